# Seed: torch-distributed-primitives.md, 1. send / 2. recv.
#   python3 -m paramsync.run --nproc 2 send_recv.py
# As in the seed, rank 0 sends an int64 tensor and rank 1 receives into a
# float32 one: torch's Gloo aborts on the size mismatch, and paramsync
# refuses it with an error naming both ranks and the dtypes (see
# send_recv_same_dtype.py for the working version). The one change to the
# seed beyond the import and the backend: rank comes from $RANK, not the
# literal 0, so that two processes can run it.
import os
import torch
import paramsync.distributed as dist

dist.init_process_group("paramsync", rank=int(os.environ["RANK"]), world_size=2)
tensor = torch.tensor([1, 2, 3])
if dist.get_rank() == 0:
    dist.send(tensor=tensor, dst=1)
elif dist.get_rank() == 1:
    recv_tensor = torch.empty(3)
    dist.recv(tensor=recv_tensor, src=0)
    print(recv_tensor)
