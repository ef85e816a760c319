/* Kept threads (task.h). */
#include "task.h"
#include "rpc.h"

#include <errno.h>
#include <stdlib.h>
#include <time.h>

typedef struct item {
    void *(*fn)(void *);
    void *arg;
    struct item *next;
} item_t;

static struct {
    pthread_mutex_t lock;
    pthread_cond_t more;  /* queue not empty, or quit */
    pthread_cond_t ended; /* a thread ended */
    item_t *head, *tail;
    int idle;           /* threads waiting for a task, none promised one yet */
    int threads;        /* threads not yet ended */
    int quit;           /* ps__task_quiesce: idle threads end now */
    ps__thread_t *gone; /* ended, to be joined */
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER,
          .more = PTHREAD_COND_INITIALIZER,
          .ended = PTHREAD_COND_INITIALIZER};

static void *pool_main(void *arg)
{
    ps__thread_t *self = arg, *before = NULL;
    item_t *it = self->arg; /* its first task */
    for (;;) {
        void *(*fn)(void *) = it->fn;
        void *fa = it->arg;
        free(it);
        fn(fa);
        pthread_mutex_lock(&pool.lock);
        pool.idle++;
        struct timespec until = ps__abs_time(CLOCK_REALTIME, PS_TASK_IDLE_MS);
        int rc = 0;
        while (!pool.head && rc != ETIMEDOUT && !pool.quit)
            rc = pthread_cond_timedwait(&pool.more, &pool.lock, &until);
        /* A task queued was promised to an idle thread (ps__task_run took
         * idle down for it): take it even when the wait timed out. */
        it = pool.head;
        if (it) {
            pool.head = it->next;
            if (!pool.head)
                pool.tail = NULL;
        } else {
            pool.idle--;
            /* Ends: the thread's exit (OpenSSL's and gRPC's per-thread
             * clean-up among it) is over once it is joined. */
            pool.threads--;
            before = ps__thread_ended(&pool.gone, self);
            pthread_cond_broadcast(&pool.ended);
        }
        pthread_mutex_unlock(&pool.lock);
        if (!it) {
            ps__thread_reap(&before);
            return NULL;
        }
    }
}

/* A child of fork() has none of the parent's threads: no idle ones. */
static void pool_after_fork(void)
{
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.more, NULL);
    pthread_cond_init(&pool.ended, NULL);
    pool.head = pool.tail = NULL;
    pool.idle = pool.threads = pool.quit = 0;
    pool.gone = NULL;
}

static void pool_init(void)
{
    pthread_atfork(NULL, NULL, pool_after_fork);
}

int ps__task_run(void *(*fn)(void *), void *arg)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, pool_init);
    item_t *it = malloc(sizeof(*it));
    if (!it)
        return -1;
    it->fn = fn;
    it->arg = arg;
    it->next = NULL;
    pthread_mutex_lock(&pool.lock);
    if (pool.idle > 0) {
        pool.idle--; /* promised: that thread takes a task from the queue */
        if (pool.tail)
            pool.tail->next = it;
        else
            pool.head = it;
        pool.tail = it;
        pthread_cond_signal(&pool.more);
        pthread_mutex_unlock(&pool.lock);
        return 0;
    }
    int started = ps__thread_start("ps-task", pool_main, it) != NULL;
    pool.threads += started;
    pthread_mutex_unlock(&pool.lock);
    if (!started)
        free(it);
    return started ? 0 : -1;
}

int ps__task_quiesce(int64_t timeout_ms)
{
    struct timespec until = ps__abs_time(CLOCK_REALTIME, timeout_ms);
    int rc = 0;
    pthread_mutex_lock(&pool.lock);
    pool.quit = 1;
    pthread_cond_broadcast(&pool.more);
    while (pool.threads > 0 && rc != ETIMEDOUT)
        rc = pthread_cond_timedwait(&pool.ended, &pool.lock, &until);
    ps__thread_reap(&pool.gone);
    int left = pool.threads;
    pool.quit = 0;
    pthread_mutex_unlock(&pool.lock);
    return left;
}

int ps__task_idle(void)
{
    pthread_mutex_lock(&pool.lock);
    int n = pool.idle;
    pthread_mutex_unlock(&pool.lock);
    return n;
}

static void *task_main(void *arg)
{
    ps__task_t *t = arg;
    t->fn(t->arg);
    pthread_mutex_lock(&t->lock);
    t->done = 1;
    pthread_cond_signal(&t->cond);
    pthread_mutex_unlock(&t->lock);
    return NULL;
}

int ps__task_start(ps__task_t *t, void *(*fn)(void *), void *arg)
{
    t->fn = fn;
    t->arg = arg;
    t->done = 0;
    if (pthread_mutex_init(&t->lock, NULL) != 0)
        return -1;
    if (pthread_cond_init(&t->cond, NULL) != 0) {
        pthread_mutex_destroy(&t->lock);
        return -1;
    }
    if (ps__task_run(task_main, t) != 0) {
        pthread_cond_destroy(&t->cond);
        pthread_mutex_destroy(&t->lock);
        return -1;
    }
    return 0;
}

void ps__task_join(ps__task_t *t)
{
    pthread_mutex_lock(&t->lock);
    while (!t->done)
        pthread_cond_wait(&t->cond, &t->lock);
    pthread_mutex_unlock(&t->lock);
    pthread_cond_destroy(&t->cond);
    pthread_mutex_destroy(&t->lock);
}
