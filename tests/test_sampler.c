// test_sampler.c: the sampling path and its agreement with training, on the CPU reference.
//
// - attention over a KV cache (fp32 and fp8) against attention_fwd, bitwise;
// - cross_entropy_bwd_rows against cross_entropy_bwd, bitwise, row by row;
// - the cached forward (prefill in chunks, decode, rows of several sequences interleaved in
//   any order) against the training forward's logits, bitwise, for every precision recipe;
// - log-probs of a sequence alone and inside a batch of 16, bitwise, for every recipe;
// - the decode step's graph: recorded, replayed, the same draws;
// - the sampler: top-k = 1 is greedy on the training forward's logits; the recorded log-probs
//   are the trainer's and the definition's (softmax(logits / T)); the same seeds give the same
//   completions whatever the batch composition, slot count, forward size or request order;
//   top-k and top-p keep only the allowed tokens, and the draw follows the probabilities;
// - the backward through per-token weights (finite differences of a weighted log-prob sum);
// - reward functions and the external reward command, including its errors.
// Where a CUDA device is present, test_gpu runs the kernel, model and sampler checks on the
// CUDA backend too (its cached path against its own training path, bitwise).
#include "lb_autoconf.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kernels/common.h"
#include "kernels/quant/quant.h"
#include "kernels/sample.h"
#include "models/model.h"
#include "src/rl/reward.h"
#include "src/rl/sampler.h"
#include "tests/testutil.h"

static lb_backend *be;

// every recipe of the contract's table
#define NRECIPES lb_recipe_count()
#define recipes(r) lb_recipe_name(r)

static lb_model_config tiny_config(const char *arch)
{
    lb_model_config c = lb_test_tiny_config(arch, 40, 32, 4, 16);
    c.router_aux_loss_coef = strcmp(arch, "glm4_moe") ? 0.01 : 0.0;   // the sigmoid router: none
    return c;
}

// A model under `recipe` with every role quantized (nothing kept in BF16: the strictest case).
static lb_model *make_model(const char *arch, const char *recipe, int kv_fp8, uint64_t seed)
{
    char err[512];
    lb_model_config cfg = tiny_config(arch);
    lb_model *m = lb_model_create(&cfg, be, err, sizeof err);
    ck_assert_msg(m != NULL, "%s", err);
    char words[96];   // no roles kept in bf16, NVFP4 weights in 1x16 blocks
    snprintf(words, sizeof words, "recipe=%s keep_bf16_roles= nvfp4_weight_blocks=1x16", recipe);
    lb_precision_spec spec = lb_test_spec_words(words);
    ck_assert_msg(lb_model_set_precision(m, &spec, 3, err, sizeof err) == 0, "%s", err);
    lb_model_init_params(m, seed);
    lb_model_set_kv_fp8(m, kv_fp8);
    return m;
}

// Whether the backend has the operations a recipe needs (the CUDA backend grows them).
static int recipe_ok(const char *r)
{
    if (!strcmp(r, "fp32")) return 1;
    if (!strcmp(r, "bf16")) return be->round_bf16 != NULL;
    return be->quantize && be->gemm_q && be->round_bf16;
}

static float *randn(size_t n, uint64_t stream)
{
    float *x = lb_malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) x[i] = lb_rand_normal(11, stream, i);
    return x;
}

// Backend copies of host arrays and host copies of backend buffers (the GPU case runs the
// same checks as the CPU).
static void *dev(const void *h, size_t bytes)
{
    void *d = be->alloc(be, bytes);
    be->upload(be, d, h, bytes);
    return d;
}

static void *host(const void *d, size_t bytes)
{
    void *h = lb_malloc(bytes ? bytes : 1);
    be->download(be, h, d, bytes);
    return h;
}

// ---- kernel operations ------------------------------------------------------------------------

