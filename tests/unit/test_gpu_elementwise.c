/* Unit tests of the arithmetic the GPU kernels run (gpu/gpu_element.h), on the host, against the
 * CPU engine. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <paramsync/gpu.h>
#include <paramsync/reduce.h>

#include "gpu_element.h"
#include "test_data.h"

/*
 * Every GPU kernel produces an element as first / step... / finish of
 * gpu_element.h (see gpu/gpu_kernels.cuh). Here the host C compiler runs
 * those same functions in the same composition and the result must equal,
 * bit for bit, the CPU engine's scalar reference through its public API
 * (ps_reduce, ps_reduce_multi, ps_reduce_scale), including the way each gpu
 * entry point maps its arguments: ps_gpu_reduce runs AVG as SUM with two
 * inputs, ps_gpu_reduce_multi divides AVG by nsrc, ps_gpu_scale is AVG with
 * one input and the divisor.
 */

#define COUNT    4099 /* odd, and not a multiple of any vector width */
#define MAX_SRCS 6

static const ps_op_t all_ops[] = {PS_SUM,  PS_PRODUCT, PS_MIN,  PS_MAX,
                                  PS_BAND, PS_BOR,     PS_BXOR, PS_AVG};
static const ps_dtype_t all_dtypes[] = {PS_FLOAT32, PS_FLOAT64, PS_FLOAT16, PS_BFLOAT16, PS_INT8,
                                        PS_UINT8,   PS_INT16,   PS_INT32,   PS_INT64,    PS_BOOL};
#define N_OPS    (sizeof all_ops / sizeof all_ops[0])
#define N_DTYPES (sizeof all_dtypes / sizeof all_dtypes[0])

/* ---- the GPU kernel's per-element loop, on the host */

typedef void (*emulate_fn)(void *dst, const void *const *srcs, size_t nsrc, size_t count,
                           uint64_t divisor);

#define EMULATE(opname, step, fin, dtype, d, T, c, A)                                              \
    static void emulate_##opname##_##d(void *dst, const void *const *srcs, size_t nsrc,            \
                                       size_t count, uint64_t divisor)                             \
    {                                                                                              \
        for (size_t i = 0; i < count; i++) {                                                       \
            T x;                                                                                   \
            memcpy(&x, (const unsigned char *)srcs[0] + i * sizeof(T), sizeof x);                  \
            A acc = ps__gpu_first_##opname##_##d(x);                                               \
            for (size_t j = 1; j < nsrc; j++) {                                                    \
                memcpy(&x, (const unsigned char *)srcs[j] + i * sizeof(T), sizeof x);              \
                acc = ps__gpu_step_##opname##_##d(acc, x);                                         \
            }                                                                                      \
            x = ps__gpu_finish_##opname##_##d(acc, divisor);                                       \
            memcpy((unsigned char *)dst + i * sizeof(T), &x, sizeof x);                            \
        }                                                                                          \
    }

PS_FOR_EACH_KERNEL(EMULATE)

