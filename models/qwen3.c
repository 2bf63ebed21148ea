// qwen3.c: the Qwen3 family. qwen3_moe: pre-norm blocks of GQA attention (per-head RMSNorm on
// q and k, RoPE) and a top-k routed SwiGLU mixture of experts. qwen3: the same with a dense
// SwiGLU MLP. Forward and backward are written out explicitly (llm.c style) from kernel-set
// operations only.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kernels/common.h"
#include "models/model.h"

typedef struct {
    // saved by forward, per layer
    float *x;              // (n, c) residual entering the layer; x[layers] feeds the final norm
    float *ln1, *rstd1;    // (n, c), (n)
    float *q, *qrstd, *qr; // q before norm (n, hq*d), its rstd (n*hq), after norm + RoPE
    float *k, *krstd, *kr; // same for k, (n, hkv*d)
    float *v;              // (n, hkv*d)
    float *att, *lse;      // (n, hq*d), (b, hq, t)
    float *xmid;           // (n, c) residual after attention
    float *ln2, *rstd2;    // (n, c), (n)
    // MoE
    float *rlogits, *probs, *weight;   // (n, e), (n, e), (n, k)
    int32_t *idx, *row;                // (n, k)
    int *counts;                       // (e) host: rows per expert
    float *aux_grad;                   // (e) d aux / d probs[i][j]
    float *xp, *yp;                    // (n*k, c)
    // MLP input of the activation (dense: (n, 2f); MoE: (n*k, 2f)) and its output
    float *gu, *h;
} layer_acts;

typedef struct {
    int b, t, n, rows;     // rows = n for dense, n*k for MoE
    layer_acts *l;         // (layers + 1): only .x is used in the last
    float *lnf, *rstdf;    // (n, c), (n)
    float *loss;           // (n) per-token losses
    int32_t *pos;          // (n)
    // backward scratch
    float *dres, *dln, *dtmp;              // (n, c)
    float *dq, *dk, *dv, *datt;            // (n, hq*d), (n, hkv*d) x2, (n, hq*d)
    float *dqr, *dkr;                      // (n, hq*d), (n, hkv*d)
    float *dgu, *dh;                       // (rows, 2f), (rows, f)
    float *dxp, *dyp;                      // (n*k, c)
    float *drlogits, *dweight, *daux;      // (n, e), (n, k), (e)
    float *host_loss;                      // (n) host
    int32_t *host_targets;                 // (n) host
} acts;

static int is_moe(const lb_model_config *c) { return strcmp(c->arch, "qwen3_moe") == 0; }
static int ffn_dim(const lb_model_config *c)
{
    return is_moe(c) ? c->moe_intermediate_size : c->intermediate_size;
}

static int check(const lb_model_config *c, char *err, size_t errlen)
{
#define REQUIRE(cond, ...)                        \
    do {                                          \
        if (!(cond)) {                            \
            snprintf(err, errlen, __VA_ARGS__);   \
            return -1;                            \
        }                                         \
    } while (0)
    REQUIRE(c->vocab_size > 0 && c->hidden_size > 0 && c->num_hidden_layers > 0,
            "model: vocab_size, hidden_size and num_hidden_layers must be positive");
    REQUIRE(c->num_attention_heads > 0 && c->num_key_value_heads > 0 && c->head_dim > 0,
            "model: attention heads and head_dim must be positive");
    REQUIRE(c->num_attention_heads % c->num_key_value_heads == 0,
            "model: num_attention_heads (%d) is not a multiple of num_key_value_heads (%d)",
            c->num_attention_heads, c->num_key_value_heads);
    REQUIRE(c->head_dim % 2 == 0, "model: head_dim (%d) must be even for RoPE", c->head_dim);
    if (is_moe(c)) {
        REQUIRE(c->num_experts > 0 && c->moe_intermediate_size > 0,
                "model: num_experts and moe_intermediate_size must be positive");
        REQUIRE(c->num_experts_per_tok > 0 && c->num_experts_per_tok <= c->num_experts,
                "model: num_experts_per_tok (%d) must be in 1..num_experts (%d)",
                c->num_experts_per_tok, c->num_experts);
    } else {
        REQUIRE(c->intermediate_size > 0, "model: intermediate_size must be positive");
    }
    return 0;
#undef REQUIRE
}

// Tensor order is the parameter buffer's order; names are Hugging Face's (fused experts as in
// transformers 5; see src/convert.c for the per-expert hub layout).
static int add(lb_tensor *out, int i, int is_norm, int ndim, int64_t d0, int64_t d1, int64_t d2,
               const char *fmt, int layer)
{
    if (out) {
        lb_tensor *t = &out[i];
        memset(t, 0, sizeof *t);
        snprintf(t->name, sizeof t->name, fmt, layer);
        t->ndim = ndim;
        t->shape[0] = d0;
        t->shape[1] = d1;
        t->shape[2] = d2;
        t->is_norm = is_norm;
    }
    return i + 1;
}

