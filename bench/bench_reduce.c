/* paramsync-bench-reduce: GB/s of each (op, dtype, path) beside memcpy of the same buffers. */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include <paramsync/reduce.h>

#include "bench_args.h"

static const char usage[] =
    "usage: paramsync-bench-reduce [options]\n"
    "  --size-mib N     bytes per buffer, in MiB (default 64)\n"
    "  --reps N         timed runs per row; the best is reported (default 5)\n"
    "  --path LIST      comma-separated: scalar,avx2,avx512 (default: all supported)\n"
    "  --op LIST        comma-separated: SUM,PRODUCT,MIN,MAX,BAND,BOR,BXOR,AVG (default: all)\n"
    "  --dtype LIST     comma-separated: float32,...,bool (default: all)\n"
    "  --threads N      split every reduce and memcpy over N threads (default 1)\n"
    "  --no-flush       do not evict the caches before each timed run\n"
    "  --quick          1 MiB buffers, 1 run, no flush: a smoke run for CI\n"
    "  --help\n";

typedef struct options {
    size_t bytes;
    int reps;
    int threads;
    int flush;
    int want_path[PS_PATH_COUNT];
    int want_op[PS_OP_COUNT];
    int want_dtype[PS_DTYPE_COUNT];
} options_t;

/* Monotonic seconds; cannot fail on Linux. */
static double now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Returns 0, or -1 after printing why the arguments are wrong. */
static int parse_options(int argc, char **argv, options_t *o)
{
    o->bytes = (size_t)64 << 20;
    o->reps = 5;
    o->threads = 1;
    o->flush = 1;
    for (int i = 0; i < PS_PATH_COUNT; i++)
        o->want_path[i] = 1;
    for (int i = 0; i < PS_OP_COUNT; i++)
        o->want_op[i] = 1;
    for (int i = 0; i < PS_DTYPE_COUNT; i++)
        o->want_dtype[i] = 1;
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        const char *val = i + 1 < argc ? argv[i + 1] : NULL;
        int rc = 0;
        if (strcmp(arg, "--quick") == 0) {
            o->bytes = (size_t)1 << 20;
            o->reps = 1;
            o->flush = 0;
            continue;
        }
        if (strcmp(arg, "--no-flush") == 0) {
            o->flush = 0;
            continue;
        }
        if (strcmp(arg, "--help") == 0) {
            fputs(usage, stdout);
            exit(0);
        }
        if (val == NULL) {
            fprintf(stderr, "%s: missing value or unknown option\n%s", arg, usage);
            return -1;
        }
        i++;
        if (strcmp(arg, "--size-mib") == 0) {
            long mib = strtol(val, NULL, 10);
            if (mib <= 0 || mib > 4096)
                rc = -1;
            o->bytes = (size_t)mib << 20;
        } else if (strcmp(arg, "--reps") == 0) {
            o->reps = atoi(val);
            if (o->reps <= 0)
                rc = -1;
        } else if (strcmp(arg, "--threads") == 0) {
            o->threads = atoi(val);
            if (o->threads <= 0 || o->threads > 64)
                rc = -1;
        } else if (strcmp(arg, "--path") == 0) {
            rc = ps_bench_parse_list(val, o->want_path, PS_PATH_COUNT, ps_bench_path_name, "path");
        } else if (strcmp(arg, "--op") == 0) {
            rc = ps_bench_parse_list(val, o->want_op, PS_OP_COUNT, ps_bench_op_name, "op");
        } else if (strcmp(arg, "--dtype") == 0) {
            rc = ps_bench_parse_list(val, o->want_dtype, PS_DTYPE_COUNT, ps_bench_dtype_name,
                                     "dtype");
        } else {
            fprintf(stderr, "unknown option %s\n%s", arg, usage);
            return -1;
        }
        if (rc != 0) {
            fprintf(stderr, "bad value for %s: %s\n", arg, val);
            return -1;
        }
    }
    return 0;
}

/* ---- the timed work, split over threads when asked */

typedef struct work {
    int is_copy;
    ps_op_t op;
    ps_dtype_t dtype;
    unsigned char *dst;
    const unsigned char *src;
    size_t count; /* elements, or bytes for memcpy */
    int rc;
} work_t;

/* Thread body: one part of a timed run; a reduce error is left in w->rc. Returns NULL. */
static void *run_work(void *arg)
{
    work_t *w = arg;
    if (w->is_copy)
        memcpy(w->dst, w->src, w->count);
    else
        w->rc = ps_reduce(w->op, w->dtype, w->dst, w->src, w->count);
    return NULL;
}

/*
 * Runs one reduce (or memcpy when is_copy) over the whole buffer, split into
 * `threads` contiguous parts, and returns its wall time in seconds, thread
 * start-up included. Returns a negative time when a reduce failed.
 */
