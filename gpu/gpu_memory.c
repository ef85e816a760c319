/* Devices, memory, copies and streams of paramsync_gpu, and the CUDA error mapping.
 *
 * Apart from the reduce launches (gpu.c), so that a program that only moves memory (the C client
 * staging device buffers) links this object and not the kernels of gpu_kernels.cu. */
#include <pthread.h>
#include <string.h>

#include <cuda.h>
#include <cuda_runtime_api.h>

#include "gpu_internal.h"

int ps__gpu_error(int cuda_error)
{
    switch ((enum cudaError)cuda_error) {
    case cudaSuccess:
        return 0;
    /* Nothing this process can run on: callers in "auto" mode fall back to the CPU. */
    case cudaErrorInsufficientDriver:
    case cudaErrorNoDevice:
    case cudaErrorDevicesUnavailable:
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorUnsupportedPtxVersion:
    case cudaErrorStubLibrary:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
    case cudaErrorCallRequiresNewerDriver:
    case cudaErrorSystemNotReady:
    case cudaErrorInitializationError:
        return PS_EUNAVAIL;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidResourceHandle:
    case cudaErrorInvalidMemcpyDirection:
    case cudaErrorHostMemoryAlreadyRegistered:
    case cudaErrorHostMemoryNotRegistered:
        return PS_EINVAL;
    case cudaErrorMemoryAllocation:
        return PS_ENOMEM;
    default:
        return PS_EINTERNAL;
    }
}

int ps__gpu_result(int cuda_error)
{
    if (cuda_error == cudaSuccess)
        return 0;
    /* The failed call also set the thread's last error; reading it clears it. */
    (void)cudaGetLastError();
    return ps__gpu_error(cuda_error);
}

int ps_gpu_device_count(int *count)
{
    if (count == NULL)
        return PS_EINVAL;
    int n = 0;
    int err = ps__gpu_result(cudaGetDeviceCount(&n));
    if (err != 0)
        return err;
    if (n <= 0)
        return PS_EUNAVAIL;
    *count = n;
    return 0;
}

int ps_gpu_set_device(int device)
{
    if (device < 0)
        return PS_EINVAL;
    return ps__gpu_result(cudaSetDevice(device));
}

int ps_gpu_get_device(int *device)
{
    if (device == NULL)
        return PS_EINVAL;
    int d;
    int err = ps__gpu_result(cudaGetDevice(&d));
    if (err == 0)
        *device = d;
    return err;
}

int ps_gpu_is_device_pointer(const void *ptr, int *is_device)
{
    if (is_device == NULL)
        return PS_EINVAL;
    if (ptr == NULL) {
        *is_device = 0;
        return 0;
    }
    struct cudaPointerAttributes attr;
    int err = ps__gpu_result(cudaPointerGetAttributes(&attr, ptr));
    if (err == PS_EUNAVAIL) {
        /* No driver or no device: no device memory can exist in this process. */
        *is_device = 0;
        return 0;
    }
    if (err != 0)
        return err;
    *is_device = attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
    return 0;
}

int ps_gpu_host_alloc(void **out, size_t bytes)
{
    if (out == NULL || bytes == 0)
        return PS_EINVAL;
    void *p;
    int err = ps__gpu_result(cudaHostAlloc(&p, bytes, cudaHostAllocPortable));
    if (err == 0)
        *out = p;
    return err;
}

void ps_gpu_host_free(void *ptr)
{
    if (ptr != NULL)
        (void)ps__gpu_result(cudaFreeHost(ptr));
}

int ps_gpu_host_register(void *ptr, size_t bytes)
{
    if (ptr == NULL || bytes == 0)
        return PS_EINVAL;
    cudaError_t e = cudaHostRegister(ptr, bytes, cudaHostRegisterPortable);
    /* Memory this system cannot pin (a file on disk, say) is the caller's argument. */
    int err = ps__gpu_result(e);
    return e == cudaErrorNotSupported || e == cudaErrorNotPermitted ? PS_EINVAL : err;
}

int ps_gpu_host_unregister(void *ptr)
{
    if (ptr == NULL)
        return 0;
    return ps__gpu_result(cudaHostUnregister(ptr));
}

int ps_gpu_malloc(void **out, size_t bytes)
{
    if (out == NULL || bytes == 0)
        return PS_EINVAL;
    void *p;
    int err = ps__gpu_result(cudaMalloc(&p, bytes));
    if (err == 0)
        *out = p;
    return err;
}

