/* The coordinator: job membership, rank assignment, groups and the liveness of ranks. */
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <grpc/status.h>

#include <paramsync/common.h>

#include "auth.h"
#include "daemon.h"
#include "log.h"
#include "metrics.h"
#include "paramsync/v1/paramsync.pb-c.h"

typedef enum member_state { M_FREE = 0, M_JOINED, M_LEFT, M_LOST } member_state_t;

typedef struct event {
    Paramsync__V1__JoinEvent__Kind kind;
    int rank;
    char *message;
    struct event *next;
} event_t;

/* The sets of ranks READY names (JoinEvent.peer_sets, device_sets, barrier_sets). */
enum { SET_PEER, SET_DEVICE, SET_BARRIER, SETS };

typedef struct member {
    member_state_t state;
    int leaving; /* Leave was called: the end of its stream is not a loss */
    char *agent;
    char *machine; /* of its agent ("" unknown) */
    char *peer;
    int peer_copies;        /* JoinRequest.peer_copies */
    uint64_t pid_namespace; /* JoinRequest.pid_namespace */
    uint64_t cuda_host;     /* JoinRequest.cuda_host */
    int direct_barrier;     /* JoinRequest.direct_barrier */
    int agent_stopping;     /* its agent said it is stopping (do_register) */
    char *settings;         /* JoinRequest.agent_settings of its agent */
    event_t *events, **events_tail;
} member_t;

typedef struct group {
    uint32_t id;
    int nranks;
    int *ranks;
    struct group *next;
} group_t;

typedef struct job {
    char *name;
    int world_size;
    int njoined;
    int ready;
    int aborted;
    int detached; /* replaced by a new incarnation; no longer in the list */
    /* Not formed: its agents' settings differ. Every join until refused_until
     * (the refused rank's rendezvous deadline) is told this; then a join
     * forms the job anew. */
    char *refused;
    int64_t refused_until;
    uint64_t incarnation;
    member_t *members;
    /* JoinEvent.peer_sets, device_sets and barrier_sets, made when the job
     * forms (NULL: none) */
    uint32_t *sets[SETS];
    group_t *groups;
    struct job *next;
} job_t;

/* A registered agent, once per address. */
typedef struct {
    char *addr;
    char *stopping;      /* NULL, or why it said it is shutting down */
    uint64_t stopped_at; /* the order it said so in (c->stops) */
    int id;              /* agent-N */
    uint32_t refresh_ms; /* it registers again this often; 0: it never does */
    int64_t seen_ms;     /* when it last registered */
} agent_entry_t;

/* An agent not heard from in this many of its refresh periods is no longer
 * listed (it died, or its node did). */
#define AGENT_MISSED_REFRESHES 3

/* Agents that said they were stopping stay listed (StatusResponse.
 * stopping_agents) up to this many, the latest; a Kubernetes rollout gives
 * each agent a new address, so they would pile up otherwise. */
#define STOPPING_LISTED 32

struct ps__coordinator {
    const ps__config_t *cfg;
    pthread_mutex_t lock;
    pthread_cond_t changed;
    job_t *jobs;
    uint64_t next_incarnation;
    int nagents;
    agent_entry_t *agent_list; /* registered agents, each once */
    char *last_settings;       /* RegisterAgentRequest.agent_settings of the last agent that
                                  said */
    char *last_settings_agent; /* that agent's address */
    ps__tokens_t *tokens;      /* NULL: no authentication */
    int nagent_list;
    uint64_t stops; /* agents that said they were stopping, so far */
    int draining;   /* SIGTERM: Joins end saying so (ps__coordinator_drain) */
};

/* The agent registered at addr, or NULL; with c->lock. */
static agent_entry_t *agent_find(const ps__coordinator_t *c, const char *addr)
{
    for (int i = 0; addr && i < c->nagent_list; i++)
        if (strcmp(c->agent_list[i].addr, addr) == 0)
            return &c->agent_list[i];
    return NULL;
}

static job_t *job_find(ps__coordinator_t *c, const char *name)
{
    for (job_t *j = c->jobs; j; j = j->next)
        if (strcmp(j->name, name) == 0)
            return j;
    return NULL;
}

static void job_free(job_t *j)
{
    for (int r = 0; r < j->world_size; r++) {
        member_t *m = &j->members[r];
        while (m->events) {
            event_t *e = m->events;
            m->events = e->next;
            free(e->message);
            free(e);
        }
        free(m->agent);
        free(m->machine);
        free(m->peer);
        free(m->settings);
    }
    for (int k = 0; k < SETS; k++)
        free(j->sets[k]);
    free(j->refused);
    while (j->groups) {
        group_t *g = j->groups;
        j->groups = g->next;
        free(g->ranks);
        free(g);
    }
    free(j->members);
    free(j->name);
    free(j);
}

static void job_unlink(ps__coordinator_t *c, job_t *j)
{
    for (job_t **p = &c->jobs; *p; p = &(*p)->next)
        if (*p == j) {
            *p = j->next;
            return;
        }
}

static void push_event(member_t *m, Paramsync__V1__JoinEvent__Kind kind, int rank, const char *msg)
{
    event_t *e = calloc(1, sizeof(*e));
    if (!e)
        return;
    e->kind = kind;
    e->rank = rank;
    e->message = msg ? strdup(msg) : NULL;
    *m->events_tail = e;
    m->events_tail = &e->next;
}

static event_t *pop_event(member_t *m)
{
    event_t *e = m->events;
    if (e) {
        m->events = e->next;
        if (!m->events)
            m->events_tail = &m->events;
    }
    return e;
}

/* ---- Join: rendezvous, then the membership stream ---- */

typedef struct join_watch {
    ps__coordinator_t *c;
    ps__rpc_call_t *call;
    job_t *job;
    int rank;
    int ended; /* 1: graceful (half-close), 2: broken */
    int done;
} join_watch_t;

/* Blocks on the member's stream: its end is how we learn that the rank left
 * or died, without any polling. */
static void *join_watch_main(void *arg)
{
    join_watch_t *w = arg;
    grpc_byte_buffer *bb = NULL;
    int graceful = 0;
    for (;;) {
        int rc = ps__rpc_call_recv(w->call, &bb);
        if (rc < 0)
            break;
        if (!bb) {
            /* gRPC reports a member that died as an end of stream too; the
             * Leave call before it is what makes an end graceful. */
            graceful = 1;
            break;
        }
        grpc_byte_buffer_destroy(bb); /* extra requests are ignored */
    }
    pthread_mutex_lock(&w->c->lock);
    w->ended = graceful ? 1 : 2;
    pthread_cond_broadcast(&w->c->changed);
    pthread_mutex_unlock(&w->c->lock);
    return NULL;
}

