// test_model.c: the whole Qwen3 / Qwen3-MoE forward and backward against finite differences,
// and checkpoints (round trip, corrupt and mismatched files).
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "kernels/common.h"
#include "src/io/checkpoint.h"
#include "src/train/optim.h"
#include "src/io/files.h"
#include "tests/testutil.h"

static lb_backend *be;

static lb_model_config tiny_config(const char *arch)
{
    lb_model_config c = lb_test_tiny_config(arch, 23, 16, 5, 12);
    // large, so the load-balancing gradient is checked too (the sigmoid router has none)
    c.router_aux_loss_coef = strcmp(arch, "glm4_moe") ? 0.1 : 0.0;
    if (strcmp(arch, "glm4_moe") == 0) {
        c.num_hidden_layers = 3;
        c.router_bias_update_rate = 0.01;
    }
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
    ck_assert(m->aux_loss > 0.0f || !m->def->moe || m->def->sigmoid_router);
    // biases start at zero: move them off it, so their gradients meet nonzero inputs downstream
    for (int ti = 0; ti < m->ntensors; ti++)
        if (m->tensors[ti].zero_init && !m->tensors[ti].frozen)
            for (size_t j = 0; j < m->tensors[ti].numel; j++)
                m->params[m->tensors[ti].offset + j] = 0.2f * lb_rand_normal(5, ti, j);
    // A routed model's routes at the point and at each perturbed one: a central difference
    // across a change of routes measures the jump, not the gradient, so such samples are left
    // out (the sigmoid router's groups and scaling make near ties likelier than softmax's).
    const int rk = m->def->route_k(&cfg);
    const size_t rn = (size_t)cfg.num_hidden_layers * B * T * rk;
    int32_t *r0 = rk ? lb_calloc(rn, sizeof *r0) : NULL, *r1 = rk ? lb_calloc(rn, sizeof *r1) : NULL;
    int skipped = 0, sampled = 0;
    m->route_log = r0;
    lb_model_zero_grad(m);
    loss0 = lb_model_forward(m, tok, tgt, B, T);
    m->route_log = NULL;
    lb_model_backward(m, 1.0f);
    float *p = m->params, *g = m->grads;   // CPU backend: host memory
    const float h = 2e-3f;
    for (int ti = 0; ti < m->ntensors; ti++) {
        const lb_tensor *t = &m->tensors[ti];
        if (t->frozen) continue;   // the selection bias: no gradient (it only selects)
        int samples = t->numel < 12 ? (int)t->numel : 12;
        double num = 0, den = 0;
        for (int s = 0; s < samples; s++) {
            size_t j = t->offset + lb_rand_u64(3, ti, s) % t->numel;
            float keep = p[j];
            m->route_log = r1;
            p[j] = keep + h;
            double lp = lb_model_forward(m, tok, tgt, B, T);
            int moved = rk && memcmp(r0, r1, rn * sizeof *r0) != 0;
            p[j] = keep - h;
            double lm = lb_model_forward(m, tok, tgt, B, T);
            moved |= rk && memcmp(r0, r1, rn * sizeof *r0) != 0;
            p[j] = keep;
            m->route_log = NULL;
            sampled++;
            if (moved) {
                skipped++;
                continue;
            }
            double fd = (lp - lm) / (2.0 * h);
            num += (fd - g[j]) * (fd - g[j]);
            den += (double)g[j] * g[j];
        }
        double rel = sqrt(num) / (sqrt(den) + 1e-4);
        ck_assert_msg(rel < 2e-2, "%s: %s: gradient differs from finite differences (rel %.3g)",
                      arch, t->name, rel);
    }
    printf("%s: %d of %d samples left out (their routes changed)\n", arch, skipped, sampled);
    ck_assert_msg(skipped * 10 <= sampled, "%s: %d of %d samples changed routes", arch, skipped,
                  sampled);
    free(r0);
    free(r1);
    lb_model_free(m);
}

