/* Frame codec: protobuf wire format with the tensor bytes kept in their own slices. */
#include "frame.h"

#include <stdlib.h>
#include <string.h>

#include <grpc/byte_buffer_reader.h>
#include <grpc/slice.h>
#include <grpc/slice_buffer.h>

#include <paramsync/common.h>

#define FRAME_DATA_FIELD 15
#define WIRE_VARINT      0
#define WIRE_I64         1
#define WIRE_LEN         2
#define WIRE_I32         5

static size_t varint_put(uint8_t *p, uint64_t v)
{
    size_t n = 0;
    while (v >= 0x80) {
        p[n++] = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    p[n++] = (uint8_t)v;
    return n;
}

/* The frame's bytes before its data: the small fields of meta, and the
 * data field's tag and length when len > 0. */
static grpc_slice meta_head(const Paramsync__V1__Frame *meta, size_t len)
{
    size_t msize = protobuf_c_message_get_packed_size(&meta->base);
    grpc_slice head = grpc_slice_malloc(msize + (len ? 11 : 0));
    uint8_t *p = GRPC_SLICE_START_PTR(head);
    protobuf_c_message_pack(&meta->base, p);
    size_t used = msize;
    if (len) {
        p[used++] = (FRAME_DATA_FIELD << 3) | WIRE_LEN;
        used += varint_put(p + used, len);
    }
    return grpc_slice_sub_no_ref(head, 0, used);
}

static grpc_slice frame_head(const Paramsync__V1__CollectiveHeader *header,
                             const Paramsync__V1__CollectiveResult *result, uint64_t offset,
                             size_t len)
{
    Paramsync__V1__Frame meta = PARAMSYNC__V1__FRAME__INIT;
    meta.header = (Paramsync__V1__CollectiveHeader *)header;
    meta.result = (Paramsync__V1__CollectiveResult *)result;
    meta.offset = offset;
    return meta_head(&meta, len);
}

grpc_byte_buffer *ps__frame_encode_end(const Paramsync__V1__CollectiveResult *result)
{
    Paramsync__V1__Frame meta = PARAMSYNC__V1__FRAME__INIT;
    meta.result = (Paramsync__V1__CollectiveResult *)result;
    meta.end = 1;
    grpc_slice head = meta_head(&meta, 0);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&head, 1);
    grpc_slice_unref(head);
    return bb;
}

int ps__frame_is_end(const ps__frame_t *f)
{
    return f->meta && f->meta->end && !f->meta->header && !f->data_len;
}

grpc_byte_buffer *ps__frame_encode(const Paramsync__V1__CollectiveHeader *header,
                                   const Paramsync__V1__CollectiveResult *result, uint64_t offset,
                                   const void *data, size_t len, ps__frame_release_fn release,
                                   void *release_arg)
{
    grpc_slice slices[2];
    size_t n = 0;
    slices[n++] = frame_head(header, result, offset, len);
    if (len) {
        if (release)
            slices[n++] = grpc_slice_new_with_user_data((void *)data, len, release, release_arg);
        else
            slices[n++] = grpc_slice_from_copied_buffer(data, len);
    } else if (release) {
        release(release_arg);
    }
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(slices, n);
    for (size_t i = 0; i < n; i++)
        grpc_slice_unref(slices[i]);
    return bb;
}

grpc_byte_buffer *ps__frame_encode_slices(const Paramsync__V1__CollectiveHeader *header,
                                          const Paramsync__V1__CollectiveResult *result,
                                          uint64_t offset, grpc_slice *data, int n)
{
    size_t len = 0;
    for (int i = 0; i < n; i++)
        len += GRPC_SLICE_LENGTH(data[i]);
    grpc_slice head = frame_head(header, result, offset, len);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&head, 1);
    grpc_slice_unref(head);
    for (int i = 0; i < n; i++)
        grpc_slice_buffer_add(&bb->data.raw.slice_buffer, data[i]);
    return bb;
}

/* A cursor over the received slices. */
typedef struct cursor {
    const ps__frame_t *f;
    size_t si, off;
} cursor_t;

