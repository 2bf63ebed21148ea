// convert.c: Hugging Face import and export (see convert.h); `lowbit convert` is
// src/cli/convert_cmd.c.
#include "src/io/convert.h"

#include <cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "src/io/json.h"
#include "kernels/common.h"
#include "src/io/safetensors.h"
#include "src/io/tokenizer.h"
#include "src/io/files.h"

// The registry's definition decides which keys a family reads and writes: the shared
// decoder's by its flags (lb_model_def.moe, .rope_scaling), its own by its table
// (.hf_config); lb_hf_read_config has checked that there is one.
static const lb_model_def *def_of(const lb_model_config *c) { return lb_model_lookup(c->arch); }
static int is_moe(const lb_model_config *c) { return def_of(c)->moe; }

// --- config.json -----------------------------------------------------------------------------

static cJSON *read_json(const char *path, char *err, size_t errlen)
{
    size_t len;
    char *text = lb_read_file(path, &len, err, errlen);
    if (!text) return NULL;
    // strict: a duplicate key imports another model than transformers reads (it takes the last)
    cJSON *root = lb_json_parse(text, len, path, 1, err, errlen);
    if (root && !cJSON_IsObject(root)) {
        lb_seterr(err, errlen, "%s: not a JSON object", path);
        cJSON_Delete(root);
        root = NULL;
    }
    free(text);
    return root;
}

// A present, non-null key (null means "use the default" in transformers' configs).
static const cJSON *field(const cJSON *root, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, key);
    return v && !cJSON_IsNull(v) ? v : NULL;
}

// Integer field >= lo; absent: def, or an error when required.
static int get_int(const cJSON *root, const char *key, int required, int def, int lo, int *out,
                   const char *path, char *err, size_t errlen)
{
    const cJSON *v = field(root, key);
    if (!v) {
        if (required) {
            lb_seterr(err, errlen, "%s: missing '%s'", path, key);
            return -1;
        }
        *out = def;
        return 0;
    }
    double d = cJSON_IsNumber(v) ? v->valuedouble : NAN;
    if (!(d >= lo) || d > 2147483647.0 || floor(d) != d) {
        lb_seterr(err, errlen, "%s: '%s' must be an integer >= %d", path, key, lo);
        return -1;
    }
    *out = (int)d;
    return 0;
}

static int get_real(const cJSON *root, const char *key, double def, double *out,
                    const char *path, char *err, size_t errlen)
{
    const cJSON *v = field(root, key);
    if (!v) {
        *out = def;
        return 0;
    }
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) || v->valuedouble < 0) {
        lb_seterr(err, errlen, "%s: '%s' must be a non-negative number", path, key);
        return -1;
    }
    *out = v->valuedouble;
    return 0;
}

static int get_bool(const cJSON *root, const char *key, int def, int *out, const char *path,
                    char *err, size_t errlen)
{
    const cJSON *v = field(root, key);
    if (!v) {
        *out = def;
        return 0;
    }
    if (!cJSON_IsBool(v)) {
        lb_seterr(err, errlen, "%s: '%s' must be true or false", path, key);
        return -1;
    }
    *out = cJSON_IsTrue(v);
    return 0;
}

// Refuses what lowbit's Qwen3 definitions do not compute, so an import never silently changes
// the model. Returns 0, or -1 with the message.
static int check_supported(const cJSON *root, const lb_model_config *cfg, const char *path,
                           char *err, size_t errlen)
{
    int b;
    if (get_bool(root, "use_sliding_window", 0, &b, path, err, errlen)) return -1;
    if (b) {
        lb_seterr(err, errlen, "%s: use_sliding_window = true is not supported (lowbit attends to "
                  "the whole causal context)", path);
        return -1;
    }
    if (get_bool(root, "mlp_bias", 0, &b, path, err, errlen)) return -1;
    if (b) {
        lb_seterr(err, errlen,
                  "%s: mlp_bias = true is not supported (lowbit's MLP projections have no bias)",
                  path);
        return -1;
    }
    const cJSON *v = field(root, "hidden_act");
    if (v && (!cJSON_IsString(v) || strcmp(v->valuestring, "silu") != 0)) {
        lb_seterr(err, errlen, "%s: hidden_act '%s' is not supported (silu only)", path,
                  cJSON_IsString(v) ? v->valuestring : "?");
        return -1;
    }
    double drop;
    if (get_real(root, "attention_dropout", 0.0, &drop, path, err, errlen)) return -1;
    if (drop != 0.0) {
        lb_seterr(err, errlen,
                  "%s: attention_dropout = %g is not supported (lowbit has no dropout)", path,
                  drop);
        return -1;
    }
    const cJSON *lt = field(root, "layer_types"), *e;
    if (lt) {
        int bad = !cJSON_IsArray(lt);
        cJSON_ArrayForEach(e, lt) bad |= !cJSON_IsString(e) || strcmp(e->valuestring,
                                                                      "full_attention") != 0;
        if (bad) {
            lb_seterr(err, errlen, "%s: layer_types other than 'full_attention' are not supported",
                      path);
            return -1;
        }
    }
    if (is_moe(cfg)) {
        int step;
        if (get_int(root, "decoder_sparse_step", 0, 1, 0, &step, path, err, errlen)) return -1;
        if (step != 1) {
            lb_seterr(err, errlen,
                      "%s: decoder_sparse_step = %d is not supported (every layer is a MoE layer "
                      "in lowbit: 1)", path, step);
            return -1;
        }
    }
    return 0;
}

