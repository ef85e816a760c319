/* Not a seed: torch's all_to_all_single with split sizes, MPI's Alltoallv.
 * Rank r sends r + j + 1 elements to rank j, each naming the sender, the
 * receiver and its place.
 *
 *     input_splits = [rank + j + 1 for j in range(world)]
 *     output_splits = [j + rank + 1 for j in range(world)]
 *     input = torch.tensor([100 * rank + 10 * j + k
 *                           for j in range(world) for k in range(input_splits[j])])
 *     output = torch.zeros(sum(output_splits), dtype=torch.int64)
 *     dist.all_to_all_single(output, input, output_splits, input_splits)
 *     print(f"Rank {rank}: {output}")
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "example.h"

int main(void)
{
    ps_comm_t *comm = example_init();
    int rank = ps_get_rank(comm, NULL), size = ps_get_world_size(comm, NULL);
    size_t *in_counts = calloc((size_t)size, sizeof(size_t));
    size_t *out_counts = calloc((size_t)size, sizeof(size_t));
    size_t in_all = 0, out_all = 0;
    if (!in_counts || !out_counts)
        example_check(PS_ENOMEM, "calloc");
    for (int j = 0; j < size; j++) {
        in_all += in_counts[j] = (size_t)(rank + j + 1);
        out_all += out_counts[j] = (size_t)(j + rank + 1);
    }
    int64_t *input = calloc(in_all, sizeof(*input)), *output = calloc(out_all, sizeof(*output));
    if (!input || !output)
        example_check(PS_ENOMEM, "calloc");
    size_t at = 0;
    for (int j = 0; j < size; j++)
        for (size_t k = 0; k < in_counts[j]; k++)
            input[at++] = 100 * rank + 10 * j + (int64_t)k;
    example_check(ps_all_to_all_v(comm, output, out_counts, input, in_counts, PS_INT64, NULL),
                  "all_to_all_v");
    char s[1024];
    printf("Rank %d: %s\n", rank, example_tensor_str(s, sizeof(s), PS_INT64, output, out_all));
    free(input);
    free(output);
    free(in_counts);
    free(out_counts);
    example_finalize(comm);
    return 0;
}
