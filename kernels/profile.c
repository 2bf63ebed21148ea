// profile.c: a backend that times another one, operation by operation (LB_PROFILE=1).
//
// Every entry of the table calls the same entry of the wrapped backend between two syncs, so
// the time of queued device work is charged to the operation that queued it (the device runs
// one stream in order anyway; the syncs remove only the overlap of host and device). The
// "host" column is the part spent before the entry returned, the device idle until its first
// launch: in an unprofiled run that part overlaps earlier device work wherever the host runs
// ahead (a grouped GEMM's tensor maps, cuBLASLt's plans), so an operation's device time is at
// least its total minus its host part. destroy prints the operations by total time to
// stderr. Results are those of the wrapped backend, bit for bit: the wrapper only forwards.
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "kernels/common.h"
#include "kernels/kernels.h"
#include "kernels/quant/quant.h"

#define LB_PROFILE_OPS(X)                                                                     \
    X(alloc) X(free) X(upload) X(download) X(copy) X(zero) X(gemm) X(gemm_grouped)            \
    X(qmat_alloc) X(qmat_free) X(quantize) X(quantize_grouped) X(quantize_rc)                 \
    X(qmat_transpose) X(quantize_rt) X(dequantize) X(gemm_q) X(gemm_q_grouped) X(hadamard)    \
    X(round_bf16) X(to_bf16)                                                                  \
    X(add) X(scale) X(sumsq) X(embedding_fwd) X(embedding_bwd) X(rmsnorm_fwd) X(rmsnorm_bwd)  \
    X(rope_fwd) X(rope_bwd) X(attention_fwd) X(attention_bwd) X(kv_append)                    \
    X(attention_cached) X(swiglu_fwd) X(swiglu_bwd) X(router_topk_fwd) X(router_topk_bwd)     \
    X(moe_aux_loss) X(moe_plan) X(moe_permute) X(moe_permute_bwd) X(moe_combine)              \
    X(moe_combine_bwd) X(cross_entropy_fwd) X(cross_entropy_bwd) X(cross_entropy_bwd_rows)    \
    X(linear_ce_bwd) X(adamw) X(adamw16) X(sample)

enum {
#define X(name) OP_##name,
    LB_PROFILE_OPS(X)
#undef X
    OP_COUNT
};

static const char *const op_name[OP_COUNT] = {
#define X(name) #name,
    LB_PROFILE_OPS(X)
#undef X
};

// The GEMMs and quantizations are also charged by shape (the same operation serves several
// passes of a layer, at very different speeds): up to LB_PROFILE_SHAPES keys, the rest as one.
#define LB_PROFILE_SHAPES 64

typedef struct {
    char key[80];
    double seconds, host;
    long calls;
} shape_row;

typedef struct {
    lb_backend *in;
    double seconds[OP_COUNT], host[OP_COUNT];
    long calls[OP_COUNT];
    double last_host;   // the host part of the latest charge, for its shape
    shape_row shape[LB_PROFILE_SHAPES + 1];   // the last: every key that found no room
    int nshape;
} prof;

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

// The wrapped backend, ready for a call: its queue drained, the caller's mode passed on.
static lb_backend *inner(lb_backend *be, double *t0)
{
    lb_backend *in = ((prof *)be->ctx)->in;
    in->deterministic = be->deterministic;
    in->sync(in);
    *t0 = now();
    return in;
}

static void charge(lb_backend *be, int op, double t0)
{
    prof *p = be->ctx;
    p->last_host = now() - t0;
    p->host[op] += p->last_host;
    p->in->sync(p->in);
    p->seconds[op] += now() - t0;
    p->calls[op]++;
}

