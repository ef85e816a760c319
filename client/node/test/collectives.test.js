'use strict';
// Every collective, several dtypes and every reduce op, with 3 ranks of one job
// living in this process (each a World with its own channel and Join stream).
const test = require('node:test');
const assert = require('node:assert');
const dist = require('..');
const { sharedJob, worlds } = require('./helpers');

const N = 3;
const job = sharedJob(test, dist, 'node-collectives', N);
const needDaemon = job.need;

// Every rank calls fn(world, rank) at once; resolves to their results.
const all = job.all;

const TYPES = {
  float32: Float32Array, float64: Float64Array, int8: Int8Array, uint8: Uint8Array,
  int16: Int16Array, int32: Int32Array, int64: BigInt64Array,
};

function input(dtype, r, n = 5) {
  const C = TYPES[dtype];
  const out = new C(n);
  for (let i = 0; i < n; i++) {
    let v = ((r + 1) * (i + 3)) % 7 + 1;
    if (dtype.startsWith('int') && r % 2) v = -v;
    out[i] = dtype === 'int64' ? BigInt(v) : v;
  }
  return out;
}

function reference(dtype, op, arrays) {
  const C = TYPES[dtype];
  const n = arrays[0].length;
  const out = new C(n);
  for (let i = 0; i < n; i++) {
    const vals = arrays.map((a) => a[i]);
    let acc;
    switch (op) {
      case 'SUM': acc = vals.reduce((x, y) => x + y); break;
      case 'PRODUCT': acc = vals.reduce((x, y) => x * y); break;
      case 'MIN': acc = vals.reduce((x, y) => (y < x ? y : x)); break;
      case 'MAX': acc = vals.reduce((x, y) => (y > x ? y : x)); break;
      case 'BAND': acc = vals.reduce((x, y) => x & y); break;
      case 'BOR': acc = vals.reduce((x, y) => x | y); break;
      case 'BXOR': acc = vals.reduce((x, y) => x ^ y); break;
      case 'AVG': acc = vals.reduce((x, y) => x + y) / vals.length; break;
      default: throw new Error(op);
    }
    out[i] = acc; // the typed array wraps integers like torch
  }
  return out;
}

test('allReduce: every dtype and every op it has', async (t) => {
  if (!needDaemon(t)) return;
  let checked = 0;
  for (const dtype of Object.keys(TYPES)) {
    const floating = dtype.startsWith('float');
    const ops = floating ? ['SUM', 'PRODUCT', 'MIN', 'MAX', 'AVG']
      : ['SUM', 'PRODUCT', 'MIN', 'MAX', 'BAND', 'BOR', 'BXOR'];
    for (const op of ops) {
      const xs = job.ws.map((_, r) => (op === 'AVG'
        ? TYPES[dtype].from([0, 1, 2, 3, 4], (i) => i + 3 * r) : input(dtype, r)));
      const want = reference(dtype, op, xs.map((x) => x.slice()));
      const res = await all((w, r) => w.allReduce(xs[r], { op: dist.ReduceOp[op] }));
      for (let r = 0; r < N; r++) {
        assert.strictEqual(res[r], xs[r], 'resolves to the tensor');
        assert.deepStrictEqual(xs[r], want, `allReduce ${dtype} ${op} rank ${r}`);
      }
      checked++;
    }
  }
  assert.strictEqual(checked, 2 * 5 + 5 * 7);
});

test('allReduce: float16, bfloat16 (Uint16Array) and bool (Uint8Array)', async (t) => {
  if (!needDaemon(t)) return;
  // float16 1, 2, 3 = 0x3c00, 0x4000, 0x4200; sum of ranks' (r+1) = 6 = 0x4600.
  const h = job.ws.map((_, r) => new Uint16Array([[0x3c00, 0x4000, 0x4200][r], 0x3c00]));
  await all((w, r) => w.allReduce(h[r], { dtype: 'float16' }));
  h.forEach((x) => assert.deepStrictEqual([...x], [0x4600, 0x4200]));
  // bfloat16 1, 2, 3 = 0x3f80, 0x4000, 0x4040; max = 3.
  const b = job.ws.map((_, r) => new Uint16Array([[0x3f80, 0x4000, 0x4040][r]]));
  await all((w, r) => w.allReduce(b[r], { dtype: 'bfloat16', op: dist.ReduceOp.MAX }));
  b.forEach((x) => assert.deepStrictEqual([...x], [0x4040]));
  const bools = job.ws.map((_, r) => Uint8Array.from([r === 1, 0, 1]));
  await all((w, r) => w.allReduce(bools[r], { dtype: 'bool', op: dist.ReduceOp.BOR }));
  bools.forEach((x) => assert.deepStrictEqual([...x], [1, 0, 1]));
});

