/* For unit tests that check every thread a module started has ended. */
#ifndef PS_TEST_THREADS_H
#define PS_TEST_THREADS_H

#include <stdio.h>

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

#endif
