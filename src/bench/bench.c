// bench.c: `lowbit bench`: GEMMs and quantization per format, attention forward + backward, and training steps,
// timed on the configured backend. Figures go to doc/benchmarks.md with the peers measured in
// the same run (tests/tools/peer_kernels.py, ../shared/bench/peer_torch_moe.py); nothing here
// is asserted by a test.
#include "lb_autoconf.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include "kernels/common.h"
#include "models/precision/contract.h"
#include "kernels/quant/quant.h"
#include "src/cli/commands.h"
#include "src/train/optim.h"
#include "src/cli/run.h"
#include "src/rl/sampler.h"
#include "src/io/files.h"

#ifdef LB_HAVE_CUDA
size_t lb_cuda_mem_peak(void);
#endif

// n normal values times scale on the backend. At most 2^22 are drawn and then repeated by
// device copies: timings do not depend on the values, and drawing the 670M inputs of the
// 128-expert shapes on the host took longer than the runs timed (about 35 ns each).
static float *random_buffer(lb_backend *be, size_t n, uint64_t stream, float scale)
{
    size_t drawn = n < ((size_t)1 << 22) ? n : ((size_t)1 << 22);
    float *h = lb_malloc(drawn * sizeof(float) + 1);
    for (size_t i = 0; i < drawn; i++) h[i] = scale * lb_rand_normal(7, stream, i);
    float *d = be->alloc(be, n * sizeof(float));
    be->upload(be, d, h, drawn * sizeof(float));
    free(h);
    for (size_t have = drawn; have < n;) {   // double the filled prefix
        size_t len = have < n - have ? have : n - have;
        be->copy(be, d + have, d, len * sizeof(float));
        have += len;
    }
    return d;
}

typedef void (*bench_fn)(lb_backend *be, void *arg);

// Mean seconds per call over iters calls after warmup calls, the queue drained around them.
static double time_it(lb_backend *be, const lb_config *c, bench_fn fn, void *arg)
{
    for (int i = 0; i < c->bench.warmup; i++) fn(be, arg);
    be->sync(be);
    double t0 = lb_now();
    for (int i = 0; i < c->bench.iters; i++) fn(be, arg);
    be->sync(be);
    return (lb_now() - t0) / c->bench.iters;
}

// Peak device memory (CUDA) or peak resident host memory (CPU), GiB.
static double peak_gib(lb_backend *be)
{
#ifdef LB_HAVE_CUDA
    if (!strcmp(be->name, "cuda")) return lb_cuda_mem_peak() / (1024.0 * 1024.0 * 1024.0);
#endif
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_maxrss / 1024.0 / 1024.0;
}

typedef struct {
    int m, n, k;
    const float *a, *b;
    float *c;
    const lb_qmat *qa, *qb;
    int groups;
    lb_gemm_args *args;
    int bf16;                  // fp32 operands the GEMM rounds to bf16 (lb_gemm_args.bf16)
} gemm_case;

static void run_gemm(lb_backend *be, void *p)
{
    gemm_case *g = p;
    lb_gemm_args a = {0, 1, g->m, g->n, g->k, 1.0f, 0.0f, g->a, g->b, g->c, g->bf16,
                      NULL, NULL, NULL};
    be->gemm(be, &a);
}

// One gemm_q, or a group per expert in one gemm_q_grouped call.
static void run_gemm_q(lb_backend *be, void *p)
{
    gemm_case *g = p;
    if (g->groups == 1) {
        be->gemm_q(be, g->m, g->n, g->k, 1.0f, &g->qa[0], &g->qb[0], 0.0f, g->c);
        return;
    }
    lb_gemm_q_args args[g->groups];
    for (int e = 0; e < g->groups; e++)
        args[e] = (lb_gemm_q_args){g->m, g->n, g->k, 1.0f, 0.0f, &g->qa[e], &g->qb[e],
                                   g->c + (size_t)e * g->m * g->n, NULL};
    be->gemm_q_grouped(be, g->groups, args);
}

static void run_grouped(lb_backend *be, void *p)
{
    gemm_case *g = p;
    be->gemm_grouped(be, g->groups, g->args);
}


static lb_quant_args qargs(lb_format f, int weight)
{
    lb_quant_args a;
    memset(&a, 0, sizeof a);
    a.fmt = f;
    a.elem = LB_E4M3;
    a.weight_blocks = weight && (f == LB_FMT_FP8_BLOCK || f == LB_FMT_NVFP4);
    a.s2_mode = f == LB_FMT_NVFP4 && !weight ? LB_S2_ROW : LB_S2_TENSOR;
    return a;
}