START_TEST(test_grad_moe) { gradcheck("qwen3_moe"); }
END_TEST

START_TEST(test_grad_dense) { gradcheck("qwen3"); }
END_TEST

START_TEST(test_grad_llama) { gradcheck("llama"); }
END_TEST

START_TEST(test_grad_glm4_moe) { gradcheck("glm4_moe"); }
END_TEST

// The aux-loss-free balancing (lb_model_after_step: glm4_moe's lb_decoder_router_bias_update): after a step, each routed layer's
// selection bias moves by rate * sign(mean load - load) with the loads of the step's backwards
// (the experts its router chose, read here from route_log); forwards alone count nothing, and
// the loads start again from zero after each update.
START_TEST(test_router_bias_update)
{
    char err[512];
    lb_model_config cfg = tiny_config("glm4_moe");
    lb_model *m = lb_model_create(&cfg, be, err, sizeof err);
    ck_assert_msg(m != NULL, "%s", err);
    lb_model_init_params(m, 42);
    const int L = cfg.num_hidden_layers, E = cfg.num_experts, K = cfg.num_experts_per_tok,
              n = B * T;
    const float rate = (float)cfg.router_bias_update_rate;
    ck_assert_ptr_null(lb_model_find(m, "model.layers.0.mlp.gate.e_score_correction_bias"));
    const lb_tensor *bt[3] = {NULL};
    for (int l = 1; l < L; l++) {
        char name[96];
        snprintf(name, sizeof name, "model.layers.%d.mlp.gate.e_score_correction_bias", l);
        bt[l] = lb_model_find(m, name);
        ck_assert_ptr_nonnull(bt[l]);
        for (int j = 0; j < E; j++) ck_assert(m->params[bt[l]->offset + j] == 0.0f);
    }
    int32_t tok[B * T], tgt[B * T];
    batch(tok, tgt, cfg.vocab_size);
    lb_model_forward(m, tok, tgt, B, T);   // a forward without backward: no loads
    lb_model_after_step(m, NULL);
    for (int l = 1; l < L; l++)
        for (int j = 0; j < E; j++) ck_assert(m->params[bt[l]->offset + j] == 0.0f);

    int32_t *log = lb_calloc((size_t)L * n * K, sizeof(int32_t));
    double load[3][8] = {{0}};
    for (int step = 0; step < 2; step++) {   // two micro-batches, one update
        m->route_log = log;
        lb_model_zero_grad(m);
        lb_model_forward(m, tok, tgt, B, T);
        m->route_log = NULL;
        lb_model_backward(m, 1.0f);
        for (int l = 1; l < L; l++)
            for (int i = 0; i < n * K; i++) load[l][log[(size_t)l * n * K + i]] += 1;
        // a larger forward's routes grow their stage; the loads counted so far stay (the
        // stage's growth once freed them)
        lb_model_route_stage(m, 4 * (size_t)n);
    }
    lb_model_after_step(m, NULL);
    int up = 0, down = 0;
    for (int l = 1; l < L; l++) {
        double mean = 2.0 * n * K / E;
        for (int j = 0; j < E; j++) {
            float want = load[l][j] < mean ? rate : load[l][j] > mean ? -rate : 0.0f;
            ck_assert_msg(m->params[bt[l]->offset + j] == want,
                          "layer %d expert %d: load %g (mean %g): bias %g, want %g", l, j,
                          load[l][j], mean, m->params[bt[l]->offset + j], want);
            up += want > 0, down += want < 0;
        }
    }
    ck_assert(up > 0 && down > 0);   // the loads are uneven both ways
    // nothing counted since: the biases stay
    float keep = m->params[bt[1]->offset];
    lb_model_after_step(m, NULL);
    ck_assert(m->params[bt[1]->offset] == keep);
    // the optimizer leaves the frozen bias alone (zero gradient, no weight decay, skipped)
    lb_optim_config oc = {.lr = 1e-2, .min_lr = 1e-3, .total_steps = 10, .beta1 = 0.9,
                          .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .grad_clip = 1.0,
                          .offload_threads = 1};
    lb_optimizer o;
    lb_optimizer_init(&o, m, &oc);
    lb_model_zero_grad(m);
    lb_model_forward(m, tok, tgt, B, T);
    lb_model_backward(m, 1.0f);
    for (int j = 0; j < E; j++) m->grads[bt[1]->offset + j] = 1.0f;   // even if it had one
    lb_optimizer_step(&o, 1, NULL);
    ck_assert(m->params[bt[1]->offset] == keep);
    lb_optimizer_free(&o);
    free(log);
    lb_model_free(m);
}
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

