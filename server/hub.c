/* The collective engine of the agent that hosts a job: matching, checking and pipelined data steps.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <grpc/slice.h>
#include <grpc/status.h>

#include <paramsync/gpu.h>
#include <paramsync/reduce.h>

#include "daemon.h"
#include "paramsync/v1/doorbell.h"
#include "log.h"
#include "metrics.h"
#include "rpc/frame.h"
#include "rpc/task.h"

/*
 * Every collective is a sequence of steps. In a step some members contribute
 * a piece of their input and some receive a piece of their output; a step
 * that several members contribute to is a reduction. Each member's input
 * and output pieces are consecutive, so members stream their payloads in
 * order and the engine needs only `window` steps in memory at once.
 *
 * Each member's call is served by its own thread (the reader: it receives
 * frames and deposits contributions); a member whose output spans several
 * steps also gets a writer thread, so receiving and sending overlap and
 * HTTP/2 flow control cannot deadlock a rank that is still sending.
 */

typedef Paramsync__V1__CollectiveHeader header_t;

/* A reference-counted buffer, handed to gRPC without a copy when sent. */
/* A worker's shared-memory segment, mapped by ShmAttach. Views of it (blobs)
 * and members using it hold references, so a worker that leaves or dies
 * mid-collective cannot unmap memory still being read. `views` counts the
 * live views: a member whose input is in the segment is not answered until
 * they are gone, because the worker rewrites the segment once answered and
 * a view may still be on its way to another rank (as a p2p or broadcast
 * output, or an input not reduced yet). */
typedef struct shm_map {
    char *name, *job;
    int rank;
    uint8_t *base;
    size_t size;    /* bytes payloads may use */
    size_t map_len; /* bytes mapped */
    int fd;         /* for pread/pwrite (shm_by_file); -1 for a doorbell or process segment */
    int kind;       /* PS_SHM_PAYLOAD, _DOORBELL (doorbell_main serves it), _REGISTERED
                     * or _PROCESS */
    int pid;        /* a process segment: the worker's process, as this agent sees it */
    int slot;       /* a payload segment's slot (ShmAttachRequest.slot) */
    int closing;    /* doorbell: dropped, its thread is to end */
    int guard;      /* its slot in seg_guards, or -1 */
    int pinned;     /* registered with CUDA (ps_gpu_host_register): the stager's DMA
                     * reads and writes it in place */
    int refs;
    int views;
    void *serve_state; /* doorbell: the agent's (ps__serve_fn), its thread's only */
    struct shm_map *next;
} shm_map_t;

typedef struct blob {
    int refs;
    size_t len;
    uint8_t *data;  /* storage[], a pinned buffer, or a view into map; NULL when held in pieces */
    shm_map_t *map; /* the segment a view belongs to, else NULL */
    /* In pieces (blob_pieces): held[i] are slices of the received frames
     * with the bytes in order. */
    grpc_slice *held;
    int npieces, cap;
    uint8_t *heap; /* data when pieces were copied together (blob_flatten) */
    int pinned;    /* data is a pinned buffer of class pinned_class(len) (blob_new_pinned) */
    uint8_t storage[];
} blob_t;

/* Reference counts of blobs and segments (gRPC releases blobs from its
 * own threads); views_gone is signalled when a segment's last view goes. */
static pthread_mutex_t blob_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t views_gone = PTHREAD_COND_INITIALIZER;

/*
 * A worker can shrink its segment (ftruncate) while the agent uses it, and a
 * touch of a page past the new end is SIGBUS, which would kill the agent and
 * every job on it. Each mapping has a guard slot; the SIGBUS handler maps
 * zero pages over the rest of the mapping the fault is in, marks it broken
 * and returns, so the copy goes on harmlessly; the collective using it then
 * fails with DATA_LOSS (shm_broken_check). A fault anywhere else is left to
 * the handler that was there before (by default: the process dies, as it
 * would have).
 */
#define PS_HUB_GUARDS 16384

typedef struct seg_guard {
    _Atomic uintptr_t base; /* 0: a free slot */
    _Atomic size_t len;
    _Atomic int broken;
} seg_guard_t;

static seg_guard_t seg_guards[PS_HUB_GUARDS];
static pthread_mutex_t guard_lock = PTHREAD_MUTEX_INITIALIZER;
static struct sigaction sigbus_old;
static pthread_once_t sigbus_once = PTHREAD_ONCE_INIT;
static uintptr_t guard_page = 4096;

static void sigbus_handler(int sig, siginfo_t *si, void *uc)
{
    (void)sig;
    (void)uc;
    uintptr_t a = (uintptr_t)si->si_addr;
    for (int i = 0; i < PS_HUB_GUARDS; i++) {
        uintptr_t b = atomic_load(&seg_guards[i].base);
        size_t n = atomic_load(&seg_guards[i].len);
        if (!b || a < b || a >= b + n)
            continue;
        uintptr_t page = a & ~(guard_page - 1);
        if (mmap((void *)page, b + n - page, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) != MAP_FAILED) {
            atomic_store(&seg_guards[i].broken, 1);
            return;
        }
        break;
    }
    /* Not a segment's: the fault comes again, to what was there before. */
    sigaction(SIGBUS, &sigbus_old, NULL);
}

static void sigbus_install(void)
{
    guard_page = (uintptr_t)sysconf(_SC_PAGESIZE);
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = sigbus_handler;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, &sigbus_old);
}

/* A guard slot for a mapping, or -1 when every slot is taken. */
static int guard_add(uint8_t *base, size_t len)
{
    pthread_once(&sigbus_once, sigbus_install);
    pthread_mutex_lock(&guard_lock);
    int slot = -1;
    for (int i = 0; i < PS_HUB_GUARDS && slot < 0; i++)
        if (!atomic_load(&seg_guards[i].base))
            slot = i;
    if (slot >= 0) {
        atomic_store(&seg_guards[slot].broken, 0);
        atomic_store(&seg_guards[slot].len, len);
        atomic_store(&seg_guards[slot].base, (uintptr_t)base);
    }
    pthread_mutex_unlock(&guard_lock);
    return slot;
}

static void guard_drop(int slot)
{
    if (slot >= 0)
        atomic_store(&seg_guards[slot].base, 0);
}

/* Whether segment m shrank under the agent (a SIGBUS was caught in it). */
static int shm_broken(const shm_map_t *m)
{
    return m && m->guard >= 0 && atomic_load(&seg_guards[m->guard].broken);
}

/* Whether pinned segment m's file is shorter now than the agent mapped it;
 * marks it broken then, as a SIGBUS would. The device's DMA reads the pages
 * a truncation took from the file without a fault, so only the file's size
 * tells. An fstat, for pinned segments only: a pageable one faults. */
static int shm_shrank(const shm_map_t *m)
{
    struct stat st;
    if (!m || !m->pinned || m->fd < 0 || m->guard < 0 || fstat(m->fd, &st) != 0 ||
        (uint64_t)st.st_size >= m->map_len)
        return 0;
    atomic_store(&seg_guards[m->guard].broken, 1);
    return 1;
}

static void shm_unref(shm_map_t *m)
{
    pthread_mutex_lock(&blob_lock);
    int last = --m->refs == 0;
    pthread_mutex_unlock(&blob_lock);
    if (last) {
        guard_drop(m->guard);
        if (m->pinned && ps_gpu_host_unregister(m->base) == 0)
            ps__metrics_pinned(PS_M_PIN_SEGMENTS, -(int64_t)m->map_len);
        munmap(m->base, m->map_len);
        if (m->fd >= 0)
            close(m->fd);
        free(m->name);
        free(m->job);
        free(m);
    }
}

/* Remote ranges per process_vm_readv/writev of a list form. */
#define SEG_REMOTE 64

/* The place of one side of a member's payload of `total` bytes, as its
 * header gives it: from `at`, or in the n parts of `list` (shm_lists_hold
 * checks that they split `total` evenly). */
static ps__shm_place_t shm_place(uint64_t at, const uint64_t *list, size_t n, uint64_t total)
{
    ps__shm_place_t pl = {at, n ? list : NULL, n, n ? total / n : 0};
    return pl;
}

/* Where a member's `in` input and `out` output bytes are, as header hd says. */
static void shm_places(const Paramsync__V1__CollectiveHeader *hd, uint64_t in, uint64_t out,
                       ps__shm_place_t *pin, ps__shm_place_t *pout)
{
    *pin = shm_place(hd->shm_in_offset, hd->shm_in_blocks, hd->n_shm_in_blocks, in);
    *pout = shm_place(hd->shm_out_offset, hd->shm_out_blocks, hd->n_shm_out_blocks, out);
}

/* The ranges of worker memory (at most max) that hold bytes [off, off + len)
 * of place pl in a process segment: how many (fewer than needed when max is
 * reached; 0 past the last part). */
static int place_ranges(const ps__shm_place_t *pl, uint64_t off, uint64_t len, struct iovec *r,
                        int max)
{
    if (!pl->part) {
        r[0].iov_base = (void *)(uintptr_t)(pl->at + off);
        r[0].iov_len = len;
        return 1;
    }
    uint64_t i = off / pl->part_len, in = off % pl->part_len;
    int k = 0;
    for (; k < max && len > 0 && i < pl->nparts; k++, i++, in = 0) {
        uint64_t take = pl->part_len - in < len ? pl->part_len - in : len;
        r[k].iov_base = (void *)(uintptr_t)(pl->part[i] + in);
        r[k].iov_len = take;
        len -= take;
    }
    return k;
}

/* Reads (or writes) the bytes of local[0..n) (consumed as it goes) at `off`
 * of place pl of segment m through its file, or, for a process segment, in
 * the worker's memory (one copy, no segment between): 0, or a negative
 * errno (-EIO for a file shorter than expected or memory that ends early). */
static int seg_iov(const shm_map_t *m, int write, struct iovec *local, int n,
                   const ps__shm_place_t *pl, uint64_t off)
{
    while (n > 0) {
        ssize_t k;
        if (m->kind == PS_SHM_PROCESS) {
            size_t len = 0;
            for (int i = 0; i < n; i++)
                len += local[i].iov_len;
            struct iovec remote[SEG_REMOTE];
            unsigned long nr = (unsigned long)place_ranges(pl, off, len, remote, SEG_REMOTE);
            k = !nr     ? 0
                : write ? process_vm_writev(m->pid, local, (unsigned long)n, remote, nr, 0)
                        : process_vm_readv(m->pid, local, (unsigned long)n, remote, nr, 0);
        } else {
            off_t at = (off_t)(pl->at + off);
            k = write ? pwritev(m->fd, local, n, at) : preadv(m->fd, local, n, at);
        }
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return k < 0 ? -errno : -EIO;
        off += (uint64_t)k;
        for (; n > 0 && (size_t)k >= local->iov_len; n--, local++)
            k -= (ssize_t)local->iov_len;
        if (n > 0) {
            local->iov_base = (uint8_t *)local->iov_base + k;
            local->iov_len -= (size_t)k;
        }
    }
    return 0;
}

/* seg_iov of one buffer. */
static int seg_io(const shm_map_t *m, int write, void *buf, size_t len, const ps__shm_place_t *pl,
                  uint64_t off)
{
    struct iovec local = {buf, len};
    return seg_iov(m, write, &local, len ? 1 : 0, pl, off);
}

/* How the agent reaches a segment's payload, for the metrics: through its
 * mapping, its file, or (a process segment) the worker's own memory. */
static enum ps__m_access shm_access(const shm_map_t *m, int by_file)
{
    return m->kind == PS_SHM_PROCESS ? PS_M_SHM_PROCESS : by_file ? PS_M_SHM_FILE : PS_M_SHM_MAPPED;
}

static void shm_ref(shm_map_t *m)
{
    pthread_mutex_lock(&blob_lock);
    m->refs++;
    pthread_mutex_unlock(&blob_lock);
}

static blob_t *blob_new(size_t len)
{
    blob_t *b = malloc(sizeof(*b) + len);
    if (b) {
        *b = (blob_t){.refs = 1, .len = len};
        b->data = b->storage;
    }
    return b;
}

/* Pinned buffers for the steps an agent reduces on CUDA: the stager's DMA
 * reads an input, and writes a result, in pinned memory in place, where a
 * pageable one costs a CPU copy through its own pinned buffer. Pinning is
 * slow (a cudaHostAlloc takes about as long as copying the buffer many
 * times), so freed buffers are kept, in power-of-two classes from 64 KiB
 * to 16 MiB, up to PS_HUB_PINNED_MAX bytes in all; past that, or for other
 * sizes, blobs are malloc'd as before. They stay until the process exits,
 * as the stagers do (stager_get: freeing at exit races CUDA's teardown). */
#define PS_HUB_PINNED_MIN_SHIFT 16
#define PS_HUB_PINNED_CLASSES   9
#define PS_HUB_PINNED_MAX       ((size_t)512 << 20)

typedef struct pinned_buf {
    struct pinned_buf *next;
} pinned_buf_t;

static pthread_mutex_t pinned_lock = PTHREAD_MUTEX_INITIALIZER;
static pinned_buf_t *pinned_free[PS_HUB_PINNED_CLASSES];
static size_t pinned_total; /* bytes of pinned buffers made, in use or free */

/* The class a buffer of len bytes comes from, or -1 for none. */
static int pinned_class(size_t len)
{
    for (int k = 0; k < PS_HUB_PINNED_CLASSES; k++)
        if (len <= (size_t)1 << (PS_HUB_PINNED_MIN_SHIFT + k))
            return k;
    return -1;
}

/* A pinned buffer of class k: a kept one, or a new one while the pool is
 * under PS_HUB_PINNED_MAX; NULL when there is none to have. */
static void *pinned_take(int k)
{
    size_t size = (size_t)1 << (PS_HUB_PINNED_MIN_SHIFT + k);
    pthread_mutex_lock(&pinned_lock);
    void *buf = pinned_free[k];
    if (buf)
        pinned_free[k] = pinned_free[k]->next;
    int grow = !buf && pinned_total + size <= PS_HUB_PINNED_MAX;
    if (grow)
        pinned_total += size; /* given back below if the allocation fails */
    pthread_mutex_unlock(&pinned_lock);
    if (!grow)
        return buf;
    if (ps_gpu_host_alloc(&buf, size) == 0) {
        ps__metrics_pinned(PS_M_PIN_BUFFERS, (int64_t)size);
        return buf;
    }
    pthread_mutex_lock(&pinned_lock);
    pinned_total -= size;
    pthread_mutex_unlock(&pinned_lock);
    return NULL;
}

/* Keeps pinned buffer buf of class k for the next pinned_take. */
static void pinned_put(int k, void *buf)
{
    pinned_buf_t *p = buf;
    pthread_mutex_lock(&pinned_lock);
    p->next = pinned_free[k];
    pinned_free[k] = p;
    pthread_mutex_unlock(&pinned_lock);
}

/* A blob of len bytes in pinned memory, else from blob_new. */
static blob_t *blob_new_pinned(size_t len)
{
    int k = pinned_class(len);
    void *buf = k < 0 ? NULL : pinned_take(k);
    if (!buf)
        return blob_new(len);
    blob_t *b = malloc(sizeof(*b));
    if (!b) {
        pinned_put(k, buf);
        return NULL;
    }
    *b = (blob_t){.refs = 1, .len = len, .data = buf, .pinned = 1};
    return b;
}

/* A blob of len bytes to be held where they arrive (blob_hold): a member's
 * input that is only read by the step's reduction (reduce_step), so the
 * bytes are not copied out of the received frames first. */
static blob_t *blob_pieces(size_t len)
{
    blob_t *b = malloc(sizeof(*b));
    if (b)
        *b = (blob_t){.refs = 1, .len = len};
    return b;
}

/* Adds data bytes [from, from+len) of frame f to blob b in pieces. 0, or
 * PS_ENOMEM. */
static int blob_hold(blob_t *b, const ps__frame_t *f, size_t from, size_t len)
{
    /* A range of a frame lies in at most its nslices pieces. */
    if ((size_t)(b->cap - b->npieces) < f->nslices) {
        size_t cap = (size_t)b->cap * 2 + f->nslices;
        if (cap > INT_MAX)
            return PS_ENOMEM;
        grpc_slice *nh = realloc(b->held, cap * sizeof(*nh));
        if (!nh)
            return PS_ENOMEM;
        b->held = nh;
        b->cap = (int)cap;
    }
    int n = ps__frame_data_ref(f, from, len, NULL, b->held + b->npieces, b->cap - b->npieces);
    if (n < 0)
        return PS_EINVAL; /* not reached: member_read asks for bytes the frame has */
    b->npieces += n;
    return 0;
}

/* The most pieces a step's input is held in; past that it is copied
 * together (blob_flatten). A step of 1 MiB in 1 MiB frames arrives in about
 * 90; a sender of tiny frames would otherwise make the agent keep 48 bytes
 * of bookkeeping (and perhaps a receive buffer) per piece. */
#define PS_HUB_MAX_PIECES(len) (64 + (len) / 4096)

/* Copies the pieces held so far into memory of the blob's own and lets the
 * slices go: from then on the blob is whole (b->data). 0, or PS_ENOMEM. */
static int blob_flatten(blob_t *b)
{
    uint8_t *d = malloc(b->len ? b->len : 1);
    if (!d)
        return PS_ENOMEM;
    size_t at = 0;
    for (int i = 0; i < b->npieces; i++) {
        size_t l = GRPC_SLICE_LENGTH(b->held[i]);
        memcpy(d + at, GRPC_SLICE_START_PTR(b->held[i]), l);
        at += l;
        grpc_slice_unref(b->held[i]);
    }
    free(b->held);
    b->held = NULL;
    b->npieces = b->cap = 0;
    b->data = b->heap = d;
    return 0;
}

/* The most pieces of an output frame written into a segment's file or a
 * worker's memory with one vectored write (frames of 1 MiB arrive in far
 * fewer; IOV_MAX is 1024). */
#define PS_HUB_FRAME_IOV 256

/* Where bytes [off, off+len) of a blob held in pieces lie: their count of
 * pieces (at most max), each into iov or, with subs, as a new reference to
 * the range (grpc_slice_sub); -1 (nothing referenced) when they need more. */
static int blob_piece_iov(const blob_t *b, size_t off, size_t len, struct iovec *iov,
                          grpc_slice *subs, int max)
{
    int n = 0;
    for (int i = 0; i < b->npieces && len > 0; i++) {
        size_t l = GRPC_SLICE_LENGTH(b->held[i]);
        if (off >= l) {
            off -= l;
            continue;
        }
        if (n == max) {
            while (subs && n > 0)
                grpc_slice_unref(subs[--n]);
            return -1;
        }
        size_t take = l - off < len ? l - off : len;
        if (subs)
            subs[n] = grpc_slice_sub(b->held[i], off, off + take);
        else
            iov[n] = (struct iovec){GRPC_SLICE_START_PTR(b->held[i]) + off, take};
        n++;
        len -= take;
        off = 0;
    }
    return n;
}

/* A blob that reads len bytes of a segment in place (no copy). */
static blob_t *blob_view(shm_map_t *map, uint8_t *data, size_t len)
{
    blob_t *b = malloc(sizeof(*b));
    if (b) {
        *b = (blob_t){.refs = 1, .len = len, .data = data, .map = map};
        pthread_mutex_lock(&blob_lock);
        map->refs++;
        map->views++;
        pthread_mutex_unlock(&blob_lock);
    }
    return b;
}

static void blob_ref(blob_t *b)
{
    pthread_mutex_lock(&blob_lock);
    b->refs++;
    pthread_mutex_unlock(&blob_lock);
}

static void blob_unref(void *arg)
{
    blob_t *b = arg;
    if (!b)
        return;
    pthread_mutex_lock(&blob_lock);
    int last = --b->refs == 0;
    if (last && b->map && --b->map->views == 0)
        pthread_cond_broadcast(&views_gone);
    pthread_mutex_unlock(&blob_lock);
    if (last) {
        if (b->map)
            shm_unref(b->map);
        for (int i = 0; i < b->npieces; i++)
            grpc_slice_unref(b->held[i]);
        free(b->held);
        free(b->heap);
        if (b->pinned)
            pinned_put(pinned_class(b->len), b->data);
        free(b);
    }
}

/* A frame (offset tag) of bytes [off, off+len) of blob b, held in pieces:
 * made of the very slices, which the frame references. Drops the caller's
 * reference to b. NULL (not reached) when the range lies in more pieces than
 * a frame is held in. */
static grpc_byte_buffer *blob_pieces_encode(blob_t *b, uint64_t tag, size_t off, size_t len)
{
    grpc_slice subs[PS_HUB_FRAME_IOV];
    int n = blob_piece_iov(b, off, len, NULL, subs, PS_HUB_FRAME_IOV);
    grpc_byte_buffer *bb = n < 0 ? NULL : ps__frame_encode_slices(NULL, NULL, tag, subs, n);
    blob_unref(b);
    return bb;
}

typedef struct slot {
    int64_t step;      /* -1: free */
    int64_t last_done; /* the last step that used this slot and was consumed */
    size_t len;
    int need, have; /* contributions */
    int recv_need, recv_done;
    int computed;
    int partial;     /* ring: the local ranks' reduction is in `out` */
    int rounds;      /* ring: pieces received from the previous agent */
    int sent;        /* ring: pieces sent to the next agent */
    blob_t **in;     /* per member */
    uint8_t *placed; /* per member, on CUDA (else NULL): the device wrote its part of `out`
                      * into its segment itself (step_places), and out may not hold it */
    blob_t *out;
} slot_t;

struct coll;

typedef struct member {
    struct coll *coll;
    Paramsync__V1__Frame *first; /* the first frame's fields; owns header */
    int index;                   /* member index in the collective */
    ps__rpc_call_t *call;
    ps__frame_t frame; /* current input frame */
    size_t frame_pos;  /* bytes of frame data consumed */
    uint64_t in_off;   /* input bytes consumed so far */
    uint64_t in_total, out_total;
    int finished;
    struct member *next_wait; /* p2p mailbox */
    int64_t arrival_ms;
    int refused;                     /* p2p: a gRPC code when the match could not be served */
    shm_map_t *shm;                  /* input (and output) live in this segment */
    shm_map_t *oshm;                 /* the output's: shm, or a second registered one
                                      * (CollectiveHeader.shm_out); NULL with shm */
    int link;                        /* PS_M_LINK_AGENT when another agent forwarded the call */
    pthread_t thread;                /* the handler thread serving it */
    ps__shm_place_t shm_in, shm_out; /* where input and output are in it */
    int by_file;   /* the segment is read and written through its file (shm_by_file) */
    int deposited; /* its input went in before the last arrival (deposits_early) */
} member_t;

#define K_BARRIER        PARAMSYNC__V1__COLLECTIVE_KIND__BARRIER
#define K_BROADCAST      PARAMSYNC__V1__COLLECTIVE_KIND__BROADCAST
#define K_ALL_REDUCE     PARAMSYNC__V1__COLLECTIVE_KIND__ALL_REDUCE
#define K_REDUCE         PARAMSYNC__V1__COLLECTIVE_KIND__REDUCE
#define K_ALL_GATHER     PARAMSYNC__V1__COLLECTIVE_KIND__ALL_GATHER
#define K_GATHER         PARAMSYNC__V1__COLLECTIVE_KIND__GATHER
#define K_SCATTER        PARAMSYNC__V1__COLLECTIVE_KIND__SCATTER
#define K_REDUCE_SCATTER PARAMSYNC__V1__COLLECTIVE_KIND__REDUCE_SCATTER
#define K_ALL_TO_ALL     PARAMSYNC__V1__COLLECTIVE_KIND__ALL_TO_ALL
#define K_SEND           PARAMSYNC__V1__COLLECTIVE_KIND__SEND
#define K_RECV           PARAMSYNC__V1__COLLECTIVE_KIND__RECV
typedef int coll_kind_t;

typedef struct job job_t;

/* A collective served by several agents, each for its own ranks, combined
 * around a ring of those agents (see ring_send_main). */
typedef struct ring_frame {
    ps__frame_t f;
    const struct ring_link *from; /* the link it came over */
    struct ring_frame *next;
} ring_frame_t;

/* How a ring moves a collective's steps (ring_mode):
 * SPLIT: all_reduce, each step in A pieces reduced and passed round twice;
 * PASS: all_gather, broadcast, each step passed on whole from its owner's
 * agent to every other; ACC: reduce, reduce_scatter, each step added up
 * whole along the agents, ending at the agent of the rank it is for. */
enum { RING_SPLIT, RING_PASS, RING_ACC };

/* A link between this agent and another of a ring collective's. */
typedef struct ring_link {
    struct coll *c;
    int peer;             /* the other agent's position in the ring */
    char *addr, *who;     /* its address; the same with its ranks, for messages (ring_who) */
    ps__rpc_call_t *call; /* while open */
    uint64_t frames;      /* the steps' frames it carries (ring_frames) */
    int seen;             /* in: the link has arrived (it may be gone now) */
    int busy;             /* out: its sender is in a send or finish: cancel `call` to fail */
    int64_t failed_ms;    /* out: when its opening sender saw the collective failed */
} ring_link_t;

static void ring_link_clear(ring_link_t *l)
{
    free(l->addr);
    free(l->who);
}

typedef struct ring {
    struct ps__hub *hub;
    ring_frame_t *q_head, *q_tail; /* pieces read from the links, not applied yet */
    int nagents, pos;              /* agents in the ring, this one's position */
    int group_size;                /* ranks in the group (AVG divides by it) */
    ring_link_t in, out;           /* from the previous agent, to the next */
    /* A mesh (all_to_all): each step goes from its owner's agent straight to
     * its rank's, over a link of its own between every two agents; besides
     * in and out, xin[k] from the agent at pos - 2 - k and xout[k] to the one
     * at pos + 2 + k (k < nagents - 2). */
    int mesh;
    ring_link_t *xin, *xout;
    int64_t timeout_ms;
    int mode;      /* RING_SPLIT, RING_PASS or RING_ACC (ring_mode) */
    int nlocal;    /* the group's ranks this agent serves */
    int *agent_of; /* PASS, ACC: group rank -> position of its agent in the ring */
    /* Agreement (ring_agrees): tokens this agent may send, has sent and has
     * received; agreed: every agent of the ring took its link's header. */
    int tok_ready, tok_sent, tok_in, agreed;
    /* Recursive doubling (rd_apply_main; links as in a mesh, those of two
     * agents with a round together used): rd_val (rd_len bytes) is this
     * agent's value after rd_k rounds; rd_taken has bit t set once round
     * t's frame took it. */
    int rd, rd_k;
    uint64_t rd_taken;
    blob_t *rd_val;
    size_t rd_len;
} ring_t;

typedef struct coll {
    job_t *job;
    uint32_t group;
    uint64_t seq;
    int p2p; /* a matched send/recv pair: member 0 sends, member 1 receives */
    coll_kind_t kind;
    int op, dtype, root;
    uint64_t count;
    int n;      /* members */
    int *ranks; /* group ranks of the members (p2p: sender, receiver) */
    member_t **members;
    int narrived, nfinished;
    int64_t alive_checked_ms; /* the last check_missing_alive */
    int failed;
    int code;
    char message[512];
    int64_t nsteps;
    uint64_t block;  /* bytes per rank block */
    uint64_t chunks; /* steps per block */
    /* all_gather round a ring: step s is chunk s / n of block order[s % n],
     * the agents' blocks taking turns (ring_block_order); NULL: block after
     * block, chunk after chunk. */
    int *order;
    size_t step_bytes;
    int packed; /* one step carries every block (coll_packs) */
    int window;
    slot_t *slots;
    pthread_cond_t cond;
    pthread_mutex_t *lock;  /* the hub's */
    uint64_t reserved;      /* bytes counted against --max-inflight-bytes */
    int cuda;               /* reduce on the GPU (--reduce-device) steps of cuda_min bytes
                             * per input or more */
    size_t cuda_min;        /* --reduce-device auto: PS_AUTO_CUDA_MIN; cuda: 0 */
    atomic_int device_read; /* a step was reduced on the device since shm_broken_check
                             * last looked at the pinned segments' files */
    uint64_t *budget;       /* the hub's inflight_bytes */
    ring_t *ring;           /* NULL: this agent serves every rank (the job's hub) */
    int threads;            /* ring threads still using it */
    struct coll *next;
} coll_t;

typedef struct mailbox {
    uint32_t group;
    int dst;
    member_t *sends; /* pending, arrival order */
    member_t *recvs;
    uint64_t next_recv_seq;
    uint64_t *next_send_seq; /* per source */
    int nsrc;
    struct mailbox *next;
} mailbox_t;

/* The answer of a failed collective, for ranks that arrive after it ended. */
typedef struct tombstone {
    uint32_t group;
    uint64_t seq;
    int code;
    char message[512];
    struct tombstone *next;
} tombstone_t;

#define PS_HUB_TOMBSTONES 64

struct job {
    tombstone_t *tombstones; /* newest first, at most PS_HUB_TOMBSTONES */
    char *name;
    ps__job_info_t info;
    coll_t *colls;
    mailbox_t *mailboxes;
    int refs;  /* handlers using it */
    int stale; /* replaced by a newer incarnation: freed when unused */
    job_t *next;
};

struct ps__hub {
    const ps__config_t *cfg;
    char *self;
    ps__job_lookup_fn lookup;
    ps__ring_open_fn ring_open;
    ps__ring_keep_fn ring_keep;
    ps__serve_fn serve;
    void *lookup_arg;
    pthread_mutex_t lock;
    pthread_cond_t p2p_changed;
    job_t *jobs;
    uint64_t inflight_bytes; /* reserved by the collectives in flight */
    shm_map_t *shms;         /* attached segments */
    int stopping;            /* draining: everything fails with UNAVAILABLE */
    int helpers;             /* ring and doorbell threads running (destroy waits for them) */
};

static const char *kind_name(int k);

/* Registered segments (ps_mem_alloc) an agent keeps per rank. */
#define PS_HUB_MAX_REGISTERED 64

#define PS_HUB_NOT_ATTACHED                                                                        \
    "its shared-memory segment is not attached to this agent (ShmAttach first)"

#define PS_HUB_FOREIGN                                                                             \
    "its shared-memory segment was attached by another rank (a rank uses only its own)"

#define PS_HUB_NOT_PROCESS                                                                         \
    "shm_process is set, but the segment it names is not its process segment (ShmAttach with "     \
    "process, answered process_memory)"

#define PS_HUB_PROCESS_ONLY                                                                        \
    "the segment it names is its process segment, which holds no payload: set shm_process"

/* The attached segment `name` of job, or NULL. Lock held. */
static shm_map_t *shms_find(const ps__hub_t *h, const char *job, const char *name)
{
    for (shm_map_t *sm = h->shms; sm; sm = sm->next)
        if (strcmp(sm->name, name) == 0 && strcmp(sm->job, job) == 0)
            return sm;
    return NULL;
}

/* The job rank of a group rank (group 0 is the job). */
static int job_rank(const ps__job_info_t *info, uint32_t group, int grank)
{
    if (group == 0)
        return grank;
    for (int g = 0; g < info->ngroups; g++)
        if (info->groups[g].id == group && grank < info->groups[g].nranks)
            return info->groups[g].ranks[grank];
    return -1;
}

/* The segment a collective's header names, when the rank that calls attached
 * it; else NULL, with *msg saying why. Lock held; hd passed header_check. */
static shm_map_t *shms_find_own(const ps__hub_t *h, const ps__job_info_t *info, const header_t *hd,
                                const char **msg)
{
    shm_map_t *sm = shms_find(h, hd->job, hd->shm);
    *msg = !sm ? PS_HUB_NOT_ATTACHED : NULL;
    if (sm && sm->rank != job_rank(info, hd->group, hd->rank)) {
        *msg = PS_HUB_FOREIGN;
        sm = NULL;
    } else if (sm && hd->shm_process != (sm->kind == PS_SHM_PROCESS)) {
        *msg = hd->shm_process ? PS_HUB_NOT_PROCESS : PS_HUB_PROCESS_ONLY;
        sm = NULL;
    }
    return sm;
}

