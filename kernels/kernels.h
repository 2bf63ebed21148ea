// kernels.h: the kernel set, lowbit's one compute interface.
//
// A backend is a table of operations (as ggml's backend interface). kernels/cpu fills it with
// the reference (C11 + OpenBLAS, fp32); kernels/cuda fills it for NVIDIA GPUs. The trainer's
// forward and backward and the sampler call only this table.
//
// Conventions for every operation:
// - Buffers live in the backend's memory (alloc/upload/download); matrices are row-major and
//   contiguous. Shapes are given in comments as (rows, cols).
// - Activation buffers are fp32 where an op takes a float pointer, fp32 or bf16 where it takes
//   an lb_act. Integer buffers (tokens, expert indices) are int32.
// - Weight-gradient outputs ACCUMULATE (+=), so micro-batches sum into one gradient buffer.
//   Activation-gradient outputs are OVERWRITTEN (=) unless the comment says otherwise.
// - Results never depend on the number of threads or on which other rows are in the call:
//   no atomics, each output element reduced in one fixed order (batch invariance).
#ifndef LB_KERNELS_H
#define LB_KERNELS_H

#include <stddef.h>
#include <stdint.h>

// Element formats of GEMM operands (doc/formats.md).
typedef enum {
    LB_FMT_FP32 = 0,
    LB_FMT_BF16,
    LB_FMT_FP8_BLOCK,
    LB_FMT_MXFP8,
    LB_FMT_MXFP4,
    LB_FMT_NVFP4,
    // E4M3 with one FP32 scale for the whole tensor: a GEMM format (quantize, gemm_q,
    // lowbit bench), never a training one: the scale depends on every row, so a token's
    // result would depend on its batch (the precision contract refuses it).
    LB_FMT_FP8_TENSOR,
} lb_format;

// Element types of activations.
typedef enum { LB_ACT_F32 = 0, LB_ACT_BF16 } lb_act_type;

// An activation matrix in backend memory: (rows, cols) elements of type, row r starting ld
// elements after row r - 1. A bf16 one lies in to_bf16's layout (ld = cols rounded up to 8),
// as every op that writes a bf16 activation writes it. Ops that take an lb_act read either
// type: a bf16 activation needs no fp32 twin.
typedef struct {
    const void *p;
    lb_act_type type;
    int rows, cols;
    size_t ld;
} lb_act;

static inline lb_act lb_act_f32(const float *p, int rows, int cols)
{
    return (lb_act){p, LB_ACT_F32, rows, cols, (size_t)cols};
}

static inline lb_act lb_act_bf16(const uint16_t *p, int rows, int cols)
{
    return (lb_act){p, LB_ACT_BF16, rows, cols, (size_t)(cols + 7) / 8 * 8};
}

// x's bf16 copy where it is given, else x itself: the activation a bf16-or-fp32 caller has.
static inline lb_act lb_act_of(const float *x, const uint16_t *x16, int rows, int cols)
{
    return x16 ? lb_act_bf16(x16, rows, cols) : lb_act_f32(x, rows, cols);
}

static inline size_t lb_act_esize(lb_act x) { return x.type == LB_ACT_BF16 ? 2 : 4; }

// Rows [r0, r0 + n) of x.
static inline lb_act lb_act_rows(lb_act x, size_t r0, int n)
{
    x.p = x.p ? (const char *)x.p + r0 * x.ld * lb_act_esize(x) : NULL;
    x.rows = n;
    return x;
}

// One GEMM: C (m, n) = alpha * op(A) (m, k) * op(B) (k, n) + beta * C.
// op(X) is X when trans is 0 and X^T when 1; A is stored (m, k) or (k, m), B (k, n) or (n, k).
// The linear layer's three passes with W (out, in):
//   fprop  Y  = X  W^T : transa 0, transb 1
//   dgrad  dX = dY W   : transa 0, transb 0
//   wgrad  dW += dY^T X: transa 1, transb 0, beta 1
typedef struct {
    int transa, transb;
    int m, n, k;
    float alpha, beta;
    const float *a, *b;
    float *c;
    // 1: the product of a and b rounded to bf16 (nearest even, as round_bf16): the backend
    // rounds them itself (the CPU into copies, CUDA while converting them for its bf16 tensor
    // cores), so the caller needs no rounding pass. Products of bf16 values are exact in fp32;
    // only the order of the fp32 accumulation can differ from the fp32 GEMM of the rounded
    // values. Operands that are bf16 values already are unchanged by the rounding.
    int bf16;
    // NULL, or (bf16 1 only) b rounded to bf16 already: its bits in b's storage layout, each
    // stored row padded to a multiple of 8 elements (to_bf16). It holds exactly what rounding
    // b gives, so a backend reads it instead of rounding b (a weight cache fills it once a
    // step); b stays valid and means the same.
    const uint16_t *b16;
    // NULL, or (bf16 1 only) a rounded to bf16 already, in the same layout: what the op that
    // wrote a wrote beside it (swiglu_fwd's out16, moe_permute's xp16, ...). Where a16 (b16) is
    // given, a (b) may be NULL: the op that made the copy need not have written fp32 at all.
    const uint16_t *a16;
    // NULL, or (bf16 1 and beta 0 only; 4-byte aligned, as every row of a to_bf16 copy is)
    // where C goes instead of c, rounded to bf16 (nearest even) in to_bf16's layout, rows
    // pad8(n) elements apart (c is then not written and may be NULL; the pad columns n ..
    // pad8(n) - 1 are not written either). The output of a GEMM whose readers take bf16 (an
    // expert layer's gate/up and down outputs): half the bytes of fp32 to write and to read
    // again, as stored activations are (doc/architecture.md, Memory). The value is C's fp32 result rounded
    // once, so the CPU rounds where the GPU stores.
    uint16_t *c16;
} lb_gemm_args;

