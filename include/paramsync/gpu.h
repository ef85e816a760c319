/* The CUDA reduction path: (op, dtype) kernels on device memory, device selection, pinned staging.
 */
#ifndef PARAMSYNC_GPU_H
#define PARAMSYNC_GPU_H

#include <paramsync/common.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Library: paramsync_gpu. Built from CUDA sources when CMake finds nvcc
 * (-DPARAMSYNC_CUDA=AUTO, the default, or ON); the target then carries the
 * compile definition PS_HAVE_CUDA=1. With -DPARAMSYNC_CUDA=OFF, or AUTO and
 * no nvcc, paramsync_gpu is a stub with the same functions: they check their
 * arguments exactly as below (PS_EINVAL) and then return PS_EUNAVAIL, so a
 * caller links unconditionally and decides at run time:
 *
 *     int n;
 *     use_cuda = ps_gpu_device_count(&n) == 0;   // --reduce-device=auto
 *
 * Errors. CUDA errors become PS_EUNAVAIL (no driver, no device, or no kernel
 * image for this device), PS_EINVAL (bad device, pointer, stream or value),
 * PS_ENOMEM (allocation) and PS_EINTERNAL (anything else, e.g. a kernel that
 * faulted). After a failed CUDA call the library reads the thread's last
 * CUDA error back (cudaGetLastError), so a PS_E* failure never leaves a stale
 * error for the caller's next cudaGetLastError(). Errors that poison the
 * CUDA context (an illegal address) cannot be cleared by anyone: every later
 * call then fails with PS_EINTERNAL until the process exits.
 *
 * Devices. Every function works on the calling thread's current CUDA device
 * (ps_gpu_set_device, or the caller's own cudaSetDevice), except the stager,
 * which remembers the device it was created for.
 *
 * Streams. ps_gpu_stream_t is a cudaStream_t: pass one straight in (or NULL
 * for the default stream). The reduce functions only enqueue work and return;
 * the result is in dst once the stream has reached that point
 * (ps_gpu_stream_synchronize, an event, or later work on the same stream).
 * Errors of the kernel itself appear at that synchronization.
 *
 * Recipes.
 *
 * A client holding a device tensor (send it, receive the result into it):
 *
 *     int is_dev;
 *     ps_gpu_is_device_pointer(tensor, &is_dev);
 *     if (is_dev) {
 *         void *pinned;                              // once, reused per call
 *         ps_gpu_host_alloc(&pinned, bytes);
 *         ps_gpu_memcpy_async(pinned, tensor, bytes, stream);  // D2H, DMA
 *         ps_gpu_stream_synchronize(stream);
 *         ... send pinned, receive the result into pinned ...
 *         ps_gpu_memcpy_async(tensor, pinned, bytes, stream);  // H2D
 *     }
 *
 * Reducing host chunks on the device with the copies overlapped: use the
 * stager below (ps_gpu_reduce_host), which does exactly this with two
 * streams and double buffers. By hand, per chunk k on stream k % 2:
 * ps_gpu_memcpy_async each pinned input to its device buffer, then
 * ps_gpu_reduce_multi, then ps_gpu_memcpy_async the result back to pinned
 * memory; before reusing slot k % 2 for chunk k + 2, synchronize its stream.
 */
typedef void *ps_gpu_stream_t;

/* The most inputs one ps_gpu_reduce_multi call takes: their pointers travel as kernel parameters.
 */
#define PS_GPU_MAX_SRCS 64

/**
 * Counts the CUDA devices this process can use. On success sets *count
 * (>= 1) and returns 0. Returns PS_EUNAVAIL when there is no driver or no
 * device (and always in the stub), PS_EINVAL when count is NULL.
 */
PS_EXPORT int ps_gpu_device_count(int *count);

/** Makes device current for the calling thread. PS_EINVAL for a bad index; PS_EUNAVAIL. */
PS_EXPORT int ps_gpu_set_device(int device);

/** Sets *device to the calling thread's current device. PS_EINVAL for NULL; PS_EUNAVAIL. */
PS_EXPORT int ps_gpu_get_device(int *device);

/**
 * dst[i] = dst[i] op src[i] for i in [0, count), on device memory, enqueued
 * on stream. Exactly the semantics of ps_reduce (include/paramsync/reduce.h),
 * bit for bit: integers wrap, MIN/MAX propagate NaN, float16/bfloat16 go
 * through float32 with one round to nearest even, SUM/PRODUCT NaNs are the
 * canonical quiet NaN, bool is 0/1, AVG behaves as SUM (divide afterwards
 * with ps_gpu_scale).
 *
 * dst and src are device pointers (or managed memory), aligned to the
 * element size; dst == src is allowed, any other overlap is not. 16-byte
 * aligned pointers take the vectorized path.
 *
 * Returns 0 once the kernel is enqueued (count == 0 enqueues nothing);
 * PS_EINVAL for an invalid op/dtype pair (ps_op_check), NULL or misaligned
 * pointers with count > 0, a size overflow or overlapping buffers; a mapped
 * CUDA error otherwise. On an argument error nothing is enqueued.
 */
PS_EXPORT int ps_gpu_reduce(ps_op_t op, ps_dtype_t dtype, void *dst, const void *src, size_t count,
                            ps_gpu_stream_t stream);

/**
 * dst[i] = srcs[0][i] op ... op srcs[nsrc-1][i] in one pass over device
 * memory: the semantics of ps_reduce_multi (float16/bfloat16 accumulate in
 * float32 over all inputs and round once; AVG divides by nsrc before that
 * rounding). srcs is a host array of device pointers, read before the call
 * returns; dst may equal any srcs[j] exactly (one pass: every input of an
 * element is read before it is written), unlike ps_reduce_multi.
 *
 * Returns as ps_gpu_reduce, and PS_EINVAL for srcs == NULL, nsrc == 0 or
 * nsrc > PS_GPU_MAX_SRCS.
 */
PS_EXPORT int ps_gpu_reduce_multi(ps_op_t op, ps_dtype_t dtype, void *dst, const void *const *srcs,
                                  size_t nsrc, size_t count, ps_gpu_stream_t stream);

/**
 * buf[i] = buf[i] / divisor on device memory: ps_reduce_scale's semantics.
 * Floating dtypes only; PS_EINVAL otherwise, for divisor == 0, or for a NULL
 * or misaligned buf with count > 0.
 */
PS_EXPORT int ps_gpu_scale(ps_dtype_t dtype, void *buf, size_t count, uint64_t divisor,
                           ps_gpu_stream_t stream);

/**
 * Sets *is_device to 1 when ptr is device or managed memory (a kernel can
 * read it and a host memcpy must not), to 0 otherwise (pageable or pinned
 * host memory, NULL). Without a CUDA driver (and in the stub) no device
 * pointer can exist: *is_device is 0 and the call succeeds. Returns 0, or
 * PS_EINVAL when is_device is NULL.
 */
PS_EXPORT int ps_gpu_is_device_pointer(const void *ptr, int *is_device);

/**
 * Allocates bytes of pinned (page-locked) host memory, usable by every
 * device for DMA. The caller owns *out and frees it with ps_gpu_host_free.
 * Returns 0; PS_EINVAL for NULL out or bytes == 0; PS_ENOMEM; PS_EUNAVAIL.
 */
PS_EXPORT int ps_gpu_host_alloc(void **out, size_t bytes);

/** Frees memory from ps_gpu_host_alloc. Accepts NULL. Cannot fail. */
PS_EXPORT void ps_gpu_host_free(void *ptr);

/**
 * Pins bytes of existing host memory at ptr (page-locks it and maps it for
 * every device's DMA), so that copies and the stager read and write it
 * directly, without a staging copy. The memory must stay mapped until
 * ps_gpu_host_unregister(ptr); ranges may not overlap one already pinned.
 * Works on malloc'd memory and on shared mappings of tmpfs files (POSIX shm,
 * memfd). Pinning touches every page once: a cost paid at registration, not
 * per copy. Returns 0; PS_EINVAL for NULL ptr, bytes == 0 or memory CUDA
 * cannot pin (e.g. already pinned); PS_ENOMEM when the system's locked-page
 * limit is reached; PS_EUNAVAIL without a driver or device (and in the stub).
 */
PS_EXPORT int ps_gpu_host_register(void *ptr, size_t bytes);

/**
 * Unpins memory pinned by ps_gpu_host_register at the same ptr; call it
 * before unmapping or freeing that memory. Accepts NULL. Returns 0, or a
 * mapped CUDA error (PS_EINVAL when ptr was not registered).
 */
PS_EXPORT int ps_gpu_host_unregister(void *ptr);

/**
 * Allocates bytes of device memory on the current device (256-byte aligned).
 * The caller owns *out and frees it with ps_gpu_free. Returns 0; PS_EINVAL
 * for NULL out or bytes == 0; PS_ENOMEM; PS_EUNAVAIL.
 */
PS_EXPORT int ps_gpu_malloc(void **out, size_t bytes);

/** Frees memory from ps_gpu_malloc. Accepts NULL. Cannot fail. */
PS_EXPORT void ps_gpu_free(void *ptr);

/**
 * Enqueues a copy of bytes from src to dst on stream, in whichever direction
 * the pointers say (host or device, unified addressing). With pageable host
 * memory CUDA copies synchronously; with pinned memory the copy overlaps
 * other work. Returns 0; PS_EINVAL for NULL pointers with bytes > 0; a
 * mapped CUDA error.
 */
PS_EXPORT int ps_gpu_memcpy_async(void *dst, const void *src, size_t bytes, ps_gpu_stream_t stream);

/**
 * Creates a non-blocking stream on the current device; the caller owns it
 * and destroys it with ps_gpu_stream_destroy. Returns 0; PS_EINVAL for NULL
 * out; a mapped CUDA error.
 */
PS_EXPORT int ps_gpu_stream_create(ps_gpu_stream_t *out);

/** Destroys a stream from ps_gpu_stream_create once its work is done. Accepts NULL. */
PS_EXPORT void ps_gpu_stream_destroy(ps_gpu_stream_t stream);

/**
 * Waits until all work enqueued on stream has finished. Returns 0, or the
 * mapped error of that work (a faulted kernel gives PS_EINTERNAL).
 */
PS_EXPORT int ps_gpu_stream_synchronize(ps_gpu_stream_t stream);

/**
 * Waits until the work enqueued before it on the legacy default stream of
 * the current device has finished, and with it the work of the blocking
 * streams that stream waits for (what a copy on stream NULL would wait for
 * before it started). Returns 0 or a mapped CUDA error.
 */
PS_EXPORT int ps_gpu_fence(void);

/*
 * Device memory of one process read by another on the same host (CUDA IPC).
 * The exporter describes the allocation its pointer lies in; another process
 * opens that description once, at an address of its own, and reads the
 * bytes at the same offsets from the allocation's start.
 */
#define PS_GPU_IPC_HANDLE_BYTES 64

typedef struct ps_gpu_ipc {
    unsigned char handle[PS_GPU_IPC_HANDLE_BYTES]; /* cudaIpcMemHandle_t */
    uint64_t base; /* where the allocation starts in the exporting process */
    uint64_t size; /* its bytes */
} ps_gpu_ipc_t;

/**
 * Describes the device allocation (cudaMalloc) that ptr lies in, for
 * ps_gpu_ipc_open in another process. Returns 0; PS_EINVAL for NULL
 * arguments or memory CUDA cannot export (host, managed, or from an
 * allocator without IPC); PS_EUNAVAIL without a device.
 */
PS_EXPORT int ps_gpu_ipc_export(const void *ptr, ps_gpu_ipc_t *out);

/**
 * Maps another process's allocation into this one, on the current device
 * (peer access enabled where it is another): *base is where its first byte
 * is here, until ps_gpu_ipc_close(*base). A process cannot open its own
 * allocations (they are at ipc->base already). Returns 0; PS_EINVAL for NULL
 * arguments, a handle of this process or one that names no allocation; a
 * mapped CUDA error.
 */
PS_EXPORT int ps_gpu_ipc_open(const ps_gpu_ipc_t *ipc, void **base);

/** Unmaps what ps_gpu_ipc_open mapped at base. Accepts NULL. Returns 0 or a mapped CUDA error. */
PS_EXPORT int ps_gpu_ipc_close(void *base);

/*
 * Host data reduced on a device: the stager.
 *
 * ps_gpu_reduce_host takes host buffers and cuts them into chunks of
 * chunk_bytes. Chunk k goes through slot k % 2, each slot with its own
 * stream, pinned buffers and device buffers:
 *
 *   host thread:  stage k (memcpy into pinned) | stage k+1          | ...
 *   slot k % 2:   H2D k -> kernel k -> D2H k
 *   slot k+1 % 2:                  H2D k+1 -> kernel k+1 -> D2H k+1
 *
 * so the CPU's staging copies of one chunk overlap the transfers and the
 * kernel of the previous one. An input (or dst) that is already pinned
 * (ps_gpu_host_alloc, ps_gpu_host_register, cudaHostAlloc) is not staged: the
 * DMA reads (or writes) it directly, which removes the CPU copy entirely.
 * Callers that own their receive buffers (the agent) should allocate them
 * pinned for that reason: staging pageable inputs costs the CPU a memcpy of
 * every input and of the result, as much memory traffic as the CPU engine's
 * own ps_reduce_multi, so the device only pays off for pinned data.
 *
 * Memory: for a call with nsrc inputs the stager holds 2 * nsrc *
 * chunk_bytes of device memory, and as much pinned memory once a call has a
 * pageable input or dst to stage, allocated at the first call that needs
 * them and kept (grown when a later call has more inputs): a stager created
 * with max_srcs = 64 that sees 4 inputs holds 2 * 4 chunks, 32 MiB device
 * (+ 32 MiB pinned when it stages) with the default chunk. Make one for each
 * reduction that runs at once, on the device it should use, and reuse it; a
 * stager is not thread-safe.
 */
typedef struct ps_gpu_stager ps_gpu_stager_t;

/**
 * Creates a stager on device (its two streams; buffers come with the first
 * call) for up to max_srcs inputs per call, moving chunk_bytes per input per
 * chunk (0: 4 MiB; rounded down to a multiple of 256, at least 256). The
 * caller owns *out (ps_gpu_stager_destroy). The calling thread's current
 * device is left as it was.
 * Returns 0; PS_EINVAL for NULL out, max_srcs of 0 or above
 * PS_GPU_MAX_SRCS, or a bad device; PS_ENOMEM; PS_EUNAVAIL (always in the
 * stub). On error *out is untouched and nothing is left allocated.
 */
PS_EXPORT int ps_gpu_stager_create(ps_gpu_stager_t **out, int device, size_t max_srcs,
                                   size_t chunk_bytes);

/** Waits for the stager's work and frees everything it owns. Accepts NULL. */
PS_EXPORT void ps_gpu_stager_destroy(ps_gpu_stager_t *stager);

/**
 * ps_reduce_multi on the stager's device: dst[i] = srcs[0][i] op ... op
 * srcs[nsrc-1][i] for host buffers (pageable or pinned; alignment as for
 * ps_reduce_multi: none needed), with the same result bit for bit. For the
 * two-input accumulate of ps_reduce pass op SUM for AVG. Synchronous: dst
 * holds the result when it returns 0.
 *
 * The calling thread's current device is left as it was.
 *
 * Returns 0; PS_EINVAL as ps_reduce_multi, for a NULL stager, for nsrc >
 * the stager's max_srcs, or for a device pointer among dst and srcs (device
 * data goes to ps_gpu_reduce_multi); PS_ENOMEM when the buffers for nsrc
 * inputs cannot be allocated; a mapped CUDA error. After a CUDA error the
 * content of dst is unspecified (some chunks may be written), unlike the
 * CPU engine; the stager stays usable unless the context is poisoned.
 */
PS_EXPORT int ps_gpu_reduce_host(ps_gpu_stager_t *stager, ps_op_t op, ps_dtype_t dtype, void *dst,
                                 const void *const *srcs, size_t nsrc, size_t count);

/**
 * ps_gpu_reduce_host with the result written into each of ndst host buffers
 * (1 to PS_GPU_MAX_SRCS): the DMA writes every pinned one straight from the
 * device, pageable ones get a CPU copy from the stager's pinned buffer. So
 * a result that several pinned buffers want costs no CPU copy at all (the
 * agent writes one step's result into every worker's segment this way).
 * A dst may be one of srcs exactly (in place; any of them, since each chunk is
 * read from every input before it is written anywhere); dsts must not overlap
 * each other, nor overlap srcs otherwise.
 *
 * Returns as ps_gpu_reduce_host; PS_EINVAL also for NULL dsts, ndst of 0 or
 * above PS_GPU_MAX_SRCS, or overlapping dsts. The argument checks come
 * before anything is enqueued; after a CUDA error any dst may be partly
 * written, an input that is also a dst among them.
 */
PS_EXPORT int ps_gpu_reduce_host_dsts(ps_gpu_stager_t *stager, ps_op_t op, ps_dtype_t dtype,
                                      void *const *dsts, size_t ndst, const void *const *srcs,
                                      size_t nsrc, size_t count);

#ifdef __cplusplus
}
#endif
#endif
