/*
 * paramsync-bench: nccl-tests-style figures for every collective of libparamsync.
 *
 * Run one process per rank, as the C client expects (RANK, WORLD_SIZE and
 * PARAMSYNC_ADDR or MASTER_ADDR/MASTER_PORT in the environment, or --init).
 * For each collective and size it prints size, count, dtype, op, root, time
 * per call (the slowest rank's mean; the CSV has the slowest rank's median
 * too), algbw, busbw (nccl-tests' factors) and
 * the number of wrong elements over all ranks (a separate, freshly filled
 * call is checked after the timed ones).
 *
 * Sizes follow nccl-tests: for all_gather, gather, scatter, reduce_scatter
 * and all_to_all the size is the whole buffer (world size × the per-rank
 * block), rounded down to a multiple of world size × element size (at least
 * one element per rank).
 */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include <paramsync/gpu.h>
#include <paramsync/paramsync.h>

#include "a2av.h"
#include "huge.h"

#define PS_BENCH_INFLIGHT 64 /* the most --inflight takes */

static const char usage[] =
    "usage: paramsync-bench [options]   (one process per rank: RANK, WORLD_SIZE and\n"
    "                                     PARAMSYNC_ADDR in the environment)\n"
    "  -b, --minbytes N      smallest size, K/M/G suffixes (default 4)\n"
    "  -e, --maxbytes N      largest size (default 256M)\n"
    "  -f, --stepfactor F    multiply the size by F each step (default 2)\n"
    "  -w, --warmup N        untimed calls per size (default 5)\n"
    "  -n, --iters N         timed calls per size (default 20)\n"
    "  -B, --iter-bytes N    fewer calls for large sizes: at most N/size calls, at least\n"
    "                        one (default 0: no cap)\n"
    "  -t, --collectives L   comma-separated: all_reduce, broadcast, reduce, all_gather,\n"
    "                        gather, scatter, reduce_scatter, all_to_all, all_to_all_v,\n"
    "                        barrier, or all (default). all_to_all_v: ps_all_to_all_v,\n"
    "                        rank r sends rank j a block of u (1 + (r + j) mod p)\n"
    "                        elements, the size being what each rank sends (host\n"
    "                        memory only)\n"
    "  -d, --dtype NAME      float32 (default), float64, float16, bfloat16, int8, uint8,\n"
    "                        int16, int32, int64\n"
    "  -o, --op NAME         sum (default), prod, min, max, avg\n"
    "  -r, --root N          root of broadcast, reduce, gather, scatter (default 0)\n"
    "  -c, --check 0|1       check results (default 1)\n"
    "  -I, --in-place 0|1    all_gather and gather in place, as torch's\n"
    "                        all_gather_into_tensor from a view of its output: each\n"
    "                        rank's input is its own block of the output (default 0)\n"
    "  -i, --init URL        init method (default env://)\n"
    "  -m, --mem KIND        malloc (default): buffers from malloc; huge: on 2 MiB\n"
    "                        transparent huge pages (aligned, madvise MADV_HUGEPAGE),\n"
    "                        which the agent's direct path copies much faster; shared:\n"
    "                        from ps_mem_alloc, which the agent reads and writes in place;\n"
    "                        shared2: the same, the input and the output in two\n"
    "                        allocations (as tensors of two empty() calls);\n"
    "                        device: CUDA device memory (ps_gpu_malloc), which the client\n"
    "                        stages through pinned host memory (a GPU needed; not with\n"
    "                        --inflight)\n"
    "  -a, --inflight K      each timed call starts K nonblocking calls at once (each\n"
    "                        on a buffer of its own) and waits for them all; time is per\n"
    "                        call (default 1: blocking calls). all_reduce and barrier\n"
    "      --cuda 0|1        1: load CUDA before ps_init, as a GPU training process\n"
    "                        does, so that the job joins for device collectives (its\n"
    "                        host-buffer calls then pay for finding that out); the\n"
    "                        default with --mem device, else 0\n"
    "      --csv FILE        append one CSV row per result to FILE (rank 0; '-' is stdout):\n"
    "                        label, collective, world, bytes, count, dtype, op, root,\n"
    "                        time_us (mean), algbw, busbw (GB/s), wrong, iters, median_us\n"
    "      --label NAME      the system column of the CSV (default paramsync)\n"
    "  -h, --help\n";