// gemm_experts: an MoE layer's fprop over all its experts, with the rows per expert in backend
// memory (moe_plan's counts), so the host never needs them: expert j's rows of C are its rows
// of A times its weight B_j^T, the experts' rows one after another in expert order (moe_plan's
// permuted buffer). Operands in bf16 (the bf16 fprop: lb_gemm_args with bf16 1, transa 0,
// transb 1, alpha 1, beta 0, a16 and b16 given): the same bits as gemm_grouped over the same
// groups. Or quantized (qa and qb given, a16 and b16 NULL): gemm_q_grouped's product of the
// groups of qa's rows (one row-wise quantization of all rows, split by lb_qmat_rows, as
// linear.c's experts quantize) and qb[j], with its bits. counts must sum to rows (CUDA
// reports a larger sum and clips it).
typedef struct {
    const uint16_t *a16;   // (rows, pad8(k)) the experts' rows, expert 0's first
    const uint16_t *b16;   // (e, n, pad8(k)) every expert's weight, stacked (a weight cache's)
    float *c;              // (rows, n), or NULL where c16 is given
    uint16_t *c16;         // (rows, pad8(n)) C rounded to bf16 as lb_gemm_args.c16, or NULL
    const int *counts;     // (e) backend memory: expert j's rows
    int e, rows, n, k;
    const struct lb_qmat *qa;   // (rows, k) quantized row-wise, or NULL
    const struct lb_qmat *qb;   // (e) expert j's (n, k) row-wise (a weight cache's row), or NULL
} lb_gemm_experts_args;
// Its groups for gemm_grouped (a calloc'd array of a->e), counts_host the host's copy of
// a->counts; dies where the counts pass a->rows.
lb_gemm_args *lb_experts_groups(const lb_gemm_experts_args *a, const int *counts_host);

// The sample operation (the sampler's decode step): one token per row of logits, drawn on the
// device from counter-based random numbers, with the stop test, so that only the tokens and
// done flags need to reach the host.
#define LB_SAMPLE_MAX_STOP 16

// Row i's random number is lb_rand_uniform(seed, stream, counter) (the completion position it
// samples); counter < 0: the row is not sampled (a prompt row): token -1, done 0.
typedef struct {
    uint64_t seed, stream;
    int64_t counter;
} lb_sample_row;

// The draw of row i (kernels/sample.h states the arithmetic; every backend gives its bits):
// - mx = the largest non-NaN logit (-inf if none); greedy (top_k 1): the lowest token with
//   logit mx (0 if none), no random number used.
// - Weights w_j = lb_sample_weight(l_j, mx), integers ~ 2^39 exp(l_j - mx).
// - The sorted order is logit descending, ties by token id. top_k > 0 keeps its first top_k
//   tokens (all when top_k >= v); top_p < 1 keeps, of those, the shortest prefix whose weight
//   reaches lb_sample_top_p_need(top_p, their weight).
// - The token: the first kept token in token-id order whose running sum of kept weights
//   exceeds lb_sample_target(u, the kept weight); a row of zero weight gives the greedy token.
typedef struct {
    const float *logits;           // (n, v) the policy's logits (tempered already)
    const lb_sample_row *rows;     // (n) backend memory
    int32_t *token;                // (n) out
    int32_t *done;                 // (n) out, or NULL: 2 where the token is a stop token, else
                                   // 1 where counter + 1 >= max_len (the last one), else 0
    int n, v;                      // v <= LB_SAMPLE_MAX_V (kernels/sample.h)
    int top_k;                     // 0 = off, 1 = greedy
    float top_p;                   // (0, 1]; 1 = off
    int max_len;                   // 0: no length limit
    int nstop;
    int32_t stop[LB_SAMPLE_MAX_STOP];
} lb_sample_args;
// Dies with a message where a's sizes or settings are out of range (both backends call it).
void lb_sample_check(const lb_sample_args *a);
// The CPU reference's draw of one row of logits (v) at the uniform u in [0, 1) (u unused for
// greedy): what `sample` gives for a row whose random number is u. For tests.
int32_t lb_sample_draw(const float *logits, int v, int top_k, float top_p, float u);

typedef struct lb_backend lb_backend;
struct lb_qmat;           // a quantized matrix (kernels/quant/quant.h)
struct lb_quant_args;     // how to quantize it
struct lb_graph;          // a recording of queued operations (graph_record)

// One group of gemm_q_grouped: C (m, n) = alpha * A (m, k) * B (n, k)^T + beta * C, with A and
// B quantized (the qmats' rows and cols must be (m, k) and (n, k)), as gemm_q.
typedef struct {
    int m, n, k;
    float alpha, beta;
    const struct lb_qmat *a, *b;
    float *c;
    uint16_t *c16;   // NULL, or (beta 0) C stored in bf16 instead, as lb_gemm_args.c16
} lb_gemm_q_args;
// gemm_experts' quantized form as gemm_q_grouped's groups (a calloc'd array of a->e), their
// views of a->qa written to views (e); counts_host as for lb_experts_groups.
lb_gemm_q_args *lb_experts_qgroups(const lb_gemm_experts_args *a, const int *counts_host,
                                   struct lb_qmat *views);

// One layer's KV cache for sampling: the k and v rows of every (sequence slot, kv head,
// position), (slots, hkv, cap, ...) in that order, so the keys one decode query reads are
// contiguous. fp8 = 0, bf16 = 0: k, v are fp32 rows of d. bf16 = 1: bf16 rows of
// lb_kv_ld(c) = d rounded up to 16, zero past d (the bf16-mode attention rounds k and v to
// bf16 before any product, so the cache holds exactly the values it reads, in half the
// bytes; attention_cached takes such a cache in bf16 mode only). fp8 = 1: k, v hold E4M3
// codes, rows of d bytes, and ks, vs their FP32 scales (slots, hkv, cap, nb),
// nb = ceil(d / 128): each (token, head) row quantized as fp8-block activations (1x128 blocks,
// scale amax / 448, doc/formats.md), read back as code * scale.
typedef struct {
    int fp8;
    int slots, cap, hkv, d;
    void *k, *v;                   // backend memory
    float *ks, *vs;                // fp8 only, backend memory
    int bf16;                      // bf16 rows (fp8 = 0 only)
} lb_kv_layer;

// Elements per cache row (see lb_kv_layer) and the row index of (slot, kv head, position).
static inline int lb_kv_ld(const lb_kv_layer *c) { return c->bf16 ? (c->d + 15) / 16 * 16 : c->d; }
static inline size_t lb_kv_row(const lb_kv_layer *c, int slot, int h, int pos)
{
    return ((size_t)slot * c->hkv + h) * c->cap + pos;
}

// Keys per chunk of the bf16-mode attention's online softmax (attention_fwd below): chunks are
// aligned at position 0 whatever the call's size, so a row's arithmetic depends on its
// position alone (batch invariance; the sampler's attention_cached uses the same chunks).
#define LB_ATTN_CHUNK 64

// --- argument structs ---------------------------------------------------------------------------
// The operations of many parameters take one struct, shared by an operation's forward and
// backward (lb_gemm_args, lb_sample_args likewise): a caller names each field (designated
// initializers), and the fields an operation does not read are left zero. Shapes as (rows, cols).

