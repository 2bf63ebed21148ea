// checkpoint.c: lowbit checkpoints as safetensors files (see checkpoint.h, doc/checkpoints.md).
#include "src/io/checkpoint.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kernels/common.h"
#include "src/io/safetensors.h"
#include "src/io/files.h"
#include "parallel/grid.h"

// Format 2: header_crc32 covers the metadata and the tensor table. Format 1 (before
// 2026-12-02) has the data's crc32 only; it still loads.
#define FORMAT "lowbit-checkpoint-2"
#define FORMAT_1 "lowbit-checkpoint-1"
#define STEP_MAX 2147483647   // steps, shard indices and offsets are int32 where used
// The tokenizer.json text of the model, when it has one: a metadata string, so the header's
// CRC covers it and older readers pass over it (doc/checkpoints.md, 2026-12-07).
#define TOKENIZER_KEY "tokenizer_json"

static const char *moment_name(char *buf, size_t len, const char *which, const char *name)
{
    snprintf(buf, len, "optimizer.%s.%s", which, name);
    return buf;
}

// Writes tensors t (n; data at host + t->offset, and the moments at adam_m/adam_v + t->offset
// when not NULL).
static int save_tables(const char *path, const lb_tensor *t, int n, const float *host,
                       const float *adam_m, const float *adam_v, const lb_train_state *st,
                       const char *config_ini, const char *tokenizer_json, char *err,
                       size_t errlen)
{
    // The data section holds the tensors in the order added, without gaps, so its CRC is the
    // CRC of these buffers in this order.
    lb_st_writer *w = lb_st_writer_new();
    static const char *which[3] = {NULL, "exp_avg", "exp_avg_sq"};
    const float *buf[3] = {host, adam_m, adam_v};
    int nbuf = adam_m ? 3 : 1;
    char (*names)[LB_TENSOR_NAME + 32] = lb_malloc(sizeof *names * n * nbuf);
    uint32_t crc = 0;
    for (int b = 0; b < nbuf; b++)
        for (int i = 0; i < n; i++) {
            const char *name = t[i].name;
            if (b) name = moment_name(names[b * n + i], sizeof names[0], which[b], name);
            const float *data = buf[b] + t[i].offset;
            lb_st_writer_add(w, name, "F32", t[i].ndim, t[i].shape, data);
            crc = lb_st_crc32(crc, data, t[i].numel * sizeof(float));
        }
    char num[64];
    lb_st_writer_meta(w, "format", FORMAT);
    lb_st_writer_meta(w, "config", config_ini);
    snprintf(num, sizeof num, "%" PRId64, st->step);
    lb_st_writer_meta(w, "step", num);
    if (st->loader_shard == -1) {   // a shuffled or blended loader: one count
        snprintf(num, sizeof num, "%" PRId64, st->loader_pos);
        lb_st_writer_meta(w, "loader_sequence", num);
    } else {
        snprintf(num, sizeof num, "%" PRId64, st->loader_shard);
        lb_st_writer_meta(w, "loader_shard", num);
        snprintf(num, sizeof num, "%" PRId64, st->loader_pos);
        lb_st_writer_meta(w, "loader_pos", num);
    }
    if (tokenizer_json) lb_st_writer_meta(w, TOKENIZER_KEY, tokenizer_json);
    snprintf(num, sizeof num, "%08x", crc);
    lb_st_writer_meta(w, "crc32", num);
    snprintf(num, sizeof num, "%08x", lb_st_writer_header_crc(w, "header_crc32"));
    lb_st_writer_meta(w, "header_crc32", num);   // last: over everything else
    int rc = lb_st_writer_save(w, path, err, errlen);
    lb_st_writer_free(w);
    free(names);
    return rc;
}

