/*
 * Peer copies: large all_to_all and all_gather calls whose ranks all share
 * one agent copy each block once, rank to rank, with process_vm_readv.
 *
 * Through the agent, a block from a worker's own buffer costs two copies:
 * the agent reads it from the sender (process_vm_readv) and writes it to
 * the receiver (process_vm_writev), all of them on the agent's threads.
 * Here each rank reads its blocks straight from the other ranks' buffers
 * into its output, one copy, the ranks side by side:
 *
 *   1. an all_gather of each rank's descriptor (its pid, PID namespace,
 *      the address of its input and of its nonce): seq s;
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
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#define K(x) PARAMSYNC__V1__COLLECTIVE_KIND__##x

/* Outputs below these go through the agent: there the two small
 * collectives cost more than the copy they save (measured here with 2 and
 * 4 ranks: level at 1 MiB, all_to_all ahead from 2 MiB, all_gather from 4;
 * docs/PERFORMANCE.md, "Peer copies"). */
#define PEER_MIN_ALL_TO_ALL ((size_t)2 << 20)
#define PEER_MIN_ALL_GATHER ((size_t)4 << 20)

#define PEER_MAGIC UINT64_C(0x3170656572737370) /* "pssreep1" */

/* What each rank tells the others (step 1); all ranks run on one machine. */
typedef struct peer_desc {
    uint64_t magic;
    uint64_t pidns_dev, pidns_ino; /* its PID namespace */
    uint64_t nonce_addr, nonce;
    uint64_t in; /* address of its input */
    int32_t pid;
    uint32_t fits; /* its buffers suit peer copies (no overlap but the own block) */
} peer_desc_t;

int ps__peer_wanted(uint64_t *pidns)
{
    const char *shm = getenv("PARAMSYNC_SHM"), *peer = getenv("PARAMSYNC_PEER_COPY");
    struct stat st;
    *pidns = 0;
    if ((shm && strcmp(shm, "0") == 0) || (peer && strcmp(peer, "0") == 0) ||
        stat("/proc/self/ns/pid", &st) != 0)
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
    *pidns = (uint64_t)st.st_ino;
    return 1;
}

int ps__peer_takes(const ps__coll_t *c)
{
    const ps_comm_t *comm = c->comm;
    const ps_group_t *g = c->group;
    size_t min = c->hdr.kind == K(ALL_TO_ALL)   ? PEER_MIN_ALL_TO_ALL
                 : c->hdr.kind == K(ALL_GATHER) ? PEER_MIN_ALL_GATHER
                                                : SIZE_MAX;
    if (c->out_bytes < min || !comm->peer_sets || !g || g->size < 2)
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

/* This rank's descriptor. */
static void describe(const ps__coll_t *c, size_t block, peer_desc_t *d)
{
    const ps_comm_t *comm = c->comm;
    struct stat st;
    memset(d, 0, sizeof(*d));
    d->magic = PEER_MAGIC;
    if (stat("/proc/self/ns/pid", &st) == 0) {
        d->pidns_dev = (uint64_t)st.st_dev;
        d->pidns_ino = (uint64_t)st.st_ino;
    }
    d->nonce_addr = (uint64_t)(uintptr_t)&comm->peer_nonce;
    d->nonce = comm->peer_nonce;
    d->in = (uint64_t)(uintptr_t)c->in;
    d->pid = (int32_t)getpid();
    /* An all_gather may be torch's in-place form, the input its own block of
     * the output; any other overlap would have ranks read what another
     * already wrote. */
    const char *own = (const char *)c->out + (size_t)c->hdr.rank * block;
    int in_place = c->hdr.kind == K(ALL_GATHER) && (const char *)c->in == own;
    d->fits = in_place || !overlap(c->in, c->in_bytes, c->out, c->out_bytes);
}

/* Whether every rank can be read by every other. */
static int all_fit(const peer_desc_t *d, int n)
{
    for (int i = 0; i < n; i++)
        if (d[i].magic != PEER_MAGIC || !d[i].fits || !d[i].pid || !d[i].pidns_ino ||
            d[i].pidns_dev != d[0].pidns_dev || d[i].pidns_ino != d[0].pidns_ino)
            return 0;
    return 1;
}

/* Reads this rank's blocks from the others: 0, or -1 if any could not be
 * read whole from the process that holds its rank's nonce. */
static int pull(const ps__coll_t *c, const peer_desc_t *d, int n, size_t block)
{
    int me = (int)c->hdr.rank;
    char *out = c->out;
    for (int k = 1; k < n; k++) {
        int i = (me + k) % n; /* not every rank at rank 0 first */
        uint64_t seen = 0;
        size_t at = c->hdr.kind == K(ALL_TO_ALL) ? (size_t)me * block : 0;
        struct iovec local[2] = {{&seen, sizeof(seen)}, {out + (size_t)i * block, block}};
        struct iovec remote[2] = {{(void *)(uintptr_t)d[i].nonce_addr, sizeof(seen)},
                                  {(void *)(uintptr_t)(d[i].in + at), block}};
        ssize_t got = process_vm_readv((pid_t)d[i].pid, local, 2, remote, 2, 0);
        if (got != (ssize_t)(sizeof(seen) + block) || seen != d[i].nonce)
            return -1;
    }
    const char *from =
        (const char *)c->in + (c->hdr.kind == K(ALL_TO_ALL) ? (size_t)me * block : 0);
    if (out + (size_t)me * block != from)
        memcpy(out + (size_t)me * block, from, block);
    return 0;
}

int ps__peer_prepare(ps__coll_t *c)
{
    c->peer_descs = calloc((size_t)c->group->size, sizeof(peer_desc_t));
    return c->peer_descs ? 0 : PS_ENOMEM;
}

/* The names the steps' failures are reported under. */
static const char *step_name(const ps__coll_t *c, int step)
{
    if (c->hdr.kind == K(ALL_TO_ALL))
        return step ? "all_to_all (peer copies done)" : "all_to_all (peer addresses)";
    return step ? "all_gather (peer copies done)" : "all_gather (peer addresses)";
}

int ps__peer_run(ps__coll_t *c, int *rc)
{
    int n = c->group->size;
    size_t block = c->out_bytes / (size_t)n;
    uint64_t seq = c->hdr.seq;
    peer_desc_t mine, *all = c->peer_descs;
    c->peer_descs = NULL;
    describe(c, block, &mine);
    *rc = ps__coll_sub(c, step_name(c, 0), K(ALL_GATHER), PS_SUM, PS_UINT8, sizeof(mine), &mine,
                       all, seq);
    int fit = *rc == 0 && all_fit(all, n);
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
