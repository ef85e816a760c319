/* Unit tests of client/device.c's staging logic against a fake CUDA: copies, mixed buffers, failure
 * injection, the pinned cache. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <paramsync/gpu.h>

#include "internal.h"

/*
 * No machine here has a GPU, so this file defines the few ps_gpu_* functions
 * that client/device.c calls, over plain memory: "device" buffers are heap
 * blocks listed in a table, "pinned" ones are counted allocations. Linked
 * before libparamsync.a, these definitions keep the archive's gpu objects
 * out. device.c is compiled into this test without PS_HAVE_CUDA, so that it
 * asks the fake, not the process's loaded driver, whether CUDA is usable.
 * What a real device adds (DMA, streams, the driver) is left to the
 * integration scenario `device`, which needs one.
 */

#define MAX_FAKE 16
static const void *fake_dev[MAX_FAKE];
static size_t fake_dev_bytes[MAX_FAKE];
static int pinned_live, pinned_allocs, registered;
static int fail_alloc, fail_copy, fail_register; /* the next alloc / copy / register fails */
static void *registered_at;
static size_t registered_bytes;
static int copies;
static int current_device = 3, device_on_copy = -1;

int ps_gpu_device_count(int *count)
{
    *count = 1;
    return 0;
}

int ps_gpu_get_device(int *device)
{
    *device = current_device;
    return 0;
}

int ps_gpu_set_device(int device)
{
    current_device = device;
    return 0;
}

int ps_gpu_is_device_pointer(const void *ptr, int *is_device)
{
    *is_device = 0;
    for (int i = 0; i < MAX_FAKE; i++)
        if (fake_dev[i] && (const char *)ptr >= (const char *)fake_dev[i] &&
            (const char *)ptr < (const char *)fake_dev[i] + fake_dev_bytes[i])
            *is_device = 1;
    return 0;
}

int ps_gpu_host_alloc(void **out, size_t bytes)
{
    if (fail_alloc) {
        int rc = fail_alloc;
        fail_alloc = 0;
        return rc;
    }
    void *p = malloc(bytes);
    if (!p)
        return PS_ENOMEM;
    pinned_live++;
    pinned_allocs++;
    *out = p;
    return 0;
}

void ps_gpu_host_free(void *ptr)
{
    if (ptr)
        pinned_live--;
    free(ptr);
}

/* Pins memory the caller mapped: one range at a time here. */
int ps_gpu_host_register(void *ptr, size_t bytes)
{
    if (fail_register) {
        int rc = fail_register;
        fail_register = 0;
        return rc;
    }
    assert_null(registered_at);
    registered_at = ptr;
    registered_bytes = bytes;
    registered++;
    pinned_live++;
    return 0;
}

int ps_gpu_host_unregister(void *ptr)
{
    assert_ptr_equal(ptr, registered_at);
    registered_at = NULL;
    pinned_live--;
    return 0;
}

int ps_gpu_memcpy_async(void *dst, const void *src, size_t bytes, ps_gpu_stream_t stream)
{
    (void)stream;
    if (fail_copy) {
        int rc = fail_copy;
        fail_copy = 0;
        return rc;
    }
    copies++;
    device_on_copy = current_device;
    memcpy(dst, src, bytes);
    return 0;
}

int ps_gpu_stream_synchronize(ps_gpu_stream_t stream)
{
    (void)stream;
    return 0;
}

/* No CUDA IPC export here: calls that peer copies take stage their device
 * buffers as every other call does (the integration worker's fake CUDA has
 * IPC). Opening counts, for the comm's cache of mappings: a handle whose
 * first byte is 0xff cannot be opened; a mapping is a distinct address. */
static int ipc_opens, ipc_live;

int ps_gpu_fence(void)
{
    return 0;
}

int ps_gpu_ipc_export(const void *ptr, ps_gpu_ipc_t *out)
{
    (void)ptr, (void)out;
    return PS_EUNAVAIL;
}

int ps_gpu_ipc_open(const ps_gpu_ipc_t *ipc, void **base)
{
    if (ipc->handle[0] == 0xff)
        return PS_EINVAL;
    ipc_opens++;
    ipc_live++;
    *base = malloc(1);
    return *base ? 0 : PS_ENOMEM;
}

int ps_gpu_ipc_close(void *base)
{
    if (base) {
        ipc_live--;
        free(base);
    }
    return 0;
}

