# Seed: torch-distributed-primitives.md, 5. reduce.
#   python3 -m paramsync.run --nproc 2 reduce.py
import torch
import paramsync.distributed as dist

dist.init_process_group("paramsync")  # env:// (set by the launcher)

tensor = torch.tensor([dist.get_rank() + 1])
dist.reduce(tensor, dst=0, op=dist.ReduceOp.SUM)
if dist.get_rank() == 0:
    print(f"Reduced result: {tensor}")
