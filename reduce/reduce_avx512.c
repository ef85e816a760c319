/* AVX-512 (F + BW) kernels for the whole (op, dtype) grid, bit-exact with the scalar reference. */
#include "reduce_internal.h"

#ifdef PS_HAVE_AVX512

#include <immintrin.h>

#include "ps_elementwise.h"

/*
 * Only these functions are compiled for AVX-512 (target attribute); the
 * dispatcher calls in here only after __builtin_cpu_supports("avx512f") and
 * ("avx512bw"). VCVTNEPS2BF16 (AVX512_BF16) is deliberately not used: it
 * flushes subnormals, so it could not match ps_f32_to_bf16 bit for bit.
 */
#define PS_AVX512_FN     static inline __attribute__((target("avx512f,avx512bw"), always_inline))
#define PS_AVX512_KERNEL static __attribute__((target("avx512f,avx512bw")))

/* ---- float32 compute type: 16 lanes in a __m512 */

PS_AVX512_FN __m512 avx512_canon_f32(__m512 v)
{
    __m512 nan = _mm512_castsi512_ps(_mm512_set1_epi32((int)PS_F32_CANONICAL_NAN));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), v, nan);
}
PS_AVX512_FN __m512 avx512_sum_f32(__m512 a, __m512 b)
{
    return avx512_canon_f32(_mm512_add_ps(a, b));
}
PS_AVX512_FN __m512 avx512_prod_f32(__m512 a, __m512 b)
{
    return avx512_canon_f32(_mm512_mul_ps(a, b));
}
/* b replaces a when a is ordered and (b < a or b is NaN): NGE_UQ under an ORD(a) mask. */
PS_AVX512_FN __m512 avx512_min_f32(__m512 a, __m512 b)
{
    __mmask16 a_ordered = _mm512_cmp_ps_mask(a, a, _CMP_ORD_Q);
    return _mm512_mask_blend_ps(_mm512_mask_cmp_ps_mask(a_ordered, b, a, _CMP_NGE_UQ), a, b);
}
PS_AVX512_FN __m512 avx512_max_f32(__m512 a, __m512 b)
{
    __mmask16 a_ordered = _mm512_cmp_ps_mask(a, a, _CMP_ORD_Q);
    return _mm512_mask_blend_ps(_mm512_mask_cmp_ps_mask(a_ordered, b, a, _CMP_NLE_UQ), a, b);
}
PS_AVX512_FN __m512 avx512_div_f32(__m512 v, uint64_t divisor)
{
    return avx512_canon_f32(_mm512_div_ps(v, _mm512_set1_ps((float)divisor)));
}

/* ---- float64 compute type: 8 lanes in a __m512d */

PS_AVX512_FN __m512d avx512_canon_f64(__m512d v)
{
    __m512d nan = _mm512_castsi512_pd(_mm512_set1_epi64((long long)PS_F64_CANONICAL_NAN));
    return _mm512_mask_blend_pd(_mm512_cmp_pd_mask(v, v, _CMP_UNORD_Q), v, nan);
}
PS_AVX512_FN __m512d avx512_sum_f64(__m512d a, __m512d b)
{
    return avx512_canon_f64(_mm512_add_pd(a, b));
}
PS_AVX512_FN __m512d avx512_prod_f64(__m512d a, __m512d b)
{
    return avx512_canon_f64(_mm512_mul_pd(a, b));
}
PS_AVX512_FN __m512d avx512_min_f64(__m512d a, __m512d b)
{
    __mmask8 a_ordered = _mm512_cmp_pd_mask(a, a, _CMP_ORD_Q);
    return _mm512_mask_blend_pd(_mm512_mask_cmp_pd_mask(a_ordered, b, a, _CMP_NGE_UQ), a, b);
}
PS_AVX512_FN __m512d avx512_max_f64(__m512d a, __m512d b)
{
    __mmask8 a_ordered = _mm512_cmp_pd_mask(a, a, _CMP_ORD_Q);
    return _mm512_mask_blend_pd(_mm512_mask_cmp_pd_mask(a_ordered, b, a, _CMP_NLE_UQ), a, b);
}
PS_AVX512_FN __m512d avx512_div_f64(__m512d v, uint64_t divisor)
{
    return avx512_canon_f64(_mm512_div_pd(v, _mm512_set1_pd((double)divisor)));
}

/* ---- integer compute types: one __m512i, lanes of the element width */

/* No 8-bit multiply exists: multiply even and odd bytes as 16-bit lanes and keep the low bytes. */
PS_AVX512_FN __m512i avx512_mul_epi8(__m512i a, __m512i b)
{
    __m512i even = _mm512_mullo_epi16(a, b);
    __m512i odd = _mm512_mullo_epi16(_mm512_srli_epi16(a, 8), _mm512_srli_epi16(b, 8));
    return _mm512_mask_blend_epi8(0xAAAAAAAAAAAAAAAAull, even, _mm512_slli_epi16(odd, 8));
}

