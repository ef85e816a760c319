/* Seed "new_group" (torch-distributed-api): two groups of a world of four reduce apart.
 *
 *     # world size 4: two groups, [0, 1] and [2, 3]
 *     group1 = dist.new_group([0, 1])
 *     group2 = dist.new_group([2, 3])
 *     if dist.get_rank() in [0, 1]:
 *         dist.all_reduce(tensor, group=group1)
 *
 * The seed leaves `tensor` undefined and only reduces in group1; here it is
 * torch.tensor([rank + 1]), group2 reduces too, and each rank prints its
 * result: 1 + 2 in group1, 3 + 4 in group2. Run it with four ranks.
 */
#include <stdint.h>
#include <stdio.h>

#include "example.h"

int main(void)
{
    ps_comm_t *comm = example_init();
    int rank = ps_get_rank(comm, NULL);
    const int ranks1[] = {0, 1}, ranks2[] = {2, 3};
    ps_group_t *group1, *group2;
    int64_t tensor[1] = {rank + 1};
    char s[128];
    /* Every rank creates every group, members or not, as in torch. */
    example_check(ps_new_group(comm, ranks1, 2, &group1), "new_group");
    example_check(ps_new_group(comm, ranks2, 2, &group2), "new_group");
    if (rank == 0 || rank == 1)
        example_check(ps_all_reduce(comm, tensor, 1, PS_INT64, PS_SUM, group1), "all_reduce");
    else if (rank == 2 || rank == 3)
        example_check(ps_all_reduce(comm, tensor, 1, PS_INT64, PS_SUM, group2), "all_reduce");
    printf("Rank %d: %s\n", rank, example_tensor_str(s, sizeof(s), PS_INT64, tensor, 1));
    example_finalize(comm);
    return 0;
}