// b sequences of t tokens through attention_fwd, and the same rows appended to a cache in a
// scrambled order (sequence bi in slot perm[bi]) and read back by attention_cached, one call per
// chunk of rows in another order. fp8: k and v go through the fp8-block quantization first (the
// training forward's fake quantization), the cache stores the codes. bf16: both in bf16 mode,
// over 130 positions (three of its 64-key chunks). store16: the cache holds bf16 rows (bf16
// mode only).
static void cached_attention_case(int d, int fp8, int bf16, int store16)
{
    enum { Bq = 3, HQ = 4, HKV = 2 };
    const int Tq = bf16 ? 130 : 37;
    size_t nq = (size_t)Bq * Tq * HQ * d, nk = (size_t)Bq * Tq * HKV * d;
    float *q = randn(nq, 1), *k = randn(nk, 2), *v = randn(nk, 3);
    float *dq = dev(q, nq * 4), *dk = dev(k, nk * 4), *dv = dev(v, nk * 4);
    float *dout = be->alloc(be, nq * 4), *dlse = be->alloc(be, (size_t)Bq * HQ * Tq * 4);
    lb_quant_args qa;
    memset(&qa, 0, sizeof qa);
    qa.fmt = LB_FMT_FP8_BLOCK;
    if (fp8) {   // what the training forward does with the fp8 KV numerics
        lb_qmat t;
        memset(&t, 0, sizeof t);
        be->qmat_alloc(be, &t, Bq * Tq * HKV, d, &qa);
        float *kq = be->alloc(be, nk * 4), *vq = be->alloc(be, nk * 4);
        be->quantize(be, &t, lb_act_f32(dk, Bq * Tq * HKV, d), &qa);
        be->dequantize(be, kq, &t);
        be->quantize(be, &t, lb_act_f32(dv, Bq * Tq * HKV, d), &qa);
        be->dequantize(be, vq, &t);
        be->qmat_free(be, &t);
        be->attention_fwd(be, &(lb_attention_args){.out = dout, .lse = dlse, .q = dq, .k = kq,
                .v = vq, .b = Bq, .t = Tq, .hq = HQ, .hkv = HKV, .d = d, .bf16 = bf16});
        be->free(be, kq), be->free(be, vq);
    } else {
        be->attention_fwd(be, &(lb_attention_args){.out = dout, .lse = dlse, .q = dq, .k = dk,
                .v = dv, .b = Bq, .t = Tq, .hq = HQ, .hkv = HKV, .d = d, .bf16 = bf16});
    }
    float *out = host(dout, nq * 4);
    // the cache: 5 slots, capacity Tq + 3; sequence bi lives in slot perm[bi]
    const int perm[Bq] = {4, 0, 2};
    lb_kv_layer c = {.fp8 = fp8, .slots = 5, .cap = Tq + 3, .hkv = HKV, .d = d, .bf16 = store16};
    size_t rows = (size_t)c.slots * c.cap * HKV, nb = ((size_t)d + 127) / 128;
    size_t cbytes = rows * lb_kv_ld(&c) * (fp8 ? 1 : store16 ? 2 : 4);
    unsigned char *poison = lb_malloc(cbytes);
    memset(poison, 0xff, cbytes);   // NaN: an unwritten position must not be read
    c.k = dev(poison, cbytes);
    c.v = dev(poison, cbytes);
    free(poison);
    if (fp8) c.ks = be->alloc(be, rows * nb * 4), c.vs = be->alloc(be, rows * nb * 4);
    // rows in chunks: position-major over sequences, so a call mixes sequences; each row is
    // appended before (or in the same call as) any row that attends to it
    float *got = lb_malloc(nq * sizeof(float));
    enum { CH = 7 };
    int32_t slot[CH], pos[CH];
    float *qc = lb_malloc((size_t)CH * HQ * d * 4), *kc = lb_malloc((size_t)CH * HKV * d * 4);
    float *vc = lb_malloc((size_t)CH * HKV * d * 4);
    size_t qrow = (size_t)HQ * d * 4, krow = (size_t)HKV * d * 4;   // bytes per token
    float *dqc = be->alloc(be, CH * qrow), *dkc = be->alloc(be, CH * krow);
    float *dvc = be->alloc(be, CH * krow), *doc = be->alloc(be, CH * qrow);
    int32_t *dslot = be->alloc(be, CH * 4), *dpos = be->alloc(be, CH * 4);
    int *order = lb_malloc((size_t)Bq * Tq * sizeof(int)), no = 0;
    for (int t = 0; t < Tq; t++)
        for (int b = Bq - 1; b >= 0; b--) order[no++] = b * Tq + t;
    for (int r0 = 0; r0 < no; r0 += CH) {
        int n = r0 + CH <= no ? CH : no - r0;
        for (int i = 0; i < n; i++) {
            int r = order[r0 + i], b = r / Tq, t = r % Tq;
            slot[i] = perm[b];
            pos[i] = t;
            memcpy(qc + (size_t)i * HQ * d, q + (size_t)r * HQ * d, (size_t)HQ * d * 4);
            memcpy(kc + (size_t)i * HKV * d, k + (size_t)r * HKV * d, (size_t)HKV * d * 4);
            memcpy(vc + (size_t)i * HKV * d, v + (size_t)r * HKV * d, (size_t)HKV * d * 4);
        }
        be->upload(be, dqc, qc, (size_t)n * HQ * d * 4);
        be->upload(be, dkc, kc, (size_t)n * HKV * d * 4);
        be->upload(be, dvc, vc, (size_t)n * HKV * d * 4);
        be->upload(be, dslot, slot, (size_t)n * 4);
        be->upload(be, dpos, pos, (size_t)n * 4);
        if (fp8) {
            lb_qmat a, bq;
            memset(&a, 0, sizeof a);
            memset(&bq, 0, sizeof bq);
            be->qmat_alloc(be, &a, n * HKV, d, &qa);
            be->qmat_alloc(be, &bq, n * HKV, d, &qa);
            be->quantize(be, &a, lb_act_f32(dkc, n * HKV, d), &qa);
            be->quantize(be, &bq, lb_act_f32(dvc, n * HKV, d), &qa);
            be->kv_append(be, &c, NULL, NULL, &a, &bq, dslot, dpos, n);
            be->qmat_free(be, &a);
            be->qmat_free(be, &bq);
        } else {
            be->kv_append(be, &c, dkc, dvc, NULL, NULL, dslot, dpos, n);
        }
        be->attention_cached(be, doc, dqc, &c, dslot, dpos, n, HQ, bf16);
        float *oc = host(doc, (size_t)n * HQ * d * 4);
        for (int i = 0; i < n; i++)
            memcpy(got + (size_t)order[r0 + i] * HQ * d, oc + (size_t)i * HQ * d,
                   (size_t)HQ * d * 4);
        free(oc);
    }
    for (size_t i = 0; i < nq; i++)
        ck_assert_msg(memcmp(&got[i], &out[i], 4) == 0,
                      "%s d %d fp8 %d bf16 %d store16 %d: element %zu: cached %.9g, training "
                      "%.9g", be->name, d, fp8, bf16, store16, i, (double)got[i], (double)out[i]);
    void *bufs[] = {dq, dk, dv, dout, dlse, c.k, c.v, c.ks, c.vs, dqc, dkc, dvc, doc, dslot, dpos};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) be->free(be, bufs[i]);
    free(q), free(k), free(v), free(out), free(got), free(qc), free(kc), free(vc), free(order);
}

static void attention_cached_cases(void)
{
    // bf16 mode: d 72 is no multiple of the tensor-core kernels' 16-wide tiles; 160 (two fp8
    // blocks per row) is beyond the CUDA bf16 kernels' 128, so the CPU alone runs it.
    int cpu = !strcmp(be->name, "cpu");
    cached_attention_case(8, 0, 0, 0);
    cached_attention_case(160, 0, 0, 0);
    for (int s16 = 0; s16 < 2; s16++) {   // fp32 rows, then bf16 rows (the same logits)
        cached_attention_case(8, 0, 1, s16);
        cached_attention_case(72, 0, 1, s16);
        if (cpu) cached_attention_case(160, 0, 1, s16);
    }
    if (!be->quantize) return;   // a backend without the codecs has no fp8 cache yet
    cached_attention_case(8, 1, 0, 0);
    cached_attention_case(160, 1, 0, 0);   // two fp8 blocks per row
    cached_attention_case(8, 1, 1, 0);
    cached_attention_case(72, 1, 1, 0);
    if (cpu) cached_attention_case(160, 1, 1, 0);
}

START_TEST(test_attention_cached) { attention_cached_cases(); }
END_TEST

