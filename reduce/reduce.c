/* The public reduce API: argument checks, run-time path selection, kernel dispatch. */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <pthread.h>

#if defined(PS_HAVE_AVX2) || defined(PS_HAVE_AVX512)
#include <cpuid.h>
#endif

#include "reduce_internal.h"

static const char *const path_names[PS_PATH_COUNT] = {
    [PS_PATH_SCALAR] = "scalar",
    [PS_PATH_AVX2] = "avx2",
    [PS_PATH_AVX512] = "avx512",
};

static const ps__kernel_table_t *const path_tables[PS_PATH_COUNT] = {
    [PS_PATH_SCALAR] = &ps__scalar_kernels,
#ifdef PS_HAVE_AVX2
    [PS_PATH_AVX2] = &ps__avx2_kernels,
#endif
#ifdef PS_HAVE_AVX512
    [PS_PATH_AVX512] = &ps__avx512_kernels,
#endif
};

/* Written once under path_once; read-only afterwards. */
static pthread_once_t path_once = PTHREAD_ONCE_INIT;
static int path_supported[PS_PATH_COUNT];
/* The path in use. Atomic because ps_reduce_set_path may race with reductions in other threads. */
static atomic_int current_path = PS_PATH_SCALAR;

#ifdef PS_HAVE_AVX2
/* CPUID.1:ECX bit 29, read directly: clang < 16 rejects __builtin_cpu_supports("f16c").
 * Returns 1 or 0; cannot fail. */
static int cpu_has_f16c(void)
{
    unsigned eax, ebx, ecx, edx;
    return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & (1u << 29)) != 0;
}
#endif

/*
 * Probes the CPU once and picks the path; cannot fail (scalar always works).
 * __builtin_cpu_supports also checks that the OS saves the YMM/ZMM state
 * (XCR0), so a feature bit alone never selects a path.
 */
static void path_init(void)
{
    path_supported[PS_PATH_SCALAR] = 1;
#if defined(PS_HAVE_AVX2) || defined(PS_HAVE_AVX512)
    __builtin_cpu_init();
#endif
#ifdef PS_HAVE_AVX2
    path_supported[PS_PATH_AVX2] = __builtin_cpu_supports("avx2") && cpu_has_f16c();
#endif
#ifdef PS_HAVE_AVX512
    path_supported[PS_PATH_AVX512] =
        __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
#endif
    int chosen = PS_PATH_SCALAR;
    for (int p = 0; p < PS_PATH_COUNT; p++)
        if (path_supported[p])
            chosen = p;
    /* An unknown or unsupported value is ignored: the best path stays, and
     * ps_reduce_get_path() tells which one that is. */
    const char *env = getenv("PARAMSYNC_REDUCE_PATH");
    if (env != NULL)
        for (int p = 0; p < PS_PATH_COUNT; p++)
            if (strcmp(env, path_names[p]) == 0 && path_supported[p])
                chosen = p;
    atomic_store(&current_path, chosen);
}

/* Runs path_init exactly once, whichever thread comes first; cannot fail. */
static void path_ensure_init(void)
{
    pthread_once(&path_once, path_init);
}

ps_reduce_path_t ps_reduce_get_path(void)
{
    path_ensure_init();
    return (ps_reduce_path_t)atomic_load_explicit(&current_path, memory_order_relaxed);
}

int ps_reduce_path_supported(ps_reduce_path_t path)
{
    if ((unsigned)path >= PS_PATH_COUNT)
        return 0;
    path_ensure_init();
    return path_supported[path];
}

int ps_reduce_set_path(ps_reduce_path_t path)
{
    if (!ps_reduce_path_supported(path))
        return PS_ENOTSUP;
    atomic_store_explicit(&current_path, (int)path, memory_order_relaxed);
    return 0;
}

const char *ps_reduce_path_name(ps_reduce_path_t path)
{
    return (unsigned)path < PS_PATH_COUNT ? path_names[path] : "invalid";
}

