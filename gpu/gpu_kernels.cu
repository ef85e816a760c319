/* The CUDA reduce kernels of every (op, dtype) pair, generated from one table, and their launcher.
 */
#include <cuda_runtime.h>

#include "gpu_kernels.cuh"

namespace
{

/*
 * __grid_constant__ lets ps__gpu_reduce_range take the parameter by
 * reference without a copy of its 560 bytes into local memory; the input
 * pointers are read from the parameter space.
 */
template <class Op>
__global__ void __launch_bounds__(PS__GPU_THREADS)
    reduce_kernel(const __grid_constant__ ps__gpu_args_t args)
{
    size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t nthreads = (size_t)gridDim.x * blockDim.x;
    ps__gpu_reduce_range<Op>(args, tid, nthreads);
}

/* The kernel of a valid (op, dtype) pair; NULL for an invalid one. Cannot fail. */
const void *kernel_for(ps_op_t want_op, ps_dtype_t want_dtype)
{
#define PS__GPU_PICK(opname, step, fin, dtype, d, T, c, A)                                         \
    if (want_op == PS__OP_##opname && want_dtype == dtype)                                         \
        return reinterpret_cast<const void *>(&reduce_kernel<ps__gpu_op_##opname##_##d>);
    PS_FOR_EACH_KERNEL(PS__GPU_PICK)
#undef PS__GPU_PICK
    return NULL;
}

} // namespace

extern "C" int ps__gpu_launch(ps_op_t op, ps_dtype_t dtype, const ps__gpu_args_t *args,
                              unsigned blocks, void *stream)
{
    const void *fn = kernel_for(op, dtype);
    if (fn == NULL)
        return (int)cudaErrorInvalidValue;
    void *params[1] = {const_cast<ps__gpu_args_t *>(args)};
    return (int)cudaLaunchKernel(fn, dim3(blocks), dim3(PS__GPU_THREADS), params, 0,
                                 static_cast<cudaStream_t>(stream));
}
