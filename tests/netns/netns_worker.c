/*
 * netns-worker: one rank of the multi-host collective suite (tests/netns/suite.sh).
 *
 * Runs every collective of libparamsync, with several dtypes and ops, sizes
 * below and above the daemon's pipeline step, every root, point-to-point,
 * a subgroup and operations in flight together, and checks each result
 * exactly. Environment: RANK, WORLD_SIZE, PARAMSYNC_ADDR, PARAMSYNC_JOB.
 * Prints one line per failed check and a summary; exits 0 only if all held.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <paramsync/paramsync.h>

static int rank, p, failures, checks;

#define CALL(expr)                                                                                 \
    do {                                                                                           \
        int rc_ = (expr);                                                                          \
        if (rc_ < 0) {                                                                             \
            fprintf(stderr, "rank %d: %s failed: %s (%d)\n", rank, #expr, ps_strerror(rc_), rc_);  \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

/* Records one check over n elements; got/want are doubles of exactly representable values. */
static void expect(const char *what, size_t i, double got, double want)
{
    checks++;
    if (got != want && !(isnan(got) && isnan(want))) {
        if (failures++ < 20)
            fprintf(stderr, "rank %d: %s: element %zu is %.17g, want %.17g\n", rank, what, i, got,
                    want);
    }
}

