/*
 * paramsync_node: the few system calls the Node.js client cannot make in
 * JavaScript, for the doorbell (proto/paramsync/v1/doorbell.h): mapping a
 * shared segment, and futex wait and wake on a 32-bit word of it.
 *
 *   map(fd, size)                       -> ArrayBuffer over mmap(fd), shared;
 *                                          unmapped when the buffer is collected
 *   wake(buffer, offset)                -> how many waiters FUTEX_WAKE woke
 *   wait(buffer, offset, value, ms)     -> Promise<boolean>: true once the word
 *                                          is no longer value, false after ms
 *   waitNow(buffer, offset, value, us)  -> the same, here and now: the event loop
 *                                          waits too, at most us (up to 10 ms)
 *   address(buffer)                     -> where the buffer's bytes are, for the
 *                                          agent's process_vm_readv/writev
 *   collapse(buffer, offset, length)    -> 0, or the errno of madvise(MADV_COLLAPSE)
 *                                          over the whole 2 MiB pages in that range
 *   collapseWorks()                     -> whether this kernel collapses on request
 *   peerRead(pid, nonceAddress, nonce,  -> whether a block of another process came whole,
 *            address, length, buffer,      read with its nonce (peer copies, client/peer.c)
 *            offset)
 *   peerMapRead(... as peerRead,        -> the same through a kept read-only mapping of the
 *               segFd, segBase, segSize)   owner's segment (pidfd_getfd of its segFd)
 *   peerMapClock(), peerMapSweep(since) -> a mark; drops mappings unused since it whose
 *                                          owner let the file go (-1: all), how many
 *
 * wait() blocks a thread of libuv's pool (the event loop goes on); the
 * buffer is kept alive until it ends. waitNow() saves wait()'s two hand-offs
 * (to the pool's thread and back to the loop: tens of microseconds) where an
 * answer is due at once. Words are shared between processes, so
 * the futexes are never FUTEX_PRIVATE_FLAG. Plain C11 on N-API (version 8),
 * so one build serves every Node.js from 18 on.
 */
#define NAPI_VERSION 8
#include <node_api.h>

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

/* Throws a JavaScript Error with msg (or the pending N-API error) and returns
 * NULL, for the callbacks' early returns. */
static napi_value fail(napi_env env, const char *msg)
{
    bool pending = false;
    if (napi_is_exception_pending(env, &pending) == napi_ok && !pending)
        napi_throw_error(env, NULL, msg);
    return NULL;
}

#define TRY(env, call, msg)                                                                        \
    do {                                                                                           \
        if ((call) != napi_ok)                                                                     \
            return fail((env), (msg));                                                             \
    } while (0)

/* The callback's first n arguments into argv; false (thrown, naming usage) when fewer
 * came. */
static bool get_args(napi_env env, napi_callback_info info, size_t n, napi_value *argv,
                     const char *usage)
{
    size_t argc = n;
    if (napi_get_cb_info(env, info, &argc, argv, NULL, NULL) != napi_ok || argc < n) {
        fail(env, usage);
        return false;
    }
    return true;
}

/* argv[i] as a non-negative integer no larger than max. */
static int get_count(napi_env env, napi_value v, double max, uint64_t *out)
{
    double d;
    if (napi_get_value_double(env, v, &d) != napi_ok || d != d || d < 0 || d > max ||
        d != (double)(uint64_t)d)
        return -1;
    *out = (uint64_t)d;
    return 0;
}

/* v as an ArrayBuffer: its bytes and length; NULL (thrown) when it is not one. */
static void *buffer_of(napi_env env, napi_value v, size_t *len)
{
    bool is_ab = false;
    void *data = NULL;
    if (napi_is_arraybuffer(env, v, &is_ab) != napi_ok || !is_ab ||
        napi_get_arraybuffer_info(env, v, &data, len) != napi_ok || !data) {
        napi_throw_type_error(env, NULL, "paramsync_node: expected an ArrayBuffer");
        return NULL;
    }
    return data;
}