static double timed_run(int is_copy, ps_op_t op, ps_dtype_t dtype, unsigned char *dst,
                        const unsigned char *src, size_t bytes, int threads)
{
    enum { MAX_THREADS = 64 };
    work_t parts[MAX_THREADS];
    pthread_t tids[MAX_THREADS];
    size_t unit = is_copy ? 1 : ps_dtype_size(dtype);
    size_t total = bytes / unit, per = total / (size_t)threads;
    for (int t = 0; t < threads; t++) {
        size_t first = per * (size_t)t;
        size_t count = t == threads - 1 ? total - first : per;
        parts[t] = (work_t){is_copy, op, dtype, dst + first * unit, src + first * unit, count, 0};
    }
    double start = now_seconds();
    int started = 0;
    for (int t = 1; t < threads; t++, started++)
        if (pthread_create(&tids[t], NULL, run_work, &parts[t]) != 0)
            break;
    run_work(&parts[0]);
    /* A thread that could not start does its part here, late but correct. */
    for (int t = 1 + started; t < threads; t++)
        run_work(&parts[t]);
    for (int t = 1; t <= started; t++)
        pthread_join(tids[t], NULL);
    double elapsed = now_seconds() - start;
    for (int t = 0; t < threads; t++)
        if (parts[t].rc != 0)
            return -1.0;
    return elapsed;
}

/* Reads and writes a buffer larger than the last-level cache so that no timed run starts warm. */
static void flush_caches(unsigned char *scratch, size_t bytes)
{
    for (size_t i = 0; i < bytes; i += 64)
        scratch[i]++;
}

/*
 * Fills buf with values that stay ordinary through repeated SUM/PRODUCT
 * (floats in [1, 2)), so that no run slows down on subnormals or Inf.
 */
static void fill_values(ps_dtype_t dtype, unsigned char *buf, size_t bytes)
{
    uint64_t x = 0x243F6A8885A308D3ull;
    size_t size = ps_dtype_size(dtype);
    for (size_t i = 0; i + size <= bytes; i += size) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        uint32_t r = (uint32_t)(x >> 33);
        switch (dtype) {
        case PS_FLOAT32: {
            uint32_t v = 0x3F800000u | (r & 0x7FFFFFu);
            memcpy(buf + i, &v, 4);
            break;
        }
        case PS_FLOAT64: {
            uint64_t v = 0x3FF0000000000000ull | ((uint64_t)r << 20);
            memcpy(buf + i, &v, 8);
            break;
        }
        case PS_FLOAT16: {
            uint16_t v = (uint16_t)(0x3C00u | (r & 0x3FFu));
            memcpy(buf + i, &v, 2);
            break;
        }
        case PS_BFLOAT16: {
            uint16_t v = (uint16_t)(0x3F80u | (r & 0x7Fu));
            memcpy(buf + i, &v, 2);
            break;
        }
        default:
            memcpy(buf + i, &r, size);
            break;
        }
    }
}

typedef struct buffers {
    unsigned char *dst, *src, *pristine, *copy_dst, *scratch;
    size_t scratch_bytes;
} buffers_t;

/* Returns 0, or -1 when memory ran out (then frees what it took). */
static int buffers_alloc(buffers_t *b, size_t bytes, int flush)
{
    memset(b, 0, sizeof *b);
    /* Comfortably above any L3 a 2-core VM gets; a page when nothing is flushed. */
    b->scratch_bytes = flush ? (size_t)256 << 20 : 4096;
    b->dst = aligned_alloc(4096, bytes);
    b->src = aligned_alloc(4096, bytes);
    b->pristine = aligned_alloc(4096, bytes);
    b->copy_dst = aligned_alloc(4096, bytes);
    b->scratch = aligned_alloc(4096, b->scratch_bytes);
    if (!b->dst || !b->src || !b->pristine || !b->copy_dst || !b->scratch) {
        free(b->scratch);
        free(b->copy_dst);
        free(b->pristine);
        free(b->src);
        free(b->dst);
        return -1;
    }
    /* Touch every page now so that page faults never land in a timed run. */
    memset(b->dst, 0, bytes);
    memset(b->copy_dst, 0, bytes);
    memset(b->scratch, 0, b->scratch_bytes);
    return 0;
}

/* Frees what buffers_alloc took; cannot fail. */
static void buffers_free(buffers_t *b)
{
    free(b->scratch);
    free(b->copy_dst);
    free(b->pristine);
    free(b->src);
    free(b->dst);
}

typedef struct row {
    double reduce_gbs, copy_gbs;
} row_t;

/*
 * Measures one (path, op, dtype): each repetition resets dst, evicts the
 * caches and times memcpy, then does the same for the reduce, so both see
 * the same machine state; the best of each is kept. Returns 0 or -1.
 */