int ps_gpu_reduce_multi(ps_op_t op, ps_dtype_t dtype, void *dst, const void *const *srcs,
                        size_t nsrc, size_t count, ps_gpu_stream_t stream)
{
    (void)op, (void)dtype, (void)dst, (void)srcs, (void)nsrc, (void)count, (void)stream;
    return PS_EUNAVAIL;
}

static void *dev_alloc(size_t bytes, int fill)
{
    void *p = malloc(bytes);
    assert_non_null(p);
    memset(p, fill, bytes);
    for (int i = 0; i < MAX_FAKE; i++)
        if (!fake_dev[i]) {
            fake_dev[i] = p;
            fake_dev_bytes[i] = bytes;
            return p;
        }
    fail_msg("too many fake device buffers");
    return NULL;
}

static void dev_free(void *p)
{
    for (int i = 0; i < MAX_FAKE; i++)
        if (fake_dev[i] == p)
            fake_dev[i] = NULL;
    free(p);
}

typedef struct fixture {
    ps_comm_t comm;
    int reports;
    int last_err;
    char last_msg[512];
} fixture_t;

static void capture(int err, const char *message, void *arg)
{
    fixture_t *f = arg;
    f->reports++;
    f->last_err = err;
    snprintf(f->last_msg, sizeof(f->last_msg), "%s", message);
}

static int setup(void **state)
{
    fixture_t *f = calloc(1, sizeof(*f));
    if (!f || pthread_mutex_init(&f->comm.lock, NULL) != 0)
        return -1;
    f->comm.error_fn = capture;
    f->comm.error_arg = f;
    pinned_live = pinned_allocs = copies = registered = 0;
    fail_alloc = fail_copy = fail_register = 0;
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    fixture_t *f = *state;
    ps__stage_free(&f->comm);
    /* Every pinned buffer came back. */
    int live = pinned_live;
    pthread_mutex_destroy(&f->comm.lock);
    free(f);
    return live == 0 ? 0 : -1;
}

static ps__coll_t coll_for(fixture_t *f, const char *name, const void *in, size_t in_bytes,
                           void *out, size_t out_bytes)
{
    ps__coll_t c;
    memset(&c, 0, sizeof(c));
    c.comm = &f->comm;
    c.name = name;
    c.hdr.seq = 7;
    c.in = in;
    c.in_bytes = in_bytes;
    c.out = out;
    c.out_bytes = out_bytes;
    return c;
}

/* What the wire would do: the output gets a pattern derived from the input. */
static void fake_result(ps__coll_t *c, unsigned char add)
{
    const unsigned char *in = c->in;
    unsigned char *out = c->out;
    for (size_t i = 0; i < c->out_bytes; i++)
        out[i] = (unsigned char)((c->in_bytes ? in[i % c->in_bytes] : 0) + add);
}

static void assert_filled(const void *p, size_t n, unsigned char v)
{
    for (size_t i = 0; i < n; i++)
        assert_int_equal(((const unsigned char *)p)[i], v);
}

/* Every in/out combination of host and device, with in == out (all_reduce)
 * and in != out (all_gather), and one-sided calls (send, recv). */
