// testutil.h: helpers shared by the Check suites.
#ifndef LB_TESTUTIL_H
#define LB_TESTUTIL_H

#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "models/precision/contract.h"
#include "models/model.h"   // lb_model_config (lb_test_llama3_rope)

// Path of a file under the source tree (tests run from the build tree under make distcheck).
static inline const char *lb_test_src(const char *rel)
{
    static char buf[8][1024];
    static int next;
    const char *root = getenv("LB_SRCDIR");
    char *out = buf[next++ % 8];
    snprintf(out, sizeof buf[0], "%s/%s", root && *root ? root : ".", rel);
    return out;
}

// Llama 3.1's RoPE scaling on a test configuration of head_dim 8: an original context of 64
// puts one frequency in each band (kept, blended, divided by the factor 8).
static inline void lb_test_llama3_rope(lb_model_config *c)
{
    snprintf(c->rope_type, sizeof c->rope_type, "llama3");
    c->rope_factor = 8.0;
    c->rope_low_freq_factor = 1.0;
    c->rope_high_freq_factor = 4.0;
    c->rope_original_max_position_embeddings = 64;
}

// A fresh scratch directory for one test (removed by the caller when wanted).
static inline const char *lb_test_tmpdir(void)
{
    static char buf[256];
    const char *base = getenv("TMPDIR");
    snprintf(buf, sizeof buf, "%s/lowbit-test-XXXXXX", base && *base ? base : "/tmp");
    if (!mkdtemp(buf)) { perror("mkdtemp"); exit(1); }
    return buf;
}

// Runs one suite with CK_FORK=no semantics (set in the environment by make check) and
// returns the process exit status.
static inline int lb_test_run(Suite *s)
{
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}

// [precision] as the parameter file's defaults give it, with this recipe.
static inline lb_precision_spec lb_test_spec(const char *recipe)
{
    lb_precision_spec s;
    memset(&s, 0, sizeof s);
    snprintf(s.recipe, sizeof s.recipe, "%s", recipe);
    snprintf(s.backward, sizeof s.backward, "default");
    snprintf(s.wgrad_hadamard, sizeof s.wgrad_hadamard, "default");
    snprintf(s.scale_rule, sizeof s.scale_rule, "ceil");
    snprintf(s.nvfp4_scale, sizeof s.nvfp4_scale, "per-token");
    snprintf(s.nvfp4_weight_blocks, sizeof s.nvfp4_weight_blocks, "16x16");
    snprintf(s.keep_bf16_roles, sizeof s.keep_bf16_roles, "router,lm_head");
    return s;
}

#endif
