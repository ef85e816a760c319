/* The thin gRPC core wrapper: blocking per-call operations on per-call pluck queues. */
#include "rpc.h"
#include "thread_names.h"

#include <errno.h>
#include <malloc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

#include <paramsync/common.h>

/* Requests kept outstanding per method, so bursts of new calls (a job's
 * ranks arriving at once) do not wait for a request to be made again. */
#define PS_RPC_PENDING_PER_METHOD 8
#define PS_RPC_MAX_METHODS        32
/* A channel's longest wait between connection attempts (gRPC's default is
 * 120 s). A subchannel waiting to reconnect is destroyed only when that wait
 * ends, even after its channel is, and gRPC shuts down only then: a process
 * exits that much later (ps__rpc_wait_shutdown). A peer that comes back is
 * also found sooner. */
#define PS_RPC_RECONNECT_MAX_MS 1000

struct ps__rpc_call {
    grpc_call *call;
    grpc_completion_queue *cq;
    int is_server;
    const char *method;
    char *peer;
    gpr_timespec deadline;
    pthread_mutex_t lock;
    int initial_md_sent; /* SEND_INITIAL_METADATA already in a batch */
    /* client: the initial metadata, sent with the first batch that sends
     * anything, so a call's headers and first message go in one write */
    char *md_authorization, *md_via;
    uint32_t md_flags;
    int md_outstanding;    /* client: sent in a batch of its own, not plucked yet */
    int status_sent;       /* server */
    int start_outstanding; /* client: the start batch is not plucked yet */
    int status_outstanding;
    int finished; /* client: status plucked */
    grpc_metadata_array md_initial;
    grpc_metadata_array md_trailing;
    grpc_status_code status;
    grpc_slice status_details;
    int cancelled;                  /* server: RECV_CLOSE_ON_SERVER result */
    int status_code;                /* server: the status sent */
    int close_seen;                 /* server: RECV_CLOSE_ON_SERVER already plucked */
    grpc_metadata_array md_request; /* server: the client's metadata */
    ps__rpc_channel_t *channel;     /* client: for its metadata */
    /* A receive batch left outstanding by ps__rpc_call_recv_ready, and the
     * message it receives into (every receive's target) */
    int recv_outstanding;
    grpc_byte_buffer *recv_bb;
    /* Tags: distinct addresses inside the call. */
    char tag_start, tag_status, tag_send, tag_recv, tag_close, tag_md;
    /* A local call (ps__rpc_call_local): no gRPC call behind it; what is
     * sent on it is kept for ps__rpc_call_local_outcome. */
    int local;
    grpc_byte_buffer *local_first; /* the first message sent */
    /* ps__rpc_call_local_on: messages go out on this server call, whose
     * metadata is the local call's too. */
    struct ps__rpc_call *parent;
    /* server bookkeeping */
    struct ps__rpc_server *server;
    struct ps__rpc_call *next_active, *prev_active;
};

typedef struct rpc_method {
    char *name;
    void *handle;
    ps__rpc_handler_fn fn;
    void *arg;
} rpc_method_t;

typedef struct rpc_pending {
    struct ps__rpc_server *server;
    int method;
    grpc_call *call;
    gpr_timespec deadline;
    grpc_metadata_array md;
    grpc_byte_buffer *payload;
    grpc_completion_queue *call_cq;
    grpc_call_details details; /* method -1: a call to no registered method */
} rpc_pending_t;

struct ps__rpc_server {
    grpc_server *server;
    grpc_server_credentials *creds; /* TLS, or NULL for plaintext */
    grpc_completion_queue *cq;
    rpc_method_t methods[PS_RPC_MAX_METHODS];
    int nmethods;
    int started, shutting_down, destroyed;
    pthread_mutex_t lock;
    pthread_cond_t idle;
    int active_handlers;
    int pending_requests;
    int shutdown_notified;
    struct ps__rpc_call *active;
    /* Handler threads are kept: creating one per call cost 100-150 us on
     * these VMs, more than the rest of a small collective. pool_idle counts
     * those waiting on the server's queue. */
    int pool_threads, pool_idle;
    ps__thread_t *ended; /* handler threads that have ended, to be joined */
    ps__rpc_observer_fn observer;
    char tag_shutdown;
};

struct ps__rpc_channel {
    grpc_channel *channel;
    char *target;
    char *authorization; /* "Bearer TOKEN", or NULL */
};

static pthread_mutex_t g_init_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_init_refs;
/* gRPC was up before this module's first grpc_init: the process has another
 * user of it, whose shutdown is not this module's to wait for. */
static int g_grpc_shared;
/* This module let gRPC go (its last release) and has not seen it down
 * since: gRPC may still be up on this module's account (a subchannel waiting
 * to reconnect holds a grpc_init of its own), which says nothing of another
 * user. */
static int g_let_go;

int ps__malloc_arenas_init(void)
{
    if (getenv("MALLOC_ARENA_MAX") || getenv("GLIBC_TUNABLES"))
        return 0;
    return mallopt(M_ARENA_MAX, 1) == 1 ? 1 : 0;
}

void ps__rpc_acquire(void)
{
    pthread_mutex_lock(&g_init_lock);
    if (g_init_refs++ == 0) {
        /* gRPC allocates a fresh buffer for every TCP read; glibc's default
         * trimming returns that memory to the kernel after each message, so
         * every read page-faults. Keeping it doubles stream throughput. The
         * mmap threshold must be set too, or it freezes at 128 KiB. */
        mallopt(M_TRIM_THRESHOLD, 512 << 20);
        mallopt(M_MMAP_THRESHOLD, 32 << 20);
        int up = grpc_is_initialized();
        /* Up while this module's own release may still hold it: whether
         * another user has it is as it was before. */
        if (!up || !g_let_go)
            g_grpc_shared = up;
        g_let_go = 0;
        grpc_init();
    }
    pthread_mutex_unlock(&g_init_lock);
}

int ps__rpc_release(void)
{
    pthread_mutex_lock(&g_init_lock);
    if (g_init_refs > 0 && --g_init_refs == 0) {
        grpc_shutdown();
        g_let_go = 1;
    }
    int left = g_init_refs;
    pthread_mutex_unlock(&g_init_lock);
    return left;
}

/* Whether gRPC is still wanted: by this module (a reference), or by another
 * user of it in the process (up before this module's). Not this module's to
 * wait for, then. */
static int grpc_still_wanted(void)
{
    pthread_mutex_lock(&g_init_lock);
    int wanted = g_init_refs > 0 || g_grpc_shared;
    pthread_mutex_unlock(&g_init_lock);
    return wanted;
}

/* Whether gRPC is up on this module's account: not wanted (above) and not
 * shut down yet. Once it is seen down, this module's release holds it no
 * more. */
static int grpc_left_up(void)
{
    if (grpc_still_wanted())
        return 0;
    if (grpc_is_initialized())
        return 1;
    pthread_mutex_lock(&g_init_lock);
    if (g_init_refs == 0)
        g_let_go = 0;
    pthread_mutex_unlock(&g_init_lock);
    return 0;
}

