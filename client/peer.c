/*
 * Peer copies: large all_to_all, all_gather, gather and scatter calls whose
 * ranks all share one agent copy each block once, rank to rank, with
 * process_vm_readv (a gather's root reads every rank's input, a scatter's
 * ranks their block of the root's).
 *
 * Through the agent, a block from a worker's own buffer costs two copies:
 * the agent reads it from the sender (process_vm_readv) and writes it to
 * the receiver (process_vm_writev), all of them on the agent's threads.
 * Here each rank reads its blocks straight from the other ranks' buffers
 * into its output, one copy, the ranks side by side:
 *
 *   1. an all_gather of each rank's descriptor (its pid, PID namespace,
 *      where its input's blocks and its nonce are): seq s;
 *   2. if every rank may be read (same PID namespace, buffers that fit),
 *      each reads its blocks from the others, checking in the same system
 *      call that the process it reads holds that rank's nonce (a random
 *      number a wrong process would not have at that address);
 *   3. an all_reduce (MAX) of each rank's outcome: seq s + 1. No rank
 *      returns, and so none touches its input, before every rank has read.
 *
 * If any rank could not read (another PID namespace, ptrace rules, a bad
 * address), every rank learns it from step 3 and the call goes through the
 * agent as before, with seq s + 2 (or s + 1 when step 1 already showed it
 * could not be done). Every rank decides alike from what all of them sent,
 * and before it takes a sequence number, from JoinEvent.peer_sets, whether
 * a call takes this path at all: the daemon matches calls by (group, seq)
 * and needs no numbers in order, so the unused ones are simply skipped.
 *
 * Device peer copies: when every rank's input is CUDA device memory (and
 * PARAMSYNC_CUDA_IPC is not 0), the descriptors also carry the CUDA IPC
 * handle of the allocation each input lies in. A rank opens the others'
 * (once: the mappings are kept for later calls, PS__IPC_MAPS, 32, at most) and copies its
 * blocks device to device, into a device or host output; nothing crosses
 * host memory, and the client stages nothing (device.c). Each rank waits
 * for the work before its call on the legacy default stream (and so on
 * blocking streams) before step 1, and for its copies before step 3. A mix
 * of device and host inputs, or a handle a rank cannot open, sends the call
 * through the agent as above, the device buffers staged only then.
 */
#include "internal.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#define K(x) PARAMSYNC__V1__COLLECTIVE_KIND__##x

/* All the blocks of a call (a block's bytes times the group's size) below
 * these go through the agent: there the two small collectives cost more
 * than the copy they save (measured here with 2 and 4 ranks: level at
 * 1 MiB, all_to_all ahead from 2 MiB, all_gather and scatter from 4,
 * gather from 8; docs/PERFORMANCE.md, "Peer copies"). */
#define PEER_MIN_ALL_TO_ALL ((size_t)2 << 20)
#define PEER_MIN_ALL_GATHER ((size_t)4 << 20)
#define PEER_MIN_GATHER     ((size_t)8 << 20)
#define PEER_MIN_SCATTER    ((size_t)4 << 20)

/* An all_to_all's (or scatter's) descriptors name every block: n^2 words in
 * all. Past this many ranks (on one host) they would outweigh the blocks. */
#define PEER_MAX_ALL_TO_ALL_RANKS 64

#define PEER_MAGIC UINT64_C(0x3270656572737370) /* "pssreep2" */

/*
 * What each rank tells the others (step 1), as 64-bit words in this host's
 * byte order (all ranks run on one machine); the Python client writes the
 * same (paramsync/_peer.py):
 *
 *   0 PEER_MAGIC      1 the device and 2 the inode of its PID namespace
 *   3 the address of its nonce and 4 the nonce
 *   5 its pid (low 32 bits), whether its buffers suit peer copies (bit 32:
 *     no overlap between input and output, but an all_gather's own block;
 *     neither in memory from ps_mem_alloc that the agent would copy in
 *     place) and whether its input is CUDA device memory that the others
 *     may open (bit 33: device peer copies)
 *   6 and 7, with bit 33: where the device allocation the input lies in
 *     starts in this process, and its bytes; 8..15 its CUDA IPC handle
 *   6, 7 and 8, with bit 34 (host memory from ps_mem_alloc, which the C
 *     client keeps a file open for): where the segment the input lies in
 *     starts in this process, its bytes, and the number of that file here:
 *     the others map it (pidfd_getfd) and copy from the mapping instead of
 *     process_vm_readv, which pins shared pages one by one; clients that do
 *     not know the bit read as before, and write 0 there
 *   16.. where its input's blocks are: an all_to_all's block for rank j in
 *     word 16 + j (a list of buffers need not lie end to end), an
 *     all_gather's one block in word 16
 */
