// ops_attention.c: causal grouped-query attention, forward and backward, for the CPU reference.
//
// Layouts: q, out, dout, dq (b, t, hq, d); k, v, dk, dv (b, t, hkv, d); lse (b, hq, t).
// Query head h reads kv head h / (hq / hkv). Softmax scale 1/sqrt(d).
//
// One query row (b, h, i) is one task: its scores, softmax and output are computed by one thread
// in key order, in double, so a row never depends on the thread count or on the other sequences
// in the batch. The backward recomputes probabilities from the saved log-sum-exp (as flash
// attention does) and reduces dk/dv per key row, again one thread per row: no atomics.
//
// bf16 mode (kernels.h states the arithmetic) mirrors the tensor-core kernels' roundings: the
// inputs are rounded to bf16 once per call (an elementwise map, so it never changes a row's
// bits), then the same one-task-per-row structure runs the chunked base-2 online softmax.
#include "kernels/cpu/cpu.h"
#include "kernels/common.h"
#include "kernels/quant/quant.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

static double dot_f64(const float *a, const float *b, int d)
{
    double s = 0.0;
    for (int i = 0; i < d; i++) s += (double)a[i] * b[i];
    return s;
}

static void check_heads(const char *what, int b, int t, int hq, int hkv, int d)
{
    if (b < 0 || t < 0 || hq < 0 || hkv < 0 || d < 0)
        lb_die("%s: negative size (b %d, t %d, hq %d, hkv %d, d %d)", what, b, t, hq, hkv, d);
    if (hkv == 0 || hq % hkv)
        lb_die("%s: %d query heads are not a multiple of %d kv heads", what, hq, hkv);
}

// Row pointers into (b, t, heads, d) tensors; reads the caller's t and d.
#define ROW(base, bi, ti, h, heads) ((base) + (((size_t)(bi) * t + (ti)) * (heads) + (h)) * d)

// One query row qi (d) against keys and values 0..nk-1, row j at kb + j * stride and
// vb + j * stride: out (d) and the row's log-sum-exp. Every attention forward (training's and
// the KV cache's) calls this one function, so a query row gets the same bits whichever path
// computes it. s (nk) and acc (d) are the caller's scratch.
static void attn_row(float *oi, float *lse, const float *qi, const float *kb, const float *vb,
                     size_t stride, int nk, int d, double scale, double *s, double *acc)
{
    double m = -INFINITY;
    for (int j = 0; j < nk; j++) {
        s[j] = dot_f64(qi, kb + j * stride, d) * scale;
        if (s[j] > m) m = s[j];
    }
    double sum = 0.0;
    for (int x = 0; x < d; x++) acc[x] = 0.0;
    for (int j = 0; j < nk; j++) {
        double p = exp(s[j] - m);
        sum += p;
        const float *vj = vb + j * stride;
        for (int x = 0; x < d; x++) acc[x] += p * vj[x];
    }
    for (int x = 0; x < d; x++) oi[x] = (float)(acc[x] / sum);
    *lse = (float)(m + log(sum));
}

// --- bf16 mode ------------------------------------------------------------------------------

static const double LOG2E = 1.44269504088896340736, LN2 = 0.693147180559945309417;

// c = log2(e) / sqrt(d), formed in double and rounded once, as the tensor-core kernels take it.
static float attn_log2_scale(int d) { return (float)(LOG2E / sqrt((double)d)); }

// y (n) = bf16(x), or x16 widened where given (the same values when x16 holds bf16(x)), in
// parallel: elementwise, so the split never changes a value.
static float *round_copy(lb_backend *be, const float *x, const uint16_t *x16, size_t n)
{
    float *y = lb_malloc((n ? n : 1) * sizeof(float));
    #pragma omp parallel for schedule(static) num_threads(lb_cpu_threads(be)) \
        if (n > LB_CPU_PAR_MIN)
    for (size_t i = 0; i < n; i++) y[i] = x16 ? lb_bf16_to_f32(x16[i]) : lb_round_bf16(x[i]);
    return y;
}

// kernels.h: bf16 inputs (q16, k16, v16) in bf16 mode only.
static void check_inputs16(const char *what, const lb_attention_args *a)
{
    if (!a->bf16 && (a->q16 || a->k16 || a->v16 || a->out16))
        lb_die("%s: bf16 operands (q16, k16, v16, out16) are taken in bf16 mode only", what);
}

