/* The doorbell segment: small collectives of a worker on its job's hub agent, without a call. */
#ifndef PARAMSYNC_V1_DOORBELL_H
#define PARAMSYNC_V1_DOORBELL_H

#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/*
 * Part of the wire contract, like paramsync.proto. A worker whose agent runs
 * on its host may offer the agent a second POSIX segment of PS_DOORBELL_SIZE
 * bytes (ShmAttach with doorbell = true).
 * A collective whose input and output each fit in PS_DOORBELL_PAYLOAD bytes
 * then goes as follows, instead of as a Collective call:
 *
 *   worker: input at offset 0; the packed CollectiveHeader (shm = this
 *           segment's name, shm_out_offset = PS_DOORBELL_OUT) in `header`;
 *           then req += 1 (release) and FUTEX_WAKE on req.
 *   agent:  serves it as if a Collective call had brought that header
 *           (at this agent, or forwarded to the job's hub agent),
 *           output at PS_DOORBELL_OUT; fills code, message, source; then
 *           resp = req (release) and FUTEX_WAKE on resp.
 *
 * An agent whose ShmAttach answer had doorbell_segments set also takes a
 * request whose header names another segment of the same rank (its payload
 * segment or registered memory: shm, shm_in_offset, shm_out_offset as in a
 * Collective call) with the input there, of any size; the output goes there
 * too, and nothing is read from or written to this segment's payload bytes.
 *
 * One request at a time per segment. `closed`, set by the agent, says it
 * serves no more requests here (the worker goes back to gRPC calls); with
 * PS_DOORBELL_STOPPED also set, the request rung last is not being served
 * either, so nothing more will be written into the worker's buffers for it
 * (a request naming the process segment: CollectiveHeader.shm_process). The
 * words are shared between processes: futexes without FUTEX_PRIVATE_FLAG.
 */

#define PS_DOORBELL_SIZE    8192u
#define PS_DOORBELL_PAYLOAD 2048u /* the most input, and the most output, bytes */
#define PS_DOORBELL_OUT     2048u /* offset of the output */
#define PS_DOORBELL_CTL     4096u /* offset of the ps_doorbell_ctl_t */
#define PS_DOORBELL_HEADER  1024u /* the largest packed header */
#define PS_DOORBELL_CLOSED  1u    /* bits of ps_doorbell_ctl_t.closed */
#define PS_DOORBELL_STOPPED 2u

typedef struct ps_doorbell_ctl {
    uint32_t req;    /* futex: requests the worker has rung */
    uint32_t resp;   /* futex: the last request answered */
    uint32_t closed; /* PS_DOORBELL_CLOSED: the agent serves no more requests;
                      * | PS_DOORBELL_STOPPED: and writes nothing more anywhere */
    uint32_t header_len;
    uint8_t header[PS_DOORBELL_HEADER];
    int32_t code;       /* the answer: a gRPC status code */
    int32_t source;     /* RECV: the sender's rank */
    uint32_t shm;       /* CollectiveResult.shm: the output is at PS_DOORBELL_OUT */
    char message[2048]; /* NUL-terminated */
} ps_doorbell_ctl_t;

/* FUTEX_WAIT / FUTEX_WAKE on a word of the segment, shared between the two
 * processes (so never FUTEX_PRIVATE_FLAG); timeout is relative, or NULL. */
static inline long ps_doorbell_futex(uint32_t *word, int op, uint32_t val,
                                     const struct timespec *timeout)
{
    return syscall(SYS_futex, word, op, val, timeout, NULL, 0);
}

#endif
