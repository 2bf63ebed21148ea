// test_linear.c: the linear layer runs each GEMM in the format its contract site names. Each
// pass is recomputed here from the codecs (golden-tested in test_quant) and a double-precision
// product, independently of models/precision/linear.c's code paths.
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "kernels/common.h"
#include "models/precision/linear.h"
#include "tests/testutil.h"

enum { N = 40, IN = 96, OUT = 24 };   // partial blocks everywhere; N not a multiple of 16

static lb_backend *be, *cpu_be;   // be: the backend under test

// The recipe with this backward, every role in it (no roles kept in bf16).
static lb_precision_spec spec(const char *recipe, const char *backward)
{
    char words[128];
    snprintf(words, sizeof words, "recipe=%s backward=%s keep_bf16_roles=", recipe, backward);
    return lb_test_spec_words(words);
}

// precision.wgrad_hadamard's word as its enum.
static lb_wgrad_hadamard_choice hadamard_of(const char *word)
{
    char words[64];
    snprintf(words, sizeof words, "wgrad_hadamard=%s", word);
    return lb_test_spec_words(words).wgrad_hadamard;
}

static void fill(float *x, size_t n, uint64_t stream)
{
    for (size_t i = 0; i < n; i++) x[i] = lb_rand_normal(11, stream, i) * (i % 7 == 0 ? 8.0f : 1.0f);
}

// What a format does to an operand: quantize as the site says, dequantize.
static void fake_quant(float *y, const float *x, int rows, int cols, lb_format f, int weight,
                       int colwise)
{
    if (f == LB_FMT_FP32) {
        for (int i = 0; i < rows * cols; i++) y[i] = x[i];
        return;
    }
    if (f == LB_FMT_BF16) {
        for (int i = 0; i < rows * cols; i++) y[i] = lb_round_bf16(x[i]);
        return;
    }
    lb_quant_args a;
    memset(&a, 0, sizeof a);
    a.fmt = f;
    a.colwise = colwise;
    a.weight_blocks = weight && (f == LB_FMT_FP8_BLOCK || f == LB_FMT_NVFP4);
    a.s2_mode = f == LB_FMT_NVFP4 && !weight && !colwise ? LB_S2_ROW : LB_S2_TENSOR;
    lb_qmat q;
    lb_qmat_alloc(&q, rows, cols, &a);
    lb_quantize(&q, x, rows, cols, &a);
    lb_dequantize(y, &q);   // colwise: y holds x^T
    lb_qmat_free(&q);
}

// c (m, n) = a (m, k) b (n, k)^T in double
static void ref_nt(double *c, const float *a, const float *b, int m, int n, int k)
{
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            double s = 0;
            for (int x = 0; x < k; x++) s += (double)a[i * k + x] * b[j * k + x];
            c[i * n + j] = s;
        }
}

static void transpose(float *t, const float *x, int rows, int cols)
{
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) t[j * rows + i] = x[i * cols + j];
}

static void expect_close(const float *got, const double *want, int n, double bound, const char *what)
{
    double num = 0, den = 0;
    for (int i = 0; i < n; i++) {
        ck_assert_msg(isfinite(got[i]), "%s: non-finite at %d", what, i);
        num = fmax(num, fabs(got[i] - want[i]));
        den = fmax(den, fabs(want[i]));
    }
    ck_assert_msg(num <= bound * den, "%s: error %.3g of %.3g (bound %.1g)", what, num, den, bound);
}

static void check_recipe(const char *recipe, const char *backward, lb_format f, int hadamard)
{
    char err[256], what[128];
    lb_precision_spec s = spec(recipe, backward);
    lb_contract c;
    ck_assert_msg(lb_contract_resolve(&c, &s, 1, err, sizeof err) == 0, "%s", err);
    lb_linear L = {.be = be, .contract = &c, .seed = 5, .step = 3};
    const lb_role role = LB_ROLE_MOE_GATE_UP;
    ck_assert_int_eq(lb_contract_site(&c, 0, role, LB_PASS_FPROP)->fmt, f);
    float *x = malloc(sizeof(float) * N * IN), *w = malloc(sizeof(float) * OUT * IN);
    float *dy = malloc(sizeof(float) * N * OUT), *y = malloc(sizeof(float) * N * OUT);
    float *dx = malloc(sizeof(float) * N * IN), *dw = calloc(OUT * IN, sizeof(float));
    fill(x, N * IN, 1);
    fill(w, OUT * IN, 2);
    fill(dy, N * OUT, 3);
    lb_wcache wc;
    memset(&wc, 0, sizeof wc);
    lb_wcache_build(&L, &wc, 0, role, w, 1, OUT, IN);
    lb_linear_fwd(&L, 0, role, lb_act_f32(x, N, IN), w, &wc, 0, y, OUT, 0.0f);
    lb_linear_bwd(&L, 0, role, lb_act_f32(x, N, IN), w, &wc, 0, dy, dx, 0.0f, dw, 1.0f, OUT);

    int quantized = strcmp(backward, "quantized") == 0;
    int low = f != LB_FMT_FP32 && f != LB_FMT_BF16;
    float *a = malloc(sizeof(float) * 64 * 1024), *b = malloc(sizeof(float) * 64 * 1024);
    double *ref = malloc(sizeof(double) * 64 * 1024);
    // fprop: y = Q(x) Q(W)^T
    fake_quant(a, x, N, IN, f, 0, 0);
    fake_quant(b, w, OUT, IN, f, 1, 0);
    ref_nt(ref, a, b, N, OUT, IN);
    snprintf(what, sizeof what, "%s/%s fprop", recipe, backward);
    expect_close(y, ref, N * OUT, 1e-5, what);
    // dgrad: dx = Q(dy) Q_col(W)^T, or BF16 on dequantized or original weights
    float *wt = malloc(sizeof(float) * OUT * IN);
    if (low && quantized) {
        fake_quant(a, dy, N, OUT, f, 0, 0);
        fake_quant(b, w, OUT, IN, f, 1, 1);                        // (IN, OUT)
    } else {
        fake_quant(a, dy, N, OUT, f == LB_FMT_FP32 ? f : LB_FMT_BF16, 0, 0);
        if (low && !strcmp(backward, "dequantized")) fake_quant(wt, w, OUT, IN, f, 1, 0);
        else fake_quant(wt, w, OUT, IN, f == LB_FMT_FP32 ? f : LB_FMT_BF16, 1, 0);
        transpose(b, wt, OUT, IN);
    }
    ref_nt(ref, a, b, N, IN, OUT);
    snprintf(what, sizeof what, "%s/%s dgrad", recipe, backward);
    expect_close(dx, ref, N * IN, 1e-5, what);
    // wgrad: dw = Q_col(H dy)^T-blocks . Q_col(H x), over tokens padded with zeros to a
    // multiple of 16 and of the Hadamard size
    int pad = hadamard > 16 ? hadamard : 16, nk = (N + pad - 1) / pad * pad;
    float *pd = calloc((size_t)nk * OUT, sizeof(float)), *px = calloc((size_t)nk * IN, sizeof(float));
    memcpy(pd, dy, sizeof(float) * N * OUT);
    memcpy(px, x, sizeof(float) * N * IN);
    if (hadamard) {
        lb_hadamard(pd, pd, nk, OUT, LB_AXIS_ROWS, hadamard, 0);
        lb_hadamard(px, px, nk, IN, LB_AXIS_ROWS, hadamard, 0);
    }
    if (low && quantized) {
        fake_quant(a, pd, nk, OUT, f, 0, 1);                       // (OUT, nk)
        fake_quant(b, px, nk, IN, f, 0, 1);                        // (IN, nk)
    } else {
        float *t = malloc(sizeof(float) * nk * IN);
        fake_quant(t, pd, nk, OUT, f == LB_FMT_FP32 ? f : LB_FMT_BF16, 0, 0);
        transpose(a, t, nk, OUT);
        if (low && !strcmp(backward, "dequantized")) fake_quant(t, px, nk, IN, f, 0, 0);
        else fake_quant(t, px, nk, IN, f == LB_FMT_FP32 ? f : LB_FMT_BF16, 0, 0);
        transpose(b, t, nk, IN);
        free(t);
    }
    ref_nt(ref, a, b, OUT, IN, nk);
    snprintf(what, sizeof what, "%s/%s wgrad", recipe, backward);
    expect_close(dw, ref, OUT * IN, 1e-5, what);
    lb_wcache_free(&L, &wc);
    lb_linear_free(&L);
    lb_contract_free(&c);
    free(x); free(w); free(dy); free(y); free(dx); free(dw); free(a); free(b); free(ref);
    free(wt); free(pd); free(px);
}

