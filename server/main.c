/* paramsyncd: the daemon's command line, roles, signals and shutdown. */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <paramsync/common.h>
#include <paramsync/reduce.h>

#include "daemon.h"
#include "health.h"
#include "log.h"
#include "metrics.h"

#ifndef PS_VERSION
#define PS_VERSION "0.0.0"
#endif

static void usage(FILE *out)
{
    fprintf(
        out,
        "Usage: paramsyncd [OPTIONS]\n"
        "\n"
        "The paramsync daemon. With no options it runs the coordinator and an agent in one\n"
        "process on 127.0.0.1:29500: one machine, nothing else to start. Workers then use\n"
        "MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 (or PARAMSYNC_ADDR=127.0.0.1:29500).\n"
        "\n"
        "Every option can also be set by the environment variable in brackets.\n"
        "\n"
        "  --role ROLE              embedded (default), coordinator or agent [PARAMSYNC_ROLE]\n"
        "  --listen ADDR            gRPC address to serve: HOST:PORT or unix:PATH; port 0 picks\n"
        "                           a free one [PARAMSYNC_LISTEN] (default 127.0.0.1:29500 for\n"
        "                           embedded, 0.0.0.0:29400 for coordinator, 0.0.0.0:29500 for\n"
        "                           agent)\n"
        "  --coordinator ADDR       agent: the coordinator's HOST:PORT [PARAMSYNC_COORDINATOR]\n"
        "  --advertise ADDR         agent: the HOST:PORT other agents use to reach this one\n"
        "                           [PARAMSYNC_ADVERTISE] (default: the listen address, with\n"
        "                           this host's name for a wildcard host)\n"
        "  --announce-file PATH     write the address workers should use to PATH once serving\n"
        "                           (for init_method file://PATH) [PARAMSYNC_ANNOUNCE_FILE]\n"
        "  --timeout-ms MS          default deadline of a collective [PARAMSYNC_TIMEOUT_MS]\n"
        "                           (default 1800000, torch's 30 minutes)\n"
        "  --join-timeout-ms MS     default deadline of a job's rendezvous\n"
        "                           [PARAMSYNC_JOIN_TIMEOUT_MS] (default 1800000)\n"
        "  --max-tensor-bytes N     largest payload one rank may send or receive in one\n"
        "                           collective; K, M, G suffixes [PARAMSYNC_MAX_TENSOR_BYTES]\n"
        "                           (default 16G)\n"
        "  --step-bytes N           pipeline step of the collective engine\n"
        "                           [PARAMSYNC_STEP_BYTES] (default 1M)\n"
        "  --window N               pipeline steps in flight per collective\n"
        "                           [PARAMSYNC_WINDOW] (default 4)\n"
        "  --metrics-addr ADDR      serve Prometheus metrics at http://ADDR/metrics; 'off'\n"
        "                           disables [PARAMSYNC_METRICS_ADDR] (default 127.0.0.1:9400\n"
        "                           for embedded, 0.0.0.0:9400 otherwise; a busy default port\n"
        "                           is a warning, a busy explicit one an error)\n"
        "  --metrics-rank-limit N   ranks below N get their own label value in per-rank\n"
        "                           metrics, the rest count as rank=\"other\"\n"
        "                           [PARAMSYNC_METRICS_RANK_LIMIT] (default 64)\n"
        "  --log-level LEVEL        error, warn, info (default) or debug [PARAMSYNC_LOG_LEVEL]\n"
        "  --version                print the version and exit\n"
        "  -h, --help               print this help and exit\n"
        "\n"
        "SIGTERM or SIGINT stop the daemon: it stops accepting calls, ends calls in flight\n"
        "with UNAVAILABLE and exits 0.\n");
}

/* Parses a byte count with an optional K/M/G suffix (binary). */
static int parse_bytes(const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s)
        return -1;
    uint64_t mult = 1;
    if (*end == 'K' || *end == 'k')
        mult = 1ull << 10;
    else if (*end == 'M' || *end == 'm')
        mult = 1ull << 20;
    else if (*end == 'G' || *end == 'g')
        mult = 1ull << 30;
    else if (*end)
        return -1;
    if (mult > 1 && end[1] && strcmp(end + 1, "iB") != 0 && strcmp(end + 1, "B") != 0)
        return -1;
    if (v > UINT64_MAX / mult)
        return -1;
    *out = v * mult;
    return 0;
}

