/* Fuzz target: every protobuf message paramsync unpacks from the network, through ps__rpc_unpack.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <paramsync/common.h>

#include "fuzz_input.h"
#include "grpc/health/v1/health.pb-c.h"
#include "paramsync/v1/paramsync.pb-c.h"
#include "rpc.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/*
 * The messages received from a peer: requests the daemon serves (worker,
 * coordinator, admin, health), responses and events an agent or the C
 * client reads from the coordinator or an agent, and the Frame header and
 * result. Byte 0 of an input picks one (modulo the count); the order is
 * part of the corpus format (tests/fuzz/make_corpus.py): append only.
 */
static const ProtobufCMessageDescriptor *const messages[] = {
    &paramsync__v1__join_request__descriptor,             /* 0: Worker/Coordinator.Join */
    &paramsync__v1__leave_request__descriptor,            /* 1: Leave */
    &paramsync__v1__new_group_request__descriptor,        /* 2: NewGroup */
    &paramsync__v1__describe_job_request__descriptor,     /* 3: Coordinator.DescribeJob */
    &paramsync__v1__register_agent_request__descriptor,   /* 4: Coordinator.RegisterAgent */
    &paramsync__v1__status_request__descriptor,           /* 5: Admin.Status */
    &grpc__health__v1__health_check_request__descriptor,  /* 6: Health.Check/Watch */
    &paramsync__v1__frame__descriptor,                    /* 7: Collective frames, whole */
    &paramsync__v1__collective_header__descriptor,        /* 8: Frame.header */
    &paramsync__v1__collective_result__descriptor,        /* 9: Frame.result */
    &paramsync__v1__join_event__descriptor,               /* 10: Join's events */
    &paramsync__v1__describe_job_response__descriptor,    /* 11: agent's job lookup */
    &paramsync__v1__new_group_response__descriptor,       /* 12 */
    &paramsync__v1__leave_response__descriptor,           /* 13 */
    &paramsync__v1__register_agent_response__descriptor,  /* 14 */
    &paramsync__v1__status_response__descriptor,          /* 15: paramsyncctl's view */
    &grpc__health__v1__health_check_response__descriptor, /* 16 */
};
#define NMESSAGES (sizeof(messages) / sizeof(messages[0]))

static uint64_t sink;

/* Reads every field the way the daemon's code would, so that AddressSanitizer
 * sees a string without its terminator, an array shorter than its count or
 * a dangling sub-message. */
static void walk(const ProtobufCMessage *m)
{
    const ProtobufCMessageDescriptor *d = m->descriptor;
    FUZZ_CHECK(d != NULL && d->magic == PROTOBUF_C__MESSAGE_DESCRIPTOR_MAGIC);
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *fd = &d->fields[i];
        const char *base = (const char *)m + fd->offset;
        size_t n = 1;
        if (fd->label == PROTOBUF_C_LABEL_REPEATED) {
            n = *(const size_t *)((const char *)m + fd->quantifier_offset);
            base = *(const char *const *)base;
            FUZZ_CHECK(n == 0 || base != NULL);
        }
        for (size_t k = 0; k < n; k++) {
            switch (fd->type) {
            case PROTOBUF_C_TYPE_STRING: {
                const char *s = ((const char *const *)base)[k];
                FUZZ_CHECK(s != NULL);
                sink += strlen(s);
                break;
            }
            case PROTOBUF_C_TYPE_BYTES: {
                const ProtobufCBinaryData *b = &((const ProtobufCBinaryData *)base)[k];
                for (size_t j = 0; j < b->len; j++)
                    sink += b->data[j];
                break;
            }
            case PROTOBUF_C_TYPE_MESSAGE: {
                const ProtobufCMessage *sub = ((const ProtobufCMessage *const *)base)[k];
                if (sub)
                    walk(sub);
                else
                    FUZZ_CHECK(fd->label != PROTOBUF_C_LABEL_REPEATED);
                break;
            }
            case PROTOBUF_C_TYPE_INT64:
            case PROTOBUF_C_TYPE_UINT64:
            case PROTOBUF_C_TYPE_SINT64:
            case PROTOBUF_C_TYPE_FIXED64:
            case PROTOBUF_C_TYPE_SFIXED64:
            case PROTOBUF_C_TYPE_DOUBLE: {
                uint64_t v;
                memcpy(&v, base + 8 * k, 8);
                sink += v;
                break;
            }
            case PROTOBUF_C_TYPE_BOOL:
            case PROTOBUF_C_TYPE_INT32:
            case PROTOBUF_C_TYPE_UINT32:
            case PROTOBUF_C_TYPE_SINT32:
            case PROTOBUF_C_TYPE_FIXED32:
            case PROTOBUF_C_TYPE_SFIXED32:
            case PROTOBUF_C_TYPE_FLOAT:
            case PROTOBUF_C_TYPE_ENUM: {
                uint32_t v;
                memcpy(&v, base + 4 * k, 4);
                sink += v;
                break;
            }
            }
        }
    }
}

