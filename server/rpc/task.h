/* Kept threads: run a function on a thread of the process's pool. */
#ifndef PS_RPC_TASK_H
#define PS_RPC_TASK_H

#include <pthread.h>
#include <stdint.h>

/* Runs fn(arg), its return value unused, on a thread of its own: an idle
 * thread of the pool, or a new one (never a wait for a busy one: tasks may
 * wait on each other). A thread that finished its task waits up to
 * PS_TASK_IDLE_MS for the next before it ends, since starting one costs
 * tens to hundreds of microseconds on a small VM, as much as a small
 * collective. When fn is done is the caller's business (ps__task_start
 * gives a join). 0, or -1 when no thread could be had. */
int ps__task_run(void *(*fn)(void *), void *arg);

/* The pool's threads that wait for a task now (for tests). */
int ps__task_idle(void);

/* Ends the pool's idle threads, and waits up to timeout_ms for those running
 * a task to finish it and end: each is joined, so its exit, with OpenSSL's and
 * gRPC's per-thread clean-up, is over. For a process about to exit, once it
 * starts no more tasks. Returns how many threads are left (0: none). */
int ps__task_quiesce(int64_t timeout_ms);

#define PS_TASK_IDLE_MS 2000

/* A task that can be joined, as pthread_create and pthread_join would; the
 * struct is the caller's (the stack will do) until ps__task_join returns. */
typedef struct ps__task {
    void *(*fn)(void *);
    void *arg;
    int done;
    pthread_mutex_t lock;
    pthread_cond_t cond;
} ps__task_t;

/* Starts fn(arg) as ps__task_run does. 0, or -1 (then t needs no join). */
int ps__task_start(ps__task_t *t, void *(*fn)(void *), void *arg);

/* Waits for a started task's fn to return. */
void ps__task_join(ps__task_t *t);

#endif
