// safetensors.c: the safetensors format (https://github.com/huggingface/safetensors):
// u64 little-endian header length N, N bytes of JSON (may end in spaces), then the data.
// The header maps each tensor name to {dtype, shape, data_offsets: [begin, end]} relative to
// the data section, plus an optional "__metadata__" object of string pairs. As the format
// requires, the tensors cover the data section exactly: no overlaps, no holes.
#include "src/io/safetensors.h"

#include <cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#include "kernels/common.h"
#include "src/io/files.h"

// The header is read whole into memory; the reference implementation refuses above 100 MB.
#define LB_ST_MAX_HEADER (100u << 20)

static const struct {
    const char *name;
    size_t size;
} st_dtypes[] = {
    {"BOOL", 1}, {"U8", 1}, {"I8", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"F8_E8M0", 1},
    {"U16", 2}, {"I16", 2}, {"F16", 2}, {"BF16", 2},
    {"U32", 4}, {"I32", 4}, {"F32", 4},
    {"U64", 8}, {"I64", 8}, {"F64", 8},
};

static size_t dtype_size(const char *dtype)
{
    for (size_t i = 0; i < sizeof st_dtypes / sizeof st_dtypes[0]; i++)
        if (strcmp(dtype, st_dtypes[i].name) == 0) return st_dtypes[i].size;
    return 0;
}

int64_t lb_st_numel(const lb_st_tensor *t)
{
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}

