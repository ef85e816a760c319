/* ps-test-worker: one rank of an integration scenario; checks exact results, exits 0, 1 or 77
 * (skipped).
 *
 * Usage: ps-test-worker SCENARIO. The job comes from the environment as for
 * any paramsync program (PARAMSYNC_ADDR, WORLD_SIZE, RANK, PARAMSYNC_JOB);
 * PS_TEST_INIT, when set, is the init method instead of env://, and
 * PS_TEST_SALT varies the data so that concurrent jobs cannot pass with
 * each other's tensors.
 *
 * Values are chosen so that every result is exact in every dtype: integers
 * use full-width random bits (wrapping arithmetic commutes with truncation,
 * so the expected value is computed in 64 bits and truncated); floating
 * types use small integers whose sums, products, minima and averages over
 * up to 8 ranks are exactly representable even in bfloat16.
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <paramsync/gpu.h>
#include <paramsync/paramsync.h>

/* The engine's conversions (round to nearest even), proven by tests/unit. */
#include "ps_elementwise.h"

/* The doorbell's layout, part of the wire contract (sc_doorbell). */
#include "paramsync/v1/doorbell.h"
#include "paramsync/v1/paramsync.pb-c.h"
#include "../unit/threads.h"
#ifdef PS_TEST_FAKE_CLIENT_GPU
#include "fake_client_gpu.h"
#endif

#define SKIP 77
#define MIB  (1u << 20)

/* ---------------------------------------------------------------- harness */

typedef struct ctx {
    ps_comm_t *comm;
    int rank, size; /* in the job */
    unsigned salt;
} ctx_t;

static int g_rank = -1;
static int g_verbose; /* PS_TEST_VERBOSE: time every collective */
static const char *g_scenario = "?";

/* The last error message the library reported (its handler is set on every
 * comm), so that tests can check what the daemon said. */
static pthread_mutex_t g_err_lock = PTHREAD_MUTEX_INITIALIZER;
static char g_last_error[1024];
static int g_error_count;

static void on_error(int err, const char *message, void *arg)
{
    (void)arg;
    pthread_mutex_lock(&g_err_lock);
    snprintf(g_last_error, sizeof(g_last_error), "%s", message);
    g_error_count++;
    pthread_mutex_unlock(&g_err_lock);
    fprintf(stderr, "[rank %d] paramsync error %d (%s): %s\n", g_rank, err, ps_strerror(err),
            message);
}

static void last_error(char *buf, size_t cap)
{
    pthread_mutex_lock(&g_err_lock);
    snprintf(buf, cap, "%s", g_last_error);
    pthread_mutex_unlock(&g_err_lock);
}

static void clear_last_error(void)
{
    pthread_mutex_lock(&g_err_lock);
    g_last_error[0] = 0;
    pthread_mutex_unlock(&g_err_lock);
}

static int error_count(void)
{
    pthread_mutex_lock(&g_err_lock);
    int n = g_error_count;
    pthread_mutex_unlock(&g_err_lock);
    return n;
}

__attribute__((format(printf, 1, 2))) static int fail(const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "[rank %d] %s: FAIL: ", g_rank, g_scenario);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    return -1;
}

__attribute__((format(printf, 1, 2))) static void note(const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "[rank %d] %s: ", g_rank, g_scenario);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

#define CHECK_OK(expr)                                                                             \
    do {                                                                                           \
        int rc_ = (expr);                                                                          \
        if (rc_ != 0)                                                                              \
            return fail("%s:%d: %s returned %d (%s)", __FILE__, __LINE__, #expr, rc_,              \
                        ps_strerror(rc_));                                                         \
    } while (0)

/* For the test's own helpers, which have said what failed. */
#define TRY(expr)                                                                                  \
    do {                                                                                           \
        if ((expr) != 0)                                                                           \
            return -1;                                                                             \
    } while (0)

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond))                                                                               \
            return fail(__VA_ARGS__);                                                              \
    } while (0)

static int64_t now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static int64_t now_ms(void)
{
    return now_us() / 1000;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
        ;
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "out of memory (%zu bytes)\n", n);
        exit(1);
    }
    return p;
}

/* The `registered` scenario: each case's buffers come from one ps_mem_alloc
 * (so input and output share a segment and the agent uses them in place);
 * with PS_TEST_SHARED=2 its outputs from a second one (input and output in
 * two segments, CollectiveHeader.shm_out, as torch's tensors of two empty()
 * calls); otherwise from malloc. */
static ps_comm_t *g_arena_comm;
static uint8_t *g_arena, *g_arena_out;
static size_t g_arena_size, g_arena_used, g_arena_out_used;
static int g_arena_shared = -1; /* what ps_mem_is_shared must say (PS_TEST_SHARED) */

static int arena_open(ps_comm_t *comm, size_t bytes)
{
    if (!g_arena_comm)
        return 0;
    g_arena_size = bytes + 8 * 4096;
    g_arena_used = g_arena_out_used = 0;
    g_arena = ps_mem_alloc(comm, g_arena_size);
    if (g_arena && g_arena_shared == 2 && !(g_arena_out = ps_mem_alloc(comm, g_arena_size)))
        return fail("ps_mem_alloc(%zu) of the outputs returned NULL", g_arena_size);
    if (!g_arena)
        return fail("ps_mem_alloc(%zu) returned NULL", g_arena_size);
    int shared = ps_mem_is_shared(comm, g_arena);
    if (g_arena_out && !ps_mem_is_shared(comm, g_arena_out))
        shared = 0;
    if (g_arena_shared >= 0 && shared != !!g_arena_shared)
        return fail("ps_mem_is_shared says %d, expected %d", shared, !!g_arena_shared);
    return 0;
}

static void *arena_take(uint8_t *arena, size_t *used, size_t n)
{
    void *p = arena + *used;
    *used += (n + 4095) / 4096 * 4096 + 4096; /* a page apart */
    if (*used > g_arena_size) {
        fprintf(stderr, "case arena too small\n");
        exit(1);
    }
    return p;
}

static void *case_alloc(size_t n)
{
    return g_arena ? arena_take(g_arena, &g_arena_used, n) : xmalloc(n);
}

/* A case's output buffer: from the outputs' arena where there is one. */
static void *case_alloc_out(size_t n)
{
    return g_arena_out ? arena_take(g_arena_out, &g_arena_out_used, n) : case_alloc(n);
}

static void case_free(void *p)
{
    if (!g_arena)
        free(p);
}

static int arena_close(void)
{
    if (!g_arena)
        return 0;
    int rc = ps_mem_free(g_arena_comm, g_arena);
    if (g_arena_out && rc == 0)
        rc = ps_mem_free(g_arena_comm, g_arena_out);
    g_arena = g_arena_out = NULL;
    return rc ? fail("ps_mem_free: %d (%s)", rc, ps_strerror(rc)) : 0;
}

static int env_int(const char *name, int dflt)
{
    const char *s = getenv(name);
    return s && *s ? atoi(s) : dflt;
}

/* Joins with the environment's job (or PS_TEST_INIT), overriding what the
 * caller sets in opts. */
static int join(ps_init_options_t *opts, ps_comm_t **comm)
{
    opts->init_method = getenv("PS_TEST_INIT");
    opts->error_fn = on_error;
    return ps_init(opts, comm);
}

/* ---------------------------------------------------------------- values */

static const ps_dtype_t all_dtypes[] = {PS_FLOAT32, PS_FLOAT64, PS_FLOAT16, PS_BFLOAT16, PS_INT8,
                                        PS_UINT8,   PS_INT16,   PS_INT32,   PS_INT64,    PS_BOOL};
#define NDTYPES (sizeof(all_dtypes) / sizeof(all_dtypes[0]))
static const ps_op_t all_ops[] = {PS_SUM,  PS_PRODUCT, PS_MIN,  PS_MAX,
                                  PS_BAND, PS_BOR,     PS_BXOR, PS_AVG};
#define NOPS (sizeof(all_ops) / sizeof(all_ops[0]))

static int is_float(ps_dtype_t dt)
{
    return dt == PS_FLOAT32 || dt == PS_FLOAT64 || dt == PS_FLOAT16 || dt == PS_BFLOAT16;
}

static uint64_t splitmix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static uint64_t hash3(unsigned salt, int r, uint64_t i)
{
    return splitmix(splitmix(((uint64_t)salt << 40) ^ ((uint64_t)(unsigned)r << 32) ^ i) + i);
}

/* The value of an integer dtype held by a random 64-bit pattern. */
static int64_t canon_int(ps_dtype_t dt, uint64_t h)
{
    switch (dt) {
    case PS_INT8:
        return (int8_t)h;
    case PS_UINT8:
        return (uint8_t)h;
    case PS_INT16:
        return (int16_t)h;
    case PS_INT32:
        return (int32_t)h;
    case PS_INT64:
        return (int64_t)h;
    case PS_BOOL:
        return h % 4 != 0; /* mostly true, so that PRODUCT (AND) is not all false */
    default:
        return 0;
    }
}

/* Rank r's element i for (dt, op): an integer value (for floating types a
 * small one, exact everywhere). */
static int64_t gen(ps_dtype_t dt, ps_op_t op, unsigned salt, int r, uint64_t i)
{
    uint64_t h = hash3(salt, r, i);
    if (!is_float(dt))
        return canon_int(dt, h);
    switch (op) {
    case PS_PRODUCT: {
        static const int pattern[4] = {2, 1, -1, 1};
        return pattern[h % 4];
    }
    case PS_MIN:
    case PS_MAX:
        return (int64_t)(h % 17) - 8;
    default:
        return (int64_t)(h % 11) - 5;
    }
}

static void put_double(ps_dtype_t dt, void *buf, size_t i, double v)
{
    switch (dt) {
    case PS_FLOAT32:
        ((float *)buf)[i] = (float)v;
        break;
    case PS_FLOAT64:
        ((double *)buf)[i] = v;
        break;
    case PS_FLOAT16:
        ((uint16_t *)buf)[i] = ps_f32_to_f16((float)v);
        break;
    case PS_BFLOAT16:
        ((uint16_t *)buf)[i] = ps_f32_to_bf16((float)v);
        break;
    default:
        break;
    }
}

/* Stores an integer value; integers wrap to the dtype's width. */
static void put(ps_dtype_t dt, void *buf, size_t i, int64_t v)
{
    switch (dt) {
    case PS_INT8:
    case PS_UINT8:
        ((uint8_t *)buf)[i] = (uint8_t)v;
        break;
    case PS_BOOL:
        ((uint8_t *)buf)[i] = v != 0;
        break;
    case PS_INT16:
        ((uint16_t *)buf)[i] = (uint16_t)v;
        break;
    case PS_INT32:
        ((uint32_t *)buf)[i] = (uint32_t)v;
        break;
    case PS_INT64:
        ((uint64_t *)buf)[i] = (uint64_t)v;
        break;
    default:
        put_double(dt, buf, i, (double)v);
    }
}

/* Fills count elements of rank r's payload starting at element `first`. */
static void fill(ps_dtype_t dt, ps_op_t op, unsigned salt, int r, void *buf, size_t first,
                 size_t count)
{
    for (size_t i = 0; i < count; i++)
        put(dt, buf, i, gen(dt, op, salt, r, first + i));
}

/* out[i] = the reduction over ranks 0..n-1 of element first+i. */
static void expect_reduced(ps_dtype_t dt, ps_op_t op, unsigned salt, int n, void *out, size_t first,
                           size_t count)
{
    for (size_t i = 0; i < count; i++) {
        uint64_t idx = first + i;
        if (is_float(dt)) {
            double acc = (double)gen(dt, op, salt, 0, idx);
            for (int r = 1; r < n; r++) {
                double v = (double)gen(dt, op, salt, r, idx);
                acc = op == PS_PRODUCT ? acc * v
                      : op == PS_MIN   ? (v < acc ? v : acc)
                      : op == PS_MAX   ? (v > acc ? v : acc)
                                       : acc + v;
            }
            if (op == PS_AVG)
                acc /= n;
            put_double(dt, out, i, acc);
            continue;
        }
        /* Wrapping arithmetic and bitwise ops in 64 bits, truncated by put(). */
        int64_t first_v = gen(dt, op, salt, 0, idx);
        uint64_t acc = (uint64_t)first_v;
        int64_t sacc = first_v;
        for (int r = 1; r < n; r++) {
            int64_t v = gen(dt, op, salt, r, idx);
            switch (op) {
            case PS_SUM:
                acc += (uint64_t)v;
                break;
            case PS_PRODUCT:
                acc *= (uint64_t)v;
                break;
            case PS_BAND:
                acc &= (uint64_t)v;
                break;
            case PS_BOR:
                acc |= (uint64_t)v;
                break;
            case PS_BXOR:
                acc ^= (uint64_t)v;
                break;
            case PS_MIN:
                sacc = v < sacc ? v : sacc;
                break;
            case PS_MAX:
                sacc = v > sacc ? v : sacc;
                break;
            default:
                break;
            }
        }
        put(dt, out, i, op == PS_MIN || op == PS_MAX ? sacc : (int64_t)acc);
    }
}