test('allReduce: many frames, in place on a view of a larger buffer', async (t) => {
  if (!needDaemon(t)) return;
  const n = 700001; // > 2 MiB of float32, not a multiple of the frame size
  const backing = job.ws.map(() => new ArrayBuffer(4 * (n + 8)));
  const xs = job.ws.map((_, r) => {
    const x = new Float32Array(backing[r], 16, n);
    x.fill(r + 1);
    x[n - 1] = r;
    return x;
  });
  await all((w, r) => w.allReduce(xs[r]));
  for (const x of xs) {
    assert.strictEqual(x[0], 6);
    assert.strictEqual(x[n - 2], 6);
    assert.strictEqual(x[n - 1], 3);
  }
  // The bytes around the view are untouched.
  backing.forEach((b) => assert.deepStrictEqual([...new Float32Array(b, 0, 4)], [0, 0, 0, 0]));
});

test('broadcast and reduce from every root', async (t) => {
  if (!needDaemon(t)) return;
  for (let root = 0; root < N; root++) {
    const xs = job.ws.map((_, r) => new BigInt64Array([BigInt(r * 10), -1n]));
    await all((w, r) => w.broadcast(xs[r], root));
    xs.forEach((x) => assert.deepStrictEqual([...x], [BigInt(root * 10), -1n]));
    const ys = job.ws.map((_, r) => Int32Array.from([r + 1, r]));
    await all((w, r) => w.reduce(ys[r], root, { op: dist.ReduceOp.SUM }));
    ys.forEach((y, r) => assert.deepStrictEqual([...y], r === root ? [6, 3] : [r + 1, r],
      `reduce to ${root}, rank ${r}`));
  }
});

test('allGather, gather and scatter', async (t) => {
  if (!needDaemon(t)) return;
  const lists = job.ws.map(() => [0, 1, 2].map(() => new Float64Array(2)));
  await all((w, r) => w.allGather(lists[r], Float64Array.from([r, r / 2])));
  lists.forEach((l) => assert.deepStrictEqual(l.map((x) => [...x]), [[0, 0], [1, 0.5], [2, 1]]));
  const out = job.ws.map(() => new Int16Array(6));
  await all((w, r) => w.allGatherIntoTensor(out[r], Int16Array.from([r, -r])));
  out.forEach((o) => assert.deepStrictEqual([...o], [0, 0, 1, -1, 2, -2]));
  const glist = [0, 1, 2].map(() => new Uint8Array(1));
  await all((w, r) => w.gather(Uint8Array.from([r + 7]), r === 2 ? glist : null, 2));
  assert.deepStrictEqual(glist.map((x) => x[0]), [7, 8, 9]);
  const got = job.ws.map(() => new Int32Array(2));
  await all((w, r) => w.scatter(got[r], r === 1 ? [0, 1, 2].map((k) => Int32Array.from([k, 100]))
    : null, 1));
  got.forEach((g, r) => assert.deepStrictEqual([...g], [r, 100]));
});

test('reduceScatter and allToAll', async (t) => {
  if (!needDaemon(t)) return;
  const outs = job.ws.map(() => new Int32Array(1));
  await all((w, r) => w.reduceScatter(outs[r], [0, 1, 2].map((k) => Int32Array.from([r * 10 + k])),
    { op: dist.ReduceOp.MAX }));
  outs.forEach((o, r) => assert.deepStrictEqual([...o], [20 + r]));
  const o2 = job.ws.map(() => new Float32Array(1));
  await all((w, r) => w.reduceScatterTensor(o2[r], Float32Array.from([r, r + 1, r + 2])));
  o2.forEach((o, r) => assert.deepStrictEqual([...o], [3 + 3 * r]));
  const a2a = job.ws.map(() => [0, 1, 2].map(() => new BigInt64Array(1)));
  await all((w, r) => w.allToAll(a2a[r], [0, 1, 2].map((j) => BigInt64Array.from([BigInt(r * 10 + j)]))));
  a2a.forEach((l, r) => assert.deepStrictEqual(l.map((x) => x[0]), [0, 1, 2].map((j) => BigInt(j * 10 + r))));
  const single = job.ws.map(() => new Int8Array(3));
  await all((w, r) => w.allToAllSingle(single[r], Int8Array.from([r, r, r])));
  single.forEach((s) => assert.deepStrictEqual([...s], [0, 1, 2]));
});

test('barrier holds everyone until the last rank arrives', async (t) => {
  if (!needDaemon(t)) return;
  const t0 = Date.now();
  const passed = [];
  await all(async (w, r) => {
    if (r === 0) await new Promise((res) => setTimeout(res, 300));
    await w.barrier();
    passed[r] = Date.now() - t0;
  });
  passed.forEach((ms) => assert.ok(ms >= 280, `passed after ${ms} ms`));
});

