// glm4_moe.c: GLM-4.5's MoE (transformers' Glm4MoeForCausalLM), DeepSeek-V3's routing behind
// ordinary GQA attention: q/k/v projections with a bias, optional per-head q/k RMSNorm, RoPE on
// a part of each head (partial_rotary_factor); the first first_k_dense_replace layers a dense
// SwiGLU MLP, the others the sigmoid router (selection bias, group-limited top-k, routed
// scaling factor) over SwiGLU experts with n_shared_experts shared experts beside them. All of
// it is the shared decoder's blocks (models/blocks.h); the bias moves after each optimizer step
// (after_step: lb_decoder_router_bias_update).
#include "models/blocks.h"

extern const lb_model_def lb_glm4_moe_def;

static int check(const lb_model_config *c, char *err, size_t errlen)
{
    return lb_decoder_check(&lb_glm4_moe_def, c, err, errlen);
}

static int tensors(const lb_model_config *c, lb_tensor *out)
{
    int i = lb_embed_tensors(c, out, 0);
    for (int l = 0; l < c->num_hidden_layers; l++) {
        i = lb_attn_tensors(c, out, i, l, c->use_qk_norm);
        i = lb_ffn_tensors(c, out, i, l);   // dense below first_k_dense_replace
    }
    return lb_head_tensors(c, out, i);
}

// The key only this family reads: GLM-4.5's q/k norms are optional (its config.json's
// use_qk_norm; LB_HF_USE_QK_NORM), every other family's are fixed.
static const lb_model_key keys[] = {
    LB_MODEL_KEY(use_qk_norm, LB_MKEY_BOOL, "false", 0, 0, NULL,
                 "per-head RMSNorm on q and k where the family makes it optional", NULL),
};

const lb_model_def lb_glm4_moe_def = {
    .arch = "glm4_moe",
    .summary = "GLM-4.5 MoE: GQA with biases and partial RoPE, dense leading layers, sigmoid "
               "group-limited router with a selection bias, shared and routed SwiGLU experts",
    .moe = 1,
    .sigmoid_router = 1,
    .hf_architecture = "Glm4MoeForCausalLM",
    .hf_keys = LB_HF_USE_QK_NORM,
    .keys = keys,
    .nkeys = 1,
    .check = check,
    .tensors = tensors,
    .after_step = lb_decoder_router_bias_update,
    LB_DECODER_OPS,
};