/* Compares byte for byte; names the first differing element. */
static int compare(const char *what, ps_dtype_t dt, const void *got, const void *want, size_t count)
{
    size_t esz = ps_dtype_size(dt);
    if (count == 0 || memcmp(got, want, count * esz) == 0)
        return 0;
    for (size_t i = 0; i < count; i++) {
        if (memcmp((const char *)got + i * esz, (const char *)want + i * esz, esz) != 0) {
            uint64_t g = 0, w = 0;
            memcpy(&g, (const char *)got + i * esz, esz);
            memcpy(&w, (const char *)want + i * esz, esz);
            return fail("%s: element %zu of %zu differs: got 0x%llx, want 0x%llx", what, i, count,
                        (unsigned long long)g, (unsigned long long)w);
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- one collective */

typedef enum kind {
    K_ALL_REDUCE,
    K_REDUCE,
    K_BROADCAST,
    K_ALL_GATHER,
    K_GATHER,
    K_SCATTER,
    K_REDUCE_SCATTER,
    K_ALL_TO_ALL,
} kind_t;

static const char *const kind_names[] = {"all_reduce", "reduce",  "broadcast",      "all_gather",
                                         "gather",     "scatter", "reduce_scatter", "all_to_all"};

/* Runs one collective of kind on group g and checks every byte this rank
 * ends up with (including buffers that must stay untouched). async: through
 * the ps_i* form and ps_work_wait. */
static int run_case(ctx_t *cx, kind_t kind, ps_dtype_t dt, ps_op_t op, size_t count, int root,
                    ps_group_t *g, int async)
{
    ps_comm_t *comm = cx->comm;
    int me = ps_get_rank(comm, g), n = ps_get_world_size(comm, g);
    size_t esz = ps_dtype_size(dt), all = (size_t)n * count;
    unsigned salt = cx->salt * 131u + (unsigned)kind * 17u + (unsigned)dt * 3u + (unsigned)op;
    char what[160];
    snprintf(what, sizeof(what), "%s%s %s %s count %zu root %d group size %d", async ? "i" : "",
             kind_names[kind], ps_dtype_name(dt), ps_op_name(op), count, root, n);
    int rc = 0, ret = 0;
    ps_work_t *w = NULL;
    /* Inputs and outputs get distinct allocations, the untouched parts a
     * known pattern. */
    uint8_t *in = NULL, *out = NULL, *want = NULL;
    TRY(arena_open(comm, (3 * all + count) * esz));

    int64_t t0 = 0;
    switch (kind) {
    case K_ALL_REDUCE:
    case K_REDUCE:
        in = case_alloc(count * esz);
        want = case_alloc(count * esz);
        fill(dt, op, salt, me, in, 0, count);
        if (kind == K_ALL_REDUCE || me == root)
            expect_reduced(dt, op, salt, n, want, 0, count);
        else
            memcpy(want, in, count * esz); /* other ranks' buffers are unchanged */
        t0 = now_ms();
        rc = kind == K_ALL_REDUCE ? (async ? ps_iall_reduce(comm, in, count, dt, op, g, &w)
                                           : ps_all_reduce(comm, in, count, dt, op, g))
                                  : (async ? ps_ireduce_to(comm, in, count, dt, op, root, g, &w)
                                           : ps_reduce_to(comm, in, count, dt, op, root, g));
        out = in;
        in = NULL;
        break;
    case K_BROADCAST:
        out = case_alloc(count * esz);
        want = case_alloc(count * esz);
        fill(dt, op, salt, me, out, 0, count);
        fill(dt, op, salt, root, want, 0, count);
        t0 = now_ms();
        rc = async ? ps_ibroadcast(comm, out, count, dt, root, g, &w)
                   : ps_broadcast(comm, out, count, dt, root, g);
        break;
    case K_ALL_GATHER:
    case K_GATHER:
        in = case_alloc(count * esz);
        fill(dt, op, salt, me, in, 0, count);
        if (kind == K_ALL_GATHER || me == root) {
            out = case_alloc_out(all * esz);
            memset(out, 0xa5, all * esz);
            want = case_alloc(all * esz);
            for (int r = 0; r < n; r++)
                fill(dt, op, salt, r, want + (size_t)r * count * esz, 0, count);
        }
        t0 = now_ms();
        if (kind == K_ALL_GATHER)
            rc = async ? ps_iall_gather(comm, out, in, count, dt, g, &w)
                       : ps_all_gather(comm, out, in, count, dt, g);
        else /* non-roots pass NULL, as torch's gather_list=None */
            rc = async ? ps_igather(comm, out, in, count, dt, root, g, &w)
                       : ps_gather(comm, out, in, count, dt, root, g);
        break;
    case K_SCATTER:
        if (me == root) {
            in = case_alloc(all * esz);
            fill(dt, op, salt, root, in, 0, all);
        }
        out = case_alloc_out(count * esz);
        memset(out, 0xa5, count * esz);
        want = case_alloc(count * esz);
        fill(dt, op, salt, root, want, (size_t)me * count, count);
        t0 = now_ms();
        rc = async ? ps_iscatter(comm, out, in, count, dt, root, g, &w)
                   : ps_scatter(comm, out, in, count, dt, root, g);
        break;
    case K_REDUCE_SCATTER:
        in = case_alloc(all * esz);
        fill(dt, op, salt, me, in, 0, all);
        out = case_alloc_out(count * esz);
        memset(out, 0xa5, count * esz);
        want = case_alloc(count * esz);
        expect_reduced(dt, op, salt, n, want, (size_t)me * count, count);
        t0 = now_ms();
        rc = async ? ps_ireduce_scatter(comm, out, in, count, dt, op, g, &w)
                   : ps_reduce_scatter(comm, out, in, count, dt, op, g);
        break;
    case K_ALL_TO_ALL:
        in = case_alloc(all * esz);
        fill(dt, op, salt, me, in, 0, all);
        out = case_alloc_out(all * esz);
        memset(out, 0xa5, all * esz);
        want = case_alloc(all * esz);
        for (int r = 0; r < n; r++)
            fill(dt, op, salt, r, want + (size_t)r * count * esz, (size_t)me * count, count);
        t0 = now_ms();
        rc = async ? ps_iall_to_all(comm, out, in, count, dt, g, &w)
                   : ps_all_to_all(comm, out, in, count, dt, g);
        break;
    }
    if (rc == 0 && async) {
        rc = ps_work_wait(w);
        if (rc == 0 && ps_work_wait(w) != 0)
            rc = fail("%s: a second ps_work_wait gave another result", what);
        ps_work_free(w);
    }
    if (g_verbose)
        note("%s: %lld ms", what, (long long)(now_ms() - t0));
    if (rc != 0) {
        ret = fail("%s: returned %d (%s)", what, rc, ps_strerror(rc));
    } else if (want) {
        size_t nout =
            kind == K_ALL_GATHER || kind == K_GATHER || kind == K_ALL_TO_ALL ? all : count;
        ret = compare(what, dt, out, want, nout);
    }
    case_free(in);
    case_free(out);
    case_free(want);
    if (arena_close() != 0)
        ret = -1;
    return ret;
}

/* Element counts: empty, one, odd, a few thousand bytes, and one that
 * spans several 1 MiB frames and ends mid-frame (multi). */
static size_t multi_count(ps_dtype_t dt)
{
    return (size_t)(5 * MIB / 2) / ps_dtype_size(dt) + 3;
}

static const size_t small_counts[] = {0, 1, 7, 1000};
#define NSMALL (sizeof(small_counts) / sizeof(small_counts[0]))

static int reducing(kind_t k)
{
    return k == K_ALL_REDUCE || k == K_REDUCE || k == K_REDUCE_SCATTER;
}

/* Roots to try: the first and the last rank. */
static int nroots(kind_t k, int n)
{
    int rooted = k == K_REDUCE || k == K_BROADCAST || k == K_GATHER || k == K_SCATTER;
    return rooted && n > 1 ? 2 : 1;
}

static int root_at(int i, int n)
{
    return i == 0 ? 0 : n - 1;
}

/* Light sweeps (many ranks, several agents) keep to a spread of dtypes. */
static int g_light;
/* Small sweeps leave out the multi-frame sizes. */
static int g_small;

static int light_dtype(ps_dtype_t dt)
{
    return dt == PS_FLOAT32 || dt == PS_BFLOAT16 || dt == PS_INT8 || dt == PS_INT64 ||
           dt == PS_BOOL;
}

/* Whether (dt, op) also runs at a multi-frame size: every dtype with its
 * first op, and every op of float32, int32 and bool (uint8 for the others). */
static int multi_frame_case(kind_t kind, ps_dtype_t dt, size_t op_index)
{
    if (g_light)
        return op_index == 0 && (dt == PS_FLOAT32 || dt == PS_INT8);
    if (!reducing(kind))
        return dt == PS_FLOAT16 || dt == PS_INT8 || dt == PS_INT64;
    if (op_index == 0)
        return kind == K_ALL_REDUCE || dt == PS_FLOAT32 || dt == PS_INT8;
    return kind == K_ALL_REDUCE && (dt == PS_FLOAT32 || dt == PS_INT32 || dt == PS_BOOL);
}

/* Every (op, dtype) pair for reducing kinds, every dtype otherwise, at
 * every small size; multi-frame sizes for a spread of them. The payload of
 * kinds that send n blocks is kept near 2.5 MiB per rank. */
static int sweep(ctx_t *cx, kind_t kind, ps_group_t *g)
{
    int n = ps_get_world_size(cx->comm, g);
    for (size_t d = 0; d < NDTYPES; d++) {
        ps_dtype_t dt = all_dtypes[d];
        if (g_light && !light_dtype(dt))
            continue;
        size_t valid = 0;
        for (size_t o = 0; o < (reducing(kind) ? NOPS : 1); o++) {
            ps_op_t op = all_ops[o];
            if (ps_op_check(op, dt) != 0)
                continue;
            size_t mc = multi_count(dt);
            if (kind == K_SCATTER || kind == K_REDUCE_SCATTER || kind == K_ALL_TO_ALL)
                mc = mc / (size_t)n + 1;
            int multi = multi_frame_case(kind, dt, valid++);
            for (int ri = 0; ri < nroots(kind, n); ri++) {
                int root = root_at(ri, n);
                for (size_t s = 0; s < NSMALL; s++)
                    TRY(run_case(cx, kind, dt, op, small_counts[s], root, g, 0));
                if (multi && !g_small)
                    TRY(run_case(cx, kind, dt, op, mc, root, g, 0));
            }
        }
    }
    return 0;
}

/* MIN/MAX propagate NaN (torch's rule): one rank's NaN wins element 0. */
static int check_nan(ctx_t *cx)
{
    const ps_dtype_t dts[] = {PS_FLOAT32, PS_FLOAT64};
    const ps_op_t ops[] = {PS_MIN, PS_MAX};
    for (size_t d = 0; d < 2; d++) {
        for (size_t o = 0; o < 2; o++) {
            double v[3] = {(double)cx->rank, -1.0 * cx->rank, 5};
            if (cx->rank == cx->size - 1)
                v[0] = NAN;
            uint8_t buf[3 * 8];
            for (int i = 0; i < 3; i++)
                put_double(dts[d], buf, (size_t)i, v[i]);
            CHECK_OK(ps_all_reduce(cx->comm, buf, 3, dts[d], ops[o], NULL));
            double r0 = dts[d] == PS_FLOAT32 ? ((float *)buf)[0] : ((double *)buf)[0];
            double r2 = dts[d] == PS_FLOAT32 ? ((float *)buf)[2] : ((double *)buf)[2];
            CHECK(isnan(r0), "%s %s: NaN did not propagate (got %g)", ps_dtype_name(dts[d]),
                  ps_op_name(ops[o]), r0);
            CHECK(r2 == 5, "%s %s: element 2 is %g, want 5", ps_dtype_name(dts[d]),
                  ps_op_name(ops[o]), r2);
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- scenarios */

static int sc_all_reduce(ctx_t *cx)
{
    if (sweep(cx, K_ALL_REDUCE, NULL) != 0)
        return -1;
    return check_nan(cx);
}

static int sc_reduce(ctx_t *cx)
{
    return sweep(cx, K_REDUCE, NULL);
}

static int sc_broadcast(ctx_t *cx)
{
    return sweep(cx, K_BROADCAST, NULL);
}

static int sc_all_gather(ctx_t *cx)
{
    return sweep(cx, K_ALL_GATHER, NULL);
}

static int sc_gather(ctx_t *cx)
{
    return sweep(cx, K_GATHER, NULL);
}

static int sc_scatter(ctx_t *cx)
{
    return sweep(cx, K_SCATTER, NULL);
}

static int sc_reduce_scatter(ctx_t *cx)
{
    return sweep(cx, K_REDUCE_SCATTER, NULL);
}

static int sc_all_to_all(ctx_t *cx)
{
    return sweep(cx, K_ALL_TO_ALL, NULL);
}

/* Rank r sends rank j (r + 2 j + 1) x scale int32 elements (none where
 * r + j is a multiple of 5, so some blocks are empty), each naming r, j and
 * its index. */
static size_t a2av_count(int r, int j, size_t scale)
{
    return (r + j) % 5 == 0 ? 0 : (size_t)(r + 2 * j + 1) * scale;
}

static int32_t a2av_value(int r, int j, size_t k)
{
    return (int32_t)((r * 16 + j) * 1000000 + (int)(k % 999983));
}

/* One ps_all_to_all_v of those counts, every element checked. */
static int a2av_case(ctx_t *cx, size_t scale)
{
    int n = cx->size, me = cx->rank;
    size_t in_counts[64] = {0}, out_counts[64] = {0}, in_all = 0, out_all = 0;
    CHECK(n <= 64, "at most 64 ranks");
    for (int j = 0; j < n; j++) {
        in_counts[j] = a2av_count(me, j, scale);
        out_counts[j] = a2av_count(j, me, scale);
        in_all += in_counts[j];
        out_all += out_counts[j];
    }
    /* From ps_mem_alloc in the `peer` scenario's PS_TEST_SHARED runs. */
    TRY(arena_open(cx->comm, (in_all + out_all + 2) * sizeof(int32_t) + 4 * 4096));
    int32_t *in = case_alloc((in_all + 1) * sizeof(int32_t));
    int32_t *out = case_alloc((out_all + 1) * sizeof(int32_t));
    size_t at = 0;
    for (int j = 0; j < n; j++)
        for (size_t k = 0; k < in_counts[j]; k++)
            in[at++] = a2av_value(me, j, k);
    out[out_all] = -7; /* nothing may be written past the output */
    int rc = ps_all_to_all_v(cx->comm, out, out_counts, in, in_counts, PS_INT32, NULL);
    at = 0;
    int bad = rc != 0;
    for (int j = 0; !bad && j < n; j++)
        for (size_t k = 0; !bad && k < out_counts[j]; k++, at++)
            bad = out[at] != a2av_value(j, me, k);
    bad = bad || out[out_all] != -7;
    case_free(in);
    case_free(out);
    TRY(arena_close());
    CHECK(!bad, "all_to_all_v x%zu: rc %d or element %zu wrong", scale, rc, at);
    return 0;
}

/* ps_all_to_all_v: uneven blocks, empty ones, small and of megabytes; counts
 * the ranks disagree on fail on every rank alike, naming the pair; argument
 * errors are refused before anything is sent; the job goes on. */
static int sc_all_to_all_v(ctx_t *cx)
{
    ps_comm_t *comm = cx->comm;
    int n = cx->size, me = cx->rank;
    TRY(a2av_case(cx, 1));
    TRY(a2av_case(cx, 100003));
    /* Even counts: read and written in place; in one buffer, the output padded. */
    for (int in_place = 0; in_place < 2; in_place++) {
        size_t three[64];
        int64_t a[192], b[192];
        for (int j = 0; j < n; j++)
            three[j] = 3;
        for (int k = 0; k < 3 * n; k++)
            a[k] = me * 1000 + k;
        int64_t *o = in_place ? a : b;
        CHECK_OK(ps_all_to_all_v(comm, o, three, a, three, PS_INT64, NULL));
        for (int k = 0; k < 3 * n; k++)
            CHECK(o[k] == (k / 3) * 1000 + me * 3 + k % 3, "even counts%s: element %d is %lld",
                  in_place ? " in place" : "", k, (long long)o[k]);
    }
    size_t zero[64] = {0}, one[64], two[64];
    for (int j = 0; j < n; j++)
        one[j] = two[j] = 1;
    CHECK_OK(ps_all_to_all_v(comm, NULL, zero, NULL, zero, PS_FLOAT64, NULL));
    if (n > 1) {
        /* Rank 0 expects 2 elements from rank 1, which sends it 1. */
        if (me == 0)
            two[1] = 2;
        double in[64] = {0}, out[65] = {0};
        clear_last_error();
        int rc = ps_all_to_all_v(comm, out, two, in, one, PS_FLOAT64, NULL);
        char msg[1024];
        last_error(msg, sizeof(msg));
        CHECK(rc == PS_EPRECOND, "disagreeing counts: %d (%s)", rc, ps_strerror(rc));
        CHECK(strstr(msg, "group rank 1 sends 1 elements to group rank 0, whose out_counts "
                          "expect 2"),
              "disagreeing counts: %s", msg);
    }
    float f[4] = {0};
    CHECK(ps_all_to_all_v(comm, f, NULL, f, one, PS_FLOAT32, NULL) == PS_EINVAL,
          "NULL out_counts: not PS_EINVAL");
    CHECK(ps_all_to_all_v(comm, NULL, one, f, one, PS_FLOAT32, NULL) == PS_EINVAL,
          "NULL output for counts: not PS_EINVAL");
    CHECK(ps_all_to_all_v(comm, f, one, f, one, (ps_dtype_t)99, NULL) == PS_EINVAL,
          "dtype 99: not PS_EINVAL");
    CHECK(ps_all_to_all_v(NULL, f, one, f, one, PS_FLOAT32, NULL) == PS_EPRECOND,
          "comm NULL: not PS_EPRECOND");
    int64_t v = me + 1;
    CHECK_OK(ps_all_reduce(comm, &v, 1, PS_INT64, PS_SUM, NULL));
    CHECK(v == (int64_t)n * (n + 1) / 2, "all_reduce after all_to_all_v: %lld", (long long)v);
    return 0;
}

/* How many mappings of paramsync segments (/dev/shm/paramsync.PID..., their
 * names carry their owners' pids) of `min` to `max` bytes this process has:
 * its own (own) or other processes' (the peer copies' mappings); or -1. */
static int segments_mapped(int own, size_t min, size_t max)
{
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f)
        return -1;
    char line[1024], mine[64];
    snprintf(mine, sizeof(mine), "/paramsync.%d.", (int)getpid());
    int n = 0;
    unsigned long lo, hi;
    while (fgets(line, sizeof(line), f))
        n += strstr(line, "/paramsync.") && (strstr(line, mine) != NULL) == own &&
             sscanf(line, "%lx-%lx", &lo, &hi) == 2 && hi - lo >= min && hi - lo <= max;
    fclose(f);
    return n;
}

/* An uneven all_to_all whose padded blocks are over the daemon's
 * --max-tensor-bytes (PS_TEST_MAX_TENSOR_BYTES) though its own bytes are
 * not: rank 0 sends rank 1 just over the limit's share of a rank, everyone
 * else one element. Every rank fails with PS_ENOMEM naming the limit, the
 * padded buffers are let go (ranks on two agents: ps_mem_alloc memory, no
 * longer mapped), and uneven calls within the limit go on right. */
static int sc_all_to_all_v_limit(ctx_t *cx)
{
    int n = cx->size, me = cx->rank;
    size_t limit = (size_t)env_int("PS_TEST_MAX_TENSOR_BYTES", 0);
    CHECK(limit && n >= 2 && n <= 64, "PS_TEST_MAX_TENSOR_BYTES and 2 to 64 ranks");
    size_t big = limit / ((size_t)n * sizeof(int32_t)) + 1, in_counts[64], out_counts[64];
    size_t in_all = 0, out_all = 0;
    for (int j = 0; j < n; j++) {
        in_counts[j] = me == 0 && j == 1 ? big : 1;
        out_counts[j] = me == 1 && j == 0 ? big : 1;
        in_all += in_counts[j];
        out_all += out_counts[j];
    }
    int32_t *in = xmalloc(in_all * sizeof(int32_t)), *out = xmalloc(out_all * sizeof(int32_t));
    memset(in, 0, in_all * sizeof(int32_t));
    for (int round = 0; round < 2; round++) {
        clear_last_error();
        int rc = ps_all_to_all_v(cx->comm, out, out_counts, in, in_counts, PS_INT32, NULL);
        char msg[1024];
        last_error(msg, sizeof(msg));
        CHECK(rc == PS_ENOMEM && strstr(msg, "--max-tensor-bytes"),
              "padded blocks over the limit, round %d: %d (%s): %s", round, rc, ps_strerror(rc),
              msg);
        /* Not kept for the next call: no segment that large is left mapped. */
        int left = segments_mapped(1, limit, SIZE_MAX);
        CHECK(left == 0,
              "padded blocks over the limit, round %d: %d segments of %zu bytes and "
              "more still mapped, want 0",
              round, left, limit);
        TRY(a2av_case(cx, 1));
        TRY(a2av_case(cx, 1000));
    }
    free(in);
    free(out);
    return 0;
}

/* PARAMSYNC_SCRATCH_BYTES (ranks on two agents, so the padded buffers are
 * ps_mem_alloc memory): an uneven all_to_all's two padded buffers (input
 * and output, each n blocks of the largest) are kept for the next call when
 * they are at most that size, and let go when larger, while the ones kept
 * before stay. */
static int sc_all_to_all_v_scratch(ctx_t *cx)
{
    int n = cx->size;
    size_t cap = (size_t)env_int("PARAMSYNC_SCRATCH_BYTES", 0), page = (size_t)getpagesize();
    CHECK(cap > page && n <= 64, "PARAMSYNC_SCRATCH_BYTES over a page, and at most 64 ranks");
    size_t most = 0; /* the largest block at scale 1 */
    for (int r = 0; r < n; r++)
        for (int j = 0; j < n; j++)
            most = a2av_count(r, j, 1) > most ? a2av_count(r, j, 1) : most;
    size_t per = (size_t)n * most * sizeof(int32_t); /* padded bytes per unit of scale */
    size_t under = (cap - page) / per, over = cap / per + 1;
    size_t under_bytes = (under * per + page - 1) / page * page;
    size_t over_bytes = (over * per + page - 1) / page * page;
    const struct {
        size_t scale, bytes;
        int want;
    } call[] = {{under, under_bytes, 2}, {over, over_bytes, 0}};
    for (int round = 0; round < 2; round++)
        for (int i = 0; i < 2; i++) {
            TRY(a2av_case(cx, call[i].scale));
            int got = segments_mapped(1, call[i].bytes, call[i].bytes);
            CHECK(got == call[i].want,
                  "round %d: %d segments of %zu bytes (the padded buffers; at most %zu kept) "
                  "mapped after the call, want %d",
                  round, got, call[i].bytes, cap, call[i].want);
        }
    int kept = segments_mapped(1, under_bytes, under_bytes);
    CHECK(kept == 2, "the smaller padded buffers gone after a larger call: %d of 2", kept);
    return 0;
}

/* Blocks of --ring-min-bytes (1 MiB) and more, which --ring auto sends
 * straight between the agents (the mesh); odd counts, so that no step
 * boundary lines up with a block's; one of them async. */
static int sc_all_to_all_large(ctx_t *cx)
{
    TRY(run_case(cx, K_ALL_TO_ALL, PS_FLOAT32, PS_SUM, (1u << 18) + 3, 0, NULL, 0));
    TRY(run_case(cx, K_ALL_TO_ALL, PS_INT64, PS_SUM, (3u << 17) + 1, 0, NULL, 1));
    TRY(run_case(cx, K_ALL_TO_ALL, PS_INT8, PS_SUM, (3u << 20) + 7, 0, NULL, 0));
    return 0;
}

/* Blocks of --ring-min-bytes (1 MiB) and more, which --ring auto sends round
 * the ring from 2 ranks per agent; odd counts, so that no step boundary
 * lines up with a block's; one of them async, one MIN. */
static int sc_reduce_scatter_large(ctx_t *cx)
{
    TRY(run_case(cx, K_REDUCE_SCATTER, PS_FLOAT32, PS_SUM, (1u << 18) + 3, 0, NULL, 0));
    TRY(run_case(cx, K_REDUCE_SCATTER, PS_INT64, PS_MIN, (3u << 17) + 1, 0, NULL, 1));
    return 0;
}

/* Multi-step all_gathers of ranks forwarded to another agent's hub, their
 * input frames sent while the hub streams the output: each rank's block
 * spans more steps than the hub's window, so a forwarded rank's first step
 * waits for it to take the earlier ranks' output. The agent forwarding it
 * must read the hub's frames while it passes the rank's frames on (it once
 * sent the second frame before reading any, and hung about one run in
 * two). Repeated: the frames' timing varies from call to call. */
static int sc_forward_stream(ctx_t *cx)
{
    for (int i = 0; i < 12; i++)
        TRY(run_case(cx, K_ALL_GATHER, PS_FLOAT32, PS_SUM, (5u << 18) + (unsigned)i, 0, NULL, 0));
    return 0;
}

/* A barrier holds every rank until the last arrives: rank r arrives about
 * r*150 ms after the others, and none may leave before the last rank's
 * arrival. Arrivals are stamped on CLOCK_MONOTONIC, one clock for every
 * process of the host (the ranks of these tests share one), and gathered:
 * the check does not depend on when each rank left the barrier before
 * (under ASan and load those releases were seen up to 100 ms apart). */
static int sc_barrier(ctx_t *cx)
{
    const int step = 150;
    int64_t arrived[1024];
    CHECK(cx->size <= 1024, "barrier: %d ranks, at most 1024 here", cx->size);
    for (int round = 0; round < 3; round++) {
        CHECK_OK(ps_barrier(cx->comm, NULL)); /* line everyone up */
        sleep_ms(step * cx->rank);
        int64_t mine = now_us();
        CHECK_OK(ps_barrier(cx->comm, NULL));
        int64_t left = now_us();
        CHECK_OK(ps_all_gather(cx->comm, arrived, &mine, 1, PS_INT64, NULL));
        int last = 0;
        for (int r = 1; r < cx->size; r++)
            if (arrived[r] > arrived[last])
                last = r;
        CHECK(left >= arrived[last],
              "round %d: left the barrier %lld us before rank %d arrived at it", round,
              (long long)(arrived[last] - left), last);
    }
    for (int i = 0; i < 20; i++)
        CHECK_OK(ps_barrier(cx->comm, NULL));
    return 0;
}

/* The control words of this process's doorbell segments (layout in
 * proto/paramsync/v1/doorbell.h), up to max of them: the library maps each
 * under its own /dev/shm/paramsync.PID.* name (unlinked by the agent, so
 * "(deleted)"). Returns how many are mapped. */
static int doorbell_ctls(const ps_doorbell_ctl_t **ctls, int max)
{
    FILE *f = fopen("/proc/self/maps", "r");
    char line[512], pre[64];
    int n = 0;
    snprintf(pre, sizeof(pre), "/dev/shm/paramsync.%d.", (int)getpid());
    while (f && fgets(line, sizeof(line), f)) {
        unsigned long lo, hi;
        if (strstr(line, pre) && sscanf(line, "%lx-%lx", &lo, &hi) == 2 &&
            hi - lo == PS_DOORBELL_SIZE && n < max)
            ctls[n++] = (const ps_doorbell_ctl_t *)(uintptr_t)(lo + PS_DOORBELL_CTL);
    }
    if (f)
        fclose(f);
    return n;
}

/* Requests rung (resp: answered) on every doorbell of this process. */
static uint32_t doorbells_rung(int resp)
{
    const ps_doorbell_ctl_t *ctls[16];
    int n = doorbell_ctls(ctls, 16);
    uint32_t sum = 0;
    for (int i = 0; i < n; i++)
        sum += __atomic_load_n(resp ? &ctls[i]->resp : &ctls[i]->req, __ATOMIC_ACQUIRE);
    return sum;
}

/* The doorbell that served the most requests (the one every blocking
 * collective claims first), or NULL when none is mapped. */
static const ps_doorbell_ctl_t *doorbell_ctl(void)
{
    const ps_doorbell_ctl_t *ctls[16], *best = NULL;
    int n = doorbell_ctls(ctls, 16);
    for (int i = 0; i < n; i++)
        if (!best || __atomic_load_n(&ctls[i]->req, __ATOMIC_ACQUIRE) >
                         __atomic_load_n(&best->req, __ATOMIC_ACQUIRE))
            best = ctls[i];
    return best;
}

/* Collectives in flight side by side each ring a doorbell of their own, up
 * to the agent's PS_HUB_DOORBELLS (4) per rank; one more takes a call. The
 * last rank starts its five async all_reduces late, so that on every other
 * rank all five are waiting at once: four doorbells there, each rung once a
 * round. Every result is checked. */
static int doorbell_inflight(ctx_t *cx, int mapped)
{
    enum { ROUNDS = 3, K = 5, AGENT_DOORBELLS = 4 };
    int n = cx->size, me = cx->rank, late = me == n - 1;
    uint32_t before = doorbells_rung(0);
    for (int round = 0; round < ROUNDS; round++) {
        int64_t v[K];
        ps_work_t *w[K];
        if (late)
            sleep_ms(150);
        for (int k = 0; k < K; k++) {
            v[k] = me * (k + 1) + round;
            CHECK_OK(ps_iall_reduce(cx->comm, &v[k], 1, PS_INT64, PS_SUM, NULL, &w[k]));
        }
        for (int k = 0; k < K; k++) {
            CHECK_OK(ps_work_wait(w[k]));
            ps_work_free(w[k]);
            int64_t want = (int64_t)n * (n - 1) / 2 * (k + 1) + (int64_t)n * round;
            CHECK(v[k] == want,
                  "round %d: async all_reduce %d of %d in flight gave %lld, want %lld", round, k, K,
                  (long long)v[k], (long long)want);
        }
    }
    if (!mapped || late || n < 2)
        return ps_barrier(cx->comm, NULL);
    const ps_doorbell_ctl_t *ctls[16];
    int have = doorbell_ctls(ctls, 16);
    uint32_t rung = doorbells_rung(0) - before;
    CHECK(have == AGENT_DOORBELLS,
          "%d doorbells mapped after %d collectives in flight at once, want the agent's %d", have,
          K, AGENT_DOORBELLS);
    CHECK(rung >= ROUNDS * AGENT_DOORBELLS && rung <= ROUNDS * K,
          "%u of %d async all_reduces (%d in flight at once) went through the doorbells, want "
          "%d to %d",
          rung, ROUNDS * K, K, ROUNDS * AGENT_DOORBELLS, ROUNDS * K);
    note("%u of %d async all_reduces in flight side by side went through %d doorbells", rung,
         ROUNDS * K, have);
    return ps_barrier(cx->comm, NULL);
}

/* Rings the doorbell by hand with header hd naming segment `name`, and
 * waits (5 s at most) for the answer: its code, or -1. */
static int doorbell_ring_raw(ps_doorbell_ctl_t *ctl, Paramsync__V1__CollectiveHeader *hd,
                             const char *name)
{
    hd->shm = (char *)name;
    size_t len = protobuf_c_message_get_packed_size(&hd->base);
    if (len > PS_DOORBELL_HEADER)
        return -1;
    protobuf_c_message_pack(&hd->base, ctl->header);
    ctl->header_len = (uint32_t)len;
    uint32_t req = __atomic_load_n(&ctl->req, __ATOMIC_RELAXED) + 1;
    __atomic_store_n(&ctl->req, req, __ATOMIC_RELEASE);
    ps_doorbell_futex(&ctl->req, FUTEX_WAKE, 1, NULL);
    for (int64_t end = now_ms() + 5000; now_ms() < end;) {
        if (__atomic_load_n(&ctl->resp, __ATOMIC_ACQUIRE) == req)
            return ctl->code;
        sleep_ms(1);
    }
    return -1;
}

/* A doorbell request may name the doorbell or another segment of its own
 * rank (its payload segment, registered memory), never another rank's or
 * one that is not attached (the agent checks it as for any call): rank 1
 * tells rank 0 the name of its payload segment (in the header of its last
 * request), and rank 0 rings its own doorbell naming it, then a name nobody
 * attached. Both fail with a clear error, before anything is served, and
 * the job goes on. */
static int doorbell_foreign(ctx_t *cx, ps_doorbell_ctl_t *ctl)
{
    char theirs[64] = "";
    if (cx->rank == 1) {
        Paramsync__V1__CollectiveHeader *last =
            paramsync__v1__collective_header__unpack(NULL, ctl->header_len, ctl->header);
        if (last && strlen(last->shm) < sizeof(theirs))
            snprintf(theirs, sizeof(theirs), "%s", last->shm);
        if (last)
            protobuf_c_message_free_unpacked(&last->base, NULL);
        CHECK(*theirs, "the last doorbell request's header names no segment");
    }
    CHECK_OK(ps_broadcast(cx->comm, theirs, sizeof(theirs), PS_UINT8, 1, NULL));
    CHECK(strncmp(theirs, "/paramsync.", 11) == 0, "rank 1's segment is called '%s'", theirs);
    if (cx->rank == 0) {
        /* The broadcast's header, as rank 0 packed it: the right job. */
        Paramsync__V1__CollectiveHeader *hd =
            paramsync__v1__collective_header__unpack(NULL, ctl->header_len, ctl->header);
        CHECK(hd != NULL, "cannot read back the last doorbell request");
        char *own = hd->shm;
        const char *names[] = {theirs, "/paramsync.0.0.attached-by-nobody"};
        int ret = 0;
        for (int i = 0; i < 2 && !ret; i++) {
            /* Rank 1's segment is "another rank's" when both ranks joined
             * this agent, "not attached" here when rank 1 is on another. */
            int code = doorbell_ring_raw(ctl, hd, names[i]);
            if (code != 3 /* INVALID_ARGUMENT */ ||
                !(strstr(ctl->message, "another rank") || strstr(ctl->message, "not attached")))
                ret = fail("a doorbell request naming %s: code %d (%s), want INVALID_ARGUMENT "
                           "naming the rule",
                           names[i], code, code >= 0 ? ctl->message : "no answer in 5 s");
        }
        hd->shm = own;
        protobuf_c_message_free_unpacked(&hd->base, NULL);
        if (ret)
            return ret;
    }
    return ps_barrier(cx->comm, NULL);
}

/* One small collective of kind k (int32 elements, one per rank and block)
 * with root `root`, its result checked. */
static int arrival_call(ctx_t *cx, kind_t k, int root)
{
    enum { MAXN = 64 };
    int n = cx->size, me = cx->rank;
    int32_t in[MAXN], out[MAXN], v = me + 1;
    CHECK(n <= MAXN, "arrival_order: %d ranks, at most %d here", n, MAXN);
    for (int i = 0; i < n; i++) {
        in[i] = me * 100 + i;
        out[i] = -1;
    }
    switch (k) {
    case K_BROADCAST:
        v = me == root ? 77 : -1;
        CHECK_OK(ps_broadcast(cx->comm, &v, 1, PS_INT32, root, NULL));
        CHECK(v == 77, "broadcast from %d gave %d", root, v);
        break;
    case K_ALL_REDUCE:
        CHECK_OK(ps_all_reduce(cx->comm, &v, 1, PS_INT32, PS_SUM, NULL));
        CHECK(v == n * (n + 1) / 2, "all_reduce gave %d, want %d", v, n * (n + 1) / 2);
        break;
    case K_REDUCE:
        CHECK_OK(ps_reduce_to(cx->comm, &v, 1, PS_INT32, PS_SUM, root, NULL));
        CHECK(me != root || v == n * (n + 1) / 2, "reduce to %d gave %d", root, v);
        break;
    case K_ALL_GATHER:
        CHECK_OK(ps_all_gather(cx->comm, out, &v, 1, PS_INT32, NULL));
        for (int i = 0; i < n; i++)
            CHECK(out[i] == i + 1, "all_gather block %d is %d", i, out[i]);
        break;
    case K_GATHER:
        CHECK_OK(ps_gather(cx->comm, me == root ? out : NULL, &v, 1, PS_INT32, root, NULL));
        for (int i = 0; me == root && i < n; i++)
            CHECK(out[i] == i + 1, "gather to %d: block %d is %d", root, i, out[i]);
        break;
    case K_SCATTER:
        v = -1;
        CHECK_OK(ps_scatter(cx->comm, &v, me == root ? in : NULL, 1, PS_INT32, root, NULL));
        CHECK(v == root * 100 + me, "scatter from %d gave %d", root, v);
        break;
    default: /* all_to_all */
        CHECK_OK(ps_all_to_all(cx->comm, out, in, 1, PS_INT32, NULL));
        for (int j = 0; j < n; j++)
            CHECK(out[j] == j * 100 + me, "all_to_all block %d is %d", j, out[j]);
        break;
    }
    return 0;
}

/* Every order of arrival wakes the ranks that came first as soon as the last
 * comes: small collectives of each kind, the root (or rank 0) arriving last
 * and then first, the others LATE_MS later. A rank left asleep after the last
 * arrival (a lost wake-up) only wakes to the hub's one-second liveness
 * check, so the early ranks' calls would take about a second; with every
 * wake-up they take about LATE_MS. Of ROUNDS rounds per case the fastest
 * must be under LIMIT_MS (far from both), so one round slowed by the
 * machine does not fail it. */
static int sc_arrival_order(ctx_t *cx)
{
    enum { ROUNDS = 3, LATE_MS = 20, LIMIT_MS = 700 };
    static const kind_t kinds[] = {K_BROADCAST, K_ALL_REDUCE, K_REDUCE,    K_ALL_GATHER,
                                   K_GATHER,    K_SCATTER,    K_ALL_TO_ALL};
    int n = cx->size, me = cx->rank;
    for (size_t k = 0; k < sizeof(kinds) / sizeof(kinds[0]); k++) {
        for (int order = 0; order < 2; order++) {
            int root = order == 0 ? 0 : n - 1;
            int late = order == 0 ? root : (root + 1) % n; /* root last, then root first */
            int64_t best = INT64_MAX;
            for (int round = 0; round < ROUNDS; round++) {
                CHECK_OK(ps_barrier(cx->comm, NULL));
                if (me == late)
                    sleep_ms(LATE_MS);
                int64_t t0 = now_us();
                TRY(arrival_call(cx, kinds[k], root));
                int64_t took = now_us() - t0;
                if (took < best)
                    best = took;
            }
            CHECK(me == late || best < (int64_t)LIMIT_MS * 1000,
                  "%s, root %d, rank %d arriving last: rank %d's fastest of %d calls took %lld "
                  "ms (a wake-up lost?)",
                  kind_names[kinds[k]], root, late, me, ROUNDS, (long long)(best / 1000));
        }
    }
    return 0;
}

/* Small collectives of every kind, many times, each result checked. With
 * shared memory on they go through the doorbell: the scenario checks it is
 * mapped and, at the end, that it answered every request rung on it, and
 * at least one per round. Every tenth round an async all_reduce small
 * enough for the doorbell runs beside the blocking calls, so that one or
 * the other finds the doorbell busy and takes a gRPC call. */
static int sc_doorbell(ctx_t *cx)
{
    enum { ROUNDS = 150, NA = 200 };
    ps_comm_t *comm = cx->comm;
    int n = cx->size, me = cx->rank;
    const char *shm = getenv("PARAMSYNC_SHM");
    int want = !(shm && strcmp(shm, "0") == 0);
    CHECK_OK(ps_barrier(comm, NULL));
    const ps_doorbell_ctl_t *ctl = doorbell_ctl();
    CHECK((ctl != NULL) == want, "doorbell segment %s, expected %s with PARAMSYNC_SHM=%s",
          ctl ? "mapped" : "not mapped", want ? "mapped" : "none", shm ? shm : "(unset)");
    int64_t *gathered = xmalloc((size_t)n * 2 * sizeof(int64_t));
    int ret = 0;
    for (int round = 0; round < ROUNDS && !ret; round++) {
        int64_t big[NA], mine = me + round; /* 1600 bytes: doorbell-sized */
        ps_work_t *w = NULL;
        if (round % 10 == 0) {
            for (int i = 0; i < NA; i++)
                big[i] = me * 1000 + i;
            CHECK_OK(ps_iall_reduce(comm, big, NA, PS_INT64, PS_SUM, NULL, &w));
        }
        CHECK_OK(ps_barrier(comm, NULL));
        CHECK_OK(ps_all_reduce(comm, &mine, 1, PS_INT64, PS_SUM, NULL));
        int64_t want_sum = (int64_t)n * (n - 1) / 2 + (int64_t)n * round;
        CHECK(mine == want_sum, "round %d: all_reduce gave %lld, want %lld", round, (long long)mine,
              (long long)want_sum);
        int root = round % n;
        int64_t b[2] = {me == root ? round : -1, me == root ? -round : -1};
        CHECK_OK(ps_broadcast(comm, b, 2, PS_INT64, root, NULL));
        CHECK(b[0] == round && b[1] == -round, "round %d: broadcast from %d gave %lld, %lld", round,
              root, (long long)b[0], (long long)b[1]);
        int64_t in2[2] = {me, round};
        CHECK_OK(ps_all_gather(comm, gathered, in2, 2, PS_INT64, NULL));
        for (int r = 0; r < n; r++)
            CHECK(gathered[2 * r] == r && gathered[2 * r + 1] == round,
                  "round %d: all_gather block %d is %lld, %lld", round, r,
                  (long long)gathered[2 * r], (long long)gathered[2 * r + 1]);
        if (n >= 2 && me < n - n % 2) {
            int peer = me % 2 == 0 ? me + 1 : me - 1, src = -1;
            int32_t v = me * 100 + round, got = -1;
            if (me % 2 == 0) {
                CHECK_OK(ps_send(comm, &v, 1, PS_INT32, peer, round, NULL));
                CHECK_OK(ps_recv(comm, &got, 1, PS_INT32, peer, round, NULL, &src));
            } else {
                CHECK_OK(ps_recv(comm, &got, 1, PS_INT32, peer, round, NULL, &src));
                CHECK_OK(ps_send(comm, &v, 1, PS_INT32, peer, round, NULL));
            }
            CHECK(got == peer * 100 + round && src == peer,
                  "round %d: recv from %d gave %d (source %d)", round, peer, got, src);
        }
        if (w) {
            CHECK_OK(ps_work_wait(w));
            for (int i = 0; i < NA && !ret; i++)
                if (big[i] != (int64_t)n * (n - 1) / 2 * 1000 + (int64_t)n * i)
                    ret = fail("round %d: iall_reduce element %d is %lld", round, i,
                               (long long)big[i]);
            ps_work_free(w);
        }
    }
    free(gathered);
    /* Past the doorbell's own 2 KiB, up to 800 KB (under --ring-min-bytes):
     * the input and output go through the payload segment (or registered
     * memory), and still no call is made. Every kind once, every result
     * checked. */
    static const struct {
        kind_t kind;
        size_t count;
    } mid[] = {
        {K_ALL_REDUCE, 4096},    {K_BROADCAST, 20000}, {K_REDUCE, 700},
        {K_ALL_GATHER, 1500},    {K_GATHER, 3000},     {K_SCATTER, 3000},
        {K_REDUCE_SCATTER, 600}, {K_ALL_TO_ALL, 600},  {K_ALL_REDUCE, 200000},
    };
    uint32_t before = doorbells_rung(0);
    for (size_t i = 0; i < sizeof(mid) / sizeof(mid[0]) && !ret; i++)
        ret = run_case(cx, mid[i].kind, PS_FLOAT32, PS_SUM, mid[i].count, 1 % n, NULL, 0);
    if (!ret && ctl) {
        uint32_t rung = doorbells_rung(0) - before;
        CHECK(rung == sizeof(mid) / sizeof(mid[0]),
              "%u of %zu collectives of 2.4 KB to 800 KB went through the doorbell", rung,
              sizeof(mid) / sizeof(mid[0]));
    }
    if (!ret)
        ret = doorbell_inflight(cx, ctl != NULL);
    if (!ret && ctl) {
        uint32_t req = doorbells_rung(0), resp = doorbells_rung(1);
        CHECK(resp == req && req >= ROUNDS,
              "the doorbell was rung %u times and answered %u times; want at least %d, all "
              "answered",
              req, resp, ROUNDS);
        note("%u collectives went through the doorbell", req);
    }
    if (!ret && ctl && n < 2)
        note("SKIPPED: a doorbell naming another rank's segment needs two ranks");
    else if (!ret && ctl)
        ret = doorbell_foreign(cx, (ps_doorbell_ctl_t *)(uintptr_t)doorbell_ctl());
    return ret;
}

/* Large collectives in flight side by side: two async all_reduces of 256
 * KiB and two all_gathers of 64 KiB each (as many as a rank has doorbells
 * and payload segments), on buffers from malloc, started at once (the last
 * rank starts late, so that on the others all wait together).
 * Every result is checked. With shared memory each takes a payload segment
 * of its own (the first, or a spare), never gRPC frames: the test
 * registration checks the daemon received no payload byte from a worker as
 * frames. Spares come once the first segment is attached (the agent's answer
 * says how many slots it keeps): a blocking all_reduce makes it first. */
static int sc_inflight(ctx_t *cx)
{
    enum { ROUNDS = 3, K = 2, COUNT = 65536 };
    ps_comm_t *comm = cx->comm;
    int n = cx->size, me = cx->rank;
    int32_t *buf = xmalloc((size_t)K * COUNT * 4), *want = xmalloc((size_t)COUNT * 4);
    int64_t *gin = xmalloc((size_t)K * COUNT / 8 * 8),
            *gout = xmalloc((size_t)K * n * COUNT / 8 * 8);
    int ret = 0;
    fill(PS_INT32, PS_SUM, 99, me, buf, 0, COUNT);
    CHECK_OK(ps_all_reduce(comm, buf, COUNT, PS_INT32, PS_SUM, NULL));
    expect_reduced(PS_INT32, PS_SUM, 99, n, want, 0, COUNT);
    CHECK(!compare("all_reduce before the async ones", PS_INT32, buf, want, COUNT),
          "the blocking all_reduce is wrong");
    for (int round = 0; round < ROUNDS && !ret; round++) {
        ps_work_t *w[2 * K];
        for (int k = 0; k < K; k++) {
            fill(PS_INT32, PS_SUM, (unsigned)(round * K + k), me, buf + (size_t)k * COUNT, 0,
                 COUNT);
            fill(PS_INT64, PS_SUM, (unsigned)(round * K + k), me, gin + (size_t)k * COUNT / 8, 0,
                 COUNT / 8);
        }
        if (me == n - 1)
            sleep_ms(150);
        for (int k = 0; k < K; k++) {
            CHECK_OK(ps_iall_reduce(comm, buf + (size_t)k * COUNT, COUNT, PS_INT32, PS_SUM, NULL,
                                    &w[2 * k]));
            CHECK_OK(ps_iall_gather(comm, gout + (size_t)k * n * COUNT / 8,
                                    gin + (size_t)k * COUNT / 8, COUNT / 8, PS_INT64, NULL,
                                    &w[2 * k + 1]));
        }
        for (int i = 0; i < 2 * K; i++) {
            int rc = ps_work_wait(w[i]);
            if (rc != 0 && !ret)
                ret = fail("round %d: async %s %d: %d (%s)", round,
                           i % 2 ? "all_gather" : "all_reduce", i / 2, rc, ps_strerror(rc));
            ps_work_free(w[i]);
        }
        for (int k = 0; k < K && !ret; k++) {
            expect_reduced(PS_INT32, PS_SUM, (unsigned)(round * K + k), n, want, 0, COUNT);
            ret = compare("async all_reduce beside others", PS_INT32, buf + (size_t)k * COUNT, want,
                          COUNT);
            for (int r = 0; r < n && !ret; r++) {
                int64_t g[COUNT / 8];
                fill(PS_INT64, PS_SUM, (unsigned)(round * K + k), r, g, 0, COUNT / 8);
                ret = compare("async all_gather beside others", PS_INT64,
                              gout + ((size_t)k * n + (size_t)r) * COUNT / 8, g, COUNT / 8);
            }
        }
    }
    free(buf);
    free(want);
    free(gin);
    free(gout);
    if (!ret)
        note("%d rounds of %d all_reduces (256 KiB) and %d all_gathers in flight at once checked",
             ROUNDS, K, K);
    return ret;
}

/* Pairs (0,1), (2,3), ...: the even rank sends, the odd one receives and
 * sends back; then a ring with isend/irecv so that every rank sends and
 * receives at once. */
static int sc_send_recv(ctx_t *cx)
{
    int n = cx->size, me = cx->rank;
    if (n < 2) {
        note("SKIPPED: send/recv needs two ranks");
        return SKIP;
    }
    int partner = me % 2 == 0 ? me + 1 : me - 1;
    for (size_t d = 0; d < NDTYPES; d++) {
        ps_dtype_t dt = all_dtypes[d];
        if (g_light && !light_dtype(dt))
            continue;
        size_t esz = ps_dtype_size(dt);
        size_t counts[NSMALL + 1];
        memcpy(counts, small_counts, sizeof(small_counts));
        counts[NSMALL] = multi_count(dt);
        for (size_t s = 0; s < NSMALL + 1; s++) {
            size_t count = counts[s];
            if (partner >= n)
                continue; /* the odd one out of an odd world sits this out */
            uint8_t *mine = xmalloc(count * esz), *got = xmalloc(count * esz),
                    *want = xmalloc(count * esz);
            unsigned salt = cx->salt + (unsigned)(d * 31 + s);
            int tag = (int)(d * 10 + s), src = -2, rc, ret = 0;
            fill(dt, PS_SUM, salt, me, mine, 0, count);
            fill(dt, PS_SUM, salt, partner, want, 0, count);
            memset(got, 0xa5, count * esz);
            /* The even rank sends first, the odd one answers. */
            if (me % 2 == 0) {
                rc = ps_send(cx->comm, mine, count, dt, partner, tag, NULL);
                if (rc == 0)
                    rc = ps_recv(cx->comm, got, count, dt, partner, tag, NULL, &src);
            } else {
                rc = ps_recv(cx->comm, got, count, dt, partner, tag, NULL, &src);
                if (rc == 0)
                    rc = ps_send(cx->comm, mine, count, dt, partner, tag, NULL);
            }
            if (rc != 0)
                ret = fail("send/recv %s count %zu: %d (%s)", ps_dtype_name(dt), count, rc,
                           ps_strerror(rc));
            else if (src != partner)
                ret = fail("recv %s count %zu: source %d, want %d", ps_dtype_name(dt), count, src,
                           partner);
            else
                ret = compare("recv", dt, got, want, count);
            free(mine);
            free(got);
            free(want);
            if (ret)
                return ret;
        }
    }

    /* The ring, every rank sending and receiving at once, multi-frame. */
    size_t count = multi_count(PS_INT32);
    int32_t *out = xmalloc(count * 4), *got = xmalloc(count * 4), *want = xmalloc(count * 4);
    int next = (me + 1) % n, prev = (me + n - 1) % n, ret = 0;
    fill(PS_INT32, PS_SUM, cx->salt, me, out, 0, count);
    fill(PS_INT32, PS_SUM, cx->salt, prev, want, 0, count);
    ps_work_t *ws = NULL, *wr = NULL;
    int rc = ps_isend(cx->comm, out, count, PS_INT32, next, 7, NULL, &ws);
    if (rc == 0)
        rc = ps_irecv(cx->comm, got, count, PS_INT32, prev, 7, NULL, &wr);
    int rr = wr ? ps_work_wait(wr) : rc, rs = ws ? ps_work_wait(ws) : rc;
    if (rc || rr || rs)
        ret = fail("ring: isend %d, irecv %d", rs, rr);
    else if (ps_work_source(wr) != prev)
        ret = fail("ring: irecv source %d, want %d", ps_work_source(wr), prev);
    else
        ret = compare("ring", PS_INT32, got, want, count);
    ps_work_free(ws);
    ps_work_free(wr);
    free(out);
    free(got);
    free(want);
    return ret;
}

/*
 * A worker may rewrite its shared segment as soon as a call returns, so the
 * daemon must not answer it while its input is still on the way to another
 * rank. Ranks 1.. send through shared memory, back to back, with new data
 * each round; rank 0 takes the gRPC path (slower to drain) and checks every
 * byte: sends, gather and reduce to rank 0, and a broadcast from rank 1.
 */
static int sc_shm_reuse(ctx_t *cx)
{
    int n = cx->size, me = cx->rank;
    if (n < 2) {
        note("SKIPPED: needs two ranks");
        return SKIP;
    }
    if (me == 0)
        setenv("PARAMSYNC_SHM", "0", 1); /* read per call; nothing else runs yet */
    enum { ROUNDS = 4 };
    const size_t count = 4 * MIB / 4 + 3; /* 16 MiB of int32, odd */
    const size_t bytes = count * 4;
    uint8_t *in = xmalloc(bytes), *want = xmalloc(bytes);
    uint8_t *out = xmalloc(bytes * (size_t)n), *wantn = xmalloc(bytes * (size_t)n);
    int ret = 0;
    for (int k = 0; k < ROUNDS && !ret; k++) {
        unsigned salt = cx->salt + 1000u + (unsigned)k;
        if (me != 0) {
            fill(PS_INT32, PS_SUM, salt, me, in, 0, count);
            CHECK_OK(ps_send(cx->comm, in, count, PS_INT32, 0, k, NULL));
            continue;
        }
        for (int r = 1; r < n && !ret; r++) {
            CHECK_OK(ps_recv(cx->comm, out, count, PS_INT32, r, k, NULL, NULL));
            fill(PS_INT32, PS_SUM, salt, r, want, 0, count);
            ret = compare("send", PS_INT32, out, want, count);
        }
    }
    for (int k = 0; k < ROUNDS && !ret; k++) {
        unsigned salt = cx->salt + 2000u + (unsigned)k;
        fill(PS_INT32, PS_SUM, salt, me, in, 0, count);
        CHECK_OK(ps_gather(cx->comm, me == 0 ? out : NULL, in, count, PS_INT32, 0, NULL));
        for (int r = 0; r < n && me == 0; r++)
            fill(PS_INT32, PS_SUM, salt, r, wantn + (size_t)r * bytes, 0, count);
        if (me == 0)
            ret = compare("gather", PS_INT32, out, wantn, count * (size_t)n);
    }
    for (int k = 0; k < ROUNDS && !ret; k++) {
        unsigned salt = cx->salt + 3000u + (unsigned)k;
        fill(PS_INT32, PS_SUM, salt, me, in, 0, count);
        CHECK_OK(ps_reduce_to(cx->comm, in, count, PS_INT32, PS_SUM, 0, NULL));
        if (me == 0) {
            expect_reduced(PS_INT32, PS_SUM, salt, n, want, 0, count);
            ret = compare("reduce", PS_INT32, in, want, count);
        }
    }
    for (int k = 0; k < ROUNDS && !ret; k++) {
        unsigned salt = cx->salt + 4000u + (unsigned)k;
        fill(PS_INT32, PS_SUM, salt, 1, want, 0, count);
        if (me == 1)
            memcpy(in, want, bytes);
        else
            memset(in, 0xa5, bytes);
        CHECK_OK(ps_broadcast(cx->comm, in, count, PS_INT32, 1, NULL));
        ret = compare("broadcast", PS_INT32, in, want, count);
    }
    free(in);
    free(want);
    free(out);
    free(wantn);
    return ret;
}

static int sc_collectives(ctx_t *cx)
{
    int (*const fns[])(ctx_t *) = {sc_all_reduce,     sc_reduce,     sc_broadcast,
                                   sc_all_gather,     sc_gather,     sc_scatter,
                                   sc_reduce_scatter, sc_all_to_all, sc_barrier};
    for (size_t i = 0; i < sizeof(fns) / sizeof(fns[0]); i++)
        if (fns[i](cx) != 0)
            return -1;
    if (cx->size < 2) {
        note("send/recv not run: it needs two ranks");
        return 0;
    }
    return sc_send_recv(cx);
}

/* Every kind with buffers large enough (32 MiB and more, input and output
 * together, at p = 4) for the direct path: the agent reads and writes this
 * process's own malloc'd buffers through its process segment (client/shm.c).
 * Blocks of an odd count, so no step or page boundary lines up; the root the
 * last rank; every other kind async. Which path carried the bytes is the
 * harness's --metric checks. As small as the path allows: it runs under
 * ASan too. */
/* Whether a process that is not our ancestor may read our memory with
 * process_vm_readv, as the agent must for the direct path: a child reads its
 * parent (no ancestor exemption under Yama, blocked like the agent by
 * seccomp or a missing capability). */
static int others_may_read_us(void)
{
    static const uint64_t word = 0x7061726173796e63u;
    pid_t parent = getpid(), child = fork();
    if (child == 0) {
        uint64_t seen = 0;
        struct iovec local = {&seen, sizeof(seen)}, remote = {(void *)&word, sizeof(word)};
        _exit(process_vm_readv(parent, &local, 1, &remote, 1, 0) == sizeof(seen) && seen == word
                  ? 0
                  : 1);
    }
    int status = 0;
    return child > 0 && waitpid(child, &status, 0) == child && WIFEXITED(status) &&
           WEXITSTATUS(status) == 0;
}

/* Whether the direct path cannot run here (another process may not read
 * ours); says SKIPPED then. */
static int direct_skipped(void)
{
    if (others_may_read_us())
        return 0;
    note("SKIPPED: this machine does not let another process read ours "
         "(process_vm_readv: ptrace rules or seccomp), which the direct path needs");
    return 1;
}

/* KiB of huge pages under the mapping of /proc/self/smaps that holds p, or
 * -1 when none does. */
static long huge_kib(const void *p)
{
    FILE *f = fopen("/proc/self/smaps", "r");
    char line[512];
    int in = 0;
    long kib = -1;
    while (f && kib < 0 && fgets(line, sizeof(line), f)) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2)
            in = (uintptr_t)p >= lo && (uintptr_t)p < hi;
        else if (in && sscanf(line, "AnonHugePages: %ld kB", &kib) != 1)
            kib = -1;
    }
    if (f)
        fclose(f);
    return kib;
}

/* Whether this kernel collapses anonymous memory into huge pages on request
 * (MADV_COLLAPSE, Linux 6.1; THP not "never"): tried on a scratch region. */
static int collapse_works(void)
{
    size_t len = 4u << 20;
    uint8_t *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED)
        return 0;
    uint8_t *at = (uint8_t *)(((uintptr_t)m + (2u << 20) - 1) & ~(uintptr_t)((2u << 20) - 1));
    memset(m, 1, len);
    int ok = madvise(at, 2u << 20, 25 /* MADV_COLLAPSE */) == 0;
    munmap(m, len);
    return ok;
}

/* A buffer of small pages all_reduced directly twice: its whole 2 MiB pages
 * are huge after the second call (the client's MADV_COLLAPSE, from a
 * buffer's second direct call on) and not after the first; with
 * PARAMSYNC_SHM_COLLAPSE=0 or PARAMSYNC_SHM_DIRECT=0 never. Counted as the
 * growth of the huge pages of the buffer's mapping (/proc/self/smaps), where
 * the kernel gives huge pages only on request (THP "madvise"). */
static int check_collapse(ctx_t *cx)
{
    const char *env = getenv("PARAMSYNC_SHM_COLLAPSE"), *direct = getenv("PARAMSYNC_SHM_DIRECT");
    int off = (env && strcmp(env, "0") == 0) || (direct && strcmp(direct, "0") == 0);
    FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
    char mode[128] = "";
    if (f) {
        if (!fgets(mode, sizeof(mode), f))
            mode[0] = 0;
        fclose(f);
    }
    /* The check is collectives: every rank must decide alike, and a collapse
     * may fail on one rank only (no huge page free just then), so the ranks
     * agree on the least of their answers. */
    int32_t can = strstr(mode, "[madvise]") && collapse_works();
    int rc = ps_all_reduce(cx->comm, &can, 1, PS_INT32, PS_MIN, NULL);
    if (rc != 0)
        return fail("all_reduce of whether the huge-page check can run: %d (%s)", rc,
                    ps_strerror(rc));
    if (!can) {
        note("SKIPPED the huge-page check: it needs transparent huge pages on request only "
             "(here: %.40s) and a kernel that collapses memory on request (MADV_COLLAPSE, "
             "Linux 6.1), on every rank",
             mode[0] ? mode : "none");
        return 0;
    }
    /* 40 MiB (in and out together over 32) in a fresh mapping of its own, as
     * malloc gives large buffers, between two pages no mapping merges with
     * (the heap may hold huge pages from earlier cases). */
    const size_t count = (40 * MIB) / 4, page = 4096, len = count * 4 + 2 * page;
    uint8_t *map = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED)
        return fail("mmap of 40 MiB: %s", strerror(errno));
    mprotect(map, page, PROT_NONE);
    mprotect(map + len - page, page, PROT_NONE);
    int32_t *buf = (int32_t *)(map + page);
    long n = cx->size, kib[3] = {0, 0, 0};
    int ret = 0;
    for (int k = 0; k < 2 && !ret; k++) {
        for (size_t i = 0; i < count; i++)
            buf[i] = (int32_t)(i % 1000) + cx->rank;
        kib[k] = k ? kib[k] : huge_kib(buf);
        ret = ps_all_reduce(cx->comm, buf, count, PS_INT32, PS_SUM, NULL);
        kib[k + 1] = huge_kib(buf);
        for (size_t i = 0; i < count && !ret; i++)
            if (buf[i] != (int32_t)(n * (int32_t)(i % 1000) + n * (n - 1) / 2))
                ret = fail("all_reduce %d of 40 MiB: element %zu is %d", k, i, buf[i]);
    }
    long first = kib[1] - kib[0], second = kib[2] - kib[0];
    if (ret == 0 && first != 0)
        ret = fail("after one direct all_reduce of 40 MiB the buffer's mapping gained %ld KiB "
                   "of huge pages, want none until the second",
                   first);
    if (ret == 0 && off && second != 0)
        ret = fail("with the collapse off, the buffer's mapping gained %ld KiB of huge pages",
                   second);
    if (ret == 0 && !off && second < 36 * 1024)
        ret = fail("after two direct all_reduces of 40 MiB the buffer's mapping gained %ld KiB "
                   "of huge pages, want the buffer's whole 2 MiB pages (36 MiB or more)",
                   second);
    if (ret == 0)
        note("direct all_reduces of 40 MiB: huge pages of its mapping %ld, %ld, %ld KiB", kib[0],
             kib[1], kib[2]);
    munmap(map, len);
    return ret;
}

static int sc_direct(ctx_t *cx)
{
    if (direct_skipped())
        return SKIP;
    const size_t count = (32 * MIB / 5) / 4 + 5; /* a block: 6.4 MiB of int32, odd */
    int n = cx->size;
    for (int k = K_ALL_REDUCE; k <= K_ALL_TO_ALL; k++) {
        /* Kinds whose block is all a rank sends or gets take 5 blocks. */
        size_t c = k == K_ALL_REDUCE || k == K_REDUCE || k == K_BROADCAST ? count * 5 : count;
        if (run_case(cx, (kind_t)k, PS_INT32, PS_SUM, c, n - 1, NULL, k & 1) != 0)
            return -1;
    }
    /* send/recv: every other rank to rank 0. */
    const size_t big = count * 5;
    int32_t *buf = xmalloc(big * 4), *want = xmalloc(big * 4);
    int ret = 0;
    for (int r = 1; r < n && !ret; r++) {
        unsigned salt = cx->salt + 5000u + (unsigned)r;
        if (cx->rank == r) {
            fill(PS_INT32, PS_SUM, salt, r, buf, 0, big);
            ret = ps_send(cx->comm, buf, big, PS_INT32, 0, r, NULL);
            if (ret)
                ret = fail("send of %zu int32 to rank 0: %d (%s)", big, ret, ps_strerror(ret));
        } else if (cx->rank == 0) {
            memset(buf, 0xa5, big * 4);
            fill(PS_INT32, PS_SUM, salt, r, want, 0, big);
            ret = ps_recv(cx->comm, buf, big, PS_INT32, r, r, NULL, NULL);
            ret =
                ret ? fail("recv of %zu int32 from rank %d: %d (%s)", big, r, ret, ps_strerror(ret))
                    : compare("recv", PS_INT32, buf, want, big);
        }
    }
    free(buf);
    free(want);
    return ret ? ret : check_collapse(cx);
}

/* One all_gather, gather or scatter in place, in torch's form: the input is
 * the rank's own block of the output (all_gather, gather's root), or the
 * root's output its block of the input (scatter); root the last rank, every
 * other one async. The blocks are checked, the caller's own included. */
static int run_in_place(ctx_t *cx, kind_t kind, size_t count, int async)
{
    ps_comm_t *comm = cx->comm;
    int me = cx->rank, n = cx->size, root = n - 1;
    size_t esz = 4, all = (size_t)n * count;
    unsigned salt = cx->salt * 131u + (unsigned)kind * 17u + (unsigned)count;
    char what[128];
    snprintf(what, sizeof(what), "%s%s in place, %zu int32", async ? "i" : "", kind_names[kind],
             count);
    TRY(arena_open(comm, 3 * all * esz));
    uint8_t *big = case_alloc(all * esz), *want = case_alloc(all * esz);
    uint8_t *own = big + (size_t)me * count * esz;
    memset(big, 0xa5, all * esz);
    for (int r = 0; r < n; r++)
        fill(PS_INT32, PS_SUM, salt, r, want + (size_t)r * count * esz, 0, count);
    ps_work_t *w = NULL;
    int rc = 0, ret = 0;
    uint8_t *got = big, *expect = want;
    size_t check = all;
    if (kind == K_SCATTER && me == root) {
        memcpy(big, want, all * esz); /* the root's blocks: block r for rank r */
        rc = async ? ps_iscatter(comm, own, big, count, PS_INT32, root, NULL, &w)
                   : ps_scatter(comm, own, big, count, PS_INT32, root, NULL);
    } else if (kind == K_SCATTER) {
        got = own;
        expect = want + (size_t)me * count * esz;
        check = count;
        rc = async ? ps_iscatter(comm, own, NULL, count, PS_INT32, root, NULL, &w)
                   : ps_scatter(comm, own, NULL, count, PS_INT32, root, NULL);
    } else {
        fill(PS_INT32, PS_SUM, salt, me, own, 0, count);
        if (kind == K_GATHER && me != root) { /* nothing comes back: the input stays */
            got = own;
            expect = want + (size_t)me * count * esz;
            check = count;
        }
        void *out = kind == K_GATHER && me != root ? NULL : big;
        rc = kind == K_ALL_GATHER
                 ? (async ? ps_iall_gather(comm, out, own, count, PS_INT32, NULL, &w)
                          : ps_all_gather(comm, out, own, count, PS_INT32, NULL))
                 : (async ? ps_igather(comm, out, own, count, PS_INT32, root, NULL, &w)
                          : ps_gather(comm, out, own, count, PS_INT32, root, NULL));
    }
    if (rc == 0 && w)
        rc = ps_work_wait(w);
    ps_work_free(w);
    if (rc != 0)
        ret = fail("%s: %d (%s)", what, rc, ps_strerror(rc));
    else
        ret = compare(what, PS_INT32, got, expect, check);
    case_free(big);
    case_free(want);
    if (arena_close() != 0)
        ret = -1;
    return ret;
}

/* all_gather, gather and scatter in place (run_in_place) with blocks of
 * count int32, every other one async, the first when first is odd. */
static int run_in_place_kinds(ctx_t *cx, size_t count, int first)
{
    static const kind_t kinds[] = {K_ALL_GATHER, K_GATHER, K_SCATTER};
    for (int k = 0; k < 3; k++)
        TRY(run_in_place(cx, kinds[k], count, (first + k) & 1));
    return 0;
}

/* With PS_TEST_SHARED=1 the case buffers come from ps_mem_alloc memory (a
 * registered segment) until g_arena_comm is cleared: returns whether. */
static int arena_from_env(ctx_t *cx)
{
    if (!env_int("PS_TEST_SHARED", 0))
        return 0;
    g_arena_shared = 1;
    g_arena_comm = cx->comm;
    return 1;
}

/* In place at sizes that take every path: the doorbell's own payload, a
 * payload segment or registered memory, and (3 blocks of 12 MiB and more)
 * the direct path; from malloc'd buffers, or ps_mem_alloc memory
 * (arena_from_env). */
static int sc_in_place(ctx_t *cx)
{
    arena_from_env(cx);
    static const size_t counts[] = {1000, 300001, 12 * MIB / 4 + 5};
    int rc = 0;
    for (size_t i = 0; i < sizeof(counts) / sizeof(counts[0]) && rc == 0; i++)
        rc = run_in_place_kinds(cx, counts[i], (int)i);
    g_arena_comm = NULL;
    return rc;
}

/* In place with blocks of 12 MiB (and an odd few bytes): from malloc'd
 * buffers the direct path, or ps_mem_alloc memory (arena_from_env). The
 * harness's --metric checks that the agent wrote every block but the ranks'
 * own (own_block). */
static int sc_own_block(ctx_t *cx)
{
    if (!arena_from_env(cx) && direct_skipped())
        return SKIP;
    int rc = run_in_place_kinds(cx, 12 * MIB / 4 + 5, 0);
    g_arena_comm = NULL;
    return rc;
}

/* Makes this rank one the others may not read with process_vm_readv: as
 * root, another user (which the others, root, may read, but which may not
 * read them); else not dumpable. 0, or -1 with the reason. */
static int peer_unreadable(void)
{
    if (geteuid() == 0)
        return setresgid(65534, 65534, 65534) == 0 && setresuid(65534, 65534, 65534) == 0 ? 0 : -1;
    return prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
}

/* An all_to_all of count int32 a block from ps_mem_alloc memory into malloc'd
 * memory, checked: the agent takes such memory in place only where one
 * allocation holds input and output, so the ranks copy rank to rank. */
static int peer_two_places(ctx_t *cx, size_t count)
{
    int n = cx->size, me = cx->rank;
    int32_t *in = ps_mem_alloc(cx->comm, (size_t)n * count * sizeof(int32_t));
    int32_t *out = xmalloc((size_t)n * count * sizeof(int32_t));
    CHECK(in, "ps_mem_alloc returned NULL");
    for (size_t k = 0; k < (size_t)n * count; k++)
        in[k] = me * 1000 + (int32_t)(k / count) + (int32_t)(k % count % 7) * 100000;
    int rc = ps_all_to_all(cx->comm, out, in, count, PS_INT32, NULL);
    size_t k = 0;
    for (; rc == 0 && k < (size_t)n * count; k++)
        if (out[k] != (int32_t)(k / count) * 1000 + me + (int32_t)(k % count % 7) * 100000)
            break;
    int good = rc == 0 && k == (size_t)n * count;
    free(out);
    CHECK_OK(ps_mem_free(cx->comm, in));
    CHECK(good, "all_to_all from ps_mem_alloc into malloc: rc %d, element %zu wrong", rc, k);
    return 0;
}

/* The `peer` scenario: all_to_all, all_gather and scatter of 5 MiB and some,
 * gather of 10 (its floor is 8), which ranks that share an agent copy rank
 * to rank (client/peer.c): odd blocks, out of place and in place, blocking
 * and async, in the world and in a group of the ranks in reverse, each
 * result checked whole; and one below that size, through the agent. The
 * harness's --metric checks which way they went. PS_TEST_PEER_UNREADABLE=1:
 * rank 1 first makes itself unreadable (peer_unreadable), so that calls
 * that read it fall back to the agent with the same results.
 * PS_TEST_SHARED=1: buffers from ps_mem_alloc (and one all_to_all from it
 * into malloc'd memory). */
static int sc_peer(ctx_t *cx)
{
    if (cx->size < 2) {
        note("SKIPPED: needs two ranks");
        return SKIP;
    }
    ps_comm_t *comm = cx->comm;
    arena_from_env(cx);
    if (env_int("PS_TEST_PEER_UNREADABLE", 0) && cx->rank == 1 && peer_unreadable() != 0)
        return fail("cannot make rank 1 unreadable: %s", strerror(errno));
    int rev[64], n = cx->size < 64 ? cx->size : 64;
    for (int i = 0; i < n; i++)
        rev[i] = n - 1 - i;
    ps_group_t *grev;
    CHECK_OK(ps_new_group(comm, rev, n, &grev));
    const size_t big = (5u << 18) / (size_t)n + 7; /* int32: 5 MiB and some in all */
    for (int async = 0; async < 2; async++) {
        TRY(run_case(cx, K_ALL_TO_ALL, PS_INT32, PS_SUM, big, 0, NULL, async));
        TRY(run_case(cx, K_ALL_GATHER, PS_INT32, PS_SUM, big, 0, NULL, async));
        TRY(run_case(cx, K_ALL_TO_ALL, PS_INT8, PS_SUM, 4 * big + 1, 0, grev, async));
        TRY(run_case(cx, K_ALL_GATHER, PS_FLOAT64, PS_SUM, big / 2 + 1, 0, grev, async));
        TRY(run_in_place(cx, K_ALL_GATHER, big, async));
        TRY(run_case(cx, K_GATHER, PS_INT32, PS_SUM, 2 * big, n - 1, NULL, async));
        TRY(run_case(cx, K_SCATTER, PS_INT16, PS_SUM, 2 * big + 1, 1, grev, async));
        TRY(run_in_place(cx, K_GATHER, 2 * big, async));
        TRY(run_in_place(cx, K_SCATTER, big, async));
    }
    /* Uneven blocks of megabytes: each pair's own bytes, rank to rank (no
     * padded all_to_all at the agent, where the ranks may read each other). */
    TRY(a2av_case(cx, 100003));
    if (g_arena_comm)
        TRY(peer_two_places(cx, big));
    /* Below the floors (2 MiB of output for all_to_all, 4 for all_gather):
     * through the agent. */
    TRY(run_case(cx, K_ALL_GATHER, PS_INT32, PS_SUM, (3u << 18) / (size_t)n, 0, NULL, 0));
    TRY(run_case(cx, K_ALL_TO_ALL, PS_INT32, PS_SUM, 1000, 0, NULL, 0));
    /* PARAMSYNC_SHM=0 on rank 0 since ps_init (read on every collective):
     * that call goes through the agent, as asked (from malloc: ps_mem_alloc
     * gives no shared memory then). */
    if (!g_arena_comm) {
        if (cx->rank == 0)
            setenv("PARAMSYNC_SHM", "0", 1);
        TRY(run_case(cx, K_ALL_TO_ALL, PS_INT32, PS_SUM, big, 0, NULL, 0));
    }
    g_arena_comm = NULL;
    return 0;
}

/* The body of sc_peer_mapped, on buffers it frees: in (ps_mem_alloc, in_bytes
 * of it) and, at the root, out (malloc'd). */
static int peer_mapped_gathers(ctx_t *cx, int32_t *in, size_t in_bytes, int32_t *out, size_t count)
{
    for (int round = 0; round < 2; round++) {
        for (size_t i = 0; i < count; i++)
            in[i] = (int32_t)(i * 7 + (size_t)cx->rank * 1000003 + (size_t)round);
        if (cx->rank != 0 && mprotect(in, in_bytes, PROT_NONE) != 0)
            return fail("mprotect PROT_NONE: %s", strerror(errno));
        int rc = ps_gather(cx->comm, out, in, count, PS_INT32, 0, NULL);
        if (cx->rank != 0 && mprotect(in, in_bytes, PROT_READ | PROT_WRITE) != 0)
            return fail("mprotect back: %s", strerror(errno));
        CHECK(rc == 0, "gather %d: %s", round, ps_strerror(rc));
        for (size_t i = 0; i < count; i++)
            CHECK(in[i] == (int32_t)(i * 7 + (size_t)cx->rank * 1000003 + (size_t)round),
                  "gather %d changed its input at %zu", round, i);
        for (int r = 0; out && r < cx->size; r++)
            for (size_t i = 0; i < count; i++)
                CHECK(out[(size_t)r * count + i] ==
                          (int32_t)(i * 7 + (size_t)r * 1000003 + (size_t)round),
                      "gather %d: rank %d element %zu is %d", round, r, i,
                      out[(size_t)r * count + i]);
    }
    return 0;
}

/* Peer copies from ps_mem_alloc memory through a mapping of the owner's
 * segment file (client/peer.c, read_mapped): gathers of 3 MiB blocks and
 * some, over the agent's --shm-resident-bytes (the harness makes it small,
 * so the ranks copy), each lending rank's input made unreadable through
 * its page tables (PROT_NONE) for the call. process_vm_readv cannot read
 * it there and the call would go through the agent, which reads the
 * segment's file; a mapping of that file can. The harness's --metric
 * checks which way the calls went (none to the agent; with
 * PARAMSYNC_PEER_MAP=0 all to it), and the results are the same. The root
 * keeps its mappings of the others' segments for later calls, and lets go
 * of those the others freed at its next peer copy (/proc/self/maps). */
static int sc_peer_mapped(ctx_t *cx)
{
    if (cx->size < 2) {
        note("SKIPPED: needs two ranks");
        return SKIP;
    }
    const char *env = getenv("PARAMSYNC_PEER_MAP");
    int kept = env && strcmp(env, "0") == 0 ? 0 : cx->size - 1;
    const size_t count = (3u << 20) / 4 + 11;
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t in_bytes = (count * 4 + page - 1) / page * page;
    int32_t *out = cx->rank == 0 ? xmalloc(count * 4 * (size_t)cx->size) : NULL;
    int rc = 0;
    for (int alloc = 0; alloc < 2 && rc == 0; alloc++) {
        int32_t *in = ps_mem_alloc(cx->comm, in_bytes);
        CHECK(in, "ps_mem_alloc returned NULL");
        rc = ps_mem_is_shared(cx->comm, in)
                 ? peer_mapped_gathers(cx, in, in_bytes, out, count)
                 : fail("ps_mem_alloc memory is not shared with the agent");
        int mapped = cx->rank == 0 ? segments_mapped(0, 0, SIZE_MAX) : kept;
        if (rc == 0 && mapped != kept)
            rc = fail("after the gathers on allocation %d the root maps %d of the others' "
                      "segments, expected %d",
                      alloc, mapped, kept);
        CHECK_OK(ps_mem_free(cx->comm, in));
    }
    free(out);
    return rc;
}

/* One all_reduce of >= 256 MiB: streams far past any gRPC message limit. */
static int sc_big(ctx_t *cx)
{
    size_t count = (size_t)(256 + 4) * MIB / 4 + 1; /* a little over 256 MiB, odd */
    float *buf = xmalloc(count * 4);
    for (size_t i = 0; i < count; i++)
        buf[i] = (float)((i + (size_t)cx->rank * 7) % 1000);
    int64_t t0 = now_ms();
    int rc = ps_all_reduce(cx->comm, buf, count, PS_FLOAT32, PS_SUM, NULL);
    int64_t dt = now_ms() - t0;
    if (rc != 0) {
        free(buf);
        return fail("all_reduce of %zu float32: %d (%s)", count, rc, ps_strerror(rc));
    }
    for (size_t i = 0; i < count; i++) {
        float want = 0;
        for (int r = 0; r < cx->size; r++)
            want += (float)((i + (size_t)r * 7) % 1000);
        if (buf[i] != want) {
            float got = buf[i];
            free(buf);
            return fail("element %zu: got %g, want %g", i, got, want);
        }
    }
    note("all_reduce of %.1f MiB float32 in %lld ms", count * 4.0 / MIB, (long long)dt);
    free(buf);
    return 0;
}

/* Sub-groups of a world of 4, one with its ranks in reverse order. */
static int sc_groups(ctx_t *cx)
{
    if (cx->size != 4) {
        note("SKIPPED: needs a world of 4");
        return SKIP;
    }
    ps_comm_t *comm = cx->comm;
    int me = cx->rank;
    const int r01[] = {0, 1}, r23[] = {2, 3}, rev[] = {3, 2, 1, 0};
    ps_group_t *g01, *g23, *grev, *gall;
    CHECK_OK(ps_new_group(comm, r01, 2, &g01));
    CHECK_OK(ps_new_group(comm, r23, 2, &g23));
    CHECK_OK(ps_new_group(comm, rev, 4, &grev));
    CHECK_OK(ps_new_group(comm, NULL, 0, &gall));
    ps_group_t *mine = me < 2 ? g01 : g23, *other = me < 2 ? g23 : g01;
    CHECK(ps_get_rank(comm, mine) == me % 2 && ps_get_world_size(comm, mine) == 2,
          "own group: rank %d size %d", ps_get_rank(comm, mine), ps_get_world_size(comm, mine));
    CHECK(ps_get_rank(comm, other) == -1 && ps_get_world_size(comm, other) == 2,
          "other group: rank %d size %d", ps_get_rank(comm, other), ps_get_world_size(comm, other));
    CHECK(ps_get_rank(comm, grev) == 3 - me, "reversed group: rank %d", ps_get_rank(comm, grev));
    CHECK(ps_get_rank(comm, gall) == me && ps_get_world_size(comm, gall) == 4,
          "new_group(all): rank %d size %d", ps_get_rank(comm, gall),
          ps_get_world_size(comm, gall));

    /* The seed: [0, 1] and [2, 3] reduce apart, in the same breath. */
    int64_t t = me + 1;
    CHECK_OK(ps_all_reduce(comm, &t, 1, PS_INT64, PS_SUM, mine));
    CHECK(t == (me < 2 ? 3 : 7), "all_reduce in own group: %lld", (long long)t);

    /* A non-member may not call a group's collective. */
    int64_t x = 0;
    CHECK(ps_all_reduce(comm, &x, 1, PS_INT64, PS_SUM, other) == PS_EINVAL,
          "all_reduce in a group this rank is not in did not give PS_EINVAL");

    /* Group ranks, not job ranks, in every collective of the reversed group. */
    for (kind_t k = K_ALL_REDUCE; k <= K_ALL_TO_ALL; k++) {
        TRY(run_case(cx, k, PS_INT32, PS_SUM, 5, 0, grev, 0));
        TRY(run_case(cx, k, PS_BFLOAT16, PS_MAX, 1000, 3, grev, 0));
        TRY(run_case(cx, k, PS_FLOAT32, PS_SUM, 3, 1, mine, 0));
        TRY(run_case(cx, k, PS_INT64, PS_SUM, 2, 0, NULL, 0)); /* the world between */
    }
    /* Broadcast from group rank 0 of the reversed group is job rank 3. */
    int64_t b = me == 3 ? 42 : -1;
    CHECK_OK(ps_broadcast(comm, &b, 1, PS_INT64, 0, grev));
    CHECK(b == 42, "broadcast from reversed group rank 0: %lld", (long long)b);
    /* Send and receive by group rank. */
    int32_t v = me * 100, got = -1;
    int src = -1;
    if (ps_get_rank(comm, mine) == 0) {
        CHECK_OK(ps_send(comm, &v, 1, PS_INT32, 1, 3, mine));
    } else {
        CHECK_OK(ps_recv(comm, &got, 1, PS_INT32, 0, 3, mine, &src));
        CHECK(got == (me - 1) * 100 && src == 0, "recv in own group: %d from %d", got, src);
    }
    /* Group and world operations in flight together. */
    ps_work_t *wg, *ww;
    int64_t a = me + 1, c = me + 1;
    CHECK_OK(ps_iall_reduce(comm, &a, 1, PS_INT64, PS_SUM, mine, &wg));
    CHECK_OK(ps_iall_reduce(comm, &c, 1, PS_INT64, PS_SUM, gall, &ww));
    CHECK_OK(ps_work_wait(ww));
    CHECK_OK(ps_work_wait(wg));
    ps_work_free(ww);
    ps_work_free(wg);
    CHECK(a == (me < 2 ? 3 : 7) && c == 10, "async group/world: %lld %lld", (long long)a,
          (long long)c);
    CHECK_OK(ps_barrier(comm, mine));
    CHECK_OK(ps_barrier(comm, NULL));
    return 0;
}

/* Several operations in flight at once, waited for in reverse order. */
static int sc_async(ctx_t *cx)
{
    ps_comm_t *comm = cx->comm;
    int n = cx->size, me = cx->rank;
    enum { NW = 7 };
    ps_work_t *w[NW] = {0};
    size_t cA = 1000, cB = multi_count(PS_FLOAT32), cC = 333, cE = 17, cF = 5,
           cG = multi_count(PS_FLOAT64);
    int32_t *A = xmalloc(cA * 4), *wantA = xmalloc(cA * 4);
    float *B = xmalloc(cB * 4), *wantB = xmalloc(cB * 4);
    int64_t *Cin = xmalloc(cC * 8), *C = xmalloc((size_t)n * cC * 8),
            *wantC = xmalloc((size_t)n * cC * 8);
    uint16_t *Ein = xmalloc((size_t)n * cE * 2), *E = xmalloc(cE * 2), *wantE = xmalloc(cE * 2);
    int8_t *Fin = xmalloc((size_t)n * cF), *F = xmalloc((size_t)n * cF),
           *wantF = xmalloc((size_t)n * cF);
    double *G = xmalloc(cG * 8), *wantG = xmalloc(cG * 8);
    int ret = 0;

    fill(PS_INT32, PS_SUM, 1, me, A, 0, cA);
    expect_reduced(PS_INT32, PS_SUM, 1, n, wantA, 0, cA);
    fill(PS_FLOAT32, PS_SUM, 2, me, B, 0, cB);
    fill(PS_FLOAT32, PS_SUM, 2, 0, wantB, 0, cB);
    fill(PS_INT64, PS_SUM, 3, me, Cin, 0, cC);
    for (int r = 0; r < n; r++)
        fill(PS_INT64, PS_SUM, 3, r, wantC + (size_t)r * cC, 0, cC);
    fill(PS_BFLOAT16, PS_MIN, 4, me, Ein, 0, (size_t)n * cE);
    expect_reduced(PS_BFLOAT16, PS_MIN, 4, n, wantE, (size_t)me * cE, cE);
    fill(PS_INT8, PS_SUM, 5, me, Fin, 0, (size_t)n * cF);
    for (int r = 0; r < n; r++)
        fill(PS_INT8, PS_SUM, 5, r, wantF + (size_t)r * cF, (size_t)me * cF, cF);
    fill(PS_FLOAT64, PS_MAX, 6, me, G, 0, cG);
    expect_reduced(PS_FLOAT64, PS_MAX, 6, n, wantG, 0, cG);

    CHECK_OK(ps_iall_reduce(comm, A, cA, PS_INT32, PS_SUM, NULL, &w[0]));
    CHECK_OK(ps_ibroadcast(comm, B, cB, PS_FLOAT32, 0, NULL, &w[1]));
    CHECK_OK(ps_iall_gather(comm, C, Cin, cC, PS_INT64, NULL, &w[2]));
    CHECK_OK(ps_ibarrier(comm, NULL, &w[3]));
    CHECK_OK(ps_ireduce_scatter(comm, E, Ein, cE, PS_BFLOAT16, PS_MIN, NULL, &w[4]));
    CHECK_OK(ps_iall_to_all(comm, F, Fin, cF, PS_INT8, NULL, &w[5]));
    CHECK_OK(ps_iall_reduce(comm, G, cG, PS_FLOAT64, PS_MAX, NULL, &w[6]));
    /* A blocking call while they run keeps its place in the order. */
    int64_t t = 1;
    CHECK_OK(ps_all_reduce(comm, &t, 1, PS_INT64, PS_SUM, NULL));
    CHECK(t == n, "blocking all_reduce among async ones: %lld", (long long)t);
    int done = -1;
    CHECK_OK(ps_work_test(w[6], &done));
    CHECK(done == 0 || done == 1, "ps_work_test set done=%d", done);
    for (int i = NW - 1; i >= 0; i--) {
        int rc = ps_work_wait(w[i]);
        if (rc != 0 && !ret)
            ret = fail("work %d: %d (%s)", i, rc, ps_strerror(rc));
        CHECK_OK(ps_work_test(w[i], &done));
        CHECK(done == 1, "work %d waited but not done", i);
        CHECK(ps_work_source(w[i]) == -1, "work %d is no recv but has a source", i);
    }
    if (!ret)
        ret = compare("iall_reduce int32", PS_INT32, A, wantA, cA) ||
              compare("ibroadcast float32", PS_FLOAT32, B, wantB, cB) ||
              compare("iall_gather int64", PS_INT64, C, wantC, (size_t)n * cC) ||
              compare("ireduce_scatter bfloat16", PS_BFLOAT16, E, wantE, cE) ||
              compare("iall_to_all int8", PS_INT8, F, wantF, (size_t)n * cF) ||
              compare("iall_reduce float64", PS_FLOAT64, G, wantG, cG);
    for (int i = 0; i < NW; i++)
        ps_work_free(w[i]);
    ps_work_free(NULL);

    /* Freed without a wait: ps_work_free waits. Then every kind async. */
    if (!ret) {
        ps_work_t *x;
        int64_t v = me;
        CHECK_OK(ps_iall_reduce(comm, &v, 1, PS_INT64, PS_MAX, NULL, &x));
        ps_work_free(x);
        CHECK(v == n - 1, "all_reduce freed unwaited: %lld", (long long)v);
        for (kind_t k = K_ALL_REDUCE; k <= K_ALL_TO_ALL && !ret; k++)
            ret = run_case(cx, k, PS_FLOAT16, PS_SUM, 99, n - 1, NULL, 1);
    }
    free(A), free(wantA), free(B), free(wantB), free(Cin), free(C), free(wantC);
    free(Ein), free(E), free(wantE), free(Fin), free(F), free(wantF), free(G), free(wantG);
    return ret ? -1 : 0;
}

/* Receives from any rank report who sent. */
static int sc_recv_any(ctx_t *cx)
{
    ps_comm_t *comm = cx->comm;
    int n = cx->size, me = cx->rank;
    if (n < 2) {
        note("SKIPPED: needs two ranks");
        return SKIP;
    }
    for (int round = 0; round < 2; round++) {
        int async = round == 1;
        /* Rounds apart: an any-source receive may rightly take a sender's
         * next message, which would make the rounds' counts meaningless. */
        CHECK_OK(ps_barrier(comm, NULL));
        if (me != 0) {
            int32_t msg[3] = {me, me * 10 + round, (int32_t)cx->salt};
            CHECK_OK(ps_send(comm, msg, 3, PS_INT32, 0, 0, NULL));
            continue;
        }
        int32_t(*msgs)[3] = xmalloc((size_t)n * sizeof(*msgs));
        int *seen = calloc((size_t)n, sizeof(int));
        ps_work_t **w = calloc((size_t)n, sizeof(*w));
        int ret = 0;
        for (int i = 1; i < n && !ret; i++) {
            int src = -1;
            if (async) {
                ret = ps_irecv(comm, msgs[i], 3, PS_INT32, PS_ANY_SOURCE, 0, NULL, &w[i]);
                continue;
            }
            ret = ps_recv(comm, msgs[i], 3, PS_INT32, PS_ANY_SOURCE, 0, NULL, &src);
            if (!ret && (src < 1 || src >= n || msgs[i][0] != src || seen[src]++))
                ret = fail("recv any: source %d with message from %d", src, msgs[i][0]);
        }
        for (int i = 1; i < n && async && !ret; i++) {
            ret = ps_work_wait(w[i]);
            int src = ps_work_source(w[i]);
            if (!ret && (src < 1 || src >= n || msgs[i][0] != src || seen[src]++))
                ret = fail("irecv any: source %d with message from %d", src, msgs[i][0]);
        }
        for (int i = 1; i < n && !ret; i++)
            if (msgs[i][1] != msgs[i][0] * 10 + round || msgs[i][2] != (int32_t)cx->salt)
                ret = fail("message %d: {%d, %d, %d}", i, msgs[i][0], msgs[i][1], msgs[i][2]);
        for (int i = 1; i < n; i++)
            ps_work_free(w[i]);
        free(w);
        free(seen);
        free(msgs);
        if (ret)
            return fail("round %d: %d", round, ret);
    }
    /* A named source among any-source traffic: rank 1 sends twice, and the
     * two arrive in the order sent. */
    CHECK_OK(ps_barrier(comm, NULL));
    if (me == 1 || me == 0) {
        int32_t v[2] = {5, 6};
        if (me == 1) {
            CHECK_OK(ps_send(comm, &v[0], 1, PS_INT32, 0, 1, NULL));
            CHECK_OK(ps_send(comm, &v[1], 1, PS_INT32, 0, 1, NULL));
        } else {
            int32_t a = 0, b = 0;
            int src = -1;
            CHECK_OK(ps_recv(comm, &a, 1, PS_INT32, 1, 1, NULL, &src));
            CHECK_OK(ps_recv(comm, &b, 1, PS_INT32, PS_ANY_SOURCE, 1, NULL, &src));
            CHECK(a == 5 && b == 6 && src == 1, "in-order sends from rank 1: %d %d from %d", a, b,
                  src);
        }
    }
    return ps_barrier(comm, NULL);
}

/* An in-place int32 all_reduce of count elements at buf; checks the sums. */
static int sum_check(ctx_t *cx, int32_t *buf, size_t count, int tag)
{
    for (size_t i = 0; i < count; i++)
        buf[i] = (int32_t)(i * 7 + (size_t)cx->rank * 1000 + (size_t)tag);
    CHECK_OK(ps_all_reduce(cx->comm, buf, count, PS_INT32, PS_SUM, NULL));
    for (size_t i = 0; i < count; i++) {
        int64_t want = (int64_t)cx->size * (int64_t)(i * 7 + (size_t)tag) +
                       1000LL * cx->size * (cx->size - 1) / 2;
        CHECK(buf[i] == (int32_t)want, "all_reduce %d: element %zu is %d, expected %lld", tag, i,
              buf[i], (long long)want);
    }
    return 0;
}

/* Memory from ps_mem_alloc: every collective with its input and output in
 * one allocation (collectives_light's cases), then the edges: frees that
 * are refused, more allocations than the agent shares, two collectives on
 * one allocation at once, an input there with the output elsewhere.
 * PS_TEST_SHARED=1/0: what ps_mem_is_shared must say. */
static int sc_registered(ctx_t *cx)
{
    ps_comm_t *comm = cx->comm;
    g_arena_shared = env_int("PS_TEST_SHARED", -1);
    g_arena_comm = comm;
    g_light = 1;
    int rc = sc_collectives(cx);
    g_arena_comm = NULL;
    TRY(rc);

    CHECK(ps_mem_alloc(comm, 0) == NULL && ps_mem_alloc(NULL, 64) == NULL,
          "ps_mem_alloc of 0 bytes or without a comm must return NULL");
    CHECK_OK(ps_mem_free(comm, NULL));
    int local = 0;
    clear_last_error();
    CHECK(ps_mem_free(comm, &local) == PS_EINVAL, "ps_mem_free of a stack address: not PS_EINVAL");
    char err[512];
    last_error(err, sizeof(err));
    CHECK(strstr(err, "not memory from ps_mem_alloc"), "ps_mem_free's error says: '%s'", err);

    /* 70 allocations: the agent shares 64 per rank, the rest are plain
     * memory; every one works. */
    enum { NALLOC = 70, COUNT = 20000 };
    int32_t *bufs[NALLOC];
    int shared = 0;
    for (int i = 0; i < NALLOC; i++) {
        bufs[i] = ps_mem_alloc(comm, COUNT * sizeof(int32_t));
        CHECK(bufs[i], "ps_mem_alloc %d returned NULL", i);
        shared += ps_mem_is_shared(comm, bufs[i]);
    }
    if (g_arena_shared >= 0)
        CHECK(shared == (g_arena_shared ? 64 : 0), "%d of %d allocations shared, expected %d",
              shared, NALLOC, g_arena_shared ? 64 : 0);
    for (int i = 0; i < NALLOC; i++)
        TRY(sum_check(cx, bufs[i], COUNT, i));
    CHECK_OK(ps_mem_free(comm, bufs[0]));
    CHECK(ps_mem_free(comm, bufs[0]) == PS_EINVAL, "a second ps_mem_free was not refused");
    for (int i = 1; i < NALLOC; i++)
        CHECK_OK(ps_mem_free(comm, bufs[i]));

    /* Two all_reduces at once on the halves of one allocation (the second
     * copies), and an all_gather from it into malloc'd memory. */
    size_t half = 300000;
    int32_t *two = ps_mem_alloc(comm, 2 * half * sizeof(int32_t) + 4096);
    CHECK(two, "ps_mem_alloc returned NULL");
    int32_t *b = (int32_t *)((uint8_t *)two + (half * sizeof(int32_t) + 4095) / 4096 * 4096);
    for (size_t i = 0; i < half; i++) {
        two[i] = (int32_t)(cx->rank + 1);
        b[i] = (int32_t)(i % 1000) * (cx->rank + 1);
    }
    ps_work_t *w1 = NULL, *w2 = NULL;
    CHECK_OK(ps_iall_reduce(comm, two, half, PS_INT32, PS_SUM, NULL, &w1));
    CHECK_OK(ps_iall_reduce(comm, b, half, PS_INT32, PS_SUM, NULL, &w2));
    CHECK_OK(ps_work_wait(w1));
    CHECK_OK(ps_work_wait(w2));
    ps_work_free(w1);
    ps_work_free(w2);
    int32_t tri = cx->size * (cx->size + 1) / 2;
    for (size_t i = 0; i < half; i++)
        CHECK(two[i] == tri && b[i] == (int32_t)(i % 1000) * tri,
              "concurrent all_reduces on one allocation: element %zu is %d / %d", i, two[i], b[i]);
    int32_t *gathered = xmalloc(half * sizeof(int32_t) * (size_t)cx->size);
    for (size_t i = 0; i < half; i++)
        two[i] = (int32_t)(i + (size_t)cx->rank);
    CHECK_OK(ps_all_gather(comm, gathered, two, half, PS_INT32, NULL));
    for (int r = 0; r < cx->size; r++)
        for (size_t i = 0; i < half; i++)
            CHECK(gathered[(size_t)r * half + i] == (int32_t)(i + (size_t)r),
                  "all_gather into malloc'd memory: rank %d element %zu is %d", r, i,
                  gathered[(size_t)r * half + i]);
    free(gathered);
    CHECK_OK(ps_mem_free(comm, two));
    return 0;
}

/* What concurrent jobs run: a few collectives whose data depend on the job. */
static int sc_mixed(ctx_t *cx)
{
    for (int i = 0; i < 3; i++) {
        TRY(run_case(cx, K_ALL_REDUCE, PS_INT32, PS_SUM, 1000, 0, NULL, 0));
        TRY(run_case(cx, K_ALL_REDUCE, PS_FLOAT32, PS_MAX, multi_count(PS_FLOAT32) / 2, 0, NULL,
                     0));
        TRY(run_case(cx, K_ALL_GATHER, PS_INT64, PS_SUM, 77, 0, NULL, 0));
        TRY(run_case(cx, K_BROADCAST, PS_UINT8, PS_SUM, 4097, cx->size - 1, NULL, 0));
        TRY(run_case(cx, K_REDUCE_SCATTER, PS_BFLOAT16, PS_SUM, 100, 0, NULL, 1));
        CHECK_OK(ps_barrier(cx->comm, NULL));
    }
    return cx->size > 1 ? sc_recv_any(cx) : 0;
}

/* Arguments the library refuses before any call: nothing is sent, so the
 * ranks stay in step and a real collective works afterwards. */
static int sc_local_errors(ctx_t *cx)
{
    ps_comm_t *comm = cx->comm;
    int n = cx->size, me = cx->rank;
    float f[4] = {1, 2, 3, 4};
    int32_t i32[4] = {0};
    int before = error_count();
    CHECK(ps_all_reduce(NULL, f, 4, PS_FLOAT32, PS_SUM, NULL) == PS_EPRECOND,
          "collective before init: not PS_EPRECOND");
    CHECK(ps_barrier(NULL, NULL) == PS_EPRECOND, "barrier before init: not PS_EPRECOND");
    for (ps_op_t op = PS_BAND; op <= PS_BXOR; op++)
        CHECK(ps_all_reduce(comm, f, 4, PS_FLOAT32, op, NULL) == PS_EINVAL,
              "%s on float32: not PS_EINVAL", ps_op_name(op));
    CHECK(ps_reduce_scatter(comm, f, f, 1, PS_BFLOAT16, PS_BXOR, NULL) == PS_EINVAL,
          "BXOR on bfloat16: not PS_EINVAL");
    CHECK(ps_all_reduce(comm, i32, 4, PS_INT32, PS_AVG, NULL) == PS_EINVAL,
          "AVG on int32: not PS_EINVAL");
    CHECK(ps_all_reduce(comm, f, 4, (ps_dtype_t)99, PS_SUM, NULL) == PS_EINVAL,
          "dtype 99: not PS_EINVAL");
    CHECK(ps_all_reduce(comm, f, 4, PS_FLOAT32, (ps_op_t)42, NULL) == PS_EINVAL,
          "op 42: not PS_EINVAL");
    CHECK(ps_broadcast(comm, f, 4, PS_FLOAT32, n, NULL) == PS_EINVAL, "src = n: not PS_EINVAL");
    CHECK(ps_broadcast(comm, f, 4, PS_FLOAT32, -1, NULL) == PS_EINVAL, "src -1: not PS_EINVAL");
    CHECK(ps_reduce_to(comm, f, 4, PS_FLOAT32, PS_SUM, n + 3, NULL) == PS_EINVAL,
          "dst = n+3: not PS_EINVAL");
    CHECK(ps_all_reduce(comm, NULL, 4, PS_FLOAT32, PS_SUM, NULL) == PS_EINVAL,
          "NULL buffer: not PS_EINVAL");
    CHECK(ps_all_gather(comm, NULL, f, 1, PS_FLOAT32, NULL) == PS_EINVAL,
          "NULL output: not PS_EINVAL");
    CHECK(ps_send(comm, f, 1, PS_FLOAT32, me, 0, NULL) == PS_EINVAL,
          "send to oneself: not PS_EINVAL");
    CHECK(ps_recv(comm, f, 1, PS_FLOAT32, n, 0, NULL, NULL) == PS_EINVAL,
          "recv from rank n: not PS_EINVAL");
    CHECK(ps_send(comm, f, 1, PS_FLOAT32, (me + 1) % n, -5, NULL) == PS_EINVAL,
          "negative tag: not PS_EINVAL");
    CHECK(ps_iall_reduce(comm, f, 4, PS_FLOAT32, PS_SUM, NULL, NULL) == PS_EINVAL,
          "NULL work: not PS_EINVAL");
    ps_work_t *w = (ps_work_t *)&w;
    CHECK(ps_iall_reduce(comm, f, 4, PS_FLOAT32, PS_BOR, NULL, &w) == PS_EINVAL &&
              w == (ps_work_t *)&w,
          "bad async call: not PS_EINVAL, or *work written");
    const int bad[] = {0, n}, dup[] = {0, 0};
    ps_group_t *g = (ps_group_t *)&g;
    CHECK(ps_new_group(comm, bad, 2, &g) == PS_EINVAL && g == (ps_group_t *)&g,
          "new_group with rank n: not PS_EINVAL, or *out written");
    CHECK(ps_new_group(comm, dup, 2, &g) == PS_EINVAL, "new_group with rank 0 twice");
    CHECK(error_count() - before == 19, "the error handler heard %d of the 19 errors",
          error_count() - before);
    CHECK(ps_get_rank(NULL, NULL) == -1 && ps_get_world_size(NULL, NULL) == -1,
          "queries on a NULL comm");
    CHECK(ps_finalize(NULL) == 0, "ps_finalize(NULL)");

    /* Nothing was consumed: the ranks are still in step. */
    int64_t v = me + 1;
    CHECK_OK(ps_all_reduce(comm, &v, 1, PS_INT64, PS_SUM, NULL));
    CHECK(v == (int64_t)n * (n + 1) / 2, "all_reduce after the refusals: %lld", (long long)v);
    const int pair[] = {0, n - 1};
    CHECK_OK(ps_new_group(comm, pair, n > 1 ? 2 : 1, &g));
    return 0;
}

/* Checks that the last reported error has code err on every rank and names
 * the field (needle) and a rank. */
static int expect_error(int rc, const char *what, const char *needle, int want1, int want2)
{
    char msg[1024];
    last_error(msg, sizeof(msg));
    CHECK(rc == want1 || rc == want2, "%s: returned %d (%s), want %s or %s", what, rc,
          ps_strerror(rc), ps_strerror(want1), ps_strerror(want2));
    CHECK(strstr(msg, needle), "%s: the message does not name '%s': %s", what, needle, msg);
    CHECK(strstr(msg, "rank"), "%s: the message names no rank: %s", what, msg);
    return 0;
}

/* Ranks that disagree: every rank gets an error naming the field, and the
 * job goes on afterwards. The odd one out is the last rank. */
static int sc_mismatch(ctx_t *cx)
{
    ps_comm_t *comm = cx->comm;
    int n = cx->size, odd = cx->rank == n - 1;
    if (n < 2) {
        note("SKIPPED: needs two ranks");
        return SKIP;
    }
    float f[8] = {0};
    int rc;

    clear_last_error();
    rc = ps_all_reduce(comm, f, 4, odd ? PS_INT32 : PS_FLOAT32, PS_SUM, NULL);
    TRY(expect_error(rc, "dtype", "dtype", PS_EPRECOND, PS_EINVAL));
    TRY(run_case(cx, K_ALL_REDUCE, PS_FLOAT32, PS_SUM, 9, 0, NULL, 0));

    clear_last_error();
    rc = ps_all_reduce(comm, f, odd ? 5 : 4, PS_FLOAT32, PS_SUM, NULL);
    TRY(expect_error(rc, "count", "count", PS_EPRECOND, PS_EINVAL));
    TRY(run_case(cx, K_ALL_REDUCE, PS_FLOAT32, PS_SUM, 9, 0, NULL, 0));

    clear_last_error();
    rc = ps_all_reduce(comm, f, 4, PS_FLOAT32, odd ? PS_MAX : PS_SUM, NULL);
    TRY(expect_error(rc, "op", "op", PS_EPRECOND, PS_EINVAL));
    TRY(run_case(cx, K_ALL_REDUCE, PS_FLOAT32, PS_SUM, 9, 0, NULL, 0));

    /* The odd rank comes late: across the ring the root's agent (and a
     * reduce's other ranks) must not answer OK before it came and agreed. */
    clear_last_error();
    if (odd)
        sleep_ms(300);
    rc = ps_broadcast(comm, f, 4, PS_FLOAT32, odd ? 1 : 0, NULL);
    TRY(expect_error(rc, "root", "root", PS_EPRECOND, PS_EINVAL));
    TRY(run_case(cx, K_ALL_REDUCE, PS_FLOAT32, PS_SUM, 9, 0, NULL, 0));

    clear_last_error();
    if (odd)
        sleep_ms(300);
    rc = ps_reduce_to(comm, f, 4, PS_FLOAT32, PS_SUM, odd ? 1 : 0, NULL);
    TRY(expect_error(rc, "reduce root", "root", PS_EPRECOND, PS_EINVAL));
    TRY(run_case(cx, K_ALL_REDUCE, PS_FLOAT32, PS_SUM, 9, 0, NULL, 0));

    clear_last_error();
    rc = odd ? ps_broadcast(comm, f, 4, PS_FLOAT32, 0, NULL)
             : ps_all_reduce(comm, f, 4, PS_FLOAT32, PS_SUM, NULL);
    TRY(expect_error(rc, "kind", "broadcast", PS_EPRECOND, PS_EINVAL));
    TRY(run_case(cx, K_ALL_REDUCE, PS_FLOAT32, PS_SUM, 9, 0, NULL, 0));

    /* With --ring on, each step of an all_gather passes from its owner's
     * agent round the others: every rank is still told. */
    float *g = calloc((size_t)n * 2, sizeof(float));
    CHECK(g != NULL, "out of memory");
    clear_last_error();
    rc = ps_all_gather(comm, g, f, odd ? 2 : 1, PS_FLOAT32, NULL);
    free(g);
    TRY(expect_error(rc, "all_gather count", "count", PS_EPRECOND, PS_EINVAL));
    TRY(run_case(cx, K_ALL_REDUCE, PS_FLOAT32, PS_SUM, 9, 0, NULL, 0));

    clear_last_error();
    rc = ps_reduce_scatter(comm, f, f, odd ? 2 : 1, PS_FLOAT32, PS_SUM, NULL);
    TRY(expect_error(rc, "reduce_scatter count", "count", PS_EPRECOND, PS_EINVAL));
    TRY(run_case(cx, K_ALL_REDUCE, PS_FLOAT32, PS_SUM, 9, 0, NULL, 0));

    /* With --ring on an all_to_all goes over the mesh, each agent's blocks
     * straight to the others: the odd rank comes late with another dtype,
     * after the others' links carried their headers; every rank is told. */
    float *in = calloc((size_t)n * 2, sizeof(float)), *out = calloc((size_t)n * 2, sizeof(float));
    CHECK(in != NULL && out != NULL, "out of memory");
    clear_last_error();
    if (odd)
        sleep_ms(300);
    rc = ps_all_to_all(comm, out, in, 2, odd ? PS_INT32 : PS_FLOAT32, NULL);
    free(in);
    free(out);
    TRY(expect_error(rc, "all_to_all dtype", "dtype", PS_EPRECOND, PS_EINVAL));
    return ps_barrier(comm, NULL);
}

/* Ranks may leave as soon as their part is done. Rank 0 comes 2.5 s late
 * (past its agent's liveness checks); the others wait for it (every rank
 * must have come and agreed before any is answered OK), then, with --ring
 * on, the ranks on other agents finish a broadcast (their data on its way)
 * and a reduce to rank 0 and leave while rank 0's agent still passes the
 * data on; rank 0 still gets every byte and no error. */
static int sc_early_exit(ctx_t *cx)
{
    if (cx->rank == 0)
        sleep_ms(2500);
    TRY(run_case(cx, K_BROADCAST, PS_FLOAT32, PS_SUM, 300000, 1 % cx->size, NULL, 0));
    TRY(run_case(cx, K_REDUCE, PS_INT32, PS_SUM, 300000, 0, NULL, 0));
    return 0;
}

/* Rank 0 comes to a barrier 3.5 s late: the others wait for it (the hub
 * checks once a second that rank 0 is still a member), then all go on. */
static int sc_straggler(ctx_t *cx)
{
    if (cx->rank == 0)
        sleep_ms(3500);
    TRY(ps_barrier(cx->comm, NULL));
    return run_case(cx, K_ALL_REDUCE, PS_FLOAT32, PS_SUM, 1000, 0, NULL, 0);
}

/* A payload over the daemon's --max-tensor-bytes (1 MiB in this test) fails
 * with PS_ENOMEM on every rank, and smaller ones still work. */
static int sc_too_big(ctx_t *cx)
{
    ps_comm_t *comm = cx->comm;
    size_t count = 2 * MIB / 4;
    float *f = calloc(count * (size_t)cx->size, 4);
    clear_last_error();
    int rc = ps_all_reduce(comm, f, count, PS_FLOAT32, PS_SUM, NULL);
    CHECK(rc == PS_ENOMEM, "all_reduce of 2 MiB: %d (%s), want PS_ENOMEM", rc, ps_strerror(rc));
    /* 600 KiB in, but n * 600 KiB out. */
    if (cx->size > 1) {
        rc = ps_all_gather(comm, f, f + count, 600 * 1024 / 4, PS_FLOAT32, NULL);
        CHECK(rc == PS_ENOMEM, "all_gather of n x 600 KiB: %d (%s), want PS_ENOMEM", rc,
              ps_strerror(rc));
    }
    free(f);
    TRY(run_case(cx, K_ALL_REDUCE, PS_FLOAT32, PS_SUM, 1024, 0, NULL, 0));
    TRY(run_case(cx, K_ALL_REDUCE, PS_INT8, PS_SUM, MIB - 1, 0, NULL, 0));
    return 0;
}

/* The smallest real job: used after failures to show the daemon still serves. */
static int sc_smoke(ctx_t *cx)
{
    TRY(run_case(cx, K_ALL_REDUCE, PS_INT32, PS_SUM, 3, 0, NULL, 0));
    TRY(run_case(cx, K_ALL_GATHER, PS_FLOAT32, PS_SUM, 1025, 0, NULL, 0));
    return ps_barrier(cx->comm, NULL);
}

/* Ranks that never call (absent): the others' all_reduce or barrier fails
 * with PS_ETIMEDOUT within the collective timeout (2 s here), its message
 * containing `want`. The absent ones stay joined until well past that, then
 * leave. */
static int expect_absent(ctx_t *cx, int absent, int barrier, const char *want)
{
    if (absent) {
        sleep_ms(4500);
        return 0;
    }
    float f[4] = {0};
    int64_t t0 = now_ms();
    clear_last_error();
    int rc = barrier ? ps_barrier(cx->comm, NULL)
                     : ps_all_reduce(cx->comm, f, 4, PS_FLOAT32, PS_SUM, NULL);
    int64_t took = now_ms() - t0;
    char msg[1024];
    last_error(msg, sizeof(msg));
    CHECK(rc == PS_ETIMEDOUT, "absent ranks: %d (%s), want PS_ETIMEDOUT", rc, ps_strerror(rc));
    CHECK(took >= 1500 && took <= 4000, "absent ranks: failed after %lld ms; the timeout is 2000",
          (long long)took);
    CHECK(strstr(msg, want), "absent ranks: the message does not say '%s': %s", want, msg);
    return 0;
}

/* Rank 1 never calls (its agent may not even have the collective). */
static int sc_peer_timeout(ctx_t *cx)
{
    return expect_absent(cx, cx->rank != 0, 0, "rank 1 did not arrive");
}

/* The last rank never comes to the barrier (its agent has the others). */
static int sc_barrier_late_rank(ctx_t *cx)
{
    char want[64];
    snprintf(want, sizeof(want), "rank %d did not arrive", cx->size - 1);
    return expect_absent(cx, cx->rank == cx->size - 1, 1, want);
}

/* The odd ranks never come (with --topology split, every rank of agent 1:
 * that agent has the barrier only from the ring's link). */
static int sc_barrier_late_half(ctx_t *cx)
{
    char want[512] = "ranks";
    size_t len = strlen(want);
    for (int r = 1; r < cx->size && len < sizeof(want); r += 2)
        len += (size_t)snprintf(want + len, sizeof(want) - len, "%s %d", r > 1 ? "," : "", r);
    if (len < sizeof(want))
        snprintf(want + len, sizeof(want) - len, " did not arrive");
    return expect_absent(cx, cx->rank % 2 == 1, 1, want);
}

/* 1 when msg names rank r in a list after `word` at any of its
 * occurrences: "rank r", "ranks a, b, r", "missing ranks: a r". A bare
 * digit is not enough (job names carry process ids). */
static int names_rank(const char *msg, const char *word, int r)
{
    size_t wl = strlen(word);
    for (const char *p = strstr(msg, word); p; p = strstr(p + wl, word)) {
        const char *q = p + wl;
        if (*q == 's')
            q++;
        if (*q == ':')
            q++;
        while (*q == ' ') {
            char *end;
            long v = strtol(q + 1, &end, 10);
            if (end == q + 1)
                break;
            if (v == r)
                return 1;
            q = end;
            if (*q == ',')
                q++;
        }
    }
    return 0;
}

/* A member that dies without leaving: the others' collective fails soon,
 * naming it, instead of waiting for the (long) timeout. */
static int sc_member_lost(ctx_t *cx)
{
    int victim = cx->size - 1;
    /* PS_TEST_COUNT: a larger all_reduce (36 MiB and more goes direct: the
     * survivors then wait for the agent's answer, never giving up early);
     * the victim dies once they wait. */
    const char *env = getenv("PS_TEST_COUNT");
    if (cx->rank == victim) {
        if (env)
            usleep(300 * 1000);
        fflush(NULL);
        _exit(0); /* no Leave: as if killed */
    }
    /* PS_TEST_LEAVER=1: rank 1 never calls; it leaves just after the victim
     * died, so that the hub, asking once a second who is still a member,
     * finds both gone. Its answer must still name the victim (it named only
     * the first rank gone, this leaver, once). */
    const char *leaver = getenv("PS_TEST_LEAVER");
    if (leaver && atoi(leaver) == 1 && cx->rank == 1) {
        usleep(350 * 1000);
        return 0; /* main's ps_finalize leaves */
    }
    /* PS_TEST_KIND=all_to_all: an all_to_all of PS_TEST_COUNT per block,
     * which the ranks of one agent take by peer copies from 2 MiB;
     * all_to_all_v: an uneven one, PS_TEST_COUNT + j to rank j (its first
     * step, the counts, is what the lost rank never joins). */
    const char *kind = getenv("PS_TEST_KIND");
    int a2av = kind && strcmp(kind, "all_to_all_v") == 0;
    int a2a = a2av || (kind && strcmp(kind, "all_to_all") == 0);
    size_t count = env ? strtoull(env, NULL, 10) : 4, n = a2a ? (size_t)cx->size : 1;
    size_t each = a2av ? count + n : count, counts[64];
    CHECK(n <= 64, "at most 64 ranks");
    for (size_t j = 0; j < n; j++)
        counts[j] = count + j;
    float *f = xmalloc((each ? each : 1) * n * sizeof(float));
    float *g = a2a ? xmalloc((each ? each : 1) * n * sizeof(float)) : NULL;
    memset(f, 0, each * n * sizeof(float));
    int64_t t0 = now_ms();
    clear_last_error();
    int rc = a2av  ? ps_all_to_all_v(cx->comm, g, counts, f, counts, PS_FLOAT32, NULL)
             : a2a ? ps_all_to_all(cx->comm, g, f, count, PS_FLOAT32, NULL)
                   : ps_all_reduce(cx->comm, f, count, PS_FLOAT32, PS_SUM, NULL);
    int64_t took = now_ms() - t0;
    free(f);
    free(g);
    char msg[1024];
    last_error(msg, sizeof(msg));
    CHECK(rc == PS_EABORTED || rc == PS_EUNAVAIL, "lost member: %d (%s), want PS_EABORTED", rc,
          ps_strerror(rc));
    CHECK(took <= 15000, "lost member: failed after %lld ms", (long long)took);
    CHECK(names_rank(msg, "rank", victim), "lost member: the message does not name rank %d: %s",
          victim, msg);
    CHECK(!a2a || strstr(msg, a2av ? "all_to_all_v" : "all_to_all (peer addresses)"),
          "lost member: the message does not name the call: %s", msg);
    /* The comm stays failed: a later call fails at once with the same cause. */
    rc = ps_barrier(cx->comm, NULL);
    CHECK(rc != 0, "a collective after a member was lost succeeded");
    return 0;
}

/* Barriers met directly (client/barrier.c): the first two of a group set up
 * its page through the agent, later ones meet on it. Blocking ones, a
 * subgroup's, and nonblocking ones in flight side by side (waited for in
 * reverse) all line the ranks up. PS_TEST_BARRIER says what the last rank
 * does at the barrier after them: "late" never comes (the others fail with
 * PS_ETIMEDOUT naming it within the 2 s timeout), "lost" dies (they fail
 * naming it, well before that), "mismatch" calls an all_reduce there (every
 * rank fails at once with PS_EPRECOND naming both calls: a waiter sees the
 * all_reduce's number on the page and takes its barrier to the agent; and the
 * next barriers meet), "mismatch_one" is the same with the last rank the only
 * one at the barrier, "mismatch_peer" with the last rank at an all_to_all the
 * ranks take by peer copies (its first step, an all_gather through the agent,
 * is what the barrier is compared with; the ranks are out of step after it,
 * as through the agent, so no barriers follow). */
static int sc_barrier_direct(ctx_t *cx)
{
    int last = cx->size - 1;
    const char *what = getenv("PS_TEST_BARRIER");
    int evens[512], ne = 0;
    CHECK(cx->size <= 1024, "barrier_direct: %d ranks, at most 1024 here", cx->size);
    for (int r = 0; r < cx->size; r += 2)
        evens[ne++] = r;
    ps_group_t *g = NULL;
    CHECK_OK(ps_new_group(cx->comm, evens, ne, &g));
    for (int i = 0; i < 4; i++) {
        CHECK_OK(ps_barrier(cx->comm, NULL));
        if (cx->rank % 2 == 0)
            CHECK_OK(ps_barrier(cx->comm, g));
    }
    /* The last arrival of each round is rank round % size: nobody may leave
     * before it came (stamped as in sc_barrier). */
    int64_t arrived[1024];
    for (int round = 0; round < 3; round++) {
        if (cx->rank == round % cx->size)
            sleep_ms(200);
        int64_t mine = now_us();
        CHECK_OK(ps_barrier(cx->comm, NULL));
        int64_t left = now_us();
        CHECK_OK(ps_all_gather(cx->comm, arrived, &mine, 1, PS_INT64, NULL));
        int late = round % cx->size;
        CHECK(left >= arrived[late], "round %d: left the barrier %lld us before rank %d arrived",
              round, (long long)(arrived[late] - left), late);
    }
    ps_work_t *w[4];
    for (int i = 0; i < 4; i++)
        CHECK_OK(ps_ibarrier(cx->comm, NULL, &w[i]));
    int wrc = 0;
    for (int i = 3; i >= 0; i--) {
        wrc = wrc ? wrc : ps_work_wait(w[i]);
        ps_work_free(w[i]);
    }
    CHECK_OK(wrc);
    for (int i = 0; i < 200; i++)
        CHECK_OK(ps_barrier(cx->comm, NULL));
    if (!what)
        return 0;
    int lost = strcmp(what, "lost") == 0;
    if (strncmp(what, "mismatch", 8) == 0) {
        int one = strcmp(what, "mismatch_one") == 0;
        /* A peer copy's first step is an all_gather through the agent. */
        int peer = strcmp(what, "mismatch_peer") == 0;
        float x = 1;
        size_t count = (size_t)1 << 18; /* blocks of 1 MiB: 3 MiB by peer copies */
        float *in = peer ? xmalloc(count * (size_t)cx->size * sizeof(float)) : NULL;
        float *out = peer ? xmalloc(count * (size_t)cx->size * sizeof(float)) : NULL;
        if (peer)
            memset(in, 0, count * (size_t)cx->size * sizeof(float));
        /* The barrier's side 100 ms late: the other call is at the hub. */
        if ((cx->rank == last) == one)
            sleep_ms(100);
        int64_t t0 = now_ms();
        clear_last_error();
        int rc = (cx->rank == last) == one ? ps_barrier(cx->comm, NULL)
                 : peer ? ps_all_to_all(cx->comm, out, in, count, PS_FLOAT32, NULL)
                        : ps_all_reduce(cx->comm, &x, 1, PS_FLOAT32, PS_SUM, NULL);
        int64_t took = now_ms() - t0;
        free(in);
        free(out);
        char msg[1024];
        last_error(msg, sizeof(msg));
        CHECK(rc == PS_EPRECOND, "mismatch: %d (%s), want PS_EPRECOND: %s", rc, ps_strerror(rc),
              msg);
        CHECK(took <= 1000, "mismatch: failed after %lld ms (the deadline is 2 s)",
              (long long)took);
        CHECK(strstr(msg, "called barrier") &&
                  strstr(msg, peer ? "called all_gather" : "called all_reduce") &&
                  names_rank(msg, "rank", last),
              "mismatch: the message does not name both calls and rank %d: %s", last, msg);
        /* A peer copy holds three sequence numbers, a barrier one: the ranks'
         * later calls no longer match, through the agent or not. */
        if (peer)
            return 0;
        /* In step again: the next barriers line everyone up (the last rank
         * comes 200 ms late to the first). */
        int64_t arrived[1024];
        for (int i = 0; i < 2; i++) {
            if (i == 0 && cx->rank == last)
                sleep_ms(200);
            int64_t mine = now_us();
            CHECK_OK(ps_barrier(cx->comm, NULL));
            int64_t left = now_us();
            CHECK_OK(ps_all_gather(cx->comm, arrived, &mine, 1, PS_INT64, NULL));
            CHECK(left >= arrived[last],
                  "mismatch: barrier %d after it let a rank go %lld us "
                  "before rank %d arrived",
                  i, (long long)(arrived[last] - left), last);
        }
        return 0;
    }
    if (cx->rank == last) {
        if (lost) {
            fflush(NULL);
            _exit(0); /* no Leave: as if killed */
        }
        sleep_ms(4500);
        return 0;
    }
    int64_t t0 = now_ms();
    clear_last_error();
    int rc = ps_barrier(cx->comm, NULL);
    int64_t took = now_ms() - t0;
    char msg[1024];
    last_error(msg, sizeof(msg));
    CHECK(rc == (lost ? PS_EABORTED : PS_ETIMEDOUT), "%s rank: %d (%s)", what, rc, ps_strerror(rc));
    CHECK(lost ? took <= 15000 : took >= 1500 && took <= 4000, "%s rank: failed after %lld ms",
          what, (long long)took);
    CHECK(names_rank(msg, "rank", last), "%s rank: the message does not name rank %d: %s", what,
          last, msg);
    CHECK(lost || strstr(msg, "met directly"), "late rank: not a direct barrier's message: %s",
          msg);
    return 0;
}

/* SIGTERM to the daemon while calls are in flight: they end with
 * PS_EUNAVAIL (the driver sends the signal and checks the exit status). */
static int sc_sigterm(ctx_t *cx)
{
    float f[4] = {0};
    int rc, src;
    if (cx->rank == 0)
        rc = ps_barrier(cx->comm, NULL); /* rank 1 never comes */
    else
        rc = ps_recv(cx->comm, f, 4, PS_FLOAT32, 0, 0, NULL, &src); /* nobody sends */
    CHECK(rc == PS_EUNAVAIL, "in flight at SIGTERM: %d (%s), want PS_EUNAVAIL", rc,
          ps_strerror(rc));
    return 0;
}

/* ---- scenarios that join by themselves ---- */

static int join_expect(ps_init_options_t *o, int want, const char *needle, const char *what)
{
    ps_comm_t *comm = NULL;
    clear_last_error();
    int rc = join(o, &comm);
    if (rc == 0) {
        ps_finalize(comm);
        return fail("%s: ps_init succeeded", what);
    }
    char msg[1024];
    last_error(msg, sizeof(msg));
    CHECK(want == 0 || rc == want, "%s: ps_init returned %d (%s), want %s", what, rc,
          ps_strerror(rc), ps_strerror(want));
    CHECK(!needle || strstr(msg, needle), "%s: the message does not name '%s': %s", what, needle,
          msg);
    return 0;
}

/* rank >= world size is refused. */
static int sc_join_bad_rank(ctx_t *cx)
{
    (void)cx;
    ps_init_options_t o;
    ps_init_options_default(&o);
    o.world_size = 2;
    o.rank = 5;
    o.join_timeout_ms = 5000;
    return join_expect(&o, PS_EINVAL, "rank", "rank 5 of 2");
}

/* Settings from the environment that are not numbers, or out of range:
 * ps_init refuses each at once, naming the variable, and the next ps_init
 * with the variable gone joins. */
static int sc_env_errors(ctx_t *cx)
{
    static const struct {
        const char *var, *value;
    } bad[] = {
        {"PARAMSYNC_TIMEOUT_MS", "0"},
        {"PARAMSYNC_TIMEOUT_MS", "10s"},
        {"PARAMSYNC_JOIN_TIMEOUT_MS", "-5"},
        {"PARAMSYNC_CHUNK_BYTES", "0"},
        {"PARAMSYNC_CHUNK_BYTES", "999999999999"},
        {"PARAMSYNC_DEVICE_MIN_BYTES", "-1"},
        {"PARAMSYNC_DEVICE_MIN_BYTES", "4M"},
        {"PARAMSYNC_SCRATCH_BYTES", "-1"},
        {"PARAMSYNC_SCRATCH_BYTES", "1G"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char what[96];
        snprintf(what, sizeof(what), "%s=%s", bad[i].var, bad[i].value);
        const char *before = getenv(bad[i].var);
        char *saved = before ? strdup(before) : NULL;
        setenv(bad[i].var, bad[i].value, 1);
        ps_init_options_t o;
        ps_init_options_default(&o);
        int rc = join_expect(&o, PS_EINVAL, bad[i].var, what);
        if (saved)
            setenv(bad[i].var, saved, 1);
        else
            unsetenv(bad[i].var);
        free(saved);
        TRY(rc);
    }
    ps_init_options_t o;
    ps_init_options_default(&o);
    CHECK_OK(join(&o, &cx->comm));
    return sc_smoke(cx);
}

/* Agents that disagree on settings their collectives between agents depend
 * on (e.g. --rd-max-bytes at one: run.sh --agent-arg; its all_reduces would take
 * recursive doubling where the others' go round the ring): the job is not
 * formed, and every rank's init fails soon with a message naming the
 * settings to compare, rather than a first collective that fails naming
 * something else, or waits. */
static int sc_flags_differ(ctx_t *cx)
{
    (void)cx;
    ps_init_options_t o;
    ps_init_options_default(&o);
    o.join_timeout_ms = 20000;
    /* PS_TEST_FLAG: the flag that differs (default --rd-max-bytes). */
    const char *flag = getenv("PS_TEST_FLAG") ? getenv("PS_TEST_FLAG") : "--rd-max-bytes";
    char want[64];
    snprintf(want, sizeof(want), "%s ", flag);
    int64_t t0 = now_ms();
    TRY(join_expect(&o, PS_EPRECOND, want, "agents with different settings"));
    int64_t took = now_ms() - t0;
    CHECK(took < 10000, "agents with different settings: refused after %lld ms", (long long)took);
    return 0;
}

/* A joiner whose world size differs from the job's is refused, naming it;
 * the job it tried to join cannot form either. */
static int sc_join_world_mismatch(ctx_t *cx)
{
    ps_init_options_t o;
    ps_init_options_default(&o);
    o.join_timeout_ms = 3000;
    if (cx->rank == 0) {
        o.world_size = 2;
        return join_expect(&o, 0, NULL, "world of 2 that rank 1 disagrees with");
    }
    sleep_ms(800); /* rank 0 defines the job */
    o.world_size = 3;
    return join_expect(&o, PS_EINVAL, "world", "world size 3 against 2");
}

/* Two processes asking for the same rank: the second is refused. */
static int sc_join_duplicate(ctx_t *cx)
{
    ps_init_options_t o;
    ps_init_options_default(&o);
    o.world_size = 2;
    o.rank = 0;
    o.join_timeout_ms = 3000;
    if (cx->rank == 0)
        return join_expect(&o, 0, NULL, "rank 0 whose twin arrives");
    sleep_ms(800);
    return join_expect(&o, PS_EEXIST, "rank 0", "a second rank 0");
}

/* A rank that never joins: the others fail at the join deadline, naming it. */
static int sc_join_timeout(ctx_t *cx)
{
    ps_init_options_t o;
    ps_init_options_default(&o);
    o.world_size = cx->size + 1;
    o.join_timeout_ms = 2000;
    int64_t t0 = now_ms();
    int rc = join_expect(&o, PS_ETIMEDOUT, "missing ranks:", "a rank never joins");
    int64_t took = now_ms() - t0;
    /* The list names the rank that never came (and may name another that
     * gave up first). */
    char msg[1024];
    last_error(msg, sizeof(msg));
    CHECK(rc != 0 || names_rank(msg, "missing rank", cx->size),
          "a rank never joins: the missing ranks do not name %d: %s", cx->size, msg);
    CHECK(took >= 1500 && took <= 5000, "join timeout after %lld ms; the deadline is 2000",
          (long long)took);
    return rc;
}

/* ---- device buffers ---- */

/* Device buffers of int32 values for the `device` scenario: they go in and
 * come out through ps_gpu_memcpy_async, never touched by the host. */
static int dev_put(int32_t **dev, const int32_t *host, size_t count)
{
    CHECK_OK(ps_gpu_malloc((void **)dev, count * sizeof(int32_t)));
    CHECK_OK(ps_gpu_memcpy_async(*dev, host, count * sizeof(int32_t), NULL));
    CHECK_OK(ps_gpu_stream_synchronize(NULL));
    return 0;
}

static int dev_get(int32_t *host, const int32_t *dev, size_t count)
{
    CHECK_OK(ps_gpu_memcpy_async(host, dev, count * sizeof(int32_t), NULL));
    CHECK_OK(ps_gpu_stream_synchronize(NULL));
    return 0;
}

static int check_i32(const char *what, const int32_t *got, size_t count,
                     int64_t (*want)(size_t i, int rank, int n), int rank, int n)
{
    for (size_t i = 0; i < count; i++)
        CHECK((int64_t)got[i] == want(i, rank, n), "%s: element %zu is %d, expected %lld", what, i,
              got[i], (long long)want(i, rank, n));
    return 0;
}

/* Built with the fake CUDA (ps-test-worker-fakegpu), checks where the client
 * staged the last call's device buffers: in pinned memory, and with
 * PS_TEST_STAGE_SEGMENT=1 in a segment the agent maps (the agent then works
 * in it where it lies), with 0 in memory of the client's own; with `ipc`,
 * nowhere: the ranks read each other's device inputs (device peer copies);
 * with `any`, not checked.
 * A real device cannot tell: nothing to check there. */
static int staged_reads(ctx_t *cx, const char *what, const char *want_var, int reads)
{
#ifdef PS_TEST_FAKE_CLIENT_GPU
    const void *p = fake_client_gpu_last_pinned();
    int ipc_reads = fake_client_gpu_ipc_reads();
    const char *want = want_var ? getenv(want_var) : NULL;
    if (want && strcmp(want, "any") == 0)
        return 0; /* either way: the scenario checks the results */
    if (want && strcmp(want, "ipc") == 0) {
        CHECK(p == NULL && ipc_reads == reads,
              "%s: staged (%d) and %d reads of other ranks' device buffers, expected none and %d",
              what, p != NULL, ipc_reads, reads);
        return 0;
    }
    CHECK(ipc_reads == 0, "%s: %d reads of other ranks' device buffers", what, ipc_reads);
    CHECK(p != NULL, "%s: the device buffers were not staged through pinned memory", what);
    if (want) {
        int shared = ps_mem_is_shared(cx->comm, p);
        CHECK(shared == atoi(want), "%s: staged in %s", what,
              shared ? "a segment the agent maps" : "memory of the client's own");
    }
#else
    (void)cx, (void)what, (void)want_var, (void)reads;
#endif
    return 0;
}

/* A call that peer copies take: with `ipc`, each rank reads n - 1 blocks. */
static int staged_as(ctx_t *cx, const char *what, const char *want_var)
{
    return staged_reads(cx, what, want_var, cx->size - 1);
}

static int staged(ctx_t *cx, const char *what)
{
    return staged_as(cx, what, "PS_TEST_STAGE_SEGMENT");
}

/* A call that device collectives take (PS_TEST_STAGE_DEVICE): with `ipc`,
 * the rank reads `reads` of other ranks' device buffers, nothing staged. */
static int staged_dev(ctx_t *cx, const char *what, int reads)
{
    return staged_reads(cx, what, "PS_TEST_STAGE_DEVICE", reads);
}

enum { DEV_COUNT = 70001 }; /* odd, and above the shared-memory threshold */

static int64_t dv_rank_value(size_t i, int r, int n)
{
    (void)n;
    return (int64_t)r * 1000 + (int64_t)i;
}

static int64_t dv_all_reduce(size_t i, int r, int n)
{
    (void)r;
    return 1000LL * n * (n - 1) / 2 + (int64_t)n * (int64_t)i;
}

static int64_t dv_broadcast(size_t i, int r, int n)
{
    (void)r, (void)n;
    return 7 * (int64_t)i + 3;
}

/* all_gather's out: block j holds rank j's values. */
static int64_t dv_gathered(size_t i, int r, int n)
{
    (void)r, (void)n;
    return dv_rank_value(i % DEV_COUNT, (int)(i / DEV_COUNT), n);
}

/* reduce_scatter's in on rank r: (r + 1) * global index. */
static int64_t dv_rs_in(size_t i, int r, int n)
{
    (void)n;
    return (int64_t)(r + 1) * (int64_t)i;
}

static int64_t dv_rs_out(size_t i, int r, int n)
{
    return (int64_t)n * (n + 1) / 2 * (int64_t)(r * DEV_COUNT + i);
}

static void fill_i32(int32_t *p, size_t count, int64_t (*f)(size_t, int, int), int r, int n)
{
    for (size_t i = 0; i < count; i++)
        p[i] = (int32_t)f(i, r, n);
}

/* The large calls that peer copies take: blocks of these many int32 (all
 * just above a size: 4 MiB, 1 MiB, 2 MiB), and each one's values. */
enum { BIG_AG = (1 << 20) + 1, BIG_A2A = (1 << 18) + 3, BIG_SC = (1 << 19) + 3 };

/* all_gather: rank r's input; the output holds every rank's in order. */
static int64_t big_ag_in(size_t i, int r, int n)
{
    (void)n;
    return r * 7 + (int64_t)(i % 1000);
}

static int64_t big_ag_out(size_t i, int r, int n)
{
    (void)r;
    return big_ag_in(i % BIG_AG, (int)(i / BIG_AG), n);
}

/* all_to_all: rank r's block j; rank r's output block j is rank j's block r. */
static int64_t big_a2a_in(size_t i, int r, int n)
{
    (void)n;
    return r * 1000 + (int64_t)(i / BIG_A2A) * 7 + (int64_t)(i % BIG_A2A % 97);
}

static int64_t big_a2a_out(size_t i, int r, int n)
{
    return big_a2a_in(i % BIG_A2A + (size_t)r * BIG_A2A, (int)(i / BIG_A2A), n);
}

/* scatter: the root's block j goes to rank j. */
static int64_t big_sc_in(size_t i, int r, int n)
{
    (void)r, (void)n;
    return (int64_t)(i / BIG_SC) * 1000 + (int64_t)(i % BIG_SC % 89);
}

static int64_t big_sc_out(size_t i, int r, int n)
{
    return big_sc_in(i + (size_t)r * BIG_SC, 0, n);
}

/* An all_gather of device buffers large enough (4 MiB a rank) for peer
 * copies where the ranks share an agent: they read each other's device
 * inputs where they lie (device peer copies: nothing staged), or, without
 * CUDA IPC, each other's staged inputs, which the client then stages in
 * memory of its own, not in a segment (PS_TEST_STAGE_PEER says which the
 * fake CUDA must have seen). With `mixed`, the odd ranks' inputs are host
 * memory: the ranks cannot all read alike, and the call goes through the
 * agent, the even ranks' device inputs staged only then. */
static int dv_big_all_gather(ctx_t *cx, int mixed)
{
    int r = cx->rank, n = cx->size;
    const size_t c = BIG_AG, all = (size_t)n * c;
    int32_t *host = malloc(all * sizeof(int32_t)), *din = NULL, *dout = NULL;
    const char *what = mixed ? "all_gather (4 MiB a rank, odd ranks' inputs on the host)"
                             : "all_gather (4 MiB a rank)";
    int rc = host ? 0 : fail("out of memory");
    if (rc == 0) {
        fill_i32(host, c, big_ag_in, r, n);
        rc = dev_put(&din, host, c);
    }
    if (rc == 0)
        rc = dev_put(&dout, host, all);
    const void *in = mixed && r % 2 ? (const void *)host : din;
    if (rc == 0 && (rc = ps_all_gather(cx->comm, dout, in, c, PS_INT32, NULL)) != 0)
        rc = fail("%s returned %d (%s)", what, rc, ps_strerror(rc));
    if (rc == 0)
        rc = staged_as(cx, what, mixed ? NULL : "PS_TEST_STAGE_PEER");
    if (rc == 0)
        rc = dev_get(host, dout, all);
    if (rc == 0)
        rc = check_i32(what, host, all, big_ag_out, r, n);
    ps_gpu_free(din);
    ps_gpu_free(dout);
    free(host);
    return rc;
}

/* A scatter from the last rank of device buffers, 2 MiB a block, which peer
 * copies take where the ranks share an agent (from 4 MiB of blocks): each
 * other rank reads its block of the root's input (the root copies its own). */
static int dv_big_scatter(ctx_t *cx)
{
    int r = cx->rank, n = cx->size, root = n - 1;
    const size_t c = BIG_SC, all = (size_t)n * c;
    int32_t *host = malloc(all * sizeof(int32_t)), *din = NULL, *dout = NULL;
    int rc = host ? 0 : fail("out of memory");
    if (rc == 0) {
        fill_i32(host, all, big_sc_in, r, n);
        rc = r == root ? dev_put(&din, host, all) : 0;
    }
    if (rc == 0)
        rc = dev_put(&dout, host + all - c, c); /* anything but its block */
    if (rc == 0 && (rc = ps_scatter(cx->comm, dout, din, c, PS_INT32, root, NULL)) != 0)
        rc = fail("scatter (2 MiB blocks) returned %d (%s)", rc, ps_strerror(rc));
    if (rc == 0)
        rc = staged_reads(cx, "scatter (2 MiB blocks)", "PS_TEST_STAGE_PEER", r == root ? 0 : 1);
    if (rc == 0)
        rc = dev_get(host, dout, c);
    if (rc == 0)
        rc = check_i32("scatter (2 MiB blocks)", host, c, big_sc_out, r, n);
    ps_gpu_free(din);
    ps_gpu_free(dout);
    free(host);
    return rc;
}

/* An all_to_all of device buffers, 1 MiB a block, which peer copies take
 * where the ranks share an agent, into host memory. */
static int dv_big_all_to_all(ctx_t *cx)
{
    int r = cx->rank, n = cx->size;
    const size_t all = (size_t)n * BIG_A2A;
    int32_t *host = malloc(all * sizeof(int32_t)), *out = calloc(all, sizeof(int32_t));
    int32_t *din = NULL;
    int rc = host && out ? 0 : fail("out of memory");
    if (rc == 0) {
        fill_i32(host, all, big_a2a_in, r, n);
        rc = dev_put(&din, host, all);
    }
    if (rc == 0 && (rc = ps_all_to_all(cx->comm, out, din, BIG_A2A, PS_INT32, NULL)) != 0)
        rc = fail("all_to_all (1 MiB blocks) returned %d (%s)", rc, ps_strerror(rc));
    if (rc == 0)
        rc = staged_as(cx, "all_to_all (1 MiB blocks)", "PS_TEST_STAGE_PEER");
    if (rc == 0)
        rc = check_i32("all_to_all (1 MiB blocks)", out, all, big_a2a_out, r, n);
    ps_gpu_free(din);
    free(out);
    free(host);
    return rc;
}

/* Collectives on device memory from ps_gpu_malloc: the client stages them
 * through pinned host memory. Every element is checked after copying the
 * results back. Without a CUDA device this scenario is SKIPPED: it never
 * passes without having run. */
static int sc_device_body(ctx_t *cx, int32_t *host, int32_t *host2, int32_t **dev)
{
    int r = cx->rank, n = cx->size;
    size_t c = DEV_COUNT, all = (size_t)n * DEV_COUNT;

    /* all_reduce in place on one device buffer. */
    fill_i32(host, c, dv_rank_value, r, n);
    TRY(dev_put(&dev[0], host, c));
    CHECK_OK(ps_all_reduce(cx->comm, dev[0], c, PS_INT32, PS_SUM, NULL));
    /* Device collectives: the others' inputs, then their slices of the result. */
    TRY(staged_dev(cx, "all_reduce", 2 * (n - 1)));
    TRY(dev_get(host, dev[0], c));
    TRY(check_i32("all_reduce", host, c, dv_all_reduce, r, n));

    /* broadcast from the last rank; the others' buffers start as zeros. */
    for (size_t i = 0; i < c; i++)
        host[i] = r == n - 1 ? (int32_t)dv_broadcast(i, r, n) : 0;
    CHECK_OK(ps_gpu_memcpy_async(dev[0], host, c * sizeof(int32_t), NULL));
    CHECK_OK(ps_gpu_stream_synchronize(NULL));
    CHECK_OK(ps_broadcast(cx->comm, dev[0], c, PS_INT32, n - 1, NULL));
    TRY(staged_dev(cx, "broadcast", r == n - 1 ? 0 : 1));
    TRY(dev_get(host, dev[0], c));
    TRY(check_i32("broadcast", host, c, dv_broadcast, r, n));

    /* all_gather: device to device, then host in with device out, then
     * device in with host out. */
    fill_i32(host, c, dv_rank_value, r, n);
    CHECK_OK(ps_gpu_memcpy_async(dev[0], host, c * sizeof(int32_t), NULL));
    CHECK_OK(ps_gpu_stream_synchronize(NULL));
    TRY(dev_put(&dev[1], host2, all)); /* host2: whatever it holds */
    CHECK_OK(ps_all_gather(cx->comm, dev[1], dev[0], c, PS_INT32, NULL));
    TRY(staged(cx, "all_gather (device, device)"));
    TRY(dev_get(host2, dev[1], all));
    TRY(check_i32("all_gather (device, device)", host2, all, dv_gathered, r, n));
    memset(host2, 0, all * sizeof(int32_t));
    CHECK_OK(ps_gpu_memcpy_async(dev[1], host2, all * sizeof(int32_t), NULL));
    CHECK_OK(ps_gpu_stream_synchronize(NULL));
    CHECK_OK(ps_all_gather(cx->comm, dev[1], host, c, PS_INT32, NULL));
    TRY(staged(cx, "all_gather (host in, device out)"));
    TRY(dev_get(host2, dev[1], all));
    TRY(check_i32("all_gather (host in, device out)", host2, all, dv_gathered, r, n));
    memset(host2, 0, all * sizeof(int32_t));
    CHECK_OK(ps_all_gather(cx->comm, host2, dev[0], c, PS_INT32, NULL));
    TRY(staged(cx, "all_gather (device in, host out)"));
    TRY(check_i32("all_gather (device in, host out)", host2, all, dv_gathered, r, n));
    TRY(dv_big_all_gather(cx, 0));
    TRY(dv_big_all_gather(cx, 1));
    TRY(dv_big_all_to_all(cx));
    TRY(dv_big_scatter(cx));

    /* reduce_scatter: n blocks in, one block out, both on the device. */
    fill_i32(host2, all, dv_rs_in, r, n);
    CHECK_OK(ps_gpu_memcpy_async(dev[1], host2, all * sizeof(int32_t), NULL));
    CHECK_OK(ps_gpu_stream_synchronize(NULL));
    CHECK_OK(ps_reduce_scatter(cx->comm, dev[0], dev[1], c, PS_INT32, PS_SUM, NULL));
    TRY(staged_dev(cx, "reduce_scatter", n - 1));
    TRY(dev_get(host, dev[0], c));
    TRY(check_i32("reduce_scatter", host, c, dv_rs_out, r, n));

    /* reduce_to the last rank, in place there: it reads every other rank's buffer. */
    fill_i32(host, c, dv_rank_value, r, n);
    CHECK_OK(ps_gpu_memcpy_async(dev[0], host, c * sizeof(int32_t), NULL));
    CHECK_OK(ps_gpu_stream_synchronize(NULL));
    CHECK_OK(ps_reduce_to(cx->comm, dev[0], c, PS_INT32, PS_SUM, n - 1, NULL));
    TRY(staged_dev(cx, "reduce_to", r == n - 1 ? n - 1 : 0));
    TRY(dev_get(host, dev[0], c));
    TRY(check_i32("reduce_to", host, c, r == n - 1 ? dv_all_reduce : dv_rank_value, r, n));

    /* An all_reduce whose odd ranks' buffers are host memory: the ranks
     * cannot all work on the device, so it goes through the agent, the even
     * ranks' device buffers staged only then. */
    fill_i32(host, c, dv_rank_value, r, n);
    CHECK_OK(ps_gpu_memcpy_async(dev[0], host, c * sizeof(int32_t), NULL));
    CHECK_OK(ps_gpu_stream_synchronize(NULL));
    CHECK_OK(ps_all_reduce(cx->comm, r % 2 ? (void *)host : dev[0], c, PS_INT32, PS_SUM, NULL));
    if (r % 2 == 0) {
        TRY(staged_reads(cx, "all_reduce (odd ranks' buffers on the host)", NULL, 0));
        TRY(dev_get(host, dev[0], c));
    }
    TRY(check_i32("all_reduce (odd ranks' buffers on the host)", host, c, dv_all_reduce, r, n));

    /* send/recv in pairs: even ranks send their device buffer to the next. */
    if (n >= 2 && !(n % 2 == 1 && r == n - 1)) {
        if (r % 2 == 0) {
            fill_i32(host, c, dv_broadcast, r, n);
            CHECK_OK(ps_gpu_memcpy_async(dev[0], host, c * sizeof(int32_t), NULL));
            CHECK_OK(ps_gpu_stream_synchronize(NULL));
            CHECK_OK(ps_send(cx->comm, dev[0], c, PS_INT32, r + 1, 4, NULL));
            TRY(staged(cx, "send"));
        } else {
            int source = -1;
            memset(host, 0, c * sizeof(int32_t));
            CHECK_OK(ps_gpu_memcpy_async(dev[0], host, c * sizeof(int32_t), NULL));
            CHECK_OK(ps_gpu_stream_synchronize(NULL));
            CHECK_OK(ps_recv(cx->comm, dev[0], c, PS_INT32, r - 1, 4, NULL, &source));
            CHECK(source == r - 1, "recv: source %d, expected %d", source, r - 1);
            TRY(staged(cx, "recv"));
            TRY(dev_get(host, dev[0], c));
            TRY(check_i32("recv", host, c, dv_broadcast, r, n));
        }
    }

    /* An async all_reduce: the result is on the device once the work is done. */
    fill_i32(host, c, dv_rank_value, r, n);
    CHECK_OK(ps_gpu_memcpy_async(dev[0], host, c * sizeof(int32_t), NULL));
    CHECK_OK(ps_gpu_stream_synchronize(NULL));
    ps_work_t *w = NULL;
    CHECK_OK(ps_iall_reduce(cx->comm, dev[0], c, PS_INT32, PS_SUM, NULL, &w));
    int wrc = ps_work_wait(w);
    ps_work_free(w);
    CHECK_OK(wrc);
    TRY(staged_dev(cx, "iall_reduce", 2 * (n - 1)));
    TRY(dev_get(host, dev[0], c));
    TRY(check_i32("iall_reduce", host, c, dv_all_reduce, r, n));
    return ps_barrier(cx->comm, NULL);
}

/* Device collectives whose work on the device fails (the fake CUDA's
 * PS_FAKEGPU_REDUCE=fail: half the output written, then an error), on every
 * rank: a reduce_scatter, whose inputs are intact, goes through the agent
 * and is right; an in-place all_reduce, whose inputs are half overwritten,
 * fails on every rank with INTERNAL and says why; the job goes on. */
static int sc_device_fail(ctx_t *cx)
{
#ifndef PS_TEST_FAKE_CLIENT_GPU
    (void)cx;
    printf("SKIPPED: the device_fail scenario needs the fake CUDA (ps-test-worker-fakegpu)\n");
    return SKIP;
#else
    int r = cx->rank, n = cx->size;
    size_t c = DEV_COUNT, all = (size_t)n * DEV_COUNT;
    int32_t *host = malloc(all * sizeof(int32_t)), *din = NULL, *dout = NULL;
    CHECK(host != NULL, "out of memory");
    fill_i32(host, all, dv_rs_in, r, n);
    TRY(dev_put(&din, host, all));
    TRY(dev_put(&dout, host, c));
    CHECK_OK(ps_reduce_scatter(cx->comm, dout, din, c, PS_INT32, PS_SUM, NULL));
    TRY(staged_reads(cx, "reduce_scatter (device work failed)", NULL, 0));
    TRY(dev_get(host, dout, c));
    TRY(check_i32("reduce_scatter (device work failed)", host, c, dv_rs_out, r, n));

    fill_i32(host, c, dv_rank_value, r, n);
    CHECK_OK(ps_gpu_memcpy_async(din, host, c * sizeof(int32_t), NULL));
    clear_last_error();
    int rc = ps_all_reduce(cx->comm, din, c, PS_INT32, PS_SUM, NULL);
    char msg[1024];
    last_error(msg, sizeof(msg));
    CHECK(rc == PS_EINTERNAL, "all_reduce in place with the device failing returned %d (%s)", rc,
          ps_strerror(rc));
    CHECK(strstr(msg, "cannot be repeated through the agent") != NULL,
          "all_reduce in place with the device failing: message '%s'", msg);
    /* The job goes on: a host all_reduce. */
    fill_i32(host, c, dv_rank_value, r, n);
    CHECK_OK(ps_all_reduce(cx->comm, host, c, PS_INT32, PS_SUM, NULL));
    TRY(check_i32("all_reduce after the failure", host, c, dv_all_reduce, r, n));
    ps_gpu_free(din);
    ps_gpu_free(dout);
    free(host);
    return 0;
#endif
}

static int sc_device(ctx_t *cx)
{
    int ndev = 0;
    if (ps_gpu_device_count(&ndev) != 0) {
        printf("SKIPPED: no CUDA device\n");
        return SKIP;
    }
    size_t all = (size_t)cx->size * DEV_COUNT;
    int32_t *host = malloc(DEV_COUNT * sizeof(int32_t)), *host2 = calloc(all, sizeof(int32_t));
    int32_t *dev[2] = {NULL, NULL};
    int rc = host && host2 ? sc_device_body(cx, host, host2, dev) : fail("out of memory");
    ps_gpu_free(dev[0]);
    ps_gpu_free(dev[1]);
    free(host);
    free(host2);
    return rc;
}

/* ---------------------------------------------------------------- main */

typedef struct scenario {
    const char *name;
    int (*fn)(ctx_t *);
    int joins; /* 1: the harness joins before and finalizes after */
    int64_t timeout_ms;
} scenario_t;

static const scenario_t scenarios[] = {
    {"all_reduce", sc_all_reduce, 1, 0},
    {"reduce", sc_reduce, 1, 0},
    {"broadcast", sc_broadcast, 1, 0},
    {"all_gather", sc_all_gather, 1, 0},
    {"all_gather_small", sc_all_gather, 1, 0},
    {"broadcast_small", sc_broadcast, 1, 0},
    {"reduce_small", sc_reduce, 1, 0},
    {"gather", sc_gather, 1, 0},
    {"scatter", sc_scatter, 1, 0},
    {"reduce_scatter", sc_reduce_scatter, 1, 0},
    {"all_to_all", sc_all_to_all, 1, 0},
    {"all_to_all_large", sc_all_to_all_large, 1, 0},
    {"all_to_all_v", sc_all_to_all_v, 1, 0},
    {"all_to_all_v_limit", sc_all_to_all_v_limit, 1, 0},
    {"all_to_all_v_scratch", sc_all_to_all_v_scratch, 1, 0},
    {"reduce_scatter_large", sc_reduce_scatter_large, 1, 0},
    {"forward_stream", sc_forward_stream, 1, 0},
    {"peer", sc_peer, 1, 0},
    {"peer_mapped", sc_peer_mapped, 1, 0},
    {"barrier", sc_barrier, 1, 0},
    {"barrier_direct", sc_barrier_direct, 1, 2000},
    {"send_recv", sc_send_recv, 1, 0},
    {"doorbell", sc_doorbell, 1, 0},
    {"arrival_order", sc_arrival_order, 1, 0},
    {"inflight", sc_inflight, 1, 0},
    {"shm_reuse", sc_shm_reuse, 1, 30000},
    {"collectives", sc_collectives, 1, 0},
    {"collectives_light", sc_collectives, 1, 0},
    {"registered", sc_registered, 1, 0},
    {"big", sc_big, 1, 0},
    {"direct", sc_direct, 1, 0},
    {"own_block", sc_own_block, 1, 0},
    {"in_place", sc_in_place, 1, 0},
    {"groups", sc_groups, 1, 0},
    {"async", sc_async, 1, 0},
    {"recv_any", sc_recv_any, 1, 0},
    {"mixed", sc_mixed, 1, 0},
    {"local_errors", sc_local_errors, 1, 0},
    {"mismatch", sc_mismatch, 1, 0},
    {"too_big", sc_too_big, 1, 0},
    {"smoke", sc_smoke, 1, 0},
    {"early_exit", sc_early_exit, 1, 0},
    {"straggler", sc_straggler, 1, 0},
    {"peer_timeout", sc_peer_timeout, 1, 2000},
    {"barrier_late_rank", sc_barrier_late_rank, 1, 2000},
    {"barrier_late_half", sc_barrier_late_half, 1, 2000},
    {"member_lost", sc_member_lost, 1, 0},
    {"sigterm", sc_sigterm, 1, 0},
    {"device", sc_device, 1, 0},
    {"device_fail", sc_device_fail, 1, 0},
    {"join_bad_rank", sc_join_bad_rank, 0, 0},
    {"env_errors", sc_env_errors, 0, 0},
    {"join_world_mismatch", sc_join_world_mismatch, 0, 0},
    {"join_duplicate", sc_join_duplicate, 0, 0},
    {"join_timeout", sc_join_timeout, 0, 0},
    {"flags_differ", sc_flags_differ, 0, 0},
};

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc != 2) {
        fprintf(stderr, "usage: %s SCENARIO\nscenarios:", argv[0]);
        for (size_t i = 0; i < sizeof(scenarios) / sizeof(scenarios[0]); i++)
            fprintf(stderr, " %s", scenarios[i].name);
        fputc('\n', stderr);
        return 2;
    }
    const scenario_t *sc = NULL;
    for (size_t i = 0; i < sizeof(scenarios) / sizeof(scenarios[0]); i++)
        if (strcmp(scenarios[i].name, argv[1]) == 0)
            sc = &scenarios[i];
    if (!sc) {
        fprintf(stderr, "unknown scenario '%s'\n", argv[1]);
        return 2;
    }
    g_scenario = sc->name;
    ctx_t cx = {.rank = env_int("RANK", -1),
                .size = env_int("WORLD_SIZE", 1),
                .salt = (unsigned)env_int("PS_TEST_SALT", 0)};
    g_rank = cx.rank;
    g_verbose = env_int("PS_TEST_VERBOSE", 0);
    g_light = strcmp(sc->name, "collectives_light") == 0;
    size_t nlen = strlen(sc->name);
    g_small = nlen > 6 && strcmp(sc->name + nlen - 6, "_small") == 0;

    int64_t t0 = now_ms();
    /* The device scenario loads CUDA before it joins, as a training process
     * would: a process with CUDA loaded at ps_init joins for device
     * collectives. Without a device the scenario skips. */
    int ndev = 0;
    /* PS_TEST_HOST_PER_RANK: each rank says it is on a host of its own. */
    char host_id[32];
    snprintf(host_id, sizeof(host_id), "host-%d", cx.rank);
    if (env_int("PS_TEST_HOST_PER_RANK", 0))
        setenv("PARAMSYNC_HOST_ID", host_id, 1);
    /* PS_TEST_RANK0_ENV=NAME=VALUE: rank 0 alone joins with it set. */
    const char *rank0_env = getenv("PS_TEST_RANK0_ENV");
    if (rank0_env && cx.rank == 0 && strchr(rank0_env, '='))
        putenv(strdup(rank0_env));
    if (strncmp(sc->name, "device", 6) == 0 && ps_gpu_device_count(&ndev) == 0)
        (void)ps_gpu_set_device(0);
    int threads0 = thread_count();
    if (sc->joins) {
        ps_init_options_t o;
        ps_init_options_default(&o);
        o.timeout_ms = sc->timeout_ms;
        int rc = join(&o, &cx.comm);
        if (rc != 0) {
            fail("ps_init: %d (%s)", rc, ps_strerror(rc));
            return 1;
        }
        cx.rank = g_rank = ps_get_rank(cx.comm, NULL);
        cx.size = ps_get_world_size(cx.comm, NULL);
    }
    int rc = sc->fn(&cx);
    if (cx.comm) {
        int frc = ps_finalize(cx.comm);
        /* After a lost member or a daemon that is gone, Leave may fail. */
        if (frc != 0 && rc == 0 && strcmp(sc->name, "sigterm") != 0 &&
            strcmp(sc->name, "member_lost") != 0 &&
            !(strcmp(sc->name, "barrier_direct") == 0 && getenv("PS_TEST_BARRIER"))) {
            fail("ps_finalize: %d (%s)", frc, ps_strerror(frc));
            rc = -1;
        }
    }
    /* The last ps_finalize, or a ps_init that failed, leaves no thread of the
     * library's or gRPC's behind (a real GPU's driver keeps threads of its
     * own). */
    int threads = thread_count_settled(threads0, 2000);
    if (threads != threads0 && rc == 0 && strncmp(sc->name, "device", 6) != 0) {
        char names[1024];
        fail("the library left %d threads running (%d before ps_init): %s", threads, threads0,
             thread_names(names, sizeof(names)));
        rc = -1;
    }
    if (rc == SKIP)
        return SKIP;
    note("%s in %lld ms", rc == 0 ? "passed" : "FAILED", (long long)(now_ms() - t0));
    return rc == 0 ? 0 : 1;
}
