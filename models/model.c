// model.c: the model object shared by every definition: parameter layout, initialisation,
// and the forward/backward entry points that move tokens to the backend.
#include "models/model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kernels/common.h"

lb_model *lb_model_create(const lb_model_config *cfg, lb_backend *be, char *err, size_t errlen)
{
    const lb_model_def *def = lb_model_lookup(cfg->arch);
    if (!def) {
        snprintf(err, errlen, "unknown model arch '%s'", cfg->arch);
        return NULL;
    }
    if (def->check(cfg, err, errlen) != 0) return NULL;
    lb_model *m = lb_calloc(1, sizeof *m);
    m->cfg = *cfg;
    m->def = def;
    m->be = be;
    m->ntensors = def->tensors(cfg, NULL);
    m->tensors = lb_calloc(m->ntensors, sizeof *m->tensors);
    def->tensors(cfg, m->tensors);
    size_t off = 0;
    for (int i = 0; i < m->ntensors; i++) {
        lb_tensor *t = &m->tensors[i];
        t->numel = 1;
        for (int d = 0; d < t->ndim; d++) t->numel *= (size_t)t->shape[d];
        t->offset = off;
        off += t->numel;
    }
    m->nparams = off;
    m->params = be->alloc(be, off * sizeof(float));
    m->grads = be->alloc(be, off * sizeof(float));
    m->wcache = lb_calloc(m->ntensors, sizeof *m->wcache);
    m->lin.be = be;
    lb_precision_spec fp32;
    memset(&fp32, 0, sizeof fp32);
    snprintf(fp32.recipe, sizeof fp32.recipe, "fp32");
    if (lb_model_set_precision(m, &fp32, 0, err, errlen) != 0) lb_die("%s", err);
    return m;
}

static void acts_release(lb_model *m)
{
    if (!m->acts) return;
    m->def->acts_free(m, m->acts);
    m->be->free(m->be, m->logits);
    m->be->free(m->be, m->tokens);
    m->be->free(m->be, m->targets);
    m->acts = NULL;
    m->logits = NULL;
    m->tokens = m->targets = NULL;
}

void lb_model_free(lb_model *m)
{
    if (!m) return;
    acts_release(m);
    for (int i = 0; i < m->ntensors; i++) lb_wcache_free(&m->lin, &m->wcache[i]);
    free(m->wcache);
    lb_linear_free(&m->lin);
    lb_contract_free(&m->contract);
    m->be->free(m->be, m->params);
    m->be->free(m->be, m->grads);
    free(m->tensors);
    free(m);
}

void lb_model_init_params(lb_model *m, uint64_t seed)
{
    // Drawn on the host from (seed, tensor index, element index), so every backend and every
    // later re-sharding starts from the same numbers.
    float *host = lb_malloc(m->nparams * sizeof(float));
    for (int i = 0; i < m->ntensors; i++) {
        const lb_tensor *t = &m->tensors[i];
        float *p = host + t->offset;
        for (size_t j = 0; j < t->numel; j++)
            p[j] = t->is_norm ? 1.0f
                              : (float)m->cfg.initializer_range * lb_rand_normal(seed, (uint64_t)i, j);
    }
    m->be->upload(m->be, m->params, host, m->nparams * sizeof(float));
    free(host);
    lb_model_params_changed(m, 0);
}

int lb_model_set_precision(lb_model *m, const lb_precision_spec *spec, uint64_t seed,
                           char *err, size_t errlen)
{
    lb_contract c;
    if (lb_contract_resolve(&c, spec, m->cfg.num_hidden_layers, err, errlen) != 0) return -1;
    lb_contract_free(&m->contract);
    m->contract = c;
    m->lin.contract = &m->contract;
    m->lin.seed = seed;
    m->wcache_stale = 1;
    return 0;
}

void lb_model_params_changed(lb_model *m, uint64_t step)
{
    m->lin.step = step;
    m->wcache_stale = 1;
}

void lb_model_refresh_weights(lb_model *m)
{
    if (!m->wcache_stale) return;
    m->def->weights_refresh(m);
    m->wcache_stale = 0;
}

static void acts_ensure(lb_model *m, int b, int t)
{
    if (m->acts && m->b == b && m->t == t) return;
    acts_release(m);
    lb_backend *be = m->be;
    size_t n = (size_t)b * t;
    m->acts = m->def->acts_create(m, b, t);
    m->logits = be->alloc(be, n * (size_t)m->cfg.vocab_size * sizeof(float));
    m->tokens = be->alloc(be, n * sizeof(int32_t));
    m->targets = be->alloc(be, n * sizeof(int32_t));
    m->b = b;
    m->t = t;
}

float lb_model_forward(lb_model *m, const int32_t *tokens, const int32_t *targets, int b, int t)
{
    if (t > m->cfg.max_position_embeddings)
        lb_die("sequence of %d tokens exceeds max_position_embeddings %d", t,
               m->cfg.max_position_embeddings);
    acts_ensure(m, b, t);
    size_t n = (size_t)b * t;
    for (size_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= m->cfg.vocab_size)
            lb_die("token %d at position %zu is outside the vocabulary (%d)", tokens[i], i,
                   m->cfg.vocab_size);
    m->be->upload(m->be, m->tokens, tokens, n * sizeof(int32_t));
    if (targets) m->be->upload(m->be, m->targets, targets, n * sizeof(int32_t));
    lb_model_refresh_weights(m);
    m->def->forward(m, m->tokens, targets ? m->targets : NULL, b, t);
    return m->loss;
}

void lb_model_backward(lb_model *m, float loss_scale)
{
    if (!m->acts) lb_die("backward called before forward");
    m->def->backward(m, loss_scale);
}

void lb_model_zero_grad(lb_model *m) { m->be->zero(m->be, m->grads, m->nparams * sizeof(float)); }

const lb_tensor *lb_model_find(const lb_model *m, const char *name)
{
    for (int i = 0; i < m->ntensors; i++)
        if (strcmp(m->tensors[i].name, name) == 0) return &m->tensors[i];
    return NULL;
}

int64_t lb_model_active_params(const lb_model *m) { return m->def->active_matmul_params(&m->cfg); }

double lb_model_flops_per_token(const lb_model_config *cfg, int seq_len)
{
    const lb_model_def *def = lb_model_lookup(cfg->arch);
    double active = def ? (double)def->active_matmul_params(cfg) : 0.0;
    // Causal attention: QK^T and PV, 2 FLOPs per multiply-add, half the square, x3 for
    // forward + backward: 6 * t * hq * d per token and layer.
    double attn = 6.0 * cfg->num_hidden_layers * (double)seq_len * cfg->num_attention_heads *
                  cfg->head_dim;
    return 6.0 * active + attn;
}