static void test_combinations(void **state)
{
    fixture_t *f = *state;
    enum { N = 1000, M = 3000 };
    for (int shape = 0; shape < 7; shape++) {
        unsigned char *host_in = malloc(N), *host_out = malloc(M);
        unsigned char *dev_in = dev_alloc(N, 0x11), *dev_out = dev_alloc(M, 0x22);
        assert_non_null(host_in);
        assert_non_null(host_out);
        memset(host_in, 0x11, N);
        memset(host_out, 0x22, M);
        const void *in = NULL;
        void *out = NULL;
        size_t in_bytes = N, out_bytes = M;
        int want_in_dev = 0, want_out_dev = 0;
        switch (shape) {
        case 0:
            in = host_in, out = host_out;
            break;
        case 1:
            in = dev_in, out = host_out, want_in_dev = 1;
            break;
        case 2:
            in = host_in, out = dev_out, want_out_dev = 1;
            break;
        case 3:
            in = dev_in, out = dev_out, want_in_dev = want_out_dev = 1;
            break;
        case 4: /* all_reduce on one device buffer */
            in = out = dev_in, out_bytes = N, want_in_dev = want_out_dev = 1;
            break;
        case 5:
            in = dev_in, out_bytes = 0, want_in_dev = 1;
            break; /* send */
        case 6:
            in_bytes = 0, out = dev_out, want_out_dev = 1;
            break; /* recv */
        }
        ps__coll_t c = coll_for(f, "all_gather", in, in_bytes, out, out_bytes);
        int in_dev, out_dev;
        assert_int_equal(ps__stage_classify(&c, &in_dev, &out_dev), 0);
        assert_int_equal(in_dev, want_in_dev);
        assert_int_equal(out_dev, want_out_dev);
        copies = 0;
        assert_int_equal(ps__stage_begin(&c), 0);
        if (!want_in_dev && !want_out_dev) {
            assert_null(c.stage_pinned);
            assert_int_equal(copies, 0);
        }
        /* The wire sees host memory only; device input arrived in full. */
        int is_dev;
        ps_gpu_is_device_pointer(c.in, &is_dev);
        assert_int_equal(is_dev, 0);
        ps_gpu_is_device_pointer(c.out, &is_dev);
        assert_int_equal(is_dev, 0);
        if (want_in_dev)
            assert_filled(c.in, in_bytes, 0x11);
        assert_ptr_equal(c.in, want_in_dev ? c.stage_pinned : in);
        if (!want_out_dev)
            assert_ptr_equal(c.out, out);
        if (want_in_dev && want_out_dev && in != out) /* separate bytes, input kept */
            assert_true((char *)c.out >= (char *)c.in + in_bytes);
        fake_result(&c, 5);
        assert_int_equal(ps__stage_end(&c, 0), 0);
        if (out_bytes)
            assert_filled(out, out_bytes, in_bytes ? 0x11 + 5 : 5);
        assert_int_equal(copies, want_in_dev + want_out_dev);
        assert_int_equal(f->reports, 0);
        free(host_in);
        free(host_out);
        dev_free(dev_in);
        dev_free(dev_out);
    }
    /* Only the cached buffer is left. */
    assert_int_equal(pinned_live, 1);
}

/* A failed call leaves the device output as it was, and reports nothing
 * more than the call did. */
static void test_failed_call_leaves_device_output(void **state)
{
    fixture_t *f = *state;
    unsigned char *buf = dev_alloc(512, 0x77);
    ps__coll_t c = coll_for(f, "all_reduce", buf, 512, buf, 512);
    assert_int_equal(ps__stage_begin(&c), 0);
    fake_result(&c, 1);
    assert_int_equal(ps__stage_end(&c, PS_EDATALOSS), PS_EDATALOSS);
    assert_filled(buf, 512, 0x77);
    assert_int_equal(f->reports, 0);
    assert_null(c.stage_pinned);
    dev_free(buf);
}

/* Pinned allocation and the device-to-host copy fail: the error comes back,
 * reported with its cause, and nothing is held or changed. */
static void test_begin_failures(void **state)
{
    fixture_t *f = *state;
    unsigned char *buf = dev_alloc(256, 0x10);
    struct {
        int *knob, err;
        const char *needle;
    } cases[] = {
        {&fail_alloc, PS_ENOMEM, "cannot allocate pinned host memory"},
        {&fail_copy, PS_EINTERNAL, "cannot copy the device input to host memory"},
    };
    for (size_t i = 0; i < 2; i++) {
        ps__coll_t c = coll_for(f, "broadcast", buf, 256, NULL, 0);
        *cases[i].knob = cases[i].err;
        f->reports = 0;
        assert_int_equal(ps__stage_begin(&c), cases[i].err);
        assert_int_equal(f->reports, 1);
        assert_int_equal(f->last_err, cases[i].err);
        assert_non_null(strstr(f->last_msg, "broadcast: "));
        assert_non_null(strstr(f->last_msg, cases[i].needle));
        assert_non_null(strstr(f->last_msg, ps_strerror(cases[i].err)));
        assert_ptr_equal(c.in, buf);
        assert_null(c.stage_pinned);
        assert_int_equal(ps__stage_end(&c, 0), 0);
    }
    assert_filled(buf, 256, 0x10);
    dev_free(buf);
}

/* The copy back fails: the call's success becomes that error, reported
 * with the call's group and sequence number. */
