"""Example worker: all_reduce a gradient-sized tensor, as a torch.distributed
program would, through paramsync (init_method env://)."""
import os

import numpy as np

import paramsync.distributed as dist

dist.init_process_group(backend="paramsync", init_method="env://")
rank, world = dist.get_rank(), dist.get_world_size()
print("rank %d of %d joined job %s via %s:%s" % (rank, world, os.environ.get("PARAMSYNC_JOB"),
      os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]), flush=True)

for step in range(10):
    grad = np.full(1 << 20, float(rank + 1), dtype=np.float32)  # 4 MiB
    dist.all_reduce(grad, op=dist.ReduceOp.SUM)
    expected = world * (world + 1) / 2
    if not np.all(grad == expected):
        raise SystemExit("rank %d step %d: got %r, expected %r" % (rank, step, grad[0], expected))
    print("rank %d step %d: all_reduce OK (%g)" % (rank, step, grad[0]), flush=True)

dist.barrier()
dist.destroy_process_group()
