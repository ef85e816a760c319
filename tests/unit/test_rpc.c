/* Unit tests for server/rpc/rpc.c over a real gRPC server on loopback: handler threads that
 * block on each other, idle ones ending, a client call's deferred headers. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include <grpc/byte_buffer_reader.h>
#include <grpc/status.h>
#include <paramsync/common.h>

#include "loopback.h"
#include "threads.h"
#include "rpc/rpc.h"

/* More calls at once than the server keeps idle threads for (16). */
#define NCALLS 24

typedef struct fixture {
    ps__rpc_server_t *srv;
    ps__rpc_channel_t *ch;
} fixture_t;

/* Handlers of "Meet" wait for each other: every call completes only if the
 * server gives each its own thread while the others block. */
static struct {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int arrived;
} meet = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0};

static grpc_byte_buffer *bb_of(const char *text)
{
    grpc_slice s = grpc_slice_from_copied_string(text);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    return bb;
}

/* The message's bytes as a string in buf; consumes bb. */
static const char *text_of(grpc_byte_buffer *bb, char *buf, size_t len)
{
    grpc_byte_buffer_reader r;
    buf[0] = 0;
    if (bb && grpc_byte_buffer_reader_init(&r, bb)) {
        grpc_slice s = grpc_byte_buffer_reader_readall(&r);
        size_t n = GRPC_SLICE_LENGTH(s) < len - 1 ? GRPC_SLICE_LENGTH(s) : len - 1;
        memcpy(buf, GRPC_SLICE_START_PTR(s), n);
        buf[n] = 0;
        grpc_slice_unref(s);
        grpc_byte_buffer_reader_destroy(&r);
    }
    if (bb)
        grpc_byte_buffer_destroy(bb);
    return buf;
}

/* Sends text on c (with the half-close when last). */
static void send_text(ps__rpc_call_t *c, const char *text, int last)
{
    grpc_byte_buffer *bb = bb_of(text);
    assert_int_equal(last ? ps__rpc_call_send_last(c, bb, 0, NULL) : ps__rpc_call_send(c, bb), 0);
    grpc_byte_buffer_destroy(bb);
}

/* Receives the next message of c and checks that it reads `want`. */
static void expect_text(ps__rpc_call_t *c, const char *want)
{
    grpc_byte_buffer *bb = NULL;
    char buf[256];
    assert_int_equal(ps__rpc_call_recv(c, &bb), 0);
    assert_string_equal(text_of(bb, buf, sizeof(buf)), want);
}

/* The last message of c reads `want` and the call ends OK; frees c. */
static void expect_reply(ps__rpc_call_t *c, const char *want)
{
    expect_text(c, want);
    assert_int_equal(ps__rpc_call_finish(c, NULL), 0);
    ps__rpc_call_destroy(c);
}

static void meet_handler(ps__rpc_call_t *call, void *arg)
{
    (void)arg;
    grpc_byte_buffer *bb = NULL;
    ps__rpc_call_recv(call, &bb);
    if (bb)
        grpc_byte_buffer_destroy(bb);
    pthread_mutex_lock(&meet.lock);
    meet.arrived++;
    pthread_cond_broadcast(&meet.cond);
    struct timespec until = ps__abs_time(CLOCK_REALTIME, 20000);
    while (meet.arrived < NCALLS && pthread_cond_timedwait(&meet.cond, &meet.lock, &until) == 0)
        ;
    int all = meet.arrived >= NCALLS;
    pthread_mutex_unlock(&meet.lock);
    grpc_byte_buffer *reply = bb_of(all ? "met" : "alone");
    ps__rpc_call_send_last(call, reply, all ? GRPC_STATUS_OK : GRPC_STATUS_DEADLINE_EXCEEDED, "");
    grpc_byte_buffer_destroy(reply);
}

/* "First" speaks before the client has sent anything, then echoes. */
static void first_handler(ps__rpc_call_t *call, void *arg)
{
    (void)arg;
    grpc_byte_buffer *hello = bb_of("hello");
    int rc = ps__rpc_call_send(call, hello);
    grpc_byte_buffer_destroy(hello);
    grpc_byte_buffer *bb = NULL;
    if (rc == 0 && ps__rpc_call_recv(call, &bb) == 0 && bb) {
        ps__rpc_call_send_last(call, bb, GRPC_STATUS_OK, "");
        grpc_byte_buffer_destroy(bb);
        return;
    }
    ps__rpc_call_send_status(call, GRPC_STATUS_INVALID_ARGUMENT, "no echo");
}

