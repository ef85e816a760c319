/* Unit tests for server/health.c over a real gRPC server on loopback: Check, Watch, shutdown. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <time.h>
#include <unistd.h>

#include <grpc/health/v1/health.pb-c.h>
#include <paramsync/common.h>

#include "health.h"
#include "loopback.h"

/* Not in health.h yet (asked for): Watch handlers running. */
int ps__health_watchers(ps__health_t *h);

#define SERVING         GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING
#define NOT_SERVING     GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING
#define SERVICE_UNKNOWN GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVICE_UNKNOWN

typedef struct fixture {
    ps__rpc_server_t *srv;
    ps__health_t *health;
    ps__rpc_channel_t *ch;
} fixture_t;

static int setup(void **state)
{
    fixture_t *f = calloc(1, sizeof(*f));
    assert_non_null(f);
    ps__rpc_acquire();
    assert_int_equal(ps__rpc_server_create(&f->srv), 0);
    assert_int_equal(ps__health_create(f->srv, &f->health), 0);
    loopback_start(f->srv, &f->ch);
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    fixture_t *f = *state;
    ps__rpc_channel_destroy(f->ch);
    ps__health_shutdown(f->health);
    ps__rpc_server_destroy(f->srv);
    ps__health_destroy(f->health);
    ps__rpc_release();
    free(f);
    return 0;
}

/* Check(service): the status, or the negative gRPC code. */
static int check(fixture_t *f, const char *service)
{
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    req.service = (char *)service;
    ProtobufCMessage *resp = NULL;
    char *err = NULL;
    int rc = ps__rpc_unary(f->ch, "/grpc.health.v1.Health/Check", &req.base,
                           &grpc__health__v1__health_check_response__descriptor, &resp, 5000, &err);
    free(err);
    if (rc < 0)
        return rc;
    int status = ((Grpc__Health__V1__HealthCheckResponse *)resp)->status;
    protobuf_c_message_free_unpacked(resp, NULL);
    return status;
}

static ps__rpc_call_t *watch_start(fixture_t *f, const char *service)
{
    ps__rpc_call_t *c = NULL;
    assert_int_equal(ps__rpc_call_start(f->ch, "/grpc.health.v1.Health/Watch", 10000, &c), 0);
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    req.service = (char *)service;
    assert_int_equal(ps__rpc_send_msg(c, &req.base), 0);
    assert_int_equal(ps__rpc_call_close_send(c), 0);
    return c;
}

/* The next status on a Watch stream; -1 at its end. */
static int watch_recv(ps__rpc_call_t *c)
{
    ProtobufCMessage *m = NULL;
    int rc = ps__rpc_recv_msg(c, &grpc__health__v1__health_check_response__descriptor, &m);
    if (rc != 0)
        return -1;
    int status = ((Grpc__Health__V1__HealthCheckResponse *)m)->status;
    protobuf_c_message_free_unpacked(m, NULL);
    return status;
}

/* The next status different from the last one seen on c: the handler
 * repeats the current status every few seconds (health.c H_REPEAT_MS). */
static int last_seen = -2;
static int watch_next(ps__rpc_call_t *c)
{
    int s;
    do
        s = watch_recv(c);
    while (s == last_seen && s != -1);
    last_seen = s;
    return s;
}

static void test_check(void **state)
{
    fixture_t *f = *state;
    /* Every service starts NOT_SERVING; "" (the whole server) exists from the start. */
    assert_int_equal(check(f, ""), NOT_SERVING);
    assert_int_equal(check(f, "paramsync.v1.Worker"), PS_ENOTFOUND);
    ps__health_set(f->health, "", 1);
    ps__health_set(f->health, "paramsync.v1.Worker", 0);
    assert_int_equal(check(f, ""), SERVING);
    assert_int_equal(check(f, "paramsync.v1.Worker"), NOT_SERVING);
    ps__health_set(f->health, "paramsync.v1.Worker", 1);
    assert_int_equal(check(f, "paramsync.v1.Worker"), SERVING);
    assert_int_equal(check(f, "no.such.Service"), PS_ENOTFOUND);
}

