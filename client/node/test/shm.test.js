'use strict';
// The shared-memory path: payloads of 64 KiB and more go through a segment the
// agent maps, not gRPC frames. The daemon's /metrics says which way the bytes
// went; every element is checked; PARAMSYNC_SHM=0 takes frames again.
const test = require('node:test');
const assert = require('node:assert');
const fs = require('fs');
const dist = require('..');
const { daemonWithMetrics, scrapeMetrics, haveDaemon, worlds } = require('./helpers');

const N = 2;
let daemon;
let metricsUrl;
let ws;

test.before(async () => {
  [daemon, metricsUrl] = await daemonWithMetrics();
  if (daemon) ws = await worlds(dist, daemon.addr, 'node-shm', N);
});
test.after(async () => {
  delete process.env.PARAMSYNC_SHM;
  if (ws) await Promise.all(ws.map((w) => w.destroy()));
  if (daemon) await daemon.stop();
});

function needDaemon(t) {
  if (!haveDaemon(t, daemon)) return false;
  assert.ok(metricsUrl, `the daemon announced no metrics address:\n${daemon.log()}`);
  return true;
}

const all = (fn) => Promise.all(ws.map((w, r) => fn(w, r)));

/** Payload bytes between workers and the agent so far: as gRPC frames, and through
 * shared memory (mapped or through the segments' files), both directions. */
async function scrape(url) {
  const m = await scrapeMetrics(url);
  const sum = (name, labels) => labels.reduce((acc, l) => {
    const v = m.get(`${name}{${l}}`);
    assert.ok(v !== undefined, `no ${name}{${l}} in /metrics`);
    return acc + v;
  }, 0);
  return {
    grpc: sum('paramsync_payload_bytes_total',
      ['direction="received",link="worker"', 'direction="sent",link="worker"']),
    shm: sum('paramsync_shm_bytes_total', ['direction="received",access="mapped"',
      'direction="sent",access="mapped"', 'direction="received",access="file"',
      'direction="sent",access="file"']),
  };
}

// The agent counts a sent frame when gRPC reports it sent, which can come just
// after the worker has it: read until the counts hold still.
async function settled(url) {
  let last = await scrape(url);
  for (;;) {
    await new Promise((r) => setTimeout(r, 100));
    const now = await scrape(url);
    if (now.grpc === last.grpc && now.shm === last.shm) return now;
    last = now;
  }
}

/** Runs fn between scrapes of url; resolves to the bytes that went each way meanwhile. */
async function bytesOf(fn, url = metricsUrl) {
  const before = await settled(url);
  await fn();
  const after = await settled(url);
  return { grpc: after.grpc - before.grpc, shm: after.shm - before.shm };
}

function namesLeft() {
  try {
    return fs.readdirSync('/dev/shm').filter((n) => n.startsWith(`paramsync.${process.pid}.`));
  } catch (e) {
    return [];
  }
}

const n = 300001; // 1.2 MiB of float32: a few segment pages, not a multiple of them
function filled(r, k = n) {
  const x = new Float32Array(k);
  for (let i = 0; i < k; i++) x[i] = (r + 1) * ((i % 1000) + 1);
  return x;
}

// Every kind with a payload, each element checked. Resolves when all are done.
async function everyKind() {
  const xs = ws.map((_, r) => filled(r));
  await all((w, r) => w.allReduce(xs[r]));
  for (const x of xs) {
    assert.strictEqual(x[0], 3);
    assert.strictEqual(x[n - 1], 3 * ((n - 1) % 1000 + 1));
  }
  const b = ws.map((_, r) => (r === 1 ? filled(1) : new Float32Array(n)));
  await all((w, r) => w.broadcast(b[r], 1));
  b.forEach((x) => assert.deepStrictEqual(x, filled(1)));
  const red = ws.map((_, r) => filled(r));
  await all((w, r) => w.reduce(red[r], 0, { op: dist.ReduceOp.MAX }));
  assert.deepStrictEqual(red[0], filled(1));
  assert.deepStrictEqual(red[1], filled(1)); // not the root: its input stays
  const ag = ws.map(() => new Float32Array(N * n));
  await all((w, r) => w.allGatherIntoTensor(ag[r], filled(r)));
  const want = new Float32Array(N * n);
  want.set(filled(0), 0);
  want.set(filled(1), n);
  ag.forEach((x) => assert.deepStrictEqual(x, want));
  const rs = ws.map(() => new Float32Array(n));
  await all((w, r) => w.reduceScatterTensor(rs[r], want));
  rs.forEach((x, r) => assert.deepStrictEqual(x, filled(r).map((v) => 2 * v)));
  const a2a = ws.map(() => new Float32Array(N * n));
  await all((w, r) => w.allToAllSingle(a2a[r], r ? want.map((v) => -v) : want));
  a2a.forEach((x, r) => {
    assert.deepStrictEqual(x.subarray(0, n), filled(r));
    assert.deepStrictEqual(x.subarray(n), filled(r).map((v) => -v));
  });
  const g = [new Float32Array(n), new Float32Array(n)];
  await all((w, r) => w.gather(filled(r), r === 1 ? g : null, 1));
  g.forEach((x, r) => assert.deepStrictEqual(x, filled(r)));
  const sc = ws.map(() => new Float32Array(n));
  await all((w, r) => w.scatter(sc[r], r === 0 ? [filled(5), filled(6)] : null, 0));
  sc.forEach((x, r) => assert.deepStrictEqual(x, filled(5 + r)));
  const got = new Float32Array(n);
  await Promise.all([ws[0].send(filled(3), 1), ws[1].recv(got, 0)]);
  assert.deepStrictEqual(got, filled(3));
}

