#!/usr/bin/env node
'use strict';
/*
 * Node.js client: gRPC frames against the shared-memory segment, side by side.
 *
 *   node bench/node_shm.js --paramsyncd BUILD/server/paramsyncd [--mib 64] [--np 2,4]
 *                          [--iters 5]
 *
 * For each world size it starts one paramsyncd on a free loopback port (with
 * /metrics) and runs the same job twice, PARAMSYNC_SHM=0 and shared memory on:
 * float32 all_reduce, broadcast (root 0) and all_gather of --mib MiB per rank,
 * one untimed call of each first. A call's time is the slowest rank's, from a
 * barrier to its return; the table gives the median over --iters calls, the
 * busbw (nccl-tests factors), shm's speed-up, and the payload bytes the daemon
 * counted between workers and agent over the whole run (so the shm rows show
 * that the payload did not travel as frames). Results are checked once per
 * operation. Needs client/node/node_modules (scripts/setup runs npm ci).
 */
const { spawn } = require('child_process');
const fs = require('fs');
const os = require('os');
const path = require('path');

const REPO = path.join(__dirname, '..');
const OPS = ['all_reduce', 'broadcast', 'all_gather'];

function usage(code) {
  const text = fs.readFileSync(__filename, 'utf8');
  const doc = text.slice(text.indexOf('/*') + 3, text.indexOf(' */'));
  process.stdout.write(doc.split('\n').map((l) => l.replace(/^ \*( |$)/, '')).join('\n'));
  process.exit(code);
}

function parseArgs(argv) {
  const a = { paramsyncd: path.join(REPO, 'build', 'server', 'paramsyncd'), mib: 64,
    np: [2, 4], iters: 5 };
  for (let i = 0; i < argv.length; i++) {
    const k = argv[i];
    const v = () => {
      if (i + 1 >= argv.length) { console.error(`node_shm: ${k} needs a value`); process.exit(2); }
      return argv[++i];
    };
    if (k === '-h' || k === '--help') usage(0);
    else if (k === '--paramsyncd') a.paramsyncd = v();
    else if (k === '--mib') a.mib = Number(v());
    else if (k === '--np') a.np = v().split(',').map(Number);
    else if (k === '--iters') a.iters = Number(v());
    else { console.error(`node_shm: unknown option ${k} (--help)`); process.exit(2); }
  }
  if (!(a.mib > 0) || !(a.iters >= 1) || a.np.some((p) => !(p >= 2))) {
    console.error('node_shm: --mib and --iters must be positive, --np at least 2');
    process.exit(2);
  }
  if (!fs.existsSync(a.paramsyncd)) {
    console.error(`node_shm: no paramsyncd at ${a.paramsyncd} (--paramsyncd)`);
    process.exit(2);
  }
  return a;
}

// ------------------------------------------------------------------ worker

async function worker() {
  const dist = require(path.join(REPO, 'client', 'node'));
  const iters = Number(process.env.BENCH_ITERS);
  const n = Number(process.env.BENCH_MIB) * (1 << 20) / 4;
  await dist.initProcessGroup();
  const r = dist.getRank();
  const p = dist.getWorldSize();
  const x = new Float32Array(n);
  const out = new Float32Array(n * p);
  const times = {};
  for (const op of OPS) {
    times[op] = [];
    for (let i = 0; i <= iters; i++) {
      x.fill(r + 1);
      await dist.barrier();
      const t0 = process.hrtime.bigint();
      if (op === 'all_reduce') await dist.allReduce(x);
      else if (op === 'broadcast') await dist.broadcast(x, 0);
      else await dist.allGatherIntoTensor(out, x);
      const us = Number(process.hrtime.bigint() - t0) / 1e3;
      if (i === 0) { // untimed: checked instead
        const want = op === 'all_reduce' ? p * (p + 1) / 2 : op === 'broadcast' ? 1 : null;
        const bad = want !== null ? x.findIndex((v) => v !== want)
          : out.findIndex((v, k) => v !== Math.floor(k / n) + 1);
        if (bad >= 0) throw new Error(`${op}: element ${bad} is wrong`);
      } else {
        times[op].push(us);
      }
    }
  }
  process.stdout.write(`RESULT ${JSON.stringify(times)}\n`);
  await dist.destroyProcessGroup();
}

// ------------------------------------------------------------------ driver

