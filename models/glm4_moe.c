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
// use_qk_norm; LB_QK_NORM_OPTIONAL), every other family's are fixed.
static const lb_model_key keys[] = {
    LB_MODEL_KEY(use_qk_norm, LB_MKEY_BOOL, "false", 0, 0, NULL,
                 "per-head RMSNorm on q and k where the family makes it optional", NULL),
};

// config.json's GLM keys beside the shared decoder's (models/model.h, lb_hf_key), with
// Glm4MoeConfig's defaults. router_aux_loss_coef is not among them: this router has no such
// loss (import leaves it 0).
static const lb_hf_key hf_config[] = {
    LB_HF_KEY("use_qk_norm", LB_HF_BOOL, use_qk_norm, 0, 0, "attention_bias"),
    LB_HF_ALIAS("n_routed_experts", LB_HF_INT, num_experts, "use_cache"),
    LB_HF_KEY("norm_topk_prob", LB_HF_BOOL, norm_topk_prob, 1, 0, "moe_intermediate_size"),
    LB_HF_KEY("n_shared_experts", LB_HF_INT, n_shared_experts, 1, 0, "output_router_logits"),
    LB_HF_KEY("first_k_dense_replace", LB_HF_INT, first_k_dense_replace, 1, 0, NULL),
    LB_HF_KEY("n_group", LB_HF_INT, n_group, 1, 1, NULL),
    LB_HF_KEY("topk_group", LB_HF_INT, topk_group, 1, 1, NULL),
    LB_HF_KEY("routed_scaling_factor", LB_HF_REAL, routed_scaling_factor, 1.0, 0, NULL),
    LB_HF_CONST("num_nextn_predict_layers", LB_HF_INT, 0, NULL),   // no MTP layers
};

const lb_model_def lb_glm4_moe_def = {
    .arch = "glm4_moe",
    .summary = "GLM-4.5 MoE: GQA with biases and partial RoPE, dense leading layers, sigmoid "
               "group-limited router with a selection bias, shared and routed SwiGLU experts",
    .moe = 1,
    .sigmoid_router = 1,
    .hf_architecture = "Glm4MoeForCausalLM",
    .qk_norm = LB_QK_NORM_OPTIONAL,
    .hf_config = hf_config,
    .nhf_config = sizeof hf_config / sizeof hf_config[0],
    .hf_check = check,             // the router's shapes and the dense layers' sizes
    .keys = keys,
    .nkeys = 1,
    .check = check,
    .tensors = tensors,
    .after_step = lb_decoder_router_bias_update,
    LB_DECODER_OPS,
};