test('every kind through shared memory: no payload byte in gRPC frames', async (t) => {
  if (!needDaemon(t)) return;
  const moved = await bytesOf(everyKind);
  assert.strictEqual(moved.grpc, 0, `${moved.grpc} payload bytes went as gRPC frames`);
  assert.ok(moved.shm > 10 * 4 * n, `only ${moved.shm} bytes through shared memory`);
  ws.forEach((w) => {
    assert.ok(w.shm.fd !== null && !w.shm.disabled, `no segment: ${w.shm.refused}`);
    assert.ok(w.shm.size >= 2 * 4 * n && w.shm.size <= 8 * 4 * n, `segment of ${w.shm.size}`);
  });
  assert.deepStrictEqual(namesLeft(), [], 'segment names left in /dev/shm');
});

test('PARAMSYNC_SHM=0 takes gRPC frames; small payloads ring the doorbell or take frames',
  async (t) => {
    if (!needDaemon(t)) return;
    process.env.PARAMSYNC_SHM = '0';
    let moved;
    const rung = ws.map((w) => w.doorbellRung);
    try {
      moved = await bytesOf(everyKind);
    } finally {
      delete process.env.PARAMSYNC_SHM;
    }
    assert.strictEqual(moved.shm, 0);
    assert.ok(moved.grpc > 10 * 4 * n, `only ${moved.grpc} bytes as frames`);
    assert.deepStrictEqual(ws.map((w) => w.doorbellRung), rung, 'a doorbell rang');
    // 4 KB: under the 64 KiB a call takes the segment for, over the doorbell's 2 KiB. The
    // doorbell takes it through the segment; without the native helper it goes as frames.
    const small = ws.map((_, r) => filled(r, 1000));
    moved = await bytesOf(() => all((w, r) => w.allReduce(small[r])));
    small.forEach((x) => assert.deepStrictEqual(x, filled(2, 1000)));
    if (dist.hasDoorbell) {
      assert.strictEqual(moved.grpc, 0);
      assert.strictEqual(moved.shm, 2 * N * 4000);
      ws.forEach((w, r) => assert.strictEqual(w.doorbellRung, rung[r] + 1));
    } else {
      assert.strictEqual(moved.shm, 0);
      assert.strictEqual(moved.grpc, 2 * N * 4000);
    }
  });

test('collectives in flight together: a segment each (the first, 3 spares), then frames',
  async (t) => {
    if (!needDaemon(t)) return;
    // Five all_reduces at once on each rank, with ops that tell them apart.
    const ops = [dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.SUM,
      dist.ReduceOp.MAX];
    const xs = ops.map((_, i) => ws.map((_w, r) => filled(r + i)));
    const moved = await bytesOf(() => all((w, r) => Promise.all(ops.map((op, i) =>
      w.allReduce(xs[i][r], { op })))));
    ops.forEach((op, i) => {
      const [lo, hi] = [filled(i), filled(1 + i)];
      const want = op === dist.ReduceOp.SUM ? lo.map((v, j) => v + hi[j])
        : op === dist.ReduceOp.MAX ? hi : lo;
      xs[i].forEach((x) => assert.deepStrictEqual(x, want, `all_reduce ${i} of 5 in flight`));
    });
    // Four segments for five collectives: on each rank one takes frames, unless one of the
    // first four was done before it came (a doorbell answers in well under a millisecond,
    // while the doorbells made for the others are still being offered to the agent).
    const rankCall = 2 * 4 * n; // one rank's input and output as frames
    assert.ok(moved.grpc % rankCall === 0 && moved.grpc <= N * rankCall,
      `${moved.grpc} bytes as frames: all but one collective a rank should take a segment`);
    assert.ok(moved.shm >= 4 * 2 * N * 4 * n, `${moved.shm} bytes through shared memory`);
    // At most the three spares the agent keeps slots for; fewer when a segment freed
    // early served a later collective (the doorbells made meanwhile take a call each).
    ws.forEach((w) => {
      const made = w.spares.segs.filter((x) => x.fd !== null).length;
      assert.ok(made <= 3, `${made} spare segments`);
    });
  });