// rmsnorm_fwd, rmsnorm_bwd: out = x / sqrt(mean(x^2) + eps) * w, row by row.
typedef struct {
    int n, c;
    const float *x, *w;    // x (n, c); w (c)
    float *rstd;           // (n): written by the forward, read by the backward
    float *out;            // forward: (n, c)
    float eps;             // forward
    // forward: res NULL, or (n, c) added first: the rows normalised are x + res, one fp32 add
    // each (add()'s bits), stored in sum (n, c; may be x itself), so that a residual add and
    // the norm after it are one pass. sum is NULL where res is.
    const float *res;
    float *sum;
    // forward: out16 NULL, or out rounded to bf16 as to_bf16 writes it, (n, pad8(c)): the next
    // GEMM's operand (lb_gemm_args.a16), written while the value is at hand. With out16, out
    // may be NULL (not written): where only bf16 GEMMs read the norm's output.
    uint16_t *out16;
    // forward and backward: x16 NULL, or x in bf16 (n, pad8(c)), to_bf16's layout, read instead
    // of x (x may then be NULL), each value widened exactly: a residual stream stored in bf16
    // (lb_layer_plan.residual). Not with res.
    const uint16_t *x16;
    // backward: dx (n, c) = the gradient (rounded to fp32) + dx_beta dx, dx not read when
    // dx_beta is 0 (1: a residual's gradient added in place, the same bits as add() after it);
    // dw (c) accumulated
    const float *dout;     // (n, c)
    float *dx, *dw;
    float dx_beta;
} lb_rmsnorm_args;

// rope: RoPE in the rotate-half form (as Hugging Face Llama/Qwen), in place on x (n, heads, d).
// pos (n) token positions. The first rot values of each head rotate (rot 0: all d; partial
// rotary, as GLM-4 and NeoX, rotates fewer), pairs (i, i + rot/2), and the others pass through.
// Frequency i < rot/2: inv_freq[i] (rot/2 doubles in backend memory, e.g. llama3-scaled ones
// from lb_rope_inv_freq_llama3), or theta^(-2i/rot) where inv_freq is NULL. inverse 1: the
// inverse rotation (the transpose of the forward map), which is the backward of the forward on
// dx.
typedef struct {
    float *x;
    const int32_t *pos;
    int n, heads, d;
    float theta;
    int inverse;
    int rot;
    const double *inv_freq;
    // forward only (inverse 0): src NULL, or x is first rmsnorm_fwd of src (n heads rows of d;
    // weight nw (d), eps), rstd (n heads) written, then rotated: the q/k norm and RoPE in one
    // call, the bits of the two calls
    const float *src, *nw;
    float *rstd;
    float eps;
    // forward only: src16 NULL, or src in bf16, read instead of src (each value widened
    // exactly): q or k as their projection stored them in bf16 (lb_layer_plan.qk_in); rows of
    // d (a multiple of 8), no padding.
    const uint16_t *src16;
    // forward only: out16 NULL, or where the result goes instead, rounded to bf16 (n, heads, d)
    // with no padding: the bf16-mode attention's q or k (lb_attention_args.q16), which it rounds
    // to bf16 anyway. x is then only read (the input where src is NULL), or not at all (src).
    uint16_t *out16;
} lb_rope_args;

// attention_fwd, attention_bwd (the numerics: the struct's entries below).
// q, out (b, t, hq, d); k, v (b, t, hkv, d); hq a multiple of hkv; lse (b, hq, t) written by the
// forward and read by the backward; the backward overwrites dq (b, t, hq, d), dk, dv
// (b, t, hkv, d) from dout (b, t, hq, d) and reads out. bf16: the numerics mode (0 fp32, 1 bf16).
typedef struct {
    int b, t, hq, hkv, d;
    int bf16;
    const float *q, *k, *v;
    float *out, *lse;
    const float *dout;     // backward
    float *dq, *dk, *dv;   // backward
    // bf16 mode only: each NULL, or that input already in bf16 (the same layout, no padding),
    // read instead of the fp32 one, which may then be NULL. The mode rounds q, k and v to bf16
    // before any product, so a copy holding exactly those values gives the same bits: stored
    // activations of half the bytes, and no rounding pass in the call.
    const uint16_t *q16, *k16, *v16;
    // bf16 mode only: NULL, or the output in bf16 instead of out (the same layout, no padding;
    // out may then be NULL): the forward writes each out_i rounded to bf16 (nearest even), the
    // backward reads it for D_i = dout_i.out_i. Where the next GEMM (the o projection) reads
    // its input in bf16, the stored output takes half the bytes and no rounding pass.
    uint16_t *out16;
} lb_attention_args;

// swiglu_fwd, swiglu_bwd on a fused gate/up row: out = silu(gate) * up.
// An output named ..16 is NULL, or gets the output rounded to bf16 as to_bf16 writes it (rows
// padded to a multiple of 8 elements with zeros): the next GEMM's operand, written while the
// value is at hand (lb_gemm_args.a16, .b16) instead of by a pass of its own. With a copy, the
// fp32 output may be NULL (not written) where only GEMMs read it. An input named ..16 is NULL,
// or the input in bf16 in that layout (a GEMM's c16: an expert GEMM's output stored in bf16),
// read instead of the fp32 one, which may be NULL.
typedef struct {
    int n, f;
    const float *gu;          // (n, 2f): gate in columns [0, f), up in [f, 2f)
    const uint16_t *gu16;     // (n, pad8(2f))
    float *out;               // forward: (n, f)
    uint16_t *out16;          // forward: (n, pad8(f))
    const float *dout;        // backward: (n, f)
    const uint16_t *dout16;   // backward: (n, pad8(f))
    float *dgu;               // backward: (n, 2f) overwritten
    uint16_t *dgu16;          // backward: (n, pad8(2f))
    // NULL, or (n) a weight per row (an MoE row's routing weight, applied before the down
    // GEMM): the forward's output is silu(gate) * up * rw[i] (each product rounded to fp32 in
    // that order), and the backward's dout is the gradient of that output: dgu from rw[i] *
    // dout, and drw (n; NULL: not written) = sum over j of dout[i][j] * silu(gate) * up, in
    // double and left there (a row's columns may be split over ranks: the caller adds the
    // parts, then rounds, f64_to_f32).
    const float *rw;
    double *drw;
} lb_swiglu_args;

// router_topk_fwd, router_topk_bwd: the MoE router, fp32 softmax over e experts, top-k,
// renormalised over the k choices when renorm is 1. logits, probs (n, e); idx, weight (n, k).
// Ties go to the lower expert index; the k choices are ordered by decreasing probability.
typedef struct {
    int n, e, k, renorm;
    const float *logits;         // forward
    float *probs;                // written by the forward, read by the backward
    int32_t *idx;                // written by the forward, read by the backward
    float *weight;               // forward
    // backward: dlogits (n, e) overwritten, from dweight (n, k) and, if dprobs_expert is not
    // NULL, an extra gradient on every probs[i][j] of dprobs_expert[j] (the load-balancing loss)
    const float *dweight, *dprobs_expert;
    float *dlogits;
} lb_router_args;

