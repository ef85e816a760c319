/* The public collectives: argument checks, payload sizes per kind, sequence numbers, dispatch. */
#include "internal.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define K(x) PARAMSYNC__V1__COLLECTIVE_KIND__##x

/* What one public call asked for, before it is checked. */
typedef struct request {
    const char *name;
    Paramsync__V1__CollectiveKind kind;
    int reduces; /* op is meaningful */
    ps_op_t op;
    ps_dtype_t dtype;
    size_t count;
    int root; /* BROADCAST/REDUCE/GATHER/SCATTER */
    int peer; /* SEND: dst; RECV: src or PS_ANY_SOURCE */
    int tag;
    const void *in;
    void *out;
    ps_group_t *group;
    ps__a2av_t *v; /* ps_all_to_all_v's layout, or NULL */
} request_t;

/* Rooted kinds name their root's rank; the others send 0. */
static int has_root(Paramsync__V1__CollectiveKind k)
{
    return k == K(BROADCAST) || k == K(REDUCE) || k == K(GATHER) || k == K(SCATTER);
}

/* Multiplies sizes, refusing overflow. */
static int mul_size(size_t a, size_t b, size_t *out)
{
    if (a && b > SIZE_MAX / a)
        return -1;
    *out = a * b;
    return 0;
}

/* Checks r and fills c: the header and the bytes this rank sends and
 * receives, per the payload table of paramsync.proto. Takes no sequence
 * number. Returns 0, or PS_EINVAL/PS_EPRECOND after reporting why. */
