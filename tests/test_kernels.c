// test_kernels.c: the CPU reference backend against naive double-precision loops, finite-
// difference checks of every backward operation, hand-computed cases, and the determinism and
// batch-invariance promises of kernels.h.
//
// The CPU backend's buffers are host memory, so the tests hand it host arrays directly.
// Set LB_TEST_VERBOSE=1 to print every measured error next to its bound.
#include "kernels/common.h"
#include "kernels/cpu/cpu.h"   // lb_cpu_gemm_det: the deterministic GEMM with a chosen ISA build
#include "kernels/kernels.h"
#include "kernels/quant/quant.h"
#include "tests/testutil.h"

#include <cblas.h>   // openblas_get_corename: GEMM findings name the kernel set in use
#include <math.h>
#include <omp.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static lb_backend *be;        // all cores: the backend under test (deterministic, the default)
static lb_backend *be_one;    // one thread
static lb_backend *be_many;   // at least two threads
static lb_backend *be_blas;   // all cores, deterministic = 0: the GEMM calls OpenBLAS
static int many_threads;      // be_many's thread count
static char *self_exe;        // argv[0]: test_determinism_gemm_haswell re-runs this program

// Sizes that are multiples of nothing in particular.
enum { N = 37, C = 53, D = 24, T = 19, HQ = 6, HKV = 2, E = 7, K = 3, V = 101, B = 2 };

// --- helpers ----------------------------------------------------------------------------------

static int verbose(void)
{
    const char *s = getenv("LB_TEST_VERBOSE");
    return s && *s && *s != '0';
}

static float *randn(size_t n, uint64_t seed, float scale)
{
    float *x = lb_malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) x[i] = scale * lb_rand_normal(seed, 0, i);
    return x;
}

static int32_t *randint(size_t n, uint64_t seed, int hi)
{
    int32_t *x = lb_malloc(n * sizeof(int32_t));
    for (size_t i = 0; i < n; i++) x[i] = (int32_t)(lb_rand_u64(seed, 1, i) % (uint64_t)hi);
    return x;
}

static float *fdup(const float *x, size_t n)
{
    float *y = lb_malloc(n * sizeof(float));
    memcpy(y, x, n * sizeof(float));
    return y;
}

static double *dzeros(size_t n) { return lb_calloc(n, sizeof(double)); }

// Normalised error max|a - ref| / max|ref|; infinite when anything is not finite, so NaN never
// passes.
static double nerr(const float *a, const double *ref, size_t n)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(a[i]) || !isfinite(ref[i])) return INFINITY;
        num = fmax(num, fabs(a[i] - ref[i]));
        den = fmax(den, fabs(ref[i]));
    }
    return den > 0.0 ? num / den : num;
}

#define ASSERT_CLOSE(what, a, ref, n, bound)                                                  \
    do {                                                                                      \
        double e_ = nerr((a), (ref), (n));                                                    \
        if (verbose()) printf("  %-34s err %.3g (bound %.1g)\n", (what), e_, (double)(bound)); \
        ck_assert_msg(e_ <= (bound), "%s: normalised error %.3g > %.3g", (what), e_,          \
                      (double)(bound));                                                       \
    } while (0)

#define ASSERT_BITWISE(what, a, b, bytes) \
    ck_assert_msg(memcmp((a), (b), (bytes)) == 0, "%s: results differ bitwise", (what))

// An op's bf16 copy c16 of x (rows, cols) (kernels.h: swiglu_fwd's out16) holds to_bf16's bits
// of x, padding included: to_bf16 writes the reference.
static void check_copy16(const char *what, const uint16_t *c16, const float *x, size_t rows,
                         int cols)
{
    const int ld = (cols + 7) / 8 * 8;
    uint16_t *want = lb_malloc(rows * ld * sizeof *want);
    be->to_bf16(be, want, x, rows, cols, ld);
    ASSERT_BITWISE(what, c16, want, rows * ld * sizeof *want);
    free(want);
}

// --- naive double-precision references ----------------------------------------------------------

// C (m, n) = alpha op(A) op(B) + beta C0, as documented in kernels.h.
static void ref_gemm(double *c, int ta, int tb, int m, int n, int k, double alpha,
                     const float *a, const float *b, double beta, const float *c0)
{
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            double s = 0.0;
            for (int l = 0; l < k; l++) {
                double av = ta ? a[(size_t)l * m + i] : a[(size_t)i * k + l];
                double bv = tb ? b[(size_t)j * k + l] : b[(size_t)l * n + j];
                s += av * bv;
            }
            c[(size_t)i * n + j] = alpha * s + (beta != 0.0 ? beta * c0[(size_t)i * n + j] : 0);
        }
}

static void ref_rmsnorm(double *out, double *rstd, const float *x, const float *w, int n, int c,
                        double eps)
{
    for (int i = 0; i < n; i++) {
        double ss = 0.0;
        for (int j = 0; j < c; j++) ss += (double)x[i * c + j] * x[i * c + j];
        rstd[i] = 1.0 / sqrt(ss / c + eps);
        for (int j = 0; j < c; j++) out[i * c + j] = x[i * c + j] * rstd[i] * w[j];
    }
}

static void ref_rope(double *out, const float *x, const int32_t *pos, int n, int heads, int d,
                     double theta)
{
    int half = d / 2;
    for (int i = 0; i < n; i++)
        for (int h = 0; h < heads; h++)
            for (int f = 0; f < half; f++) {
                double ang = pos[i] * pow(theta, -2.0 * f / d);
                const float *xh = x + ((size_t)i * heads + h) * d;
                double *oh = out + ((size_t)i * heads + h) * d;
                oh[f] = xh[f] * cos(ang) - xh[f + half] * sin(ang);
                oh[f + half] = xh[f + half] * cos(ang) + xh[f] * sin(ang);
            }
}

static void ref_attention(double *out, double *lse, const float *q, const float *k,
                          const float *v, int b, int t, int hq, int hkv, int d)
{
    double *s = dzeros(t);
    for (int bi = 0; bi < b; bi++)
        for (int h = 0; h < hq; h++)
            for (int i = 0; i < t; i++) {
                int hk = h / (hq / hkv);
                const float *qi = q + (((size_t)bi * t + i) * hq + h) * d;
                double m = -INFINITY, sum = 0.0;
                for (int j = 0; j <= i; j++) {
                    const float *kj = k + (((size_t)bi * t + j) * hkv + hk) * d;
                    s[j] = 0.0;
                    for (int x = 0; x < d; x++) s[j] += (double)qi[x] * kj[x];
                    s[j] /= sqrt((double)d);
                    m = fmax(m, s[j]);
                }
                for (int j = 0; j <= i; j++) sum += exp(s[j] - m);
                double *oi = out + (((size_t)bi * t + i) * hq + h) * d;
                for (int x = 0; x < d; x++) {
                    oi[x] = 0.0;
                    for (int j = 0; j <= i; j++)
                        oi[x] += exp(s[j] - m) / sum * v[(((size_t)bi * t + j) * hkv + hk) * d + x];
                }
                lse[((size_t)bi * hq + h) * t + i] = m + log(sum);
            }
    free(s);
}

// kernels.h's bf16 attention mode written out literally, query row by query row, with the chunk
// size as a parameter (kernels.h fixes LB_ATTN_CHUNK): bf16 inputs rounded where they are read,
// masked keys (j > i) of the last chunk taking p = 0. out (b, t, hq, d), lse (b, hq, t).
static void ref_attention_bf16(float *out, float *lse, const float *q, const float *k,
                               const float *v, int b, int t, int hq, int hkv, int d, int chunk)
{
    const float c = (float)(1.44269504088896340736 / sqrt((double)d));
    float *x = lb_malloc((size_t)chunk * 4), *acc = lb_malloc((size_t)d * 4);
    double *sum = dzeros(d);
    for (int bi = 0; bi < b; bi++)
        for (int h = 0; h < hq; h++)
            for (int i = 0; i < t; i++) {
                int hk = h / (hq / hkv);
                const float *qi = q + (((size_t)bi * t + i) * hq + h) * d;
                float m = -INFINITY, l = 0.0f;
                for (int e = 0; e < d; e++) acc[e] = 0.0f;
                for (int j0 = 0; j0 <= i; j0 += chunk) {
                    float mn = m;
                    for (int j = j0; j < j0 + chunk && j <= i; j++) {
                        const float *kj = k + (((size_t)bi * t + j) * hkv + hk) * d;
                        double s = 0.0;
                        for (int e = 0; e < d; e++)
                            s += (double)lb_round_bf16(qi[e]) * lb_round_bf16(kj[e]);
                        x[j - j0] = (float)s * c;
                        mn = fmaxf(mn, x[j - j0]);
                    }
                    float alpha = exp2f(m - mn);
                    double ps = 0.0;
                    for (int e = 0; e < d; e++) sum[e] = 0.0;
                    for (int j = j0; j < j0 + chunk; j++) {
                        float p = j <= i ? exp2f(x[j - j0] - mn) : 0.0f;
                        ps += p;
                        if (j > i) continue;
                        const float *vj = v + (((size_t)bi * t + j) * hkv + hk) * d;
                        for (int e = 0; e < d; e++)
                            sum[e] += (double)lb_round_bf16(p) * lb_round_bf16(vj[e]);
                    }
                    l = l * alpha + (float)ps;
                    for (int e = 0; e < d; e++) acc[e] = acc[e] * alpha + (float)sum[e];
                    m = mn;
                }
                float *oi = out + (((size_t)bi * t + i) * hq + h) * d;
                for (int e = 0; e < d; e++) oi[e] = acc[e] / l;
                const float ln2 = (float)0.693147180559945309417;
                lse[((size_t)bi * hq + h) * t + i] = (m + log2f(l)) * ln2;
            }
    free(x), free(acc), free(sum);
}

static double dot_bf16(const float *a, const float *b, int d)
{
    double s = 0.0;
    for (int e = 0; e < d; e++) s += (double)lb_round_bf16(a[e]) * lb_round_bf16(b[e]);
    return s;
}

// p_ij and ds_ij of the bf16 backward for query row qi (dout gi, out oi, saved lse) and key
// row kj (value vj).
static void ref_pair_bf16(float *p, float *ds, const float *qi, const float *gi, const float *oi,
                          float lse, const float *kj, const float *vj, int d)
{
    const float c = (float)(1.44269504088896340736 / sqrt((double)d));
    double D = 0.0;
    for (int e = 0; e < d; e++) D += (double)gi[e] * oi[e];
    float lse2 = lse * (float)1.44269504088896340736;
    *p = exp2f((float)dot_bf16(qi, kj, d) * c - lse2);
    *ds = *p * ((float)dot_bf16(gi, vj, d) - (float)D);
}

// The bf16 backward of kernels.h, literally, summing in the CPU's order (dq: keys in order;
// dk, dv: the group's query heads, then queries, in order), so it must agree bit for bit.
static void ref_attention_bwd_bf16(float *dq, float *dk, float *dv, const float *g,
                                   const float *q, const float *k, const float *v,
                                   const float *out, const float *lse, int b, int t, int hq,
                                   int hkv, int d)
{
    const int group = hq / hkv;
    const double scale = 1.0 / sqrt((double)d);
    double *acc = dzeros(2 * (size_t)d);
#define RQ(a, bi, i, h) ((a) + (((size_t)(bi) * t + (i)) * hq + (h)) * d)
#define RK(a, bi, j, hk) ((a) + (((size_t)(bi) * t + (j)) * hkv + (hk)) * d)
    for (int bi = 0; bi < b; bi++)
        for (int h = 0; h < hq; h++)
            for (int i = 0; i < t; i++) {
                for (int e = 0; e < d; e++) acc[e] = 0.0;
                for (int j = 0; j <= i; j++) {
                    float p, ds;
                    ref_pair_bf16(&p, &ds, RQ(q, bi, i, h), RQ(g, bi, i, h), RQ(out, bi, i, h),
                                  lse[((size_t)bi * hq + h) * t + i], RK(k, bi, j, h / group),
                                  RK(v, bi, j, h / group), d);
                    const float *kj = RK(k, bi, j, h / group);
                    for (int e = 0; e < d; e++)
                        acc[e] += (double)lb_round_bf16(ds) * lb_round_bf16(kj[e]);
                }
                for (int e = 0; e < d; e++) RQ(dq, bi, i, h)[e] = (float)(acc[e] * scale);
            }
    for (int bi = 0; bi < b; bi++)
        for (int hk = 0; hk < hkv; hk++)
            for (int j = 0; j < t; j++) {
                for (int e = 0; e < 2 * d; e++) acc[e] = 0.0;
                for (int h = hk * group; h < (hk + 1) * group; h++)
                    for (int i = j; i < t; i++) {
                        float p, ds;
                        ref_pair_bf16(&p, &ds, RQ(q, bi, i, h), RQ(g, bi, i, h),
                                      RQ(out, bi, i, h), lse[((size_t)bi * hq + h) * t + i],
                                      RK(k, bi, j, hk), RK(v, bi, j, hk), d);
                        const float *qi = RQ(q, bi, i, h), *gi = RQ(g, bi, i, h);
                        double dsb = lb_round_bf16(ds), pb = lb_round_bf16(p);
                        for (int e = 0; e < d; e++) {
                            acc[e] += dsb * lb_round_bf16(qi[e]);
                            acc[d + e] += pb * lb_round_bf16(gi[e]);
                        }
                    }
                for (int e = 0; e < d; e++) {
                    RK(dk, bi, j, hk)[e] = (float)(acc[e] * scale);
                    RK(dv, bi, j, hk)[e] = (float)acc[d + e];
                }
            }
#undef RQ
#undef RK
    free(acc);
}

// --- backend table and memory -----------------------------------------------------------------

// A backend of one entry (lb_backend_new fills the rest); lb_die jumps back through the abort
// hook (the suite runs without fork).
static void lacking_sync(lb_backend *be) {}
static void lacking_init(lb_backend *be) { be->sync = lacking_sync; }
static jmp_buf lacking_jmp;
static void lacking_jump(int code) { longjmp(lacking_jmp, code ? code : 1); }

// Messages name source files from the tree's top on, whatever directory the build ran in.
START_TEST(test_source_path)
{
    ck_assert_str_eq(lb_source_path("../lowbit/src/train/train.c"), "src/train/train.c");
    ck_assert_str_eq(lb_source_path("/build/x/lowbit/kernels/cuda/gemm.cu"),
                     "kernels/cuda/gemm.cu");
    ck_assert_str_eq(lb_source_path("/home/u/src/lowbit/models/qwen3.c"), "models/qwen3.c");
    ck_assert_str_eq(lb_source_path("parallel/comm.c"), "parallel/comm.c");
    ck_assert_str_eq(lb_source_path("main.c"), "main.c");
}
END_TEST

START_TEST(test_table_and_memory)
{
    ck_assert_str_eq(be->name, "cpu");
    // Every entry of the op list filled, each name distinct and known.
    for (int op = 0; op < LB_OP_COUNT; op++) {
        ck_assert_msg(lb_backend_supports(be, op), "cpu lacks op %s", lb_op_name(op));
        ck_assert_ptr_nonnull(lb_op_name(op));
    }
    ck_assert_ptr_null(lb_op_name(LB_OP_COUNT));
    ck_assert_str_eq(lb_op_name(LB_OP_gemm), "gemm");
    // A backend that lacks an op says so: the entry stops the program by name, no NULL.
    static void (*const only_sync[])(lb_backend *) = {lacking_init};
    lb_backend *part = lb_backend_new("partial", NULL, only_sync, 1);
    ck_assert(lb_backend_supports(part, LB_OP_sync) && !lb_backend_supports(part, LB_OP_gemm));
    ck_assert_ptr_nonnull(part->gemm);
    lb_set_abort_hook(lacking_jump);
    int died = setjmp(lacking_jmp);
    if (!died) lb_gemm(part, 0, 0, 1, 1, 1, 1.0f, NULL, NULL, 0.0f, NULL);   // prints the name
    lb_set_abort_hook(NULL);
    ck_assert_msg(died, "a missing op returned");
    free(part);

    size_t bytes = 1001;
    unsigned char *p = be->alloc(be, bytes), *q = be->alloc(be, bytes);
    for (size_t i = 0; i < bytes; i++) ck_assert_msg(p[i] == 0, "alloc is not zero-filled");
    unsigned char host[1001], back[1001];
    for (size_t i = 0; i < bytes; i++) host[i] = (unsigned char)(i * 7 + 3);
    be->upload(be, p, host, bytes);
    be->copy(be, q, p, bytes);
    be->sync(be);
    be->download(be, back, q, bytes);
    ck_assert(memcmp(host, back, bytes) == 0);
    be->zero(be, q + 10, 20);
    be->download(be, back, q, bytes);
    for (size_t i = 0; i < bytes; i++)
        ck_assert(back[i] == (i >= 10 && i < 30 ? 0 : host[i]));
    be->free(be, p);
    be->free(be, q);
    be->free(be, be->alloc(be, 0));   // a zero-byte buffer is valid and freeable

    char err[128];
    ck_assert_ptr_null(lb_backend_cpu_create(-1, err, sizeof err));
    ck_assert_msg(err[0] != '\0', "no message for a bad thread count");
}
END_TEST