// router_sigmoid_fwd, router_sigmoid_bwd: the DeepSeek-V3 / GLM-4.5 MoE router (transformers'
// Glm4MoeTopkRouter). scores = sigmoid(logits) (n, e); the choice ranks scores + bias (bias (e),
// backend memory, NULL = 0; it selects only and gets no gradient): the e experts form n_group
// groups of e / n_group, a group scores the sum of its two best choice scores, the topk_group
// best groups stay, and the k best experts of those are chosen, idx (n, k) in decreasing
// choice order (ties to the lower index). weight (n, k) = the chosen scores, divided by their
// sum + 1e-20 when renorm, times scale (routed_scaling_factor). The backward overwrites
// dlogits (n, e) from dweight (n, k) (zero off the chosen experts). n_group <= 64 divides e,
// topk_group * e / n_group >= k. kernels/router.h holds the row's arithmetic.
typedef struct {
    int n, e, k, n_group, topk_group, renorm;
    float scale;
    const float *logits, *bias;  // forward
    float *scores;               // written by the forward, read by the backward
    int32_t *idx;                // written by the forward, read by the backward
    float *weight;               // forward
    const float *dweight;        // backward
    float *dlogits;
} lb_router_sigmoid_args;

// moe_combine, moe_combine_bwd: out (n, c) = sum over s in order of weight[i][s] *
// yp[row[i][s]], with row (n, k) moe_plan's and yp (n*k, c) the experts' outputs. yp16: NULL,
// or yp in bf16 (n*k, pad8(c)), read instead (as lb_swiglu_args.gu16). weight NULL: every
// weight 1 (the experts' rows weighted already, lb_swiglu_args.rw): the plain sum, the
// backward's dyp the rows of dout, and dweight NULL (with yp and yp16: not read).
typedef struct {
    int n, k, c;
    const int32_t *row;
    const float *weight;
    const float *yp;
    const uint16_t *yp16;
    float *out;              // forward
    // backward: dyp (n*k, c) overwritten, dyp[row[i][s]] = weight[i][s] * dout[i]; dyp16
    // (n*k, pad8(c)) as lb_swiglu_args.out16; dweight (n, k) overwritten: dot(dout[i],
    // yp[row[i][s]])
    const float *dout;
    float *dyp;
    uint16_t *dyp16;
    float *dweight;
} lb_moe_combine_args;

// linear_ce_bwd: the backward of logits (n, v) = x (n, c) w (v, c)^T, a bf16 linear layer (an
// LM head), followed by the cross-entropy: g = cross_entropy_bwd(logits, stats, targets, dloss)
// with the forward's stats (not NULL), then one gemm_grouped call of two bf16 groups,
// dx (n, c) = g w + dx_beta dx and dw (v, c) = g^T x + dw_beta dw: the same bits as those two
// calls. logits are left undefined (the CPU writes g over them; CUDA rounds g to bf16 for the
// GEMMs as it computes it, never storing it in fp32). w16: NULL, or w rounded to bf16 in
// to_bf16's layout (v, pad8(c)), the dgrad's lb_gemm_args.b16. logits16: NULL, or the logits
// in bf16 (n, pad8(v)) instead (cross_entropy_fwd16's; logits then NULL): g from their widened
// values, rounded to bf16 and written over them, and the GEMMs read that (lb_gemm_args.a16):
// the same bits as cross_entropy_bwd on the widened logits, then gemm_grouped.
typedef struct {
    int n, v, c;
    const float *x, *w;
    const uint16_t *w16;
    float *logits;
    uint16_t *logits16;
    const double *stats;
    const int32_t *targets;
    float dloss;
    float *dx, *dw;
    float dx_beta, dw_beta;
} lb_linear_ce_args;

// adamw, adamw16: AdamW with decoupled weight decay and bias correction; step counts from 1.
// p -= lr * (mhat / (sqrt(vhat) + eps) + wd * p) over n parameters. The gradient used is
// g * gscale rounded to fp32 (gradient clipping's factor, 1 for none: bitwise `scale` then
// adamw, without writing g); g is not modified. p16: NULL, or n bf16 values that get the updated
// p rounded as to_bf16 does (a weight cache's copy, written in the same pass: the cache then need
// not read p again). adamw keeps the moments in m, v (fp32); adamw16 in m16, v16 (bf16).
typedef struct {
    float *p;
    const float *g;
    float gscale;
    float *m, *v;            // adamw
    uint16_t *m16, *v16;     // adamw16
    uint16_t *p16;
    size_t n;
    float lr, beta1, beta2, eps, wd;
    int step;
} lb_adamw_args;

// --- the operations -----------------------------------------------------------------------------
// One list, X(return type, name, parameters, arguments), from which the table (struct
// lb_backend), the op enum (lb_op), the names, the check that a backend fills every entry
// (lb_backend_supports), kernels/profile.c's timing wrappers and the test registry
// (tests/test_backend_ops.c) are all generated. A new operation is one line here, one
// implementation per backend and its cases in the test table.
//
// LB_OPS_MEMORY and LB_OPS_CONTROL are each backend's own, filled by its constructor; the
// operations in LB_OPS_COMPUTE are installed by the backend's files. A backend may lack an
// operation: lb_backend_new puts in its place one that stops the program with "backend NAME
// lacks op OP", and lb_backend_supports says so beforehand.
// (Comments in the lists are /* */: each line ends in a backslash.)
#define LB_OPS_MEMORY(X)                                                                      \
    X(void *, alloc, (lb_backend *be, size_t bytes), (be, bytes))                             \
    /* zero-filled; never NULL (exits) */                                                     \
    X(void, free, (lb_backend *be, void *p), (be, p))                                         \
    X(void, upload, (lb_backend *be, void *dst, const void *src_host, size_t bytes),          \
      (be, dst, src_host, bytes))                                                             \
    X(void, download, (lb_backend *be, void *dst_host, const void *src, size_t bytes),        \
      (be, dst_host, src, bytes))                                                             \
    X(void, copy, (lb_backend *be, void *dst, const void *src, size_t bytes),                 \
      (be, dst, src, bytes))                                                                  \
    X(void, zero, (lb_backend *be, void *p, size_t bytes), (be, p, bytes))                    \
    /* Host memory that upload and download move at the link's full speed (CUDA: pinned;     \
       the CPU: alloc's), zero-filled, never NULL (exits); freed by host_free. */             \
    X(void *, host_alloc, (lb_backend *be, size_t bytes), (be, bytes))                        \
    X(void, host_free, (lb_backend *be, void *p), (be, p))

