/* Helpers shared by the C examples: joining from the environment and printing tensors as torch
 * does. */
#ifndef PS_EXAMPLE_H
#define PS_EXAMPLE_H

#include <stddef.h>

#include <paramsync/paramsync.h>

/* Joins the job described by the environment (env://: PARAMSYNC_ADDR or
 * MASTER_ADDR/MASTER_PORT, WORLD_SIZE, RANK), like
 * dist.init_process_group(). Exits the process on failure. */
ps_comm_t *example_init(void);

/* Exits the process with a message when rc is an error. */
void example_check(int rc, const char *what);

/* Leaves the job; exits with a message on failure. */
void example_finalize(ps_comm_t *comm);

/* Writes count elements as torch prints a 1-D tensor ("tensor([1, 2])",
 * "tensor([ 1., 10.])", "tensor([0, 1], dtype=torch.int32)") into buf (NUL
 * terminated, truncated to cap). Supports the dtypes the examples use:
 * int64, int32, float32. Returns buf. */
char *example_tensor_str(char *buf, size_t cap, ps_dtype_t dtype, const void *data, size_t count);

/* Prints a Python list of n tensors of count elements each, laid out one after
 * another in data: "[tensor([0]), tensor([1])]". */
void example_print_list(const char *prefix, ps_dtype_t dtype, const void *data, size_t n,
                        size_t count);

#endif
