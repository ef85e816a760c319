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
 */
#include "internal.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
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

#define PEER_MAGIC UINT64_C(0x3170656572737370) /* "pssreep1" */

/*
 * What each rank tells the others (step 1), as 64-bit words in this host's
 * byte order (all ranks run on one machine); the Python client writes the
 * same (paramsync/_peer.py):
 *
 *   0 PEER_MAGIC      1 the device and 2 the inode of its PID namespace
 *   3 the address of its nonce and 4 the nonce
 *   5 its pid (low 32 bits) and whether its buffers suit peer copies (bit 32:
 *     no overlap between input and output, but an all_gather's own block;
 *     neither in memory from ps_mem_alloc)
 *   6.. where its input's blocks are: an all_to_all's block for rank j in
 *     word 6 + j (a list of buffers need not lie end to end), an
 *     all_gather's one block in word 6
 */
enum { W_MAGIC, W_PIDNS_DEV, W_PIDNS_INO, W_NONCE_ADDR, W_NONCE, W_PID_FITS, W_BLOCKS };

/* Whether each rank's input holds a block for every rank (all_to_all, a
 * scatter's root) rather than one (all_gather, gather). */
static int blocks_per_rank(const ps__coll_t *c)
{
    return c->hdr.kind == K(ALL_TO_ALL) || c->hdr.kind == K(SCATTER);
}

/* Words of one rank's descriptor for c. */
static size_t desc_words(const ps__coll_t *c)
{
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
    uint32_t set = comm->peer_sets[comm->rank];
    for (int i = 0; set && i < g->size; i++)
        if (comm->peer_sets[g->ranks ? g->ranks[i] : i] != set)
            return 0;
    return set != 0;
}

static int overlap(const void *a, size_t alen, const void *b, size_t blen)
{
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return alen && blen && x < y + blen && y < x + alen;
}

/* This rank's descriptor, into d (desc_words). */
static void describe(const ps__coll_t *c, size_t block, uint64_t *d)
{
    const ps_comm_t *comm = c->comm;
    size_t nb = desc_words(c) - W_BLOCKS, me = (size_t)c->hdr.rank;
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
    int in_place = blocks_per_rank(c) ? c->hdr.kind == K(SCATTER) && c->out &&
                                            c->out == (const char *)c->in + me * block
                                      : c->out && c->in == (const char *)c->out + me * block;
    uint64_t fits = in_place || !overlap(c->in, c->in_bytes, c->out, c->out_bytes);
    /* Memory from ps_mem_alloc the agent copies in place, between its
     * mappings: 1.1-2.2x faster at 16-64 MiB than reads that pin its shared
     * pages one by one (PERFORMANCE.md, "Peer copies"). */
    if ((c->in && ps_mem_is_shared(c->comm, c->in)) ||
        (c->out && ps_mem_is_shared(c->comm, c->out)))
        fits = 0;
    /* PARAMSYNC_SHM=0 set since ps_init (it is read on every collective):
     * payloads over gRPC, as asked. */
    if (ps__shm_off())
        fits = 0;
    d[W_PID_FITS] = (uint64_t)(uint32_t)getpid() | fits << 32;
    for (size_t j = 0; c->in && j < nb; j++)
        d[W_BLOCKS + j] = (uint64_t)(uintptr_t)((const char *)c->in + j * block);
}

/* Whether every rank of the n descriptors at d (w words each) can be read
 * by every other. */
static int all_fit(const uint64_t *d, int n, size_t w)
{
    for (int i = 0; i < n; i++) {
        const uint64_t *x = d + (size_t)i * w;
        if (x[W_MAGIC] != PEER_MAGIC || !(x[W_PID_FITS] >> 32) || !(uint32_t)x[W_PID_FITS] ||
            !x[W_PIDNS_INO] || x[W_PIDNS_DEV] != d[W_PIDNS_DEV] || x[W_PIDNS_INO] != d[W_PIDNS_INO])
            return 0;
    }
    return 1;
}

/* Reads one block of rank x (its block `which`) into `to`, with x's nonce
 * in the same call: 0, or -1 if it could not be read whole from the
 * process that holds that nonce. */
static int read_block(const uint64_t *x, size_t which, void *to, size_t block)
{
    uint64_t seen = 0;
    struct iovec local[2] = {{&seen, sizeof(seen)}, {to, block}};
    struct iovec remote[2] = {{(void *)(uintptr_t)x[W_NONCE_ADDR], sizeof(seen)},
                              {(void *)(uintptr_t)x[W_BLOCKS + which], block}};
    ssize_t got = process_vm_readv((pid_t)(uint32_t)x[W_PID_FITS], local, 2, remote, 2, 0);
    return got == (ssize_t)(sizeof(seen) + block) && seen == x[W_NONCE] ? 0 : -1;
}

/* Reads this rank's blocks from the others (all_to_all and all_gather:
 * every other rank's; a gather's root: every other rank's; a scatter's
 * other ranks: the root's) and copies its own: 0, or -1 if any could not
 * be read. */
static int pull(const ps__coll_t *c, const uint64_t *d, int n, size_t block)
{
    Paramsync__V1__CollectiveKind k = c->hdr.kind;
    int me = (int)c->hdr.rank, root = (int)c->hdr.root;
    size_t w = desc_words(c), which = blocks_per_rank(c) ? (size_t)me : 0;
    char *out = c->out;
    if (k == K(SCATTER) && me != root)
        return read_block(d + (size_t)root * w, which, out, block);
    if (k == K(GATHER) && me != root)
        return 0; /* it only lends its input */
    for (int j = 1; k != K(SCATTER) && j < n; j++) {
        int i = (me + j) % n; /* not every rank at rank 0 first */
        if (read_block(d + (size_t)i * w, which, out + (size_t)i * block, block) < 0)
            return -1;
    }
    const char *from = (const char *)c->in + which * block;
    char *to = k == K(SCATTER) ? out : out + (size_t)me * block;
    if (to != from)
        memcpy(to, from, block);
    return 0;
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
    int n = c->group->size;
    size_t block = block_bytes(c), w = desc_words(c);
    uint64_t seq = c->hdr.seq, *all = c->peer_descs, *mine = all + (size_t)n * w;
    c->peer_descs = NULL;
    describe(c, block, mine);
    *rc = ps__coll_sub(c, step_name(c, 0), K(ALL_GATHER), PS_SUM, PS_UINT8, w * sizeof(*mine), mine,
                       all, seq);
    int fit = *rc == 0 && all_fit(all, n, w);
    if (fit)
        ps__collapse_buffers(c);
    int32_t failed = fit && pull(c, all, n, block) < 0;
    free(all);
    if (*rc < 0)
        return 1;
    if (!fit) {
        c->hdr.seq = seq + 1;
        return 0;
    }
    *rc = ps__coll_sub(c, step_name(c, 1), K(ALL_REDUCE), PS_MAX, PS_INT32, 1, &failed, &failed,
                       seq + 1);
    if (*rc < 0 || !failed)
        return 1;
    c->hdr.seq = seq + 2;
    return 0;
}