// The operands of E experts' GEMMs: x (n, IN), w (E, OUT, IN), dy (n, OUT), filled, and w's
// cache under L's contract.
static void expert_operands(lb_linear *L, lb_role role, int n, int E, float **x, float **w,
                            float **dy, lb_wcache *wc)
{
    *x = malloc(sizeof(float) * n * IN);
    *w = malloc(sizeof(float) * E * OUT * IN);
    *dy = malloc(sizeof(float) * n * OUT);
    fill(*x, (size_t)n * IN, 1);
    fill(*w, (size_t)E * OUT * IN, 2);
    fill(*dy, (size_t)n * OUT, 3);
    memset(wc, 0, sizeof *wc);
    lb_wcache_build(L, wc, 0, role, *w, E, OUT, IN);
}

// Experts: lb_linear_grouped_fwd / _bwd (one quantization of all rows or quantize_grouped,
// grouped GEMMs, grouped column-wise wgrad quantization) give bit for bit what lb_linear_fwd /
// _bwd give per expert, with stochastic rounding (each expert's own stream), NVFP4 with one
// second level per tensor (each expert's own) and random Hadamard signs (random16: each
// expert's own, in one quantize_grouped call) too.
static void check_grouped_h(const char *recipe, const char *backward, int sr, int per_tensor,
                            const char *hadamard)
{
    enum { E = 7 };
    const int counts[E] = {0, 17, 0, 0, 40, 3, 0};   // empty experts first, in a run and last
    int n = 0;
    for (int j = 0; j < E; j++) n += counts[j];
    char err[256];
    lb_precision_spec s = spec(recipe, backward);
    s.stochastic_rounding = sr;
    if (per_tensor) s.nvfp4_per_tensor = 1;
    if (hadamard) s.wgrad_hadamard = hadamard_of(hadamard);
    lb_contract c;
    ck_assert_msg(lb_contract_resolve(&c, &s, 1, err, sizeof err) == 0, "%s", err);
    lb_linear L = {.be = be, .contract = &c, .seed = 5, .step = 3};
    const lb_role role = LB_ROLE_MOE_GATE_UP;
    size_t mat = (size_t)OUT * IN;
    float *x, *w, *dy;
    lb_wcache wc;
    expert_operands(&L, role, n, E, &x, &w, &dy, &wc);
    float *y[2], *dx[2], *dw[2];
    for (int r = 0; r < 2; r++) {
        y[r] = malloc(sizeof(float) * n * OUT), dx[r] = malloc(sizeof(float) * n * IN);
        dw[r] = malloc(sizeof(float) * E * mat);
        fill(dw[r], E * mat, 4);   // wgrad accumulates
    }
    const lb_act xa = lb_act_f32(x, n, IN);
    lb_linear_grouped_fwd(&L, 0, role, xa, w, &wc, counts, E, y[0], NULL, OUT);
    lb_linear_grouped_bwd(&L, 0, role, xa, w, &wc, counts, E, NULL, 1, dy, NULL, dx[0], NULL,
                          dw[0], 1.0f, OUT);
    size_t off = 0;
    for (int j = 0; j < E; j++) {
        lb_linear_fwd(&L, 0, role, lb_act_rows(xa, off, counts[j]), w, &wc, j, y[1] + off * OUT,
                      OUT, 0.0f);
        lb_linear_bwd(&L, 0, role, lb_act_rows(xa, off, counts[j]), w, &wc, j, dy + off * OUT,
                      dx[1] + off * IN, 0.0f, dw[1] + j * mat, 1.0f, OUT);
        off += (size_t)counts[j];
    }
    ck_assert_msg(!memcmp(y[0], y[1], sizeof(float) * n * OUT), "%s/%s: grouped fprop", recipe, backward);
    ck_assert_msg(!memcmp(dx[0], dx[1], sizeof(float) * n * IN), "%s/%s: grouped dgrad", recipe, backward);
    ck_assert_msg(!memcmp(dw[0], dw[1], sizeof(float) * E * mat), "%s/%s: grouped wgrad", recipe, backward);
    if (lb_linear_grouped_bf16(&L, 0, role)) {
        // bf16 GEMMs given x and dy's bf16 copies (to_bf16's layout, as the ops that made them
        // write them) give the same bits
        enum { IN8 = (IN + 7) / 8 * 8, OUT8 = (OUT + 7) / 8 * 8 };
        uint16_t *x16 = malloc(2 * (size_t)n * IN8), *dy16 = malloc(2 * (size_t)n * OUT8);
        be->to_bf16(be, x16, x, n, IN, IN8);
        be->to_bf16(be, dy16, dy, n, OUT, OUT8);
        float *y2 = malloc(sizeof(float) * n * OUT), *dx2 = malloc(sizeof(float) * n * IN);
        float *dw2 = malloc(sizeof(float) * E * mat);
        fill(dw2, E * mat, 4);
        lb_linear_grouped_fwd(&L, 0, role, xa, w, &wc, counts, E, y2, NULL, OUT);
        lb_linear_grouped_bwd(&L, 0, role, xa, w, &wc, counts, E, NULL, 1, dy, dy16, dx2, NULL,
                              dw2, 1.0f, OUT);
        ck_assert_msg(!memcmp(y[0], y2, sizeof(float) * n * OUT), "%s: fprop, x", recipe);
        ck_assert_msg(!memcmp(dx[0], dx2, sizeof(float) * n * IN), "%s: dgrad, dy16", recipe);
        ck_assert_msg(!memcmp(dw[0], dw2, sizeof(float) * E * mat), "%s: wgrad, x16 dy16", recipe);
        // the copies alone (x and dy NULL: their ops wrote no fp32)
        fill(dw2, E * mat, 4);
        const lb_act xa16 = lb_act_bf16(x16, n, IN);
        lb_linear_grouped_fwd(&L, 0, role, xa16, w, &wc, counts, E, y2, NULL, OUT);
        lb_linear_grouped_bwd(&L, 0, role, xa16, w, &wc, counts, E, NULL, 1, NULL, dy16, dx2,
                              NULL, dw2, 1.0f, OUT);
        ck_assert_msg(!memcmp(y[0], y2, sizeof(float) * n * OUT), "%s: fprop, x16 alone", recipe);
        ck_assert_msg(!memcmp(dx[0], dx2, sizeof(float) * n * IN), "%s: dgrad, dy16 alone", recipe);
        ck_assert_msg(!memcmp(dw[0], dw2, sizeof(float) * E * mat), "%s: wgrad, copies alone",
                      recipe);
        // no rows at all (an expert-parallel rank that received none): no operand, no error,
        // and dw_beta 0 still zeroes the matrices
        const int none[E] = {0};
        lb_linear_grouped_fwd(&L, 0, role, lb_act_f32(NULL, 0, IN), w, &wc, none, E, y2, NULL,
                              OUT);
        for (size_t i = 0; i < E * mat; i++) dw2[i] = NAN;
        lb_linear_grouped_bwd(&L, 0, role, lb_act_f32(NULL, 0, IN), w, &wc, none, E, NULL, 1,
                              NULL, NULL, dx2, NULL, dw2, 0.0f, OUT);
        for (size_t i = 0; i < E * mat; i++)
            ck_assert_msg(dw2[i] == 0.0f, "%s: no rows, dw[%zu] %g", recipe, i, dw2[i]);
        free(x16), free(dy16), free(y2), free(dx2), free(dw2);
    }
    // the outputs stored in bf16 instead (y16, dx16: lb_gemm_args.c16, lb_gemm_q_args.c16)
    // where the grouped calls store them: the fp32 results rounded once, the fp32 outputs and
    // the pad columns untouched, the wgrad beside them unchanged
    const int f16 = lb_linear_grouped_c16(&L, 0, role, LB_PASS_FPROP);
    const int d16 = lb_linear_grouped_c16(&L, 0, role, LB_PASS_DGRAD);
    ck_assert_msg(f16, "%s: every recipe here has a bf16 or quantized fprop", recipe);
    if (f16 || d16) {
        enum { IN8 = (IN + 7) / 8 * 8, OUT8 = (OUT + 7) / 8 * 8 };
        uint16_t *y16 = malloc(2 * (size_t)n * OUT8), *dx16 = malloc(2 * (size_t)n * IN8);
        float *y2 = malloc(sizeof(float) * n * OUT), *dx2 = malloc(sizeof(float) * n * IN);
        float *dw2 = malloc(sizeof(float) * E * mat);
        for (size_t i = 0; i < (size_t)n * OUT8; i++) y16[i] = 0x7fc1;
        for (size_t i = 0; i < (size_t)n * IN8; i++) dx16[i] = 0x7fc1;
        for (size_t i = 0; i < (size_t)n * OUT; i++) y2[i] = NAN;
        for (size_t i = 0; i < (size_t)n * IN; i++) dx2[i] = NAN;
        fill(dw2, E * mat, 4);
        lb_linear_grouped_fwd(&L, 0, role, xa, w, &wc, counts, E, y2, f16 ? y16 : NULL, OUT);
        lb_linear_grouped_bwd(&L, 0, role, xa, w, &wc, counts, E, NULL, 1, dy, NULL, dx2,
                              d16 ? dx16 : NULL, dw2, 1.0f, OUT);
        for (int i = 0; i < n; i++) {
            for (int j = 0; f16 && j < OUT8; j++) {
                uint16_t want = j < OUT ? lb_f32_to_bf16(y[0][(size_t)i * OUT + j]) : 0x7fc1;
                ck_assert_msg(y16[(size_t)i * OUT8 + j] == want, "%s/%s: y16 [%d][%d]", recipe,
                              backward, i, j);
            }
            for (int j = 0; d16 && j < IN8; j++) {
                uint16_t want = j < IN ? lb_f32_to_bf16(dx[0][(size_t)i * IN + j]) : 0x7fc1;
                ck_assert_msg(dx16[(size_t)i * IN8 + j] == want, "%s/%s: dx16 [%d][%d]", recipe,
                              backward, i, j);
            }
        }
        for (size_t i = 0; f16 && i < (size_t)n * OUT; i++)
            ck_assert_msg(isnan(y2[i]), "%s/%s: y written", recipe, backward);
        for (size_t i = 0; d16 && i < (size_t)n * IN; i++)
            ck_assert_msg(isnan(dx2[i]), "%s/%s: dx written", recipe, backward);
        if (!f16) ck_assert_msg(!memcmp(y[0], y2, sizeof(float) * n * OUT), "%s: y", recipe);
        if (!d16) ck_assert_msg(!memcmp(dx[0], dx2, sizeof(float) * n * IN), "%s: dx", recipe);
        ck_assert_msg(!memcmp(dw[0], dw2, sizeof(float) * E * mat), "%s/%s: wgrad beside them",
                      recipe, backward);
        free(y16), free(dx16), free(y2), free(dx2), free(dw2);
    }
    // dw_beta 0 overwrites: NaN before, the products after, and zeros for the experts without
    // rows, equal (up to the sign of zero) to adding to zeros
    for (size_t i = 0; i < E * mat; i++) dw[0][i] = NAN, dw[1][i] = 0.0f;
    lb_linear_grouped_bwd(&L, 0, role, xa, w, &wc, counts, E, NULL, 1, dy, NULL, dx[0], NULL,
                          dw[0], 0.0f, OUT);
    lb_linear_grouped_bwd(&L, 0, role, xa, w, &wc, counts, E, NULL, 1, dy, NULL, dx[1], NULL,
                          dw[1], 1.0f, OUT);
    for (size_t i = 0; i < E * mat; i++)
        ck_assert_msg(dw[0][i] == dw[1][i], "%s/%s: grouped wgrad, beta 0: [%zu] %g, not %g",
                      recipe, backward, i, dw[0][i], dw[1][i]);
    lb_wcache_free(&L, &wc);
    lb_linear_free(&L);
    lb_contract_free(&c);
    free(x), free(w), free(dy);
    for (int r = 0; r < 2; r++) free(y[r]), free(dx[r]), free(dw[r]);
}

