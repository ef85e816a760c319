/* The shared-memory path: payloads of local workers go through a POSIX segment the agent maps. */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <paramsync/gpu.h>

#include "paramsync/v1/doorbell.h"

/*
 * Over gRPC every payload byte is framed, copied into the transport and out
 * of it on both sides. When the agent runs on this host (the one the worker
 * joined through) the worker instead copies its input into a segment the
 * agent has mapped, sends only the header, and copies its output back when the
 * result frame says it is there. The segment is offered once per size with
 * ShmAttach, which checks the agent really maps the same memory (magic
 * bytes); if it cannot, the comm stays on gRPC for good.
 *
 * Whatever the agent's address (a node's agent is often reached at the
 * node's own IP, or through a Kubernetes service), the segment is offered
 * once: an agent on another host cannot open it, or sees other magic bytes,
 * and says so, and the comm stays on gRPC. PARAMSYNC_SHM=0 turns the path
 * off; payloads under PS__SHM_MIN_BYTES always go as frames, where one gRPC
 * message is cheaper than two copies.
 */

#define PS__SHM_MIN_BYTES (64u << 10)
#define PS__SHM_ALIGN     4096u

/*
 * Direct: a doorbell request whose buffers are large enough (direct_large)
 * and lie outside any segment names the rank's process segment instead
 * (CollectiveHeader.shm_process), and the agent reads the input from the
 * caller's buffer and writes the output into it (process_vm_readv/writev):
 * no copy into a payload segment, none out of it.
 * The agent checks at ShmAttach that it may (docs/ARCHITECTURE.md); where it
 * may not (another PID namespace, ptrace rules), or with
 * PARAMSYNC_SHM_DIRECT=0, the payload segments serve as before.
 *
 * The agent writes into the caller's own memory, so such a request is never
 * abandoned while the agent might still write: a job that broke is waited
 * out (the agent fails the collective within about a second), and only an
 * agent that is gone (the membership stream ended) or whose doorbell thread
 * stopped (PS_DOORBELL_STOPPED) lets the caller have its buffer back
 * unanswered.
 * Doorbell requests only, for that reason: a call, once cancelled, could
 * not tell.
 */
#define PS__DIRECT_MIN_BYTES      (32u << 20) /* on small pages */
#define PS__DIRECT_HUGE_MIN_BYTES (8u << 20)  /* where collapse() gives huge pages */

struct ps__shm {
    char name[64];
    uint8_t *base;
    size_t size;
    int in_use;    /* one collective at a time uses the segment */
    int disabled;  /* the agent cannot map our segments */
    int segments;  /* a doorbell that may name the rank's other segments */
    int doorbells; /* a doorbell: how many the agent keeps for the rank (0: one) */
    int slot;      /* a payload segment: its slot (ShmAttachRequest.slot) */
    int slots;     /* a payload segment: how many slots the agent keeps (0: one) */
    int ready;     /* the process segment: attached, the agent reaches our memory */
    int own_block; /* a process or registered segment: the agent leaves our own block
                      to us (ShmAttachResponse.own_block) */
    int two;       /* a registered segment: the agent takes the output in another one
                      (ShmAttachResponse.two_segments, CollectiveHeader.shm_out) */
    /* a registered segment: the agent's --shm-resident-bytes (UINT64_MAX: not
     * told; ShmAttachResponse.resident_bytes) */
    uint64_t resident;
    /* a registered segment from ps_mem_alloc of PS__MEM_FD_MIN_BYTES or more:
     * its file, kept open for the ranks that copy from it to map
     * (pidfd_getfd; client/peer.c); else -1 */
    int fd;
};

/* Registered memory smaller than this keeps no file open: peer copies of
 * blocks that small pay more for mapping than they save, and a program
 * with many small allocations would run out of descriptors. */
#define PS__MEM_FD_MIN_BYTES ((size_t)1 << 20)

/* PARAMSYNC_SHM=0: neither segment; read on every collective. */
static int shm_off(void)
{
    const char *env = getenv("PARAMSYNC_SHM");
    return env && strcmp(env, "0") == 0;
}

int ps__shm_off(void)
{
    return shm_off();
}

static void segment_unmap(struct ps__shm *s)
{
    if (s->base) {
        munmap(s->base, s->size);
        s->base = NULL;
        s->size = 0;
        /* Only a segment made by segment_create (which sets it) has one. */
        if (s->fd >= 0)
            close(s->fd);
        s->fd = -1;
    }
}

enum { SEG_PAYLOAD, SEG_DOORBELL, SEG_REGISTERED, SEG_PROCESS };

/* Creates a segment of size bytes and offers it to the agent, as a payload
 * segment, a doorbell or registered memory. 0 when the agent attached it; a
 * negative code otherwise (the segment is gone). keep_fd: keep its file
 * open in s->fd (else closed once mapped). */
