/* Non-blocking operations (torch's async_op=True): one thread per operation in flight. */
#include "internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct ps_work {
    ps__coll_t coll;
    pthread_mutex_t lock;
    pthread_cond_t done_cond;
    int done;
    int result;
    struct ps_work *next; /* in the pool's queue */
};

/*
 * Each operation in flight has a thread of its own: operations may wait on
 * each other across ranks (an irecv for a peer's send that another thread
 * here has yet to make), so none may wait for a free thread. Threads are
 * kept, though: one that finished its operation waits up to
 * PS__WORK_IDLE_MS for the next before it exits, since starting a thread
 * costs tens to hundreds of microseconds here, as much as a small
 * collective through the doorbell. One pool for the process (no comm owns
 * a thread, so ps_finalize has none to wait for).
 */
#define PS__WORK_IDLE_MS 2000

static struct {
    pthread_mutex_t lock;
    pthread_cond_t more; /* queue not empty */
    ps_work_t *head, *tail;
    int idle; /* threads waiting for an operation, none promised one yet */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, NULL, 0};

static void work_run(ps_work_t *w)
{
    int rc = ps__coll_run(&w->coll);
    pthread_mutex_lock(&w->lock);
    w->result = rc;
    w->done = 1;
    pthread_cond_broadcast(&w->done_cond);
    pthread_mutex_unlock(&w->lock);
}

static void *work_main(void *arg)
{
    ps_work_t *w = arg;
    for (;;) {
        work_run(w);
        pthread_mutex_lock(&pool.lock);
        pool.idle++;
        struct timespec until = ps__abs_time(CLOCK_REALTIME, PS__WORK_IDLE_MS);
        int rc = 0;
        while (!pool.head && rc != ETIMEDOUT)
            rc = pthread_cond_timedwait(&pool.more, &pool.lock, &until);
        /* An operation queued was promised to an idle thread (work_dispatch
         * took one off idle): take it even when the wait just timed out. */
        w = pool.head;
        if (w) {
            pool.head = w->next;
            if (!pool.head)
                pool.tail = NULL;
        } else {
            pool.idle--;
        }
        pthread_mutex_unlock(&pool.lock);
        if (!w)
            return NULL;
    }
}

/* A child of fork() has none of the parent's threads: no idle ones. */
static void pool_after_fork(void)
{
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.more, NULL);
    pool.head = pool.tail = NULL;
    pool.idle = 0;
}

static void pool_init(void)
{
    pthread_atfork(NULL, NULL, pool_after_fork);
}

/* Hands w to an idle thread, or to a new one. 0, or -1. */
static int work_dispatch(ps_work_t *w)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, pool_init);
    pthread_mutex_lock(&pool.lock);
    if (pool.idle > 0) {
        pool.idle--; /* promised: that thread takes an operation from the queue */
        w->next = NULL;
        if (pool.tail)
            pool.tail->next = w;
        else
            pool.head = w;
        pool.tail = w;
        pthread_cond_signal(&pool.more);
        pthread_mutex_unlock(&pool.lock);
        return 0;
    }
    pthread_mutex_unlock(&pool.lock);
    pthread_attr_t attr;
    pthread_t t;
    if (pthread_attr_init(&attr) != 0)
        return -1;
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&t, &attr, work_main, w);
    pthread_attr_destroy(&attr);
    return rc == 0 ? 0 : -1;
}

int ps__work_start(const ps__coll_t *coll, ps_work_t **out)
{
    ps_work_t *w = calloc(1, sizeof(*w));
    if (!w)
        return PS_ENOMEM;
    w->coll = *coll;
    if (ps__coll_init(&w->coll) < 0)
        goto fail_coll;
    if (pthread_mutex_init(&w->lock, NULL) != 0)
        goto fail_lock;
    if (pthread_cond_init(&w->done_cond, NULL) != 0)
        goto fail_cond;
    /* comm->lock is held: linking here keeps ps_finalize from freeing the
     * comm before the thread is done with it. */
    ps__inflight_link(coll->comm, &w->coll);
    if (work_dispatch(w) != 0) {
        ps__inflight_unlink(coll->comm, &w->coll);
        goto fail_thread;
    }
    *out = w;
    return 0;

fail_thread:
    pthread_cond_destroy(&w->done_cond);
fail_cond:
    pthread_mutex_destroy(&w->lock);
fail_lock:
    ps__coll_destroy(&w->coll);
fail_coll:
    free(w);
    return PS_ENOMEM;
}

int ps_work_wait(ps_work_t *work)
{
    if (!work)
        return PS_EINVAL;
    pthread_mutex_lock(&work->lock);
    while (!work->done)
        pthread_cond_wait(&work->done_cond, &work->lock);
    int rc = work->result;
    pthread_mutex_unlock(&work->lock);
    return rc;
}

int ps_work_test(ps_work_t *work, int *done)
{
    if (!work || !done)
        return PS_EINVAL;
    pthread_mutex_lock(&work->lock);
    *done = work->done;
    pthread_mutex_unlock(&work->lock);
    return 0;
}

int ps_work_source(const ps_work_t *work)
{
    if (!work)
        return -1;
    ps_work_t *w = (ps_work_t *)work; /* the lock is not part of the value */
    pthread_mutex_lock(&w->lock);
    int src = w->done && w->result == 0 && w->coll.hdr.kind == PARAMSYNC__V1__COLLECTIVE_KIND__RECV
                  ? w->coll.source
                  : -1;
    pthread_mutex_unlock(&w->lock);
    return src;
}

void ps_work_free(ps_work_t *work)
{
    if (!work)
        return;
    ps_work_wait(work);
    pthread_cond_destroy(&work->done_cond);
    pthread_mutex_destroy(&work->lock);
    ps__coll_destroy(&work->coll);
    free(work);
}
