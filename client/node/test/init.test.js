'use strict';
// Init methods and the module-level API (torch's style: one default group per
// process), with each rank a separate node process.
const test = require('node:test');
const assert = require('node:assert');
const fs = require('fs');
const os = require('os');
const path = require('path');
const { startDaemon, haveDaemon, runNode, daemonBinary } = require('./helpers');

const WORKER = `
const dist = require('.');
(async () => {
  await dist.initProcessGroup(process.env.INIT ? { backend: 'paramsync', initMethod: process.env.INIT }
    : 'paramsync');
  const r = dist.getRank();
  const x = new Float64Array([r + 1, 10]);
  await dist.all_reduce(x, { op: dist.ReduceOp.SUM });
  const g = [0, 1].map(() => new Int32Array(1));
  await dist.allGather(g, Int32Array.from([r * 7]));
  console.log(JSON.stringify({ rank: r, size: dist.getWorldSize(), x: [...x], g: g.map((t) => t[0]),
    init: dist.isInitialized() }));
  await dist.destroyProcessGroup();
  console.log(JSON.stringify({ after: dist.isInitialized() }));
})().catch((e) => { console.error(e); process.exit(1); });
`;

async function pair(envs) {
  const res = await Promise.all(envs.map((env) => runNode(WORKER, env)));
  for (const r of res) assert.strictEqual(r.code, 0, r.stderr);
  return res.map((r) => r.stdout.trim().split('\n').map((l) => JSON.parse(l)));
}

function check(outs) {
  const ranks = outs.map((o) => o[0].rank).sort();
  assert.deepStrictEqual(ranks, [0, 1]);
  for (const [o, after] of outs) {
    assert.deepStrictEqual(o.x, [3, 20]);
    assert.deepStrictEqual(o.g, [0, 7]);
    assert.strictEqual(o.size, 2);
    assert.strictEqual(o.init, true);
    assert.strictEqual(after.after, false);
  }
}

const clean = { PARAMSYNC_ADDR: '', MASTER_ADDR: '', MASTER_PORT: '', RANK: '', WORLD_SIZE: '',
  PARAMSYNC_JOB: '', INIT: '' };

test('env:// with PARAMSYNC_ADDR, and with MASTER_ADDR/MASTER_PORT', async (t) => {
  const d = await startDaemon();
  if (!haveDaemon(t, d)) return;
  try {
    check(await pair([0, 1].map((r) => ({ ...clean, PARAMSYNC_ADDR: d.addr, WORLD_SIZE: '2',
      RANK: String(r), PARAMSYNC_JOB: 'node-env' }))));
    const [host, port] = d.addr.split(':');
    check(await pair([0, 1].map((r) => ({ ...clean, MASTER_ADDR: host, MASTER_PORT: port,
      WORLD_SIZE: '2', RANK: String(r), PARAMSYNC_JOB: 'node-master' }))));
  } finally {
    await d.stop();
  }
});

test('tcp:// with ranks assigned by the daemon', async (t) => {
  const d = await startDaemon();
  if (!haveDaemon(t, d)) return;
  try {
    check(await pair([0, 1].map(() => ({ ...clean,
      INIT: `tcp://${d.addr}?job=node-tcp&world_size=2` }))));
  } finally {
    await d.stop();
  }
});

test('file:// waits for the daemon to announce itself', async (t) => {
  if (!haveDaemon(t, daemonBinary())) return;
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'ps-node-file-'));
  const file = path.join(dir, 'shared');
  const workers = pair([0, 1].map((r) => ({ ...clean, INIT: `file://${file}?world_size=2&rank=${r}` })));
  await new Promise((r) => setTimeout(r, 500));
  const d = await startDaemon([], file);
  try {
    check(await workers);
  } finally {
    await d.stop();
    fs.rmSync(dir, { recursive: true, force: true });
  }
});

test('errors before a daemon is involved', async () => {
  const dist = require('..');
  await assert.rejects(dist.allReduce(new Float32Array(1)), /not been initialized/);
  await assert.rejects(dist.initProcessGroup('gloo'), /'paramsync' backend/);
  await assert.rejects(dist.initProcessGroup({ initMethod: 'bogus://x' }), RangeError);
  for (const bad of ['-1', '1G']) {
    process.env.PARAMSYNC_SCRATCH_BYTES = bad;
    await assert.rejects(dist.initProcessGroup({ worldSize: 1 }),
      { name: 'RangeError', message: /PARAMSYNC_SCRATCH_BYTES/ });
    delete process.env.PARAMSYNC_SCRATCH_BYTES;
  }
  const saved = { ...process.env };
  delete process.env.PARAMSYNC_ADDR;
  delete process.env.MASTER_ADDR;
  await assert.rejects(dist.initProcessGroup({ worldSize: 1 }), /MASTER_ADDR/);
  process.env = saved;
  assert.strictEqual(dist.isInitialized(), false);
});
