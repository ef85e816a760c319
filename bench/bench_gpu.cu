/* paramsync-bench-gpu: GB/s of every (op, dtype) CUDA reduce beside device-to-device cudaMemcpy. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <cuda_runtime.h>

#include <paramsync/gpu.h>
#include <paramsync/reduce.h>

#include "bench_args.h"

/*
 * For each row, on the same device and in the same run: a device-to-device
 * cudaMemcpy of one buffer (2 x bytes moved: read + write), then the reduce
 * (nsrc + 1 buffers moved: every input read, dst written; nsrc == 2 is
 * ps_gpu_reduce, dst += src, in place). GB/s = bytes moved / time, 1e9 bytes.
 * ratio = reduce GB/s / memcpy GB/s: 1.00 means the kernel streams memory as
 * fast as the copy engine path of cudaMemcpy does, which is the ceiling of a
 * memory-bound kernel. Times come from CUDA events around reps back-to-back
 * launches after one warm-up, so launch overhead is amortized; a row is
 * verified against the CPU engine before it is timed.
 *
 * Exit status: 0; 77 after printing SKIPPED when there is no CUDA device; 1 on
 * an error or a wrong result; 2 on bad usage.
 */

static const char usage[] =
    "usage: paramsync-bench-gpu [options]\n"
    "  --size-mib N   bytes per buffer, in MiB (default 256)\n"
    "  --reps N       timed launches per row, averaged (default 20)\n"
    "  --nsrc N       inputs per reduce: 2 = ps_gpu_reduce (dst += src), else\n"
    "                 ps_gpu_reduce_multi into a separate dst (default 2, at most 16)\n"
    "  --op LIST      comma-separated: SUM,PRODUCT,MIN,MAX,BAND,BOR,BXOR,AVG (default: all)\n"
    "  --dtype LIST   comma-separated: float32,...,bool (default: all)\n"
    "  --device N     CUDA device (default 0)\n"
    "  --quick        16 MiB, 3 reps: a smoke run\n"
    "  --help\n";

#define MAX_NSRC     16
#define VERIFY_COUNT ((size_t)1 << 16)

typedef struct options {
    size_t bytes;
    int reps;
    int nsrc;
    int device;
    int want_op[PS_OP_COUNT];
    int want_dtype[PS_DTYPE_COUNT];
} options_t;

/* Prints a CUDA failure with its call site and returns 1; 0 when e is cudaSuccess. */
static int cuda_failed(cudaError_t e, const char *what)
{
    if (e == cudaSuccess)
        return 0;
    fprintf(stderr, "bench-gpu: %s: %s\n", what, cudaGetErrorString(e));
    return 1;
}

/* Parses argv into o. Returns 0, 1 for --help, or -1 after printing the problem. */
static int parse_args(int argc, char **argv, options_t *o)
{
    o->bytes = (size_t)256 << 20;
    o->reps = 20;
    o->nsrc = 2;
    o->device = 0;
    for (int i = 0; i < PS_OP_COUNT; i++)
        o->want_op[i] = 1;
    for (int i = 0; i < PS_DTYPE_COUNT; i++)
        o->want_dtype[i] = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--help") == 0)
            return 1;
        if (strcmp(a, "--quick") == 0) {
            o->bytes = (size_t)16 << 20;
            o->reps = 3;
            continue;
        }
        if (v == NULL) {
            fprintf(stderr, "unknown option or missing value: %s\n", a);
            return -1;
        }
        i++;
        if (strcmp(a, "--size-mib") == 0 && atol(v) > 0)
            o->bytes = (size_t)atol(v) << 20;
        else if (strcmp(a, "--reps") == 0 && atoi(v) > 0)
            o->reps = atoi(v);
        else if (strcmp(a, "--nsrc") == 0 && atoi(v) >= 1 && atoi(v) <= MAX_NSRC)
            o->nsrc = atoi(v);
        else if (strcmp(a, "--device") == 0 && atoi(v) >= 0)
            o->device = atoi(v);
        else if (strcmp(a, "--op") == 0) {
            if (ps_bench_parse_list(v, o->want_op, PS_OP_COUNT, ps_bench_op_name, "op") != 0)
                return -1;
        } else if (strcmp(a, "--dtype") == 0) {
            if (ps_bench_parse_list(v, o->want_dtype, PS_DTYPE_COUNT, ps_bench_dtype_name,
                                    "dtype") != 0)
                return -1;
        } else {
            fprintf(stderr, "bad option or value: %s %s\n", a, v);
            return -1;
        }
    }
    return 0;
}

