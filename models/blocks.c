// blocks.c: the building blocks of decoder models (see blocks.h): the tensors of each block,
// and pre-norm layers of GQA attention (optional q/k RMSNorm, plain or llama3-scaled RoPE) and
// a dense SwiGLU MLP or a top-k routed SwiGLU mixture of experts, with the embedding, final
// norm and LM head. Forward and backward are written out explicitly (llm.c style) from
// kernel-set operations only; what differs between families is read from the definition's
// flags (lb_model_def.moe, .qk_norm) and the configuration (rope_type).
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kernels/common.h"
#include "kernels/router.h"
#include "models/blocks.h"
#include "parallel/tensor_parallel.h"

// Routed feed-forward blocks: the family's flag (the configuration names the family).
static int is_moe(const lb_model_config *c)
{
    const lb_model_def *def = lb_model_lookup(c->arch);
    return def && def->moe;
}
static int has_qk_norm(const lb_model *m) { return lb_model_qk_norm(m->def, &m->cfg); }
static int ffn_dim(const lb_model_config *c)
{
    return is_moe(c) ? c->moe_intermediate_size : c->intermediate_size;
}
// Layer l's feed-forward block is routed (else a dense MLP: every layer of a dense family, the
// first first_k_dense_replace of a MoE one).
static int layer_moe(const lb_model_config *c, int l)
{
    const lb_model_def *def = lb_model_lookup(c->arch);
    return def && lb_model_layer_moe(def, c, l);
}
// Some layer of a MoE model has a dense MLP.
static int has_dense(const lb_model_config *c) { return !is_moe(c) || c->first_k_dense_replace > 0; }
static int sigmoid_router(const lb_model_config *c)
{
    const lb_model_def *def = lb_model_lookup(c->arch);
    return def && def->moe && def->sigmoid_router;
}
static int shared_experts(const lb_model_config *c) { return is_moe(c) && c->n_shared_experts > 0; }
// RoPE's rotated dimensions of a head: 0 (all of them) or the partial share (GLM).
static int rope_rot(const lb_model_config *c)
{
    double f = c->partial_rotary_factor;
    return f > 0 && f < 1 ? (int)(c->head_dim * f) : 0;
}

// --- the blocks' [model] keys ---------------------------------------------------------------

static int reads_rope_scaling(const lb_model_def *d) { return d->rope_scaling; }
static int reads_moe(const lb_model_def *d) { return d->moe; }
static int reads_softmax_router(const lb_model_def *d) { return d->moe && !d->sigmoid_router; }
static int reads_sigmoid_router(const lb_model_def *d) { return d->moe && d->sigmoid_router; }

#define I LB_MKEY_INT
#define F LB_MKEY_FLOAT
#define B LB_MKEY_BOOL
#define E LB_MKEY_ENUM
const lb_model_key lb_block_keys[] = {
    // the decoder: embedding, attention, the dense MLP (a MoE model's dense leading layers too)
    LB_MODEL_KEY(vocab_size, I, "256", 1, 16777216, NULL, "vocabulary size", NULL),
    LB_MODEL_KEY(hidden_size, I, "128", 1, 65536, NULL, "width of the residual stream", NULL),
    LB_MODEL_KEY(num_hidden_layers, I, "4", 1, 1024, NULL, "transformer blocks", NULL),
    LB_MODEL_KEY(num_attention_heads, I, "4", 1, 1024, NULL, "query heads", NULL),
    LB_MODEL_KEY(num_key_value_heads, I, "2", 1, 1024, NULL,
                 "key/value heads (GQA); divides num_attention_heads", NULL),
    LB_MODEL_KEY(head_dim, I, "32", 1, 1024, NULL, "width of one attention head", NULL),
    LB_MODEL_KEY(intermediate_size, I, "512", 1, 1048576, NULL,
                 "hidden width of the dense SwiGLU MLP (in a MoE model: of its dense leading "
                 "layers)", NULL),
    // the routed MoE and its routers
    LB_MODEL_KEY(num_experts, I, "4", 1, 4096, NULL, "experts per MoE layer", reads_moe),
    LB_MODEL_KEY(num_experts_per_tok, I, "2", 1, 4096, NULL,
                 "experts each token is routed to (top-k)", reads_moe),
    LB_MODEL_KEY(moe_intermediate_size, I, "256", 1, 1048576, NULL,
                 "hidden width of one SwiGLU expert", reads_moe),
    LB_MODEL_KEY(norm_topk_prob, B, "true", 0, 0, NULL,
                 "renormalise the top-k router weights to sum to 1", reads_moe),
    LB_MODEL_KEY(first_k_dense_replace, I, "0", 0, 1024, NULL,
                 "leading layers of a MoE model with a dense MLP of intermediate_size instead",
                 reads_moe),
    LB_MODEL_KEY(n_shared_experts, I, "0", 0, 1024, NULL,
                 "shared experts beside the routed ones, each moe_intermediate_size wide",
                 reads_moe),
    LB_MODEL_KEY(n_group, I, "1", 1, 64, NULL,
                 "sigmoid router: expert groups, dividing num_experts", reads_sigmoid_router),
    LB_MODEL_KEY(topk_group, I, "1", 1, 64, NULL,
                 "sigmoid router: groups a token's experts come from", reads_sigmoid_router),
    LB_MODEL_KEY(routed_scaling_factor, F, "1", 1e-6, 1e6, NULL,
                 "sigmoid router: factor on the routed experts' weights", reads_sigmoid_router),
    LB_MODEL_KEY(router_bias_update_rate, F, "0.001", 0, 1, NULL,
                 "sigmoid router: step of the aux-loss-free selection-bias update after each "
                 "optimizer step (0 = off)", reads_sigmoid_router),
    // attention and RoPE
    LB_MODEL_KEY(attention_bias, B, "false", 0, 0, NULL, "q, k and v projections with a bias",
                 NULL),
    LB_MODEL_KEY(partial_rotary_factor, F, "1", 1e-6, 1, NULL,
                 "share of each head's dimensions RoPE rotates (GLM: 0.5)", NULL),
    LB_MODEL_KEY(max_position_embeddings, I, "4096", 1, 16777216, NULL,
                 "longest sequence the model is built for", NULL),
    LB_MODEL_KEY(rope_theta, F, "1000000", 1, 1e12, NULL, "RoPE base frequency", NULL),
    LB_MODEL_KEY(rope_type, E, "default", 0, 0, "default|llama3",
                 "RoPE frequency scaling (Hugging Face rope_scaling): none, or Llama 3.1's",
                 reads_rope_scaling),
    LB_MODEL_KEY(rope_factor, F, "8", 1, 1e6, NULL, "llama3 RoPE: the low frequencies' divisor",
                 reads_rope_scaling),
    LB_MODEL_KEY(rope_low_freq_factor, F, "1", 1e-6, 1e6, NULL,
                 "llama3 RoPE: wavelengths above original_max / this are scaled",
                 reads_rope_scaling),
    LB_MODEL_KEY(rope_high_freq_factor, F, "4", 1e-6, 1e6, NULL,
                 "llama3 RoPE: wavelengths below original_max / this are kept",
                 reads_rope_scaling),
    LB_MODEL_KEY(rope_original_max_position_embeddings, I, "8192", 1, 16777216, NULL,
                 "llama3 RoPE: the context length the model was pre-trained at",
                 reads_rope_scaling),
    // norms, the load-balancing loss, initialisation
    LB_MODEL_KEY(rms_norm_eps, F, "1e-6", 1e-12, 1, NULL, "epsilon of every RMSNorm", NULL),
    LB_MODEL_KEY(router_aux_loss_coef, F, "0.001", 0, 100, NULL,
                 "weight of the load-balancing loss (0 = off)", reads_softmax_router),
    LB_MODEL_KEY(initializer_range, F, "0.02", 0, 10, NULL,
                 "standard deviation of the normal init of matrices", NULL),
};
const int lb_block_nkeys = (int)(sizeof lb_block_keys / sizeof lb_block_keys[0]);
#undef I
#undef F
#undef B
#undef E

int lb_decoder_check(const lb_model_def *def, const lb_model_config *c, char *err,
                     size_t errlen)
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
    if (strcmp(c->rope_type, "llama3") == 0) {
        REQUIRE(c->rope_factor >= 1, "model: rope_factor (%g) must be at least 1",
                c->rope_factor);
        REQUIRE(c->rope_low_freq_factor > 0 &&
                    c->rope_high_freq_factor > c->rope_low_freq_factor,
                "model: rope_high_freq_factor (%g) must exceed rope_low_freq_factor (%g) > 0",
                c->rope_high_freq_factor, c->rope_low_freq_factor);
        REQUIRE(c->rope_original_max_position_embeddings > 0,
                "model: rope_original_max_position_embeddings must be positive");
    } else {
        REQUIRE(c->rope_type[0] == 0 || strcmp(c->rope_type, "default") == 0,
                "model: rope_type '%s' is not default or llama3", c->rope_type);
    }
    if (c->partial_rotary_factor > 0 && c->partial_rotary_factor < 1) {
        int rot = (int)(c->head_dim * c->partial_rotary_factor);
        REQUIRE(rot >= 2 && rot % 2 == 0,
                "model: partial_rotary_factor (%g) of head_dim %d rotates %d dimensions: need an "
                "even number, at least 2", c->partial_rotary_factor, c->head_dim, rot);
        REQUIRE(strcmp(c->rope_type, "llama3") != 0,
                "model: partial_rotary_factor with rope_type llama3 is not supported");
    }
    REQUIRE(!c->use_qk_norm || (def->hf_keys & LB_HF_USE_QK_NORM),
            "model: use_qk_norm: %s's q/k norms are not optional", def->arch);
    REQUIRE(def->moe || (c->first_k_dense_replace == 0 && c->n_shared_experts == 0),
            "model: first_k_dense_replace and n_shared_experts need a MoE model (%s is dense)",
            def->arch);
    REQUIRE(c->first_k_dense_replace <= c->num_hidden_layers,
            "model: first_k_dense_replace (%d) exceeds num_hidden_layers (%d)",
            c->first_k_dense_replace, c->num_hidden_layers);
    if (def->moe && def->sigmoid_router) {
        REQUIRE(c->num_experts > 0 && c->num_experts_per_tok > 0 &&
                    lb_router_sigmoid_shape_ok(0, c->num_experts, c->num_experts_per_tok,
                                               c->n_group, c->topk_group),
                "model: n_group (%d) must divide num_experts (%d), be at most 64, and topk_group "
                "(%d, at most n_group) groups must hold num_experts_per_tok (%d) experts",
                c->n_group, c->num_experts, c->topk_group, c->num_experts_per_tok);
        REQUIRE(c->routed_scaling_factor > 0, "model: routed_scaling_factor must be positive");
        REQUIRE(c->router_aux_loss_coef == 0,
                "model: router_aux_loss_coef (%g) must be 0: %s's sigmoid router has no "
                "load-balancing loss (its selection bias balances the experts, "
                "router_bias_update_rate)", c->router_aux_loss_coef, def->arch);
    } else {
        REQUIRE(c->n_group <= 1 && c->topk_group <= 1,
                "model: n_group and topk_group are the sigmoid router's (%s routes by softmax)",
                def->arch);
    }
    if (def->moe && c->first_k_dense_replace > 0)
        REQUIRE(c->intermediate_size > 0,
                "model: intermediate_size must be positive (the dense leading layers')");
    if (def->moe) {
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

// --- tensors ---------------------------------------------------------------------------------
// Tensor order is the definition's (and the checkpoint's) order; names are Hugging Face's (fused
// experts as in transformers 5; see src/io/convert.c for the per-expert hub layout). Sequence
// parallelism splits the rows that norms, the embedding and the LM head see, so their gradients
// are partial then; q/k norms see only the rank's heads, so always.
static int add(lb_tensor *out, int i, int is_norm, lb_split split, lb_tpgrad tpgrad, int ndim,
               int64_t d0, int64_t d1, int64_t d2, const char *fmt, int layer)
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
        t->split = split;
        t->tpgrad = tpgrad;
        t->layer = layer;
    }
    return i + 1;
}

// Marks the tensor just added as a linear layer's weight: its gradient comes from that layer's
// wgrads alone, each writing all of it (lb_model_grad_beta).
static int linear(lb_tensor *out, int i)
{
    if (out) out[i - 1].wgrad_gemm = 1;
    return i;
}

#define SP LB_TPGRAD_PARTIAL_SP
#define WHOLE LB_TPGRAD_WHOLE

int lb_embed_tensors(const lb_model_config *c, lb_tensor *out, int i)
{
    return add(out, i, 0, LB_SPLIT_NONE, SP, 2, c->vocab_size, c->hidden_size, 0,
               "model.embed_tokens.weight", -1);
}

// A bias: zero at init, no weight decay.
static int bias(lb_tensor *out, int i)
{
    if (out) out[i - 1].zero_init = 1;
    return i;
}

int lb_attn_tensors(const lb_model_config *c, lb_tensor *out, int i, int l, int qk_norm)
{
    int64_t C = c->hidden_size, D = c->head_dim, hq = c->num_attention_heads,
            hkv = c->num_key_value_heads;
    const char *const proj[3] = {"q", "k", "v"};
    const int64_t rows[3] = {hq * D, hkv * D, hkv * D};
    char name[LB_TENSOR_NAME];
    i = add(out, i, 1, LB_SPLIT_NONE, SP, 1, C, 0, 0, "model.layers.%d.input_layernorm.weight", l);
    for (int p = 0; p < 3; p++) {   // each weight, then its bias (attention_bias)
        snprintf(name, sizeof name, "model.layers.%%d.self_attn.%s_proj.weight", proj[p]);
        i = linear(out, add(out, i, 0, LB_SPLIT_COL, WHOLE, 2, rows[p], C, 0, name, l));
        if (!c->attention_bias) continue;
        snprintf(name, sizeof name, "model.layers.%%d.self_attn.%s_proj.bias", proj[p]);
        i = bias(out, add(out, i, 0, LB_SPLIT_COL, WHOLE, 1, rows[p], 0, 0, name, l));
    }
    i = linear(out, add(out, i, 0, LB_SPLIT_ROW, WHOLE, 2, C, hq * D, 0,
                        "model.layers.%d.self_attn.o_proj.weight", l));
    if (qk_norm) {
        const lb_tpgrad heads = LB_TPGRAD_PARTIAL;
        i = add(out, i, 1, LB_SPLIT_NONE, heads, 1, D, 0, 0,
                "model.layers.%d.self_attn.q_norm.weight", l);
        i = add(out, i, 1, LB_SPLIT_NONE, heads, 1, D, 0, 0,
                "model.layers.%d.self_attn.k_norm.weight", l);
    }
    return i;
}