test('send, recv (also from any source), tags', async (t) => {
  if (!needDaemon(t)) return;
  const got = job.ws.map(() => new Float32Array(2));
  const srcs = await all((w, r) => Promise.all([
    w.send(Float32Array.from([r, r * r]), (r + 1) % N),
    w.recv(got[r], (r + N - 1) % N),
  ]).then(([, src]) => src));
  srcs.forEach((s, r) => assert.strictEqual(s, (r + N - 1) % N));
  got.forEach((g, r) => { const l = (r + N - 1) % N; assert.deepStrictEqual([...g], [l, l * l]); });
  const bufs = [new Int32Array(1), new Int32Array(1)];
  const res = await Promise.all([
    job.ws[0].recv(bufs[0]), job.ws[0].recv(bufs[1]),
    job.ws[1].send(Int32Array.from([11]), 0), job.ws[2].send(Int32Array.from([22]), 0),
  ]);
  assert.deepStrictEqual(new Set([res[0], res[1]]), new Set([1, 2]));
  for (let i = 0; i < 2; i++) assert.strictEqual(bufs[i][0], res[i] * 11);
  const tagged = new BigInt64Array(1);
  const [, from] = await Promise.all([job.ws[2].send(BigInt64Array.from([5n]), 1, { tag: 5 }),
    job.ws[1].recv(tagged, 2, { tag: 5 })]);
  assert.strictEqual(from, 2);
  assert.strictEqual(tagged[0], 5n);
});

test('many collectives in flight, awaited in any order', async (t) => {
  if (!needDaemon(t)) return;
  const xs = job.ws.map((_, r) => [1, 2, 3, 4].map((k) => new Int32Array(1000 * k).fill(k + r)));
  const ps = job.ws.map((w, r) => xs[r].map((x) => w.allReduce(x)));
  const bars = job.ws.map((w) => w.barrier());
  for (let k = 3; k >= 0; k--) await Promise.all(ps.map((p) => p[k]));
  await Promise.all(bars);
  xs.forEach((l) => l.forEach((x, k) => assert.ok(x.every((v) => v === 3 * (k + 1) + 3))));
});

test('groups: members, non-members, global src, reversed order', async (t) => {
  if (!needDaemon(t)) return;
  const g02 = await Promise.all(job.ws.map((w) => w.newGroup([0, 2])));
  const rev = await Promise.all(job.ws.map((w) => w.newGroup([2, 1, 0])));
  assert.strictEqual(g02[1], dist.GroupMember.NON_GROUP_MEMBER);
  assert.strictEqual(job.ws[1].getRank(g02[1]), -1);
  assert.strictEqual(job.ws[2].getRank(g02[2]), 1);
  assert.strictEqual(job.ws[0].getWorldSize(g02[0]), 2);
  const xs = job.ws.map((_, r) => Int32Array.from([r + 1]));
  const warned = new Promise((res) => process.once('warning', res));
  await Promise.all(job.ws.map((w, r) => w.allReduce(xs[r], { group: g02[r] })));
  assert.match(String((await warned).message), /does not belong/);
  assert.deepStrictEqual(xs.map((x) => x[0]), [4, 2, 4]);
  const ys = job.ws.map((_, r) => Float32Array.from([r]));
  await Promise.all([0, 2].map((r) => job.ws[r].broadcast(ys[r], 2, { group: g02[r] })));
  assert.deepStrictEqual(ys.map((y) => y[0]), [2, 1, 2]);
  const lists = job.ws.map(() => [0, 1, 2].map(() => new Int32Array(1)));
  await Promise.all(job.ws.map((w, r) => w.allGather(lists[r], Int32Array.from([r]), { group: rev[r] })));
  lists.forEach((l) => assert.deepStrictEqual(l.map((x) => x[0]), [2, 1, 0]));
  assert.deepStrictEqual(job.ws[0].getProcessGroupRanks(rev[0]), [2, 1, 0]);
});

