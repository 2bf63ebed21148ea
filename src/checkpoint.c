// checkpoint.c: lowbit checkpoints as safetensors files (see checkpoint.h, doc/checkpoints.md).
#include "src/checkpoint.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kernels/common.h"
#include "src/safetensors.h"
#include "src/util.h"

#define FORMAT "lowbit-checkpoint-1"

static uint32_t crc32_update(uint32_t crc, const void *data, size_t n)
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

static const char *moment_name(char *buf, size_t len, const char *which, const char *name)
{
    snprintf(buf, len, "optimizer.%s.%s", which, name);
    return buf;
}

int lb_checkpoint_save(const char *path, const lb_model *m, const float *adam_m,
                       const float *adam_v, const lb_train_state *st, const char *config_ini,
                       char *err, size_t errlen)
{
    lb_backend *be = m->be;
    size_t bytes = m->nparams * sizeof(float);
    int nbuf = adam_m ? 3 : 1;
    float *host = lb_malloc(bytes * nbuf);
    be->download(be, host, m->params, bytes);
    if (adam_m) {
        be->download(be, host + m->nparams, adam_m, bytes);
        be->download(be, host + 2 * m->nparams, adam_v, bytes);
    }
    // The data section holds the tensors in the order added, without gaps, so its CRC is the
    // CRC of these buffers in this order.
    lb_st_writer *w = lb_st_writer_new();
    static const char *which[3] = {NULL, "exp_avg", "exp_avg_sq"};
    char (*names)[LB_TENSOR_NAME + 32] = lb_malloc(sizeof *names * m->ntensors * nbuf);
    uint32_t crc = 0;
    for (int b = 0; b < nbuf; b++)
        for (int i = 0; i < m->ntensors; i++) {
            const lb_tensor *t = &m->tensors[i];
            const char *name = t->name;
            if (b) name = moment_name(names[b * m->ntensors + i], sizeof names[0], which[b], name);
            const float *data = host + (size_t)b * m->nparams + t->offset;
            lb_st_writer_add(w, name, "F32", t->ndim, t->shape, data);
            crc = crc32_update(crc, data, t->numel * sizeof(float));
        }
    char num[64];
    lb_st_writer_meta(w, "format", FORMAT);
    lb_st_writer_meta(w, "config", config_ini);
    snprintf(num, sizeof num, "%" PRId64, st->step);
    lb_st_writer_meta(w, "step", num);
    snprintf(num, sizeof num, "%" PRId64, st->loader_shard);
    lb_st_writer_meta(w, "loader_shard", num);
    snprintf(num, sizeof num, "%" PRId64, st->loader_pos);
    lb_st_writer_meta(w, "loader_pos", num);
    snprintf(num, sizeof num, "%08x", crc);
    lb_st_writer_meta(w, "crc32", num);
    int rc = lb_st_writer_save(w, path, err, errlen);
    lb_st_writer_free(w);
    free(names);
    free(host);
    return rc;
}

static int open_checkpoint(lb_st_file *f, const char *path, char *err, size_t errlen)
{
    if (lb_st_open(f, path, err, errlen) != 0) return -1;
    const char *fmt = lb_st_meta(f, "format");
    if (!fmt || strcmp(fmt, FORMAT) != 0) {
        snprintf(err, errlen, "%s: not a lowbit checkpoint (metadata format is '%s', expected '%s')",
                 path, fmt ? fmt : "absent", FORMAT);
        lb_st_close(f);
        return -1;
    }
    return 0;
}

char *lb_checkpoint_config(const char *path, char *err, size_t errlen)
{
    lb_st_file f;
    if (open_checkpoint(&f, path, err, errlen) != 0) return NULL;
    const char *cfg = lb_st_meta(&f, "config");
    char *out = cfg ? strdup(cfg) : NULL;
    if (!out) snprintf(err, errlen, "%s: checkpoint has no stored configuration", path);
    lb_st_close(&f);
    return out;
}

static int meta_i64(const lb_st_file *f, const char *key, int64_t *out, char *err, size_t errlen)
{
    const char *s = lb_st_meta(f, key);
    char *end = NULL;
    if (s) *out = strtoll(s, &end, 10);
    if (!s || end == s || *end) {
        snprintf(err, errlen, "%s: metadata '%s' is missing or not an integer", f->path, key);
        return -1;
    }
    return 0;
}

