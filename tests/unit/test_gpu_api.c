/* Unit tests of the gpu/ API contract that needs no device: argument checks, errors, no-device
 * behaviour. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <paramsync/gpu.h>

#include "gpu_internal.h"

#ifdef PS_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

/*
 * These run on every machine, against whichever paramsync_gpu was built (the
 * CUDA one or the stub). Pointers here are never dereferenced: a call either
 * fails its argument checks, or has count == 0, or (no device) fails with
 * PS_EUNAVAIL before anything touches memory. Calls that would launch a
 * kernel on fake pointers run only when no device is present.
 */

static int have_device;

/* Fake, never-dereferenced addresses with the alignment each case needs. */
#define FAKE(addr) ((void *)(uintptr_t)(addr))

/*
 * The thread's last CUDA error is clear: no PS_E* failure leaves one behind.
 * Only a machine with a driver can show it: without one, the runtime answers
 * every call, cudaGetLastError() included, with cudaErrorInsufficientDriver.
 */
static void assert_no_stale_cuda_error(void)
{
#ifdef PS_HAVE_CUDA
    if (have_device)
        assert_int_equal(cudaGetLastError(), cudaSuccess);
#endif
}

static void test_reduce_argument_checks(void **state)
{
    (void)state;
    void *d = FAKE(0x100000), *s = FAKE(0x200000);
    const void *two[2] = {s, FAKE(0x300000)};
    /* Invalid pairs: bitwise ops on floats, AVG on integers, out-of-range enums. */
    assert_int_equal(ps_gpu_reduce(PS_BAND, PS_FLOAT32, d, s, 16, NULL), PS_EINVAL);
    assert_int_equal(ps_gpu_reduce(PS_BXOR, PS_BFLOAT16, d, s, 16, NULL), PS_EINVAL);
    assert_int_equal(ps_gpu_reduce(PS_AVG, PS_INT32, d, s, 16, NULL), PS_EINVAL);
    assert_int_equal(ps_gpu_reduce(PS_OP_COUNT, PS_INT32, d, s, 16, NULL), PS_EINVAL);
    assert_int_equal(ps_gpu_reduce(PS_SUM, PS_DTYPE_COUNT, d, s, 16, NULL), PS_EINVAL);
    assert_int_equal(ps_gpu_reduce(PS_SUM, (ps_dtype_t)-1, d, s, 16, NULL), PS_EINVAL);
    /* NULL pointers with work to do, but not without. */
    assert_int_equal(ps_gpu_reduce(PS_SUM, PS_FLOAT32, NULL, s, 16, NULL), PS_EINVAL);
    assert_int_equal(ps_gpu_reduce(PS_SUM, PS_FLOAT32, d, NULL, 16, NULL), PS_EINVAL);
    assert_int_equal(ps_gpu_reduce(PS_SUM, PS_FLOAT32, NULL, NULL, 0, NULL), 0);
    /* Device loads need element alignment. */
    assert_int_equal(ps_gpu_reduce(PS_SUM, PS_FLOAT32, FAKE(0x100002), s, 16, NULL), PS_EINVAL);
    assert_int_equal(ps_gpu_reduce(PS_SUM, PS_FLOAT64, d, FAKE(0x200004), 16, NULL), PS_EINVAL);
    assert_int_equal(ps_gpu_reduce(PS_SUM, PS_FLOAT16, d, FAKE(0x200001), 16, NULL), PS_EINVAL);
    /* Size overflow and wrap past the end of the address space. */
    assert_int_equal(ps_gpu_reduce(PS_SUM, PS_FLOAT32, d, s, SIZE_MAX / 2, NULL), PS_EINVAL);
    assert_int_equal(ps_gpu_reduce(PS_SUM, PS_INT8, FAKE(UINTPTR_MAX - 8), s, 16, NULL), PS_EINVAL);
    /* Partial overlap is refused; dst == src is ps_reduce's x op x and allowed. */
    assert_int_equal(ps_gpu_reduce(PS_SUM, PS_FLOAT32, d, FAKE(0x100000 + 4), 16, NULL), PS_EINVAL);
    assert_int_equal(ps_gpu_reduce(PS_SUM, PS_FLOAT32, d, d, 0, NULL), 0);

    /* ps_gpu_reduce_multi. */
    assert_int_equal(ps_gpu_reduce_multi(PS_SUM, PS_FLOAT32, d, NULL, 2, 16, NULL), PS_EINVAL);
    assert_int_equal(ps_gpu_reduce_multi(PS_SUM, PS_FLOAT32, d, two, 0, 16, NULL), PS_EINVAL);
    const void *many[PS_GPU_MAX_SRCS + 1];
    for (size_t j = 0; j <= PS_GPU_MAX_SRCS; j++)
        many[j] = FAKE(0x1000000 + j * 0x10000);
    assert_int_equal(ps_gpu_reduce_multi(PS_SUM, PS_INT8, d, many, PS_GPU_MAX_SRCS + 1, 16, NULL),
                     PS_EINVAL);
    assert_int_equal(ps_gpu_reduce_multi(PS_SUM, PS_INT8, d, many, PS_GPU_MAX_SRCS, 0, NULL), 0);
    /* dst may be any input exactly (one pass), but no part of one. */
    const void *first_is_dst[2] = {d, s};
    const void *second_is_dst[2] = {s, d};
    const void *second_in_dst[2] = {s, FAKE(0x100000 + 8)};
    assert_int_equal(ps_gpu_reduce_multi(PS_SUM, PS_INT32, d, first_is_dst, 2, 0, NULL), 0);
    assert_int_equal(ps_gpu_reduce_multi(PS_SUM, PS_INT32, d, second_is_dst, 2, 0, NULL), 0);
    assert_int_equal(ps_gpu_reduce_multi(PS_SUM, PS_INT32, d, second_in_dst, 2, 16, NULL),
                     PS_EINVAL);
    assert_int_equal(ps_gpu_reduce_multi(PS_BOR, PS_FLOAT64, d, two, 2, 16, NULL), PS_EINVAL);

    /* ps_gpu_scale: floating dtypes, a divisor, an aligned buffer. */
    assert_int_equal(ps_gpu_scale(PS_INT32, d, 16, 2, NULL), PS_EINVAL);
    assert_int_equal(ps_gpu_scale(PS_FLOAT32, d, 16, 0, NULL), PS_EINVAL);
    assert_int_equal(ps_gpu_scale(PS_FLOAT32, NULL, 16, 2, NULL), PS_EINVAL);
    assert_int_equal(ps_gpu_scale(PS_FLOAT64, FAKE(0x100004), 16, 2, NULL), PS_EINVAL);
    assert_int_equal(ps_gpu_scale(PS_FLOAT16, d, 0, 3, NULL), 0);
    assert_no_stale_cuda_error();
}

