/* Seed "all_to_all": block j of rank i's input becomes block i of rank j's output.
 *
 *     input = torch.tensor([dist.get_rank()] * dist.get_world_size())
 *     output = torch.empty(dist.get_world_size(), dtype=torch.int)
 *     dist.all_to_all(output, input)
 *     print(f"Rank {dist.get_rank()}: {output}")
 *
 * One dtype travels per collective, so the input is int32 like the output;
 * the output is what torch prints.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "example.h"

int main(void)
{
    ps_comm_t *comm = example_init();
    int rank = ps_get_rank(comm, NULL), size = ps_get_world_size(comm, NULL);
    int32_t *input = calloc((size_t)size, sizeof(*input));
    int32_t *output = calloc((size_t)size, sizeof(*output));
    char s[256];
    if (!input || !output)
        example_check(PS_ENOMEM, "calloc");
    for (int i = 0; i < size; i++)
        input[i] = rank;
    example_check(ps_all_to_all(comm, output, input, 1, PS_INT32, NULL), "all_to_all");
    printf("Rank %d: %s\n", rank, example_tensor_str(s, sizeof(s), PS_INT32, output, (size_t)size));
    free(input);
    free(output);
    example_finalize(comm);
    return 0;
}
