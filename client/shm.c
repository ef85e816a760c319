/* The shared-memory path: payloads of local workers go through a POSIX segment the agent maps. */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "paramsync/v1/doorbell.h"

/*
 * Over gRPC every payload byte is framed, copied into the transport and out
 * of it on both sides. When the agent runs on this host (the one the worker
 * joined through) the worker instead copies its input into a segment the
 * agent has mapped, sends only the header, and copies its output back when the
 * result frame says it is there. The segment is offered once per size with
 * ShmAttach, which checks the agent really maps the same memory (magic
 * bytes); if it cannot, the comm stays on gRPC for good.
 *
 * Whatever the agent's address (a node's agent is often reached at the
 * node's own IP, or through a Kubernetes service), the segment is offered
 * once: an agent on another host cannot open it, or sees other magic bytes,
 * and says so, and the comm stays on gRPC. PARAMSYNC_SHM=0 turns the path
 * off; payloads under PS__SHM_MIN_BYTES always go as frames, where one gRPC
 * message is cheaper than two copies.
 */

#define PS__SHM_MIN_BYTES (64u << 10)
#define PS__SHM_ALIGN     4096u

struct ps__shm {
    char name[64];
    uint8_t *base;
    size_t size;
    int in_use;   /* one collective at a time uses the segment */
    int disabled; /* the agent cannot map our segments */
};

/* PARAMSYNC_SHM=0: neither segment; read on every collective. */
static int shm_off(void)
{
    const char *env = getenv("PARAMSYNC_SHM");
    return env && strcmp(env, "0") == 0;
}

static void segment_unmap(struct ps__shm *s)
{
    if (s->base) {
        munmap(s->base, s->size);
        s->base = NULL;
        s->size = 0;
    }
}

/* Creates a segment of size bytes and offers it to the agent, as a payload
 * segment or a doorbell. 0 when the agent attached it; a negative code
 * otherwise (the segment is gone). */
static int segment_create(ps_comm_t *comm, struct ps__shm *s, size_t size, int doorbell)
{
    static unsigned counter;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t magic = ((uint64_t)getpid() << 32) ^ (uint64_t)ts.tv_nsec ^ (uint64_t)++counter;
    snprintf(s->name, sizeof(s->name), "/paramsync.%d.%u.%llx", (int)getpid(), counter,
             (unsigned long long)(ts.tv_nsec & 0xffffff));
    int fd = shm_open(s->name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0)
        return PS_EUNAVAIL;
    int rc = 0;
    if (ftruncate(fd, (off_t)size) != 0)
        rc = PS_ENOMEM;
    uint8_t *base = rc ? MAP_FAILED : mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (base == MAP_FAILED) {
        shm_unlink(s->name);
        return PS_ENOMEM;
    }
    memcpy(base, &magic, sizeof(magic));

    Paramsync__V1__ShmAttachRequest req = PARAMSYNC__V1__SHM_ATTACH_REQUEST__INIT;
    Paramsync__V1__ShmAttachResponse *resp = NULL;
    req.job = comm->job;
    req.rank = comm->rank;
    req.name = s->name;
    req.size = size;
    req.magic = magic;
    req.doorbell = doorbell;
    rc = ps__rpc_unary(comm->channel, PS__METHOD_SHM_ATTACH, &req.base,
                       &paramsync__v1__shm_attach_response__descriptor, (ProtobufCMessage **)&resp,
                       PS__CONTROL_TIMEOUT_MS, NULL);
    int attached = rc == 0 && resp->attached;
    if (resp)
        protobuf_c_message_free_unpacked(&resp->base, NULL);
    /* The agent unlinks the name once it maps the segment; do it here too
     * for every other outcome, so nothing is left in /dev/shm. */
    shm_unlink(s->name);
    if (!attached) {
        munmap(base, size);
        return rc < 0 ? rc : PS_ENOTSUP;
    }
    s->base = base;
    s->size = size;
    return 0;
}