/* The 32-bit word at offset off of the ArrayBuffer buf. */
static _Atomic uint32_t *word_of(napi_env env, napi_value buf, napi_value off)
{
    size_t len = 0;
    uint64_t o;
    char *data = buffer_of(env, buf, &len);
    if (!data)
        return NULL;
    if (get_count(env, off, (double)SIZE_MAX, &o) != 0 || o % 4 || o + 4 > len) {
        napi_throw_range_error(env, NULL,
                               "paramsync_node: the offset must be a multiple of 4 "
                               "inside the buffer");
        return NULL;
    }
    return (_Atomic uint32_t *)(data + o);
}

static void unmap_buffer(napi_env env, void *data, void *hint)
{
    (void)env;
    munmap(data, (size_t)(uintptr_t)hint);
}

static napi_value js_map(napi_env env, napi_callback_info info)
{
    napi_value argv[2];
    uint64_t fd, size;
    if (!get_args(env, info, 2, argv, "map(fd, size): two arguments"))
        return NULL;
    if (get_count(env, argv[0], INT_MAX, &fd) != 0 ||
        get_count(env, argv[1], (double)(SIZE_MAX / 2), &size) != 0 || size == 0) {
        napi_throw_type_error(env, NULL, "map(fd, size): fd and a positive size, as integers");
        return NULL;
    }
    void *p = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, (int)fd, 0);
    if (p == MAP_FAILED) {
        char msg[128];
        snprintf(msg, sizeof(msg), "map: mmap of %llu bytes: %s", (unsigned long long)size,
                 strerror(errno));
        return fail(env, msg);
    }
    napi_value ab;
    if (napi_create_external_arraybuffer(env, p, (size_t)size, unmap_buffer,
                                         (void *)(uintptr_t)size, &ab) != napi_ok) {
        munmap(p, (size_t)size);
        return fail(env, "map: this Node.js does not take external buffers");
    }
    return ab;
}

static napi_value js_wake(napi_env env, napi_callback_info info)
{
    napi_value argv[2], out;
    if (!get_args(env, info, 2, argv, "wake(buffer, offset): two arguments"))
        return NULL;
    _Atomic uint32_t *w = word_of(env, argv[0], argv[1]);
    if (!w)
        return NULL;
    long n = syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
    TRY(env, napi_create_int32(env, n < 0 ? 0 : (int32_t)n, &out), "wake: result");
    return out;
}

typedef struct waiter {
    napi_async_work work;
    napi_deferred deferred;
    napi_ref keep; /* the buffer, mapped until the wait ends */
    _Atomic uint32_t *word;
    uint32_t value;
    uint64_t timeout_ns;
    bool changed;
} waiter_t;

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Until *word is no longer value (true) or timeout_ns have passed (false). */
static bool wait_word(_Atomic uint32_t *word, uint32_t value, uint64_t timeout_ns)
{
    uint64_t end = now_ns() + timeout_ns;
    for (;;) {
        if (atomic_load_explicit(word, memory_order_acquire) != value)
            return true;
        uint64_t now = now_ns();
        if (now >= end)
            return false;
        uint64_t left = end - now;
        struct timespec ts = {.tv_sec = (time_t)(left / 1000000000u),
                              .tv_nsec = (long)(left % 1000000000u)};
        syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, value, &ts, NULL, 0);
    }
}

/* On a thread of libuv's pool. */
static void wait_execute(napi_env env, void *data)
{
    (void)env;
    waiter_t *w = data;
    w->changed = wait_word(w->word, w->value, w->timeout_ns);
}

static void wait_complete(napi_env env, napi_status status, void *data)
{
    waiter_t *w = data;
    napi_value v;
    if (status == napi_ok && napi_get_boolean(env, w->changed, &v) == napi_ok)
        napi_resolve_deferred(env, w->deferred, v);
    else if (napi_create_string_utf8(env, "wait: cancelled", NAPI_AUTO_LENGTH, &v) == napi_ok)
        napi_reject_deferred(env, w->deferred, v);
    napi_delete_reference(env, w->keep);
    napi_delete_async_work(env, w->work);
    free(w);
}