#define LB_OPS_CONTROL(X)                                                                     \
    X(void, sync, (lb_backend *be), (be))   /* wait for queued work */                        \
    /* bytes alloc can still hand out (about; for messages) */                                \
    X(size_t, mem_free, (lb_backend *be), (be))                                               \
    X(void, destroy, (lb_backend *be), (be))                                                  \
    /* Runs fn(arg) as a plain call, then returns a recording of the operations it queues,   \
       replayed by graph_launch as one unit (CUDA graphs; the CPU keeps fn and arg and runs   \
       them again). NULL: nothing recorded (switched off, LB_CUDA_SYNC, or fn waited for the  \
       backend: a download, a sync). The replays repeat the operations with the arguments fn  \
       gave them, so what changes between launches must be in backend memory. */              \
    X(struct lb_graph *, graph_record, (lb_backend *be, void (*fn)(void *), void *arg),       \
      (be, fn, arg))                                                                          \
    /* Queues the recording: 1; 0 (nothing queued) where the backend allocated or freed      \
       memory since it was recorded (CUDA), so its operations may name freed buffers. */      \
    X(int, graph_launch, (lb_backend *be, struct lb_graph *g), (be, g))                       \
    X(void, graph_free, (lb_backend *be, struct lb_graph *g), (be, g))

