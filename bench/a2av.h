/*
 * The uneven all_to_all the benchmarks time (paramsync-bench and mpi-bench,
 * -t all_to_all_v; torch-bench writes the same in Python): rank r sends rank
 * j a block of u (1 + (r + j) mod p) elements, so every rank sends and
 * receives u p (p + 1) / 2, and each block is received as long as it is sent.
 */
#ifndef PS_BENCH_A2AV_H
#define PS_BENCH_A2AV_H

#include <stddef.h>

/* The units of u elements each rank sends (and receives). */
static inline size_t ps_bench_a2av_units(int p)
{
    return (size_t)p * (size_t)(p + 1) / 2;
}

/* Elements rank r sends rank j. */
static inline size_t ps_bench_a2av_count(int r, int j, int p, size_t u)
{
    return u * (size_t)(1 + (r + j) % p);
}

/* Where rank r's block for rank j starts in r's input, in elements. */
static inline size_t ps_bench_a2av_at(int r, int j, int p, size_t u)
{
    size_t at = 0;
    for (int i = 0; i < j; i++)
        at += ps_bench_a2av_count(r, i, p, u);
    return at;
}

#endif
