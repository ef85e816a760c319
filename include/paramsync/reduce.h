/* The CPU reduction engine: element-wise (op, dtype) kernels with run-time SIMD dispatch. */
#ifndef PARAMSYNC_REDUCE_H
#define PARAMSYNC_REDUCE_H

#include <paramsync/common.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Kernel implementations, in order of preference. */
typedef enum ps_reduce_path {
    PS_PATH_SCALAR = 0,
    PS_PATH_AVX2 = 1,
    PS_PATH_AVX512 = 2,
    PS_PATH_COUNT = 3
} ps_reduce_path_t;

/**
 * dst[i] = dst[i] op src[i] for i in [0, count).
 *
 * Semantics follow torch: integers wrap; MIN/MAX propagate NaN; float16 and
 * bfloat16 are computed in float32 and rounded to nearest even; bool SUM is
 * logical OR and PRODUCT logical AND. AVG behaves as SUM here (scale with
 * ps_reduce_scale afterwards).
 *
 * Bit-level rules, identical on every path (reduce/ps_elementwise.h has
 * them in full): a NaN made by SUM, PRODUCT or AVG is the canonical quiet
 * NaN; MIN/MAX return one operand unchanged, dst's NaN before src's, and
 * keep dst on ties (+0 vs -0 included); float16/bfloat16 NaN results are
 * 0x7E00/0x7FC0. Buffers may start at any byte address. Thread-safe; the
 * call never starts threads (docs/PERFORMANCE.md says why).
 *
 * Returns 0; PS_EINVAL for an invalid op/dtype pair (see ps_op_check), for
 * NULL pointers with count > 0, or for partially overlapping dst and src
 * (dst == src is allowed). On error dst is untouched.
 */
PS_EXPORT int ps_reduce(ps_op_t op, ps_dtype_t dtype, void *dst, const void *src, size_t count);

/**
 * dst[i] = srcs[0][i] op srcs[1][i] op ... op srcs[nsrc-1][i], in that order,
 * in one pass. dst may be equal to srcs[0] (and only to srcs[0]).
 * float16/bfloat16 accumulate in float32 over all inputs and round once.
 * For AVG the sum is divided by nsrc before that single rounding.
 *
 * Returns 0; PS_EINVAL as for ps_reduce, or for nsrc == 0 or a NULL srcs.
 */
PS_EXPORT int ps_reduce_multi(ps_op_t op, ps_dtype_t dtype, void *dst, const void *const *srcs,
                              size_t nsrc, size_t count);

/**
 * buf[i] = buf[i] / divisor, for the last step of AVG when the sum was made
 * in several places. Floating dtypes only (PS_EINVAL otherwise, or for
 * divisor == 0).
 */
PS_EXPORT int ps_reduce_scale(ps_dtype_t dtype, void *buf, size_t count, uint64_t divisor);

/** The path ps_reduce uses now (best supported, or the forced one). */
PS_EXPORT ps_reduce_path_t ps_reduce_get_path(void);

/**
 * Forces a path for the whole process ("scalar", "avx2", "avx512" also come
 * from the environment variable PARAMSYNC_REDUCE_PATH at first use).
 * Returns 0, or PS_ENOTSUP when this CPU or build lacks that path.
 */
PS_EXPORT int ps_reduce_set_path(ps_reduce_path_t path);

/** Whether this CPU and build can run path. */
PS_EXPORT int ps_reduce_path_supported(ps_reduce_path_t path);

/** "scalar", "avx2", "avx512". */
PS_EXPORT const char *ps_reduce_path_name(ps_reduce_path_t path);

#ifdef __cplusplus
}
#endif
#endif
