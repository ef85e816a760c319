/* Types, error codes and export macro shared by every paramsync library. */
#ifndef PARAMSYNC_COMMON_H
#define PARAMSYNC_COMMON_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define PS_EXPORT __attribute__((visibility("default")))
#else
#define PS_EXPORT
#endif

/*
 * Error codes. Every fallible function returns 0 or one of these negative
 * values. The magnitude of each code equals the gRPC status code it travels
 * as (PS_EINVAL == -GRPC_STATUS_INVALID_ARGUMENT), so errors cross the wire
 * and the language boundary without a translation table.
 */
typedef enum ps_error {
    PS_OK = 0,
    PS_ECANCELLED = -1, /* CANCELLED: the call was cancelled */
    PS_EUNKNOWN = -2,   /* UNKNOWN */
    PS_EINVAL = -3,     /* INVALID_ARGUMENT: bad argument, op/dtype pair, rank, size */
    PS_ETIMEDOUT = -4,  /* DEADLINE_EXCEEDED: a peer never arrived in time */
    PS_ENOTFOUND = -5,  /* NOT_FOUND: unknown job or group */
    PS_EEXIST = -6,     /* ALREADY_EXISTS: duplicate rank */
    PS_EPERM = -7,      /* PERMISSION_DENIED */
    PS_ENOMEM = -8,     /* RESOURCE_EXHAUSTED: out of memory or over a limit */
    PS_EPRECOND = -9,   /* FAILED_PRECONDITION: ranks disagree, not initialised */
    PS_EABORTED = -10,  /* ABORTED: a peer died mid-collective */
    PS_ERANGE = -11,    /* OUT_OF_RANGE */
    PS_ENOTSUP = -12,   /* UNIMPLEMENTED */
    PS_EINTERNAL = -13, /* INTERNAL */
    PS_EUNAVAIL = -14,  /* UNAVAILABLE: daemon or peer unreachable, shutting down */
    PS_EDATALOSS = -15, /* DATA_LOSS */
    PS_EUNAUTH = -16,   /* UNAUTHENTICATED: missing or wrong job token */
} ps_error_t;

/* Element types. The values are those of paramsync.v1.DType on the wire. */
typedef enum ps_dtype {
    PS_FLOAT32 = 0,
    PS_FLOAT64 = 1,
    PS_FLOAT16 = 2,
    PS_BFLOAT16 = 3,
    PS_INT8 = 4,
    PS_UINT8 = 5,
    PS_INT16 = 6,
    PS_INT32 = 7,
    PS_INT64 = 8,
    PS_BOOL = 9,
    PS_DTYPE_COUNT = 10
} ps_dtype_t;

/* Reduce operations. The values are those of paramsync.v1.ReduceOp. */
typedef enum ps_op {
    PS_SUM = 0,
    PS_PRODUCT = 1,
    PS_MIN = 2,
    PS_MAX = 3,
    PS_BAND = 4,
    PS_BOR = 5,
    PS_BXOR = 6,
    PS_AVG = 7,
    PS_OP_COUNT = 8
} ps_op_t;

/** Returns a static, human-readable string for an error code. Never NULL. */
PS_EXPORT const char *ps_strerror(int err);

/** Returns the size in bytes of one element of dtype, or 0 if dtype is invalid. */
PS_EXPORT size_t ps_dtype_size(ps_dtype_t dtype);

/** Returns the lower-case name ("float32", "bfloat16", ...) or "invalid". */
PS_EXPORT const char *ps_dtype_name(ps_dtype_t dtype);

/** Returns the upper-case name ("SUM", "BXOR", ...) or "INVALID". */
PS_EXPORT const char *ps_op_name(ps_op_t op);

/**
 * Checks that op can be applied to dtype: 0 when it can, PS_EINVAL for an
 * out-of-range op or dtype, for a bitwise op on a floating dtype, and for
 * AVG on a non-floating dtype.
 */
PS_EXPORT int ps_op_check(ps_op_t op, ps_dtype_t dtype);

#ifdef __cplusplus
}
#endif
#endif
