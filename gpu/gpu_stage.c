/* The stager: host buffers reduced on a device through pinned double buffers, copies overlapped. */
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "gpu_internal.h"

#define DEFAULT_CHUNK_BYTES ((size_t)4 << 20)
#define CHUNK_ALIGN         256 /* keeps every slot buffer 16-byte aligned: the vector path */

/*
 * Two slots, each with its own stream and, for every input j < cap, a pinned
 * buffer and a device buffer of chunk_bytes at offset (slot * cap + j) *
 * chunk_bytes. The result of a chunk is written over input 0 on the device
 * and comes back into input 0's pinned buffer. The buffers are allocated for
 * the inputs a call needs and grown when a later call needs more, so a
 * stager made for max_srcs = 64 that always sees 4 inputs holds 4 * 2 chunks.
 * The pinned ones only once a call has a pageable buffer to stage: a caller
 * whose buffers are all pinned never pays for them (a cudaHostAlloc of
 * tens of MiB takes milliseconds).
 */
struct ps_gpu_stager {
    int device;
    size_t max_srcs;
    size_t chunk_bytes;
    cudaStream_t streams[2];
    size_t cap;        /* inputs the device buffers have room for; 0 before first use */
    size_t pinned_cap; /* the same for the pinned buffers; 0 or cap */
    unsigned char *pinned;
    unsigned char *dev;
};

/* A chunk whose result is on its way back to the host in a slot. */
typedef struct pending {
    int active;
    size_t offset; /* bytes from the start of dst */
    size_t bytes;
} pending_t;

/* Frees the slot buffers (streams idle, stager's device current). Cannot fail. */
static void buffers_release(ps_gpu_stager_t *s)
{
    if (s->dev != NULL)
        (void)ps__gpu_result(cudaFree(s->dev));
    if (s->pinned != NULL)
        (void)ps__gpu_result(cudaFreeHost(s->pinned));
    s->dev = NULL;
    s->pinned = NULL;
    s->cap = s->pinned_cap = 0;
}

/*
 * Makes room for nsrc inputs per slot on the device and, with staging, in
 * pinned memory (the streams are idle between calls). Returns 0, or
 * PS_ENOMEM (or another mapped error) with no buffers left.
 */
static int buffers_reserve(ps_gpu_stager_t *s, size_t nsrc, int staging)
{
    if (nsrc <= s->cap && (!staging || s->pinned_cap == s->cap))
        return 0;
    size_t cap = nsrc > s->cap ? nsrc : s->cap;
    staging = staging || s->pinned_cap != 0;
    buffers_release(s);
    size_t total = 2 * cap * s->chunk_bytes; /* no overflow: create bounded max_srcs */
    void *pinned = NULL, *dev = NULL;
    int err = staging ? ps__gpu_result(cudaHostAlloc(&pinned, total, cudaHostAllocPortable)) : 0;
    if (err != 0)
        return err;
    err = ps__gpu_result(cudaMalloc(&dev, total));
    if (err != 0) {
        if (pinned != NULL)
            (void)ps__gpu_result(cudaFreeHost(pinned));
        return err;
    }
    s->pinned = pinned;
    s->dev = dev;
    s->cap = cap;
    s->pinned_cap = staging ? cap : 0;
    return 0;
}

/* Frees everything, on the stager's device (already current). Cannot fail. */
static void stager_release(ps_gpu_stager_t *s)
{
    for (int b = 0; b < 2; b++)
        if (s->streams[b] != NULL) {
            (void)ps__gpu_result(cudaStreamSynchronize(s->streams[b]));
            (void)ps__gpu_result(cudaStreamDestroy(s->streams[b]));
        }
    buffers_release(s);
    free(s);
}

