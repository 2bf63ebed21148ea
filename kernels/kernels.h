// kernels.h: the kernel set, lowbit's one compute interface.
//
// A backend is a table of operations (as ggml's backend interface). kernels/cpu fills it with
// the reference (C11 + OpenBLAS, fp32); kernels/cuda fills it for NVIDIA GPUs. The trainer's
// forward and backward and the sampler call only this table.
//
// Conventions for every operation:
// - Buffers live in the backend's memory (alloc/upload/download); matrices are row-major and
//   contiguous. Shapes are given in comments as (rows, cols).
// - Activation buffers are fp32. Integer buffers (tokens, expert indices) are int32.
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
    // again, as stored activations are (DESIGN.md). The value is C's fp32 result rounded
    // once, so the CPU rounds where the GPU stores.
    uint16_t *c16;
} lb_gemm_args;

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

// One group of gemm_q_grouped: C (m, n) = alpha * A (m, k) * B (n, k)^T + beta * C, with A and
// B quantized (the qmats' rows and cols must be (m, k) and (n, k)), as gemm_q.
typedef struct {
    int m, n, k;
    float alpha, beta;
    const struct lb_qmat *a, *b;
    float *c;
    uint16_t *c16;   // NULL, or (beta 0) C stored in bf16 instead, as lb_gemm_args.c16
} lb_gemm_q_args;

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

struct lb_backend {
    const char *name;   // "cpu", "cuda"
    void *ctx;          // backend-private state
    // 1 = every operation bitwise reproducible and batch invariant (the default); 0 lets a
    // backend use faster library paths that are not (the CPU's GEMM then calls OpenBLAS).
    int deterministic;

    // --- memory ---------------------------------------------------------------------------
    void *(*alloc)(lb_backend *, size_t bytes);               // zero-filled; never NULL (exits)
    void  (*free)(lb_backend *, void *p);
    void  (*upload)(lb_backend *, void *dst, const void *src_host, size_t bytes);
    void  (*download)(lb_backend *, void *dst_host, const void *src, size_t bytes);
    void  (*copy)(lb_backend *, void *dst, const void *src, size_t bytes);
    void  (*zero)(lb_backend *, void *p, size_t bytes);
    void  (*sync)(lb_backend *);                               // wait for queued work
    size_t (*mem_free)(lb_backend *);   // bytes alloc can still hand out (about; for messages)
    void  (*destroy)(lb_backend *);

    // --- GEMM -----------------------------------------------------------------------------
    void (*gemm)(lb_backend *, const lb_gemm_args *);
    // Independent GEMMs in one call (all local experts): the CPU loops; CUDA may run groups at
    // once, so no group's C may overlap another group's operands or C. args is a host array.
    // Groups with m, n or k == 0 are skipped (k == 0 with beta 0 zeroes C).
    void (*gemm_grouped)(lb_backend *, int count, const lb_gemm_args *args);

