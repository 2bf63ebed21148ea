// fuzz.h: the fuzz targets (tests/fuzz/, doc/robustness.md). Each target file defines
// LLVMFuzzerTestOneInput, the libFuzzer entry point, for one reader of untrusted input; it is
// linked either with libFuzzer (`make fuzz`, clang) or with replay.c, the plain driver that
// `make check` runs over the committed corpus tests/fuzz/corpus/NAME/.
#ifndef LB_FUZZ_H
#define LB_FUZZ_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

// The verdict of the last input: 1 accepted, 0 refused with a message. replay.c checks it for
// corpus files named ok-* (must be accepted) and bad-* (must be refused).
extern int lb_fuzz_accepted;

// The readers take paths: the input written to this process's scratch file, whose path is
// returned (the same path for every input of a process, made under TMPDIR).
static inline const char *lb_fuzz_file(const uint8_t *data, size_t size, const char *suffix)
{
    static char path[512];
    const char *base = getenv("TMPDIR");
    snprintf(path, sizeof path, "%s/lowbit-fuzz-%ld%s", base && *base ? base : "/tmp",
             (long)getpid(), suffix);
    FILE *f = fopen(path, "wb");
    if (!f || (size && fwrite(data, 1, size, f) != size) || fclose(f) != 0) {
        perror(path);
        abort();
    }
    return path;
}

// A refusal must name the input: err starts with "path:" (doc: every error names its file).
// LB_FUZZ_VERBOSE=1 prints every refusal.
static inline void lb_fuzz_names(const char *err, const char *path)
{
    size_t n = strlen(path);
    if (getenv("LB_FUZZ_VERBOSE")) fprintf(stderr, "refused: %s\n", err);
    if (strncmp(err, path, n) != 0 || err[n] != ':') {
        fprintf(stderr, "fuzz: an error that does not start with '%s:': '%s'\n", path, err);
        abort();
    }
}

#endif
