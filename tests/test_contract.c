// test_contract.c: [precision] resolves to the documented per-site formats.
#include <stdio.h>
#include <string.h>
#include "models/precision/contract.h"
#include "tests/testutil.h"

static lb_contract resolve(const lb_precision_spec *s, int layers)
{
    lb_contract c;
    char err[512];
    ck_assert_msg(lb_contract_resolve(&c, s, layers, err, sizeof err) == 0, "%s", err);
    return c;
}

static lb_format fmt(const lb_contract *c, int l, lb_role r, lb_pass p)
{
    return lb_contract_site(c, l, r, p)->fmt;
}

START_TEST(test_recipes)
{
    static const struct {
        const char *recipe;
        lb_format linear, expert, router;
        lb_hadamard_size wgrad_h;
    } want[] = {
        {"fp32", LB_FMT_FP32, LB_FMT_FP32, LB_FMT_FP32, LB_HAD_NONE},
        {"bf16", LB_FMT_BF16, LB_FMT_BF16, LB_FMT_BF16, LB_HAD_NONE},
        {"fp8-block", LB_FMT_FP8_BLOCK, LB_FMT_FP8_BLOCK, LB_FMT_BF16, LB_HAD_NONE},
        {"mxfp8", LB_FMT_MXFP8, LB_FMT_MXFP8, LB_FMT_BF16, LB_HAD_NONE},
        {"nvfp4-moe", LB_FMT_BF16, LB_FMT_NVFP4, LB_FMT_BF16, LB_HAD_16},
        {"mxfp4", LB_FMT_MXFP4, LB_FMT_MXFP4, LB_FMT_BF16, LB_HAD_16},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        lb_precision_spec s = lb_test_spec(want[i].recipe);
        lb_contract c = resolve(&s, 3);
        for (int l = 0; l < 3; l++)
            for (int p = 0; p < LB_NPASSES; p++) {
                ck_assert_int_eq(fmt(&c, l, LB_ROLE_ATTN_QKV, p), want[i].linear);
                ck_assert_int_eq(fmt(&c, l, LB_ROLE_MLP_DOWN, p), want[i].linear);
                ck_assert_int_eq(fmt(&c, l, LB_ROLE_MOE_GATE_UP, p), want[i].expert);
                ck_assert_int_eq(fmt(&c, l, LB_ROLE_MOE_DOWN, p), want[i].expert);
                ck_assert_int_eq(fmt(&c, l, LB_ROLE_ROUTER, p), want[i].router);
                ck_assert_int_eq(fmt(&c, l, LB_ROLE_LM_HEAD, p), want[i].router);
                const lb_site *x = lb_contract_site(&c, l, LB_ROLE_MOE_DOWN, p);
                ck_assert_int_eq(x->hadamard, p == LB_PASS_WGRAD ? want[i].wgrad_h : LB_HAD_NONE);
                ck_assert_int_eq(x->mode, LB_BWD_QUANTIZED);
                ck_assert_int_eq(x->stochastic, 0);
            }
        lb_contract_free(&c);
    }
    // the contract's table is these recipes, in this order: the parameter's choices and every
    // test that loops over the recipes read it
    ck_assert_int_eq(lb_recipe_count(), (int)(sizeof want / sizeof want[0]));
    for (int i = 0; i < lb_recipe_count(); i++) ck_assert_str_eq(lb_recipe_name(i), want[i].recipe);
    ck_assert_ptr_null(lb_recipe_name(lb_recipe_count()));
    ck_assert_str_eq(lb_recipe_choices(), "fp32|bf16|fp8-block|mxfp8|nvfp4-moe|mxfp4");
}
END_TEST

