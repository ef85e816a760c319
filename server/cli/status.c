/* `paramsync status`: a daemon's jobs, ranks and collectives in flight, for people and scripts. */
#include <ctype.h>
#include <getopt.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <paramsync/common.h>
#include <paramsync/v1/paramsync.pb-c.h>

#include "cli.h"
#include "rpc/rpc.h"

#define STATUS_METHOD "/paramsync.v1.Admin/Status"

typedef Paramsync__V1__StatusResponse status_t;
typedef Paramsync__V1__InFlightCollective inflight_t;
typedef Paramsync__V1__JobStatus job_t;

/* One daemon asked: the one named by --addr, or an agent it listed. */
typedef struct source {
    char *addr;
    status_t *resp; /* NULL when the call failed */
    int rc;         /* 0 or the negative code */
    char *error;    /* what went wrong, for people */
} source_t;

/* A collective in flight and the agent (hub) that reported it. */
typedef struct inflight_ref {
    const inflight_t *c;
    const char *agent;
} inflight_ref_t;

typedef struct view {
    source_t *src; /* src[0] is --addr */
    size_t nsrc;
    inflight_ref_t *inflight;
    size_t ninflight;
} view_t;

static void usage(FILE *out)
{
    fprintf(out,
            "Usage: paramsync status [--addr HOST:PORT] [--job JOB] [--json] [OPTIONS]\n"
            "\n"
            "Asks a paramsyncd what it knows and prints what you need when a job hangs: its\n"
            "jobs and their ranks (state, agent, worker address), process groups, and every\n"
            "collective in flight with the ranks it is still waiting for and for how long.\n"
            "Pointed at a coordinator, it also asks each registered agent for the\n"
            "collectives it hosts.\n"
            "\n"
            "  --addr ADDR      the daemon, HOST:PORT or unix:PATH [PARAMSYNC_ADDR]\n"
            "                   (default " PS_CLI_DEFAULT_ADDR ")\n"
            "  --job JOB        only this job\n"
            "  --json           one JSON object on stdout, for scripts: daemon, agents,\n"
            "                   stopping_agents (those shutting down), jobs\n"
            "                   (ranks, groups), collectives (with agent, waiting_for,\n"
            "                   waiting_seconds) and errors (agents that did not answer)\n"
            "  --timeout SEC    how long to wait for each daemon (default 5)\n"
            "  --tls-ca PEM     speak TLS, verifying the daemons with these CAs\n"
            "                   [PARAMSYNC_TLS_CA]\n"
            "  --tls-cert PEM, --tls-key PEM\n"
            "                   speak TLS with this client certificate, for daemons that\n"
            "                   require one [PARAMSYNC_TLS_CERT, PARAMSYNC_TLS_KEY]\n"
            "  --tls-server-name NAME\n"
            "                   name expected in the daemons' certificates, if not their\n"
            "                   host [PARAMSYNC_TLS_SERVER_NAME]\n"
            "  -h, --help       print this help and exit\n"
            "\n"
            "Exit status: 0 when the daemon answered (agents that did not are warnings, and\n"
            "\"errors\" in JSON); 1 when it cannot be reached or fails; 2 for a usage error.\n");
}

/* "ALL_REDUCE" -> "all_reduce", from the generated enum descriptor. */
static const char *enum_name(char *buf, size_t len, const ProtobufCEnumDescriptor *d, int v)
{
    const ProtobufCEnumValue *ev = protobuf_c_enum_descriptor_get_value(d, v);
    if (!ev) {
        snprintf(buf, len, "%d", v);
        return buf;
    }
    size_t i = 0;
    for (; ev->name[i] && i + 1 < len; i++)
        buf[i] = (char)tolower((unsigned char)ev->name[i]);
    buf[i] = 0;
    return buf;
}

static const char *kind_name(char *buf, size_t len, int kind)
{
    return enum_name(buf, len, &paramsync__v1__collective_kind__descriptor, kind);
}

static const char *dtype_name(char *buf, size_t len, int dtype)
{
    return enum_name(buf, len, &paramsync__v1__dtype__descriptor, dtype);
}

static char *dup_printf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *dup_printf(const char *fmt, ...)
{
    va_list ap;
    char *s = NULL;
    va_start(ap, fmt);
    if (vasprintf(&s, fmt, ap) < 0)
        s = NULL;
    va_end(ap);
    return s;
}

