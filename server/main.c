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
#include <paramsync/gpu.h>
#include <paramsync/reduce.h>

#include "daemon.h"
#include "health.h"
#include "log.h"
#include "metrics.h"
#include "rpc/task.h"

#ifndef PS_VERSION
#define PS_VERSION "0.0.0"
#endif

/* How long the exit waits for the task threads to end and then for gRPC to
 * shut down (ps__task_quiesce, ps__rpc_wait_shutdown). */
#define PS_EXIT_WAIT_MS 5000

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
        "  --step-bytes N           pipeline step of the collective engine (an all_gather,\n"
        "                           gather, scatter, reduce_scatter or all_to_all that fits\n"
        "                           in one goes as one) [PARAMSYNC_STEP_BYTES] (default 1M;\n"
        "                           alike on every agent)\n"
        "  --window N               pipeline steps in flight per collective\n"
        "                           [PARAMSYNC_WINDOW] (default 4)\n"
        "  --metrics-addr ADDR      serve Prometheus metrics at http://ADDR/metrics; 'off'\n"
        "                           disables [PARAMSYNC_METRICS_ADDR] (default 127.0.0.1:9400\n"
        "                           for embedded, 0.0.0.0:9400 otherwise; a busy default port\n"
        "                           is a warning, a busy explicit one an error)\n"
        "  --metrics-rank-limit N   ranks below N get their own label value in per-rank\n"
        "                           metrics, the rest count as rank=\"other\"\n"
        "                           [PARAMSYNC_METRICS_RANK_LIMIT] (default 64)\n"
        "  --tls-cert PEM, --tls-key PEM\n"
        "                           serve TLS with this certificate and key; agents also use\n"
        "                           them as client certificates [PARAMSYNC_TLS_CERT,\n"
        "                           PARAMSYNC_TLS_KEY] (default: plaintext)\n"
        "  --tls-ca PEM             CAs that verify peers; on a server this makes client\n"
        "                           certificates mandatory (mutual TLS) [PARAMSYNC_TLS_CA]\n"
        "  --tls-server-name NAME   name expected in the coordinator's and other agents'\n"
        "                           certificates, if not their host [PARAMSYNC_TLS_SERVER_NAME]\n"
        "  --tokens-file PATH       per-job tokens, one 'JOB TOKEN' per line ('*' as JOB for any\n"
        "                           other job); workers must send 'authorization: Bearer\n"
        "                           TOKEN' [PARAMSYNC_TOKENS_FILE] (default: no tokens)\n"
        "  --liveness-timeout-ms MS a connection silent this long is pinged, and dead if the\n"
        "                           ping is not answered as long again\n"
        "                           [PARAMSYNC_LIVENESS_TIMEOUT_MS] (default 10000)\n"
        "  --max-message-bytes N    largest gRPC message accepted [PARAMSYNC_MAX_MESSAGE_BYTES]\n"
        "                           (default 16M)\n"
        "  --max-jobs N             jobs at once [PARAMSYNC_MAX_JOBS] (default 1024)\n"
        "  --max-world-size N       ranks per job [PARAMSYNC_MAX_WORLD_SIZE] (default 65536)\n"
        "  --max-groups N           groups per job [PARAMSYNC_MAX_GROUPS] (default 4096)\n"
        "  --max-inflight-bytes N   memory the collectives in flight may hold in this agent;\n"
        "                           over it new collectives get RESOURCE_EXHAUSTED\n"
        "                           [PARAMSYNC_MAX_INFLIGHT_BYTES] (default 4G)\n"
        "  --health-listen ADDR     also serve grpc.health.v1 alone, in plaintext, on ADDR:\n"
        "                           for Kubernetes probes when the gRPC port speaks TLS\n"
        "                           [PARAMSYNC_HEALTH_LISTEN] (default: none)\n"
        "  --reduce-device DEV      cpu (default), cuda or auto: where agents reduce the\n"
        "                           bytes they receive. cuda: on a CUDA device (required);\n"
        "                           auto: on one when usable, for steps of 1M per input or\n"
        "                           more, smaller ones on the CPU. The GPU path pins host\n"
        "                           memory and holds device buffers; on an idle H200 it was\n"
        "                           1.1-2.0x faster than the CPU from 4M, slower below 1M\n"
        "                           (docs/GPU.md) [PARAMSYNC_REDUCE_DEVICE]\n"
        "  --ring auto|on|off       where a collective whose ranks span several agents runs.\n"
        "                           off: at the job's hub agent. on: an all_reduce is reduced\n"
        "                           at each agent for its ranks, then round a ring of those\n"
        "                           agents; all_gather and broadcast pass each rank's data\n"
        "                           round that ring, all_to_all sends each block straight\n"
        "                           to its rank's agent (a mesh), reduce and reduce_scatter\n"
        "                           add it up along the ring (those of --ring-min-bytes or\n"
        "                           more per rank; barrier too when that is 0). auto\n"
        "                           (default): the ring for an all_reduce whose ranks average\n"
        "                           8 or more per agent, or 2 or more with --ring-min-bytes\n"
        "                           per rank (a reduce_scatter: 2 or more with blocks of\n"
        "                           --ring-min-bytes), for a broadcast, reduce or all_gather\n"
        "                           (over --step-bytes) of 4 or more per agent (a barrier, and a\n"
        "                           broadcast or reduce under 64K per rank: 8), and the mesh\n"
        "                           for an all_to_all of --ring-min-bytes blocks; when the\n"
        "                           agents are on two or more machines (--machine-id), also\n"
        "                           for an all_reduce, broadcast, reduce, all_gather or\n"
        "                           reduce_scatter of --ring-min-bytes per rank; the rest at\n"
        "                           the hub. gather and scatter always go to the hub. Set it,\n"
        "                           --ring-min-bytes, --rd-max-bytes and --step-bytes alike\n"
        "                           on every agent: the coordinator does not form a job\n"
        "                           whose agents differ in them\n"
        "                           [PARAMSYNC_RING] (docs/PERFORMANCE.md: when each is faster)\n"
        "  --ring-min-bytes N       smaller collectives (bytes per rank) go to the hub, where\n"
        "                           they take fewer hops; with auto, see above\n"
        "                           [PARAMSYNC_RING_MIN_BYTES] (default 1M)\n"
        "  --rd-max-bytes N         where the agents of an all_reduce combine it among\n"
        "                           themselves (--ring above), one of at most N bytes per\n"
        "                           rank (and one --step-bytes) goes by recursive doubling:\n"
        "                           about log2(agents) rounds, each agent exchanging its\n"
        "                           value with one other, instead of 2 x (agents - 1) rounds\n"
        "                           round the ring. 0: never. Set it alike on every agent\n"
        "                           [PARAMSYNC_RD_MAX_BYTES] (default 64K)\n"
        "  --machine-id ID          agent: the machine it runs on, as the coordinator tells\n"
        "                           the other agents; agents with different IDs do not share\n"
        "                           cores or links [PARAMSYNC_MACHINE_ID] (default: the\n"
        "                           kernel's boot id, /proc/sys/kernel/random/boot_id, which\n"
        "                           containers and network namespaces of one host share)\n"
        "  --link-keep-ms MS        agent: a link to another agent (an Agent.Ring call) that\n"
        "                           carried a collective stays open this long, idle, for the\n"
        "                           job's next one between the two, instead of a call per\n"
        "                           collective; 0: a call each [PARAMSYNC_LINK_KEEP_MS]\n"
        "                           (default 30000)\n"
        "  --shm-resident-bytes N   a collective that touches more than N bytes of its ranks'\n"
        "                           shared-memory segments (summed over its ranks; of an\n"
        "                           uneven all_to_all, not the padding) reads and writes\n"
        "                           them through their files, one step at a time, not\n"
        "                           through this agent's mappings: its resident memory then\n"
        "                           stays small, at the price of a copy\n"
        "                           [PARAMSYNC_SHM_RESIDENT_BYTES] (default 512M; 0: always)\n"
        "  --log-level LEVEL        error, warn, info (default) or debug [PARAMSYNC_LOG_LEVEL]\n"
        "  --version                print the version and exit\n"
        "  -h, --help               print this help and exit\n"
        "\n"
        "SIGTERM or SIGINT stop the daemon: it stops accepting calls, ends calls in flight\n"
        "with UNAVAILABLE and exits 0.\n"
        "\n"
        "Its threads share one malloc arena (fewer page faults and less CPU for large\n"
        "collectives); MALLOC_ARENA_MAX or GLIBC_TUNABLES in the environment leave the\n"
        "arenas to glibc.\n");
}

