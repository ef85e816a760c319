/* The communicator: joining a job, the membership stream, groups, errors, leaving. */
#include "internal.h"
#include "task.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* How long ps_finalize waits for the agent to end the Join stream after
 * Leave before it cancels the stream itself. */
#define PS__LEAVE_LINGER_MS 2000

char *ps__strdupf(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0)
        return NULL;
    char *s = malloc((size_t)n + 1);
    if (!s)
        return NULL;
    va_start(ap, fmt);
    vsnprintf(s, (size_t)n + 1, fmt, ap);
    va_end(ap);
    return s;
}

static void default_error_handler(int err, const char *message, void *arg)
{
    (void)err;
    (void)arg;
    fprintf(stderr, "paramsync: %s\n", message);
}

void ps__report(ps_comm_t *comm, int err, const char *what, const char *fmt, ...)
{
    ps_error_fn fn = default_error_handler;
    void *arg = NULL;
    if (comm) {
        pthread_mutex_lock(&comm->lock);
        fn = comm->error_fn;
        arg = comm->error_arg;
        pthread_mutex_unlock(&comm->lock);
    }
    if (!fn)
        return;
    char *detail = NULL, *full = NULL;
    va_list ap;
    va_start(ap, fmt);
    if (vasprintf(&detail, fmt, ap) < 0)
        detail = NULL;
    va_end(ap);
    /* The daemon's messages may already start with the same context. */
    size_t wl = strlen(what);
    if (detail && strncmp(detail, what, wl) == 0 && strncmp(detail + wl, ": ", 2) == 0)
        full = strdup(detail);
    else if (detail)
        full = ps__strdupf("%s: %s", what, detail);
    fn(err, full ? full : ps_strerror(err), arg);
    free(full);
    free(detail);
}

/* Waits on comm->cond until deadline (ps__now_ms clock); 1 when it passed. */
static int cond_wait_until(ps_comm_t *comm, int64_t deadline_ms)
{
    int64_t now = ps__now_ms();
    if (now >= deadline_ms)
        return 1;
    struct timespec ts = ps__abs_time(CLOCK_MONOTONIC, deadline_ms - now);
    return pthread_cond_timedwait(&comm->cond, &comm->lock, &ts) == ETIMEDOUT;
}

/* ---------------------------------------------------------------- in flight */

/* Called with comm->lock held. The first reason wins: later ones are
 * consequences of it. Cancels every call in flight so that no rank waits
 * for a peer that is gone. */
static void mark_broken(ps_comm_t *comm, int err, char *msg)
{
    if (comm->broken) {
        free(msg);
        return;
    }
    comm->broken = err;
    comm->broken_msg = msg;
    for (ps__coll_t *c = comm->inflight; c; c = c->next)
        if (c->call)
            ps__rpc_call_cancel(c->call, -err, msg ? msg : ps_strerror(err));
}

void ps__inflight_link(ps_comm_t *comm, ps__coll_t *coll)
{
    coll->call = NULL;
    coll->prev = NULL;
    coll->next = comm->inflight;
    if (comm->inflight)
        comm->inflight->prev = coll;
    comm->inflight = coll;
}

void ps__inflight_unlink(ps_comm_t *comm, ps__coll_t *coll)
{
    if (coll->prev)
        coll->prev->next = coll->next;
    else
        comm->inflight = coll->next;
    if (coll->next)
        coll->next->prev = coll->prev;
    coll->prev = coll->next = NULL;
    pthread_cond_broadcast(&comm->cond);
}

/* ps__comm_over with comm->lock held. */
static int comm_over_locked(ps_comm_t *comm, char **msg)
{
    if (comm->broken) {
        *msg = comm->broken_msg ? strdup(comm->broken_msg) : NULL;
        return comm->broken;
    }
    if (comm->finalizing) {
        *msg = strdup("the communicator was finalized");
        return PS_ECANCELLED;
    }
    return 0;
}

