'use strict';
// The collectives that take two steps, with 3 ranks of one job in this process: torch's
// object collectives (allGatherObject, gatherObject, broadcastObjectList,
// scatterObjectList) and allToAllSingle with uneven split sizes. Results in group rank
// order, the argument errors before anything is sent, the daemon's count check, splits
// the ranks disagree on, and another collective on the group refused until one resolves.
const test = require('node:test');
const assert = require('node:assert');
const dist = require('..');
const { sharedJob } = require('./helpers');

const N = 3;
const job = sharedJob(test, dist, 'node-steps', N);
const needDaemon = job.need;
const all = job.all;

// Rank k's object: structured-clone types, and 300 KB at rank 1 (the payload segment).
function obj(k) {
  return { rank: k, text: 'x'.repeat(k === 1 ? 300000 : k), big: BigInt(k) << 40n,
    map: new Map([[k, [k, k + 1]]]), arr: Int32Array.of(k, -k) };
}

test('allGatherObject: every rank gets every object in rank order', async (t) => {
  if (!needDaemon(t)) return;
  const lists = job.ws.map(() => new Array(N).fill(null));
  const got = await all((w, r) => w.allGatherObject(lists[r], obj(r)));
  for (let r = 0; r < N; r++) {
    assert.strictEqual(got[r], lists[r]);
    assert.deepStrictEqual(lists[r], [0, 1, 2].map(obj));
  }
});

test('gatherObject, broadcastObjectList, scatterObjectList; src and dst global', async (t) => {
  if (!needDaemon(t)) return;
  const rev = await Promise.all(job.ws.map((w) => w.newGroup([2, 1, 0])));
  const at = [null, new Array(N).fill(0), null];
  await all((w, r) => w.gatherObject(['from', r], at[r], 1, { group: rev[r] }));
  assert.deepStrictEqual(at[1], [['from', 2], ['from', 1], ['from', 0]]);
  const lists = job.ws.map((w, r) => (r === 2 ? [null, 'x', 3.5, { k: [1, 2] }] : [0, 0, 0, 0]));
  await all((w, r) => w.broadcastObjectList(lists[r], 2));
  for (const l of lists) assert.deepStrictEqual(l, [null, 'x', 3.5, { k: [1, 2] }]);
  const empty = job.ws.map(() => []);
  await all((w, r) => w.broadcastObjectList(empty[r], 0));
  assert.deepStrictEqual(empty, [[], [], []]);
  const outs = job.ws.map(() => ['unset']);
  await all((w, r) => w.scatterObjectList(outs[r],
    r === 0 ? ['to group rank 0', 'to group rank 1', { two: 2 }] : null, 0, { group: rev[r] }));
  assert.deepStrictEqual(outs, [[{ two: 2 }], ['to group rank 1'], ['to group rank 0']]);
  // Through the default group's functions too.
  assert.strictEqual(typeof dist.allGatherObject, 'function');
  assert.strictEqual(dist.all_gather_object, dist.allGatherObject);
});

test('a rank outside the group is warned and its list untouched', async (t) => {
  if (!needDaemon(t)) return;
  const g02 = await Promise.all(job.ws.map((w) => w.newGroup([0, 2])));
  const warned = [];
  const onWarning = (w) => warned.push(String(w.message));
  process.on('warning', onWarning);
  const lists = [[null, null], ['mine'], [null, null]];
  const res = await all((w, r) => w.allGatherObject(lists[r], r * 10, { group: g02[r] }));
  await new Promise((r) => setImmediate(r));
  process.off('warning', onWarning);
  assert.strictEqual(res[1], undefined);
  assert.deepStrictEqual(lists, [[0, 20], ['mine'], [0, 20]]);
  assert.ok(warned.some((m) => /does not belong/.test(m)), warned);
});

test('argument errors reject before anything is sent', async (t) => {
  if (!needDaemon(t)) return;
  await all(async (w, r) => {
    await assert.rejects(w.allGatherObject([null], r), /has 1 elements; the group has 3/);
    await assert.rejects(w.allGatherObject('abc', r), TypeError);
    await assert.rejects(w.allGatherObject([0, 0, 0], () => r), /could not be cloned/);
    await assert.rejects(w.scatterObjectList([], null, 0), /at least one/);
    await assert.rejects(w.broadcastObjectList([1], 3), /not part of the group/);
    if (r === 0) {
      await assert.rejects(w.gatherObject(r, null, 0), /must be given/);
      await assert.rejects(w.scatterObjectList([null], null, 0), /must be given/);
    } else {
      await assert.rejects(w.gatherObject(r, [0, 0, 0], 0), /must NOT/);
    }
  });
  // Nothing reached the daemon: the next collective lines up on every rank.
  const lists = job.ws.map(() => [0, 0, 0]);
  await all((w, r) => w.allGatherObject(lists[r], `after ${r}`));
  assert.deepStrictEqual(lists[2], ['after 0', 'after 1', 'after 2']);
});

test('lists of different lengths fail on every rank with the daemon\'s count error', async (t) => {
  if (!needDaemon(t)) return;
  const res = await all((w, r) => w.broadcastObjectList(new Array(1 + (r % 2)).fill(r), 0)
    .then(() => null, (e) => e));
  for (const e of res) {
    assert.ok(e instanceof dist.ParamsyncError, String(e));
    assert.match(e.details, /count/);
  }
});

