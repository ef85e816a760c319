'use strict';
// Test helpers: a real paramsyncd per test file, found as $PARAMSYNC_DAEMON
// (ctest sets it) or in the usual build folders; ranks as World objects in
// this process, or as child processes.
const assert = require('node:assert');
const { spawn } = require('child_process');
const fs = require('fs');
const os = require('os');
const path = require('path');

const REPO = path.join(__dirname, '..', '..', '..');

function daemonBinary() {
  const candidates = [process.env.PARAMSYNC_DAEMON,
    path.join(REPO, 'build', 'server', 'paramsyncd')].filter(Boolean);
  return candidates.find((p) => fs.existsSync(p));
}

/** Starts paramsyncd on a free port; resolves to { addr, stop(), log() }. */
async function startDaemon(extra = [], announce) {
  const bin = daemonBinary();
  if (!bin) return null;
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'ps-node-test-'));
  const file = announce || path.join(dir, 'addr');
  let log = '';
  const proc = spawn(bin, ['--listen', '127.0.0.1:0', '--announce-file', file,
    '--metrics-addr', 'off', ...extra], { stdio: ['ignore', 'pipe', 'pipe'] });
  proc.stdout.on('data', (d) => { log += d; });
  proc.stderr.on('data', (d) => { log += d; });
  const exited = new Promise((res) => proc.on('exit', res));
  const end = Date.now() + 30000;
  for (;;) {
    if (proc.exitCode !== null) throw new Error(`paramsyncd exited at start:\n${log}`);
    try {
      const text = fs.readFileSync(file, 'utf8');
      if (text.endsWith('\n')) {
        return {
          addr: text.trim(),
          log: () => log,
          async stop() {
            if (proc.exitCode === null) proc.kill('SIGTERM');
            await exited;
            fs.rmSync(dir, { recursive: true, force: true });
          },
        };
      }
    } catch (e) { /* not yet */ }
    if (Date.now() > end) throw new Error('paramsyncd did not start');
    await new Promise((r) => setTimeout(r, 20));
  }
}

/** Starts paramsyncd with /metrics on a free port: resolves to [daemon, metrics URL]
 * ([null] without a paramsyncd; the URL undefined if the daemon never announced it). */
async function daemonWithMetrics(extra = []) {
  const d = await startDaemon(['--metrics-addr', '127.0.0.1:0', ...extra]);
  if (!d) return [null];
  const end = Date.now() + 10000;
  while (Date.now() < end) {
    const m = /metrics on (http:\/\/\S+)/.exec(d.log());
    if (m) return [d, m[1]];
    await new Promise((r) => setTimeout(r, 20));
  }
  return [d, undefined];
}

/** The daemon's /metrics at url: a Map from each series (name and labels) to its value. */
async function scrapeMetrics(url) {
  const text = await (await fetch(url)).text();
  const series = new Map();
  for (const line of text.split('\n')) {
    if (!line || line.startsWith('#')) continue;
    const cut = line.lastIndexOf(' ');
    series.set(line.slice(0, cut), Number(line.slice(cut + 1)));
  }
  return series;
}

/** Skips test t, saying so, when there is no daemon d: true when t may go on. */
function haveDaemon(t, d) {
  if (d) return true;
  t.skip('SKIPPED: no paramsyncd (set PARAMSYNC_DAEMON or build build/server/paramsyncd)');
  return false;
}

/** Joins n ranks of one job as World objects of this process. */
async function worlds(dist, addr, job, n, extra = {}) {
  return Promise.all([...Array(n).keys()].map((rank) => dist.World.init({
    initMethod: `tcp://${addr}?job=${job}`, worldSize: n, rank, ...extra })));
}

/** For a test file whose tests share one job: a daemon and n ranks of job `job` (Worlds
 * in this process), made before its tests and stopped after. Returns { ws, daemon } (set
 * once made), need(t) (false, the test skipped, without a daemon) and all(fn): fn(world,
 * rank) for every rank at once. */
