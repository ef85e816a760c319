/*
 * Buffers on transparent huge pages for the benchmarks (paramsync-bench and
 * mpi-bench, --mem huge): where the agent, or Open MPI, copies between
 * processes (process_vm_readv/writev), each call pins the other process's
 * pages, and 2 MiB pages cost far less to pin than 4 KiB ones.
 */
#ifndef PS_BENCH_HUGE_H
#define PS_BENCH_HUGE_H

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define PS_BENCH_HUGE_PAGE ((size_t)2 << 20)

/* n bytes, zeroed, in whole 2 MiB pages aligned to 2 MiB, which madvise asks
 * the kernel to back with huge pages (it may still give small ones; see
 * /sys/kernel/mm/transparent_hugepage/enabled). *advised: whether madvise
 * took the advice. Released with free(); NULL when out of memory. */
static inline void *ps_bench_huge_alloc(size_t n, int *advised)
{
    size_t len = (n + PS_BENCH_HUGE_PAGE - 1) / PS_BENCH_HUGE_PAGE * PS_BENCH_HUGE_PAGE;
    if (!len)
        len = PS_BENCH_HUGE_PAGE;
    void *p = aligned_alloc(PS_BENCH_HUGE_PAGE, len);
    if (p) {
        *advised = madvise(p, len, MADV_HUGEPAGE) == 0;
        memset(p, 0, len);
    }
    return p;
}

#endif
