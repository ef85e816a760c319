# Seed: torch-distributed-primitives.md, 9. reduce_scatter, with an int64
# output like the inputs (the seed's output is float32). torch's Gloo backend
# does not implement reduce_scatter at all; paramsync does.
#   python3 -m paramsync.run --nproc 2 reduce_scatter_same_dtype.py
import torch
import paramsync.distributed as dist

dist.init_process_group("paramsync")  # env:// (set by the launcher)

input = [torch.tensor([dist.get_rank() + 1]) for _ in range(dist.get_world_size())]
output = torch.empty(1, dtype=torch.int64)
dist.reduce_scatter(output, input, op=dist.ReduceOp.SUM)
print(f"Rank {dist.get_rank()}: {output}")
