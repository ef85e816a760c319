/* Seed "broadcast": rank 0's tensor reaches every rank.
 *
 *     tensor = torch.tensor([0])
 *     if dist.get_rank() == 0:
 *         tensor += 1
 *     dist.broadcast(tensor, src=0)
 *     print(f"Rank {dist.get_rank()}: {tensor}")
 */
#include <stdint.h>
#include <stdio.h>

#include "example.h"

int main(void)
{
    ps_comm_t *comm = example_init();
    int rank = ps_get_rank(comm, NULL);
    int64_t tensor[1] = {0};
    char s[128];
    if (rank == 0)
        tensor[0] += 1;
    example_check(ps_broadcast(comm, tensor, 1, PS_INT64, 0, NULL), "broadcast");
    printf("Rank %d: %s\n", rank, example_tensor_str(s, sizeof(s), PS_INT64, tensor, 1));
    example_finalize(comm);
    return 0;
}