static void check_grouped(const char *recipe, const char *backward, int sr, int per_tensor)
{
    check_grouped_h(recipe, backward, sr, per_tensor, NULL);
}

START_TEST(test_grouped)
{
    check_grouped("fp8-block", "quantized", 0, 0);
    check_grouped("fp8-block", "quantized", 1, 0);
    check_grouped("mxfp8", "quantized", 0, 0);
    check_grouped("mxfp8", "quantized", 1, 0);
    check_grouped("nvfp4-moe", "quantized", 0, 0);
    check_grouped("nvfp4-moe", "quantized", 1, 1);
    check_grouped("mxfp4", "quantized", 0, 0);
    check_grouped_h("nvfp4-moe", "quantized", 0, 0, "random16");
    check_grouped_h("mxfp4", "quantized", 1, 0, "random16");
    check_grouped("mxfp8", "dequantized", 0, 0);
    check_grouped("bf16", "default", 0, 0);
}
END_TEST

// An expert's rows from two expert-parallel sources (segments): the grouped backward's wgrad
// is, bit for bit, the sum of each segment's own lb_linear_bwd in segment order (each
// quantized as one rank quantizes that source's micro-batch), and its dgrad the per-expert
// one (row-wise blocks do not see the segments). fp8-block's 1x128 blocks along the tokens
// also show that one group per expert (no segments) quantizes other blocks: its wgrad
// differs. With stochastic rounding the segments are not used (their streams would be keyed by
// the segment's index): the per-expert result.
static void check_segments(const char *recipe, int sr, const char *hadamard, int must_differ)
{
    enum { E = 3, P = 2 };
    const int segs[E * P] = {9, 14, 0, 0, 21, 5};   // expert 1: one source only
    int counts[E], n = 0;
    for (int j = 0; j < E; j++) n += counts[j] = segs[j * P] + segs[j * P + 1];
    char err[256];
    lb_precision_spec s = spec(recipe, "quantized");
    s.stochastic_rounding = sr;
    if (hadamard) s.wgrad_hadamard = hadamard_of(hadamard);
    lb_contract c;
    ck_assert_msg(lb_contract_resolve(&c, &s, 1, err, sizeof err) == 0, "%s", err);
    lb_linear L = {.be = be, .contract = &c, .seed = 5, .step = 3};
    const lb_role role = LB_ROLE_MOE_DOWN;
    size_t mat = (size_t)OUT * IN;
    float *x, *w, *dy, *dx[3], *dw[3];
    lb_wcache wc;
    expert_operands(&L, role, n, E, &x, &w, &dy, &wc);
    for (int r = 0; r < 3; r++) {
        dx[r] = malloc(sizeof(float) * n * IN), dw[r] = malloc(sizeof(float) * E * mat);
        fill(dw[r], E * mat, 4);
    }
    const lb_act xa = lb_act_f32(x, n, IN);
    lb_linear_grouped_bwd(&L, 0, role, xa, w, &wc, counts, E, segs, P, dy, NULL, dx[0], NULL,
                          dw[0], 1.0f, OUT);
    lb_linear_grouped_bwd(&L, 0, role, xa, w, &wc, counts, E, NULL, 1, dy, NULL, dx[2], NULL,
                          dw[2], 1.0f, OUT);
    size_t off = 0;
    for (int j = 0; j < E; j++) {
        lb_linear_bwd(&L, 0, role, lb_act_rows(xa, off, counts[j]), w, &wc, j, dy + off * OUT,
                      dx[1] + off * IN, 0.0f, NULL, 0.0f, OUT);
        for (int q = j * P; q < (j + 1) * P; q++) {   // the wgrad segment by segment
            if (!sr)
                lb_linear_bwd(&L, 0, role, lb_act_rows(xa, off, segs[q]), w, &wc, j,
                              dy + off * OUT, NULL, 0.0f, dw[1] + j * mat, 1.0f, OUT);
            off += (size_t)segs[q];
        }
    }
    ck_assert_msg(!memcmp(dx[0], dx[1], sizeof(float) * n * IN), "%s: segments: dgrad", recipe);
    ck_assert_msg(!memcmp(dx[0], dx[2], sizeof(float) * n * IN), "%s: dgrad either way", recipe);
    if (sr)
        ck_assert_msg(!memcmp(dw[0], dw[2], sizeof(float) * E * mat),
                      "%s + sr: segments should not be used", recipe);
    else
        ck_assert_msg(!memcmp(dw[0], dw[1], sizeof(float) * E * mat),
                      "%s: segments: wgrad is not the segments' sum", recipe);
    if (must_differ)
        ck_assert_msg(memcmp(dw[0], dw[2], sizeof(float) * E * mat),
                      "%s: one group per expert gives the segments' wgrad", recipe);
    lb_wcache_free(&L, &wc);
    lb_linear_free(&L);
    lb_contract_free(&c);
    free(x), free(w), free(dy);
    for (int r = 0; r < 3; r++) free(dx[r]), free(dw[r]);
}

