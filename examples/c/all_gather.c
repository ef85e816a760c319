/* Seed "all_gather": every rank gets every rank's tensor, in rank order.
 *
 *     tensor = torch.tensor([dist.get_rank()])
 *     gather_list = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
 *     dist.all_gather(gather_list, tensor)
 *     print(f"Rank {dist.get_rank()}: {gather_list}")
 *
 * torch's list of tensors is one buffer of world_size blocks here.
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
    int64_t *gather_list = calloc((size_t)size, sizeof(*gather_list));
    char prefix[32];
    if (!gather_list)
        example_check(PS_ENOMEM, "calloc");
    example_check(ps_all_gather(comm, gather_list, tensor, 1, PS_INT64, NULL), "all_gather");
    snprintf(prefix, sizeof(prefix), "Rank %d: ", rank);
    example_print_list(prefix, PS_INT64, gather_list, (size_t)size, 1);
    free(gather_list);
    example_finalize(comm);
    return 0;
}
