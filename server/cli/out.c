/* Output helpers of `paramsync`: JSON and terminal-safe text, durations, a reachability probe. */
#include "cli.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netdb.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

/* Length of the valid UTF-8 sequence at s (1 to 4), or 0 if it is not one. */
static int utf8_len(const unsigned char *s)
{
    unsigned char c = s[0];
    if (c < 0x80)
        return 1;
    int n;
    unsigned char lo = 0x80, hi = 0xBF; /* allowed range of the second byte */
    if (c >= 0xC2 && c <= 0xDF)
        n = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
        n = 3;
        if (c == 0xE0)
            lo = 0xA0; /* no overlong forms */
        if (c == 0xED)
            hi = 0x9F; /* no surrogates */
    } else if (c >= 0xF0 && c <= 0xF4) {
        n = 4;
        if (c == 0xF0)
            lo = 0x90;
        if (c == 0xF4)
            hi = 0x8F; /* nothing above U+10FFFF */
    } else
        return 0;
    if (s[1] < lo || s[1] > hi)
        return 0;
    for (int i = 2; i < n; i++)
        if (s[i] < 0x80 || s[i] > 0xBF)
            return 0;
    return n;
}

void ps__cli_json_string(FILE *f, const char *str)
{
    const unsigned char *s = (const unsigned char *)(str ? str : "");
    fputc('"', f);
    while (*s) {
        unsigned char c = *s;
        if (c == '"' || c == '\\') {
            fputc('\\', f);
            fputc(c, f);
            s++;
        } else if (c < 0x20) {
            switch (c) {
            case '\n':
                fputs("\\n", f);
                break;
            case '\t':
                fputs("\\t", f);
                break;
            case '\r':
                fputs("\\r", f);
                break;
            default:
                fprintf(f, "\\u%04x", c);
            }
            s++;
        } else {
            int n = utf8_len(s);
            if (n == 0) {
                fputs("\\ufffd", f);
                s++;
            } else {
                fwrite(s, 1, (size_t)n, f);
                s += n;
            }
        }
    }
    fputc('"', f);
}

void ps__cli_json_number(FILE *f, double v)
{
    if (!isfinite(v))
        v = 0;
    fprintf(f, "%.6f", v);
}

void ps__cli_text(FILE *f, const char *str)
{
    const unsigned char *s = (const unsigned char *)(str ? str : "");
    while (*s) {
        /* C0 controls, DEL, and C1 controls (U+0080..U+009F, encoded C2 80..C2 9F). */
        if (*s < 0x20 || *s == 0x7F) {
            fputc('?', f);
            s++;
        } else if (s[0] == 0xC2 && s[1] >= 0x80 && s[1] <= 0x9F) {
            fputc('?', f);
            s += 2;
        } else {
            fputc(*s++, f);
        }
    }
}

const char *ps__cli_duration(char *buf, size_t len, double seconds)
{
    if (!isfinite(seconds) || seconds < 0)
        seconds = 0;
    if (seconds < 1)
        snprintf(buf, len, "%.0f ms", seconds * 1e3);
    else if (seconds < 60)
        snprintf(buf, len, "%.1f s", seconds);
    else if (seconds < 3600)
        snprintf(buf, len, "%dm%02ds", (int)(seconds / 60), (int)seconds % 60);
    else
        snprintf(buf, len, "%dh%02dm", (int)(seconds / 3600), (int)(seconds / 60) % 60);
    return buf;
}

/* Connects fd to addr within timeout_ms. 0 or -errno. */
static int connect_within(int fd, const struct sockaddr *addr, socklen_t len, int timeout_ms)
{
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0)
        return -errno;
    if (connect(fd, addr, len) == 0)
        return 0;
    if (errno != EINPROGRESS)
        return -errno;
    struct pollfd p = {fd, POLLOUT, 0};
    int n = poll(&p, 1, timeout_ms);
    if (n == 0)
        return -ETIMEDOUT;
    if (n < 0)
        return -errno;
    int err = 0;
    socklen_t el = sizeof(err);
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) < 0)
        return -errno;
    return -err;
}

int ps__cli_probe(const char *addr, int timeout_ms, const char **why)
{
    if (strncmp(addr, "unix:", 5) == 0) {
        const char *path = addr + 5;
        if (strncmp(path, "//", 2) == 0)
            path += 2;
        struct sockaddr_un un;
        memset(&un, 0, sizeof(un));
        un.sun_family = AF_UNIX;
        if (strlen(path) >= sizeof(un.sun_path)) {
            *why = "the socket path is too long";
            return -1;
        }
        strcpy(un.sun_path, path);
        int fd = socket(AF_UNIX, SOCK_STREAM, 0);
        if (fd < 0) {
            *why = strerror(errno);
            return -1;
        }
        int rc = connect_within(fd, (struct sockaddr *)&un, sizeof(un), timeout_ms);
        close(fd);
        if (rc < 0) {
            *why = strerror(-rc);
            return -1;
        }
        return 0;
    }
    if (strstr(addr, "://") || strncmp(addr, "dns:", 4) == 0 || strncmp(addr, "ipv4:", 5) == 0 ||
        strncmp(addr, "ipv6:", 5) == 0)
        return 0; /* gRPC's own target syntax: let gRPC resolve it */
    const char *colon = strrchr(addr, ':');
    if (!colon || colon == addr || !colon[1]) {
        *why = "not HOST:PORT";
        return -1;
    }
    char host[256];
    size_t hl = (size_t)(colon - addr);
    const char *h = addr;
    if (hl >= 2 && h[0] == '[' && h[hl - 1] == ']') {
        h++;
        hl -= 2;
    }
    if (hl >= sizeof(host)) {
        *why = "the host name is too long";
        return -1;
    }
    memcpy(host, h, hl);
    host[hl] = 0;
    struct addrinfo hints, *ai = NULL;
    memset(&hints, 0, sizeof(hints));
    hints.ai_socktype = SOCK_STREAM;
    int g = getaddrinfo(host, colon + 1, &hints, &ai);
    if (g != 0) {
        *why = g == EAI_SYSTEM ? strerror(errno) : gai_strerror(g);
        return -1;
    }
    int rc = -ECONNREFUSED;
    for (struct addrinfo *a = ai; a; a = a->ai_next) {
        int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (fd < 0) {
            rc = -errno;
            continue;
        }
        rc = connect_within(fd, a->ai_addr, a->ai_addrlen, timeout_ms);
        close(fd);
        if (rc == 0)
            break;
    }
    freeaddrinfo(ai);
    if (rc < 0) {
        *why = strerror(-rc);
        return -1;
    }
    return 0;
}
