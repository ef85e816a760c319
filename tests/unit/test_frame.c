/* unit.frame: server/rpc/frame.c's encoder, by decoding what it builds. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>

#include "rpc/frame.h"

/* bb's bytes, flattened (caller frees). */
static grpc_slice flat(grpc_byte_buffer *bb)
{
    grpc_byte_buffer_reader r;
    assert_true(grpc_byte_buffer_reader_init(&r, bb));
    grpc_slice s = grpc_byte_buffer_reader_readall(&r);
    grpc_byte_buffer_reader_destroy(&r);
    return s;
}

/* A frame made of received slices (a relay) has the bytes of one made of
 * the same data in one piece, and decodes to that data and offset; pieces
 * of a few bytes (inlined slices) and empty data included. */
static void test_encode_slices_matches_encode(void **state)
{
    (void)state;
    uint8_t data[70000];
    for (size_t i = 0; i < sizeof(data); i++)
        data[i] = (uint8_t)(i * 7 + 3);
    grpc_slice big = grpc_slice_from_copied_buffer((const char *)data, sizeof(data));
    const size_t cuts[][2] = {{0, 5}, {5, 40000}, {40000, 40003}, {40003, sizeof(data)}};
    grpc_slice parts[4];
    for (int i = 0; i < 4; i++)
        parts[i] = grpc_slice_sub(big, cuts[i][0], cuts[i][1]);
    for (int n = 0; n <= 4; n++) {
        size_t len = n ? cuts[n - 1][1] : 0;
        uint64_t offset = 12345 + (uint64_t)n;
        grpc_byte_buffer *a = ps__frame_encode(NULL, NULL, offset, data, len, NULL, NULL);
        grpc_slice refs[4]; /* ps__frame_encode_slices takes these */
        for (int i = 0; i < n; i++)
            refs[i] = grpc_slice_ref(parts[i]);
        grpc_byte_buffer *b = ps__frame_encode_slices(NULL, NULL, offset, refs, n);
        assert_non_null(a);
        assert_non_null(b);
        grpc_slice fa = flat(a), fb = flat(b);
        assert_int_equal(GRPC_SLICE_LENGTH(fa), GRPC_SLICE_LENGTH(fb));
        assert_memory_equal(GRPC_SLICE_START_PTR(fa), GRPC_SLICE_START_PTR(fb),
                            GRPC_SLICE_LENGTH(fa));
        grpc_slice_unref(fa);
        grpc_slice_unref(fb);
        ps__frame_t f;
        memset(&f, 0, sizeof(f));
        assert_int_equal(ps__frame_decode(b, &f), 0);
        assert_int_equal(f.meta->offset, offset);
        assert_int_equal(f.data_len, len);
        uint8_t *got = malloc(len + 1);
        assert_non_null(got);
        assert_int_equal(ps__frame_copy_data(&f, 0, got, len), 0);
        assert_memory_equal(got, data, len);
        free(got);
        ps__frame_clear(&f);
        grpc_byte_buffer_destroy(a);
        grpc_byte_buffer_destroy(b);
    }
    /* The frames took only the references given them: the parts are still ours. */
    for (int i = 0; i < 4; i++)
        grpc_slice_unref(parts[i]);
    grpc_slice_unref(big);
}

int main(void)
{
    grpc_init();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_encode_slices_matches_encode),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    grpc_shutdown();
    return rc;
}