enum {
    W_MAGIC,
    W_PIDNS_DEV,
    W_PIDNS_INO,
    W_NONCE_ADDR,
    W_NONCE,
    W_PID_FITS,
    W_DEV, /* PS__IPC_WORDS: the input's device allocation */
    W_BLOCKS = W_DEV + PS__IPC_WORDS,
    /* with FITS_SEGMENT, in the device words */
    W_SEG_BASE = W_DEV,
    W_SEG_SIZE,
    W_SEG_FD
};
#define FITS_HOST    (UINT64_C(1) << 32)
#define FITS_DEVICE  (UINT64_C(1) << 33)
#define FITS_SEGMENT (UINT64_C(1) << 34)

/* Whether each rank's input holds a block for every rank (all_to_all, a
 * scatter's root) rather than one (all_gather, gather). */
static int blocks_per_rank(const ps__coll_t *c)
{
    return c->hdr.kind == K(ALL_TO_ALL) || c->hdr.kind == K(SCATTER);
}

/* Words of one rank's descriptor for c. */
static size_t desc_words(const ps__coll_t *c)
{
    if (ps__devcoll_kind(c))
        return ps__devcoll_words();
    return W_BLOCKS + (blocks_per_rank(c) ? (size_t)c->group->size : 1);
}

/* Bytes of one block: what one rank sends one other. */
static size_t block_bytes(const ps__coll_t *c)
{
    return (size_t)c->hdr.count * ps_dtype_size((ps_dtype_t)c->hdr.dtype);
}

int ps__peer_wanted(ps_comm_t *comm)
{
    const char *peer = getenv("PARAMSYNC_PEER_COPY");
    struct stat st;
    if (ps__shm_off() || (peer && strcmp(peer, "0") == 0) || stat("/proc/self/ns/pid", &st) != 0)
        return 0;
    /* Under Yama's ptrace_scope 1 a process reads only its descendants
     * (unless it holds CAP_SYS_PTRACE): every peer copy would fail, and each
     * call would pay for finding out. */
    FILE *f = fopen("/proc/sys/kernel/yama/ptrace_scope", "re");
    int scope = 0;
    if (f) {
        if (fscanf(f, "%d", &scope) != 1)
            scope = 1;
        fclose(f);
    }
    if (scope > 0)
        return 0;
    comm->peer_pidns_dev = (uint64_t)st.st_dev;
    comm->peer_pidns_ino = (uint64_t)st.st_ino;
    /* Peers check it to know they read this process. */
    if (getrandom(&comm->peer_nonce, sizeof(comm->peer_nonce), 0) !=
        (ssize_t)sizeof(comm->peer_nonce))
        comm->peer_nonce =
            (uint64_t)ps__now_ms() ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)comm;
    return 1;
}

int ps__peer_takes(const ps__coll_t *c)
{
    if (ps__devcoll_kind(c))
        return ps__devcoll_takes(c);
    const ps_comm_t *comm = c->comm;
    const ps_group_t *g = c->group;
    Paramsync__V1__CollectiveKind k = c->hdr.kind;
    size_t min = k == K(ALL_TO_ALL)   ? PEER_MIN_ALL_TO_ALL
                 : k == K(ALL_GATHER) ? PEER_MIN_ALL_GATHER
                 : k == K(GATHER)     ? PEER_MIN_GATHER
                 : k == K(SCATTER)    ? PEER_MIN_SCATTER
                                      : SIZE_MAX;
    /* Every rank's own count: the same on all of them (else the call fails
     * whichever way it goes). */
    if (!g || g->size < 2 || block_bytes(c) > SIZE_MAX / (size_t)g->size ||
        block_bytes(c) * (size_t)g->size < min || !comm->peer_sets ||
        (blocks_per_rank(c) && g->size > PEER_MAX_ALL_TO_ALL_RANKS))
        return 0;
    return ps__group_shares_set(comm, g, comm->peer_sets);
}

