// testutil.h: helpers shared by the Check suites.
#ifndef LB_TESTUTIL_H
#define LB_TESTUTIL_H

#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kernels/quant/contract.h"

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
