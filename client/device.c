/* Collectives on CUDA device buffers: detection, and staging through pinned host memory. */
#include "internal.h"

#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#ifdef PS_HAVE_CUDA
#include <dlfcn.h>
#include <link.h>
#endif

#include <paramsync/gpu.h>

/*
 * The client never hands a device pointer to gRPC or to memcpy: a device
 * input is copied into pinned host memory before the call starts, and a
 * device output receives the result from pinned memory after the call has
 * succeeded, so that a failed call leaves the caller's device buffer as it
 * was. Pinned memory makes both copies DMA transfers (a pageable buffer
 * would cost CUDA a second, CPU-side copy through its own staging area).
 */

/* Whether this process can have device memory at all: 1 yes, -1 no (for
 * good), 0 not known yet. Settled once; host pointers then cost one load. */
static atomic_int cuda_state;

#ifdef PS_HAVE_CUDA
/* The loader's count of objects loaded so far when libcuda.so.1 was last
 * found absent (0: never looked). */
static atomic_ullong driver_absent_at;

/* dl_iterate_phdr callback: the first object carries the loader's counter
 * of loads (glibc's dlpi_adds), which changes with every library loaded. */
static int read_loads(struct dl_phdr_info *info, size_t size, void *arg)
{
    *(unsigned long long *)arg =
        size >= offsetof(struct dl_phdr_info, dlpi_subs) ? info->dlpi_adds : 0;
    return 1;
}

/* Whether the CUDA driver is loaded in this process. Device memory cannot
 * exist before it is: until then the answer is "host" without asking CUDA,
 * because asking would initialise the driver here, which costs time at the
 * first collective and makes CUDA unusable in children the caller forks
 * later (torch's data loader workers). Looking the driver up by name costs
 * tens of microseconds (the loader searches the file system), so it is
 * looked up again only when a library was loaded since it was last absent:
 * otherwise this is one dl_iterate_phdr step, about 15 ns. */
static int driver_loaded(void)
{
    unsigned long long loads = 0;
    dl_iterate_phdr(read_loads, &loads);
    if (loads != 0 && loads == atomic_load_explicit(&driver_absent_at, memory_order_relaxed))
        return 0;
    void *driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (!driver) {
        atomic_store_explicit(&driver_absent_at, loads, memory_order_relaxed);
        return 0;
    }
    dlclose(driver);
    return 1;
}
#endif

/* Answers whether device pointers can exist in this process. Never fails. */
static int cuda_usable(void)
{
    int state = atomic_load_explicit(&cuda_state, memory_order_acquire);
    if (state != 0)
        return state > 0;
#ifdef PS_HAVE_CUDA
    if (!driver_loaded())
        return 0; /* not cached: the caller may load CUDA later */
#endif
    int n;
    state = ps_gpu_device_count(&n) == 0 ? 1 : -1;
    atomic_store_explicit(&cuda_state, state, memory_order_release);
    return state > 0;
}

int ps__is_device(const void *p, int *dev)
{
    *dev = 0;
    return cuda_usable() ? ps_gpu_is_device_pointer(p, dev) : 0;
}

int ps__stage_classify(const ps__coll_t *c, int *in_dev, int *out_dev)
{
    int in = 0, out = 0, rc = 0;
    if (cuda_usable()) {
        rc = ps_gpu_is_device_pointer(c->in, &in);
        if (rc == 0 && c->out != c->in)
            rc = ps_gpu_is_device_pointer(c->out, &out);
        else
            out = in;
    }
    if (rc < 0) {
        ps__report(c->comm, rc, c->name, "cannot tell whether a buffer is device memory: %s",
                   ps_strerror(rc));
        return rc;
    }
    *in_dev = in;
    *out_dev = out;
    return 0;
}

typedef ps__pinned_t pinned_t;

/* Frees b; a segment's agent is told with detach. */
static void pinned_free(ps_comm_t *comm, pinned_t b, int detach)
{
    if (!b.p)
        return;
    if (b.kind == PS__STAGE_SEGMENT) {
        ps__mem_stage_free(comm, b.p, detach);
    } else if (b.kind == PS__STAGE_MAPPED) {
        ps_gpu_host_unregister(b.p);
        munmap(b.p, b.size);
    } else {
        ps_gpu_host_free(b.p);
    }
}

/*
 * A new pinned buffer of at least bytes, in memory of our own: from 2 MiB,
 * an anonymous mapping of whole 2 MiB pages, advised to be huge
 * (MADV_HUGEPAGE), touched and then pinned: the agent, and peers in peer
 * copies, can read and write it in this process's memory like any large
 * buffer (the direct path), which walks huge pages 2-3x faster than small
 * ones, and pinned memory cannot be collapsed into huge pages later. The
 * driver's own pinned memory (ps_gpu_host_alloc, the fallback and the choice
 * below 2 MiB) is mapped in a way the kernel may refuse to pin for another
 * process, so it never goes direct. Children forked later do not inherit the
 * mapping (MADV_DONTFORK): a data loader's fork does not copy pinned pages.
 */
