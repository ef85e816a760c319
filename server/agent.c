/* The agent: serves workers' calls, hosts collectives or forwards them to the agent that does. */
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <grpc/status.h>

#include <paramsync/common.h>

#include "daemon.h"
#include "auth.h"
#include "health.h"
#include "log.h"
#include "metrics.h"
#include "rpc/frame.h"
#include "rpc/task.h"

typedef struct peer_channel {
    char *address;
    ps__rpc_channel_t *ch;
    struct peer_channel *next;
} peer_channel_t;

/* A call this agent makes for a worker: a unary call forwarded to the
 * coordinator (forward_unary) or a collective forwarded to another agent's
 * hub (collective_proxy, collective_proxy_shm). */
typedef struct forward {
    ps__rpc_call_t *up;
    struct forward *next;
} forward_t;

/* A link to another agent (an Agent.Ring call) kept open between the
 * collectives of a job, to carry the next one (agent_ring_keep). */
typedef struct kept_link {
    char *address, *job;
    ps__rpc_call_t *call;
    int64_t since_ms; /* idle since */
    struct kept_link *next;
} kept_link_t;

typedef struct job_route {
    char *job;
    uint64_t incarnation;
    char *hub;
    struct job_route *next;
} job_route_t;

struct ps__agent {
    const ps__config_t *cfg;
    char *self;
    ps__rpc_channel_t *coord;
    ps__hub_t *hub;
    pthread_mutex_t lock;
    peer_channel_t *peers;
    job_route_t *routes;
    ps__tokens_t *tokens; /* NULL: no authentication */
    struct ps__health *health;
    pthread_t health_thread;
    int health_running;
    int stopping;
    pthread_cond_t stop_cond;
    int draining; /* SIGTERM: nothing more is forwarded */
    /* Held across each RegisterAgent call, so that the drain's "stopping"
     * cannot be overtaken by a refresh sent before it. */
    pthread_mutex_t register_lock;
    forward_t *forwards;  /* in flight; ps__agent_drain cancels them */
    kept_link_t *links;   /* idle, for the next collective (agent_ring_open) */
    kept_link_t *closing; /* half-closed by links_sweep; destroyed at its next pass */
    char settings[160];   /* JoinRequest.agent_settings: what every agent of a job must share */
};

/* Control calls to the coordinator are short; a coordinator that does not
 * answer within this is reported as unavailable. */
#define CONTROL_TIMEOUT_MS 30000
/* Job lookups also run while collectives wait (liveness checks): short, so
 * a coordinator that is gone cannot hold them long. */
#define LOOKUP_TIMEOUT_MS 5000

/* ---- forwarding helpers ---- */

typedef struct pipe_arg {
    ps__rpc_call_t *from, *to;
    int client_to;             /* `to` is a client call: half-close it at the end */
    int frames;                /* collective frames: count their payload bytes */
    grpc_byte_buffer *pending; /* taken already: sent first (the pipe destroys it) */
} pipe_arg_t;

/* Payload bytes of a forwarded collective frame, for the link metrics. */
static void count_frame(grpc_byte_buffer *bb, int from_worker)
{
    ps__frame_t f;
    if (ps__frame_decode(bb, &f) < 0)
        return;
    if (f.data_len) {
        ps__metrics_bytes(PS_M_RX, from_worker ? PS_M_LINK_WORKER : PS_M_LINK_AGENT, f.data_len);
        ps__metrics_bytes(PS_M_TX, from_worker ? PS_M_LINK_AGENT : PS_M_LINK_WORKER, f.data_len);
    }
    ps__frame_clear(&f);
}

/* Copies messages from one call to another until the stream ends. A broken
 * source cancels the destination so the far side learns at once. */
static void *pipe_main(void *arg)
{
    pipe_arg_t *p = arg;
    for (;;) {
        grpc_byte_buffer *bb = p->pending;
        p->pending = NULL;
        int rc = bb ? 0 : ps__rpc_call_recv(p->from, &bb);
        if (rc < 0) {
            ps__rpc_call_cancel(p->to, GRPC_STATUS_CANCELLED, "the worker's stream broke");
            break;
        }
        if (!bb) {
            if (p->client_to)
                ps__rpc_call_close_send(p->to);
            break;
        }
        if (p->frames)
            count_frame(bb, 1);
        rc = ps__rpc_call_send(p->to, bb);
        grpc_byte_buffer_destroy(bb);
        if (rc < 0)
            break;
    }
    return NULL;
}

static ps__rpc_channel_t *peer_channel(ps__agent_t *a, const char *address)
{
    pthread_mutex_lock(&a->lock);
    peer_channel_t *p = a->peers;
    while (p && strcmp(p->address, address) != 0)
        p = p->next;
    if (!p && (p = calloc(1, sizeof(*p)))) {
        p->address = strdup(address);
        if (!p->address || ps__rpc_channel_create_ex(address, &a->cfg->rpc, &p->ch) < 0) {
            free(p->address);
            free(p);
            p = NULL;
        } else {
            p->next = a->peers;
            a->peers = p;
        }
    }
    pthread_mutex_unlock(&a->lock);
    return p ? p->ch : NULL;
}

static int auth_check(ps__agent_t *a, ps__rpc_call_t *call, const char *job);

/* Lists fw->up among the calls SIGTERM's drain cancels, or, if the drain has
 * begun, cancels it as the drain would and returns 1. The server's shutdown
 * waits for our handlers but cannot end calls of ours: embedded, `up` may go
 * to a server that is stopping too, and a doorbell's request has no server
 * call to be cancelled at all. */
static int forward_track(ps__agent_t *a, forward_t *fw)
{
    pthread_mutex_lock(&a->lock);
    int refused = a->draining;
    if (refused) {
        ps__rpc_call_cancel(fw->up, GRPC_STATUS_UNAVAILABLE, PS_MSG_STOPPING);
    } else {
        fw->next = a->forwards;
        a->forwards = fw;
    }
    pthread_mutex_unlock(&a->lock);
    return refused;
}

/* Takes fw off the list (before its call is destroyed), its call having
 * ended with rc: 1 if that failed after the drain began, so was most likely
 * cut by it. */
static int forward_untrack(ps__agent_t *a, forward_t *fw, int rc)
{
    pthread_mutex_lock(&a->lock);
    for (forward_t **p = &a->forwards; *p; p = &(*p)->next)
        if (*p == fw) {
            *p = fw->next;
            break;
        }
    int cut = rc != 0 && a->draining;
    pthread_mutex_unlock(&a->lock);
    return cut;
}

/* Serves a unary call by forwarding it, bytes untouched, to the coordinator,
 * once the caller has shown the token of the request's job. */
