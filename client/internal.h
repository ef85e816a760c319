/* Internals of libparamsync shared by the files of client/; never installed. */
#ifndef PS_CLIENT_INTERNAL_H
#define PS_CLIENT_INTERNAL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include <paramsync/gpu.h>
#include <paramsync/paramsync.h>

#include "frame.h"
#include "rpc.h"

#define PS__METHOD_JOIN       "/paramsync.v1.Worker/Join"
#define PS__METHOD_LEAVE      "/paramsync.v1.Worker/Leave"
#define PS__METHOD_NEW_GROUP  "/paramsync.v1.Worker/NewGroup"
#define PS__METHOD_COLLECTIVE "/paramsync.v1.Worker/Collective"
#define PS__METHOD_SHM_ATTACH "/paramsync.v1.Worker/ShmAttach"
#define PS__METHOD_SHM_DETACH "/paramsync.v1.Worker/ShmDetach"

/* torch's default collective timeout. */
#define PS__DEFAULT_TIMEOUT_MS (30 * 60 * 1000)
/* Frame payload size: large enough that per-frame costs vanish, small enough
 * that sending and receiving overlap well. PARAMSYNC_CHUNK_BYTES tunes it. */
#define PS__DEFAULT_CHUNK_BYTES (1u << 20)
/* The client's gRPC deadline trails the daemon's own by this much, so that the
 * daemon's DEADLINE_EXCEEDED, which names the missing ranks, arrives first. */
#define PS__DEADLINE_GRACE_MS 5000
/* Control calls (Leave) that must not hold up shutdown. */
#define PS__CONTROL_TIMEOUT_MS 10000
/* The last ps_finalize waits at most this long for the library's kept
 * threads to end and for gRPC to shut down (comm.c, comm_free). */
#define PS__FINALIZE_WAIT_MS 2000

struct ps_group {
    ps_comm_t *comm;
    uint32_t id; /* 0: the whole job; else the rank's count of ps_new_group calls */
    int rank;    /* the caller's group rank, -1 when not a member */
    int size;
    int *ranks; /* job ranks in group-rank order */
    /* Sequence numbers the daemon matches calls by (guarded by comm->lock). */
    uint64_t coll_seq;
    uint64_t recv_seq;
    uint64_t *send_seq; /* per destination group rank */
    /* Direct barriers (barrier.c): the barriers called that may meet directly
     * (comm->lock); the setup steps ended here (comm->lock, comm->cond); the
     * page, which once step 2 has ended says the outcome (NULL: through the
     * agent); rank 0's name of the page until it unlinks it. */
    uint64_t bar_calls;
    int bar_setup;
    struct ps__bar_page *bar_page;
    char bar_name[64];
};

/* An uneven all_to_all (ps_all_to_all_v, api.c). The daemon moves equal
 * blocks, so through the agent the call's in and out are buffers of blocks
 * padded to the largest, filled (ps__a2av_pack) only when it goes that way;
 * peer copies (peer.c) read each pair's own bytes between the caller's
 * buffers instead. Block j of the caller's input is in + in_at[j] up to
 * in + in_at[j + 1]; of its output, out + out_at[j] up to out_at[j + 1]. */
typedef struct ps__a2av {
    const unsigned char *in;
    unsigned char *out;
    const size_t *in_at, *out_at; /* n + 1 byte offsets each */
    size_t block;                 /* a padded block's bytes */
    unsigned char *pad_in;        /* NULL where the caller's input is sent as it is */
    int via_agent;                /* set by ps__a2av_pack: the output comes padded */
    uint64_t *used;     /* the input blocks' bytes, CollectiveHeader.block_used; NULL if all full */
    uint64_t *out_used; /* the output blocks' (block_out_used); NULL if all full */
} ps__a2av_t;

