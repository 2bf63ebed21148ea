// test_quant.c: the kernels/quant codecs against golden data from an independent
// implementation (tests/tools/make_quant_golden.py: ml_dtypes + numpy), bit for bit: every
// element type in both overflow modes, every code's decoding, stochastic rounding draws, every
// quantizer in both directions with both MX scale rules, NVFP4's three second levels and 16x16
// blocks, dequantized values, and the Hadamard transform. Then properties the golden files
// cannot show: round-trip error bounds, idempotence, partial blocks as zero padding, square
// blocks commuting with the transpose, stochastic rounding unbiased and deterministic, and the
// Hadamard transform orthogonal and invisible to a GEMM.
#include <math.h>
#include <omp.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/common.h"
#include "kernels/quant/quant.h"
#include "src/io/safetensors.h"
#include "tests/testutil.h"

// Check records every assertion it evaluates (a write per call); these only reach Check when
// they fail, so loops over thousands of elements stay fast.
#define CHECK(c) do { if (!(c)) ck_assert(c); } while (0)
#define CHECKM(c, ...) do { if (!(c)) ck_assert_msg(c, __VA_ARGS__); } while (0)

// --- golden file access -------------------------------------------------------------------------

typedef struct {
    lb_st_file f;
    uint64_t sr_seed, sr_step, sr_tensor;
} golden;

static void golden_open(golden *g, const char *name)
{
    char rel[256], err[512];
    snprintf(rel, sizeof rel, "tests/data/quant/%s.safetensors", name);
    if (lb_st_open(&g->f, lb_test_src(rel), err, sizeof err)) ck_abort_msg("%s", err);
    const char *s;
    g->sr_seed = (s = lb_st_meta(&g->f, "sr_seed")) ? strtoull(s, NULL, 10) : 0;
    g->sr_step = (s = lb_st_meta(&g->f, "sr_step")) ? strtoull(s, NULL, 10) : 0;
    g->sr_tensor = (s = lb_st_meta(&g->f, "sr_tensor")) ? strtoull(s, NULL, 10) : 0;
}

static int has(golden *g, const char *name) { return lb_st_find(&g->f, name) != NULL; }

// The raw bytes of tensor name (dtype checked); *n = element count. Caller frees.
static void *raw(golden *g, const char *name, const char *dtype, size_t *n)
{
    const lb_st_tensor *t = lb_st_find(&g->f, name);
    CHECKM(t, "golden tensor '%s' missing", name);
    CHECKM(strcmp(t->dtype, dtype) == 0, "%s: dtype %s, want %s", name, t->dtype, dtype);
    size_t bytes = t->end - t->begin;
    void *p = lb_malloc(bytes);
    FILE *fp = g->f.fp;
    CHECK(fseek(fp, (long)(g->f.data_offset + t->begin), SEEK_SET) == 0);
    CHECK(fread(p, 1, bytes, fp) == bytes);
    if (n) *n = (size_t)lb_st_numel(t);
    return p;
}

static float *f32s(golden *g, const char *name, size_t *n) { return raw(g, name, "F32", n); }
static uint8_t *u8s(golden *g, const char *name, size_t *n) { return raw(g, name, "U8", n); }

static uint32_t bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

// Equal bits, or both NaN (NaN payloads are not part of any rule).
static int same(float a, float b) { return bits(a) == bits(b) || (a != a && b != b); }

static const lb_elem ELEMS[] = {LB_E4M3, LB_E5M2, LB_E2M1, LB_E8M0, LB_UE4M3};

// --- element codecs ---------------------------------------------------------------------------

START_TEST(test_encode_golden)
{
    golden g;
    golden_open(&g, "elements");
    for (int k = 0; k < 5; k++) {
        lb_elem t = ELEMS[k];
        char name[64];
        size_t n, ns, nn;
        snprintf(name, sizeof name, "%s.x", lb_elem_name(t));
        float *x = f32s(&g, name, &n);
        snprintf(name, sizeof name, "%s.sat", lb_elem_name(t));
        uint8_t *sat = u8s(&g, name, &ns);
        snprintf(name, sizeof name, "%s.nosat", lb_elem_name(t));
        uint8_t *nosat = u8s(&g, name, &nn);
        CHECK(ns == n && nn == n && n > 100);
        int bad = 0;
        for (size_t i = 0; i < n; i++) {
            uint8_t a = lb_encode(t, x[i], 1), b = lb_encode(t, x[i], 0);
            if (a != sat[i] || b != nosat[i]) {
                if (bad++ < 10)
                    fprintf(stderr, "%s: x=%a (%g): sat %#x want %#x, nosat %#x want %#x\n",
                            lb_elem_name(t), (double)x[i], (double)x[i], a, sat[i], b, nosat[i]);
            }
        }
        CHECKM(bad == 0, "%s: %d of %zu encodings differ from ml_dtypes", lb_elem_name(t),
               bad, n);
        free(x);
        free(sat);
        free(nosat);
    }
    lb_st_close(&g.f);
}
END_TEST

START_TEST(test_decode_golden)
{
    golden g;
    golden_open(&g, "elements");
    for (int k = 0; k < 5; k++) {
        lb_elem t = ELEMS[k];
        char name[64];
        size_t n;
        snprintf(name, sizeof name, "%s.decode", lb_elem_name(t));
        float *want = f32s(&g, name, &n);
        ck_assert_int_eq((int)n, t == LB_E2M1 ? 16 : 256);
        for (size_t c = 0; c < n; c++) {
            float got = lb_decode(t, (uint8_t)c);
            CHECKM(same(got, want[c]), "%s code %#zx: %a, want %a", lb_elem_name(t), c,
                   (double)got, (double)want[c]);
        }
        free(want);
    }
    lb_st_close(&g.f);
}
END_TEST

// Every finite code survives decode then encode (both modes), so the two are inverse.
START_TEST(test_encode_decode_inverse)
{
    for (int k = 0; k < 5; k++) {
        lb_elem t = ELEMS[k];
        int ncodes = t == LB_E2M1 ? 16 : 256;
        for (int c = 0; c < ncodes; c++) {
            float v = lb_decode(t, (uint8_t)c);
            if (!isfinite(v)) continue;
            CHECKM(lb_encode(t, v, 1) == c && lb_encode(t, v, 0) == c,
                   "%s code %#x -> %g -> %#x", lb_elem_name(t), c, (double)v,
                   lb_encode(t, v, 1));
            ck_assert_int_eq(lb_encode_sr(t, v, ~0ull), c);     // on the grid: never moves
        }
        CHECK(lb_decode(t, lb_encode(t, lb_elem_max(t), 1)) == lb_elem_max(t));
    }
}
END_TEST

START_TEST(test_sr_golden)
{
    golden g;
    golden_open(&g, "elements");
    uint64_t stream = lb_quant_stream(g.sr_step, g.sr_tensor);
    CHECK(g.sr_seed && g.sr_step && g.sr_tensor);
    const lb_elem ts[] = {LB_E4M3, LB_E5M2, LB_E2M1};
    for (int k = 0; k < 3; k++) {
        char name[64];
        size_t n, nc;
        snprintf(name, sizeof name, "sr.%s.x", lb_elem_name(ts[k]));
        float *x = f32s(&g, name, &n);
        snprintf(name, sizeof name, "sr.%s.codes", lb_elem_name(ts[k]));
        uint8_t *want = u8s(&g, name, &nc);
        CHECK(n == nc && n > 100);
        int ups = 0, downs = 0;
        for (size_t i = 0; i < n; i++) {
            uint8_t c = lb_encode_sr(ts[k], x[i], lb_rand_u64(g.sr_seed, stream, i));
            CHECKM(c == want[i], "sr %s x=%a counter %zu: %#x want %#x",
                   lb_elem_name(ts[k]), (double)x[i], i, c, want[i]);
            uint8_t rne = lb_encode(ts[k], x[i], 1);
            if (c != rne) ups++;
            else downs++;
        }
        CHECK(ups > 10 && downs > 10);   // the draws really decide something
        free(x);
        free(want);
    }
    lb_st_close(&g.f);
}
END_TEST

// Mean of many draws equals x, and only the two neighbours ever appear.
START_TEST(test_sr_unbiased)
{
    const struct { lb_elem t; float x; } cs[] = {
        {LB_E4M3, 0.3f}, {LB_E4M3, -17.3f}, {LB_E4M3, 0.0031f}, {LB_E4M3, 1e-4f},
        {LB_E4M3, 440.0f}, {LB_E5M2, 0.3f}, {LB_E5M2, 3e-6f}, {LB_E5M2, -50000.0f},
        {LB_E2M1, 0.3f}, {LB_E2M1, 2.6f}, {LB_E2M1, -5.5f}, {LB_E2M1, 0.01f},
    };
    const int N = 200000;
    uint64_t stream = lb_quant_stream(3, 11);
    for (size_t k = 0; k < sizeof cs / sizeof cs[0]; k++) {
        float v[2] = {NAN, NAN};
        int cnt[2] = {0, 0};
        for (int i = 0; i < N; i++) {
            float d = lb_decode(cs[k].t, lb_encode_sr(cs[k].t, cs[k].x, lb_rand_u64(5, stream, i)));
            int j = v[0] != v[0] || v[0] == d ? 0 : 1;
            if (v[j] != v[j]) v[j] = d;
            CHECKM(v[j] == d, "%s %g: a third value %g", lb_elem_name(cs[k].t),
                   (double)cs[k].x, (double)d);
            cnt[j]++;
        }
        CHECKM(cnt[0] && cnt[1], "%s %g: only one neighbour drawn", lb_elem_name(cs[k].t),
               (double)cs[k].x);
        double lo = fmin(v[0], v[1]), hi = fmax(v[0], v[1]);
        CHECK(lo <= cs[k].x && cs[k].x <= hi);
        double p = ((double)cs[k].x - lo) / (hi - lo);
        double phat = (double)cnt[v[0] == hi ? 0 : 1] / N;
        double sigma = sqrt(p * (1 - p) / N);
        CHECKM(fabs(phat - p) < 5 * sigma, "%s %g: P(up) %g, want %g (sigma %g)",
               lb_elem_name(cs[k].t), (double)cs[k].x, phat, p, sigma);
    }
}
END_TEST