int ps__comm_over(ps_comm_t *comm, char **msg)
{
    pthread_mutex_lock(&comm->lock);
    int rc = comm_over_locked(comm, msg);
    pthread_mutex_unlock(&comm->lock);
    return rc;
}

int ps__inflight_attach(ps_comm_t *comm, ps__coll_t *coll, ps__rpc_call_t *call, char **msg)
{
    pthread_mutex_lock(&comm->lock);
    int rc = comm_over_locked(comm, msg);
    if (rc == 0)
        coll->call = call;
    pthread_mutex_unlock(&comm->lock);
    return rc;
}

void ps__inflight_detach(ps_comm_t *comm, ps__coll_t *coll)
{
    pthread_mutex_lock(&comm->lock);
    coll->call = NULL;
    pthread_mutex_unlock(&comm->lock);
}

void ps__inflight_remove(ps_comm_t *comm, ps__coll_t *coll)
{
    pthread_mutex_lock(&comm->lock);
    ps__inflight_unlink(comm, coll);
    pthread_mutex_unlock(&comm->lock);
}

/* ---------------------------------------------------------------- Join stream */

/* Handles one membership event; called with comm->lock held. Returns a
 * message (malloc'd) when the stream must be cancelled with *code. */
/* A copy of READY's n numbers, one per rank of a world of `world`; NULL
 * when they are not one per rank (an older coordinator sends none) or there
 * is no memory. */
static uint32_t *sets_copy(const uint32_t *sets, size_t n, int world)
{
    uint32_t *copy = n == (size_t)world && n ? malloc(n * sizeof(*copy)) : NULL;
    if (copy)
        memcpy(copy, sets, n * sizeof(*copy));
    return copy;
}

static char *join_event(ps_comm_t *comm, const Paramsync__V1__JoinEvent *ev, int *code)
{
    switch (ev->kind) {
    case PARAMSYNC__V1__JOIN_EVENT__KIND__READY:
        if (comm->ready)
            return NULL; /* a repeated READY changes nothing for this process */
        if (ev->world_size != comm->world_size ||
            (comm->requested_rank >= 0 && ev->rank != comm->requested_rank) || ev->rank < 0 ||
            ev->rank >= ev->world_size) {
            *code = -PS_EINTERNAL;
            return ps__strdupf("the agent made this process rank %d of %d; it asked for rank %d "
                               "of %d",
                               ev->rank, ev->world_size, comm->requested_rank, comm->world_size);
        }
        comm->rank = ev->rank;
        comm->incarnation = ev->incarnation;
        /* Without memory for them, no collective takes peer copies (device
         * collectives). */
        comm->peer_sets = sets_copy(ev->peer_sets, ev->n_peer_sets, ev->world_size);
        comm->device_sets = sets_copy(ev->device_sets, ev->n_device_sets, ev->world_size);
        comm->barrier_sets = sets_copy(ev->barrier_sets, ev->n_barrier_sets, ev->world_size);
        comm->ready = 1;
        comm->world.rank = ev->rank;
        pthread_cond_broadcast(&comm->cond);
        return NULL;
    case PARAMSYNC__V1__JOIN_EVENT__KIND__MEMBER_LOST:
    case PARAMSYNC__V1__JOIN_EVENT__KIND__JOB_ABORTED: {
        /* A loss's message is the coordinator's: "job J: rank R was lost ...". */
        int lost = ev->kind == PARAMSYNC__V1__JOIN_EVENT__KIND__MEMBER_LOST;
        char *msg = !lost ? ps__strdupf("the job was aborted: %s", ev->message)
                    : ev->message && *ev->message ? strdup(ev->message)
                                                  : ps__strdupf("rank %d was lost", ev->rank);
        if (!comm->ready) {
            /* The job never formed: ps_init fails with this. */
            *code = -PS_EABORTED;
            return msg;
        }
        mark_broken(comm, PS_EABORTED, msg);
        return NULL;
    }
    default:
        return NULL; /* newer agents may send kinds this client does not know */
    }
}