// A list of dense layers (LB_HF_LAYERS, Qwen3-MoE's mlp_only_layers): the leading ones
// 0 .. k-1 only, which is *out = k (dense layers elsewhere are refused); absent: def.
static int get_layers(const cJSON *root, const char *key, int def, int layers, int *out,
                      const char *path, char *err, size_t errlen)
{
    const cJSON *mo = field(root, key), *e;
    if (!mo) {
        *out = def;
        return 0;
    }
    int k = 0, bad = !cJSON_IsArray(mo);
    cJSON_ArrayForEach(e, mo) bad |= !cJSON_IsNumber(e) || e->valuedouble != k++;
    if (bad || k > layers) {
        lb_seterr(err, errlen, "%s: %s must list the leading layers 0, 1, ... in order (dense "
                  "layers after a MoE layer are not supported)", path, key);
        return -1;
    }
    *out = k;
    return 0;
}

// The family's own keys (lb_model_def.hf_config) into their fields, in the table's order.
static int read_family(const cJSON *root, lb_model_config *cfg, const char *path, char *err,
                       size_t errlen)
{
    const lb_model_def *def = def_of(cfg);
    for (int i = 0; i < def->nhf_config; i++) {
        const lb_hf_key *k = &def->hf_config[i];
        if (k->write_only) continue;
        void *f = (char *)cfg + k->offset;
        int rc = 0;
        switch (k->kind) {
        case LB_HF_INT:
            rc = get_int(root, k->name, 0, (int)k->value, k->lo, f, path, err, errlen);
            break;
        case LB_HF_REAL: rc = get_real(root, k->name, k->value, f, path, err, errlen); break;
        case LB_HF_BOOL: rc = get_bool(root, k->name, (int)k->value, f, path, err, errlen); break;
        case LB_HF_LAYERS:
            rc = get_layers(root, k->name, (int)k->value, cfg->num_hidden_layers, f, path, err,
                            errlen);
            break;
        case LB_HF_NULL: break;
        }
        if (rc) return -1;
    }
    char msg[256];
    if (def->hf_check && def->hf_check(cfg, msg, sizeof msg)) {
        lb_seterr(err, errlen, "%s: %s", path, msg);
        return -1;
    }
    return 0;
}

// RoPE's frequencies: rope_scaling (transformers 4) or rope_parameters (transformers 5), each
// with rope_type (or type) "default", or "llama3" with its four numbers where the family takes
// it (lb_model_def.rope_scaling). Anything else is refused: lowbit would compute another model.
static int read_rope(const cJSON *root, lb_model_config *cfg, const char *path, char *err,
                     size_t errlen)
{
    snprintf(cfg->rope_type, sizeof cfg->rope_type, "default");
    const char *keys[2] = {"rope_scaling", "rope_parameters"};
    for (int k = 0; k < 2; k++) {
        const cJSON *rp = field(root, keys[k]);
        if (!rp) continue;
        const cJSON *type = cJSON_IsObject(rp) ? field(rp, "rope_type") : NULL;
        if (cJSON_IsObject(rp) && !type) type = field(rp, "type");
        const char *t = type && cJSON_IsString(type) ? type->valuestring : "?";
        if (!cJSON_IsObject(rp) || (type && !cJSON_IsString(type))) {
            lb_seterr(err, errlen, "%s: %s must be an object with a string rope_type", path,
                      keys[k]);
            return -1;
        }
        if (!type || strcmp(t, "default") == 0) continue;
        if (strcmp(t, "llama3") != 0 || !def_of(cfg)->rope_scaling) {
            lb_seterr(err, errlen, "%s: %s of type '%s' is not supported (rope_type 'default'%s)",
                      path, keys[k], t, def_of(cfg)->rope_scaling ? " or 'llama3'" : "");
            return -1;
        }
        double orig;
        snprintf(cfg->rope_type, sizeof cfg->rope_type, "llama3");
        if (get_real(rp, "factor", 8.0, &cfg->rope_factor, path, err, errlen) ||
            get_real(rp, "low_freq_factor", 1.0, &cfg->rope_low_freq_factor, path, err,
                     errlen) ||
            get_real(rp, "high_freq_factor", 4.0, &cfg->rope_high_freq_factor, path, err,
                     errlen) ||
            get_real(rp, "original_max_position_embeddings", 8192, &orig, path, err, errlen))
            return -1;
        if (orig < 1 || orig > 2147483647.0 || floor(orig) != orig || cfg->rope_factor < 1 ||
            !(cfg->rope_high_freq_factor > cfg->rope_low_freq_factor) ||
            !(cfg->rope_low_freq_factor > 0)) {
            lb_seterr(err, errlen, "%s: %s: llama3 needs factor >= 1, high_freq_factor > "
                      "low_freq_factor > 0 and a positive integer original_max_position_embeddings",
                      path, keys[k]);
            return -1;
        }
        cfg->rope_original_max_position_embeddings = (int)orig;
    }
    return 0;
}