/* One collective call of this rank, resolved to the bytes it sends and receives. */
typedef struct ps__coll {
    ps_comm_t *comm;
    const char *name; /* the API's name ("all_reduce"), for messages */
    Paramsync__V1__CollectiveHeader hdr;
    const void *in;
    size_t in_bytes;
    void *out;
    size_t out_bytes;
    uint8_t *shm_out;        /* output in the shared segment, when this call uses it */
    struct ps__mem *mem;     /* the registered segment this call uses (shm.c), or NULL */
    struct ps__mem *mem_out; /* a second one that holds the output (shm_out), or NULL */
    struct ps__shm *seg;     /* else the payload segment (or spare) it uses, or NULL */
    /* Device buffers (device.c): when the caller's in or out is device memory,
     * in/out point into this pinned buffer instead, and the result goes to
     * stage_dev_out once the call has succeeded. */
    void *stage_pinned;
    size_t stage_bytes;
    int stage_kind; /* what stage_pinned is: PS__STAGE_DRIVER... (device.c) */
    void *stage_dev_out;
    int stage_device; /* the caller's current CUDA device, for the copy back */
    /* Device peer copies (peer.c): the input is device memory, described by
     * peer_ipc, that the other ranks read where it lies (CUDA IPC); nothing
     * is staged unless the call goes through the agent after all, and then
     * the output too when defer_out_dev (ps__stage_deferred). */
    int peer_dev;
    int defer_in_dev, defer_out_dev;
    ps_gpu_ipc_t peer_ipc; /* the input's allocation */
    ps_gpu_ipc_t out_ipc;  /* the output's, for device collectives (devcoll.c) */
    int source;            /* RECV: the sender's group rank, once done */
    struct ps_group *group;
    /* Peer copies (peer.c): room for every rank's descriptor, set when this
     * call takes them and so holds seqs hdr.seq .. hdr.seq + 2 (NULL once
     * ps__peer_run has begun). */
    void *peer_descs;
    ps__a2av_t *v; /* an uneven all_to_all's layout, or NULL */
    /* A barrier that may meet directly (barrier.c): its number among the
     * group's such barriers, from 1; 0 for any other call. */
    uint64_t bar_k;

    /* While the call is in flight it is on comm's list, so that a lost member
     * can cancel it (the list and `call` are guarded by comm->lock). */
    ps__rpc_call_t *call;
    struct ps__coll *prev, *next;

    /* Input frames reference the caller's buffer; gRPC may hold them after a
     * send completes, so the collective does not return before they are all
     * released. */
    pthread_mutex_t lock;
    pthread_cond_t released;
    size_t pending_releases;
} ps__coll_t;

/* A pinned staging buffer for device buffers (device.c): size bytes at p,
 * of kind PS__STAGE_*: the driver's pinned memory (ps_gpu_host_alloc), our
 * own huge-page mapping pinned by registering, or a registered segment the
 * agent maps (ps__mem_stage_alloc). */
enum { PS__STAGE_DRIVER, PS__STAGE_MAPPED, PS__STAGE_SEGMENT };
typedef struct ps__pinned {
    void *p;
    size_t size;
    int kind;
} ps__pinned_t;

/* Another rank's memory mapped here (peer.c): a device allocation opened
 * by CUDA IPC, or the file of a ps_mem_alloc segment. */
#define PS__IPC_MAPS 32
typedef struct ps__ipc_map {
    void *at;     /* where it is mapped here; NULL: a free slot */
    uint32_t pid; /* the process that exported it */
    /* the CUDA IPC handle; a segment: its file's device and inode */
    unsigned char handle[PS_GPU_IPC_HANDLE_BYTES];
    size_t len;    /* a segment: the bytes mapped; 0: a device allocation */
    int fd;        /* a segment: the number of its file in process pid */
    int users;     /* copies reading it now */
    uint64_t used; /* the comm's ipc_clock when last used: the oldest unused one goes */
} ps__ipc_map_t;

/* Scratch buffers ps_comm keeps (ps__scratch_take): how many, and the largest
 * by default (PARAMSYNC_SCRATCH_BYTES). One not kept is a fresh segment the
 * next call faults in page by page: a 256 MiB uneven all_to_all across
 * agents, whose padded buffers are 429 MB each, took 6.0 s a call under a
 * 256 MiB cap and 1.5 s kept (PERFORMANCE.md). */
#define PS__SCRATCH_KEEP          2
#define PS__SCRATCH_DEFAULT_BYTES ((size_t)1 << 30)

struct ps_comm {
    pthread_mutex_t lock;
    pthread_cond_t cond; /* join state changes, in-flight list empties */