// One format at one shape: groups GEMMs of (m, n, k); prints TFLOP/s. A quantized B has
// weight blocks (128x128 for fp8-block) when b_weight, else 1-D blocks (a wgrad operand).
static void bench_gemm_format(lb_backend *be, const lb_config *c, const char *what, lb_format f,
                              int groups, int m, int n, int k, int b_weight)
{
    size_t an = (size_t)groups * m * k, bn = (size_t)groups * n * k;
    float *a = random_buffer(be, an, 1, 1.0f), *b = random_buffer(be, bn, 2, 0.05f);
    float *cc = be->alloc(be, (size_t)groups * m * n * sizeof(float));
    gemm_case g = {m, n, k, a, b, cc, NULL, NULL, groups, NULL, f == LB_FMT_BF16};
    double t;
    if (f == LB_FMT_FP32 || f == LB_FMT_BF16) {
        if (groups == 1) {
            t = time_it(be, c, run_gemm, &g);
        } else {
            g.args = lb_calloc(groups, sizeof *g.args);
            for (int e = 0; e < groups; e++)
                g.args[e] = (lb_gemm_args){0, 1, m, n, k, 1.0f, 0.0f, a + (size_t)e * m * k,
                                           b + (size_t)e * n * k, cc + (size_t)e * m * n,
                                           g.bf16, NULL, NULL, NULL};
            t = time_it(be, c, run_grouped, &g);
            free(g.args);
        }
    } else {
        lb_qmat *qa = lb_calloc(groups, sizeof *qa), *qb = lb_calloc(groups, sizeof *qb);
        lb_quant_args aa = qargs(f, 0), ab = qargs(f, b_weight);
        for (int e = 0; e < groups; e++) {
            be->qmat_alloc(be, &qa[e], m, k, &aa);
            be->qmat_alloc(be, &qb[e], n, k, &ab);
            be->quantize(be, &qa[e], lb_act_f32(a + (size_t)e * m * k, m, k), &aa);
            be->quantize(be, &qb[e], lb_act_f32(b + (size_t)e * n * k, n, k), &ab);
        }
        g.qa = qa;
        g.qb = qb;
        t = time_it(be, c, run_gemm_q, &g);
        for (int e = 0; e < groups; e++) {
            be->qmat_free(be, &qa[e]);
            be->qmat_free(be, &qb[e]);
        }
        free(qa);
        free(qb);
    }
    double flops = 2.0 * groups * (double)m * n * k;
    printf("gemm  %-9s %-40s %9.3f ms  %8.1f TFLOP/s\n", lb_format_name(f), what, t * 1e3,
           flops / t / 1e12);
    fflush(stdout);
    be->free(be, a);
    be->free(be, b);
    be->free(be, cc);
}

// A bf16 copy of x (rows, cols) in to_bf16's layout (rows padded to 8 elements).
static uint16_t *bf16_copy(lb_backend *be, const float *x, size_t rows, int cols)
{
    const int ld = (cols + 7) / 8 * 8;
    uint16_t *y = be->alloc(be, rows * ld * sizeof(uint16_t));
    be->to_bf16(be, y, x, rows, cols, ld);
    return y;
}

// One bf16 MoE layer's four expert GEMM calls as models/precision/linear.c issues them where every
// operand has its bf16 copy (the weight caches', the expert ops'): gate/up and down fprop,
// then each backward as one call of every expert's dgrad and wgrad side by side; and, to see
// which half costs what, each backward's dgrads and wgrads alone.
typedef struct {
    int count;
    lb_gemm_args *args;
} grouped_case;

static void run_grouped_case(lb_backend *be, void *p)
{
    grouped_case *g = p;
    be->gemm_grouped(be, g->count, g->args);
}

static void bench_moe_bf16(lb_backend *be, const lb_config *c)
{
    const int E = c->bench.experts, T = c->bench.expert_rows;
    const int C = c->model.hidden_size, I = c->model.moe_intermediate_size, F = 2 * I;
    const size_t R = (size_t)E * T;
    float *x = random_buffer(be, R * C, 1, 1.0f), *h = random_buffer(be, R * I, 2, 1.0f);
    float *dy = random_buffer(be, R * C, 3, 1.0f), *dgu = random_buffer(be, R * F, 4, 1.0f);
    float *wgu = random_buffer(be, (size_t)E * F * C, 5, 0.05f);
    float *wd = random_buffer(be, (size_t)E * C * I, 6, 0.05f);
    uint16_t *x16 = bf16_copy(be, x, R, C), *h16 = bf16_copy(be, h, R, I);
    uint16_t *dy16 = bf16_copy(be, dy, R, C), *dgu16 = bf16_copy(be, dgu, R, F);
    uint16_t *wgu16 = bf16_copy(be, wgu, (size_t)E * F, C);
    uint16_t *wd16 = bf16_copy(be, wd, (size_t)E * C, I);
    float *yb = be->alloc(be, R * (C > F ? C : F) * sizeof(float));   // (rows, out or in)
    uint16_t *yb16 = be->alloc(be, R * (size_t)(((C > F ? C : F) + 7) / 8 * 8) * 2);   // as yb
    float *dw = be->alloc(be, (size_t)E * F * C * sizeof(float));
    lb_gemm_args *g = lb_calloc(2 * (size_t)E, sizeof *g);
    // (the layer's role: in, out features; x16/w16 its input copy and weight copy, dy16 the
    // output gradient's copy) in linear.c's order
    const struct {
        const char *name;
        int in, out;
        const uint16_t *x16, *w16, *dy16;
    } role[] = {{"gate/up", C, F, x16, wgu16, dgu16}, {"down", I, C, h16, wd16, dy16}};
    for (int r = 0; r < 2; r++) {
        const int in = role[r].in, out = role[r].out, lx = (in + 7) / 8 * 8, ly = (out + 7) / 8 * 8;
        // fprop, dgrad + wgrad, dgrad, wgrad; then fprop and dgrad storing bf16 (c16), as the
        // training step's layer calls them where the expert ops read bf16
        for (int pass = 0; pass < 6; pass++) {
            int n = 0;
            for (int j = 0; j < E; j++) {
                const size_t o = (size_t)j * T;
                const uint16_t *w16 = role[r].w16 + (size_t)j * out * lx;
                if (pass == 0 || pass == 4)
                    g[n++] = (lb_gemm_args){0, 1, T, out, in, 1.0f, 0.0f, NULL, NULL,
                                            pass ? NULL : yb + o * out, 1, w16,
                                            role[r].x16 + o * lx, pass ? yb16 + o * ly : NULL};
                if (pass == 1 || pass == 2 || pass == 5)
                    g[n++] = (lb_gemm_args){0, 0, T, in, out, 1.0f, 0.0f, NULL, NULL,
                                            pass == 5 ? NULL : yb + o * in, 1, w16,
                                            role[r].dy16 + o * ly,
                                            pass == 5 ? yb16 + o * lx : NULL};
                if (pass == 1 || pass == 3)
                    g[n++] = (lb_gemm_args){1, 0, out, in, T, 1.0f, 0.0f, NULL, NULL,
                                            dw + (size_t)j * out * in, 1, role[r].x16 + o * lx,
                                            role[r].dy16 + o * ly, NULL};
            }
            static const char *pname[] = {"fprop",        "dgrad + wgrad", "dgrad",
                                          "wgrad",        "fprop -> bf16", "dgrad -> bf16"};
            grouped_case gc = {n, g};
            double t = time_it(be, c, run_grouped_case, &gc);
            double flops = 2.0 * R * in * out * (pass == 1 ? 2 : 1);
            char what[96];
            snprintf(what, sizeof what, "moe %s %s %dx%d rows", role[r].name, pname[pass], E, T);
            printf("gemm  bf16      %-40s %9.3f ms  %8.1f TFLOP/s\n", what, t * 1e3,
                   flops / t / 1e12);
            fflush(stdout);
        }
    }
    free(g);
    void *bufs[] = {x, h, dy, dgu, wgu, wd, x16, h16, dy16, dgu16, wgu16, wd16, yb, yb16, dw};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) be->free(be, bufs[i]);
}

