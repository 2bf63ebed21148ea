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


const lb_model_def lb_qwen3_moe_def = {
    .arch = "qwen3_moe",
    .summary = "Qwen3-MoE: GQA with q/k RMSNorm and RoPE, top-k softmax router, SwiGLU experts",
    .moe = 1,
    .qk_norm = 1,
    .rope_scaling = 1,
    .hf_architecture = "Qwen3MoeForCausalLM",
    .hf_keys = LB_HF_SLIDING_WINDOW,
    .check = check_moe,
    .tensors = tensors,
    LB_DECODER_OPS,
};

const lb_model_def lb_qwen3_def = {
    .arch = "qwen3",
    .summary = "Qwen3 (dense): GQA with q/k RMSNorm and RoPE, SwiGLU MLP",
    .qk_norm = 1,
    .rope_scaling = 1,
    .hf_architecture = "Qwen3ForCausalLM",
    .hf_keys = LB_HF_SLIDING_WINDOW,
    .check = check_dense,
    .tensors = tensors,
    LB_DECODER_OPS,
};