int lb_mlp_tensors(const lb_model_config *c, lb_tensor *out, int i, int l)
{
    int64_t C = c->hidden_size, F = c->intermediate_size;
    i = add(out, i, 1, LB_SPLIT_NONE, SP, 1, C, 0, 0,
            "model.layers.%d.post_attention_layernorm.weight", l);
    i = linear(out, add(out, i, 0, LB_SPLIT_COL2, WHOLE, 2, 2 * F, C, 0,
                        "model.layers.%d.mlp.gate_up_proj.weight", l));
    return linear(out, add(out, i, 0, LB_SPLIT_ROW, WHOLE, 2, C, F, 0,
                           "model.layers.%d.mlp.down_proj.weight", l));
}

int lb_moe_tensors(const lb_model_config *c, lb_tensor *out, int i, int l)
{
    int64_t C = c->hidden_size, F = c->moe_intermediate_size, E = c->num_experts;
    i = add(out, i, 1, LB_SPLIT_NONE, SP, 1, C, 0, 0,
            "model.layers.%d.post_attention_layernorm.weight", l);
    i = linear(out, add(out, i, 0, LB_SPLIT_NONE, WHOLE, 2, E, C, 0,
                        "model.layers.%d.mlp.gate.weight", l));
    if (sigmoid_router(c)) {   // the selection bias: no gradient, moved after each step
        i = bias(out, add(out, i, 0, LB_SPLIT_NONE, WHOLE, 1, E, 0, 0,
                          "model.layers.%d.mlp.gate.e_score_correction_bias", l));
        if (out) out[i - 1].frozen = 1;
    }
    i = linear(out, add(out, i, 0, LB_SPLIT_EXPERT_COL2, WHOLE, 3, E, 2 * F, C,
                        "model.layers.%d.mlp.experts.gate_up_proj", l));
    i = linear(out, add(out, i, 0, LB_SPLIT_EXPERT_ROW, WHOLE, 3, E, C, F,
                        "model.layers.%d.mlp.experts.down_proj", l));
    if (c->n_shared_experts > 0) {   // one dense SwiGLU MLP of the shared experts' width
        int64_t Fs = (int64_t)c->n_shared_experts * F;
        i = linear(out, add(out, i, 0, LB_SPLIT_COL2, WHOLE, 2, 2 * Fs, C, 0,
                            "model.layers.%d.mlp.shared_experts.gate_up_proj.weight", l));
        i = linear(out, add(out, i, 0, LB_SPLIT_ROW, WHOLE, 2, C, Fs, 0,
                            "model.layers.%d.mlp.shared_experts.down_proj.weight", l));
    }
    return i;
}

int lb_ffn_tensors(const lb_model_config *c, lb_tensor *out, int i, int l)
{
    return layer_moe(c, l) ? lb_moe_tensors(c, out, i, l) : lb_mlp_tensors(c, out, i, l);
}

int lb_head_tensors(const lb_model_config *c, lb_tensor *out, int i)
{
    int L = c->num_hidden_layers;
    i = add(out, i, 1, LB_SPLIT_NONE, SP, 1, c->hidden_size, 0, 0, "model.norm.weight", L);
    return linear(out, add(out, i, 0, LB_SPLIT_NONE, SP, 2, c->vocab_size, c->hidden_size, 0,
                           "lm_head.weight", L));
}

#undef SP
#undef WHOLE

static int tensor_index(const lb_model *m, const char *fmt, int layer)
{
    char name[LB_TENSOR_NAME];
    snprintf(name, sizeof name, fmt, layer);
    const lb_tensor *t = lb_model_find(m, name);
    if (!t) lb_die("model has no tensor %s", name);
    return (int)(t - m->tensors);
}

// A layer's tensors by role, found by name once per model (m->layer_tensors): every forward
// and backward then reads them at fixed places, as llm.c does, instead of formatting 17 names
// and comparing them with every tensor's for each layer of each pass (decode steps included).
enum { R_LN1, R_Q, R_K, R_V, R_O, R_QN, R_KN, R_LN2, R_ROUTER, R_GU, R_DOWN, R_QB, R_KB, R_VB,
       R_EBIAS, R_SGU, R_SDOWN, R_COUNT };

static const int *layer_tensors(lb_model *m, int l)
{
    if (!m->layer_tensors) {
        const lb_model_config *c = &m->cfg;
        const int qkn = has_qk_norm(m), n = m->layer_end - m->layer_begin;
        const int ab = c->attention_bias, sig = sigmoid_router(c), sh = shared_experts(c);
        int *ix = lb_malloc((size_t)(n > 0 ? n : 1) * R_COUNT * sizeof *ix);
        for (int i = 0; i < n; i++) {
        const int moe = layer_moe(c, m->layer_begin + i);
        const char *const names[R_COUNT] = {
            "model.layers.%d.input_layernorm.weight", "model.layers.%d.self_attn.q_proj.weight",
            "model.layers.%d.self_attn.k_proj.weight", "model.layers.%d.self_attn.v_proj.weight",
            "model.layers.%d.self_attn.o_proj.weight",
            qkn ? "model.layers.%d.self_attn.q_norm.weight" : NULL,
            qkn ? "model.layers.%d.self_attn.k_norm.weight" : NULL,
            "model.layers.%d.post_attention_layernorm.weight",
            moe ? "model.layers.%d.mlp.gate.weight" : NULL,
            moe ? "model.layers.%d.mlp.experts.gate_up_proj"
                : "model.layers.%d.mlp.gate_up_proj.weight",
            moe ? "model.layers.%d.mlp.experts.down_proj" : "model.layers.%d.mlp.down_proj.weight",
            ab ? "model.layers.%d.self_attn.q_proj.bias" : NULL,
            ab ? "model.layers.%d.self_attn.k_proj.bias" : NULL,
            ab ? "model.layers.%d.self_attn.v_proj.bias" : NULL,
            moe && sig ? "model.layers.%d.mlp.gate.e_score_correction_bias" : NULL,
            moe && sh ? "model.layers.%d.mlp.shared_experts.gate_up_proj.weight" : NULL,
            moe && sh ? "model.layers.%d.mlp.shared_experts.down_proj.weight" : NULL};
            for (int r = 0; r < R_COUNT; r++)
                ix[i * R_COUNT + r] =
                    names[r] ? tensor_index(m, names[r], m->layer_begin + i) : -1;
        }
        m->layer_tensors = ix;
    }
    if (l < m->layer_begin || l >= m->layer_end)
        lb_die("layer %d is not on this stage (layers %d..%d)", l, m->layer_begin,
               m->layer_end - 1);
    return m->layer_tensors + (size_t)(l - m->layer_begin) * R_COUNT;
}

static lb_layer_w layer_weights(lb_model *m, float *base, int l)
{
    const int *ix = layer_tensors(m, l);
#define P(r) (ix[r] < 0 ? NULL : base + m->tensors[ix[r]].offset)
#define WC(r) (ix[r] < 0 ? NULL : &m->wcache[ix[r]])
    lb_layer_w w = {P(R_LN1), P(R_Q), P(R_K), P(R_V), P(R_O), P(R_QN), P(R_KN), P(R_LN2),
                 P(R_ROUTER), P(R_GU), P(R_DOWN), WC(R_Q), WC(R_K), WC(R_V), WC(R_O),
                 WC(R_ROUTER), WC(R_GU), WC(R_DOWN), P(R_QB), P(R_KB), P(R_VB), P(R_EBIAS),
                 P(R_SGU), P(R_SDOWN), WC(R_SGU), WC(R_SDOWN)};
#undef P
#undef WC
    return w;
}

lb_dims lb_dims_of(const lb_model *m)
{
    const lb_model_config *c = &m->cfg;
    const lb_model_parallel *p = &m->par;
    int split = is_moe(c) ? p->etp : p->tp;
    lb_dims d = {c->hidden_size, c->head_dim, c->num_attention_heads / p->tp,
              c->num_key_value_heads / p->tp, ffn_dim(c) / split, c->num_experts,
              c->num_experts / p->ep, c->num_experts_per_tok, c->vocab_size, p->tp, p->ep, p->sp,
              p->tp / p->etp, p->tp_rank / p->etp, c->intermediate_size / p->tp,
              shared_experts(c) ? c->n_shared_experts * c->moe_intermediate_size / p->tp : 0};
    return d;
}

// q, k, v (n, heads x D) = ln (n, C) times their weights: one call, so a low-precision ln is
// quantized once for the three (lb_linear_fwd_shared).
void lb_qkv_fwd(lb_linear *lin, int l, const lb_layer_w *w, lb_act ln, float *q, float *k,
                float *v, lb_dims d)
{
    const float *ws[3] = {w->q, w->k, w->v};
    const lb_wcache *cs[3] = {w->cq, w->ck, w->cv};
    float *ys[3] = {q, k, v};
    const int outs[3] = {d.hq * d.D, d.hkv * d.D, d.hkv * d.D};
    lb_linear_fwd_shared(lin, l, LB_ROLE_ATTN_QKV, ln, 3, ws, cs, ys, outs);
}

// What the fprop of (layer l, role) reads of a norm kept in fp32 (ln) and, beside it or alone,
// in bf16 (ln16): the bf16 rows for a bf16 fprop or where they are all there is, else the fp32
// ones.
static lb_act norm_in(const lb_model *m, int l, lb_role role, const float *ln,
                      const uint16_t *ln16, int n, int c)
{
    if (ln16 && (!ln || lb_contract_site(&m->contract, l, role, LB_PASS_FPROP)->fmt ==
                            LB_FMT_BF16))
        return lb_act_bf16(ln16, n, c);
    return lb_act_f32(ln, n, c);
}

// The rows [*o, *o + return) of n that this rank's part sends through the experts.
static int part_rows(const lb_dims *d, int n, int *o)
{
    *o = (int)((long)d->part * n / d->parts);
    return (int)((long)(d->part + 1) * n / d->parts) - *o;
}

// Every weight cache of this rank's layers (and the LM head on the last stage), in one order:
// fn(m, its cache, layer, role, the weights, count, out, in, ctx).
typedef void (*wcache_fn)(lb_model *m, lb_wcache *c, int l, lb_role role, const float *w,
                          int count, int out, int in, void *ctx);

static void wcache_each(lb_model *m, wcache_fn fn, void *ctx)
{
    const lb_model_config *c = &m->cfg;
    lb_dims d = lb_dims_of(m);
    for (int l = m->layer_begin; l < m->layer_end; l++) {
        lb_layer_w w = layer_weights(m, m->params, l);
        fn(m, w.cq, l, LB_ROLE_ATTN_QKV, w.q, 1, d.hq * d.D, d.C, ctx);
        fn(m, w.ck, l, LB_ROLE_ATTN_QKV, w.k, 1, d.hkv * d.D, d.C, ctx);
        fn(m, w.cv, l, LB_ROLE_ATTN_QKV, w.v, 1, d.hkv * d.D, d.C, ctx);
        fn(m, w.co, l, LB_ROLE_ATTN_OUT, w.o, 1, d.C, d.hq * d.D, ctx);
        if (layer_moe(c, l)) {
            fn(m, w.crouter, l, LB_ROLE_ROUTER, w.router, 1, d.E, d.C, ctx);
            fn(m, w.cgu, l, LB_ROLE_MOE_GATE_UP, w.gu, d.El, 2 * d.F, d.C, ctx);
            fn(m, w.cdown, l, LB_ROLE_MOE_DOWN, w.down, d.El, d.C, d.F, ctx);
            if (w.sgu) {   // the shared experts: a dense MLP's roles
                fn(m, w.csgu, l, LB_ROLE_MLP_GATE_UP, w.sgu, 1, 2 * d.Fs, d.C, ctx);
                fn(m, w.csdown, l, LB_ROLE_MLP_DOWN, w.sdown, 1, d.C, d.Fs, ctx);
            }
        } else {
            fn(m, w.cgu, l, LB_ROLE_MLP_GATE_UP, w.gu, 1, 2 * d.Fd, d.C, ctx);
            fn(m, w.cdown, l, LB_ROLE_MLP_DOWN, w.down, 1, d.C, d.Fd, ctx);
        }
    }
    if (m->last_stage) {
        int h = tensor_index(m, "lm_head.weight", 0);
        fn(m, &m->wcache[h], c->num_hidden_layers - 1, LB_ROLE_LM_HEAD,
           m->params + m->tensors[h].offset, 1, d.V, d.C, ctx);
    }
}

static void refresh_one(lb_model *m, lb_wcache *c, int l, lb_role role, const float *w,
                        int count, int out, int in, void *ctx)
{
    lb_wcache_build(&m->lin, c, l, role, w, count, out, in);
}

static void bytes_one(lb_model *m, lb_wcache *c, int l, lb_role role, const float *w, int count,
                      int out, int in, void *ctx)
{
    *(size_t *)ctx += lb_wcache_bytes(&m->lin, l, role, count, out, in);
}

void lb_decoder_weights_refresh(lb_model *m) { wcache_each(m, refresh_one, NULL); }

size_t lb_decoder_wcache_bytes(lb_model *m)
{
    size_t n = 0;
    wcache_each(m, bytes_one, &n);
    return n;
}

static float *falloc(lb_backend *be, size_t n) { return be->alloc(be, n * sizeof(float)); }

// A grow-only backend buffer of n elements of size bytes (capacity *cap elements): replaced
// by a larger one when too small, its contents then lost.
static void *grow_n(lb_backend *be, void *p, size_t *cap, size_t n, size_t size)
{
    if (n <= *cap) return p;
    if (p) be->free(be, p);
    *cap = n;
    return be->alloc(be, n * size);
}
static float *grow(lb_backend *be, float **p, size_t *cap, size_t n)
{
    return *p = grow_n(be, *p, cap, n, sizeof **p);
}
static uint16_t *grow16(lb_backend *be, uint16_t **p, size_t *cap, size_t n)
{
    return *p = grow_n(be, *p, cap, n, sizeof **p);
}
static double *grow64(lb_backend *be, double **p, size_t *cap, size_t n)
{
    return *p = grow_n(be, *p, cap, n, sizeof **p);
}

// Elements of a bf16 copy of (rows, cols) values (to_bf16's layout: rows padded to 8).
static size_t n16(size_t rows, int cols) { return rows * (size_t)((cols + 7) / 8 * 8); }

static int ln1_16(const lb_model *m);