static int parse_ms(const char *s, int64_t *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end || v <= 0)
        return -1;
    *out = v;
    return 0;
}

/* The address a local client dials to reach `listen` (wildcards become
 * loopback; port 0 becomes the bound port). */
static char *dial_address(const char *listen, int port)
{
    char buf[512];
    if (strncmp(listen, "unix:", 5) == 0)
        return strdup(listen);
    const char *colon = strrchr(listen, ':');
    size_t hostlen = colon ? (size_t)(colon - listen) : strlen(listen);
    char host[256];
    snprintf(host, sizeof(host), "%.*s", (int)hostlen, listen);
    if (!*host || strcmp(host, "0.0.0.0") == 0 || strcmp(host, "[::]") == 0 ||
        strcmp(host, "::") == 0)
        snprintf(host, sizeof(host), "127.0.0.1");
    snprintf(buf, sizeof(buf), "%s:%d", host, port);
    return strdup(buf);
}

/* The address other hosts use: the listen host, or this host's name. */
static char *advertise_address(const char *listen, int port)
{
    char buf[512], host[256];
    if (strncmp(listen, "unix:", 5) == 0)
        return strdup(listen);
    const char *colon = strrchr(listen, ':');
    size_t hostlen = colon ? (size_t)(colon - listen) : strlen(listen);
    snprintf(host, sizeof(host), "%.*s", (int)hostlen, listen);
    if (!*host || strcmp(host, "0.0.0.0") == 0 || strcmp(host, "[::]") == 0 ||
        strcmp(host, "::") == 0) {
        if (gethostname(host, sizeof(host)) != 0)
            snprintf(host, sizeof(host), "127.0.0.1");
        host[sizeof(host) - 1] = 0;
    }
    snprintf(buf, sizeof(buf), "%s:%d", host, port);
    return strdup(buf);
}

static int write_announce(const char *path, const char *addr)
{
    char tmp[PATH_MAX];
    snprintf(tmp, sizeof(tmp), "%s.tmp.%d", path, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f)
        return -errno;
    fprintf(f, "%s\n", addr);
    if (fclose(f) != 0 || rename(tmp, path) != 0) {
        int e = -errno;
        unlink(tmp);
        return e;
    }
    return 0;
}

/* What Admin/Status reports about this daemon. */
static const char *g_role = "embedded", *g_address = "";
static int64_t g_start_ms;
static ps__coordinator_t *g_coord;
static ps__agent_t *g_agent;

static void admin_status(ps__rpc_call_t *call, void *arg)
{
    (void)arg;
    Paramsync__V1__StatusRequest *req = NULL;
    if (ps__rpc_recv_msg(call, &paramsync__v1__status_request__descriptor,
                         (ProtobufCMessage **)&req) != 0) {
        ps__rpc_call_send_status(call, 3, "status: malformed request");
        return;
    }
    Paramsync__V1__StatusResponse *resp = malloc(sizeof(*resp));
    int rc = resp ? 0 : PS_ENOMEM;
    if (resp) {
        paramsync__v1__status_response__init(resp);
        resp->role = strdup(g_role);
        resp->version = strdup(PS_VERSION);
        resp->address = strdup(g_address);
        resp->uptime_seconds = (double)(ps__now_ms() - g_start_ms) / 1e3;
        if (!resp->role || !resp->version || !resp->address)
            rc = PS_ENOMEM;
        if (rc == 0 && g_coord)
            rc = ps__coordinator_status(g_coord, req->job, resp);
        if (rc == 0 && g_agent)
            rc = ps__agent_status(g_agent, req->job, resp);
    }
    if (rc == 0) {
        ps__rpc_send_msg(call, &resp->base);
        ps__rpc_call_send_status(call, 0, "");
    } else {
        ps__rpc_call_send_status(call, -rc, "status: out of memory");
    }
    if (resp)
        protobuf_c_message_free_unpacked(&resp->base, NULL);
    protobuf_c_message_free_unpacked(&req->base, NULL);
}

