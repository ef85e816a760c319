/* The C worker of the cross-language test (xlang.py): one rank of a job whose
 * other ranks are Python and Node.js workers running the same steps
 * (xlang_worker.py, xlang_worker.js). Joins from the environment (env://:
 * PARAMSYNC_ADDR, PARAMSYNC_JOB, WORLD_SIZE = 3, RANK), checks every result
 * exactly, prints one line per step and exits 1 on the first mismatch.
 * XLANG_PEER=1: only peer_steps; XLANG_PEER=2: only mem_steps. */
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <paramsync/paramsync.h>

static int rank;

static void check_rc(int rc, const char *what)
{
    if (rc != 0) {
        fprintf(stderr, "C rank %d: %s failed: %s\n", rank, what, ps_strerror(rc));
        exit(1);
    }
}

static void expect(bool ok, const char *what)
{
    if (!ok) {
        fprintf(stderr, "C rank %d: %s: wrong result\n", rank, what);
        exit(1);
    }
    printf("C rank %d: %s ok\n", rank, what);
}

#define EQ(a, b, n) (memcmp((a), (b), sizeof((a)[0]) * (n)) == 0)

/* XLANG_PEER=1: an all_to_all, an all_gather, a gather and a scatter of 8 MiB
 * of blocks, and an uneven all_to_all, which the C, Python and Node.js ranks
 * of one agent take by peer copies together. */
enum { PEER_B = 700001 };

/* An all_to_all of 3 blocks of PEER_B int32 from in into out, checked. */
static void all_to_all_step(ps_comm_t *comm, int r, int32_t *in, int32_t *out, const char *what)
{
    for (size_t k = 0; k < 3 * (size_t)PEER_B; k++)
        in[k] = 1000 * r + 10 * (int32_t)(k / PEER_B) + (int32_t)(k % PEER_B % 7);
    check_rc(ps_all_to_all(comm, out, in, PEER_B, PS_INT32, NULL), "all_to_all");
    bool ok = true;
    for (size_t k = 0; k < 3 * (size_t)PEER_B; k++)
        ok = ok && out[k] == 1000 * (int32_t)(k / PEER_B) + 10 * r + (int32_t)(k % PEER_B % 7);
    expect(ok, what);
}

/* An all_to_all with counts per pair (ps_all_to_all_v, all_to_all_single's
 * split sizes): rank s sends rank d uneven_sent(s, d) int32 (none where s + d
 * is 1 more than a multiple of 3), each naming both; the ranks read each
 * pair's own bytes from each other, whatever their language. */
static size_t uneven_sent(int s, int d)
{
    return (s + d) % 3 == 1 ? 0 : (size_t)(s + 2 * d + 1) * 200003;
}

static int32_t uneven_value(int s, int d, size_t k)
{
    return (10 * s + d) * 10000000 + (int32_t)k;
}

static void uneven_step(ps_comm_t *comm, int r)
{
    size_t in_counts[3], out_counts[3], in_all = 0, out_all = 0;
    for (int j = 0; j < 3; j++) {
        in_all += in_counts[j] = uneven_sent(r, j);
        out_all += out_counts[j] = uneven_sent(j, r);
    }
    int32_t *in = malloc(in_all * sizeof(*in)), *out = malloc(out_all * sizeof(*out));
    if (!in || !out)
        exit(1);
    size_t at = 0;
    for (int j = 0; j < 3; j++)
        for (size_t k = 0; k < in_counts[j]; k++)
            in[at++] = uneven_value(r, j, k);
    check_rc(ps_all_to_all_v(comm, out, out_counts, in, in_counts, PS_INT32, NULL), "all_to_all_v");
    bool ok = true;
    at = 0;
    for (int j = 0; j < 3; j++)
        for (size_t k = 0; k < out_counts[j]; k++)
            ok = ok && out[at++] == uneven_value(j, r, k);
    expect(ok, "uneven all_to_all int32");
    free(in);
    free(out);
}