static int prepare(ps_comm_t *comm, const request_t *r, ps__coll_t *c)
{
    char what[64];
    const char *why = NULL;
    char buf[160];

    if (!comm) {
        ps__report(NULL, PS_EPRECOND, r->name, "paramsync is not initialised (comm is NULL)");
        return PS_EPRECOND;
    }
    ps_group_t *g = r->group ? r->group : &comm->world;
    snprintf(what, sizeof(what), "%s (group %u)", r->name, g->id);
    int n = g->size, me = g->rank;
    size_t esz = ps_dtype_size(r->dtype), block, all;

    if (g->comm != comm) {
        why = "the group belongs to another communicator";
    } else if (me < 0) {
        snprintf(buf, sizeof(buf), "this process (rank %d) is not a member of the group",
                 comm->rank);
        why = buf;
    } else if (!esz) {
        snprintf(buf, sizeof(buf), "%d is not a dtype", (int)r->dtype);
        why = buf;
    } else if (r->reduces && ps_op_check(r->op, r->dtype) < 0) {
        snprintf(buf, sizeof(buf), "op %s is not defined for dtype %s", ps_op_name(r->op),
                 ps_dtype_name(r->dtype));
        why = buf;
    } else if (has_root(r->kind) && (r->root < 0 || r->root >= n)) {
        snprintf(buf, sizeof(buf), "root rank %d is not in the group (size %d)", r->root, n);
        why = buf;
    } else if ((r->kind == K(SEND) || r->kind == K(RECV)) &&
               (r->kind == K(SEND) || r->peer != PS_ANY_SOURCE) &&
               (r->peer < 0 || r->peer >= n || r->peer == me)) {
        snprintf(buf, sizeof(buf),
                 "%s rank %d is not another rank of the group (size %d, this "
                 "rank %d)",
                 r->kind == K(SEND) ? "destination" : "source", r->peer, n, me);
        why = buf;
    } else if (r->tag < 0) {
        snprintf(buf, sizeof(buf), "tag %d is negative", r->tag);
        why = buf;
    } else if (mul_size(r->count, esz, &block) < 0 || mul_size(block, (size_t)n, &all) < 0) {
        snprintf(buf, sizeof(buf), "count %zu is too large", r->count);
        why = buf;
    }
    if (why) {
        ps__report(comm, PS_EINVAL, what, "%s", why);
        return PS_EINVAL;
    }

    int root = has_root(r->kind) ? r->root : 0, is_root = me == root;
    const void *in = NULL;
    void *out = NULL;
    size_t in_bytes = 0, out_bytes = 0;
    switch (r->kind) {
    case K(BROADCAST):
        in_bytes = is_root ? block : 0;
        out_bytes = is_root ? 0 : block;
        break;
    case K(ALL_REDUCE):
        in_bytes = out_bytes = block;
        break;
    case K(REDUCE):
        in_bytes = block;
        out_bytes = is_root ? block : 0;
        break;
    case K(ALL_GATHER):
        in_bytes = block;
        out_bytes = all;
        break;
    case K(GATHER):
        in_bytes = block;
        out_bytes = is_root ? all : 0;
        break;
    case K(SCATTER):
        in_bytes = is_root ? all : 0;
        out_bytes = block;
        break;
    case K(REDUCE_SCATTER):
        in_bytes = all;
        out_bytes = block;
        break;
    case K(ALL_TO_ALL):
        in_bytes = out_bytes = all;
        break;
    case K(SEND):
        in_bytes = block;
        break;
    case K(RECV):
        out_bytes = block;
        break;
    default: /* BARRIER */
        break;
    }
    if (in_bytes)
        in = r->in;
    if (out_bytes)
        out = r->out;
    if ((in_bytes && !in) || (out_bytes && !out)) {
        ps__report(comm, PS_EINVAL, what, "%s buffer is NULL with count %zu",
                   in_bytes && !in ? "input" : "output", r->count);
        return PS_EINVAL;
    }

    memset(c, 0, sizeof(*c));
    Paramsync__V1__CollectiveHeader init = PARAMSYNC__V1__COLLECTIVE_HEADER__INIT;
    c->hdr = init;
    c->hdr.job = comm->job;
    c->hdr.group = g->id;
    c->hdr.kind = r->kind;
    c->hdr.op = r->reduces ? (Paramsync__V1__ReduceOp)r->op : PARAMSYNC__V1__REDUCE_OP__SUM;
    c->hdr.dtype = (Paramsync__V1__DType)r->dtype;
    c->hdr.count = r->count;
    c->hdr.root = root;
    c->hdr.peer = r->kind == K(SEND) || r->kind == K(RECV) ? r->peer : 0;
    c->hdr.rank = me;
    c->hdr.tag = (uint32_t)r->tag;
    c->hdr.timeout_ms = (uint32_t)comm->timeout_ms;
    c->hdr.chunk_bytes = (uint32_t)comm->chunk_bytes;
    c->hdr.incarnation = comm->incarnation;
    c->comm = comm;
    c->group = g;
    c->name = r->name;
    c->in = in;
    c->in_bytes = in_bytes;
    c->out = out;
    c->out_bytes = out_bytes;
    c->source = -1;
    c->v = r->v;
    if (r->v && r->v->used) { /* the agents need not move the padding */
        c->hdr.block_used = r->v->used;
        c->hdr.n_block_used = (size_t)n;
    }
    if (r->v && r->v->out_used) { /* nor count it against their memory */
        c->hdr.block_out_used = r->v->out_used;
        c->hdr.n_block_out_used = (size_t)n;
    }
    return 0;
}

/* The counter that numbers c's calls (comm->lock held): sends per
 * destination, receives per group whatever their source (so any-source
 * receives need no special case), everything else per group. */
static uint64_t *seq_counter(ps__coll_t *c, ps_group_t *g)
{
    if (c->hdr.kind == K(SEND))
        return &g->send_seq[c->hdr.peer];
    if (c->hdr.kind == K(RECV))
        return &g->recv_seq;
    return &g->coll_seq;
}

/* Runs r: blocking when work is NULL, else on a thread of its own. The
 * sequence number is taken here, in the caller's thread, so that calls are
 * matched across ranks in the order each rank started them. */