static void ce_rows_case(void)
{
    enum { N = 9, V = 37 };
    float *l = randn((size_t)N * V, 4);
    int32_t tg[N];
    float w[N];
    for (int i = 0; i < N; i++) {
        tg[i] = i == 4 ? -1 : (int32_t)(lb_rand_u64(2, 2, i) % V);
        w[i] = lb_rand_normal(2, 3, i);
    }
    size_t bytes = sizeof(float) * N * V;
    float *dl = dev(l, bytes), *dw = dev(w, sizeof w), *drows = be->alloc(be, bytes);
    float *done = be->alloc(be, bytes);
    int32_t *dtg = dev(tg, sizeof tg);
    be->cross_entropy_bwd_rows(be, drows, dl, NULL, dtg, dw, N, V);
    float *rows = host(drows, bytes);
    for (int i = 0; i < N; i++) {   // row i equals the scalar op with dloss = w[i]
        be->cross_entropy_bwd(be, done, dl, NULL, dtg, w[i], N, V);
        float *one = host(done, bytes);
        ck_assert_msg(memcmp(rows + i * V, one + i * V, V * sizeof(float)) == 0, "%s: row %d",
                      be->name, i);
        free(one);
    }
    for (int j = 0; j < V; j++) ck_assert(rows[4 * V + j] == 0.0f);   // ignored target
    // aliasing the logits, as the model does
    be->cross_entropy_bwd_rows(be, dl, dl, NULL, dtg, dw, N, V);
    float *alias = host(dl, bytes);
    ck_assert(memcmp(alias, rows, bytes) == 0);
    be->free(be, dl), be->free(be, dw), be->free(be, drows), be->free(be, done), be->free(be, dtg);
    free(l), free(rows), free(alias);
}

START_TEST(test_cross_entropy_bwd_rows) { ce_rows_case(); }
END_TEST

// ---- the model: cached forward and log-probs -------------------------------------------------

enum { NSEQ = 3, TSEQ = 19 };

static void seq_tokens(int32_t *tok, int vocab, uint64_t seed)
{
    for (int i = 0; i < NSEQ * TSEQ; i++) tok[i] = (int32_t)(lb_rand_u64(seed, 5, i) % vocab);
}

// Training forward of NSEQ sequences; then the cached forward: sequence b in slot 2 - b, its
// first `pre[b]` tokens prefilled, the rest decoded one token per call with the sequences
// interleaved (and one call mixing a prefill chunk with decode rows).
static void cached_vs_training(const char *arch, const char *recipe, int kv_fp8)
{
    lb_model *m = make_model(arch, recipe, kv_fp8, 21);
    int V = m->cfg.vocab_size;
    int32_t tok[NSEQ * TSEQ];
    seq_tokens(tok, V, 8);
    lb_model_forward(m, tok, NULL, NSEQ, TSEQ);
    size_t nl = (size_t)NSEQ * TSEQ * V;
    float *want = host(m->logits, nl * 4), *got = lb_malloc(nl * 4);
    for (size_t i = 0; i < nl; i++) got[i] = NAN;
    lb_kvcache *kv = lb_kvcache_create(m, 3, 32, 16, 16);
    const int pre[NSEQ] = {5, 1, 9};
    int fed[NSEQ] = {0, 0, 0};
    int32_t t[16], s[16], p[16], who[16];
    // call 1: prefill of sequences 0 and 1; call 2: sequence 2's prefill with decodes of 0, 1
    for (int call = 0; ; call++) {
        int n = 0;
        for (int b = 0; b < NSEQ; b++) {
            int want_rows = call == 0 ? (b < 2 ? pre[b] : 0) : call == 1 && b == 2 ? pre[b] : 1;
            for (int r = 0; r < want_rows && fed[b] < TSEQ; r++) {
                t[n] = tok[b * TSEQ + fed[b]];
                s[n] = 2 - b;
                p[n] = fed[b];
                who[n] = b * TSEQ + fed[b];
                n++;
                fed[b]++;
            }
        }
        if (!n) break;
        lb_model_forward_cached(m, kv, t, s, p, n);
        float *lg = host(kv->logits, (size_t)n * V * 4);
        for (int i = 0; i < n; i++) memcpy(got + (size_t)who[i] * V, lg + (size_t)i * V, V * 4);
        free(lg);
    }
    for (size_t i = 0; i < nl; i++)
        ck_assert_msg(memcmp(&got[i], &want[i], 4) == 0,
                      "%s %s kv_fp8 %d: logit %zu (token %zu): cached %.9g, training %.9g", arch,
                      recipe, kv_fp8, i, i / V, (double)got[i], (double)want[i]);
    lb_kvcache_free(m, kv);
    free(want), free(got);
    lb_model_free(m);
}

static void cached_forward_cases(void)
{
    for (int r = 0; r < NRECIPES; r++)
        if (recipe_ok(recipes(r))) cached_vs_training("qwen3_moe", recipes(r), 0);
    if (!recipe_ok("nvfp4-moe")) return;
    cached_vs_training("qwen3_moe", "fp32", 1);
    cached_vs_training("qwen3_moe", "nvfp4-moe", 1);
    cached_vs_training("qwen3", "mxfp8", 0);
    cached_vs_training("llama", "fp8-block", 0);   // no q/k norm, llama3 RoPE
    cached_vs_training("llama", "bf16", 1);
    cached_vs_training("glm4_moe", "fp8-block", 0);   // sigmoid router, shared expert, biases
    cached_vs_training("glm4_moe", "bf16", 1);
}

START_TEST(test_cached_forward_equals_training) { cached_forward_cases(); }
END_TEST

// One sequence's log-probs alone (b = 1) and as sequence 11 of a batch of 16 (the others
// random, of other lengths' padding), bitwise; every recipe, temperature 0.7.
static void logprobs_1_vs_16_cases(void)
{
    enum { BT = 16, T = 13 };
    for (int r = 0; r < NRECIPES; r++) {
        if (!recipe_ok(recipes(r))) continue;
        lb_model *m = make_model("qwen3_moe", recipes(r), !strcmp(recipes(r), "nvfp4-moe"), 33);
        int V = m->cfg.vocab_size;
        int32_t tok[BT * T], tgt[BT * T];
        for (int i = 0; i < BT * T; i++) {
            tok[i] = (int32_t)(lb_rand_u64(4, 1, i) % V);
            tgt[i] = i % T < 3 || i % T == T - 1 ? -1 : (int32_t)(lb_rand_u64(4, 2, i) % V);
        }
        float lp16[BT * T], lp1[T];
        lb_model_forward_logprobs(m, tok, tgt, BT, T, 1.0f / 0.7f, lp16);
        lb_model_forward_logprobs(m, tok + 11 * T, tgt + 11 * T, 1, T, 1.0f / 0.7f, lp1);
        for (int i = 0; i < T; i++) {
            ck_assert_msg(memcmp(&lp1[i], &lp16[11 * T + i], 4) == 0,
                          "%s: position %d: alone %.9g, in a batch of 16 %.9g", recipes(r), i,
                          (double)lp1[i], (double)lp16[11 * T + i]);
            if (tgt[11 * T + i] < 0) ck_assert(lp1[i] == 0.0f);
            else ck_assert(lp1[i] < 0.0f);
        }
        lb_model_free(m);
    }
}