static int cur_byte(cursor_t *c, uint8_t *b)
{
    while (c->si < c->f->nslices && c->off >= GRPC_SLICE_LENGTH(c->f->slices[c->si])) {
        c->si++;
        c->off = 0;
    }
    if (c->si >= c->f->nslices)
        return -1;
    *b = GRPC_SLICE_START_PTR(c->f->slices[c->si])[c->off++];
    return 0;
}

static int cur_varint(cursor_t *c, uint64_t *v)
{
    uint64_t r = 0;
    for (int shift = 0; shift < 64; shift += 7) {
        uint8_t b;
        if (cur_byte(c, &b) < 0)
            return -1;
        r |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *v = r;
            return 0;
        }
    }
    return -1;
}

/* Copies (dst != NULL) or skips n bytes. */
static int cur_take(cursor_t *c, uint8_t *dst, size_t n)
{
    while (n > 0) {
        if (c->si >= c->f->nslices)
            return -1;
        size_t avail = GRPC_SLICE_LENGTH(c->f->slices[c->si]) - c->off;
        if (avail == 0) {
            c->si++;
            c->off = 0;
            continue;
        }
        size_t k = avail < n ? avail : n;
        if (dst) {
            memcpy(dst, GRPC_SLICE_START_PTR(c->f->slices[c->si]) + c->off, k);
            dst += k;
        }
        c->off += k;
        n -= k;
    }
    return 0;
}

/* The small fields are copied into a buffer that protobuf-c unpacks. */
typedef struct metabuf {
    uint8_t *p;
    size_t len, cap;
} metabuf_t;

static uint8_t *meta_reserve(metabuf_t *m, size_t n)
{
    if (m->len + n > m->cap) {
        size_t cap = m->cap ? m->cap : 256;
        while (cap < m->len + n)
            cap *= 2;
        uint8_t *np = realloc(m->p, cap);
        if (!np)
            return NULL;
        m->p = np;
        m->cap = cap;
    }
    uint8_t *r = m->p + m->len;
    m->len += n;
    return r;
}

