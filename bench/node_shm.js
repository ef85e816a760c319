#!/usr/bin/env node
'use strict';
/*
 * Node.js client: gRPC frames, the shared-memory segment by call, and the
 * doorbell, side by side.
 *
 *   node bench/node_shm.js --paramsyncd BUILD/server/paramsyncd [--mib 64 | --sizes B,...]
 *                          [--np 2,4] [--iters 5] [--warmup 5]
 *                          [--ops all_reduce,broadcast,all_gather]
 *                          [--modes frames,calls,segment,doorbell,mem] [--resident BYTES]
 *
 * For each world size it starts one paramsyncd on a free loopback port (with
 * /metrics) and runs the same job once per mode: `frames` (PARAMSYNC_SHM=0: every
 * payload byte in gRPC frames), `calls` (PARAMSYNC_NODE_NATIVE=0: a Collective
 * call per collective, the payload through the segment from 64 KiB), `segment`
 * (the native helper: no call, the payload in the doorbell up to 2 KiB, else
 * through the segment; PARAMSYNC_SHM_DIRECT=0 and PARAMSYNC_PEER_COPY=0),
 * `doorbell` (the same, but from 8 MiB (32 without huge pages) the agent reads and
 * writes the arrays where they are), `peer` (that, and peer copies: large
 * all_gather and all_to_all rank to rank), `mem` (every path, the buffers from
 * dist.empty(), which the agent uses in place: input and output in one), `mem-nomap`
 * (that with PARAMSYNC_PEER_MAP=0: peer copies read empty() memory over the agent's
 * --shm-resident-bytes with process_vm_readv, not through mappings of the segments).
 * --resident gives the daemon that --shm-resident-bytes (e.g. 1M: every call over it,
 * so all_gather and all_to_all of empty() memory go by peer copies). Ops:
 * float32 all_reduce, broadcast (root 0), all_gather, all_to_all (single tensor),
 * and barrier (no size), --warmup untimed calls of each first (the first checked; V8
 * compiles the client's code over the first thousands of calls, so small sizes want
 * many), of every size (--sizes in bytes, K/M suffixes; or --mib MiB). A call's time is the slowest rank's, from a
 * barrier to its return; the table gives the median over --iters calls in µs, the
 * busbw (nccl-tests factors; an all_gather's size its output's), the first mode's
 * time over each other's, and the payload bytes the daemon counted between workers
 * and agent in each mode's whole run. Results are checked once per op and size.
 * Needs client/node/node_modules (scripts/setup runs npm ci) and, for `segment`,
 * `doorbell`, `peer` and `mem`, the built paramsync_node target.
 */
const { spawn } = require('child_process');
const fs = require('fs');
const os = require('os');
const path = require('path');

const REPO = path.join(__dirname, '..');
const OPS = ['all_reduce', 'broadcast', 'all_gather', 'all_to_all', 'barrier'];
const MODES = { frames: { PARAMSYNC_SHM: '0' }, calls: { PARAMSYNC_NODE_NATIVE: '0' },
  segment: { PARAMSYNC_SHM_DIRECT: '0', PARAMSYNC_PEER_COPY: '0' },
  doorbell: { PARAMSYNC_PEER_COPY: '0' }, peer: {}, mem: { BENCH_MEM: '1' },
  'mem-nomap': { BENCH_MEM: '1', PARAMSYNC_PEER_MAP: '0' } };

function usage(code) {
  const text = fs.readFileSync(__filename, 'utf8');
  const doc = text.slice(text.indexOf('/*') + 3, text.indexOf(' */'));
  process.stdout.write(doc.split('\n').map((l) => l.replace(/^ \*( |$)/, '')).join('\n'));
  process.exit(code);
}

function sizeOf(text) {
  const m = /^(\d+)([KkMm]?)$/.exec(text);
  if (!m) return NaN;
  return Number(m[1]) * ({ '': 1, k: 1 << 10, m: 1 << 20 })[m[2].toLowerCase()];
}

