/* Seed "gather": every rank's tensor lands on rank 0, in rank order.
 *
 *     tensor = torch.tensor([dist.get_rank()])
 *     if dist.get_rank() == 0:
 *         gather_list = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
 *     else:
 *         gather_list = None
 *     dist.gather(tensor, gather_list, dst=0)
 *     if dist.get_rank() == 0:
 *         print(f"Gathered result: {gather_list}")
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "example.h"

int main(void)
{
    ps_comm_t *comm = example_init();
    int rank = ps_get_rank(comm, NULL), size = ps_get_world_size(comm, NULL);
    int64_t tensor[1] = {rank};
    int64_t *gather_list = NULL;
    if (rank == 0 && !(gather_list = calloc((size_t)size, sizeof(*gather_list))))
        example_check(PS_ENOMEM, "calloc");
    example_check(ps_gather(comm, gather_list, tensor, 1, PS_INT64, 0, NULL), "gather");
    if (rank == 0)
        example_print_list("Gathered result: ", PS_INT64, gather_list, (size_t)size, 1);
    free(gather_list);
    example_finalize(comm);
    return 0;
}
