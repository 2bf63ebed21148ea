// ops_quant.c: low-precision operations of the CPU reference, on the codecs of kernels/quant.
// GEMMs on quantized operands are computed exactly on the dequantized values (every format's
// values are exact in fp32), so the CPU is the oracle for the GPU's tensor-core paths.
#include "kernels/common.h"
#include "kernels/cpu/cpu.h"
#include "kernels/quant/quant.h"

#include <stdlib.h>
#include <string.h>

static void cpu_qmat_alloc(lb_backend *be, lb_qmat *q, int rows, int cols, const lb_quant_args *a)
{
    lb_qmat_alloc(q, rows, cols, a);
}

static void cpu_qmat_free(lb_backend *be, lb_qmat *q) { lb_qmat_free(q); }

// x's values in fp32, rows cols apart, followed by pr - x.rows zero rows (pr >= x.rows): x
// itself where it is so, else a copy in *tmp (freed by the caller; else NULL), a bf16 value's
// fp32 being exact. The padded rows are what a padded group is quantized from.
static const float *f32_of(lb_act x, int pr, float **tmp)
{
    *tmp = NULL;
    if (x.type == LB_ACT_F32 && x.ld == (size_t)x.cols && pr == x.rows) return x.p;
    float *t = lb_calloc((size_t)pr * x.cols + 1, sizeof(float));
    for (int r = 0; r < x.rows; r++)
        for (int c = 0; c < x.cols; c++) {
            const size_t i = (size_t)r * x.ld + c;
            t[(size_t)r * x.cols + c] = x.type == LB_ACT_BF16
                                            ? lb_bf16_to_f32(((const uint16_t *)x.p)[i])
                                            : ((const float *)x.p)[i];
        }
    return *tmp = t;
}

static void cpu_quantize(lb_backend *be, lb_qmat *q, lb_act x, const lb_quant_args *a)
{
    float *tmp;
    lb_quantize(q, f32_of(x, x.rows, &tmp), x.rows, x.cols, a);
    free(tmp);
}

typedef struct {
    lb_qmat *q;
} cpu_groups;

// One group quantized on its own (a padded one from its zero-padded copy).
static void cpu_group(void *ctx, int j, lb_act xj, int pr, const lb_quant_args *aj)
{
    const cpu_groups *g = ctx;
    float *tmp;
    lb_quantize(&g->q[j], f32_of(xj, pr, &tmp), pr, xj.cols, aj);
    free(tmp);
}

static void cpu_quantize_grouped(lb_backend *be, int count, lb_qmat *q, lb_act x,
                                 const int *rows, const int *prows, const lb_quant_args *a)
{
    cpu_groups g = {q};
    lb_quant_groups(count, x, rows, prows, a, cpu_group, &g);
}

typedef struct {
    float *out;   // the next group's amaxes
} cpu_amax_groups;

// One group's amaxes (a padded one from its zero-padded copy, as cpu_group quantizes it).
static void cpu_amax_group(void *ctx, int j, lb_act xj, int pr, const lb_quant_args *aj)
{
    cpu_amax_groups *g = ctx;
    float *out = g->out, *tmp;
    g->out += lb_quant_nscale2(pr, xj.cols, aj);
    lb_quant_amax(out, f32_of(xj, pr, &tmp), pr, xj.cols, aj);
    free(tmp);
}

static void cpu_quantize_amax(lb_backend *be, float *amax, int count, lb_act x, const int *rows,
                              const int *prows, const lb_quant_args *a)
{
    cpu_amax_groups g = {amax};
    lb_quant_groups(count, x, rows, prows, a, cpu_amax_group, &g);
}

static void cpu_quantize_rc(lb_backend *be, lb_qmat *qr, const lb_quant_args *ar, int count,
                            lb_qmat *qc, lb_act x, const int *rows, const int *prows,
                            const lb_quant_args *ac)
{
    int total = 0;
    for (int j = 0; j < count; j++) total += rows[j];
    cpu_quantize(be, qr, lb_act_rows(x, 0, total), ar);
    cpu_quantize_grouped(be, count, qc, x, rows, prows, ac);
}

static void cpu_qmat_transpose(lb_backend *be, int count, lb_qmat *dst, const lb_qmat *src)
{
    for (int j = 0; j < count; j++) lb_qmat_transpose(&dst[j], &src[j]);
}

static void cpu_quantize_rt(lb_backend *be, int count, lb_qmat *qr, lb_qmat *qc,
                            const float *x, const int *rows, int cols, const lb_quant_args *a)
{
    int total = 0;
    for (int j = 0; j < count; j++) total += rows[j];
    cpu_quantize_grouped(be, count, qr, lb_act_f32(x, total, cols), rows, NULL, a);
    for (int j = 0; j < count; j++)
        if (rows[j]) lb_qmat_transpose(&qc[j], &qr[j]);
}

static void cpu_dequantize(lb_backend *be, float *y, const lb_qmat *q) { lb_dequantize(y, q); }

