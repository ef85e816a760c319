/* grpc.health.v1.Health: a table of service statuses served by Check and Watch. */
#include "health.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <grpc/health/v1/health.pb-c.h>
#include <paramsync/common.h>

#include "log.h"

#define H_MAX_SERVICES 32
/* A Watch handler with nothing new to send repeats the current status this
 * often. The wrapper cannot tell a handler that its client went away (a
 * receive after the client's half-close succeeds even once the call is
 * cancelled), but a send fails: so a cancelled Watch frees its thread
 * within this, and clients take the repeat as the status it is. */
#define H_REPEAT_MS 2000

#define H_SERVING         GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING
#define H_NOT_SERVING     GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING
#define H_SERVICE_UNKNOWN GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVICE_UNKNOWN

/* gRPC status codes used here (grpc/status.h values). */
enum { H_OK = 0, H_CANCELLED = 1, H_INVALID_ARGUMENT = 3, H_NOT_FOUND = 5, H_UNAVAILABLE = 14 };

struct ps__health {
    pthread_mutex_t lock;
    pthread_cond_t changed; /* a status changed, or shutdown began */
    int shutting_down;
    int watchers; /* Watch handlers running */
    int nservices;
    struct {
        char *name;
        int status; /* H_SERVING or H_NOT_SERVING */
    } services[H_MAX_SERVICES];
};

/* With h->lock held: the index of service, or -1. */
static int service_find(ps__health_t *h, const char *service)
{
    for (int i = 0; i < h->nservices; i++)
        if (strcmp(h->services[i].name, service) == 0)
            return i;
    return -1;
}

/* With h->lock held: the status of service, H_SERVICE_UNKNOWN if unknown. */
static int service_status(ps__health_t *h, const char *service)
{
    int i = service_find(h, service);
    return i < 0 ? H_SERVICE_UNKNOWN : h->services[i].status;
}

/* Receives the one request of a Check or Watch call. 0 with *out set, or
 * the call has already been ended with a status. */
static int recv_request(ps__rpc_call_t *call, Grpc__Health__V1__HealthCheckRequest **out)
{
    ProtobufCMessage *m = NULL;
    int rc = ps__rpc_recv_msg(call, &grpc__health__v1__health_check_request__descriptor, &m);
    if (rc == 0) {
        *out = (Grpc__Health__V1__HealthCheckRequest *)m;
        return 0;
    }
    if (rc == 1)
        ps__rpc_call_send_status(call, H_INVALID_ARGUMENT, "no HealthCheckRequest was sent");
    else if (rc == PS_EINVAL)
        ps__rpc_call_send_status(call, H_INVALID_ARGUMENT, "malformed HealthCheckRequest");
    else
        ps__rpc_call_send_status(call, H_CANCELLED, "the call ended before its request");
    return -1;
}

static int send_status_msg(ps__rpc_call_t *call, int status)
{
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    resp.status = (Grpc__Health__V1__HealthCheckResponse__ServingStatus)status;
    return ps__rpc_send_msg(call, &resp.base);
}

static void health_check(ps__rpc_call_t *call, void *arg)
{
    ps__health_t *h = arg;
    Grpc__Health__V1__HealthCheckRequest *req = NULL;
    if (recv_request(call, &req) < 0)
        return;
    pthread_mutex_lock(&h->lock);
    int status = service_status(h, req->service);
    pthread_mutex_unlock(&h->lock);
    if (status == H_SERVICE_UNKNOWN) {
        char msg[300];
        snprintf(msg, sizeof(msg), "unknown service \"%.200s\"", req->service);
        ps__rpc_call_send_status(call, H_NOT_FOUND, msg);
    } else if (send_status_msg(call, status) == 0) {
        ps__rpc_call_send_status(call, H_OK, NULL);
    } else {
        ps__rpc_call_send_status(call, H_CANCELLED, "the call ended before the answer");
    }
    protobuf_c_message_free_unpacked(&req->base, NULL);
}

/* Sends the current status, then every change, until the call ends or the
 * daemon shuts down. */