static void count_event_engine(const char *name, void *n)
{
    *(int *)n += strncmp(name, "event_engine", 12) == 0;
}

/* Threads of gRPC's event engine (named so by gRPC) in this process. */
static int event_engine_threads(void)
{
    int n = 0;
    ps__each_thread_name(count_event_engine, &n);
    return n;
}

int ps__rpc_wait_shutdown(int64_t timeout_ms)
{
    int64_t end = ps__now_ms() + timeout_ms;
    /* grpc_is_initialized takes gRPC's init lock, which its clean-up thread
     * holds until the shutdown is done. */
    while (grpc_left_up()) {
        if (ps__now_ms() >= end)
            return PS_ETIMEDOUT;
        /* Once the last channel is gone nothing polls: a connection attempt
         * being cancelled (a TLS handshake) would wait for gRPC's backup
         * poller. Poll here, holding gRPC up meanwhile; whichever of this
         * grpc_shutdown and gRPC's own comes last shuts gRPC down (this one
         * here, in this thread). */
        grpc_init();
        grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
        grpc_completion_queue_next(
            cq, gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(10, GPR_TIMESPAN)),
            NULL);
        grpc_completion_queue_shutdown(cq);
        while (grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
               GRPC_QUEUE_SHUTDOWN)
            ;
        grpc_completion_queue_destroy(cq);
        grpc_shutdown();
    }
    /* gRPC's event engine lets the threads of its pool end detached: after
     * the shutdown they may still be running their exit (thread-local
     * clean-up). Wait until the kernel has them gone. */
    while (!grpc_still_wanted() && event_engine_threads() > 0) {
        if (ps__now_ms() >= end)
            return PS_ETIMEDOUT;
        struct timespec ms = {0, 1000000};
        nanosleep(&ms, NULL);
    }
    return 0;
}

ps__thread_t *ps__thread_start(const char *name, void *(*fn)(void *), void *arg)
{
    ps__thread_t *t = malloc(sizeof(*t));
    if (!t)
        return NULL;
    t->arg = arg;
    t->next = NULL;
    if (pthread_create(&t->id, NULL, fn, t) != 0) {
        free(t);
        return NULL;
    }
    (void)pthread_setname_np(t->id, name);
    return t;
}

ps__thread_t *ps__thread_ended(ps__thread_t **ended, ps__thread_t *t)
{
    ps__thread_t *before = *ended;
    t->next = NULL;
    *ended = t;
    return before;
}

void ps__thread_reap(ps__thread_t **ended)
{
    while (*ended) {
        ps__thread_t *t = *ended;
        *ended = t->next;
        pthread_join(t->id, NULL);
        free(t);
    }
}

int64_t ps__now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

struct timespec ps__abs_time(clockid_t clock, int64_t ms_from_now)
{
    struct timespec ts;
    clock_gettime(clock, &ts);
    ts.tv_sec += ms_from_now / 1000;
    ts.tv_nsec += (long)(ms_from_now % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    return ts;
}

/* Channel arguments for a server or channel, built from options. */
typedef struct rpc_args {
    grpc_arg arg[12];
    grpc_channel_args ch;
} rpc_args_t;

static void args_int(rpc_args_t *a, const char *key, int v)
{
    grpc_arg *g = &a->arg[a->ch.num_args++];
    g->type = GRPC_ARG_INTEGER;
    g->key = (char *)key;
    g->value.integer = v;
}

static void args_str(rpc_args_t *a, const char *key, const char *v)
{
    grpc_arg *g = &a->arg[a->ch.num_args++];
    g->type = GRPC_ARG_STRING;
    g->key = (char *)key;
    g->value.string = (char *)v;
}

static grpc_channel_args *rpc_args(rpc_args_t *a, const ps__rpc_options_t *o, int server)
{
    memset(a, 0, sizeof(*a));
    a->ch.args = a->arg;
    int64_t maxmsg = o && o->max_message_bytes > 0 ? o->max_message_bytes : -1;
    args_int(a, GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, maxmsg > INT32_MAX ? -1 : (int)maxmsg);
    args_int(a, GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, -1);
    /* BDP probing costs 40-75% on request/response streams (measured). */
    args_int(a, GRPC_ARG_HTTP2_BDP_PROBE, 0);
    if (o && o->keepalive_ms > 0) {
        /* A ping after half the liveness timeout of silence, and half again
         * for its answer: a dead peer is known within the timeout. */
        int ka = o->keepalive_ms / 2 > INT32_MAX ? INT32_MAX : (int)(o->keepalive_ms / 2);
        args_int(a, GRPC_ARG_KEEPALIVE_TIME_MS, ka);
        args_int(a, GRPC_ARG_KEEPALIVE_TIMEOUT_MS, ka);
        args_int(a, GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
        args_int(a, GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
        if (server)
            args_int(a, GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, ka / 2);
    }
    if (!server)
        args_int(a, GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, PS_RPC_RECONNECT_MAX_MS);
    /* gRPC binds with SO_REUSEPORT by default: a second daemon on a port in
     * use would start and take a share of its connections. It fails instead. */
    if (server)
        args_int(a, GRPC_ARG_ALLOW_REUSEPORT, 0);
    if (!server && o && o->tls_server_name)
        args_str(a, GRPC_SSL_TARGET_NAME_OVERRIDE_ARG, o->tls_server_name);
    return &a->ch;
}

/* Reads a whole PEM file; NULL when it cannot. */
static char *read_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    char *buf = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len + 4096 + 1 > cap) {
            size_t ncap = cap ? cap * 2 : 8192;
            char *nb = realloc(buf, ncap);
            if (!nb) {
                free(buf);
                fclose(f);
                return NULL;
            }
            buf = nb;
            cap = ncap;
        }
        size_t n = fread(buf + len, 1, 4096, f);
        len += n;
        if (n < 4096)
            break;
    }
    fclose(f);
    buf[len] = 0;
    return buf;
}

static grpc_completion_queue *pluck_cq_create(void)
{
    return grpc_completion_queue_create_for_pluck(NULL);
}

