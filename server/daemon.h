/* paramsyncd internals shared across server/ files: configuration and the roles' entry points. */
#ifndef PS_DAEMON_H
#define PS_DAEMON_H

#include <stddef.h>
#include <stdint.h>

#include "paramsync/v1/paramsync.pb-c.h"
#include "rpc/frame.h"
#include "rpc/rpc.h"

typedef enum ps__role { PS_ROLE_EMBEDDED = 0, PS_ROLE_COORDINATOR, PS_ROLE_AGENT } ps__role_t;

typedef struct ps__config {
    ps__role_t role;
    const char *listen;          /* gRPC address served */
    const char *coordinator;     /* agent: the coordinator's address */
    const char *advertise;       /* agent: the address other agents use for it */
    const char *announce_file;   /* written with the listen address once serving */
    int64_t timeout_ms;          /* default collective timeout */
    int64_t join_timeout_ms;     /* default rendezvous timeout */
    uint64_t max_tensor_bytes;   /* largest payload one rank may send or receive */
    size_t step_bytes;           /* pipeline step of the collective engine */
    int window;                  /* steps in flight per collective */
    ps__rpc_options_t rpc;       /* TLS, keepalive (liveness), message limit */
    const char *tokens_file;     /* per-job tokens; NULL: no authentication */
    int max_jobs;                /* jobs one coordinator holds at once */
    int max_world_size;          /* ranks per job */
    int max_groups;              /* groups per job */
    uint64_t max_inflight_bytes; /* hub memory for collectives in flight */
    int reduce_cuda;             /* reductions on the GPU (--reduce-device) */
    size_t reduce_cuda_min;      /* the fewest bytes per input a step reduces on the GPU
                                  * with; smaller ones on the CPU (auto: PS_AUTO_CUDA_MIN) */
    int ring;                    /* PS_RING_OFF, _ON or _AUTO (--ring) */
    uint64_t ring_min_bytes;     /* smaller ones go to the hub (--ring-min-bytes) */
    uint64_t rd_max_bytes;       /* recursive doubling up to this (--rd-max-bytes) */
    const char *machine_id;      /* the machine this agent runs on (--machine-id); "" unknown */
    uint64_t
        shm_resident_bytes; /* larger collectives let go of segment pages (--shm-resident-bytes) */
    int64_t link_keep_ms; /* an idle link to another agent stays open this long (--link-keep-ms) */
} ps__config_t;

/* --link-keep-ms: how long a link to another agent (an Agent.Ring stream)
 * that carried a collective stays open, idle, for the next of its job
 * between the two agents. */
#define PS_LINK_KEEP_MS 30000

/* --reduce-device auto: a step of fewer bytes per input reduces on the CPU.
 * On an H200 host (docs/GPU.md, "Pinned host memory") the GPU lost below
 * 1 MiB all_reduces (a round trip to the device per step) and won from 4 MiB. */
#define PS_AUTO_CUDA_MIN ((size_t)1 << 20)

/* --rd-max-bytes: the largest all_reduce (per rank) recursive doubling takes
 * by default; see docs/PERFORMANCE.md, "Recursive doubling between agents". */
#define PS_RD_MAX_BYTES ((uint64_t)64 << 10)

/* --ring: which multi-agent collectives go round a ring of agents. */
enum { PS_RING_OFF, PS_RING_ON, PS_RING_AUTO };
/* --ring auto: an all_reduce goes round the ring when its group has this many
 * ranks per agent (on average), any size; from 2 per agent at
 * --ring-min-bytes. Measured in docs/PERFORMANCE.md ("--ring auto"). */
#define PS_RING_AUTO_RANKS 8
/* --ring auto: a barrier, broadcast, reduce or all_gather (one whose output
 * is over a step: a smaller one is one step at the hub) goes round the ring
 * from this many ranks per agent (measured the same place)... */
#define PS_RING_AUTO_OTHER_RANKS 4
/* ... but a barrier, or a broadcast or reduce of fewer bytes per rank than
 * this, only from PS_RING_AUTO_RANKS: with ranks on shared memory the hub
 * took 0.57-0.87x the ring's time for them at 4 ranks per agent, where the
 * ring's two laps of tokens are 2A - 1 hops one after another. */
#define PS_RING_AUTO_SMALL_BYTES ((uint64_t)64 << 10)
/* With agents on two or more machines (--machine-id), auto also takes the
 * ring from --ring-min-bytes per rank whatever the ranks per agent
 * (ring_use in hub.c). */