    // --- low precision (formats and rules: doc/formats.md) ------------------------------------
    // Lays out q for x (rows, cols) under a and allocates its buffers in backend memory.
    void (*qmat_alloc)(lb_backend *, struct lb_qmat *q, int rows, int cols,
                       const struct lb_quant_args *a);
    void (*qmat_free)(lb_backend *, struct lb_qmat *q);
    // q = the quantization of x (rows, cols), row-wise or column-wise (of x^T) as a says; bytes
    // and scales identical to the codecs in kernels/quant on every backend.
    void (*quantize)(lb_backend *, struct lb_qmat *q, const float *x, int rows, int cols,
                     const struct lb_quant_args *a);
    // Groups of rows quantized each on its own in one call (an MoE layer's experts): x_j, rows
    // [o_j, o_j + rows[j]) of x (sum of rows, cols) with o_j the rows before it, into q[j] laid
    // out for (prows[j], cols) under a, prows[j] >= rows[j] (prows NULL: equal): the bytes of
    // quantize of x_j followed by prows[j] - rows[j] zero rows (column-wise: zero columns,
    // which add nothing to a GEMM over them; the wgrad pads its tokens so). Groups with
    // prows[j] == 0 are skipped. With stochastic rounding group j draws as tensor a->tensor + j;
    // with a->hsigns_groups its Hadamard signs are a->hsigns_groups[j].
    void (*quantize_grouped)(lb_backend *, int count, struct lb_qmat *q, const float *x,
                             const int *rows, const int *prows, int cols,
                             const struct lb_quant_args *a);
    // quantize (qr, x, sum of rows, cols, ar: row-wise) and quantize_grouped (count, qc, x,
    // rows, prows, cols, ac: column-wise) of the same x in one call, with those calls' bytes: a
    // layer's dy feeds its dgrad row-wise and its wgrad column-wise, and a backend may read x
    // once for both.
    void (*quantize_rc)(lb_backend *, struct lb_qmat *qr, const struct lb_quant_args *ar,
                        int count, struct lb_qmat *qc, const float *x, const int *rows,
                        const int *prows, int cols, const struct lb_quant_args *ac);
    // dst[j] = the other direction's quantization of the x that src[j] quantizes, from src[j]'s
    // bytes (lb_qmat_transpose: square blocks, one second level; bytes equal to quantize's).
    // A weight cache's column-wise copy without a second pass over the fp32 weights.
    void (*qmat_transpose)(lb_backend *, int count, struct lb_qmat *dst,
                           const struct lb_qmat *src);
    // quantize_grouped (count, qr, x, rows, NULL, cols, a) and then qmat_transpose (count, qc,
    // qr) in one call, with those calls' bytes (groups with rows[j] == 0 skipped in both): a
    // weight cache's two copies, and a backend may write the transposed one from the same pass
    // over the fp32 weights.
    void (*quantize_rt)(lb_backend *, int count, struct lb_qmat *qr, struct lb_qmat *qc,
                        const float *x, const int *rows, int cols,
                        const struct lb_quant_args *a);
    void (*dequantize)(lb_backend *, float *y, const struct lb_qmat *q);   // y (q rows, q cols)
    // C (m, n) = alpha * A (m, k) * B (n, k)^T + beta * C on quantized operands of one format,
    // both blocked along k. The CPU computes it exactly on the dequantized values.
    void (*gemm_q)(lb_backend *, int m, int n, int k, float alpha, const struct lb_qmat *a,
                   const struct lb_qmat *b, float beta, float *c);
    // Independent gemm_q's in one call (all local experts; formats may differ between groups).
    // A group's bits never depend on the other groups or on its own m (batch invariance); they
    // are gemm_q's up to the order of the sums: the CPU loops over gemm_q, CUDA runs the
    // fp8-block groups in one launch of its own kernel (doc/backends.md). No group's C may
    // overlap another's operands or C. args is a host array; groups with m or n == 0 are
    // skipped.
    void (*gemm_q_grouped)(lb_backend *, int count, const lb_gemm_q_args *args);
    // Block-diagonal Walsh-Hadamard of size hn along axis (0 rows, 1 cols) of x (rows, cols).
    void (*hadamard)(lb_backend *, float *y, const float *x, int rows, int cols, int axis,
                     int hn, uint32_t signs);
    void (*round_bf16)(lb_backend *, float *y, const float *x, size_t n);  // y = bf16(x), RNE
    // y (rows, ld) = the bf16 bits of x (rows, cols), rounded as round_bf16, zeros in columns
    // cols .. ld - 1 (ld a multiple of 8, >= cols): lb_gemm_args.b16's layout.
    void (*to_bf16)(lb_backend *, uint16_t *y, const float *x, size_t rows, int cols, int ld);

    // --- elementwise and reductions ---------------------------------------------------------
    void   (*add)(lb_backend *, float *y, const float *x, size_t n);        // y += x
    void   (*scale)(lb_backend *, float *x, float s, size_t n);            // x *= s
    double (*sumsq)(lb_backend *, const float *x, size_t n);               // sum x^2, fixed order

    // --- embedding ---------------------------------------------------------------------------
    // out (n, c) = wte[tokens[i]] ; wte (vocab, c)
    void (*embedding_fwd)(lb_backend *, float *out, const int32_t *tokens, const float *wte,
                          int n, int c);
    // dwte (vocab, c) += scatter of dout (n, c) by tokens, tokens summed in index order
    void (*embedding_bwd)(lb_backend *, float *dwte, const float *dout, const int32_t *tokens,
                          int n, int c);

    // --- RMSNorm: out = x / sqrt(mean(x^2) + eps) * w -----------------------------------------
    // x, out (n, c); w (c); rstd (n) saved for backward
    void (*rmsnorm_fwd)(lb_backend *, float *out, float *rstd, const float *x, const float *w,
                        int n, int c, float eps);
    // dx (n, c) = the gradient (rounded to fp32) + dx_beta dx, dx not read when dx_beta is 0
    // (1: a residual's gradient added in place, the same bits as add() after it); dw (c)
    // accumulated
    void (*rmsnorm_bwd)(lb_backend *, float *dx, float dx_beta, float *dw, const float *dout,
                        const float *x, const float *w, const float *rstd, int n, int c);

