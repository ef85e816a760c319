# Not from a seed: torch.distributed's object collectives, which move any
# picklable Python objects (a config, a dict of metrics, a list of file names)
# instead of tensors. The same program runs on torch's Gloo with the import and
# the backend name changed (the client test seed.api.objects compares the outputs).
#   python3 -m paramsync.run --nproc 3 objects.py
import paramsync.distributed as dist

dist.init_process_group("paramsync")
rank, world = dist.get_rank(), dist.get_world_size()

# Every rank gets every rank's object, in rank order.
gathered = [None] * world
dist.all_gather_object(gathered, {"rank": rank, "loss": 1.0 / (rank + 1)})
print(f"Rank {rank}: all_gather_object {gathered}")

# Rank 0's list replaces everyone's, element by element.
config = [{"lr": 0.1, "steps": 100}, "resnet50"] if rank == 0 else [None, None]
dist.broadcast_object_list(config, src=0)
print(f"Rank {rank}: broadcast_object_list {config}")

# Only the destination passes a list.
results = [None] * world if rank == world - 1 else None
dist.gather_object((rank, "done" * rank), results, dst=world - 1)
if rank == world - 1:
    print(f"Rank {rank}: gather_object {results}")

# Rank i gets element i of the source's list.
shard = [None]
files = [[f"part-{i}-{k}" for k in range(i + 1)] for i in range(world)]
dist.scatter_object_list(shard, files if rank == 0 else None, src=0)
print(f"Rank {rank}: scatter_object_list {shard[0]}")

# In a group of the even ranks, src is a global rank as everywhere.
evens = dist.new_group(list(range(0, world, 2)))
if rank % 2 == 0:
    names = [f"from rank {rank}"] if rank == 2 else [None]
    dist.broadcast_object_list(names, src=2 if world > 2 else 0, group=evens)
    print(f"Rank {rank}: broadcast_object_list in the even ranks {names}")

dist.destroy_process_group()
