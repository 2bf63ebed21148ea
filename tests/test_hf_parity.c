// test_hf_parity.c: Hugging Face parity and conversion. The tiny random Qwen3-MoE, Qwen3 and
// Llama (llama3 RoPE scaling) models in tests/data (made by tests/tools/make_hf_golden.py with
// transformers) are imported
// and must give transformers' logits, loss (cross-entropy + per-layer Switch loss) and
// gradients; export and re-import are exact; both expert layouts, sharded checkpoints and
// tied embeddings import; bad inputs fail with messages naming the file.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <ftw.h>

#include "kernels/common.h"
#include "src/io/checkpoint.h"
#include "src/cli/commands.h"
#include "src/cli/config.h"
#include "src/io/convert.h"
#include "src/io/safetensors.h"
#include "src/io/files.h"
#include "tests/testutil.h"

static lb_backend *be;

static void setup(void)
{
    char err[256];
    be = lb_backend_cpu_create(0, err, sizeof err);
    ck_assert_msg(be != NULL, "%s", err);
}

static void teardown(void) { be->destroy(be); }

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
    return remove(p);
}

static void rm_rf(const char *dir) { nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS); }

static const char *tmpdir_copy(char *buf, size_t n)
{
    snprintf(buf, n, "%s", lb_test_tmpdir());
    return buf;
}

// Imports an HF directory; fails the test with the message on error.
static lb_model *import(const char *dir)
{
    char err[1024];
    lb_model_config cfg;
    ck_assert_msg(lb_hf_read_config(dir, &cfg, err, sizeof err) == 0, "%s", err);
    lb_model *m = lb_model_create(&cfg, be, err, sizeof err);
    ck_assert_msg(m != NULL, "%s", err);
    ck_assert_msg(lb_hf_load(m, dir, err, sizeof err) == 0, "%s", err);
    return m;
}

static float *params_of(const lb_model *m)
{
    float *p = lb_malloc(m->nparams * sizeof(float));
    m->be->download(m->be, p, m->params, m->nparams * sizeof(float));
    return p;
}

static void assert_same_params(const lb_model *a, const lb_model *b, const char *what)
{
    ck_assert_uint_eq(a->nparams, b->nparams);
    float *pa = params_of(a), *pb = params_of(b);
    for (int i = 0; i < a->ntensors; i++) {
        const lb_tensor *t = &a->tensors[i];
        ck_assert_msg(memcmp(pa + t->offset, pb + t->offset, t->numel * sizeof(float)) == 0,
                      "%s: tensor %s differs", what, t->name);
    }
    free(pa);
    free(pb);
}

static float *golden_read(const lb_st_file *g, const char *name, int64_t *numel)
{
    char err[512];
    const lb_st_tensor *t = lb_st_find(g, name);
    ck_assert_msg(t != NULL, "%s: no tensor %s", g->path, name);
    float *x = lb_malloc((size_t)lb_st_numel(t) * sizeof(float) + 1);
    ck_assert_msg(lb_st_read_f32(g, t, x, err, sizeof err) == 0, "%s", err);
    if (numel) *numel = lb_st_numel(t);
    return x;
}

// max |a - ref| / max |ref|; NaN never passes (it yields NaN or inf here).
static double rel_err(const float *a, const float *ref, size_t n)
{
    double diff = 0, scale = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - ref[i]);
        if (!(d <= diff)) diff = d;     // also takes NaN
        if (fabs(ref[i]) > scale) scale = fabs(ref[i]);
    }
    return diff / scale;
}

static void parity(const char *sub, int moe, int want_grads)
{
    char gpath[1024], err[1024];
    const char *dir = lb_test_src(sub);
    lb_model *m = import(dir);
    snprintf(gpath, sizeof gpath, "%s/golden.safetensors", dir);
    lb_st_file g;
    ck_assert_msg(lb_st_open(&g, gpath, err, sizeof err) == 0, "%s", err);
    int64_t n;
    float *ftok = golden_read(&g, "tokens", &n), *ftgt = golden_read(&g, "targets", NULL);
    const lb_st_tensor *tt = lb_st_find(&g, "tokens");
    int b = (int)tt->shape[0], t = (int)tt->shape[1];
    int32_t *tok = lb_malloc(n * sizeof(int32_t)), *tgt = lb_malloc(n * sizeof(int32_t));
    int ignored = 0;
    for (int64_t i = 0; i < n; i++) {
        tok[i] = (int32_t)ftok[i];
        tgt[i] = (int32_t)ftgt[i];
        ignored += tgt[i] < 0;
    }
    ck_assert_int_gt(ignored, 0);        // the golden batch exercises ignored targets

    float loss = lb_model_forward(m, tok, tgt, b, t);
    int64_t nlog;
    float *ref_logits = golden_read(&g, "logits", &nlog);
    ck_assert_int_eq(nlog, (int64_t)b * t * m->cfg.vocab_size);
    float *logits = lb_malloc(nlog * sizeof(float));
    be->download(be, logits, m->logits, nlog * sizeof(float));
    double e_logits = rel_err(logits, ref_logits, nlog);
    float *ref_loss = golden_read(&g, "loss", NULL), *ref_ce = golden_read(&g, "ce", NULL);
    double e_loss = fabs(loss - ref_loss[0]) / fabs(ref_loss[0]);
    double e_ce = fabs(m->ce_loss - ref_ce[0]) / fabs(ref_ce[0]);
    printf("%s: logits rel err %.3g, loss %.7f (ref %.7f) rel err %.3g, ce rel err %.3g", sub,
           e_logits, loss, ref_loss[0], e_loss, e_ce);
    ck_assert_int_eq(m->ntokens, (int)(n - ignored));
    ck_assert_msg(e_logits <= 1e-5, "%s: logits differ: %.3g", sub, e_logits);
    ck_assert_msg(e_ce <= 1e-5, "%s: ce %.8g vs %.8g", sub, m->ce_loss, ref_ce[0]);
    ck_assert_msg(e_loss <= 1e-5, "%s: loss %.8g vs %.8g", sub, loss, ref_loss[0]);
    if (moe) {
        float *ref_aux = golden_read(&g, "aux", NULL);
        double e_aux = fabs(m->aux_loss - ref_aux[0]) / fabs(ref_aux[0]);
        printf(", aux %.7f (ref %.7f) rel err %.3g", m->aux_loss, ref_aux[0], e_aux);
        ck_assert_msg(e_aux <= 1e-5, "%s: aux %.8g vs %.8g", sub, m->aux_loss, ref_aux[0]);
        // The aux term must matter in the loss for the comparison to test it.
        ck_assert(m->cfg.router_aux_loss_coef * ref_aux[0] > 100 * 1e-5 * ref_loss[0]);
        free(ref_aux);
    }
    printf("\n");

    lb_model_zero_grad(m);
    lb_model_backward(m, 1.0f);
    float *grads = lb_malloc(m->nparams * sizeof(float));
    be->download(be, grads, m->grads, m->nparams * sizeof(float));
    int compared = 0;
    double worst = 0;
    for (int i = 0; i < g.ntensors; i++) {
        const char *name = g.tensors[i].name;
        if (strncmp(name, "grad.", 5) != 0) continue;
        const lb_tensor *pt = lb_model_find(m, name + 5);
        ck_assert_msg(pt != NULL, "golden gradient of unknown tensor %s", name + 5);
        int64_t gn;
        float *ref = golden_read(&g, name, &gn);
        ck_assert_int_eq(gn, (int64_t)pt->numel);
        double e = rel_err(grads + pt->offset, ref, pt->numel);
        printf("  %-48s grad rel err %.3g\n", name + 5, e);
        ck_assert_msg(e <= 1e-4, "%s: gradient of %s differs: rel err %.3g", sub, name + 5, e);
        if (e > worst) worst = e;
        compared++;
        free(ref);
    }
    ck_assert_int_ge(compared, want_grads);
    printf("%s: %d gradients, worst rel err %.3g\n", sub, compared, worst);
    free(grads);
    free(ref_loss);
    free(ref_ce);
    free(logits);
    free(ref_logits);
    free(tok);
    free(tgt);
    free(ftok);
    free(ftgt);
    lb_st_close(&g);
    lb_model_free(m);
}