static void forward_unary(ps__agent_t *a, ps__rpc_call_t *down, const char *method,
                          const ProtobufCMessageDescriptor *desc)
{
    grpc_byte_buffer *req = NULL, *resp = NULL;
    ps__rpc_call_t *up = NULL;
    char *msg = NULL;
    ProtobufCMessage *parsed = NULL;
    if (ps__rpc_call_recv(down, &req) < 0 || !req || ps__rpc_unpack(req, desc, &parsed) < 0) {
        if (req)
            grpc_byte_buffer_destroy(req);
        ps__rpc_call_send_status(down, GRPC_STATUS_INVALID_ARGUMENT,
                                 "missing or malformed request");
        return;
    }
    /* Both forwarded requests carry the job id as field 1. */
    const ProtobufCFieldDescriptor *jf = protobuf_c_message_descriptor_get_field(desc, 1);
    const char *job = jf ? *(char **)((char *)parsed + jf->offset) : "";
    int denied = auth_check(a, down, job ? job : "");
    protobuf_c_message_free_unpacked(parsed, NULL);
    if (denied) {
        grpc_byte_buffer_destroy(req);
        return;
    }
    char auth[600];
    int have_auth = ps__rpc_call_metadata(down, "authorization", auth, sizeof(auth)) == 0;
    int rc = ps__rpc_call_start_auth(a->coord, method, CONTROL_TIMEOUT_MS, have_auth ? auth : NULL,
                                     a->self, &up);
    forward_t fw = {up, NULL};
    int refused = rc == 0 && forward_track(a, &fw), cut = 0;
    if (rc == 0 && !refused) {
        ps__rpc_call_send(up, req);
        ps__rpc_call_close_send(up);
        ps__rpc_call_recv(up, &resp);
        rc = ps__rpc_call_finish(up, &msg);
        cut = forward_untrack(a, &fw, rc);
    }
    if (rc == 0 && resp)
        ps__rpc_call_send(down, resp);
    if (refused || cut) {
        ps__rpc_call_send_status(down, GRPC_STATUS_UNAVAILABLE, PS_MSG_STOPPING);
    } else if (rc == -GRPC_STATUS_UNAVAILABLE || rc == -GRPC_STATUS_DEADLINE_EXCEEDED) {
        char m[512];
        snprintf(m, sizeof(m), "the coordinator at %s did not answer: %s",
                 ps__rpc_channel_target(a->coord), msg ? msg : ps_strerror(rc));
        ps__rpc_call_send_status(down, -rc, m);
    } else {
        ps__rpc_call_send_status(down, -rc, msg ? msg : "");
    }
    free(msg);
    if (req)
        grpc_byte_buffer_destroy(req);
    if (resp)
        grpc_byte_buffer_destroy(resp);
    ps__rpc_call_destroy(up);
}

/* 0 when the call may act on job (see auth.c); otherwise the call has been
 * ended with UNAUTHENTICATED and -1 is returned. */
static int auth_check(ps__agent_t *a, ps__rpc_call_t *call, const char *job)
{
    return ps__auth_check(a->tokens, call, job);
}

/* ---- job lookup (for the hub and for routing) ---- */

/* "Bearer TOKEN" for job's token from the agent's table, in buf; NULL when
 * the agent has none (no tokens, or none for that job). */
static const char *job_auth(const ps__agent_t *a, const char *job, char *buf, size_t len)
{
    const char *token = ps__tokens_for(a->tokens, job);
    if (!token)
        return NULL;
    snprintf(buf, len, "Bearer %s", token);
    return buf;
}

/* Copies the n strings of a DescribeJob field given by rank into *out when
 * there is one per rank of a world of world: 1; 0 (*out NULL) when the
 * coordinator sent none; PS_ENOMEM. */
static int rank_strings(char *const *src, size_t n, int world, char ***out)
{
    *out = NULL;
    if (world <= 0 || n != (size_t)world)
        return 0;
    if (!(*out = calloc(n, sizeof(char *))))
        return PS_ENOMEM;
    for (size_t r = 0; r < n; r++)
        if (!((*out)[r] = strdup(src[r])))
            return PS_ENOMEM; /* ps__job_info_clear frees what was copied */
    return 1;
}

static int agent_lookup(void *arg, const char *job, ps__job_info_t *info, char **errmsg)
{
    ps__agent_t *a = arg;
    Paramsync__V1__DescribeJobRequest req = PARAMSYNC__V1__DESCRIBE_JOB_REQUEST__INIT;
    Paramsync__V1__DescribeJobResponse *resp = NULL;
    req.job = (char *)job;
    /* The coordinator checks tokens too: show the job's, from our table. */
    char buf[600];
    const char *auth = job_auth(a, job, buf, sizeof(buf));
    int rc = ps__rpc_unary_auth(a->coord, PS_M_COORD_DESCRIBE_JOB, auth, &req.base,
                                &paramsync__v1__describe_job_response__descriptor,
                                (ProtobufCMessage **)&resp, LOOKUP_TIMEOUT_MS, errmsg);
    if (rc < 0)
        return rc;
    memset(info, 0, sizeof(*info));
    info->world_size = resp->world_size;
    info->incarnation = resp->incarnation;
    info->hub = strdup(resp->hub);
    info->groups = calloc(resp->n_groups ? resp->n_groups : 1, sizeof(*info->groups));
    info->joined = malloc((resp->n_joined ? resp->n_joined : 1) * sizeof(int));
    if (info->joined) {
        memcpy(info->joined, resp->joined, resp->n_joined * sizeof(int));
        info->njoined = (int)resp->n_joined;
    }
    /* An older coordinator sends no rank_agents (then every collective goes
     * to the hub, as it did) nor rank_machines (then --ring auto keeps to its
     * one-machine rules). */
    if (!info->hub || !info->groups || !info->joined ||
        rank_strings(resp->rank_agents, resp->n_rank_agents, resp->world_size, &info->rank_agents) <
            0 ||
        rank_strings(resp->rank_machines, resp->n_rank_machines, resp->world_size,
                     &info->rank_machines) < 0) {
        ps__job_info_clear(info);
        protobuf_c_message_free_unpacked(&resp->base, NULL);
        return PS_ENOMEM;
    }
    for (size_t g = 0; g < resp->n_groups; g++) {
        Paramsync__V1__GroupInfo *gi = resp->groups[g];
        info->groups[g].id = gi->group;
        info->groups[g].nranks = (int)gi->n_ranks;
        info->groups[g].ranks = malloc((gi->n_ranks ? gi->n_ranks : 1) * sizeof(int));
        if (info->groups[g].ranks)
            memcpy(info->groups[g].ranks, gi->ranks, gi->n_ranks * sizeof(int));
        info->ngroups++;
    }
    protobuf_c_message_free_unpacked(&resp->base, NULL);
    return 0;
}

static void route_set(ps__agent_t *a, const char *job, uint64_t inc, const char *hub)
{
    pthread_mutex_lock(&a->lock);
    job_route_t *r = a->routes;
    while (r && strcmp(r->job, job) != 0)
        r = r->next;
    if (!r && (r = calloc(1, sizeof(*r)))) {
        r->job = strdup(job);
        r->next = a->routes;
        a->routes = r;
    }
    if (r) {
        free(r->hub);
        r->hub = strdup(hub);
        r->incarnation = inc;
    }
    pthread_mutex_unlock(&a->lock);
}

/* The hub of a job's incarnation (malloc'd), from the cache or the coordinator. */
static char *route_get(ps__agent_t *a, const char *job, uint64_t inc, int *code, char **msg)
{
    char *hub = NULL;
    pthread_mutex_lock(&a->lock);
    for (job_route_t *r = a->routes; r; r = r->next)
        if (strcmp(r->job, job) == 0 && (inc == 0 || r->incarnation == inc) && r->hub)
            hub = strdup(r->hub);
    pthread_mutex_unlock(&a->lock);
    if (hub)
        return hub;
    ps__job_info_t info;
    int rc = agent_lookup(a, job, &info, msg);
    if (rc < 0) {
        *code = -rc;
        return NULL;
    }
    route_set(a, job, info.incarnation, info.hub);
    hub = strdup(info.hub);
    ps__job_info_clear(&info);
    return hub;
}

static void kept_link_free(kept_link_t *k)
{
    free(k->address);
    free(k->job);
    free(k);
}