static int tensors(const lb_model_config *c, lb_tensor *out)
{
    int64_t C = c->hidden_size, D = c->head_dim, hq = c->num_attention_heads,
            hkv = c->num_key_value_heads, F = ffn_dim(c), E = c->num_experts;
    int i = 0;
    i = add(out, i, 0, 2, c->vocab_size, C, 0, "model.embed_tokens.weight", 0);
    for (int l = 0; l < c->num_hidden_layers; l++) {
        i = add(out, i, 1, 1, C, 0, 0, "model.layers.%d.input_layernorm.weight", l);
        i = add(out, i, 0, 2, hq * D, C, 0, "model.layers.%d.self_attn.q_proj.weight", l);
        i = add(out, i, 0, 2, hkv * D, C, 0, "model.layers.%d.self_attn.k_proj.weight", l);
        i = add(out, i, 0, 2, hkv * D, C, 0, "model.layers.%d.self_attn.v_proj.weight", l);
        i = add(out, i, 0, 2, C, hq * D, 0, "model.layers.%d.self_attn.o_proj.weight", l);
        i = add(out, i, 1, 1, D, 0, 0, "model.layers.%d.self_attn.q_norm.weight", l);
        i = add(out, i, 1, 1, D, 0, 0, "model.layers.%d.self_attn.k_norm.weight", l);
        i = add(out, i, 1, 1, C, 0, 0, "model.layers.%d.post_attention_layernorm.weight", l);
        if (is_moe(c)) {
            i = add(out, i, 0, 2, E, C, 0, "model.layers.%d.mlp.gate.weight", l);
            i = add(out, i, 0, 3, E, 2 * F, C, "model.layers.%d.mlp.experts.gate_up_proj", l);
            i = add(out, i, 0, 3, E, C, F, "model.layers.%d.mlp.experts.down_proj", l);
        } else {
            i = add(out, i, 0, 2, 2 * F, C, 0, "model.layers.%d.mlp.gate_up_proj.weight", l);
            i = add(out, i, 0, 2, C, F, 0, "model.layers.%d.mlp.down_proj.weight", l);
        }
    }
    i = add(out, i, 1, 1, C, 0, 0, "model.norm.weight", 0);
    i = add(out, i, 0, 2, c->vocab_size, C, 0, "lm_head.weight", 0);
    return i;
}

// Pointers to one layer's weights, or to their gradients (same offsets in m->grads), and the
// weight-cache entries of its matrices.
typedef struct {
    float *ln1, *q, *k, *v, *o, *qn, *kn, *ln2, *router, *gu, *down;
    lb_wcache *cq, *ck, *cv, *co, *crouter, *cgu, *cdown;
} layer_w;

static int tensor_index(const lb_model *m, const char *fmt, int layer)
{
    char name[LB_TENSOR_NAME];
    snprintf(name, sizeof name, fmt, layer);
    const lb_tensor *t = lb_model_find(m, name);
    if (!t) lb_die("model has no tensor %s", name);
    return (int)(t - m->tensors);
}

static float *tensor_ptr(const lb_model *m, float *base, const char *fmt, int layer)
{
    return base + m->tensors[tensor_index(m, fmt, layer)].offset;
}

static lb_wcache *tensor_cache(const lb_model *m, const char *fmt, int layer)
{
    return &m->wcache[tensor_index(m, fmt, layer)];
}

static layer_w layer_weights(const lb_model *m, float *base, int l)
{
    layer_w w;
    w.ln1 = tensor_ptr(m, base, "model.layers.%d.input_layernorm.weight", l);
    w.q = tensor_ptr(m, base, "model.layers.%d.self_attn.q_proj.weight", l);
    w.k = tensor_ptr(m, base, "model.layers.%d.self_attn.k_proj.weight", l);
    w.v = tensor_ptr(m, base, "model.layers.%d.self_attn.v_proj.weight", l);
    w.o = tensor_ptr(m, base, "model.layers.%d.self_attn.o_proj.weight", l);
    w.qn = tensor_ptr(m, base, "model.layers.%d.self_attn.q_norm.weight", l);
    w.kn = tensor_ptr(m, base, "model.layers.%d.self_attn.k_norm.weight", l);
    w.ln2 = tensor_ptr(m, base, "model.layers.%d.post_attention_layernorm.weight", l);
    w.cq = tensor_cache(m, "model.layers.%d.self_attn.q_proj.weight", l);
    w.ck = tensor_cache(m, "model.layers.%d.self_attn.k_proj.weight", l);
    w.cv = tensor_cache(m, "model.layers.%d.self_attn.v_proj.weight", l);
    w.co = tensor_cache(m, "model.layers.%d.self_attn.o_proj.weight", l);
    const char *gu = "model.layers.%d.mlp.gate_up_proj.weight";
    const char *down = "model.layers.%d.mlp.down_proj.weight";
    w.router = NULL;
    w.crouter = NULL;
    if (is_moe(&m->cfg)) {
        w.router = tensor_ptr(m, base, "model.layers.%d.mlp.gate.weight", l);
        w.crouter = tensor_cache(m, "model.layers.%d.mlp.gate.weight", l);
        gu = "model.layers.%d.mlp.experts.gate_up_proj";
        down = "model.layers.%d.mlp.experts.down_proj";
    }
    w.gu = tensor_ptr(m, base, gu, l);
    w.down = tensor_ptr(m, base, down, l);
    w.cgu = tensor_cache(m, gu, l);
    w.cdown = tensor_cache(m, down, l);
    return w;
}