// --- forward operations against naive references -----------------------------------------------

START_TEST(test_gemm_fwd)
{
    const int m = 37, n = 29, k = 53;
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            float *a = randn((size_t)m * k, 100 + ta, 1), *b = randn((size_t)k * n, 110 + tb, 1);
            float *c0 = randn((size_t)m * n, 120, 1), *c = fdup(c0, (size_t)m * n);
            double *ref = dzeros((size_t)m * n);
            ref_gemm(ref, ta, tb, m, n, k, 0.7, a, b, 0.3, c0);
            lb_gemm(be, ta, tb, m, n, k, 0.7f, a, b, 0.3f, c);
            char what[64];
            snprintf(what, sizeof what, "gemm transa %d transb %d", ta, tb);
            ASSERT_CLOSE(what, c, ref, (size_t)m * n, 1e-5);
            free(a), free(b), free(c0), free(c), free(ref);
        }
}
END_TEST

// beta = 1 accumulates (the wgrad form); k == 0 and alpha == 0 never read A or B; beta == 0
// overwrites even NaN.
START_TEST(test_gemm_accumulate_and_edges)
{
    const int m = 23, n = 31, k = 45;
    float *dy = randn((size_t)k * m, 130, 1), *x = randn((size_t)k * n, 131, 1);
    float *dw0 = randn((size_t)m * n, 132, 1), *dw = fdup(dw0, (size_t)m * n);
    double *ref = dzeros((size_t)m * n);
    ref_gemm(ref, 1, 0, m, n, k, 1.0, dy, x, 1.0, dw0);
    lb_gemm(be, 1, 0, m, n, k, 1.0f, dy, x, 1.0f, dw);   // dW += dY^T X
    ASSERT_CLOSE("gemm wgrad beta=1", dw, ref, (size_t)m * n, 1e-5);
    // A second call adds the product again.
    ref_gemm(ref, 1, 0, m, n, k, 1.0, dy, x, 1.0, dw);
    lb_gemm(be, 1, 0, m, n, k, 1.0f, dy, x, 1.0f, dw);
    ASSERT_CLOSE("gemm wgrad second accumulation", dw, ref, (size_t)m * n, 1e-5);

    float *c = lb_malloc((size_t)m * n * sizeof(float));
    for (int i = 0; i < m * n; i++) c[i] = NAN;
    lb_gemm(be, 0, 1, m, n, 0, 1.0f, NULL, NULL, 0.0f, c);
    for (int i = 0; i < m * n; i++) ck_assert_msg(c[i] == 0.0f, "k == 0, beta 0 must zero C");
    memcpy(c, dw0, (size_t)m * n * sizeof(float));
    lb_gemm(be, 0, 1, m, n, 0, 1.0f, NULL, NULL, 1.0f, c);
    ASSERT_BITWISE("k == 0, beta 1 leaves C", c, dw0, (size_t)m * n * sizeof(float));
    lb_gemm(be, 0, 1, m, n, 0, 1.0f, NULL, NULL, 2.0f, c);
    for (int i = 0; i < m * n; i++) ck_assert(c[i] == 2.0f * dw0[i]);
    lb_gemm(be, 0, 1, 0, n, k, 1.0f, NULL, NULL, 0.0f, NULL);   // m == 0: nothing touched
    free(dy), free(x), free(dw0), free(dw), free(ref), free(c);
}
END_TEST

// The quantize family on a bf16 activation (lb_act_bf16: rows padded to 8 elements, the
// padding NaN here, which must not be read) gives the bytes of the same op on those values in
// fp32: fp8-block both ways (padded groups), MXFP8, NVFP4 per row with its amaxes, MXFP4 with
// the wgrad's Hadamard transform, and quantize_rc.
START_TEST(test_quantize_from_bf16)
{
    enum { G = 3, C = 130, LD = (C + 7) / 8 * 8 };
    const int rows[G] = {5, 0, 40}, prows[G] = {16, 0, 48};
    const int n = 45;
    float *x = randn((size_t)n * C, 170, 3.0f);
    uint16_t *x16 = lb_malloc((size_t)n * LD * sizeof *x16);
    for (int r = 0; r < n; r++)
        for (int c = 0; c < LD; c++) {
            uint16_t b = c < C ? lb_f32_to_bf16(x[(size_t)r * C + c]) : 0x7fc0;   // NaN pad
            x16[(size_t)r * LD + c] = b;
            if (c < C) x[(size_t)r * C + c] = lb_bf16_to_f32(b);
        }
    const lb_act a32 = lb_act_f32(x, n, C), a16 = lb_act_bf16(x16, n, C);
    struct { lb_format fmt; int colwise, pad, hadamard; lb_scale2_mode s2; } cs[] = {
        {LB_FMT_FP8_BLOCK, 0, 0, 0, 0}, {LB_FMT_FP8_BLOCK, 1, 1, 0, 0},
        {LB_FMT_MXFP8, 1, 1, 0, 0}, {LB_FMT_NVFP4, 0, 0, 0, LB_S2_ROW},
        {LB_FMT_MXFP4, 1, 1, 16, 0},
    };
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        lb_quant_args a = {.fmt = cs[i].fmt, .colwise = cs[i].colwise, .hadamard = cs[i].hadamard,
                           .hsigns = 0x5a5au, .s2_mode = cs[i].s2};
        const int *pr = cs[i].pad ? prows : rows;
        lb_qmat q[2][G];
        for (int v = 0; v < 2; v++) {
            for (int j = 0; j < G; j++) {
                memset(&q[v][j], 0, sizeof q[v][j]);
                if (pr[j]) be->qmat_alloc(be, &q[v][j], pr[j], C, &a);
            }
            be->quantize_grouped(be, G, q[v], v ? a16 : a32, rows, pr, &a);
        }
        for (int j = 0; j < G; j++) {
            if (!pr[j]) continue;
            ck_assert_msg(!memcmp(q[0][j].data, q[1][j].data, lb_qmat_data_bytes(&q[0][j])) &&
                              !memcmp(q[0][j].scale, q[1][j].scale,
                                      lb_qmat_scale_bytes(&q[0][j])),
                          "quantize_grouped case %zu group %d: bf16 rows quantize otherwise", i, j);
            for (int v = 0; v < 2; v++) be->qmat_free(be, &q[v][j]);
        }
        if (cs[i].s2 == LB_S2_ROW) {   // the amaxes behind the second levels
            float m[2][n];
            for (int v = 0; v < 2; v++)
                be->quantize_amax(be, m[v], G, v ? a16 : a32, rows, pr, &a);
            ck_assert_msg(!memcmp(m[0], m[1], sizeof m[0]), "quantize_amax from bf16");
        }
    }
    // quantize_rc: fp8-block dy both ways
    lb_quant_args ar = {.fmt = LB_FMT_FP8_BLOCK}, ac = {.fmt = LB_FMT_FP8_BLOCK, .colwise = 1};
    lb_qmat r[2], c[2][G];
    for (int v = 0; v < 2; v++) {
        be->qmat_alloc(be, &r[v], n, C, &ar);
        for (int j = 0; j < G; j++) {
            memset(&c[v][j], 0, sizeof c[v][j]);
            if (prows[j]) be->qmat_alloc(be, &c[v][j], prows[j], C, &ac);
        }
        be->quantize_rc(be, &r[v], &ar, G, c[v], v ? a16 : a32, rows, prows, &ac);
    }
    ck_assert_msg(!memcmp(r[0].data, r[1].data, lb_qmat_data_bytes(&r[0])) &&
                      !memcmp(r[0].scale, r[1].scale, lb_qmat_scale_bytes(&r[0])),
                  "quantize_rc from bf16: row-wise");
    for (int j = 0; j < G; j++) {
        if (!prows[j]) continue;
        ck_assert_msg(!memcmp(c[0][j].data, c[1][j].data, lb_qmat_data_bytes(&c[0][j])),
                      "quantize_rc from bf16: column-wise group %d", j);
        for (int v = 0; v < 2; v++) be->qmat_free(be, &c[v][j]);
    }
    for (int v = 0; v < 2; v++) be->qmat_free(be, &r[v]);
    free(x), free(x16);
}
END_TEST

// to_bf16: each element's bf16 bits (lb_f32_to_bf16, which round_bf16 widens), zeros in the
// padding; and a bf16 GEMM given b's copy (lb_gemm_args.b16) equals the GEMM rounding b, bit
// for bit, with B (n, k) (fprop) and (k, n) (dgrad) from the same copy of W (n, k); so do
// GEMMs given copies of A (lb_gemm_args.a16), stored (m, k) (fprop) and (k, m) (wgrad).
START_TEST(test_to_bf16_gemm_b16)
{
    const int n = 37, k = 53, m = 9, ld = 56;
    float *w = randn((size_t)n * k, 11, 3.0f), *a = randn((size_t)m * k, 12, 1.0f);
    float *g = randn((size_t)m * n, 13, 1.0f);
    uint16_t *w16 = lb_malloc((size_t)n * ld * 2);
    memset(w16, 0xff, (size_t)n * ld * 2);
    be->to_bf16(be, w16, w, n, k, ld);
    for (int r = 0; r < n; r++)
        for (int c = 0; c < ld; c++)
            ck_assert_uint_eq(w16[r * ld + c], c < k ? lb_f32_to_bf16(w[r * k + c]) : 0);
    const size_t cb = (size_t)m * (n > k ? n : k) * 4;
    float *c0 = lb_malloc(cb), *c1 = lb_malloc(cb);
    for (int pass = 0; pass < 2; pass++) {   // fprop C (m, n) = A W^T; dgrad C (m, k) = G W
        const int nn = pass ? k : n, kk = pass ? n : k;
        const float *x = pass ? g : a;
        lb_gemm_bf16_b16(be, 0, !pass, m, nn, kk, 1.0f, x, w, NULL, 0.0f, c0);
        lb_gemm_bf16_b16(be, 0, !pass, m, nn, kk, 1.0f, x, w, w16, 0.0f, c1);
        ck_assert_msg(memcmp(c0, c1, (size_t)m * nn * 4) == 0, "%s with b16 differs",
                      pass ? "dgrad" : "fprop");
    }
    // a16: the fprop with A's copy (m, pad8(k)), the wgrad dW (n, k) = G^T A with G's (m,
    // pad8(n)) as a16 and A's as b16
    uint16_t *a16 = lb_malloc((size_t)m * 56 * 2), *g16 = lb_malloc((size_t)m * 40 * 2);
    be->to_bf16(be, a16, a, m, k, 56);
    be->to_bf16(be, g16, g, m, n, 40);
    float *d0 = lb_malloc((size_t)n * k * 4), *d1 = lb_malloc((size_t)n * k * 4);
    lb_gemm_args f0 = {0, 1, m, n, k, 1.0f, 0.0f, a, w, c0, 1, NULL, NULL, NULL};
    lb_gemm_args f1 = {0, 1, m, n, k, 1.0f, 0.0f, a, w, c1, 1, w16, a16, NULL};
    lb_gemm_args w0 = {1, 0, n, k, m, 1.0f, 0.0f, g, a, d0, 1, NULL, NULL, NULL};
    lb_gemm_args w1 = {1, 0, n, k, m, 1.0f, 0.0f, g, a, d1, 1, a16, g16, NULL};
    be->gemm(be, &f0), be->gemm(be, &f1), be->gemm(be, &w0), be->gemm(be, &w1);
    ck_assert_msg(memcmp(c0, c1, (size_t)m * n * 4) == 0, "fprop with a16 differs");
    ck_assert_msg(memcmp(d0, d1, (size_t)n * k * 4) == 0, "wgrad with a16, b16 differs");
    free(w), free(a), free(g), free(w16), free(c0), free(c1), free(a16), free(g16), free(d0);
    free(d1);
}
END_TEST

// One call for several experts: an ordinary group, an expert with no tokens (m == 0, its C
// untouched), one whose inner size is 0 (C zeroed, NaN included) and a transposed wgrad group.
START_TEST(test_gemm_grouped)
{
    const int n = 19, k = 27, m0 = 11, m3 = 13;
    float *a0 = randn((size_t)m0 * k, 140, 1), *w = randn((size_t)n * k, 141, 1);
    float *a3 = randn((size_t)m3 * n, 142, 1), *b3 = randn((size_t)m3 * k, 143, 1);
    float *c0 = lb_calloc((size_t)m0 * n, sizeof(float));
    float sentinel[4] = {1, 2, 3, 4};
    float *c2 = lb_malloc((size_t)5 * n * sizeof(float));
    for (int i = 0; i < 5 * n; i++) c2[i] = NAN;
    float *c3_0 = randn((size_t)n * k, 144, 1), *c3 = fdup(c3_0, (size_t)n * k);
    lb_gemm_args g[4] = {
        {0, 1, m0, n, k, 1.0f, 0.0f, a0, w, c0, 0, NULL, NULL, NULL},          // fprop
        {0, 1, 0, n, k, 1.0f, 0.0f, NULL, w, sentinel, 0, NULL, NULL, NULL},   // no tokens
        {0, 1, 5, n, 0, 1.0f, 0.0f, NULL, NULL, c2, 0, NULL, NULL, NULL},      // empty inner dim
        {1, 0, n, k, m3, 0.5f, 1.0f, a3, b3, c3, 0, NULL, NULL, NULL},         // wgrad, adding
    };
    be->gemm_grouped(be, 4, g);
    double *ref0 = dzeros((size_t)m0 * n), *ref3 = dzeros((size_t)n * k);
    ref_gemm(ref0, 0, 1, m0, n, k, 1.0, a0, w, 0.0, NULL);
    ref_gemm(ref3, 1, 0, n, k, m3, 0.5, a3, b3, 1.0, c3_0);
    ASSERT_CLOSE("gemm_grouped group 0", c0, ref0, (size_t)m0 * n, 1e-5);
    ASSERT_CLOSE("gemm_grouped group 3", c3, ref3, (size_t)n * k, 1e-5);
    ck_assert(sentinel[0] == 1 && sentinel[1] == 2 && sentinel[2] == 3 && sentinel[3] == 4);
    for (int i = 0; i < 5 * n; i++) ck_assert_msg(c2[i] == 0.0f, "k == 0 group not zeroed");
    be->gemm_grouped(be, 0, NULL);   // nothing to do
    free(a0), free(w), free(a3), free(b3), free(c0), free(c2), free(c3_0), free(c3);
    free(ref0), free(ref3);
}
END_TEST

