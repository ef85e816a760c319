/* Unit tests for reduce/: reference values by hand, every SIMD path bit-exact vs scalar. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#ifdef __x86_64__
#include <immintrin.h>
#endif

#include <paramsync/reduce.h>

#include "ps_elementwise.h"
#include "test_data.h"

extern char **environ;

/* 1M + 3: large enough to cross every unroll and threading boundary, odd so a tail remains. */
#define BIG_COUNT  ((size_t)(1u << 20) + 3u)
#define GUARD      64 /* bytes checked on both sides of every dst for stray writes */
#define GUARD_BYTE 0xA5
#define MAX_SRCS   5

static const ps_op_t all_ops[] = {PS_SUM,  PS_PRODUCT, PS_MIN,  PS_MAX,
                                  PS_BAND, PS_BOR,     PS_BXOR, PS_AVG};
static const ps_dtype_t all_dtypes[] = {PS_FLOAT32, PS_FLOAT64, PS_FLOAT16, PS_BFLOAT16, PS_INT8,
                                        PS_UINT8,   PS_INT16,   PS_INT32,   PS_INT64,    PS_BOOL};
#define N_OPS    (sizeof all_ops / sizeof all_ops[0])
#define N_DTYPES (sizeof all_dtypes / sizeof all_dtypes[0])

/* ---- deterministic random data (test_data.h) */

static int is_float(ps_dtype_t dt)
{
    return dt == PS_FLOAT32 || dt == PS_FLOAT64 || dt == PS_FLOAT16 || dt == PS_BFLOAT16;
}

/* ---- buffers with guard bytes around them */

typedef struct guarded {
    unsigned char *base;
    unsigned char *data; /* base + GUARD + offset */
    size_t bytes;
} guarded_t;

static guarded_t guarded_alloc(size_t bytes, size_t offset)
{
    guarded_t g;
    g.base = malloc(bytes + offset + 2 * GUARD);
    assert_non_null(g.base);
    memset(g.base, GUARD_BYTE, bytes + offset + 2 * GUARD);
    g.data = g.base + GUARD + offset;
    g.bytes = bytes;
    return g;
}

static void guarded_check(const guarded_t *g)
{
    for (const unsigned char *p = g->base; p < g->data; p++)
        assert_int_equal(*p, GUARD_BYTE);
    for (size_t i = 0; i < GUARD; i++)
        assert_int_equal(g->data[g->bytes + i], GUARD_BYTE);
}

/* ---- running on a given path */

static void use_path(ps_reduce_path_t path)
{
    assert_int_equal(ps_reduce_set_path(path), 0);
    assert_int_equal(ps_reduce_get_path(), path);
}

static int path_or_skip(ps_reduce_path_t path)
{
    if (!ps_reduce_path_supported(path)) {
        print_message("SKIPPED: path %s not supported by this CPU or build\n",
                      ps_reduce_path_name(path));
        return 0;
    }
    return 1;
}

static ps_reduce_path_t best_path(void)
{
    ps_reduce_path_t best = PS_PATH_SCALAR;
    for (int p = 0; p < PS_PATH_COUNT; p++)
        if (ps_reduce_path_supported((ps_reduce_path_t)p))
            best = (ps_reduce_path_t)p;
    return best;
}

/* Fails with the first differing element (printed), so that a mismatch is readable. */
static void assert_same_bytes(const void *got, const void *want, size_t n, ps_dtype_t dt,
                              const char *what)
{
    if (!test_data_same(got, want, n, dt, what))
        fail_msg("%s: the %s results differ (the first difference is above)", what,
                 ps_dtype_name(dt));
}

/* ---- per-dtype random sources, made once per test and sliced by every case */

typedef struct sources {
    ps_dtype_t dtype;
    size_t n;
    void *src[MAX_SRCS];
} sources_t;

static void sources_make(sources_t *s, ps_dtype_t dt, size_t n)
{
    s->dtype = dt;
    s->n = n;
    for (int k = 0; k < MAX_SRCS; k++) {
        s->src[k] = malloc(n * ps_dtype_size(dt));
        assert_non_null(s->src[k]);
        /* After the first, 1 in 8 elements as the first's: ties, where MIN/MAX's order shows. */
        test_data_fill(dt, s->src[k], k > 0 ? s->src[0] : NULL, n);
    }
}

static void sources_free(sources_t *s)
{
    for (int k = 0; k < MAX_SRCS; k++)
        free(s->src[k]);
}

/* BIG_COUNT sources per dtype, made on first use and shared by every path test: making them
 * dominates the run time under sanitizers. Freed by free_big_sources after the group. */
static sources_t big_cache[PS_DTYPE_COUNT];
static int big_cached[PS_DTYPE_COUNT];

static const sources_t *big_sources(ps_dtype_t dt)
{
    if (!big_cached[dt]) {
        sources_make(&big_cache[dt], dt, BIG_COUNT);
        big_cached[dt] = 1;
    }
    return &big_cache[dt];
}

static int free_big_sources(void **state)
{
    (void)state;
    for (int d = 0; d < PS_DTYPE_COUNT; d++)
        if (big_cached[d]) {
            sources_free(&big_cache[d]);
            big_cached[d] = 0;
        }
    return 0;
}

/* Byte offsets (dst, src) that cover aligned, whole-element and odd-byte misalignment. */
typedef struct offsets {
    size_t dst_elems, dst_bytes, src_elems, src_bytes;
} offsets_t;

static const offsets_t case_offsets[] = {
    {0, 0, 0, 0}, {1, 0, 2, 0}, {3, 0, 1, 0}, {2, 0, 0, 0},
    {0, 1, 0, 3}, {1, 3, 0, 5}, {0, 7, 3, 1},
};
#define N_OFFSETS (sizeof case_offsets / sizeof case_offsets[0])

static size_t off_bytes(size_t elems, size_t bytes, size_t size)
{
    return elems * size + bytes;
}

/*
 * ps_reduce on path against ps_reduce on scalar for n elements at the given
 * offsets: same bytes in dst, nothing written outside it.
 */
static void reduce_case(ps_reduce_path_t path, ps_op_t op, const sources_t *s, size_t n,
                        const offsets_t *o)
{
    ps_dtype_t dt = s->dtype;
    size_t size = ps_dtype_size(dt), bytes = n * size;
    size_t doff = off_bytes(o->dst_elems, o->dst_bytes, size);
    size_t soff = off_bytes(o->src_elems, o->src_bytes, size);
    guarded_t want = guarded_alloc(bytes, doff), got = guarded_alloc(bytes, doff);
    guarded_t src = guarded_alloc(bytes, soff);
    memcpy(want.data, s->src[0], bytes);
    memcpy(got.data, s->src[0], bytes);
    memcpy(src.data, s->src[1], bytes);

    use_path(PS_PATH_SCALAR);
    assert_int_equal(ps_reduce(op, dt, want.data, src.data, n), 0);
    use_path(path);
    assert_int_equal(ps_reduce(op, dt, got.data, src.data, n), 0);

    char what[128];
    snprintf(what, sizeof what, "%s %s n=%zu doff=%zu soff=%zu", ps_reduce_path_name(path),
             ps_op_name(op), n, doff, soff);
    assert_same_bytes(got.data, want.data, n, dt, what);
    guarded_check(&got);
    guarded_check(&src);
    free(want.base);
    free(got.base);
    free(src.base);
}