// --- block quantizers ---------------------------------------------------------------------------

typedef struct {
    const char *name;
    lb_format fmt;
    int weight;
    lb_elem elem;
    lb_scale_rule rule;
    lb_scale2_mode s2;
    int sr;
} qcase;

static const qcase CASES[] = {
    {"fp8", LB_FMT_FP8_BLOCK, 0, LB_E4M3, 0, 0, 0},
    {"fp8w", LB_FMT_FP8_BLOCK, 1, LB_E4M3, 0, 0, 0},
    {"mxfp8", LB_FMT_MXFP8, 0, LB_E4M3, LB_SCALE_CEIL, 0, 0},
    {"mxfp8f", LB_FMT_MXFP8, 0, LB_E4M3, LB_SCALE_FLOOR, 0, 0},
    {"mxfp8e5", LB_FMT_MXFP8, 0, LB_E5M2, LB_SCALE_CEIL, 0, 0},
    {"mxfp8e5f", LB_FMT_MXFP8, 0, LB_E5M2, LB_SCALE_FLOOR, 0, 0},
    {"mxfp4", LB_FMT_MXFP4, 0, LB_E4M3, LB_SCALE_CEIL, 0, 0},
    {"mxfp4f", LB_FMT_MXFP4, 0, LB_E4M3, LB_SCALE_FLOOR, 0, 0},
    {"nvfp4", LB_FMT_NVFP4, 0, LB_E4M3, 0, LB_S2_TENSOR, 0},
    {"nvfp4r", LB_FMT_NVFP4, 0, LB_E4M3, 0, LB_S2_ROW, 0},
    {"nvfp4g", LB_FMT_NVFP4, 0, LB_E4M3, 0, LB_S2_GIVEN, 0},
    {"nvfp4w", LB_FMT_NVFP4, 1, LB_E4M3, 0, LB_S2_TENSOR, 0},
    {"nvfp4wg", LB_FMT_NVFP4, 1, LB_E4M3, 0, LB_S2_GIVEN, 0},
    {"fp8_sr", LB_FMT_FP8_BLOCK, 0, LB_E4M3, 0, 0, 1},
    {"mxfp4_sr", LB_FMT_MXFP4, 0, LB_E4M3, LB_SCALE_CEIL, 0, 1},
    {"nvfp4_sr", LB_FMT_NVFP4, 0, LB_E4M3, 0, LB_S2_TENSOR, 1},
};
#define NCASES ((int)(sizeof CASES / sizeof CASES[0]))

static lb_quant_args case_args(const qcase *c, int colwise, float s2, uint64_t seed,
                               uint64_t step, uint64_t tensor)
{
    lb_quant_args a = {0};
    a.fmt = c->fmt;
    a.colwise = colwise;
    a.weight_blocks = c->weight;
    a.elem = c->elem;
    a.rule = c->rule;
    a.s2_mode = c->s2;
    a.s2 = s2;
    a.sr = c->sr;
    a.seed = seed;
    a.step = step;
    a.tensor = tensor;
    return a;
}

// Compares one quantized matrix with the golden tensors under prefix; returns mismatches.
static int check_qmat(golden *g, const char *prefix, const lb_qmat *q)
{
    char name[128];
    int bad = 0;
    size_t n;
    snprintf(name, sizeof name, "%s.data", prefix);
    uint8_t *data = u8s(g, name, &n);
    CHECKM(n == lb_qmat_data_bytes(q), "%s: %zu bytes, layout says %zu", name, n,
           lb_qmat_data_bytes(q));
    for (size_t i = 0; i < n; i++)
        if (data[i] != q->data[i] && bad++ < 5)
            fprintf(stderr, "%s: byte %zu (row %zu): %#x want %#x\n", name, i, i / q->ld,
                    q->data[i], data[i]);
    free(data);

    snprintf(name, sizeof name, "%s.scale", prefix);
    size_t ns = (size_t)q->srows * q->scols;
    if (q->fmt == LB_FMT_FP8_BLOCK) {
        float *s = f32s(g, name, &n);
        CHECKM(n == ns, "%s: %zu scales, layout says %zu", name, n, ns);
        for (size_t i = 0; i < n; i++)
            if (!same(s[i], ((float *)q->scale)[i]) && bad++ < 5)
                fprintf(stderr, "%s[%zu]: %a want %a\n", name, i, (double)((float *)q->scale)[i],
                        (double)s[i]);
        free(s);
    } else {
        uint8_t *s = u8s(g, name, &n);
        CHECKM(n == ns, "%s: %zu scales, layout says %zu", name, n, ns);
        for (size_t i = 0; i < n; i++)
            if (s[i] != ((uint8_t *)q->scale)[i] && bad++ < 5)
                fprintf(stderr, "%s[%zu]: %#x want %#x\n", name, i, ((uint8_t *)q->scale)[i], s[i]);
        free(s);
    }

    snprintf(name, sizeof name, "%s.scale2", prefix);
    if (q->fmt == LB_FMT_NVFP4) {
        float *s = f32s(g, name, &n);
        CHECKM((int)n == q->nscale2, "%s: %zu, layout says %d", name, n, q->nscale2);
        for (size_t i = 0; i < n; i++)
            if (!same(s[i], q->scale2[i]) && bad++ < 5)
                fprintf(stderr, "%s[%zu]: %a want %a\n", name, i, (double)q->scale2[i],
                        (double)s[i]);
        free(s);
    } else {
        CHECKM(!has(g, name), "%s: a second level for a format without one", name);
    }

    snprintf(name, sizeof name, "%s.deq", prefix);
    if (has(g, name)) {
        float *want = f32s(g, name, &n);
        CHECK(n == (size_t)q->rows * q->cols);
        float *y = lb_malloc(n * sizeof(float));
        lb_dequantize(y, q);
        for (size_t i = 0; i < n; i++)
            if (!same(y[i], want[i]) && bad++ < 5)
                fprintf(stderr, "%s[%zu]: %a want %a\n", name, i, (double)y[i], (double)want[i]);
        free(y);
        free(want);
    }
    return bad;
}

START_TEST(test_blocks_golden)
{
    golden g;
    golden_open(&g, "blocks");
    const char *inputs[] = {"fin", "ext", "spec"};
    int checked = 0, deqs = 0;
    for (int ii = 0; ii < 3; ii++) {
        char name[128];
        snprintf(name, sizeof name, "%s.x", inputs[ii]);
        const lb_st_tensor *t = lb_st_find(&g.f, name);
        CHECKM(t && t->ndim == 2, "%s missing", name);
        int rows = (int)t->shape[0], cols = (int)t->shape[1];
        float *x = f32s(&g, name, NULL);
        snprintf(name, sizeof name, "%s.s2_given", inputs[ii]);
        float *s2 = f32s(&g, name, NULL);
        for (int c = 0; c < NCASES; c++)
            for (int dir = 0; dir < 2; dir++) {
                char prefix[96];
                snprintf(prefix, sizeof prefix, "%s.%s.%s", inputs[ii], CASES[c].name,
                         dir ? "col" : "row");
                lb_quant_args a = case_args(&CASES[c], dir, s2[0], g.sr_seed, g.sr_step,
                                            g.sr_tensor);
                lb_qmat q;
                lb_qmat_alloc(&q, rows, cols, &a);
                lb_quantize(&q, x, rows, cols, &a);
                int bad = check_qmat(&g, prefix, &q);
                CHECKM(bad == 0, "%s: %d mismatches against the golden file", prefix, bad);
                snprintf(name, sizeof name, "%s.deq", prefix);
                deqs += has(&g, name);
                lb_qmat_free(&q);
                checked++;
            }
        free(x);
        free(s2);
    }
    ck_assert_int_eq(checked, 3 * NCASES * 2);
    ck_assert_int_ge(deqs, 20);
    lb_st_close(&g.f);
}
END_TEST

static float *randmat(int rows, int cols, uint64_t seed)
{
    float *x = lb_malloc((size_t)rows * cols * sizeof(float));
    for (int r = 0; r < rows; r++) {
        float mag = expf(2.0f * lb_rand_normal(seed, 1, (uint64_t)r));   // rows of unlike size
        for (int c = 0; c < cols; c++)
            x[(size_t)r * cols + c] = mag * lb_rand_normal(seed, 0, (uint64_t)r * cols + c);
    }
    return x;
}

