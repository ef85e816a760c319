/* AVX2 + F16C kernels for the whole (op, dtype) grid, bit-exact with the scalar reference. */
#include "reduce_internal.h"

#ifdef PS_HAVE_AVX2

#include <immintrin.h>

#include "ps_elementwise.h"

/*
 * Only the functions below are compiled for AVX2 (through the target
 * attribute); the rest of the library stays baseline x86-64 and the
 * dispatcher calls in here only after __builtin_cpu_supports said yes.
 */
#define PS_AVX2_FN     static inline __attribute__((target("avx2,f16c"), always_inline))
#define PS_AVX2_KERNEL static __attribute__((target("avx2,f16c")))

/* ---- float32 compute type: 8 lanes in a __m256 */

PS_AVX2_FN __m256 avx2_canon_f32(__m256 v)
{
    __m256 nan = _mm256_castsi256_ps(_mm256_set1_epi32((int)PS_F32_CANONICAL_NAN));
    return _mm256_blendv_ps(v, nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}
PS_AVX2_FN __m256 avx2_sum_f32(__m256 a, __m256 b)
{
    return avx2_canon_f32(_mm256_add_ps(a, b));
}
PS_AVX2_FN __m256 avx2_prod_f32(__m256 a, __m256 b)
{
    return avx2_canon_f32(_mm256_mul_ps(a, b));
}
/* b replaces a when b < a, or when b is NaN and a is not: NGE_UQ is "b < a or unordered". */
PS_AVX2_FN __m256 avx2_min_f32(__m256 a, __m256 b)
{
    __m256 take_b =
        _mm256_and_ps(_mm256_cmp_ps(b, a, _CMP_NGE_UQ), _mm256_cmp_ps(a, a, _CMP_ORD_Q));
    return _mm256_blendv_ps(a, b, take_b);
}
PS_AVX2_FN __m256 avx2_max_f32(__m256 a, __m256 b)
{
    __m256 take_b =
        _mm256_and_ps(_mm256_cmp_ps(b, a, _CMP_NLE_UQ), _mm256_cmp_ps(a, a, _CMP_ORD_Q));
    return _mm256_blendv_ps(a, b, take_b);
}
PS_AVX2_FN __m256 avx2_div_f32(__m256 v, uint64_t divisor)
{
    return avx2_canon_f32(_mm256_div_ps(v, _mm256_set1_ps((float)divisor)));
}

/* ---- float64 compute type: 4 lanes in a __m256d */

PS_AVX2_FN __m256d avx2_canon_f64(__m256d v)
{
    __m256d nan = _mm256_castsi256_pd(_mm256_set1_epi64x((long long)PS_F64_CANONICAL_NAN));
    return _mm256_blendv_pd(v, nan, _mm256_cmp_pd(v, v, _CMP_UNORD_Q));
}
PS_AVX2_FN __m256d avx2_sum_f64(__m256d a, __m256d b)
{
    return avx2_canon_f64(_mm256_add_pd(a, b));
}
PS_AVX2_FN __m256d avx2_prod_f64(__m256d a, __m256d b)
{
    return avx2_canon_f64(_mm256_mul_pd(a, b));
}
PS_AVX2_FN __m256d avx2_min_f64(__m256d a, __m256d b)
{
    __m256d take_b =
        _mm256_and_pd(_mm256_cmp_pd(b, a, _CMP_NGE_UQ), _mm256_cmp_pd(a, a, _CMP_ORD_Q));
    return _mm256_blendv_pd(a, b, take_b);
}
PS_AVX2_FN __m256d avx2_max_f64(__m256d a, __m256d b)
{
    __m256d take_b =
        _mm256_and_pd(_mm256_cmp_pd(b, a, _CMP_NLE_UQ), _mm256_cmp_pd(a, a, _CMP_ORD_Q));
    return _mm256_blendv_pd(a, b, take_b);
}
PS_AVX2_FN __m256d avx2_div_f64(__m256d v, uint64_t divisor)
{
    return avx2_canon_f64(_mm256_div_pd(v, _mm256_set1_pd((double)divisor)));
}

/* ---- integer compute types: one __m256i, lanes of the element width */

/* No 8-bit multiply exists: multiply even and odd bytes as 16-bit lanes and keep the low bytes. */
PS_AVX2_FN __m256i avx2_mul_epi8(__m256i a, __m256i b)
{
    __m256i even = _mm256_mullo_epi16(a, b);
    __m256i odd = _mm256_mullo_epi16(_mm256_srli_epi16(a, 8), _mm256_srli_epi16(b, 8));
    return _mm256_or_si256(_mm256_and_si256(even, _mm256_set1_epi16(0x00FF)),
                           _mm256_slli_epi16(odd, 8));
}

/* No 64-bit multiply in AVX2: lo*lo + ((hi*lo + lo*hi) << 32), which is the product mod 2^64. */
PS_AVX2_FN __m256i avx2_mul_epi64(__m256i a, __m256i b)
{
    __m256i lo = _mm256_mul_epu32(a, b);
    __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), b),
                                     _mm256_mul_epu32(a, _mm256_srli_epi64(b, 32)));
    return _mm256_add_epi64(lo, _mm256_slli_epi64(cross, 32));
}

