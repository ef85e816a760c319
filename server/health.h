/* grpc.health.v1.Health (Check and Watch) for Kubernetes gRPC probes. */
#ifndef PS_HEALTH_H
#define PS_HEALTH_H

#include "rpc/rpc.h"

typedef struct ps__health ps__health_t;

/** Registers Check and Watch on srv (before start). Every service starts
 * NOT_SERVING until set. 0, or PS_ENOMEM. */
int ps__health_create(ps__rpc_server_t *srv, ps__health_t **out);

/** Serves the same statuses on another server too (before its start): the
 * plaintext --health-listen port for probes that cannot speak TLS. */
int ps__health_serve_on(ps__health_t *h, ps__rpc_server_t *srv);

/** Sets a service's status ("" is the whole server; names such as
 * "paramsync.v1.Worker"). Wakes Watch streams whose status changed.
 * Unknown names are added. Thread-safe. */
void ps__health_set(ps__health_t *h, const char *service, int serving);

/** Marks every service NOT_SERVING (draining) and ends Watch streams, so
 * the server can shut down. */
void ps__health_shutdown(ps__health_t *h);

/** Frees h (after the server is shut down). Accepts NULL. */
void ps__health_destroy(ps__health_t *h);

#endif
