/* Unit tests for server/metrics.c: the exposition parsed back, exact counts, label bounds, HTTP. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <arpa/inet.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <paramsync/common.h>

#include "metrics.h"

/* Not in metrics.h yet (asked for). */
typedef double (*ps__metrics_wait_fn)(void *arg);
void ps__metrics_set_wait_source(ps__metrics_wait_fn fn, void *arg);

/* ---- a small parser of text format 0.0.4, strict enough to catch mistakes */

#define MAX_SAMPLES 4096

typedef struct sample {
    char name[128];
    char labels[512]; /* as written, without braces, escapes decoded */
    double value;
} sample_t;

typedef struct exposition {
    sample_t s[MAX_SAMPLES];
    int n;
    char types[256][160]; /* "name type" of every # TYPE line */
    int ntypes;
} exposition_t;

static int is_name_char(char c, int first)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':' ||
           (!first && c >= '0' && c <= '9');
}

/* The family a sample belongs to: its name, less _bucket/_sum/_count for histograms. */
static const char *family_type(const exposition_t *e, const char *name)
{
    static char type[32];
    for (int i = 0; i < e->ntypes; i++) {
        char fam[128];
        if (sscanf(e->types[i], "%127s %31s", fam, type) != 2)
            continue;
        size_t fl = strlen(fam);
        if (strcmp(name, fam) == 0)
            return type;
        if (strcmp(type, "histogram") == 0 && strncmp(name, fam, fl) == 0 &&
            (strcmp(name + fl, "_bucket") == 0 || strcmp(name + fl, "_sum") == 0 ||
             strcmp(name + fl, "_count") == 0))
            return type;
    }
    return NULL;
}

/* Parses text into e; fails the test on any malformed line. */
static void parse(const char *text, exposition_t *e)
{
    memset(e, 0, sizeof(*e));
    const char *p = text;
    int lineno = 0;
    while (*p) {
        const char *eol = strchr(p, '\n');
        assert_non_null(eol); /* every line ends with \n, the last one too */
        char line[2048];
        size_t len = (size_t)(eol - p);
        assert_true(len < sizeof(line));
        memcpy(line, p, len);
        line[len] = 0;
        p = eol + 1;
        lineno++;
        if (line[0] == '#') {
            char kw[16], name[128], type[32];
            int k = sscanf(line, "# %15s %127s %31s", kw, name, type);
            assert_int_equal(k, 3); /* HELP has text, TYPE has a type */
            if (strcmp(kw, "TYPE") == 0) {
                assert_true(strcmp(type, "counter") == 0 || strcmp(type, "gauge") == 0 ||
                            strcmp(type, "histogram") == 0);
                assert_true(e->ntypes < 256);
                snprintf(e->types[e->ntypes++], sizeof(e->types[0]), "%s %s", name, type);
            } else {
                assert_string_equal(kw, "HELP");
            }
            continue;
        }
        sample_t *s = &e->s[e->n];
        assert_true(e->n < MAX_SAMPLES);
        const char *c = line;
        size_t nl = 0;
        while (is_name_char(*c, nl == 0))
            s->name[nl++] = *c++;
        assert_true(nl > 0 && nl < sizeof(s->name));
        size_t ll = 0;
        if (*c == '{') {
            c++;
            while (*c != '}') {
                /* label name="value" */
                assert_true(is_name_char(*c, 1));
                while (is_name_char(*c, 0))
                    s->labels[ll++] = *c++;
                assert_true(*c == '=' && c[1] == '"');
                s->labels[ll++] = '=';
                s->labels[ll++] = '"';
                c += 2;
                while (*c != '"') {
                    assert_true(*c != 0);
                    if (*c == '\\') {
                        c++;
                        assert_true(*c == '\\' || *c == '"' || *c == 'n');
                        s->labels[ll++] = *c == 'n' ? '\n' : *c;
                        c++;
                    } else {
                        s->labels[ll++] = *c++;
                    }
                }
                s->labels[ll++] = '"';
                c++;
                if (*c == ',') {
                    s->labels[ll++] = *c++;
                    assert_true(*c != '}');
                } else {
                    assert_true(*c == '}');
                }
                assert_true(ll < sizeof(s->labels) - 8);
            }
            c++;
        }
        s->labels[ll] = 0;
        assert_true(*c == ' ');
        char *end;
        s->value = strtod(c + 1, &end);
        assert_true(end != c + 1 && *end == 0);
        if (family_type(e, s->name) == NULL) {
            fprintf(stderr, "line %d: sample of a family without # TYPE: %s\n", lineno, line);
            fail();
        }
        e->n++;
    }
}

