'use strict';
// The doorbell: collectives of a worker on its agent's host without a gRPC call, through
// the native helper (client/node/native). Every element checked; the daemon's /metrics
// says no payload byte went as frames; errors, lost ranks and refusals each a test.
const test = require('node:test');
const assert = require('node:assert');
const dist = require('..');
const { worlds, runNode, filled, sumOf, fixture, loseRank1, startDaemon, daemonWithMetrics,
  scrapeMetrics } = require('./helpers');

const N = 3;
const f = fixture(test, dist, { job: 'node-doorbell', n: N, native: true });
const ready = f.ready;
const all = (fn) => f.all(fn);
const frameBytes = () => f.frameBytes();
const rungs = () => f.ws.map((w) => w.doorbellRung);

test('small collectives of every kind ring the doorbell: no call, no frame', async (t) => {
  if (!ready(t)) return;
  const before = rungs();
  const frames = await frameBytes();
  let calls = 0; // collectives each rank made
  const k = 5;
  await all((w) => w.barrier()); calls++;
  const xs = f.ws.map((_, r) => filled(r, k));
  await all((w, r) => w.allReduce(xs[r], { op: dist.ReduceOp.MAX })); calls++;
  xs.forEach((x) => assert.deepStrictEqual(x, filled(N - 1, k)));
  const b = f.ws.map((_, r) => (r === 2 ? filled(7, k) : new Int32Array(k)));
  await all((w, r) => w.broadcast(b[r], 2)); calls++;
  b.forEach((x) => assert.deepStrictEqual(x, filled(7, k)));
  const red = f.ws.map((_, r) => filled(r, k));
  await all((w, r) => w.reduce(red[r], 1)); calls++;
  assert.deepStrictEqual(red[1], sumOf([0, 1, 2], k));
  assert.deepStrictEqual(red[0], filled(0, k)); // not the root: unchanged
  const ag = f.ws.map(() => [...Array(N)].map(() => new Int32Array(k)));
  await all((w, r) => w.allGather(ag[r], filled(r, k))); calls++;
  ag.forEach((l) => l.forEach((x, j) => assert.deepStrictEqual(x, filled(j, k))));
  const g = [...Array(N)].map(() => new Int32Array(k));
  await all((w, r) => w.gather(filled(r, k), r === 0 ? g : null, 0)); calls++;
  g.forEach((x, j) => assert.deepStrictEqual(x, filled(j, k)));
  const sc = f.ws.map(() => new Int32Array(k));
  await all((w, r) => w.scatter(sc[r], r === 1 ? [0, 1, 2].map((j) => filled(10 + j, k))
    : null, 1)); calls++;
  sc.forEach((x, r) => assert.deepStrictEqual(x, filled(10 + r, k)));
  const rs = f.ws.map(() => new Int32Array(k));
  await all((w, r) => w.reduceScatter(rs[r], [0, 1, 2].map((j) => filled(r + j, k)))); calls++;
  rs.forEach((x, r) => assert.deepStrictEqual(x, sumOf([r, r + 1, r + 2], k)));
  const a2a = f.ws.map(() => [...Array(N)].map(() => new Int32Array(k)));
  await all((w, r) => w.allToAll(a2a[r], [0, 1, 2].map((j) => filled(10 * r + j, k)))); calls++;
  a2a.forEach((l, r) => l.forEach((x, j) => assert.deepStrictEqual(x, filled(10 * j + r, k))));
  const got = new Int32Array(k);
  const [, src] = await Promise.all([f.ws[0].send(filled(42, k), 2, { tag: 3 }),
    f.ws[2].recv(got, null, { tag: 3 })]);
  assert.strictEqual(src, 0, 'recv from any source names the sender');
  assert.deepStrictEqual(got, filled(42, k));
  const after = rungs();
  f.ws.forEach((_, r) => assert.strictEqual(after[r] - before[r], calls + (r === 1 ? 0 : 1),
    `rank ${r}: ${after[r] - before[r]} requests through the doorbell`));
  assert.strictEqual(await frameBytes(), frames, 'payload went as gRPC frames');
});

