// testutil.h: helpers shared by the Check suites.
#ifndef LB_TESTUTIL_H
#define LB_TESTUTIL_H

#include <check.h>
#include <stdio.h>
#include <stdlib.h>

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

#endif
