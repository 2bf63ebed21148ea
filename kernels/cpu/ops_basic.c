// ops_basic.c: GEMM (gemm.c's deterministic kernel or OpenBLAS), elementwise ops, sumsq,
// embedding, RMSNorm, RoPE and SwiGLU for the CPU reference backend.
//
// Every output element is produced by one thread in one fixed order, so results depend neither
// on the thread count nor on the other rows of the call. Reductions that feed statistics
// (norm sums, sumsq, weight-gradient column sums) accumulate in double.
#include "kernels/cpu/cpu.h"
#include "kernels/common.h"
#include "kernels/quant/quant.h"

#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

// --- GEMM -------------------------------------------------------------------------------------

// dst (n / len, len) = src16 (n / len, pad8(len)) widened (to_bf16's layout).
static void widen_bf16(lb_backend *be, float *dst, const uint16_t *src16, size_t n, int len)
{
    const int ld = (len + 7) / 8 * 8;
    const size_t rows = n / (size_t)len;
    #pragma omp parallel for num_threads(lb_cpu_threads(be)) if (n >= LB_CPU_PAR_MIN)
    for (size_t r = 0; r < rows; r++)
        for (int c = 0; c < len; c++) dst[r * len + c] = lb_bf16_to_f32(src16[r * ld + c]);
}

float *lb_cpu_c32(lb_backend *be, size_t n)
{
    lb_cpu_ctx *cx = be->ctx;
    if (cx->c32_n < n) {   // grow-only, as round
        free(cx->c32);
        cx->c32 = lb_malloc(n * sizeof(float));
        cx->c32_n = n;
    }
    return cx->c32;
}

void lb_cpu_store_c16(lb_backend *be, uint16_t *c16, const float *c, int m, int n)
{
    const int ld = (n + 7) / 8 * 8;   // the pad columns are not written
    #pragma omp parallel for num_threads(lb_cpu_threads(be)) \
        if ((size_t)m * n >= LB_CPU_PAR_MIN)
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) c16[(size_t)i * ld + j] = lb_f32_to_bf16(c[(size_t)i * n + j]);
}

// C (m, n) = alpha * op(A) (m, k) * op(B) (k, n) + beta * C, all row-major and contiguous.
// be->deterministic: gemm.c's kernel (one fixed order per element, batch invariant); otherwise
// OpenBLAS, faster but its bits depend on m, the row's position and on some CPUs the threads.
// c16 (kernels.h): C is computed in fp32 as without it, into scratch, and each element rounded
// once into c16: the GPU's bits, which round the same fp32 value where they store it.
static void cpu_gemm(lb_backend *be, const lb_gemm_args *g)
{
    if (g->c16) {
        if (!g->bf16 || g->beta != 0.0f)
            lb_die("gemm: a bf16 output (c16) needs bf16 operands and beta 0 (bf16 %d, beta %g)",
                   g->bf16, (double)g->beta);
        if (g->m < 0 || g->n < 0 || g->k < 0)
            lb_die("gemm: negative size (m %d, n %d, k %d)", g->m, g->n, g->k);
        if (g->m == 0 || g->n == 0) return;
        lb_gemm_args r = *g;
        r.c = lb_cpu_c32(be, (size_t)g->m * g->n), r.c16 = NULL;
        cpu_gemm(be, &r);   // k 0: zeros, so c16 gets bf16 zeros
        lb_cpu_store_c16(be, g->c16, r.c, g->m, g->n);
        return;
    }
    if (g->bf16 && g->m > 0 && g->n > 0 && g->k > 0) {   // the rounded operands' product
        lb_cpu_ctx *cx = be->ctx;
        size_t na = (size_t)g->m * g->k, nb = (size_t)g->k * g->n;
        if (cx->round_n < na + nb) {   // grow-only: no allocation per call
            free(cx->round);
            cx->round = lb_malloc((na + nb) * sizeof(float));
            cx->round_n = na + nb;
        }
        float *ra = cx->round, *rb = ra + na;
        // the same values, widened from a bf16 copy where there is one
        if (g->a16) widen_bf16(be, ra, g->a16, na, g->transa ? g->m : g->k);
        else be->round_bf16(be, ra, g->a, na);
        if (g->b16) widen_bf16(be, rb, g->b16, nb, g->transb ? g->k : g->n);
        else be->round_bf16(be, rb, g->b, nb);
        lb_gemm_args r = *g;
        r.a = ra, r.b = rb, r.bf16 = 0, r.b16 = r.a16 = NULL;
        cpu_gemm(be, &r);
        return;
    }
    int nt = lb_cpu_threads(be);
    if (be->deterministic) {
        lb_cpu_gemm_det(g, nt, LB_CPU_GEMM_AUTO);
        return;
    }
    if (lb_cpu_gemm_trivial(g)) return;
    // OpenBLAS's thread count is process-wide; set it to this backend's before each call.
    if (openblas_get_num_threads() != nt) openblas_set_num_threads(nt);
    int lda = g->transa ? g->m : g->k;   // A stored (k, m) when transposed, else (m, k)
    int ldb = g->transb ? g->k : g->n;   // B stored (n, k) when transposed, else (k, n)
    cblas_sgemm(CblasRowMajor, g->transa ? CblasTrans : CblasNoTrans,
                g->transb ? CblasTrans : CblasNoTrans, g->m, g->n, g->k, g->alpha, g->a, lda,
                g->b, ldb, g->beta, g->c, g->n);
}