START_TEST(test_parity_moe) { parity("tests/data/hf_qwen3_moe", 1, 12); }
END_TEST

START_TEST(test_parity_dense) { parity("tests/data/hf_qwen3", 0, 10); }
END_TEST

START_TEST(test_parity_llama) { parity("tests/data/hf_llama", 0, 12); }
END_TEST

// GLM-4.5's MoE: no aux loss (moe 0: loss = ce); gradients of the dense layer, the biases, the
// q/k norm, both routers, the experts and the shared experts.
START_TEST(test_parity_glm4_moe) { parity("tests/data/hf_glm4_moe", 0, 18); }
END_TEST

// Export then import gives the same parameters bit for bit (F32), the hub's per-expert layout,
// and for BF16 exactly the parameters rounded to nearest even.
static void export_roundtrip(const char *sub)
{
    char tmp[256], out[512], path[600], err[1024];
    tmpdir_copy(tmp, sizeof tmp);
    snprintf(out, sizeof out, "%s/export/f32", tmp);   // created by the export
    lb_model *m = import(lb_test_src(sub));
    ck_assert_msg(lb_hf_export(m, out, "f32", NULL, err, sizeof err) == 0, "%s", err);
    lb_model *r = import(out);
    assert_same_params(m, r, "f32 export");
    ck_assert_str_eq(r->cfg.arch, m->cfg.arch);
    ck_assert_int_eq(r->cfg.vocab_size, m->cfg.vocab_size);
    ck_assert_int_eq(r->cfg.num_key_value_heads, m->cfg.num_key_value_heads);
    ck_assert_int_eq(r->cfg.head_dim, m->cfg.head_dim);
    ck_assert_int_eq(r->cfg.num_experts, m->cfg.num_experts);
    ck_assert_int_eq(r->cfg.num_experts_per_tok, m->cfg.num_experts_per_tok);
    ck_assert_int_eq(r->cfg.norm_topk_prob, m->cfg.norm_topk_prob);
    ck_assert_int_eq(r->cfg.max_position_embeddings, m->cfg.max_position_embeddings);
    ck_assert(r->cfg.rope_theta == m->cfg.rope_theta);
    ck_assert(r->cfg.rms_norm_eps == m->cfg.rms_norm_eps);
    ck_assert(r->cfg.router_aux_loss_coef == m->cfg.router_aux_loss_coef);
    ck_assert(r->cfg.initializer_range == m->cfg.initializer_range);
    ck_assert_str_eq(r->cfg.rope_type, m->cfg.rope_type);
    ck_assert(r->cfg.rope_factor == m->cfg.rope_factor);
    ck_assert(r->cfg.rope_low_freq_factor == m->cfg.rope_low_freq_factor);
    ck_assert(r->cfg.rope_high_freq_factor == m->cfg.rope_high_freq_factor);
    ck_assert_int_eq(r->cfg.rope_original_max_position_embeddings,
                     m->cfg.rope_original_max_position_embeddings);
    ck_assert_int_eq(r->cfg.first_k_dense_replace, m->cfg.first_k_dense_replace);
    ck_assert_int_eq(r->cfg.n_shared_experts, m->cfg.n_shared_experts);
    ck_assert_int_eq(r->cfg.n_group, m->cfg.n_group);
    ck_assert_int_eq(r->cfg.topk_group, m->cfg.topk_group);
    ck_assert(r->cfg.routed_scaling_factor == m->cfg.routed_scaling_factor);
    ck_assert_int_eq(r->cfg.attention_bias, m->cfg.attention_bias);
    ck_assert_int_eq(r->cfg.use_qk_norm, m->cfg.use_qk_norm);
    ck_assert(r->cfg.partial_rotary_factor == m->cfg.partial_rotary_factor);
    lb_model_free(r);

    // config.json's text: the shared keys and the family's own (lb_model_def.hf_config) in
    // their spellings and order, as tests/data/hf_export/ARCH.json keeps them
    char want[256];
    snprintf(want, sizeof want, "tests/data/hf_export/%s.json", m->cfg.arch);
    snprintf(path, sizeof path, "%s/config.json", out);
    char *a = lb_read_file(lb_test_src(want), NULL, err, sizeof err);
    ck_assert_msg(a != NULL, "%s", err);
    char *b = lb_read_file(path, NULL, err, sizeof err);
    ck_assert_msg(b != NULL, "%s", err);
    ck_assert_str_eq(b, a);
    free(a);
    free(b);

    snprintf(path, sizeof path, "%s/model.safetensors", out);
    lb_st_file f;
    ck_assert_msg(lb_st_open(&f, path, err, sizeof err) == 0, "%s", err);
    ck_assert_str_eq(lb_st_meta(&f, "format"), "pt");
    if (strcmp(m->cfg.arch, "glm4_moe") == 0) {   // the dense layer 0, then MoE layers
        ck_assert_ptr_nonnull(lb_st_find(&f, "model.layers.0.mlp.gate_proj.weight"));
        ck_assert_ptr_nonnull(lb_st_find(&f, "model.layers.2.mlp.experts.7.up_proj.weight"));
        ck_assert_ptr_nonnull(
            lb_st_find(&f, "model.layers.1.mlp.shared_experts.gate_proj.weight"));
        ck_assert_ptr_nonnull(lb_st_find(&f, "model.layers.1.mlp.gate.e_score_correction_bias"));
        ck_assert_ptr_nonnull(lb_st_find(&f, "model.layers.1.self_attn.q_proj.bias"));
        ck_assert_ptr_null(lb_st_find(&f, "model.layers.1.mlp.shared_experts.gate_up_proj.weight"));
    } else if (strcmp(m->cfg.arch, "qwen3_moe") == 0) {
        ck_assert_ptr_nonnull(lb_st_find(&f, "model.layers.1.mlp.experts.3.up_proj.weight"));
        ck_assert_ptr_nonnull(lb_st_find(&f, "model.layers.0.mlp.experts.0.down_proj.weight"));
        ck_assert_ptr_null(lb_st_find(&f, "model.layers.0.mlp.experts.gate_up_proj"));
    } else {
        ck_assert_ptr_nonnull(lb_st_find(&f, "model.layers.1.mlp.gate_proj.weight"));
        ck_assert_ptr_null(lb_st_find(&f, "model.layers.1.mlp.gate_up_proj.weight"));
    }
    lb_st_close(&f);

    snprintf(out, sizeof out, "%s/export/bf16", tmp);
    ck_assert_msg(lb_hf_export(m, out, "bf16", NULL, err, sizeof err) == 0, "%s", err);
    r = import(out);
    float *pa = params_of(m), *pb = params_of(r);
    for (size_t i = 0; i < m->nparams; i++) {
        float want = lb_round_bf16(pa[i]);
        ck_assert_msg(memcmp(&want, &pb[i], 4) == 0, "bf16 export: parameter %zu", i);
    }
    free(pa);
    free(pb);
    lb_model_free(r);
    ck_assert_int_eq(lb_hf_export(m, out, "f16", NULL, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "'f16'"), "%s", err);
    lb_model_free(m);
    rm_rf(tmp);
}