/* Runs the reduce of one row once on the default stream. Returns 0 or a PS_E* code. */
static int reduce_once(const options_t *o, ps_op_t op, ps_dtype_t dt, void *dst,
                       const void *const *srcs, size_t count)
{
    if (o->nsrc == 2)
        return ps_gpu_reduce(op, dt, (void *)srcs[0], srcs[1], count, NULL);
    return ps_gpu_reduce_multi(op, dt, dst, srcs, (size_t)o->nsrc, count, NULL);
}

/*
 * Checks the row's kernel on VERIFY_COUNT elements of deterministic bytes
 * against the CPU engine. Returns 0 when equal, 1 otherwise.
 */
static int verify_row(const options_t *o, ps_op_t op, ps_dtype_t dt, void *dst, void *const *dev,
                      size_t count)
{
    size_t n = count < VERIFY_COUNT ? count : VERIFY_COUNT;
    size_t bytes = n * ps_dtype_size(dt);
    int rc = 1;
    unsigned char *host[MAX_NSRC] = {NULL};
    unsigned char *want = (unsigned char *)malloc(bytes);
    unsigned char *got = (unsigned char *)malloc(bytes);
    const void *dsrcs[MAX_NSRC];
    uint32_t x = 12345;
    if (want == NULL || got == NULL)
        goto out;
    for (int j = 0; j < o->nsrc; j++) {
        host[j] = (unsigned char *)malloc(bytes);
        if (host[j] == NULL)
            goto out;
        for (size_t i = 0; i < bytes; i++) {
            x = x * 1664525u + 1013904223u; /* an LCG: varied bytes, some NaN and Inf patterns */
            host[j][i] = (unsigned char)(x >> 24);
        }
        if (cuda_failed(cudaMemcpy(dev[j], host[j], bytes, cudaMemcpyHostToDevice), "verify copy"))
            goto out;
        dsrcs[j] = dev[j];
    }
    if (reduce_once(o, op, dt, dst, dsrcs, n) != 0 ||
        cuda_failed(cudaDeviceSynchronize(), "verify"))
        goto out;
    memcpy(want, host[0], bytes);
    if (o->nsrc == 2)
        (void)ps_reduce(op, dt, want, host[1], n);
    else
        (void)ps_reduce_multi(op, dt, want, (const void *const *)host, (size_t)o->nsrc, n);
    if (cuda_failed(cudaMemcpy(got, o->nsrc == 2 ? dev[0] : dst, bytes, cudaMemcpyDeviceToHost),
                    "verify fetch"))
        goto out;
    rc = memcmp(got, want, bytes) != 0;
    if (rc)
        fprintf(stderr, "bench-gpu: %s %s: device result differs from the CPU engine\n",
                ps_op_name(op), ps_dtype_name(dt));
out:
    for (int j = 0; j < o->nsrc; j++)
        free(host[j]);
    free(want);
    free(got);
    return rc;
}

/* Average seconds of reps back-to-back runs of the row (memcpy when op < 0). -1 on error. */
static double time_row(const options_t *o, int op, ps_dtype_t dt, void *dst,
                       const void *const *srcs, size_t count, cudaEvent_t start, cudaEvent_t stop)
{
    size_t bytes = count * ps_dtype_size(dt);
    for (int r = -1; r < o->reps; r++) { /* r == -1: the warm-up */
        if (r == 0 && cuda_failed(cudaEventRecord(start, NULL), "event"))
            return -1;
        int err = op < 0 ? (cudaMemcpyAsync(dst, srcs[0], bytes, cudaMemcpyDeviceToDevice, NULL) ==
                                    cudaSuccess
                                ? 0
                                : PS_EINTERNAL)
                         : reduce_once(o, (ps_op_t)op, dt, dst, srcs, count);
        if (err != 0) {
            fprintf(stderr, "bench-gpu: launch failed: %s\n", ps_strerror(err));
            return -1;
        }
    }
    float ms = 0;
    if (cuda_failed(cudaEventRecord(stop, NULL), "event") ||
        cuda_failed(cudaEventSynchronize(stop), "run") ||
        cuda_failed(cudaEventElapsedTime(&ms, start, stop), "event time"))
        return -1;
    return (double)ms * 1e-3 / o->reps;
}