int lb_hf_read_config(const char *dir, lb_model_config *cfg, char *err, size_t errlen)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/config.json", dir);
    cJSON *root = read_json(path, err, errlen);
    if (!root) return -1;
    memset(cfg, 0, sizeof *cfg);
    int rc = -1;
    const cJSON *mt = field(root, "model_type");
    if (!cJSON_IsString(mt)) {
        lb_seterr(err, errlen, "%s: missing 'model_type'", path);
        goto out;
    }
    if (!lb_model_lookup(mt->valuestring)) {
        lb_seterr(err, errlen, "%s: model_type '%s' is not supported (%s)", path, mt->valuestring,
                  lb_model_arch_choices());
        goto out;
    }
    snprintf(cfg->arch, sizeof cfg->arch, "%s", mt->valuestring);
    // Defaults of optional fields are transformers' defaults for these model types.
    if (get_int(root, "vocab_size", 1, 0, 1, &cfg->vocab_size, path, err, errlen) ||
        get_int(root, "hidden_size", 1, 0, 1, &cfg->hidden_size, path, err, errlen) ||
        get_int(root, "num_hidden_layers", 1, 0, 1, &cfg->num_hidden_layers, path, err,
                errlen) ||
        get_int(root, "num_attention_heads", 1, 0, 1, &cfg->num_attention_heads, path, err,
                errlen) ||
        get_int(root, "num_key_value_heads", 0, cfg->num_attention_heads, 1,
                &cfg->num_key_value_heads, path, err, errlen) ||
        get_int(root, "head_dim", 0, cfg->hidden_size / cfg->num_attention_heads, 1,
                &cfg->head_dim, path, err, errlen) ||
        get_int(root, "intermediate_size", !is_moe(cfg), 0, 1, &cfg->intermediate_size, path,
                err, errlen) ||
        get_int(root, "max_position_embeddings", 0, 32768, 1, &cfg->max_position_embeddings,
                path, err, errlen) ||
        get_real(root, "rms_norm_eps", 1e-6, &cfg->rms_norm_eps, path, err, errlen) ||
        get_real(root, "initializer_range", 0.02, &cfg->initializer_range, path, err, errlen) ||
        get_bool(root, "attention_bias", 0, &cfg->attention_bias, path, err, errlen))
        goto out;
    // Keys of other families' routers and layouts, at their neutral values.
    cfg->n_group = cfg->topk_group = 1;
    cfg->routed_scaling_factor = 1.0;
    // rope_theta: top level (transformers 4) or inside rope_parameters (transformers 5).
    const cJSON *rp = field(root, "rope_parameters");
    if (get_real(root, "rope_theta", 10000.0, &cfg->rope_theta, path, err, errlen)) goto out;
    if (cJSON_IsObject(rp) && field(rp, "rope_theta") &&
        get_real(rp, "rope_theta", 10000.0, &cfg->rope_theta, path, err, errlen))
        goto out;
    if (read_rope(root, cfg, path, err, errlen)) goto out;
    // partial_rotary_factor: top level (transformers 4) or inside rope_parameters (5).
    if (get_real(root, "partial_rotary_factor", 1.0, &cfg->partial_rotary_factor, path, err,
                 errlen))
        goto out;
    if (cJSON_IsObject(rp) && field(rp, "partial_rotary_factor") &&
        get_real(rp, "partial_rotary_factor", 1.0, &cfg->partial_rotary_factor, path, err,
                 errlen))
        goto out;
    if (!(cfg->partial_rotary_factor > 0 && cfg->partial_rotary_factor <= 1)) {
        lb_seterr(err, errlen, "%s: partial_rotary_factor (%g) must be in (0, 1]", path,
                  cfg->partial_rotary_factor);
        goto out;
    }
    // The expert count: transformers 5 writes num_local_experts; Qwen's hub checkpoints
    // num_experts, GLM's n_routed_experts. Every MoE family takes each spelling.
    const char *ek = field(root, "num_experts")        ? "num_experts"
                     : field(root, "n_routed_experts") ? "n_routed_experts"
                                                       : "num_local_experts";
    if (is_moe(cfg) &&
        (get_int(root, ek, 1, 0, 1, &cfg->num_experts, path, err, errlen) ||
         get_int(root, "num_experts_per_tok", 1, 0, 1, &cfg->num_experts_per_tok, path, err,
                 errlen) ||
         get_int(root, "moe_intermediate_size", 1, 0, 1, &cfg->moe_intermediate_size, path, err,
                 errlen)))
        goto out;
    if (read_family(root, cfg, path, err, errlen)) goto out;
    if (is_moe(cfg) && cfg->num_experts_per_tok > cfg->num_experts) {
        lb_seterr(err, errlen, "%s: num_experts_per_tok (%d) exceeds the number of experts (%d)",
                  path, cfg->num_experts_per_tok, cfg->num_experts);
        goto out;
    }
    if (cfg->num_attention_heads % cfg->num_key_value_heads != 0) {
        lb_seterr(err, errlen, "%s: num_attention_heads (%d) is not a multiple of "
                  "num_key_value_heads (%d)", path, cfg->num_attention_heads,
                  cfg->num_key_value_heads);
        goto out;
    }
    if (cfg->rms_norm_eps <= 0 || cfg->rope_theta <= 0) {
        lb_seterr(err, errlen, "%s: rms_norm_eps and rope_theta must be positive", path);
        goto out;
    }
    // tie_word_embeddings = true is accepted: lowbit's LM head is always its own tensor, so
    // lb_hf_load copies the embedding into it (training then unties them; export writes them
    // untied).
    int tie;
    if (get_bool(root, "tie_word_embeddings", 0, &tie, path, err, errlen)) goto out;
    rc = check_supported(root, cfg, path, err, errlen);