/* The value of one series, or NAN when absent. labels as rendered, e.g. kind="barrier",code="OK".
 */
static double value_of(const exposition_t *e, const char *name, const char *labels)
{
    for (int i = 0; i < e->n; i++)
        if (strcmp(e->s[i].name, name) == 0 && strcmp(e->s[i].labels, labels) == 0)
            return e->s[i].value;
    return NAN;
}

static double value0(const exposition_t *e, const char *name, const char *labels)
{
    double v = value_of(e, name, labels);
    return isnan(v) ? 0 : v;
}

static int series_count(const exposition_t *e, const char *name)
{
    int n = 0;
    for (int i = 0; i < e->n; i++)
        n += strcmp(e->s[i].name, name) == 0;
    return n;
}

static exposition_t *scrape(void)
{
    exposition_t *e = malloc(sizeof(*e));
    assert_non_null(e);
    char *text = ps__metrics_render();
    assert_non_null(text);
    parse(text, e);
    free(text);
    return e;
}

static void start_plain(int rank_limit)
{
    ps__metrics_config_t cfg = {NULL, rank_limit, "test", "1.2.3", "avx2", 0};
    assert_int_equal(ps__metrics_start(&cfg, NULL), 0);
}

/* ---- tests */

static void test_render_is_valid_and_complete(void **state)
{
    (void)state;
    start_plain(8);
    exposition_t *e = scrape();
    static const char *const always[] = {
        "paramsync_build_info",          "paramsync_start_time_seconds",
        "paramsync_collectives_total",   "paramsync_collectives_in_flight",
        "paramsync_payload_bytes_total", "paramsync_reduced_bytes_total",
        "paramsync_timeouts_total",      "paramsync_mismatches_total",
        "paramsync_auth_failures_total", "paramsync_rejected_requests_total",
        "paramsync_ranks_lost_total",    "paramsync_ranks_stopped_total",
        "paramsync_relayed_bytes_total", "paramsync_agent_collectives_total",
    };
    for (size_t i = 0; i < sizeof(always) / sizeof(always[0]); i++) {
        if (series_count(e, always[i]) == 0)
            fail_msg("no series of %s", always[i]);
    }
    assert_true(value_of(e, "paramsync_build_info",
                         "version=\"1.2.3\",role=\"test\",simd=\"avx2\",cuda=\"false\"") == 1);
    /* Every real kind has its OK series from the start. */
    assert_int_equal(series_count(e, "paramsync_collectives_total") >= 11, 1);
    assert_false(isnan(value_of(e, "paramsync_collectives_total", "kind=\"recv\",code=\"OK\"")));
    /* Every name follows the conventions: prefix, and _total exactly on counters. */
    for (int i = 0; i < e->ntypes; i++) {
        char fam[128], type[32];
        sscanf(e->types[i], "%127s %31s", fam, type);
        assert_int_equal(strncmp(fam, "paramsync_", 10), 0);
        size_t fl = strlen(fam);
        int total = fl > 6 && strcmp(fam + fl - 6, "_total") == 0;
        assert_int_equal(total, strcmp(type, "counter") == 0);
    }
    free(e);
}

