// ops_moe.c: the MoE router (softmax, top-k), the Switch load-balancing loss and token dispatch
// (plan, permute, combine) for the CPU reference backend.
//
// Layouts: logits, probs, dlogits (n, e); idx, weight, dweight, row (n, k); x, out (n, c);
// permuted buffers xp, yp (n*k, c). Every reduction over slots runs in slot order.
#include "kernels/cpu/cpu.h"
#include "kernels/common.h"
#include "kernels/router.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

static void check_idx(const char *what, const int32_t *idx, int n, int e, int k)
{
    for (size_t i = 0; i < (size_t)n * k; i++)
        if (idx[i] < 0 || idx[i] >= e)
            lb_die("%s: expert index %d at (%zu, %zu) outside [0, %d)", what, idx[i], i / k,
                   i % k, e);
}

// A plan maps the n*k assignments onto rows 0 .. n*k-1 of the permuted buffer.
static void check_rows(const char *what, const int32_t *row, int n, int k)
{
    for (size_t a = 0; a < (size_t)n * k; a++)
        if (row[a] < 0 || (size_t)row[a] >= (size_t)n * k)
            lb_die("%s: row %d at (%zu, %zu) outside [0, %zu)", what, row[a], a / k, a % k,
                   (size_t)n * k);
}

// --- router -----------------------------------------------------------------------------------

// Does (pa, a) come before (pb, b) in the selection order: decreasing probability, then
// increasing index?
static int ranks_before(float pa, int a, float pb, int b)
{
    return pa > pb || (pa == pb && a < b);
}

static void cpu_router_topk_fwd(lb_backend *be, const lb_router_args *args)
{
    float *probs = args->probs;
    int32_t *idx = args->idx;
    float *weight = args->weight;
    const float *logits = args->logits;
    int n = args->n, e = args->e, k = args->k, renorm = args->renorm;
    if (k < 0 || k > e || (n > 0 && e < 1))
        lb_die("router_topk_fwd: k %d outside [0, %d] or no experts", k, e);
    // Non-finite logits would make the ranking undefined; stop here rather than mid-loop.
    for (size_t a = 0; a < (size_t)n * e; a++)
        if (!isfinite(logits[a]))
            lb_die("router_topk_fwd: logit (%zu, %zu) is %g", a / e, a % e, logits[a]);
    #pragma omp parallel for num_threads(lb_cpu_threads(be)) if ((size_t)n * e >= LB_CPU_PAR_MIN)
    for (int i = 0; i < n; i++) {
        const float *l = logits + (size_t)i * e;
        float *p = probs + (size_t)i * e;
        int32_t *ix = idx + (size_t)i * k;
        float *w = weight + (size_t)i * k;
        float m = l[0];
        for (int j = 1; j < e; j++) m = l[j] > m ? l[j] : m;
        double sum = 0.0;
        for (int j = 0; j < e; j++) {
            p[j] = expf(l[j] - m);
            sum += p[j];
        }
        for (int j = 0; j < e; j++) p[j] = (float)(p[j] / sum);
        // The s-th choice is the best-ranked expert ranked after choice s-1: O(k e), no scratch.
        double wsum = 0.0;
        for (int s = 0; s < k; s++) {
            int best = -1;
            for (int j = 0; j < e; j++) {
                if (s > 0 && !ranks_before(p[ix[s - 1]], ix[s - 1], p[j], j)) continue;
                if (best < 0 || ranks_before(p[j], j, p[best], best)) best = j;
            }
            ix[s] = best;
            w[s] = p[best];
            wsum += p[best];
        }
        if (renorm)
            for (int s = 0; s < k; s++) w[s] = (float)(w[s] / wsum);
    }
}

