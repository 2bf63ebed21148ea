// registry.c: model name -> definition. Adding a model is one file and one line here
// (doc/adding-a-model.md): the definition carries its tensors, its feature flags (which the
// shared decoder, the Hugging Face import and export and `lowbit info` read) and its counts.
#include <stdio.h>
#include <string.h>
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
    return def->qk_norm || ((def->hf_keys & LB_HF_USE_QK_NORM) && c->use_qk_norm);
}

int lb_model_layer_moe(const lb_model_def *def, const lb_model_config *c, int l)
{
    return def->moe && l >= c->first_k_dense_replace;
}
