/* The `paramsync` command: internals shared by its files (commands, output helpers). */
#ifndef PS_CLI_H
#define PS_CLI_H

#include <stdint.h>
#include <stdio.h>

/* Exit codes of every command. */
enum { PS_CLI_OK = 0, PS_CLI_FAILED = 1, PS_CLI_USAGE = 2 };

#define PS_CLI_DEFAULT_ADDR "127.0.0.1:29500"
/* At most this long at exit waiting for gRPC to shut down (status.c). */
#define PS_CLI_EXIT_WAIT_MS 2000

/** `paramsync status ...` (argv[0] is "status"). Returns an exit code. */
int ps__cli_status(int argc, char **argv);

/* ---- output (out.c) ---- */

/** Writes s as a JSON string (quotes included): control characters and
 * invalid UTF-8 are escaped (the latter as U+FFFD), so any bytes give valid
 * JSON. NULL is written as "". */
void ps__cli_json_string(FILE *f, const char *s);

/** Writes a finite double as a JSON number (NaN and infinities as 0). */
void ps__cli_json_number(FILE *f, double v);

/** Writes s for a terminal: control characters become '?', so names from
 * the network cannot move the cursor or change colours. NULL is "". */
void ps__cli_text(FILE *f, const char *s);

/** Formats seconds for people ("850 ms", "3.2 s", "2m05s", "1h02m") into buf. */
const char *ps__cli_duration(char *buf, size_t len, double seconds);

/** Checks that a TCP (HOST:PORT, [V6]:PORT) or unix:PATH address accepts
 * connections within timeout_ms, so an absent daemon is reported at once
 * rather than after the call deadline. 0; or -1 with why (a static string
 * or errno text) in *why. Other target forms (dns:///...) return 0 unchecked. */
int ps__cli_probe(const char *addr, int timeout_ms, const char **why);

#endif