// Per-thread scratch of attn_row_bf16.
typedef struct {
    float x[LB_ATTN_CHUNK];   // one chunk's x_ij
    float *acc;               // (d) the output accumulator
    double *sum;              // (d) one chunk's sum of bf16(p) bf16(v)
} row_scratch;

static row_scratch row_scratch_new(int d)
{
    row_scratch r;
    r.acc = lb_malloc(((size_t)d + 1) * sizeof(float));
    r.sum = lb_malloc(((size_t)d + 1) * sizeof(double));
    return r;
}

static void row_scratch_free(row_scratch *r) { free(r->acc), free(r->sum); }

// attn_row in bf16 mode: qi (d), keys kb + j * stride and values vb + j * stride (j < nk) are
// already bf16 values. The base-2 online softmax over chunks of LB_ATTN_CHUNK keys aligned at
// position 0, in kernels.h's float operations. attention_fwd and attention_cached both call it,
// so a query row gets the same bits on either path.
static void attn_row_bf16(float *oi, float *lse, const float *qi, const float *kb,
                          const float *vb, size_t stride, int nk, int d, float c, row_scratch *w)
{
    float m = -INFINITY, l = 0.0f;
    for (int x = 0; x < d; x++) w->acc[x] = 0.0f;
    for (int j0 = 0; j0 < nk; j0 += LB_ATTN_CHUNK) {
        int n = nk - j0 < LB_ATTN_CHUNK ? nk - j0 : LB_ATTN_CHUNK;
        float mn = m;
        for (int j = 0; j < n; j++) {
            w->x[j] = (float)dot_f64(qi, kb + (j0 + j) * stride, d) * c;
            mn = fmaxf(mn, w->x[j]);
        }
        float alpha = exp2f(m - mn);   // 0 on the first chunk (m = -inf)
        double psum = 0.0;
        for (int x = 0; x < d; x++) w->sum[x] = 0.0;
        for (int j = 0; j < n; j++) {
            float p = exp2f(w->x[j] - mn);
            psum += p;
            double pb = lb_round_bf16(p);
            const float *vj = vb + (j0 + j) * stride;
            for (int x = 0; x < d; x++) w->sum[x] += pb * vj[x];   // exact products
        }
        l = l * alpha + (float)psum;   // two roundings, as the GPU's __fmul_rn, __fadd_rn
        for (int x = 0; x < d; x++) w->acc[x] = w->acc[x] * alpha + (float)w->sum[x];
        m = mn;
    }
    for (int x = 0; x < d; x++) oi[x] = w->acc[x] / l;
    *lse = (m + log2f(l)) * (float)LN2;
}

static void attention_fwd_bf16(lb_backend *be, const lb_attention_args *a)
{
    float *out = a->out, *lse = a->lse;
    int b = a->b, t = a->t, hq = a->hq, hkv = a->hkv, d = a->d;
    int group = hq / hkv;
    float c = attn_log2_scale(d);
    long rows = (long)b * hq * t;
    size_t nq = (size_t)rows * d, nk = (size_t)b * t * hkv * d;
    float *qb = round_copy(be, a->q, a->q16, nq), *kb = round_copy(be, a->k, a->k16, nk);
    float *vb = round_copy(be, a->v, a->v16, nk);
    #pragma omp parallel num_threads(lb_cpu_threads(be)) if (rows > 1)
    {
        row_scratch w = row_scratch_new(d);
        float *o = lb_malloc(((size_t)d + 1) * sizeof(float));   // a row's out (out16)
        #pragma omp for schedule(dynamic, 4)
        for (long r = 0; r < rows; r++) {
            int bi = (int)(r / ((long)hq * t)), h = (int)(r / t % hq), i = (int)(r % t);
            int hk = h / group;
            float *oi = a->out16 ? o : ROW(out, bi, i, h, hq);
            attn_row_bf16(oi, &lse[((size_t)bi * hq + h) * t + i], ROW(qb, bi, i, h, hq),
                          ROW(kb, bi, 0, hk, hkv), ROW(vb, bi, 0, hk, hkv), (size_t)hkv * d,
                          i + 1, d, c, &w);
            if (!a->out16) continue;
            uint16_t *o16 = ROW(a->out16, bi, i, h, hq);
            for (int x = 0; x < d; x++) o16[x] = lb_f32_to_bf16(oi[x]);
        }
        free(o);
        row_scratch_free(&w);
    }
    free(qb), free(kb), free(vb);
}

