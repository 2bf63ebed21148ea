// test_grpo.c: GRPO's advantages, clipped objective, TIS and k3 KL against cases worked by hand.
#include <math.h>
#include "src/rl/grpo.h"
#include "tests/testutil.h"

START_TEST(test_advantages)
{
    float r[7] = {1, 0, 0, 1, 2, 2, 2}, a[7];
    lb_grpo_advantages(r, 1, 4, 0.0, a);
    // mean 0.5, population std 0.5
    ck_assert_float_eq_tol(a[0], 1.0f, 1e-7f);
    ck_assert_float_eq_tol(a[1], -1.0f, 1e-7f);
    ck_assert_float_eq_tol(a[2], -1.0f, 1e-7f);
    ck_assert_float_eq_tol(a[3], 1.0f, 1e-7f);
    lb_grpo_advantages(r + 4, 1, 3, 1e-6, a + 4);   // equal rewards: no signal
    for (int i = 4; i < 7; i++) ck_assert(a[i] == 0.0f);
    float r2[6] = {0, 1, 3, 5, 5, 5}, a2[6];
    lb_grpo_advantages(r2, 2, 3, 0.0, a2);          // groups are normalised separately
    double sd = sqrt(((0 - 4 / 3.0) * (0 - 4 / 3.0) + (1 - 4 / 3.0) * (1 - 4 / 3.0) +
                      (3 - 4 / 3.0) * (3 - 4 / 3.0)) / 3);
    ck_assert_float_eq_tol(a2[2], (float)((3 - 4 / 3.0) / sd), 1e-6f);
    ck_assert(a2[3] == 0.0f && a2[5] == 0.0f);
}
END_TEST

START_TEST(test_clipped_objective)
{
    lb_grpo_config c = {.eps_low = 0.2, .eps_high = 0.28};
    // ratios 1.5 (A=+1, clipped at 1.28), 0.5 (A=-1, clipped at 0.8), 1.1 (A=+1),
    // 0.9 (A=-2), 0.5 (A=+1: below the range but not clipped, the min picks ratio*A)
    float lp[5] = {logf(1.5f), logf(0.5f), logf(1.1f), logf(0.9f), logf(0.5f)};
    float old[5] = {0, 0, 0, 0, 0}, adv[5] = {1, -1, 1, -2, 1}, d[5];
    lb_grpo_stats st;
    double loss = lb_grpo_loss(&c, lp, old, old, NULL, adv, 5, d, &st);
    double want = -(1.28 - 0.8 + 1.1 - 1.8 + 0.5) / 5;
    ck_assert_msg(fabs(loss - want) < 1e-6, "loss %.9f, want %.9f", loss, want);
    ck_assert(d[0] == 0.0f && d[1] == 0.0f);         // clipped: no gradient
    ck_assert_float_eq_tol(d[2], -1.1f / 5, 1e-6f);
    ck_assert_float_eq_tol(d[3], 0.9f * 2 / 5, 1e-6f);
    ck_assert_float_eq_tol(d[4], -0.5f / 5, 1e-6f);
    ck_assert_double_eq_tol(st.clip_frac, 0.4, 1e-12);
    ck_assert(st.tis_clip_frac == 0.0 && st.kl == 0.0);
}
END_TEST

START_TEST(test_tis_and_kl)
{
    lb_grpo_config c = {.eps_low = 0.2, .eps_high = 0.28, .tis_cap = 2.0, .kl_coef = 0.1};
    // on-policy (lp == lp_old); the rollout saw token 0 three times less likely (weight 3,
    // capped at 2) and token 1 twice as likely (weight 0.5); the reference is twice as likely
    // as the policy on both (k3 = 2 - ln 2 - 1).
    float lp[2] = {-1.0f, -2.0f}, old[2] = {-1.0f, -2.0f};
    float roll[2] = {-1.0f - logf(3.0f), -2.0f + logf(2.0f)};
    float ref[2] = {-1.0f + logf(2.0f), -2.0f + logf(2.0f)};
    float adv[2] = {1.0f, -1.0f}, d[2];
    lb_grpo_stats st;
    double loss = lb_grpo_loss(&c, lp, old, roll, ref, adv, 2, d, &st);
    double k3 = 2.0 - log(2.0) - 1.0;
    double want = (-(2.0 * 1.0) - (0.5 * -1.0) + 2 * 0.1 * k3) / 2;
    ck_assert_msg(fabs(loss - want) < 1e-6, "loss %.9f, want %.9f", loss, want);
    ck_assert_float_eq_tol(d[0], (float)((-2.0 + 0.1 * (1 - 2.0)) / 2), 1e-6f);
    ck_assert_float_eq_tol(d[1], (float)((0.5 + 0.1 * (1 - 2.0)) / 2), 1e-6f);
    ck_assert_double_eq_tol(st.tis_clip_frac, 0.5, 1e-12);
    ck_assert_double_eq_tol(st.kl, k3, 1e-6);
}
END_TEST

// The returned gradient is the derivative of the returned loss (central differences in double
// on the unclipped region).
START_TEST(test_gradient_matches_loss)
{
    lb_grpo_config c = {.eps_low = 0.2, .eps_high = 0.28, .tis_cap = 2.0, .kl_coef = 0.05};
    float lp[4] = {-0.7f, -1.3f, -0.2f, -2.1f}, old[4] = {-0.75f, -1.25f, -0.25f, -2.0f};
    float roll[4] = {-0.8f, -1.2f, -0.2f, -2.5f}, ref[4] = {-0.6f, -1.5f, -0.3f, -2.0f};
    float adv[4] = {0.7f, -0.4f, 1.2f, -1.5f}, d[4], tmp[4];
    lb_grpo_loss(&c, lp, old, roll, ref, adv, 4, d, NULL);
    for (int t = 0; t < 4; t++) {
        float keep = lp[t], h = 1e-3f;
        lp[t] = keep + h;
        double up = lb_grpo_loss(&c, lp, old, roll, ref, adv, 4, tmp, NULL);
        lp[t] = keep - h;
        double dn = lb_grpo_loss(&c, lp, old, roll, ref, adv, 4, tmp, NULL);
        lp[t] = keep;
        double fd = (up - dn) / (2.0 * h);
        ck_assert_msg(fabs(fd - d[t]) < 1e-4, "token %d: fd %.6g analytic %.6g", t, fd, d[t]);
    }
}
END_TEST

int main(void)
{
    Suite *s = suite_create("grpo");
    TCase *tc = tcase_create("grpo");
    tcase_add_test(tc, test_advantages);
    tcase_add_test(tc, test_clipped_objective);
    tcase_add_test(tc, test_tis_and_kl);
    tcase_add_test(tc, test_gradient_matches_loss);
    suite_add_tcase(s, tc);
    return lb_test_run(s);
}
