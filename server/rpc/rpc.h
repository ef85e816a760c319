/* The one thin wrapper over gRPC's C core, used by the daemon and the C client. */
#ifndef PS_RPC_H
#define PS_RPC_H

#include <stddef.h>
#include <pthread.h>
#include <stdint.h>
#include <time.h>

#include <grpc/byte_buffer.h>
#include <grpc/grpc.h>
#include <protobuf-c/protobuf-c.h>

/*
 * Model: every call has its own pluck completion queue, and the code that
 * owns a call blocks on its operations. A call may have one sender thread
 * and one receiver thread at once (full duplex); any thread may cancel it.
 * Servers run each accepted call's handler on a thread of its own.
 *
 * Errors are negative PS_E* codes; the magnitude of each is the gRPC status
 * code, so ps__rpc_status_to_err(code) == -code.
 */

typedef struct ps__rpc_server ps__rpc_server_t;
typedef struct ps__rpc_channel ps__rpc_channel_t;
typedef struct ps__rpc_call ps__rpc_call_t;

/* Handles one accepted call on its own thread. Must end the call with
 * ps__rpc_call_send_status (if it does not, the wrapper ends it with
 * INTERNAL). The wrapper frees the call when the handler returns. */
typedef void (*ps__rpc_handler_fn)(ps__rpc_call_t *call, void *arg);

/** Transport settings shared by servers and channels. Zeroed = plaintext,
 * gRPC's keepalive defaults, no message limit. */
typedef struct ps__rpc_options {
    const char *tls_cert;        /* PEM file: this side's certificate chain */
    const char *tls_key;         /* PEM file: its private key */
    const char *tls_ca;          /* PEM file: CAs to verify the peer; on a server
                                  * it also makes client certificates mandatory */
    const char *tls_server_name; /* client: expected name in the server's cert */
    const char *token;           /* client: sent as "authorization: Bearer TOKEN" */
    int64_t keepalive_ms;        /* ping an idle connection this often; a peer that
                                  * does not answer within it is dead */
    int64_t max_message_bytes;   /* largest message received; 0: unlimited */
} ps__rpc_options_t;

/** grpc_init, and glibc malloc tuning that doubles streaming throughput (see
 * docs/ARCHITECTURE.md). Reference counted; pair with ps__rpc_release, which
 * returns the references left (0: it was the last). */
void ps__rpc_acquire(void);
int ps__rpc_release(void);

/** For a daemon, before its first thread: one malloc arena for every thread
 * (mallopt M_ARENA_MAX). glibc's default, an arena per thread up to 8 a core,
 * left gRPC's read buffers and the frames they make spread over many arenas
 * that each grew on their own: the agent page-faulted for the first tens of
 * large collectives and spent more CPU on each (PERFORMANCE.md, "One malloc
 * arena"). Left to glibc where MALLOC_ARENA_MAX or GLIBC_TUNABLES is set.
 * Returns the arenas set (1), or 0 when it left them (the environment, or a
 * mallopt that refused: ASan's). */
int ps__malloc_arenas_init(void);

/** Waits, up to timeout_ms, until gRPC has shut down after the last
 * ps__rpc_release, polling meanwhile. gRPC's subchannels hold grpc_init of
 * their own and are destroyed after their channel, by gRPC's threads; the
 * last of them shuts gRPC down on a thread of its own. A process that exits
 * before then has OpenSSL's and gRPC's atexit clean-up run beside that work
 * (a connection retry's handshake in freed OpenSSL state). It also waits
 * until the threads gRPC's event engine lets end detached are gone. 0 when
 * gRPC is down or acquired again (ps__rpc_acquire: no longer this caller's
 * to wait for), at once when gRPC was up before this module's first
 * ps__rpc_acquire (the process has another user of it; gRPC still up on
 * this module's own account when it is acquired again is not another user),
 * PS_ETIMEDOUT when something still holds it. */
int ps__rpc_wait_shutdown(int64_t timeout_ms);

