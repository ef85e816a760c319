/* Unit tests for server/hub.c: SIGTERM's drain ends every collective, even one just beginning. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <pthread.h>
#include <unistd.h>

#include <grpc/status.h>
#include <paramsync/common.h>

#include "daemon.h"

#define SELF "127.0.0.1:1"
#define JOB  "job"
/* The collective's own deadline: a collective the drain misses ends no
 * sooner (a local call has no peer that could cancel it). */
#define TIMEOUT_MS 5000

typedef struct fixture {
    ps__config_t cfg;
    ps__hub_t *hub;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int hold;      /* lookups wait for `go` */
    int in_lookup; /* lookups entered */
    int go;
} fixture_t;

/* The coordinator's answer: two ranks, both members, this agent the hub.
 * With `hold`, it is given only once the test says so. */
static int lookup(void *arg, const char *job, ps__job_info_t *info, char **errmsg)
{
    fixture_t *f = arg;
    (void)job;
    (void)errmsg;
    pthread_mutex_lock(&f->lock);
    f->in_lookup++;
    pthread_cond_broadcast(&f->cond);
    while (f->hold && !f->go)
        pthread_cond_wait(&f->cond, &f->lock);
    pthread_mutex_unlock(&f->lock);
    memset(info, 0, sizeof(*info));
    info->world_size = 2;
    info->incarnation = 1;
    info->hub = strdup(SELF);
    info->groups = calloc(1, sizeof(*info->groups));
    info->joined = malloc(2 * sizeof(int));
    if (!info->hub || !info->groups || !info->joined) {
        ps__job_info_clear(info);
        return PS_ENOMEM;
    }
    info->joined[0] = 0;
    info->joined[1] = 1;
    info->njoined = 2;
    return 0;
}

static int ring_open(void *arg, const char *address, const char *job, ps__rpc_call_t **out)
{
    (void)arg;
    (void)address;
    (void)job;
    (void)out;
    return PS_EUNAVAIL;
}

static int ring_keep(void *arg, const char *address, const char *job, ps__rpc_call_t *call)
{
    (void)arg;
    (void)address;
    (void)job;
    (void)call;
    return 0;
}

static void serve(void *arg, ps__rpc_call_t *call, ps__frame_t *first, void **state)
{
    (void)arg;
    (void)state;
    if (!call)
        return;
    ps__frame_clear(first);
    ps__rpc_call_send_status(call, GRPC_STATUS_INTERNAL, "not routed in this test");
}

static int setup(void **state)
{
    fixture_t *f = calloc(1, sizeof(*f));
    assert_non_null(f);
    f->cfg.timeout_ms = TIMEOUT_MS;
    f->cfg.join_timeout_ms = TIMEOUT_MS;
    f->cfg.max_tensor_bytes = 1u << 20;
    f->cfg.step_bytes = 1u << 16;
    f->cfg.window = 4;
    f->cfg.max_inflight_bytes = 1u << 24;
    f->cfg.ring_min_bytes = 1u << 20;
    pthread_mutex_init(&f->lock, NULL);
    pthread_cond_init(&f->cond, NULL);
    assert_int_equal(ps__hub_create(&f->cfg, SELF, lookup, ring_open, ring_keep, serve, f, &f->hub),
                     0);
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    fixture_t *f = *state;
    ps__hub_destroy(f->hub);
    pthread_cond_destroy(&f->cond);
    pthread_mutex_destroy(&f->lock);
    free(f);
    return 0;
}

/* Rank 0's barrier (rank 1 never comes) on a local call, as a doorbell's
 * thread serves it. */
typedef struct barrier {
    fixture_t *f;
    int code;
    char *msg;
    int64_t took_ms;
} barrier_t;

static void *barrier_main(void *arg)
{
    barrier_t *b = arg;
    Paramsync__V1__CollectiveHeader hd = PARAMSYNC__V1__COLLECTIVE_HEADER__INIT;
    hd.job = (char *)JOB;
    hd.kind = PARAMSYNC__V1__COLLECTIVE_KIND__BARRIER;
    hd.rank = 0;
    hd.timeout_ms = TIMEOUT_MS;
    uint8_t buf[256];
    size_t len = paramsync__v1__collective_header__pack(&hd, buf);
    Paramsync__V1__Frame *meta = malloc(sizeof(*meta));
    assert_non_null(meta);
    paramsync__v1__frame__init(meta);
    meta->header = paramsync__v1__collective_header__unpack(NULL, len, buf);
    assert_non_null(meta->header);
    ps__frame_t first;
    memset(&first, 0, sizeof(first));
    first.meta = meta;
    ps__rpc_call_t *call = NULL;
    assert_int_equal(ps__rpc_call_local(&call), 0);
    int64_t t0 = ps__now_ms();
    ps__hub_serve(b->f->hub, call, &first);
    b->took_ms = ps__now_ms() - t0;
    grpc_byte_buffer *bb = NULL;
    b->code = ps__rpc_call_local_outcome(call, &b->msg, &bb);
    if (bb)
        grpc_byte_buffer_destroy(bb);
    ps__rpc_call_destroy(call);
    return NULL;
}

static void assert_stopped(const barrier_t *b)
{
    if (b->code != GRPC_STATUS_UNAVAILABLE)
        fail_msg("the barrier ended with %d (%s) after %lld ms, want UNAVAILABLE at once", b->code,
                 b->msg ? b->msg : "", (long long)b->took_ms);
    assert_non_null(strstr(b->msg, "shutting down"));
    assert_true(b->took_ms < TIMEOUT_MS / 2);
}

/* SIGTERM while the barrier waits for rank 1: it fails at once. */
static void test_drain_fails_waiting(void **state)
{
    fixture_t *f = *state;
    barrier_t b = {.f = f};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, barrier_main, &b), 0);
    /* Waiting: the hub lists it among the collectives in flight. */
    for (int i = 0;; i++) {
        Paramsync__V1__StatusResponse *resp = malloc(sizeof(*resp));
        assert_non_null(resp);
        paramsync__v1__status_response__init(resp);
        assert_int_equal(ps__hub_status(f->hub, JOB, resp), 0);
        size_t n = resp->n_collectives;
        protobuf_c_message_free_unpacked(&resp->base, NULL);
        if (n > 0)
            break;
        assert_true(i < 5000);
        usleep(1000);
    }
    ps__hub_drain(f->hub);
    pthread_join(t, NULL);
    assert_stopped(&b);
    free(b.msg);
}

/* SIGTERM while the barrier's job is being looked up (the hub's lock is
 * down meanwhile): the drain has nothing to fail yet, and the barrier must
 * not begin after it. */
static void test_drain_during_lookup(void **state)
{
    fixture_t *f = *state;
    f->hold = 1;
    barrier_t b = {.f = f};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, barrier_main, &b), 0);
    pthread_mutex_lock(&f->lock);
    while (f->in_lookup == 0)
        pthread_cond_wait(&f->cond, &f->lock);
    pthread_mutex_unlock(&f->lock);
    ps__hub_drain(f->hub);
    pthread_mutex_lock(&f->lock);
    f->go = 1;
    pthread_cond_broadcast(&f->cond);
    pthread_mutex_unlock(&f->lock);
    pthread_join(t, NULL);
    assert_stopped(&b);
    free(b.msg);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_drain_fails_waiting, setup, teardown),
        cmocka_unit_test_setup_teardown(test_drain_during_lookup, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