    // --- RoPE (rotate-half form, as Hugging Face Llama/Qwen), in place --------------------------
    // x (n, heads, d); pos (n) token positions; frequency i = theta^(-2i/d), i < d/2
    void (*rope_fwd)(lb_backend *, float *x, const int32_t *pos, int n, int heads, int d,
                     float theta);
    // dx in place: the inverse rotation (the transpose of the forward map)
    void (*rope_bwd)(lb_backend *, float *dx, const int32_t *pos, int n, int heads, int d,
                     float theta);

    // --- causal grouped-query attention, softmax scale 1/sqrt(d) ------------------------------
    // Two numerics modes, chosen per call by `bf16` (the contract's precision.attention; the
    // trainer's forward and backward and the sampler pass the same value):
    // - bf16 = 0 (fp32): scores, softmax and products in fp32 or better (CPU: double sums).
    // - bf16 = 1: FlashAttention's numerics on tensor cores, mirrored exactly on the CPU. q, k,
    //   v (and dout) are rounded to bf16 (nearest even) before any product; products are summed
    //   in fp32 or better (CPU: double, then one rounding to float). With c = (float)(log2(e) /
    //   sqrt(d)) (formed in double, rounded once) and s_ij = bf16(q_i).bf16(k_j) as a float:
    //     x_ij = s_ij * c (a float multiply, never fused), keys j <= i only (causal).
    //   Forward of row i: m = -inf, l = 0, acc = 0; for each chunk of LB_ATTN_CHUNK keys
    //   aligned at position 0: m' = max(m, max_j x_ij); alpha = exp2f(m - m');
    //   p_ij = exp2f(x_ij - m'); l = l * alpha + (float)sum_j p_ij;
    //   acc = acc * alpha + (float)sum_j bf16(p_ij) bf16(v_j); m = m' (float operations, each
    //   rounded on its own: no fused multiply-add).
    //   out_i = acc / l; lse_i = (m + log2f(l)) * (float)ln(2) (natural log units).
    //   Backward: lse2_i = lse_i * (float)log2(e); p_ij = exp2f(x_ij - lse2_i);
    //   dp_ij = bf16(dout_i).bf16(v_j); D_i = dout_i.out_i (unrounded, as a float);
    //   ds_ij = p_ij * (dp_ij - D_i) (floats); dv_j = sum bf16(p_ij) bf16(dout_i);
    //   dk_j = scale sum bf16(ds_ij) bf16(q_i); dq_i = scale sum_j bf16(ds_ij) bf16(k_j).
    //   exp2f is each backend's own 2^x (glibc's on the CPU; the CUDA kernels' hardware
    //   unit, results below 2^-126 flushed to 0), so backends agree within rounding, not bits.
    //   The CUDA backend supports d <= 128 in this mode.
    // q, out (b, t, hq, d); k, v (b, t, hkv, d); hq a multiple of hkv; lse (b, hq, t) saved
    void (*attention_fwd)(lb_backend *, float *out, float *lse, const float *q, const float *k,
                          const float *v, int b, int t, int hq, int hkv, int d, int bf16);
    // dq (b, t, hq, d), dk, dv (b, t, hkv, d) overwritten; bf16 as the forward's
    void (*attention_bwd)(lb_backend *, float *dq, float *dk, float *dv, const float *dout,
                          const float *q, const float *k, const float *v, const float *out,
                          const float *lse, int b, int t, int hq, int hkv, int d, int bf16);

    // --- attention over a KV cache: sampling's prefill and decode in one call ----------------
    // Writes the k and v rows (n, hkv, d) of n new tokens into the cache at (slot[i], pos[i]).
    // An fp8 cache copies instead the codes and scales of kq and vq, the row-wise fp8-block
    // quantizations of k and v viewed as (n * hkv, d) (k and v are then not read); a bf16
    // cache stores k and v rounded to bf16 (to nearest even, as to_bf16), zeros past d.
    // slot, pos (n) are backend int32 arrays; slot in [0, slots), pos in [0, cap).
    void (*kv_append)(lb_backend *, const lb_kv_layer *c, const float *k, const float *v,
                      const struct lb_qmat *kq, const struct lb_qmat *vq, const int32_t *slot,
                      const int32_t *pos, int n);
    // out (n, hq, d): query row i of q (n, hq, d) attends to positions 0..pos[i] of slot[i]
    // (appended earlier, or by this step's kv_append). A row's arithmetic, key order and
    // roundings are exactly attention_fwd's for query position pos[i] of a sequence with those
    // keys, in the same mode (bf16: cache values, fp32 rows or fp8 codes times their scales,
    // are rounded to bf16 as attention_fwd rounds k and v), so sampling reproduces training bit
    // for bit (batch invariance).
    void (*attention_cached)(lb_backend *, float *out, const float *q, const lb_kv_layer *c,
                             const int32_t *slot, const int32_t *pos, int n, int hq, int bf16);