/* The kernel's boot id into buf (its first line), or "" where it cannot be
 * read: the default --machine-id. Every container and network namespace of
 * one host reads the same, and so shares that host's cores and links. */
static const char *boot_id(char *buf, size_t len)
{
    buf[0] = 0;
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (!f)
        return buf;
    if (!fgets(buf, (int)len, f))
        buf[0] = 0;
    fclose(f);
    buf[strcspn(buf, "\n")] = 0;
    return buf;
}

/* Parses a byte count with an optional K/M/G suffix (binary). */
static int parse_bytes(const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    /* strtoull takes "-1" as its negation, 2^64 - 1: refused. */
    if (strchr(s, '-'))
        return -1;
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

/* A byte-count flag's value s (NULL: not given, *out kept) into *out; -1,
 * having said so, when it is not a byte count. */
static int byte_count_flag(const char *flag, const char *s, uint64_t *out)
{
    if (!s)
        return 0;
    if (parse_bytes(s, out) < 0) {
        fprintf(stderr, "paramsyncd: %s must be a byte count, not '%s'\n", flag, s);
        return -1;
    }
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

int main(int argc, char **argv)
{
    ps__malloc_arenas_init(); /* before any thread */
    char machine[64];
    ps__config_t cfg = {
        .role = PS_ROLE_EMBEDDED,
        .timeout_ms = 1800000,
        .join_timeout_ms = 1800000,
        .max_tensor_bytes = 16ull << 30,
        .step_bytes = 1u << 20,
        .window = 4,
        .rpc = {.keepalive_ms = 10000, .max_message_bytes = 16u << 20},
        .link_keep_ms = PS_LINK_KEEP_MS,
        .max_jobs = 1024,
        .max_world_size = 65536,
        .max_groups = 4096,
        .max_inflight_bytes = 4ull << 30,
        .ring = PS_RING_AUTO,
        .ring_min_bytes = 1u << 20,
        .rd_max_bytes = PS_RD_MAX_BYTES,
        .shm_resident_bytes = 512u << 20,
    };
    /* Every option is a string first, from the environment, then the command
     * line; each is parsed and checked once below. */
    enum {
        O_ROLE,
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
        O_TLS_CERT,
        O_TLS_KEY,
        O_TLS_CA,
        O_TLS_NAME,
        O_TOKENS,
        O_LIVENESS,
        O_MAX_MESSAGE,
        O_MAX_JOBS,
        O_MAX_WORLD,
        O_MAX_GROUPS,
        O_MAX_INFLIGHT,
        O_REDUCE_DEVICE,
        O_HEALTH_LISTEN,
        O_RING,
        O_RING_MIN,
        O_RD_MAX,
        O_SHM_RESIDENT,
        O_MACHINE_ID,
        O_LINK_KEEP,
        O_COUNT,
        O_VERSION = 1000
    };
    static const char *const env_names[O_COUNT] = {
        "PARAMSYNC_ROLE",
        "PARAMSYNC_LISTEN",
        "PARAMSYNC_COORDINATOR",
        "PARAMSYNC_ADVERTISE",
        "PARAMSYNC_ANNOUNCE_FILE",
        "PARAMSYNC_TIMEOUT_MS",
        "PARAMSYNC_JOIN_TIMEOUT_MS",
        "PARAMSYNC_MAX_TENSOR_BYTES",
        "PARAMSYNC_STEP_BYTES",
        "PARAMSYNC_WINDOW",
        "PARAMSYNC_LOG_LEVEL",
        "PARAMSYNC_METRICS_ADDR",
        "PARAMSYNC_METRICS_RANK_LIMIT",
        "PARAMSYNC_TLS_CERT",
        "PARAMSYNC_TLS_KEY",
        "PARAMSYNC_TLS_CA",
        "PARAMSYNC_TLS_SERVER_NAME",
        "PARAMSYNC_TOKENS_FILE",
        "PARAMSYNC_LIVENESS_TIMEOUT_MS",
        "PARAMSYNC_MAX_MESSAGE_BYTES",
        "PARAMSYNC_MAX_JOBS",
        "PARAMSYNC_MAX_WORLD_SIZE",
        "PARAMSYNC_MAX_GROUPS",
        "PARAMSYNC_MAX_INFLIGHT_BYTES",
        "PARAMSYNC_REDUCE_DEVICE",
        "PARAMSYNC_HEALTH_LISTEN",
        "PARAMSYNC_RING",
        "PARAMSYNC_RING_MIN_BYTES",
        "PARAMSYNC_RD_MAX_BYTES",
        "PARAMSYNC_SHM_RESIDENT_BYTES",
        "PARAMSYNC_MACHINE_ID",
        "PARAMSYNC_LINK_KEEP_MS",
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
        {"tls-cert", required_argument, 0, O_TLS_CERT},
        {"tls-key", required_argument, 0, O_TLS_KEY},
        {"tls-ca", required_argument, 0, O_TLS_CA},
        {"tls-server-name", required_argument, 0, O_TLS_NAME},
        {"tokens-file", required_argument, 0, O_TOKENS},
        {"liveness-timeout-ms", required_argument, 0, O_LIVENESS},
        {"max-message-bytes", required_argument, 0, O_MAX_MESSAGE},
        {"max-jobs", required_argument, 0, O_MAX_JOBS},
        {"max-world-size", required_argument, 0, O_MAX_WORLD},
        {"max-groups", required_argument, 0, O_MAX_GROUPS},
        {"max-inflight-bytes", required_argument, 0, O_MAX_INFLIGHT},
        {"reduce-device", required_argument, 0, O_REDUCE_DEVICE},
        {"health-listen", required_argument, 0, O_HEALTH_LISTEN},
        {"ring", required_argument, 0, O_RING},
        {"ring-min-bytes", required_argument, 0, O_RING_MIN},
        {"rd-max-bytes", required_argument, 0, O_RD_MAX},
        {"machine-id", required_argument, 0, O_MACHINE_ID},
        {"shm-resident-bytes", required_argument, 0, O_SHM_RESIDENT},
        {"link-keep-ms", required_argument, 0, O_LINK_KEEP},
        {"version", no_argument, 0, O_VERSION},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    const char *val[O_COUNT];
    for (int i = 0; i < O_COUNT; i++) {
        const char *e = getenv(env_names[i]);
        val[i] = e && *e ? e : NULL;
    }
    int o;
    while ((o = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        if (o >= 0 && o < O_COUNT) {
            val[o] = optarg;
        } else if (o == O_VERSION) {
            printf("paramsyncd %s\n", PS_VERSION);
            return 0;
        } else if (o == 'h') {
            usage(stdout);
            return 0;
        } else {
            usage(stderr);
            return 2;
        }
    }
    const char *role = val[O_ROLE] ? val[O_ROLE] : "embedded";
    const char *listen = val[O_LISTEN], *coordinator = val[O_COORD];
    const char *advertise = val[O_ADVERTISE], *announce = val[O_ANNOUNCE];
    const char *timeout = val[O_TIMEOUT], *join_timeout = val[O_JOIN_TIMEOUT];
    const char *max_bytes = val[O_MAX_BYTES], *step = val[O_STEP], *window = val[O_WINDOW];
    const char *level = val[O_LEVEL], *metrics_addr = val[O_METRICS];
    const char *rank_limit = val[O_RANK_LIMIT];
    cfg.rpc.tls_cert = val[O_TLS_CERT];
    cfg.rpc.tls_key = val[O_TLS_KEY];
    cfg.rpc.tls_ca = val[O_TLS_CA];
    cfg.rpc.tls_server_name = val[O_TLS_NAME];
    cfg.tokens_file = val[O_TOKENS];
    const char *device = val[O_REDUCE_DEVICE] ? val[O_REDUCE_DEVICE] : "cpu";
    if (strcmp(device, "cpu") != 0 && strcmp(device, "cuda") != 0 && strcmp(device, "auto") != 0) {
        fprintf(stderr, "paramsyncd: --reduce-device must be cpu, cuda or auto, not '%s'\n",
                device);
        return 2;
    }
    if (strcmp(device, "cpu") != 0) {
        int ngpu = 0;
        int grc = ps_gpu_device_count(&ngpu);
        cfg.reduce_cuda = grc == 0 && ngpu > 0;
        cfg.reduce_cuda_min = strcmp(device, "auto") == 0 ? PS_AUTO_CUDA_MIN : 0;
        if (!cfg.reduce_cuda && strcmp(device, "cuda") == 0) {
            fprintf(stderr,
                    "paramsyncd: --reduce-device cuda, but no CUDA device can be used (%s); "
                    "use --reduce-device cpu or auto\n",
                    grc < 0 ? ps_strerror(grc) : "no device");
            return 2;
        }
    }
    if ((cfg.rpc.tls_cert != NULL) != (cfg.rpc.tls_key != NULL)) {
        fprintf(stderr, "paramsyncd: --tls-cert and --tls-key go together\n");
        return 2;
    }
    /* Numeric limits: name, text, destination, smallest and largest value. */
    struct {
        const char *name, *text;
        uint64_t *dst, lo, hi;
    } nums[] = {
        {"--liveness-timeout-ms", val[O_LIVENESS], (uint64_t *)&cfg.rpc.keepalive_ms, 100, 3600000},
        {"--max-message-bytes", val[O_MAX_MESSAGE], (uint64_t *)&cfg.rpc.max_message_bytes,
         4u << 20, 1u << 30},
        {"--max-inflight-bytes", val[O_MAX_INFLIGHT], &cfg.max_inflight_bytes, 1u << 20,
         UINT64_MAX},
        {"--link-keep-ms", val[O_LINK_KEEP], (uint64_t *)&cfg.link_keep_ms, 0, 3600000},
    };
    for (size_t i = 0; i < sizeof(nums) / sizeof(nums[0]); i++) {
        uint64_t x;
        if (!nums[i].text)
            continue;
        if (parse_bytes(nums[i].text, &x) < 0 || x < nums[i].lo || x > nums[i].hi) {
            fprintf(stderr, "paramsyncd: %s must be %llu to %llu, not '%s'\n", nums[i].name,
                    (unsigned long long)nums[i].lo, (unsigned long long)nums[i].hi, nums[i].text);
            return 2;
        }
        *nums[i].dst = x;
    }
    struct {
        const char *name, *text;
        int *dst, lo, hi;
    } ints[] = {
        {"--max-jobs", val[O_MAX_JOBS], &cfg.max_jobs, 1, 1 << 20},
        {"--max-world-size", val[O_MAX_WORLD], &cfg.max_world_size, 1, 65536},
        {"--max-groups", val[O_MAX_GROUPS], &cfg.max_groups, 1, 1 << 20},
    };
    for (size_t i = 0; i < sizeof(ints) / sizeof(ints[0]); i++) {
        uint64_t x;
        if (!ints[i].text)
            continue;
        if (parse_bytes(ints[i].text, &x) < 0 || x < (uint64_t)ints[i].lo ||
            x > (uint64_t)ints[i].hi) {
            fprintf(stderr, "paramsyncd: %s must be %d to %d, not '%s'\n", ints[i].name, ints[i].lo,
                    ints[i].hi, ints[i].text);
            return 2;
        }
        *ints[i].dst = (int)x;
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
    if (val[O_RING]) {
        if (strcmp(val[O_RING], "on") == 0)
            cfg.ring = PS_RING_ON;
        else if (strcmp(val[O_RING], "off") == 0)
            cfg.ring = PS_RING_OFF;
        else if (strcmp(val[O_RING], "auto") == 0)
            cfg.ring = PS_RING_AUTO;
        else {
            fprintf(stderr, "paramsyncd: --ring must be auto, on or off, not '%s'\n", val[O_RING]);
            return 2;
        }
    }
    if (byte_count_flag("--ring-min-bytes", val[O_RING_MIN], &cfg.ring_min_bytes) < 0 ||
        byte_count_flag("--rd-max-bytes", val[O_RD_MAX], &cfg.rd_max_bytes) < 0 ||
        byte_count_flag("--shm-resident-bytes", val[O_SHM_RESIDENT], &cfg.shm_resident_bytes) < 0)
        return 2;
    cfg.machine_id = val[O_MACHINE_ID] ? val[O_MACHINE_ID] : boot_id(machine, sizeof machine);
    if (strlen(cfg.machine_id) > 128) {
        fprintf(stderr, "paramsyncd: --machine-id is at most 128 characters\n");
        return 2;
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
        if (parse_bytes(rank_limit, &v) < 0 || v > 1024) {
            fprintf(stderr, "paramsyncd: --metrics-rank-limit must be 0 to 1024, not '%s'\n",
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
    ps__rpc_server_t *health_srv = NULL;
    char *self = NULL, *dial = NULL;
    g_start_ms = ps__now_ms();
    if ((rc = ps__rpc_server_create_ex(&cfg.rpc, &srv)) < 0) {
        if (rc == PS_EINVAL)
            fprintf(stderr,
                    "paramsyncd: cannot read the TLS files (--tls-cert/--tls-key/--tls-ca)\n");
        goto out;
    }
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
    if (agent)
        ps__metrics_set_wait_source(ps__hub_longest_wait, ps__agent_hub(agent));
    if (val[O_HEALTH_LISTEN]) {
        int hport = 0;
        if ((rc = ps__rpc_server_create(&health_srv)) < 0 ||
            (rc = ps__health_serve_on(health, health_srv)) < 0)
            goto out;
        if ((rc = ps__rpc_server_listen_plain(health_srv, val[O_HEALTH_LISTEN], &hport)) < 0) {
            fprintf(stderr, "paramsyncd: cannot listen on --health-listen %s\n",
                    val[O_HEALTH_LISTEN]);
            goto out;
        }
        if ((rc = ps__rpc_server_start(health_srv)) < 0)
            goto out;
        PS_LOG(PS_LOG_INFO, "health (plaintext) on port %d", hport);
    }
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
    char from[64] = "";
    if (cfg.reduce_cuda && cfg.reduce_cuda_min)
        snprintf(from, sizeof(from), " from %zu KiB per input, cpu below",
                 cfg.reduce_cuda_min >> 10);
    PS_LOG(PS_LOG_INFO, "paramsyncd %s: role %s, reduce on %s%s (%s), step %zu bytes x %d",
           PS_VERSION, role, cfg.reduce_cuda ? "cuda" : "cpu", from,
           ps_reduce_path_name(ps_reduce_get_path()), cfg.step_bytes, cfg.window);
    if (cfg.role == PS_ROLE_AGENT)
        PS_LOG(PS_LOG_INFO, "agent %s, coordinator %s, machine %s", self, coordinator,
               *cfg.machine_id ? cfg.machine_id : "unknown");
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
    /* Probes see NOT_SERVING before calls are refused, and collectives in
     * flight are told why they end. */
    if (health)
        ps__health_shutdown(health);
    ps__agent_drain(agent);
    ps__coordinator_drain(coord);
    ps__rpc_server_shutdown(srv);
    ps__rpc_server_destroy(health_srv);
    /* A scrape reads the hub and the coordinator: none after this. */
    ps__metrics_stop();
    ps__agent_destroy(agent);
    ps__health_destroy(health);
    ps__coordinator_destroy(coord);
    ps__rpc_server_destroy(srv);
    if (announce && status == 0)
        unlink(announce);
    free(self);
    free(dial);
    /* Exit only once every thread that used gRPC or OpenSSL has ended, and
     * gRPC is down: its subchannels outlive their channels. */
    int left = ps__task_quiesce(PS_EXIT_WAIT_MS);
    if (left > 0)
        PS_LOG(PS_LOG_WARN, "%d task thread(s) still running at exit", left);
    ps__rpc_release();
    if (ps__rpc_wait_shutdown(PS_EXIT_WAIT_MS) < 0)
        PS_LOG(PS_LOG_WARN,
               "gRPC had not shut down %d ms after the last channel closed; "
               "exiting anyway",
               PS_EXIT_WAIT_MS);
    if (status == 0)
        PS_LOG(PS_LOG_INFO, "stopped");
    return status;
}
