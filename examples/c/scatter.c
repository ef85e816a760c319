/* Seed "scatter": rank 0 sends scatter_list[i] to rank i.
 *
 *     if dist.get_rank() == 0:
 *         scatter_list = [torch.tensor([i]) for i in range(dist.get_world_size())]
 *     else:
 *         scatter_list = None
 *     tensor = torch.empty(1)
 *     dist.scatter(tensor, scatter_list, src=0)
 *     print(f"Rank {dist.get_rank()}: {tensor}")
 *
 * One dtype travels per collective, so scatter_list is float32 like the
 * receiving torch.empty(1); the output is what torch prints.
 */
#include <stdio.h>
#include <stdlib.h>

#include "example.h"

int main(void)
{
    ps_comm_t *comm = example_init();
    int rank = ps_get_rank(comm, NULL), size = ps_get_world_size(comm, NULL);
    float *scatter_list = NULL;
    float tensor[1];
    char s[128];
    if (rank == 0) {
        if (!(scatter_list = calloc((size_t)size, sizeof(*scatter_list))))
            example_check(PS_ENOMEM, "calloc");
        for (int i = 0; i < size; i++)
            scatter_list[i] = (float)i;
    }
    example_check(ps_scatter(comm, tensor, scatter_list, 1, PS_FLOAT32, 0, NULL), "scatter");
    printf("Rank %d: %s\n", rank, example_tensor_str(s, sizeof(s), PS_FLOAT32, tensor, 1));
    free(scatter_list);
    example_finalize(comm);
    return 0;
}
