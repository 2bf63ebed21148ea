// test_backend_ops.c: every operation of a backend (CUDA) against the CPU reference on the
// same inputs, plus the backend's determinism and batch-invariance promises, as one table of
// cases (CASES, at the end; "the table of cases" below says what a row holds), in the manner
// of ggml's test-backend-ops.
//
// - Inputs are fresh each run: every random array is drawn from (seed, array number, element)
//   with the seed taken from the clock and printed; LB_TEST_SEED=N repeats a run.
// - Sizes are multiples of no tile (n 37..300, c 53, t 129, v 1001, e 53/128, odd k) plus one
//   vocabulary of 151936 and Qwen3-like head dims 64 and 128.
// - Every GPU output buffer is filled with 0xff bytes (NaN for floats, -1 for int32) before
//   each run, so an element a kernel forgot to write fails the comparison.
// - Float outputs are compared by normalised mean squared error
//       nmse = sum (dev - cpu)^2 / sum cpu^2
//   against a bound stated per operation; anything non-finite gives an infinite error, so NaN
//   never passes. Integer outputs (expert indices, plan rows, counts) must be equal, and where
//   the CUDA kernel performs the CPU's own arithmetic in the CPU's order the test says so and
//   demands equal bits.
// - Each GPU operation runs twice on the same inputs and must give the same bits; the batch
//   invariance tests run one row (or sequence) alone and inside a larger call.
//
// Bounds (NMSE), by the arithmetic each output goes through:
//   B_ROUND  1e-12  one to a few fp32 roundings per element, or a double sum rounded once
//                   (elementwise ops, norms, RoPE, router, cross-entropy, AdamW): the expected
//                   NMSE is about 1e-14 (relative error ~1e-7 per element), so the bound
//                   leaves a factor of 10 in RMS error.
//   B_ACCUM  1e-10  fp32 accumulation over up to a few hundred terms on both sides, in
//                   different orders (GEMM, attention): expected ~1e-13 (relative error
//                   ~3e-7), the bound leaves a factor of 30 in RMS error.
//   B_DOT    1e-13  a double dot product rounded once to fp32, summed in another order than
//                   the CPU (moe_combine_bwd's dweight): at most one fp32 rounding apart.
//   B_ATTN_BF16 1e-6  attention in bf16 mode (kernels.h) against the CPU's bf16 mode: both
//                   round the same inputs to bf16, but the GPU sums in fp32 in another order
//                   and its exp2f is approximate, so now and then a bf16 rounding of p or ds
//                   (2^-9 relative) falls the other way; those flips dominate.
// Run with LB_TEST_VERBOSE=1 to print every measured error; LB_TEST_CASES=TEXT runs only the
// cases whose runner or label contains TEXT.
//
// The suite skips (exit 77) when lowbit was built without CUDA or no CUDA device is visible,
// so CI without a GPU stays green; with a visible device a failing lb_backend_cuda_create is
// a failure. LB_TEST_BACKEND=cpu tests a second CPU backend (one thread) instead, the cases of
// CUDA's own paths skipped: the table's check where there is no GPU.
#include "lb_autoconf.h"
#include "kernels/common.h"
#include "kernels/kernels.h"
#include "kernels/quant/quant.h"
#include "src/io/safetensors.h"
#include "tests/testutil.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifdef LB_HAVE_CUDA
int lb_cuda_device_count(void);   // kernels/cuda/device.cu
// kernels/cuda/gemm_q.cu: gemm_q calls per path so far, and the compute capability.
void lb_cuda_gemm_q_stats(lb_backend *be, long *fp8_native, long *fp8_fallback, long *emulated,
                          long *fp8_grouped, int *cc_major);
// kernels/cuda/gemm_grouped.cu: whether gemm_experts' fp8-block form takes its device-count kernel
int lb_cuda_gemm_experts_q_fits(const lb_gemm_experts_args *x);
#endif

#define B_ROUND 1e-12
#define B_ACCUM 1e-10
#define B_DOT 1e-13
#define B_ATTN_BF16 1e-6

static lb_backend *cpu, *dev;   // the reference, and the backend under test
static uint64_t seed;
static uint64_t next_stream = 1;   // one random stream per array drawn

// --- the table of cases ------------------------------------------------------------------------
//
// Every case is a row of CASES (at the end of this file): the operations it checks, the
// runner of their family, its sizes and flags (p, f: in the order the runner's comment
// names them), formats (q), group sizes (g), the NMSE bound it is held to and, for CUDA's own
// paths, the switches of a backend of its own (env). A runner draws the inputs, runs the
// operations on the CPU and on the backend under test, and makes the checks the header above
// describes; a new case of an operation is a new row, a new operation a runner and its rows.
// test_registry checks that every operation of kernels.h's LB_OPS has a case.

#define LB_TEST_MAX_GROUPS 256

// A quantization as gq() builds it, plus a Hadamard transform of hadamard (0: none) whose
// signs are hsigns, or drawn: hsigns_draw > 0 from (seed, 5, hsigns_draw); -1 one per group j
// from (seed, 5, 20 + j).
typedef struct {
    lb_format fmt;
    int colwise, weight;
    lb_elem elem;
    lb_scale_rule rule;
    lb_scale2_mode s2;
    int sr;
    int hadamard;
    uint32_t hsigns;
    int hsigns_draw;
    int pow2;   // fp8-block's power-of-two scales (lb_quant_args.pow2)
} qspec;

// Rows per group: list[j], or add + (j * mul) % mod; the last group `last` rows where > 0.
typedef struct {
    int count;
    const int *list;
    int mul, mod, add, last;
} groups;

static void group_rows(const groups *g, int *rows)
{
    ck_assert(g->count <= LB_TEST_MAX_GROUPS);
    for (int j = 0; j < g->count; j++)
        rows[j] = g->list ? g->list[j] : g->add + (g->mod ? j * g->mul % g->mod : 0);
    if (g->last > 0) rows[g->count - 1] = g->last;
}

typedef struct test_case test_case;
struct test_case {
    const char *ops;                    // OP(x) OP(y) ...: the operations it checks, by name
    void (*run)(const test_case *tst);
    const char *name;                   // the runner's (CASE fills it)
    int p[8];
    float f[2];
    double bound;                       // NMSE; 0 where the runner compares bits only
    const char *label;                  // the formats, for the messages
    qspec q[2];
    groups g;
    const char *env[2];
    int cuda;                           // 1: CUDA's paths or counters; other backends skip it
};
#define OP(x) " " #x   // adjacent ones join: " gemm gemm_q"; test_registry checks each name

// --- helpers ---------------------------------------------------------------------------------

static int verbose(void)
{
    const char *s = getenv("LB_TEST_VERBOSE");
    return s && *s && *s != '0';
}

static float *randn(size_t n, float scale)
{
    uint64_t st = next_stream++;
    float *x = lb_malloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) x[i] = scale * lb_rand_normal(seed, st, i);
    return x;
}

static int32_t *randint(size_t n, int lo, int hi)   // uniform in [lo, hi)
{
    uint64_t st = next_stream++;
    int32_t *x = lb_malloc((n ? n : 1) * sizeof(int32_t));
    for (size_t i = 0; i < n; i++)
        x[i] = lo + (int32_t)(lb_rand_u64(seed, st, i) % (uint64_t)(hi - lo));
    return x;
}

static void *hdup(const void *x, size_t bytes)
{
    void *y = lb_malloc(bytes ? bytes : 1);
    if (bytes) memcpy(y, x, bytes);
    return y;
}

// Device copy of a host array.
static void *dput(const void *h, size_t bytes)
{
    void *d = dev->alloc(dev, bytes);
    dev->upload(dev, d, h, bytes);
    return d;
}

// Fills a device buffer with 0xff bytes (NaN as fp32, -1 as int32).
static void poison(void *d, size_t bytes)
{
    unsigned char *h = lb_malloc(bytes ? bytes : 1);
    memset(h, 0xff, bytes);
    dev->upload(dev, d, h, bytes);
    free(h);
}

static void *dpoisoned(size_t bytes)
{
    void *d = dev->alloc(dev, bytes);
    poison(d, bytes);
    return d;
}

// Host copy of a device buffer (waits for the queued work).
static void *hget(const void *d, size_t bytes)
{
    void *h = lb_malloc(bytes ? bytes : 1);
    dev->download(dev, h, d, bytes);
    return h;
}

// Host copy of a buffer of backend be (the CPU's or the device's).
static void *hget_be(lb_backend *be, const void *p, size_t bytes)
{
    void *h = lb_malloc(bytes ? bytes : 1);
    be->download(be, h, p, bytes);
    return h;
}

static void dfree(void *d) { dev->free(dev, d); }

// Bytes of a bf16 copy of (rows, cols) values in to_bf16's layout (rows padded to 8).
static size_t bytes16(size_t rows, int cols) { return rows * (size_t)((cols + 7) / 8 * 8) * 2; }

// x (rows, cols) rounded to bf16 in to_bf16's layout (host memory): an op's bf16 input, as an
// expert GEMM's c16 holds it.
static uint16_t *host16(const float *x, size_t rows, int cols)
{
    const int ld = (cols + 7) / 8 * 8;
    uint16_t *h = lb_malloc(bytes16(rows, cols));
    for (size_t r = 0; r < rows; r++) lb_bf16_row(h + r * ld, x + r * cols, cols, ld);
    return h;
}

// sum (a - ref)^2 / sum ref^2; infinite when anything is not finite (NaN never passes).
static double nmse(const float *a, const float *ref, size_t n)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(a[i]) || !isfinite(ref[i])) return INFINITY;
        double d = (double)a[i] - ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
    }
    return den > 0.0 ? num / den : num;
}

static size_t count_bit_diffs(const void *a, const void *b, size_t n4)
{
    size_t diff = 0;
    const char *x = a, *y = b;
    for (size_t i = 0; i < n4; i++) diff += memcmp(x + 4 * i, y + 4 * i, 4) != 0;
    return diff;
}

#define CHECK_NMSE(what, gpu_h, cpu_h, n, bound)                                              \
    do {                                                                                      \
        double e_ = nmse((gpu_h), (cpu_h), (n));                                              \
        if (verbose())                                                                        \
            printf("  %-44s nmse %-10.3g (bound %.0e), %zu of %zu bits differ\n", (what), e_, \
                   (double)(bound), count_bit_diffs((gpu_h), (cpu_h), (n)), (size_t)(n));     \
        ck_assert_msg(e_ <= (bound), "%s: nmse %.3g > %.3g (seed %llu)", (what), e_,          \
                      (double)(bound), (unsigned long long)seed);                             \
    } while (0)

#define CHECK_BITS(what, a, b, bytes)                                                         \
    do {                                                                                      \
        int same_ = memcmp((a), (b), (bytes)) == 0;                                           \
        if (verbose()) printf("  %-44s %s\n", (what), same_ ? "bitwise equal" : "DIFFER");   \
        ck_assert_msg(same_, "%s: results differ bitwise (seed %llu)", (what),               \
                      (unsigned long long)seed);                                              \
    } while (0)

#define CHECK_INTS(what, a, b, n)                                                             \
    do {                                                                                      \
        for (size_t i_ = 0; i_ < (size_t)(n); i_++)                                           \
            ck_assert_msg((a)[i_] == (b)[i_], "%s: element %zu is %d, want %d (seed %llu)",   \
                          (what), i_, (int)(a)[i_], (int)(b)[i_], (unsigned long long)seed);  \
        if (verbose()) printf("  %-44s equal\n", (what));                                    \
    } while (0)

// Checks an op's bf16 copy c16 (device) of its own fp32 output x (host, rows x cols): to_bf16's
// bits (lb_f32_to_bf16), the padding zeros.
static void check_copy16(const char *what, const void *c16, const float *x, size_t rows, int cols)
{
    const int ld = (cols + 7) / 8 * 8;
    uint16_t *got = hget(c16, bytes16(rows, cols)), *want = lb_malloc(bytes16(rows, cols));
    for (size_t r = 0; r < rows; r++) lb_bf16_row(want + r * ld, x + r * cols, cols, ld);
    CHECK_BITS(what, got, want, bytes16(rows, cols));
    free(got), free(want);
}

// --- sample -----------------------------------------------------------------------------------

// n rows of v logits of several kinds (kind 1: many ties; 2: -inf entries; 3: NaN and -0;
// 4: a wide range, -inf and one +inf), the random rows' counters some negative (prompt rows),
// under every top-k / top-p pair given: the GPU's tokens and done flags equal the CPU's.
static const int SAMPLE_K[][6] = {{0, 1, 2, 50, 1000, 1001}, {0, 1, 20}};
static const float SAMPLE_P[4] = {1.0f, 0.95f, 0.5f, 1e-9f};

// p: n, v, kind, the top-k list (SAMPLE_K), how many of its values, how many top-p values
static void sample_case(const test_case *tst)
{
    const int n = tst->p[0], v = tst->p[1], kind = tst->p[2], nk = tst->p[4], np = tst->p[5];
    const int *ks = SAMPLE_K[tst->p[3]];
    const float *ps = SAMPLE_P;
    float *l = randn((size_t)n * v, 3.0f);
    for (size_t i = 0; i < (size_t)n * v; i++) {
        size_t j = i % (size_t)v;
        if (kind == 1) l[i] = floorf(l[i]);
        if (kind == 2 && j % 7 == 3) l[i] = -INFINITY;
        if (kind == 3 && j % 5 == 1) l[i] = NAN;
        if (kind == 3 && j % 11 == 2) l[i] = -0.0f;
        if (kind == 4) l[i] = j % 3 ? -INFINITY : 20.0f * l[i];
    }
    if (kind == 4) l[(size_t)(n / 2) * v + v / 2] = INFINITY;
    lb_sample_row *rows = lb_malloc((size_t)n * sizeof *rows);
    for (int i = 0; i < n; i++)
        rows[i] = (lb_sample_row){seed, lb_rand_u64(seed, 77, i), i % 9 == 4 ? -1 : i % 13};
    float *L = dput(l, (size_t)n * v * 4);
    lb_sample_row *R = dput(rows, (size_t)n * sizeof *rows);
    int32_t *want = lb_malloc((size_t)n * 8), *T = dpoisoned((size_t)n * 8);
    for (int a = 0; a < nk; a++)
        for (int b = 0; b < np; b++) {
            lb_sample_args sa = {NULL, NULL, NULL, NULL, n, v, ks[a], ps[b], 7, 2, {0}};
            sa.stop[0] = 3, sa.stop[1] = v - 1;
            sa.logits = l, sa.rows = rows, sa.token = want, sa.done = want + n;
            cpu->sample(cpu, &sa);
            sa.logits = L, sa.rows = R, sa.token = T, sa.done = T + n;
            dev->sample(dev, &sa);
            int32_t *got = hget(T, (size_t)n * 8);
            char what[96];
            snprintf(what, sizeof what, "sample n %d v %d kind %d top_k %d top_p %g", n, v, kind,
                     ks[a], (double)ps[b]);
            CHECK_INTS(what, got, want, 2 * (size_t)n);
            free(got);
        }
    dfree(L), dfree(R), dfree(T);
    free(l), free(rows), free(want);
}

// --- table and memory ------------------------------------------------------------------------

static void table_and_memory_case(const test_case *tst)
{
    ck_assert_str_eq(dev->name, "cuda");
    ck_assert_int_eq(dev->deterministic, 1);   // the table's default
    for (int op = 0; op < LB_OP_COUNT; op++)
        ck_assert_msg(lb_backend_supports(dev, op), "cuda lacks op %s", lb_op_name(op));

    enum { BYTES = 1001 };
    unsigned char host[BYTES], back[BYTES];
    unsigned char *p = dev->alloc(dev, BYTES), *q = dev->alloc(dev, BYTES);
    dev->download(dev, back, p, BYTES);
    for (size_t i = 0; i < BYTES; i++) ck_assert_msg(back[i] == 0, "alloc is not zero-filled");
    for (size_t i = 0; i < BYTES; i++) host[i] = (unsigned char)(lb_rand_u64(seed, 0, i) | 1);
    dev->upload(dev, p, host, BYTES);
    dev->copy(dev, q, p, BYTES);
    dev->sync(dev);
    dev->download(dev, back, q, BYTES);
    ck_assert(memcmp(host, back, BYTES) == 0);
    dev->zero(dev, q + 10, 20);
    dev->download(dev, back, q, BYTES);
    for (size_t i = 0; i < BYTES; i++)
        ck_assert(back[i] == (i >= 10 && i < 30 ? 0 : host[i]));
    // Overlapping copies behave as memmove, in both directions.
    dev->copy(dev, p + 7, p, 500);
    dev->download(dev, back, p, BYTES);
    ck_assert(memcmp(back + 7, host, 500) == 0 && memcmp(back, host, 7) == 0);
    dev->upload(dev, p, host, BYTES);
    dev->copy(dev, p, p + 7, 500);
    dev->download(dev, back, p, BYTES);
    ck_assert(memcmp(back, host + 7, 500) == 0 && memcmp(back + 500, host + 500, BYTES - 500) == 0);
    dev->free(dev, p);
    dev->free(dev, q);
    dev->free(dev, dev->alloc(dev, 0));   // a zero-byte buffer is valid and freeable
    // host_alloc: zero-filled host memory (pinned) that upload and download take
    unsigned char *h = dev->host_alloc(dev, BYTES);
    p = dev->alloc(dev, BYTES);
    for (size_t i = 0; i < BYTES; i++) ck_assert_msg(h[i] == 0, "host_alloc is not zero-filled");
    memcpy(h, host, BYTES);
    dev->upload(dev, p, h, BYTES);
    memset(h, 0, BYTES);
    dev->download(dev, h, p, BYTES);
    ck_assert(memcmp(h, host, BYTES) == 0);
    dev->free(dev, p);
    dev->host_free(dev, h);
    dev->host_free(dev, dev->host_alloc(dev, 0));

    char err[160];
    ck_assert_ptr_null(lb_backend_cuda_create(1 << 20, err, sizeof err));
    ck_assert_msg(strstr(err, "does not exist") != NULL, "bad device message: %s", err);
}

// --- graphs ----------------------------------------------------------------------------------

typedef struct {
    float *x, *y, *a, *b, *c;   // x += y, then c (m, n) = a (m, k) b (n, k)^T
    int n, m, nn, k;
} graph_work;

static void graph_fn(void *p)
{
    const graph_work *w = p;
    dev->add(dev, w->x, w->y, (size_t)w->n);
    lb_gemm_bf16(dev, 0, 1, w->m, w->nn, w->k, 1.0f, w->a, w->b, 0.0f, w->c);
}

// graph_record runs fn once; each launch runs its operations again, the eager calls' bits; a
// launch after an allocation queues nothing on CUDA (its buffers may have moved) and says so.
static void graph_case(const test_case *tst)
{
    const int n = tst->p[0], m = tst->p[1], nn = tst->p[2], k = tst->p[3];
    float *x = randn(n, 1), *y = randn(n, 1), *a = randn((size_t)m * k, 1);
    float *b = randn((size_t)nn * k, 1);
    graph_work g = {dput(x, n * 4), dput(y, n * 4), dput(a, (size_t)m * k * 4),
                    dput(b, (size_t)nn * k * 4), dpoisoned((size_t)m * nn * 4), n, m, nn, k};
    graph_work e = g;   // the eager twin, on buffers of its own
    e.x = dput(x, n * 4), e.c = dpoisoned((size_t)m * nn * 4);
    struct lb_graph *r = dev->graph_record(dev, graph_fn, &g);
    graph_fn(&e);
    const char *off = getenv("LB_CUDA_GRAPHS"), *sync = getenv("LB_CUDA_SYNC");
    if (!r)   // only where switched off
        ck_assert_msg((off && *off == '0') || (sync && *sync && *sync != '0'),
                      "graph_record recorded nothing");
    for (int i = 0; r && i < 2; i++) {
        ck_assert(dev->graph_launch(dev, r));
        graph_fn(&e);
    }
    float *gx = hget(g.x, n * 4), *ex = hget(e.x, n * 4);
    float *gc = hget(g.c, (size_t)m * nn * 4), *ec = hget(e.c, (size_t)m * nn * 4);
    ck_assert_msg(memcmp(gx, ex, n * 4) == 0, "replayed add differs from the eager one");
    ck_assert_msg(memcmp(gc, ec, (size_t)m * nn * 4) == 0, "replayed gemm differs");
    for (int i = 0; i < n; i++)
        ck_assert(gx[i] == (r ? ((x[i] + y[i]) + y[i]) + y[i] : x[i] + y[i]));
    free(ex), free(gc), free(ec);
    if (!r) goto done;
    void *moved = dev->alloc(dev, 64);
    if (!strcmp(dev->name, "cuda")) {
        ck_assert_msg(!dev->graph_launch(dev, r), "a launch after an allocation ran");
        float *h = hget(g.x, n * 4);
        ck_assert_msg(memcmp(h, gx, n * 4) == 0, "a refused launch changed x");
        free(h);
    }
    dfree(moved);
    dev->graph_free(dev, r);
done:
    free(gx);
    dfree(g.x), dfree(g.y), dfree(g.a), dfree(g.b), dfree(g.c), dfree(e.x), dfree(e.c);
    free(x), free(y), free(a), free(b);
}

// --- GEMM ------------------------------------------------------------------------------------

// One GEMM on both backends (and twice on the GPU), C starting from c0 (beta != 0) or from
// poison (beta == 0: cuBLASLt must not read C).
static void gemm_one(int ta, int tb, int m, int n, int k, float alpha, float beta, int det,
                     double bound)
{
    size_t sa = (size_t)m * k, sb = (size_t)k * n, sc = (size_t)m * n;
    float *a = randn(sa, 1), *b = randn(sb, 1), *c0 = randn(sc, 1);
    float *ref = hdup(c0, sc * 4);
    lb_gemm(cpu, ta, tb, m, n, k, alpha, a, b, beta, ref);
    float *da = dput(a, sa * 4), *db = dput(b, sb * 4), *dc = dev->alloc(dev, sc * 4);
    float *out[2];
    dev->deterministic = det;
    for (int r = 0; r < 2; r++) {
        if (beta == 0.0f) poison(dc, sc * 4);
        else dev->upload(dev, dc, c0, sc * 4);
        lb_gemm(dev, ta, tb, m, n, k, alpha, da, db, beta, dc);
        out[r] = hget(dc, sc * 4);
    }
    dev->deterministic = 1;
    char what[128];
    snprintf(what, sizeof what, "gemm %s ta %d tb %d m %d n %d k %d b %g",
             det ? "det" : "heur", ta, tb, m, n, k, beta);
    CHECK_NMSE(what, out[0], ref, sc, bound);
    // Run-to-run equality is promised in deterministic mode only; the heuristic path is
    // reported when it differs.
    int same = memcmp(out[0], out[1], sc * 4) == 0;
    if (!det && !same) printf("  %s: two runs differ (heuristic mode, not promised)\n", what);
    ck_assert_msg(!det || same, "%s: two runs differ", what);
    dfree(da), dfree(db), dfree(dc);
    free(a), free(b), free(c0), free(ref), free(out[0]), free(out[1]);
}

// p: ta, tb, m, n, k, det; f: alpha, beta
static void gemm_case(const test_case *tst)
{
    const int *p = tst->p;
    gemm_one(p[0], p[1], p[2], p[3], p[4], tst->f[0], tst->f[1], p[5], tst->bound);
}

// p: m, n, k, each transpose in both modes, alpha 0.7 with beta 0.3 and alpha 1 with beta 0
static void gemm_shape_case(const test_case *tst)
{
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++)
            for (int det = 1; det >= 0; det--) {
                const int *p = tst->p;
                gemm_one(ta, tb, p[0], p[1], p[2], 0.7f, 0.3f, det, tst->bound);
                gemm_one(ta, tb, p[0], p[1], p[2], 1.0f, 0.0f, det, tst->bound);
            }
}

// A CUDA backend of its own, created with the environment switches set ("VAR=VALUE", up to
// two; NULL for none).
static lb_backend *cuda_with(const char *set1, const char *set2)
{
    char err[256], var[2][64];
    const char *set[2] = {set1, set2};
    for (int i = 0; i < 2; i++) {
        if (!set[i]) continue;
        const char *eq = strchr(set[i], '=');
        snprintf(var[i], sizeof var[i], "%.*s", (int)(eq - set[i]), set[i]);
        setenv(var[i], eq + 1, 1);
    }
    lb_backend *be = lb_backend_cuda_create(0, err, sizeof err);
    for (int i = 0; i < 2; i++)
        if (set[i]) unsetenv(var[i]);
    ck_assert_msg(be != NULL, "%s", err);
    return be;
}

// GEMMs of operands rounded to bf16 (lb_gemm_args.bf16; fp32 inputs, each backend rounds)
// on each CUDA path (a backend of its own each): gemm_grouped.cu's wgmma kernel (the default
// on sm_90), cuBLASLt's bf16 tensor cores
// (LB_CUDA_DENSE_TC=0), the fp32 GEMM of rounded copies (LB_CUDA_BF16=0): against the CPU,
// every transpose, sizes that are not multiples of 8 (the padded leading dimensions), beta 0
// and 1; run twice alike in deterministic mode, and one row alone equal to the same row among
// 300. The last shape's wgrad (ta 1, tb 0: 4 tiles, k 2200) is split in two slices of k on the
// wgmma kernel (gt_split). Each GEMM once more from the operands' bf16 copies alone (a and b
// NULL: lb_gemm_args.a16, .b16), as an expert layer's ops leave them.
// On a CUDA backend of its own, made with the switches env names.
static void gemm_bf16_case(const test_case *tst)
{
    lb_backend *tc = cuda_with(tst->env[0], tst->env[1]);
    const int shapes[][3] = {{37, 29, 53}, {1, 300, 257}, {129, 77, 300}, {300, 53, 1029},
                             {129, 300, 2200}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++)
                for (int bi = 0; bi < 2; bi++) {
                    int m = shapes[si][0], n = shapes[si][1], k = shapes[si][2];
                    float beta = (float)bi;
                    size_t sa = (size_t)m * k, sb = (size_t)k * n, sc = (size_t)m * n;
                    float *a = randn(sa, 1), *b = randn(sb, 1), *c0 = randn(sc, 1);
                    float *ra = hdup(a, sa * 4), *rb = hdup(b, sb * 4);
                    cpu->round_bf16(cpu, ra, a, sa);
                    cpu->round_bf16(cpu, rb, b, sb);
                    float *ref = hdup(c0, sc * 4), *ref_r = hdup(c0, sc * 4);
                    lb_gemm_bf16(cpu, ta, tb, m, n, k, 1.0f, a, b, beta, ref);
                    lb_gemm(cpu, ta, tb, m, n, k, 1.0f, ra, rb, beta, ref_r);
                    ck_assert_msg(memcmp(ref, ref_r, sc * 4) == 0,
                                  "cpu gemm bf16: not the GEMM of the rounded operands");
                    float *da = tc->alloc(tc, sa * 4), *db = tc->alloc(tc, sb * 4);
                    float *dc = tc->alloc(tc, sc * 4);
                    tc->upload(tc, da, a, sa * 4);
                    tc->upload(tc, db, b, sb * 4);
                    float *out[2];
                    for (int r = 0; r < 2; r++) {
                        tc->upload(tc, dc, c0, sc * 4);
                        lb_gemm_bf16(tc, ta, tb, m, n, k, 1.0f, da, db, beta, dc);
                        out[r] = lb_malloc(sc * 4);
                        tc->download(tc, out[r], dc, sc * 4);
                    }
                    char what[128];
                    snprintf(what, sizeof what, "gemm bf16 ta %d tb %d m %d n %d k %d b %g", ta,
                             tb, m, n, k, beta);
                    CHECK_NMSE(what, out[0], ref, sc, tst->bound);
                    ck_assert_msg(memcmp(out[0], out[1], sc * 4) == 0, "%s: two runs differ", what);
                    // A stored (m, k) or (k, m), B (k, n) or (n, k): copies in to_bf16's layout
                    const int ra_ = ta ? k : m, ca = ta ? m : k, rb_ = tb ? n : k, cb = tb ? k : n;
                    uint16_t *a16 = tc->alloc(tc, (size_t)ra_ * ((ca + 7) / 8 * 8) * 2);
                    uint16_t *b16 = tc->alloc(tc, (size_t)rb_ * ((cb + 7) / 8 * 8) * 2);
                    tc->to_bf16(tc, a16, da, ra_, ca, (ca + 7) / 8 * 8);
                    tc->to_bf16(tc, b16, db, rb_, cb, (cb + 7) / 8 * 8);
                    tc->upload(tc, dc, c0, sc * 4);
                    lb_gemm_args gc = {ta, tb, m, n, k, 1.0f, beta,
                                       NULL, NULL, dc, 1, b16, a16, NULL};
                    tc->gemm(tc, &gc);
                    tc->download(tc, out[1], dc, sc * 4);
                    strncat(what, ", copies alone", sizeof what - strlen(what) - 1);
                    CHECK_NMSE(what, out[1], ref, sc, tst->bound);
                    tc->free(tc, a16), tc->free(tc, b16);
                    tc->free(tc, da), tc->free(tc, db), tc->free(tc, dc);
                    free(a), free(b), free(c0), free(ref), free(out[0]), free(out[1]);
                    free(ra), free(rb), free(ref_r);
                }
    // batch invariance of the fprop: row 17 alone against the same row among 300
    const int m = 300, k = 1029, n = 384, row = 17;
    float *x = randn((size_t)m * k, 1), *w = randn((size_t)n * k, 1);
    cpu->round_bf16(cpu, x, x, (size_t)m * k);
    cpu->round_bf16(cpu, w, w, (size_t)n * k);
    float *X = tc->alloc(tc, (size_t)m * k * 4), *W = tc->alloc(tc, (size_t)n * k * 4);
    float *Y = tc->alloc(tc, (size_t)m * n * 4), *Y1 = tc->alloc(tc, (size_t)n * 4);
    tc->upload(tc, X, x, (size_t)m * k * 4);
    tc->upload(tc, W, w, (size_t)n * k * 4);
    lb_gemm_bf16(tc, 0, 1, m, n, k, 1.0f, X, W, 0.0f, Y);
    lb_gemm_bf16(tc, 0, 1, 1, n, k, 1.0f, X + (size_t)row * k, W, 0.0f, Y1);
    float *ym = lb_malloc((size_t)m * n * 4), *y1 = lb_malloc((size_t)n * 4);
    tc->download(tc, ym, Y, (size_t)m * n * 4);
    tc->download(tc, y1, Y1, (size_t)n * 4);
    size_t diff = count_bit_diffs(ym + (size_t)row * n, y1, n);
    ck_assert_msg(diff == 0, "bf16 gemm: row %d alone differs from the same row among %d in %zu "
                  "of %d outputs", row, m, diff, n);
    tc->free(tc, X), tc->free(tc, W), tc->free(tc, Y), tc->free(tc, Y1);
    free(x), free(w), free(ym), free(y1);
    tc->destroy(tc);
}

// No product (k == 0 or alpha == 0): C = beta C, beta 0 overwriting NaN; m == 0 touches nothing.
static void gemm_edges_case(const test_case *tst)
{
    const int m = 23, n = 31;
    size_t sc = (size_t)m * n;
    float *c0 = randn(sc, 1);
    float *dc = dpoisoned(sc * 4);
    lb_gemm(dev, 0, 1, m, n, 0, 1.0f, NULL, NULL, 0.0f, dc);
    float *h = hget(dc, sc * 4);
    for (size_t i = 0; i < sc; i++) ck_assert_msg(h[i] == 0.0f, "k == 0, beta 0 must zero C");
    free(h);
    dev->upload(dev, dc, c0, sc * 4);
    lb_gemm(dev, 0, 1, m, n, 0, 1.0f, NULL, NULL, 1.0f, dc);
    h = hget(dc, sc * 4);
    CHECK_BITS("gemm k == 0, beta 1 leaves C", h, c0, sc * 4);
    free(h);
    float *da = dput(c0, sc * 4);
    lb_gemm(dev, 0, 1, m, n, 7, 0.0f, da, da, 2.0f, dc);   // alpha 0: C = 2 C
    h = hget(dc, sc * 4);
    for (size_t i = 0; i < sc; i++) ck_assert(h[i] == 2.0f * c0[i]);
    free(h);
    lb_gemm(dev, 0, 1, 0, n, 5, 1.0f, NULL, NULL, 0.0f, NULL);   // m == 0: nothing touched
    dev->sync(dev);
    dfree(dc), dfree(da), free(c0);
}

// One call for several experts: an ordinary group, an expert with no tokens (its C untouched),
// one whose inner size is 0 (C zeroed, NaN included) and a transposed, accumulating wgrad.
static void gemm_grouped_case(const test_case *tst)
{
    const int n = 19, k = 27, m0 = 11, m3 = 13;
    float *a0 = randn((size_t)m0 * k, 1), *w = randn((size_t)n * k, 1);
    float *a3 = randn((size_t)m3 * n, 1), *b3 = randn((size_t)m3 * k, 1);
    float *c3_0 = randn((size_t)n * k, 1), sentinel[4] = {1, 2, 3, 4};
    float *ref0 = lb_calloc((size_t)m0 * n, 4), *ref3 = hdup(c3_0, (size_t)n * k * 4);
    lb_gemm(cpu, 0, 1, m0, n, k, 1.0f, a0, w, 0.0f, ref0);
    lb_gemm(cpu, 1, 0, n, k, m3, 0.5f, a3, b3, 1.0f, ref3);

    float *da0 = dput(a0, (size_t)m0 * k * 4), *dw = dput(w, (size_t)n * k * 4);
    float *da3 = dput(a3, (size_t)m3 * n * 4), *db3 = dput(b3, (size_t)m3 * k * 4);
    float *dc0 = dpoisoned((size_t)m0 * n * 4), *dsent = dput(sentinel, sizeof sentinel);
    float *dc2 = dpoisoned((size_t)5 * n * 4), *dc3 = dput(c3_0, (size_t)n * k * 4);
    lb_gemm_args g[4] = {
        {0, 1, m0, n, k, 1.0f, 0.0f, da0, dw, dc0, 0, NULL, NULL, NULL},       // fprop
        {0, 1, 0, n, k, 1.0f, 0.0f, NULL, dw, dsent, 0, NULL, NULL, NULL},     // no tokens
        {0, 1, 5, n, 0, 1.0f, 0.0f, NULL, NULL, dc2, 0, NULL, NULL, NULL},     // empty inner dim
        {1, 0, n, k, m3, 0.5f, 1.0f, da3, db3, dc3, 0, NULL, NULL, NULL},      // wgrad, adding
    };
    dev->gemm_grouped(dev, 4, g);
    dev->gemm_grouped(dev, 0, NULL);   // nothing to do
    float *c0 = hget(dc0, (size_t)m0 * n * 4), *c2 = hget(dc2, (size_t)5 * n * 4);
    float *c3 = hget(dc3, (size_t)n * k * 4), *sent = hget(dsent, sizeof sentinel);
    CHECK_NMSE("gemm_grouped group 0", c0, ref0, (size_t)m0 * n, B_ACCUM);
    CHECK_NMSE("gemm_grouped group 3 (wgrad, beta 1)", c3, ref3, (size_t)n * k, B_ACCUM);
    CHECK_BITS("gemm_grouped m == 0 leaves C", sent, sentinel, sizeof sentinel);
    for (int i = 0; i < 5 * n; i++) ck_assert_msg(c2[i] == 0.0f, "k == 0 group not zeroed");
    dfree(da0), dfree(dw), dfree(da3), dfree(db3), dfree(dc0), dfree(dsent), dfree(dc2);
    dfree(dc3);
    free(a0), free(w), free(a3), free(b3), free(c3_0), free(ref0), free(ref3);
    free(c0), free(c2), free(c3), free(sent);
}

// The experts' rows for gemm_experts' cases: empty experts, experts of one row and one of more
// than two 128-row tiles among random counts of mean `mean`; *rows their sum.
static int *experts_counts(int e, int mean, int *rows)
{
    int *counts = lb_malloc((size_t)e * sizeof(int));
    *rows = 0;
    for (int j = 0; j < e; j++) {
        counts[j] = j % 5 == 2 ? 0 : j % 7 == 3 ? 1 : (int)(lb_rand_u64(7, 1, j) % (2 * mean));
        if (j == 1) counts[j] = 300;
        *rows += counts[j];
    }
    return counts;
}

// out[0] and out[1] (gemm_experts run twice) and out[2] (`other` on its groups), C (rows, n) in
// bf16 (c16) or fp32: the three bit for bit equal, out[0] against ref (fp32) within bound (1e-5
// for bf16). Frees out.
static void experts_check(const char *name, const char *other, void *const out[3], size_t cbytes,
                          int rows, int n, int c16, const float *ref, double bound)
{
    const int ln = (n + 7) / 8 * 8;
    const char *cn = c16 ? "c16" : "fp32";
    void *h[3];
    for (int r = 0; r < 3; r++) h[r] = hget(out[r], cbytes);
    char what[160];
    snprintf(what, sizeof what, "%s %s: run twice", name, cn);
    CHECK_BITS(what, h[0], h[1], cbytes);
    snprintf(what, sizeof what, "%s %s = %s", name, cn, other);
    CHECK_BITS(what, h[0], h[2], cbytes);
    float *got = lb_malloc((size_t)rows * n * 4);
    for (size_t i = 0; i < (size_t)rows; i++)
        for (int c = 0; c < n; c++)
            got[i * n + c] = c16 ? lb_bf16_to_f32(((uint16_t *)h[0])[i * ln + c])
                                 : ((float *)h[0])[i * n + c];
    snprintf(what, sizeof what, "%s %s vs cpu", name, cn);
    CHECK_NMSE(what, got, ref, (size_t)rows * n, c16 ? 1e-5 : bound);
    for (int r = 0; r < 3; r++) dfree(out[r]), free(h[r]);
    free(got);
}

// gemm_experts: an MoE layer's bf16 fprop with the rows per expert in backend memory, p: e,
// n, k, c16 (a bf16 C), mean rows an expert. The counts hold empty experts, experts of one row
// and one of more than two 128-row tiles. Against the CPU (the same groups through
// gemm_grouped), and bit for bit against the device's own gemm_grouped on those groups, run
// twice, with C16 or fp32 C.
static void gemm_experts_case(const test_case *tst)
{
    const int e = tst->p[0], n = tst->p[1], k = tst->p[2], c16 = tst->p[3], mean = tst->p[4];
    int rows, *counts = experts_counts(e, mean, &rows);
    float *a = randn((size_t)rows * k, 1), *b = randn((size_t)e * n * k, 1);
    uint16_t *a16 = host16(a, rows, k), *b16 = host16(b, (size_t)e * n, k);
    size_t cbytes = c16 ? bytes16(rows, n) : (size_t)rows * n * 4;
    lb_gemm_experts_args x = {a16, b16, NULL, NULL, counts, e, rows, n, k, NULL, NULL};
    float *ref = lb_malloc((size_t)rows * n * 4);
    x.c = ref;
    cpu->gemm_experts(cpu, &x);   // fp32 C: the reference either way
    uint16_t *A = dput(a16, bytes16(rows, k)), *B = dput(b16, bytes16((size_t)e * n, k));
    int *C = dput(counts, (size_t)e * sizeof(int));
    void *out[3];
    for (int r = 0; r < 3; r++) {   // gemm_experts twice, then gemm_grouped on its groups
        out[r] = dpoisoned(cbytes);
        lb_gemm_experts_args xd = {A, B, c16 ? NULL : out[r], c16 ? out[r] : NULL, C, e, rows, n,
                                   k, NULL, NULL};
        if (r < 2) {
            dev->gemm_experts(dev, &xd);
        } else {
            lb_gemm_args *g = lb_experts_groups(&xd, counts);
            dev->gemm_grouped(dev, e, g);
            free(g);
        }
    }
    char name[64];
    snprintf(name, sizeof name, "gemm_experts e %d n %d k %d", e, n, k);
    experts_check(name, "gemm_grouped", out, cbytes, rows, n, c16, ref, tst->bound);
    dfree(A), dfree(B), dfree(C);
    free(counts), free(a), free(b), free(a16), free(b16), free(ref);
}

// Grouped bf16 GEMMs of fp32 inputs, as an expert layer issues them: the three passes over
// consecutive slices of one activation and consecutive weights, an expert without tokens
// among them, sizes that are not multiples of any tile and inner sizes longer than the
// kernel's ring of stages, against the CPU per group. On the default backend (the one-launch
// kernel on sm_90) the result is bit for bit each group computed alone and, for one row, that
// row alone; on a backend with LB_CUDA_GROUPED=0 LB_CUDA_GROUPED_STREAMS=1 (operands
// converted once, groups on several streams) it is bit for bit one gemm call per group.
// The three passes of an expert layer of G groups (counts[j] rows each, in -> out features) on
// gs, grouped, against the CPU, against each group alone (or one gemm call per group with
// streams) and one row of the last group alone.
// p: streams (1: a backend with LB_CUDA_GROUPED=0 LB_CUDA_GROUPED_STREAMS=1, compared with one
// gemm per group), in, out features; g: the groups' rows
static void grouped_bf16_case(const test_case *tst)
{
    const int streams = tst->p[0], in = tst->p[1], out = tst->p[2], G = tst->g.count;
    int counts[LB_TEST_MAX_GROUPS];
    group_rows(&tst->g, counts);
    lb_backend *gs = streams ? cuda_with("LB_CUDA_GROUPED_STREAMS=1", "LB_CUDA_GROUPED=0") : dev;
    int n = 0;
    for (int j = 0; j < G; j++) n += counts[j];
    size_t sx = (size_t)n * in, sy = (size_t)n * out, mat = (size_t)out * in, sw = G * mat;
    // fp32 inputs: the packing (transposing for dgrad and wgrad) must round them to bf16
    float *x = randn(sx, 1), *dy = randn(sy, 1), *w = randn(sw, 1), *dw0 = randn(sw, 1);
    float *X = dput(x, sx * 4), *DY = dput(dy, sy * 4), *W = dput(w, sw * 4);
    float *out_d[2][3];   // [grouped, per group][y, dx, dw]
    for (int r = 0; r < 2; r++) {
        out_d[r][0] = dpoisoned(sy * 4), out_d[r][1] = dpoisoned(sx * 4);
        out_d[r][2] = dput(dw0, sw * 4);
    }
    lb_gemm_args *g[3];
    for (int p = 0; p < 3; p++) g[p] = lb_calloc(G, sizeof *g[p]);
    float *yr = lb_calloc(sy, 4), *dxr = lb_calloc(sx, 4), *dwr = hdup(dw0, sw * 4);
    size_t off = 0;
    for (int j = 0; j < G; j++) {
        int m = counts[j];
        g[0][j] = (lb_gemm_args){0, 1, m, out, in, 1.0f, 0.0f, X + off * in, W + j * mat,
                                 out_d[0][0] + off * out, 1, NULL, NULL, NULL};
        g[1][j] = (lb_gemm_args){0, 0, m, in, out, 1.0f, 0.0f, DY + off * out, W + j * mat,
                                 out_d[0][1] + off * in, 1, NULL, NULL, NULL};
        g[2][j] = (lb_gemm_args){1, 0, out, in, m, 1.0f, 1.0f, DY + off * out, X + off * in,
                                 out_d[0][2] + j * mat, 1, NULL, NULL, NULL};
        if (m) {
            lb_gemm_bf16(cpu, 0, 1, m, out, in, 1.0f, x + off * in, w + j * mat, 0.0f,
                         yr + off * out);
            lb_gemm_bf16(cpu, 0, 0, m, in, out, 1.0f, dy + off * out, w + j * mat, 0.0f,
                         dxr + off * in);
            lb_gemm_bf16(cpu, 1, 0, out, in, m, 1.0f, dy + off * out, x + off * in, 1.0f,
                         dwr + j * mat);
        }
        off += (size_t)m;
    }
    dev->sync(dev);   // the buffers are the test backend's: its uploads and calls first
    for (int p = 0; p < 3; p++) gs->gemm_grouped(gs, G, g[p]);
    // dgrad and wgrad of each group side by side in one call, as lb_linear_grouped_bwd issues
    // them (one bf16 copy of dy serves both): the bits of the separate calls
    float *pair_dx = dpoisoned(sx * 4), *pair_dw = dput(dw0, sw * 4);
    lb_gemm_args *gp = lb_calloc(2 * G, sizeof *gp);
    for (int j = 0; j < G; j++) {
        gp[2 * j] = g[1][j], gp[2 * j + 1] = g[2][j];
        gp[2 * j].c = pair_dx + (g[1][j].c - out_d[0][1]);
        gp[2 * j + 1].c = pair_dw + (g[2][j].c - out_d[0][2]);
    }
    gs->gemm_grouped(gs, 2 * G, gp);
    free(gp);
    for (int j = 0; j < G; j++)
        for (int p = 0; p < 3; p++) {
            lb_gemm_args one = g[p][j];
            one.c = out_d[1][p] + (one.c - out_d[0][p]);
            if (streams) gs->gemm(gs, &one);
            else gs->gemm_grouped(gs, 1, &one);
        }
    // fprop of a middle row of the last group alone
    const size_t row = (size_t)(n - counts[G - 1]) + counts[G - 1] / 2;
    float *y1 = dpoisoned((size_t)out * 4);
    lb_gemm_args one = {0, 1, 1, out, in, 1.0f, 0.0f, X + row * in, W + (G - 1) * mat, y1, 1,
                        NULL, NULL, NULL};
    gs->gemm_grouped(gs, 1, &one);
    gs->sync(gs);
    const char *names[3] = {"fprop", "dgrad", "wgrad"};
    const float *refs[3] = {yr, dxr, dwr};
    const size_t sizes[3] = {sy, sx, sw};
    float *y_all = NULL, *pair[3] = {NULL, hget(pair_dx, sx * 4), hget(pair_dw, sw * 4)};
    dfree(pair_dx), dfree(pair_dw);
    for (int p = 0; p < 3; p++) {
        float *a = hget(out_d[0][p], sizes[p] * 4), *b = hget(out_d[1][p], sizes[p] * 4);
        char what[96];
        snprintf(what, sizeof what, "gemm_grouped bf16 %s (%d groups, %s)", names[p], G,
                 streams ? "streams" : "default");
        CHECK_NMSE(what, a, refs[p], sizes[p], tst->bound);
        snprintf(what, sizeof what, "gemm_grouped bf16 %s against %s", names[p],
                 streams ? "one gemm call per group" : "each group alone");
        CHECK_BITS(what, a, b, sizes[p] * 4);
        if (p > 0) {
            snprintf(what, sizeof what, "gemm_grouped bf16 %s, dgrad and wgrad in one call",
                     names[p]);
            CHECK_BITS(what, pair[p], a, sizes[p] * 4);
            free(pair[p]);
        }
        if (p == 0) y_all = a;
        else free(a);
        free(b);
        dfree(out_d[0][p]), dfree(out_d[1][p]);
    }
    float *y1h = hget(y1, (size_t)out * 4);
    CHECK_BITS("gemm_grouped bf16 one row alone", y1h, y_all + row * out, (size_t)out * 4);
    dfree(X), dfree(DY), dfree(W), dfree(y1);
    free(x), free(dy), free(w), free(dw0), free(yr), free(dxr), free(dwr), free(y_all), free(y1h);
    for (int p = 0; p < 3; p++) free(g[p]);
    if (streams) gs->destroy(gs);
}

// Expert GEMMs with a bf16 output (lb_gemm_args.c16) on each CUDA path: the wgmma kernel with
// its TMA-store epilogue (the default) and with gg_store16 (LB_CUDA_GG_TMA_STORE=0), cuBLASLt
// per group (LB_CUDA_GROUPED=0) and the fp32 GEMM of rounded copies (LB_CUDA_BF16=0), the last
// two rounding an fp32 C of their own. Groups fprop-like (transa 0, transb 1) and dgrad-like
// (0, 0: B read MN-major) of m 0, 1, 37, 1031, 200 and 5 (k 0), n 1536, 2048, 768, 1536, 101
// (odd: pad columns, a last column alone) and 13: all six in one call (128-column tiles; n 101
// keeps the launch off the TMA store: gg_store16), then the first four (256, TMA store). c16
// is bit for bit to_bf16's rounding of the same backend's fp32 C of the same call (c16 NULL),
// with c NULL, the pad columns and an empty group's c16 untouched; so is a call mixing c16 and
// fp32 groups (the TS kernel's branch per group, the C16 kernel's fp32 groups); and near the
// CPU's c16. One dense gemm (a group of one) alike: n 101 (gg_store16) and 1536 (TMA store).
static void gemm_grouped_c16_case(const test_case *tst)
{
    enum { NG = 6 };   // groups; index NG is the dense gemm
    // bf16 roundings of fp32 values B_ACCUM apart: now and then one falls the other way, one
    // bf16 ulp (2^-8 relative), and those flips dominate
    const double b_c16 = 1e-6;
    lb_backend *bes[4] = {dev, cuda_with("LB_CUDA_GG_TMA_STORE=0", NULL),
                          cuda_with("LB_CUDA_GROUPED=0", NULL), cuda_with("LB_CUDA_BF16=0", NULL)};
    const char *bname[4] = {"default", "gg_store16", "cuBLASLt", "fp32 of rounded copies"};
    for (int tb = 1; tb >= 0; tb--) {
        const int gm[NG + 1] = {0, 1, 37, 1031, 200, 5, tb ? 300 : 129};
        const int gn[NG + 1] = {1536, 2048, 768, 1536, 101, 13, tb ? 101 : 1536};
        const int gk[NG + 1] = {520, 520, 520, 520, 520, 0, tb ? 1029 : 520};
        const float ga[NG + 1] = {1.0f, 0.7f, 1.0f, 1.0f, -1.5f, 1.0f, 0.7f};
        float *a[NG + 1], *b[NG + 1], *da[NG + 1], *db[NG + 1], *ref[NG + 1];
        uint16_t *ref16[NG + 1];
        lb_gemm_args g[NG + 1];
        for (int j = 0; j <= NG; j++) {   // the inputs, the CPU's fp32 C and c16
            const size_t m = gm[j], n = gn[j], k = gk[j];
            a[j] = randn(m * k, 1), b[j] = randn(k * n, 1);
            da[j] = dput(a[j], m * k * 4), db[j] = dput(b[j], k * n * 4);
            ref[j] = lb_malloc(m * n * 4), ref16[j] = lb_malloc(bytes16(m, (int)n));
            g[j] = (lb_gemm_args){0, tb, (int)m, (int)n, (int)k, ga[j], 0.0f, a[j], b[j], ref[j],
                                  1, NULL, NULL, NULL};
        }
        cpu->gemm_grouped(cpu, NG, g);
        cpu->gemm(cpu, &g[NG]);
        for (int j = 0; j <= NG; j++) g[j].c = NULL, g[j].c16 = ref16[j];
        cpu->gemm_grouped(cpu, NG, g);
        cpu->gemm(cpu, &g[NG]);
        for (int j = 0; j <= NG; j++) {
            uint16_t *want = host16(ref[j], gm[j], gn[j]);
            for (size_t r = 0; r < (size_t)gm[j]; r++)   // the CPU leaves the pads: compare cols
                for (int c = 0; c < gn[j]; c++)
                    ck_assert_msg(ref16[j][r * ((gn[j] + 7) / 8 * 8) + c] ==
                                      want[r * ((gn[j] + 7) / 8 * 8) + c],
                                  "cpu c16: not to_bf16 of the fp32 C (group %d)", j);
            free(want);
        }
        for (int bi = 0; bi < 4; bi++)
            for (int set = 0; set < 2; set++) {
                lb_backend *be = bes[bi];
                const int cnt = set ? 4 : NG;   // 4: no n <= 128, so 256-column tiles
                // per group: fp32 C, c16 (16 bytes beyond: an empty group's is only those), and
                // the mixed call's (odd groups c16, even ones fp32)
                float *dc[NG + 1], *dxc[NG + 1];
                uint16_t *d16[NG + 1], *dx16[NG + 1];
                lb_gemm_args gd[3][NG + 1];
                for (int j = 0; j <= NG; j++) {
                    const size_t mn = (size_t)gm[j] * gn[j], b16 = bytes16(gm[j], gn[j]) + 16;
                    dc[j] = dpoisoned(mn * 4), dxc[j] = dpoisoned(mn * 4);
                    d16[j] = dpoisoned(b16), dx16[j] = dpoisoned(b16);
                    gd[0][j] = (lb_gemm_args){0, tb, gm[j], gn[j], gk[j], ga[j], 0.0f, da[j],
                                              db[j], dc[j], 1, NULL, NULL, NULL};
                    gd[1][j] = gd[0][j], gd[2][j] = gd[0][j];
                    gd[1][j].c = NULL, gd[1][j].c16 = d16[j];
                    if (j % 2) gd[2][j].c = NULL, gd[2][j].c16 = dx16[j];
                    else gd[2][j].c = dxc[j];
                }
                dev->sync(dev);   // the buffers are the test backend's: its uploads first
                for (int r = 0; r < 3; r++) {
                    be->gemm_grouped(be, cnt, gd[r]);
                    if (r < 2) be->gemm(be, &gd[r][NG]);
                }
                be->sync(be);
                for (int j = 0; j <= NG; j++) {
                    if (set && j >= cnt && j < NG) continue;
                    const int m = gm[j], n = gn[j], ld = (n + 7) / 8 * 8;
                    const size_t mn = (size_t)m * n, b16 = bytes16(m, n) + 16;
                    float *f = hget(dc[j], mn * 4);
                    uint16_t *h16 = hget(d16[j], b16), *want = lb_malloc(b16);
                    memset(want, 0xff, b16);   // the poison: pads and the 16 bytes beyond
                    for (size_t r = 0; r < (size_t)m; r++)
                        for (int c = 0; c < n; c++) want[r * ld + c] = lb_f32_to_bf16(f[r * n + c]);
                    char what[128];
                    snprintf(what, sizeof what, "c16 %s %s %d/%d (m %d n %d k %d) fp32", bname[bi],
                             tb ? "fprop" : "dgrad", j, cnt, m, n, gk[j]);
                    CHECK_NMSE(what, f, ref[j], mn, B_ACCUM);
                    snprintf(what, sizeof what, "c16 %s %s %d/%d (m %d n %d) to_bf16 of fp32",
                             bname[bi], tb ? "fprop" : "dgrad", j, cnt, m, n);
                    for (size_t e = 0; e < b16 / 2; e++)   // where, if anywhere
                        if (h16[e] != want[e]) {
                            printf("  %s: row %zu col %zu is 0x%04x, want 0x%04x\n", what,
                                   e / ld, e % ld, h16[e], want[e]);
                            break;
                        }
                    CHECK_BITS(what, h16, want, b16);
                    float *w16 = lb_malloc(mn * 4), *wref = lb_malloc(mn * 4);
                    for (size_t r = 0; r < (size_t)m; r++)
                        for (int c = 0; c < n; c++) {
                            w16[r * n + c] = lb_bf16_to_f32(h16[r * ld + c]);
                            wref[r * n + c] = lb_bf16_to_f32(ref16[j][r * ld + c]);
                        }
                    snprintf(what, sizeof what, "c16 %s %s %d/%d (m %d n %d) vs cpu c16",
                             bname[bi], tb ? "fprop" : "dgrad", j, cnt, m, n);
                    CHECK_NMSE(what, w16, wref, mn, b_c16);
                    if (j < NG) {   // the mixed call
                        snprintf(what, sizeof what, "c16 %s %s %d/%d (m %d n %d) mixed call",
                                 bname[bi], tb ? "fprop" : "dgrad", j, cnt, m, n);
                        if (j % 2) {
                            uint16_t *x16 = hget(dx16[j], b16);
                            CHECK_BITS(what, x16, want, b16);
                            free(x16);
                        } else {
                            float *xf = hget(dxc[j], mn * 4);
                            CHECK_BITS(what, xf, f, mn * 4);
                            free(xf);
                        }
                    }
                    free(f), free(h16), free(want), free(w16), free(wref);
                }
                for (int j = 0; j <= NG; j++)
                    dfree(dc[j]), dfree(dxc[j]), dfree(d16[j]), dfree(dx16[j]);
            }
        for (int j = 0; j <= NG; j++) {
            dfree(da[j]), dfree(db[j]);
            free(a[j]), free(b[j]), free(ref[j]), free(ref16[j]);
        }
    }
    for (int bi = 1; bi < 4; bi++) bes[bi]->destroy(bes[bi]);
}

// --- elementwise and sumsq -------------------------------------------------------------------

static void add_scale_sumsq_case(const test_case *tst)
{
    const size_t n = 100003;
    float *x = randn(n, 1), *y0 = randn(n, 1);
    float *yc = hdup(y0, n * 4);
    cpu->add(cpu, yc, x, n);
    float *dx = dput(x, n * 4), *dy = dput(y0, n * 4);
    dev->add(dev, dy, dx, n);
    float *yg = hget(dy, n * 4);
    CHECK_BITS("add (one fp32 addition per element)", yg, yc, n * 4);
    cpu->scale(cpu, yc, -1.75f, n);
    dev->scale(dev, dy, -1.75f, n);
    free(yg);
    yg = hget(dy, n * 4);
    CHECK_BITS("scale (one fp32 multiply per element)", yg, yc, n * 4);
    // f64_to_f32: one rounding each, wide values and ties included (random doubles with 40
    // bits below float precision, their float neighbours' midpoints, huge ones that overflow)
    double *w = lb_malloc(n * sizeof(double));
    for (size_t i = 0; i < n; i++)
        w[i] = i % 3 == 0 ? (double)x[i] * (1.0 + 1e-9 * (double)i)
               : i % 3 == 1 ? ((double)x[i] + (double)nextafterf(x[i], INFINITY)) / 2
                            : (double)x[i] * 1e39;
    double *dw = dev->alloc(dev, n * sizeof(double));
    dev->upload(dev, dw, w, n * sizeof(double));
    cpu->f64_to_f32(cpu, yc, w, n);
    dev->f64_to_f32(dev, dy, dw, n);
    free(yg);
    yg = hget(dy, n * 4);
    CHECK_BITS("f64_to_f32 (one rounding per element)", yg, yc, n * 4);
    dfree(dw), free(w);

    // Relative 1e-12: both sides add exact double squares in double, in different orders.
    const size_t sizes[] = {1, 4095, 4096, 100003, 10000019};
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        size_t nn = sizes[si];
        float *v = randn(nn, 1);
        float *dv = dput(v, nn * 4);
        double c = cpu->sumsq(cpu, v, nn), g1 = dev->sumsq(dev, dv, nn);
        double g2 = dev->sumsq(dev, dv, nn);
        double rel = fabs(g1 - c) / c;
        if (verbose()) printf("  sumsq n %-10zu rel err %.3g (bound 1e-12)\n", nn, rel);
        ck_assert_msg(isfinite(g1) && rel <= 1e-12, "sumsq n %zu: %.17g vs %.17g", nn, g1, c);
        ck_assert_msg(memcmp(&g1, &g2, sizeof g1) == 0, "sumsq n %zu: two runs differ", nn);
        if (nn == 1) ck_assert(g1 == (double)v[0] * v[0]);
        dfree(dv), free(v);
    }
    ck_assert(dev->sumsq(dev, dx, 0) == 0.0);
    dfree(dx), dfree(dy), free(x), free(y0), free(yc), free(yg);
}

// --- embedding -------------------------------------------------------------------------------

// p: vocab, n, c
static void embedding_case(const test_case *tst)
{
    const int vocab = tst->p[0], n = tst->p[1], c = tst->p[2];
    int32_t *tok = randint(n, 0, vocab);
    float *wte = randn((size_t)vocab * c, 1), *ref = lb_malloc((size_t)n * c * 4);
    cpu->embedding_fwd(cpu, ref, tok, wte, n, c);
    int32_t *dtok = dput(tok, (size_t)n * 4);
    float *dwte = dput(wte, (size_t)vocab * c * 4), *dout = dev->alloc(dev, (size_t)n * c * 4);
    char what[96];
    for (int r = 0; r < 2; r++) {
        poison(dout, (size_t)n * c * 4);
        dev->embedding_fwd(dev, dout, dtok, dwte, n, c);
        float *out = hget(dout, (size_t)n * c * 4);
        snprintf(what, sizeof what, "embedding_fwd vocab %d n %d c %d (copy)", vocab, n, c);
        CHECK_BITS(what, out, ref, (size_t)n * c * 4);
        free(out);
    }
    // Backward, accumulating onto random values; the GPU adds each token's rows in index order
    // in fp32, the CPU's exact sequence of operations, so the bits must match.
    float *g = randn((size_t)n * c, 1), *dw0 = randn((size_t)vocab * c, 1);
    float *dwref = hdup(dw0, (size_t)vocab * c * 4);
    cpu->embedding_bwd(cpu, dwref, g, tok, n, c);
    float *dg = dput(g, (size_t)n * c * 4), *ddw = dev->alloc(dev, (size_t)vocab * c * 4);
    for (int r = 0; r < 2; r++) {
        dev->upload(dev, ddw, dw0, (size_t)vocab * c * 4);
        dev->embedding_bwd(dev, ddw, dg, dtok, n, c);
        float *dw = hget(ddw, (size_t)vocab * c * 4);
        snprintf(what, sizeof what, "embedding_bwd vocab %d n %d c %d (+=)", vocab, n, c);
        CHECK_BITS(what, dw, dwref, (size_t)vocab * c * 4);
        free(dw);
    }
    dfree(dtok), dfree(dwte), dfree(dout), dfree(dg), dfree(ddw);
    free(tok), free(wte), free(ref), free(g), free(dw0), free(dwref);
}

// --- RMSNorm ---------------------------------------------------------------------------------

// p: n, c
static void rmsnorm_case(const test_case *tst)
{
    const int n = tst->p[0], c = tst->p[1];
    size_t sz = (size_t)n * c;
    float *x = randn(sz, 2), *w = randn(c, 1), *g = randn(sz, 1), *dw0 = randn(c, 1);
    float *out = lb_malloc(sz * 4), *rstd = lb_malloc((size_t)n * 4);
    float *dx = lb_malloc(sz * 4), *dw = hdup(dw0, (size_t)c * 4);
    cpu->rmsnorm_fwd(cpu, &(lb_rmsnorm_args){.out = out, .rstd = rstd, .x = x, .w = w, .n = n,
            .c = c, .eps = 1e-6f});
    cpu->rmsnorm_bwd(cpu, &(lb_rmsnorm_args){.dx = dx, .dx_beta = 0.0f, .dw = dw, .dout = g,
            .x = x, .w = w, .rstd = rstd, .n = n, .c = c});
    float *dxx = dput(x, sz * 4), *dww = dput(w, (size_t)c * 4), *dg = dput(g, sz * 4);
    float *dout = dev->alloc(dev, sz * 4), *drstd = dev->alloc(dev, (size_t)n * 4);
    float *ddx = dev->alloc(dev, sz * 4), *ddw = dev->alloc(dev, (size_t)c * 4);
    float *keep[2][4];
    char what[96];
    for (int r = 0; r < 2; r++) {
        poison(dout, sz * 4), poison(drstd, (size_t)n * 4), poison(ddx, sz * 4);
        dev->upload(dev, ddw, dw0, (size_t)c * 4);
        dev->rmsnorm_fwd(dev, &(lb_rmsnorm_args){.out = dout, .rstd = drstd, .x = dxx, .w = dww,
                .n = n, .c = c, .eps = 1e-6f});
        // The backward reads the CPU's rstd so it is compared on identical inputs.
        float *drc = dput(rstd, (size_t)n * 4);
        dev->rmsnorm_bwd(dev, &(lb_rmsnorm_args){.dx = ddx, .dx_beta = 0.0f, .dw = ddw, .dout = dg,
                .x = dxx, .w = dww, .rstd = drc, .n = n, .c = c});
        keep[r][0] = hget(dout, sz * 4), keep[r][1] = hget(drstd, (size_t)n * 4);
        keep[r][2] = hget(ddx, sz * 4), keep[r][3] = hget(ddw, (size_t)c * 4);
        dfree(drc);
    }
    {   // dx_beta 1: the GPU's own dx added to a residual's gradient, one fp32 add each
        float *res = randn(sz, 3), *want = lb_malloc(sz * 4);
        for (size_t i = 0; i < sz; i++) want[i] = res[i] + keep[0][2][i];
        float *dres = dput(res, sz * 4), *drc = dput(rstd, (size_t)n * 4);
        dev->rmsnorm_bwd(dev, &(lb_rmsnorm_args){.dx = dres, .dx_beta = 1.0f, .dw = ddw,
                .dout = dg, .x = dxx, .w = dww, .rstd = drc, .n = n, .c = c});
        float *got = hget(dres, sz * 4);
        snprintf(what, sizeof what, "rmsnorm_bwd dx_beta 1 n %d c %d", n, c);
        CHECK_BITS(what, got, want, sz * 4);
        free(res), free(want), free(got), dfree(dres), dfree(drc);
    }
    {   // res, sum and out16 (the decode step's fused residual add and bf16 copy): on each
        // backend, the bits of add() and then the plain norm, out16 to_bf16's of out
        float *res = randn(sz, 4);
        lb_backend *bes[2] = {cpu, dev};
        for (int b = 0; b < 2; b++) {
            lb_backend *be = bes[b];
            const size_t b16 = bytes16(n, c);
            float *X = be->alloc(be, sz * 4), *Y = be->alloc(be, sz * 4);
            float *R = be->alloc(be, sz * 4), *O = be->alloc(be, sz * 4);
            float *O2 = be->alloc(be, sz * 4), *S = be->alloc(be, (size_t)n * 4);
            float *S2 = be->alloc(be, (size_t)n * 4), *Wt = be->alloc(be, (size_t)c * 4);
            uint16_t *O16 = be->alloc(be, b16);
            be->upload(be, X, x, sz * 4), be->upload(be, Y, x, sz * 4);
            be->upload(be, R, res, sz * 4), be->upload(be, Wt, w, (size_t)c * 4);
            uint16_t *poison16 = lb_malloc(b16);   // the padding must be written as zeros
            memset(poison16, 0xff, b16);
            be->upload(be, O16, poison16, b16);
            be->rmsnorm_fwd(be, &(lb_rmsnorm_args){.out = O, .rstd = S, .x = X, .res = R,
                    .sum = X, .w = Wt, .n = n, .c = c, .eps = 1e-6f, .out16 = O16});
            be->add(be, Y, R, sz);
            be->rmsnorm_fwd(be, &(lb_rmsnorm_args){.out = O2, .rstd = S2, .x = Y, .w = Wt,
                    .n = n, .c = c, .eps = 1e-6f});
            float *h[4];
            const void *src[4] = {X, Y, O, O2};
            for (int i = 0; i < 4; i++) {
                h[i] = lb_malloc(sz * 4);
                be->download(be, h[i], src[i], sz * 4);
            }
            float *hs = lb_malloc((size_t)n * 4), *hs2 = lb_malloc((size_t)n * 4);
            be->download(be, hs, S, (size_t)n * 4), be->download(be, hs2, S2, (size_t)n * 4);
            uint16_t *got16 = lb_malloc(b16), *want16 = host16(h[3], n, c);
            be->download(be, got16, O16, b16);
            const char *bn = b ? "dev" : "cpu";
            snprintf(what, sizeof what, "rmsnorm_fwd res: sum = add's (%s)", bn);
            CHECK_BITS(what, h[0], h[1], sz * 4);
            snprintf(what, sizeof what, "rmsnorm_fwd res: out (%s)", bn);
            CHECK_BITS(what, h[2], h[3], sz * 4);
            snprintf(what, sizeof what, "rmsnorm_fwd res: rstd (%s)", bn);
            CHECK_BITS(what, hs, hs2, (size_t)n * 4);
            snprintf(what, sizeof what, "rmsnorm_fwd out16 n %d c %d (%s)", n, c, bn);
            CHECK_BITS(what, got16, want16, b16);
            // out16 alone (out NULL): the same bf16 bits and rstd
            be->upload(be, O16, poison16, b16);
            be->rmsnorm_fwd(be, &(lb_rmsnorm_args){.rstd = S2, .x = Y, .w = Wt, .n = n, .c = c,
                    .eps = 1e-6f, .out16 = O16});
            be->download(be, got16, O16, b16), be->download(be, hs2, S2, (size_t)n * 4);
            snprintf(what, sizeof what, "rmsnorm_fwd out16 without out n %d c %d (%s)", n, c, bn);
            CHECK_BITS(what, got16, want16, b16);
            CHECK_BITS("rmsnorm_fwd out16 without out: rstd", hs, hs2, (size_t)n * 4);
            for (int i = 0; i < 4; i++) free(h[i]);
            free(hs), free(hs2), free(got16), free(want16), free(poison16);
            void *bufs[] = {X, Y, R, O, O2, S, S2, Wt, O16};
            for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) be->free(be, bufs[i]);
        }
        free(res);
    }
    {   // x16 (a residual stream in bf16): the forward and backward from bf16 rows are the
        // fp32 op's on the widened values, on each backend; add16 is one fp32 add rounded
        // once, from fp32 or bf16 rows, in place too
        float *res = randn(sz, 5), *xw = lb_malloc(sz * 4), *ys = lb_malloc(sz * 4);
        uint16_t *x16 = host16(x, n, c);
        for (int i = 0; i < n; i++)
            for (int j = 0; j < c; j++)
                xw[(size_t)i * c + j] = lb_bf16_to_f32(x16[(size_t)i * ((c + 7) & ~7) + j]);
        const size_t b16 = bytes16(n, c);
        for (size_t i = 0; i < sz; i++) ys[i] = x[i] + res[i];
        uint16_t *want_f = host16(ys, n, c);
        for (size_t i = 0; i < sz; i++) ys[i] = xw[i] + res[i];
        uint16_t *want_b = host16(ys, n, c);
        lb_backend *bes[2] = {cpu, dev};
        for (int b = 0; b < 2; b++) {
            lb_backend *be = bes[b];
            const char *bn = b ? "dev" : "cpu";
            float *X = be->alloc(be, sz * 4), *XW = be->alloc(be, sz * 4);
            float *R = be->alloc(be, sz * 4), *Wt = be->alloc(be, (size_t)c * 4);
            float *G = be->alloc(be, sz * 4), *S = be->alloc(be, (size_t)n * 4);
            float *O[2], *DX[2], *DW[2];
            uint16_t *X16 = be->alloc(be, b16), *Y16 = be->alloc(be, b16);
            be->upload(be, X, x, sz * 4), be->upload(be, XW, xw, sz * 4);
            be->upload(be, R, res, sz * 4), be->upload(be, Wt, w, (size_t)c * 4);
            be->upload(be, G, g, sz * 4), be->upload(be, X16, x16, b16);
            for (int k = 0; k < 2; k++) {   // 0: from the widened fp32 rows, 1: from x16
                O[k] = be->alloc(be, sz * 4), DX[k] = be->alloc(be, sz * 4);
                DW[k] = be->alloc(be, (size_t)c * 4);
                be->rmsnorm_fwd(be, &(lb_rmsnorm_args){.out = O[k], .rstd = S,
                        .x = k ? NULL : XW, .x16 = k ? X16 : NULL, .w = Wt, .n = n, .c = c,
                        .eps = 1e-6f});
                be->rmsnorm_bwd(be, &(lb_rmsnorm_args){.dx = DX[k], .dw = DW[k], .dout = G,
                        .x = k ? NULL : XW, .x16 = k ? X16 : NULL, .w = Wt, .rstd = S, .n = n,
                        .c = c});
            }
            float *h[2][3];
            for (int k = 0; k < 2; k++) {
                h[k][0] = hget_be(be, O[k], sz * 4), h[k][1] = hget_be(be, DX[k], sz * 4);
                h[k][2] = hget_be(be, DW[k], (size_t)c * 4);
            }
            snprintf(what, sizeof what, "rmsnorm_fwd x16 n %d c %d (%s)", n, c, bn);
            CHECK_BITS(what, h[1][0], h[0][0], sz * 4);
            snprintf(what, sizeof what, "rmsnorm_bwd x16: dx n %d c %d (%s)", n, c, bn);
            CHECK_BITS(what, h[1][1], h[0][1], sz * 4);
            snprintf(what, sizeof what, "rmsnorm_bwd x16: dw n %d c %d (%s)", n, c, bn);
            CHECK_BITS(what, h[1][2], h[0][2], (size_t)c * 4);
            uint16_t *got = lb_malloc(b16);
            memset(got, 0xff, b16);   // the padding must be written as zeros
            be->upload(be, Y16, got, b16);
            be->add16(be, Y16, lb_act_f32(X, n, c), R);
            be->download(be, got, Y16, b16);
            snprintf(what, sizeof what, "add16 from fp32 n %d c %d (%s)", n, c, bn);
            CHECK_BITS(what, got, want_f, b16);
            be->add16(be, X16, lb_act_bf16(X16, n, c), R);   // in place
            be->download(be, got, X16, b16);
            snprintf(what, sizeof what, "add16 from bf16, in place n %d c %d (%s)", n, c, bn);
            CHECK_BITS(what, got, want_b, b16);
            free(got);
            for (int k = 0; k < 2; k++) {
                for (int i = 0; i < 3; i++) free(h[k][i]);
                be->free(be, O[k]), be->free(be, DX[k]), be->free(be, DW[k]);
            }
            void *bufs[] = {X, XW, R, Wt, G, S, X16, Y16};
            for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) be->free(be, bufs[i]);
        }
        free(res), free(xw), free(ys), free(x16), free(want_f), free(want_b);
    }
    snprintf(what, sizeof what, "rmsnorm_fwd out n %d c %d", n, c);
    CHECK_NMSE(what, keep[0][0], out, sz, tst->bound);
    snprintf(what, sizeof what, "rmsnorm_fwd rstd n %d c %d", n, c);
    CHECK_NMSE(what, keep[0][1], rstd, (size_t)n, tst->bound);
    snprintf(what, sizeof what, "rmsnorm_bwd dx n %d c %d", n, c);
    CHECK_NMSE(what, keep[0][2], dx, sz, tst->bound);
    snprintf(what, sizeof what, "rmsnorm_bwd dw (+=) n %d c %d", n, c);
    CHECK_NMSE(what, keep[0][3], dw, (size_t)c, tst->bound);
    CHECK_BITS("rmsnorm_fwd out, run twice", keep[0][0], keep[1][0], sz * 4);
    CHECK_BITS("rmsnorm_fwd rstd, run twice", keep[0][1], keep[1][1], (size_t)n * 4);
    CHECK_BITS("rmsnorm_bwd dx, run twice", keep[0][2], keep[1][2], sz * 4);
    CHECK_BITS("rmsnorm_bwd dw, run twice", keep[0][3], keep[1][3], (size_t)c * 4);
    for (int r = 0; r < 2; r++)
        for (int i = 0; i < 4; i++) free(keep[r][i]);
    dfree(dxx), dfree(dww), dfree(dg), dfree(dout), dfree(drstd), dfree(ddx), dfree(ddw);
    free(x), free(w), free(g), free(dw0), free(out), free(rstd), free(dx), free(dw);
}

// --- RoPE ------------------------------------------------------------------------------------

// p: n, heads, d, rot (0: all d; partial rotary), llama3 (1: frequencies from
// lb_rope_inv_freq_llama3, a table in backend memory; Llama 3.1's numbers, original context 64
// so positions up to 40000 cross every band). The CPU's rows are also checked against an
// independent double rotation: the rotated pairs, and that values past rot pass unchanged.
static void rope_case(const test_case *tst)
{
    const int n = tst->p[0], heads = tst->p[1], d = tst->p[2], rot = tst->p[3] ? tst->p[3] : d;
    const int llama3 = tst->p[4], half = rot / 2;
    size_t sz = (size_t)n * heads * d;
    float *x = randn(sz, 1), *ref = hdup(x, sz * 4);
    int32_t *pos = randint(n, 0, 40000);
    pos[0] = 0;
    double *freq = NULL, *dfreq = NULL;
    if (llama3) {
        freq = lb_malloc((size_t)half * sizeof(double));
        lb_rope_inv_freq_llama3(freq, rot, 5e5, 8.0, 1.0, 4.0, 64.0);
        dfreq = dput(freq, (size_t)half * sizeof(double));
        // the three bands are all there: scaled by 1/8, kept, and blended between
        int scaled = 0, kept = 0, mid = 0;
        for (int f = 0; f < half; f++) {
            double r = freq[f] / pow(5e5, -2.0 * f / rot);
            scaled += fabs(r - 0.125) < 1e-15, kept += r == 1.0, mid += r > 0.125 + 1e-9 && r < 1;
        }
        ck_assert_msg(scaled && kept && mid, "llama3 bands %d %d %d", scaled, kept, mid);
    }
    cpu->rope(cpu, &(lb_rope_args){.x = ref, .pos = pos, .n = n, .heads = heads, .d = d,
            .theta = 5e5f, .rot = tst->p[3], .inv_freq = freq});
    for (int i = 0; i < n; i++)   // an independent evaluation of the rotation
        for (int h = 0; h < heads; h++)
            for (int j = 0; j < d; j++) {
                size_t o = ((size_t)i * heads + h) * d;
                double want = x[o + j];
                if (j < rot) {
                    int f = j % half;
                    double fr = freq ? freq[f] : pow(5e5f, -2.0 * f / rot), a = pos[i] * fr;
                    double x1 = x[o + f], x2 = x[o + f + half];
                    want = j < half ? x1 * cos(a) - x2 * sin(a) : x2 * cos(a) + x1 * sin(a);
                }
                ck_assert_msg(fabs(ref[o + j] - want) <= 1e-5 * (1 + fabs(want)),
                              "rope row %d head %d elem %d: %g, want %g", i, h, j, ref[o + j],
                              want);
                if (j >= rot) ck_assert(ref[o + j] == x[o + j]);
            }
    float *back = hdup(ref, sz * 4);
    cpu->rope(cpu, &(lb_rope_args){.x = back, .pos = pos, .n = n, .heads = heads, .d = d,
            .theta = 5e5f, .inverse = 1, .rot = tst->p[3], .inv_freq = freq});
    int32_t *dpos = dput(pos, (size_t)n * 4);
    float *dxx = dev->alloc(dev, sz * 4);
    float *keep[2][2];
    for (int r = 0; r < 2; r++) {
        dev->upload(dev, dxx, x, sz * 4);
        dev->rope(dev, &(lb_rope_args){.x = dxx, .pos = dpos, .n = n, .heads = heads, .d = d,
                .theta = 5e5f, .rot = tst->p[3], .inv_freq = dfreq});
        keep[r][0] = hget(dxx, sz * 4);
        dev->upload(dev, dxx, ref, sz * 4);   // the backward from the CPU's forward output
        dev->rope(dev, &(lb_rope_args){.x = dxx, .pos = dpos, .n = n, .heads = heads, .d = d,
                .theta = 5e5f, .inverse = 1, .rot = tst->p[3], .inv_freq = dfreq});
        keep[r][1] = hget(dxx, sz * 4);
    }
    char what[128];
    snprintf(what, sizeof what, "rope_fwd n %d heads %d d %d rot %d llama3 %d", n, heads, d, rot,
             llama3);
    CHECK_NMSE(what, keep[0][0], ref, sz, tst->bound);
    snprintf(what, sizeof what, "rope_bwd n %d heads %d d %d rot %d llama3 %d", n, heads, d, rot,
             llama3);
    CHECK_NMSE(what, keep[0][1], back, sz, tst->bound);
    CHECK_BITS("rope_fwd, run twice", keep[0][0], keep[1][0], sz * 4);
    CHECK_BITS("rope_bwd, run twice", keep[0][1], keep[1][1], sz * 4);
    for (int j = 0; j < heads * d; j++) ck_assert(keep[0][0][j] == x[j]);   // position 0
    double e = 0;   // the backward undoes the forward
    for (size_t j = 0; j < sz; j++) e = fmax(e, fabs(back[j] - x[j]));
    ck_assert_msg(e < 1e-5, "rope: inverse(forward(x)) differs from x by %g", e);
    {   // src: the q/k norm in the rotation's call, the bits of rmsnorm_fwd and then rope on
        // each backend (the CUDA kernel of one warp a head where d <= 128 and 64 divides rot)
        float *nw = randn(d, 5);
        lb_backend *bes[2] = {cpu, dev};
        const int nh = n * heads;
        for (int b = 0; b < 2; b++) {
            lb_backend *be = bes[b];
            float *Xs = be->alloc(be, sz * 4), *A = be->alloc(be, sz * 4);
            float *B = be->alloc(be, sz * 4), *Ra = be->alloc(be, (size_t)nh * 4);
            float *Rb = be->alloc(be, (size_t)nh * 4), *Nw = be->alloc(be, (size_t)d * 4);
            int32_t *P = be->alloc(be, (size_t)n * 4);
            double *F = NULL;
            if (freq) {
                F = be->alloc(be, (size_t)half * sizeof(double));
                be->upload(be, F, freq, (size_t)half * sizeof(double));
            }
            be->upload(be, Xs, x, sz * 4), be->upload(be, Nw, nw, (size_t)d * 4);
            be->upload(be, P, pos, (size_t)n * 4);
            be->rope(be, &(lb_rope_args){.x = A, .pos = P, .n = n, .heads = heads, .d = d,
                    .theta = 5e5f, .rot = tst->p[3], .inv_freq = F, .src = Xs, .nw = Nw,
                    .rstd = Ra, .eps = 1e-6f});
            be->rmsnorm_fwd(be, &(lb_rmsnorm_args){.out = B, .rstd = Rb, .x = Xs, .w = Nw,
                    .n = nh, .c = d, .eps = 1e-6f});
            be->rope(be, &(lb_rope_args){.x = B, .pos = P, .n = n, .heads = heads, .d = d,
                    .theta = 5e5f, .rot = tst->p[3], .inv_freq = F});
            float *ha = lb_malloc(sz * 4), *hb = lb_malloc(sz * 4);
            float *hra = lb_malloc((size_t)nh * 4), *hrb = lb_malloc((size_t)nh * 4);
            be->download(be, ha, A, sz * 4), be->download(be, hb, B, sz * 4);
            be->download(be, hra, Ra, (size_t)nh * 4), be->download(be, hrb, Rb, (size_t)nh * 4);
            snprintf(what, sizeof what, "rope src (norm) d %d rot %d (%s)", d, rot,
                     b ? "dev" : "cpu");
            CHECK_BITS(what, ha, hb, sz * 4);
            snprintf(what, sizeof what, "rope src (norm) rstd (%s)", b ? "dev" : "cpu");
            CHECK_BITS(what, hra, hrb, (size_t)nh * 4);
            // out16: the same values rounded to bf16, with the norm (x not used) and without
            // (x read, not written)
            uint16_t *Y = be->alloc(be, sz * 2), *hy = lb_malloc(sz * 2), *want = lb_malloc(sz * 2);
            be->rope(be, &(lb_rope_args){.out16 = Y, .pos = P, .n = n, .heads = heads, .d = d,
                    .theta = 5e5f, .rot = tst->p[3], .inv_freq = F, .src = Xs, .nw = Nw,
                    .rstd = Rb, .eps = 1e-6f});
            be->download(be, hy, Y, sz * 2), be->download(be, hrb, Rb, (size_t)nh * 4);
            for (size_t i = 0; i < sz; i++) want[i] = lb_f32_to_bf16(ha[i]);
            snprintf(what, sizeof what, "rope src (norm) out16 d %d rot %d (%s)", d, rot,
                     b ? "dev" : "cpu");
            CHECK_BITS(what, hy, want, sz * 2);
            CHECK_BITS("rope src (norm) out16 rstd", hra, hrb, (size_t)nh * 4);
            be->rope(be, &(lb_rope_args){.x = Xs, .out16 = Y, .pos = P, .n = n, .heads = heads,
                    .d = d, .theta = 5e5f, .rot = tst->p[3], .inv_freq = F});
            be->download(be, hy, Y, sz * 2), be->download(be, ha, Xs, sz * 4);
            const float *rot32 = b ? keep[0][0] : ref;   // this backend's rope of x in place
            for (size_t i = 0; i < sz; i++) want[i] = lb_f32_to_bf16(rot32[i]);
            snprintf(what, sizeof what, "rope out16 d %d rot %d (%s)", d, rot, b ? "dev" : "cpu");
            CHECK_BITS(what, hy, want, sz * 2);
            CHECK_BITS("rope out16 leaves x", ha, x, sz * 4);
            if (d % 8 == 0) {   // src16: bf16 rows read instead of src, the bits of the norm
                // and rotation of their widened values, into x and into out16
                uint16_t *x16h = lb_malloc(sz * 2);
                float *xw = lb_malloc(sz * 4);
                for (size_t i = 0; i < sz; i++) {
                    x16h[i] = lb_f32_to_bf16(x[i]);
                    xw[i] = lb_bf16_to_f32(x16h[i]);
                }
                uint16_t *S16 = be->alloc(be, sz * 2);
                be->upload(be, S16, x16h, sz * 2), be->upload(be, Xs, xw, sz * 4);
                be->rope(be, &(lb_rope_args){.x = A, .pos = P, .n = n, .heads = heads, .d = d,
                        .theta = 5e5f, .rot = tst->p[3], .inv_freq = F, .src = Xs, .nw = Nw,
                        .rstd = Ra, .eps = 1e-6f});
                be->rope(be, &(lb_rope_args){.x = B, .pos = P, .n = n, .heads = heads, .d = d,
                        .theta = 5e5f, .rot = tst->p[3], .inv_freq = F, .src16 = S16, .nw = Nw,
                        .rstd = Rb, .eps = 1e-6f});
                be->download(be, ha, A, sz * 4), be->download(be, hb, B, sz * 4);
                be->download(be, hra, Ra, (size_t)nh * 4);
                be->download(be, hrb, Rb, (size_t)nh * 4);
                snprintf(what, sizeof what, "rope src16 (norm) d %d rot %d (%s)", d, rot,
                         b ? "dev" : "cpu");
                CHECK_BITS(what, hb, ha, sz * 4);
                CHECK_BITS("rope src16 (norm) rstd", hrb, hra, (size_t)nh * 4);
                be->rope(be, &(lb_rope_args){.out16 = Y, .pos = P, .n = n, .heads = heads,
                        .d = d, .theta = 5e5f, .rot = tst->p[3], .inv_freq = F, .src16 = S16,
                        .nw = Nw, .rstd = Rb, .eps = 1e-6f});
                be->download(be, hy, Y, sz * 2);
                for (size_t i = 0; i < sz; i++) want[i] = lb_f32_to_bf16(ha[i]);
                snprintf(what, sizeof what, "rope src16 (norm) out16 d %d rot %d (%s)", d, rot,
                         b ? "dev" : "cpu");
                CHECK_BITS(what, hy, want, sz * 2);
                be->free(be, S16), free(x16h), free(xw);
            }
            be->free(be, Y), free(hy), free(want);
            free(ha), free(hb), free(hra), free(hrb);
            void *bufs[] = {Xs, A, B, Ra, Rb, Nw, P, F};
            for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
                if (bufs[i]) be->free(be, bufs[i]);
        }
        free(nw);
    }
    for (int r = 0; r < 2; r++) free(keep[r][0]), free(keep[r][1]);
    if (dfreq) dfree(dfreq);
    dfree(dpos), dfree(dxx), free(x), free(ref), free(pos), free(back), free(freq);
}

// --- attention -------------------------------------------------------------------------------

// bf16: both backends in bf16 mode (kernels.h), bound B_ATTN_BF16; else fp32 mode, B_ACCUM.
// p: b, t, hq, hkv, d, bf16
static void attention_case(const test_case *tst)
{
    const int b = tst->p[0], t = tst->p[1], hq = tst->p[2], hkv = tst->p[3], d = tst->p[4];
    const int bf16 = tst->p[5];
    size_t nq = (size_t)b * t * hq * d, nk = (size_t)b * t * hkv * d, nl = (size_t)b * hq * t;
    float *q = randn(nq, 1), *k = randn(nk, 1), *v = randn(nk, 1), *g = randn(nq, 1);
    // A one-key row's softmax is constant, so its exact dq is 0, and the computed dS = dP - D
    // is rounding noise: in bf16 mode dP takes bf16(dout) and D the fp32 dout, and the GPU
    // accumulates dP on tensor cores, so the two backends' noise differs by more than any
    // relative bound can state (5.3e-6 against 1e-6 measured on the H200). With dout
    // bf16-valued, dP and D are the same exact sum and the CPU's dq is exactly 0: the GPU's
    // dq is then held to the absolute bound (nmse() of a zero reference).
    if (bf16 && t == 1)
        for (size_t i = 0; i < nq; i++) g[i] = lb_round_bf16(g[i]);
    float *out = lb_malloc(nq * 4), *lse = lb_malloc(nl * 4);
    float *dq = lb_malloc(nq * 4), *dk = lb_malloc(nk * 4), *dv = lb_malloc(nk * 4);
    cpu->attention_fwd(cpu, &(lb_attention_args){.out = out, .lse = lse, .q = q, .k = k, .v = v,
            .b = b, .t = t, .hq = hq, .hkv = hkv, .d = d, .bf16 = bf16});
    cpu->attention_bwd(cpu, &(lb_attention_args){.dq = dq, .dk = dk, .dv = dv, .dout = g, .q = q,
            .k = k, .v = v, .out = out, .lse = lse, .b = b, .t = t, .hq = hq, .hkv = hkv, .d = d,
            .bf16 = bf16});
    float *Q = dput(q, nq * 4), *Kd = dput(k, nk * 4), *Vd = dput(v, nk * 4), *G = dput(g, nq * 4);
    float *O = dev->alloc(dev, nq * 4), *L = dev->alloc(dev, nl * 4);
    float *Oc = dput(out, nq * 4), *Lc = dput(lse, nl * 4);
    float *DQ = dev->alloc(dev, nq * 4), *DK = dev->alloc(dev, nk * 4);
    float *DV = dev->alloc(dev, nk * 4);
    float *keep[2][5];
    for (int r = 0; r < 2; r++) {
        poison(O, nq * 4), poison(L, nl * 4);
        poison(DQ, nq * 4), poison(DK, nk * 4), poison(DV, nk * 4);
        dev->attention_fwd(dev, &(lb_attention_args){.out = O, .lse = L, .q = Q, .k = Kd, .v = Vd,
                .b = b, .t = t, .hq = hq, .hkv = hkv, .d = d, .bf16 = bf16});
        // The backward takes the CPU's out and lse, so it is compared on identical inputs.
        dev->attention_bwd(dev, &(lb_attention_args){.dq = DQ, .dk = DK, .dv = DV, .dout = G,
                .q = Q, .k = Kd, .v = Vd, .out = Oc, .lse = Lc, .b = b, .t = t, .hq = hq,
                .hkv = hkv, .d = d, .bf16 = bf16});
        keep[r][0] = hget(O, nq * 4), keep[r][1] = hget(L, nl * 4);
        keep[r][2] = hget(DQ, nq * 4), keep[r][3] = hget(DK, nk * 4);
        keep[r][4] = hget(DV, nk * 4);
    }
    const char *names[5] = {"out", "lse", "dq", "dk", "dv"};
    const float *refs[5] = {out, lse, dq, dk, dv};
    const size_t sizes[5] = {nq, nl, nq, nk, nk};
    for (int i = 0; i < 5; i++) {
        char what[96];
        snprintf(what, sizeof what, "attention%s %s b %d t %d hq %d hkv %d d %d",
                 bf16 ? " bf16" : "", names[i], b, t, hq, hkv, d);
        CHECK_NMSE(what, keep[0][i], refs[i], sizes[i], tst->bound);
        snprintf(what, sizeof what, "attention%s %s, run twice", bf16 ? " bf16" : "", names[i]);
        CHECK_BITS(what, keep[0][i], keep[1][i], sizes[i] * 4);
    }
    // Causality: the first query of each sequence and head sees only its own key (with p = 1:
    // in bf16 mode the output is that value rounded to bf16).
    for (int bi = 0; bi < b; bi++)
        for (int h = 0; h < hq; h++)
            for (int x = 0; x < d; x++) {
                float vx = v[(((size_t)bi * t) * hkv + h / (hq / hkv)) * d + x];
                ck_assert(keep[0][0][(((size_t)bi * t) * hq + h) * d + x] ==
                          (bf16 ? lb_round_bf16(vx) : vx));
            }
    for (int r = 0; r < 2; r++)
        for (int i = 0; i < 5; i++) free(keep[r][i]);
    dfree(Q), dfree(Kd), dfree(Vd), dfree(G), dfree(O), dfree(L), dfree(Oc), dfree(Lc);
    dfree(DQ), dfree(DK), dfree(DV);
    free(q), free(k), free(v), free(g), free(out), free(lse), free(dq), free(dk), free(dv);
}

// bf16 inputs (lb_attention_args.q16, k16, v16) on each backend: the bf16 mode reads q, k and v
// rounded to bf16, so copies of those values must give the same bits as the fp32 inputs,
// forward and backward, all three at once or q alone (d 40: the CUDA kernels' padded copies).
// p: b, t, hq, hkv, d
static void attention_io16_case(const test_case *tst)
{
    const int b = tst->p[0], t = tst->p[1], hq = tst->p[2], hkv = tst->p[3], d = tst->p[4];
    size_t nq = (size_t)b * t * hq * d, nk = (size_t)b * t * hkv * d, nl = (size_t)b * hq * t;
    float *h[4] = {randn(nq, 1), randn(nk, 1), randn(nk, 1), randn(nq, 1)};   // q, k, v, dout
    uint16_t *h16[3];
    const size_t cnt[4] = {nq, nk, nk, nq};
    for (int i = 0; i < 3; i++) {
        h16[i] = lb_malloc(cnt[i] * 2);
        for (size_t j = 0; j < cnt[i]; j++) h16[i][j] = lb_f32_to_bf16(h[0 + i][j]);
    }
    lb_backend *bes[2] = {cpu, dev};
    for (int w = 0; w < 2; w++) {
        lb_backend *be = bes[w];
        float *X[4];
        uint16_t *X16[3];
        for (int i = 0; i < 4; i++) {
            X[i] = be->alloc(be, cnt[i] * 4);
            be->upload(be, X[i], h[i], cnt[i] * 4);
        }
        for (int i = 0; i < 3; i++) {
            X16[i] = be->alloc(be, cnt[i] * 2);
            be->upload(be, X16[i], h16[i], cnt[i] * 2);
        }
        float *got[3][5];
        for (int mode = 0; mode < 3; mode++) {   // fp32 inputs, all three bf16, q alone bf16
            float *O = be->alloc(be, nq * 4), *L = be->alloc(be, nl * 4);
            float *DQ = be->alloc(be, nq * 4), *DK = be->alloc(be, nk * 4);
            float *DV = be->alloc(be, nk * 4);
            lb_attention_args a = {.out = O, .lse = L, .b = b, .t = t, .hq = hq, .hkv = hkv,
                                   .d = d, .bf16 = 1, .dout = X[3], .dq = DQ, .dk = DK, .dv = DV};
            a.q = mode == 0 ? X[0] : NULL, a.q16 = mode ? X16[0] : NULL;
            a.k = mode == 1 ? NULL : X[1], a.k16 = mode == 1 ? X16[1] : NULL;
            a.v = mode == 1 ? NULL : X[2], a.v16 = mode == 1 ? X16[2] : NULL;
            be->attention_fwd(be, &a);
            be->attention_bwd(be, &a);
            float *outs[5] = {O, L, DQ, DK, DV};
            const size_t sizes[5] = {nq, nl, nq, nk, nk};
            for (int i = 0; i < 5; i++) {
                got[mode][i] = lb_malloc(sizes[i] * 4);
                be->download(be, got[mode][i], outs[i], sizes[i] * 4);
                be->free(be, outs[i]);
            }
        }
        const char *names[5] = {"out", "lse", "dq", "dk", "dv"};
        const size_t sizes[5] = {nq, nl, nq, nk, nk};
        for (int mode = 1; mode < 3; mode++)
            for (int i = 0; i < 5; i++) {
                char what[128];
                snprintf(what, sizeof what, "attention bf16 %s from %s (%s), b %d t %d hq %d hkv "
                         "%d d %d", names[i], mode == 1 ? "q16 k16 v16" : "q16", w ? "dev" : "cpu",
                         b, t, hq, hkv, d);
                CHECK_BITS(what, got[mode][i], got[0][i], sizes[i] * 4);
            }
        for (int mode = 0; mode < 3; mode++)
            for (int i = 0; i < 5; i++) free(got[mode][i]);
        for (int i = 0; i < 4; i++) be->free(be, X[i]);
        for (int i = 0; i < 3; i++) be->free(be, X16[i]);
    }
    for (int i = 0; i < 4; i++) free(h[i]);
    for (int i = 0; i < 3; i++) free(h16[i]);
}

// The bf16 output (lb_attention_args.out16) on each backend: the forward writes exactly its
// fp32 output rounded to bf16, the same lse, and the backward reading out16 gives the bits of
// the backward reading those rounded values as fp32 (D_i from bf16 out_i). p: b, t, hq, hkv, d
static void attention_out16_case(const test_case *tst)
{
    const int b = tst->p[0], t = tst->p[1], hq = tst->p[2], hkv = tst->p[3], d = tst->p[4];
    size_t nq = (size_t)b * t * hq * d, nk = (size_t)b * t * hkv * d, nl = (size_t)b * hq * t;
    float *h[4] = {randn(nq, 1), randn(nk, 1), randn(nk, 1), randn(nq, 1)};   // q, k, v, dout
    const size_t cnt[4] = {nq, nk, nk, nq};
    lb_backend *bes[2] = {cpu, dev};
    for (int w = 0; w < 2; w++) {
        lb_backend *be = bes[w];
        float *X[4];
        for (int i = 0; i < 4; i++) {
            X[i] = be->alloc(be, cnt[i] * 4);
            be->upload(be, X[i], h[i], cnt[i] * 4);
        }
        float *O = be->alloc(be, nq * 4), *L = be->alloc(be, nl * 4), *L16 = be->alloc(be, nl * 4);
        uint16_t *O16 = be->alloc(be, nq * 2);
        lb_attention_args a = {.out = O, .lse = L, .q = X[0], .k = X[1], .v = X[2], .b = b,
                               .t = t, .hq = hq, .hkv = hkv, .d = d, .bf16 = 1};
        be->attention_fwd(be, &a);
        lb_attention_args a16 = a;
        a16.out = NULL, a16.out16 = O16, a16.lse = L16;
        be->attention_fwd(be, &a16);
        float *o = lb_malloc(nq * 4), *l = lb_malloc(nl * 4), *l16 = lb_malloc(nl * 4);
        uint16_t *o16 = lb_malloc(nq * 2), *want16 = lb_malloc(nq * 2);
        be->download(be, o, O, nq * 4);
        be->download(be, o16, O16, nq * 2);
        be->download(be, l, L, nl * 4);
        be->download(be, l16, L16, nl * 4);
        for (size_t j = 0; j < nq; j++) want16[j] = lb_f32_to_bf16(o[j]);
        char what[128];
        snprintf(what, sizeof what, "attention bf16 out16 (%s), b %d t %d hq %d hkv %d d %d",
                 w ? "dev" : "cpu", b, t, hq, hkv, d);
        CHECK_BITS(what, o16, want16, nq * 2);
        CHECK_BITS("attention bf16 lse beside out16", l16, l, nl * 4);
        // the backward: from out16, and from its values as fp32
        for (size_t j = 0; j < nq; j++) o[j] = lb_bf16_to_f32(o16[j]);
        be->upload(be, O, o, nq * 4);
        float *D[2][3], *got[2][3];
        const size_t gsz[3] = {nq, nk, nk};
        for (int m16 = 0; m16 < 2; m16++) {
            for (int i = 0; i < 3; i++) D[m16][i] = be->alloc(be, gsz[i] * 4);
            lb_attention_args g = a;
            g.dout = X[3], g.dq = D[m16][0], g.dk = D[m16][1], g.dv = D[m16][2];
            if (m16) g.out = NULL, g.out16 = O16;
            be->attention_bwd(be, &g);
            for (int i = 0; i < 3; i++) {
                got[m16][i] = lb_malloc(gsz[i] * 4);
                be->download(be, got[m16][i], D[m16][i], gsz[i] * 4);
                be->free(be, D[m16][i]);
            }
        }
        const char *names[3] = {"dq", "dk", "dv"};
        for (int i = 0; i < 3; i++) {
            snprintf(what, sizeof what, "attention bf16 %s from out16 (%s), b %d t %d hq %d d %d",
                     names[i], w ? "dev" : "cpu", b, t, hq, d);
            CHECK_BITS(what, got[1][i], got[0][i], gsz[i] * 4);
            free(got[0][i]), free(got[1][i]);
        }
        free(o), free(l), free(l16), free(o16), free(want16);
        be->free(be, O), be->free(be, L), be->free(be, L16), be->free(be, O16);
        for (int i = 0; i < 4; i++) be->free(be, X[i]);
    }
    for (int i = 0; i < 4; i++) free(h[i]);
}

// The bf16 backward's two ways to dq on sm_90 (attention_tc.cu): from the dS tiles the dk/dv
// kernel stores (the default), and by the dq kernel that recomputes S and dP
// (LB_CUDA_ATTN_DS=0, a backend of its own). Both form the same bf16 dS and meet it with K in
// the same k16 steps, chunks in order, so dq (and dk, dv: the same kernel) must agree bit for
// bit; lengths below, across and beyond the chunks, head dims 64 and 128 (the wgmma kernels'),
// GQA 2:1 and 32:4. The batch in chunks of one element (LB_CUDA_ATTN_CHUNK=1, a third
// backend: the launches the proxy's backward takes) must give the same bits too.
static void attention_bf16_ds_case(const test_case *tst)
{
    lb_backend *rc = cuda_with("LB_CUDA_ATTN_DS=0", NULL);
    lb_backend *ch = cuda_with("LB_CUDA_ATTN_CHUNK=1", NULL);
    const int shapes[][5] = {{2, 77, 4, 2, 64}, {1, 200, 32, 4, 128}, {2, 1, 4, 2, 128},
                             {1, 129, 4, 1, 64}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int b = shapes[si][0], t = shapes[si][1], hq = shapes[si][2], hkv = shapes[si][3];
        const int d = shapes[si][4];
        size_t nq = (size_t)b * t * hq * d, nk = (size_t)b * t * hkv * d, nl = (size_t)b * hq * t;
        float *q = randn(nq, 1), *k = randn(nk, 1), *v = randn(nk, 1), *g = randn(nq, 1);
        float *out = lb_malloc(nq * 4), *lse = lb_malloc(nl * 4);
        cpu->attention_fwd(cpu, &(lb_attention_args){.out = out, .lse = lse, .q = q, .k = k,
                .v = v, .b = b, .t = t, .hq = hq, .hkv = hkv, .d = d, .bf16 = 1});
        // device memory of one device serves both backends; rc's stream is synced before reads
        float *Q = dput(q, nq * 4), *K = dput(k, nk * 4), *V = dput(v, nk * 4);
        float *G = dput(g, nq * 4), *O = dput(out, nq * 4), *L = dput(lse, nl * 4);
        float *got[3][3];
        lb_backend *be[3] = {dev, rc, ch};
        for (int w = 0; w < 3; w++) {
            float *DQ = dpoisoned(nq * 4), *DK = dpoisoned(nk * 4), *DV = dpoisoned(nk * 4);
            be[w]->attention_bwd(be[w], &(lb_attention_args){.dq = DQ, .dk = DK, .dv = DV,
                    .dout = G, .q = Q, .k = K, .v = V, .out = O, .lse = L, .b = b, .t = t,
                    .hq = hq, .hkv = hkv, .d = d, .bf16 = 1});
            be[w]->sync(be[w]);
            got[w][0] = hget(DQ, nq * 4), got[w][1] = hget(DK, nk * 4), got[w][2] = hget(DV, nk * 4);
            dfree(DQ), dfree(DK), dfree(DV);
        }
        dfree(Q), dfree(K), dfree(V), dfree(G), dfree(O), dfree(L);
        const char *names[3] = {"dq", "dk", "dv"};
        const size_t sizes[3] = {nq, nk, nk};
        for (int i = 0; i < 3; i++)
            for (int w = 1; w < 3; w++) {
                char what[112];
                snprintf(what, sizeof what, "attention bf16 %s %s, b %d t %d hq %d hkv %d d %d",
                         names[i], w == 1 ? "from dS" : "in chunks", b, t, hq, hkv, d);
                CHECK_NMSE(what, got[0][i], got[w][i], sizes[i], B_ATTN_BF16);
                CHECK_BITS(what, got[0][i], got[w][i], sizes[i] * 4);
            }
        for (int w = 0; w < 3; w++)
            for (int i = 0; i < 3; i++) free(got[w][i]);
        free(q), free(k), free(v), free(g), free(out), free(lse);
    }
    rc->destroy(rc);
    ch->destroy(ch);
}

// --- SwiGLU ----------------------------------------------------------------------------------

// f 257: one element per lane; f 256: 16-byte rows (the kernels' vector path); f 36: 16-byte
// rows, and out16's padded. The second run writes the bf16 copies too (the same fp32 bits).
// p: n, f
static void swiglu_case(const test_case *tst)
{
    const int n = tst->p[0], f = tst->p[1];
    size_t s2 = (size_t)n * 2 * f, s1 = (size_t)n * f;
    float *gu = randn(s2, 3), *g = randn(s1, 1);
    float *out = lb_malloc(s1 * 4), *dgu = lb_malloc(s2 * 4);
    cpu->swiglu_fwd(cpu, &(lb_swiglu_args){.out = out, .gu = gu, .n = n, .f = f});
    cpu->swiglu_bwd(cpu, &(lb_swiglu_args){.dgu = dgu, .dout = g, .gu = gu, .n = n, .f = f});
    float *GU = dput(gu, s2 * 4), *G = dput(g, s1 * 4);
    float *O = dev->alloc(dev, s1 * 4), *DGU = dev->alloc(dev, s2 * 4);
    void *O16 = dpoisoned(bytes16(n, f)), *DGU16 = dpoisoned(bytes16(n, 2 * f));
    float *keep[2][2];
    for (int r = 0; r < 2; r++) {
        poison(O, s1 * 4), poison(DGU, s2 * 4);
        dev->swiglu_fwd(dev, &(lb_swiglu_args){.out = O, .out16 = r ? O16 : NULL, .gu = GU, .n = n,
                .f = f});
        dev->swiglu_bwd(dev, &(lb_swiglu_args){.dgu = DGU, .dgu16 = r ? DGU16 : NULL, .dout = G,
                .gu = GU, .n = n, .f = f});
        keep[r][0] = hget(O, s1 * 4), keep[r][1] = hget(DGU, s2 * 4);
    }
    check_copy16("swiglu_fwd out16", O16, keep[1][0], n, f);
    check_copy16("swiglu_bwd dgu16", DGU16, keep[1][1], n, 2 * f);
    poison(O16, bytes16(n, f)), poison(DGU16, bytes16(n, 2 * f));   // the copies alone
    dev->swiglu_fwd(dev, &(lb_swiglu_args){.out16 = O16, .gu = GU, .n = n, .f = f});
    dev->swiglu_bwd(dev, &(lb_swiglu_args){.dgu16 = DGU16, .dout = G, .gu = GU, .n = n, .f = f});
    check_copy16("swiglu_fwd out16 alone", O16, keep[1][0], n, f);
    check_copy16("swiglu_bwd dgu16 alone", DGU16, keep[1][1], n, 2 * f);
    dfree(O16), dfree(DGU16);
    char what[64];
    snprintf(what, sizeof what, "swiglu_fwd n %d f %d", n, f);
    CHECK_NMSE(what, keep[0][0], out, s1, tst->bound);
    snprintf(what, sizeof what, "swiglu_bwd n %d f %d", n, f);
    CHECK_NMSE(what, keep[0][1], dgu, s2, tst->bound);
    CHECK_BITS("swiglu_fwd, run twice", keep[0][0], keep[1][0], s1 * 4);
    CHECK_BITS("swiglu_bwd, run twice", keep[0][1], keep[1][1], s2 * 4);
    // bf16 inputs (gu16, dout16; the fp32 ones NULL): against the CPU on the same inputs, and
    // bitwise the GPU's results on those values widened to fp32 (the fp32 inputs above)
    uint16_t *gu16 = host16(gu, n, 2 * f), *g16 = host16(g, n, f);
    for (size_t i = 0; i < s2; i++) gu[i] = lb_round_bf16(gu[i]);
    for (size_t i = 0; i < s1; i++) g[i] = lb_round_bf16(g[i]);
    cpu->swiglu_fwd(cpu, &(lb_swiglu_args){.out = out, .gu16 = gu16, .n = n, .f = f});
    cpu->swiglu_bwd(cpu, &(lb_swiglu_args){.dgu = dgu, .dout16 = g16, .gu16 = gu16, .n = n,
            .f = f});
    void *GU16 = dput(gu16, bytes16(n, 2 * f)), *G16 = dput(g16, bytes16(n, f));
    float *GUW = dput(gu, s2 * 4), *GW = dput(g, s1 * 4), *in16[2][2];
    for (int r = 0; r < 2; r++) {   // r 0: the bf16 inputs, 1: widened
        poison(O, s1 * 4), poison(DGU, s2 * 4);
        dev->swiglu_fwd(dev, &(lb_swiglu_args){.out = O, .gu = r ? GUW : NULL,
                .gu16 = r ? NULL : GU16, .n = n, .f = f});
        dev->swiglu_bwd(dev, &(lb_swiglu_args){.dgu = DGU, .dout = r ? GW : NULL,
                .dout16 = r ? NULL : G16, .gu = r ? GUW : NULL, .gu16 = r ? NULL : GU16, .n = n,
                .f = f});
        in16[r][0] = hget(O, s1 * 4), in16[r][1] = hget(DGU, s2 * 4);
    }
    snprintf(what, sizeof what, "swiglu_fwd gu16 n %d f %d", n, f);
    CHECK_NMSE(what, in16[0][0], out, s1, tst->bound);
    CHECK_BITS(what, in16[0][0], in16[1][0], s1 * 4);
    snprintf(what, sizeof what, "swiglu_bwd gu16 dout16 n %d f %d", n, f);
    CHECK_NMSE(what, in16[0][1], dgu, s2, tst->bound);
    CHECK_BITS(what, in16[0][1], in16[1][1], s2 * 4);
    // row weights (an MoE row's routing weight before down): out * rw, dgu from rw * dout, and
    // drw's double sums, against the CPU; rw 1 gives the unweighted bits
    float *rw = lb_malloc((size_t)n * 4);
    for (int i = 0; i < n; i++) rw[i] = i % 7 == 3 ? 1.0f : (float)(0.05 + 0.9 * (i % 13) / 13.0);
    double *drw = lb_malloc((size_t)n * 8);
    cpu->swiglu_fwd(cpu, &(lb_swiglu_args){.out = out, .gu16 = gu16, .rw = rw, .n = n, .f = f});
    cpu->swiglu_bwd(cpu, &(lb_swiglu_args){.dgu = dgu, .dout16 = g16, .gu16 = gu16, .rw = rw,
            .drw = drw, .n = n, .f = f});
    float *RW = dput(rw, (size_t)n * 4);
    double *DRW = dev->alloc(dev, (size_t)n * 8);
    poison(O, s1 * 4), poison(DGU, s2 * 4);
    dev->swiglu_fwd(dev, &(lb_swiglu_args){.out = O, .gu16 = GU16, .rw = RW, .n = n, .f = f});
    dev->swiglu_bwd(dev, &(lb_swiglu_args){.dgu = DGU, .dout16 = G16, .gu16 = GU16, .rw = RW,
            .drw = DRW, .n = n, .f = f});
    float *wo = hget(O, s1 * 4), *wd = hget(DGU, s2 * 4);
    double *wr = lb_malloc((size_t)n * 8);
    dev->download(dev, wr, DRW, (size_t)n * 8);
    snprintf(what, sizeof what, "swiglu_fwd rw n %d f %d", n, f);
    CHECK_NMSE(what, wo, out, s1, tst->bound);
    snprintf(what, sizeof what, "swiglu_bwd rw n %d f %d", n, f);
    CHECK_NMSE(what, wd, dgu, s2, tst->bound);
    for (int i = 0; i < n; i++) {   // drw: the same products, summed in double in two orders
        const double tol = 1e-5 * (fabs(drw[i]) + 1e-3);
        ck_assert_msg(fabs(wr[i] - drw[i]) <= tol, "swiglu_bwd drw row %d: %.9g vs %.9g", i,
                      wr[i], drw[i]);
    }
    for (int i = 0; i < n; i++)   // rw 1: the unweighted rows' bits
        if (rw[i] == 1.0f) {
            ck_assert(!memcmp(wo + (size_t)i * f, in16[0][0] + (size_t)i * f, (size_t)f * 4));
            ck_assert(!memcmp(wd + (size_t)i * 2 * f, in16[0][1] + (size_t)i * 2 * f,
                              (size_t)f * 8));
        }
    for (int r = 0; r < 2; r++) free(in16[r][0]), free(in16[r][1]);
    free(wo), free(wd), free(wr), free(rw), free(drw), dfree(RW), dfree(DRW);
    dfree(GU16), dfree(G16), dfree(GUW), dfree(GW), free(gu16), free(g16);
    for (int r = 0; r < 2; r++) free(keep[r][0]), free(keep[r][1]);
    dfree(GU), dfree(G), dfree(O), dfree(DGU), free(gu), free(g), free(out), free(dgu);
}

// --- router ----------------------------------------------------------------------------------

// Router logits whose probabilities are never within rounding of each other (so the top-k
// choice is not decided by the last bit of an exp): row i is 0.05 * (a random permutation of
// 0 .. e-1) plus noise below 0.005, so distinct logits stay at least 0.04 apart. Rows 0 and 1
// hold exact ties, which must go to the lower index on both backends: row 0 is constant, row 1
// repeats its largest logit at two more places.
static float *router_logits(int n, int e)
{
    float *l = lb_malloc((size_t)n * e * 4);
    uint64_t st = next_stream++;
    int *perm = lb_malloc((size_t)e * sizeof(int));
    for (int i = 0; i < n; i++) {
        for (int j = 0; j < e; j++) perm[j] = j;
        for (int j = e - 1; j > 0; j--) {   // Fisher-Yates
            int r = (int)(lb_rand_u64(seed, st, (uint64_t)i * e + j) % (uint64_t)(j + 1));
            int tmp = perm[j];
            perm[j] = perm[r], perm[r] = tmp;
        }
        for (int j = 0; j < e; j++) {
            float z = lb_rand_normal(seed, st + (1ull << 40), (uint64_t)i * e + j);
            l[(size_t)i * e + j] = 0.05f * perm[j] + 0.001f * fmaxf(-4.0f, fminf(4.0f, z));
        }
    }
    for (int j = 0; j < e; j++) l[j] = 0.5f;
    if (n > 1 && e >= 3) {
        int top = 0;
        for (int j = 1; j < e; j++) top = l[e + j] > l[e + top] ? j : top;
        l[e + (top + 1) % e] = l[e + top];
        l[e + (top + e / 2) % e] = l[e + top];
    }
    free(perm);
    return l;
}

// p: n, e, k, renorm, with_dpe (the load-balancing loss's extra gradient)
static void router_case(const test_case *tst)
{
    const int n = tst->p[0], e = tst->p[1], k = tst->p[2], renorm = tst->p[3];
    const int with_dpe = tst->p[4];
    size_t ne = (size_t)n * e, nk = (size_t)n * k;
    float *l = router_logits(n, e);
    float *probs = lb_malloc(ne * 4), *w = lb_malloc(nk * 4), *dl = lb_malloc(ne * 4);
    int32_t *idx = lb_malloc(nk * 4);
    float *dw = randn(nk, 1), *dpe = randn(e, 0.1f);
    cpu->router_topk_fwd(cpu, &(lb_router_args){.probs = probs, .idx = idx, .weight = w,
            .logits = l, .n = n, .e = e, .k = k, .renorm = renorm});
    cpu->router_topk_bwd(cpu, &(lb_router_args){.dlogits = dl, .dweight = dw,
            .dprobs_expert = with_dpe ? dpe : NULL, .probs = probs, .idx = idx, .n = n, .e = e,
            .k = k, .renorm = renorm});
    float *L = dput(l, ne * 4), *DW = dput(dw, nk * 4), *DPE = dput(dpe, (size_t)e * 4);
    float *P = dev->alloc(dev, ne * 4), *W = dev->alloc(dev, nk * 4), *DL = dev->alloc(dev, ne * 4);
    int32_t *I = dev->alloc(dev, nk * 4);
    float *Pc = dput(probs, ne * 4);
    int32_t *Ic = dput(idx, nk * 4);
    float *keep[2][3];
    int32_t *ikeep[2];
    for (int r = 0; r < 2; r++) {
        poison(P, ne * 4), poison(W, nk * 4), poison(I, nk * 4), poison(DL, ne * 4);
        dev->router_topk_fwd(dev, &(lb_router_args){.probs = P, .idx = I, .weight = W, .logits = L,
                .n = n, .e = e, .k = k, .renorm = renorm});
        // The backward reads the CPU's probs and idx: compared on identical inputs.
        dev->router_topk_bwd(dev, &(lb_router_args){.dlogits = DL, .dweight = DW,
                .dprobs_expert = with_dpe ? DPE : NULL, .probs = Pc, .idx = Ic, .n = n, .e = e,
                .k = k, .renorm = renorm});
        keep[r][0] = hget(P, ne * 4), keep[r][1] = hget(W, nk * 4), keep[r][2] = hget(DL, ne * 4);
        ikeep[r] = hget(I, nk * 4);
    }
    char what[112];
    snprintf(what, sizeof what, "router_topk_fwd probs n %d e %d k %d renorm %d", n, e, k, renorm);
    CHECK_NMSE(what, keep[0][0], probs, ne, tst->bound);
    snprintf(what, sizeof what, "router_topk_fwd idx n %d e %d k %d", n, e, k);
    CHECK_INTS(what, ikeep[0], idx, nk);
    snprintf(what, sizeof what, "router_topk_fwd weight n %d e %d k %d renorm %d", n, e, k, renorm);
    CHECK_NMSE(what, keep[0][1], w, nk, tst->bound);
    snprintf(what, sizeof what, "router_topk_bwd n %d e %d k %d renorm %d aux %d", n, e, k, renorm,
             with_dpe);
    CHECK_NMSE(what, keep[0][2], dl, ne, tst->bound);
    CHECK_BITS("router_topk_fwd probs, run twice", keep[0][0], keep[1][0], ne * 4);
    CHECK_BITS("router_topk_fwd idx, run twice", ikeep[0], ikeep[1], nk * 4);
    CHECK_BITS("router_topk_fwd weight, run twice", keep[0][1], keep[1][1], nk * 4);
    CHECK_BITS("router_topk_bwd, run twice", keep[0][2], keep[1][2], ne * 4);
    for (int s = 0; s < k; s++) ck_assert_int_eq(ikeep[0][s], s);   // row 0: all tied
    for (int r = 0; r < 2; r++)
        free(keep[r][0]), free(keep[r][1]), free(keep[r][2]), free(ikeep[r]);
    dfree(L), dfree(DW), dfree(DPE), dfree(P), dfree(W), dfree(DL), dfree(I), dfree(Pc), dfree(Ic);
    free(l), free(probs), free(w), free(dl), free(idx), free(dw), free(dpe);
}

// p: n, e, k, n_group, topk_group, renorm, with_bias. Distinct logits a row (router_logits), a
// bias of the scores' size so that it moves the choice, scale 2.5.
static void router_sigmoid_case(const test_case *tst)
{
    const int n = tst->p[0], e = tst->p[1], k = tst->p[2], ng = tst->p[3], tg = tst->p[4];
    const int renorm = tst->p[5], with_bias = tst->p[6];
    size_t ne = (size_t)n * e, nk = (size_t)n * k;
    float *l = router_logits(n, e), *bias = randn(e, 0.3f), *dw = randn(nk, 1);
    float *sc = lb_malloc(ne * 4), *w = lb_malloc(nk * 4), *dl = lb_malloc(ne * 4);
    int32_t *idx = lb_malloc(nk * 4);
    lb_router_sigmoid_args a = {.n = n, .e = e, .k = k, .n_group = ng, .topk_group = tg,
                                .renorm = renorm, .scale = 2.5f};
    lb_router_sigmoid_args c = a;
    c.logits = l, c.bias = with_bias ? bias : NULL, c.scores = sc, c.idx = idx, c.weight = w;
    c.dweight = dw, c.dlogits = dl;
    cpu->router_sigmoid_fwd(cpu, &c);
    cpu->router_sigmoid_bwd(cpu, &c);
    float *L = dput(l, ne * 4), *B = dput(bias, (size_t)e * 4), *DW = dput(dw, nk * 4);
    float *S = dev->alloc(dev, ne * 4), *W = dev->alloc(dev, nk * 4), *DL = dev->alloc(dev, ne * 4);
    int32_t *I = dev->alloc(dev, nk * 4);
    float *keep[2][3];
    int32_t *ikeep[2];
    for (int r = 0; r < 2; r++) {
        poison(S, ne * 4), poison(W, nk * 4), poison(I, nk * 4), poison(DL, ne * 4);
        lb_router_sigmoid_args d = a;
        d.logits = L, d.bias = with_bias ? B : NULL, d.scores = S, d.idx = I, d.weight = W;
        d.dweight = DW, d.dlogits = DL;
        dev->router_sigmoid_fwd(dev, &d);
        dev->router_sigmoid_bwd(dev, &d);
        keep[r][0] = hget(S, ne * 4), keep[r][1] = hget(W, nk * 4), keep[r][2] = hget(DL, ne * 4);
        ikeep[r] = hget(I, nk * 4);
    }
    char what[128];
    snprintf(what, sizeof what, "router_sigmoid_fwd scores n %d e %d", n, e);
    CHECK_NMSE(what, keep[0][0], sc, ne, tst->bound);
    snprintf(what, sizeof what, "router_sigmoid_fwd idx n %d e %d k %d groups %d/%d bias %d", n,
             e, k, tg, ng, with_bias);
    CHECK_INTS(what, ikeep[0], idx, nk);
    snprintf(what, sizeof what, "router_sigmoid_fwd weight renorm %d", renorm);
    CHECK_NMSE(what, keep[0][1], w, nk, tst->bound);
    snprintf(what, sizeof what, "router_sigmoid_bwd renorm %d", renorm);
    CHECK_NMSE(what, keep[0][2], dl, ne, tst->bound);
    CHECK_BITS("router_sigmoid_fwd idx, run twice", ikeep[0], ikeep[1], nk * 4);
    CHECK_BITS("router_sigmoid_fwd weight, run twice", keep[0][1], keep[1][1], nk * 4);
    CHECK_BITS("router_sigmoid_bwd, run twice", keep[0][2], keep[1][2], ne * 4);
    // the bias update: cheaper experts gain, busier ones lose, the mean's stay
    float *load = lb_malloc((size_t)e * 4), *b2 = hdup(bias, (size_t)e * 4);
    for (int j = 0; j < e; j++) load[j] = (float)(j % 3);   // mean 1 when 3 divides e
    float *LD = dput(load, (size_t)e * 4);
    cpu->router_bias_update(cpu, b2, load, e, 1e-3f);
    dev->router_bias_update(dev, B, LD, e, 1e-3f);
    float *bd = hget(B, (size_t)e * 4);
    CHECK_BITS("router_bias_update", bd, b2, (size_t)e * 4);
    for (int j = 0; e % 3 == 0 && j < e; j++)
        ck_assert(b2[j] == bias[j] + (j % 3 == 0 ? 1e-3f : j % 3 == 2 ? -1e-3f : 0.0f));
    for (int r = 0; r < 2; r++)
        free(keep[r][0]), free(keep[r][1]), free(keep[r][2]), free(ikeep[r]);
    dfree(L), dfree(B), dfree(DW), dfree(S), dfree(W), dfree(DL), dfree(I), dfree(LD);
    free(l), free(bias), free(dw), free(sc), free(w), free(dl), free(idx), free(load), free(b2);
    free(bd);
}

static void moe_aux_loss_case(const test_case *tst)
{
    const int n = 300, e = 53, k = 3;
    float *l = router_logits(n, e), *probs = lb_malloc((size_t)n * e * 4);
    float *w = lb_malloc((size_t)n * k * 4), dref[53], loss_c = NAN;
    int32_t *idx = lb_malloc((size_t)n * k * 4);
    cpu->router_topk_fwd(cpu, &(lb_router_args){.probs = probs, .idx = idx, .weight = w,
            .logits = l, .n = n, .e = e, .k = k, .renorm = 1});
    cpu->moe_aux_loss(cpu, &loss_c, dref, probs, idx, n, e, k);
    float *P = dput(probs, (size_t)n * e * 4), *D = dev->alloc(dev, (size_t)e * 4);
    int32_t *I = dput(idx, (size_t)n * k * 4);
    float loss[2], *dpe[2];
    for (int r = 0; r < 2; r++) {
        poison(D, (size_t)e * 4);
        loss[r] = NAN;
        dev->moe_aux_loss(dev, &loss[r], D, P, I, n, e, k);
        dpe[r] = hget(D, (size_t)e * 4);
    }
    // The loss is a double sum in another order (the per-expert probability sums run in
    // chunks) rounded once to fp32: at most 2 ulp apart. dprobs_expert comes from exact counts
    // through the CPU's double expressions: equal bits.
    double rel = fabs((double)loss[0] - loss_c) / fabs(loss_c);
    if (verbose()) printf("  moe_aux_loss loss rel err %.3g (bound 2.4e-7)\n", rel);
    ck_assert_msg(isfinite(loss[0]) && rel <= 2.4e-7, "aux loss %.9g vs %.9g", loss[0], loss_c);
    CHECK_BITS("moe_aux_loss dprobs_expert", dpe[0], dref, (size_t)e * 4);
    CHECK_BITS("moe_aux_loss loss, run twice", &loss[0], &loss[1], 4);
    CHECK_BITS("moe_aux_loss dprobs_expert, run twice", dpe[0], dpe[1], (size_t)e * 4);
    dfree(P), dfree(D), dfree(I);
    free(l), free(probs), free(w), free(idx), free(dpe[0]), free(dpe[1]);
}

// --- dispatch --------------------------------------------------------------------------------

// Distinct experts per token (as top-k gives), skewed: a few experts take most assignments and
// the last two receive none.
static int32_t *skewed_idx(int n, int e, int k)
{
    int32_t *idx = lb_malloc((size_t)n * k * 4);
    uint64_t st = next_stream;
    next_stream += 2;   // streams st and st + 1
    for (int i = 0; i < n; i++) {
        int base = (int)(lb_rand_u64(seed, st, i) % 5);
        for (int s = 0; s < k; s++) {
            int jitter = (int)(lb_rand_u64(seed, st + 1, (uint64_t)i * k + s) % 2);
            int j = (base + s * 3 + jitter) % (e - 2);
            for (int t = 0; t < s; t++)
                if (idx[(size_t)i * k + t] == j) j = (j + 1) % (e - 2), t = -1;   // distinct
            idx[(size_t)i * k + s] = j;
        }
    }
    return idx;
}

// p: n, e, k, c
static void dispatch_case(const test_case *tst)
{
    const int n = tst->p[0], e = tst->p[1], k = tst->p[2], c = tst->p[3];
    size_t nk = (size_t)n * k, nc = (size_t)n * c, kc = nk * c;
    int32_t *idx = skewed_idx(n, e, k), *row = lb_malloc(nk * 4);
    int *counts = lb_malloc((size_t)e * sizeof(int));
    cpu->moe_plan(cpu, row, counts, NULL, idx, n, e, k);
    int32_t *I = dput(idx, nk * 4), *R = dev->alloc(dev, nk * 4);
    int *C = dev->alloc(dev, (size_t)e * sizeof(int));
    char what[96];
    for (int r = 0; r < 3; r++) {   // host counts, device counts, both
        poison(R, nk * 4);
        poison(C, (size_t)e * sizeof(int));
        int *cg = lb_malloc((size_t)e * sizeof(int));
        memset(cg, 0xff, (size_t)e * sizeof(int));
        dev->moe_plan(dev, R, r == 1 ? NULL : cg, r ? C : NULL, I, n, e, k);
        int32_t *rg = hget(R, nk * 4);
        snprintf(what, sizeof what, "moe_plan row n %d e %d k %d", n, e, k);
        CHECK_INTS(what, rg, row, nk);
        if (r != 1) {
            snprintf(what, sizeof what, "moe_plan counts n %d e %d k %d", n, e, k);
            CHECK_INTS(what, cg, counts, e);
        }
        if (r) {
            int *cd = hget(C, (size_t)e * sizeof(int));
            snprintf(what, sizeof what, "moe_plan device counts n %d e %d k %d (pass %d)", n, e,
                     k, r);
            CHECK_INTS(what, cd, counts, e);
            free(cd);
        }
        free(rg), free(cg);
    }
    dev->free(dev, C);
    ck_assert_int_eq(counts[e - 1], 0);

    // permute / permute_bwd / combine / combine_bwd on the plan's rows. The slot sums run in
    // slot order in double on both sides (products of two fp32 values are exact in double),
    // so their bits must match; dweight's double dot runs in another order (B_DOT).
    float *x = randn(nc, 1), *dxp = randn(kc, 1), *yp = randn(kc, 1), *w = randn(nk, 1);
    float *g = randn(nc, 1);
    float *xp = lb_malloc(kc * 4), *dx = lb_malloc(nc * 4), *out = lb_malloc(nc * 4);
    float *dyp = lb_malloc(kc * 4), *dw = lb_malloc(nk * 4);
    cpu->moe_permute(cpu, xp, NULL, lb_act_f32(x, n, c), row, k);
    cpu->moe_permute_bwd(cpu, dx, dxp, NULL, row, n, k, c);
    cpu->moe_combine(cpu, &(lb_moe_combine_args){.out = out, .yp = yp, .weight = w, .row = row,
            .n = n, .k = k, .c = c});
    cpu->moe_combine_bwd(cpu, &(lb_moe_combine_args){.dyp = dyp, .dweight = dw, .dout = g,
            .yp = yp, .weight = w, .row = row, .n = n, .k = k, .c = c});
    float *X = dput(x, nc * 4), *DXP = dput(dxp, kc * 4), *YP = dput(yp, kc * 4);
    float *W = dput(w, nk * 4), *G = dput(g, nc * 4);
    float *XP = dev->alloc(dev, kc * 4), *DX = dev->alloc(dev, nc * 4);
    float *O = dev->alloc(dev, nc * 4), *DYP = dev->alloc(dev, kc * 4);
    float *DW = dev->alloc(dev, nk * 4);
    int32_t *Rc = dput(row, nk * 4);
    // the second run writes the bf16 copies too (the same fp32 bits)
    void *XP16 = dpoisoned(bytes16(nk, c)), *DYP16 = dpoisoned(bytes16(nk, c));
    float *keep[2][5];
    for (int r = 0; r < 2; r++) {
        poison(XP, kc * 4), poison(DX, nc * 4), poison(O, nc * 4), poison(DYP, kc * 4);
        poison(DW, nk * 4);
        dev->moe_permute(dev, XP, r ? XP16 : NULL, lb_act_f32(X, n, c), Rc, k);
        dev->moe_permute_bwd(dev, DX, DXP, NULL, Rc, n, k, c);
        dev->moe_combine(dev, &(lb_moe_combine_args){.out = O, .yp = YP, .weight = W, .row = Rc,
                .n = n, .k = k, .c = c});
        dev->moe_combine_bwd(dev, &(lb_moe_combine_args){.dyp = DYP, .dyp16 = r ? DYP16 : NULL,
                .dweight = DW, .dout = G, .yp = YP, .weight = W, .row = Rc, .n = n, .k = k,
                .c = c});
        keep[r][0] = hget(XP, kc * 4), keep[r][1] = hget(DX, nc * 4);
        keep[r][2] = hget(O, nc * 4), keep[r][3] = hget(DYP, kc * 4);
        keep[r][4] = hget(DW, nk * 4);
    }
    CHECK_BITS("moe_permute", keep[0][0], xp, kc * 4);
    CHECK_BITS("moe_permute_bwd (double, slot order)", keep[0][1], dx, nc * 4);
    CHECK_BITS("moe_combine (double, slot order)", keep[0][2], out, nc * 4);
    CHECK_BITS("moe_combine_bwd dyp (one multiply)", keep[0][3], dyp, kc * 4);
    CHECK_NMSE("moe_combine_bwd dweight", keep[0][4], dw, nk, tst->bound);
    for (int i = 0; i < 5; i++) CHECK_BITS("moe dispatch op, run twice", keep[0][i], keep[1][i],
                                           (i == 1 || i == 2 ? nc : i == 4 ? nk : kc) * 4);
    check_copy16("moe_permute xp16", XP16, keep[1][0], nk, c);
    check_copy16("moe_combine_bwd dyp16", DYP16, keep[1][3], nk, c);
    poison(XP16, bytes16(nk, c)), poison(DYP16, bytes16(nk, c)), poison(DW, nk * 4);
    dev->moe_permute(dev, NULL, XP16, lb_act_f32(X, n, c), Rc, k);   // the copies alone
    dev->moe_combine_bwd(dev, &(lb_moe_combine_args){.dyp16 = DYP16, .dweight = DW, .dout = G,
            .yp = YP, .weight = W, .row = Rc, .n = n, .k = k, .c = c});
    check_copy16("moe_permute xp16 alone", XP16, keep[1][0], nk, c);
    // from bf16 rows (a norm stored in bf16): the rows copied as they are, and widened
    {
        uint16_t *x16 = host16(x, n, c);
        float *xw = lb_malloc(kc * 4);
        cpu->moe_permute(cpu, xw, NULL, lb_act_bf16(x16, n, c), row, k);
        void *X16 = dput(x16, bytes16(n, c));
        poison(XP16, bytes16(nk, c)), poison(XP, kc * 4);
        dev->moe_permute(dev, XP, XP16, lb_act_bf16(X16, n, c), Rc, k);
        float *got = hget(XP, kc * 4);
        CHECK_BITS("moe_permute from bf16 rows", got, xw, kc * 4);
        check_copy16("moe_permute xp16 from bf16 rows", XP16, got, nk, c);
        for (size_t j = 0; j < kc; j++)   // the widened rows are the rounded fp32 ones
            ck_assert_msg(xw[j] == lb_round_bf16(xp[j]), "moe_permute from bf16: element %zu", j);
        free(got), free(xw), free(x16), dfree(X16);
    }
    check_copy16("moe_combine_bwd dyp16 alone", DYP16, keep[1][3], nk, c);
    float *dw16 = hget(DW, nk * 4);
    CHECK_BITS("moe_combine_bwd dweight, dyp16 alone", dw16, keep[1][4], nk * 4);
    free(dw16), dfree(XP16), dfree(DYP16);
    // bf16 inputs (dxp16, yp16: the expert GEMMs' c16; the fp32 ones NULL): the same bits as
    // the CPU on them (the double slot sums and one multiply), dweight within B_DOT
    uint16_t *dxp16 = host16(dxp, nk, c), *yp16 = host16(yp, nk, c);
    cpu->moe_permute_bwd(cpu, dx, NULL, dxp16, row, n, k, c);
    cpu->moe_combine(cpu, &(lb_moe_combine_args){.out = out, .yp16 = yp16, .weight = w, .row = row,
            .n = n, .k = k, .c = c});
    cpu->moe_combine_bwd(cpu, &(lb_moe_combine_args){.dyp = dyp, .dweight = dw, .dout = g,
            .yp16 = yp16, .weight = w, .row = row, .n = n, .k = k, .c = c});
    void *DXP16 = dput(dxp16, bytes16(nk, c)), *YP16 = dput(yp16, bytes16(nk, c));
    poison(DX, nc * 4), poison(O, nc * 4), poison(DYP, kc * 4), poison(DW, nk * 4);
    dev->moe_permute_bwd(dev, DX, NULL, DXP16, Rc, n, k, c);
    dev->moe_combine(dev, &(lb_moe_combine_args){.out = O, .yp16 = YP16, .weight = W, .row = Rc,
            .n = n, .k = k, .c = c});
    dev->moe_combine_bwd(dev, &(lb_moe_combine_args){.dyp = DYP, .dweight = DW, .dout = G,
            .yp16 = YP16, .weight = W, .row = Rc, .n = n, .k = k, .c = c});
    float *got[4] = {hget(DX, nc * 4), hget(O, nc * 4), hget(DYP, kc * 4), hget(DW, nk * 4)};
    CHECK_BITS("moe_permute_bwd dxp16", got[0], dx, nc * 4);
    CHECK_BITS("moe_combine yp16", got[1], out, nc * 4);
    CHECK_BITS("moe_combine_bwd dyp, yp16", got[2], dyp, kc * 4);
    CHECK_NMSE("moe_combine_bwd dweight, yp16", got[3], dw, nk, tst->bound);
    for (int i = 0; i < 4; i++) free(got[i]);
    // without weights (the rows weighted already): the plain slot sums, and dyp dout's rows,
    // bit for bit, no dweight written
    cpu->moe_combine(cpu, &(lb_moe_combine_args){.out = out, .yp16 = yp16, .row = row, .n = n,
            .k = k, .c = c});
    cpu->moe_combine_bwd(cpu, &(lb_moe_combine_args){.dyp = dyp, .dout = g, .row = row, .n = n,
            .k = k, .c = c});
    poison(O, nc * 4), poison(DYP, kc * 4), poison(DW, nk * 4);
    dev->moe_combine(dev, &(lb_moe_combine_args){.out = O, .yp16 = YP16, .row = Rc, .n = n,
            .k = k, .c = c});
    dev->moe_combine_bwd(dev, &(lb_moe_combine_args){.dyp = DYP, .dout = G, .row = Rc, .n = n,
            .k = k, .c = c});
    float *nw[3] = {hget(O, nc * 4), hget(DYP, kc * 4), hget(DW, nk * 4)};
    CHECK_BITS("moe_combine without weights", nw[0], out, nc * 4);
    CHECK_BITS("moe_combine_bwd without weights", nw[1], dyp, kc * 4);
    for (size_t i = 0; i < (size_t)nk; i++)   // untouched: still the poison's bits
        ck_assert(isnan(nw[2][i]));
    for (int i = 0; i < 3; i++) free(nw[i]);
    dfree(DXP16), dfree(YP16), free(dxp16), free(yp16);
    for (int r = 0; r < 2; r++)
        for (int i = 0; i < 5; i++) free(keep[r][i]);
    dfree(I), dfree(R), dfree(X), dfree(DXP), dfree(YP), dfree(W), dfree(G), dfree(XP);
    dfree(DX), dfree(O), dfree(DYP), dfree(DW), dfree(Rc);
    free(idx), free(row), free(counts), free(x), free(dxp), free(yp), free(w), free(g);
    free(xp), free(dx), free(out), free(dyp), free(dw);
}

// --- cross-entropy ---------------------------------------------------------------------------

// p: n, v
static void ce_case(const test_case *tst)
{
    const int n = tst->p[0], v = tst->p[1];
    size_t nv = (size_t)n * v;
    float *l = randn(nv, 3), *loss = lb_malloc((size_t)n * 4), *dl = lb_malloc(nv * 4);
    int32_t *tgt = randint(n, 0, v);
    tgt[n / 3] = -1, tgt[n - 1] = -100;   // ignored rows
    // bwd_rows: one weight per row, of either sign (GRPO's d loss / d logprob); one row 0.37,
    // the scalar op's dloss, so that row must equal cross_entropy_bwd's bit for bit
    float *w = randn((size_t)n, 1), *dlr = lb_malloc(nv * 4);
    w[n / 2] = 0.37f;
    cpu->cross_entropy_fwd(cpu, loss, NULL, l, tgt, n, v);
    cpu->cross_entropy_bwd(cpu, dl, l, NULL, tgt, 0.37f, n, v);
    cpu->cross_entropy_bwd_rows(cpu, dlr, l, NULL, tgt, w, n, v);
    float *L = dput(l, nv * 4), *LS = dev->alloc(dev, (size_t)n * 4), *DL = dev->alloc(dev, nv * 4);
    float *W = dput(w, (size_t)n * 4), *DR = dev->alloc(dev, nv * 4);
    int32_t *T = dput(tgt, (size_t)n * 4);
    double *ST = dev->alloc(dev, (size_t)n * 2 * sizeof(double));
    float *keep[2][5];
    for (int r = 0; r < 2; r++) {   // the second run's forward also writes the statistics
        poison(LS, (size_t)n * 4), poison(DL, nv * 4), poison(DR, nv * 4);
        dev->cross_entropy_fwd(dev, LS, r ? ST : NULL, L, T, n, v);
        dev->cross_entropy_bwd(dev, DL, L, NULL, T, 0.37f, n, v);
        dev->cross_entropy_bwd_rows(dev, DR, L, NULL, T, W, n, v);
        keep[r][0] = hget(LS, (size_t)n * 4), keep[r][1] = hget(DL, nv * 4);
        keep[r][3] = hget(DR, nv * 4);
        float *IN = dput(l, nv * 4);   // dlogits aliasing logits
        dev->cross_entropy_bwd(dev, IN, IN, NULL, T, 0.37f, n, v);
        keep[r][2] = hget(IN, nv * 4);
        dev->upload(dev, IN, l, nv * 4);
        dev->cross_entropy_bwd_rows(dev, IN, IN, NULL, T, W, n, v);
        keep[r][4] = hget(IN, nv * 4);
        dfree(IN);
    }
    {   // the backward from the forward's statistics, in place as the model runs it: the same
        // bits as the backward that computes them
        float *IN = dput(l, nv * 4);
        dev->cross_entropy_bwd(dev, IN, IN, ST, T, 0.37f, n, v);
        float *got = hget(IN, nv * 4);
        CHECK_BITS("cross_entropy_bwd with the forward's statistics", got, keep[0][1], nv * 4);
        free(got);
        dev->upload(dev, IN, l, nv * 4);
        dev->cross_entropy_bwd_rows(dev, IN, IN, ST, T, W, n, v);
        got = hget(IN, nv * 4);
        CHECK_BITS("cross_entropy_bwd_rows with the forward's statistics", got, keep[0][3],
                   nv * 4);
        free(got);
        dfree(IN), dfree(ST);
    }
    char what[96];
    snprintf(what, sizeof what, "cross_entropy_fwd n %d v %d", n, v);
    CHECK_NMSE(what, keep[0][0], loss, (size_t)n, tst->bound);
    snprintf(what, sizeof what, "cross_entropy_bwd n %d v %d", n, v);
    CHECK_NMSE(what, keep[0][1], dl, nv, tst->bound);
    CHECK_BITS("cross_entropy_bwd in place", keep[0][2], keep[0][1], nv * 4);
    CHECK_BITS("cross_entropy_fwd, run twice (with and without statistics)", keep[0][0],
               keep[1][0], (size_t)n * 4);
    CHECK_BITS("cross_entropy_bwd, run twice", keep[0][1], keep[1][1], nv * 4);
    snprintf(what, sizeof what, "cross_entropy_bwd_rows n %d v %d", n, v);
    CHECK_NMSE(what, keep[0][3], dlr, nv, tst->bound);
    CHECK_BITS("cross_entropy_bwd_rows in place", keep[0][4], keep[0][3], nv * 4);
    CHECK_BITS("cross_entropy_bwd_rows, run twice", keep[0][3], keep[1][3], nv * 4);
    CHECK_BITS("cross_entropy_bwd_rows row of weight 0.37 vs bwd",
               keep[0][3] + (size_t)(n / 2) * v, keep[0][1] + (size_t)(n / 2) * v, (size_t)v * 4);
    ck_assert(keep[0][0][n / 3] == 0.0f && keep[0][0][n - 1] == 0.0f);
    for (int j = 0; j < v; j++)
        ck_assert(keep[0][1][(size_t)(n / 3) * v + j] == 0.0f &&
                  keep[0][3][(size_t)(n / 3) * v + j] == 0.0f);
    for (int r = 0; r < 2; r++)
        for (int i = 0; i < 5; i++) free(keep[r][i]);
    dfree(L), dfree(LS), dfree(DL), dfree(T), dfree(W), dfree(DR);
    free(l), free(loss), free(dl), free(tgt), free(w), free(dlr);
}

// linear_ce_bwd against the CPU: the two backends' gradients differ by about one fp32
// rounding (expf against exp in double, B_ROUND above), so after the rounding to bf16 a few
// elements in 10^4 sit one bf16 step apart; a model of it (numpy, these shapes) gives NMSE up
// to 4e-12 in dx and dw. A wrong row, column or target costs 1e-3 or more.
#define B_CE_BF16 1e-9

// The LM head's backward from its logits (linear_ce_bwd), n rows of v logits over c features,
// against the CPU, and bit for bit against the GPU's own cross_entropy_bwd and gemm_grouped,
// the two calls it replaces (from the same forward statistics), which round w where
// linear_ce_bwd reads its bf16 copy (to_bf16).
// p: n, v, c; f: dw_beta
static void linear_ce_case(const test_case *tst)
{
    const int n = tst->p[0], v = tst->p[1], c = tst->p[2];
    const float dw_beta = tst->f[0];
    const size_t nv = (size_t)n * v, nc = (size_t)n * c, vc = (size_t)v * c;
    float *l = randn(nv, 3), *x = randn(nc, 1), *w = randn(vc, 0.1f), *dw0 = randn(vc, 1);
    int32_t *tgt = randint(n, 0, v);
    tgt[n / 3] = -1;   // an ignored row
    double *st = lb_malloc((size_t)n * 2 * sizeof(double));
    float *loss = lb_malloc((size_t)n * 4), *lc = hdup(l, nv * 4), *dx = lb_malloc(nc * 4);
    float *dw = hdup(dw0, vc * 4);
    cpu->cross_entropy_fwd(cpu, loss, st, l, tgt, n, v);
    cpu->linear_ce_bwd(cpu, &(lb_linear_ce_args){.dx = dx, .dx_beta = 0.0f, .dw = dw,
            .dw_beta = dw_beta, .logits = lc, .stats = st, .targets = tgt, .dloss = 0.37f, .x = x,
            .w = w, .n = n, .v = v, .c = c});

    float *L = dput(l, nv * 4), *X = dput(x, nc * 4), *W = dput(w, vc * 4);
    float *LS = dev->alloc(dev, (size_t)n * 4);
    int32_t *T = dput(tgt, (size_t)n * 4);
    double *ST = dev->alloc(dev, (size_t)n * 2 * sizeof(double));
    dev->cross_entropy_fwd(dev, LS, ST, L, T, n, v);
    float *DX[2], *DW[2];
    for (int r = 0; r < 2; r++) {
        DX[r] = dpoisoned(nc * 4);
        DW[r] = dw_beta == 0.0f ? dpoisoned(vc * 4) : dput(dw0, vc * 4);
    }
    // w's bf16 copy (a weight cache's) for the dgrad; the calls below round w themselves
    const int ldw = (c + 7) / 8 * 8;
    uint16_t *W16 = dev->alloc(dev, (size_t)v * ldw * 2);
    dev->to_bf16(dev, W16, W, v, c, ldw);
    dev->linear_ce_bwd(dev, &(lb_linear_ce_args){.dx = DX[0], .dx_beta = 0.0f, .dw = DW[0],
            .dw_beta = dw_beta, .logits = L, .stats = ST, .targets = T, .dloss = 0.37f, .x = X,
            .w = W, .w16 = W16, .n = n, .v = v, .c = c});
    dev->upload(dev, L, l, nv * 4);   // linear_ce_bwd leaves the logits undefined
    dev->cross_entropy_bwd(dev, L, L, ST, T, 0.37f, n, v);
    lb_gemm_args g[2] = {{0, 0, n, c, v, 1.0f, 0.0f, L, W, DX[1], 1, NULL, NULL, NULL},
                         {1, 0, v, c, n, 1.0f, dw_beta, L, X, DW[1], 1, NULL, NULL, NULL}};
    dev->gemm_grouped(dev, 2, g);
    float *gx[2], *gw[2];
    for (int r = 0; r < 2; r++) gx[r] = hget(DX[r], nc * 4), gw[r] = hget(DW[r], vc * 4);
    char what[96];
    snprintf(what, sizeof what, "linear_ce_bwd dx, n %d v %d c %d", n, v, c);
    CHECK_NMSE(what, gx[0], dx, nc, tst->bound);
    snprintf(what, sizeof what, "linear_ce_bwd dw, n %d v %d c %d, beta %g", n, v, c, dw_beta);
    CHECK_NMSE(what, gw[0], dw, vc, tst->bound);
    CHECK_BITS("linear_ce_bwd dx against cross_entropy_bwd and gemm_grouped", gx[0], gx[1],
               nc * 4);
    CHECK_BITS("linear_ce_bwd dw against cross_entropy_bwd and gemm_grouped", gw[0], gw[1],
               vc * 4);
    for (int r = 0; r < 2; r++) free(gx[r]), free(gw[r]), dfree(DX[r]), dfree(DW[r]);
    dfree(L), dfree(X), dfree(W), dfree(W16), dfree(LS), dfree(T), dfree(ST);
    free(l), free(x), free(w), free(dw0), free(tgt), free(st), free(loss), free(lc), free(dx);
    free(dw);
}

// The LM head over bf16 logits (an LM head bf16 in every pass stores them so): n rows of v
// logits in bf16, rows pad8(v), over c features. cross_entropy_fwd16 must give
// cross_entropy_fwd's bits on the widened logits, on each backend; linear_ce_bwd with logits16
// the bits of linear_ce_bwd on those fp32 logits, on each backend (the same gradient, rounded to
// bf16 where the fp32 path rounds it), and the device's results the CPU's within the bounds of
// the fp32 cases.
// p: n, v, c; f: dw_beta
static void ce16_case(const test_case *tst)
{
    const int n = tst->p[0], v = tst->p[1], c = tst->p[2], ld = (v + 7) / 8 * 8;
    const float dw_beta = tst->f[0];
    const size_t nv = (size_t)n * v, nl = (size_t)n * ld, nc = (size_t)n * c, vc = (size_t)v * c;
    float *l = randn(nv, 3), *x = randn(nc, 1), *w = randn(vc, 0.1f), *dw0 = randn(vc, 1);
    uint16_t *l16 = lb_calloc(nl, 2);
    for (int i = 0; i < n; i++)
        for (int j = 0; j < v; j++) {
            l16[(size_t)i * ld + j] = lb_f32_to_bf16(l[(size_t)i * v + j]);
            l[(size_t)i * v + j] = lb_bf16_to_f32(l16[(size_t)i * ld + j]);   // widened
        }
    int32_t *tgt = randint(n, 0, v);
    tgt[n / 3] = -1;   // an ignored row
    lb_backend *bes[2] = {cpu, dev};
    float *loss[2][2], *dx[2][2], *dw[2][2];
    for (int b = 0; b < 2; b++) {
        lb_backend *B = bes[b];
        float *L = B->alloc(B, nv * 4), *X = B->alloc(B, nc * 4), *W = B->alloc(B, vc * 4);
        uint16_t *L16 = B->alloc(B, nl * 2);
        int32_t *T = B->alloc(B, (size_t)n * 4);
        double *ST = B->alloc(B, (size_t)n * 2 * sizeof(double));
        float *LS = B->alloc(B, (size_t)n * 4), *DX = B->alloc(B, nc * 4), *DW = B->alloc(B, vc * 4);
        B->upload(B, X, x, nc * 4), B->upload(B, W, w, vc * 4), B->upload(B, T, tgt, (size_t)n * 4);
        for (int r = 0; r < 2; r++) {   // r 0: fp32 logits; 1: bf16
            B->upload(B, L, l, nv * 4), B->upload(B, L16, l16, nl * 2);
            B->upload(B, DW, dw0, vc * 4);
            if (r) B->cross_entropy_fwd16(B, LS, ST, L16, T, n, v);
            else B->cross_entropy_fwd(B, LS, ST, L, T, n, v);
            B->linear_ce_bwd(B, &(lb_linear_ce_args){.dx = DX, .dx_beta = 0.0f, .dw = DW,
                    .dw_beta = dw_beta, .logits = r ? NULL : L, .logits16 = r ? L16 : NULL,
                    .stats = ST, .targets = T, .dloss = 0.37f, .x = X, .w = W, .n = n, .v = v,
                    .c = c});
            loss[b][r] = lb_malloc((size_t)n * 4), dx[b][r] = lb_malloc(nc * 4);
            dw[b][r] = lb_malloc(vc * 4);
            B->download(B, loss[b][r], LS, (size_t)n * 4);
            B->download(B, dx[b][r], DX, nc * 4);
            B->download(B, dw[b][r], DW, vc * 4);
        }
        void *bufs[] = {L, X, W, L16, T, ST, LS, DX, DW};
        for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) B->free(B, bufs[i]);
    }
    for (int b = 0; b < 2; b++) {
        CHECK_BITS("cross_entropy_fwd16 against cross_entropy_fwd", loss[b][1], loss[b][0],
                   (size_t)n * 4);
        CHECK_BITS("linear_ce_bwd logits16 dx against fp32 logits", dx[b][1], dx[b][0], nc * 4);
        CHECK_BITS("linear_ce_bwd logits16 dw against fp32 logits", dw[b][1], dw[b][0], vc * 4);
    }
    char what[96];
    snprintf(what, sizeof what, "cross_entropy_fwd16 n %d v %d", n, v);
    CHECK_NMSE(what, loss[1][1], loss[0][1], (size_t)n, B_ROUND);
    snprintf(what, sizeof what, "linear_ce_bwd logits16 dx, n %d v %d c %d", n, v, c);
    CHECK_NMSE(what, dx[1][1], dx[0][1], nc, tst->bound);
    snprintf(what, sizeof what, "linear_ce_bwd logits16 dw, n %d v %d c %d", n, v, c);
    CHECK_NMSE(what, dw[1][1], dw[0][1], vc, tst->bound);
    for (int b = 0; b < 2; b++)
        for (int r = 0; r < 2; r++) free(loss[b][r]), free(dx[b][r]), free(dw[b][r]);
    free(l), free(x), free(w), free(dw0), free(l16), free(tgt);
}

// --- AdamW -----------------------------------------------------------------------------------

static void adamw_case(const test_case *tst)
{
    const size_t n = 100003;
    float *p0 = randn(n, 1), *g = randn(n, 1), *m0 = randn(n, 0.1f), *v0 = randn(n, 0.01f);
    for (size_t i = 0; i < n; i++) v0[i] = fabsf(v0[i]);
    float *p = hdup(p0, n * 4), *m = hdup(m0, n * 4), *v = hdup(v0, n * 4);
    uint16_t *p16 = lb_malloc(n * 2);
    cpu->adamw(cpu, &(lb_adamw_args){.p = p, .g = g, .gscale = 0.37f, .m = m, .v = v, .p16 = p16,
            .n = n, .lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .wd = 0.1f,
            .step = 3});
    float *P = dev->alloc(dev, n * 4), *G = dput(g, n * 4), *M = dev->alloc(dev, n * 4);
    float *Vd = dev->alloc(dev, n * 4);
    uint16_t *P16 = dpoisoned(n * 2), *got16[2];
    float *keep[3][3];
    // Runs 0 and 1: 16-byte aligned arrays (the float4 path and its 3-element tail); run 2 from
    // element 1 (the scalar path): every element is computed alike, so all three agree bitwise.
    // Runs 1 and 2 write the bf16 copy too (p16).
    for (int r = 0; r < 3; r++) {
        const size_t o = r == 2;
        dev->upload(dev, P, p0, n * 4), dev->upload(dev, M, m0, n * 4);
        dev->upload(dev, Vd, v0, n * 4);
        dev->adamw(dev, &(lb_adamw_args){.p = P + o, .g = G + o, .gscale = 0.37f, .m = M + o,
                .v = Vd + o, .p16 = r ? P16 + o : NULL, .n = n - o, .lr = 1e-3f, .beta1 = 0.9f,
                .beta2 = 0.95f, .eps = 1e-8f, .wd = 0.1f, .step = 3});
        keep[r][0] = hget(P, n * 4), keep[r][1] = hget(M, n * 4), keep[r][2] = hget(Vd, n * 4);
        if (r) got16[r - 1] = hget(P16, n * 2);
    }
    CHECK_BITS("adamw p16", got16[0], p16, n * 2);
    CHECK_BITS("adamw p16, unaligned", got16[1] + 1, p16 + 1, (n - 1) * 2);
    free(got16[0]), free(got16[1]), free(p16), dfree(P16);
    // The CUDA kernel rounds every operation alone in the CPU's order: equal bit for bit.
    CHECK_BITS("adamw p", keep[0][0], p, n * 4);
    CHECK_BITS("adamw m", keep[0][1], m, n * 4);
    CHECK_BITS("adamw v", keep[0][2], v, n * 4);
    for (int i = 0; i < 3; i++) {
        CHECK_BITS("adamw, run twice", keep[0][i], keep[1][i], n * 4);
        CHECK_BITS("adamw, unaligned", keep[0][i] + 1, keep[2][i] + 1, (n - 1) * 4);
    }
    for (int r = 0; r < 3; r++)
        for (int i = 0; i < 3; i++) free(keep[r][i]);
    dfree(P), dfree(G), dfree(M), dfree(Vd);
    free(p0), free(g), free(m0), free(v0), free(p), free(m), free(v);
}

// adamw16 (bf16 moments): the CUDA kernel's p, p16 and moments bit for bit the CPU's, on the
// 8-byte vector path and the scalar one.
static void adamw16_case(const test_case *tst)
{
    const size_t n = 100003;
    float *p0 = randn(n, 1), *g = randn(n, 1), *mf = randn(n, 0.1f), *vf = randn(n, 0.01f);
    uint16_t *m0 = lb_malloc(n * 2), *v0 = lb_malloc(n * 2);
    for (size_t i = 0; i < n; i++)
        m0[i] = lb_f32_to_bf16(mf[i]), v0[i] = lb_f32_to_bf16(fabsf(vf[i]));
    float *p = hdup(p0, n * 4);
    uint16_t *m = hdup(m0, n * 2), *v = hdup(v0, n * 2), *p16 = lb_malloc(n * 2);
    cpu->adamw16(cpu, &(lb_adamw_args){.p = p, .g = g, .gscale = 0.37f, .m16 = m, .v16 = v,
            .p16 = p16, .n = n, .lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
            .wd = 0.1f, .step = 3});
    float *P = dev->alloc(dev, n * 4), *G = dput(g, n * 4);
    uint16_t *M = dev->alloc(dev, n * 2), *V = dev->alloc(dev, n * 2), *P16 = dpoisoned(n * 2);
    for (int r = 0; r < 2; r++) {   // run 1 from element 1: the scalar path
        const size_t o = r;
        dev->upload(dev, P, p0, n * 4), dev->upload(dev, M, m0, n * 2);
        dev->upload(dev, V, v0, n * 2);
        dev->adamw16(dev, &(lb_adamw_args){.p = P + o, .g = G + o, .gscale = 0.37f, .m16 = M + o,
                .v16 = V + o, .p16 = P16 + o, .n = n - o, .lr = 1e-3f, .beta1 = 0.9f,
                .beta2 = 0.95f, .eps = 1e-8f, .wd = 0.1f, .step = 3});
        float *hp = hget(P, n * 4);
        uint16_t *hm = hget(M, n * 2), *hv = hget(V, n * 2), *h16 = hget(P16, n * 2);
        CHECK_BITS(r ? "adamw16 p, unaligned" : "adamw16 p", hp + o, p + o, (n - o) * 4);
        CHECK_BITS(r ? "adamw16 m, unaligned" : "adamw16 m", hm + o, m + o, (n - o) * 2);
        CHECK_BITS(r ? "adamw16 v, unaligned" : "adamw16 v", hv + o, v + o, (n - o) * 2);
        CHECK_BITS(r ? "adamw16 p16, unaligned" : "adamw16 p16", h16 + o, p16 + o, (n - o) * 2);
        free(hp), free(hm), free(hv), free(h16);
    }
    dfree(P), dfree(G), dfree(M), dfree(V), dfree(P16);
    free(p0), free(g), free(mf), free(vf), free(m0), free(v0), free(p), free(m), free(v), free(p16);
}

// --- batch invariance ------------------------------------------------------------------------

// The linear fprop Y = X W^T: one row alone (m 1) against the same row among m 33 and m 1000,
// for several (k, n). In deterministic mode (the pinned cuBLASLt algorithm) the bits must be
// equal; with the heuristic the differences are printed, not asserted (nothing is promised).
// The row's address is x + row * k, so odd k also exercises unaligned operands.
static void batch_invariance_gemm_case(const test_case *tst)
{
    const int shapes[][2] = {{53, 29}, {256, 384}, {1024, 96}, {2048, 512}, {4096, 2048}};
    const int ms[] = {33, 1000}, row = 17;
    int total_det = 0;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        int k = shapes[si][0], n = shapes[si][1];
        float *x = randn((size_t)1000 * k, 1), *w = randn((size_t)n * k, 1);
        float *X = dput(x, (size_t)1000 * k * 4), *Wd = dput(w, (size_t)n * k * 4);
        float *Y = dev->alloc(dev, (size_t)1000 * n * 4), *Y1 = dev->alloc(dev, (size_t)n * 4);
        for (int det = 1; det >= 0; det--)
            for (size_t mi = 0; mi < 2; mi++) {
                int m = ms[mi];
                dev->deterministic = det;
                poison(Y, (size_t)m * n * 4), poison(Y1, (size_t)n * 4);
                lb_gemm(dev, 0, 1, m, n, k, 1.0f, X, Wd, 0.0f, Y);
                lb_gemm(dev, 0, 1, 1, n, k, 1.0f, X + (size_t)row * k, Wd, 0.0f, Y1);
                dev->deterministic = 1;
                float *ym = hget(Y, (size_t)m * n * 4), *y1 = hget(Y1, (size_t)n * 4);
                size_t diff = count_bit_diffs(ym + (size_t)row * n, y1, n);
                if (verbose() || (det && diff))
                    printf("  gemm fprop %s: m 1 vs m %d (row %d), k %d n %d: %zu of %d outputs "
                           "differ\n", det ? "deterministic" : "heuristic", m, row, k, n, diff, n);
                if (det) total_det += (int)diff;
                ck_assert(isfinite(y1[0]) && isfinite(ym[(size_t)row * n]));
                free(ym), free(y1);
            }
        dfree(X), dfree(Wd), dfree(Y), dfree(Y1), free(x), free(w);
    }
    // dgrad dX = dY W (transa 0, transb 0: the other pinned algorithm), one row of dY alone
    // against the same row among 257.
    {
        const int m = 257, k = 384, n = 1000;
        float *dy = randn((size_t)m * k, 1), *w = randn((size_t)k * n, 1);
        float *DY = dput(dy, (size_t)m * k * 4), *Wd = dput(w, (size_t)k * n * 4);
        float *DX = dpoisoned((size_t)m * n * 4), *DX1 = dpoisoned((size_t)n * 4);
        lb_gemm(dev, 0, 0, m, n, k, 1.0f, DY, Wd, 0.0f, DX);
        lb_gemm(dev, 0, 0, 1, n, k, 1.0f, DY + (size_t)row * k, Wd, 0.0f, DX1);
        float *dx = hget(DX, (size_t)m * n * 4), *dx1 = hget(DX1, (size_t)n * 4);
        size_t diff = count_bit_diffs(dx + (size_t)row * n, dx1, n);
        if (verbose() || diff)
            printf("  gemm dgrad deterministic: m 1 vs m %d (row %d), k %d n %d: %zu of %d "
                   "outputs differ\n", m, row, k, n, diff, n);
        total_det += (int)diff;
        dfree(DY), dfree(Wd), dfree(DX), dfree(DX1), free(dy), free(w), free(dx), free(dx1);
    }
    ck_assert_msg(total_det == 0, "deterministic gemm is not batch invariant: %d outputs differ "
                  "(listed above)", total_det);
}

// Row operations: RMSNorm, the router and cross-entropy of one row alone against the same row
// among 300; attention of a sequence alone against the same sequence inside a batch of 3, and
// the first 70 positions of a sequence against the same positions of its 129-token extension
// (keys after a query are masked to exactly zero weight).
static void batch_invariance_rows_case(const test_case *tst)
{
    const int n = 300, row = 123;
    {   // RMSNorm, c 2048
        const int c = 2048;
        float *x = randn((size_t)n * c, 1), *w = randn(c, 1);
        float *X = dput(x, (size_t)n * c * 4), *Wd = dput(w, (size_t)c * 4);
        float *O = dpoisoned((size_t)n * c * 4), *R = dpoisoned((size_t)n * 4);
        float *O1 = dpoisoned((size_t)c * 4), *R1 = dpoisoned(4);
        dev->rmsnorm_fwd(dev, &(lb_rmsnorm_args){.out = O, .rstd = R, .x = X, .w = Wd, .n = n,
                .c = c, .eps = 1e-6f});
        dev->rmsnorm_fwd(dev, &(lb_rmsnorm_args){.out = O1, .rstd = R1, .x = X + (size_t)row * c,
                .w = Wd, .n = 1, .c = c, .eps = 1e-6f});
        float *o = hget(O, (size_t)n * c * 4), *o1 = hget(O1, (size_t)c * 4);
        CHECK_BITS("rmsnorm row alone vs among 300", o + (size_t)row * c, o1, (size_t)c * 4);
        dfree(X), dfree(Wd), dfree(O), dfree(R), dfree(O1), dfree(R1);
        free(x), free(w), free(o), free(o1);
    }
    {   // router, 128 experts, top-8
        const int e = 128, k = 8;
        float *l = router_logits(n, e);
        float *L = dput(l, (size_t)n * e * 4), *P = dpoisoned((size_t)n * e * 4);
        float *W = dpoisoned((size_t)n * k * 4), *P1 = dpoisoned((size_t)e * 4);
        float *W1 = dpoisoned((size_t)k * 4);
        int32_t *I = dpoisoned((size_t)n * k * 4), *I1 = dpoisoned((size_t)k * 4);
        dev->router_topk_fwd(dev, &(lb_router_args){.probs = P, .idx = I, .weight = W, .logits = L,
                .n = n, .e = e, .k = k, .renorm = 1});
        dev->router_topk_fwd(dev, &(lb_router_args){.probs = P1, .idx = I1, .weight = W1,
                .logits = L + (size_t)row * e, .n = 1, .e = e, .k = k, .renorm = 1});
        float *w = hget(W, (size_t)n * k * 4), *w1 = hget(W1, (size_t)k * 4);
        CHECK_BITS("router weights row alone vs among 300", w + (size_t)row * k, w1,
                   (size_t)k * 4);
        dfree(L), dfree(P), dfree(W), dfree(P1), dfree(W1), dfree(I), dfree(I1);
        free(l), free(w), free(w1);
    }
    {   // cross-entropy, v 1001
        const int v = 1001;
        float *l = randn((size_t)n * v, 3);
        int32_t *t = randint(n, 0, v);
        float *L = dput(l, (size_t)n * v * 4), *LS = dpoisoned((size_t)n * 4), *LS1 = dpoisoned(4);
        int32_t *T = dput(t, (size_t)n * 4);
        dev->cross_entropy_fwd(dev, LS, NULL, L, T, n, v);
        dev->cross_entropy_fwd(dev, LS1, NULL, L + (size_t)row * v, T + row, 1, v);
        float *ls = hget(LS, (size_t)n * 4), *ls1 = hget(LS1, 4);
        CHECK_BITS("cross_entropy row alone vs among 300", ls + row, ls1, 4);
        dfree(L), dfree(LS), dfree(LS1), dfree(T), free(l), free(t), free(ls), free(ls1);
    }
    for (int bf16 = 0; bf16 <= 1; bf16++) {   // attention, in both numerics modes
        const int b = 3, mid = 1, t = 129, hq = 6, hkv = 2, d = 64, tp = 70;
        size_t sq = (size_t)t * hq * d, sk = (size_t)t * hkv * d, sl = (size_t)hq * t;
        float *q = randn(b * sq, 1), *k = randn(b * sk, 1), *v = randn(b * sk, 1);
        float *Q = dput(q, b * sq * 4), *Kd = dput(k, b * sk * 4), *Vd = dput(v, b * sk * 4);
        float *O = dpoisoned(b * sq * 4), *L = dpoisoned(b * sl * 4);
        float *O1 = dpoisoned(sq * 4), *L1 = dpoisoned(sl * 4);
        dev->attention_fwd(dev, &(lb_attention_args){.out = O, .lse = L, .q = Q, .k = Kd, .v = Vd,
                .b = b, .t = t, .hq = hq, .hkv = hkv, .d = d, .bf16 = bf16});
        dev->attention_fwd(dev, &(lb_attention_args){.out = O1, .lse = L1, .q = Q + mid * sq,
                .k = Kd + mid * sk, .v = Vd + mid * sk, .b = 1, .t = t, .hq = hq, .hkv = hkv,
                .d = d, .bf16 = bf16});
        float *o = hget(O, b * sq * 4), *o1 = hget(O1, sq * 4);
        float *lb = hget(L, b * sl * 4), *l1 = hget(L1, sl * 4);
        CHECK_BITS(bf16 ? "attention bf16 out, batch 1 vs 3" : "attention out, batch 1 vs 3",
                   o + mid * sq, o1, sq * 4);
        CHECK_BITS(bf16 ? "attention bf16 lse, batch 1 vs 3" : "attention lse, batch 1 vs 3",
                   lb + mid * sl, l1, sl * 4);
        if (bf16) {   // the tensor-core backward too: no split of a row's sums by batch size
            float *g = randn(b * sq, 1), *G = dput(g, b * sq * 4);
            float *DQ = dpoisoned(b * sq * 4), *DK = dpoisoned(b * sk * 4);
            float *DV = dpoisoned(b * sk * 4), *DQ1 = dpoisoned(sq * 4);
            float *DK1 = dpoisoned(sk * 4), *DV1 = dpoisoned(sk * 4);
            dev->attention_bwd(dev, &(lb_attention_args){.dq = DQ, .dk = DK, .dv = DV, .dout = G,
                    .q = Q, .k = Kd, .v = Vd, .out = O, .lse = L, .b = b, .t = t, .hq = hq,
                    .hkv = hkv, .d = d, .bf16 = 1});
            dev->attention_bwd(dev, &(lb_attention_args){.dq = DQ1, .dk = DK1, .dv = DV1,
                    .dout = G + mid * sq, .q = Q + mid * sq, .k = Kd + mid * sk,
                    .v = Vd + mid * sk, .out = O1, .lse = L1, .b = 1, .t = t, .hq = hq, .hkv = hkv,
                    .d = d, .bf16 = 1});
            float *gb[3] = {hget(DQ, b * sq * 4), hget(DK, b * sk * 4), hget(DV, b * sk * 4)};
            float *g1[3] = {hget(DQ1, sq * 4), hget(DK1, sk * 4), hget(DV1, sk * 4)};
            CHECK_BITS("attention bf16 dq, batch 1 vs 3", gb[0] + mid * sq, g1[0], sq * 4);
            CHECK_BITS("attention bf16 dk, batch 1 vs 3", gb[1] + mid * sk, g1[1], sk * 4);
            CHECK_BITS("attention bf16 dv, batch 1 vs 3", gb[2] + mid * sk, g1[2], sk * 4);
            for (int i = 0; i < 3; i++) free(gb[i]), free(g1[i]);
            dfree(G), dfree(DQ), dfree(DK), dfree(DV), dfree(DQ1), dfree(DK1), dfree(DV1);
            free(g);
        }
        // Prefix: sequence 1's first tp tokens as a sequence of their own.
        float *qp = lb_malloc((size_t)tp * hq * d * 4), *kp = lb_malloc((size_t)tp * hkv * d * 4);
        float *vp = lb_malloc((size_t)tp * hkv * d * 4);
        memcpy(qp, q + mid * sq, (size_t)tp * hq * d * 4);
        memcpy(kp, k + mid * sk, (size_t)tp * hkv * d * 4);
        memcpy(vp, v + mid * sk, (size_t)tp * hkv * d * 4);
        float *QP = dput(qp, (size_t)tp * hq * d * 4), *KP = dput(kp, (size_t)tp * hkv * d * 4);
        float *VP = dput(vp, (size_t)tp * hkv * d * 4);
        float *OP = dpoisoned((size_t)tp * hq * d * 4), *LP = dpoisoned((size_t)hq * tp * 4);
        dev->attention_fwd(dev, &(lb_attention_args){.out = OP, .lse = LP, .q = QP, .k = KP,
                .v = VP, .b = 1, .t = tp, .hq = hq, .hkv = hkv, .d = d, .bf16 = bf16});
        float *op = hget(OP, (size_t)tp * hq * d * 4), *lp = hget(LP, (size_t)hq * tp * 4);
        CHECK_BITS(bf16 ? "attention bf16 out, t 70 vs first 70 of t 129"
                        : "attention out, t 70 vs first 70 of t 129",
                   op, o1, (size_t)tp * hq * d * 4);
        for (int h = 0; h < hq; h++)
            CHECK_BITS(bf16 ? "attention bf16 lse, t 70 vs first 70 of t 129"
                            : "attention lse, t 70 vs first 70 of t 129",
                       lp + (size_t)h * tp, l1 + (size_t)h * t, (size_t)tp * 4);
        dfree(Q), dfree(Kd), dfree(Vd), dfree(O), dfree(L), dfree(O1), dfree(L1);
        dfree(QP), dfree(KP), dfree(VP), dfree(OP), dfree(LP);
        free(q), free(k), free(v), free(o), free(o1), free(lb), free(l1);
        free(qp), free(kp), free(vp), free(op), free(lp);
    }
}

// --- low precision: quantize, dequantize, Hadamard, bf16 rounding, gemm_q ---------------------
//
// Quantization must be bit-identical to the CPU codecs (doc/formats.md): element bytes, block
// scales and NVFP4 second levels are compared byte for byte, for every format, block shape,
// element type, MX scale rule, second-level mode, rounding (nearest even and stochastic) and
// direction, on random matrices of awkward shapes with special values planted in them (zero
// blocks, -0, NaN, +-Inf, fp32 subnormals, values near the fp32 maximum, outliers next to tiny
// values) and on the three inputs of tests/data/quant/blocks.safetensors. Dequantization is
// compared bitwise (NaN payloads excepted, as in test_quant.c: they are not part of the
// contract). The Hadamard transform and bf16 rounding perform the CPU's operations in the CPU's
// order, so they are compared bitwise too.
//
// gemm_q bounds (NMSE against the CPU's gemm_q on the same quantized bytes):
//   B_ACCUM  1e-10  fp8-block with two 128x128 operands: the fp32 fallback, the CPU's own
//                   computation (fp32 FFMA) in another order.
//   B_TC     1e-9   MXFP8, MXFP4, NVFP4 on bf16 tensor cores: the operands are the exactly
//                   dequantized values, so every product is the CPU's product exactly, and only
//                   the fp32 accumulation differs. Tensor cores add into the fp32 accumulator
//                   with truncation (round toward zero; Fasi et al. 2021 measured it on V100 to
//                   A100), a bias that does not average out: simulating K = 1000 random products
//                   truncated after every product gives NMSE 6.7e-10 (after every 8: 9e-12),
//                   against ~1e-13 for round-to-nearest. The bound covers the worst model.
//   B_FP8TC  2e-6   fp8-block on cuBLASLt's FP8 tensor cores: within each 128-term block the
//                   Hopper FP8 accumulator keeps about 14 bits (DeepSeek-V3 report, section
//                   3.3.2: aligned to the largest addend and truncated) before cuBLASLt promotes
//                   the block partial to fp32 and applies sa * sb. A model of that (each k32
//                   instruction: the accumulator and its 32 products truncated to 13 fraction
//                   bits below the largest, then summed; fp32 promotion per 128 of K) on this
//                   test's operands (rows and K groups of unlike magnitude) gives medians of
//                   3e-9 to 7e-8 per case, as measured on the H200 (3e-9 to 1.5e-7), and a
//                   heavy tail: the largest of 2,000 modelled draws is 3.8e-7, and the H200
//                   measured 4.6e-7 once (seed 55110521359424; the earlier bound of 3e-7 came
//                   from the largest of a few measurements, 7.4e-8, and missed that tail). The
//                   bound leaves a factor 4 over the largest seen; a misplaced block scale
//                   (the bug this looks for) costs NMSE 1e-2 or more.

#define B_TC 1e-9
#define B_FP8TC 2e-6

// (rows, cols) normal values times a per-row and a per-32-column-group magnitude exp(N(0, 1)):
// block scales differ across rows and along K, so a scale applied to the wrong block shows.
static float *scaled_randn(int rows, int cols)
{
    uint64_t st = next_stream++;
    float *x = lb_malloc((size_t)rows * cols * sizeof(float));
    for (int r = 0; r < rows; r++) {
        float rm = expf(lb_rand_normal(seed, st, ((uint64_t)1 << 40) + (uint64_t)r));
        for (int c = 0; c < cols; c++) {
            float cm = expf(lb_rand_normal(seed, st, ((uint64_t)2 << 40) + (uint64_t)(c / 32)));
            x[(size_t)r * cols + c] = rm * cm * lb_rand_normal(seed, st, (uint64_t)r * cols + c);
        }
    }
    return x;
}

static uint32_t fbits(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

// A random (rows, cols) matrix: rows of unlike magnitude (exp(2 N(0,1))), then special values
// planted by `special`: 0 none; 1 a zero block and -0, fp32 subnormals, a huge outlier row
// segment, near-fp32-max values, tiny values (amax below 2^-120); 2 adds NaN, +Inf and -Inf.
static float *qinput(int rows, int cols, int special)
{
    uint64_t st = next_stream++;
    float *x = lb_malloc((size_t)rows * cols * sizeof(float));
    for (int r = 0; r < rows; r++) {
        float mag = expf(2.0f * lb_rand_normal(seed, st, (uint64_t)r + ((uint64_t)1 << 40)));
        for (int c = 0; c < cols; c++)
            x[(size_t)r * cols + c] = mag * lb_rand_normal(seed, st, (uint64_t)r * cols + c);
    }
    if (!special) return x;
    size_t n = (size_t)rows * cols;
#define AT(r, c) x[(size_t)((r) % rows) * cols + ((c) % cols)]
    for (int c = 0; c < 40 && c < cols; c++) AT(0, c) = 0.0f;            // a zero block (row 0)
    AT(0, 3) = -0.0f;
    for (int c = 0; c < 20; c++) AT(1, c) = ldexpf(1.0f + c, -140);      // fp32 subnormals
    for (int c = 0; c < 16; c++) AT(2, c + 16) = ldexpf(1.0f + 0.01f * c, -122);   // tiny block
    AT(3, 5) = 3.0e38f;                                                  // near the fp32 max
    AT(3, 6) = -3.4028235e38f;
    AT(4, 7) = 1e30f, AT(4, 8) = 1e-30f;                                 // outlier over tiny
    for (int c = 0; c < 8; c++) AT(5, 64 + c) = 448.0f * (c + 1);       // saturation region
    AT(6, 33) = 2688.0f * 8;                                             // the tensor amax
    if (rows > 10)   // a row of tiny values only: blocks whose fp8 divisor is below 2^-90
        for (int c = 0; c < cols; c++)
            AT(10, c) = ldexpf((c & 1 ? -1.0f : 1.0f) * (1.0f + 0.37f * (c % 7)), -100 - c % 50);
    if (special == 2) {
        AT(7, 1) = NAN;
        AT(8, 40) = INFINITY;
        AT(9, 100) = -INFINITY;
    }
#undef AT
    (void)n;
    return x;
}

typedef struct {
    const char *name;
    lb_format fmt;
    int weight;
    lb_elem elem;
    lb_scale_rule rule;
    lb_scale2_mode s2;
    int pow2;
} qcfg;

// From here on a table's row names the fields it uses; the others are zero (pow2 where absent).
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
static const qcfg QCFG[] = {
    {"fp8 1x128", LB_FMT_FP8_BLOCK, 0, LB_E4M3, 0, 0},
    {"fp8 128x128", LB_FMT_FP8_BLOCK, 1, LB_E4M3, 0, 0},
    {"mxfp8 e4m3 ceil", LB_FMT_MXFP8, 0, LB_E4M3, LB_SCALE_CEIL, 0},
    {"mxfp8 e4m3 floor", LB_FMT_MXFP8, 0, LB_E4M3, LB_SCALE_FLOOR, 0},
    {"mxfp8 e5m2 ceil", LB_FMT_MXFP8, 0, LB_E5M2, LB_SCALE_CEIL, 0},
    {"mxfp8 e5m2 floor", LB_FMT_MXFP8, 0, LB_E5M2, LB_SCALE_FLOOR, 0},
    {"mxfp4 ceil", LB_FMT_MXFP4, 0, LB_E4M3, LB_SCALE_CEIL, 0},
    {"mxfp4 floor", LB_FMT_MXFP4, 0, LB_E4M3, LB_SCALE_FLOOR, 0},
    {"nvfp4 tensor", LB_FMT_NVFP4, 0, LB_E4M3, 0, LB_S2_TENSOR},
    {"nvfp4 row", LB_FMT_NVFP4, 0, LB_E4M3, 0, LB_S2_ROW},
    {"nvfp4 given", LB_FMT_NVFP4, 0, LB_E4M3, 0, LB_S2_GIVEN},
    {"nvfp4 16x16 tensor", LB_FMT_NVFP4, 1, LB_E4M3, 0, LB_S2_TENSOR},
    {"nvfp4 16x16 given", LB_FMT_NVFP4, 1, LB_E4M3, 0, LB_S2_GIVEN},
    {"fp8 tensor", LB_FMT_FP8_TENSOR, 0, LB_E4M3, 0, 0},
    // precision.scale = pow2 (after the others: the rows above are indexed)
    {"fp8 1x128 pow2", LB_FMT_FP8_BLOCK, 0, LB_E4M3, 0, 0, 1},
    {"fp8 128x128 pow2", LB_FMT_FP8_BLOCK, 1, LB_E4M3, 0, 0, 1},
    {"fp8 tensor pow2", LB_FMT_FP8_TENSOR, 0, LB_E4M3, 0, 0, 1},
};
#define NQCFG ((int)(sizeof QCFG / sizeof QCFG[0]))

static lb_quant_args qargs(const qcfg *c, int colwise, int sr, float s2)
{
    lb_quant_args a;
    memset(&a, 0, sizeof a);
    a.fmt = c->fmt;
    a.colwise = colwise;
    a.weight_blocks = c->weight;
    a.elem = c->elem;
    a.rule = c->rule;
    a.s2_mode = c->s2;
    a.s2 = s2;
    a.pow2 = c->pow2;
    a.sr = sr;
    a.seed = seed ^ 0x5eed;
    a.step = 17;
    a.tensor = 12345 + (uint64_t)colwise;
    return a;
}

// Host copy of a device qmat (same layout, host buffers).
static void qmat_get(lb_qmat *h, const lb_qmat *d)
{
    *h = *d;
    h->data = hget(d->data, lb_qmat_data_bytes(d));
    h->scale = hget(d->scale, lb_qmat_scale_bytes(d));
    h->scale2 = d->nscale2 ? hget(d->scale2, (size_t)d->nscale2 * 4) : NULL;
}

// Device qmat holding the bytes of host qmat h.
static void qmat_put(lb_qmat *d, const lb_qmat *h, const lb_quant_args *a, int rows, int cols)
{
    dev->qmat_alloc(dev, d, rows, cols, a);
    dev->upload(dev, d->data, h->data, lb_qmat_data_bytes(h));
    dev->upload(dev, d->scale, h->scale, lb_qmat_scale_bytes(h));
    if (h->nscale2) dev->upload(dev, d->scale2, h->scale2, (size_t)h->nscale2 * 4);
}

static int same_or_nan(float a, float b) { return fbits(a) == fbits(b) || (a != a && b != b); }

// lb_qmat.tscale on host qmat h and device qmat d where their layout has one (fp8-block 1x128),
// the device's poisoned: every quantizer then writes it, and ts_check compares it as the scales.
static void ts_attach(lb_qmat *h, lb_qmat *d)
{
    if (!lb_qmat_tscale_fits(h)) return;
    const size_t n = lb_qmat_tscale_bytes(h);
    h->tscale = lb_malloc(n);
    d->tscale = dev->alloc(dev, n);
    poison(d->tscale, n);
}

// The CPU's transposed scales are its scales transposed, and the device's equal them bit for
// bit (rows srows .. ld - 1 are not written); then both are freed.
static void ts_check(const char *what, lb_qmat *d, lb_qmat *h)
{
    if (!h->tscale) return;
    const size_t ld = lb_qmat_tscale_ld(h);
    float *got = hget(d->tscale, lb_qmat_tscale_bytes(h));
    const float *sc = h->scale;
    for (int k = 0; k < h->scols; k++)
        for (int r = 0; r < h->srows; r++) {
            const size_t i = (size_t)k * ld + r;
            ck_assert_msg(fbits(h->tscale[i]) == fbits(sc[(size_t)r * h->scols + k]),
                          "%s: the CPU's transposed scale (%d, %d) is not its scale", what, k, r);
            ck_assert_msg(fbits(got[i]) == fbits(h->tscale[i]),
                          "%s: transposed scale (%d, %d) %a want %a (seed %llu)", what, k, r,
                          (double)got[i], (double)h->tscale[i], (unsigned long long)seed);
        }
    free(got), free(h->tscale), dfree(d->tscale);
    h->tscale = d->tscale = NULL;
}

// Device qmat d (a copy of host h's bytes) gets h's scales transposed as lb_qmat.tscale, where
// its layout has them; ts_drop frees them.
static void ts_put(lb_qmat *d, const lb_qmat *h)
{
    if (!lb_qmat_tscale_fits(h)) return;
    const size_t ld = lb_qmat_tscale_ld(h), n = lb_qmat_tscale_bytes(h);
    float *t = lb_malloc(n);
    for (int k = 0; k < h->scols; k++)
        for (int r = 0; r < h->srows; r++)
            t[(size_t)k * ld + r] = ((const float *)h->scale)[(size_t)r * h->scols + k];
    d->tscale = dput(t, n);
    free(t);
}

static void ts_drop(lb_qmat *d)
{
    if (d->tscale) dfree(d->tscale);
    d->tscale = NULL;
}

static int qcompared;   // quantizations compared (the test checks it covered what it meant to)

// Quantizes x (rows, cols) on both backends and demands identical bytes, scales and second
// levels; then dequantizes the GPU's copy on the GPU and compares with the CPU's.
static void quant_case(const char *input, const float *x, int rows, int cols, const qcfg *c,
                       int colwise, int sr, float s2)
{
    lb_quant_args a = qargs(c, colwise, sr, s2);
    lb_qmat ref, dq, got;
    lb_qmat_alloc(&ref, rows, cols, &a);
    float *dx = dput(x, (size_t)rows * cols * 4);
    dev->qmat_alloc(dev, &dq, rows, cols, &a);
    ts_attach(&ref, &dq);   // the first run writes transposed scales too, the second none
    lb_quantize(&ref, x, rows, cols, &a);
    ck_assert_int_eq(dq.rows, ref.rows);
    ck_assert_int_eq(dq.cols, ref.cols);
    ck_assert_uint_eq(dq.ld, ref.ld);
    ck_assert_int_eq(dq.srows, ref.srows);
    ck_assert_int_eq(dq.scols, ref.scols);
    ck_assert_int_eq(dq.nscale2, ref.nscale2);
    size_t nd = lb_qmat_data_bytes(&ref), ns = lb_qmat_scale_bytes(&ref);
    char what[200];
    snprintf(what, sizeof what, "quantize %s %s %s%s (%d x %d)", input, c->name,
             colwise ? "col" : "row", sr ? " sr" : "", rows, cols);
    for (int run = 0; run < 2; run++) {   // twice: identical again (poisoned each time)
        poison(dq.data, nd);
        poison(dq.scale, ns);
        if (dq.nscale2) poison(dq.scale2, (size_t)dq.nscale2 * 4);
        dev->quantize(dev, &dq, lb_act_f32(dx, rows, cols), &a);
        qmat_get(&got, &dq);
        size_t bad = 0, first = 0;
        for (size_t i = 0; i < nd; i++)
            if (got.data[i] != ref.data[i] && !bad++) first = i;
        ck_assert_msg(!bad, "%s: %zu of %zu data bytes differ, first at %zu (row %zu): %#x want "
                      "%#x (seed %llu)", what, bad, nd, first, first / ref.ld, got.data[first],
                      ref.data[first], (unsigned long long)seed);
        for (size_t i = 0; i < ns; i++)
            if (((uint8_t *)got.scale)[i] != ((uint8_t *)ref.scale)[i] && !bad++) first = i;
        ck_assert_msg(!bad, "%s: scale bytes differ, first at byte %zu: %#x want %#x (seed %llu)",
                      what, first, ((uint8_t *)got.scale)[first], ((uint8_t *)ref.scale)[first],
                      (unsigned long long)seed);
        ts_check(what, &dq, &ref);
        for (int i = 0; i < ref.nscale2; i++)
            ck_assert_msg(fbits(got.scale2[i]) == fbits(ref.scale2[i]),
                          "%s: scale2[%d] %a want %a (seed %llu)", what, i, (double)got.scale2[i],
                          (double)ref.scale2[i], (unsigned long long)seed);
        lb_qmat_free(&got);
    }
    // Dequantization of the (identical) bytes.
    size_t ny = (size_t)ref.rows * ref.cols;
    float *want = lb_malloc(ny * 4), *dy = dpoisoned(ny * 4);
    lb_dequantize(want, &ref);
    dev->dequantize(dev, dy, &dq);
    float *y = hget(dy, ny * 4);
    for (size_t i = 0; i < ny; i++)
        ck_assert_msg(same_or_nan(y[i], want[i]), "%s: dequantized [%zu] %a want %a (seed %llu)",
                      what, i, (double)y[i], (double)want[i], (unsigned long long)seed);
    if (verbose()) printf("  %-70s bitwise equal (+ dequantize)\n", what);
    qcompared++;
    free(want), free(y), dfree(dy), dfree(dx);
    dev->qmat_free(dev, &dq);
    lb_qmat_free(&ref);
}

// Every configuration, both directions, both roundings, on x.
static void quant_all(const char *input, const float *x, int rows, int cols, float s2_given)
{
    for (int c = 0; c < NQCFG; c++)
        for (int dir = 0; dir < 2; dir++)
            for (int sr = 0; sr < 2; sr++)
                quant_case(input, x, rows, cols, &QCFG[c], dir, sr, s2_given);
}

static void quantize_random_case(const test_case *tst)
{
    qcompared = 0;
    const struct { int rows, cols, special; } sz[] = {
        {1, 1, 0}, {3, 17, 1}, {37, 135, 1}, {129, 300, 2}, {300, 129, 1}, {2, 1000, 0},
        {257, 33, 2},
    };
    int ncases = (int)(sizeof sz / sizeof sz[0]);
    for (int i = 0; i < ncases; i++) {
        int rows = sz[i].rows, cols = sz[i].cols;
        float *x = qinput(rows, cols, sz[i].special);
        char name[64];
        snprintf(name, sizeof name, "random%s", sz[i].special == 2 ? "+nan/inf" : sz[i].special ? "+special" : "");
        // A given second level a third of the tensor's own, so some block scales saturate.
        float s2 = lb_nvfp4_scale2(lb_amax(x, (size_t)rows * cols));
        s2 = s2 == s2 ? s2 / 3.0f : 0.01f;
        quant_all(name, x, rows, cols, s2);
        free(x);
    }
    // NaN given second level (allowed: it poisons the tensor).
    float *x = qinput(20, 40, 0);
    quant_case("random", x, 20, 40, &QCFG[10], 0, 0, NAN);
    quant_case("random", x, 20, 40, &QCFG[12], 1, 1, NAN);
    free(x);
    ck_assert_int_eq(qcompared, ncases * NQCFG * 4 + 2);
}

static void quantize_golden_case(const test_case *tst)
{
    qcompared = 0;
    lb_st_file f;
    char err[512];
    if (lb_st_open(&f, lb_test_src("tests/data/quant/blocks.safetensors"), err, sizeof err))
        ck_abort_msg("%s", err);
    const char *inputs[] = {"fin", "ext", "spec"};
    for (int ii = 0; ii < 3; ii++) {
        char name[64];
        snprintf(name, sizeof name, "%s.x", inputs[ii]);
        const lb_st_tensor *t = lb_st_find(&f, name);
        ck_assert_msg(t && t->ndim == 2 && strcmp(t->dtype, "F32") == 0, "%s missing", name);
        int rows = (int)t->shape[0], cols = (int)t->shape[1];
        float *x = lb_malloc((size_t)rows * cols * 4);
        ck_assert(fseek(f.fp, (long)(f.data_offset + t->begin), SEEK_SET) == 0);
        ck_assert(fread(x, 4, (size_t)rows * cols, f.fp) == (size_t)rows * cols);
        snprintf(name, sizeof name, "%s.s2_given", inputs[ii]);
        t = lb_st_find(&f, name);
        ck_assert(t && strcmp(t->dtype, "F32") == 0);
        float s2;
        ck_assert(fseek(f.fp, (long)(f.data_offset + t->begin), SEEK_SET) == 0);
        ck_assert(fread(&s2, 4, 1, f.fp) == 1);
        quant_all(inputs[ii], x, rows, cols, s2);
        free(x);
    }
    lb_st_close(&f);
    ck_assert_int_eq(qcompared, 3 * NQCFG * 4);
}

// precision.scale = pow2 checked on the backend under test itself (its bytes equal the CPU's:
// quant_case first), on qinput's special values plus rows whose amax is 448 * 2^-5 exactly (the
// scale 2^-5, not doubled), 448 * 2^-150 (below fp32: 1, as the FP32 rule) and one ulp above:
// every scale of a finite block with amax above 448 * 2^-150 is a power of two s with
// amax <= 448 s < 2 amax, the others 1 (NaN for a non-finite block); every dequantized element
// within half an E4M3 step of x at x / s, which never passes 448 (nothing clips). The fp32
// maximum's element alone may round up to 2^128, +-Inf (doc/formats.md).
static void quantize_pow2_case(const test_case *tst)
{
    const int shapes[2][2] = {{37, 135}, {300, 129}};
    int checked = 0;
    for (int sh = 0; sh < 2; sh++) {
        const int rows = shapes[sh][0], cols = shapes[sh][1];
        float *x = qinput(rows, cols, 2);
        for (int c = 0; c < cols; c++) {
            x[11 * cols + c] = (c % 2 ? -1.0f : 1.0f) * 0x1p-10f * (float)(c % 9);
            x[12 * cols + c] = c == 3 ? 0x1.cp-142f : 0.0f;                  // 448 * 2^-150
            x[13 * cols + c] = c == 9 ? -(0x1.cp-142f + 0x1p-149f) : 0x1p-149f;
        }
        x[11 * cols + 60] = 448.0f * 0x1p-5f;
        for (int ci = 0; ci < NQCFG; ci++) {
            const qcfg *cf = &QCFG[ci];
            if (!cf->pow2) continue;
            for (int dir = 0; dir < 2; dir++) {
                quant_case("pow2 edges", x, rows, cols, cf, dir, 0, 0.0f);
                lb_quant_args a = qargs(cf, dir, 0, 0.0f);
                lb_qmat dq, got;
                dev->qmat_alloc(dev, &dq, rows, cols, &a);
                float *dx = dput(x, (size_t)rows * cols * 4);
                dev->quantize(dev, &dq, lb_act_f32(dx, rows, cols), &a);
                qmat_get(&got, &dq);
                const int R = got.rows, C = got.cols;
                float *dy = dpoisoned((size_t)R * C * 4);
                dev->dequantize(dev, dy, &dq);
                float *y = hget(dy, (size_t)R * C * 4);
                char what[96];
                snprintf(what, sizeof what, "pow2 %s %s (%d x %d)", cf->name, dir ? "col" : "row",
                         rows, cols);
                for (int i = 0; i < got.srows; i++)
                    for (int j = 0; j < got.scols; j++) {
                        const int r0 = i * got.brows, c0 = j * got.bcols;
                        const int r1 = r0 + got.brows < R ? r0 + got.brows : R;
                        const int c1 = c0 + got.bcols < C ? c0 + got.bcols : C;
                        double amax = 0.0;   // over Q's block: x's element (c, r) column-wise
                        for (int r = r0; r < r1; r++)
                            for (int c = c0; c < c1; c++) {
                                const double v = fabs(dir ? x[(size_t)c * cols + r]
                                                          : x[(size_t)r * cols + c]);
                                amax = v != v || amax != amax ? NAN : v > amax ? v : amax;
                            }
                        const float s = ((const float *)got.scale)[(size_t)i * got.scols + j];
                        if (!(amax < INFINITY)) {
                            ck_assert_msg(s != s, "%s: block (%d, %d) amax %g, scale %g", what,
                                          i, j, amax, (double)s);
                            continue;
                        }
                        int e;
                        if (amax <= 448.0 * 0x1p-150)
                            ck_assert_msg(s == 1.0f, "%s: block (%d, %d) amax %a, scale %a",
                                          what, i, j, amax, (double)s);
                        else
                            ck_assert_msg(frexpf(s, &e) == 0.5f && amax <= 448.0 * s &&
                                          amax > 224.0 * s, "%s: block (%d, %d) amax %a, scale "
                                          "%a: not a power of two in [amax / 448, 2 amax / 448)",
                                          what, i, j, amax, (double)s);
                        for (int r = r0; r < r1; r++)
                            for (int c = c0; c < c1; c++) {
                                const double xv = dir ? x[(size_t)c * cols + r]
                                                      : x[(size_t)r * cols + c];
                                const double yv = y[(size_t)r * C + c], xs = fabs(xv) / s;
                                const double step =
                                    ldexp(1.0, (xs < 0x1p-6 ? -6 : ilogb(xs)) - 3);
                                if (isinf(yv) && fabs(xv) >= 0x1.fp127) continue;
                                if (!(xs <= 448.0 && fabs(yv - xv) <= 0.5 * step * s))
                                    ck_abort_msg("%s: (%d, %d) x %a -> %a, scale %a", what, r, c,
                                                 xv, yv, (double)s);
                            }
                        checked++;
                    }
                if (verbose()) printf("  %-70s scales and errors as the rule says\n", what);
                free(y), dfree(dy), dfree(dx);
                lb_qmat_free(&got);
                dev->qmat_free(dev, &dq);
            }
        }
        free(x);
    }
    ck_assert_int_gt(checked, 1000);
}

// p: rows, cols, axis, n, the random signs' site (99 + it); deterministic and random signs,
// out of place and in place
static void hadamard_case(const test_case *tst)
{
    const int rows = tst->p[0], cols = tst->p[1], axis = tst->p[2], n = tst->p[3];
    for (int rnd = 0; rnd < 2; rnd++)
        for (int inplace = 0; inplace < 2; inplace++) {
            size_t sz = (size_t)rows * cols;
            uint32_t signs = rnd ? lb_hadamard_signs(n, seed, 3, 99 + (uint64_t)tst->p[4]) : 0;
            float *x = randn(sz, 3.0f), *want = lb_malloc(sz * 4);
            x[0] = NAN;
            x[sz - 1] = ldexpf(1.0f, -140);
            lb_hadamard(want, x, rows, cols, axis, n, signs);
            float *dx = dput(x, sz * 4), *dy = inplace ? dx : dpoisoned(sz * 4);
            dev->hadamard(dev, dy, dx, rows, cols, axis, n, signs);
            float *y = hget(dy, sz * 4);
            char what[128];
            snprintf(what, sizeof what, "hadamard %d x %d axis %s n %d %s%s", rows, cols,
                     axis == LB_AXIS_COLS ? "cols" : "rows", n,
                     rnd ? "random signs" : "deterministic", inplace ? " in place" : "");
            for (size_t j = 0; j < sz; j++)
                ck_assert_msg(same_or_nan(y[j], want[j]), "%s: [%zu] %a want %a (seed %llu)",
                              what, j, (double)y[j], (double)want[j], (unsigned long long)seed);
            if (verbose()) printf("  %-60s bitwise equal\n", what);
            free(x), free(want), free(y), dfree(dx);
            if (!inplace) dfree(dy);
        }
}

static void round_bf16_case(const test_case *tst)
{
    const size_t n = 100003;
    float *x = randn(n, 10.0f);
    const uint32_t sp[] = {0x3f808000u, 0x3f818000u, 0x3f80ffffu, 0x7f7fffffu, 0xff7fffffu,
                           0x7f800000u, 0xff800000u, 0x7fc00001u, 0xffa00000u, 0x00000001u,
                           0x80008000u, 0x00018000u, 0x00000000u, 0x80000000u, 0x7f7f8000u};
    for (size_t i = 0; i < sizeof sp / sizeof sp[0]; i++) memcpy(&x[i], &sp[i], 4);
    float *want = lb_malloc(n * 4);
    cpu->round_bf16(cpu, want, x, n);
    float *dx = dput(x, n * 4), *dy = dpoisoned(n * 4);
    dev->round_bf16(dev, dy, dx, n);
    float *y = hget(dy, n * 4);
    CHECK_BITS("round_bf16 (ties, NaN, Inf, subnormals, overflow)", y, want, n * 4);
    dev->round_bf16(dev, dx, dx, n);   // in place
    free(y);
    y = hget(dx, n * 4);
    CHECK_BITS("round_bf16 in place", y, want, n * 4);
    free(x), free(want), free(y), dfree(dx), dfree(dy);
}

// to_bf16 against the CPU bit for bit (the special values of test_round_bf16, rows of 37
// columns padded to 40), and bf16 GEMMs given b's copy (lb_gemm_args.b16) against the same
// GEMMs rounding b themselves, bit for bit: fprop (B (n, k)) and dgrad (B (k, n)) of one
// weight's copy, as the weight cache serves them, alone and as groups beside a wgrad; the
// groups given the activations' copies too (lb_gemm_args.a16: A (m, k) and, in the wgrad,
// (k, m); G's rows padded), as an expert layer's ops write them.
static void to_bf16_case(const test_case *tst)
{
    // A padded pitch (the row kernel) and ld == cols (the 16-byte kernel).
    for (int pass = 0; pass < 2; pass++) {
        const int rows = 301, cols = pass ? 40 : 37, ld = 40;
        float *x = randn((size_t)rows * cols, 10.0f);
        const uint32_t sp[] = {0x3f808000u, 0x7f7fffffu, 0x7f800000u, 0x7fc00001u,
                               0xffa00000u, 0x00000001u, 0x80008000u, 0x80000000u};
        for (size_t i = 0; i < sizeof sp / sizeof sp[0]; i++) memcpy(&x[3 * i], &sp[i], 4);
        uint16_t *want = lb_malloc((size_t)rows * ld * 2);
        cpu->to_bf16(cpu, want, x, rows, cols, ld);
        float *dx = dput(x, (size_t)rows * cols * 4);
        uint16_t *dy = dpoisoned((size_t)rows * ld * 2);
        dev->to_bf16(dev, dy, dx, rows, cols, ld);
        uint16_t *got = hget(dy, (size_t)rows * ld * 2);
        CHECK_BITS(pass ? "to_bf16 (ld = cols, special values)"
                        : "to_bf16 (padded rows, special values)",
                   got, want, (size_t)rows * ld * 2);
        free(got), dfree(dy), dfree(dx), free(x), free(want);
    }

    const int m = 77, n = 300, k = 136;   // W (n, k): fprop C (m, n), dgrad C (m, k)
    float *w = randn((size_t)n * k, 1), *a = randn((size_t)m * k, 1), *g = randn((size_t)m * n, 1);
    float *W = dput(w, (size_t)n * k * 4), *A = dput(a, (size_t)m * k * 4);
    float *G = dput(g, (size_t)m * n * 4);
    uint16_t *W16 = dev->alloc(dev, (size_t)n * 136 * 2);   // pad8(136) = 136
    uint16_t *A16 = dev->alloc(dev, (size_t)m * 136 * 2), *G16 = dpoisoned((size_t)m * 304 * 2);
    dev->to_bf16(dev, W16, W, n, k, 136);
    dev->to_bf16(dev, A16, A, m, k, 136);
    dev->to_bf16(dev, G16, G, m, n, 304);
    float *c[2][5];
    for (int r = 0; r < 2; r++) {
        const uint16_t *b16 = r ? W16 : NULL, *a16 = r ? A16 : NULL, *g16 = r ? G16 : NULL;
        for (int i = 0; i < 4; i++) c[r][i] = dpoisoned((size_t)m * (i % 2 ? k : n) * 4);
        c[r][4] = dpoisoned((size_t)n * k * 4);
        lb_gemm_bf16_b16(dev, 0, 1, m, n, k, 1.0f, A, W, b16, 0.0f, c[r][0]);   // fprop
        lb_gemm_bf16_b16(dev, 0, 0, m, k, n, 1.0f, G, W, b16, 0.0f, c[r][1]);   // dgrad
        lb_gemm_args gr[3] = {{0, 1, m, n, k, 1.0f, 0.0f, A, W, c[r][2], 1, b16, a16, NULL},
                              {0, 0, m, k, n, 1.0f, 0.0f, G, W, c[r][3], 1, b16, g16, NULL},
                              {1, 0, n, k, m, 1.0f, 0.0f, G, A, c[r][4], 1, a16, g16, NULL}};
        dev->gemm_grouped(dev, 3, gr);
    }
    dev->sync(dev);
    const char *names[5] = {"fprop, b16", "dgrad, b16", "grouped fprop, a16 b16",
                            "grouped dgrad, a16 b16", "grouped wgrad, a16 b16"};
    for (int i = 0; i < 5; i++) {
        const size_t bytes = (i == 4 ? (size_t)n * k : (size_t)m * (i % 2 ? k : n)) * 4;
        float *x0 = hget(c[0][i], bytes), *x1 = hget(c[1][i], bytes);
        char what[96];
        snprintf(what, sizeof what, "bf16 gemm %s against rounding", names[i]);
        CHECK_BITS(what, x1, x0, bytes);
        free(x0), free(x1), dfree(c[0][i]), dfree(c[1][i]);
    }
    dfree(W16), dfree(A16), dfree(G16), dfree(W), dfree(A), dfree(G), free(w), free(a), free(g);
}

// One quantized GEMM: A (m, k) and B (n, k) quantized on the CPU under qa and qb, the same
// bytes uploaded to the GPU; C from poison (beta 0) or from c0. Twice on the GPU: equal bits.
static void gemm_q_case(const char *name, int m, int n, int k, const lb_quant_args *qa,
                        const lb_quant_args *qb, float alpha, float beta, double bound)
{
    // colwise operands are quantizations of x^T: draw x with the transposed shape.
    int ar = qa->colwise ? k : m, ac = qa->colwise ? m : k;
    int br = qb->colwise ? k : n, bc = qb->colwise ? n : k;
    float *xa = scaled_randn(ar, ac), *xb = scaled_randn(br, bc);
    float *c0 = randn((size_t)m * n, 1.0f);
    lb_qmat ha, hb, da, db;
    lb_qmat_alloc(&ha, ar, ac, qa);
    lb_qmat_alloc(&hb, br, bc, qb);
    lb_quantize(&ha, xa, ar, ac, qa);
    lb_quantize(&hb, xb, br, bc, qb);
    qmat_put(&da, &ha, qa, ar, ac);
    qmat_put(&db, &hb, qb, br, bc);
    size_t sc = (size_t)m * n;
    float *ref = hdup(c0, sc * 4);
    cpu->gemm_q(cpu, m, n, k, alpha, &ha, &hb, beta, ref);
    float *dc = dev->alloc(dev, sc * 4), *out[2];
    for (int r = 0; r < 2; r++) {
        if (beta == 0.0f) poison(dc, sc * 4);
        else dev->upload(dev, dc, c0, sc * 4);
        if (r == 1) {   // the same bits from the operands' transposed scales (lb_qmat.tscale)
            ts_put(&da, &ha);
            ts_put(&db, &hb);
        }
        dev->gemm_q(dev, m, n, k, alpha, &da, &db, beta, dc);
        out[r] = hget(dc, sc * 4);
    }
    ts_drop(&da), ts_drop(&db);
    char what[160];
    snprintf(what, sizeof what, "gemm_q %s m %d n %d k %d a %g b %g", name, m, n, k, alpha, beta);
    CHECK_NMSE(what, out[0], ref, sc, bound);
    CHECK_BITS(what, out[0], out[1], sc * 4);
    dev->qmat_free(dev, &da);
    dev->qmat_free(dev, &db);
    lb_qmat_free(&ha);
    lb_qmat_free(&hb);
    dfree(dc);
    free(xa), free(xb), free(c0), free(ref), free(out[0]), free(out[1]);
}

static lb_quant_args gq(lb_format fmt, int colwise, int weight, lb_elem elem, lb_scale_rule rule,
                        lb_scale2_mode s2, int sr)
{
    lb_quant_args a;
    memset(&a, 0, sizeof a);
    a.fmt = fmt, a.colwise = colwise, a.weight_blocks = weight, a.elem = elem, a.rule = rule;
    a.s2_mode = s2, a.sr = sr, a.seed = seed, a.step = 5, a.tensor = 77 + (uint64_t)colwise;
    return a;
}

// q's quantization; signs: room for G per-group signs (hsigns_draw -1).
static lb_quant_args qspec_args(const qspec *q, int G, uint32_t *signs)
{
    lb_quant_args a = gq(q->fmt, q->colwise, q->weight, q->elem, q->rule, q->s2, q->sr);
    a.pow2 = q->pow2;
    a.hadamard = q->hadamard;
    a.hsigns = q->hsigns_draw > 0 ? lb_hadamard_signs(q->hadamard, seed, 5, q->hsigns_draw)
                                  : q->hsigns;
    if (q->hsigns_draw < 0) {
        for (int j = 0; j < G; j++) signs[j] = lb_hadamard_signs(q->hadamard, seed, 5, 20 + (uint64_t)j);
        a.hsigns_groups = signs;
    }
    return a;
}

// A grouped quantization's inputs and outputs: the case's groups (rows, padded to prows: a
// multiple of pad, 0 not padded; group 4, when empty, all padding), the quantization a of its
// q[qi], x (n, cols) on the host and the device, and each group's qmat under a on the host (h)
// and on the device (d), the device's poisoned. With the case's p[2] set, x is an activation
// in bf16 (lb_act): its values rounded to bf16, the ops given them in to_bf16's layout, so
// the device's conversion is checked against the CPU's.
typedef struct {
    int cols, G, n;
    int rows[LB_TEST_MAX_GROUPS], *prows;
    uint32_t signs[LB_TEST_MAX_GROUPS];
    lb_quant_args a;
    float *x, *dx;
    uint16_t *x16, *dx16;
    lb_act hx, dxa;   // what the CPU and the device are given
    lb_qmat *h, *d;
} grouped_io;

static void grouped_setup(grouped_io *g, const test_case *tst, int qi)
{
    const int cols = tst->p[0], pad = tst->p[1], G = tst->g.count;
    g->cols = cols, g->G = G;
    group_rows(&tst->g, g->rows);
    g->a = qspec_args(&tst->q[qi], G, g->signs);
    const int *rows = g->rows;
    int *prows = g->prows = lb_calloc(G, sizeof *prows);
    g->n = 0;
    for (int j = 0; j < G; j++) {
        prows[j] = pad ? (rows[j] + pad - 1) / pad * pad : rows[j];
        g->n += rows[j];
    }
    if (pad && G > 4 && rows[4] == 0) prows[4] = pad;   // no rows of x: all zeros
    g->x = qinput(g->n, cols, 2), g->dx = dput(g->x, (size_t)g->n * cols * 4);
    g->x16 = NULL, g->dx16 = NULL;
    g->hx = lb_act_f32(g->x, g->n, cols), g->dxa = lb_act_f32(g->dx, g->n, cols);
    if (tst->p[2]) {
        const size_t ld = (size_t)(cols + 7) / 8 * 8;
        g->x16 = lb_calloc((size_t)g->n * ld + 8, sizeof *g->x16);
        for (int r = 0; r < g->n; r++)
            for (int c = 0; c < cols; c++) {
                float *v = &g->x[(size_t)r * cols + c];
                g->x16[r * ld + c] = lb_f32_to_bf16(*v);
                *v = lb_bf16_to_f32(g->x16[r * ld + c]);
            }
        g->dx16 = dput(g->x16, ((size_t)g->n * ld + 8) * 2);
        g->hx = lb_act_bf16(g->x16, g->n, cols), g->dxa = lb_act_bf16(g->dx16, g->n, cols);
    }
    lb_qmat *h = g->h = lb_calloc(G, sizeof *h), *d = g->d = lb_calloc(G, sizeof *d);
    for (int j = 0; j < G; j++) {
        if (!prows[j]) continue;
        lb_qmat_alloc(&h[j], prows[j], cols, &g->a);
        dev->qmat_alloc(dev, &d[j], prows[j], cols, &g->a);
        poison(d[j].data, lb_qmat_data_bytes(&h[j]));
        poison(d[j].scale, lb_qmat_scale_bytes(&h[j]));
        if (h[j].nscale2) poison(d[j].scale2, (size_t)h[j].nscale2 * 4);
    }
}

// Frees what grouped_setup made but the qmats (groups_check frees those).
static void grouped_free(grouped_io *g)
{
    free(g->x), dfree(g->dx), free(g->prows), free(g->h), free(g->d);
    if (g->x16) free(g->x16), dfree(g->dx16);
}

// Each group's device qmat d[j] against the CPU's h[j], byte for byte (data, scales, second
// levels, transposed scales), named "<what> group j"; then both are freed.
static void groups_check(const char *what0, int G, const int *rows, const int *prows,
                         lb_qmat *h, lb_qmat *d)
{
    for (int j = 0; j < G; j++) {
        if (!prows[j]) continue;
        lb_qmat got;
        qmat_get(&got, &d[j]);
        char what[200];
        snprintf(what, sizeof what, "%s group %d (%d of %d rows)", what0, j, rows[j], prows[j]);
        CHECK_BITS(what, got.data, h[j].data, lb_qmat_data_bytes(&h[j]));
        CHECK_BITS(what, got.scale, h[j].scale, lb_qmat_scale_bytes(&h[j]));
        if (h[j].nscale2) CHECK_BITS(what, got.scale2, h[j].scale2, (size_t)h[j].nscale2 * 4);
        ts_check(what, &d[j], &h[j]);
        lb_qmat_free(&got);
        lb_qmat_free(&h[j]);
        dev->qmat_free(dev, &d[j]);
    }
}

// quantize_grouped against the CPU's, byte for byte (data, scales, second levels; the GPU's
// buffers poisoned first): groups of awkward sizes, one empty and one all padding, padded to
// a multiple of pad rows (0: not padded); every direction and block shape of fp8-block (one
// launch on the GPU) and the per-group path of other formats, stochastic rounding included (a
// stream per group), and the wgrad's Hadamard transform fused into column-wise quantization.
// label: the name; q[0]: the quantization; p: cols, pad; g: the groups' rows
static void quant_grouped_case(const test_case *tst)
{
    grouped_io io;
    grouped_setup(&io, tst, 0);
    for (int j = 0; j < io.G; j++)
        if (io.prows[j]) ts_attach(&io.h[j], &io.d[j]);
    cpu->quantize_grouped(cpu, io.G, io.h, io.hx, io.rows, io.prows, &io.a);
    dev->quantize_grouped(dev, io.G, io.d, io.dxa, io.rows, io.prows, &io.a);
    char what[160];
    snprintf(what, sizeof what, "quantize_grouped %s", tst->label);
    groups_check(what, io.G, io.rows, io.prows, io.h, io.d);
    grouped_free(&io);
}

// Two amaxes the same, NaN equal to NaN.
static int amax_same(float a, float b)
{
    return (a != a && b != b) || memcmp(&a, &b, sizeof a) == 0;
}

// quantize_amax against the CPU's (groups of awkward sizes, one empty, one all padding), and
// the CPU's against the second levels of its own quantize_grouped (each lb_nvfp4_scale2 of its
// amax); then quantize_grouped with given amaxes (lb_quant_args.amax: 4x a level's own, a
// quarter of it, zero, in turn) against the CPU's, byte for byte, and the CPU's second levels
// against lb_nvfp4_scale2 of the larger amax. The paths: mq_kernel's maxima pass (rows,
// columns, Hadamard 16, many launches) and the per-group passes (Hadamard 32).
// label: the name; q[0]: the quantization (NVFP4, per row or tensor); p: cols, pad; g: rows
static void quant_amax_case(const test_case *tst)
{
    const char *name = tst->label;
    grouped_io io;
    grouped_setup(&io, tst, 0);
    const int cols = io.cols, G = io.G, *rows = io.rows, *prows = io.prows;
    const lb_quant_args *a = &io.a;
    const lb_act x = io.hx, dx = io.dxa;
    lb_qmat *h = io.h, *d = io.d;
    int na = 0;
    for (int j = 0; j < G; j++)
        if (prows[j]) na += lb_quant_nscale2(prows[j], cols, a);
    float *ha = lb_malloc((size_t)na * 4 + 4), *da = dpoisoned((size_t)na * 4 + 4);
    cpu->quantize_amax(cpu, ha, G, x, rows, prows, a);
    dev->quantize_amax(dev, da, G, dx, rows, prows, a);
    float *ga = hget(da, (size_t)na * 4);
    int bad = 0, first = -1;
    for (int i = 0; i < na; i++)
        if (!amax_same(ga[i], ha[i]) && bad++ == 0) first = i;
    ck_assert_msg(bad == 0, "quantize_amax %s: %d of %d amaxes differ, first %d: %g, cpu %g "
                  "(seed %llu)", name, bad, na, first, first < 0 ? 0.0 : (double)ga[first],
                  first < 0 ? 0.0 : (double)ha[first], (unsigned long long)seed);
    cpu->quantize_grouped(cpu, G, h, x, rows, prows, a);
    for (int j = 0, i = 0; j < G; j++)
        for (int k = 0; prows[j] && k < h[j].nscale2; k++, i++)
            ck_assert_msg(amax_same(h[j].scale2[k], lb_nvfp4_scale2(ha[i])),
                          "quantize_amax %s: group %d level %d: amax %g, scale2 %g", name, j, k,
                          (double)ha[i], (double)h[j].scale2[k]);
    float *fl = lb_malloc((size_t)na * 4 + 4);
    for (int i = 0; i < na; i++) fl[i] = i % 3 == 0 ? 4.0f * ha[i] : i % 3 == 1 ? 0.25f * ha[i] : 0.0f;
    float *dfl = dput(fl, (size_t)na * 4 + 4);
    lb_quant_args b = *a;
    b.amax = fl;
    cpu->quantize_grouped(cpu, G, h, x, rows, prows, &b);
    b.amax = dfl;
    dev->quantize_grouped(dev, G, d, dx, rows, prows, &b);
    for (int j = 0, i = 0; j < G; j++)
        for (int k = 0; prows[j] && k < h[j].nscale2; k++, i++) {
            const float m = ha[i] != ha[i] || fl[i] != fl[i] ? NAN : fmaxf(ha[i], fl[i]);
            ck_assert_msg(amax_same(h[j].scale2[k], lb_nvfp4_scale2(m)),
                          "quantize_grouped %s with amaxes: group %d level %d: scale2 %g, not "
                          "from %g", name, j, k, (double)h[j].scale2[k], (double)m);
        }
    char what[160];
    snprintf(what, sizeof what, "quantize_grouped %s with amaxes", name);
    groups_check(what, G, rows, prows, h, d);
    grouped_free(&io);
    free(ha), dfree(da), free(ga), free(fl), dfree(dfl);
}

// quantize_rc against the CPU's (quantize row-wise of all rows, then quantize_grouped
// column-wise), byte for byte, the GPU's buffers poisoned first: fp8-block 1x128 both ways (one
// pass on CUDA: the column-wise tiles also written row-wise) with groups of awkward sizes, one
// empty and one all padding, rows of x 16-byte aligned or not (cols 200, 130), more groups than
// one launch takes; and pairs that CUDA runs as the two calls (MXFP8, stochastic rounding).
// label: the name; q: the row-wise and the column-wise quantization; p: cols, pad; g: the
// groups' rows
static void quant_rc_case(const test_case *tst)
{
    const char *name = tst->label;
    grouped_io io;   // the column-wise groups
    grouped_setup(&io, tst, 1);
    const int cols = io.cols, G = io.G, n = io.n, *rows = io.rows, *prows = io.prows;
    uint32_t signs[LB_TEST_MAX_GROUPS];
    const lb_quant_args qr = qspec_args(&tst->q[0], G, signs), *ar = &qr, *ac = &io.a;
    const lb_act x = io.hx, dx = io.dxa;
    lb_qmat hr, dr, *h = io.h, *d = io.d;
    lb_qmat_alloc(&hr, n, cols, ar);
    dev->qmat_alloc(dev, &dr, n, cols, ar);
    poison(dr.data, lb_qmat_data_bytes(&hr)), poison(dr.scale, lb_qmat_scale_bytes(&hr));
    ts_attach(&hr, &dr);
    for (int j = 0; j < G; j++)
        if (prows[j]) ts_attach(&h[j], &d[j]);
    cpu->quantize_rc(cpu, &hr, ar, G, h, x, rows, prows, ac);
    dev->quantize_rc(dev, &dr, ar, G, d, dx, rows, prows, ac);
    char what[160];
    lb_qmat got;
    qmat_get(&got, &dr);
    snprintf(what, sizeof what, "quantize_rc %s, row-wise (%d, %d)", name, n, cols);
    CHECK_BITS(what, got.data, hr.data, lb_qmat_data_bytes(&hr));
    CHECK_BITS(what, got.scale, hr.scale, lb_qmat_scale_bytes(&hr));
    ts_check(what, &dr, &hr);
    lb_qmat_free(&got), lb_qmat_free(&hr), dev->qmat_free(dev, &dr);
    int differ = 0;
    for (int j = 0; j < G; j++) {
        if (!prows[j]) continue;
        qmat_get(&got, &d[j]);
        differ += memcmp(got.data, h[j].data, lb_qmat_data_bytes(&h[j])) != 0;
        differ += memcmp(got.scale, h[j].scale, lb_qmat_scale_bytes(&h[j])) != 0;
        snprintf(what, sizeof what, "quantize_rc %s, column-wise group %d", name, j);
        ts_check(what, &d[j], &h[j]);
        lb_qmat_free(&got), lb_qmat_free(&h[j]), dev->qmat_free(dev, &d[j]);
    }
    if (verbose())
        printf("  quantize_rc %s, column-wise, %d groups: %d differ\n", name, G, differ);
    ck_assert_msg(differ == 0, "quantize_rc %s: %d column-wise groups differ (seed %llu)", name,
                  differ, (unsigned long long)seed);
    grouped_free(&io);
}

// qmat_transpose against the CPU's, byte for byte: square blocks (fp8-block 128x128, NVFP4
// 16x16 with one second level), matrices of awkward shapes (odd rows for E2M1's nibble pairs)
// in one call, row-wise to column-wise and back, and one whose rows are all 16-byte aligned
// (the kernel's 16-byte path); the CPU's result is itself checked against a direct quantization
// in test_quant.
// label: the name; p: fmt, colwise
static void qmat_transpose_case(const test_case *tst)
{
    const char *name = tst->label;
    const lb_format fmt = (lb_format)tst->p[0];
    const int colwise = tst->p[1];
    enum { G = 5 };
    const int rows[G] = {300, 37, 129, 1, 256}, cols[G] = {200, 50, 17, 260, 192};
    lb_quant_args a = gq(fmt, colwise, 1, LB_E4M3, 0, LB_S2_TENSOR, 0), b = a;
    b.colwise = !colwise;
    lb_qmat hs[G], hd[G], ds[G], dd[G];
    for (int j = 0; j < G; j++) {
        float *x = qinput(rows[j], cols[j], j % 3);
        lb_qmat_alloc(&hs[j], rows[j], cols[j], &a);
        lb_qmat_alloc(&hd[j], rows[j], cols[j], &b);
        lb_quantize(&hs[j], x, rows[j], cols[j], &a);
        dev->qmat_alloc(dev, &ds[j], rows[j], cols[j], &a);
        dev->qmat_alloc(dev, &dd[j], rows[j], cols[j], &b);
        dev->upload(dev, ds[j].data, hs[j].data, lb_qmat_data_bytes(&hs[j]));
        dev->upload(dev, ds[j].scale, hs[j].scale, lb_qmat_scale_bytes(&hs[j]));
        if (hs[j].nscale2) dev->upload(dev, ds[j].scale2, hs[j].scale2, (size_t)hs[j].nscale2 * 4);
        poison(dd[j].data, lb_qmat_data_bytes(&hd[j]));
        poison(dd[j].scale, lb_qmat_scale_bytes(&hd[j]));
        if (hd[j].nscale2) poison(dd[j].scale2, (size_t)hd[j].nscale2 * 4);
        free(x);
    }
    cpu->qmat_transpose(cpu, G, hd, hs);
    dev->qmat_transpose(dev, G, dd, ds);
    for (int j = 0; j < G; j++) {
        lb_qmat got;
        qmat_get(&got, &dd[j]);
        char what[160];
        snprintf(what, sizeof what, "qmat_transpose %s matrix %d (%d, %d)", name, j, rows[j],
                 cols[j]);
        CHECK_BITS(what, got.data, hd[j].data, lb_qmat_data_bytes(&hd[j]));
        CHECK_BITS(what, got.scale, hd[j].scale, lb_qmat_scale_bytes(&hd[j]));
        if (hd[j].nscale2) CHECK_BITS(what, got.scale2, hd[j].scale2, (size_t)hd[j].nscale2 * 4);
        lb_qmat_free(&got);
        lb_qmat_free(&hs[j]);
        lb_qmat_free(&hd[j]);
        dev->qmat_free(dev, &ds[j]);
        dev->qmat_free(dev, &dd[j]);
    }
}

// quantize_rt against the CPU's (quantize_grouped, then qmat_transpose), byte for byte, both
// copies poisoned first: fp8-block 128x128 (one pass on CUDA, each tile also stored
// transposed) with groups of awkward row counts, one empty, the transposed rows 16-byte
// aligned or not (rows 256 or 300), the rows of x aligned or not (cols 200, 130), more groups
// than one launch takes, stochastic rounding, power-of-two scales; and NVFP4 16x16, which CUDA
// runs as the two calls.
// label: the name; p: fmt, sr, cols, pow2; g: the groups' rows
static void quant_rt_case(const test_case *tst)
{
    const char *name = tst->label;
    const lb_format fmt = (lb_format)tst->p[0];
    const int sr = tst->p[1], cols = tst->p[2], G = tst->g.count;
    int rows[LB_TEST_MAX_GROUPS];
    group_rows(&tst->g, rows);
    lb_quant_args a = gq(fmt, 0, 1, LB_E4M3, 0, LB_S2_TENSOR, sr), b;
    a.pow2 = tst->p[3];
    b = a;
    b.colwise = 1;
    int n = 0;
    for (int j = 0; j < G; j++) n += rows[j];
    float *x = qinput(n, cols, 2), *dx = dput(x, (size_t)n * cols * 4);
    lb_qmat *hr = lb_calloc(G, sizeof *hr), *hc = lb_calloc(G, sizeof *hc);
    lb_qmat *dr = lb_calloc(G, sizeof *dr), *dc = lb_calloc(G, sizeof *dc);
    for (int j = 0; j < G; j++) {
        if (!rows[j]) continue;
        lb_qmat_alloc(&hr[j], rows[j], cols, &a), lb_qmat_alloc(&hc[j], rows[j], cols, &b);
        dev->qmat_alloc(dev, &dr[j], rows[j], cols, &a);
        dev->qmat_alloc(dev, &dc[j], rows[j], cols, &b);
        const lb_qmat *q[2] = {&dr[j], &dc[j]};
        for (int i = 0; i < 2; i++) {
            poison(q[i]->data, lb_qmat_data_bytes(q[i]));
            poison(q[i]->scale, lb_qmat_scale_bytes(q[i]));
            if (q[i]->nscale2) poison(q[i]->scale2, (size_t)q[i]->nscale2 * 4);
        }
    }
    cpu->quantize_rt(cpu, G, hr, hc, x, rows, cols, &a);
    dev->quantize_rt(dev, G, dr, dc, dx, rows, cols, &a);
    int differ = 0, groups = 0;
    for (int j = 0; j < G; j++) {
        if (!rows[j]) continue;
        groups++;
        const lb_qmat *h[2] = {&hr[j], &hc[j]}, *d[2] = {&dr[j], &dc[j]};
        for (int i = 0; i < 2; i++) {
            lb_qmat got;
            qmat_get(&got, d[i]);
            int bad = memcmp(got.data, h[i]->data, lb_qmat_data_bytes(h[i])) != 0 ||
                      memcmp(got.scale, h[i]->scale, lb_qmat_scale_bytes(h[i])) != 0 ||
                      (h[i]->nscale2 && memcmp(got.scale2, h[i]->scale2, h[i]->nscale2 * 4));
            if (bad && differ < 3)
                printf("  quantize_rt %s: group %d (%d, %d) %s copy differs\n", name, j, rows[j],
                       cols, i ? "transposed" : "row-wise");
            differ += bad;
            lb_qmat_free(&got);
        }
        lb_qmat_free(&hr[j]), lb_qmat_free(&hc[j]);
        dev->qmat_free(dev, &dr[j]), dev->qmat_free(dev, &dc[j]);
    }
    if (verbose())
        printf("  quantize_rt %s, %d groups, cols %d: %d copies differ\n", name, groups, cols,
               differ);
    ck_assert_msg(differ == 0, "quantize_rt %s: %d copies differ (seed %llu)", name, differ,
                  (unsigned long long)seed);
    free(x), dfree(dx), free(hr), free(hc), free(dr), free(dc);
}

static void gemm_q_all_case(const test_case *tst)
{
#ifdef LB_HAVE_CUDA
    long nat0, fb0, em0, gr0;
    int cc;
    lb_cuda_gemm_q_stats(dev, &nat0, &fb0, &em0, &gr0, &cc);
#endif
    const struct { int m, n, k; } sz[] = {
        {37, 29, 53}, {129, 200, 300}, {256, 384, 512}, {1, 64, 128}, {300, 100, 1000},
        {16, 48, 48},
    };
    const int nsz = (int)(sizeof sz / sizeof sz[0]);
    int k16 = 0;   // sizes with k a multiple of 16: their 3 cases with a 1x128 A may run on
                   // gemm_grouped.cu's fp8 kernel instead of cuBLASLt
    for (int s = 0; s < nsz; s++) {
        int m = sz[s].m, n = sz[s].n, k = sz[s].k;
        k16 += k % 16 == 0;
        float al = s % 2 ? 0.75f : 1.0f, be = s % 3 == 1 ? 1.0f : s % 3 == 2 ? -0.5f : 0.0f;
        // fp8-block: fprop (1x128 x 128x128), dgrad-like (1x128 x col-wise 128x128), wgrad
        // (1x128 x 1x128, both column-wise), 128x128 x 1x128, and 2D x 2D (fp32 fallback).
        lb_quant_args a1 = gq(LB_FMT_FP8_BLOCK, 0, 0, LB_E4M3, 0, 0, 0);
        lb_quant_args w2 = gq(LB_FMT_FP8_BLOCK, 0, 1, LB_E4M3, 0, 0, 0);
        lb_quant_args w2c = gq(LB_FMT_FP8_BLOCK, 1, 1, LB_E4M3, 0, 0, 0);
        lb_quant_args g1 = gq(LB_FMT_FP8_BLOCK, 1, 0, LB_E4M3, 0, 0, 1);
        gemm_q_case("fp8 1x128 x 128x128", m, n, k, &a1, &w2, al, be, B_FP8TC);
        gemm_q_case("fp8 1x128 x 128x128 col", m, n, k, &a1, &w2c, al, be, B_FP8TC);
        gemm_q_case("fp8 1x128 col sr x 1x128 col", m, n, k, &g1, &g1, al, be, B_FP8TC);
        gemm_q_case("fp8 128x128 x 1x128", m, n, k, &w2, &a1, al, be, B_FP8TC);
        gemm_q_case("fp8 128x128 x 128x128 (fp32 fallback)", m, n, k, &w2, &w2c, al, be, B_ACCUM);
        // fp8-tensor: cuBLASLt's per-tensor scaling, the same FP8 tensor-core accumulation.
        lb_quant_args t1 = gq(LB_FMT_FP8_TENSOR, 0, 0, LB_E4M3, 0, 0, 0);
        lb_quant_args t1c = gq(LB_FMT_FP8_TENSOR, 1, 0, LB_E4M3, 0, 0, 1);
        gemm_q_case("fp8 tensor x tensor", m, n, k, &t1, &t1, al, be, B_FP8TC);
        gemm_q_case("fp8 tensor col sr x tensor", m, n, k, &t1c, &t1, al, be, B_FP8TC);
        // MXFP8, MXFP4, NVFP4: bf16 tensor cores on exact operands.
        lb_quant_args x4 = gq(LB_FMT_MXFP8, 0, 0, LB_E4M3, LB_SCALE_CEIL, 0, 0);
        lb_quant_args x5 = gq(LB_FMT_MXFP8, 1, 0, LB_E5M2, LB_SCALE_FLOOR, 0, 1);
        gemm_q_case("mxfp8 e4m3 x e4m3", m, n, k, &x4, &x4, al, be, B_TC);
        gemm_q_case("mxfp8 e5m2 col sr x e4m3", m, n, k, &x5, &x4, al, be, B_TC);
        lb_quant_args f4 = gq(LB_FMT_MXFP4, 0, 0, LB_E4M3, LB_SCALE_CEIL, 0, 0);
        lb_quant_args f4f = gq(LB_FMT_MXFP4, 1, 0, LB_E4M3, LB_SCALE_FLOOR, 0, 1);
        gemm_q_case("mxfp4 ceil x ceil", m, n, k, &f4, &f4, al, be, B_TC);
        gemm_q_case("mxfp4 floor col sr x ceil", m, n, k, &f4f, &f4, al, be, B_TC);
        lb_quant_args nr = gq(LB_FMT_NVFP4, 0, 0, LB_E4M3, 0, LB_S2_ROW, 0);
        lb_quant_args nt = gq(LB_FMT_NVFP4, 1, 0, LB_E4M3, 0, LB_S2_TENSOR, 1);
        lb_quant_args nw = gq(LB_FMT_NVFP4, 0, 1, LB_E4M3, 0, LB_S2_TENSOR, 0);
        gemm_q_case("nvfp4 per-row x 16x16", m, n, k, &nr, &nw, al, be, B_TC);
        gemm_q_case("nvfp4 tensor col sr x per-row", m, n, k, &nt, &nr, al, be, B_TC);
    }
    // alpha 0: C = beta C without reading the operands (the CPU's GEMM rule).
    lb_quant_args a1 = gq(LB_FMT_FP8_BLOCK, 0, 0, LB_E4M3, 0, 0, 0);
    gemm_q_case("fp8 alpha 0", 20, 30, 40, &a1, &a1, 0.0f, 0.5f, 0.0);
#ifdef LB_HAVE_CUDA
    // Each case runs twice: 4 fp8 cases with a 1x128 operand, one 2D x 2D and two per-tensor
    // ones per size, 6 emulated cases. On Hopper every 1x128 and per-tensor case must run on
    // FP8 tensor cores (cuBLASLt's scaling modes or gemm_grouped.cu's kernel).
    long nat, fb, em, gr;
    lb_cuda_gemm_q_stats(dev, &nat, &fb, &em, &gr, &cc);
    nat -= nat0, fb -= fb0, em -= em0, gr -= gr0;
    if (verbose())
        printf("  gemm_q paths: fp8 cuBLASLt (block or tensor scales) %ld, fp8 wgmma kernel %ld, fp8 fp32 "
               "fallback %ld, emulated %ld (sm_%d)\n", nat, gr, fb, em, cc);
    ck_assert_int_eq(em, nsz * 6 * 2);
    ck_assert_int_eq(nat + gr + fb, nsz * 7 * 2);
    if (cc == 9) {
        ck_assert_msg(nat + gr == nsz * 6 * 2, "fp8: %ld of %d GEMMs with a 1x128 or per-tensor "
                      "operand ran on FP8 tensor cores on sm_90", nat + gr, nsz * 6 * 2);
        ck_assert_int_eq(fb, nsz * 2);
        if (!getenv("LB_CUDA_GROUPED") && !getenv("LB_CUDA_DENSE_TC"))
            ck_assert_int_eq(gr, k16 * 3 * 2);
    }
#endif
}

// gemm_experts' quantized form: the rows of all experts quantized in one call (as linear.c's
// experts are), every expert's weight quantized as a weight cache's row-wise copy, the weights
// one after another in one device allocation as the cache lays them out (gap 0: data n k
// bytes apart, the device-count kernel's layout), or with gap bytes between the experts (the
// host-count path). p: e, n, k, c16, mean rows an expert, gap, format: 0 fp8-block (1x128 A,
// 128x128 weights), 1 MXFP8, 2 MXFP4, 3 NVFP4 (per-row second levels in A); the last three
// with the weights' bf16 copies (lb_qmat.d16, written by the CPU's quantize and uploaded), as
// the cache holds them. Counts as gemm_experts_case's. Against the CPU's gemm_experts, bit for
// bit against the device's gemm_q_grouped on the same groups and against itself run again;
// with d16 also against gemm_q_grouped on weights without it (the copy changes no bit).
static void gemm_experts_q_case(const test_case *tst)
{
    const int e = tst->p[0], n = tst->p[1], k = tst->p[2], c16 = tst->p[3], mean = tst->p[4];
    const size_t gap = (size_t)tst->p[5];
    const int fmt = tst->p[6];
    int rows, *counts = experts_counts(e, mean, &rows);
    static const char *fname[4] = {"fp8", "mxfp8", "mxfp4", "nvfp4"};
    lb_quant_args a1, w2;
    if (fmt == 0) {
        a1 = gq(LB_FMT_FP8_BLOCK, 0, 0, LB_E4M3, 0, 0, 0);
        w2 = gq(LB_FMT_FP8_BLOCK, 0, 1, LB_E4M3, 0, 0, 0);
    } else if (fmt < 3) {
        const lb_format f = fmt == 1 ? LB_FMT_MXFP8 : LB_FMT_MXFP4;
        a1 = gq(f, 0, 0, LB_E4M3, LB_SCALE_CEIL, 0, 0);
        w2 = gq(f, 0, 0, LB_E4M3, LB_SCALE_CEIL, 0, 0);
    } else {
        a1 = gq(LB_FMT_NVFP4, 0, 0, LB_E4M3, 0, LB_S2_ROW, 0);
        w2 = gq(LB_FMT_NVFP4, 0, 0, LB_E4M3, 0, LB_S2_TENSOR, 0);
    }
    float *xa = scaled_randn(rows, k);
    lb_qmat ha, da, *hb = lb_calloc(e, sizeof *hb), *db = lb_calloc(e, sizeof *db);
    lb_qmat_alloc(&ha, rows, k, &a1);
    lb_quantize(&ha, xa, rows, k, &a1);
    qmat_put(&da, &ha, &a1, rows, k);
    lb_qmat_layout(&hb[0], n, k, &w2);
    const size_t dstep = lb_qmat_data_bytes(&hb[0]) + gap, sstep = lb_qmat_scale_bytes(&hb[0]);
    const size_t d16 = fmt ? lb_qmat_d16_bytes(&hb[0]) : 0;
    uint8_t *bdata = dev->alloc(dev, dstep * e);
    char *bscale = dev->alloc(dev, sstep * e), *b16 = d16 ? dev->alloc(dev, d16 * e) : NULL;
    for (int j = 0; j < e; j++) {
        float *xb = scaled_randn(n, k);
        lb_qmat_alloc(&hb[j], n, k, &w2);
        if (d16) hb[j].d16 = lb_malloc(d16);
        lb_quantize(&hb[j], xb, n, k, &w2);
        lb_qmat_layout(&db[j], n, k, &w2);
        db[j].data = bdata + j * dstep, db[j].scale = bscale + j * sstep;
        dev->upload(dev, db[j].data, hb[j].data, lb_qmat_data_bytes(&hb[j]));
        dev->upload(dev, db[j].scale, hb[j].scale, sstep);
        if (hb[j].nscale2) {
            db[j].scale2 = dev->alloc(dev, (size_t)hb[j].nscale2 * 4);
            dev->upload(dev, db[j].scale2, hb[j].scale2, (size_t)hb[j].nscale2 * 4);
        }
        if (d16) {
            db[j].d16 = (uint16_t *)(b16 + j * d16);
            dev->upload(dev, db[j].d16, hb[j].d16, d16);
        }
        free(xb);
    }
    size_t cbytes = c16 ? bytes16(rows, n) : (size_t)rows * n * 4;
    float *ref = lb_malloc((size_t)rows * n * 4);
    lb_gemm_experts_args x = {.c = ref, .counts = counts, .e = e, .rows = rows, .n = n, .k = k,
                              .qa = &ha, .qb = hb};
    cpu->gemm_experts(cpu, &x);   // fp32 C: the reference either way
    int *C = dput(counts, (size_t)e * sizeof(int));
    void *out[4];
    lb_qmat *views = lb_calloc(e, sizeof *views), *plain = lb_calloc(e, sizeof *plain);
    for (int j = 0; j < e; j++) plain[j] = db[j], plain[j].d16 = NULL;
    for (int r = 0; r < (d16 ? 4 : 3); r++) {
        // gemm_experts twice, then gemm_q_grouped on its groups (with d16: on the weights
        // with their copies, then without)
        out[r] = dpoisoned(cbytes);
        lb_gemm_experts_args xd = {.c = c16 ? NULL : out[r], .c16 = c16 ? out[r] : NULL,
                                   .counts = C, .e = e, .rows = rows, .n = n, .k = k, .qa = &da,
                                   .qb = r == 3 ? plain : db};
#ifdef LB_HAVE_CUDA
        if (r == 0 && !strcmp(dev->name, "cuda") && fmt == 0) {
            int cc;
            long x0, x1, x2, x3;
            lb_cuda_gemm_q_stats(dev, &x0, &x1, &x2, &x3, &cc);
            // the cache's layout on sm_90 takes the device-count kernel; a gap the host path
            ck_assert_int_eq(lb_cuda_gemm_experts_q_fits(&xd), cc == 9 && gap == 0);
        }
#endif
        if (r < 2) {
            if (r == 1) ts_put(&da, &ha);   // the same bits from A's transposed scales
            dev->gemm_experts(dev, &xd);
            ts_drop(&da);
        } else {
            lb_gemm_q_args *g = lb_experts_qgroups(&xd, counts, views);
            dev->gemm_q_grouped(dev, e, g);
            free(g);
        }
    }
    char name[80];
    snprintf(name, sizeof name, "gemm_experts %s e %d n %d k %d gap %zu", fname[fmt], e, n, k,
             gap);
    if (d16) {   // the copies change no bit of gemm_q_grouped
        void *h2 = hget(out[2], cbytes), *h3 = hget(out[3], cbytes);
        char what[120];
        snprintf(what, sizeof what, "%s: gemm_q_grouped with d16 = without", name);
        CHECK_BITS(what, h2, h3, cbytes);
        free(h2), free(h3), dfree(out[3]);
    }
    experts_check(name, "gemm_q_grouped", out, cbytes, rows, n, c16, ref, tst->bound);
    for (int j = 0; j < e; j++) {
        free(hb[j].d16), hb[j].d16 = NULL;
        lb_qmat_free(&hb[j]);
        if (db[j].scale2) dev->free(dev, db[j].scale2);
    }
    dev->qmat_free(dev, &da);
    lb_qmat_free(&ha);
    dfree(bdata), dfree(bscale), dfree(C);
    if (b16) dfree(b16);
    free(counts), free(xa), free(hb), free(db), free(views), free(plain), free(ref);
}

// The d16 copies (lb_qmat.d16) of MX and NVFP4 matrices as quantize, quantize_grouped and
// qmat_transpose write them: the CPU's values are the dequantized blocks exactly (bf16 holds
// them), zeros past cols; the device's are the CPU's bits. p: rows, cols.
static void quantize_d16_case(const test_case *tst)
{
    const int rows = tst->p[0], cols = tst->p[1], ld = (cols + 7) & ~7;
    const lb_quant_args fm[5] = {gq(LB_FMT_MXFP8, 0, 0, LB_E4M3, LB_SCALE_CEIL, 0, 0),
                                 gq(LB_FMT_MXFP8, 1, 0, LB_E5M2, LB_SCALE_FLOOR, 0, 0),
                                 gq(LB_FMT_MXFP4, 0, 0, LB_E4M3, LB_SCALE_CEIL, 0, 0),
                                 gq(LB_FMT_NVFP4, 0, 0, LB_E4M3, 0, LB_S2_ROW, 0),
                                 gq(LB_FMT_NVFP4, 0, 1, LB_E4M3, 0, LB_S2_TENSOR, 0)};
    float *x = scaled_randn(rows, cols);
    float *X = dput(x, (size_t)rows * cols * 4);
    char what[120];
    for (int f = 0; f < 5; f++) {
        const lb_quant_args *a = &fm[f];
        lb_qmat h;
        lb_qmat_alloc(&h, rows, cols, a);   // column-wise: h is (cols, rows)
        const int qr = h.rows, qc = h.cols, qld = (qc + 7) & ~7;
        const size_t nb = (size_t)qr * qld * 2;
        h.d16 = lb_malloc(nb);
        memset(h.d16, 0xff, nb);
        lb_quantize(&h, x, rows, cols, a);
        float *y = lb_malloc((size_t)qr * qc * 4);
        lb_dequantize_blocks(y, &h);
        int exact = 1;
        for (int r = 0; r < qr; r++)
            for (int c = 0; c < qld; c++) {
                const float v = lb_bf16_to_f32(h.d16[(size_t)r * qld + c]);
                if (c < qc ? v != y[(size_t)r * qc + c] : h.d16[(size_t)r * qld + c] != 0)
                    exact = 0;
            }
        snprintf(what, sizeof what, "d16 %d: the cpu's copy is the dequantized blocks", f);
        ck_assert_msg(exact, "%s (seed %llu)", what, (unsigned long long)seed);
        // the device's quantize, then quantize_grouped in three groups of rows (row-wise)
        lb_qmat d;
        dev->qmat_alloc(dev, &d, rows, cols, a);
        d.d16 = dpoisoned(nb);
        dev->quantize(dev, &d, lb_act_f32(X, rows, cols), a);
        uint16_t *got = hget(d.d16, nb);
        snprintf(what, sizeof what, "d16 %d: quantize = cpu", f);
        CHECK_BITS(what, got, h.d16, nb);
        free(got);
        if (!a->colwise) {
            const int g[3] = {rows / 3, 0, rows - rows / 3};
            lb_qmat dg[3];
            uint16_t *dd[3];
            size_t off = 0;
            for (int j = 0; j < 3; j++) {
                memset(&dg[j], 0, sizeof dg[j]);
                dd[j] = NULL;
                if (!g[j]) continue;
                dev->qmat_alloc(dev, &dg[j], g[j], cols, a);
                dg[j].d16 = dd[j] = dpoisoned((size_t)g[j] * ld * 2);
            }
            dev->quantize_grouped(dev, 3, dg, lb_act_f32(X, rows, cols), g, NULL, a);
            for (int j = 0; j < 3; j++) {
                if (!g[j]) continue;
                lb_qmat hj;
                lb_qmat_alloc(&hj, g[j], cols, a);
                hj.d16 = lb_malloc((size_t)g[j] * ld * 2);
                lb_quantize(&hj, x + off * cols, g[j], cols, a);
                got = hget(dd[j], (size_t)g[j] * ld * 2);
                snprintf(what, sizeof what, "d16 %d: quantize_grouped group %d = cpu", f, j);
                CHECK_BITS(what, got, hj.d16, (size_t)g[j] * ld * 2);
                free(got), free(hj.d16), hj.d16 = NULL;
                lb_qmat_free(&hj);
                off += (size_t)g[j];
                dfree(dd[j]), dg[j].d16 = NULL;
                dev->qmat_free(dev, &dg[j]);
            }
        }
        if (a->weight_blocks) {   // square blocks: the transposed copy's d16 too
            const lb_quant_args ac = gq(LB_FMT_NVFP4, 1, 1, LB_E4M3, 0, LB_S2_TENSOR, 0);
            const size_t tb = (size_t)cols * ((rows + 7) & ~7) * 2;
            lb_qmat ht, dt;
            lb_qmat_alloc(&ht, rows, cols, &ac);   // (cols, rows)
            ht.d16 = lb_malloc(tb);
            lb_qmat_transpose(&ht, &h);
            dev->qmat_alloc(dev, &dt, rows, cols, &ac);
            dt.d16 = dpoisoned(tb);
            dev->qmat_transpose(dev, 1, &dt, &d);
            got = hget(dt.d16, tb);
            snprintf(what, sizeof what, "d16 %d: qmat_transpose = cpu", f);
            CHECK_BITS(what, got, ht.d16, tb);
            free(got), free(ht.d16), ht.d16 = NULL;
            lb_qmat_free(&ht);
            dfree(dt.d16), dt.d16 = NULL;
            dev->qmat_free(dev, &dt);
        }
        dfree(d.d16), d.d16 = NULL;
        dev->qmat_free(dev, &d);
        free(h.d16), h.d16 = NULL;
        lb_qmat_free(&h);
        free(y);
    }
    dfree(X);
    free(x);
}

// gemm_q_grouped: the groups of an MoE layer. As linear.c does, the activations of all groups
// are quantized in one call (row-wise blocks are per row) and split by lb_qmat_rows; each group
// has its own weight matrix. The CPU quantizes, the same bytes go to the GPU. Each group must
// match the CPU's gemm_q within `bound`, equal bit for bit the same group run alone, and one
// row alone must equal that row in the group (batch invariance). Returns the groups the GPU
// ran on its grouped fp8 kernel.
static long gemm_q_grouped_case(const char *name, int G, const int *counts, int k, int n,
                                const lb_quant_args *qa, const lb_quant_args *qb, float alpha,
                                float beta, double bound)
{
    int m = 0;
    for (int j = 0; j < G; j++) m += counts[j];
    float *xa = scaled_randn(m, k), *c0 = randn((size_t)m * n, 1.0f);
    lb_qmat ha, da, *hb = lb_calloc(G, sizeof *hb), *db = lb_calloc(G, sizeof *db);
    lb_qmat_alloc(&ha, m, k, qa);
    lb_quantize(&ha, xa, m, k, qa);
    qmat_put(&da, &ha, qa, m, k);
    int br = qb->colwise ? k : n, bc = qb->colwise ? n : k;
    for (int j = 0; j < G; j++) {
        float *xb = scaled_randn(br, bc);
        lb_qmat_alloc(&hb[j], br, bc, qb);
        lb_quantize(&hb[j], xb, br, bc, qb);
        qmat_put(&db[j], &hb[j], qb, br, bc);
        free(xb);
    }
    size_t sc = (size_t)m * n;
    float *ref = hdup(c0, sc * 4), *dc[2];
    lb_qmat *hv = lb_calloc(G, sizeof *hv), *dv = lb_calloc(G, sizeof *dv);
    lb_gemm_q_args *hg = lb_calloc(G, sizeof *hg), *dg[2] = {lb_calloc(G, sizeof *hg),
                                                              lb_calloc(G, sizeof *hg)};
    for (int r = 0; r < 2; r++) {
        dc[r] = dev->alloc(dev, sc * 4);
        if (beta == 0.0f) poison(dc[r], sc * 4);
        else dev->upload(dev, dc[r], c0, sc * 4);
    }
    int off = 0;
    for (int j = 0; j < G; j++) {
        int mj = counts[j];
        // an empty group's view is never read: it borrows one row
        hv[j] = lb_qmat_rows(&ha, mj ? off : 0, mj ? mj : 1);
        dv[j] = lb_qmat_rows(&da, mj ? off : 0, mj ? mj : 1);
        hv[j].rows = dv[j].rows = mj;
        hg[j] = (lb_gemm_q_args){mj, n, k, alpha, beta, &hv[j], &hb[j],
                                 ref + (size_t)off * n, NULL};
        for (int r = 0; r < 2; r++)
            dg[r][j] = (lb_gemm_q_args){mj, n, k, alpha, beta, &dv[j], &db[j],
                                        dc[r] + (size_t)off * n, NULL};
        off += mj;
    }
    cpu->gemm_q_grouped(cpu, G, hg);
#ifdef LB_HAVE_CUDA
    long n0, f0, e0, gr0, gr;
    int cc;
    lb_cuda_gemm_q_stats(dev, &n0, &f0, &e0, &gr0, &cc);
#endif
    dev->gemm_q_grouped(dev, G, dg[0]);
    for (int j = 0; j < G; j++) dev->gemm_q_grouped(dev, 1, &dg[1][j]);
    // row 200 of the last group (a middle row of its second tile) alone, or its last row
    const int row = m - counts[G - 1] + (counts[G - 1] > 200 ? 200 : counts[G - 1] - 1);
    lb_qmat dr = lb_qmat_rows(&da, row, 1);
    float *d1 = dpoisoned((size_t)n * 4);
    if (beta != 0.0f) dev->upload(dev, d1, c0 + (size_t)row * n, (size_t)n * 4);
    lb_gemm_q_args one = {1, n, k, alpha, beta, &dr, &db[G - 1], d1, NULL};
    dev->gemm_q_grouped(dev, 1, &one);
#ifdef LB_HAVE_CUDA
    lb_cuda_gemm_q_stats(dev, &n0, &f0, &e0, &gr, &cc);
    gr -= gr0;
#else
    long gr = 0;
#endif
    float *out0 = hget(dc[0], sc * 4), *out1 = hget(dc[1], sc * 4), *o1 = hget(d1, (size_t)n * 4);
    char what[160];
    snprintf(what, sizeof what, "gemm_q_grouped %s k %d n %d a %g b %g", name, k, n, alpha, beta);
    CHECK_NMSE(what, out0, ref, sc, bound);
    snprintf(what, sizeof what, "gemm_q_grouped %s against each group alone", name);
    CHECK_BITS(what, out0, out1, sc * 4);
    snprintf(what, sizeof what, "gemm_q_grouped %s one row alone", name);
    CHECK_BITS(what, o1, out0 + (size_t)row * n, (size_t)n * 4);
    if (beta == 0.0f) {
        // a bf16 output (c16): the same fp32 C rounded once, the pad columns untouched, from the
        // fp8 kernel's TMA store (n a multiple of 8) or through an fp32 C of the backend's own
        // (n 200 is one, 100 is not; and with the TMA store off: LB_CUDA_GG_TMA_STORE=0)
        lb_backend *bes[2] = {dev, cuda_with("LB_CUDA_GG_TMA_STORE=0", NULL)};
        const int ld = (n + 7) / 8 * 8;
        const size_t b16 = (size_t)m * ld * 2;
        uint16_t *want = lb_malloc(b16);
        memset(want, 0xff, b16);   // the poison
        for (size_t r = 0; r < (size_t)m; r++)
            for (int c = 0; c < n; c++) want[r * ld + c] = lb_f32_to_bf16(out0[r * n + c]);
        lb_gemm_q_args *g16 = lb_calloc(G, sizeof *g16);
        for (int bi = 0; bi < 2; bi++) {
            uint16_t *d16 = dpoisoned(b16);
            for (int j = 0, o = 0; j < G; o += counts[j], j++) {
                g16[j] = dg[0][j];
                g16[j].c = NULL, g16[j].c16 = d16 + (size_t)o * ld;
            }
            dev->sync(dev);   // the buffers are dev's: its uploads first
            bes[bi]->gemm_q_grouped(bes[bi], G, g16);
            bes[bi]->sync(bes[bi]);
            uint16_t *h = hget(d16, b16);
            snprintf(what, sizeof what, "gemm_q_grouped %s n %d c16 (%s)", name, n,
                     bi ? "TMA stores off" : "default");
            CHECK_BITS(what, h, want, b16);
            free(h), dfree(d16);
        }
        bes[1]->destroy(bes[1]);
        free(want), free(g16);
    }
    for (int j = 0; j < G; j++) {
        dev->qmat_free(dev, &db[j]);
        lb_qmat_free(&hb[j]);
    }
    dev->qmat_free(dev, &da);
    lb_qmat_free(&ha);
    dfree(dc[0]), dfree(dc[1]), dfree(d1);
    free(xa), free(c0), free(ref), free(out0), free(out1), free(o1);
    free(hb), free(db), free(hv), free(dv), free(hg), free(dg[0]), free(dg[1]);
    return gr;
}

static void gemm_q_grouped_all_case(const test_case *tst)
{
    lb_quant_args a1 = gq(LB_FMT_FP8_BLOCK, 0, 0, LB_E4M3, 0, 0, 0);
    lb_quant_args w2 = gq(LB_FMT_FP8_BLOCK, 0, 1, LB_E4M3, 0, 0, 0);
    lb_quant_args w2c = gq(LB_FMT_FP8_BLOCK, 1, 1, LB_E4M3, 0, 0, 0);
    lb_quant_args nr = gq(LB_FMT_NVFP4, 0, 0, LB_E4M3, 0, LB_S2_ROW, 0);
    lb_quant_args nw = gq(LB_FMT_NVFP4, 0, 1, LB_E4M3, 0, LB_S2_TENSOR, 0);
    // k 336: a multiple of 16, not of 128 (a partial last block); n 200: a partial tile
    const int c6[6] = {37, 0, 129, 1, 64, 300};
    long tc = 0;
    tc += gemm_q_grouped_case("fp8 1x128 x 128x128", 6, c6, 336, 200, &a1, &w2, 1.0f, 0.0f,
                              B_FP8TC);
    tc += gemm_q_grouped_case("fp8 1x128 x 128x128 col", 6, c6, 336, 200, &a1, &w2c, 0.75f,
                              1.0f, B_FP8TC);
    tc += gemm_q_grouped_case("fp8 1x128 x 1x128", 6, c6, 2048, 136, &a1, &a1, 1.0f, -0.5f,
                              B_FP8TC);
    // beta 0: the wgrad's launches (the TMA-store epilogue beside a 1x128 B's scales)
    tc += gemm_q_grouped_case("fp8 1x128 x 1x128 beta 0", 6, c6, 2048, 136, &a1, &a1, 1.0f, 0.0f,
                              B_FP8TC);
    // 250 groups of 0 to 3 rows: more than one launch takes (32 on sm_90)
    enum { MANY = 250 };
    int cm[MANY], nonempty = 0;
    for (int j = 0; j < MANY; j++) nonempty += (cm[j] = j % 4) > 0;
    tc += gemm_q_grouped_case("fp8 250 groups", MANY, cm, 256, 40, &a1, &w2, 1.0f, 0.0f, B_FP8TC);
    // 70 groups of 1x128 B (as an MoE layer's wgrads), 0 to 130 rows: three launches, every
    // group slot of a full one
    enum { WG = 70 };
    int cw[WG];
    for (int j = 0; j < WG; j++) nonempty += (cw[j] = j * 37 % 131) > 0;
    tc += gemm_q_grouped_case("fp8 1x128 70 groups", WG, cw, 384, 136, &a1, &a1, 1.0f, 0.0f,
                              B_FP8TC);
    long fast = tc;
    // k 53 (rows not 16-byte multiples): each group through gemm_q
    tc += gemm_q_grouped_case("fp8 k 53", 6, c6, 53, 70, &a1, &w2, 1.0f, 0.0f, B_FP8TC);
    tc += gemm_q_grouped_case("nvfp4 per-row x 16x16", 6, c6, 336, 200, &nr, &nw, 1.0f, 0.5f,
                              B_TC);
    ck_assert_int_eq(tc, fast);
#ifdef LB_HAVE_CUDA
    // each non-empty group run grouped and alone, and the row alone: 11 per 6-group fp8 case,
    // and 2 per non-empty group and 1 for the row in each of the two many-group cases
    const long want = 4 * 11 + 2 * nonempty + 2;
    int cc = 0;
    long x0, x1, x2, x3;
    lb_cuda_gemm_q_stats(dev, &x0, &x1, &x2, &x3, &cc);
    if (verbose()) printf("  gemm_q_grouped: %ld groups on the grouped fp8 kernel (sm_%d)\n", tc, cc);
    if (cc == 9 && !getenv("LB_CUDA_GROUPED"))
        ck_assert_msg(tc == want, "%ld of %ld fp8 groups ran on the grouped kernel on sm_90", tc,
                      want);
#endif
}

// The fp8 expert GEMMs of one MoE layer at a training step's size, run three times: the same
// bits every time. The small cases above never fill the machine, nor wrap a block's ring of
// stages many times; a race that needs both (found 2026-11-30: a stage's scales
// rewritten by TMA while still being read) changed the training loss from run to run and
// passed every small test. 128 groups of 640 to 1278 rows (the fprop and dgrad launch, 128x128
// B), and 128 groups of 768 x 2048 over k 1024 (the wgrad's, 1x128 B), beta 0 (the TMA-store
// epilogue). No CPU reference at this size: the small cases check the values. It guards
// determinism at scale but does not reproduce that race: with the fence removed it passed
// three runs of three on the H200 (2026-11-30); the training loss caught it.
// label: the name; g: the groups' rows m; p: n, k, B's rows per group; q[0]: B's quantization
static void repeat_case(const test_case *tst)
{
    const char *name = tst->label;
    const int G = tst->g.count, n = tst->p[0], k = tst->p[1], b_rows_per_group = tst->p[2];
    int m[LB_TEST_MAX_GROUPS];
    group_rows(&tst->g, m);
    uint32_t signs[LB_TEST_MAX_GROUPS];
    const lb_quant_args qb_ = qspec_args(&tst->q[0], G, signs), *qb = &qb_;
    lb_quant_args qa = gq(LB_FMT_FP8_BLOCK, 0, 0, LB_E4M3, 0, 0, 0);
    size_t rows = 0;
    for (int j = 0; j < G; j++) rows += (size_t)m[j];
    // one random slab of 4096 rows, repeated: A's rows need not differ for this test
    enum { SLAB = 4096 };
    float *slab = scaled_randn(SLAB, k), *X = dev->alloc(dev, rows * k * 4);
    for (size_t r = 0; r < rows; r += SLAB)
        dev->upload(dev, X + r * k, slab, (rows - r < SLAB ? rows - r : SLAB) * k * 4);
    lb_qmat a, b;
    dev->qmat_alloc(dev, &a, (int)rows, k, &qa);
    dev->quantize(dev, &a, lb_act_f32(X, (int)rows, k), &qa);
    float *wb = scaled_randn(b_rows_per_group, k), *WB = dput(wb, (size_t)b_rows_per_group * k * 4);
    dev->qmat_alloc(dev, &b, b_rows_per_group, k, qb);
    dev->quantize(dev, &b, lb_act_f32(WB, b_rows_per_group, k), qb);
    lb_qmat *av = lb_calloc(G, sizeof *av);
    lb_gemm_q_args *g = lb_calloc(G, sizeof *g);
    size_t cn = 0;
    for (int j = 0; j < G; j++) cn += (size_t)m[j] * n;
    float *C[3], *host[3];
    for (int r = 0; r < 3; r++) C[r] = dpoisoned(cn * 4);
    for (int r = 0; r < 3; r++) {
        size_t off = 0, co = 0;
        for (int j = 0; j < G; j++) {
            av[j] = lb_qmat_rows(&a, (int)off, m[j]);
            g[j] = (lb_gemm_q_args){m[j], n, k, 1.0f, 0.0f, &av[j], &b, C[r] + co, NULL};
            off += (size_t)m[j], co += (size_t)m[j] * n;
        }
        dev->gemm_q_grouped(dev, G, g);
    }
    for (int r = 0; r < 3; r++) host[r] = hget(C[r], cn * 4);
    char what[96];
    snprintf(what, sizeof what, "gemm_q_grouped %s, run 2 against run 1", name);
    CHECK_BITS(what, host[1], host[0], cn * 4);
    snprintf(what, sizeof what, "gemm_q_grouped %s, run 3 against run 1", name);
    CHECK_BITS(what, host[2], host[0], cn * 4);
    for (int r = 0; r < 3; r++) free(host[r]), dfree(C[r]);
    dev->qmat_free(dev, &a), dev->qmat_free(dev, &b);
    dfree(X), dfree(WB);
    free(slab), free(wb), free(av), free(g);
}

// gemm_q batch invariance in deterministic mode: row i of C computed with A's row alone equals
// row i of the whole product, bit for bit (row-wise quantization is per row: 1-D blocks, and
// NVFP4 with its per-row second level).
static void batch_invariance_gemm_q_case(const test_case *tst)
{
    const struct { const char *name; lb_quant_args a, b; } cs[] = {
        {"fp8 1x128 x 128x128", gq(LB_FMT_FP8_BLOCK, 0, 0, LB_E4M3, 0, 0, 0),
         gq(LB_FMT_FP8_BLOCK, 0, 1, LB_E4M3, 0, 0, 0)},
        {"mxfp8", gq(LB_FMT_MXFP8, 0, 0, LB_E4M3, 0, 0, 0), gq(LB_FMT_MXFP8, 0, 0, LB_E4M3, 0, 0, 0)},
        {"mxfp4", gq(LB_FMT_MXFP4, 0, 0, LB_E4M3, 0, 0, 0), gq(LB_FMT_MXFP4, 0, 0, LB_E4M3, 0, 0, 0)},
        {"nvfp4 per-row x tensor", gq(LB_FMT_NVFP4, 0, 0, LB_E4M3, 0, LB_S2_ROW, 0),
         gq(LB_FMT_NVFP4, 0, 0, LB_E4M3, 0, LB_S2_TENSOR, 0)},
    };
    const struct { int m, n, k, row; } sz[] = {{304, 256, 512, 211}, {300, 200, 300, 7}};
    for (size_t c = 0; c < sizeof cs / sizeof cs[0]; c++)
        for (size_t s = 0; s < sizeof sz / sizeof sz[0]; s++) {
            int m = sz[s].m, n = sz[s].n, k = sz[s].k, row = sz[s].row;
            float *xa = randn((size_t)m * k, 1.0f), *xb = randn((size_t)n * k, 1.0f);
            float *dxa = dput(xa, (size_t)m * k * 4), *dxb = dput(xb, (size_t)n * k * 4);
            lb_qmat qa, qb, q1;
            dev->qmat_alloc(dev, &qa, m, k, &cs[c].a);
            dev->qmat_alloc(dev, &q1, 1, k, &cs[c].a);
            dev->qmat_alloc(dev, &qb, n, k, &cs[c].b);
            dev->quantize(dev, &qa, lb_act_f32(dxa, m, k), &cs[c].a);
            dev->quantize(dev, &q1, lb_act_f32(dxa + (size_t)row * k, 1, k), &cs[c].a);
            dev->quantize(dev, &qb, lb_act_f32(dxb, n, k), &cs[c].b);
            float *dc = dpoisoned((size_t)m * n * 4), *dc1 = dpoisoned((size_t)n * 4);
            dev->gemm_q(dev, m, n, k, 1.0f, &qa, &qb, 0.0f, dc);
            dev->gemm_q(dev, 1, n, k, 1.0f, &q1, &qb, 0.0f, dc1);
            float *cc = hget(dc, (size_t)m * n * 4), *c1 = hget(dc1, (size_t)n * 4);
            char what[160];
            snprintf(what, sizeof what, "gemm_q %s row %d alone vs among %d (n %d k %d)",
                     cs[c].name, row, m, n, k);
            CHECK_BITS(what, cc + (size_t)row * n, c1, (size_t)n * 4);
            dev->qmat_free(dev, &qa), dev->qmat_free(dev, &qb), dev->qmat_free(dev, &q1);
            dfree(dxa), dfree(dxb), dfree(dc), dfree(dc1);
            free(xa), free(xb), free(cc), free(c1);
        }
}

// --- KV cache: kv_append and attention_cached (sampling) --------------------------------------
//
// kv_append is a copy: the GPU cache must equal the CPU cache byte for byte after the same calls,
// positions never appended included (both start as 0xff bytes, so a stray write shows).
// attention_cached reads both caches (identical bytes) and is compared like attention_fwd: fp32
// online softmax over up to `cap` keys on the GPU against the CPU's double sums, B_ACCUM.

typedef struct {
    lb_kv_layer h, d;   // the CPU cache (host memory) and the GPU cache (device memory)
    size_t rows, nb;    // cache rows (slots * cap * hkv) and fp8 scales per row
} kv_pair;

enum { KV_F32, KV_FP8, KV_BF16 };   // the cache's elements (lb_kv_layer), p[0] of the cases

static size_t kv_elem_bytes(const kv_pair *p) { return p->h.fp8 ? 1 : p->h.bf16 ? 2 : 4; }

static size_t kv_bytes(const kv_pair *p) { return p->rows * lb_kv_ld(&p->h) * kv_elem_bytes(p); }

static void kv_pair_init(kv_pair *p, int kind, int slots, int cap, int hkv, int d)
{
    memset(p, 0, sizeof *p);
    int fp8 = kind == KV_FP8;
    p->h = (lb_kv_layer){.fp8 = fp8, .slots = slots, .cap = cap, .hkv = hkv, .d = d,
                         .bf16 = kind == KV_BF16};
    p->d = p->h;
    p->rows = (size_t)slots * cap * hkv;
    p->nb = ((size_t)d + 127) / 128;
    size_t kb = kv_bytes(p), sb = p->rows * p->nb * 4;
    p->h.k = lb_malloc(kb), p->h.v = lb_malloc(kb);
    memset(p->h.k, 0xff, kb), memset(p->h.v, 0xff, kb);
    p->d.k = dpoisoned(kb), p->d.v = dpoisoned(kb);
    if (fp8) {
        p->h.ks = lb_malloc(sb), p->h.vs = lb_malloc(sb);
        memset(p->h.ks, 0xff, sb), memset(p->h.vs, 0xff, sb);
        p->d.ks = dpoisoned(sb), p->d.vs = dpoisoned(sb);
    }
}

static void kv_pair_free(kv_pair *p)
{
    free(p->h.k), free(p->h.v), free(p->h.ks), free(p->h.vs);
    dfree(p->d.k), dfree(p->d.v);
    if (p->d.ks) dfree(p->d.ks), dfree(p->d.vs);
}

// The GPU cache's four arrays equal the CPU's, byte for byte.
static void kv_pair_compare(const kv_pair *p, const char *what)
{
    size_t kb = kv_bytes(p), sb = p->rows * p->nb * 4;
    const void *hp[4] = {p->h.k, p->h.v, p->h.ks, p->h.vs};
    const void *dp[4] = {p->d.k, p->d.v, p->d.ks, p->d.vs};
    const char *names[4] = {"k", "v", "k scales", "v scales"};
    for (int a = 0; a < (p->h.fp8 ? 4 : 2); a++) {
        size_t bytes = a < 2 ? kb : sb;
        unsigned char *got = hget(dp[a], bytes);
        char w[160];
        snprintf(w, sizeof w, "%s: cache %s", what, names[a]);
        CHECK_BITS(w, got, hp[a], bytes);
        free(got);
    }
}

// Appends n rows at (slot, pos) to both caches: k, v (n, hkv, d) fp32, or for an fp8 cache their
// row-wise fp8-block quantizations (the CPU's bytes uploaded, so only kv_append is under test).
static void kv_pair_append(kv_pair *p, const float *k, const float *v, const int32_t *slot,
                           const int32_t *pos, int n)
{
    int hkv = p->h.hkv, d = p->h.d;
    size_t nk = (size_t)n * hkv * d;
    int32_t *S = dput(slot, (size_t)n * 4), *P = dput(pos, (size_t)n * 4);
    if (!p->h.fp8) {
        cpu->kv_append(cpu, &p->h, k, v, NULL, NULL, slot, pos, n);
        float *K = dput(k, nk * 4), *V = dput(v, nk * 4);
        dev->kv_append(dev, &p->d, K, V, NULL, NULL, S, P, n);
        dfree(K), dfree(V);
    } else {
        lb_quant_args a;
        memset(&a, 0, sizeof a);
        a.fmt = LB_FMT_FP8_BLOCK;
        a.elem = LB_E4M3;
        lb_qmat hk, hv, dk, dv;
        lb_qmat_alloc(&hk, n * hkv, d, &a);
        lb_qmat_alloc(&hv, n * hkv, d, &a);
        lb_quantize(&hk, k, n * hkv, d, &a);
        lb_quantize(&hv, v, n * hkv, d, &a);
        cpu->kv_append(cpu, &p->h, NULL, NULL, &hk, &hv, slot, pos, n);
        qmat_put(&dk, &hk, &a, n * hkv, d);
        qmat_put(&dv, &hv, &a, n * hkv, d);
        dev->kv_append(dev, &p->d, NULL, NULL, &dk, &dv, S, P, n);   // k, v not read
        dev->qmat_free(dev, &dk), dev->qmat_free(dev, &dv);
        lb_qmat_free(&hk), lb_qmat_free(&hv);
    }
    dfree(S), dfree(P);
}

// Slot s holds len[s] positions, appended in calls of up to 13 rows that interleave the slots
// (position-major, slots in a scrambled order), as the sampler's prefill chunks and decode rows
// do. Keys and values have per-(token, head) magnitudes exp(N(0, 1)), so fp8 scales differ.
static void kv_fill(kv_pair *p, const int *len)
{
    int slots = p->h.slots, hkv = p->h.hkv, d = p->h.d, maxlen = 0, total = 0;
    ck_assert_msg(slots % 3 != 0, "kv_fill scrambles the slots by 3: %d slots", slots);
    for (int s = 0; s < slots; s++) maxlen = len[s] > maxlen ? len[s] : maxlen, total += len[s];
    int32_t *slot = lb_malloc((size_t)total * 4), *pos = lb_malloc((size_t)total * 4);
    int r = 0;
    for (int t = 0; t < maxlen; t++)
        for (int s0 = 0; s0 < slots; s0++) {
            int s = (s0 * 3 + 1) % slots;   // slots coprime to 3 in the cases below
            if (t < len[s]) slot[r] = s, pos[r] = t, r++;
        }
    float *k = scaled_randn(total * hkv, d), *v = scaled_randn(total * hkv, d);
    enum { CH = 13 };
    for (int r0 = 0; r0 < total; r0 += CH) {
        int n = total - r0 < CH ? total - r0 : CH;
        size_t o = (size_t)r0 * hkv * d;
        kv_pair_append(p, k + o, v + o, slot + r0, pos + r0, n);
    }
    free(k), free(v), free(slot), free(pos);
}

// p: kind (KV_F32, KV_FP8, KV_BF16), slots, cap, hkv, d
static void kv_append_case(const test_case *tst)
{
    const int kind = tst->p[0], slots = tst->p[1], cap = tst->p[2], hkv = tst->p[3];
    const int d = tst->p[4];
    kv_pair p;
    kv_pair_init(&p, kind, slots, cap, hkv, d);
    int len[8];
    for (int s = 0; s < slots; s++) len[s] = (int)(lb_rand_u64(seed, next_stream, s) % cap);
    next_stream++;
    len[slots - 1] = cap;   // one slot full to the last position; others shorter, maybe empty
    kv_fill(&p, len);
    char what[128];
    snprintf(what, sizeof what, "kv_append kind %d slots %d cap %d hkv %d d %d", kind, slots,
             cap, hkv, d);
    kv_pair_compare(&p, what);
    // Rewriting positions in place (a slot reused by the next request) overwrites them.
    int32_t slot[3] = {0, slots - 1, slots - 1}, pos[3] = {0, cap - 1, 3};
    float *k = randn((size_t)3 * hkv * d, 1), *v = randn((size_t)3 * hkv * d, 1);
    kv_pair_append(&p, k, v, slot, pos, 3);
    snprintf(what, sizeof what, "kv_append kind %d d %d, overwrite", kind, d);
    kv_pair_compare(&p, what);
    free(k), free(v);
    kv_pair_free(&p);
}

// n query rows at random (slot, position) of the filled caches, hq = group * hkv heads; rows 0..3
// take position 0, the last position of the fullest slot and the chunk edges 31 and 32 (bf16
// mode: 63 and 64, its chunk edge). bf16: both backends in bf16 mode, bound B_ATTN_BF16.
// p: kind (KV_F32, KV_FP8, KV_BF16), slots, cap, hkv, group, d, n, bf16
static void attention_cached_case(const test_case *tst)
{
    const int kind = tst->p[0], slots = tst->p[1], cap = tst->p[2], hkv = tst->p[3];
    const int group = tst->p[4], d = tst->p[5], n = tst->p[6], bf16 = tst->p[7];
    kv_pair p;
    kv_pair_init(&p, kind, slots, cap, hkv, d);
    int len[8];
    for (int s = 0; s < slots; s++)
        len[s] = 1 + (int)(lb_rand_u64(seed, next_stream, s) % (uint64_t)cap);
    next_stream++;
    len[0] = cap;
    kv_fill(&p, len);
    int hq = hkv * group;
    size_t nq = (size_t)n * hq * d;
    int32_t *slot = randint(n, 0, slots), *pos = lb_malloc((size_t)n * 4);
    for (int i = 0; i < n; i++)
        pos[i] = (int32_t)(lb_rand_u64(seed, next_stream, i) % (uint64_t)len[slot[i]]);
    next_stream++;
    const int edge[4] = {0, cap - 1, bf16 ? 63 : 31, bf16 ? 64 : 32};
    for (int i = 0; i < 4 && i < n; i++) slot[i] = 0, pos[i] = edge[i] < cap ? edge[i] : 0;
    float *q = randn(nq, 1), *out = lb_malloc(nq * 4);
    cpu->attention_cached(cpu, out, q, &p.h, slot, pos, n, hq, bf16);
    float *Q = dput(q, nq * 4), *O = dev->alloc(dev, nq * 4);
    int32_t *S = dput(slot, (size_t)n * 4), *P = dput(pos, (size_t)n * 4);
    float *keep[2];
    for (int r = 0; r < 2; r++) {
        poison(O, nq * 4);
        dev->attention_cached(dev, O, Q, &p.d, S, P, n, hq, bf16);
        keep[r] = hget(O, nq * 4);
    }
    char what[128];
    snprintf(what, sizeof what, "attention_cached%s kind %d n %d hq %d hkv %d d %d cap %d",
             bf16 ? " bf16" : "", kind, n, hq, hkv, d, cap);
    CHECK_NMSE(what, keep[0], out, nq, tst->bound);
    CHECK_BITS("attention_cached, run twice", keep[0], keep[1], nq * 4);
    // Row 1 (the longest) alone equals its result among the n rows (batch invariance).
    float *O1 = dpoisoned((size_t)hq * d * 4);
    dev->attention_cached(dev, O1, Q + (size_t)hq * d, &p.d, S + 1, P + 1, 1, hq, bf16);
    float *one = hget(O1, (size_t)hq * d * 4);
    CHECK_BITS("attention_cached, a row alone vs among all", one, keep[0] + (size_t)hq * d,
               (size_t)hq * d * 4);
    // Position 0 attends to its own key alone: the output is that value row (bf16 mode: the
    // value rounded to bf16).
    if (kind != KV_FP8)
        for (int h = 0; h < hq; h++)
            for (int x = 0; x < d; x++) {
                size_t e = lb_kv_row(&p.h, 0, h / group, 0) * lb_kv_ld(&p.h) + x;
                float vx = kind == KV_BF16 ? lb_bf16_to_f32(((uint16_t *)p.h.v)[e])
                                           : ((float *)p.h.v)[e];
                ck_assert(keep[0][(size_t)h * d + x] == (bf16 ? lb_round_bf16(vx) : vx));
            }
    free(one), dfree(O1), free(keep[0]), free(keep[1]);
    dfree(Q), dfree(O), dfree(S), dfree(P);
    free(q), free(out), free(slot), free(pos);
    kv_pair_free(&p);
}

// Sampler = trainer at the operation level: in bf16 mode attention_cached over a cache that
// kv_append filled with exactly attention_fwd's keys and values (slot = sequence), fp32 or
// bf16 rows, gives every row attention_fwd's output bit for bit. The forward kernels (wgmma for
// head dims 64 and 128, mma.sync otherwise) and the cache kernels (mma.sync; fragments from the
// cache or from shared memory) share the softmax step, so only the products' bits could part
// them.
// p: b, t, hq, hkv, d
static void attention_fwd_vs_cached_case(const test_case *tst)
{
    const int b = tst->p[0], t = tst->p[1], hq = tst->p[2], hkv = tst->p[3], d = tst->p[4];
    size_t nq = (size_t)b * t * hq * d, nk = (size_t)b * t * hkv * d;
    float *q = randn(nq, 1), *k = randn(nk, 1), *v = randn(nk, 1);
    float *Q = dput(q, nq * 4), *Kd = dput(k, nk * 4), *Vd = dput(v, nk * 4);
    float *O = dpoisoned(nq * 4), *L = dpoisoned((size_t)b * hq * t * 4), *OC = dpoisoned(nq * 4);
    const int n = b * t;
    int32_t *slot = lb_malloc((size_t)n * 4), *pos = lb_malloc((size_t)n * 4);
    for (int i = 0; i < n; i++) slot[i] = i / t, pos[i] = i % t;
    int32_t *S = dput(slot, (size_t)n * 4), *P = dput(pos, (size_t)n * 4);
    dev->attention_fwd(dev, &(lb_attention_args){.out = O, .lse = L, .q = Q, .k = Kd, .v = Vd,
            .b = b, .t = t, .hq = hq, .hkv = hkv, .d = d, .bf16 = 1});
    float *o = hget(O, nq * 4);
    const int kinds[2] = {KV_F32, KV_BF16};
    for (int u = 0; u < 2; u++) {
        kv_pair p;   // only the device cache is used
        kv_pair_init(&p, kinds[u], b, t, hkv, d);
        dev->kv_append(dev, &p.d, Kd, Vd, NULL, NULL, S, P, n);   // (n, hkv, d) = (b, t, hkv, d)
        poison(OC, nq * 4);
        dev->attention_cached(dev, OC, Q, &p.d, S, P, n, hq, 1);
        float *oc = hget(OC, nq * 4);
        char what[112];
        snprintf(what, sizeof what, "attention bf16 fwd vs cached (kind %d) b %d t %d hq %d hkv %d "
                 "d %d", kinds[u], b, t, hq, hkv, d);
        CHECK_BITS(what, o, oc, nq * 4);
        free(oc);
        kv_pair_free(&p);
    }
    free(o), free(q), free(k), free(v), free(slot), free(pos);
    dfree(Q), dfree(Kd), dfree(Vd), dfree(O), dfree(L), dfree(OC), dfree(S), dfree(P);
}

// --- the cases --------------------------------------------------------------------------------
// A row names the fields it uses; the others are zero (as QCFG's rows).

#define CASE(ops, run, ...) {ops, run, #run, __VA_ARGS__}
#define FP8B LB_FMT_FP8_BLOCK
#define E4 LB_E4M3
#define CEIL LB_SCALE_CEIL

static const int R6[6] = {37, 0, 129, 1, 0, 300};      // an empty group and a lone row
static const int C6[6] = {37, 0, 129, 1, 64, 600};
static const int C4[4] = {2000, 1700, 2100, 1900};
static const int R5[5] = {300, 37, 0, 129, 1}, R2[2] = {256, 256};
#define G6 {6, R6}
#define G250 {250, NULL, 1, 3, 0, 0}   // more groups than one launch takes
#define G128 {128, NULL, 37, 201, 0, 0}

static const test_case CASES[] = {
    CASE(OP(alloc) OP(free) OP(upload) OP(download) OP(copy) OP(zero) OP(sync)
         OP(mem_free) OP(destroy) OP(host_alloc) OP(host_free), table_and_memory_case,
         .cuda = 1),
    CASE(OP(graph_record) OP(graph_launch) OP(graph_free), graph_case, {1000, 70, 130, 256}),

    // --- GEMM: shapes of no tile; p (m, n, k) every transpose and mode, or (ta, tb, m, n, k, det)
    CASE(OP(gemm), gemm_shape_case, {37, 29, 53}, .bound = B_ACCUM),
    CASE(OP(gemm), gemm_shape_case, {1, 300, 257}, .bound = B_ACCUM),
    CASE(OP(gemm), gemm_shape_case, {129, 77, 300}, .bound = B_ACCUM),
    CASE(OP(gemm), gemm_shape_case, {64, 128, 1}, .bound = B_ACCUM),
    CASE(OP(gemm), gemm_shape_case, {300, 53, 129}, .bound = B_ACCUM),
    // the linear layer's three passes at a hidden-size shape, accumulation included
    CASE(OP(gemm), gemm_case, {0, 1, 129, 256, 1024, 1}, {1.0f, 0.0f}, B_ACCUM, "fprop"),
    CASE(OP(gemm), gemm_case, {0, 0, 129, 1024, 256, 1}, {1.0f, 0.0f}, B_ACCUM, "dgrad"),
    CASE(OP(gemm), gemm_case, {1, 0, 256, 1024, 129, 1}, {1.0f, 1.0f}, B_ACCUM, "wgrad"),
    // bf16 GEMMs on each CUDA path: the wgmma kernel, cuBLASLt's bf16 tensor cores, the fp32
    // GEMM of rounded copies
    CASE(OP(gemm), gemm_bf16_case, .bound = B_ACCUM, .label = "wgmma", .cuda = 1),
    CASE(OP(gemm), gemm_bf16_case, .bound = B_ACCUM, .label = "cuBLASLt",
         .env = {"LB_CUDA_DENSE_TC=0"}, .cuda = 1),
    CASE(OP(gemm), gemm_bf16_case, .bound = B_ACCUM, .label = "rounded copies",
         .env = {"LB_CUDA_BF16=0"}, .cuda = 1),
    CASE(OP(gemm), gemm_edges_case),
    CASE(OP(gemm_grouped), gemm_grouped_case, .bound = B_ACCUM),
    // grouped bf16 GEMMs, p (streams, in, out): 128-column tiles (n <= 128); 70 groups (three
    // launches of at most 32 on sm_90) of 0 to 4 rows and one of 200 with 256-column tiles;
    // more tiles than an H200 has multiprocessors; one gemm per group on streams
    CASE(OP(gemm_grouped), grouped_bf16_case, {0, 700, 77}, .bound = B_ACCUM, .g = {6, C6}),
    CASE(OP(gemm_grouped), grouped_bf16_case, {0, 136, 300}, .bound = B_ACCUM,
         .g = {70, NULL, 1, 5, 0, 200}),
    CASE(OP(gemm_grouped), grouped_bf16_case, {0, 520, 520}, .bound = B_ACCUM, .g = {4, C4}),
    CASE(OP(gemm_grouped), grouped_bf16_case, {1, 700, 77}, .bound = B_ACCUM, .g = {6, C6},
         .cuda = 1),
    CASE(OP(gemm_grouped) OP(gemm), gemm_grouped_c16_case, .cuda = 1),
    CASE(OP(gemm_experts) OP(gemm_grouped), gemm_experts_case, {128, 300, 136, 1, 16},
         .bound = B_ACCUM, .label = "decode shape, bf16 C"),
    CASE(OP(gemm_experts) OP(gemm_grouped), gemm_experts_case, {128, 256, 200, 0, 8},
         .bound = B_ACCUM, .label = "decode shape, fp32 C"),
    CASE(OP(gemm_experts) OP(gemm_grouped), gemm_experts_case, {9, 101, 77, 1, 150},
         .bound = B_ACCUM, .label = "odd sizes, 128-row tiles"),
    CASE(OP(gemm_experts) OP(gemm_q_grouped) OP(quantize), gemm_experts_q_case,
         {128, 1536, 2048, 1, 16, 0}, .bound = B_FP8TC, .label = "fp8, decode shape, bf16 C"),
    CASE(OP(gemm_experts) OP(gemm_q_grouped) OP(quantize), gemm_experts_q_case,
         {16, 200, 336, 0, 150, 0}, .bound = B_FP8TC, .label = "fp8, 128-row tiles, fp32 C"),
    CASE(OP(gemm_experts) OP(gemm_q_grouped) OP(quantize), gemm_experts_q_case,
         {128, 2048, 768, 0, 16, 0}, .bound = B_FP8TC, .label = "fp8, decode shape, fp32 C"),
    CASE(OP(gemm_experts) OP(gemm_q_grouped) OP(quantize), gemm_experts_q_case,
         {9, 136, 256, 1, 40, 256}, .bound = B_FP8TC, .label = "fp8, experts apart (host)"),
    // MX and NVFP4 experts with their weights' bf16 copies (CUDA: MXFP8 and MXFP4 on the
    // device counts, NVFP4 through the host's)
    CASE(OP(gemm_experts) OP(gemm_q_grouped) OP(quantize), gemm_experts_q_case,
         {128, 1536, 2048, 1, 16, 0, 1}, .bound = B_TC, .label = "mxfp8, decode shape, bf16 C"),
    CASE(OP(gemm_experts) OP(gemm_q_grouped) OP(quantize), gemm_experts_q_case,
         {16, 200, 336, 0, 150, 0, 1}, .bound = B_TC, .label = "mxfp8, 128-row tiles, fp32 C"),
    CASE(OP(gemm_experts) OP(gemm_q_grouped) OP(quantize), gemm_experts_q_case,
         {32, 2048, 768, 1, 16, 0, 2}, .bound = B_TC, .label = "mxfp4, decode shape, bf16 C"),
    CASE(OP(gemm_experts) OP(gemm_q_grouped) OP(quantize), gemm_experts_q_case,
         {9, 136, 256, 0, 40, 0, 3}, .bound = B_TC, .label = "nvfp4, fp32 C"),
    CASE(OP(quantize) OP(qmat_transpose), quantize_d16_case, {37, 203}),
    CASE(OP(quantize) OP(qmat_transpose), quantize_d16_case, {64, 256}),

    CASE(OP(add) OP(scale) OP(sumsq) OP(f64_to_f32), add_scale_sumsq_case),

    // --- embedding, p (vocab, n, c): every token repeated many times; the Qwen3 vocabulary
    CASE(OP(embedding_fwd) OP(embedding_bwd), embedding_case, {1001, 300, 53}),
    CASE(OP(embedding_fwd) OP(embedding_bwd), embedding_case, {7, 300, 53}),
    CASE(OP(embedding_fwd) OP(embedding_bwd), embedding_case, {151936, 129, 64}),

    // --- RMSNorm, p (n, c). CUDA's rmsnorm_bwd takes a row with 32 to 1024 threads by c; dw's
    // partials are per block of 16 to 1024 rows (by n); the last: 625 blocks, dw's partials
    // summed in groups first
    CASE(OP(rmsnorm_fwd) OP(rmsnorm_bwd) OP(add) OP(add16), rmsnorm_case, {300, 53},
         .bound = B_ROUND),
    CASE(OP(rmsnorm_fwd) OP(rmsnorm_bwd) OP(add) OP(add16), rmsnorm_case, {1000, 128},
         .bound = B_ROUND),
    CASE(OP(rmsnorm_fwd) OP(rmsnorm_bwd) OP(add) OP(add16), rmsnorm_case, {37, 600},
         .bound = B_ROUND),
    CASE(OP(rmsnorm_fwd) OP(rmsnorm_bwd) OP(add) OP(add16), rmsnorm_case, {37, 2048},
         .bound = B_ROUND),
    CASE(OP(rmsnorm_fwd) OP(rmsnorm_bwd) OP(add) OP(add16), rmsnorm_case, {21, 3000},
         .bound = B_ROUND),
    CASE(OP(rmsnorm_fwd) OP(rmsnorm_bwd) OP(add) OP(add16), rmsnorm_case, {19, 5000},
         .bound = B_ROUND),
    CASE(OP(rmsnorm_fwd) OP(rmsnorm_bwd) OP(add) OP(add16), rmsnorm_case, {9, 10000},
         .bound = B_ROUND),
    CASE(OP(rmsnorm_fwd) OP(rmsnorm_bwd) OP(add) OP(add16), rmsnorm_case, {40000, 128},
         .bound = B_ROUND),

    // --- RoPE, p (n, heads, d)
    CASE(OP(rope) OP(rmsnorm_fwd), rope_case, {129, 3, 64}, .bound = B_ROUND),
    CASE(OP(rope) OP(rmsnorm_fwd), rope_case, {129, 5, 128}, .bound = B_ROUND),
    CASE(OP(rope) OP(rmsnorm_fwd), rope_case, {37, 2, 24}, .bound = B_ROUND),
    CASE(OP(rope) OP(rmsnorm_fwd), rope_case, {129, 3, 64, 0, 1}, .bound = B_ROUND),    // llama3 scaling
    CASE(OP(rope) OP(rmsnorm_fwd), rope_case, {37, 2, 128, 0, 1}, .bound = B_ROUND),
    CASE(OP(rope) OP(rmsnorm_fwd), rope_case, {129, 3, 64, 32}, .bound = B_ROUND),      // partial rotary
    CASE(OP(rope) OP(rmsnorm_fwd), rope_case, {37, 4, 128, 64, 1}, .bound = B_ROUND),   // both
    CASE(OP(rope) OP(rmsnorm_fwd), rope_case, {300, 32, 128}, .bound = B_ROUND),         // a decode step's q
    CASE(OP(rope) OP(rmsnorm_fwd), rope_case, {45, 3, 64}, .bound = B_ROUND),

    // --- attention, p (b, t, hq, hkv, d, bf16). fp32 mode: no grouping with a head dim below
    // one warp, the largest head dim supported
#define ATTN OP(attention_fwd) OP(attention_bwd)
    CASE(ATTN, attention_case, {2, 129, 6, 2, 64, 0}, .bound = B_ACCUM),
    CASE(ATTN, attention_case, {1, 129, 4, 1, 128, 0}, .bound = B_ACCUM),
    CASE(ATTN, attention_case, {2, 37, 3, 3, 24, 0}, .bound = B_ACCUM),
    CASE(ATTN, attention_case, {1, 70, 2, 1, 256, 0}, .bound = B_ACCUM),
    // bf16 mode (the tensor-core kernels): lengths below, across and beyond the 64-key chunks,
    // head dims 16, 64 and 128 (the largest in this mode), GQA 2:1 and Qwen3-30B-A3B's 32:4,
    // and d 40, which the kernels pad to 48
    CASE(ATTN, attention_case, {2, 1, 4, 2, 16, 1}, .bound = B_ATTN_BF16),
    CASE(ATTN, attention_case, {1, 1, 32, 4, 16, 1}, .bound = B_ATTN_BF16),
    CASE(ATTN, attention_case, {2, 1, 4, 2, 64, 1}, .bound = B_ATTN_BF16),
    CASE(ATTN, attention_case, {1, 1, 32, 4, 64, 1}, .bound = B_ATTN_BF16),
    CASE(ATTN, attention_case, {2, 1, 4, 2, 128, 1}, .bound = B_ATTN_BF16),
    CASE(ATTN, attention_case, {1, 1, 32, 4, 128, 1}, .bound = B_ATTN_BF16),
    CASE(ATTN, attention_case, {2, 77, 4, 2, 16, 1}, .bound = B_ATTN_BF16),
    CASE(ATTN, attention_case, {1, 77, 32, 4, 16, 1}, .bound = B_ATTN_BF16),
    CASE(ATTN, attention_case, {2, 77, 4, 2, 64, 1}, .bound = B_ATTN_BF16),
    CASE(ATTN, attention_case, {1, 77, 32, 4, 64, 1}, .bound = B_ATTN_BF16),
    CASE(ATTN, attention_case, {2, 77, 4, 2, 128, 1}, .bound = B_ATTN_BF16),
    CASE(ATTN, attention_case, {1, 77, 32, 4, 128, 1}, .bound = B_ATTN_BF16),
    CASE(ATTN, attention_case, {2, 200, 4, 2, 16, 1}, .bound = B_ATTN_BF16),
    CASE(ATTN, attention_case, {1, 200, 32, 4, 16, 1}, .bound = B_ATTN_BF16),
    CASE(ATTN, attention_case, {2, 200, 4, 2, 64, 1}, .bound = B_ATTN_BF16),
    CASE(ATTN, attention_case, {1, 200, 32, 4, 64, 1}, .bound = B_ATTN_BF16),
    CASE(ATTN, attention_case, {2, 200, 4, 2, 128, 1}, .bound = B_ATTN_BF16),
    CASE(ATTN, attention_case, {1, 200, 32, 4, 128, 1}, .bound = B_ATTN_BF16),
    CASE(ATTN, attention_case, {2, 77, 4, 2, 40, 1}, .bound = B_ATTN_BF16),
    CASE(ATTN, attention_bf16_ds_case, .cuda = 1),
    CASE(ATTN, attention_io16_case, {2, 77, 4, 2, 16}),
    CASE(ATTN, attention_io16_case, {2, 77, 4, 2, 40}),
    CASE(ATTN, attention_io16_case, {1, 200, 32, 4, 128}),
    CASE(ATTN, attention_io16_case, {2, 129, 4, 1, 64}),
    CASE(ATTN, attention_io16_case, {2, 1, 4, 2, 128}),
    CASE(ATTN, attention_out16_case, {2, 77, 4, 2, 40}),
    CASE(ATTN, attention_out16_case, {1, 200, 32, 4, 128}),
    CASE(ATTN, attention_out16_case, {2, 129, 4, 1, 64}),

    // --- SwiGLU, p (n, f): one element per lane; 16-byte rows; 16-byte rows, out16's padded
    CASE(OP(swiglu_fwd) OP(swiglu_bwd), swiglu_case, {300, 257}, .bound = B_ROUND),
    CASE(OP(swiglu_fwd) OP(swiglu_bwd), swiglu_case, {300, 256}, .bound = B_ROUND),
    CASE(OP(swiglu_fwd) OP(swiglu_bwd), swiglu_case, {300, 36}, .bound = B_ROUND),

    // --- router, p (n, e, k, renorm, with_dpe): Qwen3-MoE's 128 experts, top-8; k == e
#define ROUTER OP(router_topk_fwd) OP(router_topk_bwd)
    CASE(ROUTER, router_case, {300, 128, 8, 1, 1}, .bound = B_ROUND),
    CASE(ROUTER, router_case, {300, 128, 8, 0, 0}, .bound = B_ROUND),
    CASE(ROUTER, router_case, {37, 53, 3, 1, 0}, .bound = B_ROUND),
    CASE(ROUTER, router_case, {37, 7, 7, 0, 1}, .bound = B_ROUND),
#define ROUTER_SIG OP(router_sigmoid_fwd) OP(router_sigmoid_bwd) OP(router_bias_update)
    CASE(ROUTER_SIG, router_sigmoid_case, {300, 128, 8, 8, 4, 1, 1}, .bound = B_ROUND),   // V3
    CASE(ROUTER_SIG, router_sigmoid_case, {300, 160, 8, 1, 1, 1, 1}, .bound = B_ROUND),   // GLM-4.5
    CASE(ROUTER_SIG, router_sigmoid_case, {37, 48, 6, 4, 2, 0, 0}, .bound = B_ROUND),
    CASE(ROUTER_SIG, router_sigmoid_case, {37, 12, 3, 6, 2, 1, 0}, .bound = B_ROUND),
    CASE(OP(moe_aux_loss), moe_aux_loss_case),

    // --- dispatch, p (n, e, k, c): 16-byte rows with the copies' rows padded (c 60)
#define DISPATCH OP(moe_plan) OP(moe_permute) OP(moe_permute_bwd) OP(moe_combine) \
                 OP(moe_combine_bwd)
    CASE(DISPATCH, dispatch_case, {300, 53, 3, 53}, .bound = B_DOT),
    CASE(DISPATCH, dispatch_case, {257, 128, 8, 64}, .bound = B_DOT),
    CASE(DISPATCH, dispatch_case, {100, 16, 4, 60}, .bound = B_DOT),
    CASE(DISPATCH, dispatch_case, {37, 7, 1, 129}, .bound = B_DOT),
    // CUDA's plan: the one-block counting sort's largest size (16,384 assignments, 16 chunks),
    // past it (the radix sort), and a thousand experts
    CASE(DISPATCH, dispatch_case, {2048, 128, 8, 16}, .bound = B_DOT),
    CASE(DISPATCH, dispatch_case, {2101, 128, 8, 16}, .bound = B_DOT),
    CASE(DISPATCH, dispatch_case, {300, 1000, 4, 16}, .bound = B_DOT),

    // --- cross-entropy, p (n, v): the Qwen3 vocabulary
#define CE OP(cross_entropy_fwd) OP(cross_entropy_bwd) OP(cross_entropy_bwd_rows)
    CASE(CE, ce_case, {37, 1001}, .bound = B_ROUND),
    CASE(CE, ce_case, {5, 151936}, .bound = B_ROUND),
    // linear_ce_bwd, p (n, v, c), f (dw_beta): sizes of no tile or vector width: partial 64 x
    // 64 pack tiles, an odd vocabulary (the scalar loads), a partial 128 x 256 GEMM tile
    CASE(OP(linear_ce_bwd), linear_ce_case, {77, 1000, 136}, {0.0f}, B_CE_BF16),
    CASE(OP(linear_ce_bwd), linear_ce_case, {40, 4099, 72}, {1.0f}, B_CE_BF16),
    // over bf16 logits, p (n, v, c), f (dw_beta): an odd vocabulary (padded rows)
    CASE(OP(cross_entropy_fwd16) OP(linear_ce_bwd), ce16_case, {77, 1000, 136}, {0.0f},
         B_CE_BF16),
    CASE(OP(cross_entropy_fwd16) OP(linear_ce_bwd), ce16_case, {40, 4099, 72}, {1.0f},
         B_CE_BF16),

    CASE(OP(adamw), adamw_case),
    CASE(OP(adamw16), adamw16_case),

    // --- low precision
    CASE(OP(quantize) OP(dequantize) OP(qmat_alloc) OP(qmat_free), quantize_random_case),
    CASE(OP(quantize) OP(dequantize), quantize_golden_case),
    CASE(OP(quantize) OP(dequantize), quantize_pow2_case),
    // hadamard, p (rows, cols, axis, n, signs' site): the CPU's operations in its order, bitwise
    CASE(OP(hadamard), hadamard_case, {48, 37, LB_AXIS_ROWS, 16, 0}),
    CASE(OP(hadamard), hadamard_case, {96, 5, LB_AXIS_ROWS, 32, 1}),
    CASE(OP(hadamard), hadamard_case, {7, 64, LB_AXIS_COLS, 16, 2}),
    CASE(OP(hadamard), hadamard_case, {33, 96, LB_AXIS_COLS, 32, 3}),
    CASE(OP(hadamard), hadamard_case, {4, 6, LB_AXIS_COLS, 2, 4}),
    CASE(OP(hadamard), hadamard_case, {24, 9, LB_AXIS_ROWS, 8, 5}),
    CASE(OP(hadamard), hadamard_case, {1, 4, LB_AXIS_COLS, 4, 6}),
    CASE(OP(round_bf16), round_bf16_case),
    CASE(OP(to_bf16) OP(gemm) OP(gemm_grouped), to_bf16_case),
    // quantize_grouped, q[0] the format, p (cols, pad): one launch for fp8-block on the GPU, the
    // per-group path of other formats, stochastic rounding (a stream per group), the wgrad's
    // Hadamard transform fused into column-wise quantization
#define QG(lbl, cols, pad, grp, ...) \
    CASE(OP(quantize_grouped), quant_grouped_case, {cols, pad}, .label = lbl, .g = grp, \
         .q = {{__VA_ARGS__}})
    QG("fp8 1x128 row", 300, 0, G6, FP8B, 0, 0, E4, 0, 0, 0),
    QG("fp8 1x128 row, padded", 300, 16, G6, FP8B, 0, 0, E4, 0, 0, 0),
    QG("fp8 1x128 col, padded", 200, 16, G6, FP8B, 1, 0, E4, 0, 0, 0),
    QG("fp8 1x128 col sr, padded", 200, 16, G6, FP8B, 1, 0, E4, 0, 0, 1),
    QG("fp8 128x128 row", 300, 0, G6, FP8B, 0, 1, E4, 0, 0, 0),
    QG("fp8 128x128 col", 200, 0, G6, FP8B, 1, 1, E4, 0, 0, 0),
    QG("mxfp8 col, padded", 200, 16, G6, LB_FMT_MXFP8, 1, 0, E4, CEIL, 0, 0),
    QG("nvfp4 per-row", 200, 0, G6, LB_FMT_NVFP4, 0, 0, E4, 0, LB_S2_ROW, 0),
    QG("nvfp4 col sr, padded", 200, 16, G6, LB_FMT_NVFP4, 1, 0, E4, 0, LB_S2_TENSOR, 1),
    QG("fp8 tensor col, padded", 200, 16, G6, LB_FMT_FP8_TENSOR, 1, 0, E4, 0, 0, 0),
    QG("fp8 1x128 col, padded, 250 groups", 130, 16, G250, FP8B, 1, 0, E4, 0, 0, 0),
    QG("nvfp4 col sr, Hadamard 16 random", 200, 16, G6, LB_FMT_NVFP4, 1, 0, E4, 0, LB_S2_TENSOR,
       1, 16, 0, 9),
    QG("mxfp4 col, Hadamard 32", 70, 32, G6, LB_FMT_MXFP4, 1, 0, E4, CEIL, 0, 0, 32),
    QG("fp8 1x128 col, Hadamard 16", 200, 16, G6, FP8B, 1, 0, E4, 0, 0, 0, 16, 0x5a5au),
    // fp8-block with a transform takes the per-group passes, not fq_kernel
    QG("fp8 1x128 col sr, Hadamard 16", 200, 16, G6, FP8B, 1, 0, E4, 0, 0, 1, 16, 0x5a5au),
    QG("mxfp8 col sr, Hadamard 32 random", 130, 32, G6, LB_FMT_MXFP8, 1, 0, E4, CEIL, 0, 1, 32,
       0, 10),
    // random signs of each group's own (the wgrad draws them per expert under random16)
    QG("nvfp4 col sr, Hadamard 16, signs per group", 200, 16, G6, LB_FMT_NVFP4, 1, 0, E4, 0,
       LB_S2_TENSOR, 1, 16, 0, -1),
    QG("mxfp4 col, Hadamard 16, signs per group", 130, 16, G6, LB_FMT_MXFP4, 1, 0, E4, CEIL, 0,
       0, 16, 0, -1),
    // power-of-two scales: fq_rows_kernel, fq_kernel both ways and block shapes, stochastic
    // rounding, the passes (a transform)
    QG("fp8 1x128 row pow2", 300, 0, G6, FP8B, 0, 0, E4, 0, 0, 0, .pow2 = 1),
    QG("fp8 1x128 col pow2, padded", 200, 16, G6, FP8B, 1, 0, E4, 0, 0, 0, .pow2 = 1),
    QG("fp8 1x128 col sr pow2, padded", 200, 16, G6, FP8B, 1, 0, E4, 0, 0, 1, .pow2 = 1),
    QG("fp8 128x128 row pow2", 300, 0, G6, FP8B, 0, 1, E4, 0, 0, 0, .pow2 = 1),
    QG("fp8 128x128 col pow2", 200, 0, G6, FP8B, 1, 1, E4, 0, 0, 0, .pow2 = 1),
    QG("fp8 1x128 col pow2, Hadamard 16", 200, 16, G6, FP8B, 1, 0, E4, 0, 0, 0, 16, 0x5a5au,
       .pow2 = 1),
    QG("fp8 tensor col pow2, padded", 200, 16, G6, LB_FMT_FP8_TENSOR, 1, 0, E4, 0, 0, 0,
       .pow2 = 1),
#undef QG
    // the same from bf16 activations (p[2] 1): fq_rows_kernel, fq_kernel, mq_kernel (with a
    // transform), rows not 8-byte aligned (cols 130), and the passes that read an fp32 copy
#define QG16(lbl, cols, pad, grp, ...) \
    CASE(OP(quantize_grouped), quant_grouped_case, {cols, pad, 1}, .label = lbl " from bf16", \
         .g = grp, .q = {{__VA_ARGS__}})
    QG16("fp8 1x128 row", 300, 0, G6, FP8B, 0, 0, E4, 0, 0, 0),
    QG16("fp8 1x128 row, cols 130", 130, 0, G6, FP8B, 0, 0, E4, 0, 0, 0),
    QG16("fp8 1x128 col, padded", 200, 16, G6, FP8B, 1, 0, E4, 0, 0, 0),
    QG16("fp8 1x128 col, padded, 250 groups", 130, 16, G250, FP8B, 1, 0, E4, 0, 0, 0),
    QG16("mxfp8 row", 200, 0, G6, LB_FMT_MXFP8, 0, 0, E4, CEIL, 0, 0),
    QG16("mxfp8 col, padded", 200, 16, G6, LB_FMT_MXFP8, 1, 0, E4, CEIL, 0, 0),
    QG16("nvfp4 per-row", 200, 0, G6, LB_FMT_NVFP4, 0, 0, E4, 0, LB_S2_ROW, 0),
    QG16("nvfp4 col sr, Hadamard 16 random", 200, 16, G6, LB_FMT_NVFP4, 1, 0, E4, 0,
         LB_S2_TENSOR, 1, 16, 0, 9),
    QG16("mxfp4 col, Hadamard 16, signs per group", 130, 16, G6, LB_FMT_MXFP4, 1, 0, E4, CEIL, 0,
         0, 16, 0, -1),
    QG16("fp8 1x128 col, Hadamard 16", 200, 16, G6, FP8B, 1, 0, E4, 0, 0, 0, 16, 0x5a5au),
    QG16("fp8 tensor col, padded", 200, 16, G6, LB_FMT_FP8_TENSOR, 1, 0, E4, 0, 0, 0),
    QG16("fp8 1x128 row pow2", 300, 0, G6, FP8B, 0, 0, E4, 0, 0, 0, .pow2 = 1),
    QG16("fp8 1x128 col pow2, padded", 200, 16, G6, FP8B, 1, 0, E4, 0, 0, 0, .pow2 = 1),
#undef QG16
    // quantize_amax and quantize_grouped with given amaxes, q[0] NVFP4, p (cols, pad)
#define QA(lbl, cols, pad, grp, colwise, s2, ...) \
    CASE(OP(quantize_amax) OP(quantize_grouped), quant_amax_case, {cols, pad}, .label = lbl, \
         .g = grp, .q = {{LB_FMT_NVFP4, colwise, 0, E4, 0, s2, 0, __VA_ARGS__}})
    QA("nvfp4 per-row", 200, 0, G6, 0, LB_S2_ROW, 0),
    QA("nvfp4 per-row, padded", 200, 16, G6, 0, LB_S2_ROW, 0),
    QA("nvfp4 per-row, 250 groups", 130, 0, G250, 0, LB_S2_ROW, 0),
    QA("nvfp4 row tensor", 200, 0, G6, 0, LB_S2_TENSOR, 0),
    QA("nvfp4 col tensor, padded", 200, 16, G6, 1, LB_S2_TENSOR, 0),
    QA("nvfp4 col per-row, padded", 130, 16, G6, 1, LB_S2_ROW, 0),
    QA("nvfp4 col tensor, Hadamard 16, signs per group", 200, 16, G6, 1, LB_S2_TENSOR, 16, 0, -1),
    QA("nvfp4 col tensor, Hadamard 32", 70, 32, G6, 1, LB_S2_TENSOR, 32, 0x1234u),
#undef QA
    CASE(OP(quantize_amax) OP(quantize_grouped), quant_amax_case, {200, 16, 1},
         .label = "nvfp4 per-row, padded, from bf16", .g = G6,
         .q = {{LB_FMT_NVFP4, 0, 0, E4, 0, LB_S2_ROW, 0, 0}}),
    CASE(OP(quantize_amax) OP(quantize_grouped), quant_amax_case, {70, 32, 1},
         .label = "nvfp4 col tensor, Hadamard 32, from bf16", .g = G6,
         .q = {{LB_FMT_NVFP4, 1, 0, E4, 0, LB_S2_TENSOR, 0, 32, 0x1234u}}),
    // quantize_rc, q (row-wise, column-wise), p (cols, pad): rows of x 16-byte aligned or not,
    // more groups than one launch takes, an MoE layer's dy (128 experts, 0 to 200 tokens each);
    // pairs that CUDA runs as the two calls (MXFP8, stochastic rounding)
#define QRC(lbl, cols, pad, grp, sr, fmt, rule) \
    CASE(OP(quantize_rc), quant_rc_case, {cols, pad}, .label = lbl, .g = grp, \
         .q = {{fmt, 0, 0, E4, rule, 0, 0}, {fmt, 1, 0, E4, rule, 0, sr}})
    QRC("fp8 1x128", 200, 16, G6, 0, FP8B, 0),
    QRC("fp8 1x128, cols 130", 130, 16, G6, 0, FP8B, 0),
    QRC("fp8 1x128, not padded", 200, 0, G6, 0, FP8B, 0),
    QRC("fp8 1x128, 250 groups", 130, 16, G250, 0, FP8B, 0),
    QRC("fp8 1x128, 128 groups", 512, 128, G128, 0, FP8B, 0),
    QRC("fp8 1x128, column-wise sr", 200, 16, G6, 1, FP8B, 0),
    QRC("mxfp8", 200, 16, G6, 0, LB_FMT_MXFP8, CEIL),
#undef QRC
    // power-of-two scales both ways (one pass on CUDA), and on one side only (the two calls)
#define QRC2(lbl, cols, pad, grp, x16, pr, pc) \
    CASE(OP(quantize_rc), quant_rc_case, {cols, pad, x16}, .label = lbl, .g = grp, \
         .q = {{FP8B, 0, 0, E4, 0, 0, 0, .pow2 = pr}, {FP8B, 1, 0, E4, 0, 0, 0, .pow2 = pc}})
    QRC2("fp8 1x128 pow2", 200, 16, G6, 0, 1, 1),
    QRC2("fp8 1x128 pow2, cols 130, from bf16", 130, 16, G6, 1, 1, 1),
    QRC2("fp8 1x128 pow2, 128 groups", 512, 128, G128, 0, 1, 1),
    QRC2("fp8 1x128 pow2 row-wise only", 200, 16, G6, 0, 1, 0),
    QRC2("fp8 1x128 pow2 column-wise only", 200, 16, G6, 0, 0, 1),
#undef QRC2
#define QRC16(lbl, cols, pad, grp, sr, fmt, rule) \
    CASE(OP(quantize_rc), quant_rc_case, {cols, pad, 1}, .label = lbl " from bf16", .g = grp, \
         .q = {{fmt, 0, 0, E4, rule, 0, 0}, {fmt, 1, 0, E4, rule, 0, sr}})
    QRC16("fp8 1x128", 200, 16, G6, 0, FP8B, 0),
    QRC16("fp8 1x128, cols 130", 130, 16, G6, 0, FP8B, 0),
    QRC16("fp8 1x128, 128 groups", 512, 128, G128, 0, FP8B, 0),
    QRC16("mxfp8", 200, 16, G6, 0, LB_FMT_MXFP8, CEIL),
#undef QRC16
    // qmat_transpose, p (fmt, colwise)
    CASE(OP(qmat_transpose), qmat_transpose_case, {FP8B, 0}, .label = "fp8 128x128, row to col"),
    CASE(OP(qmat_transpose), qmat_transpose_case, {FP8B, 1}, .label = "fp8 128x128, col to row"),
    CASE(OP(qmat_transpose), qmat_transpose_case, {LB_FMT_NVFP4, 0},
         .label = "nvfp4 16x16, row to col"),
    CASE(OP(qmat_transpose), qmat_transpose_case, {LB_FMT_NVFP4, 1},
         .label = "nvfp4 16x16, col to row"),
    // quantize_rt, p (fmt, sr, cols)
    CASE(OP(quantize_rt), quant_rt_case, {FP8B, 0, 200}, .label = "fp8 128x128", .g = {5, R5}),
    CASE(OP(quantize_rt), quant_rt_case, {FP8B, 0, 130}, .label = "fp8 128x128, cols 130",
         .g = {5, R5}),
    CASE(OP(quantize_rt), quant_rt_case, {FP8B, 0, 192}, .label = "fp8 128x128, rows 256",
         .g = {2, R2}),
    CASE(OP(quantize_rt), quant_rt_case, {FP8B, 0, 48}, .label = "fp8 128x128, 250 groups",
         .g = {250, NULL, 1, 20, 1, 0}),
    CASE(OP(quantize_rt), quant_rt_case, {FP8B, 1, 200}, .label = "fp8 128x128 sr",
         .g = {5, R5}),
    CASE(OP(quantize_rt), quant_rt_case, {FP8B, 0, 200, 1}, .label = "fp8 128x128 pow2",
         .g = {5, R5}),
    CASE(OP(quantize_rt), quant_rt_case, {FP8B, 1, 130, 1}, .label = "fp8 128x128 sr pow2",
         .g = {5, R5}),
    CASE(OP(quantize_rt), quant_rt_case, {FP8B, 0, 48, 1},
         .label = "fp8 128x128 pow2, 250 groups", .g = {250, NULL, 1, 20, 1, 0}),
    CASE(OP(quantize_rt), quant_rt_case, {LB_FMT_NVFP4, 0, 200}, .label = "nvfp4 16x16",
         .g = {5, R5}),
    CASE(OP(gemm_q), gemm_q_all_case, .cuda = 1),
    CASE(OP(gemm_q_grouped), gemm_q_grouped_all_case, .cuda = 1),

    // --- KV cache, p (kind, slots, cap, hkv, d): fp8 with one partial block per row, with a
    // full and a partial block per row; bf16 rows padded to 80 with zeros
    CASE(OP(kv_append), kv_append_case, {KV_F32, 5, 41, 3, 72}),
    CASE(OP(kv_append), kv_append_case, {KV_F32, 4, 29, 2, 128}),
    CASE(OP(kv_append), kv_append_case, {KV_FP8, 5, 41, 3, 72}),
    CASE(OP(kv_append), kv_append_case, {KV_FP8, 4, 37, 1, 160}),
    CASE(OP(kv_append), kv_append_case, {KV_BF16, 5, 41, 3, 72}),
    CASE(OP(kv_append), kv_append_case, {KV_BF16, 4, 29, 2, 128}),
    // attention_cached, p (kind, slots, cap, hkv, group, d, n, bf16)
#define CACHED OP(attention_cached) OP(kv_append)
    CASE(CACHED, attention_cached_case, {0, 5, 100, 2, 3, 64, 37, 0}, .bound = B_ACCUM,
         .label = "GQA 3:1, keys up to 100"),
    CASE(CACHED, attention_cached_case, {0, 4, 70, 4, 8, 128, 29, 0}, .bound = B_ACCUM,
         .label = "Qwen3-30B-A3B's heads (32 q, 4 kv)"),
    CASE(CACHED, attention_cached_case, {0, 7, 41, 3, 1, 24, 53, 0}, .bound = B_ACCUM,
         .label = "no grouping, head dim below a warp"),
    CASE(CACHED, attention_cached_case, {0, 2, 45, 1, 2, 256, 11, 0}, .bound = B_ACCUM,
         .label = "the largest head dim"),
    CASE(CACHED, attention_cached_case, {1, 5, 100, 2, 3, 64, 37, 0}, .bound = B_ACCUM,
         .label = "fp8 cache, one partial block"),
    CASE(CACHED, attention_cached_case, {1, 4, 70, 2, 2, 160, 23, 0}, .bound = B_ACCUM,
         .label = "fp8, two blocks per row"),
    // bf16 mode (the tensor-core kernels, head dims up to 128), fp32 and fp8 caches
    CASE(CACHED, attention_cached_case, {0, 5, 100, 2, 2, 64, 37, 1}, .bound = B_ATTN_BF16,
         .label = "GQA 2:1, keys up to 100"),
    CASE(CACHED, attention_cached_case, {0, 4, 200, 4, 8, 128, 29, 1}, .bound = B_ATTN_BF16,
         .label = "Qwen3-30B-A3B's heads, 200 keys"),
    CASE(CACHED, attention_cached_case, {0, 7, 77, 2, 2, 16, 53, 1}, .bound = B_ATTN_BF16,
         .label = "the smallest tile"),
    CASE(CACHED, attention_cached_case, {0, 4, 77, 2, 2, 40, 23, 1}, .bound = B_ATTN_BF16,
         .label = "d 40, padded to 48"),
    CASE(CACHED, attention_cached_case, {1, 5, 100, 2, 2, 64, 37, 1}, .bound = B_ATTN_BF16,
         .label = "fp8 cache, one partial block"),
    CASE(CACHED, attention_cached_case, {1, 4, 200, 4, 8, 128, 23, 1}, .bound = B_ATTN_BF16,
         .label = "fp8, one full block per row"),
    // bf16 rows: the decode kernel that stages chunks in shared memory (bf16 mode only)
    CASE(CACHED, attention_cached_case, {KV_BF16, 5, 100, 2, 2, 64, 37, 1},
         .bound = B_ATTN_BF16, .label = "bf16 rows, GQA 2:1"),
    CASE(CACHED, attention_cached_case, {KV_BF16, 4, 200, 4, 8, 128, 29, 1},
         .bound = B_ATTN_BF16, .label = "bf16 rows, Qwen3-30B-A3B's heads"),
    CASE(CACHED, attention_cached_case, {KV_BF16, 4, 330, 4, 16, 128, 9, 1},
         .bound = B_ATTN_BF16, .label = "bf16 rows, group 16, 6 chunks"),
    CASE(CACHED, attention_cached_case, {KV_BF16, 5, 150, 1, 40, 128, 7, 1},
         .bound = B_ATTN_BF16, .label = "bf16 rows, group 40: three warps a block"),
    CASE(CACHED, attention_cached_case, {KV_BF16, 7, 77, 2, 2, 16, 53, 1},
         .bound = B_ATTN_BF16, .label = "bf16 rows, the smallest tile"),
    CASE(CACHED, attention_cached_case, {KV_BF16, 4, 77, 2, 2, 40, 23, 1},
         .bound = B_ATTN_BF16, .label = "bf16 rows, d 40 padded to 48"),
    // sampler = trainer, p (b, t, hq, hkv, d): Qwen3-30B-A3B's heads; the mma.sync forward
    CASE(CACHED ATTN, attention_fwd_vs_cached_case, {2, 200, 32, 4, 128}),
    CASE(CACHED ATTN, attention_fwd_vs_cached_case, {1, 129, 4, 2, 64}),
    CASE(CACHED ATTN, attention_fwd_vs_cached_case, {2, 77, 4, 2, 40}),
    CASE(CACHED ATTN, attention_fwd_vs_cached_case, {2, 150, 6, 3, 32}),   // two warps

    // --- sample, p (n, v, kind, top-k list, its values, top-p values): the Qwen3 vocabulary last
#define SAMPLE(n, v, kind, kl, nk, np) CASE(OP(sample), sample_case, {n, v, kind, kl, nk, np})
    SAMPLE(23, 1001, 0, 0, 6, 4), SAMPLE(5, 3, 0, 0, 3, 4),
    SAMPLE(23, 1001, 1, 0, 6, 4), SAMPLE(5, 3, 1, 0, 3, 4),
    SAMPLE(23, 1001, 2, 0, 6, 4), SAMPLE(5, 3, 2, 0, 3, 4),
    SAMPLE(23, 1001, 3, 0, 6, 4), SAMPLE(5, 3, 3, 0, 3, 4),
    SAMPLE(23, 1001, 4, 0, 6, 4), SAMPLE(5, 3, 4, 0, 3, 4),
    SAMPLE(9, 151936, 0, 1, 3, 4), SAMPLE(3, 151936, 1, 1, 3, 2),
    // rows of several of CUDA's 8,192-logit parts (ops_sample.cu), v odd and v % 4 == 0: the
    // ties, NaNs and infinities across part boundaries
    SAMPLE(7, 20011, 1, 1, 2, 1), SAMPLE(7, 20011, 3, 1, 2, 1), SAMPLE(7, 20012, 2, 1, 2, 1),
    SAMPLE(7, 20012, 4, 1, 2, 1), SAMPLE(7, 20012, 1, 1, 2, 1),
#undef SAMPLE

    // --- batch invariance and determinism at scale
    CASE(OP(gemm), batch_invariance_gemm_case),
    CASE(OP(rmsnorm_fwd) ROUTER CE ATTN, batch_invariance_rows_case),
    CASE(OP(gemm_q), batch_invariance_gemm_q_case),
    // the fp8 expert GEMMs of one MoE layer at a training step's size, run three times
    CASE(OP(gemm_q_grouped), repeat_case, {1536, 2048, 1536},
         .label = "fprop 128 x (~960, 2048) -> 1536", .g = {128, NULL, 37, 639, 640, 0},
         .q = {{FP8B, 0, 1, E4, 0, 0, 0}}, .cuda = 1),
    CASE(OP(gemm_q_grouped), repeat_case, {2048, 1024, 2048},
         .label = "wgrad 128 x (768, 1024) -> 2048", .g = {128, NULL, 0, 0, 768, 0},
         .q = {{FP8B, 0, 0, E4, 0, 0, 0}}, .cuda = 1),
};
#define NCASES ((int)(sizeof CASES / sizeof CASES[0]))

// LB_TEST_CASES=TEXT runs only the cases whose runner or label contains TEXT.
static int selected(const test_case *c)
{
    const char *want = getenv("LB_TEST_CASES");
    if (!want || !*want) return 1;
    return strstr(c->name, want) || (c->label && strstr(c->label, want));
}

START_TEST(test_case_row)
{
    const test_case *c = &CASES[_i];
    if (!selected(c)) return;
    if (c->cuda && strcmp(dev->name, "cuda")) {
        if (verbose()) printf("case %d %s: skipped (CUDA's own)\n", _i, c->name);
        return;
    }
    if (verbose())
        printf("case %d %s%s%s\n", _i, c->name, c->label ? ": " : "", c->label ? c->label : "");
    c->run(c);
}
END_TEST

// The test registry: every operation of kernels.h has a case.
START_TEST(test_registry)
{
    int *seen = calloc(LB_OP_COUNT, sizeof *seen);
    for (int i = 0; i < NCASES; i++)
        for (const char *t = CASES[i].ops; *t;) {   // " name name ..."
            t += strspn(t, " ");
            size_t len = strcspn(t, " ");
            if (!len) break;
            int op = 0;
            while (op < LB_OP_COUNT && (strlen(lb_op_name(op)) != len ||
                                        strncmp(lb_op_name(op), t, len)))
                op++;
            ck_assert_msg(op < LB_OP_COUNT, "case %s names no op '%.*s'", CASES[i].name,
                          (int)len, t);
            seen[op] = 1;
            t += len;
        }
    for (int op = 0; op < LB_OP_COUNT; op++)
        ck_assert_msg(seen[op], "op %s has no case in test_backend_ops", lb_op_name(op));
    free(seen);
}
END_TEST

// LB_TEST_BACKEND=cpu tests a second CPU backend (one thread) instead of CUDA, the CUDA cases
// skipped: the table's own check where no GPU is.
int main(void)
{
    const char *s = getenv("LB_TEST_SEED");
    seed = s && *s ? strtoull(s, NULL, 0)
                   : (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
    printf("test_backend_ops: seed %llu (LB_TEST_SEED=%llu repeats this run)\n",
           (unsigned long long)seed, (unsigned long long)seed);

    char err[256];
    const char *want = getenv("LB_TEST_BACKEND");
    if (want && !strcmp(want, "cpu")) {
        dev = lb_backend_cpu_create(1, err, sizeof err);
    } else {
        dev = lb_backend_cuda_create(0, err, sizeof err);
        if (!dev) {
#ifdef LB_HAVE_CUDA
            if (lb_cuda_device_count() > 0) {   // a device is there: failing to use it is a bug
                fprintf(stderr, "test_backend_ops: %s\n", err);
                return EXIT_FAILURE;
            }
#endif
            // the registry needs no device: a missing case fails here too, not only on a GPU
            printf("test_backend_ops: SKIP the cases: %s\n", err);
            Suite *su = suite_create("backend_ops");
            TCase *tc = tcase_create("registry");
            tcase_add_test(tc, test_registry);
            suite_add_tcase(su, tc);
            return lb_test_run(su) == EXIT_SUCCESS ? 77 : EXIT_FAILURE;
        }
    }
    cpu = lb_backend_cpu_create(0, err, sizeof err);
    if (!cpu || !dev) {
        fprintf(stderr, "cpu backend: %s\n", err);
        return EXIT_FAILURE;
    }

    Suite *su = suite_create("backend_ops");
    TCase *tc = tcase_create("registry");
    tcase_add_test(tc, test_registry);
    suite_add_tcase(su, tc);
    tc = tcase_create(strcmp(dev->name, "cuda") ? "cpu (1 thread) vs cpu" : "cuda vs cpu");
    tcase_add_loop_test(tc, test_case_row, 0, NCASES);
    suite_add_tcase(su, tc);

    int rc = lb_test_run(su);
    dev->destroy(dev);
    cpu->destroy(cpu);
    return rc;
}