// One call per group, in order. Empty groups are skipped inside cpu_gemm (k == 0 with beta 0
// zeroes C, so an expert that received no tokens still yields a defined output).
static void cpu_gemm_grouped(lb_backend *be, int count, const lb_gemm_args *args)
{
    for (int i = 0; i < count; i++) cpu_gemm(be, &args[i]);
}

// gemm_experts as the groups of gemm_grouped (backend memory is host memory here).
static void cpu_gemm_experts(lb_backend *be, const lb_gemm_experts_args *x)
{
    if (x->qa) {
        lb_qmat *v = lb_calloc(x->e ? (size_t)x->e : 1, sizeof *v);
        lb_gemm_q_args *g = lb_experts_qgroups(x, x->counts, v);
        be->gemm_q_grouped(be, x->e, g);
        free(g), free(v);
        return;
    }
    lb_gemm_args *g = lb_experts_groups(x, x->counts);
    cpu_gemm_grouped(be, x->e, g);
    free(g);
}

// --- elementwise and reductions -----------------------------------------------------------------

static void cpu_add(lb_backend *be, float *y, const float *x, size_t n)
{
    #pragma omp parallel for num_threads(lb_cpu_threads(be)) if (n >= LB_CPU_PAR_MIN)
    for (size_t i = 0; i < n; i++) y[i] += x[i];
}

static void cpu_add16(lb_backend *be, uint16_t *y16, lb_act x, const float *r)
{
    const int n = x.rows, c = x.cols, ld = (c + 7) & ~7;
    const uint16_t *x16 = x.type == LB_ACT_BF16 ? x.p : NULL;
    const float *x32 = x16 ? NULL : x.p;
    #pragma omp parallel for num_threads(lb_cpu_threads(be)) if ((size_t)n * c >= LB_CPU_PAR_MIN)
    for (int i = 0; i < n; i++) {
        uint16_t *yi = y16 + (size_t)i * ld;
        const float *ri = r + (size_t)i * c;
        for (int j = 0; j < c; j++) {   // in place: element j is read before it is written
            float xv = x16 ? lb_bf16_to_f32(x16[(size_t)i * x.ld + j]) : x32[(size_t)i * x.ld + j];
            yi[j] = lb_f32_to_bf16(xv + ri[j]);
        }
        for (int j = c; j < ld; j++) yi[j] = 0;
    }
}

static void cpu_scale(lb_backend *be, float *x, float s, size_t n)
{
    #pragma omp parallel for num_threads(lb_cpu_threads(be)) if (n >= LB_CPU_PAR_MIN)
    for (size_t i = 0; i < n; i++) x[i] *= s;
}

static void cpu_f64_to_f32(lb_backend *be, float *y, const double *x, size_t n)
{
    #pragma omp parallel for num_threads(lb_cpu_threads(be)) if (n >= LB_CPU_PAR_MIN)
    for (size_t i = 0; i < n; i++) y[i] = (float)x[i];
}