// Whether the q/k/v projections of layer l read the attention's input norm in bf16 alone, and
// quantize it: where the training step stores only that norm's bf16 copy (ln1_16) and those
// projections are quantized, the cached forward quantizes the same bf16 values.
static int qkv_quantized16(const lb_model *m, int l)
{
    return ln1_16(m) && lb_linear_quantized(&m->lin, l, LB_ROLE_ATTN_QKV);
}

// The cached forward's ln16 where the fprop of (layer l, role) is a bf16 GEMM, which reads the
// norm's bf16 copy (rmsnorm_fwd's out16, lb_linear_fwd16), or quantizes it (qkv_quantized16);
// else NULL (no copy written).
static uint16_t *cached_ln16(const lb_model *m, lb_cached_acts *a, int l, lb_role role)
{
    if (role == LB_ROLE_ATTN_QKV && qkv_quantized16(m, l)) return a->ln16;
    return lb_contract_site(&m->contract, l, role, LB_PASS_FPROP)->fmt == LB_FMT_BF16 ? a->ln16
                                                                                      : NULL;
}

// Whether role's expert GEMMs of layer l take their activations in bf16 alone, written by the
// ops that make them (lb_linear_grouped_fwd's x16): bf16 GEMMs, which read those values
// exactly, or quantized ones (lb_linear_quantized), which quantize them. In the low-precision
// recipes that rounds an activation to bf16 before its quantization, as Transformer Engine's
// and DeepSeek-V3's bf16 activations are.
static int takes16(const lb_model *m, int l, lb_role role)
{
    return lb_linear_grouped_bf16(&m->lin, l, role) || lb_linear_quantized(&m->lin, l, role);
}

// Whether role's expert GEMMs of layer l take their input gradients (dy) in bf16: bf16 GEMMs
// alone (a quantized backward reads fp32 gradients).
static int grads16(const lb_model *m, int l, lb_role role)
{
    return lb_linear_grouped_bf16(&m->lin, l, role);
}

// grads16 over this stage's layers, as takes16_layers.
static int grads16_layers(const lb_model *m, lb_role role, int every)
{
    for (int l = m->layer_begin; l < m->layer_end; l++)
        if (grads16(m, l, role) != every) return !every;
    return every;
}

// Over this stage's layers: 1 if some layer's role takes them (every 0), or if all do (1).
static int takes16_layers(const lb_model *m, lb_role role, int every)
{
    for (int l = m->layer_begin; l < m->layer_end; l++)
        if (takes16(m, l, role) != every) return !every;
    return every;
}

// Whether layer l's expert GEMMs store the output of pass (fprop or dgrad) in bf16
// (lb_gemm_args.c16) for the ops that read it, wherever their grouped call can
// (lb_linear_grouped_c16: bf16, or a quantized fprop or dgrad): gate/up's gu (the SwiGLUs) and
// down's dh (swiglu_bwd), whose elements are whole in every layout. Never the routed outputs,
// down's yp (the combine) and gate/up's dxp (moe_permute_bwd): under etp an etp rank's yp and
// dxp are partial sums over etp (summed by the caller in fp32), so rounding them where etp is 1
// alone made the recipe's numbers depend on the layout (doc/parallel.md,
// "Low precision under parallel layouts"); their callers do not ask.
static int out16(const lb_model *m, int l, lb_role role, lb_pass pass)
{
    return lb_linear_grouped_c16(&m->lin, l, role, pass);
}

// out16 over this stage's layers, as takes16_layers.
static int out16_layers(const lb_model *m, lb_role role, lb_pass pass, int every)
{
    for (int l = m->layer_begin; l < m->layer_end; l++)
        if (out16(m, l, role, pass) != every) return !every;
    return every;
}

// Whether the training step stores q and k after their norms and RoPE in bf16 (lb_layer_acts
// qr16, kr16): where the contract's attention is bf16, which rounds them to bf16 before any
// product, so the copy is all it reads and the step's bits do not change. Not with the fp8 KV
// cache's straight-through quantization (kv_fake_quant), which rewrites k in fp32 first.
static int qk16(const lb_model *m) { return m->contract.attention_bf16 && !m->kv_fp8; }

// Whether the training step stores the attention's input norm only in bf16 (lb_layer_acts
// ln1_16): where the q/k/v projections are plain bf16 GEMMs in every pass of every layer of the
// stage, the fprop and the wgrads read the norm rounded to bf16 anyway, so the step's bits do
// not change; where they are quantized in every pass (lb_linear_quantized), the quantizations
// read its bf16 values (the cached forward's too, qkv_quantized16), whatever the layout: under
// sequence parallelism the ranks gather the norm's rows in bf16.
static int ln1_16(const lb_model *m)
{
    for (int l = m->layer_begin; l < m->layer_end; l++)
        if (!lb_linear_plain16(&m->lin, l, LB_ROLE_ATTN_QKV) &&
            !lb_linear_quantized(&m->lin, l, LB_ROLE_ATTN_QKV))
            return 0;
    return 1;
}

void lb_decoder_act_plan(const lb_model *m, lb_act_plan *p)
{
    for (int l = m->layer_begin; l < m->layer_end; l++) {
        p->qk += qk16(m);
        p->ln1 += ln1_16(m);
        if (!layer_moe(&m->cfg, l)) continue;
        p->expert_in += takes16(m, l, LB_ROLE_MOE_GATE_UP);   // as lb_ffn_fwd
        p->gate_up_out += out16(m, l, LB_ROLE_MOE_GATE_UP, LB_PASS_FPROP);
        p->swiglu_out += takes16(m, l, LB_ROLE_MOE_DOWN);
        p->down_dgrad += out16(m, l, LB_ROLE_MOE_DOWN, LB_PASS_DGRAD);
    }
}

// Whether layer l applies the routed weights to its experts' SwiGLU outputs, before down
// (lb_swiglu_args.rw), rather than to down's outputs: the same sum in real arithmetic, but
// down's outputs (n*k, c) a layer then need not be kept for the backward, whose weight
// gradient comes from down's dgrad instead (lb_swiglu_args.drw). Every recipe but fp32, whose
// numbers stay those of the weights after down. (As Megatron's moe_apply_probs_on_input, one
// GEMM later: the weighted rows are the rank's whole elements in every layout.)
static int weights_on_h(const lb_model *m, int l)
{
    return lb_contract_site(&m->contract, l, LB_ROLE_MOE_DOWN, LB_PASS_FPROP)->fmt !=
           LB_FMT_FP32;
}

// weights_on_h over this stage's MoE layers, as takes16_layers.
static int weights_on_h_layers(const lb_model *m, int every)
{
    for (int l = m->layer_begin; l < m->layer_end; l++)
        if (layer_moe(&m->cfg, l) && weights_on_h(m, l) != every) return !every;
    return every;
}

// --- tensor parallelism: Megatron's conjugate operators (parallel/tensor_parallel.h) ---------
// over this model piece's tp group and backend; (n, C) are whole rows, this rank's n / tp of
// them under sequence parallelism.

static void tp_reduce(lb_model *m, float *part, float *out, int n, int C)
{
    lb_tp_reduce(m->be, m->par.tp_comm, m->par.sp, part, out, n, C);
}

static void tp_gather(lb_model *m, const float *mine, float *full, int n, int C)
{
    lb_tp_gather(m->be, m->par.tp_comm, m->par.sp, mine, full, n, C);
}

static void tp_sum(lb_model *m, float *x, size_t count)
{
    lb_tp_all_reduce(m->be, m->par.tp_comm, x, count);
}

// --- activations ----------------------------------------------------------------------------------

static void ffn_create(lb_model *m, lb_ffn_acts *f, int n)
{
    lb_backend *be = m->be;
    lb_dims d = lb_dims_of(m);
    size_t rows = (size_t)n;
    if (is_moe(&m->cfg)) {
        rows = (size_t)n * d.K;
        f->rlogits = falloc(be, (size_t)n * d.E);
        f->probs = falloc(be, (size_t)n * d.E);
        f->weight = falloc(be, (size_t)n * d.K);
        f->idx = be->alloc(be, (size_t)n * d.K * sizeof(int32_t));
        f->row = be->alloc(be, (size_t)n * d.K * sizeof(int32_t));
        f->counts = lb_calloc(d.E, sizeof(int));
        f->counts_dev = be->alloc(be, (size_t)d.E * sizeof(int));
        f->aux_grad = falloc(be, d.E);
        // down's routed outputs stay fp32 (out16), kept where the weights follow down
        if (!weights_on_h_layers(m, 1)) grow(be, &f->yp, &f->cap_yp, rows * d.C);
        if (weights_on_h_layers(m, 0)) grow(be, &f->wp, &f->cap_wp, rows);
        if (out16_layers(m, LB_ROLE_MOE_GATE_UP, LB_PASS_FPROP, 0))
            grow16(be, &f->gu16, &f->cap_gu16, n16(rows, 2 * d.F));
        if (takes16_layers(m, LB_ROLE_MOE_DOWN, 0))
            grow16(be, &f->h16, &f->cap_h16, n16(rows, d.F));   // a shared one is big enough
    }
    if (!is_moe(&m->cfg) || !out16_layers(m, LB_ROLE_MOE_GATE_UP, LB_PASS_FPROP, 1))
        grow(be, &f->gu, &f->cap_gu, rows * 2 * d.F);
    if (!is_moe(&m->cfg) || !takes16_layers(m, LB_ROLE_MOE_DOWN, 1))
        grow(be, &f->h, &f->cap_h, rows * d.F);   // a shared h is big enough already
    if (is_moe(&m->cfg) && has_dense(&m->cfg)) {   // the dense leading layers' (grow-only)
        grow(be, &f->gu, &f->cap_gu, (size_t)n * 2 * d.Fd);
        grow(be, &f->h, &f->cap_h, (size_t)n * d.Fd);
    }
    if (d.Fs) {   // the shared experts' MLP, kept by every layer (not recomputed)
        f->sgu = falloc(be, (size_t)n * 2 * d.Fs);
        f->sh = falloc(be, (size_t)n * d.Fs);
    }
}

static void ffn_free(lb_model *m, lb_ffn_acts *f)
{
    lb_backend *be = m->be;
    void *bufs[] = {f->rlogits, f->probs, f->weight, f->idx, f->row, f->aux_grad, f->yp,
                    f->xe, f->xe16, f->gu, f->h, f->h16, f->gu16, f->wp, f->wpe,
                    f->counts_dev, f->sgu, f->sh};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) be->free(be, bufs[i]);
    free(f->counts);
    lb_ep_route_free(&f->route, be);
}

// The MoE scratch (rows, rows16; lb_ffn_bwd's dgu, dh or their bf16 forms, shared by the
// layers) for `rows` routed rows (this rank's tokens'), made with the activations so that
// `lowbit info` counts what a step holds. The experts' rows only where they are known (ep 1,
// the experts not split into parts); elsewhere lb_ffn_fwd and lb_ffn_bwd grow them on first
// use, as they do here past these sizes.
static void scratch_reserve(lb_model *m, lb_moe_scratch *s, size_t rows)
{
    lb_backend *be = m->be;
    lb_dims d = lb_dims_of(m);
    // rows: xp and dyp in fp32, or (weights_on_h) down's outputs in the forward and (x16)
    // gate/up's dgrad in the backward: some of them in every MoE model
    grow(be, &s->rows, &s->cap_rows, rows * d.C);
    if (weights_on_h_layers(m, 0)) {
        grow64(be, &s->dwp, &s->cap_dwp, rows);
        grow(be, &s->dw32, &s->cap_dw32, rows);
    }
    if (d.ep != 1 || d.parts != 1) return;
    if (takes16_layers(m, LB_ROLE_MOE_DOWN, 0) || takes16_layers(m, LB_ROLE_MOE_GATE_UP, 0))
        grow16(be, &s->rows16, &s->cap_rows16, n16(rows, d.C));
    if (grads16_layers(m, LB_ROLE_MOE_GATE_UP, 0))
        grow16(be, &s->dgu16, &s->cap_dgu16, n16(rows, 2 * d.F));
    if (!grads16_layers(m, LB_ROLE_MOE_GATE_UP, 1)) grow(be, &s->dgu, &s->cap_dgu, rows * 2 * d.F);
    if (out16_layers(m, LB_ROLE_MOE_DOWN, LB_PASS_DGRAD, 0))
        grow16(be, &s->dh16, &s->cap_dh16, n16(rows, d.F));
    if (!out16_layers(m, LB_ROLE_MOE_DOWN, LB_PASS_DGRAD, 1))
        grow(be, &s->dh, &s->cap_dh, rows * d.F);
}

// The quantized operands' scratch (m->lin's) every quantized GEMM of this stage takes in a
// step of n rows (ns of them this rank's), laid out once with the activations: the largest
// request of each of its buffers, routing balanced (lb_linear_qscratch_reserve).
static void qscratch_reserve(lb_model *m, int n, int ns)
{
    lb_linear *lin = &m->lin;
    lb_dims d = lb_dims_of(m);
    for (int l = m->layer_begin; l < m->layer_end; l++) {
        lb_linear_qscratch_reserve(lin, l, LB_ROLE_ATTN_QKV, 1, n, d.hq * d.D, d.C);
        lb_linear_qscratch_reserve(lin, l, LB_ROLE_ATTN_OUT, 1, n, d.C, d.hq * d.D);
        if (!layer_moe(&m->cfg, l)) {
            lb_linear_qscratch_reserve(lin, l, LB_ROLE_MLP_GATE_UP, 1, n, 2 * d.Fd, d.C);
            lb_linear_qscratch_reserve(lin, l, LB_ROLE_MLP_DOWN, 1, n, d.C, d.Fd);
            continue;
        }
        int o, rows = part_rows(&d, n, &o) * d.K;
        lb_linear_qscratch_reserve(lin, l, LB_ROLE_ROUTER, 1, n, d.E, d.C);
        lb_linear_qscratch_reserve(lin, l, LB_ROLE_MOE_GATE_UP, d.El, rows, 2 * d.F, d.C);
        lb_linear_qscratch_reserve(lin, l, LB_ROLE_MOE_DOWN, d.El, rows, d.C, d.F);
        if (d.Fs) {
            lb_linear_qscratch_reserve(lin, l, LB_ROLE_MLP_GATE_UP, 1, n, 2 * d.Fs, d.C);
            lb_linear_qscratch_reserve(lin, l, LB_ROLE_MLP_DOWN, 1, n, d.C, d.Fs);
        }
    }
    if (m->last_stage)
        lb_linear_qscratch_reserve(lin, m->cfg.num_hidden_layers - 1, LB_ROLE_LM_HEAD, 1,
                                   lb_model_ce_rows(m, ns), d.V, d.C);
}

