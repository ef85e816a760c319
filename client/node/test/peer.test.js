'use strict';
// Peer copies: large all_to_all, all_gather, gather and scatter of ranks on one agent read
// each block rank to rank (process_vm_readv), so none of those calls reaches the agent but
// the exchange of descriptors; where one rank cannot take part, every rank goes through
// the agent, with the same results.
const test = require('node:test');
const assert = require('node:assert');
const fs = require('node:fs');
const dist = require('..');
const { worlds, filled, fixture, runNode, scrapeMetrics, daemonWithMetrics } =
  require('./helpers');

const f = fixture(test, dist, { native: true });
const K = 1 << 20; // int32 elements per block: 4 MiB, past every kind's floor with 3 ranks

/** Ranks' calls of all_to_all, gather and scatter the daemon finished so far. */
async function agentCalls() {
  const m = await scrapeMetrics(f.url);
  return ['all_to_all', 'gather', 'scatter'].reduce((n, k) =>
    n + (m.get(`paramsync_collectives_total{kind="${k}",code="OK"}`) || 0), 0);
}

/** The four kinds on ws (3 ranks), every element checked. */
async function fourKinds(ws) {
  const all = (fn) => Promise.all(ws.map((w, r) => fn(w, r)));
  const outs = ws.map(() => new Int32Array(3 * K));
  await all((w, r) => w.allGatherIntoTensor(outs[r], filled(r, K)));
  outs.forEach((o) => [0, 1, 2].forEach((j) =>
    assert.deepStrictEqual(o.subarray(j * K, (j + 1) * K), filled(j, K))));
  const ins = ws.map((_, r) => filled(r, 3 * K));
  const a2a = ws.map(() => new Int32Array(3 * K));
  await all((w, r) => w.allToAllSingle(a2a[r], ins[r]));
  a2a.forEach((x, r) => [0, 1, 2].forEach((s) => assert.deepStrictEqual(
    x.subarray(s * K, (s + 1) * K), ins[s].subarray(r * K, (r + 1) * K))));
  const g = [0, 1, 2].map(() => new Int32Array(2 * K));
  await all((w, r) => w.gather(filled(r, 2 * K), r === 1 ? g : null, 1));
  g.forEach((x, j) => assert.deepStrictEqual(x, filled(j, 2 * K)));
  const sc = ws.map(() => new Int32Array(2 * K));
  await all((w, r) => w.scatter(sc[r], r === 2 ? [0, 1, 2].map((j) => filled(10 + j, 2 * K))
    : null, 2));
  sc.forEach((x, r) => assert.deepStrictEqual(x, filled(10 + r, 2 * K)));
}

/** An all_to_all_single on ws (3 ranks) whose input and output lie in one allocation from
 * empty(), every element checked. */
async function allToAllOnEmpty(ws) {
  const mems = await Promise.all(ws.map((w) => w.empty(6 * K, 'int32')));
  await allToAllOn(ws, mems);
  return mems;
}

/** allToAllOnEmpty's call on mems (one array from empty() per rank). */
async function allToAllOn(ws, mems) {
  mems.forEach((m, r) => m.set(filled(r, 3 * K)));
  await Promise.all(ws.map((w, r) => w.allToAllSingle(mems[r].subarray(3 * K),
    mems[r].subarray(0, 3 * K))));
  mems.forEach((m, r) => [0, 1, 2].forEach((s) => assert.deepStrictEqual(
    m.subarray(3 * K + s * K, 3 * K + (s + 1) * K), filled(s, 3 * K).subarray(r * K,
      (r + 1) * K))));
}

