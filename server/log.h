/* Daemon logging: one line per meaningful event, to stderr. */
#ifndef PS_LOG_H
#define PS_LOG_H

enum { PS_LOG_ERROR = 0, PS_LOG_WARN = 1, PS_LOG_INFO = 2, PS_LOG_DEBUG = 3 };

extern int ps__log_level;

/** Parses "error", "warn", "info", "debug"; -1 when unknown. */
int ps__log_parse_level(const char *s);

void ps__log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define PS_LOG(level, ...)                                                                         \
    do {                                                                                           \
        if ((level) <= ps__log_level)                                                              \
            ps__log((level), __VA_ARGS__);                                                         \
    } while (0)

#endif
