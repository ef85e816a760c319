'use strict';
// Direct barriers: ranks on one agent meet at barriers on a page of shared memory they all
// map (the C client's client/barrier.c, the same page), none reaching the agent but the
// two per group that set the page up (an all_gather and an all_reduce).
const test = require('node:test');
const assert = require('node:assert');
const dist = require('..');
const { worlds, fixture, loseRank1, scrapeMetrics, runNode } = require('./helpers');

const f = fixture(test, dist, { native: true });

/** Barriers the daemon served so far. */
async function agentBarriers() {
  const m = await scrapeMetrics(f.url);
  return m.get('paramsync_collectives_total{kind="barrier",code="OK"}') || 0;
}

/** n ranks of job as Worlds of this process, past their world group's page setup (the
 * first two barriers) and one barrier on it. */
async function pastSetup(job, n, extra = {}) {
  const ws = await worlds(dist, f.daemon.addr, job, n, extra);
  for (let i = 0; i < 3; i++) await Promise.all(ws.map((w) => w.barrier()));
  return ws;
}

test('barriers of three ranks meet on their page: world, subgroup, in flight together',
  async (t) => {
    if (!f.ready(t)) return;
    const ws = await worlds(dist, f.daemon.addr, 'node-barrier', 3);
    try {
      const before = await agentBarriers();
      const evens = await Promise.all(ws.map((w) => w.newGroup([0, 2])));
      for (let i = 0; i < 3; i++) {
        await Promise.all(ws.map((w) => w.barrier()));
        await Promise.all([0, 2].map((r) => ws[r].barrier({ group: evens[r] })));
      }
      // Each rank in turn comes last: no other rank's barrier resolves before it came.
      for (let late = 0; late < 3; late++) {
        let came = false;
        const others = ws.map((w, r) => (r === late ? null
          : w.barrier().then(() => assert.ok(came, `rank ${r} left before rank ${late} came`))));
        await new Promise((res) => setTimeout(res, 100));
        came = true;
        await Promise.all([...others.filter(Boolean), ws[late].barrier()]);
      }
      // Several in flight on each rank, awaited in any order.
      const many = ws.map((w) => [w.barrier(), w.barrier(), w.barrier()]);
      await Promise.all(many.map((ps) => Promise.all(ps.reverse())));
      for (let i = 0; i < 50; i++) await Promise.all(ws.map((w) => w.barrier()));
      assert.strictEqual(await agentBarriers(), before, 'barriers reached the agent');
      // Several Worlds in this process: none waits on the loop's thread.
      assert.deepStrictEqual(ws.map((w) => w.barrierMetNow), [0, 0, 0]);
      // A rank that never comes: the others fail at their deadline, naming it.
      const late = await pastSetup('node-barrier-late', 3, { timeout: 1500 });
      try {
        const t0 = Date.now();
        const errs = await Promise.all([0, 1].map((r) => late[r].barrier()
          .then(() => null, (e) => e)));
        for (const e of errs) {
          assert.ok(e instanceof dist.ParamsyncError, String(e));
          assert.strictEqual(e.codeName, 'DEADLINE_EXCEEDED');
          assert.match(e.message, /rank 2 did not arrive within 1500 ms \(met directly/);
        }
        assert.ok(Date.now() - t0 >= 1000 && Date.now() - t0 < 10000);
      } finally {
        await Promise.all(late.map((w) => w.destroy()));
      }
    } finally {
      await Promise.all(ws.map((w) => w.destroy()));
    }
  });

test('a rank that calls an all_reduce where the others meet at a direct barrier: every ' +
  'rank fails at once, and the next barrier meets', async (t) => {
  if (!f.ready(t)) return;
  const ws = await pastSetup('node-barrier-mismatch', 3, { timeout: 2000 });
  try {
    const t0 = Date.now();
    const sleep = (ms) => new Promise((res) => setTimeout(res, ms));
    const errs = await Promise.all(ws.map((w, r) => (r === 2
      ? w.allReduce(new Float32Array([1]))
      : sleep(100).then(() => w.barrier())).then(() => null, (e) => e)));
    for (const e of errs) {
      assert.ok(e instanceof dist.ParamsyncError, String(e));
      assert.strictEqual(e.codeName, 'FAILED_PRECONDITION');
      assert.match(e.message, /called barrier/);
      assert.match(e.message, /called all_reduce/);
    }
    assert.ok(Date.now() - t0 < 1000, `failed after ${Date.now() - t0} ms (the deadline: 2 s)`);
    await Promise.all(ws.map((w) => w.barrier()));
  } finally {
    await Promise.all(ws.map((w) => w.destroy()));
  }
});

test('a rank lost while the others wait at a direct barrier: ABORTED naming it',
  async (t) => {
    if (!f.ready(t)) return;
    const ws = await pastSetup('node-barrier-lost', 3);
    try {
      await loseRank1(ws, (w) => w.barrier(), 200);
    } finally {
      await Promise.all([ws[0].destroy(), ws[2].destroy()]);
    }
  });

test('PARAMSYNC_DIRECT_BARRIER=0 on one rank: every barrier goes through the agent',
  async (t) => {
    if (!f.ready(t)) return;
    // Rank 2 in a process of its own with the switch, doing the same ten barriers.
    const child = runNode(`
      const dist = require('.');
      (async () => {
        const w = await dist.World.init({
          initMethod: 'tcp://${f.daemon.addr}?job=node-barrier-off', worldSize: 3, rank: 2 });
        for (let i = 0; i < 10; i++) await w.barrier();
        console.log(JSON.stringify({ sets: w.barrierSets }));
        await w.destroy();
      })().catch((e) => { console.error(e); process.exit(1); });`,
    { PARAMSYNC_DIRECT_BARRIER: '0' });
    const ws = await Promise.all([0, 1].map((rank) => dist.World.init({
      initMethod: `tcp://${f.daemon.addr}?job=node-barrier-off`, worldSize: 3, rank })));
    try {
      const before = await agentBarriers();
      for (let i = 0; i < 10; i++) await Promise.all(ws.map((w) => w.barrier()));
      const c = await child;
      assert.strictEqual(c.code, 0, c.stderr);
      const { sets } = JSON.parse(c.stdout.trim().split('\n').pop());
      assert.strictEqual(sets[2], 0, `rank 2 is in a barrier set: ${sets}`);
      assert.ok(sets[0] !== 0 && sets[0] === sets[1], `ranks 0 and 1 share no set: ${sets}`);
      assert.strictEqual(await agentBarriers() - before, 30);
    } finally {
      await Promise.all(ws.map((w) => w.destroy()));
    }
  });

test('a World destroyed while its direct barrier waits: the barrier rejects, saying so',
  async (t) => {
    if (!f.ready(t)) return;
    const ws = await pastSetup('node-barrier-destroyed', 2);
    try {
      const waiting = ws[0].barrier().then(() => null, (e) => e);
      await new Promise((res) => setTimeout(res, 100));
      await ws[0].destroy();
      const e = await waiting;
      assert.ok(e instanceof dist.ParamsyncError, String(e));
      assert.match(e.message, /destroyed/);
    } finally {
      await ws[1].destroy();
    }
  });

test('ranks each in a process of their own: lone barriers are met on the loop\'s thread',
  async (t) => {
    if (!f.ready(t)) return;
    const rank = (r, us) => runNode(`
      const dist = require('.');
      (async () => {
        const w = await dist.World.init({ initMethod: 'tcp://${f.daemon.addr}?job=node-bar-now-' +
          '${us}', worldSize: 2, rank: ${r} });
        for (let i = 0; i < 300; i++) await w.barrier();
        console.log(JSON.stringify({ now: w.barrierMetNow }));
        await w.destroy();
      })().catch((e) => { console.error(e); process.exit(1); });`,
    { PARAMSYNC_NODE_WAIT_NOW_US: us });
    for (const us of ['10000', '0']) {
      const out = (await Promise.all([0, 1].map((r) => rank(r, us)))).map((o) => {
        assert.strictEqual(o.code, 0, o.stderr);
        return JSON.parse(o.stdout);
      });
      // Waiting up to 10 ms, the later rank comes meanwhile; with 0 none is waited for.
      const now = out.reduce((n, o) => n + o.now, 0);
      if (us === '0') assert.strictEqual(now, 0);
      else assert.ok(now > 0, `no barrier was met while the loop's thread waited: ${now}`);
    }
  });