// --- the table's entries: fp32 mode, or the bf16 functions above (the backward does both) ---------------------------

static void cpu_attention_fwd(lb_backend *be, const lb_attention_args *args)
{
    float *out = args->out, *lse = args->lse;
    const float *q = args->q, *k = args->k, *v = args->v;
    int b = args->b, t = args->t, hq = args->hq, hkv = args->hkv, d = args->d, bf16 = args->bf16;
    check_heads("attention_fwd", b, t, hq, hkv, d);
    check_inputs16("attention_fwd", args);
    if (bf16) {
        attention_fwd_bf16(be, args);
        return;
    }
    int group = hq / hkv;
    double scale = 1.0 / sqrt((double)d);
    long rows = (long)b * hq * t;
    #pragma omp parallel num_threads(lb_cpu_threads(be)) if (rows > 1)
    {
        double *s = lb_malloc(((size_t)t + d) * sizeof(double));   // scores (t), acc (d)
        double *acc = s + t;
        // Causal rows differ in length; dynamic scheduling balances them without changing
        // any row's arithmetic.
        #pragma omp for schedule(dynamic, 4)
        for (long r = 0; r < rows; r++) {
            int bi = (int)(r / ((long)hq * t)), h = (int)(r / t % hq), i = (int)(r % t);
            int hk = h / group;
            attn_row(ROW(out, bi, i, h, hq), &lse[((size_t)bi * hq + h) * t + i],
                     ROW(q, bi, i, h, hq), ROW(k, bi, 0, hk, hkv), ROW(v, bi, 0, hk, hkv),
                     (size_t)hkv * d, i + 1, d, scale, s, acc);
        }
        free(s);
    }
}

// p_ij and ds_ij of one (query i, key j) pair, as the backward's products use them. fp32 mode:
// in double. bf16 mode (kernels.h): float operations on bf16 inputs, and both rounded to bf16,
// the tensor cores' operands. Both passes call it, so they see the same numbers.
static inline void bwd_pair(int bf16, double *ds, double *p, const float *qi, const float *kj,
                            const float *gi, const float *vj, int d, double scale, float c,
                            float lse, double D)
{
    if (!bf16) {
        *p = exp(dot_f64(qi, kj, d) * scale - (double)lse);
        *ds = *p * (dot_f64(gi, vj, d) - D);
        return;
    }
    float lse2 = lse * (float)LOG2E;
    float x = (float)dot_f64(qi, kj, d) * c;
    float pf = exp2f(x - lse2);
    float dp = (float)dot_f64(gi, vj, d);
    float dsf = pf * (dp - (float)D);
    *p = lb_round_bf16(pf);
    *ds = lb_round_bf16(dsf);
}

