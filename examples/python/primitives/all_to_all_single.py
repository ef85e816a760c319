# Seed: torch-distributed-primitives.md, 10. all_to_all, as the seed means it:
# tensors (all_to_all_single) of one dtype (the seed's input is int64 and its
# output int32).
#   python3 -m paramsync.run --nproc 2 all_to_all_single.py
import torch
import paramsync.distributed as dist

dist.init_process_group("paramsync")  # env:// (set by the launcher)

input = torch.tensor([dist.get_rank()] * dist.get_world_size(), dtype=torch.int)
output = torch.empty(dist.get_world_size(), dtype=torch.int)
dist.all_to_all_single(output, input)
print(f"Rank {dist.get_rank()}: {output}")
