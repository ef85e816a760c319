# Seed: torch-distributed-api.md, 5. new_group: two groups of a world of 4,
# all_reduce inside the first.
#   python3 -m paramsync.run --nproc 4 new_group.py
# Added to the seed: the tensor (rank + 1) and the print.
import torch
import paramsync.distributed as dist

dist.init_process_group("paramsync")  # env:// (set by the launcher)
tensor = torch.tensor([dist.get_rank() + 1])

# 假设 World Size = 4
# 创建两个子组：[0, 1] 和 [2, 3]
group1 = dist.new_group([0, 1])
group2 = dist.new_group([2, 3])

# 仅在组内进行 all_reduce
if dist.get_rank() in [0, 1]:
    dist.all_reduce(tensor, group=group1)

print(f"Rank {dist.get_rank()}: {tensor} in group1 of {dist.get_world_size(group1)}, "
      f"group2 rank {dist.get_rank(group2)}")