/* What agents of one job say to each other between them, in their
 * settings (JoinRequest.agent_settings, "--wire N"), so that the
 * coordinator refuses a job whose agents would not understand each other:
 * 2 since an all_to_all block may cross without its padding
 * (CollectiveHeader.block_used) and a mesh sends no agreement tokens
 * (ring_agrees in hub.c); 3 since a link between agents ends each
 * collective with an `end` frame both ways, and may carry the next one
 * (ps__hub_ring_serve); agents that name none are older (1). */
#define PS_WIRE_REVISION 3

/* What a call cut by SIGTERM's drain is told (UNAVAILABLE). */
#define PS_MSG_STOPPING "paramsyncd is shutting down (SIGTERM)"

/* Method names. */
#define PS_M_WORKER_JOIN        "/paramsync.v1.Worker/Join"
#define PS_M_WORKER_LEAVE       "/paramsync.v1.Worker/Leave"
#define PS_M_WORKER_NEW_GROUP   "/paramsync.v1.Worker/NewGroup"
#define PS_M_WORKER_COLLECTIVE  "/paramsync.v1.Worker/Collective"
#define PS_M_WORKER_SHM_ATTACH  "/paramsync.v1.Worker/ShmAttach"
#define PS_M_WORKER_SHM_DETACH  "/paramsync.v1.Worker/ShmDetach"
#define PS_M_COORD_REGISTER     "/paramsync.v1.Coordinator/RegisterAgent"
#define PS_M_COORD_JOIN         "/paramsync.v1.Coordinator/Join"
#define PS_M_COORD_LEAVE        "/paramsync.v1.Coordinator/Leave"
#define PS_M_COORD_NEW_GROUP    "/paramsync.v1.Coordinator/NewGroup"
#define PS_M_COORD_DESCRIBE_JOB "/paramsync.v1.Coordinator/DescribeJob"
#define PS_M_ADMIN_STATUS       "/paramsync.v1.Admin/Status"
#define PS_M_AGENT_RING         "/paramsync.v1.Agent/Ring"
#define PS_M_AGENT_RELAY        "/paramsync.v1.Agent/Relay"

/* ---- coordinator (coordinator.c) ---- */

typedef struct ps__coordinator ps__coordinator_t;

/** Creates the coordinator and registers its methods on srv. 0 or PS_ENOMEM. */
int ps__coordinator_create(const ps__config_t *cfg, ps__rpc_server_t *srv, ps__coordinator_t **out);
void ps__coordinator_destroy(ps__coordinator_t *c);

/** SIGTERM: every Join ends, and every new one is refused, with UNAVAILABLE
 * PS_MSG_STOPPING; the ranks whose streams end with the daemon are not
 * reported lost. Before the server's shutdown. NULL is a no-op. */
void ps__coordinator_drain(ps__coordinator_t *c);

/** Adds the jobs (filtered by name when job is non-empty) and agents to
 * resp; everything added is malloc'd, so protobuf_c_message_free_unpacked
 * frees a heap-allocated resp. 0 or PS_ENOMEM. */
int ps__coordinator_status(ps__coordinator_t *c, const char *job,
                           Paramsync__V1__StatusResponse *resp);

/** For the metrics gauges: jobs, groups, members and agents now. */
struct ps__metrics_gauges;
void ps__coordinator_gauges(void *coordinator, struct ps__metrics_gauges *out);

/* ---- agent (agent.c) and its collective engine (hub.c) ---- */

typedef struct ps__agent ps__agent_t;

/** Creates the agent and registers the Worker methods on srv. self is the
 * address other agents reach it at; coordinator the coordinator's address. */
int ps__agent_create(const ps__config_t *cfg, ps__rpc_server_t *srv, const char *self,
                     const char *coordinator, ps__agent_t **out);
void ps__agent_destroy(ps__agent_t *a);

/** Ends the calls the agent forwards to the coordinator, refuses new ones,
 * and drains its hub (ps__hub_drain). */
void ps__agent_drain(ps__agent_t *a);

/** Adds the collectives in flight on this agent's hub to resp (as
 * ps__coordinator_status). */
int ps__agent_status(ps__agent_t *a, const char *job, Paramsync__V1__StatusResponse *resp);

struct ps__health;
/** Reports "paramsync.v1.Worker" SERVING only while the coordinator channel
 * is connected (checked every second). */
void ps__agent_watch_health(ps__agent_t *a, struct ps__health *health);

typedef struct ps__hub ps__hub_t;