static void *join_main(void *arg)
{
    ps_comm_t *comm = arg;
    ps__rpc_call_t *call = comm->join_call;
    Paramsync__V1__JoinRequest req = PARAMSYNC__V1__JOIN_REQUEST__INIT;
    req.job = comm->job;
    req.world_size = comm->world_size;
    req.rank = comm->requested_rank;
    req.timeout_ms =
        comm->join_timeout_ms > UINT32_MAX ? UINT32_MAX : (uint32_t)comm->join_timeout_ms;
    req.peer_copies = ps__peer_wanted(comm);
    req.pid_namespace = comm->peer_pidns_ino;
    req.cuda_host = ps__device_host();
    req.direct_barrier = req.peer_copies && ps__bar_wanted();
    /* Failures to send show in the status below. The request side stays
     * open: the agent learns that this rank died when the stream breaks, and
     * that it left when ps_finalize half-closes it. */
    ps__rpc_send_msg(call, &req.base);

    for (;;) {
        ProtobufCMessage *m = NULL;
        int rc = ps__rpc_recv_msg(call, &paramsync__v1__join_event__descriptor, &m);
        if (rc == PS_EINVAL) {
            ps__rpc_call_cancel(call, -PS_EINTERNAL, "malformed JoinEvent from the agent");
            continue; /* the next receive fails and ends the loop */
        }
        if (rc != 0)
            break;
        int code = 0;
        pthread_mutex_lock(&comm->lock);
        char *cancel_msg = join_event(comm, (Paramsync__V1__JoinEvent *)m, &code);
        pthread_mutex_unlock(&comm->lock);
        protobuf_c_message_free_unpacked(m, NULL);
        if (cancel_msg) {
            ps__rpc_call_cancel(call, code, cancel_msg);
            free(cancel_msg);
        }
    }

    char *msg = NULL;
    int st = ps__rpc_call_finish(call, &msg);
    pthread_mutex_lock(&comm->lock);
    if (!comm->ready) {
        comm->join_err = st ? st : PS_EUNAVAIL;
        comm->join_msg = st && msg ? strdup(msg)
                                   : strdup("the agent ended the Join stream before the job was "
                                            "ready");
    } else if (!comm->leaving) {
        int err = st ? st : PS_EUNAVAIL;
        mark_broken(comm, err,
                    ps__strdupf("lost the membership stream to the agent at %s: %s", comm->target,
                                st && msg ? msg : "the agent ended it"));
    } else if (st && comm->leave_call) {
        /* The agent is gone: Leave would wait for it until its deadline. */
        ps__rpc_call_cancel(comm->leave_call, -st, msg ? msg : "the agent is gone");
    }
    comm->join_ended = 1;
    pthread_cond_broadcast(&comm->cond);
    pthread_mutex_unlock(&comm->lock);
    free(msg);
    return NULL;
}

/* ---------------------------------------------------------------- init */

void ps_init_options_default(ps_init_options_t *opts)
{
    if (!opts)
        return;
    memset(opts, 0, sizeof(*opts));
    opts->world_size = -1;
    opts->rank = -1;
}

static void group_free(ps_group_t *g)
{
    if (!g)
        return;
    ps__bar_free(g);
    free(g->ranks);
    free(g->send_seq);
}