START_TEST(test_keep_and_overrides)
{
    lb_precision_spec s = lb_test_spec("mxfp4");
    snprintf(s.keep_bf16_layers, sizeof s.keep_bf16_layers, "0, -1");
    snprintf(s.overrides, sizeof s.overrides, "moe.down.wgrad=bf16; attn.qkv.*=mxfp8");
    s.backward = LB_BACKWARD_DEQUANTIZED;
    s.stochastic_rounding = 1;
    s.wgrad_hadamard = LB_WGRAD_HAD_RANDOM16;
    lb_contract c = resolve(&s, 4);
    // first and last layer kept in BF16, the LM head follows the last layer
    ck_assert_int_eq(fmt(&c, 0, LB_ROLE_MOE_GATE_UP, LB_PASS_FPROP), LB_FMT_BF16);
    ck_assert_int_eq(fmt(&c, 3, LB_ROLE_ATTN_OUT, LB_PASS_DGRAD), LB_FMT_BF16);
    ck_assert_int_eq(fmt(&c, 1, LB_ROLE_MOE_GATE_UP, LB_PASS_FPROP), LB_FMT_MXFP4);
    // overrides come last and win over keep rules
    for (int l = 0; l < 4; l++) {
        ck_assert_int_eq(fmt(&c, l, LB_ROLE_MOE_DOWN, LB_PASS_WGRAD), LB_FMT_BF16);
        for (int p = 0; p < LB_NPASSES; p++)
            ck_assert_int_eq(fmt(&c, l, LB_ROLE_ATTN_QKV, p), LB_FMT_MXFP8);
    }
    const lb_site *w = lb_contract_site(&c, 1, LB_ROLE_MOE_GATE_UP, LB_PASS_WGRAD);
    ck_assert_int_eq(w->hadamard, LB_HAD_16);
    ck_assert_int_eq(w->hadamard_random, 1);
    ck_assert_int_eq(w->stochastic, 1);
    ck_assert_int_eq(w->mode, LB_BWD_DEQUANTIZED);
    const lb_site *f = lb_contract_site(&c, 1, LB_ROLE_MOE_GATE_UP, LB_PASS_FPROP);
    ck_assert_int_eq(f->stochastic, 0);               // never on the forward
    ck_assert_int_eq(f->hadamard, LB_HAD_NONE);
    // no Hadamard where the operands are BF16
    ck_assert_int_eq(lb_contract_site(&c, 1, LB_ROLE_MOE_DOWN, LB_PASS_WGRAD)->hadamard, LB_HAD_NONE);
    char *buf;
    size_t len;
    FILE *mf = open_memstream(&buf, &len);
    // an MoE model's roles: no dense-MLP rows
    lb_contract_print(&c, ~(1u << LB_ROLE_MLP_GATE_UP | 1u << LB_ROLE_MLP_DOWN), mf);
    fclose(mf);
    ck_assert_msg(strstr(buf, "layers 0-0") && strstr(buf, "layers 1-2") && strstr(buf, "layers 3-3"),
                  "%s", buf);
    ck_assert_msg(strstr(buf, "moe.gate_up") && strstr(buf, "router") &&
                  !strstr(buf, "mlp.gate_up") && !strstr(buf, "mlp.down"), "%s", buf);
    ck_assert_msg(strstr(buf, "mxfp4/deq+rh16+sr"), "%s", buf);
    free(buf);
    lb_contract_free(&c);
}
END_TEST