/* dst == src, the one overlap ps_reduce allows. */
static void reduce_inplace_case(ps_reduce_path_t path, ps_op_t op, const sources_t *s, size_t n)
{
    size_t bytes = n * ps_dtype_size(s->dtype);
    guarded_t want = guarded_alloc(bytes, 0), got = guarded_alloc(bytes, 0);
    memcpy(want.data, s->src[2], bytes);
    memcpy(got.data, s->src[2], bytes);
    use_path(PS_PATH_SCALAR);
    assert_int_equal(ps_reduce(op, s->dtype, want.data, want.data, n), 0);
    use_path(path);
    assert_int_equal(ps_reduce(op, s->dtype, got.data, got.data, n), 0);
    assert_same_bytes(got.data, want.data, n, s->dtype, "in-place");
    guarded_check(&got);
    free(want.base);
    free(got.base);
}

static const size_t small_counts[] = {0, 1, 7, 15, 31, 63, 64, 65, 127, 129, 1000};
#define N_SMALL (sizeof small_counts / sizeof small_counts[0])

static void reduce_path_vs_scalar(ps_reduce_path_t path)
{
    for (size_t d = 0; d < N_DTYPES; d++) {
        const sources_t *s = big_sources(all_dtypes[d]);
        for (size_t o = 0; o < N_OPS; o++) {
            ps_op_t op = all_ops[o];
            if (ps_op_check(op, s->dtype) != 0)
                continue;
            for (size_t c = 0; c < N_SMALL; c++)
                for (size_t k = 0; k < N_OFFSETS; k++)
                    reduce_case(path, op, s, small_counts[c], &case_offsets[k]);
            reduce_case(path, op, s, BIG_COUNT, &case_offsets[5]);
            reduce_inplace_case(path, op, s, 1000);
        }
    }
}

/*
 * ps_reduce_multi on path against scalar, with nsrc 1..MAX_SRCS, dst either
 * aliasing srcs[0] or separate and misaligned.
 */
static void multi_case(ps_reduce_path_t path, ps_op_t op, const sources_t *s, size_t nsrc, size_t n,
                       int in_place)
{
    ps_dtype_t dt = s->dtype;
    size_t size = ps_dtype_size(dt), bytes = n * size;
    guarded_t want = guarded_alloc(bytes, in_place ? 0 : 3);
    guarded_t got = guarded_alloc(bytes, in_place ? 0 : 3);
    guarded_t first = guarded_alloc(bytes, 1);
    memcpy(first.data, s->src[0], bytes);
    memcpy(want.data, s->src[0], bytes);
    memcpy(got.data, s->src[0], bytes);
    const void *srcs[MAX_SRCS];
    for (size_t k = 1; k < nsrc; k++)
        srcs[k] = s->src[k];

    use_path(PS_PATH_SCALAR);
    srcs[0] = in_place ? want.data : first.data;
    assert_int_equal(ps_reduce_multi(op, dt, want.data, srcs, nsrc, n), 0);
    use_path(path);
    srcs[0] = in_place ? got.data : first.data;
    assert_int_equal(ps_reduce_multi(op, dt, got.data, srcs, nsrc, n), 0);

    char what[128];
    snprintf(what, sizeof what, "multi %s %s nsrc=%zu n=%zu in_place=%d", ps_reduce_path_name(path),
             ps_op_name(op), nsrc, n, in_place);
    assert_same_bytes(got.data, want.data, n, dt, what);
    guarded_check(&got);
    free(want.base);
    free(got.base);
    free(first.base);
}

static void multi_path_vs_scalar(ps_reduce_path_t path)
{
    static const size_t counts[] = {0, 1, 7, 63, 64, 1000};
    for (size_t d = 0; d < N_DTYPES; d++) {
        const sources_t *s = big_sources(all_dtypes[d]);
        for (size_t o = 0; o < N_OPS; o++) {
            ps_op_t op = all_ops[o];
            if (ps_op_check(op, s->dtype) != 0)
                continue;
            for (size_t nsrc = 1; nsrc <= MAX_SRCS; nsrc++)
                for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
                    multi_case(path, op, s, nsrc, counts[c], 0);
                    multi_case(path, op, s, nsrc, counts[c], 1);
                }
            multi_case(path, op, s, 3, BIG_COUNT, 0);
        }
    }
}

static void scale_path_vs_scalar(ps_reduce_path_t path)
{
    static const uint64_t divisors[] = {1, 2, 3, 7, 1000003, (1ull << 40) + 1, UINT64_MAX};
    static const size_t counts[] = {0, 1, 7, 63, 64, 1000, BIG_COUNT};
    /* The big count with every divisor adds time, not coverage: the divisor is a broadcast. */
    for (size_t d = 0; d < N_DTYPES; d++) {
        ps_dtype_t dt = all_dtypes[d];
        if (!is_float(dt))
            continue;
        const sources_t *s = big_sources(dt);
        size_t size = ps_dtype_size(dt);
        for (size_t v = 0; v < sizeof divisors / sizeof divisors[0]; v++)
            for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
                size_t n = counts[c];
                if (n == BIG_COUNT && v % 3 != 0)
                    continue;
                guarded_t want = guarded_alloc(n * size, 2), got = guarded_alloc(n * size, 2);
                memcpy(want.data, s->src[0], n * size);
                memcpy(got.data, s->src[0], n * size);
                use_path(PS_PATH_SCALAR);
                assert_int_equal(ps_reduce_scale(dt, want.data, n, divisors[v]), 0);
                use_path(path);
                assert_int_equal(ps_reduce_scale(dt, got.data, n, divisors[v]), 0);
                assert_same_bytes(got.data, want.data, n, dt, "scale");
                guarded_check(&got);
                free(want.base);
                free(got.base);
            }
    }
}

static void test_avx2_reduce_matches_scalar(void **state)
{
    (void)state;
    if (!path_or_skip(PS_PATH_AVX2))
        skip();
    reduce_path_vs_scalar(PS_PATH_AVX2);
}

static void test_avx512_reduce_matches_scalar(void **state)
{
    (void)state;
    if (!path_or_skip(PS_PATH_AVX512))
        skip();
    reduce_path_vs_scalar(PS_PATH_AVX512);
}

static void test_avx2_multi_matches_scalar(void **state)
{
    (void)state;
    if (!path_or_skip(PS_PATH_AVX2))
        skip();
    multi_path_vs_scalar(PS_PATH_AVX2);
}

static void test_avx512_multi_matches_scalar(void **state)
{
    (void)state;
    if (!path_or_skip(PS_PATH_AVX512))
        skip();
    multi_path_vs_scalar(PS_PATH_AVX512);
}

static void test_avx2_scale_matches_scalar(void **state)
{
    (void)state;
    if (!path_or_skip(PS_PATH_AVX2))
        skip();
    scale_path_vs_scalar(PS_PATH_AVX2);
}