out:
    cJSON_Delete(root);
    return rc;
}

// --- weights ---------------------------------------------------------------------------------

typedef struct {
    char label[1100];              // the file named when a tensor is missing
    int nfiles;
    lb_st_file *files;
    unsigned char **used;          // per file, per tensor: consumed by the import
} hf_source;

static void source_close(hf_source *s)
{
    for (int i = 0; i < s->nfiles; i++) {
        lb_st_close(&s->files[i]);
        free(s->used[i]);
    }
    free(s->files);
    free(s->used);
    memset(s, 0, sizeof *s);
}

static int source_add(hf_source *s, const char *path, char *err, size_t errlen)
{
    s->files = realloc(s->files, sizeof *s->files * (s->nfiles + 1));
    s->used = realloc(s->used, sizeof *s->used * (s->nfiles + 1));
    if (!s->files || !s->used) lb_die("out of host memory");
    if (lb_st_open(&s->files[s->nfiles], path, err, errlen) != 0) return -1;
    s->used[s->nfiles] = lb_calloc(s->files[s->nfiles].ntensors + 1, 1);
    s->nfiles++;
    return 0;
}

// model.safetensors, or the shards listed by model.safetensors.index.json.
static int source_open(hf_source *s, const char *dir, char *err, size_t errlen)
{
    memset(s, 0, sizeof *s);
    char index[1100], path[1100];
    snprintf(index, sizeof index, "%s/model.safetensors.index.json", dir);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    if (access(index, F_OK) != 0) {
        if (access(path, F_OK) != 0) {
            lb_seterr(err, errlen, "%s: no model.safetensors or model.safetensors.index.json", dir);
            return -1;
        }
        snprintf(s->label, sizeof s->label, "%s", path);
        if (source_add(s, path, err, errlen) == 0) return 0;
        source_close(s);   // the tables source_add grew
        return -1;
    }
    snprintf(s->label, sizeof s->label, "%s", index);
    cJSON *root = read_json(index, err, errlen);
    if (!root) return -1;
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(root, "weight_map"), *e;
    int rc = 0;
    if (!cJSON_IsObject(wm)) {
        lb_seterr(err, errlen, "%s: missing 'weight_map' object", index);
        rc = -1;
    }
    int *which = NULL, n = 0;
    if (rc == 0) {
        which = lb_calloc((size_t)cJSON_GetArraySize(wm) + 1, sizeof *which);
        char (*names)[256] = NULL;
        cJSON_ArrayForEach(e, wm) {
            if (!cJSON_IsString(e) || !e->valuestring[0] || strstr(e->valuestring, "..")) {
                lb_seterr(err, errlen, "%s: weight_map entry '%s' is not a file name", index,
                          e->string);
                rc = -1;
                break;
            }
            int f = 0;
            while (f < s->nfiles && strcmp(names[f], e->valuestring) != 0) f++;
            if (f == s->nfiles) {
                names = realloc(names, sizeof *names * (s->nfiles + 1));
                if (!names) lb_die("out of host memory");
                snprintf(names[f], sizeof names[f], "%s", e->valuestring);
                snprintf(path, sizeof path, "%s/%s", dir, e->valuestring);
                if (source_add(s, path, err, errlen) != 0) {
                    rc = -1;
                    break;
                }
            }
            which[n++] = f;
        }
        free(names);
    }
    // Every entry must be in the shard the index names.
    int i = 0;
    if (rc == 0) cJSON_ArrayForEach(e, wm) {
        if (!lb_st_find(&s->files[which[i]], e->string)) {
            lb_seterr(err, errlen, "%s: weight_map puts tensor '%s' in %s, which does not hold it",
                      index, e->string, s->files[which[i]].path);
            rc = -1;
            break;
        }
        i++;
    }
    free(which);
    cJSON_Delete(root);
    if (rc != 0) source_close(s);
    return rc;
}

static const lb_st_tensor *source_find(const hf_source *s, const char *name, int *file)
{
    for (int i = 0; i < s->nfiles; i++) {
        const lb_st_tensor *t = lb_st_find(&s->files[i], name);
        if (t) {
            *file = i;
            return t;
        }
    }
    return NULL;
}

static void shape_str(char *buf, size_t len, int ndim, const int64_t *shape)
{
    size_t n = (size_t)snprintf(buf, len, "[");
    for (int d = 0; d < ndim && n < len; d++)
        n += (size_t)snprintf(buf + n, len - n, "%s%lld", d ? ", " : "", (long long)shape[d]);
    if (n < len) snprintf(buf + n, len - n, "]");
}