test('a failed ShmAttach takes frames for that call only; errors lose nothing', async (t) => {
  if (!needDaemon(t)) return;
  // Grow past the segment, with the offer failing once on rank 0 (the payload segment's
  // test: not taken directly from the arrays, which it would be at this size).
  const k = 8 * n; // 9.6 MB: more than any segment the tests above made
  const attach = ws[0].shm.attach;
  process.env.PARAMSYNC_SHM_DIRECT = '0';
  let offers = 0;
  ws[0].shm.attach = (...args) => {
    offers += 1;
    return offers === 1 ? Promise.reject(new Error('injected')) : attach(...args);
  };
  try {
    const xs = ws.map((_, r) => filled(r, k));
    const moved = await bytesOf(() => all((w, r) => w.allReduce(xs[r])));
    xs.forEach((x) => assert.deepStrictEqual(x, filled(2, k)));
    assert.strictEqual(moved.grpc, 2 * 4 * k, 'rank 0 should have taken frames');
    assert.ok(!ws[0].shm.disabled, 'a failure other than a refusal turned the path off');
    // The daemon's errors (here: counts that differ) reject, and the next call works.
    const ys = ws.map((_, r) => filled(r, k - r));
    const res = await all((w, r) => w.allReduce(ys[r]).then(() => null, (e) => e));
    res.forEach((e) => assert.ok(e instanceof dist.ParamsyncError && /count/.test(e.message),
      `want a count mismatch, got ${e}`));
    assert.deepStrictEqual(ys[0], filled(0, k), 'a failed all_reduce changed its input');
    const zs = ws.map((_, r) => filled(r, k));
    const moved2 = await bytesOf(() => all((w, r) => w.allReduce(zs[r])));
    zs.forEach((x) => assert.deepStrictEqual(x, filled(2, k)));
    assert.strictEqual(moved2.grpc, 0);
    assert.ok(offers >= 2, `${offers} offers`);
  } finally {
    ws[0].shm.attach = attach;
    delete process.env.PARAMSYNC_SHM_DIRECT;
  }
  assert.deepStrictEqual(namesLeft(), []);
});

test('an agent that refuses the segment turns the path off for good', async (t) => {
  if (!needDaemon(t)) return;
  // Segments may be at most 2 x --max-tensor-bytes + 4 KiB: an all_to_all of
  // 1.4 MB each way fits the limit on payloads but needs a 4 MiB segment.
  const [d, url] = await daemonWithMetrics(['--max-tensor-bytes', '1536K']);
  assert.ok(url, `the daemon announced no metrics address:\n${d.log()}`);
  let mine;
  try {
    mine = await worlds(dist, d.addr, 'node-shm-refused', N);
    const k = 350000;
    const ins = mine.map((_, r) => filled(r, k));
    const outs = mine.map(() => new Float32Array(k));
    let moved = await bytesOf(
      () => Promise.all(mine.map((w, r) => w.allToAllSingle(outs[r], ins[r]))), url);
    const h = k / 2; // a block
    outs.forEach((o, r) => {
      assert.deepStrictEqual(o.subarray(0, h), filled(0, k).subarray(r * h, (r + 1) * h));
      assert.deepStrictEqual(o.subarray(h), filled(1, k).subarray(r * h, (r + 1) * h));
    });
    assert.strictEqual(moved.shm, 0);
    assert.strictEqual(moved.grpc, 2 * N * 4 * k);
    mine.forEach((w) => assert.ok(w.shm.disabled && /size/.test(w.shm.refused),
      `not turned off: ${w.shm.refused}`));
    // A collective the limit would allow still takes frames: no new offer.
    const xs = mine.map((_, r) => filled(r, 50000));
    moved = await bytesOf(() => Promise.all(mine.map((w, r) => w.allReduce(xs[r]))), url);
    xs.forEach((x) => assert.deepStrictEqual(x, filled(2, 50000)));
    assert.strictEqual(moved.shm, 0);
    assert.strictEqual(moved.grpc, 2 * N * 4 * 50000);
    assert.deepStrictEqual(namesLeft(), []);
  } finally {
    if (mine) await Promise.all(mine.map((w) => w.destroy()));
    await d.stop();
  }
});