#define EMULATE_ENTRY(opname, step, fin, dtype, d, T, c, A)                                        \
    [PS__OP_##opname][dtype] = emulate_##opname##_##d,

/* The same table the GPU instantiates its kernels from (PS_FOR_EACH_KERNEL). */
static const emulate_fn emulate_table[PS_OP_COUNT][PS_DTYPE_COUNT] = {
    PS_FOR_EACH_KERNEL(EMULATE_ENTRY)};

/* ---- fixtures */

typedef struct data {
    void *src[MAX_SRCS];
    void *got;
    void *want;
} data_t;

static void data_make(data_t *d, ps_dtype_t dt, size_t n)
{
    size_t bytes = n * ps_dtype_size(dt);
    for (int k = 0; k < MAX_SRCS; k++) {
        d->src[k] = malloc(bytes);
        assert_non_null(d->src[k]);
        test_data_fill(dt, d->src[k], k > 0 ? d->src[0] : NULL, n);
    }
    d->got = malloc(bytes);
    d->want = malloc(bytes);
    assert_non_null(d->got);
    assert_non_null(d->want);
}

static void data_free(data_t *d)
{
    for (int k = 0; k < MAX_SRCS; k++)
        free(d->src[k]);
    free(d->got);
    free(d->want);
}

static int setup(void **state)
{
    (void)state;
    return ps_reduce_set_path(PS_PATH_SCALAR);
}

/* ---- tests */

/* The GPU table has exactly the pairs that ps_op_check accepts: the whole grid, nothing more. */
static void test_table_is_the_grid(void **state)
{
    (void)state;
    int pairs = 0;
    for (size_t o = 0; o < N_OPS; o++)
        for (size_t t = 0; t < N_DTYPES; t++) {
            int valid = ps_op_check(all_ops[o], all_dtypes[t]) == 0;
            if (valid != (emulate_table[all_ops[o]][all_dtypes[t]] != NULL))
                fail_msg("%s %s: table and ps_op_check disagree", ps_op_name(all_ops[o]),
                         ps_dtype_name(all_dtypes[t]));
            pairs += valid;
        }
    /* 5 floating ops x 4 floating dtypes + 7 integer ops x 6 integer dtypes. */
    assert_int_equal(pairs, 5 * 4 + 7 * 6);
}

/* ps_gpu_reduce: dst = dst op src, AVG as SUM, against ps_reduce; dst == src too. */
static void test_two_inputs(void **state)
{
    (void)state;
    test_data_seed("two_inputs");
    for (size_t t = 0; t < N_DTYPES; t++) {
        ps_dtype_t dt = all_dtypes[t];
        size_t bytes = COUNT * ps_dtype_size(dt);
        data_t d;
        data_make(&d, dt, COUNT);
        for (size_t o = 0; o < N_OPS; o++) {
            ps_op_t op = all_ops[o];
            if (ps_op_check(op, dt) != 0)
                continue;
            for (int alias = 0; alias < 2; alias++) {
                const void *src = alias ? d.src[0] : d.src[1];
                memcpy(d.want, d.src[0], bytes);
                assert_int_equal(ps_reduce(op, dt, d.want, alias ? d.want : src, COUNT), 0);
                const void *srcs[2] = {d.src[0], src};
                emulate_table[op == PS_AVG ? PS_SUM : op][dt](d.got, srcs, 2, COUNT, 1);
                char what[64];
                snprintf(what, sizeof what, "reduce %s%s", ps_op_name(op), alias ? " x,x" : "");
                assert_true(test_data_same(d.got, d.want, COUNT, dt, what));
            }
        }
        data_free(&d);
    }
}

/* ps_gpu_reduce_multi: one pass over nsrc inputs, AVG divided by nsrc, against ps_reduce_multi. */
static void test_multi_inputs(void **state)
{
    (void)state;
    test_data_seed("multi_inputs");
    for (size_t t = 0; t < N_DTYPES; t++) {
        ps_dtype_t dt = all_dtypes[t];
        data_t d;
        data_make(&d, dt, COUNT);
        for (size_t o = 0; o < N_OPS; o++) {
            ps_op_t op = all_ops[o];
            if (ps_op_check(op, dt) != 0)
                continue;
            for (size_t nsrc = 1; nsrc <= MAX_SRCS; nsrc++) {
                const void *const *srcs = (const void *const *)d.src;
                assert_int_equal(ps_reduce_multi(op, dt, d.want, srcs, nsrc, COUNT), 0);
                emulate_table[op][dt](d.got, srcs, nsrc, COUNT, nsrc);
                char what[64];
                snprintf(what, sizeof what, "multi %s nsrc=%zu", ps_op_name(op), nsrc);
                assert_true(test_data_same(d.got, d.want, COUNT, dt, what));
            }
        }
        data_free(&d);
    }
}

/* ps_gpu_reduce_multi with the most inputs it takes (PS_GPU_MAX_SRCS, the same few buffers). */
static void test_max_inputs(void **state)
{
    (void)state;
    test_data_seed("max_inputs");
    const void *srcs[PS_GPU_MAX_SRCS];
    for (size_t t = 0; t < N_DTYPES; t++) {
        ps_dtype_t dt = all_dtypes[t];
        data_t d;
        data_make(&d, dt, COUNT);
        for (size_t j = 0; j < PS_GPU_MAX_SRCS; j++)
            srcs[j] = d.src[(j * 7) % MAX_SRCS];
        for (size_t o = 0; o < N_OPS; o++) {
            ps_op_t op = all_ops[o];
            if (ps_op_check(op, dt) != 0)
                continue;
            assert_int_equal(ps_reduce_multi(op, dt, d.want, srcs, PS_GPU_MAX_SRCS, COUNT), 0);
            emulate_table[op][dt](d.got, srcs, PS_GPU_MAX_SRCS, COUNT, PS_GPU_MAX_SRCS);
            assert_true(test_data_same(d.got, d.want, COUNT, dt, ps_op_name(op)));
        }
        data_free(&d);
    }
}

/* ps_gpu_scale: AVG with one input and the divisor, against ps_reduce_scale. */
static void test_scale(void **state)
{
    (void)state;
    test_data_seed("scale");
    /* Small, inexact, large, not representable in float32 or float64, the largest. */
    const uint64_t divisors[] = {
        1, 2, 3, 7, 10, 1000003, (1ull << 24) + 1, (1ull << 53) + 1, UINT64_MAX};
    const ps_dtype_t floats[] = {PS_FLOAT32, PS_FLOAT64, PS_FLOAT16, PS_BFLOAT16};
    for (size_t t = 0; t < 4; t++) {
        ps_dtype_t dt = floats[t];
        size_t bytes = COUNT * ps_dtype_size(dt);
        data_t d;
        data_make(&d, dt, COUNT);
        for (size_t k = 0; k < sizeof divisors / sizeof divisors[0]; k++) {
            memcpy(d.want, d.src[0], bytes);
            assert_int_equal(ps_reduce_scale(dt, d.want, COUNT, divisors[k]), 0);
            const void *srcs[1] = {d.src[0]};
            emulate_table[PS_AVG][dt](d.got, srcs, 1, COUNT, divisors[k]);
            char what[64];
            snprintf(what, sizeof what, "scale /%llu", (unsigned long long)divisors[k]);
            assert_true(test_data_same(d.got, d.want, COUNT, dt, what));
        }
        data_free(&d);
    }
}

/*
 * float16 and bfloat16, exhaustive in the first operand: every one of the
 * 65536 encodings against each special value and a few random ones, for
 * every op, two inputs and three (one float32 rounding at the end).
 */
static void test_half_exhaustive(void **state)
{
    (void)state;
    test_data_seed("half_exhaustive");
    const ps_dtype_t halves[] = {PS_FLOAT16, PS_BFLOAT16};
    const size_t n = 65536;
    uint16_t *a = malloc(n * 2), *b = malloc(n * 2), *c = malloc(n * 2);
    uint16_t *got = malloc(n * 2), *want = malloc(n * 2);
    assert_true(a != NULL && b != NULL && c != NULL && got != NULL && want != NULL);
    for (size_t i = 0; i < n; i++)
        a[i] = (uint16_t)i;
    for (int h = 0; h < 2; h++) {
        ps_dtype_t dt = halves[h];
        const uint16_t *specials =
            dt == PS_FLOAT16 ? test_data_f16_specials : test_data_bf16_specials;
        size_t nspecial = dt == PS_FLOAT16 ? sizeof test_data_f16_specials / 2
                                           : sizeof test_data_bf16_specials / 2;
        for (size_t s = 0; s < nspecial + 8; s++) {
            uint16_t other = s < nspecial ? specials[s] : (uint16_t)test_data_rng();
            for (size_t i = 0; i < n; i++)
                b[i] = other;
            test_data_fill(dt, c, NULL, n);
            for (size_t o = 0; o < N_OPS; o++) {
                ps_op_t op = all_ops[o];
                if (ps_op_check(op, dt) != 0)
                    continue;
                const void *srcs[3] = {a, b, c};
                char what[64];
                snprintf(what, sizeof what, "%s vs 0x%04x", ps_op_name(op), other);
                memcpy(want, a, n * 2);
                assert_int_equal(ps_reduce(op, dt, want, b, n), 0);
                emulate_table[op == PS_AVG ? PS_SUM : op][dt](got, srcs, 2, n, 1);
                assert_true(test_data_same(got, want, n, dt, what));
                assert_int_equal(ps_reduce_multi(op, dt, want, srcs, 3, n), 0);
                emulate_table[op][dt](got, srcs, 3, n, 3);
                assert_true(test_data_same(got, want, n, dt, what));
            }
        }
    }
    free(a);
    free(b);
    free(c);
    free(got);
    free(want);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_table_is_the_grid),
        cmocka_unit_test(test_two_inputs),
        cmocka_unit_test(test_multi_inputs),
        cmocka_unit_test(test_max_inputs),
        cmocka_unit_test(test_scale),
        cmocka_unit_test(test_half_exhaustive),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