/* wait's and waitNow's arguments (buffer, offset, value, time): argv, the word,
 * its value and the time (at most max); NULL (thrown, naming usage or range)
 * when they are not so. */
static _Atomic uint32_t *wait_args(napi_env env, napi_callback_info info, napi_value argv[4],
                                   uint32_t *value, uint64_t *time, double max, const char *usage,
                                   const char *range)
{
    uint64_t v;
    if (!get_args(env, info, 4, argv, usage))
        return NULL;
    _Atomic uint32_t *word = word_of(env, argv[0], argv[1]);
    if (!word)
        return NULL;
    if (get_count(env, argv[2], UINT32_MAX, &v) != 0 || get_count(env, argv[3], max, time) != 0) {
        napi_throw_range_error(env, NULL, range);
        return NULL;
    }
    *value = (uint32_t)v;
    return word;
}

static napi_value js_wait(napi_env env, napi_callback_info info)
{
    napi_value argv[4], promise, name;
    uint32_t value;
    uint64_t ms;
    _Atomic uint32_t *word = wait_args(env, info, argv, &value, &ms, 3600e3,
                                       "wait(buffer, offset, value, ms): four arguments",
                                       "wait: value must be a uint32, ms at most an hour");
    if (!word)
        return NULL;
    waiter_t *w = calloc(1, sizeof(*w));
    if (!w)
        return fail(env, "wait: out of memory");
    w->word = word;
    w->value = value;
    w->timeout_ns = ms * 1000000u;
    if (napi_create_reference(env, argv[0], 1, &w->keep) != napi_ok) {
        free(w);
        return fail(env, "wait: cannot hold the buffer");
    }
    if (napi_create_promise(env, &w->deferred, &promise) != napi_ok ||
        napi_create_string_utf8(env, "paramsync.wait", NAPI_AUTO_LENGTH, &name) != napi_ok ||
        napi_create_async_work(env, NULL, name, wait_execute, wait_complete, w, &w->work) !=
            napi_ok) {
        napi_delete_reference(env, w->keep);
        free(w);
        return fail(env, "wait: cannot start");
    }
    if (napi_queue_async_work(env, w->work) != napi_ok) {
        napi_delete_async_work(env, w->work);
        napi_delete_reference(env, w->keep);
        free(w);
        return fail(env, "wait: cannot queue");
    }
    return promise;
}

static napi_value js_wait_now(napi_env env, napi_callback_info info)
{
    napi_value argv[4], out;
    uint32_t value;
    uint64_t us;
    _Atomic uint32_t *word = wait_args(env, info, argv, &value, &us, 10e3,
                                       "waitNow(buffer, offset, value, us): four arguments",
                                       "waitNow: value must be a uint32, us at most 10000");
    if (!word)
        return NULL;
    TRY(env, napi_get_boolean(env, wait_word(word, value, us * 1000u), &out), "waitNow: result");
    return out;
}

/* User addresses stay below 2^53 on every 64-bit Linux: exact as a double, both ways. */
#define ADDRESS_MAX 9007199254740992.0

static napi_value js_address(napi_env env, napi_callback_info info)
{
    napi_value argv[1], out;
    size_t len;
    if (!get_args(env, info, 1, argv, "address(buffer): one argument"))
        return NULL;
    void *data = buffer_of(env, argv[0], &len);
    if (!data)
        return NULL;
    TRY(env, napi_create_double(env, (double)(uintptr_t)data, &out), "address: result");
    return out;
}

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25 /* Linux 6.1 */
#endif
#define HUGE_PAGE ((uintptr_t)2 << 20)