int ps__group_shares_set(const ps_comm_t *comm, const ps_group_t *g, const uint32_t *sets)
{
    uint32_t set = sets[comm->rank];
    for (int i = 0; set && i < g->size; i++)
        if (sets[g->ranks ? g->ranks[i] : i] != set)
            return 0;
    return set != 0;
}

int ps__overlap(const void *a, size_t alen, const void *b, size_t blen)
{
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return alen && blen && x < y + blen && y < x + alen;
}

/* The bytes of its ranks' memory an agent taking c would touch, summed over
 * them, as the agent counts them against --shm-resident-bytes (hub.c,
 * member_totals): inputs and outputs of blocks of `block` bytes. */
static uint64_t agent_touches(const ps__coll_t *c, size_t block)
{
    uint64_t n = (uint64_t)c->group->size, p = block;
    switch (c->hdr.kind) {
    case K(ALL_TO_ALL):
        return 2 * n * n * p;
    case K(ALL_GATHER):
        return n * p + n * n * p;
    default: /* gather, scatter: every rank's block, and the root's n */
        return 2 * n * p;
    }
}

/* PARAMSYNC_PEER_MAP=0: peer copies from ps_mem_alloc memory by
 * process_vm_readv, as from any other memory (read on every call). */
static int map_wanted(void)
{
    const char *env = getenv("PARAMSYNC_PEER_MAP");
    return !(env && strcmp(env, "0") == 0);
}

/* The buffers peer copies read and write, and their bytes: an uneven
 * all_to_all's are the caller's own (ps__a2av_t), not the padded ones the
 * agent would move. */
static void peer_buffers(const ps__coll_t *c, const void **in, size_t *in_bytes, void **out,
                         size_t *out_bytes)
{
    const ps__a2av_t *v = c->v;
    int n = c->group->size;
    *in = v ? (const void *)v->in : c->in;
    *in_bytes = v ? v->in_at[n] : c->in_bytes;
    *out = v ? (void *)v->out : c->out;
    *out_bytes = v ? v->out_at[n] : c->out_bytes;
}

/* This rank's descriptor, into d (desc_words). */
static void describe(const ps__coll_t *c, size_t block, uint64_t *d)
{
    const ps_comm_t *comm = c->comm;
    size_t nb = desc_words(c) - W_BLOCKS, me = (size_t)c->hdr.rank, in_bytes, out_bytes;
    const void *in;
    void *out;
    peer_buffers(c, &in, &in_bytes, &out, &out_bytes);
    memset(d, 0, desc_words(c) * sizeof(*d));
    d[W_MAGIC] = PEER_MAGIC;
    d[W_PIDNS_DEV] = comm->peer_pidns_dev;
    d[W_PIDNS_INO] = comm->peer_pidns_ino;
    d[W_NONCE_ADDR] = (uint64_t)(uintptr_t)&comm->peer_nonce;
    d[W_NONCE] = comm->peer_nonce;
    /* torch's in-place forms: an all_gather's or gather root's input its own
     * block of the output, a scatter root's output its own block of the
     * input. Any other overlap would have ranks read what another already
     * wrote. */
    int in_place = blocks_per_rank(c)
                       ? c->hdr.kind == K(SCATTER) && out && out == (const char *)in + me * block
                       : out && in == (const char *)out + me * block;
    int fits = in_place || !ps__overlap(in, in_bytes, out, out_bytes);
    /* Memory from ps_mem_alloc the agent copies in place, between its
     * mappings (asked where one allocation holds input and output; from two,
     * ps__mem_in_place says why not): 1.1-2.2x faster
     * at 16-64 MiB than reads that pin its shared pages one by one
     * (PERFORMANCE.md, "Peer copies"). Not where the call
     * is over the agent's --shm-resident-bytes: it would copy through the
     * segments' files, a step at a time, where the ranks map each other's
     * segments (FITS_SEGMENT: 1.2-1.8x faster than process_vm_readv at
     * 64-256 MiB, PERFORMANCE.md). Asked of the buffers the agent would
     * take: an uneven all_to_all's are padded ones unless a side is the
     * caller's own. */
    uint64_t touched = agent_touches(c, block);
    if (ps__mem_in_place(c->comm, c->in, c->in_bytes, c->out, c->out_bytes, touched))
        fits = 0;
    /* PARAMSYNC_SHM=0 set since ps_init (it is read on every collective):
     * payloads over gRPC, as asked. */
    if (ps__shm_off())
        fits = 0;
    /* A device input is complete before any rank can read it. */
    int device =
        fits && c->peer_dev && ps_gpu_set_device(c->stage_device) == 0 && ps_gpu_fence() == 0;
    if (c->peer_dev && !device)
        fits = 0;
    d[W_PID_FITS] = (uint64_t)(uint32_t)getpid() | (fits ? FITS_HOST : 0);
    if (device) {
        d[W_PID_FITS] |= FITS_DEVICE;
        ps__ipc_put(&d[W_DEV], &c->peer_ipc);
    }
    uint64_t seg_base = 0, seg_size = 0;
    int fd = fits && !device && in && map_wanted()
                 ? ps__mem_file(c->comm, in, in_bytes, &seg_base, &seg_size)
                 : -1;
    if (fd >= 0) {
        d[W_PID_FITS] |= FITS_SEGMENT;
        d[W_SEG_BASE] = seg_base;
        d[W_SEG_SIZE] = seg_size;
        d[W_SEG_FD] = (uint64_t)fd;
    }
    for (size_t j = 0; in && j < nb; j++)
        d[W_BLOCKS + j] =
            (uint64_t)(uintptr_t)((const char *)in + (c->v ? c->v->in_at[j] : j * block));
}