/* Whether a header puts its output in a segment of its own (shm_out). */
static int shm_two(const header_t *hd)
{
    return hd->shm_out && *hd->shm_out && strcmp(hd->shm_out, hd->shm) != 0;
}

#define PS_HUB_OUT_KIND                                                                            \
    "it is not a registered segment (ShmAttach with registered), or the input's is not: only two " \
    "registered segments go together"

#define PS_HUB_OUT_OWN                                                                             \
    "own_block does not go with it (the input is then a block of the output, in one segment)"

/* The segment that holds a collective's output: sm, the one its header names
 * for the input, or another registered one of the same rank named by
 * shm_out; NULL with *msg saying why (out: whether the fault is shm_out's).
 * Lock held; hd passed header_check. */
static shm_map_t *shms_find_out(const ps__hub_t *h, const ps__job_info_t *info, const header_t *hd,
                                shm_map_t *sm, const char **msg, int *out)
{
    *out = 0;
    if (!sm || !shm_two(hd))
        return sm;
    header_t o = *hd;
    o.shm = hd->shm_out;
    o.shm_process = 0;
    shm_map_t *om = shms_find_own(h, info, &o, msg);
    *out = 1;
    if (om && (sm->kind != PS_SHM_REGISTERED || om->kind != PS_SHM_REGISTERED || hd->own_block)) {
        *msg = hd->own_block ? PS_HUB_OUT_OWN : PS_HUB_OUT_KIND;
        om = NULL;
    }
    return om;
}

/* Whether a member's output goes exactly over its input in its segment
 * (all_reduce and reduce only). */
static int shm_in_place(const Paramsync__V1__CollectiveHeader *hd)
{
    return (hd->kind == PARAMSYNC__V1__COLLECTIVE_KIND__ALL_REDUCE ||
            hd->kind == PARAMSYNC__V1__COLLECTIVE_KIND__REDUCE) &&
           hd->shm_in_offset == hd->shm_out_offset && !shm_two(hd);
}

/* Whether a member's input lies exactly in its own block of the output (an
 * all_gather's or gather's rank block), or its output in its block of the
 * input (a scatter's root), and the header says so (own_block): the agent
 * reads that block and never writes it (step_own_placed). */
static int shm_own_in_place(const Paramsync__V1__CollectiveHeader *hd, uint64_t in, uint64_t out)
{
    int gathers = hd->kind == PARAMSYNC__V1__COLLECTIVE_KIND__ALL_GATHER ||
                  hd->kind == PARAMSYNC__V1__COLLECTIVE_KIND__GATHER;
    int scatters = hd->kind == PARAMSYNC__V1__COLLECTIVE_KIND__SCATTER;
    if (!hd->own_block || !(gathers || scatters) || hd->rank < 0)
        return 0;
    uint64_t block = gathers ? in : out, at = (uint64_t)hd->rank * block;
    return gathers ? hd->shm_in_offset == hd->shm_out_offset + at && at + block <= out
                   : hd->shm_out_offset == hd->shm_in_offset + at && at + block <= in;
}

/* Bytes [at, at + len) of a worker's memory (shm_lists_hold). */
typedef struct {
    uint64_t at, len;
} range_t;

static int range_cmp(const void *a, const void *b)
{
    uint64_t x = ((const range_t *)a)->at, y = ((const range_t *)b)->at;
    return x < y ? -1 : x > y;
}

/* Adds the ranges of one side of `total` bytes, from `at` or in the n parts
 * of `list`, to r at *k. */
static void ranges_add(range_t *r, size_t *k, uint64_t at, const uint64_t *list, size_t n,
                       uint64_t total)
{
    for (size_t i = 0; i < n; i++)
        r[(*k)++] = (range_t){list[i], total / n};
    if (!n && total)
        r[(*k)++] = (range_t){at, total};
}

/* shm_holds for a list form (CollectiveHeader.shm_in_blocks, shm_out_blocks):
 * a process segment, each listed side splitting its bytes evenly at offset
 * 0, and no range of either side empty of an address, wrapping around, or
 * overlapping another. */
static int shm_lists_hold(const shm_map_t *m, const header_t *hd, uint64_t in, uint64_t out,
                          char *msg, size_t len)
{
    size_t ni = hd->n_shm_in_blocks, no = hd->n_shm_out_blocks;
    int n = snprintf(msg, len, "%s (group %u, seq %" PRIu64 "): rank %d ", kind_name(hd->kind),
                     hd->group, hd->seq, hd->rank);
    char *why = msg + (n > 0 && (size_t)n < len ? n : 0);
    size_t wlen = len - (size_t)(why - msg);
    int ins = ni && (hd->shm_in_offset || !in || in % ni);
    if (m->kind != PS_SHM_PROCESS) {
        snprintf(why, wlen, "lists blocks, which only its process segment takes");
        return 0;
    }
    if (hd->own_block) {
        snprintf(why, wlen, "lists blocks and sets own_block, which do not go together");
        return 0;
    }
    if (ins || (no && (hd->shm_out_offset || !out || out % no))) {
        snprintf(why, wlen,
                 "lists %zu %s blocks for %" PRIu64 " %s bytes: they must split them evenly, "
                 "with shm_%s_offset 0",
                 ins ? ni : no, ins ? "input" : "output", ins ? in : out, ins ? "input" : "output",
                 ins ? "in" : "out");
        return 0;
    }
    range_t *r = malloc((ni + no + 2) * sizeof(*r));
    if (!r) {
        snprintf(why, wlen, "lists blocks: out of memory checking them");
        return 0;
    }
    size_t k = 0;
    ranges_add(r, &k, hd->shm_in_offset, hd->shm_in_blocks, ni, in);
    ranges_add(r, &k, hd->shm_out_offset, hd->shm_out_blocks, no, out);
    qsort(r, k, sizeof(*r), range_cmp);
    int ok = 1;
    for (size_t i = 0; i < k && ok; i++) {
        const char *bad = !r[i].at || r[i].at + r[i].len < r[i].at ? "are not a valid range"
                          : i + 1 < k && r[i].at + r[i].len > r[i + 1].at
                              ? "overlap the next of its ranges"
                              : NULL;
        if (bad)
            snprintf(why, wlen, "has %" PRIu64 " bytes at 0x%" PRIx64 " in its memory that %s",
                     r[i].len, r[i].at, bad);
        ok = !bad;
    }
    free(r);
    return ok;
}

/* Whether segment m holds a member's `in` input bytes (at the header's
 * shm_in_offset) and segment om (m, or a second registered segment: shm_out)
 * its `out` output bytes (at its shm_out_offset), apart, or
 * for all_reduce and reduce, output exactly over input, or a rank's own
 * block in place (shm_own_in_place, which own_block must name); if not,
 * says so in msg. For a process segment they are addresses in the worker's
 * memory: any that do not wrap around (memory the worker does not have
 * fails the copy, and the collective, with EFAULT); or lists of them
 * (shm_lists_hold). */
static int shm_holds(const shm_map_t *m, const shm_map_t *om, const header_t *hd, uint64_t in,
                     uint64_t out, char *msg, size_t len)
{
    if (hd->n_shm_in_blocks || hd->n_shm_out_blocks)
        return shm_lists_hold(m, hd, in, out, msg, len);
    uint64_t ia = hd->shm_in_offset, oa = hd->shm_out_offset;
    int in_place = shm_in_place(hd);
    int fits = m->kind == PS_SHM_PROCESS
                   ? ia + in >= ia && oa + out >= oa && (!in || ia) && (!out || oa)
                   : ia <= m->size && in <= m->size - ia && oa <= om->size && out <= om->size - oa;
    int own = shm_own_in_place(hd, in, out);
    int apart = om != m || in_place || own || !in || !out || ia + in <= oa || oa + out <= ia;
    if (hd->own_block && !own) {
        snprintf(msg, len,
                 "%s (group %u, seq %" PRIu64 "): rank %d sets own_block, but its input is not "
                 "its own block of the output (nor, for scatter, its output its block of the "
                 "input)",
                 kind_name(hd->kind), hd->group, hd->seq, hd->rank);
        return 0;
    }
    if (fits && apart)
        return 1;
    if (m->kind == PS_SHM_PROCESS) {
        snprintf(msg, len,
                 "%s (group %u, seq %" PRIu64 "): rank %d's %" PRIu64 " input bytes at 0x%" PRIx64
                 " and %" PRIu64 " output bytes at 0x%" PRIx64 " in its memory %s",
                 kind_name(hd->kind), hd->group, hd->seq, hd->rank, in, ia, out, oa,
                 fits ? "overlap" : "are not a valid range");
        return 0;
    }
    if (om != m) {
        snprintf(msg, len,
                 "%s (group %u, seq %" PRIu64 "): rank %d's shared segments cannot hold %" PRIu64
                 " input bytes at %" PRIu64 " of one (%zu bytes) and %" PRIu64
                 " output bytes at %" PRIu64 " of the other (shm_out, %zu bytes)",
                 kind_name(hd->kind), hd->group, hd->seq, hd->rank, in, ia, m->size, out, oa,
                 om->size);
        return 0;
    }
    snprintf(msg, len,
             "%s (group %u, seq %" PRIu64
             "): rank %d's shared segment (%zu bytes) cannot hold %" PRIu64
             " input bytes at %" PRIu64 " and %" PRIu64 " output bytes at %" PRIu64 "%s",
             kind_name(hd->kind), hd->group, hd->seq, hd->rank, m->size, in, ia, out, oa,
             fits ? ": they overlap" : "");
    return 0;
}

static const char *kind_name(int k)
{
    static const char *const names[] = {"unspecified",    "barrier",    "broadcast", "all_reduce",
                                        "reduce",         "all_gather", "gather",    "scatter",
                                        "reduce_scatter", "all_to_all", "send",      "recv"};
    return k >= 0 && k <= K_RECV ? names[k] : "unknown";
}

static int kind_reduces(coll_kind_t k)
{
    return k == K_ALL_REDUCE || k == K_REDUCE || k == K_REDUCE_SCATTER;
}

static int kind_rooted(coll_kind_t k)
{
    return k == K_BROADCAST || k == K_REDUCE || k == K_GATHER || k == K_SCATTER;
}

/* ms from now on the clock of the hub's condition variables. */
static struct timespec abs_ms(int64_t ms)
{
    return ps__abs_time(CLOCK_MONOTONIC, ms);
}

/* ---- jobs ---- */

void ps__job_info_clear(ps__job_info_t *info)
{
    for (int i = 0; info->rank_agents && i < info->world_size; i++)
        free(info->rank_agents[i]);
    free(info->rank_agents);
    for (int i = 0; info->rank_machines && i < info->world_size; i++)
        free(info->rank_machines[i]);
    free(info->rank_machines);
    for (int i = 0; i < info->ngroups; i++)
        free(info->groups[i].ranks);
    free(info->groups);
    free(info->hub);
    free(info->joined);
    memset(info, 0, sizeof(*info));
}

static void coll_free(struct coll *c);

static void job_free(job_t *j)
{
    while (j->tombstones) {
        tombstone_t *t = j->tombstones;
        j->tombstones = t->next;
        free(t);
    }
    while (j->colls) {
        coll_t *c = j->colls;
        j->colls = c->next;
        coll_free(c);
    }
    while (j->mailboxes) {
        mailbox_t *m = j->mailboxes;
        j->mailboxes = m->next;
        free(m->next_send_seq);
        free(m);
    }
    ps__job_info_clear(&j->info);
    free(j->name);
    free(j);
}

/* Jobs stay cached between collectives; a stale one goes when unused. */
static void job_release(job_t *j)
{
    if (--j->refs == 0 && j->stale)
        job_free(j);
}

/* Finds the job, asking the coordinator when it is unknown, of another
 * incarnation, or lacks the group. Called with the lock held; drops it
 * while asking. Returns a referenced job or NULL with code/msg set. */
static job_t *job_get(ps__hub_t *h, const header_t *hd, int *code, char *msg, size_t msglen)
{
    for (int attempt = 0; attempt < 2; attempt++) {
        job_t *j = NULL;
        for (job_t *x = h->jobs; x; x = x->next)
            if (strcmp(x->name, hd->job) == 0)
                j = x;
        if (j && (hd->incarnation == 0 || j->info.incarnation == hd->incarnation)) {
            int have_group = hd->group == 0;
            for (int g = 0; g < j->info.ngroups && !have_group; g++)
                have_group = j->info.groups[g].id == hd->group;
            if (have_group) {
                j->refs++;
                return j;
            }
        }
        if (attempt == 1)
            break;
        ps__job_info_t info;
        char *err = NULL;
        memset(&info, 0, sizeof(info));
        pthread_mutex_unlock(&h->lock);
        int rc = h->lookup(h->lookup_arg, hd->job, &info, &err);
        pthread_mutex_lock(&h->lock);
        if (h->stopping) {
            /* ps__hub_drain ran while the lock was down: it failed the
             * collectives in flight then, and none may begin after it. A
             * doorbell's (a local call: the server's shutdown cannot cancel
             * it) would wait out its timeout, and ps__hub_destroy with it. */
            ps__job_info_clear(&info);
            free(err);
            *code = GRPC_STATUS_UNAVAILABLE;
            snprintf(msg, msglen, PS_MSG_STOPPING);
            return NULL;
        }
        if (rc < 0) {
            *code = -rc;
            snprintf(msg, msglen, "%s: %s", kind_name(hd->kind), err ? err : ps_strerror(rc));
            free(err);
            return NULL;
        }
        free(err);
        /* Re-find: another thread may have refreshed it meanwhile. */
        j = NULL;
        for (job_t *x = h->jobs; x; x = x->next)
            if (strcmp(x->name, hd->job) == 0)
                j = x;
        if (j && j->info.incarnation != info.incarnation) {
            /* A new incarnation: the old state is dropped once unused. */
            for (job_t **p = &h->jobs; *p; p = &(*p)->next)
                if (*p == j) {
                    *p = j->next;
                    break;
                }
            j->next = NULL;
            j->stale = 1;
            if (j->refs == 0)
                job_free(j);
            j = NULL;
        }
        if (!j) {
            j = calloc(1, sizeof(*j));
            if (!j || !(j->name = strdup(hd->job))) {
                free(j);
                ps__job_info_clear(&info);
                *code = GRPC_STATUS_RESOURCE_EXHAUSTED;
                snprintf(msg, msglen, "out of memory");
                return NULL;
            }
            j->next = h->jobs;
            h->jobs = j;
            j->info = info;
        } else {
            ps__job_info_clear(&j->info);
            j->info = info;
        }
    }
    if (hd->incarnation != 0) {
        job_t *j = NULL;
        for (job_t *x = h->jobs; x; x = x->next)
            if (strcmp(x->name, hd->job) == 0)
                j = x;
        if (j && j->info.incarnation != hd->incarnation) {
            *code = GRPC_STATUS_FAILED_PRECONDITION;
            snprintf(msg, msglen,
                     "%s: job %s was formed anew (incarnation %" PRIu64 ", the caller has %" PRIu64
                     "); call init again",
                     kind_name(hd->kind), hd->job, j->info.incarnation, hd->incarnation);
            return NULL;
        }
    }
    *code = GRPC_STATUS_NOT_FOUND;
    snprintf(msg, msglen, "%s: job %s has no group %u (create it with new_group on every rank)",
             kind_name(hd->kind), hd->job, hd->group);
    return NULL;
}

/* Group size and the member list of a group (group 0: the job). */
static int group_size(const job_t *j, uint32_t group)
{
    if (group == 0)
        return j->info.world_size;
    for (int g = 0; g < j->info.ngroups; g++)
        if (j->info.groups[g].id == group)
            return j->info.groups[g].nranks;
    return -1;
}

/* ---- failure ---- */

static void coll_fail(coll_t *c, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Called with the hub lock held. The first failure wins; every member call
 * is ended with it so no rank waits on a collective that cannot finish. */
static void coll_fail(coll_t *c, int code, const char *fmt, ...)
{
    if (c->failed)
        return;
    c->failed = 1;
    c->code = code;
    if (code == GRPC_STATUS_FAILED_PRECONDITION)
        ps__metrics_event(PS_M_EV_MISMATCH);
    else if (code == GRPC_STATUS_DEADLINE_EXCEEDED)
        ps__metrics_event(PS_M_EV_TIMEOUT);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->message, sizeof(c->message), fmt, ap);
    va_end(ap);
    PS_LOG(PS_LOG_WARN, "job %s: %s", c->job->name, c->message);
    for (int i = 0; i < c->n; i++)
        if (c->members[i] && !c->members[i]->finished)
            ps__rpc_call_cancel(c->members[i]->call, code, c->message);
    /* The agents whose links come here learn why from the link's status;
     * those this one sends to from a failure frame the sender sends, unless
     * it is stuck sending. */
    int links = c->ring && c->ring->xin && c->ring->xout ? c->ring->nagents - 2 : 0;
    for (int k = -1; c->ring && k < links; k++) {
        ring_link_t *in = k < 0 ? &c->ring->in : &c->ring->xin[k];
        ring_link_t *out = k < 0 ? &c->ring->out : &c->ring->xout[k];
        if (in->call)
            ps__rpc_call_cancel(in->call, code, c->message);
        if (out->call && out->busy)
            ps__rpc_call_cancel(out->call, code, c->message);
    }
    pthread_cond_broadcast(&c->cond);
}

/* ---- the step plan ---- */

typedef struct step_plan {
    size_t len;     /* bytes each contributor puts in */
    size_t out_len; /* bytes of the step's output */
    size_t slice;   /* bytes of it each receiver takes (step_slice) */
    int ncontrib;
    int contrib_one; /* the single contributor, or -1 for all */
    int recv_one;    /* the single receiver, -1 for all, -2 all but root */
    uint64_t at;     /* where the step's part lies in a receiver's output */
} step_plan_t;

/* A packed collective's one step (coll_packs): every rank contributes its
 * whole input (a scatter: the root alone), and the output holds every block:
 * all_gather, gather: the blocks in rank order, each receiver takes them
 * all; reduce_scatter: the reduced input; scatter: the root's input;
 * all_to_all: the blocks grouped by the rank they are for; receiver i takes
 * the i-th slice (its block, or its n blocks). */
static void plan_packed(const coll_t *c, step_plan_t *p)
{
    size_t all = (size_t)c->block * (size_t)c->n;
    int gathers = c->kind == K_ALL_GATHER || c->kind == K_GATHER;
    p->len = gathers ? (size_t)c->block : all;
    p->out_len = c->kind == K_ALL_TO_ALL ? all * (size_t)c->n : all;
    p->slice = gathers ? all : p->out_len / (size_t)c->n;
    p->contrib_one = c->kind == K_SCATTER ? c->root : -1;
    p->recv_one = c->kind == K_GATHER ? c->root : -1;
    p->ncontrib = p->contrib_one >= 0 ? 1 : c->n;
    p->at = 0;
}

static void plan_step(const coll_t *c, int64_t s, step_plan_t *p)
{
    if (c->packed) {
        plan_packed(c, p);
        return;
    }
    uint64_t m = c->chunks, n = (uint64_t)c->n;
    uint64_t ch = c->order ? (uint64_t)s / n : (uint64_t)s % m;
    uint64_t blk = c->order ? (uint64_t)c->order[(uint64_t)s % n] : (uint64_t)s / m;
    uint64_t left = c->block - ch * c->step_bytes;
    p->len = left < c->step_bytes ? left : c->step_bytes;
    p->out_len = p->slice = p->len;
    /* A receiver of every block (all_gather, gather's root) has them in
     * rank order, one of all_to_all its block from each rank in rank order,
     * any other one block. */
    p->at = ch * c->step_bytes;
    if (c->kind == K_ALL_GATHER || c->kind == K_GATHER)
        p->at += blk * c->block;
    else if (c->kind == K_ALL_TO_ALL)
        p->at += blk / n * c->block;
    switch (c->kind) {
    case K_BROADCAST:
        p->contrib_one = c->root;
        p->recv_one = -2;
        break;
    case K_ALL_REDUCE:
        p->contrib_one = -1;
        p->recv_one = -1;
        break;
    case K_REDUCE:
        p->contrib_one = -1;
        p->recv_one = c->root;
        break;
    case K_ALL_GATHER:
        p->contrib_one = (int)blk;
        p->recv_one = -1;
        break;
    case K_GATHER:
        p->contrib_one = (int)blk;
        p->recv_one = c->root;
        break;
    case K_SCATTER:
        p->contrib_one = c->root;
        p->recv_one = (int)blk;
        break;
    case K_REDUCE_SCATTER:
        p->contrib_one = -1;
        p->recv_one = (int)blk;
        break;
    case K_ALL_TO_ALL:
        p->contrib_one = (int)(blk / (uint64_t)c->n);
        p->recv_one = (int)(blk % (uint64_t)c->n);
        break;
    default: /* p2p */
        p->contrib_one = 0;
        p->recv_one = 1;
        break;
    }
    p->ncontrib = p->contrib_one >= 0 ? 1 : c->n;
}

/* Where in a step's output the part receiver i takes starts: all of it
 * (offset 0), or its slice. */
static size_t step_slice(const step_plan_t *p, int i)
{
    return p->slice == p->out_len ? 0 : (size_t)i * p->slice;
}

/* Puts a packed step's output together from its contributors' inputs
 * (in[i]: rank i's, NULL where it gave none), other than by reduction. */
static void packed_combine(const coll_t *c, uint8_t *out, blob_t *const *in)
{
    size_t b = (size_t)c->block, n = (size_t)c->n;
    for (size_t i = 0; i < n; i++) {
        if (!in[i])
            continue;
        if (c->kind == K_ALL_TO_ALL) /* rank i's block for rank k goes to k's part */
            for (size_t k = 0; k < n; k++)
                memcpy(out + (k * n + i) * b, in[i]->data + k * b, b);
        else if (c->kind == K_SCATTER)
            memcpy(out, in[i]->data, n * b);
        else
            memcpy(out + i * b, in[i]->data, b);
    }
}

/* The bytes at the start of step p's output that carry data: p->slice, or
 * fewer for an all_to_all block whose contributor said how much of it is
 * data (CollectiveHeader.block_used; where that rank is here) or that came
 * from another agent shorter (out, when given: its bytes). The rest is
 * padding its receiver does not read, left out of what agents move between
 * them (ring_send_main) and write into outputs (member_write). */
static size_t step_used(const coll_t *c, const step_plan_t *p, const blob_t *out)
{
    size_t used = p->slice; /* all_to_all's steps not packed: p->len */
    if (c->kind != K_ALL_TO_ALL || c->packed || p->contrib_one < 0 || p->recv_one < 0)
        return used;
    if (out && out->len < used)
        used = out->len;
    const member_t *m = c->members[p->contrib_one];
    const header_t *hd = m && m->first ? m->first->header : NULL;
    if (!hd || hd->n_block_used != (size_t)c->n)
        return used;
    uint64_t have = hd->block_used[p->recv_one] * ps_dtype_size((ps_dtype_t)c->dtype);
    uint64_t from = p->at - (uint64_t)p->contrib_one * c->block; /* the step's place in its block */
    uint64_t left = have > from ? have - from : 0;
    return left < used ? (size_t)left : used;
}

static int step_contributes(const step_plan_t *p, int i)
{
    return p->contrib_one < 0 || p->contrib_one == i;
}

static int ring_acc(const coll_t *c)
{
    return c->ring && c->ring->mode == RING_ACC;
}

/* Whether step p's output is its one contributor's input as it came (no
 * reduction, nothing put together; not a ring's ACC, which adds to it). */
static int step_lone(const coll_t *c, const step_plan_t *p)
{
    return p->ncontrib == 1 && !ring_acc(c);
}

/* Whether the step's last contributor reduces its inputs (reduce_step),
 * rather than passing its one input on as the output or putting packed
 * blocks together. ACC adds the previous agent's step into the output: never
 * a view of a rank's input (its input stays as it was), so it reduces even
 * one input. */
static int step_reduces(const coll_t *c, const step_plan_t *p)
{
    if (step_lone(c, p))
        return 0;
    return !(c->packed && c->kind != K_REDUCE_SCATTER);
}

static int step_receives(const coll_t *c, const step_plan_t *p, int i)
{
    if (p->recv_one == -1)
        return 1;
    if (p->recv_one == -2)
        return i != c->root;
    return p->recv_one == i;
}

static int step_nreceivers(const coll_t *c, const step_plan_t *p)
{
    if (p->recv_one == -1)
        return c->n;
    if (p->recv_one == -2)
        return c->n - 1;
    return 1;
}

/* Whether c is a ring collective whose members are the whole group,
 * indexed by group rank as at the hub (PASS, ACC), of which only this
 * agent's ranks arrive here (SPLIT: the members are this agent's ranks). */
static int ring_whole(const coll_t *c)
{
    return c->ring && c->ring->mode != RING_SPLIT;
}

/* Whether member i is a rank this agent serves. */
static int coll_serves(const coll_t *c, int i)
{
    return !ring_whole(c) || c->ring->agent_of[i] == c->ring->pos;
}

/* Whether c's ring needs the agreement tokens (see PS_RING_TOKEN) before
 * its ranks are answered. Not a mesh (all_to_all) with steps: each of its
 * ranks waits for a block from every rank of the group, which that rank's
 * agent sends only once the rank came and passed its checks there, and
 * takes each block over a link whose header it checked itself; so a rank
 * answered OK knows what the tokens would tell it. Their two laps, 2A - 1
 * hops after the data, cost 0.7-1 ms a call at 64 KiB and 2-5 ms at 4 MiB
 * on 4 netns hosts (docs/PERFORMANCE.md, "A mesh all_to_all's fixed
 * cost"). */
static int ring_agrees(const coll_t *c)
{
    return ring_whole(c) && !(c->ring->mesh && c->nsteps > 0);
}

/* Waits, before a rank of c is answered OK, until every agent of the ring
 * took its link (or the collective failed). Lock held. */
static void ring_agreed_wait(coll_t *c)
{
    while (ring_agrees(c) && !c->ring->agreed && !c->failed)
        pthread_cond_wait(&c->cond, c->lock);
}

/* The members that arrive at this agent. */
static int coll_nlocal(const coll_t *c)
{
    return c->ring ? c->ring->nlocal : c->n;
}

/* PASS, ACC: the position of the agent where step s starts going round
 * (PASS: its owner's, whose rank contributes it; ACC: the one after the
 * agent of the rank it is for) and of the agent where it ends (PASS: the
 * agent of the rank it is for, or, when it is for every rank, the one
 * before the owner's; ACC: that rank's). */
static void ring_path(const coll_t *c, int64_t s, int *start, int *end)
{
    step_plan_t p;
    plan_step(c, s, &p);
    int a = c->ring->nagents;
    if (c->ring->mode == RING_PASS) {
        *start = c->ring->agent_of[p.contrib_one];
        *end = p.recv_one >= 0 ? c->ring->agent_of[p.recv_one] : (*start + a - 1) % a;
    } else {
        *end = c->ring->agent_of[p.recv_one];
        *start = (*end + 1) % a;
    }
}

/* Where step s is at this agent: RING_AT_START, _MID or _END of its path
 * (one agent: start and end), or 0 when the step does not come here (an
 * all_to_all block between two other agents). SPLIT: every step, midway. */
enum { RING_AT_START = 1, RING_AT_MID = 2, RING_AT_END = 4 };

static int ring_at(const coll_t *c, int64_t s)
{
    if (c->ring->mode == RING_SPLIT)
        return RING_AT_MID;
    int start, end, a = c->ring->nagents, pos = c->ring->pos;
    ring_path(c, s, &start, &end);
    if (c->ring->mesh) /* straight from start to end */
        return (pos == start ? RING_AT_START : 0) | (pos == end ? RING_AT_END : 0);
    int d = (pos - start + a) % a, last = (end - start + a) % a;
    if (d > last)
        return 0;
    return (d == 0 ? RING_AT_START : 0) | (d == last ? RING_AT_END : 0) |
           (d > 0 && d < last ? RING_AT_MID : 0);
}

/* Whether this agent sends step s (or its pieces) to the next agent. */
static int ring_sends(const coll_t *c, int64_t s)
{
    int at = ring_at(c, s);
    return at && !(at & RING_AT_END);
}

/* Whether this agent receives step s (or its pieces) from the previous one
 * (a mesh: from the agent where it starts). */
static int ring_takes(const coll_t *c, int64_t s)
{
    int at = ring_at(c, s);
    return at && !(at & RING_AT_START);
}

/* The position of the agent this one sends step s to (ring_sends): the next
 * one; in a mesh the one where the step ends. */
static int ring_to(const coll_t *c, int64_t s)
{
    int start, end;
    if (!c->ring->mesh)
        return (c->ring->pos + 1) % c->ring->nagents;
    ring_path(c, s, &start, &end);
    return end;
}

/* The position of the agent this one takes step s from (ring_takes). */
static int ring_from(const coll_t *c, int64_t s)
{
    int start, end;
    if (!c->ring->mesh)
        return (c->ring->pos + c->ring->nagents - 1) % c->ring->nagents;
    ring_path(c, s, &start, &end);
    return start;
}

/* ACC: whether step s ends here, with the rank it is for. */
static int ring_ends(const coll_t *c, int64_t s)
{
    return (ring_at(c, s) & RING_AT_END) != 0;
}

/* The receivers of a step at this agent; in a ring, the sender to the next
 * agent is one too when it sends the step on. */
static int step_local_receivers(const coll_t *c, int64_t s, const step_plan_t *p)
{
    if (!c->ring)
        return step_nreceivers(c, p);
    if (!ring_whole(c))
        return step_nreceivers(c, p) + 1;
    int k = ring_sends(c, s);
    for (int i = 0; i < c->n; i++)
        k += coll_serves(c, i) && step_receives(c, p, i);
    return k;
}

/* Bytes a member sends and receives in total. */
static void member_totals(const coll_t *c, int i, uint64_t *in, uint64_t *out)
{
    uint64_t P = c->block, n = (uint64_t)c->n;
    *in = *out = 0;
    switch (c->kind) {
    case K_BARRIER:
        break;
    case K_BROADCAST:
        *in = i == c->root ? P : 0;
        *out = i == c->root ? 0 : P;
        break;
    case K_ALL_REDUCE:
        *in = *out = P;
        break;
    case K_REDUCE:
        *in = P;
        *out = i == c->root ? P : 0;
        break;
    case K_ALL_GATHER:
        *in = P;
        *out = n * P;
        break;
    case K_GATHER:
        *in = P;
        *out = i == c->root ? n * P : 0;
        break;
    case K_SCATTER:
        *in = i == c->root ? n * P : 0;
        *out = P;
        break;
    case K_REDUCE_SCATTER:
        *in = n * P;
        *out = P;
        break;
    case K_ALL_TO_ALL:
        *in = *out = n * P;
        break;
    default:
        *in = i == 0 ? P : 0;
        *out = i == 1 ? P : 0;
        break;
    }
}

/* The bytes that carry data in one side of a rank's padded all_to_all
 * blocks, from its header hd: the input's (block_used) or the output's
 * (block_out_used) when the header gives them; else n whole blocks. */
static uint64_t a2a_used(const coll_t *c, const header_t *hd, const uint64_t *used, size_t nused)
{
    if (!hd || nused != (size_t)c->n)
        return (uint64_t)c->n * c->block;
    uint64_t sum = 0;
    for (size_t j = 0; j < nused; j++)
        sum += used[j];
    return sum * ps_dtype_size((ps_dtype_t)hd->dtype);
}

