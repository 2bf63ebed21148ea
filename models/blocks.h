// blocks.h: the building blocks model definitions compose (models/blocks.c), and the decoder
// made of them (models/activations.c, ffn.c, decoder.c, decoder_cached.c).
//
// A decoder-only transformer of pre-norm layers: RMSNorm, GQA attention (optional per-head
// RMSNorm on q and k; RoPE, plain or llama3-scaled), RMSNorm, then a feed-forward block, a
// dense SwiGLU MLP or a top-k routed SwiGLU mixture of experts; the embedding, the final norm
// and the LM head around them. A model file (models/qwen3.c, models/llama.c) declares its
// tensors with the lb_*_tensors declarators below, checks its configuration with
// lb_decoder_check, and fills its lb_model_def with LB_DECODER_OPS and its feature flags
// (lb_model_def.moe, .qk_norm): the decoder reads those flags, so a family that is these
// blocks in this order needs no forward or backward of its own. doc/adding-a-model.md.
#ifndef LB_BLOCKS_H
#define LB_BLOCKS_H

#include "models/model.h"

// --- tensors ---------------------------------------------------------------------------------
// Each declarator appends its tensors at index i of out (out may be NULL: counting) and returns
// the next index. Names are Hugging Face's; how each is cut for tensor and expert parallelism:
// q/k/v and gate_up column-parallel, o and down row-parallel; the embedding, norms, router and
// LM head replicated over tp.
int lb_embed_tensors(const lb_model_config *c, lb_tensor *out, int i);
// input_layernorm, q/k/v/o projections, and with qk_norm the per-head q_norm and k_norm.
int lb_attn_tensors(const lb_model_config *c, lb_tensor *out, int i, int layer, int qk_norm);
// post_attention_layernorm and the dense SwiGLU MLP (fused gate_up_proj, down_proj).
int lb_mlp_tensors(const lb_model_config *c, lb_tensor *out, int i, int layer);
// post_attention_layernorm, the router (mlp.gate) and the fused experts.
int lb_moe_tensors(const lb_model_config *c, lb_tensor *out, int i, int layer);
// Layer l's feed-forward block: lb_moe_tensors where the layer is routed (lb_model_layer_moe:
// a MoE family's layers from first_k_dense_replace on), else lb_mlp_tensors.
int lb_ffn_tensors(const lb_model_config *c, lb_tensor *out, int i, int layer);
// model.norm and lm_head.
int lb_head_tensors(const lb_model_config *c, lb_tensor *out, int i);

// The [model] keys of the shared blocks (lb_model_key): the decoder's shape, attention and
// RoPE for every family, RoPE scaling for those with rope_scaling, the MoE keys for families
// with moe, the routers' for theirs.
extern const lb_model_key lb_block_keys[];
extern const int lb_block_nkeys;

// The checks every decoder needs (sizes, GQA, RoPE, the MoE sizes where def->moe); -1 with a
// message naming the key.
int lb_decoder_check(const lb_model_def *def, const lb_model_config *c, char *err,
                     size_t errlen);

// --- the decoder's state and passes (models/activations.c, ffn.c, decoder.c) -----------------

// Pointers to one layer's weights, or to their gradients (same offsets in m->grads), and the
// weight-cache entries of its matrices.
typedef struct {
    float *ln1, *q, *k, *v, *o, *qn, *kn, *ln2, *router, *gu, *down;
    lb_wcache *cq, *ck, *cv, *co, *crouter, *cgu, *cdown;
    float *qb, *kb, *vb;           // attention biases (attention_bias), or NULL
    float *ebias;                  // the sigmoid router's selection bias, or NULL
    float *sgu, *sdown;            // the shared experts' MLP (n_shared_experts), or NULL
    lb_wcache *csgu, *csdown;
} lb_layer_w;

// The sizes this rank works with: heads and FFN columns are its tensor-parallel share (expert
// columns its etp share), El its experts; E (router) and V stay whole. The tp group's rows go
// through the experts in tp / etp parts, part `part` on this rank's etp group. F: the family's
// feed-forward width (an expert's in a MoE model); Fd: a dense MLP layer's (the leading dense
// layers of a MoE model; = F in a dense one); Fs: the shared experts' MLP (0: none).
typedef struct {
    int C, D, hq, hkv, F, E, El, K, V, tp, ep, sp, parts, part, Fd, Fs;
} lb_dims;