START_TEST(test_errors)
{
    static const struct {
        const char *field, *value, *msg;
    } bad[] = {
        {"keep_bf16_roles", "router,lmhead", "precision.keep_bf16_roles: unknown role 'lmhead'"},
        {"keep_bf16_layers", "0,4", "precision.keep_bf16_layers: '4' is not a layer index in [-4, 3]"},
        {"keep_bf16_layers", "x", "precision.keep_bf16_layers: 'x' is not a layer index"},
        {"overrides", "moe.down.wgrad=fp6", "precision.overrides: unknown format 'fp6'"},
        {"overrides", "moe.dwn.wgrad=bf16", "precision.overrides: 'moe.dwn.wgrad=bf16' names no site"},
        {"overrides", "moe.down", "precision.overrides: 'moe.down' is not role.pass=format"},
        {"overrides", "attn.qkv.fprop=fp8-tensor",
         "precision.overrides: 'attn.qkv.fprop=fp8-tensor': fp8-tensor is a GEMM format, not a "
         "training one"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        lb_precision_spec s = lb_test_spec("mxfp8");
        char *dst = !strcmp(bad[i].field, "keep_bf16_roles") ? s.keep_bf16_roles
                    : !strcmp(bad[i].field, "keep_bf16_layers") ? s.keep_bf16_layers
                                                                : s.overrides;
        strcpy(dst, bad[i].value);
        lb_contract c;
        char err[512] = "";
        ck_assert_int_eq(lb_contract_resolve(&c, &s, 4, err, sizeof err), -1);
        ck_assert_msg(strncmp(err, bad[i].msg, strlen(bad[i].msg)) == 0, "got '%s', want '%s'", err,
                      bad[i].msg);
    }
}
END_TEST

// precision.attention: auto is bf16 for every recipe but fp32 (the exact reference); fp32 and
// bf16 force the mode whatever the recipe; the resolved mode is printed.
START_TEST(test_attention_mode)
{
    static const char *const modes[] = {"auto", "fp32", "bf16"};
    for (int r = 0; r < lb_recipe_count(); r++)
        for (size_t m = 0; m < sizeof modes / sizeof modes[0]; m++) {
            char words[64];
            snprintf(words, sizeof words, "recipe=%s attention=%s", lb_recipe_name(r), modes[m]);
            lb_precision_spec s = lb_test_spec_words(words);
            lb_contract c = resolve(&s, 2);
            int want = m < 1 ? strcmp(lb_recipe_name(r), "fp32") != 0 : !strcmp(modes[m], "bf16");
            ck_assert_msg(c.attention_bf16 == want, "recipe %s, attention '%s': bf16 %d",
                          lb_recipe_name(r), modes[m], c.attention_bf16);
            char *buf;
            size_t len;
            FILE *mf = open_memstream(&buf, &len);
            lb_contract_print(&c, ~0u, mf);
            fclose(mf);
            ck_assert_msg(strstr(buf, want ? "attention bf16" : "attention fp32"), "%s", buf);
            free(buf);
            lb_contract_free(&c);
        }
}
END_TEST

// precision.scale = pow2: on every fp8-block site (recipe or override) and nowhere else,
// printed as +p2; fp32 none; refused, naming the key, where no GEMM is fp8-block.
START_TEST(test_scale_pow2)
{
    lb_precision_spec s = lb_test_spec("fp8-block");
    lb_contract c = resolve(&s, 2);
    for (int l = 0; l < 2; l++)
        for (int r = 0; r < LB_NROLES; r++)
            for (int p = 0; p < LB_NPASSES; p++)
                ck_assert_int_eq(lb_contract_site(&c, l, r, p)->scale_pow2, 0);
    lb_contract_free(&c);

    s.scale_pow2 = 1;
    snprintf(s.overrides, sizeof s.overrides, "attn.qkv.*=mxfp8");
    c = resolve(&s, 2);
    for (int l = 0; l < 2; l++)
        for (int r = 0; r < LB_NROLES; r++)
            for (int p = 0; p < LB_NPASSES; p++) {
                const lb_site *x = lb_contract_site(&c, l, r, p);
                ck_assert_msg(x->scale_pow2 == (x->fmt == LB_FMT_FP8_BLOCK),
                              "layer %d %s pass %d: format %s, pow2 %d", l, lb_role_name(r), p,
                              lb_format_name(x->fmt), x->scale_pow2);
            }
    ck_assert_int_eq(lb_contract_site(&c, 0, LB_ROLE_MOE_DOWN, LB_PASS_WGRAD)->scale_pow2, 1);
    ck_assert_int_eq(lb_contract_site(&c, 0, LB_ROLE_ROUTER, LB_PASS_FPROP)->scale_pow2, 0);
    char *buf;
    size_t len;
    FILE *mf = open_memstream(&buf, &len);
    lb_contract_print(&c, ~0u, mf);
    fclose(mf);
    ck_assert_msg(strstr(buf, "fp8-block+p2") && strstr(buf, "+p2: power-of-two scales") &&
                  !strstr(buf, "mxfp8+p2") && !strstr(buf, "bf16+p2"), "%s", buf);
    free(buf);
    lb_contract_free(&c);

    // a bf16 recipe with one fp8-block override takes it there
    s = lb_test_spec("bf16");
    s.scale_pow2 = 1;
    snprintf(s.overrides, sizeof s.overrides, "moe.down.fprop=fp8-block");
    c = resolve(&s, 2);
    ck_assert_int_eq(lb_contract_site(&c, 1, LB_ROLE_MOE_DOWN, LB_PASS_FPROP)->scale_pow2, 1);
    ck_assert_int_eq(lb_contract_site(&c, 1, LB_ROLE_MOE_DOWN, LB_PASS_DGRAD)->scale_pow2, 0);
    lb_contract_free(&c);

    static const struct {
        const char *recipe, *overrides, *msg;
    } bad[] = {
        {"mxfp8", "", "precision.scale: pow2 rounds fp8-block scales up to powers of two, "
                      "and no GEMM of recipe 'mxfp8'"},
        {"nvfp4-moe", "", "precision.scale: pow2 rounds fp8-block scales"},
        {"fp32", "", "precision.scale: pow2 rounds fp8-block scales"},
        {"fp8-block", "*.*=bf16", "precision.scale: pow2 rounds fp8-block scales"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        s = lb_test_spec(bad[i].recipe);
        s.scale_pow2 = 1;
        snprintf(s.overrides, sizeof s.overrides, "%s", bad[i].overrides);
        char err[512] = "";
        ck_assert_int_eq(lb_contract_resolve(&c, &s, 2, err, sizeof err), -1);
        ck_assert_msg(strncmp(err, bad[i].msg, strlen(bad[i].msg)) == 0, "got '%s', want '%s'",
                      err, bad[i].msg);
    }
}
END_TEST

int main(void)
{
    Suite *s = suite_create("contract");
    TCase *tc = tcase_create("contract");
    tcase_add_test(tc, test_recipes);
    tcase_add_test(tc, test_keep_and_overrides);
    tcase_add_test(tc, test_errors);
    tcase_add_test(tc, test_attention_mode);
    tcase_add_test(tc, test_scale_pow2);
    suite_add_tcase(s, tc);
    return lb_test_run(s);
}