/* "Md" answers with the metadata the call brought. */
static void md_handler(ps__rpc_call_t *call, void *arg)
{
    (void)arg;
    grpc_byte_buffer *bb = NULL;
    ps__rpc_call_recv(call, &bb);
    char got[64];
    text_of(bb, got, sizeof(got));
    char auth[64] = "-", via[64] = "-", out[256];
    ps__rpc_call_metadata(call, "authorization", auth, sizeof(auth));
    ps__rpc_call_metadata(call, PS_RPC_VIA_METADATA, via, sizeof(via));
    snprintf(out, sizeof(out), "%s|%s|%s", auth, via, got);
    grpc_byte_buffer *reply = bb_of(out);
    ps__rpc_call_send_last(call, reply, GRPC_STATUS_OK, "");
    grpc_byte_buffer_destroy(reply);
}

/* "Ready" takes the first message, finds that nothing more has come yet
 * (ps__rpc_call_recv_ready, which leaves its receive started) and says so,
 * takes the next message by that receive, then waits for the half-close
 * the same way and answers what it saw. With "leave" first it answers at
 * once, its receive still started: freeing the call must end that batch. */
static void ready_handler(ps__rpc_call_t *call, void *arg)
{
    (void)arg;
    grpc_byte_buffer *bb = NULL;
    char got[64], second[64], out[160];
    ps__rpc_call_recv(call, &bb);
    text_of(bb, got, sizeof(got));
    bb = NULL;
    int early = ps__rpc_call_recv_ready(call, &bb);
    if (strcmp(got, "leave") == 0) {
        if (bb)
            grpc_byte_buffer_destroy(bb);
        snprintf(out, sizeof(out), "left %d", early);
    } else {
        grpc_byte_buffer *w = bb_of(early == 1 ? "waiting" : "not waiting");
        ps__rpc_call_send(call, w);
        grpc_byte_buffer_destroy(w);
        if (early == 1)
            ps__rpc_call_recv(call, &bb);
        text_of(bb, second, sizeof(second));
        bb = NULL;
        int end = 1;
        for (int i = 0; i < 500 && end == 1; i++)
            if ((end = ps__rpc_call_recv_ready(call, &bb)) == 1)
                usleep(10000);
        snprintf(out, sizeof(out), "%s|%d|%s", second, end, bb ? "more" : "end");
        if (bb)
            grpc_byte_buffer_destroy(bb);
    }
    grpc_byte_buffer *reply = bb_of(out);
    ps__rpc_call_send_last(call, reply, GRPC_STATUS_OK, "");
    grpc_byte_buffer_destroy(reply);
}

/* "Hold" counts itself in and waits for a message that never comes: the
 * call ends only with the server's shutdown. */
static struct {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int held;
} hold = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0};

static void hold_handler(ps__rpc_call_t *call, void *arg)
{
    (void)arg;
    pthread_mutex_lock(&hold.lock);
    hold.held++;
    pthread_cond_broadcast(&hold.cond);
    pthread_mutex_unlock(&hold.lock);
    grpc_byte_buffer *bb = NULL;
    if (ps__rpc_call_recv(call, &bb) == 0 && bb)
        grpc_byte_buffer_destroy(bb);
    ps__rpc_call_send_status(call, GRPC_STATUS_INTERNAL, "hold: a message came");
}

static int setup(void **state)
{
    fixture_t *f = calloc(1, sizeof(*f));
    assert_non_null(f);
    ps__rpc_acquire();
    assert_int_equal(ps__rpc_server_create(&f->srv), 0);
    assert_int_equal(ps__rpc_server_add_method(f->srv, "/t.T/Meet", meet_handler, NULL), 0);
    assert_int_equal(ps__rpc_server_add_method(f->srv, "/t.T/First", first_handler, NULL), 0);
    assert_int_equal(ps__rpc_server_add_method(f->srv, "/t.T/Md", md_handler, NULL), 0);
    assert_int_equal(ps__rpc_server_add_method(f->srv, "/t.T/Ready", ready_handler, NULL), 0);
    assert_int_equal(ps__rpc_server_add_method(f->srv, "/t.T/Hold", hold_handler, NULL), 0);
    loopback_start(f->srv, &f->ch);
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    fixture_t *f = *state;
    ps__rpc_channel_destroy(f->ch);
    ps__rpc_server_destroy(f->srv);
    ps__rpc_release();
    free(f);
    return 0;
}

typedef struct meeter {
    fixture_t *f;
    int rc;
    char reply[16];
} meeter_t;

