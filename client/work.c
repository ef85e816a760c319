/* Non-blocking operations (torch's async_op=True): a kept thread per operation in flight. */
#include "internal.h"
#include "task.h"

#include <stdlib.h>

struct ps_work {
    ps__coll_t coll;
    pthread_mutex_t lock;
    pthread_cond_t done_cond;
    int done;
    int result;
};

/*
 * Each operation in flight has a thread of its own: operations may wait on
 * each other across ranks (an irecv for a peer's send that another thread
 * here has yet to make), so none may wait for a free thread. The threads
 * are the process's kept ones (rpc/task.h): one that finished its operation
 * waits a while for the next, since starting a thread costs as much as a
 * small collective through the doorbell. No comm owns a thread, so
 * ps_finalize has none to wait for.
 */
static void *work_run(void *arg)
{
    ps_work_t *w = arg;
    int rc = ps__coll_run(&w->coll);
    pthread_mutex_lock(&w->lock);
    w->result = rc;
    w->done = 1;
    pthread_cond_broadcast(&w->done_cond);
    pthread_mutex_unlock(&w->lock);
    return NULL;
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
    if (ps__task_run(work_run, w) != 0) {
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