int lb_checkpoint_save(const char *path, const lb_model *m, const float *adam_m,
                       const float *adam_v, const lb_train_state *st, const char *config_ini,
                       const char *tokenizer_json, char *err, size_t errlen)
{
    lb_backend *be = m->be;
    size_t bytes = m->nparams * sizeof(float);
    float *host = lb_malloc(bytes * (adam_m ? 3 : 1));
    be->download(be, host, m->params, bytes);
    if (adam_m) {
        be->download(be, host + m->nparams, adam_m, bytes);
        be->download(be, host + 2 * m->nparams, adam_v, bytes);
    }
    int rc = save_tables(path, m->tensors, m->ntensors, host, adam_m ? host + m->nparams : NULL,
                         adam_m ? host + 2 * m->nparams : NULL, st, config_ini, tokenizer_json,
                         err, errlen);
    free(host);
    return rc;
}

// Metadata key as a whole number in [0, STEP_MAX].
static int meta_count(const lb_st_file *f, const char *key, int64_t *out, char *err,
                      size_t errlen)
{
    const char *s = lb_st_meta(f, key);
    char *end = NULL;
    long long v = 0;
    if (s && *s >= '0' && *s <= '9') v = strtoll(s, &end, 10);
    if (!s || !end || *end || v > STEP_MAX) {
        char shown[48] = "";
        if (s) {
            snprintf(shown, sizeof shown, " is '%.32s'", s);
            lb_escape_bytes(shown, sizeof shown);
        }
        snprintf(err, errlen, "%s: metadata '%s'%s: not a whole number from 0 to %d (the file is "
                 "corrupt)", f->path, key, s ? shown : " is missing", STEP_MAX);
        return -1;
    }
    *out = v;
    return 0;
}

// The loader position: shard and offset, or (shard -1) the sequences a shuffled or blended
// loader has drawn (up to 2^62: they outgrow an int32 long before steps do).
static int meta_loader(const lb_st_file *f, lb_train_state *s, char *err, size_t errlen)
{
    const char *seq = lb_st_meta(f, "loader_sequence");
    if (!seq)
        return meta_count(f, "loader_shard", &s->loader_shard, err, errlen) == 0 &&
                       meta_count(f, "loader_pos", &s->loader_pos, err, errlen) == 0
                   ? 0
                   : -1;
    char *end = NULL;
    long long v = 0;
    if (*seq >= '0' && *seq <= '9') v = strtoll(seq, &end, 10);
    if (!end || *end || v > (1LL << 62)) {
        char shown[48];
        snprintf(shown, sizeof shown, "%.32s", seq);
        lb_escape_bytes(shown, sizeof shown);
        snprintf(err, errlen, "%s: metadata 'loader_sequence' is '%s': not a whole number from 0 "
                 "to 2^62 (the file is corrupt)", f->path, shown);
        return -1;
    }
    s->loader_shard = -1;
    s->loader_pos = v;
    return 0;
}

