/* For unit tests over a real gRPC server: start it on loopback and open a channel to it. Include
 * after cmocka.h. */
#ifndef PS_TEST_LOOPBACK_H
#define PS_TEST_LOOPBACK_H

#include <stdio.h>

#include "rpc/rpc.h"

/* Listens on 127.0.0.1 (a free port), starts srv, and opens *ch to it. */
static inline void loopback_start(ps__rpc_server_t *srv, ps__rpc_channel_t **ch)
{
    int port = 0;
    assert_int_equal(ps__rpc_server_listen(srv, "127.0.0.1:0", &port), 0);
    assert_int_equal(ps__rpc_server_start(srv), 0);
    char target[64];
    snprintf(target, sizeof(target), "127.0.0.1:%d", port);
    assert_int_equal(ps__rpc_channel_create(target, ch), 0);
}

#endif