/* How c's n descriptors at d (w words each, blocks of `block` bytes) let
 * every rank read every other: FITS_HOST from host memory, FITS_DEVICE from
 * device memory (every rank's input, its blocks inside the allocation it
 * names; a scatter's other ranks have none), or 0 not at all (a mix of the
 * two among them). */
static uint64_t all_fit(const ps__coll_t *c, const uint64_t *d, int n, size_t w, size_t block)
{
    uint64_t how = d[W_PID_FITS] & FITS_DEVICE ? FITS_DEVICE : FITS_HOST;
    for (int i = 0; i < n; i++) {
        const uint64_t *x = d + (size_t)i * w;
        if (x[W_MAGIC] != PEER_MAGIC || !(x[W_PID_FITS] & FITS_HOST) ||
            (x[W_PID_FITS] & FITS_DEVICE) != (how & FITS_DEVICE) || !(uint32_t)x[W_PID_FITS] ||
            !x[W_PIDNS_INO] || x[W_PIDNS_DEV] != d[W_PIDNS_DEV] || x[W_PIDNS_INO] != d[W_PIDNS_INO])
            return 0;
        /* A read past an allocation would fault the reader's CUDA context. */
        int has_input = c->hdr.kind != K(SCATTER) || i == (int)c->hdr.root;
        for (size_t j = W_BLOCKS; how == FITS_DEVICE && has_input && j < w; j++)
            if (!ps__ipc_inside(&x[W_DEV], x[j], block))
                return 0;
    }
    return how;
}

/* Reads one block of rank x (its block `which`) into `to`, with x's nonce
 * in the same call: 0, or -1 if it could not be read whole from the
 * process that holds that nonce (block 0: the nonce alone). */
static int read_block(const uint64_t *x, size_t which, void *to, size_t block)
{
    uint64_t seen = 0;
    struct iovec local[2] = {{&seen, sizeof(seen)}, {to, block}};
    struct iovec remote[2] = {{(void *)(uintptr_t)x[W_NONCE_ADDR], sizeof(seen)},
                              {(void *)(uintptr_t)x[W_BLOCKS + which], block}};
    ssize_t got = process_vm_readv((pid_t)(uint32_t)x[W_PID_FITS], local, 2, remote, 2, 0);
    return got == (ssize_t)(sizeof(seen) + block) && seen == x[W_NONCE] ? 0 : -1;
}

int ps__peer_ipc_wanted(void)
{
    const char *ipc = getenv("PARAMSYNC_CUDA_IPC");
    return !(ipc && strcmp(ipc, "0") == 0);
}

/* What maps_take maps: another rank's device allocation (ipc), or the file
 * of its segment (fd, here; its `len` bytes, owner_fd in the owner). */
typedef struct map_want {
    uint32_t pid;
    unsigned char key[PS_GPU_IPC_HANDLE_BYTES]; /* ps__ipc_map_t.handle */
    const ps_gpu_ipc_t *ipc;
    int fd, owner_fd;
    size_t len;
} map_want_t;

