/*
 * Device collectives: all_reduce, reduce, reduce_scatter and broadcast of
 * CUDA device buffers, run by the ranks on the device, rank to rank, when
 * every rank of the group joined through one agent with CUDA loaded
 * (JoinRequest.cuda_host, JoinEvent.device_sets). Through the agent such a call
 * costs a copy of every input to host memory, the agent's work there, and
 * a copy of every result back; here no byte leaves the GPU:
 *
 *   1. an all_gather (seq s) of each rank's descriptor: its pid, whether its
 *      buffers suit (device memory it could describe, placed as the kind
 *      allows), and for its input and its output the device allocation each
 *      lies in (start, size, CUDA IPC handle) and its address;
 *   2. if every rank's suits, each rank opens the allocations it reads
 *      (ps__ipc_map: kept for later calls); where a rank writes over its
 *      input (an all_reduce or a reduce root in place, a reduce_scatter into
 *      its own input block), an all_reduce (MAX, seq s + 1) of whether each
 *      could, so that no rank writes before the call is sure to run here;
 *      then each does its part on its current device, on the legacy
 *      default stream:
 *        all_reduce      reduces slice `rank` (1/n of the elements) of every
 *                        input into the same slice of its output;
 *        reduce          the root reduces every input into its output;
 *        reduce_scatter  block `rank` of every input into its output;
 *        broadcast       every other rank copies the root's input;
 *   3. an all_reduce (MAX, the next seq) of each rank's outcome;
 *   4. all_reduce only: each rank copies every other rank's slice of the
 *      result from that rank's output into its own, then an all_reduce (MAX,
 *      the next seq) of the outcome, so that no rank returns (and writes
 *      its buffer again) while another still reads it.
 *
 * The slices and the order of the inputs (rank order) are the same on
 * every rank, so every rank gets the same bits. If a rank's buffers do not
 * suit (host memory, memory CUDA cannot describe, a placement the kind does
 * not allow) the call goes through the agent with seq s + 1, the device
 * buffers staged only then (device.c); if a rank could not open another's
 * memory, or its work failed where no rank writes in place, with the number
 * after the step that said so (s + 2). A failure of the work where a rank
 * writes in place cannot be undone: every rank's call fails. A call holds
 * four numbers (s .. s + 3). Whether a call tries this at all is
 * decided before its sequence number, alike on every rank: the kind, its
 * bytes (the input of a reduce_scatter, the buffer of the others) from the
 * kind's floor below (PARAMSYNC_DEVICE_MIN_BYTES, the same on every rank,
 * for all kinds), at most PS_GPU_MAX_SRCS ranks, and every rank of the
 * group in the caller's device set.
 */
#include "internal.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define K(x) PARAMSYNC__V1__COLLECTIVE_KIND__##x

/* Below these the small collectives and the device's switches between the
 * ranks' processes cost more than staging: four ranks on one H200 were
 * 1.1-2.2x faster from 4 MiB (broadcast, reduce, reduce_scatter) and an
 * all_reduce 0.85x at 4 MiB, 1.2-1.6x at 8 MiB, 2.3x at 16 MiB
 * (docs/GPU.md, "Device collectives"). */
#define MIN_BYTES_ALL_REDUCE ((size_t)8 << 20)
#define MIN_BYTES_OTHERS     ((size_t)4 << 20)

#define DEV_MAGIC UINT64_C(0x31766564636c6f63) /* "colcdev1" */
#define FITS      (UINT64_C(1) << 32)

/*
 * A rank's descriptor, 64-bit words in this host's byte order:
 *   0 DEV_MAGIC   1 its pid (low 32 bits) and FITS
 *   2, 3, 4..11  its input's allocation: start (in its process), size, handle
 *   12, 13, 14..21  its output's, likewise
 *   22, 23  its input's and output's addresses (0: none)
 */