static void test_other_argument_checks(void **state)
{
    (void)state;
    void *p = FAKE(0x12345678);
    ps_gpu_stager_t *stager = FAKE(0x4000);
    assert_int_equal(ps_gpu_device_count(NULL), PS_EINVAL);
    assert_int_equal(ps_gpu_set_device(-1), PS_EINVAL);
    assert_int_equal(ps_gpu_get_device(NULL), PS_EINVAL);
    assert_int_equal(ps_gpu_is_device_pointer(&p, NULL), PS_EINVAL);
    assert_int_equal(ps_gpu_host_alloc(NULL, 64), PS_EINVAL);
    assert_int_equal(ps_gpu_host_alloc(&p, 0), PS_EINVAL);
    assert_int_equal(ps_gpu_host_register(NULL, 64), PS_EINVAL);
    assert_int_equal(ps_gpu_host_register(p, 0), PS_EINVAL);
    assert_int_equal(ps_gpu_host_unregister(NULL), 0);
    assert_int_equal(ps_gpu_malloc(NULL, 64), PS_EINVAL);
    assert_int_equal(ps_gpu_malloc(&p, 0), PS_EINVAL);
    assert_int_equal(ps_gpu_memcpy_async(NULL, &p, 8, NULL), PS_EINVAL);
    assert_int_equal(ps_gpu_memcpy_async(&p, NULL, 8, NULL), PS_EINVAL);
    assert_int_equal(ps_gpu_memcpy_async(NULL, NULL, 0, NULL), 0);
    assert_int_equal(ps_gpu_stream_create(NULL), PS_EINVAL);
    ps_gpu_ipc_t ipc;
    memset(&ipc, 0, sizeof ipc);
    assert_int_equal(ps_gpu_ipc_export(NULL, &ipc), PS_EINVAL);
    assert_int_equal(ps_gpu_ipc_export(p, NULL), PS_EINVAL);
    assert_int_equal(ps_gpu_ipc_open(NULL, &p), PS_EINVAL);
    assert_int_equal(ps_gpu_ipc_open(&ipc, NULL), PS_EINVAL);
    assert_ptr_equal(p, FAKE(0x12345678));
    assert_int_equal(ps_gpu_ipc_close(NULL), 0);
    assert_int_equal(ps_gpu_stager_create(NULL, 0, 2, 0), PS_EINVAL);
    assert_int_equal(ps_gpu_stager_create(&stager, -1, 2, 0), PS_EINVAL);
    assert_int_equal(ps_gpu_stager_create(&stager, 0, 0, 0), PS_EINVAL);
    assert_int_equal(ps_gpu_stager_create(&stager, 0, PS_GPU_MAX_SRCS + 1, 0), PS_EINVAL);
    assert_ptr_equal(stager, FAKE(0x4000)); /* out-parameters are written only on success */
    const void *srcs[2] = {FAKE(0x1000), FAKE(0x2000)};
    assert_int_equal(ps_gpu_reduce_host(NULL, PS_SUM, PS_FLOAT32, FAKE(0x3000), srcs, 2, 4),
                     PS_EINVAL);
    void *dsts[2] = {FAKE(0x3000), FAKE(0x4000)};
    assert_int_equal(ps_gpu_reduce_host_dsts(NULL, PS_SUM, PS_FLOAT32, dsts, 2, srcs, 2, 4),
                     PS_EINVAL);
    /* Every free and destroy accepts NULL. */
    ps_gpu_host_free(NULL);
    ps_gpu_free(NULL);
    ps_gpu_stream_destroy(NULL);
    ps_gpu_stager_destroy(NULL);
    assert_no_stale_cuda_error();
}