static void scratch_free(lb_backend *be, lb_moe_scratch *s)
{
    void *bufs[] = {s->xs, s->ye, s->dye, s->dxe, s->dgu, s->dh, s->rows, s->rows16, s->dgu16,
                    s->dh16, s->dwp, s->dwpe, s->dw32};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) be->free(be, bufs[i]);
}

// What selective recomputation recomputes (doc/architecture.md, Model: norms, SwiGLU / expert
// activation, core attention): the norm outputs and their rstd, q and k after norm and RoPE, the attention
// output and its lse (and the SwiGLU output, lb_ffn_acts.h).
static void recomputable_create(lb_model *m, lb_layer_acts *L, int n, int ns)
{
    lb_backend *be = m->be;
    lb_dims d = lb_dims_of(m);
    size_t C = d.C, D = d.D, hq = d.hq, hkv = d.hkv;
    if (ln1_16(m)) L->ln1_16 = be->alloc(be, n16(n, (int)C) * sizeof(uint16_t));
    else L->ln1 = falloc(be, (size_t)n * C);
    L->rstd1 = falloc(be, ns);
    L->qrstd = falloc(be, n * hq);
    L->krstd = falloc(be, n * hkv);
    if (qk16(m)) {
        L->qr16 = be->alloc(be, n * hq * D * sizeof(uint16_t));
        L->kr16 = be->alloc(be, n * hkv * D * sizeof(uint16_t));
    } else {
        L->qr = falloc(be, n * hq * D);
        L->kr = falloc(be, n * hkv * D);
    }
    L->att = falloc(be, n * hq * D);
    L->lse = falloc(be, n * hq);
    L->ln2 = falloc(be, n * C);
    L->rstd2 = falloc(be, ns);
}

static void recomputable_free(lb_model *m, lb_layer_acts *L)
{
    lb_backend *be = m->be;
    void *bufs[] = {L->ln1, L->rstd1, L->qrstd, L->qr, L->krstd, L->kr, L->att, L->lse, L->ln2,
                    L->rstd2, L->qr16, L->kr16, L->ln1_16};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) be->free(be, bufs[i]);
}

// One set of those serves every layer under selective recomputation (a->sel); the expert
// activation's rows vary under ep, so its buffer holds the most a rank can receive.
static void shared_create(lb_model *m, lb_layer_acts *S, int n, int ns)
{
    lb_dims d = lb_dims_of(m);
    size_t rows = is_moe(&m->cfg) ? (size_t)d.ep * n * d.K : (size_t)n;
    recomputable_create(m, S, n, ns);
    if (!is_moe(&m->cfg) || !takes16_layers(m, LB_ROLE_MOE_DOWN, 1))
        grow(m->be, &S->f.h, &S->f.cap_h, rows * d.F);
    if (is_moe(&m->cfg) && has_dense(&m->cfg))   // the dense leading layers' h too
        grow(m->be, &S->f.h, &S->f.cap_h, (size_t)n * d.Fd);
    // h's bf16 copy is recomputed in h's place where some layer's GEMMs take it
    if (is_moe(&m->cfg) && takes16_layers(m, LB_ROLE_MOE_DOWN, 0))
        grow16(m->be, &S->f.h16, &S->f.cap_h16, n16(rows, d.F));
}

static void shared_free(lb_model *m, lb_layer_acts *S)
{
    recomputable_free(m, S);
    if (S->f.h) m->be->free(m->be, S->f.h);
    if (S->f.h16) m->be->free(m->be, S->f.h16);
}

// A layer's saved activations (all but its input x) for n rows, ns of them this rank's; with
// S, the recomputed ones are S's.
static void layer_create(lb_model *m, lb_layer_acts *L, int n, int ns, const lb_layer_acts *S)
{
    lb_backend *be = m->be;
    lb_dims d = lb_dims_of(m);
    size_t C = d.C, D = d.D, hq = d.hq, hkv = d.hkv;
    L->q = falloc(be, n * hq * D);
    L->k = falloc(be, n * hkv * D);
    L->v = falloc(be, n * hkv * D);
    L->xmid = falloc(be, ns * C);
    if (S) {
        L->shared = 1;
        L->ln1 = S->ln1, L->rstd1 = S->rstd1, L->qrstd = S->qrstd, L->qr = S->qr;
        L->krstd = S->krstd, L->kr = S->kr, L->att = S->att, L->lse = S->lse;
        L->qr16 = S->qr16, L->kr16 = S->kr16, L->ln1_16 = S->ln1_16;
        L->ln2 = S->ln2, L->rstd2 = S->rstd2;
        L->f.h = S->f.h, L->f.cap_h = S->f.cap_h;   // big enough: grow never replaces it
        L->f.h16 = S->f.h16, L->f.cap_h16 = S->f.cap_h16;
    } else {
        recomputable_create(m, L, n, ns);
    }
    ffn_create(m, &L->f, n);
}

static void layer_free(lb_model *m, lb_layer_acts *L)
{
    lb_backend *be = m->be;
    void *own[] = {L->q, L->k, L->v, L->xmid};
    for (size_t i = 0; i < sizeof own / sizeof own[0]; i++)
        if (own[i]) be->free(be, own[i]);
    if (L->shared) L->f.h = NULL, L->f.h16 = NULL;   // sel's
    else recomputable_free(m, L);
    ffn_free(m, &L->f);
}

// The RoPE frequencies of the configuration's rope_type in backend memory (D/2 doubles), or
// NULL for plain RoPE (the op's own theta^(-2i/D)).
static double *rope_freq_create(lb_model *m)
{
    const lb_model_config *c = &m->cfg;
    if (strcmp(c->rope_type, "llama3") != 0) return NULL;
    int half = c->head_dim / 2;
    double *host = lb_malloc((size_t)half * sizeof(double));
    lb_rope_inv_freq_llama3(host, c->head_dim, c->rope_theta, c->rope_factor,
                            c->rope_low_freq_factor, c->rope_high_freq_factor,
                            c->rope_original_max_position_embeddings);
    double *dev = m->be->alloc(m->be, (size_t)half * sizeof(double));
    m->be->upload(m->be, dev, host, (size_t)half * sizeof(double));
    free(host);
    return dev;
}

// n ones in backend memory where the attention has biases (their GEMMs), else NULL.
static float *ones_create(lb_model *m, size_t n)
{
    if (!m->cfg.attention_bias) return NULL;
    float *host = lb_malloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) host[i] = 1.0f;
    float *dev = falloc(m->be, n ? n : 1);
    m->be->upload(m->be, dev, host, n * sizeof(float));
    free(host);
    return dev;
}

void *lb_decoder_acts_create(lb_model *m, int b, int t)
{
    lb_backend *be = m->be;
    lb_dims d = lb_dims_of(m);
    lb_acts *a = lb_calloc(1, sizeof *a);
    size_t n = (size_t)b * t, ns = d.sp ? n / d.tp : n, C = d.C, D = d.D, hq = d.hq,
           hkv = d.hkv, F = d.F, E = d.E, K = d.K;
    int moe = is_moe(&m->cfg);
    a->b = b;
    a->t = t;
    a->n = (int)n;
    a->ns = (int)ns;
    a->nl = m->layer_end - m->layer_begin;
    a->l = lb_calloc(a->nl + 1, sizeof *a->l);
    a->recompute = m->recompute;
    if (a->recompute == LB_RECOMPUTE_SELECTIVE) shared_create(m, &a->sel, (int)n, (int)ns);
    for (int l = 0; l <= a->nl; l++) {
        a->l[l].x = falloc(be, ns * C);
        if (l < a->nl && a->recompute != LB_RECOMPUTE_FULL)
            layer_create(m, &a->l[l], (int)n, (int)ns,
                         a->recompute == LB_RECOMPUTE_SELECTIVE ? &a->sel : NULL);
    }
    if (a->recompute == LB_RECOMPUTE_FULL) layer_create(m, &a->work, (int)n, (int)ns, NULL);
    a->lnf = falloc(be, ns * C);
    a->rstdf = falloc(be, ns);
    a->loss = falloc(be, ns);
    a->ce_stats = be->alloc(be, (size_t)ns * 2 * sizeof(double));
    a->pos = be->alloc(be, n * sizeof(int32_t));
    int32_t *pos = lb_malloc(n * sizeof(int32_t));
    for (size_t i = 0; i < n; i++) pos[i] = (int32_t)(i % (size_t)t);   // each row starts at 0
    be->upload(be, a->pos, pos, n * sizeof(int32_t));
    free(pos);
    a->rope_freq = rope_freq_create(m);
    a->ones = ones_create(m, n);
    if (d.tp > 1) a->part = falloc(be, n * C);
    a->dres = falloc(be, ns * C);
    a->dfull = d.sp ? falloc(be, n * C) : a->dres;
    a->dln = falloc(be, n * C);
    a->dlns = d.sp ? falloc(be, ns * C) : a->dln;
    a->dq = falloc(be, n * hq * D);
    a->dk = falloc(be, n * hkv * D);
    a->dv = falloc(be, n * hkv * D);
    a->datt = falloc(be, n * hq * D);
    a->dqr = falloc(be, n * hq * D);
    a->dkr = falloc(be, n * hkv * D);
    if (moe) {
        // gate/up's dgrad: the scratch's rows where the layer reads xp16 (lb_ffn_bwd)
        if (d.ep > 1 || !takes16_layers(m, LB_ROLE_MOE_GATE_UP, 1))
            a->dxp = falloc(be, n * K * C);
        a->drlogits = falloc(be, n * E);
        a->dweight = falloc(be, n * K);
        a->daux = falloc(be, E);
        scratch_reserve(m, &a->ms, n * K);
    }
    qscratch_reserve(m, (int)n, (int)ns);
    // dense MLPs' backward scratch: every layer of a dense model, a MoE model's dense layers and
    // its shared experts
    size_t fw = moe ? (size_t)(has_dense(&m->cfg) ? d.Fd : 0) : F;
    if ((size_t)d.Fs > fw) fw = d.Fs;
    if (fw) {
        a->dgu = falloc(be, n * 2 * fw);
        a->dh = falloc(be, n * fw);
    }
    a->host_loss = lb_malloc(ns * sizeof(float));
    a->host_targets = lb_malloc(ns * sizeof(int32_t));
    return a;
}

void lb_decoder_acts_free(lb_model *m, void *p)
{
    lb_acts *a = p;
    lb_backend *be = m->be;
    for (int l = 0; l <= a->nl; l++) {
        be->free(be, a->l[l].x);
        if (l < a->nl && a->recompute != LB_RECOMPUTE_FULL) layer_free(m, &a->l[l]);
    }
    if (a->recompute == LB_RECOMPUTE_FULL) layer_free(m, &a->work);
    if (a->recompute == LB_RECOMPUTE_SELECTIVE) shared_free(m, &a->sel);
    free(a->l);
    void *bufs[] = {a->lnf, a->rstdf, a->loss, a->ce_stats, a->pos, a->rope_freq, a->ones, a->part,
                    a->dres, a->dln,
                    a->dq, a->dk, a->dv, a->datt, a->dqr, a->dkr, a->dgu, a->dh, a->dxp,
                    a->drlogits, a->dweight, a->daux};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) be->free(be, bufs[i]);
    if (a->dfull != a->dres) be->free(be, a->dfull);
    if (a->dlns != a->dln) be->free(be, a->dlns);
    scratch_free(be, &a->ms);
    free(a->host_loss);
    free(a->host_targets);
    free(a);
}

float *lb_decoder_stage_input(lb_model *m) { return ((lb_acts *)m->acts)->l[0].x; }
float *lb_decoder_stage_output(lb_model *m)
{
    lb_acts *a = m->acts;
    return a->l[a->nl].x;
}
float *lb_decoder_stage_grad(lb_model *m) { return ((lb_acts *)m->acts)->dres; }

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
    be->quantize(be, &q, lb_act_f32(x, rows, d), &a);
    be->dequantize(be, x, &q);
    be->qmat_free(be, &q);
}

// --- the feed-forward blocks, shared by the training and the cached forward ----------------------

// Whether the cached forward's experts of MoE layer l run from the counts in backend memory
// (gemm_experts), so the host never waits for them.
static int experts_on_device(lb_model *m, int l, const lb_layer_w *w)
{
    return m->par.ep == 1 && lb_linear_experts_ok(&m->lin, l, LB_ROLE_MOE_GATE_UP, w->cgu) &&
           lb_linear_experts_ok(&m->lin, l, LB_ROLE_MOE_DOWN, w->cdown);
}