static void weights_refresh(lb_model *m)
{
    const lb_model_config *c = &m->cfg;
    int C = c->hidden_size, D = c->head_dim, hq = c->num_attention_heads,
        hkv = c->num_key_value_heads, F = ffn_dim(c), E = c->num_experts, L = c->num_hidden_layers;
    lb_linear *lin = &m->lin;
    for (int l = 0; l < L; l++) {
        layer_w w = layer_weights(m, m->params, l);
        lb_wcache_build(lin, w.cq, l, LB_ROLE_ATTN_QKV, w.q, 1, hq * D, C);
        lb_wcache_build(lin, w.ck, l, LB_ROLE_ATTN_QKV, w.k, 1, hkv * D, C);
        lb_wcache_build(lin, w.cv, l, LB_ROLE_ATTN_QKV, w.v, 1, hkv * D, C);
        lb_wcache_build(lin, w.co, l, LB_ROLE_ATTN_OUT, w.o, 1, C, hq * D);
        if (is_moe(c)) {
            lb_wcache_build(lin, w.crouter, l, LB_ROLE_ROUTER, w.router, 1, E, C);
            lb_wcache_build(lin, w.cgu, l, LB_ROLE_MOE_GATE_UP, w.gu, E, 2 * F, C);
            lb_wcache_build(lin, w.cdown, l, LB_ROLE_MOE_DOWN, w.down, E, C, F);
        } else {
            lb_wcache_build(lin, w.cgu, l, LB_ROLE_MLP_GATE_UP, w.gu, 1, 2 * F, C);
            lb_wcache_build(lin, w.cdown, l, LB_ROLE_MLP_DOWN, w.down, 1, C, F);
        }
    }
    int h = tensor_index(m, "lm_head.weight", 0);
    lb_wcache_build(lin, &m->wcache[h], L - 1, LB_ROLE_LM_HEAD, m->params + m->tensors[h].offset,
                    1, c->vocab_size, C);
}

static float *falloc(lb_backend *be, size_t n) { return be->alloc(be, n * sizeof(float)); }

static void *acts_create(lb_model *m, int b, int t)
{
    const lb_model_config *c = &m->cfg;
    lb_backend *be = m->be;
    acts *a = lb_calloc(1, sizeof *a);
    size_t n = (size_t)b * t, C = c->hidden_size, D = c->head_dim, hq = c->num_attention_heads,
           hkv = c->num_key_value_heads, F = ffn_dim(c), E = c->num_experts,
           K = c->num_experts_per_tok;
    int moe = is_moe(c);
    a->b = b;
    a->t = t;
    a->n = (int)n;
    a->rows = (int)(moe ? n * K : n);
    size_t rows = a->rows;
    a->l = lb_calloc(c->num_hidden_layers + 1, sizeof *a->l);
    for (int l = 0; l <= c->num_hidden_layers; l++) {
        layer_acts *L = &a->l[l];
        L->x = falloc(be, n * C);
        if (l == c->num_hidden_layers) break;
        L->ln1 = falloc(be, n * C);
        L->rstd1 = falloc(be, n);
        L->q = falloc(be, n * hq * D);
        L->qrstd = falloc(be, n * hq);
        L->qr = falloc(be, n * hq * D);
        L->k = falloc(be, n * hkv * D);
        L->krstd = falloc(be, n * hkv);
        L->kr = falloc(be, n * hkv * D);
        L->v = falloc(be, n * hkv * D);
        L->att = falloc(be, n * hq * D);
        L->lse = falloc(be, n * hq);
        L->xmid = falloc(be, n * C);
        L->ln2 = falloc(be, n * C);
        L->rstd2 = falloc(be, n);
        L->gu = falloc(be, rows * 2 * F);
        L->h = falloc(be, rows * F);
        if (moe) {
            L->rlogits = falloc(be, n * E);
            L->probs = falloc(be, n * E);
            L->weight = falloc(be, n * K);
            L->idx = be->alloc(be, n * K * sizeof(int32_t));
            L->row = be->alloc(be, n * K * sizeof(int32_t));
            L->counts = lb_calloc(E, sizeof(int));
            L->aux_grad = falloc(be, E);
            L->xp = falloc(be, rows * C);
            L->yp = falloc(be, rows * C);
        }
    }
    a->lnf = falloc(be, n * C);
    a->rstdf = falloc(be, n);
    a->loss = falloc(be, n);
    a->pos = be->alloc(be, n * sizeof(int32_t));
    int32_t *pos = lb_malloc(n * sizeof(int32_t));
    for (size_t i = 0; i < n; i++) pos[i] = (int32_t)(i % (size_t)t);   // each row starts at 0
    be->upload(be, a->pos, pos, n * sizeof(int32_t));
    free(pos);
    a->dres = falloc(be, n * C);
    a->dln = falloc(be, n * C);
    a->dtmp = falloc(be, n * C);
    a->dq = falloc(be, n * hq * D);
    a->dk = falloc(be, n * hkv * D);
    a->dv = falloc(be, n * hkv * D);
    a->datt = falloc(be, n * hq * D);
    a->dqr = falloc(be, n * hq * D);
    a->dkr = falloc(be, n * hkv * D);
    a->dgu = falloc(be, rows * 2 * F);
    a->dh = falloc(be, rows * F);
    if (moe) {
        a->dxp = falloc(be, rows * C);
        a->dyp = falloc(be, rows * C);
        a->drlogits = falloc(be, n * E);
        a->dweight = falloc(be, n * K);
        a->daux = falloc(be, E);
    }
    a->host_loss = lb_malloc(n * sizeof(float));
    a->host_targets = lb_malloc(n * sizeof(int32_t));
    return a;
}