/* Asks addr for its status over a channel with opts (TLS). Fills src (addr
 * taken over); the error text says what a person can do about it (hint: how
 * to point elsewhere). */
static void ask(source_t *src, char *addr, const char *job, int timeout_ms,
                const ps__rpc_options_t *opts, const char *hint)
{
    memset(src, 0, sizeof(*src));
    src->addr = addr;
    const char *why = NULL;
    if (ps__cli_probe(addr, timeout_ms < 3000 ? timeout_ms : 3000, &why) < 0) {
        src->rc = PS_EUNAVAIL;
        src->error = dup_printf("cannot connect to %s: %s (is paramsyncd running there?%s)", addr,
                                why, hint);
        return;
    }
    ps__rpc_channel_t *ch = NULL;
    int rc = ps__rpc_channel_create_ex(addr, opts, &ch);
    if (rc < 0) {
        src->rc = rc;
        src->error = rc == PS_EINVAL && (opts->tls_ca || opts->tls_cert)
                         ? dup_printf("cannot read the TLS files (--tls-ca, --tls-cert, "
                                      "--tls-key) to reach %s",
                                      addr)
                         : dup_printf("bad address %s: %s", addr, ps_strerror(rc));
        return;
    }
    Paramsync__V1__StatusRequest req = PARAMSYNC__V1__STATUS_REQUEST__INIT;
    req.job = (char *)(job ? job : "");
    ProtobufCMessage *resp = NULL;
    char *msg = NULL;
    rc = ps__rpc_unary(ch, STATUS_METHOD, &req.base, &paramsync__v1__status_response__descriptor,
                       &resp, timeout_ms, &msg);
    ps__rpc_channel_destroy(ch);
    if (rc == 0) {
        src->resp = (status_t *)resp;
    } else {
        src->rc = rc;
        if (rc == PS_ETIMEDOUT)
            src->error =
                dup_printf("%s did not answer within %.1f s (overloaded, not a "
                           "paramsyncd%s?)",
                           addr, timeout_ms / 1e3,
                           opts->tls_ca || opts->tls_cert ? ", or a TLS name or CA mismatch"
                                                          : ", or serving TLS: pass --tls-ca");
        else if (rc == PS_EUNAVAIL && !opts->tls_ca && !opts->tls_cert)
            src->error = dup_printf("%s did not answer (%s); if it serves TLS, pass --tls-ca", addr,
                                    msg && *msg ? msg : "unavailable");
        else if (rc == PS_ENOTSUP)
            src->error = dup_printf("%s does not serve %s (an older paramsyncd, or another "
                                    "gRPC server)",
                                    addr, STATUS_METHOD);
        else
            src->error = dup_printf("%s answered %s: %s", addr, ps_strerror(rc),
                                    msg && *msg ? msg : "(no message)");
    }
    free(msg);
}

static int add_inflight(view_t *v, status_t *r, const char *agent)
{
    if (!r || r->n_collectives == 0)
        return 0;
    inflight_ref_t *a = realloc(v->inflight, (v->ninflight + r->n_collectives) * sizeof(*a));
    if (!a)
        return PS_ENOMEM;
    v->inflight = a;
    for (size_t i = 0; i < r->n_collectives; i++)
        v->inflight[v->ninflight++] = (inflight_ref_t){r->collectives[i], agent};
    return 0;
}

static int inflight_order(const void *pa, const void *pb)
{
    const inflight_ref_t *a = pa, *b = pb;
    int c = strcmp(a->c->job ? a->c->job : "", b->c->job ? b->c->job : "");
    if (c)
        return c;
    /* Longest wait first: that is where to look. */
    if (a->c->waiting_seconds != b->c->waiting_seconds)
        return a->c->waiting_seconds < b->c->waiting_seconds ? 1 : -1;
    if (a->c->group != b->c->group)
        return a->c->group < b->c->group ? -1 : 1;
    return a->c->seq < b->c->seq ? -1 : a->c->seq > b->c->seq;
}

static int job_order(const void *pa, const void *pb)
{
    const job_t *a = *(job_t *const *)pa, *b = *(job_t *const *)pb;
    return strcmp(a->job ? a->job : "", b->job ? b->job : "");
}