static int send_event(ps__rpc_call_t *call, Paramsync__V1__JoinEvent__Kind kind, int rank,
                      int world, const char *hub, uint64_t inc, const char *msg,
                      uint32_t *const *sets)
{
    Paramsync__V1__JoinEvent ev = PARAMSYNC__V1__JOIN_EVENT__INIT;
    ev.kind = kind;
    if (sets) {
        ev.peer_sets = sets[SET_PEER];
        ev.n_peer_sets = sets[SET_PEER] ? (size_t)world : 0;
        ev.device_sets = sets[SET_DEVICE];
        ev.n_device_sets = sets[SET_DEVICE] ? (size_t)world : 0;
        ev.barrier_sets = sets[SET_BARRIER];
        ev.n_barrier_sets = sets[SET_BARRIER] ? (size_t)world : 0;
    }
    ev.rank = rank;
    ev.world_size = world;
    ev.hub = (char *)(hub ? hub : "");
    ev.incarnation = inc;
    ev.message = (char *)(msg ? msg : "");
    return ps__rpc_send_msg(call, &ev.base);
}

/* Whether member m may be in a set of kind `kind` at all. */
static int in_sets(const member_t *m, int kind)
{
    if (kind == SET_DEVICE)
        return m->cuda_host != 0;
    return m->peer_copies && m->pid_namespace && (kind == SET_PEER || m->direct_barrier);
}

/* Whether member m may share a set of kind `kind` with x. */
static int same_set(const member_t *m, const member_t *x, int kind)
{
    return in_sets(x, kind) &&
           (kind == SET_DEVICE ? x->cuda_host == m->cuda_host
                               : x->pid_namespace == m->pid_namespace) &&
           x->agent && strcmp(x->agent, m->agent) == 0;
}

/* JoinEvent.peer_sets (SET_PEER; SET_DEVICE: device_sets, SET_BARRIER: barrier_sets)
 * for a job whose ranks have all joined (lock held; made once as it forms,
 * O(n^2) in its world size at worst): ranks that asked for peer copies
 * through the same agent from the same PID namespace (device: that joined
 * with CUDA on the same host through the same agent; barrier: peer copies
 * and direct barriers) share a number, one more than the first such rank;
 * the others have 0. NULL: no memory (then READY goes without, and no rank
 * takes that path). */
static uint32_t *rank_sets(const job_t *j, int kind)
{
    uint32_t *sets = calloc((size_t)j->world_size, sizeof(*sets));
    for (int r = 0; sets && r < j->world_size; r++) {
        const member_t *m = &j->members[r];
        if (!in_sets(m, kind) || !m->agent || !*m->agent)
            continue;
        int first = 0;
        while (!same_set(m, &j->members[first], kind))
            first++;
        sets[r] = (uint32_t)first + 1;
    }
    return sets;
}

/* A copy of a job's sets of world numbers, or NULL (none, or no memory). */
static uint32_t *sets_copy(const uint32_t *sets, int world)
{
    uint32_t *copy = sets ? malloc((size_t)world * sizeof(*copy)) : NULL;
    if (copy)
        memcpy(copy, sets, (size_t)world * sizeof(*copy));
    return copy;
}

/* Frees the jobs refused (settings_differ) whose window is over and that no
 * rank holds. Lock held. */
static void job_purge_refused(ps__coordinator_t *c)
{
    int64_t now = ps__now_ms();
    for (job_t **pj = &c->jobs; *pj;) {
        job_t *j = *pj;
        if (j->refused && !j->ready && j->njoined == 0 && now >= j->refused_until) {
            *pj = j->next;
            job_free(j);
        } else {
            pj = &j->next;
        }
    }
}

/* What to do about agents' settings that differ, for the messages. */
#define PS_SETTINGS_ALIKE                                                                          \
    "give every agent the same --ring, --ring-min-bytes, --rd-max-bytes and --step-bytes, "        \
    "and one release of paramsyncd (--wire: how agents talk to each other)"

/* Two agents' settings ("--flag value ...") for a message, into a (x's) and
 * b (y's), each of size bytes: the pairs whose values differ where both
 * name the same flags in the same order, else the whole of each. */
static void settings_diff(const char *x, const char *y, char *a, char *b, size_t size)
{
    char xs[160], ys[160], *xp, *yp;
    snprintf(xs, sizeof(xs), "%s", x);
    snprintf(ys, sizeof(ys), "%s", y);
    size_t na = 0, nb = 0;
    a[0] = b[0] = '\0';
    char *xf = strtok_r(xs, " ", &xp), *yf = strtok_r(ys, " ", &yp);
    int same = 1;
    while (same && xf && yf) {
        char *xv = strtok_r(NULL, " ", &xp), *yv = strtok_r(NULL, " ", &yp);
        same = xv && yv && strcmp(xf, yf) == 0;
        if (same && strcmp(xv, yv) != 0 && na < size && nb < size) {
            na += (size_t)snprintf(a + na, size - na, "%s%s %s", na ? " " : "", xf, xv);
            nb += (size_t)snprintf(b + nb, size - nb, "%s%s %s", nb ? " " : "", yf, yv);
        }
        xf = strtok_r(NULL, " ", &xp);
        yf = strtok_r(NULL, " ", &yp);
    }
    if (!same || xf || yf || !a[0]) {
        snprintf(a, size, "%s", x);
        snprintf(b, size, "%s", y);
    }
}

/*
 * Whether the agent of a rank joining j (as rank) runs with settings that
 * differ from those of the agent of a rank already in j (JoinRequest.
 * agent_settings; agents that do not say are not compared): then the job is
 * refused, with msg, which every rank that joins it within the joining
 * rank's rendezvous deadline is told, those waiting included. Its
 * collectives between those agents would not meet: one would take recursive
 * doubling, the other the ring, or the hub. Lock held.
 */
