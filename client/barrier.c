/*
 * Direct barriers: the ranks of a group that all joined through one agent, in
 * one PID namespace, with clients that do this (JoinEvent.barrier_sets), meet
 * at a barrier in a page of shared memory they all map, without the agent.
 * Through the agent a barrier costs a wake-up of the agent's thread for each
 * rank and one more for each rank's answer; here the last rank to arrive
 * wakes the others and goes on (docs/ARCHITECTURE.md, "Direct barriers").
 *
 * Every rank decides alike, from the barrier sets and the group, before it
 * takes the call's sequence number, whether a barrier may meet directly; such
 * barriers are counted per group (bar_k). The first two set the page up and
 * are barriers through the agent all the same:
 *   1. group rank 0 makes the page (a POSIX segment) and the ranks
 *      all_gather its name (as the barrier's call); each other rank maps it;
 *   2. the ranks all_reduce (MIN) whether they mapped it (as that barrier's
 *      call); rank 0 unlinks the name. All of them mapped it: every later
 *      barrier of the group meets on the page; else all go through the agent.
 * A later barrier waits here for the second's outcome, so that the ranks
 * agree even where barriers are started without waiting (ps_ibarrier).
 *
 * On the page, arrived[i] is one more than the sequence number of the last
 * direct barrier group rank i has called (raised, never lowered: a later
 * barrier's arrival implies the earlier's; numbered by sequence number, not
 * by count, so that a rank that called something else where the others
 * called a barrier is in step again at the next barrier), and gen the same of
 * the last one met. A rank raises its word, then reads the others'
 * (sequentially consistent, so of two ranks arriving at once at least one
 * sees the other); the one that finds all there raises gen and wakes the
 * waiters, which sleep on gen (a futex) in slices between which they look at
 * the job (a lost member breaks it: its Join stream says so) and at the
 * deadline.
 *
 * other[i] is one more than the sequence number of the last collective group
 * rank i started other than a direct barrier, written as it takes the number
 * (for a peer copy, which holds three, its first: the all_gather of its
 * addresses through the agent). A rank whose other[] word is m called
 * something else where the others called direct barrier m: a waiter that
 * sees it wakes the rest and takes the barrier to the agent under its
 * number, where the hub compares it with that call and fails both sides at
 * once (FAILED_PRECONDITION "rank 0 called barrier but rank 2 called
 * all_reduce") instead of at their deadline. Such a rank does not count as
 * arrived at m, even once a later barrier raised its arrival word.
 */
#include "internal.h"
#include "paramsync/v1/doorbell.h" /* ps_doorbell_futex */

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define BAR_PAGE  4096u
#define BAR_NAME  64 /* bytes of the name each rank contributes in step 1 */
#define BAR_SLICE 50 /* ms between looks at the job while waiting */

#define BAR_MAX_RANKS 504 /* (BAR_PAGE - 64) / 8: two words a rank */

struct ps__bar_page {
    uint32_t gen; /* futex: the direct barriers met */
    uint32_t pad[15];
    uint32_t arrived[BAR_MAX_RANKS]; /* by group rank: its last direct barrier's number + 1 */
    uint32_t other[BAR_MAX_RANKS];   /* by group rank: its last other call's number + 1 */
};

_Static_assert(sizeof(struct ps__bar_page) == BAR_PAGE, "the page's layout");

/* What a direct barrier's waiter found. */
enum { BAR_PENDING, BAR_MET, BAR_MISMATCH };

int ps__bar_wanted(void)
{
    const char *v = getenv("PARAMSYNC_DIRECT_BARRIER");
    return !(v && strcmp(v, "0") == 0) && !ps__shm_off();
}

int ps__bar_takes(const ps__coll_t *c)
{
    const ps_comm_t *comm = c->comm;
    const ps_group_t *g = c->group;
    return c->hdr.kind == PARAMSYNC__V1__COLLECTIVE_KIND__BARRIER && comm->barrier_sets &&
           g->rank >= 0 && (size_t)g->size <= BAR_MAX_RANKS &&
           ps__group_shares_set(comm, g, comm->barrier_sets);
}

/* Marks setup step `step` ended here and wakes whoever waits for it. */
static void setup_ended(ps_comm_t *comm, ps_group_t *g, int step)
{
    pthread_mutex_lock(&comm->lock);
    g->bar_setup = step;
    pthread_cond_broadcast(&comm->cond);
    pthread_mutex_unlock(&comm->lock);
}

static void setup_wait(ps_comm_t *comm, ps_group_t *g, int step)
{
    pthread_mutex_lock(&comm->lock);
    while (g->bar_setup < step)
        pthread_cond_wait(&comm->cond, &comm->lock);
    pthread_mutex_unlock(&comm->lock);
}