/* Asks --addr, then every agent it lists that is not itself. */
static int gather(view_t *v, const char *addr, const char *job, int timeout_ms,
                  const ps__rpc_options_t *opts)
{
    v->src = calloc(1, sizeof(*v->src));
    char *a0 = strdup(addr);
    if (!v->src || !a0) {
        free(a0);
        return PS_ENOMEM;
    }
    v->nsrc = 1;
    ask(&v->src[0], a0, job, timeout_ms, opts, " --addr or PARAMSYNC_ADDR names another");
    status_t *main_resp = v->src[0].resp;
    if (!main_resp)
        return v->src[0].rc;
    const char *self = main_resp->address ? main_resp->address : "";
    if (add_inflight(v, main_resp, self) < 0)
        return PS_ENOMEM;
    for (size_t i = 0; i < main_resp->n_agents; i++) {
        const char *ag = main_resp->agents[i];
        int seen = !ag || !*ag || strcmp(ag, self) == 0 || strcmp(ag, addr) == 0;
        for (size_t k = 1; k < v->nsrc && !seen; k++)
            seen = strcmp(v->src[k].addr, ag) == 0;
        if (seen)
            continue;
        source_t *s = realloc(v->src, (v->nsrc + 1) * sizeof(*s));
        char *copy = s ? strdup(ag) : NULL;
        if (s)
            v->src = s;
        if (!copy)
            return PS_ENOMEM;
        ask(&v->src[v->nsrc], copy, job, timeout_ms, opts, "");
        v->nsrc++;
    }
    for (size_t k = 1; k < v->nsrc; k++)
        if (add_inflight(v, v->src[k].resp, v->src[k].addr) < 0)
            return PS_ENOMEM;
    if (job && *job) {
        size_t n = 0;
        for (size_t i = 0; i < v->ninflight; i++)
            if (strcmp(v->inflight[i].c->job ? v->inflight[i].c->job : "", job) == 0)
                v->inflight[n++] = v->inflight[i];
        v->ninflight = n;
    }
    if (v->ninflight)
        qsort(v->inflight, v->ninflight, sizeof(*v->inflight), inflight_order);
    if (main_resp->n_jobs)
        qsort(main_resp->jobs, main_resp->n_jobs, sizeof(*main_resp->jobs), job_order);
    return 0;
}

static void view_free(view_t *v)
{
    for (size_t i = 0; i < v->nsrc; i++) {
        if (v->src[i].resp)
            protobuf_c_message_free_unpacked(&v->src[i].resp->base, NULL);
        free(v->src[i].addr);
        free(v->src[i].error);
    }
    free(v->src);
    free(v->inflight);
}

/* ---------------------------------------------------------------- JSON */

static void json_ints(FILE *f, const int32_t *a, size_t n)
{
    fputc('[', f);
    for (size_t i = 0; i < n; i++)
        fprintf(f, "%s%d", i ? "," : "", a[i]);
    fputc(']', f);
}

static void json_key(FILE *f, int *first, const char *key)
{
    fputs(*first ? "" : ",", f);
    *first = 0;
    ps__cli_json_string(f, key);
    fputc(':', f);
}

/* "what (N): a, b" and a newline; nothing when n is 0. */
static void text_list(FILE *f, const char *what, char *const *s, size_t n)
{
    if (!n)
        return;
    fprintf(f, "%s (%zu): ", what, n);
    for (size_t i = 0; i < n; i++) {
        fputs(i ? ", " : "", f);
        ps__cli_text(f, s[i]);
    }
    fputc('\n', f);
}

/* "key":["a","b"] */
static void json_strings(FILE *f, int *first, const char *key, char *const *s, size_t n)
{
    json_key(f, first, key);
    fputc('[', f);
    for (size_t i = 0; i < n; i++) {
        fputs(i ? "," : "", f);
        ps__cli_json_string(f, s[i]);
    }
    fputc(']', f);
}

