/* Seed "barrier": no rank passes before every rank has reached it.
 *
 *     print(f"Rank {dist.get_rank()} reached barrier.")
 *     dist.barrier()
 *     print(f"Rank {dist.get_rank()} passed barrier.")
 */
#include <stdio.h>

#include "example.h"

int main(void)
{
    ps_comm_t *comm = example_init();
    int rank = ps_get_rank(comm, NULL);
    printf("Rank %d reached barrier.\n", rank);
    fflush(stdout);
    example_check(ps_barrier(comm, NULL), "barrier");
    printf("Rank %d passed barrier.\n", rank);
    example_finalize(comm);
    return 0;
}