// NVFP4's second-level scales are per tensor or per row of an operand, so they factor out of
// each dot product: C[i][j] = alpha * s2a[i] * s2b[j] * (A_blocks B_blocks^T)[i][j] + beta C,
// with the block products exact in fp32 (E2M1 x UE4M3) as on tensor cores.
static void cpu_gemm_q(lb_backend *be, int m, int n, int k, float alpha, const lb_qmat *a,
                       const lb_qmat *b, float beta, float *c)
{
    if (a->cols != k || b->cols != k || a->rows != m || b->rows != n)
        lb_die("gemm_q: operands (%d, %d) and (%d, %d) do not fit (%d, %d, k %d)", a->rows,
               a->cols, b->rows, b->cols, m, n, k);
    if (a->fmt != b->fmt) lb_die("gemm_q: operands of different formats (%d, %d)", a->fmt, b->fmt);
    float *ad = lb_malloc((size_t)m * k * sizeof(float));
    float *bd = lb_malloc((size_t)n * k * sizeof(float));
    lb_dequantize_blocks(ad, a);
    lb_dequantize_blocks(bd, b);
    if (a->fmt != LB_FMT_NVFP4) {
        lb_gemm(be, 0, 1, m, n, k, alpha, ad, bd, beta, c);
    } else {
        float *t = lb_malloc((size_t)m * n * sizeof(float));
        lb_gemm(be, 0, 1, m, n, k, 1.0f, ad, bd, 0.0f, t);
        for (int i = 0; i < m; i++) {
            float sa = a->scale2[a->nscale2 > 1 ? i : 0];
            for (int j = 0; j < n; j++) {
                float s = sa * b->scale2[b->nscale2 > 1 ? j : 0];
                float *cij = c + (size_t)i * n + j;
                *cij = alpha * (s * t[(size_t)i * n + j]) + (beta != 0.0f ? beta * *cij : 0.0f);
            }
        }
        free(t);
    }
    free(ad);
    free(bd);
}

// One gemm_q per group, in order; a bf16 output (c16) as cpu_gemm makes it.
static void cpu_gemm_q_grouped(lb_backend *be, int count, const lb_gemm_q_args *g)
{
    for (int i = 0; i < count; i++) {
        const lb_gemm_q_args *x = &g[i];
        if (x->c16 && x->beta != 0.0f)
            lb_die("gemm_q_grouped: group %d: a bf16 output (c16) needs beta 0 (beta %g)", i,
                   (double)x->beta);
        if (x->m <= 0 || x->n <= 0) continue;
        float *c = x->c16 ? lb_cpu_c32(be, (size_t)x->m * x->n) : x->c;
        cpu_gemm_q(be, x->m, x->n, x->k, x->alpha, x->a, x->b, x->beta, c);
        if (x->c16) lb_cpu_store_c16(be, x->c16, c, x->m, x->n);
    }
}

static void cpu_hadamard(lb_backend *be, float *y, const float *x, int rows, int cols, int axis,
                         int hn, uint32_t signs)
{
    lb_hadamard(y, x, rows, cols, axis ? LB_AXIS_COLS : LB_AXIS_ROWS, hn, signs);
}

// lb_round_bf16 inlined (the bf16 recipe rounds every GEMM operand): round to nearest even
// on the bits, quiet NaN kept; the bf16 value's fp32 bits.
static inline uint32_t round_bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u | 0x400000u) & 0xffff0000u;   // quiet NaN
    return (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
}

// Elementwise, so threads change nothing.
static void cpu_round_bf16(lb_backend *be, float *y, const float *x, size_t n)
{
    #pragma omp parallel for num_threads(lb_cpu_threads(be)) if (n >= LB_CPU_PAR_MIN)
    for (size_t i = 0; i < n; i++) {
        const uint32_t u = round_bits(x[i]);
        memcpy(&y[i], &u, 4);
    }
}

static void cpu_to_bf16(lb_backend *be, uint16_t *y, const float *x, size_t rows, int cols,
                        int ld)
{
    if (cols < 0 || ld < cols || ld % 8)
        lb_die("to_bf16: row pitch %d for %d columns (a multiple of 8, at least the columns)", ld,
               cols);
    #pragma omp parallel for num_threads(lb_cpu_threads(be)) if (rows * cols >= LB_CPU_PAR_MIN)
    for (size_t r = 0; r < rows; r++)
        for (int c = 0; c < ld; c++)
            y[r * ld + c] = c < cols ? (uint16_t)(round_bits(x[r * cols + c]) >> 16) : 0;
}

void lb_cpu_init_quant(lb_backend *be)
{
    be->qmat_alloc = cpu_qmat_alloc;
    be->qmat_free = cpu_qmat_free;
    be->quantize = cpu_quantize;
    be->quantize_grouped = cpu_quantize_grouped;
    be->quantize_amax = cpu_quantize_amax;
    be->quantize_rc = cpu_quantize_rc;
    be->qmat_transpose = cpu_qmat_transpose;
    be->quantize_rt = cpu_quantize_rt;
    be->dequantize = cpu_dequantize;
    be->gemm_q = cpu_gemm_q;
    be->gemm_q_grouped = cpu_gemm_q_grouped;
    be->hadamard = cpu_hadamard;
    be->round_bf16 = cpu_round_bf16;
    be->to_bf16 = cpu_to_bf16;
}