static void acts_free(lb_model *m, void *p)
{
    acts *a = p;
    lb_backend *be = m->be;
    for (int l = 0; l <= m->cfg.num_hidden_layers; l++) {
        layer_acts *L = &a->l[l];
        void *bufs[] = {L->x, L->ln1, L->rstd1, L->q, L->qrstd, L->qr, L->k, L->krstd, L->kr,
                        L->v, L->att, L->lse, L->xmid, L->ln2, L->rstd2, L->gu, L->h,
                        L->rlogits, L->probs, L->weight, L->idx, L->row, L->aux_grad, L->xp,
                        L->yp};
        for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
            if (bufs[i]) be->free(be, bufs[i]);
        free(L->counts);
    }
    free(a->l);
    void *bufs[] = {a->lnf, a->rstdf, a->loss, a->pos, a->dres, a->dln, a->dtmp, a->dq, a->dk,
                    a->dv, a->datt, a->dqr, a->dkr, a->dgu, a->dh, a->dxp, a->dyp, a->drlogits,
                    a->dweight, a->daux};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) be->free(be, bufs[i]);
    free(a->host_loss);
    free(a->host_targets);
    free(a);
}

// The fp8 KV cache's quantization of k or v rows x (rows, d): fp8-block activations, 1x128
// blocks along d (one scale per row when d <= 128), E4M3, scale amax / 448.
static lb_quant_args kv_quant_args(void)
{
    lb_quant_args a;
    memset(&a, 0, sizeof a);
    a.fmt = LB_FMT_FP8_BLOCK;
    a.elem = LB_E4M3;
    return a;
}

// x = dequantize(quantize(x)) in place: the values an fp8 cache gives back.
static void kv_fake_quant(lb_backend *be, float *x, int rows, int d)
{
    lb_quant_args a = kv_quant_args();
    lb_qmat q;
    memset(&q, 0, sizeof q);
    be->qmat_alloc(be, &q, rows, d, &a);
    be->quantize(be, &q, x, rows, d, &a);
    be->dequantize(be, x, &q);
    be->qmat_free(be, &q);
}