static void test_end_copy_failure(void **state)
{
    fixture_t *f = *state;
    unsigned char *buf = dev_alloc(128, 0x01);
    ps__coll_t c = coll_for(f, "recv", NULL, 0, buf, 128);
    assert_int_equal(ps__stage_begin(&c), 0);
    fake_result(&c, 9);
    fail_copy = PS_EINVAL;
    assert_int_equal(ps__stage_end(&c, 0), PS_EINVAL);
    assert_int_equal(f->reports, 1);
    assert_int_equal(f->last_err, PS_EINVAL);
    assert_non_null(strstr(f->last_msg, "recv (group 0, seq 7): "));
    assert_non_null(strstr(f->last_msg, "cannot copy the result (128 bytes) to the device"));
    assert_null(c.stage_pinned);
    dev_free(buf);
}

/* The copy back runs on the device the caller had current when it started
 * (a non-blocking call ends on another thread). */
static void test_copy_back_on_callers_device(void **state)
{
    fixture_t *f = *state;
    unsigned char *buf = dev_alloc(64, 0);
    current_device = 2;
    ps__coll_t c = coll_for(f, "all_reduce", buf, 64, buf, 64);
    assert_int_equal(ps__stage_begin(&c), 0);
    current_device = 0;
    assert_int_equal(ps__stage_end(&c, 0), 0);
    assert_int_equal(device_on_copy, 2);
    dev_free(buf);
}

/* Two calls in flight hold two buffers; the larger one stays cached. */
static void test_cache_keeps_the_larger(void **state)
{
    fixture_t *f = *state;
    unsigned char *a = dev_alloc(100, 1), *b = dev_alloc(5000, 2);
    ps__coll_t ca = coll_for(f, "send", a, 100, NULL, 0);
    ps__coll_t cb = coll_for(f, "send", b, 5000, NULL, 0);
    assert_int_equal(ps__stage_begin(&ca), 0);
    assert_int_equal(ps__stage_begin(&cb), 0);
    assert_int_equal(pinned_live, 2);
    assert_int_equal(ps__stage_end(&ca, 0), 0);
    assert_int_equal(ps__stage_end(&cb, 0), 0);
    assert_int_equal(pinned_live, 1);
    assert_int_equal(f->comm.stage_cache[0].size, 5000);
    ps__coll_t cc = coll_for(f, "send", a, 100, NULL, 0);
    assert_int_equal(ps__stage_begin(&cc), 0);
    assert_int_equal(pinned_allocs, 2);
    assert_int_equal(ps__stage_end(&cc, 0), 0);
    dev_free(a);
    dev_free(b);
}

/* From 2 MiB the staging buffer is a mapping of whole 2 MiB pages, aligned
 * and pinned by registering (the agent may then take it direct); where
 * registering fails, the driver's pinned memory as below 2 MiB. The data
 * goes through either way; the cache frees each the way it was made. */
static void test_large_buffers_on_huge_pages(void **state)
{
    fixture_t *f = *state;
    const size_t n = (3u << 20) + 5;
    unsigned char *buf = dev_alloc(n, 0x3c);
    for (int refuse = 0; refuse < 2; refuse++) {
        fail_register = refuse ? PS_ENOMEM : 0;
        ps__stage_free(&f->comm); /* no cached buffer: this call makes one */
        ps__coll_t c = coll_for(f, "all_reduce", buf, n, buf, n);
        assert_int_equal(ps__stage_begin(&c), 0);
        assert_int_equal(c.stage_kind, refuse ? PS__STAGE_DRIVER : PS__STAGE_MAPPED);
        if (!refuse) {
            assert_ptr_equal(c.stage_pinned, registered_at);
            assert_int_equal((uintptr_t)c.stage_pinned % (2u << 20), 0);
            assert_int_equal(registered_bytes, 4u << 20);
            assert_int_equal(c.stage_bytes, 4u << 20);
        } else {
            assert_null(registered_at);
        }
        assert_filled(c.in, n, 0x3c);
        fake_result(&c, 2);
        assert_int_equal(ps__stage_end(&c, 0), 0);
        assert_filled(buf, n, 0x3c + 2);
        memset(buf, 0x3c, n);
        assert_int_equal(pinned_live, 1); /* cached */
    }
    assert_int_equal(registered, 1);
    assert_int_equal(pinned_allocs, 1);
    assert_int_equal(f->reports, 0);
    dev_free(buf);
}

static ps_gpu_ipc_t ipc_of(int n)
{
    ps_gpu_ipc_t ipc;
    memset(&ipc, 0, sizeof(ipc));
    memcpy(ipc.handle + 8, &n, sizeof(n));
    ipc.size = 4096;
    return ipc;
}

