'use strict';
// The Node.js worker of the cross-language test (xlang.py): the steps of
// xlang_worker.c, with the paramsync Node.js client on typed arrays.
const fs = require('fs');
const path = require('path');
const dist = require(path.join(__dirname, '..', '..', 'client', 'node'));

let r;
function expect(got, want, what) {
  const g = Array.from(got); const w = Array.from(want);
  if (got.constructor !== want.constructor || g.length !== w.length || g.some((v, i) => v !== w[i])) {
    console.error(`Node rank ${r}: ${what}: got ${g}, want ${w}`);
    process.exit(1);
  }
  console.log(`Node rank ${r}: ${what} ok`);
}

/** Element by element, want(k) for element k, without making arrays of millions. */
function expectEach(got, want, what) {
  for (let k = 0; k < got.length; k++) {
    if (got[k] !== want(k)) {
      console.error(`Node rank ${r}: ${what}: element ${k} is ${got[k]}, want ${want(k)}`);
      process.exit(1);
    }
  }
  console.log(`Node rank ${r}: ${what} ok`);
}

/** xlang_worker.c's peer_steps (XLANG_PEER=1): an all_to_all, an all_gather, a gather
 * and a scatter of 8 MiB of blocks, and an uneven all_to_all, which the ranks of one agent
 * take by peer copies, C, Python and Node.js ranks together. */
async function peerSteps() {
  const B = 700001;
  const mod = (k, m) => k % B % m;
  const blk = (k) => Math.floor(k / B);
  const src = Int32Array.from({ length: 3 * B }, (_, k) => 1000 * r + 10 * blk(k) + mod(k, 7));
  const out = new Int32Array(3 * B);
  await dist.allToAllSingle(out, src);
  expectEach(out, (k) => 1000 * blk(k) + 10 * r + mod(k, 7), 'all_to_all int32 of 8 MiB');
  const fout = new Float32Array(3 * B);
  await dist.allGatherIntoTensor(fout, Float32Array.from({ length: B }, (_, k) => r +
    (k % 3) * 0.5));
  expectEach(fout, (k) => blk(k) + mod(k, 3) * 0.5, 'all_gather float32 of 8 MiB');
  const lst = r === 1 ? [0, 1, 2].map(() => new Int32Array(B)) : null;
  await dist.gather(Int32Array.from({ length: B }, (_, j) => 7 * r + j % 5), lst, 1);
  // The root's blocks end to end (as the C root's one buffer); the others have none.
  const all = r === 1 ? Int32Array.from({ length: 3 * B }, (_, k) => lst[blk(k)][k % B])
    : new Int32Array(0);
  expectEach(all, (k) => 7 * blk(k) + mod(k, 5), 'gather int32 of 8 MiB');
  const got = new Int32Array(B);
  await dist.scatter(got, r === 2 ? [0, 1, 2].map((q) => Int32Array.from({ length: B },
    (_, j) => 9 * q + j % 3)) : null, 2);
  expectEach(got, (j) => 9 * r + j % 3, 'scatter int32 of 8 MiB');
  // xlang_worker.c's uneven_step: rank s sends rank d sent(s, d) elements naming both.
  const sent = (s, d) => ((s + d) % 3 === 1 ? 0 : (s + 2 * d + 1) * 200003);
  const ins = [0, 1, 2].map((d) => sent(r, d));
  const outs = [0, 1, 2].map((s) => sent(s, r));
  const x = new Int32Array(ins.reduce((a, b) => a + b));
  let at = 0;
  ins.forEach((n, d) => { for (let k = 0; k < n; k++) x[at++] = (10 * r + d) * 10000000 + k; });
  const o = new Int32Array(outs.reduce((a, b) => a + b));
  await dist.allToAllSingle(o, x, { outputSplitSizes: outs, inputSplitSizes: ins });
  const want = new Int32Array(o.length);
  at = 0;
  outs.forEach((n, s) => { for (let k = 0; k < n; k++) want[at++] = (10 * s + r) * 10000000 + k; });
  expectEach(o, (k) => want[k], 'uneven all_to_all int32');
  await dist.destroyProcessGroup();
}