/* Waits for tag; returns the event's success flag. */
static int pluck(grpc_completion_queue *cq, void *tag)
{
    grpc_event ev = grpc_completion_queue_pluck(cq, tag, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    return ev.type == GRPC_OP_COMPLETE && ev.success;
}

static void call_free(ps__rpc_call_t *c)
{
    if (!c)
        return;
    if (c->recv_outstanding) { /* its batch must end before the queue goes */
        grpc_call_cancel(c->call, NULL);
        pluck(c->cq, &c->tag_recv);
        if (c->recv_bb)
            grpc_byte_buffer_destroy(c->recv_bb);
    }
    if (c->call)
        grpc_call_unref(c->call);
    if (c->cq) {
        grpc_completion_queue_shutdown(c->cq);
        grpc_completion_queue_destroy(c->cq);
    }
    grpc_metadata_array_destroy(&c->md_initial);
    grpc_metadata_array_destroy(&c->md_trailing);
    grpc_metadata_array_destroy(&c->md_request);
    grpc_slice_unref(c->status_details);
    if (c->local_first)
        grpc_byte_buffer_destroy(c->local_first);
    if (c->peer)
        gpr_free(c->peer);
    free(c->md_authorization);
    free(c->md_via);
    pthread_mutex_destroy(&c->lock);
    free(c);
}

static ps__rpc_call_t *call_alloc(void)
{
    ps__rpc_call_t *c = calloc(1, sizeof(*c));
    if (!c)
        return NULL;
    pthread_mutex_init(&c->lock, NULL);
    grpc_metadata_array_init(&c->md_initial);
    grpc_metadata_array_init(&c->md_trailing);
    grpc_metadata_array_init(&c->md_request);
    c->status_details = grpc_empty_slice();
    return c;
}

static int status_to_err(grpc_status_code code)
{
    return code == GRPC_STATUS_OK ? 0 : -(int)code;
}

/* ---------------------------------------------------------------- server */

int ps__rpc_server_create(ps__rpc_server_t **out)
{
    return ps__rpc_server_create_ex(NULL, out);
}

int ps__rpc_server_create_ex(const ps__rpc_options_t *o, ps__rpc_server_t **out)
{
    grpc_server_credentials *creds = NULL;
    if (o && o->tls_cert) {
        char *cert = read_file(o->tls_cert), *key = o->tls_key ? read_file(o->tls_key) : NULL;
        char *ca = o->tls_ca ? read_file(o->tls_ca) : NULL;
        if (!cert || !key || (o->tls_ca && !ca)) {
            free(cert);
            free(key);
            free(ca);
            return PS_EINVAL;
        }
        grpc_ssl_pem_key_cert_pair pair = {key, cert};
        creds = grpc_ssl_server_credentials_create_ex(
            ca, &pair, 1,
            ca ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
               : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE,
            NULL);
        free(cert);
        free(key);
        free(ca);
        if (!creds)
            return PS_EINVAL;
    }
    ps__rpc_server_t *s = calloc(1, sizeof(*s));
    if (!s) {
        if (creds)
            grpc_server_credentials_release(creds);
        return PS_ENOMEM;
    }
    s->creds = creds;
    rpc_args_t args;
    s->server = grpc_server_create(rpc_args(&args, o, 1), NULL);
    s->cq = grpc_completion_queue_create_for_next(NULL);
    if (!s->server || !s->cq) {
        if (s->server)
            grpc_server_destroy(s->server);
        if (s->cq)
            grpc_completion_queue_destroy(s->cq);
        free(s);
        return PS_ENOMEM;
    }
    grpc_server_register_completion_queue(s->server, s->cq, NULL);
    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->idle, NULL);
    *out = s;
    return 0;
}

int ps__rpc_server_add_method(ps__rpc_server_t *s, const char *method, ps__rpc_handler_fn fn,
                              void *arg)
{
    if (s->started || s->nmethods >= PS_RPC_MAX_METHODS)
        return PS_EINVAL;
    rpc_method_t *m = &s->methods[s->nmethods];
    m->name = strdup(method);
    if (!m->name)
        return PS_ENOMEM;
    m->handle = grpc_server_register_method(s->server, m->name, NULL, GRPC_SRM_PAYLOAD_NONE, 0);
    if (!m->handle) {
        free(m->name);
        return PS_EINVAL;
    }
    m->fn = fn;
    m->arg = arg;
    s->nmethods++;
    return 0;
}

static int server_listen(ps__rpc_server_t *s, const char *addr, int *port, int plain)
{
    grpc_server_credentials *creds = grpc_insecure_server_credentials_create();
    int p = grpc_server_add_http2_port(s->server, addr, plain || !s->creds ? creds : s->creds);
    grpc_server_credentials_release(creds);
    if (p <= 0 && strncmp(addr, "unix:", 5) != 0)
        return PS_EUNAVAIL;
    if (p <= 0)
        p = 0;
    if (port)
        *port = p;
    return 0;
}

int ps__rpc_server_listen(ps__rpc_server_t *s, const char *addr, int *port)
{
    return server_listen(s, addr, port, 0);
}

int ps__rpc_server_listen_plain(ps__rpc_server_t *s, const char *addr, int *port)
{
    return server_listen(s, addr, port, 1);
}

/* ---------------------------------------------------------------- local calls */

/* A status message as a C string (malloc'd; NULL when out of memory). */
static char *slice_strdup(grpc_slice s)
{
    size_t n = GRPC_SLICE_LENGTH(s);
    char *m = malloc(n + 1);
    if (m) {
        memcpy(m, GRPC_SLICE_START_PTR(s), n);
        m[n] = 0;
    }
    return m;
}

int ps__rpc_call_local(ps__rpc_call_t **out)
{
    ps__rpc_call_t *c = calloc(1, sizeof(*c));
    if (!c)
        return PS_ENOMEM;
    c->local = 1;
    c->is_server = 1;
    c->method = "local";
    c->status_details = grpc_empty_slice();
    pthread_mutex_init(&c->lock, NULL);
    *out = c;
    return 0;
}

int ps__rpc_call_local_on(ps__rpc_call_t *parent, ps__rpc_call_t **out)
{
    int rc = ps__rpc_call_local(out);
    if (rc == 0)
        (*out)->parent = parent;
    return rc;
}

int ps__rpc_call_is_local(const ps__rpc_call_t *c)
{
    return c->local;
}

/* What a local call got: a message (kept if it is the first) and/or its
 * status (the first one wins, as with gRPC). */
static int local_take(ps__rpc_call_t *c, grpc_byte_buffer *msg, int has_status, int code,
                      const char *message)
{
    pthread_mutex_lock(&c->lock);
    int rc = 0;
    if (c->status_sent) {
        rc = PS_EINVAL;
    } else {
        if (msg && c->parent) {
            /* Not under the lock a cancel takes. One send at a time, as
             * on any call: the hub sends a member's frames in turn. */
            pthread_mutex_unlock(&c->lock);
            rc = ps__rpc_call_send(c->parent, msg);
            pthread_mutex_lock(&c->lock);
            if (rc == 0 && has_status && c->status_sent)
                rc = PS_EINVAL; /* ended meanwhile: the first status wins */
            if (rc < 0) {
                pthread_mutex_unlock(&c->lock);
                return rc;
            }
        } else if (msg && !c->local_first) {
            c->local_first = grpc_byte_buffer_copy(msg);
        }
        if (has_status) {
            c->status_sent = 1;
            c->status_code = code;
            grpc_slice_unref(c->status_details);
            c->status_details = grpc_slice_from_copied_string(message ? message : "");
        }
    }
    pthread_mutex_unlock(&c->lock);
    return rc;
}