static void print_json(FILE *f, const view_t *v)
{
    const status_t *r = v->src[0].resp;
    char b1[32], b2[32];
    int first = 1;
    fputc('{', f);
    json_key(f, &first, "daemon");
    fputs("{\"address\":", f);
    ps__cli_json_string(f, r->address);
    fputs(",\"asked\":", f);
    ps__cli_json_string(f, v->src[0].addr);
    fputs(",\"role\":", f);
    ps__cli_json_string(f, r->role);
    fputs(",\"version\":", f);
    ps__cli_json_string(f, r->version);
    fputs(",\"uptime_seconds\":", f);
    ps__cli_json_number(f, r->uptime_seconds);
    fputc('}', f);

    json_strings(f, &first, "agents", r->agents, r->n_agents);
    json_strings(f, &first, "stopping_agents", r->stopping_agents, r->n_stopping_agents);

    json_key(f, &first, "jobs");
    fputc('[', f);
    for (size_t j = 0; j < r->n_jobs; j++) {
        const job_t *js = r->jobs[j];
        fputs(j ? ",{\"job\":" : "{\"job\":", f);
        ps__cli_json_string(f, js->job);
        fputs(",\"state\":", f);
        ps__cli_json_string(f, js->state);
        if (js->message && *js->message) {
            fputs(",\"message\":", f);
            ps__cli_json_string(f, js->message);
        }
        fprintf(f, ",\"world_size\":%d,\"incarnation\":%llu,\"hub\":", js->world_size,
                (unsigned long long)js->incarnation);
        ps__cli_json_string(f, js->hub);
        fputs(",\"ranks\":[", f);
        for (size_t k = 0; k < js->n_ranks; k++) {
            const Paramsync__V1__RankStatus *rs = js->ranks[k];
            fprintf(f, "%s{\"rank\":%d,\"state\":", k ? "," : "", rs->rank);
            ps__cli_json_string(f, rs->state);
            fputs(",\"peer\":", f);
            ps__cli_json_string(f, rs->peer);
            fputs(",\"agent\":", f);
            ps__cli_json_string(f, rs->agent);
            fputs(",\"machine\":", f);
            ps__cli_json_string(f, rs->machine);
            fputc('}', f);
        }
        fputs("],\"groups\":[", f);
        for (size_t g = 0; g < js->n_groups; g++) {
            fprintf(f, "%s{\"group\":%u,\"ranks\":", g ? "," : "", js->groups[g]->group);
            json_ints(f, js->groups[g]->ranks, js->groups[g]->n_ranks);
            fputc('}', f);
        }
        fputs("]}", f);
    }
    fputc(']', f);

    json_key(f, &first, "collectives");
    fputc('[', f);
    for (size_t i = 0; i < v->ninflight; i++) {
        const inflight_t *c = v->inflight[i].c;
        fputs(i ? ",{\"agent\":" : "{\"agent\":", f);
        ps__cli_json_string(f, v->inflight[i].agent);
        fputs(",\"job\":", f);
        ps__cli_json_string(f, c->job);
        fprintf(f, ",\"group\":%u,\"seq\":%llu,\"kind\":", c->group, (unsigned long long)c->seq);
        ps__cli_json_string(f, kind_name(b1, sizeof(b1), c->kind));
        fputs(",\"dtype\":", f);
        ps__cli_json_string(f, dtype_name(b2, sizeof(b2), c->dtype));
        fprintf(f, ",\"count\":%llu,\"group_size\":%d,\"state\":", (unsigned long long)c->count,
                c->group_size);
        ps__cli_json_string(f, c->state);
        fputs(",\"arrived\":", f);
        json_ints(f, c->arrived, c->n_arrived);
        fputs(",\"waiting_for\":", f);
        json_ints(f, c->waiting_for, c->n_waiting_for);
        fputs(",\"waiting_seconds\":", f);
        ps__cli_json_number(f, c->waiting_seconds);
        fputs(",\"message\":", f);
        ps__cli_json_string(f, c->message);
        fputc('}', f);
    }
    fputc(']', f);

    json_key(f, &first, "errors");
    fputc('[', f);
    int ne = 0;
    for (size_t k = 1; k < v->nsrc; k++) {
        if (!v->src[k].error)
            continue;
        fputs(ne++ ? ",{\"agent\":" : "{\"agent\":", f);
        ps__cli_json_string(f, v->src[k].addr);
        fprintf(f, ",\"code\":%d,\"error\":", -v->src[k].rc);
        ps__cli_json_string(f, v->src[k].error);
        fputc('}', f);
    }
    fputs("]}\n", f);
}

/* ---------------------------------------------------------------- text */

static const job_t *find_job(const status_t *r, const char *name)
{
    for (size_t j = 0; j < r->n_jobs; j++)
        if (strcmp(r->jobs[j]->job ? r->jobs[j]->job : "", name ? name : "") == 0)
            return r->jobs[j];
    return NULL;
}