uint32_t lb_st_crc32(uint32_t crc, const void *data, size_t n)
{
    static uint32_t table[256];
    if (!table[1])
        for (uint32_t i = 0; i < 256; i++) {
            uint32_t c = i;
            for (int k = 0; k < 8; k++) c = c & 1 ? 0xedb88320u ^ (c >> 1) : c >> 1;
            table[i] = c;
        }
    const uint8_t *p = data;
    crc = ~crc;
    for (size_t i = 0; i < n; i++) crc = table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
    return ~crc;
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

// Sorts pairs (key, value) by key.
static int cmp_pair(const void *a, const void *b)
{
    return strcmp(((const char *const *)a)[0], ((const char *const *)b)[0]);
}

// The header's canonical form, as lb_st_header_crc describes: "m" key NUL value NUL for each
// pair (keys sorted), then "t" name NUL dtype NUL and the numbers in decimal, each ended by
// NUL, for each tensor (t sorted by name). Every field ends in NUL, so no two headers share
// the form.
static uint32_t header_crc(const lb_st_tensor *t, int n, char *const *keys, char *const *values,
                           int nmeta, const char *skip_key)
{
    uint32_t crc = 0;
    const char **pairs = lb_malloc(sizeof(char *) * 2 * (nmeta ? nmeta : 1));
    for (int i = 0; i < nmeta; i++) {
        pairs[2 * i] = keys[i];
        pairs[2 * i + 1] = values[i];
    }
    qsort(pairs, nmeta, 2 * sizeof *pairs, cmp_pair);
    for (int i = 0; i < nmeta; i++) {
        const char *k = pairs[2 * i], *v = pairs[2 * i + 1];
        if (skip_key && strcmp(k, skip_key) == 0) continue;
        crc = lb_st_crc32(crc, "m", 1);
        crc = lb_st_crc32(crc, k, strlen(k) + 1);
        crc = lb_st_crc32(crc, v, strlen(v) + 1);
    }
    free(pairs);
    for (int i = 0; i < n; i++) {
        char num[32];
        crc = lb_st_crc32(crc, "t", 1);
        crc = lb_st_crc32(crc, t[i].name, strlen(t[i].name) + 1);
        crc = lb_st_crc32(crc, t[i].dtype, strlen(t[i].dtype) + 1);
        int64_t v[11];
        int nv = 0;
        v[nv++] = t[i].ndim;
        for (int d = 0; d < t[i].ndim; d++) v[nv++] = t[i].shape[d];
        v[nv++] = (int64_t)t[i].begin;
        v[nv++] = (int64_t)t[i].end;
        for (int j = 0; j < nv; j++) {
            int len = snprintf(num, sizeof num, "%lld", (long long)v[j]);
            crc = lb_st_crc32(crc, num, (size_t)len + 1);
        }
    }
    return crc;
}

uint32_t lb_st_header_crc(const lb_st_file *f, const char *skip_key)
{
    // f->tensors are sorted by name (lb_st_open)
    return header_crc(f->tensors, f->ntensors, f->meta_keys, f->meta_values, f->nmeta, skip_key);
}

// A JSON number that is a whole number in [0, 2^53] (exact in a double, so cJSON kept it).
static int json_uint(const cJSON *v, uint64_t *out)
{
    if (!cJSON_IsNumber(v)) return 0;
    double d = v->valuedouble;
    if (!(d >= 0) || d > 9007199254740992.0 || floor(d) != d) return 0;
    *out = (uint64_t)d;
    return 1;
}

static int cmp_name(const void *a, const void *b)
{
    return strcmp(((const lb_st_tensor *)a)->name, ((const lb_st_tensor *)b)->name);
}

static int cmp_begin(const void *a, const void *b)
{
    const lb_st_tensor *x = *(const lb_st_tensor *const *)a, *y = *(const lb_st_tensor *const *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return 0;
}

// Parses one tensor entry into t. Returns 0 or -1 with "path: tensor 'name': problem".
static int parse_tensor(const char *path, const cJSON *item, lb_st_tensor *t, size_t data_size,
                        char *err, size_t errlen)
{
    const char *name = item->string;
    if (strlen(name) >= sizeof t->name) {
        lb_seterr(err, errlen, "%s: tensor name '%.60s...' longer than %zu characters", path, name,
                  sizeof t->name - 1);
        return -1;
    }
    snprintf(t->name, sizeof t->name, "%s", name);
    if (!cJSON_IsObject(item)) {
        lb_seterr(err, errlen, "%s: tensor '%s': entry is not a JSON object", path, name);
        return -1;
    }
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(item, "dtype");
    const cJSON *sh = cJSON_GetObjectItemCaseSensitive(item, "shape");
    const cJSON *off = cJSON_GetObjectItemCaseSensitive(item, "data_offsets");
    if (!dt) {
        lb_seterr(err, errlen, "%s: tensor '%s': missing dtype", path, name);
        return -1;
    }
    if (!cJSON_IsString(dt)) {
        lb_seterr(err, errlen, "%s: tensor '%s': dtype is not a string", path, name);
        return -1;
    }
    if (!dtype_size(dt->valuestring)) {
        lb_seterr(err, errlen, "%s: tensor '%s': unknown dtype '%s'", path, name, dt->valuestring);
        return -1;
    }
    snprintf(t->dtype, sizeof t->dtype, "%s", dt->valuestring);
    if (!sh) {
        lb_seterr(err, errlen, "%s: tensor '%s': missing shape", path, name);
        return -1;
    }
    if (!cJSON_IsArray(sh) || cJSON_GetArraySize(sh) > 8) {
        lb_seterr(err, errlen, "%s: tensor '%s': shape must be an array of at most 8 dimensions",
                  path, name);
        return -1;
    }
    t->ndim = 0;
    uint64_t numel = 1;
    int overflow = 0;
    const cJSON *d;
    cJSON_ArrayForEach(d, sh) {
        uint64_t v;
        if (!json_uint(d, &v)) {
            lb_seterr(err, errlen, "%s: tensor '%s': shape entries must be non-negative integers",
                      path, name);
            return -1;
        }
        t->shape[t->ndim++] = (int64_t)v;
        if (v && numel > UINT64_MAX / v) overflow = 1;
        numel *= v;
    }
    if (!off) {
        lb_seterr(err, errlen, "%s: tensor '%s': missing data_offsets", path, name);
        return -1;
    }
    uint64_t b, e;
    if (!cJSON_IsArray(off) || cJSON_GetArraySize(off) != 2 ||
        !json_uint(cJSON_GetArrayItem(off, 0), &b) || !json_uint(cJSON_GetArrayItem(off, 1), &e) ||
        e < b) {
        lb_seterr(err, errlen, "%s: tensor '%s': data_offsets must be [begin, end] with "
                  "0 <= begin <= end", path, name);
        return -1;
    }
    if (e > data_size) {
        lb_seterr(err, errlen, "%s: tensor '%s': data_offsets [%llu, %llu] outside the data "
                  "section (%zu bytes)", path, name, (unsigned long long)b, (unsigned long long)e,
                  data_size);
        return -1;
    }
    size_t es = dtype_size(t->dtype);
    if (overflow || numel > UINT64_MAX / es || numel * es != e - b) {
        lb_seterr(err, errlen, "%s: tensor '%s': %llu bytes, but shape and dtype %s need %s%llu",
                  path, name, (unsigned long long)(e - b), t->dtype, overflow ? "more than " : "",
                  overflow ? (unsigned long long)UINT64_MAX : (unsigned long long)(numel * es));
        return -1;
    }
    t->begin = (size_t)b;
    t->end = (size_t)e;
    return 0;
}

static int parse_header(lb_st_file *f, const char *json, size_t len, char *err, size_t errlen)
{
    const char *path = f->path;
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(json, len, &end, 0);
    if (!root) {
        const char *at = cJSON_GetErrorPtr();
        long pos = at && at >= json && at <= json + len ? (long)(at - json) : -1;
        lb_seterr(err, errlen, "%s: header is not valid JSON (error near byte %ld of %zu)", path,
                  pos, len);
        return -1;
    }
    // Only padding spaces may follow the JSON object.
    for (const char *p = end; p && p < json + len; p++) {
        if (*p != ' ') {
            lb_seterr(err, errlen, "%s: header has bytes after the JSON object (byte %ld)", path,
                      (long)(p - json));
            cJSON_Delete(root);
            return -1;
        }
    }
    if (!cJSON_IsObject(root)) {
        lb_seterr(err, errlen, "%s: header is not a JSON object", path);
        cJSON_Delete(root);
        return -1;
    }
    size_t data_size = f->file_size - f->data_offset;
    int n = 0, nmeta = 0;
    const cJSON *item;
    cJSON_ArrayForEach(item, root) {
        if (strcmp(item->string, "__metadata__") == 0) {
            if (!cJSON_IsObject(item)) {
                lb_seterr(err, errlen, "%s: __metadata__ is not a JSON object", path);
                cJSON_Delete(root);
                return -1;
            }
            nmeta += cJSON_GetArraySize(item);
        } else {
            n++;
        }
    }
    f->tensors = calloc(n ? n : 1, sizeof *f->tensors);
    f->meta_keys = calloc(nmeta ? nmeta : 1, sizeof(char *));
    f->meta_values = calloc(nmeta ? nmeta : 1, sizeof(char *));
    if (!f->tensors || !f->meta_keys || !f->meta_values) {
        lb_seterr(err, errlen, "%s: out of memory for the header", path);
        cJSON_Delete(root);
        return -1;
    }
    cJSON_ArrayForEach(item, root) {
        if (strcmp(item->string, "__metadata__") == 0) {
            const cJSON *kv;
            cJSON_ArrayForEach(kv, item) {
                if (!cJSON_IsString(kv)) {
                    lb_seterr(err, errlen, "%s: __metadata__ value of '%s' is not a string", path,
                              kv->string);
                    cJSON_Delete(root);
                    return -1;
                }
                f->meta_keys[f->nmeta] = strdup(kv->string);
                f->meta_values[f->nmeta] = strdup(kv->valuestring);
                f->nmeta++;
            }
            continue;
        }
        if (parse_tensor(path, item, &f->tensors[f->ntensors], data_size, err, errlen) != 0) {
            cJSON_Delete(root);
            return -1;
        }
        f->ntensors++;
    }
    cJSON_Delete(root);

    // Sorted by name so lb_st_find is a binary search (checkpoints hold tens of thousands).
    qsort(f->tensors, f->ntensors, sizeof *f->tensors, cmp_name);
    for (int i = 1; i < f->ntensors; i++) {
        if (strcmp(f->tensors[i - 1].name, f->tensors[i].name) == 0) {
            lb_seterr(err, errlen, "%s: tensor '%s' appears twice in the header", path,
                      f->tensors[i].name);
            return -1;
        }
    }
    // The byte ranges, in file order, must tile the data section exactly.
    const lb_st_tensor **order = malloc(sizeof *order * (f->ntensors ? f->ntensors : 1));
    if (!order) {
        lb_seterr(err, errlen, "%s: out of memory for the header", path);
        return -1;
    }
    for (int i = 0; i < f->ntensors; i++) order[i] = &f->tensors[i];
    qsort(order, f->ntensors, sizeof *order, cmp_begin);
    size_t pos = 0;
    int rc = 0;
    for (int i = 0; i < f->ntensors && rc == 0; i++) {
        const lb_st_tensor *t = order[i];
        if (t->begin < pos) {
            lb_seterr(err, errlen, "%s: tensor '%s': data_offsets [%zu, %zu] overlap tensor '%s' "
                      "[%zu, %zu]", path, t->name, t->begin, t->end, order[i - 1]->name,
                      order[i - 1]->begin, order[i - 1]->end);
            rc = -1;
        } else if (t->begin > pos) {
            lb_seterr(err, errlen, "%s: tensor '%s': data_offsets [%zu, %zu] leave a gap of %zu "
                      "bytes before them", path, t->name, t->begin, t->end, t->begin - pos);
            rc = -1;
        }
        pos = t->end;
    }
    if (rc == 0 && pos != data_size) {
        lb_seterr(err, errlen, "%s: the tensors cover %zu bytes of the %zu-byte data section",
                  path, pos, data_size);
        rc = -1;
    }
    free(order);
    return rc;
}

int lb_st_open(lb_st_file *f, const char *path, char *err, size_t errlen)
{
    memset(f, 0, sizeof *f);
    snprintf(f->path, sizeof f->path, "%s", path);
    FILE *fp = fopen(path, "rb");
    if (!fp) {
        lb_seterr(err, errlen, "%s: %s", path, strerror(errno));
        return -1;
    }
    f->fp = fp;
    if (fseeko(fp, 0, SEEK_END) != 0) {
        lb_seterr(err, errlen, "%s: cannot seek: %s", path, strerror(errno));
        lb_st_close(f);
        return -1;
    }
    off_t size = ftello(fp);
    rewind(fp);
    f->file_size = size > 0 ? (size_t)size : 0;
    if (f->file_size < 8) {
        lb_seterr(err, errlen, "%s: file is %zu bytes, too short for the 8-byte header length",
                  path, f->file_size);
        lb_st_close(f);
        return -1;
    }
    unsigned char lenbuf[8];
    if (fread(lenbuf, 1, 8, fp) != 8) {
        lb_seterr(err, errlen, "%s: read error", path);
        lb_st_close(f);
        return -1;
    }
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | lenbuf[i];
    if (hlen > f->file_size - 8) {
        lb_seterr(err, errlen, "%s: header length %llu runs past the end of the file (%zu bytes)",
                  path, (unsigned long long)hlen, f->file_size);
        lb_st_close(f);
        return -1;
    }
    if (hlen > LB_ST_MAX_HEADER) {
        lb_seterr(err, errlen, "%s: header length %llu is over the %u-byte limit", path,
                  (unsigned long long)hlen, LB_ST_MAX_HEADER);
        lb_st_close(f);
        return -1;
    }
    char *json = malloc(hlen + 1);
    if (!json || fread(json, 1, hlen, fp) != hlen) {
        lb_seterr(err, errlen, "%s: cannot read the %llu-byte header", path,
                  (unsigned long long)hlen);
        free(json);
        lb_st_close(f);
        return -1;
    }
    json[hlen] = 0;
    f->data_offset = 8 + (size_t)hlen;
    int rc = parse_header(f, json, hlen, err, errlen);
    free(json);
    if (rc != 0) lb_st_close(f);
    return rc;
}

void lb_st_close(lb_st_file *f)
{
    if (f->fp) fclose(f->fp);
    for (int i = 0; i < f->nmeta; i++) {
        free(f->meta_keys[i]);
        free(f->meta_values[i]);
    }
    free(f->meta_keys);
    free(f->meta_values);
    free(f->tensors);
    f->fp = NULL;
    f->tensors = NULL;
    f->meta_keys = f->meta_values = NULL;
    f->ntensors = f->nmeta = 0;
}

const lb_st_tensor *lb_st_find(const lb_st_file *f, const char *name)
{
    int lo = 0, hi = f->ntensors - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        int c = strcmp(f->tensors[mid].name, name);
        if (c == 0) return &f->tensors[mid];
        if (c < 0) lo = mid + 1;
        else hi = mid - 1;
    }
    return NULL;
}

const char *lb_st_meta(const lb_st_file *f, const char *key)
{
    for (int i = 0; i < f->nmeta; i++)
        if (strcmp(f->meta_keys[i], key) == 0) return f->meta_values[i];
    return NULL;
}

int lb_st_read_f32(const lb_st_file *f, const lb_st_tensor *t, float *out, char *err,
                   size_t errlen)
{
    size_t es = dtype_size(t->dtype);
    int kind = strcmp(t->dtype, "F32") == 0 ? 0 : strcmp(t->dtype, "BF16") == 0 ? 1
             : strcmp(t->dtype, "F16") == 0 ? 2 : -1;
    if (kind < 0) {
        lb_seterr(err, errlen, "%s: tensor '%s': dtype %s cannot be read as fp32 (F32, BF16, F16)",
                  f->path, t->name, t->dtype);
        return -1;
    }
    if (fseeko((FILE *)f->fp, (off_t)(f->data_offset + t->begin), SEEK_SET) != 0) {
        lb_seterr(err, errlen, "%s: tensor '%s': cannot seek: %s", f->path, t->name,
                  strerror(errno));
        return -1;
    }
    // Decoded from little-endian bytes in chunks, so the result does not depend on the host.
    enum { CHUNK = 1 << 16 };
    unsigned char *buf = malloc(CHUNK * 4);
    if (!buf) {
        lb_seterr(err, errlen, "%s: tensor '%s': out of memory", f->path, t->name);
        return -1;
    }
    size_t n = (t->end - t->begin) / es, done = 0;
    while (done < n) {
        size_t m = n - done < CHUNK ? n - done : CHUNK;
        if (fread(buf, es, m, (FILE *)f->fp) != m) {
            lb_seterr(err, errlen, "%s: tensor '%s': short read", f->path, t->name);
            free(buf);
            return -1;
        }
        for (size_t i = 0; i < m; i++) {
            const unsigned char *p = buf + i * es;
            if (kind == 0) {
                uint32_t u = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                             (uint32_t)p[3] << 24;
                memcpy(&out[done + i], &u, 4);
            } else {
                uint16_t h = (uint16_t)(p[0] | p[1] << 8);
                out[done + i] = kind == 1 ? lb_bf16_to_f32(h) : lb_f16_to_f32(h);
            }
        }
        done += m;
    }
    free(buf);
    return 0;
}

// --- writer ----------------------------------------------------------------------------------

typedef struct {
    char *name;
    char dtype[8];
    int ndim;
    int64_t shape[8];
    const float *data;
} st_entry;

struct lb_st_writer {
    int n, cap;
    st_entry *e;
    int nmeta, metacap;
    char **keys, **values;
    char bad[256];                 // first problem found by add/meta, reported by save
};

lb_st_writer *lb_st_writer_new(void)
{
    return lb_calloc(1, sizeof(lb_st_writer));
}

void lb_st_writer_add(lb_st_writer *w, const char *name, const char *dtype, int ndim,
                      const int64_t *shape, const float *data)
{
    // add has no error return: a bad entry is remembered and fails the save, so a writer can
    // never silently drop a tensor.
    if (w->bad[0]) return;
    if (strcmp(dtype, "F32") != 0 && strcmp(dtype, "BF16") != 0)
        snprintf(w->bad, sizeof w->bad, "tensor '%s': dtype '%s' cannot be written (F32, BF16)",
                 name, dtype);
    else if (ndim < 0 || ndim > 8)
        snprintf(w->bad, sizeof w->bad, "tensor '%s': %d dimensions (0 to 8)", name, ndim);
    else if (strlen(name) >= sizeof((lb_st_tensor *)0)->name)
        snprintf(w->bad, sizeof w->bad, "tensor '%.60s...': name too long", name);
    else if (strcmp(name, "__metadata__") == 0)
        snprintf(w->bad, sizeof w->bad, "'__metadata__' is not a tensor name");
    for (int i = 0; !w->bad[0] && i < ndim; i++)
        if (shape[i] < 0) snprintf(w->bad, sizeof w->bad, "tensor '%s': negative dimension", name);
    if (w->bad[0]) return;
    if (w->n == w->cap) {
        w->cap = w->cap ? 2 * w->cap : 64;
        w->e = realloc(w->e, sizeof *w->e * w->cap);
        if (!w->e) lb_die("out of host memory");
    }
    st_entry *e = &w->e[w->n++];
    e->name = strdup(name);
    snprintf(e->dtype, sizeof e->dtype, "%s", dtype);
    e->ndim = ndim;
    for (int i = 0; i < ndim; i++) e->shape[i] = shape[i];
    e->data = data;
}

void lb_st_writer_meta(lb_st_writer *w, const char *key, const char *value)
{
    for (int i = 0; i < w->nmeta; i++) {
        if (strcmp(w->keys[i], key) == 0) {     // a repeated key replaces the value
            free(w->values[i]);
            w->values[i] = strdup(value);
            return;
        }
    }
    if (w->nmeta == w->metacap) {
        w->metacap = w->metacap ? 2 * w->metacap : 16;
        w->keys = realloc(w->keys, sizeof(char *) * w->metacap);
        w->values = realloc(w->values, sizeof(char *) * w->metacap);
        if (!w->keys || !w->values) lb_die("out of host memory");
    }
    w->keys[w->nmeta] = strdup(key);
    w->values[w->nmeta] = strdup(value);
    w->nmeta++;
}

static uint64_t entry_bytes(const st_entry *e)
{
    uint64_t n = 1;
    for (int i = 0; i < e->ndim; i++) n *= (uint64_t)e->shape[i];
    return n * (strcmp(e->dtype, "BF16") == 0 ? 2 : 4);
}

// Writes n floats of one entry as little-endian F32 or BF16.
static int write_data(FILE *fp, const st_entry *e)
{
    int bf16 = strcmp(e->dtype, "BF16") == 0;
    uint64_t n = entry_bytes(e) / (bf16 ? 2 : 4);
    enum { CHUNK = 1 << 15 };
    unsigned char buf[CHUNK * 4];
    for (uint64_t done = 0; done < n;) {
        size_t m = n - done < CHUNK ? (size_t)(n - done) : CHUNK;
        for (size_t i = 0; i < m; i++) {
            float x = e->data[done + i];
            if (bf16) {
                uint16_t h = lb_f32_to_bf16(x);
                buf[2 * i] = (unsigned char)h;
                buf[2 * i + 1] = (unsigned char)(h >> 8);
            } else {
                uint32_t u;
                memcpy(&u, &x, 4);
                for (int b = 0; b < 4; b++) buf[4 * i + b] = (unsigned char)(u >> (8 * b));
            }
        }
        size_t bytes = m * (bf16 ? 2 : 4);
        if (fwrite(buf, 1, bytes, fp) != bytes) return -1;
        done += m;
    }
    return 0;
}

int lb_st_writer_save(lb_st_writer *w, const char *path, char *err, size_t errlen)
{
    if (w->bad[0]) {
        lb_seterr(err, errlen, "%s: %s", path, w->bad);
        return -1;
    }
    // Duplicate names, found by sorting (linear scans would be quadratic in the tensor count).
    const char **names = lb_malloc(sizeof(char *) * (w->n ? w->n : 1));
    for (int i = 0; i < w->n; i++) names[i] = w->e[i].name;
    qsort(names, w->n, sizeof *names, cmp_str);
    for (int i = 1; i < w->n; i++) {
        if (strcmp(names[i - 1], names[i]) == 0) {
            lb_seterr(err, errlen, "%s: tensor '%s' added twice", path, names[i]);
            free(names);
            return -1;
        }
    }
    free(names);
    cJSON *root = cJSON_CreateObject();
    if (w->nmeta) {
        cJSON *meta = cJSON_AddObjectToObject(root, "__metadata__");
        for (int i = 0; i < w->nmeta; i++) cJSON_AddStringToObject(meta, w->keys[i], w->values[i]);
    }
    uint64_t pos = 0;
    for (int i = 0; i < w->n; i++) {   // data laid out in insertion order
        const st_entry *e = &w->e[i];
        cJSON *t = cJSON_AddObjectToObject(root, e->name);
        cJSON_AddStringToObject(t, "dtype", e->dtype);
        cJSON *sh = cJSON_AddArrayToObject(t, "shape");
        for (int d = 0; d < e->ndim; d++)
            cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)e->shape[d]));
        uint64_t bytes = entry_bytes(e);
        cJSON *off = cJSON_AddArrayToObject(t, "data_offsets");
        cJSON_AddItemToArray(off, cJSON_CreateNumber((double)pos));
        cJSON_AddItemToArray(off, cJSON_CreateNumber((double)(pos + bytes)));
        pos += bytes;
    }
    char *json = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    if (!json) {
        lb_seterr(err, errlen, "%s: cannot build the header", path);
        return -1;
    }
    // Pad the header with spaces so the data section starts 8-byte aligned.
    size_t hlen = strlen(json), padded = (hlen + 7) & ~(size_t)7;
    lb_atomic_file a;
    if (lb_atomic_open(&a, path, err, errlen) != 0) {
        free(json);
        return -1;
    }
    unsigned char lenbuf[8];
    for (int b = 0; b < 8; b++) lenbuf[b] = (unsigned char)((uint64_t)padded >> (8 * b));
    int bad = fwrite(lenbuf, 1, 8, a.f) != 8 || fwrite(json, 1, hlen, a.f) != hlen;
    for (size_t i = hlen; i < padded && !bad; i++) bad = fputc(' ', a.f) == EOF;
    free(json);
    for (int i = 0; i < w->n && !bad; i++) bad = write_data(a.f, &w->e[i]) != 0;
    if (bad) {
        lb_seterr(err, errlen, "%s: write failed: %s", path, strerror(errno));
        lb_atomic_abort(&a);
        return -1;
    }
    return lb_atomic_commit(&a, err, errlen);
}

