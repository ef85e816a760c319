/* The GPU reduce loop as a host-and-device template: kernels run it, a host test emulates it. */
#ifndef PARAMSYNC_GPU_KERNELS_CUH
#define PARAMSYNC_GPU_KERNELS_CUH

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cuda_runtime.h>

#include "gpu_element.h"
#include "gpu_internal.h"

/* Unrolls the loops over the lanes of a vector in device code; host compilers do it unasked. */
#if defined(__CUDA_ARCH__)
#define PS__GPU_UNROLL _Pragma("unroll")
#else
#define PS__GPU_UNROLL
#endif

/*
 * One struct per valid (op, dtype) pair, from the single table of
 * ps_elementwise.h, so that the loop below is written once. The member
 * functions only forward to gpu_element.h, which the host tests check.
 */
#define PS__GPU_OP(opname, step, fin, dtype, d, T, c, A)                                           \
    struct ps__gpu_op_##opname##_##d {                                                             \
        typedef T stored_t;                                                                        \
        typedef A acc_t;                                                                           \
        static PS_HD A load_first(T x)                                                             \
        {                                                                                          \
            return ps__gpu_first_##opname##_##d(x);                                                \
        }                                                                                          \
        static PS_HD A accumulate(A acc, T x)                                                      \
        {                                                                                          \
            return ps__gpu_step_##opname##_##d(acc, x);                                            \
        }                                                                                          \
        static PS_HD T finish(A acc, uint64_t divisor)                                             \
        {                                                                                          \
            return ps__gpu_finish_##opname##_##d(acc, divisor);                                    \
        }                                                                                          \
    };

PS_FOR_EACH_KERNEL(PS__GPU_OP)

/*
 * The work of thread tid out of nthreads, in grid-stride order: every
 * element is produced by exactly one thread, which reads it from every input
 * before writing it, so dst == srcs[0] is safe and the order in which threads
 * run does not matter (the host test runs them one after another).
 *
 * When every pointer is 16-byte aligned (a.vec), the first count / V * V
 * elements move as 16-byte vectors of V elements (one 128-bit load per input,
 * one store); the remaining count % V elements, and everything when a.vec is
 * 0, go one element at a time. Both loops apply exactly the same functions.
 */
template <class Op>
static inline PS_HD void ps__gpu_reduce_range(const ps__gpu_args_t &a, size_t tid, size_t nthreads)
{
    typedef typename Op::stored_t T;
    typedef typename Op::acc_t A;
    const size_t V = sizeof(uint4) / sizeof(T);
    size_t done = 0;
    if (a.vec) {
        const size_t nvec = a.count / V;
        for (size_t v = tid; v < nvec; v += nthreads) {
            /* memcpy between registers is the defined way to see a vector as lanes; it costs
             * nothing (ptxas: no local memory in 60 of the 62 kernels, 16 bytes in two). */
            T lanes[V];
            A acc[V];
            uint4 w = static_cast<const uint4 *>(a.srcs[0])[v];
            memcpy(lanes, &w, sizeof w);
            PS__GPU_UNROLL
            for (size_t l = 0; l < V; l++)
                acc[l] = Op::load_first(lanes[l]);
            for (int j = 1; j < a.nsrc; j++) {
                w = static_cast<const uint4 *>(a.srcs[j])[v];
                memcpy(lanes, &w, sizeof w);
                PS__GPU_UNROLL
                for (size_t l = 0; l < V; l++)
                    acc[l] = Op::accumulate(acc[l], lanes[l]);
            }
            PS__GPU_UNROLL
            for (size_t l = 0; l < V; l++)
                lanes[l] = Op::finish(acc[l], a.divisor);
            memcpy(&w, lanes, sizeof w);
            static_cast<uint4 *>(a.dst)[v] = w;
        }
        done = nvec * V;
    }
    for (size_t i = done + tid; i < a.count; i += nthreads) {
        A acc = Op::load_first(static_cast<const T *>(a.srcs[0])[i]);
        for (int j = 1; j < a.nsrc; j++)
            acc = Op::accumulate(acc, static_cast<const T *>(a.srcs[j])[i]);
        static_cast<T *>(a.dst)[i] = Op::finish(acc, a.divisor);
    }
}

#endif