static void test_avx512_scale_matches_scalar(void **state)
{
    (void)state;
    if (!path_or_skip(PS_PATH_AVX512))
        skip();
    scale_path_vs_scalar(PS_PATH_AVX512);
}

/* ---- the reference itself against hand-computed values, on every path */

/*
 * Runs dst = a op b for n hand-checked elements on every supported path.
 * The case is tiled to 200 elements so that SIMD lanes (not only the scalar
 * tail) see every value; want[i % n] must come out at every i.
 */
static void known_case(ps_op_t op, ps_dtype_t dt, const void *a, const void *b, const void *want,
                       size_t n)
{
    enum { TILED = 200 };
    size_t size = ps_dtype_size(dt);
    unsigned char ta[TILED * 8], tb[TILED * 8], tw[TILED * 8];
    for (size_t i = 0; i < TILED; i++) {
        memcpy(ta + i * size, (const unsigned char *)a + (i % n) * size, size);
        memcpy(tb + i * size, (const unsigned char *)b + (i % n) * size, size);
        memcpy(tw + i * size, (const unsigned char *)want + (i % n) * size, size);
    }
    for (int p = 0; p < PS_PATH_COUNT; p++) {
        if (!ps_reduce_path_supported((ps_reduce_path_t)p))
            continue;
        use_path((ps_reduce_path_t)p);
        unsigned char got[TILED * 8];
        memcpy(got, ta, TILED * size);
        assert_int_equal(ps_reduce(op, dt, got, tb, TILED), 0);
        char what[64];
        snprintf(what, sizeof what, "known %s %s", ps_reduce_path_name((ps_reduce_path_t)p),
                 ps_op_name(op));
        assert_same_bytes(got, tw, TILED, dt, what);
    }
}

/* KNOWN(op, dtype, C type, n, {{a...}, {b...}, {want...}}) with n values per row. */
#define KNOWN(op, dt, T, n, ...)                                                                   \
    do {                                                                                           \
        const T k_[3][n] = __VA_ARGS__;                                                            \
        known_case(op, dt, k_[0], k_[1], k_[2], n);                                                \
    } while (0)

static void test_known_integer_values(void **state)
{
    (void)state;
    /* rows: a, b, want */
    KNOWN(PS_SUM, PS_INT8, int8_t, 4, {{127, -128, 100, -1}, {1, -1, 100, 1}, {-128, 127, -56, 0}});
    KNOWN(PS_SUM, PS_INT32, int32_t, 3,
          {{INT32_MAX, INT32_MIN, -7}, {1, -1, 3}, {INT32_MIN, INT32_MAX, -4}});
    KNOWN(PS_SUM, PS_UINT8, uint8_t, 3, {{255, 200, 0}, {1, 100, 0}, {0, 44, 0}});
    KNOWN(PS_PRODUCT, PS_UINT8, uint8_t, 3, {{16, 255, 3}, {16, 255, 7}, {0, 1, 21}});
    KNOWN(PS_PRODUCT, PS_INT8, int8_t, 3, {{-128, 16, -3}, {-1, 8, 5}, {-128, -128, -15}});
    KNOWN(PS_PRODUCT, PS_INT16, int16_t, 3,
          {{-32768, 300, -1}, {-1, 300, -32768}, {-32768, 24464, -32768}});
    KNOWN(PS_PRODUCT, PS_INT32, int32_t, 3,
          {{65536, -3, INT32_MIN}, {65536, 5, -1}, {0, -15, INT32_MIN}});
    KNOWN(
        PS_PRODUCT, PS_INT64, int64_t, 3,
        {{INT64_MIN, 0x100000001ll, -3}, {-1, 0x100000001ll, 7}, {INT64_MIN, 0x200000001ll, -21}});
    KNOWN(PS_SUM, PS_INT64, int64_t, 2, {{INT64_MAX, -5}, {1, 2}, {INT64_MIN, -3}});
    KNOWN(PS_MIN, PS_INT32, int32_t, 3, {{-5, 7, 0}, {3, 7, -1}, {-5, 7, -1}});
    KNOWN(PS_MAX, PS_INT32, int32_t, 3, {{-5, 7, 0}, {3, 7, -1}, {3, 7, 0}});
    /* unsigned compare: 200 > 100 (a signed compare would say otherwise) */
    KNOWN(PS_MIN, PS_UINT8, uint8_t, 3, {{200, 1, 128}, {100, 255, 127}, {100, 1, 127}});
    KNOWN(PS_MAX, PS_UINT8, uint8_t, 3, {{200, 1, 128}, {100, 255, 127}, {200, 255, 128}});
    KNOWN(PS_MIN, PS_INT8, int8_t, 3, {{-128, 1, 127}, {127, -1, -128}, {-128, -1, -128}});
    KNOWN(PS_MAX, PS_INT16, int16_t, 2, {{-32768, 1}, {32767, -1}, {32767, 1}});
    KNOWN(PS_MIN, PS_INT64, int64_t, 3,
          {{INT64_MIN, 5, -1}, {INT64_MAX, -5, 0}, {INT64_MIN, -5, -1}});
    KNOWN(PS_MAX, PS_INT64, int64_t, 3,
          {{INT64_MIN, 5, -1}, {INT64_MAX, -5, 0}, {INT64_MAX, 5, 0}});
    KNOWN(PS_BAND, PS_INT16, int16_t, 3,
          {{0x0F0F, -1, 0x7000}, {0x00FF, -32768, 0x1234}, {0x000F, -32768, 0x1000}});
    KNOWN(PS_BOR, PS_INT16, int16_t, 3,
          {{0x0F0F, 0, 0x7000}, {0x00FF, -32768, 0x1234}, {0x0FFF, -32768, 0x7234}});
    KNOWN(PS_BXOR, PS_INT16, int16_t, 3,
          {{0x0F0F, -1, 0x7000}, {0x00FF, -32768, 0x1234}, {0x0FF0, 0x7FFF, 0x6234}});
    KNOWN(PS_BXOR, PS_UINT8, uint8_t, 2, {{0xF0, 0xFF}, {0x3C, 0xFF}, {0xCC, 0x00}});
    KNOWN(PS_BAND, PS_INT64, int64_t, 2,
          {{-1, 0x0123456789ABCDEFll},
           {INT64_MIN, 0x00FF00FF00FF00FFll},
           {INT64_MIN, 0x0023006700AB00EFll}});
}

static void test_known_bool_values(void **state)
{
    (void)state;
    /* Any nonzero byte is true and results are 0/1: 2 AND 3 is 1, not 2 & 3 = 2. */
    static const uint8_t a[] = {0, 1, 2, 0x80, 0, 0xFF};
    static const uint8_t b[] = {0, 0, 3, 0, 0xFF, 0x01};
    static const uint8_t or_[] = {0, 1, 1, 1, 1, 1};
    static const uint8_t and_[] = {0, 0, 1, 0, 0, 1};
    static const uint8_t xor_[] = {0, 1, 0, 1, 1, 0};
    known_case(PS_SUM, PS_BOOL, a, b, or_, 6);
    known_case(PS_MAX, PS_BOOL, a, b, or_, 6);
    known_case(PS_BOR, PS_BOOL, a, b, or_, 6);
    known_case(PS_PRODUCT, PS_BOOL, a, b, and_, 6);
    known_case(PS_MIN, PS_BOOL, a, b, and_, 6);
    known_case(PS_BAND, PS_BOOL, a, b, and_, 6);
    known_case(PS_BXOR, PS_BOOL, a, b, xor_, 6);
}