// The divisor d of element (r, c) in q: block scale (times s2 for NVFP4).
static double divisor(const lb_qmat *q, int r, int c)
{
    size_t si = (size_t)(r / q->brows) * q->scols + c / q->bcols;
    if (q->fmt == LB_FMT_FP8_BLOCK) return ((float *)q->scale)[si];
    double d = lb_decode(q->scale_elem, ((uint8_t *)q->scale)[si]);
    if (q->fmt == LB_FMT_NVFP4) d *= q->scale2[q->nscale2 > 1 ? r : 0];
    return d;
}

// |deq - x| within half a grid step of the element plus the fp32 roundings, for every element
// and case on random data with unlike magnitudes; signs and zeros survive.
START_TEST(test_roundtrip_bound)
{
    int rows = 45, cols = 150;
    float *x = randmat(rows, cols, 77);
    x[3] = 0.0f;
    x[4] = -0.0f;
    float *y = lb_malloc((size_t)rows * cols * sizeof(float));
    for (int c = 0; c < NCASES; c++) {
        if (CASES[c].sr) continue;
        for (int dir = 0; dir < 2; dir++) {
            lb_quant_args a = case_args(&CASES[c], dir, 0.0f, 0, 0, 0);
            if (a.s2_mode == LB_S2_GIVEN) a.s2 = lb_nvfp4_scale2(lb_amax(x, (size_t)rows * cols));
            lb_qmat q;
            lb_qmat_alloc(&q, rows, cols, &a);
            lb_quantize(&q, x, rows, cols, &a);
            lb_dequantize(y, &q);
            int mbits = q.elem == LB_E4M3 ? 3 : q.elem == LB_E5M2 ? 2 : 1;
            int emin = q.elem == LB_E4M3 ? -6 : q.elem == LB_E5M2 ? -14 : 0;
            int floor_rule = a.rule == LB_SCALE_FLOOR && q.fmt != LB_FMT_FP8_BLOCK &&
                             q.fmt != LB_FMT_NVFP4;
            for (int r = 0; r < q.rows; r++)
                for (int k = 0; k < q.cols; k++) {
                    double xv = dir ? x[(size_t)k * cols + r] : x[(size_t)r * cols + k];
                    double yv = y[(size_t)r * q.cols + k], d = divisor(&q, r, k);
                    double xs = fabs(xv) / d, emax = lb_elem_max(q.elem);
                    // Half an element step at |x|/d, scaled back, plus two fp32 roundings.
                    double step = ldexp(1.0, (xs < ldexp(1.0, emin) ? emin : ilogb(xs)) - mbits);
                    double bound = 0.5 * step * d * (1 + 1e-6) + 3e-7 * fabs(xv);
                    if (xs > emax) bound += (xs - emax) * d;   // clipped: floor rule, NVFP4
                    if (xs > emax * (1 + 1e-6))          // beyond the fp32 rounding of amax/d
                        CHECKM(floor_rule || q.fmt == LB_FMT_NVFP4,
                               "%s: element beyond the max outside a clipping rule",
                               CASES[c].name);
                    CHECKM(fabs(yv - xv) <= bound, "%s %s (%d,%d): x %g -> %g (bound %g)",
                           CASES[c].name, dir ? "col" : "row", r, k, xv, yv, bound);
                    CHECK(xv == 0 || yv == 0 || signbit(xv) == signbit(yv));
                }
            CHECK(y[dir ? 3 * rows : 3] == 0.0f);
            lb_qmat_free(&q);
        }
    }
    free(x);
    free(y);
}
END_TEST

// MX dequantized values are fixed points: quantizing them again gives the same values.
START_TEST(test_mx_idempotent)
{
    int rows = 19, cols = 96;
    float *x = randmat(rows, cols, 5);
    float *y = lb_malloc((size_t)rows * cols * sizeof(float));
    float *z = lb_malloc((size_t)rows * cols * sizeof(float));
    const char *mx[] = {"mxfp8", "mxfp8f", "mxfp8e5", "mxfp8e5f", "mxfp4", "mxfp4f"};
    for (int c = 0; c < NCASES; c++) {
        int is_mx = 0;
        for (int j = 0; j < 6; j++) is_mx |= strcmp(CASES[c].name, mx[j]) == 0;
        if (!is_mx) continue;
        lb_quant_args a = case_args(&CASES[c], 0, 0, 0, 0, 0);
        lb_qmat q;
        lb_qmat_alloc(&q, rows, cols, &a);
        lb_quantize(&q, x, rows, cols, &a);
        lb_dequantize(y, &q);
        lb_quantize(&q, y, rows, cols, &a);
        lb_dequantize(z, &q);
        for (int i = 0; i < rows * cols; i++)
            CHECKM(bits(y[i]) == bits(z[i]), "%s: %a -> %a", CASES[c].name, (double)y[i],
                   (double)z[i]);
        lb_qmat_free(&q);
    }
    free(x);
    free(y);
    free(z);
}
END_TEST

// A trailing partial block is the same as padding with zeros; column-wise equals row-wise on
// the explicit transpose; square blocks commute with the transpose.
START_TEST(test_partial_and_transpose)
{
    int rows = 21, cols = 70, pc = 256, pr = 128;   // padded to whole blocks of every size
    float *x = randmat(rows, cols, 9);
    float *xp = lb_calloc((size_t)pr * pc, sizeof(float));
    float *xt = lb_malloc((size_t)rows * cols * sizeof(float));
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            xp[(size_t)r * pc + c] = x[(size_t)r * cols + c];
            xt[(size_t)c * rows + r] = x[(size_t)r * cols + c];
        }
    for (int c = 0; c < NCASES; c++) {
        lb_quant_args a = case_args(&CASES[c], 0, 0.01f, 1, 2, 3);
        lb_qmat q, qp, qc, qt;
        lb_qmat_alloc(&q, rows, cols, &a);
        lb_qmat_alloc(&qp, pr, pc, &a);
        lb_quantize(&q, x, rows, cols, &a);
        lb_quantize(&qp, xp, pr, pc, &a);
        for (int r = 0; r < rows; r++) {
            for (int k = 0; k < cols; k++)
                if (!CASES[c].sr || r == 0)   // SR counters follow the row length
                    CHECKM(lb_qmat_code(&q, r, k) == lb_qmat_code(&qp, r, k),
                           "%s: padding changed (%d,%d)", CASES[c].name, r, k);
            if (r % q.brows) continue;
            size_t es = q.fmt == LB_FMT_FP8_BLOCK ? 4 : 1;
            for (int b = 0; b < q.scols; b++)
                CHECK(memcmp((char *)q.scale + ((size_t)(r / q.brows) * q.scols + b) * es,
                                 (char *)qp.scale + ((size_t)(r / q.brows) * qp.scols + b) * es,
                                 es) == 0);
        }
        if (q.elem == LB_E2M1 && cols % 2)              // the pad nibble is zero
            for (int r = 0; r < rows; r++) CHECK((q.data[r * q.ld + q.ld - 1] >> 4) == 0);
        // Column-wise from x == row-wise from x^T, bit for bit.
        lb_quant_args ac = a, at = a;
        ac.colwise = 1;
        lb_qmat_alloc(&qc, rows, cols, &ac);
        lb_qmat_alloc(&qt, cols, rows, &at);
        lb_quantize(&qc, x, rows, cols, &ac);
        lb_quantize(&qt, xt, cols, rows, &at);
        CHECK(memcmp(qc.data, qt.data, lb_qmat_data_bytes(&qc)) == 0);
        CHECK(memcmp(qc.scale, qt.scale, lb_qmat_scale_bytes(&qc)) == 0);
        // Square blocks (per-tensor second level): the column-wise copy is the transpose.
        if (CASES[c].weight && !CASES[c].sr) {
            for (int r = 0; r < rows; r++)
                for (int k = 0; k < cols; k++)
                    CHECK(lb_qmat_code(&q, r, k) == lb_qmat_code(&qc, k, r));
            size_t es = q.fmt == LB_FMT_FP8_BLOCK ? 4 : 1;
            for (int i = 0; i < q.srows; i++)
                for (int j = 0; j < q.scols; j++)
                    CHECK(memcmp((char *)q.scale + ((size_t)i * q.scols + j) * es,
                                     (char *)qc.scale + ((size_t)j * qc.scols + i) * es, es) == 0);
        }
        lb_qmat_free(&q);
        lb_qmat_free(&qp);
        lb_qmat_free(&qc);
        lb_qmat_free(&qt);
    }
    free(x);
    free(xp);
    free(xt);
}
END_TEST

