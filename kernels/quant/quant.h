// quant.h: the low-precision codecs shared by every backend: element encoders and decoders
// (E4M3, E5M2, E2M1, E8M0, UE4M3), block quantizers (fp8-block, MXFP8, MXFP4, NVFP4) with their
// dequantizers, and the block-diagonal Walsh-Hadamard transform.
//
// doc/formats.md states every rule exactly (rounding, saturation, special values, scale rules,
// layouts); tests/test_quant.c checks them bit for bit against tests/tools/make_quant_golden.py,
// which uses ml_dtypes and numpy, not this code.
//
// Matrices are row-major fp32, shapes given as (rows, cols). Blocks run along cols (the K axis of
// a GEMM operand). Nothing here allocates unless the name says so (lb_qmat_alloc).
#ifndef LB_QUANT_H
#define LB_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/kernels.h"   // lb_format

// --- element types --------------------------------------------------------------------------

typedef enum {
    LB_E4M3 = 0,   // OCP FP8 E4M3 (ml_dtypes float8_e4m3fn): finite only, max 448, 0x7f/0xff NaN
    LB_E5M2,       // OCP FP8 E5M2 (float8_e5m2): IEEE-like, max 57344, Inf 0x7c, NaN 0x7d-0x7f
    LB_E2M1,       // OCP FP4 E2M1 (float4_e2m1fn): max 6, no Inf/NaN; the code is 4 bits
    LB_E8M0,       // OCP scale E8M0 (float8_e8m0fnu): 2^(code-127), 0xff NaN, no zero or sign
    LB_UE4M3,      // unsigned E4M3 (the NVFP4 block scale): E4M3 codes 0x00-0x7f, max 448
} lb_elem;

float lb_elem_max(lb_elem t);                 // largest finite value: 448, 57344, 6, 2^127, 448
const char *lb_elem_name(lb_elem t);          // "e4m3", ...

// Round to nearest, ties to even (E8M0: ties away from zero, as ml_dtypes). With sat = 0,
// overflow behaves as ml_dtypes: Inf where the type has one (E5M2), else NaN (E4M3, UE4M3,
// E8M0); E2M1 has neither and saturates. With sat = 1 finite overflow and +-Inf saturate to
// +-max (CUDA's __NV_SATFINITE); NaN stays NaN in both. The quantizers use sat = 1.
uint8_t lb_encode(lb_elem t, float x, int sat);

// Stochastic rounding, saturating: |x| between neighbours lo < hi of the grid rounds to hi with
// probability (|x| - lo) / (hi - lo), exactly: up iff r * 2^-64 < that fraction. r is one
// lb_rand_u64 draw (see lb_quant_stream). Values already on the grid never move.
uint8_t lb_encode_sr(lb_elem t, float x, uint64_t r);

float lb_decode(lb_elem t, uint8_t code);     // exact; NaN codes give a quiet NaN

// The RNG stream of a (step, tensor) pair: lb_hash64(step) ^ tensor. A quantizer with stochastic
// rounding draws lb_rand_u64(seed, lb_quant_stream(step, tensor), element index).
uint64_t lb_quant_stream(uint64_t step, uint64_t tensor);

// --- block quantizers -------------------------------------------------------------------------

typedef enum {
    LB_SCALE_CEIL = 0,    // MX scale 2^ceil(log2(amax / elem_max)): the block max never clips
    LB_SCALE_FLOOR,       // OCP: 2^(floor(log2(amax)) - emax_elem), the top binade saturates
} lb_scale_rule;

typedef enum {
    LB_S2_TENSOR = 0,     // NVFP4 second level: one FP32 per tensor, amax / (6 * 448)
    LB_S2_ROW,            // one per row of the quantized matrix ("per token"), from that row
    LB_S2_GIVEN,          // taken from lb_quant_args.s2 (fused gate/up share one)
} lb_scale2_mode;