static int submit(ps_comm_t *comm, const request_t *r, ps_work_t **work, int *source)
{
    ps__coll_t c;
    int rc = prepare(comm, r, &c);
    if (rc < 0)
        return rc;
    /* Before the sequence number: a call that cannot stage its device
     * buffers is not started, so no other rank waits for it. */
    rc = ps__stage_prepare(&c);
    if (rc < 0)
        return rc;
    rc = ps__peer_takes(&c) ? ps__peer_prepare(&c) : 0;
    if (rc == 0 && !work)
        rc = ps__coll_init(&c);
    if (rc < 0) {
        ps__report(comm, rc, r->name, "out of memory");
        free(c.peer_descs);
        ps__stage_end(&c, rc);
        return rc;
    }
    uint64_t seqs = c.peer_descs ? ps__peer_seqs(&c) : 1;
    ps_group_t *g = c.group;
    int direct = ps__bar_takes(&c);
    if (work) {
        pthread_mutex_lock(&comm->lock);
        uint64_t *seq = seq_counter(&c, g);
        c.hdr.seq = *seq;
        *seq += seqs;
        c.bar_k = direct ? ++g->bar_calls : 0;
        rc = ps__work_start(&c, work);
        if (rc < 0) {
            *seq -= seqs; /* nothing was sent: the numbers are still free */
            g->bar_calls -= direct;
        } else {
            ps__bar_started(&c);
        }
        pthread_mutex_unlock(&comm->lock);
        if (rc < 0) {
            ps__report(comm, rc, r->name, "cannot start a thread for the operation");
            free(c.peer_descs);
            ps__stage_end(&c, rc);
        }
        return rc;
    }
    pthread_mutex_lock(&comm->lock);
    uint64_t *seq = seq_counter(&c, g);
    c.hdr.seq = *seq;
    *seq += seqs;
    c.bar_k = direct ? ++g->bar_calls : 0;
    ps__bar_started(&c);
    ps__inflight_link(comm, &c);
    pthread_mutex_unlock(&comm->lock);
    rc = ps__coll_run(&c);
    if (rc == 0 && source)
        *source = c.source;
    ps__coll_destroy(&c);
    return rc;
}

int ps__coll_sub(const ps__coll_t *parent, const char *name, Paramsync__V1__CollectiveKind kind,
                 ps_op_t op, ps_dtype_t dtype, size_t count, const void *in, void *out,
                 uint64_t seq)
{
    ps_comm_t *comm = parent->comm;
    request_t r = {.name = name,
                   .kind = kind,
                   .reduces = kind == K(ALL_REDUCE),
                   .op = op,
                   .dtype = dtype,
                   .count = count,
                   .in = in,
                   .out = out,
                   .group = parent->group};
    ps__coll_t c;
    int rc = prepare(comm, &r, &c);
    if (rc == 0 && (rc = ps__coll_init(&c)) < 0)
        ps__report(comm, rc, name, "out of memory");
    if (rc < 0)
        return rc;
    c.hdr.seq = seq;
    pthread_mutex_lock(&comm->lock);
    ps__inflight_link(comm, &c);
    pthread_mutex_unlock(&comm->lock);
    rc = ps__coll_run(&c);
    ps__coll_destroy(&c);
    return rc;
}

/* ---------------------------------------------------------------- requests */

static request_t req_barrier(ps_group_t *group)
{
    request_t r = {.name = "barrier", .kind = K(BARRIER), .dtype = PS_FLOAT32, .group = group};
    return r;
}

static request_t req_broadcast(void *buf, size_t count, ps_dtype_t dtype, int src,
                               ps_group_t *group)
{
    request_t r = {.name = "broadcast",
                   .kind = K(BROADCAST),
                   .dtype = dtype,
                   .count = count,
                   .root = src,
                   .in = buf,
                   .out = buf,
                   .group = group};
    return r;
}

static request_t req_all_reduce(void *buf, size_t count, ps_dtype_t dtype, ps_op_t op,
                                ps_group_t *group)
{
    request_t r = {.name = "all_reduce",
                   .kind = K(ALL_REDUCE),
                   .reduces = 1,
                   .op = op,
                   .dtype = dtype,
                   .count = count,
                   .in = buf,
                   .out = buf,
                   .group = group};
    return r;
}

