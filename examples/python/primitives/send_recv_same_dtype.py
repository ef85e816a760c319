# Seed: torch-distributed-primitives.md, 1. send / 2. recv, with both ends
# float32 (the seed sends int64 into a float32 tensor, which neither Gloo nor
# paramsync accepts).
#   python3 -m paramsync.run --nproc 2 send_recv_same_dtype.py
import os
import torch
import paramsync.distributed as dist

dist.init_process_group("paramsync", rank=int(os.environ["RANK"]), world_size=2)
tensor = torch.tensor([1., 2., 3.])
if dist.get_rank() == 0:
    dist.send(tensor=tensor, dst=1)
elif dist.get_rank() == 1:
    recv_tensor = torch.empty(3)
    dist.recv(tensor=recv_tensor, src=0)
    print(recv_tensor)
