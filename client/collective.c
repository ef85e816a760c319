/* One collective call on the wire: the Collective stream, sending and receiving at once. */
#include "internal.h"
#include "task.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int ps__coll_init(ps__coll_t *c)
{
    if (pthread_mutex_init(&c->lock, NULL) != 0)
        return PS_ENOMEM;
    if (pthread_cond_init(&c->released, NULL) != 0) {
        pthread_mutex_destroy(&c->lock);
        return PS_ENOMEM;
    }
    c->pending_releases = 0;
    c->call = NULL;
    c->prev = c->next = NULL;
    c->source = -1;
    return 0;
}

void ps__coll_destroy(ps__coll_t *c)
{
    pthread_cond_destroy(&c->released);
    pthread_mutex_destroy(&c->lock);
}

/* gRPC is done with one input frame's reference to the caller's buffer. */
static void frame_released(void *arg)
{
    ps__coll_t *c = arg;
    pthread_mutex_lock(&c->lock);
    if (--c->pending_releases == 0)
        pthread_cond_broadcast(&c->released);
    pthread_mutex_unlock(&c->lock);
}

/* Sends one frame of input bytes [off, off+len), referencing them in place. */
static int send_frame(ps__coll_t *c, const Paramsync__V1__CollectiveHeader *hdr, size_t off,
                      size_t len, int last)
{
    pthread_mutex_lock(&c->lock);
    c->pending_releases++;
    pthread_mutex_unlock(&c->lock);
    const void *data = len ? (const char *)c->in + off : NULL;
    grpc_byte_buffer *bb = ps__frame_encode(hdr, NULL, off, data, len, frame_released, c);
    if (!bb)
        return PS_ENOMEM; /* the encoder already released the reference */
    /* The last frame carries the half-close in the same batch. */
    int rc = last ? ps__rpc_call_send_last(c->call, bb, 0, NULL) : ps__rpc_call_send(c->call, bb);
    grpc_byte_buffer_destroy(bb);
    return rc;
}

static size_t first_frame_len(const ps__coll_t *c)
{
    return c->in_bytes < c->comm->chunk_bytes ? c->in_bytes : c->comm->chunk_bytes;
}

/* Sends the input frames after the first, then half-closes. Runs on a
 * thread of its own (a kept one, rpc/task.h) for multi-frame inputs,
 * because the daemon streams results back while inputs still arrive: a
 * client that only sends would stall HTTP/2 flow control on both sides.
 * Failures end the call, and the receiver sees them in the status. */
static void *sender_main(void *arg)
{
    ps__coll_t *c = arg;
    size_t chunk = c->comm->chunk_bytes;
    for (size_t off = first_frame_len(c); off < c->in_bytes; off += chunk) {
        size_t len = c->in_bytes - off < chunk ? c->in_bytes - off : chunk;
        int rc = send_frame(c, NULL, off, len, off + len == c->in_bytes);
        if (rc < 0) {
            if (rc == PS_ENOMEM)
                ps__rpc_call_cancel(c->call, -PS_ENOMEM, "out of memory sending a frame");
            return NULL;
        }
    }
    return NULL;
}

/* The outcome of the receive side, before the status is known. */
typedef struct recv_state {
    int have_result;
    int result_code;
    char *result_msg;
    size_t received;
    int local_err; /* a fault this side found in what the daemon sent */
    char *local_msg;
} recv_state_t;

static void fail_local(ps__coll_t *c, recv_state_t *st, int err, char *msg)
{
    if (!st->local_err) {
        st->local_err = err;
        st->local_msg = msg;
        /* Stops the daemon's side and a sender blocked on flow control. */
        ps__rpc_call_cancel(c->call, -err, msg ? msg : ps_strerror(err));
    } else {
        free(msg);
    }
}

/* Takes one response frame: the result first, then output bytes at their
 * offsets, straight into the caller's buffer. */
static void take_frame(ps__coll_t *c, recv_state_t *st, grpc_byte_buffer *bb)
{
    ps__frame_t f;
    memset(&f, 0, sizeof(f));
    int rc = ps__frame_decode(bb, &f);
    if (rc < 0) {
        fail_local(c, st, rc == PS_ENOMEM ? PS_ENOMEM : PS_EINTERNAL,
                   strdup("malformed frame from the agent"));
        return;
    }
    const Paramsync__V1__CollectiveResult *res = f.meta->result;
    if (!st->have_result) {
        if (!res) {
            fail_local(c, st, PS_EINTERNAL, strdup("the agent's first frame has no result"));
            goto out;
        }
        st->have_result = 1;
        st->result_code = res->code;
        if (res->code != 0) {
            st->result_msg = strdup(res->message ? res->message : "");
        } else if (res->bytes != c->out_bytes) {
            fail_local(c, st, PS_EDATALOSS,
                       ps__strdupf("the agent announced %llu result bytes; this rank expects %zu",
                                   (unsigned long long)res->bytes, c->out_bytes));
            goto out;
        }
        c->source = res->source;
        if (res->code == 0 && res->shm) {
            /* The agent wrote the output into the segment. */
            if (!c->shm_out) {
                fail_local(c, st, PS_EINTERNAL,
                           strdup("the agent answered in shared memory this call did not use"));
                goto out;
            }
            if (c->out_bytes && c->out != c->shm_out) /* else registered memory */
                memcpy(c->out, c->shm_out, c->out_bytes);
            st->received = c->out_bytes;
        }
    }
    if (f.data_len) {
        uint64_t off = f.meta->offset;
        /* Any order: round a ring an all_gather's blocks take turns. */
        if (off > c->out_bytes || f.data_len > c->out_bytes - off ||
            f.data_len > c->out_bytes - st->received) {
            fail_local(c, st, PS_EDATALOSS,
                       ps__strdupf("the agent sent result bytes [%llu, %llu) after %zu; this "
                                   "rank expects %zu in all",
                                   (unsigned long long)off, (unsigned long long)(off + f.data_len),
                                   st->received, c->out_bytes));
            goto out;
        }
        rc = ps__frame_copy_data(&f, 0, (char *)c->out + off, f.data_len);
        if (rc < 0) {
            fail_local(c, st, PS_EINTERNAL, strdup("cannot read a frame's data"));
            goto out;
        }
        st->received += f.data_len;
    }
out:
    ps__frame_clear(&f);
}