test('large payloads ring the doorbell through the payload segment', async (t) => {
  if (!ready(t)) return;
  const k = 300001; // 1.2 MB
  const before = rungs();
  const frames = await frameBytes();
  const xs = f.ws.map((_, r) => filled(r, k));
  await all((w, r) => w.allReduce(xs[r]));
  const sum = sumOf([0, 1, 2], k);
  xs.forEach((x) => assert.deepStrictEqual(x, sum));
  const out = f.ws.map(() => new Int32Array(N * k));
  await all((w, r) => w.allGatherIntoTensor(out[r], filled(r, k)));
  out.forEach((o) => [0, 1, 2].forEach((j) =>
    assert.deepStrictEqual(o.subarray(j * k, (j + 1) * k), filled(j, k))));
  rungs().forEach((n, r) => assert.strictEqual(n - before[r], 2));
  assert.strictEqual(await frameBytes(), frames);
});

test('errors come back through the doorbell with the daemon\'s code; nothing is lost',
  async (t) => {
    if (!ready(t)) return;
    const before = rungs();
    const xs = f.ws.map((_, r) => filled(r, 4 + (r === 2 ? 1 : 0)));
    const res = await all((w, r) => w.allReduce(xs[r]).then(() => null, (e) => e));
    res.forEach((e) => {
      assert.ok(e instanceof dist.ParamsyncError, String(e));
      assert.strictEqual(e.codeName, 'FAILED_PRECONDITION');
      assert.match(e.message, /rank 2 has count 5 but rank 0 has 4|count/);
    });
    xs.forEach((x, r) => assert.deepStrictEqual(x, filled(r, x.length), 'input changed'));
    const roots = await all((w, r) => w.broadcast(new Int32Array(2), r === 0 ? 1 : 0)
      .then(() => null, (e) => e));
    roots.forEach((e) => assert.ok(e && /root/.test(e.message), `want a root mismatch: ${e}`));
    // The doorbells still serve: the next collective works.
    const ys = f.ws.map((_, r) => filled(r, 3));
    await all((w, r) => w.allReduce(ys[r], { op: dist.ReduceOp.MIN }));
    ys.forEach((y) => assert.deepStrictEqual(y, filled(0, 3)));
    rungs().forEach((n, r) => assert.strictEqual(n - before[r], 3));
  });

test('collectives in flight side by side: a doorbell each, as many as the agent keeps, ' +
  'then calls', async (t) => {
  if (!ready(t)) return;
  const before = rungs();
  const ops = [dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT,
    dist.ReduceOp.BOR, dist.ReduceOp.BXOR];
  const xs = ops.map((_, i) => f.ws.map((_w, r) => new Int32Array([r + 1 + i, 1 << r])));
  await all((w, r) => Promise.all(ops.map((op, i) => w.allReduce(xs[i][r], { op }))));
  const want = (op, a) => a.reduce((x, y) => [x + y, Math.max(x, y), Math.min(x, y), x * y,
    x | y, x ^ y][ops.indexOf(op)]);
  ops.forEach((op, i) => xs[i].forEach((x) => assert.deepStrictEqual(Array.from(x),
    [want(op, [1, 2, 3].map((v) => v + i)), want(op, [1, 2, 4])], `op ${op}`)));
  f.ws.forEach((w, r) => {
    assert.strictEqual(w.doorbells.all.length, 4, 'the agent keeps 4 doorbells a rank');
    assert.strictEqual(w.doorbellRung - before[r], 4, 'four rang, two took calls');
  });
});

test('a rank lost while the others wait at the doorbell: ABORTED naming it', async (t) => {
  if (!ready(t)) return;
  const mine = await worlds(dist, f.daemon.addr, 'node-doorbell-lost', 3);
  try {
    await Promise.all(mine.map((w) => w.barrier())); // each has its doorbell now
    await loseRank1(mine, (w) => w.barrier(), 200);
    // Each waited at its doorbell, abandoned it (the agent may still answer into it) and
    // made no call.
    [0, 2].forEach((r) => {
      assert.strictEqual(mine[r].doorbellRung, 1);
      assert.ok(mine[r].doorbells.all[0].disabled, `rank ${r}'s doorbell still in use`);
    });
  } finally {
    await Promise.all([mine[0].destroy(), mine[2].destroy()]);
  }
});