enum coll {
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

static const char *const coll_names[C_COUNT] = {
    "all_reduce", "broadcast",      "reduce",     "all_gather",   "gather",
    "scatter",    "reduce_scatter", "all_to_all", "all_to_all_v", "barrier",
};

/* Collectives whose size is split in world-size blocks. */
static int coll_blocked(int c)
{
    return c == C_ALL_GATHER || c == C_GATHER || c == C_SCATTER || c == C_REDUCE_SCATTER ||
           c == C_ALL_TO_ALL;
}

static int coll_reduces(int c)
{
    return c == C_ALL_REDUCE || c == C_REDUCE || c == C_REDUCE_SCATTER;
}

static int coll_rooted(int c)
{
    return c == C_BROADCAST || c == C_REDUCE || c == C_GATHER || c == C_SCATTER;
}

/* nccl-tests' bus bandwidth factors. */
static double busbw_factor(int c, int p)
{
    switch (c) {
    case C_ALL_REDUCE:
        return 2.0 * (p - 1) / p;
    case C_BROADCAST:
    case C_REDUCE:
        return 1.0;
    case C_BARRIER:
        return 0.0;
    default:
        return (double)(p - 1) / p;
    }
}

static const char *const op_names[PS_OP_COUNT] = {"sum",  "prod", "min",  "max",
                                                  "band", "bor",  "bxor", "avg"};

typedef struct options {
    size_t minbytes, maxbytes, iter_bytes;
    double factor;
    int warmup, iters, root, check;
    int want[C_COUNT]; /* 1: wanted, 2: named in -t */
    ps_dtype_t dtype;
    ps_op_t op;
    const char *init, *csv, *label;
    int shared_mem; /* --mem shared or shared2 */
    int two_allocs; /* --mem shared2: input and output in allocations of their own */
    int huge_mem;   /* --mem huge */
    int device_mem; /* --mem device */
    int cuda;       /* --cuda: -1 as --mem device says */
    int inflight;   /* --inflight */
    int in_place;   /* --in-place */
} options_t;

/* A buffer of the worker's own memory: malloc, or with --mem huge on huge
 * pages (huge.h). */
static void *host_alloc(const options_t *o, size_t n, int *advised)
{
    return o->huge_mem ? ps_bench_huge_alloc(n, advised) : malloc(n);
}

static double now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int parse_size(const char *s, size_t *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || v < 0)
        return -1;
    double mult = 1;
    switch (*end) {
    case 'k':
    case 'K':
        mult = 1024.0;
        end++;
        break;
    case 'm':
    case 'M':
        mult = 1024.0 * 1024;
        end++;
        break;
    case 'g':
    case 'G':
        mult = 1024.0 * 1024 * 1024;
        end++;
        break;
    default:
        break;
    }
    if (*end == 'i' || *end == 'I')
        end++;
    if (*end == 'b' || *end == 'B')
        end++;
    if (*end)
        return -1;
    *out = (size_t)(v * mult);
    return 0;
}

static int parse_int_arg(const char *s, int min, int *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < min || v > 1000000000L)
        return -1;
    *out = (int)v;
    return 0;
}

static int parse_dtype(const char *s, ps_dtype_t *out)
{
    static const ps_dtype_t ok[] = {PS_FLOAT32, PS_FLOAT64, PS_FLOAT16, PS_BFLOAT16, PS_INT8,
                                    PS_UINT8,   PS_INT16,   PS_INT32,   PS_INT64};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++)
        if (strcasecmp(s, ps_dtype_name(ok[i])) == 0) {
            *out = ok[i];
            return 0;
        }
    return -1;
}

static int parse_op(const char *s, ps_op_t *out)
{
    static const ps_op_t ok[] = {PS_SUM, PS_PRODUCT, PS_MIN, PS_MAX, PS_AVG};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++)
        if (strcasecmp(s, op_names[ok[i]]) == 0) {
            *out = ok[i];
            return 0;
        }
    if (strcasecmp(s, "product") == 0) {
        *out = PS_PRODUCT;
        return 0;
    }
    return -1;
}

static int parse_colls(const char *list, int *want)
{
    char *copy = strdup(list);
    if (!copy)
        return -1;
    memset(want, 0, C_COUNT * sizeof *want);
    int rc = 0;
    char *save = NULL;
    for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        int found = strcasecmp(tok, "all") == 0;
        for (int c = 0; c < C_COUNT; c++)
            if (strcasecmp(tok, coll_names[c]) == 0)
                want[c] = found = 2; /* named */
            else if (found == 1 && !want[c])
                want[c] = 1;
        if (!found) {
            fprintf(stderr, "paramsync-bench: unknown collective '%s'\n", tok);
            rc = -1;
        }
    }
    free(copy);
    return rc;
}