int ps_gpu_stager_create(ps_gpu_stager_t **out, int device, size_t max_srcs, size_t chunk_bytes)
{
    if (out == NULL || device < 0 || max_srcs == 0 || max_srcs > PS_GPU_MAX_SRCS)
        return PS_EINVAL;
    if (chunk_bytes == 0)
        chunk_bytes = DEFAULT_CHUNK_BYTES;
    chunk_bytes -= chunk_bytes % CHUNK_ALIGN;
    if (chunk_bytes == 0)
        chunk_bytes = CHUNK_ALIGN;
    if (chunk_bytes > SIZE_MAX / 2 / max_srcs)
        return PS_EINVAL;

    int prev;
    int err = ps__gpu_result(cudaGetDevice(&prev));
    if (err != 0)
        return err;
    ps_gpu_stager_t *s = calloc(1, sizeof *s);
    if (s == NULL)
        return PS_ENOMEM;
    s->device = device;
    s->max_srcs = max_srcs;
    s->chunk_bytes = chunk_bytes;
    err = ps__gpu_result(cudaSetDevice(device));
    if (err != 0)
        goto fail;
    for (int b = 0; b < 2; b++) {
        cudaStream_t stream;
        err = ps__gpu_result(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        if (err != 0)
            goto fail;
        s->streams[b] = stream;
    }
    (void)ps__gpu_result(cudaSetDevice(prev));
    *out = s;
    return 0;

fail:
    stager_release(s);
    (void)ps__gpu_result(cudaSetDevice(prev));
    return err;
}

void ps_gpu_stager_destroy(ps_gpu_stager_t *stager)
{
    if (stager == NULL)
        return;
    int prev;
    int have_prev = ps__gpu_result(cudaGetDevice(&prev)) == 0;
    (void)ps__gpu_result(cudaSetDevice(stager->device));
    stager_release(stager);
    if (have_prev)
        (void)ps__gpu_result(cudaSetDevice(prev));
}

/*
 * What the DMA engine can do with host buffer p: 1 when p is pinned (copy
 * straight from or into it), 0 when it is pageable or managed (stage it
 * through the slot's pinned buffer). Sets *is_device when p is device memory,
 * which a host buffer must not be.
 */
static int is_pinned(const void *p, int *is_device)
{
    struct cudaPointerAttributes attr;
    if (ps__gpu_result(cudaPointerGetAttributes(&attr, p)) != 0)
        return 0;
    if (attr.type == cudaMemoryTypeDevice)
        *is_device = 1;
    return attr.type == cudaMemoryTypeHost;
}

/* Where a call's result goes: ndst buffers, direct[i] when dsts[i] is pinned
 * (the DMA writes it), `staged` when any is not (one copy comes back into
 * the slot's pinned buffer, and the CPU copies it into each such dst). */
typedef struct dst_set {
    void *const *dsts;
    size_t ndst;
    int direct[PS_GPU_MAX_SRCS];
    int staged;
} dst_set_t;

/*
 * Waits for slot b's chunk and copies its result from the slot's pinned
 * buffer into every dst that the DMA did not write itself.
 * Returns 0 or the chunk's error.
 */
static int slot_drain(ps_gpu_stager_t *s, int b, const dst_set_t *d, pending_t *p)
{
    if (!p->active)
        return 0;
    p->active = 0;
    int err = ps__gpu_result(cudaStreamSynchronize(s->streams[b]));
    for (size_t i = 0; err == 0 && i < d->ndst; i++)
        if (!d->direct[i])
            memcpy((unsigned char *)d->dsts[i] + p->offset,
                   s->pinned + (size_t)b * s->cap * s->chunk_bytes, p->bytes);
    return err;
}

/* Enqueues the copies of slot b's result (dev_out, nbytes) home: one DMA
 * into each pinned dst at offset, one into the slot's pinned buffer when a
 * dst is pageable. 0 or a mapped CUDA error. */
static int result_home(ps_gpu_stager_t *s, int b, const dst_set_t *d, const void *dev_out,
                       size_t offset, size_t nbytes)
{
    int err = 0;
    for (size_t i = 0; err == 0 && i < d->ndst; i++)
        if (d->direct[i])
            err = ps__gpu_result(cudaMemcpyAsync((unsigned char *)d->dsts[i] + offset, dev_out,
                                                 nbytes, cudaMemcpyDeviceToHost, s->streams[b]));
    if (err == 0 && d->staged)
        err =
            ps__gpu_result(cudaMemcpyAsync(s->pinned + (size_t)b * s->cap * s->chunk_bytes, dev_out,
                                           nbytes, cudaMemcpyDeviceToHost, s->streams[b]));
    return err;
}

/* ps_gpu_reduce_host and ps_gpu_reduce_host_dsts, arguments checked, count > 0. */
static int reduce_host(ps_gpu_stager_t *s, ps_op_t op, ps_dtype_t dtype, dst_set_t *d,
                       const void *const *srcs, size_t nsrc, size_t count)
{
    int prev;
    int err = ps__gpu_result(cudaGetDevice(&prev));
    if (err != 0)
        return err;
    err = ps__gpu_result(cudaSetDevice(s->device));
    if (err != 0)
        return err;

    int direct[PS_GPU_MAX_SRCS];
    int device_memory = 0;
    d->staged = 0;
    for (size_t i = 0; i < d->ndst; i++) {
        d->direct[i] = is_pinned(d->dsts[i], &device_memory);
        d->staged |= !d->direct[i];
    }
    int staging = d->staged;
    for (size_t j = 0; j < nsrc; j++) {
        direct[j] = is_pinned(srcs[j], &device_memory);
        staging |= !direct[j];
    }
    if (device_memory) {
        /* The host memcpy of staging would fault on it: device buffers go to ps_gpu_reduce. */
        (void)ps__gpu_result(cudaSetDevice(prev));
        return PS_EINVAL;
    }
    err = buffers_reserve(s, nsrc, staging);
    if (err != 0) {
        (void)ps__gpu_result(cudaSetDevice(prev));
        return err;
    }

    size_t size = ps_dtype_size(dtype);
    size_t chunk_elems = s->chunk_bytes / size;
    uint64_t divisor = op == PS_AVG ? (uint64_t)nsrc : 1;
    pending_t pend[2] = {{0, 0, 0}, {0, 0, 0}};

    for (size_t first = 0, k = 0; first < count && err == 0; first += chunk_elems, k++) {
        int b = (int)(k & 1);
        /* Slot b last held chunk k - 2: its buffers are free once its result is home. */
        err = slot_drain(s, b, d, &pend[b]);
        if (err != 0)
            break;
        size_t n = count - first < chunk_elems ? count - first : chunk_elems;
        size_t offset = first * size, nbytes = n * size;
        const void *dev_srcs[PS_GPU_MAX_SRCS];
        for (size_t j = 0; j < nsrc && err == 0; j++) {
            size_t slot_off = ((size_t)b * s->cap + j) * s->chunk_bytes;
            const unsigned char *from = (const unsigned char *)srcs[j] + offset;
            if (!direct[j]) {
                memcpy(s->pinned + slot_off, from, nbytes);
                from = s->pinned + slot_off;
            }
            dev_srcs[j] = s->dev + slot_off;
            err = ps__gpu_result(cudaMemcpyAsync(s->dev + slot_off, from, nbytes,
                                                 cudaMemcpyHostToDevice, s->streams[b]));
        }
        if (err != 0)
            break;
        unsigned char *dev_out = s->dev + (size_t)b * s->cap * s->chunk_bytes;
        err = ps__gpu_enqueue(op, dtype, dev_out, dev_srcs, nsrc, n, divisor, s->streams[b]);
        if (err != 0)
            break;
        err = result_home(s, b, d, dev_out, offset, nbytes);
        pend[b].active = err == 0;
        pend[b].offset = offset;
        pend[b].bytes = nbytes;
    }
    /* The last two chunks; after an error, only wait, so that no copy outlives the call. */
    for (int b = 0; b < 2; b++) {
        int drained = err == 0 ? slot_drain(s, b, d, &pend[b])
                               : ps__gpu_result(cudaStreamSynchronize(s->streams[b]));
        if (err == 0)
            err = drained;
    }
    (void)ps__gpu_result(cudaSetDevice(prev));
    return err;
}

int ps_gpu_reduce_host(ps_gpu_stager_t *stager, ps_op_t op, ps_dtype_t dtype, void *dst,
                       const void *const *srcs, size_t nsrc, size_t count)
{
    if (stager == NULL)
        return PS_EINVAL;
    size_t bytes;
    int err =
        ps__gpu_check_reduce(op, dtype, dst, srcs, nsrc, stager->max_srcs, count, 1, 0, &bytes);
    if (err != 0 || count == 0)
        return err;
    dst_set_t d = {.dsts = &dst, .ndst = 1};
    return reduce_host(stager, op, dtype, &d, srcs, nsrc, count);
}

int ps_gpu_reduce_host_dsts(ps_gpu_stager_t *stager, ps_op_t op, ps_dtype_t dtype,
                            void *const *dsts, size_t ndst, const void *const *srcs, size_t nsrc,
                            size_t count)
{
    if (stager == NULL)
        return PS_EINVAL;
    size_t bytes = 0;
    int err = dsts == NULL || ndst == 0 || ndst > PS_GPU_MAX_SRCS ? PS_EINVAL : 0;
    for (size_t i = 0; err == 0 && i < ndst; i++)
        err = ps__gpu_check_reduce(op, dtype, dsts[i], srcs, nsrc, stager->max_srcs, count, 1, 1,
                                   &bytes);
    if (err == 0)
        err = ps__gpu_check_dsts(dsts, ndst, bytes);
    if (err != 0 || count == 0)
        return err;
    dst_set_t d = {.dsts = dsts, .ndst = ndst};
    return reduce_host(stager, op, dtype, &d, srcs, nsrc, count);
}
