/* GPU tests of gpu/: every kernel on a device, bit for bit against the CPU engine; SKIPPED without
 * one. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmocka.h>

#include <paramsync/gpu.h>
#include <paramsync/reduce.h>

#include "test_data.h"

/*
 * Needs a CUDA device: without one main() prints SKIPPED and exits 77, which
 * ctest reports as skipped (SKIP_RETURN_CODE), never as passed. Only the
 * public API of paramsync/gpu.h is used, so this also builds against the
 * stub, where it always skips.
 *
 * Expected values come from the CPU engine's scalar path (ps_reduce,
 * ps_reduce_multi, ps_reduce_scale). Device buffers carry guard bytes on
 * both sides, checked after every kernel, so a stray write fails the test.
 */

/* Odd sizes around every vector width and the grid-stride boundary, and one of 4 MiB-ish. */
static const size_t counts[] = {1, 2, 7, 15, 16, 17, 31, 33, 255, 1000, 4099, (1u << 20) + 3};
#define N_COUNTS   (sizeof counts / sizeof counts[0])
#define MAX_COUNT  ((size_t)(1u << 20) + 3)
#define MAX_SRCS   5
#define GUARD      256 /* bytes on each side of a device buffer; keeps the data 16-byte aligned */
#define GUARD_BYTE 0xA5

static const ps_op_t all_ops[] = {PS_SUM,  PS_PRODUCT, PS_MIN,  PS_MAX,
                                  PS_BAND, PS_BOR,     PS_BXOR, PS_AVG};
static const ps_dtype_t all_dtypes[] = {PS_FLOAT32, PS_FLOAT64, PS_FLOAT16, PS_BFLOAT16, PS_INT8,
                                        PS_UINT8,   PS_INT16,   PS_INT32,   PS_INT64,    PS_BOOL};
#define N_OPS    (sizeof all_ops / sizeof all_ops[0])
#define N_DTYPES (sizeof all_dtypes / sizeof all_dtypes[0])

/* ---- device buffers with guards */

typedef struct dbuf {
    unsigned char *base; /* device */
    size_t bytes;        /* data bytes, between the guards */
} dbuf_t;

static void dbuf_alloc(dbuf_t *b, size_t bytes)
{
    void *p = NULL;
    assert_int_equal(ps_gpu_malloc(&p, bytes + 2 * GUARD), 0);
    b->base = p;
    b->bytes = bytes;
}

static void dbuf_free(dbuf_t *b)
{
    ps_gpu_free(b->base);
}

/* The data pointer, offset bytes past the guard (offset 0: 256-byte aligned). */
static void *dbuf_data(const dbuf_t *b, size_t offset)
{
    return b->base + GUARD + offset;
}

/* Fills the whole buffer with the guard byte, then the data at offset with n bytes of host. */
static void dbuf_load(dbuf_t *b, size_t offset, const void *host, size_t n)
{
    unsigned char *tmp = malloc(b->bytes + 2 * GUARD);
    assert_non_null(tmp);
    memset(tmp, GUARD_BYTE, b->bytes + 2 * GUARD);
    memcpy(tmp + GUARD + offset, host, n);
    assert_int_equal(ps_gpu_memcpy_async(b->base, tmp, b->bytes + 2 * GUARD, NULL), 0);
    assert_int_equal(ps_gpu_stream_synchronize(NULL), 0);
    free(tmp);
}

/* Copies n bytes at offset back to host, checking every byte outside them is still a guard. */
static void dbuf_fetch(const dbuf_t *b, size_t offset, void *host, size_t n)
{
    unsigned char *tmp = malloc(b->bytes + 2 * GUARD);
    assert_non_null(tmp);
    assert_int_equal(ps_gpu_memcpy_async(tmp, b->base, b->bytes + 2 * GUARD, NULL), 0);
    assert_int_equal(ps_gpu_stream_synchronize(NULL), 0);
    for (size_t i = 0; i < b->bytes + 2 * GUARD; i++)
        if ((i < GUARD + offset || i >= GUARD + offset + n) && tmp[i] != GUARD_BYTE)
            fail_msg("stray write at byte %td of the data",
                     (ptrdiff_t)i - (ptrdiff_t)(GUARD + offset));
    memcpy(host, tmp + GUARD + offset, n);
    free(tmp);
}

/* ---- per-dtype fixture: host inputs, device inputs, room for results */

