"""The Python worker of the cross-language test (xlang.py): the steps of
xlang_worker.c, with paramsync.distributed on numpy arrays (XLANG_PEER=1: its
peer_steps)."""
import os
import sys

import numpy as np

import paramsync.distributed as dist

dist.init_process_group("paramsync")
r = dist.get_rank()
assert dist.get_world_size() == 3


def expect(got, want, what):
    got = np.asarray(got)
    if got.dtype != np.asarray(want).dtype or not np.array_equal(got, want):
        print("Python rank %d: %s: got %r, want %r" % (r, what, got, want), file=sys.stderr)
        sys.exit(1)
    print("Python rank %d: %s ok" % (r, what), flush=True)


if os.environ.get("XLANG_PEER") == "3":
    # xlang_worker.c's barrier_steps: barriers met on the page the ranks share.
    import time
    for _ in range(3):
        dist.barrier()
    fine = True
    for late in range(3):
        if r == late:
            time.sleep(0.1)
        mine = np.array([time.monotonic()])
        dist.barrier()
        left = time.monotonic()
        arrived = [np.zeros(1) for _ in range(3)]
        dist.all_gather(arrived, mine)
        fine = fine and left >= arrived[late][0]
    expect(np.bool_(fine), np.bool_(True), "barriers wait for the last rank")
    for _ in range(200):
        dist.barrier()
    expect(np.int64(200), np.int64(200), "200 barriers")
    # Rank 2 calls an all_reduce where the others call a barrier: all are told at once.
    if r != 2:
        time.sleep(0.1)
    t0 = time.monotonic()
    code = None
    try:
        dist.all_reduce(np.ones(1, np.float32)) if r == 2 else dist.barrier()
    except dist.ParamsyncError as e:
        code = e.code.name
        print("Python rank %d: %s" % (r, e), flush=True)
    expect(np.bool_(code == "FAILED_PRECONDITION" and time.monotonic() - t0 < 1.0),
           np.bool_(True), "a barrier against an all_reduce fails at once")
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0)

if os.environ.get("XLANG_PEER") == "4":
    # Object collectives between Python and Node.js ranks (no C rank): pickles and v8's
    # serialization do not read each other, so each side fails naming the first rank of the
    # other language (XLANG_ORDER), and the job goes on.
    order = os.environ["XLANG_ORDER"].split(",")
    other = next(k for k, lang in enumerate(order) if lang != "Python")
    said = ""
    try:
        dist.all_gather_object([None] * 3, {"rank": r})
    except ValueError as e:
        said = str(e)
        print("Python rank %d: %s" % (r, e), flush=True)
    expect(np.bool_("the object from rank %d could not be unpickled" % other in said),
           np.bool_(True), "all_gather_object with a Node.js rank fails naming it")
    x = np.array([r], np.int64)
    dist.all_reduce(x)
    expect(x, np.array([3], np.int64), "all_reduce after the object error")
    dist.destroy_process_group()
    sys.exit(0)

