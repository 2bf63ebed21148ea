// grpo.h: the GRPO objective (group-relative advantages, asymmetric PPO clipping, token-level
// mean, optional k3 KL to a reference, optional truncated importance sampling), as plain
// functions of log-probabilities so they can be checked by hand (tests/test_grpo.c).
#ifndef LB_GRPO_H
#define LB_GRPO_H

#include <stddef.h>

typedef struct {
    double eps_low, eps_high;      // clip range [1 - eps_low, 1 + eps_high] (0.2, 0.28)
    double kl_coef;                // weight of k3 KL to the reference policy, 0 = off
    double tis_cap;                // truncated importance sampling cap, 0 = off (2.0)
    double adv_eps;                // added to the group std (1e-6)
} lb_grpo_config;

// advantages (ngroups * group) = (r - mean(group)) / (std(group) + adv_eps), std the population
// standard deviation; a group whose rewards are all equal gets zero advantages.
void lb_grpo_advantages(const float *rewards, int ngroups, int group, double adv_eps,
                        float *advantages);

// Per-token terms of one batch of response tokens, token-level mean over all n tokens:
//   ratio_t = exp(lp_t - lp_old_t)
//   w_t     = min(exp(lp_old_t - lp_rollout_t), tis_cap)  (1 without TIS)
//   obj_t   = w_t * min(ratio_t * A_t, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A_t)
//   kl_t    = exp(lp_ref_t - lp_t) - (lp_ref_t - lp_t) - 1   (k3)
//   loss    = sum_t (-obj_t + kl_coef * kl_t) / n
// lp: the trainer's log-probs (differentiated); lp_old: the same policy before this update
// (equal to lp on the first pass of an on-policy step); lp_rollout: the sampler's recorded
// log-probs; lp_ref: the reference policy (NULL when kl_coef = 0).
// dlp (n) receives d loss / d lp_t. Returns the loss; stats (may be NULL) gets the clip and
// TIS fractions and the mean k3 KL.
typedef struct {
    double clip_frac;              // tokens whose ratio was clipped (gradient zero)
    double tis_clip_frac;          // tokens whose importance weight hit the cap
    double kl;                     // mean k3 KL to the reference (0 without one)
} lb_grpo_stats;

double lb_grpo_loss(const lb_grpo_config *c, const float *lp, const float *lp_old,
                    const float *lp_rollout, const float *lp_ref, const float *adv, size_t n,
                    float *dlp, lb_grpo_stats *stats);

#endif
