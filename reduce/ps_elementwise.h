/* The element-wise arithmetic of every (op, dtype), shared by the CPU and CUDA paths. */
#ifndef PARAMSYNC_PS_ELEMENTWISE_H
#define PARAMSYNC_PS_ELEMENTWISE_H

/*
 * This header must compile as C11 and as CUDA C++ (nvcc), so it holds plain
 * C that is also valid C++: no compound literals, no designated
 * initializers, no _Generic. Every function is static inline, pure and
 * cannot fail.
 *
 * The rules every path follows bit for bit (scalar, AVX2, AVX-512, CUDA):
 *
 * - Integers wrap modulo 2^bits. The arithmetic is done in unsigned types
 *   so that wrapping is defined behaviour (UBSan runs over the tests).
 * - MIN/MAX select one of their operands, never compute a new value:
 *   if a is NaN the result is a, else if b is NaN it is b, else MIN takes b
 *   only when b < a and MAX only when b > a. Ties (including +0 vs -0) keep
 *   a, the value already in dst; a NaN keeps its bits (float32/float64).
 * - SUM, PRODUCT, AVG and the AVG division return the canonical quiet NaN
 *   (0x7FC00000, 0x7FF8000000000000) whenever the result is NaN. x86 keeps
 *   one operand's payload and which one depends on the compiler's operand
 *   order; GPUs return their own canonical NaN. Canonicalising is the only
 *   rule every path can match exactly.
 * - float16 and bfloat16 are widened exactly to float32, computed there and
 *   rounded once to nearest even. A NaN result becomes the canonical quiet
 *   NaN of the format (0x7E00, 0x7FC0), including a NaN selected by MIN/MAX.
 * - bool: any nonzero byte is true; results are 0 or 1. SUM and MAX are
 *   logical OR, PRODUCT and MIN logical AND; BAND/BOR/BXOR act on 0/1.
 *
 * Naming: ps_<op>_<c>(a, b) is one accumulation step on the compute type c
 * (f32, f64, i8, u8, i16, i32, i64, bool); ps_load_<d> widens a stored
 * element of dtype d to its compute type and ps_store_<d> narrows it back.
 * float16 and bfloat16 compute as f32.
 */

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define PS_HD __host__ __device__
#else
#define PS_HD
#endif

/* ---- bit casts: memcpy is the one bit cast that is defined in C, C++ and CUDA device code. */

static inline PS_HD uint32_t ps_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline PS_HD float ps_f32_from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline PS_HD uint64_t ps_f64_bits(double d)
{
    uint64_t u;
    memcpy(&u, &d, sizeof u);
    return u;
}

static inline PS_HD double ps_f64_from_bits(uint64_t u)
{
    double d;
    memcpy(&d, &u, sizeof d);
    return d;
}

#define PS_F32_CANONICAL_NAN  0x7FC00000u
#define PS_F64_CANONICAL_NAN  0x7FF8000000000000ull
#define PS_F16_CANONICAL_NAN  0x7E00u
#define PS_BF16_CANONICAL_NAN 0x7FC0u

/* x != x is the portable NaN test; it stays correct because no path is built with fast-math. */
static inline PS_HD float ps_canon_f32(float x)
{
    return x != x ? ps_f32_from_bits(PS_F32_CANONICAL_NAN) : x;
}

static inline PS_HD double ps_canon_f64(double x)
{
    return x != x ? ps_f64_from_bits(PS_F64_CANONICAL_NAN) : x;
}

/* ---- float16 <-> float32 */

/*
 * Exact: every float16 is a float32. On the CPU a NaN keeps sign and
 * payload and is made quiet, as VCVTPH2PS does, so every CPU path sees the
 * same float32 bits.
 */