    // --- SwiGLU on a fused gate/up row: out = silu(gate) * up ---------------------------------
    // An output named ..16 is NULL, or gets the output rounded to bf16 as to_bf16 writes it
    // (rows padded to a multiple of 8 elements with zeros): the next GEMM's operand, written
    // while the value is at hand (lb_gemm_args.a16, .b16) instead of by a pass of its own.
    // With a copy, the fp32 output may be NULL (not written) where only GEMMs read it.
    // An input named ..16 is NULL, or the input in bf16 in that layout (a GEMM's c16: an
    // expert GEMM's output stored in bf16), read instead of the fp32 one, which may be NULL.
    // gu (n, 2f) holds gate in columns [0, f) and up in [f, 2f); out (n, f), out16 (n, pad8(f)),
    // gu16 (n, pad8(2f))
    void (*swiglu_fwd)(lb_backend *, float *out, uint16_t *out16, const float *gu,
                       const uint16_t *gu16, int n, int f);
    // dgu (n, 2f) overwritten; dgu16 (n, pad8(2f)); dout16 (n, pad8(f))
    void (*swiglu_bwd)(lb_backend *, float *dgu, uint16_t *dgu16, const float *dout,
                       const uint16_t *dout16, const float *gu, const uint16_t *gu16, int n,
                       int f);

    // --- MoE router: fp32 softmax over experts, top-k, optional renormalisation -------------
    // logits, probs (n, e); idx, weight (n, k). Ties go to the lower expert index; the k
    // choices are ordered by decreasing probability.
    void (*router_topk_fwd)(lb_backend *, float *probs, int32_t *idx, float *weight,
                            const float *logits, int n, int e, int k, int renorm);
    // dlogits (n, e) overwritten, from dweight (n, k) and, if dprobs_expert is not NULL, an
    // extra gradient on every probs[i][j] of dprobs_expert[j] (the load-balancing loss).
    void (*router_topk_bwd)(lb_backend *, float *dlogits, const float *dweight,
                            const float *dprobs_expert, const float *probs, const int32_t *idx,
                            int n, int e, int k, int renorm);
    // Switch load-balancing loss of one layer: loss = e * sum_j f_j * P_j, with f_j the share of
    // the n*k assignments that chose expert j and P_j the mean of probs[:, j].
    // Writes the loss to *loss (host) and d loss / d probs[i][j] = e * f_j / n to dprobs_expert (e).
    void (*moe_aux_loss)(lb_backend *, float *loss, float *dprobs_expert, const float *probs,
                         const int32_t *idx, int n, int e, int k);

    // --- MoE token dispatch on one rank --------------------------------------------------------
    // Plan: rows sorted by expert, then by token, then by slot. row (n, k) gets the row of
    // assignment (i, s) in the permuted buffer; counts (e), a HOST array, rows per expert.
    void (*moe_plan)(lb_backend *, int32_t *row, int *counts_host, const int32_t *idx, int n,
                     int e, int k);
    // xp (n*k, c): xp[row[i][s]] = x[i]; xp16 (n*k, pad8(c)) as swiglu_fwd's out16
    void (*moe_permute)(lb_backend *, float *xp, uint16_t *xp16, const float *x,
                        const int32_t *row, int n, int k, int c);
    // dx (n, c) = sum over s of dxp[row[i][s]], s in order. dxp16 (n*k, pad8(c)), yp16
    // below: NULL, or the input in bf16, read instead (as swiglu_fwd's gu16).
    void (*moe_permute_bwd)(lb_backend *, float *dx, const float *dxp, const uint16_t *dxp16,
                            const int32_t *row, int n, int k, int c);
    // out (n, c) = sum over s in order of weight[i][s] * yp[row[i][s]]
    void (*moe_combine)(lb_backend *, float *out, const float *yp, const uint16_t *yp16,
                        const float *weight, const int32_t *row, int n, int k, int c);
    // dyp (n*k, c) overwritten: dyp[row[i][s]] = weight[i][s] * dout[i]; dyp16 (n*k, pad8(c))
    // as swiglu_fwd's out16; dweight (n, k) overwritten: dot(dout[i], yp[row[i][s]])
    void (*moe_combine_bwd)(lb_backend *, float *dyp, uint16_t *dyp16, float *dweight,
                            const float *dout, const float *yp, const uint16_t *yp16,
                            const float *weight, const int32_t *row, int n, int k, int c);