START_TEST(test_grouped_segments)
{
    check_segments("fp8-block", 0, NULL, 1);
    check_segments("mxfp8", 0, NULL, 0);
    check_segments("nvfp4-moe", 0, NULL, 1);
    check_segments("mxfp4", 0, NULL, 1);
    check_segments("mxfp4", 0, "random16", 1);   // each segment with its expert's signs
    check_segments("mxfp8", 1, NULL, 0);
}
END_TEST

// Under expert parallelism a rank's experts draw their global index's random numbers
// (lb_linear.expert0): a rank holding experts 2 and 3 of 4 gives, with stochastic rounding and
// random Hadamard signs, what one rank gives for experts 2 and 3.
static void check_expert0(const char *recipe, int sr, const char *hadamard)
{
    enum { E = 4, LOCAL = 2 };
    const int counts[E] = {11, 6, 17, 9};
    int n = 0, off2 = 0;
    for (int j = 0; j < E; j++) n += counts[j], off2 += j < E - LOCAL ? counts[j] : 0;
    char err[256];
    lb_precision_spec s = spec(recipe, "quantized");
    s.stochastic_rounding = sr;
    if (hadamard) s.wgrad_hadamard = hadamard_of(hadamard);
    lb_contract c;
    ck_assert_msg(lb_contract_resolve(&c, &s, 1, err, sizeof err) == 0, "%s", err);
    lb_linear L1 = {.be = be, .contract = &c, .seed = 5, .step = 3};
    lb_linear L2 = {.be = be, .contract = &c, .seed = 5, .step = 3, .expert0 = E - LOCAL};
    const lb_role role = LB_ROLE_MOE_GATE_UP;
    const size_t mat = (size_t)OUT * IN;
    float *x, *w, *dy;
    lb_wcache wc1, wc2;
    expert_operands(&L1, role, n, E, &x, &w, &dy, &wc1);
    memset(&wc2, 0, sizeof wc2);
    lb_wcache_build(&L2, &wc2, 0, role, w + (E - LOCAL) * mat, LOCAL, OUT, IN);
    float *dx1 = malloc(sizeof(float) * n * IN), *dw1 = calloc(E * mat, sizeof(float));
    float *dx2 = malloc(sizeof(float) * n * IN), *dw2 = calloc(LOCAL * mat, sizeof(float));
    lb_linear_grouped_bwd(&L1, 0, role, lb_act_f32(x, n, IN), w, &wc1, counts, E, NULL, 1, dy,
                          NULL, dx1, NULL, dw1, 0.0f, OUT);
    lb_linear_grouped_bwd(&L2, 0, role, lb_act_f32(x + (size_t)off2 * IN, n - off2, IN),
                          w + (E - LOCAL) * mat, &wc2, counts + E - LOCAL, LOCAL, NULL, 1,
                          dy + (size_t)off2 * OUT, NULL, dx2, NULL, dw2, 0.0f, OUT);
    ck_assert_msg(!memcmp(dx1 + (size_t)off2 * IN, dx2, sizeof(float) * (n - off2) * IN),
                  "%s: experts 2, 3 on their own rank: dgrad", recipe);
    ck_assert_msg(!memcmp(dw1 + (E - LOCAL) * mat, dw2, sizeof(float) * LOCAL * mat),
                  "%s: experts 2, 3 on their own rank: wgrad", recipe);
    lb_wcache_free(&L1, &wc1);
    lb_wcache_free(&L2, &wc2);
    lb_linear_free(&L1);
    lb_linear_free(&L2);
    lb_contract_free(&c);
    free(x), free(w), free(dy), free(dx1), free(dw1), free(dx2), free(dw2);
}