static void test_known_float_values(void **state)
{
    (void)state;
    const uint32_t CNAN = PS_F32_CANONICAL_NAN;
    /* SUM: exact sums, -0 + -0 = -0, Inf - Inf and NaN + 1 give the canonical NaN. */
    KNOWN(PS_SUM, PS_FLOAT32, uint32_t, 6,
          {{0x3FC00000 /* 1.5 */, 0x80000000, 0x7F800000, 0x7FA00001, 0x00000001, 0x7F7FFFFF},
           {0x40100000 /* 2.25 */, 0x80000000, 0xFF800000, 0x3F800000, 0x00000001, 0x7F7FFFFF},
           {0x40700000 /* 3.75 */, 0x80000000, CNAN, CNAN, 0x00000002, 0x7F800000}});
    /* AVG through ps_reduce is a plain sum. */
    KNOWN(PS_AVG, PS_FLOAT32, uint32_t, 2,
          {{0x3FC00000, 0xFFC00001}, {0x40100000, 0x3F800000}, {0x40700000, CNAN}});
    KNOWN(PS_PRODUCT, PS_FLOAT32, uint32_t, 4,
          {{0x40400000 /* 3 */, 0x00000000, 0x7F7FFFFF, 0xBF800000},
           {0x3F000000 /* .5 */, 0x7F800000, 0x40000000, 0x00000000},
           {0x3FC00000 /* 1.5 */, CNAN, 0x7F800000, 0x80000000}});
    /* MIN/MAX: a NaN in a wins with its own bits, then a NaN in b; ties (+0/-0) keep a. */
    KNOWN(PS_MIN, PS_FLOAT32, uint32_t, 7,
          {{0x7FC00123, 0x3F800000, 0x00000000, 0x80000000, 0x40000000, 0xFF800000, 0x7F800001},
           {0x3F800000, 0xFFC00456, 0x80000000, 0x00000000, 0x3F800000, 0x3F800000, 0xFFC00000},
           {0x7FC00123, 0xFFC00456, 0x00000000, 0x80000000, 0x3F800000, 0xFF800000, 0x7F800001}});
    KNOWN(PS_MAX, PS_FLOAT32, uint32_t, 7,
          {{0x7FC00123, 0x3F800000, 0x00000000, 0x80000000, 0x40000000, 0xFF800000, 0x3F800000},
           {0x3F800000, 0xFFC00456, 0x80000000, 0x00000000, 0x3F800000, 0x3F800000, 0x7F800001},
           {0x7FC00123, 0xFFC00456, 0x00000000, 0x80000000, 0x40000000, 0x3F800000, 0x7F800001}});
    const uint64_t DNAN = PS_F64_CANONICAL_NAN;
    KNOWN(
        PS_PRODUCT, PS_FLOAT64, uint64_t, 3,
        {{0x4008000000000000ull /* 3 */, 0x7E37E43C8800759Cull /* 1e300 */, 0x0000000000000000ull},
         {0x3FE0000000000000ull /* .5 */, 0x7E37E43C8800759Cull, 0xFFF0000000000000ull},
         {0x3FF8000000000000ull /* 1.5 */, 0x7FF0000000000000ull, DNAN}});
    KNOWN(PS_MIN, PS_FLOAT64, uint64_t, 3,
          {{0x0000000000000000ull, 0x7FF0000000000001ull, 0x3FF0000000000000ull},
           {0x8000000000000000ull, 0x3FF0000000000000ull, 0xFFF8000000000001ull},
           {0x0000000000000000ull, 0x7FF0000000000001ull, 0xFFF8000000000001ull}});
    KNOWN(PS_MAX, PS_FLOAT64, uint64_t, 2,
          {{0x8000000000000000ull, 0x4000000000000000ull},
           {0x0000000000000000ull, 0x4000000000000001ull},
           {0x8000000000000000ull, 0x4000000000000001ull}});
}

static void test_known_half_values(void **state)
{
    (void)state;
    /* float16: 1 + 2^-11 is a tie and stays at even 1.0 (0x3C00); (1 + 2^-10) + 2^-11 ties up
     * to even 0x3C02; 65504 + 65504 overflows to Inf; a NaN comes out as 0x7E00. */
    KNOWN(PS_SUM, PS_FLOAT16, uint16_t, 6,
          {{0x3C00, 0x3C01, 0x7BFF, 0xFE01, 0x8000, 0x0001},
           {0x1000, 0x1000, 0x7BFF, 0x3C00, 0x8000, 0x8001},
           {0x3C00, 0x3C02, 0x7C00, 0x7E00, 0x8000, 0x0000}});
    /* Subnormal results: 2^-24 * 0.5 = 2^-25 is a tie to 0; 3 * 2^-24 * 0.5 ties to even 2. */
    KNOWN(PS_PRODUCT, PS_FLOAT16, uint16_t, 4,
          {{0x0001, 0x0003, 0x0005, 0x7C00},
           {0x3800, 0x3800, 0x3800, 0x0000},
           {0x0000, 0x0002, 0x0002, 0x7E00}});
    /* MIN/MAX select, but any NaN leaves as the canonical 0x7E00. */
    KNOWN(PS_MIN, PS_FLOAT16, uint16_t, 4,
          {{0x7C01, 0x3C00, 0x0000, 0xBC00},
           {0x3C00, 0xFD00, 0x8000, 0x3C00},
           {0x7E00, 0x7E00, 0x0000, 0xBC00}});
    KNOWN(PS_MAX, PS_FLOAT16, uint16_t, 3,
          {{0x3C00, 0x8000, 0xBC00}, {0x7D00, 0x0000, 0x3C00}, {0x7E00, 0x8000, 0x3C00}});
    /* bfloat16: 1 + 2^-8 ties to even 1.0; (1 + 2^-7) + 2^-8 ties up to 0x3F82; max + max = Inf;
     * the smallest subnormal doubled stays exact (no flush to zero). */
    KNOWN(PS_SUM, PS_BFLOAT16, uint16_t, 5,
          {{0x3F80, 0x3F81, 0x7F7F, 0x0001, 0x7F81},
           {0x3B80, 0x3B80, 0x7F7F, 0x0001, 0x3F80},
           {0x3F80, 0x3F82, 0x7F80, 0x0002, 0x7FC0}});
    KNOWN(PS_PRODUCT, PS_BFLOAT16, uint16_t, 3,
          {{0x0080, 0x4040, 0xFF80}, {0x3F00, 0x4040, 0x0000}, {0x0040, 0x4110, 0x7FC0}});
    KNOWN(PS_MIN, PS_BFLOAT16, uint16_t, 3,
          {{0x0000, 0xFFC1, 0x4000}, {0x8000, 0x3F80, 0x3F80}, {0x0000, 0x7FC0, 0x3F80}});
}