static int parse_options(int argc, char **argv, options_t *o)
{
    memset(o, 0, sizeof *o);
    o->minbytes = 4;
    o->maxbytes = (size_t)256 << 20;
    o->factor = 2.0;
    o->warmup = 5;
    o->iters = 20;
    o->check = 1;
    o->inflight = 1;
    o->dtype = PS_FLOAT32;
    o->op = PS_SUM;
    o->label = "paramsync";
    o->cuda = -1;
    for (int c = 0; c < C_COUNT; c++)
        o->want[c] = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            fputs(usage, stdout);
            exit(0);
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "paramsync-bench: %s needs a value or is unknown\n%s", a, usage);
            return -1;
        }
        const char *v = argv[++i];
        int bad = 0;
        if (!strcmp(a, "-b") || !strcmp(a, "--minbytes"))
            bad = parse_size(v, &o->minbytes);
        else if (!strcmp(a, "-e") || !strcmp(a, "--maxbytes"))
            bad = parse_size(v, &o->maxbytes);
        else if (!strcmp(a, "-B") || !strcmp(a, "--iter-bytes"))
            bad = parse_size(v, &o->iter_bytes);
        else if (!strcmp(a, "-f") || !strcmp(a, "--stepfactor")) {
            char *end;
            o->factor = strtod(v, &end);
            bad = *end || !(o->factor > 1.0);
        } else if (!strcmp(a, "-w") || !strcmp(a, "--warmup"))
            bad = parse_int_arg(v, 0, &o->warmup);
        else if (!strcmp(a, "-n") || !strcmp(a, "--iters"))
            bad = parse_int_arg(v, 1, &o->iters);
        else if (!strcmp(a, "-r") || !strcmp(a, "--root"))
            bad = parse_int_arg(v, 0, &o->root);
        else if (!strcmp(a, "-c") || !strcmp(a, "--check"))
            bad = parse_int_arg(v, 0, &o->check);
        else if (!strcmp(a, "-t") || !strcmp(a, "--collectives"))
            bad = parse_colls(v, o->want);
        else if (!strcmp(a, "-d") || !strcmp(a, "--dtype"))
            bad = parse_dtype(v, &o->dtype);
        else if (!strcmp(a, "-o") || !strcmp(a, "--op"))
            bad = parse_op(v, &o->op);
        else if (!strcmp(a, "-i") || !strcmp(a, "--init"))
            o->init = v;
        else if (!strcmp(a, "--cuda"))
            bad = parse_int_arg(v, 0, &o->cuda) || o->cuda > 1;
        else if (!strcmp(a, "--csv"))
            o->csv = v;
        else if (!strcmp(a, "--label"))
            o->label = v;
        else if (!strcmp(a, "-I") || !strcmp(a, "--in-place"))
            bad = parse_int_arg(v, 0, &o->in_place) || o->in_place > 1;
        else if (!strcmp(a, "-a") || !strcmp(a, "--inflight"))
            bad = parse_int_arg(v, 1, &o->inflight) || o->inflight > PS_BENCH_INFLIGHT;
        else if (!strcmp(a, "-m") || !strcmp(a, "--mem")) {
            o->two_allocs = !strcmp(v, "shared2");
            o->shared_mem = o->two_allocs || !strcmp(v, "shared");
            o->huge_mem = !strcmp(v, "huge");
            o->device_mem = !strcmp(v, "device");
            bad = !o->shared_mem && !o->huge_mem && !o->device_mem && strcmp(v, "malloc") != 0;
        } else {
            fprintf(stderr, "paramsync-bench: unknown option %s\n%s", a, usage);
            return -1;
        }
        if (bad) {
            fprintf(stderr, "paramsync-bench: bad value '%s' for %s\n", v, a);
            return -1;
        }
    }
    if (o->minbytes == 0 || o->maxbytes < o->minbytes) {
        fprintf(stderr, "paramsync-bench: need 0 < minbytes <= maxbytes\n");
        return -1;
    }
    int fp = o->dtype == PS_FLOAT32 || o->dtype == PS_FLOAT64 || o->dtype == PS_FLOAT16 ||
             o->dtype == PS_BFLOAT16;
    if (o->op == PS_AVG && !fp) {
        fprintf(stderr, "paramsync-bench: avg needs a floating dtype\n");
        return -1;
    }
    if (o->device_mem && o->want[C_ALL_TO_ALL_V] == 2) {
        fprintf(stderr, "paramsync-bench: all_to_all_v takes host memory, not --mem device "
                        "(choose others with -t)\n");
        return -1;
    }
    if (o->device_mem) /* all: the others */
        o->want[C_ALL_TO_ALL_V] = 0;
    if (o->inflight > 1 && o->device_mem) {
        fprintf(stderr, "paramsync-bench: --mem device takes blocking calls only, not "
                        "--inflight\n");
        return -1;
    }
    for (int c = 0; c < C_COUNT && o->inflight > 1; c++)
        if (o->want[c] && c != C_ALL_REDUCE && c != C_BARRIER) {
            fprintf(stderr,
                    "paramsync-bench: --inflight takes all_reduce and barrier only, not %s "
                    "(choose with -t)\n",
                    coll_names[c]);
            return -1;
        }
    return 0;
}

/* ---- data and checks ---------------------------------------------------
 *
 * Every input element is a small integer that depends on (rank, index mod
 * PERIOD), so sums, products, minima and maxima are exact in every dtype
 * (or wrap exactly for narrow integers) and the expected value of any
 * element is a table lookup. PERIOD is prime so neighbouring blocks differ.
 */
#define PERIOD 13

static int gen(ps_op_t op, int rank, size_t i)
{
    unsigned r = (unsigned)rank, k = (unsigned)(i % PERIOD);
    if (op == PS_PRODUCT) /* 1s and 2s: products are powers of two */
        return 1 + ((r + k) % 4 == 0);
    return (int)((r * 5u + k * 3u) % PERIOD) + 1;
}

static uint16_t float_to_bf16(float f)
{
    uint32_t b;
    memcpy(&b, &f, 4);
    if ((b & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((b >> 16) | 0x40);
    b += 0x7fffu + ((b >> 16) & 1u);
    return (uint16_t)(b >> 16);
}

static float bf16_to_float(uint16_t h)
{
    uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* float -> IEEE half, round to nearest even; enough for finite values and overflow. */
static uint16_t float_to_half(float f)
{
    uint32_t b;
    memcpy(&b, &f, 4);
    uint16_t sign = (uint16_t)((b >> 16) & 0x8000u);
    uint32_t absb = b & 0x7fffffffu;
    if (absb > 0x7f800000u)
        return sign | 0x7e00u;
    if (absb >= 0x477ff000u) /* rounds to >= 65520: infinity */
        return sign | 0x7c00u;
    if (absb < 0x38800000u) { /* subnormal half or zero */
        float a;
        memcpy(&a, &absb, 4);
        float scaled = a * 16777216.0f; /* 2^24: units of the smallest subnormal */
        return sign | (uint16_t)lrintf(scaled);
    }
    uint32_t mant = absb & 0x7fffffu, exp = (absb >> 23) - 127 + 15;
    uint32_t h = (exp << 10) | (mant >> 13);
    uint32_t rest = mant & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u)))
        h++;
    return sign | (uint16_t)h;
}