static int bench_gemm(lb_backend *be, const lb_config *c)
{
    char list[128], shape[96];
    snprintf(list, sizeof list, "%s", c->bench.formats);
    for (char *tok = strtok(list, ", "); tok; tok = strtok(NULL, ", ")) {
        lb_format f;
        if (lb_format_parse(tok, &f) != 0) {
            fprintf(stderr, "lowbit bench: bench.formats: unknown format '%s'\n", tok);
            return 1;
        }
        snprintf(shape, sizeof shape, "dense %dx%dx%d", c->bench.m, c->bench.n, c->bench.k);
        bench_gemm_format(be, c, shape, f, 1, c->bench.m, c->bench.n, c->bench.k, 1);
        int E = c->bench.experts, rows = c->bench.expert_rows;
        int C = c->model.hidden_size, I = c->model.moe_intermediate_size, F = 2 * I;
        snprintf(shape, sizeof shape, "grouped %dx%d rows, %d -> %d", E, rows, C, F);
        bench_gemm_format(be, c, shape, f, E, rows, F, C, 1);
        if (c->bench.moe_passes && f == LB_FMT_BF16) bench_moe_bf16(be, c);
        if (!c->bench.moe_passes || f == LB_FMT_FP32 || f == LB_FMT_BF16) continue;
        // The rest of the layer as models/precision/linear.c issues it (the row above is the gate/up
        // fprop): (m, n, k) per expert and whether B is a weight.
        const struct { const char *name; int m, n, k, w; } pass[] = {
            {"fprop down", rows, C, I, 1},      // H (rows, I) x W_down (C, I)
            {"dgrad down", rows, I, C, 1},      // dY (rows, C) x W_down^T (I, C)
            {"dgrad gate/up", rows, C, F, 1},   // dGU (rows, F) x W_gu^T (C, F)
            {"wgrad down", C, I, rows, 0},      // dY^T (C, rows) x H^T (I, rows)
            {"wgrad gate/up", F, C, rows, 0},   // dGU^T (F, rows) x X^T (C, rows)
        };
        for (size_t i = 0; i < sizeof pass / sizeof pass[0]; i++) {
            snprintf(shape, sizeof shape, "moe %s %dx(%d, %d, k %d)", pass[i].name, E, pass[i].m,
                     pass[i].n, pass[i].k);
            bench_gemm_format(be, c, shape, f, E, pass[i].m, pass[i].n, pass[i].k, pass[i].w);
        }
    }
    return 0;
}

typedef struct {
    int count;
    lb_qmat *q;
    lb_act x;
    const int *rows, *prows;
    lb_quant_args a;
    void *dst;                 // the copy peer
    size_t bytes;
} quant_case;

static void run_quant(lb_backend *be, void *p)
{
    quant_case *q = p;
    be->quantize_grouped(be, q->count, q->q, q->x, q->rows, q->prows, &q->a);
}

static void run_copy(lb_backend *be, void *p)
{
    quant_case *q = p;
    be->copy(be, q->dst, q->x.p, q->bytes);
}

