#!/usr/bin/python3
"""torch-bench: the torch.distributed (Gloo) baseline of bench/compare.

One process per rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the
environment; GLOO_SOCKET_IFNAME where it matters). The same sizes, rounding,
timing (the slowest rank's mean per call; its median in the CSV), check (after the timed calls, on
freshly filled buffers) and CSV columns as paramsync-bench, float32 and sum.
Gloo in torch 1.13 has no reduce_scatter: that row is left out. all_to_all_v is
all_to_all_single with split sizes: rank r sends rank j u (1 + (r + j) mod p) elements.
Run with Debian's /usr/bin/python3 (python3-torch).
"""
import argparse
import sys
import time

import torch
import torch.distributed as dist

PERIOD = 13
COLLS = ["all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter",
         "reduce_scatter", "all_to_all", "all_to_all_v", "barrier"]
UNSUPPORTED = {"reduce_scatter"}  # ProcessGroupGloo does not support reduce_scatter


def parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.upper().rstrip("B").rstrip("I")
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(float(s))


def pattern(r, n, start=0):
    """Element j is ((r*5 + ((start+j) % 13)*3) % 13) + 1, as in paramsync-bench."""
    table = torch.tensor([float((r * 5 + ((start + k) % PERIOD) * 3) % PERIOD + 1)
                          for k in range(PERIOD)], dtype=torch.float32)
    return table.repeat(n // PERIOD + 1)[:n]


def summed(p, n, start=0):
    table = torch.zeros(PERIOD, dtype=torch.float32)
    for r in range(p):
        table += pattern(r, PERIOD, start)
    return table.repeat(n // PERIOD + 1)[:n]


CHUNK = 1 << 22  # elements compared at a time, to keep the check's memory small


def count_ne(x, want, start=0):
    """Elements of x that differ from want(n, start) for the pattern function want."""
    bad = 0
    for o in range(0, x.numel(), CHUNK):
        part = x[o:o + CHUNK]
        bad += int((part != want(part.numel(), start + o)).sum())
    return bad


def a2av_counts(r, p, u):
    """all_to_all_v, as paramsync-bench: rank r sends rank j u (1 + (r + j) mod p) elements
    (and receives as many from it)."""
    return [u * (1 + (r + j) % p) for j in range(p)]


def factor(c, p):
    if c == "all_reduce":
        return 2.0 * (p - 1) / p
    if c in ("broadcast", "reduce"):
        return 1.0
    if c == "barrier":
        return 0.0
    return (p - 1) / p


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-b", default="4")
    ap.add_argument("-e", default="256M")
    ap.add_argument("-f", type=float, default=2.0)
    ap.add_argument("-w", type=int, default=5)
    ap.add_argument("-n", type=int, default=20)
    ap.add_argument("-B", default="0")
    ap.add_argument("-t", default="all")
    ap.add_argument("--csv")
    ap.add_argument("--label", default="gloo")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    rank, p = dist.get_rank(), dist.get_world_size()
    want = COLLS if a.t == "all" else a.t.split(",")
    minb, maxb, iter_bytes = parse_size(a.b), parse_size(a.e), parse_size(a.B)
    cap = max(maxb, 4 * p * (p + 1) // 2) // 4 + 1
    inp = torch.zeros(cap, dtype=torch.float32)
    out = torch.zeros(cap, dtype=torch.float32)
    csv = None
    if rank == 0 and a.csv:
        csv = sys.stdout if a.csv == "-" else open(a.csv, "a")
    if rank == 0:
        print(f"# torch-bench ({a.label}): torch {torch.__version__}, world {p}, float32 sum, "
              f"warmup {a.w}, iters {a.n}", flush=True)
    total_wrong = 0
    for c in COLLS:
        if c not in want or c in UNSUPPORTED:
            continue
        last = -1
        nominal = float(minb)
        while nominal <= maxb * 1.0000001:
            nb = int(nominal)
            nominal *= a.f
            if c == "barrier":
                n = size = 0
            elif c in ("all_gather", "gather", "scatter", "all_to_all"):
                n = max(1, nb // (4 * p))
                size = n * p * 4
            elif c == "all_to_all_v":
                units = p * (p + 1) // 2
                n = max(1, nb // (4 * units))
                size = n * units * 4
            else:
                n = max(1, nb // 4)
                size = n * 4
            if size == last:
                continue
            last = size
            x_out = out[:n * p] if c in ("all_gather", "gather", "all_to_all") else out[:n]
            x_in = inp[:n * p] if c in ("scatter", "all_to_all") else inp[:n]
            splits = a2av_counts(rank, p, n) if c == "all_to_all_v" else None
            if splits:
                x_out, x_in = out[:size // 4], inp[:size // 4]
            outs = list(x_out.chunk(p)) if c in ("all_gather", "gather") else None
            ins = list(x_in.chunk(p)) if c == "scatter" else None

            def run():
                if c == "all_reduce":
                    dist.all_reduce(x_out)
                elif c == "broadcast":
                    dist.broadcast(x_out, 0)
                elif c == "reduce":
                    dist.reduce(x_out, 0)
                elif c == "all_gather":
                    dist.all_gather(outs, x_in)
                elif c == "gather":
                    dist.gather(x_in, outs if rank == 0 else None, dst=0)
                elif c == "scatter":
                    dist.scatter(x_out, ins if rank == 0 else None, src=0)
                elif c == "all_to_all":
                    dist.all_to_all_single(x_out, x_in)
                elif c == "all_to_all_v":
                    dist.all_to_all_single(x_out, x_in, splits, splits)
                else:
                    dist.barrier()

            def prepare():
                if c in ("all_reduce", "reduce", "broadcast"):
                    x_out.copy_(pattern(rank, n))
                elif c in ("all_gather", "gather"):
                    x_in.copy_(pattern(rank, n))
                elif c == "scatter" and rank == 0:
                    for r in range(p):
                        ins[r].copy_(pattern(r, n))
                elif c == "all_to_all":
                    x_in.copy_(pattern(rank, n * p))
                elif c == "all_to_all_v":
                    x_in.copy_(pattern(rank, x_in.numel()))

            def verify():
                if c == "all_reduce":
                    return count_ne(x_out, lambda k, o: summed(p, k, o))
                if c == "reduce":  # torch leaves non-root buffers undefined (Gloo writes them)
                    return count_ne(x_out, lambda k, o: summed(p, k, o)) if rank == 0 else 0
                if c == "broadcast":
                    return count_ne(x_out, lambda k, o: pattern(0, k, o))
                if c in ("all_gather", "gather"):
                    if c == "gather" and rank != 0:
                        return 0
                    return sum(count_ne(outs[r], lambda k, o, r=r: pattern(r, k, o))
                               for r in range(p))
                if c == "scatter":
                    return count_ne(x_out, lambda k, o: pattern(rank, k, o))
                if c == "all_to_all":
                    return sum(count_ne(x_out[j * n:(j + 1) * n],
                                        lambda k, o, j=j: pattern(j, k, o), rank * n)
                               for j in range(p))
                if c == "all_to_all_v":  # block j: rank j's block `rank`, where it lies there
                    bad, at = 0, 0
                    for j in range(p):
                        cj = a2av_counts(j, p, n)
                        bad += count_ne(x_out[at:at + cj[rank]],
                                        lambda k, o, j=j: pattern(j, k, o), sum(cj[:rank]))
                        at += cj[rank]
                    return bad
                return -1

            w, it = a.w, a.n
            if iter_bytes and size:
                capn = max(1, iter_bytes // size)
                w, it = min(w, capn), min(it, capn)
            if c not in ("all_reduce", "reduce", "barrier"):
                prepare()
            dist.barrier()
            for _ in range(w):
                run()
            dist.barrier()
            times = []
            t0 = prev = time.perf_counter()
            for _ in range(it):
                run()
                now = time.perf_counter()
                times.append(now - prev)
                prev = now
            times.sort()
            med = times[it // 2] if it % 2 else 0.5 * (times[it // 2 - 1] + times[it // 2])
            tm = torch.tensor([(prev - t0) / it, med], dtype=torch.float64)
            dist.all_reduce(tm, op=dist.ReduceOp.MAX)
            t, med = float(tm[0]), float(tm[1])
            wrong = -1
            if c != "barrier":
                prepare()
                run()
                wt = torch.tensor([verify()], dtype=torch.int64)
                dist.all_reduce(wt)
                wrong = int(wt[0])
                total_wrong += wrong
            if rank == 0:
                algbw = size / t / 1e9 if size else 0.0
                busbw = algbw * factor(c, p)
                root = 0 if c in ("broadcast", "reduce", "gather", "scatter") else -1
                redop = "sum" if c in ("all_reduce", "reduce") else "none"
                dtype = "none" if c == "barrier" else "float32"
                print(f" {c:>15} {size:12d} {size // 4:11d} {dtype:>9} {redop:>5} {root:5d} "
                      f"{t * 1e6:11.2f} {algbw:11.3f} {busbw:11.3f} {wrong:8d}", flush=True)
                if csv:
                    csv.write(f"{a.label},{c},{p},{size},{size // 4},{dtype},{redop},{root},"
                              f"{t * 1e6:.3f},{algbw:.6f},{busbw:.6f},{wrong},{it},{med * 1e6:.3f}\n")
                    csv.flush()
            if c == "barrier":
                break
    if rank == 0:
        print(f"# {'FAILED' if total_wrong else 'OK'}: {total_wrong} wrong elements in all",
              flush=True)
    dist.destroy_process_group()
    return 3 if total_wrong else 0


if __name__ == "__main__":
    sys.exit(main())