static double half_to_double(uint16_t h)
{
    int exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    double v = exp == 0    ? ldexp(mant, -24)
               : exp == 31 ? (mant ? NAN : INFINITY)
                           : ldexp(mant | 0x400, exp - 25);
    return (h & 0x8000) ? -v : v;
}

static int is_float(ps_dtype_t t)
{
    return t == PS_FLOAT32 || t == PS_FLOAT64 || t == PS_FLOAT16 || t == PS_BFLOAT16;
}

/* Writes value v (exact for the values used here) into element 0 of dst. */
static void encode(ps_dtype_t t, double fv, int64_t iv, void *dst)
{
    switch (t) {
    case PS_FLOAT32: {
        float f = (float)fv;
        memcpy(dst, &f, 4);
        break;
    }
    case PS_FLOAT64:
        memcpy(dst, &fv, 8);
        break;
    case PS_FLOAT16: {
        uint16_t h = float_to_half((float)fv);
        memcpy(dst, &h, 2);
        break;
    }
    case PS_BFLOAT16: {
        uint16_t h = float_to_bf16((float)fv);
        memcpy(dst, &h, 2);
        break;
    }
    case PS_INT8:
    case PS_UINT8: {
        uint8_t x = (uint8_t)(uint64_t)iv;
        memcpy(dst, &x, 1);
        break;
    }
    case PS_INT16: {
        uint16_t x = (uint16_t)(uint64_t)iv;
        memcpy(dst, &x, 2);
        break;
    }
    case PS_INT32: {
        uint32_t x = (uint32_t)(uint64_t)iv;
        memcpy(dst, &x, 4);
        break;
    }
    default: {
        uint64_t x = (uint64_t)iv;
        memcpy(dst, &x, 8);
        break;
    }
    }
}

static double decode_float(ps_dtype_t t, const void *src)
{
    switch (t) {
    case PS_FLOAT32: {
        float f;
        memcpy(&f, src, 4);
        return f;
    }
    case PS_FLOAT64: {
        double d;
        memcpy(&d, src, 8);
        return d;
    }
    case PS_FLOAT16: {
        uint16_t h;
        memcpy(&h, src, 2);
        return half_to_double(h);
    }
    default: {
        uint16_t h;
        memcpy(&h, src, 2);
        return bf16_to_float(h);
    }
    }
}

/* A table of PERIOD encoded values: the element at index i is table[i % PERIOD]. */
typedef struct pattern {
    unsigned char v[PERIOD][8];
    double f[PERIOD]; /* the exact value, for AVG's tolerance */
} pattern_t;

/* The input of `rank`. */
static void pattern_input(pattern_t *pt, ps_dtype_t t, ps_op_t op, int rank)
{
    for (int k = 0; k < PERIOD; k++) {
        int g = gen(op, rank, (size_t)k);
        pt->f[k] = g;
        encode(t, g, g, pt->v[k]);
    }
}

/* The reduction over ranks 0..p-1 of their inputs at index offset+k. */
static void pattern_reduced(pattern_t *pt, ps_dtype_t t, ps_op_t op, int p, size_t offset)
{
    for (int k = 0; k < PERIOD; k++) {
        size_t idx = offset + (size_t)k;
        double f = gen(op, 0, idx);
        int64_t iv = gen(op, 0, idx);
        uint64_t uprod = (uint64_t)iv;
        for (int r = 1; r < p; r++) {
            int g = gen(op, r, idx);
            switch (op) {
            case PS_SUM:
            case PS_AVG:
                f += g;
                iv += g;
                break;
            case PS_PRODUCT:
                f *= g;
                uprod *= (uint64_t)g;
                break;
            case PS_MIN:
                f = g < f ? g : f;
                iv = g < iv ? g : iv;
                break;
            default:
                f = g > f ? g : f;
                iv = g > iv ? g : iv;
                break;
            }
        }
        if (op == PS_PRODUCT)
            iv = (int64_t)uprod;
        if (op == PS_AVG)
            f /= p;
        pt->f[k] = f;
        encode(t, f, iv, pt->v[k]);
    }
}

/* Fills n elements; element j gets the pattern at (j + start) mod PERIOD. */
static void fill(void *buf, size_t n, size_t start, const pattern_t *pt, size_t es)
{
    unsigned char *b = buf;
    size_t k = start % PERIOD;
    for (size_t j = 0; j < n; j++) {
        memcpy(b + j * es, pt->v[k], es);
        if (++k == PERIOD)
            k = 0;
    }
}

/* Counts elements of buf that differ from the pattern (AVG: beyond rounding). */
static int64_t count_wrong(const void *buf, size_t n, size_t start, const pattern_t *pt,
                           ps_dtype_t t, ps_op_t op)
{
    size_t es = ps_dtype_size(t);
    const unsigned char *b = buf;
    size_t k = start % PERIOD;
    int64_t wrong = 0;
    double tol = t == PS_FLOAT64 ? 0x1p-50 : t == PS_FLOAT32 ? 0x1p-22 : 0x1p-7;
    for (size_t j = 0; j < n; j++) {
        if (memcmp(b + j * es, pt->v[k], es) != 0) {
            if (op == PS_AVG && is_float(t)) {
                double got = decode_float(t, b + j * es), want = pt->f[k];
                wrong += !(fabs(got - want) <= tol * fabs(want));
            } else {
                wrong++;
            }
        }
        if (++k == PERIOD)
            k = 0;
    }
    return wrong;
}

/* ---- the benchmark ------------------------------------------------------ */