START_TEST(test_logprobs_batch_1_vs_16) { logprobs_1_vs_16_cases(); }
END_TEST

// d/dp of sum_i w_i lp_i through lb_model_backward_logprobs against central differences.
START_TEST(test_backward_logprobs_gradcheck)
{
    enum { BG = 2, T = 6 };
    lb_model *m = make_model("qwen3_moe", "fp32", 0, 5);
    m->cfg.router_aux_loss_coef = 0.0;
    int V = m->cfg.vocab_size;
    int32_t tok[BG * T], tgt[BG * T];
    float w[BG * T], lp[BG * T];
    for (int i = 0; i < BG * T; i++) {
        tok[i] = (int32_t)(lb_rand_u64(6, 1, i) % V);
        tgt[i] = i % T < 2 ? -1 : (int32_t)(lb_rand_u64(6, 2, i) % V);
        w[i] = tgt[i] < 0 ? 0.0f : lb_rand_normal(6, 3, i);
    }
    const float it = 1.0f / 1.3f;
    lb_model_zero_grad(m);
    lb_model_forward_logprobs(m, tok, tgt, BG, T, it, lp);
    lb_model_backward_logprobs(m, w, 0.0f);
    float *p = m->params, *g = m->grads;
    double num = 0.0, den = 0.0;
    const float h = 1e-3f;
    for (int s = 0; s < 60; s++) {
        size_t j = lb_rand_u64(6, 4, s) % m->nparams;
        float keep = p[j];
        double f[2];
        for (int sgn = 0; sgn < 2; sgn++) {
            p[j] = keep + (sgn ? -h : h);
            lb_model_params_changed(m, 0);
            lb_model_forward_logprobs(m, tok, tgt, BG, T, it, lp);
            f[sgn] = 0.0;
            for (int i = 0; i < BG * T; i++) f[sgn] += (double)w[i] * lp[i];
        }
        p[j] = keep;
        double fd = (f[0] - f[1]) / (2.0 * h);
        num += (fd - g[j]) * (fd - g[j]);
        den += (double)g[j] * g[j];
    }
    ck_assert_msg(den > 0.0, "no gradient reached the sampled parameters");
    ck_assert_msg(sqrt(num / den) < 2e-2, "relative error %.3g", sqrt(num / den));
    lb_model_free(m);
}
END_TEST

// ---- the sampler -------------------------------------------------------------------------------

enum { NREQ = 7, MAXNEW = 9 };

typedef struct {
    int32_t prompt[NREQ][8];
    int plen[NREQ];
    int32_t tok[NREQ][MAXNEW];
    float lp[NREQ][MAXNEW];
    uint16_t routes[NREQ][(8 + MAXNEW) * 8];   // (position, layer, k): layers x k <= 8
    lb_sample_req req[NREQ];
} req_set;

static void make_reqs(req_set *r, int vocab, uint64_t seed)
{
    memset(r, 0, sizeof *r);
    for (int i = 0; i < NREQ; i++) {
        r->plen[i] = 1 + i % 6;
        for (int j = 0; j < r->plen[i]; j++)
            r->prompt[i][j] = (int32_t)(lb_rand_u64(9, i, j) % vocab);
        r->req[i] = (lb_sample_req){r->prompt[i], r->plen[i], seed, lb_sample_stream(i, 0),
                                    r->tok[i], r->lp[i], 0, 0, r->routes[i]};
    }
}

static lb_sampler_config scfg(float temp, int top_k, float top_p, int slots, int max_rows)
{
    lb_sampler_config c = {temp, top_p, top_k, MAXNEW, 1, {7}, slots, max_rows};
    return c;
}

static void run_sampler(lb_model *m, const lb_sampler_config *c, lb_sample_req *reqs, int n)
{
    char err[512];
    lb_sampler *s = lb_sampler_create(m, c, 16, err, sizeof err);
    ck_assert_msg(s != NULL, "%s", err);
    lb_sample_stats st;
    ck_assert_msg(lb_sampler_run(s, reqs, n, &st, err, sizeof err) == 0, "%s", err);
    ck_assert_int_gt(st.forwards, 0);
    // The decode stretches: no forward that fed prompt rows among them (each feeds at most
    // max_rows), and where every prompt fits the first forward, all the others.
    long prompt_rows = 0, most = 0;
    for (int i = 0; i < n; i++) {
        prompt_rows += reqs[i].prompt_len;
        most = reqs[i].len > most ? reqs[i].len : most;
    }
    ck_assert_int_eq(st.prefill_tokens, prompt_rows);
    ck_assert_int_le(st.decode_forwards,
                     st.forwards - (prompt_rows + c->max_rows - 1) / c->max_rows);
    ck_assert(st.decode_seconds >= 0.0 && st.decode_seconds <= st.seconds);
    if (c->slots >= n && (long)c->max_rows >= prompt_rows)
        ck_assert_int_eq(st.decode_forwards, most - 1);
    lb_sampler_free(s);
}

// The trainer's view of request q: the log-probs of its completion from the training forward,
// and the logits rows that produced each token.
static void trainer_logprobs(lb_model *m, const lb_sample_req *q, float temp, float *lp,
                             float *logits_rows)
{
    int T = q->prompt_len + q->len, V = m->cfg.vocab_size;
    int32_t tok[32], tgt[32];
    float all[32];
    for (int i = 0; i < T; i++) {
        tok[i] = i < q->prompt_len ? q->prompt[i] : q->tokens[i - q->prompt_len];
        tgt[i] = i >= q->prompt_len - 1 && i + 1 < T ? q->tokens[i + 1 - q->prompt_len] : -1;
    }
    lb_model_forward_logprobs(m, tok, tgt, 1, T, 1.0f / temp, all);
    float *lg = host(m->logits, (size_t)T * V * 4);
    for (int j = 0; j < q->len; j++) {
        lp[j] = all[q->prompt_len - 1 + j];
        if (logits_rows)
            memcpy(logits_rows + (size_t)j * V, lg + (size_t)(q->prompt_len - 1 + j) * V, V * 4);
    }
    free(lg);
}

