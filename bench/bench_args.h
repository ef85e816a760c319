/* Command-line lists the reduce benchmarks share (bench_reduce.c, bench_gpu.cu). */
#ifndef PS_BENCH_ARGS_H
#define PS_BENCH_ARGS_H

#ifdef __cplusplus
extern "C" {
#endif

/* Sets flags[i] for every name in the comma-separated list that matches
 * name_of(i), case-insensitively, and clears the others. Returns 0, or -1
 * after printing each unknown name (as "unknown WHAT 'NAME'"). */
int ps_bench_parse_list(const char *list, int *flags, int count, const char *(*name_of)(int),
                        const char *what);

/* name_of functions for ps_bench_parse_list: reduce paths, ops, dtypes. */
const char *ps_bench_path_name(int i);
const char *ps_bench_op_name(int i);
const char *ps_bench_dtype_name(int i);

#ifdef __cplusplus
}
#endif

#endif
