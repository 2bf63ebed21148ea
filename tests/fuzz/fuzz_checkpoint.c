// fuzz_checkpoint.c: the checkpoint loader (lb_checkpoint_config and the stored configuration
// parsed, as `lowbit sample` does; lb_checkpoint_load with the moments, as a resume does) into
// one fixed tiny model. `fuzz_checkpoint --seed DIR` (the replay driver) writes DIR/ok-step15,
// a valid checkpoint of that model, from which tests/fuzz/make_corpus.sh makes the bad ones.
#include "kernels/kernels.h"
#include "src/cli/config.h"
#include "src/io/checkpoint.h"
#include "tests/fuzz/fuzz.h"

static lb_model *model(void)
{
    static lb_model *m;
    if (m) return m;
    char err[512];
    lb_backend *be = lb_backend_cpu_create(1, err, sizeof err);
    lb_model_config c = {0};
    snprintf(c.arch, sizeof c.arch, "qwen3_moe");
    c.vocab_size = 16;
    c.hidden_size = 8;
    c.num_hidden_layers = 1;
    c.num_attention_heads = 2;
    c.num_key_value_heads = 1;
    c.head_dim = 4;
    c.intermediate_size = 8;
    c.num_experts = 2;
    c.num_experts_per_tok = 1;
    c.moe_intermediate_size = 4;
    c.norm_topk_prob = 1;
    c.max_position_embeddings = 16;
    c.rope_theta = 10000.0;
    c.rms_norm_eps = 1e-6;
    c.initializer_range = 0.02;
    m = be ? lb_model_create(&c, be, err, sizeof err) : NULL;
    if (!m) {
        fprintf(stderr, "fuzz_checkpoint: %s\n", err);
        abort();
    }
    return m;
}

int lb_fuzz_seed(const char *dir)
{
    char path[1024], err[512];
    lb_model *m = model();
    lb_backend *be = m->be;
    lb_model_init_params(m, 1);
    float *am = be->alloc(be, m->nparams * sizeof(float));
    float *av = be->alloc(be, m->nparams * sizeof(float));
    for (size_t i = 0; i < m->nparams; i++) {
        am[i] = 1e-3f * (float)(i % 7);
        av[i] = 1e-6f * (float)(i % 5);
    }
    lb_train_state st = {15, 0, 40};
    snprintf(path, sizeof path, "%s/ok-step15", dir);
    int rc = lb_checkpoint_save(path, m, am, av, &st,
                                "[model]\narch = qwen3_moe\nrope_theta = 10000\n", NULL, err,
                                sizeof err);
    if (rc != 0) fprintf(stderr, "%s\n", err);
    be->free(be, am);
    be->free(be, av);
    return rc;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[1024] = "";
    lb_model *m = model();
    lb_backend *be = m->be;
    const char *path = lb_fuzz_file(data, size, ".safetensors");
    char *ini = lb_checkpoint_config(path, err, sizeof err);
    int rc = ini ? 0 : -1;
    if (ini) {
        lb_config c;
        lb_config_defaults(&c);
        rc = lb_config_parse(&c, ini, path, err, sizeof err);
        free(ini);
    }
    if (rc == 0) {
        float *am = be->alloc(be, m->nparams * sizeof(float));
        float *av = be->alloc(be, m->nparams * sizeof(float));
        lb_train_state st;
        rc = lb_checkpoint_load(path, m, am, av, &st, err, sizeof err);
        if (rc == 0 && (st.step < 0 || st.loader_shard < -1 || st.loader_pos < 0)) abort();
        be->free(be, am);
        be->free(be, av);
    }
    if (rc != 0) lb_fuzz_names(err, path);
    lb_fuzz_accepted = rc == 0;
    return 0;
}
