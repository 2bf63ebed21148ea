// registry.c: model name -> definition. Adding a model is one file and one line here
// (doc/adding-a-model.md): the definition carries its tensors, its feature flags (which the
// shared decoder, the Hugging Face import and export and `lowbit info` read), its config.json
// keys, its counts and its own [model] keys; with the shared blocks' keys they are the
// parameter table's [model] section (src/cli/params.c asks lb_model_key_at).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "models/blocks.h"
#include "models/model.h"

extern const lb_model_def lb_qwen3_moe_def;
extern const lb_model_def lb_qwen3_def;
extern const lb_model_def lb_llama_def;
extern const lb_model_def lb_glm4_moe_def;

static const lb_model_def *const registry[] = {
    &lb_qwen3_moe_def,
    &lb_qwen3_def,
    &lb_llama_def,
    &lb_glm4_moe_def,
};

int lb_model_count(void) { return (int)(sizeof registry / sizeof registry[0]); }

const lb_model_def *lb_model_at(int i)
{
    return i >= 0 && i < lb_model_count() ? registry[i] : NULL;
}

const lb_model_def *lb_model_lookup(const char *arch)
{
    for (int i = 0; i < lb_model_count(); i++)
        if (strcmp(registry[i]->arch, arch) == 0) return registry[i];
    return NULL;
}

const char *lb_model_arch_choices(void)
{
    static char buf[512];
    if (!buf[0])
        for (int i = 0; i < lb_model_count(); i++) {
            size_t n = strlen(buf);
            snprintf(buf + n, sizeof buf - n, "%s%s", i ? "|" : "", registry[i]->arch);
        }
    return buf;
}

int lb_model_qk_norm(const lb_model_def *def, const lb_model_config *c)
{
    return def->qk_norm == LB_QK_NORM_ALWAYS ||
           (def->qk_norm == LB_QK_NORM_OPTIONAL && c->use_qk_norm);
}

int lb_model_layer_moe(const lb_model_def *def, const lb_model_config *c, int l)
{
    return def->moe && l >= c->first_k_dense_replace;
}

// The keys: the blocks' table and each family's own that no earlier entry names (two families
// may declare the same key; the first declaration is the table's).
static const lb_model_key *keys[128];
static int nkeys = -1;

static void keys_collect(void)
{
    nkeys = 0;
    for (int i = 0; i < lb_block_nkeys; i++) keys[nkeys++] = &lb_block_keys[i];
    for (int m = 0; m < lb_model_count(); m++)
        for (int j = 0; j < registry[m]->nkeys; j++) {
            const lb_model_key *k = &registry[m]->keys[j];
            int seen = 0;
            for (int i = 0; i < nkeys && !seen; i++) seen = !strcmp(keys[i]->name, k->name);
            if (seen) continue;
            if (nkeys == (int)(sizeof keys / sizeof keys[0])) {
                fprintf(stderr, "models/registry.c: more than %d [model] keys\n", nkeys);
                abort();
            }
            keys[nkeys++] = k;
        }
    // in the order of their lb_model_config fields (the parameter table's order): a family's
    // key sits where its field is
    for (int i = 1; i < nkeys; i++)
        for (int j = i; j > 0 && keys[j - 1]->offset > keys[j]->offset; j--) {
            const lb_model_key *t = keys[j];
            keys[j] = keys[j - 1];
            keys[j - 1] = t;
        }
}

int lb_model_key_count(void)
{
    if (nkeys < 0) keys_collect();
    return nkeys;
}

const lb_model_key *lb_model_key_at(int i)
{
    return i >= 0 && i < lb_model_key_count() ? keys[i] : NULL;
}

// Whether family d reads k: a blocks' key by its predicate, a family's own when d declares it.
static int reads(const lb_model_def *d, const lb_model_key *k)
{
    for (int i = 0; i < lb_block_nkeys; i++)
        if (&lb_block_keys[i] == k) return !k->reads || k->reads(d);
    for (int j = 0; j < d->nkeys; j++)
        if (!strcmp(d->keys[j].name, k->name)) return 1;
    return 0;
}

const char *lb_model_key_readers(const lb_model_key *k, char *buf, size_t n)
{
    size_t o = 0;
    int all = 1;
    buf[0] = 0;
    for (int m = 0; m < lb_model_count(); m++) {
        if (!reads(registry[m], k)) {
            all = 0;
            continue;
        }
        if (o < n) o += (size_t)snprintf(buf + o, n - o, "%s%s", o ? ", " : "", registry[m]->arch);
    }
    if (all) buf[0] = 0;
    return buf;
}