/* The job rank of group rank gr, or -1 when unknown. */
static int job_rank(const job_t *js, uint32_t group, int gr)
{
    if (group == 0)
        return gr;
    if (!js)
        return -1;
    for (size_t g = 0; g < js->n_groups; g++)
        if (js->groups[g]->group == group)
            return gr >= 0 && (size_t)gr < js->groups[g]->n_ranks ? js->groups[g]->ranks[gr] : -1;
    return -1;
}

static const Paramsync__V1__RankStatus *rank_status(const job_t *js, int rank)
{
    for (size_t k = 0; js && k < js->n_ranks; k++)
        if (js->ranks[k]->rank == rank)
            return js->ranks[k];
    return NULL;
}

/* "rank 2" or "ranks 1, 2 and 5", with job ranks for subgroups. */
static void print_ranks(FILE *f, const job_t *js, uint32_t group, const int32_t *r, size_t n)
{
    fputs(n == 1 ? "rank " : "ranks ", f);
    for (size_t i = 0; i < n; i++) {
        if (i)
            fputs(i + 1 == n ? " and " : ", ", f);
        fprintf(f, "%d", r[i]);
        int jr = job_rank(js, group, r[i]);
        if (group != 0 && jr >= 0)
            fprintf(f, " (job rank %d)", jr);
    }
}

static void print_inflight(FILE *f, const inflight_ref_t *ref, const job_t *js, int with_job)
{
    const inflight_t *c = ref->c;
    char b1[32], b2[32], d[32];
    fputs("    ", f);
    if (with_job) {
        fputs("job ", f);
        ps__cli_text(f, c->job);
        fputc(' ', f);
    }
    fprintf(f, "group %u seq %llu %s %s[%llu]: ", c->group, (unsigned long long)c->seq,
            kind_name(b1, sizeof(b1), c->kind), dtype_name(b2, sizeof(b2), c->dtype),
            (unsigned long long)c->count);
    ps__cli_text(f, c->state);
    fprintf(f, ", %zu of %d ranks in", c->n_arrived, c->group_size);
    if (c->n_waiting_for) {
        fprintf(f, ", waiting %s for ", ps__cli_duration(d, sizeof(d), c->waiting_seconds));
        print_ranks(f, js, c->group, c->waiting_for, c->n_waiting_for);
    } else {
        fprintf(f, ", for %s", ps__cli_duration(d, sizeof(d), c->waiting_seconds));
    }
    if (c->message && *c->message) {
        fputs(": ", f);
        ps__cli_text(f, c->message);
    }
    fputs(" [hub ", f);
    ps__cli_text(f, ref->agent);
    fputs("]\n", f);
}

/* A column of the ranks table: s ("-" when empty), cut to max characters,
 * then spaces up to width and one more. */
static void text_cell(FILE *f, const char *s, size_t max, size_t width)
{
    char cell[64];
    snprintf(cell, max + 1 < sizeof(cell) ? max + 1 : sizeof(cell), "%s", s && *s ? s : "-");
    ps__cli_text(f, cell);
    for (size_t pad = strlen(cell); pad < width; pad++)
        fputc(' ', f);
    fputc(' ', f);
}

static void print_job(FILE *f, const job_t *js, const view_t *v)
{
    fputs("\njob ", f);
    ps__cli_text(f, js->job);
    fputs(": ", f);
    ps__cli_text(f, js->state);
    fprintf(f, ", world size %d, incarnation %llu", js->world_size,
            (unsigned long long)js->incarnation);
    if (js->hub && *js->hub) {
        fputs(", hub ", f);
        ps__cli_text(f, js->hub);
    }
    if (js->message && *js->message) {
        fputs("\n  ", f);
        ps__cli_text(f, js->message);
    }
    fputs("\n  RANK  STATE     AGENT                  MACHINE   PEER\n", f);
    for (size_t k = 0; k < js->n_ranks; k++) {
        const Paramsync__V1__RankStatus *rs = js->ranks[k];
        fprintf(f, "  %-5d ", rs->rank);
        char state[16];
        snprintf(state, sizeof(state), "%s", rs->state ? rs->state : "");
        fprintf(f, "%-9s ", state);
        text_cell(f, rs->agent, 63, 22);
        /* The start of its id, as git shows commits: enough to tell machines apart. */
        text_cell(f, rs->machine, 9, 9);
        ps__cli_text(f, rs->peer && *rs->peer ? rs->peer : "-");
        fputc('\n', f);
    }
    fputs("  groups: 0 (every rank)", f);
    for (size_t g = 0; g < js->n_groups; g++) {
        if (js->groups[g]->group == 0)
            continue;
        fprintf(f, ", %u [", js->groups[g]->group);
        for (size_t i = 0; i < js->groups[g]->n_ranks; i++)
            fprintf(f, "%s%d", i ? " " : "", js->groups[g]->ranks[i]);
        fputc(']', f);
    }
    fputc('\n', f);
    int any = 0;
    for (size_t i = 0; i < v->ninflight; i++) {
        if (strcmp(v->inflight[i].c->job ? v->inflight[i].c->job : "", js->job ? js->job : ""))
            continue;
        if (!any++)
            fputs("  in flight:\n", f);
        print_inflight(f, &v->inflight[i], js, 0);
    }
    if (!any)
        fputs("  in flight: none\n", f);
}