test('an agent that refuses the doorbell: calls, and results alike', async (t) => {
  if (!ready(t)) return;
  const mine = await worlds(dist, f.daemon.addr, 'node-doorbell-refused', 2);
  try {
    let offers = 0;
    mine.forEach((w) => {
      w.doorbells.attach = () => {
        offers++;
        return Promise.reject(new Error('injected: not this host'));
      };
    });
    for (let i = 0; i < 3; i++) {
      const xs = mine.map((_, r) => filled(r, 4));
      await Promise.all(mine.map((w, r) => w.allReduce(xs[r])));
      xs.forEach((x) => assert.deepStrictEqual(x, sumOf([0, 1], 4)));
    }
    assert.strictEqual(offers, 2, 'a refused doorbell was offered again');
    mine.forEach((w) => assert.strictEqual(w.doorbellRung, 0));
  } finally {
    await Promise.all(mine.map((w) => w.destroy()));
  }
});

test('PARAMSYNC_NODE_NATIVE: 0 does without; a helper that is not there is an error',
  async () => {
    const off = await runNode("console.log(require('.').hasDoorbell)",
      { PARAMSYNC_NODE_NATIVE: '0' });
    assert.strictEqual(off.code, 0, off.stderr);
    assert.strictEqual(off.stdout.trim(), 'false');
    const bad = await runNode("require('.')", { PARAMSYNC_NODE_NATIVE: '/nonexistent.node' });
    assert.notStrictEqual(bad.code, 0);
    assert.match(bad.stderr, /cannot load PARAMSYNC_NODE_NATIVE=\/nonexistent\.node/);
  });

test('the native helper checks its arguments', (t) => {
  if (!ready(t)) return;
  const n = dist._native;
  assert.throws(() => n.wake(), /wake\(buffer, offset\): two arguments/);
  assert.throws(() => n.map(-1, 4096), TypeError);
  assert.throws(() => n.map(999999, 4096), /mmap of 4096 bytes/);
  assert.throws(() => n.wake(new Uint8Array(8), 0), TypeError);
  assert.throws(() => n.wait(new ArrayBuffer(8), 6, 0, 1), RangeError);
  assert.throws(() => n.wait(new ArrayBuffer(8), 8, 0, 1), RangeError);
  assert.throws(() => n.wait(new ArrayBuffer(8), 0, 2 ** 32, 1), RangeError);
  assert.throws(() => n.waitNow(new ArrayBuffer(8), 0, 0), /four arguments/);
  assert.throws(() => n.waitNow(new ArrayBuffer(8), 6, 0, 1), RangeError);
  assert.throws(() => n.waitNow(new ArrayBuffer(8), 0, 0, 10001), /at most 10000/);
  // A word that is not the value: at once; one that is: false once the time is up.
  const words = new Uint32Array(2);
  words[1] = 7;
  assert.strictEqual(n.waitNow(words.buffer, 4, 6, 10000), true);
  const t0 = process.hrtime.bigint();
  assert.strictEqual(n.waitNow(words.buffer, 4, 7, 3000), false);
  assert.ok(process.hrtime.bigint() - t0 >= 3000000n, 'waitNow returned before its time');
});