// out (n, c) = this rank's share of the block on ln (n, c): the caller sums it over tp. Returns
// the layer's load-balancing loss (0 for dense blocks or without want_aux). cached: the cached
// forward, which no backward follows, so that under ep 1 with bf16 expert GEMMs the rows per
// expert need not come to the host (moe_plan's device counts, gemm_experts): the host queues
// the whole layer without waiting, and the bits are the same.
double lb_ffn_fwd(lb_model *m, int l, const lb_layer_w *w, lb_ffn_acts *f, lb_moe_scratch *s,
                  const float *ln, const uint16_t *ln16, int n, float *out, int want_aux,
                  int cached)
{
    const lb_model_config *c = &m->cfg;
    lb_backend *be = m->be;
    lb_linear *lin = &m->lin;
    lb_dims d = lb_dims_of(m);
    if (!layer_moe(c, l)) {
        if (m->route_log && is_moe(c))   // a dense layer of a MoE model routes nothing: zeros
            be->zero(be, lb_model_route_stage(m, n) + (size_t)(l - m->layer_begin) * n * d.K,
                     (size_t)n * d.K * sizeof(int32_t));
        float *gu = grow(be, &f->gu, &f->cap_gu, (size_t)n * 2 * d.Fd);
        float *h = grow(be, &f->h, &f->cap_h, (size_t)n * d.Fd);
        lb_linear_fwd(lin, l, LB_ROLE_MLP_GATE_UP, norm_in(m, l, LB_ROLE_MLP_GATE_UP, ln, ln16, n,
                      d.C), w->gu, w->cgu, 0, gu, 2 * d.Fd, 0.0f);
        be->swiglu_fwd(be, &(lb_swiglu_args){.out = h, .gu = gu, .n = n, .f = d.Fd});
        lb_linear_fwd(lin, l, LB_ROLE_MLP_DOWN, lb_act_f32(h, n, d.Fd), w->down, w->cdown, 0, out,
                      d.C, 0.0f);
        return 0.0;
    }
    lb_linear_fwd(lin, l, LB_ROLE_ROUTER, norm_in(m, l, LB_ROLE_ROUTER, ln, ln16, n, d.C),
                  w->router, w->crouter, 0, f->rlogits, d.E, 0.0f);
    if (sigmoid_router(c))   // probs holds the sigmoid scores
        be->router_sigmoid_fwd(be, &(lb_router_sigmoid_args){.n = n, .e = d.E, .k = d.K,
                .n_group = c->n_group, .topk_group = c->topk_group, .renorm = c->norm_topk_prob,
                .scale = (float)c->routed_scaling_factor, .logits = f->rlogits, .bias = w->ebias,
                .scores = f->probs, .idx = f->idx, .weight = f->weight});
    else
        be->router_topk_fwd(be, &(lb_router_args){.probs = f->probs, .idx = f->idx,
                .weight = f->weight, .logits = f->rlogits, .n = n, .e = d.E, .k = d.K,
                .renorm = c->norm_topk_prob});
    if (m->route_log)
        be->copy(be, lb_model_route_stage(m, n) + (size_t)(l - m->layer_begin) * n * d.K, f->idx,
                 (size_t)n * d.K * sizeof(int32_t));
    float aux = 0.0f;   // the sigmoid router has no load-balancing loss
    if (want_aux && !sigmoid_router(c))
        be->moe_aux_loss(be, &aux, f->aux_grad, f->probs, f->idx, n, d.E, d.K);
    // This rank's part of the rows goes to the experts (all of them when etp = tp). The others'
    // rows of `out` stay zero, so the caller's sum over tp assembles every part.
    int o, np = part_rows(&d, n, &o);
    const int x16 = takes16(m, l, LB_ROLE_MOE_GATE_UP);
    const int down16 = takes16(m, l, LB_ROLE_MOE_DOWN);
    uint16_t *xp16 = x16 ? grow16(be, &s->rows16, &s->cap_rows16, n16((size_t)n * d.K, d.C)) : NULL;
    float *xp = x16 ? NULL : grow(be, &s->rows, &s->cap_rows, (size_t)n * d.K * d.C);
    // bf16 experts read the bf16 copies of x and h (x16, down16), quantized ones fp32 x and h
    const int dev = cached && experts_on_device(m, l, w);
    const int wh = weights_on_h(m, l);
    float *wr = wh ? grow(be, &f->wp, &f->cap_wp, (size_t)n * d.K) : NULL;   // the rows' weights
    if (np) {
        be->moe_plan(be, f->row, dev ? NULL : f->counts, dev ? f->counts_dev : NULL,
                     f->idx + (size_t)o * d.K, np, d.E, d.K);
        be->moe_permute(be, xp, xp16, ln + (size_t)o * d.C, f->row, np, d.K, d.C);
        if (wh)   // slot r's weight to its row, row[r]: a permutation of np*k rows of one
            be->moe_permute(be, wr, NULL, f->weight + (size_t)o * d.K, f->row, np * d.K, 1, 1);
    } else {
        memset(f->counts, 0, (size_t)d.E * sizeof *f->counts);
        if (dev) be->zero(be, f->counts_dev, (size_t)d.E * sizeof(int));
    }
    // the dispatcher: this rank's experts get their rows from every ep rank (x16: ep 1)
    lb_comm *ep = m->par.ep_comm;
    if (!dev) lb_ep_route_plan(&f->route, ep, be, f->counts, d.E);
    size_t nr = dev ? (size_t)np * d.K : (size_t)f->route.nrecv;
    size_t big = nr > (size_t)np * d.K ? nr : (size_t)np * d.K;
    // gate/up's outputs in bf16 where their readers take it (out16); down's routed ones in
    // fp32, scratch in xp's place (read by gate/up already) where the weights are on h
    const int g16 = out16(m, l, LB_ROLE_MOE_GATE_UP, LB_PASS_FPROP);
    float *yp = wh ? grow(be, &s->rows, &s->cap_rows, (size_t)n * d.K * d.C)
                   : grow(be, &f->yp, &f->cap_yp, (size_t)n * d.K * d.C);
    float *xe = xp, *ye = yp;
    uint16_t *xe16 = xp16;
    if (d.ep > 1) {
        ye = grow(be, &s->ye, &s->cap_ye, nr * d.C);
        float *xs = grow(be, &s->xs, &s->cap_xs, big * d.C);
        if (x16) {   // bf16 rows moved as pairs of them in 32-bit words (bits kept)
            xe16 = grow16(be, &f->xe16, &f->cap_xe16, n16(nr, d.C));
            lb_ep_dispatch(&f->route, ep, be, (const float *)xp16, (float *)xe16, xs,
                           (int)(n16(1, d.C) / 2));
        } else {
            xe = grow(be, &f->xe, &f->cap_xe, nr * d.C);
            lb_ep_dispatch(&f->route, ep, be, xp, xe, xs, d.C);
        }
        if (wh) {
            wr = grow(be, &f->wpe, &f->cap_wpe, nr);
            lb_ep_dispatch(&f->route, ep, be, f->wp, wr, s->xs, 1);
        }
    }
    uint16_t *gu16 = g16 ? grow16(be, &f->gu16, &f->cap_gu16, n16(nr, 2 * d.F)) : NULL;
    float *gu = g16 ? NULL : grow(be, &f->gu, &f->cap_gu, nr * 2 * d.F);
    uint16_t *h16 = down16 ? grow16(be, &f->h16, &f->cap_h16, n16(nr, d.F)) : NULL;
    if (!down16) grow(be, &f->h, &f->cap_h, nr * d.F);
    if (dev)
        lb_linear_experts_fwd(lin, l, LB_ROLE_MOE_GATE_UP, lb_act_of(xp, xp16, (int)nr, d.C),
                              w->cgu, f->counts_dev, d.El, gu, gu16, 2 * d.F);
    else
        lb_linear_grouped_fwd(lin, l, LB_ROLE_MOE_GATE_UP, lb_act_of(xe, xe16, (int)nr, d.C),
                              w->gu, w->cgu, f->route.local_counts, d.El, gu, gu16, 2 * d.F);
    float *h = h16 ? NULL : f->h;
    if (nr) be->swiglu_fwd(be, &(lb_swiglu_args){.out = h, .out16 = h16, .gu = gu, .gu16 = gu16,
            .rw = wr, .n = (int)nr, .f = d.F});
    const lb_act ha = lb_act_of(h, h16, (int)nr, d.F);
    if (dev)
        lb_linear_experts_fwd(lin, l, LB_ROLE_MOE_DOWN, ha, w->cdown, f->counts_dev, d.El, ye,
                              NULL, d.C);
    else
        lb_linear_grouped_fwd(lin, l, LB_ROLE_MOE_DOWN, ha, w->down, w->cdown,
                              f->route.local_counts, d.El, ye, NULL, d.C);
    if (d.ep > 1) lb_ep_combine(&f->route, ep, be, ye, yp, s->xs, d.C);
    if (d.parts > 1) be->zero(be, out, (size_t)n * d.C * sizeof(float));
    if (np)
        be->moe_combine(be, &(lb_moe_combine_args){.out = out + (size_t)o * d.C, .yp = yp,
                .weight = wh ? NULL : f->weight + (size_t)o * d.K, .row = f->row,
                .n = np, .k = d.K, .c = d.C});
    if (w->sgu) {   // the shared experts on every row, added to the routed output (tp partial)
        lb_linear_fwd(lin, l, LB_ROLE_MLP_GATE_UP, norm_in(m, l, LB_ROLE_MLP_GATE_UP, ln, ln16, n,
                      d.C), w->sgu, w->csgu, 0, f->sgu, 2 * d.Fs, 0.0f);
        be->swiglu_fwd(be, &(lb_swiglu_args){.out = f->sh, .gu = f->sgu, .n = n, .f = d.Fs});
        lb_linear_fwd(lin, l, LB_ROLE_MLP_DOWN, lb_act_f32(f->sh, n, d.Fs), w->sdown, w->csdown, 0,
                      out, d.C, 1.0f);
    }
    return aux;
}

// The sigmoid router's loads: layer l's rows per expert of this backward's micro-batch (this
// rank's part of its rows), added to m->expert_load for the next bias update. In the backward,
// so that recomputation and forwards without a step (evaluation, sampling) count nothing.
static void expert_load_add(lb_model *m, int l, const int *counts)
{
    const lb_model_config *c = &m->cfg;
    if (!m->expert_load)
        m->expert_load = lb_calloc((size_t)c->num_hidden_layers * c->num_experts, sizeof(double));
    double *row = m->expert_load + (size_t)l * c->num_experts;
    for (int j = 0; j < c->num_experts; j++) row[j] += counts[j];
}

// MoE health (lb_model_moe_stats_begin): layer l's tokens per expert (counts, this rank's part
// of the rows) and the entropy of its rows' router distributions, probs (n, E) downloaded
// (only while collecting: the metrics' logged steps). The entropy of every s-th row, at most
// LB_MOE_STATS_ROWS of them: a mean that needs no more, at a host cost that does not grow
// with the micro-batch.
static void moe_stats_add(lb_model *m, int l, const lb_ffn_acts *f, int n)
{
    if (!m->moe_stats) return;
    const int E = m->cfg.num_experts;
    double *row = m->moe_stats + (size_t)l * (E + 2);
    for (int j = 0; j < E; j++) row[j] += f->counts[j];
    const size_t count = (size_t)n * E;
    float *p = lb_malloc((count ? count : 1) * sizeof(float));
    m->be->download(m->be, p, f->probs, count * sizeof(float));
    const int s = (n + LB_MOE_STATS_ROWS - 1) / LB_MOE_STATS_ROWS;
    for (int i = 0; i < n; i += s) {
        const float *pi = p + (size_t)i * E;
        double z = 0.0, h = 0.0;
        for (int j = 0; j < E; j++) z += pi[j];
        for (int j = 0; j < E && z > 0.0; j++)
            if (pi[j] > 0.0f) h -= pi[j] / z * log(pi[j] / z);
        row[E] += h;
        row[E + 1] += 1;
    }
    free(p);
}