// With P_ij = exp(S_ij - lse_i), S_ij = scale q_i.k_j (j <= i), D_i = dout_i.out_i:
//   dP_ij = dout_i.v_j;  dS_ij = P_ij (dP_ij - D_i)
//   dq_i = scale sum_j dS_ij k_j;  dk_j = scale sum_{h,i} dS_ij q_i;  dv_j = sum_{h,i} P_ij dout_i
// Two passes: one thread per query row for dq, one thread per key row for dk and dv (summing
// the group's query heads, then queries, in order). The scores are recomputed in each pass by
// the same expression (bwd_pair), so both passes see identical probabilities. bf16 mode reads
// q, k, v and dout rounded to bf16 (D from dout as it is and out or out16, rounded to float).
static void cpu_attention_bwd(lb_backend *be, const lb_attention_args *args)
{
    float *dq = args->dq, *dk = args->dk, *dv = args->dv;
    const float *dout = args->dout, *q = args->q, *k = args->k, *v = args->v, *out = args->out,
                *lse = args->lse;
    int b = args->b, t = args->t, hq = args->hq, hkv = args->hkv, d = args->d, bf16 = args->bf16;
    check_heads("attention_bwd", b, t, hq, hkv, d);
    check_inputs16("attention_bwd", args);
    int group = hq / hkv;
    double scale = 1.0 / sqrt((double)d);
    float c = attn_log2_scale(d);
    int nt = lb_cpu_threads(be);
    long qrows = (long)b * hq * t, krows = (long)b * hkv * t;
    size_t nq = (size_t)qrows * d, nk = (size_t)krows * d;
    float *qr = NULL, *kr = NULL, *vr = NULL, *gr = NULL;
    const float *qx = q, *kx = k, *vx = v, *gx = dout;   // the products' inputs
    if (bf16) {
        qx = qr = round_copy(be, q, args->q16, nq), kx = kr = round_copy(be, k, args->k16, nk);
        vx = vr = round_copy(be, v, args->v16, nk), gx = gr = round_copy(be, dout, NULL, nq);
    }
    double *D = lb_malloc(((size_t)qrows + 1) * sizeof(double));   // (b, hq, t)

    #pragma omp parallel num_threads(nt) if (qrows > 1)
    {
        double *acc = lb_malloc(((size_t)d + 1) * sizeof(double));
        #pragma omp for
        for (long r = 0; r < qrows; r++) {
            int bi = (int)(r / ((long)hq * t)), h = (int)(r / t % hq), i = (int)(r % t);
            if (args->out16) {
                const float *gi = ROW(dout, bi, i, h, hq);
                const uint16_t *oi = ROW(args->out16, bi, i, h, hq);
                double s = 0.0;
                for (int x = 0; x < d; x++) s += (double)gi[x] * lb_bf16_to_f32(oi[x]);
                D[r] = s;
            } else {
                D[r] = dot_f64(ROW(dout, bi, i, h, hq), ROW(out, bi, i, h, hq), d);
            }
            if (bf16) D[r] = (float)D[r];
        }
        // dq: one query row per task.
        #pragma omp for schedule(dynamic, 4)
        for (long r = 0; r < qrows; r++) {
            int bi = (int)(r / ((long)hq * t)), h = (int)(r / t % hq), i = (int)(r % t);
            int hk = h / group;
            const float *qi = ROW(qx, bi, i, h, hq), *gi = ROW(gx, bi, i, h, hq);
            for (int x = 0; x < d; x++) acc[x] = 0.0;
            for (int j = 0; j <= i; j++) {
                const float *kj = ROW(kx, bi, j, hk, hkv);
                double ds, p;
                bwd_pair(bf16, &ds, &p, qi, kj, gi, ROW(vx, bi, j, hk, hkv), d, scale, c, lse[r],
                         D[r]);
                for (int x = 0; x < d; x++) acc[x] += ds * kj[x];
            }
            float *dqi = ROW(dq, bi, i, h, hq);
            for (int x = 0; x < d; x++) dqi[x] = (float)(acc[x] * scale);
        }
        free(acc);
    }

    #pragma omp parallel num_threads(nt) if (krows > 1)
    {
        double *acc = lb_malloc(((size_t)2 * d + 1) * sizeof(double));   // dk (d), dv (d)
        #pragma omp for schedule(dynamic, 4)
        for (long r = 0; r < krows; r++) {
            int bi = (int)(r / ((long)hkv * t)), hk = (int)(r / t % hkv), j = (int)(r % t);
            const float *kj = ROW(kx, bi, j, hk, hkv), *vj = ROW(vx, bi, j, hk, hkv);
            for (int x = 0; x < 2 * d; x++) acc[x] = 0.0;
            for (int h = hk * group; h < (hk + 1) * group; h++) {
                size_t lrow = ((size_t)bi * hq + h) * t;
                for (int i = j; i < t; i++) {
                    const float *qi = ROW(qx, bi, i, h, hq), *gi = ROW(gx, bi, i, h, hq);
                    double ds, p;
                    bwd_pair(bf16, &ds, &p, qi, kj, gi, vj, d, scale, c, lse[lrow + i],
                             D[lrow + i]);
                    for (int x = 0; x < d; x++) {
                        acc[x] += ds * qi[x];
                        acc[d + x] += p * gi[x];
                    }
                }
            }
            float *dkj = ROW(dk, bi, j, hk, hkv), *dvj = ROW(dv, bi, j, hk, hkv);
            for (int x = 0; x < d; x++) {
                dkj[x] = (float)(acc[x] * scale);
                dvj[x] = (float)acc[d + x];
            }
        }
        free(acc);
    }
    free(D), free(qr), free(kr), free(vr), free(gr);
}

