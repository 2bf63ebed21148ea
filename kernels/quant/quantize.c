// quantize.c: block quantizers and dequantizers (fp8-block, MXFP8, MXFP4, NVFP4, and
// fp8-tensor: fp8-block's rules with one block the size of the tensor).
//
// Every quantizer works on a row-major (R, C) source with blocks along C. Column-wise
// quantization first transposes the fp32 input and then runs the same row-wise code, so the
// column-wise copy always comes from full precision. Blocks are independent, so rows run in
// parallel and the result never depends on the thread count. doc/formats.md is the
// specification.
#include "kernels/quant/quant.h"
#include "kernels/quant/elem.h"   // lb_elem_fp8_scale_pow2

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/common.h"

// Below this many elements a thread team costs more than it saves.
#define LB_QUANT_PAR_MIN 65536

static int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Formats whose scales are FP32 (amax / 448, or its power of two with lb_quant_args.pow2), one
// per block.
static int fp32_scales(lb_format f) { return f == LB_FMT_FP8_BLOCK || f == LB_FMT_FP8_TENSOR; }

void lb_qmat_layout(lb_qmat *q, int rows, int cols, const lb_quant_args *a)
{
    if (rows < 1 || cols < 1) lb_die("kernels/quant: bad shape (%d, %d)", rows, cols);
    const int h = a->hadamard;
    if (h && (!a->colwise || h < 2 || h > 32 || (h & (h - 1)) || rows % h))
        lb_die("kernels/quant: a fused Hadamard transform needs column-wise quantization, a "
               "power of two in [2, 32] and rows a multiple of it (size %d, %s, %d rows)", h,
               a->colwise ? "column-wise" : "row-wise", rows);
    q->fmt = a->fmt;
    q->rows = a->colwise ? cols : rows;
    q->cols = a->colwise ? rows : cols;
    q->brows = 1;
    switch (a->fmt) {
    case LB_FMT_FP8_BLOCK:
        q->elem = LB_E4M3;
        q->scale_elem = LB_E4M3;                 // unused: FP32 scales
        q->bcols = 128;
        if (a->weight_blocks) q->brows = 128;
        break;
    case LB_FMT_FP8_TENSOR:                      // one block: the whole (quantized) matrix
        q->elem = LB_E4M3;
        q->scale_elem = LB_E4M3;                 // unused: an FP32 scale
        q->brows = q->rows;
        q->bcols = q->cols;
        break;
    case LB_FMT_MXFP8:
        if (a->elem != LB_E4M3 && a->elem != LB_E5M2)
            lb_die("kernels/quant: MXFP8 elements are E4M3 or E5M2, not %s", lb_elem_name(a->elem));
        q->elem = a->elem;
        q->scale_elem = LB_E8M0;
        q->bcols = 32;
        break;
    case LB_FMT_MXFP4:
        q->elem = LB_E2M1;
        q->scale_elem = LB_E8M0;
        q->bcols = 32;
        break;
    case LB_FMT_NVFP4:
        q->elem = LB_E2M1;
        q->scale_elem = LB_UE4M3;
        q->bcols = 16;
        if (a->weight_blocks) {
            // A 16x16 block spans 16 rows: one second-level scale must cover all of them.
            if (a->s2_mode == LB_S2_ROW)
                lb_die("kernels/quant: NVFP4 16x16 blocks need a per-tensor or given scale2");
            q->brows = 16;
        }
        break;
    default:
        lb_die("kernels/quant: format %d has no quantizer", (int)a->fmt);
    }
    if ((a->fmt == LB_FMT_MXFP8 || a->fmt == LB_FMT_MXFP4) && a->rule != LB_SCALE_CEIL &&
        a->rule != LB_SCALE_FLOOR)
        lb_die("kernels/quant: unknown MX scale rule %d", (int)a->rule);
    if (a->weight_blocks && a->fmt != LB_FMT_FP8_BLOCK && a->fmt != LB_FMT_NVFP4)
        lb_die("kernels/quant: square weight blocks exist for fp8-block and NVFP4 only");
    if (a->pow2 && !fp32_scales(a->fmt))
        lb_die("kernels/quant: power-of-two FP32 scales exist for fp8-block and fp8-tensor only "
               "(format %d; MX scales are powers of two already)", (int)a->fmt);
    q->srows = ceil_div(q->rows, q->brows);
    q->scols = ceil_div(q->cols, q->bcols);
    q->ld = q->elem == LB_E2M1 ? (size_t)(q->cols + 1) / 2 : (size_t)q->cols;
    q->nscale2 = a->fmt != LB_FMT_NVFP4 ? 0 : a->s2_mode == LB_S2_ROW ? q->rows : 1;
}

