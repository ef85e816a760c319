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
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <paramsync/gpu.h>

#include "fake_client_gpu.h"

#define MAX_BLOCKS 64

typedef struct block {
    const uint8_t *p;
    size_t bytes;
} block_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static block_t dev[MAX_BLOCKS];    /* ps_gpu_malloc */
static block_t pinned[MAX_BLOCKS]; /* ps_gpu_host_alloc and ps_gpu_host_register */
static const void *last_pinned;
static int device_now;

/* Lock held. */
static block_t *find(block_t *t, const void *p)
{
    for (int i = 0; i < MAX_BLOCKS; i++)
        if (t[i].p && (const uint8_t *)p >= t[i].p && (const uint8_t *)p < t[i].p + t[i].bytes)
            return &t[i];
    return NULL;
}

/* Lock held. */
static int add(block_t *t, const void *p, size_t bytes)
{
    block_t *free_slot = NULL;
    for (int i = 0; i < MAX_BLOCKS && !free_slot; i++)
        if (!t[i].p)
            free_slot = &t[i];
    if (!free_slot)
        return PS_ENOMEM;
    *free_slot = (block_t){p, bytes};
    return 0;
}

/* Removes the block starting at p: 0, or PS_EINVAL when there is none. */
static int drop(block_t *t, const void *p)
{
    pthread_mutex_lock(&lock);
    block_t *b = find(t, p);
    int ok = b && b->p == p;
    if (ok)
        *b = (block_t){NULL, 0};
    pthread_mutex_unlock(&lock);
    return ok ? 0 : PS_EINVAL;
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
    int rc = add(t, p, bytes ? bytes : 1);
    pthread_mutex_unlock(&lock);
    if (rc < 0) {
        free(p);
        return rc;
    }
    *ptr = p;
    return 0;
}

int ps_gpu_malloc(void **ptr, size_t bytes)
{
    return alloc_in(dev, ptr, bytes);
}

void ps_gpu_free(void *ptr)
{
    if (ptr && drop(dev, ptr) == 0)
        free(ptr);
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
    int rc = find(pinned, ptr) ? PS_EINVAL : add(pinned, ptr, bytes);
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
    int dst_dev = find(dev, dst) != NULL, src_dev = find(dev, src) != NULL;
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