enum {
    D_MAGIC,
    D_PID_FITS,
    D_IN,                         /* PS__IPC_WORDS */
    D_OUT = D_IN + PS__IPC_WORDS, /* PS__IPC_WORDS */
    D_IN_ADDR = D_OUT + PS__IPC_WORDS,
    D_OUT_ADDR,
    D_WORDS
};

size_t ps__devcoll_words(void)
{
    return D_WORDS;
}

int ps__devcoll_kind(const ps__coll_t *c)
{
    Paramsync__V1__CollectiveKind k = c->hdr.kind;
    return k == K(ALL_REDUCE) || k == K(REDUCE) || k == K(REDUCE_SCATTER) || k == K(BROADCAST);
}

/* Bytes of one rank's block: the whole buffer, or a reduce_scatter's output. */
static size_t block_bytes(const ps__coll_t *c)
{
    return (size_t)c->hdr.count * ps_dtype_size((ps_dtype_t)c->hdr.dtype);
}

int ps__devcoll_takes(const ps__coll_t *c)
{
    const ps_comm_t *comm = c->comm;
    const ps_group_t *g = c->group;
    if (!comm->device_sets || !g || g->size < 2 || g->size > PS_GPU_MAX_SRCS)
        return 0;
    size_t bytes = block_bytes(c);
    if (c->hdr.kind == K(REDUCE_SCATTER))
        bytes = bytes > SIZE_MAX / (size_t)g->size ? SIZE_MAX : bytes * (size_t)g->size;
    size_t min = comm->device_min_bytes >= 0    ? (size_t)comm->device_min_bytes
                 : c->hdr.kind == K(ALL_REDUCE) ? MIN_BYTES_ALL_REDUCE
                                                : MIN_BYTES_OTHERS;
    if (bytes < min)
        return 0;
    return ps__group_shares_set(comm, g, comm->device_sets);
}

int ps__devcoll_export(ps__coll_t *c, int in_dev, int out_dev)
{
    if ((c->in_bytes && !in_dev) || (c->out_bytes && !out_dev) || (!c->in_bytes && !c->out_bytes))
        return 0;
    if (c->in_bytes && ps_gpu_ipc_export(c->in, &c->peer_ipc) != 0)
        return 0;
    if (c->out_bytes && ps_gpu_ipc_export(c->out, &c->out_ipc) != 0)
        return 0;
    return ps_gpu_get_device(&c->stage_device) == 0;
}

/* Whether c's input and output are placed as its kind allows: apart, or an
 * all_reduce's or reduce's one buffer, or a reduce_scatter's output exactly
 * its own input block. */
static int placed_ok(const ps__coll_t *c)
{
    if (!ps__overlap(c->in, c->in_bytes, c->out, c->out_bytes))
        return 1;
    if (c->hdr.kind == K(REDUCE_SCATTER))
        return c->out == (const char *)c->in + (size_t)c->hdr.rank * block_bytes(c);
    return c->in == c->out && c->in_bytes == c->out_bytes;
}

/* This rank's descriptor, into d. */
static void describe(const ps__coll_t *c, uint64_t *d)
{
    memset(d, 0, D_WORDS * sizeof(*d));
    d[D_MAGIC] = DEV_MAGIC;
    /* Its input is complete before any rank can read it. */
    int fits = c->peer_dev && placed_ok(c) && ps_gpu_set_device(c->stage_device) == 0 &&
               ps_gpu_fence() == 0;
    d[D_PID_FITS] = (uint64_t)(uint32_t)getpid() | (fits ? FITS : 0);
    if (!fits)
        return;
    if (c->in_bytes) {
        ps__ipc_put(&d[D_IN], &c->peer_ipc);
        d[D_IN_ADDR] = (uint64_t)(uintptr_t)c->in;
    }
    if (c->out_bytes) {
        ps__ipc_put(&d[D_OUT], &c->out_ipc);
        d[D_OUT_ADDR] = (uint64_t)(uintptr_t)c->out;
    }
}