static int segment_create(ps_comm_t *comm, struct ps__shm *s, size_t size, int kind, int keep_fd)
{
    s->fd = -1;
    static unsigned counter;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t magic = ((uint64_t)getpid() << 32) ^ (uint64_t)ts.tv_nsec ^ (uint64_t)++counter;
    snprintf(s->name, sizeof(s->name), "/paramsync.%d.%u.%llx", (int)getpid(), counter,
             (unsigned long long)(ts.tv_nsec & 0xffffff));
    int fd = shm_open(s->name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0)
        return PS_EUNAVAIL;
    int rc = 0;
    if (ftruncate(fd, (off_t)size) != 0)
        rc = PS_ENOMEM;
    /* tmpfs hands out pages on first touch: with /dev/shm full, the first
     * write into a page would kill whoever makes it with SIGBUS, the agent
     * included (it writes outputs). Reserving them now makes that an error
     * here, and gRPC frames; it also charges the pages to this process's
     * memory cgroup, not the agent's. */
    int fa = rc ? 0 : posix_fallocate(fd, 0, (off_t)size);
    if (fa && fa != EOPNOTSUPP && fa != ENOSYS && fa != EINVAL)
        rc = PS_ENOMEM;
    uint8_t *base = rc ? MAP_FAILED : mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (keep_fd && base != MAP_FAILED)
        s->fd = fd;
    else
        close(fd);
    if (base == MAP_FAILED) {
        shm_unlink(s->name);
        return PS_ENOMEM;
    }
    memcpy(base, &magic, sizeof(magic));

    Paramsync__V1__ShmAttachRequest req = PARAMSYNC__V1__SHM_ATTACH_REQUEST__INIT;
    Paramsync__V1__ShmAttachResponse *resp = NULL;
    req.job = comm->job;
    req.rank = comm->rank;
    req.name = s->name;
    req.size = size;
    req.magic = magic;
    req.doorbell = kind == SEG_DOORBELL;
    req.registered = kind == SEG_REGISTERED;
    req.slot = kind == SEG_PAYLOAD ? (uint32_t)s->slot : 0;
    req.process = kind == SEG_PROCESS;
    req.pid = kind == SEG_PROCESS ? (int32_t)getpid() : 0;
    req.address = kind == SEG_PROCESS ? (uint64_t)(uintptr_t)base : 0;
    rc = ps__rpc_unary(comm->channel, PS__METHOD_SHM_ATTACH, &req.base,
                       &paramsync__v1__shm_attach_response__descriptor, (ProtobufCMessage **)&resp,
                       PS__CONTROL_TIMEOUT_MS, NULL);
    /* An agent before process segments attaches one as a payload segment,
     * without process_memory: not what was asked for. */
    int attached = rc == 0 && resp->attached && (kind != SEG_PROCESS || resp->process_memory);
    s->segments = attached && resp->doorbell_segments;
    s->doorbells = attached ? (int)resp->doorbells : 0;
    int slots = attached ? (int)resp->payload_slots : 0;
    int own = attached && resp->own_block;
    int two = attached && resp->two_segments;
    uint64_t resident = attached && resp->resident_told ? resp->resident_bytes : UINT64_MAX;
    if (resp)
        protobuf_c_message_free_unpacked(&resp->base, NULL);
    /* The agent unlinks the name once it maps the segment; do it here too
     * for every other outcome, so nothing is left in /dev/shm. */
    shm_unlink(s->name);
    if (!attached) {
        munmap(base, size);
        if (s->fd >= 0)
            close(s->fd);
        s->fd = -1;
        return rc < 0 ? rc : PS_ENOTSUP;
    }
    /* The magic bytes were for the agent's check: the memory reads as
     * zeros again, as fresh segments do. */
    memset(base, 0, sizeof(magic));
    /* Read by other threads' payload_claim while this one uses s. */
    pthread_mutex_lock(&comm->lock);
    s->slots = slots;
    s->own_block = own;
    s->two = two;
    s->resident = resident;
    pthread_mutex_unlock(&comm->lock);
    s->base = base;
    s->size = size;
    return 0;
}

/*
 * Registered memory (ps_mem_alloc): each allocation is a segment of its
 * own, attached to the agent for good (until ps_mem_free). A collective
 * whose input and output both lie in one allocation names it with their
 * offsets and the agent reads and writes the caller's buffers themselves:
 * no copy in, no copy out. One collective at a time per allocation (the
 * agent answers a rank only once no step of its segment is still on its way
 * to another rank, which only holds per collective); a concurrent one takes
 * the copying path.
 */
struct ps__mem {
    struct ps__shm seg; /* name, base, size */
    int shared;         /* attached by the agent; else plain memory */
    int staging;        /* device.c's staging buffer (ps__mem_stage_alloc), not the caller's */
    int in_use;
    struct ps__mem *next;
};

static size_t page_round(size_t n)
{
    return (n + PS__SHM_ALIGN - 1) / PS__SHM_ALIGN * PS__SHM_ALIGN;
}

/* Lists m among the comm's registered memory. */
static void mem_link(ps_comm_t *comm, struct ps__mem *m)
{
    pthread_mutex_lock(&comm->lock);
    m->next = comm->mem;
    comm->mem = m;
    pthread_mutex_unlock(&comm->lock);
}

void *ps_mem_alloc(ps_comm_t *comm, size_t bytes)
{
    if (!comm || !bytes || bytes > SIZE_MAX - PS__SHM_ALIGN)
        return NULL;
    struct ps__mem *m = calloc(1, sizeof(*m));
    if (!m)
        return NULL;
    size_t size = page_round(bytes);
    if (shm_off() ||
        segment_create(comm, &m->seg, size, SEG_REGISTERED, size >= PS__MEM_FD_MIN_BYTES) < 0) {
        /* The agent cannot map it (another host, PARAMSYNC_SHM=0, the limit
         * of segments per rank): plain memory, used like any other. */
        void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) {
            free(m);
            return NULL;
        }
        m->seg.base = p;
        m->seg.size = size;
        m->seg.fd = -1;
    } else {
        m->shared = 1;
    }
    mem_link(comm, m);
    return m->seg.base;
}

/* Tells the agent a registered segment is gone (best effort: it drops the
 * rank's segments when the rank leaves anyway). */
static void mem_detach(ps_comm_t *comm, struct ps__mem *m)
{
    Paramsync__V1__ShmDetachRequest req = PARAMSYNC__V1__SHM_DETACH_REQUEST__INIT;
    Paramsync__V1__ShmDetachResponse *resp = NULL;
    req.job = comm->job;
    req.rank = comm->rank;
    req.name = m->seg.name;
    if (ps__rpc_unary(comm->channel, PS__METHOD_SHM_DETACH, &req.base,
                      &paramsync__v1__shm_detach_response__descriptor, (ProtobufCMessage **)&resp,
                      PS__CONTROL_TIMEOUT_MS, NULL) == 0)
        protobuf_c_message_free_unpacked(&resp->base, NULL);
}

