/* Fuzz target: the C client's init method URLs (ps__endpoint_parse in client/init_method.c). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_input.h"
#include "internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    /* env:// takes the address from here; fixed, so every run is the same.
     * A bare IPv6 host exercises the bracketing. */
    unsetenv("PARAMSYNC_ADDR");
    setenv("MASTER_ADDR", "::1", 1);
    setenv("MASTER_PORT", "29500", 1);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* The URL is a C string: it ends at the first NUL, as it would in a real
     * caller. An exact-size heap copy lets ASan see reads past its end. */
    char *url = malloc(size + 1);
    FUZZ_CHECK(url != NULL);
    memcpy(url, data, size);
    url[size] = 0;

    ps__endpoint_t ep;
    char *errmsg = NULL;
    memset(&ep, 0x5a, sizeof(ep)); /* parse must set every field itself */
    int rc = ps__endpoint_parse(url, &ep, &errmsg);
    FUZZ_CHECK(rc == 0 || rc == PS_EINVAL);
    if (rc == 0) {
        FUZZ_CHECK(errmsg == NULL);
        /* It says where the agent is, now or once the file names it. */
        FUZZ_CHECK((ep.target != NULL) != (ep.file != NULL));
        if (ep.file) {
            FUZZ_CHECK(ep.file[0] == '/');
            FUZZ_CHECK(ep.job != NULL && strcmp(ep.job, ep.file) == 0);
            FUZZ_CHECK(strcmp(ep.file, url + strlen("file://")) == 0);
        } else {
            FUZZ_CHECK(ep.target[0] != 0);
        }
        FUZZ_CHECK(ep.world_size == -1 || ep.world_size >= 1);
        FUZZ_CHECK(ep.rank >= -1);
        FUZZ_CHECK(ep.job == NULL || ep.job[0] != 0);
        FUZZ_CHECK(strlen(url) == 0 || strchr(url, ':') != NULL);
    } else {
        /* Every refusal says why, and leaves nothing to free. */
        FUZZ_CHECK(errmsg != NULL && errmsg[0] != 0);
        FUZZ_CHECK(ep.target == NULL && ep.file == NULL && ep.job == NULL);
    }
    free(errmsg);
    ps__endpoint_clear(&ep);
    FUZZ_CHECK(ep.target == NULL && ep.file == NULL && ep.job == NULL);
    free(url);
    return 0;
}