/* A thread that ends on its own and is joined later, not detached: its exit
 * runs OpenSSL's and gRPC's per-thread clean-up, which must be over before
 * the process exits, and its stack stays mapped until it is joined. Under
 * the lock of a list of ended threads, it takes the threads that ended before
 * it off the list and puts itself on (ps__thread_ended); once the lock is
 * down it joins those (ps__thread_reap). So at most one ended thread per list
 * waits to be joined (a burst of thousands leaves no stacks behind), and
 * whoever ends the threads (a shutdown) joins that last one under the lock:
 * joining it waits for the joins it does. The task pool and the RPC server's
 * handler threads are such threads. */
typedef struct ps__thread {
    pthread_t id;
    void *arg;               /* the function's */
    struct ps__thread *next; /* on a list of ended threads */
} ps__thread_t;

/* Starts fn(t) on a new thread t, with t->arg = arg, named name (what `top
 * -H` and /proc/PID/task/TID/comm show; 15 characters at most). Call with
 * the lock of the list t will end on held, so that t->id is set before anyone
 * joins t. NULL when no thread could be had. */
ps__thread_t *ps__thread_start(const char *name, void *(*fn)(void *), void *arg);

/* t, about to return from its function, goes on *ended, and the threads
 * that were on it come off: returned, for t to reap once it has let go of
 * the list's lock. Lock held. */
ps__thread_t *ps__thread_ended(ps__thread_t **ended, ps__thread_t *t);

/* Joins and frees every thread on *ended. A list taken off its owner's
 * (ps__thread_ended), or the owner's with its lock held once no thread is
 * left to end. */
void ps__thread_reap(ps__thread_t **ended);

/** Monotonic milliseconds. */
int64_t ps__now_ms(void);

/** The time ms_from_now milliseconds from now on `clock`, as the absolute
 * timespec pthread_cond_timedwait takes (CLOCK_REALTIME for a condition
 * variable with default attributes). */
struct timespec ps__abs_time(clockid_t clock, int64_t ms_from_now);

/* ---- server ---- */

/** Creates a server; 0, or PS_ENOMEM. */
int ps__rpc_server_create(ps__rpc_server_t **out);

/** Creates a server with options (TLS for every port it listens on,
 * keepalive, message limit). opts is copied. 0, PS_ENOMEM, or PS_EINVAL
 * when a TLS file cannot be read. */
int ps__rpc_server_create_ex(const ps__rpc_options_t *opts, ps__rpc_server_t **out);

/** Copies the value of request metadata `key` into buf (NUL-terminated,
 * truncated to len). 0, or PS_ENOTFOUND. Server calls only. */
int ps__rpc_call_metadata(const ps__rpc_call_t *call, const char *key, char *buf, size_t len);

/** Registers "/pkg.Svc/Method" with its handler. Before start only. */
int ps__rpc_server_add_method(ps__rpc_server_t *srv, const char *method, ps__rpc_handler_fn fn,
                              void *arg);

/** Listens on addr ("host:port", "unix:/path"; port 0 picks one). *port gets the
 * bound port (0 for unix sockets). PS_EUNAVAIL when it cannot bind. */
int ps__rpc_server_listen(ps__rpc_server_t *srv, const char *addr, int *port);

/** Like ps__rpc_server_listen but always plaintext (health probes cannot
 * speak TLS). */
int ps__rpc_server_listen_plain(ps__rpc_server_t *srv, const char *addr, int *port);

/** Starts serving. */
int ps__rpc_server_start(ps__rpc_server_t *srv);

/** Cancels every call in flight with UNAVAILABLE ("shutting down"), stops
 * accepting, lets clients read those statuses and close their connections
 * (for up to PS_RPC_SHUTDOWN_GRACE_MS in all), cuts those still open, and
 * waits for the handlers to return. Idempotent. */
void ps__rpc_server_shutdown(ps__rpc_server_t *srv);

/** Called when each served call ends, with its method and status code
 * (for metrics). Set before start. */
typedef void (*ps__rpc_observer_fn)(const char *method, int code);
void ps__rpc_server_set_observer(ps__rpc_server_t *srv, ps__rpc_observer_fn fn);

/** The server's handler threads, and in *idle those waiting for a call
 * (for tests). */
int ps__rpc_server_threads(ps__rpc_server_t *srv, int *idle);

