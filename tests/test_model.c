// test_model.c: the whole Qwen3 / Qwen3-MoE forward and backward against finite differences,
// and checkpoints (round trip, corrupt and mismatched files).
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "kernels/common.h"
#include "src/checkpoint.h"
#include "src/util.h"
#include "tests/testutil.h"

static lb_backend *be;

static lb_model_config tiny_config(const char *arch)
{
    lb_model_config c = {0};
    snprintf(c.arch, sizeof c.arch, "%s", arch);
    c.vocab_size = 23;
    c.hidden_size = 16;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 8;
    c.intermediate_size = 24;
    c.num_experts = 5;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = 12;
    c.norm_topk_prob = 1;
    c.max_position_embeddings = 64;
    c.rope_theta = 10000.0;
    c.rms_norm_eps = 1e-6;
    c.router_aux_loss_coef = 0.1;   // large, so the load-balancing gradient is checked too
    c.initializer_range = 0.3;      // large, so attention and routing are far from uniform
    return c;
}

enum { B = 2, T = 7 };

static void batch(int32_t *tok, int32_t *tgt, int vocab)
{
    for (int i = 0; i < B * T; i++) {
        tok[i] = (int32_t)(lb_rand_u64(7, 1, i) % vocab);
        tgt[i] = i % 5 == 3 ? -1 : (int32_t)(lb_rand_u64(7, 2, i) % vocab);   // some ignored
    }
}

// d loss / d p for a sample of every tensor's elements: analytic vs central differences.
// Per tensor the normalised error ||fd - an|| / ||an|| must stay small: fp32 forward passes
// limit the agreement to about 1e-3, while a wrong or missing gradient term gives O(1).
static void gradcheck(const char *arch)
{
    char err[512];
    lb_model_config cfg = tiny_config(arch);
    lb_model *m = lb_model_create(&cfg, be, err, sizeof err);
    ck_assert_msg(m != NULL, "%s", err);
    lb_model_init_params(m, 42);
    int32_t tok[B * T], tgt[B * T];
    batch(tok, tgt, cfg.vocab_size);
    lb_model_zero_grad(m);
    float loss0 = lb_model_forward(m, tok, tgt, B, T);
    ck_assert(isfinite(loss0));
    ck_assert(m->aux_loss > 0.0f || strcmp(arch, "qwen3") == 0);
    lb_model_backward(m, 1.0f);
    float *p = m->params, *g = m->grads;   // CPU backend: host memory
    const float h = 2e-3f;
    for (int ti = 0; ti < m->ntensors; ti++) {
        const lb_tensor *t = &m->tensors[ti];
        int samples = t->numel < 12 ? (int)t->numel : 12;
        double num = 0, den = 0;
        for (int s = 0; s < samples; s++) {
            size_t j = t->offset + lb_rand_u64(3, ti, s) % t->numel;
            float keep = p[j];
            p[j] = keep + h;
            double lp = lb_model_forward(m, tok, tgt, B, T);
            p[j] = keep - h;
            double lm = lb_model_forward(m, tok, tgt, B, T);
            p[j] = keep;
            double fd = (lp - lm) / (2.0 * h);
            num += (fd - g[j]) * (fd - g[j]);
            den += (double)g[j] * g[j];
        }
        double rel = sqrt(num) / (sqrt(den) + 1e-4);
        ck_assert_msg(rel < 2e-2, "%s: %s: gradient differs from finite differences (rel %.3g)",
                      arch, t->name, rel);
    }
    lb_model_free(m);
}

START_TEST(test_grad_moe) { gradcheck("qwen3_moe"); }
END_TEST

START_TEST(test_grad_dense) { gradcheck("qwen3"); }
END_TEST

// A micro-batch split in two with loss_scale 1/2 each gives the gradient of the whole batch
// with equal token counts (the trainer's gradient accumulation).
START_TEST(test_loss_independent_of_batch)
{
    char err[512];
    lb_model_config cfg = tiny_config("qwen3_moe");
    lb_model *m = lb_model_create(&cfg, be, err, sizeof err);
    lb_model_init_params(m, 5);
    int32_t tok[B * T], tgt[B * T];
    batch(tok, tgt, cfg.vocab_size);
    lb_model_forward(m, tok, NULL, B, T);
    float *both = lb_malloc(sizeof(float) * B * T * cfg.vocab_size);
    memcpy(both, m->logits, sizeof(float) * B * T * cfg.vocab_size);
    // each sequence alone: the logits of a row never depend on the other rows
    for (int b = 0; b < B; b++) {
        lb_model_forward(m, tok + b * T, NULL, 1, T);
        for (int i = 0; i < T * cfg.vocab_size; i++)
            ck_assert_msg(m->logits[i] == both[b * T * cfg.vocab_size + i],
                          "sequence %d logit %d differs alone vs in a batch", b, i);
    }
    free(both);
    lb_model_free(m);
}
END_TEST

static lb_model *trained_model(const char *arch, float **am, float **av)
{
    char err[512];
    lb_model_config cfg = tiny_config(arch);
    lb_model *m = lb_model_create(&cfg, be, err, sizeof err);
    lb_model_init_params(m, 9);
    *am = be->alloc(be, m->nparams * sizeof(float));
    *av = be->alloc(be, m->nparams * sizeof(float));
    for (size_t i = 0; i < m->nparams; i++) {
        (*am)[i] = lb_rand_normal(1, 1, i);
        (*av)[i] = fabsf(lb_rand_normal(1, 2, i));
    }
    return m;
}