static struct ps__bar_page *page_map(int fd)
{
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_size != (off_t)BAR_PAGE)
        return NULL;
    void *p = mmap(NULL, BAR_PAGE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    return p == MAP_FAILED ? NULL : p;
}

/* Step 1: rank 0 makes the page, every rank learns its name, the others map it. */
static int setup_map(ps__coll_t *c)
{
    ps_comm_t *comm = c->comm;
    ps_group_t *g = c->group;
    char mine[BAR_NAME];
    memset(mine, 0, sizeof(mine));
    if (g->rank == 0) {
        static unsigned counter;
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        snprintf(g->bar_name, sizeof(g->bar_name), "/paramsync.%d.bar.%u.%lx", (int)getpid(),
                 __atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED), (long)(ts.tv_nsec & 0xffffff));
        int fd = shm_open(g->bar_name, O_RDWR | O_CREAT | O_EXCL, 0600);
        if (fd >= 0) {
            if (ftruncate(fd, BAR_PAGE) == 0)
                g->bar_page = page_map(fd);
            close(fd);
            if (!g->bar_page)
                shm_unlink(g->bar_name);
        }
        if (g->bar_page)
            memcpy(mine, g->bar_name, strlen(g->bar_name));
        else
            g->bar_name[0] = 0;
    }
    char *all = calloc((size_t)g->size, BAR_NAME);
    int rc = all ? ps__coll_sub(c, c->name, PARAMSYNC__V1__COLLECTIVE_KIND__ALL_GATHER, PS_SUM,
                                PS_UINT8, BAR_NAME, mine, all, c->hdr.seq)
                 : PS_ENOMEM;
    if (rc == PS_ENOMEM && !all)
        ps__report(comm, rc, c->name, "out of memory");
    /* Only a name such as rank 0 makes, whole. */
    if (rc == 0 && g->rank != 0 && strncmp(all, "/paramsync.", 11) == 0 &&
        memchr(all, 0, BAR_NAME)) {
        int fd = shm_open(all, O_RDWR, 0);
        if (fd >= 0) {
            g->bar_page = page_map(fd);
            close(fd);
        }
    }
    free(all);
    setup_ended(comm, g, 1);
    return rc;
}

/* Step 2: the ranks agree whether all of them mapped the page. */
static int setup_agree(ps__coll_t *c)
{
    ps_comm_t *comm = c->comm;
    ps_group_t *g = c->group;
    setup_wait(comm, g, 1);
    int32_t ok = g->bar_page != NULL;
    int rc = ps__coll_sub(c, c->name, PARAMSYNC__V1__COLLECTIVE_KIND__ALL_REDUCE, PS_MIN, PS_INT32,
                          1, &ok, &ok, c->hdr.seq);
    if (g->bar_name[0]) {
        /* Every rank tried to open it before it came to this step. */
        shm_unlink(g->bar_name);
        g->bar_name[0] = 0;
    }
    if ((rc != 0 || ok != 1) && g->bar_page) {
        munmap(g->bar_page, BAR_PAGE);
        g->bar_page = NULL; /* through the agent for good */
    }
    setup_ended(comm, g, 2);
    return rc;
}