function sharedJob(test, dist, job, n) {
  const s = { ws: null, daemon: null };
  test.before(async () => {
    s.daemon = await startDaemon();
    if (s.daemon) s.ws = await worlds(dist, s.daemon.addr, job, n);
  });
  test.after(async () => {
    if (s.ws) await Promise.all(s.ws.map((w) => w.destroy()));
    if (s.daemon) await s.daemon.stop();
  });
  s.need = (t) => haveDaemon(t, s.daemon);
  s.all = (fn) => Promise.all(s.ws.map((w, r) => fn(w, r)));
  return s;
}

/** Runs `node -e code` in a child process with env; resolves to { code, stdout, stderr }. */
function runNode(code, env) {
  return new Promise((res) => {
    const p = spawn(process.execPath, ['-e', code], { env: { ...process.env, ...env },
      cwd: path.join(__dirname, '..'), stdio: ['ignore', 'pipe', 'pipe'] });
    let stdout = ''; let stderr = '';
    p.stdout.on('data', (d) => { stdout += d; });
    p.stderr.on('data', (d) => { stderr += d; });
    p.on('exit', (c) => res({ code: c, stdout, stderr }));
  });
}

/** k int32 elements that tell rank (or value) r and each index apart. */
function filled(r, k) {
  const x = new Int32Array(k);
  for (let i = 0; i < k; i++) x[i] = (r + 1) * 100000 + (i % 9973);
  return x;
}

/** The element-wise sum of filled(r, k) over the rs. */
function sumOf(rs, k) {
  const s = new Int32Array(k);
  for (const r of rs) filled(r, k).forEach((v, i) => { s[i] += v; });
  return s;
}

/**
 * One daemon with /metrics for a test file and, with job, n ranks of it as Worlds of this
 * process: registers test.before and test.after (which also forgets the PARAMSYNC_SHM*
 * switches tests set). Its daemon, url and ws are filled in before the tests run;
 * ready(t) skips t without a daemon (and, with native, fails when the native helper did
 * not load); all(fn) runs fn(world, rank) on every rank; frameBytes() resolves to the
 * payload bytes between workers and agent that went as gRPC frames so far.
 */
function fixture(test, dist, { job, n = 2, native = false } = {}) {
  const f = { daemon: null, url: undefined, ws: null };
  test.before(async () => {
    [f.daemon, f.url] = await daemonWithMetrics();
    if (f.daemon && job) f.ws = await worlds(dist, f.daemon.addr, job, n);
  });
  test.after(async () => {
    for (const k of ['PARAMSYNC_SHM', 'PARAMSYNC_SHM_DIRECT']) delete process.env[k];
    if (f.ws) await Promise.all(f.ws.map((w) => w.destroy()));
    if (f.daemon) await f.daemon.stop();
  });
  f.ready = (t) => {
    if (!haveDaemon(t, f.daemon)) return false;
    assert.ok(f.url, `the daemon announced no metrics address:\n${f.daemon.log()}`);
    assert.ok(!native || dist.hasDoorbell, 'the native helper did not load ' +
      `(PARAMSYNC_NODE_NATIVE=${process.env.PARAMSYNC_NODE_NATIVE}; build paramsync_node)`);
    return true;
  };
  f.all = (fn) => Promise.all(f.ws.map((w, r) => fn(w, r)));
  f.frameBytes = async () => {
    const m = await scrapeMetrics(f.url);
    return ['received', 'sent'].reduce((sum, d) =>
      sum + m.get(`paramsync_payload_bytes_total{direction="${d}",link="worker"}`), 0);
  };
  return f;
}

/** Starts start(world, rank) on ranks 0 and 2 of the three in ws, aborts rank 1 after ms,
 * and checks that both reject with ABORTED naming rank 1. */
async function loseRank1(ws, start, ms) {
  const waiting = [start(ws[0], 0), start(ws[2], 2)];
  setTimeout(() => ws[1].abort(), ms);
  for (const s of await Promise.allSettled(waiting)) {
    assert.strictEqual(s.status, 'rejected');
    assert.strictEqual(s.reason.codeName, 'ABORTED', String(s.reason));
    assert.match(s.reason.message, /rank 1/);
  }
}

module.exports = { startDaemon, daemonWithMetrics, scrapeMetrics, haveDaemon, worlds, sharedJob,
  runNode,
  daemonBinary, REPO, filled, sumOf, fixture, loseRank1 };
