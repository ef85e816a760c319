# Seed: torch-distributed-primitives.md, 10. all_to_all.
#   python3 -m paramsync.run --nproc 2 all_to_all.py
# As in the seed, all_to_all gets tensors where torch's signature takes lists
# of tensors: torch raises "Invalid function argument", and paramsync raises
# TypeError pointing to all_to_all_single. all_to_all_single.py is the
# working version.
import torch
import paramsync.distributed as dist

dist.init_process_group("paramsync")  # env:// (set by the launcher)

input = torch.tensor([dist.get_rank()] * dist.get_world_size())
output = torch.empty(dist.get_world_size(), dtype=torch.int)
dist.all_to_all(output, input)
print(f"Rank {dist.get_rank()}: {output}")
