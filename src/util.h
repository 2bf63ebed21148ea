// util.h: file helpers for src/: whole-file reads, atomic writes, directories, globs, time.
#ifndef LB_UTIL_H
#define LB_UTIL_H

#include <stddef.h>
#include <stdio.h>

// Reads a whole file, NUL-terminated. Returns NULL with "path: reason" in err.
char *lb_read_file(const char *path, size_t *len, char *err, size_t errlen);

// Atomic replacement: open PATH.tmp.PID for writing; commit fsyncs, closes, renames over PATH
// and fsyncs the directory; abort closes and removes the temporary. A crash at any point leaves
// either the old PATH or the new one, never a partial file.
typedef struct {
    FILE *f;
    char path[1024];
    char tmp[1100];
} lb_atomic_file;
int lb_atomic_open(lb_atomic_file *a, const char *path, char *err, size_t errlen);
int lb_atomic_commit(lb_atomic_file *a, char *err, size_t errlen);
void lb_atomic_abort(lb_atomic_file *a);

// A run's metrics file (JSON lines, each starting {"step": N) opened to append. resume_step
// < 0: a new run, the file emptied. Otherwise the rows of steps after resume_step are dropped
// first (the run went past its last checkpoint before it stopped and repeats those steps), so
// every step keeps one row; the kept rows are written atomically. NULL with a message in err.
FILE *lb_metrics_open(const char *path, long resume_step, char *err, size_t errlen);

int lb_mkdirs(const char *dir, char *err, size_t errlen);      // mkdir -p
// Sorted matches of a glob pattern; *out is malloc'd (free with lb_glob_free). Returns count.
int lb_glob(const char *pattern, char ***out);
void lb_glob_free(char **list, int n);
double lb_now(void);                                             // monotonic seconds

#endif