static void test_collective_counts_exact(void **state)
{
    (void)state;
    start_plain(8);
    exposition_t *before = scrape();
    for (int i = 0; i < 37; i++)
        ps__metrics_collective_done(3 /* ALL_REDUCE */, 0, 0.002);
    ps__metrics_collective_done(3, 4 /* DEADLINE_EXCEEDED */, 31.0);
    ps__metrics_collective_done(3, PS_ETIMEDOUT, 31.0); /* a PS_E code counts as its gRPC code */
    ps__metrics_collective_done(99, 0, 0.0);            /* out of range: unspecified */
    ps__metrics_collective_done(1, 77, -1.0);           /* code out of range: UNKNOWN */
    exposition_t *after = scrape();
    const char *ar = "paramsync_collectives_total";
    assert_true(value0(after, ar, "kind=\"all_reduce\",code=\"OK\"") -
                    value0(before, ar, "kind=\"all_reduce\",code=\"OK\"") ==
                37);
    assert_true(value0(after, ar, "kind=\"all_reduce\",code=\"DEADLINE_EXCEEDED\"") -
                    value0(before, ar, "kind=\"all_reduce\",code=\"DEADLINE_EXCEEDED\"") ==
                2);
    assert_true(value0(after, ar, "kind=\"unspecified\",code=\"OK\"") -
                    value0(before, ar, "kind=\"unspecified\",code=\"OK\"") ==
                1);
    assert_true(value0(after, ar, "kind=\"barrier\",code=\"UNKNOWN\"") -
                    value0(before, ar, "kind=\"barrier\",code=\"UNKNOWN\"") ==
                1);

    /* The histogram: 0.002 s falls in le="0.0025", not le="0.001"; 31 s in le="60". */
    const char *h = "paramsync_collective_duration_seconds_bucket";
    assert_true(value0(after, h, "kind=\"all_reduce\",le=\"0.001\"") -
                    value0(before, h, "kind=\"all_reduce\",le=\"0.001\"") ==
                0);
    assert_true(value0(after, h, "kind=\"all_reduce\",le=\"0.0025\"") -
                    value0(before, h, "kind=\"all_reduce\",le=\"0.0025\"") ==
                37);
    assert_true(value0(after, h, "kind=\"all_reduce\",le=\"30\"") -
                    value0(before, h, "kind=\"all_reduce\",le=\"30\"") ==
                37);
    assert_true(value0(after, h, "kind=\"all_reduce\",le=\"60\"") -
                    value0(before, h, "kind=\"all_reduce\",le=\"60\"") ==
                39);
    assert_true(
        value0(after, "paramsync_collective_duration_seconds_count", "kind=\"all_reduce\"") -
            value0(before, "paramsync_collective_duration_seconds_count", "kind=\"all_reduce\"") ==
        39);
    double dsum =
        value0(after, "paramsync_collective_duration_seconds_sum", "kind=\"all_reduce\"") -
        value0(before, "paramsync_collective_duration_seconds_sum", "kind=\"all_reduce\"");
    assert_true(fabs(dsum - (37 * 0.002 + 62.0)) < 1e-6);
    free(before);
    free(after);
}

