// router.h: one row of the sigmoid router (router_sigmoid_fwd / router_sigmoid_bwd, kernels.h),
// one source for the CPU (cpu/ops_moe.c) and the device (cuda/ops_moe.cu), so both choose the
// same experts with the same weights. The arithmetic is in double, rounded to fp32 once per
// output; the selection compares fp32 choice scores, ties to the lower index.
#ifndef LB_ROUTER_H
#define LB_ROUTER_H

#include <math.h>
#include <stdint.h>

#ifdef __CUDACC__
#define LB_ROUTER_HD __host__ __device__ __forceinline__
#else
#define LB_ROUTER_HD static inline
#endif

// Does (sa, a) come before (sb, b): a higher score, then a lower index?
LB_ROUTER_HD int lb_router_before(float sa, int a, float sb, int b)
{
    return sa > sb || (sa == sb && a < b);
}

// A group's score: the sum of its two best choice scores (its one score if it has one).
LB_ROUTER_HD double lb_router_group_score(const float *c, int g, int gs)
{
    int b1 = -1, b2 = -1;
    for (int j = g * gs; j < (g + 1) * gs; j++) {
        if (b1 < 0 || lb_router_before(c[j], j, c[b1], b1)) {
            b2 = b1;
            b1 = j;
        } else if (b2 < 0 || lb_router_before(c[j], j, c[b2], b2)) {
            b2 = j;
        }
    }
    return (double)c[b1] + (b2 >= 0 ? (double)c[b2] : 0.0);
}

// scores (e) = sigmoid(logits), choice (e) = scores + bias (scratch the caller provides), the
// kept groups, then idx (k) in decreasing choice order and weight (k). n_group <= 64.
LB_ROUTER_HD void lb_router_sigmoid_row(const float *logits, const float *bias, float *scores,
                                        float *choice, int32_t *idx, float *weight, int e,
                                        int k, int n_group, int topk_group, int renorm,
                                        float scale)
{
    for (int j = 0; j < e; j++) {
        scores[j] = (float)(1.0 / (1.0 + exp(-(double)logits[j])));
        choice[j] = bias ? (float)((double)scores[j] + bias[j]) : scores[j];
    }
    const int gs = e / n_group;
    uint64_t kept = 0;
    for (int t = 0; t < topk_group; t++) {   // the best group not yet kept
        int best = -1;
        double bs = 0.0;
        for (int g = 0; g < n_group; g++) {
            if (kept >> g & 1) continue;
            double s = lb_router_group_score(choice, g, gs);
            if (best < 0 || s > bs) best = g, bs = s;
        }
        kept |= (uint64_t)1 << best;
    }
    double sum = 0.0;
    for (int s = 0; s < k; s++) {   // the s-th choice: the best kept expert ranked after s-1
        int best = -1;
        for (int j = 0; j < e; j++) {
            if (!(kept >> (j / gs) & 1)) continue;
            if (s > 0 && !lb_router_before(choice[idx[s - 1]], idx[s - 1], choice[j], j))
                continue;
            if (best < 0 || lb_router_before(choice[j], j, choice[best], best)) best = j;
        }
        idx[s] = best;
        sum += scores[best];
    }
    const double den = renorm ? sum + 1e-20 : 1.0;
    for (int s = 0; s < k; s++) weight[s] = (float)(scores[idx[s]] / den * scale);
}

// dlogits (e) overwritten from dweight (k): w_s = scale s_s / S (renorm, S = sum of the chosen
// scores + 1e-20) or scale s_s, so ds_s = scale (dw_s - sum_t dw_t s_t / S) / S, or scale dw_s;
// then dl_j = ds_j s_j (1 - s_j). The bias and the choice pass no gradient.
LB_ROUTER_HD void lb_router_sigmoid_row_bwd(const float *scores, const int32_t *idx,
                                            const float *dweight, float *dlogits, int e, int k,
                                            int renorm, float scale)
{
    for (int j = 0; j < e; j++) dlogits[j] = 0.0f;
    double S = 1e-20, dot = 0.0;
    for (int s = 0; s < k; s++) S += scores[idx[s]];
    for (int s = 0; s < k; s++) dot += (double)dweight[s] * scores[idx[s]];
    for (int s = 0; s < k; s++) {
        double sj = scores[idx[s]];
        double ds = renorm ? scale * ((double)dweight[s] - dot / S) / S : scale * (double)dweight[s];
        dlogits[idx[s]] = (float)(ds * sj * (1.0 - sj));
    }
}

// The shapes the sigmoid router takes (kernels.h): n_group <= 64 divides e, 1 <= topk_group <=
// n_group, 1 <= k <= min(e, topk_group * e / n_group). Both backends die with the same message
// otherwise (lb_router_sigmoid_check).
static inline int lb_router_sigmoid_shape_ok(int n, int e, int k, int n_group, int topk_group)
{
    return n >= 0 && e >= 1 && k >= 1 && k <= e && n_group >= 1 && n_group <= 64 &&
           e % n_group == 0 && topk_group >= 1 && topk_group <= n_group &&
           topk_group * (e / n_group) >= k;
}

#define lb_router_sigmoid_check(what, a)                                                     \
    do {                                                                                     \
        if (!lb_router_sigmoid_shape_ok((a)->n, (a)->e, (a)->k, (a)->n_group,                \
                                        (a)->topk_group))                                    \
            lb_die("%s: e %d, k %d, n_group %d, topk_group %d: need n_group <= 64 dividing "  \
                   "e and k <= topk_group * e / n_group", what, (a)->e, (a)->k, (a)->n_group, \
                   (a)->topk_group);                                                          \
    } while (0)

#endif