/** Frees a server (shutting it down first if needed). Accepts NULL. */
void ps__rpc_server_destroy(ps__rpc_server_t *srv);

/** The method name of an accepted call (a static string of the server). */
const char *ps__rpc_call_method(const ps__rpc_call_t *call);

/** The peer address ("ipv4:127.0.0.1:4242"); owned by the call. */
const char *ps__rpc_call_peer(ps__rpc_call_t *call);

/** Milliseconds left before the call's deadline (INT64_MAX when it has none). */
int64_t ps__rpc_call_remaining_ms(const ps__rpc_call_t *call);

/** Server side, after a receive ended the stream: 1 when the client is
 * gone (cancelled, died, connection lost), 0 when it half-closed normally,
 * -1 when that is not known within wait_ms. Call from one thread only. */
int ps__rpc_call_peer_cancelled(ps__rpc_call_t *call, int64_t wait_ms);

/** Server side: ends the call with a status. Later sends fail. */
int ps__rpc_call_send_status(ps__rpc_call_t *call, int code, const char *message);

/* ---- client ---- */

/** A channel to target ("host:port", "unix:/path"). 0, or PS_EINVAL/PS_ENOMEM. */
int ps__rpc_channel_create(const char *target, ps__rpc_channel_t **out);

/** A channel with options (TLS, token, keepalive). opts may be NULL. */
int ps__rpc_channel_create_ex(const char *target, const ps__rpc_options_t *opts,
                              ps__rpc_channel_t **out);
void ps__rpc_channel_destroy(ps__rpc_channel_t *ch);
const char *ps__rpc_channel_target(const ps__rpc_channel_t *ch);

/** 1 when the channel is connected, else 0 (an idle channel is asked to
 * connect, so a later check can succeed). Never blocks. */
int ps__rpc_channel_ready(ps__rpc_channel_t *ch);

/** Starts a call (it waits for the server to be ready, up to timeout_ms;
 * <= 0 means no deadline). 0, or a negative code. */
int ps__rpc_call_start(ps__rpc_channel_t *ch, const char *method, int64_t timeout_ms,
                       ps__rpc_call_t **out);

/** What the server's shutdown tells every call it cancels (UNAVAILABLE). */
#define PS_RPC_MSG_SHUTDOWN "the daemon is shutting down"

/** How long the server's shutdown waits for its handlers to end and its
 * clients to close their connections before it cuts them. */
#define PS_RPC_SHUTDOWN_GRACE_MS 1000

/** Metadata naming the agent that forwarded a call. */
#define PS_RPC_VIA_METADATA "x-paramsync-via"

/** As ps__rpc_call_start, sending `authorization` (e.g. "Bearer T") instead
 * of the channel's own token (NULL sends none), and `via` (may be NULL) as
 * PS_RPC_VIA_METADATA. For forwarding a worker's call. */
int ps__rpc_call_start_auth(ps__rpc_channel_t *ch, const char *method, int64_t timeout_ms,
                            const char *authorization, const char *via, ps__rpc_call_t **out);

/** As ps__rpc_call_start_auth; with wait_for_ready 0 the call fails at once
 * with UNAVAILABLE when the server cannot be reached, instead of waiting. */
int ps__rpc_call_start_ex(ps__rpc_channel_t *ch, const char *method, int64_t timeout_ms,
                          const char *authorization, const char *via, int wait_for_ready,
                          ps__rpc_call_t **out);

/** Client side: half-closes the request stream. */
int ps__rpc_call_close_send(ps__rpc_call_t *call);

/** Client side: waits for the status. *message (may be NULL) gets a malloc'd
 * copy of the status message, owned by the caller. Returns -code (0 for OK). */
int ps__rpc_call_finish(ps__rpc_call_t *call, char **message);

/** Frees a client call, cancelling it if unfinished. Accepts NULL. */
void ps__rpc_call_destroy(ps__rpc_call_t *call);

/* ---- both sides ---- */

/** Sends one message and waits until gRPC has taken it. Does not take msg;
 * the caller destroys it. 0, or a negative code when the call is broken. */
int ps__rpc_call_send(ps__rpc_call_t *call, grpc_byte_buffer *msg);