static void peer_steps(ps_comm_t *comm, int r)
{
    int32_t *in = malloc(3 * PEER_B * sizeof(*in)), *out = malloc(3 * PEER_B * sizeof(*out));
    float *fin = malloc(PEER_B * sizeof(*fin)), *fout = malloc(3 * PEER_B * sizeof(*fout));
    if (!in || !out || !fin || !fout)
        exit(1);
    all_to_all_step(comm, r, in, out, "all_to_all int32 of 8 MiB");
    for (size_t k = 0; k < PEER_B; k++)
        fin[k] = (float)r + (float)(k % 3) * 0.5f;
    check_rc(ps_all_gather(comm, fout, fin, PEER_B, PS_FLOAT32, NULL), "all_gather");
    bool ok = true;
    for (size_t k = 0; k < 3 * (size_t)PEER_B; k++)
        ok = ok && fout[k] == (float)(k / PEER_B) + (float)(k % PEER_B % 3) * 0.5f;
    expect(ok, "all_gather float32 of 8 MiB");
    /* gather to rank 1 and scatter from rank 2: the roots' blocks in rank order. */
    for (size_t k = 0; k < PEER_B; k++)
        in[k] = 7 * r + (int32_t)(k % 5);
    check_rc(ps_gather(comm, r == 1 ? out : NULL, in, PEER_B, PS_INT32, 1, NULL), "gather");
    ok = true;
    for (size_t k = 0; r == 1 && k < 3 * (size_t)PEER_B; k++)
        ok = ok && out[k] == 7 * (int32_t)(k / PEER_B) + (int32_t)(k % PEER_B % 5);
    expect(ok, "gather int32 of 8 MiB");
    for (size_t k = 0; k < 3 * (size_t)PEER_B; k++)
        in[k] = 9 * (int32_t)(k / PEER_B) + (int32_t)(k % PEER_B % 3);
    check_rc(ps_scatter(comm, out, r == 2 ? in : NULL, PEER_B, PS_INT32, 2, NULL), "scatter");
    ok = true;
    for (size_t k = 0; k < PEER_B; k++)
        ok = ok && out[k] == 9 * r + (int32_t)(k % 3);
    expect(ok, "scatter int32 of 8 MiB");
    uneven_step(comm, r);
    free(in);
    free(out);
    free(fin);
    free(fout);
}

/* How many mappings of other processes' paramsync segments this one has
 * (their names carry their pids: /dev/shm/paramsync.PID...). */
static int others_segments_mapped(void)
{
    FILE *f = fopen("/proc/self/maps", "r");
    char line[1024], mine[64];
    int n = 0;
    snprintf(mine, sizeof(mine), "/paramsync.%d.", (int)getpid());
    while (f && fgets(line, sizeof(line), f))
        n += strstr(line, "/paramsync.") && !strstr(line, mine);
    if (f)
        fclose(f);
    return n;
}

/* XLANG_PEER=2: an all_to_all of 8 MiB of blocks from ps_mem_alloc memory
 * (input and output in one allocation), over the agent's
 * --shm-resident-bytes (the driver makes it small), so by peer copies; the
 * other ranks' segments, whatever their language, read through mappings
 * this rank keeps (XLANG_MAPS of them, from the driver). */
static void mem_steps(ps_comm_t *comm, int r)
{
    int32_t *mem = ps_mem_alloc(comm, 6 * (size_t)PEER_B * sizeof(*mem));
    if (!mem)
        exit(1);
    expect(ps_mem_is_shared(comm, mem), "ps_mem_alloc memory shared with the agent");
    int32_t *in = mem, *out = mem + 3 * PEER_B;
    all_to_all_step(comm, r, in, out, "all_to_all int32 of 8 MiB from ps_mem_alloc memory");
    const char *want = getenv("XLANG_MAPS");
    int mapped = others_segments_mapped();
    if (!want || mapped != atoi(want)) {
        fprintf(stderr, "C rank %d: maps %d of the others' segments, want %s\n", rank, mapped,
                want ? want : "(XLANG_MAPS unset)");
        exit(1);
    }
    printf("C rank %d: %d of the others' segments mapped ok\n", rank, mapped);
    check_rc(ps_barrier(comm, NULL), "barrier");
    check_rc(ps_mem_free(comm, mem), "mem_free");
}