static void print_text(FILE *f, const view_t *v)
{
    const status_t *r = v->src[0].resp;
    char d[32];
    fputs("paramsyncd ", f);
    ps__cli_text(f, r->version);
    fputs(" (", f);
    ps__cli_text(f, r->role);
    fputs(") at ", f);
    ps__cli_text(f, r->address && *r->address ? r->address : v->src[0].addr);
    fprintf(f, ", up %s\n", ps__cli_duration(d, sizeof(d), r->uptime_seconds));
    text_list(f, "agents", r->agents, r->n_agents);
    text_list(f, "agents stopping", r->stopping_agents, r->n_stopping_agents);
    int is_coordinator = strcmp(r->role ? r->role : "", "agent") != 0;
    if (is_coordinator && r->n_jobs == 0)
        fputs("\nno jobs\n", f);
    for (size_t j = 0; j < r->n_jobs; j++)
        print_job(f, r->jobs[j], v);

    /* Collectives of jobs not listed above: asked an agent, or an agent's view is newer. */
    int any = 0;
    for (size_t i = 0; i < v->ninflight; i++) {
        if (find_job(r, v->inflight[i].c->job))
            continue;
        if (!any++)
            fputs(is_coordinator ? "\nin flight for jobs not listed above:\n"
                                 : "\nin flight on this agent:\n",
                  f);
        print_inflight(f, &v->inflight[i], NULL, 1);
    }
    if (!is_coordinator && !any)
        fputs("\nin flight on this agent: none\n", f);

    /* The one line to read first when a job hangs. */
    const inflight_ref_t *worst = NULL;
    for (size_t i = 0; i < v->ninflight; i++)
        if (v->inflight[i].c->n_waiting_for &&
            (!worst || v->inflight[i].c->waiting_seconds > worst->c->waiting_seconds))
            worst = &v->inflight[i];
    if (worst) {
        const inflight_t *c = worst->c;
        const job_t *js = find_job(r, c->job);
        char b1[32];
        fputs("\nlongest wait: job ", f);
        ps__cli_text(f, c->job);
        fprintf(f, " %s (group %u seq %llu) has waited %s for ", kind_name(b1, sizeof(b1), c->kind),
                c->group, (unsigned long long)c->seq,
                ps__cli_duration(d, sizeof(d), c->waiting_seconds));
        print_ranks(f, js, c->group, c->waiting_for, c->n_waiting_for);
        int jr = job_rank(js, c->group, c->waiting_for[0]);
        const Paramsync__V1__RankStatus *rs = rank_status(js, jr);
        if (rs) {
            fprintf(f, "; rank %d is ", jr);
            ps__cli_text(f, rs->state);
            if (rs->peer && *rs->peer) {
                fputs(" at ", f);
                ps__cli_text(f, rs->peer);
            }
            if (rs->agent && *rs->agent) {
                fputs(" via ", f);
                ps__cli_text(f, rs->agent);
            }
        }
        fputc('\n', f);
    }
}

/* ---------------------------------------------------------------- command */