// Fixed-size chunks, each summed sequentially in double, then the partials summed in chunk
// order: the grouping is a function of n alone, never of the thread count.
#define SUMSQ_CHUNK 4096

static double cpu_sumsq(lb_backend *be, const float *x, size_t n)
{
    size_t nchunks = (n + SUMSQ_CHUNK - 1) / SUMSQ_CHUNK;
    if (nchunks == 0) return 0.0;
    double stack[64];
    double *part = nchunks <= 64 ? stack : lb_malloc(nchunks * sizeof(double));
    #pragma omp parallel for num_threads(lb_cpu_threads(be)) if (nchunks > 1)
    for (size_t ch = 0; ch < nchunks; ch++) {
        size_t lo = ch * SUMSQ_CHUNK, hi = lo + SUMSQ_CHUNK < n ? lo + SUMSQ_CHUNK : n;
        double s = 0.0;
        for (size_t i = lo; i < hi; i++) s += (double)x[i] * x[i];
        part[ch] = s;
    }
    double total = 0.0;
    for (size_t ch = 0; ch < nchunks; ch++) total += part[ch];
    if (part != stack) free(part);
    return total;
}

// --- embedding --------------------------------------------------------------------------------

// out (n, c) = wte[tokens[i]]; wte (vocab, c)
static void cpu_embedding_fwd(lb_backend *be, float *out, const int32_t *tokens, const float *wte,
                              int n, int c)
{
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0) lb_die("embedding_fwd: negative token %d at %d", tokens[i], i);
    #pragma omp parallel for num_threads(lb_cpu_threads(be)) if ((size_t)n * c >= LB_CPU_PAR_MIN)
    for (int i = 0; i < n; i++)
        memcpy(out + (size_t)i * c, wte + (size_t)tokens[i] * c, (size_t)c * sizeof(float));
}

// Columns per parallel task in column-parallel scatters: wide enough to vectorise, narrow
// enough that several tasks exist for hidden sizes of a few hundred.
#define COL_BLOCK 64

// dwte (vocab, c) += dout (n, c) scattered by tokens. Parallel over column blocks, so every
// element of dwte sees its tokens added in index order by one thread (repeated tokens collide
// only within a thread).
static void cpu_embedding_bwd(lb_backend *be, float *dwte, const float *dout,
                              const int32_t *tokens, int n, int c)
{
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0) lb_die("embedding_bwd: negative token %d at %d", tokens[i], i);
    int nblk = (c + COL_BLOCK - 1) / COL_BLOCK;
    #pragma omp parallel for num_threads(lb_cpu_threads(be)) if ((size_t)n * c >= LB_CPU_PAR_MIN)
    for (int b = 0; b < nblk; b++) {
        int lo = b * COL_BLOCK, hi = lo + COL_BLOCK < c ? lo + COL_BLOCK : c;
        for (int i = 0; i < n; i++) {
            float *dst = dwte + (size_t)tokens[i] * c;
            const float *src = dout + (size_t)i * c;
            for (int j = lo; j < hi; j++) dst[j] += src[j];
        }
    }
}

// --- RMSNorm ----------------------------------------------------------------------------------