// lb_model_zero_grad leaves the linear layers' gradients unzeroed (their first wgrad
// overwrites them). Over two micro-batches of one sequence each (loss scale 1/2), gradients that
// held NaN before it must equal, bit for bit up to the sign of zero, those of a model whose
// gradients were all zeroed and always added to (m[1]: the fresh marks cleared by hand). One
// sequence of 3 tokens routes to at most 6 of the 8 experts, so some expert has no rows and
// its gradient must still come out zero; fp8-block takes the quantized grouped wgrad. In fp32
// both must also match the gradient of the two sequences as one batch (m[2]; no
// load-balancing loss, which is not a sum over sequences), which the accumulation order
// changes only by rounding.
static void check_lazy_zero(const char *arch, const char *recipe)
{
    char err[512];
    lb_model_config cfg = tiny_config(arch);
    cfg.num_experts = 8;
    cfg.router_aux_loss_coef = 0.0;
    lb_precision_spec spec = lb_test_spec(recipe);
    lb_model *m[3];
    for (int k = 0; k < 3; k++) {
        m[k] = lb_model_create(&cfg, be, err, sizeof err);
        ck_assert_msg(m[k] != NULL, "%s", err);
        ck_assert_msg(lb_model_set_precision(m[k], &spec, 1, err, sizeof err) == 0, "%s", err);
        lb_model_init_params(m[k], 9);
    }
    size_t np = m[0]->nparams;
    for (size_t i = 0; i < np; i++) m[0]->grads[i] = NAN;   // CPU: host memory
    for (int k = 0; k < 3; k++) lb_model_zero_grad(m[k]);
    memset(m[1]->grads, 0, np * sizeof(float));
    memset(m[1]->grad_fresh, 0, (size_t)m[1]->ntensors);
    int32_t tok[6], tgt[6];
    for (int i = 0; i < 6; i++) {
        tok[i] = (int32_t)(lb_rand_u64(11, 0, i) % cfg.vocab_size);
        tgt[i] = (int32_t)(lb_rand_u64(12, 0, i) % cfg.vocab_size);
    }
    for (int mb = 0; mb < 2; mb++)
        for (int k = 0; k < 2; k++) {
            lb_model_forward(m[k], tok + 3 * mb, tgt + 3 * mb, 1, 3);
            lb_model_backward(m[k], 0.5f);
        }
    lb_model_forward(m[2], tok, tgt, 2, 3);
    lb_model_backward(m[2], 1.0f);
    for (int ti = 0; ti < m[0]->ntensors; ti++) {
        const lb_tensor *t = &m[0]->tensors[ti];
        const float *g0 = m[0]->grads + t->offset, *g1 = m[1]->grads + t->offset;
        const float *g2 = m[2]->grads + t->offset;
        double num = 0.0, den = 0.0;
        for (size_t j = 0; j < t->numel; j++) {
            ck_assert_msg(g0[j] == g1[j], "%s %s: %s[%zu] is %g, not %g", arch, recipe, t->name,
                          j, g0[j], g1[j]);
            num += ((double)g0[j] - g2[j]) * ((double)g0[j] - g2[j]);
            den += (double)g2[j] * g2[j];
        }
        if (strcmp(recipe, "fp32") == 0)
            ck_assert_msg(sqrt(num) <= 1e-5 * sqrt(den) + 1e-12,
                          "%s: %s: two micro-batches differ from one batch (%g of %g)", arch,
                          t->name, sqrt(num), sqrt(den));
    }
    for (int k = 0; k < 3; k++) lb_model_free(m[k]);
}