// dln (n, c) = this rank's share of d loss / d ln given dout (n, c) = d loss / d out (the same on
// every tp rank); the caller sums it over tp. Accumulates the block's weight gradients.
void lb_ffn_bwd(lb_model *m, int l, const lb_layer_w *w, const lb_layer_w *dw, lb_ffn_acts *f,
                lb_acts *a, const float *ln, int n, const float *dout, float *dln,
                float aux_scale)
{
    const lb_model_config *c = &m->cfg;
    lb_backend *be = m->be;
    lb_linear *lin = &m->lin;
    lb_dims d = lb_dims_of(m);
    lb_moe_scratch *s = &a->ms;
    if (!layer_moe(c, l)) {
        lb_linear_bwd(lin, l, LB_ROLE_MLP_DOWN, lb_act_f32(f->h, n, d.Fd), w->down, w->cdown, 0,
                      dout, a->dh, 0.0f, dw->down, lb_model_grad_beta(m, dw->down), d.C);
        be->swiglu_bwd(be, &(lb_swiglu_args){.dgu = a->dgu, .dout = a->dh, .gu = f->gu, .n = n,
                .f = d.Fd});
        lb_linear_bwd(lin, l, LB_ROLE_MLP_GATE_UP, lb_act_f32(ln, n, d.C), w->gu, w->cgu, 0,
                      a->dgu, dln, 0.0f, dw->gu, lb_model_grad_beta(m, dw->gu), 2 * d.Fd);
        return;
    }
    int o, np = part_rows(&d, n, &o);   // the rows this rank sent to the experts
    // the copies the forward wrote (lb_ffn_acts), and those of dyp and dgu to write here (dgu's
    // under expert parallelism too: the experts' rows are local by then)
    const int gu16 = takes16(m, l, LB_ROLE_MOE_GATE_UP);
    const int down16 = takes16(m, l, LB_ROLE_MOE_DOWN);
    size_t nr = (size_t)f->route.nrecv, big = nr > (size_t)np * d.K ? nr : (size_t)np * d.K;
    uint16_t *dyp16 = d.ep == 1 && grads16(m, l, LB_ROLE_MOE_DOWN)
                          ? grow16(be, &s->rows16, &s->cap_rows16, n16((size_t)np * d.K, d.C))
                          : NULL;
    uint16_t *dgu16 = grads16(m, l, LB_ROLE_MOE_GATE_UP)
                          ? grow16(be, &s->dgu16, &s->cap_dgu16, n16(nr, 2 * d.F))
                          : NULL;
    if (d.parts > 1) be->zero(be, a->dweight, (size_t)n * d.K * sizeof(float));
    // where there is a copy, only GEMMs would read dyp
    float *dyp = dyp16 ? NULL : grow(be, &s->rows, &s->cap_rows, (size_t)np * d.K * d.C);
    // the forward's outputs as it stored them, and the backward's to store alike (out16)
    const int g16 = out16(m, l, LB_ROLE_MOE_GATE_UP, LB_PASS_FPROP);
    const int dh16 = out16(m, l, LB_ROLE_MOE_DOWN, LB_PASS_DGRAD);
    // weights on h: dyp is dout's rows as they are, the weights' gradients come from down's
    // dgrad (below)
    const int wh = weights_on_h(m, l);
    if (np)
        be->moe_combine_bwd(be, &(lb_moe_combine_args){.dyp = dyp, .dyp16 = dyp16,
                .dweight = wh ? NULL : a->dweight + (size_t)o * d.K,
                .dout = dout + (size_t)o * d.C, .yp = wh ? NULL : f->yp, .weight = wh ? NULL : f->weight + (size_t)o * d.K, .row = f->row, .n = np,
                .k = d.K, .c = d.C});
    // yp held this rank's etp share of its part's expert outputs: the sum over tp gives every
    // row's combine-weight gradient whole
    if (!wh) tp_sum(m, a->dweight, (size_t)n * d.K);
    lb_comm *ep = m->par.ep_comm;
    // gate/up's dgrad: where the layer reads xp16, in the scratch's fp32 rows (dyp's, or
    // the forward's down outputs: dead by then); else its own buffer
    const int x16 = d.ep == 1 && gu16;   // the forward wrote xp16 (rows16) and not xp
    float *dxp = x16 ? grow(be, &s->rows, &s->cap_rows, (size_t)n * d.K * d.C) : a->dxp;
    float *dye = dyp, *dxe = dxp;
    if (d.ep > 1) {
        dye = grow(be, &s->dye, &s->cap_dye, nr * d.C);
        dxe = grow(be, &s->dxe, &s->cap_dxe, nr * d.C);
        lb_ep_dispatch(&f->route, ep, be, dyp, dye, grow(be, &s->xs, &s->cap_xs, big * d.C), d.C);
    }
    float *dgu = dgu16 ? NULL : grow(be, &s->dgu, &s->cap_dgu, nr * 2 * d.F);
    uint16_t *dh16p = dh16 ? grow16(be, &s->dh16, &s->cap_dh16, n16(nr, d.F)) : NULL;
    float *dh = dh16 ? NULL : grow(be, &s->dh, &s->cap_dh, nr * d.F);
    lb_linear_grouped_bwd(lin, l, LB_ROLE_MOE_DOWN,
                          down16 ? lb_act_bf16(f->h16, (int)nr, d.F) : lb_act_f32(f->h, (int)nr, d.F),
                          w->down, w->cdown, f->route.local_counts, d.El, f->route.seg_counts,
                          f->route.ep, dye, dyp16, dh, dh16p, dw->down,
                          lb_model_grad_beta(m, dw->down), d.C);
    double *dwr = !wh ? NULL
                  : d.ep > 1 ? grow64(be, &s->dwpe, &s->cap_dwpe, nr)
                             : grow64(be, &s->dwp, &s->cap_dwp, (size_t)n * d.K);
    if (nr)
        be->swiglu_bwd(be, &(lb_swiglu_args){.dgu = dgu, .dgu16 = dgu16, .dout = dh,
                .dout16 = dh16p, .gu = g16 ? NULL : f->gu, .gu16 = g16 ? f->gu16 : NULL,
                .rw = !wh ? NULL : d.ep > 1 ? f->wpe : f->wp, .drw = dwr, .n = (int)nr,
                .f = d.F});
    if (wh) {   // the weights' gradients: whole, rounded once, back to their slots
        double *dwp = grow64(be, &s->dwp, &s->cap_dwp, (size_t)n * d.K);
        float *dw32 = grow(be, &s->dw32, &s->cap_dw32, (size_t)n * d.K);
        // under ep from the experts' ranks, the doubles moved as pairs of 32-bit words
        if (d.ep > 1) lb_ep_combine(&f->route, ep, be, (float *)dwr, (float *)dwp, s->xs, 2);
        // etp ranks hold parts of each row's columns: their double sums are added before the
        // one rounding, so a row's weight gradient is one rank's whatever etp is (parts 1:
        // every tp rank holds the same rows in the same order)
        if (d.parts == 1 && d.tp > 1 && np)
            lb_comm_all_reduce(m->par.tp_comm, dwp, dwp, (size_t)np * d.K, LB_F64);
        be->f64_to_f32(be, dw32, dwp, (size_t)np * d.K);
        if (np)
            be->moe_permute_bwd(be, a->dweight + (size_t)o * d.K, dw32, NULL, f->row, np * d.K,
                                1, 1);
        // with the rows in parts (etp < tp), the sum over tp assembles them: whole where etp is
        // 1; where it is more, the etp ranks' parts are rounded before they are added, as the
        // weights applied after down always are
        if (d.parts > 1) tp_sum(m, a->dweight, (size_t)n * d.K);
    }
    // the forward's xp again, in dyp's place (dead by now); under ep the experts' rows kept
    float *xp = NULL;
    uint16_t *xp16 = NULL;
    if (d.ep == 1) {
        if (x16) xp16 = grow16(be, &s->rows16, &s->cap_rows16, n16((size_t)n * d.K, d.C));
        else xp = grow(be, &s->rows, &s->cap_rows, (size_t)n * d.K * d.C);
        if (np) be->moe_permute(be, xp, xp16, ln + (size_t)o * d.C, f->row, np, d.K, d.C);
    }
    const lb_act xa = d.ep > 1 ? lb_act_of(f->xe, gu16 ? f->xe16 : NULL, (int)nr, d.C)
                               : lb_act_of(xp, xp16, (int)nr, d.C);
    lb_linear_grouped_bwd(lin, l, LB_ROLE_MOE_GATE_UP, xa, w->gu, w->cgu, f->route.local_counts,
                          d.El, f->route.seg_counts, f->route.ep, dgu, dgu16, dxe, NULL, dw->gu,
                          lb_model_grad_beta(m, dw->gu), 2 * d.F);
    if (d.ep > 1) lb_ep_combine(&f->route, ep, be, dxe, dxp, s->xs, d.C);
    if (d.parts > 1) be->zero(be, dln, (size_t)n * d.C * sizeof(float));
    if (np)
        be->moe_permute_bwd(be, dln + (size_t)o * d.C, dxp, NULL, f->row, np, d.K, d.C);
    moe_stats_add(m, l, f, n);
    if (sigmoid_router(c)) {   // through the routed weights alone (the bias selects only)
        be->router_sigmoid_bwd(be, &(lb_router_sigmoid_args){.n = n, .e = d.E, .k = d.K,
                .n_group = c->n_group, .topk_group = c->topk_group, .renorm = c->norm_topk_prob,
                .scale = (float)c->routed_scaling_factor, .scores = f->probs, .idx = f->idx,
                .dweight = a->dweight, .dlogits = a->drlogits});
        expert_load_add(m, l, f->counts);
    } else {   // router: through the top-k weights and the load-balancing loss
        be->copy(be, a->daux, f->aux_grad, (size_t)d.E * sizeof(float));
        be->scale(be, a->daux, aux_scale, (size_t)d.E);
        be->router_topk_bwd(be, &(lb_router_args){.dlogits = a->drlogits, .dweight = a->dweight,
                .dprobs_expert = a->daux, .probs = f->probs, .idx = f->idx, .n = n, .e = d.E,
                .k = d.K, .renorm = c->norm_topk_prob});
    }
    // The router is replicated over tp and its gradient the same on every tp rank: one rank
    // adds its share to dln so the tp sum counts it once.
    lb_linear_bwd(lin, l, LB_ROLE_ROUTER, lb_act_f32(ln, n, d.C), w->router, w->crouter, 0,
                  a->drlogits, m->par.tp_rank == 0 ? dln : NULL, 1.0f, dw->router,
                  lb_model_grad_beta(m, dw->router), d.E);
    if (w->sgu) {   // the shared experts: a dense MLP's backward, its dln added (tp partial)
        lb_linear_bwd(lin, l, LB_ROLE_MLP_DOWN, lb_act_f32(f->sh, n, d.Fs), w->sdown, w->csdown, 0,
                      dout, a->dh, 0.0f, dw->sdown, lb_model_grad_beta(m, dw->sdown), d.C);
        be->swiglu_bwd(be, &(lb_swiglu_args){.dgu = a->dgu, .dout = a->dh, .gu = f->sgu, .n = n,
                .f = d.Fs});
        lb_linear_bwd(lin, l, LB_ROLE_MLP_GATE_UP, lb_act_f32(ln, n, d.C), w->sgu, w->csgu, 0,
                      a->dgu, dln, 1.0f, dw->sgu, lb_model_grad_beta(m, dw->sgu), 2 * d.Fs);
    }
}

static const lb_tensor *find_or_die(const lb_model *m, const char *name)
{
    const lb_tensor *t = lb_model_find(m, name);
    if (!t) lb_die("model has no tensor %s", name);
    return t;
}

// Under SP rank r holds rows [r ns, (r + 1) ns) of the residual stream.
static int row_offset(const lb_model *m, int ns) { return m->par.sp ? m->par.tp_rank * ns : 0; }

// The layer's activations: its own, or under recomputation the working set with the layer's
// saved input.
static lb_layer_acts *layer_at(lb_acts *a, int i)
{
    if (a->recompute != LB_RECOMPUTE_FULL) return &a->l[i];
    a->work.x = a->l[i].x;
    return &a->work;
}

// RMSNorm of this rank's rows of x into norm's rows (all rows gathered under SP).
void lb_norm_rows(lb_model *m, lb_acts *a, const float *x, const float *w, float *norm,
                  uint16_t *norm16, float *rstd)
{
    lb_dims d = lb_dims_of(m);
    int r0 = row_offset(m, a->ns);
    if (norm16) {   // the rank's rows in bf16, gathered as pairs of them in 32-bit words
        const size_t ld = n16(1, d.C);
        m->be->rmsnorm_fwd(m->be, &(lb_rmsnorm_args){.out16 = norm16 + (size_t)r0 * ld,
                .rstd = rstd, .x = x, .w = w, .n = a->ns, .c = d.C,
                .eps = (float)m->cfg.rms_norm_eps});
        tp_gather(m, (const float *)(norm16 + (size_t)r0 * ld), (float *)norm16, a->n,
                  (int)(ld / 2));
        return;
    }
    m->be->rmsnorm_fwd(m->be, &(lb_rmsnorm_args){.out = norm + (size_t)r0 * d.C, .rstd = rstd,
            .x = x, .w = w, .n = a->ns, .c = d.C, .eps = (float)m->cfg.rms_norm_eps});
    tp_gather(m, norm + (size_t)r0 * d.C, norm, a->n, d.C);
}

// y (n, cols) += the bias b (cols) on every row: the fp32 GEMM ones (n, 1) b (1, cols), in
// every recipe (a bias is not a linear layer's weight, so the contract does not quantize it).
static void bias_rows(lb_backend *be, float *y, const float *b, const float *ones, int n,
                      int cols)
{
    be->gemm(be, &(lb_gemm_args){.transa = 0, .transb = 0, .m = n, .n = cols, .k = 1,
            .alpha = 1.0f, .beta = 1.0f, .a = ones, .b = b, .c = y});
}

// The attention biases (attention_bias) on the q, k, v projections of n rows.
static void qkv_bias_fwd(lb_model *m, const lb_layer_w *w, const float *ones, float *q, float *k,
                         float *v, int n)
{
    if (!w->qb) return;
    lb_dims d = lb_dims_of(m);
    bias_rows(m->be, q, w->qb, ones, n, d.hq * d.D);
    bias_rows(m->be, k, w->kb, ones, n, d.hkv * d.D);
    bias_rows(m->be, v, w->vb, ones, n, d.hkv * d.D);
}

// db (cols) += the column sums of dy (n, cols): ones (n, 1)^T dy.
static void qkv_bias_bwd(lb_backend *be, float *db, const float *ones, const float *dy, int n,
                         int cols)
{
    be->gemm(be, &(lb_gemm_args){.transa = 1, .transb = 0, .m = 1, .n = cols, .k = n,
            .alpha = 1.0f, .beta = 1.0f, .a = ones, .b = dy, .c = db});
}

// q and k of n rows as attention takes them: per-head RMSNorm (def->qk_norm; else a copy),
// then RoPE at positions pos (n), with the frequencies freq (NULL: plain RoPE). The training
// and the cached forward both go through here, so their rows are the same bits.
// qr16, kr16: NULL, or where q and k go instead, in bf16 (the rotation reads q and k then).
static void qk_rope_fwd(lb_model *m, const lb_layer_w *w, const float *q, const float *k,
                        float *qr, float *kr, uint16_t *qr16, uint16_t *kr16, float *qrstd,
                        float *krstd, const int32_t *pos, const double *freq, int n)
{
    lb_backend *be = m->be;
    lb_dims d = lb_dims_of(m);
    int D = d.D;
    float eps = (float)m->cfg.rms_norm_eps, theta = (float)m->cfg.rope_theta;
    const int norm = has_qk_norm(m);
    if (!norm && !qr16) {
        be->copy(be, qr, q, (size_t)n * d.hq * D * sizeof(float));
        be->copy(be, kr, k, (size_t)n * d.hkv * D * sizeof(float));
    }
    // the q/k norms in the rotation's call (rope's src): one pass each
    be->rope(be, &(lb_rope_args){.x = qr16 && !norm ? (float *)q : qr, .out16 = qr16, .pos = pos,
            .n = n, .heads = d.hq, .d = D, .theta = theta, .rot = rope_rot(&m->cfg),
            .inv_freq = freq, .src = norm ? q : NULL, .nw = w->qn, .rstd = qrstd, .eps = eps});
    be->rope(be, &(lb_rope_args){.x = kr16 && !norm ? (float *)k : kr, .out16 = kr16, .pos = pos,
            .n = n, .heads = d.hkv, .d = D, .theta = theta, .rot = rope_rot(&m->cfg),
            .inv_freq = freq, .src = norm ? k : NULL, .nw = w->kn, .rstd = krstd, .eps = eps});
}

// Core attention of layer L from its q, k, v projections: q/k norms, RoPE, what an fp8 KV
// cache would hold (straight-through backward), attention.
void lb_attention_core_fwd(lb_model *m, lb_acts *a, lb_layer_acts *L, const lb_layer_w *w)
{
    lb_backend *be = m->be;
    lb_dims d = lb_dims_of(m);
    int n = a->n, D = d.D;
    if ((L->qr16 != NULL) != qk16(m))
        lb_die("attention: the activations were made for %s q and k, and the model now wants "
               "the other (the KV cache kind changed after they were made)",
               L->qr16 ? "bf16" : "fp32");
    qk_rope_fwd(m, w, L->q, L->k, L->qr, L->kr, L->qr16, L->kr16, L->qrstd, L->krstd, a->pos,
                a->rope_freq, n);
    if (m->kv_fp8) {
        kv_fake_quant(be, L->kr, n * d.hkv, D);
        kv_fake_quant(be, L->v, n * d.hkv, D);
    }
    // The contract's attention mode; the backward and the cached forward pass the same one, so
    // the sampler's rows are this forward's bits.
    be->attention_fwd(be, &(lb_attention_args){.out = L->att, .lse = L->lse, .q = L->qr,
            .k = L->kr, .v = L->v, .q16 = L->qr16, .k16 = L->kr16, .b = a->b, .t = a->t,
            .hq = d.hq, .hkv = d.hkv, .d = D,
            .bf16 = m->contract.attention_bf16});
}

