// replay.c: the plain driver of a fuzz target (fuzz.h): runs every file of the committed
// corpus through LLVMFuzzerTestOneInput, as `make check` does. With arguments, those files
// (or directories) instead. A file named ok-* must be accepted and bad-* refused; any other
// (what `make fuzz` found) only has to pass without a crash or a sanitizer report. Built with
// LB_LIBFUZZER (tests/fuzz/libfuzzer.sh) it only defines lb_fuzz_accepted.
#include <dirent.h>
#include <sys/stat.h>
#include "tests/fuzz/fuzz.h"

int lb_fuzz_accepted;
// A target may write its seed corpus (replay --seed DIR); weak: most have none.
int lb_fuzz_seed(const char *dir) __attribute__((weak));

#ifndef LB_LIBFUZZER   // under libFuzzer (make fuzz) its main drives the target
static int replay_file(const char *path, int *n)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        perror(path);
        return 1;
    }
    uint8_t *buf = NULL;
    size_t len = 0, cap = 0, got;
    do {
        if (len == cap) {
            cap = cap ? 2 * cap : 1 << 16;
            buf = realloc(buf, cap);
            if (!buf) abort();
        }
        got = fread(buf + len, 1, cap - len, f);
        len += got;
    } while (got > 0);
    fclose(f);
    lb_fuzz_accepted = -1;
    LLVMFuzzerTestOneInput(buf, len);
    free(buf);
    (*n)++;
    const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    int want = strncmp(base, "ok-", 3) == 0 ? 1 : strncmp(base, "bad-", 4) == 0 ? 0 : -1;
    if (want >= 0 && lb_fuzz_accepted != want) {
        fprintf(stderr, "FAIL: %s was %s\n", path, lb_fuzz_accepted ? "accepted" : "refused");
        return 1;
    }
    return 0;
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static int replay(const char *path, int *n)
{
    struct stat st;
    if (stat(path, &st) != 0) {
        perror(path);
        return 1;
    }
    if (!S_ISDIR(st.st_mode)) return replay_file(path, n);
    DIR *d = opendir(path);
    if (!d) {
        perror(path);
        return 1;
    }
    char **names = NULL;
    int k = 0, bad = 0;
    for (struct dirent *e; (e = readdir(d));) {
        if (e->d_name[0] == '.') continue;
        names = realloc(names, sizeof *names * (k + 1));
        if (!names || asprintf(&names[k], "%s/%s", path, e->d_name) < 0) abort();
        k++;
    }
    closedir(d);
    qsort(names, k, sizeof *names, cmp_str);   // the same order on every machine
    for (int i = 0; i < k; i++) {
        bad |= replay_file(names[i], n);
        free(names[i]);
    }
    free(names);
    return bad;
}

int main(int argc, char **argv)
{
    int n = 0, bad = 0;
    if (argc == 3 && strcmp(argv[1], "--seed") == 0) {
        if (!lb_fuzz_seed) {
            fprintf(stderr, "%s: this target has no seed to write\n", LB_FUZZ_NAME);
            return 1;
        }
        return lb_fuzz_seed(argv[2]) == 0 ? 0 : 1;
    }
    if (argc > 1) {
        for (int i = 1; i < argc; i++) bad |= replay(argv[i], &n);
    } else {
        const char *src = getenv("LB_SRCDIR");
        char dir[1024];
        snprintf(dir, sizeof dir, "%s/tests/fuzz/corpus/%s", src && *src ? src : ".", LB_FUZZ_NAME);
        bad = replay(dir, &n);
        if (n == 0) {   // a replay of nothing would pass whatever the reader does
            fprintf(stderr, "FAIL: no corpus in %s\n", dir);
            bad = 1;
        }
    }
    printf("%s: %d inputs replayed, %s\n", LB_FUZZ_NAME, n, bad ? "FAILED" : "ok");
    return bad ? 1 : 0;
}
#endif
