/* Encoding and decoding of paramsync.v1.Frame without re-encoding tensor bytes. */
#ifndef PS_FRAME_H
#define PS_FRAME_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include <grpc/byte_buffer.h>

#include "paramsync/v1/paramsync.pb-c.h"

/*
 * A Frame on the wire is the protobuf encoding of its small fields
 * (header, result, offset) followed by field 15 (`data`): its tag, its
 * length, then the raw tensor bytes. The encoder puts those bytes in a slice
 * of their own (referenced, not copied, when the caller can keep them alive);
 * the decoder finds them inside the received slices and copies them once,
 * straight to their destination. Any protobuf library reads and writes the
 * same bytes, so the Python and Node.js clients use their generated code.
 */

/** Upper bound of payload bytes in one frame (the gRPC receive limit is
 * lifted on both ends, but frames stay well under 4 MiB anyway). */
#define PS_FRAME_MAX_DATA (4u << 20)

/** Called when gRPC no longer needs the bytes passed to ps__frame_encode. */
typedef void (*ps__frame_release_fn)(void *arg);

/**
 * Builds a frame. header, result may be NULL; data may be NULL when len is 0.
 * With release == NULL the bytes are copied; otherwise they are referenced
 * and release(release_arg) runs once gRPC is done with them (possibly long
 * after the send completed). Returns a new byte buffer, or NULL on ENOMEM
 * (release is then called before returning).
 */
grpc_byte_buffer *ps__frame_encode(const Paramsync__V1__CollectiveHeader *header,
                                   const Paramsync__V1__CollectiveResult *result, uint64_t offset,
                                   const void *data, size_t len, ps__frame_release_fn release,
                                   void *release_arg);

/**
 * Builds a frame whose data is the n slices in order (received slices passed
 * on without a copy), taking the caller's references to them.
 */
grpc_byte_buffer *ps__frame_encode_slices(const Paramsync__V1__CollectiveHeader *header,
                                          const Paramsync__V1__CollectiveResult *result,
                                          uint64_t offset, grpc_slice *data, int n);

/**
 * Builds the frame that ends an answer on a stream carrying several (`end`
 * set; result may be NULL): a relay's request's answer with its status, a
 * collective's frames on a Ring link both ways. NULL on ENOMEM.
 */
grpc_byte_buffer *ps__frame_encode_end(const Paramsync__V1__CollectiveResult *result);

/** A decoded frame: the small fields unpacked, the data located in place. */
typedef struct ps__frame {
    Paramsync__V1__Frame *meta; /* header/result/offset; data left empty */
    size_t data_len;
    /* private: where the data lies in the received slices */
    grpc_slice *slices;
    size_t nslices;
    size_t data_slice;  /* slice index of the first data byte */
    size_t data_offset; /* offset of the first data byte in that slice */
} ps__frame_t;

/**
 * Decodes bb (not consumed; the caller still destroys it). Returns 0, or
 * PS_EINVAL for malformed input (bad varint, truncated field, wire-type or
 * nested-message errors), or PS_ENOMEM. On success release with
 * ps__frame_clear.
 */
int ps__frame_decode(grpc_byte_buffer *bb, ps__frame_t *out);

/** Copies data bytes [from, from+len) of the frame to dst. PS_EINVAL when the
 * range is outside the data. */
int ps__frame_copy_data(const ps__frame_t *f, size_t from, void *dst, size_t len);

/** Points iov[0..n) at the frame's data bytes where they lie in the received
 * slices (no copy), for a vectored write. Returns n, or -1 when they span
 * more than max pieces. */
int ps__frame_data_iov(const ps__frame_t *f, struct iovec *iov, int max);

/** Points iov[0..n) at data bytes [from, from+len) of the frame where they
 * lie (no copy); or, with held != NULL (iov unused), makes held[0..n) slices
 * of those bytes that outlive the frame (each its own reference, released
 * with grpc_slice_unref; a piece of a few bytes is copied into its slice,
 * so read it through GRPC_SLICE_START_PTR of where held[i] lies). Returns
 * n, or -1 (nothing held) when the range is outside the data or spans more
 * than max pieces; a frame's range never spans more than its nslices. */
int ps__frame_data_ref(const ps__frame_t *f, size_t from, size_t len, struct iovec *iov,
                       grpc_slice *held, int max);

/** 1 for a decoded frame of ps__frame_encode_end (end set, no header, no
 * data), else 0. */
int ps__frame_is_end(const ps__frame_t *f);

/** Frees what decode took. Accepts a zeroed frame. */
void ps__frame_clear(ps__frame_t *f);

#endif