START_TEST(test_export_roundtrip_moe) { export_roundtrip("tests/data/hf_qwen3_moe"); }
END_TEST

START_TEST(test_export_roundtrip_dense) { export_roundtrip("tests/data/hf_qwen3"); }
END_TEST

START_TEST(test_export_roundtrip_llama) { export_roundtrip("tests/data/hf_llama"); }
END_TEST

START_TEST(test_export_roundtrip_glm4_moe) { export_roundtrip("tests/data/hf_glm4_moe"); }
END_TEST

// tests/data/hf_qwen3_moe_fused holds the same model as transformers keeps it in memory:
// mlp.experts.gate_up_proj (E, 2F, C) and mlp.experts.down_proj (E, C, F).
START_TEST(test_fused_layout)
{
    lb_model *a = import(lb_test_src("tests/data/hf_qwen3_moe"));
    lb_model *b = import(lb_test_src("tests/data/hf_qwen3_moe_fused"));
    assert_same_params(a, b, "fused vs per-expert layout");
    lb_model_free(a);
    lb_model_free(b);
}
END_TEST

// The sigmoid router op (router_sigmoid_fwd/bwd) against transformers' Glm4MoeTopkRouter
// (tests/data/hf_glm4_router.safetensors): the same experts per row (transformers' order is
// unsorted: compared as sets), their weights within 1e-6 and d logits within 1e-5 relative;
// and the golden rows are ones where the bias and the group limit change the choice, so both
// are what is compared.
static int same_choice(const int32_t *a, const float *b, int k)
{
    for (int s = 0; s < k; s++) {
        int found = 0;
        for (int t = 0; t < k; t++) found |= a[s] == (int32_t)b[t];
        if (!found) return 0;
    }
    return 1;
}

