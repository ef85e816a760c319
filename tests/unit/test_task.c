/* Unit tests for server/rpc/task.c: kept threads that never make a task wait for a busy one. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <pthread.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>

#include "rpc/rpc.h"
#include "rpc/task.h"
#include "threads.h"

#define NTASKS 24

/* Tasks that each wait for all the others: they only finish if every one
 * has a thread at once. */
typedef struct meet {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int arrived, done;
    pthread_t who[NTASKS];
} meet_t;

static meet_t meet = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, {0}};

static void *meet_main(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&meet.lock);
    meet.who[meet.arrived++] = pthread_self();
    pthread_cond_broadcast(&meet.cond);
    struct timespec until = ps__abs_time(CLOCK_REALTIME, 20000);
    while (meet.arrived < NTASKS && pthread_cond_timedwait(&meet.cond, &meet.lock, &until) == 0)
        ;
    meet.done++;
    pthread_cond_broadcast(&meet.cond);
    pthread_mutex_unlock(&meet.lock);
    return NULL;
}

/* Waits until n tasks of the meeting are done (20 s at most). */
static int meet_wait_done(int n)
{
    pthread_mutex_lock(&meet.lock);
    struct timespec until = ps__abs_time(CLOCK_REALTIME, 20000);
    while (meet.done < n && pthread_cond_timedwait(&meet.cond, &meet.lock, &until) == 0)
        ;
    int done = meet.done;
    pthread_mutex_unlock(&meet.lock);
    return done;
}

static void test_tasks_waiting_on_each_other_all_run(void **state)
{
    (void)state;
    for (int i = 0; i < NTASKS; i++)
        assert_int_equal(ps__task_run(meet_main, NULL), 0);
    assert_int_equal(meet_wait_done(NTASKS), NTASKS);
    assert_int_equal(meet.arrived, NTASKS);
    for (int i = 0; i < NTASKS; i++)
        for (int k = i + 1; k < NTASKS; k++)
            assert_false(pthread_equal(meet.who[i], meet.who[k]));
}

static void *self_main(void *arg)
{
    *(pthread_t *)arg = pthread_self();
    usleep(20000); /* the joiner really waits */
    return NULL;
}

static void test_join_waits_and_threads_are_kept(void **state)
{
    (void)state;
    /* The threads of the test before are idle now (up to PS_TASK_IDLE_MS). */
    for (int i = 0; i < 100 && ps__task_idle() < NTASKS; i++)
        usleep(10000);
    int idle = ps__task_idle();
    assert_true(idle >= 1);
    pthread_t ran = pthread_self();
    ps__task_t t;
    assert_int_equal(ps__task_start(&t, self_main, &ran), 0);
    ps__task_join(&t);
    assert_false(pthread_equal(ran, pthread_self()));
    int kept = 0;
    for (int i = 0; i < NTASKS; i++)
        kept |= pthread_equal(ran, meet.who[i]);
    assert_true(kept); /* an idle thread took it: none was started */
}

static void test_idle_threads_end(void **state)
{
    (void)state;
    /* Every idle thread ends PS_TASK_IDLE_MS after its last task. */
    for (int i = 0; i < (PS_TASK_IDLE_MS + 3000) / 50 && ps__task_idle() > 0; i++)
        usleep(50000);
    assert_int_equal(ps__task_idle(), 0);
    /* And a task still gets a (new) thread. */
    pthread_t ran = pthread_self();
    ps__task_t t;
    assert_int_equal(ps__task_start(&t, self_main, &ran), 0);
    ps__task_join(&t);
    assert_false(pthread_equal(ran, pthread_self()));
}

static int gate_open;
static pthread_mutex_t gate_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_cond = PTHREAD_COND_INITIALIZER;

/* Waits until the gate opens (20 s at most). */
static void *gate_main(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&gate_lock);
    struct timespec until = ps__abs_time(CLOCK_REALTIME, 20000);
    while (!gate_open && pthread_cond_timedwait(&gate_cond, &gate_lock, &until) == 0)
        ;
    pthread_mutex_unlock(&gate_lock);
    return NULL;
}

static void *nap_main(void *arg)
{
    (void)arg;
    usleep(30000);
    return NULL;
}

static void test_quiesce_joins_every_thread(void **state)
{
    (void)state;
    /* The thread of the test before is idle now. */
    assert_int_equal(ps__task_quiesce(5000), 0);
    int before = thread_count();
    assert_true(before >= 1);
    /* Idle threads and threads still running a task: each ends and is joined. */
    for (int i = 0; i < 8; i++)
        assert_int_equal(ps__task_run(nap_main, NULL), 0);
    usleep(100000);
    for (int i = 0; i < 4; i++)
        assert_int_equal(ps__task_run(nap_main, NULL), 0);
    assert_true(thread_count() > before);
    /* The pool's threads say whose they are. */
    char names[1024];
    assert_non_null(strstr(thread_names(names, sizeof(names)), "ps-task"));
    assert_int_equal(ps__task_quiesce(5000), 0);
    assert_int_equal(ps__task_idle(), 0);
    assert_int_equal(thread_count_settled(before, 2000), before);

    /* A task that does not end in time is left running, and counted. */
    assert_int_equal(ps__task_run(gate_main, NULL), 0);
    assert_int_equal(ps__task_quiesce(100), 1);
    pthread_mutex_lock(&gate_lock);
    gate_open = 1;
    pthread_cond_broadcast(&gate_cond);
    pthread_mutex_unlock(&gate_lock);
    assert_int_equal(ps__task_quiesce(5000), 0);
    assert_int_equal(thread_count_settled(before, 2000), before);

    /* The pool still runs tasks afterwards. */
    pthread_t ran = pthread_self();
    ps__task_t t;
    assert_int_equal(ps__task_start(&t, self_main, &ran), 0);
    ps__task_join(&t);
    assert_false(pthread_equal(ran, pthread_self()));
    assert_int_equal(ps__task_quiesce(5000), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tasks_waiting_on_each_other_all_run),
        cmocka_unit_test(test_join_waits_and_threads_are_kept),
        cmocka_unit_test(test_idle_threads_end),
        cmocka_unit_test(test_quiesce_joins_every_thread),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