// quantize_grouped of E groups of (rows, cols) under a (padded to prows column-wise), against
// a device copy of the same fp32 input in the same run: GB/s counts bytes read and written.
static void bench_quant_case(lb_backend *be, const lb_config *c, const char *what, int E,
                             int rows, int cols, lb_quant_args a)
{
    size_t n = (size_t)E * rows * cols;
    float *x = random_buffer(be, n, 3, 1.0f);
    int *r = lb_calloc(E, sizeof *r), *pr = lb_calloc(E, sizeof *pr);
    lb_qmat *q = lb_calloc(E, sizeof *q);
    size_t out = 0;
    for (int e = 0; e < E; e++) {
        r[e] = rows;
        pr[e] = a.colwise ? (rows + 15) / 16 * 16 : rows;
        be->qmat_alloc(be, &q[e], pr[e], cols, &a);
        out += lb_qmat_data_bytes(&q[e]) + lb_qmat_scale_bytes(&q[e]);
    }
    quant_case qc = {E, q, lb_act_f32(x, E * rows, cols), r, pr, a,
                     be->alloc(be, n * sizeof(float)), n * sizeof(float)};
    double t = time_it(be, c, run_quant, &qc), tc = time_it(be, c, run_copy, &qc);
    double gb = (n * sizeof(float) + out) / 1e9, gbc = 2.0 * n * sizeof(float) / 1e9;
    printf("quant %-9s %-44s %8.3f ms %8.1f GB/s  copy %8.1f GB/s  %.2fx\n",
           lb_format_name(a.fmt), what, t * 1e3, gb / t, gbc / tc, (gb / t) / (gbc / tc));
    fflush(stdout);
    for (int e = 0; e < E; e++) be->qmat_free(be, &q[e]);
    free(q), free(r), free(pr);
    be->free(be, x);
    be->free(be, qc.dst);
}

// The quantizations of one MoE layer's expert GEMMs, for each of bench.formats (quantized
// ones): activations row-wise, wgrad operands column-wise, weights in both directions.
static int bench_quant(lb_backend *be, const lb_config *c)
{
    char list[128], what[96];
    snprintf(list, sizeof list, "%s", c->bench.formats);
    int E = c->bench.experts, T = c->bench.expert_rows;
    int C = c->model.hidden_size, F = 2 * c->model.moe_intermediate_size;
    for (char *tok = strtok(list, ", "); tok; tok = strtok(NULL, ", ")) {
        lb_format f;
        if (lb_format_parse(tok, &f) != 0) {
            fprintf(stderr, "lowbit bench: bench.formats: unknown format '%s'\n", tok);
            return 1;
        }
        if (f == LB_FMT_FP32 || f == LB_FMT_BF16) continue;
        lb_quant_args a = qargs(f, 0);
        snprintf(what, sizeof what, "activations %dx(%d, %d), row-wise", E, T, C);
        bench_quant_case(be, c, what, E, T, C, a);
        a.colwise = 1;
        snprintf(what, sizeof what, "activations %dx(%d, %d), column-wise", E, T, C);
        bench_quant_case(be, c, what, E, T, C, a);
        a = qargs(f, 1);
        snprintf(what, sizeof what, "weights %dx(%d, %d), row-wise", E, F, C);
        bench_quant_case(be, c, what, E, F, C, a);
        a.colwise = 1;
        snprintf(what, sizeof what, "weights %dx(%d, %d), column-wise", E, F, C);
        bench_quant_case(be, c, what, E, F, C, a);
    }
    return 0;
}

typedef struct {
    int b, t, hq, hkv, d, bf16;
    float *q, *k, *v, *o, *lse, *dout, *dq, *dk, *dv;
} attn_case;

static void run_attn_fwd(lb_backend *be, void *p)
{
    attn_case *a = p;
    be->attention_fwd(be, &(lb_attention_args){.out = a->o, .lse = a->lse, .q = a->q, .k = a->k,
            .v = a->v, .b = a->b, .t = a->t, .hq = a->hq, .hkv = a->hkv, .d = a->d,
            .bf16 = a->bf16});
}

static void run_attn_fwd_bwd(lb_backend *be, void *p)
{
    attn_case *a = p;
    run_attn_fwd(be, p);
    be->attention_bwd(be, &(lb_attention_args){.dq = a->dq, .dk = a->dk, .dv = a->dv,
            .dout = a->dout, .q = a->q, .k = a->k, .v = a->v, .out = a->o, .lse = a->lse,
            .b = a->b, .t = a->t, .hq = a->hq, .hkv = a->hkv, .d = a->d, .bf16 = a->bf16});
}

