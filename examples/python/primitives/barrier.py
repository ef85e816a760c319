# Seed: torch-distributed-primitives.md, 11. barrier.
#   python3 -m paramsync.run --nproc 2 barrier.py
import torch
import paramsync.distributed as dist

dist.init_process_group("paramsync")  # env:// (set by the launcher)

print(f"Rank {dist.get_rank()} reached barrier.")
dist.barrier()
print(f"Rank {dist.get_rank()} passed barrier.")