// A feed-forward block's saved state. MoE rows go through the dispatcher: xp/yp are this
// rank's token rows in moe_plan order, xe/gu/h the rows its experts received (xe = xp when
// ep = 1). Dense blocks use gu and h only. h16: a bf16 copy of h where the down GEMMs that
// read it are bf16 (lb_blocks_takes16), written by swiglu_fwd and read by the forward's GEMM
// and the backward's wgrad; only GEMMs read h, so where there is a copy the fp32 values are
// neither written nor, where every layer takes copies, allocated. xp is not kept: it is ln's
// rows repeated, made again in the backward (lb_moe_scratch.rows, .rows16); under ep the rows
// the experts received (xe) are, in bf16 (xe16) where the experts take bf16 rows
// (lb_blocks_takes16): the dispatcher moves them in bf16 too. gu16: gu as the expert GEMMs
// stored it in bf16 (lb_blocks_out16), held instead of gu.
typedef struct {
    float *rlogits, *probs, *weight;   // (n, E), (n, E), (n, k)
    int32_t *idx, *row;                // (n, k)
    int *counts;                       // (E) host: rows per expert
    int *counts_dev;                   // (E) backend memory: the same (the cached forward's)
    float *aux_grad;                   // (E) d aux / d probs[i][j]
    float *yp;                         // (n*k, c), where the weights follow down (fp32)
    float *xe, *gu, *h;                // (cap, c), (cap, 2f), (cap, f)
    size_t cap_yp, cap_xe, cap_gu, cap_h;   // grow-only: rows vary under ep
    // Where the routed weights are applied to the SwiGLU outputs (every recipe but fp32:
    // lb_blocks_weights_on_h), the weights in moe_plan order (n*k) and, under ep, as the
    // experts received them (cap): h and h16 hold silu(gate) * up * weight, down's outputs
    // are summed as they are, so yp is not kept.
    float *wp, *wpe;
    size_t cap_wp, cap_wpe;
    uint16_t *h16, *gu16, *xe16;       // (cap, pad8(f)), (cap, pad8(2f)), (cap, pad8(c)), or NULL
    size_t cap_h16, cap_gu16, cap_xe16;
    lb_ep_route route;
    float *sgu, *sh;                   // the shared experts' (n, 2 fs), (n, fs), or NULL
    uint16_t *sgu16, *sh16;            // the same in bf16 instead (lb_blocks_mlp16), or NULL
} lb_ffn_acts;

// Exchange and expert scratch shared by a micro-batch's layers (grow-only).
typedef struct {
    float *xs, *ye, *dye, *dxe, *dgu, *dh;
    size_t cap_xs, cap_ye, cap_dye, cap_dxe, cap_dgu, cap_dh;
    // (n*k, c) this rank's routed rows, in fp32 (rows) and, where the expert GEMMs take
    // copies (ep 1), bf16 (rows16, rows of pad8(c)): one buffer for a layer's passes in turn,
    // the forward's xp (moe_permute's copy of ln, read by gate/up's fprop or the dispatcher),
    // the backward's dyp (moe_combine_bwd's, read by down's dgrad and wgrad or the
    // dispatcher), then (ep 1) xp again, moe_permute of the same ln rows, the same bits, for
    // gate/up's wgrad: xp kept from forward to backward would cost (n*k, c) a layer.
    float *rows;
    uint16_t *rows16;
    // (n*k), (cap): the gradients of the routed weights in the experts' row order, this
    // rank's and (ep) the received rows', in double until the etp ranks' parts are added
    // (lb_swiglu_args.drw); dw32 (n*k) the same rounded to fp32
    double *dwp, *dwpe;
    float *dw32;
    size_t cap_dwp, cap_dwpe, cap_dw32;
    uint16_t *dgu16;           // a bf16 copy of dgu (lb_blocks_takes16)
    uint16_t *dh16;            // dh as the down dgrad stored it in bf16 (lb_blocks_out16)
    size_t cap_rows, cap_rows16, cap_dgu16, cap_dh16;
} lb_moe_scratch;

typedef struct {
    // saved by forward, per layer. ns rows are this rank's (n / tp under sequence parallelism).
    float *x;              // (ns, c) residual entering the layer; x[layers] feeds the next stage
    uint16_t *x16;         // (ns, pad8(c)) x in bf16 instead (NULL: fp32; lb_layer_plan.residual)
    float *ln1, *rstd1;    // (n, c) all rows (gathered under SP), (ns)
    uint16_t *ln1_16;      // (n, pad8(c)) ln1 in bf16 instead (NULL: fp32; activations.c ln1_16)
    float *q, *qrstd, *qr; // q before norm (n, hq*d), its rstd (n*hq), after norm + RoPE
    float *k, *krstd, *kr; // same for k, (n, hkv*d)
    uint16_t *q16, *k16;   // q and k before their norms in bf16 instead (NULL: fp32; qk_in)
    float *v;              // (n, hkv*d)
    // qr and kr in bf16 instead (NULL: fp32), where the attention reads bf16 (lb_blocks_qk16)
    uint16_t *qr16, *kr16;
    float *att, *lse;      // (n, hq*d), (b, hq, t)
    uint16_t *att16;       // (n, hq*d) att in bf16 instead (NULL: fp32; lb_blocks_att16)
    float *xmid;           // (ns, c) residual after attention
    uint16_t *xmid16;      // (ns, pad8(c)) xmid in bf16 instead (NULL: fp32)
    float *ln2, *rstd2;    // (n, c), (ns)
    uint16_t *ln2_16;      // (n, pad8(c)) ln2 in bf16 instead (NULL: fp32; lb_layer_plan.ln2)
    lb_ffn_acts f;
    int shared;            // selective recomputation: the recomputed buffers are a->sel's
} lb_layer_acts;