int ps__rpc_call_local_outcome(ps__rpc_call_t *c, char **message, grpc_byte_buffer **first)
{
    pthread_mutex_lock(&c->lock);
    int code = c->status_sent ? c->status_code : GRPC_STATUS_INTERNAL;
    *message = slice_strdup(c->status_details);
    if (first) {
        *first = c->local_first;
        c->local_first = NULL;
    }
    pthread_mutex_unlock(&c->lock);
    return code;
}

int ps__rpc_call_metadata(const ps__rpc_call_t *c, const char *key, char *buf, size_t len)
{
    if (c->parent)
        return ps__rpc_call_metadata(c->parent, key, buf, len);
    for (size_t i = 0; i < c->md_request.count; i++) {
        const grpc_metadata *m = &c->md_request.metadata[i];
        size_t klen = GRPC_SLICE_LENGTH(m->key);
        if (klen == strlen(key) && memcmp(GRPC_SLICE_START_PTR(m->key), key, klen) == 0) {
            size_t n = GRPC_SLICE_LENGTH(m->value);
            if (len == 0)
                return 0;
            if (n >= len)
                n = len - 1;
            memcpy(buf, GRPC_SLICE_START_PTR(m->value), n);
            buf[n] = 0;
            return 0;
        }
    }
    return PS_ENOTFOUND;
}

static int request_call(ps__rpc_server_t *s, int method)
{
    rpc_pending_t *p = calloc(1, sizeof(*p));
    if (!p)
        return PS_ENOMEM;
    p->server = s;
    p->method = method;
    grpc_metadata_array_init(&p->md);
    grpc_call_details_init(&p->details);
    p->call_cq = pluck_cq_create();
    /* Method -1 takes calls to any other method, so they get UNIMPLEMENTED
     * at once instead of waiting for their deadline. */
    grpc_call_error e =
        method < 0
            ? grpc_server_request_call(s->server, &p->call, &p->details, &p->md, p->call_cq, s->cq,
                                       p)
            : grpc_server_request_registered_call(s->server, s->methods[method].handle, &p->call,
                                                  &p->deadline, &p->md, NULL, p->call_cq, s->cq, p);
    if (e != GRPC_CALL_OK) {
        grpc_completion_queue_destroy(p->call_cq);
        grpc_metadata_array_destroy(&p->md);
        grpc_call_details_destroy(&p->details);
        free(p);
        return PS_EINTERNAL;
    }
    s->pending_requests++;
    return 0;
}

static void pending_free(rpc_pending_t *p)
{
    if (p->call_cq) {
        grpc_completion_queue_shutdown(p->call_cq);
        grpc_completion_queue_destroy(p->call_cq);
    }
    grpc_metadata_array_destroy(&p->md);
    grpc_call_details_destroy(&p->details);
    free(p);
}

/* Takes an ended call off the server's active list and frees it. */
static void call_retire(ps__rpc_server_t *s, ps__rpc_call_t *c)
{
    pthread_mutex_lock(&s->lock);
    if (c->prev_active)
        c->prev_active->next_active = c->next_active;
    else
        s->active = c->next_active;
    if (c->next_active)
        c->next_active->prev_active = c->prev_active;
    s->active_handlers--;
    pthread_cond_broadcast(&s->idle);
    pthread_mutex_unlock(&s->lock);
    call_free(c);
}

static void serve_call(ps__rpc_call_t *c)
{
    ps__rpc_server_t *s = c->server;
    rpc_method_t *m = NULL;
    for (int i = 0; i < s->nmethods; i++)
        if (s->methods[i].name == c->method)
            m = &s->methods[i];
    m->fn(c, m->arg);
    if (!c->status_sent)
        ps__rpc_call_send_status(c, GRPC_STATUS_INTERNAL, "handler ended without a status");
    if (!c->close_seen)
        pluck(c->cq, &c->tag_close);
    if (s->observer)
        s->observer(c->method,
                    c->cancelled && c->status_code == 0 ? GRPC_STATUS_CANCELLED : c->status_code);
    call_retire(s, c);
}

/* Idle handler threads beyond this many end after PS_RPC_POOL_IDLE_MS, so
 * a burst of streams does not keep its threads for good. */
#define PS_RPC_POOL_KEEP    16
#define PS_RPC_POOL_IDLE_MS 5000

static void *pool_main(void *arg);

/* Starts one more handler thread, waiting on the server's queue. Lock
 * held. 0, or PS_ENOMEM. */
static int pool_grow(ps__rpc_server_t *s)
{
    if (!ps__thread_start("ps-rpc", pool_main, s))
        return PS_ENOMEM;
    s->pool_threads++;
    s->pool_idle++;
    return 0;
}

/* Makes the server's call of an accepted request and serves it in this
 * thread. served says whether another thread waits for the next request:
 * when none could be had, the call is refused rather than served, since a
 * handler may block until calls not yet accepted come in. */
static void handle_call(ps__rpc_server_t *s, rpc_pending_t *p, int served)
{
    ps__rpc_call_t *c = call_alloc();
    if (!c) {
        grpc_call_cancel_with_status(p->call, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory",
                                     NULL);
        grpc_call_unref(p->call);
        pending_free(p);
        return;
    }
    c->call = p->call;
    c->cq = p->call_cq;
    c->is_server = 1;
    c->method = s->methods[p->method].name;
    c->deadline = p->deadline;
    c->server = s;
    c->md_request = p->md;
    grpc_metadata_array_init(&p->md);
    p->call_cq = NULL;
    if (p->payload)
        grpc_byte_buffer_destroy(p->payload);
    pending_free(p);

    /* RECV_CLOSE_ON_SERVER completes when the client half-closes or the call
     * dies; it is plucked when the handler returns. */
    grpc_op op;
    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    op.data.recv_close_on_server.cancelled = &c->cancelled;
    grpc_call_start_batch(c->call, &op, 1, &c->tag_close, NULL);

    pthread_mutex_lock(&s->lock);
    c->next_active = s->active;
    if (s->active)
        s->active->prev_active = c;
    s->active = c;
    s->active_handlers++;
    int shutting = s->shutting_down;
    pthread_mutex_unlock(&s->lock);
    if (shutting)
        grpc_call_cancel_with_status(c->call, GRPC_STATUS_UNAVAILABLE, PS_RPC_MSG_SHUTDOWN, NULL);
    if (served) {
        serve_call(c);
    } else {
        ps__rpc_call_send_status(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "no thread for the call");
        pluck(c->cq, &c->tag_close);
        call_retire(s, c);
    }
}

/* One event of the server's queue: a call accepted (served here), a
 * request that failed, or the server's shutdown. */