static int settings_differ(ps__coordinator_t *c, job_t *j, const Paramsync__V1__JoinRequest *req,
                           int rank, char *msg, size_t msglen)
{
    const char *mine = req->agent_settings ? req->agent_settings : "";
    for (int r = 0; *mine && r < j->world_size; r++) {
        const member_t *o = &j->members[r];
        if (o->state != M_JOINED || !o->settings || !*o->settings || !strcmp(o->settings, mine))
            continue;
        char theirs[160], ours[160];
        settings_diff(o->settings, mine, theirs, ours, sizeof(theirs));
        snprintf(msg, msglen,
                 "join job %s: its agents run with different settings: %s at agent %s (rank %d) "
                 "but %s at agent %s (rank %d); " PS_SETTINGS_ALIKE,
                 req->job, theirs, o->agent, r, ours, req->agent ? req->agent : "?", rank);
        free(j->refused);
        j->refused = strdup(msg);
        int64_t wait = req->timeout_ms ? (int64_t)req->timeout_ms : c->cfg->join_timeout_ms;
        j->refused_until = ps__now_ms() + wait;
        pthread_cond_broadcast(&c->changed);
        return 1;
    }
    return 0;
}

/* Registers the joiner; returns the rank or a negative code with msg set. */
static int join_register(ps__coordinator_t *c, const Paramsync__V1__JoinRequest *req,
                         const char *peer, job_t **jobp, char *msg, size_t msglen)
{
    if (!req->job || !*req->job) {
        snprintf(msg, msglen, "join: the job id is empty");
        return PS_EINVAL;
    }
    if (req->world_size <= 0) {
        snprintf(msg, msglen, "join job %s: world_size %d must be positive", req->job,
                 req->world_size);
        return PS_EINVAL;
    }
    if (req->world_size > c->cfg->max_world_size) {
        snprintf(msg, msglen,
                 "join job %s: world_size %d is over this daemon's limit of %d "
                 "(--max-world-size)",
                 req->job, req->world_size, c->cfg->max_world_size);
        return PS_ENOMEM;
    }
    if (req->rank < -1 || req->rank >= req->world_size) {
        snprintf(msg, msglen, "join job %s: rank %d is out of range for world_size %d", req->job,
                 req->rank, req->world_size);
        return PS_EINVAL;
    }
    if (c->draining) {
        snprintf(msg, msglen, "%s", PS_MSG_STOPPING);
        return PS_EUNAVAIL;
    }
    job_purge_refused(c);
    job_t *j = job_find(c, req->job);
    int refused = j && j->refused && !j->ready;
    if (refused && ps__now_ms() < j->refused_until) {
        snprintf(msg, msglen, "%s", j->refused);
        return PS_EPRECOND;
    }
    if (j && (j->aborted || refused)) {
        /* Elastic restart: after a failure the survivors (and replacements)
         * form the job anew, with any world size; a refused job, once told
         * for long enough, too. The old one is detached; its last members
         * free it when they go. */
        job_unlink(c, j);
        j->detached = 1;
        if (j->njoined == 0)
            job_free(j);
        j = NULL;
    } else if (j && j->ready) {
        snprintf(msg, msglen,
                 "join job %s: the job is already running with all %d ranks; wait for its ranks "
                 "to leave or use another job id",
                 req->job, j->world_size);
        return PS_EEXIST;
    }
    if (!j) {
        int njobs = 0;
        for (job_t *x = c->jobs; x; x = x->next)
            njobs++;
        if (njobs >= c->cfg->max_jobs) {
            snprintf(msg, msglen, "join job %s: this daemon already holds %d jobs (--max-jobs)",
                     req->job, njobs);
            return PS_ENOMEM;
        }
        j = calloc(1, sizeof(*j));
        if (!j)
            return PS_ENOMEM;
        j->name = strdup(req->job);
        j->world_size = req->world_size;
        j->members = calloc((size_t)req->world_size, sizeof(member_t));
        if (!j->name || !j->members) {
            free(j->name);
            free(j->members);
            free(j);
            return PS_ENOMEM;
        }
        for (int r = 0; r < j->world_size; r++)
            j->members[r].events_tail = &j->members[r].events;
        j->next = c->jobs;
        c->jobs = j;
    }
    if (j->world_size != req->world_size) {
        snprintf(msg, msglen,
                 "join job %s: world_size mismatch: this rank asked for %d but the job was "
                 "started with %d",
                 req->job, req->world_size, j->world_size);
        return PS_EINVAL;
    }
    int rank = req->rank;
    if (rank >= 0 && j->members[rank].state == M_JOINED) {
        snprintf(msg, msglen, "join job %s: rank %d has already joined (from %s)", req->job, rank,
                 j->members[rank].peer ? j->members[rank].peer : "?");
        return PS_EEXIST;
    }
    if (rank < 0) {
        for (int r = 0; r < j->world_size && rank < 0; r++)
            if (j->members[r].state != M_JOINED)
                rank = r;
    }
    if (settings_differ(c, j, req, rank, msg, msglen))
        return PS_EPRECOND;
    member_t *m = &j->members[rank];
    m->state = M_JOINED;
    m->leaving = 0;
    free(m->agent);
    free(m->machine);
    free(m->peer);
    m->agent = strdup(req->agent ? req->agent : "");
    m->machine = strdup(req->agent_machine ? req->agent_machine : "");
    m->peer = strdup(peer);
    m->peer_copies = req->peer_copies;
    m->pid_namespace = req->pid_namespace;
    m->cuda_host = req->cuda_host;
    m->direct_barrier = req->direct_barrier;
    m->agent_stopping = 0;
    free(m->settings);
    m->settings = strdup(req->agent_settings ? req->agent_settings : "");
    j->njoined++;
    if (j->njoined == j->world_size) {
        j->ready = 1;
        for (int k = 0; k < SETS; k++) {
            free(j->sets[k]);
            j->sets[k] = rank_sets(j, k);
        }
        j->incarnation = ++c->next_incarnation;
        PS_LOG(PS_LOG_INFO, "job %s: ready, world_size %d, incarnation %llu, hub %s", j->name,
               j->world_size, (unsigned long long)j->incarnation, j->members[0].agent);
        pthread_cond_broadcast(&c->changed);
    }
    *jobp = j;
    return rank;
}

