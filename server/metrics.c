/* The metrics registry (fixed slots, relaxed atomics), its text exposition and HTTP /metrics. */
#include "metrics.h"

#include <netdb.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include <microhttpd.h>

#include <paramsync/common.h>

/* For metrics.h (asked for; C11 allows the repeat once it is there): the
 * hub's longest wait, read at scrape time like the gauges. */

/* Slot counts. Every label value has its slot from the start, so an update
 * is one relaxed atomic add and never allocates or locks. */
#define M_KINDS            12   /* paramsync.v1.CollectiveKind 0..11 */
#define M_CODES            17   /* gRPC status codes 0..16 */
#define M_RANK_SLOTS       1024 /* the largest rank limit; slot M_RANK_SLOTS is "other" */
#define M_METHODS          48   /* distinct gRPC method names; more count as "other" */
#define M_DEFAULT_RANK     64   /* rank limit when the configuration gives a negative one */
#define M_BUCKETS          20
#define M_HTTP_CONNECTIONS 256 /* concurrent /metrics connections */
#define M_HTTP_IDLE_S      5   /* an idle connection is closed after this */

/* Collectives last from tens of microseconds (a barrier on loopback) to the
 * 30-minute default timeout; skew spans the same range. Bounds in ns so the
 * hot path compares integers. */
static const uint64_t bucket_ns[M_BUCKETS] = {
    100000ull,      250000ull,      500000ull,      1000000ull,      2500000ull,
    5000000ull,     10000000ull,    25000000ull,    50000000ull,     100000000ull,
    250000000ull,   500000000ull,   1000000000ull,  2500000000ull,   5000000000ull,
    10000000000ull, 30000000000ull, 60000000000ull, 300000000000ull, 1800000000000ull,
};
static const char *const bucket_le[M_BUCKETS] = {
    "0.0001", "0.00025", "0.0005", "0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1",
    "0.25",   "0.5",     "1",      "2.5",   "5",      "10",    "30",   "60",    "300",  "1800",
};

static const char *const kind_names[M_KINDS] = {
    "unspecified", "barrier", "broadcast",      "all_reduce", "reduce", "all_gather",
    "gather",      "scatter", "reduce_scatter", "all_to_all", "send",   "recv",
};

static const char *const code_names[M_CODES] = {
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
};

typedef struct m_histogram {
    _Atomic uint64_t bucket[M_BUCKETS + 1]; /* not cumulative; the last is +Inf */
    _Atomic uint64_t sum_ns;
} m_histogram_t;

typedef struct m_method {
    char service[96]; /* "paramsync.v1.Worker" */
    char method[64];  /* "Join" */
    char name[168];   /* "/paramsync.v1.Worker/Join", what callers pass */
    _Atomic uint64_t calls[M_CODES];
} m_method_t;

static _Atomic uint64_t g_collectives[M_KINDS][M_CODES];
static m_histogram_t g_duration[M_KINDS];
static m_histogram_t g_skew[M_KINDS];
static _Atomic uint64_t g_straggler[M_RANK_SLOTS + 1];
static _Atomic int g_rank_limit = M_DEFAULT_RANK;
static _Atomic uint64_t g_bytes[2][2]; /* [dir][link] */
static _Atomic uint64_t g_reduced[2];  /* [device] */
static _Atomic int64_t g_pinned[2];    /* [PS_M_PIN_*] */
static _Atomic uint64_t g_relayed;
static _Atomic uint64_t g_ring[PS_M_RING_COUNT];
static const char *const ring_algos[PS_M_RING_COUNT] = {"ring", "mesh", "recursive_doubling"};
static _Atomic uint64_t g_links[2];                  /* [kept] */
static _Atomic uint64_t g_shm[2][PS_M_SHM_ACCESSES]; /* [dir][access] */
static _Atomic uint64_t g_shm_calls[PS_M_SHM_CALL_KINDS];
static _Atomic uint64_t g_events[PS_M_EV_COUNT];
static _Atomic int64_t g_inflight;

/* Methods are appended under g_methods_lock and published by g_nmethods
 * (release), so lookups read the table without the lock. */
