# Seed: torch-distributed-primitives.md, 4. all_reduce.
#   python3 -m paramsync.run --nproc 2 all_reduce.py
import torch
import paramsync.distributed as dist

dist.init_process_group("paramsync")  # env:// (set by the launcher)

tensor = torch.tensor([dist.get_rank() + 1])
dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
print(f"Rank {dist.get_rank()}: {tensor}")
