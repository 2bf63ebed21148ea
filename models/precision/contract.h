// contract.h: the precision contract. The [precision] section resolves to one object that
// gives, for every GEMM site (a role in a pass at a layer), the operand format, the backward
// mode, the Hadamard transform and the rounding. Every GEMM of the trainer and of the sampler
// asks it; the sampler reads the fprop entries. See doc/formats.md.
#ifndef LB_CONTRACT_H
#define LB_CONTRACT_H

#include <stddef.h>
#include <stdio.h>
#include "kernels/kernels.h"
#include "kernels/quant/quant.h"   // lb_scale_rule

typedef enum {
    LB_ROLE_ATTN_QKV, LB_ROLE_ATTN_OUT, LB_ROLE_MOE_GATE_UP, LB_ROLE_MOE_DOWN,
    LB_ROLE_MLP_GATE_UP, LB_ROLE_MLP_DOWN, LB_ROLE_ROUTER, LB_ROLE_LM_HEAD, LB_NROLES
} lb_role;

typedef enum { LB_PASS_FPROP, LB_PASS_DGRAD, LB_PASS_WGRAD, LB_NPASSES } lb_pass;

// How a backward GEMM treats the quantized forward: in the format itself (quantized), in BF16
// on the dequantized operands (dequantized), or in BF16 on the original operands (high).
typedef enum { LB_BWD_QUANTIZED, LB_BWD_DEQUANTIZED, LB_BWD_HIGH } lb_bwd_mode;

typedef enum { LB_HAD_NONE = 0, LB_HAD_16 = 16, LB_HAD_32 = 32 } lb_hadamard_size;

typedef struct {
    lb_format fmt;                 // format of both operands of this GEMM
    lb_bwd_mode mode;              // dgrad/wgrad only; fprop is always "quantized"
    lb_hadamard_size hadamard;     // wgrad only: along the reduction (token) axis
    int hadamard_random;           // signs drawn per step (else fixed)
    int stochastic;                // stochastic rounding of the gradient operand
    lb_scale_rule scale_rule;      // MXFP8 / MXFP4
    int scale_pow2;                // fp8-block: scales rounded up to powers of two (else 0)
    int nvfp4_per_token;           // NVFP4 activations: second-level scale per row (else tensor)
    int nvfp4_weight_2d;           // NVFP4 weights in 16x16 blocks (else 1x16)
} lb_site;

// The recipes (precision.recipe), in the order of the recipe table (contract.c), which
// `lowbit params` and the tests list.
typedef enum {
    LB_RECIPE_FP32, LB_RECIPE_BF16, LB_RECIPE_FP8_BLOCK, LB_RECIPE_MXFP8, LB_RECIPE_NVFP4_MOE,
    LB_RECIPE_MXFP4, LB_NRECIPES
} lb_recipe;

// The choices of precision.backward, precision.wgrad_hadamard and precision.attention, each in
// its parameter's order (src/cli/params.c; tests/test_config.c pairs them by name).
typedef enum {
    LB_BACKWARD_DEFAULT, LB_BACKWARD_QUANTIZED, LB_BACKWARD_DEQUANTIZED, LB_BACKWARD_HIGH
} lb_backward_choice;
typedef enum {
    LB_WGRAD_HAD_DEFAULT, LB_WGRAD_HAD_NONE, LB_WGRAD_HAD_H16, LB_WGRAD_HAD_H32,
    LB_WGRAD_HAD_RANDOM16
} lb_wgrad_hadamard_choice;
typedef enum { LB_ATTENTION_AUTO, LB_ATTENTION_FP32, LB_ATTENTION_BF16 } lb_attention_choice;

// What a parameter file's [precision] section says, its words parsed once by the configuration
// (src/cli/config.c, lb_config_precision); the lists stay text, which lb_contract_resolve
// reads against the roles, layers and formats. All zeros: the fp32 recipe.
typedef struct {
    lb_recipe recipe;
    lb_backward_choice backward;
    lb_wgrad_hadamard_choice wgrad_hadamard;
    int stochastic_rounding;       // stochastic rounding of gradient operands (bool)
    lb_scale_rule scale_rule;      // MX block scales: ceil | floor
    int scale_pow2;                // precision.scale: fp32 (0) | pow2 (1), fp8-block's scales
    int nvfp4_per_tensor;          // precision.nvfp4_scale: per-token (0) | per-tensor (1)
    int nvfp4_weight_2d;           // precision.nvfp4_weight_blocks: 1x16 (0) | 16x16 (1)
    char keep_bf16_roles[256];     // comma list of roles kept in BF16, e.g. "router,lm_head"
    char keep_bf16_layers[256];    // comma list of layer indices, negative from the end
    char overrides[1024];          // "role.pass=format" items separated by ';' or ','
    lb_attention_choice attention; // attention's numerics
} lb_precision_spec;

typedef struct {
    int layers;
    char recipe[16];
    lb_site *sites;                // (layers, LB_NROLES, LB_NPASSES)
    // Attention's numerics mode (kernels.h, attention_*'s bf16 argument): 1 = bf16 inputs on
    // tensor cores (FlashAttention's numerics). auto: every recipe but fp32, which stays the
    // exact reference.
    int attention_bf16;
} lb_contract;

// Resolves spec for a model of `layers` layers. Returns 0, or -1 with a message naming the
// precision key and the bad word (of a list) in err.
int lb_contract_resolve(lb_contract *c, const lb_precision_spec *spec, int layers, char *err,
                        size_t errlen);
void lb_contract_free(lb_contract *c);
const lb_site *lb_contract_site(const lb_contract *c, int layer, lb_role role, lb_pass pass);
// The resolved table, role x pass -> format (layers that differ are listed separately).
void lb_contract_print(const lb_contract *c, unsigned roles, FILE *f);

const char *lb_role_name(lb_role r);      // "attn.qkv", ...
const char *lb_format_name(lb_format f);  // "fp32", "bf16", "fp8-block", ...
// The recipes (precision.recipe): how many, the i-th's name (NULL outside 0 .. count - 1), and
// all of them as "fp32|bf16|..." (the parameter's choices), in one order.
int lb_recipe_count(void);
const char *lb_recipe_name(int i);
// The recipe of that name (LB_NRECIPES where none is).
lb_recipe lb_recipe_of(const char *name);
const char *lb_recipe_choices(void);
int lb_format_parse(const char *s, lb_format *out);

#endif
