/* Internals shared by the files of reduce/: the kernel signature and the per-path kernel tables. */
#ifndef PARAMSYNC_REDUCE_INTERNAL_H
#define PARAMSYNC_REDUCE_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include <paramsync/reduce.h>

/*
 * One kernel reduces elements [begin, end) of nsrc >= 1 inputs into dst:
 * dst[i] = srcs[0][i] op ... op srcs[nsrc-1][i], divided by divisor when op
 * is AVG (divisor is ignored otherwise). dst may equal srcs[0]; the caller
 * has checked every other overlap, the op/dtype pair and the pointers.
 *
 * A scalar kernel handles the whole range and returns end. A SIMD kernel
 * handles a prefix that is a whole number of vectors and returns the index
 * where it stopped; the scalar kernel finishes the tail. Kernels cannot fail.
 */
typedef size_t (*ps__kernel_fn)(void *dst, const void *const *srcs, size_t nsrc, size_t begin,
                                size_t end, uint64_t divisor);

/* fn[op][dtype]; NULL for invalid pairs (and, in SIMD tables, for pairs a path leaves to scalar).
 */
typedef struct ps__kernel_table {
    ps__kernel_fn fn[PS_OP_COUNT][PS_DTYPE_COUNT];
} ps__kernel_table_t;

/* The reference: every valid pair is non-NULL. Always built. */
extern const ps__kernel_table_t ps__scalar_kernels;

#ifdef PS_HAVE_AVX2
/* Needs AVX2 and F16C at run time. */
extern const ps__kernel_table_t ps__avx2_kernels;
#endif

#ifdef PS_HAVE_AVX512
/* Needs AVX-512 F and BW at run time. */
extern const ps__kernel_table_t ps__avx512_kernels;
#endif

#endif