test('the four kinds by peer copies: rank to rank, none at the agent', async (t) => {
  if (!f.ready(t)) return;
  const ws = await worlds(dist, f.daemon.addr, 'node-peer', 3);
  try {
    ws.forEach((w) => assert.deepStrictEqual(w.peerSets, [1, 1, 1], 'not in one set'));
    const before = await agentCalls();
    await fourKinds(ws);
    ws.forEach((w, r) => assert.strictEqual(w.peerUsed, 4, `rank ${r}`));
    assert.strictEqual(await agentCalls() - before, 0, 'calls reached the agent');
    // A list form (each block an array of its own) takes the path too.
    const lists = ws.map(() => [0, 1, 2].map(() => new Int32Array(K)));
    await Promise.all(ws.map((w, r) => w.allGather(lists[r], filled(r, K))));
    lists.forEach((l) => l.forEach((x, j) => assert.deepStrictEqual(x, filled(j, K))));
    ws.forEach((w) => assert.strictEqual(w.peerUsed, 5));
    // empty() memory, which the agent copies in place faster, does not: the descriptors
    // say so and every rank's call goes through the agent.
    await allToAllOnEmpty(ws);
    ws.forEach((w) => assert.strictEqual(w.peerUsed, 5));
    assert.strictEqual(await agentCalls() - before, 3, 'each rank\'s all_to_all on empty() memory');
    // Input and output in two allocations: the agent would take them in place (shm_out),
    // but peer copies measured about as fast and spare its CPU, so by peer
    // copies.
    const two = await Promise.all(ws.map((w) => Promise.all([w.empty(3 * K, 'int32'),
      w.empty(3 * K, 'int32')])));
    two.forEach(([x], r) => x.set(filled(r, 3 * K)));
    await Promise.all(ws.map((w, r) => w.allToAllSingle(two[r][1], two[r][0])));
    two.forEach(([, o], r) => [0, 1, 2].forEach((s) => assert.deepStrictEqual(
      o.subarray(s * K, (s + 1) * K), filled(s, 3 * K).subarray(r * K, (r + 1) * K))));
    ws.forEach((w) => assert.strictEqual(w.peerUsed, 6));
    assert.strictEqual(await agentCalls() - before, 3, 'an all_to_all between two allocations');
  } finally {
    await Promise.all(ws.map((w) => w.destroy()));
  }
});

test('allToAllSingle with split sizes: each pair\'s own bytes rank to rank', async (t) => {
  if (!f.ready(t)) return;
  const ws = await worlds(dist, f.daemon.addr, 'node-peer-uneven', 3);
  // Elements rank s sends rank d (none where s + d is a multiple of 3), naming both.
  const sent = (s, d) => ((s + d) % 3 === 0 ? 0 : (s + 2 * d + 1) * (K / 4) + 3);
  const fill = (a, at, s, d) => {
    for (let k = 0; k < sent(s, d); k++) a[at + k] = (s * 10 + d) * 1000000 + k;
    return at + sent(s, d);
  };
  const splits = (r) => ({ outputSplitSizes: [0, 1, 2].map((s) => sent(s, r)),
    inputSplitSizes: [0, 1, 2].map((d) => sent(r, d)) });
  const total = (sizes) => sizes.reduce((a, b) => a + b);
  /** One call on ins and outs (per rank), every element checked and the one past. */
  const call = async (ins, outs) => {
    ins.forEach((x, r) => [0, 1, 2].reduce((at, d) => fill(x, at, r, d), 0));
    outs.forEach((o) => o.fill(-7));
    await Promise.all(ws.map((w, r) => w.allToAllSingle(outs[r].subarray(0,
      total(splits(r).outputSplitSizes)), ins[r], splits(r))));
    outs.forEach((o, r) => {
      const want = new Int32Array(o.length).fill(-7);
      [0, 1, 2].reduce((at, s) => fill(want, at, s, r), 0);
      assert.deepStrictEqual(o, want, `rank ${r}`);
    });
  };
  try {
    const before = await agentCalls();
    await call(ws.map((_, r) => new Int32Array(total(splits(r).inputSplitSizes))),
      ws.map((_, r) => new Int32Array(total(splits(r).outputSplitSizes) + 1)));
    ws.forEach((w, r) => assert.strictEqual(w.peerUsed, 1, `rank ${r}`));
    assert.strictEqual(await agentCalls() - before, 0, 'an uneven all_to_all reached the agent');
    // From empty() memory too: the agent would copy padded buffers, not that memory.
    const mems = await Promise.all(ws.map((w, r) => w.empty(total(splits(r).inputSplitSizes) +
      total(splits(r).outputSplitSizes) + 1, 'int32')));
    await call(mems.map((m, r) => m.subarray(0, total(splits(r).inputSplitSizes))),
      mems.map((m, r) => m.subarray(total(splits(r).inputSplitSizes))));
    ws.forEach((w) => assert.strictEqual(w.peerUsed, 2));
    assert.strictEqual(await agentCalls() - before, 0, 'an uneven all_to_all on empty() memory');
    // Input and output in one array: the descriptors say so, and every rank's call goes
    // padded through the agent.
    const inT = (r) => total(splits(r).inputSplitSizes);
    const outT = (r) => total(splits(r).outputSplitSizes);
    const one = ws.map((_, r) => new Int32Array(Math.max(inT(r), outT(r))));
    one.forEach((a, r) => [0, 1, 2].reduce((at, d) => fill(a, at, r, d), 0));
    await Promise.all(ws.map((w, r) => w.allToAllSingle(one[r].subarray(0, outT(r)),
      one[r].subarray(0, inT(r)), splits(r))));
    one.forEach((a, r) => {
      const want = new Int32Array(outT(r));
      [0, 1, 2].reduce((at, s) => fill(want, at, s, r), 0);
      assert.deepStrictEqual(a.subarray(0, outT(r)), want, `rank ${r}, one array`);
    });
    ws.forEach((w) => assert.strictEqual(w.peerUsed, 2));
    assert.strictEqual(await agentCalls() - before, 3, 'each rank\'s padded all_to_all');
  } finally {
    await Promise.all(ws.map((w) => w.destroy()));
  }
});