/* Whether collective c is so large that the agent reads and writes the
 * segments of its members with pread/pwrite on their files rather than
 * through its mappings: when the segment bytes it touches, summed over its
 * ranks (as if every one used shared memory), are over
 * --shm-resident-bytes. Bytes touched through a mapping stay in the agent's
 * resident set (as shared pages) for as long as the segment is mapped;
 * through the file they do not, at the price of a copy through a buffer of
 * one step. A segment without a file (a doorbell: small anyway) never goes
 * that way. m is a member's segment, hd its header.
 *
 * An all_to_all touches only the bytes of its blocks that carry data
 * (block_used, block_out_used: padding is neither read nor written), which
 * each rank's header gives for itself alone; its ranks' padded blocks are
 * all alike, so each takes an equal share of the budget for its own. */
static int shm_by_file(const ps__hub_t *h, const shm_map_t *m, const coll_t *c, const header_t *hd)
{
    if (m->kind == PS_SHM_PROCESS)
        return 1; /* the worker's own memory: no mapping here to use */
    if (m->fd < 0)
        return 0;
    int in_place = shm_in_place(hd);
    uint64_t total = 0, served = 0;
    for (int k = 0; k < c->n; k++) {
        uint64_t in, out;
        if (!coll_serves(c, k))
            continue;
        served++;
        if (c->kind == K_ALL_TO_ALL)
            continue; /* its own share, below */
        member_totals(c, k, &in, &out);
        total += in_place ? (in > out ? in : out) : in + out;
    }
    if (c->kind != K_ALL_TO_ALL)
        return total > h->cfg->shm_resident_bytes;
    uint64_t own = a2a_used(c, hd, hd->block_used, hd->n_block_used) +
                   a2a_used(c, hd, hd->block_out_used, hd->n_block_out_used);
    return served && own > h->cfg->shm_resident_bytes / served;
}

/* ---- collective instances ---- */

/* The bytes of a step of elements of esize (0: plain bytes): `step` (0:
 * --step-bytes) in whole elements, so reductions never split one. */
static size_t step_whole(const ps__hub_t *h, size_t step, size_t esize)
{
    size_t sb = step ? step : h->cfg->step_bytes;
    if (esize)
        sb -= sb % esize;
    return sb ? sb : esize;
}

/* Whether c, a collective of `blocks` blocks (all_gather, gather, scatter,
 * reduce_scatter: one per rank; all_to_all: one per pair of ranks) at the
 * hub, goes as one step (packed, plan_packed) rather than a step per block
 * (and per piece of one): when all its blocks fit in a step, and the memory
 * the one step holds, every contributor's whole input and the output, fits
 * in what --max-inflight-bytes leaves (*reserve: that memory). One round of
 * hand-offs between the ranks' threads instead of one per block: 1.1-9x
 * faster for p = 4 and 8 up to 1 MiB here (docs/PERFORMANCE.md, "Small
 * collectives of many blocks: one step"). Lock held. */
static int coll_packs(const ps__hub_t *h, const coll_t *c, uint64_t blocks, uint64_t *reserve)
{
    if (blocks < 2 || !c->block || c->block * blocks > c->step_bytes)
        return 0;
    step_plan_t p;
    plan_packed(c, &p);
    /* The inputs, and the output unless it is the one input (scatter). */
    *reserve = (uint64_t)p.ncontrib * p.len + (p.ncontrib > 1 ? p.out_len : 0);
    return h->inflight_bytes + *reserve <= h->cfg->max_inflight_bytes;
}

/* A new collective; NULL with *over set when it would take the agent past
 * --max-inflight-bytes (the memory its window can hold, reserved up front),
 * NULL with *over clear when out of memory. Lock held. */
static coll_t *coll_new(ps__hub_t *h, job_t *j, const header_t *hd, int n, int p2p, int ring,
                        size_t step, int *over)
{
    *over = 0;
    coll_t *c = calloc(1, sizeof(*c));
    if (!c)
        return NULL;
    c->job = j;
    c->group = hd->group;
    c->seq = hd->seq;
    c->alive_checked_ms = ps__now_ms(); /* the first check a second from now */
    c->p2p = p2p;
    c->kind = p2p ? K_SEND : (coll_kind_t)hd->kind;
    c->op = hd->op;
    c->dtype = hd->dtype;
    c->root = hd->root;
    c->count = hd->count;
    c->n = n;
    c->members = calloc((size_t)n, sizeof(*c->members));
    c->ranks = calloc((size_t)n, sizeof(int));
    c->window = h->cfg->window;
    c->slots = calloc((size_t)c->window, sizeof(slot_t));
    if (!c->members || !c->ranks || !c->slots) {
        free(c->members);
        free(c->ranks);
        free(c->slots);
        free(c);
        return NULL;
    }
    for (int i = 0; i < n; i++)
        c->ranks[i] = i;
    size_t esize = ps_dtype_size((ps_dtype_t)hd->dtype);
    c->block = hd->count * (esize ? esize : 1);
    c->step_bytes = step_whole(h, step, esize);
    c->chunks = c->block ? (c->block + c->step_bytes - 1) / c->step_bytes : 0;
    uint64_t blocks = 1;
    if (c->kind == K_ALL_GATHER || c->kind == K_GATHER || c->kind == K_SCATTER ||
        c->kind == K_REDUCE_SCATTER)
        blocks = (uint64_t)n;
    else if (c->kind == K_ALL_TO_ALL)
        blocks = (uint64_t)n * (uint64_t)n;
    c->nsteps = c->kind == K_BARRIER ? 0 : (int64_t)(blocks * c->chunks);
    uint64_t live = (uint64_t)(c->nsteps < c->window ? c->nsteps : c->window);
    uint64_t piece = c->block < c->step_bytes ? c->block : c->step_bytes;
    c->reserved = live * (uint64_t)(n + 1) * piece;
    if (!ring && !p2p && coll_packs(h, c, blocks, &c->reserved)) {
        c->packed = 1;
        c->nsteps = 1;
    }
    if (h->inflight_bytes + c->reserved > h->cfg->max_inflight_bytes) {
        free(c->members);
        free(c->ranks);
        free(c->slots);
        free(c);
        *over = 1;
        return NULL;
    }
    h->inflight_bytes += c->reserved;
    c->budget = &h->inflight_bytes;
    for (int w = 0; w < c->window; w++) {
        c->slots[w].step = -1;
        c->slots[w].last_done = w - c->window;
    }
    c->lock = &h->lock;
    c->cuda = h->cfg->reduce_cuda;
    c->cuda_min = h->cfg->reduce_cuda_min;
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&c->cond, &ca);
    pthread_condattr_destroy(&ca);
    ps__metrics_inflight_add(1);
    return c;
}

static void slot_clear(slot_t *s, int n)
{
    int64_t done = s->step >= 0 ? s->step : s->last_done;
    if (s->in) {
        for (int i = 0; i < n; i++)
            blob_unref(s->in[i]);
        free(s->in);
    }
    free(s->placed);
    blob_unref(s->out);
    memset(s, 0, sizeof(*s));
    s->step = -1;
    s->last_done = done;
}

static void member_free(member_t *m);

/* Frees the collective and its members (whose handlers have all returned). */
static void coll_free(coll_t *c)
{
    ps__metrics_inflight_add(-1);
    *c->budget -= c->reserved;
    for (int i = 0; i < c->n; i++)
        member_free(c->members[i]);
    for (int w = 0; w < c->window; w++)
        slot_clear(&c->slots[w], c->n);
    pthread_cond_destroy(&c->cond);
    if (c->ring) {
        while (c->ring->q_head) {
            ring_frame_t *q = c->ring->q_head;
            c->ring->q_head = q->next;
            ps__frame_clear(&q->f);
            free(q);
        }
        ring_link_clear(&c->ring->out);
        ring_link_clear(&c->ring->in);
        for (int k = 0; c->ring->xin && c->ring->xout && k < c->ring->nagents - 2; k++) {
            ring_link_clear(&c->ring->xin[k]);
            ring_link_clear(&c->ring->xout[k]);
        }
        free(c->ring->xin);
        free(c->ring->xout);
        free(c->ring->agent_of);
        blob_unref(c->ring->rd_val);
        free(c->ring);
    }
    free(c->order);
    free(c->slots);
    free(c->members);
    free(c->ranks);
    free(c);
}

static void tombstone_add(job_t *j, const coll_t *c)
{
    tombstone_t *t = calloc(1, sizeof(*t));
    if (!t)
        return;
    t->group = c->group;
    t->seq = c->seq;
    t->code = c->code;
    snprintf(t->message, sizeof(t->message), "%s", c->message);
    t->next = j->tombstones;
    j->tombstones = t;
    int n = 0;
    for (tombstone_t **p = &j->tombstones; *p; n++) {
        if (n >= PS_HUB_TOMBSTONES) {
            tombstone_t *old = *p;
            *p = old->next;
            free(old);
        } else {
            p = &(*p)->next;
        }
    }
}

static void coll_unlink(job_t *j, coll_t *c)
{
    for (coll_t **p = &j->colls; *p; p = &(*p)->next)
        if (*p == c) {
            *p = c->next;
            return;
        }
}

/* The widest window of a collective whose slots hold no heap memory. */
#define PS_HUB_VIEW_WINDOW 64

/* Below this many bytes a step's output is not a view of a member's segment
 * (step_out_view, a lone contributor's input) but a copy of the agent's: a
 * member answers only once no view of its segment is left
 * (member_views_wait), so with a view the member whose segment it was waits
 * for every other to copy out, one more wake-up on its path, where copying
 * a few KiB costs well under one (docs/PERFORMANCE.md, "Small collectives:
 * one wake-up per member"). */
#define PS_HUB_VIEW_MIN (64u << 10)

/* A collective that only moves bytes (every step has one contributor) and
 * whose members all use shared memory through their mappings holds nothing
 * but views of their segments in its slots: it gets a wider window, so
 * that several blocks, and so several senders and receivers, move at once (measured, 64 MiB
 * busbw in three A/B pairs: all_to_all p=4 0.75/0.85/0.79 GB/s with 4
 * steps in flight, 0.95/0.93/0.85 with up to 64; scatter p=4 3.13/2.95/2.38
 * against 3.47/3.32/2.85; all_gather and broadcast within noise). Called
 * under the lock once every member is there and before any has claimed a
 * slot. */
static void coll_widen(const ps__hub_t *h, coll_t *c)
{
    if (c->failed || c->ring || c->window >= PS_HUB_VIEW_WINDOW || c->nsteps <= c->window)
        return;
    if (!c->p2p && c->kind != K_BROADCAST && c->kind != K_ALL_GATHER && c->kind != K_GATHER &&
        c->kind != K_SCATTER && c->kind != K_ALL_TO_ALL)
        return;
    /* Any member read through a file or its process's memory fills its
     * slots with copies. */
    for (int i = 0; i < c->n; i++)
        if (!c->members[i] || !c->members[i]->shm ||
            shm_by_file(h, c->members[i]->shm, c, c->members[i]->first->header))
            return;
    int w = c->nsteps < PS_HUB_VIEW_WINDOW ? (int)c->nsteps : PS_HUB_VIEW_WINDOW;
    slot_t *slots = calloc((size_t)w, sizeof(slot_t));
    if (!slots)
        return; /* the narrow window still works */
    for (int i = 0; i < c->window; i++)
        if (c->slots[i].step != -1) { /* claimed after all: keep it */
            free(slots);
            return;
        }
    free(c->slots);
    c->slots = slots;
    c->window = w;
    for (int i = 0; i < w; i++) {
        c->slots[i].step = -1;
        c->slots[i].last_done = i - w;
    }
}

/* The step that used the slot of step s before it: s - window; in a ring
 * whose steps do not all come to this agent (all_to_all), the last earlier
 * one that does; when there is none, the slot's initial last_done. */
static int64_t slot_prev_step(const coll_t *c, int64_t s)
{
    int64_t p = s - c->window;
    if (ring_whole(c))
        while (p >= 0 && !ring_at(c, p))
            p -= c->window;
    return p >= 0 ? p : s % c->window - c->window;
}

/* Claims the slot of step s when the step `window` earlier has been
 * consumed: 1 when claimed (or already), 0 when not yet free, -1 when out of
 * memory (the collective failed). Lock held. */
static int slot_take(coll_t *c, int64_t s)
{
    slot_t *sl = &c->slots[s % c->window];
    if (sl->step == s)
        return 1;
    if (sl->step != -1 || sl->last_done != slot_prev_step(c, s))
        return 0;
    step_plan_t p;
    plan_step(c, s, &p);
    sl->in = calloc((size_t)c->n, sizeof(blob_t *));
    sl->placed = c->cuda ? calloc((size_t)c->n, 1) : NULL;
    if (!sl->in || (c->cuda && !sl->placed)) {
        free(sl->in);
        free(sl->placed);
        sl->in = NULL;
        sl->placed = NULL;
        coll_fail(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "%s: out of memory", kind_name(c->kind));
        return -1;
    }
    sl->step = s;
    sl->len = p.len;
    /* ACC: every rank contributes, this agent's are here. */
    sl->need = ring_acc(c) ? c->ring->nlocal : p.ncontrib;
    sl->recv_need = step_local_receivers(c, s, &p);
    return 1;
}

/* Claims the slot of step s, waiting until the step `window` earlier has
 * been consumed. Lock held. NULL when the collective failed. */
static slot_t *slot_claim(coll_t *c, int64_t s)
{
    while (!c->failed && slot_take(c, s) == 0)
        pthread_cond_wait(&c->cond, c->lock);
    return c->failed ? NULL : &c->slots[s % c->window];
}

/* A step whose every receiver has its output frees its slot. Lock held. */
static void slot_consumed(coll_t *c, slot_t *sl)
{
    slot_clear(sl, c->n);
    pthread_cond_broadcast(&c->cond);
}

/* ---- member input ---- */

/* Takes the member's next len input bytes into b (copied to b->data, or
 * held in pieces), receiving frames as needed. 0, or a negative code with
 * the collective failed. */
static int member_read(member_t *m, blob_t *b, size_t len)
{
    coll_t *c = m->coll;
    size_t filled = 0;
    while (len > 0) {
        if (m->frame_pos == m->frame.data_len) {
            grpc_byte_buffer *bb = NULL;
            ps__frame_clear(&m->frame);
            m->frame_pos = 0;
            int rc = ps__rpc_call_recv(m->call, &bb);
            /* A stream that ends early may be a client that died: gRPC can
             * report that as an end of stream, so ask how it ended. */
            if (rc == 0 && !bb && ps__rpc_call_peer_cancelled(m->call, 200) == 1)
                rc = PS_EABORTED;
            if (rc < 0 || !bb) {
                pthread_mutex_lock(c->lock);
                if (rc < 0)
                    coll_fail(c, GRPC_STATUS_ABORTED,
                              "%s (group %u, seq %" PRIu64
                              "): rank %d's stream broke after %" PRIu64 " of %" PRIu64
                              " input bytes (the process or its connection died?)",
                              kind_name(c->kind), c->group, c->seq, c->ranks[m->index], m->in_off,
                              m->in_total);
                else
                    coll_fail(c, GRPC_STATUS_INVALID_ARGUMENT,
                              "%s (group %u, seq %" PRIu64
                              "): rank %d ended its input after %" PRIu64 " of %" PRIu64 " bytes",
                              kind_name(c->kind), c->group, c->seq, c->ranks[m->index], m->in_off,
                              m->in_total);
                pthread_mutex_unlock(c->lock);
                return PS_EABORTED;
            }
            rc = ps__frame_decode(bb, &m->frame);
            grpc_byte_buffer_destroy(bb);
            const char *why = NULL;
            if (rc < 0)
                why = "a malformed frame";
            else if (m->frame.meta->offset != m->in_off)
                why = "a frame at the wrong offset";
            else if (m->frame.data_len > m->in_total - m->in_off)
                why = "more bytes than its count implies";
            if (why) {
                pthread_mutex_lock(c->lock);
                coll_fail(c, GRPC_STATUS_INVALID_ARGUMENT,
                          "%s (group %u, seq %" PRIu64 "): rank %d sent %s (at input byte %" PRIu64
                          ")",
                          kind_name(c->kind), c->group, c->seq, c->ranks[m->index], why, m->in_off);
                pthread_mutex_unlock(c->lock);
                return PS_EINVAL;
            }
            continue;
        }
        size_t k = m->frame.data_len - m->frame_pos;
        if (k > len)
            k = len;
        int rc = 0;
        if (!b->data && (size_t)b->npieces + m->frame.nslices > PS_HUB_MAX_PIECES(b->len))
            rc = blob_flatten(b);
        if (rc == 0 && b->data)
            ps__frame_copy_data(&m->frame, m->frame_pos, b->data + filled, k);
        else if (rc == 0)
            rc = blob_hold(b, &m->frame, m->frame_pos, k);
        if (rc < 0) {
            pthread_mutex_lock(c->lock);
            coll_fail(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "%s: out of memory", kind_name(c->kind));
            pthread_mutex_unlock(c->lock);
            return PS_ENOMEM;
        }
        m->frame_pos += k;
        m->in_off += k;
        ps__metrics_bytes(PS_M_RX, m->link, k);
        filled += k;
        len -= k;
    }
    return 0;
}

/* CUDA stagers (they are not thread-safe), one per reduction running at
 * once: a reducing thread takes one from the free list, or makes one, and
 * puts it back. Making one costs milliseconds (streams, a device buffer),
 * so they are kept, not tied to the threads of the pool that come and go,
 * and never freed: freeing at exit could race CUDA's runtime tearing itself
 * down (a daemon killed by SIGSEGV after "stopped" was seen on an H200
 * when a thread's stager was freed then). */
typedef struct stager_node {
    ps_gpu_stager_t *stager;
    struct stager_node *next;
} stager_node_t;

static pthread_mutex_t stager_lock = PTHREAD_MUTEX_INITIALIZER;
static stager_node_t *stagers_free;

static stager_node_t *stager_get(void)
{
    pthread_mutex_lock(&stager_lock);
    stager_node_t *n = stagers_free;
    if (n)
        stagers_free = n->next;
    pthread_mutex_unlock(&stager_lock);
    if (n)
        return n;
    n = calloc(1, sizeof(*n));
    if (n && ps_gpu_stager_create(&n->stager, 0, PS_GPU_MAX_SRCS, 0) != 0) {
        free(n);
        n = NULL;
    }
    return n;
}

static void stager_put(stager_node_t *n)
{
    pthread_mutex_lock(&stager_lock);
    n->next = stagers_free;
    stagers_free = n;
    pthread_mutex_unlock(&stager_lock);
}

/* The operation the hub applies to a step's inputs. */
static ps_op_t hub_op(const coll_t *c)
{
    /* A ring divides an average once, where the last piece is added. */
    return c->ring && c->op == PS_AVG ? PS_SUM : (ps_op_t)c->op;
}

/* Whether a step of len bytes per input reduces on the GPU. */
static int step_cuda(const coll_t *c, size_t len)
{
    return c->cuda && len >= c->cuda_min;
}

/* Whether [a, a + len) and [b, b + len) share a byte. */
static int bytes_overlap(const void *a, const void *b, size_t len)
{
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return len && x < y + len && y < x + len;
}

/* Whether a step's result may be written at d (len bytes) while its inputs
 * in[0..n) (NULL where a member gave none) are read: d shares no byte with
 * any input (one held in pieces is frames of the hub's), or is exactly an
 * input, in place: the first only for the CPU engine (ps_reduce_multi), any
 * with alias_any (the stager reads every input of a chunk before writing). */
static int place_apart(const uint8_t *d, size_t len, blob_t *const *in, int n, int alias_any)
{
    int first = 1;
    for (int j = 0; j < n; j++) {
        if (!in[j])
            continue;
        const uint8_t *x = in[j]->data;
        if (x && !(x == d && (first || alias_any)) && bytes_overlap(d, x, len))
            return 0;
        first = 0;
    }
    return 1;
}

/* Reduces one step on the device the agent was told to use, into dsts[0]
 * ... dsts[ndst - 1] (on CUDA each by DMA where it is pinned), where the
 * first nplaced are members' segments (step_places) and the last, if any
 * more, is the step's output `out`. A collective wider than the CUDA path
 * takes, or a CUDA failure, falls back to the CPU engine into `out` alone
 * (same bits by construction): *placed is then 0, and every receiver takes
 * the result from there. After a CUDA failure that may have written part of
 * a segment that is also an input (in place), nothing is left to reduce
 * from: PS_EINTERNAL. */
static int hub_reduce(coll_t *c, void *out, void *const *dsts, size_t ndst, size_t nplaced,
                      const void **srcs, size_t nsrc, size_t len, int *placed)
{
    ps_op_t op = hub_op(c);
    ps_dtype_t dt = (ps_dtype_t)c->dtype;
    size_t count = len / ps_dtype_size(dt);
    uint64_t bytes = (uint64_t)len * nsrc;
    *placed = 0;
    if (step_cuda(c, len) && nsrc <= PS_GPU_MAX_SRCS) {
        stager_node_t *st = stager_get();
        int rc = st ? ps_gpu_reduce_host_dsts(st->stager, op, dt, dsts, ndst, srcs, nsrc, count)
                    : PS_ENOMEM;
        if (st)
            stager_put(st);
        if (rc == 0) {
            /* The device read the inputs: pinned segments among them are
             * looked at through their files before anyone is answered. */
            atomic_store(&c->device_read, 1);
            ps__metrics_reduced(PS_M_DEV_CUDA, bytes);
            *placed = nplaced > 0;
            return 0;
        }
        for (size_t i = 0; i < nplaced && st; i++)
            for (size_t j = 0; j < nsrc; j++)
                if (dsts[i] == srcs[j]) {
                    ps__log(PS_LOG_ERROR,
                            "%s (group %u, seq %" PRIu64 "): reducing a step on CUDA failed "
                            "(%s) after it may have written a rank's input in place",
                            kind_name(c->kind), c->group, c->seq, ps_strerror(rc));
                    return PS_EINTERNAL;
                }
    }
    int rc = ps_reduce_multi(op, dt, out, srcs, nsrc, count);
    ps__metrics_reduced(PS_M_DEV_CPU, bytes);
    return rc;
}

/* Where member m's output of step s of a reduction that step_places or
 * step_out_view serve lies in its segment as the agent maps it, or NULL
 * where it is not mapped here (gRPC, by file, a worker's process segment). */
static uint8_t *step_out_at(const coll_t *c, const member_t *m, int64_t s)
{
    if (!m || !m->shm || m->by_file)
        return NULL;
    return m->oshm->base + m->shm_out.at + (uint64_t)s % c->chunks * c->step_bytes;
}

/* The receivers of step s whose part of the result the device writes
 * straight into their segments, so that no CPU copies it there
 * (member_write): members whose segment is mapped here and pinned, in the
 * reductions whose receivers each take the whole step at the same offset
 * of their outputs (all_reduce, reduce, reduce_scatter; not packed, not
 * round a ring), on CUDA, in the collective's last step: its copies come
 * after the device's last work, so the worker waits for them (a one-step
 * all_reduce of 1 MiB took 1.3-1.7x less time on an H200 so). An earlier
 * step's copies overlap the device's work on later steps, and writing every
 * receiver by DMA moves p times the bytes back over the bus: done for every
 * step, 16 and 64 MiB all_reduces of 8 ranks were 1.13-1.24x slower, and
 * for the last window of 4 steps, 4 MiB ones 1.04-1.13x (docs/GPU.md,
 * "Results written by the device").
 * dsts[k] is where the k-th goes, sl->placed[i] marks member i; a place
 * that overlaps another, or an input other than exactly (place_apart), is
 * left to the CPU. Sets *all when every receiver is placed (no output blob
 * needed). Returns how many, at most PS_GPU_MAX_SRCS - 1 (room for the
 * blob). */
static size_t step_places(const coll_t *c, const slot_t *sl, int64_t s, const step_plan_t *p,
                          size_t nsrc, void **dsts, int *all)
{
    *all = 0;
    if (c->packed || c->ring || !step_cuda(c, p->len) || nsrc > PS_GPU_MAX_SRCS ||
        s + 1 < c->nsteps)
        return 0;
    size_t n = 0, receivers = 0;
    for (int i = 0; i < c->n; i++) {
        if (!step_receives(c, p, i))
            continue;
        receivers++;
        member_t *m = c->members[i];
        uint8_t *d = step_out_at(c, m, s);
        if (!d || !m->oshm->pinned || n == PS_GPU_MAX_SRCS - 1)
            continue;
        int ok = place_apart(d, p->len, sl->in, c->n, 1);
        for (size_t k = 0; k < n && ok; k++)
            ok = !bytes_overlap(d, dsts[k], p->len);
        if (ok) {
            dsts[n++] = d;
            sl->placed[i] = 1;
        }
    }
    *all = n == receivers;
    return n;
}

/* A step reduced on the CPU goes straight into the output of its first
 * receiver whose segment is mapped here and that view is the step's
 * output: that receiver copies nothing (member_write: reduced in place)
 * and the others copy from its segment, one copy fewer than through a blob
 * of the agent's, and none at all where the step has one receiver (reduce,
 * reduce_scatter). The reductions of step_places (all_reduce, reduce,
 * reduce_scatter; not packed, not round a ring), and only when every
 * receiver is a worker of this agent's segments (a gRPC receiver's frames
 * would hold the view until sent, and with it that receiver's answer). The
 * place must be apart from the inputs as ps_reduce_multi wants
 * (place_apart). NULL when none qualifies (or out of memory): the step's
 * output is a blob. */
static blob_t *step_out_view(const coll_t *c, const slot_t *sl, int64_t s, const step_plan_t *p)
{
    if (c->packed || c->ring || step_cuda(c, p->len) || p->len < PS_HUB_VIEW_MIN)
        return NULL;
    for (int i = 0; i < c->n; i++)
        if (step_receives(c, p, i) && (!c->members[i] || !c->members[i]->shm))
            return NULL;
    for (int i = 0; i < c->n; i++) {
        uint8_t *d = step_receives(c, p, i) ? step_out_at(c, c->members[i], s) : NULL;
        if (d && place_apart(d, p->len, sl->in, c->n, 0))
            return blob_view(c->members[i]->oshm, d, p->len);
    }
    return NULL;
}

/* Where a reduction has got to in one input: its pieces (one for a whole
 * input), the current one and the offset in it. */
typedef struct in_cursor {
    const struct iovec *piece;
    int npieces, i;
    size_t off;
    struct iovec whole;
} in_cursor_t;

/* The bytes left in the current piece, skipping used-up ones; 0 at the end. */
static size_t in_cursor_avail(in_cursor_t *k)
{
    while (k->i < k->npieces && k->off == k->piece[k->i].iov_len) {
        k->i++;
        k->off = 0;
    }
    return k->i < k->npieces ? k->piece[k->i].iov_len - k->off : 0;
}

/* Reduces n inputs of len bytes each, read through their cursors, in input
 * order into dst (which may be the first input exactly: in place). Runs go
 * to the engine as long as every input is contiguous over them; an element
 * split between two pieces (in some input) is put together first. Every
 * element sees the same operations in the same order as in one call over
 * whole inputs, so the bits are the same. 0 or a negative code. */
static int reduce_runs(ps_op_t op, ps_dtype_t dt, uint8_t *dst, in_cursor_t *cur, size_t n,
                       size_t len)
{
    size_t es = ps_dtype_size(dt);
    const void **srcs = malloc(n * sizeof(*srcs));
    uint8_t *split = malloc(n * es);
    int rc = srcs && split ? 0 : PS_ENOMEM;
    for (size_t done = 0; rc == 0 && done < len;) {
        size_t run = len - done;
        for (size_t k = 0; k < n; k++) {
            size_t avail = in_cursor_avail(&cur[k]);
            if (avail < run)
                run = avail;
        }
        run -= run % es;
        for (size_t k = 0; k < n; k++) {
            in_cursor_t *q = &cur[k];
            if (run) {
                srcs[k] = (const uint8_t *)q->piece[q->i].iov_base + q->off;
                q->off += run;
                continue;
            }
            uint8_t *e = split + k * es;
            for (size_t b = 0; b < es && rc == 0; b++) {
                if (in_cursor_avail(q) == 0)
                    rc = PS_EINVAL; /* not reached: each input holds len bytes */
                else
                    e[b] = ((const uint8_t *)q->piece[q->i].iov_base)[q->off++];
            }
            srcs[k] = e;
        }
        size_t step = run ? run : es;
        if (rc == 0)
            rc = ps_reduce_multi(op, dt, dst + done, srcs, n, step / es);
        done += step;
    }
    free(srcs);
    free(split);
    return rc;
}

/* A cursor over one whole input. */
static void in_cursor_whole(in_cursor_t *q, const void *data, size_t len)
{
    *q = (in_cursor_t){.whole = {(void *)data, len}, .npieces = 1};
    q->piece = &q->whole;
}

/* Reduces a step's inputs in[i] (NULL where member i gave none), len bytes
 * each, in member order into dst; inputs held in pieces (blob_pieces) are
 * read where they lie (reduce_runs). 0 or a negative code. */
static int reduce_step(coll_t *c, slot_t *sl, int64_t s, const step_plan_t *p, uint8_t *dst)
{
    blob_t *const *in = sl->in;
    size_t len = p->len;
    size_t n = 0;
    int pieces = 0;
    for (int i = 0; i < c->n; i++)
        if (in[i]) {
            n++;
            pieces |= !in[i]->data;
        }
    if (!pieces) {
        const void **srcs = malloc(n * sizeof(*srcs));
        if (!srcs)
            return PS_ENOMEM;
        size_t k = 0;
        for (int i = 0; i < c->n; i++)
            if (in[i])
                srcs[k++] = in[i]->data;
        void *dsts[PS_GPU_MAX_SRCS];
        int all, placed;
        size_t nplaced = step_places(c, sl, s, p, n, dsts, &all);
        size_t ndst = nplaced;
        if (!all)
            dsts[ndst++] = dst;
        int rc = hub_reduce(c, dst, dsts, ndst, nplaced, srcs, n, len, &placed);
        if (!placed && nplaced)
            memset(sl->placed, 0, (size_t)c->n);
        free(srcs);
        return rc;
    }
    /* Where the held pieces lie: their slices no longer move (an inlined
     * slice keeps its bytes in itself). */
    size_t total = 0;
    for (int i = 0; i < c->n; i++)
        if (in[i] && !in[i]->data)
            total += (size_t)in[i]->npieces;
    in_cursor_t *cur = calloc(n, sizeof(*cur));
    struct iovec *iov = malloc((total ? total : 1) * sizeof(*iov)), *at = iov;
    int rc = cur && iov ? 0 : PS_ENOMEM;
    for (int i = 0, k = 0; i < c->n && rc == 0; i++) {
        if (!in[i])
            continue;
        in_cursor_t *q = &cur[k++];
        if (in[i]->data) {
            in_cursor_whole(q, in[i]->data, len);
            continue;
        }
        q->piece = at;
        q->npieces = in[i]->npieces;
        for (int j = 0; j < in[i]->npieces; j++)
            *at++ = (struct iovec){GRPC_SLICE_START_PTR(in[i]->held[j]),
                                   GRPC_SLICE_LENGTH(in[i]->held[j])};
    }
    if (rc == 0)
        rc = reduce_runs(hub_op(c), (ps_dtype_t)c->dtype, dst, cur, n, len);
    if (rc == 0)
        ps__metrics_reduced(PS_M_DEV_CPU, (uint64_t)len * n);
    free(iov);
    free(cur);
    return rc;
}

/* Fails the collective when reading (or writing) the segment of member m
 * through its file failed with rc (a negative errno); returns whether it
 * did. */
static int seg_failed(member_t *m, int write, int rc)
{
    if (rc == 0)
        return 0;
    coll_t *c = m->coll;
    pthread_mutex_lock(c->lock);
    int process = m->shm->kind == PS_SHM_PROCESS;
    /* In the worker's memory a bad address is the caller's mistake, and a
     * process that is gone a lost rank. */
    coll_fail(c,
              process && rc == -EFAULT  ? GRPC_STATUS_INVALID_ARGUMENT
              : process && rc == -ESRCH ? GRPC_STATUS_ABORTED
                                        : GRPC_STATUS_INTERNAL,
              "%s (group %u, seq %" PRIu64 "): %s rank %d's %s: %s", kind_name(c->kind), c->group,
              c->seq, write ? "writing" : "reading", c->ranks[m->index],
              process ? "memory (through its process segment)" : "segment", strerror(-rc));
    pthread_mutex_unlock(c->lock);
    return 1;
}