/* protobuf-c 1.4 takes field number 0 when its key is an overlong varint
 * (0x80 0x00), keeps it as an unknown field, and then refuses its own
 * re-encoding. Harmless to paramsync (the field is ignored, and a forwarded
 * message is refused cleanly by the next hop), so the fixed-point check
 * below allows exactly this. */
static int has_field_zero(const ProtobufCMessage *m)
{
    const ProtobufCMessageDescriptor *d = m->descriptor;
    for (unsigned i = 0; i < m->n_unknown_fields; i++)
        if (m->unknown_fields[i].tag == 0)
            return 1;
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *fd = &d->fields[i];
        if (fd->type != PROTOBUF_C_TYPE_MESSAGE)
            continue;
        const char *base = (const char *)m + fd->offset;
        size_t n = 1;
        if (fd->label == PROTOBUF_C_LABEL_REPEATED) {
            n = *(const size_t *)((const char *)m + fd->quantifier_offset);
            base = *(const char *const *)base;
        }
        for (size_t k = 0; k < n; k++) {
            const ProtobufCMessage *sub = ((const ProtobufCMessage *const *)base)[k];
            if (sub && has_field_zero(sub))
                return 1;
        }
    }
    return 0;
}

static uint8_t *pack(const ProtobufCMessage *m, size_t *len)
{
    *len = protobuf_c_message_get_packed_size(m);
    uint8_t *p = malloc(*len ? *len : 1);
    FUZZ_CHECK(p != NULL);
    FUZZ_CHECK(protobuf_c_message_pack(m, p) == *len);
    return p;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    const ProtobufCMessageDescriptor *desc = messages[data[0] % NMESSAGES];
    const uint8_t *msg;
    size_t msg_len;
    grpc_byte_buffer *bb = fuzz_sliced_buffer(data + 1, size - 1, &msg, &msg_len);
    ProtobufCMessage *m = NULL;
    int rc = ps__rpc_unpack(bb, desc, &m);
    grpc_byte_buffer_destroy(bb);
    FUZZ_CHECK(rc == 0 || rc == PS_EINVAL);
    FUZZ_CHECK((rc == 0) == (m != NULL));
    /* The slices must not matter: protobuf-c on the bytes in one piece agrees. */
    ProtobufCMessage *ref = protobuf_c_message_unpack(desc, NULL, msg_len, msg);
    FUZZ_CHECK((ref != NULL) == (m != NULL));
    if (!m)
        return 0;
    FUZZ_CHECK(m->descriptor == desc);
    FUZZ_CHECK(protobuf_c_message_check(m));
    walk(m);

    /* Packing what was read and reading it back is a fixed point. */
    size_t len1, len2, len3;
    uint8_t *p1 = pack(m, &len1), *p3 = pack(ref, &len3);
    FUZZ_CHECK(len1 == len3 && memcmp(p1, p3, len1) == 0);
    ProtobufCMessage *again = protobuf_c_message_unpack(desc, NULL, len1, p1);
    FUZZ_CHECK(again != NULL || has_field_zero(m));
    if (again) {
        uint8_t *p2 = pack(again, &len2);
        FUZZ_CHECK(len1 == len2 && memcmp(p1, p2, len1) == 0);
        free(p2);
        protobuf_c_message_free_unpacked(again, NULL);
    }
    free(p1);
    free(p3);
    protobuf_c_message_free_unpacked(ref, NULL);
    protobuf_c_message_free_unpacked(m, NULL);
    return 0;
}