    ps__rpc_channel_t *channel;
    char *job;
    char *target;
    int rank;
    int world_size;
    uint64_t incarnation;
    int64_t timeout_ms;
    int64_t join_timeout_ms;
    size_t chunk_bytes;

    ps_group_t world;
    uint32_t *peer_sets;      /* JoinEvent.peer_sets by job rank (peer.c), or NULL */
    uint32_t *device_sets;    /* JoinEvent.device_sets by job rank (devcoll.c), or NULL */
    uint32_t *barrier_sets;   /* JoinEvent.barrier_sets by job rank (barrier.c), or NULL */
    int64_t device_min_bytes; /* PARAMSYNC_DEVICE_MIN_BYTES, -1: each kind's default */
    /* This process to its peers, set at Join when it asks for peer copies:
     * its PID namespace, and a random number peers read to know they read
     * this process. */
    uint64_t peer_pidns_dev, peer_pidns_ino;
    uint64_t peer_nonce;
    ps_group_t **groups; /* groups[i] has id i + 1 */
    uint32_t ngroups;

    ps__coll_t *inflight;
    /* Once set, the job cannot go on: every collective fails with it. */
    int broken;
    char *broken_msg;

    /* The Join stream, open for the life of the comm. */
    ps__rpc_call_t *join_call;
    pthread_t join_thread;
    int join_thread_started;
    int ready;                  /* READY arrived */
    int join_ended;             /* the stream is over */
    int leaving;                /* Leave was sent: the end of the stream is expected */
    int finalizing;             /* no new call may start */
    ps__rpc_call_t *leave_call; /* Leave in flight: the stream's failure cancels it */
    int join_err;               /* why the stream ended before READY */
    char *join_msg;             /* its message (malloc'd) */
    int requested_rank;

    ps_error_fn error_fn;
    void *error_arg;

    struct ps__shm *shm;             /* the shared-memory segment (shm.c), or NULL */
    struct ps__shm *spares;          /* more of them, for collectives beside (shm.c) */
    struct ps__doorbells *doorbells; /* the doorbell segments (shm.c), or NULL */
    struct ps__shm *process;         /* the process segment (shm.c), or NULL */
    struct ps__mem *mem;             /* registered memory, ps_mem_alloc (shm.c) */
    /* ps_all_to_all_v's padded buffers kept for the next call, largest first
     * (ps__scratch_take; guarded by lock): ps_mem_alloc memory. */
    struct {
        void *p;
        size_t size;
    } scratch[PS__SCRATCH_KEEP];
    size_t scratch_max; /* the largest kept (PARAMSYNC_SCRATCH_BYTES) */

    /* Pinned staging buffers kept between calls on device buffers, one of each
     * slot (device.c; guarded by lock): page-locking memory costs far more
     * than the copy. */
    ps__pinned_t stage_cache[2]; /* [0] memory of our own, [1] a segment the agent maps */
    int stage_segments_off;      /* the agent cannot map our staging segments (shm.c) */

    /* Other ranks' device allocations mapped here for device peer copies
     * (peer.c; guarded by lock), kept for the next call on the same buffers:
     * opening one costs more than copying a few MiB. */
    ps__ipc_map_t ipc_maps[PS__IPC_MAPS];
    uint64_t ipc_clock;
};

/* ---- device buffers (device.c) ---- */

/** Sets *in_dev / *out_dev to whether c->in / c->out are CUDA device (or
 * managed) memory. Host pointers cost one cached check. Returns 0, or a
 * PS_E* code from cudaPointerGetAttributes after reporting it. */
int ps__stage_classify(const ps__coll_t *c, int *in_dev, int *out_dev);

/** Whether p is CUDA device (or managed) memory: 0 with *dev set (0 where CUDA
 * cannot be in use), or a negative PS_E* when CUDA cannot tell. */
int ps__is_device(const void *p, int *dev);

/** Stages the buffers flagged as device memory: takes a pinned buffer,
 * copies a device input into it (synchronously) and points c->in / c->out
 * into it, remembering the device output for ps__stage_end. Returns 0 (also
 * when nothing is flagged); on error, PS_ENOMEM / PS_EUNAVAIL / ... after
 * reporting why, and c is as it was. */