START_TEST(test_glm4_router)
{
    char err[512];
    lb_st_file g;
    const char *path = lb_test_src("tests/data/hf_glm4_router.safetensors");
    ck_assert_msg(lb_st_open(&g, path, err, sizeof err) == 0, "%s", err);
    const int n = atoi(lb_st_meta(&g, "n")), e = atoi(lb_st_meta(&g, "e")),
              k = atoi(lb_st_meta(&g, "k")), ng = atoi(lb_st_meta(&g, "n_group")),
              tg = atoi(lb_st_meta(&g, "topk_group"));
    const float scale = (float)atof(lb_st_meta(&g, "scale"));
    const char *variants[2] = {"renorm", "plain"};
    for (int v = 0; v < 2; v++) {
        char name[64];
#define GET(x) (snprintf(name, sizeof name, "%s.%s", variants[v], x), golden_read(&g, name, NULL))
        float *logits = GET("logits"), *bias = GET("bias"), *ridx = GET("idx"),
              *rw = GET("weight"), *dw = GET("dweight"), *rdl = GET("dlogits");
#undef GET
        float *sc = lb_malloc((size_t)n * e * 4), *w = lb_malloc((size_t)n * k * 4),
              *dl = lb_malloc((size_t)n * e * 4), *w2 = lb_malloc((size_t)n * k * 4);
        int32_t *idx = lb_malloc((size_t)n * k * 4), *idx2 = lb_malloc((size_t)n * k * 4);
        lb_router_sigmoid_args a = {.n = n, .e = e, .k = k, .n_group = ng, .topk_group = tg,
                                    .renorm = v == 0, .scale = scale, .logits = logits,
                                    .bias = bias, .scores = sc, .idx = idx, .weight = w,
                                    .dweight = dw, .dlogits = dl};
        be->router_sigmoid_fwd(be, &a);
        double ew = 0;
        for (int i = 0; i < n; i++) {
            ck_assert_msg(same_choice(idx + i * k, ridx + i * k, k), "%s row %d: other experts",
                          variants[v], i);
            for (int s = 0; s < k; s++)
                for (int t = 0; t < k; t++)
                    if (idx[i * k + s] == (int32_t)ridx[i * k + t])
                        ew = fmax(ew, fabs(w[i * k + s] - rw[i * k + t]) / fabs(rw[i * k + t]));
        }
        // the golden's dweight is in transformers' slot order: put it in ours and go again
        for (int i = 0; i < n; i++)
            for (int s = 0; s < k; s++)
                for (int t = 0; t < k; t++)
                    if (idx[i * k + s] == (int32_t)ridx[i * k + t]) w2[i * k + s] = dw[i * k + t];
        a.dweight = w2;
        be->router_sigmoid_bwd(be, &a);
        double edl = rel_err(dl, rdl, (size_t)n * e);
        printf("glm4 router (%s): %d rows, weights rel err %.3g, d logits rel err %.3g\n",
               variants[v], n, ew, edl);
        ck_assert_msg(ew <= 1e-6, "%s: weights differ: %.3g", variants[v], ew);
        ck_assert_msg(edl <= 1e-5, "%s: d logits differ: %.3g", variants[v], edl);
        // without the bias, and without the group limit, some rows choose otherwise
        int moved[2] = {0, 0};
        for (int c = 0; c < 2; c++) {
            lb_router_sigmoid_args b = a;
            b.idx = idx2, b.weight = w2, b.scores = sc;
            if (c == 0) b.bias = NULL;
            else b.n_group = 1, b.topk_group = 1;
            be->router_sigmoid_fwd(be, &b);
            for (int i = 0; i < n; i++) moved[c] += !same_choice(idx2 + i * k, ridx + i * k, k);
        }
        ck_assert_msg(moved[0] > 0 && moved[1] > 0, "%s: bias moves %d rows, groups %d",
                      variants[v], moved[0], moved[1]);
        free(logits), free(bias), free(ridx), free(rw), free(dw), free(rdl);
        free(sc), free(w), free(dl), free(w2), free(idx), free(idx2);
    }
    lb_st_close(&g);
}
END_TEST

// --- crafted checkpoints ---------------------------------------------------------------------

typedef struct {
    const char *skip;              // tensor left out
    const char *reshape;           // tensor written with its first dimension halved
    const char *extra;             // tensor added (a copy of the first tensor's first row)
    const char *config_from, *config_to;   // text replaced in config.json
    int shards;                    // > 1: model.safetensors.index.json and that many shards
    const char *misplace;          // sharded: the index names the wrong shard for this tensor
} craft;

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    fclose(f);
}

// Copies the HF model in src to dst with the changes in k.
static void make_variant(const char *src, const char *dst, const craft *k)
{
    char path[1100], err[1024];
    snprintf(path, sizeof path, "%s/config.json", src);
    char *cfg = lb_read_file(path, NULL, err, sizeof err);
    ck_assert_msg(cfg != NULL, "%s", err);
    if (k->config_from) {
        char *at = strstr(cfg, k->config_from);
        ck_assert_msg(at != NULL, "config.json has no '%s'", k->config_from);
        size_t len = strlen(cfg) + strlen(k->config_to) + 1;
        char *out = lb_malloc(len);
        snprintf(out, len, "%.*s%s%s", (int)(at - cfg), cfg, k->config_to,
                 at + strlen(k->config_from));
        free(cfg);
        cfg = out;
    }
    snprintf(path, sizeof path, "%s/config.json", dst);
    write_text(path, cfg);
    free(cfg);

    lb_st_file f;
    snprintf(path, sizeof path, "%s/model.safetensors", src);
    ck_assert_msg(lb_st_open(&f, path, err, sizeof err) == 0, "%s", err);
    int nsh = k->shards > 1 ? k->shards : 1;
    lb_st_writer **w = lb_calloc(nsh, sizeof *w);
    for (int s = 0; s < nsh; s++) w[s] = lb_st_writer_new();
    float **data = lb_calloc(f.ntensors + 1, sizeof *data);
    char *index = lb_malloc(1 << 16);
    size_t ilen = (size_t)snprintf(index, 1 << 16, "{\"metadata\": {}, \"weight_map\": {");
    int listed = 0;
    for (int i = 0; i < f.ntensors; i++) {
        const lb_st_tensor *t = &f.tensors[i];
        if (k->skip && strcmp(t->name, k->skip) == 0) continue;
        data[i] = lb_malloc((size_t)lb_st_numel(t) * sizeof(float) + 4);
        ck_assert_int_eq(lb_st_read_f32(&f, t, data[i], err, sizeof err), 0);
        int64_t shape[8];
        memcpy(shape, t->shape, sizeof shape);
        if (k->reshape && strcmp(t->name, k->reshape) == 0) shape[0] /= 2;
        int s = i % nsh;
        lb_st_writer_add(w[s], t->name, "F32", t->ndim, shape, data[i]);
        int place = k->misplace && strcmp(t->name, k->misplace) == 0 ? (s + 1) % nsh : s;
        ilen += (size_t)snprintf(index + ilen, (1 << 16) - ilen,
                                 "%s\"%s\": \"part-%d.safetensors\"", listed++ ? ", " : "",
                                 t->name, place);
    }
    if (k->extra) {
        int64_t shape[1] = {f.tensors[0].shape[1]};
        lb_st_writer_add(w[0], k->extra, "F32", 1, shape, data[0]);
        ilen += (size_t)snprintf(index + ilen, (1 << 16) - ilen,
                                 ", \"%s\": \"part-0.safetensors\"", k->extra);
    }
    snprintf(index + ilen, (1 << 16) - ilen, "}}\n");
    for (int s = 0; s < nsh; s++) {
        if (nsh > 1) snprintf(path, sizeof path, "%s/part-%d.safetensors", dst, s);
        else snprintf(path, sizeof path, "%s/model.safetensors", dst);
        ck_assert_msg(lb_st_writer_save(w[s], path, err, sizeof err) == 0, "%s", err);
        lb_st_writer_free(w[s]);
    }
    if (nsh > 1) {
        snprintf(path, sizeof path, "%s/model.safetensors.index.json", dst);
        write_text(path, index);
    }
    for (int i = 0; i < f.ntensors; i++) free(data[i]);
    free(data);
    free(w);
    free(index);
    lb_st_close(&f);
}