// --- KV cache ------------------------------------------------------------------------------

static void check_cache_rows(const char *what, const lb_kv_layer *c, const int32_t *slot,
                             const int32_t *pos, int n)
{
    if (n < 0) lb_die("%s: negative row count %d", what, n);
    for (int i = 0; i < n; i++)
        if (slot[i] < 0 || slot[i] >= c->slots || pos[i] < 0 || pos[i] >= c->cap)
            lb_die("%s: row %d at (slot %d, position %d) is outside the cache (%d slots of %d "
                   "positions)", what, i, slot[i], pos[i], c->slots, c->cap);
}

static int kv_blocks(int d) { return (d + 127) / 128; }   // fp8-block scales per row

// Element offset of row (slot, head, pos) in (slots, hkv, cap, width) storage.
static size_t kv_off(const lb_kv_layer *c, int slot, int pos, int h, int width)
{
    return lb_kv_row(c, slot, h, pos) * width;
}

static void check_kv_qmat(const char *what, const struct lb_qmat *q, int n, const lb_kv_layer *c)
{
    if (!q || q->fmt != LB_FMT_FP8_BLOCK || q->elem != LB_E4M3 || q->brows != 1 ||
        q->bcols != 128 || q->rows != n * c->hkv || q->cols != c->d)
        lb_die("%s: an fp8 cache takes row-wise fp8-block (1x128) quantizations of (%d, %d)",
               what, n * c->hkv, c->d);
}

static void cpu_kv_append(lb_backend *be, const lb_kv_layer *c, const float *k, const float *v,
                          const struct lb_qmat *kq, const struct lb_qmat *vq, const int32_t *slot,
                          const int32_t *pos, int n)
{
    check_cache_rows("kv_append", c, slot, pos, n);
    int d = c->d, hkv = c->hkv;
    if (c->fp8) {
        check_kv_qmat("kv_append", kq, n, c);
        check_kv_qmat("kv_append", vq, n, c);
        int nb = kv_blocks(d);
        for (int i = 0; i < n; i++)
            for (int h = 0; h < hkv; h++) {
                size_t r = (size_t)i * hkv + h;
                memcpy((uint8_t *)c->k + kv_off(c, slot[i], pos[i], h, d), kq->data + r * kq->ld,
                       (size_t)d);
                memcpy((uint8_t *)c->v + kv_off(c, slot[i], pos[i], h, d), vq->data + r * vq->ld,
                       (size_t)d);
                memcpy(c->ks + kv_off(c, slot[i], pos[i], h, nb),
                       (const float *)kq->scale + r * nb, nb * sizeof(float));
                memcpy(c->vs + kv_off(c, slot[i], pos[i], h, nb),
                       (const float *)vq->scale + r * nb, nb * sizeof(float));
            }
        return;
    }
    int ld = lb_kv_ld(c);
    for (int i = 0; i < n; i++)
        for (int h = 0; h < hkv; h++) {
            const float *ki = k + ((size_t)i * hkv + h) * d, *vi = v + ((size_t)i * hkv + h) * d;
            size_t o = kv_off(c, slot[i], pos[i], h, ld);
            if (c->bf16) {   // rounded once here, as the bf16-mode attention would round them
                uint16_t *kr = (uint16_t *)c->k + o, *vr = (uint16_t *)c->v + o;
                for (int x = 0; x < ld; x++) {
                    kr[x] = x < d ? lb_f32_to_bf16(ki[x]) : 0;
                    vr[x] = x < d ? lb_f32_to_bf16(vi[x]) : 0;
                }
            } else {
                memcpy((float *)c->k + o, ki, (size_t)d * sizeof(float));
                memcpy((float *)c->v + o, vi, (size_t)d * sizeof(float));
            }
        }
}

// fp8 rows back to fp32 with lb_dequantize's expression (E4M3 value times the block scale),
// so the cache reads exactly what the training forward's quantize + dequantize produced.
static void kv_dequant_rows(float *y, const uint8_t *codes, const float *scales, int nk,
                            size_t stride, size_t sstride, int d)
{
    for (int j = 0; j < nk; j++)
        for (int x = 0; x < d; x++)
            y[(size_t)j * d + x] =
                lb_decode(LB_E4M3, codes[j * stride + x]) * scales[j * sstride + x / 128];
}