void ps_gpu_free(void *ptr)
{
    if (ptr != NULL)
        (void)ps__gpu_result(cudaFree(ptr));
}

int ps_gpu_memcpy_async(void *dst, const void *src, size_t bytes, ps_gpu_stream_t stream)
{
    if (bytes == 0)
        return 0;
    if (dst == NULL || src == NULL)
        return PS_EINVAL;
    return ps__gpu_result(
        cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, (cudaStream_t)stream));
}

int ps_gpu_stream_create(ps_gpu_stream_t *out)
{
    if (out == NULL)
        return PS_EINVAL;
    cudaStream_t s;
    int err = ps__gpu_result(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    if (err == 0)
        *out = s;
    return err;
}

void ps_gpu_stream_destroy(ps_gpu_stream_t stream)
{
    if (stream != NULL)
        (void)ps__gpu_result(cudaStreamDestroy((cudaStream_t)stream));
}

int ps_gpu_stream_synchronize(ps_gpu_stream_t stream)
{
    return ps__gpu_result(cudaStreamSynchronize((cudaStream_t)stream));
}

int ps_gpu_fence(void)
{
    cudaEvent_t ev;
    int err = ps__gpu_result(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    if (err != 0)
        return err;
    /* An event recorded on the legacy stream, like any work there, comes
     * after the work of the blocking streams enqueued before it. */
    err = ps__gpu_result(cudaEventRecord(ev, (cudaStream_t)0));
    if (err == 0)
        err = ps__gpu_result(cudaEventSynchronize(ev));
    (void)ps__gpu_result(cudaEventDestroy(ev));
    return err;
}

/* The driver's cuMemGetAddressRange, which the runtime does not offer: the
 * allocation a pointer lies in. Taken from the driver the runtime loaded
 * (no link with libcuda), once. */
typedef CUresult (*get_range_fn)(CUdeviceptr *base, size_t *size, CUdeviceptr ptr);
static get_range_fn get_range;
static pthread_once_t get_range_once = PTHREAD_ONCE_INIT;

static void get_range_load(void)
{
    void *fn = NULL;
    enum cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault,
                                         &found) == cudaSuccess &&
        found == cudaDriverEntryPointSuccess)
        get_range = (get_range_fn)fn;
    else
        (void)cudaGetLastError();
}

_Static_assert(sizeof(cudaIpcMemHandle_t) == PS_GPU_IPC_HANDLE_BYTES,
               "ps_gpu_ipc_t holds a cudaIpcMemHandle_t as it is");

int ps_gpu_ipc_export(const void *ptr, ps_gpu_ipc_t *out)
{
    if (ptr == NULL || out == NULL)
        return PS_EINVAL;
    struct cudaPointerAttributes attr;
    int err = ps__gpu_result(cudaPointerGetAttributes(&attr, ptr));
    if (err != 0)
        return err;
    if (attr.type != cudaMemoryTypeDevice)
        return PS_EINVAL; /* host or managed memory has no IPC handle */
    pthread_once(&get_range_once, get_range_load);
    if (get_range == NULL)
        return PS_EUNAVAIL;
    CUdeviceptr base = 0;
    size_t size = 0;
    if (get_range(&base, &size, (CUdeviceptr)(uintptr_t)ptr) != CUDA_SUCCESS)
        return PS_EINVAL;
    cudaIpcMemHandle_t h;
    err = ps__gpu_result(cudaIpcGetMemHandle(&h, (void *)(uintptr_t)base));
    if (err != 0)
        return err == PS_EINTERNAL ? PS_EINVAL : err; /* e.g. memory of a VMM pool */
    memcpy(out->handle, &h, sizeof(h));
    out->base = (uint64_t)base;
    out->size = (uint64_t)size;
    return 0;
}

int ps_gpu_ipc_open(const ps_gpu_ipc_t *ipc, void **base)
{
    if (ipc == NULL || base == NULL)
        return PS_EINVAL;
    cudaIpcMemHandle_t h;
    memcpy(&h, ipc->handle, sizeof(h));
    void *p = NULL;
    int err = ps__gpu_result(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
    /* Whatever else went wrong, the handle cannot be opened here (one of
     * this process, of a process gone, of another host). */
    if (err != 0)
        return err == PS_EUNAVAIL || err == PS_ENOMEM ? err : PS_EINVAL;
    *base = p;
    return 0;
}

int ps_gpu_ipc_close(void *base)
{
    if (base == NULL)
        return 0;
    return ps__gpu_result(cudaIpcCloseMemHandle(base));
}
