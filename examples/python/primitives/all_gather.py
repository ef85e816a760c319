# Seed: torch-distributed-primitives.md, 6. all_gather.
#   python3 -m paramsync.run --nproc 2 all_gather.py
import torch
import paramsync.distributed as dist

dist.init_process_group("paramsync")  # env:// (set by the launcher)

tensor = torch.tensor([dist.get_rank()])
gather_list = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
dist.all_gather(gather_list, tensor)
print(f"Rank {dist.get_rank()}: {gather_list}")