/* The bytes rank i of c's group has in its input and its output. */
static void rank_bytes(const ps__coll_t *c, int i, size_t *in, size_t *out)
{
    size_t b = block_bytes(c);
    int root = (int)c->hdr.root;
    switch (c->hdr.kind) {
    case K(ALL_REDUCE):
        *in = *out = b;
        break;
    case K(REDUCE):
        *in = b;
        *out = i == root ? b : 0;
        break;
    case K(REDUCE_SCATTER):
        *in = b * (size_t)c->group->size;
        *out = b;
        break;
    default: /* BROADCAST */
        *in = i == root ? b : 0;
        *out = i == root ? 0 : b;
        break;
    }
}

/* Whether every one of the n descriptors at d fits: every rank's buffers
 * device memory inside the allocations they name. A read past an
 * allocation would fault the reader's CUDA context. */
static int all_fit(const ps__coll_t *c, const uint64_t *d, int n)
{
    for (int i = 0; i < n; i++) {
        const uint64_t *x = d + (size_t)i * D_WORDS;
        size_t in, out;
        rank_bytes(c, i, &in, &out);
        if (x[D_MAGIC] != DEV_MAGIC || !(x[D_PID_FITS] & FITS) || !(uint32_t)x[D_PID_FITS] ||
            (in && !ps__ipc_inside(&x[D_IN], x[D_IN_ADDR], in)) ||
            (out && !ps__ipc_inside(&x[D_OUT], x[D_OUT_ADDR], out)))
            return 0;
    }
    return 1;
}

/* Whether a rank of the n descriptors at d writes over its input (an
 * all_reduce's or reduce root's one buffer, a reduce_scatter into its own
 * input block): a call through the agent after that rank began its work
 * would reduce what it wrote. Alike on every rank. */
static int any_in_place(const ps__coll_t *c, const uint64_t *d, int n)
{
    for (int i = 0; i < n; i++) {
        const uint64_t *x = d + (size_t)i * D_WORDS;
        size_t in, out;
        rank_bytes(c, i, &in, &out);
        if (in && out &&
            ps__overlap((const void *)(uintptr_t)x[D_IN_ADDR], in,
                        (const void *)(uintptr_t)x[D_OUT_ADDR], out))
            return 1;
    }
    return 0;
}

/* Where rank x's input (out: output) is in this process (held in h); NULL
 * if it cannot be mapped. */
static uint8_t *buffer_of(ps__ipc_held_t *h, const uint64_t *x, int out)
{
    return ps__ipc_held_at(h, (uint32_t)x[D_PID_FITS], &x[out ? D_OUT : D_IN],
                           x[out ? D_OUT_ADDR : D_IN_ADDR]);
}

/* Slice q of an all_reduce of count elements of size esz among n ranks:
 * *first and *len in bytes. Slices are whole multiples of 256 bytes (the
 * kernels' vector loads stay aligned), the last ones shorter or empty. */
static void slice(size_t count, size_t esz, int n, int q, size_t *first, size_t *len)
{
    size_t per = (count + (size_t)n - 1) / (size_t)n, unit = 256 / esz;
    per = (per + unit - 1) / unit * unit;
    size_t a = (size_t)q * per, b = a + per;
    a = a < count ? a : count;
    b = b < count ? b : count;
    *first = a * esz;
    *len = (b - a) * esz;
}

/* Opens what this rank reads in step 2 (and an all_reduce's step 4): the
 * other ranks' inputs in[i] and outputs out[i], rank order (NULL where it
 * reads none; its own buffers where i is itself). 0, or -1 if one cannot
 * be opened. */
