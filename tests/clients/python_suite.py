#!/usr/bin/python3
"""The Python client (paramsync.distributed) against a real paramsyncd.

    python_suite.py --python VENV_PY --paramsyncd BIN [--transport grpc|shm] SCENARIO

Scenarios (each its own ctest test): collectives, groups, async, p2p, torch, registered, doorbell,
local_errors, daemon_errors, objects, uneven, timeout, member_lost, init_methods, launcher,
shm_reuse, shm_paths, peer, peer_unreadable, peer_registered. With --transport the workers run with PARAMSYNC_SHM=0 (grpc) or
shared memory on (shm) and check, from the daemon's /metrics, that their big
payloads went that way; the driver checks that no segment name of theirs is
left in /dev/shm.
The driver starts a daemon and N worker processes running
`python_suite.py --worker SCENARIO` with the installed client (VENV_PY is
the venv the client_python_install test made); every worker checks exact
results itself and exits non-zero on the first mismatch.
"""
import argparse
import os
import re
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import pyharness as H  # noqa: E402

# ---------------------------------------------------------------------------------- workers

NP_DTYPES = ["float32", "float64", "float16", "int8", "uint8", "int16", "int32", "int64", "bool"]
FLOATS = {"float32", "float64", "float16", "bfloat16"}


def _w_init(**kw):
    import paramsync.distributed as dist
    dist.init_process_group("paramsync", **kw)
    return dist


def expect_eq(got, want, what):
    import numpy as np
    got = np.asarray(got)
    want = np.asarray(want)
    if got.dtype != want.dtype or got.shape != want.shape or not np.array_equal(
            got, want, equal_nan=got.dtype.kind == "f"):
        raise AssertionError("%s: got %r (%s), want %r (%s)" % (what, got, got.dtype, want,
                                                              want.dtype))


def raises(exc, fn, *a, **kw):
    """fn's error message when it raises exc; AssertionError when it does not."""
    try:
        fn(*a, **kw)
    except exc as e:
        return str(e)
    raise AssertionError("%s(%s) did not raise %s" % (fn.__name__, a, exc.__name__))


def inputs(dtype, r, n=5):
    """Rank r's input: small values, so sums, products and float16 are exact."""
    import numpy as np
    i = np.arange(n)
    v = ((r + 1) * (i + 3)) % 7 + 1
    if dtype == "bool":
        return (v % 2 == 1)
    if dtype in ("int8", "int16", "int32", "int64"):
        v = v * (1 if r % 2 == 0 else -1)  # negatives too
    return v.astype(dtype)


def reference(op, arrays):
    """What the reduction must give (numpy, same dtype, wrapping like torch)."""
    import numpy as np
    a = np.stack(arrays)
    dt = a.dtype
    if dt == np.bool_:
        return {"SUM": a.any(0), "PRODUCT": a.all(0), "MIN": a.all(0), "MAX": a.any(0),
                "BAND": a.all(0), "BOR": a.any(0), "BXOR": np.bitwise_xor.reduce(a, 0)}[op]
    if op == "SUM":
        return np.add.reduce(a, 0, dtype=dt)
    if op == "PRODUCT":
        return np.multiply.reduce(a, 0, dtype=dt)
    if op == "MIN":
        return a.min(0)
    if op == "MAX":
        return a.max(0)
    if op == "AVG":
        return (a.astype(np.float64).sum(0) / len(arrays)).astype(dt)
    return {"BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}[op].reduce(a, 0)


def data(k, count, dtype, salt=0):
    """Rank k's big input: values under 2**16, so sums of a few ranks are exact in float32."""
    import numpy as np
    v = (np.arange(count, dtype=np.int64) * 7 + k * 1009 + salt * 31) % 65521
    if dtype in ("int8", "uint8", "int16"):
        v = v % 100
    return v.astype(dtype)


def on_path(dist, what, fn, grpc, shm=(0, 0)):
    """Runs fn (one collective; every rank calls on_path) between barriers and checks,
    from the daemon's /metrics, which way its payload went: (received, sent) bytes
    between the workers and the agent must be `grpc` with PARAMSYNC_SHM=0 and `shm`
    (nothing, unless a rank is on gRPC) through shared memory. Also checks that this
    process left no segment name in /dev/shm. Without SUITE_METRICS only runs fn."""
    url = os.environ.get("SUITE_METRICS")
    r = dist.get_rank()
    if not url:
        fn()
        return
    want = shm if os.environ["SUITE_TRANSPORT"] == "shm" else grpc

    def settled():
        # The agent counts a sent frame when gRPC reports it sent, which can come
        # just after the worker has it: read until the counts hold still.
        last = H.payload_bytes(url)
        while True:
            time.sleep(0.1)
            now = H.payload_bytes(url)
            if now == last:
                return now
            last = now
    dist.barrier()
    before = settled() if r == 0 else None
    dist.barrier()
    fn()
    dist.barrier()  # every rank has its answer: the daemon has read and written it all
    if r == 0:
        after = settled()
        got = (after[0] - before[0], after[1] - before[1])
        if got != want:
            raise AssertionError("%s: %d bytes from workers to the agent and %d back; want %s "
                                 "(%s)" % (what, got[0], got[1], want,
                                           os.environ["SUITE_TRANSPORT"]))
    left = H.shm_names([os.getpid()])
    assert not left, "%s: segment names left in /dev/shm: %s" % (what, left)
    dist.barrier()


def big_collectives(dist):
    """Every kind with a payload over 64 KiB (the shared-memory path unless
    PARAMSYNC_SHM=0), every element checked, and which way the bytes went."""
    import numpy as np
    r, n = dist.get_rank(), dist.get_world_size()

    c = (1 << 20) + 3  # 4 MiB of float32, in place through the segment
    x = data(r, c, "float32")
    on_path(dist, "big all_reduce", lambda: dist.all_reduce(x), (n * 4 * c, n * 4 * c))
    expect_eq(x, sum(data(k, c, "float32") for k in range(n)), "big all_reduce")
    x = data(r, c, "float32", salt=1)  # a second round, in the same segment
    on_path(dist, "big all_reduce MAX", lambda: dist.all_reduce(x, op=dist.ReduceOp.MAX),
            (n * 4 * c, n * 4 * c))
    expect_eq(x, np.maximum.reduce([data(k, c, "float32", 1) for k in range(n)]),
              "big all_reduce MAX")

    c = 100_003
    x = data(r, c, "int64")
    on_path(dist, "big reduce", lambda: dist.reduce(x, dst=1), (n * 8 * c, 8 * c))
    expect_eq(x, sum(data(k, c, "int64") for k in range(n)) if r == 1 else data(r, c, "int64"),
              "big reduce")

    c = 150_001
    x = data(r, c, "float64") if r == n - 1 else np.zeros(c, np.float64)
    on_path(dist, "big broadcast", lambda: dist.broadcast(x, src=n - 1),
            (8 * c, (n - 1) * 8 * c))
    expect_eq(x, data(n - 1, c, "float64"), "big broadcast")

    c = 40_001
    outs = [np.full(c, -1, np.int32) for _ in range(n)]
    on_path(dist, "big all_gather", lambda: dist.all_gather(outs, data(r, c, "int32")),
            (n * 4 * c, n * n * 4 * c))
    for k in range(n):
        expect_eq(outs[k], data(k, c, "int32"), "big all_gather [%d]" % k)

    c = 70_001
    out = np.zeros(n * c, np.uint8)
    mine = out[r * c:(r + 1) * c]  # the input is a view of the output
    mine[:] = data(r, c, "uint8")
    on_path(dist, "big all_gather_into_tensor", lambda: dist.all_gather_into_tensor(out, mine),
            (n * c, n * n * c))
    expect_eq(out, np.concatenate([data(k, c, "uint8") for k in range(n)]),
              "big all_gather_into_tensor")

    # In place: results land where input not yet sent lies (as frames the input
    # must be copied first; through the segment it is already there).
    c = 262_147
    x = np.concatenate([data(r * n + k, c, "int32") for k in range(n)])
    on_path(dist, "big all_to_all_single in place", lambda: dist.all_to_all_single(x, x),
            (n * n * 4 * c, n * n * 4 * c))
    expect_eq(x, np.concatenate([data(k * n + r, c, "int32") for k in range(n)]),
              "big all_to_all_single in place")

    c = 30_000
    lst = [np.zeros(c, np.float32) for _ in range(n)] if r == 0 else None
    on_path(dist, "big gather", lambda: dist.gather(data(r, c, "float32"), lst, dst=0),
            (n * 4 * c, n * 4 * c))
    if r == 0:
        for k in range(n):
            expect_eq(lst[k], data(k, c, "float32"), "big gather [%d]" % k)

    c = 50_001
    lst = [data(k, c, "int16", salt=7) for k in range(n)] if r == 1 else None
    x = np.zeros(c, np.int16)
    on_path(dist, "big scatter", lambda: dist.scatter(x, lst, src=1), (n * 2 * c, n * 2 * c))
    expect_eq(x, data(r, c, "int16", salt=7), "big scatter")

    c = 30_001
    ins = [data(r + 10 * k, c, "int32") for k in range(n)]
    o = np.zeros(c, np.int32)
    on_path(dist, "big reduce_scatter", lambda: dist.reduce_scatter(o, ins),
            (n * n * 4 * c, n * 4 * c))
    expect_eq(o, sum(data(k + 10 * r, c, "int32") for k in range(n)), "big reduce_scatter")

    c = 20_000
    inp = data(r, n * c, "float64")
    o = np.zeros(c, np.float64)
    on_path(dist, "big reduce_scatter_tensor",
            lambda: dist.reduce_scatter_tensor(o, inp, op=dist.ReduceOp.MAX),
            (n * n * 8 * c, n * 8 * c))
    expect_eq(o, np.maximum.reduce([data(k, n * c, "float64") for k in range(n)])[
        r * c:(r + 1) * c], "big reduce_scatter_tensor")

    c = 10_000
    ins = [data(r * n + j, c, "int64") for j in range(n)]
    outs = [np.zeros(c, np.int64) for _ in range(n)]
    on_path(dist, "big all_to_all", lambda: dist.all_to_all(outs, ins),
            (n * n * 8 * c, n * n * 8 * c))
    for j in range(n):
        expect_eq(outs[j], data(j * n + r, c, "int64"), "big all_to_all [%d]" % j)

    c = 20_000
    inp = np.concatenate([data(r * n + j, c, "float32") for j in range(n)])
    o = np.zeros(n * c, np.float32)
    on_path(dist, "big all_to_all_single", lambda: dist.all_to_all_single(o, inp),
            (n * n * 4 * c, n * n * 4 * c))
    expect_eq(o, np.concatenate([data(j * n + r, c, "float32") for j in range(n)]),
              "big all_to_all_single")

    c = 500_000
    x = data(0, c, "float32") if r == 0 else np.zeros(c, np.float32)

    def send_recv():
        if r == 0:
            dist.send(x, dst=n - 1)
        elif r == n - 1:
            assert dist.recv(x, src=None) == 0
    on_path(dist, "big send/recv", send_recv, (4 * c, 4 * c))
    if r in (0, n - 1):
        expect_eq(x, data(0, c, "float32"), "big send/recv")


def ops_for(dtype):
    if dtype in FLOATS:
        return ["SUM", "PRODUCT", "MIN", "MAX", "AVG"]
    return ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]


def threads_started(fn):
    """Runs fn() and returns how many threads it started in this process."""
    import threading
    started = [0]
    start = threading.Thread.start

    def counting(self):
        started[0] += 1
        return start(self)

    threading.Thread.start = counting
    try:
        fn()
    finally:
        threading.Thread.start = start
    return started[0]