// Decoder layer i of this stage on L->x, into a->l[i + 1].x; returns its load-balancing loss.
double lb_decoder_layer_fwd(lb_model *m, lb_acts *a, int i, lb_layer_acts *L)
{
    lb_backend *be = m->be;
    lb_dims d = lb_dims_of(m);
    int n = a->n, ns = a->ns, C = d.C, D = d.D;
    int l = m->layer_begin + i;
    lb_linear *lin = &m->lin;
    lb_layer_w w = layer_weights(m, m->params, l);
    // attention block: heads split over tp, o_proj row-parallel
    lb_norm_rows(m, a, L->x, w.ln1, L->ln1, L->ln1_16, L->rstd1);
    lb_qkv_fwd(lin, l, &w, lb_act_of(L->ln1, L->ln1_16, n, C), L->q, L->k, L->v, d);
    qkv_bias_fwd(m, &w, a->ones, L->q, L->k, L->v, n);
    lb_attention_core_fwd(m, a, L, &w);
    float *part = d.tp > 1 ? a->part : L->xmid;
    lb_linear_fwd(lin, l, LB_ROLE_ATTN_OUT, lb_act_f32(L->att, n, d.hq * D), w.o, w.co, 0, part,
                  C, 0.0f);
    tp_reduce(m, part, L->xmid, n, C);
    be->add(be, L->xmid, L->x, (size_t)ns * C);
    // feed-forward block: gate_up column-parallel, down row-parallel
    float *xnext = a->l[i + 1].x;
    lb_norm_rows(m, a, L->xmid, w.ln2, L->ln2, NULL, L->rstd2);
    part = d.tp > 1 ? a->part : xnext;
    double aux = lb_ffn_fwd(m, l, &w, &L->f, &a->ms, L->ln2, NULL, n, part, 1, 0);
    tp_reduce(m, part, xnext, n, C);
    be->add(be, xnext, L->xmid, (size_t)ns * C);
    return aux;
}

// Selective recomputation before layer i's backward: the forward's norms, core attention and
// SwiGLU again from what the layer kept (x, xmid, the q/k/v projections, gate_up's output),
// with the same operations in the same order, so the same bits.
static void layer_recompute(lb_model *m, lb_acts *a, int i, lb_layer_acts *L)
{
    lb_dims d = lb_dims_of(m);
    lb_layer_w w = layer_weights(m, m->params, m->layer_begin + i);
    lb_norm_rows(m, a, L->x, w.ln1, L->ln1, L->ln1_16, L->rstd1);
    lb_attention_core_fwd(m, a, L, &w);
    lb_norm_rows(m, a, L->xmid, w.ln2, L->ln2, NULL, L->rstd2);
    const int l = m->layer_begin + i, moe = layer_moe(&m->cfg, l);
    int rows = moe ? L->f.route.nrecv : a->n;
    uint16_t *h16 = moe && takes16(m, l, LB_ROLE_MOE_DOWN) ? L->f.h16 : NULL;
    uint16_t *gu16 =
        moe && out16(m, l, LB_ROLE_MOE_GATE_UP, LB_PASS_FPROP) ? L->f.gu16 : NULL;
    const float *rw = !moe || !weights_on_h(m, l) ? NULL : d.ep > 1 ? L->f.wpe : L->f.wp;
    if (rows)
        m->be->swiglu_fwd(m->be, &(lb_swiglu_args){.out = h16 ? NULL : L->f.h, .out16 = h16,
                .gu = gu16 ? NULL : L->f.gu, .gu16 = gu16, .rw = rw, .n = rows,
                .f = moe ? d.F : d.Fd});
}

// One chunk of the LM head's forward: the logits of nr rows x of lnf into m->logits (bf16
// where lb_model_logits16, else fp32) and their per-token losses into loss, with the row
// statistics where st is given.
static void head_chunk_fwd(lb_model *m, const float *x, const int32_t *tg, int nr, float *loss,
                           double *st)
{
    lb_dims d = lb_dims_of(m);
    const lb_tensor *th = find_or_die(m, "lm_head.weight");
    const int l = m->cfg.num_hidden_layers - 1;
    const float *wh = m->params + th->offset;
    const lb_wcache *ch = &m->wcache[th - m->tensors];
    if (lb_model_logits16(m)) {
        uint16_t *l16 = (uint16_t *)m->logits;
        lb_linear_fwd_c16(&m->lin, l, LB_ROLE_LM_HEAD, lb_act_f32(x, nr, d.C), wh, ch, l16, d.V);
        m->be->cross_entropy_fwd16(m->be, loss, st, l16, tg, nr, d.V);
    } else {
        lb_linear_fwd(&m->lin, l, LB_ROLE_LM_HEAD, lb_act_f32(x, nr, d.C), wh, ch, 0, m->logits,
                      d.V, 0.0f);
        m->be->cross_entropy_fwd(m->be, loss, st, m->logits, tg, nr, d.V);
    }
}

// The training forward's LM head (lb_model_forward_train): R rows at a time, the chunk's
// logits, their per-token losses and row statistics, then at once the LM head's backward for
// those rows with the loss scale given up front: d lnf rows into a->dln, the weight gradient
// accumulated chunk by chunk. A chunk's logits are made once, and live only until its
// backward; unchunked (R = ns) the calls and their bits are those of forward then backward.
static void head_train(lb_model *m, lb_acts *a, const int32_t *tg, int R)
{
    lb_backend *be = m->be;
    lb_dims d = lb_dims_of(m);
    const lb_tensor *th = find_or_die(m, "lm_head.weight");
    const int l = m->cfg.num_hidden_layers - 1, ns = a->ns, C = d.C;
    float *wh = m->params + th->offset, *dwh = m->grads + th->offset;
    const lb_wcache *ch = &m->wcache[th - m->tensors];
    float dce = m->ntokens ? m->head_scale / (float)m->ntokens : 0.0f;
    int fused = lb_linear_ce_fusable(&m->lin, l, LB_ROLE_LM_HEAD);
    // bf16 logits (lb_model_logits16 implies fused) get the gradient written over them
    uint16_t *l16 = lb_model_logits16(m) ? (uint16_t *)m->logits : NULL;
    for (int r = 0; r < ns; r += R) {
        int nr = ns - r < R ? ns - r : R;
        const float *x = a->lnf + (size_t)r * C;
        double *st = a->ce_stats + 2 * (size_t)r;
        head_chunk_fwd(m, x, tg + r, nr, a->loss + r, st);
        // the cross-entropy's gradient and the LM head's backward in one call where the
        // backward is a plain bf16 GEMM (the backend need not store the gradient)
        if (fused) {
            lb_linear_ce_bwd(&m->lin, l, LB_ROLE_LM_HEAD, lb_act_f32(x, nr, C), wh, ch,
                             l16 ? NULL : m->logits, l16, st, tg + r, dce,
                             a->dln + (size_t)r * C, dwh, lb_model_grad_beta(m, dwh), d.V);
        } else {
            be->cross_entropy_bwd(be, m->logits, m->logits, st, tg + r, dce, nr, d.V);
            lb_linear_bwd(&m->lin, l, LB_ROLE_LM_HEAD, lb_act_f32(x, nr, C), wh, ch, 0, m->logits,
                          a->dln + (size_t)r * C, 0.0f, dwh, lb_model_grad_beta(m, dwh), d.V);
        }
    }
    a->ce_stats_ok = a->logits_whole = 0;   // the buffer holds a gradient now
    a->head_done = 1;
    a->head_scale = m->head_scale;
}

void lb_decoder_forward(lb_model *m, const int32_t *tokens, const int32_t *targets, int b, int t)
{
    const lb_model_config *c = &m->cfg;
    lb_backend *be = m->be;
    lb_acts *a = m->acts;
    lb_dims d = lb_dims_of(m);
    int ns = a->ns, r0 = row_offset(m, ns), C = d.C;
    float eps = (float)c->rms_norm_eps;
    double aux = 0.0;
    lb_linear *lin = &m->lin;
    (void)b, (void)t;   // the activations were made for (b, t)

    if (m->first_stage)
        be->embedding_fwd(be, a->l[0].x, tokens + r0,
                          m->params + find_or_die(m, "model.embed_tokens.weight")->offset, ns, C);
    for (int i = 0; i < a->nl; i++) aux += lb_decoder_layer_fwd(m, a, i, layer_at(a, i));
    m->aux_loss = (float)aux;
    m->ntokens = 0;
    m->ce_loss = 0.0f;
    m->loss = (float)(c->router_aux_loss_coef * aux);
    a->ce_stats_ok = a->logits_whole = a->head_done = 0;
    if (!m->last_stage) return;   // the next stage continues from stage_output
    const lb_tensor *tn = find_or_die(m, "model.norm.weight");
    const lb_tensor *th = find_or_die(m, "lm_head.weight");
    be->rmsnorm_fwd(be, &(lb_rmsnorm_args){.out = a->lnf, .rstd = a->rstdf, .x = a->l[a->nl].x,
            .w = m->params + tn->offset, .n = ns, .c = C, .eps = eps});
    int R = targets ? lb_model_ce_rows(m, ns) : ns;
    if (!targets) {   // the logits of every row (log-probabilities, sampling's checks)
        lb_linear_fwd(lin, c->num_hidden_layers - 1, LB_ROLE_LM_HEAD, lb_act_f32(a->lnf, ns, C),
                      m->params + th->offset, &m->wcache[th - m->tensors], 0, m->logits, d.V,
                      0.0f);
        a->logits_whole = 1;
        return;
    }
    m->ntokens = m->target_count;   // all rows', counted by the host before the forward
    if (m->head_bwd) {
        head_train(m, a, targets + r0, R);
    } else {
        // Loss only, or kept for a backward: the LM head and the per-token losses R rows at a
        // time (chunked, the logits are not kept); unchunked, the statistics save the
        // backward a second read of every row. bf16 logits where the head is bf16 throughout.
        for (int r = 0; r < ns; r += R) {
            int nr = ns - r < R ? ns - r : R;
            head_chunk_fwd(m, a->lnf + (size_t)r * C, targets + r0 + r, nr, a->loss + r,
                           R == ns ? a->ce_stats : NULL);
        }
        a->ce_stats_ok = a->logits_whole = R == ns;
    }
    // Loss: mean cross-entropy over counted targets, summed in token order in double (each
    // rank's rows, then the ranks in order under SP).
    be->download(be, a->host_loss, a->loss, (size_t)ns * sizeof(float));
    be->download(be, a->host_targets, targets + r0, (size_t)ns * sizeof(int32_t));
    double sum = 0.0;
    for (int i = 0; i < ns; i++)
        if (a->host_targets[i] >= 0) sum += a->host_loss[i];
    if (m->par.sp) sum = lb_comm_allreduce_sum(m->par.tp_comm, sum);
    m->ce_loss = m->ntokens > 0 ? (float)(sum / m->ntokens) : 0.0f;
    m->loss = (float)(m->ce_loss + c->router_aux_loss_coef * aux);
}

// From d loss / d logits in m->logits on the last stage, or d loss / d stage output in
// stage_grad on an earlier one; aux_scale weighs the load-balancing loss. On a later stage
// stage_grad ends holding d loss / d stage input.
static void backward_from(lb_model *m, float aux_scale, int head_done)
{
    const lb_model_config *c = &m->cfg;
    lb_backend *be = m->be;
    lb_acts *a = m->acts;
    lb_dims d = lb_dims_of(m);
    int b = a->b, t = a->t, n = a->n, ns = a->ns, r0 = row_offset(m, ns), C = d.C, D = d.D;
    float theta = (float)c->rope_theta;
    float *G = m->grads;
    lb_linear *lin = &m->lin;

    if (m->last_stage) {   // lm head (unless done chunk by chunk) and final norm
        const lb_tensor *tn = find_or_die(m, "model.norm.weight");
        const lb_tensor *th = find_or_die(m, "lm_head.weight");
        if (!head_done)
            lb_linear_bwd(lin, c->num_hidden_layers - 1, LB_ROLE_LM_HEAD,
                          lb_act_f32(a->lnf, ns, C), m->params + th->offset,
                          &m->wcache[th - m->tensors], 0, m->logits, a->dln, 0.0f,
                          G + th->offset, lb_model_grad_beta(m, G + th->offset), d.V);
        be->rmsnorm_bwd(be, &(lb_rmsnorm_args){.dx = a->dres, .dx_beta = 0.0f,
                .dw = G + tn->offset, .dout = a->dln, .x = a->l[a->nl].x,
                .w = m->params + tn->offset, .rstd = a->rstdf, .n = ns, .c = C});
    }
    for (int i = a->nl - 1; i >= 0; i--) {
        int l = m->layer_begin + i;
        lb_layer_acts *L = layer_at(a, i);
        // Recomputation: the layer's forward again, on its saved input, the same operations in
        // the same order, so every activation is the same bits as the first time. Its output
        // (x of layer i + 1, no longer needed) is rewritten with the same values.
        if (a->recompute == LB_RECOMPUTE_FULL) lb_decoder_layer_fwd(m, a, i, L);
        else if (a->recompute == LB_RECOMPUTE_SELECTIVE) layer_recompute(m, a, i, L);
        lb_layer_w w = layer_weights(m, m->params, l);
        lb_layer_w dw = layer_weights(m, G, l);
        // feed-forward block: dres is d loss / d xnext, and passes straight to xmid
        tp_gather(m, a->dres, a->dfull, n, C);
        lb_ffn_bwd(m, l, &w, &dw, &L->f, a, L->ln2, n, a->dfull, a->dln, aux_scale);
        tp_reduce(m, a->dln, a->dlns, n, C);
        be->rmsnorm_bwd(be, &(lb_rmsnorm_args){.dx = a->dres, .dx_beta = 1.0f, .dw = dw.ln2,
                .dout = a->dlns, .x = L->xmid, .w = w.ln2, .rstd = L->rstd2, .n = ns, .c = C});
        // attention block: dres is now d loss / d xmid
        tp_gather(m, a->dres, a->dfull, n, C);
        lb_linear_bwd(lin, l, LB_ROLE_ATTN_OUT, lb_act_f32(L->att, n, d.hq * D), w.o, w.co, 0,
                      a->dfull, a->datt, 0.0f, dw.o, lb_model_grad_beta(m, dw.o), C);
        be->attention_bwd(be, &(lb_attention_args){.dq = a->dq, .dk = a->dk, .dv = a->dv,
                .dout = a->datt, .q = L->qr, .k = L->kr, .v = L->v, .q16 = L->qr16,
                .k16 = L->kr16, .out = L->att, .lse = L->lse,
                .b = b, .t = t, .hq = d.hq, .hkv = d.hkv, .d = D,
                .bf16 = m->contract.attention_bf16});
        be->rope(be, &(lb_rope_args){.x = a->dq, .pos = a->pos, .n = n, .heads = d.hq, .d = D,
                .theta = theta, .inverse = 1, .rot = rope_rot(c), .inv_freq = a->rope_freq});
        be->rope(be, &(lb_rope_args){.x = a->dk, .pos = a->pos, .n = n, .heads = d.hkv, .d = D,
                .theta = theta, .inverse = 1, .rot = rope_rot(c), .inv_freq = a->rope_freq});
        // d loss / d the projections' q and k: through the q/k norms, or RoPE's input itself
        const float *dqp = a->dq, *dkp = a->dk;
        if (has_qk_norm(m)) {
            be->rmsnorm_bwd(be, &(lb_rmsnorm_args){.dx = a->dqr, .dx_beta = 0.0f, .dw = dw.qn,
                    .dout = a->dq, .x = L->q, .w = w.qn, .rstd = L->qrstd, .n = n * d.hq,
                    .c = D});
            be->rmsnorm_bwd(be, &(lb_rmsnorm_args){.dx = a->dkr, .dx_beta = 0.0f, .dw = dw.kn,
                    .dout = a->dk, .x = L->k, .w = w.kn, .rstd = L->krstd, .n = n * d.hkv,
                    .c = D});
            dqp = a->dqr, dkp = a->dkr;
        }
        if (w.qb) {   // the biases' gradients: the column sums of dq, dk, dv
            qkv_bias_bwd(be, dw.qb, a->ones, dqp, n, d.hq * D);
            qkv_bias_bwd(be, dw.kb, a->ones, dkp, n, d.hkv * D);
            qkv_bias_bwd(be, dw.vb, a->ones, a->dv, n, d.hkv * D);
        }
        {   // dln = dq W_q + dk W_k + dv W_v, the wgrads' column-wise ln1 made once
            const float *ws[3] = {w.q, w.k, w.v}, *dys[3] = {dqp, dkp, a->dv};
            const lb_wcache *cs[3] = {w.cq, w.ck, w.cv};
            float *dws[3] = {dw.q, dw.k, dw.v};
            const float betas[3] = {lb_model_grad_beta(m, dw.q), lb_model_grad_beta(m, dw.k),
                                    lb_model_grad_beta(m, dw.v)};
            const int outs[3] = {d.hq * D, d.hkv * D, d.hkv * D};
            lb_linear_bwd_shared(lin, l, LB_ROLE_ATTN_QKV, lb_act_of(L->ln1, L->ln1_16, n, C), 3,
                                 ws, cs, dys, a->dln, dws, betas, outs);
        }
        tp_reduce(m, a->dln, a->dlns, n, C);
        be->rmsnorm_bwd(be, &(lb_rmsnorm_args){.dx = a->dres, .dx_beta = 1.0f, .dw = dw.ln1,
                .dout = a->dlns, .x = L->x, .w = w.ln1, .rstd = L->rstd1, .n = ns, .c = C});
    }
    if (m->first_stage)
        be->embedding_bwd(be, G + find_or_die(m, "model.embed_tokens.weight")->offset, a->dres,
                          m->tokens + r0, ns, C);
}

