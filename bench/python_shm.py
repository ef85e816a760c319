#!/usr/bin/python3
"""Python client: gRPC frames, the shared-memory segment and empty() memory, side by side.

    /usr/bin/python3 bench/python_shm.py --paramsyncd BUILD/server/paramsyncd \
        [--python VENV/bin/python] [--mib 64] [--np 2,4] [--iters 5]

For each world size it starts one paramsyncd on a free loopback port (with
/metrics), then runs the same job three times, PARAMSYNC_SHM=0, shared memory
on (a numpy array: copied through the segment), and shared memory on with the
array from paramsync.distributed.empty() (used in place by the daemon):
float32 all_reduce and broadcast (root 0) of --mib MiB, all_gather_into_tensor
in place into --mib MiB (the input a slice of the output, torch's way), and
all_gather into a list of n arrays of their own ("list") or of n slices of that
array ("chunks"), the input an array of its own (with --latency: barrier
and a 4-byte all_reduce, which shared memory sends through the doorbell
instead of a call, alone and four async ones at once, time per call; 200
calls, times in microseconds), one untimed call
of each first. A call's time is the slowest rank's, from a barrier to its
return; the table gives the median over --iters calls, and the bytes the
daemon counted between workers and agent over the whole run (so the shm rows
show that the payload did not travel as frames). Without --python, the
checkout's client/python is used (its stubs: `python3 client/python/setup.py
gen_proto`). Results are checked once per operation.
"""
import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
# --latency also times ASYNC async_op=True all_reduces in flight at once (per call).
ASYNC = 4
ASYNC_OP = "all_reduce 4 B, %d async at once" % ASYNC
OPS = ("all_reduce", "broadcast", "all_gather in place", "all_gather list", "all_gather chunks")
CLIENT = os.path.join(os.path.dirname(HERE), "client", "python")


def latency_worker(iters):
    import numpy as np
    import paramsync.distributed as dist
    dist.init_process_group("paramsync")
    r = dist.get_rank()
    x = np.ones(1, np.float32)
    xs = [np.ones(1, np.float32) for _ in range(ASYNC)]

    def in_flight():
        for w in [dist.all_reduce(y, async_op=True) for y in xs]:
            w.wait()

    out = {}
    for op, call, calls in (("barrier", dist.barrier, 1),
                            ("all_reduce 4 B", lambda: dist.all_reduce(x), 1),
                            (ASYNC_OP, in_flight, ASYNC)):
        for _ in range(20):
            call()
        times = np.zeros(iters, np.float64)
        for i in range(iters):
            t0 = time.perf_counter()
            call()
            times[i] = (time.perf_counter() - t0) / calls
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        out[op] = times.tolist()
    if r == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def worker(mib, iters, empty):
    import numpy as np
    import paramsync.distributed as dist
    dist.init_process_group("paramsync")
    r, n = dist.get_rank(), dist.get_world_size()
    count = (mib << 20) // 4
    x = dist.empty(count, "float32") if empty else np.ones(count, np.float32)
    block = count // n
    own = x[r * block:(r + 1) * block]
    chunks = [x[q * block:(q + 1) * block] for q in range(n)]
    apart = [dist.empty(block, "float32") if empty else np.empty(block, np.float32)
             for _ in range(n)]
    mine = np.empty(block, np.float32)
    out = {}
    for op in OPS:
        def call():
            if op == "all_reduce":
                dist.all_reduce(x)
            elif op == "broadcast":
                dist.broadcast(x, src=0)
            elif op == "all_gather list":
                dist.all_gather(apart, mine)
            elif op == "all_gather chunks":
                dist.all_gather(chunks, mine)
            else:
                dist.all_gather_into_tensor(x[:n * block], own)
        x[:] = r + 1
        mine[:] = r + 1
        dist.barrier()
        call()  # untimed: the segment (or the channel's buffers) settle here
        if op.startswith("all_gather"):
            want = np.repeat(np.arange(1, n + 1, dtype=np.float32), block)
            ok = ((np.concatenate(apart) if op == "all_gather list" else x[:n * block]) ==
                  want).all()
        else:
            ok = (x == (n * (n + 1) / 2 if op == "all_reduce" else 1.0)).all()
        if not ok:
            raise SystemExit("rank %d: %s gave %r" % (r, op, x[:4]))
        times = np.zeros(iters, np.float64)
        for i in range(iters):
            x[:] = 1.0
            dist.barrier()
            t0 = time.perf_counter()
            call()
            times[i] = time.perf_counter() - t0
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank's time per call
        out[op] = times.tolist()
    if r == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def payload_bytes(url):
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    total = 0
    for m in re.finditer(r'^paramsync_payload_bytes_total\{direction="\w+",link="worker"\} (\d+)$',
                         text, re.M):
        total += int(m.group(1))
    return total