static int bench_attention(lb_backend *be, const lb_config *c)
{
    attn_case a = {.b = c->bench.attn_batch, .t = c->bench.attn_seq,
                   .hq = c->model.num_attention_heads, .hkv = c->model.num_key_value_heads,
                   .d = c->model.head_dim};
    size_t nq = (size_t)a.b * a.t * a.hq * a.d, nk = (size_t)a.b * a.t * a.hkv * a.d;
    a.q = random_buffer(be, nq, 3, 1.0f);
    a.k = random_buffer(be, nk, 4, 1.0f);
    a.v = random_buffer(be, nk, 5, 1.0f);
    a.dout = random_buffer(be, nq, 6, 1.0f);
    a.o = be->alloc(be, nq * sizeof(float));
    a.dq = be->alloc(be, nq * sizeof(float));
    a.dk = be->alloc(be, nk * sizeof(float));
    a.dv = be->alloc(be, nk * sizeof(float));
    a.lse = be->alloc(be, (size_t)a.b * a.hq * a.t * sizeof(float));
    // Causal attention FLOPs as FlashAttention counts them: forward 2 GEMMs over half the
    // square, backward 2.5x the forward.
    double fwd = 4.0 * a.b * a.hq * (double)a.t * a.t * a.d / 2.0;
    // Both numerics modes (precision.attention picks one for training): fp32 and bf16. The
    // CUDA bf16 kernels take head dims up to 128.
    for (a.bf16 = 0; a.bf16 <= 1; a.bf16++) {
        const char *mode = a.bf16 ? "bf16" : "fp32";
        if (a.bf16 && a.d > 128 && !strcmp(be->name, "cuda")) {
            printf("attn  %s  head dim %d > 128: no bf16 kernel, skipped\n", mode, a.d);
            continue;
        }
        double t1 = time_it(be, c, run_attn_fwd, &a);
        double t2 = time_it(be, c, run_attn_fwd_bwd, &a);
        printf("attn  %s fwd      b%d t%d hq%d hkv%d d%d %14.3f ms  %8.1f TFLOP/s\n", mode, a.b,
               a.t, a.hq, a.hkv, a.d, t1 * 1e3, fwd / t1 / 1e12);
        printf("attn  %s fwd+bwd  b%d t%d hq%d hkv%d d%d %14.3f ms  %8.1f TFLOP/s\n", mode, a.b,
               a.t, a.hq, a.hkv, a.d, t2 * 1e3, 3.5 * fwd / t2 / 1e12);
        fflush(stdout);
    }
    float *bufs[] = {a.q, a.k, a.v, a.dout, a.o, a.dq, a.dk, a.dv, a.lse};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) be->free(be, bufs[i]);
    return 0;
}

// A model of [model] with random weights under [precision]; NULL (message printed) on error.
static lb_model *bench_model(lb_backend *be, const lb_config *c)
{
    char err[1024];
    double t0 = lb_now();
    lb_model *m = lb_run_model(c, be, NULL, 0, err, sizeof err);
    if (!m) {
        fprintf(stderr, "lowbit bench: %s\n", err);
        return NULL;
    }
    double t1 = lb_now();
    lb_model_init_params(m, c->run.seed);
    be->sync(be);
    // The setup's share of a bench command's time (GPU calls are budgeted in seconds)
    printf("# bench setup: model %.1f s, weights drawn and uploaded %.1f s\n", t1 - t0,
           lb_now() - t1);
    return m;
}

// bench_model with the KV cache of [sample] (the rollout and RL kinds).
static lb_model *bench_kv_model(lb_backend *be, const lb_config *c)
{
    lb_model *m = bench_model(be, c);
    char err[256];
    if (m && lb_model_set_kv_cache(m, lb_config_kv_cache(c), err, sizeof err) != 0) {
        fprintf(stderr, "lowbit bench: sample.kv_cache: %s\n", err);
        lb_model_free(m);
        return NULL;
    }
    return m;
}

// AdamW with [train]'s settings (train.optimizer_offload included) on a schedule too long to
// end while timing, without warm-up.
static void bench_optimizer(lb_optimizer *o, lb_model *m, const lb_config *c)
{
    lb_optim_config oc = lb_run_optim_config(c, 1000000);
    oc.warmup_steps = 0;
    lb_optimizer_init(o, m, &oc);
}

static int bench_train(lb_backend *be, const lb_config *c)
{
    lb_model *m = bench_model(be, c);
    if (!m) return 1;
    lb_optimizer opt;
    bench_optimizer(&opt, m, c);
    int B = c->train.micro_batch, T = c->train.seq_len;
    size_t n = (size_t)B * T;
    int32_t *tok = lb_malloc(n * sizeof(int32_t)), *tgt = lb_malloc(n * sizeof(int32_t));
    for (size_t i = 0; i < n; i++) {
        tok[i] = (int32_t)(lb_rand_u64(9, 1, i) % (uint64_t)c->model.vocab_size);
        tgt[i] = (int32_t)(lb_rand_u64(9, 2, i) % (uint64_t)c->model.vocab_size);
    }
    double total = 0.0;
    for (int s = 1; s <= c->bench.warmup + c->bench.iters; s++) {
        be->sync(be);
        double t0 = lb_now();
        lb_model_zero_grad(m);
        lb_model_forward_train(m, tok, tgt, B, T, 1.0f);
        lb_model_backward(m, 1.0f);
        lb_optimizer_step(&opt, s, NULL);
        be->sync(be);
        if (s > c->bench.warmup) total += lb_now() - t0;
#ifdef LB_HAVE_CUDA
        if (!strcmp(be->name, "cuda")) lb_cuda_mem_peak();   // sample the peak
#endif
    }
    double step = total / c->bench.iters, tps = n / step;
    double flops = lb_model_flops_per_token(&m->cfg, T) * tps;
    double mem = peak_gib(be);
    // MFU against the H100/H200's dense bf16 peak, on the GPU only (a CPU has no such peak)
    char mfu[64] = "";
    if (!strcmp(be->name, "cuda"))
        snprintf(mfu, sizeof mfu, "MFU %.3f (989 TFLOP/s), ", flops / 989e12);
    // the settings that trade memory for time, where they are not the defaults
    char how[128] = "";
    if (strcmp(c->train.recompute, "none"))
        snprintf(how, sizeof how, ", recompute %s", c->train.recompute);
    if (c->train.optimizer_offload > 0)
        snprintf(how + strlen(how), sizeof how - strlen(how), ", offload %g",
                 c->train.optimizer_offload);
    printf("train %s %s%s%s: %d x %d tokens, %.4f s/step, %.0f tokens/s, %.1f model TFLOP/s, "
           "%speak memory %.1f GiB, loss %.7f\n",
           m->cfg.arch, c->precision.recipe,
           strcmp(c->train.adam_moments, "fp32") ? ", bf16 moments" : "", how, B, T, step, tps,
           flops / 1e12, mfu, mem, m->loss);
    fflush(stdout);
    lb_optimizer_free(&opt);
    lb_model_free(m);
    free(tok);
    free(tgt);
    return 0;
}

