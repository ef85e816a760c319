'use strict';
// Memory from empty(): the agent reads and writes it in place. The daemon's /metrics
// says no payload byte went as frames, and the World's payload segment is never made,
// so nothing was copied through it; every element checked.
const test = require('node:test');
const assert = require('node:assert');
const dist = require('..');
const { filled, sumOf, fixture, scrapeMetrics } = require('./helpers');

const N = 2;
const f = fixture(test, dist, { job: 'node-mem', n: N, native: true });
const ready = f.ready;
const all = (fn) => f.all(fn);
const frameBytes = () => f.frameBytes();

/** Fills x as helpers' filled(r, x.length). */
const fill = (x, r) => x.set(filled(r, x.length));

test('empty(): typed arrays of every dtype, zeroed, each a segment the agent keeps',
  async (t) => {
    if (!ready(t)) return;
    const kinds = { float32: Float32Array, float64: Float64Array, int8: Int8Array,
      uint8: Uint8Array, int16: Int16Array, int32: Int32Array, int64: BigInt64Array,
      float16: Uint16Array, bfloat16: Uint16Array, bool: Uint8Array };
    for (const [name, Kind] of Object.entries(kinds)) {
      const x = await f.ws[0].empty(1000, name);
      assert.ok(x instanceof Kind, `${name}: ${x.constructor.name}`);
      assert.strictEqual(x.length, 1000);
      assert.ok(x.every((v) => v === 0 || v === 0n), `${name} not zeroed`);
      const mem = f.ws[0].mem.mems.find((m) => m.ab === x.buffer);
      assert.ok(mem && mem.name, `${name}: not a registered segment`);
      await f.ws[0].free(x);
    }
    await assert.rejects(f.ws[0].empty(4, 'complex64'), TypeError);
    await assert.rejects(f.ws[0].empty(-1), RangeError);
    await assert.rejects(f.ws[0].empty(1.5), RangeError);
    await assert.rejects(f.ws[0].free(new Float32Array(4)), RangeError);
  });

test('collectives on empty() memory: in place, no frame, no payload segment', async (t) => {
  if (!ready(t)) return;
  const k = 300001; // 1.2 MB
  const frames = await frameBytes();
  const rung = f.ws.map((w) => w.doorbellRung);
  // all_reduce in place.
  const xs = await all((w) => w.empty(k, 'int32'));
  xs.forEach(fill);
  await all((w, r) => w.allReduce(xs[r]));
  const sum = sumOf([0, 1], k);
  xs.forEach((x) => assert.deepStrictEqual(x, sum));
  // all_gather, input and output in one array: [input | output of N blocks].
  const ag = await all((w) => w.empty(k * (N + 1), 'int32'));
  ag.forEach((x, r) => fill(x.subarray(0, k), r));
  await all((w, r) => w.allGatherIntoTensor(ag[r].subarray(k), ag[r].subarray(0, k)));
  ag.forEach((x) => [0, 1].forEach((j) =>
    assert.deepStrictEqual(x.subarray(k * (j + 1), k * (j + 2)), filled(j, k))));
  // broadcast from rank 1, reduce (MAX) to rank 0, reduce_scatter, all_to_all.
  const b = await all((w) => w.empty(k, 'int32'));
  fill(b[1], 5);
  await all((w, r) => w.broadcast(b[r], 1));
  b.forEach((x) => assert.deepStrictEqual(x, filled(5, k)));
  const red = await all((w) => w.empty(k, 'int32'));
  red.forEach(fill);
  await all((w, r) => w.reduce(red[r], 0, { op: dist.ReduceOp.MAX }));
  assert.deepStrictEqual(red[0], filled(1, k));
  assert.deepStrictEqual(red[1], filled(1, k));
  const rs = await all((w) => w.empty(3 * k, 'int32')); // [input of 2 blocks | output]
  rs.forEach((x, r) => { fill(x.subarray(0, k), r); fill(x.subarray(k, 2 * k), r + 2); });
  await all((w, r) => w.reduceScatterTensor(rs[r].subarray(2 * k), rs[r].subarray(0, 2 * k)));
  // Rank 0's blocks are f0, f2; rank 1's f1, f3: block r summed over the ranks.
  rs.forEach((x, r) => assert.deepStrictEqual(x.subarray(2 * k), sumOf([2 * r, 2 * r + 1], k)));
  const a2a = await all((w) => w.empty(4 * k, 'int32')); // [input 2 blocks | output]
  a2a.forEach((x, r) => { fill(x.subarray(0, k), 10 * r); fill(x.subarray(k, 2 * k), 10 * r + 1); });
  await all((w, r) => w.allToAllSingle(a2a[r].subarray(2 * k), a2a[r].subarray(0, 2 * k)));
  a2a.forEach((x, r) => [0, 1].forEach((s) =>
    assert.deepStrictEqual(x.subarray(2 * k + s * k, 2 * k + (s + 1) * k), filled(10 * s + r, k))));
  // reduce_scatter with input and output in two arrays from empty(): the agent writes the
  // output into its own allocation (header.shm_out).
  const two = () => f.url && scrapeMetrics(f.url).then((m) =>
    m.get('paramsync_shm_calls_total{segments="registered_two"}'));
  const twoBefore = await two();
  const rsIn = await all((w) => w.empty(2 * k, 'int32'));
  const rsOut = await all((w) => w.empty(k, 'int32'));
  rsIn.forEach((x, r) => { fill(x.subarray(0, k), r + 4); fill(x.subarray(k), r + 6); });
  await all((w, r) => w.reduceScatterTensor(rsOut[r], rsIn[r]));
  rsOut.forEach((x, r) => assert.deepStrictEqual(x, sumOf([2 * r + 4, 2 * r + 5], k)));
  assert.strictEqual(await two() - twoBefore, N, 'reduce_scatter from two arrays in place');
  assert.strictEqual(await frameBytes(), frames, 'payload went as gRPC frames');
  f.ws.forEach((w, r) => {
    assert.strictEqual(w.shm.fd, null, 'the payload segment was made: something was copied');
    // Seven collectives, and the descriptors the all_to_all exchanged first (it is large
    // enough for peer copies, whose descriptors say empty() memory goes to the agent).
    assert.strictEqual(w.doorbellRung - rung[r], 8, 'each through the doorbell');
  });
});

