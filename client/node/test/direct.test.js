'use strict';
// Large collectives from the worker's own buffers: the agent reads and writes them where
// they are (the process segment), so no payload segment is made and no byte goes as a
// frame; below the floor, with PARAMSYNC_SHM_DIRECT=0, or refused, the segment as before.
const test = require('node:test');
const assert = require('node:assert');
const dist = require('..');
const { worlds, filled, sumOf, fixture, loseRank1 } = require('./helpers');

const N = 2;
const K = 4 << 20; // 16 MiB of int32: in place once, or input and output, past either floor
const f = fixture(test, dist, { native: true });
// The all_gather and all_to_all below would go rank to rank by peer copies (peer.test.js);
// here they are to reach the agent. Read at each World's join.
process.env.PARAMSYNC_PEER_COPY = '0';
const ready = f.ready;
const frameBytes = () => f.frameBytes();

/** A job of N ranks in this process for fn(ws, all); destroyed after. */
async function job(name, fn) {
  const ws = await worlds(dist, f.daemon.addr, name, N);
  try {
    await fn(ws, (g) => Promise.all(ws.map((w, r) => g(w, r))));
  } finally {
    await Promise.all(ws.map((w) => w.destroy()));
  }
}

test('large collectives of plain arrays: read and written in place, nothing copied',
  async (t) => {
    if (!ready(t)) return;
    await job('node-direct', async (ws, all) => {
      const frames = await frameBytes();
      for (let round = 0; round < 2; round++) { // the second asks for huge pages
        const xs = ws.map((_, r) => filled(r, K));
        await all((w, r) => w.allReduce(xs[r]));
        const want = sumOf([0, 1], K);
        xs.forEach((x) => assert.deepStrictEqual(x, want));
      }
      // A list form (all_gather into a list) and a single output (all_to_all_single).
      const outs = ws.map(() => [new Int32Array(K / 2), new Int32Array(K / 2)]);
      await all((w, r) => w.allGather(outs[r], filled(r, K / 2)));
      outs.forEach((l) => l.forEach((x, j) => assert.deepStrictEqual(x, filled(j, K / 2))));
      const a2a = ws.map(() => new Int32Array(K));
      await all((w, r) => w.allToAllSingle(a2a[r], filled(r, K)));
      a2a.forEach((x, r) => [0, 1].forEach((s) => assert.deepStrictEqual(
        x.subarray(s * K / 2, (s + 1) * K / 2), filled(s, K).subarray(r * K / 2, (r + 1) * K / 2))));
      assert.strictEqual(await frameBytes(), frames, 'payload went as gRPC frames');
      ws.forEach((w) => {
        assert.strictEqual(w.proc.used, 4, `${w.proc.used} direct: ${w.proc.refused}`);
        assert.strictEqual(w.shm.fd, null, 'a payload segment was made: something was copied');
      });
    });
  });

test('below the floor, PARAMSYNC_SHM_DIRECT=0, or an agent that refuses: the segment',
  async (t) => {
    if (!ready(t)) return;
    await job('node-direct-off', async (ws, all) => {
      const small = ws.map((_, r) => filled(r, 1 << 18)); // 1 MiB
      await all((w, r) => w.allReduce(small[r]));
      small.forEach((x) => assert.deepStrictEqual(x, sumOf([0, 1], 1 << 18)));
      process.env.PARAMSYNC_SHM_DIRECT = '0';
      const xs = ws.map((_, r) => filled(r, K));
      try {
        await all((w, r) => w.allReduce(xs[r], { op: dist.ReduceOp.MAX }));
      } finally {
        delete process.env.PARAMSYNC_SHM_DIRECT;
      }
      xs.forEach((x) => assert.deepStrictEqual(x, filled(1, K)));
      ws.forEach((w) => {
        assert.strictEqual(w.proc.used, 0);
        assert.notStrictEqual(w.shm.fd, null, 'the payload segment was not used');
      });
    });
    await job('node-direct-refused', async (ws, all) => {
      ws.forEach((w) => {
        w.proc.attach = () => Promise.reject(new Error('injected: ptrace not permitted'));
      });
      for (let i = 0; i < 2; i++) {
        const xs = ws.map((_, r) => filled(r, K));
        await all((w, r) => w.allReduce(xs[r], { op: dist.ReduceOp.MIN }));
        xs.forEach((x) => assert.deepStrictEqual(x, filled(0, K)));
      }
      ws.forEach((w) => {
        assert.ok(w.proc.disabled && /injected/.test(w.proc.refused), w.proc.refused);
        assert.strictEqual(w.proc.used, 0);
      });
    });
  });

test('a rank lost during a direct collective: ABORTED naming it, the doorbell kept',
  async (t) => {
    if (!ready(t)) return;
    const ws = await worlds(dist, f.daemon.addr, 'node-direct-lost', 3);
    try {
      const xs = ws.map((_, r) => filled(r, K));
      await loseRank1(ws, (w, r) => w.allReduce(xs[r]), 300);
      [0, 2].forEach((r) => {
        assert.strictEqual(ws[r].proc.used, 1, 'not direct');
        // The agent answered (it may write into this process until it does), so the
        // doorbell was not abandoned.
        assert.ok(!ws[r].doorbells.all[0].disabled, 'the doorbell was retired');
      });
    } finally {
      await Promise.all([ws[0].destroy(), ws[2].destroy()]);
    }
  });