int ps_mem_free(ps_comm_t *comm, void *ptr)
{
    if (!ptr)
        return 0;
    if (!comm)
        return PS_EINVAL;
    pthread_mutex_lock(&comm->lock);
    struct ps__mem **pp = &comm->mem;
    while (*pp && ((*pp)->seg.base != ptr || (*pp)->staging))
        pp = &(*pp)->next;
    struct ps__mem *m = *pp;
    int busy = m && m->in_use;
    if (m && !busy)
        *pp = m->next;
    pthread_mutex_unlock(&comm->lock);
    if (!m || busy) {
        ps__report(comm, PS_EINVAL, "mem_free", "%s",
                   m ? "the memory is in use by a collective still running"
                     : "not memory from ps_mem_alloc of this comm");
        return PS_EINVAL;
    }
    if (m->shared)
        mem_detach(comm, m);
    segment_unmap(&m->seg);
    free(m);
    return 0;
}

/* The allocation of comm's registered memory that holds [ptr, ptr + len)
 * whole, or NULL. Lock held. */
static struct ps__mem *mem_holding(ps_comm_t *comm, const void *ptr, size_t len)
{
    const uint8_t *p = ptr;
    for (struct ps__mem *m = comm->mem; m; m = m->next)
        if (p >= m->seg.base && len <= m->seg.size &&
            (size_t)(p - m->seg.base) <= m->seg.size - len)
            return m;
    return NULL;
}

/* Whether [p, p + n) lies in m (n == 0: any p does). */
static int mem_holds(const struct ps__mem *m, const void *p, size_t n)
{
    uintptr_t a = (uintptr_t)p, b = (uintptr_t)m->seg.base;
    return !n || (a >= b && n <= m->seg.size && a - b <= m->seg.size - n);
}

int ps__mem_in_place(ps_comm_t *comm, const void *in, size_t in_bytes, const void *out,
                     size_t out_bytes, uint64_t touched)
{
    const void *first = in_bytes ? in : out;
    if (!comm || !first || (!in_bytes && !out_bytes))
        return 0;
    pthread_mutex_lock(&comm->lock);
    struct ps__mem *m = mem_holding(comm, first, 1);
    int yes = m && m->shared && touched <= m->seg.resident && mem_holds(m, in, in_bytes) &&
              mem_holds(m, out, out_bytes);
    pthread_mutex_unlock(&comm->lock);
    return yes;
}

int ps__mem_file(ps_comm_t *comm, const void *ptr, size_t len, uint64_t *base, uint64_t *size)
{
    if (!comm || !ptr)
        return -1;
    pthread_mutex_lock(&comm->lock);
    struct ps__mem *m = mem_holding(comm, ptr, len);
    int fd = m && m->shared ? m->seg.fd : -1;
    if (fd >= 0) {
        *base = (uint64_t)(uintptr_t)m->seg.base;
        *size = m->seg.size;
    }
    pthread_mutex_unlock(&comm->lock);
    return fd;
}

int ps_mem_is_shared(ps_comm_t *comm, const void *ptr)
{
    return ps__mem_in_place(comm, ptr, 1, NULL, 0, 0);
}

/*
 * Staging segments (device.c): the pinned host buffer a device buffer is
 * copied through is registered memory as well, a segment the agent maps,
 * pinned here for CUDA. The call then goes as one on ps_mem_alloc memory
 * (mem_begin): the agent reduces from the segment and writes the result
 * into it where it lies, by DMA on an agent with CUDA, which pins
 * registered segments. The bytes cross host memory once each way, by the
 * client's two DMA copies; no CPU copy into a payload segment or across
 * processes. NULL where there is no such segment: an agent that cannot map
 * ours (another host; remembered, so it is asked once), PARAMSYNC_SHM=0,
 * the agent's limit of segments, or pinning refused; device.c then stages
 * in memory of its own. *size: the bytes mapped (page-rounded).
 */
void *ps__mem_stage_alloc(ps_comm_t *comm, size_t bytes, size_t *size)
{
    pthread_mutex_lock(&comm->lock);
    int off = comm->stage_segments_off;
    pthread_mutex_unlock(&comm->lock);
    if (!comm->channel || off || shm_off() || !bytes || bytes > SIZE_MAX - PS__SHM_ALIGN)
        return NULL;
    struct ps__mem *m = calloc(1, sizeof(*m));
    if (!m)
        return NULL;
    int rc = segment_create(comm, &m->seg, page_round(bytes), SEG_REGISTERED, 0);
    if (rc < 0) {
        /* An agent that cannot map ours never will. */
        if (rc == PS_ENOTSUP || rc == PS_EUNAVAIL) {
            pthread_mutex_lock(&comm->lock);
            comm->stage_segments_off = 1;
            pthread_mutex_unlock(&comm->lock);
        }
        free(m);
        return NULL;
    }
    /* A data loader's fork does not share the buffer the agent writes. */
    (void)madvise(m->seg.base, m->seg.size, MADV_DONTFORK);
    if (ps_gpu_host_register(m->seg.base, m->seg.size) < 0) {
        mem_detach(comm, m);
        segment_unmap(&m->seg);
        free(m);
        return NULL;
    }
    m->shared = 1;
    m->staging = 1;
    mem_link(comm, m);
    *size = m->seg.size;
    return m->seg.base;
}

/* Frees a staging segment of ps__mem_stage_alloc: unpinned, unmapped and,
 * with detach, dropped by the agent (without: the comm is leaving, and the
 * agent drops the rank's segments then). */
void ps__mem_stage_free(ps_comm_t *comm, void *p, int detach)
{
    pthread_mutex_lock(&comm->lock);
    struct ps__mem **pp = &comm->mem;
    while (*pp && (*pp)->seg.base != p)
        pp = &(*pp)->next;
    struct ps__mem *m = *pp;
    if (m)
        *pp = m->next;
    pthread_mutex_unlock(&comm->lock);
    if (!m)
        return;
    ps_gpu_host_unregister(m->seg.base);
    if (detach)
        mem_detach(comm, m);
    segment_unmap(&m->seg);
    free(m);
}

/* Whether c is in place in torch's form: an all_gather's or gather root's
 * input is its own block of the output (all_gather_into_tensor from a view
 * of its output), a scatter root's output its block of the input. */
