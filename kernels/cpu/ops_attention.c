// ops_attention.c: causal grouped-query attention, forward and backward, for the CPU reference.
//
// Layouts: q, out, dout, dq (b, t, hq, d); k, v, dk, dv (b, t, hkv, d); lse (b, hq, t).
// Query head h reads kv head h / (hq / hkv). Softmax scale 1/sqrt(d).
//
// One query row (b, h, i) is one task: its scores, softmax and output are computed by one thread
// in key order, in double, so a row never depends on the thread count or on the other sequences
// in the batch. The backward recomputes probabilities from the saved log-sum-exp (as flash
// attention does) and reduces dk/dv per key row, again one thread per row: no atomics.
#include "kernels/cpu/cpu.h"
#include "kernels/common.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>

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

static void cpu_attention_fwd(lb_backend *be, float *out, float *lse, const float *q,
                              const float *k, const float *v, int b, int t, int hq, int hkv, int d)
{
    check_heads("attention_fwd", b, t, hq, hkv, d);
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
            const float *qi = ROW(q, bi, i, h, hq);
            double m = -INFINITY;
            for (int j = 0; j <= i; j++) {
                s[j] = dot_f64(qi, ROW(k, bi, j, hk, hkv), d) * scale;
                if (s[j] > m) m = s[j];
            }
            double sum = 0.0;
            for (int x = 0; x < d; x++) acc[x] = 0.0;
            for (int j = 0; j <= i; j++) {
                double p = exp(s[j] - m);
                sum += p;
                const float *vj = ROW(v, bi, j, hk, hkv);
                for (int x = 0; x < d; x++) acc[x] += p * vj[x];
            }
            float *oi = ROW(out, bi, i, h, hq);
            for (int x = 0; x < d; x++) oi[x] = (float)(acc[x] / sum);
            lse[((size_t)bi * hq + h) * t + i] = (float)(m + log(sum));
        }
        free(s);
    }
}

// With P_ij = exp(S_ij - lse_i), S_ij = scale q_i.k_j (j <= i), D_i = dout_i.out_i:
//   dP_ij = dout_i.v_j;  dS_ij = P_ij (dP_ij - D_i)
//   dq_i = scale sum_j dS_ij k_j;  dk_j = scale sum_{h,i} dS_ij q_i;  dv_j = sum_{h,i} P_ij dout_i
// Two passes: one thread per query row for dq, one thread per key row for dk and dv (summing
// the group's query heads, then queries, in order). The scores are recomputed in each pass by
// the same expression, so both passes see identical probabilities.
static void cpu_attention_bwd(lb_backend *be, float *dq, float *dk, float *dv, const float *dout,
                              const float *q, const float *k, const float *v, const float *out,
                              const float *lse, int b, int t, int hq, int hkv, int d)
{
    check_heads("attention_bwd", b, t, hq, hkv, d);
    int group = hq / hkv;
    double scale = 1.0 / sqrt((double)d);
    int nt = lb_cpu_threads(be);
    long qrows = (long)b * hq * t, krows = (long)b * hkv * t;
    double *D = lb_malloc(((size_t)qrows + 1) * sizeof(double));   // (b, hq, t)

    #pragma omp parallel num_threads(nt) if (qrows > 1)
    {
        double *acc = lb_malloc(((size_t)d + 1) * sizeof(double));
        #pragma omp for
        for (long r = 0; r < qrows; r++) {
            int bi = (int)(r / ((long)hq * t)), h = (int)(r / t % hq), i = (int)(r % t);
            D[r] = dot_f64(ROW(dout, bi, i, h, hq), ROW(out, bi, i, h, hq), d);
        }
        // dq: one query row per task.
        #pragma omp for schedule(dynamic, 4)
        for (long r = 0; r < qrows; r++) {
            int bi = (int)(r / ((long)hq * t)), h = (int)(r / t % hq), i = (int)(r % t);
            int hk = h / group;
            const float *qi = ROW(q, bi, i, h, hq), *gi = ROW(dout, bi, i, h, hq);
            double l = lse[r];
            for (int x = 0; x < d; x++) acc[x] = 0.0;
            for (int j = 0; j <= i; j++) {
                const float *kj = ROW(k, bi, j, hk, hkv);
                double p = exp(dot_f64(qi, kj, d) * scale - l);
                double ds = p * (dot_f64(gi, ROW(v, bi, j, hk, hkv), d) - D[r]);
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
            const float *kj = ROW(k, bi, j, hk, hkv), *vj = ROW(v, bi, j, hk, hkv);
            for (int x = 0; x < 2 * d; x++) acc[x] = 0.0;
            for (int h = hk * group; h < (hk + 1) * group; h++) {
                size_t lrow = ((size_t)bi * hq + h) * t;
                for (int i = j; i < t; i++) {
                    const float *qi = ROW(q, bi, i, h, hq), *gi = ROW(dout, bi, i, h, hq);
                    double p = exp(dot_f64(qi, kj, d) * scale - (double)lse[lrow + i]);
                    double ds = p * (dot_f64(gi, vj, d) - D[lrow + i]);
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
    free(D);
}

void lb_cpu_init_attention(lb_backend *be)
{
    be->attention_fwd = cpu_attention_fwd;
    be->attention_bwd = cpu_attention_bwd;
}
