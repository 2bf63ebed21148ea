// linear.h: linear layers under the precision contract. Each GEMM of a linear layer (fprop,
// dgrad, wgrad) asks the contract for its site and runs in that format: FP32, BF16, or a
// block-scaled format through the backend's quantize and gemm_q. Weights are quantized once per
// optimizer step into a weight cache (lb_wcache) that the trainer's forward and the sampler
// both read. A layer computes on the piece of the weight its rank holds: a column- or
// row-parallel layer (Megatron's ColumnParallelLinear, RowParallelLinear) is this layer on the
// piece the model definition cut (lb_split), joined to the other ranks' pieces by the
// collectives of parallel/tensor_parallel.h.
#ifndef LB_LINEAR_H
#define LB_LINEAR_H

#include <stddef.h>
#include <stdint.h>
#include "kernels/kernels.h"
#include "models/precision/contract.h"
#include "kernels/quant/quant.h"
#include "parallel/comm.h"

// The quantized copies of one weight tensor: `count` matrices (out, in) (count = experts).
typedef struct {
    int count, out, in;
    lb_format ffmt, dfmt;          // formats the copies were built for
    lb_qmat *row;                  // (count) fprop: Q(W) row-wise (blocks along in)
    lb_qmat *col;                  // (count) dgrad: Q(W^T) (blocks along out), when quantized
    // (count, out, pad8(in)) W rounded to bf16, when the fprop or the dgrad is a bf16 GEMM on
    // it: lb_gemm_args.b16 of both (W is B (n, k) in the fprop, (k, n) in the dgrad), so the
    // GEMMs do not round W again on every call
    uint16_t *b16;
    // b16 already holds W's present values: written by the optimizer with the update (AdamW's
    // p16, lb_model_b16_written), so the next build skips the rounding pass; the build clears it
    int b16_fresh;
} lb_wcache;

// Grow-only buffers for one quantized operand (backend memory): quantize writes every byte of
// a layout, so reusing them gives the same bits as a fresh lb_qmat, without an allocation (and
// on CUDA a stream wait in qmat_free) per GEMM.
typedef struct {
    uint8_t *data;
    void *scale;
    float *scale2;
    size_t data_n, scale_n, scale2_n;   // capacities in bytes
} lb_qscratch;

#define LB_LINEAR_QSCRATCH 3   // quantized operands live at once (wgrad's two, dgrad's dy)

typedef struct {
    lb_backend *be;
    const lb_contract *contract;
    uint64_t seed, step;           // stochastic rounding and random Hadamard signs
    int expert0;                   // the global index of this rank's first expert (their draws)
    // The expert-tensor-parallel group the experts' weights are cut over (NULL: not cut). An
    // NVFP4 weight's per-tensor second level is then the group's, as one rank computes it over
    // the whole expert (lb_wcache_build).
    lb_comm *etp;
    float *scratch[4];             // grow-only fp32 scratch (backend memory)
    size_t scratch_n[4];           // their capacities in bytes
    // The etp group's amaxes of a cut NVFP4 operand (lb_quant_args.amax; backend memory,
    // grow-only): [0] a row-wise operand's, [1] a column-wise one's (quantize_rc needs both)
    float *amax[2];
    size_t amax_n[2];              // their capacities in bytes
    lb_qscratch qscratch[LB_LINEAR_QSCRATCH];
} lb_linear;

// q laid out for x (rows, cols) under a, its buffers those of L's quantized scratch i (grown as
// needed). Valid until the next call with the same i; work queued earlier that reads the old
// contents stays ordered before any later write (one stream). Not to be freed by the caller.
void lb_linear_qscratch(lb_linear *L, int i, lb_qmat *q, int rows, int cols,
                        const lb_quant_args *a);
// The same for count matrices at once, q[j] laid out for (rows[j], cols) under a (rows[j] == 0:
// q[j] zeroed, no memory), all in scratch i.
void lb_linear_qscratch_groups(lb_linear *L, int i, lb_qmat *q, int count, const int *rows,
                               int cols, const lb_quant_args *a);

// Builds (or rebuilds after an optimizer step) the cache of weight w (count, out, in) used at
// (layer, role). Cheap when every pass is FP32 (nothing is stored).
void lb_wcache_build(lb_linear *L, lb_wcache *c, int layer, lb_role role, const float *w,
                     int count, int out, int in);