def w_collectives():
    import numpy as np
    dist = _w_init()
    r, n = dist.get_rank(), dist.get_world_size()
    assert dist.is_initialized()
    checked = 0
    # all_reduce: every dtype x every op it has.
    for dt in NP_DTYPES:
        for op in ops_for(dt):
            x = inputs(dt, r)
            if op == "AVG":  # sums divisible by n: the average is exact
                x = (np.arange(5) + 3 * r).astype(dt)
            want = reference(op, [inputs(dt, k) if op != "AVG" else
                                  (np.arange(5) + 3 * k).astype(dt) for k in range(n)])
            ret = dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
            assert ret is None
            expect_eq(x, want, "all_reduce %s %s" % (dt, op))
            checked += 1
    # MIN/MAX propagate NaN (torch's rule).
    for op in ("MIN", "MAX"):
        x = np.array([1.0, 2.0, 3.0], np.float32)
        if r == 1:
            x[0] = np.nan
        dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
        assert np.isnan(x[0]) and not np.isnan(x[1:]).any(), "NaN %s: %r" % (op, x)
    # Integer overflow wraps.
    x = np.array([100, -128, 127], np.int8)
    dist.all_reduce(x)
    expect_eq(x, (np.array([100, -128, 127], np.int8) * np.int8(n)).astype(np.int8),
              "int8 wrap")
    # A collective of one frame is a unary-request call: no thread of gRPC's sends its
    # half-close after the frame (an agent forwarding it would wait for that).
    if os.environ["SUITE_TRANSPORT"] == "grpc":
        x = np.ones(4, np.float32)
        small = threads_started(lambda: [dist.all_reduce(x) for _ in range(5)])
        assert small == 0, "5 small all_reduces started %d threads" % small
    # Multi-frame payloads (several 1 MiB frames, not a multiple of the frame size): a
    # request stream, fed by a thread of gRPC's.
    big = np.full(1_300_001, r + 1, np.float64)
    big[-1] = r
    started = threads_started(lambda: dist.all_reduce(big, op=dist.ReduceOp.SUM))
    assert os.environ["SUITE_TRANSPORT"] != "grpc" or started >= 1, \
        "a multi-frame all_reduce over gRPC started no thread: %d" % started
    assert big[0] == n * (n + 1) / 2 and big[-1] == n * (n - 1) / 2 and (
        big[:-1] == big[0]).all(), "big all_reduce"
    # A 0-d array and an empty one.
    z = np.array(r + 1, np.int32)
    dist.all_reduce(z, op=dist.ReduceOp.MAX)
    assert int(z) == n, z
    e = np.zeros(0, np.float32)
    dist.all_reduce(e)
    big_collectives(dist)
    # broadcast from every root, multi-dimensional, and big.
    for root in range(n):
        x = np.full((2, 3), r * 10, np.int16)
        dist.broadcast(x, src=root)
        expect_eq(x, np.full((2, 3), root * 10, np.int16), "broadcast src %d" % root)
    x = np.arange(2_500_000, dtype=np.float32) * (1 if r == n - 1 else 0)
    dist.broadcast(x, src=n - 1)
    expect_eq(x, np.arange(2_500_000, dtype=np.float32), "big broadcast")
    # reduce: the result on dst only; the others' tensors are unchanged.
    for dst in range(n):
        x = inputs("int32", r)
        dist.reduce(x, dst=dst, op=dist.ReduceOp.SUM)
        want = reference("SUM", [inputs("int32", k) for k in range(n)]) if r == dst else \
            inputs("int32", r)
        expect_eq(x, want, "reduce dst %d" % dst)
    # all_gather (list and tensor forms).
    for dt in ("float32", "int64", "uint8", "bool"):
        outs = [np.zeros(3, dt) for _ in range(n)]
        dist.all_gather(outs, inputs(dt, r, 3))
        for k in range(n):
            expect_eq(outs[k], inputs(dt, k, 3), "all_gather %s [%d]" % (dt, k))
    out = np.zeros((n, 4), np.float64)
    dist.all_gather_into_tensor(out, np.full(4, r, np.float64))
    expect_eq(out, np.repeat(np.arange(n, dtype=np.float64), 4).reshape(n, 4),
              "all_gather_into_tensor")
    # gather to each dst.
    for dst in range(n):
        lst = [np.zeros(2, np.int64) for _ in range(n)] if r == dst else None
        dist.gather(np.array([r, -r], np.int64), lst, dst=dst)
        if r == dst:
            for k in range(n):
                expect_eq(lst[k], np.array([k, -k], np.int64), "gather dst %d [%d]" % (dst, k))
    # scatter from each src.
    for src in range(n):
        lst = [np.full(3, 100 * src + k, np.float32) for k in range(n)] if r == src else None
        x = np.zeros(3, np.float32)
        dist.scatter(x, lst, src=src)
        expect_eq(x, np.full(3, 100 * src + r, np.float32), "scatter src %d" % src)
    # reduce_scatter (list and tensor forms), several ops.
    for op in ("SUM", "MAX", "BXOR"):
        ins = [inputs("int32", r + 10 * k, 3) for k in range(n)]
        o = np.zeros(3, np.int32)
        dist.reduce_scatter(o, ins, op=getattr(dist.ReduceOp, op))
        want = reference(op, [inputs("int32", k + 10 * r, 3) for k in range(n)])
        expect_eq(o, want, "reduce_scatter %s" % op)
    inp = np.arange(n * 2, dtype=np.float32) + r
    o = np.zeros(2, np.float32)
    dist.reduce_scatter_tensor(o, inp, op=dist.ReduceOp.SUM)
    expect_eq(o, sum(np.arange(n * 2, dtype=np.float32) + k for k in range(n))[2 * r:2 * r + 2],
              "reduce_scatter_tensor")
    # all_to_all (lists) and all_to_all_single.
    ins = [np.array([r * 10 + j, -1], np.int64) for j in range(n)]
    outs = [np.zeros(2, np.int64) for _ in range(n)]
    dist.all_to_all(outs, ins)
    for j in range(n):
        expect_eq(outs[j], np.array([j * 10 + r, -1], np.int64), "all_to_all [%d]" % j)
    inp = np.array([r * 100 + j for j in range(n) for _ in range(2)], np.int16)
    o = np.zeros(2 * n, np.int16)
    dist.all_to_all_single(o, inp)
    expect_eq(o, np.array([j * 100 + r for j in range(n) for _ in range(2)], np.int16),
              "all_to_all_single")
    # barrier: nobody passes before the last rank arrives.
    t0 = time.monotonic()
    if r == 0:
        time.sleep(0.4)
    dist.barrier()
    if r != 0:
        assert time.monotonic() - t0 > 0.3, "barrier let rank %d through early" % r
    dist.destroy_process_group()
    assert not dist.is_initialized()
    print("rank %d: %d all_reduce (op, dtype) pairs and every collective checked" % (r, checked))


def w_groups():
    import warnings
    import numpy as np
    dist = _w_init()
    r, n = dist.get_rank(), dist.get_world_size()
    assert n == 4
    g02 = dist.new_group([0, 2])
    g_rev = dist.new_group([3, 2, 1, 0])  # group ranks reversed
    g1 = dist.new_group([1])
    if r in (0, 2):
        assert dist.get_rank(g02) == [0, 2].index(r) and dist.get_world_size(g02) == 2
        x = np.array([r + 1], np.int32)
        dist.all_reduce(x, group=g02)
        expect_eq(x, np.array([4], np.int32), "all_reduce in [0, 2]")
        y = np.array([r], np.float32)
        dist.broadcast(y, src=2, group=g02)  # src is a global rank
        expect_eq(y, np.array([2], np.float32), "broadcast src 2 in [0, 2]")
        if r == 0:
            dist.send(np.array([7, 8], np.int64), dst=2, group=g02)
        else:
            z = np.zeros(2, np.int64)
            assert dist.recv(z, src=None, group=g02) == 0  # the global rank
            expect_eq(z, np.array([7, 8], np.int64), "recv in [0, 2]")
    else:
        assert g02 is dist.GroupMember.NON_GROUP_MEMBER
        assert dist.get_rank(g02) == -1 and dist.get_world_size(g02) == -1
        x = np.array([5], np.int32)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert dist.all_reduce(x, group=g02) is None  # torch: warn and do nothing
        assert caught and "does not belong" in str(caught[0].message), caught
        expect_eq(x, np.array([5], np.int32), "non-member tensor unchanged")
    assert dist.get_rank(g_rev) == 3 - r
    lst = [np.zeros(1, np.int32) for _ in range(4)]
    dist.all_gather(lst, np.array([r], np.int32), group=g_rev)
    expect_eq(np.concatenate(lst), np.array([3, 2, 1, 0], np.int32), "all_gather reversed group")
    lst = [np.zeros(1, np.int32) for _ in range(4)] if r == 1 else None
    dist.gather(np.array([r * 2], np.int32), lst, dst=1, group=g_rev)
    if r == 1:
        expect_eq(np.concatenate(lst), np.array([6, 4, 2, 0], np.int32), "gather reversed")
    if r == 1:
        assert dist.get_world_size(g1) == 1 and dist.get_rank(g1) == 0
        x = np.array([3.5], np.float64)
        dist.all_reduce(x, group=g1)
        expect_eq(x, np.array([3.5]), "group of one")
    # Big payloads in groups share the rank's one segment with the world's.
    c = 65_536
    x = data(r, c, "float32")
    on_path(dist, "big all_reduce in [0, 2]",
            lambda: dist.all_reduce(x, group=g02) if r in (0, 2) else None,
            (2 * 4 * c, 2 * 4 * c))
    expect_eq(x, data(0, c, "float32") + data(2, c, "float32") if r in (0, 2) else
              data(r, c, "float32"), "big all_reduce in [0, 2]")
    lst = [np.zeros(c, np.int32) for _ in range(4)]
    on_path(dist, "big all_gather reversed",
            lambda: dist.all_gather(lst, data(r, c, "int32"), group=g_rev),
            (4 * 4 * c, 16 * 4 * c))
    for k in range(4):
        expect_eq(lst[k], data(3 - k, c, "int32"), "big all_gather reversed [%d]" % k)
    assert dist.get_process_group_ranks(g_rev) == [3, 2, 1, 0]
    assert dist.get_global_rank(g_rev, 0) == 3 and dist.get_group_rank(g_rev, 3) == 0
    # World collectives still line up after group traffic.
    x = np.array([1], np.int64)
    dist.all_reduce(x)
    expect_eq(x, np.array([4], np.int64), "world after groups")
    dist.destroy_process_group()
    print("rank %d: groups ok" % r)