static m_method_t g_methods[M_METHODS];
static _Atomic int g_nmethods;
static pthread_mutex_t g_methods_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic uint64_t g_grpc_other[M_CODES];

/* Build info, the gauge source and the HTTP daemon change rarely; g_lock
 * keeps a scrape from seeing them half-changed, and lets
 * ps__metrics_set_gauge_source promise that the old callback is not running
 * once it returns. */
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static char g_version[64] = "unknown", g_role[32] = "unknown", g_simd[32] = "unknown";
static int g_cuda;
static double g_start_time;
static ps__metrics_gauge_fn g_gauge_fn;
static void *g_gauge_arg;
static ps__metrics_wait_fn g_wait_fn;
static void *g_wait_arg;
static struct MHD_Daemon *g_daemon;
static char g_bound[300];

#define RELAXED memory_order_relaxed

static void add(_Atomic uint64_t *slot, uint64_t v)
{
    atomic_fetch_add_explicit(slot, v, RELAXED);
}

static uint64_t get(_Atomic uint64_t *slot)
{
    return atomic_load_explicit(slot, RELAXED);
}

static int kind_slot(int kind)
{
    return kind >= 0 && kind < M_KINDS ? kind : 0;
}

/* Codes outside 0..16 are UNKNOWN; a negative PS_E* code is taken as its
 * magnitude, which is the gRPC code by the project's error model. */
static int code_slot(int code)
{
    if (code < 0)
        code = -code;
    return code < M_CODES ? code : 2;
}

static uint64_t seconds_to_ns(double seconds)
{
    if (!(seconds > 0)) /* negative, zero and NaN */
        return 0;
    if (seconds >= 1e10)
        return (uint64_t)1e19;
    return (uint64_t)(seconds * 1e9);
}

static void observe(m_histogram_t *h, double seconds)
{
    uint64_t ns = seconds_to_ns(seconds);
    int i = 0;
    while (i < M_BUCKETS && ns > bucket_ns[i])
        i++;
    add(&h->bucket[i], 1);
    add(&h->sum_ns, ns);
}

/* ---------------------------------------------------------------- updates */

void ps__metrics_collective_done(int kind, int code, double seconds)
{
    int k = kind_slot(kind);
    add(&g_collectives[k][code_slot(code)], 1);
    observe(&g_duration[k], seconds);
}

void ps__metrics_inflight_add(int delta)
{
    atomic_fetch_add_explicit(&g_inflight, delta, RELAXED);
}

void ps__metrics_arrival(int kind, double skew_seconds, int last_rank)
{
    int limit = atomic_load_explicit(&g_rank_limit, RELAXED);
    observe(&g_skew[kind_slot(kind)], skew_seconds);
    add(&g_straggler[last_rank >= 0 && last_rank < limit ? last_rank : M_RANK_SLOTS], 1);
}

void ps__metrics_bytes(int dir, int link, uint64_t bytes)
{
    if (dir >= 0 && dir < 2 && link >= 0 && link < 2)
        add(&g_bytes[dir][link], bytes);
}

void ps__metrics_shm_bytes(int dir, int access, uint64_t bytes)
{
    if (dir >= 0 && dir < 2 && access >= 0 && access < PS_M_SHM_ACCESSES)
        add(&g_shm[dir][access], bytes);
}

void ps__metrics_shm_call(int segments)
{
    if (segments >= 0 && segments < PS_M_SHM_CALL_KINDS)
        add(&g_shm_calls[segments], 1);
}

void ps__metrics_reduced(int device, uint64_t bytes)
{
    if (device >= 0 && device < 2)
        add(&g_reduced[device], bytes);
}

void ps__metrics_pinned(int kind, int64_t delta)
{
    if (kind >= 0 && kind < 2)
        atomic_fetch_add_explicit(&g_pinned[kind], delta, RELAXED);
}

void ps__metrics_relayed(uint64_t bytes)
{
    add(&g_relayed, bytes);
}