PS_AVX2_FN __m256i avx2_min_epi64(__m256i a, __m256i b)
{
    return _mm256_blendv_epi8(a, b, _mm256_cmpgt_epi64(a, b));
}

PS_AVX2_FN __m256i avx2_max_epi64(__m256i a, __m256i b)
{
    return _mm256_blendv_epi8(a, b, _mm256_cmpgt_epi64(b, a));
}

/* Bitwise ops do not care about the lane width: one definition per integer compute type. */
#define PS__AVX2_INT_OPS(c, add, mul, min, max)                                                    \
    PS_AVX2_FN __m256i avx2_sum_##c(__m256i a, __m256i b)                                          \
    {                                                                                              \
        return add(a, b);                                                                          \
    }                                                                                              \
    PS_AVX2_FN __m256i avx2_prod_##c(__m256i a, __m256i b)                                         \
    {                                                                                              \
        return mul(a, b);                                                                          \
    }                                                                                              \
    PS_AVX2_FN __m256i avx2_min_##c(__m256i a, __m256i b)                                          \
    {                                                                                              \
        return min(a, b);                                                                          \
    }                                                                                              \
    PS_AVX2_FN __m256i avx2_max_##c(__m256i a, __m256i b)                                          \
    {                                                                                              \
        return max(a, b);                                                                          \
    }                                                                                              \
    PS_AVX2_FN __m256i avx2_band_##c(__m256i a, __m256i b)                                         \
    {                                                                                              \
        return _mm256_and_si256(a, b);                                                             \
    }                                                                                              \
    PS_AVX2_FN __m256i avx2_bor_##c(__m256i a, __m256i b)                                          \
    {                                                                                              \
        return _mm256_or_si256(a, b);                                                              \
    }                                                                                              \
    PS_AVX2_FN __m256i avx2_bxor_##c(__m256i a, __m256i b)                                         \
    {                                                                                              \
        return _mm256_xor_si256(a, b);                                                             \
    }

PS__AVX2_INT_OPS(i8, _mm256_add_epi8, avx2_mul_epi8, _mm256_min_epi8, _mm256_max_epi8)
PS__AVX2_INT_OPS(u8, _mm256_add_epi8, avx2_mul_epi8, _mm256_min_epu8, _mm256_max_epu8)
PS__AVX2_INT_OPS(i16, _mm256_add_epi16, _mm256_mullo_epi16, _mm256_min_epi16, _mm256_max_epi16)
PS__AVX2_INT_OPS(i32, _mm256_add_epi32, _mm256_mullo_epi32, _mm256_min_epi32, _mm256_max_epi32)
PS__AVX2_INT_OPS(i64, _mm256_add_epi64, avx2_mul_epi64, avx2_min_epi64, avx2_max_epi64)
/* bool lanes hold 0/1 after loading, so OR/AND give SUM/MAX and PRODUCT/MIN. */
PS__AVX2_INT_OPS(bool, _mm256_or_si256, _mm256_and_si256, _mm256_and_si256, _mm256_or_si256)

/* ---- per-dtype loads and stores (unaligned, p is a byte address): AVX2_LANES_<d> elements at a
 * time, any alignment */

#define AVX2_VEC_f32  __m256
#define AVX2_VEC_f64  __m256d
#define AVX2_VEC_i8   __m256i
#define AVX2_VEC_u8   __m256i
#define AVX2_VEC_i16  __m256i
#define AVX2_VEC_i32  __m256i
#define AVX2_VEC_i64  __m256i
#define AVX2_VEC_bool __m256i

#define AVX2_LANES_f32  8
#define AVX2_LANES_f64  4
#define AVX2_LANES_f16  8
#define AVX2_LANES_bf16 8
#define AVX2_LANES_i8   32
#define AVX2_LANES_u8   32
#define AVX2_LANES_i16  16
#define AVX2_LANES_i32  8
#define AVX2_LANES_i64  4
#define AVX2_LANES_bool 32

PS_AVX2_FN __m256 avx2_load_f32(const void *p)
{
    return _mm256_loadu_ps((const float *)p);
}
PS_AVX2_FN void avx2_store_f32(void *p, __m256 v)
{
    _mm256_storeu_ps((float *)p, v);
}
PS_AVX2_FN __m256d avx2_load_f64(const void *p)
{
    return _mm256_loadu_pd((const double *)p);
}
PS_AVX2_FN void avx2_store_f64(void *p, __m256d v)
{
    _mm256_storeu_pd((double *)p, v);
}

/* F16C widens exactly and, with imm8 = 0, narrows with round to nearest even, like
 * ps_f32_to_f16 for every non-NaN value; NaNs are made canonical first so they match too. */