typedef struct {
    int b, t, n, ns, nl;   // nl: this stage's layers
    lb_layer_acts *l;      // (nl + 1): only .x is used in the last; only .x of any under recompute
    int recompute;         // LB_RECOMPUTE_*: none, selective or full
    lb_layer_acts work;       // full: the working layer's buffers, .x (.x16) borrowed from l[i]
    lb_layer_acts sel;        // selective: the recomputed buffers every layer shares
    float *lnf, *rstdf;    // (ns, c), (ns)
    float *loss;           // (ns) per-token losses
    double *ce_stats;      // (ns, 2) the cross-entropy's row statistics (max, exp sum)
    int ce_stats_ok;       // ce_stats are those of the logits buffer, all ns rows
    int logits_whole;      // the logits buffer holds the last forward's ns rows
    int head_done;         // the last forward ran the LM head's backward (forward_train) ...
    float head_scale;      // ... with this loss scale: dln holds d loss / d lnf
    int32_t *pos;          // (n)
    double *rope_freq;     // (D/2) backend: llama3-scaled RoPE frequencies, NULL for plain RoPE
    float *ones;           // (n) backend ones: the attention biases' GEMMs, or NULL
    float *part;           // (n, c) a row-parallel layer's partial output (tp > 1)
    float *branch;         // (ns, c) a block's output before its residual add into bf16 x16
    // backward scratch
    float *dres;           // (ns, c) d loss / d residual
    float *dfull;          // (n, c) dres gathered over tp (= dres without SP)
    float *dln, *dlns;     // (n, c) partial d loss / d norm output; (ns, c) its sum (= dln w/o SP)
    float *dq, *dk, *dv, *datt;            // (n, hq*d), (n, hkv*d) x2, (n, hq*d)
    float *dqr, *dkr;                      // (n, hq*d), (n, hkv*d)
    float *dgu, *dh;                       // dense: (n, 2f), (n, f)
    float *dxp;                            // (n*k, c)
    float *drlogits, *dweight, *daux;      // (n, E), (n, k), (E)
    lb_moe_scratch ms;
    float *host_loss;                      // (ns) host
    int32_t *host_targets;                 // (ns) host
} lb_acts;

// One layer's worth of activations for up to `rows` new tokens (layers run one after another).
typedef struct {
    int rows;
    float *x, *xmid, *ln, *rstd;           // (rows, c), (rows, c), (rows, c), (rows)
    // (rows, pad8(c)) x and xmid in bf16 where the residual stream is (lb_blocks_res16): x
    // and xmid then hold the blocks' outputs before their adds
    uint16_t *x16, *xmid16;
    uint16_t *ln16;                        // (rows, pad8(c)): ln in bf16 for bf16 GEMMs
    float *q, *qrstd, *qr;                 // (rows, hq*d), (rows*hq), (rows, hq*d)
    float *k, *krstd, *kr, *v;             // (rows, hkv*d), (rows*hkv), (rows, hkv*d) x2
    uint16_t *q16, *k16;                   // q and k in bf16 instead where lb_blocks_qk_in16
    float *att;                            // (rows, hq*d)
    uint16_t *att16;                       // (rows, hq*d) att in bf16 where lb_blocks_att16
    float *part;                           // (rows, c) tp > 1
    lb_qmat kq, vq;                        // fp8 cache: k and v quantized, (rows * hkv, d)
    double *rope_freq;                     // as lb_acts'
    float *ones;                           // as lb_acts'
    lb_ffn_acts f;
    lb_moe_scratch ms;
} lb_cached_acts;

lb_dims lb_dims_of(const lb_model *m);

// q, k, v (n, heads x D) = ln (n, C) times their weights: one call, so a low-precision ln is
// quantized once for the three (lb_linear_fwd_shared). ln in fp32 or bf16 (lb_act); q and k
// into q16 and k16 in bf16 instead where given (lb_layer_plan.qk_in).
void lb_qkv_fwd(lb_linear *lin, int l, const lb_layer_w *w, lb_act ln, float *q, float *k,
                float *v, uint16_t *q16, uint16_t *k16, lb_dims d);