/** Other ranks' segments this process maps read-only (the native helper's table of peer
 * mappings; an owner maps its own read-write). */
function peerMappings() {
  return fs.readFileSync('/proc/self/maps', 'utf8').split('\n')
    .filter((l) => l.includes('/paramsync.') && l.split(/\s+/)[1] === 'r--s').length;
}

test('empty() memory over the agent\'s --shm-resident-bytes: by peer copies', async (t) => {
  if (!f.ready(t)) return;
  // The agent would copy such a call through the segments' files, slower than the ranks.
  const [d] = await daemonWithMetrics(['--shm-resident-bytes', '1M']);
  try {
    const ws = await worlds(dist, d.addr, 'node-peer-resident', 3);
    try {
      const mems = await allToAllOnEmpty(ws);
      ws.forEach((w, r) => assert.strictEqual(w.peerUsed, 1, `rank ${r}`));
      // Each rank's segment read through a mapping the process keeps (the three ranks
      // share this process, and so one table): three, and still three when the call
      // comes again.
      assert.strictEqual(peerMappings(), 3, 'the segments mapped after the first call');
      await allToAllOn(ws, mems);
      assert.strictEqual(peerMappings(), 3, 'the same mappings used again');
      // Given back and allocated anew: the old segments' mappings go (their owner closed
      // the files), the new ones come.
      await Promise.all(ws.map((w, r) => w.free(mems[r])));
      await allToAllOnEmpty(ws);
      ws.forEach((w, r) => assert.strictEqual(w.peerUsed, 3, `rank ${r}`));
      assert.strictEqual(peerMappings(), 3, 'the freed segments\' mappings let go');
    } finally {
      await Promise.all(ws.map((w) => w.destroy()));
    }
    assert.strictEqual(peerMappings(), 0, 'mappings left after the ranks left');
  } finally {
    await d.stop();
  }
});

test('PARAMSYNC_PEER_MAP=0: empty() memory over the budget read without mappings',
  async (t) => {
    if (!f.ready(t)) return;
    const [d] = await daemonWithMetrics(['--shm-resident-bytes', '1M']);
    const was = process.env.PARAMSYNC_PEER_MAP;
    process.env.PARAMSYNC_PEER_MAP = '0';
    try {
      const ws = await worlds(dist, d.addr, 'node-peer-nomap', 3);
      try {
        await allToAllOnEmpty(ws);
        ws.forEach((w, r) => assert.strictEqual(w.peerUsed, 1, `rank ${r}`));
        assert.strictEqual(peerMappings(), 0, 'mapped with PARAMSYNC_PEER_MAP=0');
      } finally {
        await Promise.all(ws.map((w) => w.destroy()));
      }
    } finally {
      if (was === undefined) delete process.env.PARAMSYNC_PEER_MAP;
      else process.env.PARAMSYNC_PEER_MAP = was;
      await d.stop();
    }
  });

