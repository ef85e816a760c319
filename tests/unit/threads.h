/* For unit tests that check every thread a module started has ended. */
#ifndef PS_TEST_THREADS_H
#define PS_TEST_THREADS_H

#include <stdio.h>
#include <time.h>

#include "../../server/rpc/thread_names.h"

/* The threads of this process ("Threads:" of /proc/self/status); 0 when
 * it cannot be read. */
static inline int thread_count(void)
{
    int n = 0;
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    while (f && fgets(line, sizeof(line), f))
        if (sscanf(line, "Threads: %d", &n) == 1)
            break;
    if (f)
        fclose(f);
    return n;
}

/* The threads of this process once they are want again, or after ms: what
 * a test that checks no thread is left compares. A thread that was joined
 * may still be counted a moment: pthread_join returns when the kernel clears
 * the thread's id, early in its exit, before the thread leaves the process
 * (a busy machine can preempt it in between). One left running stays. */
static inline int thread_count_settled(int want, int ms)
{
    int n = thread_count();
    for (int i = 0; n != want && i < ms; i++) {
        struct timespec one = {0, 1000000};
        nanosleep(&one, NULL);
        n = thread_count();
    }
    return n;
}

typedef struct {
    char *buf;
    size_t size, used;
} thread_names_t;

static inline void add_thread_name(const char *name, void *arg)
{
    thread_names_t *t = arg;
    int n = snprintf(t->buf + t->used, t->size - t->used, "%s%s", t->used ? " " : "", name);
    if (n > 0 && (size_t)n < t->size - t->used)
        t->used += (size_t)n;
}

/* The names of this process's threads, space-separated, into buf: what a test
 * that finds one too many prints. */
static inline const char *thread_names(char *buf, size_t size)
{
    thread_names_t t = {buf, size, 0};
    buf[0] = '\0';
    ps__each_thread_name(add_thread_name, &t);
    return buf;
}

#endif
