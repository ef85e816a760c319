/* Seed "all_reduce": every rank gets the sum of every rank's tensor.
 *
 *     tensor = torch.tensor([dist.get_rank() + 1])
 *     dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
 *     print(f"Rank {dist.get_rank()}: {tensor}")
 */
#include <stdint.h>
#include <stdio.h>

#include "example.h"

int main(void)
{
    ps_comm_t *comm = example_init();
    int rank = ps_get_rank(comm, NULL);
    int64_t tensor[1] = {rank + 1};
    char s[128];
    example_check(ps_all_reduce(comm, tensor, 1, PS_INT64, PS_SUM, NULL), "all_reduce");
    printf("Rank %d: %s\n", rank, example_tensor_str(s, sizeof(s), PS_INT64, tensor, 1));
    example_finalize(comm);
    return 0;
}
