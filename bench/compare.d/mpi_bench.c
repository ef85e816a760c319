/*
 * mpi-bench: the Open MPI baseline of bench/compare. The same sizes, rounding,
 * timing (the slowest rank's mean per call; its median in the CSV), check (after the timed calls,
 * on freshly filled buffers) and CSV columns as paramsync-bench, for float32 and sum. Built by
 * bench/compare with mpicc; run with mpirun.
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../a2av.h"
#include "../huge.h"

enum {
    C_ALL_REDUCE,
    C_BROADCAST,
    C_REDUCE,
    C_ALL_GATHER,
    C_GATHER,
    C_SCATTER,
    C_REDUCE_SCATTER,
    C_ALL_TO_ALL,
    C_ALL_TO_ALL_V,
    C_BARRIER,
    C_COUNT
};

static const char *const names[C_COUNT] = {
    "all_reduce", "broadcast",      "reduce",     "all_gather",   "gather",
    "scatter",    "reduce_scatter", "all_to_all", "all_to_all_v", "barrier"};

#define PERIOD 13

static int rank, p;

static float gen(int r, size_t i)
{
    return (float)(((unsigned)r * 5u + (unsigned)(i % PERIOD) * 3u) % PERIOD + 1);
}

static void fill(float *b, size_t n, int r, size_t start)
{
    for (size_t j = 0; j < n; j++)
        b[j] = gen(r, start + j);
}

static long long wrong_vs(const float *b, size_t n, int r, size_t start)
{
    long long w = 0;
    for (size_t j = 0; j < n; j++)
        w += b[j] != gen(r, start + j);
    return w;
}

static long long wrong_sum(const float *b, size_t n, size_t start)
{
    float t[PERIOD];
    for (int k = 0; k < PERIOD; k++) {
        float s = 0;
        for (int r = 0; r < p; r++)
            s += gen(r, start + (size_t)k);
        t[k] = s;
    }
    long long w = 0;
    for (size_t j = 0; j < n; j++)
        w += b[j] != t[j % PERIOD];
    return w;
}

static int blocked(int c)
{
    return c == C_ALL_GATHER || c == C_GATHER || c == C_SCATTER || c == C_REDUCE_SCATTER ||
           c == C_ALL_TO_ALL;
}

static double factor(int c)
{
    if (c == C_ALL_REDUCE)
        return 2.0 * (p - 1) / p;
    if (c == C_BROADCAST || c == C_REDUCE)
        return 1.0;
    if (c == C_BARRIER)
        return 0.0;
    return (double)(p - 1) / p;
}

static float *in, *out;
/* all_to_all_v's counts and displacements (../a2av.h), alike both ways. */
static int *a2av_cnt, *a2av_at;