typedef struct fixture {
    ps_dtype_t dtype;
    size_t size;
    void *host[MAX_SRCS];
    dbuf_t dev[MAX_SRCS];
    dbuf_t out;
    void *got, *want;
} fixture_t;

static void fixture_make(fixture_t *f, ps_dtype_t dt)
{
    f->dtype = dt;
    f->size = ps_dtype_size(dt);
    size_t bytes = MAX_COUNT * f->size;
    for (int k = 0; k < MAX_SRCS; k++) {
        f->host[k] = malloc(bytes);
        assert_non_null(f->host[k]);
        test_data_fill(dt, f->host[k], k > 0 ? f->host[0] : NULL, MAX_COUNT);
        dbuf_alloc(&f->dev[k], bytes + 16);
    }
    dbuf_alloc(&f->out, bytes + 16);
    f->got = malloc(bytes);
    f->want = malloc(bytes);
    assert_true(f->got != NULL && f->want != NULL);
}

static void fixture_free(fixture_t *f)
{
    for (int k = 0; k < MAX_SRCS; k++) {
        free(f->host[k]);
        dbuf_free(&f->dev[k]);
    }
    dbuf_free(&f->out);
    free(f->got);
    free(f->want);
}

/*
 * One case: nsrc inputs of count elements at byte offset off (0: the
 * vector path; the element size: element loads only), reduced on the device
 * into a separate dst or in place into input 0, compared with the CPU.
 * multi selects ps_gpu_reduce_multi (else ps_gpu_reduce, nsrc == 2).
 */
static void run_case(fixture_t *f, ps_op_t op, size_t nsrc, size_t count, size_t off, int in_place,
                     int multi, ps_gpu_stream_t stream)
{
    size_t bytes = count * f->size;
    const void *dsrcs[MAX_SRCS];
    for (size_t j = 0; j < nsrc; j++) {
        dbuf_load(&f->dev[j], off, f->host[j], bytes);
        dsrcs[j] = dbuf_data(&f->dev[j], off);
    }
    dbuf_t *out = in_place ? &f->dev[0] : &f->out;
    if (!in_place)
        dbuf_load(out, off, f->host[0], 0);
    void *dst = dbuf_data(out, off);

    memcpy(f->want, f->host[0], bytes);
    if (multi) {
        assert_int_equal(
            ps_reduce_multi(op, f->dtype, f->want, (const void *const *)f->host, nsrc, count), 0);
        assert_int_equal(ps_gpu_reduce_multi(op, f->dtype, dst, dsrcs, nsrc, count, stream), 0);
    } else {
        assert_int_equal(ps_reduce(op, f->dtype, f->want, f->host[1], count), 0);
        if (!in_place)
            dbuf_load(out, off, f->host[0], bytes); /* ps_gpu_reduce accumulates into dst */
        assert_int_equal(ps_gpu_reduce(op, f->dtype, dst, dsrcs[1], count, stream), 0);
    }
    assert_int_equal(ps_gpu_stream_synchronize(stream), 0);
    dbuf_fetch(out, off, f->got, bytes);
    char what[128];
    snprintf(what, sizeof what, "%s %s nsrc=%zu count=%zu offset=%zu%s", multi ? "multi" : "reduce",
             ps_op_name(op), nsrc, count, off, in_place ? " in place" : "");
    assert_true(test_data_same(f->got, f->want, count, f->dtype, what));
}

static int setup(void **state)
{
    (void)state;
    return ps_reduce_set_path(PS_PATH_SCALAR);
}

/* ---- tests */

static void test_reduce_grid(void **state)
{
    (void)state;
    test_data_seed("reduce_grid");
    for (size_t t = 0; t < N_DTYPES; t++) {
        fixture_t f;
        fixture_make(&f, all_dtypes[t]);
        for (size_t o = 0; o < N_OPS; o++) {
            if (ps_op_check(all_ops[o], f.dtype) != 0)
                continue;
            for (size_t c = 0; c < N_COUNTS; c++)
                for (int misaligned = 0; misaligned < 2; misaligned++)
                    run_case(&f, all_ops[o], 2, counts[c], misaligned ? f.size : 0, c % 2, 0, NULL);
        }
        fixture_free(&f);
    }
}

