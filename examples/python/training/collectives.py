# Seed: pytorch-distributed-training.md, "Collective Communication": the
# seed's run functions (broadcast, scatter, gather, reduce, all-gather,
# all-reduce), run one after another by 4 workers started the way the seed's
# P2P program starts them (torch.multiprocessing, spawn, 127.0.0.1:29500,
# where a paramsyncd started with no options listens):
#   paramsyncd &  python3 collectives.py
# Added to the seed: names for the run functions, the prints, and run_all.
# reduce prints on dst only: elsewhere torch says the tensor "might be altered".
import os
import torch
import paramsync.distributed as dist
import torch.multiprocessing as mp

def init_process(rank_id, size, fn, backend='paramsync'):
  os.environ['MASTER_ADDR'] = '127.0.0.1'
  os.environ['MASTER_PORT'] = '29500'
  dist.init_process_group(backend, rank=rank_id, world_size=size)
  fn(rank_id, size)

# Broadcast
def run_broadcast(rank_id, size):
    tensor = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank_id
    dist.broadcast(tensor, src = 0)
    print(f"broadcast: rank {rank_id}: {tensor}")

def run_scatter(rank_id, size):
    tensor = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank_id
    if rank_id == 0:
        scatter_list = [torch.tensor([0,0]), torch.tensor([1,1]), torch.tensor([2,2]), torch.tensor([3,3])]
        dist.scatter(tensor, src = 0, scatter_list=scatter_list)
    else:
        dist.scatter(tensor, src = 0)
    print(f"scatter: rank {rank_id}: {tensor}")

def run_gather(rank_id, size):
    tensor = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank_id
    if rank_id == 0:
        gather_list = [torch.zeros(2, dtype=torch.int64) for _ in range(4)]
        dist.gather(tensor, dst = 0, gather_list=gather_list)
        print(f"gather: rank {rank_id}: {gather_list}")
    else:
        dist.gather(tensor, dst = 0)

def run_reduce(rank_id, size):
    tensor = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank_id
    dist.reduce(tensor, dst=3, op=dist.ReduceOp.SUM)
    if rank_id == 3:
        print(f"reduce: rank {rank_id}: {tensor}")

def run_all_gather(rank_id, size):
    tensor = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank_id
    gather_list = [torch.zeros(2, dtype=torch.int64) for _ in range(4)]
    dist.all_gather(gather_list, tensor)
    print(f"all_gather: rank {rank_id}: {gather_list}")

def run_all_reduce(rank_id, size):
    tensor = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank_id
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    print(f"all_reduce: rank {rank_id}: {tensor}")

def run_all(rank_id, size):
    for fn in (run_broadcast, run_scatter, run_gather, run_reduce, run_all_gather,
               run_all_reduce):
        fn(rank_id, size)

if __name__ == "__main__":
  size = 4
  processes = []
  mp.set_start_method("spawn")
  for rank in range(size):
    p = mp.Process(target=init_process, args=(rank, size, run_all))
    p.start()
    processes.append(p)
  for p in processes:
    p.join()