// Weights w_s = p_{idx_s} (/ S with S = sum_t p_{idx_t} when renorm), so
//   dp_{idx_s} = dw_s                                  (no renorm)
//   dp_{idx_s} = (dw_s - sum_t dw_t w_t) / S           (renorm)
// plus dprobs_expert[j] on every p_j, then the softmax backward dl = p (dp - sum_j p_j dp_j).
// dlogits (n, e) overwritten; it holds dp while a row is worked on.
static void cpu_router_topk_bwd(lb_backend *be, const lb_router_args *args)
{
    float *dlogits = args->dlogits;
    const float *dweight = args->dweight, *dprobs_expert = args->dprobs_expert,
                *probs = args->probs;
    const int32_t *idx = args->idx;
    int n = args->n, e = args->e, k = args->k, renorm = args->renorm;
    check_idx("router_topk_bwd", idx, n, e, k);
    #pragma omp parallel for num_threads(lb_cpu_threads(be)) if ((size_t)n * e >= LB_CPU_PAR_MIN)
    for (int i = 0; i < n; i++) {
        const float *p = probs + (size_t)i * e, *dw = dweight + (size_t)i * k;
        const int32_t *ix = idx + (size_t)i * k;
        float *dl = dlogits + (size_t)i * e;
        for (int j = 0; j < e; j++) dl[j] = dprobs_expert ? dprobs_expert[j] : 0.0f;
        if (renorm) {
            double S = 0.0, dot = 0.0;
            for (int s = 0; s < k; s++) S += p[ix[s]];
            for (int s = 0; s < k; s++) dot += (double)dw[s] * (p[ix[s]] / S);
            for (int s = 0; s < k; s++) dl[ix[s]] += (float)((dw[s] - dot) / S);
        } else {
            for (int s = 0; s < k; s++) dl[ix[s]] += dw[s];
        }
        double pdp = 0.0;
        for (int j = 0; j < e; j++) pdp += (double)p[j] * dl[j];
        for (int j = 0; j < e; j++) dl[j] = (float)(p[j] * (dl[j] - pdp));
    }
}

static void cpu_router_sigmoid_fwd(lb_backend *be, const lb_router_sigmoid_args *a)
{
    lb_router_sigmoid_check("router_sigmoid_fwd", a);
    for (size_t i = 0; i < (size_t)a->n * a->e; i++)
        if (!isfinite(a->logits[i]))
            lb_die("router_sigmoid_fwd: logit (%zu, %zu) is %g", i / a->e, i % a->e,
                   a->logits[i]);
    #pragma omp parallel num_threads(lb_cpu_threads(be)) if ((size_t)a->n * a->e >= LB_CPU_PAR_MIN)
    {
        float *choice = lb_malloc((size_t)a->e * sizeof(float));
        #pragma omp for
        for (int i = 0; i < a->n; i++)
            lb_router_sigmoid_row(a->logits + (size_t)i * a->e, a->bias,
                                  a->scores + (size_t)i * a->e, choice, a->idx + (size_t)i * a->k,
                                  a->weight + (size_t)i * a->k, a->e, a->k, a->n_group,
                                  a->topk_group, a->renorm, a->scale);
        free(choice);
    }
}

static void cpu_router_sigmoid_bwd(lb_backend *be, const lb_router_sigmoid_args *a)
{
    lb_router_sigmoid_check("router_sigmoid_bwd", a);
    check_idx("router_sigmoid_bwd", a->idx, a->n, a->e, a->k);
    #pragma omp parallel for num_threads(lb_cpu_threads(be)) \
        if ((size_t)a->n * a->e >= LB_CPU_PAR_MIN)
    for (int i = 0; i < a->n; i++)
        lb_router_sigmoid_row_bwd(a->scores + (size_t)i * a->e, a->idx + (size_t)i * a->k,
                                  a->dweight + (size_t)i * a->k, a->dlogits + (size_t)i * a->e,
                                  a->e, a->k, a->renorm, a->scale);
}

// bias[j] += rate * sign(mean - load[j]): experts that got fewer tokens than the mean rank
// higher next step, those that got more lower (DeepSeek-V3's aux-loss-free balancing).
static void cpu_router_bias_update(lb_backend *be, float *bias, const float *load, int e,
                                   float rate)
{
    (void)be;
    double mean = 0.0;
    for (int j = 0; j < e; j++) mean += load[j];
    mean /= e > 0 ? e : 1;
    for (int j = 0; j < e; j++)
        bias[j] += load[j] < mean ? rate : load[j] > mean ? -rate : 0.0f;
}