/* ---- conversions, with known bit patterns */

static void test_f16_conversion_known(void **state)
{
    (void)state;
    static const uint32_t to_half[][2] = {
        {0x3F800000, 0x3C00}, /* 1 */
        {0x477FE000, 0x7BFF}, /* 65504, the largest finite */
        {0x477FEFFF, 0x7BFF}, /* just below the tie with 65536 */
        {0x477FF000, 0x7C00}, /* 65520: tie, 0x7BFF is odd, rounds up to Inf */
        {0x7F800000, 0x7C00}, {0xFF800000, 0xFC00},
        {0x80000000, 0x8000}, {0x38800000, 0x0400}, /* 2^-14, the smallest normal */
        {0x387FC000, 0x03FF},                       /* the largest subnormal */
        {0x387FE000, 0x0400},                       /* tie between 0x3FF and 0x400: to even */
        {0x33800000, 0x0001},                       /* 2^-24, the smallest subnormal */
        {0x33000000, 0x0000},                       /* 2^-25: tie with zero, to even zero */
        {0x33000001, 0x0001}, {0xB3000001, 0x8001},
        {0x33C00000, 0x0002}, /* 1.5 * 2^-24: tie, to even 2 */
        {0x34200000, 0x0002}, /* 2.5 * 2^-24: tie, to even 2 */
        {0x3F801000, 0x3C00}, /* 1 + 2^-11: tie, to even */
        {0x3F803000, 0x3C02}, /* 1 + 3 * 2^-11: tie, to even */
        {0x3F801001, 0x3C01}, {0x00000001, 0x0000},
        {0x80000001, 0x8000}, {0x7FC00000, 0x7E00},
        {0xFFC00001, 0x7E00}, {0x7F800001, 0x7E00},
    };
    for (size_t i = 0; i < sizeof to_half / sizeof to_half[0]; i++) {
        uint16_t got = ps_f32_to_f16(ps_f32_from_bits(to_half[i][0]));
        if (got != to_half[i][1])
            fail_msg("f32 0x%08x -> f16 0x%04x, want 0x%04x", to_half[i][0], got, to_half[i][1]);
    }
    static const uint32_t from_half[][2] = {
        {0x0001, 0x33800000}, {0x03FF, 0x387FC000}, {0x0400, 0x38800000}, {0x7BFF, 0x477FE000},
        {0x7C00, 0x7F800000}, {0xFC00, 0xFF800000}, {0x8000, 0x80000000}, {0x3C00, 0x3F800000},
        {0x8001, 0xB3800000}, {0x7E00, 0x7FC00000}, {0x7C01, 0x7FC02000}, /* quieted */
    };
    for (size_t i = 0; i < sizeof from_half / sizeof from_half[0]; i++) {
        uint32_t got = ps_f32_bits(ps_f16_to_f32((uint16_t)from_half[i][0]));
        if (got != from_half[i][1])
            fail_msg("f16 0x%04x -> f32 0x%08x, want 0x%08x", from_half[i][0], got,
                     from_half[i][1]);
    }
    /* Every non-NaN float16 survives the round trip. */
    for (uint32_t h = 0; h < 0x10000; h++) {
        if ((h & 0x7C00) == 0x7C00 && (h & 0x3FF) != 0)
            continue;
        assert_int_equal(ps_f32_to_f16(ps_f16_to_f32((uint16_t)h)), h);
    }
}

static void test_bf16_conversion_known(void **state)
{
    (void)state;
    static const uint32_t to_bf16[][2] = {
        {0x3F800000, 0x3F80}, {0x3F808000, 0x3F80},                       /* tie, 0x3F80 is even */
        {0x3F818000, 0x3F82},                                             /* tie, 0x3F81 is odd */
        {0x3F808001, 0x3F81}, {0x7F7F7FFF, 0x7F7F}, {0x7F7F8000, 0x7F80}, /* tie at the top: Inf */
        {0x7F7FFFFF, 0x7F80}, {0x7F800000, 0x7F80}, {0xFF800000, 0xFF80},
        {0x00008000, 0x0000}, /* subnormal tie to even zero, not flushed */
        {0x00018000, 0x0002}, {0x00008001, 0x0001}, {0x807FFFFF, 0x8080},
        {0x7F800001, 0x7FC0}, /* a NaN that plain rounding would turn into Inf */
        {0xFFFFFFFF, 0x7FC0}, {0x7FC00000, 0x7FC0},
    };
    for (size_t i = 0; i < sizeof to_bf16 / sizeof to_bf16[0]; i++) {
        uint16_t got = ps_f32_to_bf16(ps_f32_from_bits(to_bf16[i][0]));
        if (got != to_bf16[i][1])
            fail_msg("f32 0x%08x -> bf16 0x%04x, want 0x%04x", to_bf16[i][0], got, to_bf16[i][1]);
    }
    assert_int_equal(ps_f32_bits(ps_bf16_to_f32(0x3F80)), 0x3F800000);
    assert_int_equal(ps_f32_bits(ps_bf16_to_f32(0x8001)), 0x80010000);
}