/* Every histogram series is cumulative, ends in +Inf, and its _count equals +Inf. */
static void test_histograms_consistent(void **state)
{
    (void)state;
    start_plain(8);
    double obs[] = {0, 0.00005, 0.0001, 0.00011, 0.7, 1, 1800, 1801, 1e12};
    for (size_t i = 0; i < sizeof(obs) / sizeof(obs[0]); i++) {
        ps__metrics_collective_done(2, 0, obs[i]);
        ps__metrics_arrival(2, obs[i], 0);
    }
    exposition_t *e = scrape();
    const char *fams[] = {"paramsync_collective_duration_seconds",
                          "paramsync_arrival_skew_seconds"};
    for (int f = 0; f < 2; f++) {
        char name[160];
        snprintf(name, sizeof(name), "%s_bucket", fams[f]);
        double prev = -1, last = -1;
        int buckets = 0;
        for (int i = 0; i < e->n; i++) {
            if (strcmp(e->s[i].name, name) != 0 ||
                strncmp(e->s[i].labels, "kind=\"broadcast\",", 17) != 0)
                continue;
            assert_true(e->s[i].value >= prev);
            prev = last = e->s[i].value;
            buckets++;
            if (strstr(e->s[i].labels, "le=\"+Inf\""))
                break;
        }
        assert_int_equal(buckets, 21);
        snprintf(name, sizeof(name), "%s_count", fams[f]);
        assert_true(value_of(e, name, "kind=\"broadcast\"") == last);
        /* le is inclusive: exactly 0.0001 s is in the first bucket, with 0 and 0.00005. */
        snprintf(name, sizeof(name), "%s_bucket", fams[f]);
        assert_true(value_of(e, name, "kind=\"broadcast\",le=\"0.0001\"") >= 3);
    }
    free(e);
}

static void test_straggler_rank_limit(void **state)
{
    (void)state;
    start_plain(4);
    exposition_t *before = scrape();
    ps__metrics_arrival(3, 0.5, 3);
    ps__metrics_arrival(3, 0.5, 3);
    ps__metrics_arrival(3, 0.5, 4);    /* at the limit: other */
    ps__metrics_arrival(3, 0.5, 1000); /* far above: other */
    ps__metrics_arrival(3, 0.5, -1);   /* unknown: other */
    exposition_t *after = scrape();
    const char *st = "paramsync_straggler_total";
    assert_true(value0(after, st, "rank=\"3\"") - value0(before, st, "rank=\"3\"") == 2);
    assert_true(value0(after, st, "rank=\"other\"") - value0(before, st, "rank=\"other\"") == 3);
    assert_true(isnan(value_of(after, st, "rank=\"4\"")));
    assert_true(isnan(value_of(after, st, "rank=\"1000\"")));
    assert_true(series_count(after, st) <= 4 + 1);
    /* Limit 0: every rank is "other"; counts already made above the limit move there too. */
    start_plain(0);
    exposition_t *zero = scrape();
    assert_int_equal(series_count(zero, st), 1);
    double all = 0;
    for (int i = 0; i < after->n; i++)
        if (strcmp(after->s[i].name, st) == 0)
            all += after->s[i].value;
    assert_true(value0(zero, st, "rank=\"other\"") == all);
    /* A huge limit is clamped to the fixed slots, so cardinality stays bounded. */
    start_plain(1 << 30);
    free(after);
    after = scrape();
    ps__metrics_arrival(3, 0, 5000);
    exposition_t *big = scrape();
    assert_true(value0(big, st, "rank=\"other\"") - value0(after, st, "rank=\"other\"") == 1);
    assert_true(series_count(big, st) <= 1024 + 1);
    free(before);
    free(after);
    free(zero);
    free(big);
}