// loss = e * sum_j f_j P_j with f_j = count_j / (n k) (not differentiable) and
// P_j = mean_i probs[i][j]; d loss / d probs[i][j] = e f_j / n for every i.
static void cpu_moe_aux_loss(lb_backend *be, float *loss, float *dprobs_expert,
                             const float *probs, const int32_t *idx, int n, int e, int k)
{
    check_idx("moe_aux_loss", idx, n, e, k);
    if (n == 0 || k == 0) {
        *loss = 0.0f;
        memset(dprobs_expert, 0, (size_t)e * sizeof(float));
        return;
    }
    long *count = lb_calloc((size_t)e, sizeof(long));
    double *psum = lb_calloc((size_t)e, sizeof(double));
    for (size_t a = 0; a < (size_t)n * k; a++) count[idx[a]]++;
    for (int i = 0; i < n; i++)   // rows in order: P_j is summed in one fixed order
        for (int j = 0; j < e; j++) psum[j] += probs[(size_t)i * e + j];
    double total = 0.0;
    for (int j = 0; j < e; j++) {
        double f = (double)count[j] / ((double)n * k);
        total += f * (psum[j] / n);
        dprobs_expert[j] = (float)(e * f / n);
    }
    *loss = (float)(e * total);
    free(count);
    free(psum);
}

// --- dispatch -----------------------------------------------------------------------------------

// A counting sort: expert offsets are the exclusive prefix sum of counts, and walking the
// assignments in (token, slot) order hands out rows within each expert in that same order.
static void cpu_moe_plan(lb_backend *be, int32_t *row, int *counts_host, int *counts,
                         const int32_t *idx, int n, int e, int k)
{
    check_idx("moe_plan", idx, n, e, k);
    if ((size_t)n * k > INT32_MAX) lb_die("moe_plan: %d x %d assignments overflow int32", n, k);
    int32_t *next = lb_malloc(((size_t)e + 1) * sizeof(int32_t));
    for (int j = 0; j < e; j++) next[j] = 0;
    for (size_t a = 0; a < (size_t)n * k; a++) next[idx[a]]++;
    for (int j = 0; j < e; j++) {   // backend memory is host memory here
        if (counts_host) counts_host[j] = next[j];
        if (counts) counts[j] = next[j];
    }
    int32_t off = 0;
    for (int j = 0; j < e; j++) {
        int32_t cj = next[j];
        next[j] = off;
        off += cj;
    }
    for (size_t a = 0; a < (size_t)n * k; a++) row[a] = next[idx[a]]++;
    free(next);
}

// xp (n*k, c): xp[row[i][s]] = x[i]. Rows of a plan are distinct, so tasks never collide.
static void cpu_moe_permute(lb_backend *be, float *xp, uint16_t *xp16, lb_act x,
                            const int32_t *row, int k)
{
    const int n = x.rows, c = x.cols;
    check_rows("moe_permute", row, n, k);
    if (n > 0 && k > 0 && c > 0 && !xp && !xp16) lb_die("moe_permute: neither xp nor xp16");
    const int ld = (c + 7) / 8 * 8;
    const float *x32 = x.type == LB_ACT_F32 ? x.p : NULL;
    const uint16_t *x16 = x.type == LB_ACT_BF16 ? x.p : NULL;
    #pragma omp parallel for num_threads(lb_cpu_threads(be)) \
        if ((size_t)n * k * c >= LB_CPU_PAR_MIN)
    for (int i = 0; i < n; i++)
        for (int s = 0; s < k; s++) {
            const size_t r = (size_t)row[(size_t)i * k + s];
            if (x16) {
                const uint16_t *src = x16 + (size_t)i * x.ld;
                if (xp)
                    for (int j = 0; j < c; j++) xp[r * c + j] = lb_bf16_to_f32(src[j]);
                if (xp16) {
                    memcpy(xp16 + r * ld, src, (size_t)c * sizeof(uint16_t));
                    memset(xp16 + r * ld + c, 0, (size_t)(ld - c) * sizeof(uint16_t));
                }
                continue;
            }
            if (xp) memcpy(xp + r * c, x32 + (size_t)i * x.ld, (size_t)c * sizeof(float));
            if (xp16) lb_bf16_row(xp16 + r * ld, x32 + (size_t)i * x.ld, c, ld);
        }
}