typedef struct bench {
    const options_t *o;
    ps_comm_t *comm;
    int rank, p;
    size_t es;
    void *in, *out;                /* buffers of the largest size (--mem device: host copies) */
    uint8_t *dev_in, *dev_out;     /* --mem device: the buffers the collectives get */
    void *outs[PS_BENCH_INFLIGHT]; /* --inflight: one all_reduce buffer per call (outs[0] = out) */
    size_t cap;                    /* bytes in each */
    double *times;                 /* per-call times of one size */
    size_t *counts; /* all_to_all_v: the block of each rank, sent and received alike */
    FILE *csv;
} bench_t;

static void die_rc(const bench_t *b, const char *what, int rc)
{
    fprintf(stderr, "paramsync-bench: rank %d: %s failed: %s (%d)\n", b->rank, what,
            ps_strerror(rc), rc);
    exit(1);
}

/* The buffer a collective gets for p, a pointer into b->in or b->out: p
 * itself, or with --mem device the same place in the device buffers. */
static void *dev(const bench_t *b, void *p)
{
    if (!b->dev_in || !p)
        return p;
    uint8_t *q = p, *in = b->in;
    return q >= in && q < in + b->cap ? b->dev_in + (q - in) : b->dev_out + (q - (uint8_t *)b->out);
}

/* --mem device: copies n bytes between host and device and waits; any
 * failure ends the run. */
static void dev_copy(const bench_t *b, void *dst, const void *src, size_t n)
{
    int rc = ps_gpu_memcpy_async(dst, src, n, NULL);
    if (rc == 0)
        rc = ps_gpu_stream_synchronize(NULL);
    if (rc < 0)
        die_rc(b, "copying between host and device", rc);
}

/* An all_gather's or gather's input of n elements: b->in, or with
 * --in-place the rank's own block of the output. */
static void *gather_input(const bench_t *b, size_t n)
{
    return b->o->in_place ? (char *)b->out + (size_t)b->rank * n * b->es : b->in;
}

/* One call of collective c; n is the per-rank element count (blocked) or the count. */
static int run_one(bench_t *b, int c, size_t n)
{
    const options_t *o = b->o;
    switch (c) {
    case C_ALL_REDUCE:
        return ps_all_reduce(b->comm, dev(b, b->out), n, o->dtype, o->op, NULL);
    case C_BROADCAST:
        return ps_broadcast(b->comm, dev(b, b->out), n, o->dtype, o->root, NULL);
    case C_REDUCE:
        return ps_reduce_to(b->comm, dev(b, b->out), n, o->dtype, o->op, o->root, NULL);
    case C_ALL_GATHER:
        return ps_all_gather(b->comm, dev(b, b->out), dev(b, gather_input(b, n)), n, o->dtype,
                             NULL);
    case C_GATHER:
        return ps_gather(b->comm, b->rank == o->root ? dev(b, b->out) : NULL,
                         dev(b, gather_input(b, n)), n, o->dtype, o->root, NULL);
    case C_SCATTER:
        return ps_scatter(b->comm, dev(b, b->out), b->rank == o->root ? dev(b, b->in) : NULL, n,
                          o->dtype, o->root, NULL);
    case C_REDUCE_SCATTER:
        return ps_reduce_scatter(b->comm, dev(b, b->out), dev(b, b->in), n, o->dtype, o->op, NULL);
    case C_ALL_TO_ALL:
        return ps_all_to_all(b->comm, dev(b, b->out), dev(b, b->in), n, o->dtype, NULL);
    case C_ALL_TO_ALL_V:
        for (int j = 0; j < b->p; j++)
            b->counts[j] = ps_bench_a2av_count(b->rank, j, b->p, n);
        return ps_all_to_all_v(b->comm, b->out, b->counts, b->in, b->counts, o->dtype, NULL);
    default:
        return ps_barrier(b->comm, NULL);
    }
}

/* One timed call: blocking, or --inflight nonblocking ones at once, each on
 * a buffer of its own, all waited for. */
static int run_batch(bench_t *b, int c, size_t n)
{
    const options_t *o = b->o;
    if (o->inflight == 1)
        return run_one(b, c, n);
    ps_work_t *w[PS_BENCH_INFLIGHT];
    int rc = 0, started = 0;
    for (; started < o->inflight && rc == 0; started++)
        rc = c == C_ALL_REDUCE
                 ? ps_iall_reduce(b->comm, b->outs[started], n, o->dtype, o->op, NULL, &w[started])
                 : ps_ibarrier(b->comm, NULL, &w[started]);
    if (rc < 0)
        started--;
    for (int i = 0; i < started; i++) {
        int r = ps_work_wait(w[i]);
        rc = rc < 0 ? rc : r;
        ps_work_free(w[i]);
    }
    return rc;
}