static void comm_free(ps_comm_t *comm, int rpc_acquired)
{
    ps__stage_free(comm); /* its staging segment is among the shm ones */
    ps__shm_free(comm);
    ps__rpc_call_destroy(comm->join_call);
    ps__rpc_channel_destroy(comm->channel);
    for (uint32_t i = 0; i < comm->ngroups; i++) {
        group_free(comm->groups[i]);
        free(comm->groups[i]);
    }
    free(comm->groups);
    group_free(&comm->world);
    free(comm->job);
    free(comm->peer_sets);
    free(comm->device_sets);
    free(comm->barrier_sets);
    free(comm->target);
    free(comm->broken_msg);
    free(comm->join_msg);
    pthread_cond_destroy(&comm->cond);
    pthread_mutex_destroy(&comm->lock);
    free(comm);
    /* The last communicator gone, the process may exit next: its atexit
     * clean-up (OpenSSL's, gRPC's) must not run beside threads of this
     * library's that are still ending, nor beside gRPC's subchannels, which
     * outlive their channel (rpc.h, ps__rpc_wait_shutdown). So the kept
     * threads are joined and gRPC is let shut down here, as the daemon does
     * at its exit. */
    if (rpc_acquired && ps__rpc_release() == 0) {
        ps__task_quiesce(PS__FINALIZE_WAIT_MS);
        ps__rpc_wait_shutdown(PS__FINALIZE_WAIT_MS);
    }
}

/* Settles every option from opts, the init method and the environment.
 * Returns 0 or PS_EINVAL/PS_ENOMEM with *errmsg. */
static int resolve_options(const ps_init_options_t *opts, ps__endpoint_t *ep, ps_comm_t *comm,
                           char **errmsg)
{
    int64_t v;
    int rc = ps__endpoint_parse(opts->init_method, ep, errmsg);
    if (rc < 0)
        return rc;

    const char *job = opts->job ? opts->job : ep->job ? ep->job : getenv("PARAMSYNC_JOB");
    if (!job || !*job)
        job = ep->file ? ep->file : "default";
    comm->job = strdup(job);
    if (!comm->job)
        return PS_ENOMEM;

    comm->world_size = opts->world_size > 0 ? opts->world_size : ep->world_size;
    if (comm->world_size <= 0) {
        rc = ps__env_int("WORLD_SIZE", 1, INT32_MAX, &v);
        if (rc < 0 || rc == 1) {
            *errmsg = strdup(rc < 0 ? "WORLD_SIZE is not a positive integer"
                                    : "the world size is not set (options, the init method's "
                                      "?world_size= or WORLD_SIZE)");
            return PS_EINVAL;
        }
        comm->world_size = (int)v;
    }
    comm->requested_rank = opts->rank >= 0 ? opts->rank : ep->rank;
    if (comm->requested_rank < 0) {
        rc = ps__env_int("RANK", 0, INT32_MAX, &v);
        if (rc < 0) {
            *errmsg = strdup("RANK is not a non-negative integer");
            return PS_EINVAL;
        }
        comm->requested_rank = rc == 1 ? -1 : (int)v;
    }
    /* A rank outside the world is left for the daemon to refuse: it is the
     * one place that names the rule, for every client language. */

    comm->timeout_ms = opts->timeout_ms;
    if (comm->timeout_ms <= 0) {
        rc = ps__env_int("PARAMSYNC_TIMEOUT_MS", 1, UINT32_MAX, &v);
        if (rc < 0) {
            *errmsg = strdup("PARAMSYNC_TIMEOUT_MS is not a positive number of milliseconds");
            return PS_EINVAL;
        }
        comm->timeout_ms = rc == 1 ? PS__DEFAULT_TIMEOUT_MS : v;
    }
    if (comm->timeout_ms > UINT32_MAX)
        comm->timeout_ms = UINT32_MAX; /* the wire field is 32 bits: about 49 days */
    comm->join_timeout_ms = opts->join_timeout_ms;
    if (comm->join_timeout_ms <= 0) {
        rc = ps__env_int("PARAMSYNC_JOIN_TIMEOUT_MS", 1, UINT32_MAX, &v);
        if (rc < 0) {
            *errmsg = strdup("PARAMSYNC_JOIN_TIMEOUT_MS is not a positive number of milliseconds");
            return PS_EINVAL;
        }
        comm->join_timeout_ms = rc == 1 ? comm->timeout_ms : v;
    }
    if (comm->join_timeout_ms > UINT32_MAX)
        comm->join_timeout_ms = UINT32_MAX;

    rc = ps__env_int("PARAMSYNC_CHUNK_BYTES", 1, PS_FRAME_MAX_DATA, &v);
    if (rc < 0) {
        *errmsg = ps__strdupf("PARAMSYNC_CHUNK_BYTES is not a number of bytes in [1, %u]",
                              PS_FRAME_MAX_DATA);
        return PS_EINVAL;
    }
    comm->chunk_bytes = rc == 1 ? PS__DEFAULT_CHUNK_BYTES : (size_t)v;

    rc = ps__env_int("PARAMSYNC_DEVICE_MIN_BYTES", 0, INT64_MAX, &v);
    if (rc < 0) {
        *errmsg = strdup("PARAMSYNC_DEVICE_MIN_BYTES is not a number of bytes");
        return PS_EINVAL;
    }
    comm->device_min_bytes = rc == 1 ? -1 : v;

    rc = ps__env_int("PARAMSYNC_SCRATCH_BYTES", 0, INT64_MAX, &v);
    if (rc < 0) {
        *errmsg = strdup("PARAMSYNC_SCRATCH_BYTES is not a number of bytes");
        return PS_EINVAL;
    }
    comm->scratch_max = rc == 1 ? PS__SCRATCH_DEFAULT_BYTES : (size_t)v;
    return 0;
}