static napi_value js_collapse(napi_env env, napi_callback_info info)
{
    napi_value argv[3], out;
    size_t len;
    uint64_t off, n;
    if (!get_args(env, info, 3, argv, "collapse(buffer, offset, length): three arguments"))
        return NULL;
    char *data = buffer_of(env, argv[0], &len);
    if (!data)
        return NULL;
    if (get_count(env, argv[1], (double)len, &off) != 0 ||
        get_count(env, argv[2], (double)len, &n) != 0 || off + n > len) {
        napi_throw_range_error(env, NULL, "collapse: the range must lie inside the buffer");
        return NULL;
    }
    uintptr_t at = ((uintptr_t)data + off + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1);
    uintptr_t end = ((uintptr_t)data + off + n) & ~(HUGE_PAGE - 1);
    int err = 0;
    if (end > at && madvise((void *)at, end - at, MADV_COLLAPSE) != 0)
        err = errno;
    TRY(env, napi_create_int32(env, err, &out), "collapse: result");
    return out;
}

/* Whether madvise(MADV_COLLAPSE) gives huge pages here (Linux 6.1, THP not
 * "never"), tried on a scratch mapping, as client/shm.c's collapse_probe. */
static napi_value js_collapse_works(napi_env env, napi_callback_info info)
{
    (void)info;
    napi_value out;
    bool works = false;
    char *p = mmap(NULL, 2 * HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p != MAP_FAILED) {
        char *at = (char *)(((uintptr_t)p + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1));
        memset(at, 1, HUGE_PAGE);
        works = madvise(at, HUGE_PAGE, MADV_COLLAPSE) == 0;
        munmap(p, 2 * HUGE_PAGE);
    }
    TRY(env, napi_get_boolean(env, works, &out), "collapseWorks: result");
    return out;
}

/* A block of another process to copy here: pid holds it at `at` (n bytes) and its nonce
 * at nonce_at; it goes to data + off. */
typedef struct peer_block {
    uint64_t pid, nonce_at, nonce, at, n, off;
    char *data;
} peer_block_t;

/* argv[0..6] (pid, nonceAddress, nonce, address, length, buffer, offset) into *b; false
 * (thrown) when they are not integers (the nonce a BigInt) or the block is not inside the
 * buffer. */
static bool peer_block_args(napi_env env, napi_value *argv, const char *what, peer_block_t *b)
{
    size_t len;
    bool lossless = false;
    b->data = buffer_of(env, argv[5], &len);
    if (!b->data)
        return false;
    if (get_count(env, argv[0], INT_MAX, &b->pid) != 0 ||
        get_count(env, argv[1], ADDRESS_MAX, &b->nonce_at) != 0 ||
        napi_get_value_bigint_uint64(env, argv[2], &b->nonce, &lossless) != napi_ok || !lossless ||
        get_count(env, argv[3], ADDRESS_MAX, &b->at) != 0 ||
        get_count(env, argv[4], (double)len, &b->n) != 0 ||
        get_count(env, argv[6], (double)len, &b->off) != 0 || b->off + b->n > len) {
        char msg[160];
        snprintf(msg, sizeof(msg), "%s: integers (the nonce a BigInt), the block inside the buffer",
                 what);
        napi_throw_range_error(env, NULL, msg);
        return false;
    }
    return true;
}

/* Reads the 8 bytes at b's nonce_at and, in the same process_vm_readv, n bytes at `from`
 * of b's process into dst (n may be 0): whether all came and the nonce is b's, so that the
 * bytes came whole from the process that holds that rank's nonce. */
static bool peer_readv(const peer_block_t *b, uint64_t from, void *dst, uint64_t n)
{
    uint64_t seen = 0;
    struct iovec local[2] = {{&seen, 8}, {dst, (size_t)n}};
    struct iovec remote[2] = {{(void *)(uintptr_t)b->nonce_at, 8},
                              {(void *)(uintptr_t)from, (size_t)n}};
    ssize_t got = process_vm_readv((pid_t)b->pid, local, n ? 2 : 1, remote, n ? 2 : 1, 0);
    return got == (ssize_t)(8 + n) && seen == b->nonce;
}

/* peerRead(pid, nonceAddress, nonce, address, length, buffer, offset): reads length
 * bytes at address of process pid into buffer at offset, with the 8 bytes at
 * nonceAddress in the same process_vm_readv (client/peer.c's rule): true when all came
 * and the nonce is the one that process's descriptor gave, so the block came whole from
 * that very process. */
