/* Unit tests for server/rpc/task.c: kept threads that never make a task wait for a busy one. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include "rpc/rpc.h"
#include "rpc/task.h"

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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tasks_waiting_on_each_other_all_run),
        cmocka_unit_test(test_join_waits_and_threads_are_kept),
        cmocka_unit_test(test_idle_threads_end),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