static void forward(lb_model *m, const int32_t *tokens, const int32_t *targets, int b, int t)
{
    const lb_model_config *c = &m->cfg;
    lb_backend *be = m->be;
    acts *a = m->acts;
    int n = b * t, C = c->hidden_size, D = c->head_dim, hq = c->num_attention_heads,
        hkv = c->num_key_value_heads, F = ffn_dim(c), E = c->num_experts,
        K = c->num_experts_per_tok, V = c->vocab_size;
    float eps = (float)c->rms_norm_eps, theta = (float)c->rope_theta;
    int moe = is_moe(c);
    double aux = 0.0;
    lb_linear *lin = &m->lin;

    be->embedding_fwd(be, a->l[0].x, tokens, m->params, n, C);
    for (int l = 0; l < c->num_hidden_layers; l++) {
        layer_acts *L = &a->l[l];
        layer_w w = layer_weights(m, m->params, l);
        // attention block
        be->rmsnorm_fwd(be, L->ln1, L->rstd1, L->x, w.ln1, n, C, eps);
        lb_linear_fwd(lin, l, LB_ROLE_ATTN_QKV, L->ln1, w.q, w.cq, 0, L->q, n, hq * D, C, 0.0f);
        lb_linear_fwd(lin, l, LB_ROLE_ATTN_QKV, L->ln1, w.k, w.ck, 0, L->k, n, hkv * D, C, 0.0f);
        lb_linear_fwd(lin, l, LB_ROLE_ATTN_QKV, L->ln1, w.v, w.cv, 0, L->v, n, hkv * D, C, 0.0f);
        be->rmsnorm_fwd(be, L->qr, L->qrstd, L->q, w.qn, n * hq, D, eps);
        be->rmsnorm_fwd(be, L->kr, L->krstd, L->k, w.kn, n * hkv, D, eps);
        be->rope_fwd(be, L->qr, a->pos, n, hq, D, theta);
        be->rope_fwd(be, L->kr, a->pos, n, hkv, D, theta);
        if (m->kv_fp8) {   // what an fp8 KV cache would hold (straight-through backward)
            kv_fake_quant(be, L->kr, n * hkv, D);
            kv_fake_quant(be, L->v, n * hkv, D);
        }
        be->attention_fwd(be, L->att, L->lse, L->qr, L->kr, L->v, b, t, hq, hkv, D);
        be->copy(be, L->xmid, L->x, (size_t)n * C * sizeof(float));
        lb_linear_fwd(lin, l, LB_ROLE_ATTN_OUT, L->att, w.o, w.co, 0, L->xmid, n, C, hq * D, 1.0f);
        // feed-forward block
        float *xnext = a->l[l + 1].x;
        be->rmsnorm_fwd(be, L->ln2, L->rstd2, L->xmid, w.ln2, n, C, eps);
        if (moe) {
            lb_linear_fwd(lin, l, LB_ROLE_ROUTER, L->ln2, w.router, w.crouter, 0, L->rlogits, n, E,
                          C, 0.0f);
            be->router_topk_fwd(be, L->probs, L->idx, L->weight, L->rlogits, n, E, K,
                                c->norm_topk_prob);
            float aux_l;
            be->moe_aux_loss(be, &aux_l, L->aux_grad, L->probs, L->idx, n, E, K);
            aux += aux_l;
            be->moe_plan(be, L->row, L->counts, L->idx, n, E, K);
            be->moe_permute(be, L->xp, L->ln2, L->row, n, K, C);
            lb_linear_grouped_fwd(lin, l, LB_ROLE_MOE_GATE_UP, L->xp, w.gu, w.cgu, L->counts, E,
                                  L->gu, 2 * F, C);
            be->swiglu_fwd(be, L->h, L->gu, n * K, F);
            lb_linear_grouped_fwd(lin, l, LB_ROLE_MOE_DOWN, L->h, w.down, w.cdown, L->counts, E,
                                  L->yp, C, F);
            be->moe_combine(be, xnext, L->yp, L->weight, L->row, n, K, C);
            be->add(be, xnext, L->xmid, (size_t)n * C);
        } else {
            lb_linear_fwd(lin, l, LB_ROLE_MLP_GATE_UP, L->ln2, w.gu, w.cgu, 0, L->gu, n, 2 * F, C,
                          0.0f);
            be->swiglu_fwd(be, L->h, L->gu, n, F);
            be->copy(be, xnext, L->xmid, (size_t)n * C * sizeof(float));
            lb_linear_fwd(lin, l, LB_ROLE_MLP_DOWN, L->h, w.down, w.cdown, 0, xnext, n, C, F, 1.0f);
        }
    }
    const lb_tensor *tn = lb_model_find(m, "model.norm.weight");
    const lb_tensor *th = lb_model_find(m, "lm_head.weight");
    be->rmsnorm_fwd(be, a->lnf, a->rstdf, a->l[c->num_hidden_layers].x, m->params + tn->offset,
                    n, C, eps);
    lb_linear_fwd(lin, c->num_hidden_layers - 1, LB_ROLE_LM_HEAD, a->lnf, m->params + th->offset,
                  &m->wcache[th - m->tensors], 0, m->logits, n, V, C, 0.0f);
    if (!targets) return;

    // Loss: mean cross-entropy over counted targets, summed in token order in double.
    be->cross_entropy_fwd(be, a->loss, m->logits, targets, n, V);
    be->download(be, a->host_loss, a->loss, (size_t)n * sizeof(float));
    be->download(be, a->host_targets, targets, (size_t)n * sizeof(int32_t));
    double sum = 0.0;
    int count = 0;
    for (int i = 0; i < n; i++)
        if (a->host_targets[i] >= 0) {
            sum += a->host_loss[i];
            count++;
        }
    m->ntokens = count;
    m->ce_loss = count ? (float)(sum / count) : 0.0f;
    m->aux_loss = (float)aux;
    m->loss = (float)(m->ce_loss + c->router_aux_loss_coef * aux);
}