// Builds the variant and expects the import to fail with a message starting with
// "dst/<file>:" and containing want.
static void expect_import_error(const char *src, const craft *k, const char *file,
                                const char *want)
{
    char dst[256], prefix[600], err[1024] = "";
    tmpdir_copy(dst, sizeof dst);
    make_variant(src, dst, k);
    snprintf(prefix, sizeof prefix, "%s/%s:", dst, file);
    lb_model_config cfg;
    int rc = lb_hf_read_config(dst, &cfg, err, sizeof err);
    lb_model *m = NULL;
    if (rc == 0) {
        m = lb_model_create(&cfg, be, err, sizeof err);
        ck_assert_msg(m != NULL, "%s", err);
        rc = lb_hf_load(m, dst, err, sizeof err);
    }
    ck_assert_msg(rc == -1, "import of a variant (%s) succeeded", want);
    ck_assert_msg(strncmp(err, prefix, strlen(prefix)) == 0, "'%s' does not start with '%s'",
                  err, prefix);
    ck_assert_msg(strstr(err, want) != NULL, "'%s' does not say '%s'", err, want);
    lb_model_free(m);
    rm_rf(dst);
}

// The golden Llama's RoPE scaling is in force: read from rope_parameters (transformers 5) or
// rope_scaling (transformers 4) alike, and the same model with plain RoPE gives other logits.
START_TEST(test_llama_rope_scaling)
{
    const char *src = lb_test_src("tests/data/hf_llama");
    lb_model *m = import(src);
    ck_assert_str_eq(m->cfg.rope_type, "llama3");
    ck_assert(m->cfg.rope_factor == 8.0 && m->cfg.rope_low_freq_factor == 1.0 &&
              m->cfg.rope_high_freq_factor == 4.0);
    ck_assert_int_eq(m->cfg.rope_original_max_position_embeddings, 32);
    ck_assert_ptr_null(lb_model_find(m, "model.layers.0.self_attn.q_norm.weight"));
    int32_t tok[12];
    for (int i = 0; i < 12; i++) tok[i] = (i * 37 + 5) % m->cfg.vocab_size;
    size_t nl = (size_t)12 * m->cfg.vocab_size;
    float *a = lb_malloc(nl * sizeof(float)), *b = lb_malloc(nl * sizeof(float));
    lb_model_forward(m, tok, NULL, 1, 12);
    be->download(be, a, m->logits, nl * sizeof(float));
    lb_model_config plain = m->cfg;
    snprintf(plain.rope_type, sizeof plain.rope_type, "default");
    char err[1024], dir[256];
    lb_model *p = lb_model_create(&plain, be, err, sizeof err);
    ck_assert_msg(p != NULL, "%s", err);
    ck_assert_msg(lb_hf_load(p, src, err, sizeof err) == 0, "%s", err);
    lb_model_forward(p, tok, NULL, 1, 12);
    be->download(be, b, p->logits, nl * sizeof(float));
    double e = rel_err(b, a, nl);
    printf("llama: plain RoPE instead of llama3 moves the logits by %.3g (relative)\n", e);
    ck_assert_msg(e > 1e-2, "the llama3 scaling does not change the logits (%.3g)", e);
    lb_model_free(p);

    // transformers 4's spelling: rope_scaling beside rope_theta
    tmpdir_copy(dir, sizeof dir);
    craft k = {.config_from = "\"rope_parameters\": {",
               .config_to = "\"rope_theta\": 10000.0, \"rope_scaling\": {"};
    make_variant(src, dir, &k);
    lb_model *r = import(dir);
    ck_assert_str_eq(r->cfg.rope_type, "llama3");
    ck_assert(r->cfg.rope_factor == 8.0 && r->cfg.rope_high_freq_factor == 4.0);
    ck_assert_int_eq(r->cfg.rope_original_max_position_embeddings, 32);
    lb_model_forward(r, tok, NULL, 1, 12);
    be->download(be, b, r->logits, nl * sizeof(float));
    ck_assert(memcmp(a, b, nl * sizeof(float)) == 0);
    lb_model_free(r);
    rm_rf(dir);
    free(a);
    free(b);
    lb_model_free(m);
}
END_TEST