/* Fills a group's bookkeeping for ranks (job ranks in group order). */
static int group_setup(ps_group_t *g, ps_comm_t *comm, uint32_t id, const int *ranks, int n,
                       int my_rank)
{
    g->comm = comm;
    g->id = id;
    g->size = n;
    g->rank = -1;
    g->ranks = malloc((size_t)n * sizeof(*g->ranks));
    g->send_seq = calloc((size_t)n, sizeof(*g->send_seq));
    if (!g->ranks || !g->send_seq)
        return PS_ENOMEM;
    for (int i = 0; i < n; i++) {
        g->ranks[i] = ranks ? ranks[i] : i;
        if (g->ranks[i] == my_rank)
            g->rank = i;
    }
    return 0;
}

int ps_init(const ps_init_options_t *opts, ps_comm_t **out)
{
    ps_init_options_t defaults;
    ps__endpoint_t ep;
    char *errmsg = NULL;
    int rc, rpc_acquired = 0;
    int64_t start = ps__now_ms();
    memset(&ep, 0, sizeof(ep));

    if (!opts) {
        ps_init_options_default(&defaults);
        opts = &defaults;
    }
    if (!out) {
        ps__report(NULL, PS_EINVAL, "init", "out is NULL");
        return PS_EINVAL;
    }
    ps_comm_t *comm = calloc(1, sizeof(*comm));
    if (!comm) {
        ps__report(NULL, PS_ENOMEM, "init", "out of memory");
        return PS_ENOMEM;
    }
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(&comm->lock, NULL);
    pthread_cond_init(&comm->cond, &ca);
    pthread_condattr_destroy(&ca);
    comm->error_fn = opts->error_fn ? opts->error_fn : default_error_handler;
    comm->error_arg = opts->error_fn ? opts->error_arg : NULL;
    comm->rank = -1;

    rc = resolve_options(opts, &ep, comm, &errmsg);
    if (rc < 0)
        goto fail;
    if (ep.file) {
        rc = ps__endpoint_wait_file(&ep, comm->join_timeout_ms, &errmsg);
        if (rc < 0)
            goto fail;
    }
    comm->target = strdup(ep.target);
    if (!comm->target) {
        rc = PS_ENOMEM;
        goto fail;
    }
    rc = group_setup(&comm->world, comm, 0, NULL, comm->world_size, -1);
    if (rc < 0)
        goto fail;

    ps__rpc_acquire();
    rpc_acquired = 1;
    /* Credentials come from the environment, as a container passes them:
     * the job token, and TLS files when the agent serves TLS. */
    ps__rpc_options_t ropts;
    memset(&ropts, 0, sizeof(ropts));
    ropts.token = getenv("PARAMSYNC_TOKEN");
    ropts.tls_ca = getenv("PARAMSYNC_TLS_CA");
    ropts.tls_cert = getenv("PARAMSYNC_TLS_CERT");
    ropts.tls_key = getenv("PARAMSYNC_TLS_KEY");
    ropts.tls_server_name = getenv("PARAMSYNC_TLS_SERVER_NAME");
    rc = ps__rpc_channel_create_ex(comm->target, &ropts, &comm->channel);
    if (rc < 0) {
        errmsg = ps__strdupf("cannot make a channel to '%s'%s", comm->target,
                             rc == PS_EINVAL ? ": cannot read PARAMSYNC_TLS_CA/CERT/KEY" : "");
        goto fail;
    }
    /* No deadline on the stream itself: it lasts as long as the comm. The
     * rendezvous deadline is enforced below and by the daemon. */
    rc = ps__rpc_call_start(comm->channel, PS__METHOD_JOIN, 0, &comm->join_call);
    if (rc < 0)
        goto fail;
    if (pthread_create(&comm->join_thread, NULL, join_main, comm) != 0) {
        rc = PS_ENOMEM;
        goto fail;
    }
    (void)pthread_setname_np(comm->join_thread, "ps-join");
    comm->join_thread_started = 1;

    int64_t deadline = start + comm->join_timeout_ms + PS__DEADLINE_GRACE_MS;
    int cancelled = 0;
    pthread_mutex_lock(&comm->lock);
    while (!comm->ready && !comm->join_ended) {
        if (cancelled) {
            pthread_cond_wait(&comm->cond, &comm->lock); /* the stream ends soon */
        } else if (cond_wait_until(comm, deadline)) {
            char *m = ps__strdupf("no answer from the agent at %s within %lld ms (is paramsyncd "
                                  "running there?)",
                                  comm->target, (long long)(ps__now_ms() - start));
            ps__rpc_call_cancel(comm->join_call, -PS_ETIMEDOUT, m ? m : "join timed out");
            free(m);
            cancelled = 1;
        }
    }
    int ready = comm->ready;
    pthread_mutex_unlock(&comm->lock);
    if (!ready) {
        rc = comm->join_err ? comm->join_err : PS_EUNAVAIL;
        errmsg = comm->join_msg;
        comm->join_msg = NULL;
        goto fail;
    }
    ps__endpoint_clear(&ep);
    *out = comm;
    return 0;

fail:
    if (comm->join_thread_started) {
        ps__rpc_call_cancel(comm->join_call, -PS_ECANCELLED, "init failed");
        pthread_join(comm->join_thread, NULL);
    }
    {
        char what[160];
        if (comm->job)
            snprintf(what, sizeof(what), "init (job %s, rank %d of %d)", comm->job,
                     comm->requested_rank, comm->world_size);
        else
            snprintf(what, sizeof(what), "init");
        ps__report(comm, rc, what, "%s", errmsg ? errmsg : ps_strerror(rc));
    }
    free(errmsg);
    ps__endpoint_clear(&ep);
    comm_free(comm, rpc_acquired);
    return rc;
}

