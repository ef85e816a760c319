/* paramsync: the operator's command for a running paramsyncd (status today). */
#include <stdio.h>
#include <string.h>

#include "cli.h"

#ifndef PS_VERSION
#define PS_VERSION "0.0.0"
#endif

static void usage(FILE *out)
{
    fprintf(out, "Usage: paramsync COMMAND [OPTIONS]\n"
                 "\n"
                 "Looks into a running paramsyncd.\n"
                 "\n"
                 "Commands:\n"
                 "  status     jobs, ranks and where they are, and the collectives in flight\n"
                 "             with the ranks each one is still waiting for\n"
                 "\n"
                 "  -h, --help     print this help and exit\n"
                 "  --version      print the version and exit\n"
                 "\n"
                 "Run 'paramsync COMMAND --help' for a command's options.\n");
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return PS_CLI_USAGE;
    }
    const char *cmd = argv[1];
    if (strcmp(cmd, "-h") == 0 || strcmp(cmd, "--help") == 0 || strcmp(cmd, "help") == 0) {
        usage(stdout);
        return PS_CLI_OK;
    }
    if (strcmp(cmd, "--version") == 0) {
        printf("paramsync %s\n", PS_VERSION);
        return PS_CLI_OK;
    }
    if (strcmp(cmd, "status") == 0)
        return ps__cli_status(argc - 1, argv + 1);
    fprintf(stderr, "paramsync: unknown command '%s' (see 'paramsync --help')\n", cmd);
    return PS_CLI_USAGE;
}