static request_t req_reduce(void *buf, size_t count, ps_dtype_t dtype, ps_op_t op, int dst,
                            ps_group_t *group)
{
    request_t r = {.name = "reduce",
                   .kind = K(REDUCE),
                   .reduces = 1,
                   .op = op,
                   .dtype = dtype,
                   .count = count,
                   .root = dst,
                   .in = buf,
                   .out = buf,
                   .group = group};
    return r;
}

static request_t req_io(const char *name, Paramsync__V1__CollectiveKind kind, void *out,
                        const void *in, size_t count, ps_dtype_t dtype, int root, ps_group_t *group)
{
    request_t r = {.name = name,
                   .kind = kind,
                   .dtype = dtype,
                   .count = count,
                   .root = root,
                   .in = in,
                   .out = out,
                   .group = group};
    return r;
}

static request_t req_reduce_scatter(void *out, const void *in, size_t count, ps_dtype_t dtype,
                                    ps_op_t op, ps_group_t *group)
{
    request_t r = {.name = "reduce_scatter",
                   .kind = K(REDUCE_SCATTER),
                   .reduces = 1,
                   .op = op,
                   .dtype = dtype,
                   .count = count,
                   .in = in,
                   .out = out,
                   .group = group};
    return r;
}

static request_t req_send(const void *buf, size_t count, ps_dtype_t dtype, int dst, int tag,
                          ps_group_t *group)
{
    request_t r = {.name = "send",
                   .kind = K(SEND),
                   .dtype = dtype,
                   .count = count,
                   .peer = dst,
                   .tag = tag,
                   .in = buf,
                   .group = group};
    return r;
}

static request_t req_recv(void *buf, size_t count, ps_dtype_t dtype, int src, int tag,
                          ps_group_t *group)
{
    request_t r = {.name = "recv",
                   .kind = K(RECV),
                   .dtype = dtype,
                   .count = count,
                   .peer = src,
                   .tag = tag,
                   .out = buf,
                   .group = group};
    return r;
}

/* Non-blocking forms need somewhere to put the handle. */
static int need_work(ps_comm_t *comm, const char *name, ps_work_t **work)
{
    if (work)
        return 0;
    ps__report(comm, PS_EINVAL, name, "work is NULL");
    return PS_EINVAL;
}

/* ---------------------------------------------------------------- blocking */

int ps_barrier(ps_comm_t *comm, ps_group_t *group)
{
    request_t r = req_barrier(group);
    return submit(comm, &r, NULL, NULL);
}

int ps_broadcast(ps_comm_t *comm, void *buf, size_t count, ps_dtype_t dtype, int src,
                 ps_group_t *group)
{
    request_t r = req_broadcast(buf, count, dtype, src, group);
    return submit(comm, &r, NULL, NULL);
}

int ps_all_reduce(ps_comm_t *comm, void *buf, size_t count, ps_dtype_t dtype, ps_op_t op,
                  ps_group_t *group)
{
    request_t r = req_all_reduce(buf, count, dtype, op, group);
    return submit(comm, &r, NULL, NULL);
}

int ps_reduce_to(ps_comm_t *comm, void *buf, size_t count, ps_dtype_t dtype, ps_op_t op, int dst,
                 ps_group_t *group)
{
    request_t r = req_reduce(buf, count, dtype, op, dst, group);
    return submit(comm, &r, NULL, NULL);
}

int ps_all_gather(ps_comm_t *comm, void *out, const void *in, size_t count, ps_dtype_t dtype,
                  ps_group_t *group)
{
    request_t r = req_io("all_gather", K(ALL_GATHER), out, in, count, dtype, 0, group);
    return submit(comm, &r, NULL, NULL);
}