// A bf16 output (lb_gemm_args.c16): exactly lb_f32_to_bf16 of the fp32 bf16 GEMM's C, rows
// pad8(n) apart, with neither c (NaN stays) nor the pad columns (a pattern stays) written. Every
// trans case, n not a multiple of 8, k 0 (bf16 zeros), m 1, alpha not 1; one call through
// gemm_grouped with an empty group (m 0: its c16 untouched).
START_TEST(test_gemm_c16)
{
    static const struct { int ta, tb, m, n, k; float alpha; } sh[] = {
        {0, 1, 37, 13, 53, 0.7f}, {0, 0, 9, 40, 27, 1.0f}, {1, 0, 23, 29, 45, 1.0f},
        {1, 1, 6, 8, 19, -2.0f},  {0, 1, 5, 13, 0, 1.0f},  {0, 1, 1, 1, 7, 1.0f},
    };
    const int ns = (int)(sizeof sh / sizeof sh[0]);
    const uint16_t POISON = 0xdead;
    lb_gemm_args g[8], gg[8];
    float *ref[8];
    for (int i = 0; i < ns; i++) {
        const int m = sh[i].m, n = sh[i].n, k = sh[i].k, ld = (n + 7) / 8 * 8;
        float *a = k ? randn((size_t)m * k, 150 + i, 1) : NULL;
        float *b = k ? randn((size_t)k * n, 160 + i, 1) : NULL;
        ref[i] = lb_malloc((size_t)m * n * sizeof(float));
        for (size_t e = 0; e < (size_t)m * n; e++) ref[i][e] = NAN;
        g[i] = (lb_gemm_args){sh[i].ta, sh[i].tb, m, n, k, sh[i].alpha, 0.0f, a, b, ref[i], 1,
                              NULL, NULL, NULL};
        be->gemm(be, &g[i]);   // the fp32 C
        gg[i] = g[i];
        gg[i].c = lb_malloc((size_t)m * n * sizeof(float));
        gg[i].c16 = lb_malloc((size_t)m * ld * sizeof(uint16_t));
        for (int pass = 0; pass < 2; pass++) {   // gemm, then the same through gemm_grouped
            for (size_t e = 0; e < (size_t)m * n; e++) gg[i].c[e] = NAN;
            for (size_t e = 0; e < (size_t)m * ld; e++) gg[i].c16[e] = POISON;
            if (pass == 0) be->gemm(be, &gg[i]);
            else be->gemm_grouped(be, 1, &gg[i]);
            for (int r = 0; r < m; r++)
                for (int c = 0; c < ld; c++) {
                    const uint16_t got = gg[i].c16[(size_t)r * ld + c];
                    const uint16_t want =
                        c < n ? lb_f32_to_bf16(ref[i][(size_t)r * n + c]) : POISON;
                    ck_assert_msg(got == want,
                                  "gemm c16 (%s) shape %d row %d col %d: 0x%04x, want 0x%04x",
                                  pass ? "grouped" : "dense", i, r, c, got, want);
                }
            for (size_t e = 0; e < (size_t)m * n; e++)
                ck_assert_msg(isnan(gg[i].c[e]), "gemm c16 shape %d wrote c", i);
        }
        if (k == 0)
            for (size_t e = 0; e < (size_t)m * n; e++) ck_assert(ref[i][e] == 0.0f);
    }
    // all the shapes in one grouped call, with an empty group (m 0) between them
    uint16_t sentinel[8];
    for (int e = 0; e < 8; e++) sentinel[e] = POISON;
    gg[ns] = gg[0];
    gg[ns].m = 0, gg[ns].c = NULL, gg[ns].c16 = sentinel;
    for (int i = 0; i < ns; i++) {
        const size_t ld = (size_t)(sh[i].n + 7) / 8 * 8;
        for (size_t e = 0; e < (size_t)sh[i].m * ld; e++) gg[i].c16[e] = POISON;
    }
    be->gemm_grouped(be, ns + 1, gg);
    for (int i = 0; i < ns; i++) {
        const int n = sh[i].n, ld = (n + 7) / 8 * 8;
        for (int r = 0; r < sh[i].m; r++)
            for (int c = 0; c < ld; c++)
                ck_assert_uint_eq(gg[i].c16[(size_t)r * ld + c],
                                  c < n ? lb_f32_to_bf16(ref[i][(size_t)r * n + c]) : POISON);
    }
    for (int e = 0; e < 8; e++) ck_assert_uint_eq(sentinel[e], POISON);
    for (int i = 0; i < ns; i++) {
        free((void *)g[i].a), free((void *)g[i].b), free(ref[i]), free(gg[i].c);
        free(gg[i].c16);
    }
}
END_TEST

// --- the deterministic GEMM (kernels/cpu/gemm.c) ------------------------------------------------

// gemm.c's canonical order in plain scalar C: lane q (0..7) sums the products at k-indices
// q, q + 8, ... in order, the last step adding +0 for indices past k; then the fixed tree
// ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)), then alpha and beta. The kernel must match
// it bit for bit whatever its tile shapes, blocks, threads or ISA build. Products go through
// volatile floats so no compiler setting can fuse them into an FMA here.
static void canon_gemm(float *c, int ta, int tb, int m, int n, int k, float alpha,
                       const float *a, const float *b, float beta)
{
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            float s[8] = {0};
            for (int l0 = 0; l0 < k; l0 += 8)
                for (int q = 0; q < 8; q++) {
                    int l = l0 + q;
                    volatile float p = 0.0f;
                    if (l < k)
                        p = (ta ? a[(size_t)l * m + i] : a[(size_t)i * k + l]) *
                            (tb ? b[(size_t)j * k + l] : b[(size_t)l * n + j]);
                    s[q] = s[q] + p;
                }
            float sum = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
            volatile float o = alpha * sum;
            if (beta != 0.0f) {
                volatile float old = beta * c[(size_t)i * n + j];
                o = o + old;
            }
            c[(size_t)i * n + j] = o;
        }
}

// Every trans case, sizes that leave partial tiles and blocks in both directions (k < 8, k = 1,
// m = 1, n = 1, k not a multiple of 8, calls big enough for several threads), alpha and beta
// (beta 0 over NaN): within 1e-5 of the double reference and bitwise equal to the canonical
// order, on 1 and on several threads, with the best and with the baseline ISA build.
START_TEST(test_gemm_det_canonical)
{
    const int shapes[][3] = {   // m, n, k
        {1, 1, 1}, {1, 7, 3}, {3, 1, 8}, {5, 9, 7}, {4, 2, 16}, {2, 4, 9}, {6, 10, 1},
        {37, 29, 53}, {33, 17, 1}, {7, 1, 1000}, {1, 300, 129}, {66, 130, 40},
        {129, 70, 257}, {1, 4099, 300},
    };
    const float ab[][2] = {{1.0f, 0.0f}, {0.7f, 0.3f}, {-1.5f, 1.0f}};   // alpha, beta
    lb_backend *bes[2] = {be_one, be_many};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++)
                for (int abi = 0; abi < 3; abi++) {
                    int m = shapes[si][0], n = shapes[si][1], k = shapes[si][2];
                    float alpha = ab[abi][0], beta = ab[abi][1];
                    size_t mn = (size_t)m * n;
                    float *a = randn((size_t)m * k, 160 + si, 1);
                    float *b = randn((size_t)k * n, 180 + si, 1);
                    float *c0 = randn(mn, 200 + si, 1);
                    if (beta == 0.0f)
                        for (size_t i = 0; i < mn; i++) c0[i] = NAN;
                    float *want = fdup(c0, mn), *c = lb_malloc(mn * sizeof(float));
                    double *ref = dzeros(mn);
                    canon_gemm(want, ta, tb, m, n, k, alpha, a, b, beta);
                    ref_gemm(ref, ta, tb, m, n, k, alpha, a, b, beta, c0);
                    char what[128];
                    for (int r = 0; r < 2; r++)
                        for (int isa = 0; isa < 2; isa++) {
                            memcpy(c, c0, mn * sizeof(float));
                            lb_gemm_args g = {ta, tb, m, n, k, alpha,
                                              beta, a, b, c, 0, NULL, NULL, NULL};
                            lb_cpu_gemm_det(&g, lb_cpu_threads(bes[r]),
                                            isa ? LB_CPU_GEMM_BASE : LB_CPU_GEMM_AUTO);
                            snprintf(what, sizeof what,
                                     "gemm det m %d n %d k %d ta %d tb %d a %g b %g, %s, %s", m,
                                     n, k, ta, tb, alpha, beta, r ? "many threads" : "1 thread",
                                     isa ? "baseline ISA" : "best ISA");
                            ASSERT_BITWISE(what, c, want, mn * sizeof(float));
                        }
                    double e = nerr(c, ref, mn);
                    if (verbose() && abi == 1)
                        printf("  gemm det m %d n %d k %d ta %d tb %d: err %.3g (bound 1e-5)\n",
                               m, n, k, ta, tb, e);
                    ck_assert_msg(e <= 1e-5, "gemm det m %d n %d k %d ta %d tb %d alpha %g beta "
                                  "%g: normalised error %.3g > 1e-5", m, n, k, ta, tb, alpha,
                                  beta, e);
                    free(a), free(b), free(c0), free(want), free(c), free(ref);
                }
}
END_TEST

// The non-deterministic backend (deterministic = 0) keeps OpenBLAS: still correct, every trans
// case, alpha and beta, the k == 0 and beta == 0 edges.
START_TEST(test_gemm_openblas_path)
{
    ck_assert_int_eq(be_blas->deterministic, 0);
    ck_assert_int_eq(be->deterministic, 1);
    const int m = 37, n = 29, k = 53;
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            float *a = randn((size_t)m * k, 220 + ta, 1), *b = randn((size_t)k * n, 222 + tb, 1);
            float *c0 = randn((size_t)m * n, 224, 1), *c = fdup(c0, (size_t)m * n);
            double *ref = dzeros((size_t)m * n);
            ref_gemm(ref, ta, tb, m, n, k, 0.7, a, b, 0.3, c0);
            lb_gemm(be_blas, ta, tb, m, n, k, 0.7f, a, b, 0.3f, c);
            char what[64];
            snprintf(what, sizeof what, "gemm OpenBLAS transa %d transb %d", ta, tb);
            ASSERT_CLOSE(what, c, ref, (size_t)m * n, 1e-5);
            free(a), free(b), free(c0), free(c), free(ref);
        }
    float *c = lb_malloc((size_t)m * n * sizeof(float));
    for (int i = 0; i < m * n; i++) c[i] = NAN;
    lb_gemm(be_blas, 0, 1, m, n, 0, 1.0f, NULL, NULL, 0.0f, c);
    for (int i = 0; i < m * n; i++) ck_assert_msg(c[i] == 0.0f, "k == 0, beta 0 must zero C");
    float *a = randn((size_t)m * k, 226, 1), *b = randn((size_t)n * k, 227, 1);
    double *ref = dzeros((size_t)m * n);
    ref_gemm(ref, 0, 1, m, n, k, 1.0, a, b, 0.0, NULL);
    for (int i = 0; i < m * n; i++) c[i] = NAN;
    lb_gemm(be_blas, 0, 1, m, n, k, 1.0f, a, b, 0.0f, c);   // beta 0 over NaN
    ASSERT_CLOSE("gemm OpenBLAS beta 0 over NaN", c, ref, (size_t)m * n, 1e-5);
    free(c), free(a), free(b), free(ref);
}
END_TEST

START_TEST(test_elementwise_and_sumsq)
{
    const size_t n = 100003;   // several sumsq chunks and parallel elementwise loops
    float *x = randn(n, 150, 1), *y0 = randn(n, 151, 1), *y = fdup(y0, n);
    double *ref = dzeros(n);
    be->add(be, y, x, n);
    for (size_t i = 0; i < n; i++) ref[i] = (double)y0[i] + x[i];
    ASSERT_CLOSE("add", y, ref, n, 1e-7);
    be->scale(be, y, -1.75f, n);
    for (size_t i = 0; i < n; i++) ref[i] *= -1.75;
    ASSERT_CLOSE("scale", y, ref, n, 1e-7);

    double s = 0.0;
    for (size_t i = 0; i < n; i++) s += (double)x[i] * x[i];
    double got = be->sumsq(be, x, n);
    if (verbose()) printf("  sumsq rel err %.3g\n", fabs(got - s) / s);
    ck_assert_msg(isfinite(got) && fabs(got - s) <= 1e-12 * s, "sumsq %.17g vs %.17g", got, s);
    ck_assert(be->sumsq(be, x, 0) == 0.0);
    ck_assert(be->sumsq(be, x, 1) == (double)x[0] * x[0]);
    free(x), free(y0), free(y), free(ref);
}
END_TEST

START_TEST(test_embedding)
{
    const int vocab = 11;   // small, so tokens repeat
    int32_t *tok = randint(N, 160, vocab);
    float *wte = randn((size_t)vocab * C, 161, 1), *out = lb_malloc((size_t)N * C * 4);
    be->embedding_fwd(be, out, tok, wte, N, C);
    for (int i = 0; i < N; i++)
        ASSERT_BITWISE("embedding_fwd row", out + (size_t)i * C, wte + (size_t)tok[i] * C,
                       C * sizeof(float));

    float *dout = randn((size_t)N * C, 162, 1), *dw0 = randn((size_t)vocab * C, 163, 1);
    float *dw = fdup(dw0, (size_t)vocab * C);
    double *ref = dzeros((size_t)vocab * C);
    for (int i = 0; i < vocab * C; i++) ref[i] = dw0[i];
    for (int i = 0; i < N; i++)
        for (int j = 0; j < C; j++) ref[(size_t)tok[i] * C + j] += dout[(size_t)i * C + j];
    be->embedding_bwd(be, dw, dout, tok, N, C);
    ASSERT_CLOSE("embedding_bwd (accumulating)", dw, ref, (size_t)vocab * C, 1e-6);
    free(tok), free(wte), free(out), free(dout), free(dw0), free(dw), free(ref);
}
END_TEST

START_TEST(test_rmsnorm_fwd)
{
    float *x = randn((size_t)N * C, 170, 2), *w = randn(C, 171, 1);
    float *out = lb_malloc((size_t)N * C * 4), *rstd = lb_malloc(N * 4);
    double *ref = dzeros((size_t)N * C), *rref = dzeros(N);
    be->rmsnorm_fwd(be, &(lb_rmsnorm_args){.out = out, .rstd = rstd, .x = x, .w = w, .n = N,
            .c = C, .eps = 1e-6f});
    ref_rmsnorm(ref, rref, x, w, N, C, 1e-6f);
    ASSERT_CLOSE("rmsnorm_fwd out", out, ref, (size_t)N * C, 1e-6);
    ASSERT_CLOSE("rmsnorm_fwd rstd", rstd, rref, N, 1e-6);
    free(x), free(w), free(out), free(rstd), free(ref), free(rref);
}
END_TEST

START_TEST(test_rope_fwd)
{
    const int heads = 3;
    size_t sz = (size_t)N * heads * D;
    float *x = randn(sz, 180, 1), *y = fdup(x, sz);
    int32_t *pos = randint(N, 181, 40000);
    pos[0] = 0;
    double *ref = dzeros(sz);
    be->rope(be, &(lb_rope_args){.x = y, .pos = pos, .n = N, .heads = heads, .d = D,
            .theta = 1e6f});
    ref_rope(ref, x, pos, N, heads, D, 1e6);
    ASSERT_CLOSE("rope_fwd", y, ref, sz, 1e-6);
    for (int j = 0; j < heads * D; j++) ck_assert(y[j] == x[j]);   // position 0: identity
    // The backward map is the inverse rotation.
    be->rope(be, &(lb_rope_args){.x = y, .pos = pos, .n = N, .heads = heads, .d = D, .theta = 1e6f,
            .inverse = 1});
    for (size_t i = 0; i < sz; i++) ref[i] = x[i];
    ASSERT_CLOSE("rope_bwd(rope_fwd(x)) == x", y, ref, sz, 1e-6);
    free(x), free(y), free(pos), free(ref);
}
END_TEST

// Llama 3.1's RoPE frequencies written as transformers writes them (torch.where over the three
// bands), for comparison with lb_rope_inv_freq_llama3.
static double ref_llama3_freq(int f, int rot, double theta, double factor, double lo, double hi,
                              double orig)
{
    double inv = 1.0 / pow(theta, 2.0 * f / rot), wl = 2 * M_PI / inv;
    double scaled = wl > orig / lo ? inv / factor : inv;
    double s = (orig / wl - lo) / (hi - lo);
    double smooth = (1 - s) * scaled / factor + s * scaled;
    int medium = !(wl < orig / hi) && !(wl > orig / lo);
    return medium ? smooth : scaled;
}

// llama3-scaled frequencies (a table) and partial rotary (rot < d: the rest passes through).
START_TEST(test_rope_llama3_partial)
{
    const int heads = 2, d = 64, rot = 48, half = rot / 2;
    size_t sz = (size_t)N * heads * d;
    float *x = randn(sz, 182, 1), *y = fdup(x, sz);
    int32_t *pos = randint(N, 183, 40000);
    double *freq = lb_malloc(half * sizeof(double)), *ref = dzeros(sz);
    lb_rope_inv_freq_llama3(freq, rot, 5e5, 8.0, 1.0, 4.0, 64.0);
    int bands[3] = {0, 0, 0};   // scaled, blended, kept: each band must be exercised
    for (int f = 0; f < half; f++) {
        double want = ref_llama3_freq(f, rot, 5e5, 8.0, 1.0, 4.0, 64.0);
        double r = want * pow(5e5, 2.0 * f / rot);
        ck_assert_msg(fabs(freq[f] - want) <= 1e-14 * want, "freq %d: %g, want %g", f, freq[f],
                      want);
        bands[fabs(r - 0.125) < 1e-12 ? 0 : fabs(r - 1) < 1e-12 ? 2 : 1]++;
    }
    ck_assert_msg(bands[0] && bands[1] && bands[2], "bands %d %d %d", bands[0], bands[1], bands[2]);
    be->rope(be, &(lb_rope_args){.x = y, .pos = pos, .n = N, .heads = heads, .d = d,
            .theta = 5e5f, .rot = rot, .inv_freq = freq});
    for (int i = 0; i < N; i++)
        for (int h = 0; h < heads; h++) {
            const float *xh = x + ((size_t)i * heads + h) * d;
            double *oh = ref + ((size_t)i * heads + h) * d;
            for (int f = 0; f < half; f++) {
                double ang = pos[i] * freq[f];
                oh[f] = xh[f] * cos(ang) - xh[f + half] * sin(ang);
                oh[f + half] = xh[f + half] * cos(ang) + xh[f] * sin(ang);
            }
            for (int j = rot; j < d; j++) oh[j] = xh[j];
        }
    ASSERT_CLOSE("rope llama3 partial", y, ref, sz, 1e-6);
    for (size_t i = 0; i < sz; i++)   // the passed-through values are the same bits
        if (i % d >= (size_t)rot) ck_assert(y[i] == x[i]);
    be->rope(be, &(lb_rope_args){.x = y, .pos = pos, .n = N, .heads = heads, .d = d,
            .theta = 5e5f, .inverse = 1, .rot = rot, .inv_freq = freq});
    for (size_t i = 0; i < sz; i++) ref[i] = x[i];
    ASSERT_CLOSE("rope_bwd(rope_fwd(x)) == x, llama3 partial", y, ref, sz, 1e-6);
    free(x), free(y), free(pos), free(ref), free(freq);
}
END_TEST