static void greedy_cases(void)
{
    for (int r = 0; r < NRECIPES; r++) {
        if (!recipe_ok(recipes(r))) continue;
        lb_model *m = make_model("qwen3_moe", recipes(r), 0, 41);
        int V = m->cfg.vocab_size;
        req_set rs;
        make_reqs(&rs, V, 1);
        lb_sampler_config c = scfg(0.8f, 1, 1.0f, 3, 8);
        run_sampler(m, &c, rs.req, NREQ);
        float lp[MAXNEW], rows[MAXNEW * 40];
        for (int i = 0; i < NREQ; i++) {
            const lb_sample_req *q = &rs.req[i];
            ck_assert(q->len >= 1 && q->len <= MAXNEW);
            ck_assert(q->stopped == (q->tokens[q->len - 1] == 7));
            ck_assert(q->stopped || q->len == MAXNEW);
            trainer_logprobs(m, q, 0.8f, lp, rows);
            for (int j = 0; j < q->len; j++) {
                // greedy: the first maximum of the training forward's logits row
                const float *row = rows + (size_t)j * V;
                int arg = 0;
                for (int x = 1; x < V; x++)
                    if (row[x] > row[arg]) arg = x;
                ck_assert_msg(q->tokens[j] == arg, "%s: request %d token %d is %d, argmax %d",
                              recipes(r), i, j, q->tokens[j], arg);
                ck_assert_msg(memcmp(&lp[j], &q->logprobs[j], 4) == 0,
                              "%s: request %d token %d: trainer %.9g, sampler %.9g", recipes(r),
                              i, j, (double)lp[j], (double)q->logprobs[j]);
                // the definition: log softmax(logits / T) (the rows are already tempered)
                double mx = row[0], sum = 0.0;
                for (int x = 1; x < V; x++) mx = fmax(mx, row[x]);
                for (int x = 0; x < V; x++) sum += exp((double)row[x] - mx);
                double want = (double)row[q->tokens[j]] - mx - log(sum);
                ck_assert_msg(fabs(want - q->logprobs[j]) < 1e-5, "log-prob %.9g, want %.9g",
                              (double)q->logprobs[j], want);
            }
        }
        lb_model_free(m);
    }
}

START_TEST(test_sampler_greedy_and_logprobs) { greedy_cases(); }
END_TEST

// The decode step's graph (graph_record): recorded on a shape's second step in a row, then
// replayed, the same draws run after run (the graphs dropped at each run's end); none where
// the cached forward waits for the host (fp32 experts: their counts come to the host).
static void graphs_case(void)
{
    const char *off = getenv("LB_CUDA_GRAPHS"), *sync = getenv("LB_CUDA_SYNC");
    const int on = lb_backend_supports(be, LB_OP_graph_record) && !(off && *off == '0') &&
                   !(sync && *sync && *sync != '0');
    for (int r = 0; r < 2; r++) {
        const char *recipe = r ? "fp32" : "bf16";
        lb_model *m = make_model("qwen3_moe", recipe, 0, 45);
        req_set rs;
        make_reqs(&rs, m->cfg.vocab_size, 3);
        lb_sampler_config c = scfg(1.0f, 0, 1.0f, 2, 8);
        c.nstop = 0;   // both run to MAXNEW
        char err[512];
        lb_sampler *s = lb_sampler_create(m, &c, 16, err, sizeof err);
        ck_assert_msg(s != NULL, "%s", err);
        int32_t tok[2][MAXNEW];
        float lp[2][MAXNEW];
        long replays = -1;
        for (int run = 0; run < 2; run++) {
            lb_sample_stats st;
            ck_assert_msg(lb_sampler_run(s, rs.req, 2, &st, err, sizeof err) == 0, "%s", err);
            // one forward of both prompts, then MAXNEW - 1 steps of 2 rows: the first eager,
            // the second recorded, the rest replays
            ck_assert_int_eq(st.forwards, MAXNEW);
            ck_assert_msg(st.graph_forwards == (on && r == 0 ? MAXNEW - 3 : 0),
                          "%s: %ld replays", recipe, st.graph_forwards);
            for (int i = 0; i < 2; i++) {
                ck_assert_int_eq(rs.req[i].len, MAXNEW);
                if (run == 0) {
                    memcpy(tok[i], rs.req[i].tokens, sizeof tok[i]);
                    memcpy(lp[i], rs.req[i].logprobs, sizeof lp[i]);
                } else {
                    ck_assert(memcmp(tok[i], rs.req[i].tokens, sizeof tok[i]) == 0);
                    ck_assert(memcmp(lp[i], rs.req[i].logprobs, sizeof lp[i]) == 0);
                }
            }
            if (run == 1) ck_assert_int_eq(st.graph_forwards, replays);
            replays = st.graph_forwards;
        }
        lb_sampler_free(s);
        lb_model_free(m);
    }
}

START_TEST(test_sampler_graphs) { graphs_case(); }
END_TEST

static int same_results(const req_set *a, const req_set *b)
{
    for (int i = 0; i < NREQ; i++) {
        if (a->req[i].len != b->req[i].len || a->req[i].stopped != b->req[i].stopped) return 0;
        if (memcmp(a->tok[i], b->tok[i], a->req[i].len * 4) ||
            memcmp(a->lp[i], b->lp[i], a->req[i].len * 4))
            return 0;
    }
    return 1;
}

// The routes the sampler recorded for request q (every token it fed: prompt, then the
// completion but its last token) against the training forward's over the same tokens, bitwise.
static void check_routes(lb_model *m, const lb_sample_req *q, const char *what)
{
    const int L = m->cfg.num_hidden_layers, K = m->def->route_k(&m->cfg);
    const int T = q->prompt_len + q->len - 1;
    ck_assert(K > 0 && L * K <= 8 && T >= 1 && T <= 32);
    int32_t tok[32], tgt[32], log[32 * 8];
    float lp[32];
    for (int i = 0; i < T; i++) {
        tok[i] = i < q->prompt_len ? q->prompt[i] : q->tokens[i - q->prompt_len];
        tgt[i] = -1;
    }
    m->route_log = log;
    lb_model_forward_logprobs(m, tok, tgt, 1, T, 1.0f, lp);
    m->route_log = NULL;
    for (int i = 0; i < T; i++)
        for (int l = 0; l < L; l++)
            for (int j = 0; j < K; j++)
                ck_assert_msg(q->routes[(i * L + l) * K + j] == log[(l * T + i) * K + j],
                              "%s: position %d layer %d choice %d: sampler %d, trainer %d", what,
                              i, l, j, q->routes[(i * L + l) * K + j], log[(l * T + i) * K + j]);
}