int ps_gather(ps_comm_t *comm, void *out, const void *in, size_t count, ps_dtype_t dtype, int dst,
              ps_group_t *group)
{
    request_t r = req_io("gather", K(GATHER), out, in, count, dtype, dst, group);
    return submit(comm, &r, NULL, NULL);
}

int ps_scatter(ps_comm_t *comm, void *out, const void *in, size_t count, ps_dtype_t dtype, int src,
               ps_group_t *group)
{
    request_t r = req_io("scatter", K(SCATTER), out, in, count, dtype, src, group);
    return submit(comm, &r, NULL, NULL);
}

int ps_reduce_scatter(ps_comm_t *comm, void *out, const void *in, size_t count, ps_dtype_t dtype,
                      ps_op_t op, ps_group_t *group)
{
    request_t r = req_reduce_scatter(out, in, count, dtype, op, group);
    return submit(comm, &r, NULL, NULL);
}

int ps_all_to_all(ps_comm_t *comm, void *out, const void *in, size_t count, ps_dtype_t dtype,
                  ps_group_t *group)
{
    request_t r = req_io("all_to_all", K(ALL_TO_ALL), out, in, count, dtype, 0, group);
    return submit(comm, &r, NULL, NULL);
}

int ps_send(ps_comm_t *comm, const void *buf, size_t count, ps_dtype_t dtype, int dst, int tag,
            ps_group_t *group)
{
    request_t r = req_send(buf, count, dtype, dst, tag, group);
    return submit(comm, &r, NULL, NULL);
}

int ps_recv(ps_comm_t *comm, void *buf, size_t count, ps_dtype_t dtype, int src, int tag,
            ps_group_t *group, int *source)
{
    request_t r = req_recv(buf, count, dtype, src, tag, group);
    return submit(comm, &r, NULL, source);
}

/* ---------------------------------------------------------------- uneven all_to_all */

/* Checks the counts table (n rows of 2n: a rank's in_counts, then its
 * out_counts): 0 with *most the largest count sent, or -1 with *a and *b a
 * pair where what a sends b is not what b expects from a. */
static int counts_check(const int64_t *t, int n, size_t *most, int *a, int *b)
{
    *most = 0;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            int64_t sent = t[(size_t)i * 2 * n + j];
            if (sent != t[(size_t)j * 2 * n + n + i]) {
                *a = i;
                *b = j;
                return -1;
            }
            if ((size_t)sent > *most)
                *most = (size_t)sent;
        }
    return 0;
}

/* Whether every one of the n counts is c. */
static int all_of(const size_t *counts, int n, size_t c)
{
    for (int j = 0; j < n; j++)
        if (counts[j] != c)
            return 0;
    return 1;
}

/* Argument checks of ps_all_to_all_v that need no call: 0, or reported. The
 * group's (another comm's, or one the caller is not in) are the first call's,
 * made by prepare. */
static int a2av_check(ps_comm_t *comm, int n, const void *out, const size_t *out_counts,
                      const void *in, const size_t *in_counts, ps_dtype_t dtype)
{
    const char *why = NULL;
    int dev = 0;
    size_t esz = ps_dtype_size(dtype), in_all = 0, out_all = 0;
    if (!esz)
        why = "not a dtype";
    else if (!out_counts || !in_counts)
        why = "out_counts and in_counts must each hold one count per rank of the group";
    for (int j = 0; !why && j < n; j++) {
        in_all += in_counts[j];
        out_all += out_counts[j];
        if (in_all < in_counts[j] || out_all < out_counts[j] || in_counts[j] > INT64_MAX / esz ||
            out_counts[j] > INT64_MAX / esz)
            why = "the counts are too large";
    }
    if (!why && (in_all > SIZE_MAX / esz || out_all > SIZE_MAX / esz))
        why = "the counts are too large";
    if (!why && ((in_all && !in) || (out_all && !out)))
        why = "a NULL buffer for a nonzero count";
    if (!why && ((in_all && ps__is_device(in, &dev) == 0 && dev) ||
                 (out_all && ps__is_device(out, &dev) == 0 && dev)))
        why = "device memory is not supported here: copy it to host memory first";
    if (why) {
        ps__report(comm, PS_EINVAL, "all_to_all_v", "%s", why);
        return PS_EINVAL;
    }
    return 0;
}