// CRC of the whole data section against the stored one: catches flipped or zeroed bytes that
// still parse.
static int verify_crc(const lb_st_file *f, char *err, size_t errlen)
{
    const char *want = lb_st_meta(f, "crc32");
    if (!want) {
        snprintf(err, errlen, "%s: checkpoint has no crc32", f->path);
        return -1;
    }
    FILE *fp = fopen(f->path, "rb");
    if (!fp || fseek(fp, (long)f->data_offset, SEEK_SET) != 0) {
        snprintf(err, errlen, "%s: cannot read", f->path);
        if (fp) fclose(fp);
        return -1;
    }
    uint32_t crc = 0;
    char buf[1 << 16];
    size_t got;
    while ((got = fread(buf, 1, sizeof buf, fp)) > 0) crc = crc32_update(crc, buf, got);
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

static int load_tensor(const lb_st_file *f, const lb_tensor *t, const char *name, float *host,
                       char *err, size_t errlen)
{
    const lb_st_tensor *s = lb_st_find(f, name);
    if (!s) {
        snprintf(err, errlen, "%s: tensor '%s' is missing (checkpoint of another model?)", f->path,
                 name);
        return -1;
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
        return -1;
    }
    return lb_st_read_f32(f, s, host + t->offset, err, errlen);
}

int lb_checkpoint_load(const char *path, lb_model *m, float *adam_m, float *adam_v,
                       lb_train_state *st, char *err, size_t errlen)
{
    lb_st_file f;
    if (open_checkpoint(&f, path, err, errlen) != 0) return -1;
    int rc = -1;
    size_t bytes = m->nparams * sizeof(float);
    float *host = lb_malloc(bytes);
    char name[LB_TENSOR_NAME + 32];
    lb_train_state s = {0};
    if (verify_crc(&f, err, errlen) != 0) goto out;
    if (meta_i64(&f, "step", &s.step, err, errlen) ||
        meta_i64(&f, "loader_shard", &s.loader_shard, err, errlen) ||
        meta_i64(&f, "loader_pos", &s.loader_pos, err, errlen))
        goto out;
    for (int i = 0; i < m->ntensors; i++)
        if (load_tensor(&f, &m->tensors[i], m->tensors[i].name, host, err, errlen)) goto out;
    if (f.ntensors != m->ntensors && f.ntensors != 3 * m->ntensors) {
        snprintf(err, errlen, "%s: holds %d tensors, the model has %d (checkpoint of another model?)",
                 path, f.ntensors, m->ntensors);
        goto out;
    }
    m->be->upload(m->be, m->params, host, bytes);
    lb_model_params_changed(m, (uint64_t)s.step);
    if (adam_m) {
        static const char *which[2] = {"exp_avg", "exp_avg_sq"};
        float *dst[2] = {adam_m, adam_v};
        const char *first = moment_name(name, sizeof name, which[0], m->tensors[0].name);
        int has = lb_st_find(&f, first) != NULL;
        for (int b = 0; b < 2; b++) {
            if (has) {
                for (int i = 0; i < m->ntensors; i++)
                    if (load_tensor(&f, &m->tensors[i],
                                    moment_name(name, sizeof name, which[b], m->tensors[i].name),
                                    host, err, errlen))
                        goto out;
                m->be->upload(m->be, dst[b], host, bytes);
            } else {
                m->be->zero(m->be, dst[b], bytes);   // imported weights: a fresh optimizer
            }
        }
    }
    if (st) *st = s;
    rc = 0;
out:
    free(host);
    lb_st_close(&f);
    return rc;
}

int lb_checkpoint_save_dp(const char *path, lb_optimizer *o, const lb_train_state *st,
                          const char *config_ini, lb_comm *world, char *err, size_t errlen)
{
    lb_model *m = o->m;
    lb_backend *be = m->be;
    // Every rank gathers (all-gather: NCCL has no gather); only rank 0 writes.
    float *am = be->alloc(be, o->padded * sizeof(float));
    float *av = be->alloc(be, o->padded * sizeof(float));
    lb_optimizer_state_gather(o, am, av);
    int rc = world->rank == 0 ? lb_checkpoint_save(path, m, am, av, st, config_ini, err, errlen) : 0;
    be->free(be, am);
    be->free(be, av);
    return rc;
}

int lb_checkpoint_load_dp(const char *path, lb_optimizer *o, lb_train_state *st, lb_comm *world,
                          char *err, size_t errlen)
{
    lb_model *m = o->m;
    lb_backend *be = m->be;
    lb_comm *dp = o->dp;
    if (world->size > 1 && !dp)
        lb_die("checkpoint: %d ranks, but the optimizer has no data-parallel communicator",
               world->size);
    if (dp && dp->size != world->size)
        lb_die("checkpoint: the data-parallel group (%d ranks) is not the world (%d): loading "
               "under model parallelism is not built yet", dp->size, world->size);
    float *am = be->alloc(be, m->nparams * sizeof(float));
    float *av = be->alloc(be, m->nparams * sizeof(float));
    int rc = world->rank == 0 ? lb_checkpoint_load(path, m, am, av, st, err, errlen) : 0;
    lb_comm_bcast(world, &rc, sizeof rc, 0);
    if (rc == 0 && world->size > 1) {
        lb_comm_bcast(world, st, sizeof *st, 0);
        be->sync(be);
        lb_comm_broadcast(dp, m->params, m->nparams, LB_F32, 0);
        lb_comm_broadcast(dp, am, m->nparams, LB_F32, 0);
        lb_comm_broadcast(dp, av, m->nparams, LB_F32, 0);
        lb_comm_sync(dp);
        lb_model_params_changed(m, (uint64_t)st->step);
    }
    if (rc == 0) lb_optimizer_state_load(o, am, av);
    else if (world->rank != 0) snprintf(err, errlen, "%s: rank 0 could not load it", path);
    be->free(be, am);
    be->free(be, av);
    return rc ? -1 : 0;
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