// The same seeds give the same completions and bitwise the same log-probs with one slot, with
// three, with all requests at once and tiny or large forward calls, and with the requests
// given in reverse order (each request keeps its own stream); another seed changes them.
static void batch_composition_cases(void)
{
    for (int r = 0; r < NRECIPES; r += 2) {
        lb_model *m = make_model("qwen3_moe", recipes(r), 0, 43);
        int V = m->cfg.vocab_size;
        req_set base, other;
        make_reqs(&base, V, 77);
        lb_sampler_config c = scfg(1.3f, 0, 1.0f, 1, 1);
        run_sampler(m, &c, base.req, NREQ);
        const int slots[] = {3, 7, 16}, rows[] = {3, 64, 16};
        for (int k = 0; k < 3; k++) {
            make_reqs(&other, V, 77);
            c = scfg(1.3f, 0, 1.0f, slots[k], rows[k]);
            run_sampler(m, &c, other.req, NREQ);
            ck_assert_msg(same_results(&base, &other), "%s: slots %d, rows %d differ",
                          recipes(r), slots[k], rows[k]);
        }
        // reverse order: request i of `other` is request NREQ-1-i of a reversed array
        make_reqs(&other, V, 77);
        lb_sample_req rev[NREQ];
        for (int i = 0; i < NREQ; i++) rev[i] = other.req[NREQ - 1 - i];
        c = scfg(1.3f, 0, 1.0f, 2, 5);
        run_sampler(m, &c, rev, NREQ);
        for (int i = 0; i < NREQ; i++) other.req[NREQ - 1 - i] = rev[i];
        ck_assert_msg(same_results(&base, &other), "%s: reversed order differs", recipes(r));
        // a trainer check on this stochastic run too
        float lp[MAXNEW];
        for (int i = 0; i < NREQ; i++) {
            trainer_logprobs(m, &base.req[i], 1.3f, lp, NULL);
            ck_assert(memcmp(lp, base.lp[i], base.req[i].len * 4) == 0);
            check_routes(m, &base.req[i], recipes(r));
            check_routes(m, &rev[NREQ - 1 - i], recipes(r));   // 2 slots, 5 rows a call
        }
        make_reqs(&other, V, 78);
        run_sampler(m, &c, other.req, NREQ);
        ck_assert_msg(!same_results(&base, &other), "another seed gave the same completions");
        lb_model_free(m);
    }
}

START_TEST(test_sampler_batch_composition) { batch_composition_cases(); }
END_TEST

// lb_sample_token on a fixed row: top-k and top-p keep the allowed tokens only; a grid of u
// reproduces the probabilities (each token's share of the grid is its probability to within
// one grid step); ties go to the lower token.
START_TEST(test_sample_token)
{
    enum { V = 6, U = 100000 };
    const float l[V] = {1.0f, 3.0f, 2.0f, 3.0f, -1.0f, 0.5f};
    double p[V], sum = 0.0;
    for (int j = 0; j < V; j++) sum += p[j] = exp(l[j] - 3.0);
    for (int j = 0; j < V; j++) p[j] /= sum;
    ck_assert_int_eq(lb_sample_draw(l, V, 1, 1.0f, 0.99f), 1);   // tie 1/3: the lower
    int count[V] = {0};
    for (int i = 0; i < U; i++) count[lb_sample_draw(l, V, 0, 1.0f, (i + 0.5f) / U)]++;
    for (int j = 0; j < V; j++)
        ck_assert_msg(fabs((double)count[j] / U - p[j]) < 2.0 / U, "token %d: %d of %d, p %.6f",
                      j, count[j], U, p[j]);
    // top-k = 3 keeps 1, 3, 2 in proportion; top-p = 0.5 keeps the smallest prefix of
    // {1, 3, 2, ...} (sorted, ties by id) holding half the mass: 1 and 3
    int k3[V] = {0}, pp[V] = {0};
    for (int i = 0; i < U; i++) {
        float u = (i + 0.5f) / U;
        k3[lb_sample_draw(l, V, 3, 1.0f, u)]++;
        pp[lb_sample_draw(l, V, 0, 0.5f, u)]++;
    }
    double s3 = p[1] + p[3] + p[2];
    for (int j = 0; j < V; j++) {
        double want3 = j == 1 || j == 2 || j == 3 ? p[j] / s3 : 0.0;
        ck_assert_msg(fabs((double)k3[j] / U - want3) < 2.0 / U, "top-k token %d", j);
        double wantp = j == 1 || j == 3 ? 0.5 : 0.0;
        ck_assert_msg(fabs((double)pp[j] / U - wantp) < 2.0 / U, "top-p token %d", j);
    }
    // tiny top-p: only the first of the sorted order (the lower of the tied maxima)
    for (int i = 0; i < 100; i++) ck_assert_int_eq(lb_sample_draw(l, V, 0, 0.01f, i / 100.0f), 1);
}
END_TEST

// lb_sample_draw against a brute-force reading of kernels.h's rule: the vocabulary sorted by
// (logit descending, id), weights lb_sample_weight summed along it to find the top-k / top-p
// prefix, then the first kept token in id order whose running weight passes the target. Rows
// with many ties, -inf, NaN and +inf, and top-k / top-p at and past their edges.
struct bf_cand { uint32_t key; int32_t j; };
static int bf_cmp(const void *pa, const void *pb)
{
    const struct bf_cand *a = pa, *b = pb;
    if (a->key != b->key) return a->key > b->key ? -1 : 1;
    return (a->j > b->j) - (a->j < b->j);
}

