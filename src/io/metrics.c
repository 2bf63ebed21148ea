// metrics.c: metrics.jsonl and TensorBoard event files (see metrics.h).
#include "src/io/metrics.h"

#include <cJSON.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>
#include "kernels/common.h"
#include "src/io/files.h"

struct lb_metrics {
    FILE *f;                       // the JSON lines
    FILE *tb;                      // the event file
    char prefix[32];
    char path[1100], tb_path[1200];
};

// The size of f's file: where the next record starts (every record is flushed whole; the
// position of a FILE in append mode is not that before its first write), or -1.
static long record_start(FILE *f)
{
    struct stat st;
    return fstat(fileno(f), &st) == 0 ? (long)st.st_size : -1;
}

// A write that failed (a full disk): the file is cut back to its last whole record (at), so a
// reader never meets half a line, and the run stops (every rank: lb_abort) with the reason.
static void written_or_stop(FILE *f, long at, const char *path)
{
    if (fflush(f) == 0 && !ferror(f)) return;
    int e = errno;
    if (at >= 0 && ftruncate(fileno(f), at) != 0) e = e ? e : errno;
    fprintf(stderr, "lowbit: %s: cannot write: %s; the run stops (its last whole record is "
            "kept)\n", path, strerror(e));
    lb_abort(1);
}

uint32_t lb_crc32c(const void *data, size_t n)
{
    static uint32_t table[256];
    static int ready;
    if (!ready) {   // reflected polynomial 0x1EDC6F41
        for (uint32_t i = 0; i < 256; i++) {
            uint32_t c = i;
            for (int k = 0; k < 8; k++) c = c & 1 ? 0x82F63B78u ^ (c >> 1) : c >> 1;
            table[i] = c;
        }
        ready = 1;
    }
    const unsigned char *p = data;
    uint32_t c = 0xffffffffu;
    for (size_t i = 0; i < n; i++) c = table[(c ^ p[i]) & 255] ^ (c >> 8);
    return c ^ 0xffffffffu;
}

