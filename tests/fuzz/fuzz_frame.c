/* Fuzz target: Frame decoding and its data (decode, copy_data, data_iov, data_ref), in any
 * slices. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <paramsync/common.h>

#include "frame.h"
#include "fuzz_input.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* The small fields in canonical form, to compare two decodes. Returns a
 * malloc'd buffer and its length. */
static uint8_t *pack_meta(const Paramsync__V1__Frame *meta, size_t *len)
{
    Paramsync__V1__Frame m = *meta;
    m.data.len = 0;
    m.data.data = NULL;
    *len = protobuf_c_message_get_packed_size(&m.base);
    uint8_t *p = malloc(*len ? *len : 1);
    FUZZ_CHECK(p != NULL);
    FUZZ_CHECK(protobuf_c_message_pack(&m.base, p) == *len);
    return p;
}

/* The known small fields, packed: decoders may keep unknown fields as they
 * came (protobuf-c) or re-encoded (the frame decoder), so those are compared
 * by tag and wire type only (same_unknown). */
static uint8_t *pack_known(const Paramsync__V1__Frame *meta, size_t *len)
{
    Paramsync__V1__Frame m = *meta;
    Paramsync__V1__CollectiveHeader h;
    Paramsync__V1__CollectiveResult r;
    m.base.n_unknown_fields = 0;
    m.base.unknown_fields = NULL;
    if (m.header) {
        h = *m.header;
        h.base.n_unknown_fields = 0;
        h.base.unknown_fields = NULL;
        m.header = &h;
    }
    if (m.result) {
        r = *m.result;
        r.base.n_unknown_fields = 0;
        r.base.unknown_fields = NULL;
        m.result = &r;
    }
    return pack_meta(&m, len);
}

static int same_unknown_fields(const ProtobufCMessage *a, const ProtobufCMessage *b)
{
    if (!a || !b)
        return a == b;
    if (a->n_unknown_fields != b->n_unknown_fields)
        return 0;
    for (unsigned i = 0; i < a->n_unknown_fields; i++)
        if (a->unknown_fields[i].tag != b->unknown_fields[i].tag ||
            a->unknown_fields[i].wire_type != b->unknown_fields[i].wire_type)
            return 0;
    return 1;
}

static int same_meta(const Paramsync__V1__Frame *a, const Paramsync__V1__Frame *b)
{
    size_t al, bl;
    uint8_t *ap = pack_known(a, &al), *bp = pack_known(b, &bl);
    int same = al == bl && memcmp(ap, bp, al) == 0 && same_unknown_fields(&a->base, &b->base) &&
               same_unknown_fields(a->header ? &a->header->base : NULL,
                                   b->header ? &b->header->base : NULL) &&
               same_unknown_fields(a->result ? &a->result->base : NULL,
                                   b->result ? &b->result->base : NULL);
    free(ap);
    free(bp);
    return same;
}

/* Every data byte of f, in a malloc'd buffer. */
static uint8_t *copy_all(const ps__frame_t *f)
{
    uint8_t *p = malloc(f->data_len ? f->data_len : 1);
    FUZZ_CHECK(p != NULL);
    FUZZ_CHECK(ps__frame_copy_data(f, 0, p, f->data_len) == 0);
    return p;
}

/* Ranges inside the data copy the same bytes as the whole copy; ranges
 * outside it, including ones whose end overflows, are refused. */
static void check_ranges(const ps__frame_t *f, const uint8_t *all, uint64_t seed)
{
    size_t n = f->data_len;
    if (n > 0) {
        size_t from = (size_t)(seed % n);
        size_t len = (size_t)((seed >> 32) % (n - from + 1));
        uint8_t *part = malloc(len ? len : 1);
        FUZZ_CHECK(part != NULL);
        FUZZ_CHECK(ps__frame_copy_data(f, from, part, len) == 0);
        FUZZ_CHECK(len == 0 || memcmp(part, all + from, len) == 0);
        free(part);
    }
    /* The pieces ps__frame_data_iov points at are the same bytes, in order,
     * none empty; too few places for them is -1. */
    struct iovec iov[64];
    int k = ps__frame_data_iov(f, iov, 64);
    if (k >= 0) {
        size_t at = 0;
        for (int i = 0; i < k; i++) {
            FUZZ_CHECK(iov[i].iov_len > 0 && at + iov[i].iov_len <= n);
            FUZZ_CHECK(memcmp(iov[i].iov_base, all + at, iov[i].iov_len) == 0);
            at += iov[i].iov_len;
        }
        FUZZ_CHECK(at == n);
        FUZZ_CHECK(k == 0 || ps__frame_data_iov(f, iov, k - 1) == -1);
    }
    uint8_t byte;
    FUZZ_CHECK(ps__frame_copy_data(f, n, &byte, 0) == 0);
    FUZZ_CHECK(ps__frame_copy_data(f, n, &byte, 1) == PS_EINVAL);
    FUZZ_CHECK(ps__frame_copy_data(f, n + 1, &byte, 0) == PS_EINVAL);
    FUZZ_CHECK(ps__frame_copy_data(f, SIZE_MAX, &byte, 1) == PS_EINVAL);
    FUZZ_CHECK(ps__frame_copy_data(f, 1, &byte, SIZE_MAX) == PS_EINVAL);
}

/* Slices of a range of f's data, made to outlive f (ps__frame_data_ref):
 * up to 64 into held, the range in *from, *len. Returns how many, or -1. */