static void *meeter_main(void *arg)
{
    meeter_t *m = arg;
    ps__rpc_call_t *c = NULL;
    m->rc = ps__rpc_call_start(m->f->ch, "/t.T/Meet", 30000, &c);
    if (m->rc == 0) {
        grpc_byte_buffer *bb = bb_of("hi");
        ps__rpc_call_send_last(c, bb, 0, NULL);
        grpc_byte_buffer_destroy(bb);
        bb = NULL;
        ps__rpc_call_recv(c, &bb);
        text_of(bb, m->reply, sizeof(m->reply));
        m->rc = ps__rpc_call_finish(c, NULL);
    }
    ps__rpc_call_destroy(c);
    return NULL;
}

/* NCALLS calls at once, each of whose handlers waits for all of them: each
 * must be answered "met". */
static void meet_all(fixture_t *f)
{
    pthread_mutex_lock(&meet.lock);
    meet.arrived = 0;
    pthread_mutex_unlock(&meet.lock);
    meeter_t m[NCALLS];
    pthread_t t[NCALLS];
    for (int i = 0; i < NCALLS; i++) {
        m[i] = (meeter_t){f, -1, ""};
        assert_int_equal(pthread_create(&t[i], NULL, meeter_main, &m[i]), 0);
    }
    for (int i = 0; i < NCALLS; i++) {
        pthread_join(t[i], NULL);
        assert_int_equal(m[i].rc, 0);
        assert_string_equal(m[i].reply, "met");
    }
}

static void test_handlers_blocking_on_each_other_all_run(void **state)
{
    fixture_t *f = *state;
    meet_all(f);
    int idle = 0;
    int threads = ps__rpc_server_threads(f->srv, &idle);
    assert_true(threads > NCALLS); /* one each, and one more waiting for the next call */

    /* Idle handler threads beyond the 16 kept end after 5 s. */
    for (int i = 0; i < 200 && ps__rpc_server_threads(f->srv, &idle) > 16; i++)
        usleep(50000);
    assert_int_equal(ps__rpc_server_threads(f->srv, &idle), 16);
    assert_int_equal(idle, 16);

    /* And calls are still served, by the threads kept. */
    meeter_t one = {f, -1, ""};
    pthread_mutex_lock(&meet.lock);
    meet.arrived = NCALLS - 1;
    pthread_mutex_unlock(&meet.lock);
    meeter_main(&one);
    assert_int_equal(one.rc, 0);
    assert_string_equal(one.reply, "met");
    assert_int_equal(ps__rpc_server_threads(f->srv, &idle), 16);
}

static void test_client_receiving_first_reaches_the_server(void **state)
{
    fixture_t *f = *state;
    ps__rpc_call_t *c = NULL;
    /* The call's headers wait for its first message; one that receives
     * first must still send them, or the server never sees the call. */
    assert_int_equal(ps__rpc_call_start(f->ch, "/t.T/First", 5000, &c), 0);
    expect_text(c, "hello");
    send_text(c, "echo me", 1);
    expect_reply(c, "echo me");
}

static void test_headers_go_with_the_first_message(void **state)
{
    fixture_t *f = *state;
    /* Sent with the message and the half-close in one batch. */
    ps__rpc_call_t *c = NULL;
    assert_int_equal(
        ps__rpc_call_start_auth(f->ch, "/t.T/Md", 5000, "Bearer s3cret", "agent-7", &c), 0);
    send_text(c, "payload", 1);
    expect_reply(c, "Bearer s3cret|agent-7|payload");

    /* With a plain send, then the half-close on its own; no metadata. */
    assert_int_equal(ps__rpc_call_start_auth(f->ch, "/t.T/Md", 5000, NULL, NULL, &c), 0);
    send_text(c, "two", 0);
    assert_int_equal(ps__rpc_call_close_send(c), 0);
    expect_reply(c, "-|-|two");

    /* Only the half-close: the headers go with it. */
    assert_int_equal(ps__rpc_call_start_auth(f->ch, "/t.T/Md", 5000, "Bearer x", NULL, &c), 0);
    assert_int_equal(ps__rpc_call_close_send(c), 0);
    expect_reply(c, "Bearer x|-|");
}