// Metadata key as 8 lowercase hex digits (a CRC as save_tables writes it).
static int meta_crc(const lb_st_file *f, const char *key, char *err, size_t errlen)
{
    const char *s = lb_st_meta(f, key);
    int ok = s && strlen(s) == 8;
    for (int i = 0; ok && i < 8; i++) ok = (s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f');
    if (!ok) {
        char shown[48] = "";
        if (s) {
            snprintf(shown, sizeof shown, " is '%.32s'", s);
            lb_escape_bytes(shown, sizeof shown);
        }
        snprintf(err, errlen, "%s: metadata '%s'%s: not 8 hex digits (the file is corrupt)",
                 f->path, key, s ? shown : " is missing");
    }
    return ok ? 0 : -1;
}

// Opens a checkpoint and checks every metadata field it has to have: the format, the stored
// configuration, the step and the loader position (whole numbers in range), the CRCs (their
// form; verify_header and verify_data check their values). *st gets the numbers.
static int open_checkpoint(lb_st_file *f, const char *path, lb_train_state *st, char *err,
                           size_t errlen)
{
    if (lb_st_open(f, path, err, errlen) != 0) return -1;
    const char *fmt = lb_st_meta(f, "format");
    const char *cfg = lb_st_meta(f, "config");
    lb_train_state s = {0};
    if (!fmt || (strcmp(fmt, FORMAT) != 0 && strcmp(fmt, FORMAT_1) != 0)) {
        char shown[80];
        snprintf(shown, sizeof shown, "%.64s", fmt ? fmt : "absent");
        lb_escape_bytes(shown, sizeof shown);
        snprintf(err, errlen, "%s: not a lowbit checkpoint (metadata format is '%s', expected '%s')",
                 path, shown, FORMAT);
    } else if (!cfg || !cfg[0]) {
        snprintf(err, errlen, "%s: checkpoint has no stored configuration", path);
    } else if (meta_count(f, "step", &s.step, err, errlen) == 0 &&
               meta_loader(f, &s, err, errlen) == 0 &&
               meta_crc(f, "crc32", err, errlen) == 0 &&
               (strcmp(fmt, FORMAT) != 0 || meta_crc(f, "header_crc32", err, errlen) == 0)) {
        if (st) *st = s;
        return 0;
    }
    lb_st_close(f);
    return -1;
}

// The header's CRC (lb_st_header_crc) against the stored one: catches an edited step, loader
// position or configuration, a renamed tensor, a changed shape. Format 1 has none.
static int verify_header(const lb_st_file *f, char *err, size_t errlen)
{
    if (strcmp(lb_st_meta(f, "format"), FORMAT) != 0) return 0;
    const char *want = lb_st_meta(f, "header_crc32");
    char have[16];
    snprintf(have, sizeof have, "%08x", lb_st_header_crc(f, "header_crc32"));
    if (strcmp(have, want) != 0) {
        snprintf(err, errlen, "%s: header checksum mismatch (stored %s, computed %s): the "
                 "metadata or the tensor table is corrupt", f->path, want, have);
        return -1;
    }
    return 0;
}

char *lb_checkpoint_config(const char *path, char *err, size_t errlen)
{
    lb_st_file f;
    if (open_checkpoint(&f, path, NULL, err, errlen) != 0) return NULL;
    char *out = NULL;
    if (verify_header(&f, err, errlen) == 0 && !(out = strdup(lb_st_meta(&f, "config"))))
        snprintf(err, errlen, "%s: out of memory", path);
    lb_st_close(&f);
    return out;
}

int lb_checkpoint_tokenizer(const char *path, char **json, char *err, size_t errlen)
{
    lb_st_file f;
    *json = NULL;
    if (open_checkpoint(&f, path, NULL, err, errlen) != 0) return -1;
    int rc = verify_header(&f, err, errlen);
    const char *s = lb_st_meta(&f, TOKENIZER_KEY);
    if (rc == 0 && s && !(*json = strdup(s))) {
        snprintf(err, errlen, "%s: out of memory", path);
        rc = -1;
    }
    lb_st_close(&f);
    return rc;
}

// CRC of the whole data section against the stored one: catches flipped or zeroed bytes that
// still parse.
static int verify_data(const lb_st_file *f, char *err, size_t errlen)
{
    const char *want = lb_st_meta(f, "crc32");
    FILE *fp = fopen(f->path, "rb");
    if (!fp || fseeko(fp, (off_t)f->data_offset, SEEK_SET) != 0) {
        snprintf(err, errlen, "%s: cannot read", f->path);
        if (fp) fclose(fp);
        return -1;
    }
    uint32_t crc = 0;
    char buf[1 << 16];
    size_t got;
    while ((got = fread(buf, 1, sizeof buf, fp)) > 0) crc = lb_st_crc32(crc, buf, got);
    fclose(fp);
    char have[16];
    snprintf(have, sizeof have, "%08x", crc);
    if (strcmp(have, want) != 0) {
        snprintf(err, errlen, "%s: checksum mismatch (stored %s, computed %s): the file is corrupt",
                 f->path, want, have);
        return -1;
    }
    return 0;
}

// The file's entry of tensor name with t's shape and dtype F32; NULL with a message naming the
// file and the tensor (*missing set when there is no such name).
static const lb_st_tensor *find_tensor(const lb_st_file *f, const lb_tensor *t, const char *name,
                                       int *missing, char *err, size_t errlen)
{
    const lb_st_tensor *s = lb_st_find(f, name);
    if (!s) {
        snprintf(err, errlen, "%s: tensor '%s' is missing", f->path, name);
        *missing = 1;
        return NULL;
    }
    int same = s->ndim == t->ndim;
    for (int d = 0; same && d < t->ndim; d++) same = s->shape[d] == t->shape[d];
    if (!same) {
        char a[96] = "", b[96] = "";
        for (int d = 0; d < s->ndim; d++)
            snprintf(a + strlen(a), sizeof a - strlen(a), "%s%" PRId64, d ? "," : "", s->shape[d]);
        for (int d = 0; d < t->ndim; d++)
            snprintf(b + strlen(b), sizeof b - strlen(b), "%s%" PRId64, d ? "," : "", t->shape[d]);
        snprintf(err, errlen, "%s: tensor '%s' has shape [%s], the model expects [%s]", f->path,
                 name, a, b);
        return NULL;
    }
    if (strcmp(s->dtype, "F32") != 0) {
        snprintf(err, errlen, "%s: tensor '%s' is %s, checkpoints hold F32", f->path, name,
                 s->dtype);
        return NULL;
    }
    return s;
}

// Reads tensors t (n) into host + t->offset, and the moments into adam_m/adam_v + t->offset
// when those are not NULL (zeros when the file has none). Everything is checked before any
// data is read: the metadata, every tensor by name, shape and dtype (the parameters, and the
// moments of every parameter when the file holds 3n tensors), the header's CRC, the data's.
static int load_tables(const char *path, const lb_tensor *t, int n, float *host, float *adam_m,
                       float *adam_v, size_t floats, lb_train_state *st, char *err, size_t errlen)
{
    lb_st_file f;
    lb_train_state s;
    if (open_checkpoint(&f, path, &s, err, errlen) != 0) return -1;
    int rc = -1, nb = f.ntensors == 3 * n ? 3 : 1;
    static const char *which[3] = {NULL, "exp_avg", "exp_avg_sq"};
    float *dst[3] = {host, adam_m, adam_v};
    const lb_st_tensor **found = lb_calloc((size_t)3 * n + 1, sizeof *found);
    char *seen = lb_calloc((size_t)f.ntensors + 1, 1);
    char name[LB_TENSOR_NAME + 32];
    if (f.ntensors != n && f.ntensors != 3 * n) {
        snprintf(err, errlen, "%s: holds %d tensors, the model has %d (with the optimizer's "
                 "moments %d: a checkpoint of another model?)", path, f.ntensors, n, 3 * n);
        goto out;
    }
    int missing = 0;
    for (int b = 0; b < nb && !missing; b++)
        for (int i = 0; i < n && !missing; i++) {
            const char *nm = b ? moment_name(name, sizeof name, which[b], t[i].name) : t[i].name;
            found[b * n + i] = find_tensor(&f, &t[i], nm, &missing, err, errlen);
            if (!found[b * n + i] && !missing) goto out;
        }
    if (missing) {   // the count matched, so the file holds a name the model does not have
        for (int b = 0; b < nb; b++)
            for (int i = 0; i < n; i++) {
                const char *nm = b ? moment_name(name, sizeof name, which[b], t[i].name)
                                   : t[i].name;
                const lb_st_tensor *x = lb_st_find(&f, nm);
                if (x) seen[x - f.tensors] = 1;
            }
        int k = 0;
        while (k < f.ntensors && seen[k]) k++;
        if (k < f.ntensors) {
            char stray[200];
            snprintf(stray, sizeof stray, "%s", f.tensors[k].name);
            lb_escape_bytes(stray, sizeof stray);
            size_t len = strlen(err);
            snprintf(err + len, errlen - len, "; the file holds '%s' instead, which the model "
                     "has not (a corrupt name, or a checkpoint of another model)", stray);
        }
        goto out;
    }
    if (verify_header(&f, err, errlen) != 0 || verify_data(&f, err, errlen) != 0) goto out;
    for (int b = 0; b < 3; b++) {
        if (b && !adam_m) break;
        if (b >= nb) {   // imported weights: a fresh optimizer
            memset(dst[b], 0, floats * sizeof(float));
            continue;
        }
        for (int i = 0; i < n; i++)
            if (lb_st_read_f32(&f, found[b * n + i], dst[b] + t[i].offset, err, errlen)) goto out;
    }
    if (st) *st = s;
    rc = 0;
out:
    free(found);
    free(seen);
    lb_st_close(&f);
    return rc;
}

int lb_checkpoint_load(const char *path, lb_model *m, float *adam_m, float *adam_v,
                       lb_train_state *st, char *err, size_t errlen)
{
    size_t n = m->nparams, bytes = n * sizeof(float);
    float *host = lb_calloc(adam_m ? 3 * n : n, sizeof(float));
    lb_train_state s;
    int rc = load_tables(path, m->tensors, m->ntensors, host, adam_m ? host + n : NULL,
                         adam_m ? host + 2 * n : NULL, n, &s, err, errlen);
    if (rc == 0) {
        m->be->upload(m->be, m->params, host, bytes);
        lb_model_params_changed(m, (uint64_t)s.step);
        if (adam_m) {
            m->be->upload(m->be, adam_m, host + n, bytes);
            m->be->upload(m->be, adam_v, host + 2 * n, bytes);
        }
        if (st) *st = s;
    }
    free(host);
    return rc;
}

// --- checkpoints of a parallel job --------------------------------------------------------------

// Rank r's place: its model piece, and its data-parallel coordinates. pc NULL: pure data
// parallelism over the world (every rank holds everything).
typedef struct {
    lb_model_parallel par;
    int dp_rank, edp_rank;
    lb_tensor *t;                  // its pieces, in the definition's order
    int n, next;                   // count, and the next piece to visit
} rank_place;

static void place_of(rank_place *p, const lb_model *m, const lb_parallel_config *pc, int world,
                     int r)
{
    char err[256];
    memset(p, 0, sizeof *p);
    p->par = (lb_model_parallel){1, 0, 0, 1, 0, 1, 0, NULL, NULL, 1, 0, NULL};
    p->dp_rank = p->edp_rank = r;
    if (pc) {
        lb_grid g;
        if (lb_grid_layout(&g, pc, world, r, err, sizeof err) != 0) lb_die("%s", err);
        p->par = lb_model_parallel_of(&g, NULL, NULL);
        p->dp_rank = g.dp_rank;
        p->edp_rank = g.edp_rank;
    }
    p->t = lb_model_pieces(&m->cfg, &p->par, &p->n, err, sizeof err);
    if (!p->t) lb_die("%s", err);
}

// Rank p's piece of whole tensor gi, or NULL. Visited in increasing gi.
static const lb_tensor *piece_of(rank_place *p, int gi)
{
    while (p->next < p->n && p->t[p->next].global < gi) p->next++;
    return p->next < p->n && p->t[p->next].global == gi ? &p->t[p->next] : NULL;
}

// One copy of every parameter is written: dense pieces by data-parallel rank 0 (tp-replicated
// ones by tp rank 0 of it), expert pieces by expert-data-parallel rank 0.
static int writes(const rank_place *p, const lb_tensor *t)
{
    if (t->expert) return p->edp_rank == 0;
    return p->dp_rank == 0 && (!t->tp_replicated || p->par.tp_rank == 0);
}

// Floats in the largest of n tensors: the message buffers.
static size_t largest(const lb_tensor *t, int n)
{
    size_t most = 1;
    for (int i = 0; i < n; i++)
        if (t[i].numel > most) most = t[i].numel;
    return most;
}

// A piece travels as one message: parameters, then the two moments (host[0..2]: whole rank
// buffers laid out as the parameters).
static void pack(const lb_tensor *t, const float *const host[3], float *buf)
{
    for (int b = 0; b < 3; b++)
        memcpy(buf + b * t->numel, host[b] + t->offset, t->numel * sizeof(float));
}

int lb_checkpoint_save_parallel(const char *path, lb_model *m, const float *adam_m,
                                const float *adam_v, const lb_train_state *st,
                                const char *config_ini, const char *tokenizer_json,
                                lb_comm *world, const lb_parallel_config *pc, char *err,
                                size_t errlen)
{
    lb_backend *be = m->be;
    size_t n = m->nparams;
    float *params = lb_malloc(n * sizeof(float));
    be->download(be, params, m->params, n * sizeof(float));
    const float *host[3] = {params, adam_m, adam_v};
    rank_place me;
    place_of(&me, m, pc, world->size, world->rank);
    float *buf = lb_malloc(3 * largest(m->gtensors, m->nglobal) * sizeof(float));
    int rc = 0;
    if (world->rank != 0) {   // send the pieces this rank writes, in the definition's order
        for (int i = 0; i < me.n; i++) {
            if (!writes(&me, &me.t[i])) continue;
            const lb_tensor *t = &m->tensors[i];
            pack(t, host, buf);
            lb_comm_send(world, buf, 3 * t->numel, LB_F32, 0);
        }
    } else {   // rank 0 puts the whole model together, tensor by tensor, and writes it
        size_t G = m->gparams;
        float *whole = lb_malloc(3 * G * sizeof(float));
        rank_place *all = lb_calloc(world->size, sizeof *all);
        for (int r = 0; r < world->size; r++) place_of(&all[r], m, pc, world->size, r);
        for (int gi = 0; gi < m->nglobal; gi++) {
            const lb_tensor *g = &m->gtensors[gi];
            for (int r = 0; r < world->size; r++) {
                const lb_tensor *p = piece_of(&all[r], gi);
                if (!p || !writes(&all[r], p)) continue;
                if (r == 0) pack(&m->tensors[p - all[0].t], host, buf);
                else lb_comm_recv(world, buf, 3 * p->numel, LB_F32, r);
                for (int b = 0; b < 3; b++)
                    lb_tensor_put(p, buf + b * p->numel, whole + b * G + g->offset);
            }
        }
        rc = save_tables(path, m->gtensors, m->nglobal, whole, whole + G, whole + 2 * G, st,
                         config_ini, tokenizer_json, err, errlen);
        for (int r = 0; r < world->size; r++) free(all[r].t);
        free(all);
        free(whole);
    }
    lb_comm_bcast(world, &rc, sizeof rc, 0);
    if (rc != 0 && world->rank != 0) snprintf(err, errlen, "%s: rank 0 could not write it", path);
    free(buf);
    free(me.t);
    free(params);
    return rc ? -1 : 0;
}

// Rank 0 reads path (the moments too when nb is 3) and sends every rank its pieces: host
// (nb x m->nparams floats, zeroed: padding stays zero) receives this rank's parameters, then the
// moments, laid out as m->params. Collective over world; on -1 every rank returns -1.
static int scatter_pieces(const char *path, lb_model *m, int nb, float *host, lb_train_state *st,
                          lb_comm *world, const lb_parallel_config *pc, char *err, size_t errlen)
{
    size_t n = m->nparams, G = m->gparams;
    float *whole = NULL;
    int rc = 0;
    if (world->rank == 0) {   // rank 0 alone reads and checks the file
        whole = lb_malloc(nb * G * sizeof(float));
        rc = load_tables(path, m->gtensors, m->nglobal, whole, nb == 3 ? whole + G : NULL,
                         nb == 3 ? whole + 2 * G : NULL, G, st, err, errlen);
    }
    lb_comm_bcast(world, &rc, sizeof rc, 0);
    if (rc != 0) {
        if (world->rank != 0) snprintf(err, errlen, "%s: rank 0 could not load it", path);
        free(whole);
        return -1;
    }
    lb_comm_bcast(world, st, sizeof *st, 0);
    float *buf = lb_malloc(nb * largest(m->gtensors, m->nglobal) * sizeof(float));
    if (world->rank != 0) {   // every piece this rank holds, in the definition's order
        for (int i = 0; i < m->ntensors; i++) {
            const lb_tensor *t = &m->tensors[i];
            lb_comm_recv(world, buf, nb * t->numel, LB_F32, 0);
            for (int b = 0; b < nb; b++)
                memcpy(host + b * n + t->offset, buf + b * t->numel, t->numel * sizeof(float));
        }
    } else {
        rank_place *all = lb_calloc(world->size, sizeof *all);
        for (int r = 0; r < world->size; r++) place_of(&all[r], m, pc, world->size, r);
        for (int gi = 0; gi < m->nglobal; gi++) {
            const lb_tensor *g = &m->gtensors[gi];
            for (int r = 0; r < world->size; r++) {
                const lb_tensor *p = piece_of(&all[r], gi);
                if (!p) continue;
                for (int b = 0; b < nb; b++)
                    lb_tensor_take(p, whole + b * G + g->offset, buf + b * p->numel);
                if (r != 0) {
                    lb_comm_send(world, buf, nb * p->numel, LB_F32, r);
                    continue;
                }
                const lb_tensor *t = &m->tensors[p - all[0].t];
                for (int b = 0; b < nb; b++)
                    memcpy(host + b * n + t->offset, buf + b * t->numel, t->numel * sizeof(float));
            }
        }
        for (int r = 0; r < world->size; r++) free(all[r].t);
        free(all);
    }
    free(buf);
    free(whole);
    return 0;
}

int lb_checkpoint_load_parallel(const char *path, lb_model *m, float *adam_m, float *adam_v,
                                lb_train_state *st, lb_comm *world,
                                const lb_parallel_config *pc, char *err, size_t errlen)
{
    lb_backend *be = m->be;
    size_t n = m->nparams;
    float *host = lb_calloc(3 * n, sizeof(float));
    if (scatter_pieces(path, m, 3, host, st, world, pc, err, errlen) != 0) {
        free(host);
        return -1;
    }
    be->upload(be, m->params, host, n * sizeof(float));
    be->upload(be, adam_m, host + n, n * sizeof(float));
    be->upload(be, adam_v, host + 2 * n, n * sizeof(float));
    lb_model_params_changed(m, (uint64_t)st->step);
    free(host);
    return 0;
}

int lb_checkpoint_load_weights(const char *path, lb_model *m, lb_comm *world,
                               const lb_parallel_config *pc, char *err, size_t errlen)
{
    lb_train_state st;
    float *host = lb_calloc(m->nparams, sizeof(float));
    int rc = scatter_pieces(path, m, 1, host, &st, world, pc, err, errlen);
    if (rc == 0) {
        m->be->upload(m->be, m->params, host, m->nparams * sizeof(float));
        lb_model_params_changed(m, (uint64_t)st.step);
    }
    free(host);
    return rc;
}

int lb_checkpoint_latest(const char *dir, char *out, size_t outlen)
{
    char pattern[1024];
    char **list;
    snprintf(pattern, sizeof pattern, "%s/step_*.safetensors", dir);
    int n = lb_glob(pattern, &list);   // zero-padded steps: name order is step order
    snprintf(out, outlen, "%s", n ? list[n - 1] : "");
    lb_glob_free(list, n);
    return 0;
}