START_TEST(test_expert_draws_global)
{
    check_expert0("mxfp8", 1, NULL);
    check_expert0("mxfp4", 0, "random16");
    check_expert0("mxfp4", 1, "random16");
}
END_TEST

// Weights that read one x (q, k, v): lb_linear_fwd_shared / _bwd_shared give bit for bit what
// separate lb_linear_fwd / _bwd calls give (x quantized once for the fprops and once for the
// wgrads, dx summed over the weights in order), with stochastic rounding and random Hadamard
// signs too, and dw_beta 0 and 1 side by side.
static void check_shared(const char *recipe, const char *backward, int sr, const char *hadamard)
{
    enum { W = 3 };
    const int out[W] = {OUT, 8, 16};
    char err[256];
    lb_precision_spec s = spec(recipe, backward);
    s.stochastic_rounding = sr;
    if (hadamard) s.wgrad_hadamard = hadamard_of(hadamard);
    lb_contract c;
    ck_assert_msg(lb_contract_resolve(&c, &s, 1, err, sizeof err) == 0, "%s", err);
    lb_linear L = {.be = be, .contract = &c, .seed = 5, .step = 3};
    const lb_role role = LB_ROLE_ATTN_QKV;
    float *x = malloc(sizeof(float) * N * IN), *dx[2], *w[W], *dy[W], *y[2][W], *dw[2][W];
    lb_wcache wc[W];
    const float betas[W] = {1.0f, 0.0f, 1.0f};
    fill(x, (size_t)N * IN, 1);
    for (int i = 0; i < W; i++) {
        w[i] = malloc(sizeof(float) * out[i] * IN), dy[i] = malloc(sizeof(float) * N * out[i]);
        fill(w[i], (size_t)out[i] * IN, 2 + (uint64_t)i);
        fill(dy[i], (size_t)N * out[i], 5 + (uint64_t)i);
        memset(&wc[i], 0, sizeof wc[i]);
        lb_wcache_build(&L, &wc[i], 0, role, w[i], 1, out[i], IN);
        for (int r = 0; r < 2; r++) {
            y[r][i] = malloc(sizeof(float) * N * out[i]);
            dw[r][i] = malloc(sizeof(float) * out[i] * IN);
            fill(dw[r][i], (size_t)out[i] * IN, 9);   // beta 1 accumulates, beta 0 overwrites
        }
    }
    for (int r = 0; r < 2; r++) dx[r] = malloc(sizeof(float) * N * IN);
    const float *ws[W] = {w[0], w[1], w[2]}, *dys[W] = {dy[0], dy[1], dy[2]};
    const lb_wcache *cs[W] = {&wc[0], &wc[1], &wc[2]};
    const lb_act xa = lb_act_f32(x, N, IN);
    lb_linear_fwd_shared(&L, 0, role, xa, W, ws, cs, y[0], NULL, out);
    lb_linear_bwd_shared(&L, 0, role, xa, W, ws, cs, dys, dx[0], dw[0], betas, out);
    for (int i = 0; i < W; i++) {
        lb_linear_fwd(&L, 0, role, xa, w[i], &wc[i], 0, y[1][i], out[i], 0.0f);
        lb_linear_bwd(&L, 0, role, xa, w[i], &wc[i], 0, dy[i], dx[1], i ? 1.0f : 0.0f, dw[1][i],
                      betas[i], out[i]);
    }
    for (int i = 0; i < W; i++) {
        ck_assert_msg(!memcmp(y[0][i], y[1][i], sizeof(float) * N * out[i]),
                      "%s/%s sr %d: shared fprop %d", recipe, backward, sr, i);
        ck_assert_msg(!memcmp(dw[0][i], dw[1][i], sizeof(float) * out[i] * IN),
                      "%s/%s sr %d: shared wgrad %d", recipe, backward, sr, i);
    }
    ck_assert_msg(!memcmp(dx[0], dx[1], sizeof(float) * N * IN), "%s/%s sr %d: shared dgrad",
                  recipe, backward, sr);
    if (lb_linear_plain16(&L, 0, role)) {   // y16: outputs 0 and 2 in bf16, the fp32 ones rounded
        uint16_t *y16[W] = {malloc(2 * (size_t)N * out[0]), NULL, malloc(2 * (size_t)N * out[2])};
        lb_linear_fwd_shared(&L, 0, role, xa, W, ws, cs, y[1], y16, out);
        for (int i = 0; i < W; i += 2) {   // out[i] a multiple of 8: no padding
            for (size_t j = 0; j < (size_t)N * out[i]; j++)
                ck_assert_msg(y16[i][j] == lb_f32_to_bf16(y[0][i][j]),
                              "%s: shared fprop %d in bf16, element %zu", recipe, i, j);
            free(y16[i]);
        }
        ck_assert_msg(!memcmp(y[0][1], y[1][1], sizeof(float) * N * out[1]),
                      "%s: shared fprop 1 beside bf16 outputs", recipe);
    }
    for (int i = 0; i < W; i++) {
        lb_wcache_free(&L, &wc[i]);
        free(w[i]), free(dy[i]);
        for (int r = 0; r < 2; r++) free(y[r][i]), free(dw[r][i]);
    }
    lb_linear_free(&L);
    lb_contract_free(&c);
    free(x), free(dx[0]), free(dx[1]);
}

START_TEST(test_shared)
{
    check_shared("fp8-block", "quantized", 0, NULL);
    check_shared("fp8-block", "quantized", 1, NULL);
    check_shared("mxfp8", "quantized", 1, NULL);
    check_shared("nvfp4-moe", "quantized", 1, "random16");
    check_shared("mxfp8", "dequantized", 0, NULL);
    check_shared("bf16", "default", 0, NULL);
    check_shared("fp32", "default", 0, NULL);
}
END_TEST