#define LB_OPS_COMPUTE(X)                                                                     \
    /* --- GEMM ---------------------------------------------------------------------------- */\
    X(void, gemm, (lb_backend *be, const lb_gemm_args *a), (be, a))                           \
    /* Independent GEMMs in one call (all local experts): the CPU loops; CUDA may run groups  \
       at once, so no group's C may overlap another group's operands or C. args is a host     \
       array. Groups with m, n or k == 0 are skipped (k == 0 with beta 0 zeroes C). */        \
    X(void, gemm_grouped, (lb_backend *be, int count, const lb_gemm_args *args),              \
      (be, count, args))                                                                      \
    /* The bf16 fprop of an MoE layer's experts, their rows per expert in backend memory     \
       (lb_gemm_experts_args): no host round trip for the counts (the sampler's decode). */  \
    X(void, gemm_experts, (lb_backend *be, const lb_gemm_experts_args *a), (be, a))           \
                                                                                              \
    /* --- low precision (formats and rules: doc/formats.md) ------------------------------ */\
    /* Lays out q for x (rows, cols) under a and allocates its buffers in backend memory. */  \
    X(void, qmat_alloc, (lb_backend *be, struct lb_qmat *q, int rows, int cols,               \
                         const struct lb_quant_args *a), (be, q, rows, cols, a))              \
    X(void, qmat_free, (lb_backend *be, struct lb_qmat *q), (be, q))                          \
    /* q = the quantization of x (rows, cols), row-wise or column-wise (of x^T) as a says;    \
       bytes and scales identical to the codecs in kernels/quant on every backend. A bf16 x   \
       is quantized from its values as they are (exact in fp32). */                           \
    X(void, quantize, (lb_backend *be, struct lb_qmat *q, lb_act x,                           \
                       const struct lb_quant_args *a), (be, q, x, a))                         \
    /* Groups of rows quantized each on its own in one call (an MoE layer's experts): x_j,    \
       rows [o_j, o_j + rows[j]) of x (at least the sum of rows, cols) with o_j the rows      \
       before it, into q[j] laid out for (prows[j], cols) under a, prows[j] >= rows[j]        \
       (prows NULL: equal): the bytes of quantize of x_j followed by prows[j] - rows[j] zero  \
       rows (column-wise: zero columns, which add nothing to a GEMM over them; the wgrad pads \
       its tokens so).                                                                        \
       Groups with prows[j] == 0 are skipped. With stochastic rounding group j draws as       \
       tensor a->tensor + j; with a->hsigns_groups its Hadamard signs are                     \
       a->hsigns_groups[j]. */                                                                \
    X(void, quantize_grouped, (lb_backend *be, int count, struct lb_qmat *q, lb_act x,       \
                               const int *rows, const int *prows,                             \
                               const struct lb_quant_args *a),                                \
      (be, count, q, x, rows, prows, a))                                                      \
    /* amax = the amaxes behind the NVFP4 second levels (LB_S2_ROW, LB_S2_TENSOR) that       \
       quantize_grouped (count, q, x, rows, prows, a) would make, a->amax not applied:        \
       lb_quant_nscale2 floats per group with prows[j] > 0, group after group, in backend     \
       memory; the kernels/quant codec's lb_quant_amax on every backend (>= 0, NaN above all). \
       The ranks that hold parts of those rows or tensors take the largest and quantize with  \
       it (lb_quant_args.amax). */                                                             \
    X(void, quantize_amax, (lb_backend *be, float *amax, int count, lb_act x,                 \
                            const int *rows, const int *prows,                                \
                            const struct lb_quant_args *a),                                   \
      (be, amax, count, x, rows, prows, a))                                                   \
    /* quantize (qr, the sum of rows of x, ar: row-wise) and quantize_grouped (count, qc, x,  \
       rows, prows, ac: column-wise) of the same x in one call, with those calls'             \
       bytes: a layer's dy feeds its dgrad row-wise and its wgrad column-wise, and a backend  \
       may read x once for both. */                                                           \
    X(void, quantize_rc, (lb_backend *be, struct lb_qmat *qr, const struct lb_quant_args *ar, \
                          int count, struct lb_qmat *qc, lb_act x, const int *rows,           \
                          const int *prows, const struct lb_quant_args *ac),                  \
      (be, qr, ar, count, qc, x, rows, prows, ac))                                            \
    /* dst[j] = the other direction's quantization of the x that src[j] quantizes, from       \
       src[j]'s bytes (lb_qmat_transpose: square blocks, one second level; bytes equal to     \
       quantize's). A weight cache's column-wise copy without a second pass over the fp32     \
       weights. */                                                                            \
    X(void, qmat_transpose, (lb_backend *be, int count, struct lb_qmat *dst,                  \
                             const struct lb_qmat *src), (be, count, dst, src))               \
    /* quantize_grouped (count, qr, x, rows, NULL, a) and then qmat_transpose (count,         \
       qc, qr) in one call, with those calls' bytes (groups with rows[j] == 0 skipped in      \
       both): a weight cache's two copies, and a backend may write the transposed one from    \
       the same pass over the fp32 weights. */                                                \
    X(void, quantize_rt, (lb_backend *be, int count, struct lb_qmat *qr, struct lb_qmat *qc,  \
                          const float *x, const int *rows, int cols,                          \
                          const struct lb_quant_args *a), (be, count, qr, qc, x, rows, cols, a))\
    /* y (q rows, q cols) */                                                                  \
    X(void, dequantize, (lb_backend *be, float *y, const struct lb_qmat *q), (be, y, q))      \
    /* C (m, n) = alpha * A (m, k) * B (n, k)^T + beta * C on quantized operands of one       \
       format, both blocked along k. The CPU computes it exactly on the dequantized values. */\
    X(void, gemm_q, (lb_backend *be, int m, int n, int k, float alpha, const struct lb_qmat *a,\
                     const struct lb_qmat *b, float beta, float *c),                          \
      (be, m, n, k, alpha, a, b, beta, c))                                                    \
    /* Independent gemm_q's in one call (all local experts; formats may differ between        \
       groups). A group's bits never depend on the other groups or on its own m (batch        \
       invariance); they are gemm_q's up to the order of the sums: the CPU loops over gemm_q, \
       CUDA runs the fp8-block groups in one launch of its own kernel (doc/backends.md). No   \
       group's C may overlap another's operands or C. args is a host array; groups with m or  \
       n == 0 are skipped. */                                                                 \
    X(void, gemm_q_grouped, (lb_backend *be, int count, const lb_gemm_q_args *args),          \
      (be, count, args))                                                                      \
    /* Block-diagonal Walsh-Hadamard of size hn along axis (0 rows, 1 cols) of x (rows,       \
       cols). */                                                                              \
    X(void, hadamard, (lb_backend *be, float *y, const float *x, int rows, int cols, int axis,\
                       int hn, uint32_t signs), (be, y, x, rows, cols, axis, hn, signs))      \
    /* y = bf16(x), nearest even */                                                           \
    X(void, round_bf16, (lb_backend *be, float *y, const float *x, size_t n), (be, y, x, n))  \
    /* y (rows, ld) = the bf16 bits of x (rows, cols), rounded as round_bf16, zeros in        \
       columns cols .. ld - 1 (ld a multiple of 8, >= cols): lb_gemm_args.b16's layout. */    \
    X(void, to_bf16, (lb_backend *be, uint16_t *y, const float *x, size_t rows, int cols,     \
                      int ld), (be, y, x, rows, cols, ld))                                    \
                                                                                              \
    /* --- elementwise and reductions ----------------------------------------------------- */\
    X(void, add, (lb_backend *be, float *y, const float *x, size_t n), (be, y, x, n))         \
    /* y += x */                                                                              \
    /* y16 (x.rows, pad8(x.cols)) = bf16(x + r): x fp32 or bf16 (widened exactly), r          \
       (x.rows, x.cols) fp32, one fp32 add rounded once to nearest even, to_bf16's layout     \
       (zeros in the padding). y16 may be x's own bf16 rows. A residual add into a stream     \
       stored in bf16 (lb_layer_plan.residual). */                                            \
    X(void, add16, (lb_backend *be, uint16_t *y16, lb_act x, const float *r), (be, y16, x, r))\
    X(void, scale, (lb_backend *be, float *x, float s, size_t n), (be, x, s, n)) /* x *= s */ \
    /* y = (float)x, rounded to nearest even: sums kept in double until they are whole */    \
    X(void, f64_to_f32, (lb_backend *be, float *y, const double *x, size_t n), (be, y, x, n))  \
    /* sum x^2, in a fixed order */                                                           \
    X(double, sumsq, (lb_backend *be, const float *x, size_t n), (be, x, n))                  \
                                                                                              \
    /* --- embedding ---------------------------------------------------------------------- */\
    /* out (n, c) = wte[tokens[i]] ; wte (vocab, c) */                                        \
    X(void, embedding_fwd, (lb_backend *be, float *out, const int32_t *tokens,                \
                            const float *wte, int n, int c), (be, out, tokens, wte, n, c))    \
    /* dwte (vocab, c) += scatter of dout (n, c) by tokens, tokens summed in index order */   \
    X(void, embedding_bwd, (lb_backend *be, float *dwte, const float *dout,                   \
                            const int32_t *tokens, int n, int c),                             \
      (be, dwte, dout, tokens, n, c))                                                         \
                                                                                              \
    /* --- RMSNorm, RoPE (lb_rmsnorm_args, lb_rope_args) ---------------------------------- */\
    X(void, rmsnorm_fwd, (lb_backend *be, const lb_rmsnorm_args *a), (be, a))                 \
    X(void, rmsnorm_bwd, (lb_backend *be, const lb_rmsnorm_args *a), (be, a))                 \
    X(void, rope, (lb_backend *be, const lb_rope_args *a), (be, a))                           \
                                                                                              \
    /* --- causal grouped-query attention, softmax scale 1/sqrt(d) ------------------------ */\
    /* Two numerics modes, chosen per call by `bf16` (the contract's precision.attention; the \
       trainer's forward and backward and the sampler pass the same value):                   \
       - bf16 = 0 (fp32): scores, softmax and products in fp32 or better (CPU: double sums).  \
       - bf16 = 1: FlashAttention's numerics on tensor cores, mirrored exactly on the CPU.    \
         q, k, v (and dout) are rounded to bf16 (nearest even) before any product; products  \
         are summed in fp32 or better (CPU: double, then one rounding to float). With         \
         c = (float)(log2(e) / sqrt(d)) (formed in double, rounded once) and                  \
         s_ij = bf16(q_i).bf16(k_j) as a float:                                               \
           x_ij = s_ij * c (a float multiply, never fused), keys j <= i only (causal).        \
         Forward of row i: m = -inf, l = 0, acc = 0; for each chunk of LB_ATTN_CHUNK keys     \
         aligned at position 0: m' = max(m, max_j x_ij); alpha = exp2f(m - m');               \
         p_ij = exp2f(x_ij - m'); l = l * alpha + (float)sum_j p_ij;                          \
         acc = acc * alpha + (float)sum_j bf16(p_ij) bf16(v_j); m = m' (float operations,     \
         each rounded on its own: no fused multiply-add).                                     \
         out_i = acc / l; lse_i = (m + log2f(l)) * (float)ln(2) (natural log units).          \
         Backward: lse2_i = lse_i * (float)log2(e); p_ij = exp2f(x_ij - lse2_i);              \
         dp_ij = bf16(dout_i).bf16(v_j); D_i = dout_i.out_i (dout unrounded, out as stored:   \
         out16's values where given; as a float);                                             \
         ds_ij = p_ij * (dp_ij - D_i) (floats); dv_j = sum bf16(p_ij) bf16(dout_i);           \
         dk_j = scale sum bf16(ds_ij) bf16(q_i); dq_i = scale sum_j bf16(ds_ij) bf16(k_j).    \
         exp2f is each backend's own 2^x (glibc's on the CPU; the CUDA kernels' hardware      \
         unit, results below 2^-126 flushed to 0), so backends agree within rounding, not     \
         bits. The CUDA backend supports d <= 128 in this mode.                               \
       Shapes: lb_attention_args. */                                                          \
    X(void, attention_fwd, (lb_backend *be, const lb_attention_args *a), (be, a))             \
    X(void, attention_bwd, (lb_backend *be, const lb_attention_args *a), (be, a))             \
                                                                                              \
    /* --- attention over a KV cache: sampling's prefill and decode in one call ----------- */\
    /* Writes the k and v rows (n, hkv, d) of n new tokens into the cache at (slot[i],        \
       pos[i]). An fp8 cache copies instead the codes and scales of kq and vq, the row-wise   \
       fp8-block quantizations of k and v viewed as (n * hkv, d) (k and v are then not        \
       read); a bf16 cache stores k and v rounded to bf16 (to nearest even, as to_bf16),      \
       zeros past d. slot, pos (n) are backend int32 arrays; slot in [0, slots), pos in       \
       [0, cap). */                                                                           \
    X(void, kv_append, (lb_backend *be, const lb_kv_layer *c, const float *k, const float *v, \
                        const struct lb_qmat *kq, const struct lb_qmat *vq,                   \
                        const int32_t *slot, const int32_t *pos, int n),                      \
      (be, c, k, v, kq, vq, slot, pos, n))                                                    \
    /* out (n, hq, d): query row i of q (n, hq, d) attends to positions 0..pos[i] of slot[i]  \
       (appended earlier, or by this step's kv_append). A row's arithmetic, key order and     \
       roundings are exactly attention_fwd's for query position pos[i] of a sequence with     \
       those keys, in the same mode (bf16: cache values, fp32 rows or fp8 codes times their   \
       scales, are rounded to bf16 as attention_fwd rounds k and v; bf16 rows are read as    \
       they are, in this mode only), so sampling reproduces training bit for bit (batch       \
       invariance). */                                                                        \
    X(void, attention_cached, (lb_backend *be, float *out, const float *q,                    \
                               const lb_kv_layer *c, const int32_t *slot, const int32_t *pos, \
                               int n, int hq, int bf16), (be, out, q, c, slot, pos, n, hq, bf16))\
                                                                                              \
    /* --- SwiGLU (lb_swiglu_args) -------------------------------------------------------- */\
    X(void, swiglu_fwd, (lb_backend *be, const lb_swiglu_args *a), (be, a))                   \
    X(void, swiglu_bwd, (lb_backend *be, const lb_swiglu_args *a), (be, a))                   \
                                                                                              \
    /* --- MoE router (lb_router_args) ---------------------------------------------------- */\
    X(void, router_topk_fwd, (lb_backend *be, const lb_router_args *a), (be, a))              \
    X(void, router_topk_bwd, (lb_backend *be, const lb_router_args *a), (be, a))              \
    X(void, router_sigmoid_fwd, (lb_backend *be, const lb_router_sigmoid_args *a), (be, a))   \
    X(void, router_sigmoid_bwd, (lb_backend *be, const lb_router_sigmoid_args *a), (be, a))   \
    /* The aux-loss-free balancing of DeepSeek-V3 after a step: bias[j] += rate *             \
       sign(mean(load) - load[j]), load (e) the tokens each expert received (summed over     \
       the step's micro-batches and ranks by the caller), bias and load backend memory. */    \
    X(void, router_bias_update, (lb_backend *be, float *bias, const float *load, int e,       \
                                 float rate), (be, bias, load, e, rate))                      \
    /* Switch load-balancing loss of one layer: loss = e * sum_j f_j * P_j, with f_j the      \
       share of the n*k assignments that chose expert j and P_j the mean of probs[:, j].      \
       Writes the loss to *loss (host) and d loss / d probs[i][j] = e * f_j / n to            \
       dprobs_expert (e). */                                                                  \
    X(void, moe_aux_loss, (lb_backend *be, float *loss, float *dprobs_expert,                 \
                           const float *probs, const int32_t *idx, int n, int e, int k),      \
      (be, loss, dprobs_expert, probs, idx, n, e, k))                                         \
                                                                                              \
    /* --- MoE token dispatch on one rank ------------------------------------------------- */\
    /* Plan: rows sorted by expert, then by token, then by slot. row (n, k) gets the row of   \
       assignment (i, s) in the permuted buffer; counts_host (e), a HOST array, and counts    \
       (e), backend memory, the rows per expert; either may be NULL (without counts_host the \
       call need not wait for the device: gemm_experts reads counts). */                    \
    X(void, moe_plan, (lb_backend *be, int32_t *row, int *counts_host, int *counts,          \
                       const int32_t *idx, int n, int e, int k),                              \
      (be, row, counts_host, counts, idx, n, e, k))                                           \
    /* xp (n*k, c): xp[row[i][s]] = x[i], x (n, c) = (x.rows, x.cols) fp32 or bf16 rows (a   \
       bf16 row widened exactly); xp16 (n*k, pad8(c)) as lb_swiglu_args.out16 (a bf16 row    \
       copied as it is). Either output may be NULL. */                                        \
    X(void, moe_permute, (lb_backend *be, float *xp, uint16_t *xp16, lb_act x,                \
                          const int32_t *row, int k), (be, xp, xp16, x, row, k))              \
    /* dx (n, c) = sum over s of dxp[row[i][s]], s in order. dxp16 (n*k, pad8(c)): NULL, or   \
       the input in bf16, read instead (as lb_swiglu_args.gu16). */                           \
    X(void, moe_permute_bwd, (lb_backend *be, float *dx, const float *dxp,                    \
                              const uint16_t *dxp16, const int32_t *row, int n, int k, int c),\
      (be, dx, dxp, dxp16, row, n, k, c))                                                     \
    X(void, moe_combine, (lb_backend *be, const lb_moe_combine_args *a), (be, a))             \
    X(void, moe_combine_bwd, (lb_backend *be, const lb_moe_combine_args *a), (be, a))         \
                                                                                              \
    /* --- cross-entropy over fp32 logits ------------------------------------------------- */\
    /* logits (n, v); targets (n), a negative target is ignored (loss 0, gradient 0).         \
       loss (n) per-token losses. stats (n, 2), or NULL: row i's max and                      \
       sum_j exp(l_ij - max) (in double), the softmax statistics the backward would compute   \
       again (rows with a negative target are left unset). */                                 \
    X(void, cross_entropy_fwd, (lb_backend *be, float *loss, double *stats,                   \
                                const float *logits, const int32_t *targets, int n, int v),   \
      (be, loss, stats, logits, targets, n, v))                                               \
    /* The same over bf16 logits (n, pad8(v)), to_bf16's layout (a GEMM's c16: an LM head     \
       whose passes are all bf16 stores its logits so), each widened exactly: the results of  \
       cross_entropy_fwd on the widened values. */                                            \
    X(void, cross_entropy_fwd16, (lb_backend *be, float *loss, double *stats,                 \
                                  const uint16_t *logits16, const int32_t *targets, int n,    \
                                  int v), (be, loss, stats, logits16, targets, n, v))         \
    /* dlogits (n, v) = dloss * (softmax(logits) - onehot(target)); may alias logits. stats:  \
       the forward's for these same logits (the backward then reads each row once, not        \
       twice; the result is the same bits), or NULL. */                                       \
    X(void, cross_entropy_bwd, (lb_backend *be, float *dlogits, const float *logits,          \
                                const double *stats, const int32_t *targets, float dloss,     \
                                int n, int v), (be, dlogits, logits, stats, targets, dloss, n, v))\
    /* The same with a weight per row: dlogits_i = dloss[i] * (softmax(logits_i) - onehot);   \
       dloss (n) backend memory (GRPO's d loss / d logprob reaches the logits through it).    \
       Row arithmetic identical to cross_entropy_bwd's; may alias logits. */                  \
    X(void, cross_entropy_bwd_rows, (lb_backend *be, float *dlogits, const float *logits,     \
                                     const double *stats, const int32_t *targets,             \
                                     const float *dloss, int n, int v),                       \
      (be, dlogits, logits, stats, targets, dloss, n, v))                                     \
    X(void, linear_ce_bwd, (lb_backend *be, const lb_linear_ce_args *a), (be, a))             \
                                                                                              \
    /* --- sampling ----------------------------------------------------------------------- */\
    /* token (n) and done (n) of the rows of a->logits, drawn as lb_sample_args says. */      \
    X(void, sample, (lb_backend *be, const lb_sample_args *a), (be, a))                       \
                                                                                              \
    /* --- optimizer (lb_adamw_args) ------------------------------------------------------ */\
    X(void, adamw, (lb_backend *be, const lb_adamw_args *a), (be, a))                         \
    /* adamw with the moments stored in bf16 (DeepSeek-V3's optimizer state: 4 bytes a       \
       parameter fewer to read and write each step): m16 and v16 are widened to fp32,         \
       updated as adamw updates m and v, and stored rounded to nearest even; the parameter's  \
       update uses the fp32 values before that rounding. So p (and p16) get exactly what      \
       adamw gives for moments equal to the widened ones, and m16, v16 the rounding of        \
       adamw's m and v. */                                                                    \
    X(void, adamw16, (lb_backend *be, const lb_adamw_args *a), (be, a))

