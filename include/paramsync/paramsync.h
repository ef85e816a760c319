/* libparamsync: torch.distributed's collectives as gRPC calls to a paramsync agent. */
#ifndef PARAMSYNC_PARAMSYNC_H
#define PARAMSYNC_PARAMSYNC_H

#include <paramsync/common.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PS_ANY_SOURCE (-1)

/** A joined process: one rank of one job. Opaque. */
typedef struct ps_comm ps_comm_t;
/** A process group made by ps_new_group; NULL everywhere means the whole job. Opaque. */
typedef struct ps_group ps_group_t;
/** An operation started by a ps_i* function (torch's async_op=True). Opaque. */
typedef struct ps_work ps_work_t;

/**
 * Called with every error a call returns, the daemon's and the local ones:
 * err is the code the call returns and message says where and why, as
 * "all_reduce (group 0, seq 3): <the daemon's message>". The default
 * handler prints "paramsync: <message>" to stderr. It may run on any thread
 * (non-blocking operations report from their own); message lives until it
 * returns.
 */
typedef void (*ps_error_fn)(int err, const char *message, void *arg);

typedef struct ps_init_options {
    /*
     * Where the agent is and how to meet the other ranks, as torch's
     * init_method: "env://" (NULL means this): PARAMSYNC_ADDR, else
     * MASTER_ADDR and MASTER_PORT; "tcp://HOST:PORT"; "unix:PATH";
     * "file:///PATH": the file names the agent's address (paramsyncd
     * --announce-file writes it; ps_init waits for it up to the join
     * timeout) and, by default, the job id. env://, tcp:// and unix: take
     * "?job=NAME&world_size=N&rank=R" too.
     */
    const char *init_method;
    /* Job id; NULL: ?job= of the init method, else $PARAMSYNC_JOB, else the file path
     * for file://, else "default". */
    const char *job;
    /* -1: ?world_size= of the init method, else $WORLD_SIZE. */
    int world_size;
    /* -1: ?rank= of the init method, else $RANK when set, else the daemon assigns one. */
    int rank;
    /* Deadline of each collective in ms; 0: $PARAMSYNC_TIMEOUT_MS, else 30 minutes. */
    int64_t timeout_ms;
    /* Deadline of the rendezvous in ms; 0: $PARAMSYNC_JOIN_TIMEOUT_MS, else the
     * collective timeout. */
    int64_t join_timeout_ms;
    /* The comm's first error handler, which also gets ps_init's own errors
     * (a comm does not exist yet to ask); NULL: the default (stderr). */
    ps_error_fn error_fn;
    void *error_arg;
} ps_init_options_t;

/** Fills opts with defaults (everything from the environment). */
PS_EXPORT void ps_init_options_default(ps_init_options_t *opts);

/**
 * Joins the job and waits until all world_size ranks have joined.
 * opts NULL means ps_init_options_default. The frame size comes from
 * $PARAMSYNC_CHUNK_BYTES (default 1 MiB, at most 4 MiB).
 * On success *out is a new communicator owned by the caller (ps_finalize).
 * Returns 0 or a negative PS_E* code (the daemon's: PS_EINVAL for a rank
 * outside the world or a world size other ranks disagree with, PS_EEXIST
 * for a rank already taken, PS_ETIMEDOUT when ranks are missing at the
 * deadline; PS_EUNAVAIL when no daemon answers); *out is untouched on error.
 */
PS_EXPORT int ps_init(const ps_init_options_t *opts, ps_comm_t **out);

/**
 * Leaves the job and frees comm and its groups. Accepts NULL. Operations
 * still in flight are cancelled (PS_ECANCELLED) first; their work handles
 * stay valid until ps_work_free. The process's last communicator's
 * ps_finalize also waits, 2 s at most, until the library's threads have
 * ended and gRPC is shut down, so that the process may exit right after.
 * Returns 0, or the error of Leave (comm is freed all the same).
 */
PS_EXPORT int ps_finalize(ps_comm_t *comm);

/** Replaces the error handler (the default prints to stderr); fn NULL silences it. */
PS_EXPORT void ps_set_error_handler(ps_comm_t *comm, ps_error_fn fn, void *arg);

/** The caller's rank in group (NULL: the job), or -1 if not a member (or comm is NULL). */
PS_EXPORT int ps_get_rank(const ps_comm_t *comm, const ps_group_t *group);

/** The size of group (NULL: the job); -1 when comm is NULL. */
PS_EXPORT int ps_get_world_size(const ps_comm_t *comm, const ps_group_t *group);

/**
 * torch's new_group: every rank of the job must call it, in the same order,
 * with the same ranks (job ranks; their order gives the group ranks);
 * ranks NULL with nranks 0 means every rank of the job. *out belongs to comm
 * and lives until ps_finalize. Non-members get a group too, in which they
 * have rank -1 and may not call collectives. Returns 0, PS_EINVAL for a
 * rank outside the job or listed twice, or the daemon's error.
 */