/* Fails c when the segment of one of its members shrank under the agent
 * (sigbus_handler): what was read from it is zeros, not the rank's data;
 * or, once the device has read steps (hub_reduce), when a pinned segment's
 * file is shorter (shm_shrank): one look at each file after each batch of
 * device reads, not one per member answered. Called before a member is
 * answered; returns whether c failed. Lock held. */
static int shm_broken_check(coll_t *c)
{
    int files = atomic_exchange(&c->device_read, 0);
    for (int i = 0; i < c->n && !c->failed; i++)
        if (c->members[i] &&
            (shm_broken(c->members[i]->shm) || shm_broken(c->members[i]->oshm) ||
             (files && (shm_shrank(c->members[i]->shm) || shm_shrank(c->members[i]->oshm)))))
            coll_fail(c, GRPC_STATUS_DATA_LOSS,
                      "%s (group %u, seq %" PRIu64 "): rank %d's shared-memory segment shrank "
                      "while the agent used it (truncated by the worker?): its data is lost",
                      kind_name(c->kind), c->group, c->seq, c->ranks[i]);
    return c->failed;
}

/* Deposits the member's contributions, step by step. */
static void member_deposit(member_t *m)
{
    coll_t *c = m->coll;
    for (int64_t s = 0; s < c->nsteps; s++) {
        step_plan_t p;
        plan_step(c, s, &p);
        if (!step_contributes(&p, m->index))
            continue;
        /* An input the CPU reduces is read where it arrived, not copied; so
         * is one in a segment mapped here, but for a lone contributor's small
         * one (PS_HUB_VIEW_MIN): as the step's output, a view would keep its
         * rank unanswered until every reader had copied it. */
        int mapped = m->shm && !m->by_file;
        int lone = step_lone(c, &p);
        int view = mapped && !(lone && p.len < PS_HUB_VIEW_MIN);
        int reduces = step_reduces(c, &p);
        int gpu = reduces && step_cuda(c, p.len);
        int held = reduces && !gpu && !m->shm;
        uint8_t *src = mapped ? m->shm->base + m->shm_in.at + m->in_off : NULL;
        blob_t *b = view   ? blob_view(m->shm, src, p.len)
                    : held ? blob_pieces(p.len)     /* never mapped */
                    : gpu  ? blob_new_pinned(p.len) /* never lone, so mapped is a view */
                           : blob_new(p.len);
        if (b && mapped && !view)
            memcpy(b->data, src, p.len);
        uint64_t at = m->in_off;
        pthread_mutex_lock(c->lock);
        slot_t *sl = b ? slot_claim(c, s) : NULL;
        if (!b && !c->failed)
            coll_fail(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "%s: out of memory", kind_name(c->kind));
        pthread_mutex_unlock(c->lock);
        /* An all_to_all block's padding is never read (step_used): through
         * a file or the worker's memory it is zeros instead, since a rank
         * answered in frames gets the whole step. */
        size_t used = p.len;
        if (m->shm && c->kind == K_ALL_TO_ALL && !c->packed)
            used = step_used(c, &p, NULL); /* p.slice is p.len: at most that */
        size_t got = m->shm && m->by_file ? used : p.len;
        if (sl && m->shm) {
            m->in_off += p.len;
            ps__metrics_shm_bytes(PS_M_RX, shm_access(m->shm, m->by_file), used);
        }
        if (b && got < p.len)
            memset(b->data + got, 0, p.len - got);
        if (!sl || (!m->shm && member_read(m, b, p.len) < 0) ||
            (m->shm && m->by_file &&
             seg_failed(m, 0, seg_io(m->shm, 0, b->data, got, &m->shm_in, at)))) {
            blob_unref(b);
            return;
        }
        pthread_mutex_lock(c->lock);
        if (c->failed) {
            pthread_mutex_unlock(c->lock);
            blob_unref(b);
            return;
        }
        sl->in[m->index] = b;
        if (++sl->have == sl->need) {
            if (lone) {
                sl->out = b;
                sl->in[m->index] = NULL;
            } else {
                /* The last contributor reduces (or, packed, puts the
                 * blocks together), outside the lock, in rank order so
                 * every run gives the same bits. */
                pthread_mutex_unlock(c->lock);
                blob_t *out = reduces ? step_out_view(c, sl, s, &p) : NULL;
                if (!out)
                    out = gpu ? blob_new_pinned(p.out_len) : blob_new(p.out_len);
                int rc = PS_ENOMEM;
                if (out && !reduces) {
                    packed_combine(c, out->data, sl->in);
                    rc = 0;
                } else if (out) {
                    rc = reduce_step(c, sl, s, &p, out->data);
                }
                pthread_mutex_lock(c->lock);
                if (rc < 0) {
                    blob_unref(out);
                    coll_fail(c,
                              rc == PS_ENOMEM      ? GRPC_STATUS_RESOURCE_EXHAUSTED
                              : rc == PS_EINTERNAL ? GRPC_STATUS_INTERNAL
                                                   : GRPC_STATUS_INVALID_ARGUMENT,
                              "%s: reduction failed: %s", kind_name(c->kind), ps_strerror(rc));
                    pthread_mutex_unlock(c->lock);
                    return;
                }
                for (int i = 0; i < c->n; i++) {
                    blob_unref(sl->in[i]);
                    sl->in[i] = NULL;
                }
                sl->out = out;
            }
            if (c->ring && c->ring->mode != RING_PASS)
                sl->partial = 1; /* the ring makes it the result */
            else
                sl->computed = 1;
            if (sl->recv_need == 0)
                slot_consumed(c, sl);
            pthread_cond_broadcast(&c->cond);
        }
        pthread_mutex_unlock(c->lock);
    }
}

/* ---- member output ---- */

/* Sends one output frame; with `last`, the OK status goes in the same batch. */
static int send_frame(member_t *m, const Paramsync__V1__CollectiveResult *res, uint64_t off,
                      blob_t *b, size_t boff, size_t len, int last)
{
    if (b)
        blob_ref(b);
    grpc_byte_buffer *bb =
        ps__frame_encode(NULL, res, off, b ? b->data + boff : NULL, len, b ? blob_unref : NULL, b);
    if (!bb)
        return PS_ENOMEM;
    int rc = last ? ps__rpc_call_send_last(m->call, bb, GRPC_STATUS_OK, "")
                  : ps__rpc_call_send(m->call, bb);
    grpc_byte_buffer_destroy(bb);
    if (rc == 0 && len)
        ps__metrics_bytes(PS_M_TX, m->link, len);
    return rc;
}

static void result_init(const coll_t *c, const member_t *m, Paramsync__V1__CollectiveResult *res)
{
    paramsync__v1__collective_result__init(res);
    res->bytes = m->out_total;
    res->source = c->p2p ? c->ranks[0] : -1;
}

/* Waits until no view of the member's segment is left, or the collective
 * failed (then its views go only when every member is done, and the worker
 * gets an error anyway). Called before a shared-memory member is answered. */
static void member_views_wait(member_t *m)
{
    coll_t *c = m->coll;
    for (;;) {
        pthread_mutex_lock(&blob_lock);
        if (m->shm->views == 0 && m->oshm->views == 0) {
            pthread_mutex_unlock(&blob_lock);
            return;
        }
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_nsec += 20 * 1000 * 1000;
        if (until.tv_nsec >= 1000000000) {
            until.tv_sec++;
            until.tv_nsec -= 1000000000;
        }
        pthread_cond_timedwait(&views_gone, &blob_lock, &until);
        pthread_mutex_unlock(&blob_lock);
        /* Lock order is hub lock, then blob_lock: never the other way. */
        pthread_mutex_lock(c->lock);
        int failed = c->failed;
        pthread_mutex_unlock(c->lock);
        if (failed)
            return;
    }
}

/* Whether the step is the member's own block coming back to it (its input
 * alone, for it) in a collective in place (CollectiveHeader.own_block: the
 * input lies in that very block of the output, shm_own_in_place): there is
 * nothing to write. */
static int step_own_placed(const member_t *m, const step_plan_t *p)
{
    return m->shm && m->first->header->own_block && p->contrib_one == m->index;
}

/* Writes bytes [soff, soff+len) of a step's output into the shared-memory
 * member's output at off: through the segment's mapping, its file or the
 * worker's memory, from the blob's own bytes or, held in pieces (a passed-on
 * step, pass_step_held), from the slices it came in. 0 or < 0. */
static int member_put(member_t *m, const blob_t *out, size_t soff, size_t len, uint64_t off)
{
    struct iovec iov[PS_HUB_FRAME_IOV];
    int n = len ? 1 : 0, rc = 0;
    if (out->data)
        iov[0] = (struct iovec){out->data + soff, len};
    else if ((n = blob_piece_iov(out, soff, len, iov, NULL, PS_HUB_FRAME_IOV)) < 0)
        return PS_EINTERNAL; /* not reached: held only in that many */
    if (m->by_file) {
        rc = seg_iov(m->oshm, 1, iov, n, &m->shm_out, off);
        seg_failed(m, 1, rc);
    } else {
        uint8_t *dst = m->oshm->base + m->shm_out.at + off;
        for (int i = 0; i < n; dst += iov[i].iov_len, i++)
            if (dst != iov[i].iov_base) /* else reduced in place */
                memcpy(dst, iov[i].iov_base, iov[i].iov_len);
    }
    if (rc == 0)
        ps__metrics_shm_bytes(PS_M_TX, shm_access(m->oshm, m->by_file), len);
    return rc;
}

/* Sends the member's outputs; the first frame also carries the result.
 * With `finish` (the member's input is already consumed) the last frame
 * carries the OK status too. Returns 1 when it sent the status. */
static int member_write(member_t *m, int finish)
{
    coll_t *c = m->coll;
    Paramsync__V1__CollectiveResult res;
    result_init(c, m, &res);
    int first = 1;
    int64_t last_step = -1;
    for (int64_t s = 0; s < c->nsteps && finish; s++) {
        step_plan_t p;
        plan_step(c, s, &p);
        if (step_receives(c, &p, m->index))
            last_step = s;
    }
    for (int64_t s = 0; s < c->nsteps; s++) {
        step_plan_t p;
        plan_step(c, s, &p);
        if (!step_receives(c, &p, m->index))
            continue;
        slot_t *sl = &c->slots[s % c->window];
        pthread_mutex_lock(c->lock);
        while (!c->failed && !(sl->step == s && sl->computed))
            pthread_cond_wait(&c->cond, c->lock);
        if (s == last_step) { /* its status goes with this step's data */
            shm_broken_check(c);
            ring_agreed_wait(c);
        }
        if (c->failed) {
            pthread_mutex_unlock(c->lock);
            return 0;
        }
        blob_t *out = sl->out;
        blob_ref(out);
        int placed = sl->placed && sl->placed[m->index];
        pthread_mutex_unlock(c->lock);
        size_t soff = step_slice(&p, m->index), len = p.slice;
        int rc = 0;
        if (step_own_placed(m, &p)) {
            /* in place: the block holds the member's input already */
        } else if (placed) {
            /* the device wrote it there (step_places) */
            ps__metrics_shm_bytes(PS_M_TX, PS_M_SHM_DEVICE, len);
        } else if (m->shm) { /* the result frame follows the data, below */
            rc = member_put(m, out, soff, step_used(c, &p, out), p.at);
        } else {
            rc = send_frame(m, first ? &res : NULL, p.at, out, soff, len, s == last_step);
        }
        blob_unref(out);
        first = 0;
        pthread_mutex_lock(c->lock);
        if (rc < 0)
            coll_fail(c, GRPC_STATUS_ABORTED,
                      "%s (group %u, seq %" PRIu64 "): sending to rank %d failed (the process or "
                      "its connection died?)",
                      kind_name(c->kind), c->group, c->seq, c->ranks[m->index]);
        if (sl->step == s && ++sl->recv_done == sl->recv_need)
            slot_consumed(c, sl);
        pthread_mutex_unlock(c->lock);
        if (rc < 0)
            return 0;
        if (s == last_step && !m->shm)
            return 1;
    }
    if (first || m->shm) {
        res.shm = m->shm != NULL && !first;
        res.bytes = res.shm ? m->out_total : 0;
        if (finish && m->shm)
            member_views_wait(m);
        if (finish) {
            pthread_mutex_lock(c->lock);
            ring_agreed_wait(c);
            int failed = shm_broken_check(c);
            pthread_mutex_unlock(c->lock);
            if (failed)
                return 0;
        }
        return send_frame(m, &res, 0, NULL, 0, 0, finish) == 0 && finish;
    }
    return 0;
}

static void *writer_main(void *arg)
{
    member_write(arg, 0);
    return NULL;
}

/* ---- matching ---- */

static int header_mismatch(const coll_t *c, const member_t *ref, const header_t *a, int rank,
                           char *msg, size_t len)
{
    const header_t *b = ref->first->header;
    int rref = c->ranks[ref->index];
    const char *pre = kind_name(b->kind);
    if (a->kind != b->kind) {
        snprintf(msg, len,
                 "collective seq %" PRIu64 " on group %u: rank %d called %s but rank %d called %s",
                 a->seq, a->group, rank, kind_name(a->kind), rref, kind_name(b->kind));
        return 1;
    }
    if (a->kind != K_BARRIER && a->dtype != b->dtype) {
        snprintf(msg, len,
                 "%s (group %u, seq %" PRIu64 "): rank %d has dtype %s but rank %d has %s", pre,
                 a->group, a->seq, rank, ps_dtype_name((ps_dtype_t)a->dtype), rref,
                 ps_dtype_name((ps_dtype_t)b->dtype));
        return 1;
    }
    if (a->kind != K_BARRIER && a->count != b->count) {
        snprintf(msg, len,
                 "%s (group %u, seq %" PRIu64 "): rank %d has count %" PRIu64
                 " but rank %d has %" PRIu64,
                 pre, a->group, a->seq, rank, a->count, rref, b->count);
        return 1;
    }
    if (kind_reduces((coll_kind_t)a->kind) && a->op != b->op) {
        snprintf(msg, len, "%s (group %u, seq %" PRIu64 "): rank %d has op %s but rank %d has %s",
                 pre, a->group, a->seq, rank, ps_op_name((ps_op_t)a->op), rref,
                 ps_op_name((ps_op_t)b->op));
        return 1;
    }
    if (kind_rooted((coll_kind_t)a->kind) && a->root != b->root) {
        snprintf(msg, len, "%s (group %u, seq %" PRIu64 "): rank %d has root %d but rank %d has %d",
                 pre, a->group, a->seq, rank, a->root, rref, b->root);
        return 1;
    }
    return 0;
}

static mailbox_t *mailbox_get(job_t *j, uint32_t group, int dst, int n)
{
    for (mailbox_t *m = j->mailboxes; m; m = m->next)
        if (m->group == group && m->dst == dst)
            return m;
    mailbox_t *m = calloc(1, sizeof(*m));
    if (!m)
        return NULL;
    m->next_send_seq = calloc((size_t)n, sizeof(uint64_t));
    if (!m->next_send_seq) {
        free(m);
        return NULL;
    }
    m->group = group;
    m->dst = dst;
    m->nsrc = n;
    m->next = j->mailboxes;
    j->mailboxes = m;
    return m;
}

static void list_remove(member_t **head, member_t *x)
{
    for (member_t **p = head; *p; p = &(*p)->next_wait)
        if (*p == x) {
            *p = x->next_wait;
            x->next_wait = NULL;
            return;
        }
}

/* Pairs receives with sends in the order each rank started them. Lock held. */
static void mailbox_match(ps__hub_t *h, job_t *j, mailbox_t *mb)
{
    for (;;) {
        member_t *r = NULL, *s = NULL;
        for (member_t *x = mb->recvs; x; x = x->next_wait)
            if (x->first->header->seq == mb->next_recv_seq)
                r = x;
        if (!r)
            return;
        const header_t *rh = r->first->header;
        for (member_t *x = mb->sends; x && !s; x = x->next_wait) {
            const header_t *sh = x->first->header;
            if ((rh->peer < 0 || sh->rank == rh->peer) && sh->seq == mb->next_send_seq[sh->rank] &&
                sh->tag == rh->tag)
                s = x;
        }
        if (!s)
            return;
        list_remove(&mb->recvs, r);
        list_remove(&mb->sends, s);
        mb->next_recv_seq++;
        mb->next_send_seq[s->first->header->rank]++;
        const header_t *sh = s->first->header;
        int over;
        coll_t *c = coll_new(h, j, sh, 2, 1, 0, 0, &over);
        if (!c) {
            /* Neither side can go on: both fail alike. */
            s->refused = r->refused = over ? 1 : 2;
            continue;
        }
        c->ranks[0] = sh->rank;
        c->ranks[1] = rh->rank;
        c->members[0] = s;
        c->members[1] = r;
        s->coll = c;
        s->index = 0;
        r->coll = c;
        r->index = 1;
        c->narrived = 2;
        c->next = j->colls;
        j->colls = c;
        coll_widen(h, c);
        if (sh->dtype != rh->dtype || sh->count != rh->count)
            coll_fail(c, GRPC_STATUS_FAILED_PRECONDITION,
                      "send from rank %d to rank %d (group %u, tag %u): the sender has %" PRIu64
                      " %s elements but the receiver expects %" PRIu64 " %s",
                      sh->rank, rh->rank, sh->group, sh->tag, sh->count,
                      ps_dtype_name((ps_dtype_t)sh->dtype), rh->count,
                      ps_dtype_name((ps_dtype_t)rh->dtype));
    }
}

/* ---- serving one call ---- */

static member_t *member_new(ps__rpc_call_t *call, ps__frame_t *first)
{
    member_t *m = calloc(1, sizeof(*m));
    if (!m)
        return NULL;
    m->call = call;
    m->first = first->meta;
    m->frame = *first;
    m->frame.meta = NULL;
    memset(first, 0, sizeof(*first));
    m->arrival_ms = ps__now_ms();
    m->thread = pthread_self();
    char via[8];
    m->link = ps__rpc_call_metadata(call, PS_RPC_VIA_METADATA, via, sizeof(via)) == 0
                  ? PS_M_LINK_AGENT
                  : PS_M_LINK_WORKER;
    return m;
}

static void member_free(member_t *m)
{
    if (!m)
        return;
    ps__frame_clear(&m->frame);
    if (m->first)
        protobuf_c_message_free_unpacked(&m->first->base, NULL);
    if (m->oshm && m->oshm != m->shm)
        shm_unref(m->oshm);
    if (m->shm)
        shm_unref(m->shm);
    free(m);
}

/* Checks an all_to_all's list of used counts (CollectiveHeader.block_used
 * or block_out_used, `field`): none, or one per rank of the group of n, each
 * at most the block's count. 0, or -1 with msg set. */
static int used_check(const header_t *hd, const char *field, const uint64_t *used, size_t nused,
                      int n, char *msg, size_t len)
{
    const char *k = kind_name(hd->kind);
    if (nused && (hd->kind != K_ALL_TO_ALL || nused != (size_t)n)) {
        snprintf(msg, len,
                 "%s (group %u, seq %" PRIu64 "): rank %d: %s gives %zu counts; it is for "
                 "all_to_all, one count per rank of the group (%d)",
                 k, hd->group, hd->seq, hd->rank, field, nused, n);
        return -1;
    }
    for (size_t j = 0; j < nused; j++)
        if (used[j] > hd->count) {
            snprintf(msg, len,
                     "%s (group %u, seq %" PRIu64 "): rank %d: %s[%zu] is %" PRIu64
                     " elements, more than the block's %" PRIu64 " (count)",
                     k, hd->group, hd->seq, hd->rank, field, j, used[j], hd->count);
            return -1;
        }
    return 0;
}

/* Checks a header on its own; INVALID_ARGUMENT-style codes with msg. */
static int header_check(const ps__config_t *cfg, const header_t *hd, int n, char *msg, size_t len)
{
    const char *k = kind_name(hd->kind);
    if (hd->kind < K_BARRIER || hd->kind > K_RECV) {
        snprintf(msg, len, "unknown collective kind %d", hd->kind);
        return GRPC_STATUS_INVALID_ARGUMENT;
    }
    if (hd->rank < 0 || hd->rank >= n) {
        snprintf(msg, len, "%s (group %u): rank %d is out of range for a group of size %d", k,
                 hd->group, hd->rank, n);
        return GRPC_STATUS_INVALID_ARGUMENT;
    }
    if (hd->kind != K_BARRIER && ps_dtype_size((ps_dtype_t)hd->dtype) == 0) {
        snprintf(msg, len, "%s (group %u): unknown dtype %d", k, hd->group, hd->dtype);
        return GRPC_STATUS_INVALID_ARGUMENT;
    }
    if (kind_reduces((coll_kind_t)hd->kind) &&
        ps_op_check((ps_op_t)hd->op, (ps_dtype_t)hd->dtype)) {
        snprintf(msg, len,
                 "%s (group %u, seq %" PRIu64 "): rank %d: op %s is not defined for dtype %s", k,
                 hd->group, hd->seq, hd->rank, ps_op_name((ps_op_t)hd->op),
                 ps_dtype_name((ps_dtype_t)hd->dtype));
        return GRPC_STATUS_INVALID_ARGUMENT;
    }
    if (kind_rooted((coll_kind_t)hd->kind) && (hd->root < 0 || hd->root >= n)) {
        snprintf(msg, len,
                 "%s (group %u, seq %" PRIu64
                 "): rank %d: root %d is out of range for a group of size %d",
                 k, hd->group, hd->seq, hd->rank, hd->root, n);
        return GRPC_STATUS_INVALID_ARGUMENT;
    }
    if ((hd->kind == K_SEND && (hd->peer < 0 || hd->peer >= n || hd->peer == hd->rank)) ||
        (hd->kind == K_RECV && (hd->peer < -1 || hd->peer >= n || hd->peer == hd->rank))) {
        snprintf(msg, len, "%s (group %u): rank %d: peer %d is invalid for a group of size %d", k,
                 hd->group, hd->rank, hd->peer, n);
        return GRPC_STATUS_INVALID_ARGUMENT;
    }
    if (hd->shm_out && *hd->shm_out && !(hd->shm && *hd->shm)) {
        snprintf(msg, len,
                 "%s (group %u): rank %d: shm_out names a segment for the output, but shm names "
                 "none for the input (both, or neither)",
                 k, hd->group, hd->rank);
        return GRPC_STATUS_INVALID_ARGUMENT;
    }
    if (used_check(hd, "block_used", hd->block_used, hd->n_block_used, n, msg, len) ||
        used_check(hd, "block_out_used", hd->block_out_used, hd->n_block_out_used, n, msg, len))
        return GRPC_STATUS_INVALID_ARGUMENT;
    /* Limits are checked before any memory is taken. */
    uint64_t esize = ps_dtype_size((ps_dtype_t)hd->dtype);
    uint64_t mult = 1;
    if (hd->kind == K_ALL_GATHER || hd->kind == K_GATHER || hd->kind == K_SCATTER ||
        hd->kind == K_REDUCE_SCATTER || hd->kind == K_ALL_TO_ALL)
        mult = (uint64_t)n;
    if (hd->kind != K_BARRIER && (hd->count > cfg->max_tensor_bytes / (esize ? esize : 1) / mult)) {
        snprintf(msg, len,
                 "%s (group %u): rank %d: %" PRIu64 " elements of %s (x%" PRIu64
                 " ranks) exceed the daemon's "
                 "limit of %" PRIu64 " bytes (--max-tensor-bytes)",
                 k, hd->group, hd->rank, hd->count, ps_dtype_name((ps_dtype_t)hd->dtype), mult,
                 cfg->max_tensor_bytes);
        return GRPC_STATUS_RESOURCE_EXHAUSTED;
    }
    return 0;
}

/* Ranks named in a message ("1, 3"; past its room " and N more"). */
typedef struct rank_list {
    char text[256];
    size_t len;
    int n, unlisted;
} rank_list_t;

static void rank_list_add(rank_list_t *l, int rank)
{
    if (l->len < sizeof(l->text) - 32)
        l->len += (size_t)snprintf(l->text + l->len, sizeof(l->text) - l->len, "%s%d",
                                   l->n ? ", " : "", rank);
    else
        l->unlisted++;
    l->n++;
}

/* The list's text, with how many it left out; once all are added. */
static const char *rank_list_text(rank_list_t *l)
{
    if (l->unlisted)
        snprintf(l->text + l->len, sizeof(l->text) - l->len, " and %d more", l->unlisted);
    return l->text;
}

/* Liveness of missing ranks is checked this often while a collective waits. */
#define PS_HUB_LIVENESS_CHECK_MS 1000

/* Asks the coordinator whether the ranks still missing are members; fails
 * the collective naming those that are not (they died or left), so the
 * others need not wait for the timeout. At most once a second for the
 * collective, whichever of its waiting threads (ranks, ring links) calls
 * first: the others return at once. Lock held; dropped while asking. */
static void check_missing_alive(ps__hub_t *h, coll_t *c)
{
    int64_t now = ps__now_ms();
    if (h->stopping || now - c->alive_checked_ms < PS_HUB_LIVENESS_CHECK_MS)
        return;
    c->alive_checked_ms = now;
    ps__job_info_t info;
    char *err = NULL;
    memset(&info, 0, sizeof(info));
    char *name = strdup(c->job->name);
    pthread_mutex_unlock(c->lock);
    int rc = name ? h->lookup(h->lookup_arg, name, &info, &err) : PS_ENOMEM;
    pthread_mutex_lock(c->lock);
    free(name);
    free(err);
    if (rc < 0 || c->failed || info.incarnation != c->job->info.incarnation) {
        ps__job_info_clear(&info);
        return;
    }
    /* In a ring the ranks of the other agents are waited for too. Every
     * rank gone is named: one that left after another died (a survivor
     * giving up) must not hide the one that died. */
    int nall = c->ring ? group_size(c->job, c->group) : c->n;
    rank_list_t gone = {.len = 0};
    for (int i = 0; i < nall && !c->failed; i++) {
        if (!c->ring && c->members[i])
            continue;
        /* PASS, ACC: once the previous agent's link came, every agent has
         * the collective (each opens its link as soon as it has it) and
         * watches its own ranks, and another agent's rank may be done with
         * it and gone (a broadcast's root) while ranks here still come.
         * Before, none can be done: no agent agrees without this link. */
        if (ring_whole(c) && c->ring->in.seen && !coll_serves(c, i))
            continue;
        int grank = c->ring ? i : c->ranks[i];
        int jr = job_rank(&info, c->group, grank);
        int alive = 0;
        for (int k = 0; k < info.njoined; k++)
            alive |= info.joined[k] == jr;
        if (!alive)
            rank_list_add(&gone, grank);
    }
    if (gone.n && !c->failed)
        coll_fail(c, GRPC_STATUS_ABORTED,
                  "%s (group %u, seq %" PRIu64 "): %s %s %s of job %s (%s); the job must be "
                  "formed again",
                  kind_name(c->kind), c->group, c->seq, gone.n > 1 ? "ranks" : "rank",
                  rank_list_text(&gone),
                  gone.n > 1 ? "are no longer members" : "is no longer a member", c->job->name,
                  gone.n > 1 ? "their processes or connections died, or they left"
                             : "its process or connection died, or it left");
    ps__job_info_clear(&info);
}

/* A rank that gave up (cancelled its call, or died) while waiting for the
 * others must not hold the collective until its timeout. Lock held; only
 * members' own handler threads call this, each for its own call. */
static void check_cancelled(coll_t *c)
{
    for (int i = 0; i < c->n && !c->failed; i++) {
        member_t *m = c->members[i];
        if (m && !m->finished && pthread_equal(m->thread, pthread_self()) &&
            ps__rpc_call_peer_cancelled(m->call, 0) == 1)
            coll_fail(c, GRPC_STATUS_CANCELLED,
                      "%s (group %u, seq %" PRIu64 "): rank %d cancelled its call (or died) "
                      "while waiting for the others",
                      kind_name(c->kind), c->group, c->seq, c->ranks[i]);
    }
}

/* Waits, lock held, until the collective may start; fails it at the deadline. */
static void wait_arrivals(ps__hub_t *h, coll_t *c, int64_t timeout_ms)
{
    int64_t end = ps__now_ms() + timeout_ms;
    int nlocal = coll_nlocal(c);
    while (!c->failed && c->narrived < nlocal) {
        int64_t left = end - ps__now_ms();
        struct timespec slice =
            abs_ms(left < PS_HUB_LIVENESS_CHECK_MS ? left : PS_HUB_LIVENESS_CHECK_MS);
        if (left > 0 && pthread_cond_timedwait(&c->cond, c->lock, &slice) == ETIMEDOUT &&
            c->narrived < nlocal && !c->failed && ps__now_ms() < end) {
            check_missing_alive(h, c);
            check_cancelled(c);
            continue;
        }
        if (ps__now_ms() >= end && c->narrived < nlocal && !c->failed) {
            rank_list_t missing = {.len = 0};
            for (int i = 0; i < c->n; i++)
                if (!c->members[i] && coll_serves(c, i))
                    rank_list_add(&missing, c->ranks[i]);
            coll_fail(c, GRPC_STATUS_DEADLINE_EXCEEDED,
                      "%s (group %u, seq %" PRIu64 "): rank%s %s did not arrive within %lld ms",
                      kind_name(c->kind), c->group, c->seq, missing.n > 1 ? "s" : "",
                      rank_list_text(&missing), (long long)timeout_ms);
        }
    }
}

/* Finds the collective (group, seq) of hd in job j, or makes it with n
 * members and steps of `step` bytes (0: --step-bytes); *made says which.
 * 0, or a gRPC code with msg: the tombstone's answer for a collective that
 * has failed already, or RESOURCE_EXHAUSTED. Lock held. */
static int coll_get(ps__hub_t *h, job_t *j, const header_t *hd, int n, int ring, size_t step,
                    coll_t **out, int *made, char *msg, size_t len)
{
    coll_t *c = NULL;
    *made = 0;
    for (coll_t *x = j->colls; x && !c; x = x->next)
        if (!x->p2p && x->group == hd->group && x->seq == hd->seq)
            c = x;
    for (tombstone_t *t = j->tombstones; t && !c; t = t->next)
        if (t->group == hd->group && t->seq == hd->seq) {
            snprintf(msg, len, "%s", t->message);
            return t->code;
        }
    if (!c) {
        int over;
        c = coll_new(h, j, hd, n, 0, ring, step, &over);
        if (!c) {
            snprintf(msg, len, "%s (group %u, seq %" PRIu64 "): %s", kind_name(hd->kind), hd->group,
                     hd->seq,
                     over ? "this agent's collectives in flight already hold their limit of "
                            "memory (--max-inflight-bytes); retry later"
                          : "out of memory");
            return GRPC_STATUS_RESOURCE_EXHAUSTED;
        }
        c->next = j->colls;
        j->colls = c;
        *made = 1;
    }
    *out = c;
    return 0;
}

/* ---- collectives spanning several agents: the ring ---- */

/*
 * An all_reduce whose group has ranks on several agents is served by each of
 * those agents for its own ranks. Each step is reduced over the local ranks
 * first (the step's `partial`); the agents then combine their partials
 * around a ring, agents ordered by their first rank in the group: the step is
 * cut into A pieces, A - 1 rounds pass a piece on and add the one received
 * (reduce-scatter: agent a ends with piece a + 1 complete), A - 1 more pass
 * the complete pieces on (all-gather). Each agent sends 2(A-1)/A of the
 * tensor to the next one and receives as much from the previous one,
 * whatever the number of agents; every piece is reduced once, by a fixed
 * chain of agents, so every rank gets the same bits on every run. The link
 * to the next agent is a Ring call (ring_send_main); the link from the
 * previous one is served by ps__hub_ring_serve. Steps are pipelined: while
 * step s goes round, later steps are reduced locally and enter the ring.
 */

