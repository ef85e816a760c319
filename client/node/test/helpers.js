'use strict';
// Test helpers: a real paramsyncd per test file, found as $PARAMSYNC_DAEMON
// (ctest sets it) or in the usual build folders; ranks as World objects in
// this process, or as child processes.
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

module.exports = { startDaemon, daemonWithMetrics, scrapeMetrics, haveDaemon, worlds, runNode,
  daemonBinary, REPO };