// --- rollout and RL step ---------------------------------------------------------------------
// The sampler (src/rl/sampler.c) on the [model] of the file with random weights under [precision]:
// bench.rollout_batch random prompts of bench.rollout_prompt tokens, each generating exactly
// bench.rollout_new tokens (no stop token), all in flight at once (slots = batch), with the
// [sample] policy settings; what ../shared/bench/peer_hf_generate.py measures with generate().

typedef struct {
    int B, P, N;                   // sequences, prompt and new tokens per sequence
    int32_t *prompt;               // (B, P)
    int32_t *out;                  // (B, N) generated tokens
    float *lp;                     // (B, N) their log-probs
    lb_sample_req *req;            // (B)
} rollout_reqs;

static void rollout_reqs_init(rollout_reqs *r, int B, int P, int N, int vocab, uint64_t seed)
{
    r->B = B, r->P = P, r->N = N;
    r->prompt = lb_malloc((size_t)B * P * sizeof(int32_t));
    r->out = lb_malloc((size_t)B * N * sizeof(int32_t));
    r->lp = lb_malloc((size_t)B * N * sizeof(float));
    r->req = lb_calloc((size_t)B, sizeof *r->req);
    for (size_t i = 0; i < (size_t)B * P; i++)
        r->prompt[i] = (int32_t)(lb_rand_u64(seed, 3, i) % (uint64_t)vocab);
    for (int b = 0; b < B; b++)
        r->req[b] = (lb_sample_req){r->prompt + (size_t)b * P, P, seed, lb_sample_stream(b, 0),
                                    r->out + (size_t)b * N, r->lp + (size_t)b * N, 0, 0, NULL};
}

static void rollout_reqs_free(rollout_reqs *r)
{
    free(r->prompt), free(r->out), free(r->lp), free(r->req);
}

// A sampler for B sequences of P + N positions; NULL (message printed) on a bad setting.
static lb_sampler *rollout_sampler(const lb_config *c, lb_model *m, int B, int P, int N)
{
    lb_sampler_config sc = {(float)c->sample.temperature, (float)c->sample.top_p,
                            c->sample.top_k, N, 0, {0}, B,
                            c->sample.max_rows > B ? c->sample.max_rows : B};
    char err[512];
    lb_sampler *s = lb_sampler_create(m, &sc, P + N, err, sizeof err);
    if (!s) fprintf(stderr, "lowbit bench: %s\n", err);
    return s;
}

// Runs the B requests of r (stats, seconds included, in *st). 0, or 1 with a message printed.
static int rollout_run(lb_sampler *s, rollout_reqs *r, lb_sample_stats *st)
{
    char err[512];
    if (lb_sampler_run(s, r->req, r->B, st, err, sizeof err) != 0) {
        fprintf(stderr, "lowbit bench: %s\n", err);
        return 1;
    }
    return 0;
}

// The peer's warm-up: 16-token prompts, 8 new tokens, same batch (plans, scratch, the cache).
static int rollout_warmup(const lb_config *c, lb_model *m)
{
    int B = c->bench.rollout_batch, P = c->bench.rollout_prompt < 16 ? c->bench.rollout_prompt : 16;
    lb_sampler *s = rollout_sampler(c, m, B, P, 8);
    if (!s) return 1;
    rollout_reqs r;
    rollout_reqs_init(&r, B, P, 8, m->cfg.vocab_size, c->sample.seed + 1);
    lb_sample_stats st;
    int rc = rollout_run(s, &r, &st);
    rollout_reqs_free(&r);
    lb_sampler_free(s);
    return rc;
}

static void print_rollout(const lb_config *c, lb_backend *be, const lb_model *m,
                          const lb_sample_stats *st)
{
    printf("rollout %s %s: batch %d, prompt %d, new %d, KV cache %s, max_rows %d: %.3f s, "
           "%.0f generated tokens/s (%ld generated, %ld prefill tokens, %ld forward calls, %ld of "
           "them graph replays; "
           "%.3f ms a decode forward over %ld, %.3f ms of it queuing on the host, %.3f s for "
           "the prefill and the rest), peak memory %.1f GiB\n",
           m->cfg.arch, c->precision.recipe, c->bench.rollout_batch, c->bench.rollout_prompt,
           c->bench.rollout_new, c->sample.kv_cache,
           c->sample.max_rows > c->bench.rollout_batch ? c->sample.max_rows : c->bench.rollout_batch,
           st->seconds, st->generated / st->seconds, st->generated, st->prefill_tokens,
           st->forwards, st->graph_forwards,
           st->decode_forwards ? 1e3 * st->decode_seconds / st->decode_forwards : 0.0,
           st->decode_forwards,
           st->decode_forwards ? 1e3 * st->decode_queue_seconds / st->decode_forwards : 0.0,
           st->seconds - st->decode_seconds, peak_gib(be));
    fflush(stdout);
}