size_t lb_qmat_data_bytes(const lb_qmat *q) { return (size_t)q->rows * q->ld; }

size_t lb_qmat_scale_bytes(const lb_qmat *q)
{
    return (size_t)q->srows * q->scols * (fp32_scales(q->fmt) ? 4 : 1);
}

void lb_qmat_alloc(lb_qmat *q, int rows, int cols, const lb_quant_args *a)
{
    memset(q, 0, sizeof *q);
    lb_qmat_layout(q, rows, cols, a);
    q->data = lb_malloc(lb_qmat_data_bytes(q));
    q->scale = lb_malloc(lb_qmat_scale_bytes(q));
    q->scale2 = q->nscale2 ? lb_malloc((size_t)q->nscale2 * sizeof(float)) : NULL;
}

int lb_qmat_tscale_fits(const lb_qmat *q)
{
    return q->fmt == LB_FMT_FP8_BLOCK && q->brows == 1 && q->bcols == 128;
}

size_t lb_qmat_tscale_ld(const lb_qmat *q)
{
    if (!lb_qmat_tscale_fits(q))
        lb_die("kernels/quant: transposed scales exist for fp8-block 1x128 blocks only (format "
               "%d, %dx%d blocks)", (int)q->fmt, q->brows, q->bcols);
    return ((size_t)q->srows + 127) / 128 * 128;
}

size_t lb_qmat_tscale_bytes(const lb_qmat *q)
{
    return lb_qmat_tscale_ld(q) * q->scols * sizeof(float);
}

// The transposed copy of q's scales (lb_qmat.tscale), where q has one.
static void tscale_fill(lb_qmat *q)
{
    if (!q->tscale) return;
    const size_t ld = lb_qmat_tscale_ld(q);
    const float *s = q->scale;
    for (int r = 0; r < q->srows; r++)
        for (int k = 0; k < q->scols; k++)
            q->tscale[(size_t)k * ld + r] = s[(size_t)r * q->scols + k];
}

int lb_qmat_d16_fits(const lb_qmat *q)
{
    return q->fmt == LB_FMT_MXFP8 || q->fmt == LB_FMT_MXFP4 || q->fmt == LB_FMT_NVFP4;
}

size_t lb_qmat_d16_bytes(const lb_qmat *q)
{
    if (!lb_qmat_d16_fits(q)) lb_die("kernels/quant: format %d has no bf16 copy", (int)q->fmt);
    return (size_t)q->rows * ((q->cols + 7) & ~7) * sizeof(uint16_t);
}

void lb_qmat_d16_fill(lb_qmat *q)
{
    if (!q->d16) return;
    lb_qmat_d16_bytes(q);   // dies for a format without
    const int ld = (q->cols + 7) & ~7;
    float *y = lb_malloc((size_t)q->rows * q->cols * sizeof(float));
    lb_dequantize_blocks(y, q);
    #pragma omp parallel for schedule(static) if ((size_t)q->rows * q->cols >= LB_QUANT_PAR_MIN)
    for (int r = 0; r < q->rows; r++)
        lb_bf16_row(q->d16 + (size_t)r * ld, y + (size_t)r * q->cols, q->cols, ld);
    free(y);
}