PS_EXPORT int ps_new_group(ps_comm_t *comm, const int *ranks, int nranks, ps_group_t **out);

/**
 * Memory for tensors that the agent reads and writes in place: bytes
 * (rounded up to 4 KiB) in a shared-memory segment of their own, mapped by
 * this process and by the agent it joined through. A collective whose input
 * and output buffers both lie in one such allocation (apart, or for
 * all_reduce and reduce, output exactly over input) moves no payload bytes
 * through this process: no copy into the comm's segment and out of it.
 * Anything else about the call is unchanged; other buffers still work.
 * One collective at a time uses an allocation that way (another one at the
 * same time takes the copying path), and at most 64 allocations per rank
 * are shared with the agent.
 *
 * When the agent cannot map it (it runs on another host or in another
 * /dev/shm, /dev/shm is full, PARAMSYNC_SHM=0, the limit of 64), the memory is plain memory
 * of this process and collectives on it copy as on any other buffer
 * (ps_mem_is_shared tells). The memory starts zeroed. Returns NULL when
 * comm is NULL, bytes is 0, or memory is short. It lives until
 * ps_mem_free or ps_finalize of comm, whichever comes first.
 */
PS_EXPORT void *ps_mem_alloc(ps_comm_t *comm, size_t bytes);

/**
 * Frees memory from ps_mem_alloc(comm). NULL is a no-op. Returns 0, or
 * PS_EINVAL (reported) for memory not from ps_mem_alloc of this comm or in
 * use by a collective still running.
 */
PS_EXPORT int ps_mem_free(ps_comm_t *comm, void *ptr);

/** 1 when ptr lies in memory from ps_mem_alloc(comm) that the agent shares, else 0. */
PS_EXPORT int ps_mem_is_shared(ps_comm_t *comm, const void *ptr);

/*
 * Collectives. Ranks (src, dst, peer) are group ranks. Counts are elements
 * per rank as in torch; n is the group size. All return 0 or PS_E*; on
 * error the output buffers may be partly written but the error names the
 * ranks and the field at fault (through the error handler).
 *
 * Checked before anything is sent: comm NULL (PS_EPRECOND: not
 * initialised); PS_EINVAL for a group of another comm or one the caller is
 * not a member of, an invalid dtype, an op the dtype does not have (bitwise
 * on floating types, AVG on integers), a root or peer outside the group, a
 * send to or receive from oneself, a negative tag, a NULL buffer that would
 * carry bytes. Input and output buffers must not overlap except where the
 * call takes one buffer, and in torch's in-place form: an all_gather's (or
 * gather root's) input may be the caller's own block of the output, in ==
 * out + rank * count elements, and a scatter root's output its block of the
 * input, out == in + rank * count. With the agent on this host, and the
 * buffers from ps_mem_alloc or large enough to go direct (8 MiB, or 32 MiB
 * where the kernel gives no huge pages on request: docs/C_API.md), such a
 * call copies nothing of its own block.
 *
 * Buffers may be host memory or CUDA device (or managed) memory, in any mix
 * (cudaPointerGetAttributes tells them apart; libparamsync built without
 * CUDA sees host memory only). A device input is copied to pinned host
 * memory before the call starts; a device output gets the result only when
 * the call succeeds and is left untouched when it fails. The copies run on
 * the legacy default stream of the calling thread's current device: finish
 * writing a device input on your own streams before the call. Staging errors
 * (PS_ENOMEM for pinned memory, PS_EUNAVAIL or PS_EINTERNAL from CUDA) are
 * reported like any other, and a call that cannot stage its input is not
 * started. See docs/GPU.md.
 */
PS_EXPORT int ps_barrier(ps_comm_t *comm, ps_group_t *group);
PS_EXPORT int ps_broadcast(ps_comm_t *comm, void *buf, size_t count, ps_dtype_t dtype, int src,
                           ps_group_t *group);
PS_EXPORT int ps_all_reduce(ps_comm_t *comm, void *buf, size_t count, ps_dtype_t dtype, ps_op_t op,
                            ps_group_t *group);
/* The result is in buf on dst; other ranks' buf is unchanged. */
PS_EXPORT int ps_reduce_to(ps_comm_t *comm, void *buf, size_t count, ps_dtype_t dtype, ps_op_t op,
                           int dst, ps_group_t *group);
/* out holds n*count elements, in rank order. */
PS_EXPORT int ps_all_gather(ps_comm_t *comm, void *out, const void *in, size_t count,
                            ps_dtype_t dtype, ps_group_t *group);
/* out (n*count) is needed on dst only; NULL elsewhere. */
PS_EXPORT int ps_gather(ps_comm_t *comm, void *out, const void *in, size_t count, ps_dtype_t dtype,
                        int dst, ps_group_t *group);
/* in (n*count, block i to rank i) is needed on src only; NULL elsewhere. */
PS_EXPORT int ps_scatter(ps_comm_t *comm, void *out, const void *in, size_t count, ps_dtype_t dtype,
                         int src, ps_group_t *group);