/* ---------------------------------------------------------------- finalize */

/* Sends Leave. Not ps__rpc_unary: the call is published in comm->leave_call
 * so that the end of the Join stream, when the agent is gone, cancels it
 * rather than let it wait for the agent until its deadline. */
static int leave(ps_comm_t *comm)
{
    Paramsync__V1__LeaveRequest req = PARAMSYNC__V1__LEAVE_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    ps__rpc_call_t *call = NULL;
    char *msg = NULL;
    req.job = comm->job;
    req.rank = comm->rank;
    int rc = ps__rpc_call_start(comm->channel, PS__METHOD_LEAVE, PS__CONTROL_TIMEOUT_MS, &call);
    if (rc < 0)
        goto out;
    pthread_mutex_lock(&comm->lock);
    int gone = comm->join_ended;
    comm->leave_call = gone ? NULL : call;
    pthread_mutex_unlock(&comm->lock);
    if (gone)
        goto out; /* the agent ended the stream meanwhile: nobody to tell */
    /* Failures to send show in the status. */
    if (ps__rpc_send_msg(call, &req.base) == 0)
        ps__rpc_call_close_send(call);
    int rrc = ps__rpc_recv_msg(call, &paramsync__v1__leave_response__descriptor, &resp);
    rc = ps__rpc_call_finish(call, &msg);
    if (rc == 0 && rrc != 0)
        rc = rrc == 1 ? PS_EINTERNAL : rrc;
    pthread_mutex_lock(&comm->lock);
    comm->leave_call = NULL;
    pthread_mutex_unlock(&comm->lock);
out:
    if (rc < 0)
        ps__report(comm, rc, "finalize", "Leave: %s", msg ? msg : ps_strerror(rc));
    if (resp)
        protobuf_c_message_free_unpacked(resp, NULL);
    free(msg);
    ps__rpc_call_destroy(call);
    return rc;
}

