/* Seed "send"/"recv": rank 0 sends [1, 2, 3] to rank 1, which prints what it received.
 *
 *     tensor = torch.tensor([1, 2, 3])
 *     if dist.get_rank() == 0:
 *         dist.send(tensor=tensor, dst=1)
 *     elif dist.get_rank() == 1:
 *         recv_tensor = torch.empty(3)
 *         dist.recv(tensor=recv_tensor, src=0)
 *         print(recv_tensor)
 *
 * Both ends of a paramsync transfer use one dtype, so the sent tensor is
 * float32 like the receiving torch.empty(3); the output is what torch prints.
 */
#include <stdio.h>

#include "example.h"

int main(void)
{
    ps_comm_t *comm = example_init();
    float tensor[3] = {1, 2, 3};
    char s[128];
    if (ps_get_rank(comm, NULL) == 0) {
        example_check(ps_send(comm, tensor, 3, PS_FLOAT32, 1, 0, NULL), "send");
    } else if (ps_get_rank(comm, NULL) == 1) {
        float recv_tensor[3];
        example_check(ps_recv(comm, recv_tensor, 3, PS_FLOAT32, 0, 0, NULL, NULL), "recv");
        printf("%s\n", example_tensor_str(s, sizeof(s), PS_FLOAT32, recv_tensor, 3));
    }
    example_finalize(comm);
    return 0;
}