test('newSubgroups and newSubgroupsByEnumeration', async (t) => {
  if (!needDaemon(t)) return;
  await assert.rejects(job.ws[0].newSubgroups(2), /multiple of groupSize 2/);
  await assert.rejects(job.ws[0].newSubgroups(0), /positive integer/);
  await assert.rejects(job.ws[0].newSubgroupsByEnumeration([]), /cannot be empty/);
  await assert.rejects(job.ws[0].newSubgroupsByEnumeration([[0, 1], [1]]),
    /rank 1 has appeared in both subgroup 0,1 and 1/);
  // Nothing was made by those: the next groups line up on every rank.
  const ones = await Promise.all(job.ws.map((w) => w.newSubgroups(1)));
  ones.forEach(([mine, all], r) => {
    assert.strictEqual(all.length, 3);
    assert.strictEqual(all[r], mine);
    assert.deepStrictEqual(mine.ranks, [r]);
  });
  const en = await Promise.all(job.ws.map((w) => w.newSubgroupsByEnumeration([[2, 0], [1]])));
  const xs = job.ws.map((_, r) => Int32Array.of(10 * (r + 1)));
  await Promise.all(job.ws.map((w, r) => w.allReduce(xs[r], { group: en[r][0] })));
  assert.deepStrictEqual(xs.map((x) => x[0]), [40, 20, 40]);
  assert.strictEqual(job.ws[0].getRank(en[0][0]), 1);
  assert.strictEqual(typeof dist.new_subgroups, 'function');
});

test('local argument errors: TypeError or RangeError, nothing sent', async (t) => {
  if (!needDaemon(t)) return;
  const w = job.ws[0];
  await assert.rejects(w.allReduce([1, 2, 3]), TypeError);
  await assert.rejects(w.allReduce(new Uint32Array(2)), /does not support Uint32Array/);
  await assert.rejects(w.allReduce(new Uint16Array(2)), /float16/);
  await assert.rejects(w.allReduce(new Float32Array(2), { dtype: 'bfloat16' }), TypeError);
  await assert.rejects(w.allReduce(new Float32Array(2), { op: dist.ReduceOp.BXOR }), /BXOR/);
  await assert.rejects(w.allReduce(new Float32Array(2), { op: 9 }), RangeError);
  await assert.rejects(w.broadcast(new Float32Array(2), 3), /not part of the group/);
  await assert.rejects(w.send(new Float32Array(2), 0), /itself/);
  await assert.rejects(w.allGather([new Int32Array(1)], new Int32Array(1)), /has 1 tensors/);
  await assert.rejects(w.allGather([0, 1, 2].map(() => new Int32Array(1)), new Float32Array(1)),
    TypeError);
  await assert.rejects(w.allToAll(new Int32Array(3), new Int32Array(3)), /allToAllSingle/);
  await assert.rejects(w.gather(new Int32Array(1), null, 0), /gatherList must be given/);
  // Nothing reached the daemon: the next collective lines up on every rank.
  const xs = job.ws.map(() => Int32Array.from([1]));
  await all((x, r) => x.allReduce(xs[r]));
  xs.forEach((x) => assert.strictEqual(x[0], 3));
});

test('daemon errors reject with its code and message', async (t) => {
  if (!needDaemon(t)) return;
  const res = await Promise.allSettled(job.ws.map((w, r) => w.allReduce(new Float32Array(2 + r))));
  for (const s of res) {
    assert.strictEqual(s.status, 'rejected');
    assert.ok(s.reason instanceof dist.ParamsyncError);
    assert.strictEqual(s.reason.codeName, 'FAILED_PRECONDITION');
    assert.strictEqual(s.reason.code, 9);
    assert.match(s.reason.details, /count/);
    assert.match(s.reason.message, /all_reduce \(group 0, seq \d+\)/);
  }
  const avg = await Promise.allSettled(job.ws.map((w) => w.allReduce(new Int32Array(2),
    { op: dist.ReduceOp.AVG })));
  avg.forEach((s) => assert.strictEqual(s.reason.codeName, 'INVALID_ARGUMENT'));
  const p2p = await Promise.allSettled([job.ws[0].send(new BigInt64Array(3), 1),
    job.ws[1].recv(new Float32Array(3), 0)]);
  p2p.forEach((s) => assert.match(s.reason.details, /int64.*float32|float32.*int64/));
  const ok = job.ws.map(() => Int32Array.from([2]));
  await all((w, r) => w.allReduce(ok[r], { op: dist.ReduceOp.PRODUCT }));
  ok.forEach((x) => assert.strictEqual(x[0], 8));
});

test('monitoredBarrier: a deadline of its own, naming the missing ranks', async (t) => {
  if (!needDaemon(t)) return;
  const w2 = await worlds(dist, job.daemon.addr, 'node-monitored', N);
  try {
    const t0 = Date.now();
    const e = await w2[0].monitoredBarrier({ timeout: 300 }).then(() => null, (x) => x);
    assert.ok(e instanceof dist.ParamsyncError, String(e));
    assert.strictEqual(e.codeName, 'DEADLINE_EXCEEDED');
    assert.match(e.details, /ranks 1, 2 did not arrive within 300 ms/);
    assert.ok(Date.now() - t0 < 1500, `took ${Date.now() - t0} ms`);
    await assert.rejects(w2[1].monitoredBarrier({ timeout: -1 }), /positive/);
  } finally {
    await Promise.all(w2.map((w) => w.destroy()));
  }
});
