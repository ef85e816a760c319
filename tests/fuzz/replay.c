/* Regression runner: replays corpus and crash files through a fuzz target, with any compiler. */
#include <dirent.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
/* Optional in a target, as with libFuzzer. */
int LLVMFuzzerInitialize(int *argc, char ***argv) __attribute__((weak));

/* Inputs larger than this are not fuzzer inputs: refuse them rather than
 * replaying something nobody meant. */
#define REPLAY_MAX_INPUT (16u << 20)

/* Runs one file through the target. 0, or -1 when it cannot be read. A
 * crash or a violated invariant aborts the process, which fails the test. */
static int replay_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "replay: cannot open %s: %s\n", path, strerror(errno));
        return -1;
    }
    uint8_t *buf = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len == cap) {
            size_t ncap = cap ? cap * 2 : 4096;
            uint8_t *nb = ncap <= REPLAY_MAX_INPUT ? realloc(buf, ncap) : NULL;
            if (!nb) {
                fprintf(stderr, "replay: %s is too large or memory ran out\n", path);
                free(buf);
                fclose(f);
                return -1;
            }
            buf = nb;
            cap = ncap;
        }
        size_t n = fread(buf + len, 1, cap - len, f);
        len += n;
        if (n == 0)
            break;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        fprintf(stderr, "replay: cannot read %s\n", path);
        free(buf);
        return -1;
    }
    /* An exact-size copy, so that reads past the end are caught under ASan. */
    uint8_t *exact = malloc(len ? len : 1);
    if (!exact) {
        free(buf);
        return -1;
    }
    memcpy(exact, buf, len);
    free(buf);
    LLVMFuzzerTestOneInput(exact, len);
    free(exact);
    return 0;
}

static int cmp_names(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Replays every regular file of dir (not recursing), in name order; adds to
 * *count. A missing directory is empty. 0, or -1 on an unreadable entry. */
static int replay_dir(const char *dir, size_t *count)
{
    DIR *d = opendir(dir);
    if (!d)
        return errno == ENOENT ? 0 : -1;
    char **names = NULL;
    size_t n = 0, cap = 0;
    int rc = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        if (n == cap) {
            size_t ncap = cap ? cap * 2 : 64;
            char **nn = realloc(names, ncap * sizeof(*nn));
            if (!nn) {
                rc = -1;
                break;
            }
            names = nn;
            cap = ncap;
        }
        size_t plen = strlen(dir) + strlen(e->d_name) + 2;
        if (!(names[n] = malloc(plen))) {
            rc = -1;
            break;
        }
        snprintf(names[n], plen, "%s/%s", dir, e->d_name);
        n++;
    }
    closedir(d);
    if (rc == 0)
        qsort(names, n, sizeof(*names), cmp_names);
    for (size_t i = 0; i < n; i++) {
        struct stat st;
        if (rc == 0 && stat(names[i], &st) == 0 && S_ISREG(st.st_mode)) {
            if (replay_file(names[i]) < 0)
                rc = -1;
            else
                (*count)++;
        }
        free(names[i]);
    }
    free(names);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr,
                "usage: %s DIR_OR_FILE...\n"
                "Replays each file (and each file of each directory) through the fuzz "
                "target; fails on a crash, an invariant violated, or no input at all.\n",
                argv[0]);
        return 2;
    }
    if (LLVMFuzzerInitialize)
        LLVMFuzzerInitialize(&argc, &argv);
    size_t count = 0;
    for (int i = 1; i < argc; i++) {
        struct stat st;
        int rc;
        if (stat(argv[i], &st) == 0 && S_ISREG(st.st_mode)) {
            rc = replay_file(argv[i]);
            count += rc == 0;
        } else {
            rc = replay_dir(argv[i], &count);
        }
        if (rc < 0) {
            fprintf(stderr, "replay: cannot read %s\n", argv[i]);
            return 1;
        }
    }
    if (count == 0) {
        fprintf(stderr, "replay: no inputs found: the corpus is missing\n");
        return 1;
    }
    printf("replay: %zu inputs passed\n", count);
    return 0;
}