static int own_in_place(const ps__coll_t *c)
{
    int k = c->hdr.kind;
    int gathers = k == PARAMSYNC__V1__COLLECTIVE_KIND__ALL_GATHER ||
                  k == PARAMSYNC__V1__COLLECTIVE_KIND__GATHER;
    if (!(gathers || k == PARAMSYNC__V1__COLLECTIVE_KIND__SCATTER) || !c->in_bytes || !c->out_bytes)
        return 0;
    size_t at = (size_t)c->hdr.rank * c->hdr.count * ps_dtype_size((ps_dtype_t)c->hdr.dtype);
    uintptr_t in = (uintptr_t)c->in, out = (uintptr_t)c->out;
    return gathers ? in == out + at : out == in + at;
}

/* Whether c's input and output are placed as the agent accepts them in
 * place: apart, or all_reduce/reduce output exactly over input. (In place
 * in torch's form, own_in_place, only agents that say so take.) */
static int placed_apart(const ps__coll_t *c)
{
    uintptr_t in = (uintptr_t)c->in, out = (uintptr_t)c->out;
    int in_place = (c->hdr.kind == PARAMSYNC__V1__COLLECTIVE_KIND__ALL_REDUCE ||
                    c->hdr.kind == PARAMSYNC__V1__COLLECTIVE_KIND__REDUCE) &&
                   in == out;
    return in_place || !c->in_bytes || !c->out_bytes || in + c->in_bytes <= out ||
           out + c->out_bytes <= in;
}

/* A free registered segment that holds n bytes at p, or NULL. Lock held. */
static struct ps__mem *mem_free_holding(ps_comm_t *comm, const void *p, size_t n)
{
    for (struct ps__mem *m = comm->mem; m; m = m->next)
        if (m->shared && !m->in_use && mem_holds(m, p, n))
            return m;
    return NULL;
}

/* Takes c through registered memory: a segment holding both its input and
 * output, placed apart or (own: own_in_place) in place where the segment's
 * agent takes that; or (not own) the input in one segment and the output
 * in another (CollectiveHeader.shm_out), where the agent takes that, as
 * torch's tensors of two empty() calls are. 1, or 0 when there are none
 * free. */
static int mem_begin(ps_comm_t *comm, ps__coll_t *c, int own)
{
    if ((!c->in_bytes && !c->out_bytes) || !(own || placed_apart(c)))
        return 0;
    uintptr_t in = (uintptr_t)c->in, out = (uintptr_t)c->out;
    int ins = c->in_bytes != 0;
    pthread_mutex_lock(&comm->lock);
    /* Allocations do not overlap: the one holding the input (else the
     * output) holds both, or the output lies in another. */
    struct ps__mem *mo = NULL;
    struct ps__mem *m =
        mem_free_holding(comm, ins ? c->in : c->out, ins ? c->in_bytes : c->out_bytes);
    if (m && !mem_holds(m, c->out, c->out_bytes)) {
        mo = own ? NULL : mem_free_holding(comm, c->out, c->out_bytes);
        if (!mo || !m->seg.two || !mo->seg.two)
            m = mo = NULL;
    }
    if (m && own && !m->seg.own_block)
        m = NULL;
    if (m)
        m->in_use = 1;
    if (mo)
        mo->in_use = 1;
    pthread_mutex_unlock(&comm->lock);
    if (!m)
        return 0;
    struct ps__mem *om = mo ? mo : m;
    c->mem = m;
    c->mem_out = mo;
    c->hdr.shm = m->seg.name;
    c->hdr.shm_out = mo ? mo->seg.name : (char *)protobuf_c_empty_string;
    c->hdr.shm_in_offset = c->in_bytes ? (uint64_t)(in - (uintptr_t)m->seg.base) : 0;
    c->hdr.shm_out_offset = c->out_bytes ? (uint64_t)(out - (uintptr_t)om->seg.base) : 0;
    c->shm_out = c->out_bytes ? c->out : m->seg.base;
    return 1;
}

/*
 * Spares: collectives in flight beside the one using the payload segment
 * (async ones) take a spare payload segment each instead of gRPC frames,
 * made on demand and used the same way (input copied in, output copied
 * out). Each has a slot of its own at the agent (ShmAttachRequest.slot:
 * the first is slot 0, spare i slot i + 1), so a spare that grows replaces
 * only itself; there are as many as the agent keeps slots
 * (ShmAttachResponse.payload_slots, told when the first was attached; none
 * with agents that do not say), at most PS__SPARES.
 */
#define PS__SPARES 3

/* Claims a payload segment: the comm's first, else (while it is busy) a
 * free spare, the largest. NULL: frames. Lock held. */
static struct ps__shm *payload_claim(ps_comm_t *comm)
{
    struct ps__shm *s = comm->shm;
    if (!s && (s = calloc(1, sizeof(*s))))
        comm->shm = s;
    if (!s || s->disabled)
        return NULL;
    if (s->in_use) {
        int spares = s->slots - 1 < PS__SPARES ? s->slots - 1 : PS__SPARES;
        if (spares <= 0)
            return NULL;
        if (!comm->spares) {
            if (!(comm->spares = calloc(PS__SPARES, sizeof(*comm->spares))))
                return NULL;
            for (int i = 0; i < PS__SPARES; i++)
                comm->spares[i].slot = i + 1;
        }
        s = NULL;
        for (int i = 0; i < spares; i++) {
            struct ps__shm *x = &comm->spares[i];
            if (!x->in_use && !x->disabled && (!s || x->size > s->size))
                s = x;
        }
        if (!s)
            return NULL;
    }
    s->in_use = 1;
    return s;
}

/* PARAMSYNC_SHM_DIRECT=0: no process segment; read on every collective. */
static int direct_off(void)
{
    const char *env = getenv("PARAMSYNC_SHM_DIRECT");
    return env && strcmp(env, "0") == 0;
}