START_TEST(test_fp32) { check_recipe("fp32", "default", LB_FMT_FP32, 0); }
END_TEST
START_TEST(test_bf16) { check_recipe("bf16", "default", LB_FMT_BF16, 0); }
END_TEST
START_TEST(test_fp8_block) { check_recipe("fp8-block", "quantized", LB_FMT_FP8_BLOCK, 0); }
END_TEST
START_TEST(test_mxfp8) { check_recipe("mxfp8", "quantized", LB_FMT_MXFP8, 0); }
END_TEST
START_TEST(test_nvfp4) { check_recipe("nvfp4-moe", "quantized", LB_FMT_NVFP4, 16); }
END_TEST
START_TEST(test_mxfp4_h16) { check_recipe("mxfp4", "quantized", LB_FMT_MXFP4, 16); }
END_TEST
START_TEST(test_dequantized) { check_recipe("mxfp8", "dequantized", LB_FMT_MXFP8, 0); }
END_TEST
START_TEST(test_high) { check_recipe("fp8-block", "high", LB_FMT_FP8_BLOCK, 0); }
END_TEST

// lb_wcache_bytes is what lb_wcache_build allocates (`lowbit info` predicts memory with it):
// every recipe and backward mode, one matrix and several experts, counted through a backend
// whose alloc and qmat_alloc add up what they hand out.
static size_t counted;
static void *count_alloc(lb_backend *b, size_t bytes)
{
    counted += bytes;
    return be->alloc(be, bytes);
}
static void count_qmat_alloc(lb_backend *b, struct lb_qmat *q, int rows, int cols,
                             const lb_quant_args *a)
{
    be->qmat_alloc(be, q, rows, cols, a);
    counted += lb_qmat_data_bytes(q) + lb_qmat_scale_bytes(q) + (size_t)q->nscale2 * sizeof(float);
}

START_TEST(test_wcache_bytes)
{
    const char *modes[] = {"default", "quantized", "dequantized"};
    lb_backend cb = *be;
    cb.alloc = count_alloc;
    cb.qmat_alloc = count_qmat_alloc;
    float *w = malloc(sizeof(float) * 3 * OUT * IN);
    fill(w, (size_t)3 * OUT * IN, 2);
    int nonzero = 0;
    for (int r = 0; r < lb_recipe_count(); r++)
        for (int b = 0; b < 3; b++)
            for (int E = 1; E <= 3; E += 2) {
                char err[256];
                lb_precision_spec s = spec(lb_recipe_name(r), modes[b]);
                lb_contract c;
                ck_assert_msg(lb_contract_resolve(&c, &s, 1, err, sizeof err) == 0, "%s", err);
                lb_linear L = {.be = &cb, .contract = &c, .seed = 5, .step = 3};
                const lb_role role = E > 1 ? LB_ROLE_MOE_GATE_UP : LB_ROLE_ATTN_QKV;
                lb_wcache wc;
                memset(&wc, 0, sizeof wc);
                counted = 0;
                lb_wcache_build(&L, &wc, 0, role, w, E, OUT, IN);
                const size_t want = lb_wcache_bytes(&L, 0, role, E, OUT, IN);
                ck_assert_msg(counted == want, "%s/%s, %d matrices: the cache took %zu bytes, "
                              "lb_wcache_bytes says %zu", lb_recipe_name(r), modes[b], E, counted, want);
                nonzero += want > 0;
                lb_wcache_free(&L, &wc);
                lb_contract_free(&c);
            }
    ck_assert_int_ge(nonzero, 20);   // fp32 alone keeps nothing
    free(w);
}
END_TEST

// `test_linear etp` under mpirun (tests/test_linear_etp.sh): experts cut over the ranks as the
// model cuts them (gate/up: each rank's rows of gate and of up; down: its columns), NVFP4
// with one second level per tensor. With lb_linear.etp each rank's weight cache holds, for its
// rows, the values one rank's cache of the whole expert holds (s2 from the whole expert);
// without it a shard that lacks the expert's largest magnitude differs. Expert 0's largest
// element is on the last rank, expert 1's first rank holds only zeros, expert 2 is plain.
static int etp_failures;

static void etp_check(int ok, const char *what, int rank)
{
    if (!ok) {
        fprintf(stderr, "test_linear etp: rank %d: %s\n", rank, what);
        etp_failures++;
    }
}

// Element (i, j) of rank r's shard of an expert (F columns of gate and of up, FL a rank) is
// element (*gi, *gj) of the whole expert.
static void etp_place(int gu, int F, int FL, int r, int i, int j, int *gi, int *gj)
{
    *gi = gu ? (i < FL ? r * FL + i : F + r * FL + i - FL) : i;
    *gj = gu ? j : r * FL + j;
}

static void etp_case(lb_comm *world, lb_role role, const char *blocks)
{
    enum { E = 3, F = 32, H = 48 };
    const int P = world->size, r = world->rank, FL = F / P;
    const int gu = role == LB_ROLE_MOE_GATE_UP;
    const int out = gu ? 2 * F : H, in = gu ? H : F;            // the whole expert (out, in)
    const int outl = gu ? 2 * FL : H, inl = gu ? H : FL;        // this rank's shard
    char err[256], what[160];
    lb_precision_spec s = spec("nvfp4-moe", "quantized");
    s.nvfp4_weight_2d = !strcmp(blocks, "16x16");
    lb_contract c;
    if (lb_contract_resolve(&c, &s, 1, err, sizeof err) != 0) lb_die("%s", err);
    float *w = malloc(sizeof(float) * E * out * in), *wl = malloc(sizeof(float) * E * outl * inl);
    fill(w, (size_t)E * out * in, 7);
    // (row, col) of the whole expert -> its owner and its place in the owner's shard
    for (int e = 0; e < E; e++)
        for (int i = 0; i < out; i++)
            for (int j = 0; j < in; j++) {
                const int f = gu ? i % F : j, owner = f / FL;
                float *x = &w[((size_t)e * out + i) * in + j];
                if (e == 0 && owner == P - 1) *x *= 16.0f;
                if (e == 1 && owner == 0) *x = 0.0f;
            }
    for (int e = 0; e < E; e++)
        for (int i = 0; i < outl; i++)
            for (int j = 0; j < inl; j++) {
                int gi, gj;
                etp_place(gu, F, FL, r, i, j, &gi, &gj);
                wl[((size_t)e * outl + i) * inl + j] = w[((size_t)e * out + gi) * in + gj];
            }
    lb_linear L1 = {.be = be, .contract = &c}, L2 = {.be = be, .contract = &c, .etp = world},
              L3 = {.be = be, .contract = &c};
    lb_wcache w1, w2, w3;
    memset(&w1, 0, sizeof w1), memset(&w2, 0, sizeof w2), memset(&w3, 0, sizeof w3);
    lb_wcache_build(&L1, &w1, 0, role, w, E, out, in);
    lb_wcache_build(&L2, &w2, 0, role, wl, E, outl, inl);
    lb_wcache_build(&L3, &w3, 0, role, wl, E, outl, inl);
    float *d1 = malloc(sizeof(float) * out * in), *d2 = malloc(sizeof(float) * outl * inl);
    for (int e = 0; e < E; e++) {
        // without etp a shard matches only where it holds the expert's largest magnitude
        // (never expert 0's first rank nor expert 1's): the check can fail
        float ag = 0.0f, al = 0.0f;
        for (size_t i = 0; i < (size_t)out * in; i++) ag = fmaxf(ag, fabsf(w[e * out * in + i]));
        for (size_t i = 0; i < (size_t)outl * inl; i++)
            al = fmaxf(al, fabsf(wl[e * outl * inl + i]));
        for (int col = 0; col < 2; col++) {
            const lb_qmat *q1 = col ? &w1.col[e] : &w1.row[e];
            lb_dequantize(d1, q1);   // col: W^T
            for (int k = 0; k < 2; k++) {
                const lb_qmat *q = k ? (col ? &w3.col[e] : &w3.row[e])
                                     : (col ? &w2.col[e] : &w2.row[e]);
                lb_dequantize(d2, q);
                int same = q->scale2[0] == q1->scale2[0];
                for (int i = 0; i < outl; i++)
                    for (int j = 0; j < inl; j++) {
                        int gi, gj;
                        etp_place(gu, F, FL, r, i, j, &gi, &gj);
                        const float a = col ? d2[(size_t)j * outl + i] : d2[(size_t)i * inl + j];
                        const float b = col ? d1[(size_t)gj * out + gi] : d1[(size_t)gi * in + gj];
                        same &= memcmp(&a, &b, sizeof a) == 0;
                    }
                snprintf(what, sizeof what, "%s %s expert %d %s copy: %s", gu ? "gate/up" : "down",
                         blocks, e, col ? "column-wise" : "row-wise",
                         k ? "without etp the same as one rank's" : "not one rank's");
                etp_check(same == (k == 0 || al == ag), what, r);
            }
        }
    }
    lb_wcache_free(&L1, &w1), lb_wcache_free(&L2, &w2), lb_wcache_free(&L3, &w3);
    lb_linear_free(&L1), lb_linear_free(&L2), lb_linear_free(&L3);
    lb_contract_free(&c);
    free(w), free(wl), free(d1), free(d2);
}