/* A kept link of job to address, taken off the list; NULL if none. */
static kept_link_t *link_take(ps__agent_t *a, const char *address, const char *job)
{
    pthread_mutex_lock(&a->lock);
    kept_link_t **p = &a->links;
    while (*p && (strcmp((*p)->address, address) != 0 || strcmp((*p)->job, job) != 0))
        p = &(*p)->next;
    kept_link_t *k = *p;
    if (k)
        *p = k->next;
    pthread_mutex_unlock(&a->lock);
    return k;
}

/* The link of a collective to another agent for the hub (ps__ring_open_fn):
 * one kept from the job's earlier collectives there (1), unless the other
 * agent has ended it meanwhile (it stopped), or a new Ring call (0). */
static int agent_ring_open(void *arg, const char *address, const char *job, ps__rpc_call_t **out)
{
    ps__agent_t *a = arg;
    kept_link_t *k;
    while ((k = link_take(a, address, job))) {
        ps__rpc_call_t *call = k->call;
        kept_link_free(k);
        /* Nothing is due on it: a receive that has ended means the call
         * has (the receive stays started for the hub's watcher). */
        grpc_byte_buffer *bb = NULL;
        if (ps__rpc_call_recv_ready(call, &bb) == 1) {
            *out = call;
            return 1;
        }
        if (bb)
            grpc_byte_buffer_destroy(bb);
        ps__rpc_call_destroy(call);
    }
    ps__rpc_channel_t *ch = peer_channel(a, address);
    if (!ch)
        return PS_ENOMEM;
    char buf[600];
    return ps__rpc_call_start_auth(ch, PS_M_AGENT_RING, 0, job_auth(a, job, buf, sizeof(buf)),
                                   a->self, out);
}

/* Keeps a link whose collective ended cleanly for the job's next one to the
 * same agent (ps__ring_keep_fn), unless --link-keep-ms is 0 or the agent is
 * draining. */
static int agent_ring_keep(void *arg, const char *address, const char *job, ps__rpc_call_t *call)
{
    ps__agent_t *a = arg;
    if (a->cfg->link_keep_ms <= 0)
        return 0;
    kept_link_t *k = calloc(1, sizeof(*k));
    if (!k || !(k->address = strdup(address)) || !(k->job = strdup(job))) {
        if (k)
            kept_link_free(k);
        return 0;
    }
    k->call = call;
    k->since_ms = ps__now_ms();
    pthread_mutex_lock(&a->lock);
    int kept = !a->draining && !a->stopping;
    if (kept) {
        k->next = a->links;
        a->links = k;
    }
    pthread_mutex_unlock(&a->lock);
    if (!kept) {
        k->call = NULL;
        kept_link_free(k);
    }
    return kept;
}

/* Ends the kept links idle for --link-keep-ms (all: every one): each is
 * half-closed, so that the other agent ends its side with OK, and destroyed
 * at the next pass (on the agent's destroy at once). */
static void links_sweep(ps__agent_t *a, int all)
{
    int64_t now = ps__now_ms();
    kept_link_t *old = NULL, *idle = NULL;
    pthread_mutex_lock(&a->lock);
    old = a->closing;
    a->closing = NULL;
    for (kept_link_t **p = &a->links; *p;) {
        kept_link_t *k = *p;
        if (all || now - k->since_ms >= a->cfg->link_keep_ms) {
            *p = k->next;
            k->next = idle;
            idle = k;
        } else {
            p = &k->next;
        }
    }
    pthread_mutex_unlock(&a->lock);
    while (old) {
        kept_link_t *k = old;
        old = k->next;
        ps__rpc_call_destroy(k->call);
        kept_link_free(k);
    }
    for (kept_link_t *k = idle; k; k = k->next)
        ps__rpc_call_close_send(k->call);
    if (!idle)
        return;
    pthread_mutex_lock(&a->lock);
    kept_link_t *last = idle;
    while (last->next)
        last = last->next;
    last->next = a->closing;
    a->closing = idle;
    pthread_mutex_unlock(&a->lock);
}

/* The message for a call that another daemon (who, at addr) ended with
 * UNAVAILABLE saying msg: "is stopping" when that was its drain's or its
 * server's shutdown (a rollout), "is unreachable" otherwise. */
static void unavailable_msg(char *m, size_t len, const char *who, const char *addr, const char *msg)
{
    int stopping = msg && (strstr(msg, PS_MSG_STOPPING) || strstr(msg, PS_RPC_MSG_SHUTDOWN));
    snprintf(m, len, "%s at %s is %s: %s", who, addr, stopping ? "stopping" : "unreachable",
             msg ? msg : "");
}

/* ---- Worker service ---- */

static void worker_join(ps__rpc_call_t *down, void *arg)
{
    ps__agent_t *a = arg;
    Paramsync__V1__JoinRequest *req = NULL;
    ps__rpc_call_t *up = NULL;
    char *msg = NULL;
    ps__task_t watcher;
    int watching = 0;
    if (ps__rpc_recv_msg(down, &paramsync__v1__join_request__descriptor,
                         (ProtobufCMessage **)&req) != 0) {
        ps__rpc_call_send_status(down, GRPC_STATUS_INVALID_ARGUMENT,
                                 "join: expected a JoinRequest");
        return;
    }
    if (auth_check(a, down, req->job)) {
        protobuf_c_message_free_unpacked(&req->base, NULL);
        return;
    }
    char *job = strdup(req->job);
    int rank = -1;
    char *asked = req->agent, *asked_peer = req->peer, *asked_machine = req->agent_machine;
    char *asked_settings = req->agent_settings;
    /* Borrowed; the request's own values are put back before freeing. */
    req->agent = a->self;
    req->peer = (char *)ps__rpc_call_peer(down);
    req->agent_machine = (char *)(a->cfg->machine_id ? a->cfg->machine_id : "");
    req->agent_settings = a->settings;
    /* A coordinator that cannot be reached within the rendezvous deadline
     * is an error for the worker, not a Join that waits for ever (nor one
     * that fails while a restarted coordinator's connection comes back). */
    int64_t wait_ms = req->timeout_ms ? (int64_t)req->timeout_ms : a->cfg->join_timeout_ms;
    int64_t until = ps__now_ms() + (wait_ms < 30000 ? wait_ms : 30000);
    while (!ps__rpc_channel_ready(a->coord) && ps__now_ms() < until &&
           ps__rpc_call_peer_cancelled(down, 50) != 1)
        ;
    char auth[600];
    int have_auth = ps__rpc_call_metadata(down, "authorization", auth, sizeof(auth)) == 0;
    int rc = ps__rpc_call_start_ex(a->coord, PS_M_COORD_JOIN, 0, have_auth ? auth : NULL, a->self,
                                   ps__rpc_channel_ready(a->coord), &up);
    if (rc == 0)
        rc = ps__rpc_send_msg(up, &req->base);
    req->agent = asked;
    req->peer = asked_peer;
    req->agent_machine = asked_machine;
    req->agent_settings = asked_settings;
    protobuf_c_message_free_unpacked(&req->base, NULL);
    /* Tracked, so SIGTERM's drain ends every Join with UNAVAILABLE before
     * it fails the collectives: a rank those end first, that then finalizes,
     * cannot have the coordinator report it lost to the others. */
    forward_t fw = {up, NULL};
    int refused = rc == 0 && forward_track(a, &fw), tracked = rc == 0 && !refused;
    pipe_arg_t pa = {down, up, 1, 0, NULL};
    if (tracked && ps__task_start(&watcher, pipe_main, &pa) == 0)
        watching = 1;
    for (;;) {
        Paramsync__V1__JoinEvent *ev = NULL;
        if (!watching || ps__rpc_recv_msg(up, &paramsync__v1__join_event__descriptor,
                                          (ProtobufCMessage **)&ev) != 0)
            break;
        if (ev->kind == PARAMSYNC__V1__JOIN_EVENT__KIND__READY && job) {
            route_set(a, job, ev->incarnation, ev->hub);
            rank = ev->rank;
        }
        int src = ps__rpc_send_msg(down, &ev->base);
        protobuf_c_message_free_unpacked(&ev->base, NULL);
        if (src < 0)
            break;
    }
    if (up) {
        rc = ps__rpc_call_finish(up, &msg);
        if (refused || (tracked && forward_untrack(a, &fw, rc))) {
            ps__rpc_call_send_status(down, GRPC_STATUS_UNAVAILABLE, PS_MSG_STOPPING);
        } else if (rc == -GRPC_STATUS_UNAVAILABLE) {
            char m[512];
            unavailable_msg(m, sizeof(m), "the coordinator", ps__rpc_channel_target(a->coord), msg);
            /* Without its coordinator the job cannot go on: whatever it
             * has in flight here ends now, not at its timeout. */
            if (job && rank >= 0)
                ps__hub_job_abort(a->hub, job, GRPC_STATUS_UNAVAILABLE, m);
            ps__rpc_call_send_status(down, GRPC_STATUS_UNAVAILABLE, m);
        } else {
            ps__rpc_call_send_status(down, -rc, msg ? msg : "");
        }
    } else {
        ps__rpc_call_send_status(down, -rc, "join: cannot reach the coordinator");
    }
    if (watching) {
        ps__rpc_call_cancel(down, GRPC_STATUS_CANCELLED, "join ended");
        ps__task_join(&watcher);
    }
    ps__rpc_call_destroy(up);
    free(msg);
    /* The member is gone: so are its shared segments. */
    if (job && rank >= 0)
        ps__hub_shm_release(a->hub, job, rank);
    free(job);
}