static void test_multi_grid(void **state)
{
    (void)state;
    test_data_seed("multi_grid");
    for (size_t t = 0; t < N_DTYPES; t++) {
        fixture_t f;
        fixture_make(&f, all_dtypes[t]);
        for (size_t o = 0; o < N_OPS; o++) {
            if (ps_op_check(all_ops[o], f.dtype) != 0)
                continue;
            for (size_t nsrc = 1; nsrc <= MAX_SRCS; nsrc++)
                for (size_t c = 0; c < N_COUNTS; c++)
                    run_case(&f, all_ops[o], nsrc, counts[c], (c % 3 == 0) ? f.size : 0, nsrc % 2,
                             1, NULL);
        }
        fixture_free(&f);
    }
}

static void test_scale(void **state)
{
    (void)state;
    test_data_seed("scale");
    const ps_dtype_t floats[] = {PS_FLOAT32, PS_FLOAT64, PS_FLOAT16, PS_BFLOAT16};
    const uint64_t divisors[] = {1, 3, 7, (1ull << 24) + 1, UINT64_MAX};
    for (size_t t = 0; t < 4; t++) {
        fixture_t f;
        fixture_make(&f, floats[t]);
        for (size_t k = 0; k < sizeof divisors / sizeof divisors[0]; k++)
            for (size_t c = 0; c < N_COUNTS; c++) {
                size_t count = counts[c], bytes = count * f.size, off = (c % 2) ? f.size : 0;
                dbuf_load(&f.dev[0], off, f.host[0], bytes);
                memcpy(f.want, f.host[0], bytes);
                assert_int_equal(ps_reduce_scale(f.dtype, f.want, count, divisors[k]), 0);
                assert_int_equal(
                    ps_gpu_scale(f.dtype, dbuf_data(&f.dev[0], off), count, divisors[k], NULL), 0);
                assert_int_equal(ps_gpu_stream_synchronize(NULL), 0);
                dbuf_fetch(&f.dev[0], off, f.got, bytes);
                assert_true(test_data_same(f.got, f.want, count, f.dtype, "scale"));
            }
        fixture_free(&f);
    }
}

/*
 * Every float16 and bfloat16 value as the first input, against random second
 * and third inputs rich in special values, through every float op and a
 * scale: each conversion the device makes (its load of any 16-bit pattern,
 * its rounding of sums, products and quotients back) equals the CPU's.
 */
static void test_half_exhaustive(void **state)
{
    (void)state;
    test_data_seed("half_exhaustive");
    const ps_dtype_t halves[] = {PS_FLOAT16, PS_BFLOAT16};
    const ps_op_t ops[] = {PS_SUM, PS_PRODUCT, PS_MIN, PS_MAX, PS_AVG};
    const size_t count = 1u << 16;
    for (size_t t = 0; t < 2; t++) {
        fixture_t f;
        fixture_make(&f, halves[t]);
        uint16_t *first = f.host[0];
        for (size_t i = 0; i < count; i++)
            first[i] = (uint16_t)i;
        for (size_t o = 0; o < sizeof ops / sizeof ops[0]; o++)
            for (size_t nsrc = 1; nsrc <= 3; nsrc++)
                run_case(&f, ops[o], nsrc, count, 0, 0, 1, NULL);
        const uint64_t divisors[] = {3, 7, 1000};
        for (size_t k = 0; k < 3; k++) {
            dbuf_load(&f.dev[0], 0, f.host[0], count * f.size);
            memcpy(f.want, f.host[0], count * f.size);
            assert_int_equal(ps_reduce_scale(f.dtype, f.want, count, divisors[k]), 0);
            assert_int_equal(
                ps_gpu_scale(f.dtype, dbuf_data(&f.dev[0], 0), count, divisors[k], NULL), 0);
            assert_int_equal(ps_gpu_stream_synchronize(NULL), 0);
            dbuf_fetch(&f.dev[0], 0, f.got, count * f.size);
            assert_true(test_data_same(f.got, f.want, count, f.dtype, "scale, every value"));
        }
        fixture_free(&f);
    }
}

/* The same kernels on a stream of the caller's, and on two streams at once. */
static void test_streams(void **state)
{
    (void)state;
    test_data_seed("streams");
    ps_gpu_stream_t s1, s2;
    assert_int_equal(ps_gpu_stream_create(&s1), 0);
    assert_int_equal(ps_gpu_stream_create(&s2), 0);
    fixture_t f;
    fixture_make(&f, PS_BFLOAT16);
    run_case(&f, PS_AVG, 3, MAX_COUNT, 0, 0, 1, s1);
    run_case(&f, PS_MAX, 2, 4099, 0, 1, 0, s2);
    fixture_free(&f);
    ps_gpu_stream_destroy(s1);
    ps_gpu_stream_destroy(s2);
}