static const char *save_one(const char *dir, const char *name, lb_model *m, float *am, float *av)
{
    static char path[512];
    char err[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    lb_train_state st = {17, 2, 12345};
    int rc = lb_checkpoint_save(path, m, am, av, &st, "[model]\narch = qwen3_moe\n", err, sizeof err);
    ck_assert_msg(rc == 0, "%s", err);
    return path;
}

START_TEST(test_checkpoint_roundtrip)
{
    char err[512];
    float *am, *av;
    lb_model *m = trained_model("qwen3_moe", &am, &av);
    const char *dir = lb_test_tmpdir();
    const char *path = save_one(dir, "step_00000017.safetensors", m, am, av);
    float *bm, *bv;
    lb_model *n = trained_model("qwen3_moe", &bm, &bv);
    lb_model_init_params(n, 10);
    lb_train_state st;
    ck_assert_msg(lb_checkpoint_load(path, n, bm, bv, &st, err, sizeof err) == 0, "%s", err);
    ck_assert(memcmp(m->params, n->params, m->nparams * sizeof(float)) == 0);
    ck_assert(memcmp(am, bm, m->nparams * sizeof(float)) == 0);
    ck_assert(memcmp(av, bv, m->nparams * sizeof(float)) == 0);
    ck_assert_int_eq(st.step, 17);
    ck_assert_int_eq(st.loader_shard, 2);
    ck_assert_int_eq(st.loader_pos, 12345);
    char *ini = lb_checkpoint_config(path, err, sizeof err);
    ck_assert_str_eq(ini, "[model]\narch = qwen3_moe\n");
    free(ini);
    char latest[1024];
    save_one(dir, "step_00000020.safetensors", m, am, av);
    lb_checkpoint_latest(dir, latest, sizeof latest);
    ck_assert_msg(strstr(latest, "step_00000020.safetensors") != NULL, "latest is %s", latest);
    lb_model_free(m);
    lb_model_free(n);
}
END_TEST

static void expect_load_error(const char *path, const char *arch, const char *want)
{
    char err[1024] = "";
    float *bm, *bv;
    lb_model *n = trained_model(arch, &bm, &bv);
    int rc = lb_checkpoint_load(path, n, bm, bv, NULL, err, sizeof err);
    ck_assert_msg(rc != 0, "loading %s should fail", path);
    ck_assert_msg(strstr(err, path) && strstr(err, want), "error '%s' lacks '%s' or the path", err,
                  want);
    lb_model_free(n);
}

START_TEST(test_checkpoint_bad)
{
    float *am, *av;
    lb_model *m = trained_model("qwen3_moe", &am, &av);
    const char *dir = lb_test_tmpdir();
    char path[600], cmd[1400];
    snprintf(path, sizeof path, "%s", save_one(dir, "good.safetensors", m, am, av));
    // another model's tensors
    expect_load_error(path, "qwen3", "missing");
    // a flipped byte in the data section
    snprintf(cmd, sizeof cmd, "%s/flip.safetensors", dir);
    char *flip = strdup(cmd);
    snprintf(cmd, sizeof cmd, "cp '%s' '%s'", path, flip);
    ck_assert(system(cmd) == 0);
    FILE *f = fopen(flip, "r+b");
    fseek(f, -100, SEEK_END);
    int ch = fgetc(f);
    fseek(f, -100, SEEK_END);
    fputc(ch ^ 0x55, f);
    fclose(f);
    expect_load_error(flip, "qwen3_moe", "checksum mismatch");
    // truncated
    struct stat sb;
    stat(path, &sb);
    ck_assert(truncate(flip, sb.st_size / 2) == 0);
    expect_load_error(flip, "qwen3_moe", "");
    // missing file
    snprintf(cmd, sizeof cmd, "%s/none.safetensors", dir);
    expect_load_error(cmd, "qwen3_moe", "");
    free(flip);
    lb_model_free(m);
}
END_TEST

START_TEST(test_checkpoint_other_shape)
{
    float *am, *av;
    lb_model *m = trained_model("qwen3_moe", &am, &av);
    const char *dir = lb_test_tmpdir();
    const char *path = save_one(dir, "a.safetensors", m, am, av);
    char err[1024];
    lb_model_config cfg = tiny_config("qwen3_moe");
    cfg.moe_intermediate_size = 8;
    lb_model *n = lb_model_create(&cfg, be, err, sizeof err);
    float *bm = be->alloc(be, n->nparams * sizeof(float)), *bv = be->alloc(be, n->nparams * sizeof(float));
    ck_assert(lb_checkpoint_load(path, n, bm, bv, NULL, err, sizeof err) != 0);
    ck_assert_msg(strstr(err, "model.layers.0.mlp.experts.gate_up_proj") && strstr(err, "shape [5,24,16]") &&
                      strstr(err, "expects [5,16,16]"),
                  "unexpected: %s", err);
    lb_model_free(n);
    lb_model_free(m);
}
END_TEST

int main(void)
{
    char err[256];
    be = lb_backend_cpu_create(0, err, sizeof err);
    if (!be) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    Suite *s = suite_create("model");
    TCase *tc = tcase_create("model");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_grad_moe);
    tcase_add_test(tc, test_grad_dense);
    tcase_add_test(tc, test_loss_independent_of_batch);
    tcase_add_test(tc, test_checkpoint_roundtrip);
    tcase_add_test(tc, test_checkpoint_bad);
    tcase_add_test(tc, test_checkpoint_other_shape);
    suite_add_tcase(s, tc);
    return lb_test_run(s);
}
