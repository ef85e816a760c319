# Seed: torch-distributed-primitives.md, 9. reduce_scatter.
#   python3 -m paramsync.run --nproc 2 reduce_scatter.py
# As in the seed, the inputs are int64 and the output float32: torch raises
# "Invalid usage of tensors with different dtypes", and so does paramsync
# (TypeError). reduce_scatter_same_dtype.py is the working version.
import torch
import paramsync.distributed as dist

dist.init_process_group("paramsync")  # env:// (set by the launcher)

input = [torch.tensor([dist.get_rank() + 1]) for _ in range(dist.get_world_size())]
output = torch.empty(1)
dist.reduce_scatter(output, input, op=dist.ReduceOp.SUM)
print(f"Rank {dist.get_rank()}: {output}")