/* Raises *w to at least v. */
static void raise_to(uint32_t *w, uint32_t v)
{
    uint32_t cur = __atomic_load_n(w, __ATOMIC_SEQ_CST);
    while ((int32_t)(cur - v) < 0 &&
           !__atomic_compare_exchange_n(w, &cur, v, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
        ;
}

/* Whether group rank i has called direct barrier m: its arrival word is
 * there, and its call under m's number was not another collective. */
static int has_arrived(const struct ps__bar_page *p, int i, uint32_t m)
{
    return (int32_t)(__atomic_load_n(&p->arrived[i], __ATOMIC_SEQ_CST) - m) >= 0 &&
           __atomic_load_n(&p->other[i], __ATOMIC_SEQ_CST) != m;
}

void ps__bar_started(const ps__coll_t *c)
{
    const ps_group_t *g = c->group;
    /* Only this rank writes its word, under comm->lock, in the order it
     * takes the numbers: a store, as the Python and Node.js clients do. */
    if (g->bar_setup >= 2 && g->bar_page && !c->bar_k &&
        c->hdr.kind != PARAMSYNC__V1__COLLECTIVE_KIND__SEND &&
        c->hdr.kind != PARAMSYNC__V1__COLLECTIVE_KIND__RECV)
        __atomic_store_n(&g->bar_page->other[g->rank], (uint32_t)c->hdr.seq + 1, __ATOMIC_SEQ_CST);
}

/* The job ranks of g that have not called direct barrier m, as "1, 3". */
static void missing_ranks(const ps_group_t *g, const struct ps__bar_page *p, uint32_t m, char *buf,
                          size_t len, int *count)
{
    size_t at = 0;
    *count = 0;
    buf[0] = 0;
    for (int i = 0; i < g->size; i++) {
        if (has_arrived(p, i, m))
            continue;
        int r = g->ranks ? g->ranks[i] : i;
        int n = snprintf(buf + at, at < len ? len - at : 0, "%s%d", *count ? ", " : "", r);
        at += n > 0 ? (size_t)n : 0;
        ++*count;
    }
    if (at >= len && len > 4)
        memcpy(buf + len - 4, "...", 4);
}

/* Whether all n ranks have called direct barrier m (BAR_MET), one called
 * another collective under its number (BAR_MISMATCH), or neither yet. */
static int arrivals(const struct ps__bar_page *p, int n, uint32_t m)
{
    int all = 1;
    for (int i = 0; i < n; i++) {
        if (__atomic_load_n(&p->other[i], __ATOMIC_SEQ_CST) == m)
            return BAR_MISMATCH;
        if ((int32_t)(__atomic_load_n(&p->arrived[i], __ATOMIC_SEQ_CST) - m) < 0)
            all = 0;
    }
    return all ? BAR_MET : BAR_PENDING;
}

/* Direct barrier m (its sequence number + 1) of c's group: 0, an error, or
 * BAR_MISMATCH (a rank called another collective under its number: the
 * barrier is to go to the agent). The arrivals, not gen, say it is met: gen
 * only wakes (the Python client, without an atomic maximum, may lower it for
 * a moment). */
static int meet(ps__coll_t *c, uint32_t m)
{
    ps_comm_t *comm = c->comm;
    ps_group_t *g = c->group;
    struct ps__bar_page *p = g->bar_page;
    raise_to(&p->arrived[g->rank], m);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    int got = arrivals(p, g->size, m);
    if (got == BAR_MET)
        raise_to(&p->gen, m);
    if (got != BAR_PENDING) {
        ps_doorbell_futex(&p->gen, FUTEX_WAKE, INT32_MAX, NULL);
        return got == BAR_MET ? 0 : BAR_MISMATCH;
    }
    int64_t timeout = c->hdr.timeout_ms; /* the comm's, as every call's header has */
    int64_t end = ps__now_ms() + timeout;
    char *msg = NULL;
    int rc = 0;
    for (;;) {
        uint32_t seen = __atomic_load_n(&p->gen, __ATOMIC_SEQ_CST);
        got = arrivals(p, g->size, m);
        if (got == BAR_MISMATCH) {
            /* The others waiting see it now, not a slice later. */
            ps_doorbell_futex(&p->gen, FUTEX_WAKE, INT32_MAX, NULL);
            return BAR_MISMATCH;
        }
        if ((int32_t)(seen - m) >= 0 || got == BAR_MET)
            break;
        if ((rc = ps__comm_over(comm, &msg)) != 0)
            break;
        int64_t left = end - ps__now_ms();
        if (left <= 0) {
            char who[256];
            int n;
            missing_ranks(g, p, m, who, sizeof(who), &n);
            rc = PS_ETIMEDOUT;
            msg = ps__strdupf("rank%s %s did not arrive within %lld ms (met directly on this "
                              "host)",
                              n > 1 ? "s" : "", who, (long long)timeout);
            break;
        }
        struct timespec slice = {.tv_sec = 0,
                                 .tv_nsec = (left < BAR_SLICE ? left : BAR_SLICE) * 1000000L};
        ps_doorbell_futex(&p->gen, FUTEX_WAIT, seen, &slice);
    }
    if (rc < 0) {
        char what[96];
        ps__coll_what(c, what, sizeof(what));
        ps__report(comm, rc, what, "%s", msg ? msg : ps_strerror(rc));
    }
    free(msg);
    return rc;
}

int ps__bar_run(ps__coll_t *c, int *rc)
{
    ps_group_t *g = c->group;
    if (c->bar_k == 1) {
        *rc = setup_map(c);
        return 1;
    }
    if (c->bar_k == 2) {
        *rc = setup_agree(c);
        return 1;
    }
    setup_wait(c->comm, g, 2);
    if (!g->bar_page)
        return 0;
    int got = meet(c, (uint32_t)c->hdr.seq + 1);
    if (got == BAR_MISMATCH)
        return 0; /* to the agent under its number, where the hub tells both sides */
    *rc = got;
    return 1;
}

void ps__bar_free(ps_group_t *g)
{
    if (g->bar_name[0])
        shm_unlink(g->bar_name);
    g->bar_name[0] = 0;
    if (g->bar_page)
        munmap(g->bar_page, BAR_PAGE);
    g->bar_page = NULL;
}