// out (n, c) = x / sqrt(mean(x^2) + eps) * w; rstd (n) saved for backward.
static void cpu_rmsnorm_fwd(lb_backend *be, const lb_rmsnorm_args *args)
{
    float *out = args->out, *rstd = args->rstd;
    const float *x = args->x, *w = args->w;
    int n = args->n, c = args->c;
    float eps = args->eps;
    const float *res = args->res;
    float *sum = args->sum;
    uint16_t *out16 = args->out16;
    const uint16_t *x16 = args->x16;
    if (!res != !sum) lb_die("rmsnorm_fwd: res and sum go together");
    if (!out && !out16) lb_die("rmsnorm_fwd: neither out nor out16");
    if (x16 && res) lb_die("rmsnorm_fwd: x16 with res");
    const int ld = (c + 7) & ~7;
    // x16: each row widened into a row of this scratch
    float *wide = x16 ? lb_malloc((size_t)lb_cpu_threads(be) * c * sizeof(float)) : NULL;
    // without out, each row into a row of this scratch, then rounded into out16
    float *row = out ? NULL : lb_malloc((size_t)lb_cpu_threads(be) * c * sizeof(float));
    #pragma omp parallel for num_threads(lb_cpu_threads(be)) if ((size_t)n * c >= LB_CPU_PAR_MIN)
    for (int i = 0; i < n; i++) {
        float *wi = x16 ? wide + (size_t)omp_get_thread_num() * c : NULL;
        for (int j = 0; wi && j < c; j++) wi[j] = lb_bf16_to_f32(x16[(size_t)i * ld + j]);
        const float *xi = wi ? wi : x + (size_t)i * c;
        float *oi = out ? out + (size_t)i * c : row + (size_t)omp_get_thread_num() * c;
        if (res) {   // the residual's add first, as add() makes it
            float *si = sum + (size_t)i * c;
            const float *ri = res + (size_t)i * c;
            for (int j = 0; j < c; j++) si[j] = xi[j] + ri[j];
            xi = si;
        }
        double ss = 0.0;
        for (int j = 0; j < c; j++) ss += (double)xi[j] * xi[j];
        float r = (float)(1.0 / sqrt(ss / c + (double)eps));
        rstd[i] = r;
        for (int j = 0; j < c; j++) oi[j] = (xi[j] * r) * w[j];   // as HF: w * (x * rstd)
        if (out16) lb_bf16_row(out16 + (size_t)i * ld, oi, c, ld);
    }
    free(row);
    free(wide);
}

// With y = x r w and r = (mean(x^2) + eps)^(-1/2):
//   dx_j = r (w_j dy_j) - x_j r^3 / c * sum_k (w_k dy_k x_k)
//   dw_j += sum_i dy_ij x_ij r_i
// dx (n, c) = that + dx_beta dx (parallel over rows); dw (c) accumulated (parallel over
// columns, rows summed in order in double).
static void cpu_rmsnorm_bwd(lb_backend *be, const lb_rmsnorm_args *args)
{
    float *dx = args->dx;
    float dx_beta = args->dx_beta;
    float *dw = args->dw;
    const float *dout = args->dout, *x = args->x, *w = args->w, *rstd = args->rstd;
    int n = args->n, c = args->c;
    int nt = lb_cpu_threads(be);
    int par = (size_t)n * c >= LB_CPU_PAR_MIN;
    float *wide = NULL;   // x16: the rows widened, then the fp32 backward on them
    if (args->x16) {
        wide = lb_malloc(((size_t)n * c + 1) * sizeof(float));
        for (int i = 0; i < n; i++)
            for (int j = 0; j < c; j++)
                wide[(size_t)i * c + j] = lb_in_at(NULL, args->x16, i, c, j);
        x = wide;
    }
    #pragma omp parallel for num_threads(nt) if (par)
    for (int i = 0; i < n; i++) {
        const float *xi = x + (size_t)i * c, *gi = dout + (size_t)i * c;
        float *dxi = dx + (size_t)i * c;
        double r = rstd[i], dot = 0.0;
        for (int j = 0; j < c; j++) dot += (double)gi[j] * w[j] * xi[j];
        double coef = dot * r * r * r / c;
        for (int j = 0; j < c; j++) {
            float v = (float)(r * ((double)w[j] * gi[j]) - coef * xi[j]);
            if (dx_beta != 0.0f) {   // rounded apart, as add() after an overwrite
                float old = dx_beta * dxi[j];
                v = old + v;
            }
            dxi[j] = v;
        }
    }
    int nblk = (c + COL_BLOCK - 1) / COL_BLOCK;
    #pragma omp parallel for num_threads(nt) if (par)
    for (int b = 0; b < nblk; b++) {
        int lo = b * COL_BLOCK, hi = lo + COL_BLOCK < c ? lo + COL_BLOCK : c;
        double acc[COL_BLOCK] = {0};
        for (int i = 0; i < n; i++) {
            const float *xi = x + (size_t)i * c, *gi = dout + (size_t)i * c;
            double r = rstd[i];
            for (int j = lo; j < hi; j++) acc[j - lo] += (double)gi[j] * xi[j] * r;
        }
        for (int j = lo; j < hi; j++) dw[j] += (float)acc[j - lo];
    }
    free(wide);
}