test('another collective on the group is refused until the objects resolve', async (t) => {
  if (!needDaemon(t)) return;
  const lists = job.ws.map(() => [0, 0, 0]);
  const objs = job.ws.map((w, r) => w.allGatherObject(lists[r], r));
  // Started while the object collective has not resolved: refused, on every rank alike.
  const early = await Promise.all(job.ws.map((w) => w.allReduce(Int32Array.of(1))
    .then(() => null, (e) => e)));
  for (const e of early) assert.match(String(e), /allGatherObject on this group has not resolved/);
  await Promise.all(objs);
  assert.deepStrictEqual(lists[0], [0, 1, 2]);
  const x = job.ws.map(() => Int32Array.of(1));
  await all((w, r) => w.allReduce(x[r]));
  assert.deepStrictEqual(x[0], Int32Array.of(3));
});

// Rank s sends rank d `s + 2 d` (times scale) elements naming both.
function unevenInput(r, scale) {
  const parts = [0, 1, 2].map((d) => Int32Array.from({ length: scale * (r + 2 * d) },
    (_, k) => (r * 10 + d) * 1000000 + k));
  return Int32Array.from(parts.flatMap((p) => Array.from(p)));
}

test('allToAllSingle with uneven split sizes', async (t) => {
  if (!needDaemon(t)) return;
  for (const scale of [1, 30000]) { // the second: up to about 1 MB a rank
    const ins = (r) => [0, 1, 2].map((d) => scale * (r + 2 * d));
    const outs = (r) => [0, 1, 2].map((s) => scale * (s + 2 * r));
    const o = job.ws.map((w, r) => new Int32Array(outs(r).reduce((a, b) => a + b)).fill(-1));
    const res = await all((w, r) => w.allToAllSingle(o[r], unevenInput(r, scale),
      { outputSplitSizes: outs(r), inputSplitSizes: ins(r) }));
    for (let r = 0; r < N; r++) {
      assert.strictEqual(res[r], o[r]);
      const want = [0, 1, 2].flatMap((s) => Array.from({ length: scale * (s + 2 * r) },
        (_, k) => (s * 10 + r) * 1000000 + k));
      assert.deepStrictEqual(Array.from(o[r]), want, `rank ${r}, scale ${scale}`);
    }
  }
  // The padded blocks are kept for the next call, which takes them again.
  const kept = job.ws.map((w) => w.scratchFree.slice());
  kept.forEach((k, r) => assert.strictEqual(k.length, 2, `rank ${r}: padded blocks kept`));
  await all((w, r) => w.allToAllSingle(new Int32Array(3 * (2 * r + 1)),
    unevenInput(r, 1).map((v) => -v), { outputSplitSizes: [0, 1, 2].map((s) => s + 2 * r),
      inputSplitSizes: [r, r + 2, r + 4] }));
  job.ws.forEach((w, r) => assert.ok(w.scratchFree.length === 2 &&
    kept[r].every((b) => w.scratchFree.includes(b)), `rank ${r}: the kept blocks kept`));
  // Rank 1's padded input (the first kept) now starts with its first element to rank 0.
  const pad = kept[1][0];
  assert.strictEqual(new Int32Array(pad.buffer, pad.byteOffset, 1)[0], -10000000,
    'the kept blocks were not taken again');
  // Even splits given: read and written in place; in one array, the output padded.
  for (const inPlace of [false, true]) {
    const x = job.ws.map((_, r) => Int16Array.from({ length: 6 }, (_, k) => 10 * r + k));
    const out = inPlace ? x : job.ws.map(() => new Int16Array(6));
    await all((w, r) => w.allToAllSingle(out[r], x[r], { outputSplitSizes: [2, 2, 2],
      inputSplitSizes: [2, 2, 2] }));
    assert.deepStrictEqual(Array.from(out[1]), [2, 3, 12, 13, 22, 23], `in place ${inPlace}`);
  }
  // Input splits only: the outputs even (2 from each).
  const o = job.ws.map(() => new Float64Array(6));
  await all((w, r) => w.allToAllSingle(o[r], Float64Array.from({ length: 6 }, (_, k) => 10 * r + k),
    { inputSplitSizes: [2, 2, 2] }));
  assert.deepStrictEqual(Array.from(o[1]), [2, 3, 12, 13, 22, 23]);
});

test('uneven splits the ranks disagree on fail on every rank, naming the pair', async (t) => {
  if (!needDaemon(t)) return;
  const res = await all((w, r) => {
    const outs = [1, r === 0 ? 2 : 1, 1];
    return w.allToAllSingle(new Int32Array(outs[0] + outs[1] + outs[2]), new Int32Array(3),
      { outputSplitSizes: outs, inputSplitSizes: [1, 1, 1] }).then(() => null, (e) => e);
  });
  for (const e of res) {
    assert.match(String(e), /group rank 1 sends 1 elements to group rank 0, whose outputSplitSizes expect 2/);
  }
  await all(async (w) => {
    await assert.rejects(w.allToAllSingle(new Int32Array(3), new Int32Array(3),
      { outputSplitSizes: [1, 1, 2], inputSplitSizes: [1, 1, 1] }), /adding up/);
    await assert.rejects(w.allToAllSingle(new Int32Array(3), new Int32Array(3),
      { inputSplitSizes: [3] }), /has 1 sizes; the group has 3/);
  });
  // The job goes on.
  const x = job.ws.map(() => Int32Array.of(1));
  await all((w, r) => w.allReduce(x[r]));
  assert.deepStrictEqual(x[2], Int32Array.of(3));
});
