// mllog.c: writing the MLPerf log (src/io/mllog.h). One line per event, flushed at once, so a
// run that dies leaves every line it logged.
#include "src/io/mllog.h"

#include <cJSON.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct lb_mllog {
    FILE *f;
    int own;                       // f is a file of ours (not stdout)
};

lb_mllog *lb_mllog_open(const char *out_dir, const char *file, int resumed, char *err,
                        size_t errlen)
{
    lb_mllog *l = calloc(1, sizeof *l);
    if (!strcmp(file, "-")) {
        l->f = stdout;
        return l;
    }
    char path[1100];
    if (file[0] == '/') snprintf(path, sizeof path, "%s", file);
    else snprintf(path, sizeof path, "%s/%s", out_dir, file);
    l->f = fopen(path, resumed ? "a" : "w");
    if (!l->f) {
        snprintf(err, errlen, "%s: cannot open for writing: %s", path, strerror(errno));
        free(l);
        return NULL;
    }
    l->own = 1;
    return l;
}

void lb_mllog_close(lb_mllog *l)
{
    if (!l) return;
    if (l->own) fclose(l->f);
    else fflush(l->f);
    free(l);
}

double lb_mllog_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static const char *type_name(lb_mllog_type t)
{
    return t == LB_MLLOG_START ? "INTERVAL_START" : t == LB_MLLOG_END ? "INTERVAL_END"
                                                                      : "POINT_IN_TIME";
}

void lb_mllog_emit(lb_mllog *l, const char *file, int line, double time_ms, lb_mllog_type type,
                   const char *key, const char *value, const char *meta)
{
    if (!l) return;
    if (time_ms < 0) time_ms = lb_mllog_now_ms();
    char fbuf[600];
    fprintf(l->f, ":::MLLOG {\"namespace\": \"\", \"time_ms\": %lld, \"event_type\": \"%s\", "
            "\"key\": \"%s\", \"value\": %s, \"metadata\": {\"file\": %s, \"lineno\": %d%s%s}}\n",
            (long long)time_ms, type_name(type), key, value,
            lb_mllog_str(fbuf, sizeof fbuf, file), line, meta ? ", " : "", meta ? meta : "");
    fflush(l->f);
}

const char *lb_mllog_num(char *buf, double v)
{
    // the shortest of %.15g .. %.17g that reads back as v; integral values keep a ".0" so
    // that the value reads as the float it is (as Python's json writes 1.0)
    for (int p = 15; p <= 17; p++) {
        snprintf(buf, 64, "%.*g", p, v);
        if (strtod(buf, NULL) == v) break;
    }
    if (!strpbrk(buf, ".eEn")) strcat(buf, ".0");
    return buf;
}

const char *lb_mllog_int(char *buf, int64_t v)
{
    snprintf(buf, 64, "%lld", (long long)v);
    return buf;
}

const char *lb_mllog_str(char *buf, size_t len, const char *s)
{
    cJSON *j = cJSON_CreateString(s);
    char *t = j ? cJSON_PrintUnformatted(j) : NULL;
    snprintf(buf, len, "%s", t ? t : "\"\"");
    free(t);
    cJSON_Delete(j);
    return buf;
}