// fp8-tensor: fp8-block's rules with one block of the whole matrix. Its codes are checked
// against the definition on the golden-tested element encoder: s = amax / 448 (1 for an
// all-zero tensor, NaN with zero codes for a non-finite one), code = E4M3(x / s) saturating,
// or stochastically rounded with the matrix's counters; the column-wise copy is the transpose
// with the same scale.
static void fp8_tensor_case(const char *what, const float *x, int rows, int cols, int sr,
                            float want_scale)
{
    lb_quant_args a;
    memset(&a, 0, sizeof a);
    a.fmt = LB_FMT_FP8_TENSOR;
    a.sr = sr, a.seed = 41, a.step = 3, a.tensor = 9;
    lb_qmat q, qc;
    lb_qmat_alloc(&q, rows, cols, &a);
    CHECK(q.brows == rows && q.bcols == cols && q.srows == 1 && q.scols == 1);
    CHECK(q.elem == LB_E4M3 && lb_qmat_scale_bytes(&q) == 4 && q.nscale2 == 0);
    lb_quantize(&q, x, rows, cols, &a);
    const float s = ((const float *)q.scale)[0];
    CHECKM(same(s, want_scale), "%s: scale %g, want %g", what, (double)s, (double)want_scale);
    const uint64_t stream = lb_quant_stream(a.step, a.tensor);
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            size_t i = (size_t)r * cols + c;
            uint8_t want = s != s ? 0
                         : sr ? lb_encode_sr(LB_E4M3, x[i] / s, lb_rand_u64(a.seed, stream, i))
                              : lb_encode(LB_E4M3, x[i] / s, 1);
            CHECKM(q.data[i] == want, "%s: (%d, %d) code %#x, want %#x", what, r, c, q.data[i],
                   want);
        }
    if (!sr) {   // column-wise: the transpose (SR counters follow the quantized layout)
        a.colwise = 1;
        lb_qmat_alloc(&qc, rows, cols, &a);
        lb_quantize(&qc, x, rows, cols, &a);
        CHECK(qc.rows == cols && qc.cols == rows && same(((const float *)qc.scale)[0], s));
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < cols; c++) CHECK(lb_qmat_code(&q, r, c) == lb_qmat_code(&qc, c, r));
        lb_qmat_free(&qc);
    }
    lb_qmat_free(&q);
}

START_TEST(test_fp8_tensor)
{
    // By hand: amax 896 gives s = 2 and every x / s below is an E4M3 value, so dequantizing
    // gives x back exactly.
    const float hand[6] = {896.0f, -1.0f, 0.5f, 3.0f, -0.015625f, 0.0f};
    fp8_tensor_case("by hand", hand, 2, 3, 0, 2.0f);
    lb_quant_args a;
    memset(&a, 0, sizeof a);
    a.fmt = LB_FMT_FP8_TENSOR;
    lb_qmat q;
    lb_qmat_alloc(&q, 2, 3, &a);
    lb_quantize(&q, hand, 2, 3, &a);
    float y[6];
    lb_dequantize(y, &q);
    for (int i = 0; i < 6; i++) CHECKM(y[i] == hand[i], "by hand: %d: %g", i, (double)y[i]);
    lb_qmat_free(&q);

    float *x = randmat(37, 300, 12);   // rows of unlike magnitude: small rows go subnormal
    const float amax = lb_amax(x, (size_t)37 * 300);
    fp8_tensor_case("random", x, 37, 300, 0, amax / 448.0f);
    fp8_tensor_case("random sr", x, 37, 300, 1, amax / 448.0f);
    float zero[4] = {0};
    fp8_tensor_case("all zero", zero, 2, 2, 0, 1.0f);
    x[5] = NAN;
    fp8_tensor_case("a NaN", x, 37, 300, 0, NAN);
    x[5] = -INFINITY;
    fp8_tensor_case("an Inf", x, 37, 300, 0, NAN);
    free(x);
}
END_TEST

// lb_die's abort hook in the checks that a call dies (the suite runs without fork).
static jmp_buf die_jmp;
static void die_jump(int code) { longjmp(die_jmp, code ? code : 1); }

// The power-of-two fp8 scale of a finite amax, by a route of its own: the smallest k with
// amax <= 448 * 2^k, both sides exact in double; 1 for 0 and for k < -149 (no fp32 2^k).
static float pow2_ref(float amax)
{
    if (amax == 0.0f) return 1.0f;
    int k = (int)ceil(log2((double)amax / 448.0));
    while (448.0 * ldexp(1.0, k - 1) >= (double)amax) k--;
    while (448.0 * ldexp(1.0, k) < (double)amax) k++;
    return k < -149 ? 1.0f : (float)ldexp(1.0, k);
}

// Every element of a finite block under a power-of-two scale s: x / s is exact and never
// beyond 448 (nothing clips), the code is E4M3(x / s) rounded to nearest, and the dequantized
// value is code * s exactly, within half an E4M3 step of x (the FP32 rule adds the rounding of
// amax / 448 and of the product).
static void pow2_elements(const char *what, const float *x, const float *y, const uint8_t *code,
                          size_t n, float s)
{
    for (size_t i = 0; i < n; i++) {
        const double xs = (double)x[i] / s;
        CHECKM(xs == (double)(x[i] / s) && fabs(xs) <= 448.0, "%s: [%zu] x / s = %g", what, i, xs);
        CHECKM(code[i] == lb_encode(LB_E4M3, x[i] / s, 0), "%s: [%zu] code %#x", what, i, code[i]);
        const double e = lb_decode(LB_E4M3, code[i]);
        CHECKM((double)y[i] == e * s, "%s: [%zu] %g is not code * scale", what, i, (double)y[i]);
        const double step = ldexp(1.0, (fabs(xs) < 0x1p-6 ? -6 : ilogb(xs)) - 3);
        CHECKM(fabs((double)y[i] - x[i]) <= 0.5 * step * s, "%s: [%zu] x %g -> %g", what, i,
               (double)x[i], (double)y[i]);
    }
}