// From d loss / d logits in m->logits; aux_scale weighs the load-balancing loss.
static void backward_logits(lb_model *m, float aux_scale)
{
    const lb_model_config *c = &m->cfg;
    lb_backend *be = m->be;
    acts *a = m->acts;
    int b = a->b, t = a->t, n = a->n, C = c->hidden_size, D = c->head_dim,
        hq = c->num_attention_heads, hkv = c->num_key_value_heads, F = ffn_dim(c),
        E = c->num_experts, K = c->num_experts_per_tok, V = c->vocab_size;
    float theta = (float)c->rope_theta;
    int moe = is_moe(c);
    float *G = m->grads;
    lb_linear *lin = &m->lin;

    // lm head and final norm
    const lb_tensor *tn = lb_model_find(m, "model.norm.weight");
    const lb_tensor *th = lb_model_find(m, "lm_head.weight");
    lb_linear_bwd(lin, c->num_hidden_layers - 1, LB_ROLE_LM_HEAD, a->lnf, m->params + th->offset,
                  &m->wcache[th - m->tensors], 0, m->logits, a->dln, 0.0f, G + th->offset, n, V,
                  C);
    be->rmsnorm_bwd(be, a->dres, G + tn->offset, a->dln, a->l[c->num_hidden_layers].x,
                    m->params + tn->offset, a->rstdf, n, C);

    for (int l = c->num_hidden_layers - 1; l >= 0; l--) {
        layer_acts *L = &a->l[l];
        layer_w w = layer_weights(m, m->params, l);
        layer_w dw = layer_weights(m, G, l);
        // feed-forward block: dres is d loss / d xnext, and passes straight to xmid
        if (moe) {
            be->moe_combine_bwd(be, a->dyp, a->dweight, a->dres, L->yp, L->weight, L->row, n, K,
                                C);
            lb_linear_grouped_bwd(lin, l, LB_ROLE_MOE_DOWN, L->h, w.down, w.cdown, L->counts, E,
                                  a->dyp, a->dh, dw.down, C, F);
            be->swiglu_bwd(be, a->dgu, a->dh, L->gu, n * K, F);
            lb_linear_grouped_bwd(lin, l, LB_ROLE_MOE_GATE_UP, L->xp, w.gu, w.cgu, L->counts, E,
                                  a->dgu, a->dxp, dw.gu, 2 * F, C);
            be->moe_permute_bwd(be, a->dln, a->dxp, L->row, n, K, C);
            // router: through the top-k weights and the load-balancing loss
            be->copy(be, a->daux, L->aux_grad, (size_t)E * sizeof(float));
            be->scale(be, a->daux, aux_scale, (size_t)E);
            be->router_topk_bwd(be, a->drlogits, a->dweight, a->daux, L->probs, L->idx, n, E, K,
                                c->norm_topk_prob);
            lb_linear_bwd(lin, l, LB_ROLE_ROUTER, L->ln2, w.router, w.crouter, 0, a->drlogits,
                          a->dln, 1.0f, dw.router, n, E, C);
        } else {
            lb_linear_bwd(lin, l, LB_ROLE_MLP_DOWN, L->h, w.down, w.cdown, 0, a->dres, a->dh, 0.0f,
                          dw.down, n, C, F);
            be->swiglu_bwd(be, a->dgu, a->dh, L->gu, n, F);
            lb_linear_bwd(lin, l, LB_ROLE_MLP_GATE_UP, L->ln2, w.gu, w.cgu, 0, a->dgu, a->dln, 0.0f,
                          dw.gu, n, 2 * F, C);
        }
        be->rmsnorm_bwd(be, a->dtmp, dw.ln2, a->dln, L->xmid, w.ln2, L->rstd2, n, C);
        be->add(be, a->dres, a->dtmp, (size_t)n * C);
        // attention block: dres is now d loss / d xmid
        lb_linear_bwd(lin, l, LB_ROLE_ATTN_OUT, L->att, w.o, w.co, 0, a->dres, a->datt, 0.0f, dw.o,
                      n, C, hq * D);
        be->attention_bwd(be, a->dq, a->dk, a->dv, a->datt, L->qr, L->kr, L->v, L->att, L->lse,
                          b, t, hq, hkv, D);
        be->rope_bwd(be, a->dq, a->pos, n, hq, D, theta);
        be->rope_bwd(be, a->dk, a->pos, n, hkv, D, theta);
        be->rmsnorm_bwd(be, a->dqr, dw.qn, a->dq, L->q, w.qn, L->qrstd, n * hq, D);
        be->rmsnorm_bwd(be, a->dkr, dw.kn, a->dk, L->k, w.kn, L->krstd, n * hkv, D);
        lb_linear_bwd(lin, l, LB_ROLE_ATTN_QKV, L->ln1, w.q, w.cq, 0, a->dqr, a->dln, 0.0f, dw.q, n,
                      hq * D, C);
        lb_linear_bwd(lin, l, LB_ROLE_ATTN_QKV, L->ln1, w.k, w.ck, 0, a->dkr, a->dln, 1.0f, dw.k, n,
                      hkv * D, C);
        lb_linear_bwd(lin, l, LB_ROLE_ATTN_QKV, L->ln1, w.v, w.cv, 0, a->dv, a->dln, 1.0f, dw.v, n,
                      hkv * D, C);
        be->rmsnorm_bwd(be, a->dtmp, dw.ln1, a->dln, L->x, w.ln1, L->rstd1, n, C);
        be->add(be, a->dres, a->dtmp, (size_t)n * C);
    }
    be->embedding_bwd(be, G, a->dres, m->tokens, n, C);   // embed_tokens is tensor 0
}

static void backward(lb_model *m, float loss_scale)
{
    // the logits buffer becomes d loss / d logits
    float dce = m->ntokens ? loss_scale / (float)m->ntokens : 0.0f;
    m->be->cross_entropy_bwd(m->be, m->logits, m->logits, m->targets, dce,
                             ((acts *)m->acts)->n, m->cfg.vocab_size);
    backward_logits(m, loss_scale * (float)m->cfg.router_aux_loss_coef);
}

// --- cached forward (sampling) -------------------------------------------------------------------