// DeepSeek-V3's aux-loss-free balancing: experts below the mean load gain rate, those above
// lose it, one at the mean keeps its bias.
START_TEST(test_router_bias_update)
{
    float bias[5] = {0.5f, -0.25f, 0.0f, 1.0f, 2.0f}, load[5] = {1, 5, 3, 0, 6};   // mean 3
    be->router_bias_update(be, bias, load, 5, 0.125f);
    const float want[5] = {0.625f, -0.375f, 0.0f, 1.125f, 1.875f};
    for (int j = 0; j < 5; j++) ck_assert_msg(bias[j] == want[j], "bias %d: %g", j, bias[j]);
}
END_TEST

START_TEST(test_attention_fwd)
{
    size_t nq = (size_t)B * T * HQ * D, nk = (size_t)B * T * HKV * D;
    float *q = randn(nq, 190, 1), *k = randn(nk, 191, 1), *v = randn(nk, 192, 1);
    float *out = lb_malloc(nq * 4), *lse = lb_malloc((size_t)B * HQ * T * 4);
    double *ref = dzeros(nq), *lref = dzeros((size_t)B * HQ * T);
    be->attention_fwd(be, &(lb_attention_args){.out = out, .lse = lse, .q = q, .k = k, .v = v,
            .b = B, .t = T, .hq = HQ, .hkv = HKV, .d = D, .bf16 = 0});
    ref_attention(ref, lref, q, k, v, B, T, HQ, HKV, D);
    ASSERT_CLOSE("attention_fwd out", out, ref, nq, 1e-6);
    ASSERT_CLOSE("attention_fwd lse", lse, lref, (size_t)B * HQ * T, 1e-6);
    // Causality: the first query of each sequence and head sees only its own key.
    for (int bi = 0; bi < B; bi++)
        for (int h = 0; h < HQ; h++)
            for (int x = 0; x < D; x++)
                ck_assert(out[(((size_t)bi * T) * HQ + h) * D + x] ==
                          v[(((size_t)bi * T) * HKV + h / (HQ / HKV)) * D + x]);
    free(q), free(k), free(v), free(out), free(lse), free(ref), free(lref);
}
END_TEST

// bf16 mode (kernels.h) against its arithmetic written out in ref_attention_bf16 and
// ref_attention_bwd_bf16, bit for bit: lengths on both sides of the 64-key chunk edges, head
// dims 16 and 48, GQA groups 2 and 4. The forward reference with 32-key chunks must differ
// somewhere (t 130), so the comparison does see the chunking.
START_TEST(test_attention_bf16_exact)
{
    const int ts[] = {1, 63, 64, 65, 130}, ds[] = {16, 48}, groups[] = {2, 4}, b = 2, hkv = 2;
    for (size_t it = 0; it < sizeof ts / sizeof ts[0]; it++)
        for (size_t id = 0; id < sizeof ds / sizeof ds[0]; id++)
            for (size_t ig = 0; ig < sizeof groups / sizeof groups[0]; ig++) {
                int t = ts[it], d = ds[id], hq = hkv * groups[ig];
                size_t nq = (size_t)b * t * hq * d, nk = (size_t)b * t * hkv * d;
                size_t nl = (size_t)b * hq * t;
                uint64_t sd = 600 + 10 * it + 3 * id + ig;
                float *q = randn(nq, sd, 1.5f), *k = randn(nk, sd + 1000, 1);
                float *v = randn(nk, sd + 2000, 1), *g = randn(nq, sd + 3000, 1);
                float *out = lb_malloc(nq * 4), *lse = lb_malloc(nl * 4);
                float *rout = lb_malloc(nq * 4), *rlse = lb_malloc(nl * 4);
                float *dq = lb_malloc(nq * 4), *dk = lb_malloc(nk * 4), *dv = lb_malloc(nk * 4);
                float *rdq = lb_malloc(nq * 4), *rdk = lb_malloc(nk * 4);
                float *rdv = lb_malloc(nk * 4);
                be->attention_fwd(be, &(lb_attention_args){.out = out, .lse = lse, .q = q, .k = k,
                        .v = v, .b = b, .t = t, .hq = hq, .hkv = hkv, .d = d, .bf16 = 1});
                ref_attention_bf16(rout, rlse, q, k, v, b, t, hq, hkv, d, LB_ATTN_CHUNK);
                char what[96];
                snprintf(what, sizeof what, "bf16 out t %d d %d hq %d: spec", t, d, hq);
                ASSERT_BITWISE(what, out, rout, nq * 4);
                snprintf(what, sizeof what, "bf16 lse t %d d %d hq %d: spec", t, d, hq);
                ASSERT_BITWISE(what, lse, rlse, nl * 4);
                if (t == 130) {
                    ref_attention_bf16(rout, rlse, q, k, v, b, t, hq, hkv, d, 32);
                    ck_assert_msg(memcmp(out, rout, nq * 4) != 0,
                                  "32-key chunks give the same bits as 64: the test is blind");
                }
                // The backward takes the forward's out and lse, as the model does.
                be->attention_bwd(be, &(lb_attention_args){.dq = dq, .dk = dk, .dv = dv, .dout = g,
                        .q = q, .k = k, .v = v, .out = out, .lse = lse, .b = b, .t = t, .hq = hq,
                        .hkv = hkv, .d = d, .bf16 = 1});
                ref_attention_bwd_bf16(rdq, rdk, rdv, g, q, k, v, out, lse, b, t, hq, hkv, d);
                snprintf(what, sizeof what, "bf16 dq t %d d %d hq %d: spec", t, d, hq);
                ASSERT_BITWISE(what, dq, rdq, nq * 4);
                snprintf(what, sizeof what, "bf16 dk t %d d %d hq %d: spec", t, d, hq);
                ASSERT_BITWISE(what, dk, rdk, nk * 4);
                snprintf(what, sizeof what, "bf16 dv t %d d %d hq %d: spec", t, d, hq);
                ASSERT_BITWISE(what, dv, rdv, nk * 4);
                // Causality: the first query sees its own key alone, with p = 1: out = bf16(v).
                for (int bi = 0; bi < b; bi++)
                    for (int h = 0; h < hq; h++)
                        for (int x = 0; x < d; x++)
                            ck_assert(out[(((size_t)bi * t) * hq + h) * d + x] ==
                                      lb_round_bf16(v[(((size_t)bi * t) * hkv + h / (hq / hkv))
                                                      * d + x]));
                free(q), free(k), free(v), free(g), free(out), free(lse), free(rout);
                free(rlse), free(dq), free(dk), free(dv), free(rdq), free(rdk), free(rdv);
            }
}
END_TEST

// sum (a - ref)^2 / sum ref^2; infinite when anything is not finite.
static double nmse_f(const float *a, const float *ref, size_t n)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(a[i]) || !isfinite(ref[i])) return INFINITY;
        num += ((double)a[i] - ref[i]) * ((double)a[i] - ref[i]);
        den += (double)ref[i] * ref[i];
    }
    return den > 0.0 ? num / den : num;
}

// bf16 mode against fp32 mode on the same inputs. bf16 keeps 8 significant bits: one rounding
// is a relative error of at most 2^-9 (RMS about 2^-9 / sqrt(3) = 1.1e-3, a squared relative
// error of 1.3e-6). Each output is a sum of products of a few rounded factors (p and v; dp,
// ds and q or k in the backward), each contributing about 1.3e-6, plus the scores' error
// inside the exponential, which grows with the scores' size (q is drawn with scale 1.5 here,
// scores of standard deviation 1.5): expected NMSE about 1e-5, measured 1.0e-7 (lse) to
// 2.3e-5 (dq). The bound 1e-4 leaves a factor of 4 in MSE (2 in RMS) on fixed inputs and is
// far below what an arithmetic slip (a missed rescale, a wrong scale or mask) gives: NMSE of
// order 1e-2 to 1.
START_TEST(test_attention_bf16_vs_fp32)
{
    const int b = 2, t = 130, hq = 8, hkv = 2, d = 48;
    size_t nq = (size_t)b * t * hq * d, nk = (size_t)b * t * hkv * d, nl = (size_t)b * hq * t;
    float *q = randn(nq, 660, 1.5f), *k = randn(nk, 661, 1), *v = randn(nk, 662, 1);
    float *g = randn(nq, 663, 1);
    float *o[2], *l[2], *dq[2], *dk[2], *dv[2];
    for (int m = 0; m < 2; m++) {
        o[m] = lb_malloc(nq * 4), l[m] = lb_malloc(nl * 4);
        dq[m] = lb_malloc(nq * 4), dk[m] = lb_malloc(nk * 4), dv[m] = lb_malloc(nk * 4);
        be->attention_fwd(be, &(lb_attention_args){.out = o[m], .lse = l[m], .q = q, .k = k,
                .v = v, .b = b, .t = t, .hq = hq, .hkv = hkv, .d = d, .bf16 = m});
        be->attention_bwd(be, &(lb_attention_args){.dq = dq[m], .dk = dk[m], .dv = dv[m],
                .dout = g, .q = q, .k = k, .v = v, .out = o[m], .lse = l[m], .b = b, .t = t,
                .hq = hq, .hkv = hkv, .d = d, .bf16 = m});
    }
    const char *names[5] = {"out", "lse", "dq", "dk", "dv"};
    const float *got[5] = {o[1], l[1], dq[1], dk[1], dv[1]}, *ref[5] = {o[0], l[0], dq[0], dk[0],
                                                                          dv[0]};
    const size_t n[5] = {nq, nl, nq, nk, nk};
    for (int i = 0; i < 5; i++) {
        double e = nmse_f(got[i], ref[i], n[i]);
        printf("  attention bf16 vs fp32 mode %-4s nmse %.3g (bound 1e-4)\n", names[i], e);
        ck_assert_msg(e <= 1e-4, "attention bf16 %s: nmse %.3g against fp32 mode", names[i], e);
    }
    for (int m = 0; m < 2; m++) free(o[m]), free(l[m]), free(dq[m]), free(dk[m]), free(dv[m]);
    free(q), free(k), free(v), free(g);
}
END_TEST

START_TEST(test_swiglu_fwd)
{
    const int f = 41;
    float *gu = randn((size_t)N * 2 * f, 200, 3), *out = lb_malloc((size_t)N * f * 4);
    float *out2 = lb_malloc((size_t)N * f * 4);
    uint16_t *out16 = lb_malloc((size_t)N * 48 * 2);   // (N, pad8(f))
    double *ref = dzeros((size_t)N * f);
    be->swiglu_fwd(be, &(lb_swiglu_args){.out = out, .gu = gu, .n = N, .f = f});
    for (int i = 0; i < N; i++)
        for (int j = 0; j < f; j++) {
            double g = gu[(size_t)i * 2 * f + j], u = gu[(size_t)i * 2 * f + f + j];
            ref[(size_t)i * f + j] = g / (1.0 + exp(-g)) * u;
        }
    ASSERT_CLOSE("swiglu_fwd", out, ref, (size_t)N * f, 1e-6);
    memset(out16, 0xff, (size_t)N * 48 * 2);   // the padding must be written
    be->swiglu_fwd(be, &(lb_swiglu_args){.out = out2, .out16 = out16, .gu = gu, .n = N, .f = f});
    ASSERT_BITWISE("swiglu_fwd with a copy", out2, out, (size_t)N * f * 4);
    check_copy16("swiglu_fwd out16", out16, out, N, f);
    memset(out16, 0xff, (size_t)N * 48 * 2);   // the copy alone, out not written
    be->swiglu_fwd(be, &(lb_swiglu_args){.out16 = out16, .gu = gu, .n = N, .f = f});
    check_copy16("swiglu_fwd out16 alone", out16, out, N, f);
    // a bf16 input (gu16, the gate/up GEMM's c16) reads as its values widened to fp32
    uint16_t *gu16 = lb_malloc((size_t)N * 88 * 2);   // (N, pad8(2f))
    for (int i = 0; i < N; i++)
        lb_bf16_row(gu16 + (size_t)i * 88, gu + (size_t)i * 2 * f, 2 * f, 88);
    for (size_t i = 0; i < (size_t)N * 2 * f; i++) gu[i] = lb_round_bf16(gu[i]);
    be->swiglu_fwd(be, &(lb_swiglu_args){.out = out, .gu = gu, .n = N, .f = f});
    be->swiglu_fwd(be, &(lb_swiglu_args){.out = out2, .gu16 = gu16, .n = N, .f = f});
    ASSERT_BITWISE("swiglu_fwd gu16", out2, out, (size_t)N * f * 4);
    free(gu16);
    free(gu), free(out), free(out2), free(out16), free(ref);
}
END_TEST

// Softmax, top-k by decreasing probability (ties to the lower index), weights with and without
// renormalisation, against double loops.
START_TEST(test_router_topk_fwd)
{
    float *logits = randn((size_t)N * E, 210, 2);
    // Row 0: all equal (choices 0, 1, 2); row 1: a three-way tie at the top (1, 2, 4).
    for (int j = 0; j < E; j++) logits[j] = 0.5f;
    const float row1[E] = {1, 3, 3, 0, 3, -1, 2};
    memcpy(logits + E, row1, sizeof row1);
    float *probs = lb_malloc((size_t)N * E * 4), *w = lb_malloc((size_t)N * K * 4);
    int32_t *idx = lb_malloc((size_t)N * K * 4);
    double *pref = dzeros((size_t)N * E), *wref = dzeros((size_t)N * K);
    for (int i = 0; i < N; i++) {
        double m = -INFINITY, sum = 0.0;
        for (int j = 0; j < E; j++) m = fmax(m, logits[i * E + j]);
        for (int j = 0; j < E; j++) sum += exp(logits[i * E + j] - m);
        for (int j = 0; j < E; j++) pref[i * E + j] = exp(logits[i * E + j] - m) / sum;
    }
    for (int renorm = 0; renorm < 2; renorm++) {
        be->router_topk_fwd(be, &(lb_router_args){.probs = probs, .idx = idx, .weight = w,
                .logits = logits, .n = N, .e = E, .k = K, .renorm = renorm});
        ASSERT_CLOSE("router_topk_fwd probs", probs, pref, (size_t)N * E, 1e-6);
        for (int i = 0; i < N; i++) {
            int chosen[E] = {0};
            double wsum = 0.0;
            for (int s = 0; s < K; s++) {   // selection sort on the double probabilities
                int best = -1;
                for (int j = 0; j < E; j++)
                    if (!chosen[j] && (best < 0 || pref[i * E + j] > pref[i * E + best])) best = j;
                chosen[best] = 1;
                ck_assert_msg(idx[i * K + s] == best, "row %d slot %d: expert %d, want %d", i, s,
                              idx[i * K + s], best);
                wref[i * K + s] = pref[i * E + best];
                wsum += pref[i * E + best];
            }
            if (renorm)
                for (int s = 0; s < K; s++) wref[i * K + s] /= wsum;
        }
        ASSERT_CLOSE(renorm ? "router_topk_fwd weight (renorm)" : "router_topk_fwd weight", w,
                     wref, (size_t)N * K, 1e-6);
        ck_assert(idx[0] == 0 && idx[1] == 1 && idx[2] == 2);
        ck_assert(idx[K] == 1 && idx[K + 1] == 2 && idx[K + 2] == 4);
    }
    free(logits), free(probs), free(w), free(idx), free(pref), free(wref);
}
END_TEST

START_TEST(test_moe_aux_loss)
{
    float *logits = randn((size_t)N * E, 220, 1), *probs = lb_malloc((size_t)N * E * 4);
    float *w = lb_malloc((size_t)N * K * 4), *dpe = lb_malloc(E * 4), loss = NAN;
    int32_t *idx = lb_malloc((size_t)N * K * 4);
    be->router_topk_fwd(be, &(lb_router_args){.probs = probs, .idx = idx, .weight = w,
            .logits = logits, .n = N, .e = E, .k = K, .renorm = 1});
    be->moe_aux_loss(be, &loss, dpe, probs, idx, N, E, K);
    double f[E] = {0}, P[E] = {0}, lref = 0.0, dref[E];
    for (int a = 0; a < N * K; a++) f[idx[a]] += 1.0 / (N * K);
    for (int i = 0; i < N; i++)
        for (int j = 0; j < E; j++) P[j] += probs[i * E + j] / (double)N;
    for (int j = 0; j < E; j++) {
        lref += E * f[j] * P[j];
        dref[j] = E * f[j] / N;
    }
    ASSERT_CLOSE("moe_aux_loss loss", &loss, &lref, 1, 1e-6);
    ASSERT_CLOSE("moe_aux_loss dprobs_expert", dpe, dref, E, 1e-6);
    // Perfect balance with uniform probabilities gives exactly 1.
    for (int i = 0; i < E * E; i++) probs[i] = 1.0f / E;
    int32_t bal[E * 1];
    for (int i = 0; i < E; i++) bal[i] = i;
    be->moe_aux_loss(be, &loss, dpe, probs, bal, E, E, 1);
    ck_assert_msg(fabs(loss - 1.0) < 1e-6, "balanced aux loss %g", loss);
    free(logits), free(probs), free(w), free(dpe), free(idx);
}
END_TEST