static void health_watch(ps__rpc_call_t *call, void *arg)
{
    ps__health_t *h = arg;
    Grpc__Health__V1__HealthCheckRequest *req = NULL;
    if (recv_request(call, &req) < 0)
        return;
    int sent = -1, alive = 1;
    pthread_mutex_lock(&h->lock);
    h->watchers++;
    while (alive) {
        int status = service_status(h, req->service);
        if (status != sent) {
            pthread_mutex_unlock(&h->lock);
            alive = send_status_msg(call, status) == 0;
            pthread_mutex_lock(&h->lock);
            sent = status;
            continue;
        }
        if (h->shutting_down)
            break;
        struct timespec until;
        until = ps__abs_time(CLOCK_MONOTONIC, H_REPEAT_MS);
        if (pthread_cond_timedwait(&h->changed, &h->lock, &until) != 0)
            sent = -1;
    }
    int shutting = h->shutting_down;
    h->watchers--;
    pthread_cond_broadcast(&h->changed);
    pthread_mutex_unlock(&h->lock);
    if (shutting && alive)
        ps__rpc_call_send_status(call, H_UNAVAILABLE, PS_RPC_MSG_SHUTDOWN);
    else
        ps__rpc_call_send_status(call, H_CANCELLED, "the watch was cancelled");
    protobuf_c_message_free_unpacked(&req->base, NULL);
}

int ps__health_create(ps__rpc_server_t *srv, ps__health_t **out)
{
    ps__health_t *h = calloc(1, sizeof(*h));
    if (!h)
        return PS_ENOMEM;
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&h->changed, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&h->lock, NULL);
    int rc = 0;
    /* "" is the whole server; it exists from the start, NOT_SERVING until set. */
    h->services[0].name = strdup("");
    h->services[0].status = H_NOT_SERVING;
    if (!h->services[0].name) {
        rc = PS_ENOMEM;
        goto fail;
    }
    h->nservices = 1;
    if ((rc = ps__rpc_server_add_method(srv, "/grpc.health.v1.Health/Check", health_check, h)) <
            0 ||
        (rc = ps__rpc_server_add_method(srv, "/grpc.health.v1.Health/Watch", health_watch, h)) < 0)
        goto fail;
    *out = h;
    return 0;
fail:
    ps__health_destroy(h);
    return rc;
}

int ps__health_serve_on(ps__health_t *h, ps__rpc_server_t *srv)
{
    int rc = ps__rpc_server_add_method(srv, "/grpc.health.v1.Health/Check", health_check, h);
    return rc ? rc
              : ps__rpc_server_add_method(srv, "/grpc.health.v1.Health/Watch", health_watch, h);
}

void ps__health_set(ps__health_t *h, const char *service, int serving)
{
    if (!h || !service)
        return;
    int status = serving ? H_SERVING : H_NOT_SERVING;
    pthread_mutex_lock(&h->lock);
    /* A draining daemon stays NOT_SERVING whatever its parts report. */
    if (h->shutting_down)
        goto out;
    int i = service_find(h, service);
    if (i < 0) {
        char *name = h->nservices < H_MAX_SERVICES ? strdup(service) : NULL;
        if (!name) {
            PS_LOG(PS_LOG_WARN, "health: cannot track service \"%s\" (table full or no memory)",
                   service);
            goto out;
        }
        i = h->nservices++;
        h->services[i].name = name;
        h->services[i].status = -1;
    }
    if (h->services[i].status != status) {
        h->services[i].status = status;
        pthread_cond_broadcast(&h->changed);
    }
out:
    pthread_mutex_unlock(&h->lock);
}

void ps__health_shutdown(ps__health_t *h)
{
    if (!h)
        return;
    pthread_mutex_lock(&h->lock);
    h->shutting_down = 1;
    for (int i = 0; i < h->nservices; i++)
        h->services[i].status = H_NOT_SERVING;
    pthread_cond_broadcast(&h->changed);
    pthread_mutex_unlock(&h->lock);
}

int ps__health_watchers(ps__health_t *h)
{
    pthread_mutex_lock(&h->lock);
    int n = h->watchers;
    pthread_mutex_unlock(&h->lock);
    return n;
}

void ps__health_destroy(ps__health_t *h)
{
    if (!h)
        return;
    for (int i = 0; i < h->nservices; i++)
        free(h->services[i].name);
    pthread_cond_destroy(&h->changed);
    pthread_mutex_destroy(&h->lock);
    free(h);
}