/* No host pointer is a device pointer, with or without a device. */
static void test_host_pointers_are_not_device_pointers(void **state)
{
    (void)state;
    int on_stack = 0;
    int *on_heap = malloc(sizeof *on_heap);
    assert_non_null(on_heap);
    int is_dev = -1;
    assert_int_equal(ps_gpu_is_device_pointer(&on_stack, &is_dev), 0);
    assert_int_equal(is_dev, 0);
    is_dev = -1;
    assert_int_equal(ps_gpu_is_device_pointer(on_heap, &is_dev), 0);
    assert_int_equal(is_dev, 0);
    is_dev = -1;
    assert_int_equal(ps_gpu_is_device_pointer(NULL, &is_dev), 0);
    assert_int_equal(is_dev, 0);
    free(on_heap);
    assert_no_stale_cuda_error();
}

/* Without a device (here, and in the stub build) every call that needs one says PS_EUNAVAIL. */
static void test_without_a_device(void **state)
{
    (void)state;
    if (have_device) {
        skip();
        return;
    }
    int n = -7, dev = -7;
    void *p = FAKE(0x4000);
    ps_gpu_stream_t stream = FAKE(0x5000);
    ps_gpu_stager_t *stager = FAKE(0x6000);
    void *d = FAKE(0x100000), *s = FAKE(0x200000);
    const void *srcs[3] = {d, s, FAKE(0x300000)};

    assert_int_equal(ps_gpu_device_count(&n), PS_EUNAVAIL);
    assert_int_equal(n, -7);
    assert_no_stale_cuda_error();
    assert_int_equal(ps_gpu_set_device(0), PS_EUNAVAIL);
    assert_no_stale_cuda_error();
    assert_int_equal(ps_gpu_get_device(&dev), PS_EUNAVAIL);
    assert_int_equal(dev, -7);
    assert_int_equal(ps_gpu_reduce(PS_SUM, PS_FLOAT32, d, s, 1000, NULL), PS_EUNAVAIL);
    assert_no_stale_cuda_error();
    assert_int_equal(ps_gpu_reduce_multi(PS_AVG, PS_BFLOAT16, d, srcs, 3, 1000, NULL), PS_EUNAVAIL);
    assert_int_equal(ps_gpu_scale(PS_FLOAT64, d, 1000, 3, NULL), PS_EUNAVAIL);
    assert_int_equal(ps_gpu_host_alloc(&p, 4096), PS_EUNAVAIL);
    char page[64];
    assert_int_equal(ps_gpu_host_register(page, sizeof page), PS_EUNAVAIL);
    assert_int_equal(ps_gpu_host_unregister(page), PS_EUNAVAIL);
    assert_no_stale_cuda_error();
    assert_int_equal(ps_gpu_malloc(&p, 4096), PS_EUNAVAIL);
    assert_ptr_equal(p, FAKE(0x4000));
    assert_int_equal(ps_gpu_memcpy_async(d, s, 64, NULL), PS_EUNAVAIL);
    assert_int_equal(ps_gpu_stream_create(&stream), PS_EUNAVAIL);
    assert_ptr_equal(stream, FAKE(0x5000));
    assert_int_equal(ps_gpu_stream_synchronize(NULL), PS_EUNAVAIL);
    assert_int_equal(ps_gpu_stager_create(&stager, 0, 2, 0), PS_EUNAVAIL);
    assert_ptr_equal(stager, FAKE(0x6000));
    assert_int_equal(ps_gpu_fence(), PS_EUNAVAIL);
    ps_gpu_ipc_t ipc;
    memset(&ipc, 0, sizeof ipc);
    assert_int_equal(ps_gpu_ipc_export(d, &ipc), PS_EUNAVAIL);
    assert_int_equal(ps_gpu_ipc_open(&ipc, &p), PS_EUNAVAIL);
    assert_ptr_equal(p, FAKE(0x4000));
    assert_no_stale_cuda_error();
}