test('ranks each in a process of their own: lone collectives are answered on the loop\'s ' +
  'thread, and alike', async (t) => {
  if (!ready(t)) return;
  // In this process, several Worlds: none waits on the loop's thread.
  await all((w) => w.barrier());
  assert.deepStrictEqual(f.ws.map((w) => w.doorbellAnsweredNow), [0, 0, 0]);
  const rank = (r, env) => runNode(`
    const dist = require('.');
    const { filled } = require('./test/helpers');
    (async () => {
      const w = await dist.World.init({ initMethod: 'tcp://${f.daemon.addr}?job=node-now-' +
        '${env.PARAMSYNC_NODE_WAIT_NOW_US}', worldSize: 2, rank: ${r} });
      const sums = [];
      for (let i = 0; i < 200; i++) {
        await w.barrier();
        const x = filled(${r} + i, 300);
        await w.allReduce(x);
        sums.push(x[299]);
      }
      console.log(JSON.stringify({ rung: w.doorbellRung, now: w.doorbellAnsweredNow, sums }));
      await w.destroy();
    })().catch((e) => { console.error(e); process.exit(1); });`, env);
  for (const us of ['10000', '0']) {
    // Barriers through the doorbell too, not met on the ranks' shared page.
    const env = { PARAMSYNC_NODE_WAIT_NOW_US: us, PARAMSYNC_DIRECT_BARRIER: '0' };
    const out = (await Promise.all([0, 1].map((r) => rank(r, env)))).map((o) => {
      assert.strictEqual(o.code, 0, o.stderr);
      return JSON.parse(o.stdout);
    });
    for (const o of out) {
      assert.strictEqual(o.rung, 400);
      o.sums.forEach((s, i) => assert.strictEqual(s, filled(i, 300)[299] + filled(1 + i, 300)[299]));
      // Waiting up to 10 ms, some answers come meanwhile; with 0 none is waited for.
      if (us === '0') assert.strictEqual(o.now, 0);
      else assert.ok(o.now > 0, `no answer came while the loop's thread waited: ${o.now}`);
    }
  }
});