static void worker_shm_attach(ps__rpc_call_t *call, void *arg)
{
    ps__agent_t *a = arg;
    Paramsync__V1__ShmAttachRequest *req = NULL;
    Paramsync__V1__ShmAttachResponse resp = PARAMSYNC__V1__SHM_ATTACH_RESPONSE__INIT;
    char reason[512] = "";
    if (ps__rpc_recv_msg(call, &paramsync__v1__shm_attach_request__descriptor,
                         (ProtobufCMessage **)&req) != 0) {
        ps__rpc_call_send_status(call, GRPC_STATUS_INVALID_ARGUMENT, "malformed ShmAttachRequest");
        return;
    }
    if (auth_check(a, call, req->job)) {
        protobuf_c_message_free_unpacked(&req->base, NULL);
        return;
    }
    int code = 0;
    char *msg = NULL;
    char *hub = route_get(a, req->job, 0, &code, &msg);
    if (!hub)
        snprintf(reason, sizeof(reason), "job %s: %s", req->job, msg ? msg : "unknown job");
    else if (strcmp(hub, a->self) != 0 && !ps__hub_rank_here(a->hub, req->job, req->rank))
        snprintf(reason, sizeof(reason), "rank %d of job %s did not join through this agent",
                 req->rank, req->job);
    else if (req->doorbell + req->registered + req->process > 1)
        snprintf(reason, sizeof(reason),
                 "a segment is at most one of doorbell, registered and process");
    else
        resp.attached =
            ps__hub_shm_attach(a->hub, req->job, req->rank, req->name, req->size, req->magic,
                               req->doorbell     ? PS_SHM_DOORBELL
                               : req->registered ? PS_SHM_REGISTERED
                               : req->process    ? PS_SHM_PROCESS
                                                 : PS_SHM_PAYLOAD,
                               req->slot > INT32_MAX ? -1 : (int)req->slot, req->pid, req->address,
                               reason, sizeof(reason));
    resp.doorbell_segments = resp.attached && req->doorbell;
    resp.doorbells = resp.attached && req->doorbell ? PS_HUB_DOORBELLS : 0;
    resp.payload_slots = resp.attached && !req->doorbell && !req->registered && !req->process
                             ? PS_HUB_PAYLOAD_SLOTS
                             : 0;
    resp.process_memory = resp.attached && req->process;
    resp.own_block = resp.attached && (req->process || req->registered);
    resp.block_lists = resp.process_memory;
    resp.two_segments = resp.attached && req->registered;
    resp.resident_told = resp.attached && req->registered;
    resp.resident_bytes = resp.resident_told ? a->cfg->shm_resident_bytes : 0;
    if (!resp.attached)
        PS_LOG(PS_LOG_INFO, "job %s: rank %d's %s not used: %s", req->job, req->rank,
               req->doorbell  ? "doorbell"
               : req->process ? "process segment (its memory read and written directly)"
                              : "shared memory",
               reason);
    resp.reason = reason;
    ps__rpc_send_msg(call, &resp.base);
    ps__rpc_call_send_status(call, GRPC_STATUS_OK, "");
    free(hub);
    free(msg);
    protobuf_c_message_free_unpacked(&req->base, NULL);
}

static void worker_shm_detach(ps__rpc_call_t *call, void *arg)
{
    ps__agent_t *a = arg;
    Paramsync__V1__ShmDetachRequest *req = NULL;
    Paramsync__V1__ShmDetachResponse resp = PARAMSYNC__V1__SHM_DETACH_RESPONSE__INIT;
    if (ps__rpc_recv_msg(call, &paramsync__v1__shm_detach_request__descriptor,
                         (ProtobufCMessage **)&req) != 0) {
        ps__rpc_call_send_status(call, GRPC_STATUS_INVALID_ARGUMENT, "malformed ShmDetachRequest");
        return;
    }
    if (auth_check(a, call, req->job)) {
        protobuf_c_message_free_unpacked(&req->base, NULL);
        return;
    }
    resp.detached = ps__hub_shm_detach(a->hub, req->job, req->rank, req->name);
    ps__rpc_send_msg(call, &resp.base);
    ps__rpc_call_send_status(call, GRPC_STATUS_OK, "");
    protobuf_c_message_free_unpacked(&req->base, NULL);
}

static void worker_leave(ps__rpc_call_t *call, void *arg)
{
    forward_unary(arg, call, PS_M_COORD_LEAVE, &paramsync__v1__leave_request__descriptor);
}

static void worker_new_group(ps__rpc_call_t *call, void *arg)
{
    forward_unary(arg, call, PS_M_COORD_NEW_GROUP, &paramsync__v1__new_group_request__descriptor);
}

/* The authorization a call forwarded for `down` carries to the hub agent: the
 * worker's, or for a doorbell's request (a local call, without metadata) the
 * job's token from this agent's table, the worker having shown it when it
 * attached the doorbell (whose requests must name its job). NULL: none. */
static const char *forward_auth(const ps__agent_t *a, ps__rpc_call_t *down, const char *job,
                                char *buf, size_t len)
{
    if (ps__rpc_call_metadata(down, "authorization", buf, len) == 0)
        return buf;
    return ps__rpc_call_is_local(down) ? job_auth(a, job, buf, len) : NULL;
}

/* Starts a call of `method` to the hub agent for `down` (forward_auth), on
 * the list the drain cancels: 0 or a negative error. */