typedef struct ring_plan {
    int nagents, pos;
    int machines;        /* distinct machines of the agents; 0: one is not known */
    const char **agents; /* position -> address (the job's strings) */
    int nlocal;
    int *local;    /* group ranks served by this agent, ascending */
    int *agent_of; /* group rank -> position of its agent */
    int rd;        /* by recursive doubling between the agents (ring_use) */
} ring_plan_t;

static void ring_plan_clear(ring_plan_t *plan)
{
    free(plan->agents);
    plan->agents = NULL;
    free(plan->local);
    free(plan->agent_of);
    plan->local = plan->agent_of = NULL;
}

/* The index of s among v[0..n), or n. */
static int str_index(const char *const *v, int n, const char *s)
{
    int i = 0;
    while (i < n && strcmp(v[i], s) != 0)
        i++;
    return i;
}

/* How many machines the ring's agents are on (mach[k]: agent k's, as the
 * coordinator has it), or 0 when one is not known. Reorders mach. */
static int ring_machines(const char **mach, int nagents)
{
    int n = 0;
    for (int k = 0; k < nagents; k++) {
        if (!mach[k] || !*mach[k])
            return 0;
        if (str_index(mach, n, mach[k]) == n)
            mach[n++] = mach[k];
    }
    return n;
}

/* Works out the ring of the job's group: 1 when this agent is in a ring of
 * two or more, 0 when the group's ranks are all on one agent (or the
 * coordinator does not say where ranks are). Lock held; ring_plan_clear after. */
static int ring_plan(const ps__hub_t *h, const job_t *j, uint32_t group, ring_plan_t *plan)
{
    memset(plan, 0, sizeof(*plan));
    int n = group_size(j, group);
    if (!h->cfg->ring || !j->info.rank_agents || n < 2)
        return 0;
    const char **agents = calloc((size_t)n, sizeof(char *));
    const char **mach = calloc((size_t)n, sizeof(char *)); /* position -> its machine */
    plan->local = calloc((size_t)n, sizeof(int));
    plan->agent_of = calloc((size_t)n, sizeof(int));
    if (!agents || !mach || !plan->local || !plan->agent_of) {
        free(agents);
        free(mach);
        ring_plan_clear(plan);
        return 0;
    }
    plan->pos = -1;
    for (int g = 0; g < n; g++) {
        int jr = job_rank(&j->info, group, g);
        const char *ag = jr >= 0 && jr < j->info.world_size ? j->info.rank_agents[jr] : "";
        if (!*ag) {
            plan->nagents = 0;
            break;
        }
        int k = str_index(agents, plan->nagents, ag);
        if (k == plan->nagents) {
            mach[k] = j->info.rank_machines ? j->info.rank_machines[jr] : NULL;
            agents[plan->nagents++] = ag;
        }
        plan->agent_of[g] = k;
        if (strcmp(ag, h->self) == 0) {
            plan->pos = k;
            plan->local[plan->nlocal++] = g;
        }
    }
    plan->agents = agents;
    plan->machines = ring_machines(mach, plan->nagents);
    free(mach);
    if (plan->nagents < 2 || plan->pos < 0) {
        ring_plan_clear(plan);
        return 0;
    }
    return 1;
}

/* How a ring of agents serves a kind (RING_SPLIT, _PASS, _ACC), or -1 when
 * the kind always goes to the job's hub. */
static int ring_mode(int kind)
{
    switch (kind) {
    case K_ALL_REDUCE:
        return RING_SPLIT;
    case K_ALL_GATHER:
    case K_BROADCAST:
    case K_ALL_TO_ALL:
    case K_BARRIER: /* no steps: only the tokens go round (ring_tok_held) */
        return RING_PASS;
    case K_REDUCE:
    case K_REDUCE_SCATTER:
        return RING_ACC;
    default:
        return -1;
    }
}

/* Whether a ring collective's members are this agent's ranks (SPLIT, and
 * recursive doubling), not the whole group. */
static int ring_split(const ring_plan_t *plan, int kind)
{
    return plan->rd || ring_mode(kind) == RING_SPLIT;
}

/* An all_reduce ring moves a step in A pieces: its steps are A times
 * --step-bytes (up to a frame's limit), so that each piece is about a step
 * of the hub's. Fewer, larger messages: 64 MiB all_reduce over 4 agents on
 * loopback, every rank on shared memory, 0.36 GB/s busbw with 1 MiB steps
 * against 0.62 with 4 MiB (the hub: 0.65 and 0.54). The other modes move
 * steps whole: --step-bytes (0). */
static size_t ring_step(const ps__hub_t *h, const ring_plan_t *plan, int kind)
{
    if (ring_mode(kind) != RING_SPLIT || plan->rd)
        return 0;
    uint64_t sb = (uint64_t)h->cfg->step_bytes * (uint64_t)plan->nagents;
    uint64_t max = PS_FRAME_MAX_DATA - 4096;
    return (size_t)(sb < max ? sb : max);
}

/* --ring auto: the ranks per agent (on average) from which a kind goes round
 * the ring with `bytes` per rank, or 0 for a kind that stays at the hub. */
static uint64_t ring_auto_ranks(int kind, uint64_t bytes)
{
    switch (kind) {
    case K_ALL_REDUCE:
        return PS_RING_AUTO_RANKS;
    case K_BARRIER:
    case K_BROADCAST:
    case K_REDUCE:
        return bytes < PS_RING_AUTO_SMALL_BYTES ? PS_RING_AUTO_RANKS : PS_RING_AUTO_OTHER_RANKS;
    case K_ALL_GATHER:
        return PS_RING_AUTO_OTHER_RANKS;
    default:
        return 0;
    }
}

/* Whether a collective of `bytes` per rank whose agents combine it among
 * themselves (ring_use) does so by recursive doubling (rd_apply_main)
 * rather than round the ring: an all_reduce of at most --rd-max-bytes, in
 * one step. The same on every agent, as the ring's own choice. (A barrier
 * stays with the ring's tokens: by recursive doubling it was level to 23 %
 * slower here, docs/PERFORMANCE.md.) */
static int rd_fits(const ps__hub_t *h, int kind, uint64_t bytes)
{
    return kind == K_ALL_REDUCE && bytes > 0 && bytes <= h->cfg->rd_max_bytes &&
           bytes <= h->cfg->step_bytes;
}

/* Whether a collective of this header may go round a ring of agents (when
 * its group spans several): with --ring on, all_reduce, all_gather,
 * broadcast, reduce, reduce_scatter and all_to_all of --ring-min-bytes or
 * more (per rank), and barrier (0 bytes) when that is 0; with --ring auto,
 * all_reduce, barrier, broadcast, reduce, all_gather, reduce_scatter and
 * all_to_all (ring_use decides). */
static int ring_wanted(const ps__hub_t *h, const header_t *hd)
{
    uint64_t esize = ps_dtype_size((ps_dtype_t)hd->dtype);
    if (h->cfg->ring == PS_RING_AUTO)
        return (ring_auto_ranks(hd->kind, 0) || hd->kind == K_ALL_TO_ALL ||
                hd->kind == K_REDUCE_SCATTER) &&
               (esize || hd->kind == K_BARRIER);
    if (h->cfg->ring != PS_RING_ON || ring_mode(hd->kind) < 0)
        return 0;
    if (hd->kind == K_BARRIER)
        return h->cfg->ring_min_bytes == 0;
    return esize && hd->count >= (h->cfg->ring_min_bytes + esize - 1) / esize;
}

/* Whether the collective goes round the ring of agents, with *plan made
 * (ring_plan_clear after) if so. --ring auto takes the ring where its
 * hierarchy pays (each agent reduces its ranks first, where the hub takes
 * every rank's tensor): an all_reduce from PS_RING_AUTO_RANKS ranks per
 * agent at any size, 2 from --ring-min-bytes; a broadcast, reduce or
 * all_gather from PS_RING_AUTO_OTHER_RANKS (a barrier, which has no bytes
 * and takes two laps of tokens, and a broadcast or reduce under
 * PS_RING_AUTO_SMALL_BYTES from PS_RING_AUTO_RANKS), but not an all_gather
 * whose output fits in a step (--step-bytes: one step
 * at the hub, coll_packs); an all_to_all over the mesh from
 * --ring-min-bytes per block, where the hub carries (A - 1) x A blocks each
 * way and a mesh link one (4 netns hosts, one rank each, 16 MiB per rank:
 * 1.75x the hub's busbw, 1 MiB at par, 256 KiB half); a reduce_scatter, as
 * an all_reduce, from 2 ranks per agent with blocks of --ring-min-bytes
 * (2, 4 and 8 per agent, blocks of 1-8 MiB: 1.1-5.4x the hub's busbw; small
 * blocks, even 16 per agent, and one rank per agent: the hub as fast or
 * faster). With one rank per agent the hub was as fast or faster here for
 * the others too (since the kept threads: mixed, 0.7-1.4x by kind, size
 * and round). All of
 * that on agents sharing two cores: agents on two or more machines
 * (ring_machines) also take it for every kind that moves bytes (all_reduce,
 * broadcast, reduce, all_gather, reduce_scatter) from --ring-min-bytes per
 * rank, one rank per agent as well: on 1 Gbit/s links 1.8-3.2x faster than the
 * hub (docs/PERFORMANCE.md, "--ring auto across machines"). Lock held. */
static int ring_use(const ps__hub_t *h, const job_t *j, const header_t *hd, ring_plan_t *plan)
{
    if (!ring_wanted(h, hd) || !ring_plan(h, j, hd->group, plan))
        return 0;
    size_t esize = ps_dtype_size((ps_dtype_t)hd->dtype);
    uint64_t bytes = hd->count * esize;
    plan->rd = rd_fits(h, hd->kind, bytes);
    if (h->cfg->ring != PS_RING_AUTO)
        return 1;
    uint64_t n = (uint64_t)group_size(j, hd->group), a = (uint64_t)plan->nagents;
    uint64_t ranks = ring_auto_ranks(hd->kind, bytes);
    int big = bytes >= h->cfg->ring_min_bytes;
    int apart = plan->machines >= 2 && hd->kind != K_BARRIER;
    int pairs = hd->kind == K_ALL_REDUCE || hd->kind == K_REDUCE_SCATTER;
    int use = (ranks && n >= ranks * a) || (pairs && n >= 2 * a && big) ||
              (hd->kind == K_ALL_TO_ALL && big) || (apart && big);
    /* An all_gather whose output fits in a step is one step at the hub
     * (coll_packs): faster there than a step per rank round the ring. */
    if (hd->kind == K_ALL_GATHER && bytes * n <= step_whole(h, 0, esize))
        use = 0;
    if (!use)
        ring_plan_clear(plan);
    return use;
}

int ps__hub_is_ring(ps__hub_t *h, const header_t *hd)
{
    if (!ring_wanted(h, hd))
        return 0;
    char msg[256];
    int code, ring = 0;
    pthread_mutex_lock(&h->lock);
    job_t *j = h->stopping ? NULL : job_get(h, hd, &code, msg, sizeof(msg));
    ring_plan_t plan;
    if (j && ring_use(h, j, hd, &plan)) {
        for (int i = 0; i < plan.nlocal; i++)
            ring |= plan.local[i] == hd->rank;
        ring_plan_clear(&plan);
    }
    if (j)
        job_release(j);
    pthread_mutex_unlock(&h->lock);
    return ring;
}

/* Whether the header of a rank (who: "rank 3") or of the previous agent's
 * ranks agrees with the collective c; if not, says which field differs. */
static int ring_mismatch(const coll_t *c, const header_t *hd, const char *who, const char *theirs,
                         char *msg, size_t len)
{
    const char *f = NULL, *a = NULL, *b = NULL;
    char na[32], nb[32];
    if ((int)hd->kind != c->kind) {
        f = "called";
        a = kind_name(hd->kind);
        b = kind_name(c->kind);
    } else if (c->kind == K_BARRIER) {
        /* nothing else to agree on (header_mismatch) */
    } else if ((int)hd->dtype != c->dtype) {
        f = "dtype";
        a = ps_dtype_name((ps_dtype_t)hd->dtype);
        b = ps_dtype_name((ps_dtype_t)c->dtype);
    } else if (hd->count != c->count) {
        f = "count";
        snprintf(na, sizeof(na), "%" PRIu64, hd->count);
        snprintf(nb, sizeof(nb), "%" PRIu64, c->count);
        a = na;
        b = nb;
    } else if (kind_reduces(c->kind) && (int)hd->op != c->op) {
        f = "op";
        a = ps_op_name((ps_op_t)hd->op);
        b = ps_op_name((ps_op_t)c->op);
    } else if (kind_rooted(c->kind) && hd->root != c->root) {
        f = "root";
        snprintf(na, sizeof(na), "%d", hd->root);
        snprintf(nb, sizeof(nb), "%d", c->root);
        a = na;
        b = nb;
    }
    if (f && strcmp(f, "called") == 0)
        snprintf(msg, len, "collective seq %" PRIu64 " on group %u: %s called %s but %s called %s",
                 c->seq, c->group, who, a, theirs, b);
    else if (f)
        snprintf(msg, len, "%s (group %u, seq %" PRIu64 "): %s %s %s %s but %s %s",
                 kind_name(c->kind), c->group, c->seq, who,
                 strncmp(who, "rank ", 5) == 0 ? "has" : "have", f, a, theirs, b);
    return f != NULL;
}

/* Bytes [off, off + len) of piece k of a step of len bytes cut into A. */
static void ring_piece(const coll_t *c, size_t step_len, int k, size_t *off, size_t *len)
{
    size_t esize = ps_dtype_size((ps_dtype_t)c->dtype);
    size_t elems = step_len / esize, a = (size_t)c->ring->nagents;
    size_t from = elems * (size_t)k / a, to = elems * (size_t)(k + 1) / a;
    *off = from * esize;
    *len = (to - from) * esize;
}

/* Frames a link carries per step: SPLIT 2(A - 1) rounds, the others 1. */
static int ring_rounds(const coll_t *c)
{
    return ring_whole(c) ? 1 : 2 * (c->ring->nagents - 1);
}

/* Frames the link from (out: to) the agent at position `peer` carries, or
 * with peer = -1 all the links to this agent together: every round of every
 * step (SPLIT, between neighbours); the steps that pass that way (PASS, ACC;
 * a mesh: those between this agent and `peer`). */
static uint64_t ring_frames(const coll_t *c, int peer, int out)
{
    if (!ring_whole(c))
        return (uint64_t)c->nsteps * (uint64_t)ring_rounds(c);
    uint64_t k = 0;
    for (int64_t s = 0; s < c->nsteps; s++)
        k += out ? ring_sends(c, s) && ring_to(c, s) == peer
                 : ring_takes(c, s) && (peer < 0 || ring_from(c, s) == peer);
    return k;
}

/* ---- recursive doubling between agents ----
 *
 * A small all_reduce whose agents would combine it round the ring (2(A - 1)
 * rounds one after another) goes by recursive doubling instead (rd_fits):
 * each agent reduces its ranks' inputs first, as for the ring; then, with P the
 * largest power of two <= A and R = log2 P, an agent p >= P (an "extra")
 * hands its value to p - P in round 0 and gets the result back from it in
 * round R + 1; the agents below P exchange theirs with p ^ 2^(r-1) in
 * rounds r = 1..R and combine the two, the lower position's value first.
 * Every agent below P so ends with the same bits (the same tree of
 * reductions), and the extras with a copy: R + 2 hops at most. Each pair of
 * agents with a round shares one Ring call (rd_opens: the extra, or the
 * lower of two, opens it), which carries one frame each way, tagged with its
 * round: the opener's value on the request stream, the other's as the reply
 * (rd_reply_main); about half as many calls as agents times their rounds.
 * Only agent P - 1 would open none, so it opens its own call to P - 2 as
 * well (that pair has a call each way, without replies): every agent then
 * reaches another with the collective at once, which thus learns of it from
 * the first hop, and a rank whose agent serves a collective apart from its
 * hub is told at once (ring.mismatch_route.p4), as round the ring. */

/* The largest power of two <= a (a >= 1), and its log2. */
static int rd_core(int a)
{
    int p = 1;
    while (p <= a / 2)
        p *= 2;
    return p;
}

static int rd_log2(int p)
{
    int r = 0;
    while ((1 << r) < p)
        r++;
    return r;
}

/* The rounds of recursive doubling between a agents: 0 (extras in), 1..R,
 * R + 1 (extras out). */
static int rd_rounds(int a)
{
    return rd_log2(rd_core(a)) + 2;
}

/* The round in which the agent at position `from` sends to the one at `to`
 * (of a), or -1 when it never does. */
static int rd_round(int a, int from, int to)
{
    int p = rd_core(a);
    if (from == to || from < 0 || to < 0 || from >= a || to >= a)
        return -1;
    if (from >= p)
        return to == from - p ? 0 : -1;
    if (to >= p)
        return to == from + p ? rd_log2(p) + 1 : -1;
    int d = from ^ to;
    return (d & (d - 1)) == 0 ? rd_log2(d) + 1 : -1;
}

/* Whether the agent at pos opens a call to the one at peer: an extra its
 * call to its core agent; of two core agents, the lower; and P - 1 to P - 2.
 * The other agent of a call replies on it unless it opens one of its own. */
static int rd_opens(int a, int pos, int peer)
{
    int p = rd_core(a);
    if (pos >= p)
        return peer == pos - p;
    return peer < p && rd_round(a, pos, peer) >= 0 &&
           (pos < peer || (pos == p - 1 && peer == p - 2));
}

/* The first link that has to come to this agent and has not come yet: the
 * one from the previous agent (with need_in: when it carries frames or
 * tokens), then in a mesh those from the others that carry frames; NULL when
 * every one came. Lock held. */
static const ring_link_t *ring_link_missing(const coll_t *c, int need_in)
{
    const ring_t *rg = c->ring;
    /* Recursive doubling opens only the links that carry a round. */
    if (need_in && !rg->in.seen && (!rg->rd || rg->in.frames > 0))
        return &rg->in;
    for (int k = 0; rg->xin && k < rg->nagents - 2; k++)
        if (!rg->xin[k].seen && rg->xin[k].frames > 0)
            return &rg->xin[k];
    return NULL;
}

/* The piece sent (or, with recv, received) in round r of a step. */
static int ring_piece_of_round(const ring_t *rg, int r, int recv)
{
    int a = rg->nagents, x = rg->pos - recv;
    int k = r < a - 1 ? x - r : x + 1 - (r - (a - 1));
    return ((k % a) + a) % a;
}

/*
 * Agreement. An agent checks the header of the link from the previous agent
 * against its own ranks; in an all_reduce every piece passes every agent
 * before any rank has its result, so a rank answered knows every link was
 * taken. In a passing ring the owner's ranks (a broadcast's root) are done
 * without hearing from anyone: its ranks must not be answered OK while
 * another agent fails the collective for a mismatch. So two tokens go
 * round: the first agent (position 0) starts token 1 once it took its own
 * link and its own ranks are all there; each agent passes it on once it
 * came (its link carried it, so was taken) and its own ranks are all there
 * too (ring_tok_held: each was checked against the header as it came).
 * Back at position 0 every rank of the group came and agreed, and token 2
 * tells the others so, going round to position A - 1; ranks are answered OK
 * only then. A barrier is nothing but these tokens.
 */
#define PS_RING_TOKEN (UINT64_MAX - 2) /* + 1, + 2: the tag of token 1, 2 */

/* Tokens this agent sends (A - 1 passes token 2 to nobody) and receives
 * (position 0 starts token 2). */
static int ring_tok_out(const ring_t *rg)
{
    return rg->pos == rg->nagents - 1 ? 1 : 2;
}

static int ring_tok_in(const ring_t *rg)
{
    return rg->pos == 0 ? 1 : 2;
}

/* An agent holds token 1 until its own ranks have all arrived (each checked
 * against the collective's header as it came): back at position 0 it then
 * says every rank of the group has come and agrees, and token 2 lets them
 * go. Without the wait a rank coming late with another root or count would
 * fail the collective at its agent after the others were answered OK. Lock
 * held. */
static int ring_tok_held(const coll_t *c)
{
    return c->ring->tok_sent == 0 && c->narrived < coll_nlocal(c);
}

/* Token t arrived from the previous agent. Lock held. */
static void ring_token_in(coll_t *c, int t)
{
    ring_t *rg = c->ring;
    rg->tok_in = t;
    if (t == 2 || rg->pos == 0)
        rg->agreed = 1;
    if (t == 1)
        rg->tok_ready = rg->pos == 0 ? 2 : 1;
    else if (rg->pos != rg->nagents - 1)
        rg->tok_ready = 2;
    pthread_cond_broadcast(&c->cond);
}

/* Frees a collective once every rank that came has its answer and no ring
 * thread uses it; a failed one leaves a tombstone, so that ranks coming
 * later get the same answer at once. Lock held. */
static void coll_retire(job_t *j, coll_t *c)
{
    int nlocal = coll_nlocal(c);
    if (c->threads > 0 || !(c->nfinished == nlocal || (c->failed && c->nfinished == c->narrived)))
        return;
    /* A ring collective with nothing to move can be done here before the
     * previous agent's link comes: it stays until that link has been served,
     * or the link would start it afresh. */
    if (c->ring && ring_link_missing(c, 1) && !c->failed)
        return;
    /* A failed one whose links from other agents have not all come yet
     * leaves a tombstone too: a late link would start it afresh, opening
     * links of its own to agents that have one from here already ("a second
     * ring link", where the answer is this failure). */
    if (c->nfinished < nlocal || (c->ring && c->failed && ring_link_missing(c, 1)))
        tombstone_add(j, c);
    coll_unlink(j, c);
    coll_free(c);
}

/* The end of a ring thread (sender or applier), lock held: the collective
 * may go now, and ps__hub_destroy may stop waiting. Unlocks. */
static void ring_thread_exit(ps__hub_t *h, job_t *j, coll_t *c)
{
    c->threads--;
    coll_retire(j, c);
    job_release(j);
    h->helpers--;
    pthread_cond_broadcast(&h->p2p_changed);
    pthread_mutex_unlock(&h->lock);
}

/* Fails c for the way the link l to another agent ended (rc < 0): with that
 * agent's own words when it failed the collective, else as a broken link.
 * Lock held. */
static void ring_link_failed(const ring_link_t *l, int rc, const char *msg)
{
    coll_t *c = l->c;
    if (rc < 0 && msg && *msg && rc != -GRPC_STATUS_UNAVAILABLE && rc != -GRPC_STATUS_CANCELLED)
        coll_fail(c, -rc, "%s", msg);
    else if (rc < 0)
        coll_fail(c, rc == -GRPC_STATUS_UNAVAILABLE ? GRPC_STATUS_UNAVAILABLE : -rc,
                  "%s (group %u, seq %" PRIu64 "): the link to agent %s broke: %s",
                  kind_name(c->kind), c->group, c->seq, l->who,
                  msg && *msg ? msg : ps_strerror(rc));
}

/* Waits for the end of a link to another agent while its sender works: the
 * agent may end it early (a mismatch found there, its ranks gone), which
 * must fail the collective here at once, not when the sender next sends or
 * finishes. */
typedef struct ring_watch {
    const ring_link_t *l;
    ps__rpc_call_t *out;
    int ended; /* the other agent answered the end frame with its own: the call stays open */
} ring_watch_t;

/* Queues frame q the other agent of recursive doubling replied with on l
 * (rd_apply_main takes it); takes q. */
static void rd_reply_queue(const ring_link_t *l, ring_frame_t *q)
{
    coll_t *c = l->c;
    pthread_mutex_lock(c->lock);
    if (!c->failed) {
        q->from = l;
        *(c->ring->q_tail ? &c->ring->q_tail->next : &c->ring->q_head) = q;
        c->ring->q_tail = q;
        q = NULL;
        pthread_cond_broadcast(&c->cond);
    }
    pthread_mutex_unlock(c->lock);
    if (q) {
        ps__frame_clear(&q->f);
        free(q);
    }
}

static void *ring_watch_main(void *arg)
{
    ring_watch_t *w = arg;
    const ring_link_t *l = w->l;
    coll_t *c = l->c;
    const ring_t *rg = c->ring;
    int replies = rg->rd && !rd_opens(rg->nagents, l->peer, rg->pos);
    /* The other agent sends its end frame, with the collective's outcome
     * there, once it has read this one's; in recursive doubling, first its
     * value of the pair's round (the call is the pair's, both ways). When it
     * fails the collective it ends the call with a status instead. */
    for (;;) {
        grpc_byte_buffer *bb = NULL;
        if (ps__rpc_call_recv(w->out, &bb) < 0 || !bb)
            break;
        ring_frame_t *q = calloc(1, sizeof(*q));
        int rc = q ? (ps__frame_decode(bb, &q->f) < 0 ? PS_EINVAL : 0) : PS_ENOMEM;
        grpc_byte_buffer_destroy(bb);
        const Paramsync__V1__CollectiveResult *res = rc == 0 ? q->f.meta->result : NULL;
        if (rc == 0 && ps__frame_is_end(&q->f)) {
            pthread_mutex_lock(c->lock);
            if (res && res->code)
                ring_link_failed(l, -res->code, res->message);
            pthread_mutex_unlock(c->lock);
            w->ended = 1;
        } else if (rc == 0 && replies && !res && !q->f.meta->end) {
            rd_reply_queue(l, q);
            continue;
        } else {
            pthread_mutex_lock(c->lock);
            coll_fail(
                c, rc == PS_ENOMEM ? GRPC_STATUS_RESOURCE_EXHAUSTED : GRPC_STATUS_INVALID_ARGUMENT,
                "%s (group %u, seq %" PRIu64 "): agent %s replied %s", kind_name(c->kind), c->group,
                c->seq, l->addr,
                rc == PS_ENOMEM ? "(out of memory)"
                : rc < 0        ? "a malformed frame"
                                : "a frame where none belongs");
            pthread_mutex_unlock(c->lock);
            ps__rpc_call_cancel(w->out, GRPC_STATUS_CANCELLED, "a bad reply");
        }
        if (q)
            ps__frame_clear(&q->f);
        free(q);
        break;
    }
    if (w->ended) /* the call stays open */
        return NULL;
    char *msg = NULL;
    int rc = ps__rpc_call_finish(w->out, &msg);
    pthread_mutex_lock(c->lock);
    ring_link_failed(l, rc, msg);
    pthread_mutex_unlock(c->lock);
    free(msg);
    return NULL;
}

/* Whether the sender of link l, still opening it (its call waits for the
 * other agent to be reachable: gRPC's wait-for-ready), gives up: once its
 * collective has failed for a second, time enough for a reachable agent to
 * take the header and the failure frame after it. Without it a link to an
 * agent that died before the call reached it waited for ever, and held the
 * agent's shutdown. */
static int ring_open_give_up(void *arg)
{
    ring_link_t *l = arg;
    pthread_mutex_lock(l->c->lock);
    int64_t now = ps__now_ms();
    if (l->c->failed && !l->failed_ms)
        l->failed_ms = now;
    int give = l->c->failed && now - l->failed_ms >= 1000;
    pthread_mutex_unlock(l->c->lock);
    return give;
}

/* The sending end of a link to another agent, while its sender works. */
typedef struct ring_out {
    ps__rpc_call_t *call;
    ring_watch_t watch;
    ps__task_t watcher;
    int watching;
} ring_out_t;

/* Opens link l (a Ring call to its agent, or one kept open from an earlier
 * collective, the collective's header first) and starts watching it; fails
 * the collective when the agent cannot be reached. Called without the lock;
 * returns with it held, 0 or < 0. */
static int ring_out_open(ring_link_t *l, ring_out_t *o)
{
    coll_t *c = l->c;
    ring_t *rg = c->ring;
    ps__hub_t *h = rg->hub;
    job_t *j = c->job;
    header_t hd = PARAMSYNC__V1__COLLECTIVE_HEADER__INIT;
    hd.job = j->name;
    hd.group = c->group;
    hd.seq = c->seq;
    hd.kind = (Paramsync__V1__CollectiveKind)c->kind;
    hd.op = (Paramsync__V1__ReduceOp)c->op;
    hd.dtype = (Paramsync__V1__DType)c->dtype;
    hd.count = c->count;
    hd.root = c->root;
    hd.rank = rg->pos;
    hd.incarnation = j->info.incarnation;
    hd.timeout_ms = (uint32_t)rg->timeout_ms;
    int rc, kept;
    for (;;) {
        o->call = NULL;
        kept = rc = h->ring_open(h->lookup_arg, l->addr, j->name, &o->call);
        if (rc >= 0) {
            grpc_byte_buffer *bb = ps__frame_encode(&hd, NULL, 0, NULL, 0, NULL, NULL);
            rc = bb ? ps__rpc_call_send_or(o->call, bb, ring_open_give_up, l) : PS_ENOMEM;
            if (bb)
                grpc_byte_buffer_destroy(bb);
        }
        if (kept != 1 || rc == 0 || rc == PS_ENOMEM || ring_open_give_up(l))
            break;
        /* A kept link that broke while it waited (the agent restarted):
         * the header never reached that agent; another link. */
        ps__rpc_call_destroy(o->call);
    }
    if (rc == 0)
        ps__metrics_agent_link(kept == 1);
    o->watch = (ring_watch_t){l, o->call, 0};
    o->watching = rc == 0 && ps__task_start(&o->watcher, ring_watch_main, &o->watch) == 0;
    pthread_mutex_lock(c->lock);
    l->call = o->call;
    if (rc == 0 && rg->rd && !o->watching) /* its reply would go unread */
        coll_fail(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "%s: no thread for the ring",
                  kind_name(c->kind));
    if (rc < 0 && !o->call)
        coll_fail(c, GRPC_STATUS_UNAVAILABLE,
                  "%s (group %u, seq %" PRIu64 "): cannot reach agent %s, %s: %s",
                  kind_name(c->kind), c->group, c->seq, l->who,
                  rg->rd          ? "a partner in recursive doubling"
                  : l == &rg->out ? "the next in the ring"
                                  : "one of the mesh",
                  ps_strerror(rc));
    return rc;
}

/* Ends link l once its sender is done (broke: a send failed): a failed
 * collective's words go to the other agent first, then the end frame,
 * which the other agent answers with its own. A link that carried a
 * collective which succeeded goes back to the agent, to be kept for the
 * job's next one (ring_keep); any other is ended. Lock held; ends the
 * sender's thread (unlocks). */
static void ring_out_close(ring_link_t *l, ring_out_t *o, int broke)
{
    coll_t *c = l->c;
    ps__hub_t *h = c->ring->hub;
    job_t *j = c->job;
    Paramsync__V1__CollectiveResult res = PARAMSYNC__V1__COLLECTIVE_RESULT__INIT;
    char why[sizeof(c->message)];
    int failed = c->failed, end_sent = 0;
    res.code = c->code;
    snprintf(why, sizeof(why), "%s", c->message);
    l->busy = 1;
    pthread_mutex_unlock(c->lock);
    if (o->call) {
        if (failed && !broke) {
            /* The other agent fails the collective with the same words. */
            res.message = why;
            grpc_byte_buffer *bb = ps__frame_encode(NULL, &res, 0, NULL, 0, NULL, NULL);
            if (bb) {
                ps__rpc_call_send(o->call, bb);
                grpc_byte_buffer_destroy(bb);
            }
        }
        grpc_byte_buffer *bb = broke ? NULL : ps__frame_encode_end(NULL);
        end_sent = bb && ps__rpc_call_send(o->call, bb) == 0;
        if (bb)
            grpc_byte_buffer_destroy(bb);
        if (!end_sent)
            ps__rpc_call_close_send(o->call);
        if (o->watching)
            ps__task_join(&o->watcher);
        else
            ring_watch_main(&o->watch);
    }
    pthread_mutex_lock(c->lock);
    int keep = end_sent && o->watch.ended && !c->failed;
    l->call = NULL;
    l->busy = 0;
    pthread_mutex_unlock(c->lock);
    if (o->call && !(keep && h->ring_keep(h->lookup_arg, l->addr, j->name, o->call))) {
        if (o->watch.ended) { /* the other agent waits for another header */
            ps__rpc_call_close_send(o->call);
            ps__rpc_call_finish(o->call, NULL);
        }
        ps__rpc_call_destroy(o->call);
    }
    pthread_mutex_lock(c->lock);
    ring_thread_exit(h, j, c);
}

