/* The reduce launches of paramsync_gpu: grid sizing, argument checks, the ps_gpu_reduce family. */
#include <string.h>

#include <cuda_runtime_api.h>

#include "gpu_internal.h"

/*
 * Grid size for a launch of work items: enough blocks to fill every SM of
 * the current device to its thread limit, fewer when there is less work; the
 * grid-stride loop covers the rest. Sets *blocks; returns 0 or a PS_E* code.
 */
static int grid_blocks(size_t work, unsigned *blocks)
{
    int dev, sms, threads_per_sm;
    int err = ps__gpu_result(cudaGetDevice(&dev));
    if (err == 0)
        err = ps__gpu_result(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    if (err == 0)
        err = ps__gpu_result(
            cudaDeviceGetAttribute(&threads_per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, dev));
    if (err != 0)
        return err;
    size_t per_sm =
        threads_per_sm >= PS__GPU_THREADS ? (size_t)threads_per_sm / PS__GPU_THREADS : 1;
    size_t most = (size_t)(sms > 0 ? sms : 1) * per_sm;
    size_t need = (work + PS__GPU_THREADS - 1) / PS__GPU_THREADS;
    *blocks = (unsigned)(need < most ? (need > 0 ? need : 1) : most);
    return 0;
}

/* Picks the vector width and grid for checked args (count > 0) and enqueues the kernel. */
static int enqueue(ps_op_t op, ps_dtype_t dtype, ps__gpu_args_t *args, ps_gpu_stream_t stream)
{
    uintptr_t bits = (uintptr_t)args->dst;
    for (int j = 0; j < args->nsrc; j++)
        bits |= (uintptr_t)args->srcs[j];
    args->vec = bits % 16 == 0;
    size_t per_item = args->vec ? 16 / ps_dtype_size(dtype) : 1;
    /* Vector items, plus the tail elements that the same threads then take one by one. */
    size_t work = args->count / per_item + args->count % per_item;
    unsigned blocks;
    int err = grid_blocks(work, &blocks);
    if (err != 0)
        return err;
    return ps__gpu_result(ps__gpu_launch(op, dtype, args, blocks, stream));
}

int ps__gpu_enqueue(ps_op_t op, ps_dtype_t dtype, void *dst, const void *const *srcs, size_t nsrc,
                    size_t count, uint64_t divisor, ps_gpu_stream_t stream)
{
    ps__gpu_args_t args;
    memset(&args, 0, sizeof args);
    args.dst = dst;
    for (size_t j = 0; j < nsrc; j++)
        args.srcs[j] = srcs[j];
    args.nsrc = (int)nsrc;
    args.count = count;
    args.divisor = divisor;
    return enqueue(op, dtype, &args, stream);
}

int ps_gpu_reduce(ps_op_t op, ps_dtype_t dtype, void *dst, const void *src, size_t count,
                  ps_gpu_stream_t stream)
{
    const void *srcs[2] = {dst, src};
    size_t bytes;
    int err =
        ps__gpu_check_reduce(op, dtype, dst, srcs, 2, 2, count, ps_dtype_size(dtype), 1, &bytes);
    if (err != 0 || count == 0)
        return err;
    /* As ps_reduce: a two-input AVG is a plain sum, divided by whoever knows the final count. */
    return ps__gpu_enqueue(op == PS_AVG ? PS_SUM : op, dtype, dst, srcs, 2, count, 1, stream);
}

int ps_gpu_reduce_multi(ps_op_t op, ps_dtype_t dtype, void *dst, const void *const *srcs,
                        size_t nsrc, size_t count, ps_gpu_stream_t stream)
{
    size_t bytes;
    int err = ps__gpu_check_reduce(op, dtype, dst, srcs, nsrc, PS_GPU_MAX_SRCS, count,
                                   ps_dtype_size(dtype), 1, &bytes);
    if (err != 0 || count == 0)
        return err;
    return ps__gpu_enqueue(op, dtype, dst, srcs, nsrc, count, nsrc, stream);
}

int ps_gpu_scale(ps_dtype_t dtype, void *buf, size_t count, uint64_t divisor,
                 ps_gpu_stream_t stream)
{
    const void *srcs[1] = {buf};
    size_t bytes;
    if (divisor == 0)
        return PS_EINVAL;
    /* The AVG kernel with one input is exactly "divide and round", as in ps_reduce_scale. */
    int err = ps__gpu_check_reduce(PS_AVG, dtype, buf, srcs, 1, 1, count, ps_dtype_size(dtype), 0,
                                   &bytes);
    if (err != 0 || count == 0)
        return err;
    return ps__gpu_enqueue(PS_AVG, dtype, buf, srcs, 1, count, divisor, stream);
}