static void test_bytes_events_inflight(void **state)
{
    (void)state;
    start_plain(8);
    exposition_t *before = scrape();
    ps__metrics_bytes(PS_M_RX, PS_M_LINK_WORKER, 4096);
    ps__metrics_bytes(PS_M_RX, PS_M_LINK_WORKER, 1);
    ps__metrics_bytes(PS_M_TX, PS_M_LINK_AGENT, 1ull << 40);
    ps__metrics_bytes(7, 0, 5); /* ignored */
    ps__metrics_reduced(PS_M_DEV_CPU, 12);
    ps__metrics_reduced(PS_M_DEV_CUDA, 7);
    ps__metrics_reduced(-1, 7); /* ignored */
    ps__metrics_relayed(3);
    ps__metrics_ring(PS_M_RING_RD);
    ps__metrics_ring(PS_M_RING_RD);
    ps__metrics_ring(PS_M_RING_MESH);
    ps__metrics_ring(PS_M_RING_COUNT); /* ignored */
    for (int e = 0; e < PS_M_EV_COUNT; e++)
        for (int i = 0; i <= e; i++)
            ps__metrics_event(e);
    ps__metrics_event(PS_M_EV_COUNT); /* ignored */
    ps__metrics_inflight_add(1);
    ps__metrics_inflight_add(1);
    ps__metrics_inflight_add(-1);
    exposition_t *after = scrape();
#define DELTA(name, labels) (value0(after, name, labels) - value0(before, name, labels))
    const char *b = "paramsync_payload_bytes_total";
    assert_true(DELTA(b, "direction=\"received\",link=\"worker\"") == 4097);
    assert_true(DELTA(b, "direction=\"sent\",link=\"agent\"") == (double)(1ull << 40));
    assert_true(DELTA(b, "direction=\"sent\",link=\"worker\"") == 0);
    assert_true(DELTA(b, "direction=\"received\",link=\"agent\"") == 0);
    assert_true(DELTA("paramsync_reduced_bytes_total", "device=\"cpu\"") == 12);
    assert_true(DELTA("paramsync_reduced_bytes_total", "device=\"cuda\"") == 7);
    assert_true(DELTA("paramsync_relayed_bytes_total", "") == 3);
    const char *ac = "paramsync_agent_collectives_total";
    assert_true(DELTA(ac, "algorithm=\"recursive_doubling\"") == 2);
    assert_true(DELTA(ac, "algorithm=\"mesh\"") == 1);
    assert_true(DELTA(ac, "algorithm=\"ring\"") == 0);
    assert_true(DELTA("paramsync_timeouts_total", "") == 1);
    assert_true(DELTA("paramsync_mismatches_total", "") == 2);
    assert_true(DELTA("paramsync_auth_failures_total", "") == 3);
    assert_true(DELTA("paramsync_rejected_requests_total", "") == 4);
    assert_true(DELTA("paramsync_ranks_lost_total", "") == 5);
    assert_true(DELTA("paramsync_ranks_stopped_total", "") == 6);
    assert_true(DELTA("paramsync_collectives_in_flight", "") == 1);
#undef DELTA
    ps__metrics_inflight_add(-1);
    free(before);
    free(after);
}

static void test_grpc_methods_and_escaping(void **state)
{
    (void)state;
    start_plain(8);
    exposition_t *before = scrape();
    char name[64];
    strcpy(name, "/paramsync.v1.Worker/Join");
    ps__metrics_grpc_call(name, 0);
    char *copy = strdup(name); /* another pointer, same name: the same series */
    assert_non_null(copy);
    ps__metrics_grpc_call(copy, 0);
    free(copy);
    ps__metrics_grpc_call("/paramsync.v1.Worker/Join", 14);
    ps__metrics_grpc_call("/grpc.health.v1.Health/Check", 5);
    ps__metrics_grpc_call("odd\"name\\with\nescapes", 0);
    ps__metrics_grpc_call(NULL, 0);
    exposition_t *after = scrape();
    const char *g = "paramsync_grpc_calls_total";
#define DELTA(labels) (value0(after, g, labels) - value0(before, g, labels))
    assert_true(DELTA("service=\"paramsync.v1.Worker\",method=\"Join\",code=\"OK\"") == 2);
    assert_true(DELTA("service=\"paramsync.v1.Worker\",method=\"Join\",code=\"UNAVAILABLE\"") == 1);
    assert_true(DELTA("service=\"grpc.health.v1.Health\",method=\"Check\",code=\"NOT_FOUND\"") ==
                1);
    assert_true(DELTA("service=\"\",method=\"odd\"name\\with\nescapes\",code=\"OK\"") == 1);
    assert_true(DELTA("service=\"other\",method=\"other\",code=\"OK\"") == 1);
    /* The method table is bounded: new names beyond it count as other. */
    for (int i = 0; i < 100; i++) {
        snprintf(name, sizeof(name), "/x.Svc/M%d", i);
        ps__metrics_grpc_call(name, 0);
    }
    exposition_t *many = scrape();
    assert_true(series_count(many, g) <= 48 * 17 + 17);
    assert_true(value0(many, g, "service=\"other\",method=\"other\",code=\"OK\"") -
                    value0(after, g, "service=\"other\",method=\"other\",code=\"OK\"") >
                0);
#undef DELTA
    free(before);
    free(after);
    free(many);
}