static inline PS_HD float ps_f16_to_f32(uint16_t h)
{
#if defined(__CUDA_ARCH__)
    /* On the GPU the hardware conversion, exact like this function (subnormals
     * kept, no flush); a NaN stays a NaN, its payload perhaps not, which no
     * result shows: every float16 store makes a NaN the canonical one. The
     * integer path cost float16 kernels half their bandwidth (H200). */
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)h));
    return f;
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t mant = h & 0x3FFu;
    if (exp == 0x1Fu) {
        uint32_t quiet = mant != 0 ? 0x400000u : 0u;
        return ps_f32_from_bits(sign | 0x7F800000u | quiet | (mant << 13));
    }
    if (exp == 0) {
        /* Subnormal: mant * 2^-24, exact in float32 (mant < 2^10, result normal). */
        float mag = (float)mant * 5.9604644775390625e-8f;
        return ps_f32_from_bits(sign | ps_f32_bits(mag));
    }
    return ps_f32_from_bits(sign | ((exp + 112u) << 23) | (mant << 13));
#endif
}

/*
 * Round to nearest, ties to even, in integer arithmetic so that the result
 * does not depend on the FPU's rounding mode or flush-to-zero setting; it
 * matches VCVTPS2PH with imm8 = 0 for every non-NaN input. Overflow gives
 * +-Inf; NaN gives 0x7E00.
 */
static inline PS_HD uint16_t ps_f32_to_f16(float f)
{
    uint32_t x = ps_f32_bits(f);
    uint32_t ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u)
        return (uint16_t)PS_F16_CANONICAL_NAN;
#if defined(__CUDA_ARCH__)
    /* IEEE round to nearest even, subnormals kept, overflow to Inf: the same
     * result as the integer path below (gpu.kernels checks every value). */
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return (uint16_t)h;
#else
    uint32_t sign = (x >> 16) & 0x8000u;
    if (ax >= 0x477FF000u) /* >= 65520: the tie above 65504 rounds to even, i.e. up to Inf */
        return (uint16_t)(sign | 0x7C00u);
    if (ax < 0x38800000u) {    /* below 2^-14: float16 subnormal or zero */
        if (ax <= 0x33000000u) /* <= 2^-25: rounds to zero (2^-25 is a tie, zero is even) */
            return (uint16_t)sign;
        /* The value is m * 2^(e-150); in units of 2^-24 that is m >> (126 - e). */
        uint32_t e = ax >> 23;
        uint32_t m = (ax & 0x7FFFFFu) | 0x800000u;
        uint32_t shift = 126u - e; /* 14..24 */
        uint32_t q = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1u);
        uint32_t half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (q & 1u)))
            q++; /* may carry into 0x400, the smallest normal: still the right encoding */
        return (uint16_t)(sign | q);
    }
    /* Normal: rebias the exponent (127 -> 15), then round 13 mantissa bits away. */
    uint32_t r = ax - 0x38000000u;
    r += 0xFFFu + ((r >> 13) & 1u);
    return (uint16_t)(sign | (r >> 13));
#endif
}

/* ---- bfloat16 <-> float32 */

/* Exact: bfloat16 is the upper half of a float32. */
static inline PS_HD float ps_bf16_to_f32(uint16_t h)
{
    return ps_f32_from_bits((uint32_t)h << 16);
}

/*
 * Round to nearest, ties to even, in integer arithmetic: unlike VCVTNEPS2BF16
 * it keeps subnormals instead of flushing them. Overflow gives +-Inf; NaN
 * gives 0x7FC0 (the plain rounding would turn some NaNs into Inf).
 */