static void coord_join(ps__rpc_call_t *call, void *arg)
{
    ps__coordinator_t *c = arg;
    Paramsync__V1__JoinRequest *req = NULL;
    char msg[1024] = "";
    int code = GRPC_STATUS_OK;
    join_watch_t w = {.c = c, .call = call};
    pthread_t watcher;
    int watching = 0;

    int rc =
        ps__rpc_recv_msg(call, &paramsync__v1__join_request__descriptor, (ProtobufCMessage **)&req);
    if (rc != 0) {
        ps__rpc_call_send_status(call, GRPC_STATUS_INVALID_ARGUMENT,
                                 "join: expected a JoinRequest");
        return;
    }
    /* The worker's own address when an agent forwarded the call. */
    if (ps__auth_check(c->tokens, call, req->job)) {
        protobuf_c_message_free_unpacked(&req->base, NULL);
        return;
    }
    const char *peer = req->peer && *req->peer ? req->peer : ps__rpc_call_peer(call);
    int64_t timeout = req->timeout_ms ? (int64_t)req->timeout_ms : c->cfg->join_timeout_ms;

    pthread_mutex_lock(&c->lock);
    job_t *j = NULL;
    int rank = join_register(c, req, peer, &j, msg, sizeof(msg));
    if (rank < 0) {
        pthread_mutex_unlock(&c->lock);
        PS_LOG(PS_LOG_WARN, "%s", msg);
        ps__metrics_event(PS_M_EV_REJECTED);
        code = -rank;
        goto out;
    }
    PS_LOG(PS_LOG_INFO, "job %s: rank %d joined (%d of %d) from %s via agent %s", j->name, rank,
           j->njoined, j->world_size, peer, req->agent && *req->agent ? req->agent : "local");
    pthread_mutex_unlock(&c->lock);

    w.job = j;
    w.rank = rank;
    if (pthread_create(&watcher, NULL, join_watch_main, &w) != 0) {
        code = GRPC_STATUS_RESOURCE_EXHAUSTED;
        snprintf(msg, sizeof(msg), "join: no thread");
        pthread_mutex_lock(&c->lock);
        j->members[rank].state = M_FREE;
        j->njoined--;
        pthread_mutex_unlock(&c->lock);
        goto out;
    }
    (void)pthread_setname_np(watcher, "ps-join-watch");
    watching = 1;

    pthread_mutex_lock(&c->lock);
    struct timespec deadline = ps__abs_time(CLOCK_MONOTONIC, timeout);
    int sent_ready = 0;
    for (;;) {
        member_t *m = &j->members[rank];
        if (c->draining) {
            code = GRPC_STATUS_UNAVAILABLE;
            snprintf(msg, sizeof(msg), "%s", PS_MSG_STOPPING);
            break;
        }
        if (w.ended)
            break;
        if (!j->ready && j->refused) {
            code = GRPC_STATUS_FAILED_PRECONDITION;
            snprintf(msg, sizeof(msg), "%s", j->refused);
            break;
        }
        if (j->ready && !sent_ready) {
            uint64_t inc = j->incarnation;
            int world = j->world_size;
            char *hub = strdup(j->members[0].agent);
            uint32_t *sets[SETS];
            for (int k = 0; k < SETS; k++)
                sets[k] = sets_copy(j->sets[k], world);
            pthread_mutex_unlock(&c->lock);
            send_event(call, PARAMSYNC__V1__JOIN_EVENT__KIND__READY, rank, world, hub, inc, NULL,
                       sets);
            free(hub);
            for (int k = 0; k < SETS; k++)
                free(sets[k]);
            pthread_mutex_lock(&c->lock);
            sent_ready = 1;
            continue;
        }
        event_t *e = sent_ready ? pop_event(m) : NULL;
        if (e) {
            pthread_mutex_unlock(&c->lock);
            send_event(call, e->kind, e->rank, 0, NULL, 0, e->message, NULL);
            free(e->message);
            free(e);
            pthread_mutex_lock(&c->lock);
            continue;
        }
        if (!j->ready) {
            if (pthread_cond_timedwait(&c->changed, &c->lock, &deadline) == ETIMEDOUT &&
                !j->ready) {
                int n = snprintf(msg, sizeof(msg),
                                 "join job %s: rendezvous timed out after %lld ms with %d of %d "
                                 "ranks; missing ranks:",
                                 j->name, (long long)timeout, j->njoined, j->world_size);
                for (int r = 0; r < j->world_size && n < (int)sizeof(msg) - 8; r++)
                    if (j->members[r].state != M_JOINED)
                        n += snprintf(msg + n, sizeof(msg) - (size_t)n, " %d", r);
                code = GRPC_STATUS_DEADLINE_EXCEEDED;
                ps__metrics_event(PS_M_EV_TIMEOUT);
                PS_LOG(PS_LOG_WARN, "%s", msg);
                break;
            }
        } else {
            pthread_cond_wait(&c->changed, &c->lock);
        }
    }
    /* Leaving: graceful, lost, or a rendezvous that never completed. The
     * loop looks at the drain before the stream's end, under the same lock,
     * so a stream the coordinator's own shutdown ends comes here with
     * UNAVAILABLE: no rank's loss. */
    member_t *m = &j->members[rank];
    if (code != GRPC_STATUS_OK || (w.ended == 1 && (m->leaving || !j->ready))) {
        m->state = j->ready ? M_LEFT : M_FREE;
        PS_LOG(PS_LOG_INFO, "job %s: rank %d left", j->name, rank);
    } else {
        m->state = M_LOST;
        j->aborted = 1;
        char lost[640];
        const agent_entry_t *ae = m->agent_stopping ? agent_find(c, m->agent) : NULL;
        const char *why = ae ? ae->stopping : NULL;
        if (why)
            snprintf(lost, sizeof(lost),
                     "job %s: rank %d was lost: its agent at %s is stopping: %s", j->name, rank,
                     m->agent, why);
        else
            snprintf(lost, sizeof(lost), "job %s: rank %d was lost (its stream from %s broke)",
                     j->name, rank, m->peer ? m->peer : "?");
        PS_LOG(PS_LOG_WARN, "%s", lost);
        ps__metrics_event(why ? PS_M_EV_RANK_STOPPED : PS_M_EV_RANK_LOST);
        /* Not to ranks of an agent that said it is stopping: it cuts their
         * Joins itself, with UNAVAILABLE, and this must not come first. */
        for (int r = 0; r < j->world_size; r++)
            if (r != rank && j->members[r].state == M_JOINED && !j->members[r].agent_stopping)
                push_event(&j->members[r], PARAMSYNC__V1__JOIN_EVENT__KIND__MEMBER_LOST, rank,
                           lost);
        pthread_cond_broadcast(&c->changed);
    }
    j->njoined--;
    /* A refused job stays, to tell ranks that come late (job_purge_refused). */
    if (j->njoined == 0 && !(j->refused && !j->detached)) {
        PS_LOG(PS_LOG_INFO, "job %s: ended", j->name);
        if (!j->detached)
            job_unlink(c, j);
        job_free(j);
    }
    pthread_mutex_unlock(&c->lock);
out:
    if (code == GRPC_STATUS_OK)
        ps__rpc_call_send_status(call, GRPC_STATUS_OK, "");
    else
        ps__rpc_call_send_status(call, code, msg);
    if (watching) {
        /* The status ends the call, which ends the watcher's receive. */
        ps__rpc_call_cancel(call, GRPC_STATUS_CANCELLED, "join ended");
        pthread_join(watcher, NULL);
    }
    if (req)
        protobuf_c_message_free_unpacked(&req->base, NULL);
}