/* Copies the n blocks of flat (block j from at[j] to at[j + 1]) into pad's
 * blocks of `block` bytes, or (to_pad 0) back out of them. No-op without a
 * pad (that side is the caller's own). */
static void pad_copy(unsigned char *pad, size_t block, unsigned char *flat, const size_t *at, int n,
                     int to_pad)
{
    for (int j = 0; pad && j < n; j++) {
        size_t len = at[j + 1] - at[j];
        if (!len) /* flat may be NULL where this side has no bytes */
            continue;
        if (to_pad)
            memcpy(pad + (size_t)j * block, flat + at[j], len);
        else
            memcpy(flat + at[j], pad + (size_t)j * block, len);
    }
}

void ps__a2av_pack(ps__coll_t *c)
{
    ps__a2av_t *v = c->v;
    if (!v || v->via_agent)
        return;
    v->via_agent = 1;
    pad_copy(v->pad_in, v->block, (unsigned char *)(uintptr_t)v->in, v->in_at, c->group->size, 1);
}

/* The bytes of each of n blocks from their offsets at[0..n] into used[];
 * returns used. */
static uint64_t *block_bytes(uint64_t *used, const size_t *at, int n)
{
    for (int j = 0; j < n; j++)
        used[j] = (uint64_t)(at[j + 1] - at[j]);
    return used;
}

/* Byte offsets of n blocks of counts[j] elements of esz bytes, end to end:
 * at[0..n]. */
static void offsets(size_t *at, const size_t *counts, int n, size_t esz)
{
    at[0] = 0;
    for (int j = 0; j < n; j++)
        at[j + 1] = at[j] + counts[j] * esz;
}