START_TEST(test_zero_grad_lazy)
{
    const char *recipes[] = {"fp32", "bf16", "fp8-block", "nvfp4-moe"};
    for (int r = 0; r < 4; r++) {
        check_lazy_zero("qwen3_moe", recipes[r]);
        check_lazy_zero("qwen3", recipes[r]);
    }
}
END_TEST

// lb_model_forward_train runs the LM head's backward inside the forward. Unchunked its
// gradients and loss must be the bits of forward then backward (the same calls, in another
// order); in chunks of 3 rows (14 rows: 3, 3, 3, 3, 2) the loss and every gradient but the LM
// head's must still be those bits (a row's logits, loss and d lnf never depend on the other
// rows), and the LM head's, summed chunk by chunk, must agree to rounding. Two micro-batches,
// so the head's second one accumulates.
static void check_forward_train(const char *arch, const char *recipe)
{
    char err[512];
    lb_model_config cfg = tiny_config(arch);
    lb_precision_spec spec = lb_test_spec(recipe);
    lb_model *m[3];
    int32_t tok[2][B * T], tgt[2][B * T];
    batch(tok[0], tgt[0], cfg.vocab_size);
    for (int i = 0; i < B * T; i++) {   // a second micro-batch: the first one's reversed
        tok[1][i] = tok[0][B * T - 1 - i];
        tgt[1][i] = tgt[0][B * T - 1 - i];
    }
    float loss[3][2];
    for (int k = 0; k < 3; k++) {
        m[k] = lb_model_create(&cfg, be, err, sizeof err);
        ck_assert_msg(m[k] != NULL, "%s", err);
        ck_assert_msg(lb_model_set_precision(m[k], &spec, 1, err, sizeof err) == 0, "%s", err);
        lb_model_init_params(m[k], 5);
        if (k == 2) lb_model_set_ce_chunk(m[k], 3);
        lb_model_zero_grad(m[k]);
        for (int mb = 0; mb < 2; mb++) {
            loss[k][mb] = k ? lb_model_forward_train(m[k], tok[mb], tgt[mb], B, T, 0.5f)
                            : lb_model_forward(m[k], tok[mb], tgt[mb], B, T);
            lb_model_backward(m[k], 0.5f);
        }
    }
    for (int k = 1; k < 3; k++)
        for (int mb = 0; mb < 2; mb++)
            ck_assert_msg(loss[k][mb] == loss[0][mb], "%s %s, model %d: loss %.9g, not %.9g",
                          arch, recipe, k, loss[k][mb], loss[0][mb]);
    for (int ti = 0; ti < m[0]->ntensors; ti++) {
        const lb_tensor *t = &m[0]->tensors[ti];
        const int head = !strcmp(t->name, "lm_head.weight");
        double num = 0.0, den = 0.0;
        for (size_t j = 0; j < t->numel; j++) {
            float g0 = m[0]->grads[t->offset + j];
            for (int k = 1; k < 3; k++) {
                float g = m[k]->grads[t->offset + j];
                if (k == 2 && head) continue;
                ck_assert_msg(g == g0, "%s %s, model %d: %s[%zu] is %g, not %g", arch, recipe, k,
                              t->name, j, g, g0);
            }
            double dd = (double)m[2]->grads[t->offset + j] - g0;
            num += dd * dd;
            den += (double)g0 * g0;
        }
        if (head)
            ck_assert_msg(den > 0 && sqrt(num) <= 1e-6 * sqrt(den),
                          "%s %s: the LM head's chunked gradient is %g from the whole one (of %g)",
                          arch, recipe, sqrt(num), sqrt(den));
    }
    for (int k = 0; k < 3; k++) lb_model_free(m[k]);
}