lb_qmat lb_qmat_rows(const lb_qmat *q, int r0, int n)
{
    if (q->brows != 1 || r0 < 0 || n < 1 || r0 + n > q->rows)
        lb_die("lb_qmat_rows: rows [%d, %d) of a (%d, %d) matrix with %d-row blocks", r0, r0 + n,
               q->rows, q->cols, q->brows);
    lb_qmat v = *q;
    size_t sbytes = fp32_scales(q->fmt) ? 4 : 1;
    if (n != q->rows) v.tscale = NULL, v.d16 = NULL;   // its pitch is the whole matrix's
    v.rows = v.srows = n;
    v.data = q->data + (size_t)r0 * q->ld;
    v.scale = (uint8_t *)q->scale + (size_t)r0 * q->scols * sbytes;
    if (q->nscale2 > 1) {
        v.scale2 = q->scale2 + r0;
        v.nscale2 = n;
    }
    return v;
}

void lb_qmat_free(lb_qmat *q)
{
    free(q->data);
    free(q->scale);
    free(q->scale2);
    q->data = NULL;
    q->scale = NULL;
    q->scale2 = NULL;
}

float lb_amax(const float *x, size_t n)
{
    float m = 0.0f;
    int nan = 0;
    for (size_t i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        if (a != a) nan = 1;
        else if (a > m) m = a;
    }
    return nan ? NAN : m;
}

float lb_nvfp4_scale2(float amax)
{
    if (!isfinite(amax)) return NAN;
    float s = amax / 2688.0f;                    // 6 * 448
    return s == 0.0f ? 1.0f : s;
}

// amax of the block rows [r0, r1) x cols [c0, c1) of x (R, C); NaN/Inf as lb_amax.
static float block_amax(const float *x, int C, int r0, int r1, int c0, int c1)
{
    float m = 0.0f;
    for (int r = r0; r < r1; r++) {
        float b = lb_amax(x + (size_t)r * C + c0, (size_t)(c1 - c0));
        if (b != b) return NAN;
        if (b > m) m = b;
    }
    return m;
}

// E8M0 exponent k of an MX block scale 2^k (amax finite and > 0), computed exactly from the
// binary exponents and mantissas (a floating-point log2 could misround at the boundaries).
static int mx_exponent(float amax, lb_elem elem, lb_scale_rule rule)
{
    int ea;
    float ma = frexpf(amax, &ea);                // amax = ma * 2^ea, ma in [0.5, 1)
    int k;
    if (rule == LB_SCALE_FLOOR) {
        int emax = elem == LB_E4M3 ? 8 : elem == LB_E5M2 ? 15 : 2;
        k = (ea - 1) - emax;                     // floor(log2 amax) - emax
    } else {
        // Smallest k with amax <= elem_max * 2^k, exactly: elem_max = mm * 2^em.
        int em;
        float mm = frexpf(lb_elem_max(elem), &em);
        k = ea - em + (ma > mm);
    }
    if (k < -127) k = -127;                      // E8M0 range; the top is never reached
    if (k > 127) k = 127;
    return k;
}

typedef struct {
    const lb_quant_args *a;
    uint64_t stream;
} ctx;

static uint8_t enc(const ctx *cx, lb_elem t, float v, size_t idx)
{
    if (cx->a->sr) return lb_encode_sr(t, v, lb_rand_u64(cx->a->seed, cx->stream, idx));
    return lb_encode(t, v, 1);
}

// Writes the element code of (r, c); E2M1 rows are zeroed beforehand.
static void put(lb_qmat *q, int r, int c, uint8_t code)
{
    uint8_t *row = q->data + (size_t)r * q->ld;
    if (q->elem == LB_E2M1) row[c >> 1] |= (uint8_t)(code << ((c & 1) * 4));
    else row[c] = code;
}

// Encodes block (br, bc) of x (R, C) as element(x / d) for every element; zero codes when
// d is NaN or 0 (a non-finite block, or a scale that cannot represent the block).
static void encode_block(lb_qmat *q, const ctx *cx, const float *x, int br, int bc, float d)
{
    int r0 = br * q->brows, r1 = r0 + q->brows < q->rows ? r0 + q->brows : q->rows;
    int c0 = bc * q->bcols, c1 = c0 + q->bcols < q->cols ? c0 + q->bcols : q->cols;
    int zero = d != d || d == 0.0f;
    for (int r = r0; r < r1; r++)
        for (int c = c0; c < c1; c++) {
            size_t i = (size_t)r * q->cols + c;
            put(q, r, c, zero ? 0 : enc(cx, q->elem, x[i] / d, i));
        }
}

