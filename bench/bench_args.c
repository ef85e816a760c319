/* Command-line lists the reduce benchmarks share: see bench_args.h. */
#include "bench_args.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <paramsync/reduce.h>

int ps_bench_parse_list(const char *list, int *flags, int count, const char *(*name_of)(int),
                        const char *what)
{
    char *copy = strdup(list);
    if (copy == NULL)
        return -1;
    memset(flags, 0, (size_t)count * sizeof *flags);
    int rc = 0;
    char *save = NULL;
    for (char *tok = strtok_r(copy, ",", &save); tok != NULL; tok = strtok_r(NULL, ",", &save)) {
        int found = 0;
        for (int i = 0; i < count; i++)
            if (strcasecmp(tok, name_of(i)) == 0)
                flags[i] = found = 1;
        if (!found) {
            fprintf(stderr, "unknown %s '%s'\n", what, tok);
            rc = -1;
        }
    }
    free(copy);
    return rc;
}

const char *ps_bench_path_name(int i)
{
    return ps_reduce_path_name((ps_reduce_path_t)i);
}

const char *ps_bench_op_name(int i)
{
    return ps_op_name((ps_op_t)i);
}

const char *ps_bench_dtype_name(int i)
{
    return ps_dtype_name((ps_dtype_t)i);
}