START_TEST(test_forward_train)
{
    const char *recipes[] = {"fp32", "bf16", "fp8-block"};
    for (int r = 0; r < 3; r++) {
        check_forward_train("qwen3_moe", recipes[r]);
        check_forward_train("qwen3", recipes[r]);
    }
}
END_TEST

// The optimizer writes a weight cache's bf16 copy with the update (AdamW's p16) where the copy
// has the tensor's layout, and the refresh rounds only the others (down_proj's rows of 12 are
// padded; offloaded parameters are updated on the host). After every step each copy must hold
// its parameters rounded, bit for bit, whichever wrote it. offload: the host's fraction.
static void check_adamw_b16(double offload)
{
    char err[512];
    lb_model_config cfg = tiny_config("qwen3_moe");
    lb_precision_spec spec = lb_test_spec("bf16");
    lb_model *m = lb_model_create(&cfg, be, err, sizeof err);
    ck_assert_msg(m != NULL, "%s", err);
    ck_assert_msg(lb_model_set_precision(m, &spec, 1, err, sizeof err) == 0, "%s", err);
    lb_model_init_params(m, 3);
    lb_optim_config oc = {.lr = 1e-2, .min_lr = 1e-3, .total_steps = 10, .beta1 = 0.9,
                          .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .grad_clip = 1.0,
                          .offload = offload, .offload_threads = 1};
    lb_optimizer o;
    lb_optimizer_init(&o, m, &oc);
    int32_t tok[B * T], tgt[B * T];
    batch(tok, tgt, cfg.vocab_size);
    for (int step = 1; step <= 2; step++) {
        lb_model_zero_grad(m);
        lb_model_forward(m, tok, tgt, B, T);
        lb_model_backward(m, 1.0f);
        lb_optimizer_step(&o, step, NULL);
        int written = 0, copies = 0;
        for (int i = 0; i < m->ntensors; i++) written += m->wcache[i].b16_fresh;
        lb_model_refresh_weights(m);
        for (int i = 0; i < m->ntensors; i++) {
            const lb_wcache *c = &m->wcache[i];
            if (!c->b16) continue;
            const lb_tensor *t = &m->tensors[i];
            const int ld = (c->in + 7) / 8 * 8;
            const size_t rows = (size_t)c->count * c->out;
            uint16_t *want = lb_malloc(rows * ld * 2);
            be->to_bf16(be, want, m->params + t->offset, rows, c->in, ld);
            ck_assert_msg(!memcmp(want, c->b16, rows * ld * 2),
                          "offload %g, step %d: %s's bf16 copy is not its parameters rounded",
                          offload, step, t->name);
            ck_assert_msg(!c->b16_fresh, "%s: the refresh left its copy marked fresh", t->name);
            free(want);
            copies++;
        }
        ck_assert_int_gt(copies, written);   // down_proj's copies are rounded by the refresh
        if (offload == 0.0) ck_assert_int_gt(written, 0);
        if (offload == 1.0) ck_assert_int_eq(written, 0);
    }
    lb_optimizer_free(&o);
    lb_model_free(m);
}

START_TEST(test_adamw_writes_b16)
{
    check_adamw_b16(0.0);
    check_adamw_b16(0.5);
    check_adamw_b16(1.0);
}
END_TEST