static int hold_range(const ps__frame_t *f, uint64_t seed, grpc_slice *held, size_t *from,
                      size_t *len)
{
    size_t n = f->data_len;
    *from = n ? (size_t)(seed % n) : 0;
    *len = (size_t)((seed >> 32) % (n - *from + 1));
    FUZZ_CHECK(ps__frame_data_ref(f, n + 1, 0, NULL, held, 64) == -1);
    FUZZ_CHECK(ps__frame_data_ref(f, *from, n - *from + 1, NULL, held, 64) == -1);
    return ps__frame_data_ref(f, *from, *len, NULL, held, 64);
}

/* After the frame is gone, the held slices still hold bytes [from,
 * from+len) of its data, in order, none empty; then they are released. */
static void check_held(grpc_slice *held, int k, const uint8_t *all, size_t from, size_t len)
{
    size_t at = 0;
    for (int i = 0; i < k; i++) {
        size_t l = GRPC_SLICE_LENGTH(held[i]);
        FUZZ_CHECK(l > 0 && at + l <= len);
        FUZZ_CHECK(memcmp(GRPC_SLICE_START_PTR(held[i]), all + from + at, l) == 0);
        at += l;
        grpc_slice_unref(held[i]);
    }
    FUZZ_CHECK(k < 0 || at == len);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *msg;
    size_t msg_len;
    grpc_byte_buffer *sliced = fuzz_sliced_buffer(data, size, &msg, &msg_len);
    grpc_byte_buffer *whole = fuzz_contiguous_buffer(msg, msg_len);
    ps__frame_t f, g;
    memset(&f, 0, sizeof(f));
    memset(&g, 0, sizeof(g));
    int rc = ps__frame_decode(sliced, &f);
    int rc_whole = ps__frame_decode(whole, &g);
    /* Inputs are small, so decode can only fail for the bytes themselves. */
    FUZZ_CHECK(rc == 0 || rc == PS_EINVAL);
    /* Where the slices are cut must not matter. */
    FUZZ_CHECK(rc == rc_whole);
    /* The byte buffers are not consumed; the frames hold their own refs. */
    grpc_byte_buffer_destroy(sliced);
    grpc_byte_buffer_destroy(whole);
    if (rc == 0) {
        FUZZ_CHECK(f.meta != NULL && g.meta != NULL);
        FUZZ_CHECK(f.meta->data.len == 0);
        FUZZ_CHECK(f.data_len <= msg_len && f.data_len == g.data_len);

        size_t fl, gl;
        uint8_t *fm = pack_meta(f.meta, &fl), *gm = pack_meta(g.meta, &gl);
        FUZZ_CHECK(fl == gl && memcmp(fm, gm, fl) == 0);
        uint8_t *fd = copy_all(&f), *gd = copy_all(&g);
        FUZZ_CHECK(f.data_len == 0 || memcmp(fd, gd, f.data_len) == 0);

        /* What a protobuf library reads: the same bytes where protobuf-c
         * takes them (it refuses length prefixes over 5 bytes, which the
         * frame decoder and protobuf's C++ and Python parsers accept), else
         * the frame in canonical form. Either way the fields must agree. */
        Paramsync__V1__Frame *ref = (Paramsync__V1__Frame *)protobuf_c_message_unpack(
            &paramsync__v1__frame__descriptor, NULL, msg_len, msg);
        if (!ref) {
            size_t cl = fl + 11 + f.data_len;
            uint8_t *canon = malloc(cl);
            FUZZ_CHECK(canon != NULL);
            memcpy(canon, fm, fl);
            cl = fl;
            canon[cl++] = (15 << 3) | 2;
            for (uint64_t v = f.data_len;; v >>= 7) {
                canon[cl++] = (uint8_t)(v & 0x7f) | (v >= 0x80 ? 0x80 : 0);
                if (v < 0x80)
                    break;
            }
            memcpy(canon + cl, fd, f.data_len);
            cl += f.data_len;
            ref = (Paramsync__V1__Frame *)protobuf_c_message_unpack(
                &paramsync__v1__frame__descriptor, NULL, cl, canon);
            free(canon);
        }
        FUZZ_CHECK(ref != NULL);
        FUZZ_CHECK(ref->data.len == f.data_len);
        FUZZ_CHECK(f.data_len == 0 || memcmp(ref->data.data, fd, f.data_len) == 0);
        FUZZ_CHECK(same_meta(ref, f.meta));
        protobuf_c_message_free_unpacked(&ref->base, NULL);

        uint64_t seed = 1469598103934665603ull;
        for (size_t i = 0; i < size; i++)
            seed = (seed ^ data[i]) * 1099511628211ull;
        check_ranges(&f, fd, seed);
        check_ranges(&g, gd, seed * 31 + 7);
        grpc_slice held[64];
        size_t from, len;
        int k = hold_range(&f, seed * 17 + 3, held, &from, &len);
        ps__frame_clear(&f);
        ps__frame_clear(&g);
        check_held(held, k, fd, from, len);
        free(fm);
        free(gm);
        free(fd);
        free(gd);
    } else {
        /* A failed decode leaves nothing behind to free. */
        FUZZ_CHECK(f.meta == NULL && f.slices == NULL && f.nslices == 0);
    }
    ps__frame_clear(&f);
    ps__frame_clear(&g);
    return 0;
}