static void handle_event(ps__rpc_server_t *s, grpc_event ev)
{
    if (ev.tag == &s->tag_shutdown) {
        pthread_mutex_lock(&s->lock);
        s->shutdown_notified = 1;
        pthread_cond_broadcast(&s->idle);
        pthread_mutex_unlock(&s->lock);
        return;
    }
    rpc_pending_t *p = ev.tag;
    pthread_mutex_lock(&s->lock);
    s->pending_requests--;
    int shutting = s->shutting_down;
    /* The request is made again first, so the next call is not kept
     * waiting while this one is served. */
    if (ev.success && !shutting)
        request_call(s, p->method);
    /* Before serving, another thread must wait for the next call: handlers
     * block on each other inside a collective. */
    int served = ev.success && p->method >= 0 && (s->pool_idle > 0 || pool_grow(s) == 0);
    pthread_mutex_unlock(&s->lock);
    if (!ev.success) {
        pending_free(p);
    } else if (p->method < 0) {
        char msg[300];
        snprintf(msg, sizeof(msg), "unknown method %.*s",
                 (int)(GRPC_SLICE_LENGTH(p->details.method) > 200
                           ? 200
                           : GRPC_SLICE_LENGTH(p->details.method)),
                 (const char *)GRPC_SLICE_START_PTR(p->details.method));
        grpc_call_cancel_with_status(p->call, GRPC_STATUS_UNIMPLEMENTED, msg, NULL);
        grpc_call_unref(p->call);
        pending_free(p);
    } else {
        handle_call(s, p, served);
    }
    pthread_mutex_lock(&s->lock);
    pthread_cond_broadcast(&s->idle);
    pthread_mutex_unlock(&s->lock);
}

/* A handler thread: every idle one waits on the server's queue, and the one
 * that takes an accepted call serves it itself (no hand-off to another
 * thread, which cost a context switch per call). Before it does, it makes
 * sure another thread waits for the next call, starting one if none is
 * idle, because handlers block on each other inside a collective. */
static void *pool_main(void *arg)
{
    ps__thread_t *self = arg;
    ps__rpc_server_t *s = self->arg;
    int shutdown = 0;
    for (;;) {
        gpr_timespec until = gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                          gpr_time_from_millis(PS_RPC_POOL_IDLE_MS, GPR_TIMESPAN));
        grpc_event ev = grpc_completion_queue_next(s->cq, until, NULL);
        pthread_mutex_lock(&s->lock);
        if (ev.type == GRPC_QUEUE_SHUTDOWN) {
            shutdown = 1;
            break;
        }
        if (ev.type == GRPC_QUEUE_TIMEOUT) {
            if (s->pool_idle > PS_RPC_POOL_KEEP)
                break;
            pthread_mutex_unlock(&s->lock);
            continue;
        }
        s->pool_idle--;
        pthread_mutex_unlock(&s->lock);
        handle_event(s, ev);
        pthread_mutex_lock(&s->lock);
        s->pool_idle++;
        pthread_mutex_unlock(&s->lock);
    }
    s->pool_idle--;
    s->pool_threads--;
    ps__thread_t *before = ps__thread_ended(&s->ended, self);
    pthread_cond_broadcast(&s->idle);
    /* A burst is over: hand back what the tuned allocator keeps for reuse,
     * once per 256 threads gone (trimming walks every arena). */
    int trim = !shutdown && s->pool_threads % 256 == PS_RPC_POOL_KEEP % 256;
    pthread_mutex_unlock(&s->lock);
    ps__thread_reap(&before);
    if (trim)
        malloc_trim(0);
    return NULL;
}

int ps__rpc_server_start(ps__rpc_server_t *s)
{
    grpc_server_start(s->server);
    s->started = 1;
    pthread_mutex_lock(&s->lock);
    for (int m = 0; m < s->nmethods; m++)
        for (int i = 0; i < PS_RPC_PENDING_PER_METHOD; i++)
            request_call(s, m);
    request_call(s, -1);
    int rc = pool_grow(s);
    pthread_mutex_unlock(&s->lock);
    return rc;
}

void ps__rpc_server_shutdown(ps__rpc_server_t *s)
{
    if (!s || !s->started)
        return;
    pthread_mutex_lock(&s->lock);
    if (s->shutting_down) {
        pthread_mutex_unlock(&s->lock);
        return;
    }
    s->shutting_down = 1;
    /* Workers in a collective learn why their call ended: the statuses go
     * out before the server's shutdown tells the clients to go away
     * (GOAWAY), so they reach them ahead of it. Once the last call of a
     * connection has ended after a GOAWAY, gRPC closes that connection,
     * and a status queued behind it was lost ("Socket closed"). */
    for (ps__rpc_call_t *c = s->active; c; c = c->next_active)
        grpc_call_cancel_with_status(c->call, GRPC_STATUS_UNAVAILABLE, PS_RPC_MSG_SHUTDOWN, NULL);
    struct timespec grace = ps__abs_time(CLOCK_REALTIME, PS_RPC_SHUTDOWN_GRACE_MS);
    while (s->active_handlers > 0 && pthread_cond_timedwait(&s->idle, &s->lock, &grace) == 0)
        ;
    grpc_server_shutdown_and_notify(s->server, s->cq, &s->tag_shutdown);
    /* Connections end gracefully, each once its client has read all that
     * came before the GOAWAY; those still open after the grace are cut. */
    while (!s->shutdown_notified && pthread_cond_timedwait(&s->idle, &s->lock, &grace) == 0)
        ;
    pthread_mutex_unlock(&s->lock);
    grpc_server_cancel_all_calls(s->server);
    pthread_mutex_lock(&s->lock);
    while (s->active_handlers > 0 || !s->shutdown_notified || s->pending_requests > 0)
        pthread_cond_wait(&s->idle, &s->lock);
    pthread_mutex_unlock(&s->lock);
    grpc_server_destroy(s->server);
    s->server = NULL;
    /* Each handler thread ends at the queue's shutdown and says when it is
     * gone; all are joined. */
    grpc_completion_queue_shutdown(s->cq);
    pthread_mutex_lock(&s->lock);
    while (s->pool_threads > 0)
        pthread_cond_wait(&s->idle, &s->lock);
    ps__thread_reap(&s->ended);
    pthread_mutex_unlock(&s->lock);
    grpc_completion_queue_destroy(s->cq);
    s->cq = NULL;
}

void ps__rpc_server_destroy(ps__rpc_server_t *s)
{
    if (!s)
        return;
    if (s->started) {
        ps__rpc_server_shutdown(s);
    } else {
        grpc_completion_queue *cq = s->cq;
        grpc_server_shutdown_and_notify(s->server, cq, &s->tag_shutdown);
        grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        grpc_server_destroy(s->server);
        grpc_completion_queue_shutdown(cq);
        while (grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
               GRPC_QUEUE_SHUTDOWN)
            ;
        grpc_completion_queue_destroy(cq);
    }
    for (int i = 0; i < s->nmethods; i++)
        free(s->methods[i].name);
    if (s->creds)
        grpc_server_credentials_release(s->creds);
    pthread_mutex_destroy(&s->lock);
    pthread_cond_destroy(&s->idle);
    free(s);
}

int ps__rpc_server_threads(ps__rpc_server_t *s, int *idle)
{
    pthread_mutex_lock(&s->lock);
    int n = s->pool_threads;
    *idle = s->pool_idle;
    pthread_mutex_unlock(&s->lock);
    return n;
}

