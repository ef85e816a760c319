/* Init methods (torch's init_method URLs): where the agent is and what the URL says about the job.
 */
#include "internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* How often file:// looks for the announce file. */
#define PS__FILE_POLL_MS 50

int ps__env_int(const char *name, int64_t min, int64_t max, int64_t *out)
{
    const char *s = getenv(name);
    if (!s || !*s)
        return 1;
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || *end || v < min || v > max)
        return PS_EINVAL;
    *out = v;
    return 0;
}

static int parse_int(const char *s, int min, int *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < min || v > INT32_MAX)
        return PS_EINVAL;
    *out = (int)v;
    return 0;
}

/* Applies "job=NAME&world_size=N&rank=R" (query is modified). */
static int parse_query(char *query, ps__endpoint_t *ep, char **errmsg)
{
    char *save = NULL;
    for (char *kv = strtok_r(query, "&", &save); kv; kv = strtok_r(NULL, "&", &save)) {
        char *eq = strchr(kv, '=');
        if (!eq) {
            *errmsg = ps__strdupf("init method parameter '%s' has no value", kv);
            return PS_EINVAL;
        }
        *eq = 0;
        const char *val = eq + 1;
        if (strcmp(kv, "job") == 0 && *val) {
            free(ep->job);
            if (!(ep->job = strdup(val)))
                return PS_ENOMEM;
        } else if (strcmp(kv, "world_size") == 0) {
            if (parse_int(val, 1, &ep->world_size) < 0) {
                *errmsg = ps__strdupf("world_size=%s is not a positive integer", val);
                return PS_EINVAL;
            }
        } else if (strcmp(kv, "rank") == 0) {
            if (parse_int(val, 0, &ep->rank) < 0) {
                *errmsg = ps__strdupf("rank=%s is not a non-negative integer", val);
                return PS_EINVAL;
            }
        } else {
            *errmsg = ps__strdupf("unknown init method parameter '%s' (job, world_size, rank)", kv);
            return PS_EINVAL;
        }
    }
    return 0;
}

static int env_target(ps__endpoint_t *ep, char **errmsg)
{
    const char *addr = getenv("PARAMSYNC_ADDR");
    if (addr && *addr) {
        ep->target = strdup(addr);
        return ep->target ? 0 : PS_ENOMEM;
    }
    const char *host = getenv("MASTER_ADDR");
    const char *port = getenv("MASTER_PORT");
    if (!host || !*host || !port || !*port) {
        *errmsg = strdup("env:// needs PARAMSYNC_ADDR, or MASTER_ADDR and MASTER_PORT");
        return PS_EINVAL;
    }
    /* A bare IPv6 address needs brackets to be told from the port. */
    int v6 = strchr(host, ':') && host[0] != '[';
    ep->target = ps__strdupf(v6 ? "[%s]:%s" : "%s:%s", host, port);
    return ep->target ? 0 : PS_ENOMEM;
}

int ps__endpoint_parse(const char *init_method, ps__endpoint_t *ep, char **errmsg)
{
    char *url = NULL;
    int rc;
    memset(ep, 0, sizeof(*ep));
    ep->world_size = -1;
    ep->rank = -1;
    if (!init_method || !*init_method)
        init_method = "env://";

    if (strncmp(init_method, "file://", 7) == 0) {
        /* The path is taken whole: file names may hold '?' and '&'. */
        const char *path = init_method + 7;
        if (*path != '/') {
            *errmsg = ps__strdupf("file:// needs an absolute path: '%s'", init_method);
            return PS_EINVAL;
        }
        ep->file = strdup(path);
        ep->job = strdup(path);
        rc = ep->file && ep->job ? 0 : PS_ENOMEM;
        goto done;
    }

    url = strdup(init_method);
    if (!url) {
        rc = PS_ENOMEM;
        goto done;
    }
    char *query = strchr(url, '?');
    if (query) {
        *query++ = 0;
        rc = parse_query(query, ep, errmsg);
        if (rc < 0)
            goto done;
    }
    if (strcmp(url, "env://") == 0) {
        rc = env_target(ep, errmsg);
    } else if (strncmp(url, "tcp://", 6) == 0 && url[6]) {
        ep->target = strdup(url + 6);
        rc = ep->target ? 0 : PS_ENOMEM;
    } else if (strncmp(url, "unix:", 5) == 0 && url[5]) {
        ep->target = strdup(url);
        rc = ep->target ? 0 : PS_ENOMEM;
    } else {
        *errmsg = ps__strdupf("unknown init method '%s' (env://, tcp://HOST:PORT, unix:PATH, "
                              "file:///PATH)",
                              init_method);
        rc = PS_EINVAL;
    }

done:
    free(url);
    if (rc < 0)
        ps__endpoint_clear(ep);
    return rc;
}

/* Reads the whole file into a string with surrounding space trimmed; NULL
 * when it does not exist yet or holds nothing but space. */
static char *read_address(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return NULL;
    char buf[4096];
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = 0;
    char *s = buf;
    while (*s == ' ' || *s == '\t' || *s == '\n' || *s == '\r')
        s++;
    char *e = s + strlen(s);
    while (e > s && (e[-1] == ' ' || e[-1] == '\t' || e[-1] == '\n' || e[-1] == '\r'))
        *--e = 0;
    if (!*s)
        return NULL;
    if (strncmp(s, "tcp://", 6) == 0)
        s += 6;
    return strdup(s);
}

int ps__endpoint_wait_file(ps__endpoint_t *ep, int64_t timeout_ms, char **errmsg)
{
    int64_t deadline = ps__now_ms() + timeout_ms;
    for (;;) {
        char *addr = read_address(ep->file);
        /* A writer that does not rename into place may be caught mid-write:
         * take the address only when two reads agree. */
        if (addr) {
            struct timespec ts = {0, PS__FILE_POLL_MS * 1000000L};
            nanosleep(&ts, NULL);
            char *again = read_address(ep->file);
            if (again && strcmp(addr, again) == 0) {
                free(again);
                ep->target = addr;
                return 0;
            }
            free(again);
            free(addr);
        }
        if (ps__now_ms() >= deadline) {
            *errmsg = ps__strdupf("no agent address in %s after %lld ms (start paramsyncd with "
                                  "--announce-file %s)",
                                  ep->file, (long long)timeout_ms, ep->file);
            return PS_ETIMEDOUT;
        }
        struct timespec ts = {0, PS__FILE_POLL_MS * 1000000L};
        nanosleep(&ts, NULL);
    }
}

void ps__endpoint_clear(ps__endpoint_t *ep)
{
    if (!ep)
        return;
    free(ep->target);
    free(ep->file);
    free(ep->job);
    memset(ep, 0, sizeof(*ep));
    ep->world_size = -1;
    ep->rank = -1;
}