int ps__stage_buffers(ps__coll_t *c, int in_dev, int out_dev);

/** ps__stage_classify, then ps__stage_buffers. */
int ps__stage_begin(ps__coll_t *c);

/** ps__stage_begin for a call about to take its sequence number, but a
 * device input that device peer copies can read where it lies (CUDA IPC) is
 * left there: c->peer_dev set, nothing staged. Returns as ps__stage_begin. */
int ps__stage_prepare(ps__coll_t *c);

/** Stages what ps__stage_prepare left unstaged, when the call is to go
 * through the agent after all. Returns as ps__stage_buffers; 0 when nothing
 * was left. */
int ps__stage_deferred(ps__coll_t *c);

/** Ends c's staging before c's last use of comm: when rc is 0, copies the
 * result to the caller's device buffer (which is untouched otherwise);
 * gives the pinned buffer back. Returns rc, or the copy's error, reported.
 * No-op returning rc when c staged nothing. */
int ps__stage_end(ps__coll_t *c, int rc);

/** Frees the comm's cached pinned buffer and closes the other ranks'
 * device allocations it mapped (finalize). */
void ps__stage_free(ps_comm_t *comm);

/* ---- shared memory (shm.c) ---- */

/** Puts c's input in the comm's shared segment (or finds it in registered
 * memory) and marks its header, when the agent is on this host and the
 * payload is large enough for a call (any size when the doorbell is to be
 * rung instead: rung). Returns 1 when c uses shared memory, 0 when it goes
 * over gRPC. Never fails: any problem means gRPC. */
int ps__shm_begin(ps_comm_t *comm, ps__coll_t *c, int rung);

/** Releases the segment after c (no-op when c did not use it). */
void ps__shm_end(ps_comm_t *comm, ps__coll_t *c);

/** PARAMSYNC_SHM=0 now (read on every collective): payloads over gRPC only. */
int ps__shm_off(void);

/** 1 when the input and output that have bytes lie in one allocation of
 * ps_mem_alloc(comm) that the agent shares and would read and write in
 * place, through its mapping (shm.c, mem_begin), in a collective that
 * touches `touched` bytes of its ranks' segments (summed over them): not
 * over the agent's --shm-resident-bytes (ShmAttachResponse.resident_bytes;
 * an agent that does not say maps them always). Else 0: plain memory, read
 * through the segment's file, or two allocations: the agent takes those in
 * place too (CollectiveHeader.shm_out), but peer copies measured about as
 * fast there and spare the agent's CPU (PERFORMANCE.md, "Input and output
 * in two allocations"), so the peer rule (peer.c) asks of one only. */
int ps__mem_in_place(ps_comm_t *comm, const void *in, size_t in_bytes, const void *out,
                     size_t out_bytes, uint64_t touched);

/** The file of the ps_mem_alloc(comm) segment that holds [ptr, ptr + len)
 * whole, kept open for peer copies (client/peer.c maps it from the other
 * ranks), with where the segment starts here and its bytes; -1 when there
 * is none (plain memory, a small allocation, PARAMSYNC_SHM=0). */
int ps__mem_file(ps_comm_t *comm, const void *ptr, size_t len, uint64_t *base, uint64_t *size);

/** Asks for huge pages under c's buffers in and out (c->in and c->out, or
 * for peer copies the ones the ranks read) from the second time they come
 * (shm.c, collapse()): another process copies them faster, with
 * process_vm_readv/writev, on huge pages. */
void ps__collapse_buffers(const ps__coll_t *c, const void *in, size_t in_bytes, const void *out,
                          size_t out_bytes);

/** Runs c through the doorbell segment when it can (the agent is on this host,
 * the doorbell is free, and input and output fit in it or in the payload
 * segment or registered memory, which the agent takes): returns 1 with *rc and
 * *msg (malloc'd, on error) set, or 0 when c must go as a gRPC call. */
int ps__doorbell_run(ps_comm_t *comm, ps__coll_t *c, int *rc, char **msg);

/** Unmaps the comm's segments (finalize). */
void ps__shm_free(ps_comm_t *comm);