uint32_t lb_crc32c_masked(const void *data, size_t n)
{
    uint32_t c = lb_crc32c(data, n);
    return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

// --- protobuf, the few wire forms an Event needs ----------------------------------------------

typedef struct {
    unsigned char *b;
    size_t n, cap;
} buf;

static void put(buf *o, const void *p, size_t n)
{
    if (o->n + n > o->cap) {
        o->cap = (o->n + n) * 2 + 64;
        o->b = realloc(o->b, o->cap);
        if (!o->b) {
            fprintf(stderr, "lowbit: out of memory\n");
            exit(1);
        }
    }
    memcpy(o->b + o->n, p, n);
    o->n += n;
}

static void put_varint(buf *o, uint64_t v)
{
    unsigned char c[10];
    int n = 0;
    do {
        c[n] = (unsigned char)(v & 0x7f);
        v >>= 7;
        if (v) c[n] |= 0x80;
        n++;
    } while (v);
    put(o, c, (size_t)n);
}

static void put_le(buf *o, uint64_t v, int bytes)
{
    unsigned char c[8];
    for (int i = 0; i < bytes; i++) c[i] = (unsigned char)(v >> (8 * i));
    put(o, c, (size_t)bytes);
}

// field (wire type 2): bytes
static void put_bytes(buf *o, int field, const void *p, size_t n)
{
    put_varint(o, (uint64_t)field << 3 | 2);
    put_varint(o, n);
    put(o, p, n);
}

// An Event: wall_time (1, double), step (2, int64), then one of file_version (3, string) or
// summary (5, a Summary message).
static void put_event(buf *o, double wall, int64_t step, const char *version, const buf *summary)
{
    uint64_t w;
    memcpy(&w, &wall, 8);
    put_varint(o, 1 << 3 | 1);
    put_le(o, w, 8);
    put_varint(o, 2 << 3 | 0);
    put_varint(o, (uint64_t)step);
    if (version) put_bytes(o, 3, version, strlen(version));
    else put_bytes(o, 5, summary->b, summary->n);
}

// Summary.value (1): a Value of tag (1, string) and simple_value (2, float).
static void put_scalar(buf *summary, const char *tag, float v)
{
    buf val = {0};
    uint32_t u;
    memcpy(&u, &v, 4);
    put_bytes(&val, 1, tag, strlen(tag));
    put_varint(&val, 2 << 3 | 5);
    put_le(&val, u, 4);
    put_bytes(summary, 1, val.b, val.n);
    free(val.b);
}

// Summary.value (1): a Value of tag (1), metadata (9: plugin_data (1) of plugin_name (1)
// "text") and tensor (8: a TensorProto of dtype (1) DT_STRING = 7, an empty tensor_shape (2),
// one string_val (8)): what TensorBoard's text plugin shows, as Markdown.
static void put_text(buf *summary, const char *tag, const char *text)
{
    buf val = {0}, meta = {0}, plugin = {0}, tensor = {0};
    put_bytes(&plugin, 1, "text", 4);
    put_bytes(&meta, 1, plugin.b, plugin.n);
    put_varint(&tensor, 1 << 3 | 0);
    put_varint(&tensor, 7);
    put_bytes(&tensor, 2, "", 0);
    put_bytes(&tensor, 8, text, strlen(text));
    put_bytes(&val, 1, tag, strlen(tag));
    put_bytes(&val, 9, meta.b, meta.n);
    put_bytes(&val, 8, tensor.b, tensor.n);
    put_bytes(summary, 1, val.b, val.n);
    free(val.b);
    free(meta.b);
    free(plugin.b);
    free(tensor.b);
}

// One TFRecord around the event bytes.
static void write_record(FILE *f, const buf *e)
{
    unsigned char len[8];
    for (int i = 0; i < 8; i++) len[i] = (unsigned char)((uint64_t)e->n >> (8 * i));
    uint32_t lc = lb_crc32c_masked(len, 8), dc = lb_crc32c_masked(e->b, e->n);
    unsigned char c[4];
    fwrite(len, 1, 8, f);
    for (int i = 0; i < 4; i++) c[i] = (unsigned char)(lc >> (8 * i));
    fwrite(c, 1, 4, f);
    fwrite(e->b, 1, e->n, f);
    for (int i = 0; i < 4; i++) c[i] = (unsigned char)(dc >> (8 * i));
    fwrite(c, 1, 4, f);
}

static double wall_now(void)
{
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return (double)tv.tv_sec + 1e-6 * (double)tv.tv_usec;
}

// --- the sink -----------------------------------------------------------------------------------

// FILE's rows of steps after resume_step dropped, atomically (see metrics.h).
static int drop_later_rows(const char *path, long resume_step, char *err, size_t errlen)
{
    char *text = lb_read_file(path, NULL, err, errlen);
    if (!text) return -1;
    lb_atomic_file a;
    if (lb_atomic_open(&a, path, err, errlen) != 0) {
        free(text);
        return -1;
    }
    for (char *line = text; *line;) {
        char *end = strchr(line, '\n');
        size_t len = end ? (size_t)(end - line + 1) : strlen(line);
        long step;
        if (sscanf(line, "{\"step\": %ld", &step) != 1 || step <= resume_step)
            fwrite(line, 1, len, a.f);
        line += len;
    }
    free(text);
    return lb_atomic_commit(&a, err, errlen);
}

lb_metrics *lb_metrics_open(const char *out_dir, const char *file, const char *prefix,
                            long resume_step, char *err, size_t errlen)
{
    char path[1100], tb[1200], host[64] = "host";
    snprintf(path, sizeof path, "%s/%s", out_dir, file);
    snprintf(tb, sizeof tb, "%s.tmp.*", path);
    lb_atomic_sweep(tb);   // the rewrite of a run killed in drop_later_rows
    if (resume_step >= 0 && access(path, F_OK) == 0 &&
        drop_later_rows(path, resume_step, err, errlen) != 0)
        return NULL;
    lb_metrics *m = calloc(1, sizeof *m);
    snprintf(m->prefix, sizeof m->prefix, "%s", prefix);
    snprintf(m->path, sizeof m->path, "%s", path);
    m->f = fopen(path, resume_step >= 0 ? "a" : "w");
    if (!m->f) {
        snprintf(err, errlen, "%s: cannot open for writing: %s", path, strerror(errno));
        free(m);
        return NULL;
    }
    gethostname(host, sizeof host - 1);
    snprintf(tb, sizeof tb, "%s/events.out.tfevents.%ld.%s.%ld", out_dir, (long)time(NULL), host,
             (long)getpid());
    snprintf(m->tb_path, sizeof m->tb_path, "%s", tb);
    m->tb = fopen(tb, "wb");
    if (!m->tb) {
        snprintf(err, errlen, "%s: cannot open for writing: %s", tb, strerror(errno));
        fclose(m->f);
        free(m);
        return NULL;
    }
    buf e = {0};
    put_event(&e, wall_now(), 0, "brain.Event:2", NULL);
    write_record(m->tb, &e);
    free(e.b);
    written_or_stop(m->tb, 0, m->tb_path);
    return m;
}

// Every number of member `it` as the scalar TAG/KEY, an object's as TAG/KEY/ITS_KEY (the
// per-layer metrics: train/expert_load_max/3); other values are not plotted.
static void put_numbers(buf *summary, const char *tag, const cJSON *it)
{
    char sub[256];
    snprintf(sub, sizeof sub, "%s/%s", tag, it->string);
    if (cJSON_IsNumber(it)) put_scalar(summary, sub, (float)it->valuedouble);
    if (cJSON_IsObject(it))
        for (const cJSON *c = it->child; c; c = c->next) put_numbers(summary, sub, c);
}

// An event of one summary at step.
static void write_summary(lb_metrics *m, int64_t step, const buf *summary)
{
    buf e = {0};
    put_event(&e, wall_now(), step, NULL, summary);
    long at = record_start(m->tb);
    write_record(m->tb, &e);
    written_or_stop(m->tb, at, m->tb_path);
    free(e.b);
}

void lb_metrics_printf(lb_metrics *m, const char *fmt, ...)
{
    char *line = NULL;
    va_list ap;
    va_start(ap, fmt);
    if (vasprintf(&line, fmt, ap) < 0) {
        fprintf(stderr, "lowbit: out of memory\n");
        exit(1);
    }
    va_end(ap);
    long at = record_start(m->f);
    fprintf(m->f, "%s\n", line);
    written_or_stop(m->f, at, m->path);
    // every number but the step, as PREFIX/KEY at that step
    cJSON *j = cJSON_Parse(line);
    const cJSON *step = j ? cJSON_GetObjectItemCaseSensitive(j, "step") : NULL;
    if (cJSON_IsNumber(step)) {
        buf summary = {0};
        for (const cJSON *it = j->child; it; it = it->next)
            if (it != step) put_numbers(&summary, m->prefix, it);
        if (summary.n) write_summary(m, (int64_t)step->valuedouble, &summary);
        free(summary.b);
    }
    cJSON_Delete(j);
    free(line);
}

void lb_metrics_text(lb_metrics *m, int64_t step, const char *key, const char *text)
{
    char tag[160];
    snprintf(tag, sizeof tag, "%s/%s", m->prefix, key);
    buf md = {0}, summary = {0};   // each line indented four spaces: Markdown's code block
    for (const char *l = text; *l;) {
        const char *end = strchr(l, '\n');
        size_t len = end ? (size_t)(end - l + 1) : strlen(l);
        put(&md, "    ", 4);
        put(&md, l, len);
        l += len;
    }
    put(&md, "", 1);
    put_text(&summary, tag, (const char *)md.b);
    free(md.b);
    write_summary(m, step, &summary);
    free(summary.b);
}

void lb_metrics_close(lb_metrics *m)
{
    if (!m) return;
    fclose(m->f);
    fclose(m->tb);
    free(m);
}