// precision.scale = pow2 on the CPU codec: 1x128 rows whose amax sits on the rule's edges
// (exactly 448 * 2^k, which must not be doubled, one ulp either side, fp32 subnormals, the
// bottom of the range where both rules give 1, the fp32 maximum, zeros, NaN, Inf), each
// against an exact reference and by hand; the FP32 rule on the same rows unchanged; a random
// matrix in 1x128 and 128x128 blocks both ways and fp8-tensor.
START_TEST(test_fp8_pow2_scales)
{
    static const struct {
        float amax, want, want_fp32;   // want_fp32 0: amax / 448 itself
        const char *what;
    } rows[] = {
        {0.0f, 1.0f, 1.0f, "all zero"},
        {448.0f, 1.0f, 1.0f, "448: 2^0, not doubled"},
        {0x1.000002p+0f * 448.0f, 2.0f, 0, "one ulp above 448"},
        {0x1.fffffep-1f * 56.0f, 0x1p-3f, 0, "one ulp below 448 * 2^-3"},
        {448.0f * 0x1p20f, 0x1p20f, 0x1p20f, "448 * 2^20"},
        {1.0f, 0x1p-8f, 0, "1"},
        {448.0f * 0x1p-149f, 0x1p-149f, 0x1p-149f, "448 * 2^-149: the smallest subnormal scale"},
        {0x1.cp-142f, 1.0f, 1.0f, "448 * 2^-150: below fp32, 1 as amax / 448 = 0"},
        {0x1.cp-142f + 0x1p-149f, 0x1p-149f, 0x1p-149f, "one ulp above that"},
        {0x1p-140f, 0x1p-148f, 0, "a subnormal amax"},
        {448.0f * 0x1p-127f, 0x1p-127f, 0x1p-127f, "448 * 2^-127: a subnormal scale"},
        {3.0e38f, 0x1p120f, 0, "3e38"},
        {NAN, NAN, NAN, "NaN"},
        {INFINITY, NAN, NAN, "Inf"},
    };
    enum { NR = sizeof rows / sizeof rows[0], C = 128 };
    float x[NR * C], y[NR * C];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < C; c++) {
            const float a = rows[r].amax != rows[r].amax || rows[r].amax == INFINITY
                                ? 1.0f : rows[r].amax;
            // below the amax: fractions of it (some exact E4M3 multiples, some not), signs
            float v = a * ((float)(c % 7) / 9.0f);
            x[r * C + c] = c % 2 ? -v : v;
        }
    for (int r = 0; r < NR; r++) x[r * C + 77] = -rows[r].amax;   // the block's |x| maximum
    x[3] = -0.0f;
    for (int pow2 = 0; pow2 < 2; pow2++) {
        lb_quant_args a;
        memset(&a, 0, sizeof a);
        a.fmt = LB_FMT_FP8_BLOCK, a.pow2 = pow2;
        lb_qmat q;
        lb_qmat_alloc(&q, NR, C, &a);
        lb_quantize(&q, x, NR, C, &a);
        lb_dequantize(y, &q);
        for (int r = 0; r < NR; r++) {
            const float s = ((const float *)q.scale)[r], amax = rows[r].amax;
            const float want = pow2 ? rows[r].want
                             : rows[r].want_fp32 != 0.0f ? rows[r].want_fp32 : amax / 448.0f;
            CHECKM(same(s, want), "%s, %s: scale %a, want %a", rows[r].what,
                   pow2 ? "pow2" : "fp32", (double)s, (double)want);
            if (amax != amax || amax == INFINITY) {
                for (int c = 0; c < C; c++) CHECK(q.data[r * C + c] == 0);
                continue;
            }
            if (!pow2) continue;
            CHECKM(same(s, pow2_ref(amax)), "%s: scale %a, reference %a", rows[r].what,
                   (double)s, (double)pow2_ref(amax));
            // 1 where the block's values are all below fp32's reach of a scale: codes of 0
            if (s == 1.0f && amax < 1e-30f) {
                for (int c = 0; c < C; c++) CHECK((q.data[r * C + c] & 0x7f) == 0);
                continue;
            }
            pow2_elements(rows[r].what, x + r * C, y + r * C, q.data + r * C, C, s);
        }
        lb_qmat_free(&q);
    }
    // The fp32 maximum: 2^120, and its top element rounds up to 256 * 2^120 = +Inf when
    // dequantized (doc/formats.md)
    {
        float m[2] = {3.4028235e38f, 1.0f}, my[2];
        lb_quant_args a;
        memset(&a, 0, sizeof a);
        a.fmt = LB_FMT_FP8_BLOCK, a.pow2 = 1;
        lb_qmat q;
        lb_qmat_alloc(&q, 1, 2, &a);
        lb_quantize(&q, m, 1, 2, &a);
        lb_dequantize(my, &q);
        CHECKM(same(((const float *)q.scale)[0], 0x1p120f), "fp32 max: %a",
               (double)((const float *)q.scale)[0]);
        CHECK(my[0] == INFINITY && my[1] == 0.0f);
        lb_qmat_free(&q);
    }

    // Random rows of unlike magnitude, 1x128 and 128x128 blocks both ways, and fp8-tensor:
    // every scale a power of two in [amax / 448, 2 amax / 448), the elements as above.
    const int R = 150, CC = 300;
    float *xr = randmat(R, CC, 99), *yr = lb_malloc((size_t)R * CC * sizeof(float));
    xr[5] = 0.0f;
    for (int f = 0; f < 3; f++)
        for (int dir = 0; dir < 2; dir++) {
            lb_quant_args a;
            memset(&a, 0, sizeof a);
            a.fmt = f == 2 ? LB_FMT_FP8_TENSOR : LB_FMT_FP8_BLOCK;
            a.weight_blocks = f == 1, a.colwise = dir, a.pow2 = 1;
            lb_qmat q;
            lb_qmat_alloc(&q, R, CC, &a);
            lb_quantize(&q, xr, R, CC, &a);
            lb_dequantize(yr, &q);
            float *src = lb_malloc((size_t)R * CC * sizeof(float));   // Q's own layout
            for (int r = 0; r < q.rows; r++)
                for (int c = 0; c < q.cols; c++)
                    src[(size_t)r * q.cols + c] =
                        dir ? xr[(size_t)c * CC + r] : xr[(size_t)r * CC + c];
            char what[64];
            snprintf(what, sizeof what, "random %s %s", f == 2 ? "tensor" : f ? "128x128" : "1x128",
                     dir ? "col" : "row");
            for (int i = 0; i < q.srows; i++)
                for (int j = 0; j < q.scols; j++) {
                    float amax = 0.0f;
                    for (int r = i * q.brows; r < (i + 1) * q.brows && r < q.rows; r++)
                        for (int c = j * q.bcols; c < (j + 1) * q.bcols && c < q.cols; c++)
                            amax = fmaxf(amax, fabsf(src[(size_t)r * q.cols + c]));
                    const float s = ((const float *)q.scale)[(size_t)i * q.scols + j];
                    int e;
                    CHECKM(frexpf(s, &e) == 0.5f, "%s: scale %a is not a power of two", what,
                           (double)s);
                    CHECKM(same(s, pow2_ref(amax)), "%s: block (%d, %d) scale %a, want %a", what,
                           i, j, (double)s, (double)pow2_ref(amax));
                    CHECKM((double)amax <= 448.0 * s && (double)amax > 224.0 * s,
                           "%s: block (%d, %d) amax %g, scale %a", what, i, j, (double)amax,
                           (double)s);
                }
            for (int r = 0; r < q.rows; r++) {
                const size_t o = (size_t)r * q.cols;
                for (int c0 = 0; c0 < q.cols; c0 += q.bcols) {
                    const int n = q.cols - c0 < q.bcols ? q.cols - c0 : q.bcols;
                    const float s = ((const float *)q.scale)[(size_t)(r / q.brows) * q.scols +
                                                             c0 / q.bcols];
                    pow2_elements(what, src + o + c0, yr + o + c0, q.data + o + c0, (size_t)n, s);
                }
            }
            free(src);
            lb_qmat_free(&q);
        }
    free(xr), free(yr);

    // pow2 belongs to the formats with FP32 scales: MX and NVFP4 layouts refuse it
    lb_quant_args a = {0};
    a.fmt = LB_FMT_MXFP8, a.pow2 = 1;
    lb_qmat q;
    lb_set_abort_hook(die_jump);
    int died = setjmp(die_jmp);
    if (!died) lb_qmat_layout(&q, 4, 32, &a);
    lb_set_abort_hook(NULL);
    CHECKM(died, "MXFP8 with pow2 must fail");
}
END_TEST

// Row-wise quantization with 1-D blocks is row-local: the view lb_qmat_rows gives of rows
// [r0, r0 + n) of a whole matrix's quantization holds the bytes of quantizing those rows alone
// (what an MoE layer relies on to quantize all experts' rows in one call). Not for NVFP4 with
// one second level per tensor (the tensor's amax), nor stochastic rounding (its counters are
// the matrix's indices), nor square blocks (lb_qmat_rows refuses them).
START_TEST(test_qmat_rows)
{
    int rows = 50, cols = 300;
    const int r0s[] = {0, 1, 17, 49}, ns[] = {1, 16, 33, 1};
    float *x = randmat(rows, cols, 12);
    int checked = 0;
    for (int c = 0; c < NCASES; c++) {
        const qcase *k = &CASES[c];
        if (k->weight || k->sr || (k->fmt == LB_FMT_NVFP4 && k->s2 == LB_S2_TENSOR)) continue;
        lb_quant_args a = case_args(k, 0, 0.01f, 1, 2, 3);
        lb_qmat q;
        lb_qmat_alloc(&q, rows, cols, &a);
        lb_quantize(&q, x, rows, cols, &a);
        for (int t = 0; t < 4; t++) {
            lb_qmat v = lb_qmat_rows(&q, r0s[t], ns[t]), one;
            lb_qmat_alloc(&one, ns[t], cols, &a);
            lb_quantize(&one, x + (size_t)r0s[t] * cols, ns[t], cols, &a);
            CHECKM(v.rows == ns[t] && v.srows == ns[t] && v.cols == cols, "%s: view shape", k->name);
            CHECKM(memcmp(v.data, one.data, lb_qmat_data_bytes(&one)) == 0, "%s: rows %d+%d data",
                   k->name, r0s[t], ns[t]);
            CHECKM(memcmp(v.scale, one.scale, lb_qmat_scale_bytes(&one)) == 0,
                   "%s: rows %d+%d scales", k->name, r0s[t], ns[t]);
            if (one.nscale2 > 1)
                CHECKM(v.nscale2 == ns[t] &&
                           memcmp(v.scale2, one.scale2, (size_t)ns[t] * sizeof(float)) == 0,
                       "%s: rows %d+%d second levels", k->name, r0s[t], ns[t]);
            lb_qmat_free(&one);
            checked++;
        }
        lb_qmat_free(&q);
    }
    CHECK(checked == 4 * 9);   // fp8, 4 mxfp8, 2 mxfp4, nvfp4 per row and given
    free(x);
}
END_TEST

// Fused gate/up with one shared second level: quantizing [gate | up] (n, 2f) with the given
// scale equals quantizing gate and up separately with that scale (blocks never straddle).
START_TEST(test_shared_scale2)
{
    int n = 12, f = 48;
    float *g = randmat(n, f, 31), *u = randmat(n, f, 32);
    float *gu = lb_malloc((size_t)n * 2 * f * sizeof(float));
    for (int r = 0; r < n; r++) {
        memcpy(gu + (size_t)r * 2 * f, g + (size_t)r * f, f * sizeof(float));
        memcpy(gu + (size_t)r * 2 * f + f, u + (size_t)r * f, f * sizeof(float));
    }
    float am = fmaxf(lb_amax(g, (size_t)n * f), lb_amax(u, (size_t)n * f));
    float s2 = lb_nvfp4_scale2(am);
    CHECK(s2 == lb_nvfp4_scale2(lb_amax(gu, (size_t)n * 2 * f)));
    lb_quant_args a = {0};
    a.fmt = LB_FMT_NVFP4;
    a.s2_mode = LB_S2_GIVEN;
    a.s2 = s2;
    lb_qmat qg, qu, qgu, qt;
    lb_qmat_alloc(&qg, n, f, &a);
    lb_qmat_alloc(&qu, n, f, &a);
    lb_qmat_alloc(&qgu, n, 2 * f, &a);
    lb_quantize(&qg, g, n, f, &a);
    lb_quantize(&qu, u, n, f, &a);
    lb_quantize(&qgu, gu, n, 2 * f, &a);
    for (int r = 0; r < n; r++)
        for (int k = 0; k < f; k++) {
            CHECK(lb_qmat_code(&qgu, r, k) == lb_qmat_code(&qg, r, k));
            CHECK(lb_qmat_code(&qgu, r, f + k) == lb_qmat_code(&qu, r, k));
        }
    // The fused tensor quantized with its own per-tensor scale is the same.
    a.s2_mode = LB_S2_TENSOR;
    lb_qmat_alloc(&qt, n, 2 * f, &a);
    lb_quantize(&qt, gu, n, 2 * f, &a);
    CHECK(memcmp(qt.data, qgu.data, lb_qmat_data_bytes(&qt)) == 0);
    CHECK(qt.scale2[0] == s2);
    lb_qmat_free(&qg);
    lb_qmat_free(&qu);
    lb_qmat_free(&qgu);
    lb_qmat_free(&qt);
    free(g);
    free(u);
    free(gu);
}
END_TEST