int ps_all_to_all_v(ps_comm_t *comm, void *out, const size_t *out_counts, const void *in,
                    const size_t *in_counts, ps_dtype_t dtype, ps_group_t *group)
{
    if (!comm) {
        ps__report(NULL, PS_EPRECOND, "all_to_all_v",
                   "paramsync is not initialised (comm is NULL)");
        return PS_EPRECOND;
    }
    int n = (group ? group : &comm->world)->size, a, b;
    int rc = a2av_check(comm, n, out, out_counts, in, in_counts, dtype);
    if (rc < 0)
        return rc;
    size_t esz = ps_dtype_size(dtype), most = 0;
    /* This rank's 2n counts, then every rank's (table), then the byte
     * offsets of its blocks (2 (n + 1)); after those words the bytes of its
     * input and output blocks that are data (2n, block_bytes). */
    size_t words = (size_t)2 * n * (n + 1) + (size_t)2 * (n + 1);
    int64_t *mine = malloc((words + (size_t)2 * n) * sizeof(int64_t)), *table = mine + 2 * n;
    if (!mine) {
        ps__report(comm, PS_ENOMEM, "all_to_all_v", "no memory for the counts");
        return PS_ENOMEM;
    }
    for (int j = 0; j < n; j++) {
        mine[j] = (int64_t)in_counts[j];
        mine[n + j] = (int64_t)out_counts[j];
    }
    /* Every rank's counts, so that every rank checks every pair alike. */
    request_t r =
        req_io("all_to_all_v", K(ALL_GATHER), table, mine, (size_t)2 * n, PS_INT64, 0, group);
    rc = submit(comm, &r, NULL, NULL);
    if (rc == 0 && counts_check(table, n, &most, &a, &b) < 0) {
        ps__report(comm, PS_EPRECOND, "all_to_all_v",
                   "group rank %d sends %lld elements to group rank %d, whose out_counts expect "
                   "%lld",
                   a, (long long)table[(size_t)a * 2 * n + b], b,
                   (long long)table[(size_t)b * 2 * n + n + a]);
        rc = PS_EPRECOND;
    }
    /* The daemon moves equal blocks: each padded to the largest. A side whose
     * blocks are all of that size is read or written in place (not both in
     * one buffer: a call's input and output may not overlap). Peer copies
     * read each pair's own bytes, and touch neither padded buffer: their
     * pages are never faulted in then, so where the ranks share an agent
     * (and may copy) the padded buffers are malloc'd. Elsewhere the call goes
     * through the agents: the buffers are ps_mem_alloc memory kept between
     * calls (ps__scratch_take), which the agent takes in place, 1.4-1.7x
     * faster than plain memory through the process segment at 16-64 MiB
     * (PERFORMANCE.md, "Padded buffers the agent takes in place"). */
    size_t block = most * esz, all = 0;
    if (rc == 0 && block && mul_size(block, (size_t)n, &all) < 0) {
        ps__report(comm, PS_EINVAL, "all_to_all_v", "%d blocks of %zu bytes are too large", n,
                   block);
        rc = PS_EINVAL;
    }
    int own_in = all_of(in_counts, n, most), own_out = all_of(out_counts, n, most);
    if (own_in && own_out && (const unsigned char *)in < (unsigned char *)out + all &&
        (unsigned char *)out < (const unsigned char *)in + all)
        own_out = 0;
    size_t *at = (size_t *)(table + (size_t)2 * n * n);
    ps__a2av_t v = {.in = in, .out = out, .in_at = at, .out_at = at + n + 1, .block = block};
    offsets(at, in_counts, n, esz);
    offsets(at + n + 1, out_counts, n, esz);
    if (!own_in) /* the bytes of each padded input block that are data */
        v.used = block_bytes((uint64_t *)(mine + words), at, n);
    if (!own_out) /* and of each padded output block */
        v.out_used = block_bytes((uint64_t *)(mine + words + n), at + n + 1, n);
    unsigned char *src = own_in ? (unsigned char *)(uintptr_t)in : NULL;
    unsigned char *dst = own_out ? out : NULL, *pad_out = NULL;
    ps_group_t *g = group ? group : &comm->world;
    int kept = !(comm->peer_sets && ps__group_shares_set(comm, g, comm->peer_sets));
    if (rc == 0 && block && !own_in)
        src = v.pad_in = kept ? ps__scratch_take(comm, all) : malloc(all);
    if (rc == 0 && block && !own_out)
        dst = pad_out = kept ? ps__scratch_take(comm, all) : malloc(all);
    if (rc == 0 && block && (!src || !dst)) {
        ps__report(comm, PS_ENOMEM, "all_to_all_v", "no memory for %d padded blocks of %zu bytes",
                   n, block);
        rc = PS_ENOMEM;
    }
    if (rc == 0) {
        r = req_io("all_to_all_v", K(ALL_TO_ALL), dst, src, block, PS_UINT8, 0, group);
        r.v = &v;
        rc = submit(comm, &r, NULL, NULL);
    }
    if (rc == 0 && v.via_agent)
        pad_copy(pad_out, block, out, v.out_at, n, 0);
    if (kept && rc == 0) {
        ps__scratch_give(comm, v.pad_in);
        ps__scratch_give(comm, pad_out);
    } else if (kept) {
        /* A call that failed may have been given up on while an agent
         * still wrote into them: not for the next call. */
        ps_mem_free(comm, v.pad_in);
        ps_mem_free(comm, pad_out);
    } else {
        free(v.pad_in);
        free(pad_out);
    }
    free(mine);
    return rc;
}

/* ---------------------------------------------------------------- non-blocking */

int ps_ibarrier(ps_comm_t *comm, ps_group_t *group, ps_work_t **work)
{
    request_t r = req_barrier(group);
    int rc = need_work(comm, "ibarrier", work);
    return rc < 0 ? rc : submit(comm, &r, work, NULL);
}