static void test_recv_ready_leaves_its_receive_for_the_next(void **state)
{
    fixture_t *f = *state;
    ps__rpc_call_t *c = NULL;
    /* Nothing more sent yet: 1; the message sent after comes by the same
     * receive; the half-close, sent with it, is seen without waiting. */
    assert_int_equal(ps__rpc_call_start(f->ch, "/t.T/Ready", 5000, &c), 0);
    send_text(c, "a", 0);
    expect_text(c, "waiting");
    send_text(c, "b", 1);
    expect_reply(c, "b|0|end");

    /* Answered with its receive still started (ASan: nothing leaks). */
    assert_int_equal(ps__rpc_call_start(f->ch, "/t.T/Ready", 5000, &c), 0);
    send_text(c, "leave", 0);
    expect_text(c, "left 1");
    assert_int_equal(ps__rpc_call_finish(c, NULL), 0);
    ps__rpc_call_destroy(c);
}

static void test_cancel_before_sending(void **state)
{
    fixture_t *f = *state;
    /* A call cancelled before it sent anything (its headers still held)
     * ends at once with the cancel's status, not at its deadline. */
    ps__rpc_call_t *c = NULL;
    assert_int_equal(ps__rpc_call_start(f->ch, "/t.T/First", 5000, &c), 0);
    char *msg = NULL;
    int64_t t0 = ps__now_ms();
    ps__rpc_call_cancel(c, GRPC_STATUS_CANCELLED, "given up");
    int rc = ps__rpc_call_finish(c, &msg);
    assert_int_equal(rc, -GRPC_STATUS_CANCELLED);
    assert_true(ps__now_ms() - t0 < 4000); /* not the deadline */
    free(msg);
    ps__rpc_call_destroy(c);
}

#define HOLDERS 4

typedef struct holder {
    fixture_t *f;
    int rc;
    char msg[128];
} holder_t;

static void *holder_main(void *arg)
{
    holder_t *h = arg;
    ps__rpc_call_t *c = NULL;
    h->rc = ps__rpc_call_start(h->f->ch, "/t.T/Hold", 10000, &c);
    if (h->rc == 0) {
        grpc_byte_buffer *bb = NULL;
        ps__rpc_call_recv(c, &bb); /* the call reaches the server; nothing comes */
        if (bb)
            grpc_byte_buffer_destroy(bb);
        char *msg = NULL;
        h->rc = ps__rpc_call_finish(c, &msg);
        snprintf(h->msg, sizeof(h->msg), "%s", msg ? msg : "");
        free(msg);
    }
    ps__rpc_call_destroy(c);
    return NULL;
}

static void test_shutdown_tells_calls_in_flight_why(void **state)
{
    (void)state;
    /* Each call in flight hears why it ended, never "Socket closed": the
     * statuses go out before the server's GOAWAY, and the connection is not
     * cut under them. Rounds, since a lost status was a race. */
    for (int round = 0; round < 10; round++) {
        void *f = NULL;
        setup(&f);
        pthread_mutex_lock(&hold.lock);
        hold.held = 0;
        pthread_mutex_unlock(&hold.lock);
        holder_t h[HOLDERS];
        pthread_t t[HOLDERS];
        for (int i = 0; i < HOLDERS; i++) {
            h[i] = (holder_t){f, 0, ""};
            assert_int_equal(pthread_create(&t[i], NULL, holder_main, &h[i]), 0);
        }
        pthread_mutex_lock(&hold.lock);
        struct timespec until = ps__abs_time(CLOCK_REALTIME, 10000);
        while (hold.held < HOLDERS && pthread_cond_timedwait(&hold.cond, &hold.lock, &until) == 0)
            ;
        int held = hold.held;
        pthread_mutex_unlock(&hold.lock);
        assert_int_equal(held, HOLDERS);
        int64_t t0 = ps__now_ms();
        ps__rpc_server_shutdown(((fixture_t *)f)->srv);
        assert_true(ps__now_ms() - t0 < PS_RPC_SHUTDOWN_GRACE_MS + 1000);
        for (int i = 0; i < HOLDERS; i++) {
            pthread_join(t[i], NULL);
            if (h[i].rc != -GRPC_STATUS_UNAVAILABLE || !strstr(h[i].msg, PS_RPC_MSG_SHUTDOWN))
                fail_msg("round %d, call %d: status %d '%s', want UNAVAILABLE '%s'", round, i,
                         -h[i].rc, h[i].msg, PS_RPC_MSG_SHUTDOWN);
        }
        teardown(&f);
    }
}

/* A call on a channel to a port nobody listens on: the channel's subchannel
 * waits to reconnect (up to PS_RPC_RECONNECT_MAX_MS) after the channel is
 * gone, holding a grpc_init of its own. */