/* A link to another agent, l (the next one, or in a mesh any other): opens
 * it, then sends each step's pieces that go over it as soon as they are
 * ready (its own partial in round 0, then what the receiver has just added
 * or completed). The sender to the next agent also passes the tokens on,
 * keeps the deadline until every link to this agent has arrived, and checks
 * meanwhile that the group's ranks on other agents are still members. */
static void *ring_send_main(void *arg)
{
    ring_link_t *l = arg;
    coll_t *c = l->c;
    ring_t *rg = c->ring;
    ps__hub_t *h = rg->hub;
    int next = l == &rg->out;
    ring_out_t o;
    int rc = ring_out_open(l, &o);
    ps__rpc_call_t *out = o.call;
    int64_t start = ps__now_ms();
    int rounds = ring_rounds(c), broke = rc < 0;
    /* A passing ring that sends nothing (or no more) still keeps the
     * deadline until the links to this agent come, if they have to come. */
    int wait_in = rg->in.frames > 0;
    /* Pieces go as soon as they are ready, whichever step they belong to, so
     * the steps in the window go round the ring together; each frame's
     * offset says which (step x rounds + round). */
    int64_t lo = 0; /* steps below have been sent whole */
    while (!broke && !c->failed) {
        /* A step is done once sent whole (or, passing, when this agent does
         * not pass it on); its slot may be reused already. */
        while (lo < c->nsteps) {
            slot_t *x = &c->slots[lo % c->window];
            if ((x->step == lo && x->sent == rounds) || (x->step != lo && x->last_done >= lo) ||
                !ring_sends(c, lo) || ring_to(c, lo) != l->peer)
                lo++;
            else
                break;
        }
        int tok_due = next && ring_agrees(c) ? ring_tok_out(rg) : 0;
        if (next && rg->tok_ready > rg->tok_sent && !ring_tok_held(c)) {
            /* A token goes before any piece: it only says links were taken. */
            uint64_t tag = PS_RING_TOKEN + (uint64_t)++rg->tok_sent;
            l->busy = 1;
            pthread_mutex_unlock(c->lock);
            grpc_byte_buffer *bb = ps__frame_encode(NULL, NULL, tag, NULL, 0, NULL, NULL);
            rc = bb ? ps__rpc_call_send(out, bb) : PS_ENOMEM;
            if (bb)
                grpc_byte_buffer_destroy(bb);
            pthread_mutex_lock(c->lock);
            l->busy = 0;
            broke = rc < 0;
            continue;
        }
        if (lo >= c->nsteps && (!next || !ring_link_missing(c, wait_in)) && rg->tok_sent >= tok_due)
            break;
        slot_t *sl = NULL;
        int64_t s = lo;
        int r = 0;
        for (; s < lo + c->window && s < c->nsteps && !sl; s++) {
            slot_t *x = &c->slots[s % c->window];
            r = x->sent;
            if (x->step != s || r >= rounds)
                continue;
            int ready = rg->mode == RING_PASS  ? x->computed
                        : rg->mode == RING_ACC ? (ring_takes(c, s) ? x->rounds == 1 : x->partial)
                                               : (r == 0 ? x->partial : x->rounds >= r);
            if (ready && ring_sends(c, s) && ring_to(c, s) == l->peer)
                sl = x;
        }
        s--;
        if (!sl) {
            if (!next || !ring_link_missing(c, 1)) {
                pthread_cond_wait(&c->cond, c->lock);
                continue;
            }
            struct timespec slice = abs_ms(PS_HUB_LIVENESS_CHECK_MS);
            pthread_cond_timedwait(&c->cond, c->lock, &slice);
            int64_t now = ps__now_ms();
            const ring_link_t *missing = ring_link_missing(c, 1);
            if (c->failed || !missing)
                continue;
            if (now - start >= rg->timeout_ms)
                coll_fail(c, GRPC_STATUS_DEADLINE_EXCEEDED,
                          "%s (group %u, seq %" PRIu64 "): the ranks on agent %s did not "
                          "arrive within %lld ms",
                          kind_name(c->kind), c->group, c->seq, missing->addr,
                          (long long)rg->timeout_ms);
            else
                check_missing_alive(h, c);
            continue;
        }
        sl->sent++;
        int relays = rg->mode == RING_PASS && ring_at(c, s) == RING_AT_MID;
        blob_t *b = sl->out;
        blob_ref(b);
        size_t off = 0, len = sl->len;
        if (rg->mesh) { /* an all_to_all block's padding stays here */
            step_plan_t p;
            plan_step(c, s, &p);
            len = step_used(c, &p, NULL);
        }
        l->busy = 1;
        pthread_mutex_unlock(c->lock);
        if (!ring_whole(c))
            ring_piece(c, sl->len, ring_piece_of_round(rg, r, 0), &off, &len);
        uint64_t tag = (uint64_t)s * (uint64_t)rounds + (uint64_t)r;
        grpc_byte_buffer *bb =
            b->data ? ps__frame_encode(NULL, NULL, tag, b->data + off, len, blob_unref, b)
                    : blob_pieces_encode(b, tag, off, len);
        rc = bb ? ps__rpc_call_send(out, bb) : PS_ENOMEM;
        if (bb)
            grpc_byte_buffer_destroy(bb);
        if (rc == 0)
            ps__metrics_bytes(PS_M_TX, PS_M_LINK_AGENT, len);
        if (rc == 0 && relays)
            ps__metrics_relayed(len);
        pthread_mutex_lock(c->lock);
        l->busy = 0;
        broke = rc < 0;
        if (!broke && r == rounds - 1 && ++sl->recv_done == sl->recv_need)
            slot_consumed(c, sl);
    }
    ring_out_close(l, &o, broke);
    return NULL;
}

static void *ring_apply_main(void *arg);
static void *rd_send_main(void *arg);
static void *rd_apply_main(void *arg);

/* "ADDR (rank 2, rank 3)": the agent at ring position pos with the job ranks
 * it serves (the first few), so that a broken link names the ranks lost with
 * it. Lock held; NULL when out of memory. */
static char *ring_who(const job_t *j, uint32_t group, const ring_plan_t *plan, int pos,
                      const char *addr)
{
    char buf[512];
    int n = group_size(j, group), shown = 0, more = 0;
    size_t len = (size_t)snprintf(buf, sizeof(buf), "%s (", addr);
    for (int g = 0; g < n && len < sizeof(buf); g++) {
        if (plan->agent_of[g] != pos)
            continue;
        if (shown == 4) {
            more++;
            continue;
        }
        len += (size_t)snprintf(buf + len, sizeof(buf) - len, "%srank %d", shown ? ", " : "",
                                job_rank(&j->info, group, g));
        shown++;
    }
    if (len < sizeof(buf) && more)
        len += (size_t)snprintf(buf + len, sizeof(buf) - len, " and %d more", more);
    if (len < sizeof(buf))
        snprintf(buf + len, sizeof(buf) - len, ")");
    return strdup(buf);
}

/* Sets link l up for the agent at position peer: its address and who. Lock
 * held; -1 when out of memory. */
static int ring_link_init(coll_t *c, const ring_plan_t *plan, ring_link_t *l, int peer)
{
    l->c = c;
    l->peer = peer;
    l->addr = strdup(plan->agents[peer]);
    l->who = ring_who(c->job, c->group, plan, peer, plan->agents[peer]);
    return l->addr && l->who ? 0 : -1;
}

/* The most steps a mesh gives a slot each (ring_mesh_widen). */
#define PS_RING_MESH_SLOTS 65536

/* A mesh all_to_all gets a slot for every step, when the memory those that
 * come to this agent hold (a block piece each: no reductions) fits in what
 * --max-inflight-bytes leaves: with a window of a few steps, numbered source
 * rank first, an agent could not send its own blocks before it had taken
 * those of the ranks before it (their slots are the same), and the agents
 * took turns instead of sending at once (16 MiB per rank across 4 netns
 * hosts with links of 1 Gbit/s, one rank each: 278-283 ms with --window 4,
 * 134-141 ms with a slot each; on the unlimited links, where the shared
 * cores are the limit, within noise). Lock held, before any slot is
 * claimed. */
static void ring_mesh_widen(const ps__hub_t *h, coll_t *c)
{
    if (c->nsteps <= c->window || c->nsteps > PS_RING_MESH_SLOTS)
        return;
    uint64_t here = 0;
    for (int64_t s = 0; s < c->nsteps; s++)
        here += ring_at(c, s) != 0;
    uint64_t piece = c->block < c->step_bytes ? c->block : c->step_bytes;
    uint64_t need = here * piece;
    if (need > c->reserved && h->inflight_bytes + (need - c->reserved) > h->cfg->max_inflight_bytes)
        return;
    slot_t *slots = calloc((size_t)c->nsteps, sizeof(slot_t));
    if (!slots)
        return; /* the narrow window still works */
    free(c->slots);
    c->slots = slots;
    c->window = (int)c->nsteps;
    for (int i = 0; i < c->window; i++) {
        c->slots[i].step = -1;
        c->slots[i].last_done = i - c->window;
    }
    *c->budget = *c->budget - c->reserved + need;
    c->reserved = need;
}

/* Starts a thread of c's ring (fn(arg), on a kept thread), counted in
 * c->threads. Lock held; -1 when it could not. */
static int ring_thread_start(ps__hub_t *h, coll_t *c, void *(*fn)(void *), void *arg)
{
    if (ps__task_run(fn, arg) != 0)
        return -1;
    c->threads++;
    c->job->refs++;
    h->helpers++;
    return 0;
}

/* An all_gather round a ring (PASS) goes block after block as other kinds
 * do, each block round from the agent of its rank to the one before: the
 * link into that agent is idle while the block goes round, so the ring ran
 * at (A - 1) / A of its links (0.75-0.80x Gloo's all_gather on 4 netns
 * hosts of 1 Gbit/s each). The blocks take turns instead, chunk by chunk:
 * step s is chunk s / n of block c->order[s % n], and the order takes one
 * rank of each agent in turn (the first of each, then the second, ...), so
 * that the steps in the window start on every agent and every link carries
 * a piece. Every agent works the order out alike from the ring's agent_of.
 * -1 when out of memory. */
static int ring_block_order(coll_t *c)
{
    int n = c->n, a = c->ring->nagents, k = 0;
    int *order = malloc((size_t)n * sizeof(int)), *next = calloc((size_t)a, sizeof(int));
    if (!order || !next) {
        free(order);
        free(next);
        return -1;
    }
    for (int took = 1; k < n && took;) {
        took = 0;
        for (int pos = 0; pos < a; pos++) {
            /* next[pos]: where to look for agent pos's next rank */
            while (next[pos] < n && c->ring->agent_of[next[pos]] != pos)
                next[pos]++;
            if (next[pos] < n) {
                order[k++] = next[pos]++;
                took = 1;
            }
        }
    }
    free(next);
    if (k < n) /* not reached: every rank's agent is in the ring; block after block then */
        free(order);
    else
        c->order = order;
    return 0;
}

/* Makes c a ring collective (a mesh for all_to_all) and starts its links to
 * the other agents. Lock held. 0, or -1 with the collective failed. */
static int coll_ring_start(ps__hub_t *h, coll_t *c, const ring_plan_t *plan, int64_t timeout_ms)
{
    ring_t *rg = calloc(1, sizeof(*rg));
    int a = plan->nagents, nx = c->kind == K_ALL_TO_ALL || plan->rd ? a - 2 : 0, fail = !rg;
    c->ring = rg;
    if (rg) {
        rg->nagents = a;
        rg->pos = plan->pos;
        rg->nlocal = plan->nlocal;
        rg->mesh = c->kind == K_ALL_TO_ALL;
        rg->rd = plan->rd;
        rg->rd_k = -1;
        fail |= ring_link_init(c, plan, &rg->out, (plan->pos + 1) % a) < 0;
        fail |= ring_link_init(c, plan, &rg->in, (plan->pos + a - 1) % a) < 0;
        if (nx > 0) {
            rg->xin = calloc((size_t)nx, sizeof(ring_link_t));
            rg->xout = calloc((size_t)nx, sizeof(ring_link_t));
            fail |= !rg->xin || !rg->xout;
            for (int k = 0; k < nx && !fail; k++) {
                fail |= ring_link_init(c, plan, &rg->xin[k], (plan->pos + a - 2 - k) % a) < 0;
                fail |= ring_link_init(c, plan, &rg->xout[k], (plan->pos + 2 + k) % a) < 0;
            }
        }
    }
    if (fail) {
        coll_fail(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "%s: out of memory", kind_name(c->kind));
        return -1;
    }
    rg->hub = h;
    rg->group_size = group_size(c->job, c->group);
    rg->timeout_ms = timeout_ms;
    rg->mode = plan->rd ? RING_SPLIT : ring_mode(c->kind);
    if (rg->mode != RING_SPLIT) {
        /* Members are the whole group (coll_serves says which come here). */
        rg->agent_of = malloc((size_t)rg->group_size * sizeof(int));
        if (!rg->agent_of) {
            coll_fail(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "%s: out of memory", kind_name(c->kind));
            return -1;
        }
        memcpy(rg->agent_of, plan->agent_of, (size_t)rg->group_size * sizeof(int));
        if (c->kind == K_ALL_GATHER && ring_block_order(c) < 0) {
            coll_fail(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "%s: out of memory", kind_name(c->kind));
            return -1;
        }
    } else {
        for (int i = 0; i < c->n; i++)
            c->ranks[i] = plan->local[i];
    }
    for (int k = -1; k < nx; k++) {
        ring_link_t *in = k < 0 ? &rg->in : &rg->xin[k], *out = k < 0 ? &rg->out : &rg->xout[k];
        /* Recursive doubling: one frame on the call of each pair that
         * has a round, opened by one of the two (the reply is the call's). */
        in->frames =
            rg->rd ? (uint64_t)rd_opens(a, in->peer, rg->pos) : ring_frames(c, in->peer, 0);
        out->frames =
            rg->rd ? (uint64_t)rd_opens(a, rg->pos, out->peer) : ring_frames(c, out->peer, 1);
    }
    if (rg->mesh)
        ring_mesh_widen(h, c);
    ps__metrics_ring(rg->rd ? PS_M_RING_RD : rg->mesh ? PS_M_RING_MESH : PS_M_RING_RING);
    if (rg->rd) {
        /* Every link with a round, and the rounds. */
        int ok = 1;
        for (int k = -1; k < nx && ok; k++) {
            ring_link_t *out = k < 0 ? &rg->out : &rg->xout[k];
            ok = out->frames == 0 || ring_thread_start(h, c, rd_send_main, out) == 0;
        }
        if (!ok || ring_thread_start(h, c, rd_apply_main, c) != 0) {
            coll_fail(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "%s: no thread for the ring",
                      kind_name(c->kind));
            return -1;
        }
        return 0;
    }
    /* The sender to the next agent and the applier always; a sender to each
     * other agent of a mesh that has steps for it (the agent there expects
     * the link just then). */
    int ok = ring_thread_start(h, c, ring_send_main, &rg->out) == 0 &&
             ring_thread_start(h, c, ring_apply_main, c) == 0;
    for (int k = 0; k < nx && ok; k++)
        ok = rg->xout[k].frames == 0 || ring_thread_start(h, c, ring_send_main, &rg->xout[k]) == 0;
    if (!ok) {
        coll_fail(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "%s: no thread for the ring",
                  kind_name(c->kind));
        return -1;
    }
    return 0;
}

/* The member index of group rank `rank` in c, or -1 when another agent
 * serves that rank. */
static int coll_index(const coll_t *c, int rank)
{
    if (!c->ring || ring_whole(c))
        return rank >= 0 && rank < c->n && coll_serves(c, rank) ? rank : -1;
    for (int i = 0; i < c->n; i++)
        if (c->ranks[i] == rank)
            return i;
    return -1;
}

/* A link from another agent, l (the previous one, or in a mesh any other),
 * read by the Ring call's handler thread: frames are queued as they come (so
 * a failure frame is seen at once, even while the pieces before it wait for
 * this agent's own ranks), and taken in order by ring_apply_main. Tokens
 * come only from the previous agent. Ends at the other agent's end frame
 * (then 1: the call may carry that agent's next collective), at the end of
 * the stream, or at a failure (0). */
static int ring_receive(ring_link_t *l, ps__rpc_call_t *call)
{
    coll_t *c = l->c;
    ring_t *rg = c->ring;
    const char *pre = kind_name(c->kind);
    int tokens = l == &rg->in && ring_agrees(c);
    uint64_t want = l->frames, got = 0;
    for (;;) {
        grpc_byte_buffer *bb = NULL;
        ring_frame_t *q = calloc(1, sizeof(*q));
        int rc = q ? ps__rpc_call_recv(call, &bb) : PS_ENOMEM;
        if (rc == 0 && bb)
            rc = ps__frame_decode(bb, &q->f) < 0 ? PS_EINVAL : 0;
        /* The end of the collective's frames: the end frame, or the end of
         * the stream (an agent before --wire 3). */
        int end_frame = rc == 0 && bb && ps__frame_is_end(&q->f) && !q->f.meta->result;
        int fin = rc == 0 && (!bb || end_frame);
        if (bb)
            grpc_byte_buffer_destroy(bb);
        pthread_mutex_lock(c->lock);
        const Paramsync__V1__CollectiveResult *res = rc == 0 && !fin ? q->f.meta->result : NULL;
        int end = 1, kept = 0;
        if (c->failed) {
            /* nothing more to read */
        } else if (res && res->code != 0) {
            coll_fail(c, res->code, "%s", res->message);
        } else if (rc == PS_ENOMEM) {
            coll_fail(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "%s: out of memory", pre);
        } else if ((rc < 0 && rc != PS_EINVAL) ||
                   (fin && (got < want || (tokens && rg->tok_in < ring_tok_in(rg))))) {
            /* Broken, or ended early: gRPC shows a cancelled stream as an
             * end too. The previous agent cancels the link when the
             * collective fails there, and says why on the link it reads
             * (cancelled by us in coll_fail) and so on round the ring: give
             * those words a moment to arrive before these. */
            struct timespec grace = abs_ms(1000);
            while (!c->failed && pthread_cond_timedwait(&c->cond, c->lock, &grace) != ETIMEDOUT)
                ;
            coll_fail(c, GRPC_STATUS_ABORTED,
                      "%s (group %u, seq %" PRIu64 "): the link from agent %s %s (it failed, "
                      "or died)",
                      pre, c->group, c->seq, l->who, rc < 0 ? "broke" : "ended early");
        } else if (rc == 0 && !fin && !res && tokens && q->f.meta->offset > PS_RING_TOKEN &&
                   !q->f.meta->header && !q->f.meta->end) {
            int t = (int)(q->f.meta->offset - PS_RING_TOKEN);
            if (t != rg->tok_in + 1 || t > ring_tok_in(rg) || q->f.data_len)
                coll_fail(c, GRPC_STATUS_INVALID_ARGUMENT,
                          "%s (group %u, seq %" PRIu64 "): agent %s sent token %d out of turn", pre,
                          c->group, c->seq, l->addr, t);
            else {
                ring_token_in(c, t);
                end = 0;
            }
        } else if (rc < 0 || res || (!fin && (got == want || q->f.meta->end))) {
            coll_fail(c, GRPC_STATUS_INVALID_ARGUMENT,
                      "%s (group %u, seq %" PRIu64 "): agent %s sent %s", pre, c->group, c->seq,
                      l->addr,
                      rc < 0 ? "a malformed frame"
                      : res  ? "a result where a piece belongs"
                             : "more pieces than the collective has");
        } else if (!fin) {
            q->from = l;
            *(rg->q_tail ? &rg->q_tail->next : &rg->q_head) = q;
            rg->q_tail = q;
            q = NULL;
            got++;
            end = 0;
            pthread_cond_broadcast(&c->cond);
        } else {
            kept = end_frame;
        }
        pthread_mutex_unlock(c->lock);
        if (q) {
            ps__frame_clear(&q->f);
            free(q);
        }
        if (end)
            return kept;
    }
}

/* Whether the passed-on step s, arriving in frame f, stays in the frame's
 * slices: until each rank here it is for writes it out (member_write) and
 * the next agent's frame is made of the same slices (ring_send_main). So the
 * bytes are copied once on this agent, from the slices into a segment or a
 * worker's memory, not into a buffer first. When a rank here that receives
 * it is answered in frames, or the agent reduces on a device, it is copied
 * as before. Lock held. */
static int pass_step_held(const coll_t *c, int64_t s, const ps__frame_t *f)
{
    if (f->nslices > PS_HUB_FRAME_IOV || c->slots[s % c->window].placed)
        return 0;
    step_plan_t p;
    plan_step(c, s, &p);
    for (int i = 0; i < c->n; i++)
        if (step_receives(c, &p, i) && coll_serves(c, i) && (!c->members[i] || !c->members[i]->shm))
            return 0;
    return 1;
}

/* Passing ring: takes the queued steps, each as this agent's copy of the
 * step (its owner's data, for the local ranks and the next agent), lowest
 * first among those whose slot is free, so that a step sent ahead of an
 * earlier one cannot hold the window. Lock held. */
static void ring_pass_apply(coll_t *c)
{
    ring_t *rg = c->ring;
    const char *pre = kind_name(c->kind);
    for (uint64_t left = ring_frames(c, -1, 0); left > 0 && !c->failed;) {
        ring_frame_t **take = NULL, *before = NULL, *prev = NULL;
        int64_t best = -1;
        for (ring_frame_t **link = &rg->q_head; *link && !c->failed;
             prev = *link, link = &(*link)->next) {
            uint64_t tag = (*link)->f.meta->offset;
            int64_t s = tag < (uint64_t)c->nsteps ? (int64_t)tag : -1;
            slot_t *x = s >= 0 ? &c->slots[s % c->window] : NULL;
            int own = s >= 0 && (!ring_takes(c, s) || ring_from(c, s) != (*link)->from->peer);
            if (s < 0 || own || x->step == s || x->last_done >= s)
                coll_fail(c, GRPC_STATUS_INVALID_ARGUMENT,
                          "%s (group %u, seq %" PRIu64 "): agent %s sent step %" PRIu64 " %s", pre,
                          c->group, c->seq, (*link)->from->addr, tag,
                          s < 0 ? "past the collective's end"
                          : own ? "that does not come from it"
                                : "twice");
            else if ((best < 0 || s < best) && x->step == -1 &&
                     x->last_done == slot_prev_step(c, s)) {
                best = s;
                take = link;
                before = prev;
            }
        }
        if (c->failed)
            break;
        if (!take) {
            pthread_cond_wait(&c->cond, c->lock);
            continue;
        }
        ring_frame_t *q = *take;
        *take = q->next;
        if (rg->q_tail == q)
            rg->q_tail = before;
        left--;
        slot_t *sl = slot_take(c, best) > 0 ? &c->slots[best % c->window] : NULL;
        /* An all_to_all block may come without its padding (step_used):
         * held, it stays that short (only segments take it, member_write);
         * copied, the padding is zeros for a rank answered in frames. */
        size_t got = q->f.data_len;
        int fits = sl && (got == sl->len || (c->kind == K_ALL_TO_ALL && got < sl->len));
        int hold = fits && pass_step_held(c, best, &q->f);
        blob_t *b = !fits ? NULL : hold ? blob_pieces(got) : blob_new(sl->len);
        if (sl && !fits)
            coll_fail(c, GRPC_STATUS_INVALID_ARGUMENT,
                      "%s (group %u, seq %" PRIu64 "): agent %s sent %zu bytes for a step of %zu",
                      pre, c->group, c->seq, q->from->addr, got, sl->len);
        else if (sl && !b)
            coll_fail(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "%s: out of memory", pre);
        if (b) {
            /* Claimed and not computed: nobody else touches the slot. */
            pthread_mutex_unlock(c->lock);
            int rc = 0;
            if (hold) {
                rc = blob_hold(b, &q->f, 0, got);
            } else {
                ps__frame_copy_data(&q->f, 0, b->data, got);
                memset(b->data + got, 0, sl->len - got);
            }
            ps__metrics_bytes(PS_M_RX, PS_M_LINK_AGENT, got);
            pthread_mutex_lock(c->lock);
            if (rc < 0) {
                coll_fail(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "%s: out of memory", pre);
                blob_unref(b);
                ps__frame_clear(&q->f);
                free(q);
                break;
            }
            sl->out = b;
            sl->have = sl->need;
            sl->computed = 1;
            if (sl->recv_need == 0)
                slot_consumed(c, sl);
            pthread_cond_broadcast(&c->cond);
        }
        ps__frame_clear(&q->f);
        free(q);
    }
}

/* Reduces `mine` (len bytes) and the data of frame f into dst, reading the
 * frame where it arrived (reduce_runs), mine first or f first; dst may be
 * mine. *iov (*cap entries) is the caller's, grown as needed. 0 or a
 * negative code. */
static int ring_combine(coll_t *c, uint8_t *dst, const uint8_t *mine, const ps__frame_t *f,
                        int mine_first, struct iovec **iov, size_t *cap)
{
    if (*cap < f->nslices) {
        struct iovec *n = realloc(*iov, f->nslices * sizeof(*n));
        if (!n)
            return PS_ENOMEM;
        *iov = n;
        *cap = f->nslices;
    }
    int k = ps__frame_data_iov(f, *iov, (int)*cap);
    if (k < 0)
        return PS_EINVAL; /* not reached: a frame's data lies in at most nslices pieces */
    in_cursor_t cur[2];
    in_cursor_whole(&cur[mine_first ? 0 : 1], mine, f->data_len);
    cur[mine_first ? 1 : 0] = (in_cursor_t){.piece = *iov, .npieces = k};
    return reduce_runs(hub_op(c), (ps_dtype_t)c->dtype, dst, cur, 2, f->data_len);
}

/* Adds the data of frame f into dst, in place. */
static int ring_add(coll_t *c, uint8_t *dst, const ps__frame_t *f, struct iovec **iov, size_t *cap)
{
    return ring_combine(c, dst, dst, f, 1, iov, cap);
}

/* Takes the queued pieces in order: adds them to this agent's partials in
 * the first A - 1 rounds of a step, takes them as the result in the others
 * (the sender passes each on), and hands a step to the local ranks once its
 * last piece is in. First waits, with the collective's deadline, for this
 * agent's ranks. */
static void *ring_apply_main(void *arg)
{
    coll_t *c = arg;
    ring_t *rg = c->ring;
    ps__hub_t *h = rg->hub;
    job_t *j = c->job;
    int rounds = ring_rounds(c);
    size_t esize = ps_dtype_size((ps_dtype_t)c->dtype);
    const char *pre = kind_name(c->kind);
    int acc = rg->mode == RING_ACC;
    struct iovec *iov = NULL; /* where a received piece lies in its frame */
    size_t iov_cap = 0;
    pthread_mutex_lock(c->lock);
    wait_arrivals(h, c, rg->timeout_ms);
    if (rg->mode == RING_PASS)
        ring_pass_apply(c);
    /* Pieces come in the order the previous agent could send them: take the
     * first whose step is here with its partial and whose round is next
     * (ACC: a step, added to this agent's partial). */
    for (uint64_t left = rg->mode == RING_PASS ? 0 : rg->in.frames; left > 0 && !c->failed;) {
        ring_frame_t *q = NULL, **link = &rg->q_head, *prev = NULL;
        slot_t *sl = NULL;
        int64_t s = 0;
        int r = 0;
        for (; *link; prev = *link, link = &(*link)->next) {
            uint64_t tag = (*link)->f.meta->offset;
            s = (int64_t)(tag / (uint64_t)rounds);
            r = (int)(tag % (uint64_t)rounds);
            if (s >= c->nsteps || (acc && !ring_takes(c, s))) {
                coll_fail(c, GRPC_STATUS_INVALID_ARGUMENT,
                          "%s (group %u, seq %" PRIu64 "): agent %s sent a piece of step %" PRId64
                          " of %" PRId64 "%s",
                          pre, c->group, c->seq, rg->in.addr, s, c->nsteps,
                          s < c->nsteps ? ", which starts here" : "");
                break;
            }
            slot_t *x = &c->slots[s % c->window];
            if (x->step == s && x->partial && x->rounds == r) {
                q = *link;
                sl = x;
                *link = q->next;
                if (rg->q_tail == q)
                    rg->q_tail = prev;
                break;
            }
        }
        if (c->failed)
            break;
        if (!q) {
            pthread_cond_wait(&c->cond, c->lock);
            continue;
        }
        left--;
        size_t off = 0, len = sl->len;
        if (!acc)
            ring_piece(c, sl->len, ring_piece_of_round(rg, r, 1), &off, &len);
        /* SPLIT: the first A - 1 rounds add, the last of them completes the
         * piece; ACC: the step is added, and complete where it ends. */
        int adds = acc || r < rg->nagents - 1;
        int completes = acc ? ring_ends(c, s) : r == rg->nagents - 2;
        int rc = 0;
        if (q->f.data_len != len) {
            coll_fail(c, GRPC_STATUS_INVALID_ARGUMENT,
                      "%s (group %u, seq %" PRIu64 "): agent %s sent %zu bytes for a piece "
                      "of %zu",
                      pre, c->group, c->seq, rg->in.addr, q->f.data_len, len);
        } else {
            /* The slot cannot move on before this round is counted. */
            uint8_t *dst = sl->out->data + off;
            pthread_mutex_unlock(c->lock);
            if (adds) {
                rc = ring_add(c, dst, &q->f, &iov, &iov_cap);
                if (rc == 0 && completes && c->op == PS_AVG)
                    rc = ps_reduce_scale((ps_dtype_t)c->dtype, dst, len / esize,
                                         (uint64_t)rg->group_size);
                ps__metrics_reduced(PS_M_DEV_CPU, 2 * (uint64_t)len);
            } else {
                ps__frame_copy_data(&q->f, 0, dst, len);
            }
            ps__metrics_bytes(PS_M_RX, PS_M_LINK_AGENT, len);
            pthread_mutex_lock(c->lock);
            if (rc < 0)
                coll_fail(c,
                          rc == PS_ENOMEM ? GRPC_STATUS_RESOURCE_EXHAUSTED
                                          : GRPC_STATUS_INVALID_ARGUMENT,
                          "%s: reduction failed: %s", pre, ps_strerror(rc));
            sl->rounds = r + 1;
            if (acc ? completes : r == rounds - 1)
                sl->computed = 1;
            pthread_cond_broadcast(&c->cond);
        }
        ps__frame_clear(&q->f);
        free(q);
    }
    free(iov);
    ring_thread_exit(h, j, c);
    return NULL;
}

/* ---- recursive doubling between agents (rd_core and on, above) ---- */

/* The link of c's ring to (out) or from the agent at peer. */
static ring_link_t *ring_link_of(ring_t *rg, int peer, int out)
{
    int a = rg->nagents;
    if (out)
        return peer == rg->out.peer ? &rg->out : &rg->xout[(peer - rg->pos - 2 + 2 * a) % a];
    return peer == rg->in.peer ? &rg->in : &rg->xin[(rg->pos - peer + a) % a - 2];
}

/* The agent the one at pos sends to (sending) or hears from in round t, or
 * -1 when none. */