/* VPMULLQ needs AVX512DQ; lo*lo + ((hi*lo + lo*hi) << 32) keeps the path to F + BW. */
PS_AVX512_FN __m512i avx512_mul_epi64(__m512i a, __m512i b)
{
    __m512i lo = _mm512_mul_epu32(a, b);
    __m512i cross = _mm512_add_epi64(_mm512_mul_epu32(_mm512_srli_epi64(a, 32), b),
                                     _mm512_mul_epu32(a, _mm512_srli_epi64(b, 32)));
    return _mm512_add_epi64(lo, _mm512_slli_epi64(cross, 32));
}

#define PS__AVX512_INT_OPS(c, add, mul, min, max)                                                  \
    PS_AVX512_FN __m512i avx512_sum_##c(__m512i a, __m512i b)                                      \
    {                                                                                              \
        return add(a, b);                                                                          \
    }                                                                                              \
    PS_AVX512_FN __m512i avx512_prod_##c(__m512i a, __m512i b)                                     \
    {                                                                                              \
        return mul(a, b);                                                                          \
    }                                                                                              \
    PS_AVX512_FN __m512i avx512_min_##c(__m512i a, __m512i b)                                      \
    {                                                                                              \
        return min(a, b);                                                                          \
    }                                                                                              \
    PS_AVX512_FN __m512i avx512_max_##c(__m512i a, __m512i b)                                      \
    {                                                                                              \
        return max(a, b);                                                                          \
    }                                                                                              \
    PS_AVX512_FN __m512i avx512_band_##c(__m512i a, __m512i b)                                     \
    {                                                                                              \
        return _mm512_and_si512(a, b);                                                             \
    }                                                                                              \
    PS_AVX512_FN __m512i avx512_bor_##c(__m512i a, __m512i b)                                      \
    {                                                                                              \
        return _mm512_or_si512(a, b);                                                              \
    }                                                                                              \
    PS_AVX512_FN __m512i avx512_bxor_##c(__m512i a, __m512i b)                                     \
    {                                                                                              \
        return _mm512_xor_si512(a, b);                                                             \
    }

PS__AVX512_INT_OPS(i8, _mm512_add_epi8, avx512_mul_epi8, _mm512_min_epi8, _mm512_max_epi8)
PS__AVX512_INT_OPS(u8, _mm512_add_epi8, avx512_mul_epi8, _mm512_min_epu8, _mm512_max_epu8)
PS__AVX512_INT_OPS(i16, _mm512_add_epi16, _mm512_mullo_epi16, _mm512_min_epi16, _mm512_max_epi16)
PS__AVX512_INT_OPS(i32, _mm512_add_epi32, _mm512_mullo_epi32, _mm512_min_epi32, _mm512_max_epi32)
PS__AVX512_INT_OPS(i64, _mm512_add_epi64, avx512_mul_epi64, _mm512_min_epi64, _mm512_max_epi64)
/* bool lanes hold 0/1 after loading, so OR/AND give SUM/MAX and PRODUCT/MIN. */
PS__AVX512_INT_OPS(bool, _mm512_or_si512, _mm512_and_si512, _mm512_and_si512, _mm512_or_si512)

/* ---- per-dtype loads and stores (unaligned, p is a byte address): AVX512_LANES_<d> elements at a
 * time, any alignment */

#define AVX512_VEC_f32  __m512
#define AVX512_VEC_f64  __m512d
#define AVX512_VEC_i8   __m512i
#define AVX512_VEC_u8   __m512i
#define AVX512_VEC_i16  __m512i
#define AVX512_VEC_i32  __m512i
#define AVX512_VEC_i64  __m512i
#define AVX512_VEC_bool __m512i

#define AVX512_LANES_f32  16
#define AVX512_LANES_f64  8
#define AVX512_LANES_f16  16
#define AVX512_LANES_bf16 16
#define AVX512_LANES_i8   64
#define AVX512_LANES_u8   64
#define AVX512_LANES_i16  32
#define AVX512_LANES_i32  16
#define AVX512_LANES_i64  8
#define AVX512_LANES_bool 64

PS_AVX512_FN __m512 avx512_load_f32(const void *p)
{
    return _mm512_loadu_ps(p);
}
PS_AVX512_FN void avx512_store_f32(void *p, __m512 v)
{
    _mm512_storeu_ps(p, v);
}
PS_AVX512_FN __m512d avx512_load_f64(const void *p)
{
    return _mm512_loadu_pd(p);
}
PS_AVX512_FN void avx512_store_f64(void *p, __m512d v)
{
    _mm512_storeu_pd(p, v);
}

