/* Internals shared by the files of gpu/: kernel arguments, the launcher, error mapping, checks. */
#ifndef PARAMSYNC_GPU_INTERNAL_H
#define PARAMSYNC_GPU_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include <paramsync/gpu.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Threads per block of every reduce kernel. */
#define PS__GPU_THREADS 256

/*
 * Everything one reduce kernel needs, passed by value as its only parameter
 * (about 560 bytes, well under the 4 KiB kernel-parameter limit), so a launch
 * needs no device allocation and no copy of the pointer array.
 *
 * dst[i] = srcs[0][i] op ... op srcs[nsrc-1][i], divided by divisor when op
 * is AVG. dst may equal srcs[0]. vec says every pointer is 16-byte aligned, so
 * the kernel may move 16 bytes per load.
 */
typedef struct ps__gpu_args {
    void *dst;
    const void *srcs[PS_GPU_MAX_SRCS];
    int nsrc;
    int vec;
    size_t count;
    uint64_t divisor;
} ps__gpu_args_t;

/*
 * Enqueues the (op, dtype) kernel on stream (a cudaStream_t) with blocks
 * blocks of PS__GPU_THREADS threads; args were checked (ps__gpu_check_reduce).
 * Returns the cudaError_t of the launch as an int: 0, or the error, which is
 * then also the thread's last CUDA error. Defined in gpu_kernels.cu.
 */
int ps__gpu_launch(ps_op_t op, ps_dtype_t dtype, const ps__gpu_args_t *args, unsigned blocks,
                   void *stream);

/*
 * Maps a cudaError_t (passed as int so that this header needs no CUDA
 * header) to 0 or a PS_E* code. Cannot fail. Defined in gpu.c.
 */
int ps__gpu_error(int cuda_error);

/*
 * The PS_E* code of a CUDA call's result (a cudaError_t as int). A failed
 * call has also become the thread's last CUDA error: it is read back here
 * (cudaGetLastError) so that it cannot surface later in the caller's own
 * cudaGetLastError(). Cannot fail. Defined in gpu.c.
 */
int ps__gpu_result(int cuda_error);

/*
 * Enqueues dst = srcs[0] op ... op srcs[nsrc-1] (divided by divisor for AVG)
 * on stream: picks the vector width from the pointers' alignment and the grid
 * from the current device. Arguments were checked and count > 0. Returns 0 or
 * a PS_E* code. Defined in gpu.c.
 */
int ps__gpu_enqueue(ps_op_t op, ps_dtype_t dtype, void *dst, const void *const *srcs, size_t nsrc,
                    size_t count, uint64_t divisor, ps_gpu_stream_t stream);

/*
 * The argument checks of ps_gpu_reduce, ps_gpu_reduce_multi and
 * ps_gpu_reduce_host, shared by the CUDA build and the stub so both answer
 * PS_EINVAL alike. Checks the op/dtype pair, srcs and 1 <= nsrc <= max_srcs,
 * size overflow, NULL pointers when count > 0, alignment to align bytes (the
 * element size for device memory, 1 for host memory) and overlaps: dst may
 * equal srcs[0], and every srcs[j] when alias_any is set (ps_reduce's
 * dst == src); no other sharing. Sets *bytes to count times the element size.
 * Returns 0 or PS_EINVAL.
 */
int ps__gpu_check_reduce(ps_op_t op, ps_dtype_t dtype, const void *dst, const void *const *srcs,
                         size_t nsrc, size_t max_srcs, size_t count, size_t align, int alias_any,
                         size_t *bytes);

/* The destinations of ps_gpu_reduce_host_dsts: dsts non-NULL, 1 to
 * PS_GPU_MAX_SRCS of them, no two sharing a byte of their first `bytes`
 * (each passed ps__gpu_check_reduce). 0 or PS_EINVAL. */
int ps__gpu_check_dsts(void *const *dsts, size_t ndst, size_t bytes);

#ifdef __cplusplus
}
#endif
#endif
