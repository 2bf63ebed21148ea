// ops_optim.c: cross-entropy over logits and the AdamW update for the CPU reference backend.
#include "kernels/cpu/cpu.h"
#include "kernels/common.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>

static void check_targets(const char *what, const int32_t *targets, int n, int v)
{
    for (int i = 0; i < n; i++)
        if (targets[i] >= v) lb_die("%s: target %d at %d outside [0, %d)", what, targets[i], i, v);
}

// The softmax statistics of one row of logits (v >= 1: only rows with a target in [0, v) get
// here): st[0] its max, st[1] the exponential sum in double; the log-sum-exp is their
// st[0] + log(st[1]).
static void row_stats(const float *l, int v, double st[2])
{
    float m = l[0];
    for (int j = 1; j < v; j++) m = l[j] > m ? l[j] : m;
    double sum = 0.0;
    for (int j = 0; j < v; j++) sum += exp((double)l[j] - m);
    st[0] = m, st[1] = sum;
}

// loss (n): loss_i = logsumexp(logits_i) - logits_i[target_i]; 0 where the target is negative.
static void cpu_cross_entropy_fwd(lb_backend *be, float *loss, double *stats,
                                  const float *logits, const int32_t *targets, int n, int v)
{
    check_targets("cross_entropy_fwd", targets, n, v);
    #pragma omp parallel for num_threads(lb_cpu_threads(be)) if ((size_t)n * v >= LB_CPU_PAR_MIN)
    for (int i = 0; i < n; i++) {
        const float *l = logits + (size_t)i * v;
        if (targets[i] < 0) {
            loss[i] = 0.0f;
            continue;
        }
        double st[2];
        row_stats(l, v, st);
        if (stats) stats[2 * i] = st[0], stats[2 * i + 1] = st[1];
        loss[i] = (float)(st[0] + log(st[1]) - l[targets[i]]);
    }
}

// Row i of bf16 logits (rows of pad8(v), to_bf16's layout) widened into l (v).
static void widen_row(float *l, const uint16_t *logits16, int i, int v)
{
    const uint16_t *row = logits16 + (size_t)i * ((size_t)(v + 7) / 8 * 8);
    for (int j = 0; j < v; j++) l[j] = lb_bf16_to_f32(row[j]);
}

// The same over bf16 logits, rows of pad8(v): each row widened into a buffer of the thread's.
static void cpu_cross_entropy_fwd16(lb_backend *be, float *loss, double *stats,
                                    const uint16_t *logits16, const int32_t *targets, int n,
                                    int v)
{
    check_targets("cross_entropy_fwd16", targets, n, v);
    #pragma omp parallel num_threads(lb_cpu_threads(be)) if ((size_t)n * v >= LB_CPU_PAR_MIN)
    {
        float *l = lb_malloc((size_t)(v > 0 ? v : 1) * sizeof(float));
        #pragma omp for
        for (int i = 0; i < n; i++) {
            if (targets[i] < 0) {
                loss[i] = 0.0f;
                continue;
            }
            widen_row(l, logits16, i, v);
            double st[2];
            row_stats(l, v, st);
            if (stats) stats[2 * i] = st[0], stats[2 * i + 1] = st[1];
            loss[i] = (float)(st[0] + log(st[1]) - l[targets[i]]);
        }
        free(l);
    }
}

// One row of the backward: dl (v) = dloss * (softmax(l) - onehot(tgt)); 0 when tgt < 0.
// st: the row's statistics from the forward, or NULL. Each element is read before it is
// written, so dl may alias l.
static void ce_bwd_row(float *dl, const float *l, const double *st, int tgt, float dloss, int v)
{
    if (tgt < 0) {
        for (int j = 0; j < v; j++) dl[j] = 0.0f;
        return;
    }
    double mine[2];
    if (!st) row_stats(l, v, mine), st = mine;
    double lse = st[0] + log(st[1]);
    for (int j = 0; j < v; j++) {
        double p = exp((double)l[j] - lse);
        dl[j] = (float)(dloss * (p - (j == tgt)));
    }
}

// dlogits (n, v) = dloss * (softmax(logits) - onehot(target)); 0 for ignored rows. May alias
// logits.
static void cpu_cross_entropy_bwd(lb_backend *be, float *dlogits, const float *logits,
                                  const double *stats, const int32_t *targets, float dloss,
                                  int n, int v)
{
    check_targets("cross_entropy_bwd", targets, n, v);
    #pragma omp parallel for num_threads(lb_cpu_threads(be)) if ((size_t)n * v >= LB_CPU_PAR_MIN)
    for (int i = 0; i < n; i++)
        ce_bwd_row(dlogits + (size_t)i * v, logits + (size_t)i * v, stats ? stats + 2 * i : NULL,
                   targets[i], dloss, v);
}

// The same with one weight per row (GRPO's per-token d loss / d logprob).
static void cpu_cross_entropy_bwd_rows(lb_backend *be, float *dlogits, const float *logits,
                                       const double *stats, const int32_t *targets,
                                       const float *dloss, int n, int v)
{
    check_targets("cross_entropy_bwd_rows", targets, n, v);
    #pragma omp parallel for num_threads(lb_cpu_threads(be)) if ((size_t)n * v >= LB_CPU_PAR_MIN)
    for (int i = 0; i < n; i++)
        ce_bwd_row(dlogits + (size_t)i * v, logits + (size_t)i * v, stats ? stats + 2 * i : NULL,
                   targets[i], dloss[i], v);
}