/*
 * Huge pages for the direct path: process_vm_readv/writev pin the caller's
 * pages on every call, and 2 MiB pages pin far faster than 4 KiB ones (the
 * direct path went 1.6-2.4x faster on them here: docs/PERFORMANCE.md, "Huge
 * pages"). So when the agent takes a buffer directly for the second time
 * (a training loop's buffers come back every step; a buffer used once, as a
 * one-off broadcast of weights, would pay the collapse for nothing), the
 * client asks the kernel to back the buffer's whole 2 MiB pages with huge
 * ones (madvise(MADV_COLLAPSE), Linux 6.1 and later; the contents stay).
 * That costs a copy once (about 25 ms per 64 MiB here); later calls find the
 * pages huge and return at once, or collapse what could not be taken the
 * time before (one EAGAIN). A range the kernel would not collapse (older
 * kernel, THP off, no free huge page, not anonymous memory, pinned) is not
 * asked again while it stays among the last PS__COLLAPSE_FAILED such;
 * PARAMSYNC_SHM_COLLAPSE=0 turns it off.
 */
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25 /* Linux 6.1; glibc headers before 2.37 lack it */
#endif
#define PS__COLLAPSE_SEEN   64
#define PS__COLLAPSE_FAILED 16

typedef struct {
    uintptr_t at, end;
} ps__range_t;

static pthread_mutex_t collapse_lock = PTHREAD_MUTEX_INITIALIZER;
static ps__range_t collapse_seen[PS__COLLAPSE_SEEN], collapse_failed[PS__COLLAPSE_FAILED];
static ps__range_t collapse_eagain[PS__COLLAPSE_FAILED]; /* refused once, for now */
static unsigned collapse_seen_next, collapse_failed_next, collapse_eagain_next;

/* Whether [at, end) is among the n ranges of t. */
static int range_among(const ps__range_t *t, unsigned n, uintptr_t at, uintptr_t end)
{
    for (unsigned i = 0; i < n; i++)
        if (t[i].at == at && t[i].end == end)
            return 1;
    return 0;
}

/* Notes [at, end) in ring t of n ranges at *next (the oldest goes). */
static void range_note(ps__range_t *t, unsigned n, unsigned *next, uintptr_t at, uintptr_t end)
{
    t[*next % n].at = at;
    t[*next % n].end = end;
    ++*next;
}

/* PARAMSYNC_SHM_COLLAPSE=0: no collapse(), and direct_min() as on small pages. */
static int collapse_off(void)
{
    const char *env = getenv("PARAMSYNC_SHM_COLLAPSE");
    return env && strcmp(env, "0") == 0;
}

void *ps__huge_map(size_t size)
{
    uint8_t *m = mmap(NULL, size + PS__HUGE_PAGE, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED)
        return NULL;
    uint8_t *p = (uint8_t *)(((uintptr_t)m + PS__HUGE_PAGE - 1) & ~(uintptr_t)(PS__HUGE_PAGE - 1));
    if (p > m)
        munmap(m, (size_t)(p - m));
    if (m + PS__HUGE_PAGE > p)
        munmap(p + size, (size_t)(m + PS__HUGE_PAGE - p));
    (void)madvise(p, size, MADV_HUGEPAGE);
    return p;
}

/* Asks for huge pages under the 2 MiB pages wholly inside [buf, buf + len),
 * from the second time that range comes. */
static void collapse(const void *buf, size_t len)
{
    uintptr_t at = ((uintptr_t)buf + PS__HUGE_PAGE - 1) & ~(PS__HUGE_PAGE - 1);
    uintptr_t end = ((uintptr_t)buf + len) & ~(PS__HUGE_PAGE - 1);
    if (collapse_off() || !buf || end <= at)
        return;
    pthread_mutex_lock(&collapse_lock);
    int again = range_among(collapse_seen, PS__COLLAPSE_SEEN, at, end);
    int refused = range_among(collapse_failed, PS__COLLAPSE_FAILED, at, end);
    if (!again)
        range_note(collapse_seen, PS__COLLAPSE_SEEN, &collapse_seen_next, at, end);
    pthread_mutex_unlock(&collapse_lock);
    if (!again || refused || madvise((void *)at, end - at, MADV_COLLAPSE) == 0)
        return;
    /* EAGAIN: some pages could not be taken just then (another CPU's batch
     * of new pages held them, say): the next call asks again, but a second
     * EAGAIN for the range (pages pinned for good, as registered with a device)
     * counts as a refusal. */
    int now = errno == EAGAIN;
    pthread_mutex_lock(&collapse_lock);
    if (now && !range_among(collapse_eagain, PS__COLLAPSE_FAILED, at, end))
        range_note(collapse_eagain, PS__COLLAPSE_FAILED, &collapse_eagain_next, at, end);
    else
        range_note(collapse_failed, PS__COLLAPSE_FAILED, &collapse_failed_next, at, end);
    pthread_mutex_unlock(&collapse_lock);
}

void ps__collapse_buffers(const ps__coll_t *c, const void *in, size_t in_bytes, const void *out,
                          size_t out_bytes)
{
    /* device.c made that one of huge pages and pinned it, or it is a segment. */
    if (c->stage_pinned && c->stage_kind != PS__STAGE_DRIVER)
        return;
    collapse(in, in_bytes);
    if (out != in || out_bytes != in_bytes) /* all_reduce's one buffer: once */
        collapse(out, out_bytes);
}

/* Whether this kernel collapses memory on request (MADV_COLLAPSE, Linux
 * 6.1; transparent huge pages not "never"): tried once on a scratch page. */
static int collapse_probe(void)
{
    uint8_t *at = ps__huge_map(PS__HUGE_PAGE);
    if (!at)
        return 0;
    memset(at, 1, PS__HUGE_PAGE);
    int ok = madvise(at, PS__HUGE_PAGE, MADV_COLLAPSE) == 0;
    munmap(at, PS__HUGE_PAGE);
    return ok;
}

/* The fewest bytes of buffers a doorbell request takes directly. Pinning
 * small pages costs so much that copying through the payload segment was
 * faster up to 32 MiB here; on huge pages direct went ahead from about
 * 8 MiB (docs/PERFORMANCE.md, "Huge pages"). So 8 MiB where collapse() can
 * give them (collapse_probe, once), unless PARAMSYNC_SHM_COLLAPSE=0. */
static size_t direct_min(void)
{
    static int works = -1;
    if (collapse_off())
        return PS__DIRECT_MIN_BYTES;
    pthread_mutex_lock(&collapse_lock);
    if (works < 0)
        works = collapse_probe();
    int huge = works;
    pthread_mutex_unlock(&collapse_lock);
    return huge ? PS__DIRECT_HUGE_MIN_BYTES : PS__DIRECT_MIN_BYTES;
}