// NVFP4 without the second level is exact (E2M1 * UE4M3), and times s2 gives lb_dequantize.
START_TEST(test_dequantize_blocks)
{
    int rows = 8, cols = 64;
    float *x = randmat(rows, cols, 41);
    float *y = lb_malloc(sizeof(float) * rows * cols), *yb = lb_malloc(sizeof(float) * rows * cols);
    lb_quant_args a = {0};
    a.fmt = LB_FMT_NVFP4;
    a.s2_mode = LB_S2_ROW;
    lb_qmat q;
    lb_qmat_alloc(&q, rows, cols, &a);
    lb_quantize(&q, x, rows, cols, &a);
    lb_dequantize(y, &q);
    lb_dequantize_blocks(yb, &q);
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            size_t i = (size_t)r * cols + c;
            double e = lb_decode(LB_E2M1, lb_qmat_code(&q, r, c));
            double s = lb_decode(LB_UE4M3, ((uint8_t *)q.scale)[(size_t)r * q.scols + c / 16]);
            CHECK(yb[i] == e * s);                       // exact in fp32
            CHECK(y[i] == yb[i] * q.scale2[r]);
        }
    lb_qmat_free(&q);
    free(x);
    free(y);
    free(yb);
}
END_TEST

// Stochastic rounding in the quantizers: deterministic in (seed, step, tensor), different for
// another step or tensor, scales untouched, and unbiased over steps.
START_TEST(test_sr_quantizers)
{
    int rows = 4, cols = 64;
    float *x = randmat(rows, cols, 17);
    const lb_format fmts[] = {LB_FMT_FP8_BLOCK, LB_FMT_MXFP8, LB_FMT_MXFP4, LB_FMT_NVFP4};
    for (int f = 0; f < 4; f++) {
        lb_quant_args a = {0};
        a.fmt = fmts[f];
        a.sr = 1;
        a.seed = 1;
        a.step = 10;
        a.tensor = 3;
        lb_qmat q1, q2, q3, q4, qn;
        lb_qmat_alloc(&q1, rows, cols, &a);
        lb_qmat_alloc(&q2, rows, cols, &a);
        lb_qmat_alloc(&q3, rows, cols, &a);
        lb_qmat_alloc(&q4, rows, cols, &a);
        lb_qmat_alloc(&qn, rows, cols, &a);
        lb_quantize(&q1, x, rows, cols, &a);
        lb_quantize(&q2, x, rows, cols, &a);
        a.step = 11;
        lb_quantize(&q3, x, rows, cols, &a);
        a.step = 10;
        a.tensor = 4;
        lb_quantize(&q4, x, rows, cols, &a);
        a.sr = 0;
        lb_quantize(&qn, x, rows, cols, &a);
        size_t nb = lb_qmat_data_bytes(&q1), ns = lb_qmat_scale_bytes(&q1);
        CHECK(memcmp(q1.data, q2.data, nb) == 0);
        CHECK(memcmp(q1.data, q3.data, nb) != 0);
        CHECK(memcmp(q1.data, q4.data, nb) != 0);
        CHECK(memcmp(q1.data, qn.data, nb) != 0);
        CHECK(memcmp(q1.scale, q3.scale, ns) == 0 && memcmp(q1.scale, qn.scale, ns) == 0);
        lb_qmat_free(&q1);
        lb_qmat_free(&q2);
        lb_qmat_free(&q3);
        lb_qmat_free(&q4);
        lb_qmat_free(&qn);
    }
    // Unbiased: the mean over steps of the MXFP4 dequantization approaches x (the scale does
    // not depend on the draws), while round-to-nearest keeps its bias.
    const int steps = 3000;
    double *mean = lb_calloc((size_t)rows * cols, sizeof(double));
    float *y = lb_malloc(sizeof(float) * rows * cols), *yn = lb_malloc(sizeof(float) * rows * cols);
    lb_quant_args a = {0};
    a.fmt = LB_FMT_MXFP4;
    lb_qmat q;
    lb_qmat_alloc(&q, rows, cols, &a);
    lb_quantize(&q, x, rows, cols, &a);
    lb_dequantize(yn, &q);
    a.sr = 1;
    a.seed = 99;
    for (int s = 0; s < steps; s++) {
        a.step = (uint64_t)s;
        lb_quantize(&q, x, rows, cols, &a);
        lb_dequantize(y, &q);
        for (int i = 0; i < rows * cols; i++) mean[i] += y[i] / steps;
    }
    double worst = 0, worst_rne = 0;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            size_t i = (size_t)r * cols + c;
            double d = divisor(&q, r, c);   // E2M1 steps are at most 2 * d
            double sigma = d / sqrt((double)steps);   // <= half a step / sqrt(steps)
            double e = fabs(mean[i] - x[i]) / sigma;
            if (e > worst) worst = e;
            double en = fabs(yn[i] - x[i]) / sigma;
            if (en > worst_rne) worst_rne = en;
        }
    CHECKM(worst < 5.0, "SR mean off by %g sigma", worst);
    CHECKM(worst_rne > 10.0, "RNE unexpectedly unbiased (%g sigma)", worst_rne);
    lb_qmat_free(&q);
    free(mean);
    free(y);
    free(yn);
    free(x);
}
END_TEST

// Large enough for the thread team: the bytes never depend on the number of threads.
START_TEST(test_thread_invariance)
{
    int rows = 260, cols = 300;
    float *x = randmat(rows, cols, 123);
    int saved = omp_get_max_threads();
    for (int c = 0; c < NCASES; c++)
        for (int dir = 0; dir < 2; dir++) {
            lb_quant_args a = case_args(&CASES[c], dir, 0.05f, 1, 2, 3);
            lb_qmat q1, q4;
            lb_qmat_alloc(&q1, rows, cols, &a);
            lb_qmat_alloc(&q4, rows, cols, &a);
            omp_set_num_threads(1);
            lb_quantize(&q1, x, rows, cols, &a);
            omp_set_num_threads(4);
            lb_quantize(&q4, x, rows, cols, &a);
            CHECKM(memcmp(q1.data, q4.data, lb_qmat_data_bytes(&q1)) == 0 &&
                   memcmp(q1.scale, q4.scale, lb_qmat_scale_bytes(&q1)) == 0, "%s %s",
                   CASES[c].name, dir ? "col" : "row");
            lb_qmat_free(&q1);
            lb_qmat_free(&q4);
        }
    int hc = 288;                                  // x read as (rows, 288): whole blocks of 32
    float *h1 = lb_malloc(sizeof(float) * rows * hc);
    float *h4 = lb_malloc(sizeof(float) * rows * hc);
    for (int ax = 0; ax < 2; ax++) {
        omp_set_num_threads(1);
        lb_hadamard(h1, x, ax ? rows : 256, hc, (lb_axis)ax, 32, 0x1234u);
        omp_set_num_threads(4);
        lb_hadamard(h4, x, ax ? rows : 256, hc, (lb_axis)ax, 32, 0x1234u);
        CHECK(memcmp(h1, h4, sizeof(float) * (ax ? rows : 256) * hc) == 0);
    }
    omp_set_num_threads(saved);
    free(h1);
    free(h4);
    free(x);
}
END_TEST

// --- Hadamard ------------------------------------------------------------------------------------

