// bench.c: `lowbit bench`: GEMMs per format, attention forward + backward, and training steps,
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
#include "kernels/quant/contract.h"
#include "kernels/quant/quant.h"
#include "src/commands.h"
#include "src/optim.h"
#include "src/util.h"

#ifdef LB_HAVE_CUDA
size_t lb_cuda_mem_peak(void);
#endif

static float *random_buffer(lb_backend *be, size_t n, uint64_t stream, float scale)
{
    float *h = lb_malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) h[i] = scale * lb_rand_normal(7, stream, i);
    float *d = be->alloc(be, n * sizeof(float));
    be->upload(be, d, h, n * sizeof(float));
    free(h);
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

typedef struct {
    int m, n, k;
    const float *a, *b;
    float *c;
    const lb_qmat *qa, *qb;
    int groups;
    lb_gemm_args *args;
} gemm_case;

static void run_gemm(lb_backend *be, void *p)
{
    gemm_case *g = p;
    lb_gemm(be, 0, 1, g->m, g->n, g->k, 1.0f, g->a, g->b, 0.0f, g->c);
}

static void run_gemm_q(lb_backend *be, void *p)
{
    gemm_case *g = p;
    for (int e = 0; e < g->groups; e++)
        be->gemm_q(be, g->m, g->n, g->k, 1.0f, &g->qa[e], &g->qb[e], 0.0f,
                   g->c + (size_t)e * g->m * g->n);
}

static void run_grouped(lb_backend *be, void *p)
{
    gemm_case *g = p;
    be->gemm_grouped(be, g->groups, g->args);
}

static void round_inplace(lb_backend *be, float *x, size_t n) { be->round_bf16(be, x, x, n); }

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

// One format at one shape: groups GEMMs of (m, n, k); prints TFLOP/s.
static void bench_gemm_format(lb_backend *be, const lb_config *c, const char *what, lb_format f,
                              int groups, int m, int n, int k)
{
    size_t an = (size_t)groups * m * k, bn = (size_t)groups * n * k;
    float *a = random_buffer(be, an, 1, 1.0f), *b = random_buffer(be, bn, 2, 0.05f);
    float *cc = be->alloc(be, (size_t)groups * m * n * sizeof(float));
    gemm_case g = {m, n, k, a, b, cc, NULL, NULL, groups, NULL};
    double t;
    if (f == LB_FMT_FP32 || f == LB_FMT_BF16) {
        if (f == LB_FMT_BF16) {   // BF16 operands, as the contract's bf16 sites give them
            round_inplace(be, a, an);
            round_inplace(be, b, bn);
        }
        if (groups == 1) {
            t = time_it(be, c, run_gemm, &g);
        } else {
            g.args = lb_calloc(groups, sizeof *g.args);
            for (int e = 0; e < groups; e++)
                g.args[e] = (lb_gemm_args){0, 1, m, n, k, 1.0f, 0.0f, a + (size_t)e * m * k,
                                           b + (size_t)e * n * k, cc + (size_t)e * m * n};
            t = time_it(be, c, run_grouped, &g);
            free(g.args);
        }
    } else {
        lb_qmat *qa = lb_calloc(groups, sizeof *qa), *qb = lb_calloc(groups, sizeof *qb);
        lb_quant_args aa = qargs(f, 0), ab = qargs(f, 1);
        for (int e = 0; e < groups; e++) {
            be->qmat_alloc(be, &qa[e], m, k, &aa);
            be->qmat_alloc(be, &qb[e], n, k, &ab);
            be->quantize(be, &qa[e], a + (size_t)e * m * k, m, k, &aa);
            be->quantize(be, &qb[e], b + (size_t)e * n * k, n, k, &ab);
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
        bench_gemm_format(be, c, shape, f, 1, c->bench.m, c->bench.n, c->bench.k);
        int E = c->bench.experts, rows = c->bench.expert_rows;
        int C = c->model.hidden_size, F = 2 * c->model.moe_intermediate_size;
        snprintf(shape, sizeof shape, "grouped %dx%d rows, %d -> %d", E, rows, C, F);
        bench_gemm_format(be, c, shape, f, E, rows, F, C);
    }
    return 0;
}

typedef struct {
    int b, t, hq, hkv, d;
    float *q, *k, *v, *o, *lse, *dout, *dq, *dk, *dv;
} attn_case;

static void run_attn_fwd(lb_backend *be, void *p)
{
    attn_case *a = p;
    be->attention_fwd(be, a->o, a->lse, a->q, a->k, a->v, a->b, a->t, a->hq, a->hkv, a->d);
}

static void run_attn_fwd_bwd(lb_backend *be, void *p)
{
    attn_case *a = p;
    run_attn_fwd(be, p);
    be->attention_bwd(be, a->dq, a->dk, a->dv, a->dout, a->q, a->k, a->v, a->o, a->lse, a->b,
                      a->t, a->hq, a->hkv, a->d);
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
    double t1 = time_it(be, c, run_attn_fwd, &a);
    double t2 = time_it(be, c, run_attn_fwd_bwd, &a);
    printf("attn  fwd      b%d t%d hq%d hkv%d d%d %14.3f ms  %8.1f TFLOP/s\n", a.b, a.t, a.hq,
           a.hkv, a.d, t1 * 1e3, fwd / t1 / 1e12);
    printf("attn  fwd+bwd  b%d t%d hq%d hkv%d d%d %14.3f ms  %8.1f TFLOP/s\n", a.b, a.t, a.hq,
           a.hkv, a.d, t2 * 1e3, 3.5 * fwd / t2 / 1e12);
    fflush(stdout);
    float *bufs[] = {a.q, a.k, a.v, a.dout, a.o, a.dq, a.dk, a.dv, a.lse};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) be->free(be, bufs[i]);
    return 0;
}

