/*
 * A fake CUDA for the client, where no GPU is: the ps_gpu_* functions that
 * libparamsync's client and the integration worker call, over host memory.
 * ps-test-worker-fakegpu links this before libparamsync.a (and client/device.c
 * compiled again without PS_HAVE_CUDA, so that it asks this file, not the
 * driver, whether CUDA is usable), so the `device` scenario runs its device
 * buffers through the client's staging against a real daemon: "device" buffers
 * are heap blocks listed here, pinned memory is what ps_gpu_host_alloc gave or
 * ps_gpu_host_register pinned. It also tells the worker where the client
 * staged its last call (fake_client_gpu_last_pinned), so the scenario can check
 * the path the bytes took. DMA, streams and devices other than one are left to
 * the real `device` scenarios on a GPU.
 *
 * CUDA IPC: a "device" buffer is a shared mapping of a memfd of its own, and
 * its IPC handle names the process and that file descriptor, which another
 * process opens through /proc/PID/fd (the same permission peer copies need)
 * and maps: device peer copies then read the other ranks' "device" inputs
 * across processes as CUDA IPC would. PS_FAKEGPU_IPC_OPEN=fail refuses every
 * open, as a driver that cannot open another process's handle would (=fail:K
 * only in the process whose RANK is K);
 * PS_FAKEGPU_REDUCE=fail makes ps_gpu_reduce_multi fail after it wrote half
 * of its output, as a kernel that faulted would.
 */
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <paramsync/gpu.h>
#include <paramsync/reduce.h>

#include "fake_client_gpu.h"

#define MAX_BLOCKS 64

typedef struct block {
    const uint8_t *p;
    size_t bytes;
    int fd;          /* a device buffer's memfd; -1 for one mapped from another process */
    uint64_t serial; /* a device buffer's number among this process's allocations */
} block_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static block_t dev[MAX_BLOCKS];    /* ps_gpu_malloc, and what ps_gpu_ipc_open mapped */
static block_t pinned[MAX_BLOCKS]; /* ps_gpu_host_alloc and ps_gpu_host_register */
static const void *last_pinned;
static int device_now;
static int ipc_reads; /* copies from another process's device buffer */

#define IPC_MAGIC UINT64_C(0x31637069656b6166) /* "fakeipc1" */

/* Lock held. */
static block_t *find(block_t *t, const void *p)
{
    for (int i = 0; i < MAX_BLOCKS; i++)
        if (t[i].p && (const uint8_t *)p >= t[i].p && (const uint8_t *)p < t[i].p + t[i].bytes)
            return &t[i];
    return NULL;
}

/* Lock held. */
static block_t *add(block_t *t, const void *p, size_t bytes)
{
    block_t *free_slot = NULL;
    for (int i = 0; i < MAX_BLOCKS && !free_slot; i++)
        if (!t[i].p)
            free_slot = &t[i];
    if (free_slot)
        *free_slot = (block_t){p, bytes, -1, 0};
    return free_slot;
}

/* Removes the block starting at p: 0 with what it was in *was (when was is
 * not NULL), or PS_EINVAL when there is none. */
static int drop_block(block_t *t, const void *p, block_t *was)
{
    pthread_mutex_lock(&lock);
    block_t *b = find(t, p);
    int ok = b && b->p == p;
    if (ok) {
        if (was)
            *was = *b;
        *b = (block_t){NULL, 0, -1, 0};
    }
    pthread_mutex_unlock(&lock);
    return ok ? 0 : PS_EINVAL;
}

static int drop(block_t *t, const void *p)
{
    return drop_block(t, p, NULL);
}

int ps_gpu_device_count(int *count)
{
    *count = 1;
    return 0;
}

int ps_gpu_get_device(int *device)
{
    pthread_mutex_lock(&lock);
    *device = device_now;
    pthread_mutex_unlock(&lock);
    return 0;
}

int ps_gpu_set_device(int device)
{
    if (device != 0)
        return PS_EINVAL;
    pthread_mutex_lock(&lock);
    device_now = device;
    pthread_mutex_unlock(&lock);
    return 0;
}