/*
 * Checks that [p, p + bytes) is a usable range: p non-NULL unless bytes is 0
 * and no wrap past the end of the address space. Returns 0 or PS_EINVAL.
 */
static int check_range(const void *p, size_t bytes)
{
    if (bytes == 0)
        return 0;
    if (p == NULL || (uintptr_t)p > UINTPTR_MAX - bytes)
        return PS_EINVAL;
    return 0;
}

/* Whether [a, a + bytes) and [b, b + bytes) share a byte (ranges passed check_range). */
static int ranges_overlap(const void *a, const void *b, size_t bytes)
{
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return bytes != 0 && x < y + bytes && y < x + bytes;
}

/* Runs one reduction on the current path; arguments are valid. Cannot fail. */
static void run_kernels(ps_op_t op, ps_dtype_t dtype, void *dst, const void *const *srcs,
                        size_t nsrc, size_t count, uint64_t divisor)
{
    const ps__kernel_table_t *table = path_tables[ps_reduce_get_path()];
    ps__kernel_fn simd = table->fn[op][dtype];
    size_t done = 0;
    if (simd != NULL)
        done = simd(dst, srcs, nsrc, 0, count, divisor);
    /* The SIMD kernel stops at a whole number of vectors; the reference finishes the tail. */
    ps__scalar_kernels.fn[op][dtype](dst, srcs, nsrc, done, count, divisor);
}

int ps_reduce(ps_op_t op, ps_dtype_t dtype, void *dst, const void *src, size_t count)
{
    int err = ps_op_check(op, dtype);
    if (err != 0)
        return err;
    size_t size = ps_dtype_size(dtype);
    if (count > SIZE_MAX / size)
        return PS_EINVAL;
    size_t bytes = count * size;
    if (check_range(dst, bytes) != 0 || check_range(src, bytes) != 0)
        return PS_EINVAL;
    if (dst != src && ranges_overlap(dst, src, bytes))
        return PS_EINVAL;
    if (count == 0)
        return 0;
    const void *srcs[2] = {dst, src};
    /* Two-input AVG is a plain sum: the division belongs to whoever knows the final count. */
    run_kernels(op == PS_AVG ? PS_SUM : op, dtype, dst, srcs, 2, count, 1);
    return 0;
}

int ps_reduce_multi(ps_op_t op, ps_dtype_t dtype, void *dst, const void *const *srcs, size_t nsrc,
                    size_t count)
{
    int err = ps_op_check(op, dtype);
    if (err != 0)
        return err;
    if (srcs == NULL || nsrc == 0)
        return PS_EINVAL;
    size_t size = ps_dtype_size(dtype);
    if (count > SIZE_MAX / size)
        return PS_EINVAL;
    size_t bytes = count * size;
    if (check_range(dst, bytes) != 0)
        return PS_EINVAL;
    for (size_t j = 0; j < nsrc; j++) {
        if (check_range(srcs[j], bytes) != 0)
            return PS_EINVAL;
        /* srcs[0] may be dst exactly (in-place accumulate); any other sharing with dst would
         * let a write land before a later input is read. */
        if (j == 0 && srcs[0] == dst)
            continue;
        if (ranges_overlap(dst, srcs[j], bytes))
            return PS_EINVAL;
    }
    if (count == 0)
        return 0;
    run_kernels(op, dtype, dst, srcs, nsrc, count, nsrc);
    return 0;
}

int ps_reduce_scale(ps_dtype_t dtype, void *buf, size_t count, uint64_t divisor)
{
    /* The AVG kernels with one input are exactly "divide and round": one code path for both. */
    int err = ps_op_check(PS_AVG, dtype);
    if (err != 0 || divisor == 0)
        return PS_EINVAL;
    size_t size = ps_dtype_size(dtype);
    if (count > SIZE_MAX / size || check_range(buf, count * size) != 0)
        return PS_EINVAL;
    if (count == 0)
        return 0;
    const void *srcs[1] = {buf};
    run_kernels(PS_AVG, dtype, buf, srcs, 1, count, divisor);
    return 0;
}