/* Settles the outcome; returns the code and leaves the message in *msg. */
static int outcome(ps__coll_t *c, recv_state_t *st, int status, char **status_msg, char **msg)
{
    if (st->local_err) {
        *msg = st->local_msg;
        st->local_msg = NULL;
        return st->local_err;
    }
    if (status < 0) {
        *msg = *status_msg;
        *status_msg = NULL;
        return status;
    }
    if (st->have_result && st->result_code != 0) {
        *msg = st->result_msg;
        st->result_msg = NULL;
        /* The result's code travels as a gRPC status code. */
        return st->result_code > 0 ? -st->result_code : PS_EUNKNOWN;
    }
    if (!st->have_result) {
        *msg = strdup("the agent ended the call without a result");
        return PS_EINTERNAL;
    }
    if (st->received != c->out_bytes) {
        *msg = ps__strdupf("the agent sent %zu result bytes; this rank expects %zu", st->received,
                           c->out_bytes);
        return PS_EDATALOSS;
    }
    return 0;
}

void ps__coll_what(const ps__coll_t *c, char *what, size_t size)
{
    snprintf(what, size, "%s (group %u, seq %llu)", c->name, c->hdr.group,
             (unsigned long long)c->hdr.seq);
}

int ps__coll_run(ps__coll_t *c)
{
    ps_comm_t *comm = c->comm;
    recv_state_t st;
    ps__task_t sender;
    ps__rpc_call_t *call = NULL;
    int sender_started = 0;
    char *status_msg = NULL, *msg = NULL;
    int rc;
    memset(&st, 0, sizeof(st));

    /* Its steps report their own failures. */
    if ((c->peer_descs && ps__peer_run(c, &rc)) || (c->bar_k && ps__bar_run(c, &rc))) {
        rc = ps__stage_end(c, rc);
        ps__inflight_remove(comm, c);
        return rc;
    }
    /* Through the agent: an uneven all_to_all's blocks padded now. */
    ps__a2av_pack(c);
    if (ps__doorbell_run(comm, c, &rc, &msg))
        goto done;
    rc = ps__rpc_call_start(comm->channel, PS__METHOD_COLLECTIVE,
                            comm->timeout_ms + PS__DEADLINE_GRACE_MS, &call);
    if (rc < 0) {
        msg = strdup("cannot start the call");
        goto done;
    }
    rc = ps__inflight_attach(comm, c, call, &msg);
    if (rc < 0)
        goto done;

    /* Small inputs travel with the header: one message, one round trip.
     * With shared memory the header travels alone. */
    int shm = ps__shm_begin(comm, c, 0);
    size_t first = shm ? 0 : first_frame_len(c);
    int more = !shm && first < c->in_bytes;
    rc = send_frame(c, &c->hdr, 0, first, !more);
    if (rc == 0 && more) {
        if (ps__task_start(&sender, sender_main, c) == 0)
            sender_started = 1;
        else
            fail_local(c, &st, PS_ENOMEM, strdup("no thread to send the input"));
    } else if (rc == PS_ENOMEM) {
        fail_local(c, &st, PS_ENOMEM, strdup("out of memory sending the header"));
    }
    /* Other send failures mean the call is over: the status says why. */

    for (;;) {
        grpc_byte_buffer *bb = NULL;
        if (ps__rpc_call_recv(call, &bb) < 0 || !bb)
            break;
        take_frame(c, &st, bb);
        grpc_byte_buffer_destroy(bb);
    }
    int status = ps__rpc_call_finish(call, &status_msg);
    rc = outcome(c, &st, status, &status_msg, &msg);
    ps__shm_end(comm, c);
    if (sender_started) {
        /* A sender still blocked in a send of a failed call must not wait
         * for flow control that will never come. */
        if (rc < 0)
            ps__rpc_call_cancel(call, -rc, "the collective failed");
        ps__task_join(&sender);
    }
    ps__inflight_detach(comm, c);

done:
    ps__rpc_call_destroy(call);
    /* Only now may the caller reuse its buffer. */
    pthread_mutex_lock(&c->lock);
    while (c->pending_releases > 0)
        pthread_cond_wait(&c->released, &c->lock);
    pthread_mutex_unlock(&c->lock);
    if (rc < 0) {
        char what[96];
        ps__coll_what(c, what, sizeof(what));
        ps__report(comm, rc, what, "%s", msg && *msg ? msg : ps_strerror(rc));
    }
    free(msg);
    free(status_msg);
    free(st.result_msg);
    free(st.local_msg);
    /* Still on the in-flight list, so comm lives: a non-blocking call
     * copies its result to device memory before it is reported done. */
    rc = ps__stage_end(c, rc);
    ps__inflight_remove(comm, c);
    return rc;
}