int ps__frame_decode(grpc_byte_buffer *bb, ps__frame_t *out)
{
    ps__frame_t f;
    metabuf_t m = {0};
    int rc = PS_EINVAL, have_data = 0;
    grpc_byte_buffer_reader r;
    size_t cap = 0;
    memset(&f, 0, sizeof(f));
    if (!bb || !grpc_byte_buffer_reader_init(&r, bb))
        return PS_EINVAL;
    grpc_slice s;
    while (grpc_byte_buffer_reader_next(&r, &s)) {
        if (f.nslices == cap) {
            size_t ncap = cap ? cap * 2 : 32;
            grpc_slice *ns = realloc(f.slices, ncap * sizeof(*ns));
            if (!ns) {
                grpc_slice_unref(s);
                grpc_byte_buffer_reader_destroy(&r);
                rc = PS_ENOMEM;
                goto fail;
            }
            f.slices = ns;
            cap = ncap;
        }
        f.slices[f.nslices++] = s;
    }
    grpc_byte_buffer_reader_destroy(&r);

    cursor_t c = {&f, 0, 0};
    for (;;) {
        uint64_t key, v;
        uint8_t b;
        if (cur_byte(&c, &b) < 0)
            break; /* clean end of message */
        c.off--;   /* un-read: the key is a varint */
        if (cur_varint(&c, &key) < 0 || (key >> 3) == 0 || (key >> 3) > 0x1fffffff)
            goto fail;
        unsigned wt = key & 7;
        if ((key >> 3) == FRAME_DATA_FIELD) {
            if (wt != WIRE_LEN || have_data || cur_varint(&c, &v) < 0)
                goto fail;
            have_data = 1;
            f.data_len = v;
            /* Normalise the position to the slice holding the first byte. */
            while (c.si < f.nslices && c.off >= GRPC_SLICE_LENGTH(f.slices[c.si])) {
                c.si++;
                c.off = 0;
            }
            f.data_slice = c.si;
            f.data_offset = c.off;
            if (cur_take(&c, NULL, v) < 0)
                goto fail;
            continue;
        }
        uint8_t tmp[10];
        uint8_t *dst = meta_reserve(&m, varint_put(tmp, key));
        if (!dst) {
            rc = PS_ENOMEM;
            goto fail;
        }
        memcpy(dst, tmp, varint_put(tmp, key));
        size_t n;
        switch (wt) {
        case WIRE_VARINT:
            if (cur_varint(&c, &v) < 0)
                goto fail;
            n = varint_put(tmp, v);
            if (!(dst = meta_reserve(&m, n))) {
                rc = PS_ENOMEM;
                goto fail;
            }
            memcpy(dst, tmp, n);
            break;
        case WIRE_I64:
        case WIRE_I32:
            n = wt == WIRE_I64 ? 8 : 4;
            if (!(dst = meta_reserve(&m, n))) {
                rc = PS_ENOMEM;
                goto fail;
            }
            if (cur_take(&c, dst, n) < 0)
                goto fail;
            break;
        case WIRE_LEN:
            if (cur_varint(&c, &v) < 0 || v > (64u << 20))
                goto fail;
            n = varint_put(tmp, v);
            if (!(dst = meta_reserve(&m, n + v))) {
                rc = PS_ENOMEM;
                goto fail;
            }
            memcpy(dst, tmp, n);
            if (cur_take(&c, dst + n, v) < 0)
                goto fail;
            break;
        default: /* groups are not part of proto3 */
            goto fail;
        }
    }
    f.meta = (Paramsync__V1__Frame *)protobuf_c_message_unpack(&paramsync__v1__frame__descriptor,
                                                               NULL, m.len, m.p);
    if (!f.meta)
        goto fail;
    free(m.p);
    *out = f;
    return 0;
fail:
    free(m.p);
    ps__frame_clear(&f);
    return rc;
}

int ps__frame_copy_data(const ps__frame_t *f, size_t from, void *dst, size_t len)
{
    if (from > f->data_len || len > f->data_len - from)
        return PS_EINVAL;
    cursor_t c = {f, f->data_slice, f->data_offset};
    if (cur_take(&c, NULL, from) < 0 || cur_take(&c, dst, len) < 0)
        return PS_EINVAL;
    return 0;
}

int ps__frame_data_ref(const ps__frame_t *f, size_t from, size_t len, struct iovec *iov,
                       grpc_slice *held, int max)
{
    if (from > f->data_len || len > f->data_len - from)
        return -1;
    size_t off = f->data_offset;
    int n = 0;
    for (size_t si = f->data_slice; len && si < f->nslices; si++, off = 0) {
        size_t avail = GRPC_SLICE_LENGTH(f->slices[si]) - off;
        if (from >= avail) { /* before the range */
            from -= avail;
            continue;
        }
        off += from;
        avail -= from;
        from = 0;
        size_t k = avail < len ? avail : len;
        if (n == max)
            break;
        if (held) /* a short one is copied into the slice itself (inlined) */
            held[n] = grpc_slice_sub(f->slices[si], off, off + k);
        else
            iov[n] = (struct iovec){GRPC_SLICE_START_PTR(f->slices[si]) + off, k};
        n++;
        len -= k;
    }
    if (len && held)
        for (int i = 0; i < n; i++)
            grpc_slice_unref(held[i]);
    return len ? -1 : n;
}

int ps__frame_data_iov(const ps__frame_t *f, struct iovec *iov, int max)
{
    return ps__frame_data_ref(f, 0, f->data_len, iov, NULL, max);
}

void ps__frame_clear(ps__frame_t *f)
{
    if (!f)
        return;
    if (f->meta)
        protobuf_c_message_free_unpacked(&f->meta->base, NULL);
    for (size_t i = 0; i < f->nslices; i++)
        grpc_slice_unref(f->slices[i]);
    free(f->slices);
    memset(f, 0, sizeof(*f));
}