#ifdef __x86_64__
/* ps_f32_to_f16 against the F16C instruction over a spread of all 2^32 inputs. */
__attribute__((target("avx2,f16c"))) static unsigned long f16c_mismatches(uint32_t stride)
{
    unsigned long bad = 0;
    for (uint64_t u = 0; u <= 0xFFFFFFFFull; u += (uint64_t)stride * 8) {
        uint32_t in[8];
        uint16_t hw[8];
        for (int k = 0; k < 8; k++)
            in[k] = (uint32_t)(u + (uint64_t)k * stride);
        __m256 v = _mm256_loadu_ps((const float *)(const void *)in);
        _mm_storeu_si128((__m128i *)(void *)hw, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
        for (int k = 0; k < 8; k++) {
            float f = ps_f32_from_bits(in[k]);
            if (f == f && ps_f32_to_f16(f) != hw[k])
                bad++;
        }
    }
    return bad;
}
#endif

static void test_f16_conversion_matches_f16c(void **state)
{
    (void)state;
#ifdef __x86_64__
    /* The avx2 path requires AVX2 and F16C, the two extensions this check uses. */
    if (!ps_reduce_path_supported(PS_PATH_AVX2)) {
        print_message("SKIPPED: no AVX2 + F16C here\n");
        skip();
    }
    /* A stride of 127 samples 34M inputs in about a second under ASan; the full 2^32 sweep
     * (ps_f32_to_f16 == VCVTPS2PH for every non-NaN float) was run once by hand. */
    assert_int_equal(f16c_mismatches(127), 0);
#else
    print_message("SKIPPED: not x86-64\n");
    skip();
#endif
}

/* ---- ps_reduce_multi semantics */

/* For every dtype without a final rounding, one multi pass equals nsrc-1 ps_reduce calls. */
static void test_multi_matches_repeated_reduce(void **state)
{
    (void)state;
    enum { N = 4099, NSRC = 4 };
    for (int p = 0; p < PS_PATH_COUNT; p++) {
        if (!ps_reduce_path_supported((ps_reduce_path_t)p))
            continue;
        use_path((ps_reduce_path_t)p);
        for (size_t d = 0; d < N_DTYPES; d++) {
            ps_dtype_t dt = all_dtypes[d];
            if (dt == PS_FLOAT16 || dt == PS_BFLOAT16)
                continue; /* one rounding at the end: see test_multi_half_rounds_once */
            sources_t s;
            sources_make(&s, dt, N);
            size_t bytes = N * ps_dtype_size(dt);
            for (size_t o = 0; o < N_OPS; o++) {
                ps_op_t op = all_ops[o];
                if (ps_op_check(op, dt) != 0)
                    continue;
                unsigned char *multi = malloc(bytes), *seq = malloc(bytes);
                assert_non_null(multi);
                assert_non_null(seq);
                const void *srcs[NSRC] = {s.src[0], s.src[1], s.src[2], s.src[3]};
                assert_int_equal(ps_reduce_multi(op, dt, multi, srcs, NSRC, N), 0);
                memcpy(seq, s.src[0], bytes);
                for (int k = 1; k < NSRC; k++)
                    assert_int_equal(ps_reduce(op, dt, seq, s.src[k], N), 0);
                if (op == PS_AVG)
                    assert_int_equal(ps_reduce_scale(dt, seq, N, NSRC), 0);
                assert_same_bytes(multi, seq, N, dt, "multi vs repeated");
                free(multi);
                free(seq);
            }
            sources_free(&s);
        }
    }
}

/* An independent float32 accumulation for float16/bfloat16, written out here. */
static float half_to_float(ps_dtype_t dt, uint16_t h)
{
    return dt == PS_FLOAT16 ? ps_f16_to_f32(h) : ps_bf16_to_f32(h);
}

static uint16_t float_to_half(ps_dtype_t dt, float f)
{
    if (f != f)
        return dt == PS_FLOAT16 ? 0x7E00 : 0x7FC0;
    return dt == PS_FLOAT16 ? ps_f32_to_f16(f) : ps_f32_to_bf16(f);
}

static float hand_step(ps_op_t op, float acc, float x)
{
    switch (op) {
    case PS_SUM:
    case PS_AVG:
        return acc + x;
    case PS_PRODUCT:
        return acc * x;
    case PS_MIN:
        return acc != acc ? acc : x != x ? x : x < acc ? x : acc;
    case PS_MAX:
        return acc != acc ? acc : x != x ? x : x > acc ? x : acc;
    default:
        fail_msg("no float step for %s", ps_op_name(op));
    }
    return 0;
}

static void test_multi_half_rounds_once(void **state)
{
    (void)state;
    enum { N = 3001, NSRC = 5 };
    static const ps_dtype_t halves[] = {PS_FLOAT16, PS_BFLOAT16};
    static const ps_op_t ops[] = {PS_SUM, PS_PRODUCT, PS_MIN, PS_MAX, PS_AVG};
    for (int p = 0; p < PS_PATH_COUNT; p++) {
        if (!ps_reduce_path_supported((ps_reduce_path_t)p))
            continue;
        use_path((ps_reduce_path_t)p);
        for (size_t d = 0; d < 2; d++) {
            ps_dtype_t dt = halves[d];
            sources_t s;
            sources_make(&s, dt, N);
            const void *srcs[NSRC] = {s.src[0], s.src[1], s.src[2], s.src[3], s.src[4]};
            for (size_t o = 0; o < sizeof ops / sizeof ops[0]; o++) {
                uint16_t got[N], want[N];
                assert_int_equal(ps_reduce_multi(ops[o], dt, got, srcs, NSRC, N), 0);
                for (size_t i = 0; i < N; i++) {
                    float acc = half_to_float(dt, ((const uint16_t *)srcs[0])[i]);
                    for (int k = 1; k < NSRC; k++)
                        acc = hand_step(ops[o], acc,
                                        half_to_float(dt, ((const uint16_t *)srcs[k])[i]));
                    if (ops[o] == PS_AVG)
                        acc /= (float)NSRC;
                    want[i] = float_to_half(dt, acc);
                }
                assert_same_bytes(got, want, N, dt, "multi vs hand f32 accumulation");
            }
            sources_free(&s);
        }
    }
    /* The case that tells one rounding from several: 1 + 2^-11 + 2^-11 in float16 is
     * 1 + 2^-10 (0x3C01) when rounded once, but 1.0 when each step is rounded. */
    static const uint16_t one[1] = {0x3C00}, eps[1] = {0x1000};
    const void *srcs[3] = {one, eps, eps};
    uint16_t out[1];
    assert_int_equal(ps_reduce_multi(PS_SUM, PS_FLOAT16, out, srcs, 3, 1), 0);
    assert_int_equal(out[0], 0x3C01);
    static const uint16_t bone[1] = {0x3F80}, beps[1] = {0x3B80};
    const void *bsrcs[3] = {bone, beps, beps};
    assert_int_equal(ps_reduce_multi(PS_SUM, PS_BFLOAT16, out, bsrcs, 3, 1), 0);
    assert_int_equal(out[0], 0x3F81);
}

static void test_multi_avg_and_scale_known(void **state)
{
    (void)state;
    for (int p = 0; p < PS_PATH_COUNT; p++) {
        if (!ps_reduce_path_supported((ps_reduce_path_t)p))
            continue;
        use_path((ps_reduce_path_t)p);
        enum { N = 37 };
        float a[N], b[N], c[N], out[N];
        for (int i = 0; i < N; i++) {
            a[i] = 1.0f;
            b[i] = 2.0f;
            c[i] = 4.0f;
        }
        const void *srcs[3] = {a, b, c};
        assert_int_equal(ps_reduce_multi(PS_AVG, PS_FLOAT32, out, srcs, 3, N), 0);
        for (int i = 0; i < N; i++)
            assert_int_equal(ps_f32_bits(out[i]), ps_f32_bits(7.0f / 3.0f));
        /* In place: a becomes (a + b + c) / 3. */
        assert_int_equal(ps_reduce_multi(PS_AVG, PS_FLOAT32, a, srcs, 3, N), 0);
        assert_memory_equal(a, out, sizeof out);

        double x[N];
        for (int i = 0; i < N; i++)
            x[i] = 10.0;
        assert_int_equal(ps_reduce_scale(PS_FLOAT64, x, N, 4), 0);
        for (int i = 0; i < N; i++)
            assert_true(x[i] == 2.5);

        /* float16 AVG: (1 + 2 + 4) / 3 = 2.333.. rounds to 0x40AB; scale of 3.0 by 2 is 1.5. */
        uint16_t h1[N], h2[N], h4[N], hout[N];
        for (int i = 0; i < N; i++) {
            h1[i] = 0x3C00;
            h2[i] = 0x4000;
            h4[i] = 0x4400;
        }
        const void *hsrcs[3] = {h1, h2, h4};
        assert_int_equal(ps_reduce_multi(PS_AVG, PS_FLOAT16, hout, hsrcs, 3, N), 0);
        for (int i = 0; i < N; i++)
            assert_int_equal(hout[i], 0x40AB);
        for (int i = 0; i < N; i++)
            hout[i] = 0x4200;
        assert_int_equal(ps_reduce_scale(PS_FLOAT16, hout, N, 2), 0);
        for (int i = 0; i < N; i++)
            assert_int_equal(hout[i], 0x3E00);
        /* nsrc == 1 copies (and normalises bool to 0/1). */
        uint8_t bsrc[N], bout[N];
        for (int i = 0; i < N; i++)
            bsrc[i] = (uint8_t)(i * 37);
        const void *one[1] = {bsrc};
        assert_int_equal(ps_reduce_multi(PS_BXOR, PS_BOOL, bout, one, 1, N), 0);
        for (int i = 0; i < N; i++)
            assert_int_equal(bout[i], bsrc[i] != 0);
    }
}

/* ---- errors and argument checks */

static void test_names_and_op_check(void **state)
{
    (void)state;
    assert_string_equal(ps_strerror(0), "success");
    assert_string_equal(ps_strerror(PS_EINVAL), "invalid argument");
    for (int e = PS_EUNAUTH; e <= 0; e++)
        assert_non_null(ps_strerror(e));
    assert_string_equal(ps_strerror(-99), "unrecognised error code");
    assert_string_equal(ps_strerror(5), "unrecognised error code");

    static const size_t sizes[] = {4, 8, 2, 2, 1, 1, 2, 4, 8, 1};
    static const char *const names[] = {"float32", "float64", "float16", "bfloat16", "int8",
                                        "uint8",   "int16",   "int32",   "int64",    "bool"};
    for (int d = 0; d < PS_DTYPE_COUNT; d++) {
        assert_int_equal(ps_dtype_size((ps_dtype_t)d), sizes[d]);
        assert_string_equal(ps_dtype_name((ps_dtype_t)d), names[d]);
    }
    assert_int_equal(ps_dtype_size(PS_DTYPE_COUNT), 0);
    assert_int_equal(ps_dtype_size((ps_dtype_t)-1), 0);
    assert_string_equal(ps_dtype_name((ps_dtype_t)-1), "invalid");
    assert_string_equal(ps_op_name(PS_BXOR), "BXOR");
    assert_string_equal(ps_op_name(PS_AVG), "AVG");
    assert_string_equal(ps_op_name(PS_OP_COUNT), "INVALID");

    int valid = 0;
    for (int o = 0; o < PS_OP_COUNT; o++)
        for (int d = 0; d < PS_DTYPE_COUNT; d++) {
            ps_op_t op = (ps_op_t)o;
            ps_dtype_t dt = (ps_dtype_t)d;
            int bitwise = op == PS_BAND || op == PS_BOR || op == PS_BXOR;
            int want_ok = is_float(dt) ? !bitwise : op != PS_AVG;
            assert_int_equal(ps_op_check(op, dt), want_ok ? 0 : PS_EINVAL);
            valid += want_ok;
        }
    assert_int_equal(valid, 62);
    assert_int_equal(ps_op_check(PS_OP_COUNT, PS_FLOAT32), PS_EINVAL);
    assert_int_equal(ps_op_check((ps_op_t)-1, PS_FLOAT32), PS_EINVAL);
    assert_int_equal(ps_op_check(PS_SUM, PS_DTYPE_COUNT), PS_EINVAL);
    assert_int_equal(ps_op_check(PS_SUM, (ps_dtype_t)-7), PS_EINVAL);
}

static void test_reduce_errors(void **state)
{
    (void)state;
    float buf[16], src[16], copy[16];
    for (int i = 0; i < 16; i++) {
        buf[i] = (float)i;
        src[i] = 1.0f;
    }
    memcpy(copy, buf, sizeof buf);
    /* invalid pairs leave dst untouched */
    assert_int_equal(ps_reduce(PS_BAND, PS_FLOAT32, buf, src, 16), PS_EINVAL);
    assert_int_equal(ps_reduce(PS_BXOR, PS_BFLOAT16, buf, src, 16), PS_EINVAL);
    assert_int_equal(ps_reduce(PS_AVG, PS_INT32, buf, src, 16), PS_EINVAL);
    assert_int_equal(ps_reduce(PS_AVG, PS_BOOL, buf, src, 16), PS_EINVAL);
    assert_int_equal(ps_reduce((ps_op_t)99, PS_INT32, buf, src, 16), PS_EINVAL);
    assert_int_equal(ps_reduce(PS_SUM, (ps_dtype_t)99, buf, src, 16), PS_EINVAL);
    /* NULL with elements */
    assert_int_equal(ps_reduce(PS_SUM, PS_FLOAT32, NULL, src, 16), PS_EINVAL);
    assert_int_equal(ps_reduce(PS_SUM, PS_FLOAT32, buf, NULL, 16), PS_EINVAL);
    /* partial overlaps, by elements and by bytes, in both directions */
    assert_int_equal(ps_reduce(PS_SUM, PS_FLOAT32, buf, buf + 1, 8), PS_EINVAL);
    assert_int_equal(ps_reduce(PS_SUM, PS_FLOAT32, buf + 7, buf, 8), PS_EINVAL);
    assert_int_equal(ps_reduce(PS_SUM, PS_FLOAT32, buf, (unsigned char *)buf + 1, 8), PS_EINVAL);
    /* a count whose byte size overflows */
    assert_int_equal(ps_reduce(PS_SUM, PS_FLOAT32, buf, src, SIZE_MAX / 2), PS_EINVAL);
    assert_memory_equal(buf, copy, sizeof buf);

    /* allowed: nothing to do, even with NULL; adjacent ranges; dst == src */
    assert_int_equal(ps_reduce(PS_SUM, PS_FLOAT32, NULL, NULL, 0), 0);
    assert_int_equal(ps_reduce(PS_SUM, PS_FLOAT32, buf, buf + 8, 8), 0);
    assert_true(buf[0] == 8.0f && buf[7] == 22.0f && buf[8] == 8.0f);
    assert_int_equal(ps_reduce(PS_SUM, PS_FLOAT32, buf + 8, buf + 8, 8), 0);
    assert_true(buf[8] == 16.0f && buf[15] == 30.0f);
}

static void test_multi_and_scale_errors(void **state)
{
    (void)state;
    int32_t dst[8] = {0}, a[8] = {1, 1, 1, 1, 1, 1, 1, 1}, b[8] = {2, 2, 2, 2, 2, 2, 2, 2};
    const void *srcs[3] = {a, b, a};
    assert_int_equal(ps_reduce_multi(PS_SUM, PS_INT32, dst, srcs, 0, 8), PS_EINVAL);
    assert_int_equal(ps_reduce_multi(PS_SUM, PS_INT32, dst, NULL, 2, 8), PS_EINVAL);
    assert_int_equal(ps_reduce_multi(PS_SUM, PS_INT32, NULL, srcs, 2, 8), PS_EINVAL);
    assert_int_equal(ps_reduce_multi(PS_AVG, PS_INT32, dst, srcs, 2, 8), PS_EINVAL);
    assert_int_equal(ps_reduce_multi(PS_BOR, PS_FLOAT64, dst, srcs, 2, 4), PS_EINVAL);
    const void *with_null[2] = {a, NULL};
    assert_int_equal(ps_reduce_multi(PS_SUM, PS_INT32, dst, with_null, 2, 8), PS_EINVAL);
    /* dst may alias srcs[0] exactly, and nothing else */
    const void *dst_second[2] = {a, dst};
    assert_int_equal(ps_reduce_multi(PS_SUM, PS_INT32, dst, dst_second, 2, 8), PS_EINVAL);
    const void *dst_partial[2] = {dst + 1, b};
    assert_int_equal(ps_reduce_multi(PS_SUM, PS_INT32, dst, dst_partial, 2, 4), PS_EINVAL);
    const void *dst_partial2[2] = {a, (unsigned char *)dst + 2};
    assert_int_equal(ps_reduce_multi(PS_SUM, PS_INT32, dst, dst_partial2, 2, 4), PS_EINVAL);
    for (int i = 0; i < 8; i++)
        assert_int_equal(dst[i], 0);
    /* inputs may repeat (they are only read) */
    assert_int_equal(ps_reduce_multi(PS_SUM, PS_INT32, dst, srcs, 3, 8), 0);
    assert_int_equal(dst[7], 4);
    assert_int_equal(ps_reduce_multi(PS_SUM, PS_INT32, NULL, srcs, 3, 0), 0);

    float f[4] = {1, 2, 3, 4};
    assert_int_equal(ps_reduce_scale(PS_INT32, dst, 8, 2), PS_EINVAL);
    assert_int_equal(ps_reduce_scale(PS_BOOL, dst, 8, 2), PS_EINVAL);
    assert_int_equal(ps_reduce_scale(PS_FLOAT32, f, 4, 0), PS_EINVAL);
    assert_int_equal(ps_reduce_scale(PS_FLOAT32, NULL, 4, 2), PS_EINVAL);
    assert_int_equal(ps_reduce_scale((ps_dtype_t)42, f, 4, 2), PS_EINVAL);
    assert_int_equal(ps_reduce_scale(PS_FLOAT32, f, SIZE_MAX / 2, 2), PS_EINVAL);
    assert_true(f[3] == 4.0f);
    assert_int_equal(ps_reduce_scale(PS_FLOAT32, NULL, 0, 2), 0);
    assert_int_equal(ps_reduce_scale(PS_FLOAT32, f, 4, 2), 0);
    assert_true(f[0] == 0.5f && f[3] == 2.0f);
}

/* ---- path selection */

static void test_path_selection(void **state)
{
    (void)state;
    assert_string_equal(ps_reduce_path_name(PS_PATH_SCALAR), "scalar");
    assert_string_equal(ps_reduce_path_name(PS_PATH_AVX2), "avx2");
    assert_string_equal(ps_reduce_path_name(PS_PATH_AVX512), "avx512");
    assert_string_equal(ps_reduce_path_name(PS_PATH_COUNT), "invalid");
    assert_true(ps_reduce_path_supported(PS_PATH_SCALAR));
    assert_false(ps_reduce_path_supported(PS_PATH_COUNT));
    assert_false(ps_reduce_path_supported((ps_reduce_path_t)-1));
    assert_int_equal(ps_reduce_set_path(PS_PATH_COUNT), PS_ENOTSUP);
    for (int p = 0; p < PS_PATH_COUNT; p++) {
        ps_reduce_path_t path = (ps_reduce_path_t)p;
        if (ps_reduce_path_supported(path)) {
            use_path(path);
        } else {
            ps_reduce_path_t before = ps_reduce_get_path();
            assert_int_equal(ps_reduce_set_path(path), PS_ENOTSUP);
            assert_int_equal(ps_reduce_get_path(), before);
        }
    }
    print_message("best path here: %s\n", ps_reduce_path_name(best_path()));
}

/* Runs this binary with PARAMSYNC_REDUCE_PATH=value and returns the path name it reports. */
static void path_from_env(const char *value, char *out, size_t outlen)
{
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fds[1], STDOUT_FILENO);
    posix_spawn_file_actions_addclose(&fa, fds[0]);
    char env_var[64];
    snprintf(env_var, sizeof env_var, "PARAMSYNC_REDUCE_PATH=%s", value);
    char *child_env[] = {env_var, NULL};
    char *argv[] = {"test_reduce", "--print-path", NULL};
    pid_t pid;
    assert_int_equal(posix_spawn(&pid, "/proc/self/exe", &fa, NULL, argv, child_env), 0);
    posix_spawn_file_actions_destroy(&fa);
    close(fds[1]);
    ssize_t got = read(fds[0], out, outlen - 1);
    close(fds[0]);
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    assert_true(got > 0);
    out[got] = '\0';
    out[strcspn(out, "\n")] = '\0';
}

