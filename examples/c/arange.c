/* Seed "collective communication" (pytorch-distributed-training): the arange examples.
 *
 *     tensor = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank_id
 *     dist.broadcast(tensor, src=0)                         # broadcast
 *     dist.scatter(tensor, src=0, scatter_list=[[0,0], [1,1], [2,2], [3,3]])  # scatter
 *     dist.gather(tensor, dst=0, gather_list=...)           # gather
 *     dist.reduce(tensor, dst=3, op=dist.ReduceOp.SUM)      # reduce
 *     dist.all_gather(gather_list, tensor)                  # all_gather
 *     dist.all_reduce(tensor, op=dist.ReduceOp.SUM)         # all_reduce
 *
 * Usage: arange broadcast|scatter|gather|reduce|all_gather|all_reduce.
 * The seed prints nothing and is written for 4 ranks; this prints what each
 * rank holds afterwards ("Rank 0: tensor([1, 2])"; the gather list on rank 0)
 * and takes dst=3 for reduce as the last rank when there are fewer. The
 * expected outputs in tests/integration/expected/ come from running these
 * snippets with torch and Gloo (tests/integration/expected/torch_reference.py).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "example.h"

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s broadcast|scatter|gather|reduce|all_gather|all_reduce\n",
                argv[0]);
        return 2;
    }
    const char *what = argv[1];
    ps_comm_t *comm = example_init();
    int rank = ps_get_rank(comm, NULL), size = ps_get_world_size(comm, NULL);
    int64_t tensor[2] = {1 + 2 * rank, 2 + 2 * rank};
    int64_t *list = calloc((size_t)size * 2, sizeof(*list));
    char s[128], prefix[32];
    int print_tensor = 1;
    if (!list)
        example_check(PS_ENOMEM, "calloc");
    snprintf(prefix, sizeof(prefix), "Rank %d: ", rank);

    if (strcmp(what, "broadcast") == 0) {
        example_check(ps_broadcast(comm, tensor, 2, PS_INT64, 0, NULL), what);
    } else if (strcmp(what, "scatter") == 0) {
        for (int i = 0; i < size; i++)
            list[2 * i] = list[2 * i + 1] = i;
        example_check(ps_scatter(comm, tensor, rank == 0 ? list : NULL, 2, PS_INT64, 0, NULL),
                      what);
    } else if (strcmp(what, "gather") == 0) {
        example_check(ps_gather(comm, rank == 0 ? list : NULL, tensor, 2, PS_INT64, 0, NULL), what);
        if (rank == 0)
            example_print_list(prefix, PS_INT64, list, (size_t)size, 2);
        print_tensor = 0;
    } else if (strcmp(what, "reduce") == 0) {
        int dst = size > 3 ? 3 : size - 1;
        example_check(ps_reduce_to(comm, tensor, 2, PS_INT64, PS_SUM, dst, NULL), what);
        /* torch leaves the other ranks' tensors unspecified ("might be
         * altered"; Gloo does alter them): only dst's result is printed. */
        print_tensor = rank == dst;
    } else if (strcmp(what, "all_gather") == 0) {
        example_check(ps_all_gather(comm, list, tensor, 2, PS_INT64, NULL), what);
        example_print_list(prefix, PS_INT64, list, (size_t)size, 2);
        print_tensor = 0;
    } else if (strcmp(what, "all_reduce") == 0) {
        example_check(ps_all_reduce(comm, tensor, 2, PS_INT64, PS_SUM, NULL), what);
    } else {
        fprintf(stderr, "unknown collective '%s'\n", what);
        return 2;
    }
    if (print_tensor)
        printf("%s%s\n", prefix, example_tensor_str(s, sizeof(s), PS_INT64, tensor, 2));
    free(list);
    example_finalize(comm);
    return 0;
}