// Plan (rows by expert, then token, then slot), permute and combine against naive loops.
START_TEST(test_moe_dispatch_fwd)
{
    int32_t *idx = lb_malloc((size_t)N * K * 4);
    for (int i = 0; i < N; i++)   // distinct experts per token, skewed so expert 6 stays empty
        for (int s = 0; s < K; s++)
            idx[i * K + s] = (int32_t)((lb_rand_u64(230, 2, i) % 4 + (uint64_t)s * 2) % 6);
    int32_t *row = lb_malloc((size_t)N * K * 4);
    int counts[E], cref[E] = {0};
    be->moe_plan(be, row, counts, NULL, idx, N, E, K);
    int next = 0;
    for (int j = 0; j < E; j++)
        for (int i = 0; i < N; i++)
            for (int s = 0; s < K; s++)
                if (idx[i * K + s] == j) {
                    cref[j]++;
                    ck_assert_msg(row[i * K + s] == next, "plan row (%d, %d) = %d, want %d", i, s,
                                  row[i * K + s], next);
                    next++;
                }
    for (int j = 0; j < E; j++) ck_assert_int_eq(counts[j], cref[j]);
    ck_assert_int_eq(counts[6], 0);

    float *x = randn((size_t)N * C, 231, 1), *xp = lb_malloc((size_t)N * K * C * 4);
    uint16_t *xp16 = lb_malloc((size_t)N * K * 56 * 2);   // (N K, pad8(C))
    memset(xp16, 0xff, (size_t)N * K * 56 * 2);
    be->moe_permute(be, xp, xp16, lb_act_f32(x, N, C), row, K);
    for (int a = 0; a < N * K; a++)
        ASSERT_BITWISE("moe_permute row", xp + (size_t)row[a] * C, x + (size_t)(a / K) * C,
                       C * sizeof(float));
    check_copy16("moe_permute xp16", xp16, xp, (size_t)N * K, C);
    memset(xp16, 0xff, (size_t)N * K * 56 * 2);   // the copy alone
    be->moe_permute(be, NULL, xp16, lb_act_f32(x, N, C), row, K);
    check_copy16("moe_permute xp16 alone", xp16, xp, (size_t)N * K, C);
    free(xp16);

    float *yp = randn((size_t)N * K * C, 232, 1), *w = randn((size_t)N * K, 233, 1);
    float *out = lb_malloc((size_t)N * C * 4);
    double *ref = dzeros((size_t)N * C);
    for (int i = 0; i < N; i++)
        for (int s = 0; s < K; s++)
            for (int c = 0; c < C; c++)
                ref[i * C + c] += (double)w[i * K + s] * yp[(size_t)row[i * K + s] * C + c];
    be->moe_combine(be, &(lb_moe_combine_args){.out = out, .yp = yp, .weight = w, .row = row,
            .n = N, .k = K, .c = C});
    ASSERT_CLOSE("moe_combine", out, ref, (size_t)N * C, 1e-6);
    // a bf16 input (yp16, the down GEMM's c16) reads as its values widened to fp32
    const int ld = (C + 7) / 8 * 8;
    uint16_t *yp16 = lb_malloc((size_t)N * K * ld * 2);
    float *out2 = lb_malloc((size_t)N * C * 4);
    for (int r = 0; r < N * K; r++) lb_bf16_row(yp16 + (size_t)r * ld, yp + (size_t)r * C, C, ld);
    for (size_t i = 0; i < (size_t)N * K * C; i++) yp[i] = lb_round_bf16(yp[i]);
    be->moe_combine(be, &(lb_moe_combine_args){.out = out, .yp = yp, .weight = w, .row = row,
            .n = N, .k = K, .c = C});
    be->moe_combine(be, &(lb_moe_combine_args){.out = out2, .yp16 = yp16, .weight = w, .row = row,
            .n = N, .k = K, .c = C});
    ASSERT_BITWISE("moe_combine yp16", out2, out, (size_t)N * C * 4);
    free(yp16), free(out2);
    free(idx), free(row), free(x), free(xp), free(yp), free(w), free(out), free(ref);
}
END_TEST

START_TEST(test_cross_entropy)
{
    float *logits = randn((size_t)N * V, 240, 3), *loss = lb_malloc(N * 4);
    int32_t *tgt = randint(N, 241, V);
    tgt[3] = -1, tgt[17] = -100;   // ignored rows
    double *ref = dzeros(N);
    for (int i = 0; i < N; i++) {
        if (tgt[i] < 0) continue;
        double m = -INFINITY, sum = 0.0;
        for (int j = 0; j < V; j++) m = fmax(m, logits[i * V + j]);
        for (int j = 0; j < V; j++) sum += exp(logits[i * V + j] - m);
        ref[i] = m + log(sum) - logits[i * V + tgt[i]];
    }
    double *stats = lb_malloc((size_t)N * 2 * sizeof(double));
    be->cross_entropy_fwd(be, loss, stats, logits, tgt, N, V);
    ASSERT_CLOSE("cross_entropy_fwd", loss, ref, N, 1e-6);
    ck_assert(loss[3] == 0.0f && loss[17] == 0.0f);
    float *l2 = lb_malloc(N * 4);
    be->cross_entropy_fwd(be, l2, NULL, logits, tgt, N, V);
    ASSERT_BITWISE("cross_entropy_fwd without statistics", l2, loss, N * sizeof(float));

    float *dl = lb_malloc((size_t)N * V * 4), *inplace = fdup(logits, (size_t)N * V);
    float *dls = lb_malloc((size_t)N * V * 4);
    be->cross_entropy_bwd(be, dl, logits, NULL, tgt, 0.25f, N, V);
    for (int j = 0; j < V; j++) ck_assert(dl[3 * V + j] == 0.0f && dl[17 * V + j] == 0.0f);
    be->cross_entropy_bwd(be, inplace, inplace, NULL, tgt, 0.25f, N, V);   // aliasing logits
    ASSERT_BITWISE("cross_entropy_bwd in place", inplace, dl, (size_t)N * V * sizeof(float));
    // with the forward's statistics: the same bits (the backward skips its own pass)
    be->cross_entropy_bwd(be, dls, logits, stats, tgt, 0.25f, N, V);
    ASSERT_BITWISE("cross_entropy_bwd with the forward's statistics", dls, dl,
                   (size_t)N * V * sizeof(float));
    free(stats), free(l2), free(dls);
    for (int i = 0; i < N; i++) {   // each kept row of the gradient sums to zero
        double s = 0.0;
        for (int j = 0; j < V; j++) s += dl[i * V + j];
        ck_assert_msg(fabs(s) < 1e-6, "row %d of dlogits sums to %g", i, s);
    }
    free(logits), free(loss), free(tgt), free(ref), free(dl), free(inplace);
}
END_TEST

// Two AdamW steps worked by hand on p = 1 with gradients 0.5 then -0.25 (lr 0.1, b1 0.9,
// b2 0.999, eps 1e-8, wd 0.01):
//   step 1: m = 0.05, v = 0.00025, mhat = 0.5, vhat = 0.25,
//           p = 1 - 0.1 (0.5 / (0.5 + 1e-8) + 0.01) = 0.899000002
//   step 2: m = 0.045 - 0.025 = 0.02, v = 0.00024975 + 0.0000625 = 0.00031225,
//           mhat = 0.02 / 0.19, vhat = 0.00031225 / 0.001999,
//           p = p1 - 0.1 (mhat / (sqrt(vhat) + 1e-8) + 0.01 p1) = 0.87146730
// Then three steps on random vectors against a double loop.
START_TEST(test_adamw)
{
    float p = 1.0f, m = 0.0f, v = 0.0f, g = 0.5f;
    be->adamw(be, &(lb_adamw_args){.p = &p, .g = &g, .gscale = 1.0f, .m = &m, .v = &v, .n = 1,
            .lr = 0.1f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .wd = 0.01f, .step = 1});
    double p1 = 1.0 - 0.1 * (0.5 / (0.5 + 1e-8) + 0.01);
    // m and v to 1e-4 relative: 1 - beta in float is 1 - 0.999f = 0.00099998713.
    ck_assert_msg(fabs(m / 0.05 - 1) < 1e-4 && fabs(v / 0.00025 - 1) < 1e-4, "m %g v %g", m, v);
    ck_assert_msg(fabs(p - p1) < 1e-6 && fabs(p1 - 0.899000002) < 1e-12, "step 1: p %.9g", p);
    g = -0.25f;
    be->adamw(be, &(lb_adamw_args){.p = &p, .g = &g, .gscale = 1.0f, .m = &m, .v = &v, .n = 1,
            .lr = 0.1f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .wd = 0.01f, .step = 2});
    double p2 = p1 - 0.1 * ((0.02 / 0.19) / (sqrt(0.00031225 / 0.001999) + 1e-8) + 0.01 * p1);
    ck_assert_msg(fabs(m / 0.02 - 1) < 1e-4 && fabs(v / 0.00031225 - 1) < 1e-4, "m %g v %g", m,
                  v);
    ck_assert_msg(fabs(p - p2) < 1e-6 && fabs(p2 - 0.8714673) < 1e-7, "step 2: p %.9g", p);

    const size_t n = 1009;
    float *pp = randn(n, 250, 1), *mm = lb_calloc(n, 4), *vv = lb_calloc(n, 4);
    double *pr = dzeros(n), *mr = dzeros(n), *vr = dzeros(n);
    for (size_t i = 0; i < n; i++) pr[i] = pp[i];
    for (int step = 1; step <= 3; step++) {
        float *gg = randn(n, 251 + step, 0.1f);
        const float gs = step == 2 ? 0.37f : 1.0f;   // a clipped step
        be->adamw(be, &(lb_adamw_args){.p = pp, .g = gg, .gscale = gs, .m = mm, .v = vv, .n = n,
                .lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .wd = 0.1f,
                .step = step});
        for (size_t i = 0; i < n; i++) {
            const double gi = (double)gg[i] * gs;
            mr[i] = 0.9 * mr[i] + 0.1 * gi;
            vr[i] = 0.95 * vr[i] + 0.05 * gi * gi;
            double mh = mr[i] / (1 - pow(0.9, step)), vh = vr[i] / (1 - pow(0.95, step));
            pr[i] -= 1e-2 * (mh / (sqrt(vh) + 1e-8) + 0.1 * pr[i]);
        }
        free(gg);
    }
    ASSERT_CLOSE("adamw p, 3 steps", pp, pr, n, 1e-6);
    ASSERT_CLOSE("adamw m", mm, mr, n, 1e-6);
    ASSERT_CLOSE("adamw v", vv, vr, n, 1e-6);
    // gscale is `scale` then adamw, bit for bit, and leaves g as it was; p16 changes nothing
    // else and gets the new p's bf16 bits.
    float *g1 = randn(n, 260, 0.1f), *g2 = lb_malloc(n * 4), *st[3][3];
    uint16_t *p16 = lb_malloc(n * 2);
    memcpy(g2, g1, n * 4);
    for (int r = 0; r < 3; r++) {
        st[r][0] = randn(n, 261, 1), st[r][1] = randn(n, 262, 0.1f), st[r][2] = lb_calloc(n, 4);
    }
    be->scale(be, g2, 0.37f, n);
    be->adamw(be, &(lb_adamw_args){.p = st[0][0], .g = g2, .gscale = 1.0f, .m = st[0][1],
            .v = st[0][2], .n = n, .lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
            .wd = 0.1f, .step = 2});
    memcpy(g2, g1, n * 4);
    be->adamw(be, &(lb_adamw_args){.p = st[1][0], .g = g1, .gscale = 0.37f, .m = st[1][1],
            .v = st[1][2], .n = n, .lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
            .wd = 0.1f, .step = 2});
    be->adamw(be, &(lb_adamw_args){.p = st[2][0], .g = g1, .gscale = 0.37f, .m = st[2][1],
            .v = st[2][2], .p16 = p16, .n = n, .lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f,
            .eps = 1e-8f, .wd = 0.1f, .step = 2});
    ck_assert_msg(!memcmp(g1, g2, n * 4), "adamw changed g");
    for (int i = 0; i < 3; i++) {
        ck_assert_msg(!memcmp(st[0][i], st[1][i], n * 4), "adamw gscale != scale + adamw (%d)", i);
        ck_assert_msg(!memcmp(st[1][i], st[2][i], n * 4), "adamw with p16 differs (%d)", i);
    }
    for (size_t i = 0; i < n; i++)
        ck_assert_msg(p16[i] == lb_f32_to_bf16(st[2][0][i]), "adamw p16[%zu] %04x, not %04x", i,
                      p16[i], lb_f32_to_bf16(st[2][0][i]));
    for (int r = 0; r < 3; r++) free(st[r][0]), free(st[r][1]), free(st[r][2]);
    free(g1), free(g2), free(p16);
    free(pp), free(mm), free(vv), free(pr), free(mr), free(vr);
}
END_TEST

// adamw16 is adamw on the widened bf16 moments: p and p16 bit for bit, the moments stored as
// the rounding of adamw's; a second step on those stored moments again so. Moments that came
// out of a bf16 step are widened exactly, so they also round-trip through fp32 (checkpoints).
START_TEST(test_adamw16)
{
    const size_t n = 1013;
    float *p32 = randn(n, 270, 1), *p = lb_malloc(n * 4), *m = randn(n, 271, 0.1f);
    float *v = randn(n, 272, 0.01f);
    uint16_t *m16 = lb_malloc(n * 2), *v16 = lb_malloc(n * 2), *a16 = lb_malloc(n * 2);
    uint16_t *b16 = lb_malloc(n * 2);
    for (size_t i = 0; i < n; i++) {
        m16[i] = lb_f32_to_bf16(m[i]), v16[i] = lb_f32_to_bf16(fabsf(v[i]));
        m[i] = lb_bf16_to_f32(m16[i]), v[i] = lb_bf16_to_f32(v16[i]);
    }
    memcpy(p, p32, n * 4);
    for (int step = 1; step <= 2; step++) {
        float *g = randn(n, 273 + step, 0.1f);
        be->adamw(be, &(lb_adamw_args){.p = p32, .g = g, .gscale = 0.37f, .m = m, .v = v,
                .p16 = a16, .n = n, .lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
                .wd = 0.1f, .step = step});
        be->adamw16(be, &(lb_adamw_args){.p = p, .g = g, .gscale = 0.37f, .m16 = m16, .v16 = v16,
                .p16 = b16, .n = n, .lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
                .wd = 0.1f, .step = step});
        ck_assert_msg(!memcmp(p, p32, n * 4), "adamw16 p differs from adamw's (step %d)", step);
        ck_assert_msg(!memcmp(a16, b16, n * 2), "adamw16 p16 differs (step %d)", step);
        for (size_t i = 0; i < n; i++) {
            ck_assert_msg(m16[i] == lb_f32_to_bf16(m[i]) && v16[i] == lb_f32_to_bf16(v[i]),
                          "adamw16 moments[%zu] %04x %04x, not the rounding of %g %g", i,
                          m16[i], v16[i], m[i], v[i]);
            m[i] = lb_bf16_to_f32(m16[i]), v[i] = lb_bf16_to_f32(v16[i]);   // step 2 from these
        }
        free(g);
    }
    free(p32), free(p), free(m), free(v), free(m16), free(v16), free(a16), free(b16);
}
END_TEST

// --- finite-difference gradient checks -----------------------------------------------------------
//
// Each check defines a scalar L(inputs) = sum(out * R) with a fixed random R (accumulated in
// double), computes the analytic gradient with the backward operation, and compares it with
// central differences on a spread sample of elements of each input, then along one random
// direction through all elements at once. Error: max |analytic - numeric| / max |numeric| over
// the sample. Step h (relative to max(1, |x|)): 1e-2 where L is linear in the input (no
// truncation error, so the larger step only shrinks rounding noise) and for cross-entropy,
// 3e-3 for the router (its aux loss comes back as a float), 1e-3 elsewhere. Correct gradients
// measure 3e-4 or less against bounds of 1e-3 (linear) and 2e-3 (nonlinear); a gradient that
// drops a term or a factor is off by 1e-2 to 1.

