/* One soak rank: mixed collectives of random sizes through libparamsync, each result verified. */
#include <errno.h>
#include <stdarg.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <paramsync/paramsync.h>

/* The engine's conversions (round to nearest even), proven by tests/unit. */
#include "ps_elementwise.h"

/*
 * Every rank of a job draws the same sequence of collectives from a PRNG
 * seeded with (seed, job), so they agree without talking. Every element a
 * rank contributes is a small integer computed from (group rank, iteration,
 * position), so each rank computes the expected result of every collective
 * locally and exactly (sums, products and averages of such integers are
 * exact in every dtype used). The ranks stop together: each iteration ends
 * with an all_reduce (MAX) of "my time is up".
 */

#define SOAK_MAX_RANKS 16

typedef struct rng {
    uint64_t s;
} rng_t;

/* splitmix64: small, good enough, and the same on every rank. */
static uint64_t rng_next(rng_t *r)
{
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t rng_below(rng_t *r, uint64_t n)
{
    return rng_next(r) % n;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* ---- element values and dtypes ---- */

/* What group rank r contributes at position i in iteration k: -30..30. */
static int64_t val(int r, uint64_t k, size_t i)
{
    return (int64_t)(((uint64_t)r * 7u + k * 13u + (uint64_t)i * 3u) % 61u) - 30;
}

static const ps_dtype_t dtypes[] = {PS_INT32,   PS_INT64, PS_FLOAT32,
                                    PS_FLOAT64, PS_UINT8, PS_BFLOAT16};
#define NDTYPES (sizeof(dtypes) / sizeof(dtypes[0]))

/* Stores v (an integer, or for AVG a multiple of 1/4) at element i. */
static void put(ps_dtype_t t, void *buf, size_t i, double v)
{
    switch (t) {
    case PS_INT32:
        ((int32_t *)buf)[i] = (int32_t)(int64_t)v;
        break;
    case PS_INT64:
        ((int64_t *)buf)[i] = (int64_t)v;
        break;
    case PS_FLOAT32:
        ((float *)buf)[i] = (float)v;
        break;
    case PS_FLOAT64:
        ((double *)buf)[i] = v;
        break;
    case PS_UINT8:
        ((uint8_t *)buf)[i] = (uint8_t)(int64_t)v; /* wraps, as the reduction does */
        break;
    case PS_BFLOAT16:
        ((uint16_t *)buf)[i] = ps_f32_to_bf16((float)v);
        break;
    default:
        abort();
    }
}

/* Compares by value, so that -0.0 equals 0.0 (a product's sign of zero is
 * not something the reference can know). */
static int same(ps_dtype_t t, const void *a, const void *b, size_t i)
{
    switch (t) {
    case PS_INT32:
        return ((const int32_t *)a)[i] == ((const int32_t *)b)[i];
    case PS_INT64:
        return ((const int64_t *)a)[i] == ((const int64_t *)b)[i];
    case PS_FLOAT32:
        return ((const float *)a)[i] == ((const float *)b)[i];
    case PS_FLOAT64:
        return ((const double *)a)[i] == ((const double *)b)[i];
    case PS_UINT8:
        return ((const uint8_t *)a)[i] == ((const uint8_t *)b)[i];
    case PS_BFLOAT16:
        return ps_bf16_to_f32(((const uint16_t *)a)[i]) == ps_bf16_to_f32(((const uint16_t *)b)[i]);
    default:
        abort();
    }
}

static double element(ps_dtype_t t, const void *buf, size_t i)
{
    switch (t) {
    case PS_INT32:
        return ((const int32_t *)buf)[i];
    case PS_INT64:
        return (double)((const int64_t *)buf)[i];
    case PS_FLOAT32:
        return ((const float *)buf)[i];
    case PS_FLOAT64:
        return ((const double *)buf)[i];
    case PS_UINT8:
        return ((const uint8_t *)buf)[i];
    case PS_BFLOAT16:
        return ps_bf16_to_f32(((const uint16_t *)buf)[i]);
    default:
        abort();
    }
}

/* Ops a dtype can take whose results stay exact for these values. */
static ps_op_t pick_op(rng_t *r, ps_dtype_t t)
{
    static const ps_op_t ints[] = {PS_SUM, PS_PRODUCT, PS_MIN, PS_MAX, PS_BAND, PS_BOR, PS_BXOR};
    static const ps_op_t floats[] = {PS_SUM, PS_PRODUCT, PS_MIN, PS_MAX, PS_AVG};
    static const ps_op_t small[] = {PS_SUM, PS_MIN, PS_MAX, PS_AVG}; /* bf16: 8-bit mantissa */
    static const ps_op_t bytes[] = {PS_SUM, PS_MAX, PS_MIN, PS_BXOR};
    switch (t) {
    case PS_BFLOAT16:
        return small[rng_below(r, 4)];
    case PS_UINT8:
        return bytes[rng_below(r, 4)];
    case PS_FLOAT32:
    case PS_FLOAT64:
        return floats[rng_below(r, 5)];
    default:
        return ints[rng_below(r, 7)];
    }
}

/* The reduction of the values of group ranks 0..n-1 at position (k, i), as
 * the dtype holds it (uint8 sums wrap; BAND/BOR/BXOR on two's complement). */
static double reduce_ref(ps_dtype_t t, ps_op_t op, int n, uint64_t k, size_t i)
{
    int64_t acc = val(0, k, i);
    if (t == PS_UINT8)
        acc = (uint8_t)acc;
    for (int r = 1; r < n; r++) {
        int64_t v = val(r, k, i);
        if (t == PS_UINT8)
            v = (uint8_t)v;
        switch (op) {
        case PS_SUM:
        case PS_AVG:
            acc += v;
            break;
        case PS_PRODUCT:
            acc *= v;
            break;
        case PS_MIN:
            acc = v < acc ? v : acc;
            break;
        case PS_MAX:
            acc = v > acc ? v : acc;
            break;
        case PS_BAND:
            acc &= v;
            break;
        case PS_BOR:
            acc |= v;
            break;
        case PS_BXOR:
            acc ^= v;
            break;
        default:
            abort();
        }
        if (t == PS_UINT8)
            acc = (uint8_t)acc;
    }
    return op == PS_AVG ? (double)acc / n : (double)acc;
}

/* ---- the run ---- */

typedef struct soak {
    ps_comm_t *comm;
    const char *job;
    int rank, world;
    uint64_t iter;
    char what[96]; /* the collective being run, for messages */
    uint64_t ncoll, bytes;
} soak_t;

static void die(const soak_t *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void die(const soak_t *s, const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "soak_worker: job %s rank %d iteration %" PRIu64 " (%s): ", s->job, s->rank,
            s->iter, s->what);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(1);
}

static void ok(soak_t *s, int rc, size_t bytes)
{
    if (rc != 0)
        die(s, "returned %d (%s)", rc, ps_strerror(rc));
    s->ncoll++;
    s->bytes += bytes;
}

static void *xmalloc(soak_t *s, size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p)
        die(s, "out of memory for %zu bytes", n);
    return p;
}

/* Fills count elements with group rank r's values, positions from base. */
static void fill(ps_dtype_t t, void *buf, int r, uint64_t k, size_t base, size_t count)
{
    for (size_t i = 0; i < count; i++)
        put(t, buf, i, (double)val(r, k, base + i));
}

/* Checks count elements of got against want(i); dies naming the first wrong one. */
#define VERIFY(s, t, got, count, want_expr)                                                        \
    do {                                                                                           \
        void *want_ = xmalloc((s), (count)*ps_dtype_size(t));                                      \
        for (size_t i = 0; i < (count); i++)                                                       \
            put((t), want_, i, (want_expr));                                                       \
        for (size_t i = 0; i < (count); i++)                                                       \
            if (!same((t), (got), want_, i))                                                       \
                die((s), "%s x%zu: element %zu is %g, want %g", ps_dtype_name(t), (size_t)(count), \
                    i, element((t), (got), i), element((t), want_, i));                            \
        free(want_);                                                                               \
    } while (0)

enum kind {
    K_ALL_REDUCE,
    K_BROADCAST,
    K_REDUCE,
    K_ALL_GATHER,
    K_GATHER,
    K_SCATTER,
    K_REDUCE_SCATTER,
    K_ALL_TO_ALL,
    K_RING,     /* isend to the next rank, recv from the previous */
    K_ANY_RECV, /* every rank sends to rank 0, which receives from any */
    K_BATCH,    /* three iall_reduce in flight at once */
    K_BARRIER,
    K_GROUP, /* an all_reduce in a sub-group (even and odd ranks) */
    K_COUNT
};
static const char *const kind_names[] = {
    "all_reduce",      "broadcast",      "reduce",          "all_gather",     "gather",
    "scatter",         "reduce_scatter", "all_to_all",      "send/recv ring", "recv from any",
    "3 x iall_reduce", "barrier",        "group all_reduce"};

/* A size: mostly small, some medium, a few large; kinds whose buffers are n
 * times count draw from a smaller range. */
static size_t pick_count(rng_t *r, int times_n, uint64_t iter)
{
    size_t max_large = times_n ? (256u << 10) : (2u << 20);
    if (iter < K_COUNT)
        return max_large;
    uint64_t p = rng_below(r, 100);
    if (p < 60)
        return 1 + (size_t)rng_below(r, 1024);
    if (p < 90)
        return 1024 + (size_t)rng_below(r, 63 * 1024);
    if (p < 99)
        return (64u << 10) + (size_t)rng_below(r, (times_n ? 192u : 960u) << 10);
    return max_large / 2 + (size_t)rng_below(r, max_large / 2 + 1);
}

static void run_one(soak_t *s, rng_t *rng, ps_group_t *groups[2])
{
    uint64_t k = s->iter;
    /* The first K_COUNT iterations run every kind at its largest size in
     * float64, in every job at once: the daemon's memory reaches its
     * high-water mark during warm-up, so later growth means a leak. */
    int sweep = k < K_COUNT;
    enum kind kind = (enum kind)(sweep ? k : rng_below(rng, K_COUNT));
    ps_dtype_t t = sweep ? PS_FLOAT64 : dtypes[rng_below(rng, NDTYPES)];
    ps_op_t op = sweep ? PS_SUM : pick_op(rng, t);
    int times_n = kind == K_ALL_GATHER || kind == K_GATHER || kind == K_SCATTER ||
                  kind == K_REDUCE_SCATTER || kind == K_ALL_TO_ALL;
    size_t count = pick_count(rng, times_n, k);
    int n = s->world, me = s->rank;
    int root = (int)rng_below(rng, (uint64_t)n);
    size_t esz = ps_dtype_size(t), nbytes = count * esz;
    snprintf(s->what, sizeof(s->what), "%s %s %s x%zu root %d", kind_names[kind], ps_dtype_name(t),
             ps_op_name(op), count, root);

    switch (kind) {
    case K_ALL_REDUCE: {
        void *buf = xmalloc(s, nbytes);
        fill(t, buf, me, k, 0, count);
        ok(s, ps_all_reduce(s->comm, buf, count, t, op, NULL), nbytes);
        VERIFY(s, t, buf, count, reduce_ref(t, op, n, k, i));
        free(buf);
        break;
    }
    case K_BROADCAST: {
        void *buf = xmalloc(s, nbytes);
        if (me == root)
            fill(t, buf, me, k, 0, count);
        else
            memset(buf, 0x5a, nbytes);
        ok(s, ps_broadcast(s->comm, buf, count, t, root, NULL), nbytes);
        VERIFY(s, t, buf, count, (double)val(root, k, i));
        free(buf);
        break;
    }
    case K_REDUCE: {
        void *buf = xmalloc(s, nbytes);
        fill(t, buf, me, k, 0, count);
        ok(s, ps_reduce_to(s->comm, buf, count, t, op, root, NULL), nbytes);
        if (me == root)
            VERIFY(s, t, buf, count, reduce_ref(t, op, n, k, i));
        else
            VERIFY(s, t, buf, count, (double)val(me, k, i)); /* left as it was */
        free(buf);
        break;
    }
    case K_ALL_GATHER:
    case K_GATHER: {
        void *in = xmalloc(s, nbytes), *out = NULL;
        fill(t, in, me, k, 0, count);
        int receives = kind == K_ALL_GATHER || me == root;
        if (receives)
            out = xmalloc(s, nbytes * (size_t)n);
        if (kind == K_ALL_GATHER)
            ok(s, ps_all_gather(s->comm, out, in, count, t, NULL), nbytes);
        else
            ok(s, ps_gather(s->comm, out, in, count, t, root, NULL), nbytes);
        if (receives)
            VERIFY(s, t, out, count * (size_t)n, (double)val((int)(i / count), k, i % count));
        free(in);
        free(out);
        break;
    }
    case K_SCATTER: {
        void *in = NULL, *out = xmalloc(s, nbytes);
        if (me == root) {
            in = xmalloc(s, nbytes * (size_t)n);
            fill(t, in, root, k, 0, count * (size_t)n);
        }
        ok(s, ps_scatter(s->comm, out, in, count, t, root, NULL), nbytes);
        VERIFY(s, t, out, count, (double)val(root, k, (size_t)me * count + i));
        free(in);
        free(out);
        break;
    }
    case K_REDUCE_SCATTER: {
        void *in = xmalloc(s, nbytes * (size_t)n), *out = xmalloc(s, nbytes);
        fill(t, in, me, k, 0, count * (size_t)n);
        ok(s, ps_reduce_scatter(s->comm, out, in, count, t, op, NULL), nbytes * (size_t)n);
        VERIFY(s, t, out, count, reduce_ref(t, op, n, k, (size_t)me * count + i));
        free(in);
        free(out);
        break;
    }
    case K_ALL_TO_ALL: {
        void *in = xmalloc(s, nbytes * (size_t)n), *out = xmalloc(s, nbytes * (size_t)n);
        fill(t, in, me, k, 0, count * (size_t)n);
        ok(s, ps_all_to_all(s->comm, out, in, count, t, NULL), nbytes * (size_t)n);
        /* Block j comes from rank j's block `me`. */
        VERIFY(s, t, out, count * (size_t)n,
               (double)val((int)(i / count), k, (size_t)me * count + i % count));
        free(in);
        free(out);
        break;
    }
    case K_RING: {
        void *in = xmalloc(s, nbytes), *out = xmalloc(s, nbytes);
        fill(t, in, me, k, 0, count);
        int next = (me + 1) % n, prev = (me + n - 1) % n, source = -2;
        ps_work_t *w = NULL;
        ok(s, ps_isend(s->comm, in, count, t, next, (int)(k & 0x7fffffff), NULL, &w), 0);
        ok(s, ps_recv(s->comm, out, count, t, prev, (int)(k & 0x7fffffff), NULL, &source), nbytes);
        ok(s, ps_work_wait(w), nbytes);
        ps_work_free(w);
        if (source != prev)
            die(s, "recv from %d reports source %d", prev, source);
        VERIFY(s, t, out, count, (double)val(prev, k, i));
        free(in);
        free(out);
        break;
    }
    case K_ANY_RECV: {
        void *buf = xmalloc(s, nbytes);
        if (me == 0) {
            int seen[SOAK_MAX_RANKS] = {0};
            for (int j = 1; j < n; j++) {
                int source = -2;
                ok(s, ps_recv(s->comm, buf, count, t, PS_ANY_SOURCE, 7, NULL, &source), nbytes);
                if (source < 1 || source >= n || seen[source]++)
                    die(s, "recv from any: source %d unexpected", source);
                VERIFY(s, t, buf, count, (double)val(source, k, i));
            }
        } else {
            fill(t, buf, me, k, 0, count);
            ok(s, ps_send(s->comm, buf, count, t, 0, 7, NULL), nbytes);
        }
        free(buf);
        break;
    }
    case K_BATCH: {
        void *buf[3];
        ps_work_t *w[3];
        for (int b = 0; b < 3; b++) {
            buf[b] = xmalloc(s, nbytes);
            fill(t, buf[b], me, k + (uint64_t)b, 0, count);
            ok(s, ps_iall_reduce(s->comm, buf[b], count, t, op, NULL, &w[b]), 0);
        }
        for (int b = 2; b >= 0; b--) { /* waited for out of order on purpose */
            ok(s, ps_work_wait(w[b]), nbytes);
            ps_work_free(w[b]);
            VERIFY(s, t, buf[b], count, reduce_ref(t, op, n, k + (uint64_t)b, i));
            free(buf[b]);
        }
        break;
    }
    case K_BARRIER:
        ok(s, ps_barrier(s->comm, NULL), 0);
        break;
    case K_GROUP: {
        /* Even ranks in groups[0], odd ones in groups[1]: two collectives at once. */
        ps_group_t *g = groups[me % 2];
        int gn = ps_get_world_size(s->comm, g), gr = ps_get_rank(s->comm, g);
        void *buf = xmalloc(s, nbytes);
        fill(t, buf, gr, k, 0, count);
        ok(s, ps_all_reduce(s->comm, buf, count, t, op, g), nbytes);
        VERIFY(s, t, buf, count, reduce_ref(t, op, gn, k, i));
        free(buf);
        break;
    }
    case K_COUNT:
        abort();
    }
}

static long arg_long(const char *name, const char *v, long min, long max)
{
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || *end || end == v || x < min || x > max) {
        fprintf(stderr, "soak_worker: %s must be %ld to %ld, not '%s'\n", name, min, max, v);
        exit(2);
    }
    return x;
}