/* Whether c is large enough to go direct: its buffers hold direct_min()
 * bytes, counted once where input and output overlap (own: in place) on
 * huge pages; on small pages, as measured when that floor was set, input
 * and output bytes together. */
static int direct_large(const ps__coll_t *c, int own)
{
    size_t min = direct_min(), both = c->in_bytes + c->out_bytes;
    size_t once = c->in_bytes > c->out_bytes ? c->in_bytes : c->out_bytes;
    if (min == PS__DIRECT_MIN_BYTES)
        return both >= min;
    return (own || c->in == c->out ? once : both) >= min;
}

/* Takes c (a doorbell request) straight from and into the caller's buffers
 * through the rank's process segment, made and offered once: 1, or 0 (the
 * agent cannot reach this process's memory, or c in place (own:
 * own_in_place) and the agent does not take that, c is too small, or direct
 * is off). */
static int direct_begin(ps_comm_t *comm, ps__coll_t *c, int own)
{
    /* Not the driver's pinned buffers that stage small device buffers
     * (device.c): it maps them in ways the kernel may refuse to pin for
     * another process; the huge-page mappings it stages large ones in are
     * ordinary memory. */
    if ((c->stage_pinned && c->stage_kind == PS__STAGE_DRIVER) || !(own || placed_apart(c)) ||
        direct_off() || !direct_large(c, own))
        return 0;
    pthread_mutex_lock(&comm->lock);
    struct ps__shm *p = comm->process;
    if (!p && (p = calloc(1, sizeof(*p))))
        comm->process = p;
    int make = p && !p->ready && !p->disabled && !p->in_use; /* in_use: being made */
    if (make)
        p->in_use = 1;
    int ready = p && p->ready, takes_own = p && p->own_block;
    pthread_mutex_unlock(&comm->lock);
    if (make) {
        int rc = segment_create(comm, p, PS__SHM_ALIGN, SEG_PROCESS, 0);
        pthread_mutex_lock(&comm->lock);
        p->in_use = 0;
        p->ready = ready = rc == 0;
        takes_own = p->own_block;
        /* Refused (the agent may not reach us, or predates this) or failed:
         * the payload segments serve, for good. */
        p->disabled = rc < 0;
        pthread_mutex_unlock(&comm->lock);
    }
    if (!ready || (own && !takes_own))
        return 0;
    c->hdr.shm = p->name;
    c->hdr.shm_process = 1;
    c->hdr.shm_in_offset = c->in_bytes ? (uint64_t)(uintptr_t)c->in : 0;
    c->hdr.shm_out_offset = c->out_bytes ? (uint64_t)(uintptr_t)c->out : 0;
    c->shm_out = c->out_bytes ? c->out : p->base; /* the output is where it belongs */
    ps__collapse_buffers(c, c->in, c->in_bytes, c->out, c->out_bytes);
    return 1;
}

int ps__shm_begin(ps_comm_t *comm, ps__coll_t *c, int rung)
{
    /* In place: the agent leaves the own block, which holds the input. */
    int own = own_in_place(c);
    if (mem_begin(comm, c, own) || (rung && direct_begin(comm, c, own))) {
        c->hdr.own_block = own;
        return 1;
    }
    /* all_reduce and reduce produce step by step what they consume, at the
     * same offsets: the agent writes each output step over its input, which
     * it has reduced by then, so the segment holds the tensor once. Other
     * kinds put the output after the input. */
    int in_place = c->hdr.kind == PARAMSYNC__V1__COLLECTIVE_KIND__ALL_REDUCE ||
                   c->hdr.kind == PARAMSYNC__V1__COLLECTIVE_KIND__REDUCE;
    size_t out_off =
        in_place ? 0 : (c->in_bytes + PS__SHM_ALIGN - 1) / PS__SHM_ALIGN * PS__SHM_ALIGN;
    size_t need = in_place ? (c->in_bytes > c->out_bytes ? c->in_bytes : c->out_bytes)
                           : out_off + c->out_bytes;
    if (!rung && c->in_bytes + c->out_bytes < PS__SHM_MIN_BYTES)
        return 0;
    if (shm_off())
        return 0;
    pthread_mutex_lock(&comm->lock);
    struct ps__shm *s = payload_claim(comm);
    pthread_mutex_unlock(&comm->lock);
    if (!s)
        return 0;

    if (s->size < need) {
        /* Grow by doubling so a training loop settles on one segment. */
        size_t size = s->size ? s->size : PS__SHM_ALIGN;
        while (size < need)
            size *= 2;
        segment_unmap(s);
        int rc = segment_create(comm, s, size, SEG_PAYLOAD, 0);
        if (rc < 0) {
            pthread_mutex_lock(&comm->lock);
            s->in_use = 0;
            /* An agent that cannot map ours never will: stay on gRPC. */
            s->disabled = rc == PS_ENOTSUP || rc == PS_EUNAVAIL;
            pthread_mutex_unlock(&comm->lock);
            return 0;
        }
    }
    if (c->in_bytes)
        memcpy(s->base, c->in, c->in_bytes);
    c->seg = s;
    c->hdr.shm = s->name;
    c->hdr.shm_in_offset = 0;
    c->hdr.shm_out_offset = out_off;
    c->shm_out = s->base + out_off;
    return 1;
}

/* With discard (a doorbell request abandoned: the agent may still write
 * into the segment) the payload segment is unmapped, and the next
 * collective makes a new one. */
static void shm_end(ps_comm_t *comm, ps__coll_t *c, int discard)
{
    if (!c->shm_out)
        return;
    pthread_mutex_lock(&comm->lock);
    if (c->mem) {
        c->mem->in_use = 0;
        if (c->mem_out)
            c->mem_out->in_use = 0;
    } else if (c->seg) {
        if (discard)
            segment_unmap(c->seg);
        c->seg->in_use = 0;
    }
    pthread_mutex_unlock(&comm->lock);
    c->mem = c->mem_out = NULL;
    c->seg = NULL;
    c->shm_out = NULL;
    c->hdr.shm = c->hdr.shm_out = (char *)protobuf_c_empty_string;
    c->hdr.shm_process = 0;
    c->hdr.own_block = 0;
    c->hdr.shm_in_offset = 0;
    c->hdr.shm_out_offset = 0;
}