test('a job over two agents: the doorbell, the segment, empty() and direct at each, no frame' +
  ' (an uneven allToAllSingle\'s padded blocks on empty() memory)',
  async (t) => {
    if (!ready(t)) return;
    const coord = await startDaemon(['--role', 'coordinator']);
    const agents = [];
    let ws = [];
    try {
      for (let i = 0; i < 2; i++) {
        // Its budget of resident segment bytes is for the uneven allToAllSingle below.
        const [d, url] = await daemonWithMetrics(['--role', 'agent', '--coordinator', coord.addr,
          '--shm-resident-bytes', '4100000']);
        agents.push({ d, url });
        assert.ok(url, `agent ${i} announced no metrics address:\n${d.log()}`);
      }
      // Rank 0 joins through the first agent (the job's hub), rank 1 through the other.
      ws = await Promise.all([0, 1].map((r) => dist.World.init({
        initMethod: `tcp://${agents[r].d.addr}?job=node-split`, worldSize: 2, rank: r })));
      const both = (fn) => Promise.all(ws.map((w, r) => fn(w, r)));
      for (const k of [5, 300001, 4 << 20]) { // in the doorbell, the segment, direct
        const xs = ws.map((_, r) => filled(r, k));
        await both((w, r) => w.allReduce(xs[r]));
        xs.forEach((x) => assert.deepStrictEqual(x, sumOf([0, 1], k), `all_reduce of ${k}`));
        const outs = ws.map(() => new Int32Array(2 * k));
        await both((w, r) => w.allGatherIntoTensor(outs[r], filled(r, k)));
        outs.forEach((o) => [0, 1].forEach((j) =>
          assert.deepStrictEqual(o.subarray(j * k, (j + 1) * k), filled(j, k))));
      }
      const k = 300001;
      const m = await both((w) => w.empty(3 * k, 'int32'));
      m.forEach((x, r) => x.set(filled(r, k)));
      await both((w, r) => w.allGatherIntoTensor(m[r].subarray(k), m[r].subarray(0, k)));
      m.forEach((x) => [0, 1].forEach((j) =>
        assert.deepStrictEqual(x.subarray(k * (j + 1), k * (j + 2)), filled(j, k))));
      // An uneven allToAllSingle (rank s sends rank r (s + r + 1) K elements of 10 s + r):
      // its padded blocks are empty() memory, which each agent takes in place beside the
      // other (two segments), kept for the next call.
      const K = 100000;
      const blocks = (r, from) => [0, 1].map((j) => new Int32Array((j + r + 1) * K).fill(
        from ? 10 * j + r : 10 * r + j));
      const cat = (arrs) => Int32Array.from(arrs.flatMap((a) => Array.from(a)));
      const got2 = ws.map((_, r) => new Int32Array((2 * r + 1 + 2) * K));
      // Between the agents only the blocks' own bytes cross (header.block_used): 1.6 MB,
      // where the padded blocks are 2.4 MB. Only those count against each agent's
      // --shm-resident-bytes too (block_used, block_out_used): rank 1's 4.0 MB are within
      // 4.1 MB, where its padded blocks (4.8 MB) or its data in and padded blocks out
      // (4.4 MB) are not, so no byte goes through a segment's file.
      const summed = async (series) => {
        let b = 0;
        for (const a of agents) b += (await scrapeMetrics(a.url)).get(series);
        return b;
      };
      const crossed = () => summed('paramsync_payload_bytes_total{direction="sent",link="agent"}');
      const byFile = () => Promise.all(['received', 'sent'].map((dir) =>
        summed(`paramsync_shm_bytes_total{direction="${dir}",access="file"}`)));
      const sentBefore = await crossed();
      const filesBefore = await byFile();
      await both((w, r) => w.allToAllSingle(got2[r], cat(blocks(r, false)), {
        outputSplitSizes: [0, 1].map((s) => (s + r + 1) * K),
        inputSplitSizes: [0, 1].map((j) => (r + j + 1) * K) }));
      got2.forEach((o, r) => assert.deepStrictEqual(o, cat(blocks(r, true)), `uneven, rank ${r}`));
      const sent = await crossed() - sentBefore;
      const files = (await byFile()).map((b, i) => b - filesBefore[i]);
      assert.deepStrictEqual(files, [0, 0],
        'uneven: bytes read and written through segment files, want none');
      assert.ok(sent >= 1600000 && sent < 2000000,
        `uneven: ${sent} bytes sent between the agents, want the blocks' own 1.6 MB`);
      ws.forEach((w, r) => {
        assert.strictEqual(w.scratchMem.length, 2, `rank ${r}: padded blocks on empty() kept`);
        assert.strictEqual(w.scratchFree.length, 0, `rank ${r}: padded blocks of plain memory`);
        assert.strictEqual(w.doorbellRung, 9, `rank ${r}: every collective rang`);
        assert.strictEqual(w.proc.used, 2, `rank ${r}: the 16 MiB ones went directly`);
      });
      let two = 0;
      for (const a of agents) {
        const got = await scrapeMetrics(a.url);
        two += got.get('paramsync_shm_calls_total{segments="registered_two"}');
      }
      assert.strictEqual(two, 2, 'the uneven call from two empty() allocations at each rank');
      for (const [i, a] of agents.entries()) {
        const got = await scrapeMetrics(a.url);
        for (const dir of ['received', 'sent']) {
          assert.strictEqual(got.get(`paramsync_payload_bytes_total{direction="${dir}",` +
            'link="worker"}'), 0, `agent ${i}: worker payload ${dir} as frames`);
        }
      }
    } finally {
      await Promise.all(ws.map((w) => w.destroy()));
      for (const a of agents) await a.d.stop();
      await coord.stop();
    }
  });

