// info.c: `lowbit info`: what a configuration implies (parameters, FLOPs, memory), measured by
// building the model on a counting backend that allocates nothing.
#include "lb_autoconf.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kernels/common.h"
#include "src/commands.h"

typedef struct {
    size_t now, peak;
} count_ctx;

// Every allocation gets a distinct dummy pointer carrying its size, so free can subtract it.
static void *count_alloc(lb_backend *be, size_t bytes)
{
    count_ctx *c = be->ctx;
    size_t *p = lb_malloc(sizeof(size_t));
    *p = bytes;
    c->now += bytes;
    if (c->now > c->peak) c->peak = c->now;
    return p;
}

static void count_free(lb_backend *be, void *p)
{
    count_ctx *c = be->ctx;
    if (!p) return;
    c->now -= *(size_t *)p;
    free(p);
}

static void count_upload(lb_backend *be, void *dst, const void *src, size_t bytes) {}

static double gib(size_t b) { return (double)b / (1024.0 * 1024.0 * 1024.0); }

#ifdef LB_HAVE_CUDA
int lb_cuda_device_count(void);
int lb_cuda_device_describe(int i, char *buf, size_t len);
#endif

int lb_cmd_info(const lb_config *c, lb_comm *comm)
{
    if (comm->rank != 0) return 0;
    char err[1024];
    count_ctx ctx = {0, 0};
    lb_backend counter = {.name = "count", .ctx = &ctx, .alloc = count_alloc,
                          .free = count_free, .upload = count_upload};
    lb_model *m = lb_model_create(&c->model, &counter, err, sizeof err);
    if (!m) {
        fprintf(stderr, "lowbit info: %s\n", err);
        return 1;
    }
    size_t weights = ctx.now;   // params + grads
    m->acts = m->def->acts_create(m, c->train.micro_batch, c->train.seq_len);
    size_t acts = ctx.now - weights +
                  (size_t)c->train.micro_batch * c->train.seq_len *
                      ((size_t)c->model.vocab_size * sizeof(float) + 2 * sizeof(int32_t));
    m->def->acts_free(m, m->acts);
    m->acts = NULL;

    const lb_model_config *mc = &m->cfg;
    int64_t active = lb_model_active_params(m);
    double fpt = lb_model_flops_per_token(mc, c->train.seq_len);
    printf("model       %s: %s\n", mc->arch, m->def->summary);
    printf("shape       %d layers, hidden %d, %d q heads / %d kv heads x %d, vocab %d\n",
           mc->num_hidden_layers, mc->hidden_size, mc->num_attention_heads,
           mc->num_key_value_heads, mc->head_dim, mc->vocab_size);
    if (strcmp(mc->arch, "qwen3_moe") == 0)
        printf("experts     %d, top-%d, expert FFN %d\n", mc->num_experts, mc->num_experts_per_tok,
               mc->moe_intermediate_size);
    else
        printf("mlp         SwiGLU, FFN %d\n", mc->intermediate_size);
    printf("parameters  %zu (%.3fM) in %d tensors\n", m->nparams, m->nparams / 1e6, m->ntensors);
    printf("active      %lld matmul parameters per token (%.3fM)\n", (long long)active,
           active / 1e6);
    printf("FLOPs       %.4g per token for training at seq_len %d (6 x active + attention)\n",
           fpt, c->train.seq_len);
    size_t p = m->nparams * sizeof(float);
    printf("memory      weights %.3f GiB, gradients %.3f GiB, AdamW moments %.3f GiB (fp32)\n",
           gib(p), gib(p), gib(2 * p));
    printf("            activations %.3f GiB for micro-batch %d x %d tokens; total %.3f GiB\n",
           gib(acts), c->train.micro_batch, c->train.seq_len, gib(4 * p + acts));
    lb_contract contract;
    if (lb_contract_resolve(&contract, &c->precision, mc->num_hidden_layers, err, sizeof err) == 0) {
        lb_contract_print(&contract, stdout);
        lb_contract_free(&contract);
    }
#ifdef LB_HAVE_CUDA
    int n = lb_cuda_device_count();
    printf("CUDA        %d device(s) visible\n", n);
    for (int i = 0; i < n; i++) {
        char d[256];
        lb_cuda_device_describe(i, d, sizeof d);
        printf("            %d: %s\n", i, d);
    }
#else
    printf("CUDA        not built\n");
#endif
    lb_model_free(m);
    return 0;
}