// One shape's rollouts on m: bench.rollout_batch sequences of bench.rollout_new tokens.
static int rollout_shape(lb_backend *be, const lb_config *c, lb_model *m)
{
    int B = c->bench.rollout_batch, P = c->bench.rollout_prompt, N = c->bench.rollout_new;
    lb_sampler *s = rollout_sampler(c, m, B, P, N);
    double t0 = lb_now();
    int rc = !s || (c->bench.warmup > 0 && rollout_warmup(c, m));
    if (!rc) printf("# bench setup: sampler and warm-up rollout %.1f s\n", lb_now() - t0);
    rollout_reqs r;
    rollout_reqs_init(&r, B, P, N, m->cfg.vocab_size, c->sample.seed);
    for (int it = 0; !rc && it < c->bench.iters; it++) {
        lb_sample_stats st;
        rc = rollout_run(s, &r, &st);
        if (!rc) print_rollout(c, be, m, &st);
    }
    rollout_reqs_free(&r);
    if (s) lb_sampler_free(s);
    return rc;
}

// bench.rollout_shapes "BxN,BxN,..." into b and n (at most max); the count, or -1 with a
// message printed.
static int rollout_shapes(const char *list, int *b, int *n, int max)
{
    int count = 0;
    for (const char *p = list; *p;) {
        char *end;
        long bb = strtol(p, &end, 10), nn = 0;
        int ok = end != p && *end == 'x';
        if (ok) {
            const char *q = end + 1;
            nn = strtol(q, &end, 10);
            ok = end != q && (*end == ',' || !*end) && bb >= 1 && bb <= 1048576 && nn >= 1 &&
                 nn <= 1048576;
        }
        if (!ok || count == max) {
            fprintf(stderr, "lowbit bench: bench.rollout_shapes: '%s' is not a list of at most "
                    "%d BATCHxNEW shapes (1 to 1048576 each, e.g. 64x128,256x512)\n", list, max);
            return -1;
        }
        b[count] = (int)bb, n[count] = (int)nn, count++;
        p = *end ? end + 1 : end;
    }
    return count;
}

static int bench_rollout(lb_backend *be, const lb_config *c)
{
    int b[16], n[16], count = 1;
    b[0] = c->bench.rollout_batch, n[0] = c->bench.rollout_new;
    if (c->bench.rollout_shapes[0] &&
        (count = rollout_shapes(c->bench.rollout_shapes, b, n, 16)) < 0)
        return 1;
    lb_model *m = bench_kv_model(be, c);
    if (!m) return 1;
    int rc = 0;
    for (int i = 0; !rc && i < count; i++) {
        lb_config ci = *c;   // the shape's batch and new tokens
        ci.bench.rollout_batch = b[i], ci.bench.rollout_new = n[i];
        rc = rollout_shape(be, &ci, m);
    }
    lb_model_free(m);
    return rc;
}

// One GRPO-shaped RL step, timed in its four parts: the weight-cache refresh after the previous
// update (lb_model_refresh_weights), the rollout, the trainer's log-prob recompute over prompt +
// completion (rl.micro_batch sequences per forward), and the update (forward, backward through
// per-token weights, AdamW). The backward's weights are random (the loss is not GRPO's; the
// work is). bench.warmup untimed steps first, then bench.iters timed ones.
static int bench_rl(lb_backend *be, const lb_config *c)
{
    lb_model *m = bench_kv_model(be, c);
    if (!m) return 1;
    int B = c->bench.rollout_batch, P = c->bench.rollout_prompt, N = c->bench.rollout_new;
    int T = P + N, MB = c->rl.micro_batch < B ? c->rl.micro_batch : B;
    lb_optimizer opt;
    bench_optimizer(&opt, m, c);
    lb_sampler *s = rollout_sampler(c, m, B, P, N);
    rollout_reqs r;
    rollout_reqs_init(&r, B, P, N, m->cfg.vocab_size, c->sample.seed);
    size_t cap = (size_t)MB * T;
    int32_t *tok = lb_malloc(cap * sizeof(int32_t)), *tgt = lb_malloc(cap * sizeof(int32_t));
    float *lp = lb_malloc(cap * sizeof(float)), *dlp = lb_malloc(cap * sizeof(float));
    const float inv_temp = (float)(1.0 / c->sample.temperature);
    double sum[4] = {0}, t[4];
    int rc = !s;
    for (int step = 1; !rc && step <= c->bench.warmup + c->bench.iters; step++) {
        be->sync(be);
        double t0 = lb_now();
        lb_model_refresh_weights(m);   // what the next rollout's first forward would do
        be->sync(be);
        t[0] = lb_now() - t0;
        lb_sample_stats st;
        if ((rc = rollout_run(s, &r, &st))) break;
        t[1] = st.seconds;
        // recompute, then update: micro-batches of MB sequences of prompt + completion, the
        // targets the completion tokens (prompt positions -1), as src/rl/rl.c packs them
        for (int pass = 0; pass < 2; pass++) {
            be->sync(be);
            t0 = lb_now();
            if (pass) lb_model_zero_grad(m);
            for (int b0 = 0; b0 < B; b0 += MB) {
                int cnt = B - b0 < MB ? B - b0 : MB;
                for (int b = 0; b < cnt; b++)
                    for (int i = 0; i < T; i++) {
                        size_t k = (size_t)b * T + i;
                        const lb_sample_req *q = &r.req[b0 + b];
                        tok[k] = i < P ? q->prompt[i] : q->tokens[i - P];
                        tgt[k] = i >= P - 1 && i + 1 < T ? q->tokens[i + 1 - P] : -1;
                        dlp[k] = tgt[k] < 0 ? 0.0f
                                            : lb_rand_normal(step, b0 + b, 0) / (float)(B * N);
                    }
                lb_model_forward_logprobs(m, tok, tgt, cnt, T, inv_temp, lp);
                if (pass) lb_model_backward_logprobs(m, dlp, (float)cnt / B);
            }
            if (pass) lb_optimizer_step(&opt, step, NULL);
            be->sync(be);
            t[2 + pass] = lb_now() - t0;
        }
        double total = t[0] + t[1] + t[2] + t[3];
        int timed = step > c->bench.warmup;
        printf("rl step %d%s %s %s: refresh %.3f s, rollout %.3f s (%.0f generated tokens/s), "
               "recompute %.3f s, train %.3f s (%.0f tokens/s), total %.3f s\n", step,
               timed ? "" : " (warm-up)", m->cfg.arch, c->precision.recipe, t[0], t[1],
               st.generated / t[1], t[2], t[3], (double)B * T / t[3], total);
        fflush(stdout);
        for (int i = 0; timed && i < 4; i++) sum[i] += t[i];
    }
    if (!rc) {
        double k = c->bench.iters, total = (sum[0] + sum[1] + sum[2] + sum[3]) / k;
        printf("rl %s %s: batch %d, prompt %d, new %d, micro-batch %d, mean of %d steps: "
               "%.3f s per step = refresh %.1f%% + rollout %.1f%% + recompute %.1f%% + train "
               "%.1f%%, peak memory %.1f GiB\n",
               m->cfg.arch, c->precision.recipe, B, P, N, MB, c->bench.iters, total,
               100 * sum[0] / k / total, 100 * sum[1] / k / total, 100 * sum[2] / k / total,
               100 * sum[3] / k / total, peak_gib(be));
        fflush(stdout);
    }
    free(tok), free(tgt), free(lp), free(dlp);
    rollout_reqs_free(&r);
    lb_sampler_free(s);
    lb_optimizer_free(&opt);
    lb_model_free(m);
    return rc;
}