/** A buffer of at least `bytes` for blocks the client composes itself (an
 * uneven all_to_all's padded ones): one kept from an earlier call, else new
 * ps_mem_alloc memory, which the agent takes in place beside the call's
 * other buffer (CollectiveHeader.shm_out) and whose pages are in place when
 * it is taken again; NULL when out of memory. Give it back with
 * ps__scratch_give (p NULL: nothing). */
void *ps__scratch_take(ps_comm_t *comm, size_t bytes);
void ps__scratch_give(ps_comm_t *comm, void *p);

#define PS__HUGE_PAGE ((size_t)2 << 20)

/** An anonymous private mapping of `size` bytes (a multiple of
 * PS__HUGE_PAGE) aligned to a huge page and advised to be on huge ones
 * (MADV_HUGEPAGE), untouched; NULL when it cannot be mapped. munmap frees
 * it. */
void *ps__huge_map(size_t size);

/* A staging buffer for device.c in a registered segment the agent maps,
 * pinned for CUDA: NULL where there is none (shm.c, ps__mem_stage_alloc). */
void *ps__mem_stage_alloc(ps_comm_t *comm, size_t bytes, size_t *size);
void ps__mem_stage_free(ps_comm_t *comm, void *p, int detach);

/* ---- errors (comm.c) ---- */

/** Formats "<what>: <message>" and hands it to comm's error handler (or to
 * stderr when comm is NULL). Never fails; a message that cannot be built is
 * reported as the bare code. */