// Backend copies of host arrays and back (the CPU's are host memory; `test_linear etp cuda`
// runs the activation cases on the GPU).
static float *bput(const float *h, size_t n)
{
    float *d = be->alloc(be, n * sizeof *d + 4);
    be->upload(be, d, h, n * sizeof *d);
    return d;
}

static float *bget(const float *d, size_t n)
{
    float *h = malloc(n * sizeof *h + 4);
    be->download(be, h, d, n * sizeof *h);
    return h;
}

// Rank r's shard of (rows, cols) values whose row (rows_cut) or column (!rows_cut) index is an
// expert's feature index of a gate/up (gu: F gate then F up) or down matrix, as etp_place maps.
static float *etp_shard(const float *w, int count, int rows, int cols, int gu, int F, int FL,
                        int r, int rows_cut, int *lrows, int *lcols)
{
    *lrows = rows_cut ? (gu ? 2 * FL : FL) : rows;
    *lcols = rows_cut ? cols : (gu ? 2 * FL : FL);
    float *l = malloc(sizeof(float) * count * *lrows * *lcols + 4);
    for (int e = 0; e < count; e++)
        for (int i = 0; i < *lrows; i++)
            for (int j = 0; j < *lcols; j++) {
                const int f = rows_cut ? i : j, lf = gu ? (f < FL ? r * FL + f : F + r * FL + f - FL)
                                                        : r * FL + f;
                const int gi = rows_cut ? lf : i, gj = rows_cut ? j : lf;
                l[((size_t)e * *lrows + i) * *lcols + j] = w[((size_t)e * rows + gi) * cols + gj];
            }
    return l;
}