START_TEST(test_hadamard_golden)
{
    golden g;
    golden_open(&g, "hadamard");
    const char *s;
    uint64_t seed = (s = lb_st_meta(&g.f, "h_seed")) ? strtoull(s, NULL, 10) : 0;
    uint64_t step = (s = lb_st_meta(&g.f, "h_step")) ? strtoull(s, NULL, 10) : 0;
    uint64_t site = (s = lb_st_meta(&g.f, "h_site")) ? strtoull(s, NULL, 10) : 0;
    CHECK(seed && step && site);
    size_t n;
    float *x = f32s(&g, "x", &n);
    float *xi = f32s(&g, "xi", NULL);
    const int R = 32, C = 32;
    CHECK(n == (size_t)R * C);
    float xmax = lb_amax(x, n);
    float *y = lb_malloc(n * sizeof(float));
    int approx = 0, exact = 0, inv = 0;
    for (int hn = 16; hn <= 32; hn *= 2) {
        char name[96];
        snprintf(name, sizeof name, "signs%d", hn);
        uint8_t *sb = u8s(&g, name, NULL);
        uint64_t want = 0;
        for (int b = 7; b >= 0; b--) want = want << 8 | sb[b];
        free(sb);
        uint32_t sg = lb_hadamard_signs(hn, seed, step, site);
        CHECKM(sg == want, "signs%d: %#x want %#llx", hn, sg, (unsigned long long)want);
        CHECK(sg != 0);
        for (int ax = 0; ax < 2; ax++)
            for (int rnd = 0; rnd < 2; rnd++) {
                char key[64];
                snprintf(key, sizeof key, "h%d.%s.%s", hn, ax ? "cols" : "rows",
                         rnd ? "rand" : "det");
                uint32_t signs = rnd ? sg : 0;
                snprintf(name, sizeof name, "%s.fwd", key);
                if (has(&g, name)) {
                    float *want_y = f32s(&g, name, NULL);
                    lb_hadamard(y, x, R, C, (lb_axis)ax, hn, signs);
                    for (size_t i = 0; i < n; i++)
                        CHECKM(fabsf(y[i] - want_y[i]) <= 1e-6f * xmax * hn,
                               "%s[%zu]: %g want %g", name, i, (double)y[i],
                               (double)want_y[i]);
                    free(want_y);
                    approx++;
                }
                snprintf(name, sizeof name, "%s.fwd_exact", key);
                if (has(&g, name)) {
                    float *want_y = f32s(&g, name, NULL);
                    lb_hadamard(y, xi, R, C, (lb_axis)ax, hn, signs);
                    for (size_t i = 0; i < n; i++)
                        CHECKM(bits(y[i]) == bits(want_y[i]), "%s[%zu]: %a want %a", name,
                               i, (double)y[i], (double)want_y[i]);
                    free(want_y);
                    exact++;
                }
                snprintf(name, sizeof name, "%s.inv", key);
                if (has(&g, name)) {
                    float *want_y = f32s(&g, name, NULL);
                    lb_hadamard_inv(y, x, R, C, (lb_axis)ax, hn, signs);
                    for (size_t i = 0; i < n; i++)
                        CHECKM(fabsf(y[i] - want_y[i]) <= 1e-6f * xmax * hn,
                               "%s[%zu]: %g want %g", name, i, (double)y[i],
                               (double)want_y[i]);
                    free(want_y);
                    inv++;
                }
            }
    }
    ck_assert_int_eq(approx + exact, 8);   // every (size, axis, signs) once
    ck_assert_int_ge(exact, 4);
    ck_assert_int_ge(inv, 4);
    free(x);
    free(xi);
    free(y);
    lb_st_close(&g.f);
}
END_TEST

static double dot_rows(const float *a, const float *b, int k)
{
    double s = 0;
    for (int i = 0; i < k; i++) s += (double)a[i] * b[i];
    return s;
}

// Orthogonal: the inverse undoes it, norms are kept, and the matrix Q built column by column
// satisfies Q Q^T = I; deterministic mode is the symmetric H (its own inverse).
START_TEST(test_hadamard_orthogonal)
{
    for (int hn = 16; hn <= 32; hn *= 2)
        for (int ax = 0; ax < 2; ax++)
            for (int rnd = 0; rnd < 2; rnd++) {
                uint32_t signs = rnd ? lb_hadamard_signs(hn, 1, 2, 3) : 0;
                int R = 64, C = 96;
                float *x = randmat(R, C, 3), *y = lb_malloc(sizeof(float) * R * C);
                float *z = lb_malloc(sizeof(float) * R * C);
                float tol = 4e-6f * lb_amax(x, (size_t)R * C);   // rounding scales with the block
                lb_hadamard(y, x, R, C, (lb_axis)ax, hn, signs);
                lb_hadamard_inv(z, y, R, C, (lb_axis)ax, hn, signs);
                double nx = 0, ny = 0;
                for (int i = 0; i < R * C; i++) {
                    CHECKM(fabsf(z[i] - x[i]) <= tol, "inverse: %g vs %g", (double)z[i],
                           (double)x[i]);
                    nx += (double)x[i] * x[i];
                    ny += (double)y[i] * y[i];
                }
                CHECK(fabs(nx - ny) <= 1e-6 * nx);
                if (!rnd) {                       // H symmetric: forward twice is the identity
                    lb_hadamard(z, y, R, C, (lb_axis)ax, hn, 0);
                    for (int i = 0; i < R * C; i++)
                        CHECK(fabsf(z[i] - x[i]) <= tol);
                }
                // Q from the unit vectors along cols: row i of e = e_i, Q^T rows = images.
                float *e = lb_calloc((size_t)hn * hn, sizeof(float));
                for (int i = 0; i < hn; i++) e[i * hn + i] = 1.0f;
                lb_hadamard(e, e, hn, hn, LB_AXIS_COLS, hn, signs);
                for (int i = 0; i < hn; i++)
                    for (int j = 0; j < hn; j++) {
                        double d = dot_rows(e + i * hn, e + j * hn, hn);
                        CHECK(fabs(d - (i == j)) < 1e-6);
                    }
                free(e);
                free(x);
                free(y);
                free(z);
            }
    // Random signs: fixed for a step, new for the next one.
    CHECK(lb_hadamard_signs(16, 1, 2, 3) == lb_hadamard_signs(16, 1, 2, 3));
    CHECK(lb_hadamard_signs(32, 1, 2, 3) != lb_hadamard_signs(32, 1, 3, 3));
    CHECK(lb_hadamard_signs(16, 1, 2, 3) >> 16 == 0);
}
END_TEST

// The GEMM-invariance property: transforming both operands along K leaves the product, up to
// rounding: fprop-like C = A B^T with K = cols, and wgrad-like dW = dY^T X with K = rows.
START_TEST(test_hadamard_gemm_invariance)
{
    int m = 24, n = 20, k = 128;
    float *a = randmat(m, k, 51), *b = randmat(n, k, 52);
    float *ha = lb_malloc(sizeof(float) * m * k), *hb = lb_malloc(sizeof(float) * n * k);
    for (int hs = 16; hs <= 32; hs *= 2)
        for (int rnd = 0; rnd < 2; rnd++) {
            uint32_t signs = rnd ? lb_hadamard_signs(hs, 7, 8, 9) : 0;
            lb_hadamard(ha, a, m, k, LB_AXIS_COLS, hs, signs);
            lb_hadamard(hb, b, n, k, LB_AXIS_COLS, hs, signs);
            for (int i = 0; i < m; i++)
                for (int j = 0; j < n; j++) {
                    double c = dot_rows(a + i * k, b + j * k, k);
                    double hc = dot_rows(ha + i * k, hb + j * k, k);
                    double scale = sqrt(dot_rows(a + i * k, a + i * k, k) *
                                        dot_rows(b + j * k, b + j * k, k));
                    CHECKM(fabs(c - hc) <= 1e-6 * scale, "C[%d][%d] %g vs %g", i, j, c, hc);
                }
            // wgrad: dY (k, m), X (k, n) with K = rows; reuse a, b as (k, m) and (k, n) data.
            int T = 64;
            float *dy = randmat(T, m, 61), *x = randmat(T, n, 62);
            float *hdy = lb_malloc(sizeof(float) * T * m), *hx = lb_malloc(sizeof(float) * T * n);
            lb_hadamard(hdy, dy, T, m, LB_AXIS_ROWS, hs, signs);
            lb_hadamard(hx, x, T, n, LB_AXIS_ROWS, hs, signs);
            for (int i = 0; i < m; i++)
                for (int j = 0; j < n; j++) {
                    double w = 0, hw = 0, na = 0, nb = 0;
                    for (int t = 0; t < T; t++) {
                        w += (double)dy[t * m + i] * x[t * n + j];
                        hw += (double)hdy[t * m + i] * hx[t * n + j];
                        na += (double)dy[t * m + i] * dy[t * m + i];
                        nb += (double)x[t * n + j] * x[t * n + j];
                    }
                    CHECKM(fabs(w - hw) <= 1e-6 * sqrt(na * nb), "dW[%d][%d]", i, j);
                }
            free(dy);
            free(x);
            free(hdy);
            free(hx);
        }
    free(a);
    free(b);
    free(ha);
    free(hb);
}
END_TEST

// The transform fused into column-wise quantization (lb_quant_args.hadamard) gives the bytes of
// lb_hadamard along x's rows followed by plain column-wise quantization, for every format (also
// with stochastic rounding and the per-row NVFP4 second level).
START_TEST(test_hadamard_fused)
{
    const int T = 96, C = 40;
    float *x = randmat(T, C, 71), *t = lb_malloc(sizeof(float) * T * C);
    struct { lb_format f; lb_scale2_mode s2; } fmts[] = {
        {LB_FMT_FP8_BLOCK, 0}, {LB_FMT_MXFP8, 0}, {LB_FMT_MXFP4, 0},
        {LB_FMT_NVFP4, LB_S2_TENSOR}, {LB_FMT_NVFP4, LB_S2_ROW}};
    for (int fi = 0; fi < 5; fi++)
        for (int hs = 16; hs <= 32; hs *= 2)
            for (int var = 0; var < 2; var++) {   // var 1: random signs and stochastic rounding
                lb_quant_args a = {0};
                a.fmt = fmts[fi].f, a.s2_mode = fmts[fi].s2, a.colwise = 1;
                a.sr = var, a.seed = 5, a.step = 6, a.tensor = 7;
                uint32_t signs = var ? lb_hadamard_signs(hs, 1, 2, 3) : 0;
                lb_hadamard(t, x, T, C, LB_AXIS_ROWS, hs, signs);
                lb_qmat want, got;
                lb_qmat_alloc(&want, T, C, &a);
                lb_quantize(&want, t, T, C, &a);
                a.hadamard = hs, a.hsigns = signs;
                lb_qmat_alloc(&got, T, C, &a);
                lb_quantize(&got, x, T, C, &a);
                CHECKM(!memcmp(want.data, got.data, lb_qmat_data_bytes(&want)) &&
                           !memcmp(want.scale, got.scale, lb_qmat_scale_bytes(&want)) &&
                           (!want.nscale2 || !memcmp(want.scale2, got.scale2,
                                                     (size_t)want.nscale2 * sizeof(float))),
                       "format %d, Hadamard %d, variant %d: fused bytes differ", fi, hs, var);
                lb_qmat_free(&want);
                lb_qmat_free(&got);
            }
    free(x);
    free(t);
}
END_TEST