// RMSNorm of this rank's rows of x into norm's rows (all rows gathered under SP), or (norm16
// given) into norm16 in bf16 instead, (n, pad8(c)).
void lb_norm_rows(lb_model *m, lb_acts *a, lb_act x, const float *w, float *norm,
                  uint16_t *norm16, float *rstd);
// Core attention of layer L from its q, k, v projections: q/k norms (def->qk_norm), RoPE, what
// an fp8 KV cache would hold (straight-through backward), attention.
void lb_attention_core_fwd(lb_model *m, lb_acts *a, lb_layer_acts *L, const lb_layer_w *w);
// The feed-forward block, dense or routed (def->moe). out (n, c) = this rank's share of the
// block on ln (n, c): the caller sums it over tp. Returns the layer's load-balancing loss (0
// for dense blocks or without want_aux). cached: the cached forward (no backward follows), where
// the rows per expert may stay on the device (gemm_experts). ln16: NULL, or ln in bf16
// (rmsnorm_fwd's out16), which the block's bf16 GEMMs read instead of rounding ln again; ln
// NULL where ln16 is all there is (lb_layer_plan.ln2).
double lb_ffn_fwd(lb_model *m, int l, const lb_layer_w *w, lb_ffn_acts *f, lb_moe_scratch *s,
                  const float *ln, const uint16_t *ln16, int n, float *out, int want_aux,
                  int cached);
// dln (n, c) = this rank's share of d loss / d ln given dout (n, c) = d loss / d out (the same
// on every tp rank); the caller sums it over tp. Accumulates the block's weight gradients. ln
// in fp32 or bf16, as the forward stored it.
void lb_ffn_bwd(lb_model *m, int l, const lb_layer_w *w, const lb_layer_w *dw, lb_ffn_acts *f,
                lb_acts *a, lb_act ln, int n, const float *dout, float *dln, float aux_scale);
// Decoder layer i of this stage on L->x (L->x16), into a->l[i + 1].x (.x16); returns its
// load-balancing loss.
double lb_decoder_layer_fwd(lb_model *m, lb_acts *a, int i, lb_layer_acts *L);

// --- the lb_model_def entry points of a decoder ------------------------------------------------
void lb_decoder_weights_refresh(lb_model *m);
size_t lb_decoder_wcache_bytes(lb_model *m);
void *lb_decoder_acts_create(lb_model *m, int b, int t);
void lb_decoder_acts_free(lb_model *m, void *acts);
void lb_decoder_forward(lb_model *m, const int32_t *tokens, const int32_t *targets, int b, int t);
void lb_decoder_backward(lb_model *m, float loss_scale);
void lb_decoder_backward_logits(lb_model *m, float aux_scale);
void *lb_decoder_cached_create(lb_model *m, int max_rows);
void lb_decoder_cached_free(lb_model *m, void *acts);
void lb_decoder_forward_cached(lb_model *m, lb_kvcache *kv, int n);
int lb_decoder_cached_host_free(lb_model *m);
int lb_decoder_route_k(const lb_model_config *c);
void lb_decoder_plan(const lb_model *m, lb_layer_plan *out);
int64_t lb_decoder_active_matmul_params(const lb_model_config *c);
float *lb_decoder_stage_input(lb_model *m);
float *lb_decoder_stage_output(lb_model *m);
float *lb_decoder_stage_grad(lb_model *m);

// The entry points of a model made of these blocks (all but check and tensors).
// The aux-loss-free balancing step of the sigmoid router (DeepSeek-V3), a family's
// lb_model_def.after_step: the expert loads of the backwards since the last call, summed over
// `all` (every rank of the job; NULL: this rank alone), move each layer's selection bias by
// router_bias_update_rate * sign(mean load - load) (router_bias_update). Collective over all;
// nothing for other routers.
void lb_decoder_router_bias_update(lb_model *m, lb_comm *all);

#define LB_DECODER_OPS                                        \
    .acts_create = lb_decoder_acts_create,                    \
    .acts_free = lb_decoder_acts_free,                        \
    .forward = lb_decoder_forward,                            \
    .backward = lb_decoder_backward,                          \
    .weights_refresh = lb_decoder_weights_refresh,            \
    .wcache_bytes = lb_decoder_wcache_bytes,                  \
    .backward_logits = lb_decoder_backward_logits,            \
    .cached_create = lb_decoder_cached_create,                \
    .cached_free = lb_decoder_cached_free,                    \
    .forward_cached = lb_decoder_forward_cached,              \
    .cached_host_free = lb_decoder_cached_host_free,          \
    .active_matmul_params = lb_decoder_active_matmul_params,  \
    .route_k = lb_decoder_route_k,                            \
    .plan = lb_decoder_plan,                                  \
    .stage_input = lb_decoder_stage_input,                    \
    .stage_output = lb_decoder_stage_output,                  \
    .stage_grad = lb_decoder_stage_grad

#endif
