# Seed: pytorch-distributed-training.md, "P2P Communication": a complete
# program that starts its own two workers (torch.multiprocessing, spawn) and
# meets at MASTER_ADDR:MASTER_PORT = 127.0.0.1:29500, which is where a
# paramsyncd started with no options listens:
#   paramsyncd &  python3 p2p.py
# (or PARAMSYNC_ADDR=HOST:PORT python3 p2p.py for a daemon elsewhere).
# Added to the seed: the print at the end of run(), so that there is
# something to compare.
import os
import torch
import paramsync.distributed as dist
import torch.multiprocessing as mp

def init_process(rank_id, size, fn, backend='paramsync'):
  os.environ['MASTER_ADDR'] = '127.0.0.1'
  os.environ['MASTER_PORT'] = '29500'
  dist.init_process_group(backend, rank=rank_id, world_size=size)
  fn(rank_id, size)
  
def run(rank_id, size):
  tensor = torch.zeros(1)
  if rank_id == 0:
    tensor += 1
    dist.send(tensor=tensor, dst=1)
    dist.recv(tensor=tensor, src=1)
  else:
    dist.recv(tensor=tensor, src=0)
    tensor += 1
    dist.send(tensor=tensor, dst=0)
  print(f"rank {rank_id}: {tensor}")

if __name__ == "__main__":
  size = 2
  processes = []
  mp.set_start_method("spawn")
  for rank in range(size):
    p = mp.Process(target=init_process, args=(rank, size, run))
    p.start()
    processes.append(p)
  for p in processes:
    p.join()