static int measure_row(const options_t *o, buffers_t *b, ps_op_t op, ps_dtype_t dtype, row_t *out)
{
    double best_reduce = 1e30, best_copy = 1e30;
    for (int r = 0; r < o->reps; r++) {
        if (o->flush)
            flush_caches(b->scratch, b->scratch_bytes);
        double t = timed_run(1, op, dtype, b->copy_dst, b->src, o->bytes, o->threads);
        if (t < best_copy)
            best_copy = t;
        memcpy(b->dst, b->pristine, o->bytes);
        if (o->flush)
            flush_caches(b->scratch, b->scratch_bytes);
        t = timed_run(0, op, dtype, b->dst, b->src, o->bytes, o->threads);
        if (t < 0)
            return -1;
        if (t < best_reduce)
            best_reduce = t;
    }
    /* Bytes read + written: dst = dst op src reads two buffers and writes one; memcpy one each. */
    out->reduce_gbs = 3.0 * (double)o->bytes / best_reduce / 1e9;
    out->copy_gbs = 2.0 * (double)o->bytes / best_copy / 1e9;
    return 0;
}

int main(int argc, char **argv)
{
    options_t o;
    if (parse_options(argc, argv, &o) != 0)
        return 2;
    buffers_t b;
    if (buffers_alloc(&b, o.bytes, o.flush) != 0) {
        fprintf(stderr, "out of memory for %zu MiB buffers\n", o.bytes >> 20);
        return 1;
    }
    ps_reduce_path_t default_path = ps_reduce_get_path();

    time_t t = time(NULL);
    char date[64];
    strftime(date, sizeof date, "%Y-%m-%d %H:%M:%S %Z", localtime(&t));
    printf("# paramsync-bench-reduce, %s\n", date);
    printf("# %zu MiB per buffer, best of %d run(s), %d thread(s), caches %s before each run\n",
           o.bytes >> 20, o.reps, o.threads, o.flush ? "evicted" : "not evicted");
    printf("# paths supported here:");
    for (int p = 0; p < PS_PATH_COUNT; p++)
        if (ps_reduce_path_supported((ps_reduce_path_t)p))
            printf(" %s", ps_reduce_path_name((ps_reduce_path_t)p));
    printf(" (default %s)\n", ps_reduce_path_name(default_path));
    printf("# GB/s = (bytes read + bytes written) / time, 1 GB = 1e9 bytes:\n"
           "#   reduce dst = dst op src counts 3 x buffer, memcpy counts 2 x buffer.\n"
           "# memcpy is re-measured beside every row (same buffers, same run); ratio = "
           "reduce/memcpy.\n"
           "# goals: float32 SUM ratio >= 0.8, float16/bfloat16 SUM ratio >= 0.5.\n");
    printf("%-7s %-8s %-9s %9s %12s %7s\n", "path", "op", "dtype", "GB/s", "memcpy GB/s", "ratio");

    int failures = 0, goals_missed = 0;
    for (int p = 0; p < PS_PATH_COUNT; p++) {
        ps_reduce_path_t path = (ps_reduce_path_t)p;
        if (!o.want_path[p])
            continue;
        if (ps_reduce_set_path(path) != 0) {
            printf("%-7s SKIPPED (not supported by this CPU or build)\n",
                   ps_reduce_path_name(path));
            continue;
        }
        for (int d = 0; d < PS_DTYPE_COUNT; d++) {
            ps_dtype_t dtype = (ps_dtype_t)d;
            if (!o.want_dtype[d])
                continue;
            fill_values(dtype, b.pristine, o.bytes);
            fill_values(dtype, b.src, o.bytes);
            for (int k = 0; k < PS_OP_COUNT; k++) {
                ps_op_t op = (ps_op_t)k;
                if (!o.want_op[k] || ps_op_check(op, dtype) != 0)
                    continue;
                row_t row;
                if (measure_row(&o, &b, op, dtype, &row) != 0) {
                    printf("%-7s %-8s %-9s FAILED\n", ps_reduce_path_name(path), ps_op_name(op),
                           ps_dtype_name(dtype));
                    failures++;
                    continue;
                }
                double ratio = row.reduce_gbs / row.copy_gbs;
                const char *note = "";
                if (op == PS_SUM && dtype == PS_FLOAT32 && ratio < 0.8)
                    note = "  below goal 0.8";
                if (op == PS_SUM && (dtype == PS_FLOAT16 || dtype == PS_BFLOAT16) && ratio < 0.5)
                    note = "  below goal 0.5";
                goals_missed += note[0] != '\0' && path != PS_PATH_SCALAR;
                printf("%-7s %-8s %-9s %9.2f %12.2f %7.2f%s\n", ps_reduce_path_name(path),
                       ps_op_name(op), ps_dtype_name(dtype), row.reduce_gbs, row.copy_gbs, ratio,
                       note);
                fflush(stdout);
            }
        }
    }
    ps_reduce_set_path(default_path);
    printf("# %d SIMD row(s) below goal, %d failure(s)\n", goals_missed, failures);
    buffers_free(&b);
    return failures != 0;
}