/* ---- unary methods ---- */

typedef int (*unary_fn)(ps__coordinator_t *c, const ProtobufCMessage *req, ProtobufCMessage *resp,
                        char *msg, size_t msglen);

static void serve_unary(ps__coordinator_t *c, ps__rpc_call_t *call,
                        const ProtobufCMessageDescriptor *req_desc, ProtobufCMessage *resp,
                        unary_fn fn, void (*resp_clear)(ProtobufCMessage *))
{
    ProtobufCMessage *req = NULL;
    char msg[512] = "";
    if (ps__rpc_recv_msg(call, req_desc, &req) != 0) {
        ps__rpc_call_send_status(call, GRPC_STATUS_INVALID_ARGUMENT, "malformed request");
        return;
    }
    /* Every request but RegisterAgent names its job as field 1. */
    const ProtobufCFieldDescriptor *jf = protobuf_c_message_descriptor_get_field(req_desc, 1);
    if (c->tokens && req_desc != &paramsync__v1__register_agent_request__descriptor && jf &&
        jf->type == PROTOBUF_C_TYPE_STRING) {
        const char *job = *(char **)((char *)req + jf->offset);
        if (ps__auth_check(c->tokens, call, job ? job : "")) {
            protobuf_c_message_free_unpacked(req, NULL);
            return;
        }
    }
    int rc = fn(c, req, resp, msg, sizeof(msg));
    if (rc == 0) {
        ps__rpc_send_msg(call, resp);
        ps__rpc_call_send_status(call, GRPC_STATUS_OK, "");
    } else {
        ps__rpc_call_send_status(call, -rc, msg);
    }
    if (resp_clear)
        resp_clear(resp);
    protobuf_c_message_free_unpacked(req, NULL);
}

/* An agent that registers with settings other than those of the agent that
 * registered before it is told of at once, in the log: a job with ranks on
 * both would be refused (settings_differ), which is better known before any
 * job. (The one before, not the first: in a rolling change of a flag, only
 * the first agent with the new value warns.) Lock held. */
static void settings_registered(ps__coordinator_t *c,
                                const Paramsync__V1__RegisterAgentRequest *req)
{
    const char *mine = req->agent_settings ? req->agent_settings : "";
    char *s = *mine ? strdup(mine) : NULL, *who = *mine ? strdup(req->address) : NULL;
    if (!s || !who) {
        free(s);
        free(who);
        return;
    }
    if (c->last_settings && strcmp(c->last_settings, mine) != 0) {
        char theirs[160], ours[160];
        settings_diff(c->last_settings, mine, theirs, ours, sizeof(theirs));
        PS_LOG(PS_LOG_WARN,
               "agent %s registered with %s, but agent %s with %s: a job with ranks on both "
               "will be refused; " PS_SETTINGS_ALIKE,
               req->address, ours, c->last_settings_agent, theirs);
    }
    free(c->last_settings);
    free(c->last_settings_agent);
    c->last_settings = s;
    c->last_settings_agent = who;
}

/* Removes entry i of the agent list; with c->lock. */
static void agent_remove(ps__coordinator_t *c, int i)
{
    free(c->agent_list[i].addr);
    free(c->agent_list[i].stopping);
    memmove(&c->agent_list[i], &c->agent_list[i + 1],
            (size_t)(c->nagent_list - i - 1) * sizeof(*c->agent_list));
    c->nagent_list--;
}

/* Drops the earliest agents that said they were stopping, past
 * STOPPING_LISTED of them; with c->lock. */
static void forget_stopped(ps__coordinator_t *c)
{
    for (;;) {
        int n = 0, first = -1;
        for (int i = 0; i < c->nagent_list; i++)
            if (c->agent_list[i].stopping) {
                n++;
                if (first < 0 || c->agent_list[i].stopped_at < c->agent_list[first].stopped_at)
                    first = i;
            }
        if (n <= STOPPING_LISTED)
            return;
        agent_remove(c, first);
    }
}

/* Forgets the agents that stopped registering again (they died without a
 * word, or their node did); with c->lock. */
static void expire_agents(ps__coordinator_t *c)
{
    int64_t now = ps__now_ms();
    for (int i = 0; i < c->nagent_list;) {
        agent_entry_t *e = &c->agent_list[i];
        int64_t quiet = now - e->seen_ms;
        if (e->stopping || !e->refresh_ms ||
            quiet <= (int64_t)e->refresh_ms * AGENT_MISSED_REFRESHES) {
            i++;
            continue;
        }
        PS_LOG(PS_LOG_WARN,
               "agent at %s has not registered again for %lld ms (it does every %u ms): no "
               "longer listed",
               e->addr, (long long)quiet, e->refresh_ms);
        agent_remove(c, i);
    }
}