static void test_build_info_escaping(void **state)
{
    (void)state;
    ps__metrics_config_t cfg = {"off", 8, "agent", "9.9\"x\\y\nz", NULL, 1};
    const char *bound = "unset";
    assert_int_equal(ps__metrics_start(&cfg, &bound), 0);
    assert_null(bound);
    exposition_t *e = scrape();
    assert_true(
        value_of(e, "paramsync_build_info",
                 "version=\"9.9\"x\\y\nz\",role=\"agent\",simd=\"unknown\",cuda=\"true\"") == 1);
    free(e);
}

static void gauges(void *arg, ps__metrics_gauges_t *out)
{
    int *calls = arg;
    (*calls)++;
    out->jobs = 2;
    out->groups = 5;
    out->members = 8;
    out->agents = 3;
}

static void test_gauge_source(void **state)
{
    (void)state;
    start_plain(8);
    int calls = 0;
    ps__metrics_set_gauge_source(gauges, &calls);
    exposition_t *e = scrape();
    assert_int_equal(calls, 1);
    assert_true(value_of(e, "paramsync_jobs", "") == 2);
    assert_true(value_of(e, "paramsync_groups", "") == 5);
    assert_true(value_of(e, "paramsync_members", "") == 8);
    assert_true(value_of(e, "paramsync_agents", "") == 3);
    ps__metrics_set_gauge_source(NULL, NULL);
    free(e);
    e = scrape();
    assert_int_equal(calls, 1);
    assert_true(isnan(value_of(e, "paramsync_jobs", "")));
    free(e);
}

static double longest_wait(void *arg)
{
    return *(double *)arg;
}

static void test_wait_source(void **state)
{
    (void)state;
    start_plain(8);
    exposition_t *e = scrape();
    assert_true(isnan(value_of(e, "paramsync_collective_longest_wait_seconds", "")));
    free(e);
    double w = 12.5;
    ps__metrics_set_wait_source(longest_wait, &w);
    e = scrape();
    assert_true(value_of(e, "paramsync_collective_longest_wait_seconds", "") == 12.5);
    free(e);
    w = -1; /* nothing waits */
    e = scrape();
    assert_true(value_of(e, "paramsync_collective_longest_wait_seconds", "") == 0);
    free(e);
    ps__metrics_set_wait_source(NULL, NULL);
    e = scrape();
    assert_true(isnan(value_of(e, "paramsync_collective_longest_wait_seconds", "")));
    free(e);
}

#define THREADS    4
#define PER_THREAD 200000
static void *hammer(void *arg)
{
    (void)arg;
    for (int i = 0; i < PER_THREAD; i++) {
        ps__metrics_collective_done(9, 0, 0.0003);
        ps__metrics_bytes(PS_M_TX, PS_M_LINK_WORKER, 3);
        ps__metrics_arrival(9, 0.0, i & 1);
    }
    return NULL;
}