// Charges the time since t0 to the shape the format names (see LB_PROFILE_SHAPES).
static void charge_shapef(lb_backend *be, double t0, const char *fmt, ...)
{
    const double seconds = now() - t0;
    char key[80];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(key, sizeof key, fmt, ap);
    va_end(ap);
    prof *p = be->ctx;
    int i = 0;
    while (i < p->nshape && strcmp(p->shape[i].key, key)) i++;
    if (i == p->nshape) {
        if (p->nshape == LB_PROFILE_SHAPES) {
            i = LB_PROFILE_SHAPES;
            snprintf(p->shape[i].key, sizeof p->shape[i].key, "(other shapes)");
        } else {
            snprintf(p->shape[i].key, sizeof p->shape[i].key, "%s", key);
            p->nshape++;
        }
    }
    p->shape[i].seconds += seconds;
    p->shape[i].host += p->last_host;
    p->shape[i].calls++;
}

// k of groups g[0 .. count) into buf (32 bytes) as "k N", or "k ~N" (their mean) where they
// differ (the wgrad's tokens per expert); returns buf.
static char *group_k(char *buf, int count, const int *k, size_t stride)
{
    long sum = 0;
    int same = 1;
    for (int i = 0; i < count; i++) {
        int ki = *(const int *)((const char *)k + i * stride);
        sum += ki;
        same &= ki == *k;
    }
    snprintf(buf, 32, "k %s%ld", same ? "" : "~", count ? sum / count : 0);
    return buf;
}