// --- RoPE (Hugging Face rotate_half form) --------------------------------------------------------

// Rotates the first rot values (a->rot, 0: all d) of every head of every row of a->x (n, heads,
// d) by its position pos (n); a->inverse applies the inverse rotation (the transpose), which is
// the backward map. Frequencies a->inv_freq, or theta^(-2f/rot).
// Angles are computed in double and cos/sin rounded once to float, so the result does not
// depend on how the compiler evaluates pos * freq.
static void cpu_rope(lb_backend *be, const lb_rope_args *a)
{
    if (a->out16) {   // the fp32 result into a copy, then rounded where CUDA stores bf16
        if (a->inverse) lb_die("rope: a bf16 output (out16) with the inverse rotation");
        size_t count = (size_t)a->n * a->heads * a->d;
        lb_rope_args f = *a;
        f.out16 = NULL;
        f.x = lb_malloc((count ? count : 1) * sizeof(float));
        if (!a->src && !a->src16) memcpy(f.x, a->x, count * sizeof(float));
        cpu_rope(be, &f);
        for (size_t i = 0; i < count; i++) a->out16[i] = lb_f32_to_bf16(f.x[i]);
        free(f.x);
        return;
    }
    float *x = a->x;
    const int32_t *pos = a->pos;
    const int n = a->n, heads = a->heads, d = a->d, rot = a->rot ? a->rot : a->d;
    const double sign = a->inverse ? -1.0 : 1.0;
    if (d % 2) lb_die("rope: head dim %d is odd", d);
    if (rot % 2 || rot < 0 || rot > d) lb_die("rope: rot %d is not even in 0..%d", rot, d);
    if (a->src16 && (!a->nw || d % 8))
        lb_die("rope: src16 needs the norm's weight and a head dim that is a multiple of 8");
    if (a->src || a->src16) {   // the q/k norm first (kernels.h)
        if (a->inverse) lb_die("rope: a norm (src) with the inverse rotation");
        cpu_rmsnorm_fwd(be, &(lb_rmsnorm_args){.out = x, .rstd = a->rstd, .x = a->src,
                .x16 = a->src16, .w = a->nw, .n = n * heads, .c = d, .eps = a->eps});
    }
    int half = rot / 2;
    if (half == 0 || n == 0 || heads == 0) return;
    double *inv_freq = lb_malloc((size_t)half * sizeof(double));
    for (int f = 0; f < half; f++)
        inv_freq[f] = a->inv_freq ? a->inv_freq[f] : pow((double)a->theta, -2.0 * f / rot);
    #pragma omp parallel for num_threads(lb_cpu_threads(be)) \
        if ((size_t)n * heads * d >= LB_CPU_PAR_MIN)
    for (int i = 0; i < n; i++) {
        float *xi = x + (size_t)i * heads * d;
        for (int f = 0; f < half; f++) {
            double angle = (double)pos[i] * inv_freq[f];
            float cs = (float)cos(angle), sn = (float)(sign * sin(angle));
            for (int h = 0; h < heads; h++) {
                float *xh = xi + (size_t)h * d;
                float x1 = xh[f], x2 = xh[f + half];
                xh[f] = x1 * cs - x2 * sn;
                xh[f + half] = x2 * cs + x1 * sn;
            }
        }
    }
    free(inv_freq);
}

// --- SwiGLU -------------------------------------------------------------------------------------

