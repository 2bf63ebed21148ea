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
    double seconds[LB_OP_COUNT], host[LB_OP_COUNT];
    long calls[LB_OP_COUNT];
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

// A wrapper's start: *be, the profiled backend, becomes the wrapped one, ready for the call;
// returns the profiled one.
static lb_backend *enter(lb_backend **be, double *t0)
{
    lb_backend *outer = *be;
    *be = inner(outer, t0);
    return outer;
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

// Charges the time since t0 to the shape key names (see LB_PROFILE_SHAPES).
static void charge_shape(lb_backend *be, double t0, const char *key)
{
    const double seconds = now() - t0;
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

// A shape key, made by shape_<op> from the operation's arguments.
typedef struct {
    char s[80];
} shape_key;

static shape_key keyf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static shape_key keyf(const char *fmt, ...)
{
    shape_key k;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(k.s, sizeof k.s, fmt, ap);
    va_end(ap);
    return k;
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

// Per-operation variations, chosen by name while the wrappers are generated: IS(KIND, op) is
// 1 where KIND_op is defined as "~, 1" below, else 0 (the preprocessor's detection idiom).
#define IS(kind, op) SECOND_(kind##_##op, 0, ~)
#define SECOND_(...) SECOND(__VA_ARGS__)
#define SECOND(a, b, ...) b
#define CAT(a, b) CAT_(a, b)
#define CAT_(a, b) a##b

// The entries that return a value.
#define RETURNS_alloc ~, 1
#define RETURNS_host_alloc ~, 1
#define RETURNS_sumsq ~, 1

// The GEMMs and quantizations, charged by shape too: shape_<op> has the operation's
// parameters (their types as LB_OPS gives them: the declarations below check it).
#define SHAPED_gemm ~, 1
#define SHAPED_gemm_grouped ~, 1
#define SHAPED_quantize ~, 1
#define SHAPED_quantize_grouped ~, 1
#define SHAPED_quantize_rc ~, 1
#define SHAPED_quantize_rt ~, 1
#define SHAPED_gemm_q ~, 1
#define SHAPED_gemm_q_grouped ~, 1
#define SHAPED_linear_ce_bwd ~, 1

#define DECLARE_SHAPE0(name, params)
#define DECLARE_SHAPE1(name, params) static shape_key shape_##name params;
#define X(ret, name, params, args) CAT(DECLARE_SHAPE, IS(SHAPED, name))(name, params)
LB_OPS_MEMORY(X) LB_OPS_COMPUTE(X)
#undef X

static shape_key shape_gemm(lb_backend *be, const lb_gemm_args *g)
{
    return keyf("gemm %dx%dx%d%s", g->m, g->n, g->k, g->bf16 ? " bf16" : "");
}
static shape_key shape_gemm_grouped(lb_backend *be, int count, const lb_gemm_args *g)
{
    return keyf("gemm_grouped %d x (n %d, %s)%s", count, count ? g->n : 0,
                group_k((char[32]){0}, count, &g->k, sizeof *g),
                count && g->bf16 ? " bf16" : "");
}
static const char *act_type(lb_act x) { return x.type == LB_ACT_BF16 ? " from bf16" : ""; }
static shape_key shape_quantize(lb_backend *be, struct lb_qmat *q, lb_act x,
                                const struct lb_quant_args *a)
{
    return keyf("quantize (%d, %d) %s%s", x.rows, x.cols, q->brows == 1 ? "1x" : "blocks",
                act_type(x));
}
static shape_key shape_quantize_grouped(lb_backend *be, int count, struct lb_qmat *q, lb_act x,
                                        const int *rows, const int *prows,
                                        const struct lb_quant_args *a)
{
    return keyf("quantize_grouped %d x (rows %s, %d) %s%s", count,
                group_k((char[32]){0}, count, rows, sizeof *rows) + 2, x.cols,
                count && q[0].brows == 1 ? "1x" : "blocks", act_type(x));
}
static shape_key shape_quantize_rc(lb_backend *be, struct lb_qmat *qr,
                                   const struct lb_quant_args *ar, int count, struct lb_qmat *qc,
                                   lb_act x, const int *rows, const int *prows,
                                   const struct lb_quant_args *ac)
{
    return keyf("quantize_rc %d x (rows %s, %d)%s", count,
                group_k((char[32]){0}, count, rows, sizeof *rows) + 2, x.cols, act_type(x));
}
static shape_key shape_quantize_rt(lb_backend *be, int count, struct lb_qmat *qr,
                                   struct lb_qmat *qc, const float *x, const int *rows, int cols,
                                   const struct lb_quant_args *a)
{
    return keyf("quantize_rt %d x (rows %s, %d)", count,
                group_k((char[32]){0}, count, rows, sizeof *rows) + 2, cols);
}
static shape_key shape_gemm_q(lb_backend *be, int m, int n, int k, float alpha,
                              const struct lb_qmat *a, const struct lb_qmat *b, float beta,
                              float *c)
{
    return keyf("gemm_q %dx%dx%d", m, n, k);
}
static shape_key shape_gemm_q_grouped(lb_backend *be, int count, const lb_gemm_q_args *g)
{
    return keyf("gemm_q_grouped %d x (n %d, %s) B %s", count, count ? g->n : 0,
                group_k((char[32]){0}, count, &g->k, sizeof *g),
                count && g->b->brows == 1 ? "1x" : "blocks");
}
static shape_key shape_linear_ce_bwd(lb_backend *be, const lb_linear_ce_args *a)
{
    return keyf("linear_ce_bwd %dx%dx%d bf16", a->n, a->v, a->c);
}

// The wrapper of each entry: the wrapped backend's entry between two syncs (be, the
// parameter the call's arguments name, becomes the wrapped backend: enter), its time charged
// to the operation and, for the SHAPED, to the call's shape.
#define CHARGE_SHAPE0(name, args)
#define CHARGE_SHAPE1(name, args) charge_shape(outer, t0, shape_##name args.s);
#define WRAP0(ret, name, params, args)                                                        \
    static ret w_##name params                                                                \
    {                                                                                         \
        double t0;                                                                            \
        lb_backend *outer = enter(&be, &t0);                                                  \
        be->name args;                                                                        \
        charge(outer, LB_OP_##name, t0);                                                      \
        CAT(CHARGE_SHAPE, IS(SHAPED, name))(name, args)                                       \
    }
#define WRAP1(ret, name, params, args)                                                        \
    static ret w_##name params                                                                \
    {                                                                                         \
        double t0;                                                                            \
        lb_backend *outer = enter(&be, &t0);                                                  \
        ret r = be->name args;                                                                \
        return charge(outer, LB_OP_##name, t0), r;                                            \
    }
#define X(ret, name, params, args) CAT(WRAP, IS(RETURNS, name))(ret, name, params, args)
LB_OPS_MEMORY(X) LB_OPS_COMPUTE(X)
#undef X

static void w_sync(lb_backend *be) { ((prof *)be->ctx)->in->sync(((prof *)be->ctx)->in); }
static size_t w_mem_free(lb_backend *be)
{
    return ((prof *)be->ctx)->in->mem_free(((prof *)be->ctx)->in);
}


static void print_table(lb_backend *be, FILE *f)
{
    prof *p = be->ctx;
    int order[LB_OP_COUNT];
    double total = 0.0;
    for (int i = 0; i < LB_OP_COUNT; i++) {
        order[i] = i;
        total += p->seconds[i];
    }
    for (int i = 1; i < LB_OP_COUNT; i++)   // insertion sort by decreasing time (60 entries)
        for (int j = i; j > 0 && p->seconds[order[j]] > p->seconds[order[j - 1]]; j--) {
            int t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    fprintf(f, "lowbit profile (LB_PROFILE, %s backend, a sync around every operation): %.3f s\n"
               "  %-24s %10s %12s %7s %10s\n", p->in->name, total, "operation", "calls", "ms",
            "share", "host ms");
    for (int i = 0; i < LB_OP_COUNT; i++) {
        int o = order[i];
        if (!p->calls[o]) continue;
        fprintf(f, "  %-24s %10ld %12.3f %6.1f%% %10.3f\n", lb_op_name(o), p->calls[o],
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
    // Only the entries the wrapped backend has: the others still say what it lacks.
#define X(ret, name, params, args) \
    if (lb_backend_supports(in, LB_OP_##name)) be->name = w_##name;
    LB_OPS_MEMORY(X) LB_OPS_COMPUTE(X)
#undef X
    be->sync = w_sync;
    be->mem_free = w_mem_free;
    be->destroy = w_destroy;
    return be;
}