static void call_nobody(void)
{
    ps__rpc_channel_t *dead = NULL;
    assert_int_equal(ps__rpc_channel_create("127.0.0.1:1", &dead), 0);
    ps__rpc_call_t *c = NULL;
    assert_int_equal(ps__rpc_call_start(dead, "/t.T/First", 300, &c), 0);
    assert_true(ps__rpc_call_finish(c, NULL) < 0);
    ps__rpc_call_destroy(c);
    ps__rpc_channel_destroy(dead);
}

static void test_shutdown_ends_every_thread(void **state)
{
    (void)state;
    /* The tests before released gRPC; it may still be shutting down. */
    assert_int_equal(ps__rpc_wait_shutdown(5000), 0);
    int before = thread_count();
    assert_true(before >= 1);
    void *f = NULL;
    setup(&f);
    meet_all(f); /* NCALLS handler threads at once */
    int idle = 0;
    assert_true(ps__rpc_server_threads(((fixture_t *)f)->srv, &idle) > NCALLS);
    char names[2048];
    assert_non_null(strstr(thread_names(names, sizeof(names)), "ps-rpc"));
    /* Handler threads are joined, and gRPC's own end with its shutdown;
     * a subchannel waiting to reconnect holds gRPC up past the last release
     * (for under a second: made after the teardown, which can take that
     * long), and the wait sees it through. */
    ps__rpc_acquire();
    teardown(&f);
    call_nobody();
    assert_int_equal(ps__rpc_release(), 0);
    assert_true(grpc_is_initialized());
    assert_int_equal(ps__rpc_wait_shutdown(5000), 0);
    assert_false(grpc_is_initialized());
    assert_int_equal(thread_count_settled(before, 2000), before);
}

/* A process whose gRPC has another user (up before the first acquire): the
 * wait is not for that user's shutdown, and returns at once. */
static void test_shutdown_wait_leaves_another_users_grpc(void **state)
{
    (void)state;
    assert_int_equal(ps__rpc_wait_shutdown(5000), 0);
    assert_false(grpc_is_initialized());
    grpc_init(); /* the other user */
    ps__rpc_acquire();
    ps__rpc_channel_t *ch = NULL;
    assert_int_equal(ps__rpc_channel_create("127.0.0.1:1", &ch), 0);
    ps__rpc_channel_destroy(ch);
    assert_int_equal(ps__rpc_release(), 0);
    int64_t t0 = ps__now_ms();
    assert_int_equal(ps__rpc_wait_shutdown(5000), 0);
    assert_true(ps__now_ms() - t0 < 1000);
    assert_true(grpc_is_initialized());
    grpc_shutdown();
    /* Alone again (once the channel's subchannel has let go: its reconnect
     * wait is at most 1 s), the wait is for gRPC's shutdown once more. */
    for (int i = 0; i < 500 && grpc_is_initialized(); i++)
        usleep(10000);
    assert_false(grpc_is_initialized());
    ps__rpc_acquire();
    assert_int_equal(ps__rpc_release(), 0);
    assert_int_equal(ps__rpc_wait_shutdown(5000), 0);
    assert_false(grpc_is_initialized());
}

/* gRPC still up on this module's account (a subchannel of its own) when it
 * is acquired again, as a worker does that ends its process group and starts
 * another: no other user has it, and the next wait is for its shutdown. */
static void test_acquired_again_while_still_up(void **state)
{
    (void)state;
    assert_int_equal(ps__rpc_wait_shutdown(5000), 0);
    assert_false(grpc_is_initialized());
    ps__rpc_acquire();
    call_nobody();
    assert_int_equal(ps__rpc_release(), 0);
    assert_true(grpc_is_initialized()); /* the subchannel's */
    ps__rpc_acquire();
    assert_int_equal(ps__rpc_release(), 0);
    assert_int_equal(ps__rpc_wait_shutdown(5000), 0);
    assert_false(grpc_is_initialized());
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_handlers_blocking_on_each_other_all_run, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_client_receiving_first_reaches_the_server, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_headers_go_with_the_first_message, setup, teardown),
        cmocka_unit_test_setup_teardown(test_recv_ready_leaves_its_receive_for_the_next, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_cancel_before_sending, setup, teardown),
        cmocka_unit_test(test_shutdown_tells_calls_in_flight_why),
        cmocka_unit_test(test_shutdown_ends_every_thread),
        cmocka_unit_test(test_acquired_again_while_still_up),
        cmocka_unit_test(test_shutdown_wait_leaves_another_users_grpc),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