// The larger of two amaxes, NaN above every number (the CUDA quantizers' maximum of |x| bits).
static float amax_max(float a, float b)
{
    return a != a || b != b ? NAN : a > b ? a : b;
}

// amax with a->amax[i] (lb_quant_args.amax) applied.
static float amax_given(const lb_quant_args *a, int i, float amax)
{
    return a->amax ? amax_max(amax, a->amax[i]) : amax;
}

// Row-wise quantization of x (q->rows, q->cols).
static void quantize_rows(lb_qmat *q, const float *x, const lb_quant_args *a)
{
    ctx cx = {a, lb_quant_stream(a->step, a->tensor)};
    int R = q->rows, C = q->cols;
    if (q->elem == LB_E2M1) memset(q->data, 0, lb_qmat_data_bytes(q));

    if (q->fmt == LB_FMT_NVFP4) {
        if (a->s2_mode == LB_S2_TENSOR) {
            q->scale2[0] = lb_nvfp4_scale2(amax_given(a, 0, lb_amax(x, (size_t)R * C)));
        } else if (a->s2_mode == LB_S2_GIVEN) {
            if (a->amax) lb_die("kernels/quant: NVFP4 given scale2 with given amaxes");
            if (!(a->s2 > 0.0f && a->s2 < INFINITY) && a->s2 == a->s2)
                lb_die("kernels/quant: NVFP4 given scale2 %g is not positive and finite",
                       (double)a->s2);
            q->scale2[0] = a->s2;
        } else if (a->s2_mode == LB_S2_ROW) {
            for (int r = 0; r < R; r++)
                q->scale2[r] =
                    lb_nvfp4_scale2(amax_given(a, r, lb_amax(x + (size_t)r * C, (size_t)C)));
        } else {
            lb_die("kernels/quant: unknown scale2 mode %d", (int)a->s2_mode);
        }
    }

    #pragma omp parallel for schedule(static) if ((size_t)R * C >= LB_QUANT_PAR_MIN)
    for (int br = 0; br < q->srows; br++) {
        int r0 = br * q->brows, r1 = r0 + q->brows < R ? r0 + q->brows : R;
        for (int bc = 0; bc < q->scols; bc++) {
            int c0 = bc * q->bcols, c1 = c0 + q->bcols < C ? c0 + q->bcols : C;
            float amax = block_amax(x, C, r0, r1, c0, c1);
            int finite = amax < INFINITY;        // false for NaN and Inf
            size_t si = (size_t)br * q->scols + bc;
            float d;                             // the divisor of the elements
            if (fp32_scales(q->fmt)) {
                float s;
                if (!finite) {
                    s = NAN;
                } else if (a->pow2) {            // 1 in the same cases as below
                    uint32_t ab;
                    memcpy(&ab, &amax, sizeof ab);
                    s = lb_elem_fp8_scale_pow2(ab);
                } else {
                    s = amax / 448.0f;
                    if (s == 0.0f) s = 1.0f;     // all-zero block (or amax below 448 * 2^-150)
                }
                ((float *)q->scale)[si] = s;
                d = s;
            } else if (q->fmt == LB_FMT_NVFP4) {
                float s2 = q->scale2[a->s2_mode == LB_S2_ROW ? r0 : 0];
                uint8_t sc = lb_encode(LB_UE4M3, finite ? amax / 6.0f / s2 : NAN, 1);
                ((uint8_t *)q->scale)[si] = sc;
                d = lb_decode(LB_UE4M3, sc) * s2;
            } else {                             // MXFP8, MXFP4
                uint8_t sc = !finite ? 0xff : amax == 0.0f ? 127
                           : (uint8_t)(mx_exponent(amax, q->elem, a->rule) + 127);
                ((uint8_t *)q->scale)[si] = sc;
                d = lb_decode(LB_E8M0, sc);
            }
            encode_block(q, &cx, x, br, bc, d);
        }
    }
}