PS_AVX2_FN __m256 avx2_load_f16(const void *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
PS_AVX2_FN void avx2_store_f16(void *p, __m256 v)
{
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(avx2_canon_f32(v), _MM_FROUND_TO_NEAREST_INT));
}

/* bfloat16 -> float32 is a 16-bit shift; float32 -> bfloat16 is ps_f32_to_bf16's integer
 * rounding, after canonicalising NaN (the canonical NaN then rounds to 0x7FC0 exactly). */
PS_AVX2_FN __m256 avx2_load_bf16(const void *p)
{
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
PS_AVX2_FN void avx2_store_bf16(void *p, __m256 v)
{
    __m256i x = _mm256_castps_si256(avx2_canon_f32(v));
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    x = _mm256_add_epi32(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    x = _mm256_srli_epi32(x, 16);
    /* Lanes are <= 0xFFFF, so the unsigned-saturating pack is a plain narrowing. */
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    _mm_storeu_si128((__m128i *)p, packed);
}

#define PS__AVX2_INT_LOADSTORE(c)                                                                  \
    PS_AVX2_FN __m256i avx2_load_##c(const void *p)                                                \
    {                                                                                              \
        return _mm256_loadu_si256((const __m256i *)p);                                             \
    }                                                                                              \
    PS_AVX2_FN void avx2_store_##c(void *p, __m256i v)                                             \
    {                                                                                              \
        _mm256_storeu_si256((__m256i *)p, v);                                                      \
    }

PS__AVX2_INT_LOADSTORE(i8)
PS__AVX2_INT_LOADSTORE(u8)
PS__AVX2_INT_LOADSTORE(i16)
PS__AVX2_INT_LOADSTORE(i32)
PS__AVX2_INT_LOADSTORE(i64)

/* Any nonzero byte is true: min(byte, 1) maps it to 0/1 in one instruction. */
PS_AVX2_FN __m256i avx2_load_bool(const void *p)
{
    return _mm256_min_epu8(_mm256_loadu_si256((const __m256i *)p), _mm256_set1_epi8(1));
}
PS_AVX2_FN void avx2_store_bool(void *p, __m256i v)
{
    _mm256_storeu_si256((__m256i *)p, v);
}

/* ---- the kernels, one per (op, dtype) from PS_FOR_EACH_KERNEL */

#define AVX2_FIN_keep(c, acc, divisor) (acc)
#define AVX2_FIN_div(c, acc, divisor)  avx2_div_##c(acc, divisor)

/*
 * Same loop as the scalar reference, a vector at a time. The two-input case
 * (ps_reduce, and the common in-place accumulate) gets its own loop so the
 * compiler sees no inner loop over inputs.
 */
#define PS__AVX2_KERNEL(opname, step, fin, dtype, d, T, c, A)                                      \
    PS_AVX2_KERNEL size_t avx2_kernel_##opname##_##d(void *dst, const void *const *srcs,           \
                                                     size_t nsrc, size_t begin, size_t end,        \
                                                     uint64_t divisor)                             \
    {                                                                                              \
        unsigned char *out = (unsigned char *)dst;                                                 \
        const unsigned char *first = (const unsigned char *)srcs[0];                               \
        size_t i = begin;                                                                          \
        (void)divisor;                                                                             \
        if (nsrc == 2) {                                                                           \
            const unsigned char *second = (const unsigned char *)srcs[1];                          \
            for (; end - i >= AVX2_LANES_##d; i += AVX2_LANES_##d) {                               \
                AVX2_VEC_##c acc = avx2_load_##d(first + i * sizeof(T));                           \
                acc = avx2_##step##_##c(acc, avx2_load_##d(second + i * sizeof(T)));               \
                avx2_store_##d(out + i * sizeof(T), AVX2_FIN_##fin(c, acc, divisor));              \
            }                                                                                      \
            return i;                                                                              \
        }                                                                                          \
        for (; end - i >= AVX2_LANES_##d; i += AVX2_LANES_##d) {                                   \
            AVX2_VEC_##c acc = avx2_load_##d(first + i * sizeof(T));                               \
            for (size_t j = 1; j < nsrc; j++)                                                      \
                acc = avx2_##step##_##c(                                                           \
                    acc, avx2_load_##d((const unsigned char *)srcs[j] + i * sizeof(T)));           \
            avx2_store_##d(out + i * sizeof(T), AVX2_FIN_##fin(c, acc, divisor));                  \
        }                                                                                          \
        return i;                                                                                  \
    }

PS_FOR_EACH_KERNEL(PS__AVX2_KERNEL)

#define PS__AVX2_ENTRY(opname, step, fin, dtype, d, T, c, A)                                       \
    [PS__OP_##opname][dtype] = avx2_kernel_##opname##_##d,

const ps__kernel_table_t ps__avx2_kernels = {{PS_FOR_EACH_KERNEL(PS__AVX2_ENTRY)}};

#endif