void ps__shm_end(ps_comm_t *comm, ps__coll_t *c)
{
    shm_end(comm, c, 0);
}

/*
 * The doorbell (proto/paramsync/v1/doorbell.h): when the agent is on this
 * host (it serves the request, or forwards it to the job's hub agent), a
 * collective goes without a gRPC call: the header into a second, small
 * segment, a futex wake, a futex wait for the answer. A gRPC call costs
 * several thread hand-offs in gRPC's core on both sides; this costs two
 * wake-ups. Input and output that fit in the doorbell go in it; larger ones
 * go through the payload segment or registered memory, whatever their size
 * (PS__SHM_MIN_BYTES is for calls), when the agent takes such requests
 * (ShmAttachResponse.doorbell_segments). One collective at a time uses a
 * doorbell: collectives in flight side by side (async ones) each claim their
 * own, made on demand up to as many as the agent keeps for a rank
 * (ShmAttachResponse.doorbells; one for agents that do not say); past that
 * one takes a call. A request abandoned (the job broke while it waited)
 * retires its doorbell and the payload segment, since the agent may still
 * answer into them.
 */

#define PS__DOORBELLS 8 /* the most a comm makes, whatever the agent keeps */

struct ps__doorbell {
    struct ps__shm seg;
    ps_doorbell_ctl_t *ctl;
    int in_use;   /* claimed for a request, or being made */
    int disabled; /* refused, closed by the agent, or abandoned: never again */
};

struct ps__doorbells {
    struct ps__doorbell d[PS__DOORBELLS];
    int n;   /* slots made or being made */
    int max; /* the most the agent keeps: 1 until its first answer says */
};

/* A doorbell of the comm claimed for one request (a free one, else a new
 * one while the agent takes more), or NULL: this collective takes a call. */
static struct ps__doorbell *doorbell_claim(ps_comm_t *comm)
{
    if (shm_off())
        return NULL;
    pthread_mutex_lock(&comm->lock);
    struct ps__doorbells *p = comm->doorbells;
    if (!p && (p = calloc(1, sizeof(*p)))) {
        p->max = 1;
        comm->doorbells = p;
    }
    struct ps__doorbell *d = NULL;
    if (p && !comm->broken && !comm->finalizing) {
        for (int i = 0; i < p->n && !d; i++)
            if (!p->d[i].in_use && !p->d[i].disabled)
                d = &p->d[i];
        if (!d && p->n < p->max)
            d = &p->d[p->n++];
    }
    if (!d) {
        pthread_mutex_unlock(&comm->lock);
        return NULL;
    }
    d->in_use = 1;
    pthread_mutex_unlock(&comm->lock);

    if (!d->seg.base) {
        int rc = segment_create(comm, &d->seg, PS_DOORBELL_SIZE, SEG_DOORBELL, 0);
        pthread_mutex_lock(&comm->lock);
        if (rc < 0) {
            /* Refused (another host, an older agent) or failed: no more
             * are made, and without the first one calls it is, for good. */
            d->in_use = 0;
            d->disabled = 1;
            p->max = p->n;
            pthread_mutex_unlock(&comm->lock);
            return NULL;
        }
        d->ctl = (ps_doorbell_ctl_t *)(void *)(d->seg.base + PS_DOORBELL_CTL);
        if (d == &p->d[0]) {
            int most = d->seg.doorbells;
            p->max = most < 1 ? 1 : most > PS__DOORBELLS ? PS__DOORBELLS : most;
        }
        pthread_mutex_unlock(&comm->lock);
    }
    if (__atomic_load_n(&d->ctl->closed, __ATOMIC_ACQUIRE)) {
        pthread_mutex_lock(&comm->lock);
        d->in_use = 0;
        d->disabled = 1;
        pthread_mutex_unlock(&comm->lock);
        return NULL;
    }
    return d;
}

static void doorbell_release(ps_comm_t *comm, struct ps__doorbell *d)
{
    pthread_mutex_lock(&comm->lock);
    d->in_use = 0;
    pthread_mutex_unlock(&comm->lock);
}

/* Rings d with c's header (whose shm names where the payload is) and waits
 * for the answer: 0 when answered (ctl holds it), 1 when abandoned (*rc and
 * *msg say why; the doorbell is retired), -1 when not rung (the header does
 * not fit: a call it is). */
static int doorbell_ring(ps_comm_t *comm, struct ps__doorbell *d, ps__coll_t *c, int *rc,
                         char **msg)
{
    ps_doorbell_ctl_t *ctl = d->ctl;
    size_t hl = protobuf_c_message_get_packed_size(&c->hdr.base);
    if (hl > PS_DOORBELL_HEADER)
        return -1;
    protobuf_c_message_pack(&c->hdr.base, ctl->header);
    ctl->header_len = (uint32_t)hl;
    uint32_t req = __atomic_load_n(&ctl->req, __ATOMIC_RELAXED) + 1;
    __atomic_store_n(&ctl->req, req, __ATOMIC_RELEASE);
    ps_doorbell_futex(&ctl->req, FUTEX_WAKE, 1, NULL);

    for (;;) {
        uint32_t r = __atomic_load_n(&ctl->resp, __ATOMIC_ACQUIRE);
        if (r == req)
            return 0;
        /* Short waits: a job that breaks meanwhile (a peer lost, the agent
         * gone) is noticed on the next turn. */
        struct timespec slice = {0, 50 * 1000 * 1000};
        ps_doorbell_futex(&ctl->resp, FUTEX_WAIT, r, &slice);
        if (__atomic_load_n(&ctl->resp, __ATOMIC_ACQUIRE) == req)
            return 0;
        uint32_t closed = __atomic_load_n(&ctl->closed, __ATOMIC_ACQUIRE);
        pthread_mutex_lock(&comm->lock);
        int broken = comm->broken, gone = comm->join_ended;
        char *why = broken && comm->broken_msg ? strdup(comm->broken_msg) : NULL;
        /* A direct request waits until the agent cannot write any more into
         * the caller's buffers (see "Direct" above). */
        if (c->hdr.shm_process ? gone || (closed & PS_DOORBELL_STOPPED) : broken || gone || closed)
            d->disabled = 1; /* abandoned: the agent may still answer into it */
        pthread_mutex_unlock(&comm->lock);
        if (d->disabled) {
            *rc = broken ? broken : PS_EUNAVAIL;
            *msg = why ? why
                       : strdup(gone ? "lost the membership stream to the agent"
                                     : "the agent closed the doorbell (it is stopping)");
            return 1;
        }
        free(why);
    }
}

