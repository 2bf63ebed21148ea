// qwen3.c: the Qwen3 family. qwen3_moe: pre-norm blocks of GQA attention (per-head RMSNorm on
// q and k, RoPE) and a top-k routed SwiGLU mixture of experts. qwen3: the same with a dense
// SwiGLU MLP. Both are the shared decoder's blocks (models/blocks.h) in this order.
#include "models/blocks.h"

extern const lb_model_def lb_qwen3_moe_def, lb_qwen3_def;

static int check_moe(const lb_model_config *c, char *err, size_t errlen)
{
    return lb_decoder_check(&lb_qwen3_moe_def, c, err, errlen);
}

static int check_dense(const lb_model_config *c, char *err, size_t errlen)
{
    return lb_decoder_check(&lb_qwen3_def, c, err, errlen);
}

// embedding; per layer input_layernorm, q/k/v/o, q_norm, k_norm, post_attention_layernorm and
// the feed-forward block; final norm, LM head (the checkpoint's order).
static int tensors(const lb_model_config *c, lb_tensor *out)
{
    int i = lb_embed_tensors(c, out, 0);
    for (int l = 0; l < c->num_hidden_layers; l++) {
        i = lb_attn_tensors(c, out, i, l, 1);
        i = lb_ffn_tensors(c, out, i, l);   // qwen3_moe: dense where mlp_only_layers
    }
    return lb_head_tensors(c, out, i);
}

// config.json's Qwen keys beside the shared decoder's (models/model.h, lb_hf_key). Both
// families write the sliding-window keys, off: lowbit attends to the whole causal context.
#define SLIDING_WINDOW                                                                         \
    LB_HF_CONST("use_sliding_window", LB_HF_BOOL, 0, "attention_dropout"),                     \
    LB_HF_CONST("sliding_window", LB_HF_NULL, 0, NULL),                                        \
    LB_HF_ALIAS("max_window_layers", LB_HF_INT, num_hidden_layers, NULL)

static const lb_hf_key hf_dense[] = {SLIDING_WINDOW};

static const lb_hf_key hf_moe[] = {
    SLIDING_WINDOW,
    // the expert count in both spellings: transformers 4 reads num_experts, 5 either (import
    // takes every family's spelling)
    LB_HF_ALIAS("num_experts", LB_HF_INT, num_experts, "use_cache"),
    LB_HF_ALIAS("num_local_experts", LB_HF_INT, num_experts, NULL),
    LB_HF_KEY("norm_topk_prob", LB_HF_BOOL, norm_topk_prob, 0, 0, "moe_intermediate_size"),
    LB_HF_CONST("decoder_sparse_step", LB_HF_INT, 1, "output_router_logits"),   // every layer
    LB_HF_KEY("mlp_only_layers", LB_HF_LAYERS, first_k_dense_replace, 0, 0, NULL),
    LB_HF_KEY("router_aux_loss_coef", LB_HF_REAL, router_aux_loss_coef, 0.001, 0, NULL),
};

const lb_model_def lb_qwen3_moe_def = {
    .arch = "qwen3_moe",
    .summary = "Qwen3-MoE: GQA with q/k RMSNorm and RoPE, top-k softmax router, SwiGLU experts",
    .moe = 1,
    .qk_norm = LB_QK_NORM_ALWAYS,
    .rope_scaling = 1,
    .hf_architecture = "Qwen3MoeForCausalLM",
    .hf_config = hf_moe,
    .nhf_config = sizeof hf_moe / sizeof hf_moe[0],
    .check = check_moe,
    .tensors = tensors,
    LB_DECODER_OPS,
};

const lb_model_def lb_qwen3_def = {
    .arch = "qwen3",
    .summary = "Qwen3 (dense): GQA with q/k RMSNorm and RoPE, SwiGLU MLP",
    .qk_norm = LB_QK_NORM_ALWAYS,
    .rope_scaling = 1,
    .hf_architecture = "Qwen3ForCausalLM",
    .hf_config = hf_dense,
    .nhf_config = sizeof hf_dense / sizeof hf_dense[0],
    .check = check_dense,
    .tensors = tensors,
    LB_DECODER_OPS,
};