static const char *env_or(const char *name, const char *fallback)
{
    const char *v = getenv(name);
    return v && *v ? v : fallback;
}

int main(int argc, char **argv)
{
    ps__config_t cfg = {
        .role = PS_ROLE_EMBEDDED,
        .timeout_ms = 1800000,
        .join_timeout_ms = 1800000,
        .max_tensor_bytes = 16ull << 30,
        .step_bytes = 1u << 20,
        .window = 4,
    };
    const char *role = env_or("PARAMSYNC_ROLE", "embedded");
    const char *listen = getenv("PARAMSYNC_LISTEN");
    const char *coordinator = getenv("PARAMSYNC_COORDINATOR");
    const char *advertise = getenv("PARAMSYNC_ADVERTISE");
    const char *announce = getenv("PARAMSYNC_ANNOUNCE_FILE");
    const char *timeout = getenv("PARAMSYNC_TIMEOUT_MS");
    const char *join_timeout = getenv("PARAMSYNC_JOIN_TIMEOUT_MS");
    const char *max_bytes = getenv("PARAMSYNC_MAX_TENSOR_BYTES");
    const char *step = getenv("PARAMSYNC_STEP_BYTES");
    const char *window = getenv("PARAMSYNC_WINDOW");
    const char *level = getenv("PARAMSYNC_LOG_LEVEL");
    const char *metrics_addr = getenv("PARAMSYNC_METRICS_ADDR");
    const char *rank_limit = getenv("PARAMSYNC_METRICS_RANK_LIMIT");

    enum {
        O_ROLE = 1000,
        O_LISTEN,
        O_COORD,
        O_ADVERTISE,
        O_ANNOUNCE,
        O_TIMEOUT,
        O_JOIN_TIMEOUT,
        O_MAX_BYTES,
        O_STEP,
        O_WINDOW,
        O_LEVEL,
        O_METRICS,
        O_RANK_LIMIT,
        O_VERSION
    };
    static const struct option opts[] = {
        {"role", required_argument, 0, O_ROLE},
        {"listen", required_argument, 0, O_LISTEN},
        {"coordinator", required_argument, 0, O_COORD},
        {"advertise", required_argument, 0, O_ADVERTISE},
        {"announce-file", required_argument, 0, O_ANNOUNCE},
        {"timeout-ms", required_argument, 0, O_TIMEOUT},
        {"join-timeout-ms", required_argument, 0, O_JOIN_TIMEOUT},
        {"max-tensor-bytes", required_argument, 0, O_MAX_BYTES},
        {"step-bytes", required_argument, 0, O_STEP},
        {"window", required_argument, 0, O_WINDOW},
        {"log-level", required_argument, 0, O_LEVEL},
        {"metrics-addr", required_argument, 0, O_METRICS},
        {"metrics-rank-limit", required_argument, 0, O_RANK_LIMIT},
        {"version", no_argument, 0, O_VERSION},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    int o;
    while ((o = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (o) {
        case O_ROLE:
            role = optarg;
            break;
        case O_LISTEN:
            listen = optarg;
            break;
        case O_COORD:
            coordinator = optarg;
            break;
        case O_ADVERTISE:
            advertise = optarg;
            break;
        case O_ANNOUNCE:
            announce = optarg;
            break;
        case O_TIMEOUT:
            timeout = optarg;
            break;
        case O_JOIN_TIMEOUT:
            join_timeout = optarg;
            break;
        case O_MAX_BYTES:
            max_bytes = optarg;
            break;
        case O_STEP:
            step = optarg;
            break;
        case O_WINDOW:
            window = optarg;
            break;
        case O_LEVEL:
            level = optarg;
            break;
        case O_METRICS:
            metrics_addr = optarg;
            break;
        case O_RANK_LIMIT:
            rank_limit = optarg;
            break;
        case O_VERSION:
            printf("paramsyncd %s\n", PS_VERSION);
            return 0;
        case 'h':
            usage(stdout);
            return 0;
        default:
            usage(stderr);
            return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "paramsyncd: unexpected argument '%s' (see --help)\n", argv[optind]);
        return 2;
    }
    if (strcmp(role, "embedded") == 0)
        cfg.role = PS_ROLE_EMBEDDED;
    else if (strcmp(role, "coordinator") == 0)
        cfg.role = PS_ROLE_COORDINATOR;
    else if (strcmp(role, "agent") == 0)
        cfg.role = PS_ROLE_AGENT;
    else {
        fprintf(stderr, "paramsyncd: --role must be embedded, coordinator or agent, not '%s'\n",
                role);
        return 2;
    }
    uint64_t v;
    if (timeout && parse_ms(timeout, &cfg.timeout_ms) < 0) {
        fprintf(stderr, "paramsyncd: --timeout-ms wants a positive number of ms, not '%s'\n",
                timeout);
        return 2;
    }
    if (join_timeout && parse_ms(join_timeout, &cfg.join_timeout_ms) < 0) {
        fprintf(stderr, "paramsyncd: --join-timeout-ms wants a positive number of ms, not '%s'\n",
                join_timeout);
        return 2;
    }
    if (max_bytes) {
        if (parse_bytes(max_bytes, &cfg.max_tensor_bytes) < 0 || cfg.max_tensor_bytes == 0) {
            fprintf(stderr, "paramsyncd: --max-tensor-bytes wants a size like 4G, not '%s'\n",
                    max_bytes);
            return 2;
        }
    }
    if (step) {
        if (parse_bytes(step, &v) < 0 || v < 64 || v > (4u << 20) - 4096) {
            fprintf(stderr, "paramsyncd: --step-bytes must be 64 bytes to 4M-4K, not '%s'\n", step);
            return 2;
        }
        cfg.step_bytes = (size_t)v;
    }
    if (window) {
        if (parse_bytes(window, &v) < 0 || v < 1 || v > 64) {
            fprintf(stderr, "paramsyncd: --window must be 1 to 64, not '%s'\n", window);
            return 2;
        }
        cfg.window = (int)v;
    }
    if (level && (ps__log_level = ps__log_parse_level(level)) < 0) {
        fprintf(stderr, "paramsyncd: --log-level must be error, warn, info or debug, not '%s'\n",
                level);
        return 2;
    }
    int rank_limit_n = 64;
    if (rank_limit) {
        if (parse_bytes(rank_limit, &v) < 0 || v > 65536) {
            fprintf(stderr, "paramsyncd: --metrics-rank-limit must be 0 to 65536, not '%s'\n",
                    rank_limit);
            return 2;
        }
        rank_limit_n = (int)v;
    }
    int metrics_explicit = metrics_addr != NULL;
    if (!metrics_addr)
        metrics_addr = cfg.role == PS_ROLE_EMBEDDED ? "127.0.0.1:9400" : "0.0.0.0:9400";
    if (!listen)
        listen = cfg.role == PS_ROLE_EMBEDDED      ? "127.0.0.1:29500"
                 : cfg.role == PS_ROLE_COORDINATOR ? "0.0.0.0:29400"
                                                   : "0.0.0.0:29500";
    if (cfg.role == PS_ROLE_AGENT && (!coordinator || !*coordinator)) {
        fprintf(stderr, "paramsyncd: --role agent needs --coordinator HOST:PORT\n");
        return 2;
    }
    cfg.listen = listen;

    /* Signals are taken by sigwait in main; every other thread blocks them. */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    ps__rpc_acquire();
    int rc = 0, port = 0, status = 1;
    ps__rpc_server_t *srv = NULL;
    ps__coordinator_t *coord = NULL;
    ps__agent_t *agent = NULL;
    ps__health_t *health = NULL;
    char *self = NULL, *dial = NULL;
    g_start_ms = ps__now_ms();
    if ((rc = ps__rpc_server_create(&srv)) < 0)
        goto out;
    if ((rc = ps__rpc_server_listen(srv, listen, &port)) < 0) {
        fprintf(stderr, "paramsyncd: cannot listen on %s (in use, or a bad address?)\n", listen);
        goto out;
    }
    dial = dial_address(listen, port);
    g_role = role;
    g_address = dial;
    if ((rc = ps__health_create(srv, &health)) < 0)
        goto out;
    ps__rpc_server_set_observer(srv, ps__metrics_grpc_call);
    if (cfg.role != PS_ROLE_AGENT && (rc = ps__coordinator_create(&cfg, srv, &coord)) < 0)
        goto out;
    if (cfg.role != PS_ROLE_COORDINATOR) {
        self = advertise                      ? strdup(advertise)
               : cfg.role == PS_ROLE_EMBEDDED ? strdup(dial)
                                              : advertise_address(listen, port);
        cfg.advertise = self;
        cfg.coordinator = cfg.role == PS_ROLE_AGENT ? coordinator : dial;
        if ((rc = ps__agent_create(&cfg, srv, self, cfg.coordinator, &agent)) < 0)
            goto out;
    }
    if ((rc = ps__rpc_server_add_method(srv, PS_M_ADMIN_STATUS, admin_status, NULL)) < 0)
        goto out;
    g_coord = coord;
    g_agent = agent;
    ps__metrics_config_t mcfg = {
        .addr = metrics_addr,
        .rank_limit = rank_limit_n,
        .role = role,
        .version = PS_VERSION,
        .simd = ps_reduce_path_name(ps_reduce_get_path()),
#ifdef PS_HAVE_CUDA
        .cuda = 1,
#endif
    };
    const char *metrics_bound = NULL;
    if (ps__metrics_start(&mcfg, &metrics_bound) < 0) {
        if (metrics_explicit) {
            fprintf(stderr, "paramsyncd: cannot serve metrics on %s (in use?)\n", metrics_addr);
            rc = PS_EUNAVAIL;
            goto out;
        }
        PS_LOG(PS_LOG_WARN,
               "metrics: cannot bind the default %s; running without /metrics "
               "(set --metrics-addr)",
               metrics_addr);
        mcfg.addr = NULL;
        ps__metrics_start(&mcfg, NULL);
    }
    if (coord)
        ps__metrics_set_gauge_source(ps__coordinator_gauges, coord);
    if ((rc = ps__rpc_server_start(srv)) < 0)
        goto out;
    if (coord) {
        ps__health_set(health, "paramsync.v1.Coordinator", 1);
        if (!agent)
            ps__health_set(health, "", 1);
    }
    if (agent)
        ps__agent_watch_health(agent, health);
    if (announce && (rc = write_announce(announce, dial)) < 0) {
        fprintf(stderr, "paramsyncd: cannot write --announce-file %s: %s\n", announce,
                strerror(-rc));
        goto out;
    }
    PS_LOG(PS_LOG_INFO, "paramsyncd %s: role %s, reduce path %s, step %zu bytes x %d", PS_VERSION,
           role, ps_reduce_path_name(ps_reduce_get_path()), cfg.step_bytes, cfg.window);
    if (cfg.role == PS_ROLE_AGENT)
        PS_LOG(PS_LOG_INFO, "agent %s, coordinator %s", self, coordinator);
    if (metrics_bound)
        fprintf(stderr, "paramsyncd: metrics on http://%s/metrics\n", metrics_bound);
    fprintf(stderr, "paramsyncd: listening on %s\n", dial);
    fflush(stderr);

    int sig = 0;
    sigwait(&sigs, &sig);
    PS_LOG(PS_LOG_INFO, "received %s: draining and shutting down",
           sig == SIGTERM ? "SIGTERM" : "SIGINT");
    status = 0;
out:
    if (rc < 0)
        fprintf(stderr, "paramsyncd: start-up failed: %s\n", ps_strerror(rc));
    /* Probes see NOT_SERVING before calls are refused. */
    if (health)
        ps__health_shutdown(health);
    ps__rpc_server_shutdown(srv);
    ps__agent_destroy(agent);
    ps__health_destroy(health);
    ps__metrics_stop();
    ps__coordinator_destroy(coord);
    ps__rpc_server_destroy(srv);
    if (announce && status == 0)
        unlink(announce);
    free(self);
    free(dial);
    ps__rpc_release();
    if (status == 0)
        PS_LOG(PS_LOG_INFO, "stopped");
    return status;
}