int ps__shm_begin(ps_comm_t *comm, ps__coll_t *c)
{
    /* all_reduce and reduce produce step by step what they consume, at the
     * same offsets: the agent writes each output step over its input, which
     * it has reduced by then, so the segment holds the tensor once. Other
     * kinds put the output after the input. */
    int in_place = c->hdr.kind == PARAMSYNC__V1__COLLECTIVE_KIND__ALL_REDUCE ||
                   c->hdr.kind == PARAMSYNC__V1__COLLECTIVE_KIND__REDUCE;
    size_t out_off =
        in_place ? 0 : (c->in_bytes + PS__SHM_ALIGN - 1) / PS__SHM_ALIGN * PS__SHM_ALIGN;
    size_t need = in_place ? (c->in_bytes > c->out_bytes ? c->in_bytes : c->out_bytes)
                           : out_off + c->out_bytes;
    if (c->in_bytes + c->out_bytes < PS__SHM_MIN_BYTES)
        return 0;
    if (shm_off())
        return 0;
    pthread_mutex_lock(&comm->lock);
    struct ps__shm *s = comm->shm;
    if (!s && (s = calloc(1, sizeof(*s))))
        comm->shm = s;
    if (!s || s->disabled || s->in_use) {
        pthread_mutex_unlock(&comm->lock);
        return 0;
    }
    s->in_use = 1;
    pthread_mutex_unlock(&comm->lock);

    if (s->size < need) {
        /* Grow by doubling so a training loop settles on one segment. */
        size_t size = s->size ? s->size : PS__SHM_ALIGN;
        while (size < need)
            size *= 2;
        segment_unmap(s);
        int rc = segment_create(comm, s, size, 0);
        if (rc < 0) {
            pthread_mutex_lock(&comm->lock);
            s->in_use = 0;
            /* An agent that cannot map ours never will: stay on gRPC. */
            s->disabled = rc == PS_ENOTSUP || rc == PS_EUNAVAIL;
            pthread_mutex_unlock(&comm->lock);
            return 0;
        }
    }
    if (c->in_bytes)
        memcpy(s->base, c->in, c->in_bytes);
    c->hdr.shm = s->name;
    c->hdr.shm_out_offset = out_off;
    c->shm_out = s->base + out_off;
    return 1;
}

void ps__shm_end(ps_comm_t *comm, ps__coll_t *c)
{
    if (!c->shm_out)
        return;
    pthread_mutex_lock(&comm->lock);
    comm->shm->in_use = 0;
    pthread_mutex_unlock(&comm->lock);
    c->shm_out = NULL;
    c->hdr.shm = (char *)protobuf_c_empty_string;
}

/*
 * The doorbell (proto/paramsync/v1/doorbell.h): when the agent hosts the
 * job, a collective whose input and output fit in a page goes without a gRPC
 * call: the header and input into a second, small segment, a futex wake, a
 * futex wait for the answer. A gRPC call costs several thread hand-offs in
 * gRPC's core on both sides; this costs two wake-ups. One collective at a
 * time uses it (a concurrent one takes a call); a request abandoned (the job
 * broke while it waited) retires the doorbell, since the agent may still
 * answer into it.
 */

struct ps__doorbell {
    struct ps__shm seg;
    ps_doorbell_ctl_t *ctl;
    int in_use;
    int disabled;
};