int ps_gpu_is_device_pointer(const void *ptr, int *is_device)
{
    pthread_mutex_lock(&lock);
    *is_device = find(dev, ptr) != NULL;
    pthread_mutex_unlock(&lock);
    return 0;
}

/* A heap block of bytes listed in t: 0 with *ptr, or PS_ENOMEM. */
static int alloc_in(block_t *t, void **ptr, size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    if (!p)
        return PS_ENOMEM;
    pthread_mutex_lock(&lock);
    int rc = add(t, p, bytes ? bytes : 1) ? 0 : PS_ENOMEM;
    pthread_mutex_unlock(&lock);
    if (rc < 0) {
        free(p);
        return rc;
    }
    *ptr = p;
    return 0;
}

/* Maps bytes of fd shared into this process and lists them as device
 * memory (with fd, or -1): 0 with *ptr, or a PS_E* code. */
static int map_device(int fd, size_t bytes, int own_fd, void **ptr)
{
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
        return PS_ENOMEM;
    pthread_mutex_lock(&lock);
    static uint64_t serials;
    block_t *b = add(dev, p, bytes);
    int rc = b ? 0 : PS_ENOMEM;
    if (b) {
        b->fd = own_fd;
        b->serial = ++serials;
    }
    pthread_mutex_unlock(&lock);
    if (rc < 0) {
        munmap(p, bytes);
        return rc;
    }
    *ptr = p;
    return 0;
}

int ps_gpu_malloc(void **ptr, size_t bytes)
{
    if (!ptr || !bytes)
        return PS_EINVAL;
    int fd = memfd_create("fake-device", MFD_CLOEXEC);
    if (fd < 0)
        return PS_ENOMEM;
    int rc = ftruncate(fd, (off_t)bytes) == 0 ? map_device(fd, bytes, fd, ptr) : PS_ENOMEM;
    if (rc < 0)
        close(fd);
    return rc;
}

/* Unmaps a device buffer: one of ps_gpu_malloc's (and closes its memfd) or
 * one that ps_gpu_ipc_open mapped. */
static int unmap_device(void *ptr)
{
    block_t was;
    if (drop_block(dev, ptr, &was) != 0)
        return PS_EINVAL;
    munmap(ptr, was.bytes);
    if (was.fd >= 0)
        close(was.fd);
    return 0;
}

void ps_gpu_free(void *ptr)
{
    if (ptr)
        (void)unmap_device(ptr);
}

int ps_gpu_fence(void)
{
    return 0;
}

int ps_gpu_ipc_export(const void *ptr, ps_gpu_ipc_t *out)
{
    if (!ptr || !out)
        return PS_EINVAL;
    pthread_mutex_lock(&lock);
    block_t *b = find(dev, ptr);
    block_t at = b ? *b : (block_t){NULL, 0, -1, 0};
    pthread_mutex_unlock(&lock);
    if (at.fd < 0)
        return PS_EINVAL; /* host memory, or another process's buffer */
    /* Like CUDA's, a handle names one allocation: fd numbers come back. */
    uint64_t h[4] = {IPC_MAGIC, (uint64_t)getpid(), (uint64_t)at.fd, at.serial};
    memset(out, 0, sizeof(*out));
    memcpy(out->handle, h, sizeof(h));
    out->base = (uint64_t)(uintptr_t)at.p;
    out->size = at.bytes;
    return 0;
}

int ps_gpu_ipc_open(const ps_gpu_ipc_t *ipc, void **base)
{
    if (!ipc || !base)
        return PS_EINVAL;
    uint64_t h[3];
    memcpy(h, ipc->handle, sizeof(h));
    /* "fail": every open refused; "fail:K": only in the process of RANK K. */
    const char *refuse = getenv("PS_FAKEGPU_IPC_OPEN"), *rank = getenv("RANK");
    int refused = refuse && (strcmp(refuse, "fail") == 0 || (strncmp(refuse, "fail:", 5) == 0 &&
                                                             rank && !strcmp(refuse + 5, rank)));
    if (h[0] != IPC_MAGIC || h[1] == (uint64_t)getpid() || !ipc->size || refused)
        return PS_EINVAL;
    char path[64];
    snprintf(path, sizeof(path), "/proc/%llu/fd/%llu", (unsigned long long)h[1],
             (unsigned long long)h[2]);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return PS_EINVAL;
    int rc = map_device(fd, ipc->size, -1, base);
    close(fd);
    return rc;
}