// Three AdamW steps with a share of the update offloaded to the host, streamed in pieces of
// `piece` parameters (0: the default, larger than this model) through the two staging slots,
// must give the parameters of the run without offload bit for bit (the host's AdamW is the
// CPU backend's, as here): a piece boundary inside a segment, an odd last piece and a
// segment cut by the offload fraction change nothing. moments16: bf16 moments.
static float *offload_run(double offload, size_t piece, int moments16, size_t *n)
{
    char err[512];
    lb_model_config cfg = tiny_config("qwen3_moe");
    lb_model *m = lb_model_create(&cfg, be, err, sizeof err);
    ck_assert_msg(m != NULL, "%s", err);
    lb_model_init_params(m, 4);
    lb_optim_config oc = {.lr = 1e-2, .min_lr = 1e-3, .total_steps = 10, .beta1 = 0.9,
                          .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .grad_clip = 1.0,
                          .offload = offload, .offload_threads = 1, .moments16 = moments16};
    lb_optimizer o;
    lb_optimizer_init(&o, m, &oc);
    if (offload > 0) ck_assert_int_gt(o.npiece, piece ? 2 : 0);
    int32_t tok[B * T], tgt[B * T];
    batch(tok, tgt, cfg.vocab_size);
    for (int step = 1; step <= 3; step++) {
        lb_model_zero_grad(m);
        lb_model_forward(m, tok, tgt, B, T);
        lb_model_backward(m, 1.0f);
        lb_optimizer_step(&o, step, NULL);
    }
    *n = m->nparams;
    float *p = lb_malloc(m->nparams * sizeof *p);
    memcpy(p, m->params, m->nparams * sizeof *p);
    lb_optimizer_free(&o);
    lb_model_free(m);
    return p;
}

START_TEST(test_offload_pieces)
{
    for (int m16 = 0; m16 < 2; m16++) {
        size_t n;
        float *want = offload_run(0.0, 0, m16, &n);
        const double share[] = {0.37, 1.0};
        const size_t piece[] = {0, 97};
        for (int f = 0; f < 2; f++)
            for (int k = 0; k < 2; k++) {
                float *got = offload_run(share[f], piece[k], m16, &n);
                size_t i = 0;
                while (i < n && !memcmp(&got[i], &want[i], sizeof *got)) i++;
                ck_assert_msg(i == n, "offload %g, pieces of %zu%s: parameter %zu is %.9g, "
                              "without offload %.9g", share[f], piece[k],
                              m16 ? ", bf16 moments" : "", i, got[i], want[i]);
                free(got);
            }
        free(want);
    }
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

// A trained_model's model and moments freed.
static void free_trained(lb_model *m, float *am, float *av)
{
    be->free(be, am);
    be->free(be, av);
    lb_model_free(m);
}

static const char *save_one(const char *dir, const char *name, lb_model *m, float *am, float *av)
{
    static char path[512];
    char err[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    lb_train_state st = {17, 2, 12345};
    int rc = lb_checkpoint_save(path, m, am, av, &st, "[model]\narch = qwen3_moe\n", NULL, err,
                                sizeof err);
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
    free_trained(m, am, av);
    free_trained(n, bm, bv);
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
    free_trained(n, bm, bv);
}

START_TEST(test_checkpoint_bad)
{
    float *am, *av;
    lb_model *m = trained_model("qwen3_moe", &am, &av);
    const char *dir = lb_test_tmpdir();
    char path[600], cmd[1400];
    snprintf(path, sizeof path, "%s", save_one(dir, "good.safetensors", m, am, av));
    // another model's tensors
    expect_load_error(path, "qwen3", "a checkpoint of another model");
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
    free_trained(m, am, av);
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
    free_trained(n, bm, bv);
    free_trained(m, am, av);
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
    tcase_add_test(tc, test_grad_llama);
    tcase_add_test(tc, test_grad_glm4_moe);
    tcase_add_test(tc, test_router_bias_update);
    tcase_add_test(tc, test_loss_independent_of_batch);
    tcase_add_test(tc, test_zero_grad_lazy);
    tcase_add_test(tc, test_forward_train);
    tcase_add_test(tc, test_adamw_writes_b16);
    tcase_add_test(tc, test_offload_pieces);
    tcase_add_test(tc, test_checkpoint_roundtrip);
    tcase_add_test(tc, test_checkpoint_bad);
    tcase_add_test(tc, test_checkpoint_other_shape);
    suite_add_tcase(s, tc);
    return lb_test_run(s);
}