static int rd_peer_at(int a, int pos, int t, int sending)
{
    for (int q = 0; q < a; q++)
        if ((sending ? rd_round(a, pos, q) : rd_round(a, q, pos)) == t)
            return q;
    return -1;
}

/* Takes the frame from the agent at `from` off c's queue: NULL when none
 * came yet, or (c failed) when it carries another round than t. Lock held. */
static ring_frame_t *rd_take(coll_t *c, int from, int t)
{
    ring_t *rg = c->ring;
    for (ring_frame_t **link = &rg->q_head, *prev = NULL; *link;
         prev = *link, link = &(*link)->next) {
        ring_frame_t *q = *link;
        if (q->from->peer != from)
            continue;
        *link = q->next;
        if (rg->q_tail == q)
            rg->q_tail = prev;
        if (q->f.meta->offset != (uint64_t)t) {
            coll_fail(c, GRPC_STATUS_INVALID_ARGUMENT,
                      "%s (group %u, seq %" PRIu64 "): agent %s sent round %" PRIu64
                      " where round %d belongs (--ring, --rd-max-bytes or --step-bytes differ "
                      "between the agents?)",
                      kind_name(c->kind), c->group, c->seq, q->from->addr, q->f.meta->offset, t);
            ps__frame_clear(&q->f);
            free(q);
            return NULL;
        }
        return q;
    }
    return NULL;
}

/* Waits until this agent's value for round t is there, takes it for the
 * round's frame and sends that on call, the lock down meanwhile (*busy set).
 * Lock held. 0, 1 when the collective failed first, < 0 when the send did. */
static int rd_send_round(coll_t *c, int t, ps__rpc_call_t *call, int *busy)
{
    ring_t *rg = c->ring;
    while (!c->failed && rg->rd_k != t)
        pthread_cond_wait(&c->cond, c->lock);
    if (c->failed)
        return 1;
    blob_t *b = rg->rd_val;
    size_t len = rg->rd_len;
    blob_ref(b);
    rg->rd_taken |= 1ull << t;
    pthread_cond_broadcast(&c->cond);
    *busy = 1;
    pthread_mutex_unlock(c->lock);
    grpc_byte_buffer *bb = ps__frame_encode(NULL, NULL, (uint64_t)t, b->data, len, blob_unref, b);
    int rc = bb ? ps__rpc_call_send(call, bb) : PS_ENOMEM;
    if (bb)
        grpc_byte_buffer_destroy(bb);
    if (rc == 0)
        ps__metrics_bytes(PS_M_TX, PS_M_LINK_AGENT, len);
    pthread_mutex_lock(c->lock);
    *busy = 0;
    return rc < 0 ? rc : 0;
}

/* The opener of a pair's call in recursive doubling: opens it at once (the
 * other agent then has the collective), sends this agent's value of the
 * pair's round as soon as it is there; its watcher queues the reply. */
static void *rd_send_main(void *arg)
{
    ring_link_t *l = arg;
    coll_t *c = l->c;
    ring_t *rg = c->ring;
    ring_out_t o;
    int broke = ring_out_open(l, &o) < 0;
    if (!broke)
        broke = rd_send_round(c, rd_round(rg->nagents, rg->pos, l->peer), o.call, &l->busy) < 0;
    ring_out_close(l, &o, broke);
    return NULL;
}

/* The reply on a pair's call the other agent opened (l: its link here). */
typedef struct rd_reply {
    ring_link_t *l;
    ps__rpc_call_t *call;
} rd_reply_t;

static void *rd_reply_main(void *arg)
{
    rd_reply_t *r = arg;
    coll_t *c = r->l->c;
    int busy = 0;
    int t = rd_round(c->ring->nagents, c->ring->pos, r->l->peer);
    pthread_mutex_lock(c->lock);
    if (rd_send_round(c, t, r->call, &busy) < 0) {
        /* The other agent ends its call when the collective fails there,
         * and says why on it first (ring_receive reads that): a moment for
         * those words, as for a broken link (rd4.mismatch.p4 got this
         * ABORTED instead of the mismatch once in about 17 runs, ASan). */
        struct timespec grace = abs_ms(1000);
        while (!c->failed && pthread_cond_timedwait(&c->cond, c->lock, &grace) != ETIMEDOUT)
            ;
        coll_fail(c, GRPC_STATUS_ABORTED,
                  "%s (group %u, seq %" PRIu64 "): the reply to agent %s failed (it died?)",
                  kind_name(c->kind), c->group, c->seq, r->l->who);
    }
    pthread_mutex_unlock(c->lock);
    return NULL;
}

/* Waits for the frame of round t from the agent at `from`: until its link
 * has come, within the collective's deadline (then, as round the ring, that
 * agent's ranks did not arrive); once it has, for as long as it takes, since
 * that agent then has the collective and fails it, and says so, if its own
 * ranks do not come. Lock held; NULL with c failed. */
static ring_frame_t *rd_wait(coll_t *c, int from, int t, int64_t start)
{
    ring_t *rg = c->ring;
    ps__hub_t *h = rg->hub;
    /* The frame comes on the other agent's call, or as the reply on the
     * one this agent opened (then it has come once that is open). */
    int theirs = rd_opens(rg->nagents, from, rg->pos);
    ring_link_t *l = ring_link_of(rg, from, !theirs);
    ring_frame_t *q = NULL;
    /* After rd_take: it fails c itself on a frame of another round. (A frame
     * taken once c failed is the caller's to drop.) */
    while (!(q = rd_take(c, from, t)) && !c->failed) {
        if (theirs ? l->seen : l->call != NULL) {
            pthread_cond_wait(&c->cond, c->lock);
        } else if (ps__now_ms() - start >= rg->timeout_ms) {
            coll_fail(c, GRPC_STATUS_DEADLINE_EXCEEDED,
                      "%s (group %u, seq %" PRIu64 "): the ranks on agent %s did not arrive "
                      "within %lld ms",
                      kind_name(c->kind), c->group, c->seq, l->who, (long long)rg->timeout_ms);
        } else {
            check_missing_alive(h, c);
            struct timespec slice = abs_ms(PS_HUB_LIVENESS_CHECK_MS);
            pthread_cond_timedwait(&c->cond, c->lock, &slice);
        }
    }
    return q;
}

/* Recursive doubling's rounds at this agent: first waits, with the
 * collective's deadline, for its ranks and their reduction (the one step's
 * partial), then in each round makes its value known to the round's sender
 * and combines (or, an extra's last round, takes) the one it hears. The
 * result becomes the step's output. */
static void *rd_apply_main(void *arg)
{
    coll_t *c = arg;
    ring_t *rg = c->ring;
    ps__hub_t *h = rg->hub;
    job_t *j = c->job;
    const char *pre = kind_name(c->kind);
    int a = rg->nagents, pos = rg->pos, rounds = rd_rounds(a);
    int core = pos < rd_core(a);
    struct iovec *iov = NULL;
    size_t iov_cap = 0;
    int64_t start = ps__now_ms();
    pthread_mutex_lock(c->lock);
    wait_arrivals(h, c, rg->timeout_ms);
    slot_t *sl = &c->slots[0]; /* rd_fits: one step */
    while (!c->failed && !(sl->step == 0 && sl->partial))
        pthread_cond_wait(&c->cond, c->lock);
    /* The partial, shared when it is the agent's own blob (several ranks
     * here: their reduction), copied when it is a view of a rank's segment
     * (one rank): the rank's answer overwrites that with the result while a
     * frame of it may still be on its way to a partner (gRPC sends the slices
     * it is given, later), seen as wrong sums at the partners in 4 of 6 runs
     * of 4 agents before the copy. */
    size_t len = sl->len;
    if (!c->failed && !sl->out->map) {
        rg->rd_val = sl->out;
        blob_ref(rg->rd_val);
    } else if (!c->failed && (rg->rd_val = blob_new(len))) {
        memcpy(rg->rd_val->data, sl->out->data, len);
    } else if (!c->failed) {
        coll_fail(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "%s: out of memory", pre);
    }
    rg->rd_len = len;
    for (int t = 0; t < rounds && !c->failed; t++) {
        rg->rd_k = t; /* this agent's value for round t */
        pthread_cond_broadcast(&c->cond);
        int to = rd_peer_at(a, pos, t, 1), from = rd_peer_at(a, pos, t, 0);
        ring_frame_t *q = from >= 0 ? rd_wait(c, from, t, start) : NULL;
        while (!c->failed && to >= 0 && !(rg->rd_taken & (1ull << t)))
            pthread_cond_wait(&c->cond, c->lock);
        if (c->failed || !q) {
            if (q) {
                ps__frame_clear(&q->f);
                free(q);
            }
            continue;
        }
        blob_t *nb = NULL;
        if (q->f.data_len != len)
            coll_fail(c, GRPC_STATUS_INVALID_ARGUMENT,
                      "%s (group %u, seq %" PRIu64 "): agent %s sent %zu bytes for a value of %zu",
                      pre, c->group, c->seq, q->from->addr, q->f.data_len, len);
        else if (!(nb = blob_new(len)))
            coll_fail(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "%s: out of memory", pre);
        if (nb) {
            /* rd_val is only read from now on: the sender of this round
             * has its own reference. */
            blob_t *mine = rg->rd_val;
            pthread_mutex_unlock(c->lock);
            int rc = 0;
            if (t == rounds - 1) { /* an extra takes the result */
                ps__frame_copy_data(&q->f, 0, nb->data, len);
            } else {
                rc = ring_combine(c, nb->data, mine->data, &q->f, pos < from, &iov, &iov_cap);
                ps__metrics_reduced(PS_M_DEV_CPU, 2 * (uint64_t)len);
                if (rc == 0 && core && t == rounds - 2 && c->op == PS_AVG)
                    rc = ps_reduce_scale((ps_dtype_t)c->dtype, nb->data,
                                         len / ps_dtype_size((ps_dtype_t)c->dtype),
                                         (uint64_t)rg->group_size);
            }
            ps__metrics_bytes(PS_M_RX, PS_M_LINK_AGENT, len);
            pthread_mutex_lock(c->lock);
            if (rc < 0) {
                blob_unref(nb);
                coll_fail(c,
                          rc == PS_ENOMEM ? GRPC_STATUS_RESOURCE_EXHAUSTED
                                          : GRPC_STATUS_INVALID_ARGUMENT,
                          "%s: reduction failed: %s", pre, ps_strerror(rc));
            } else {
                rg->rd_val = nb;
                blob_unref(mine);
            }
        }
        ps__frame_clear(&q->f);
        free(q);
    }
    if (!c->failed) {
        /* The result is the step's output (a ring's step is never placed
         * by a device: step_places), and this thread the receiver the
         * ring's sender would be (step_local_receivers). */
        blob_t *old = sl->out;
        sl->out = rg->rd_val;
        blob_ref(sl->out);
        blob_unref(old);
        sl->computed = 1;
        if (++sl->recv_done == sl->recv_need)
            slot_consumed(c, sl);
        pthread_cond_broadcast(&c->cond);
    }
    free(iov);
    ring_thread_exit(h, j, c);
    return NULL;
}

int ps__hub_ring_serve(ps__hub_t *h, ps__rpc_call_t *call, ps__frame_t *first)
{
    Paramsync__V1__Frame *meta = first->meta;
    first->meta = NULL;
    ps__frame_clear(first);
    const header_t *hd = meta->header;
    char msg[512];
    int code = 0, kept = 0;
    coll_t *c = NULL;
    ring_plan_t plan;
    memset(&plan, 0, sizeof(plan));
    int64_t timeout = hd->timeout_ms ? (int64_t)hd->timeout_ms : h->cfg->timeout_ms;
    pthread_mutex_lock(&h->lock);
    job_t *j = NULL;
    if (h->stopping) {
        code = GRPC_STATUS_UNAVAILABLE;
        snprintf(msg, sizeof(msg), PS_MSG_STOPPING);
        goto done;
    }
    if (ring_mode(hd->kind) < 0) {
        code = GRPC_STATUS_INVALID_ARGUMENT;
        snprintf(msg, sizeof(msg), "ring: %s is not served by a ring of agents",
                 kind_name(hd->kind));
        goto done;
    }
    if (!(j = job_get(h, hd, &code, msg, sizeof(msg))))
        goto done;
    /* From the previous agent; in a mesh (all_to_all) from any other; in
     * recursive doubling from one that has a round with this one. */
    int from = hd->rank, ring = ring_use(h, j, hd, &plan);
    if (!ring || !(plan.rd ? rd_opens(plan.nagents, from, plan.pos)
                           : from == (plan.pos + plan.nagents - 1) % plan.nagents ||
                                 (hd->kind == K_ALL_TO_ALL && from >= 0 && from < plan.nagents &&
                                  from != plan.pos))) {
        code = GRPC_STATUS_FAILED_PRECONDITION;
        snprintf(msg, sizeof(msg),
                 "%s (group %u, seq %" PRIu64 "): a ring link from position %d, but this agent "
                 "(%s) is %s",
                 kind_name(hd->kind), hd->group, hd->seq, hd->rank, h->self,
                 !plan.local
                     ? "not in a ring for it (--ring, --ring-min-bytes or --step-bytes differ "
                       "here?)"
                 : plan.rd ? "not its partner in recursive doubling (--rd-max-bytes differs here?)"
                           : "not next to it");
        goto done;
    }
    int made;
    if ((code = coll_get(h, j, hd,
                         ring_split(&plan, hd->kind) ? plan.nlocal : group_size(j, hd->group), 1,
                         ring_step(h, &plan, hd->kind), &c, &made, msg, sizeof(msg))) != 0)
        goto done;
    if (made)
        coll_ring_start(h, c, &plan, timeout);
    if (!c->ring && !c->failed && (int)hd->kind != c->kind) {
        coll_fail(c, GRPC_STATUS_FAILED_PRECONDITION,
                  "collective seq %" PRIu64 " on group %u: ranks on agent %s called %s "
                  "but ranks here called %s",
                  hd->seq, hd->group, plan.agents[from], kind_name(hd->kind), kind_name(c->kind));
    } else if (!c->failed) {
        /* A different size can also mean ring here, hub there. */
        char who[300], theirs[300];
        snprintf(who, sizeof(who), "the ranks on agent %s", plan.agents[from]);
        snprintf(theirs, sizeof(theirs), "the ranks on agent %s have", h->self);
        if (ring_mismatch(c, hd, who, theirs, msg, sizeof(msg)))
            coll_fail(c, GRPC_STATUS_FAILED_PRECONDITION, "%s", msg);
        else if (!c->ring)
            coll_fail(c, GRPC_STATUS_FAILED_PRECONDITION,
                      "%s (group %u, seq %" PRIu64 "): agent %s runs it in a ring and "
                      "this one (%s) at the hub: set --ring, --ring-min-bytes and "
                      "--step-bytes alike on every agent",
                      kind_name(hd->kind), hd->group, hd->seq, plan.agents[from], h->self);
    }
    ring_link_t *l = NULL;
    if (c->ring && (from == c->ring->in.peer || c->ring->xin))
        l = ring_link_of(c->ring, from, 0);
    if (c->ring && !c->failed && !l)
        coll_fail(c, GRPC_STATUS_FAILED_PRECONDITION,
                  "%s (group %u, seq %" PRIu64 "): a ring link from agent %s, not next to this one",
                  kind_name(c->kind), hd->group, hd->seq, plan.agents[from]);
    if (c->ring && (!l || l->seen || c->failed)) {
        if (!c->failed)
            coll_fail(c, GRPC_STATUS_INVALID_ARGUMENT,
                      "%s (group %u, seq %" PRIu64 "): a second ring link from agent %s "
                      "(this one from %s)",
                      kind_name(c->kind), hd->group, hd->seq, plan.agents[from],
                      ps__rpc_call_peer(call));
        code = c->code;
        snprintf(msg, sizeof(msg), "%s", c->message);
        coll_retire(j, c);
        c = NULL;
        goto done;
    }
    if (c->failed) { /* the ring could not start */
        code = c->code;
        snprintf(msg, sizeof(msg), "%s", c->message);
        coll_retire(j, c);
        c = NULL;
        goto done;
    }
    l->call = call;
    l->seen = 1;
    if (l == &c->ring->in && ring_agrees(c) && c->ring->pos == 0)
        c->ring->tok_ready = 1; /* its own link is taken: token 1 can start */
    /* Recursive doubling: this agent's value goes back on the same call. */
    rd_reply_t rr = {l, call};
    ps__task_t reply;
    int reply_due = c->ring->rd && !rd_opens(c->ring->nagents, c->ring->pos, from);
    int replying = reply_due && ps__task_start(&reply, rd_reply_main, &rr) == 0;
    if (reply_due && !replying)
        coll_fail(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "%s: no thread for the ring",
                  kind_name(c->kind));
    c->threads++;
    pthread_cond_broadcast(&c->cond);
    pthread_mutex_unlock(&h->lock);

    int ended = ring_receive(l, call);
    if (replying)
        ps__task_join(&reply);

    pthread_mutex_lock(&h->lock);
    l->call = NULL;
    code = c->failed ? c->code : 0;
    snprintf(msg, sizeof(msg), "%s", c->failed ? c->message : "");
    /* A failure cancelled the call (coll_fail): it ends with its status. */
    kept = ended && !c->failed;
    c->threads--;
    coll_retire(j, c);
    c = NULL;
done:
    ring_plan_clear(&plan);
    if (j)
        job_release(j);
    pthread_mutex_unlock(&h->lock);
    if (code)
        PS_LOG(PS_LOG_WARN, "%s", msg);
    if (kept) {
        /* The other agent's end frame answered: the call stays open. */
        grpc_byte_buffer *bb = ps__frame_encode_end(NULL);
        kept = bb && ps__rpc_call_send(call, bb) == 0;
        if (bb)
            grpc_byte_buffer_destroy(bb);
    } else {
        ps__rpc_call_send_status(call, code, code ? msg : "");
    }
    protobuf_c_message_free_unpacked(&meta->base, NULL);
    return kept;
}

/* Works out where m's input and output are and checks them: 0, or -1 with
 * the collective failed (also when it had failed before). */
static int member_prepare(ps__hub_t *h, coll_t *c, member_t *m)
{
    char msg[512];
    member_totals(c, m->index, &m->in_total, &m->out_total);
    if (m->shm) {
        const header_t *mh = m->first->header;
        m->by_file = shm_by_file(h, m->shm, c, mh);
        shm_places(mh, m->in_total, m->out_total, &m->shm_in, &m->shm_out);
    }
    if (c->failed)
        return -1;
    /* Output after the input, or (all_reduce, reduce) over it at 0: those
     * write each step only once it has been reduced. */
    if (m->shm && !shm_holds(m->shm, m->oshm, m->first->header, m->in_total, m->out_total, msg,
                             sizeof(msg))) {
        pthread_mutex_lock(&h->lock);
        coll_fail(c, GRPC_STATUS_INVALID_ARGUMENT, "%s", msg);
        pthread_mutex_unlock(&h->lock);
        return -1;
    }
    if (m->frame.data_len > m->in_total) {
        pthread_mutex_lock(&h->lock);
        coll_fail(c, GRPC_STATUS_INVALID_ARGUMENT,
                  "%s (group %u, seq %" PRIu64 "): rank %d sent more bytes than its count implies",
                  kind_name(c->kind), c->group, c->seq, c->ranks[m->index]);
        pthread_mutex_unlock(&h->lock);
        return -1;
    }
    return 0;
}

/* Whether member m of c puts its input in as it arrives, before the others
 * come, rather than after the last: a collective of one step at this agent
 * (not a ring's) whose input m has in shared memory, where depositing never
 * waits on another rank. Its step is then made by the last deposit, at the
 * last arrival, and the members that came before wake once, to the result,
 * not once to the arrival and again to the result (p - 1 wake-ups fewer per
 * collective; docs/PERFORMANCE.md, "Small collectives: one wake-up per
 * member"). Lock held. */
static int deposits_early(const coll_t *c, const member_t *m)
{
    return c->nsteps == 1 && !c->ring && !c->p2p && m->shm;
}

/* Whether every member that has come deposits early: at the last arrival,
 * then none waits for the arrival, only for the result. Lock held. */
static int all_deposit_early(const coll_t *c)
{
    for (int i = 0; i < c->n; i++)
        if (c->members[i] && !deposits_early(c, c->members[i]))
            return 0;
    return 1;
}