static int bench_train(lb_backend *be, const lb_config *c)
{
    char err[1024];
    lb_model *m = lb_model_create(&c->model, be, err, sizeof err);
    if (!m || lb_model_set_precision(m, &c->precision, c->run.seed, err, sizeof err) != 0) {
        fprintf(stderr, "lowbit bench: %s\n", err);
        return 1;
    }
    lb_model_init_params(m, c->run.seed);
    lb_optim_config oc = {.lr = c->train.lr, .min_lr = c->train.min_lr, .total_steps = 1000000,
                          .beta1 = c->train.beta1, .beta2 = c->train.beta2,
                          .eps = c->train.adam_eps, .weight_decay = c->train.weight_decay,
                          .grad_clip = c->train.grad_clip};
    lb_optimizer opt;
    lb_optimizer_init(&opt, m, &oc);
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
        lb_model_forward(m, tok, tgt, B, T);
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
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    double mem = ru.ru_maxrss / 1024.0 / 1024.0;   // GiB (host)
#ifdef LB_HAVE_CUDA
    if (!strcmp(be->name, "cuda")) mem = lb_cuda_mem_peak() / (1024.0 * 1024.0 * 1024.0);
#endif
    printf("train %s %s: %d x %d tokens, %.4f s/step, %.0f tokens/s, %.1f model TFLOP/s, "
           "MFU %.3f (989 TFLOP/s), peak memory %.1f GiB, loss %.4f\n",
           m->cfg.arch, c->precision.recipe, B, T, step, tps, flops / 1e12, flops / 989e12, mem,
           m->loss);
    fflush(stdout);
    lb_optimizer_free(&opt);
    lb_model_free(m);
    free(tok);
    free(tgt);
    return 0;
}

int lb_cmd_bench(const lb_config *c, lb_comm *comm)
{
    if (comm->rank != 0) return 0;
    lb_backend *be = lb_backend_open(c);
    if (!be) return 1;
    printf("lowbit bench on %s (deterministic %d, %d timed iterations after %d)\n", be->name,
           be->deterministic, c->bench.iters, c->bench.warmup);
    const char *k = c->bench.kind;
    int all = !strcmp(k, "all"), rc = 0;
    if (!rc && (all || !strcmp(k, "gemm"))) rc = bench_gemm(be, c);
    if (!rc && (all || !strcmp(k, "attention"))) rc = bench_attention(be, c);
    if (!rc && (all || !strcmp(k, "train"))) rc = bench_train(be, c);
    be->destroy(be);
    return rc;
}
