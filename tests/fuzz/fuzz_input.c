/* Sliced gRPC byte buffers from fuzzer bytes (see fuzz_input.h). */
#include "fuzz_input.h"

#include <string.h>

#include <grpc/slice.h>

/* A slice over a heap copy of exactly len bytes. */
static grpc_slice exact_slice(const uint8_t *p, size_t len)
{
    if (len == 0)
        return grpc_empty_slice();
    void *copy = malloc(len);
    FUZZ_CHECK(copy != NULL);
    memcpy(copy, p, len);
    return grpc_slice_new(copy, len, free);
}

grpc_byte_buffer *fuzz_sliced_buffer(const uint8_t *data, size_t size, const uint8_t **msg,
                                     size_t *msg_len)
{
    size_t k = 0, head = 0;
    if (size > 0) {
        k = (size_t)(data[0] & FUZZ_MAX_SPLITS);
        if (k > size - 1)
            k = size - 1;
        head = 1 + k;
    }
    const uint8_t *m = data + head;
    size_t mlen = size - head;

    grpc_slice slices[FUZZ_MAX_SPLITS + 1];
    size_t n = 0, pos = 0;
    for (size_t i = 0; i < k; i++) {
        size_t len = data[1 + i];
        if (len > mlen - pos)
            len = mlen - pos;
        slices[n++] = exact_slice(m + pos, len);
        pos += len;
    }
    slices[n++] = exact_slice(m + pos, mlen - pos);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(slices, n);
    FUZZ_CHECK(bb != NULL);
    for (size_t i = 0; i < n; i++)
        grpc_slice_unref(slices[i]);
    *msg = m;
    *msg_len = mlen;
    return bb;
}

grpc_byte_buffer *fuzz_contiguous_buffer(const uint8_t *msg, size_t len)
{
    grpc_slice s = exact_slice(msg, len);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    FUZZ_CHECK(bb != NULL);
    grpc_slice_unref(s);
    return bb;
}