int main(int argc, char **argv)
{
    if (argc != 7) {
        fprintf(stderr, "usage: soak_worker ADDR JOB RANK WORLD SECONDS SEED\n"
                        "Runs mixed collectives for SECONDS with the other ranks of JOB at the\n"
                        "agent ADDR, verifying every result; exits 0 after printing a summary.\n");
        return 2;
    }
    soak_t s = {0};
    char init[512];
    snprintf(init, sizeof(init), "tcp://%s", argv[1]);
    s.job = argv[2];
    s.rank = (int)arg_long("RANK", argv[3], 0, SOAK_MAX_RANKS - 1);
    s.world = (int)arg_long("WORLD", argv[4], 2, SOAK_MAX_RANKS);
    double seconds = (double)arg_long("SECONDS", argv[5], 1, 7 * 24 * 3600);
    uint64_t seed = (uint64_t)arg_long("SEED", argv[6], 0, 0x7fffffff);
    if (s.world % 2)
        die(&s, "WORLD must be even (the sub-groups are the even and the odd ranks)");

    /* Every rank of the job draws the same sequence. */
    rng_t rng = {seed};
    for (const char *p = s.job; *p; p++)
        rng.s = rng.s * 131 + (unsigned char)*p;

    ps_init_options_t opts;
    ps_init_options_default(&opts);
    opts.init_method = init;
    opts.job = s.job;
    opts.world_size = s.world;
    opts.rank = s.rank;
    /* A collective that takes this long has hung: fail, do not wait 30 min. */
    opts.timeout_ms = 120000;
    opts.join_timeout_ms = 60000;
    snprintf(s.what, sizeof(s.what), "init");
    ok(&s, ps_init(&opts, &s.comm), 0);
    s.ncoll = 0;

    ps_group_t *groups[2];
    int even[SOAK_MAX_RANKS / 2], odd[SOAK_MAX_RANKS / 2];
    for (int i = 0; i < s.world / 2; i++) {
        even[i] = 2 * i;
        odd[i] = 2 * i + 1;
    }
    snprintf(s.what, sizeof(s.what), "new_group");
    ok(&s, ps_new_group(s.comm, even, s.world / 2, &groups[0]), 0);
    ok(&s, ps_new_group(s.comm, odd, s.world / 2, &groups[1]), 0);

    double start = now_s(), deadline = start + seconds;
    for (s.iter = 0;; s.iter++) {
        run_one(&s, &rng, groups);
        int32_t stop = now_s() >= deadline;
        snprintf(s.what, sizeof(s.what), "stop flag");
        ok(&s, ps_all_reduce(s.comm, &stop, 1, PS_INT32, PS_MAX, NULL), 4);
        if (stop != 0 && stop != 1)
            die(&s, "stop flag reduced to %d", (int)stop);
        if (stop)
            break;
    }
    double took = now_s() - start;
    snprintf(s.what, sizeof(s.what), "finalize");
    int rc = ps_finalize(s.comm);
    if (rc != 0)
        die(&s, "ps_finalize returned %d (%s)", rc, ps_strerror(rc));
    printf("soak_worker: job %s rank %d: %" PRIu64 " iterations, %" PRIu64
           " collectives, %.1f MiB in %.1f s, all verified\n",
           s.job, s.rank, s.iter + 1, s.ncoll, (double)s.bytes / (1 << 20), took);
    return 0;
}