static inline PS_HD uint16_t ps_f32_to_bf16(float f)
{
    uint32_t x = ps_f32_bits(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u)
        return (uint16_t)PS_BF16_CANONICAL_NAN;
    x += 0x7FFFu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

/* ---- load/store between a stored element and its compute type */

static inline PS_HD float ps_load_f32(float v)
{
    return v;
}
static inline PS_HD float ps_store_f32(float v)
{
    return v;
}
static inline PS_HD double ps_load_f64(double v)
{
    return v;
}
static inline PS_HD double ps_store_f64(double v)
{
    return v;
}
static inline PS_HD float ps_load_f16(uint16_t v)
{
    return ps_f16_to_f32(v);
}
static inline PS_HD uint16_t ps_store_f16(float v)
{
    return ps_f32_to_f16(v);
}
static inline PS_HD float ps_load_bf16(uint16_t v)
{
    return ps_bf16_to_f32(v);
}
static inline PS_HD uint16_t ps_store_bf16(float v)
{
    return ps_f32_to_bf16(v);
}
/* bool is normalised on load so every op below sees 0 or 1. */
static inline PS_HD uint8_t ps_load_bool(uint8_t v)
{
    return (uint8_t)(v != 0);
}
static inline PS_HD uint8_t ps_store_bool(uint8_t v)
{
    return v;
}

/* ---- floating ops (f32, f64) */

#define PS__FLOAT_OPS(c, T)                                                                        \
    static inline PS_HD T ps_sum_##c(T a, T b)                                                     \
    {                                                                                              \
        return ps_canon_##c(a + b);                                                                \
    }                                                                                              \
    static inline PS_HD T ps_prod_##c(T a, T b)                                                    \
    {                                                                                              \
        return ps_canon_##c(a * b);                                                                \
    }                                                                                              \
    static inline PS_HD T ps_min_##c(T a, T b)                                                     \
    {                                                                                              \
        if (a != a)                                                                                \
            return a;                                                                              \
        if (b != b)                                                                                \
            return b;                                                                              \
        return b < a ? b : a;                                                                      \
    }                                                                                              \
    static inline PS_HD T ps_max_##c(T a, T b)                                                     \
    {                                                                                              \
        if (a != a)                                                                                \
            return a;                                                                              \
        if (b != b)                                                                                \
            return b;                                                                              \
        return b > a ? b : a;                                                                      \
    }                                                                                              \
    /* The accumulation step of AVG is a sum; the division happens once, at the end. */            \
    static inline PS_HD T ps_avg_##c(T a, T b)                                                     \
    {                                                                                              \
        return ps_sum_##c(a, b);                                                                   \
    }                                                                                              \
    /* Divisor converted to T with round to nearest (exact below 2^24 for f32). */                 \
    static inline PS_HD T ps_div_##c(T sum, uint64_t divisor)                                      \
    {                                                                                              \
        return ps_canon_##c(sum / (T)divisor);                                                     \
    }

PS__FLOAT_OPS(f32, float)
PS__FLOAT_OPS(f64, double)

/* ---- integer ops: U is an unsigned type at least as wide as unsigned int, so that the
 * multiplication cannot be promoted to a signed int and overflow (uint16 * uint16 would). */

#define PS__INT_OPS(c, T, U)                                                                       \
    static inline PS_HD T ps_sum_##c(T a, T b)                                                     \
    {                                                                                              \
        return (T)((U)a + (U)b);                                                                   \
    }                                                                                              \
    static inline PS_HD T ps_prod_##c(T a, T b)                                                    \
    {                                                                                              \
        return (T)((U)a * (U)b);                                                                   \
    }                                                                                              \
    static inline PS_HD T ps_min_##c(T a, T b)                                                     \
    {                                                                                              \
        return b < a ? b : a;                                                                      \
    }                                                                                              \
    static inline PS_HD T ps_max_##c(T a, T b)                                                     \
    {                                                                                              \
        return b > a ? b : a;                                                                      \
    }                                                                                              \
    static inline PS_HD T ps_band_##c(T a, T b)                                                    \
    {                                                                                              \
        return (T)((U)a & (U)b);                                                                   \
    }                                                                                              \
    static inline PS_HD T ps_bor_##c(T a, T b)                                                     \
    {                                                                                              \
        return (T)((U)a | (U)b);                                                                   \
    }                                                                                              \
    static inline PS_HD T ps_bxor_##c(T a, T b)                                                    \
    {                                                                                              \
        return (T)((U)a ^ (U)b);                                                                   \
    }                                                                                              \
    static inline PS_HD T ps_load_##c(T v)                                                         \
    {                                                                                              \
        return v;                                                                                  \
    }                                                                                              \
    static inline PS_HD T ps_store_##c(T v)                                                        \
    {                                                                                              \
        return v;                                                                                  \
    }

PS__INT_OPS(i8, int8_t, uint32_t)
PS__INT_OPS(u8, uint8_t, uint32_t)
PS__INT_OPS(i16, int16_t, uint32_t)
PS__INT_OPS(i32, int32_t, uint32_t)
PS__INT_OPS(i64, int64_t, uint64_t)

/* ---- bool ops on 0/1 (operands come from ps_load_bool) */

static inline PS_HD uint8_t ps_sum_bool(uint8_t a, uint8_t b)
{
    return (uint8_t)(a | b);
}
static inline PS_HD uint8_t ps_prod_bool(uint8_t a, uint8_t b)
{
    return (uint8_t)(a & b);
}
static inline PS_HD uint8_t ps_min_bool(uint8_t a, uint8_t b)
{
    return (uint8_t)(a & b);
}
static inline PS_HD uint8_t ps_max_bool(uint8_t a, uint8_t b)
{
    return (uint8_t)(a | b);
}
static inline PS_HD uint8_t ps_band_bool(uint8_t a, uint8_t b)
{
    return (uint8_t)(a & b);
}
static inline PS_HD uint8_t ps_bor_bool(uint8_t a, uint8_t b)
{
    return (uint8_t)(a | b);
}
static inline PS_HD uint8_t ps_bxor_bool(uint8_t a, uint8_t b)
{
    return (uint8_t)(a ^ b);
}

/*
 * The (op, dtype) grid, as X-macros, so that every path (scalar, SIMD, CUDA)
 * instantiates its kernels from this one list.
 *
 * PS_FOR_EACH_KERNEL(X) calls X(opname, step, fin, dtype, d, T, c, A) once per
 * valid pair, where opname is the lower-case op (sum, prod, ..., avg), step
 * the accumulation function stem (ps_<step>_<c>), fin either keep (store the
 * accumulator as is) or div (AVG: ps_div_<c> by the divisor first), dtype the
 * ps_dtype_t enumerator, d the dtype stem (ps_load_<d>, ps_store_<d>), T the
 * stored C type, c the compute stem and A the compute C type.
 */
#define PS__FOR_FLOAT_DTYPES(X, opname, step, fin)                                                 \
    X(opname, step, fin, PS_FLOAT32, f32, float, f32, float)                                       \
    X(opname, step, fin, PS_FLOAT64, f64, double, f64, double)                                     \
    X(opname, step, fin, PS_FLOAT16, f16, uint16_t, f32, float)                                    \
    X(opname, step, fin, PS_BFLOAT16, bf16, uint16_t, f32, float)

#define PS__FOR_INT_DTYPES(X, opname, step, fin)                                                   \
    X(opname, step, fin, PS_INT8, i8, int8_t, i8, int8_t)                                          \
    X(opname, step, fin, PS_UINT8, u8, uint8_t, u8, uint8_t)                                       \
    X(opname, step, fin, PS_INT16, i16, int16_t, i16, int16_t)                                     \
    X(opname, step, fin, PS_INT32, i32, int32_t, i32, int32_t)                                     \
    X(opname, step, fin, PS_INT64, i64, int64_t, i64, int64_t)                                     \
    X(opname, step, fin, PS_BOOL, bool, uint8_t, bool, uint8_t)

/* The op enumerator for each opname. */
#define PS__OP_sum  PS_SUM
#define PS__OP_prod PS_PRODUCT
#define PS__OP_min  PS_MIN
#define PS__OP_max  PS_MAX
#define PS__OP_band PS_BAND
#define PS__OP_bor  PS_BOR
#define PS__OP_bxor PS_BXOR
#define PS__OP_avg  PS_AVG

#define PS_FOR_EACH_KERNEL(X)                                                                      \
    PS__FOR_FLOAT_DTYPES(X, sum, sum, keep)                                                        \
    PS__FOR_FLOAT_DTYPES(X, prod, prod, keep)                                                      \
    PS__FOR_FLOAT_DTYPES(X, min, min, keep)                                                        \
    PS__FOR_FLOAT_DTYPES(X, max, max, keep)                                                        \
    PS__FOR_FLOAT_DTYPES(X, avg, sum, div)                                                         \
    PS__FOR_INT_DTYPES(X, sum, sum, keep)                                                          \
    PS__FOR_INT_DTYPES(X, prod, prod, keep)                                                        \
    PS__FOR_INT_DTYPES(X, min, min, keep)                                                          \
    PS__FOR_INT_DTYPES(X, max, max, keep)                                                          \
    PS__FOR_INT_DTYPES(X, band, band, keep)                                                        \
    PS__FOR_INT_DTYPES(X, bor, bor, keep)                                                          \
    PS__FOR_INT_DTYPES(X, bxor, bxor, keep)

#endif
