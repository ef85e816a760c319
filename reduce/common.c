/* The helpers of paramsync/common.h: error strings, dtype/op names, the op/dtype rule. */
#include <paramsync/common.h>

const char *ps_strerror(int err)
{
    switch (err) {
    case PS_OK:
        return "success";
    case PS_ECANCELLED:
        return "cancelled";
    case PS_EUNKNOWN:
        return "unknown error";
    case PS_EINVAL:
        return "invalid argument";
    case PS_ETIMEDOUT:
        return "deadline exceeded";
    case PS_ENOTFOUND:
        return "not found";
    case PS_EEXIST:
        return "already exists";
    case PS_EPERM:
        return "permission denied";
    case PS_ENOMEM:
        return "out of memory or over a limit";
    case PS_EPRECOND:
        return "failed precondition";
    case PS_EABORTED:
        return "aborted";
    case PS_ERANGE:
        return "out of range";
    case PS_ENOTSUP:
        return "not supported";
    case PS_EINTERNAL:
        return "internal error";
    case PS_EUNAVAIL:
        return "unavailable";
    case PS_EDATALOSS:
        return "data loss";
    case PS_EUNAUTH:
        return "unauthenticated";
    }
    return "unrecognised error code";
}

/* Indexed by ps_dtype_t; the enum values are the wire values, so the order is fixed. */
static const struct {
    const char *name;
    size_t size;
    int floating;
} dtype_info[PS_DTYPE_COUNT] = {
    [PS_FLOAT32] = {"float32", 4, 1}, [PS_FLOAT64] = {"float64", 8, 1},
    [PS_FLOAT16] = {"float16", 2, 1}, [PS_BFLOAT16] = {"bfloat16", 2, 1},
    [PS_INT8] = {"int8", 1, 0},       [PS_UINT8] = {"uint8", 1, 0},
    [PS_INT16] = {"int16", 2, 0},     [PS_INT32] = {"int32", 4, 0},
    [PS_INT64] = {"int64", 8, 0},     [PS_BOOL] = {"bool", 1, 0},
};

static const char *const op_names[PS_OP_COUNT] = {
    [PS_SUM] = "SUM",   [PS_PRODUCT] = "PRODUCT", [PS_MIN] = "MIN",   [PS_MAX] = "MAX",
    [PS_BAND] = "BAND", [PS_BOR] = "BOR",         [PS_BXOR] = "BXOR", [PS_AVG] = "AVG",
};

/* The enums may hold any int (they come off the wire), so range checks go through unsigned.
 * Both return 1 or 0 and cannot fail. */
static int dtype_valid(ps_dtype_t dtype)
{
    return (unsigned)dtype < PS_DTYPE_COUNT;
}

static int op_valid(ps_op_t op)
{
    return (unsigned)op < PS_OP_COUNT;
}

size_t ps_dtype_size(ps_dtype_t dtype)
{
    return dtype_valid(dtype) ? dtype_info[dtype].size : 0;
}

const char *ps_dtype_name(ps_dtype_t dtype)
{
    return dtype_valid(dtype) ? dtype_info[dtype].name : "invalid";
}

const char *ps_op_name(ps_op_t op)
{
    return op_valid(op) ? op_names[op] : "INVALID";
}

int ps_op_check(ps_op_t op, ps_dtype_t dtype)
{
    if (!op_valid(op) || !dtype_valid(dtype))
        return PS_EINVAL;
    int bitwise = op == PS_BAND || op == PS_BOR || op == PS_BXOR;
    /* Bitwise ops on floats would act on the encoding, which is a guess, not torch's semantics. */
    if (bitwise && dtype_info[dtype].floating)
        return PS_EINVAL;
    /* torch rejects AVG for integers; an integer mean would have to pick a rounding. */
    if (op == PS_AVG && !dtype_info[dtype].floating)
        return PS_EINVAL;
    return 0;
}