/* Fills the buffers for a checked call of c with n elements (per rank for blocked ones). */
static void prepare(bench_t *b, int c, size_t n)
{
    const options_t *o = b->o;
    pattern_t pt;
    size_t es = b->es;
    switch (c) {
    case C_ALL_REDUCE:
    case C_REDUCE:
        pattern_input(&pt, o->dtype, o->op, b->rank);
        fill(b->out, n, 0, &pt, es);
        break;
    case C_BROADCAST:
        pattern_input(&pt, o->dtype, o->op, b->rank);
        fill(b->out, n, 0, &pt, es);
        break;
    case C_ALL_GATHER:
    case C_GATHER:
        memset(b->out, 0xa5, n * (size_t)b->p * es);
        pattern_input(&pt, o->dtype, o->op, b->rank);
        fill(gather_input(b, n), n, 0, &pt, es);
        break;
    case C_SCATTER:
        /* root's block r holds rank r's pattern */
        if (b->rank == o->root)
            for (int r = 0; r < b->p; r++) {
                pattern_input(&pt, o->dtype, o->op, r);
                fill((char *)b->in + (size_t)r * n * es, n, 0, &pt, es);
            }
        memset(b->out, 0xa5, n * es);
        break;
    case C_REDUCE_SCATTER:
    case C_ALL_TO_ALL:
        /* element j of the whole input is the pattern at j */
        pattern_input(&pt, o->dtype, o->op, b->rank);
        fill(b->in, n * (size_t)b->p, 0, &pt, es);
        memset(b->out, 0xa5, (c == C_ALL_TO_ALL ? (size_t)b->p : 1) * n * es);
        break;
    case C_ALL_TO_ALL_V:
        pattern_input(&pt, o->dtype, o->op, b->rank);
        fill(b->in, n * ps_bench_a2av_units(b->p), 0, &pt, es);
        memset(b->out, 0xa5, n * ps_bench_a2av_units(b->p) * es);
        break;
    default:
        break;
    }
    if (b->dev_in) {
        dev_copy(b, b->dev_in, b->in, b->cap);
        dev_copy(b, b->dev_out, b->out, b->cap);
    }
}