uint32_t lb_st_writer_header_crc(const lb_st_writer *w, const char *skip_key)
{
    // the tensor table save writes: data in insertion order, sorted by name here as on load
    lb_st_tensor *t = lb_calloc(w->n ? w->n : 1, sizeof *t);
    uint64_t pos = 0;
    for (int i = 0; i < w->n; i++) {
        const st_entry *e = &w->e[i];
        snprintf(t[i].name, sizeof t[i].name, "%s", e->name);
        snprintf(t[i].dtype, sizeof t[i].dtype, "%s", e->dtype);
        t[i].ndim = e->ndim;
        for (int d = 0; d < e->ndim; d++) t[i].shape[d] = e->shape[d];
        t[i].begin = (size_t)pos;
        pos += entry_bytes(e);
        t[i].end = (size_t)pos;
    }
    qsort(t, w->n, sizeof *t, cmp_name);
    uint32_t crc = header_crc(t, w->n, w->keys, w->values, w->nmeta, skip_key);
    free(t);
    return crc;
}

void lb_st_writer_free(lb_st_writer *w)
{
    if (!w) return;
    for (int i = 0; i < w->n; i++) free(w->e[i].name);
    for (int i = 0; i < w->nmeta; i++) {
        free(w->keys[i]);
        free(w->values[i]);
    }
    free(w->e);
    free(w->keys);
    free(w->values);
    free(w);
}
