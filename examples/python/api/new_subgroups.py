# Not from a seed: torch.distributed's new_subgroups (the world cut into groups
# of consecutive ranks) and new_subgroups_by_enumeration (groups listed), each
# rank all-reducing within its own. torch 1.13 makes subgroups only where CUDA is,
# so seed.api.new_subgroups compares the output with tests/clients/expected/.
#   python3 -m paramsync.run --nproc 4 new_subgroups.py
import torch
import paramsync.distributed as dist

dist.init_process_group("paramsync")
rank = dist.get_rank()

mine, subgroups = dist.new_subgroups(2)
tensor = torch.tensor([rank + 1])
dist.all_reduce(tensor, group=mine)
print(f"Rank {rank}: {len(subgroups)} subgroups of 2, sum in mine {tensor.item()}")

mine, subgroups = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
tensor = torch.tensor([10 * (rank + 1)])
dist.all_reduce(tensor, group=mine)
print(f"Rank {rank}: by enumeration, rank {dist.get_rank(mine)} of "
      f"{dist.get_world_size(mine)}, sum {tensor.item()}")
dist.destroy_process_group()