int ps__doorbell_run(ps_comm_t *comm, ps__coll_t *c, int *rc, char **msg)
{
    if (c->in_bytes > PS_DOORBELL_PAYLOAD || c->out_bytes > PS_DOORBELL_PAYLOAD)
        return 0;
    if (shm_off())
        return 0;
    pthread_mutex_lock(&comm->lock);
    struct ps__doorbell *d = comm->doorbell;
    if (!d && (d = calloc(1, sizeof(*d))))
        comm->doorbell = d;
    if (!d || d->disabled || d->in_use || comm->broken || comm->finalizing) {
        pthread_mutex_unlock(&comm->lock);
        return 0;
    }
    d->in_use = 1;
    pthread_mutex_unlock(&comm->lock);

    if (!d->seg.base) {
        int err = segment_create(comm, &d->seg, PS_DOORBELL_SIZE, 1);
        if (err < 0) {
            pthread_mutex_lock(&comm->lock);
            d->in_use = 0;
            /* Refused (not the job's hub, another host, an older agent) or
             * failed: calls it is, for good. */
            d->disabled = 1;
            pthread_mutex_unlock(&comm->lock);
            return 0;
        }
        d->ctl = (ps_doorbell_ctl_t *)(void *)(d->seg.base + PS_DOORBELL_CTL);
    }
    ps_doorbell_ctl_t *ctl = d->ctl;
    c->hdr.shm = d->seg.name;
    c->hdr.shm_out_offset = PS_DOORBELL_OUT;
    size_t hl = protobuf_c_message_get_packed_size(&c->hdr.base);
    if (hl > PS_DOORBELL_HEADER || __atomic_load_n(&ctl->closed, __ATOMIC_ACQUIRE)) {
        c->hdr.shm = (char *)protobuf_c_empty_string;
        c->hdr.shm_out_offset = 0;
        pthread_mutex_lock(&comm->lock);
        d->in_use = 0;
        d->disabled |= ctl->closed != 0;
        pthread_mutex_unlock(&comm->lock);
        return 0;
    }
    protobuf_c_message_pack(&c->hdr.base, ctl->header);
    ctl->header_len = (uint32_t)hl;
    c->hdr.shm = (char *)protobuf_c_empty_string;
    c->hdr.shm_out_offset = 0;
    if (c->in_bytes)
        memcpy(d->seg.base, c->in, c->in_bytes);
    uint32_t req = __atomic_load_n(&ctl->req, __ATOMIC_RELAXED) + 1;
    __atomic_store_n(&ctl->req, req, __ATOMIC_RELEASE);
    ps_doorbell_futex(&ctl->req, FUTEX_WAKE, 1, NULL);

    for (;;) {
        uint32_t r = __atomic_load_n(&ctl->resp, __ATOMIC_ACQUIRE);
        if (r == req)
            break;
        /* Short waits: a job that breaks meanwhile (a peer lost, the agent
         * gone) is noticed on the next turn. */
        struct timespec slice = {0, 50 * 1000 * 1000};
        ps_doorbell_futex(&ctl->resp, FUTEX_WAIT, r, &slice);
        if (__atomic_load_n(&ctl->resp, __ATOMIC_ACQUIRE) == req)
            break;
        pthread_mutex_lock(&comm->lock);
        int broken = comm->broken, gone = comm->join_ended;
        char *why = broken && comm->broken_msg ? strdup(comm->broken_msg) : NULL;
        if (broken || gone || __atomic_load_n(&ctl->closed, __ATOMIC_ACQUIRE))
            d->disabled = 1; /* abandoned: the agent may still answer into it */
        pthread_mutex_unlock(&comm->lock);
        if (d->disabled) {
            *rc = broken ? broken : PS_EUNAVAIL;
            *msg = why ? why
                       : strdup(gone ? "lost the membership stream to the agent"
                                     : "the agent closed the doorbell (it is stopping)");
            return 1;
        }
        free(why);
    }
    int code = ctl->code;
    if (code != 0) {
        *rc = code > 0 ? -code : PS_EUNKNOWN;
        *msg = strndup(ctl->message, sizeof(ctl->message) - 1); /* NUL-ended by the agent */
    } else if (c->out_bytes && !ctl->shm) {
        *rc = PS_EINTERNAL;
        *msg = strdup("the agent answered the doorbell without the output");
    } else {
        if (c->out_bytes)
            memcpy(c->out, d->seg.base + PS_DOORBELL_OUT, c->out_bytes);
        c->source = ctl->source;
        *rc = 0;
    }
    pthread_mutex_lock(&comm->lock);
    d->in_use = 0;
    pthread_mutex_unlock(&comm->lock);
    return 1;
}

void ps__shm_free(ps_comm_t *comm)
{
    if (comm->doorbell) {
        segment_unmap(&comm->doorbell->seg);
        free(comm->doorbell);
        comm->doorbell = NULL;
    }
    if (!comm->shm)
        return;
    segment_unmap(comm->shm);
    free(comm->shm);
    comm->shm = NULL;
}