// The Node client tests' daemon launcher and /metrics reader (client/node/test/helpers.js).
const helpers = require(path.join(REPO, 'client', 'node', 'test', 'helpers'));

/** Payload bytes between workers and agent as gRPC frames so far, both directions. */
async function payloadBytes(url) {
  let sum = 0;
  for (const [series, v] of await helpers.scrapeMetrics(url)) {
    if (series.startsWith('paramsync_payload_bytes_total{') && series.includes('link="worker"')) {
      sum += v;
    }
  }
  return sum;
}

function runJob(d, p, transport, a, job) {
  const procs = [...Array(p).keys()].map((r) => new Promise((resolve, reject) => {
    const env = { ...process.env, PARAMSYNC_ADDR: d.addr, WORLD_SIZE: String(p), RANK: String(r),
      PARAMSYNC_JOB: job, PARAMSYNC_SHM: transport === 'shm' ? '1' : '0',
      BENCH_ITERS: String(a.iters), BENCH_MIB: String(a.mib) };
    const c = spawn(process.execPath, [__filename, '--worker'], { env,
      stdio: ['ignore', 'pipe', 'pipe'] });
    let out = '';
    let err = '';
    c.stdout.on('data', (x) => { out += x; });
    c.stderr.on('data', (x) => { err += x; });
    c.on('exit', (code) => {
      const m = /^RESULT (.*)$/m.exec(out);
      if (code !== 0 || !m) reject(new Error(`rank ${r} (${transport}) exited ${code}:\n${err}`));
      else resolve(JSON.parse(m[1]));
    });
  }));
  return Promise.all(procs);
}

function median(xs) {
  const s = [...xs].sort((u, v) => u - v);
  return s[Math.floor(s.length / 2)];
}

function busFactor(op, p) {
  return op === 'all_reduce' ? 2 * (p - 1) / p : op === 'all_gather' ? (p - 1) / p : 1;
}

async function main() {
  if (process.argv[2] === '--worker') return worker();
  const a = parseArgs(process.argv.slice(2));
  if (!fs.existsSync(path.join(REPO, 'client', 'node', 'node_modules', '@grpc', 'grpc-js'))) {
    console.error('node_shm: client/node/node_modules is missing: npm ci in client/node');
    process.exit(2);
  }
  const bytes = a.mib * (1 << 20);
  console.log(`node_shm: ${a.mib} MiB float32, ${a.iters} timed calls per op, ` +
    `median of the slowest rank (node ${process.version}, ${os.cpus().length} cpus)`);
  console.log('| op | p | frames µs | shm µs | frames busbw GB/s | shm busbw GB/s |' +
    ' shm / frames | payload bytes as frames (frames / shm run) |');
  console.log('| --- | --- | --- | --- | --- | --- | --- | --- |');
  for (const p of a.np) {
    process.env.PARAMSYNC_DAEMON = a.paramsyncd; // which binary helpers start
    const [d, metrics] = await helpers.daemonWithMetrics();
    if (!metrics) throw new Error(`paramsyncd announced no metrics address:\n${d.log()}`);
    try {
      const res = {};
      const moved = {};
      for (const t of ['grpc', 'shm']) {
        process.stderr.write(`node_shm: p=${p} ${t} ...\n`);
        const before = await payloadBytes(metrics);
        const ranks = await runJob(d, p, t, a, `node-bench-${p}-${t}`);
        moved[t] = (await payloadBytes(metrics)) - before;
        res[t] = {};
        for (const op of OPS) {
          const slowest = ranks[0][op].map((_, i) => Math.max(...ranks.map((x) => x[op][i])));
          res[t][op] = median(slowest);
        }
      }
      for (const op of OPS) {
        const g = res.grpc[op];
        const s = res.shm[op];
        // nccl-tests: an all_gather's size is its output's.
        const size = op === 'all_gather' ? bytes * p : bytes;
        const bw = (us) => (size / (us * 1e3) * busFactor(op, p)).toFixed(2);
        console.log(`| ${op} | ${p} | ${g.toFixed(0)} | ${s.toFixed(0)} | ${bw(g)} | ${bw(s)} | ` +
          `${(g / s).toFixed(2)}× | ${moved.grpc} / ${moved.shm} |`);
      }
    } finally {
      await d.stop();
    }
  }
  return undefined;
}

main().catch((e) => { console.error(`node_shm: ${e.message}`); process.exit(1); });