int ps__cli_status(int argc, char **argv)
{
    const char *addr = getenv("PARAMSYNC_ADDR");
    if (!addr || !*addr)
        addr = PS_CLI_DEFAULT_ADDR;
    const char *job = NULL;
    int json = 0;
    double timeout_s = 5;
    /* The same variables as the C client's, so one environment serves both. */
    ps__rpc_options_t ropts;
    memset(&ropts, 0, sizeof(ropts));
    ropts.tls_ca = getenv("PARAMSYNC_TLS_CA");
    ropts.tls_cert = getenv("PARAMSYNC_TLS_CERT");
    ropts.tls_key = getenv("PARAMSYNC_TLS_KEY");
    ropts.tls_server_name = getenv("PARAMSYNC_TLS_SERVER_NAME");
    enum { O_ADDR = 1000, O_JOB, O_JSON, O_TIMEOUT, O_CA, O_CERT, O_KEY, O_NAME };
    static const struct option opts[] = {
        {"addr", required_argument, 0, O_ADDR},
        {"job", required_argument, 0, O_JOB},
        {"json", no_argument, 0, O_JSON},
        {"timeout", required_argument, 0, O_TIMEOUT},
        {"tls-ca", required_argument, 0, O_CA},
        {"tls-cert", required_argument, 0, O_CERT},
        {"tls-key", required_argument, 0, O_KEY},
        {"tls-server-name", required_argument, 0, O_NAME},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    optind = 1;
    int o;
    while ((o = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (o) {
        case O_ADDR:
            addr = optarg;
            break;
        case O_JOB:
            job = optarg;
            break;
        case O_JSON:
            json = 1;
            break;
        case O_TIMEOUT: {
            char *end;
            timeout_s = strtod(optarg, &end);
            if (*end || end == optarg || !(timeout_s > 0 && timeout_s <= 3600)) {
                fprintf(stderr, "paramsync status: --timeout wants seconds (0 to 3600), not '%s'\n",
                        optarg);
                return PS_CLI_USAGE;
            }
            break;
        }
        case O_CA:
            ropts.tls_ca = optarg;
            break;
        case O_CERT:
            ropts.tls_cert = optarg;
            break;
        case O_KEY:
            ropts.tls_key = optarg;
            break;
        case O_NAME:
            ropts.tls_server_name = optarg;
            break;
        case 'h':
            usage(stdout);
            return PS_CLI_OK;
        default:
            fprintf(stderr, "Run 'paramsync status --help' for the options.\n");
            return PS_CLI_USAGE;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "paramsync status: unexpected argument '%s' (see --help)\n", argv[optind]);
        return PS_CLI_USAGE;
    }
    /* An empty variable counts as unset. */
    const char **tls[] = {&ropts.tls_ca, &ropts.tls_cert, &ropts.tls_key, &ropts.tls_server_name};
    for (size_t i = 0; i < sizeof(tls) / sizeof(tls[0]); i++)
        if (*tls[i] && !**tls[i])
            *tls[i] = NULL;
    if ((ropts.tls_cert != NULL) != (ropts.tls_key != NULL)) {
        fprintf(stderr, "paramsync status: --tls-cert and --tls-key go together\n");
        return PS_CLI_USAGE;
    }

    view_t v;
    memset(&v, 0, sizeof(v));
    ps__rpc_acquire();
    int rc = gather(&v, addr, job, (int)(timeout_s * 1000), &ropts);
    int status = PS_CLI_OK;
    if (rc < 0) {
        const char *err = v.nsrc ? v.src[0].error : NULL;
        if (err)
            fprintf(stderr, "paramsync status: %s\n", err);
        else
            fprintf(stderr, "paramsync status: %s\n", ps_strerror(rc));
        status = PS_CLI_FAILED;
    } else {
        for (size_t k = 1; k < v.nsrc; k++)
            if (v.src[k].error)
                fprintf(stderr, "paramsync status: warning: agent %s: %s\n", v.src[k].addr,
                        v.src[k].error);
        if (json)
            print_json(stdout, &v);
        else
            print_text(stdout, &v);
        if (fflush(stdout) != 0) {
            perror("paramsync status: stdout");
            status = PS_CLI_FAILED;
        }
    }
    view_free(&v);
    /* Exit only once gRPC is down: a channel to an agent that did not answer
     * may still be retrying, and its TLS handshake would run beside OpenSSL's
     * atexit clean-up (rpc.h). */
    if (ps__rpc_release() == 0)
        ps__rpc_wait_shutdown(PS_CLI_EXIT_WAIT_MS);
    return status;
}