static void run(int c, size_t n)
{
    int cnt = (int)n;
    switch (c) {
    case C_ALL_REDUCE:
        MPI_Allreduce(MPI_IN_PLACE, out, cnt, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        break;
    case C_BROADCAST:
        MPI_Bcast(out, cnt, MPI_FLOAT, 0, MPI_COMM_WORLD);
        break;
    case C_REDUCE:
        /* torch and paramsync reduce in place on the root */
        MPI_Reduce(rank == 0 ? MPI_IN_PLACE : out, rank == 0 ? out : NULL, cnt, MPI_FLOAT, MPI_SUM,
                   0, MPI_COMM_WORLD);
        break;
    case C_ALL_GATHER:
        MPI_Allgather(in, cnt, MPI_FLOAT, out, cnt, MPI_FLOAT, MPI_COMM_WORLD);
        break;
    case C_GATHER:
        MPI_Gather(in, cnt, MPI_FLOAT, out, cnt, MPI_FLOAT, 0, MPI_COMM_WORLD);
        break;
    case C_SCATTER:
        MPI_Scatter(in, cnt, MPI_FLOAT, out, cnt, MPI_FLOAT, 0, MPI_COMM_WORLD);
        break;
    case C_REDUCE_SCATTER:
        MPI_Reduce_scatter_block(in, out, cnt, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        break;
    case C_ALL_TO_ALL:
        MPI_Alltoall(in, cnt, MPI_FLOAT, out, cnt, MPI_FLOAT, MPI_COMM_WORLD);
        break;
    case C_ALL_TO_ALL_V:
        for (int j = 0, at = 0; j < p; at += a2av_cnt[j], j++) {
            a2av_cnt[j] = (int)ps_bench_a2av_count(rank, j, p, n);
            a2av_at[j] = at;
        }
        MPI_Alltoallv(in, a2av_cnt, a2av_at, MPI_FLOAT, out, a2av_cnt, a2av_at, MPI_FLOAT,
                      MPI_COMM_WORLD);
        break;
    default:
        MPI_Barrier(MPI_COMM_WORLD);
    }
}

static void prepare(int c, size_t n)
{
    switch (c) {
    case C_ALL_REDUCE:
    case C_REDUCE:
    case C_BROADCAST:
        fill(out, n, rank, 0);
        break;
    case C_ALL_GATHER:
    case C_GATHER:
        fill(in, n, rank, 0);
        break;
    case C_SCATTER:
        if (rank == 0)
            for (int r = 0; r < p; r++)
                fill(in + (size_t)r * n, n, r, 0);
        break;
    case C_REDUCE_SCATTER:
    case C_ALL_TO_ALL:
        fill(in, n * (size_t)p, rank, 0);
        break;
    case C_ALL_TO_ALL_V:
        fill(in, n * ps_bench_a2av_units(p), rank, 0);
        break;
    }
}

static long long verify(int c, size_t n)
{
    long long w = 0;
    switch (c) {
    case C_ALL_REDUCE:
        return wrong_sum(out, n, 0);
    case C_REDUCE:
        return rank == 0 ? wrong_sum(out, n, 0) : wrong_vs(out, n, rank, 0);
    case C_BROADCAST:
        return wrong_vs(out, n, 0, 0);
    case C_ALL_GATHER:
    case C_GATHER:
        if (c == C_GATHER && rank != 0)
            return 0;
        for (int r = 0; r < p; r++)
            w += wrong_vs(out + (size_t)r * n, n, r, 0);
        return w;
    case C_SCATTER:
        return wrong_vs(out, n, rank, 0);
    case C_REDUCE_SCATTER:
        return wrong_sum(out, n, (size_t)rank * n);
    case C_ALL_TO_ALL:
        for (int j = 0; j < p; j++)
            w += wrong_vs(out + (size_t)j * n, n, j, (size_t)rank * n);
        return w;
    case C_ALL_TO_ALL_V: {
        /* out block j = rank j's block `rank`, from where it lies in rank j's input */
        size_t at = 0;
        for (int j = 0; j < p; j++) {
            size_t k = ps_bench_a2av_count(j, rank, p, n);
            w += wrong_vs(out + at, k, j, ps_bench_a2av_at(j, rank, p, n));
            at += k;
        }
        return w;
    }
    }
    return 0;
}

static size_t parse_size(const char *s)
{
    char *end;
    double v = strtod(s, &end);
    if (*end == 'K' || *end == 'k')
        v *= 1024;
    else if (*end == 'M' || *end == 'm')
        v *= 1024 * 1024;
    else if (*end == 'G' || *end == 'g')
        v *= 1024.0 * 1024 * 1024;
    return (size_t)v;
}

int main(int argc, char **argv)
{
    size_t minb = 4, maxb = (size_t)256 << 20, iter_bytes = 0;
    double f = 2;
    int warmup = 5, iters = 20, want[C_COUNT];
    const char *csv = NULL, *label = "openmpi", *mem = "malloc";
    for (int c = 0; c < C_COUNT; c++)
        want[c] = 1;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &p);
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *a = argv[i], *v = argv[i + 1];
        if (!strcmp(a, "-b"))
            minb = parse_size(v);
        else if (!strcmp(a, "-e"))
            maxb = parse_size(v);
        else if (!strcmp(a, "-f"))
            f = atof(v);
        else if (!strcmp(a, "-w"))
            warmup = atoi(v);
        else if (!strcmp(a, "-n"))
            iters = atoi(v);
        else if (!strcmp(a, "-B"))
            iter_bytes = parse_size(v);
        else if (!strcmp(a, "--csv"))
            csv = v;
        else if (!strcmp(a, "--label"))
            label = v;
        else if (!strcmp(a, "-m") && (!strcmp(v, "malloc") || !strcmp(v, "huge")))
            mem = v; /* huge: as paramsync-bench --mem huge */
        else if (!strcmp(a, "-t")) {
            /* whole comma-separated names: "all_reduce" contains "reduce" */
            char list[512];
            snprintf(list, sizeof list, ",%s,", v);
            for (int c = 0; c < C_COUNT; c++) {
                char pat[64];
                snprintf(pat, sizeof pat, ",%s,", names[c]);
                want[c] = strcmp(v, "all") == 0 || strstr(list, pat) != NULL;
            }
        } else {
            if (rank == 0)
                fprintf(stderr, "mpi-bench: unknown option %s\n", a);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
    }
    size_t cap = (maxb > ps_bench_a2av_units(p) * 4 ? maxb : ps_bench_a2av_units(p) * 4) + 4;
    a2av_cnt = calloc((size_t)p, sizeof *a2av_cnt);
    a2av_at = calloc((size_t)p, sizeof *a2av_at);
    int advised = 1;
    in = strcmp(mem, "huge") ? calloc(1, cap) : ps_bench_huge_alloc(cap, &advised);
    out = strcmp(mem, "huge") ? calloc(1, cap) : ps_bench_huge_alloc(cap, &advised);
    if (!advised && rank == 0)
        fprintf(stderr, "mpi-bench: -m huge: madvise(MADV_HUGEPAGE) refused\n");
    FILE *fcsv = NULL;
    if (rank == 0 && csv)
        fcsv = strcmp(csv, "-") == 0 ? stdout : fopen(csv, "a");
    if (rank == 0)
        printf("# mpi-bench (%s): world %d, float32 sum, warmup %d, iters %d\n", label, p, warmup,
               iters);
    long long total_wrong = 0;
    for (int c = 0; c < C_COUNT; c++) {
        if (!want[c])
            continue;
        double last = -1;
        for (double nominal = (double)minb; nominal <= (double)maxb * 1.0000001; nominal *= f) {
            size_t bytes = (size_t)nominal, n, size;
            if (c == C_BARRIER) {
                n = size = 0;
            } else if (blocked(c)) {
                n = bytes / (4 * (size_t)p);
                n = n ? n : 1;
                size = n * (size_t)p * 4;
            } else if (c == C_ALL_TO_ALL_V) {
                n = bytes / (4 * ps_bench_a2av_units(p));
                n = n ? n : 1;
                size = n * ps_bench_a2av_units(p) * 4;
            } else {
                n = bytes / 4;
                n = n ? n : 1;
                size = n * 4;
            }
            if ((double)size == last)
                continue;
            last = (double)size;
            int w = warmup, it = iters;
            if (iter_bytes && size) {
                size_t capn = iter_bytes / size ? iter_bytes / size : 1;
                w = (size_t)w < capn ? w : (int)capn;
                it = (size_t)it < capn ? it : (int)capn;
            }
            if (c != C_ALL_REDUCE && c != C_REDUCE && c != C_REDUCE_SCATTER)
                prepare(c, n);
            MPI_Barrier(MPI_COMM_WORLD);
            for (int i = 0; i < w; i++)
                run(c, n);
            MPI_Barrier(MPI_COMM_WORLD);
            double t0 = MPI_Wtime();
            for (int i = 0; i < it; i++)
                run(c, n);
            double t = (MPI_Wtime() - t0) / it;
            MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
            long long wrong = -1;
            if (c != C_BARRIER) {
                prepare(c, n);
                run(c, n);
                wrong = verify(c, n);
                MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
                total_wrong += wrong;
            }
            if (rank == 0) {
                double algbw = size ? (double)size / t / 1e9 : 0, busbw = algbw * factor(c);
                int root =
                    (c == C_BROADCAST || c == C_REDUCE || c == C_GATHER || c == C_SCATTER) ? 0 : -1;
                const char *redop =
                    (c == C_ALL_REDUCE || c == C_REDUCE || c == C_REDUCE_SCATTER) ? "sum" : "none";
                printf(" %15s %12zu %11zu %9s %5s %5d %11.2f %11.3f %11.3f %8lld\n", names[c], size,
                       size / 4, c == C_BARRIER ? "none" : "float32", redop, root, t * 1e6, algbw,
                       busbw, wrong);
                fflush(stdout);
                if (fcsv) {
                    fprintf(fcsv, "%s,%s,%d,%zu,%zu,%s,%s,%d,%.3f,%.6f,%.6f,%lld,%d\n", label,
                            names[c], p, size, size / 4, c == C_BARRIER ? "none" : "float32", redop,
                            root, t * 1e6, algbw, busbw, wrong, it);
                    fflush(fcsv);
                }
            }
            if (c == C_BARRIER)
                break;
        }
    }
    if (rank == 0) {
        printf("# %s: %lld wrong elements in all\n", total_wrong ? "FAILED" : "OK", total_wrong);
        if (fcsv && fcsv != stdout)
            fclose(fcsv);
    }
    free(in);
    free(out);
    free(a2av_cnt);
    free(a2av_at);
    MPI_Finalize();
    return total_wrong ? 3 : 0;
}