void ps__hub_serve(ps__hub_t *h, ps__rpc_call_t *call, ps__frame_t *first)
{
    char msg[512];
    int code = 0;
    job_t *j = NULL;
    coll_t *c = NULL;
    member_t *m = NULL;
    ring_plan_t plan;
    memset(&plan, 0, sizeof(plan));
    const header_t *hd = first->meta ? first->meta->header : NULL;
    if (!hd) {
        ps__frame_clear(first);
        ps__rpc_call_send_status(call, GRPC_STATUS_INVALID_ARGUMENT,
                                 "the first frame of a collective must carry a header");
        return;
    }
    int64_t timeout = hd->timeout_ms ? (int64_t)hd->timeout_ms : h->cfg->timeout_ms;
    m = member_new(call, first);
    if (!m) {
        ps__frame_clear(first);
        ps__rpc_call_send_status(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    hd = m->first->header;

    pthread_mutex_lock(&h->lock);
    if (h->stopping) {
        code = GRPC_STATUS_UNAVAILABLE;
        snprintf(msg, sizeof(msg), PS_MSG_STOPPING);
        goto fail_locked;
    }
    j = job_get(h, hd, &code, msg, sizeof(msg));
    if (!j)
        goto fail_locked;
    int n = group_size(j, hd->group);
    if ((code = header_check(h->cfg, hd, n, msg, sizeof(msg))) != 0)
        goto fail_locked;
    if (m->first->offset != 0 || (hd->kind == K_RECV && m->frame.data_len)) {
        code = GRPC_STATUS_INVALID_ARGUMENT;
        snprintf(msg, sizeof(msg), "%s (group %u): rank %d: %s", kind_name(hd->kind), hd->group,
                 hd->rank,
                 m->first->offset ? "the first frame's data must start at offset 0"
                                  : "a recv carries no data");
        goto fail_locked;
    }
    if (hd->shm && *hd->shm) {
        const char *why;
        int out_why = 0;
        m->shm = shms_find_own(h, &j->info, hd, &why);
        m->oshm = shms_find_out(h, &j->info, hd, m->shm, &why, &out_why);
        if (!m->oshm || m->frame.data_len || shm_broken(m->shm) || shm_broken(m->oshm)) {
            code = m->oshm && !m->frame.data_len ? GRPC_STATUS_DATA_LOSS
                                                 : GRPC_STATUS_INVALID_ARGUMENT;
            snprintf(msg, sizeof(msg), "%s (group %u): rank %d: %s%s", kind_name(hd->kind),
                     hd->group, hd->rank,
                     out_why && !m->oshm ? "the output's segment (shm_out): " : "",
                     !m->oshm            ? why
                     : m->frame.data_len ? "a collective in shared memory carries no data frames"
                                         : "its shared-memory segment shrank under the agent "
                                           "earlier (truncated?): make a new one");
            m->shm = m->oshm = NULL;
            goto fail_locked;
        }
        shm_ref(m->shm);
        if (m->oshm != m->shm)
            shm_ref(m->oshm);
        ps__metrics_shm_call(m->oshm != m->shm ? PS_M_SHM_TWO : m->shm->kind);
    }

    if (hd->kind == K_SEND || hd->kind == K_RECV) {
        int dst = hd->kind == K_SEND ? hd->peer : hd->rank;
        mailbox_t *mb = mailbox_get(j, hd->group, dst, n);
        if (!mb) {
            code = GRPC_STATUS_RESOURCE_EXHAUSTED;
            snprintf(msg, sizeof(msg), "out of memory");
            goto fail_locked;
        }
        member_t **list = hd->kind == K_SEND ? &mb->sends : &mb->recvs;
        member_t **tail = list;
        while (*tail)
            tail = &(*tail)->next_wait;
        *tail = m;
        mailbox_match(h, j, mb);
        pthread_cond_broadcast(&h->p2p_changed);
        int64_t p2p_end = ps__now_ms() + timeout;
        while (!m->coll) {
            if (ps__rpc_call_peer_cancelled(call, 0) == 1) {
                list_remove(list, m);
                code = GRPC_STATUS_CANCELLED;
                snprintf(msg, sizeof(msg), "%s (group %u): rank %d cancelled its call",
                         kind_name(hd->kind), hd->group, hd->rank);
                goto fail_locked;
            }
            if (h->stopping) {
                list_remove(list, m);
                code = GRPC_STATUS_UNAVAILABLE;
                snprintf(msg, sizeof(msg), PS_MSG_STOPPING);
                goto fail_locked;
            }
            if (m->refused) {
                code = GRPC_STATUS_RESOURCE_EXHAUSTED;
                snprintf(msg, sizeof(msg),
                         m->refused == 1 ? "%s (group %u): this agent's collectives in flight "
                                           "already hold their limit of memory "
                                           "(--max-inflight-bytes); retry later"
                                         : "%s (group %u): out of memory",
                         kind_name(hd->kind), hd->group);
                goto fail_locked;
            }
            int64_t left = p2p_end - ps__now_ms();
            struct timespec slice = abs_ms(
                left < PS_HUB_LIVENESS_CHECK_MS ? (left > 0 ? left : 0) : PS_HUB_LIVENESS_CHECK_MS);
            pthread_cond_timedwait(&h->p2p_changed, &h->lock, &slice);
            if (!m->coll && ps__now_ms() >= p2p_end) {
                list_remove(list, m);
                code = GRPC_STATUS_DEADLINE_EXCEEDED;
                if (hd->kind == K_SEND)
                    snprintf(msg, sizeof(msg),
                             "send from rank %d to rank %d (group %u, tag %u): no matching recv "
                             "within %lld ms",
                             hd->rank, hd->peer, hd->group, hd->tag, (long long)timeout);
                else if (hd->peer >= 0)
                    snprintf(msg, sizeof(msg),
                             "recv at rank %d from rank %d (group %u, tag %u): no matching send "
                             "within %lld ms",
                             hd->rank, hd->peer, hd->group, hd->tag, (long long)timeout);
                else
                    snprintf(msg, sizeof(msg),
                             "recv at rank %d from any rank (group %u, tag %u): no matching send "
                             "within %lld ms",
                             hd->rank, hd->group, hd->tag, (long long)timeout);
                goto fail_locked;
            }
        }
        c = m->coll;
    } else {
        int ring = ring_use(h, j, hd, &plan), made;
        if ((code = coll_get(h, j, hd, ring && ring_split(&plan, hd->kind) ? plan.nlocal : n, ring,
                             ring ? ring_step(h, &plan, hd->kind) : 0, &c, &made, msg,
                             sizeof(msg))) != 0) {
            c = NULL;
            goto fail_locked;
        }
        if (made && ring)
            coll_ring_start(h, c, &plan, timeout);
        int idx = coll_index(c, hd->rank);
        if (idx < 0 || (c->ring != NULL) != ring) {
            /* A rank the ring has on another agent, or ranks that disagree
             * on the kind (one kind runs in a ring, the other at the hub). */
            char who[32];
            int differs;
            snprintf(who, sizeof(who), "rank %d", hd->rank);
            if ((int)hd->kind != c->kind) {
                if (!c->failed)
                    coll_fail(c, GRPC_STATUS_FAILED_PRECONDITION,
                              "collective seq %" PRIu64 " on group %u: rank %d called %s but "
                              "other ranks called %s",
                              hd->seq, hd->group, hd->rank, kind_name(hd->kind),
                              kind_name(c->kind));
                code = c->code;
                snprintf(msg, sizeof(msg), "%s", c->message);
            } else if ((differs =
                            ring_mismatch(c, hd, who, "other ranks have", msg, sizeof(msg))) ||
                       idx >= 0) {
                /* One size runs in a ring, the other at the hub; or the
                 * agents' settings differ (same size, other mode). */
                if (!differs)
                    snprintf(msg, sizeof(msg),
                             "%s (group %u, seq %" PRIu64 "): agents disagree on whether "
                             "it runs in a ring: set --ring, --ring-min-bytes and --step-bytes "
                             "alike on every agent",
                             kind_name(hd->kind), hd->group, hd->seq);
                if (!c->failed)
                    coll_fail(c, GRPC_STATUS_FAILED_PRECONDITION, "%s", msg);
                code = c->code;
                snprintf(msg, sizeof(msg), "%s", c->message);
            } else {
                code = GRPC_STATUS_INVALID_ARGUMENT;
                snprintf(msg, sizeof(msg),
                         "%s (group %u, seq %" PRIu64 "): rank %d joined through another agent "
                         "than this one (%s): call it there",
                         kind_name(hd->kind), hd->group, hd->seq, hd->rank, h->self);
            }
            c = NULL;
            goto fail_locked;
        }
        if (c->members[idx]) {
            /* Not this collective's member: answer this caller alone. */
            code = GRPC_STATUS_ALREADY_EXISTS;
            snprintf(msg, sizeof(msg), "%s (group %u, seq %" PRIu64 "): rank %d called it twice",
                     kind_name(hd->kind), hd->group, hd->seq, hd->rank);
            c = NULL;
            goto fail_locked;
        }
        m->coll = c;
        m->index = idx;
        c->members[idx] = m;
        c->narrived++;
        if (c->narrived == coll_nlocal(c)) {
            coll_widen(h, c);
            int64_t firstms = m->arrival_ms;
            for (int i = 0; i < c->n; i++)
                if (c->members[i] && c->members[i]->arrival_ms < firstms)
                    firstms = c->members[i]->arrival_ms;
            ps__metrics_arrival(c->kind, (double)(m->arrival_ms - firstms) / 1e3, hd->rank);
        }
        member_t *ref = NULL;
        for (int i = 0; i < c->n && !ref; i++)
            if (c->members[i] && c->members[i] != m)
                ref = c->members[i];
        if (ref && header_mismatch(c, ref, hd, hd->rank, msg, sizeof(msg)))
            coll_fail(c, GRPC_STATUS_FAILED_PRECONDITION, "%s", msg);
        else if (!ref && c->ring) {
            char who[32], theirs[300];
            snprintf(who, sizeof(who), "rank %d", hd->rank);
            snprintf(theirs, sizeof(theirs), "the ranks on agent %s have", c->ring->in.addr);
            if (ring_mismatch(c, hd, who, theirs, msg, sizeof(msg)))
                coll_fail(c, GRPC_STATUS_FAILED_PRECONDITION, "%s", msg);
        }
        /* The members that came before wait for the last (wait_arrivals),
         * and so does a ring's token 1 (ring_tok_held): waking them at
         * every arrival woke each of p members up to p - 1 times for
         * nothing. Where they all deposited already (deposits_early), the
         * last one wakes them after its own deposit, which, when it makes
         * the result, wakes them to it: once, not once to the arrival and
         * again to the result (the wake-up after that finds nobody left to
         * wake). */
        int early = deposits_early(c, m), last = c->narrived == coll_nlocal(c);
        int wake_after = last && all_deposit_early(c);
        if ((last && !wake_after) || c->failed)
            pthread_cond_broadcast(&c->cond);
        if (c->failed)
            ps__rpc_call_cancel(call, c->code, c->message);
        if (early && !c->failed) {
            pthread_mutex_unlock(&h->lock);
            if (member_prepare(h, c, m) == 0)
                member_deposit(m);
            m->deposited = 1;
            pthread_mutex_lock(&h->lock);
        }
        if (wake_after)
            pthread_cond_broadcast(&c->cond);
        wait_arrivals(h, c, timeout);
    }
    pthread_mutex_unlock(&h->lock);

    ps__task_t writer;
    int have_writer = 0;
    if (!m->deposited && member_prepare(h, c, m) == 0 && m->out_total > 0 && c->nsteps > 1) {
        have_writer = ps__task_start(&writer, writer_main, m) == 0;
        if (!have_writer) {
            pthread_mutex_lock(&h->lock);
            coll_fail(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "no thread for the collective");
            pthread_mutex_unlock(&h->lock);
        }
    }
    if (!c->failed && !m->deposited)
        member_deposit(m);
    if (have_writer)
        ps__task_join(&writer);
    if (!c->failed) {
        /* The input must end where its count says. */
        grpc_byte_buffer *bb = NULL;
        if (m->frame_pos != m->frame.data_len || ps__rpc_call_recv(call, &bb) < 0 || bb) {
            pthread_mutex_lock(&h->lock);
            coll_fail(c, GRPC_STATUS_INVALID_ARGUMENT,
                      "%s (group %u, seq %" PRIu64
                      "): rank %d sent more input than its count implies",
                      kind_name(c->kind), c->group, c->seq, c->ranks[m->index]);
            pthread_mutex_unlock(&h->lock);
        }
        if (bb)
            grpc_byte_buffer_destroy(bb);
    }
    /* Small collectives end with one batch: result, data and status. */
    int status_sent = !have_writer && !c->failed && member_write(m, 1);
    if (!status_sent && m->shm)
        member_views_wait(m);
    pthread_mutex_lock(&h->lock);
    if (!status_sent) {
        ring_agreed_wait(c);
        shm_broken_check(c);
    }
    m->finished = 1;
    code = c->failed ? c->code : 0;
    ps__metrics_collective_done(m->first->header->kind, code,
                                (double)(ps__now_ms() - m->arrival_ms) / 1e3);
    snprintf(msg, sizeof(msg), "%s", c->failed ? c->message : "");
    c->nfinished++;
    coll_retire(j, c);
    job_release(j);
    pthread_mutex_unlock(&h->lock);
    ring_plan_clear(&plan);
    if (!status_sent)
        ps__rpc_call_send_status(call, code, msg);
    return;

fail_locked:
    ps__metrics_event(code == GRPC_STATUS_DEADLINE_EXCEEDED ? PS_M_EV_TIMEOUT : PS_M_EV_REJECTED);
    ps__metrics_collective_done(m->first->header->kind, code,
                                (double)(ps__now_ms() - m->arrival_ms) / 1e3);
    if (j)
        job_release(j);
    pthread_mutex_unlock(&h->lock);
    ring_plan_clear(&plan);
    PS_LOG(PS_LOG_WARN, "%s", msg);
    ps__rpc_call_send_status(call, code, msg);
    member_free(m);
}

int ps__hub_create(const ps__config_t *cfg, const char *self, ps__job_lookup_fn lookup,
                   ps__ring_open_fn ring_open, ps__ring_keep_fn ring_keep, ps__serve_fn serve,
                   void *arg, ps__hub_t **out)
{
    ps__hub_t *h = calloc(1, sizeof(*h));
    if (!h || !(h->self = strdup(self))) {
        free(h);
        return PS_ENOMEM;
    }
    h->cfg = cfg;
    h->lookup = lookup;
    h->ring_open = ring_open;
    h->ring_keep = ring_keep;
    h->serve = serve;
    h->lookup_arg = arg;
    pthread_mutex_init(&h->lock, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&h->p2p_changed, &ca);
    pthread_condattr_destroy(&ca);
    *out = h;
    return 0;
}

static ps_doorbell_ctl_t *doorbell_ctl(const shm_map_t *m)
{
    return (ps_doorbell_ctl_t *)(void *)(m->base + PS_DOORBELL_CTL);
}

/* Tells a doorbell segment's thread, and its worker, that it is closed. */
static void doorbell_close(shm_map_t *m)
{
    __atomic_store_n(&m->closing, 1, __ATOMIC_RELEASE);
    ps_doorbell_ctl_t *ctl = doorbell_ctl(m);
    __atomic_fetch_or(&ctl->closed, PS_DOORBELL_CLOSED, __ATOMIC_RELEASE);
    ps_doorbell_futex(&ctl->req, FUTEX_WAKE, INT32_MAX, NULL);
    ps_doorbell_futex(&ctl->resp, FUTEX_WAKE, INT32_MAX, NULL);
}

/* Closes every doorbell (the agent is stopping). Lock held. */
static void doorbells_close(ps__hub_t *h)
{
    for (shm_map_t *sm = h->shms; sm; sm = sm->next)
        if (sm->kind == PS_SHM_DOORBELL)
            doorbell_close(sm);
}

/* Drops the job's segments of `rank` (every rank when negative) from the
 * agent's list, doorbells or payload segments (of `slot`, when not
 * negative) or (kind < 0) all, except the newest `keep` of them; each goes
 * once no collective uses it. Lock held. */
static void shms_drop(ps__hub_t *h, const char *job, int rank, int kind, int slot, int keep)
{
    /* The list is newest first. */
    for (shm_map_t **p = &h->shms; *p;) {
        shm_map_t *sm = *p;
        if (strcmp(sm->job, job) == 0 && (rank < 0 || sm->rank == rank) &&
            (kind < 0 || sm->kind == kind) && (slot < 0 || sm->slot == slot) && keep-- <= 0) {
            *p = sm->next;
            if (sm->kind == PS_SHM_DOORBELL)
                doorbell_close(sm);
            shm_unref(sm);
        } else {
            p = &sm->next;
        }
    }
}

/* Answers one request rung on a doorbell: serves it as a Collective call
 * whose first frame is the packed header, through a local call. */
static void doorbell_serve(ps__hub_t *h, shm_map_t *map)
{
    ps_doorbell_ctl_t *ctl = doorbell_ctl(map);
    uint32_t len = ctl->header_len;
    header_t *hd = len <= PS_DOORBELL_HEADER
                       ? paramsync__v1__collective_header__unpack(NULL, len, ctl->header)
                       : NULL;
    int code = GRPC_STATUS_INVALID_ARGUMENT;
    char *msg = NULL;
    grpc_byte_buffer *bb = NULL;
    Paramsync__V1__Frame *meta = malloc(sizeof(*meta));
    ps__rpc_call_t *call = NULL;
    if (!hd || !meta) {
        msg = strdup(hd ? "out of memory" : "a malformed header on the doorbell");
        code = hd ? GRPC_STATUS_RESOURCE_EXHAUSTED : code;
    } else if (strcmp(hd->job, map->job) != 0) {
        /* The segment it names is checked as any call's: attached here, by the
         * rank the header names (shms_find_own). */
        msg = strdup("a doorbell request must name the doorbell's own job");
    } else if (ps__rpc_call_local(&call) < 0) {
        msg = strdup("out of memory");
        code = GRPC_STATUS_RESOURCE_EXHAUSTED;
    } else {
        paramsync__v1__frame__init(meta);
        meta->header = hd;
        ps__frame_t first;
        memset(&first, 0, sizeof(first));
        first.meta = meta;
        meta = NULL; /* the hub takes the frame, header and all */
        hd = NULL;
        /* here, or forwarded to the job's hub */
        h->serve(h->lookup_arg, call, &first, &map->serve_state);
        code = ps__rpc_call_local_outcome(call, &msg, &bb);
    }
    ctl->source = -1;
    ctl->shm = 0;
    ps__frame_t f;
    memset(&f, 0, sizeof(f));
    if (bb && ps__frame_decode(bb, &f) == 0 && f.meta->result) {
        ctl->source = f.meta->result->source;
        ctl->shm = f.meta->result->shm;
    }
    ps__frame_clear(&f);
    size_t n = msg ? strlen(msg) : 0;
    if (n >= sizeof(ctl->message))
        n = sizeof(ctl->message) - 1;
    memcpy(ctl->message, msg ? msg : "", n);
    ctl->message[n] = 0;
    ctl->code = code;
    if (bb)
        grpc_byte_buffer_destroy(bb);
    free(msg);
    free(meta);
    if (hd)
        protobuf_c_message_free_unpacked(&hd->base, NULL);
    ps__rpc_call_destroy(call);
}

/* One thread per doorbell segment (a kept one, ps__task_run): waits for the
 * worker's requests and answers each, until the segment is dropped (the
 * worker left) or the agent stops. */
typedef struct doorbell_arg {
    ps__hub_t *h;
    shm_map_t *map; /* referenced by the thread */
} doorbell_arg_t;

static void *doorbell_main(void *arg)
{
    doorbell_arg_t *d = arg;
    ps__hub_t *h = d->h;
    shm_map_t *map = d->map;
    free(d);
    ps_doorbell_ctl_t *ctl = doorbell_ctl(map);
    /* The words were zeroed at attach; the worker may ring before this
     * thread runs, so request 1 is the first to serve whatever req says now. */
    uint32_t seen = 0;
    while (!__atomic_load_n(&map->closing, __ATOMIC_ACQUIRE) && !shm_broken(map)) {
        uint32_t req = __atomic_load_n(&ctl->req, __ATOMIC_ACQUIRE);
        if (req == seen) {
            /* Woken by a ring or by doorbell_close; the timeout is a backstop. */
            struct timespec slice = {1, 0};
            ps_doorbell_futex(&ctl->req, FUTEX_WAIT, seen, &slice);
            continue;
        }
        seen = req;
        doorbell_serve(h, map);
        __atomic_store_n(&ctl->resp, req, __ATOMIC_RELEASE);
        ps_doorbell_futex(&ctl->resp, FUTEX_WAKE, INT32_MAX, NULL);
    }
    /* Nothing more is served here, so nothing more is written into a
     * worker's buffers for this doorbell: a direct request may let go. */
    __atomic_fetch_or(&ctl->closed, PS_DOORBELL_CLOSED | PS_DOORBELL_STOPPED, __ATOMIC_RELEASE);
    ps_doorbell_futex(&ctl->resp, FUTEX_WAKE, INT32_MAX, NULL);
    if (map->serve_state)
        h->serve(h->lookup_arg, NULL, NULL, &map->serve_state);
    shm_unref(map);
    pthread_mutex_lock(&h->lock);
    h->helpers--;
    pthread_cond_broadcast(&h->p2p_changed);
    pthread_mutex_unlock(&h->lock);
    return NULL;
}

/*
 * A process segment stands for its worker's memory, which the agent then
 * reads and writes with process_vm_readv/writev. Before it does, it makes
 * sure the pid the worker gave is the worker: that process maps this very
 * segment (device and inode, in /proc/PID/maps) at the address given, and
 * reading that address there gives the segment's magic bytes. So a worker
 * cannot point the agent at another process's memory (it would have to map
 * that process's segment), and an agent in another PID namespace, or one the
 * kernel does not let read the worker (ptrace rules: Yama, capabilities,
 * another user), finds out here and says why; the worker then copies
 * through payload segments as before. 0, or -1 with the reason.
 */
static int process_check(int pid, uint64_t address, int fd, const uint8_t *base, char *reason,
                         size_t rlen)
{
    struct stat st;
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/maps", pid);
    FILE *f = pid > 0 && fstat(fd, &st) == 0 ? fopen(path, "re") : NULL;
    if (!f) {
        snprintf(reason, rlen,
                 "process %d: its memory map is not readable here (%s): another PID namespace "
                 "(container) or user?",
                 pid, pid > 0 ? strerror(errno) : "no pid given");
        return -1;
    }
    char line[512];
    int found = 0;
    while (!found && fgets(line, sizeof(line), f)) {
        unsigned long long start, ino;
        unsigned maj, min;
        found = sscanf(line, "%llx-%*x %*s %*x %x:%x %llu", &start, &maj, &min, &ino) == 4 &&
                start == address && ino == (unsigned long long)st.st_ino &&
                maj == major(st.st_dev) && min == minor(st.st_dev);
        /* The rest of a line longer than the buffer is not a new line. */
        while (!strchr(line, '\n') && fgets(line, sizeof(line), f))
            ;
    }
    fclose(f);
    if (!found) {
        snprintf(reason, rlen,
                 "process %d does not map the segment at 0x%" PRIx64
                 ": not the caller (another PID namespace?)",
                 pid, address);
        return -1;
    }
    uint64_t seen = 0;
    struct iovec local = {&seen, sizeof(seen)}, remote = {(void *)(uintptr_t)address, sizeof(seen)};
    ssize_t n = process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (n != (ssize_t)sizeof(seen) || memcmp(&seen, base, sizeof(seen)) != 0) {
        snprintf(reason, rlen,
                 "the agent may not read process %d's memory (%s): ptrace rules (Yama "
                 "ptrace_scope, capabilities, another user)?",
                 pid, n < 0 ? strerror(errno) : "other bytes than the segment's");
        return -1;
    }
    return 0;
}

/* Registers a payload or registered segment with CUDA when the agent
 * reduces there, so the stager moves its bytes by DMA without staging them
 * through the CPU. Pinning costs a touch of every page, once per segment;
 * memory CUDA will not pin (the locked-memory limit, say) stays pageable
 * and is staged. */
static void shm_pin(shm_map_t *sm)
{
    static atomic_int warned;
    int rc = ps_gpu_host_register(sm->base, sm->map_len);
    sm->pinned = rc == 0;
    if (rc == 0) {
        ps__metrics_pinned(PS_M_PIN_SEGMENTS, (int64_t)sm->map_len);
        ps__log(PS_LOG_INFO, "segment %s (rank %d): %zu bytes pinned for CUDA", sm->name, sm->rank,
                sm->map_len);
    } else if (!atomic_exchange(&warned, 1))
        ps__log(PS_LOG_WARN,
                "segment %s (rank %d): pinning %zu bytes for CUDA failed (%s): segments are "
                "staged through the CPU (raise the locked-memory limit, ulimit -l?)",
                sm->name, sm->rank, sm->map_len, ps_strerror(rc));
}

int ps__hub_shm_attach(ps__hub_t *h, const char *job, int rank, const char *name, uint64_t size,
                       uint64_t magic, int kind, int slot, int pid, uint64_t address, char *reason,
                       size_t rlen)
{
    int doorbell = kind == PS_SHM_DOORBELL;
    if (slot < 0 || slot >= PS_HUB_PAYLOAD_SLOTS || (slot && kind != PS_SHM_PAYLOAD)) {
        snprintf(reason, rlen, "slot %d: payload segments take slots 0 to %d, other kinds none",
                 slot, PS_HUB_PAYLOAD_SLOTS - 1);
        return 0;
    }
    /* Names are POSIX shm names: one leading slash, no other. */
    if (!name || name[0] != '/' || strchr(name + 1, '/') || strlen(name) > 200 || size < 8 ||
        size > h->cfg->max_tensor_bytes * 2 + 4096 || (doorbell && size != PS_DOORBELL_SIZE)) {
        snprintf(reason, rlen, "bad segment name or size");
        return 0;
    }
    int fd = shm_open(name, O_RDWR, 0);
    if (fd < 0) {
        snprintf(reason, rlen,
                 "segment %s is not visible to the agent (%s): another host or "
                 "container?",
                 name, strerror(errno));
        return 0;
    }
    struct stat st;
    uint8_t *base = MAP_FAILED;
    if (fstat(fd, &st) == 0 && (uint64_t)st.st_size >= size)
        base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    uint64_t seen = 0;
    if (base != MAP_FAILED)
        memcpy(&seen, base, sizeof(seen));
    if (base == MAP_FAILED || seen != magic) {
        if (base != MAP_FAILED)
            munmap(base, size);
        close(fd);
        snprintf(reason, rlen, "segment %s is %s", name,
                 base == MAP_FAILED ? "smaller than announced"
                                    : "not the caller's (magic differs)");
        return 0;
    }
    if (kind == PS_SHM_PROCESS && process_check(pid, address, fd, base, reason, rlen) < 0) {
        munmap(base, size);
        close(fd);
        return 0;
    }
    /* From here the mapping keeps the memory; the name can go, so nothing
     * is left in /dev/shm when either side dies. */
    shm_unlink(name);
    shm_map_t *sm = calloc(1, sizeof(*sm));
    if (!sm || !(sm->name = strdup(name)) || !(sm->job = strdup(job))) {
        if (sm)
            free(sm->name);
        free(sm);
        munmap(base, size);
        close(fd);
        snprintf(reason, rlen, "out of memory");
        return 0;
    }
    sm->guard = -1;
    sm->rank = rank;
    int filed = kind == PS_SHM_PAYLOAD || kind == PS_SHM_REGISTERED;
    sm->fd = filed ? fd : -1; /* payloads may go through the file (seg_io) */
    if (!filed)
        close(fd);
    sm->base = base;
    sm->map_len = size;
    /* Payloads may not reach a doorbell's control words; a process
     * segment's are in the worker's memory, not in it. */
    sm->size = doorbell ? PS_DOORBELL_CTL : kind == PS_SHM_PROCESS ? 0 : size;
    sm->pid = kind == PS_SHM_PROCESS ? pid : 0;
    sm->kind = kind;
    sm->slot = slot;
    sm->refs = 1;
    if ((sm->guard = guard_add(base, size)) < 0) {
        snprintf(reason, rlen, "the agent maps its most segments (%d) already", PS_HUB_GUARDS);
        shm_unref(sm);
        return 0;
    }
    if (filed && h->cfg->reduce_cuda)
        shm_pin(sm);
    doorbell_arg_t *d = NULL;
    if (doorbell) {
        memset(doorbell_ctl(sm), 0, sizeof(ps_doorbell_ctl_t));
        d = malloc(sizeof(*d));
    }
    pthread_mutex_lock(&h->lock);
    int registered = 0;
    for (shm_map_t *o = h->shms; o; o = o->next)
        registered += o->kind == PS_SHM_REGISTERED && o->rank == rank && strcmp(o->job, job) == 0;
    if (kind == PS_SHM_REGISTERED && registered >= PS_HUB_MAX_REGISTERED) {
        pthread_mutex_unlock(&h->lock);
        snprintf(reason, rlen,
                 "rank %d already has %d registered segments on this agent (the most it keeps; "
                 "free some with ps_mem_free)",
                 rank, registered);
        free(d);
        shm_unref(sm);
        return 0;
    }
    /* A rank has one payload segment per slot: a new one (the client grew
     * it) replaces its slot's old one, which goes once the collectives
     * using it are done. Doorbells stay side by side up to PS_HUB_DOORBELLS
     * (the client makes one for each collective in flight at once, and
     * knows the limit); past it the oldest goes, as the one doorbell of
     * agents before the limit did. Registered segments stay side by side
     * until detached. */
    if (kind != PS_SHM_REGISTERED)
        shms_drop(h, job, rank, kind, doorbell ? -1 : slot, doorbell ? PS_HUB_DOORBELLS - 1 : 0);
    sm->next = h->shms;
    h->shms = sm;
    int ok = !doorbell || (d && !h->stopping);
    if (ok && doorbell) {
        d->h = h;
        d->map = sm;
        shm_ref(sm); /* the thread's */
        if (ps__task_run(doorbell_main, d) == 0) {
            h->helpers++;
            d = NULL;
        } else {
            shm_unref(sm);
            ok = 0;
        }
    }
    free(d);
    if (!ok) {
        /* Only the new one: it is first in the list. */
        h->shms = sm->next;
        if (doorbell)
            doorbell_close(sm);
        shm_unref(sm);
        snprintf(reason, rlen, "%s", h->stopping ? "the agent is stopping" : "no thread");
    }
    pthread_mutex_unlock(&h->lock);
    if (!ok)
        return 0;
    return 1;
}

int ps__hub_shm_detach(ps__hub_t *h, const char *job, int rank, const char *name)
{
    int found = 0;
    pthread_mutex_lock(&h->lock);
    for (shm_map_t **p = &h->shms; *p; p = &(*p)->next) {
        shm_map_t *sm = *p;
        if (sm->kind == PS_SHM_REGISTERED && sm->rank == rank && strcmp(sm->name, name) == 0 &&
            strcmp(sm->job, job) == 0) {
            *p = sm->next;
            shm_unref(sm); /* unmapped once no collective uses it */
            found = 1;
            break;
        }
    }
    pthread_mutex_unlock(&h->lock);
    return found;
}

int ps__hub_rank_here(ps__hub_t *h, const char *job, int rank)
{
    header_t hd = PARAMSYNC__V1__COLLECTIVE_HEADER__INIT;
    hd.job = (char *)job;
    char msg[256];
    int code, here = 0;
    pthread_mutex_lock(&h->lock);
    job_t *j = job_get(h, &hd, &code, msg, sizeof(msg));
    if (j) {
        here = j->info.rank_agents && rank >= 0 && rank < j->info.world_size &&
               strcmp(j->info.rank_agents[rank], h->self) == 0;
        job_release(j);
    }
    pthread_mutex_unlock(&h->lock);
    return here;
}

int ps__hub_shm_io_open(ps__hub_t *h, const header_t *hd, ps__shm_io_t *io, char *msg, size_t len)
{
    memset(io, 0, sizeof(*io));
    int code = 0;
    pthread_mutex_lock(&h->lock);
    job_t *j = job_get(h, hd, &code, msg, len);
    int n = j ? group_size(j, hd->group) : -1;
    shm_map_t *map = NULL, *om = NULL;
    const char *why;
    int out_why = 0;
    if (j && (code = header_check(h->cfg, hd, n, msg, len)) == 0 &&
        !(om = shms_find_out(h, &j->info, hd, map = shms_find_own(h, &j->info, hd, &why), &why,
                             &out_why))) {
        code = GRPC_STATUS_INVALID_ARGUMENT;
        snprintf(msg, len, "%s (group %u): rank %d: %s%s", kind_name(hd->kind), hd->group, hd->rank,
                 out_why ? "the output's segment (shm_out): " : "", why);
        map = NULL;
    }
    if (map) {
        /* The payload sizes of the member, as the hub will see them. */
        coll_t c;
        memset(&c, 0, sizeof(c));
        c.kind = hd->kind == K_SEND || hd->kind == K_RECV ? K_SEND : (coll_kind_t)hd->kind;
        c.root = hd->root;
        c.n = n;
        c.block = hd->count * ps_dtype_size((ps_dtype_t)hd->dtype);
        member_totals(&c,
                      hd->kind == K_SEND   ? 0
                      : hd->kind == K_RECV ? 1
                                           : hd->rank,
                      &io->in_total, &io->out_total);
        if (!shm_holds(map, om, hd, io->in_total, io->out_total, msg, len)) {
            code = GRPC_STATUS_INVALID_ARGUMENT;
        } else {
            shm_ref(map);
            if (om != map)
                shm_ref(om);
            io->map = map;
            io->out_map = om;
            ps__metrics_shm_call(om != map ? PS_M_SHM_TWO : map->kind);
            io->by_file = shm_by_file(h, map, &c, hd);
            shm_places(hd, io->in_total, io->out_total, &io->in, &io->out);
        }
    }
    if (j)
        job_release(j);
    pthread_mutex_unlock(&h->lock);
    return code;
}

grpc_byte_buffer *ps__hub_shm_io_frame(ps__shm_io_t *io, const header_t *hd, uint64_t off,
                                       size_t len)
{
    shm_map_t *map = io->map;
    blob_t *b = io->by_file ? blob_new(len) : blob_view(map, map->base + io->in.at + off, len);
    if (b && io->by_file && seg_io(map, 0, b->data, len, &io->in, off) < 0) {
        blob_unref(b);
        return NULL;
    }
    if (b)
        ps__metrics_shm_bytes(PS_M_RX, shm_access(map, io->by_file), len);
    return b ? ps__frame_encode(hd, NULL, off, b->data, len, blob_unref, b) : NULL;
}

int ps__hub_shm_io_put(ps__shm_io_t *io, const ps__frame_t *f)
{
    uint64_t off = f->meta->offset;
    if (off > io->out_total || f->data_len > io->out_total - off)
        return PS_EINVAL;
    shm_map_t *map = io->out_map;
    int rc;
    struct iovec iov[PS_HUB_FRAME_IOV];
    int n;
    if (!io->by_file) {
        rc = ps__frame_copy_data(f, 0, map->base + io->out.at + off, f->data_len);
    } else if ((n = ps__frame_data_iov(f, iov, PS_HUB_FRAME_IOV)) >= 0) {
        /* Straight from the received slices into the file or the worker's
         * memory: one copy, and the segment's pages stay out of this
         * agent's resident set. */
        rc = seg_iov(map, 1, iov, n, &io->out, off) < 0 ? PS_EINTERNAL : 0;
    } else {
        /* A frame in more pieces than that: through a buffer of one frame. */
        uint8_t *buf = malloc(f->data_len ? f->data_len : 1);
        rc = !buf ? PS_ENOMEM : ps__frame_copy_data(f, 0, buf, f->data_len);
        if (rc == 0)
            rc = seg_io(map, 1, buf, f->data_len, &io->out, off) < 0 ? PS_EINTERNAL : 0;
        free(buf);
    }
    if (rc == 0)
        ps__metrics_shm_bytes(PS_M_TX, shm_access(map, io->by_file), f->data_len);
    return rc;
}

int ps__hub_shm_io_broken(const ps__shm_io_t *io)
{
    return shm_broken(io->map) || shm_broken(io->out_map);
}

void ps__hub_shm_io_close(ps__shm_io_t *io)
{
    if (io->out_map && io->out_map != io->map)
        shm_unref(io->out_map);
    if (io->map)
        shm_unref(io->map);
    memset(io, 0, sizeof(*io));
}

void ps__hub_shm_release(ps__hub_t *h, const char *job, int rank)
{
    pthread_mutex_lock(&h->lock);
    shms_drop(h, job, rank, -1, -1, 0);
    pthread_mutex_unlock(&h->lock);
}

void ps__hub_job_abort(ps__hub_t *h, const char *job, int code, const char *message)
{
    pthread_mutex_lock(&h->lock);
    for (job_t **p = &h->jobs; *p;) {
        job_t *j = *p;
        if (strcmp(j->name, job) != 0) {
            p = &j->next;
            continue;
        }
        for (coll_t *c = j->colls; c; c = c->next)
            coll_fail(c, code, "%s", message);
        /* The next collective asks the coordinator afresh. */
        *p = j->next;
        j->next = NULL;
        j->stale = 1;
        if (j->refs == 0)
            job_free(j);
    }
    pthread_mutex_unlock(&h->lock);
}

double ps__hub_longest_wait(void *arg)
{
    ps__hub_t *h = arg;
    int64_t now = ps__now_ms(), oldest = now;
    pthread_mutex_lock(&h->lock);
    for (job_t *j = h->jobs; j; j = j->next)
        for (coll_t *c = j->colls; c; c = c->next)
            if (!c->failed && c->narrived < coll_nlocal(c))
                for (int i = 0; i < c->n; i++)
                    if (c->members[i] && c->members[i]->arrival_ms < oldest)
                        oldest = c->members[i]->arrival_ms;
    pthread_mutex_unlock(&h->lock);
    return (double)(now - oldest) / 1e3;
}

void ps__hub_drain(ps__hub_t *h)
{
    pthread_mutex_lock(&h->lock);
    h->stopping = 1;
    doorbells_close(h);
    for (job_t *j = h->jobs; j; j = j->next)
        for (coll_t *c = j->colls; c; c = c->next)
            coll_fail(c, GRPC_STATUS_UNAVAILABLE, PS_MSG_STOPPING ": the collective was stopped");
    pthread_cond_broadcast(&h->p2p_changed);
    pthread_mutex_unlock(&h->lock);
}

void ps__hub_destroy(ps__hub_t *h)
{
    if (!h)
        return;
    /* Ring senders end once their collective has failed, doorbell threads
     * once their segment is closed (ps__hub_drain). */
    pthread_mutex_lock(&h->lock);
    doorbells_close(h);
    while (h->helpers > 0)
        pthread_cond_wait(&h->p2p_changed, &h->lock);
    pthread_mutex_unlock(&h->lock);
    while (h->shms) {
        shm_map_t *sm = h->shms;
        h->shms = sm->next;
        shm_unref(sm);
    }
    while (h->jobs) {
        job_t *j = h->jobs;
        h->jobs = j->next;
        job_free(j);
    }
    pthread_cond_destroy(&h->p2p_changed);
    pthread_mutex_destroy(&h->lock);
    free(h->self);
    free(h);
}

/* ---- status ---- */

static int append_int(int32_t **arr, size_t *n, int v)
{
    int32_t *na = realloc(*arr, (*n + 1) * sizeof(int32_t));
    if (!na)
        return PS_ENOMEM;
    na[(*n)++] = v;
    *arr = na;
    return 0;
}

static Paramsync__V1__InFlightCollective *status_entry(Paramsync__V1__StatusResponse *resp,
                                                       const char *job)
{
    Paramsync__V1__InFlightCollective **arr =
        realloc(resp->collectives, (resp->n_collectives + 1) * sizeof(*arr));
    if (!arr)
        return NULL;
    resp->collectives = arr;
    Paramsync__V1__InFlightCollective *e = malloc(sizeof(*e));
    if (!e)
        return NULL;
    paramsync__v1__in_flight_collective__init(e);
    e->job = strdup(job);
    if (!e->job) {
        free(e);
        return NULL;
    }
    arr[resp->n_collectives++] = e;
    return e;
}

static int status_set_text(char **field, const char *text)
{
    char *t = strdup(text);
    if (!t)
        return PS_ENOMEM;
    *field = t;
    return 0;
}

int ps__hub_status(ps__hub_t *h, const char *job, Paramsync__V1__StatusResponse *resp)
{
    int rc = 0;
    int64_t now = ps__now_ms();
    pthread_mutex_lock(&h->lock);
    for (job_t *j = h->jobs; j && rc == 0; j = j->next) {
        if (job && *job && strcmp(job, j->name) != 0)
            continue;
        for (coll_t *c = j->colls; c && rc == 0; c = c->next) {
            Paramsync__V1__InFlightCollective *e = status_entry(resp, j->name);
            if (!e) {
                rc = PS_ENOMEM;
                break;
            }
            e->group = c->group;
            e->seq = c->seq;
            e->kind = c->p2p ? K_SEND : c->kind;
            e->group_size = c->p2p || c->ring ? group_size(j, c->group) : c->n;
            e->count = c->count;
            e->dtype = c->dtype;
            int64_t first = now;
            for (int i = 0; i < c->n && rc == 0; i++) {
                member_t *m = c->members[i];
                if (!coll_serves(c, i))
                    continue; /* another agent says where it is */
                if (m && m->arrival_ms < first)
                    first = m->arrival_ms;
                rc = m ? append_int(&e->arrived, &e->n_arrived, c->ranks[i])
                       : append_int(&e->waiting_for, &e->n_waiting_for, c->ranks[i]);
            }
            e->waiting_seconds = (double)(now - first) / 1e3;
            rc = rc ? rc
                    : status_set_text(&e->state, c->failed                      ? "failed"
                                                 : c->narrived < coll_nlocal(c) ? "arriving"
                                                                                : "running");
            if (rc == 0 && c->failed)
                rc = status_set_text(&e->message, c->message);
        }
        for (mailbox_t *mb = j->mailboxes; mb && rc == 0; mb = mb->next) {
            for (int list = 0; list < 2 && rc == 0; list++)
                for (member_t *m = list ? mb->recvs : mb->sends; m && rc == 0; m = m->next_wait) {
                    const header_t *hd = m->first->header;
                    Paramsync__V1__InFlightCollective *e = status_entry(resp, j->name);
                    if (!e) {
                        rc = PS_ENOMEM;
                        break;
                    }
                    e->group = hd->group;
                    e->seq = hd->seq;
                    e->kind = hd->kind;
                    e->group_size = group_size(j, hd->group);
                    e->count = hd->count;
                    e->dtype = hd->dtype;
                    e->waiting_seconds = (double)(now - m->arrival_ms) / 1e3;
                    rc = append_int(&e->arrived, &e->n_arrived, hd->rank);
                    if (rc == 0 && hd->peer >= 0)
                        rc = append_int(&e->waiting_for, &e->n_waiting_for, hd->peer);
                    if (rc == 0)
                        rc = status_set_text(&e->state, "unmatched");
                }
        }
    }
    pthread_mutex_unlock(&h->lock);
    return rc;
}