void lb_wcache_free(lb_linear *L, lb_wcache *c);
// The backend bytes lb_wcache_build allocates for those matrices under L's contract (its bf16
// copy, row-wise and column-wise quantized copies): what `lowbit info` predicts.
size_t lb_wcache_bytes(const lb_linear *L, int layer, lb_role role, int count, int out, int in);

// The activations these take are lb_acts (kernels.h): x (n, in) in fp32 or bf16, its rows and
// columns the n and in below. A bf16 GEMM reads either (rounding fp32 itself: the same bits);
// a quantized one quantizes x's values as they are; an fp32 one, and a backward that is
// dequantized or in mixed formats, takes fp32 x only. Which one a layer stores is the
// activation plan's choice (models/activations.c), made from the contract: bf16 where every pass
// reads x as bf16 values (lb_linear_plain16) or quantizes it (lb_linear_quantized).

// y (n, out) = x (n, in) W^T + beta * y, for matrix e of the cache (W is w's fp32 master).
void lb_linear_fwd(lb_linear *L, int layer, lb_role role, lb_act x, const float *w,
                   const lb_wcache *c, int e, float *y, int out, float beta);
// dx (n, in) = dy (n, out) W + dx_beta * dx   (skipped when dx is NULL)
// dw (out, in) = dy^T x + dw_beta * dw         (skipped when dw is NULL; dw_beta 0 or 1, and
//                                               0 overwrites dw even when n is 0)
void lb_linear_bwd(lb_linear *L, int layer, lb_role role, lb_act x, const float *w,
                   const lb_wcache *c, int e, const float *dy, float *dx, float dx_beta,
                   float *dw, float dw_beta, int out);
// lb_linear_fwd and lb_linear_bwd for count weights (matrix 0 of each cache) that read the
// same x at one site, the q, k and v projections: y_i (n, out[i]) = x W_i^T; dx (n, in) =
// sum_i dy_i W_i (overwritten, i in order), dw_i = dy_i^T x + dw_beta[i] dw_i. A low-precision
// x is quantized once for all the fprops, and a quantized wgrad's column-wise x once for all
// the wgrads: the site and the operand ids are the same for every i, so are the bytes, and the
// results are those of the separate calls. y16: NULL, or per output NULL or where y_i goes
// instead, rounded to bf16 (n, pad8(out[i])), as lb_linear_fwd_c16 (the site bf16 in every
// pass).
void lb_linear_fwd_shared(lb_linear *L, int layer, lb_role role, lb_act x, int count,
                          const float *const *w, const lb_wcache *const *c, float *const *y,
                          uint16_t *const *y16, const int *out);
void lb_linear_bwd_shared(lb_linear *L, int layer, lb_role role, lb_act x, int count,
                          const float *const *w, const lb_wcache *const *c,
                          const float *const *dy, float *dx, float *const *dw,
                          const float *dw_beta, const int *out);
// The same for an LM head whose logits (n, out) met cross_entropy: dy = dloss (softmax(logits)
// - onehot(targets)) from the forward's row statistics (not NULL), then dx (overwritten) and
// dw, in one backend call that need not store dy (linear_ce_bwd). Only where
// lb_linear_ce_fusable: both backward passes are plain bf16 GEMMs; x fp32. The same bits as
// cross_entropy_bwd and then lb_linear_bwd; the logits are left undefined. c: W's cache (its
// bf16 copy for the dgrad), or NULL. logits16: NULL, or the logits in bf16 instead
// (lb_linear_plain16; logits then NULL), the gradient written over them.
int lb_linear_ce_fusable(const lb_linear *L, int layer, lb_role role);
// Whether every pass of (layer, role) is a plain bf16 GEMM (a bf16 fprop, and both backward
// passes bf16 on the original operands): its input is then only ever read rounded to bf16, so
// it may be stored in bf16 with the same bits.
int lb_linear_plain16(const lb_linear *L, int layer, lb_role role);
// Whether every pass of (layer, role) is a low-precision GEMM on quantized operands (no
// dequantized or high-precision backward): its input is then only ever quantized, so it may be
// stored in bf16 and quantized from those values. The low-precision recipes' layers are so by
// default.
int lb_linear_quantized(const lb_linear *L, int layer, lb_role role);
// Such a layer's fprop y16 (n, pad8(out)) = x W^T rounded once to bf16 (lb_gemm_args.c16).
void lb_linear_fwd_c16(lb_linear *L, int layer, lb_role role, lb_act x, const float *w,
                       const lb_wcache *c, uint16_t *y16, int out);