static int forward_start(ps__agent_t *a, ps__rpc_call_t *down, const char *job, const char *hub,
                         const char *method, forward_t *fw)
{
    ps__rpc_channel_t *ch = peer_channel(a, hub);
    char buf[600];
    const char *auth = forward_auth(a, down, job, buf, sizeof(buf));
    int rc = ch ? ps__rpc_call_start_auth(ch, method, 0, auth, a->self, &fw->up) : PS_ENOMEM;
    if (rc == 0)
        forward_track(a, fw); /* when draining, cancelled: its sends fail */
    return rc;
}

/* A doorbell's stream to the job's hub agent (Agent.Relay), kept between its
 * requests: a request is a message on it rather than a call of its own. */
typedef struct relay {
    forward_t fw; /* fw.up: the stream, on the list the drain cancels */
    char *hub;
} relay_t;

/* Ends the doorbell's relay stream, if it has one, its last request having
 * ended with rc: 1 if that failed after the drain began (forward_untrack). */
static int relay_drop(ps__agent_t *a, void **state, int rc)
{
    relay_t *r = *state;
    if (!r)
        return 0;
    ps__rpc_call_cancel(r->fw.up, GRPC_STATUS_CANCELLED, "the relay is closed");
    int cut = forward_untrack(a, &r->fw, rc);
    ps__rpc_call_destroy(r->fw.up);
    free(r->hub);
    free(r);
    *state = NULL;
    return cut;
}

/* The doorbell's relay stream to hub, opened unless it has one there (*kept
 * says which); NULL with *rc when it cannot be opened. */
static relay_t *relay_get(ps__agent_t *a, void **state, const char *job, const char *hub,
                          ps__rpc_call_t *down, int *kept, int *rc)
{
    relay_t *r = *state;
    *kept = r && strcmp(r->hub, hub) == 0;
    if (*kept)
        return r;
    relay_drop(a, state, 0);
    r = calloc(1, sizeof(*r));
    *rc = !r || !(r->hub = strdup(hub))
              ? PS_ENOMEM
              : forward_start(a, down, job, hub, PS_M_AGENT_RELAY, &r->fw);
    if (*rc < 0) {
        if (r)
            free(r->hub);
        free(r);
        return NULL;
    }
    *state = r;
    return r;
}

/* The shared-memory side of a forwarded collective (collective_proxy_shm). */
typedef struct shm_feed {
    ps__rpc_call_t *down, *up;
    ps__shm_io_t *io;
    uint64_t from; /* input bytes already sent with the header */
    size_t chunk;
} shm_feed_t;

/* Sends the rest of the worker's input from its segment, then watches the
 * worker's stream: if it breaks, the hub's call is cancelled. */
static void *shm_feed_main(void *arg)
{
    shm_feed_t *f = arg;
    int rc = 0;
    for (uint64_t off = f->from; off < f->io->in_total && rc == 0; off += f->chunk) {
        uint64_t left = f->io->in_total - off;
        size_t len = left < f->chunk ? (size_t)left : f->chunk;
        grpc_byte_buffer *bb = ps__hub_shm_io_frame(f->io, NULL, off, len);
        rc = bb ? ps__rpc_call_send(f->up, bb) : PS_ENOMEM;
        if (bb)
            grpc_byte_buffer_destroy(bb);
        if (rc == 0)
            ps__metrics_bytes(PS_M_TX, PS_M_LINK_AGENT, len);
    }
    if (rc == 0)
        ps__rpc_call_close_send(f->up);
    grpc_byte_buffer *bb = NULL;
    if (ps__rpc_call_recv(f->down, &bb) < 0)
        ps__rpc_call_cancel(f->up, GRPC_STATUS_CANCELLED, "the worker's stream broke");
    if (bb)
        grpc_byte_buffer_destroy(bb);
    return NULL;
}

/* Forwards a collective of a worker whose payload is in its segment on this
 * agent: the input goes to the hub as frames read in place, the output
 * frames are copied into the segment, and the worker gets the result frame
 * of the shared-memory path. */
