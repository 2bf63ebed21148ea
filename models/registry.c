// registry.c: model name -> definition. Adding a model is one file and one line here.
#include <string.h>
#include "models/model.h"

extern const lb_model_def lb_qwen3_moe_def;
extern const lb_model_def lb_qwen3_def;

static const lb_model_def *const registry[] = {
    &lb_qwen3_moe_def,
    &lb_qwen3_def,
};

int lb_model_count(void) { return (int)(sizeof registry / sizeof registry[0]); }

const lb_model_def *lb_model_lookup(const char *arch)
{
    for (int i = 0; i < lb_model_count(); i++)
        if (strcmp(registry[i]->arch, arch) == 0) return registry[i];
    return NULL;
}