static void *map_open(const map_want_t *w)
{
    void *at = NULL;
    if (w->ipc)
        return ps_gpu_ipc_open(w->ipc, &at) == 0 ? at : NULL;
    at = mmap(NULL, w->len, PROT_READ, MAP_SHARED, w->fd, 0);
    return at == MAP_FAILED ? NULL : at;
}

static void map_close(void *at, size_t len)
{
    if (len)
        munmap(at, len);
    else
        (void)ps_gpu_ipc_close(at);
}

/* Maps w, or finds it mapped: its address here, or NULL. *slot is its place
 * in comm's maps, -1 when it is mapped for this use alone (maps_give). */
static void *maps_take(ps_comm_t *comm, const map_want_t *w, int *slot)
{
    void *at = NULL;
    pthread_mutex_lock(&comm->lock);
    int free_at = -1, oldest = -1;
    for (int i = 0; i < PS__IPC_MAPS; i++) {
        ps__ipc_map_t *m = &comm->ipc_maps[i];
        if (!m->at) {
            free_at = free_at < 0 ? i : free_at;
        } else if (m->pid == w->pid && !memcmp(m->handle, w->key, sizeof(m->handle)) &&
                   m->len == w->len && m->fd == w->owner_fd) {
            m->users++;
            m->used = ++comm->ipc_clock;
            *slot = i;
            pthread_mutex_unlock(&comm->lock);
            return m->at;
        } else if (!m->users && (oldest < 0 || m->used < comm->ipc_maps[oldest].used)) {
            oldest = i;
        }
    }
    if (!(at = map_open(w))) {
        free_at = -1;
    } else if (free_at < 0 && oldest >= 0) {
        /* A full table gives up the mapping used longest ago, which no copy reads now. */
        map_close(comm->ipc_maps[oldest].at, comm->ipc_maps[oldest].len);
        comm->ipc_maps[oldest].at = NULL;
        free_at = oldest;
    }
    if (at && free_at >= 0) {
        ps__ipc_map_t *m = &comm->ipc_maps[free_at];
        m->at = at;
        m->pid = w->pid;
        memcpy(m->handle, w->key, sizeof(m->handle));
        m->len = w->len;
        m->fd = w->owner_fd;
        m->users = 1;
        m->used = ++comm->ipc_clock;
    }
    *slot = free_at;
    pthread_mutex_unlock(&comm->lock);
    return at;
}

/* Gives back what maps_take gave (len: what was asked for). */
static void maps_give(ps_comm_t *comm, int slot, void *at, size_t len)
{
    pthread_mutex_lock(&comm->lock);
    if (slot >= 0)
        comm->ipc_maps[slot].users--;
    else
        map_close(at, len);
    pthread_mutex_unlock(&comm->lock);
}

void *ps__ipc_map(ps_comm_t *comm, uint32_t pid, const ps_gpu_ipc_t *ipc, int *slot)
{
    map_want_t w = {.pid = pid, .ipc = ipc, .fd = -1, .owner_fd = 0};
    memcpy(w.key, ipc->handle, sizeof(w.key));
    return maps_take(comm, &w, slot);
}

void ps__ipc_unmap(ps_comm_t *comm, int slot, void *at)
{
    maps_give(comm, slot, at, 0);
}

/* A pidfd of the rank whose descriptor is x, checked against its nonce
 * (read after the pidfd is taken, so a pid used again by then would not
 * hold it), or -1. */
static int peer_pidfd(const uint64_t *x)
{
    int pidfd = (int)syscall(SYS_pidfd_open, (pid_t)(uint32_t)x[W_PID_FITS], 0);
    if (pidfd >= 0 && read_block(x, 0, NULL, 0) < 0) {
        close(pidfd);
        return -1;
    }
    return pidfd;
}

/* The file at number fd of the process pidfd, with its device and inode in
 * key: a descriptor of it here, or -1. */
static int peer_file(int pidfd, int fd, struct stat *st, unsigned char *key)
{
    int here = (int)syscall(SYS_pidfd_getfd, pidfd, fd, 0);
    if (here < 0)
        return -1;
    if (fstat(here, st) != 0 || !S_ISREG(st->st_mode)) {
        close(here);
        return -1;
    }
    memset(key, 0, PS_GPU_IPC_HANDLE_BYTES);
    uint64_t id[2] = {(uint64_t)st->st_dev, (uint64_t)st->st_ino};
    memcpy(key, id, sizeof(id));
    return here;
}

