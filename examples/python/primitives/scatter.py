# Seed: torch-distributed-primitives.md, 8. scatter.
#   python3 -m paramsync.run --nproc 2 scatter.py
# As in the seed, the scattered tensors are int64 and the receiving one
# float32: torch raises "Invalid usage of tensors with different dtypes" on
# the source rank, and so does paramsync (TypeError); the other rank's scatter
# then fails too. scatter_same_dtype.py is the working version.
import torch
import paramsync.distributed as dist

dist.init_process_group("paramsync")  # env:// (set by the launcher)

if dist.get_rank() == 0:
    scatter_list = [torch.tensor([i]) for i in range(dist.get_world_size())]
else:
    scatter_list = None
tensor = torch.empty(1)
dist.scatter(tensor, scatter_list, src=0)
print(f"Rank {dist.get_rank()}: {tensor}")