static void test_pointers_and_errors(void **state)
{
    (void)state;
    int n, is_dev = -1;
    assert_int_equal(ps_gpu_device_count(&n), 0);
    assert_true(n >= 1);
    int dev = -1;
    assert_int_equal(ps_gpu_get_device(&dev), 0);
    assert_int_equal(ps_gpu_set_device(n), PS_EINVAL);
    assert_int_equal(ps_gpu_set_device(dev), 0);

    void *d = NULL, *h = NULL;
    assert_int_equal(ps_gpu_malloc(&d, 4096), 0);
    assert_int_equal(ps_gpu_host_alloc(&h, 4096), 0);
    assert_int_equal(ps_gpu_is_device_pointer(d, &is_dev), 0);
    assert_int_equal(is_dev, 1);
    assert_int_equal(ps_gpu_is_device_pointer((char *)d + 100, &is_dev), 0);
    assert_int_equal(is_dev, 1);
    assert_int_equal(ps_gpu_is_device_pointer(h, &is_dev), 0);
    assert_int_equal(is_dev, 0);
    assert_int_equal(ps_gpu_is_device_pointer(&n, &is_dev), 0);
    assert_int_equal(is_dev, 0);
    /* Misaligned device pointers are refused before any launch, which would fault. */
    assert_int_equal(ps_gpu_reduce(PS_SUM, PS_FLOAT32, (char *)d + 2, d, 4, NULL), PS_EINVAL);
    /* A host buffer given to the stager as device memory would be, and is refused. */
    ps_gpu_stager_t *st;
    assert_int_equal(ps_gpu_stager_create(&st, dev, 2, 4096), 0);
    int32_t out[4];
    const void *srcs[2] = {h, d};
    assert_int_equal(ps_gpu_reduce_host(st, PS_SUM, PS_INT32, out, srcs, 2, 4), PS_EINVAL);
    ps_gpu_stager_destroy(st);
    ps_gpu_free(d);
    ps_gpu_host_free(h);
}

/* CUDA IPC descriptions: the allocation an interior pointer lies in, host
 * memory refused, a process's own handle not opened here (another process
 * opens it: integration.device's peer copies). */
static void test_ipc_export(void **state)
{
    (void)state;
    void *d = NULL, *h = NULL;
    assert_int_equal(ps_gpu_malloc(&d, (size_t)3 << 20), 0);
    assert_int_equal(ps_gpu_host_alloc(&h, 4096), 0);
    ps_gpu_ipc_t a, b;
    memset(&a, 0, sizeof a);
    assert_int_equal(ps_gpu_ipc_export(d, &a), 0);
    assert_int_equal(ps_gpu_ipc_export((char *)d + 12345, &b), 0);
    assert_int_equal(a.base, (uint64_t)(uintptr_t)d);
    assert_int_equal(b.base, (uint64_t)(uintptr_t)d);
    assert_true(a.size >= ((size_t)3 << 20));
    assert_memory_equal(a.handle, b.handle, sizeof a.handle);
    memcpy(&b, &a, sizeof b);
    assert_int_equal(ps_gpu_ipc_export(h, &b), PS_EINVAL);
    int n = 0;
    assert_int_equal(ps_gpu_ipc_export(&n, &b), PS_EINVAL);
    assert_memory_equal(&a, &b, sizeof a); /* untouched by a refusal */
    void *at = &n;
    assert_int_equal(ps_gpu_ipc_open(&a, &at), PS_EINVAL);
    assert_ptr_equal(at, &n);
    assert_int_equal(ps_gpu_fence(), 0);
    ps_gpu_free(d);
    ps_gpu_host_free(h);
}

/*
 * ps_gpu_reduce_host: pageable, pinned and mixed host inputs, in place or
 * not, small chunks so that a run crosses many chunk (and slot) boundaries,
 * against ps_reduce_multi.
 */