// A wrapper for each entry: W(name, (parameters), (arguments after the backend)); WS also
// charges the shape that SHAPE, a parenthesised charge_shapef call, names.
#define WS(name, PARAMS, ARGS, SHAPE)                                                         \
    static void w_##name PARAMS                                                               \
    {                                                                                         \
        double t0;                                                                            \
        lb_backend *in = inner(be, &t0);                                                      \
        in->name ARGS;                                                                        \
        charge(be, OP_##name, t0);                                                            \
        SHAPE;                                                                                \
    }
#define W(name, PARAMS, ARGS) WS(name, PARAMS, ARGS, (void)0)

static void *w_alloc(lb_backend *be, size_t bytes)
{
    double t0;
    lb_backend *in = inner(be, &t0);
    void *p = in->alloc(in, bytes);
    charge(be, OP_alloc, t0);
    return p;
}

static double w_sumsq(lb_backend *be, const float *x, size_t n)
{
    double t0;
    lb_backend *in = inner(be, &t0);
    double s = in->sumsq(in, x, n);
    charge(be, OP_sumsq, t0);
    return s;
}

W(free, (lb_backend *be, void *p), (in, p))
W(upload, (lb_backend *be, void *d, const void *s, size_t n), (in, d, s, n))
W(download, (lb_backend *be, void *d, const void *s, size_t n), (in, d, s, n))
W(copy, (lb_backend *be, void *d, const void *s, size_t n), (in, d, s, n))
W(zero, (lb_backend *be, void *p, size_t n), (in, p, n))
WS(gemm, (lb_backend *be, const lb_gemm_args *g), (in, g),
   (charge_shapef(be, t0, "gemm %dx%dx%d%s", g->m, g->n, g->k, g->bf16 ? " bf16" : "")))
WS(gemm_grouped, (lb_backend *be, int count, const lb_gemm_args *g), (in, count, g),
   (charge_shapef(be, t0, "gemm_grouped %d x (n %d, %s)%s", count, count ? g->n : 0,
                  group_k((char[32]){0}, count, &g->k, sizeof *g),
                  count && g->bf16 ? " bf16" : "")))
W(qmat_alloc, (lb_backend *be, struct lb_qmat *q, int r, int c, const struct lb_quant_args *a),
  (in, q, r, c, a))
W(qmat_free, (lb_backend *be, struct lb_qmat *q), (in, q))
WS(quantize,
   (lb_backend *be, struct lb_qmat *q, const float *x, int r, int c, const struct lb_quant_args *a),
   (in, q, x, r, c, a),
   (charge_shapef(be, t0, "quantize (%d, %d) %s", r, c, q->brows == 1 ? "1x" : "blocks")))
WS(quantize_grouped,
   (lb_backend *be, int count, struct lb_qmat *q, const float *x, const int *rows,
    const int *prows, int cols, const struct lb_quant_args *a),
   (in, count, q, x, rows, prows, cols, a),
   (charge_shapef(be, t0, "quantize_grouped %d x (rows %s, %d) %s", count,
                  group_k((char[32]){0}, count, rows, sizeof *rows) + 2, cols,
                  count && q[0].brows == 1 ? "1x" : "blocks")))
WS(quantize_rc,
   (lb_backend *be, struct lb_qmat *qr, const struct lb_quant_args *ar, int count,
    struct lb_qmat *qc, const float *x, const int *rows, const int *prows, int cols,
    const struct lb_quant_args *ac),
   (in, qr, ar, count, qc, x, rows, prows, cols, ac),
   (charge_shapef(be, t0, "quantize_rc %d x (rows %s, %d)", count,
                  group_k((char[32]){0}, count, rows, sizeof *rows) + 2, cols)))
W(qmat_transpose, (lb_backend *be, int count, struct lb_qmat *d, const struct lb_qmat *s),
  (in, count, d, s))
WS(quantize_rt,
   (lb_backend *be, int count, struct lb_qmat *qr, struct lb_qmat *qc, const float *x,
    const int *rows, int cols, const struct lb_quant_args *a),
   (in, count, qr, qc, x, rows, cols, a),
   (charge_shapef(be, t0, "quantize_rt %d x (rows %s, %d)", count,
                  group_k((char[32]){0}, count, rows, sizeof *rows) + 2, cols)))
W(dequantize, (lb_backend *be, float *y, const struct lb_qmat *q), (in, y, q))
WS(gemm_q,
   (lb_backend *be, int m, int n, int k, float alpha, const struct lb_qmat *a,
    const struct lb_qmat *b, float beta, float *c),
   (in, m, n, k, alpha, a, b, beta, c), (charge_shapef(be, t0, "gemm_q %dx%dx%d", m, n, k)))
WS(gemm_q_grouped, (lb_backend *be, int count, const lb_gemm_q_args *g), (in, count, g),
   (charge_shapef(be, t0, "gemm_q_grouped %d x (n %d, %s) B %s", count, count ? g->n : 0,
                  group_k((char[32]){0}, count, &g->k, sizeof *g),
                  count && g->b->brows == 1 ? "1x" : "blocks")))
W(hadamard,
  (lb_backend *be, float *y, const float *x, int rows, int cols, int axis, int hn, uint32_t s),
  (in, y, x, rows, cols, axis, hn, s))
W(round_bf16, (lb_backend *be, float *y, const float *x, size_t n), (in, y, x, n))
W(to_bf16, (lb_backend *be, uint16_t *y, const float *x, size_t rows, int cols, int ld),
  (in, y, x, rows, cols, ld))
W(add, (lb_backend *be, float *y, const float *x, size_t n), (in, y, x, n))
W(scale, (lb_backend *be, float *x, float s, size_t n), (in, x, s, n))
W(embedding_fwd, (lb_backend *be, float *o, const int32_t *t, const float *w, int n, int c),
  (in, o, t, w, n, c))
W(embedding_bwd, (lb_backend *be, float *dw, const float *d, const int32_t *t, int n, int c),
  (in, dw, d, t, n, c))
W(rmsnorm_fwd,
  (lb_backend *be, float *o, float *r, const float *x, const float *w, int n, int c, float e),
  (in, o, r, x, w, n, c, e))
W(rmsnorm_bwd,
  (lb_backend *be, float *dx, float b, float *dw, const float *d, const float *x,
   const float *w, const float *r, int n, int c),
  (in, dx, b, dw, d, x, w, r, n, c))
W(rope_fwd, (lb_backend *be, float *x, const int32_t *p, int n, int h, int d, float th),
  (in, x, p, n, h, d, th))
W(rope_bwd, (lb_backend *be, float *x, const int32_t *p, int n, int h, int d, float th),
  (in, x, p, n, h, d, th))
W(attention_fwd,
  (lb_backend *be, float *o, float *l, const float *q, const float *k, const float *v, int b,
   int t, int hq, int hkv, int d, int bf16),
  (in, o, l, q, k, v, b, t, hq, hkv, d, bf16))
W(attention_bwd,
  (lb_backend *be, float *dq, float *dk, float *dv, const float *d, const float *q,
   const float *k, const float *v, const float *o, const float *l, int b, int t, int hq,
   int hkv, int dd, int bf16),
  (in, dq, dk, dv, d, q, k, v, o, l, b, t, hq, hkv, dd, bf16))
W(kv_append,
  (lb_backend *be, const lb_kv_layer *c, const float *k, const float *v,
   const struct lb_qmat *kq, const struct lb_qmat *vq, const int32_t *s, const int32_t *p, int n),
  (in, c, k, v, kq, vq, s, p, n))
W(attention_cached,
  (lb_backend *be, float *o, const float *q, const lb_kv_layer *c, const int32_t *s,
   const int32_t *p, int n, int hq, int bf16),
  (in, o, q, c, s, p, n, hq, bf16))
W(swiglu_fwd,
  (lb_backend *be, float *o, uint16_t *o16, const float *gu, const uint16_t *gu16, int n, int f),
  (in, o, o16, gu, gu16, n, f))
W(swiglu_bwd,
  (lb_backend *be, float *dgu, uint16_t *dgu16, const float *d, const uint16_t *d16,
   const float *gu, const uint16_t *gu16, int n, int f),
  (in, dgu, dgu16, d, d16, gu, gu16, n, f))
W(router_topk_fwd,
  (lb_backend *be, float *p, int32_t *i, float *w, const float *l, int n, int e, int k, int r),
  (in, p, i, w, l, n, e, k, r))
W(router_topk_bwd,
  (lb_backend *be, float *dl, const float *dw, const float *dp, const float *p, const int32_t *i,
   int n, int e, int k, int r),
  (in, dl, dw, dp, p, i, n, e, k, r))
W(moe_aux_loss,
  (lb_backend *be, float *l, float *dp, const float *p, const int32_t *i, int n, int e, int k),
  (in, l, dp, p, i, n, e, k))
W(moe_plan, (lb_backend *be, int32_t *r, int *c, const int32_t *i, int n, int e, int k),
  (in, r, c, i, n, e, k))
W(moe_permute,
  (lb_backend *be, float *xp, uint16_t *xp16, const float *x, const int32_t *r, int n, int k,
   int c),
  (in, xp, xp16, x, r, n, k, c))
W(moe_permute_bwd,
  (lb_backend *be, float *dx, const float *dxp, const uint16_t *dxp16, const int32_t *r, int n,
   int k, int c),
  (in, dx, dxp, dxp16, r, n, k, c))
W(moe_combine,
  (lb_backend *be, float *o, const float *yp, const uint16_t *yp16, const float *w,
   const int32_t *r, int n, int k, int c),
  (in, o, yp, yp16, w, r, n, k, c))
W(moe_combine_bwd,
  (lb_backend *be, float *dyp, uint16_t *dyp16, float *dw, const float *d, const float *yp,
   const uint16_t *yp16, const float *w, const int32_t *r, int n, int k, int c),
  (in, dyp, dyp16, dw, d, yp, yp16, w, r, n, k, c))
W(cross_entropy_fwd,
  (lb_backend *be, float *l, double *st, const float *lg, const int32_t *t, int n, int v),
  (in, l, st, lg, t, n, v))
W(cross_entropy_bwd,
  (lb_backend *be, float *d, const float *lg, const double *st, const int32_t *t, float dl,
   int n, int v),
  (in, d, lg, st, t, dl, n, v))
W(cross_entropy_bwd_rows,
  (lb_backend *be, float *d, const float *lg, const double *st, const int32_t *t,
   const float *dl, int n, int v),
  (in, d, lg, st, t, dl, n, v))
WS(linear_ce_bwd,
   (lb_backend *be, float *dx, float dxb, float *dw, float dwb, float *lg, const double *st,
    const int32_t *t, float dl, const float *x, const float *w, const uint16_t *w16, int n,
    int v, int c),
   (in, dx, dxb, dw, dwb, lg, st, t, dl, x, w, w16, n, v, c),
   (charge_shapef(be, t0, "linear_ce_bwd %dx%dx%d bf16", n, v, c)))
W(adamw,
  (lb_backend *be, float *p, const float *g, float gs, float *m, float *v, uint16_t *p16,
   size_t n, float lr, float b1, float b2, float eps, float wd, int step),
  (in, p, g, gs, m, v, p16, n, lr, b1, b2, eps, wd, step))
W(adamw16,
  (lb_backend *be, float *p, const float *g, float gs, uint16_t *m, uint16_t *v, uint16_t *p16,
   size_t n, float lr, float b1, float b2, float eps, float wd, int step),
  (in, p, g, gs, m, v, p16, n, lr, b1, b2, eps, wd, step))
W(sample, (lb_backend *be, const lb_sample_args *a), (in, a))
#undef W
#undef WS

static void w_sync(lb_backend *be) { ((prof *)be->ctx)->in->sync(((prof *)be->ctx)->in); }
static size_t w_mem_free(lb_backend *be)
{
    return ((prof *)be->ctx)->in->mem_free(((prof *)be->ctx)->in);
}


static void print_table(lb_backend *be, FILE *f)
{
    prof *p = be->ctx;
    int order[OP_COUNT];
    double total = 0.0;
    for (int i = 0; i < OP_COUNT; i++) {
        order[i] = i;
        total += p->seconds[i];
    }
    for (int i = 1; i < OP_COUNT; i++)   // insertion sort by decreasing time (40 entries)
        for (int j = i; j > 0 && p->seconds[order[j]] > p->seconds[order[j - 1]]; j--) {
            int t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    fprintf(f, "lowbit profile (LB_PROFILE, %s backend, a sync around every operation): %.3f s\n"
               "  %-24s %10s %12s %7s %10s\n", p->in->name, total, "operation", "calls", "ms",
            "share", "host ms");
    for (int i = 0; i < OP_COUNT; i++) {
        int o = order[i];
        if (!p->calls[o]) continue;
        fprintf(f, "  %-24s %10ld %12.3f %6.1f%% %10.3f\n", op_name[o], p->calls[o],
                p->seconds[o] * 1e3, total > 0 ? 100.0 * p->seconds[o] / total : 0.0,
                p->host[o] * 1e3);
    }
    const int n = p->nshape + (p->shape[LB_PROFILE_SHAPES].calls > 0);
    if (!n) return;
    int *by = lb_malloc((size_t)(LB_PROFILE_SHAPES + 1) * sizeof *by);
    for (int i = 0, j = 0; i <= LB_PROFILE_SHAPES; i++)
        if (i < p->nshape || (i == LB_PROFILE_SHAPES && p->shape[i].calls)) by[j++] = i;
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && p->shape[by[j]].seconds > p->shape[by[j - 1]].seconds; j--) {
            int t = by[j];
            by[j] = by[j - 1];
            by[j - 1] = t;
        }
    fprintf(f, "  by shape (GEMMs and quantizations; groups x (n, k), ~ a mean over them; "
               "calls, ms, host ms):\n");
    for (int i = 0; i < n; i++) {
        const shape_row *r = &p->shape[by[i]];
        fprintf(f, "    %-62s %6ld %10.3f %10.3f\n", r->key, r->calls, r->seconds * 1e3,
                r->host * 1e3);
    }
    free(by);
}

static void w_destroy(lb_backend *be)
{
    prof *p = be->ctx;
    print_table(be, stderr);
    p->in->destroy(p->in);
    free(p);
    free(be);
}

lb_backend *lb_backend_profiled(lb_backend *in)
{
    prof *p = lb_calloc(1, sizeof *p);
    p->in = in;
    lb_backend *be = lb_calloc(1, sizeof *be);
    *be = *in;   // name and mode; every entry is replaced below
    be->ctx = p;
#define X(name) be->name = w_##name;
    LB_PROFILE_OPS(X)
#undef X
    be->sync = w_sync;
    be->mem_free = w_mem_free;
    be->destroy = w_destroy;
    return be;
}
