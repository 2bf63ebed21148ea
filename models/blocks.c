// blocks.c: the building blocks of decoder models (see blocks.h): their [model] keys and the
// configuration's checks, the tensors of each block, a layer's weights found by role, the sizes
// a rank works with, and the linear layers' weight caches. The decoder made of these blocks is
// models/activations.c (what a step keeps, and in which precision), ffn.c (the feed-forward
// blocks), decoder.c (the training forward and backward) and decoder_cached.c (the cached
// forward of sampling); what they share is declared in blocks_internal.h.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kernels/common.h"
#include "kernels/router.h"
#include "models/blocks_internal.h"

// Routed feed-forward blocks: the family's flag (the configuration names the family).
int lb_blocks_moe(const lb_model_config *c)
{
    const lb_model_def *def = lb_model_lookup(c->arch);
    return def && def->moe;
}
int lb_blocks_qk_norm(const lb_model *m) { return lb_model_qk_norm(m->def, &m->cfg); }
static int ffn_dim(const lb_model_config *c)
{
    return lb_blocks_moe(c) ? c->moe_intermediate_size : c->intermediate_size;
}
// Layer l's feed-forward block is routed (else a dense MLP: every layer of a dense family, the
// first first_k_dense_replace of a MoE one).
int lb_blocks_layer_moe(const lb_model_config *c, int l)
{
    const lb_model_def *def = lb_model_lookup(c->arch);
    return def && lb_model_layer_moe(def, c, l);
}
int lb_blocks_sigmoid_router(const lb_model_config *c)
{
    const lb_model_def *def = lb_model_lookup(c->arch);
    return def && def->moe && def->sigmoid_router;
}
static int shared_experts(const lb_model_config *c)
{
    return lb_blocks_moe(c) && c->n_shared_experts > 0;
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
    REQUIRE(!c->use_qk_norm || def->qk_norm == LB_QK_NORM_OPTIONAL,
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
    if (lb_blocks_sigmoid_router(c)) {   // the selection bias: no gradient, moved after each step
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
    return lb_blocks_layer_moe(c, l) ? lb_moe_tensors(c, out, i, l) : lb_mlp_tensors(c, out, i, l);
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

const lb_tensor *lb_blocks_find_or_die(const lb_model *m, const char *name)
{
    const lb_tensor *t = lb_model_find(m, name);
    if (!t) lb_die("model has no tensor %s", name);
    return t;
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
        const int qkn = lb_blocks_qk_norm(m), n = m->layer_end - m->layer_begin;
        const int ab = c->attention_bias, sig = lb_blocks_sigmoid_router(c), sh = shared_experts(c);
        int *ix = lb_malloc((size_t)(n > 0 ? n : 1) * R_COUNT * sizeof *ix);
        for (int i = 0; i < n; i++) {
        const int moe = lb_blocks_layer_moe(c, m->layer_begin + i);
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

lb_layer_w lb_blocks_layer_weights(lb_model *m, float *base, int l)
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
    int split = lb_blocks_moe(c) ? p->etp : p->tp;
    lb_dims d = {c->hidden_size, c->head_dim, c->num_attention_heads / p->tp,
              c->num_key_value_heads / p->tp, ffn_dim(c) / split, c->num_experts,
              c->num_experts / p->ep, c->num_experts_per_tok, c->vocab_size, p->tp, p->ep, p->sp,
              p->tp / p->etp, p->tp_rank / p->etp, c->intermediate_size / p->tp,
              shared_experts(c) ? c->n_shared_experts * c->moe_intermediate_size / p->tp : 0};
    return d;
}

// The rows [*o, *o + return) of n that this rank's part sends through the experts.
int lb_blocks_part_rows(const lb_dims *d, int n, int *o)
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
        lb_layer_w w = lb_blocks_layer_weights(m, m->params, l);
        fn(m, w.cq, l, LB_ROLE_ATTN_QKV, w.q, 1, d.hq * d.D, d.C, ctx);
        fn(m, w.ck, l, LB_ROLE_ATTN_QKV, w.k, 1, d.hkv * d.D, d.C, ctx);
        fn(m, w.cv, l, LB_ROLE_ATTN_QKV, w.v, 1, d.hkv * d.D, d.C, ctx);
        fn(m, w.co, l, LB_ROLE_ATTN_OUT, w.o, 1, d.C, d.hq * d.D, ctx);
        if (lb_blocks_layer_moe(c, l)) {
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

int lb_decoder_route_k(const lb_model_config *c)
{
    return lb_blocks_moe(c) ? c->num_experts_per_tok : 0;
}

int64_t lb_decoder_active_matmul_params(const lb_model_config *c)
{
    int64_t C = c->hidden_size, D = c->head_dim;
    int64_t attn = C * (c->num_attention_heads + 2 * c->num_key_value_heads) * D +
                   (int64_t)c->num_attention_heads * D * C;
    int64_t sum = C * c->vocab_size;   // the LM head
    for (int l = 0; l < c->num_hidden_layers; l++) {
        int64_t ffn = lb_blocks_layer_moe(c, l)
                          ? C * c->num_experts +
                                (int64_t)(c->num_experts_per_tok +
                                          (lb_blocks_moe(c) ? c->n_shared_experts : 0)) *
                                    3 * C * c->moe_intermediate_size
                          : 3 * C * c->intermediate_size;
        sum += attn + ffn;
    }
    return sum;
}

void lb_decoder_router_bias_update(lb_model *m, lb_comm *all)
{
    const lb_model_config *c = &m->cfg;
    if (!m->def->moe || !m->def->sigmoid_router) return;
    const size_t L = (size_t)c->num_hidden_layers, E = (size_t)c->num_experts;
    // Every rank's loads of every layer (zeros for another stage's layers): each token counted
    // by as many ranks as hold its rows (its tp group, or its etp group), alike for all of
    // them, so the sign of mean - load is that of the job's tokens.
    double *mine = lb_calloc(L * E, sizeof(double)), *load = lb_calloc(L * E, sizeof(double));
    if (m->expert_load) {
        memcpy(mine, m->expert_load, L * E * sizeof(double));
        memset(m->expert_load, 0, L * E * sizeof(double));
    }
    if (all && all->size > 1) lb_comm_all_reduce(all, mine, load, L * E, LB_F64);
    else memcpy(load, mine, L * E * sizeof(double));
    const float rate = (float)c->router_bias_update_rate;
    float *host = lb_malloc(E * sizeof(float)), *dev = m->be->alloc(m->be, E * sizeof(float));
    for (int l = m->layer_begin; l < m->layer_end && rate > 0; l++) {
        if (!lb_model_layer_moe(m->def, c, l)) continue;
        char name[LB_TENSOR_NAME];
        snprintf(name, sizeof name, "model.layers.%d.mlp.gate.e_score_correction_bias", l);
        const lb_tensor *t = lb_model_find(m, name);
        if (!t) lb_die("model has no tensor %s", name);
        for (size_t j = 0; j < E; j++) host[j] = (float)load[(size_t)l * E + j];
        m->be->upload(m->be, dev, host, E * sizeof(float));
        m->be->router_bias_update(m->be, m->params + t->offset, dev, (int)E, rate);
    }
    m->be->free(m->be, dev);
    free(host);
    free(mine);
    free(load);
}