/** xlang_worker.c's mem_steps (XLANG_PEER=2): an all_to_all from empty() memory by peer
 * copies, the others' segments read through mappings this process keeps (XLANG_MAPS of
 * them). */
async function memSteps() {
  const B = 700001;
  const mem = await dist.empty(6 * B, 'int32');
  for (let k = 0; k < 3 * B; k++) mem[k] = 1000 * r + 10 * Math.floor(k / B) + k % B % 7;
  const out = mem.subarray(3 * B);
  await dist.allToAllSingle(out, mem.subarray(0, 3 * B));
  expectEach(out, (k) => 1000 * Math.floor(k / B) + 10 * r + k % B % 7,
    'all_to_all int32 of 8 MiB from empty() memory');
  const mine = `/paramsync.${process.pid}.`;
  const mapped = fs.readFileSync('/proc/self/maps', 'utf8').split('\n')
    .filter((l) => l.includes('/paramsync.') && !l.includes(mine)).length;
  expect([mapped], [Number(process.env.XLANG_MAPS)], 'the others\' segments mapped');
  await dist.barrier();
  await dist.destroyProcessGroup();
}

/** xlang_worker.c's barrier_steps (XLANG_PEER=3): barriers met on the page the ranks
 * share, each rank in turn the last to come to one, stamped on CLOCK_MONOTONIC (libuv's
 * hrtime, as C's clock_gettime and Python's time.monotonic). */
async function barrierSteps() {
  const now = () => Number(process.hrtime.bigint()) / 1e9;
  for (let i = 0; i < 3; i++) await dist.barrier();
  let fine = true;
  for (let late = 0; late < 3; late++) {
    if (r === late) await new Promise((res) => setTimeout(res, 100));
    const mine = Float64Array.from([now()]);
    await dist.barrier();
    const left = now();
    const arrived = new Float64Array(3);
    await dist.allGatherIntoTensor(arrived, mine);
    fine = fine && left >= arrived[late];
  }
  expect([fine], [true], 'barriers wait for the last rank');
  for (let i = 0; i < 200; i++) await dist.barrier();
  expect([200], [200], '200 barriers');
  // Rank 2 calls an all_reduce where the others call a barrier: all are told at once.
  if (r !== 2) await new Promise((res) => setTimeout(res, 100));
  const t0 = now();
  let code = null;
  await (r === 2 ? dist.allReduce(new Float32Array([1])) : dist.barrier()).catch((e) => {
    code = e.codeName;
    console.log(`Node rank ${r}: ${e.message}`);
  });
  expect([code === 'FAILED_PRECONDITION' && now() - t0 < 1], [true],
    'a barrier against an all_reduce fails at once');
  await dist.barrier();
  await dist.destroyProcessGroup();
}

/** Object collectives between Python and Node.js ranks (XLANG_PEER=4, no C rank): each
 * side fails naming the first rank of the other language (XLANG_ORDER); the job goes on. */
async function objectSteps() {
  const other = process.env.XLANG_ORDER.split(',').findIndex((lang) => lang !== 'Node');
  let said = '';
  await dist.allGatherObject([0, 0, 0], { rank: r }).catch((e) => {
    said = e.message;
    console.log(`Node rank ${r}: ${e.message}`);
  });
  expect([said.includes(`the object from rank ${other} could not be deserialized`)], [true],
    'allGatherObject with a Python rank fails naming it');
  const x = BigInt64Array.of(BigInt(r));
  await dist.allReduce(x);
  expect(x, BigInt64Array.of(3n), 'all_reduce after the object error');
  await dist.destroyProcessGroup();
}