static void collective_proxy_shm(ps__agent_t *a, ps__rpc_call_t *down,
                                 const Paramsync__V1__CollectiveHeader *hd, const char *hub,
                                 void **relay)
{
    ps__shm_io_t io;
    char m[512];
    int code = ps__hub_shm_io_open(a->hub, hd, &io, m, sizeof(m));
    if (code) {
        ps__rpc_call_send_status(down, code, m);
        return;
    }
    size_t chunk = hd->chunk_bytes ? hd->chunk_bytes : 1u << 20;
    /* A doorbell's request (a local call: no stream to watch) whose input
     * fits in the first frame needs no feeding thread: the frame goes with
     * the half-close, or (with a relay) as the one message of the request on
     * the doorbell's kept stream. */
    int whole = io.in_total <= chunk && ps__rpc_call_is_local(down);
    forward_t fw = {NULL, NULL};
    relay_t *rl = NULL;
    int rc = 0, kept = 0;
    Paramsync__V1__CollectiveHeader fwd = *hd;
    fwd.shm = fwd.shm_out = (char *)"";
    fwd.shm_out_offset = 0;
    fwd.own_block = 0; /* frames: the hub writes every block */
    fwd.n_shm_in_blocks = fwd.n_shm_out_blocks = 0;
    uint64_t first = io.in_total < chunk ? io.in_total : chunk;
    grpc_byte_buffer *fb = ps__hub_shm_io_frame(&io, &fwd, 0, (size_t)first);
    for (int attempt = 0; whole && relay && fb && attempt < 2; attempt++) {
        rl = relay_get(a, relay, hd->job, hub, down, &kept, &rc);
        rc = rl ? ps__rpc_call_send(rl->fw.up, fb) : rc;
        if (rc == 0 || !kept)
            break;
        relay_drop(a, relay, 0); /* broken since its last request: once more on a new one */
        rl = NULL;
    }
    if (!rl)
        rc = forward_start(a, down, hd->job, hub, PS_M_WORKER_COLLECTIVE, &fw);
    ps__rpc_call_t *up = rl ? rl->fw.up : fw.up;
    shm_feed_t feed = {down, up, &io, first, chunk};
    if (rc == 0 && !rl) {
        rc = !fb     ? PS_ENOMEM
             : whole ? ps__rpc_call_send_last(up, fb, 0, NULL)
                     : ps__rpc_call_send(up, fb);
    }
    if (fb)
        grpc_byte_buffer_destroy(fb);
    ps__task_t t;
    int feeding = rc == 0 && !whole && ps__task_start(&t, shm_feed_main, &feed) == 0;
    int receiving = feeding || (rc == 0 && whole);
    Paramsync__V1__CollectiveResult res = PARAMSYNC__V1__COLLECTIVE_RESULT__INIT;
    const char *bad = NULL;      /* from the hub */
    const char *here = NULL;     /* failed at this agent */
    int ended = 0, end_code = 0; /* the relay's end frame came, with this status */
    char *end_msg = NULL;
    while (receiving && !bad && !here && !ended) {
        grpc_byte_buffer *bb = NULL;
        ps__frame_t f;
        if (ps__rpc_call_recv(up, &bb) < 0 || !bb)
            break;
        if (ps__frame_decode(bb, &f) < 0) {
            bad = "a malformed frame";
        } else if (rl && ps__frame_is_end(&f)) {
            ended = 1;
            end_code = f.meta->result ? f.meta->result->code : GRPC_STATUS_INTERNAL;
            end_msg =
                strdup(f.meta->result && f.meta->result->message ? f.meta->result->message : "");
        } else {
            if (f.meta->result)
                res.source = f.meta->result->source;
            int prc = ps__hub_shm_io_put(&io, &f);
            if (prc == PS_EINVAL)
                bad = "more output than the collective has";
            else if (prc < 0)
                here = "the agent could not write the output into the worker's segment";
            ps__metrics_bytes(PS_M_RX, PS_M_LINK_AGENT, f.data_len);
        }
        ps__frame_clear(&f);
        grpc_byte_buffer_destroy(bb);
    }
    char *msg = NULL;
    int cut = 0; /* by the drain */
    if (bad || here)
        ps__rpc_call_cancel(up, GRPC_STATUS_INTERNAL, bad ? bad : here);
    int reached = up != NULL; /* a call or stream to the hub agent was opened */
    if (rl && ended && !bad && !here) {
        rc = -end_code;
        msg = end_msg;
        end_msg = NULL;
    } else if (rl) {
        /* The relay broke, or was cut short here: the request fails with its
         * status, and the next one opens another. */
        int frc = ps__rpc_call_finish(up, &msg);
        rc = frc ? frc : rc ? rc : -GRPC_STATUS_UNAVAILABLE;
        cut = relay_drop(a, relay, rc);
        rl = NULL;
    } else if (up) {
        rc = ps__rpc_call_finish(up, &msg);
        cut = forward_untrack(a, &fw, rc);
    }
    free(end_msg);
    if (!here && ps__hub_shm_io_broken(&io))
        here = "the worker's shared-memory segment shrank while the agent used it (truncated?): "
               "its data is lost";
    if (here) {
        ps__rpc_call_send_status(
            down, ps__hub_shm_io_broken(&io) ? GRPC_STATUS_DATA_LOSS : GRPC_STATUS_INTERNAL, here);
    } else if (rc == 0 && !bad) {
        res.shm = io.out_total > 0;
        res.bytes = res.shm ? io.out_total : 0;
        grpc_byte_buffer *bb = ps__frame_encode(NULL, &res, 0, NULL, 0, NULL, NULL);
        if (!bb || ps__rpc_call_send_last(down, bb, GRPC_STATUS_OK, "") < 0)
            ps__rpc_call_send_status(down, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
        if (bb)
            grpc_byte_buffer_destroy(bb);
    } else if (bad) {
        snprintf(m, sizeof(m), "the agent hosting this job at %s sent %s", hub, bad);
        ps__rpc_call_send_status(down, GRPC_STATUS_INTERNAL, m);
    } else if (cut) {
        ps__rpc_call_send_status(down, GRPC_STATUS_UNAVAILABLE, PS_MSG_STOPPING);
    } else if (rc == -GRPC_STATUS_UNAVAILABLE || !reached) {
        unavailable_msg(m, sizeof(m), "the agent hosting this job", hub,
                        msg ? msg : ps_strerror(rc));
        ps__rpc_call_send_status(down, GRPC_STATUS_UNAVAILABLE, m);
    } else {
        ps__rpc_call_send_status(down, -rc, msg ? msg : "");
    }
    if (feeding) {
        ps__rpc_call_cancel(up, GRPC_STATUS_CANCELLED, "done");
        ps__task_join(&t);
    }
    ps__rpc_call_destroy(fw.up); /* a kept relay stays the doorbell's */
    ps__hub_shm_io_close(&io);
    free(msg);
}

/* Forwards a collective whose hub is another agent, frames untouched. */
static void collective_proxy(ps__agent_t *a, ps__rpc_call_t *down, grpc_byte_buffer *first,
                             const char *job, const char *hub)
{
    forward_t fw = {NULL, NULL};
    char *msg = NULL;
    ps__task_t t;
    int rc = forward_start(a, down, job, hub, PS_M_WORKER_COLLECTIVE, &fw);
    ps__rpc_call_t *up = fw.up;
    /* A worker whose first frame holds its whole input half-closes with it
     * (the C client sends both in one batch): that frame goes to the hub with
     * the half-close, and no thread pipes the rest, a thread hand-off fewer
     * on the way of every small collective. */
    int whole = 0, broke = 0;
    grpc_byte_buffer *next = NULL;
    if (rc == 0) {
        int ready = ps__rpc_call_recv_ready(down, &next);
        whole = ready == 0 && !next;
        broke = ready < 0;
        count_frame(first, 1); /* before the send, which empties the buffer */
        rc = whole ? ps__rpc_call_send_last(up, first, 0, NULL) : ps__rpc_call_send(up, first);
        if (broke)
            ps__rpc_call_cancel(up, GRPC_STATUS_CANCELLED, "the worker's stream broke");
    }
    /* A second frame that came as soon goes up from the pipe, like the rest:
     * sent from here, it could wait on the hub's flow control while the hub
     * waits for this thread to take its output (its window full of steps
     * that this rank has to receive), and neither would move (all_gather
     * of 16 MiB across 4 netns hosts, ranks through gRPC). */
    pipe_arg_t pa = {down, up, 1, 1, next};
    int piping = rc == 0 && !whole && !broke && ps__task_start(&t, pipe_main, &pa) == 0;
    if (!piping && pa.pending)
        grpc_byte_buffer_destroy(pa.pending);
    int receiving = piping || (rc == 0 && whole);
    while (receiving) {
        grpc_byte_buffer *bb = NULL;
        if (ps__rpc_call_recv(up, &bb) < 0 || !bb)
            break;
        count_frame(bb, 0);
        int src = ps__rpc_call_send(down, bb);
        grpc_byte_buffer_destroy(bb);
        if (src < 0) {
            ps__rpc_call_cancel(up, GRPC_STATUS_CANCELLED, "the worker's stream broke");
            break;
        }
    }
    if (up) {
        rc = ps__rpc_call_finish(up, &msg);
        if (forward_untrack(a, &fw, rc)) {
            ps__rpc_call_send_status(down, GRPC_STATUS_UNAVAILABLE, PS_MSG_STOPPING);
        } else if (rc == -GRPC_STATUS_UNAVAILABLE) {
            char m[512];
            unavailable_msg(m, sizeof(m), "the agent hosting this job", hub, msg);
            ps__rpc_call_send_status(down, GRPC_STATUS_UNAVAILABLE, m);
        } else {
            ps__rpc_call_send_status(down, -rc, msg ? msg : "");
        }
    } else {
        ps__rpc_call_send_status(down, -rc, "cannot reach the agent hosting this job");
    }
    if (piping) {
        ps__rpc_call_cancel(up, GRPC_STATUS_CANCELLED, "done");
        ps__task_join(&t);
    }
    ps__rpc_call_destroy(up);
    free(msg);
}

/* Checks that frame bb (consumed: kept in *bbp when it passes) carries a
 * header naming a job whose token the caller holds; as first_frame. */
static int frame_check(ps__agent_t *a, ps__rpc_call_t *call, const char *what, grpc_byte_buffer *bb,
                       grpc_byte_buffer **bbp, ps__frame_t *first)
{
    char m[128];
    memset(first, 0, sizeof(*first));
    if (ps__frame_decode(bb, first) < 0 || !first->meta->header || !*first->meta->header->job) {
        ps__frame_clear(first); /* accepts the zeroed frame a failed decode leaves */
        grpc_byte_buffer_destroy(bb);
        snprintf(m, sizeof(m), "%sthe first frame must carry a header with a job id", what);
        ps__rpc_call_send_status(call, GRPC_STATUS_INVALID_ARGUMENT, m);
        return -1;
    }
    if (auth_check(a, call, first->meta->header->job)) {
        ps__frame_clear(first);
        grpc_byte_buffer_destroy(bb);
        return -1;
    }
    *bbp = bb;
    return 0;
}

/* Receives a call's first frame and checks that it carries a header naming
 * a job whose token the caller holds. 0 with *bbp and *first set (the caller
 * frees both), or -1 with the call ended; `what` prefixes the messages. */
static int first_frame(ps__agent_t *a, ps__rpc_call_t *call, const char *what,
                       grpc_byte_buffer **bbp, ps__frame_t *first)
{
    grpc_byte_buffer *bb = NULL;
    char m[128];
    if (ps__rpc_call_recv(call, &bb) < 0 || !bb) {
        snprintf(m, sizeof(m), "%smissing first frame", what);
        ps__rpc_call_send_status(call, GRPC_STATUS_INVALID_ARGUMENT, m);
        return -1;
    }
    return frame_check(a, call, what, bb, bbp, first);
}

/* The next request on a stream that carries several (Agent.Relay, a kept
 * Agent.Ring link), checked as first_frame checks a call's first: 0 with
 * *bbp and *first set, or -1 once the stream has ended (answered OK), broke
 * (nobody to answer) or was ended for a bad frame. */
static int next_request(ps__agent_t *a, ps__rpc_call_t *call, const char *what,
                        grpc_byte_buffer **bbp, ps__frame_t *first)
{
    grpc_byte_buffer *bb = NULL;
    if (ps__rpc_call_recv(call, &bb) < 0)
        return -1;
    if (!bb) {
        ps__rpc_call_send_status(call, GRPC_STATUS_OK, "");
        return -1;
    }
    return frame_check(a, call, what, bb, bbp, first);
}

/* Serves a collective as this agent routes it; bb is its raw first message,
 * or NULL for a doorbell's request (a shared-memory header, never forwarded
 * as raw frames). Consumes first and bb. */
static void collective_route(ps__agent_t *a, ps__rpc_call_t *call, grpc_byte_buffer *bb,
                             ps__frame_t *first, void **relay)
{
    const Paramsync__V1__CollectiveHeader *hd = first->meta->header;
    char *msg = NULL;
    int code = GRPC_STATUS_NOT_FOUND;
    /* An all_reduce, all_gather or broadcast over ranks of several agents
     * (with --ring on) is served here, for this agent's ranks, and combined
     * with the other agents over Ring links. */
    if (ps__hub_is_ring(a->hub, hd)) {
        if (bb)
            grpc_byte_buffer_destroy(bb);
        ps__hub_serve(a->hub, call, first);
        return;
    }
    char *hub = route_get(a, hd->job, hd->incarnation, &code, &msg);
    if (!hub) {
        char m[512];
        snprintf(m, sizeof(m), "collective on job %s: %s", hd->job, msg ? msg : "unknown job");
        ps__frame_clear(first);
        if (bb)
            grpc_byte_buffer_destroy(bb);
        ps__rpc_call_send_status(call, code, m);
        free(msg);
        return;
    }
    if (strcmp(hub, a->self) == 0) {
        if (bb)
            grpc_byte_buffer_destroy(bb);
        ps__hub_serve(a->hub, call, first);
    } else if (hd->shm && *hd->shm) {
        collective_proxy_shm(a, call, hd, hub, relay);
        ps__frame_clear(first);
        if (bb)
            grpc_byte_buffer_destroy(bb);
    } else if (bb) {
        collective_proxy(a, call, bb, hd->job, hub);
        ps__frame_clear(first);
        grpc_byte_buffer_destroy(bb);
    } else {
        ps__frame_clear(first);
        ps__rpc_call_send_status(call, GRPC_STATUS_INTERNAL, "no frames to forward");
    }
    free(hub);
}

/* A doorbell's request (ps__serve_fn): forwarded on the doorbell's relay
 * stream when the job's hub is another agent; call NULL: the doorbell ends. */
static void agent_serve(void *arg, ps__rpc_call_t *call, ps__frame_t *first, void **state)
{
    if (call)
        collective_route(arg, call, NULL, first, state);
    else
        relay_drop(arg, state, 0);
}

/* Agent.Relay: a forwarding agent's doorbell requests, one at a time, each
 * served as the Collective call it stands for, through a local call whose
 * frames go out on this stream, then a frame with `end` and its status. */
static void agent_relay(ps__rpc_call_t *call, void *arg)
{
    ps__agent_t *a = arg;
    for (;;) {
        grpc_byte_buffer *bb = NULL;
        ps__frame_t first;
        if (next_request(a, call, "relay: ", &bb, &first) < 0)
            return;
        ps__rpc_call_t *local = NULL;
        if (ps__rpc_call_local_on(call, &local) < 0) {
            ps__frame_clear(&first);
            grpc_byte_buffer_destroy(bb);
            ps__rpc_call_send_status(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
            return;
        }
        collective_route(a, local, bb, &first, NULL);
        char *msg = NULL;
        Paramsync__V1__CollectiveResult res = PARAMSYNC__V1__COLLECTIVE_RESULT__INIT;
        res.code = ps__rpc_call_local_outcome(local, &msg, NULL); /* its frames went out */
        res.message = msg ? msg : (char *)"";
        ps__rpc_call_destroy(local);
        grpc_byte_buffer *eb = ps__frame_encode_end(&res);
        int rc = eb ? ps__rpc_call_send(call, eb) : PS_ENOMEM;
        if (eb)
            grpc_byte_buffer_destroy(eb);
        free(msg);
        if (rc < 0)
            return;
    }
}

static void worker_collective(ps__rpc_call_t *call, void *arg)
{
    ps__agent_t *a = arg;
    grpc_byte_buffer *bb = NULL;
    ps__frame_t first;
    if (first_frame(a, call, "", &bb, &first) < 0)
        return;
    collective_route(a, call, bb, &first, NULL);
}

/* Agent.Ring: another agent's link for a collective (the previous one of a
 * ring, any of a mesh, a partner in recursive doubling), then, on the same
 * call, for each next collective of the job it sends here, until it
 * half-closes the call. */
static void agent_ring(ps__rpc_call_t *call, void *arg)
{
    ps__agent_t *a = arg;
    grpc_byte_buffer *bb = NULL;
    ps__frame_t first;
    if (first_frame(a, call, "ring: ", &bb, &first) < 0)
        return;
    for (;;) {
        grpc_byte_buffer_destroy(bb);
        if (!ps__hub_ring_serve(a->hub, call, &first))
            return;
        if (next_request(a, call, "ring: ", &bb, &first) < 0)
            return;
    }
}

int ps__agent_create(const ps__config_t *cfg, ps__rpc_server_t *srv, const char *self,
                     const char *coordinator, ps__agent_t **out)
{
    ps__agent_t *a = calloc(1, sizeof(*a));
    if (!a)
        return PS_ENOMEM;
    a->cfg = cfg;
    pthread_mutex_init(&a->lock, NULL);
    pthread_mutex_init(&a->register_lock, NULL);
    pthread_cond_init(&a->stop_cond, NULL);
    int rc = PS_ENOMEM;
    a->self = strdup(self);
    if (!a->self)
        goto fail;
    static const char *const ring_names[] = {
        [PS_RING_OFF] = "off", [PS_RING_ON] = "on", [PS_RING_AUTO] = "auto"};
    snprintf(a->settings, sizeof(a->settings),
             "--ring %s --ring-min-bytes %" PRIu64 " --rd-max-bytes %" PRIu64
             " --step-bytes %zu --wire %d",
             ring_names[cfg->ring], cfg->ring_min_bytes, cfg->rd_max_bytes, cfg->step_bytes,
             PS_WIRE_REVISION);
    if ((rc = ps__rpc_channel_create_ex(coordinator, &cfg->rpc, &a->coord)) < 0)
        goto fail;
    if (cfg->tokens_file && (rc = ps__tokens_load(cfg->tokens_file, &a->tokens)) < 0)
        goto fail;
    if ((rc = ps__hub_create(cfg, self, agent_lookup, agent_ring_open, agent_ring_keep, agent_serve,
                             a, &a->hub)) < 0)
        goto fail;
    rc = ps__rpc_server_add_method(srv, PS_M_WORKER_JOIN, worker_join, a);
    rc = rc ? rc : ps__rpc_server_add_method(srv, PS_M_WORKER_LEAVE, worker_leave, a);
    rc = rc ? rc : ps__rpc_server_add_method(srv, PS_M_WORKER_NEW_GROUP, worker_new_group, a);
    rc = rc ? rc : ps__rpc_server_add_method(srv, PS_M_WORKER_COLLECTIVE, worker_collective, a);
    rc = rc ? rc : ps__rpc_server_add_method(srv, PS_M_WORKER_SHM_ATTACH, worker_shm_attach, a);
    rc = rc ? rc : ps__rpc_server_add_method(srv, PS_M_WORKER_SHM_DETACH, worker_shm_detach, a);
    rc = rc ? rc : ps__rpc_server_add_method(srv, PS_M_AGENT_RING, agent_ring, a);
    rc = rc ? rc : ps__rpc_server_add_method(srv, PS_M_AGENT_RELAY, agent_relay, a);
    if (rc)
        goto fail;
    *out = a;
    return 0;
fail:
    ps__agent_destroy(a);
    return rc;
}

/* How often the agent registers again (RegisterAgentRequest.refresh_ms):
 * its liveness timeout, so the coordinator forgets a dead agent about as
 * soon as it would a dead connection. */
static uint32_t refresh_ms(const ps__agent_t *a)
{
    return (uint32_t)a->cfg->rpc.keepalive_ms;
}

/* Registers with the coordinator (not once the drain has begun), or says
 * it is stopping (why); 0 or an error. */
static int agent_register(ps__agent_t *a, const char *why, int64_t timeout_ms)
{
    pthread_mutex_lock(&a->register_lock);
    pthread_mutex_lock(&a->lock);
    int draining = a->draining;
    pthread_mutex_unlock(&a->lock);
    if (draining && !why) {
        pthread_mutex_unlock(&a->register_lock);
        return PS_EUNAVAIL;
    }
    Paramsync__V1__RegisterAgentRequest req = PARAMSYNC__V1__REGISTER_AGENT_REQUEST__INIT;
    Paramsync__V1__RegisterAgentResponse *resp = NULL;
    req.address = a->self;
    req.agent_settings = a->settings;
    if (why)
        req.stopping = (char *)why;
    else
        req.refresh_ms = refresh_ms(a);
    int rc = ps__rpc_unary(a->coord, PS_M_COORD_REGISTER, &req.base,
                           &paramsync__v1__register_agent_response__descriptor,
                           (ProtobufCMessage **)&resp, timeout_ms, NULL);
    if (rc == 0)
        protobuf_c_message_free_unpacked(&resp->base, NULL);
    pthread_mutex_unlock(&a->register_lock);
    return rc;
}

/* Keeps the agent's health true to whether its coordinator is reachable,
 * and registers the agent with each coordinator it connects to, and again
 * every refresh_ms while connected. */
static void *health_main(void *arg)
{
    ps__agent_t *a = arg;
    int was_ready = -1, checks = 0;
    int64_t registered = 0;
    uint32_t every = refresh_ms(a);
    pthread_mutex_lock(&a->lock);
    while (!a->stopping) {
        pthread_mutex_unlock(&a->lock);
        int ready = ps__rpc_channel_ready(a->coord);
        if (ready && (was_ready != 1 || ps__now_ms() - registered >= (int64_t)every)) {
            registered = ps__now_ms();
            agent_register(a, NULL, 2000); /* a refresh missed is harmless */
        }
        if (ready != was_ready) {
            /* The first check only starts the connection: no warning yet. */
            if (was_ready != -1 || ready)
                PS_LOG(ready ? PS_LOG_INFO : PS_LOG_WARN, "coordinator %s is %s",
                       ps__rpc_channel_target(a->coord), ready ? "reachable" : "unreachable");
            ps__health_set(a->health, "paramsync.v1.Worker", ready);
            ps__health_set(a->health, "", ready);
            was_ready = ready;
        }
        links_sweep(a, 0);
        pthread_mutex_lock(&a->lock);
        /* Poll fast until the first connection, then once a second (or
         * each refresh, if that is sooner). */
        int64_t wait = was_ready == 1 || checks > 20 ? (every < 1000 ? every : 1000) : 100;
        struct timespec ts = ps__abs_time(CLOCK_REALTIME, wait);
        checks++;
        if (!a->stopping)
            pthread_cond_timedwait(&a->stop_cond, &a->lock, &ts);
    }
    pthread_mutex_unlock(&a->lock);
    return NULL;
}

void ps__agent_watch_health(ps__agent_t *a, struct ps__health *health)
{
    a->health = health;
    a->health_running = pthread_create(&a->health_thread, NULL, health_main, a) == 0;
    if (a->health_running)
        (void)pthread_setname_np(a->health_thread, "ps-health");
}

ps__hub_t *ps__agent_hub(ps__agent_t *a)
{
    return a->hub;
}

/* How long SIGTERM's drain waits to tell the coordinator it is stopping. */
#define STOPPING_TELL_MS 1000

void ps__agent_drain(ps__agent_t *a)
{
    if (!a)
        return;
    pthread_mutex_lock(&a->lock);
    a->draining = 1;
    pthread_mutex_unlock(&a->lock);
    /* Before the Joins are cut, so the ranks lost with them are reported
     * with the reason rather than as broken streams. */
    if (ps__rpc_channel_ready(a->coord))
        agent_register(a, PS_MSG_STOPPING, STOPPING_TELL_MS);
    pthread_mutex_lock(&a->lock);
    for (forward_t *f = a->forwards; f; f = f->next)
        ps__rpc_call_cancel(f->up, GRPC_STATUS_UNAVAILABLE, PS_MSG_STOPPING);
    pthread_mutex_unlock(&a->lock);
    links_sweep(a, 1); /* the other agents let go of their ends */
    ps__hub_drain(a->hub);
}

int ps__agent_status(ps__agent_t *a, const char *job, Paramsync__V1__StatusResponse *resp)
{
    return ps__hub_status(a->hub, job, resp);
}

void ps__agent_destroy(ps__agent_t *a)
{
    if (!a)
        return;
    if (a->health_running) {
        pthread_mutex_lock(&a->lock);
        a->stopping = 1;
        pthread_cond_broadcast(&a->stop_cond);
        pthread_mutex_unlock(&a->lock);
        pthread_join(a->health_thread, NULL);
    }
    pthread_cond_destroy(&a->stop_cond);
    ps__hub_destroy(a->hub);
    links_sweep(a, 1);
    links_sweep(a, 1); /* destroys those half-closed by the first */
    while (a->peers) {
        peer_channel_t *p = a->peers;
        a->peers = p->next;
        ps__rpc_channel_destroy(p->ch);
        free(p->address);
        free(p);
    }
    ps__tokens_free(a->tokens);
    while (a->routes) {
        job_route_t *r = a->routes;
        a->routes = r->next;
        free(r->job);
        free(r->hub);
        free(r);
    }
    ps__rpc_channel_destroy(a->coord);
    pthread_mutex_destroy(&a->lock);
    pthread_mutex_destroy(&a->register_lock);
    free(a->self);
    free(a);
}
