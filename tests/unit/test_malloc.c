/* ps__malloc_arenas_init: the daemon's threads share one malloc arena, unless
 * the environment chooses glibc's arenas itself. */
#include <malloc.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "rpc/rpc.h"

#if defined(__SANITIZE_ADDRESS__)
#define PS_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define PS_SANITIZED 1
#endif
#endif

#define NTHREADS 8

#ifndef PS_SANITIZED
static pthread_barrier_t all_hold;
/* Where the threads' allocations go: the compiler may not drop them. */
static void *volatile held[NTHREADS];

/* Allocates while every other thread holds an allocation of its own: by
 * default glibc gives a thread's first allocation an arena of its own (up to
 * 8 a core). */
static void *hold_main(void *arg)
{
    int i = (int)(intptr_t)arg;
    held[i] = malloc(64 << 10);
    pthread_barrier_wait(&all_hold);
    free(held[i]);
    return NULL;
}

/* glibc's arenas in this process, as malloc_info lists them; -1 when they
 * could not be read. No cmocka assertions here: a forked child calls it. */
static int arenas(void)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (!f)
        return -1;
    int rc = malloc_info(0, f);
    fclose(f);
    int n = 0;
    for (const char *s = buf; rc == 0 && (s = strstr(s, "<heap nr=")); s++)
        n++;
    free(buf);
    return rc == 0 ? n : -1;
}

/* Arenas after NTHREADS threads allocated at once (-1: unread); the process
 * exits 3 when a thread cannot start. */
static int arenas_after_threads(void)
{
    pthread_t t[NTHREADS];
    pthread_barrier_init(&all_hold, NULL, NTHREADS);
    for (int i = 0; i < NTHREADS; i++)
        if (pthread_create(&t[i], NULL, hold_main, (void *)(intptr_t)i) != 0)
            _exit(3); /* the others wait at the barrier for ever */
    for (int i = 0; i < NTHREADS; i++)
        pthread_join(t[i], NULL);
    pthread_barrier_destroy(&all_hold);
    return arenas();
}
#endif

/* The test's own environment set glibc's arenas (test_one_arena_...). */
static int env_chose;

static void test_environment_chooses(void **state)
{
    (void)state;
    setenv("MALLOC_ARENA_MAX", "4", 1);
    assert_int_equal(ps__malloc_arenas_init(), 0);
    unsetenv("MALLOC_ARENA_MAX");
    setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=4", 1);
    assert_int_equal(ps__malloc_arenas_init(), 0);
    unsetenv("GLIBC_TUNABLES");
}

static void test_one_arena_for_every_thread(void **state)
{
    (void)state;
#ifdef PS_SANITIZED
    /* ASan's allocator serves malloc (and answers mallopt); glibc's arenas
     * stay unused. */
    printf("SKIPPED: glibc's arenas under ASan\n");
    skip();
#else
    if (env_chose) { /* glibc read it at start-up: no default to compare */
        printf("SKIPPED: MALLOC_ARENA_MAX or GLIBC_TUNABLES set for this test\n");
        skip();
    }
    /* Without it (a child, before the call), threads that allocate at once
     * get arenas of their own: what the count below could show. */
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0)
        _exit(arenas_after_threads() > 1 ? 0 : 1);
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    assert_int_equal(ps__malloc_arenas_init(), 1);
    assert_int_equal(arenas_after_threads(), 1);
#endif
}

int main(void)
{
    env_chose = getenv("MALLOC_ARENA_MAX") || getenv("GLIBC_TUNABLES");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_environment_chooses),
        cmocka_unit_test(test_one_arena_for_every_thread),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