    // --- cross-entropy over fp32 logits ---------------------------------------------------------
    // logits (n, v); targets (n), a negative target is ignored (loss 0, gradient 0).
    // loss (n) per-token losses. stats (n, 2), or NULL: row i's max and sum_j exp(l_ij - max)
    // (in double), the softmax statistics the backward would compute again (rows with a
    // negative target are left unset).
    void (*cross_entropy_fwd)(lb_backend *, float *loss, double *stats, const float *logits,
                              const int32_t *targets, int n, int v);
    // dlogits (n, v) = dloss * (softmax(logits) - onehot(target)); may alias logits. stats:
    // the forward's for these same logits (the backward then reads each row once, not twice;
    // the result is the same bits), or NULL.
    void (*cross_entropy_bwd)(lb_backend *, float *dlogits, const float *logits,
                              const double *stats, const int32_t *targets, float dloss, int n,
                              int v);
    // The same with a weight per row: dlogits_i = dloss[i] * (softmax(logits_i) - onehot);
    // dloss (n) backend memory (GRPO's d loss / d logprob reaches the logits through it).
    // Row arithmetic identical to cross_entropy_bwd's; may alias logits.
    void (*cross_entropy_bwd_rows)(lb_backend *, float *dlogits, const float *logits,
                                   const double *stats, const int32_t *targets,
                                   const float *dloss, int n, int v);
    // The backward of logits (n, v) = x (n, c) w (v, c)^T, a bf16 linear layer (an LM head),
    // followed by the cross-entropy: g = cross_entropy_bwd(logits, stats, targets, dloss) with
    // the forward's stats (not NULL), then one gemm_grouped call of two bf16 groups,
    // dx (n, c) = g w + dx_beta dx and dw (v, c) = g^T x + dw_beta dw: the same bits as those
    // two calls. logits are left undefined (the CPU writes g over them; CUDA rounds g to bf16
    // for the GEMMs as it computes it, never storing it in fp32). w16: NULL, or w rounded to
    // bf16 in to_bf16's layout (v, pad8(c)), the dgrad's lb_gemm_args.b16.
    void (*linear_ce_bwd)(lb_backend *, float *dx, float dx_beta, float *dw, float dw_beta,
                          float *logits, const double *stats, const int32_t *targets,
                          float dloss, const float *x, const float *w, const uint16_t *w16,
                          int n, int v, int c);

    // --- sampling ---------------------------------------------------------------------------
    // token (n) and done (n) of the rows of a->logits, drawn as lb_sample_args says.
    void (*sample)(lb_backend *, const lb_sample_args *a);

    // --- optimizer ------------------------------------------------------------------------------
    // AdamW with decoupled weight decay and bias correction; step counts from 1.
    // p -= lr * (mhat / (sqrt(vhat) + eps) + wd * p). The gradient used is g * gscale rounded
    // to fp32 (gradient clipping's factor, 1 for none: bitwise `scale` then adamw, without
    // writing g); g is not modified. p16: NULL, or n bf16 values that get the updated p
    // rounded as to_bf16 does (a weight cache's copy, written in the same pass: the cache then
    // need not read p again).
    void (*adamw)(lb_backend *, float *p, const float *g, float gscale, float *m, float *v,
                  uint16_t *p16, size_t n, float lr, float beta1, float beta2, float eps,
                  float wd, int step);
    // adamw with the moments stored in bf16 (DeepSeek-V3's optimizer state: 4 bytes a
    // parameter fewer to read and write each step): m16 and v16 are widened to fp32, updated
    // as adamw updates m and v, and stored rounded to nearest even; the parameter's update uses
    // the fp32 values before that rounding. So p (and p16) get exactly what adamw gives for
    // moments equal to the widened ones, and m16, v16 the rounding of adamw's m and v.
    void (*adamw16)(lb_backend *, float *p, const float *g, float gscale, uint16_t *m16,
                    uint16_t *v16, uint16_t *p16, size_t n, float lr, float beta1, float beta2,
                    float eps, float wd, int step);
};

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
