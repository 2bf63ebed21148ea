// files.h: file helpers for src/: whole-file reads, atomic writes, directories, globs, time.
#ifndef LB_FILES_H
#define LB_FILES_H

#include <stddef.h>
#include <stdio.h>

// Reads a whole file, NUL-terminated. Returns NULL with "path: reason" in err.
char *lb_read_file(const char *path, size_t *len, char *err, size_t errlen);
// The same of standard input, to its end ("stdin: reason").
char *lb_read_stdin(size_t *len, char *err, size_t errlen);

// 0 when text (len bytes) holds no NUL byte; else -1 with "path:line: ..." in err (a text
// read by lb_read_file would end there, and the rest would be dropped unseen).
int lb_text_check(const char *text, size_t len, const char *path, char *err, size_t errlen);

// Rewrites s (NUL-terminated, in a buffer of cap bytes) so that it prints as it reads: control
// bytes and bytes that are not UTF-8 become \xNN (a message quoting a garbage input).
void lb_escape_bytes(char *s, size_t cap);

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
// Removes the temporaries (PATH.tmp.PID) matching the glob pattern whose process is gone: what
// a write killed midway left. A live one is another process's write in progress (this one's
// own are committed or removed before it sweeps).
void lb_atomic_sweep(const char *pattern);

int lb_mkdirs(const char *dir, char *err, size_t errlen);      // mkdir -p
// The directories one lb_mkdirs_made call created: dir the innermost, top the outermost ("" when
// all were there). A command that fails before it finishes removes them again
// (lb_dirs_unmake), so it leaves no empty directory behind.
typedef struct {
    char dir[1024];
    char top[1024];
} lb_dirs_made;
int lb_mkdirs_made(const char *dir, lb_dirs_made *made, char *err, size_t errlen);
// Removes made->dir and its parents up to made->top, each only while empty; then forgets them.
void lb_dirs_unmake(lb_dirs_made *made);
// Sorted matches of a glob pattern; *out is malloc'd (free with lb_glob_free). Returns count.
int lb_glob(const char *pattern, char ***out);
void lb_glob_free(char **list, int n);
// err = the formatted message (vsnprintf into errlen bytes; nothing where err is NULL): the
// "file: what is wrong" of a function that reports through (err, errlen).
void lb_seterr(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
double lb_now(void);                                             // monotonic seconds

#endif