static void test_watch_follows_changes_and_shutdown(void **state)
{
    fixture_t *f = *state;
    ps__rpc_call_t *w = watch_start(f, "svc");
    last_seen = -2;
    assert_int_equal(watch_next(w), SERVICE_UNKNOWN);
    ps__health_set(f->health, "svc", 1);
    assert_int_equal(watch_next(w), SERVING);
    ps__health_set(f->health, "svc", 1); /* no change */
    ps__health_set(f->health, "svc", 0);
    assert_int_equal(watch_next(w), NOT_SERVING);
    ps__health_set(f->health, "svc", 1);
    assert_int_equal(watch_next(w), SERVING);

    ps__health_set(f->health, "", 1);
    ps__health_shutdown(f->health);
    /* Draining: NOT_SERVING is sent, then the stream ends with UNAVAILABLE. */
    assert_int_equal(watch_next(w), NOT_SERVING);
    assert_int_equal(watch_next(w), -1);
    char *msg = NULL;
    assert_int_equal(ps__rpc_call_finish(w, &msg), PS_EUNAVAIL);
    assert_non_null(strstr(msg, "shutting down"));
    free(msg);
    ps__rpc_call_destroy(w);
    /* Nothing turns SERVING again while draining. */
    ps__health_set(f->health, "", 1);
    assert_int_equal(check(f, ""), NOT_SERVING);
    assert_int_equal(check(f, "svc"), NOT_SERVING);
    /* A Watch started while draining gets NOT_SERVING and ends at once. */
    w = watch_start(f, "");
    last_seen = -2;
    assert_int_equal(watch_next(w), NOT_SERVING);
    assert_int_equal(watch_next(w), -1);
    assert_int_equal(ps__rpc_call_finish(w, NULL), PS_EUNAVAIL);
    ps__rpc_call_destroy(w);
}

/* A client that goes away frees its Watch handler without any status change. */
static void test_watch_cancel_frees_handler(void **state)
{
    fixture_t *f = *state;
    ps__health_set(f->health, "", 1);
    ps__rpc_call_t *w1 = watch_start(f, "");
    ps__rpc_call_t *w2 = watch_start(f, "");
    assert_int_equal(watch_recv(w1), SERVING);
    assert_int_equal(watch_recv(w2), SERVING);
    last_seen = SERVING;
    assert_int_equal(ps__health_watchers(f->health), 2);
    ps__rpc_call_destroy(w1); /* cancels */
    int64_t until = ps__now_ms() + 10000;
    while (ps__health_watchers(f->health) != 1 && ps__now_ms() < until)
        usleep(20000);
    assert_int_equal(ps__health_watchers(f->health), 1);
    /* The other one still follows changes. */
    ps__health_set(f->health, "", 0);
    assert_int_equal(watch_next(w2), NOT_SERVING);
    ps__rpc_call_destroy(w2);
    until = ps__now_ms() + 10000;
    while (ps__health_watchers(f->health) != 0 && ps__now_ms() < until)
        usleep(20000);
    assert_int_equal(ps__health_watchers(f->health), 0);
}

/* Server shutdown with Watch streams open and no ps__health_shutdown: handlers see the
 * cancellation and return, so the server stops. */
static void test_server_shutdown_ends_watches(void **state)
{
    fixture_t *f = *state;
    ps__health_set(f->health, "", 1);
    ps__rpc_call_t *w = watch_start(f, "");
    assert_int_equal(watch_recv(w), SERVING);
    int64_t t0 = ps__now_ms();
    ps__rpc_server_shutdown(f->srv);
    /* Noticed at the next repeat of the status at the latest (2 s). */
    assert_true(ps__now_ms() - t0 < 4000);
    last_seen = SERVING;
    assert_int_equal(watch_next(w), -1);
    assert_int_equal(ps__rpc_call_finish(w, NULL), PS_EUNAVAIL);
    ps__rpc_call_destroy(w);
    assert_int_equal(ps__health_watchers(f->health), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_check, setup, teardown),
        cmocka_unit_test_setup_teardown(test_watch_follows_changes_and_shutdown, setup, teardown),
        cmocka_unit_test_setup_teardown(test_watch_cancel_frees_handler, setup, teardown),
        cmocka_unit_test_setup_teardown(test_server_shutdown_ends_watches, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
