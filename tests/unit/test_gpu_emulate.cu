/* Unit tests of the GPU reduce loop (gpu/gpu_kernels.cuh) run on the host: vectors, tails, threads.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include <cmocka.h>
}

#include <paramsync/reduce.h>

#include "gpu_kernels.cuh"
#include "test_data.h"

/*
 * ps__gpu_reduce_range is the whole body of every kernel: the kernel only
 * passes its thread index and the grid size. nvcc compiles it here for the
 * host too, so the parts no GPU-less test otherwise reaches (the 16-byte
 * vector path, the split between vectors and tail, the grid-stride indexing,
 * in-place reduction) run on the CPU, one emulated thread after another, and
 * must give what the CPU engine gives, bit for bit, with no stray write.
 * Sequential emulation is faithful because every element belongs to exactly
 * one thread, which reads it from every input before writing it.
 *
 * What this cannot show: device code generation, real concurrency, the
 * launch itself. That is test_gpu_kernels.c, on a GPU.
 */

#define GUARD      64
#define GUARD_BYTE 0xA5
#define MAX_SRCS   5
#define MAX_COUNT  1003

static const size_t counts[] = {0, 1, 2, 7, 15, 16, 17, 31, 33, 100, MAX_COUNT};
static const size_t thread_counts[] = {1, 3, 32, 263};

typedef void (*range_fn)(const ps__gpu_args_t &args, size_t tid, size_t nthreads);

/* The kernel bodies of the GPU table, by (op, dtype); NULL for invalid pairs. */
static range_fn range_table[PS_OP_COUNT][PS_DTYPE_COUNT];

static void fill_range_table(void)
{
#define PS__RANGE_ENTRY(opname, step, fin, dtype, d, T, c, A)                                      \
    range_table[PS__OP_##opname][dtype] = &ps__gpu_reduce_range<ps__gpu_op_##opname##_##d>;
    PS_FOR_EACH_KERNEL(PS__RANGE_ENTRY)
#undef PS__RANGE_ENTRY
}

/* A host buffer of bytes with guards, its data 64-byte aligned plus offset. */
typedef struct hbuf {
    unsigned char *base;
    unsigned char *data;
    size_t bytes;
} hbuf_t;

static hbuf_t hbuf_make(size_t bytes, size_t offset)
{
    hbuf_t b;
    size_t total = (bytes + offset + 2 * GUARD + 63) / 64 * 64;
    b.base = static_cast<unsigned char *>(aligned_alloc(64, total));
    assert_non_null(b.base);
    memset(b.base, GUARD_BYTE, total);
    b.data = b.base + GUARD + offset;
    b.bytes = bytes;
    return b;
}

static int hbuf_guards_intact(const hbuf_t *b)
{
    for (const unsigned char *p = b->base; p < b->data; p++)
        if (*p != GUARD_BYTE)
            return 0;
    for (size_t i = 0; i < GUARD; i++)
        if (b->data[b->bytes + i] != GUARD_BYTE)
            return 0;
    return 1;
}

static int setup(void **state)
{
    (void)state;
    fill_range_table();
    return ps_reduce_set_path(PS_PATH_SCALAR);
}

/* Every valid pair has a kernel body and no invalid one has. */
static void test_table_is_the_grid(void **state)
{
    (void)state;
    for (int op = 0; op < PS_OP_COUNT; op++)
        for (int dt = 0; dt < PS_DTYPE_COUNT; dt++)
            assert_int_equal(range_table[op][dt] != NULL,
                             ps_op_check((ps_op_t)op, (ps_dtype_t)dt) == 0);
}

/*
 * For every pair: counts around every vector width, 1 to MAX_SRCS inputs,
 * aligned (vector path) or offset by one element (element path, as when
 * gpu.c finds a pointer not 16-byte aligned), separate dst or in place, and
 * several grid sizes; against ps_reduce_multi.
 */
static void test_kernel_body_grid(void **state)
{
    (void)state;
    test_data_seed("kernel_body_grid");
    size_t cases = 0;
    for (int dti = 0; dti < PS_DTYPE_COUNT; dti++) {
        ps_dtype_t dt = (ps_dtype_t)dti;
        size_t size = ps_dtype_size(dt);
        void *host[MAX_SRCS];
        for (int k = 0; k < MAX_SRCS; k++) {
            host[k] = malloc(MAX_COUNT * size);
            assert_non_null(host[k]);
            test_data_fill(dt, host[k], k > 0 ? host[0] : NULL, MAX_COUNT);
        }
        unsigned char *want = static_cast<unsigned char *>(malloc(MAX_COUNT * size));
        assert_non_null(want);
        for (int opi = 0; opi < PS_OP_COUNT; opi++) {
            ps_op_t op = (ps_op_t)opi;
            range_fn body = range_table[op][dt];
            if (body == NULL)
                continue;
            for (size_t ci = 0; ci < sizeof counts / sizeof counts[0]; ci++)
                for (int nsrc = 1; nsrc <= MAX_SRCS; nsrc++)
                    for (int vec = 0; vec < 2; vec++)
                        for (int in_place = 0; in_place < 2; in_place++)
                            for (size_t ti = 0; ti < sizeof thread_counts / sizeof(size_t); ti++) {
                                size_t count = counts[ci], bytes = count * size;
                                size_t off = vec ? 0 : size;
                                hbuf_t in[MAX_SRCS], out = hbuf_make(bytes, off);
                                ps__gpu_args_t a;
                                memset(&a, 0, sizeof a);
                                for (int j = 0; j < nsrc; j++) {
                                    in[j] = hbuf_make(bytes, off);
                                    memcpy(in[j].data, host[j], bytes);
                                    a.srcs[j] = in[j].data;
                                }
                                a.dst = in_place ? in[0].data : out.data;
                                a.nsrc = nsrc;
                                a.vec = vec;
                                a.count = count;
                                a.divisor = (uint64_t)nsrc;
                                for (size_t tid = 0; tid < thread_counts[ti]; tid++)
                                    body(a, tid, thread_counts[ti]);

                                memcpy(want, host[0], bytes);
                                assert_int_equal(
                                    ps_reduce_multi(op, dt, want, host, (size_t)nsrc, count), 0);
                                char what[128];
                                snprintf(what, sizeof what,
                                         "%s nsrc=%d count=%zu vec=%d in_place=%d threads=%zu",
                                         ps_op_name(op), nsrc, count, vec, in_place,
                                         thread_counts[ti]);
                                hbuf_t *dst = in_place ? &in[0] : &out;
                                assert_true(test_data_same(dst->data, want, count, dt, what));
                                assert_true(hbuf_guards_intact(&out));
                                for (int j = 0; j < nsrc; j++) {
                                    assert_true(hbuf_guards_intact(&in[j]));
                                    /* Inputs are read-only, except input 0 in place. */
                                    if (j > 0 || !in_place)
                                        assert_memory_equal(in[j].data, host[j], bytes);
                                    free(in[j].base);
                                }
                                free(out.base);
                                cases++;
                            }
        }
        for (int k = 0; k < MAX_SRCS; k++)
            free(host[k]);
        free(want);
    }
    printf("kernel_body_grid: %zu cases\n", cases);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_table_is_the_grid),
        cmocka_unit_test(test_kernel_body_grid),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
