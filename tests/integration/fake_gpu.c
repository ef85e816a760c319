/* A CUDA device made of host memory: the part of paramsync/gpu.h that paramsyncd calls, for
 * paramsyncd-fakegpu, which runs the agent's CUDA path (--reduce-device cuda|auto) where no GPU
 * is (CI).
 *
 * What it keeps true to the real library, and checks:
 * - pinned memory: ps_gpu_host_alloc and ps_gpu_host_register record their ranges;
 *   registering a range that overlaps a pinned one, or memory that is not mapped, fails as
 *   cudaHostRegister does (PS_EINVAL); unregistering anything but a registered range's start
 *   fails; unregistering a range that is no longer mapped (unmapped before it was unpinned)
 *   aborts the daemon, which the tests see;
 * - ps_gpu_reduce_host_dsts (the agent's one reduction call): the CPU engine's result, after
 *   basic argument checks (dsts that overlap each other, or a src other than exactly, fail as
 *   the real stager's checks do), and a count of the buffers that were pinned (the DMA
 *   would read or write them in place) and of those that were not (the real stager would
 *   copy them through its own pinned buffers); and of the calls with more than one dst and
 *   their dsts;
 * - stagers are not thread-safe: two threads in one stager at once abort.
 *
 * PS_FAKEGPU_REPORT=FILE: at exit, one line "reduce_host CALLS pinned PINNED staged STAGED
 * registered REG unregistered UNREG stagers N multi MCALLS dsts MDSTS" goes to FILE.
 * PS_FAKEGPU_REGISTER=fail makes every ps_gpu_host_register fail (a locked-memory limit);
 * PS_FAKEGPU_REDUCE=fail every reduction after its checks, nothing written (a device in
 * trouble).
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <paramsync/gpu.h>
#include <paramsync/reduce.h>

#define MAX_RANGES 4096

typedef struct range {
    uintptr_t start;
    size_t len;
    int registered; /* 1: ps_gpu_host_register; 0: ps_gpu_host_alloc */
} range_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static range_t ranges[MAX_RANGES];
static int nranges;
static atomic_ulong calls, pinned_bufs, staged_bufs, registered, unregistered, stagers, multi_calls,
    multi_dsts;

struct ps_gpu_stager {
    atomic_int busy;
};

static void report(void)
{
    const char *path = getenv("PS_FAKEGPU_REPORT");
    FILE *f = path ? fopen(path, "w") : NULL;
    if (!f)
        return;
    fprintf(f,
            "reduce_host %lu pinned %lu staged %lu registered %lu unregistered %lu stagers %lu "
            "multi %lu dsts %lu\n",
            atomic_load(&calls), atomic_load(&pinned_bufs), atomic_load(&staged_bufs),
            atomic_load(&registered), atomic_load(&unregistered), atomic_load(&stagers),
            atomic_load(&multi_calls), atomic_load(&multi_dsts));
    fclose(f);
}

static pthread_once_t report_once = PTHREAD_ONCE_INIT;

static void report_register(void)
{
    atexit(report);
}

/* Whether every page of [p, p + len) is mapped (mincore fails with ENOMEM otherwise). */
static int mapped(uintptr_t p, size_t len)
{
    long page = sysconf(_SC_PAGESIZE);
    uintptr_t first = p & ~(uintptr_t)(page - 1);
    size_t n = (p + len - first + (size_t)page - 1) / (size_t)page;
    unsigned char *vec = malloc(n ? n : 1);
    int ok = vec && mincore((void *)first, n * (size_t)page, vec) == 0;
    free(vec);
    return ok;
}

/* Index of the range holding [p, p + len) whole, or -1. Lock held. */
static int find_holding(uintptr_t p, size_t len)
{
    for (int i = 0; i < nranges; i++)
        if (p >= ranges[i].start && p - ranges[i].start + len <= ranges[i].len)
            return i;
    return -1;
}

static int add_range(uintptr_t p, size_t len, int reg)
{
    int rc = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < nranges && rc == 0; i++)
        if (p < ranges[i].start + ranges[i].len && ranges[i].start < p + len)
            rc = PS_EINVAL; /* cudaErrorHostMemoryAlreadyRegistered */
    if (rc == 0 && nranges == MAX_RANGES)
        rc = PS_ENOMEM;
    if (rc == 0)
        ranges[nranges++] = (range_t){p, len, reg};
    pthread_mutex_unlock(&lock);
    return rc;
}

/* Removes the registered range starting at p (a ps_gpu_host_alloc one is
 * not cudaHostUnregister's); -1 when there is none. */
static int remove_registered(uintptr_t p, size_t *len)
{
    int found = -1;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < nranges && found < 0; i++)
        if (ranges[i].start == p && ranges[i].registered) {
            found = i;
            *len = ranges[i].len;
            ranges[i] = ranges[--nranges];
        }
    pthread_mutex_unlock(&lock);
    return found;
}