// Reads tensor `name` of shape (ndim, shape) into out. Returns 0, 1 when absent (the caller
// decides whether that is an error), or -1 with the message.
static int source_read(hf_source *s, const char *name, int ndim, const int64_t *shape,
                       float *out, char *err, size_t errlen)
{
    int fi;
    const lb_st_tensor *t = source_find(s, name, &fi);
    if (!t) return 1;
    lb_st_file *f = &s->files[fi];
    int same = t->ndim == ndim;
    for (int d = 0; same && d < ndim; d++) same = t->shape[d] == shape[d];
    if (!same) {
        char a[128], b[128];
        shape_str(a, sizeof a, t->ndim, t->shape);
        shape_str(b, sizeof b, ndim, shape);
        lb_seterr(err, errlen, "%s: tensor '%s' has shape %s, the configuration needs %s", f->path,
                  name, a, b);
        return -1;
    }
    if (lb_st_read_f32(f, t, out, err, errlen) != 0) return -1;
    s->used[fi][t - f->tensors] = 1;
    return 0;
}

static int missing(const hf_source *s, const char *name, const char *alt, char *err,
                   size_t errlen)
{
    if (alt)
        lb_seterr(err, errlen, "%s: missing tensor '%s' (or the fused '%s')", s->label, name, alt);
    else
        lb_seterr(err, errlen, "%s: missing tensor '%s'", s->label, name);
    return -1;
}

// 1 when name is exactly pattern (one %d: the layer) for some layer.
static int match(const char *name, const char *pattern, int *layer)
{
    int end = -1;
    char fmt[128];
    snprintf(fmt, sizeof fmt, "%s%%n", pattern);
    return sscanf(name, fmt, layer, &end) == 1 && end >= 0 && name[end] == 0;
}

#define LB_EXPERTS_GATE_UP "model.layers.%d.mlp.experts.gate_up_proj"
#define LB_EXPERTS_DOWN "model.layers.%d.mlp.experts.down_proj"

// A fused dense gate/up weight (a layer's MLP, the shared experts' MLP): *pre gets the name
// without "gate_up_proj.weight", the hub's gate_proj and up_proj sit under the same prefix.
static int fused_mlp(const char *name, char *pre, size_t len)
{
    const char *suf = "gate_up_proj.weight";
    size_t n = strlen(name), k = strlen(suf);
    if (n <= k || strcmp(name + n - k, suf) != 0 || n - k >= len) return 0;
    memcpy(pre, name, n - k);
    pre[n - k] = 0;
    return 1;
}

// One lowbit tensor from the files. Fused SwiGLU tensors come from either the fused tensor or
// the separate gate/up (and per-expert) tensors; gate rows go first, as in transformers.
static int load_one(hf_source *s, const lb_tensor *t, int tie, float *buf, char *err,
                    size_t errlen)
{
    int layer;
    char name[LB_TENSOR_NAME + 64];
    if (match(t->name, LB_EXPERTS_GATE_UP, &layer)) {
        int rc = source_read(s, t->name, 3, t->shape, buf, err, errlen);
        if (rc <= 0) return rc;
        int64_t E = t->shape[0], F = t->shape[1] / 2, C = t->shape[2], sh[2] = {F, C};
        for (int64_t e = 0; e < E; e++) {
            for (int half = 0; half < 2; half++) {
                snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%lld.%s.weight", layer,
                         (long long)e, half ? "up_proj" : "gate_proj");
                rc = source_read(s, name, 2, sh, buf + (e * 2 + half) * F * C, err, errlen);
                if (rc < 0) return -1;
                if (rc > 0) return missing(s, name, t->name, err, errlen);
            }
        }
        return 0;
    }
    if (match(t->name, LB_EXPERTS_DOWN, &layer)) {
        int rc = source_read(s, t->name, 3, t->shape, buf, err, errlen);
        if (rc <= 0) return rc;
        int64_t E = t->shape[0], C = t->shape[1], F = t->shape[2], sh[2] = {C, F};
        for (int64_t e = 0; e < E; e++) {
            snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%lld.down_proj.weight",
                     layer, (long long)e);
            rc = source_read(s, name, 2, sh, buf + e * C * F, err, errlen);
            if (rc < 0) return -1;
            if (rc > 0) return missing(s, name, t->name, err, errlen);
        }
        return 0;
    }
    char pre[LB_TENSOR_NAME];
    if (fused_mlp(t->name, pre, sizeof pre)) {
        int rc = source_read(s, t->name, 2, t->shape, buf, err, errlen);
        if (rc <= 0) return rc;
        int64_t F = t->shape[0] / 2, C = t->shape[1], sh[2] = {F, C};
        for (int half = 0; half < 2; half++) {
            snprintf(name, sizeof name, "%s%s.weight", pre, half ? "up_proj" : "gate_proj");
            rc = source_read(s, name, 2, sh, buf + half * F * C, err, errlen);
            if (rc < 0) return -1;
            if (rc > 0) return missing(s, name, t->name, err, errlen);
        }
        return 0;
    }
    if (tie && strcmp(t->name, "lm_head.weight") == 0) {
        // Tied: transformers ignores a stored lm_head and uses the embedding.
        int fi;
        const lb_st_tensor *lm = source_find(s, t->name, &fi);
        if (lm) s->used[fi][lm - s->files[fi].tensors] = 1;
        int rc = source_read(s, "model.embed_tokens.weight", t->ndim, t->shape, buf, err, errlen);
        return rc > 0 ? missing(s, "model.embed_tokens.weight", NULL, err, errlen) : rc;
    }
    int rc = source_read(s, t->name, t->ndim, t->shape, buf, err, errlen);
    return rc > 0 ? missing(s, t->name, NULL, err, errlen) : rc;
}