typedef double (*loss_fn)(void *ctx);

static double dot_out(const float *out, const float *r, size_t n)
{
    double s = 0.0;
    for (size_t i = 0; i < n; i++) s += (double)out[i] * r[i];
    return s;
}

#define FD_SAMPLES 40

static void fd_check(const char *what, loss_fn loss, void *ctx, float *x, const float *grad,
                     size_t nx, double h, double tol, uint64_t seed)
{
    size_t samples = nx < FD_SAMPLES ? nx : FD_SAMPLES;
    double maxdiff = 0.0, maxnum = 0.0;
    for (size_t s = 0; s < samples; s++) {
        size_t lo = s * nx / samples, hi = (s + 1) * nx / samples;   // one per stratum
        size_t i = lo + lb_rand_u64(seed, 3, s) % (hi - lo);
        float x0 = x[i];
        double hi_ = h * fmax(1.0, fabs(x0));
        float xp = (float)(x0 + hi_), xm = (float)(x0 - hi_);
        x[i] = xp;
        double lp = loss(ctx);
        x[i] = xm;
        double lm = loss(ctx);
        x[i] = x0;
        double num = (lp - lm) / ((double)xp - xm);
        ck_assert_msg(isfinite(grad[i]) && isfinite(num), "%s: non-finite gradient at %zu", what,
                      i);
        maxdiff = fmax(maxdiff, fabs(num - grad[i]));
        maxnum = fmax(maxnum, fabs(num));
    }
    ck_assert_msg(maxnum > 0.0, "%s: numeric gradient is zero on every sample", what);
    double err = maxdiff / maxnum;

    // Directional derivative along u: every element takes part.
    float *x0 = fdup(x, nx), *u = randn(nx, seed + 1000, 1);
    double ana = 0.0;
    for (size_t i = 0; i < nx; i++) {
        float xp = (float)(x0[i] + h * u[i]), xm = (float)(x0[i] - h * u[i]);
        ana += (double)grad[i] * ((double)xp - xm);
        x[i] = xp;
    }
    double lp = loss(ctx);
    for (size_t i = 0; i < nx; i++) x[i] = (float)(x0[i] - h * u[i]);
    double lm = loss(ctx);
    memcpy(x, x0, nx * sizeof(float));
    double derr = fabs((lp - lm) - ana) / fmax(fabs(ana), 1e-30);
    free(x0), free(u);

    if (verbose())
        printf("  grad %-29s err %.3g, directional %.3g (bound %.1g)\n", what, err, derr, tol);
    ck_assert_msg(err <= tol, "%s: gradient error %.3g > %.3g", what, err, tol);
    ck_assert_msg(derr <= tol, "%s: directional gradient error %.3g > %.3g", what, derr, tol);
}

// dst = a - b: the part a backward added to an accumulating output that started at b.
static float *fdiff(const float *a, const float *b, size_t n)
{
    float *d = lb_malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) d[i] = a[i] - b[i];
    return d;
}

typedef struct {
    float *out, *wte, *r;
    int32_t *tok;
    int n, c;
} emb_ctx;

static double emb_loss(void *p)
{
    emb_ctx *q = p;
    be->embedding_fwd(be, q->out, q->tok, q->wte, q->n, q->c);
    return dot_out(q->out, q->r, (size_t)q->n * q->c);
}

START_TEST(test_grad_embedding)
{
    const int vocab = 11;
    emb_ctx q = {lb_malloc((size_t)N * C * 4), randn((size_t)vocab * C, 300, 1),
                 randn((size_t)N * C, 301, 1), randint(N, 302, vocab), N, C};
    float *d0 = randn((size_t)vocab * C, 303, 1), *dw = fdup(d0, (size_t)vocab * C);
    be->embedding_bwd(be, dw, q.r, q.tok, N, C);
    float *g = fdiff(dw, d0, (size_t)vocab * C);
    fd_check("embedding dwte", emb_loss, &q, q.wte, g, (size_t)vocab * C, 1e-2, 1e-3, 304);
    free(q.out), free(q.wte), free(q.r), free(q.tok), free(d0), free(dw), free(g);
}
END_TEST

typedef struct {
    float *out, *rstd, *x, *w, *r;
    int n, c;
} rms_ctx;

static double rms_loss(void *p)
{
    rms_ctx *q = p;
    be->rmsnorm_fwd(be, &(lb_rmsnorm_args){.out = q->out, .rstd = q->rstd, .x = q->x, .w = q->w,
            .n = q->n, .c = q->c, .eps = 1e-6f});
    return dot_out(q->out, q->r, (size_t)q->n * q->c);
}

START_TEST(test_grad_rmsnorm)
{
    const int n = 7;
    rms_ctx q = {lb_malloc((size_t)n * C * 4), lb_malloc(n * 4), randn((size_t)n * C, 310, 1),
                 randn(C, 311, 1), randn((size_t)n * C, 312, 1), n, C};
    float *dx = lb_malloc((size_t)n * C * 4), *d0 = randn(C, 313, 1), *dw = fdup(d0, C);
    rms_loss(&q);
    be->rmsnorm_bwd(be, &(lb_rmsnorm_args){.dx = dx, .dx_beta = 0.0f, .dw = dw, .dout = q.r,
            .x = q.x, .w = q.w, .rstd = q.rstd, .n = n, .c = C});
    float *gw = fdiff(dw, d0, C);
    fd_check("rmsnorm dx", rms_loss, &q, q.x, dx, (size_t)n * C, 1e-3, 2e-3, 314);
    fd_check("rmsnorm dw", rms_loss, &q, q.w, gw, C, 1e-3, 2e-3, 315);
    // dx_beta 1 adds into a residual's gradient: the bits of add() after the overwrite
    float *res = randn((size_t)n * C, 316, 1), *want = fdup(res, (size_t)n * C);
    be->add(be, want, dx, (size_t)n * C);
    be->rmsnorm_bwd(be, &(lb_rmsnorm_args){.dx = res, .dx_beta = 1.0f, .dw = dw, .dout = q.r,
            .x = q.x, .w = q.w, .rstd = q.rstd, .n = n, .c = C});
    ASSERT_BITWISE("rmsnorm_bwd dx_beta 1 vs add", res, want, (size_t)n * C * 4);
    free(q.out), free(q.rstd), free(q.x), free(q.w), free(q.r), free(dx), free(d0), free(dw);
    free(gw), free(res), free(want);
}
END_TEST

typedef struct {
    float *out, *x, *r;
    int32_t *pos;
    int n, heads, d;
} rope_ctx;

static double rope_loss(void *p)
{
    rope_ctx *q = p;
    size_t sz = (size_t)q->n * q->heads * q->d;
    memcpy(q->out, q->x, sz * sizeof(float));
    be->rope(be, &(lb_rope_args){.x = q->out, .pos = q->pos, .n = q->n, .heads = q->heads,
            .d = q->d, .theta = 1e4f});
    return dot_out(q->out, q->r, sz);
}

START_TEST(test_grad_rope)
{
    const int n = 5, heads = 3;
    size_t sz = (size_t)n * heads * D;
    rope_ctx q = {lb_malloc(sz * 4), randn(sz, 320, 1), randn(sz, 321, 1), randint(n, 322, 500),
                  n, heads, D};
    float *dx = fdup(q.r, sz);
    be->rope(be, &(lb_rope_args){.x = dx, .pos = q.pos, .n = n, .heads = heads, .d = D,
            .theta = 1e4f, .inverse = 1});
    fd_check("rope dx", rope_loss, &q, q.x, dx, sz, 1e-2, 1e-3, 323);
    free(q.out), free(q.x), free(q.r), free(q.pos), free(dx);
}
END_TEST

typedef struct {
    float *out, *lse, *q, *k, *v, *r;
} attn_ctx;

static double attn_loss(void *p)
{
    attn_ctx *a = p;
    be->attention_fwd(be, &(lb_attention_args){.out = a->out, .lse = a->lse, .q = a->q, .k = a->k,
            .v = a->v, .b = B, .t = T, .hq = HQ, .hkv = HKV, .d = D, .bf16 = 0});
    return dot_out(a->out, a->r, (size_t)B * T * HQ * D);
}

START_TEST(test_grad_attention)
{
    size_t nq = (size_t)B * T * HQ * D, nk = (size_t)B * T * HKV * D;
    attn_ctx a = {lb_malloc(nq * 4), lb_malloc((size_t)B * HQ * T * 4), randn(nq, 330, 1),
                  randn(nk, 331, 1), randn(nk, 332, 1), randn(nq, 333, 1)};
    float *dq = lb_malloc(nq * 4), *dk = lb_malloc(nk * 4), *dv = lb_malloc(nk * 4);
    attn_loss(&a);
    be->attention_bwd(be, &(lb_attention_args){.dq = dq, .dk = dk, .dv = dv, .dout = a.r, .q = a.q,
            .k = a.k, .v = a.v, .out = a.out, .lse = a.lse, .b = B, .t = T, .hq = HQ, .hkv = HKV,
            .d = D, .bf16 = 0});
    fd_check("attention dq", attn_loss, &a, a.q, dq, nq, 1e-3, 2e-3, 334);
    fd_check("attention dk", attn_loss, &a, a.k, dk, nk, 1e-3, 2e-3, 335);
    fd_check("attention dv", attn_loss, &a, a.v, dv, nk, 1e-3, 2e-3, 336);
    free(a.out), free(a.lse), free(a.q), free(a.k), free(a.v), free(a.r), free(dq), free(dk);
    free(dv);
}
END_TEST

typedef struct {
    float *out, *gu, *r;
    int n, f;
} swiglu_ctx;

static double swiglu_loss(void *p)
{
    swiglu_ctx *q = p;
    be->swiglu_fwd(be, &(lb_swiglu_args){.out = q->out, .gu = q->gu, .n = q->n, .f = q->f});
    return dot_out(q->out, q->r, (size_t)q->n * q->f);
}

START_TEST(test_grad_swiglu)
{
    const int n = 9, f = 41;
    swiglu_ctx q = {lb_malloc((size_t)n * f * 4), randn((size_t)n * 2 * f, 340, 2),
                    randn((size_t)n * f, 341, 1), n, f};
    float *dgu = lb_malloc((size_t)n * 2 * f * 4), *dgu2 = lb_malloc((size_t)n * 2 * f * 4);
    uint16_t *dgu16 = lb_malloc((size_t)n * 88 * 2);   // (n, pad8(2 f))
    be->swiglu_bwd(be, &(lb_swiglu_args){.dgu = dgu, .dout = q.r, .gu = q.gu, .n = n, .f = f});
    fd_check("swiglu dgate", swiglu_loss, &q, q.gu, dgu, (size_t)n * 2 * f, 1e-3, 2e-3, 342);
    memset(dgu16, 0xff, (size_t)n * 88 * 2);
    be->swiglu_bwd(be, &(lb_swiglu_args){.dgu = dgu2, .dgu16 = dgu16, .dout = q.r, .gu = q.gu,
            .n = n, .f = f});
    ASSERT_BITWISE("swiglu_bwd with a copy", dgu2, dgu, (size_t)n * 2 * f * 4);
    check_copy16("swiglu_bwd dgu16", dgu16, dgu, n, 2 * f);
    memset(dgu16, 0xff, (size_t)n * 88 * 2);   // the copy alone
    be->swiglu_bwd(be, &(lb_swiglu_args){.dgu16 = dgu16, .dout = q.r, .gu = q.gu, .n = n, .f = f});
    check_copy16("swiglu_bwd dgu16 alone", dgu16, dgu, n, 2 * f);
    free(q.out), free(q.gu), free(q.r), free(dgu), free(dgu2), free(dgu16);
}
END_TEST

// L = sum(weight * R) + aux_coef * aux_loss(probs, idx): the top-k weights and, through
// dprobs_expert, the load-balancing loss. The expert counts f_j are constants of the loss, as
// in every MoE implementation; the logits keep gaps of at least 0.4 between ranks so no
// perturbation changes the choice (checked on every evaluation).
typedef struct {
    float *logits, *probs, *weight, *r;
    int32_t *idx, *idx0;
    int n, renorm;
    float aux_coef;
} router_ctx;

static double router_loss(void *p)
{
    router_ctx *q = p;
    be->router_topk_fwd(be, &(lb_router_args){.probs = q->probs, .idx = q->idx,
            .weight = q->weight, .logits = q->logits, .n = q->n, .e = E, .k = K,
            .renorm = q->renorm});
    ck_assert_msg(memcmp(q->idx, q->idx0, (size_t)q->n * K * 4) == 0,
                  "router: a perturbation changed the top-k choice; the check is invalid");
    double l = dot_out(q->weight, q->r, (size_t)q->n * K);
    if (q->aux_coef != 0.0f) {
        float aux, dpe[E];
        be->moe_aux_loss(be, &aux, dpe, q->probs, q->idx, q->n, E, K);
        l += (double)q->aux_coef * aux;
    }
    return l;
}

static void router_case(int renorm, float aux_coef, const char *what, uint64_t seed)
{
    const int n = 11;
    router_ctx q = {lb_malloc((size_t)n * E * 4), lb_malloc((size_t)n * E * 4),
                    lb_malloc((size_t)n * K * 4), randn((size_t)n * K, seed, 1),
                    lb_malloc((size_t)n * K * 4), lb_malloc((size_t)n * K * 4), n, renorm,
                    aux_coef};
    for (int i = 0; i < n; i++)   // ranks 0.6 apart in a per-row random order, +-0.1 jitter
        for (int j = 0; j < E; j++) {
            int rank = (int)((j * 3 + lb_rand_u64(seed, 4, i)) % E);   // 3 is coprime to 7
            float jitter = 0.2f * (lb_rand_uniform(seed, 5, (uint64_t)i * E + j) - 0.5f);
            q.logits[i * E + j] = 0.6f * rank - 1.5f + jitter;
        }
    // The base point: probs and the top-k choice every perturbed evaluation must reproduce.
    be->router_topk_fwd(be, &(lb_router_args){.probs = q.probs, .idx = q.idx, .weight = q.weight,
            .logits = q.logits, .n = n, .e = E, .k = K, .renorm = renorm});
    memcpy(q.idx0, q.idx, (size_t)n * K * 4);
    float dpe[E], aux;
    be->moe_aux_loss(be, &aux, dpe, q.probs, q.idx, n, E, K);
    for (int j = 0; j < E; j++) dpe[j] *= aux_coef;
    float *dl = lb_malloc((size_t)n * E * 4);
    be->router_topk_bwd(be, &(lb_router_args){.dlogits = dl, .dweight = q.r,
            .dprobs_expert = aux_coef != 0.0f ? dpe : NULL, .probs = q.probs, .idx = q.idx, .n = n,
            .e = E, .k = K, .renorm = renorm});
    fd_check(what, router_loss, &q, q.logits, dl, (size_t)n * E, 3e-3, 2e-3, seed + 1);
    free(q.logits), free(q.probs), free(q.weight), free(q.r), free(q.idx), free(q.idx0);
    free(dl);
}

START_TEST(test_grad_router)
{
    router_case(0, 0.0f, "router dlogits", 350);
    router_case(1, 0.0f, "router dlogits (renorm)", 351);
    router_case(1, 4.0f, "router dlogits (renorm, aux)", 352);
    router_case(0, 4.0f, "router dlogits (aux)", 353);
}
END_TEST

typedef struct {
    float *x, *xp, *yp, *w, *out, *r;
    int32_t *row;
} moe_ctx;

static double permute_loss(void *p)
{
    moe_ctx *q = p;
    be->moe_permute(be, q->xp, NULL, lb_act_f32(q->x, N, C), q->row, K);
    return dot_out(q->xp, q->r, (size_t)N * K * C);
}

static double combine_loss(void *p)
{
    moe_ctx *q = p;
    be->moe_combine(be, &(lb_moe_combine_args){.out = q->out, .yp = q->yp, .weight = q->w,
            .row = q->row, .n = N, .k = K, .c = C});
    return dot_out(q->out, q->r, (size_t)N * C);
}

static int32_t *make_plan(uint64_t seed)
{
    int32_t *idx = lb_malloc((size_t)N * K * 4), *row = lb_malloc((size_t)N * K * 4);
    for (int i = 0; i < N; i++)
        for (int s = 0; s < K; s++)
            idx[i * K + s] = (int32_t)((lb_rand_u64(seed, 6, i) + (uint64_t)s * 2) % E);
    int counts[E];
    be->moe_plan(be, row, counts, NULL, idx, N, E, K);
    free(idx);
    return row;
}

START_TEST(test_grad_moe_permute)
{
    moe_ctx q = {.x = randn((size_t)N * C, 360, 1), .xp = lb_malloc((size_t)N * K * C * 4),
                 .r = randn((size_t)N * K * C, 361, 1), .row = make_plan(362)};
    float *dx = lb_malloc((size_t)N * C * 4);
    be->moe_permute_bwd(be, dx, q.r, NULL, q.row, N, K, C);
    fd_check("moe_permute dx", permute_loss, &q, q.x, dx, (size_t)N * C, 1e-2, 1e-3, 363);
    free(q.x), free(q.xp), free(q.r), free(q.row), free(dx);
}
END_TEST

