/* Seed "P2P communication" (pytorch-distributed-training): a tensor goes to rank 1 and back.
 *
 *     def run(rank_id, size):
 *         tensor = torch.zeros(1)
 *         if rank_id == 0:
 *             tensor += 1
 *             dist.send(tensor=tensor, dst=1)
 *             dist.recv(tensor=tensor, src=1)
 *         else:
 *             dist.recv(tensor=tensor, src=0)
 *             tensor += 1
 *             dist.send(tensor=tensor, dst=0)
 *
 * The seed prints nothing; this prints each rank's tensor at the end, in
 * torch's format. Run it with two ranks (ranks past 1 take no part).
 */
#include <stdio.h>

#include "example.h"

int main(void)
{
    ps_comm_t *comm = example_init();
    int rank = ps_get_rank(comm, NULL);
    float tensor[1] = {0};
    char s[128];
    if (rank == 0) {
        tensor[0] += 1;
        example_check(ps_send(comm, tensor, 1, PS_FLOAT32, 1, 0, NULL), "send");
        example_check(ps_recv(comm, tensor, 1, PS_FLOAT32, 1, 0, NULL, NULL), "recv");
    } else if (rank == 1) {
        example_check(ps_recv(comm, tensor, 1, PS_FLOAT32, 0, 0, NULL, NULL), "recv");
        tensor[0] += 1;
        example_check(ps_send(comm, tensor, 1, PS_FLOAT32, 0, 0, NULL), "send");
    }
    if (rank <= 1)
        printf("Rank %d: %s\n", rank, example_tensor_str(s, sizeof(s), PS_FLOAT32, tensor, 1));
    example_finalize(comm);
    return 0;
}