// gu (n, 2f) = [gate | up]; out (n, f) = silu(gate) * up, silu(g) = g * sigmoid(g). A bf16
// input (gu16, dout16) is widened a row at a time.
static void cpu_swiglu_fwd(lb_backend *be, const lb_swiglu_args *args)
{
    float *out = args->out;
    uint16_t *out16 = args->out16;
    const float *gu = args->gu;
    const uint16_t *gu16 = args->gu16;
    int n = args->n, f = args->f;
    const int ld = (f + 7) / 8 * 8;
    if (n > 0 && f > 0 && !out && !out16) lb_die("swiglu_fwd: neither out nor out16");
    #pragma omp parallel for num_threads(lb_cpu_threads(be)) if ((size_t)n * f >= LB_CPU_PAR_MIN)
    for (int i = 0; i < n; i++) {
        float in[gu16 ? 2 * f : 1];   // the row, widened from gu16
        for (int j = 0; gu16 && j < 2 * f; j++) in[j] = lb_in_at(NULL, gu16, i, 2 * f, j);
        const float *g = gu16 ? in : gu + (size_t)i * 2 * f, *u = g + f;
        float row[out ? 1 : f];   // the row, where out is not written
        float *o = out ? out + (size_t)i * f : row;
        const float w = args->rw ? args->rw[i] : 1.0f;
        for (int j = 0; j < f; j++) {
            float sig = 1.0f / (1.0f + expf(-g[j]));
            o[j] = g[j] * sig * u[j];
            if (args->rw) o[j] *= w;
        }
        if (out16) lb_bf16_row(out16 + (size_t)i * ld, o, f, ld);
    }
}

// d silu(g)/dg = sig * (1 + g * (1 - sig)); dgu (n, 2f) overwritten. rw, drw: kernels.h.
static void cpu_swiglu_bwd(lb_backend *be, const lb_swiglu_args *args)
{
    float *dgu = args->dgu;
    uint16_t *dgu16 = args->dgu16;
    const float *dout = args->dout;
    const uint16_t *dout16 = args->dout16;
    const float *gu = args->gu;
    const uint16_t *gu16 = args->gu16;
    int n = args->n, f = args->f;
    const int ld = (2 * f + 7) / 8 * 8;
    if (n > 0 && f > 0 && !dgu && !dgu16) lb_die("swiglu_bwd: neither dgu nor dgu16");
    #pragma omp parallel for num_threads(lb_cpu_threads(be)) if ((size_t)n * f >= LB_CPU_PAR_MIN)
    for (int i = 0; i < n; i++) {
        float in[gu16 ? 2 * f : 1], din[dout16 ? f : 1];   // rows widened from the copies
        for (int j = 0; gu16 && j < 2 * f; j++) in[j] = lb_in_at(NULL, gu16, i, 2 * f, j);
        for (int j = 0; dout16 && j < f; j++) din[j] = lb_in_at(NULL, dout16, i, f, j);
        const float *g = gu16 ? in : gu + (size_t)i * 2 * f, *u = g + f;
        const float *dy = dout16 ? din : dout + (size_t)i * f;
        float row[dgu ? 1 : 2 * f];   // the row, where dgu is not written
        float *dg = dgu ? dgu + (size_t)i * 2 * f : row, *du = dg + f;
        const float w = args->rw ? args->rw[i] : 1.0f;
        double acc = 0.0;
        for (int j = 0; j < f; j++) {
            float sig = 1.0f / (1.0f + expf(-g[j]));
            float silu = g[j] * sig;
            if (args->drw) acc += (double)dy[j] * (silu * u[j]);
            const float d = args->rw ? w * dy[j] : dy[j];
            dg[j] = d * u[j] * (sig * (1.0f + g[j] * (1.0f - sig)));
            du[j] = d * silu;
        }
        if (args->drw) args->drw[i] = acc;
        if (dgu16) lb_bf16_row(dgu16 + (size_t)i * ld, dg, 2 * f, ld);
    }
}

void lb_cpu_init_basic(lb_backend *be)
{
    be->gemm = cpu_gemm;
    be->gemm_grouped = cpu_gemm_grouped;
    be->gemm_experts = cpu_gemm_experts;
    be->add = cpu_add;
    be->add16 = cpu_add16;
    be->scale = cpu_scale;
    be->f64_to_f32 = cpu_f64_to_f32;
    be->sumsq = cpu_sumsq;
    be->embedding_fwd = cpu_embedding_fwd;
    be->embedding_bwd = cpu_embedding_bwd;
    be->rmsnorm_fwd = cpu_rmsnorm_fwd;
    be->rmsnorm_bwd = cpu_rmsnorm_bwd;
    be->rope = cpu_rope;
    be->swiglu_fwd = cpu_swiglu_fwd;
    be->swiglu_bwd = cpu_swiglu_bwd;
}