typedef struct lb_quant_args {
    lb_format fmt;            // LB_FMT_FP8_BLOCK, LB_FMT_MXFP8, LB_FMT_MXFP4, LB_FMT_NVFP4,
                              // LB_FMT_FP8_TENSOR
    int colwise;              // 0: row-wise, blocks along cols of x (rows, cols);
                              // 1: column-wise: the quantization of x^T (cols, rows), blocks
                              //    along rows of x, computed from x itself (never re-quantized)
    int weight_blocks;        // square blocks: fp8-block 128x128, NVFP4 16x16 (else 1x128, 1x16)
    lb_elem elem;             // MXFP8 only: LB_E4M3 (default) or LB_E5M2
    lb_scale_rule rule;       // MXFP8, MXFP4
    lb_scale2_mode s2_mode;   // NVFP4
    float s2;                 // NVFP4 with LB_S2_GIVEN: > 0 (NaN allowed: poisons the tensor)
    int sr;                   // stochastic rounding of the elements (scales are always exact)
    int pow2;                 // fp8-block, fp8-tensor: the scale rounded up to a power of two,
                              // 2^ceil(log2(amax / 448)) (precision.scale = pow2), not amax / 448
    uint64_t seed, step, tensor;
    int hadamard;             // column-wise only, 0 or a power of two in [2, 32]: quantize
                              // lb_hadamard(x, LB_AXIS_ROWS, hadamard, hsigns) instead of x
                              // (the wgrad's transform along its token axis, fused into the
                              // quantization; rows, or padded rows, a multiple of hadamard)
    uint32_t hsigns;
    const uint32_t *hsigns_groups;   // quantize_grouped: group j's signs (random signs drawn
                                     // per expert); NULL: hsigns for every group
    // NVFP4 with LB_S2_ROW or LB_S2_TENSOR: NULL, or (backend memory) amaxes of wholes that x
    // holds a part of, one per second level in order (nscale2 of them; quantize_grouped and
    // quantize_rc's column-wise groups: group after group, a skipped group having none): each
    // second level comes from max(its own amax, amax[i]), NaN above every number. The ranks of
    // an expert-tensor-parallel group, each holding some of a token's features, pass the
    // group's largest quantize_amax so every rank takes one rank's second levels.
    const float *amax;
} lb_quant_args;              // zero-initialised: row-wise, 1-D blocks, E4M3, ceil, per tensor,
                              // FP32 scales amax / 448, no transform

// A quantized matrix. rows, cols are the shape of the QUANTIZED matrix: (x rows, x cols)
// row-wise, (x cols, x rows) column-wise; cols is always the blocked (K) axis.
typedef struct lb_qmat {
    lb_format fmt;
    lb_elem elem;             // element type of data
    lb_elem scale_elem;       // E8M0 (MX), UE4M3 (NVFP4); fp8-block scales are FP32
    int rows, cols;
    int brows, bcols;         // block shape: 1x128, 128x128, 1x32, 1x16, 16x16; the whole
                              // (rows, cols) for fp8-tensor
    int srows, scols;         // scale shape: ceil(rows / brows), ceil(cols / bcols)
    size_t ld;                // bytes per row of data: cols, or ceil(cols / 2) for E2M1
    uint8_t *data;            // (rows, ld); E2M1: element 2i in the low nibble of byte i
    void *scale;              // (srows, scols) row-major: float (fp8-block, fp8-tensor) or one
                              // byte each
    float *scale2;            // NVFP4: nscale2 floats (1, or rows with LB_S2_ROW); else NULL
    int nscale2;
    // NULL, or (fp8-block with 1x128 blocks only) (scols, lb_qmat_tscale_ld) the scales
    // transposed, which every backend's quantize then writes beside scale: a GEMM's TMA reads
    // a k block's scales of consecutive rows as one box, and CUDA's fp8 GEMMs read this copy
    // instead of transposing scale in a launch of their own. Rows srows .. ld - 1 are not
    // written. A view of some of the rows (lb_qmat_rows) has none.
    float *tscale;
    // NULL, or (MXFP8, MXFP4, NVFP4 only) (rows, pad8(cols)) bf16: every element times its
    // block scale, without NVFP4's second level (exact in bf16: doc/formats.md), zeros past
    // cols, which every backend's quantizers then write beside data. Hopper has no tensor cores
    // for these formats, so its GEMMs multiply such bf16 values: a weight cache's copy spares
    // them dequantizing the weights on every call (the sampler's decode, 16 rows an expert,
    // would otherwise convert every expert's weight each step). Set and freed by its owner
    // (models/precision/linear.c's weight cache); a view of some of the rows has none.
    uint16_t *d16;
} lb_qmat;

// Whether q's format can have a d16 copy, and its bytes.
int lb_qmat_d16_fits(const lb_qmat *q);
size_t lb_qmat_d16_bytes(const lb_qmat *q);
// The d16 copy of q's bytes (host memory), where q has one: what the quantizers call last.
void lb_qmat_d16_fill(lb_qmat *q);

// Whether q's layout has transposed scales (fp8-block, 1x128 blocks); lb_qmat.tscale's row
// pitch (srows rounded up to a multiple of 128) and bytes, which die for a layout without.
int lb_qmat_tscale_fits(const lb_qmat *q);
size_t lb_qmat_tscale_ld(const lb_qmat *q);
size_t lb_qmat_tscale_bytes(const lb_qmat *q);

// Fills shape fields of q for x (rows, cols) under a (pointers left alone). Dies on a bad
// combination (unknown format, E5M2 outside MXFP8, per-row second level with 16x16 blocks).
void lb_qmat_layout(lb_qmat *q, int rows, int cols, const lb_quant_args *a);
size_t lb_qmat_data_bytes(const lb_qmat *q);
size_t lb_qmat_scale_bytes(const lb_qmat *q);
void lb_qmat_alloc(lb_qmat *q, int rows, int cols, const lb_quant_args *a);   // layout + malloc
void lb_qmat_free(lb_qmat *q);
// The view of rows [r0, r0 + n) of q, n >= 1, sharing q's memory (host or backend): its data,
// block scales and per-row second levels are those rows of q's. Blocks must be one row high.
// For per-row (1-D) quantization the view holds the bytes that quantizing those rows alone
// gives, so an MoE layer quantizes all its experts' rows in one call.
lb_qmat lb_qmat_rows(const lb_qmat *q, int r0, int n);