int lb_hf_load(lb_model *m, const char *dir, char *err, size_t errlen)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/config.json", dir);
    cJSON *root = read_json(path, err, errlen);
    if (!root) return -1;
    int tie;
    int rc = get_bool(root, "tie_word_embeddings", 0, &tie, path, err, errlen);
    cJSON_Delete(root);
    if (rc) return -1;

    hf_source s;
    if (source_open(&s, dir, err, errlen) != 0) return -1;
    // One tensor at a time through a host buffer, so the host never holds the whole model.
    size_t most = 1;
    for (int i = 0; i < m->ntensors; i++)
        if (m->tensors[i].numel > most) most = m->tensors[i].numel;
    float *buf = lb_malloc(most * sizeof(float));
    for (int i = 0; i < m->ntensors && rc == 0; i++) {
        const lb_tensor *t = &m->tensors[i];
        rc = load_one(&s, t, tie, buf, err, errlen);
        if (rc == 0) m->be->upload(m->be, m->params + t->offset, buf, t->numel * sizeof(float));
    }
    free(buf);
    lb_model_params_changed(m, 0);
    // Every tensor of the files must have been used: an extra one means the configuration
    // describes another model (more layers, another layout), never something to skip.
    for (int f = 0; f < s.nfiles && rc == 0; f++) {
        for (int i = 0; i < s.files[f].ntensors; i++) {
            const char *name = s.files[f].tensors[i].name;
            size_t n = strlen(name), suf = strlen(".rotary_emb.inv_freq");
            // Older exports carry RoPE's inverse frequencies as a buffer; lowbit recomputes them.
            if (n > suf && strcmp(name + n - suf, ".rotary_emb.inv_freq") == 0) continue;
            if (!s.used[f][i]) {
                lb_seterr(err, errlen, "%s: unexpected tensor '%s' (not part of a %s model with "
                          "this config.json)", s.files[f].path, name, m->cfg.arch);
                rc = -1;
                break;
            }
        }
    }
    source_close(&s);
    return rc;
}

// --- export ----------------------------------------------------------------------------------

// A JSON number that reads back as the same double and stays a float in Python ("10000.0").
static cJSON *json_real(double x)
{
    char buf[64];
    if (x == floor(x) && fabs(x) < 1e15) {     // whole numbers as "10000.0", not "1e+04"
        snprintf(buf, sizeof buf, "%.1f", x);
        return cJSON_CreateRaw(buf);
    }
    for (int p = 1; p <= 17; p++) {
        snprintf(buf, sizeof buf, "%.*g", p, x);
        if (strtod(buf, NULL) == x) break;
    }
    if (!strpbrk(buf, ".eEn")) strcat(buf, ".0");
    return cJSON_CreateRaw(buf);
}

// config.json's top level as export builds it: the shared keys in order, each followed by the
// family's keys placed after it (lb_hf_key.after).
typedef struct {
    cJSON *root;
    const lb_model_def *def;
    const lb_model_config *c;
} json_out;

// A family key's value: its field's, or the constant's.
static cJSON *family_value(const lb_hf_key *k, const lb_model_config *c)
{
    const void *f = (const char *)c + k->offset;
    int field = k->offset != LB_HF_NO_FIELD;
    double v = !field ? k->value : k->kind == LB_HF_REAL ? *(const double *)f : *(const int *)f;
    switch (k->kind) {
    case LB_HF_INT: return cJSON_CreateNumber(v);
    case LB_HF_REAL: return json_real(v);
    case LB_HF_BOOL: return cJSON_CreateBool(v != 0);
    case LB_HF_LAYERS: {
        cJSON *a = cJSON_CreateArray();
        for (int l = 0; l < (int)v; l++) cJSON_AddItemToArray(a, cJSON_CreateNumber(l));
        return a;
    }
    case LB_HF_NULL: break;
    }
    return cJSON_CreateNull();
}

// Adds key, then the run of family keys that names it as theirs to follow.
static void put(json_out *o, const char *key, cJSON *item)
{
    cJSON_AddItemToObject(o->root, key, item);
    const lb_hf_key *t = o->def->hf_config;
    for (int i = 0; i < o->def->nhf_config; i++) {
        if (!t[i].after || strcmp(t[i].after, key) != 0) continue;
        for (int j = i; j < o->def->nhf_config && (j == i || !t[j].after); j++)
            put(o, t[j].name, family_value(&t[j], o->c));
    }
}

