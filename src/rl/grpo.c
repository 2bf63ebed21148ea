// grpo.c: GRPO's objective; see grpo.h for the exact formulas.
#include "src/rl/grpo.h"

#include <math.h>

void lb_grpo_advantages(const float *rewards, int ngroups, int group, double adv_eps,
                        float *advantages)
{
    for (int g = 0; g < ngroups; g++) {
        const float *r = rewards + (size_t)g * group;
        double mean = 0.0, var = 0.0;
        for (int i = 0; i < group; i++) mean += r[i];
        mean /= group;
        for (int i = 0; i < group; i++) var += (r[i] - mean) * (r[i] - mean);
        double sd = sqrt(var / group);
        for (int i = 0; i < group; i++)
            advantages[(size_t)g * group + i] = sd > 0.0 ? (float)((r[i] - mean) / (sd + adv_eps))
                                                         : 0.0f;
    }
}

double lb_grpo_loss(const lb_grpo_config *c, const float *lp, const float *lp_old,
                    const float *lp_rollout, const float *lp_ref, const float *adv, size_t n,
                    float *dlp, lb_grpo_stats *stats)
{
    double loss = 0.0, clipped = 0.0, tis_clipped = 0.0, kl = 0.0;
    for (size_t t = 0; t < n; t++) {
        double a = adv[t];
        double ratio = exp((double)lp[t] - lp_old[t]);
        double w = 1.0;
        if (c->tis_cap > 0.0) {
            w = exp((double)lp_old[t] - lp_rollout[t]);
            if (w > c->tis_cap) {
                w = c->tis_cap;
                tis_clipped += 1.0;
            }
        }
        // PPO's pessimistic bound: the clipped branch wins (and passes no gradient) exactly
        // when the ratio has left the trust region in the direction the advantage favours.
        double lo = 1.0 - c->eps_low, hi = 1.0 + c->eps_high;
        int clip = (a > 0.0 && ratio > hi) || (a < 0.0 && ratio < lo);
        double obj = clip ? (a > 0.0 ? hi : lo) * a : ratio * a;
        double g = clip ? 0.0 : -w * ratio * a;    // d(-w * ratio * a) / d lp
        clipped += clip;
        loss -= w * obj;
        if (c->kl_coef > 0.0) {
            double d = (double)lp_ref[t] - lp[t];
            double k3 = exp(d) - d - 1.0;
            kl += k3;
            loss += c->kl_coef * k3;
            g += c->kl_coef * (1.0 - exp(d));      // d k3 / d lp
        }
        dlp[t] = (float)(g / (double)n);
    }
    if (stats) {
        stats->clip_frac = n ? clipped / n : 0.0;
        stats->tis_clip_frac = n ? tis_clipped / n : 0.0;
        stats->kl = n ? kl / n : 0.0;
    }
    return n ? loss / n : 0.0;
}