void ps__report(ps_comm_t *comm, int err, const char *what, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/** malloc'd printf; NULL on ENOMEM. */
char *ps__strdupf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* ---- in-flight calls (comm.c) ---- */

/*
 * Every collective is on its comm's in-flight list from the moment it is
 * started (in the caller's thread, with its sequence number) until it has
 * finished with the comm, so that ps_finalize can wait for it and a lost
 * member can cancel its call.
 */

/** Links coll. Called with comm->lock held. */
void ps__inflight_link(ps_comm_t *comm, ps__coll_t *coll);

/** Unlinks coll (called with comm->lock held) and wakes ps_finalize. */
void ps__inflight_unlink(ps_comm_t *comm, ps__coll_t *coll);

/** 0 while comm takes calls; else the comm's broken code (or PS_ECANCELLED
 * while finalizing) with *msg (malloc'd; NULL on ENOMEM) saying why. */
int ps__comm_over(ps_comm_t *comm, char **msg);

/** Makes call cancellable through coll. Returns 0, or the comm's broken code
 * (or PS_ECANCELLED while finalizing) with *msg (malloc'd; NULL on ENOMEM)
 * saying why; then call is not attached. */
int ps__inflight_attach(ps_comm_t *comm, ps__coll_t *coll, ps__rpc_call_t *call, char **msg);

/** Detaches the call before it is destroyed. */
void ps__inflight_detach(ps_comm_t *comm, ps__coll_t *coll);

/** Unlinks coll: its last use of comm. */
void ps__inflight_remove(ps_comm_t *comm, ps__coll_t *coll);

/* ---- init methods (init_method.c) ---- */

/* Where the agent is, and what the init method says about the job. */
typedef struct ps__endpoint {
    char *target;   /* gRPC target; NULL for file:// until the file is read */
    char *file;     /* file:// path holding the agent's address, else NULL */
    char *job;      /* from the method (?job=, the file path), else NULL */
    int world_size; /* from the method's query, else -1 */
    int rank;       /* from the method's query, else -1 */
} ps__endpoint_t;

/** Parses an init method (NULL means "env://"). Returns 0, or PS_EINVAL with
 * *errmsg (malloc'd) saying why. On success the caller clears *ep. */
int ps__endpoint_parse(const char *init_method, ps__endpoint_t *ep, char **errmsg);

/** For file://: waits up to timeout_ms for the file to name the agent and
 * sets ep->target. Returns 0, PS_ETIMEDOUT or PS_ENOMEM, with *errmsg. */
int ps__endpoint_wait_file(ps__endpoint_t *ep, int64_t timeout_ms, char **errmsg);

/** Frees what ep holds. Accepts a zeroed endpoint. */
void ps__endpoint_clear(ps__endpoint_t *ep);

/** Reads a positive integer from the environment: 0 and *out set, 1 when the
 * variable is unset or empty, PS_EINVAL when it is not a number in [min, max]. */
int ps__env_int(const char *name, int64_t min, int64_t max, int64_t *out);

/* ---- collectives (collective.c) ---- */

/** Runs one collective call to completion: streams coll->in out and
 * coll->out in, concurrently. Returns 0 or PS_E*; errors are reported
 * through the comm's handler. Does not return before gRPC has released
 * every reference to coll->in. */
int ps__coll_run(ps__coll_t *coll);

/** Runs a collective of its own for a step of parent's call (peer.c): on
 * parent's group, with sequence number seq, reported under name. */
int ps__coll_sub(const ps__coll_t *parent, const char *name, Paramsync__V1__CollectiveKind kind,
                 ps_op_t op, ps_dtype_t dtype, size_t count, const void *in, void *out,
                 uint64_t seq);

/** Fills an uneven all_to_all's padded input (api.c) and marks it gone
 * through the agent, whose output the caller unpacks; no-op when c is not
 * one. */
void ps__a2av_pack(ps__coll_t *c);

/* ---- peer copies (peer.c) ---- */

/** Whether this process asks for peer copies at Join: not with
 * PARAMSYNC_PEER_COPY=0, nor with PARAMSYNC_SHM=0 (payloads over gRPC only),
 * nor where the kernel lets no process read its peers (Yama ptrace_scope 1
 * or more). When it does, sets comm's PID namespace and nonce. */
int ps__peer_wanted(ps_comm_t *comm);

/** Whether c takes peer copies: decided alike on every rank of its group,
 * before it takes a sequence number. */
int ps__peer_takes(const ps__coll_t *c);

/** Whether device peer copies may read device inputs where they lie (CUDA
 * IPC): not with PARAMSYNC_CUDA_IPC=0. */
int ps__peer_ipc_wanted(void);

/** Closes every device allocation and segment of another rank that comm
 * mapped. */
void ps__peer_ipc_close_all(ps_comm_t *comm);

/** Maps the device allocation ipc of process pid (another rank's), or finds
 * it mapped: its address here, or NULL. *slot is its place in comm's maps,
 * -1 when it is mapped for this use alone: ps__ipc_unmap gives it back once
 * the copies that read it are done. */
void *ps__ipc_map(ps_comm_t *comm, uint32_t pid, const ps_gpu_ipc_t *ipc, int *slot);
void ps__ipc_unmap(ps_comm_t *comm, int slot, void *at);

/* A device allocation in a descriptor (peer.c, devcoll.c): three fields,
 * PS__IPC_WORDS 64-bit words: where it starts in its process, its bytes,
 * its CUDA IPC handle. */
#define PS__IPC_WORDS (2 + PS_GPU_IPC_HANDLE_BYTES / 8)
void ps__ipc_put(uint64_t *words, const ps_gpu_ipc_t *ipc);

/** Whether [addr, addr + len) lies in the allocation the words describe. */
int ps__ipc_inside(const uint64_t *words, uint64_t addr, size_t len);

/* The other ranks' device allocations one call maps, held until its copies
 * are done (ps__ipc_held_release). */
typedef struct ps__ipc_held {
    ps_comm_t *comm;
    int n, cap;
    int *slots; /* ps__ipc_map's slot of each */
    void **at;
} ps__ipc_held_t;

/** Room for cap mappings: 0 or PS_ENOMEM. */
int ps__ipc_held_init(ps__ipc_held_t *h, ps_comm_t *comm, int cap);

/** Where address addr of process pid, in the allocation the words describe,
 * is in this process: addr itself when pid is this process, else in the
 * allocation mapped here (held); NULL if it cannot be mapped. */
void *ps__ipc_held_at(ps__ipc_held_t *h, uint32_t pid, const uint64_t *words, uint64_t addr);

/** Gives back every mapping held, and the room. */
void ps__ipc_held_release(ps__ipc_held_t *h);

/** Whether c's kind is one that device collectives run (devcoll.c): all_reduce,
 * reduce, reduce_scatter, broadcast. */
int ps__devcoll_kind(const ps__coll_t *c);

/** Whether a device collective would take c: decided alike on every rank of
 * its group (JoinEvent.device_sets, the sizes), before its sequence number. */
int ps__devcoll_takes(const ps__coll_t *c);

/** JoinRequest.cuda_host: 0 unless CUDA is loaded here and neither
 * PARAMSYNC_CUDA_IPC=0 nor PARAMSYNC_SHM=0 is set; then a nonzero number
 * naming this host, from PARAMSYNC_HOST_ID or else its boot id (device.c). */
uint64_t ps__device_host(void);

/** Describes c's device buffers for a device collective: 1 when every buffer
 * c has is device memory that could be exported (c->peer_ipc, c->out_ipc,
 * c->stage_device set), else 0. */
int ps__devcoll_export(ps__coll_t *c, int in_dev, int out_dev);

/** The words of one rank's descriptor of a device collective. */
size_t ps__devcoll_words(void);

/** Runs c as a device collective, its descriptors at `all` (n + 1 of them):
 * as ps__peer_run. */
int ps__devcoll_run(ps__coll_t *c, uint64_t *all, int *rc);

/* ---- direct barriers (barrier.c) ---- */

/** JoinRequest.direct_barrier: not with PARAMSYNC_DIRECT_BARRIER=0, nor with
 * PARAMSYNC_SHM=0 (asked only along with peer copies). */
int ps__bar_wanted(void);

/** Whether barrier c may meet directly: decided alike on every rank of its
 * group (JoinEvent.barrier_sets, the group), before its sequence number. */
int ps__bar_takes(const ps__coll_t *c);

/** Once c has its sequence number (comm->lock held): on the page of a group
 * whose barriers meet directly, says that this rank called c, a collective
 * other than a direct barrier, under that number (other[]). */
void ps__bar_started(const ps__coll_t *c);

/** Runs barrier c (c->bar_k set): 1 when it is finished, with its result in
 * *rc (reported); 0 when it is to go through the agent as any barrier (also
 * when another rank called a different collective under its number). */
int ps__bar_run(ps__coll_t *c, int *rc);

/** Unmaps g's page, and unlinks it if this rank still names it. */
void ps__bar_free(ps_group_t *g);

/** Whether every rank of group g has the caller's nonzero number in sets
 * (by job rank): JoinEvent.peer_sets or device_sets. */
int ps__group_shares_set(const ps_comm_t *comm, const ps_group_t *g, const uint32_t *sets);

/** Whether [a, a + alen) and [b, b + blen) share a byte. */
int ps__overlap(const void *a, size_t alen, const void *b, size_t blen);

/** The sequence numbers a call that takes peer copies (or a device
 * collective) holds, from hdr.seq on: its steps and the call through the
 * agent it may fall back to. */
uint64_t ps__peer_seqs(const ps__coll_t *c);

/** Makes room for the ranks' descriptors: 0 or PS_ENOMEM (c->peer_descs). */
int ps__peer_prepare(ps__coll_t *c);

/** Runs c's peer copies (frees c->peer_descs). Returns 1 when c is
 * finished, with its result in *rc; 0 when it is to go through the agent,
 * with c->hdr.seq set to the number it now goes under. */
int ps__peer_run(ps__coll_t *c, int *rc);

/** "all_reduce (group 0, seq 3)" for c, into what: the context of its errors. */
void ps__coll_what(const ps__coll_t *c, char *what, size_t size);

/** Initialises coll's lock where coll will live while it runs (once, before
 * ps__coll_run). 0 or PS_ENOMEM. */
int ps__coll_init(ps__coll_t *coll);

/** Destroys what ps__coll_init made. */
void ps__coll_destroy(ps__coll_t *coll);

/* ---- non-blocking work (work.c) ---- */

/** Runs a copy of coll (filled in and given its sequence number, not yet
 * initialised) on a new thread. Called with comm->lock held, so that a
 * failure to start can give the sequence number back before anyone else
 * takes one. On success *out is the caller's; on failure, PS_ENOMEM. */
int ps__work_start(const ps__coll_t *coll, ps_work_t **out);

#endif