static char *config_json(const lb_model_config *c, const char *torch_dtype)
{
    const lb_model_def *def = def_of(c);
    int llama3 = strcmp(c->rope_type, "llama3") == 0;
    int partial = c->partial_rotary_factor > 0 && c->partial_rotary_factor < 1;
    json_out o = {cJSON_CreateObject(), def, c};
    cJSON *arch = cJSON_CreateArray();
    cJSON_AddItemToArray(arch, cJSON_CreateString(def->hf_architecture));
    put(&o, "architectures", arch);
    put(&o, "model_type", cJSON_CreateString(c->arch));
    put(&o, "vocab_size", cJSON_CreateNumber(c->vocab_size));
    put(&o, "hidden_size", cJSON_CreateNumber(c->hidden_size));
    put(&o, "intermediate_size", cJSON_CreateNumber(c->intermediate_size));
    put(&o, "num_hidden_layers", cJSON_CreateNumber(c->num_hidden_layers));
    put(&o, "num_attention_heads", cJSON_CreateNumber(c->num_attention_heads));
    put(&o, "num_key_value_heads", cJSON_CreateNumber(c->num_key_value_heads));
    put(&o, "head_dim", cJSON_CreateNumber(c->head_dim));
    put(&o, "hidden_act", cJSON_CreateString("silu"));
    put(&o, "max_position_embeddings", cJSON_CreateNumber(c->max_position_embeddings));
    put(&o, "initializer_range", json_real(c->initializer_range));
    put(&o, "rms_norm_eps", json_real(c->rms_norm_eps));
    // rope_theta at the top level for transformers 4, rope_parameters for transformers 5.
    // The same parameters in both places (rope_scaling null for plain RoPE).
    put(&o, "rope_theta", json_real(c->rope_theta));
    for (int k = 0; k < 2; k++) {
        if (k == 0 && !llama3) {
            put(&o, "rope_scaling", cJSON_CreateNull());
            continue;
        }
        cJSON *rp = cJSON_CreateObject();
        cJSON_AddStringToObject(rp, "rope_type", llama3 ? "llama3" : "default");
        cJSON_AddItemToObject(rp, "rope_theta", json_real(c->rope_theta));
        if (partial)
            cJSON_AddItemToObject(rp, "partial_rotary_factor", json_real(c->partial_rotary_factor));
        if (llama3) {
            cJSON_AddItemToObject(rp, "factor", json_real(c->rope_factor));
            cJSON_AddItemToObject(rp, "low_freq_factor", json_real(c->rope_low_freq_factor));
            cJSON_AddItemToObject(rp, "high_freq_factor", json_real(c->rope_high_freq_factor));
            cJSON_AddNumberToObject(rp, "original_max_position_embeddings",
                                    c->rope_original_max_position_embeddings);
        }
        put(&o, k ? "rope_parameters" : "rope_scaling", rp);
    }
    if (partial) put(&o, "partial_rotary_factor", json_real(c->partial_rotary_factor));
    put(&o, "attention_bias", cJSON_CreateBool(c->attention_bias));
    put(&o, "attention_dropout", json_real(0.0));
    put(&o, "tie_word_embeddings", cJSON_CreateFalse());
    put(&o, "use_cache", cJSON_CreateTrue());
    if (def->moe) {   // the expert count is the family's: its spelling
        put(&o, "num_experts_per_tok", cJSON_CreateNumber(c->num_experts_per_tok));
        put(&o, "moe_intermediate_size", cJSON_CreateNumber(c->moe_intermediate_size));
        put(&o, "output_router_logits", cJSON_CreateFalse());
    }
    put(&o, "torch_dtype", cJSON_CreateString(torch_dtype));   // transformers 4
    put(&o, "dtype", cJSON_CreateString(torch_dtype));         // transformers 5
    // a family key placed after a key this export lacks would be lost without a word
    for (int i = 0; i < def->nhf_config; i++)
        if (!cJSON_GetObjectItemCaseSensitive(o.root, def->hf_config[i].name))
            lb_die("%s's config.json key '%s' is placed after a key export does not write",
                   def->arch, def->hf_config[i].name);
    char *s = cJSON_Print(o.root);
    cJSON_Delete(o.root);
    return s;
}

// dir/name holding text (and a newline when nl), written atomically.
static int write_text(const char *dir, const char *name, const char *text, int nl, char *err,
                      size_t errlen)
{
    char path[1100];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    lb_atomic_file a;
    if (lb_atomic_open(&a, path, err, errlen) != 0) return -1;
    if (fputs(text, a.f) == EOF || (nl && fputc('\n', a.f) == EOF)) {
        lb_seterr(err, errlen, "%s: write failed: %s", path, strerror(errno));
        lb_atomic_abort(&a);
        return -1;
    }
    return lb_atomic_commit(&a, err, errlen);
}