static int32_t brute_draw(const float *l, int v, int top_k, float top_p, float u)
{
    float mx = -INFINITY;
    for (int j = 0; j < v; j++) mx = l[j] > mx ? l[j] : mx;
    int32_t arg = 0;
    for (int j = v - 1; j >= 0; j--) arg = l[j] == mx ? j : arg;
    if (top_k == 1) return arg;
    struct bf_cand *c = lb_malloc((size_t)v * sizeof *c);
    for (int j = 0; j < v; j++) c[j] = (struct bf_cand){lb_sample_key(l[j]), j};
    qsort(c, (size_t)v, sizeof *c, bf_cmp);
    int kept = top_k > 0 && top_k < v ? top_k : v;
    uint64_t mass = 0;
    for (int i = 0; i < kept; i++) mass += lb_sample_weight(l[c[i].j], mx);
    if (top_p < 1.0f) {
        uint64_t need = lb_sample_top_p_need(top_p, mass), cum = 0;
        for (int i = 0; i < kept; i++)
            if ((cum += lb_sample_weight(l[c[i].j], mx)) >= need) {
                kept = i + 1;
                mass = cum;
                break;
            }
    }
    char *in = lb_calloc((size_t)v, 1);
    for (int i = 0; i < kept; i++) in[c[i].j] = 1;
    int32_t t = arg;
    if (mass) {
        uint64_t target = lb_sample_target(u, mass), cum = 0;
        for (int j = 0; j < v; j++)
            if (in[j] && (cum += lb_sample_weight(l[j], mx)) > target) {
                t = j;
                break;
            }
    }
    free(c), free(in);
    return t;
}

START_TEST(test_sample_draw_brute)
{
    const int vs[] = {1, 2, 9, 300, 2049};
    const int ks[] = {0, 1, 2, 5, 299, 300, 301};
    const float ps[] = {1.0f, 0.999f, 0.9f, 0.5f, 1e-9f};
    long checked = 0;
    for (size_t a = 0; a < sizeof vs / sizeof *vs; a++) {
        int v = vs[a];
        float *l = lb_malloc((size_t)v * sizeof *l);
        for (int kind = 0; kind < 5; kind++) {
            for (int j = 0; j < v; j++) {
                float x = 3.0f * lb_rand_normal(kind, v, j);
                if (kind == 1) x = floorf(x);                    // many ties
                if (kind == 2 && j % 7 == 3) x = -INFINITY;
                if (kind == 3 && j % 5 == 1) x = NAN;
                if (kind == 3 && j % 11 == 2) x = -0.0f;
                if (kind == 4) x = j % 3 ? -INFINITY : x * 20.0f;   // wide range
                l[j] = x;
            }
            if (kind == 4 && v > 3) l[v / 2] = INFINITY;
            for (size_t b = 0; b < sizeof ks / sizeof *ks; b++)
                for (size_t p = 0; p < sizeof ps / sizeof *ps; p++)
                    for (int i = 0; i < 40; i++) {
                        float u = lb_rand_uniform(a * 7 + b, kind * 5 + p, i);
                        int32_t got = lb_sample_draw(l, v, ks[b], ps[p], u);
                        int32_t want = brute_draw(l, v, ks[b], ps[p], u);
                        ck_assert_msg(got == want, "v %d kind %d top_k %d top_p %g u %.7f: drew "
                                      "%d, the sorted rule %d", v, kind, ks[b], (double)ps[p],
                                      (double)u, got, want);
                        checked++;
                    }
        }
        free(l);
    }
    ck_assert_int_gt(checked, 1000);
}
END_TEST

// A length limit of 1 and stop tokens: completions end where they must.
START_TEST(test_sampler_limits_and_errors)
{
    char err[512];
    lb_model *m = make_model("qwen3_moe", "fp32", 0, 45);
    req_set rs;
    make_reqs(&rs, m->cfg.vocab_size, 5);
    lb_sampler_config c = scfg(1.0f, 0, 1.0f, 4, 8);
    c.max_new_tokens = 1;
    run_sampler(m, &c, rs.req, NREQ);
    for (int i = 0; i < NREQ; i++) ck_assert_int_eq(rs.req[i].len, 1);
    // every prompt in the first forward: run_sampler's exact count of decode forwards
    c = scfg(1.0f, 0, 1.0f, NREQ, 64);
    make_reqs(&rs, m->cfg.vocab_size, 5);
    run_sampler(m, &c, rs.req, NREQ);
    // every token a stop token: one token each, all stopped
    c = scfg(1.0f, 0, 1.0f, 4, 8);
    c.nstop = 0;
    for (int t = 0; t < LB_SAMPLER_MAX_STOP && t < m->cfg.vocab_size; t++) c.stop[c.nstop++] = t;
    make_reqs(&rs, m->cfg.vocab_size, 5);
    run_sampler(m, &c, rs.req, NREQ);
    for (int i = 0; i < NREQ; i++)
        ck_assert(rs.req[i].stopped == (rs.req[i].tokens[rs.req[i].len - 1] < c.nstop));
    // bad configurations and requests
    c = scfg(0.0f, 0, 1.0f, 4, 8);
    ck_assert_ptr_null(lb_sampler_create(m, &c, 16, err, sizeof err));
    ck_assert_msg(strstr(err, "temperature"), "%s", err);
    c = scfg(1.0f, 0, 1.0f, 4, 3);
    ck_assert_ptr_null(lb_sampler_create(m, &c, 16, err, sizeof err));
    ck_assert_msg(strstr(err, "max_rows (3) is smaller than slots (4)"), "%s", err);
    // more sequences than the backend's memory holds: how many fit, before any allocation
    c = scfg(1.0f, 0, 1.0f, 1 << 28, 1 << 28);
    ck_assert_ptr_null(lb_sampler_create(m, &c, 16, err, sizeof err));
    size_t fit = 0;
    double gib = 0.0;
    const char *h = strstr(err, "backend has ");
    ck_assert_msg(strstr(err, "268435456 slots of 16 positions need") && h &&
                  sscanf(h, "backend has %lf GiB free, which holds %zu slots", &gib, &fit) == 2,
                  "%s", err);
    // the free bytes, to the message's two decimals: fit slots do, one more does not
    const double lo = (gib - 0.005) * (1 << 30), hi = (gib + 0.005) * (1 << 30);
    ck_assert_msg(fit > 0 && fit < (1u << 28) &&
                  (double)lb_kvcache_bytes(m, (int)fit, 16, (int)fit) <= hi &&
                  (double)lb_kvcache_bytes(m, (int)fit + 1, 16, (int)fit + 1) > lo, "%s", err);
    c = scfg(1.0f, 0, 1.0f, 4, 8);
    ck_assert_ptr_null(lb_sampler_create(m, &c, 65, err, sizeof err));
    lb_sampler *s = lb_sampler_create(m, &c, 12, err, sizeof err);
    ck_assert_msg(s != NULL, "%s", err);
    make_reqs(&rs, m->cfg.vocab_size, 5);
    rs.req[2].prompt_len = 5;   // 5 + 9 - 1 > 12
    ck_assert_int_eq(lb_sampler_run(s, rs.req, NREQ, NULL, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "prompt 2 has 5 tokens; 1 to 4 fit"), "%s", err);
    make_reqs(&rs, m->cfg.vocab_size, 5);
    rs.prompt[3][0] = 40;
    ck_assert_int_eq(lb_sampler_run(s, rs.req, NREQ, NULL, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "outside the vocabulary"), "%s", err);
    lb_sampler_free(s);
    lb_model_free(m);
}
END_TEST