static int pinned_alloc(size_t bytes, pinned_t *out)
{
    if (bytes >= PS__HUGE_PAGE && bytes <= SIZE_MAX - 2 * PS__HUGE_PAGE) {
        size_t size = (bytes + PS__HUGE_PAGE - 1) & ~(PS__HUGE_PAGE - 1);
        uint8_t *p = ps__huge_map(size);
        if (p) {
            (void)madvise(p, size, MADV_DONTFORK);
            memset(p, 0, size);
            if (ps_gpu_host_register(p, size) == 0) {
                *out = (pinned_t){p, size, PS__STAGE_MAPPED};
                return 0;
            }
            munmap(p, size);
        }
    }
    void *p;
    int rc = ps_gpu_host_alloc(&p, bytes);
    if (rc < 0)
        return rc;
    *out = (pinned_t){p, bytes, PS__STAGE_DRIVER};
    return 0;
}

/* Takes the comm's cached buffer of slot (0: our own memory, 1: a segment)
 * when it holds bytes: 1 with *buf, else 0. */
static int cache_take(ps_comm_t *comm, int slot, size_t bytes, pinned_t *buf)
{
    pthread_mutex_lock(&comm->lock);
    pinned_t *c = &comm->stage_cache[slot];
    int hit = c->p && c->size >= bytes;
    if (hit) {
        *buf = *c;
        *c = (pinned_t){NULL, 0, PS__STAGE_DRIVER};
    }
    pthread_mutex_unlock(&comm->lock);
    return hit;
}

/*
 * Takes a pinned buffer of at least bytes, the comm's cached one when it is
 * large enough, else a new one. With segment, a registered segment the agent
 * maps (ps__mem_stage_alloc), which the call then names as ps_mem_alloc
 * memory: the agent works in it where it lies, with no copy across
 * processes. Where there is none, and without segment (a call that goes by
 * peer copies, which read the ranks' inputs where they lie, faster from huge
 * pages, and refuse registered memory), memory of our own (pinned_alloc).
 * Returns 0 with *buf, or the allocation's error.
 */
static int pinned_take(ps_comm_t *comm, size_t bytes, int segment, pinned_t *buf)
{
    if (segment) {
        if (cache_take(comm, 1, bytes, buf))
            return 0;
        size_t size;
        void *p = ps__mem_stage_alloc(comm, bytes, &size);
        if (p) {
            *buf = (pinned_t){p, size, PS__STAGE_SEGMENT};
            return 0;
        }
    }
    if (cache_take(comm, 0, bytes, buf))
        return 0;
    return pinned_alloc(bytes, buf);
}

/* Gives a pinned buffer back: it becomes the cache of its slot when it is
 * larger than the cached one (several calls in flight each hold their own). */
static void pinned_give(ps_comm_t *comm, pinned_t buf)
{
    pthread_mutex_lock(&comm->lock);
    pinned_t *c = &comm->stage_cache[buf.kind == PS__STAGE_SEGMENT];
    if (buf.size > c->size) {
        pinned_t old = *c;
        *c = buf;
        buf = old;
    }
    pthread_mutex_unlock(&comm->lock);
    pinned_free(comm, buf, 1);
}

/* Where the output goes in the pinned buffer when it does not share the
 * input's bytes: after them, 64-byte aligned. */
static size_t out_offset(size_t in_bytes)
{
    return (in_bytes + 63) & ~(size_t)63;
}

int ps__stage_buffers(ps__coll_t *c, int in_dev, int out_dev)
{
    if (!in_dev && !out_dev)
        return 0;
    int shared = in_dev && out_dev && c->in == c->out;
    size_t bytes, off = 0;
    if (shared) {
        bytes = c->in_bytes > c->out_bytes ? c->in_bytes : c->out_bytes;
    } else if (in_dev && out_dev) {
        off = out_offset(c->in_bytes);
        bytes = off + c->out_bytes;
        if (off < c->in_bytes || bytes < off) {
            ps__report(c->comm, PS_EINVAL, c->name, "device buffers too large to stage");
            return PS_EINVAL;
        }
    } else {
        bytes = in_dev ? c->in_bytes : c->out_bytes;
    }

    const char *step = "cannot allocate pinned host memory to stage the device buffers";
    pinned_t buf = {NULL, 0, 0};
    int device = 0;
    /* Peer copies read the staged input where it lies (not device
     * collectives: their fallback goes through the agent, as do their
     * ranks whose buffers are host memory). */
    int rc = pinned_take(c->comm, bytes, !ps__peer_takes(c) || ps__devcoll_kind(c), &buf);
    void *pinned = buf.p;
    if (rc == 0) {
        step = "cannot read the current CUDA device";
        rc = ps_gpu_get_device(&device);
    }
    if (rc == 0 && in_dev) {
        step = "cannot copy the device input to host memory";
        rc = ps_gpu_memcpy_async(pinned, c->in, c->in_bytes, NULL);
        if (rc == 0)
            rc = ps_gpu_stream_synchronize(NULL);
    }
    if (rc < 0) {
        if (pinned)
            pinned_give(c->comm, buf);
        ps__report(c->comm, rc, c->name, "%s (%zu bytes): %s", step, bytes, ps_strerror(rc));
        return rc;
    }
    c->stage_pinned = pinned;
    c->stage_bytes = buf.size;
    c->stage_kind = buf.kind;
    c->stage_device = device;
    if (in_dev)
        c->in = pinned;
    if (out_dev) {
        c->stage_dev_out = c->out;
        c->out = (char *)pinned + off;
    }
    return 0;
}