static int do_register(ps__coordinator_t *c, const ProtobufCMessage *rq, ProtobufCMessage *rs,
                       char *msg, size_t msglen)
{
    const Paramsync__V1__RegisterAgentRequest *req = (const void *)rq;
    Paramsync__V1__RegisterAgentResponse *resp = (void *)rs;
    const char *why = req->stopping && *req->stopping ? req->stopping : NULL;
    int id = 0, fresh = 0;
    pthread_mutex_lock(&c->lock);
    expire_agents(c);
    agent_entry_t *e = agent_find(c, req->address);
    if (!e) {
        agent_entry_t *na =
            realloc(c->agent_list, (size_t)(c->nagent_list + 1) * sizeof(*c->agent_list));
        char *addr = na ? strdup(req->address) : NULL;
        if (na)
            c->agent_list = na;
        if (addr) {
            e = &c->agent_list[c->nagent_list++];
            *e = (agent_entry_t){.addr = addr};
        }
    }
    if (e && why) {
        free(e->stopping);
        e->stopping = strdup(why);
        e->stopped_at = ++c->stops;
        forget_stopped(c); /* e is not to be used after this */
    } else if (e) {
        /* New, or back after it stopped: a refresh is not news. */
        fresh = !e->id || e->stopping;
        if (fresh) {
            e->id = ++c->nagents;
            settings_registered(c, req);
        }
        free(e->stopping);
        e->stopping = NULL;
        e->refresh_ms = req->refresh_ms;
        e->seen_ms = ps__now_ms();
        id = e->id;
    }
    /* Its members marked once here, so that a loss needs no lookup per member. */
    for (job_t *j = why ? c->jobs : NULL; j; j = j->next)
        for (int r = 0; r < j->world_size; r++)
            if (j->members[r].state == M_JOINED && j->members[r].agent &&
                strcmp(j->members[r].agent, req->address) == 0)
                j->members[r].agent_stopping = 1;
    pthread_mutex_unlock(&c->lock);
    if (why) {
        PS_LOG(PS_LOG_INFO, "agent at %s is stopping: %s", req->address, why);
        resp->agent_id = (char *)protobuf_c_empty_string;
        return 0;
    }
    char name[32];
    snprintf(name, sizeof(name), "agent-%d", id);
    resp->agent_id = strdup(name);
    if (fresh)
        PS_LOG(PS_LOG_INFO, "agent %s registered at %s", resp->agent_id, req->address);
    if (!resp->agent_id || !id) {
        if (!resp->agent_id)
            resp->agent_id = (char *)protobuf_c_empty_string;
        snprintf(msg, msglen, "register: out of memory");
        return PS_ENOMEM;
    }
    return 0;
}

static void register_clear(ProtobufCMessage *m)
{
    Paramsync__V1__RegisterAgentResponse *r = (void *)m;
    if (r->agent_id != protobuf_c_empty_string)
        free(r->agent_id);
}

static void coord_register(ps__rpc_call_t *call, void *arg)
{
    Paramsync__V1__RegisterAgentResponse resp = PARAMSYNC__V1__REGISTER_AGENT_RESPONSE__INIT;
    serve_unary(arg, call, &paramsync__v1__register_agent_request__descriptor, &resp.base,
                do_register, register_clear);
}

static int do_leave(ps__coordinator_t *c, const ProtobufCMessage *rq, ProtobufCMessage *rs,
                    char *msg, size_t msglen)
{
    const Paramsync__V1__LeaveRequest *req = (const void *)rq;
    (void)rs;
    pthread_mutex_lock(&c->lock);
    job_t *j = job_find(c, req->job);
    int rc = 0;
    if (!j) {
        snprintf(msg, msglen, "leave: unknown job %s", req->job);
        rc = PS_ENOTFOUND;
    } else if (req->rank < 0 || req->rank >= j->world_size ||
               j->members[req->rank].state != M_JOINED) {
        snprintf(msg, msglen, "leave job %s: rank %d is not a member", req->job, req->rank);
        rc = PS_EINVAL;
    } else {
        j->members[req->rank].leaving = 1;
    }
    pthread_mutex_unlock(&c->lock);
    /* The membership stream's half-close completes the leave. */
    return rc;
}

static void coord_leave(ps__rpc_call_t *call, void *arg)
{
    Paramsync__V1__LeaveResponse resp = PARAMSYNC__V1__LEAVE_RESPONSE__INIT;
    serve_unary(arg, call, &paramsync__v1__leave_request__descriptor, &resp.base, do_leave, NULL);
}

static group_t *group_find(job_t *j, uint32_t id)
{
    for (group_t *g = j->groups; g; g = g->next)
        if (g->id == id)
            return g;
    return NULL;
}

static void format_ranks(char *buf, size_t len, const int *ranks, size_t n)
{
    size_t off = 0;
    off += (size_t)snprintf(buf, len, "[");
    for (size_t i = 0; i < n && off + 12 < len; i++)
        off += (size_t)snprintf(buf + off, len - off, "%s%d", i ? "," : "", ranks[i]);
    snprintf(buf + off, len - off, "]");
}

static int do_new_group(ps__coordinator_t *c, const ProtobufCMessage *rq, ProtobufCMessage *rs,
                        char *msg, size_t msglen)
{
    const Paramsync__V1__NewGroupRequest *req = (const void *)rq;
    Paramsync__V1__NewGroupResponse *resp = (void *)rs;
    int rc = 0;
    pthread_mutex_lock(&c->lock);
    job_t *j = job_find(c, req->job);
    if (!j || !j->ready) {
        snprintf(msg, msglen, "new_group: job %s %s", req->job,
                 j ? "has not completed its rendezvous" : "is unknown (call init first)");
        rc = j ? PS_EPRECOND : PS_ENOTFOUND;
        goto out;
    }
    if (req->rank < 0 || req->rank >= j->world_size) {
        snprintf(msg, msglen,
                 "new_group job %s: the caller's rank %d is out of range for world_size %d",
                 req->job, req->rank, j->world_size);
        rc = PS_EINVAL;
        goto out;
    }
    if (req->group == 0 || req->n_ranks == 0) {
        snprintf(msg, msglen, "new_group job %s: %s", req->job,
                 req->group == 0 ? "group id 0 is the whole job" : "the rank list is empty");
        rc = PS_EINVAL;
        goto out;
    }
    for (size_t i = 0; i < req->n_ranks; i++) {
        if (req->ranks[i] < 0 || req->ranks[i] >= j->world_size) {
            snprintf(msg, msglen, "new_group job %s: rank %d is out of range for world_size %d",
                     req->job, req->ranks[i], j->world_size);
            rc = PS_EINVAL;
            goto out;
        }
        for (size_t k = 0; k < i; k++)
            if (req->ranks[k] == req->ranks[i]) {
                snprintf(msg, msglen, "new_group job %s: rank %d is listed twice", req->job,
                         req->ranks[i]);
                rc = PS_EINVAL;
                goto out;
            }
    }
    group_t *g = group_find(j, req->group);
    int ngroups = 0;
    for (group_t *x = j->groups; x; x = x->next)
        ngroups++;
    if (!g && ngroups >= c->cfg->max_groups) {
        snprintf(msg, msglen, "new_group job %s: the job already has %d groups (--max-groups)",
                 req->job, ngroups);
        rc = PS_ENOMEM;
        goto out;
    }
    if (g) {
        if ((size_t)g->nranks != req->n_ranks ||
            memcmp(g->ranks, req->ranks, req->n_ranks * sizeof(int)) != 0) {
            char a[128], b[128];
            format_ranks(a, sizeof(a), req->ranks, req->n_ranks);
            format_ranks(b, sizeof(b), g->ranks, (size_t)g->nranks);
            snprintf(msg, msglen,
                     "new_group job %s, group %u: rank %d passed ranks %s but an earlier call "
                     "passed %s; every rank must call new_group in the same order with the "
                     "same ranks",
                     req->job, req->group, req->rank, a, b);
            rc = PS_EINVAL;
            goto out;
        }
    } else {
        g = calloc(1, sizeof(*g));
        int *ranks = malloc(req->n_ranks * sizeof(int));
        if (!g || !ranks) {
            free(g);
            free(ranks);
            rc = PS_ENOMEM;
            goto out;
        }
        memcpy(ranks, req->ranks, req->n_ranks * sizeof(int));
        g->id = req->group;
        g->nranks = (int)req->n_ranks;
        g->ranks = ranks;
        g->next = j->groups;
        j->groups = g;
        PS_LOG(PS_LOG_INFO, "job %s: group %u created with %d ranks", j->name, g->id, g->nranks);
    }
    resp->group = g->id;
    resp->group_size = g->nranks;
    resp->group_rank = -1;
    for (int i = 0; i < g->nranks; i++)
        if (g->ranks[i] == req->rank)
            resp->group_rank = i;
out:
    pthread_mutex_unlock(&c->lock);
    return rc;
}

