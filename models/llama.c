// llama.c: Llama 3 / 3.1 (transformers' LlamaForCausalLM): pre-norm blocks of GQA attention
// with RoPE (llama3 frequency scaling where the configuration says rope_type = llama3; no
// q/k norm) and a dense SwiGLU MLP. The shared decoder's blocks (models/blocks.h) in this order.
#include "models/blocks.h"

extern const lb_model_def lb_llama_def;

static int check(const lb_model_config *c, char *err, size_t errlen)
{
    return lb_decoder_check(&lb_llama_def, c, err, errlen);
}

// embedding; per layer input_layernorm, q/k/v/o, post_attention_layernorm, gate_up, down;
// final norm, LM head.
static int tensors(const lb_model_config *c, lb_tensor *out)
{
    int i = lb_embed_tensors(c, out, 0);
    for (int l = 0; l < c->num_hidden_layers; l++) {
        i = lb_attn_tensors(c, out, i, l, 0);
        i = lb_mlp_tensors(c, out, i, l);
    }
    return lb_head_tensors(c, out, i);
}

// config.json's Llama key beside the shared decoder's (models/model.h, lb_hf_key).
static const lb_hf_key hf_config[] = {
    LB_HF_CONST("mlp_bias", LB_HF_BOOL, 0, "attention_dropout"),   // the MLP has no biases
};

const lb_model_def lb_llama_def = {
    .arch = "llama",
    .summary = "Llama 3.1: GQA with RoPE (llama3 scaling), SwiGLU MLP",
    .rope_scaling = 1,
    .hf_architecture = "LlamaForCausalLM",
    .hf_config = hf_config,
    .nhf_config = sizeof hf_config / sizeof hf_config[0],
    .check = check,
    .tensors = tensors,
    LB_DECODER_OPS,
};