int ps_ibroadcast(ps_comm_t *comm, void *buf, size_t count, ps_dtype_t dtype, int src,
                  ps_group_t *group, ps_work_t **work)
{
    request_t r = req_broadcast(buf, count, dtype, src, group);
    int rc = need_work(comm, "ibroadcast", work);
    return rc < 0 ? rc : submit(comm, &r, work, NULL);
}

int ps_iall_reduce(ps_comm_t *comm, void *buf, size_t count, ps_dtype_t dtype, ps_op_t op,
                   ps_group_t *group, ps_work_t **work)
{
    request_t r = req_all_reduce(buf, count, dtype, op, group);
    int rc = need_work(comm, "iall_reduce", work);
    return rc < 0 ? rc : submit(comm, &r, work, NULL);
}

int ps_ireduce_to(ps_comm_t *comm, void *buf, size_t count, ps_dtype_t dtype, ps_op_t op, int dst,
                  ps_group_t *group, ps_work_t **work)
{
    request_t r = req_reduce(buf, count, dtype, op, dst, group);
    int rc = need_work(comm, "ireduce_to", work);
    return rc < 0 ? rc : submit(comm, &r, work, NULL);
}

int ps_iall_gather(ps_comm_t *comm, void *out, const void *in, size_t count, ps_dtype_t dtype,
                   ps_group_t *group, ps_work_t **work)
{
    request_t r = req_io("all_gather", K(ALL_GATHER), out, in, count, dtype, 0, group);
    int rc = need_work(comm, "iall_gather", work);
    return rc < 0 ? rc : submit(comm, &r, work, NULL);
}

int ps_igather(ps_comm_t *comm, void *out, const void *in, size_t count, ps_dtype_t dtype, int dst,
               ps_group_t *group, ps_work_t **work)
{
    request_t r = req_io("gather", K(GATHER), out, in, count, dtype, dst, group);
    int rc = need_work(comm, "igather", work);
    return rc < 0 ? rc : submit(comm, &r, work, NULL);
}

int ps_iscatter(ps_comm_t *comm, void *out, const void *in, size_t count, ps_dtype_t dtype, int src,
                ps_group_t *group, ps_work_t **work)
{
    request_t r = req_io("scatter", K(SCATTER), out, in, count, dtype, src, group);
    int rc = need_work(comm, "iscatter", work);
    return rc < 0 ? rc : submit(comm, &r, work, NULL);
}

int ps_ireduce_scatter(ps_comm_t *comm, void *out, const void *in, size_t count, ps_dtype_t dtype,
                       ps_op_t op, ps_group_t *group, ps_work_t **work)
{
    request_t r = req_reduce_scatter(out, in, count, dtype, op, group);
    int rc = need_work(comm, "ireduce_scatter", work);
    return rc < 0 ? rc : submit(comm, &r, work, NULL);
}

int ps_iall_to_all(ps_comm_t *comm, void *out, const void *in, size_t count, ps_dtype_t dtype,
                   ps_group_t *group, ps_work_t **work)
{
    request_t r = req_io("all_to_all", K(ALL_TO_ALL), out, in, count, dtype, 0, group);
    int rc = need_work(comm, "iall_to_all", work);
    return rc < 0 ? rc : submit(comm, &r, work, NULL);
}

int ps_isend(ps_comm_t *comm, const void *buf, size_t count, ps_dtype_t dtype, int dst, int tag,
             ps_group_t *group, ps_work_t **work)
{
    request_t r = req_send(buf, count, dtype, dst, tag, group);
    int rc = need_work(comm, "isend", work);
    return rc < 0 ? rc : submit(comm, &r, work, NULL);
}

int ps_irecv(ps_comm_t *comm, void *buf, size_t count, ps_dtype_t dtype, int src, int tag,
             ps_group_t *group, ps_work_t **work)
{
    request_t r = req_recv(buf, count, dtype, src, tag, group);
    int rc = need_work(comm, "irecv", work);
    return rc < 0 ? rc : submit(comm, &r, work, NULL);
}