// The definition itself: cross_entropy_bwd in place, then both GEMMs in one grouped call.
static void cpu_linear_ce_bwd(lb_backend *be, const lb_linear_ce_args *args)
{
    float *dx = args->dx;
    float dx_beta = args->dx_beta;
    float *dw = args->dw;
    float dw_beta = args->dw_beta;
    float *logits = args->logits;
    const double *stats = args->stats;
    const int32_t *targets = args->targets;
    float dloss = args->dloss;
    const float *x = args->x, *w = args->w;
    const uint16_t *w16 = args->w16;
    int n = args->n, v = args->v, c = args->c;
    if (!stats) lb_die("linear_ce_bwd: needs the forward's row statistics");
    if (args->logits16) {   // g from the widened logits, rounded over them; the GEMMs read that
        uint16_t *l16 = args->logits16;
        const size_t ld = (size_t)(v + 7) / 8 * 8;
        check_targets("linear_ce_bwd", targets, n, v);
        #pragma omp parallel num_threads(lb_cpu_threads(be)) if ((size_t)n * v >= LB_CPU_PAR_MIN)
        {
            float *row = lb_malloc((size_t)(v > 0 ? v : 1) * sizeof(float));
            #pragma omp for
            for (int i = 0; i < n; i++) {
                widen_row(row, l16, i, v);
                ce_bwd_row(row, row, stats + 2 * i, targets[i], dloss, v);
                for (int j = 0; j < v; j++) l16[i * ld + j] = lb_f32_to_bf16(row[j]);
            }
            free(row);
        }
        lb_gemm_args g[2] = {{0, 0, n, c, v, 1.0f, dx_beta, NULL, w, dx, 1, w16, l16, NULL},
                             {1, 0, v, c, n, 1.0f, dw_beta, NULL, x, dw, 1, NULL, l16, NULL}};
        be->gemm_grouped(be, 2, g);
        return;
    }
    be->cross_entropy_bwd(be, logits, logits, stats, targets, dloss, n, v);
    lb_gemm_args g[2] = {{0, 0, n, c, v, 1.0f, dx_beta, logits, w, dx, 1, w16, NULL, NULL},
                         {1, 0, v, c, n, 1.0f, dw_beta, logits, x, dw, 1, NULL, NULL, NULL}};
    be->gemm_grouped(be, 2, g);
}

// g = g gscale (rounded); m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2; p -= lr (mhat / (sqrt(vhat) + eps) + wd p)
// with mhat = m / (1 - b1^step), vhat = v / (1 - b2^step); the decay uses the old p. p16: the
// new p in bf16 too.
static void cpu_adamw(lb_backend *be, const lb_adamw_args *args)
{
    float *p = args->p;
    const float *g = args->g;
    float gscale = args->gscale;
    float *m = args->m, *v = args->v;
    uint16_t *p16 = args->p16;
    size_t n = args->n;
    float lr = args->lr, beta1 = args->beta1, beta2 = args->beta2, eps = args->eps, wd = args->wd;
    int step = args->step;
    if (step < 1) lb_die("adamw: step %d, steps count from 1", step);
    float bc1 = (float)(1.0 - pow((double)beta1, step));
    float bc2 = (float)(1.0 - pow((double)beta2, step));
    #pragma omp parallel for num_threads(lb_cpu_threads(be)) if (n >= LB_CPU_PAR_MIN)
    for (size_t i = 0; i < n; i++) {
        float gi = g[i] * gscale;
        float mi = beta1 * m[i] + (1.0f - beta1) * gi;
        float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        float mhat = mi / bc1, vhat = vi / bc2;
        p[i] -= lr * (mhat / (sqrtf(vhat) + eps) + wd * p[i]);
        if (p16) p16[i] = lb_f32_to_bf16(p[i]);
    }
}

static void cpu_adamw16(lb_backend *be, const lb_adamw_args *args)
{
    float *p = args->p;
    const float *g = args->g;
    float gscale = args->gscale;
    uint16_t *m16 = args->m16, *v16 = args->v16, *p16 = args->p16;
    size_t n = args->n;
    float lr = args->lr, beta1 = args->beta1, beta2 = args->beta2, eps = args->eps, wd = args->wd;
    int step = args->step;
    if (step < 1) lb_die("adamw16: step %d, steps count from 1", step);
    float bc1 = (float)(1.0 - pow((double)beta1, step));
    float bc2 = (float)(1.0 - pow((double)beta2, step));
    #pragma omp parallel for num_threads(lb_cpu_threads(be)) if (n >= LB_CPU_PAR_MIN)
    for (size_t i = 0; i < n; i++) {   // cpu_adamw's expressions, on the widened moments
        float gi = g[i] * gscale;
        float mi = beta1 * lb_bf16_to_f32(m16[i]) + (1.0f - beta1) * gi;
        float vi = beta2 * lb_bf16_to_f32(v16[i]) + (1.0f - beta2) * gi * gi;
        m16[i] = lb_f32_to_bf16(mi);
        v16[i] = lb_f32_to_bf16(vi);
        float mhat = mi / bc1, vhat = vi / bc2;
        p[i] -= lr * (mhat / (sqrtf(vhat) + eps) + wd * p[i]);
        if (p16) p16[i] = lb_f32_to_bf16(p[i]);
    }
}

void lb_cpu_init_optim(lb_backend *be)
{
    be->cross_entropy_fwd = cpu_cross_entropy_fwd;
    be->cross_entropy_fwd16 = cpu_cross_entropy_fwd16;
    be->cross_entropy_bwd = cpu_cross_entropy_bwd;
    be->cross_entropy_bwd_rows = cpu_cross_entropy_bwd_rows;
    be->linear_ce_bwd = cpu_linear_ce_bwd;
    be->adamw = cpu_adamw;
    be->adamw16 = cpu_adamw16;
}