test('a rank that did not ask for peer copies: every rank through the agent, alike',
  async (t) => {
    if (!f.ready(t)) return;
    // Rank 2 in a process of its own with PARAMSYNC_PEER_COPY=0, doing the same calls.
    const child = runNode(`
      const assert = require('node:assert');
      const dist = require('.');
      const { filled } = require('./test/helpers');
      const K = ${K};
      (async () => {
        const w = await dist.World.init({ initMethod: 'tcp://${f.daemon.addr}?job=node-peer-off',
          worldSize: 3, rank: 2 });
        const out = new Int32Array(3 * K);
        await w.allGatherIntoTensor(out, filled(2, K));
        [0, 1, 2].forEach((j) => assert.deepStrictEqual(out.subarray(j * K, (j + 1) * K),
          filled(j, K)));
        await w.allToAllSingle(out, filled(2, 3 * K));
        [0, 1, 2].forEach((s) => assert.deepStrictEqual(out.subarray(s * K, (s + 1) * K),
          filled(s, 3 * K).subarray(2 * K, 3 * K)));
        await w.gather(filled(2, 2 * K), null, 1);
        const sc = new Int32Array(2 * K);
        await w.scatter(sc, [0, 1, 2].map((j) => filled(10 + j, 2 * K)), 2);
        assert.deepStrictEqual(sc, filled(12, 2 * K));
        console.log(JSON.stringify({ sets: w.peerSets, used: w.peerUsed }));
        await w.destroy();
      })().catch((e) => { console.error(e); process.exit(1); });`, { PARAMSYNC_PEER_COPY: '0' });
    const ws = await Promise.all([0, 1].map((rank) => dist.World.init({
      initMethod: `tcp://${f.daemon.addr}?job=node-peer-off`, worldSize: 3, rank })));
    try {
      const before = await agentCalls();
      const all = (fn) => Promise.all(ws.map((w, r) => fn(w, r)));
      const outs = ws.map(() => new Int32Array(3 * K));
      await all((w, r) => w.allGatherIntoTensor(outs[r], filled(r, K)));
      outs.forEach((o) => [0, 1, 2].forEach((j) =>
        assert.deepStrictEqual(o.subarray(j * K, (j + 1) * K), filled(j, K))));
      const a2a = ws.map(() => new Int32Array(3 * K));
      await all((w, r) => w.allToAllSingle(a2a[r], filled(r, 3 * K)));
      a2a.forEach((x, r) => [0, 1, 2].forEach((s) => assert.deepStrictEqual(
        x.subarray(s * K, (s + 1) * K), filled(s, 3 * K).subarray(r * K, (r + 1) * K))));
      const g = [0, 1, 2].map(() => new Int32Array(2 * K));
      await all((w, r) => w.gather(filled(r, 2 * K), r === 1 ? g : null, 1));
      g.forEach((x, j) => assert.deepStrictEqual(x, filled(j, 2 * K)));
      const sc = ws.map(() => new Int32Array(2 * K));
      await all((w, r) => w.scatter(sc[r], null, 2));
      sc.forEach((x, r) => assert.deepStrictEqual(x, filled(10 + r, 2 * K)));
      const c = await child;
      assert.strictEqual(c.code, 0, c.stderr);
      const { sets, used } = JSON.parse(c.stdout.trim().split('\n').pop());
      assert.strictEqual(sets[2], 0, 'rank 2 is in a peer-copy set though it did not ask');
      assert.strictEqual(used, 0);
      ws.forEach((w) => assert.strictEqual(w.peerUsed, 0));
      assert.strictEqual(await agentCalls() - before, 9, 'each rank\'s all_to_all, gather, scatter');
    } finally {
      await Promise.all(ws.map((w) => w.destroy()));
    }
  });