// A line before each part: the defaults are the GPU benchmark's shapes, and on the CPU a part
// can take minutes (bench.m, .n, .k, .experts, .expert_rows and .attn_seq shrink it). 1.
static int part(const lb_backend *be, const char *what)
{
    printf("# bench %s on %s...\n", what, be->name);
    fflush(stdout);
    return 1;
}

// The bench.* sizes default to the GPU benchmark's shapes, which the CPU would take many
// minutes over: on the CPU each size left at its default is cut to a CPU-sized one (said in
// one line); sizes given in the file or with --set are kept.
static void cpu_sizes(lb_config *c)
{
    lb_config d;
    lb_config_defaults(&d);
    int cut = 0;
#define CUT(field, small)                                                                     \
    if (c->bench.field == d.bench.field && c->bench.field != (small)) c->bench.field = (small), cut = 1
    CUT(m, 1024); CUT(n, 1024); CUT(k, 1024); CUT(experts, 8); CUT(expert_rows, 256);
    CUT(attn_batch, 1); CUT(attn_seq, 512); CUT(rollout_batch, 8); CUT(rollout_prompt, 32);
    CUT(rollout_new, 32);
#undef CUT
    if (cut)
        printf("# bench sizes left at their (GPU) defaults are cut for the CPU: gemm %d x %d x %d, "
               "grouped %d x %d rows, attention %d x %d, rollout %d x (%d + %d)\n", c->bench.m,
               c->bench.n, c->bench.k, c->bench.experts, c->bench.expert_rows,
               c->bench.attn_batch, c->bench.attn_seq, c->bench.rollout_batch,
               c->bench.rollout_prompt, c->bench.rollout_new);
}

int lb_cmd_bench(const lb_config *cfg, lb_comm *comm)
{
    if (comm->rank != 0) return 0;
    lb_backend *be = lb_run_backend_open(cfg, NULL);
    if (!be) return 1;
    lb_config cc = *cfg;
    if (!strcmp(be->name, "cpu")) cpu_sizes(&cc);
    const lb_config *c = &cc;
    printf("lowbit bench on %s (deterministic %d, %d timed iterations after %d)\n", be->name,
           be->deterministic, c->bench.iters, c->bench.warmup);
    const char *k = c->bench.kind;
    int all = !strcmp(k, "all"), rc = 0;

    if (!rc && (all || !strcmp(k, "gemm")) && part(be, "gemm")) rc = bench_gemm(be, c);
    if (!rc && !strcmp(k, "quant") && part(be, "quant")) rc = bench_quant(be, c);
    if (!rc && (all || !strcmp(k, "attention")) && part(be, "attention"))
        rc = bench_attention(be, c);
    if (!rc && (all || !strcmp(k, "train")) && part(be, "train")) rc = bench_train(be, c);
    // sampling runs as `lowbit rl` does: batch-invariant operations when sample.deterministic
    be->deterministic = c->sample.deterministic;
    if (!rc && !strcmp(k, "rollout") && part(be, "rollout")) rc = bench_rollout(be, c);
    if (!rc && !strcmp(k, "rl") && part(be, "rl")) rc = bench_rl(be, c);
    be->destroy(be);
    return rc;
}
