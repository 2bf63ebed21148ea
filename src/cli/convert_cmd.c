// convert_cmd.c: `lowbit convert`: a Hugging Face model into a lowbit checkpoint (import) or
// a checkpoint into a Hugging Face model (export), by src/io/convert.c's mapping.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels/common.h"
#include "src/cli/commands.h"
#include "src/io/checkpoint.h"
#include "src/io/convert.h"
#include "src/io/files.h"
#include "src/io/tokenizer.h"

// The imported model section over the caller's configuration. Fields that config.json does not
// give for this architecture (0: the MoE sizes of a dense model, intermediate_size of a MoE,
// the llama3 RoPE numbers of plain RoPE)
// keep their configured values, so the stored INI stays valid for lb_config_parse.
static void merge_model(lb_model_config *dst, const lb_model_config *src)
{
    lb_model_config keep = *dst;
    *dst = *src;
#define KEEP(f) if (!dst->f) dst->f = keep.f
    KEEP(intermediate_size);
    KEEP(num_experts);
    KEEP(num_experts_per_tok);
    KEEP(moe_intermediate_size);
    KEEP(rope_factor);   // the llama3 numbers of plain RoPE
    KEEP(rope_low_freq_factor);
    KEEP(rope_high_freq_factor);
    KEEP(rope_original_max_position_embeddings);
#undef KEEP
    dst->router_bias_update_rate = keep.router_bias_update_rate;   // training, not the model
}

// The directories above path, those made recorded in made.
static int parent_dirs(const char *path, lb_dirs_made *made, char *err, size_t errlen)
{
    char dir[1024];
    snprintf(dir, sizeof dir, "%s", path);
    *made = (lb_dirs_made){"", ""};
    char *slash = strrchr(dir, '/');
    if (!slash || slash == dir) return 0;
    *slash = 0;
    return lb_mkdirs_made(dir, made, err, errlen);
}

// dir/tokenizer.json, when there is one, into *json: read, parsed and checked against the
// model's vocabulary, so the checkpoint carries a tokenizer sample and rl can use.
static int import_tokenizer(const char *dir, const lb_model_config *mc, char **json, char *err,
                            size_t errlen)
{
    char path[1100];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    *json = NULL;
    if (access(path, F_OK) != 0) return 0;
    if (!(*json = lb_tokenizer_read(path, err, errlen))) return -1;
    lb_tokenizer *t = lb_tokenizer_parse(*json, path, err, errlen);
    int n = t ? lb_tokenizer_vocab_size(t) : 0;
    lb_tokenizer_free(t);
    if (t && n > mc->vocab_size)
        lb_seterr(err, errlen, "%s has %d tokens, more than config.json's vocab_size (%d)", path, n,
                  mc->vocab_size);
    if (t && n <= mc->vocab_size) return 0;
    free(*json);
    *json = NULL;
    return -1;
}

static int convert_import(const lb_config *c, char *err, size_t errlen)
{
    const char *in = c->convert.input, *out = c->convert.output;
    lb_config lc = *c;
    lb_model_config mc;
    if (lb_hf_read_config(in, &mc, err, errlen) != 0) return -1;
    merge_model(&lc.model, &mc);
    lb_backend *be = lb_backend_cpu_create(0, err, errlen);
    if (!be) return -1;
    int rc = -1;
    char *ini = NULL, *tok = NULL;
    lb_model *m = lb_model_create(&lc.model, be, err, errlen);
    if (!m) goto out;
    if (lb_hf_load(m, in, err, errlen) != 0) goto out;
    if (import_tokenizer(in, &lc.model, &tok, err, errlen) != 0) goto out;
    ini = lb_config_to_ini(&lc);
    lb_train_state st = {0, 0, 0};
    lb_dirs_made made;
    if (parent_dirs(out, &made, err, errlen) != 0) goto out;
    if (lb_checkpoint_save(out, m, NULL, NULL, &st, ini, tok, err, errlen) != 0) {
        lb_dirs_unmake(&made);   // the save left no file: no empty directory either
        goto out;
    }
    printf("convert: wrote lowbit checkpoint %s (%s, %zu parameters) from %s\n", out,
           lc.model.arch, m->nparams, in);
    rc = 0;
out:
    free(tok);
    free(ini);
    lb_model_free(m);
    be->destroy(be);
    return rc;
}

static int convert_export(const lb_config *c, char *err, size_t errlen)
{
    const char *in = c->convert.input, *out = c->convert.output;
    char *ini = lb_checkpoint_config(in, err, errlen);
    if (!ini) return -1;
    lb_config lc;
    lb_config_defaults(&lc);
    char label[LB_PATH_MAX + 32];
    snprintf(label, sizeof label, "%s (stored configuration)", in);
    int prc = lb_config_parse(&lc, ini, label, err, errlen);
    free(ini);
    if (prc != 0) return -1;
    lb_backend *be = lb_backend_cpu_create(0, err, errlen);
    if (!be) return -1;
    int rc = -1;
    lb_train_state st;
    char *tok = NULL;
    lb_model *m = lb_model_create(&lc.model, be, err, errlen);
    if (!m) goto out;
    if (lb_checkpoint_load(in, m, NULL, NULL, &st, err, errlen) != 0 ||
        lb_checkpoint_tokenizer(in, &tok, err, errlen) != 0 ||
        lb_hf_export(m, out, c->convert.dtype, tok, err, errlen) != 0)
        goto out;
    printf("convert: wrote Hugging Face model %s (%s, %s, step %lld%s) from %s\n", out,
           lc.model.arch, c->convert.dtype, (long long)st.step,
           tok ? ", with its tokenizer.json" : "", in);
    rc = 0;
out:
    free(tok);
    lb_model_free(m);
    be->destroy(be);
    return rc;
}

int lb_cmd_convert(const lb_config *c, lb_comm *comm)
{
    if (comm && comm->rank != 0) return 0;   // conversion is serial file work
    char err[1024] = "";
    int rc;
    if (!c->convert.input[0] || !c->convert.output[0]) {
        snprintf(err, sizeof err, "convert.input and convert.output must both be set");
        rc = -1;
    } else if (strcmp(c->convert.direction, "import") == 0) {
        rc = convert_import(c, err, sizeof err);
    } else if (strcmp(c->convert.direction, "export") == 0) {
        rc = convert_export(c, err, sizeof err);
    } else {
        snprintf(err, sizeof err, "convert.direction '%s' is not import or export",
                 c->convert.direction);
        rc = -1;
    }
    if (rc != 0) {
        fprintf(stderr, "lowbit convert: %s\n", err);
        return 1;
    }
    fflush(stdout);
    return 0;
}