START_TEST(test_bad_inputs)
{
    char err[1024], dir[256], prefix[600];
    const char *moe = lb_test_src("tests/data/hf_qwen3_moe");
    const char *dense = lb_test_src("tests/data/hf_qwen3");
    const char *llama = lb_test_src("tests/data/hf_llama");
    const char *glm = lb_test_src("tests/data/hf_glm4_moe");
    lb_model_config cfg;
    // No config.json at all.
    tmpdir_copy(dir, sizeof dir);
    ck_assert_int_eq(lb_hf_read_config(dir, &cfg, err, sizeof err), -1);
    snprintf(prefix, sizeof prefix, "%s/config.json:", dir);
    ck_assert_msg(strncmp(err, prefix, strlen(prefix)) == 0, "%s", err);
    rm_rf(dir);

    // Unsupported features and malformed configurations.
    struct { const char *src, *from, *to, *want; } bad[] = {
        {moe, "\"use_sliding_window\": false", "\"use_sliding_window\": true",
         "use_sliding_window"},
        {moe, "\"mlp_only_layers\": []", "\"mlp_only_layers\": [1]", "mlp_only_layers"},
        {moe, "\"decoder_sparse_step\": 1", "\"decoder_sparse_step\": 2", "decoder_sparse_step"},
        {moe, "\"rope_parameters\": {", "\"rope_scaling\": {\"type\": \"yarn\", \"factor\": 4}, "
              "\"rope_parameters\": {", "rope_scaling"},
        {dense, "\"rope_type\": \"default\"", "\"rope_type\": \"linear\"", "rope_parameters"},
        {dense, "\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\"", "hidden_act"},
        {dense, "\"full_attention\"", "\"sliding_attention\"", "layer_types"},
        {moe, "\"model_type\": \"qwen3_moe\"", "\"model_type\": \"gpt2\"", "model_type 'gpt2'"},
        {moe, "\"hidden_size\": 64", "\"hidden_size\": -64", "'hidden_size' must be an integer"},
        {moe, "\"num_experts_per_tok\": 2", "\"num_experts_per_tok\": 9", "num_experts_per_tok"},
        {dense, "\"intermediate_size\": 96,", "", "missing 'intermediate_size'"},
        {moe, "{", "{,", "not valid JSON"},
        {llama, "\"mlp_bias\": false", "\"mlp_bias\": true", "mlp_bias"},
        {llama, "\"factor\": 8.0", "\"factor\": 0.5", "llama3 needs factor >= 1"},
        {llama, "\"low_freq_factor\": 1.0", "\"low_freq_factor\": 4.0", "high_freq_factor >"},
        {llama, "\"rope_type\": \"llama3\"", "\"rope_type\": \"yarn\"",
         "rope_parameters of type 'yarn'"},
        {llama, "\"rope_parameters\": {", "\"rope_parameters\": 3, \"x\": {",
         "rope_parameters must be an object"},
        {glm, "\"n_group\": 4", "\"n_group\": 3", "n_group (3) must divide num_experts (8)"},
        {glm, "\"topk_group\": 2", "\"topk_group\": 5", "topk_group"},
        {glm, "\"first_k_dense_replace\": 1", "\"first_k_dense_replace\": 4",
         "first_k_dense_replace (4) exceeds num_hidden_layers (3)"},
        {glm, "\"partial_rotary_factor\": 0.5", "\"partial_rotary_factor\": 0.1",
         "partial_rotary_factor"},
        {glm, "\"partial_rotary_factor\": 0.5", "\"partial_rotary_factor\": 1.5",
         "partial_rotary_factor (1.5) must be in (0, 1]"},
        // the families' own keys (lb_model_def.hf_config), and the shared expert count
        {glm, "\"n_shared_experts\": 1", "\"n_shared_experts\": -1",
         "'n_shared_experts' must be an integer >= 0"},
        {glm, "\"n_group\": 4", "\"n_group\": 0", "'n_group' must be an integer >= 1"},
        {glm, "\"routed_scaling_factor\": 2.5", "\"routed_scaling_factor\": \"big\"",
         "'routed_scaling_factor' must be a non-negative number"},
        {glm, "\"use_qk_norm\": true", "\"use_qk_norm\": 1",
         "'use_qk_norm' must be true or false"},
        {glm, "\"n_routed_experts\": 8,", "", "missing 'num_local_experts'"},
        {moe, "\"router_aux_loss_coef\": 0.01", "\"router_aux_loss_coef\": -1",
         "'router_aux_loss_coef' must be a non-negative number"},
        {moe, "\"norm_topk_prob\": true", "\"norm_topk_prob\": 1",
         "'norm_topk_prob' must be true or false"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        craft k = {.config_from = bad[i].from, .config_to = bad[i].to};
        expect_import_error(bad[i].src, &k, "config.json", bad[i].want);
    }

    // Weights that do not match the configuration.
    // Missing tensors, GLM's selection bias and shared experts among them.
    struct { const char *src, *skip; } gone[] = {
        {moe, "model.layers.1.mlp.experts.2.up_proj.weight"},
        {moe, "model.layers.0.self_attn.k_norm.weight"},
        {dense, "model.layers.1.mlp.up_proj.weight"},
        {glm, "model.layers.2.mlp.gate.e_score_correction_bias"},
        {glm, "model.layers.1.mlp.shared_experts.up_proj.weight"},
        {glm, "model.layers.0.self_attn.v_proj.bias"},
    };
    for (size_t i = 0; i < sizeof gone / sizeof gone[0]; i++) {
        char want[160];
        snprintf(want, sizeof want, "missing tensor '%s'", gone[i].skip);
        craft k = {.skip = gone[i].skip};
        expect_import_error(gone[i].src, &k, "model.safetensors", want);
    }
    // Qwen3-MoE's leading mlp_only_layers make layer 0 dense: its MLP tensors are expected
    craft km = {.config_from = "\"mlp_only_layers\": []", .config_to = "\"mlp_only_layers\": [0]"};
    expect_import_error(moe, &km, "model.safetensors",
                        "missing tensor 'model.layers.0.mlp.gate_proj.weight'");
    craft k4 = {.reshape = "model.layers.0.self_attn.q_norm.weight"};
    expect_import_error(moe, &k4, "model.safetensors",
                        "tensor 'model.layers.0.self_attn.q_norm.weight' has shape [8]");
    craft k5 = {.reshape = "model.layers.1.mlp.experts.0.down_proj.weight"};
    expect_import_error(moe, &k5, "model.safetensors",
                        "'model.layers.1.mlp.experts.0.down_proj.weight' has shape [32, 32]");
    craft k6 = {.extra = "model.layers.2.input_layernorm.weight"};
    expect_import_error(moe, &k6, "model.safetensors",
                        "unexpected tensor 'model.layers.2.input_layernorm.weight'");
    // A configuration of another size than the weights (one layer: layer 1 is left over).
    craft k7 = {.config_from = "\"num_hidden_layers\": 2", .config_to = "\"num_hidden_layers\": 1"};
    expect_import_error(dense, &k7, "model.safetensors", "unexpected tensor 'model.layers.1.");
    craft k8 = {.config_from = "\"vocab_size\": 96", .config_to = "\"vocab_size\": 97"};
    expect_import_error(dense, &k8, "model.safetensors", "has shape [96, 64]");
    // Sharded: a tensor missing from every shard is reported against the index.
    craft k9 = {.shards = 3, .skip = "model.norm.weight"};
    expect_import_error(moe, &k9, "model.safetensors.index.json",
                        "missing tensor 'model.norm.weight'");
    craft k10 = {.shards = 3, .misplace = "lm_head.weight"};
    expect_import_error(moe, &k10, "model.safetensors.index.json",
                        "weight_map puts tensor 'lm_head.weight'");

    // No weights at all.
    tmpdir_copy(dir, sizeof dir);
    char path[600];
    snprintf(path, sizeof path, "%s/config.json", dir);
    char *text = lb_read_file(lb_test_src("tests/data/hf_qwen3/config.json"), NULL, err,
                              sizeof err);
    write_text(path, text);
    free(text);
    ck_assert_int_eq(lb_hf_read_config(dir, &cfg, err, sizeof err), 0);
    lb_model *m = lb_model_create(&cfg, be, err, sizeof err);
    ck_assert_int_eq(lb_hf_load(m, dir, err, sizeof err), -1);
    ck_assert_msg(strncmp(err, dir, strlen(dir)) == 0 && strstr(err, "no model.safetensors"),
                  "%s", err);
    lb_model_free(m);
    rm_rf(dir);
}
END_TEST

// Shards listed by model.safetensors.index.json load like the single file.
START_TEST(test_sharded)
{
    char dir[256];
    const char *src = lb_test_src("tests/data/hf_qwen3_moe");
    tmpdir_copy(dir, sizeof dir);
    craft k = {.shards = 3};
    make_variant(src, dir, &k);
    lb_model *a = import(src), *b = import(dir);
    assert_same_params(a, b, "sharded");
    lb_model_free(a);
    lb_model_free(b);
    rm_rf(dir);
}
END_TEST

// tie_word_embeddings = true: lm_head comes from the embedding (a stored lm_head is ignored,
// as transformers does).
START_TEST(test_tied_embeddings)
{
    char dir[256];
    const char *src = lb_test_src("tests/data/hf_qwen3");
    tmpdir_copy(dir, sizeof dir);
    craft k = {.skip = "lm_head.weight", .config_from = "\"tie_word_embeddings\": false",
               .config_to = "\"tie_word_embeddings\": true"};
    make_variant(src, dir, &k);
    lb_model *m = import(dir);
    float *p = params_of(m);
    const lb_tensor *emb = lb_model_find(m, "model.embed_tokens.weight");
    const lb_tensor *lm = lb_model_find(m, "lm_head.weight");
    ck_assert_int_eq(memcmp(p + emb->offset, p + lm->offset, emb->numel * sizeof(float)), 0);
    free(p);
    lb_model_free(m);
    rm_rf(dir);
}
END_TEST

// `lowbit convert`: HF -> lowbit checkpoint -> HF gives back the same weights and shapes.
static void convert_roundtrip(const char *sub)
{
    char tmp[256], err[1024];
    tmpdir_copy(tmp, sizeof tmp);
    const char *src = lb_test_src(sub);
    lb_config c;
    lb_config_defaults(&c);
    snprintf(c.convert.input, sizeof c.convert.input, "%s", src);
    snprintf(c.convert.output, sizeof c.convert.output, "%s/ck/model.safetensors", tmp);
    snprintf(c.convert.direction, sizeof c.convert.direction, "import");
    lb_comm comm = {.rank = 0, .size = 1};   // convert communicates nothing
    ck_assert_int_eq(lb_cmd_convert(&c, &comm), 0);
    char *ini = lb_checkpoint_config(c.convert.output, err, sizeof err);
    ck_assert_msg(ini != NULL, "%s", err);
    lb_config stored;
    lb_config_defaults(&stored);
    ck_assert_msg(lb_config_parse(&stored, ini, "stored", err, sizeof err) == 0, "%s", err);
    free(ini);
    lb_model *a = import(src);
    ck_assert_str_eq(stored.model.arch, a->cfg.arch);
    ck_assert_int_eq(stored.model.hidden_size, a->cfg.hidden_size);
    ck_assert(stored.model.rope_theta == a->cfg.rope_theta);

    snprintf(c.convert.input, sizeof c.convert.input, "%s/ck/model.safetensors", tmp);
    snprintf(c.convert.output, sizeof c.convert.output, "%s/hf", tmp);
    snprintf(c.convert.direction, sizeof c.convert.direction, "export");
    snprintf(c.convert.dtype, sizeof c.convert.dtype, "f32");
    ck_assert_int_eq(lb_cmd_convert(&c, &comm), 0);
    lb_model *b = import(c.convert.output);
    assert_same_params(a, b, "convert import + export");
    ck_assert_int_eq(b->cfg.num_experts, a->cfg.num_experts);
    lb_model_free(a);
    lb_model_free(b);

    // A missing input fails with a non-zero status.
    snprintf(c.convert.input, sizeof c.convert.input, "%s/none", tmp);
    snprintf(c.convert.direction, sizeof c.convert.direction, "import");
    ck_assert_int_ne(lb_cmd_convert(&c, &comm), 0);
    rm_rf(tmp);
}

START_TEST(test_convert_command_moe) { convert_roundtrip("tests/data/hf_qwen3_moe"); }
END_TEST

START_TEST(test_convert_command_dense) { convert_roundtrip("tests/data/hf_qwen3"); }
END_TEST

START_TEST(test_convert_command_llama) { convert_roundtrip("tests/data/hf_llama"); }
END_TEST

START_TEST(test_convert_command_glm4_moe) { convert_roundtrip("tests/data/hf_glm4_moe"); }
END_TEST

// The logits (12 tokens) of the model imported from dir, with *edit applied to its
// configuration first (NULL: none) and, where zero_bias, every selection bias set to zero.
static float *glm4_logits(const char *dir, void (*edit)(lb_model_config *), int zero_bias)
{
    char err[1024];
    lb_model_config cfg;
    ck_assert_msg(lb_hf_read_config(dir, &cfg, err, sizeof err) == 0, "%s", err);
    if (edit) edit(&cfg);
    lb_model *m = lb_model_create(&cfg, be, err, sizeof err);
    ck_assert_msg(m != NULL, "%s", err);
    ck_assert_msg(lb_hf_load(m, dir, err, sizeof err) == 0, "%s", err);
    for (int l = 0; zero_bias && l < cfg.num_hidden_layers; l++) {
        char name[96];
        snprintf(name, sizeof name, "model.layers.%d.mlp.gate.e_score_correction_bias", l);
        const lb_tensor *t = lb_model_find(m, name);
        if (t) be->zero(be, m->params + t->offset, t->numel * sizeof(float));
    }
    int32_t tok[12];
    for (int i = 0; i < 12; i++) tok[i] = (i * 37 + 5) % cfg.vocab_size;
    size_t nl = (size_t)12 * cfg.vocab_size;
    float *out = lb_malloc(nl * sizeof(float));
    lb_model_forward(m, tok, NULL, 1, 12);
    be->download(be, out, m->logits, nl * sizeof(float));
    lb_model_free(m);
    return out;
}

static void full_rotary(lb_model_config *c) { c->partial_rotary_factor = 1.0; }
static void plain_scaling(lb_model_config *c) { c->routed_scaling_factor = 1.0; }
static void one_group(lb_model_config *c) { c->n_group = c->topk_group = 1; }

// Each feature the golden GLM config turns on changes the logits, so parity covers it: the
// selection bias, partial rotary, the routed scaling factor and the group-limited choice.
START_TEST(test_glm4_moe_features)
{
    const char *src = lb_test_src("tests/data/hf_glm4_moe");
    lb_model *m = import(src);
    ck_assert_int_eq(m->cfg.first_k_dense_replace, 1);
    ck_assert_int_eq(m->cfg.n_shared_experts, 1);
    ck_assert_int_eq(m->cfg.n_group, 4);
    ck_assert_int_eq(m->cfg.topk_group, 2);
    ck_assert(m->cfg.partial_rotary_factor == 0.5 && m->cfg.routed_scaling_factor == 2.5);
    ck_assert(m->cfg.attention_bias && m->cfg.use_qk_norm && m->cfg.router_aux_loss_coef == 0);
    ck_assert_ptr_null(lb_model_find(m, "model.layers.0.mlp.gate.weight"));   // dense layer 0
    const lb_tensor *b = lb_model_find(m, "model.layers.1.mlp.gate.e_score_correction_bias");
    ck_assert(b && b->frozen && b->zero_init);
    lb_model_free(m);
    size_t nl = (size_t)12 * 96;
    float *ref = glm4_logits(src, NULL, 0);
    struct {
        const char *what;
        void (*edit)(lb_model_config *);
        int zero_bias;
    } v[] = {{"no selection bias", NULL, 1}, {"full rotary", full_rotary, 0},
             {"routed scaling 1", plain_scaling, 0}, {"one group", one_group, 0}};
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
        float *x = glm4_logits(src, v[i].edit, v[i].zero_bias);
        double e = rel_err(x, ref, nl);
        printf("glm4_moe: %s moves the logits by %.3g (relative)\n", v[i].what, e);
        ck_assert_msg(e > 1e-3, "%s does not change the logits (%.3g)", v[i].what, e);
        free(x);
    }
    free(ref);
}
END_TEST