// ---- rewards -----------------------------------------------------------------------------------

static double score(const lb_rewards *r, const char *prompt, const char *completion)
{
    char err[512];
    double v = -1;
    size_t n = strlen(completion);
    lb_reward_item it = {prompt, "", completion, n, n && completion[n - 1] == '\n'};
    ck_assert_msg(lb_rewards_score(r, &it, 1, &v, err, sizeof err) == 0, "%s", err);
    return v;
}

static int rewards_init(lb_rewards *r, const char *list, const char *command, char *err,
                        size_t errlen)
{
    lb_rewards_config c = {0.1, "", {command, 1, 1, 0, 0}};
    return lb_rewards_init(r, list, &c, err, errlen);
}

START_TEST(test_rewards_registry)
{
    char err[512];
    lb_rewards r;
    ck_assert_int_eq(rewards_init(&r, "arith_exact, arith_format", "", err, sizeof err), 0);
    ck_assert_int_eq(r.n, 2);
    ck_assert(score(&r, "17+25=", "42\n") == 1.1);
    ck_assert(score(&r, "17+25=", "42") == 1.0);       // cut by the length limit: no format
    ck_assert(score(&r, "17+25=", "43\n") == 0.1);
    ck_assert(score(&r, "30-45=", "-15\n") == 1.1);   // not what the corpus asks, but parsed
    ck_assert(score(&r, "17+25=", "4 2\n") == 0.0);
    ck_assert(score(&r, "17+25=", "\n") == 0.0);
    ck_assert(score(&r, "17+25=", "x42\n") == 0.0);
    ck_assert(score(&r, "junk", "42\n") == 0.1);      // no answer to compare: format only
    ck_assert_int_eq(rewards_init(&r, "arith_exact", "", err, sizeof err), 0);
    ck_assert(score(&r, "17+25=", "42\n") == 1.0);
    ck_assert_int_eq(rewards_init(&r, "arith_exact,nope", "", err, sizeof err), -1);
    ck_assert_str_eq(err, "rl.rewards: unknown reward 'nope' (registered: arith_exact, "
                          "arith_format, arith_digits, answer_exact, answer_regex, "
                          "answer_format)");
    ck_assert_int_eq(rewards_init(&r, " ", "", err, sizeof err), -1);
    ck_assert_msg(strstr(err, "nothing scores"), "%s", err);
    // partial credit by place value
    ck_assert_int_eq(rewards_init(&r, "arith_digits", "", err, sizeof err), 0);
    ck_assert(score(&r, "17+25=", "42\n") == 1.0);
    ck_assert(score(&r, "17+25=", "32\n") == 0.5);
    ck_assert(score(&r, "17+25=", "142\n") == 2.0 / 3.0);
    ck_assert(score(&r, "17+25=", "2") == 0.5);
    ck_assert(score(&r, "17+25=", "4\n") == 0.0);
    ck_assert(score(&r, "5-9=", "-4\n") == 1.0);
    ck_assert(score(&r, "5-9=", "4\n") == 0.5);
    ck_assert(score(&r, "17+25=", "4x\n") == 0.0);
    ck_assert_ptr_nonnull(lb_reward_lookup("arith_format"));
    ck_assert_ptr_null(lb_reward_lookup("arith"));
}
END_TEST

#ifdef LB_HAVE_CUDA
int lb_cuda_device_count(void);   // kernels/cuda/device.cu
static lb_backend *gpu;

// The same checks on the CUDA backend: its cached attention against its own attention_fwd,
// its cached forward against its training forward, its sampler against its trainer, a
// sequence's log-probs alone and in a batch of 16, and seeded completions whatever the batch
// composition, bitwise.
START_TEST(test_gpu)
{
    lb_backend *cpu = be;
    be = gpu;
    attention_cached_cases();
    ce_rows_case();
    cached_forward_cases();
    logprobs_1_vs_16_cases();
    greedy_cases();
    batch_composition_cases();
    graphs_case();
    be = cpu;
}
END_TEST
#endif

int main(void)
{
    char err[256];
    be = lb_backend_cpu_create(0, err, sizeof err);
    if (!be) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    Suite *s = suite_create("sampler");
    TCase *tc = tcase_create("sampler");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_attention_cached);
    tcase_add_test(tc, test_cross_entropy_bwd_rows);
    tcase_add_test(tc, test_cached_forward_equals_training);
    tcase_add_test(tc, test_logprobs_batch_1_vs_16);
    tcase_add_test(tc, test_backward_logprobs_gradcheck);
    tcase_add_test(tc, test_sampler_greedy_and_logprobs);
    tcase_add_test(tc, test_sampler_graphs);
    tcase_add_test(tc, test_sampler_batch_composition);
    tcase_add_test(tc, test_sample_token);
    tcase_add_test(tc, test_sample_draw_brute);
    tcase_add_test(tc, test_sampler_limits_and_errors);
    tcase_add_test(tc, test_rewards_registry);
#ifdef LB_HAVE_CUDA
    if (lb_cuda_device_count() > 0) {   // no device: the CPU checks above are the suite
        gpu = lb_backend_cuda_create(0, err, sizeof err);
        if (!gpu) {
            fprintf(stderr, "%s\n", err);
            return 1;
        }
        tcase_add_test(tc, test_gpu);
    }
#endif
    suite_add_tcase(s, tc);
    return lb_test_run(s);
}
