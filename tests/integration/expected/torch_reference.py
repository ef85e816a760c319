#!/usr/bin/python3
"""Regenerates the expected outputs of the C examples from torch.distributed itself (Gloo).

usage: /usr/bin/python3 torch_reference.py EXAMPLE WORLD_SIZE [PORT]
       /usr/bin/python3 torch_reference.py --check     (compares every *.txt here)

Each snippet is the seed's, with the dtype adaptations the C examples make
(one dtype per collective): it prints what torch prints. Gloo has no
reduce_scatter or all_to_all, so reduce_scatter.p4.txt and all_to_all.p4.txt
were written by hand from torch's documented semantics.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def snippet(name, rank, size):
    out = []
    if name == "broadcast":
        t = torch.tensor([0])
        if rank == 0:
            t += 1
        dist.broadcast(t, src=0)
        out.append(f"Rank {rank}: {t}")
    elif name == "all_reduce":
        t = torch.tensor([rank + 1])
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        out.append(f"Rank {rank}: {t}")
    elif name == "reduce":
        t = torch.tensor([rank + 1])
        dist.reduce(t, dst=0, op=dist.ReduceOp.SUM)
        if rank == 0:
            out.append(f"Reduced result: {t}")
    elif name == "all_gather":
        t = torch.tensor([rank])
        gl = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(gl, t)
        out.append(f"Rank {rank}: {gl}")
    elif name == "gather":
        t = torch.tensor([rank])
        gl = [torch.empty_like(t) for _ in range(size)] if rank == 0 else None
        dist.gather(t, gl, dst=0)
        if rank == 0:
            out.append(f"Gathered result: {gl}")
    elif name == "scatter":
        sl = [torch.tensor([float(i)]) for i in range(size)] if rank == 0 else None
        t = torch.empty(1)
        dist.scatter(t, sl, src=0)
        out.append(f"Rank {rank}: {t}")
    elif name == "barrier":
        out.append(f"Rank {rank} reached barrier.")
        dist.barrier()
        out.append(f"Rank {rank} passed barrier.")
    elif name == "send_recv":
        t = torch.tensor([1.0, 2.0, 3.0])
        if rank == 0:
            dist.send(tensor=t, dst=1)
        elif rank == 1:
            r = torch.empty(3)
            dist.recv(tensor=r, src=0)
            out.append(str(r))
    elif name == "p2p":
        t = torch.zeros(1)
        if rank == 0:
            t += 1
            dist.send(tensor=t, dst=1)
            dist.recv(tensor=t, src=1)
        else:
            dist.recv(tensor=t, src=0)
            t += 1
            dist.send(tensor=t, dst=0)
        out.append(f"Rank {rank}: {t}")
    elif name.startswith("arange_"):
        c = name[len("arange_"):]
        t = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank
        show = True
        if c == "broadcast":
            dist.broadcast(t, src=0)
        elif c == "scatter":
            sl = [torch.tensor([i, i]) for i in range(size)] if rank == 0 else None
            dist.scatter(t, src=0, scatter_list=sl)
        elif c == "gather":
            gl = [torch.zeros(2, dtype=torch.int64) for _ in range(size)] if rank == 0 else None
            dist.gather(t, dst=0, gather_list=gl)
            if rank == 0:
                out.append(f"Rank {rank}: {gl}")
            show = False
        elif c == "reduce":
            dist.reduce(t, dst=3, op=dist.ReduceOp.SUM)
            show = rank == 3  # other ranks' tensors are unspecified
        elif c == "all_gather":
            gl = [torch.zeros(2, dtype=torch.int64) for _ in range(size)]
            dist.all_gather(gl, t)
            out.append(f"Rank {rank}: {gl}")
            show = False
        elif c == "all_reduce":
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        if show:
            out.append(f"Rank {rank}: {t}")
    elif name == "all_to_all_v":
        # Not a seed: all_to_all_single with split sizes (examples/c/all_to_all_v.c).
        ins = [rank + j + 1 for j in range(size)]
        outs = [j + rank + 1 for j in range(size)]
        t = torch.tensor([100 * rank + 10 * j + k for j in range(size) for k in range(ins[j])])
        o = torch.zeros(sum(outs), dtype=torch.int64)
        dist.all_to_all_single(o, t, outs, ins)
        out.append(f"Rank {rank}: {o}")
    elif name == "new_group":
        g1 = dist.new_group([0, 1])
        g2 = dist.new_group([2, 3])
        t = torch.tensor([rank + 1])
        dist.all_reduce(t, group=g1 if rank < 2 else g2)
        out.append(f"Rank {rank}: {t}")
    else:
        raise SystemExit(f"no torch snippet for {name}")
    return out


def worker(rank, size, name, port, queue):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    queue.put((rank, snippet(name, rank, size)))
    dist.barrier()
    dist.destroy_process_group()


def reference(name, size, port):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, size, name, port, queue)) for r in range(size)]
    for p in procs:
        p.start()
    results = dict(queue.get() for _ in range(size))
    for p in procs:
        p.join()
    return "".join(line + "\n" for r in range(size) for line in results[r])


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.argv[1:] == ["--check"]:
        bad, port = 0, 29870
        for f in sorted(os.listdir(here)):
            if not f.endswith(".txt") or f.split(".")[0] in ("reduce_scatter", "all_to_all"):
                continue
            name, p = f[:-4].rsplit(".p", 1)
            port += 1
            got = reference(name, int(p), port)
            with open(os.path.join(here, f)) as fh:
                same = fh.read() == got
            print(f"{f}: {'matches torch' if same else 'DIFFERS from torch'}")
            bad += not same
        sys.exit(1 if bad else 0)
    name, size = sys.argv[1], int(sys.argv[2])
    port = int(sys.argv[3]) if len(sys.argv) > 3 else 29870
    sys.stdout.write(reference(name, size, port))


if __name__ == "__main__":
    main()