if os.environ.get("XLANG_PEER") == "2":
    # xlang_worker.c's mem_steps: an all_to_all from empty() memory by peer copies, the
    # other ranks' segments read through mappings this rank keeps.
    B = 700001
    k = np.arange(3 * B)
    mem = dist.empty(6 * B, np.int32)
    assert dist.is_shared(mem), "empty() memory is not shared"
    src, out = mem[:3 * B], mem[3 * B:]
    src[:] = (1000 * r + 10 * (k // B) + k % B % 7).astype(np.int32)
    dist.all_to_all_single(out, src)
    expect(out, (1000 * (k // B) + 10 * r + k % B % 7).astype(np.int32),
           "all_to_all int32 of 8 MiB from empty() memory")
    mine = "/paramsync.%d." % os.getpid()
    with open("/proc/self/maps") as f:
        mapped = sum(1 for line in f if "/paramsync." in line and mine not in line)
    expect(np.int64(mapped), np.int64(int(os.environ["XLANG_MAPS"])),
           "the others' segments mapped")
    dist.barrier()
    dist.free(mem)
    dist.destroy_process_group()
    sys.exit(0)

if os.environ.get("XLANG_PEER") == "1":
    # xlang_worker.c's peer_steps: taken by peer copies, C and Python ranks together.
    B = 700001
    k = np.arange(3 * B)
    src = (1000 * r + 10 * (k // B) + k % B % 7).astype(np.int32)
    out = np.zeros(3 * B, np.int32)
    dist.all_to_all_single(out, src)
    expect(out, (1000 * (k // B) + 10 * r + k % B % 7).astype(np.int32),
           "all_to_all int32 of 8 MiB")
    fout = np.zeros(3 * B, np.float32)
    dist.all_gather_into_tensor(fout, (r + (np.arange(B) % 3) * 0.5).astype(np.float32))
    expect(fout, (k // B + (k % B % 3) * 0.5).astype(np.float32), "all_gather float32 of 8 MiB")
    j = np.arange(B)
    lst = [np.zeros(B, np.int32) for _ in range(3)] if r == 1 else None
    dist.gather((7 * r + j % 5).astype(np.int32), lst, dst=1)
    expect(np.concatenate(lst) if r == 1 else np.zeros(0, np.int32),
           (7 * (k // B) + k % B % 5).astype(np.int32) if r == 1 else np.zeros(0, np.int32),
           "gather int32 of 8 MiB")
    lst = [(9 * q + j % 3).astype(np.int32) for q in range(3)] if r == 2 else None
    got = np.zeros(B, np.int32)
    dist.scatter(got, lst, src=2)
    expect(got, (9 * r + j % 3).astype(np.int32), "scatter int32 of 8 MiB")

    def sent(s, d):  # xlang_worker.c's uneven_step: elements rank s sends rank d
        return 0 if (s + d) % 3 == 1 else (s + 2 * d + 1) * 200003

    def values(s, d):
        return np.arange(sent(s, d), dtype=np.int32) + (10 * s + d) * 10_000_000
    out = np.zeros(sum(sent(q, r) for q in range(3)), np.int32)
    dist.all_to_all_single(out, np.concatenate([values(r, q) for q in range(3)]),
                           [sent(q, r) for q in range(3)], [sent(r, q) for q in range(3)])
    expect(out, np.concatenate([values(q, r) for q in range(3)]), "uneven all_to_all int32")
    dist.destroy_process_group()
    sys.exit(0)

R = dist.ReduceOp
f = np.array([r + 1, (r + 1) * 0.5, -r], np.float32)
dist.all_reduce(f, op=R.SUM)
expect(f, np.array([6, 3, -3], np.float32), "all_reduce float32 SUM")
x = np.array([r + 2, -(r + 1)], np.int64)
dist.all_reduce(x, op=R.PRODUCT)
expect(x, np.array([24, -6], np.int64), "all_reduce int64 PRODUCT")
x = np.array([r * 10, -r], np.int32)
dist.all_reduce(x, op=R.MAX)
expect(x, np.array([20, 0], np.int32), "all_reduce int32 MAX")
x = np.array([r * 10, -r], np.int32)
dist.all_reduce(x, op=R.MIN)
expect(x, np.array([0, -2], np.int32), "all_reduce int32 MIN")
x = np.array([1 << r, 255], np.uint8)
dist.all_reduce(x, op=R.BXOR)
expect(x, np.array([7, 255], np.uint8), "all_reduce uint8 BXOR")
x = np.array([255 - r], np.int16)
dist.all_reduce(x, op=R.BAND)
expect(x, np.array([252], np.int16), "all_reduce int16 BAND")
x = np.array([3.0 * r, 1], np.float64)
dist.all_reduce(x, op=R.AVG)
expect(x, np.array([3, 1], np.float64), "all_reduce float64 AVG")
x = np.array([r == 2, False])
dist.all_reduce(x, op=R.BOR)
expect(x, np.array([True, False]), "all_reduce bool BOR")
k = np.arange(1 << 20) % 7
big = (r + 1 + k).astype(np.float32)
dist.all_reduce(big)
expect(big, (6 + 3 * k).astype(np.float32), "all_reduce float32 SUM of 4 MiB")

x = np.array([r * 100, 7], np.int32)
dist.broadcast(x, src=1)
expect(x, np.array([100, 7], np.int32), "broadcast int32 from rank 1")
x = np.array([r + 0.5])
dist.broadcast(x, src=2)
expect(x, np.array([2.5]), "broadcast float64 from rank 2")

out = [np.zeros(2, np.float32) for _ in range(3)]
dist.all_gather(out, np.array([r, r + 0.25], np.float32))
expect(np.concatenate(out), np.array([0, 0.25, 1, 1.25, 2, 2.25], np.float32),
       "all_gather float32")
for dst in (0, 2):
    lst = [np.zeros(1, np.int64) for _ in range(3)] if r == dst else None
    dist.gather(np.array([r * r], np.int64), lst, dst=dst)
    if r == dst:
        expect(np.concatenate(lst), np.array([0, 1, 4], np.int64), "gather int64")
for src in (2, 0):
    lst = [np.array([v], np.int32) for v in (0, 11 + src, 22 + src)] if r == src else None
    x = np.array([-1], np.int32)
    dist.scatter(x, lst, src=src)
    expect(x, np.array([r * 11 + (src if r else 0)], np.int32), "scatter int32")
dist.barrier()
print("Python rank %d: barrier ok" % r)
dist.destroy_process_group()