int main(int argc, char **argv)
{
    options_t o;
    int parsed = parse_args(argc, argv, &o);
    if (parsed != 0) {
        fputs(usage, parsed > 0 ? stdout : stderr);
        return parsed > 0 ? 0 : 2;
    }
    int ndev;
    int err = ps_gpu_device_count(&ndev);
    if (err != 0) {
        printf("SKIPPED: no CUDA device (%s): nothing was measured\n", ps_strerror(err));
        return 77;
    }
    if (o.device >= ndev || ps_gpu_set_device(o.device) != 0) {
        fprintf(stderr, "bench-gpu: no device %d (%d present)\n", o.device, ndev);
        return 2;
    }
    if (ps_reduce_set_path(PS_PATH_SCALAR) != 0)
        return 1;

    struct cudaDeviceProp prop;
    if (cuda_failed(cudaGetDeviceProperties(&prop, o.device), "device properties"))
        return 1;
    printf("# device %d: %s, sm_%d%d, %d SMs, %.1f GiB\n", o.device, prop.name, prop.major,
           prop.minor, prop.multiProcessorCount, (double)prop.totalGlobalMem / (1 << 30));
    printf("# %zu MiB per buffer, %d inputs (%s), %d reps; GB/s = 1e9 bytes moved per second\n",
           o.bytes >> 20, o.nsrc, o.nsrc == 2 ? "ps_gpu_reduce, in place" : "ps_gpu_reduce_multi",
           o.reps);
    printf("%-8s %-9s %12s %12s %12s %12s %7s\n", "op", "dtype", "reduce_us", "reduce_GB/s",
           "memcpy_us", "memcpy_GB/s", "ratio");

    int rc = 0;
    void *dev[MAX_NSRC] = {NULL};
    void *dst = NULL;
    cudaEvent_t start = NULL, stop = NULL;
    for (int j = 0; j < o.nsrc; j++)
        if (cuda_failed(cudaMalloc(&dev[j], o.bytes), "cudaMalloc") ||
            cuda_failed(cudaMemset(dev[j], 0x3C + j, o.bytes), "cudaMemset")) {
            rc = 1;
            goto out;
        }
    if (cuda_failed(cudaMalloc(&dst, o.bytes), "cudaMalloc") ||
        cuda_failed(cudaEventCreate(&start), "event") ||
        cuda_failed(cudaEventCreate(&stop), "event")) {
        rc = 1;
        goto out;
    }
    for (int dti = 0; dti < PS_DTYPE_COUNT && rc == 0; dti++) {
        ps_dtype_t dt = (ps_dtype_t)dti;
        if (!o.want_dtype[dt])
            continue;
        size_t count = o.bytes / ps_dtype_size(dt);
        size_t bytes = count * ps_dtype_size(dt);
        for (int opi = 0; opi < PS_OP_COUNT && rc == 0; opi++) {
            ps_op_t op = (ps_op_t)opi;
            if (!o.want_op[op] || ps_op_check(op, dt) != 0)
                continue;
            if (verify_row(&o, op, dt, dst, dev, count) != 0) {
                rc = 1;
                break;
            }
            const void *srcs[MAX_NSRC];
            for (int j = 0; j < o.nsrc; j++)
                srcs[j] = dev[j];
            double t_copy = time_row(&o, -1, dt, dst, srcs, count, start, stop);
            double t_reduce = time_row(&o, op, dt, dst, srcs, count, start, stop);
            if (t_copy <= 0 || t_reduce <= 0) {
                rc = 1;
                break;
            }
            double bw_copy = 2.0 * (double)bytes / t_copy / 1e9;
            double bw_reduce = (double)(o.nsrc + 1) * (double)bytes / t_reduce / 1e9;
            printf("%-8s %-9s %12.1f %12.1f %12.1f %12.1f %7.2f\n", ps_op_name(op),
                   ps_dtype_name(dt), t_reduce * 1e6, bw_reduce, t_copy * 1e6, bw_copy,
                   bw_reduce / bw_copy);
            fflush(stdout);
        }
    }
out:
    for (int j = 0; j < o.nsrc; j++)
        cudaFree(dev[j]);
    cudaFree(dst);
    if (start != NULL)
        cudaEventDestroy(start);
    if (stop != NULL)
        cudaEventDestroy(stop);
    return rc;
}