static void test_concurrent_updates_exact(void **state)
{
    (void)state;
    start_plain(8);
    exposition_t *before = scrape();
    pthread_t t[THREADS];
    for (int i = 0; i < THREADS; i++)
        assert_int_equal(pthread_create(&t[i], NULL, hammer, NULL), 0);
    for (int i = 0; i < THREADS; i++)
        pthread_join(t[i], NULL);
    exposition_t *after = scrape();
#define DELTA(name, labels) (value0(after, name, labels) - value0(before, name, labels))
    assert_true(DELTA("paramsync_collectives_total", "kind=\"all_to_all\",code=\"OK\"") ==
                THREADS * PER_THREAD);
    assert_true(DELTA("paramsync_collective_duration_seconds_count", "kind=\"all_to_all\"") ==
                THREADS * PER_THREAD);
    assert_true(DELTA("paramsync_payload_bytes_total", "direction=\"sent\",link=\"worker\"") ==
                3.0 * THREADS * PER_THREAD);
    assert_true(DELTA("paramsync_straggler_total", "rank=\"0\"") == THREADS * PER_THREAD / 2);
    assert_true(DELTA("paramsync_straggler_total", "rank=\"1\"") == THREADS * PER_THREAD / 2);
#undef DELTA
    free(before);
    free(after);
}

/* ---- HTTP */

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* One HTTP/1.0 request to 127.0.0.1:port; returns the whole response (malloc'd). */
static char *http(int port, const char *request)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof(a));
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    assert_true(write(fd, request, strlen(request)) == (ssize_t)strlen(request));
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    assert_non_null(buf);
    ssize_t n;
    while ((n = read(fd, buf + len, cap - len - 1)) > 0) {
        len += (size_t)n;
        if (len + 1 == cap) {
            cap *= 2;
            buf = realloc(buf, cap);
            assert_non_null(buf);
        }
    }
    buf[len] = 0;
    close(fd);
    return buf;
}

static void test_http(void **state)
{
    (void)state;
    ps__metrics_config_t cfg = {"127.0.0.1:0", 8, "embedded", "0.1.0", "scalar", 0};
    const char *bound = NULL;
    assert_int_equal(ps__metrics_start(&cfg, &bound), 0);
    assert_non_null(bound);
    int port = 0;
    assert_int_equal(sscanf(bound, "127.0.0.1:%d", &port), 1);
    assert_true(port > 0);
    /* A second start without stop is refused; the first keeps serving. */
    assert_int_equal(ps__metrics_start(&cfg, NULL), PS_EINVAL);

    char *r = http(port, "GET /metrics HTTP/1.0\r\n\r\n");
    assert_non_null(strstr(r, "HTTP/1.0 200") ? r : strstr(r, "HTTP/1.1 200"));
    assert_non_null(strstr(r, "\r\nContent-Type: text/plain; version=0.0.4\r\n"));
    char *body = strstr(r, "\r\n\r\n");
    assert_non_null(body);
    exposition_t *e = malloc(sizeof(*e));
    assert_non_null(e);
    parse(body + 4, e);
    assert_true(value_of(e, "paramsync_build_info",
                         "version=\"0.1.0\",role=\"embedded\",simd=\"scalar\",cuda=\"false\"") ==
                1);
    free(e);
    free(r);

    r = http(port, "GET / HTTP/1.0\r\n\r\n");
    assert_non_null(strstr(r, " 404 "));
    free(r);
    r = http(port, "GET /metricsx HTTP/1.0\r\n\r\n");
    assert_non_null(strstr(r, " 404 "));
    free(r);
    r = http(port, "POST /metrics HTTP/1.0\r\nContent-Length: 0\r\n\r\n");
    assert_non_null(strstr(r, " 405 "));
    free(r);

    /* The port is taken while serving: another registry could not bind it. */
    char taken[64];
    snprintf(taken, sizeof(taken), "127.0.0.1:%d", port);
    ps__metrics_stop();
    ps__metrics_stop(); /* idempotent */
    cfg.addr = taken;
    assert_int_equal(ps__metrics_start(&cfg, &bound), 0); /* free again after stop */
    ps__metrics_stop();

    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof(a));
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t al = sizeof(a);
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    assert_int_equal(listen(fd, 1), 0);
    assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &al), 0);
    snprintf(taken, sizeof(taken), "127.0.0.1:%d", ntohs(a.sin_port));
    cfg.addr = taken;
    bound = "unchanged";
    assert_int_equal(ps__metrics_start(&cfg, &bound), PS_EUNAVAIL);
    assert_string_equal(bound, "unchanged");
    close(fd);

    static const char *const bad[] = {"nohostport", "127.0.0.1:", "127.0.0.1:99999",
                                      "127.0.0.1:12x", "no.such.host.invalid:9"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        cfg.addr = bad[i];
        if (ps__metrics_start(&cfg, NULL) != PS_EINVAL)
            fail_msg("address %s was not refused with PS_EINVAL", bad[i]);
    }
}

