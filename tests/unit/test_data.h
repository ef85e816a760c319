/* Test data shared by the reduce/ and gpu/ tests: random elements of every dtype, rich in special
 * values. */
#ifndef PARAMSYNC_TEST_DATA_H
#define PARAMSYNC_TEST_DATA_H

/*
 * Plain C that also compiles as C++ (test_gpu_emulate.cu). Every function is
 * static inline so that each test uses what it needs without unused-function
 * warnings. The generator is deterministic: a test prints its seed, and
 * PS_TEST_SEED=<n> in the environment replays a failure.
 */

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <paramsync/common.h>

static uint64_t test_data_rng_state = 0x9E3779B97F4A7C15ull;

/* Seeds the generator from PS_TEST_SEED or the default, prints the seed and returns it. */
static inline uint64_t test_data_seed(const char *test)
{
    const char *env = getenv("PS_TEST_SEED");
    uint64_t seed = env != NULL ? strtoull(env, NULL, 0) : 0x5EEDull;
    test_data_rng_state = seed;
    printf("%s: seed %llu (PS_TEST_SEED to replay)\n", test, (unsigned long long)seed);
    return seed;
}

/* splitmix64: tiny, fast and good enough to make test data. */
static inline uint64_t test_data_rng(void)
{
    uint64_t z = (test_data_rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* NaNs with payloads and both signs, signalling NaNs, +-Inf, +-0, subnormals, extremes, +-1. */
static const uint32_t test_data_f32_specials[] = {
    0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000,
    0x7F800001, 0x7FA00001, 0xFFBFFFFF, 0x00000001, 0x807FFFFF, 0x00800000,
    0x7F7FFFFF, 0xFF7FFFFF, 0x3F800000, 0xBF800000, 0x4B000000, 0x477FF000,
};
static const uint64_t test_data_f64_specials[] = {
    0x0000000000000000ull, 0x8000000000000000ull, 0x7FF0000000000000ull, 0xFFF0000000000000ull,
    0x7FF8000000000000ull, 0xFFF8000000000000ull, 0x7FF0000000000001ull, 0x7FF4000000000123ull,
    0x0000000000000001ull, 0x800FFFFFFFFFFFFFull, 0x7FEFFFFFFFFFFFFFull, 0x3FF0000000000000ull,
};
static const uint16_t test_data_f16_specials[] = {
    0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x7C01, 0x7D23, 0x0001,
    0x83FF, 0x0400, 0x7BFF, 0xFBFF, 0x3C00, 0xBC00, 0x3C01, 0x1000,
};
static const uint16_t test_data_bf16_specials[] = {
    0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0x7FA3, 0x0001,
    0x807F, 0x0080, 0x7F7F, 0xFF7F, 0x3F80, 0xBF80, 0x3F81, 0x3B80,
};
static const uint8_t test_data_bool_specials[] = {0, 1, 2, 0x80, 0xFF};

#define TEST_DATA_PICK(arr) (arr)[test_data_rng() % (sizeof(arr) / sizeof((arr)[0]))]

/* An integer of size bytes: 0, 1, -1, 2, MIN, MIN+1, MAX, MAX-1 or -2, as raw bits. */
static inline uint64_t test_data_int_special(size_t size)
{
    uint64_t bits = size * 8;
    uint64_t mask = bits == 64 ? ~0ull : (1ull << bits) - 1;
    uint64_t min = 1ull << (bits - 1), max = min - 1;
    const uint64_t v[] = {0, 1, mask, 2, min, min + 1, max, max - 1, mask - 1};
    return v[test_data_rng() % (sizeof v / sizeof v[0])] & mask;
}

/*
 * One element of dt into p: 1 in 8 a special value, 3 in 16 raw random bits
 * (NaNs and extremes of every kind), the rest of moderate magnitude so that
 * sums and products give ordinary results (and float16 rounding cases) too.
 */
static inline void test_data_element(ps_dtype_t dt, unsigned char *p)
{
    uint64_t r = test_data_rng();
    unsigned kind = (unsigned)(r & 15);
    r >>= 4;
    switch (dt) {
    case PS_FLOAT32: {
        uint32_t v = (uint32_t)r;
        if (kind < 2)
            v = TEST_DATA_PICK(test_data_f32_specials);
        else if (kind >= 5)
            v = (v & 0x807FFFFFu) | ((uint32_t)(120 + (r >> 40) % 15) << 23);
        memcpy(p, &v, 4);
        break;
    }
    case PS_FLOAT64: {
        uint64_t v = test_data_rng();
        if (kind < 2)
            v = TEST_DATA_PICK(test_data_f64_specials);
        else if (kind >= 5)
            v = (v & 0x800FFFFFFFFFFFFFull) | ((uint64_t)(1016 + r % 15) << 52);
        memcpy(p, &v, 8);
        break;
    }
    case PS_FLOAT16: {
        uint16_t v = (uint16_t)r;
        if (kind < 2)
            v = TEST_DATA_PICK(test_data_f16_specials);
        else if (kind >= 5)
            v = (uint16_t)((v & 0x83FFu) | ((uint32_t)(10 + (r >> 20) % 11) << 10));
        memcpy(p, &v, 2);
        break;
    }
    case PS_BFLOAT16: {
        uint16_t v = (uint16_t)r;
        if (kind < 2)
            v = TEST_DATA_PICK(test_data_bf16_specials);
        else if (kind >= 5)
            v = (uint16_t)((v & 0x807Fu) | ((uint32_t)(120 + (r >> 20) % 15) << 7));
        memcpy(p, &v, 2);
        break;
    }
    case PS_BOOL:
        *p = kind < 8 ? TEST_DATA_PICK(test_data_bool_specials) : (uint8_t)(kind < 12 ? 0 : r);
        break;
    default: {
        size_t size = ps_dtype_size(dt);
        uint64_t v = kind < 3 ? test_data_int_special(size) : r ^ (test_data_rng() << 60);
        memcpy(p, &v, size); /* little-endian: the low bytes */
        break;
    }
    }
}

/* n random elements into buf; then, when like is not NULL, 1 in 8 copied from like (ties). */
static inline void test_data_fill(ps_dtype_t dt, void *buf, const void *like, size_t n)
{
    size_t size = ps_dtype_size(dt);
    unsigned char *out = (unsigned char *)buf;
    for (size_t i = 0; i < n; i++)
        test_data_element(dt, out + i * size);
    if (like != NULL)
        for (size_t i = 0; i < n; i++)
            if ((test_data_rng() & 7) == 0)
                memcpy(out + i * size, (const unsigned char *)like + i * size, size);
}

/*
 * Compares n elements bit for bit. Returns 1 when equal; otherwise prints the
 * first differing element under what and returns 0.
 */
static inline int test_data_same(const void *got, const void *want, size_t n, ps_dtype_t dt,
                                 const char *what)
{
    size_t size = ps_dtype_size(dt);
    if (memcmp(got, want, n * size) == 0)
        return 1;
    for (size_t i = 0; i < n; i++) {
        const unsigned char *g = (const unsigned char *)got + i * size;
        const unsigned char *w = (const unsigned char *)want + i * size;
        if (memcmp(g, w, size) != 0) {
            uint64_t gv = 0, wv = 0;
            memcpy(&gv, g, size);
            memcpy(&wv, w, size);
            printf("%s: %s element %zu of %zu: got 0x%llx, want 0x%llx\n", what, ps_dtype_name(dt),
                   i, n, (unsigned long long)gv, (unsigned long long)wv);
            break;
        }
    }
    return 0;
}

#endif