void ps__metrics_ring(int algorithm)
{
    if (algorithm >= 0 && algorithm < PS_M_RING_COUNT)
        add(&g_ring[algorithm], 1);
}

void ps__metrics_agent_link(int kept)
{
    add(&g_links[kept ? 1 : 0], 1);
}

void ps__metrics_event(int event)
{
    if (event >= 0 && event < PS_M_EV_COUNT)
        add(&g_events[event], 1);
}

/* Copies "/pkg.Svc/Method" into a method slot's labels. 0, or -1 when the
 * name does not fit (it then counts as "other"). */
static int method_fill(m_method_t *m, const char *name)
{
    size_t n = strlen(name);
    if (n >= sizeof(m->name))
        return -1;
    const char *slash = name[0] == '/' ? strchr(name + 1, '/') : NULL;
    if (slash) {
        size_t sl = (size_t)(slash - name - 1), ml = strlen(slash + 1);
        if (sl >= sizeof(m->service) || ml >= sizeof(m->method))
            return -1;
        memcpy(m->service, name + 1, sl);
        m->service[sl] = 0;
        memcpy(m->method, slash + 1, ml + 1);
    } else {
        if (n >= sizeof(m->method))
            return -1;
        m->service[0] = 0;
        memcpy(m->method, name, n + 1);
    }
    memcpy(m->name, name, n + 1);
    return 0;
}

static int method_find(const char *name, int n)
{
    for (int i = 0; i < n; i++)
        if (strcmp(g_methods[i].name, name) == 0)
            return i;
    return -1;
}

void ps__metrics_grpc_call(const char *method, int code)
{
    int c = code_slot(code);
    if (!method) {
        add(&g_grpc_other[c], 1);
        return;
    }
    int i = method_find(method, atomic_load_explicit(&g_nmethods, memory_order_acquire));
    if (i < 0) {
        pthread_mutex_lock(&g_methods_lock);
        int n = atomic_load_explicit(&g_nmethods, RELAXED);
        i = method_find(method, n);
        if (i < 0 && n < M_METHODS && method_fill(&g_methods[n], method) == 0) {
            i = n;
            atomic_store_explicit(&g_nmethods, n + 1, memory_order_release);
        }
        pthread_mutex_unlock(&g_methods_lock);
    }
    add(i >= 0 ? &g_methods[i].calls[c] : &g_grpc_other[c], 1);
}

void ps__metrics_set_gauge_source(ps__metrics_gauge_fn fn, void *arg)
{
    pthread_mutex_lock(&g_lock);
    g_gauge_fn = fn;
    g_gauge_arg = arg;
    pthread_mutex_unlock(&g_lock);
}

void ps__metrics_set_wait_source(ps__metrics_wait_fn fn, void *arg)
{
    pthread_mutex_lock(&g_lock);
    g_wait_fn = fn;
    g_wait_arg = arg;
    pthread_mutex_unlock(&g_lock);
}

/* ---------------------------------------------------------------- rendering */

typedef struct strbuf {
    char *p;
    size_t len, cap;
    int failed;
} strbuf_t;

static void sb_printf(strbuf_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void sb_printf(strbuf_t *b, const char *fmt, ...)
{
    if (b->failed)
        return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->failed = 1;
            return;
        }
        if ((size_t)n < b->cap - b->len) {
            b->len += (size_t)n;
            return;
        }
        size_t cap = b->cap * 2 > b->len + (size_t)n + 1 ? b->cap * 2 : b->len + (size_t)n + 1;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->failed = 1;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
}

/* Label values escape backslash, double quote and newline (format 0.0.4). */
static void sb_label_value(strbuf_t *b, const char *v)
{
    for (; *v; v++) {
        if (*v == '\\')
            sb_printf(b, "\\\\");
        else if (*v == '"')
            sb_printf(b, "\\\"");
        else if (*v == '\n')
            sb_printf(b, "\\n");
        else
            sb_printf(b, "%c", *v);
    }
}