/* Connects to 127.0.0.1:port; the socket, or -1. */
static int connect_local(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof(a));
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        close(fd);
        fd = -1;
    }
    return fd;
}

/* Clients that never finish their request, more of them than the server
 * takes at once, must not lock a scraper out past Prometheus' 10 s. */
static void test_http_slow_clients(void **state)
{
    (void)state;
    ps__metrics_config_t cfg = {"127.0.0.1:0", 8, "embedded", "0.1.0", "scalar", 0};
    const char *bound = NULL;
    assert_int_equal(ps__metrics_start(&cfg, &bound), 0);
    int port = 0;
    assert_int_equal(sscanf(bound, "127.0.0.1:%d", &port), 1);
    enum { HELD = 300 };
    int held[HELD];
    for (int i = 0; i < HELD; i++) {
        held[i] = connect_local(port);
        assert_true(held[i] >= 0);
        assert_int_equal(write(held[i], "GET /metr", 9), 9);
    }
    int64_t t0 = now_ms();
    char *r = http(port, "GET /metrics HTTP/1.0\r\n\r\n");
    int64_t took = now_ms() - t0;
    printf("scrape with %d half-open requests held: %lld ms\n", HELD, (long long)took);
    assert_non_null(strstr(r, " 200 "));
    assert_true(took < 10000);
    free(r);
    for (int i = 0; i < HELD; i++)
        close(held[i]);
    ps__metrics_stop();
}

/* Cost of the hot-path updates; printed for the record, not asserted (timing varies). */
static void test_cost_printed(void **state)
{
    (void)state;
    start_plain(64);
    const int n = 2000000;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; i < n; i++) {
        ps__metrics_collective_done(3, 0, 0.00005);
        ps__metrics_arrival(3, 0.00001, i & 3);
        ps__metrics_bytes(PS_M_RX, PS_M_LINK_WORKER, 4);
        ps__metrics_bytes(PS_M_TX, PS_M_LINK_WORKER, 4);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double ns = ((double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec)) / n;
    char *text = NULL;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; i < 100; i++) {
        free(text);
        text = ps__metrics_render();
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double render_us =
        ((double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec)) / 100 / 1e3;
    printf("metrics cost: %.1f ns per collective (done + arrival + 2 x bytes, one thread); "
           "render %.1f us for %zu bytes\n",
           ns, render_us, text ? strlen(text) : 0);
    free(text);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_render_is_valid_and_complete),
        cmocka_unit_test(test_collective_counts_exact),
        cmocka_unit_test(test_histograms_consistent),
        cmocka_unit_test(test_straggler_rank_limit),
        cmocka_unit_test(test_bytes_events_inflight),
        cmocka_unit_test(test_grpc_methods_and_escaping),
        cmocka_unit_test(test_build_info_escaping),
        cmocka_unit_test(test_gauge_source),
        cmocka_unit_test(test_wait_source),
        cmocka_unit_test(test_concurrent_updates_exact),
        cmocka_unit_test(test_http),
        cmocka_unit_test(test_http_slow_clients),
        cmocka_unit_test(test_cost_printed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