/* Lets go of the segments mapped here that their owners no longer hold
 * (freed, or gone), which the mappings would keep in memory: done after a
 * call's peer copies, for the mappings the call did not use (the comm's
 * ipc_clock was `since` before it; those it used it has just checked), so
 * memory another rank frees is given back here at this rank's next one
 * (or its ps_finalize). */
static void maps_sweep(ps_comm_t *comm, uint64_t since)
{
    ps__ipc_map_t seen[PS__IPC_MAPS];
    pthread_mutex_lock(&comm->lock);
    memcpy(seen, comm->ipc_maps, sizeof(seen));
    pthread_mutex_unlock(&comm->lock);
    for (int i = 0; i < PS__IPC_MAPS; i++) {
        if (!seen[i].at || !seen[i].len || seen[i].used > since)
            continue;
        unsigned char key[PS_GPU_IPC_HANDLE_BYTES];
        struct stat st;
        int pidfd = (int)syscall(SYS_pidfd_open, (pid_t)seen[i].pid, 0);
        int fd = pidfd < 0 ? -1 : peer_file(pidfd, seen[i].fd, &st, key);
        int held = fd >= 0 && !memcmp(key, seen[i].handle, sizeof(key));
        if (fd >= 0)
            close(fd);
        if (pidfd >= 0)
            close(pidfd);
        pthread_mutex_lock(&comm->lock);
        ps__ipc_map_t *m = &comm->ipc_maps[i];
        if (!held && m->at == seen[i].at && !m->users) {
            map_close(m->at, m->len);
            m->at = NULL;
        }
        pthread_mutex_unlock(&comm->lock);
    }
}

void ps__ipc_put(uint64_t *words, const ps_gpu_ipc_t *ipc)
{
    words[0] = ipc->base;
    words[1] = ipc->size;
    memcpy(&words[2], ipc->handle, PS_GPU_IPC_HANDLE_BYTES);
}

int ps__ipc_inside(const uint64_t *words, uint64_t addr, size_t len)
{
    uint64_t base = words[0], size = words[1];
    return addr >= base && size >= len && addr - base <= size - len;
}

int ps__ipc_held_init(ps__ipc_held_t *h, ps_comm_t *comm, int cap)
{
    *h = (ps__ipc_held_t){.comm = comm, .cap = cap};
    h->slots = calloc((size_t)cap, sizeof(*h->slots));
    h->at = calloc((size_t)cap, sizeof(*h->at));
    return h->slots && h->at ? 0 : PS_ENOMEM;
}

void *ps__ipc_held_at(ps__ipc_held_t *h, uint32_t pid, const uint64_t *words, uint64_t addr)
{
    if (pid == (uint32_t)getpid())
        return (void *)(uintptr_t)addr;
    if (h->n >= h->cap)
        return NULL;
    ps_gpu_ipc_t ipc = {.base = words[0], .size = words[1]};
    memcpy(ipc.handle, &words[2], PS_GPU_IPC_HANDLE_BYTES);
    int slot;
    uint8_t *base = ps__ipc_map(h->comm, pid, &ipc, &slot);
    if (!base)
        return NULL;
    h->slots[h->n] = slot;
    h->at[h->n++] = base;
    return base + (addr - ipc.base);
}

void ps__ipc_held_release(ps__ipc_held_t *h)
{
    for (int i = 0; i < h->n; i++)
        ps__ipc_unmap(h->comm, h->slots[i], h->at[i]);
    free(h->slots);
    free(h->at);
    *h = (ps__ipc_held_t){.comm = h->comm};
}

void ps__peer_ipc_close_all(ps_comm_t *comm)
{
    for (int i = 0; i < PS__IPC_MAPS; i++) {
        if (comm->ipc_maps[i].at)
            map_close(comm->ipc_maps[i].at, comm->ipc_maps[i].len);
        comm->ipc_maps[i].at = NULL;
    }
}

