# Seed: torch-distributed-primitives.md, 3. broadcast.
#   python3 -m paramsync.run --nproc 2 broadcast.py
import torch
import paramsync.distributed as dist

dist.init_process_group("paramsync")  # env:// (set by the launcher)

tensor = torch.tensor([0])
if dist.get_rank() == 0:
    tensor += 1  # Only rank 0 modifies the tensor
dist.broadcast(tensor, src=0)
print(f"Rank {dist.get_rank()}: {tensor}")