/* XLANG_PEER=3: barriers that C and Python ranks on one agent meet on the page
 * they share (client/barrier.c, paramsync/_barrier.py): each rank in turn
 * comes last to one, and no rank leaves it before that rank arrived (stamps
 * on CLOCK_MONOTONIC, Python's time.monotonic, gathered); then 200 more;
 * then rank 2 calls an all_reduce where the others call a barrier. */
static void barrier_steps(ps_comm_t *comm, int r)
{
    for (int i = 0; i < 3; i++)
        check_rc(ps_barrier(comm, NULL), "barrier");
    bool fine = true;
    for (int late = 0; late < 3; late++) {
        if (r == late)
            usleep(100 * 1000);
        struct timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        double mine = (double)t.tv_sec + (double)t.tv_nsec / 1e9, arrived[3];
        check_rc(ps_barrier(comm, NULL), "barrier");
        clock_gettime(CLOCK_MONOTONIC, &t);
        double left = (double)t.tv_sec + (double)t.tv_nsec / 1e9;
        check_rc(ps_all_gather(comm, arrived, &mine, 1, PS_FLOAT64, NULL), "all_gather");
        fine = fine && left >= arrived[late];
    }
    expect(fine, "barriers wait for the last rank");
    for (int i = 0; i < 200; i++)
        check_rc(ps_barrier(comm, NULL), "barrier");
    expect(true, "200 barriers");
    /* Rank 2 calls an all_reduce where the others call a barrier: every rank
     * is told at once (the waiters see its number on the page), in step after. */
    if (r != 2)
        usleep(100 * 1000);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    float x = 1;
    int rc = r == 2 ? ps_all_reduce(comm, &x, 1, PS_FLOAT32, PS_SUM, NULL) : ps_barrier(comm, NULL);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double took = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    if (rc != PS_EPRECOND || took >= 1.0)
        fprintf(stderr, "C rank %d: against the other calls: %s after %.3f s\n", rank,
                ps_strerror(rc), took);
    expect(rc == PS_EPRECOND && took < 1.0, "a barrier against an all_reduce fails at once");
    check_rc(ps_barrier(comm, NULL), "barrier");
}