def run_job(a, addr, metrics, n, shm, job, empty=False):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PARAMSYNC_ADDR", "PARAMSYNC_JOB", "RANK", "WORLD_SIZE", "PARAMSYNC_SHM")}
    if not a.python:
        env["PYTHONPATH"] = CLIENT + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(PARAMSYNC_ADDR=addr, PARAMSYNC_JOB=job, WORLD_SIZE=str(n),
               PARAMSYNC_SHM="1" if shm else "0")
    before = payload_bytes(metrics)
    procs = [subprocess.Popen([a.python or sys.executable, os.path.abspath(__file__), "--worker",
                               "--mib", str(a.mib), "--iters", str(a.iters)]
                              + (["--empty"] if empty else [])
                              + (["--latency"] if a.latency else []),
                              env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, text=True)
             for r in range(n)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode != 0 for p in procs):
        raise SystemExit("a worker failed (p=%d, shm=%s): %s" % (n, shm, outs))
    line = next(ln for ln in outs[0].splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), payload_bytes(metrics) - before


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--paramsyncd")
    p.add_argument("--python")
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--np", default="2,4")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--empty", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--latency", action="store_true",
                   help="barrier and 4-byte all_reduce, gRPC calls against the doorbell")
    a = p.parse_args()
    if a.worker:
        return latency_worker(a.iters) if a.latency else worker(a.mib, a.iters, a.empty)
    if a.latency and a.iters == 5:
        a.iters = 200
    if not a.paramsyncd:
        p.error("--paramsyncd is required")
    rows = []
    for n in [int(v) for v in a.np.split(",")]:
        tmp = tempfile.mkdtemp(prefix="ps-bench-shm-")
        announce, log = os.path.join(tmp, "addr"), open(os.path.join(tmp, "log"), "w+")
        d = subprocess.Popen([a.paramsyncd, "--listen", "127.0.0.1:0", "--metrics-addr",
                              "127.0.0.1:0", "--announce-file", announce], stderr=log,
                             stdout=log)
        try:
            metrics = addr = None
            for _ in range(300):
                log.seek(0)
                m = re.search(r"metrics on (http://\S+)", log.read())
                if m and os.path.exists(announce) and open(announce).read().endswith("\n"):
                    metrics, addr = m.group(1), open(announce).read().strip()
                    break
                time.sleep(0.05)
            if not addr:
                log.seek(0)
                raise SystemExit("paramsyncd did not start; its log:\n" + log.read())
            res = {}
            for shm in (False, True):
                res[shm] = run_job(a, addr, metrics, n, shm, "bench-%d-%d" % (n, shm))
            if a.latency:
                for op in ("barrier", "all_reduce 4 B", ASYNC_OP):
                    rows.append((op, n, statistics.median(res[False][0][op]),
                                 statistics.median(res[True][0][op])))
                continue
            res["empty"] = run_job(a, addr, metrics, n, True, "bench-%d-empty" % n, empty=True)
        finally:
            d.send_signal(signal.SIGTERM)
            d.wait()
            log.close()
            shutil.rmtree(tmp, ignore_errors=True)
        for op in OPS:
            g = statistics.median(res[False][0][op])
            s = statistics.median(res[True][0][op])
            e = statistics.median(res["empty"][0][op])
            rows.append((op, n, g, s, e, res[False][1], res[True][1], res["empty"][1]))
    if a.latency:
        print("median of %d calls (slowest rank), python %s" % (a.iters,
                                                              a.python or sys.executable))
        print("| op | p | gRPC call us | doorbell us | ratio |")
        print("| --- | --- | --- | --- | --- |")
        for op, n, g, s in rows:
            print("| %s | %d | %.0f | %.0f | %.2fx |" % (op, n, g * 1e6, s * 1e6, s / g))
        return
    mib = a.mib
    print("%d MiB float32, median of %d calls (slowest rank), python %s"
          % (mib, a.iters, a.python or sys.executable))
    print("| op | p | gRPC ms | shm ms | empty() ms | gRPC GiB/s | shm GiB/s | empty() GiB/s "
          "| shm speed-up | empty() speed-up |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for op, n, g, s, e, _, _, _ in rows:
        print("| %s | %d | %.1f | %.1f | %.1f | %.2f | %.2f | %.2f | %.1fx | %.1fx |"
              % (op, n, g * 1e3, s * 1e3, e * 1e3, mib / 1024 / g, mib / 1024 / s,
                 mib / 1024 / e, g / s, g / e))
    print("worker<->agent payload bytes over each whole run (gRPC / shm / empty()): " + ", ".join(
        "p=%d %s %.0f / %.0f / %.0f MiB" % (n, op, gb / 2**20, sb / 2**20, eb / 2**20)
        for op, n, _, _, _, gb, sb, eb in rows if op == "all_reduce"))


if __name__ == "__main__":
    main()
