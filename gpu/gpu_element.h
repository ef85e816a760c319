/* The per-element steps every GPU kernel is made of, in C that nvcc and the host tests both
 * compile.
 */
#ifndef PARAMSYNC_GPU_ELEMENT_H
#define PARAMSYNC_GPU_ELEMENT_H

/*
 * One output element of (op, dtype) from nsrc inputs is
 *
 *     acc = ps__gpu_first_<op>_<d>(srcs[0][i]);
 *     for j in 1 .. nsrc-1:  acc = ps__gpu_step_<op>_<d>(acc, srcs[j][i]);
 *     dst[i] = ps__gpu_finish_<op>_<d>(acc, divisor);
 *
 * which is the composition the scalar reference of reduce/ performs, built
 * from the same functions of ps_elementwise.h. The kernels (gpu_kernels.cuh)
 * call nothing else, and tests/unit/test_gpu_elementwise.c runs these very
 * functions on the host against the CPU engine, so the arithmetic the GPU
 * runs is proven without a GPU. What a GPU alone proves is that nvcc compiles
 * them to the same IEEE operations (it does by default: no fast-math, no
 * flush-to-zero, IEEE division; gpu/ also turns off FMA contraction).
 */

#include "ps_elementwise.h"

/* AVG divides once, after the whole accumulation; every other op keeps the accumulator. */
#define PS__GPU_FIN_keep(c, acc, divisor) (acc)
#define PS__GPU_FIN_div(c, acc, divisor)  ps_div_##c(acc, divisor)

#define PS__GPU_ELEMENT_FNS(opname, step, fin, dtype, d, T, c, A)                                  \
    static inline PS_HD A ps__gpu_first_##opname##_##d(T x)                                        \
    {                                                                                              \
        return ps_load_##d(x);                                                                     \
    }                                                                                              \
    static inline PS_HD A ps__gpu_step_##opname##_##d(A acc, T x)                                  \
    {                                                                                              \
        return ps_##step##_##c(acc, ps_load_##d(x));                                               \
    }                                                                                              \
    static inline PS_HD T ps__gpu_finish_##opname##_##d(A acc, uint64_t divisor)                   \
    {                                                                                              \
        (void)divisor;                                                                             \
        return ps_store_##d(PS__GPU_FIN_##fin(c, acc, divisor));                                   \
    }

PS_FOR_EACH_KERNEL(PS__GPU_ELEMENT_FNS)

#endif