/* VCVTPH2PS widens exactly; VCVTPS2PH with round-to-nearest-even narrows like ps_f32_to_f16
 * for every non-NaN value, and NaNs are made canonical first so they match too. */
PS_AVX512_FN __m512 avx512_load_f16(const void *p)
{
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
PS_AVX512_FN void avx512_store_f16(void *p, __m512 v)
{
    __m256i h = _mm512_cvtps_ph(avx512_canon_f32(v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256((__m256i *)p, h);
}

/* bfloat16 -> float32 is a 16-bit shift; float32 -> bfloat16 is ps_f32_to_bf16's integer
 * rounding, after canonicalising NaN (the canonical NaN then rounds to 0x7FC0 exactly). */
PS_AVX512_FN __m512 avx512_load_bf16(const void *p)
{
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
PS_AVX512_FN void avx512_store_bf16(void *p, __m512 v)
{
    __m512i x = _mm512_castps_si512(avx512_canon_f32(v));
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    x = _mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(x, 16)));
}

#define PS__AVX512_INT_LOADSTORE(c)                                                                \
    PS_AVX512_FN __m512i avx512_load_##c(const void *p)                                            \
    {                                                                                              \
        return _mm512_loadu_si512(p);                                                              \
    }                                                                                              \
    PS_AVX512_FN void avx512_store_##c(void *p, __m512i v)                                         \
    {                                                                                              \
        _mm512_storeu_si512(p, v);                                                                 \
    }

PS__AVX512_INT_LOADSTORE(i8)
PS__AVX512_INT_LOADSTORE(u8)
PS__AVX512_INT_LOADSTORE(i16)
PS__AVX512_INT_LOADSTORE(i32)
PS__AVX512_INT_LOADSTORE(i64)

/* Any nonzero byte is true: min(byte, 1) maps it to 0/1 in one instruction. */
PS_AVX512_FN __m512i avx512_load_bool(const void *p)
{
    return _mm512_min_epu8(_mm512_loadu_si512(p), _mm512_set1_epi8(1));
}
PS_AVX512_FN void avx512_store_bool(void *p, __m512i v)
{
    _mm512_storeu_si512(p, v);
}

/* ---- the kernels, one per (op, dtype) from PS_FOR_EACH_KERNEL */

#define AVX512_FIN_keep(c, acc, divisor) (acc)
#define AVX512_FIN_div(c, acc, divisor)  avx512_div_##c(acc, divisor)

/* Same loop as the scalar reference, a vector at a time; two inputs get their own loop. */
#define PS__AVX512_KERNEL(opname, step, fin, dtype, d, T, c, A)                                    \
    PS_AVX512_KERNEL size_t avx512_kernel_##opname##_##d(void *dst, const void *const *srcs,       \
                                                         size_t nsrc, size_t begin, size_t end,    \
                                                         uint64_t divisor)                         \
    {                                                                                              \
        unsigned char *out = (unsigned char *)dst;                                                 \
        const unsigned char *first = (const unsigned char *)srcs[0];                               \
        size_t i = begin;                                                                          \
        (void)divisor;                                                                             \
        if (nsrc == 2) {                                                                           \
            const unsigned char *second = (const unsigned char *)srcs[1];                          \
            for (; end - i >= AVX512_LANES_##d; i += AVX512_LANES_##d) {                           \
                AVX512_VEC_##c acc = avx512_load_##d(first + i * sizeof(T));                       \
                acc = avx512_##step##_##c(acc, avx512_load_##d(second + i * sizeof(T)));           \
                avx512_store_##d(out + i * sizeof(T), AVX512_FIN_##fin(c, acc, divisor));          \
            }                                                                                      \
            return i;                                                                              \
        }                                                                                          \
        for (; end - i >= AVX512_LANES_##d; i += AVX512_LANES_##d) {                               \
            AVX512_VEC_##c acc = avx512_load_##d(first + i * sizeof(T));                           \
            for (size_t j = 1; j < nsrc; j++)                                                      \
                acc = avx512_##step##_##c(                                                         \
                    acc, avx512_load_##d((const unsigned char *)srcs[j] + i * sizeof(T)));         \
            avx512_store_##d(out + i * sizeof(T), AVX512_FIN_##fin(c, acc, divisor));              \
        }                                                                                          \
        return i;                                                                                  \
    }

PS_FOR_EACH_KERNEL(PS__AVX512_KERNEL)

#define PS__AVX512_ENTRY(opname, step, fin, dtype, d, T, c, A)                                     \
    [PS__OP_##opname][dtype] = avx512_kernel_##opname##_##d,

const ps__kernel_table_t ps__avx512_kernels = {{PS_FOR_EACH_KERNEL(PS__AVX512_ENTRY)}};

#endif
