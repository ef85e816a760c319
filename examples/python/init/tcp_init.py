# Seed: torch-distributed-backends-init.md, 2.1 TCP init: every process names
# the address 10.1.1.20:23456 and its rank. With paramsync the address is the
# daemon's: paramsyncd --listen 10.1.1.20:23456 on that machine, then on
# each worker:
#   python3 tcp_init.py --rank R        (R = 0..3)
# Added to the seed: the argument parsing, and an all_reduce to show the
# job works.
import argparse
import torch
import paramsync.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--rank", type=int, required=True)
args = parser.parse_args()
backend = "paramsync"

# 使用其中一台机器的地址
dist.init_process_group(backend, init_method='tcp://10.1.1.20:23456',rank=args.rank, world_size=4)

tensor = torch.tensor([float(args.rank)])
dist.all_reduce(tensor)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: {tensor}")
