// blocks_internal.h: what the files of the shared decoder share (not for model definitions,
// which include blocks.h): the model's shape and a layer's weights (models/blocks.c), the
// activation plan and the buffers (activations.c), and the steps the training and the cached
// forward both take (ffn.c, decoder.c). Each function's comment is at its definition.
#ifndef LB_BLOCKS_INTERNAL_H
#define LB_BLOCKS_INTERNAL_H

#include "models/blocks.h"

// --- models/blocks.c ---------------------------------------------------------------------------
int lb_blocks_moe(const lb_model_config *c);
int lb_blocks_qk_norm(const lb_model *m);
int lb_blocks_layer_moe(const lb_model_config *c, int l);
int lb_blocks_sigmoid_router(const lb_model_config *c);
const lb_tensor *lb_blocks_find_or_die(const lb_model *m, const char *name);
lb_layer_w lb_blocks_layer_weights(lb_model *m, float *base, int l);
int lb_blocks_part_rows(const lb_dims *d, int n, int *o);

// --- models/activations.c ----------------------------------------------------------------------
float *lb_blocks_falloc(lb_backend *be, size_t n);
float *lb_blocks_grow(lb_backend *be, float **p, size_t *cap, size_t n);
uint16_t *lb_blocks_grow16(lb_backend *be, uint16_t **p, size_t *cap, size_t n);
double *lb_blocks_grow64(lb_backend *be, double **p, size_t *cap, size_t n);
size_t lb_blocks_n16(size_t rows, int cols);
lb_act lb_blocks_norm_in(const lb_model *m, int l, lb_role role, const float *ln,
                         const uint16_t *ln16, int n, int c);
// The activation plan's answers (m->plan, lb_layer_plan, made by lb_decoder_plan): whether
// layer l's q/k/v projections quantize the bf16 input norm; whether role's expert GEMMs take
// their activations (takes16) or gradients (grads16) in bf16; whether a pass's output is stored
// in bf16 (out16: gate/up's fprop, down's dgrad); q and k after RoPE in bf16; the routed
// weights applied before down; the attention output (att16) and the feed-forward block's input
// norm (ln2_16) in bf16; the residual stream in bf16 (x16, xmid16).
int lb_blocks_qkv_quantized16(const lb_model *m, int l);
int lb_blocks_takes16(const lb_model *m, int l, lb_role role);
int lb_blocks_grads16(const lb_model *m, int l, lb_role role);
int lb_blocks_out16(const lb_model *m, int l, lb_role role, lb_pass pass);
int lb_blocks_qk16(const lb_model *m);
int lb_blocks_att16(const lb_model *m);
int lb_blocks_ln2_16(const lb_model *m);
int lb_blocks_res16(const lb_model *m);
int lb_blocks_qk_in16(const lb_model *m);
// A dense model's MLP layer l: gate/up's output (h 0) or the SwiGLU's (h 1) in bf16.
int lb_blocks_mlp16(const lb_model *m, int l, int h);
int lb_blocks_weights_on_h(const lb_model *m, int l);
void lb_blocks_ffn_create(lb_model *m, lb_ffn_acts *f, int n);
void lb_blocks_ffn_free(lb_model *m, lb_ffn_acts *f);
void lb_blocks_scratch_free(lb_backend *be, lb_moe_scratch *s);
double *lb_blocks_rope_freq_create(lb_model *m);
float *lb_blocks_ones_create(lb_model *m, size_t n);

// --- models/ffn.c ------------------------------------------------------------------------------
int lb_blocks_experts_on_device(lb_model *m, int l, const lb_layer_w *w);

// --- models/decoder.c --------------------------------------------------------------------------
void lb_blocks_tp_reduce(lb_model *m, float *part, float *out, int n, int C);
void lb_blocks_tp_sum(lb_model *m, float *x, size_t count);
lb_quant_args lb_blocks_kv_quant_args(void);
void lb_blocks_qkv_bias_fwd(lb_model *m, const lb_layer_w *w, const float *ones, float *q,
                            float *k, float *v, int n);
void lb_blocks_qk_rope_fwd(lb_model *m, const lb_layer_w *w, const float *q, const float *k,
                           const uint16_t *q16, const uint16_t *k16, float *qr, float *kr,
                           uint16_t *qr16, uint16_t *kr16, float *qrstd, float *krstd,
                           const int32_t *pos, const double *freq, int n);

#endif