static int open_all(const ps__coll_t *c, const uint64_t *d, int n, ps__ipc_held_t *h, uint8_t **in,
                    uint8_t **out)
{
    Paramsync__V1__CollectiveKind k = c->hdr.kind;
    int me = (int)c->hdr.rank, root = (int)c->hdr.root;
    int reads = k == K(ALL_REDUCE) || k == K(REDUCE_SCATTER) || (k == K(REDUCE) && me == root);
    for (int i = 0; i < n; i++) {
        const uint64_t *x = d + (size_t)i * D_WORDS;
        in[i] = out[i] = NULL;
        if (i == me) {
            in[i] = (uint8_t *)(uintptr_t)c->in;
            out[i] = c->out;
            continue;
        }
        if ((reads || (k == K(BROADCAST) && i == root && me != root)) &&
            !(in[i] = buffer_of(h, x, 0)))
            return -1;
        /* An all_reduce's second part reads the others' outputs. */
        if (k == K(ALL_REDUCE) && !(out[i] = buffer_of(h, x, 1)))
            return -1;
    }
    return 0;
}

/* This rank's part of step 2, on what open_all opened: 0, or -1 if it
 * failed (its output, and an input it writes over, may be half written). */
static int work(const ps__coll_t *c, int n, uint8_t **in)
{
    Paramsync__V1__CollectiveKind k = c->hdr.kind;
    int me = (int)c->hdr.rank, root = (int)c->hdr.root;
    ps_dtype_t dt = (ps_dtype_t)c->hdr.dtype;
    size_t esz = ps_dtype_size(dt), b = block_bytes(c);
    int rc = 0;
    const void *srcs[PS_GPU_MAX_SRCS];
    if (k == K(ALL_REDUCE)) {
        size_t first, len;
        slice((size_t)c->hdr.count, esz, n, me, &first, &len);
        for (int i = 0; i < n; i++)
            srcs[i] = in[i] + first;
        rc = ps_gpu_reduce_multi((ps_op_t)c->hdr.op, dt, (uint8_t *)c->out + first, srcs, (size_t)n,
                                 len / esz, NULL);
    } else if (k == K(REDUCE_SCATTER)) {
        for (int i = 0; i < n; i++)
            srcs[i] = in[i] + (size_t)me * b;
        rc = ps_gpu_reduce_multi((ps_op_t)c->hdr.op, dt, c->out, srcs, (size_t)n, c->hdr.count,
                                 NULL);
    } else if (k == K(REDUCE) && me == root) {
        for (int i = 0; i < n; i++)
            srcs[i] = in[i];
        rc = ps_gpu_reduce_multi((ps_op_t)c->hdr.op, dt, c->out, srcs, (size_t)n, c->hdr.count,
                                 NULL);
    } else if (k == K(BROADCAST) && me != root) {
        rc = ps_gpu_memcpy_async(c->out, in[root], b, NULL);
    }
    if (ps_gpu_stream_synchronize(NULL) != 0)
        rc = -1;
    return rc == 0 ? 0 : -1;
}

/* An all_reduce's step 4: this rank copies every other rank's slice of the
 * result into its output. 0 or -1. */
static int gather_slices(const ps__coll_t *c, int n, uint8_t **out)
{
    size_t esz = ps_dtype_size((ps_dtype_t)c->hdr.dtype);
    int me = (int)c->hdr.rank, rc = 0;
    for (int j = 1; j < n && rc == 0; j++) {
        int q = (me + j) % n; /* not every rank at rank 0 first */
        size_t first, len;
        slice((size_t)c->hdr.count, esz, n, q, &first, &len);
        if (len)
            rc = ps_gpu_memcpy_async((uint8_t *)c->out + first, out[q] + first, len, NULL);
    }
    if (ps_gpu_stream_synchronize(NULL) != 0)
        rc = -1;
    return rc == 0 ? 0 : -1;
}

/* The names the steps' failures are reported under: step 0 the addresses,
 * 1 the opening (calls that write in place), 2 the work, 3 an all_reduce's
 * gathering. */
