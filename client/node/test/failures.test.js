'use strict';
// Failures become errors that name the rank: a collective's deadline, and a rank
// whose membership stream breaks (MEMBER_LOST).
const test = require('node:test');
const assert = require('node:assert');
const dist = require('..');
const { startDaemon, haveDaemon, worlds } = require('./helpers');

test('a rank that never arrives: DEADLINE_EXCEEDED naming it', async (t) => {
  const d = await startDaemon();
  if (!haveDaemon(t, d)) return;
  const ws = await worlds(dist, d.addr, 'node-timeout', 2, { timeout: 1500 });
  try {
    const t0 = Date.now();
    const err = await ws[0].allReduce(new Float32Array(2)).then(() => null, (e) => e);
    assert.ok(err instanceof dist.ParamsyncError, String(err));
    assert.strictEqual(err.codeName, 'DEADLINE_EXCEEDED');
    assert.match(err.details, /rank 1/);
    assert.ok(Date.now() - t0 >= 1000 && Date.now() - t0 < 10000);
  } finally {
    await Promise.all(ws.map((w) => w.destroy()));
    await d.stop();
  }
});

test('a rank whose stream breaks: in-flight and later collectives fail naming it', async (t) => {
  const d = await startDaemon();
  if (!haveDaemon(t, d)) return;
  const ws = await worlds(dist, d.addr, 'node-lost', 3);
  try {
    const inflight = ws[0].allReduce(new Float32Array(4));
    const other = ws[2].allReduce(new Float32Array(4));
    setTimeout(() => ws[1].abort(), 200);
    for (const s of await Promise.allSettled([inflight, other])) {
      const err = s.reason;
      assert.strictEqual(s.status, 'rejected');
      assert.ok(err instanceof dist.ParamsyncError, String(err));
      assert.strictEqual(err.codeName, 'ABORTED');
      assert.match(err.message, /rank 1/);
    }
    // MEMBER_LOST has arrived by now: a new collective fails at once, without a call.
    await new Promise((r) => setTimeout(r, 500));
    const t0 = Date.now();
    await assert.rejects(ws[0].barrier(), (e) => /rank 1/.test(e.message) && /lost/.test(e.message));
    assert.ok(Date.now() - t0 < 100);
  } finally {
    await Promise.all([ws[0].destroy(), ws[2].destroy()]);
    await d.stop();
  }
});

test('an event loop kept busy past the liveness timeout: the error says why', async (t) => {
  const d = await startDaemon(['--liveness-timeout-ms', '1000']);
  if (!haveDaemon(t, d)) return;
  const ws = await worlds(dist, d.addr, 'node-busy', 2);
  try {
    await Promise.all(ws.map((w) => w.barrier()));
    const end = Date.now() + 2500; // no ping is answered meanwhile, by either rank
    while (Date.now() < end);
    const errs = await Promise.all(ws.map((w) => w.allReduce(new Float32Array(2))
      .then(() => null, (e) => e)));
    for (const err of errs) {
      assert.ok(err instanceof dist.ParamsyncError, String(err));
      assert.match(err.message, /connection to the agent at .* broke/);
      assert.match(err.message, /keepalive/);
      assert.match(err.message, /liveness-timeout-ms/);
      assert.match(err.message, /worker thread/);
    }
  } finally {
    await Promise.all(ws.map((w) => w.destroy()));
    await d.stop();
  }
});