// The experts' GEMMs with their features cut over the ranks (gate/up: each rank's outputs of
// gate and of up; down: its inputs), NVFP4 with per-token or per-tensor second levels and the
// wgrad's Hadamard 16: with lb_linear.etp every quantized operand that spans the cut features
// (gate/up's dy, down's x, row-wise and column-wise) takes the whole's second levels
// (lb_quant_args.amax). So a rank's share of each product is one rank's: the products along the
// shard (gate/up's y and dW, down's dx and dW) bit for bit, the partial sums over the shard
// (gate/up's dx, down's y) summed over the ranks within 1e-5 of the largest value (fp32
// partials). Without etp some of them differ (the tokens' largest features are put on
// different ranks), so the check can fail.
static void etp_act_case(lb_comm *world, lb_role role, const char *scale)
{
    enum { E = 2, F = 32, H = 48, N = 40 };
    const int counts[E] = {23, 17};
    const int P = world->size, r = world->rank, FL = F / P;
    const int gu = role == LB_ROLE_MOE_GATE_UP;
    const int out = gu ? 2 * F : H, in = gu ? H : F;
    char err[256];
    lb_precision_spec s = spec("nvfp4-moe", "quantized");
    s.nvfp4_per_tensor = !strcmp(scale, "per-tensor");
    lb_contract c;
    if (lb_contract_resolve(&c, &s, 1, err, sizeof err) != 0) lb_die("%s", err);
    float *w = malloc(sizeof(float) * E * out * in), *x = malloc(sizeof(float) * N * in),
          *dy = malloc(sizeof(float) * N * out);
    fill(w, (size_t)E * out * in, 21);
    fill(x, (size_t)N * in, 22);
    fill(dy, (size_t)N * out, 23);
    // token t's cut operand is largest on rank t % P (or nowhere special: t % 5 == 4)
    float *cut = gu ? dy : x;
    const int ccols = gu ? out : in;
    for (int t = 0; t < N; t++)
        for (int j = 0; j < ccols; j++) {
            const int owner = (gu ? j % F : j) / FL;
            if (t % 5 != 4 && owner == t % P) cut[(size_t)t * ccols + j] *= 16.0f;
        }
    int outl, inl, nr, nc;
    float *wl = etp_shard(w, E, out, in, gu, F, FL, r, gu, &outl, &inl);
    float *xl = gu ? NULL : etp_shard(x, 1, N, in, 0, F, FL, r, 0, &nr, &nc);
    float *dyl = gu ? etp_shard(dy, 1, N, out, 1, F, FL, r, 0, &nr, &nc) : NULL;
    // one rank's products, then this rank's with etp (k 0) and without (k 1)
    float *y1, *dx1, *dw1;
    {
        lb_linear L = {.be = be, .contract = &c};
        lb_wcache wc;
        memset(&wc, 0, sizeof wc);
        float *bw = bput(w, (size_t)E * out * in), *bx = bput(x, (size_t)N * in),
              *bdy = bput(dy, (size_t)N * out);
        float *by = bput(dy, (size_t)N * out), *bdx = bput(x, (size_t)N * in),
              *bdw = bput(w, (size_t)E * out * in);
        lb_wcache_build(&L, &wc, 0, role, bw, E, out, in);
        lb_linear_grouped_fwd(&L, 0, role, lb_act_f32(bx, N, in), bw, &wc, counts, E, by, NULL,
                              out);
        lb_linear_grouped_bwd(&L, 0, role, lb_act_f32(bx, N, in), bw, &wc, counts, E, NULL, 1,
                              bdy, NULL, bdx, NULL, bdw, 0.0f, out);
        y1 = bget(by, (size_t)N * out), dx1 = bget(bdx, (size_t)N * in);
        dw1 = bget(bdw, (size_t)E * out * in);
        lb_wcache_free(&L, &wc), lb_linear_free(&L);
        be->free(be, bw), be->free(be, bx), be->free(be, bdy), be->free(be, by);
        be->free(be, bdx), be->free(be, bdw);
    }
    const float *xs = gu ? x : xl, *dys = gu ? dyl : dy;
    int fails[2] = {0, 0};
    for (int k = 0; k < 2; k++) {
        lb_linear L = {.be = be, .contract = &c, .etp = k ? NULL : world};
        lb_wcache wc;
        memset(&wc, 0, sizeof wc);
        float *bw = bput(wl, (size_t)E * outl * inl), *bx = bput(xs, (size_t)N * inl),
              *bdy = bput(dys, (size_t)N * outl);
        float *by = bput(dys, (size_t)N * outl), *bdx = bput(xs, (size_t)N * inl),
              *bdw = bput(wl, (size_t)E * outl * inl);
        // the weights' second levels are the whole's in both runs (etp_case tests them)
        L.etp = world;
        lb_wcache_build(&L, &wc, 0, role, bw, E, outl, inl);
        L.etp = k ? NULL : world;
        lb_linear_grouped_fwd(&L, 0, role, lb_act_f32(bx, N, inl), bw, &wc, counts, E, by, NULL,
                              outl);
        lb_linear_grouped_bwd(&L, 0, role, lb_act_f32(bx, N, inl), bw, &wc, counts, E, NULL, 1,
                              bdy, NULL, bdx, NULL, bdw, 0.0f, outl);
        float *y = bget(by, (size_t)N * outl), *dx = bget(bdx, (size_t)N * inl),
              *dw = bget(bdw, (size_t)E * outl * inl);
        // along the shard: dW (both), y (gate/up), dx (down); bitwise
        int dnr, dnc;
        float *w1l = etp_shard(dw1, E, out, in, gu, F, FL, r, gu, &dnr, &dnc);
        fails[k] += memcmp(dw, w1l, sizeof(float) * E * outl * inl) != 0;
        float *a1 = gu ? etp_shard(y1, 1, N, out, 1, F, FL, r, 0, &dnr, &dnc)
                       : etp_shard(dx1, 1, N, in, 0, F, FL, r, 0, &dnr, &dnc);
        fails[k] += memcmp(gu ? y : dx, a1, sizeof(float) * N * (gu ? outl : inl)) != 0;
        // partial sums: gate/up's dx (N, H), down's y (N, H), summed in rank order
        const float *part = gu ? dx : y, *ref = gu ? dx1 : y1;
        float *all = malloc(sizeof(float) * N * H * P);
        lb_comm_host_all_gather(world, part, all, sizeof(float) * N * H);
        double dmax = 0.0, rmax = 0.0;
        for (int i = 0; i < N * H; i++) {
            float sum = all[i];
            for (int q = 1; q < P; q++) sum += all[(size_t)q * N * H + i];
            dmax = fmax(dmax, fabs((double)sum - ref[i]));
            rmax = fmax(rmax, fabs((double)ref[i]));
        }
        fails[k] += !(dmax <= 1e-5 * rmax);
        if (k == 0 && fails[0])
            fprintf(stderr, "test_linear etp: rank %d: %s %s: %d of 3 products not one rank's "
                    "(partial sums %.3g of %.3g)\n", r, gu ? "gate/up" : "down", scale, fails[0],
                    dmax, rmax);
        free(w1l), free(a1), free(all), free(y), free(dx), free(dw);
        lb_wcache_free(&L, &wc), lb_linear_free(&L);
        be->free(be, bw), be->free(be, bx), be->free(be, bdy), be->free(be, by);
        be->free(be, bdx), be->free(be, bdw);
    }
    etp_check(fails[0] == 0, "activations with etp: not one rank's products", r);
    // every rank's check without etp: one rank may hold every largest feature of its tokens
    const double without = lb_comm_allreduce_sum(world, (double)fails[1]);
    etp_check(without > 0, "activations without etp: one rank's products (the check cannot fail)",
              r);
    if (r == 0)
        printf("test_linear etp: %s %s activations: %s products one rank's with etp, %g "
               "differing without\n", gu ? "gate/up" : "down", scale, fails[0] ? "not all" : "all",
               without);
    lb_contract_free(&c);
    free(w), free(x), free(dy), free(wl), free(xl), free(dyl), free(y1), free(dx1), free(dw1);
}

static int etp_main(int argc, char **argv)
{
    const int cuda = argc > 2 && strcmp(argv[2], "cuda") == 0;
    lb_comm world;
    lb_comm_init(&world, &argc, &argv);
    if (cuda) {   // every rank on the first GPU (the group's all-gathers are MPI's, on the host)
        char err[256];
        be = lb_backend_cuda_create(0, err, sizeof err);
        if (!be) lb_die("test_linear etp cuda: %s", err);
    }
    if (32 % world.size != 0 || (32 / world.size) % 16 != 0)
        lb_die("test_linear etp: 2 ranks (F 32 in NVFP4 blocks of 16 a shard), not %d", world.size);
    const char *blocks[2] = {"16x16", "1x16"}, *scales[2] = {"per-token", "per-tensor"};
    for (int b = 0; b < 2 && be == cpu_be; b++) {   // the weight caches' bytes, on the host
        etp_case(&world, LB_ROLE_MOE_GATE_UP, blocks[b]);
        etp_case(&world, LB_ROLE_MOE_DOWN, blocks[b]);
    }
    for (int k = 0; k < 2; k++) {
        etp_act_case(&world, LB_ROLE_MOE_GATE_UP, scales[k]);
        etp_act_case(&world, LB_ROLE_MOE_DOWN, scales[k]);
    }
    const double bad = lb_comm_allreduce_sum(&world, (double)etp_failures);
    if (world.rank == 0)
        printf("test_linear etp: %d ranks, %s backend, %s\n", world.size, be->name,
               bad ? "FAILED" : "passed");
    if (be != cpu_be) be->destroy(be);
    lb_comm_finalize(&world);
    return bad ? 1 : 0;
}

int main(int argc, char **argv)
{
    char err[256];
    be = cpu_be = lb_backend_cpu_create(0, err, sizeof err);
    if (!be) return 1;
    if (argc > 1 && strcmp(argv[1], "etp") == 0) return etp_main(argc, argv);
    Suite *s = suite_create("linear");
    TCase *tc = tcase_create("linear");
    tcase_add_test(tc, test_fp32);
    tcase_add_test(tc, test_bf16);
    tcase_add_test(tc, test_fp8_block);
    tcase_add_test(tc, test_mxfp8);
    tcase_add_test(tc, test_nvfp4);
    tcase_add_test(tc, test_mxfp4_h16);
    tcase_add_test(tc, test_dequantized);
    tcase_add_test(tc, test_high);
    tcase_add_test(tc, test_grouped);
    tcase_add_test(tc, test_grouped_segments);
    tcase_add_test(tc, test_expert_draws_global);
    tcase_add_test(tc, test_shared);
    tcase_add_test(tc, test_wcache_bytes);
    suite_add_tcase(s, tc);
    return lb_test_run(s);
}