// One layer's worth of activations for up to `rows` new tokens (layers run one after another).
typedef struct {
    int rows;
    float *x, *xmid, *ln, *rstd;           // (rows, c), (rows, c), (rows, c), (rows)
    float *q, *qrstd, *qr;                 // (rows, hq*d), (rows*hq), (rows, hq*d)
    float *k, *krstd, *kr, *v;             // (rows, hkv*d), (rows*hkv), (rows, hkv*d) x2
    float *att;                            // (rows, hq*d)
    float *rlogits, *probs, *weight;       // (rows, e) x2, (rows, k)
    int32_t *idx, *row;                    // (rows, k)
    int *counts;                           // (e) host
    float *aux_grad;                       // (e) the router op writes it; unused here
    float *xp, *yp, *gu, *h;               // (rows*k, c) x2, (rows*k, 2f), (rows*k, f)
} cached_acts;

static void *cached_create(lb_model *m, int max_rows)
{
    const lb_model_config *c = &m->cfg;
    lb_backend *be = m->be;
    cached_acts *a = lb_calloc(1, sizeof *a);
    size_t n = (size_t)max_rows, C = c->hidden_size, D = c->head_dim,
           hq = c->num_attention_heads, hkv = c->num_key_value_heads, F = ffn_dim(c),
           E = c->num_experts, K = c->num_experts_per_tok;
    int moe = is_moe(c);
    size_t rows = moe ? n * K : n;
    a->rows = max_rows;
    a->x = falloc(be, n * C);
    a->xmid = falloc(be, n * C);
    a->ln = falloc(be, n * C);
    a->rstd = falloc(be, n);
    a->q = falloc(be, n * hq * D);
    a->qrstd = falloc(be, n * hq);
    a->qr = falloc(be, n * hq * D);
    a->k = falloc(be, n * hkv * D);
    a->krstd = falloc(be, n * hkv);
    a->kr = falloc(be, n * hkv * D);
    a->v = falloc(be, n * hkv * D);
    a->att = falloc(be, n * hq * D);
    a->gu = falloc(be, rows * 2 * F);
    a->h = falloc(be, rows * F);
    if (moe) {
        a->rlogits = falloc(be, n * E);
        a->probs = falloc(be, n * E);
        a->weight = falloc(be, n * K);
        a->idx = be->alloc(be, n * K * sizeof(int32_t));
        a->row = be->alloc(be, n * K * sizeof(int32_t));
        a->counts = lb_calloc(E, sizeof(int));
        a->aux_grad = falloc(be, E);
        a->xp = falloc(be, rows * C);
        a->yp = falloc(be, rows * C);
    }
    return a;
}

static void cached_free(lb_model *m, void *p)
{
    cached_acts *a = p;
    lb_backend *be = m->be;
    void *bufs[] = {a->x, a->xmid, a->ln, a->rstd, a->q, a->qrstd, a->qr, a->k, a->krstd, a->kr,
                    a->v, a->att, a->gu, a->h, a->rlogits, a->probs, a->weight, a->idx, a->row,
                    a->aux_grad, a->xp, a->yp};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) be->free(be, bufs[i]);
    free(a->counts);
    free(a);
}