static void coord_new_group(ps__rpc_call_t *call, void *arg)
{
    Paramsync__V1__NewGroupResponse resp = PARAMSYNC__V1__NEW_GROUP_RESPONSE__INIT;
    serve_unary(arg, call, &paramsync__v1__new_group_request__descriptor, &resp.base, do_new_group,
                NULL);
}

/* Every rank's string at offset field of its member_t ("" when unset),
 * into a new *out: how many were copied (the world size unless out of
 * memory). */
static size_t member_strings(const job_t *j, size_t field, char ***out)
{
    size_t n = 0;
    *out = calloc(j->world_size > 0 ? (size_t)j->world_size : 1, sizeof(char *));
    for (int r = 0; r < j->world_size && *out; r++) {
        const char *s = *(char *const *)((const char *)&j->members[r] + field);
        if (!((*out)[r] = strdup(s ? s : "")))
            break;
        n++;
    }
    return n;
}

static int do_describe(ps__coordinator_t *c, const ProtobufCMessage *rq, ProtobufCMessage *rs,
                       char *msg, size_t msglen)
{
    const Paramsync__V1__DescribeJobRequest *req = (const void *)rq;
    Paramsync__V1__DescribeJobResponse *resp = (void *)rs;
    int rc = 0;
    pthread_mutex_lock(&c->lock);
    job_t *j = job_find(c, req->job);
    if (!j || !j->ready) {
        snprintf(msg, msglen, "job %s is %s", req->job,
                 j ? "still in its rendezvous" : "unknown (no rank has joined it)");
        rc = j ? PS_EPRECOND : PS_ENOTFOUND;
        goto out;
    }
    resp->job = strdup(j->name);
    resp->world_size = j->world_size;
    resp->incarnation = j->incarnation;
    resp->hub = strdup(j->members[0].agent ? j->members[0].agent : "");
    size_t ng = 0;
    for (group_t *g = j->groups; g; g = g->next)
        ng++;
    resp->groups = calloc(ng ? ng : 1, sizeof(*resp->groups));
    for (group_t *g = j->groups; g && resp->groups; g = g->next) {
        Paramsync__V1__GroupInfo *gi = malloc(sizeof(*gi));
        if (!gi)
            break;
        paramsync__v1__group_info__init(gi);
        gi->group = g->id;
        gi->n_ranks = (size_t)g->nranks;
        gi->ranks = malloc((size_t)g->nranks * sizeof(int));
        if (gi->ranks)
            memcpy(gi->ranks, g->ranks, (size_t)g->nranks * sizeof(int));
        resp->groups[resp->n_groups++] = gi;
    }
    resp->joined = malloc((size_t)j->world_size * sizeof(int));
    for (int r = 0; r < j->world_size && resp->joined; r++)
        if (j->members[r].state == M_JOINED)
            resp->joined[resp->n_joined++] = r;
    resp->n_rank_agents = member_strings(j, offsetof(member_t, agent), &resp->rank_agents);
    resp->n_rank_machines = member_strings(j, offsetof(member_t, machine), &resp->rank_machines);
    if (!resp->job || !resp->hub || !resp->groups || !resp->joined ||
        (int)resp->n_rank_agents < j->world_size || (int)resp->n_rank_machines < j->world_size) {
        snprintf(msg, msglen, "out of memory");
        rc = PS_ENOMEM;
    }
out:
    pthread_mutex_unlock(&c->lock);
    return rc;
}

static void describe_clear(ProtobufCMessage *m)
{
    Paramsync__V1__DescribeJobResponse *r = (void *)m;
    for (size_t i = 0; i < r->n_groups; i++) {
        free(r->groups[i]->ranks);
        free(r->groups[i]);
    }
    free(r->groups);
    free(r->joined);
    for (size_t i = 0; i < r->n_rank_agents; i++)
        free(r->rank_agents[i]);
    free(r->rank_agents);
    for (size_t i = 0; i < r->n_rank_machines; i++)
        free(r->rank_machines[i]);
    free(r->rank_machines);
    if (r->job != protobuf_c_empty_string)
        free(r->job);
    if (r->hub != protobuf_c_empty_string)
        free(r->hub);
}

static void coord_describe(ps__rpc_call_t *call, void *arg)
{
    Paramsync__V1__DescribeJobResponse resp = PARAMSYNC__V1__DESCRIBE_JOB_RESPONSE__INIT;
    serve_unary(arg, call, &paramsync__v1__describe_job_request__descriptor, &resp.base,
                do_describe, describe_clear);
}