test('PARAMSYNC_SHM=0, an array beside plain memory, or a second collective on a busy ' +
  'array: copies, same results', async (t) => {
  if (!ready(t)) return;
  const k = 100000;
  // PARAMSYNC_SHM=0: frames, though the array is the agent's.
  const xs = await all((w) => w.empty(k, 'int32'));
  xs.forEach(fill);
  process.env.PARAMSYNC_SHM = '0';
  let frames = await frameBytes();
  try {
    await all((w, r) => w.allReduce(xs[r]));
  } finally {
    delete process.env.PARAMSYNC_SHM;
  }
  xs.forEach((x) => assert.deepStrictEqual(x, sumOf([0, 1], k)));
  assert.strictEqual(await frameBytes() - frames, 2 * N * 4 * k);
  // Input from empty(), output plain memory: through the payload segment.
  frames = await frameBytes();
  const ins = await all((w) => w.empty(k, 'int32'));
  const outs = f.ws.map(() => new Int32Array(N * k));
  ins.forEach(fill);
  await all((w, r) => w.allGatherIntoTensor(outs[r], ins[r]));
  outs.forEach((o) => [0, 1].forEach((j) =>
    assert.deepStrictEqual(o.subarray(j * k, (j + 1) * k), filled(j, k))));
  assert.strictEqual(await frameBytes(), frames);
  f.ws.forEach((w) => assert.notStrictEqual(w.shm.fd, null, 'no payload segment was used'));
  // Two collectives on one array at once: the second cannot have it, and copies.
  const one = await all((w) => w.empty(2 * k, 'int32'));
  one.forEach((x, r) => { fill(x.subarray(0, k), r); fill(x.subarray(k), r + 2); });
  await all((w, r) => Promise.all([w.allReduce(one[r].subarray(0, k)),
    w.allReduce(one[r].subarray(k), { op: dist.ReduceOp.MAX })]));
  one.forEach((x) => {
    assert.deepStrictEqual(x.subarray(0, k), sumOf([0, 1], k));
    assert.deepStrictEqual(x.subarray(k), filled(3, k));
  });
});

test('empty() memory by call (no doorbell free) and after free(): still right', async (t) => {
  if (!ready(t)) return;
  const k = 50000;
  const xs = await all((w) => w.empty(k, 'float64'));
  xs.forEach((x, r) => x.fill(r + 0.5));
  const begin = f.ws.map((w) => w.doorbells.begin);
  f.ws.forEach((w) => { w.doorbells.begin = async () => null; });
  const frames = await frameBytes();
  const rung = f.ws.map((w) => w.doorbellRung);
  try {
    await all((w, r) => w.allReduce(xs[r], { op: dist.ReduceOp.PRODUCT }));
  } finally {
    f.ws.forEach((w, r) => { w.doorbells.begin = begin[r]; });
  }
  xs.forEach((x) => assert.ok(x.every((v) => v === 0.75), 'product of 0.5 and 1.5'));
  assert.strictEqual(await frameBytes(), frames, 'a call on empty() memory sent frames');
  assert.deepStrictEqual(f.ws.map((w) => w.doorbellRung), rung);
  // Freed: plain memory now, which collectives copy; freeing again is an error.
  await all((w, r) => w.free(xs[r]));
  await all((w, r) => w.allReduce(xs[r]));
  xs.forEach((x) => assert.ok(x.every((v) => v === 1.5)));
  await assert.rejects(f.ws[0].free(xs[0]), RangeError);
});