/** The same, but while gRPC has not taken the message (a call waiting for
 * its server to be reachable), asks give_up(arg) every 100 ms and cancels
 * the call once it says yes. */
int ps__rpc_call_send_or(ps__rpc_call_t *call, grpc_byte_buffer *msg, int (*give_up)(void *),
                         void *arg);

/** Waits for one message. *msg is the caller's to destroy, or NULL at the
 * end of the stream. 0, or a negative code when the call is broken. */
int ps__rpc_call_recv(ps__rpc_call_t *call, grpc_byte_buffer **msg);

/** As ps__rpc_call_recv, without waiting: 0 with *msg set when the next
 * message (or the end of the stream, NULL) has come already, 1 when it has
 * not (the receive stays started: the next ps__rpc_call_recv takes it), or
 * a negative error. */
int ps__rpc_call_recv_ready(ps__rpc_call_t *call, grpc_byte_buffer **msg);

/** Sends msg as the last message in the same batch as the end of the
 * stream: on a server with the status (code, message), on a client with
 * the half-close (code and message unused). Does not take msg. */
int ps__rpc_call_send_last(ps__rpc_call_t *call, grpc_byte_buffer *msg, int code,
                           const char *message);

/** Cancels the call with a status; thread-safe, idempotent. */
void ps__rpc_call_cancel(ps__rpc_call_t *call, int code, const char *message);

/** A server-side call with no gRPC call behind it, for requests that come
 * another way (a shared-memory doorbell): receiving gives the end of the
 * stream, what is sent is kept, cancelling or ending it records the status,
 * it has no metadata and its peer never cancels. Free with
 * ps__rpc_call_destroy. 0 or PS_ENOMEM. */
int ps__rpc_call_local(ps__rpc_call_t **out);

/** A local call whose messages go out on the server call `parent` (a stream
 * that carries several requests, each served through such a call), and
 * whose metadata is parent's. Its status is kept, as a local call's. */
int ps__rpc_call_local_on(ps__rpc_call_t *parent, ps__rpc_call_t **out);

/** 1 for a call made by ps__rpc_call_local, else 0. */
int ps__rpc_call_is_local(const ps__rpc_call_t *call);

/** The status a local call was ended with (INTERNAL if none) and its
 * message (malloc'd), and the first message sent on it (NULL if none; the
 * caller destroys it; first may be NULL). */
int ps__rpc_call_local_outcome(ps__rpc_call_t *call, char **message, grpc_byte_buffer **first);

/* ---- protobuf-c messages ---- */

/** Packs a protobuf-c message into a new byte buffer (NULL on ENOMEM). */
grpc_byte_buffer *ps__rpc_pack(const ProtobufCMessage *msg);

/** Unpacks a byte buffer into a new message of desc (free with
 * protobuf_c_message_free_unpacked). 0, or PS_EINVAL on malformed input. */
int ps__rpc_unpack(grpc_byte_buffer *bb, const ProtobufCMessageDescriptor *desc,
                   ProtobufCMessage **out);

/** A unary call: sends req, receives one response of resp_desc. On a non-OK
 * status returns -code and, when errmsg is not NULL, a malloc'd message. */
int ps__rpc_unary(ps__rpc_channel_t *ch, const char *method, const ProtobufCMessage *req,
                  const ProtobufCMessageDescriptor *resp_desc, ProtobufCMessage **resp,
                  int64_t timeout_ms, char **errmsg);

/** ps__rpc_unary sending `authorization` instead of the channel's token. */
int ps__rpc_unary_auth(ps__rpc_channel_t *ch, const char *method, const char *authorization,
                       const ProtobufCMessage *req, const ProtobufCMessageDescriptor *resp_desc,
                       ProtobufCMessage **resp, int64_t timeout_ms, char **errmsg);

/** Receives and unpacks one message; PS_EUNAVAIL-style code on a broken call,
 * 1 at the end of the stream (nothing unpacked). */
int ps__rpc_recv_msg(ps__rpc_call_t *call, const ProtobufCMessageDescriptor *desc,
                     ProtobufCMessage **out);

/** Packs and sends one message. */
int ps__rpc_send_msg(ps__rpc_call_t *call, const ProtobufCMessage *msg);

#endif