int ps_finalize(ps_comm_t *comm)
{
    if (!comm)
        return 0;
    int rc = 0;

    /* Work still in flight is a caller's bug, but must not hang or touch
     * freed memory: cancel it and wait until it lets go of the comm. */
    pthread_mutex_lock(&comm->lock);
    comm->finalizing = 1;
    for (ps__coll_t *c = comm->inflight; c; c = c->next)
        if (c->call)
            ps__rpc_call_cancel(c->call, -PS_ECANCELLED, "the communicator was finalized");
    while (comm->inflight)
        pthread_cond_wait(&comm->cond, &comm->lock);
    int alive = !comm->join_ended;
    comm->leaving = 1;
    pthread_mutex_unlock(&comm->lock);

    if (alive)
        rc = leave(comm);

    /* Half-closing the Join stream is the leave itself; the agent then ends
     * the stream. Do not wait on it forever. */
    if (comm->join_call)
        ps__rpc_call_close_send(comm->join_call);
    int64_t deadline = ps__now_ms() + PS__LEAVE_LINGER_MS;
    int cancelled = 0;
    pthread_mutex_lock(&comm->lock);
    while (!comm->join_ended) {
        if (cancelled) {
            pthread_cond_wait(&comm->cond, &comm->lock);
        } else if (cond_wait_until(comm, deadline)) {
            ps__rpc_call_cancel(comm->join_call, -PS_ECANCELLED, "the communicator was finalized");
            cancelled = 1;
        }
    }
    pthread_mutex_unlock(&comm->lock);
    pthread_join(comm->join_thread, NULL);
    comm_free(comm, 1);
    return rc;
}

/* ---------------------------------------------------------------- queries */

void ps_set_error_handler(ps_comm_t *comm, ps_error_fn fn, void *arg)
{
    if (!comm)
        return;
    pthread_mutex_lock(&comm->lock);
    comm->error_fn = fn;
    comm->error_arg = arg;
    pthread_mutex_unlock(&comm->lock);
}

int ps_get_rank(const ps_comm_t *comm, const ps_group_t *group)
{
    if (!comm)
        return -1;
    if (group)
        return group->comm == comm ? group->rank : -1;
    return comm->rank;
}

int ps_get_world_size(const ps_comm_t *comm, const ps_group_t *group)
{
    if (!comm)
        return -1;
    if (group)
        return group->comm == comm ? group->size : -1;
    return comm->world_size;
}

/* ---------------------------------------------------------------- groups */