#define LB_OPS(X) LB_OPS_MEMORY(X) LB_OPS_CONTROL(X) LB_OPS_COMPUTE(X)

// LB_OP_gemm, ...: an operation's number, in the list's order.
typedef enum {
#define LB_OP_ENUM(ret, name, params, args) LB_OP_##name,
    LB_OPS(LB_OP_ENUM)
#undef LB_OP_ENUM
    LB_OP_COUNT
} lb_op;

struct lb_backend {
    const char *name;   // "cpu", "cuda"
    char device[128];   // the device in words, for provenance ("NVIDIA H100 80GB HBM3, device 0")
    void *ctx;          // backend-private state
    // 1 = every operation bitwise reproducible and batch invariant (the default); 0 lets a
    // backend use faster library paths that are not (the CPU's GEMM then calls OpenBLAS).
    int deterministic;
    // The table: one function pointer per operation of LB_OPS.
#define LB_OP_ENTRY(ret, name, params, args) ret (*name) params;
    LB_OPS(LB_OP_ENTRY)
#undef LB_OP_ENTRY
};

// The operation's name ("gemm"); NULL outside [0, LB_OP_COUNT).
const char *lb_op_name(lb_op op);
// A new backend (name, ctx, deterministic 1) for a backend's constructor: init[0 .. n) fill
// the table, in order; in every entry they leave empty goes an operation that stops the
// program with "backend NAME lacks op OP" (instead of a crash on a NULL pointer).
lb_backend *lb_backend_new(const char *name, void *ctx, void (*const *init)(lb_backend *),
                           int n);