// Where config.json lacks a family's own key (lb_model_def.hf_config), import takes the
// transformers config class's default: Glm4MoeConfig's, Qwen3MoeConfig's. Every table entry's
// field is of its kind's type.
START_TEST(test_family_key_defaults)
{
    struct {
        const char *src, *drop[8];
    } v[] = {
        {"tests/data/hf_glm4_moe", {"use_qk_norm", "norm_topk_prob", "n_shared_experts",
                                    "first_k_dense_replace", "n_group", "topk_group",
                                    "routed_scaling_factor"}},
        {"tests/data/hf_qwen3_moe", {"norm_topk_prob", "mlp_only_layers",
                                     "router_aux_loss_coef"}},
    };
    lb_model_config c[2];
    for (int i = 0; i < 2; i++) {
        char dir[256], path[600], err[1024];
        tmpdir_copy(dir, sizeof dir);
        snprintf(path, sizeof path, "%s/config.json", lb_test_src(v[i].src));
        char *text = lb_read_file(path, NULL, err, sizeof err);
        ck_assert_msg(text != NULL, "%s", err);
        // the golden files hold one key a line, never last: drop those lines
        for (int k = 0; k < 8 && v[i].drop[k]; k++) {
            char key[64];
            snprintf(key, sizeof key, "\"%s\":", v[i].drop[k]);
            char *at = strstr(text, key);
            ck_assert_msg(at != NULL, "%s has no %s", path, key);
            while (at > text && at[-1] != '\n') at--;
            char *end = strchr(at, '\n');
            memmove(at, end + 1, strlen(end + 1) + 1);
        }
        snprintf(path, sizeof path, "%s/config.json", dir);
        write_text(path, text);
        free(text);
        ck_assert_msg(lb_hf_read_config(dir, &c[i], err, sizeof err) == 0, "%s", err);
        rm_rf(dir);
    }
    ck_assert(!c[0].use_qk_norm && c[0].norm_topk_prob && c[0].n_shared_experts == 1 &&
              c[0].first_k_dense_replace == 1 && c[0].n_group == 1 && c[0].topk_group == 1 &&
              c[0].routed_scaling_factor == 1.0 && c[0].router_aux_loss_coef == 0);
    ck_assert(!c[1].norm_topk_prob && c[1].first_k_dense_replace == 0 &&
              c[1].router_aux_loss_coef == 0.001 && c[1].n_group == 1 &&
              c[1].routed_scaling_factor == 1.0);

    for (int m = 0; m < lb_model_count(); m++) {
        const lb_model_def *d = lb_model_at(m);
        for (int i = 0; i < d->nhf_config; i++) {
            const lb_hf_key *k = &d->hf_config[i];
            if (k->offset == LB_HF_NO_FIELD) continue;
            size_t want = k->kind == LB_HF_REAL ? sizeof(double) : sizeof(int);
            ck_assert_msg(k->kind != LB_HF_NULL && k->size == want && k->offset < sizeof c[0],
                          "%s: config.json key %s: its field is not of its kind", d->arch,
                          k->name);
        }
    }
}
END_TEST