test('an uneven allToAllSingle whose padded blocks are over two agents\' --max-tensor-bytes: ' +
  'refused on every rank, its padded blocks let go; kept up to $PARAMSYNC_SCRATCH_BYTES',
async (t) => {
  if (!ready(t)) return;
  const limit = 4 << 20;
  const cap = 3 << 20; // under the limit
  const coord = await startDaemon(['--role', 'coordinator']);
  const agents = [];
  let ws = [];
  try {
    for (let i = 0; i < 2; i++) {
      agents.push(await startDaemon(['--role', 'agent', '--coordinator', coord.addr,
        '--max-tensor-bytes', String(limit)]));
    }
    process.env.PARAMSYNC_SCRATCH_BYTES = String(cap);
    try {
      ws = await Promise.all([0, 1, 2].map((r) => dist.World.init({
        initMethod: `tcp://${agents[r % 2].addr}?job=node-uneven-limit`, worldSize: 3, rank: r })));
    } finally {
      delete process.env.PARAMSYNC_SCRATCH_BYTES;
    }
    const all3 = (fn) => Promise.all(ws.map((w, r) => fn(w, r)));
    // Rank 0 sends rank 1 just over the limit's share of a rank, everyone else one element.
    const big = Math.floor(limit / (4 * 3)) + 1;
    const ins = (r) => [0, 1, 2].map((j) => (r === 0 && j === 1 ? big : 1));
    const outs = (r) => [0, 1, 2].map((s) => (r === 1 && s === 0 ? big : 1));
    const sum = (a) => a.reduce((x, y) => x + y, 0);
    for (let round = 0; round < 2; round++) {
      const got = await Promise.allSettled(ws.map((w, r) => w.allToAllSingle(
        new Int32Array(sum(outs(r))), new Int32Array(sum(ins(r))),
        { outputSplitSizes: outs(r), inputSplitSizes: ins(r) })));
      got.forEach((g, r) => {
        assert.strictEqual(g.status, 'rejected', `round ${round}, rank ${r}`);
        assert.strictEqual(g.reason.codeName, 'RESOURCE_EXHAUSTED', String(g.reason));
        assert.match(g.reason.message, /--max-tensor-bytes/);
      });
      ws.forEach((w, r) => {
        assert.ok(w.scratchMem.every((b) => b.length < limit),
          `round ${round}, rank ${r}: the failed call's padded blocks kept`);
        assert.ok(!w.mem.mems.some((m) => m.size >= limit),
          `round ${round}, rank ${r}: a padded block still registered`);
      });
      // Uneven calls within the limit go on right.
      const o = ws.map((_, r) => new Int32Array(sum([0, 1, 2].map((s) => s + r + 1))));
      await all3((w, r) => w.allToAllSingle(o[r], Int32Array.from([0, 1, 2].flatMap((j) =>
        new Array(r + j + 1).fill(10 * r + j))), {
        outputSplitSizes: [0, 1, 2].map((s) => s + r + 1),
        inputSplitSizes: [0, 1, 2].map((j) => r + j + 1) }));
      o.forEach((x, r) => assert.deepStrictEqual(Array.from(x), [0, 1, 2].flatMap((s) =>
        new Array(s + r + 1).fill(10 * s + r)), `round ${round}, rank ${r}: after the limit`));
    }
    // Padded blocks (each side n * 4 * big bytes) of at most cap are kept for the next
    // call, larger ones let go.
    for (const pad of [cap - cap / 4, cap + cap / 8]) {
      const big = Math.floor(pad / (4 * 3));
      const ins2 = (r) => [0, 1, 2].map((j) => (r === 0 && j === 1 ? big : 1));
      const outs2 = (r) => [0, 1, 2].map((s) => (r === 1 && s === 0 ? big : 1));
      const o = ws.map((_, r) => new Int32Array(sum(outs2(r))));
      await all3((w, r) => w.allToAllSingle(o[r], Int32Array.from(ins2(r).flatMap((k, j) =>
        new Array(k).fill(10 * r + j))), { outputSplitSizes: outs2(r), inputSplitSizes: ins2(r) }));
      const want = pad <= cap ? 2 : 0;
      o.forEach((x, r) => {
        assert.deepStrictEqual(Array.from(x), outs2(r).flatMap((k, s) =>
          new Array(k).fill(10 * s + r)), `padded ${pad}, rank ${r}`);
        const kept = ws[r].scratchMem.filter((b) => b.length >= pad).length;
        assert.strictEqual(kept, want, `padded ${pad} (at most ${cap} kept), rank ${r}: kept`);
        const live = ws[r].mem.mems.filter((m) => m.size >= pad).length;
        assert.strictEqual(live, want, `padded ${pad}, rank ${r}: allocations left`);
      });
    }
  } finally {
    await Promise.all(ws.map((w) => w.destroy()));
    for (const a of agents) await a.stop();
    await coord.stop();
  }
});