// lb_quant_groups gives group j the stream of tensor a->tensor + j and, with hsigns_groups,
// the signs hsigns_groups[j] (random16: the wgrad draws them per expert): each group's bytes are
// those of lb_quantize of that group alone with its own stream and signs.
typedef struct {
    lb_qmat *q;
} groups_ctx;

static void quantize_group(void *ctx, int j, lb_act xj, int pr, const lb_quant_args *aj)
{
    groups_ctx *g = ctx;
    ck_assert_int_eq(xj.rows, pr);
    ck_assert_int_eq(xj.type, LB_ACT_F32);
    lb_qmat_alloc(&g->q[j], xj.rows, xj.cols, aj);
    lb_quantize(&g->q[j], xj.p, xj.rows, xj.cols, aj);
}

START_TEST(test_hadamard_signs_per_group)
{
    enum { G = 3, C = 24 };
    const int rows[G] = {32, 16, 48};
    float *x = randmat(32 + 16 + 48, C, 73);
    uint32_t signs[G];
    for (int j = 0; j < G; j++) signs[j] = lb_hadamard_signs(16, 9, 4, 100 + (uint64_t)j);
    lb_quant_args a = {0};
    a.fmt = LB_FMT_NVFP4, a.s2_mode = LB_S2_TENSOR, a.colwise = 1, a.sr = 1;
    a.seed = 3, a.step = 4, a.tensor = 50, a.hadamard = 16, a.hsigns_groups = signs;
    lb_qmat got[G];
    groups_ctx g = {got};
    lb_quant_groups(G, lb_act_f32(x, 32 + 16 + 48, C), rows, NULL, &a, quantize_group, &g);
    int off = 0, differ = 0;
    for (int j = 0; j < G; j++) {
        lb_quant_args aj = a;
        aj.hsigns_groups = NULL, aj.hsigns = signs[j], aj.tensor = a.tensor + (uint64_t)j;
        lb_qmat want;
        lb_qmat_alloc(&want, rows[j], C, &aj);
        lb_quantize(&want, x + (size_t)off * C, rows[j], C, &aj);
        CHECKM(!memcmp(want.data, got[j].data, lb_qmat_data_bytes(&want)) &&
                   !memcmp(want.scale, got[j].scale, lb_qmat_scale_bytes(&want)) &&
                   !memcmp(want.scale2, got[j].scale2, sizeof(float)),
               "group %d: bytes differ from its own quantization", j);
        // and the signs matter: group 0's signs on group j give other bytes
        aj.hsigns = signs[(j + 1) % G];
        lb_qmat other;
        lb_qmat_alloc(&other, rows[j], C, &aj);
        lb_quantize(&other, x + (size_t)off * C, rows[j], C, &aj);
        differ += memcmp(other.data, got[j].data, lb_qmat_data_bytes(&other)) != 0;
        lb_qmat_free(&want);
        lb_qmat_free(&other);
        lb_qmat_free(&got[j]);
        off += rows[j];
    }
    CHECKM(differ == G, "only %d of %d groups changed under another group's signs", differ, G);
    free(x);
}
END_TEST

// A fused transform needs column-wise quantization and rows a multiple of its size: lb_die
// (its abort hook, die_jump, jumps back here; the suite runs without fork).

static int layout_dies(int colwise, int rows, int h)
{
    lb_quant_args a = {0};
    a.fmt = LB_FMT_NVFP4, a.colwise = colwise, a.hadamard = h;
    lb_qmat q;
    lb_set_abort_hook(die_jump);
    int died = setjmp(die_jmp);
    if (!died) lb_qmat_layout(&q, rows, 16, &a);
    lb_set_abort_hook(NULL);
    return died != 0;
}

START_TEST(test_hadamard_fused_errors)
{
    CHECKM(!layout_dies(1, 32, 16), "column-wise, 32 rows, size 16 is valid");
    CHECKM(layout_dies(0, 32, 16), "row-wise quantization with a transform must fail");
    CHECKM(layout_dies(1, 40, 16), "40 rows are not a multiple of 16");
    CHECKM(layout_dies(1, 48, 12), "12 is not a power of two");
}
END_TEST

// A transposed copy (square blocks) holds the bytes of quantizing x in the other direction.
START_TEST(test_qmat_transpose)
{
    const int shapes[][2] = {{300, 200}, {129, 257}, {37, 50}, {33, 17}, {1, 1}};
    for (int fi = 0; fi < 2; fi++)
        for (int si = 0; si < 5; si++)
            for (int colwise = 0; colwise < 2; colwise++) {
                const int R = shapes[si][0], C = shapes[si][1];
                float *x = randmat(R, C, 90 + si);
                if (si == 1) x[5 * C + 7] = NAN;   // a NaN block: its scale and zero codes
                lb_quant_args a = {0};
                a.fmt = fi ? LB_FMT_NVFP4 : LB_FMT_FP8_BLOCK, a.weight_blocks = 1;
                a.s2_mode = LB_S2_TENSOR, a.colwise = colwise;
                lb_quant_args b = a;
                b.colwise = !colwise;
                lb_qmat src, want, got;
                lb_qmat_alloc(&src, R, C, &a);
                lb_qmat_alloc(&want, R, C, &b);
                lb_qmat_alloc(&got, R, C, &b);
                lb_quantize(&src, x, R, C, &a);
                lb_quantize(&want, x, R, C, &b);
                memset(got.data, 0xff, lb_qmat_data_bytes(&got));
                lb_qmat_transpose(&got, &src);
                CHECKM(!memcmp(want.data, got.data, lb_qmat_data_bytes(&want)) &&
                           !memcmp(want.scale, got.scale, lb_qmat_scale_bytes(&want)) &&
                           (!want.nscale2 || !memcmp(want.scale2, got.scale2, 4)),
                       "format %d, (%d, %d), from %s: transposed bytes differ", fi, R, C,
                       colwise ? "column-wise" : "row-wise");
                lb_qmat_free(&src);
                lb_qmat_free(&want);
                lb_qmat_free(&got);
                free(x);
            }
    // 1x128 blocks have no transposed copy: an error (the abort hook jumps back here)
    lb_quant_args a = {0};
    a.fmt = LB_FMT_FP8_BLOCK;
    lb_qmat s1, d1;
    lb_qmat_layout(&s1, 256, 128, &a);
    a.colwise = 1;
    lb_qmat_layout(&d1, 256, 128, &a);
    lb_set_abort_hook(die_jump);
    int died = setjmp(die_jmp);
    if (!died) lb_qmat_transpose_check(&d1, &s1);
    lb_set_abort_hook(NULL);
    CHECKM(died, "a transposed copy of 1x128 blocks must fail");
}
END_TEST

static Suite *quant_suite(void)
{
    Suite *s = suite_create("quant");
    TCase *tc = tcase_create("quant");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_encode_golden);
    tcase_add_test(tc, test_decode_golden);
    tcase_add_test(tc, test_encode_decode_inverse);
    tcase_add_test(tc, test_sr_golden);
    tcase_add_test(tc, test_sr_unbiased);
    tcase_add_test(tc, test_blocks_golden);
    tcase_add_test(tc, test_roundtrip_bound);
    tcase_add_test(tc, test_mx_idempotent);
    tcase_add_test(tc, test_partial_and_transpose);
    tcase_add_test(tc, test_shared_scale2);
    tcase_add_test(tc, test_qmat_rows);
    tcase_add_test(tc, test_dequantize_blocks);
    tcase_add_test(tc, test_fp8_tensor);
    tcase_add_test(tc, test_fp8_pow2_scales);
    tcase_add_test(tc, test_sr_quantizers);
    tcase_add_test(tc, test_thread_invariance);
    tcase_add_test(tc, test_hadamard_golden);
    tcase_add_test(tc, test_hadamard_orthogonal);
    tcase_add_test(tc, test_hadamard_gemm_invariance);
    tcase_add_test(tc, test_hadamard_fused);
    tcase_add_test(tc, test_hadamard_signs_per_group);
    tcase_add_test(tc, test_hadamard_fused_errors);
    tcase_add_test(tc, test_qmat_transpose);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) { return lb_test_run(quant_suite()); }