int ps__doorbell_run(ps_comm_t *comm, ps__coll_t *c, int *rc, char **msg)
{
    int small = c->in_bytes <= PS_DOORBELL_PAYLOAD && c->out_bytes <= PS_DOORBELL_PAYLOAD;
    struct ps__doorbell *d = doorbell_claim(comm);
    if (!d)
        return 0;
    if (small) {
        c->hdr.shm = d->seg.name;
        c->hdr.shm_out_offset = PS_DOORBELL_OUT;
        if (c->in_bytes)
            memcpy(d->seg.base, c->in, c->in_bytes);
    } else if (!d->seg.segments || !ps__shm_begin(comm, c, 1)) {
        doorbell_release(comm, d);
        return 0;
    }
    int rung = doorbell_ring(comm, d, c, rc, msg);
    if (rung == 0) {
        ps_doorbell_ctl_t *ctl = d->ctl;
        int code = ctl->code;
        if (code != 0) {
            *rc = code > 0 ? -code : PS_EUNKNOWN;
            *msg = strndup(ctl->message, sizeof(ctl->message) - 1); /* NUL-ended by the agent */
        } else if (c->out_bytes && !ctl->shm) {
            *rc = PS_EINTERNAL;
            *msg = strdup("the agent answered the doorbell without the output");
        } else {
            const uint8_t *out = small ? d->seg.base + PS_DOORBELL_OUT : c->shm_out;
            if (c->out_bytes && c->out != out) /* else registered memory */
                memcpy(c->out, out, c->out_bytes);
            c->source = ctl->source;
            *rc = 0;
        }
    }
    if (small) {
        c->hdr.shm = (char *)protobuf_c_empty_string;
        c->hdr.shm_out_offset = 0;
    } else {
        shm_end(comm, c, rung == 1);
    }
    if (rung != 1)
        doorbell_release(comm, d);
    return rung >= 0;
}

/* The bytes of the ps_mem_alloc allocation at p (0: none). */
static size_t mem_size(ps_comm_t *comm, const void *p)
{
    pthread_mutex_lock(&comm->lock);
    struct ps__mem *m = comm->mem;
    while (m && m->seg.base != p)
        m = m->next;
    size_t size = m ? m->seg.size : 0;
    pthread_mutex_unlock(&comm->lock);
    return size;
}

void *ps__scratch_take(ps_comm_t *comm, size_t bytes)
{
    void *p = NULL;
    pthread_mutex_lock(&comm->lock);
    /* The smallest kept one that fits: the largest stays for larger calls. */
    int k = -1;
    for (int i = 0; i < PS__SCRATCH_KEEP; i++)
        if (comm->scratch[i].p && comm->scratch[i].size >= bytes)
            k = i;
    if (k >= 0) {
        p = comm->scratch[k].p;
        for (int i = k; i + 1 < PS__SCRATCH_KEEP; i++)
            comm->scratch[i] = comm->scratch[i + 1];
        comm->scratch[PS__SCRATCH_KEEP - 1].p = NULL;
        comm->scratch[PS__SCRATCH_KEEP - 1].size = 0;
    }
    pthread_mutex_unlock(&comm->lock);
    return p ? p : ps_mem_alloc(comm, bytes ? bytes : 1);
}

void ps__scratch_give(ps_comm_t *comm, void *p)
{
    if (!p)
        return;
    size_t size = mem_size(comm, p);
    void *drop = p;
    pthread_mutex_lock(&comm->lock);
    if (size && size <= comm->scratch_max) {
        /* Into its place by size, largest first; the smallest falls out. */
        int k = 0;
        while (k < PS__SCRATCH_KEEP && comm->scratch[k].p && comm->scratch[k].size >= size)
            k++;
        if (k < PS__SCRATCH_KEEP) {
            drop = comm->scratch[PS__SCRATCH_KEEP - 1].p;
            for (int i = PS__SCRATCH_KEEP - 1; i > k; i--)
                comm->scratch[i] = comm->scratch[i - 1];
            comm->scratch[k].p = p;
            comm->scratch[k].size = size;
        }
    }
    pthread_mutex_unlock(&comm->lock);
    if (drop)
        ps_mem_free(comm, drop);
}

void ps__shm_free(ps_comm_t *comm)
{
    /* Registered memory goes with the comm (the agent dropped it when the
     * rank left), the kept scratch buffers among it. */
    memset(comm->scratch, 0, sizeof(comm->scratch));
    while (comm->mem) {
        struct ps__mem *m = comm->mem;
        comm->mem = m->next;
        if (m->staging)
            ps_gpu_host_unregister(m->seg.base);
        segment_unmap(&m->seg);
        free(m);
    }
    if (comm->doorbells) {
        for (int i = 0; i < comm->doorbells->n; i++)
            segment_unmap(&comm->doorbells->d[i].seg);
        free(comm->doorbells);
        comm->doorbells = NULL;
    }
    if (comm->process) {
        segment_unmap(comm->process);
        free(comm->process);
        comm->process = NULL;
    }
    if (comm->spares) {
        for (int i = 0; i < PS__SPARES; i++)
            segment_unmap(&comm->spares[i]);
        free(comm->spares);
        comm->spares = NULL;
    }
    if (!comm->shm)
        return;
    segment_unmap(comm->shm);
    free(comm->shm);
    comm->shm = NULL;
}