/* in holds n*count elements; out gets count: the reduction of every rank's block `rank`. */
PS_EXPORT int ps_reduce_scatter(ps_comm_t *comm, void *out, const void *in, size_t count,
                                ps_dtype_t dtype, ps_op_t op, ps_group_t *group);
/* in and out hold n*count; out's block j comes from rank j's block `rank`. */
PS_EXPORT int ps_all_to_all(ps_comm_t *comm, void *out, const void *in, size_t count,
                            ps_dtype_t dtype, ps_group_t *group);
/* MPI_Alltoallv's form (torch's all_to_all_single with split sizes): in holds
 * in_counts[j] elements for rank j, one block after another; out gets
 * out_counts[j] from rank j, likewise; n counts each. Every rank's in_counts[j]
 * must be rank j's out_counts[rank]: the ranks first gather every rank's counts
 * (one all_gather), so all check every pair alike, and all fail with PS_EPRECOND
 * naming a pair that differs. The daemon moves equal blocks, so each block is
 * padded to the largest (up to n times the bytes of an even split). Host memory
 * only (PS_EINVAL for device buffers); blocking only. */
PS_EXPORT int ps_all_to_all_v(ps_comm_t *comm, void *out, const size_t *out_counts, const void *in,
                              const size_t *in_counts, ps_dtype_t dtype, ps_group_t *group);
PS_EXPORT int ps_send(ps_comm_t *comm, const void *buf, size_t count, ps_dtype_t dtype, int dst,
                      int tag, ps_group_t *group);
/* src may be PS_ANY_SOURCE; *source (may be NULL) gets the sender's rank. */
PS_EXPORT int ps_recv(ps_comm_t *comm, void *buf, size_t count, ps_dtype_t dtype, int src, int tag,
                      ps_group_t *group, int *source);

/*
 * Non-blocking forms: the same arguments, plus *work, a handle the caller
 * owns (ps_work_free). Buffers must stay valid until the work completes.
 * Several may be in flight at once and complete in any order; collectives
 * are matched across ranks by the order in which each rank started them.
 * On error nothing is started and *work is untouched.
 */
PS_EXPORT int ps_ibarrier(ps_comm_t *comm, ps_group_t *group, ps_work_t **work);
PS_EXPORT int ps_ibroadcast(ps_comm_t *comm, void *buf, size_t count, ps_dtype_t dtype, int src,
                            ps_group_t *group, ps_work_t **work);
PS_EXPORT int ps_iall_reduce(ps_comm_t *comm, void *buf, size_t count, ps_dtype_t dtype, ps_op_t op,
                             ps_group_t *group, ps_work_t **work);
PS_EXPORT int ps_ireduce_to(ps_comm_t *comm, void *buf, size_t count, ps_dtype_t dtype, ps_op_t op,
                            int dst, ps_group_t *group, ps_work_t **work);
PS_EXPORT int ps_iall_gather(ps_comm_t *comm, void *out, const void *in, size_t count,
                             ps_dtype_t dtype, ps_group_t *group, ps_work_t **work);
PS_EXPORT int ps_igather(ps_comm_t *comm, void *out, const void *in, size_t count, ps_dtype_t dtype,
                         int dst, ps_group_t *group, ps_work_t **work);
PS_EXPORT int ps_iscatter(ps_comm_t *comm, void *out, const void *in, size_t count,
                          ps_dtype_t dtype, int src, ps_group_t *group, ps_work_t **work);
PS_EXPORT int ps_ireduce_scatter(ps_comm_t *comm, void *out, const void *in, size_t count,
                                 ps_dtype_t dtype, ps_op_t op, ps_group_t *group, ps_work_t **work);
PS_EXPORT int ps_iall_to_all(ps_comm_t *comm, void *out, const void *in, size_t count,
                             ps_dtype_t dtype, ps_group_t *group, ps_work_t **work);
PS_EXPORT int ps_isend(ps_comm_t *comm, const void *buf, size_t count, ps_dtype_t dtype, int dst,
                       int tag, ps_group_t *group, ps_work_t **work);
PS_EXPORT int ps_irecv(ps_comm_t *comm, void *buf, size_t count, ps_dtype_t dtype, int src, int tag,
                       ps_group_t *group, ps_work_t **work);

/** Waits for work; returns its result (0 or PS_E*). May be called again; same result. */
PS_EXPORT int ps_work_wait(ps_work_t *work);
/** Sets *done to 1 when work has completed, else 0. Returns 0. Never blocks. */
PS_EXPORT int ps_work_test(ps_work_t *work, int *done);
/** For a completed ps_irecv: the sender's rank; otherwise -1. */
PS_EXPORT int ps_work_source(const ps_work_t *work);
/** Waits for work if it is still running, then frees it. Accepts NULL. */
PS_EXPORT void ps_work_free(ps_work_t *work);

#ifdef __cplusplus
}
#endif
#endif