static void test_reduce_host(void **state)
{
    (void)state;
    test_data_seed("reduce_host");
    int dev;
    assert_int_equal(ps_gpu_get_device(&dev), 0);
    const size_t chunks[] = {1024, 65536 + 256, 0}; /* 0: the default, 4 MiB */
    const size_t count = 100003;
    for (size_t t = 0; t < N_DTYPES; t++) {
        ps_dtype_t dt = all_dtypes[t];
        size_t bytes = count * ps_dtype_size(dt);
        void *pageable[MAX_SRCS], *pinned[MAX_SRCS];
        void *want = malloc(bytes), *got_pageable = malloc(bytes), *got_pinned;
        assert_true(want != NULL && got_pageable != NULL);
        assert_int_equal(ps_gpu_host_alloc(&got_pinned, bytes), 0);
        for (int k = 0; k < MAX_SRCS; k++) {
            pageable[k] = malloc(bytes);
            assert_non_null(pageable[k]);
            test_data_fill(dt, pageable[k], k > 0 ? pageable[0] : NULL, count);
            assert_int_equal(ps_gpu_host_alloc(&pinned[k], bytes), 0);
            memcpy(pinned[k], pageable[k], bytes);
        }
        for (size_t c = 0; c < sizeof chunks / sizeof chunks[0]; c++) {
            ps_gpu_stager_t *st;
            assert_int_equal(ps_gpu_stager_create(&st, dev, MAX_SRCS, chunks[c]), 0);
            for (size_t o = 0; o < N_OPS; o++) {
                ps_op_t op = all_ops[o];
                if (ps_op_check(op, dt) != 0)
                    continue;
                for (size_t nsrc = 1; nsrc <= MAX_SRCS; nsrc += 2) {
                    assert_int_equal(
                        ps_reduce_multi(op, dt, want, (const void *const *)pageable, nsrc, count),
                        0);
                    /* Mixed: even inputs pinned, odd ones pageable; dst alternates too. */
                    const void *mixed[MAX_SRCS];
                    for (size_t j = 0; j < nsrc; j++)
                        mixed[j] = j % 2 ? pageable[j] : pinned[j];
                    void *dst = nsrc % 4 == 1 ? got_pinned : got_pageable;
                    assert_int_equal(ps_gpu_reduce_host(st, op, dt, dst, mixed, nsrc, count), 0);
                    assert_true(test_data_same(dst, want, count, dt, "reduce_host mixed"));
                    /* In place into a pinned input 0, then a pageable one. */
                    for (int pin = 0; pin < 2; pin++) {
                        void *io = malloc(bytes);
                        assert_non_null(io);
                        void *first = pin ? pinned[0] : io;
                        if (!pin)
                            memcpy(io, pageable[0], bytes);
                        const void *srcs[MAX_SRCS];
                        srcs[0] = first;
                        for (size_t j = 1; j < nsrc; j++)
                            srcs[j] = pageable[j];
                        assert_int_equal(ps_gpu_reduce_host(st, op, dt, first, srcs, nsrc, count),
                                         0);
                        assert_true(test_data_same(first, want, count, dt, "reduce_host in place"));
                        if (pin)
                            memcpy(pinned[0], pageable[0], bytes);
                        free(io);
                    }
                }
            }
            ps_gpu_stager_destroy(st);
        }
        for (int k = 0; k < MAX_SRCS; k++) {
            free(pageable[k]);
            ps_gpu_host_free(pinned[k]);
        }
        free(want);
        free(got_pageable);
        ps_gpu_host_free(got_pinned);
    }
}

/*
 * The agent's case: inputs and output in a shared mapping of a POSIX shm
 * file that ps_gpu_host_register pinned, so the stager's DMA reads and
 * writes them in place. Same bits as the CPU; registering twice, or
 * unregistering what is not registered, is PS_EINVAL; after unregistering
 * the same memory is staged and still reduces right.
 */
