# Seed: torch-distributed-primitives.md, 7. gather.
#   python3 -m paramsync.run --nproc 2 gather.py
import torch
import paramsync.distributed as dist

dist.init_process_group("paramsync")  # env:// (set by the launcher)

tensor = torch.tensor([dist.get_rank()])
if dist.get_rank() == 0:
    gather_list = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
else:
    gather_list = None
dist.gather(tensor, gather_list, dst=0)
if dist.get_rank() == 0:
    print(f"Gathered result: {gather_list}")