/* Counts wrong elements, reporting the first one only, as one check. */
#define CHECK_ARRAY(what, n, got_expr, want_expr)                                                  \
    do {                                                                                           \
        size_t bad_ = 0, first_ = 0;                                                               \
        double g0_ = 0, w0_ = 0;                                                                   \
        for (size_t i = 0; i < (n); i++) {                                                         \
            double g_ = (double)(got_expr), w_ = (double)(want_expr);                              \
            if (g_ != w_) {                                                                        \
                if (!bad_++) {                                                                     \
                    first_ = i;                                                                    \
                    g0_ = g_;                                                                      \
                    w0_ = w_;                                                                      \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        checks++;                                                                                  \
        if (bad_) {                                                                                \
            failures++;                                                                            \
            fprintf(stderr,                                                                        \
                    "rank %d: %s: %zu of %zu elements wrong; first %zu is %.17g, want %.17g\n",    \
                    rank, what, bad_, (size_t)(n), first_, g0_, w0_);                              \
        }                                                                                          \
    } while (0)

static void *xmalloc(size_t n)
{
    void *b = malloc(n ? n : 1);
    if (!b) {
        fprintf(stderr, "rank %d: out of memory\n", rank);
        exit(1);
    }
    return b;
}

static void test_all_reduce(ps_comm_t *comm)
{
    static const size_t counts[] = {1, 1000, 300007}; /* the last spans two 1 MiB steps */
    for (size_t k = 0; k < sizeof counts / sizeof counts[0]; k++) {
        size_t n = counts[k];
        float *f = xmalloc(n * sizeof *f);
        for (size_t i = 0; i < n; i++)
            f[i] = (float)(rank + 1 + (int)(i % 7));
        CALL(ps_all_reduce(comm, f, n, PS_FLOAT32, PS_SUM, NULL));
        CHECK_ARRAY("all_reduce float32 sum", n, f[i], p * (p + 1) / 2 + p * (int)(i % 7));
        free(f);
    }
    size_t n = 4099;
    int64_t *l = xmalloc(n * sizeof *l);
    for (size_t i = 0; i < n; i++)
        l[i] = (int64_t)rank * 1000000007LL - (int64_t)i;
    CALL(ps_all_reduce(comm, l, n, PS_INT64, PS_MAX, NULL));
    CHECK_ARRAY("all_reduce int64 max", n, l[i], (int64_t)(p - 1) * 1000000007LL - (int64_t)i);
    free(l);

    int32_t *m = xmalloc(n * sizeof *m);
    for (size_t i = 0; i < n; i++)
        m[i] = (int32_t)((rank * 7919 + (int)i * 31) % 1000) - 500;
    CALL(ps_all_reduce(comm, m, n, PS_INT32, PS_MIN, NULL));
    for (size_t i = 0; i < n; i++) {
        int32_t want = INT32_MAX;
        for (int r = 0; r < p; r++) {
            int32_t v = (int32_t)((r * 7919 + (int)i * 31) % 1000) - 500;
            want = v < want ? v : want;
        }
        if (m[i] != want) {
            expect("all_reduce int32 min", i, m[i], want);
            break;
        }
    }
    checks++;
    free(m);

    uint8_t *x = xmalloc(n);
    for (size_t i = 0; i < n; i++)
        x[i] = (uint8_t)(rank * 37 + (int)i);
    CALL(ps_all_reduce(comm, x, n, PS_UINT8, PS_BXOR, NULL));
    for (size_t i = 0; i < n; i++) {
        uint8_t want = 0;
        for (int r = 0; r < p; r++)
            want ^= (uint8_t)(r * 37 + (int)i);
        if (x[i] != want) {
            expect("all_reduce uint8 bxor", i, x[i], want);
            break;
        }
    }
    checks++;
    free(x);

    /* int8 sum wraps as in torch */
    int8_t *w = xmalloc(n);
    for (size_t i = 0; i < n; i++)
        w[i] = (int8_t)(100 + (int)(i % 20));
    CALL(ps_all_reduce(comm, w, n, PS_INT8, PS_SUM, NULL));
    CHECK_ARRAY("all_reduce int8 sum (wraps)", n, w[i],
                (int8_t)(uint8_t)(p * (100 + (int)(i % 20))));
    free(w);

    double *d = xmalloc(n * sizeof *d);
    for (size_t i = 0; i < n; i++)
        d[i] = (double)(rank * 2);
    CALL(ps_all_reduce(comm, d, n, PS_FLOAT64, PS_AVG, NULL));
    CHECK_ARRAY("all_reduce float64 avg", n, fabs(d[i] - (double)(p - 1)) < 1e-12 ? 0 : d[i], 0);
    free(d);
}

static void test_broadcast(ps_comm_t *comm)
{
    for (int root = 0; root < p; root++) {
        size_t n = 1000 + (size_t)root;
        int32_t *b = xmalloc(n * sizeof *b);
        for (size_t i = 0; i < n; i++)
            b[i] = rank == root ? root * 100000 + (int32_t)i : -1;
        CALL(ps_broadcast(comm, b, n, PS_INT32, root, NULL));
        CHECK_ARRAY("broadcast int32", n, b[i], root * 100000 + (int32_t)i);
        free(b);
    }
    size_t n = (3u << 20) / 4 + 3; /* a bit over 3 MiB: several steps */
    float *f = xmalloc(n * sizeof *f);
    for (size_t i = 0; i < n; i++)
        f[i] = rank == p - 1 ? (float)(i % 4093) : -1.0f;
    CALL(ps_broadcast(comm, f, n, PS_FLOAT32, p - 1, NULL));
    CHECK_ARRAY("broadcast float32 3 MiB", n, f[i], (float)(i % 4093));
    free(f);
}

static void test_reduce(ps_comm_t *comm)
{
    size_t n = 5000;
    int dst = p - 1;
    int32_t *b = xmalloc(n * sizeof *b);
    for (size_t i = 0; i < n; i++)
        b[i] = rank * 3 + (int32_t)i;
    CALL(ps_reduce_to(comm, b, n, PS_INT32, PS_SUM, dst, NULL));
    if (rank == dst)
        CHECK_ARRAY("reduce int32 sum (dst)", n, b[i], 3 * p * (p - 1) / 2 + p * (int32_t)i);
    else
        CHECK_ARRAY("reduce int32 sum (non-dst unchanged)", n, b[i], rank * 3 + (int32_t)i);
    free(b);
}

static void test_gathers(ps_comm_t *comm)
{
    static const size_t counts[] = {777, 150001};
    for (size_t k = 0; k < 2; k++) {
        size_t n = counts[k];
        float *in = xmalloc(n * sizeof *in), *out = xmalloc(n * (size_t)p * sizeof *out);
        for (size_t i = 0; i < n; i++)
            in[i] = (float)(rank * 10000 + (int)(i % 9999));
        CALL(ps_all_gather(comm, out, in, n, PS_FLOAT32, NULL));
        CHECK_ARRAY("all_gather float32", n * (size_t)p, out[i],
                    (float)((int)(i / n) * 10000 + (int)((i % n) % 9999)));
        memset(out, 0, n * (size_t)p * sizeof *out);
        int dst = 1 % p;
        CALL(ps_gather(comm, rank == dst ? out : NULL, in, n, PS_FLOAT32, dst, NULL));
        if (rank == dst)
            CHECK_ARRAY("gather float32", n * (size_t)p, out[i],
                        (float)((int)(i / n) * 10000 + (int)((i % n) % 9999)));
        free(in);
        free(out);
    }

    size_t n = 1025;
    int src = p / 2;
    int64_t *sin = rank == src ? xmalloc(n * (size_t)p * sizeof *sin) : NULL;
    int64_t *sout = xmalloc(n * sizeof *sout);
    if (sin)
        for (size_t i = 0; i < n * (size_t)p; i++)
            sin[i] = (int64_t)i * 3 + 1;
    CALL(ps_scatter(comm, sout, sin, n, PS_INT64, src, NULL));
    CHECK_ARRAY("scatter int64", n, sout[i], ((int64_t)rank * (int64_t)n + (int64_t)i) * 3 + 1);
    free(sin);
    free(sout);
}

static void test_reduce_scatter_all_to_all(ps_comm_t *comm)
{
    size_t n = 333;
    int64_t *in = xmalloc(n * (size_t)p * sizeof *in), *out = xmalloc(n * sizeof *out);
    for (size_t i = 0; i < n * (size_t)p; i++)
        in[i] = (int64_t)rank * 100000 + (int64_t)i;
    CALL(ps_reduce_scatter(comm, out, in, n, PS_INT64, PS_SUM, NULL));
    CHECK_ARRAY("reduce_scatter int64 sum", n, out[i],
                100000LL * p * (p - 1) / 2 +
                    (int64_t)p * ((int64_t)rank * (int64_t)n + (int64_t)i));
    free(in);
    free(out);

    static const size_t counts[] = {257, 200003};
    for (size_t k = 0; k < 2; k++) {
        n = counts[k];
        int16_t *a = xmalloc(n * (size_t)p * sizeof *a), *b = xmalloc(n * (size_t)p * sizeof *b);
        /* block j of rank r goes to rank j: value r*1000 + j*10 + (i % 7) */
        for (int j = 0; j < p; j++)
            for (size_t i = 0; i < n; i++)
                a[(size_t)j * n + i] = (int16_t)(rank * 1000 + j * 10 + (int)(i % 7));
        CALL(ps_all_to_all(comm, b, a, n, PS_INT16, NULL));
        CHECK_ARRAY("all_to_all int16", n * (size_t)p, b[i],
                    (int16_t)((int)(i / n) * 1000 + rank * 10 + (int)((i % n) % 7)));
        free(a);
        free(b);
    }
}

static void test_send_recv(ps_comm_t *comm)
{
    if (p < 2)
        return;
    size_t n = 100000;
    float *s = xmalloc(n * sizeof *s), *r = xmalloc(n * sizeof *r);
    int to = (rank + 1) % p, from = (rank + p - 1) % p;
    for (size_t i = 0; i < n; i++)
        s[i] = (float)(rank * 7 + (int)(i % 100));
    ps_work_t *w;
    CALL(ps_isend(comm, s, n, PS_FLOAT32, to, 7, NULL, &w));
    int source = -1;
    CALL(ps_recv(comm, r, n, PS_FLOAT32, PS_ANY_SOURCE, 7, NULL, &source));
    CALL(ps_work_wait(w));
    ps_work_free(w);
    expect("recv source", 0, source, from);
    CHECK_ARRAY("send/recv ring float32", n, r[i], (float)(from * 7 + (int)(i % 100)));
    free(s);
    free(r);
}

static void test_group_and_async(ps_comm_t *comm)
{
    /* the even ranks, in reverse order: group rank g is job rank evens[g] */
    int evens[64], ne = 0;
    for (int r = (p - 1) / 2 * 2; r >= 0; r -= 2)
        evens[ne++] = r;
    ps_group_t *g;
    CALL(ps_new_group(comm, evens, ne, &g));
    if (rank % 2 == 0) {
        int grank = ps_get_rank(comm, g);
        expect("group rank", 0, grank, ne - 1 - rank / 2);
        expect("group size", 0, ps_get_world_size(comm, g), ne);
        int64_t v[3] = {rank, 1, grank};
        CALL(ps_all_reduce(comm, v, 3, PS_INT64, PS_SUM, g));
        int64_t want0 = 0;
        for (int k = 0; k < ne; k++)
            want0 += evens[k];
        expect("group all_reduce [0]", 0, (double)v[0], (double)want0);
        expect("group all_reduce [1]", 1, (double)v[1], ne);
        expect("group all_reduce [2]", 2, (double)v[2], ne * (ne - 1) / 2);
        int32_t b = grank == 0 ? 4242 : 0;
        CALL(ps_broadcast(comm, &b, 1, PS_INT32, 0, g));
        expect("group broadcast from group rank 0", 0, b, 4242);
    } else {
        expect("non-member group rank", 0, ps_get_rank(comm, g), -1);
    }

    /* two operations in flight at once, waited in the other order */
    size_t n = 70000;
    float *a = xmalloc(n * sizeof *a), *b = xmalloc(n * sizeof *b);
    for (size_t i = 0; i < n; i++) {
        a[i] = 1.0f;
        b[i] = (float)rank;
    }
    ps_work_t *wa, *wb;
    CALL(ps_iall_reduce(comm, a, n, PS_FLOAT32, PS_SUM, NULL, &wa));
    CALL(ps_iall_reduce(comm, b, n, PS_FLOAT32, PS_MAX, NULL, &wb));
    CALL(ps_work_wait(wb));
    CALL(ps_work_wait(wa));
    ps_work_free(wa);
    ps_work_free(wb);
    CHECK_ARRAY("async all_reduce sum", n, a[i], p);
    CHECK_ARRAY("async all_reduce max", n, b[i], p - 1);
    free(a);
    free(b);
}

int main(void)
{
    ps_comm_t *comm;
    int rc = ps_init(NULL, &comm);
    if (rc < 0) {
        fprintf(stderr, "netns-worker: ps_init: %s (%d)\n", ps_strerror(rc), rc);
        return 1;
    }
    rank = ps_get_rank(comm, NULL);
    p = ps_get_world_size(comm, NULL);
    const char *er = getenv("RANK"), *ew = getenv("WORLD_SIZE");
    if (er)
        expect("rank from RANK", 0, rank, atoi(er));
    if (ew)
        expect("world size from WORLD_SIZE", 0, p, atoi(ew));
    if (p > 64) {
        fprintf(stderr, "netns-worker: at most 64 ranks\n");
        return 1;
    }

    CALL(ps_barrier(comm, NULL));
    test_all_reduce(comm);
    test_broadcast(comm);
    test_reduce(comm);
    test_gathers(comm);
    test_reduce_scatter_all_to_all(comm);
    test_send_recv(comm);
    test_group_and_async(comm);
    CALL(ps_barrier(comm, NULL));

    rc = ps_finalize(comm);
    if (rc < 0) {
        fprintf(stderr, "rank %d: ps_finalize: %s\n", rank, ps_strerror(rc));
        failures++;
    }
    printf("rank %d of %d: %d checks, %d failed\n", rank, p, checks, failures);
    return failures ? 1 : 0;
}