def w_async():
    import numpy as np
    dist = _w_init()
    r, n = dist.get_rank(), dist.get_world_size()
    xs = [np.full(1000 * (k + 1), k + r, np.int64) for k in range(6)]
    works = [dist.all_reduce(x, async_op=True) for x in xs]
    b = np.array([r], np.int32)
    wb = dist.broadcast(b, src=1, async_op=True)
    g = [np.zeros(1, np.int32) for _ in range(n)]
    wg = dist.all_gather(g, np.array([r * 3], np.int32), async_op=True)
    wbar = dist.barrier(async_op=True)
    for k, w in reversed(list(enumerate(works))):  # waited in the other order
        assert w.wait() is True and w.is_completed() and w.is_success()
        expect_eq(xs[k], np.full(1000 * (k + 1), n * k + n * (n - 1) // 2, np.int64),
                  "async all_reduce %d" % k)
    wbar.wait()
    wg.wait()
    wb.wait()
    expect_eq(b, np.array([1], np.int32), "async broadcast")
    expect_eq(np.concatenate(g), np.arange(n, dtype=np.int32) * 3, "async all_gather")
    assert wg.result() == g
    # Big ones at once: one takes the segment, the others gRPC frames.
    c = 100_003
    xs = [data(r, c, "float64", salt=k) for k in range(4)]
    works = [dist.all_reduce(x, async_op=True) for x in xs]
    bc = data(r, c, "int32") if r == 0 else np.zeros(c, np.int32)
    works.append(dist.broadcast(bc, src=0, async_op=True))
    for w in reversed(works):
        w.wait()
    for k in range(4):
        expect_eq(xs[k], sum(data(q, c, "float64", salt=k) for q in range(n)),
                  "big async all_reduce %d" % k)
    expect_eq(bc, data(0, c, "int32"), "big async broadcast")
    fut = dist.all_reduce(np.ones(3), async_op=True).get_future()
    fut.result(timeout=30)
    # A work whose collective fails raises from wait(), every time.
    bad = dist.all_reduce(np.ones(2 + r, np.float32), async_op=True)
    for _ in range(2):
        try:
            bad.wait()
            raise AssertionError("mismatched async all_reduce succeeded")
        except dist.ParamsyncError as e:
            assert "count" in e.details, e.details
    assert bad.is_completed() and not bad.is_success()
    dist.destroy_process_group()
    print("rank %d: async ok" % r)


def w_p2p():
    import numpy as np
    dist = _w_init()
    r, n = dist.get_rank(), dist.get_world_size()
    right, left = (r + 1) % n, (r - 1) % n
    # A ring with isend + blocking recv.
    s = dist.isend(np.array([r, r * r], np.int64), dst=right)
    x = np.zeros(2, np.int64)
    assert dist.recv(x, src=left) == left
    s.wait()
    expect_eq(x, np.array([left, left * left], np.int64), "ring")
    # Several messages to one peer arrive in order.
    if r == 0:
        for k in range(5):
            dist.send(np.array([k], np.int32), dst=1)
    elif r == 1:
        for k in range(5):
            y = np.zeros(1, np.int32)
            dist.recv(y, src=0)
            expect_eq(y, np.array([k], np.int32), "ordered recv %d" % k)
    # Any source: rank 0 hears from everyone, learns who sent what.
    # Rank n-1 sends twice, and its second message may well come before
    # another rank's first: check the senders as a multiset.
    if r == 0:
        seen = []
        for _ in range(n - 1):
            y = np.zeros(3, np.float32)
            src = dist.recv(y)  # src=None
            seen.append((src, y))
        y = np.zeros(3, np.float32)
        w = dist.irecv(y)
        w.wait()
        seen.append((w.source_rank(), y))
        assert sorted(src for src, _ in seen) == list(range(1, n)) + [n - 1], seen
        for src, y in seen:
            expect_eq(y, np.full(3, src, np.float32), "any-source from %d" % src)
    else:
        dist.send(np.full(3, r, np.float32), dst=0)
        if r == n - 1:
            dist.send(np.full(3, r, np.float32), dst=0)
    # Tags.
    if r == 0:
        dist.send(np.array([5], np.int64), dst=1, tag=5)
    elif r == 1:
        y = np.zeros(1, np.int64)
        dist.recv(y, src=0, tag=5)
        expect_eq(y, np.array([5], np.int64), "tag 5")
    # A big message (many frames) and batch_isend_irecv.
    big = np.arange(3_000_000, dtype=np.float32) if r == 0 else np.zeros(3_000_000, np.float32)

    def big_send():
        if r == 0:
            dist.send(big, dst=n - 1)
        elif r == n - 1:
            dist.recv(big, src=0)
    on_path(dist, "big send/recv", big_send, (big.nbytes, big.nbytes))
    if r == n - 1:
        expect_eq(big, np.arange(3_000_000, dtype=np.float32), "big send/recv")
    y = np.zeros(1, np.int32)
    ops = [dist.P2POp(dist.isend, np.array([r], np.int32), right),
           dist.P2POp(dist.irecv, y, left)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    expect_eq(y, np.array([left], np.int32), "batch_isend_irecv")
    dist.barrier()
    dist.destroy_process_group()
    print("rank %d: p2p ok" % r)


def w_torch():
    import torch
    dist = _w_init()
    r, n = dist.get_rank(), dist.get_world_size()
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
              torch.uint8, torch.int16, torch.int32, torch.int64]
    for dt in dtypes:
        t = torch.arange(4, dtype=dt) + r
        dist.all_reduce(t)
        want = (torch.arange(4, dtype=torch.float64) * n + n * (n - 1) / 2).to(dt)
        assert t.dtype == dt and torch.equal(t, want), "torch all_reduce %s: %s vs %s" % (
            dt, t, want)
    # bfloat16 is accumulated in float32 and rounded to nearest even:
    # 256 + 1 + 1 = 258 (exact in float32), which rounds to 258 in bfloat16
    # (8 bits of mantissa: 256, 258, 260 are representable).
    t = torch.tensor([256.0 if r == 0 else 1.0], dtype=torch.bfloat16)
    dist.all_reduce(t)
    assert t.item() == 256.0 + (n - 1), t
    t = torch.tensor([r % 2 == 0, False])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    assert t.tolist() == [True, False], t
    # In place on views that are contiguous, and with requires_grad.
    base = torch.zeros(2, 3)
    row = base[1]
    row += r + 1
    dist.all_reduce(row)
    assert base[1].tolist() == [n * (n + 1) / 2] * 3 and base[0].tolist() == [0.0] * 3
    # Big tensors (through the segment unless PARAMSYNC_SHM=0), bfloat16 too.
    c = (1 << 18) + 1
    for dt in (torch.float32, torch.bfloat16, torch.int64):
        t = torch.from_numpy(data(r, c, "int64") % 64).to(dt)
        on_path(dist, "big torch all_reduce %s" % dt, lambda: dist.all_reduce(t),
                (n * t.element_size() * c, n * t.element_size() * c))
        want = sum(torch.from_numpy(data(k, c, "int64") % 64) for k in range(n)).to(dt)
        assert torch.equal(t, want), "big torch all_reduce %s" % dt
    t = torch.from_numpy(data(1, c, "float32")) if r == 1 else torch.zeros(c)
    on_path(dist, "big torch broadcast", lambda: dist.broadcast(t, src=1),
            (4 * c, (n - 1) * 4 * c))
    assert torch.equal(t, torch.from_numpy(data(1, c, "float32"))), "big torch broadcast"
    p = torch.ones(3, requires_grad=True)
    dist.all_reduce(p.data)
    dist.broadcast(p, src=0)
    lst = [torch.empty(2, dtype=torch.bfloat16) for _ in range(n)]
    dist.all_gather(lst, torch.tensor([r, -r], dtype=torch.bfloat16))
    assert [x.tolist() for x in lst] == [[float(k), float(-k)] for k in range(n)], lst
    # Mixed with numpy in one job (same dtype on the wire).
    import numpy as np
    if r == 0:
        x = np.array([1.5, 2.5], np.float32)
    else:
        x = torch.tensor([0.5, 0.5])
    dist.all_reduce(x)
    assert [float(v) for v in x] == [1.5 + 0.5 * (n - 1), 2.5 + 0.5 * (n - 1)], x
    # dtype mapping both ways.
    from paramsync import _tensor as T
    for dt in dtypes + [torch.bool]:
        assert T.from_wire(T.to_wire(dt), "torch") == dt
    for bad in (torch.complex64, torch.qint8):
        try:
            dist.all_reduce(torch.zeros(2, dtype=bad) if bad != torch.qint8 else
                            torch.quantize_per_tensor(torch.zeros(2), 1.0, 0, torch.qint8))
            raise AssertionError("%s accepted" % bad)
        except TypeError as e:
            assert "does not support" in str(e), e
    try:
        dist.all_reduce(torch.zeros(4, 4).t())
        raise AssertionError("non-contiguous tensor accepted")
    except ValueError as e:
        assert "contiguous" in str(e)
    dist.destroy_process_group()
    print("rank %d: torch ok" % r)


def w_objects():
    import pickle
    import warnings
    import numpy as np
    dist = _w_init()
    r, n = dist.get_rank(), dist.get_world_size()
    assert n == 4

    # Objects of different sizes, one of them large (a segment's worth under shm).
    def obj(k):
        return {"rank": k, "blob": bytes([k]) * (300_000 if k == 1 else k), "arr": np.arange(k)}

    got = [None] * n
    assert dist.all_gather_object(got, obj(r)) is None
    for k in range(n):
        assert got[k]["rank"] == k and got[k]["blob"] == obj(k)["blob"], k
        expect_eq(got[k]["arr"], np.arange(k), "all_gather_object arr %d" % k)
    # src and dst are global ranks; lists are in group rank order.
    g_rev = dist.new_group([3, 2, 1, 0])
    g02 = dist.new_group([0, 2])
    lst = [None] * n if r == 2 else None
    dist.gather_object(("from", r), lst, dst=2, group=g_rev)
    if r == 2:
        assert lst == [("from", 3), ("from", 2), ("from", 1), ("from", 0)], lst
    bl = [None, "x", 3.5, {"k": [1, 2]}] if r == 3 else [0, 0, 0, 0]
    dist.broadcast_object_list(bl, src=3)
    assert bl == [None, "x", 3.5, {"k": [1, 2]}], bl
    empty = []
    dist.broadcast_object_list(empty, src=0)
    assert empty == []
    out = ["unset"]
    ins = ["to group rank %d" % i for i in range(n)] if r == 1 else ["ignored"]
    dist.scatter_object_list(out, ins, src=1, group=g_rev)
    assert out == ["to group rank %d" % (3 - r)], out
    # A rank outside the group: warned, nothing done, the list untouched.
    mine = ["two"] if r == 2 else ["mine"]
    if r in (0, 2):
        dist.broadcast_object_list(mine, src=2, group=g02)
        assert mine == ["two"], mine
        g2 = [None, None]
        dist.all_gather_object(g2, r * 10, group=g02)
        assert g2 == [0, 20], g2
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert dist.all_gather_object(mine, r, group=g02) is None
        assert caught and "does not belong" in str(caught[0].message), caught
        assert mine == ["mine"], mine
    # Local errors, raised on every rank before anything is sent.
    assert "has 1 elements; the group has 4" in raises(ValueError, dist.all_gather_object,
                                                       [None], r)
    assert "must be a list" in raises(TypeError, dist.all_gather_object, (None,) * n, r)
    assert "at least one" in raises(ValueError, dist.scatter_object_list, [], None, src=0)
    assert "not part of the group" in raises(ValueError, dist.broadcast_object_list, [1],
                                             src=n)
    if r == 0:
        assert "must be specified" in raises(ValueError, dist.gather_object, r, None, dst=0)
        assert "must be specified" in raises(ValueError, dist.scatter_object_list, [None],
                                             None, src=0)
    else:
        assert "must NOT" in raises(ValueError, dist.gather_object, r, [None] * n, dst=0)
    raises((pickle.PicklingError, AttributeError), dist.all_gather_object, [None] * n,
           lambda: r)
    # Bytes that are not a pickle (a Node.js rank's objects, say) say whose they were.
    assert "from rank 3 could not be unpickled" in raises(
        ValueError, dist._unpickled, np.frombuffer(b"\x80\x04junk", np.uint8), 6, "x", 3)
    # The daemon's check: lists of different lengths fail alike on every rank.
    try:
        dist.broadcast_object_list([r] * (1 + r % 2), src=0)
        raise AssertionError("broadcast_object_list of different lengths succeeded")
    except dist.ParamsyncError as e:
        assert "count" in e.details, e.details
    # None of the local errors reached the daemon, and the job goes on.
    got = [None] * n
    dist.all_gather_object(got, "after %d" % r)
    assert got == ["after %d" % k for k in range(n)], got
    dist.destroy_process_group()
    print("rank %d: objects ok" % r)


def w_uneven():
    """all_to_all_single with uneven splits (torch's form): small and large, torch and
    numpy, async; splits the ranks disagree on fail on every rank alike."""
    import numpy as np
    dist = _w_init()
    r, n = dist.get_rank(), dist.get_world_size()
    assert n == 3

    def rows_of(sender, receiver, k, width):
        """The k rows sender sends receiver, each width int32 values naming them."""
        base = (sender * 10 + receiver) * 1_000_000
        return (base + np.arange(k * width, dtype=np.int32)).reshape(k, width)

    for scale, width in ((1, 3), (20_000, 4)):  # the second: up to ~2 MB a rank
        ins = [scale * (r + 2 * j) for j in range(n)]     # rows r sends to j
        outs = [scale * (j + 2 * r) for j in range(n)]    # rows j sends to r
        x = np.concatenate([rows_of(r, j, ins[j], width) for j in range(n)])
        o = np.full((sum(outs), width), -1, np.int32)
        dist.all_to_all_single(o, x, outs, ins)
        expect_eq(o, np.concatenate([rows_of(j, r, outs[j], width) for j in range(n)]),
                  "uneven all_to_all_single x%d" % scale)
        o2 = np.full((sum(outs), width), -1, np.int32)
        w = dist.all_to_all_single(o2, x, outs, ins, async_op=True)
        w.wait()
        assert w.is_success()
        expect_eq(o2, o, "async uneven all_to_all_single x%d" % scale)
    # Equal splits given: every block is of the largest size, so the call reads and writes
    # the tensors themselves; in place, the output goes through a padded buffer.
    for in_place in (False, True):
        x = (np.arange(6, dtype=np.int16) + 10 * r).reshape(6, 1)
        o = x if in_place else np.zeros((6, 1), np.int16)
        dist.all_to_all_single(o, x, [2, 2, 2], [2, 2, 2])
        expect_eq(o.ravel(), np.array([2 * r, 2 * r + 1, 10 + 2 * r, 11 + 2 * r, 20 + 2 * r,
                                       21 + 2 * r], np.int16),
                  "all_to_all_single with equal splits%s" % (" in place" if in_place else ""))
    # Only input splits: the output splits equal (rows / n); every rank sends j 2 rows.
    x = np.arange(6, dtype=np.float64) + 10 * r
    o = np.zeros(6)
    dist.all_to_all_single(o, x, None, [2, 2, 2])
    expect_eq(o, np.array([2 * r, 2 * r + 1, 10 + 2 * r, 11 + 2 * r, 20 + 2 * r, 21 + 2 * r],
                          np.float64), "all_to_all_single with input splits only")
    # Rank 0 expects 2 rows from rank 1, which sends it 1: every rank fails alike, naming
    # the pair, before any data moves.
    ins = [1, 1, 1]
    outs = [1, 2 if r == 0 else 1, 1]
    said = raises(ValueError, dist.all_to_all_single, np.zeros(sum(outs), np.int32),
                  np.zeros(3, np.int32), outs, ins)
    assert "group rank 1 sends 1 rows to group rank 0, whose output_split_sizes expect 2" \
        in said, said
    # Local errors: sizes that do not add up, a count that is not the group's.
    assert "adding up" in raises(ValueError, dist.all_to_all_single, np.zeros(3), np.zeros(3),
                                 [1, 1, 2], [1, 1, 1])
    assert "has 1 sizes; the group has 3" in raises(ValueError, dist.all_to_all_single,
                                                    np.zeros(3), np.zeros(3), [3], [3])
    # The job goes on.
    y = np.array([r], np.int64)
    dist.all_reduce(y)
    expect_eq(y, np.array([3], np.int64), "all_reduce after uneven all_to_all errors")
    dist.destroy_process_group()
    print("rank %d: uneven all_to_all ok" % r)


def w_local_errors():
    import numpy as np
    dist = _w_init()
    r, n = dist.get_rank(), dist.get_world_size()

    assert "numpy.ndarray or a torch" in raises(TypeError, dist.all_reduce, [1, 2, 3])
    assert "uint16" in raises(TypeError, dist.all_reduce, np.zeros(3, np.uint16))
    assert "complex" in raises(TypeError, dist.broadcast, np.zeros(3, np.complex64), 0)
    raises(TypeError, dist.all_reduce, np.zeros(3, ">i4"))  # not native byte order
    assert "contiguous" in raises(ValueError, dist.all_reduce, np.zeros((4, 4))[:, 1])
    assert "read-only" in raises(ValueError, dist.all_reduce,
                                 np.frombuffer(b"\0" * 8, np.float32))
    assert "BAND" in raises(TypeError, dist.all_reduce, np.zeros(2, np.float32),
                            op=dist.ReduceOp.BAND)
    raises(ValueError, dist.all_reduce, np.zeros(2), op=42)
    assert "not part of the group" in raises(ValueError, dist.broadcast, np.zeros(1), src=n)
    assert "itself" in raises(ValueError, dist.send, np.zeros(1), dst=r)
    raises(ValueError, dist.send, np.zeros(1), dst=(r + 1) % n, tag=-1)
    assert "has 1 tensors" in raises(ValueError, dist.all_gather, [np.zeros(1)], np.zeros(1))
    assert "elements" in raises(ValueError, dist.all_gather,
                                [np.zeros(2) for _ in range(n)], np.zeros(1))
    assert "dtype" in raises(TypeError, dist.all_gather,
                             [np.zeros(1, np.int32) for _ in range(n)], np.zeros(1))
    assert "lists of tensors" in raises(TypeError, dist.all_to_all, np.zeros(n), np.zeros(n))
    raises(ValueError, dist.all_to_all_single, np.zeros(n), np.zeros(n),
           output_split_sizes=[1] * (n - 1) + [2])
    if r == 0:
        assert "must be specified" in raises(ValueError, dist.gather, np.zeros(1), None, dst=0)
        assert "must NOT" in raises(ValueError, dist.gather, np.zeros(1), [np.zeros(1)] * n,
                                    dst=1)
    raises(ValueError, dist.new_group, [0, 0])
    raises(ValueError, dist.new_group, [n])
    assert "give group_size" in raises(ValueError, dist.new_subgroups)
    assert "must not exceed" in raises(ValueError, dist.new_subgroups, n + 1)
    raises(ValueError, dist.new_subgroups, 0)
    assert "cannot be empty" in raises(ValueError, dist.new_subgroups_by_enumeration, [])
    assert "Rank 1 has appeared in both subgroup [0, 1] and [1]" in raises(
        ValueError, dist.new_subgroups_by_enumeration, [[0, 1], [1]])
    raises(RuntimeError, dist.init_process_group, "paramsync")  # twice
    assert not (dist.is_gloo_available() or dist.is_nccl_available() or
                dist.is_mpi_available() or dist.is_ucc_available()) and dist.is_available()
    assert dist.is_torchelastic_launched() == ("TORCHELASTIC_RUN_ID" in os.environ)
    # None of that reached the daemon: the next collective is still seq 0 everywhere.
    x = np.array([1], np.int32)
    dist.all_reduce(x)
    expect_eq(x, np.array([n], np.int32), "all_reduce after local errors")
    # No group was made by the refused calls: the next ones line up on every rank.
    mine, subs = dist.new_subgroups(1)
    assert len(subs) == n and dist.get_world_size(mine) == 1 and subs[r] is mine, subs
    x = np.array([r + 5], np.int32)
    dist.all_reduce(x, group=mine)
    expect_eq(x, np.array([r + 5], np.int32), "all_reduce in a subgroup of one")
    dist.destroy_process_group()
    assert "not been initialized" in raises(RuntimeError, dist.get_rank)
    assert "backend" in raises(ValueError, dist.init_process_group, "gloo")
    print("rank %d: local errors ok" % r)


def w_daemon_errors():
    import grpc
    import numpy as np
    dist = _w_init()
    r, n = dist.get_rank(), dist.get_world_size()

    def daemon_error(fn, *a, **kw):
        try:
            fn(*a, **kw)
        except dist.ParamsyncError as e:
            assert isinstance(e, RuntimeError)
            return e
        raise AssertionError("%s did not fail" % fn.__name__)

    # Ranks disagree on the count: FAILED_PRECONDITION naming the ranks and the field.
    e = daemon_error(dist.all_reduce, np.ones(3 + r, np.float32))
    assert e.code == grpc.StatusCode.FAILED_PRECONDITION, e.code
    assert "count" in e.details and "rank" in e.details, e.details
    assert e.details in str(e) and "all_reduce (group 0, seq 0)" in str(e), str(e)
    # ... on the dtype.
    e = daemon_error(dist.broadcast, np.ones(2, np.float64 if r == 0 else np.float32), src=0)
    assert e.code == grpc.StatusCode.FAILED_PRECONDITION and "dtype" in e.details, e
    # ... on the op.
    e = daemon_error(dist.all_reduce, np.ones(2, np.int32),
                     op=dist.ReduceOp.SUM if r else dist.ReduceOp.MAX)
    assert e.code == grpc.StatusCode.FAILED_PRECONDITION and "op" in e.details, e
    # ... on the root.
    e = daemon_error(dist.broadcast, np.ones(2, np.int32), src=r)
    assert e.code == grpc.StatusCode.FAILED_PRECONDITION and "root" in e.details, e
    # An op the dtype does not have, which the client leaves to the daemon.
    e = daemon_error(dist.all_reduce, np.ones(2, np.int32), op=dist.ReduceOp.AVG)
    assert e.code == grpc.StatusCode.INVALID_ARGUMENT and "AVG" in e.details, e
    # send/recv that disagree on the dtype.
    if r < 2:
        if r == 0:
            e = daemon_error(dist.send, np.array([1, 2, 3]), dst=1)
        else:
            e = daemon_error(dist.recv, np.zeros(3, np.float32), src=0)
        assert e.code == grpc.StatusCode.FAILED_PRECONDITION, e
        assert "int64" in e.details and "float32" in e.details, e.details
    # Big payloads (through shared memory unless PARAMSYNC_SHM=0): the same errors,
    # and the next big collectives still get exact results.
    c = 100_000
    e = daemon_error(dist.all_reduce, data(r, c + r, "float32"))
    assert e.code == grpc.StatusCode.FAILED_PRECONDITION and "count" in e.details, e
    e = daemon_error(dist.broadcast, np.ones(c, np.float64 if r == 0 else np.int64), src=0)
    assert e.code == grpc.StatusCode.FAILED_PRECONDITION and "dtype" in e.details, e
    x = data(r, c, "float32")
    on_path(dist, "big all_reduce after errors", lambda: dist.all_reduce(x),
            (n * 4 * c, n * 4 * c))
    expect_eq(x, sum(data(k, c, "float32") for k in range(n)), "big all_reduce after errors")
    lst = [np.zeros(c, np.int32) for _ in range(n)]
    dist.all_gather(lst, data(r, c, "int32"))
    for k in range(n):
        expect_eq(lst[k], data(k, c, "int32"), "big all_gather after errors [%d]" % k)
    # The job goes on after errors.
    x = np.array([1], np.int64)
    dist.all_reduce(x)
    expect_eq(x, np.array([n], np.int64), "all_reduce after daemon errors")
    dist.destroy_process_group()
    print("rank %d: daemon errors ok" % r)


def w_timeout():
    import grpc
    import numpy as np
    from datetime import timedelta
    dist = _w_init(timeout=timedelta(seconds=2))
    r = dist.get_rank()
    if r == 1:
        time.sleep(4)  # never joins the all_reduce in time
        dist.destroy_process_group()
        print("rank 1: stayed away")
        return
    # monitored_barrier's own deadline, shorter than the World's 2 s.
    t0 = time.monotonic()
    try:
        dist.monitored_barrier(timeout=timedelta(milliseconds=400), wait_all_ranks=True)
        raise AssertionError("monitored_barrier without rank 1 succeeded")
    except dist.ParamsyncError as e:
        took = time.monotonic() - t0
        assert e.code == grpc.StatusCode.DEADLINE_EXCEEDED, e
        assert "rank 1 did not arrive within 400 ms" in e.details, e.details
        assert took < 1.5, took
    assert "positive" in raises(ValueError, dist.monitored_barrier, timeout=0)
    t0 = time.monotonic()
    try:
        dist.all_reduce(np.ones(3))
        raise AssertionError("all_reduce without rank 1 succeeded")
    except dist.ParamsyncError as e:
        took = time.monotonic() - t0
        assert e.code == grpc.StatusCode.DEADLINE_EXCEEDED, e
        assert "rank 1" in e.details, e.details
        assert 1.5 < took < 10, took
    print("rank 0: timed out as asked, naming rank 1, at monitored_barrier's deadline too")


def w_member_lost():
    import grpc
    import numpy as np
    dist = _w_init()
    r = dist.get_rank()
    if r == 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    # Rank 0: a collective in flight when rank 1 dies fails, naming it.
    t0 = time.monotonic()
    try:
        dist.all_reduce(np.ones(3))
        raise AssertionError("all_reduce with a dead rank succeeded")
    except dist.ParamsyncError as e:
        assert e.code == grpc.StatusCode.ABORTED, e
        assert "rank 1" in str(e), e
        took = time.monotonic() - t0
        assert took < 15, took
    # MEMBER_LOST (proto: "a stream that breaks marks the rank lost and every
    # other member gets MEMBER_LOST"): a collective started after it fails at
    # once, without waiting for the daemon.
    time.sleep(1.0)
    t0 = time.monotonic()
    try:
        dist.all_reduce(np.ones(3))
        raise AssertionError("all_reduce after MEMBER_LOST succeeded")
    except dist.ParamsyncError as e:
        took = time.monotonic() - t0
        assert "rank 1" in str(e) and "lost" in str(e), e
        assert took < 0.2, "no MEMBER_LOST: the collective went to the daemon (%.2fs): %s" % (
            took, e)
    print("rank 0: rank 1's death became errors naming it")


def w_init_methods():
    import numpy as np
    mode = os.environ["SUITE_INIT"]
    import paramsync.distributed as dist
    addr = os.environ["SUITE_ADDR"]
    r_env = int(os.environ["SUITE_RANK"])
    if mode == "tcp":
        dist.init_process_group("paramsync", init_method="tcp://" + addr + "?job=tcpjob",
                                rank=r_env, world_size=2)
    elif mode == "file":
        dist.init_process_group(init_method="file://" + os.environ["SUITE_FILE"], rank=r_env,
                                world_size=2)
    elif mode == "master":
        host, port = addr.rsplit(":", 1)
        os.environ.update(MASTER_ADDR=host, MASTER_PORT=port, WORLD_SIZE="2",
                          RANK=str(r_env), PARAMSYNC_JOB="masterjob")
        dist.init_process_group("paramsync")
    elif mode == "assign":  # no rank anywhere: the daemon assigns them
        dist.init_process_group("paramsync", init_method="tcp://%s?job=assign&world_size=2"
                                % addr)
    r = dist.get_rank()
    x = np.array([r + 1], np.int32)
    dist.all_reduce(x)
    expect_eq(x, np.array([3], np.int32), "all_reduce after %s init" % mode)
    if mode == "assign":
        print("assigned rank %d" % r)
    # Leave and join again in the same process (a new job incarnation).
    dist.destroy_process_group()
    dist.init_process_group("paramsync", init_method="tcp://%s?job=again-%s" % (addr, mode),
                            rank=r, world_size=2)
    x = np.array([r], np.float32)
    dist.broadcast(x, src=1)
    expect_eq(x, np.array([1], np.float32), "broadcast after re-init")
    dist.destroy_process_group()
    print("rank %d: %s init ok" % (r, mode))


def w_shm_reuse():
    """Ranks rewrite their arrays (and so their segment) right after each call returns,
    while rank 0, on gRPC frames and late to every call, still reads what they sent: the
    daemon must answer a rank only once nothing of its segment is left to read."""
    import numpy as np
    dist = _w_init()
    r, n = dist.get_rank(), dist.get_world_size()
    if r == 0:
        os.environ["PARAMSYNC_SHM"] = "0"  # read on every call; nothing else runs yet
    rounds, c = 4, (4 << 20) // 4 + 3  # 16 MiB of int32, odd
    b = 4 * c
    x = np.zeros(c, np.int32)

    def late():
        if r == 0:
            time.sleep(0.2)

    def sends():
        for k in range(rounds):
            if r != 0:
                x[:] = data(r, c, "int32", salt=100 + k)
                dist.send(x, dst=0, tag=k)
                x[:] = -1  # at once: the daemon holds the answer, not this array
                continue
            for src in range(1, n):
                late()
                y = np.zeros(c, np.int32)
                dist.recv(y, src=src, tag=k)
                expect_eq(y, data(src, c, "int32", salt=100 + k), "send %d from %d" % (k, src))
    # Senders through the segment, rank 0 on frames: nothing in from workers, all out.
    on_path(dist, "sends", sends, (rounds * (n - 1) * b, rounds * (n - 1) * b),
            shm=(0, rounds * (n - 1) * b))

    def broadcasts():
        for k in range(rounds):
            x[:] = data(1, c, "int32", salt=200 + k) if r == 1 else -7
            late()
            dist.broadcast(x, src=1)
            expect_eq(x, data(1, c, "int32", salt=200 + k), "broadcast %d" % k)
    on_path(dist, "broadcasts", broadcasts, (rounds * b, rounds * (n - 1) * b),
            shm=(0, rounds * b))

    def reduces():
        for k in range(rounds):
            x[:] = data(r, c, "int32", salt=300 + k)
            late()
            dist.reduce(x, dst=0)
            want = sum(data(q, c, "int32", salt=300 + k) for q in range(n)) if r == 0 else \
                data(r, c, "int32", salt=300 + k)
            expect_eq(x, want, "reduce %d" % k)
    on_path(dist, "reduces", reduces, (rounds * n * b, rounds * b), shm=(rounds * b, rounds * b))

    def all_reduces():
        for k in range(rounds):
            x[:] = data(r, c, "int32", salt=400 + k)
            late()
            dist.all_reduce(x)
            expect_eq(x, sum(data(q, c, "int32", salt=400 + k) for q in range(n)),
                      "all_reduce %d" % k)
    on_path(dist, "all_reduces", all_reduces, (rounds * n * b, rounds * n * b),
            shm=(rounds * b, rounds * b))

    def gathers():
        for k in range(rounds):
            x[:] = data(r, c, "int32", salt=500 + k)
            late()
            lst = [np.zeros(c, np.int32) for _ in range(n)] if r == 0 else None
            dist.gather(x, lst, dst=0)
            for q in range(n if r == 0 else 0):
                expect_eq(lst[q], data(q, c, "int32", salt=500 + k), "gather %d [%d]" % (k, q))
    on_path(dist, "gathers", gathers, (rounds * n * b, rounds * n * b),
            shm=(rounds * b, rounds * n * b))
    dist.destroy_process_group()
    print("rank %d: %d rounds of sends, broadcasts, reduces, all_reduces and gathers of "
          "16 MiB checked" % (r, rounds))


def w_uneven_limit():
    """An uneven all_to_all_single whose padded blocks are over the agents'
    --max-tensor-bytes (SUITE_LIMIT) though its own bytes are not (rank 0 sends rank 1
    just over the limit's share of a rank): every rank fails with RESOURCE_EXHAUSTED naming
    the limit, the padded blocks (empty() memory: ranks on two agents) are no longer
    mapped, and uneven calls within the limit go on right. Then $PARAMSYNC_SCRATCH_BYTES
    (under the limit): padded blocks of at most that are kept for the next call, larger
    ones let go; a value that is not a number of bytes fails init_process_group."""
    import numpy as np
    import paramsync.distributed as dist
    cap = os.environ["PARAMSYNC_SCRATCH_BYTES"]
    for bad in ("-1", "1G"):
        os.environ["PARAMSYNC_SCRATCH_BYTES"] = bad
        said = raises(ValueError, dist.init_process_group, "paramsync")
        assert "PARAMSYNC_SCRATCH_BYTES" in said, said
    os.environ["PARAMSYNC_SCRATCH_BYTES"] = cap
    cap = int(cap)
    dist = _w_init()
    r, n = dist.get_rank(), dist.get_world_size()
    limit = int(os.environ["SUITE_LIMIT"])
    big = limit // (4 * n) + 1
    ins = [big if (r, j) == (0, 1) else 1 for j in range(n)]
    outs = [big if (r, j) == (1, 0) else 1 for j in range(n)]
    mine = "/paramsync.%d." % os.getpid()

    def big_segments():
        with open("/proc/self/maps") as f:
            spans = [line.split()[0].split("-") for line in f if mine in line]
        return sum(int(b, 16) - int(a, 16) >= limit for a, b in spans)

    for round_ in range(2):
        said = raises(dist.ParamsyncError, dist.all_to_all_single,
                      np.zeros(sum(outs), np.int32), np.zeros(sum(ins), np.int32), outs, ins)
        assert "--max-tensor-bytes" in said, said
        assert big_segments() == 0, "round %d: %d segments of %d bytes and more still " \
            "mapped after the failed call" % (round_, big_segments(), limit)
        small = [r + j + 1 for j in range(n)]
        got = [j + r + 1 for j in range(n)]
        x = np.concatenate([np.full(k, 10 * r + j, np.int32) for j, k in enumerate(small)])
        o = np.full(sum(got), -1, np.int32)
        dist.all_to_all_single(o, x, got, small)
        expect_eq(o, np.concatenate([np.full(k, 10 * s + r, np.int32)
                                     for s, k in enumerate(got)]), "uneven after the limit")
    world = dist._world
    for pad in (cap - cap // 4, cap + cap // 8):  # padded bytes of each side: n * 4 * big
        big = pad // (4 * n)
        ins = [big if (r, j) == (0, 1) else 1 for j in range(n)]
        outs = [big if (r, j) == (1, 0) else 1 for j in range(n)]
        x = np.concatenate([np.full(k, 10 * r + j, np.int32) for j, k in enumerate(ins)])
        o = np.full(sum(outs), -1, np.int32)
        dist.all_to_all_single(o, x, outs, ins)
        expect_eq(o, np.concatenate([np.full(k, 10 * s + r, np.int32)
                                     for s, k in enumerate(outs)]), "uneven of %d" % pad)
        kept = sum(b.size >= pad for b in world.scratch_mem)
        want = 2 if pad <= cap else 0
        assert kept == want, "padded blocks of %d bytes (at most %d kept): %d kept, want %d" \
            % (pad, cap, kept, want)
        live = sum(m.size >= pad for m in world.mem.mems)
        assert live == want, "padded blocks of %d bytes: %d allocations left, want %d" \
            % (pad, live, want)
    dist.destroy_process_group()
    print("rank %d: uneven all_to_all over the limit refused, buffers let go" % r)


def w_relay_lost():
    """Rank 1's agent is not the job's hub: its barriers go to the hub agent on its
    doorbell's relay stream. Then rank 1 waits at a barrier rank 0 never comes to, the
    driver kills the hub agent, and rank 1 must fail soon, UNAVAILABLE or ABORTED naming
    the hub agent or rank 0, not wait for its 60 s timeout."""
    import grpc
    from datetime import timedelta
    dist = _w_init(timeout=timedelta(seconds=60))
    r = dist.get_rank()
    for _ in range(20):
        dist.barrier()
    if r == 0:
        print("rank 0: 20 barriers; staying away", flush=True)
        time.sleep(60)
        return
    print("rank 1: waiting", flush=True)
    t0 = time.monotonic()
    try:
        dist.barrier()
        raise AssertionError("a barrier without rank 0 succeeded")
    except dist.ParamsyncError as e:
        took = time.monotonic() - t0
        hub = os.environ["SUITE_HUB"]
        assert e.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED), e
        assert hub in str(e) or "rank 0" in str(e), e
        assert took < 10, took
        print("rank 1: failed %.2f s after it began waiting: %s" % (took, e), flush=True)


def w_shm_paths():
    """Rounds of big all_reduce and broadcast, every element checked; which way their
    bytes must go is the driver's to say (SUITE_TRANSPORT) or to check itself."""
    import numpy as np
    dist = _w_init()
    r, n = dist.get_rank(), dist.get_world_size()
    c = (1 << 18) + 5  # 1 MiB of float32
    for k in range(3):
        x = data(r, c, "float32", salt=k)
        on_path(dist, "all_reduce %d" % k, lambda: dist.all_reduce(x), (n * 4 * c, n * 4 * c))
        expect_eq(x, sum(data(q, c, "float32", salt=k) for q in range(n)), "all_reduce %d" % k)
        y = data(0, c, "float32", salt=k) if r == 0 else np.zeros(c, np.float32)
        on_path(dist, "broadcast %d" % k, lambda: dist.broadcast(y, src=0),
                (4 * c, (n - 1) * 4 * c))
        expect_eq(y, data(0, c, "float32", salt=k), "broadcast %d" % k)
    # The list forms of 12 MiB buffers go direct when the process segment is taken,
    # each buffer in its own place: through the agent the rank joined, which forwards
    # them to the job's hub when it is not the hub itself (split).
    w = dist._get_world()
    before = w.process.used
    list_forms(dist, np, r, n, 3 << 20, 0)
    # gather and scatter: root 0, and 12 MiB elsewhere, where that goes direct.
    went, want = w.process.used - before, 5 + 2 * (r == 0 or _shm_direct_min() <= 12 << 20)
    if os.environ.get("SUITE_TRANSPORT") == "grpc":
        assert went == 0, "%d list forms direct where shared memory is refused" % went
    elif any(x in w.process.refused for x in ("may not read", "not readable here")):
        print("rank %d: list forms direct SKIPPED: %s" % (r, w.process.refused))
    else:
        assert went == want, "%d of %d list forms direct (%s)" % (went, want, w.process.refused)
    dist.destroy_process_group()
    print("rank %d: 3 rounds of 1 MiB all_reduce and broadcast, and the list forms checked" % r)


def w_registered():
    """Tensors from dist.empty(): with shared memory the daemon reads and writes them in
    place (no payload bytes between workers and agent, and the process group's copying
    segment never made), input and output in two allocations too; with PARAMSYNC_SHM=0
    they are plain memory on gRPC frames. Every element checked; then free()'s refusals, the 64 the daemon shares per rank, and two
    collectives on one allocation at once."""
    import numpy as np
    dist = _w_init()
    r, n = dist.get_rank(), dist.get_world_size()
    shm = os.environ.get("SUITE_TRANSPORT") == "shm"
    c = (1 << 18) + 5  # 1 MiB of float32, odd
    x = dist.empty(c, "float32")
    assert x.shape == (c,) and x.dtype == np.float32 and not x.any(), "empty: not zeroed"
    assert dist.is_shared(x) == shm, "is_shared(empty()) is %s with shm=%s" % (
        dist.is_shared(x), shm)
    assert not dist.is_shared(np.zeros(4, np.float32)), "is_shared of a plain array"
    for k in range(3):
        x[:] = data(r, c, "float32", salt=k)
        on_path(dist, "all_reduce %d" % k, lambda: dist.all_reduce(x), (n * 4 * c, n * 4 * c))
        expect_eq(x, sum(data(q, c, "float32", salt=k) for q in range(n)), "all_reduce %d" % k)
        x[:] = data(0, c, "float32", salt=k) if r == 0 else 0
        on_path(dist, "broadcast %d" % k, lambda: dist.broadcast(x, src=0),
                (4 * c, (n - 1) * 4 * c))
        expect_eq(x, data(0, c, "float32", salt=k), "broadcast %d" % k)
    # all_gather with input and output in one allocation, apart.
    both = dist.empty((n + 1) * c, "int32")
    out, inp = both[:n * c], both[n * c:]
    inp[:] = data(r, c, "int32", salt=7)
    on_path(dist, "all_gather", lambda: dist.all_gather_into_tensor(out, inp),
            (n * 4 * c, n * n * 4 * c))
    for q in range(n):
        expect_eq(out[q * c:(q + 1) * c], data(q, c, "int32", salt=7), "all_gather [%d]" % q)
    # In place, torch's way: the input is this rank's block of the output. The agent
    # takes it without a copy (header.own_block), so the segment is still never made.
    whole = dist.empty(n * c, "int32")
    own = whole[r * c:(r + 1) * c]
    own[:] = data(r, c, "int32", salt=8)
    on_path(dist, "all_gather in place", lambda: dist.all_gather_into_tensor(whole, own),
            (n * 4 * c, n * n * 4 * c))
    for q in range(n):
        expect_eq(whole[q * c:(q + 1) * c], data(q, c, "int32", salt=8),
                  "all_gather in place [%d]" % q)
    # The list form on the chunks of one allocation, in order (apart from the input, then
    # the input one of them): one buffer to the agent, so in place too.
    out[:] = -1
    chunks = list(out.reshape(n, c))
    on_path(dist, "all_gather into chunks", lambda: dist.all_gather(chunks, inp),
            (n * 4 * c, n * n * 4 * c))
    for q in range(n):
        expect_eq(chunks[q], data(q, c, "int32", salt=7), "all_gather into chunks [%d]" % q)
    chunks = list(whole.reshape(n, c))
    chunks[r][:] = data(r, c, "int32", salt=9)
    on_path(dist, "all_gather into chunks in place", lambda: dist.all_gather(chunks, chunks[r]),
            (n * 4 * c, n * n * 4 * c))
    for q in range(n):
        expect_eq(chunks[q], data(q, c, "int32", salt=9), "all_gather into chunks in place [%d]"
                  % q)
    dist.free(whole)
    # Input and output from two empty() calls, reduce_scatter_tensor's way: the agent
    # writes the output into its own allocation (header.shm_out), nothing copied here.
    src, dst = dist.empty(n * c, "float32"), dist.empty(c, "float32")
    src[:] = np.concatenate([data(r, c, "float32", salt=10 + q) for q in range(n)])
    on_path(dist, "reduce_scatter between two allocations",
            lambda: dist.reduce_scatter_tensor(dst, src), (n * 4 * n * c, n * 4 * c))
    expect_eq(dst, sum(data(q, c, "float32", salt=10 + r) for q in range(n)),
              "reduce_scatter between two allocations")
    dist.free(src)
    dist.free(dst)
    w = dist._get_world()
    if shm:
        assert w.shm.size == 0, "a collective on empty() memory copied through the segment"
        m = H.scrape(os.environ["SUITE_METRICS"])
        got = int(m['paramsync_shm_bytes_total{direction="received",access="mapped"}'])
        assert got >= 4 * c, "the agent read %d bytes of shared memory" % got
        two = int(m.get('paramsync_shm_calls_total{segments="registered_two"}', 0))
        assert two >= n, "%d calls from two empty() allocations, want one a rank" % two

    dist.free(x)
    for bad in (x, np.zeros(4, np.float32), inp):  # inp: inside an allocation, not its start
        try:
            dist.free(bad)
        except ValueError as e:
            assert "empty()" in str(e), str(e)
        else:
            raise AssertionError("free of a tensor not (or no longer) from empty() passed")
    dist.free(out)  # its first element is the allocation's
    # 70 allocations: 64 shared per rank, the rest plain memory; each one works.
    many = [dist.empty(20000, "int32") for _ in range(70)]
    shared = sum(dist.is_shared(t) for t in many)
    assert shared == (64 if shm else 0), "%d of 70 allocations shared" % shared
    for i, t in enumerate(many):
        t[:] = np.arange(20000, dtype=np.int32) * (r + 1) + i
        dist.all_reduce(t)
        expect_eq(t, np.arange(20000, dtype=np.int32) * (n * (n + 1) // 2) + n * i,
                  "all_reduce on allocation %d" % i)
    for t in many:
        dist.free(t)
    # Two all_reduces at once on the halves of one allocation (the second copies).
    h = dist.empty(2 * c, "int64")
    a, b = h[:c], h[c:]
    a[:] = r + 1
    b[:] = np.arange(c) * (r + 1)
    wa = dist.all_reduce(a, async_op=True)
    wb = dist.all_reduce(b, async_op=True)
    wa.wait()
    wb.wait()
    tri = n * (n + 1) // 2
    expect_eq(a, np.full(c, tri, np.int64), "async all_reduce a")
    expect_eq(b, np.arange(c) * tri, "async all_reduce b")
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:  # a torch dtype gives a torch tensor on the same kind of memory
        t = dist.empty((3, 5), torch.bfloat16)
        assert isinstance(t, torch.Tensor) and t.shape == (3, 5) and t.dtype == torch.bfloat16
        assert dist.is_shared(t) == shm, "is_shared of a torch empty()"
        t += r + 1
        dist.all_reduce(t)
        assert bool((t == float(tri)).all()), "all_reduce of a torch empty(): %r" % (t,)
        dist.free(t)
    else:
        print("rank %d: SKIPPED the torch empty() check: torch is not importable" % r)
    dist.destroy_process_group()
    print("rank %d: all_reduce, broadcast, all_gather on empty() memory checked (shared: %s)"
          % (r, shm))


def w_doorbell():
    """Small collectives (up to 2 KiB each way) through the doorbell when shared memory is
    on, as gRPC calls otherwise; 150 rounds of barrier, all_reduce of 4 B .. 2 KiB,
    broadcast, all_gather and send/recv (with its source) checked, an async all_reduce of
    1600 bytes beside them, five async all_reduces in flight at once (four doorbells, one
    call), four large ones (payload segment and spares), and the doorbells' own count of
    the requests they answered."""
    import numpy as np
    dist = _w_init()
    r, n = dist.get_rank(), dist.get_world_size()
    shm = os.environ.get("SUITE_TRANSPORT") == "shm"
    w = dist._get_world()
    tri = n * (n + 1) // 2
    for k in range(150):
        dist.barrier()
        x = np.array([r + 1 + k], np.int32)
        dist.all_reduce(x)
        expect_eq(x, np.array([tri + n * k], np.int32), "all_reduce 4 B, round %d" % k)
        y = np.arange(512, dtype=np.float32) * (r + 1)  # 2 KiB
        wy = dist.all_reduce(y, async_op=(k % 10 == 0))
        if wy is not None:
            wy.wait()
        expect_eq(y, np.arange(512, dtype=np.float32) * tri, "all_reduce 2 KiB, round %d" % k)
        b = np.full(7, k if r == k % n else -1, np.int64)
        dist.broadcast(b, src=k % n)
        expect_eq(b, np.full(7, k, np.int64), "broadcast, round %d" % k)
        lst = [np.zeros(3, np.int16) for _ in range(n)]
        dist.all_gather(lst, np.full(3, r * 10 + k % 7, np.int16))
        for q in range(n):
            expect_eq(lst[q], np.full(3, q * 10 + k % 7, np.int16), "all_gather [%d]" % q)
        if n >= 2 and r < 2:
            if r == 0:
                dist.send(np.array([k, 7], np.int64), dst=1, tag=k % 5)
            else:
                got = np.zeros(2, np.int64)
                src = dist.recv(got, tag=k % 5)
                expect_eq(got, np.array([k, 7], np.int64), "recv, round %d" % k)
                assert src == 0, "recv from any: source %r, want 0" % (src,)
    rung = w.doorbell.rung
    if shm:
        assert rung >= 150 * 4, "the doorbell answered %d requests in 150 rounds" % rung
    else:
        assert rung == 0 and not w.doorbell.all, "a doorbell with PARAMSYNC_SHM=0"
    # Collectives in flight side by side each ring a doorbell of their own, up to the
    # agent's 4 per rank; a fifth takes a call. The last rank starts late, so that on the
    # others all five wait at once.
    before = w.doorbell.rung
    for k in range(3):
        if r == n - 1:
            time.sleep(0.15)
        xs = [np.array([r * (i + 1) + k], np.int64) for i in range(5)]
        works = [dist.all_reduce(x, async_op=True) for x in xs]
        for i, (x, wk) in enumerate(zip(xs, works)):
            wk.wait()
            expect_eq(x, np.array([n * (n - 1) // 2 * (i + 1) + n * k], np.int64),
                      "async all_reduce %d of 5 in flight, round %d" % (i, k))
    inflight = w.doorbell.rung - before
    if shm and n >= 2 and r != n - 1:
        assert len(w.doorbell.all) == 4, \
            "%d doorbells after 5 collectives in flight, want the agent's 4" % len(w.doorbell.all)
        assert 12 <= inflight <= 15, \
            "%d of 15 async all_reduces (5 in flight at once) through the doorbells" % inflight
    elif not shm:
        assert inflight == 0 and not w.doorbell.all
    # Large ones in flight side by side (two all_reduces of 256 KiB, two all_gathers of
    # 64 KiB each): each through a payload segment of its own, the first or a spare,
    # none as gRPC frames.
    for k in range(3):
        if r == n - 1:
            time.sleep(0.15)
        ars = [np.arange(65536, dtype=np.int32) * (r + 1) + i + k for i in range(2)]
        outs = [[np.zeros(8192, np.int64) for _ in range(n)] for i in range(2)]
        works = [dist.all_reduce(a, async_op=True) for a in ars]
        works += [dist.all_gather(outs[i], np.full(8192, r * 10 + i + k, np.int64),
                                  async_op=True) for i in range(2)]
        for wk in works:
            wk.wait()
        for i in range(2):
            expect_eq(ars[i], np.arange(65536, dtype=np.int32) * tri + n * (i + k),
                      "async all_reduce of 256 KiB %d beside others, round %d" % (i, k))
            for q in range(n):
                expect_eq(outs[i][q], np.full(8192, q * 10 + i + k, np.int64),
                          "async all_gather %d [%d] beside others, round %d" % (i, q, k))
    spares = [x for x in w.shm.spares if x.map is not None]
    if shm and n >= 2 and r != n - 1:
        assert 1 <= len(spares) <= 3, \
            "%d spare payload segments after 4 large collectives in flight" % len(spares)
    elif not shm:
        assert not spares
    # Past the doorbell's own 2 KiB, up to 800 KB: the payload goes through the segment
    # (or empty() memory, in place) and still no call is made. Each result checked.
    before = w.doorbell.rung
    z = np.arange(4096, dtype=np.float32) * (r + 1)  # 16 KiB
    dist.all_reduce(z)
    expect_eq(z, np.arange(4096, dtype=np.float32) * tri, "all_reduce 16 KiB")
    e = dist.empty(200000, dtype=np.float32)  # 800 KB in memory the agent uses in place
    e[:] = r + 1
    dist.all_reduce(e)
    expect_eq(e, np.full(200000, tri, np.float32), "all_reduce 800 KB of empty()")
    big = np.full(3000, r * 2 + 1, np.int32)
    dist.broadcast(big, src=n - 1)
    expect_eq(big, np.full(3000, (n - 1) * 2 + 1, np.int32), "broadcast 12 KB")
    lst = [np.zeros(1000, np.int64) for _ in range(n)]
    dist.all_gather(lst, np.full(1000, r, np.int64))
    for q in range(n):
        expect_eq(lst[q], np.full(1000, q, np.int64), "all_gather of 8 KB [%d]" % q)
    mid = w.doorbell.rung - before
    if shm:
        assert mid == 4, "%d of 4 collectives of 8 KB to 800 KB went through the doorbell" % mid
    else:
        assert mid == 0
    # 32 MiB and more (input and output together), on numpy's own memory: the agent reads and writes these arrays
    # themselves through the rank's process segment (direct), async too; with
    # PARAMSYNC_SHM_DIRECT=0 they copy through the payload segment as before.
    c = (9 << 20) + 1  # 36 MiB of int32 (odd): 72 MiB in and out, in place
    before = w.process.used
    for k, direct in enumerate((True, True, False)):
        if not direct:
            os.environ["PARAMSYNC_SHM_DIRECT"] = "0"
        a = np.arange(c, dtype=np.int32) * (r + 1) + k
        wa = dist.all_reduce(a, async_op=(k == 1))
        if wa is not None:
            wa.wait()
        expect_eq(a, np.arange(c, dtype=np.int32) * tri + n * k, "all_reduce of 36 MiB %d" % k)
        bb = np.full(c, r * 3 + k, np.int32) if r == n - 1 else np.zeros(c, np.int32)
        dist.broadcast(bb, src=n - 1)
        expect_eq(bb, np.full(c, (n - 1) * 3 + k, np.int32), "broadcast of 36 MiB %d" % k)
        out = np.zeros(n * (c // n), np.int32)
        dist.all_gather_into_tensor(out, np.full(c // n, r + k, np.int32))
        for q in range(n):
            expect_eq(out[q * (c // n):(q + 1) * (c // n)], np.full(c // n, q + k, np.int32),
                      "all_gather of 36 MiB [%d] %d" % (q, k))
        # In place: the input is this rank's block of the output (header.own_block).
        out[:] = 0
        own = out[r * (c // n):(r + 1) * (c // n)]
        own[:] = r + 2 * k
        dist.all_gather_into_tensor(out, own)
        for q in range(n):
            expect_eq(out[q * (c // n):(q + 1) * (c // n)], np.full(c // n, q + 2 * k, np.int32),
                      "all_gather of 36 MiB in place [%d] %d" % (q, k))
        list_forms(dist, np, r, n, c // n, k)
    os.environ.pop("PARAMSYNC_SHM_DIRECT", None)
    went = w.process.used - before
    # Where this machine does not let another process read ours (ptrace rules,
    # seccomp), the agent refuses, and says so: that part cannot run here.
    cannot = any(x in w.process.refused for x in ("may not read", "not readable here"))
    if shm and cannot:
        print("rank %d: direct part SKIPPED: %s" % (r, w.process.refused))
    elif shm:
        # 4 + 5 list forms each time, and gather and scatter (12 MiB on a non-root rank,
        # which goes direct where the client gets huge pages: _shm.direct_min).
        small = _shm_direct_min() <= 12 << 20
        want = sum(9 + 2 * (r == k % n or small) for k in range(2))
        assert went == want, "%d of %d collectives of 36 MiB read and written in place" % (
            went, want)
        m = H.scrape(os.environ["SUITE_METRICS"])
        for d in ("received", "sent"):
            got = int(m['paramsync_shm_bytes_total{direction="%s",access="process"}' % d])
            assert got >= 2 * 4 * c, "the agent %s %d bytes in workers' memory" % (d, got)
        collapse_check(dist, r, n)
    else:
        assert went == 0 and w.process.map is None, "a process segment with PARAMSYNC_SHM=0"
    dist.destroy_process_group()
    print("rank %d: 150 rounds of small collectives checked; %d through the doorbell"
          % (r, rung))


def _shm_direct_min():
    """The fewest bytes the client takes directly (_shm.direct_min)."""
    from paramsync import _shm
    return _shm.direct_min()


def huge_kib(addr):
    """KiB of huge pages under the mapping of /proc/self/smaps that holds addr, or -1."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                inside = int(m.group(1), 16) <= addr < int(m.group(2), 16)
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return -1


def collapse_works():
    """Whether this kernel collapses anonymous memory into huge pages on request
    (MADV_COLLAPSE, Linux 6.1; THP not "never"): tried on a scratch mapping."""
    import ctypes
    import mmap
    m = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.write(b"\1" * (4 << 20))
    anchor = ctypes.c_char.from_buffer(m)
    at = (ctypes.addressof(anchor) + (2 << 20) - 1) // (2 << 20) * (2 << 20)
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    ok = madvise(at, 2 << 20, 25) == 0
    del anchor
    m.close()
    return ok


def collapse_check(dist, r, n):
    """An array of 40 MiB on small pages (a fresh private mapping, as torch's allocator
    gives large tensors; numpy asks for huge pages itself) all_reduced directly twice: its
    whole 2 MiB pages are huge after the second call, not after the first (the client's
    MADV_COLLAPSE), counted as the growth of its mapping's huge pages (/proc/self/smaps;
    neighbours merged into it may hold some), where THP is on request only."""
    import mmap
    import numpy as np
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        mode = f.read().strip()
    m = mmap.mmap(-1, 40 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = np.frombuffer(m, np.int32)
    t[:] = r + 1
    kib = [huge_kib(t.ctypes.data)]
    for k in range(2):  # from the second time on
        dist.all_reduce(t)
        expect_eq(t, np.full(t.size, n ** k * n * (n + 1) // 2, np.int32), "all_reduce %d" % k)
        kib.append(huge_kib(t.ctypes.data))
    del t
    if "[madvise]" not in mode or not collapse_works():
        print("rank %d: SKIPPED the huge-page check: it needs THP on request only (here: %s) "
              "and MADV_COLLAPSE (Linux 6.1)" % (r, mode))
        return
    assert kib[1] == kib[0] and kib[2] - kib[0] >= 36 * 1024, \
        "a 40 MiB array's mapping held %s KiB of huge pages before, after one and after two " \
        "direct all_reduces: want no change, then its whole 2 MiB pages" % kib


def list_forms(dist, np, r, n, b, k):
    """The list forms (n buffers of b int32 on a side), every element checked: large ones
    go direct, each buffer in its own place (header.shm_in_blocks, shm_out_blocks). The
    buffers are separate arrays, each given a neighbour that must stay as it is; then
    all_gather into the chunks of one array (one buffer), also in place."""
    def bufs(fill):
        arrs = [np.full(b + 1, -7, np.int32) for _ in range(n)]
        for q, a in enumerate(arrs):
            a[:b] = fill(q)
        return arrs, [a[:b] for a in arrs]

    def check(arrs, want, what):
        for q, a in enumerate(arrs):
            expect_eq(a[:b], np.full(b, want(q), np.int32), "%s [%d] %d" % (what, q, k))
            assert a[b] == -7, "%s [%d] %d: wrote past its buffer" % (what, q, k)

    arrs, outs = bufs(lambda q: 0)
    dist.all_gather(outs, np.full(b, 10 * r + k, np.int32))
    check(arrs, lambda q: 10 * q + k, "all_gather list of 36 MiB")
    _, ins = bufs(lambda q: 100 * r + q + k)
    o = np.zeros(b, np.int32)
    dist.reduce_scatter(o, ins)
    expect_eq(o, np.full(b, sum(100 * x + r + k for x in range(n)), np.int32),
              "reduce_scatter list of 36 MiB %d" % k)
    arrs, outs = bufs(lambda q: 0)
    _, ins = bufs(lambda q: 1000 * r + q + k)
    dist.all_to_all(outs, ins)
    check(arrs, lambda q: 1000 * q + r + k, "all_to_all lists of 36 MiB")
    root = k % n
    arrs, outs = bufs(lambda q: 0)
    dist.gather(np.full(b, 5 * r + k, np.int32), outs if r == root else None, dst=root)
    if r == root:
        check(arrs, lambda q: 5 * q + k, "gather list of 36 MiB")
    _, ins = bufs(lambda q: 7 * q + k)
    o = np.zeros(b, np.int32)
    dist.scatter(o, ins if r == root else None, src=root)
    expect_eq(o, np.full(b, 7 * r + k, np.int32), "scatter list of 36 MiB %d" % k)
    # The chunks of one array, in order, are one buffer (so in place too, the input the
    # rank's own chunk).
    whole = np.full(n * b + 1, -7, np.int32)
    chunks = list(whole[:n * b].reshape(n, b))
    dist.all_gather(chunks, np.full(b, 3 * r + k, np.int32))
    expect_eq(whole[:n * b], np.repeat(np.arange(n, dtype=np.int32) * 3 + k, b),
              "all_gather into chunks %d" % k)
    chunks[r][:] = 4 * r + k
    dist.all_gather(chunks, chunks[r])
    expect_eq(whole[:n * b], np.repeat(np.arange(n, dtype=np.int32) * 4 + k, b),
              "all_gather into chunks in place %d" % k)
    assert whole[n * b] == -7, "all_gather into chunks wrote past them"


def w_peer():
    """Large all_to_all, all_gather, gather and scatter (client/peer.c, _peer): ranks on
    one agent copy rank to rank. Every form torch has, each element checked with the
    element past each output buffer: all_to_all_single, all_to_all of separate arrays,
    all_to_all_single with split sizes (each pair's own bytes), all_gather into separate
    arrays and into a tensor (also in place), gather and scatter of separate arrays (also
    in place), async, and in a group of the ranks in reverse; the calls taken by peer
    copies counted (World.peer_used: all of them with
    shared memory on, none with PARAMSYNC_SHM=0 or PARAMSYNC_PEER_COPY=0); one below the
    floor. SUITE_PEER_UNREADABLE=1: rank 1 first becomes a process the others may not
    read (another user as root, else not dumpable), so every call goes through the agent
    after the ranks find out, with the same results."""
    import ctypes
    import numpy as np
    dist = _w_init()
    r, n = dist.get_rank(), dist.get_world_size()
    w = dist._get_world()
    unreadable = os.environ.get("SUITE_PEER_UNREADABLE") == "1"
    as_root = os.geteuid() == 0
    if unreadable and r == 1:
        if os.geteuid() == 0:
            os.setresgid(65534, 65534, 65534)
            os.setresuid(65534, 65534, 65534)
        else:
            assert ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) == 0  # PR_SET_DUMPABLE 0
    rev = dist.new_group(list(range(n - 1, -1, -1)))
    gr = dist.get_rank(rev)
    b = (5 << 18) // n + 7  # int32: 5 MiB and some in all
    before = w.peer_used

    def with_guard(total, dtype=np.int32):
        a = np.full(total + 1, -7, dtype)
        return a, a[:total]

    for k in range(2):
        asy = k == 1
        # all_to_all_single: block j of this rank's input goes to rank j.
        x = np.concatenate([np.full(b, 1000 * r + j + k, np.int32) for j in range(n)])
        whole, o = with_guard(n * b)
        h = dist.all_to_all_single(o, x, async_op=asy)
        if h is not None:
            h.wait()
        expect_eq(o, np.repeat(np.arange(n, dtype=np.int32) * 1000 + r + k, b),
                  "all_to_all_single %d" % k)
        assert whole[-1] == -7, "all_to_all_single wrote past its output"
        # all_to_all of separate arrays, in the reversed group (group ranks).
        ins = [np.full(b, 100 * gr + j + k, np.int32) for j in range(n)]
        guarded = [with_guard(b) for _ in range(n)]
        h = dist.all_to_all([g[1] for g in guarded], ins, group=rev, async_op=asy)
        if h is not None:
            h.wait()
        for q, (a, v) in enumerate(guarded):
            expect_eq(v, np.full(b, 100 * q + gr + k, np.int32), "all_to_all lists [%d] %d"
                      % (q, k))
            assert a[-1] == -7, "all_to_all lists wrote past an output"
        # all_to_all_single with split sizes: each pair's own elements, rank to rank (none
        # where s + t + k is a multiple of 3).

        def sent(s, t):
            return 0 if (s + t + k) % 3 == 0 else ((s + 2 * t + k) % 4 + 1) * (b // 2) + 3

        def values(s, t):
            return np.arange(sent(s, t), dtype=np.int32) + (10 * s + t) * 1_000_000
        x = np.concatenate([values(r, j) for j in range(n)])
        whole, o = with_guard(sum(sent(j, r) for j in range(n)))
        h = dist.all_to_all_single(o, x, [sent(j, r) for j in range(n)],
                                   [sent(r, j) for j in range(n)], async_op=asy)
        if h is not None:
            h.wait()
        expect_eq(o, np.concatenate([values(j, r) for j in range(n)]),
                  "all_to_all_single with split sizes %d" % k)
        assert whole[-1] == -7, "all_to_all_single with split sizes wrote past its output"
        # all_gather into separate arrays.
        guarded = [with_guard(b) for _ in range(n)]
        h = dist.all_gather([g[1] for g in guarded], np.full(b, 7 * r + k, np.int32),
                            async_op=asy)
        if h is not None:
            h.wait()
        for q, (a, v) in enumerate(guarded):
            expect_eq(v, np.full(b, 7 * q + k, np.int32), "all_gather list [%d] %d" % (q, k))
            assert a[-1] == -7, "all_gather list wrote past an output"
        # all_gather into a tensor, apart and in place (the input its own block).
        whole, o = with_guard(n * b, np.float64)
        dist.all_gather_into_tensor(o, np.full(b, 3 * r + k, np.float64), group=rev)
        expect_eq(o, np.repeat(np.arange(n - 1, -1, -1, dtype=np.float64) * 3 + k, b),
                  "all_gather_into_tensor %d" % k)
        o[:] = 0
        own = o[gr * b:(gr + 1) * b]
        own[:] = 5 * r + k
        dist.all_gather_into_tensor(o, own, group=rev)
        expect_eq(o, np.repeat(np.arange(n - 1, -1, -1, dtype=np.float64) * 5 + k, b),
                  "all_gather_into_tensor in place %d" % k)
        assert whole[-1] == -7, "all_gather_into_tensor wrote past its output"
        # gather to the last rank and scatter from rank 1, into separate arrays and (the
        # root's own block one of them) in place.
        root = n - 1
        # (gathers of 10 MiB: their floor is 8)
        guarded = [with_guard(2 * b) for _ in range(n)]
        h = dist.gather(np.full(2 * b, 11 * r + k, np.int32),
                        [g[1] for g in guarded] if r == root else None, dst=root,
                        async_op=asy)
        if h is not None:
            h.wait()
        for q, (a, v) in enumerate(guarded if r == root else ()):
            expect_eq(v, np.full(2 * b, 11 * q + k, np.int32), "gather [%d] %d" % (q, k))
            assert a[-1] == -7, "gather wrote past an output"
        whole, o = with_guard(b)
        ins = [np.full(b, 13 * q + k, np.int32) for q in range(n)]
        h = dist.scatter(o, ins if r == 1 else None, src=1, async_op=asy)
        if h is not None:
            h.wait()
        expect_eq(o, np.full(b, 13 * r + k, np.int32), "scatter %d" % k)
        assert whole[-1] == -7, "scatter wrote past its output"
        outs = [np.zeros(2 * b, np.int32) for _ in range(n)]
        outs[r][:] = 17 * r + k
        dist.gather(outs[r], outs if r == root else None, dst=root)
        if r == root:
            expect_eq(np.concatenate(outs),
                      np.repeat(np.arange(n, dtype=np.int32) * 17 + k, 2 * b),
                      "gather in place %d" % k)
        ins = [np.full(b, 19 * q + k, np.int32) for q in range(n)]
        mine = ins[r] if r == 1 else np.zeros(b, np.int32)
        dist.scatter(mine, ins if r == 1 else None, src=1)
        expect_eq(mine, np.full(b, 19 * r + k, np.int32), "scatter in place %d" % k)
    # Below the floor (4 MiB of output for all_gather): through the agent.
    o = np.zeros(n * 1000, np.int32)
    dist.all_gather_into_tensor(o, np.full(1000, r, np.int32))
    expect_eq(o, np.repeat(np.arange(n, dtype=np.int32), 1000), "all_gather of 4 KB")
    # PARAMSYNC_SHM=0 on one rank since init (read on every collective): that call goes
    # through the agent, as asked, with the same result.
    if r == 0:
        os.environ["PARAMSYNC_SHM"] = "0"
    x = np.concatenate([np.full(b, 1000 * r + j, np.int32) for j in range(n)])
    o = np.zeros(n * b, np.int32)
    dist.all_to_all_single(o, x)
    expect_eq(o, np.repeat(np.arange(n, dtype=np.int32) * 1000 + r, b),
              "all_to_all_single with PARAMSYNC_SHM=0 on rank 0")
    went = w.peer_used - before
    want = 0 if os.environ.get("SUITE_TRANSPORT") == "grpc" else 20
    if unreadable:
        # Another user (as root) may not read the others but is read by them, so the gathers
        # to rank 2 and scatters from rank 1 (8) still go rank to rank; not dumpable, it is
        # read by nobody: every call through the agent.
        want = 8 if as_root else 0
    assert went == want, "%d of %d calls by peer copies" % (went, want)
    dist.destroy_process_group()
    print("rank %d: 21 all_to_all, all_gather, gather and scatter checked, %d by peer copies"
          % (r, went))


def _others_segments_mapped():
    """How many mappings of other processes' paramsync segments this one has (their names
    carry their pids: /dev/shm/paramsync.PID...)."""
    mine = "/paramsync.%d." % os.getpid()
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "/paramsync." in line and mine not in line)


def w_peer_registered():
    """Memory from empty() in an all_to_all of peer-copy size: the agent copies it in place
    through its mappings while the call is within its --shm-resident-bytes (the driver
    starts it with 64M); past that (it would copy through the segments' files) the ranks
    copy rank to rank, as from any other memory, each reading the others' segments through
    mappings it keeps (n - 1 of them after the call, where process_vm_readv would leave
    none) and lets go of once they are freed (still n - 1 after a second allocation's
    call). Input and output in one allocation. Then, with split sizes, by peer copies
    within the budget too (the agent would copy padded buffers), and with input and output
    in two allocations or the output plain memory."""
    import numpy as np
    dist = _w_init()
    r, n = dist.get_rank(), dist.get_world_size()
    w = dist._get_world()
    for mib, by_peer in ((1, False), (4, True), (4, True)):
        # Blocks of `mib` MiB: the agent would touch 2 n^2 blocks (18 or 72 MiB).
        b = (mib << 20) // 4
        buf = dist.empty(2 * n * b, np.int32)
        assert dist.is_shared(buf), "empty() memory is not shared"
        x, o = buf[:n * b], buf[n * b:]
        x[:] = np.concatenate([np.full(b, 1000 * r + j, np.int32) for j in range(n)])
        before = w.peer_used
        dist.all_to_all_single(o, x)
        expect_eq(o, np.repeat(np.arange(n, dtype=np.int32) * 1000 + r, b),
                  "all_to_all_single of %d MiB blocks" % mib)
        went = w.peer_used - before
        assert went == (1 if by_peer else 0), \
            "all_to_all of %d MiB blocks from empty(): %d by peer copies, want %d" % (
                mib, went, 1 if by_peer else 0)
        mapped = _others_segments_mapped()
        assert mapped == (n - 1 if by_peer else 0), \
            "after the all_to_all of %d MiB blocks this rank maps %d of the others' " \
            "segments, want %d" % (mib, mapped, n - 1 if by_peer else 0)
        dist.free(buf)
    # With split sizes the agent would copy padded buffers, not empty() memory: each pair's
    # own bytes go rank to rank instead, within the budget too.
    sent = [[(s + 2 * t + 1) << 18 for t in range(n)] for s in range(n)]  # 1-5 MiB blocks
    ins, outs = sent[r], [sent[s][r] for s in range(n)]
    buf = dist.empty(sum(ins) + sum(outs), np.int32)
    x, o = buf[:sum(ins)], buf[sum(ins):]
    x[:] = np.concatenate([np.full(k, 100 * r + t, np.int32) for t, k in enumerate(ins)])
    before = w.peer_used
    dist.all_to_all_single(o, x, outs, ins)
    expect_eq(o, np.concatenate([np.full(k, 100 * s + r, np.int32)
                                 for s, k in enumerate(outs)]),
              "all_to_all_single with split sizes from empty()")
    assert w.peer_used - before == 1, "all_to_all_single with split sizes from empty(): " \
        "through the agent"
    dist.free(buf)
    # Input and output in two allocations, or one side plain memory: rank to rank too
    # (the agent would take two allocations in place, but peer copies measured about as
    # fast and spare its CPU; plain memory it would copy through its payload segment).
    b = (4 << 20) // 4
    x = dist.empty(n * b, np.int32)
    x[:] = np.concatenate([np.full(b, 1000 * r + j, np.int32) for j in range(n)])
    for o in (dist.empty(n * b, np.int32), np.zeros(n * b, np.int32)):
        before = w.peer_used
        dist.all_to_all_single(o, x)
        expect_eq(o, np.repeat(np.arange(n, dtype=np.int32) * 1000 + r, b),
                  "all_to_all_single from empty() into %s" % type(o).__name__)
        assert w.peer_used - before == 1, "all_to_all_single from empty() into another " \
            "allocation or plain memory: through the agent"
    dist.free(x)
    dist.destroy_process_group()
    print("rank %d: empty() memory by the agent within its budget, by peer copies past it"
          % r)


def w_barrier_direct():
    """Barriers of ranks on one agent meet on a shared page (paramsync/_barrier.py): the
    agent serves none of them (only the setup's all_gather and all_reduce per group), every
    rank waits for the last to arrive, async ones in flight side by side complete, a rank
    that calls an all_reduce there fails every rank at once with FAILED_PRECONDITION, and a
    rank that never comes fails the others with DEADLINE_EXCEEDED naming it."""
    import grpc
    import numpy as np
    from datetime import timedelta
    dist = _w_init(timeout=timedelta(seconds=2))
    r, n = dist.get_rank(), dist.get_world_size()
    url = os.environ["SUITE_METRICS"]
    evens = dist.new_group(list(range(0, n, 2)))
    for _ in range(3):
        dist.barrier()
        if r % 2 == 0:
            dist.barrier(group=evens)
    for late in range(n):  # nobody leaves before the late rank arrived
        if r == late:
            time.sleep(0.2)
        mine = np.array([time.monotonic()])
        dist.barrier()
        left = time.monotonic()
        arrived = [np.zeros(1) for _ in range(n)]
        dist.all_gather(arrived, mine)
        assert left >= arrived[late][0], "left %.6f s before rank %d arrived" % (
            arrived[late][0] - left, late)
    works = [dist.barrier(async_op=True) for _ in range(4)]
    for w in reversed(works):
        w.wait()
    for _ in range(100):
        dist.barrier()
    dist.barrier()
    if r == 0:
        m = H.scrape(url)
        got = m.get('paramsync_collectives_total{kind="barrier",code="OK"}', 0)
        assert got == 0, "%d barriers went through the agent" % got
    dist.barrier()
    # The last rank calls an all_reduce where the others call the barrier: every rank is
    # told at once (the waiters see its number on the page), and the next barrier meets.
    t0 = time.monotonic()
    try:
        if r == n - 1:
            dist.all_reduce(np.ones(1, np.float32))
        else:
            time.sleep(0.1)
            dist.barrier()
        raise AssertionError("a barrier against an all_reduce succeeded")
    except dist.ParamsyncError as e:
        took = time.monotonic() - t0
        assert e.code == grpc.StatusCode.FAILED_PRECONDITION, e
        assert "called barrier" in str(e) and "called all_reduce" in str(e), e
        assert took < 1.0, took
    dist.barrier()
    if r == n - 1:
        time.sleep(4)  # never comes to this one in time
        print("rank %d: stayed away" % r)
        dist.destroy_process_group()
        return
    t0 = time.monotonic()
    try:
        dist.barrier()
        raise AssertionError("a barrier without rank %d succeeded" % (n - 1))
    except dist.ParamsyncError as e:
        took = time.monotonic() - t0
        assert e.code == grpc.StatusCode.DEADLINE_EXCEEDED, e
        assert "rank %d did not arrive" % (n - 1) in str(e), e
        assert "met directly" in str(e), e
        assert 1.5 < took < 10, took
    print("rank %d: met directly; timed out naming rank %d" % (r, n - 1))
    dist.destroy_process_group()


WORKERS = {
    "barrier_direct": w_barrier_direct,
    "doorbell": w_doorbell,
    "registered": w_registered,
    "collectives": w_collectives, "groups": w_groups, "async": w_async, "p2p": w_p2p,
    "torch": w_torch, "local_errors": w_local_errors, "daemon_errors": w_daemon_errors,
    "timeout": w_timeout, "member_lost": w_member_lost, "init_methods": w_init_methods,
    "shm_reuse": w_shm_reuse, "shm_paths": w_shm_paths, "peer": w_peer,
    "relay_lost": w_relay_lost, "objects": w_objects, "uneven": w_uneven,
    "peer_unreadable": w_peer, "peer_registered": w_peer_registered,
    "uneven_limit": w_uneven_limit,
}

# ---------------------------------------------------------------------------------- driver

NPROC = {"barrier_direct": 3, "doorbell": 3, "registered": 3, "collectives": 3, "groups": 4, "async": 3, "p2p": 3, "torch": 3, "local_errors": 2,
         "objects": 4, "uneven": 3,
         "daemon_errors": 3, "timeout": 2, "member_lost": 2, "shm_reuse": 3, "peer": 3,
         "peer_unreadable": 3, "peer_registered": 3}


# Scenarios that count what the agent's own paths took: large all_gather and all_to_all
# calls of ranks on one agent would go by peer copies (_peer) instead, which the peer
# scenario tests.
AGENT_PATHS = ("doorbell", "shm_paths", "shm_reuse")


def report(results, what):
    bad = False
    for rank, (rc, out, err) in enumerate(results):
        status = "timed out" if rc is None else "exit %s" % rc
        print("--- %s, rank %d: %s" % (what, rank, status))
        if out.strip():
            print(out.rstrip())
        if rc != 0 and err.strip():
            print(err.rstrip()[-3000:])
        bad = bad or rc != 0
    return not bad


def run_job(py, daemon, scenario, n, expect_rc=None, transport=None):
    extra = {}
    if transport:
        # The workers check which way their bytes go from the daemon's /metrics.
        extra = dict(SUITE_TRANSPORT=transport, SUITE_METRICS=daemon.metrics_url,
                     PARAMSYNC_SHM="0" if transport == "grpc" else "1")
    if scenario in AGENT_PATHS:
        extra["PARAMSYNC_PEER_COPY"] = "0"
    if scenario == "peer_unreadable":
        extra["SUITE_PEER_UNREADABLE"] = "1"
    env = [H.clean_env(PARAMSYNC_ADDR=daemon.addr, PARAMSYNC_JOB="suite-" + scenario,
                       WORLD_SIZE=n, RANK=r, **extra) for r in range(n)]
    cmds = [[py, os.path.abspath(__file__), "--worker", scenario]] * n
    pids = []
    res = H.run_workers(cmds, env, timeout=120, pids=pids)
    left = H.shm_names(pids)
    if left:
        print("FAIL: segment names left in /dev/shm: %s" % left)
        return False
    if expect_rc:
        ok = True
        for r, want in expect_rc.items():
            if res[r][0] != want:
                print("rank %d exited %s, expected %s" % (r, res[r][0], want))
                ok = False
        others = {k: v for k, v in enumerate(res) if k not in expect_rc}
        return report(list(others.values()), scenario) and ok
    return report(res, scenario)


def driver(a):
    py = a.python
    if not os.path.exists(py):
        H.fail("%s does not exist: the client_python_install test makes it" % py)
    if a.scenario == "torch":
        if subprocess.run([py, "-c", "import torch"], capture_output=True).returncode != 0:
            H.skip("torch is not importable (Debian python3-torch)")
    if a.scenario == "launcher":
        return launcher(a)
    if a.scenario == "shm_paths":
        return shm_paths(a)
    if a.scenario == "relay_lost":
        return relay_lost(a)
    if a.scenario == "uneven_limit":
        return uneven_limit(a)
    extra = ("--shm-resident-bytes", "64M") if a.scenario == "peer_registered" else ()
    with H.Daemon(a.paramsyncd, *extra, metrics=bool(a.transport)) as d:
        if a.scenario == "init_methods":
            ok = init_methods(py, d, a.paramsyncd)
        elif a.scenario == "member_lost":
            ok = run_job(py, d, "member_lost", 2, expect_rc={1: -signal.SIGKILL})
        else:
            ok = run_job(py, d, a.scenario, NPROC[a.scenario], transport=a.transport)
        if not ok:
            print("--- daemon log (tail)\n" + "\n".join(d.read_log().splitlines()[-40:]))
    if not ok:
        H.fail(a.scenario)
    print("PASS")


def init_methods(py, d, binary):
    ok = True
    me = os.path.abspath(__file__)
    for mode in ("tcp", "master", "assign"):
        envs = [H.clean_env(SUITE_INIT=mode, SUITE_ADDR=d.addr, SUITE_RANK=r) for r in range(2)]
        ok = report(H.run_workers([[py, me, "--worker", "init_methods"]] * 2, envs, 60),
                    mode) and ok
    # file://: the workers start first and wait for the daemon's --announce-file.
    tmp = H.scratch("ps-file-init-")
    path = os.path.join(tmp, "shared")
    envs = [H.clean_env(SUITE_INIT="file", SUITE_ADDR=d.addr, SUITE_FILE=path, SUITE_RANK=r)
            for r in range(2)]
    procs = [subprocess.Popen([py, me, "--worker", "init_methods"], env=e,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for e in envs]
    time.sleep(1.0)
    d2 = H.Daemon(binary, announce=path)
    try:
        d2.wait_ready()
        # SUITE_ADDR for the re-init step must be the file daemon's.
        res = []
        for p in procs:
            try:
                o, e = p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                o, e = p.communicate()
            res.append((p.returncode, o.decode(), e.decode()))
        ok = report(res, "file") and ok
    finally:
        d2.stop()
    return ok


def non_loopback_ipv4():
    """An IPv4 address of this host other than loopback, or None."""
    import socket
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a route
        ip = s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()
    return None if ip.startswith("127.") else ip


def private_shm_wrap():
    """A command prefix that runs a program with a /dev/shm of its own (a private
    mount namespace), like an agent on another host; None where that cannot be done."""
    wrap = ["unshare", "-m", "sh", "-c", 'mount -t tmpfs tmpfs /dev/shm && exec "$0" "$@"']
    try:
        ok = subprocess.run(wrap + ["true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return wrap if ok else None


def shm_paths(a):
    """When the client's shared memory is used and when it cannot be, told apart by
    the daemons' /metrics: an agent on this host takes the segment whatever its
    address (unix socket, or this host's own IP); an agent that cannot open it (its
    /dev/shm is another one, as on another host) refuses it once and the rank stays
    on frames; with a coordinator and two agents, each rank shares memory with the
    agent it joined through, the job's hub or not, and an uneven all_to_all's padded
    blocks are empty() memory the agents take in place."""
    py, me = a.python, os.path.abspath(__file__)
    ok = True

    def job(addrs, name, transport=None, metrics=None):
        extra = dict(SUITE_TRANSPORT=transport, SUITE_METRICS=metrics) if transport else {}
        envs = [H.clean_env(PARAMSYNC_ADDR=addrs[r], PARAMSYNC_JOB="paths-" + name,
                            WORLD_SIZE=2, RANK=r, PARAMSYNC_SHM="1", PARAMSYNC_PEER_COPY="0",
                            **extra) for r in range(2)]
        pids = []
        good = report(H.run_workers([[py, me, "--worker", "shm_paths"]] * 2, envs, 120, pids),
                      name)
        left = H.shm_names(pids)
        if left:
            print("FAIL: %s: segment names left in /dev/shm: %s" % (name, left))
        return good and not left

    tmp = H.scratch("ps-shm-paths-")
    with H.Daemon(a.paramsyncd, listen="unix:" + os.path.join(tmp, "sock"), metrics=True) as d:
        if not d.addr.startswith("unix:"):
            H.fail("the daemon announced %r for a unix socket" % d.addr)
        ok = job([d.addr] * 2, "unix", "shm", d.metrics_url) and ok
    ip = non_loopback_ipv4()
    if ip:
        with H.Daemon(a.paramsyncd, listen=ip + ":0", metrics=True) as d:
            ok = job([d.addr] * 2, "host-ip", "shm", d.metrics_url) and ok
    else:
        print("SKIPPED: the host-IP case (this host has no address but loopback)")
    wrap = private_shm_wrap()
    if wrap:
        with H.Daemon(a.paramsyncd, metrics=True, wrap=wrap) as d:
            ok = job([d.addr] * 2, "other-host", "grpc", d.metrics_url) and ok
            refusals = d.read_log().count("shared memory not used")  # doorbells apart
            if refusals != 2:
                print("FAIL: other-host: %d refusals of a segment logged, want 2 (one per rank)"
                      "\n%s" % (refusals, d.read_log()[-3000:]))
                ok = False
    else:
        print("SKIPPED: the other-host case (no private mount namespace here: unshare -m)")
    # Split: rank 0 on agent 1 (the job's hub), rank 1 on agent 2. The agents' budget of
    # resident segment bytes is for the uneven all_to_alls below.
    with H.agents(a.paramsyncd, metrics=True,
                  agent_args=("--shm-resident-bytes", "18M")) as agents:
        ok = job([agents[0].addr, agents[1].addr], "split") and ok
        for i, ag in enumerate(agents):
            got = H.payload_bytes(ag.metrics_url)
            refusals = ag.read_log().count("shared memory not used")
            if got != (0, 0) or refusals != 0:
                print("FAIL: split, agent %d: worker payload bytes %s, want (0, 0); %d refusals "
                      "of a segment logged, want 0\n%s" % (i + 1, got, refusals,
                                                          ag.read_log()[-3000:]))
                ok = False
        # Uneven all_to_alls of 3 ranks over the two agents (no peer copies): their padded
        # blocks are empty() memory, which the agents take in place beside the caller's.
        # Between the agents only the blocks' own bytes cross (header.block_used): of the
        # two megabyte calls, 7.68 MB, where their padded blocks are 15.36 MB.
        # Only those bytes count against the agents' --shm-resident-bytes too (block_used,
        # block_out_used): agent 1 serves ranks 0 and 2, and rank 2's 8.64 MB of data are
        # within its share of 18 MiB (9.44 MB), where its padded blocks (11.52 MB) or
        # its data in and padded blocks out (9.6 MB) are not: no byte goes by file.
        two = 'paramsync_shm_calls_total{segments="registered_two"}'
        crossed = 'paramsync_payload_bytes_total{direction="sent",link="agent"}'
        by_file = ['paramsync_shm_bytes_total{direction="%s",access="file"}' % d
                   for d in ("received", "sent")]

        def total(series):
            return sum(H.scrape(ag.metrics_url).get(series, 0) for ag in agents)

        before = total(two)
        sent = total(crossed)
        files = [total(f) for f in by_file]
        envs = [H.clean_env(PARAMSYNC_ADDR=agents[r % 2].addr, PARAMSYNC_JOB="paths-uneven",
                            WORLD_SIZE=3, RANK=r, PARAMSYNC_SHM="1") for r in range(3)]
        ok = report(H.run_workers([[py, me, "--worker", "uneven"]] * 3, envs, 120, []),
                    "split-uneven") and ok
        calls = total(two) - before
        sent = total(crossed) - sent
        files = [total(f) - k for f, k in zip(by_file, files)]
        if files != [0, 0]:
            print("FAIL: split-uneven: %s bytes read and written through segment files, want "
                  "none (the blocks' own bytes are within the agents' budget)" % files)
            ok = False
        print("split-uneven: %d bytes sent between the agents" % sent)
        if not 7_680_000 <= sent < 10_000_000:
            print("FAIL: split-uneven: %d bytes sent between the agents, want the blocks' own "
                  "7.68 MB and little more (padded: 15.36 MB)" % sent)
            ok = False
        if calls < 3:
            print("FAIL: split-uneven: %d calls from two empty() allocations, want one a rank "
                  "at least (the padded blocks on empty() memory)" % calls)
            ok = False
    if not ok:
        H.fail("shm_paths")
    print("PASS")


def uneven_limit(a):
    """A coordinator and two agents of --max-tensor-bytes 4 MiB, 3 ranks over them: an
    uneven all_to_all_single whose padded blocks are over it (w_uneven_limit)."""
    py, me = a.python, os.path.abspath(__file__)
    limit = 4 << 20
    with H.agents(a.paramsyncd, agent_args=("--max-tensor-bytes", str(limit))) as agents:
        envs = [H.clean_env(PARAMSYNC_ADDR=agents[r % 2].addr, PARAMSYNC_JOB="uneven-limit",
                            WORLD_SIZE=3, RANK=r, PARAMSYNC_SHM="1", SUITE_LIMIT=limit,
                            PARAMSYNC_SCRATCH_BYTES=3 << 20)
                for r in range(3)]
        ok = report(H.run_workers([[py, me, "--worker", "uneven_limit"]] * 3, envs, 120, []),
                    "uneven_limit")
    if not ok:
        H.fail("uneven_limit")
    print("PASS")


def relay_lost(a):
    """A coordinator and two agents, a rank on each: rank 1's small collectives reach the
    job's hub agent (rank 0's) on its doorbell's relay stream, so no Worker/Collective call
    reaches that agent; killed while rank 1 waits there, rank 1 fails soon (w_relay_lost)."""
    py, me = a.python, os.path.abspath(__file__)
    live = ("--liveness-timeout-ms", "2000")
    procs, ok = [], True
    with H.agents(a.paramsyncd, coord_args=live, agent_args=live, metrics=True) as agents:
        try:
            for r in range(2):
                env = H.clean_env(PARAMSYNC_ADDR=agents[r].addr, PARAMSYNC_JOB="relay-lost",
                                  WORLD_SIZE=2, RANK=r, SUITE_HUB=agents[0].addr)
                procs.append(subprocess.Popen([py, me, "--worker", "relay_lost"], env=env,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              text=True))
            line = procs[1].stdout.readline()
            if line.strip() != "rank 1: waiting":
                H.fail("relay_lost: rank 1 said %r\n%s" % (line,
                                                            procs[1].stderr.read()[-3000:]))
            calls = H.scrape(agents[0].metrics_url).get(
                'paramsync_grpc_calls_total{service="paramsync.v1.Worker",method="Collective",'
                'code="OK"}', 0)
            if calls:
                print("FAIL: %d Collective calls reached the hub agent; rank 1's barriers "
                      "should have come on its relay" % calls)
                ok = False
            time.sleep(0.5)
            agents[0].proc.kill()
            try:
                out, err = procs[1].communicate(timeout=30)
            except subprocess.TimeoutExpired:
                procs[1].kill()
                out, err = procs[1].communicate()
            print(line + out, end="")
            if procs[1].returncode != 0:
                print("FAIL: rank 1 exited with %s\n%s" % (procs[1].returncode, err[-3000:]))
                ok = False
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.communicate()
    if not ok:
        H.fail("relay_lost")
    print("PASS")


def launcher(a):
    """python3 -m paramsync.run: env for each rank, a daemon of its own, exit statuses."""
    py = a.python
    tmp = H.scratch("ps-launcher-")
    script = os.path.join(tmp, "w.py")
    with open(script, "w") as f:
        f.write("""import os, sys, numpy as np
import paramsync.distributed as dist
dist.init_process_group("paramsync")
x = np.array([dist.get_rank() + 1], np.int64)
dist.all_reduce(x)
# One write per line: the workers share the launcher's stdout, unprefixed.
sys.stdout.write("rank %s/%s local %s job %s sum %d args %s\\n" % (os.environ["RANK"],
                 os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"],
                 os.environ["PARAMSYNC_JOB"][:4], x[0], sys.argv[1:]))
sys.stdout.flush()
if "--fail" in sys.argv and dist.get_rank() == 1:
    sys.exit(3)
""")
    env = H.clean_env(PARAMSYNC_DAEMON=a.paramsyncd)
    p = subprocess.run([py, "-m", "paramsync.run", "--nproc", "3", script, "a", "--b"], env=env,
                       capture_output=True, text=True, timeout=120)
    lines = sorted(p.stdout.splitlines())
    want = ["rank %d/3 local %d job run- sum 6 args ['a', '--b']" % (r, r) for r in range(3)]
    if p.returncode != 0 or lines != want:
        H.fail("launcher: rc %d, stdout %r, want %r; stderr:\n%s" % (p.returncode, lines, want,
                                                                    p.stderr))
    p = subprocess.run([py, "-m", "paramsync.run", "--nproc", "2", "--prefix", script, "--fail"],
                       env=env, capture_output=True, text=True, timeout=120)
    if p.returncode != 3 or "worker 1 exited with status 3" not in p.stderr:
        H.fail("launcher with a failing worker: rc %d (want 3); stderr:\n%s" % (p.returncode,
                                                                              p.stderr))
    lines = p.stdout.splitlines()
    if not lines or not all(re.match(r"\[[01]\]: rank [01]/2 ", ln) for ln in lines) or not any(
            ln.startswith("[1]: rank 1/2") for ln in lines):
        H.fail("launcher --prefix: %r" % p.stdout)
    # With a daemon given, none is started: PARAMSYNC_ADDR reaches the workers.
    with H.Daemon(a.paramsyncd) as d:
        p = subprocess.run([py, "-m", "paramsync.run", "--nproc", "2", "--daemon", d.addr,
                            script], env=H.clean_env(PATH="/nonexistent"), capture_output=True,
                           text=True, timeout=120)
        if p.returncode != 0 or "sum 3" not in p.stdout or "joined" not in d.read_log():
            H.fail("launcher --daemon: rc %d\n%s\n%s" % (p.returncode, p.stdout, p.stderr))
    # No daemon anywhere: a clear error, not a hang.
    p = subprocess.run([py, "-m", "paramsync.run", "--nproc", "2", script],
                       env=H.clean_env(PATH="/nonexistent"), capture_output=True, text=True,
                       timeout=60)
    if p.returncode == 0 or "no paramsyncd" not in p.stderr:
        H.fail("launcher without a daemon: rc %d, stderr %r" % (p.returncode, p.stderr))
    print("PASS")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--paramsyncd")
    p.add_argument("--transport", choices=("grpc", "shm"),
                   help="force PARAMSYNC_SHM=0 (grpc) or leave shared memory on (shm), and "
                        "check from the daemon's /metrics that big payloads went that way")
    p.add_argument("scenario")
    a = p.parse_args()
    if a.worker:
        WORKERS[a.scenario]()
        return
    driver(a)


if __name__ == "__main__":
    main()