int main(void)
{
    Suite *s = suite_create("hf_parity");
    TCase *tc = tcase_create("core");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_parity_moe);
    tcase_add_test(tc, test_parity_dense);
    tcase_add_test(tc, test_parity_llama);
    tcase_add_test(tc, test_llama_rope_scaling);
    tcase_add_test(tc, test_export_roundtrip_llama);
    tcase_add_test(tc, test_convert_command_llama);
    tcase_add_test(tc, test_glm4_router);
    tcase_add_test(tc, test_parity_glm4_moe);
    tcase_add_test(tc, test_glm4_moe_features);
    tcase_add_test(tc, test_export_roundtrip_glm4_moe);
    tcase_add_test(tc, test_convert_command_glm4_moe);
    tcase_add_test(tc, test_export_roundtrip_moe);
    tcase_add_test(tc, test_export_roundtrip_dense);
    tcase_add_test(tc, test_fused_layout);
    tcase_add_test(tc, test_sharded);
    tcase_add_test(tc, test_tied_embeddings);
    tcase_add_test(tc, test_bad_inputs);
    tcase_add_test(tc, test_family_key_defaults);
    tcase_add_test(tc, test_convert_command_moe);
    tcase_add_test(tc, test_convert_command_dense);
    suite_add_tcase(s, tc);
    return lb_test_run(s);
}