#ifdef PS_HAVE_CUDA
/* CUDA errors map to the PS_E* codes the header promises. */
static void test_error_mapping(void **state)
{
    (void)state;
    static const struct {
        cudaError_t cuda;
        int ps;
    } cases[] = {
        {cudaSuccess, 0},
        {cudaErrorInsufficientDriver, PS_EUNAVAIL},
        {cudaErrorNoDevice, PS_EUNAVAIL},
        {cudaErrorDevicesUnavailable, PS_EUNAVAIL},
        {cudaErrorNoKernelImageForDevice, PS_EUNAVAIL},
        {cudaErrorUnsupportedPtxVersion, PS_EUNAVAIL},
        {cudaErrorStubLibrary, PS_EUNAVAIL},
        {cudaErrorSystemDriverMismatch, PS_EUNAVAIL},
        {cudaErrorInvalidValue, PS_EINVAL},
        {cudaErrorInvalidDevice, PS_EINVAL},
        {cudaErrorInvalidDevicePointer, PS_EINVAL},
        {cudaErrorInvalidResourceHandle, PS_EINVAL},
        {cudaErrorHostMemoryAlreadyRegistered, PS_EINVAL},
        {cudaErrorHostMemoryNotRegistered, PS_EINVAL},
        {cudaErrorMemoryAllocation, PS_ENOMEM},
        {cudaErrorIllegalAddress, PS_EINTERNAL},
        {cudaErrorMisalignedAddress, PS_EINTERNAL},
        {cudaErrorLaunchFailure, PS_EINTERNAL},
        {cudaErrorLaunchOutOfResources, PS_EINTERNAL},
        {cudaErrorUnknown, PS_EINTERNAL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (ps__gpu_error((int)cases[i].cuda) != cases[i].ps)
            fail_msg("%s: got %d, want %d", cudaGetErrorName(cases[i].cuda),
                     ps__gpu_error((int)cases[i].cuda), cases[i].ps);
}

/* ps__gpu_result reads the failed call's error back, leaving the thread's last error clear. */
static void test_failed_calls_leave_no_last_error(void **state)
{
    (void)state;
    if (!have_device) {
        /* cudaGetLastError() itself fails without a driver: nothing to observe. */
        print_message("SKIPPED: needs a CUDA driver and device\n");
        skip();
        return;
    }
    void *p;
    assert_int_equal(ps__gpu_result(cudaMalloc(&p, SIZE_MAX)), PS_ENOMEM);
    assert_int_equal(cudaGetLastError(), cudaSuccess);
    assert_int_equal(ps__gpu_result(cudaSuccess), 0);
}
#endif

int main(void)
{
    int n;
    have_device = ps_gpu_device_count(&n) == 0;
#ifdef PS_HAVE_CUDA
    printf("gpu_api: CUDA build, %s\n", have_device ? "device present" : "no device");
#else
    printf("gpu_api: stub build (no CUDA)\n");
#endif
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_reduce_argument_checks),
        cmocka_unit_test(test_other_argument_checks),
        cmocka_unit_test(test_host_pointers_are_not_device_pointers),
        cmocka_unit_test(test_without_a_device),
#ifdef PS_HAVE_CUDA
        cmocka_unit_test(test_error_mapping),
        cmocka_unit_test(test_failed_calls_leave_no_last_error),
#endif
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