static void test_reduce_host_registered(void **state)
{
    (void)state;
    test_data_seed("reduce_host_registered");
    int dev;
    assert_int_equal(ps_gpu_get_device(&dev), 0);
    const size_t count = (3u << 20) / 4 + 5; /* a step and more, not a multiple of the chunk */
    char name[64];
    snprintf(name, sizeof name, "/ps-gpu-test-%d", (int)getpid());
    for (size_t t = 0; t < N_DTYPES; t++) {
        ps_dtype_t dt = all_dtypes[t];
        size_t bytes = count * ps_dtype_size(dt);
        size_t stride = (bytes + 4095) & ~(size_t)4095;
        size_t len = stride * (MAX_SRCS + 1);
        int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
        assert_true(fd >= 0);
        shm_unlink(name);
        assert_int_equal(ftruncate(fd, (off_t)len), 0);
        unsigned char *seg = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        assert_true(seg != MAP_FAILED);
        close(fd);
        void *want = malloc(bytes);
        assert_non_null(want);
        const void *srcs[MAX_SRCS];
        for (int k = 0; k < MAX_SRCS; k++) {
            srcs[k] = seg + (size_t)k * stride;
            test_data_fill(dt, seg + (size_t)k * stride, k > 0 ? seg : NULL, count);
        }
        unsigned char *out = seg + (size_t)MAX_SRCS * stride;
        assert_int_equal(ps_gpu_host_register(seg, len), 0);
        assert_int_equal(ps_gpu_host_register(seg, len), PS_EINVAL);
        int is_dev = -1;
        assert_int_equal(ps_gpu_is_device_pointer(out, &is_dev), 0);
        assert_int_equal(is_dev, 0);
        ps_gpu_stager_t *st;
        assert_int_equal(ps_gpu_stager_create(&st, dev, MAX_SRCS, 0), 0);
        for (int pinned = 1; pinned >= 0; pinned--) {
            for (size_t o = 0; o < N_OPS; o++) {
                ps_op_t op = all_ops[o];
                if (ps_op_check(op, dt) != 0)
                    continue;
                assert_int_equal(ps_reduce_multi(op, dt, want, srcs, MAX_SRCS, count), 0);
                memset(out, 0x5A, bytes);
                assert_int_equal(ps_gpu_reduce_host(st, op, dt, out, srcs, MAX_SRCS, count), 0);
                assert_true(test_data_same(out, want, count, dt,
                                           pinned ? "registered shm" : "shm after unregister"));
            }
            if (pinned) {
                assert_int_equal(ps_gpu_host_unregister(seg), 0);
                assert_int_equal(ps_gpu_host_unregister(seg), PS_EINVAL);
            }
        }
        ps_gpu_stager_destroy(st);
        free(want);
        munmap(seg, len);
    }
}

/*
 * ps_gpu_reduce_host_dsts: one result into several host buffers at once,
 * pinned (the DMA writes them), pageable (copied from the stager's pinned
 * buffer), in a registered shm mapping, and in place over inputs other than
 * the first (pageable and registered), across chunk boundaries, against
 * ps_reduce_multi; and the refusals, with nothing written: dsts that
 * overlap, a dst that overlaps an input other than exactly, none, too many.
 */