void lb_linear_ce_bwd(lb_linear *L, int layer, lb_role role, lb_act x, const float *w,
                      const lb_wcache *c, float *logits, uint16_t *logits16, const double *stats,
                      const int32_t *targets, float dloss, float *dx, float *dw, float dw_beta,
                      int out);

// Experts: rows [off_j, off_j + counts[j]) of x use matrix j (counts is a host array; x has
// at least their sum of rows). x in bf16 only where lb_linear_grouped_bf16 says those GEMMs
// are bf16 or lb_linear_quantized that they are quantized in every pass. dy16: NULL, or dy
// rounded to bf16 in to_bf16's layout (rows, pad8(cols)), written by the op that made dy, for
// bf16 GEMMs (dy may then be NULL). y16 (dx16), or NULL: the output stored in bf16 in that
// layout (lb_gemm_args.c16, lb_gemm_q_args.c16) instead of y (dx), which is then not written;
// only where lb_linear_grouped_c16 says the pass's grouped call stores it (bf16 GEMMs, and the
// quantized fprop and dgrad of the low-precision formats).
int lb_linear_grouped_bf16(const lb_linear *L, int layer, lb_role role);
int lb_linear_grouped_c16(const lb_linear *L, int layer, lb_role role, lb_pass pass);
void lb_linear_grouped_fwd(lb_linear *L, int layer, lb_role role, lb_act x, const float *w,
                           const lb_wcache *c, const int *counts, int groups, float *y,
                           uint16_t *y16, int out);
// The fprop of lb_linear_grouped_fwd with the rows per expert in backend memory (counts:
// moe_plan's device copy; x.rows = their sum), so the host never waits for them (the
// sampler's decode forward): the same bits. Only where lb_linear_experts_ok says so: the
// backend has gemm_experts, and the GEMMs are bf16 with c holding the weights' bf16 copy (x
// bf16), or quantized with c's row-wise copies and an activation quantization that one call
// over all rows gives each expert (no stochastic rounding, no per-tensor NVFP4 level).
int lb_linear_experts_ok(const lb_linear *L, int layer, lb_role role, const lb_wcache *c);
void lb_linear_experts_fwd(lb_linear *L, int layer, lb_role role, lb_act x, const lb_wcache *c,
                           const int *counts, int groups, float *y, uint16_t *y16, int out);
// dx (rows, in) overwritten; dw (groups, out, in) = the wgrads + dw_beta * dw (0 or 1; 0
// overwrites the matrices of groups without rows with zeros). segs (groups * nsrc, or NULL):
// group j's rows come in nsrc segments of segs[j * nsrc + s] rows (an expert's rows from each
// expert-parallel source rank, lb_ep_route.seg_counts); a quantized wgrad then quantizes each
// segment as a group of its own, as one rank quantizes that source's micro-batch, so its
// blocks along the tokens do not depend on the layout (doc/parallel.md).
void lb_linear_grouped_bwd(lb_linear *L, int layer, lb_role role, lb_act x, const float *w,
                           const lb_wcache *c, const int *counts, int groups, const int *segs,
                           int nsrc, const float *dy, const uint16_t *dy16, float *dx,
                           uint16_t *dx16, float *dw, float dw_beta, int out);

// Lays out L's quantized scratch as the passes of (layer, role) would for rows split evenly
// over groups (1: a linear layer's call; the experts' count of them, balanced routing), so that
// a step's first GEMMs allocate nothing new and `lowbit info` counts what a step holds.
void lb_linear_qscratch_reserve(lb_linear *L, int layer, lb_role role, int groups, int rows,
                                int out, int in);
// The bytes L's quantized scratch holds.
size_t lb_linear_qscratch_held(const lb_linear *L);

void lb_linear_free(lb_linear *L);

#endif