/* The comm's mappings of other ranks' allocations: one open per (process,
 * allocation), kept while in use and after; when all are taken, the one
 * used longest ago and read by nobody goes; with every one in use, a
 * mapping for that use alone, closed when given back; all closed at the
 * end (teardown's ps__stage_free). */
static void test_ipc_mappings(void **state)
{
    fixture_t *f = *state;
    ipc_opens = ipc_live = 0;
    int slot, slot2;
    ps_gpu_ipc_t a = ipc_of(1);
    void *at = ps__ipc_map(&f->comm, 100, &a, &slot);
    assert_non_null(at);
    assert_true(slot >= 0);
    assert_ptr_equal(ps__ipc_map(&f->comm, 100, &a, &slot2), at); /* the same, in use twice */
    assert_int_equal(slot2, slot);
    assert_int_equal(ipc_opens, 1);
    ps_gpu_ipc_t same_handle = ipc_of(1);
    void *other_pid = ps__ipc_map(&f->comm, 101, &same_handle, &slot2);
    assert_ptr_not_equal(other_pid, at); /* another process's allocation */
    assert_int_equal(ipc_opens, 2);
    ps__ipc_unmap(&f->comm, slot2, other_pid);
    ps__ipc_unmap(&f->comm, slot, at);
    ps__ipc_unmap(&f->comm, slot, at);
    assert_int_equal(ipc_live, 2); /* kept */

    /* Fill the table; `a` is the oldest and unused: it goes first. */
    for (int i = 2; ipc_live < PS__IPC_MAPS; i++) {
        ps_gpu_ipc_t x = ipc_of(i);
        void *p = ps__ipc_map(&f->comm, 100, &x, &slot2);
        assert_non_null(p);
        ps__ipc_unmap(&f->comm, slot2, p);
    }
    ps_gpu_ipc_t b = ipc_of(1000);
    void *pb = ps__ipc_map(&f->comm, 100, &b, &slot2);
    assert_non_null(pb);
    assert_int_equal(ipc_live, PS__IPC_MAPS);
    int opens = ipc_opens;
    void *again = ps__ipc_map(&f->comm, 100, &a, &slot);
    assert_int_equal(ipc_opens, opens + 1); /* it had gone */
    ps__ipc_unmap(&f->comm, slot, again);

    /* With pb in use, PS__IPC_MAPS - 1 more fill the table in use; the next
     * is mapped for its use alone and closed when given back. */
    void *held[PS__IPC_MAPS];
    int slots[PS__IPC_MAPS];
    for (int i = 0; i < PS__IPC_MAPS; i++) {
        ps_gpu_ipc_t x = ipc_of(2000 + i);
        held[i] = ps__ipc_map(&f->comm, 100, &x, &slots[i]);
        assert_non_null(held[i]);
        assert_true(i == PS__IPC_MAPS - 1 ? slots[i] == -1 : slots[i] >= 0);
    }
    assert_int_equal(ipc_live, PS__IPC_MAPS + 1);
    ps__ipc_unmap(&f->comm, slots[PS__IPC_MAPS - 1], held[PS__IPC_MAPS - 1]);
    assert_int_equal(ipc_live, PS__IPC_MAPS);
    for (int i = 0; i < PS__IPC_MAPS - 1; i++)
        ps__ipc_unmap(&f->comm, slots[i], held[i]);
    ps__ipc_unmap(&f->comm, slot2, pb);

    /* A handle that cannot be opened: NULL, and no mapping given up for it. */
    ps_gpu_ipc_t bad = ipc_of(4000);
    bad.handle[0] = 0xff;
    int live = ipc_live;
    assert_null(ps__ipc_map(&f->comm, 100, &bad, &slot));
    assert_int_equal(ipc_live, live);
    ps__peer_ipc_close_all(&f->comm);
    assert_int_equal(ipc_live, 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_combinations, setup, teardown),
        cmocka_unit_test_setup_teardown(test_failed_call_leaves_device_output, setup, teardown),
        cmocka_unit_test_setup_teardown(test_begin_failures, setup, teardown),
        cmocka_unit_test_setup_teardown(test_end_copy_failure, setup, teardown),
        cmocka_unit_test_setup_teardown(test_copy_back_on_callers_device, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cache_keeps_the_larger, setup, teardown),
        cmocka_unit_test_setup_teardown(test_large_buffers_on_huge_pages, setup, teardown),
        cmocka_unit_test_setup_teardown(test_ipc_mappings, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