static napi_value js_peer_read(napi_env env, napi_callback_info info)
{
    napi_value argv[7], out;
    peer_block_t b;
    if (!get_args(env, info, 7, argv,
                  "peerRead(pid, nonceAddress, nonce, address, length, buffer, offset): seven "
                  "arguments") ||
        !peer_block_args(env, argv, "peerRead", &b))
        return NULL;
    TRY(env, napi_get_boolean(env, peer_readv(&b, b.at, b.data + b.off, b.n), &out),
        "peerRead: result");
    return out;
}

/* ---- other ranks' segments, mapped (client/peer.c's table, Python's _peer.Maps) ---- */

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

/* Mappings kept, at most; the one unused longest goes for a new one. */
#define PEER_MAPS 32

typedef struct peer_map {
    uint64_t pid, fd, dev, ino, size; /* the owner, its descriptor number, the file */
    uint8_t *addr;
    uint64_t last; /* the clock when last used */
} peer_map_t;

/* One table for the process (every World in it, and worker threads: the lock). */
static pthread_mutex_t maps_lock = PTHREAD_MUTEX_INITIALIZER;
static peer_map_t maps[PEER_MAPS];
static int nmaps;
static uint64_t maps_clock;

/* The file at number fd of process pid, as a descriptor here with its stat: -1 when it
 * cannot be taken or is not a regular file. With b, b's nonce is checked after the pidfd
 * is taken, so that a pid used again would not pass. */
static int peer_file(uint64_t pid, uint64_t fd, const peer_block_t *b, struct stat *st)
{
    int pidfd = (int)syscall(SYS_pidfd_open, (pid_t)pid, 0u);
    if (pidfd < 0)
        return -1;
    int here =
        b && !peer_readv(b, 0, NULL, 0) ? -1 : (int)syscall(SYS_pidfd_getfd, pidfd, (int)fd, 0u);
    close(pidfd);
    if (here >= 0 && (fstat(here, st) != 0 || !S_ISREG(st->st_mode))) {
        close(here);
        here = -1;
    }
    return here;
}

/* Drops entry i of the table. Lock held. */
static void maps_drop(int i)
{
    munmap(maps[i].addr, (size_t)maps[i].size);
    maps[i] = maps[--nmaps];
}

/* peerMapRead(pid, nonceAddress, nonce, address, length, buffer, offset, segFd, segBase,
 * segSize): as peerRead, through a mapping of the segment the block lies in (its owner's
 * descriptor segFd, from segBase, segSize bytes), taken with pidfd_getfd after the nonce
 * check and kept for later calls: true when the block was copied so, false when it could
 * not be (then peerRead). */
static napi_value js_peer_map_read(napi_env env, napi_callback_info info)
{
    napi_value argv[10], out;
    peer_block_t b;
    uint64_t fd, base, size;
    if (!get_args(env, info, 10, argv,
                  "peerMapRead(pid, nonceAddress, nonce, address, length, buffer, offset, "
                  "segFd, segBase, segSize): ten arguments") ||
        !peer_block_args(env, argv, "peerMapRead", &b))
        return NULL;
    if (get_count(env, argv[7], INT_MAX, &fd) != 0 ||
        get_count(env, argv[8], ADDRESS_MAX, &base) != 0 ||
        get_count(env, argv[9], ADDRESS_MAX, &size) != 0) {
        napi_throw_range_error(env, NULL, "peerMapRead: the segment's fd, start and size");
        return NULL;
    }
    bool ok = false;
    struct stat st;
    int here = -1;
    if (size && b.at >= base && b.at - base <= size && b.n <= size - (b.at - base) &&
        size <= SIZE_MAX / 2)
        here = peer_file(b.pid, fd, &b, &st);
    /* A file shorter than the mapping would fault on the copy (SIGBUS). */
    if (here >= 0 && (uint64_t)st.st_size >= size) {
        pthread_mutex_lock(&maps_lock);
        int i = 0;
        while (i < nmaps &&
               !(maps[i].pid == b.pid && maps[i].fd == fd && maps[i].dev == (uint64_t)st.st_dev &&
                 maps[i].ino == (uint64_t)st.st_ino && maps[i].size == size))
            i++;
        if (i == nmaps) {
            void *p = mmap(NULL, (size_t)size, PROT_READ, MAP_SHARED, here, 0);
            if (p == MAP_FAILED) {
                i = -1;
            } else {
                if (nmaps == PEER_MAPS) {
                    int old = 0;
                    for (int k = 1; k < nmaps; k++)
                        if (maps[k].last < maps[old].last)
                            old = k;
                    maps_drop(old);
                }
                i = nmaps++;
                maps[i] =
                    (peer_map_t){b.pid, fd, (uint64_t)st.st_dev, (uint64_t)st.st_ino, size, p, 0};
            }
        }
        if (i >= 0) {
            maps[i].last = ++maps_clock;
            memcpy(b.data + b.off, maps[i].addr + (b.at - base), (size_t)b.n);
            ok = true;
        }
        pthread_mutex_unlock(&maps_lock);
    }
    if (here >= 0)
        close(here);
    TRY(env, napi_get_boolean(env, ok, &out), "peerMapRead: result");
    return out;
}