static void sb_family(strbuf_t *b, const char *name, const char *type, const char *help)
{
    sb_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* A counter family of one label: name{label="names[k]"} vals[k], k < n. */
static void sb_counters(strbuf_t *b, const char *name, const char *help, const char *label,
                        const char *const *names, _Atomic uint64_t *vals, int n)
{
    sb_family(b, name, "counter", help);
    for (int k = 0; k < n; k++)
        sb_printf(b, "%s{%s=\"%s\"} %llu\n", name, label, names[k],
                  (unsigned long long)get(&vals[k]));
}

/* One histogram series; labels is "kind=\"all_reduce\"". Buckets are read
 * once, so _count always equals the +Inf bucket in one scrape. */
static void sb_histogram(strbuf_t *b, const char *name, const char *labels, m_histogram_t *h)
{
    uint64_t cum = 0;
    for (int i = 0; i <= M_BUCKETS; i++) {
        cum += get(&h->bucket[i]);
        sb_printf(b, "%s_bucket{%s,le=\"%s\"} %llu\n", name, labels,
                  i < M_BUCKETS ? bucket_le[i] : "+Inf", (unsigned long long)cum);
    }
    uint64_t ns = get(&h->sum_ns);
    sb_printf(b, "%s_sum{%s} %llu.%09llu\n", name, labels, (unsigned long long)(ns / 1000000000u),
              (unsigned long long)(ns % 1000000000u));
    sb_printf(b, "%s_count{%s} %llu\n", name, labels, (unsigned long long)cum);
}

static uint64_t histogram_count(m_histogram_t *h)
{
    uint64_t n = 0;
    for (int i = 0; i <= M_BUCKETS; i++)
        n += get(&h->bucket[i]);
    return n;
}

static void render_collectives(strbuf_t *b)
{
    char labels[64];
    sb_family(b, "paramsync_collectives_total", "counter",
              "Collectives finished on this hub, one per rank, by collective kind and gRPC status "
              "code.");
    for (int k = 0; k < M_KINDS; k++)
        for (int c = 0; c < M_CODES; c++) {
            uint64_t v = get(&g_collectives[k][c]);
            /* Every real kind shows an OK series from the start, so rate()
             * sees the first collective; other codes appear when they occur. */
            if (v || (c == 0 && k > 0))
                sb_printf(b, "paramsync_collectives_total{kind=\"%s\",code=\"%s\"} %llu\n",
                          kind_names[k], code_names[c], (unsigned long long)v);
        }
    sb_family(b, "paramsync_collective_duration_seconds", "histogram",
              "Time from a rank's arrival to the end of its part of the collective.");
    for (int k = 0; k < M_KINDS; k++)
        if (histogram_count(&g_duration[k])) {
            snprintf(labels, sizeof(labels), "kind=\"%s\"", kind_names[k]);
            sb_histogram(b, "paramsync_collective_duration_seconds", labels, &g_duration[k]);
        }
    sb_family(b, "paramsync_collectives_in_flight", "gauge",
              "Collectives the hub has started and not yet freed.");
    sb_printf(b, "paramsync_collectives_in_flight %lld\n",
              (long long)atomic_load_explicit(&g_inflight, RELAXED));
    sb_family(b, "paramsync_arrival_skew_seconds", "histogram",
              "Time between the first and the last rank's arrival at a collective.");
    for (int k = 0; k < M_KINDS; k++)
        if (histogram_count(&g_skew[k])) {
            snprintf(labels, sizeof(labels), "kind=\"%s\"", kind_names[k]);
            sb_histogram(b, "paramsync_arrival_skew_seconds", labels, &g_skew[k]);
        }
    int limit = atomic_load_explicit(&g_rank_limit, RELAXED);
    uint64_t other = get(&g_straggler[M_RANK_SLOTS]);
    sb_family(b, "paramsync_straggler_total", "counter",
              "Collectives whose last-arriving rank was this group rank (ranks at or above "
              "--metrics-rank-limit count as \"other\").");
    for (int r = 0; r < M_RANK_SLOTS; r++) {
        uint64_t v = get(&g_straggler[r]);
        if (r >= limit)
            other += v;
        else if (v)
            sb_printf(b, "paramsync_straggler_total{rank=\"%d\"} %llu\n", r, (unsigned long long)v);
    }
    if (other)
        sb_printf(b, "paramsync_straggler_total{rank=\"other\"} %llu\n", (unsigned long long)other);
}

static void render_traffic(strbuf_t *b)
{
    static const char *const dir_names[2] = {"received", "sent"};
    static const char *const link_names[2] = {"worker", "agent"};
    static const char *const device_names[2] = {"cpu", "cuda"};
    sb_family(b, "paramsync_payload_bytes_total", "counter",
              "Tensor payload bytes received and sent, by link: worker (workers and this agent) "
              "or agent (between agents).");
    for (int d = 0; d < 2; d++)
        for (int l = 0; l < 2; l++)
            sb_printf(b, "paramsync_payload_bytes_total{direction=\"%s\",link=\"%s\"} %llu\n",
                      dir_names[d], link_names[l], (unsigned long long)get(&g_bytes[d][l]));
    static const char *const access_names[PS_M_SHM_ACCESSES] = {"mapped", "file", "process",
                                                                "device"};
    sb_family(b, "paramsync_shm_bytes_total", "counter",
              "Tensor payload bytes read from (received) and written into (sent) workers' "
              "shared-memory segments, by access: mapped (in place), file (pread/pwrite, "
              "collectives over --shm-resident-bytes), process (straight from and into the "
              "worker's own buffers, process_vm_readv/writev) or device (results the CUDA "
              "device wrote into pinned segments itself, --reduce-device).");
    for (int d = 0; d < 2; d++)
        for (int a = 0; a < PS_M_SHM_ACCESSES; a++)
            sb_printf(b, "paramsync_shm_bytes_total{direction=\"%s\",access=\"%s\"} %llu\n",
                      dir_names[d], access_names[a], (unsigned long long)get(&g_shm[d][a]));
    /* The order of PS_SHM_* (daemon.h), then PS_M_SHM_TWO. */
    static const char *const seg_names[PS_M_SHM_CALL_KINDS] = {"payload", "doorbell", "registered",
                                                               "process", "registered_two"};
    sb_counters(b, "paramsync_shm_calls_total",
                "Collective calls of this agent's workers served from their shared memory, by "
                "where input and output lay: the worker's payload segment (copied in and out by "
                "the worker), its doorbell, registered memory (ps_mem_alloc, empty(): in "
                "place), two registered segments (input in one, output in another: in place), "
                "or its own memory through its process segment.",
                "segments", seg_names, g_shm_calls, PS_M_SHM_CALL_KINDS);
    sb_counters(b, "paramsync_reduced_bytes_total",
                "Input bytes of every reduction the hub ran, by device.", "device", device_names,
                g_reduced, 2);
    static const char *const pin_names[2] = {"segments", "buffers"};
    sb_family(b, "paramsync_pinned_bytes", "gauge",
              "Host memory this agent holds pinned (page-locked) for its CUDA reductions: "
              "workers' segments registered with the device while they are attached, and its "
              "own step buffers, kept for reuse. 0 when it reduces on the CPU.");
    for (int k = 0; k < 2; k++)
        sb_printf(b, "paramsync_pinned_bytes{kind=\"%s\"} %lld\n", pin_names[k],
                  (long long)atomic_load_explicit(&g_pinned[k], RELAXED));
    sb_family(b, "paramsync_relayed_bytes_total", "counter",
              "Payload bytes this agent received from the previous agent of a ring and "
              "passed on unchanged to the next (all_gather, broadcast steps of ranks on "
              "other agents). An all_to_all goes straight to its rank's agent: none.");
    sb_printf(b, "paramsync_relayed_bytes_total %llu\n", (unsigned long long)get(&g_relayed));
    sb_counters(b, "paramsync_agent_collectives_total",
                "Collectives this agent combined with other agents rather than at a hub, by "
                "algorithm: round the ring, over the mesh (all_to_all), or by recursive doubling "
                "(all_reduces of at most --rd-max-bytes per rank).",
                "algorithm", ring_algos, g_ring, PS_M_RING_COUNT);
    static const char *const link_uses[2] = {"opened", "kept"};
    sb_counters(b, "paramsync_agent_links_total",
                "Links this agent used to send a collective's frames to another agent (one per "
                "agent it sends to, per collective): opened for it (an Agent.Ring call), or kept "
                "open from an earlier collective of the job (--link-keep-ms).",
                "link", link_uses, g_links, 2);
}

static void render_events(strbuf_t *b)
{
    static const struct {
        const char *name, *help;
    } ev[PS_M_EV_COUNT] = {
        [PS_M_EV_TIMEOUT] = {"paramsync_timeouts_total",
                             "Collectives and rendezvous that hit their deadline."},
        [PS_M_EV_MISMATCH] = {"paramsync_mismatches_total",
                              "Collectives failed because ranks disagreed (kind, dtype, count, "
                              "op or root)."},
        [PS_M_EV_AUTH_FAILURE] = {"paramsync_auth_failures_total",
                                  "Calls refused for a missing or wrong job token."},
        [PS_M_EV_REJECTED] = {"paramsync_rejected_requests_total",
                              "Requests refused by a limit or by validation."},
        [PS_M_EV_RANK_LOST] = {"paramsync_ranks_lost_total",
                               "Members whose stream broke without a graceful leave (not "
                               "counting those of an agent that said it was stopping)."},
        [PS_M_EV_RANK_STOPPED] = {"paramsync_ranks_stopped_total",
                                  "Members lost because their agent said it was stopping "
                                  "(SIGTERM: a rollout or a drain)."},
    };
    for (int e = 0; e < PS_M_EV_COUNT; e++) {
        sb_family(b, ev[e].name, "counter", ev[e].help);
        sb_printf(b, "%s %llu\n", ev[e].name, (unsigned long long)get(&g_events[e]));
    }
}

static void render_grpc(strbuf_t *b)
{
    sb_family(b, "paramsync_grpc_calls_total", "counter",
              "gRPC calls this daemon served, by service, method and status code.");
    int n = atomic_load_explicit(&g_nmethods, memory_order_acquire);
    for (int i = 0; i < n; i++)
        for (int c = 0; c < M_CODES; c++) {
            uint64_t v = get(&g_methods[i].calls[c]);
            if (!v)
                continue;
            sb_printf(b, "paramsync_grpc_calls_total{service=\"");
            sb_label_value(b, g_methods[i].service);
            sb_printf(b, "\",method=\"");
            sb_label_value(b, g_methods[i].method);
            sb_printf(b, "\",code=\"%s\"} %llu\n", code_names[c], (unsigned long long)v);
        }
    for (int c = 0; c < M_CODES; c++) {
        uint64_t v = get(&g_grpc_other[c]);
        if (v)
            sb_printf(b,
                      "paramsync_grpc_calls_total{service=\"other\",method=\"other\",code=\"%s\"} "
                      "%llu\n",
                      code_names[c], (unsigned long long)v);
    }
}

/* Called with g_lock held. */
static void render_info_and_gauges(strbuf_t *b)
{
    sb_family(b, "paramsync_build_info", "gauge",
              "Always 1; the labels say the version, role, reduction SIMD path and whether CUDA "
              "is built in.");
    sb_printf(b, "paramsync_build_info{version=\"");
    sb_label_value(b, g_version);
    sb_printf(b, "\",role=\"");
    sb_label_value(b, g_role);
    sb_printf(b, "\",simd=\"");
    sb_label_value(b, g_simd);
    sb_printf(b, "\",cuda=\"%s\"} 1\n", g_cuda ? "true" : "false");
    sb_family(b, "paramsync_start_time_seconds", "gauge",
              "When the metrics registry started, in seconds since the Unix epoch.");
    sb_printf(b, "paramsync_start_time_seconds %.3f\n", g_start_time);
    if (g_wait_fn) {
        double w = g_wait_fn(g_wait_arg);
        sb_family(b, "paramsync_collective_longest_wait_seconds", "gauge",
                  "How long the collective in flight on this hub that has waited longest for "
                  "its missing ranks has waited (0 when none waits).");
        sb_printf(b, "paramsync_collective_longest_wait_seconds %.3f\n", w > 0 ? w : 0.0);
    }
    if (!g_gauge_fn)
        return;
    ps__metrics_gauges_t v = {0, 0, 0, 0};
    g_gauge_fn(g_gauge_arg, &v);
    sb_family(b, "paramsync_jobs", "gauge", "Jobs the coordinator knows (forming or running).");
    sb_printf(b, "paramsync_jobs %lld\n", (long long)v.jobs);
    sb_family(b, "paramsync_groups", "gauge", "Process groups of those jobs.");
    sb_printf(b, "paramsync_groups %lld\n", (long long)v.groups);
    sb_family(b, "paramsync_members", "gauge", "Ranks currently joined, over every job.");
    sb_printf(b, "paramsync_members %lld\n", (long long)v.members);
    sb_family(b, "paramsync_agents", "gauge",
              "Agents registered with the coordinator, less those that said they are stopping "
              "and those that stopped registering again.");
    sb_printf(b, "paramsync_agents %lld\n", (long long)v.agents);
}

char *ps__metrics_render(void)
{
    strbuf_t b = {malloc(16384), 0, 16384, 0};
    if (!b.p)
        return NULL;
    pthread_mutex_lock(&g_lock);
    render_info_and_gauges(&b);
    pthread_mutex_unlock(&g_lock);
    render_collectives(&b);
    render_traffic(&b);
    render_events(&b);
    render_grpc(&b);
    if (b.failed) {
        free(b.p);
        return NULL;
    }
    return b.p;
}

/* ---------------------------------------------------------------- HTTP */

static enum MHD_Result respond(struct MHD_Connection *conn, unsigned status, char *body,
                               enum MHD_ResponseMemoryMode mode, const char *content_type)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(body), body, mode);
    if (!r) {
        if (mode == MHD_RESPMEM_MUST_FREE)
            free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, content_type);
    if (status == MHD_HTTP_METHOD_NOT_ALLOWED)
        MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
    enum MHD_Result ret = MHD_queue_response(conn, status, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result http_handler(void *cls, struct MHD_Connection *conn, const char *url,
                                    const char *method, const char *version,
                                    const char *upload_data, size_t *upload_data_size,
                                    void **con_cls)
{
    (void)cls;
    (void)version;
    (void)upload_data;
    (void)upload_data_size;
    (void)con_cls;
    static char not_found[] = "not found: metrics are served at /metrics\n";
    static char not_allowed[] = "method not allowed: use GET\n";
    static char no_memory[] = "out of memory rendering metrics\n";
    if (strcmp(url, "/metrics") != 0)
        return respond(conn, MHD_HTTP_NOT_FOUND, not_found, MHD_RESPMEM_PERSISTENT, "text/plain");
    if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0)
        return respond(conn, MHD_HTTP_METHOD_NOT_ALLOWED, not_allowed, MHD_RESPMEM_PERSISTENT,
                       "text/plain");
    char *body = ps__metrics_render();
    if (!body)
        return respond(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, no_memory, MHD_RESPMEM_PERSISTENT,
                       "text/plain");
    return respond(conn, MHD_HTTP_OK, body, MHD_RESPMEM_MUST_FREE, "text/plain; version=0.0.4");
}

