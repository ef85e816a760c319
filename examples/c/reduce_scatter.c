/* Seed "reduce_scatter": block i of every rank's input is summed onto rank i.
 *
 *     input = [torch.tensor([dist.get_rank() + 1]) for _ in range(dist.get_world_size())]
 *     output = torch.empty(1)
 *     dist.reduce_scatter(output, input, op=dist.ReduceOp.SUM)
 *     print(f"Rank {dist.get_rank()}: {output}")
 *
 * One dtype travels per collective, so the input is float32 like the
 * output torch.empty(1); the output is what torch prints.
 */
#include <stdio.h>
#include <stdlib.h>

#include "example.h"

int main(void)
{
    ps_comm_t *comm = example_init();
    int rank = ps_get_rank(comm, NULL), size = ps_get_world_size(comm, NULL);
    float *input = calloc((size_t)size, sizeof(*input));
    float output[1];
    char s[128];
    if (!input)
        example_check(PS_ENOMEM, "calloc");
    for (int i = 0; i < size; i++)
        input[i] = (float)(rank + 1);
    example_check(ps_reduce_scatter(comm, output, input, 1, PS_FLOAT32, PS_SUM, NULL),
                  "reduce_scatter");
    printf("Rank %d: %s\n", rank, example_tensor_str(s, sizeof(s), PS_FLOAT32, output, 1));
    free(input);
    example_finalize(comm);
    return 0;
}
