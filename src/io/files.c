// files.c: whole-file reads, atomic writes, directories, globs and time (see files.h).
#include "src/io/files.h"

#include <errno.h>
#include <stdarg.h>
#include <fcntl.h>
#include <glob.h>
#include <libgen.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

// The rest of stream f, NUL-terminated; name in messages.
static char *read_stream(FILE *f, const char *name, size_t *len, char *err, size_t errlen)
{
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (n + 1 >= cap) buf = realloc(buf, cap *= 2);
        size_t got = fread(buf + n, 1, cap - n - 1, f);
        n += got;
        if (got == 0) break;
    }
    if (ferror(f)) {
        snprintf(err, errlen, "%s: read error", name);
        free(buf);
        return NULL;
    }
    buf[n] = 0;
    if (len) *len = n;
    return buf;
}

char *lb_read_file(const char *path, size_t *len, char *err, size_t errlen)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        return NULL;
    }
    char *buf = read_stream(f, path, len, err, errlen);
    fclose(f);
    return buf;
}

char *lb_read_stdin(size_t *len, char *err, size_t errlen)
{
    return read_stream(stdin, "stdin", len, err, errlen);
}

int lb_text_check(const char *text, size_t len, const char *path, char *err, size_t errlen)
{
    const char *nul = memchr(text, 0, len);
    if (!nul) return 0;
    int line = 1;
    for (const char *p = text; p < nul; p++) line += *p == '\n';
    snprintf(err, errlen, "%s:%d: a NUL byte (offset %zu): this is not a text file", path, line,
             (size_t)(nul - text));
    return -1;
}

// Bytes of the UTF-8 sequence at s (1 to 4), or 0 when none starts there.
static int utf8_len(const unsigned char *s)
{
    int n = s[0] >= 0xf0 && s[0] <= 0xf4 ? 4 : s[0] >= 0xe0 ? 3 : s[0] >= 0xc2 ? 2 : 0;
    if (s[0] < 0x80) return 1;
    if (s[0] >= 0xf5) return 0;
    for (int i = 1; i < n; i++)
        if ((s[i] & 0xc0) != 0x80) return 0;
    return n;
}

void lb_escape_bytes(char *s, size_t cap)
{
    size_t n = strlen(s);
    char *t = malloc(4 * n + 1), *o = t;
    if (!t) return;
    for (size_t i = 0; i < n;) {
        const unsigned char *c = (const unsigned char *)s + i;
        int k = utf8_len(c);
        if (k > 1 || (k == 1 && (*c >= 0x20 || *c == '\n' || *c == '\t') && *c != 0x7f)) {
            memcpy(o, c, (size_t)k);
            o += k, i += (size_t)k;
        } else {
            o += sprintf(o, "\\x%02x", *c);
            i++;
        }
    }
    *o = 0;
    snprintf(s, cap, "%s", t);
    free(t);
}

int lb_atomic_open(lb_atomic_file *a, const char *path, char *err, size_t errlen)
{
    snprintf(a->path, sizeof a->path, "%s", path);
    snprintf(a->tmp, sizeof a->tmp, "%s.tmp.%ld", path, (long)getpid());
    a->f = fopen(a->tmp, "wb");
    if (!a->f) {
        snprintf(err, errlen, "%s: %s", a->tmp, strerror(errno));
        return -1;
    }
    return 0;
}

void lb_atomic_sweep(const char *pattern)
{
    char **list;
    int n = lb_glob(pattern, &list);
    for (int i = 0; i < n; i++) {
        const char *dot = strrchr(list[i], '.'), *tmp = dot ? dot - 4 : NULL;
        if (!tmp || tmp < list[i] || strncmp(tmp, ".tmp.", 5) != 0) continue;
        char *end;
        long pid = strtol(dot + 1, &end, 10);
        if (*end || pid <= 0) continue;   // not a temporary of lb_atomic_open's
        int alive = pid != (long)getpid() && (kill((pid_t)pid, 0) == 0 || errno != ESRCH);
        if (!alive) unlink(list[i]);
    }
    lb_glob_free(list, n);
}

static void fsync_dir_of(const char *path)
{
    char copy[1024];
    snprintf(copy, sizeof copy, "%s", path);
    int fd = open(dirname(copy), O_RDONLY | O_DIRECTORY);
    if (fd >= 0) {
        fsync(fd);
        close(fd);
    }
}

int lb_atomic_commit(lb_atomic_file *a, char *err, size_t errlen)
{
    int bad = fflush(a->f) != 0 || ferror(a->f) || fsync(fileno(a->f)) != 0;
    int e = errno;
    if (fclose(a->f) != 0) bad = 1;
    a->f = NULL;
    if (bad) {
        snprintf(err, errlen, "%s: write failed: %s", a->path, strerror(e));
        unlink(a->tmp);
        return -1;
    }
    if (rename(a->tmp, a->path) != 0) {
        snprintf(err, errlen, "%s: rename failed: %s", a->path, strerror(errno));
        unlink(a->tmp);
        return -1;
    }
    fsync_dir_of(a->path);
    return 0;
}

void lb_atomic_abort(lb_atomic_file *a)
{
    if (a->f) fclose(a->f);
    a->f = NULL;
    unlink(a->tmp);
}

int lb_mkdirs(const char *dir, char *err, size_t errlen)
{
    lb_dirs_made made;
    return lb_mkdirs_made(dir, &made, err, errlen);
}

int lb_mkdirs_made(const char *dir, lb_dirs_made *made, char *err, size_t errlen)
{
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", dir);
    made->dir[0] = made->top[0] = 0;
    size_t n = strlen(buf);
    for (size_t i = 1; i <= n; i++) {
        if (buf[i] == '/' || buf[i] == 0) {
            char c = buf[i];
            buf[i] = 0;
            if (mkdir(buf, 0755) == 0) {
                if (!made->top[0]) snprintf(made->top, sizeof made->top, "%s", buf);
                snprintf(made->dir, sizeof made->dir, "%s", buf);   // the innermost made
            } else if (errno != EEXIST) {
                snprintf(err, errlen, "%s: cannot create directory: %s", buf, strerror(errno));
                lb_dirs_unmake(made);   // the ones made before this one
                return -1;
            }
            buf[i] = c;
        }
    }
    return 0;
}

void lb_dirs_unmake(lb_dirs_made *made)
{
    size_t top = strlen(made->top);
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", made->dir);
    // From the innermost up; a directory that is not empty (or not made here) stops the walk.
    while (top && strlen(buf) >= top && rmdir(buf) == 0 && strlen(buf) > top) {
        char *slash = strrchr(buf, '/');
        if (!slash) break;
        *slash = 0;
    }
    made->top[0] = 0;
}

int lb_glob(const char *pattern, char ***out)
{
    glob_t g;
    *out = NULL;
    if (glob(pattern, 0, NULL, &g) != 0) return 0;   // glob sorts by default
    int n = (int)g.gl_pathc;
    char **list = malloc(sizeof(char *) * (n ? n : 1));
    for (int i = 0; i < n; i++) list[i] = strdup(g.gl_pathv[i]);
    globfree(&g);
    *out = list;
    return n;
}

void lb_glob_free(char **list, int n)
{
    for (int i = 0; i < n; i++) free(list[i]);
    free(list);
}

double lb_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

void lb_seterr(char *err, size_t errlen, const char *fmt, ...)
{
    if (!err || !errlen) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}