void ps__rpc_server_set_observer(ps__rpc_server_t *s, ps__rpc_observer_fn fn)
{
    s->observer = fn;
}

const char *ps__rpc_call_method(const ps__rpc_call_t *c)
{
    return c->method;
}

const char *ps__rpc_call_peer(ps__rpc_call_t *c)
{
    if (c->local)
        return "local";
    pthread_mutex_lock(&c->lock);
    if (!c->peer)
        c->peer = grpc_call_get_peer(c->call);
    pthread_mutex_unlock(&c->lock);
    return c->peer ? c->peer : "unknown";
}

int64_t ps__rpc_call_remaining_ms(const ps__rpc_call_t *c)
{
    gpr_timespec d = gpr_convert_clock_type(c->deadline, GPR_CLOCK_MONOTONIC);
    if (gpr_time_cmp(d, gpr_inf_future(GPR_CLOCK_MONOTONIC)) == 0 || d.tv_sec > INT64_MAX / 2000)
        return INT64_MAX;
    gpr_timespec now = gpr_now(GPR_CLOCK_MONOTONIC);
    gpr_timespec left = gpr_time_sub(d, now);
    int64_t ms = (int64_t)left.tv_sec * 1000 + left.tv_nsec / 1000000;
    return ms < 0 ? 0 : ms;
}

/* Starts a batch of n ops (room for one more at the front), with
 * SEND_INITIAL_METADATA put first in it when the call has not sent it yet:
 * a client's carries its headers (kept from ps__rpc_call_start_ex, so the
 * headers and the first message go in one write), a server's none. With n
 * 0, only that: GRPC_CALL_ERROR (nothing started) when it went already.
 * The call's lock held. */
static grpc_call_error start_batch_locked(ps__rpc_call_t *c, grpc_op *ops, size_t n, void *tag)
{
    grpc_metadata md[2];
    size_t nmd = 0;
    if (!c->initial_md_sent) {
        memmove(ops + 1, ops, n * sizeof(*ops));
        memset(ops, 0, sizeof(*ops));
        ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
        ops[0].flags = c->md_flags;
        if (c->md_authorization) {
            md[nmd].key = grpc_slice_from_static_string("authorization");
            md[nmd++].value = grpc_slice_from_copied_string(c->md_authorization);
        }
        if (c->md_via) {
            md[nmd].key = grpc_slice_from_static_string(PS_RPC_VIA_METADATA);
            md[nmd++].value = grpc_slice_from_copied_string(c->md_via);
        }
        ops[0].data.send_initial_metadata.count = nmd;
        ops[0].data.send_initial_metadata.metadata = nmd ? md : NULL;
        c->initial_md_sent = 1;
        n++;
    }
    grpc_call_error e = n ? grpc_call_start_batch(c->call, ops, n, tag, NULL) : GRPC_CALL_ERROR;
    for (size_t i = 0; i < nmd; i++)
        grpc_slice_unref(md[i].value);
    return e;
}

static grpc_call_error start_batch_md(ps__rpc_call_t *c, grpc_op *ops, size_t n, void *tag)
{
    pthread_mutex_lock(&c->lock);
    grpc_call_error e = start_batch_locked(c, ops, n, tag);
    pthread_mutex_unlock(&c->lock);
    return e;
}

/* Sends an optional last message and the status in one batch: one trip
 * through the transport instead of two for small collectives. */
static int send_status_batch(ps__rpc_call_t *c, grpc_byte_buffer *msg, int code,
                             const char *message)
{
    grpc_op ops[3];
    size_t n = 0;
    memset(ops, 0, sizeof(ops));
    pthread_mutex_lock(&c->lock);
    if (c->status_sent) {
        pthread_mutex_unlock(&c->lock);
        return PS_EINVAL;
    }
    c->status_sent = 1;
    c->status_code = code;
    if (msg) {
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n++].data.send_message.send_message = msg;
    }
    grpc_slice details = grpc_slice_from_copied_string(message ? message : "");
    ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[n].data.send_status_from_server.status = (grpc_status_code)code;
    ops[n].data.send_status_from_server.status_details = &details;
    n++;
    grpc_call_error e = start_batch_locked(c, ops, n, &c->tag_status);
    pthread_mutex_unlock(&c->lock);
    int ok = e == GRPC_CALL_OK ? pluck(c->cq, &c->tag_status) : 0;
    grpc_slice_unref(details);
    return ok ? 0 : PS_EUNAVAIL;
}

int ps__rpc_call_peer_cancelled(ps__rpc_call_t *c, int64_t wait_ms)
{
    if (c->local)
        return 0; /* the worker's liveness is its Join stream's business */
    if (!c->close_seen) {
        gpr_timespec dl =
            gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(wait_ms, GPR_TIMESPAN));
        grpc_event ev = grpc_completion_queue_pluck(c->cq, &c->tag_close, dl, NULL);
        if (ev.type != GRPC_OP_COMPLETE)
            return -1;
        c->close_seen = 1;
    }
    return c->cancelled != 0;
}

int ps__rpc_call_send_status(ps__rpc_call_t *c, int code, const char *message)
{
    if (c->local)
        return local_take(c, NULL, 1, code, message);
    return send_status_batch(c, NULL, code, message);
}

int ps__rpc_call_send_last(ps__rpc_call_t *c, grpc_byte_buffer *msg, int code, const char *message)
{
    if (c->local)
        return local_take(c, msg, 1, code, message);
    if (c->is_server)
        return send_status_batch(c, msg, code, message);
    grpc_op ops[3];
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_MESSAGE;
    ops[0].data.send_message.send_message = msg;
    ops[1].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    if (start_batch_md(c, ops, 2, &c->tag_send) != GRPC_CALL_OK)
        return PS_EINTERNAL;
    return pluck(c->cq, &c->tag_send) ? 0 : PS_EUNAVAIL;
}

/* ---------------------------------------------------------------- client */

int ps__rpc_channel_create(const char *target, ps__rpc_channel_t **out)
{
    return ps__rpc_channel_create_ex(target, NULL, out);
}

