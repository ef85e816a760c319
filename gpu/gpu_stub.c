/* paramsync_gpu without CUDA: the API of paramsync/gpu.h, checking arguments, then PS_EUNAVAIL. */
#include "gpu_internal.h"

/*
 * Built when CMake has no CUDA compiler (or -DPARAMSYNC_CUDA=OFF), so that
 * callers link one library and choose the device at run time. Arguments get
 * the same checks as in the CUDA build: a caller's bug reads PS_EINVAL in both
 * builds. A call with nothing to do (count == 0) succeeds, as it does there.
 */

int ps_gpu_device_count(int *count)
{
    return count == NULL ? PS_EINVAL : PS_EUNAVAIL;
}

int ps_gpu_set_device(int device)
{
    return device < 0 ? PS_EINVAL : PS_EUNAVAIL;
}

int ps_gpu_get_device(int *device)
{
    return device == NULL ? PS_EINVAL : PS_EUNAVAIL;
}

int ps_gpu_reduce(ps_op_t op, ps_dtype_t dtype, void *dst, const void *src, size_t count,
                  ps_gpu_stream_t stream)
{
    const void *srcs[2] = {dst, src};
    size_t bytes;
    (void)stream;
    int err =
        ps__gpu_check_reduce(op, dtype, dst, srcs, 2, 2, count, ps_dtype_size(dtype), 1, &bytes);
    return err != 0 || count == 0 ? err : PS_EUNAVAIL;
}

int ps_gpu_reduce_multi(ps_op_t op, ps_dtype_t dtype, void *dst, const void *const *srcs,
                        size_t nsrc, size_t count, ps_gpu_stream_t stream)
{
    size_t bytes;
    (void)stream;
    int err = ps__gpu_check_reduce(op, dtype, dst, srcs, nsrc, PS_GPU_MAX_SRCS, count,
                                   ps_dtype_size(dtype), 1, &bytes);
    return err != 0 || count == 0 ? err : PS_EUNAVAIL;
}

int ps_gpu_scale(ps_dtype_t dtype, void *buf, size_t count, uint64_t divisor,
                 ps_gpu_stream_t stream)
{
    const void *srcs[1] = {buf};
    size_t bytes;
    (void)stream;
    if (divisor == 0)
        return PS_EINVAL;
    int err = ps__gpu_check_reduce(PS_AVG, dtype, buf, srcs, 1, 1, count, ps_dtype_size(dtype), 0,
                                   &bytes);
    return err != 0 || count == 0 ? err : PS_EUNAVAIL;
}

int ps_gpu_is_device_pointer(const void *ptr, int *is_device)
{
    (void)ptr;
    if (is_device == NULL)
        return PS_EINVAL;
    /* Without CUDA no device memory can exist in this process. */
    *is_device = 0;
    return 0;
}

int ps_gpu_host_alloc(void **out, size_t bytes)
{
    return out == NULL || bytes == 0 ? PS_EINVAL : PS_EUNAVAIL;
}

void ps_gpu_host_free(void *ptr)
{
    (void)ptr;
}

int ps_gpu_host_register(void *ptr, size_t bytes)
{
    return ptr == NULL || bytes == 0 ? PS_EINVAL : PS_EUNAVAIL;
}

int ps_gpu_host_unregister(void *ptr)
{
    return ptr == NULL ? 0 : PS_EUNAVAIL;
}

int ps_gpu_malloc(void **out, size_t bytes)
{
    return out == NULL || bytes == 0 ? PS_EINVAL : PS_EUNAVAIL;
}

void ps_gpu_free(void *ptr)
{
    (void)ptr;
}

int ps_gpu_memcpy_async(void *dst, const void *src, size_t bytes, ps_gpu_stream_t stream)
{
    (void)stream;
    if (bytes == 0)
        return 0;
    return dst == NULL || src == NULL ? PS_EINVAL : PS_EUNAVAIL;
}

int ps_gpu_stream_create(ps_gpu_stream_t *out)
{
    return out == NULL ? PS_EINVAL : PS_EUNAVAIL;
}

void ps_gpu_stream_destroy(ps_gpu_stream_t stream)
{
    (void)stream;
}

int ps_gpu_stream_synchronize(ps_gpu_stream_t stream)
{
    (void)stream;
    return PS_EUNAVAIL;
}

int ps_gpu_fence(void)
{
    return PS_EUNAVAIL;
}

int ps_gpu_ipc_export(const void *ptr, ps_gpu_ipc_t *out)
{
    if (ptr == NULL || out == NULL)
        return PS_EINVAL;
    return PS_EUNAVAIL;
}

int ps_gpu_ipc_open(const ps_gpu_ipc_t *ipc, void **base)
{
    if (ipc == NULL || base == NULL)
        return PS_EINVAL;
    return PS_EUNAVAIL;
}

int ps_gpu_ipc_close(void *base)
{
    return base == NULL ? 0 : PS_EUNAVAIL;
}

int ps_gpu_stager_create(ps_gpu_stager_t **out, int device, size_t max_srcs, size_t chunk_bytes)
{
    (void)chunk_bytes;
    if (out == NULL || device < 0 || max_srcs == 0 || max_srcs > PS_GPU_MAX_SRCS)
        return PS_EINVAL;
    return PS_EUNAVAIL;
}

void ps_gpu_stager_destroy(ps_gpu_stager_t *stager)
{
    (void)stager;
}

int ps_gpu_reduce_host(ps_gpu_stager_t *stager, ps_op_t op, ps_dtype_t dtype, void *dst,
                       const void *const *srcs, size_t nsrc, size_t count)
{
    /* No stager can exist without CUDA, so every call has a bad handle. */
    (void)stager, (void)op, (void)dtype, (void)dst, (void)srcs, (void)nsrc, (void)count;
    return PS_EINVAL;
}

int ps_gpu_reduce_host_dsts(ps_gpu_stager_t *stager, ps_op_t op, ps_dtype_t dtype,
                            void *const *dsts, size_t ndst, const void *const *srcs, size_t nsrc,
                            size_t count)
{
    (void)stager, (void)op, (void)dtype, (void)dsts, (void)ndst, (void)srcs, (void)nsrc;
    (void)count;
    return PS_EINVAL;
}
