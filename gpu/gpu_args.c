/* Argument checks of the gpu/ reduce functions, shared by the CUDA build and the stub. */
#include <stdint.h>

#include "gpu_internal.h"

/* Whether [p, p + bytes) is usable: non-NULL unless empty, no wrap, aligned to align bytes. */
static int range_ok(const void *p, size_t bytes, size_t align)
{
    if (bytes == 0)
        return 1;
    uintptr_t x = (uintptr_t)p;
    return p != NULL && x <= UINTPTR_MAX - bytes && x % align == 0;
}

/* Whether [a, a + bytes) and [b, b + bytes) share a byte; both ranges passed range_ok. */
static int ranges_overlap(const void *a, const void *b, size_t bytes)
{
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return bytes != 0 && x < y + bytes && y < x + bytes;
}

int ps__gpu_check_reduce(ps_op_t op, ps_dtype_t dtype, const void *dst, const void *const *srcs,
                         size_t nsrc, size_t max_srcs, size_t count, size_t align, int alias_any,
                         size_t *bytes)
{
    if (ps_op_check(op, dtype) != 0 || srcs == NULL || nsrc == 0 || nsrc > max_srcs)
        return PS_EINVAL;
    size_t size = ps_dtype_size(dtype);
    if (count > SIZE_MAX / size)
        return PS_EINVAL;
    size_t total = count * size;
    if (!range_ok(dst, total, align))
        return PS_EINVAL;
    for (size_t j = 0; j < nsrc; j++) {
        if (!range_ok(srcs[j], total, align))
            return PS_EINVAL;
        /* Exact aliasing is safe: each element is read from every input before it is written. */
        if (srcs[j] == dst && (j == 0 || alias_any))
            continue;
        if (ranges_overlap(dst, srcs[j], total))
            return PS_EINVAL;
    }
    *bytes = total;
    return 0;
}

int ps__gpu_check_dsts(void *const *dsts, size_t ndst, size_t bytes)
{
    if (dsts == NULL || ndst == 0 || ndst > PS_GPU_MAX_SRCS)
        return PS_EINVAL;
    for (size_t i = 0; i < ndst; i++)
        for (size_t k = 0; k < i; k++)
            if (ranges_overlap(dsts[i], dsts[k], bytes))
                return PS_EINVAL;
    return 0;
}