START_TEST(test_grad_moe_combine)
{
    moe_ctx q = {.yp = randn((size_t)N * K * C, 370, 1), .w = randn((size_t)N * K, 371, 1),
                 .out = lb_malloc((size_t)N * C * 4), .r = randn((size_t)N * C, 372, 1),
                 .row = make_plan(373)};
    float *dyp = lb_malloc((size_t)N * K * C * 4), *dw = lb_malloc((size_t)N * K * 4);
    float *dyp2 = lb_malloc((size_t)N * K * C * 4), *dw2 = lb_malloc((size_t)N * K * 4);
    uint16_t *dyp16 = lb_malloc((size_t)N * K * 56 * 2);   // (N K, pad8(C))
    be->moe_combine_bwd(be, &(lb_moe_combine_args){.dyp = dyp, .dweight = dw, .dout = q.r,
            .yp = q.yp, .weight = q.w, .row = q.row, .n = N, .k = K, .c = C});
    fd_check("moe_combine dyp", combine_loss, &q, q.yp, dyp, (size_t)N * K * C, 1e-2, 1e-3, 374);
    fd_check("moe_combine dweight", combine_loss, &q, q.w, dw, (size_t)N * K, 1e-2, 1e-3, 375);
    memset(dyp16, 0xff, (size_t)N * K * 56 * 2);
    be->moe_combine_bwd(be, &(lb_moe_combine_args){.dyp = dyp2, .dyp16 = dyp16, .dweight = dw2,
            .dout = q.r, .yp = q.yp, .weight = q.w, .row = q.row, .n = N, .k = K, .c = C});
    ASSERT_BITWISE("moe_combine_bwd dyp with a copy", dyp2, dyp, (size_t)N * K * C * 4);
    ASSERT_BITWISE("moe_combine_bwd dweight with a copy", dw2, dw, (size_t)N * K * 4);
    check_copy16("moe_combine_bwd dyp16", dyp16, dyp, (size_t)N * K, C);
    memset(dyp16, 0xff, (size_t)N * K * 56 * 2);   // the copy alone; dweight all the same
    be->moe_combine_bwd(be, &(lb_moe_combine_args){.dyp16 = dyp16, .dweight = dw2, .dout = q.r,
            .yp = q.yp, .weight = q.w, .row = q.row, .n = N, .k = K, .c = C});
    check_copy16("moe_combine_bwd dyp16 alone", dyp16, dyp, (size_t)N * K, C);
    ASSERT_BITWISE("moe_combine_bwd dweight, dyp16 alone", dw2, dw, (size_t)N * K * 4);
    free(q.yp), free(q.w), free(q.out), free(q.r), free(q.row), free(dyp), free(dw);
    free(dyp2), free(dw2), free(dyp16);
}
END_TEST

typedef struct {
    float *logits, *loss;
    int32_t *tgt;
    float dloss;
} ce_ctx;

static double ce_loss(void *p)
{
    ce_ctx *q = p;
    be->cross_entropy_fwd(be, q->loss, NULL, q->logits, q->tgt, N, V);
    double s = 0.0;
    for (int i = 0; i < N; i++) s += (double)q->dloss * q->loss[i];
    return s;
}

START_TEST(test_grad_cross_entropy)
{
    ce_ctx q = {randn((size_t)N * V, 380, 2), lb_malloc(N * 4), randint(N, 381, V), 0.3f};
    q.tgt[0] = -1, q.tgt[20] = -1;
    float *dl = lb_malloc((size_t)N * V * 4);
    be->cross_entropy_bwd(be, dl, q.logits, NULL, q.tgt, q.dloss, N, V);
    // h 1e-2: a per-token loss near 5 carries float rounding of ~5e-7, which a smaller step
    // would turn into gradient noise near the bound.
    fd_check("cross_entropy dlogits", ce_loss, &q, q.logits, dl, (size_t)N * V, 1e-2, 2e-3, 382);
    free(q.logits), free(q.loss), free(q.tgt), free(dl);
}
END_TEST

// The linear layer's three passes: fprop Y = X W^T, dgrad dX = dY W, wgrad dW += dY^T X.
typedef struct {
    float *x, *w, *y, *r;
    int n, in, out;
} lin_ctx;

static double lin_loss(void *p)
{
    lin_ctx *q = p;
    lb_gemm(be, 0, 1, q->n, q->out, q->in, 1.0f, q->x, q->w, 0.0f, q->y);
    return dot_out(q->y, q->r, (size_t)q->n * q->out);
}

START_TEST(test_grad_gemm_linear)
{
    const int n = 13, in = 53, out = 29;
    lin_ctx q = {randn((size_t)n * in, 390, 1), randn((size_t)out * in, 391, 1),
                 lb_malloc((size_t)n * out * 4), randn((size_t)n * out, 392, 1), n, in, out};
    float *dx = lb_malloc((size_t)n * in * 4), *d0 = randn((size_t)out * in, 393, 1);
    float *dw = fdup(d0, (size_t)out * in);
    lb_gemm(be, 0, 0, n, in, out, 1.0f, q.r, q.w, 0.0f, dx);   // dgrad
    lb_gemm(be, 1, 0, out, in, n, 1.0f, q.r, q.x, 1.0f, dw);   // wgrad
    float *gw = fdiff(dw, d0, (size_t)out * in);
    fd_check("linear dX (dgrad)", lin_loss, &q, q.x, dx, (size_t)n * in, 1e-2, 1e-3, 394);
    fd_check("linear dW (wgrad)", lin_loss, &q, q.w, gw, (size_t)out * in, 1e-2, 1e-3, 395);
    free(q.x), free(q.w), free(q.y), free(q.r), free(dx), free(d0), free(dw), free(gw);
}
END_TEST

// --- determinism: one thread against several ---------------------------------------------------

START_TEST(test_determinism_threads)
{
    const int b = 2, t = 67, hq = 6, hkv = 2, d = 24;
    size_t nq = (size_t)b * t * hq * d, nk = (size_t)b * t * hkv * d, nl = (size_t)b * hq * t;
    float *q = randn(nq, 400, 1), *k = randn(nk, 401, 1), *v = randn(nk, 402, 1);
    float *dout = randn(nq, 403, 1);
    float *o[2], *l[2], *dq[2], *dk[2], *dv[2];
    lb_backend *bes[2] = {be_one, be_many};
    for (int bf16 = 0; bf16 <= 1; bf16++) {   // both numerics modes; t spans two bf16 chunks
        for (int r = 0; r < 2; r++) {
            o[r] = lb_malloc(nq * 4), l[r] = lb_malloc(nl * 4);
            dq[r] = lb_malloc(nq * 4), dk[r] = lb_malloc(nk * 4), dv[r] = lb_malloc(nk * 4);
            bes[r]->attention_fwd(bes[r], &(lb_attention_args){.out = o[r], .lse = l[r], .q = q,
                    .k = k, .v = v, .b = b, .t = t, .hq = hq, .hkv = hkv, .d = d, .bf16 = bf16});
            bes[r]->attention_bwd(bes[r], &(lb_attention_args){.dq = dq[r], .dk = dk[r],
                    .dv = dv[r], .dout = dout, .q = q, .k = k, .v = v, .out = o[r], .lse = l[r],
                    .b = b, .t = t, .hq = hq, .hkv = hkv, .d = d, .bf16 = bf16});
        }
        ASSERT_BITWISE("attention_fwd out, 1 vs many threads", o[0], o[1], nq * 4);
        ASSERT_BITWISE("attention_fwd lse, 1 vs many threads", l[0], l[1], nl * 4);
        ASSERT_BITWISE("attention_bwd dq, 1 vs many threads", dq[0], dq[1], nq * 4);
        ASSERT_BITWISE("attention_bwd dk, 1 vs many threads", dk[0], dk[1], nk * 4);
        ASSERT_BITWISE("attention_bwd dv, 1 vs many threads", dv[0], dv[1], nk * 4);
        for (int r = 0; r < 2; r++) free(o[r]), free(l[r]), free(dq[r]), free(dk[r]), free(dv[r]);
    }

    const size_t n = 1000003;
    float *x = randn(n, 404, 1);
    double s1 = be_one->sumsq(be_one, x, n), s2 = be_many->sumsq(be_many, x, n);
    ck_assert_msg(memcmp(&s1, &s2, sizeof s1) == 0, "sumsq %.17g vs %.17g", s1, s2);
    free(x);

    const int ntok = 301, vocab = 50, c = 517;   // n * c large enough to run in parallel
    int32_t *tok = randint(ntok, 405, vocab);
    float *g = randn((size_t)ntok * c, 406, 1);
    float *w1 = randn((size_t)vocab * c, 407, 1), *w2 = fdup(w1, (size_t)vocab * c);
    be_one->embedding_bwd(be_one, w1, g, tok, ntok, c);
    be_many->embedding_bwd(be_many, w2, g, tok, ntok, c);
    ASSERT_BITWISE("embedding_bwd, 1 vs many threads", w1, w2, (size_t)vocab * c * 4);

    float *xr = randn((size_t)ntok * c, 408, 1), *wr = randn(c, 409, 1);
    float *outr = lb_malloc((size_t)ntok * c * 4), *rstd = lb_malloc(ntok * 4);
    float *dx1 = lb_malloc((size_t)ntok * c * 4), *dx2 = lb_malloc((size_t)ntok * c * 4);
    float *dw1 = lb_calloc(c, 4), *dw2 = lb_calloc(c, 4);
    be->rmsnorm_fwd(be, &(lb_rmsnorm_args){.out = outr, .rstd = rstd, .x = xr, .w = wr, .n = ntok,
            .c = c, .eps = 1e-6f});
    be_one->rmsnorm_bwd(be_one, &(lb_rmsnorm_args){.dx = dx1, .dx_beta = 0.0f, .dw = dw1,
            .dout = g, .x = xr, .w = wr, .rstd = rstd, .n = ntok, .c = c});
    be_many->rmsnorm_bwd(be_many, &(lb_rmsnorm_args){.dx = dx2, .dx_beta = 0.0f, .dw = dw2,
            .dout = g, .x = xr, .w = wr, .rstd = rstd, .n = ntok, .c = c});
    ASSERT_BITWISE("rmsnorm_bwd dx, 1 vs many threads", dx1, dx2, (size_t)ntok * c * 4);
    ASSERT_BITWISE("rmsnorm_bwd dw, 1 vs many threads", dw1, dw2, (size_t)c * 4);
    free(q), free(k), free(v), free(dout), free(tok), free(g), free(w1), free(w2), free(xr);
    free(wr), free(outr), free(rstd), free(dx1), free(dx2), free(dw1), free(dw2);
}
END_TEST

// The deterministic GEMM on 1 thread and on several, every trans case, large enough that the
// call is split over threads (and, for OpenBLAS, that its threads split the product).
START_TEST(test_determinism_gemm_threads)
{
    const int m = 256, n = 300, k = 512;
    float *a = randn((size_t)m * k, 450, 1), *b = randn((size_t)n * k, 451, 1);
    float *c1 = lb_malloc((size_t)m * n * 4), *c2 = lb_malloc((size_t)m * n * 4);
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            lb_gemm(be_one, ta, tb, m, n, k, 1.0f, a, b, 0.0f, c1);
            lb_gemm(be_many, ta, tb, m, n, k, 1.0f, a, b, 0.0f, c2);
            int diff = 0;
            for (int i = 0; i < m * n; i++) diff += memcmp(&c1[i], &c2[i], 4) != 0;
            if (verbose() || diff)
                printf("  gemm m %d n %d k %d transa %d transb %d, 1 vs %d threads: %d of %d "
                       "outputs differ\n", m, n, k, ta, tb, many_threads, diff, m * n);
            ck_assert_msg(diff == 0, "deterministic gemm depends on the thread count: %d of %d "
                          "outputs differ between 1 and %d threads", diff, m * n, many_threads);
        }
    free(a), free(b), free(c1), free(c2);
}
END_TEST

// Thread-count invariance again in a child process running OpenBLAS's Haswell kernel set
// (OPENBLAS_CORETYPE=Haswell, read when the library loads), where OpenBLAS's own sgemm changes
// with the thread count: the deterministic GEMM never calls it, so the child's 1- and
// 2-thread results must equal each other and this process's, bit for bit.
enum { HSW_M = 256, HSW_N = 300, HSW_K = 512 };

static void haswell_inputs(float **a, float **b)
{
    *a = randn((size_t)HSW_M * HSW_K, 460, 1);
    *b = randn((size_t)HSW_N * HSW_K, 461, 1);
}

// The child: computes fprop and wgrad on 1 and 2 threads, checks them equal, writes them to
// fd and returns the exit status (0 when equal).
static int haswell_child(int fd)
{
    char err[256];
    lb_backend *b1 = lb_backend_cpu_create(1, err, sizeof err);
    lb_backend *b2 = lb_backend_cpu_create(2, err, sizeof err);
    if (!b1 || !b2) return 2;
    float *a, *b;
    haswell_inputs(&a, &b);
    size_t mn = (size_t)HSW_M * HSW_N;
    float *c1 = lb_malloc(mn * 4), *c2 = lb_malloc(mn * 4);
    int bad = 0;
    for (int ta = 0; ta < 2; ta++) {
        lb_gemm(b1, ta, 1, HSW_M, HSW_N, HSW_K, 1.0f, a, b, 0.0f, c1);
        lb_gemm(b2, ta, 1, HSW_M, HSW_N, HSW_K, 1.0f, a, b, 0.0f, c2);
        bad |= memcmp(c1, c2, mn * 4) != 0;
        if (write(fd, c2, mn * 4) != (ssize_t)(mn * 4)) bad = 1;
        // For the record: OpenBLAS's own result on the same kernel set.
        b1->deterministic = b2->deterministic = 0;
        lb_gemm(b1, ta, 1, HSW_M, HSW_N, HSW_K, 1.0f, a, b, 0.0f, c1);
        lb_gemm(b2, ta, 1, HSW_M, HSW_N, HSW_K, 1.0f, a, b, 0.0f, c2);
        int diff = 0;
        for (size_t i = 0; i < mn; i++) diff += memcmp(&c1[i], &c2[i], 4) != 0;
        if (verbose())
            printf("  OpenBLAS core %s, transa %d: OpenBLAS sgemm 1 vs 2 threads: %d of %zu "
                   "outputs differ\n", openblas_get_corename(), ta, diff, mn);
        b1->deterministic = b2->deterministic = 1;
    }
    fflush(stdout);
    free(a), free(b), free(c1), free(c2);
    b1->destroy(b1), b2->destroy(b2);
    return bad;
}

