/* The scalar reference kernels: every (op, dtype) pair, portable C, built on every machine. */
#include <string.h>

#include "reduce_internal.h"
#include "ps_elementwise.h"

/* AVG divides once, after the whole accumulation; every other op stores the accumulator as is. */
#define PS__FIN_keep(c, acc, divisor) (acc)
#define PS__FIN_div(c, acc, divisor)  ps_div_##c(acc, divisor)

/*
 * The reference loop. Elements are processed one at a time, each one read
 * from every input before it is written, which is what makes dst == srcs[0]
 * safe. Elements go through memcpy because buffers may sit at any byte
 * address (tensor bytes straight out of a network buffer); on x86 it
 * compiles to plain loads and stores. Two inputs (ps_reduce) get a loop
 * without the inner loop over inputs, which the compiler can keep tight;
 * both loops perform exactly the same operations.
 */
#define PS__SCALAR_KERNEL(opname, step, fin, dtype, d, T, c, A)                                    \
    static size_t scalar_##opname##_##d(void *dst, const void *const *srcs, size_t nsrc,           \
                                        size_t begin, size_t end, uint64_t divisor)                \
    {                                                                                              \
        unsigned char *out = (unsigned char *)dst;                                                 \
        const unsigned char *first = (const unsigned char *)srcs[0];                               \
        T x, y;                                                                                    \
        (void)divisor;                                                                             \
        if (nsrc == 2) {                                                                           \
            const unsigned char *second = (const unsigned char *)srcs[1];                          \
            for (size_t i = begin; i < end; i++) {                                                 \
                memcpy(&x, first + i * sizeof(T), sizeof x);                                       \
                memcpy(&y, second + i * sizeof(T), sizeof y);                                      \
                A acc = ps_##step##_##c(ps_load_##d(x), ps_load_##d(y));                           \
                x = ps_store_##d(PS__FIN_##fin(c, acc, divisor));                                  \
                memcpy(out + i * sizeof(T), &x, sizeof x);                                         \
            }                                                                                      \
            return end;                                                                            \
        }                                                                                          \
        for (size_t i = begin; i < end; i++) {                                                     \
            memcpy(&x, first + i * sizeof(T), sizeof x);                                           \
            A acc = ps_load_##d(x);                                                                \
            for (size_t j = 1; j < nsrc; j++) {                                                    \
                memcpy(&y, (const unsigned char *)srcs[j] + i * sizeof(T), sizeof y);              \
                acc = ps_##step##_##c(acc, ps_load_##d(y));                                        \
            }                                                                                      \
            x = ps_store_##d(PS__FIN_##fin(c, acc, divisor));                                      \
            memcpy(out + i * sizeof(T), &x, sizeof x);                                             \
        }                                                                                          \
        return end;                                                                                \
    }

PS_FOR_EACH_KERNEL(PS__SCALAR_KERNEL)

#define PS__SCALAR_ENTRY(opname, step, fin, dtype, d, T, c, A)                                     \
    [PS__OP_##opname][dtype] = scalar_##opname##_##d,

const ps__kernel_table_t ps__scalar_kernels = {{PS_FOR_EACH_KERNEL(PS__SCALAR_ENTRY)}};