int ps_new_group(ps_comm_t *comm, const int *ranks, int nranks, ps_group_t **out)
{
    Paramsync__V1__NewGroupRequest req = PARAMSYNC__V1__NEW_GROUP_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    ps_group_t *g = NULL;
    char *msg = NULL;
    int32_t *wire_ranks = NULL;
    int rc = 0;
    char what[64];

    if (!comm) {
        ps__report(NULL, PS_EPRECOND, "new_group", "paramsync is not initialised (comm is NULL)");
        return PS_EPRECOND;
    }
    if (!out || (!ranks && nranks > 0) || nranks < 0 || nranks > comm->world_size) {
        ps__report(comm, PS_EINVAL, "new_group", "bad arguments (ranks %p, nranks %d)",
                   (const void *)ranks, nranks);
        return PS_EINVAL;
    }
    if (!ranks || nranks == 0)
        nranks = comm->world_size; /* torch's new_group(ranks=None): every rank */
    wire_ranks = malloc((size_t)nranks * sizeof(*wire_ranks));
    g = calloc(1, sizeof(*g));
    if (!wire_ranks || !g) {
        rc = PS_ENOMEM;
        goto fail;
    }
    for (int i = 0; i < nranks; i++) {
        int r = ranks ? ranks[i] : i;
        if (r < 0 || r >= comm->world_size) {
            ps__report(comm, PS_EINVAL, "new_group", "rank %d is not in the job (world size %d)", r,
                       comm->world_size);
            rc = PS_EINVAL;
            goto fail;
        }
        for (int j = 0; j < i; j++) {
            if (wire_ranks[j] == r) {
                ps__report(comm, PS_EINVAL, "new_group", "rank %d is listed twice", r);
                rc = PS_EINVAL;
                goto fail;
            }
        }
        wire_ranks[i] = r;
    }

    /* Every rank numbers its groups by its own count of calls, so the ids
     * agree as long as every rank calls ps_new_group in the same order
     * (torch's rule); an id is used even when the call fails, for the same
     * reason. */
    pthread_mutex_lock(&comm->lock);
    uint32_t id = comm->ngroups + 1;
    ps_group_t **grown = realloc(comm->groups, (size_t)id * sizeof(*grown));
    if (grown) {
        comm->groups = grown;
        comm->groups[comm->ngroups++] = g;
    }
    pthread_mutex_unlock(&comm->lock);
    if (!grown) {
        rc = PS_ENOMEM;
        goto fail;
    }
    /* From here g belongs to comm (freed by ps_finalize) even on failure. */
    snprintf(what, sizeof(what), "new_group (group %u)", id);
    rc = group_setup(g, comm, id, wire_ranks, nranks, comm->rank);
    if (rc < 0) {
        g->size = 0;
        ps__report(comm, rc, what, "out of memory");
        goto out;
    }

    req.job = comm->job;
    req.group = id;
    req.n_ranks = (size_t)nranks;
    req.ranks = wire_ranks;
    req.rank = comm->rank;
    rc = ps__rpc_unary(comm->channel, PS__METHOD_NEW_GROUP, &req.base,
                       &paramsync__v1__new_group_response__descriptor, &resp,
                       comm->timeout_ms + PS__DEADLINE_GRACE_MS, &msg);
    if (rc < 0) {
        ps__report(comm, rc, what, "%s", msg ? msg : ps_strerror(rc));
        goto out;
    }
    Paramsync__V1__NewGroupResponse *r = (Paramsync__V1__NewGroupResponse *)resp;
    if (r->group_size != nranks || r->group_rank != g->rank) {
        rc = PS_EINTERNAL;
        ps__report(comm, rc, what,
                   "the agent made this process rank %d of a group of %d; expected rank %d of %d",
                   r->group_rank, r->group_size, g->rank, nranks);
        goto out;
    }
    *out = g;

out:
    if (resp)
        protobuf_c_message_free_unpacked(resp, NULL);
    free(msg);
    free(wire_ranks);
    return rc;

fail:
    free(g);
    free(wire_ranks);
    return rc;
}