START_TEST(test_determinism_gemm_haswell)
{
    float *a, *b;
    haswell_inputs(&a, &b);
    size_t mn = (size_t)HSW_M * HSW_N;
    float *mine = lb_malloc(2 * mn * 4), *theirs = lb_malloc(2 * mn * 4);
    for (int ta = 0; ta < 2; ta++)
        lb_gemm(be_many, ta, 1, HSW_M, HSW_N, HSW_K, 1.0f, a, b, 0.0f, mine + ta * mn);

    int fds[2];
    ck_assert_int_eq(pipe(fds), 0);
    // The child's environment is built before fork: between fork and exec a child of a
    // threaded process may only make async-signal-safe calls.
    extern char **environ;
    size_t ne = 0;
    while (environ[ne]) ne++;
    char **env = lb_calloc(ne + 3, sizeof *env), fdvar[64];
    size_t ke = 0;
    for (size_t i = 0; i < ne; i++)
        if (strncmp(environ[i], "OPENBLAS_CORETYPE=", 18) != 0) env[ke++] = environ[i];
    snprintf(fdvar, sizeof fdvar, "LB_TEST_HASWELL_CHILD_FD=%d", fds[1]);
    env[ke++] = "OPENBLAS_CORETYPE=Haswell";
    env[ke++] = fdvar;
    char *args[] = {self_exe, NULL};
    fflush(stdout);
    pid_t pid = fork();
    ck_assert_msg(pid >= 0, "fork failed");
    if (pid == 0) {
        close(fds[0]);
        execve("/proc/self/exe", args, env);
        execve(self_exe, args, env);
        _exit(127);
    }
    free(env);
    close(fds[1]);
    size_t got = 0;
    while (got < 2 * mn * 4) {
        ssize_t r = read(fds[0], (char *)theirs + got, 2 * mn * 4 - got);
        if (r <= 0) break;
        got += (size_t)r;
    }
    close(fds[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0,
                  "Haswell child: status %d (1: deterministic gemm differs between 1 and 2 "
                  "threads under OPENBLAS_CORETYPE=Haswell)", status);
    ck_assert_msg(got == 2 * mn * 4, "Haswell child sent %zu of %zu bytes", got, 2 * mn * 4);
    ASSERT_BITWISE("deterministic gemm, Haswell kernel set vs this process", mine, theirs,
                   2 * mn * 4);
    free(a), free(b), free(mine), free(theirs);
}
END_TEST

// --- batch invariance: one row alone against the same row among many -----------------------------

// The linear fprop Y = X W^T with m = 1 against m = 33 holding the same row, for several
// shapes, on one thread and on several. Every shape is run and every difference printed before
// the verdict, so a failure reports the whole pattern.
START_TEST(test_batch_invariance_gemm)
{
    const int m = 33, row = 17;
    const int shapes[][2] = {{53, 29}, {256, 384}, {1024, 96}, {2048, 512}};   // (k, n)
    lb_backend *bes[2] = {be_one, be_many};
    int total = 0;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (int r = 0; r < 2; r++) {
            int k = shapes[si][0], n = shapes[si][1];
            float *x = randn((size_t)m * k, 410 + si, 1), *w = randn((size_t)n * k, 420 + si, 1);
            float *ym = lb_malloc((size_t)m * n * 4), *y1 = lb_malloc((size_t)n * 4);
            lb_gemm(bes[r], 0, 1, m, n, k, 1.0f, x, w, 0.0f, ym);
            lb_gemm(bes[r], 0, 1, 1, n, k, 1.0f, x + (size_t)row * k, w, 0.0f, y1);
            int diff = 0;
            double maxd = 0.0, maxy = 0.0;
            for (int j = 0; j < n; j++) {
                float a = ym[(size_t)row * n + j];
                if (memcmp(&a, &y1[j], 4)) diff++;
                maxd = fmax(maxd, fabs((double)a - y1[j]));
                maxy = fmax(maxy, fabs((double)a));
            }
            if (verbose() || diff)
                printf("  gemm fprop m 1 vs m %d (row %d), k %d n %d, %d thread(s): %d of %d "
                       "outputs differ, max |diff| %.3g (max |y| %.3g)\n", m, row, k, n,
                       r ? many_threads : 1, diff, n, maxd, maxy);
            total += diff;
            free(x), free(w), free(ym), free(y1);
        }
    ck_assert_msg(total == 0, "deterministic gemm is not batch invariant: a row computed "
                  "alone differs from the same row among %d in %d outputs (listed above)", m,
                  total);
}
END_TEST

// (k, cols) = columns [c0, c0 + cols) of x (k, ld): a slice of a transposed operand, which is
// what a caller holding fewer rows (transa) or columns (transb == 0) would pass.
static float *col_slice(const float *x, int k, int ld, int c0, int cols)
{
    float *y = lb_malloc((size_t)k * cols * sizeof(float));
    for (int l = 0; l < k; l++)
        memcpy(y + (size_t)l * cols, x + (size_t)l * ld + c0, (size_t)cols * sizeof(float));
    return y;
}

// Every trans case: rows [i0, i0 + r) of C computed alone (m = r: a single row, a window that
// starts mid-tile) against the same rows in an m = 33 call, and columns [j0, j0 + w) alone
// (n = 1 and n = 3: the wgrad and dgrad tiles run along n) against n = 300, on 1 thread and on
// several (the big call is split over threads), with alpha and beta as the wgrad uses them.
START_TEST(test_batch_invariance_gemm_trans)
{
    const int m = 33, n = 300, k = 129;
    const int rows[][2] = {{17, 1}, {3, 5}, {30, 3}}, cols[][2] = {{22, 1}, {5, 3}, {297, 3}};
    lb_backend *bes[2] = {be_one, be_many};
    int total = 0;
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++)
            for (int r = 0; r < 2; r++) {
                lb_backend *bk = bes[r];
                float *a = randn((size_t)m * k, 470 + ta, 1);
                float *b = randn((size_t)n * k, 472 + tb, 1);
                float *c0 = randn((size_t)m * n, 474, 1), *c = fdup(c0, (size_t)m * n);
                lb_gemm(bk, ta, tb, m, n, k, 0.5f, a, b, 1.0f, c);
                for (size_t x = 0; x < sizeof rows / sizeof rows[0]; x++) {
                    int i0 = rows[x][0], nr = rows[x][1];
                    float *as = ta ? col_slice(a, k, m, i0, nr) : fdup(a + (size_t)i0 * k,
                                                                        (size_t)nr * k);
                    float *cs = fdup(c0 + (size_t)i0 * n, (size_t)nr * n);
                    lb_gemm(bk, ta, tb, nr, n, k, 0.5f, as, b, 1.0f, cs);
                    int diff = 0;
                    for (size_t e = 0; e < (size_t)nr * n; e++)
                        diff += memcmp(&cs[e], &c[(size_t)i0 * n + e], 4) != 0;
                    if (verbose() || diff)
                        printf("  gemm ta %d tb %d rows [%d, %d) alone vs among %d, %s: %d of "
                               "%d differ\n", ta, tb, i0, i0 + nr, m, r ? "many" : "1 thread",
                               diff, nr * n);
                    total += diff;
                    free(as), free(cs);
                }
                for (size_t x = 0; x < sizeof cols / sizeof cols[0]; x++) {
                    int j0 = cols[x][0], nc = cols[x][1];
                    float *bs = tb ? fdup(b + (size_t)j0 * k, (size_t)nc * k)
                                   : col_slice(b, k, n, j0, nc);
                    float *cs = col_slice(c0, m, n, j0, nc);
                    lb_gemm(bk, ta, tb, m, nc, k, 0.5f, a, bs, 1.0f, cs);
                    int diff = 0;
                    for (int i = 0; i < m; i++)
                        for (int q = 0; q < nc; q++)
                            diff += memcmp(&cs[(size_t)i * nc + q], &c[(size_t)i * n + j0 + q],
                                           4) != 0;
                    if (verbose() || diff)
                        printf("  gemm ta %d tb %d cols [%d, %d) alone vs among %d, %s: %d of "
                               "%d differ\n", ta, tb, j0, j0 + nc, n, r ? "many" : "1 thread",
                               diff, m * nc);
                    total += diff;
                    free(bs), free(cs);
                }
                free(a), free(b), free(c0), free(c);
            }
    ck_assert_msg(total == 0, "deterministic gemm is not batch invariant in %d outputs (listed "
                  "above)", total);
}
END_TEST

START_TEST(test_batch_invariance_rmsnorm)
{
    const int m = 33, row = 5;
    float *x = randn((size_t)m * C, 430, 1), *w = randn(C, 431, 1);
    float *om = lb_malloc((size_t)m * C * 4), *rm = lb_malloc(m * 4);
    float *o1 = lb_malloc(C * 4), r1;
    be->rmsnorm_fwd(be, &(lb_rmsnorm_args){.out = om, .rstd = rm, .x = x, .w = w, .n = m, .c = C,
            .eps = 1e-6f});
    be->rmsnorm_fwd(be, &(lb_rmsnorm_args){.out = o1, .rstd = &r1, .x = x + (size_t)row * C,
            .w = w, .n = 1, .c = C, .eps = 1e-6f});
    ASSERT_BITWISE("rmsnorm row alone vs among 33", om + (size_t)row * C, o1, C * 4);
    ASSERT_BITWISE("rmsnorm rstd alone vs among 33", rm + row, &r1, 4);
    free(x), free(w), free(om), free(rm), free(o1);
}
END_TEST

// Attention of one sequence alone (batch 1) against the same sequence in the middle of a
// batch of 3.
START_TEST(test_batch_invariance_attention)
{
    const int b = 3, mid = 1;
    size_t sq = (size_t)T * HQ * D, sk = (size_t)T * HKV * D, sl = (size_t)HQ * T;
    float *q = randn(b * sq, 440, 1), *k = randn(b * sk, 441, 1), *v = randn(b * sk, 442, 1);
    float *ob = lb_malloc(b * sq * 4), *lb = lb_malloc(b * sl * 4);
    float *o1 = lb_malloc(sq * 4), *l1 = lb_malloc(sl * 4);
    be->attention_fwd(be, &(lb_attention_args){.out = ob, .lse = lb, .q = q, .k = k, .v = v,
            .b = b, .t = T, .hq = HQ, .hkv = HKV, .d = D, .bf16 = 0});
    be->attention_fwd(be, &(lb_attention_args){.out = o1, .lse = l1, .q = q + mid * sq,
            .k = k + mid * sk, .v = v + mid * sk, .b = 1, .t = T, .hq = HQ, .hkv = HKV, .d = D,
            .bf16 = 0});
    ASSERT_BITWISE("attention out, batch 1 vs 3", ob + mid * sq, o1, sq * 4);
    ASSERT_BITWISE("attention lse, batch 1 vs 3", lb + mid * sl, l1, sl * 4);
    free(q), free(k), free(v), free(ob), free(lb), free(o1), free(l1);
}
END_TEST

// The same in bf16 mode, forward and backward, over three chunks of keys (t 130), and a
// prefix: the first 70 positions as a sequence of their own give the same rows (the chunks are
// aligned at position 0, not at the end of the call's sequence).
START_TEST(test_batch_invariance_attention_bf16)
{
    const int b = 3, mid = 1, t = 130, hq = 8, hkv = 2, d = 48, tp = 70;
    size_t sq = (size_t)t * hq * d, sk = (size_t)t * hkv * d, sl = (size_t)hq * t;
    float *q = randn(b * sq, 445, 1), *k = randn(b * sk, 446, 1), *v = randn(b * sk, 447, 1);
    float *g = randn(b * sq, 448, 1);
    float *ob = lb_malloc(b * sq * 4), *lb = lb_malloc(b * sl * 4);
    float *o1 = lb_malloc(sq * 4), *l1 = lb_malloc(sl * 4);
    float *dqb = lb_malloc(b * sq * 4), *dkb = lb_malloc(b * sk * 4), *dvb = lb_malloc(b * sk * 4);
    float *dq1 = lb_malloc(sq * 4), *dk1 = lb_malloc(sk * 4), *dv1 = lb_malloc(sk * 4);
    be->attention_fwd(be, &(lb_attention_args){.out = ob, .lse = lb, .q = q, .k = k, .v = v,
            .b = b, .t = t, .hq = hq, .hkv = hkv, .d = d, .bf16 = 1});
    be->attention_fwd(be, &(lb_attention_args){.out = o1, .lse = l1, .q = q + mid * sq,
            .k = k + mid * sk, .v = v + mid * sk, .b = 1, .t = t, .hq = hq, .hkv = hkv, .d = d,
            .bf16 = 1});
    ASSERT_BITWISE("attention bf16 out, batch 1 vs 3", ob + mid * sq, o1, sq * 4);
    ASSERT_BITWISE("attention bf16 lse, batch 1 vs 3", lb + mid * sl, l1, sl * 4);
    be->attention_bwd(be, &(lb_attention_args){.dq = dqb, .dk = dkb, .dv = dvb, .dout = g, .q = q,
            .k = k, .v = v, .out = ob, .lse = lb, .b = b, .t = t, .hq = hq, .hkv = hkv, .d = d,
            .bf16 = 1});
    be->attention_bwd(be, &(lb_attention_args){.dq = dq1, .dk = dk1, .dv = dv1,
            .dout = g + mid * sq, .q = q + mid * sq, .k = k + mid * sk, .v = v + mid * sk,
            .out = o1, .lse = l1, .b = 1, .t = t, .hq = hq, .hkv = hkv, .d = d, .bf16 = 1});
    ASSERT_BITWISE("attention bf16 dq, batch 1 vs 3", dqb + mid * sq, dq1, sq * 4);
    ASSERT_BITWISE("attention bf16 dk, batch 1 vs 3", dkb + mid * sk, dk1, sk * 4);
    ASSERT_BITWISE("attention bf16 dv, batch 1 vs 3", dvb + mid * sk, dv1, sk * 4);
    // (b, t, heads, d) rows are contiguous per position: the prefix is the first tp positions.
    float *op = lb_malloc((size_t)tp * hq * d * 4), *lp = lb_malloc((size_t)hq * tp * 4);
    be->attention_fwd(be, &(lb_attention_args){.out = op, .lse = lp, .q = q + mid * sq,
            .k = k + mid * sk, .v = v + mid * sk, .b = 1, .t = tp, .hq = hq, .hkv = hkv, .d = d,
            .bf16 = 1});
    ASSERT_BITWISE("attention bf16 out, t 70 vs first 70 of t 130", op, o1,
                   (size_t)tp * hq * d * 4);
    for (int h = 0; h < hq; h++)
        ASSERT_BITWISE("attention bf16 lse, t 70 vs first 70 of t 130", lp + (size_t)h * tp,
                       l1 + (size_t)h * t, (size_t)tp * 4);
    free(q), free(k), free(v), free(g), free(ob), free(lb), free(o1), free(l1);
    free(dqb), free(dkb), free(dvb), free(dq1), free(dk1), free(dv1), free(op), free(lp);
}
END_TEST

int main(int argc, char **argv)
{
    char err[256];
    self_exe = argv[0];
    const char *child_fd = getenv("LB_TEST_HASWELL_CHILD_FD");
    if (child_fd) return haswell_child(atoi(child_fd));   // test_determinism_gemm_haswell's child

    many_threads = omp_get_num_procs() > 2 ? omp_get_num_procs() : 2;
    be = lb_backend_cpu_create(0, err, sizeof err);
    be_one = lb_backend_cpu_create(1, err, sizeof err);
    be_many = lb_backend_cpu_create(many_threads, err, sizeof err);
    be_blas = lb_backend_cpu_create(0, err, sizeof err);
    if (be_blas) be_blas->deterministic = 0;
    if (!be || !be_one || !be_many || !be_blas) {
        fprintf(stderr, "cpu backend: %s\n", err);
        return EXIT_FAILURE;
    }

    Suite *s = suite_create("kernels");
    TCase *tc = tcase_create("forward");
    tcase_add_test(tc, test_source_path);
    tcase_add_test(tc, test_table_and_memory);
    tcase_add_test(tc, test_gemm_fwd);
    tcase_add_test(tc, test_gemm_accumulate_and_edges);
    tcase_add_test(tc, test_gemm_grouped);
    tcase_add_test(tc, test_gemm_c16);
    tcase_add_test(tc, test_to_bf16_gemm_b16);
    tcase_add_test(tc, test_quantize_from_bf16);
    tcase_add_test(tc, test_gemm_det_canonical);
    tcase_add_test(tc, test_gemm_openblas_path);
    tcase_add_test(tc, test_elementwise_and_sumsq);
    tcase_add_test(tc, test_embedding);
    tcase_add_test(tc, test_rmsnorm_fwd);
    tcase_add_test(tc, test_rope_fwd);
    tcase_add_test(tc, test_rope_llama3_partial);
    tcase_add_test(tc, test_router_bias_update);
    tcase_add_test(tc, test_attention_fwd);
    tcase_add_test(tc, test_attention_bf16_exact);
    tcase_add_test(tc, test_attention_bf16_vs_fp32);
    tcase_add_test(tc, test_swiglu_fwd);
    tcase_add_test(tc, test_router_topk_fwd);
    tcase_add_test(tc, test_moe_aux_loss);
    tcase_add_test(tc, test_moe_dispatch_fwd);
    tcase_add_test(tc, test_cross_entropy);
    tcase_add_test(tc, test_adamw);
    tcase_add_test(tc, test_adamw16);
    suite_add_tcase(s, tc);

    tc = tcase_create("gradients");
    tcase_add_test(tc, test_grad_embedding);
    tcase_add_test(tc, test_grad_rmsnorm);
    tcase_add_test(tc, test_grad_rope);
    tcase_add_test(tc, test_grad_attention);
    tcase_add_test(tc, test_grad_swiglu);
    tcase_add_test(tc, test_grad_router);
    tcase_add_test(tc, test_grad_moe_permute);
    tcase_add_test(tc, test_grad_moe_combine);
    tcase_add_test(tc, test_grad_cross_entropy);
    tcase_add_test(tc, test_grad_gemm_linear);
    suite_add_tcase(s, tc);

    tc = tcase_create("invariance");
    tcase_add_test(tc, test_determinism_threads);
    tcase_add_test(tc, test_determinism_gemm_threads);
    tcase_add_test(tc, test_determinism_gemm_haswell);
    tcase_add_test(tc, test_batch_invariance_gemm);
    tcase_add_test(tc, test_batch_invariance_gemm_trans);
    tcase_add_test(tc, test_batch_invariance_rmsnorm);
    tcase_add_test(tc, test_batch_invariance_attention);
    tcase_add_test(tc, test_batch_invariance_attention_bf16);
    suite_add_tcase(s, tc);

    int rc = lb_test_run(s);
    be->destroy(be);
    be_one->destroy(be_one);
    be_many->destroy(be_many);
    be_blas->destroy(be_blas);
    return rc;
}
