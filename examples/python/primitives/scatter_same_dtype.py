# Seed: torch-distributed-primitives.md, 8. scatter, with float32 on both
# sides (the seed scatters int64 tensors into a float32 one).
#   python3 -m paramsync.run --nproc 2 scatter_same_dtype.py
import torch
import paramsync.distributed as dist

dist.init_process_group("paramsync")  # env:// (set by the launcher)

if dist.get_rank() == 0:
    scatter_list = [torch.tensor([float(i)]) for i in range(dist.get_world_size())]
else:
    scatter_list = None
tensor = torch.empty(1)
dist.scatter(tensor, scatter_list, src=0)
print(f"Rank {dist.get_rank()}: {tensor}")
