// testutil.h: helpers shared by the Check suites.
#ifndef LB_TESTUTIL_H
#define LB_TESTUTIL_H

#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "models/precision/contract.h"
#include "models/model.h"   // lb_model_config (lb_test_llama3_rope)
#include "src/cli/config.h"   // lb_test_spec_words: [precision] as the configuration parses it

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

// The suites' tiny model of family arch (qwen3_moe, qwen3, llama, glm4_moe): 2 layers of 4
// query and 2 kv heads of 8, SwiGLU 24, experts of moe_ffn, top-2, vocab and hidden as given,
// weights drawn wide (initializer_range 0.3) so attention and routing are far from uniform;
// llama with Llama 3.1's RoPE scaling; glm4_moe with every GLM-4.5 feature (a dense layer 0,
// 8 experts in 4 groups with the best 2 kept, a shared expert, routed scaling 2.5, attention
// biases, q/k norm, half the head rotated, no load-balancing loss). A suite sets what it needs
// beyond that (the load-balancing coefficient, more layers).
static inline lb_model_config lb_test_tiny_config(const char *arch, int vocab, int hidden,
                                                  int experts, int moe_ffn)
{
    lb_model_config c;
    memset(&c, 0, sizeof c);
    snprintf(c.arch, sizeof c.arch, "%s", arch);
    if (strcmp(arch, "llama") == 0) lb_test_llama3_rope(&c);
    c.vocab_size = vocab;
    c.hidden_size = hidden;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 8;
    c.intermediate_size = 24;
    c.num_experts = experts;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = moe_ffn;
    c.norm_topk_prob = 1;
    c.max_position_embeddings = 64;
    c.rope_theta = 10000.0;
    c.rms_norm_eps = 1e-6;
    c.initializer_range = 0.3;
    c.n_group = c.topk_group = 1;
    c.routed_scaling_factor = 1.0;
    if (strcmp(arch, "glm4_moe") == 0) {
        c.first_k_dense_replace = 1;
        c.n_shared_experts = 1;
        c.num_experts = 8;
        c.n_group = 4;
        c.topk_group = 2;
        c.routed_scaling_factor = 2.5;
        c.attention_bias = 1;
        c.use_qk_norm = 1;
        c.partial_rotary_factor = 0.5;   // 4 of head_dim 8 rotate
    }
    return c;
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

// A [parallel] section of these sizes, ZeRO-1 and deterministic sums on, no failure injected.
static inline lb_parallel_config lb_test_parallel(int tp, int pp, int ep, int etp)
{
    lb_parallel_config pc;
    memset(&pc, 0, sizeof pc);
    pc.tp = tp;
    pc.pp = pp;
    pc.ep = ep;
    pc.etp = etp;
    pc.zero = 1;
    pc.deterministic = 1;
    pc.fail_rank = -1;
    snprintf(pc.fail_mode, sizeof pc.fail_mode, "die");
    return pc;
}

// [precision] as a parameter file gives it: the parameter table's defaults, then each
// space-separated key=value of words ("recipe=mxfp4 backward=dequantized"), set as a file's
// keys are and parsed by the configuration (lb_config_precision). A bad word aborts.
static inline lb_precision_spec lb_test_spec_words(const char *words)
{
    static lb_config c;   // large: not on the stack
    char err[512], item[1100];
    lb_config_defaults(&c);
    for (const char *w = words; *w;) {
        w += strspn(w, " ");
        size_t n = strcspn(w, " ");
        if (!n) break;
        snprintf(item, sizeof item, "precision.%.*s", (int)n, w);
        if (lb_config_set(&c, item, err, sizeof err) != 0) {
            fprintf(stderr, "lb_test_spec_words: %s\n", err);
            abort();
        }
        w += n;
    }
    return lb_config_precision(&c);
}

// The parameter file's defaults with this recipe.
static inline lb_precision_spec lb_test_spec(const char *recipe)
{
    char w[64];
    snprintf(w, sizeof w, "recipe=%s", recipe);
    return lb_test_spec_words(w);
}

#endif