// 1 when the backend implements op; 0 when it lacks it (the entry lb_backend_new filled).
int lb_backend_supports(const lb_backend *be, lb_op op);

// Backends. Each returns NULL with a message in err (size errlen) when not available here.
lb_backend *lb_backend_cpu_create(int threads, char *err, size_t errlen);
lb_backend *lb_backend_cuda_create(int device, char *err, size_t errlen);
// A backend that forwards every operation to `in` between two syncs and adds up the time per
// operation (kernels/profile.c); destroying it prints the table to stderr and destroys `in`.
lb_backend *lb_backend_profiled(lb_backend *in);

// Helpers built on the table.
static inline void lb_gemm(lb_backend *be, int transa, int transb, int m, int n, int k,
                           float alpha, const float *a, const float *b, float beta, float *c)
{
    lb_gemm_args g = {transa, transb, m, n, k, alpha, beta, a, b, c, 0, NULL, NULL, NULL};
    be->gemm(be, &g);
}

// lb_gemm of the operands rounded to bf16 (lb_gemm_args.bf16).
static inline void lb_gemm_bf16(lb_backend *be, int transa, int transb, int m, int n, int k,
                                float alpha, const float *a, const float *b, float beta, float *c)
{
    lb_gemm_args g = {transa, transb, m, n, k, alpha, beta, a, b, c, 1, NULL, NULL, NULL};
    be->gemm(be, &g);
}

// The same with b's bf16 copy (lb_gemm_args.b16; NULL: none).
static inline void lb_gemm_bf16_b16(lb_backend *be, int transa, int transb, int m, int n, int k,
                                    float alpha, const float *a, const float *b,
                                    const uint16_t *b16, float beta, float *c)
{
    lb_gemm_args g = {transa, transb, m, n, k, alpha, beta, a, b, c, 1, b16, NULL, NULL};
    be->gemm(be, &g);
}

#endif