/** What the hub must know of a job; filled from the coordinator. */
typedef struct ps__job_info {
    int world_size;
    uint64_t incarnation;
    char *hub;   /* the agent hosting the job's collectives */
    int *joined; /* job ranks that are members now */
    int njoined;
    char **rank_agents;   /* world_size entries: the agent of each job rank */
    char **rank_machines; /* world_size entries, or NULL: the machine of that agent */
    int ngroups;
    struct {
        uint32_t id;
        int nranks;
        int *ranks;
    } * groups;
} ps__job_info_t;

/** Looks a job up at the coordinator: 0, PS_ENOTFOUND, or a transport error
 * with *errmsg (malloc'd) set. Free the info with ps__job_info_clear. */
typedef int (*ps__job_lookup_fn)(void *arg, const char *job, ps__job_info_t *info, char **errmsg);

void ps__job_info_clear(ps__job_info_t *info);

/** The link of a collective to the agent at `address`: a Ring call (with
 * the job's token when the agent has one), one kept open from an earlier
 * collective of the job (1) or a new one (0); or a negative error. */
typedef int (*ps__ring_open_fn)(void *arg, const char *address, const char *job,
                                ps__rpc_call_t **out);

/** Offers a link whose collective ended cleanly (both sides sent their
 * `end` frame) to be kept for the job's next collective to `address`: 1
 * when taken (the call is the agent's now), 0 when the hub must close it. */
typedef int (*ps__ring_keep_fn)(void *arg, const char *address, const char *job,
                                ps__rpc_call_t *call);

struct ps__frame;

/** Serves a doorbell's request, a call whose first frame is `first`
 * (consumed), as the agent routes it: at this hub, in a ring, or forwarded to
 * the job's hub (shared-memory headers only: there is no raw first message
 * to forward). *state is the doorbell's own (NULL at first), for what the
 * agent keeps between its requests; at the doorbell's end serve is called
 * once more with call and first NULL, to let it go. */
typedef void (*ps__serve_fn)(void *arg, ps__rpc_call_t *call, struct ps__frame *first,
                             void **state);

/** self: this agent's address as the coordinator knows it (rank_agents);
 * ring_open dials other agents for collectives spanning several, ring_keep
 * takes their links back when they may carry another; serve
 * routes a doorbell's requests (a worker on this agent, the job's hub here
 * or elsewhere). */
int ps__hub_create(const ps__config_t *cfg, const char *self, ps__job_lookup_fn lookup,
                   ps__ring_open_fn ring_open, ps__ring_keep_fn ring_keep, ps__serve_fn serve,
                   void *arg, ps__hub_t **out);
void ps__hub_destroy(ps__hub_t *h);

/** Serves one Collective call whose first frame (already decoded) is
 * `first`; the hub takes over `first` and ends the call with a status. */
struct ps__frame;
void ps__hub_serve(ps__hub_t *h, ps__rpc_call_t *call, struct ps__frame *first);

/** 1 when this agent serves the collective of header `hd` for its own
 * ranks, with the other agents of the group over Ring links (with --ring on,
 * an all_reduce, all_gather, broadcast, reduce or reduce_scatter whose group
 * spans several agents); 0 when it goes to the job's hub. */
int ps__hub_is_ring(ps__hub_t *h, const Paramsync__V1__CollectiveHeader *hd);

/** Serves one collective's link from another agent (the previous one of a
 * ring, any of a mesh, a partner in recursive doubling) on a Ring call,
 * whose header frame is `first`. 1 when the other agent ended it with an
 * `end` frame and this one answered with its own: the call stays open for
 * the next collective's header. 0 when the call has been ended with a
 * status. */
int ps__hub_ring_serve(ps__hub_t *h, ps__rpc_call_t *call, struct ps__frame *first);

/** Kinds of shared segments: the comm's payload segments (one per slot, up
 * to PS_HUB_PAYLOAD_SLOTS per rank; a new one replaces its slot's old one),
 * doorbells (up to PS_HUB_DOORBELLS per rank, one
 * for each collective in flight at once; each served by a thread of the hub),
 * registered memory the worker hands out for its tensors (ps_mem_alloc;
 * up to 64 per rank, until detached), and the process segment (one per
 * rank), which stands for the worker's own memory: collectives naming it
 * (CollectiveHeader.shm_process) are read from and written to the worker's
 * buffers with process_vm_readv/writev. */
enum { PS_SHM_PAYLOAD = 0, PS_SHM_DOORBELL = 1, PS_SHM_REGISTERED = 2, PS_SHM_PROCESS = 3 };

