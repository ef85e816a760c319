/* The names of this process's threads, as the kernel keeps them: gRPC names
 * its own ("event_engine"), the library names its ("ps-..."). Header-only, so
 * that the tests, which see only the library's public symbols, read them the
 * same way. */
#ifndef PS_RPC_THREAD_NAMES_H
#define PS_RPC_THREAD_NAMES_H

#include <dirent.h>
#include <stdio.h>
#include <string.h>

/* fn(name, arg) for each thread of this process (its comm: 15 characters at
 * most), in /proc/self/task's order; a thread that ends meanwhile may be
 * left out. */
static inline void ps__each_thread_name(void (*fn)(const char *name, void *arg), void *arg)
{
    DIR *d = opendir("/proc/self/task");
    for (struct dirent *e; d && (e = readdir(d));) {
        if (e->d_name[0] == '.')
            continue;
        char path[64], name[32] = "";
        snprintf(path, sizeof(path), "/proc/self/task/%.16s/comm", e->d_name);
        FILE *f = fopen(path, "r");
        if (!f)
            continue; /* gone meanwhile */
        if (fgets(name, sizeof(name), f)) {
            name[strcspn(name, "\n")] = '\0';
            fn(name, arg);
        }
        fclose(f);
    }
    if (d)
        closedir(d);
}

#endif
