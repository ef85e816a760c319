/* Sync metrics for Prometheus: counters and histograms updated on the hot path, exposed over HTTP.
 */
#ifndef PS_METRICS_H
#define PS_METRICS_H

#include <stddef.h>
#include <stdint.h>

/*
 * Every update is a relaxed atomic add on a fixed slot (no locks, no
 * allocation), so the cost on a 4-byte all_reduce stays far below 2%.
 * Labels are bounded: collective kind (12), gRPC code (17), direction,
 * link, device, method (the registered ones), and rank only for ranks below
 * --metrics-rank-limit (the rest count as rank="other").
 */

enum ps__m_link { PS_M_LINK_WORKER = 0, PS_M_LINK_AGENT = 1 };
enum ps__m_dir { PS_M_RX = 0, PS_M_TX = 1 };
enum ps__m_device { PS_M_DEV_CPU = 0, PS_M_DEV_CUDA = 1 };
/* How the bytes reached the segment: the agent's mapping, its file, the worker's process, or
 * (sent only) the CUDA device's DMA into a pinned segment. */
enum ps__m_access {
    PS_M_SHM_MAPPED = 0,
    PS_M_SHM_FILE = 1,
    PS_M_SHM_PROCESS = 2,
    PS_M_SHM_DEVICE = 3,
    PS_M_SHM_ACCESSES
};
enum ps__m_event {
    PS_M_EV_TIMEOUT = 0,  /* a collective or rendezvous hit its deadline */
    PS_M_EV_MISMATCH,     /* ranks disagreed on a collective */
    PS_M_EV_AUTH_FAILURE, /* a call without the job's token */
    PS_M_EV_REJECTED,     /* a request refused by a limit or validation */
    PS_M_EV_RANK_LOST,    /* a member's stream broke */
    PS_M_EV_RANK_STOPPED, /* a member lost with its agent, which said it was stopping */
    PS_M_EV_COUNT
};

typedef struct ps__metrics_config {
    const char *addr; /* "HOST:PORT" to serve /metrics on; NULL or "off": none */
    int rank_limit;   /* ranks with their own label value */
    const char *role; /* for paramsync_build_info */
    const char *version;
    const char *simd; /* reduce path in use */
    int cuda;         /* CUDA built in */
} ps__metrics_config_t;

/** Gauges read at scrape time (jobs, groups, members, in-flight) come from
 * this callback, so nothing is kept in sync on the hot path. */
typedef struct ps__metrics_gauges {
    int64_t jobs, groups, members, agents;
} ps__metrics_gauges_t;
typedef void (*ps__metrics_gauge_fn)(void *arg, ps__metrics_gauges_t *out);

/** Starts the registry and, if cfg->addr is set, the HTTP server. *bound
 * (may be NULL) gets "HOST:PORT" actually served (static storage).
 * 0, or PS_EUNAVAIL when the address cannot be bound. */
int ps__metrics_start(const ps__metrics_config_t *cfg, const char **bound);
void ps__metrics_stop(void);

/** The longest time, in seconds, any collective has been waiting for a
 * missing rank (0 when none): paramsync_collective_longest_wait_seconds. */
typedef double (*ps__metrics_wait_fn)(void *arg);
void ps__metrics_set_wait_source(ps__metrics_wait_fn fn, void *arg);

/** Registers a gauge source (the coordinator's job table). */
void ps__metrics_set_gauge_source(ps__metrics_gauge_fn fn, void *arg);

/** A collective finished on the hub for one rank: kind is the proto
 * CollectiveKind, code the gRPC status, seconds from that rank's arrival. */
void ps__metrics_collective_done(int kind, int code, double seconds);

/** Collectives in flight on the hub (+1 when created, -1 when freed). */
void ps__metrics_inflight_add(int delta);

/** When the last rank of a collective arrives: the skew between the first
 * and last arrival, and which rank was last (the straggler signal). */
void ps__metrics_arrival(int kind, double skew_seconds, int last_rank);

/** Payload bytes moved, by direction and link. */
void ps__metrics_bytes(int dir, int link, uint64_t bytes);

/** Payload bytes read from (PS_M_RX) or written into (PS_M_TX) workers'
 * shared-memory segments, through the agent's mapping or the file. */
void ps__metrics_shm_bytes(int dir, int access, uint64_t bytes);

/** A worker's collective call served from its shared memory, by where its
 * input and output lay: the segment kind (PS_SHM_PAYLOAD, _DOORBELL,
 * _REGISTERED, _PROCESS of daemon.h), or PS_M_SHM_TWO for two registered
 * segments (CollectiveHeader.shm_out). */
enum { PS_M_SHM_TWO = 4, PS_M_SHM_CALL_KINDS = 5 };
void ps__metrics_shm_call(int segments);

/** Bytes reduced (the input bytes of every reduction), by device. */
void ps__metrics_reduced(int device, uint64_t bytes);

/** Host memory pinned for CUDA reductions: PS_M_PIN_SEGMENTS (workers' segments registered
 * with the device) or PS_M_PIN_BUFFERS (the agent's own step buffers), +bytes or -bytes. */
enum { PS_M_PIN_SEGMENTS = 0, PS_M_PIN_BUFFERS = 1 };
void ps__metrics_pinned(int kind, int64_t delta);

/** Payload bytes a ring passed on unchanged between two other agents. */
void ps__metrics_relayed(uint64_t bytes);

/** A collective combined between agents began here, by algorithm. */
enum { PS_M_RING_RING = 0, PS_M_RING_MESH = 1, PS_M_RING_RD = 2, PS_M_RING_COUNT = 3 };
void ps__metrics_ring(int algorithm);

/** A link to another agent began carrying a collective: a new Ring call
 * (kept 0) or one kept open from an earlier collective (kept 1). */
void ps__metrics_agent_link(int kept);

/** Counts an event (timeouts, mismatches, ...). */
void ps__metrics_event(int event);

/** A gRPC call ended: method is a registered name, code its status. */
void ps__metrics_grpc_call(const char *method, int code);

/** Renders the exposition (text format 0.0.4) into a malloc'd string. For
 * the HTTP handler and tests. NULL on ENOMEM. */
char *ps__metrics_render(void);

#endif