void lb_qmat_transpose_check(const lb_qmat *dst, const lb_qmat *src)
{
    if ((src->fmt != LB_FMT_FP8_BLOCK && src->fmt != LB_FMT_NVFP4) || src->brows != src->bcols ||
        src->brows < 2 || (src->fmt == LB_FMT_NVFP4 && src->nscale2 != 1))
        lb_die("kernels/quant: a transposed copy needs square blocks and at most one second "
               "level (format %d, %dx%d blocks, %d second levels)", (int)src->fmt, src->brows,
               src->bcols, src->nscale2);
    if (dst->fmt != src->fmt || dst->elem != src->elem || dst->rows != src->cols ||
        dst->cols != src->rows || dst->brows != src->brows || dst->bcols != src->bcols ||
        dst->nscale2 != src->nscale2)
        lb_die("kernels/quant: the transposed copy of a (%d, %d) matrix was laid out as (%d, %d)",
               src->rows, src->cols, dst->rows, dst->cols);
}

// The element code of (r, c).
static uint8_t get(const lb_qmat *q, int r, int c)
{
    const uint8_t *row = q->data + (size_t)r * q->ld;
    return q->elem == LB_E2M1 ? (uint8_t)(row[c >> 1] >> ((c & 1) * 4) & 15u) : row[c];
}

void lb_qmat_transpose(lb_qmat *dst, const lb_qmat *src)
{
    lb_qmat_transpose_check(dst, src);
    if (dst->elem == LB_E2M1) memset(dst->data, 0, lb_qmat_data_bytes(dst));
    for (int r = 0; r < src->rows; r++)
        for (int c = 0; c < src->cols; c++) put(dst, c, r, get(src, r, c));
    const size_t es = fp32_scales(src->fmt) ? 4 : 1;
    for (int i = 0; i < src->srows; i++)
        for (int j = 0; j < src->scols; j++)
            memcpy((uint8_t *)dst->scale + ((size_t)j * dst->scols + i) * es,
                   (const uint8_t *)src->scale + ((size_t)i * src->scols + j) * es, es);
    if (src->nscale2) dst->scale2[0] = src->scale2[0];
    lb_qmat_d16_fill(dst);
}

void lb_quant_groups(int count, lb_act x, const int *rows, const int *prows,
                     const lb_quant_args *a, lb_quant_group_fn fn, void *ctx)
{
    size_t off = 0, s2off = 0;
    for (int j = 0; j < count; j++) {
        const int r = rows[j], pr = prows ? prows[j] : r;
        if (r < 0 || pr < r)
            lb_die("quantize_grouped: group %d has %d rows padded to %d", j, r, pr);
        if (off + (size_t)r > (size_t)x.rows)
            lb_die("quantize_grouped: group %d's rows end at %zu, past x's %d", j, off + r,
                   x.rows);
        const lb_act xj = lb_act_rows(x, off, r);
        off += (size_t)r;
        if (pr == 0) continue;
        lb_quant_args aj = *a;
        aj.tensor = a->tensor + (uint64_t)j;
        if (a->hsigns_groups) aj.hsigns = a->hsigns_groups[j];
        if (a->amax) aj.amax = a->amax + s2off, s2off += (size_t)lb_quant_nscale2(pr, x.cols, a);
        fn(ctx, j, xj, pr, &aj);
    }
}

int lb_quant_nscale2(int rows, int cols, const lb_quant_args *a)
{
    if (a->fmt != LB_FMT_NVFP4 || (a->s2_mode != LB_S2_ROW && a->s2_mode != LB_S2_TENSOR))
        lb_die("kernels/quant: amaxes of second levels exist for NVFP4 per row or tensor only "
               "(format %d, mode %d)", (int)a->fmt, (int)a->s2_mode);
    return a->s2_mode == LB_S2_TENSOR ? 1 : a->colwise ? cols : rows;
}