/* Wrong elements on this rank after a call prepared by prepare(). */
static int64_t verify(bench_t *b, int c, size_t n)
{
    const options_t *o = b->o;
    pattern_t pt;
    size_t es = b->es;
    int64_t wrong = 0;
    if (b->dev_out)
        dev_copy(b, b->out, b->dev_out, b->cap);
    switch (c) {
    case C_ALL_REDUCE:
        pattern_reduced(&pt, o->dtype, o->op, b->p, 0);
        return count_wrong(b->out, n, 0, &pt, o->dtype, o->op);
    case C_REDUCE:
        if (b->rank == o->root)
            pattern_reduced(&pt, o->dtype, o->op, b->p, 0);
        else
            pattern_input(&pt, o->dtype, o->op, b->rank); /* unchanged */
        return count_wrong(b->out, n, 0, &pt, o->dtype, b->rank == o->root ? o->op : PS_SUM);
    case C_BROADCAST:
        pattern_input(&pt, o->dtype, o->op, o->root);
        return count_wrong(b->out, n, 0, &pt, o->dtype, PS_SUM);
    case C_ALL_GATHER:
    case C_GATHER:
        if (c == C_GATHER && b->rank != o->root)
            return 0;
        for (int r = 0; r < b->p; r++) {
            pattern_input(&pt, o->dtype, o->op, r);
            wrong += count_wrong((char *)b->out + (size_t)r * n * es, n, 0, &pt, o->dtype, PS_SUM);
        }
        return wrong;
    case C_SCATTER:
        pattern_input(&pt, o->dtype, o->op, b->rank);
        return count_wrong(b->out, n, 0, &pt, o->dtype, PS_SUM);
    case C_REDUCE_SCATTER:
        /* block `rank` of everyone's input, reduced: indices rank*n .. */
        pattern_reduced(&pt, o->dtype, o->op, b->p, ((size_t)b->rank * n) % PERIOD);
        return count_wrong(b->out, n, 0, &pt, o->dtype, o->op);
    case C_ALL_TO_ALL:
        /* out block j = rank j's input block `rank` */
        for (int j = 0; j < b->p; j++) {
            pattern_input(&pt, o->dtype, o->op, j);
            wrong += count_wrong((char *)b->out + (size_t)j * n * es, n, (size_t)b->rank * n, &pt,
                                 o->dtype, PS_SUM);
        }
        return wrong;
    case C_ALL_TO_ALL_V: {
        /* out block j = rank j's block `rank`, from where it lies in rank j's input */
        size_t at = 0;
        for (int j = 0; j < b->p; j++) {
            size_t from = ps_bench_a2av_at(j, b->rank, b->p, n);
            size_t k = ps_bench_a2av_count(j, b->rank, b->p, n);
            pattern_input(&pt, o->dtype, o->op, j);
            wrong += count_wrong((char *)b->out + at * es, k, from, &pt, o->dtype, PS_SUM);
            at += k;
        }
        return wrong;
    }
    default:
        return 0;
    }
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Sorts v. */
static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static int iters_for(const options_t *o, int n, size_t bytes)
{
    if (o->iter_bytes == 0 || bytes == 0)
        return n;
    size_t cap = o->iter_bytes / bytes;
    if (cap < 1)
        cap = 1;
    return (size_t)n < cap ? n : (int)cap;
}

static void print_header(const bench_t *b)
{
    const options_t *o = b->o;
    printf("# paramsync-bench: world %d, dtype %s, op %s, root %d, warmup %d, iters %d", b->p,
           ps_dtype_name(o->dtype), op_names[o->op], o->root, o->warmup, o->iters);
    if (o->iter_bytes)
        printf(" (at most %zu bytes of calls per size)", o->iter_bytes);
    if (o->inflight > 1)
        printf(", %d nonblocking calls in flight at once", o->inflight);
    if (o->in_place)
        printf(", all_gather and gather in place");
    if (o->device_mem)
        printf(", buffers in CUDA device memory");
    printf(", check %s\n", o->check ? "on" : "off");
    printf("# time: mean per call of the slowest rank; algbw = size/time; busbw per "
           "nccl-tests; #wrong over all ranks (-1: not checked)\n");
    printf("#%15s %12s %11s %9s %5s %5s %11s %11s %11s %8s\n", "collective", "size(B)", "count",
           "type", "redop", "root", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong");
    fflush(stdout);
}

/* Runs every wanted size of collective c. Returns the number of wrong elements seen. */
static int64_t bench_coll(bench_t *b, int c)
{
    const options_t *o = b->o;
    int64_t total_wrong = 0;
    double last = -1;
    for (double nominal = (double)o->minbytes; nominal <= (double)o->maxbytes * 1.0000001;
         nominal *= o->factor) {
        size_t bytes = (size_t)nominal, n, size;
        if (c == C_BARRIER) {
            n = 0;
            size = 0;
        } else if (coll_blocked(c)) {
            n = bytes / (b->es * (size_t)b->p);
            if (n == 0)
                n = 1;
            size = n * (size_t)b->p * b->es;
        } else if (c == C_ALL_TO_ALL_V) {
            n = bytes / (b->es * ps_bench_a2av_units(b->p));
            if (n == 0)
                n = 1;
            size = n * ps_bench_a2av_units(b->p) * b->es;
        } else {
            n = bytes / b->es;
            if (n == 0)
                n = 1;
            size = n * b->es;
        }
        if ((double)size == last)
            continue; /* rounding made it the same as the previous size */
        last = (double)size;

        int rc;
        int warm = iters_for(o, o->warmup, size), iters = iters_for(o, o->iters, size);
        if (!coll_reduces(c) && c != C_BARRIER) /* timing runs on whatever the buffers hold */
            prepare(b, c, n);
        if ((rc = ps_barrier(b->comm, NULL)) < 0)
            die_rc(b, "barrier", rc);
        for (int i = 0; i < warm; i++)
            if ((rc = run_batch(b, c, n)) < 0)
                die_rc(b, coll_names[c], rc);
        if ((rc = ps_barrier(b->comm, NULL)) < 0)
            die_rc(b, "barrier", rc);
        /* Each call is timed: the mean is nccl-tests' figure, the median resists the
         * scheduler noise of a shared machine. */
        double t0 = now_seconds(), prev = t0;
        for (int i = 0; i < iters; i++) {
            if ((rc = run_batch(b, c, n)) < 0)
                die_rc(b, coll_names[c], rc);
            double now = now_seconds();
            b->times[i] = (now - prev) / o->inflight;
            prev = now;
        }
        double tm[2] = {(prev - t0) / iters / o->inflight, median(b->times, iters)};
        if ((rc = ps_all_reduce(b->comm, tm, 2, PS_FLOAT64, PS_MAX, NULL)) < 0)
            die_rc(b, "all_reduce of the times", rc);
        double t = tm[0];

        int64_t wrong = -1;
        if (o->check && c != C_BARRIER) {
            for (int k = 0; k < o->inflight; k++) {
                b->out = b->outs[k];
                prepare(b, c, n);
            }
            if ((rc = run_batch(b, c, n)) < 0)
                die_rc(b, coll_names[c], rc);
            wrong = 0;
            for (int k = 0; k < o->inflight; k++) {
                b->out = b->outs[k];
                wrong += verify(b, c, n);
            }
            b->out = b->outs[0];
            if ((rc = ps_all_reduce(b->comm, &wrong, 1, PS_INT64, PS_SUM, NULL)) < 0)
                die_rc(b, "all_reduce of the error counts", rc);
            total_wrong += wrong;
        }

        if (b->rank == 0) {
            double algbw = size ? (double)size / t / 1e9 : 0.0;
            double busbw = algbw * busbw_factor(c, b->p);
            int root = coll_rooted(c) ? o->root : -1;
            const char *redop = coll_reduces(c) ? op_names[o->op] : "none";
            printf(" %15s %12zu %11zu %9s %5s %5d %11.2f %11.3f %11.3f %8lld\n", coll_names[c],
                   size, size / b->es, c == C_BARRIER ? "none" : ps_dtype_name(o->dtype), redop,
                   root, t * 1e6, algbw, busbw, (long long)wrong);
            fflush(stdout);
            if (b->csv) {
                fprintf(b->csv, "%s,%s,%d,%zu,%zu,%s,%s,%d,%.3f,%.6f,%.6f,%lld,%d,%.3f\n", o->label,
                        coll_names[c], b->p, size, size / b->es,
                        c == C_BARRIER ? "none" : ps_dtype_name(o->dtype), redop, root, t * 1e6,
                        algbw, busbw, (long long)wrong, iters, tm[1] * 1e6);
                fflush(b->csv);
            }
        }
        if (c == C_BARRIER)
            break;
    }
    return total_wrong;
}

int main(int argc, char **argv)
{
    options_t o;
    if (parse_options(argc, argv, &o) < 0)
        return 2;

    /* Device buffers: CUDA is loaded before ps_init, as in a training
     * process, so that the job joins for device collectives. */
    int ndev = 0;
    if ((o.cuda < 0 ? o.device_mem : o.cuda) && ps_gpu_device_count(&ndev) == 0)
        (void)ps_gpu_set_device(0);
    ps_init_options_t io;
    ps_init_options_default(&io);
    io.init_method = o.init;
    bench_t b = {.o = &o, .es = ps_dtype_size(o.dtype)};
    int rc = ps_init(&io, &b.comm);
    if (rc < 0) {
        fprintf(stderr, "paramsync-bench: ps_init failed: %s (%d)\n", ps_strerror(rc), rc);
        return 1;
    }
    b.rank = ps_get_rank(b.comm, NULL);
    b.p = ps_get_world_size(b.comm, NULL);
    if (o.root >= b.p) {
        fprintf(stderr, "paramsync-bench: root %d is outside world size %d\n", o.root, b.p);
        ps_finalize(b.comm);
        return 2;
    }

    /* Largest buffer any wanted collective needs: all_to_all and reduce_scatter
     * inputs hold the whole size; so do all_gather and gather outputs. Sizes
     * rounded up to one element per rank may exceed maxbytes. */
    size_t floor_bytes = ps_bench_a2av_units(b.p) * b.es;
    b.cap = o.maxbytes > floor_bytes ? o.maxbytes : floor_bytes;
    b.cap += b.es; /* slack for rounding of non-power-of-two sizes */
    /* --mem shared: one allocation holds both buffers, so a collective's
     * input and output lie in the same shared segment; shared2: two. */
    size_t half = (b.cap + 4095) / 4096 * 4096;
    uint8_t *shared = o.shared_mem ? ps_mem_alloc(b.comm, o.two_allocs ? half : 2 * half) : NULL;
    uint8_t *shared_out = !o.shared_mem  ? NULL
                          : o.two_allocs ? ps_mem_alloc(b.comm, half)
                          : shared       ? shared + half
                                         : NULL;
    if (o.shared_mem && shared && !ps_mem_is_shared(b.comm, shared) && b.rank == 0)
        fprintf(stderr, "paramsync-bench: --mem shared: the agent does not share this memory; "
                        "collectives copy as with malloc\n");
    int advised = 1;
    b.in = o.shared_mem ? shared : host_alloc(&o, b.cap, &advised);
    b.out = o.shared_mem ? shared_out : host_alloc(&o, b.cap, &advised);
    if (!advised && b.rank == 0)
        fprintf(stderr,
                "paramsync-bench: --mem huge: madvise(MADV_HUGEPAGE) refused (%s); "
                "the buffers may be on small pages\n",
                strerror(errno));
    b.times = malloc((size_t)(o.iters > o.warmup ? o.iters : o.warmup + 1) * sizeof *b.times);
    b.counts = malloc((size_t)b.p * sizeof *b.counts);
    if (!b.in || !b.out || !b.times || !b.counts) {
        fprintf(stderr, "paramsync-bench: rank %d: cannot allocate 2 x %zu bytes\n", b.rank, b.cap);
        return 1;
    }
    memset(b.in, 0, b.cap);
    memset(b.out, 0, b.cap);
    b.outs[0] = b.out;
    if (o.device_mem) {
        void *di = NULL, *dout = NULL;
        rc = ps_gpu_malloc(&di, b.cap);
        if (rc == 0)
            rc = ps_gpu_malloc(&dout, b.cap);
        if (rc < 0) {
            fprintf(stderr, "paramsync-bench: rank %d: --mem device: %s\n", b.rank,
                    rc == PS_EUNAVAIL ? "no usable CUDA device (or a build without CUDA)"
                                      : ps_strerror(rc));
            ps_gpu_free(di);
            free(b.in);
            free(b.out);
            free(b.times);
            free(b.counts);
            ps_finalize(b.comm);
            return rc == PS_EUNAVAIL ? 77 : 1;
        }
        b.dev_in = di;
        b.dev_out = dout;
        dev_copy(&b, b.dev_in, b.in, b.cap);
        dev_copy(&b, b.dev_out, b.out, b.cap);
    }
    for (int k = 1; k < o.inflight && o.want[C_ALL_REDUCE]; k++) {
        b.outs[k] = o.shared_mem ? ps_mem_alloc(b.comm, b.cap) : host_alloc(&o, b.cap, &advised);
        if (!b.outs[k]) {
            fprintf(stderr, "paramsync-bench: rank %d: cannot allocate %d x %zu bytes\n", b.rank,
                    o.inflight, b.cap);
            return 1;
        }
        memset(b.outs[k], 0, b.cap);
    }

    if (b.rank == 0 && o.csv) {
        b.csv = strcmp(o.csv, "-") == 0 ? stdout : fopen(o.csv, "a");
        if (!b.csv) {
            fprintf(stderr, "paramsync-bench: cannot open %s: %s\n", o.csv, strerror(errno));
            return 1;
        }
    }
    if (b.rank == 0)
        print_header(&b);

    int64_t wrong = 0;
    for (int c = 0; c < C_COUNT; c++)
        if (o.want[c])
            wrong += bench_coll(&b, c);

    if (b.rank == 0) {
        printf("# %s: %lld wrong elements in all\n", wrong ? "FAILED" : "OK", (long long)wrong);
        fflush(stdout);
        if (b.csv && b.csv != stdout)
            fclose(b.csv);
    }
    for (int k = 1; k < o.inflight && b.outs[k]; k++) {
        if (o.shared_mem)
            ps_mem_free(b.comm, b.outs[k]);
        else
            free(b.outs[k]);
    }
    if (o.shared_mem) {
        ps_mem_free(b.comm, b.in);
        if (o.two_allocs)
            ps_mem_free(b.comm, b.out);
    } else {
        free(b.in);
        free(b.out);
    }
    ps_gpu_free(b.dev_in);
    ps_gpu_free(b.dev_out);
    rc = ps_finalize(b.comm);
    free(b.times);
    free(b.counts);
    if (rc < 0) {
        fprintf(stderr, "paramsync-bench: rank %d: ps_finalize: %s\n", b.rank, ps_strerror(rc));
        return 1;
    }
    return wrong ? 3 : 0;
}