/* Reads one block of rank x, whose input lies in a segment it keeps open
 * (FITS_SEGMENT), through a mapping of that segment's file taken from it,
 * kept for later calls in comm's maps (a reader of shared memory that
 * process_vm_readv reads pins its pages one by one, each call): 0, or -1
 * where that cannot be done (the caller reads as from other memory then). */
static int read_mapped(ps_comm_t *comm, const uint64_t *x, size_t which, void *to, size_t block)
{
    uint64_t base = x[W_SEG_BASE], size = x[W_SEG_SIZE], at = x[W_BLOCKS + which];
    if (at < base || at - base > size || block > size - (at - base) || x[W_SEG_FD] > INT32_MAX ||
        size > SIZE_MAX || !size)
        return -1;
    int pidfd = peer_pidfd(x);
    if (pidfd < 0)
        return -1;
    map_want_t w = {.pid = (uint32_t)x[W_PID_FITS], .owner_fd = (int)x[W_SEG_FD], .len = size};
    struct stat st;
    w.fd = peer_file(pidfd, w.owner_fd, &st, w.key);
    close(pidfd);
    if (w.fd < 0)
        return -1;
    int slot = -1;
    /* A file shorter than the mapping would fault on the copy (SIGBUS). */
    const char *m = (uint64_t)st.st_size >= size ? maps_take(comm, &w, &slot) : NULL;
    close(w.fd);
    if (!m)
        return -1;
    memcpy(to, m + (at - base), block);
    maps_give(comm, slot, (void *)m, size);
    return 0;
}

/* Where pull reads the other ranks' blocks: their host memory
 * (process_vm_readv, how FITS_HOST), or their device memory (how
 * FITS_DEVICE: copies enqueued on the legacy stream of the current device,
 * each allocation mapped here held until they are done). */
typedef struct source {
    uint64_t how;
    ps__ipc_held_t held;
    ps_comm_t *comm;
} source_t;

/* Reads block `which` of rank x into `to`, or enqueues the copy: 0, or -1
 * if it cannot be read (or x's device allocation cannot be opened). */
static int read_from(source_t *src, const uint64_t *x, size_t which, void *to, size_t block)
{
    if (src->how != FITS_DEVICE)
        return (x[W_PID_FITS] & FITS_SEGMENT) && read_mapped(src->comm, x, which, to, block) == 0
                   ? 0
                   : read_block(x, which, to, block);
    const void *from =
        ps__ipc_held_at(&src->held, (uint32_t)x[W_PID_FITS], &x[W_DEV], x[W_BLOCKS + which]);
    if (!from)
        return -1;
    return ps_gpu_memcpy_async(to, from, block, NULL) == 0 ? 0 : -1;
}

/* Copies this rank's own block from its input into its output. */
static int copy_own(const source_t *src, void *to, const void *from, size_t block)
{
    if (src->how == FITS_DEVICE)
        return ps_gpu_memcpy_async(to, from, block, NULL) == 0 ? 0 : -1;
    memcpy(to, from, block);
    return 0;
}

/* Reads this rank's blocks from the others (all_to_all and all_gather:
 * every other rank's; a gather's root: every other rank's; a scatter's
 * other ranks: the root's) and copies its own: 0, or -1 if any could not
 * be read. An uneven all_to_all's blocks are each pair's own bytes, which
 * every rank knows alike (ps__a2av_t). */
static int pull_blocks(const ps__coll_t *c, source_t *src, const uint64_t *d, int n, size_t block)
{
    Paramsync__V1__CollectiveKind k = c->hdr.kind;
    const ps__a2av_t *v = c->v;
    int me = (int)c->hdr.rank, root = (int)c->hdr.root;
    size_t w = desc_words(c), which = blocks_per_rank(c) ? (size_t)me : 0;
    char *out = c->out;
    if (k == K(SCATTER) && me != root)
        return read_from(src, d + (size_t)root * w, which, out, block);
    if (k == K(GATHER) && me != root)
        return 0; /* it only lends its input */
    for (int j = 1; k != K(SCATTER) && j < n; j++) {
        int i = (me + j) % n; /* not every rank at rank 0 first */
        size_t len = v ? v->out_at[i + 1] - v->out_at[i] : block;
        char *to = v ? (char *)v->out + v->out_at[i] : out + (size_t)i * block;
        if (len && read_from(src, d + (size_t)i * w, which, to, len) < 0)
            return -1;
    }
    if (v) {
        size_t len = v->in_at[me + 1] - v->in_at[me];
        if (len)
            memcpy(v->out + v->out_at[me], v->in + v->in_at[me], len);
        return 0;
    }
    const char *from = (const char *)c->in + which * block;
    char *to = k == K(SCATTER) ? out : out + (size_t)me * block;
    return to != from ? copy_own(src, to, from, block) : 0;
}