int main(void)
{
    ps_comm_t *comm = NULL;
    ps_init_options_t opts;
    ps_init_options_default(&opts);
    check_rc(ps_init(&opts, &comm), "init");
    rank = ps_get_rank(comm, NULL);
    int n = ps_get_world_size(comm, NULL);
    if (n != 3) {
        fprintf(stderr, "C rank %d: world size %d, expected 3\n", rank, n);
        return 1;
    }
    int r = rank;
    const char *peer = getenv("XLANG_PEER");
    int steps = peer ? atoi(peer) : 0;
    if (steps >= 1 && steps <= 3) {
        (steps == 1 ? peer_steps : steps == 2 ? mem_steps : barrier_steps)(comm, r);
        check_rc(ps_finalize(comm), "finalize");
        return 0;
    }

    float f[3] = {(float)r + 1, ((float)r + 1) * 0.5f, (float)-r};
    check_rc(ps_all_reduce(comm, f, 3, PS_FLOAT32, PS_SUM, NULL), "all_reduce float32 SUM");
    expect(EQ(f, ((float[]){6, 3, -3}), 3), "all_reduce float32 SUM");

    int64_t l[2] = {r + 2, -(r + 1)};
    check_rc(ps_all_reduce(comm, l, 2, PS_INT64, PS_PRODUCT, NULL), "all_reduce int64 PRODUCT");
    expect(EQ(l, ((int64_t[]){24, -6}), 2), "all_reduce int64 PRODUCT");

    int32_t i[2] = {r * 10, -r};
    check_rc(ps_all_reduce(comm, i, 2, PS_INT32, PS_MAX, NULL), "all_reduce int32 MAX");
    expect(EQ(i, ((int32_t[]){20, 0}), 2), "all_reduce int32 MAX");
    int32_t j[2] = {r * 10, -r};
    check_rc(ps_all_reduce(comm, j, 2, PS_INT32, PS_MIN, NULL), "all_reduce int32 MIN");
    expect(EQ(j, ((int32_t[]){0, -2}), 2), "all_reduce int32 MIN");

    uint8_t u[2] = {(uint8_t)(1u << r), 255};
    check_rc(ps_all_reduce(comm, u, 2, PS_UINT8, PS_BXOR, NULL), "all_reduce uint8 BXOR");
    expect(EQ(u, ((uint8_t[]){7, 255}), 2), "all_reduce uint8 BXOR");

    int16_t s[1] = {(int16_t)(255 - r)};
    check_rc(ps_all_reduce(comm, s, 1, PS_INT16, PS_BAND, NULL), "all_reduce int16 BAND");
    expect(s[0] == 252, "all_reduce int16 BAND");

    double d[2] = {3.0 * r, 1};
    check_rc(ps_all_reduce(comm, d, 2, PS_FLOAT64, PS_AVG, NULL), "all_reduce float64 AVG");
    expect(EQ(d, ((double[]){3, 1}), 2), "all_reduce float64 AVG");

    uint8_t b[2] = {r == 2, 0};
    check_rc(ps_all_reduce(comm, b, 2, PS_BOOL, PS_BOR, NULL), "all_reduce bool BOR");
    expect(EQ(b, ((uint8_t[]){1, 0}), 2), "all_reduce bool BOR");

    /* 1 Mi float32 elements: several frames each way. */
    size_t big_n = 1u << 20;
    float *big = malloc(big_n * sizeof(*big));
    if (!big)
        return 1;
    for (size_t k = 0; k < big_n; k++)
        big[k] = (float)(r + 1) + (float)(k % 7);
    check_rc(ps_all_reduce(comm, big, big_n, PS_FLOAT32, PS_SUM, NULL), "all_reduce big");
    bool big_ok = true;
    for (size_t k = 0; k < big_n; k++)
        big_ok = big_ok && big[k] == 6.0f + 3.0f * (float)(k % 7);
    expect(big_ok, "all_reduce float32 SUM of 4 MiB");
    free(big);

    int32_t bc[2] = {r * 100, 7};
    check_rc(ps_broadcast(comm, bc, 2, PS_INT32, 1, NULL), "broadcast from 1");
    expect(EQ(bc, ((int32_t[]){100, 7}), 2), "broadcast int32 from rank 1");
    double bd[1] = {r + 0.5};
    check_rc(ps_broadcast(comm, bd, 1, PS_FLOAT64, 2, NULL), "broadcast from 2");
    expect(bd[0] == 2.5, "broadcast float64 from rank 2");

    float gin[2] = {(float)r, r + 0.25f}, gout[6];
    check_rc(ps_all_gather(comm, gout, gin, 2, PS_FLOAT32, NULL), "all_gather");
    expect(EQ(gout, ((float[]){0, 0.25f, 1, 1.25f, 2, 2.25f}), 6), "all_gather float32");

    for (int dst = 0; dst < 3; dst += 2) {
        int64_t in[1] = {(int64_t)r * r}, out[3] = {0};
        check_rc(ps_gather(comm, r == dst ? out : NULL, in, 1, PS_INT64, dst, NULL), "gather");
        if (r == dst)
            expect(EQ(out, ((int64_t[]){0, 1, 4}), 3), "gather int64");
    }

    for (int src = 2; src >= 0; src -= 2) {
        int32_t in[3] = {0, 11 + src, 22 + src}, out[1] = {-1};
        check_rc(ps_scatter(comm, out, r == src ? in : NULL, 1, PS_INT32, src, NULL), "scatter");
        expect(out[0] == r * 11 + (r ? src : 0), "scatter int32");
    }

    check_rc(ps_barrier(comm, NULL), "barrier");
    printf("C rank %d: barrier ok\n", r);
    check_rc(ps_finalize(comm), "finalize");
    return 0;
}