// The matrix x's quantization under a blocks, (rows, cols) row-wise or (cols, rows)
// column-wise: x itself, or a new copy of x^T with a->hadamard applied along x's rows.
static float *quant_source(const float *x, int rows, int cols, const lb_quant_args *a)
{
    if (!a->colwise) return (float *)x;
    float *xt = lb_malloc((size_t)rows * cols * sizeof(float));
    #pragma omp parallel for schedule(static) if ((size_t)rows * cols >= LB_QUANT_PAR_MIN)
    for (int c0 = 0; c0 < cols; c0 += 32)
        for (int r0 = 0; r0 < rows; r0 += 32)
            for (int c = c0; c < c0 + 32 && c < cols; c++)
                for (int r = r0; r < r0 + 32 && r < rows; r++)
                    xt[(size_t)c * rows + r] = x[(size_t)r * cols + c];
    // x's rows are xt's columns: the transform along them (it checks the size and the length)
    if (a->hadamard) lb_hadamard(xt, xt, cols, rows, LB_AXIS_COLS, a->hadamard, a->hsigns);
    return xt;
}

void lb_quant_amax(float *amax, const float *x, int rows, int cols, const lb_quant_args *a)
{
    lb_quant_nscale2(rows, cols, a);   // dies for a format or mode without
    const int R = a->colwise ? cols : rows, C = a->colwise ? rows : cols;
    float *src = quant_source(x, rows, cols, a);
    if (a->s2_mode == LB_S2_TENSOR) amax[0] = lb_amax(src, (size_t)R * C);
    else
        for (int r = 0; r < R; r++) amax[r] = lb_amax(src + (size_t)r * C, (size_t)C);
    if (src != x) free(src);
}

void lb_quantize(lb_qmat *q, const float *x, int rows, int cols, const lb_quant_args *a)
{
    lb_qmat want;
    lb_qmat_layout(&want, rows, cols, a);
    if (want.fmt != q->fmt || want.rows != q->rows || want.cols != q->cols ||
        want.brows != q->brows || want.bcols != q->bcols || want.elem != q->elem ||
        want.nscale2 != q->nscale2)
        lb_die("kernels/quant: lb_qmat was laid out for another shape or format");
    if (q->tscale) lb_qmat_tscale_ld(q);   // dies for a layout without
    if (q->d16) lb_qmat_d16_bytes(q);   // dies for a format without
    if (!a->colwise) {
        quantize_rows(q, x, a);
        tscale_fill(q);
        lb_qmat_d16_fill(q);
        return;
    }
    // Column-wise: the full-precision input transposed (rows, cols) -> (cols, rows), in tiles
    float *xt = quant_source(x, rows, cols, a);
    quantize_rows(q, xt, a);
    tscale_fill(q);
    lb_qmat_d16_fill(q);
    free(xt);
}

static void dequantize(float *y, const lb_qmat *q, int with_s2)
{
    #pragma omp parallel for schedule(static) if ((size_t)q->rows * q->cols >= LB_QUANT_PAR_MIN)
    for (int r = 0; r < q->rows; r++) {
        size_t srow = (size_t)(r / q->brows) * q->scols;
        float s2 = q->fmt != LB_FMT_NVFP4 ? 1.0f : q->scale2[q->nscale2 > 1 ? r : 0];
        for (int c = 0; c < q->cols; c++) {
            float e = lb_decode(q->elem, lb_qmat_code(q, r, c));
            size_t si = srow + c / q->bcols;
            float v;
            if (fp32_scales(q->fmt)) {
                v = e * ((const float *)q->scale)[si];
            } else {
                v = e * lb_decode(q->scale_elem, ((const uint8_t *)q->scale)[si]);
                if (q->fmt == LB_FMT_NVFP4 && with_s2) v *= s2;   // E2M1 * UE4M3 is exact
            }
            y[(size_t)r * q->cols + c] = v;
        }
    }
}

void lb_dequantize(float *y, const lb_qmat *q) { dequantize(y, q, 1); }

void lb_dequantize_blocks(float *y, const lb_qmat *q) { dequantize(y, q, 0); }