static void test_reduce_host_dsts(void **state)
{
    (void)state;
    test_data_seed("reduce_host_dsts");
    int dev;
    assert_int_equal(ps_gpu_get_device(&dev), 0);
    const size_t count = 100003;
    const ps_dtype_t dtypes[] = {PS_FLOAT32, PS_BFLOAT16, PS_INT8, PS_FLOAT64};
    char name[64];
    snprintf(name, sizeof name, "/ps-gpu-test-dsts-%d", (int)getpid());
    ps_gpu_stager_t *st;
    assert_int_equal(ps_gpu_stager_create(&st, dev, MAX_SRCS, 65536 + 256), 0);
    for (size_t t = 0; t < sizeof dtypes / sizeof dtypes[0]; t++) {
        ps_dtype_t dt = dtypes[t];
        size_t bytes = count * ps_dtype_size(dt);
        size_t stride = (bytes + 4095) & ~(size_t)4095;
        int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
        assert_true(fd >= 0);
        shm_unlink(name);
        assert_int_equal(ftruncate(fd, (off_t)(2 * stride)), 0);
        unsigned char *seg = mmap(NULL, 2 * stride, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        assert_true(seg != MAP_FAILED);
        close(fd);
        assert_int_equal(ps_gpu_host_register(seg, 2 * stride), 0);
        void *orig[3], *want = malloc(bytes), *pageable_in = malloc(bytes);
        void *pageable_out = malloc(bytes), *pinned_in, *pinned_out;
        assert_true(want != NULL && pageable_in != NULL && pageable_out != NULL);
        assert_int_equal(ps_gpu_host_alloc(&pinned_in, bytes), 0);
        assert_int_equal(ps_gpu_host_alloc(&pinned_out, bytes), 0);
        for (int k = 0; k < 3; k++) {
            orig[k] = malloc(bytes);
            assert_non_null(orig[k]);
            test_data_fill(dt, orig[k], k > 0 ? orig[0] : NULL, count);
        }
        unsigned char *shm_in = seg, *shm_out = seg + stride;
        const void *srcs[3] = {pinned_in, pageable_in, shm_in};
        for (size_t o = 0; o < N_OPS; o++) {
            ps_op_t op = all_ops[o];
            if (ps_op_check(op, dt) != 0)
                continue;
            memcpy(pinned_in, orig[0], bytes);
            memcpy(pageable_in, orig[1], bytes);
            memcpy(shm_in, orig[2], bytes);
            assert_int_equal(ps_reduce_multi(op, dt, want, (const void *const *)orig, 3, count), 0);
            memset(pinned_out, 0x5A, bytes);
            memset(pageable_out, 0x5A, bytes);
            memset(shm_out, 0x5A, bytes);
            void *dsts[5] = {pinned_out, pageable_out, shm_out, pageable_in, shm_in};
            assert_int_equal(ps_gpu_reduce_host_dsts(st, op, dt, dsts, 5, srcs, 3, count), 0);
            static const char *const what[5] = {
                "dsts: pinned", "dsts: pageable", "dsts: registered shm",
                "dsts: in place, pageable input 1", "dsts: in place, registered input 2"};
            for (int i = 0; i < 5; i++)
                assert_true(test_data_same(dsts[i], want, count, dt, what[i]));
        }
        /* Refused before anything is written. */
        memset(pinned_out, 0x5A, bytes);
        memset(pageable_out, 0x5A, bytes);
        unsigned char *po = pinned_out;
        void *overlapping[2] = {po, po + ps_dtype_size(dt)};
        assert_int_equal(ps_gpu_reduce_host_dsts(st, PS_SUM, dt, overlapping, 2, srcs, 3, count),
                         PS_EINVAL);
        void *twice[2] = {pageable_out, pageable_out};
        assert_int_equal(ps_gpu_reduce_host_dsts(st, PS_SUM, dt, twice, 2, srcs, 3, count),
                         PS_EINVAL);
        void *on_input[2] = {pageable_out, shm_in + 64};
        assert_int_equal(ps_gpu_reduce_host_dsts(st, PS_SUM, dt, on_input, 2, srcs, 3, count),
                         PS_EINVAL);
        void *one[1] = {pageable_out};
        assert_int_equal(ps_gpu_reduce_host_dsts(st, PS_SUM, dt, one, 0, srcs, 3, count),
                         PS_EINVAL);
        assert_int_equal(ps_gpu_reduce_host_dsts(st, PS_SUM, dt, NULL, 1, srcs, 3, count),
                         PS_EINVAL);
        assert_int_equal(
            ps_gpu_reduce_host_dsts(st, PS_SUM, dt, one, PS_GPU_MAX_SRCS + 1, srcs, 3, count),
            PS_EINVAL);
        for (size_t i = 0; i < bytes; i++)
            if (po[i] != 0x5A || ((unsigned char *)pageable_out)[i] != 0x5A)
                fail_msg("dsts: a refused call wrote byte %zu", i);
        assert_int_equal(ps_gpu_host_unregister(seg), 0);
        munmap(seg, 2 * stride);
        for (int k = 0; k < 3; k++)
            free(orig[k]);
        free(want);
        free(pageable_in);
        free(pageable_out);
        ps_gpu_host_free(pinned_in);
        ps_gpu_host_free(pinned_out);
    }
    ps_gpu_stager_destroy(st);
}

int main(void)
{
    int n;
    int err = ps_gpu_device_count(&n);
    if (err != 0) {
        printf("SKIPPED: no CUDA device (%s): the kernels were not run\n", ps_strerror(err));
        return 77;
    }
    printf("gpu_kernels: %d CUDA device(s)\n", n);
    /* A subset, e.g. under compute-sanitizer: PS_GPU_TEST_FILTER=test_reduce_host (a pattern). */
    const char *only = getenv("PS_GPU_TEST_FILTER");
    if (only != NULL)
        cmocka_set_test_filter(only);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pointers_and_errors), cmocka_unit_test(test_reduce_grid),
        cmocka_unit_test(test_multi_grid),          cmocka_unit_test(test_scale),
        cmocka_unit_test(test_half_exhaustive),     cmocka_unit_test(test_streams),
        cmocka_unit_test(test_reduce_host),         cmocka_unit_test(test_reduce_host_registered),
        cmocka_unit_test(test_reduce_host_dsts),    cmocka_unit_test(test_ipc_export),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