// dst = the quantization of the same x in the other direction as src (row-wise <-> column-wise),
// from src's bytes: for square blocks (fp8-block 128x128, NVFP4 16x16 with one second level)
// a block's scale is the same either way, so the codes and the scale grid are transposed. The
// bytes equal lb_quantize's in that direction without stochastic rounding (a weight cache's
// second copy). dst laid out for it; anything else stops with an error
// (lb_qmat_transpose_check).
void lb_qmat_transpose(lb_qmat *dst, const lb_qmat *src);
void lb_qmat_transpose_check(const lb_qmat *dst, const lb_qmat *src);

// The groups of a backend's quantize_grouped (kernels.h): for each j with prows[j] > 0 (prows
// NULL: rows), fn(ctx, j, x_j, prows[j], &a_j), x_j the rows[j] rows of x after the earlier
// groups' and a_j = *a drawing as tensor a->tensor + j, its a_j.amax past the earlier groups'
// second levels; stops with an error on rows[j] < 0, prows[j] < rows[j] or rows past x's.
typedef void (*lb_quant_group_fn)(void *ctx, int j, lb_act xj, int prows,
                                  const lb_quant_args *aj);
void lb_quant_groups(int count, lb_act x, const int *rows, const int *prows,
                     const lb_quant_args *a, lb_quant_group_fn fn, void *ctx);

// The second levels lb_quantize (q, x, rows, cols, a) makes (NVFP4, LB_S2_ROW or LB_S2_TENSOR):
// n = lb_quant_nscale2 of them; stops with an error for another format or mode.
int lb_quant_nscale2(int rows, int cols, const lb_quant_args *a);
// amax (n) = the amax of x's quantized matrix behind each of them (Q's rows, or the whole, after
// a->hadamard; a->amax not applied): >= 0, NaN where a value is NaN.
void lb_quant_amax(float *amax, const float *x, int rows, int cols, const lb_quant_args *a);

// Quantizes x (rows, cols) into q, which must have been laid out for (rows, cols, a).
// Any rows and cols >= 1: a trailing partial block behaves exactly as if padded with zeros.
void lb_quantize(lb_qmat *q, const float *x, int rows, int cols, const lb_quant_args *a);

// y (q->rows, q->cols) = element * block scale (* second level for NVFP4), in fp32: exact for
// MX formats and for NVFP4 without the second level, one rounding otherwise (doc/formats.md).
void lb_dequantize(float *y, const lb_qmat *q);
// NVFP4 without the second level (y = E2M1 * UE4M3, always exact): s2 is per tensor or per
// row, so a GEMM can apply it to the output instead. Same as lb_dequantize for other formats.
void lb_dequantize_blocks(float *y, const lb_qmat *q);

// The element code at (r, c) of q (unpacks E2M1).
static inline uint8_t lb_qmat_code(const lb_qmat *q, int r, int c)
{
    const uint8_t *row = q->data + (size_t)r * q->ld;
    if (q->elem == LB_E2M1) return (uint8_t)((row[c >> 1] >> ((c & 1) * 4)) & 0xf);
    return row[c];
}

// Largest |x| of n values, NaN if any is NaN, +Inf if any is infinite (and none NaN).
float lb_amax(const float *x, size_t n);
// NVFP4 second-level scale of a tensor with that amax: amax / (6 * 448); 1 when that is 0 (an
// all-zero tensor); NaN when amax is not finite. For fused gate/up: pass max(amax_g, amax_u).
float lb_nvfp4_scale2(float amax);

// --- Hadamard ---------------------------------------------------------------------------------

typedef enum {
    LB_AXIS_ROWS = 0,     // blocks of n consecutive rows, in every column (numpy axis 0)
    LB_AXIS_COLS = 1,     // blocks of n consecutive columns, in every row (numpy axis 1)
} lb_axis;

// Normalised block-diagonal Walsh-Hadamard transform: every length-n block v along the axis
// becomes (1/sqrt(n)) * H_n * (s .* v), H_n the Sylvester Hadamard matrix, s_i = -1 where bit
// i of signs is set (signs = 0: the deterministic transform, all s_i = +1). n is a power of two
// in [2, 32] (16 and 32 in use); the axis length must be a multiple of n. y may equal x.
void lb_hadamard(float *y, const float *x, int rows, int cols, lb_axis axis, int n,
                 uint32_t signs);
// The inverse (the transpose): v = s .* ((1/sqrt(n)) * H_n * w).
void lb_hadamard_inv(float *y, const float *x, int rows, int cols, lb_axis axis, int n,
                     uint32_t signs);
// Random signs of one step: the low n bits of lb_rand_u64(seed, lb_quant_stream(step, site), 0).
// Both operands of one GEMM must use the same signs (same site).
uint32_t lb_hadamard_signs(int n, uint64_t seed, uint64_t step, uint64_t site);

#endif