int ps__stage_begin(ps__coll_t *c)
{
    int in_dev, out_dev;
    int rc = ps__stage_classify(c, &in_dev, &out_dev);
    return rc < 0 ? rc : ps__stage_buffers(c, in_dev, out_dev);
}

int ps__stage_prepare(ps__coll_t *c)
{
    int in_dev, out_dev;
    int rc = ps__stage_classify(c, &in_dev, &out_dev);
    if (rc < 0)
        return rc;
    /* The other ranks read a device input where it lies, and this rank
     * writes its output itself (peer.c, devcoll.c): no pinned memory, no
     * copy through the host. */
    int ready = 0;
    if (ps__peer_takes(c) && ps__peer_ipc_wanted()) {
        if (ps__devcoll_kind(c))
            ready = ps__devcoll_export(c, in_dev, out_dev);
        else /* a scatter's other ranks have no input: they only read the root's */
            ready =
                (in_dev ? ps_gpu_ipc_export(c->in, &c->peer_ipc) == 0 : !c->in_bytes && out_dev) &&
                ps_gpu_get_device(&c->stage_device) == 0;
    }
    if (ready) {
        c->peer_dev = 1;
        c->defer_in_dev = in_dev;
        c->defer_out_dev = out_dev;
        return 0;
    }
    return ps__stage_buffers(c, in_dev, out_dev);
}

int ps__stage_deferred(ps__coll_t *c)
{
    if (!c->peer_dev)
        return 0;
    c->peer_dev = 0;
    return ps__stage_buffers(c, c->defer_in_dev, c->defer_out_dev);
}

uint64_t ps__device_host(void)
{
    if (!cuda_usable() || !ps__peer_ipc_wanted() || ps__shm_off())
        return 0;
    /* PARAMSYNC_HOST_ID, else the kernel's boot id: one per host and boot,
     * the same in every container there. FNV-1a of its text; never 0. */
    char id[256] = "";
    const char *env = getenv("PARAMSYNC_HOST_ID");
    FILE *f = env && *env ? NULL : fopen("/proc/sys/kernel/random/boot_id", "re");
    if (env && *env)
        snprintf(id, sizeof(id), "%s", env);
    if (f) {
        if (!fgets(id, sizeof(id), f))
            id[0] = 0;
        fclose(f);
    }
    uint64_t h = UINT64_C(0xcbf29ce484222325);
    for (const char *p = id; *p && *p != '\n'; p++)
        h = (h ^ (uint8_t)*p) * UINT64_C(0x100000001b3);
    return h ? h : 1;
}

int ps__stage_end(ps__coll_t *c, int rc)
{
    if (!c->stage_pinned)
        return rc;
    if (rc == 0 && c->stage_dev_out) {
        /* A non-blocking call ends on its own thread, whose current device
         * is not the caller's. */
        int err = ps_gpu_set_device(c->stage_device);
        if (err == 0)
            err = ps_gpu_memcpy_async(c->stage_dev_out, c->out, c->out_bytes, NULL);
        if (err == 0)
            err = ps_gpu_stream_synchronize(NULL);
        if (err < 0) {
            char what[96];
            ps__coll_what(c, what, sizeof(what));
            ps__report(c->comm, err, what,
                       "cannot copy the result (%zu bytes) to the device buffer: %s", c->out_bytes,
                       ps_strerror(err));
            rc = err;
        }
    }
    pinned_t buf = {c->stage_pinned, c->stage_bytes, c->stage_kind};
    /* A failed call's segment is not used again: an agent that gave the
     * call up may still write its answer into it. */
    if (rc < 0 && buf.kind == PS__STAGE_SEGMENT)
        pinned_free(c->comm, buf, 1);
    else
        pinned_give(c->comm, buf);
    c->stage_pinned = NULL;
    c->stage_bytes = 0;
    c->stage_kind = PS__STAGE_DRIVER;
    return rc;
}

void ps__stage_free(ps_comm_t *comm)
{
    /* At finalize: the agent drops the leaving rank's segments itself. */
    for (int slot = 0; slot < 2; slot++) {
        pinned_free(comm, comm->stage_cache[slot], 0);
        comm->stage_cache[slot] = (pinned_t){NULL, 0, PS__STAGE_DRIVER};
    }
    ps__peer_ipc_close_all(comm);
}