(async () => {
  await dist.initProcessGroup('paramsync');
  r = dist.getRank();
  if (dist.getWorldSize() !== 3) throw new Error('world size');
  if (process.env.XLANG_PEER === '1') {
    await peerSteps();
    return;
  }
  if (process.env.XLANG_PEER === '2') {
    await memSteps();
    return;
  }
  if (process.env.XLANG_PEER === '3') {
    await barrierSteps();
    return;
  }
  if (process.env.XLANG_PEER === '4') {
    await objectSteps();
    return;
  }
  const R = dist.ReduceOp;
  let x = Float32Array.from([r + 1, (r + 1) * 0.5, -r]);
  await dist.allReduce(x, { op: R.SUM });
  expect(x, Float32Array.from([6, 3, -3]), 'all_reduce float32 SUM');
  x = BigInt64Array.from([BigInt(r + 2), BigInt(-(r + 1))]);
  await dist.allReduce(x, { op: R.PRODUCT });
  expect(x, BigInt64Array.from([24n, -6n]), 'all_reduce int64 PRODUCT');
  x = Int32Array.from([r * 10, -r]);
  await dist.allReduce(x, { op: R.MAX });
  expect(x, Int32Array.from([20, 0]), 'all_reduce int32 MAX');
  x = Int32Array.from([r * 10, -r]);
  await dist.allReduce(x, { op: R.MIN });
  expect(x, Int32Array.from([0, -2]), 'all_reduce int32 MIN');
  x = Uint8Array.from([1 << r, 255]);
  await dist.allReduce(x, { op: R.BXOR });
  expect(x, Uint8Array.from([7, 255]), 'all_reduce uint8 BXOR');
  x = Int16Array.from([255 - r]);
  await dist.allReduce(x, { op: R.BAND });
  expect(x, Int16Array.from([252]), 'all_reduce int16 BAND');
  x = Float64Array.from([3 * r, 1]);
  await dist.allReduce(x, { op: R.AVG });
  expect(x, Float64Array.from([3, 1]), 'all_reduce float64 AVG');
  x = Uint8Array.from([r === 2 ? 1 : 0, 0]);
  await dist.allReduce(x, { op: R.BOR, dtype: 'bool' });
  expect(x, Uint8Array.from([1, 0]), 'all_reduce bool BOR');
  const n = 1 << 20;
  const big = Float32Array.from({ length: n }, (_, k) => r + 1 + (k % 7));
  await dist.allReduce(big);
  expect(big, Float32Array.from({ length: n }, (_, k) => 6 + 3 * (k % 7)),
    'all_reduce float32 SUM of 4 MiB');

  x = Int32Array.from([r * 100, 7]);
  await dist.broadcast(x, 1);
  expect(x, Int32Array.from([100, 7]), 'broadcast int32 from rank 1');
  x = Float64Array.from([r + 0.5]);
  await dist.broadcast(x, 2);
  expect(x, Float64Array.from([2.5]), 'broadcast float64 from rank 2');

  const out = [0, 1, 2].map(() => new Float32Array(2));
  await dist.allGather(out, Float32Array.from([r, r + 0.25]));
  expect(Float32Array.from(out.flatMap((t) => [...t])), Float32Array.from([0, 0.25, 1, 1.25, 2, 2.25]),
    'all_gather float32');
  for (const dst of [0, 2]) {
    const lst = r === dst ? [0, 1, 2].map(() => new BigInt64Array(1)) : null;
    await dist.gather(BigInt64Array.from([BigInt(r * r)]), lst, dst);
    if (r === dst) {
      expect(BigInt64Array.from(lst.map((t) => t[0])), BigInt64Array.from([0n, 1n, 4n]),
        'gather int64');
    }
  }
  for (const src of [2, 0]) {
    const lst = r === src ? [0, 11 + src, 22 + src].map((v) => Int32Array.from([v])) : null;
    x = Int32Array.from([-1]);
    await dist.scatter(x, lst, src);
    expect(x, Int32Array.from([r * 11 + (r ? src : 0)]), 'scatter int32');
  }
  await dist.barrier();
  console.log(`Node rank ${r}: barrier ok`);
  await dist.destroyProcessGroup();
})().catch((e) => {
  console.error(`Node rank ${r}:`, e);
  process.exit(1);
});