int ps__rpc_channel_create_ex(const char *target, const ps__rpc_options_t *o,
                              ps__rpc_channel_t **out)
{
    if (!target || !*target)
        return PS_EINVAL;
    grpc_channel_credentials *creds = NULL;
    if (o && (o->tls_ca || o->tls_cert)) {
        char *ca = o->tls_ca ? read_file(o->tls_ca) : NULL;
        char *cert = o->tls_cert ? read_file(o->tls_cert) : NULL;
        char *key = o->tls_key ? read_file(o->tls_key) : NULL;
        if ((o->tls_ca && !ca) || (o->tls_cert && (!cert || !key))) {
            free(ca);
            free(cert);
            free(key);
            return PS_EINVAL;
        }
        grpc_ssl_pem_key_cert_pair pair = {key, cert};
        creds = grpc_ssl_credentials_create(ca, cert ? &pair : NULL, NULL, NULL);
        free(ca);
        free(cert);
        free(key);
    } else {
        creds = grpc_insecure_credentials_create();
    }
    if (!creds)
        return PS_EINVAL;
    ps__rpc_channel_t *ch = calloc(1, sizeof(*ch));
    if (!ch) {
        grpc_channel_credentials_release(creds);
        return PS_ENOMEM;
    }
    ch->target = strdup(target);
    if (o && o->token && *o->token && (ch->authorization = malloc(strlen(o->token) + 8)))
        sprintf(ch->authorization, "Bearer %s", o->token);
    rpc_args_t args;
    ch->channel = grpc_channel_create(target, creds, rpc_args(&args, o, 0));
    grpc_channel_credentials_release(creds);
    if (!ch->target || !ch->channel || (o && o->token && *o->token && !ch->authorization)) {
        if (ch->channel)
            grpc_channel_destroy(ch->channel);
        free(ch->target);
        free(ch->authorization);
        free(ch);
        return PS_ENOMEM;
    }
    *out = ch;
    return 0;
}

void ps__rpc_channel_destroy(ps__rpc_channel_t *ch)
{
    if (!ch)
        return;
    grpc_channel_destroy(ch->channel);
    free(ch->target);
    free(ch->authorization);
    free(ch);
}

const char *ps__rpc_channel_target(const ps__rpc_channel_t *ch)
{
    return ch->target;
}

int ps__rpc_channel_ready(ps__rpc_channel_t *ch)
{
    return grpc_channel_check_connectivity_state(ch->channel, 1) == GRPC_CHANNEL_READY;
}

int ps__rpc_call_start(ps__rpc_channel_t *ch, const char *method, int64_t timeout_ms,
                       ps__rpc_call_t **out)
{
    return ps__rpc_call_start_auth(ch, method, timeout_ms, ch->authorization, NULL, out);
}

int ps__rpc_call_start_auth(ps__rpc_channel_t *ch, const char *method, int64_t timeout_ms,
                            const char *authorization, const char *via, ps__rpc_call_t **out)
{
    return ps__rpc_call_start_ex(ch, method, timeout_ms, authorization, via, 1, out);
}

int ps__rpc_call_start_ex(ps__rpc_channel_t *ch, const char *method, int64_t timeout_ms,
                          const char *authorization, const char *via, int wait_for_ready,
                          ps__rpc_call_t **out)
{
    ps__rpc_call_t *c = call_alloc();
    if (!c)
        return PS_ENOMEM;
    c->cq = pluck_cq_create();
    c->method = method;
    c->deadline = timeout_ms > 0 ? gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                                gpr_time_from_millis(timeout_ms, GPR_TIMESPAN))
                                 : gpr_inf_future(GPR_CLOCK_REALTIME);
    grpc_slice m = grpc_slice_from_copied_string(method);
    c->call = grpc_channel_create_call(ch->channel, NULL, GRPC_PROPAGATE_DEFAULTS, c->cq, m, NULL,
                                       c->deadline, NULL);
    grpc_slice_unref(m);
    if (!c->call) {
        call_free(c);
        return PS_EINTERNAL;
    }
    /* Wait for the server instead of failing at once while it starts. */
    c->md_flags = wait_for_ready ? GRPC_INITIAL_METADATA_WAIT_FOR_READY : 0;
    if ((authorization && !(c->md_authorization = strdup(authorization))) ||
        (via && !(c->md_via = strdup(via)))) {
        call_free(c);
        return PS_ENOMEM;
    }
    grpc_op op;
    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_RECV_INITIAL_METADATA;
    op.data.recv_initial_metadata.recv_initial_metadata = &c->md_initial;
    if (grpc_call_start_batch(c->call, &op, 1, &c->tag_start, NULL) != GRPC_CALL_OK) {
        call_free(c);
        return PS_EINTERNAL;
    }
    c->start_outstanding = 1;
    grpc_op st;
    memset(&st, 0, sizeof(st));
    st.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    st.data.recv_status_on_client.trailing_metadata = &c->md_trailing;
    st.data.recv_status_on_client.status = &c->status;
    st.data.recv_status_on_client.status_details = &c->status_details;
    if (grpc_call_start_batch(c->call, &st, 1, &c->tag_status, NULL) != GRPC_CALL_OK) {
        grpc_call_cancel(c->call, NULL);
        pluck(c->cq, &c->tag_start);
        call_free(c);
        return PS_EINTERNAL;
    }
    c->status_outstanding = 1;
    *out = c;
    return 0;
}

/* A client call that is to wait for the server's side without having sent
 * anything sends its initial metadata first, in a batch of its own. */
static void send_md_alone(ps__rpc_call_t *c)
{
    if (c->is_server)
        return;
    grpc_op op[1]; /* start_batch_md decides, under the call's lock */
    if (start_batch_md(c, op, 0, &c->tag_md) == GRPC_CALL_OK)
        c->md_outstanding = 1;
}

int ps__rpc_call_close_send(ps__rpc_call_t *c)
{
    grpc_op ops[2];
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    if (start_batch_md(c, ops, 1, &c->tag_close) != GRPC_CALL_OK)
        return PS_EINTERNAL;
    return pluck(c->cq, &c->tag_close) ? 0 : PS_EUNAVAIL;
}

int ps__rpc_call_finish(ps__rpc_call_t *c, char **message)
{
    send_md_alone(c);
    if (c->md_outstanding) {
        pluck(c->cq, &c->tag_md);
        c->md_outstanding = 0;
    }
    if (c->start_outstanding) {
        pluck(c->cq, &c->tag_start);
        c->start_outstanding = 0;
    }
    if (c->status_outstanding) {
        pluck(c->cq, &c->tag_status);
        c->status_outstanding = 0;
    }
    c->finished = 1;
    if (message)
        *message = slice_strdup(c->status_details);
    return status_to_err(c->status);
}

void ps__rpc_call_destroy(ps__rpc_call_t *c)
{
    if (!c)
        return;
    if (c->start_outstanding || c->status_outstanding || c->md_outstanding) {
        grpc_call_cancel(c->call, NULL);
        if (c->md_outstanding)
            pluck(c->cq, &c->tag_md);
        if (c->start_outstanding)
            pluck(c->cq, &c->tag_start);
        if (c->status_outstanding)
            pluck(c->cq, &c->tag_status);
    }
    call_free(c);
}

/* ---------------------------------------------------------------- both */

int ps__rpc_call_send(ps__rpc_call_t *c, grpc_byte_buffer *msg)
{
    return ps__rpc_call_send_or(c, msg, NULL, NULL);
}