static void test_path_from_environment(void **state)
{
    (void)state;
    char name[32];
    for (int p = 0; p < PS_PATH_COUNT; p++) {
        ps_reduce_path_t path = (ps_reduce_path_t)p;
        path_from_env(ps_reduce_path_name(path), name, sizeof name);
        /* a path this CPU lacks is ignored: the best one stays */
        const char *want = ps_reduce_path_name(ps_reduce_path_supported(path) ? path : best_path());
        assert_string_equal(name, want);
    }
    path_from_env("no-such-path", name, sizeof name);
    assert_string_equal(name, ps_reduce_path_name(best_path()));
}

int main(int argc, char **argv)
{
    if (argc == 2 && strcmp(argv[1], "--print-path") == 0) {
        printf("%s\n", ps_reduce_path_name(ps_reduce_get_path()));
        return 0;
    }
    test_data_seed("test_reduce");
    /* `test_reduce NAME` runs the cases whose name matches NAME (cmocka glob). */
    if (argc == 2)
        cmocka_set_test_filter(argv[1]);

    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_names_and_op_check),
        cmocka_unit_test(test_f16_conversion_known),
        cmocka_unit_test(test_bf16_conversion_known),
        cmocka_unit_test(test_f16_conversion_matches_f16c),
        cmocka_unit_test(test_known_integer_values),
        cmocka_unit_test(test_known_bool_values),
        cmocka_unit_test(test_known_float_values),
        cmocka_unit_test(test_known_half_values),
        cmocka_unit_test(test_reduce_errors),
        cmocka_unit_test(test_multi_and_scale_errors),
        cmocka_unit_test(test_path_selection),
        cmocka_unit_test(test_path_from_environment),
        cmocka_unit_test(test_multi_matches_repeated_reduce),
        cmocka_unit_test(test_multi_half_rounds_once),
        cmocka_unit_test(test_multi_avg_and_scale_known),
        cmocka_unit_test(test_avx2_reduce_matches_scalar),
        cmocka_unit_test(test_avx512_reduce_matches_scalar),
        cmocka_unit_test(test_avx2_multi_matches_scalar),
        cmocka_unit_test(test_avx512_multi_matches_scalar),
        cmocka_unit_test(test_avx2_scale_matches_scalar),
        cmocka_unit_test(test_avx512_scale_matches_scalar),
    };
    return cmocka_run_group_tests(tests, NULL, free_big_sources);
}