static const char *step_name(const ps__coll_t *c, int step)
{
#define PS__DEVCOLL_STEPS(kind)                                                                    \
    {                                                                                              \
        kind " (device addresses)", kind " (device memory opened)", kind " (device work done)",    \
            kind " (device result gathered)"                                                       \
    }
    static const char *names[4][4] = {PS__DEVCOLL_STEPS("all_reduce"), PS__DEVCOLL_STEPS("reduce"),
                                      PS__DEVCOLL_STEPS("reduce_scatter"),
                                      PS__DEVCOLL_STEPS("broadcast")};
#undef PS__DEVCOLL_STEPS
    Paramsync__V1__CollectiveKind k = c->hdr.kind;
    int row = k == K(ALL_REDUCE) ? 0 : k == K(REDUCE) ? 1 : k == K(REDUCE_SCATTER) ? 2 : 3;
    return names[row][step];
}

/* Reports a device collective that cannot be undone and fails the call. */
static int lost(const ps__coll_t *c, const char *what)
{
    char name[96];
    ps__coll_what(c, name, sizeof(name));
    ps__report(c->comm, PS_EINTERNAL, name, "%s", what);
    return PS_EINTERNAL;
}

/* One small all_reduce (MAX) of each rank's flag at seq: 0 with *flag the
 * largest, or the failure, reported. */
static int agree(const ps__coll_t *c, int step, int32_t *flag, uint64_t seq)
{
    return ps__coll_sub(c, step_name(c, step), K(ALL_REDUCE), PS_MAX, PS_INT32, 1, flag, flag, seq);
}

int ps__devcoll_run(ps__coll_t *c, uint64_t *all, int *rc)
{
    int n = c->group->size;
    uint64_t seq = c->hdr.seq, *mine = all + (size_t)n * D_WORDS;
    describe(c, mine);
    *rc = ps__coll_sub(c, step_name(c, 0), K(ALL_GATHER), PS_SUM, PS_UINT8, D_WORDS * sizeof(*mine),
                       mine, all, seq);
    int fit = *rc == 0 && all_fit(c, all, n);
    int in_place = fit && any_in_place(c, all, n);
    ps__ipc_held_t h;
    uint8_t *in[PS_GPU_MAX_SRCS], *out[PS_GPU_MAX_SRCS];
    int32_t failed =
        fit && (ps__ipc_held_init(&h, c->comm, 2 * n) < 0 || open_all(c, all, n, &h, in, out) < 0);
    free(all);
    uint64_t next = seq + 1; /* the number of the next step */
    /* A rank that writes over its input may begin only once every rank has
     * opened what it reads: until then the call can still go through the
     * agent. */
    if (*rc == 0 && in_place)
        *rc = agree(c, 1, &failed, next++);
    /* Every rank takes the work's step, also one that could not open what
     * it reads (its call then goes through the agent with the others'). */
    if (*rc == 0 && fit && !(in_place && failed)) {
        if (!failed)
            failed = work(c, n, in) < 0;
        *rc = agree(c, 2, &failed, next++);
        if (*rc == 0 && failed && in_place)
            *rc = lost(c, "a rank's work on the device failed after it may have written over its "
                          "input: the call cannot be repeated through the agent");
        if (*rc == 0 && !failed && c->hdr.kind == K(ALL_REDUCE)) {
            int32_t copied = gather_slices(c, n, out) == 0 ? 0 : 1;
            *rc = agree(c, 3, &copied, next++);
            if (*rc == 0 && copied)
                *rc = lost(c, "a rank could not copy the other ranks' slices of the result on "
                              "the device");
        }
    }
    if (fit)
        ps__ipc_held_release(&h);
    if (*rc < 0 || (fit && !failed))
        return 1;
    /* Through the agent, under the next number: device buffers left where
     * they lay are staged now. */
    c->hdr.seq = next;
    *rc = ps__stage_deferred(c);
    return *rc < 0;
}
