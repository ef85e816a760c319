/* Helpers shared by the C examples: joining from the environment and printing tensors as torch
 * does. */
#include "example.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

ps_comm_t *example_init(void)
{
    ps_comm_t *comm = NULL;
    int rc = ps_init(NULL, &comm);
    if (rc < 0) {
        fprintf(stderr, "init_process_group failed: %s\n", ps_strerror(rc));
        exit(1);
    }
    return comm;
}

void example_check(int rc, const char *what)
{
    if (rc < 0) {
        fprintf(stderr, "%s failed: %s\n", what, ps_strerror(rc));
        exit(1);
    }
}

void example_finalize(ps_comm_t *comm)
{
    example_check(ps_finalize(comm), "finalize");
}

/* One element as torch writes it, before padding to the common width. */
static void element_str(char *out, size_t cap, ps_dtype_t dtype, const void *data, size_t i,
                        int all_integral)
{
    switch (dtype) {
    case PS_INT64:
        snprintf(out, cap, "%lld", (long long)((const int64_t *)data)[i]);
        break;
    case PS_INT32:
        snprintf(out, cap, "%d", (int)((const int32_t *)data)[i]);
        break;
    case PS_FLOAT32: {
        double v = ((const float *)data)[i];
        /* torch drops the decimals when every element is a whole number. */
        if (all_integral)
            snprintf(out, cap, "%.0f.", v);
        else
            snprintf(out, cap, "%.4f", v);
        break;
    }
    default:
        snprintf(out, cap, "?");
    }
}

char *example_tensor_str(char *buf, size_t cap, ps_dtype_t dtype, const void *data, size_t count)
{
    int all_integral = 1;
    size_t width = 0, used = 0;
    char el[64];
    if (dtype == PS_FLOAT32)
        for (size_t i = 0; i < count; i++)
            if (((const float *)data)[i] != floorf(((const float *)data)[i]))
                all_integral = 0;
    for (size_t i = 0; i < count; i++) {
        element_str(el, sizeof(el), dtype, data, i, all_integral);
        if (strlen(el) > width)
            width = strlen(el);
    }
    used += (size_t)snprintf(buf + used, cap - used, "tensor([");
    for (size_t i = 0; i < count && used < cap; i++) {
        element_str(el, sizeof(el), dtype, data, i, all_integral);
        used += (size_t)snprintf(buf + used, cap - used, "%s%*s", i ? ", " : "", (int)width, el);
    }
    if (used < cap)
        snprintf(buf + used, cap - used, "]%s)", dtype == PS_INT32 ? ", dtype=torch.int32" : "");
    return buf;
}

void example_print_list(const char *prefix, ps_dtype_t dtype, const void *data, size_t n,
                        size_t count)
{
    char t[256];
    size_t esz = ps_dtype_size(dtype);
    printf("%s[", prefix);
    for (size_t i = 0; i < n; i++)
        printf(
            "%s%s", i ? ", " : "",
            example_tensor_str(t, sizeof(t), dtype, (const char *)data + i * count * esz, count));
    printf("]\n");
}