/* peerMapClock(): a mark for peerMapSweep; mappings used after it are left alone. */
static napi_value js_peer_map_clock(napi_env env, napi_callback_info info)
{
    (void)info;
    napi_value out;
    pthread_mutex_lock(&maps_lock);
    double now = (double)maps_clock;
    pthread_mutex_unlock(&maps_lock);
    TRY(env, napi_create_double(env, now, &out), "peerMapClock: result");
    return out;
}

/* peerMapSweep(since): lets go of the mappings not used since the mark whose owner no
 * longer holds that file under that number (freed, or gone): a mapping keeps the owner's
 * memory. With no mark (-1), of every one. How many went. */
static napi_value js_peer_map_sweep(napi_env env, napi_callback_info info)
{
    napi_value argv[1], out;
    double since;
    if (!get_args(env, info, 1, argv, "peerMapSweep(since): one argument") ||
        napi_get_value_double(env, argv[0], &since) != napi_ok)
        return fail(env, "peerMapSweep(since): a number");
    int gone = 0;
    pthread_mutex_lock(&maps_lock);
    for (int i = 0; i < nmaps;) {
        struct stat st;
        int here = -1;
        if (since >= 0 && (double)maps[i].last > since) {
            i++;
            continue;
        }
        if (since >= 0)
            here = peer_file(maps[i].pid, maps[i].fd, NULL, &st);
        bool held =
            here >= 0 && (uint64_t)st.st_dev == maps[i].dev && (uint64_t)st.st_ino == maps[i].ino;
        if (here >= 0)
            close(here);
        if (held) {
            i++;
        } else {
            maps_drop(i);
            gone++;
        }
    }
    pthread_mutex_unlock(&maps_lock);
    TRY(env, napi_create_int32(env, gone, &out), "peerMapSweep: result");
    return out;
}

static napi_value init(napi_env env, napi_value exports)
{
    static const struct {
        const char *name;
        napi_callback fn;
    } fns[] = {{"map", js_map},
               {"wake", js_wake},
               {"wait", js_wait},
               {"waitNow", js_wait_now},
               {"address", js_address},
               {"collapse", js_collapse},
               {"collapseWorks", js_collapse_works},
               {"peerRead", js_peer_read},
               {"peerMapRead", js_peer_map_read},
               {"peerMapClock", js_peer_map_clock},
               {"peerMapSweep", js_peer_map_sweep}};
    for (size_t i = 0; i < sizeof(fns) / sizeof(fns[0]); i++) {
        napi_value f;
        TRY(env, napi_create_function(env, fns[i].name, NAPI_AUTO_LENGTH, fns[i].fn, NULL, &f),
            "paramsync_node: init");
        TRY(env, napi_set_named_property(env, exports, fns[i].name, f), "paramsync_node: init");
    }
    return exports;
}

NAPI_MODULE(paramsync_node, init)