int ps__coordinator_create(const ps__config_t *cfg, ps__rpc_server_t *srv, ps__coordinator_t **out)
{
    ps__coordinator_t *c = calloc(1, sizeof(*c));
    if (!c)
        return PS_ENOMEM;
    c->cfg = cfg;
    /* Incarnations stay unique across coordinator restarts, so agents never
     * mistake a new job for the one they cached before the restart. */
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    c->next_incarnation = ((uint64_t)now.tv_sec * 1000 + (uint64_t)now.tv_nsec / 1000000) << 8;
    pthread_mutex_init(&c->lock, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&c->changed, &ca);
    pthread_condattr_destroy(&ca);
    int rc = cfg->tokens_file ? ps__tokens_load(cfg->tokens_file, &c->tokens) : 0;
    rc = rc ? rc : ps__rpc_server_add_method(srv, PS_M_COORD_REGISTER, coord_register, c);
    rc = rc ? rc : ps__rpc_server_add_method(srv, PS_M_COORD_JOIN, coord_join, c);
    rc = rc ? rc : ps__rpc_server_add_method(srv, PS_M_COORD_LEAVE, coord_leave, c);
    rc = rc ? rc : ps__rpc_server_add_method(srv, PS_M_COORD_NEW_GROUP, coord_new_group, c);
    rc = rc ? rc : ps__rpc_server_add_method(srv, PS_M_COORD_DESCRIBE_JOB, coord_describe, c);
    if (rc) {
        ps__coordinator_destroy(c);
        return rc;
    }
    *out = c;
    return 0;
}

void ps__coordinator_drain(ps__coordinator_t *c)
{
    if (!c)
        return;
    pthread_mutex_lock(&c->lock);
    c->draining = 1;
    pthread_cond_broadcast(&c->changed);
    pthread_mutex_unlock(&c->lock);
}

void ps__coordinator_destroy(ps__coordinator_t *c)
{
    if (!c)
        return;
    while (c->jobs) {
        job_t *j = c->jobs;
        c->jobs = j->next;
        job_free(j);
    }
    ps__tokens_free(c->tokens);
    for (int i = 0; i < c->nagent_list; i++) {
        free(c->agent_list[i].addr);
        free(c->agent_list[i].stopping);
    }
    free(c->agent_list);
    free(c->last_settings);
    free(c->last_settings_agent);
    pthread_mutex_destroy(&c->lock);
    pthread_cond_destroy(&c->changed);
    free(c);
}

/* ---- status and gauges ---- */

static const char *const member_state_names[] = {"waiting", "joined", "left", "lost"};

int ps__coordinator_status(ps__coordinator_t *c, const char *job,
                           Paramsync__V1__StatusResponse *resp)
{
    int rc = 0;
    pthread_mutex_lock(&c->lock);
    for (job_t *j = c->jobs; j && rc == 0; j = j->next) {
        if (job && *job && strcmp(job, j->name) != 0)
            continue;
        Paramsync__V1__JobStatus **arr = realloc(resp->jobs, (resp->n_jobs + 1) * sizeof(*arr));
        Paramsync__V1__JobStatus *js = arr ? malloc(sizeof(*js)) : NULL;
        if (arr)
            resp->jobs = arr;
        if (!js) {
            rc = PS_ENOMEM;
            break;
        }
        paramsync__v1__job_status__init(js);
        arr[resp->n_jobs++] = js;
        js->world_size = j->world_size;
        js->incarnation = j->incarnation;
        js->job = strdup(j->name);
        int refused = j->refused && !j->ready;
        js->state = strdup(j->aborted ? "aborted"
                           : j->ready ? "running"
                           : refused  ? "refused"
                                      : "rendezvous");
        js->message = strdup(refused ? j->refused : "");
        js->hub = strdup(j->ready && j->members[0].agent ? j->members[0].agent : "");
        js->ranks = calloc((size_t)j->world_size, sizeof(*js->ranks));
        if (!js->job || !js->state || !js->message || !js->hub || !js->ranks) {
            rc = PS_ENOMEM;
            break;
        }
        for (int r = 0; r < j->world_size && rc == 0; r++) {
            member_t *m = &j->members[r];
            Paramsync__V1__RankStatus *rs = malloc(sizeof(*rs));
            if (!rs) {
                rc = PS_ENOMEM;
                break;
            }
            paramsync__v1__rank_status__init(rs);
            js->ranks[js->n_ranks++] = rs;
            rs->rank = r;
            rs->state =
                strdup(refused && m->state == M_FREE ? "refused" : member_state_names[m->state]);
            rs->peer = strdup(m->peer ? m->peer : "");
            rs->agent = strdup(m->agent ? m->agent : "");
            rs->machine = strdup(m->machine ? m->machine : "");
            if (!rs->state || !rs->peer || !rs->agent || !rs->machine)
                rc = PS_ENOMEM;
        }
        size_t ng = 0;
        for (group_t *g = j->groups; g; g = g->next)
            ng++;
        js->groups = calloc(ng ? ng : 1, sizeof(*js->groups));
        for (group_t *g = j->groups; g && js->groups && rc == 0; g = g->next) {
            Paramsync__V1__GroupInfo *gi = malloc(sizeof(*gi));
            int *ranks = malloc((size_t)g->nranks * sizeof(int));
            if (!gi || !ranks) {
                free(gi);
                free(ranks);
                rc = PS_ENOMEM;
                break;
            }
            paramsync__v1__group_info__init(gi);
            gi->group = g->id;
            memcpy(ranks, g->ranks, (size_t)g->nranks * sizeof(int));
            gi->ranks = ranks;
            gi->n_ranks = (size_t)g->nranks;
            js->groups[js->n_groups++] = gi;
        }
    }
    expire_agents(c);
    for (int i = 0; i < c->nagent_list && rc == 0; i++) {
        int stopping = c->agent_list[i].stopping != NULL;
        char ***list = stopping ? &resp->stopping_agents : &resp->agents;
        size_t *n = stopping ? &resp->n_stopping_agents : &resp->n_agents;
        char **arr = realloc(*list, (*n + 1) * sizeof(char *));
        char *a = arr ? strdup(c->agent_list[i].addr) : NULL;
        if (arr)
            *list = arr;
        if (!a) {
            rc = PS_ENOMEM;
            break;
        }
        arr[(*n)++] = a;
    }
    pthread_mutex_unlock(&c->lock);
    return rc;
}

void ps__coordinator_gauges(void *arg, struct ps__metrics_gauges *out)
{
    ps__coordinator_t *c = arg;
    memset(out, 0, sizeof(*out));
    pthread_mutex_lock(&c->lock);
    for (job_t *j = c->jobs; j; j = j->next) {
        out->jobs++;
        for (group_t *g = j->groups; g; g = g->next)
            out->groups++;
        for (int r = 0; r < j->world_size; r++)
            out->members += j->members[r].state == M_JOINED;
    }
    expire_agents(c);
    for (int i = 0; i < c->nagent_list; i++)
        out->agents += !c->agent_list[i].stopping;
    pthread_mutex_unlock(&c->lock);
}