int ps_gpu_ipc_close(void *base)
{
    return base ? unmap_device(base) : 0;
}

int ps_gpu_host_alloc(void **ptr, size_t bytes)
{
    return alloc_in(pinned, ptr, bytes);
}

void ps_gpu_host_free(void *ptr)
{
    if (ptr && drop(pinned, ptr) == 0)
        free(ptr);
}

int ps_gpu_host_register(void *ptr, size_t bytes)
{
    if (!ptr || !bytes)
        return PS_EINVAL;
    pthread_mutex_lock(&lock);
    int rc = find(pinned, ptr) ? PS_EINVAL : add(pinned, ptr, bytes) ? 0 : PS_ENOMEM;
    pthread_mutex_unlock(&lock);
    return rc;
}

int ps_gpu_host_unregister(void *ptr)
{
    return drop(pinned, ptr);
}

/* A copy between a device buffer and pinned host memory notes the host side:
 * that is where the client staged. */
int ps_gpu_memcpy_async(void *dst, const void *src, size_t bytes, ps_gpu_stream_t stream)
{
    (void)stream;
    if (bytes && (!dst || !src))
        return PS_EINVAL;
    pthread_mutex_lock(&lock);
    block_t *from = find(dev, src);
    int dst_dev = find(dev, dst) != NULL, src_dev = from != NULL;
    if (from && from->fd < 0)
        ipc_reads++;
    if (dst_dev != src_dev) {
        const void *host = dst_dev ? src : dst;
        if (find(pinned, host))
            last_pinned = host;
    }
    pthread_mutex_unlock(&lock);
    memmove(dst, src, bytes);
    return 0;
}

int ps_gpu_stream_synchronize(ps_gpu_stream_t stream)
{
    (void)stream;
    return 0;
}

const void *fake_client_gpu_last_pinned(void)
{
    pthread_mutex_lock(&lock);
    const void *p = last_pinned;
    last_pinned = NULL;
    pthread_mutex_unlock(&lock);
    return p;
}

/* The reduce over "device" buffers, by the CPU engine: into a buffer of its
 * own first, since dst may be any input (ps_reduce_multi takes only the
 * first). A read of another process's buffer counts as an IPC read. */
int ps_gpu_reduce_multi(ps_op_t op, ps_dtype_t dtype, void *dst, const void *const *srcs,
                        size_t nsrc, size_t count, ps_gpu_stream_t stream)
{
    (void)stream;
    if (!count)
        return 0;
    size_t bytes = count * ps_dtype_size(dtype);
    const char *fail = getenv("PS_FAKEGPU_REDUCE");
    if (fail && strcmp(fail, "fail") == 0) {
        /* A kernel that faulted half way: half its output written, with garbage. */
        memset(dst, 0x5a, bytes / 2);
        return PS_EINTERNAL;
    }
    void *tmp = malloc(bytes);
    if (!tmp)
        return PS_ENOMEM;
    int rc = ps_reduce_multi(op, dtype, tmp, srcs, nsrc, count);
    if (rc == 0)
        memcpy(dst, tmp, bytes);
    free(tmp);
    pthread_mutex_lock(&lock);
    for (size_t j = 0; j < nsrc; j++) {
        block_t *b = find(dev, srcs[j]);
        if (b && b->fd < 0)
            ipc_reads++;
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

int fake_client_gpu_ipc_reads(void)
{
    pthread_mutex_lock(&lock);
    int n = ipc_reads;
    ipc_reads = 0;
    pthread_mutex_unlock(&lock);
    return n;
}