// bf16 mode: the row's keys and values (nk, d), fp32 cache rows or the fp8 ones already
// dequantized (both at stride d), rounded to bf16 in place or into kd, vd.
static void kv_round_rows(float *kd, float *vd, const float *k, const float *v, int nk, int d)
{
    for (size_t e = 0; e < (size_t)nk * d; e++) {
        kd[e] = lb_round_bf16(k[e]);
        vd[e] = lb_round_bf16(v[e]);
    }
}

// A bf16 cache's rows (nk, ld) as floats (nk, d): exact.
static void kv_widen_rows(float *y, const uint16_t *x, int nk, int ld, int d)
{
    for (int j = 0; j < nk; j++)
        for (int e = 0; e < d; e++) y[(size_t)j * d + e] = lb_bf16_to_f32(x[(size_t)j * ld + e]);
}

static void cpu_attention_cached(lb_backend *be, float *out, const float *q, const lb_kv_layer *c,
                                 const int32_t *slot, const int32_t *pos, int n, int hq, int bf16)
{
    int d = c->d, hkv = c->hkv, cap = c->cap, ld = lb_kv_ld(c);
    check_heads("attention_cached", 1, 1, hq, hkv, d);
    check_cache_rows("attention_cached", c, slot, pos, n);
    if (c->bf16 && !bf16) lb_die("attention_cached: a bf16 cache is read in bf16 mode only");
    int group = hq / hkv, nb = kv_blocks(d);
    double scale = 1.0 / sqrt((double)d);
    float c2 = attn_log2_scale(d);
    long rows = (long)n * hq;
    #pragma omp parallel num_threads(lb_cpu_threads(be)) if (rows > 1)
    {
        // scores (cap), acc (d); fp8 or bf16: the row's keys and values as attn_row reads
        // them (cap, d) each; bf16: the rounded query row (d) and attn_row_bf16's scratch
        double *s = lb_malloc(((size_t)cap + d) * sizeof(double));
        double *acc = s + cap;
        float *kd = c->fp8 || bf16 ? lb_malloc((size_t)2 * cap * d * sizeof(float)) : NULL;
        float *vd = kd ? kd + (size_t)cap * d : NULL;
        float *qb = bf16 ? lb_malloc(((size_t)d + 1) * sizeof(float)) : NULL;
        row_scratch w = row_scratch_new(d);
        #pragma omp for schedule(dynamic, 4)
        for (long r = 0; r < rows; r++) {
            int i = (int)(r / hq), h = (int)(r % hq), hk = h / group, nk = pos[i] + 1;
            float lse;
            const float *qi = q + ((size_t)i * hq + h) * d;
            float *oi = out + ((size_t)i * hq + h) * d;
            size_t o = kv_off(c, slot[i], 0, hk, ld), so = kv_off(c, slot[i], 0, hk, nb);
            const float *kf = (const float *)c->k + o, *vf = (const float *)c->v + o;
            if (c->fp8) {   // dequantized as the training forward's fake quantization
                kv_dequant_rows(kd, (const uint8_t *)c->k + o, c->ks + so, nk, (size_t)d, nb, d);
                kv_dequant_rows(vd, (const uint8_t *)c->v + o, c->vs + so, nk, (size_t)d, nb, d);
                kf = kd, vf = vd;
            }
            if (!bf16) {
                attn_row(oi, &lse, qi, kf, vf, (size_t)d, nk, d, scale, s, acc);
                continue;
            }
            if (c->bf16) {   // already rounded
                kv_widen_rows(kd, (const uint16_t *)c->k + o, nk, ld, d);
                kv_widen_rows(vd, (const uint16_t *)c->v + o, nk, ld, d);
            } else {
                kv_round_rows(kd, vd, kf, vf, nk, d);
            }
            for (int x = 0; x < d; x++) qb[x] = lb_round_bf16(qi[x]);
            attn_row_bf16(oi, &lse, qb, kd, vd, (size_t)d, nk, d, c2, &w);
        }
        free(s);
        free(kd);
        free(qb);
        row_scratch_free(&w);
    }
}

void lb_cpu_init_attention(lb_backend *be)
{
    be->attention_fwd = cpu_attention_fwd;
    be->attention_bwd = cpu_attention_bwd;
    be->kv_append = cpu_kv_append;
    be->attention_cached = cpu_attention_cached;
}