function parseArgs(argv) {
  const a = { paramsyncd: path.join(REPO, 'build', 'server', 'paramsyncd'), sizes: [64 << 20],
    np: [2, 4], iters: 5, warmup: 5, ops: OPS.slice(0, 3), modes: Object.keys(MODES) };
  const fail = (msg) => { console.error(`node_shm: ${msg} (--help)`); process.exit(2); };
  for (let i = 0; i < argv.length; i++) {
    const k = argv[i];
    const v = () => {
      if (i + 1 >= argv.length) fail(`${k} needs a value`);
      return argv[++i];
    };
    if (k === '-h' || k === '--help') usage(0);
    else if (k === '--paramsyncd') a.paramsyncd = v();
    else if (k === '--mib') a.sizes = [Number(v()) * (1 << 20)];
    else if (k === '--sizes') a.sizes = v().split(',').map(sizeOf);
    else if (k === '--np') a.np = v().split(',').map(Number);
    else if (k === '--iters') a.iters = Number(v());
    else if (k === '--warmup') a.warmup = Number(v());
    else if (k === '--ops') a.ops = v().split(',');
    else if (k === '--modes') a.modes = v().split(',');
    else if (k === '--resident') a.resident = v();
    else fail(`unknown option ${k}`);
  }
  if (a.sizes.some((b) => !(b >= 4) || b % 4) || !(a.iters >= 1) || a.np.some((p) => !(p >= 2)) ||
    !Number.isInteger(a.warmup) || a.warmup < 1) {
    fail('sizes must be multiples of 4 bytes, --iters and --warmup positive, --np at least 2');
  }
  const bad = a.ops.find((o) => !OPS.includes(o)) || a.modes.find((m) => !MODES[m]);
  if (bad) fail(`unknown op or mode ${bad}: ops ${OPS}, modes ${Object.keys(MODES)}`);
  if (!fs.existsSync(a.paramsyncd)) fail(`no paramsyncd at ${a.paramsyncd}`);
  return a;
}

// ------------------------------------------------------------------ worker

/** The index of the first element of a that is not want(k), or -1. Checked in slices with
 * the event loop let run between them: a rank whose loop is busy for seconds (hundreds of
 * MiB checked in JavaScript on a crowded machine) answers no liveness ping, and the agent
 * drops it (CLIENTS.md, "Node.js"). */
async function firstWrong(a, want) {
  const slice = 1 << 21;
  for (let at = 0; at < a.length; at += slice) {
    const end = Math.min(a.length, at + slice);
    for (let k = at; k < end; k++) if (a[k] !== want(k)) return k;
    await new Promise((res) => setImmediate(res));
  }
  return -1;
}