int ps_gpu_device_count(int *count)
{
    if (count == NULL)
        return PS_EINVAL;
    *count = 1;
    return 0;
}

int ps_gpu_host_alloc(void **out, size_t bytes)
{
    if (out == NULL || bytes == 0)
        return PS_EINVAL;
    void *p = NULL;
    if (posix_memalign(&p, 4096, bytes) != 0)
        return PS_ENOMEM;
    if (add_range((uintptr_t)p, bytes, 0) != 0) {
        free(p);
        return PS_ENOMEM;
    }
    *out = p;
    return 0;
}

int ps_gpu_host_register(void *ptr, size_t bytes)
{
    if (ptr == NULL || bytes == 0)
        return PS_EINVAL;
    const char *mode = getenv("PS_FAKEGPU_REGISTER");
    if (mode && strcmp(mode, "fail") == 0)
        return PS_ENOMEM;
    if (!mapped((uintptr_t)ptr, bytes))
        return PS_EINVAL;
    int rc = add_range((uintptr_t)ptr, bytes, 1);
    if (rc == 0)
        atomic_fetch_add(&registered, 1);
    return rc;
}

int ps_gpu_host_unregister(void *ptr)
{
    size_t len;
    if (ptr == NULL)
        return 0;
    if (remove_registered((uintptr_t)ptr, &len) < 0)
        return PS_EINVAL; /* cudaErrorHostMemoryNotRegistered */
    if (!mapped((uintptr_t)ptr, len)) {
        fprintf(stderr, "fake_gpu: %zu bytes at %p unregistered after they were unmapped\n", len,
                ptr);
        abort();
    }
    atomic_fetch_add(&unregistered, 1);
    return 0;
}

int ps_gpu_stager_create(ps_gpu_stager_t **out, int device, size_t max_srcs, size_t chunk_bytes)
{
    (void)chunk_bytes;
    if (out == NULL || device != 0 || max_srcs == 0 || max_srcs > PS_GPU_MAX_SRCS)
        return PS_EINVAL;
    ps_gpu_stager_t *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return PS_ENOMEM;
    pthread_once(&report_once, report_register);
    atomic_fetch_add(&stagers, 1);
    *out = s;
    return 0;
}

/* Counts buffer p of len bytes as pinned or staged. */
static void count_buffer(const void *p, size_t len)
{
    pthread_mutex_lock(&lock);
    int pinned = find_holding((uintptr_t)p, len) >= 0;
    pthread_mutex_unlock(&lock);
    atomic_fetch_add(pinned ? &pinned_bufs : &staged_bufs, 1);
}

/* Whether [a, a + n) and [b, b + n) share a byte. */
static int overlap(const void *a, const void *b, size_t n)
{
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return n && x < y + n && y < x + n;
}

int ps_gpu_reduce_host_dsts(ps_gpu_stager_t *stager, ps_op_t op, ps_dtype_t dtype,
                            void *const *dsts, size_t ndst, const void *const *srcs, size_t nsrc,
                            size_t count)
{
    if (stager == NULL || dsts == NULL || ndst == 0 || ndst > PS_GPU_MAX_SRCS || srcs == NULL ||
        nsrc == 0 || nsrc > PS_GPU_MAX_SRCS || ps_op_check(op, dtype) != 0)
        return PS_EINVAL;
    size_t bytes = count * ps_dtype_size(dtype);
    for (size_t i = 0; i < ndst; i++) {
        if (dsts[i] == NULL)
            return PS_EINVAL;
        for (size_t k = 0; k < i; k++)
            if (overlap(dsts[i], dsts[k], bytes))
                return PS_EINVAL;
        for (size_t j = 0; j < nsrc; j++)
            if (dsts[i] != srcs[j] && overlap(dsts[i], srcs[j], bytes))
                return PS_EINVAL;
    }
    const char *mode = getenv("PS_FAKEGPU_REDUCE");
    if (mode && strcmp(mode, "fail") == 0)
        return PS_EINTERNAL;
    if (atomic_exchange(&stager->busy, 1)) {
        fprintf(stderr, "fake_gpu: a stager used by two threads at once\n");
        abort();
    }
    atomic_fetch_add(&calls, 1);
    if (ndst > 1) {
        atomic_fetch_add(&multi_calls, 1);
        atomic_fetch_add(&multi_dsts, ndst);
    }
    for (size_t i = 0; i < ndst; i++)
        count_buffer(dsts[i], bytes);
    for (size_t j = 0; j < nsrc; j++)
        count_buffer(srcs[j], bytes);
    /* Every input is read before any dst is written: a dst may be an input. */
    void *tmp = malloc(bytes ? bytes : 1);
    int rc = tmp ? ps_reduce_multi(op, dtype, tmp, srcs, nsrc, count) : PS_ENOMEM;
    for (size_t i = 0; rc == 0 && i < ndst; i++)
        memcpy(dsts[i], tmp, bytes);
    free(tmp);
    atomic_store(&stager->busy, 0);
    return rc;
}