int ps__rpc_call_send_or(ps__rpc_call_t *c, grpc_byte_buffer *msg, int (*give_up)(void *),
                         void *arg)
{
    if (c->local)
        return local_take(c, msg, 0, 0, NULL);
    grpc_op ops[2];
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_MESSAGE;
    ops[0].data.send_message.send_message = msg;
    pthread_mutex_lock(&c->lock);
    if (c->status_sent) { /* a server's call already ended */
        pthread_mutex_unlock(&c->lock);
        return PS_EINVAL;
    }
    grpc_call_error e = start_batch_locked(c, ops, 1, &c->tag_send);
    pthread_mutex_unlock(&c->lock);
    if (e != GRPC_CALL_OK)
        return PS_EINTERNAL;
    while (give_up) {
        gpr_timespec slice =
            gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(100, GPR_TIMESPAN));
        grpc_event ev = grpc_completion_queue_pluck(c->cq, &c->tag_send, slice, NULL);
        if (ev.type != GRPC_QUEUE_TIMEOUT)
            return ev.type == GRPC_OP_COMPLETE && ev.success ? 0 : PS_EUNAVAIL;
        if (give_up(arg)) {
            ps__rpc_call_cancel(c, GRPC_STATUS_CANCELLED, "given up");
            break; /* the batch ends now */
        }
    }
    return pluck(c->cq, &c->tag_send) ? 0 : PS_EUNAVAIL;
}

/* Starts the batch that receives one message into c->recv_bb, unless one
 * is outstanding already (left by ps__rpc_call_recv_ready). */
static int recv_start(ps__rpc_call_t *c)
{
    if (c->recv_outstanding)
        return 0;
    send_md_alone(c);
    c->recv_bb = NULL;
    grpc_op op;
    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &c->recv_bb;
    if (grpc_call_start_batch(c->call, &op, 1, &c->tag_recv, NULL) != GRPC_CALL_OK)
        return PS_EINTERNAL;
    c->recv_outstanding = 1;
    return 0;
}

/* The outcome of the receive batch, which ended with success flag ok. */
static int recv_take(ps__rpc_call_t *c, int ok, grpc_byte_buffer **msg)
{
    grpc_byte_buffer *bb = c->recv_bb;
    c->recv_bb = NULL;
    c->recv_outstanding = 0;
    if (!ok) {
        if (bb)
            grpc_byte_buffer_destroy(bb);
        return PS_EUNAVAIL;
    }
    *msg = bb;
    return 0;
}

int ps__rpc_call_recv(ps__rpc_call_t *c, grpc_byte_buffer **msg)
{
    if (c->local) { /* a local call's request is all in its first frame */
        *msg = NULL;
        return 0;
    }
    int rc = recv_start(c);
    if (rc < 0)
        return rc;
    return recv_take(c, pluck(c->cq, &c->tag_recv), msg);
}

int ps__rpc_call_recv_ready(ps__rpc_call_t *c, grpc_byte_buffer **msg)
{
    if (c->local) {
        *msg = NULL;
        return 0;
    }
    int rc = recv_start(c);
    if (rc < 0)
        return rc;
    grpc_event ev =
        grpc_completion_queue_pluck(c->cq, &c->tag_recv, gpr_time_0(GPR_CLOCK_MONOTONIC), NULL);
    if (ev.type == GRPC_QUEUE_TIMEOUT)
        return 1; /* the batch stays for the next receive */
    return recv_take(c, ev.type == GRPC_OP_COMPLETE && ev.success, msg);
}

void ps__rpc_call_cancel(ps__rpc_call_t *c, int code, const char *message)
{
    if (c->local) {
        local_take(c, NULL, 1, code, message);
        return;
    }
    grpc_call_cancel_with_status(c->call, (grpc_status_code)code, message ? message : "", NULL);
}

/* ---------------------------------------------------------------- messages */

grpc_byte_buffer *ps__rpc_pack(const ProtobufCMessage *msg)
{
    size_t n = protobuf_c_message_get_packed_size(msg);
    grpc_slice s = grpc_slice_malloc(n);
    protobuf_c_message_pack(msg, GRPC_SLICE_START_PTR(s));
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    return bb;
}

int ps__rpc_unpack(grpc_byte_buffer *bb, const ProtobufCMessageDescriptor *desc,
                   ProtobufCMessage **out)
{
    grpc_byte_buffer_reader r;
    if (!grpc_byte_buffer_reader_init(&r, bb))
        return PS_EINVAL;
    grpc_slice s = grpc_byte_buffer_reader_readall(&r);
    grpc_byte_buffer_reader_destroy(&r);
    ProtobufCMessage *m =
        protobuf_c_message_unpack(desc, NULL, GRPC_SLICE_LENGTH(s), GRPC_SLICE_START_PTR(s));
    grpc_slice_unref(s);
    if (!m)
        return PS_EINVAL;
    *out = m;
    return 0;
}

int ps__rpc_recv_msg(ps__rpc_call_t *c, const ProtobufCMessageDescriptor *desc,
                     ProtobufCMessage **out)
{
    grpc_byte_buffer *bb = NULL;
    int rc = ps__rpc_call_recv(c, &bb);
    if (rc < 0)
        return rc;
    if (!bb)
        return 1;
    rc = ps__rpc_unpack(bb, desc, out);
    grpc_byte_buffer_destroy(bb);
    return rc;
}

int ps__rpc_send_msg(ps__rpc_call_t *c, const ProtobufCMessage *msg)
{
    grpc_byte_buffer *bb = ps__rpc_pack(msg);
    if (!bb)
        return PS_ENOMEM;
    int rc = ps__rpc_call_send(c, bb);
    grpc_byte_buffer_destroy(bb);
    return rc;
}

int ps__rpc_unary(ps__rpc_channel_t *ch, const char *method, const ProtobufCMessage *req,
                  const ProtobufCMessageDescriptor *resp_desc, ProtobufCMessage **resp,
                  int64_t timeout_ms, char **errmsg)
{
    return ps__rpc_unary_auth(ch, method, ch->authorization, req, resp_desc, resp, timeout_ms,
                              errmsg);
}

int ps__rpc_unary_auth(ps__rpc_channel_t *ch, const char *method, const char *authorization,
                       const ProtobufCMessage *req, const ProtobufCMessageDescriptor *resp_desc,
                       ProtobufCMessage **resp, int64_t timeout_ms, char **errmsg)
{
    ps__rpc_call_t *c = NULL;
    ProtobufCMessage *m = NULL;
    char *msg = NULL;
    int rc = ps__rpc_call_start_auth(ch, method, timeout_ms, authorization, NULL, &c);
    if (rc < 0)
        return rc;
    /* Send failures surface in the status below. */
    ps__rpc_send_msg(c, req);
    ps__rpc_call_close_send(c);
    int rrc = ps__rpc_recv_msg(c, resp_desc, &m);
    rc = ps__rpc_call_finish(c, &msg);
    if (rc == 0 && rrc != 0)
        rc = rrc == 1 ? PS_EINTERNAL : rrc;
    if (rc == 0) {
        *resp = m;
        m = NULL;
    } else if (errmsg) {
        *errmsg = msg;
        msg = NULL;
    }
    if (m)
        protobuf_c_message_free_unpacked(m, NULL);
    free(msg);
    ps__rpc_call_destroy(c);
    return rc;
}