async function worker() {
  const dist = require(path.join(REPO, 'client', 'node'));
  const iters = Number(process.env.BENCH_ITERS);
  const warmup = Number(process.env.BENCH_WARMUP);
  const ops = process.env.BENCH_OPS.split(',');
  await dist.initProcessGroup();
  const r = dist.getRank();
  const p = dist.getWorldSize();
  const times = {};
  for (const bytes of process.env.BENCH_SIZES.split(',').map(Number)) {
    const n = bytes / 4;
    // mem: one array from empty(), the input first and the all_gather's output after it.
    const buf = process.env.BENCH_MEM === '1' ? await dist.empty(n * (p + 1))
      : new Float32Array(n * (p + 1));
    const x = buf.subarray(0, n);
    const out = buf.subarray(n);
    for (const op of ops) {
      const t = times[`${op} ${bytes}`] = [];
      for (let i = 1 - warmup; i <= iters; i++) {
        x.fill(r + 1);
        await dist.barrier();
        const t0 = process.hrtime.bigint();
        if (op === 'all_reduce') await dist.allReduce(x);
        else if (op === 'broadcast') await dist.broadcast(x, 0);
        else if (op === 'all_gather') await dist.allGatherIntoTensor(out, x);
        else if (op === 'all_to_all') await dist.allToAllSingle(out.subarray(0, n), x);
        else await dist.barrier();
        const us = Number(process.hrtime.bigint() - t0) / 1e3;
        if (i <= 0 && i > 1 - warmup) continue; // untimed
        if (i === 1 - warmup) { // untimed: checked instead
          const want = op === 'all_reduce' ? p * (p + 1) / 2 : op === 'broadcast' ? 1 : null;
          // all_to_all: block s of the output is rank s's, all s + 1 (as the all_gather's).
          const got = op === 'all_to_all' ? out.subarray(0, n) : out;
          const per = op === 'all_to_all' ? n / p : n;
          const bad = op === 'barrier' ? -1 : want !== null ? await firstWrong(x, () => want)
            : await firstWrong(got, (k) => Math.floor(k / per) + 1);
          if (bad >= 0) throw new Error(`${op} of ${bytes} bytes: element ${bad} is wrong`);
        } else {
          t.push(us);
        }
      }
    }
  }
  process.stdout.write(`RESULT ${JSON.stringify({ times, doorbell: dist.hasDoorbell })}\n`);
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

/** Runs the job's p ranks; resolves to their results, or rejects once every rank ended,
 * with each failed rank's stderr (the first to end often only says another was lost). */
async function runJob(d, p, mode, a, job) {
  const procs = [...Array(p).keys()].map((r) => new Promise((resolve, reject) => {
    const env = { ...process.env, PARAMSYNC_ADDR: d.addr, WORLD_SIZE: String(p), RANK: String(r),
      PARAMSYNC_JOB: job, BENCH_ITERS: String(a.iters), BENCH_WARMUP: String(a.warmup),
      BENCH_SIZES: a.sizes.join(','),
      BENCH_OPS: a.ops.join(','), ...MODES[mode] };
    const c = spawn(process.execPath, [__filename, '--worker'], { env,
      stdio: ['ignore', 'pipe', 'pipe'] });
    let out = '';
    let err = '';
    c.stdout.on('data', (x) => { out += x; });
    c.stderr.on('data', (x) => { err += x; });
    c.on('exit', (code) => {
      const m = /^RESULT (.*)$/m.exec(out);
      if (code !== 0 || !m) reject(new Error(`rank ${r} (${mode}) exited ${code}:\n${err}`));
      else resolve(JSON.parse(m[1]));
    });
  }));
  const ended = await Promise.allSettled(procs);
  const failed = ended.filter((x) => x.status === 'rejected');
  if (failed.length) throw new Error(failed.map((x) => x.reason.message).join('\n'));
  return ended.map((x) => x.value);
}

function median(xs) {
  const s = [...xs].sort((u, v) => u - v);
  return s[Math.floor(s.length / 2)];
}

function busFactor(op, p) {
  return op === 'all_reduce' ? 2 * (p - 1) / p
    : op === 'all_gather' || op === 'all_to_all' ? (p - 1) / p : 1;
}

function sizeText(b) {
  return b % (1 << 20) === 0 ? `${b >> 20} MiB` : b % 1024 === 0 ? `${b >> 10} KiB` : `${b} B`;
}

async function main() {
  if (process.argv[2] === '--worker') return worker();
  const a = parseArgs(process.argv.slice(2));
  if (!fs.existsSync(path.join(REPO, 'client', 'node', 'node_modules', '@grpc', 'grpc-js'))) {
    console.error('node_shm: client/node/node_modules is missing: npm ci in client/node');
    process.exit(2);
  }
  const [first, ...rest] = a.modes;
  console.log(`node_shm: float32, ${a.warmup} untimed and ${a.iters} timed calls per op and ` +
    'size, median of the ' +
    `slowest rank in µs, busbw in GB/s (node ${process.version}, ${os.cpus().length} cpus)`);
  console.log(`| op | p | size | ${a.modes.map((m) => `${m} µs`).join(' | ')} | ` +
    `${a.modes.map((m) => `${m} busbw`).join(' | ')} | ` +
    `${rest.map((m) => `${first} / ${m}`).join(' | ')} |`);
  console.log(`|${' --- |'.repeat(3 + 2 * a.modes.length + rest.length)}`);
  const moved = [];
  for (const p of a.np) {
    process.env.PARAMSYNC_DAEMON = a.paramsyncd; // which binary helpers start
    const [d, metrics] = await helpers.daemonWithMetrics(a.resident === undefined ? []
      : ['--shm-resident-bytes', a.resident]);
    if (!metrics) throw new Error(`paramsyncd announced no metrics address:\n${d.log()}`);
    try {
      const res = {};
      for (const m of a.modes) {
        process.stderr.write(`node_shm: p=${p} ${m} ...\n`);
        const before = await payloadBytes(metrics);
        const ranks = await runJob(d, p, m, a, `node-bench-${p}-${m}`);
        if (!['frames', 'calls'].includes(m) && !ranks[0].doorbell) {
          throw new Error('the native helper did not load: build the paramsync_node target');
        }
        moved.push(`p=${p} ${m} ${(await payloadBytes(metrics)) - before}`);
        res[m] = {};
        for (const key of Object.keys(ranks[0].times)) {
          const slowest = ranks[0].times[key].map((_, i) =>
            Math.max(...ranks.map((x) => x.times[key][i])));
          res[m][key] = median(slowest);
        }
      }
      for (const bytes of a.sizes) {
        for (const op of a.ops) {
          if (op === 'barrier' && bytes !== a.sizes[0]) continue;
          const key = `${op} ${bytes}`;
          const us = a.modes.map((m) => res[m][key]);
          const size = op === 'all_gather' ? bytes * p : bytes;
          const bw = (t) => (op === 'barrier' ? '-' : (size / (t * 1e3) * busFactor(op, p))
            .toFixed(size >= 1 << 20 ? 2 : 4));
          console.log(`| ${op} | ${p} | ${op === 'barrier' ? '-' : sizeText(bytes)} | ` +
            `${us.map((t) => t.toFixed(0)).join(' | ')} | ${us.map(bw).join(' | ')} | ` +
            `${us.slice(1).map((t) => `${(us[0] / t).toFixed(2)}×`).join(' | ')} |`);
        }
      }
    } finally {
      await d.stop();
    }
  }
  console.log(`payload bytes the daemon counted as gRPC frames: ${moved.join(', ')}`);
  return undefined;
}

main().catch((e) => { console.error(`node_shm: ${e.message}`); process.exit(1); });
