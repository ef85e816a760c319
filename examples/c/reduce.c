/* Seed "reduce": the sum of every rank's tensor lands on rank 0.
 *
 *     tensor = torch.tensor([dist.get_rank() + 1])
 *     dist.reduce(tensor, dst=0, op=dist.ReduceOp.SUM)
 *     if dist.get_rank() == 0:
 *         print(f"Reduced result: {tensor}")
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
    example_check(ps_reduce_to(comm, tensor, 1, PS_INT64, PS_SUM, 0, NULL), "reduce");
    if (rank == 0)
        printf("Reduced result: %s\n", example_tensor_str(s, sizeof(s), PS_INT64, tensor, 1));
    example_finalize(comm);
    return 0;
}