static void copy_label(char *dst, size_t cap, const char *src)
{
    snprintf(dst, cap, "%s", src && *src ? src : "unknown");
}

/* Splits "HOST:PORT" or "[V6]:PORT" (an empty host is every address).
 * 0, or PS_EINVAL. */
static int split_addr(const char *addr, char *host, size_t hostcap, unsigned *port)
{
    const char *colon = strrchr(addr, ':');
    if (!colon || !colon[1])
        return PS_EINVAL;
    char *end;
    unsigned long p = strtoul(colon + 1, &end, 10);
    if (*end || p > 65535)
        return PS_EINVAL;
    const char *h = addr;
    size_t hl = (size_t)(colon - addr);
    if (hl >= 2 && h[0] == '[' && h[hl - 1] == ']') {
        h++;
        hl -= 2;
    }
    if (hl >= hostcap)
        return PS_EINVAL;
    memcpy(host, h, hl);
    host[hl] = 0;
    *port = (unsigned)p;
    return 0;
}

int ps__metrics_start(const ps__metrics_config_t *cfg, const char **bound)
{
    int rc = 0;
    struct addrinfo *ai = NULL;
    pthread_mutex_lock(&g_lock);
    if (g_daemon) {
        rc = PS_EINVAL; /* started twice without ps__metrics_stop */
        goto out;
    }
    copy_label(g_version, sizeof(g_version), cfg->version);
    copy_label(g_role, sizeof(g_role), cfg->role);
    copy_label(g_simd, sizeof(g_simd), cfg->simd);
    g_cuda = cfg->cuda != 0;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    g_start_time = (double)now.tv_sec + now.tv_nsec / 1e9;
    int limit = cfg->rank_limit < 0              ? M_DEFAULT_RANK
                : cfg->rank_limit > M_RANK_SLOTS ? M_RANK_SLOTS
                                                 : cfg->rank_limit;
    atomic_store_explicit(&g_rank_limit, limit, RELAXED);
    if (!cfg->addr || !*cfg->addr || strcmp(cfg->addr, "off") == 0) {
        if (bound)
            *bound = NULL;
        goto out;
    }

    char host[256];
    unsigned port;
    if ((rc = split_addr(cfg->addr, host, sizeof(host), &port)) < 0)
        goto out;
    char portstr[8];
    snprintf(portstr, sizeof(portstr), "%u", port);
    struct addrinfo hints;
    memset(&hints, 0, sizeof(hints));
    /* An empty host means every IPv4 address, like gRPC's "0.0.0.0:PORT". */
    hints.ai_family = *host ? AF_UNSPEC : AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    if (getaddrinfo(*host ? host : NULL, portstr, &hints, &ai) != 0 || !ai) {
        rc = PS_EINVAL;
        goto out;
    }
    unsigned flags = MHD_USE_AUTO_INTERNAL_THREAD;
    if (ai->ai_family == AF_INET6)
        flags |= MHD_USE_IPv6;
    /* Scrapes are small and quick. Slow or stuck clients must not lock the
     * scraper out: the limit is far above what scrapers use (a connection
     * over it is closed at once), and a connection idle for 5 s (a request
     * never finished) is dropped, so held connections free up within the 10 s
     * Prometheus waits for a scrape. */
    g_daemon = MHD_start_daemon(flags, (uint16_t)port, NULL, NULL, http_handler, NULL,
                                MHD_OPTION_SOCK_ADDR, ai->ai_addr, MHD_OPTION_CONNECTION_LIMIT,
                                (unsigned)M_HTTP_CONNECTIONS, MHD_OPTION_CONNECTION_TIMEOUT,
                                (unsigned)M_HTTP_IDLE_S, MHD_OPTION_END);
    if (!g_daemon) {
        rc = PS_EUNAVAIL;
        goto out;
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(g_daemon, MHD_DAEMON_INFO_BIND_PORT);
    unsigned bound_port = info && info->port ? info->port : port;
    const char *shown = *host ? host : "0.0.0.0";
    if (ai->ai_family == AF_INET6)
        snprintf(g_bound, sizeof(g_bound), "[%s]:%u", shown, bound_port);
    else
        snprintf(g_bound, sizeof(g_bound), "%s:%u", shown, bound_port);
    if (bound)
        *bound = g_bound;
out:
    if (ai)
        freeaddrinfo(ai);
    pthread_mutex_unlock(&g_lock);
    return rc;
}

void ps__metrics_stop(void)
{
    /* MHD_stop_daemon waits for a scrape in progress, which takes g_lock:
     * stop outside it. */
    pthread_mutex_lock(&g_lock);
    struct MHD_Daemon *d = g_daemon;
    g_daemon = NULL;
    pthread_mutex_unlock(&g_lock);
    if (d)
        MHD_stop_daemon(d);
}