// forward()'s operations in forward()'s order for n new rows; attention goes through the KV
// cache (kv_append, then attention_cached) instead of attention_fwd. Nothing a row computes
// depends on the other rows, so each row's logits equal the training forward's.
static void forward_cached(lb_model *m, lb_kvcache *kv, int n)
{
    const lb_model_config *c = &m->cfg;
    lb_backend *be = m->be;
    cached_acts *a = kv->acts;
    int C = c->hidden_size, D = c->head_dim, hq = c->num_attention_heads,
        hkv = c->num_key_value_heads, F = ffn_dim(c), E = c->num_experts,
        K = c->num_experts_per_tok, V = c->vocab_size;
    float eps = (float)c->rms_norm_eps, theta = (float)c->rope_theta;
    int moe = is_moe(c);
    lb_linear *lin = &m->lin;

    be->embedding_fwd(be, a->x, kv->tokens, m->params, n, C);
    for (int l = 0; l < c->num_hidden_layers; l++) {
        layer_w w = layer_weights(m, m->params, l);
        be->rmsnorm_fwd(be, a->ln, a->rstd, a->x, w.ln1, n, C, eps);
        lb_linear_fwd(lin, l, LB_ROLE_ATTN_QKV, a->ln, w.q, w.cq, 0, a->q, n, hq * D, C, 0.0f);
        lb_linear_fwd(lin, l, LB_ROLE_ATTN_QKV, a->ln, w.k, w.ck, 0, a->k, n, hkv * D, C, 0.0f);
        lb_linear_fwd(lin, l, LB_ROLE_ATTN_QKV, a->ln, w.v, w.cv, 0, a->v, n, hkv * D, C, 0.0f);
        be->rmsnorm_fwd(be, a->qr, a->qrstd, a->q, w.qn, n * hq, D, eps);
        be->rmsnorm_fwd(be, a->kr, a->krstd, a->k, w.kn, n * hkv, D, eps);
        be->rope_fwd(be, a->qr, kv->pos, n, hq, D, theta);
        be->rope_fwd(be, a->kr, kv->pos, n, hkv, D, theta);
        if (kv->fp8) {
            lb_quant_args qa = kv_quant_args();
            lb_qmat kq, vq;
            memset(&kq, 0, sizeof kq);
            memset(&vq, 0, sizeof vq);
            be->qmat_alloc(be, &kq, n * hkv, D, &qa);
            be->qmat_alloc(be, &vq, n * hkv, D, &qa);
            be->quantize(be, &kq, a->kr, n * hkv, D, &qa);
            be->quantize(be, &vq, a->v, n * hkv, D, &qa);
            be->kv_append(be, &kv->layer[l], NULL, NULL, &kq, &vq, kv->slot, kv->pos, n);
            be->qmat_free(be, &kq);
            be->qmat_free(be, &vq);
        } else {
            be->kv_append(be, &kv->layer[l], a->kr, a->v, NULL, NULL, kv->slot, kv->pos, n);
        }
        be->attention_cached(be, a->att, a->qr, &kv->layer[l], kv->slot, kv->pos, n, hq);
        be->copy(be, a->xmid, a->x, (size_t)n * C * sizeof(float));
        lb_linear_fwd(lin, l, LB_ROLE_ATTN_OUT, a->att, w.o, w.co, 0, a->xmid, n, C, hq * D, 1.0f);
        // feed-forward block; its output overwrites x (the residual lives in xmid now)
        be->rmsnorm_fwd(be, a->ln, a->rstd, a->xmid, w.ln2, n, C, eps);
        if (moe) {
            lb_linear_fwd(lin, l, LB_ROLE_ROUTER, a->ln, w.router, w.crouter, 0, a->rlogits, n, E,
                          C, 0.0f);
            be->router_topk_fwd(be, a->probs, a->idx, a->weight, a->rlogits, n, E, K,
                                c->norm_topk_prob);
            be->moe_plan(be, a->row, a->counts, a->idx, n, E, K);
            be->moe_permute(be, a->xp, a->ln, a->row, n, K, C);
            lb_linear_grouped_fwd(lin, l, LB_ROLE_MOE_GATE_UP, a->xp, w.gu, w.cgu, a->counts, E,
                                  a->gu, 2 * F, C);
            be->swiglu_fwd(be, a->h, a->gu, n * K, F);
            lb_linear_grouped_fwd(lin, l, LB_ROLE_MOE_DOWN, a->h, w.down, w.cdown, a->counts, E,
                                  a->yp, C, F);
            be->moe_combine(be, a->x, a->yp, a->weight, a->row, n, K, C);
            be->add(be, a->x, a->xmid, (size_t)n * C);
        } else {
            lb_linear_fwd(lin, l, LB_ROLE_MLP_GATE_UP, a->ln, w.gu, w.cgu, 0, a->gu, n, 2 * F, C,
                          0.0f);
            be->swiglu_fwd(be, a->h, a->gu, n, F);
            be->copy(be, a->x, a->xmid, (size_t)n * C * sizeof(float));
            lb_linear_fwd(lin, l, LB_ROLE_MLP_DOWN, a->h, w.down, w.cdown, 0, a->x, n, C, F, 1.0f);
        }
    }
    const lb_tensor *tn = lb_model_find(m, "model.norm.weight");
    const lb_tensor *th = lb_model_find(m, "lm_head.weight");
    be->rmsnorm_fwd(be, a->ln, a->rstd, a->x, m->params + tn->offset, n, C, eps);
    lb_linear_fwd(lin, c->num_hidden_layers - 1, LB_ROLE_LM_HEAD, a->ln, m->params + th->offset,
                  &m->wcache[th - m->tensors], 0, kv->logits, n, V, C, 0.0f);
}

static int64_t active_matmul_params(const lb_model_config *c)
{
    int64_t C = c->hidden_size, D = c->head_dim;
    int64_t attn = C * (c->num_attention_heads + 2 * c->num_key_value_heads) * D +
                   (int64_t)c->num_attention_heads * D * C;
    int64_t ffn = is_moe(c) ? C * c->num_experts +
                                  (int64_t)c->num_experts_per_tok * 3 * C * c->moe_intermediate_size
                            : 3 * C * c->intermediate_size;
    return c->num_hidden_layers * (attn + ffn) + C * c->vocab_size;   // + the LM head
}

// Both archs share every function; check(), tensors() and the forward branch on the arch.
#define QWEN3_OPS                                  \
    .check = check,                                \
    .tensors = tensors,                            \
    .acts_create = acts_create,                    \
    .acts_free = acts_free,                        \
    .forward = forward,                            \
    .backward = backward,                          \
    .weights_refresh = weights_refresh,            \
    .backward_logits = backward_logits,            \
    .cached_create = cached_create,                \
    .cached_free = cached_free,                    \
    .forward_cached = forward_cached,              \
    .active_matmul_params = active_matmul_params

const lb_model_def lb_qwen3_moe_def = {
    .arch = "qwen3_moe",
    .summary = "Qwen3-MoE: GQA with q/k RMSNorm and RoPE, top-k softmax router, SwiGLU experts",
    QWEN3_OPS,
};

const lb_model_def lb_qwen3_def = {
    .arch = "qwen3",
    .summary = "Qwen3 (dense): GQA with q/k RMSNorm and RoPE, SwiGLU MLP",
    QWEN3_OPS,
};