/** The most doorbells a rank keeps on its agent (ShmAttachResponse.doorbells). */
#define PS_HUB_DOORBELLS 4
/** The most payload segments a rank keeps, one per slot (ShmAttachRequest.slot). */
#define PS_HUB_PAYLOAD_SLOTS 4

/** Maps a worker's shared segment of `kind` (see ShmAttach in the proto);
 * a process segment's worker is process `pid`, which maps it at `address`
 * (both unused for other kinds). Returns 1 when attached, else 0 with the
 * reason in `reason`. */
int ps__hub_shm_attach(ps__hub_t *h, const char *job, int rank, const char *name, uint64_t size,
                       uint64_t magic, int kind, int slot, int pid, uint64_t address, char *reason,
                       size_t rlen);

/** Drops the registered segment `name` of job's rank: 1, or 0 when there is
 * none of that name. */
int ps__hub_shm_detach(ps__hub_t *h, const char *job, int rank, const char *name);

/** Whether job rank `rank` of job joined through this agent. */
int ps__hub_rank_here(ps__hub_t *h, const char *job, int rank);

/** Where one side (input or output) of a worker's payload lies in its
 * segment: from `at` (an offset in the segment, or an address in the
 * worker's memory for a process segment), or, a process segment's list form
 * (CollectiveHeader.shm_in_blocks, shm_out_blocks), in `nparts` equal parts
 * of `part_len` bytes, part i at address part[i]. */
typedef struct ps__shm_place {
    uint64_t at;
    const uint64_t *part; /* the header's list, not owned; NULL: from `at` */
    size_t nparts;
    uint64_t part_len;
} ps__shm_place_t;

/** Where a worker's payload lies in its segment, for a collective this
 * agent forwards to the job's hub (server/agent.c collective_proxy). Valid
 * while the header given to ps__hub_shm_io_open is. */
typedef struct ps__shm_io {
    void *map;     /* the segment, referenced until ps__hub_shm_io_close */
    void *out_map; /* the output's: map, or a second registered segment
                    * (CollectiveHeader.shm_out), referenced as well */
    ps__shm_place_t in;
    uint64_t in_total;
    ps__shm_place_t out;
    uint64_t out_total;
    int by_file; /* read and written with pread/pwrite (over --shm-resident-bytes),
                  * or the worker's memory with process_vm_readv/writev */
} ps__shm_io_t;

/** Finds the segment the header names and checks it holds the payload.
 * 0, or a gRPC status code with msg set. */
int ps__hub_shm_io_open(ps__hub_t *h, const Paramsync__V1__CollectiveHeader *hd, ps__shm_io_t *io,
                        char *msg, size_t len);

/** A frame of input bytes [off, off + len), read in place from the segment,
 * with header (may be NULL); NULL when out of memory. */
grpc_byte_buffer *ps__hub_shm_io_frame(ps__shm_io_t *io, const Paramsync__V1__CollectiveHeader *hd,
                                       uint64_t off, size_t len);

/** Puts an output frame's bytes into the segment, at the frame's offset:
 * 0, PS_EINVAL when they do not fit the output, another negative value when
 * they could not be written. */
int ps__hub_shm_io_put(ps__shm_io_t *io, const ps__frame_t *f);

/** Whether the segment shrank under the agent while it was used (its bytes
 * read as zeros): the collective must not be answered OK. */
int ps__hub_shm_io_broken(const ps__shm_io_t *io);

void ps__hub_shm_io_close(ps__shm_io_t *io);

/** Drops the segments of job's rank (every rank for rank < 0); collectives
 * still using one keep it mapped until they end. */
void ps__hub_shm_release(ps__hub_t *h, const char *job, int rank);

/** Fails the job's collectives in flight with code and message, and forgets
 * what the hub knew of the job (its coordinator or membership is gone). */
void ps__hub_job_abort(ps__hub_t *h, const char *job, int code, const char *message);

/** Seconds the longest-waiting collective has waited for a missing rank
 * (a ps__metrics_wait_fn; arg is the hub). */
double ps__hub_longest_wait(void *hub);

/** The agent's hub. */
ps__hub_t *ps__agent_hub(ps__agent_t *a);

/** Fails every collective in flight, and every one that comes later, with
 * UNAVAILABLE "shutting down" (SIGTERM, before the server stops). */
void ps__hub_drain(ps__hub_t *h);

/** Adds the hub's in-flight collectives and unmatched sends/receives. */
int ps__hub_status(ps__hub_t *h, const char *job, Paramsync__V1__StatusResponse *resp);

#endif
