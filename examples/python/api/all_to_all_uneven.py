# Not from a seed: all_to_all_single with uneven splits (torch's form for, say,
# tokens routed to experts): rank r sends r + j + 1 rows to rank j, each row a
# pair of values naming the sender, the receiver and the row. Runs on torch's
# Gloo with the import and the backend name changed (seed.api.all_to_all_uneven).
#   python3 -m paramsync.run --nproc 3 all_to_all_uneven.py
import torch
import paramsync.distributed as dist

dist.init_process_group("paramsync")
rank, world = dist.get_rank(), dist.get_world_size()

input_splits = [rank + j + 1 for j in range(world)]   # rows to rank j
output_splits = [j + rank + 1 for j in range(world)]  # rows from rank j
rows = [[100 * rank + 10 * j + k, -k] for j in range(world) for k in range(input_splits[j])]
input = torch.tensor(rows, dtype=torch.int64)
output = torch.zeros(sum(output_splits), 2, dtype=torch.int64)
dist.all_to_all_single(output, input, output_splits, input_splits)
print(f"Rank {rank}: {output.tolist()}")

# Asynchronous, in float32, with a rank that gets nothing from rank 0.
input_splits = [0 if rank == 0 and j == 1 else 2 for j in range(world)]
output_splits = [0 if rank == 1 and j == 0 else 2 for j in range(world)]
input = torch.arange(sum(input_splits), dtype=torch.float32) + 10 * rank
output = torch.full((sum(output_splits),), -1.0)
work = dist.all_to_all_single(output, input, output_splits, input_splits, async_op=True)
work.wait()
print(f"Rank {rank}: async {output.tolist()}")
dist.destroy_process_group()
