# Seed: torch-distributed-backends-init.md, 2.2 shared file-system init:
# every process names the file /mnt/nfs/sharedfile and its rank. With
# paramsync the file holds the daemon's address, written by
# `paramsyncd --announce-file /mnt/nfs/sharedfile` (workers wait for it),
# and the file's path is the job id; then on each worker:
#   python3 file_init.py --rank R       (R = 0..3)
# Added to the seed: the argument parsing, and an all_reduce to show the
# job works.
import argparse
import torch
import paramsync.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--rank", type=int, required=True)
args = parser.parse_args()
backend = "paramsync"

# 应始终指定等级
dist.init_process_group(backend, init_method='file:///mnt/nfs/sharedfile',world_size=4, rank=args.rank)

tensor = torch.tensor([float(args.rank)])
dist.all_reduce(tensor)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: {tensor}")