void lb_decoder_backward_logits(lb_model *m, float aux_scale)
{
    lb_acts *a = m->acts;
    if (m->last_stage && !a->logits_whole)
        lb_die("backward from the logits: the last forward kept no logits of every row (it had "
               "targets and chunked cross-entropy, or ran the LM head's backward)");
    backward_from(m, aux_scale, 0);
}

void lb_decoder_backward(lb_model *m, float loss_scale)
{
    lb_acts *a = m->acts;
    int ns = a->ns, head_done = 0;
    if (m->last_stage && a->head_done) {   // lb_model_forward_train ran the LM head's backward
        if (loss_scale != a->head_scale)
            lb_die("backward with loss scale %g after a training forward for %g", loss_scale,
                   a->head_scale);
        head_done = 1;
    } else if (m->last_stage) {
        const lb_model_config *c = &m->cfg;
        lb_dims d = lb_dims_of(m);
        const lb_tensor *th = find_or_die(m, "lm_head.weight");
        const int32_t *tg = m->targets + row_offset(m, ns);
        float dce = m->ntokens ? loss_scale / (float)m->ntokens : 0.0f;
        float *wh = m->params + th->offset, *dwh = m->grads + th->offset;
        if (!a->logits_whole)
            lb_die("backward: the forward kept no logits (chunked cross-entropy); a training "
                   "step's forward is lb_model_forward_train");
        const double *st = a->ce_stats_ok ? a->ce_stats : NULL;   // the forward's, if any
        const int l = c->num_hidden_layers - 1;
        // The cross-entropy's gradient and the LM head's backward in one call (the backend
        // need not store the gradient); else the logits buffer becomes d loss / d logits, and
        // backward_from runs the LM head's backward
        head_done = st && lb_linear_ce_fusable(&m->lin, l, LB_ROLE_LM_HEAD);
        uint16_t *l16 = lb_model_logits16(m) ? (uint16_t *)m->logits : NULL;
        if (l16 && !head_done) lb_die("backward: the forward's bf16 logits lack their statistics");
        if (head_done)
            lb_linear_ce_bwd(&m->lin, l, LB_ROLE_LM_HEAD, lb_act_f32(a->lnf, ns, d.C), wh,
                             &m->wcache[th - m->tensors], l16 ? NULL : m->logits, l16, st, tg,
                             dce, a->dln, dwh, lb_model_grad_beta(m, dwh), d.V);
        else
            m->be->cross_entropy_bwd(m->be, m->logits, m->logits, st, tg, dce, ns, d.V);
        a->ce_stats_ok = a->logits_whole = 0;   // the buffer no longer holds the logits
    }
    a->head_done = 0;
    backward_from(m, loss_scale * (float)m->cfg.router_aux_loss_coef, head_done);
}

// --- cached forward (sampling) -------------------------------------------------------------------

void *lb_decoder_cached_create(lb_model *m, int max_rows)
{
    lb_backend *be = m->be;
    lb_dims d = lb_dims_of(m);
    lb_cached_acts *a = lb_calloc(1, sizeof *a);
    size_t n = (size_t)max_rows, C = d.C, D = d.D, hq = d.hq, hkv = d.hkv;
    a->rows = max_rows;
    a->x = falloc(be, n * C);
    a->xmid = falloc(be, n * C);
    a->ln = falloc(be, n * C);
    a->rstd = falloc(be, n);
    a->ln16 = be->alloc(be, n16(n, (int)C) * sizeof(uint16_t));
    a->q = falloc(be, n * hq * D);
    a->qrstd = falloc(be, n * hq);
    a->qr = falloc(be, n * hq * D);
    a->k = falloc(be, n * hkv * D);
    a->krstd = falloc(be, n * hkv);
    a->kr = falloc(be, n * hkv * D);
    a->v = falloc(be, n * hkv * D);
    a->att = falloc(be, n * hq * D);
    if (d.tp > 1) a->part = falloc(be, n * C);
    if (m->kv_fp8) {   // made once: a step allocates nothing
        lb_quant_args qa = kv_quant_args();
        be->qmat_alloc(be, &a->kq, max_rows * d.hkv, D, &qa);
        be->qmat_alloc(be, &a->vq, max_rows * d.hkv, D, &qa);
    }
    ffn_create(m, &a->f, max_rows);
    a->rope_freq = rope_freq_create(m);
    a->ones = ones_create(m, n);
    return a;
}

void lb_decoder_cached_free(lb_model *m, void *p)
{
    lb_cached_acts *a = p;
    lb_backend *be = m->be;
    void *bufs[] = {a->x, a->xmid, a->ln, a->ln16, a->rstd, a->q, a->qrstd, a->qr, a->k,
                    a->krstd, a->kr, a->v, a->att, a->part, a->rope_freq, a->ones};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) be->free(be, bufs[i]);
    if (a->kq.data) be->qmat_free(be, &a->kq);
    if (a->vq.data) be->qmat_free(be, &a->vq);
    ffn_free(m, &a->f);
    scratch_free(be, &a->ms);
    free(a);
}

// forward()'s operations in forward()'s order for n new rows; attention goes through the KV
// cache (kv_append, then attention_cached) instead of attention_fwd. Nothing a row computes
// depends on the other rows, so each row's logits equal the training forward's. Under tp and
// ep it is collective like forward (no sequence or pipeline parallelism here).
void lb_decoder_forward_cached(lb_model *m, lb_kvcache *kv, int n)
{
    const lb_model_config *c = &m->cfg;
    lb_backend *be = m->be;
    lb_cached_acts *a = kv->acts;
    lb_dims d = lb_dims_of(m);
    int C = d.C, D = d.D;
    float eps = (float)c->rms_norm_eps;
    lb_linear *lin = &m->lin;

    be->embedding_fwd(be, a->x, kv->tokens,
                      m->params + find_or_die(m, "model.embed_tokens.weight")->offset, n, C);
    // Each residual add is the next norm's (rmsnorm_fwd's res: add()'s bits), and a norm whose
    // readers are bf16 GEMMs also writes their operand (out16): fewer launches a decode step.
    lb_layer_w w0 = layer_weights(m, m->params, 0);
    be->rmsnorm_fwd(be, &(lb_rmsnorm_args){.out = a->ln, .rstd = a->rstd, .x = a->x,
            .w = w0.ln1, .n = n, .c = C, .eps = eps,
            .out16 = cached_ln16(m, a, 0, LB_ROLE_ATTN_QKV)});
    for (int l = 0; l < c->num_hidden_layers; l++) {
        lb_layer_w w = layer_weights(m, m->params, l);
        lb_qkv_fwd(lin, l, &w,
                   norm_in(m, l, LB_ROLE_ATTN_QKV, qkv_quantized16(m, l) ? NULL : a->ln,
                           cached_ln16(m, a, l, LB_ROLE_ATTN_QKV), n, C),
                   a->q, a->k, a->v, d);
        qkv_bias_fwd(m, &w, a->ones, a->q, a->k, a->v, n);
        qk_rope_fwd(m, &w, a->q, a->k, a->qr, a->kr, NULL, NULL, a->qrstd, a->krstd, kv->pos,
                    a->rope_freq, n);
        if (kv->fp8) {   // the first n * hkv rows of the call's quantized k and v
            lb_quant_args qa = kv_quant_args();
            lb_qmat kq = lb_qmat_rows(&a->kq, 0, n * d.hkv);
            lb_qmat vq = lb_qmat_rows(&a->vq, 0, n * d.hkv);
            be->quantize(be, &kq, lb_act_f32(a->kr, n * d.hkv, D), &qa);
            be->quantize(be, &vq, lb_act_f32(a->v, n * d.hkv, D), &qa);
            be->kv_append(be, &kv->layer[l], NULL, NULL, &kq, &vq, kv->slot, kv->pos, n);
        } else {
            be->kv_append(be, &kv->layer[l], a->kr, a->v, NULL, NULL, kv->slot, kv->pos, n);
        }
        be->attention_cached(be, a->att, a->qr, &kv->layer[l], kv->slot, kv->pos, n, d.hq,
                             m->contract.attention_bf16);
        float *part = d.tp > 1 ? a->part : a->xmid;
        lb_linear_fwd(lin, l, LB_ROLE_ATTN_OUT, lb_act_f32(a->att, n, d.hq * D), w.o, w.co, 0,
                      part, C, 0.0f);
        tp_reduce(m, part, a->xmid, n, C);
        // feed-forward block: xmid = xmid + x, its norm; the block's output overwrites x
        uint16_t *ln16 = cached_ln16(m, a, l, LB_ROLE_ROUTER);
        be->rmsnorm_fwd(be, &(lb_rmsnorm_args){.out = a->ln, .rstd = a->rstd, .x = a->xmid,
                .res = a->x, .sum = a->xmid, .w = w.ln2, .n = n, .c = C, .eps = eps,
                .out16 = ln16});
        part = d.tp > 1 ? a->part : a->x;
        lb_ffn_fwd(m, l, &w, &a->f, &a->ms, a->ln, ln16, n, part, 0, 1);
        tp_reduce(m, part, a->x, n, C);
        if (l + 1 == c->num_hidden_layers) {
            be->add(be, a->x, a->xmid, (size_t)n * C);
            break;
        }
        lb_layer_w wn = layer_weights(m, m->params, l + 1);   // x = x + xmid, the next norm
        be->rmsnorm_fwd(be, &(lb_rmsnorm_args){.out = a->ln, .rstd = a->rstd, .x = a->x,
                .res = a->xmid, .sum = a->x, .w = wn.ln1, .n = n, .c = C, .eps = eps,
                .out16 = cached_ln16(m, a, l + 1, LB_ROLE_ATTN_QKV)});
    }
    // The final norm and the LM head act per row: only the rows whose logits are read (kv->lrows,
    // gathered into xmid, free now) pay for them; a prefill chunk's rows are not sampled.
    const float *xf = a->x;
    if (kv->lrows) {
        if (kv->nl == 0) return;
        be->embedding_fwd(be, a->xmid, kv->lrows, a->x, kv->nl, C);
        xf = a->xmid;
    }
    const lb_tensor *tn = find_or_die(m, "model.norm.weight");
    const lb_tensor *th = find_or_die(m, "lm_head.weight");
    const int lmh = c->num_hidden_layers - 1;
    uint16_t *ln16 = cached_ln16(m, a, lmh, LB_ROLE_LM_HEAD);
    be->rmsnorm_fwd(be, &(lb_rmsnorm_args){.out = a->ln, .rstd = a->rstd, .x = xf,
            .w = m->params + tn->offset, .n = kv->nl, .c = C, .eps = eps, .out16 = ln16});
    lb_linear_fwd(lin, lmh, LB_ROLE_LM_HEAD, norm_in(m, lmh, LB_ROLE_LM_HEAD, a->ln, ln16, kv->nl, C),
                  m->params + th->offset, &m->wcache[th - m->tensors], 0, kv->logits, d.V, 0.0f);
}

// No collective (tp, ep, pp 1) and every MoE layer's experts on the device counts.
int lb_decoder_cached_host_free(lb_model *m)
{
    if (m->par.tp > 1 || m->par.ep > 1 || m->par.pp > 1) return 0;
    for (int l = 0; l < m->cfg.num_hidden_layers; l++) {
        lb_layer_w w = layer_weights(m, m->params, l);
        if (layer_moe(&m->cfg, l) && !experts_on_device(m, l, &w)) return 0;
    }
    return 1;
}

int lb_decoder_route_k(const lb_model_config *c) { return is_moe(c) ? c->num_experts_per_tok : 0; }

int64_t lb_decoder_active_matmul_params(const lb_model_config *c)
{
    int64_t C = c->hidden_size, D = c->head_dim;
    int64_t attn = C * (c->num_attention_heads + 2 * c->num_key_value_heads) * D +
                   (int64_t)c->num_attention_heads * D * C;
    int64_t sum = C * c->vocab_size;   // the LM head
    for (int l = 0; l < c->num_hidden_layers; l++) {
        int64_t ffn = layer_moe(c, l)
                          ? C * c->num_experts + (int64_t)(c->num_experts_per_tok +
                                                           (is_moe(c) ? c->n_shared_experts : 0)) *
                                                     3 * C * c->moe_intermediate_size
                          : 3 * C * c->intermediate_size;
        sum += attn + ffn;
    }
    return sum;
}