// dx (n, c) = sum over s in order of dxp[row[i][s]].
static void cpu_moe_permute_bwd(lb_backend *be, float *dx, const float *dxp,
                                const uint16_t *dxp16, const int32_t *row, int n, int k, int c)
{
    check_rows("moe_permute_bwd", row, n, k);
    #pragma omp parallel for num_threads(lb_cpu_threads(be)) \
        if ((size_t)n * k * c >= LB_CPU_PAR_MIN)
    for (int i = 0; i < n; i++) {
        float *dxi = dx + (size_t)i * c;
        for (int x = 0; x < c; x++) {
            double acc = 0.0;
            for (int s = 0; s < k; s++) acc += lb_in_at(dxp, dxp16, row[(size_t)i * k + s], c, x);
            dxi[x] = (float)acc;
        }
    }
}

// out (n, c) = sum over s in order of weight[i][s] * yp[row[i][s]].
static void cpu_moe_combine(lb_backend *be, const lb_moe_combine_args *args)
{
    float *out = args->out;
    const float *yp = args->yp;
    const uint16_t *yp16 = args->yp16;
    const float *weight = args->weight;
    const int32_t *row = args->row;
    int n = args->n, k = args->k, c = args->c;
    check_rows("moe_combine", row, n, k);
    #pragma omp parallel for num_threads(lb_cpu_threads(be)) \
        if ((size_t)n * k * c >= LB_CPU_PAR_MIN)
    for (int i = 0; i < n; i++) {
        const float *w = weight ? weight + (size_t)i * k : NULL;
        const int32_t *r = row + (size_t)i * k;
        float *oi = out + (size_t)i * c;
        for (int x = 0; x < c; x++) {
            double acc = 0.0;
            for (int s = 0; s < k; s++)
                acc += (w ? (double)w[s] : 1.0) * lb_in_at(yp, yp16, r[s], c, x);
            oi[x] = (float)acc;
        }
    }
}

// dyp[row[i][s]] = weight[i][s] * dout[i]; dweight[i][s] = dot(dout[i], yp[row[i][s]]) (weight
// NULL: 1, dweight NULL: none).
static void cpu_moe_combine_bwd(lb_backend *be, const lb_moe_combine_args *args)
{
    float *dyp = args->dyp;
    uint16_t *dyp16 = args->dyp16;
    float *dweight = args->dweight;
    const float *dout = args->dout, *yp = args->yp;
    const uint16_t *yp16 = args->yp16;
    const float *weight = args->weight;
    const int32_t *row = args->row;
    int n = args->n, k = args->k, c = args->c;
    check_rows("moe_combine_bwd", row, n, k);
    if (n > 0 && k > 0 && c > 0 && !dyp && !dyp16)
        lb_die("moe_combine_bwd: neither dyp nor dyp16");
    const int ld = (c + 7) / 8 * 8;
    #pragma omp parallel for num_threads(lb_cpu_threads(be)) \
        if ((size_t)n * k * c >= LB_CPU_PAR_MIN)
    for (int i = 0; i < n; i++) {
        const float *gi = dout + (size_t)i * c;
        float buf[dyp ? 1 : c];   // the row, where dyp is not written
        for (int s = 0; s < k; s++) {
            size_t r = (size_t)row[(size_t)i * k + s];
            float w = weight ? weight[(size_t)i * k + s] : 1.0f;
            float *dy = dyp ? dyp + r * c : buf;
            double dot = 0.0;
            for (int x = 0; x < c; x++) {
                dy[x] = w * gi[x];
                if (dweight) dot += (double)gi[x] * lb_in_at(yp, yp16, r, c, x);
            }
            if (dweight) dweight[(size_t)i * k + s] = (float)dot;
            if (dyp16) lb_bf16_row(dyp16 + r * ld, dy, c, ld);
        }
    }
}

void lb_cpu_init_moe(lb_backend *be)
{
    be->router_topk_fwd = cpu_router_topk_fwd;
    be->router_topk_bwd = cpu_router_topk_bwd;
    be->router_sigmoid_fwd = cpu_router_sigmoid_fwd;
    be->router_sigmoid_bwd = cpu_router_sigmoid_bwd;
    be->router_bias_update = cpu_router_bias_update;
    be->moe_aux_loss = cpu_moe_aux_loss;
    be->moe_plan = cpu_moe_plan;
    be->moe_permute = cpu_moe_permute;
    be->moe_permute_bwd = cpu_moe_permute_bwd;
    be->moe_combine = cpu_moe_combine;
    be->moe_combine_bwd = cpu_moe_combine_bwd;
}
