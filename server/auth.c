/* Per-job tokens: the table from --tokens-file and the check on each call. */
#include "auth.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/status.h>

#include <paramsync/common.h>

#include "log.h"
#include "metrics.h"

struct ps__tokens {
    char *job; /* "*" matches any job without its own line */
    char *token;
    struct ps__tokens *next;
};

int ps__tokens_load(const char *path, ps__tokens_t **out)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        PS_LOG(PS_LOG_ERROR, "cannot read --tokens-file %s", path);
        return PS_EINVAL;
    }
    ps__tokens_t *list = NULL;
    char line[1024];
    int n = 0, rc = 0;
    while (fgets(line, sizeof(line), f)) {
        char *hash = strchr(line, '#');
        if (hash)
            *hash = 0;
        char job[512], token[512];
        if (sscanf(line, "%511s %511s", job, token) != 2)
            continue;
        ps__tokens_t *t = calloc(1, sizeof(*t));
        if (!t || !(t->job = strdup(job)) || !(t->token = strdup(token))) {
            if (t)
                free(t->job);
            free(t);
            rc = PS_ENOMEM;
            break;
        }
        t->next = list;
        list = t;
        n++;
    }
    fclose(f);
    if (rc == 0 && n == 0) {
        PS_LOG(PS_LOG_ERROR, "--tokens-file %s holds no 'JOB TOKEN' line", path);
        rc = PS_EINVAL;
    }
    if (rc < 0) {
        ps__tokens_free(list);
        return rc;
    }
    PS_LOG(PS_LOG_INFO, "per-job tokens on: %d entries from %s", n, path);
    *out = list;
    return 0;
}

void ps__tokens_free(ps__tokens_t *t)
{
    while (t) {
        ps__tokens_t *next = t->next;
        free(t->job);
        free(t->token);
        free(t);
        t = next;
    }
}

const char *ps__tokens_for(const ps__tokens_t *t, const char *job)
{
    const char *want = NULL;
    for (; t; t = t->next) {
        if (strcmp(t->job, job) == 0)
            return t->token;
        if (!want && strcmp(t->job, "*") == 0)
            want = t->token;
    }
    return want;
}

/* Compares without an early exit, so timing tells nothing of the token. */
static int token_equal(const char *a, const char *b)
{
    size_t la = strlen(a), lb = strlen(b);
    unsigned char d = (unsigned char)(la != lb);
    for (size_t i = 0; i < la; i++)
        d |= (unsigned char)(a[i] ^ b[i % (lb ? lb : 1)]);
    return d == 0;
}

int ps__auth_check(const ps__tokens_t *tokens, ps__rpc_call_t *call, const char *job)
{
    if (!tokens)
        return 0;
    const char *want = ps__tokens_for(tokens, job);
    char have[600];
    if (want && ps__rpc_call_metadata(call, "authorization", have, sizeof(have)) == 0 &&
        strncmp(have, "Bearer ", 7) == 0 && token_equal(have + 7, want))
        return 0;
    ps__metrics_event(PS_M_EV_AUTH_FAILURE);
    PS_LOG(PS_LOG_WARN, "job %s: refused a %s call from %s: missing or wrong token", job,
           ps__rpc_call_method(call), ps__rpc_call_peer(call));
    char msg[600];
    snprintf(msg, sizeof(msg),
             "job %s: missing or wrong token; send the job's token as 'authorization: Bearer "
             "TOKEN' (PARAMSYNC_TOKEN)",
             job);
    ps__rpc_call_send_status(call, GRPC_STATUS_UNAUTHENTICATED, msg);
    return -1;
}