// The text of generation_config.json for a tokenizer.json: the ids `transformers` generates
// with: eos_token_id, the end-of-text token (where generate() stops), and bos_token_id where
// the tokenizer has one (lb_tokenizer_eot, lb_tokenizer_bos). NULL for a bad tokenizer.
static char *generation_config(const char *dir, const char *json, char *err, size_t errlen)
{
    char path[1100];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    lb_tokenizer *t = lb_tokenizer_parse(json, path, err, errlen);
    if (!t) return NULL;
    int bos = lb_tokenizer_bos(t), eos = lb_tokenizer_eot(t);
    lb_tokenizer_free(t);
    cJSON *g = cJSON_CreateObject();
    if (bos >= 0) cJSON_AddNumberToObject(g, "bos_token_id", bos);
    if (eos >= 0) cJSON_AddNumberToObject(g, "eos_token_id", eos);
    char *text = cJSON_Print(g);
    cJSON_Delete(g);
    return text;
}

int lb_hf_export(const lb_model *m, const char *dir, const char *dtype,
                 const char *tokenizer_json, char *err, size_t errlen)
{
    const char *st_dtype, *torch_dtype;
    if (strcasecmp(dtype, "f32") == 0) {
        st_dtype = "F32";
        torch_dtype = "float32";
    } else if (strcasecmp(dtype, "bf16") == 0) {
        st_dtype = "BF16";
        torch_dtype = "bfloat16";
    } else {
        lb_seterr(err, errlen, "%s: export dtype '%s' is not supported (f32, bf16)", dir, dtype);
        return -1;
    }
    char *gen = NULL;   // checked before anything is written
    if (tokenizer_json && !(gen = generation_config(dir, tokenizer_json, err, errlen))) return -1;
    lb_dirs_made made;
    if (lb_mkdirs_made(dir, &made, err, errlen) != 0) {
        free(gen);
        return -1;
    }
    float *host = lb_malloc(m->nparams * sizeof(float));
    m->be->download(m->be, host, m->params, m->nparams * sizeof(float));

    // Fused lowbit tensors become the hub's separate tensors (views into host, no copies).
    int E = m->cfg.num_experts, cap = 0;
    for (int i = 0; i < m->ntensors; i++) cap += 2 + 2 * (E > 0 ? E : 1);
    char (*names)[LB_TENSOR_NAME + 64] = lb_malloc(sizeof *names * cap);
    int n = 0;
    lb_st_writer *w = lb_st_writer_new();
    for (int i = 0; i < m->ntensors; i++) {
        const lb_tensor *t = &m->tensors[i];
        const float *p = host + t->offset;
        int layer;
        char pre[LB_TENSOR_NAME];
        if (match(t->name, LB_EXPERTS_GATE_UP, &layer)) {
            int64_t F = t->shape[1] / 2, C = t->shape[2], sh[2] = {F, C};
            for (int64_t e = 0; e < t->shape[0]; e++)
                for (int half = 0; half < 2; half++) {
                    snprintf(names[n], sizeof names[n],
                             "model.layers.%d.mlp.experts.%lld.%s.weight", layer, (long long)e,
                             half ? "up_proj" : "gate_proj");
                    lb_st_writer_add(w, names[n++], st_dtype, 2, sh, p + (e * 2 + half) * F * C);
                }
        } else if (match(t->name, LB_EXPERTS_DOWN, &layer)) {
            int64_t C = t->shape[1], F = t->shape[2], sh[2] = {C, F};
            for (int64_t e = 0; e < t->shape[0]; e++) {
                snprintf(names[n], sizeof names[n],
                         "model.layers.%d.mlp.experts.%lld.down_proj.weight", layer, (long long)e);
                lb_st_writer_add(w, names[n++], st_dtype, 2, sh, p + e * C * F);
            }
        } else if (fused_mlp(t->name, pre, sizeof pre)) {
            int64_t F = t->shape[0] / 2, C = t->shape[1], sh[2] = {F, C};
            for (int half = 0; half < 2; half++) {
                snprintf(names[n], sizeof names[n], "%s%s.weight", pre,
                         half ? "up_proj" : "gate_proj");
                lb_st_writer_add(w, names[n++], st_dtype, 2, sh, p + half * F * C);
            }
        } else {
            lb_st_writer_add(w, t->name, st_dtype, t->ndim, t->shape, p);
        }
    }
    lb_st_writer_meta(w, "format", "pt");
    char path[1100];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    int rc = lb_st_writer_save(w, path, err, errlen);
    lb_st_writer_free(w);
    free(names);
    free(host);
    // config.json last: a directory without it is not mistaken for a complete export.
    static const char *const files[] = {"model.safetensors", "tokenizer.json",
                                        "generation_config.json", "config.json"};
    int done = rc == 0;
    if (rc == 0 && tokenizer_json) {
        rc = write_text(dir, files[1], tokenizer_json, 0, err, errlen);   // verbatim
        done += rc == 0;
        if (rc == 0) rc = write_text(dir, files[2], gen, 1, err, errlen);
        done += rc == 0;
    }
    if (rc == 0) {
        char *json = config_json(&m->cfg, torch_dtype);
        rc = write_text(dir, files[3], json, 1, err, errlen);
        free(json);
    }
    free(gen);
    if (rc != 0) {   // a failed export (a full disk) leaves no part of itself (2026-12-07)
        char path[1100];
        for (int i = 0; i < done; i++) {
            snprintf(path, sizeof path, "%s/%s", dir, files[i]);
            unlink(path);
        }
        lb_dirs_unmake(&made);
    }
    return rc;
}
