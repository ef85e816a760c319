/* What the fuzz targets share: checks that abort, and fuzzer bytes turned into sliced gRPC buffers.
 */
#ifndef PS_FUZZ_INPUT_H
#define PS_FUZZ_INPUT_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <grpc/byte_buffer.h>

/* An invariant of the code under test. assert() is compiled out in release
 * builds, and the regression runners run there too, so this always aborts. */
#define FUZZ_CHECK(cond)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: invariant violated: %s\n", __FILE__, __LINE__, #cond);         \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

/* Most slices one input is cut into (the last takes what is left). */
#define FUZZ_MAX_SPLITS 15

/**
 * Cuts a fuzzer input into a message and the slices it arrives in, so that
 * decoders see every field boundary fall between slices somewhere:
 *   byte 0          k = byte & 15, the number of explicit cuts
 *   bytes 1..k      the lengths (0..255) of the first k slices
 *   the rest        the message; the first k slices take their lengths of it
 *                   (clipped at its end), a last slice takes the remainder.
 * Every slice is a heap block of exactly its length, so AddressSanitizer
 * sees any read past a slice's end. *msg and *msg_len get the message (inside
 * data). Returns a new byte buffer (the caller destroys it); aborts on ENOMEM,
 * which a fuzzer cannot do anything useful with.
 */
grpc_byte_buffer *fuzz_sliced_buffer(const uint8_t *data, size_t size, const uint8_t **msg,
                                     size_t *msg_len);

/** The same message in one slice (a heap block of its exact length). */
grpc_byte_buffer *fuzz_contiguous_buffer(const uint8_t *msg, size_t len);

#endif