/* pull_blocks from memory of kind `how`: 0 or -1. From device memory every
 * copy is done, and this rank's output written, when it returns, also after
 * a failure: no rank says it is done (step 3) while its copies still run. */
static int pull(const ps__coll_t *c, const uint64_t *d, int n, size_t block, uint64_t how)
{
    source_t src = {.how = how, .comm = c->comm};
    if (how != FITS_DEVICE) {
        pthread_mutex_lock(&c->comm->lock);
        uint64_t since = c->comm->ipc_clock;
        pthread_mutex_unlock(&c->comm->lock);
        int rc = pull_blocks(c, &src, d, n, block);
        maps_sweep(c->comm, since);
        return rc;
    }
    int rc =
        ps__ipc_held_init(&src.held, c->comm, n) == 0 && ps_gpu_set_device(c->stage_device) == 0
            ? pull_blocks(c, &src, d, n, block)
            : -1;
    if (ps_gpu_stream_synchronize(NULL) != 0)
        rc = -1;
    ps__ipc_held_release(&src.held);
    return rc;
}

uint64_t ps__peer_seqs(const ps__coll_t *c)
{
    /* Addresses, outcome, the agent's call; a device collective's four:
     * devcoll.c. */
    return ps__devcoll_kind(c) ? 4 : 3;
}

int ps__peer_prepare(ps__coll_t *c)
{
    /* Every rank's, then this rank's own. */
    c->peer_descs = calloc(((size_t)c->group->size + 1) * desc_words(c), sizeof(uint64_t));
    return c->peer_descs ? 0 : PS_ENOMEM;
}

/* The names the steps' failures are reported under. */
static const char *step_name(const ps__coll_t *c, int step)
{
    switch (c->hdr.kind) {
    case K(ALL_TO_ALL):
        if (c->v)
            return step ? "all_to_all_v (peer copies done)" : "all_to_all_v (peer addresses)";
        return step ? "all_to_all (peer copies done)" : "all_to_all (peer addresses)";
    case K(GATHER):
        return step ? "gather (peer copies done)" : "gather (peer addresses)";
    case K(SCATTER):
        return step ? "scatter (peer copies done)" : "scatter (peer addresses)";
    default:
        return step ? "all_gather (peer copies done)" : "all_gather (peer addresses)";
    }
}

int ps__peer_run(ps__coll_t *c, int *rc)
{
    if (ps__devcoll_kind(c)) {
        uint64_t *all = c->peer_descs;
        c->peer_descs = NULL;
        return ps__devcoll_run(c, all, rc);
    }
    int n = c->group->size;
    size_t block = block_bytes(c), w = desc_words(c);
    uint64_t seq = c->hdr.seq, *all = c->peer_descs, *mine = all + (size_t)n * w;
    c->peer_descs = NULL;
    describe(c, block, mine);
    *rc = ps__coll_sub(c, step_name(c, 0), K(ALL_GATHER), PS_SUM, PS_UINT8, w * sizeof(*mine), mine,
                       all, seq);
    uint64_t how = *rc == 0 ? all_fit(c, all, n, w, block) : 0;
    if (how == FITS_HOST) {
        const void *in;
        void *out;
        size_t in_bytes, out_bytes;
        peer_buffers(c, &in, &in_bytes, &out, &out_bytes);
        ps__collapse_buffers(c, in, in_bytes, out, out_bytes);
    }
    int32_t failed = how && pull(c, all, n, block, how) < 0;
    free(all);
    if (*rc < 0)
        return 1;
    if (how) {
        *rc = ps__coll_sub(c, step_name(c, 1), K(ALL_REDUCE), PS_MAX, PS_INT32, 1, &failed, &failed,
                           seq + 1);
        if (*rc < 0 || !failed)
            return 1;
    }
    c->hdr.seq = seq + (how ? 2 : 1);
    /* Through the agent: a device input left where it lay is staged now. */
    *rc = ps__stage_deferred(c);
    return *rc < 0;
}
