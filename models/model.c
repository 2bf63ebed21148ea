// model.c: the model object shared by every definition: parameter layout, initialisation,
// and the forward/backward entry points that move tokens to the backend.
#include "models/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kernels/common.h"

// Cuts tensor t (whole, from the definition) into the piece of the rank at par.
static int cut(lb_tensor *t, const lb_model_parallel *p, char *err, size_t errlen)
{
    for (int d = 0; d < 3; d++) {
        t->gshape[d] = t->shape[d];
        t->parts[d] = t->groups[d] = 1;
        t->index[d] = 0;
    }
    int d0 = -1, d1 = -1, g = 1;   // the dim cut over ep, the dim cut over tp, its sub-blocks
    switch (t->split) {
    case LB_SPLIT_NONE: break;
    case LB_SPLIT_COL: d1 = 0; break;
    case LB_SPLIT_COL2: d1 = 0; g = 2; break;
    case LB_SPLIT_ROW: d1 = 1; break;
    case LB_SPLIT_EXPERT_COL2: d0 = 0; d1 = 1; g = 2; break;
    case LB_SPLIT_EXPERT_ROW: d0 = 0; d1 = 2; break;
    }
    if (d0 >= 0) {
        t->parts[d0] = p->ep;
        t->index[d0] = p->ep_rank;
    }
    if (d1 >= 0) {   // experts over etp, dense tensors over tp
        t->parts[d1] = d0 >= 0 ? p->etp : p->tp;
        t->index[d1] = d0 >= 0 ? p->etp_rank : p->tp_rank;
        t->groups[d1] = g;
    }
    for (int d = 0; d < t->ndim; d++) {
        int64_t k = (int64_t)t->parts[d] * t->groups[d];
        if (t->gshape[d] % k != 0) {
            snprintf(err, errlen, "%s: dimension %d (%lld) does not divide into %lld pieces",
                     t->name, d, (long long)t->gshape[d], (long long)k);
            return -1;
        }
        t->shape[d] = t->gshape[d] / t->parts[d];
    }
    t->expert = t->split == LB_SPLIT_EXPERT_COL2 || t->split == LB_SPLIT_EXPERT_ROW;
    t->tp_replicated = t->split == LB_SPLIT_NONE;
    t->tp_sum = p->tp > 1 && (t->tpgrad == LB_TPGRAD_PARTIAL ||
                              (t->tpgrad == LB_TPGRAD_PARTIAL_SP && p->sp));
    t->numel = 1;
    for (int d = 0; d < t->ndim; d++) t->numel *= (size_t)t->shape[d];
    return 0;
}

static lb_model_parallel one_rank(void)
{
    lb_model_parallel p;
    memset(&p, 0, sizeof p);
    p.tp = p.ep = p.pp = p.etp = 1;
    return p;
}

lb_model_parallel lb_model_parallel_of(const lb_grid *g, lb_comm *tp, lb_comm *ep)
{
    lb_model_parallel p = {g->tp, g->tp_rank, g->sequence_parallel && g->tp > 1, g->ep,
                           g->ep_rank, g->pp, g->pp_rank, g->tp > 1 ? tp : NULL,
                           g->ep > 1 ? ep : NULL, g->etp, g->etp_rank, NULL};
    // only a grid made by lb_grid_create has communicators (the grid outlives the model)
    if (g->has_comms && g->etp > 1) p.etp_comm = (lb_comm *)&g->etp_comm;
    return p;
}

// etp 0 stands for tp; etp must divide tp.
static int complete(lb_model_parallel *p, char *err, size_t errlen)
{
    if (p->etp == 0) {
        p->etp = p->tp;
        p->etp_rank = p->tp_rank;
    }
    if (p->etp < 1 || p->tp % p->etp != 0) {
        snprintf(err, errlen, "expert tensor parallelism %d does not divide tensor parallelism %d",
                 p->etp, p->tp);
        return -1;
    }
    return 0;
}

// The decoder layers of stage s: [s L / pp, (s + 1) L / pp).
static void stage_layers(const lb_model_config *cfg, const lb_model_parallel *p, int *b, int *e)
{
    int per = cfg->num_hidden_layers / p->pp;
    *b = p->pp_rank * per;
    *e = *b + per;
}

lb_tensor *lb_model_pieces(const lb_model_config *cfg, const lb_model_parallel *par, int *n,
                           char *err, size_t errlen)
{
    const lb_model_def *def = lb_model_lookup(cfg->arch);
    lb_model_parallel p = par ? *par : one_rank();
    if (!def) {
        snprintf(err, errlen, "unknown model arch '%s'", cfg->arch);
        return NULL;
    }
    if (complete(&p, err, errlen) != 0) return NULL;
    if (cfg->num_hidden_layers % p.pp != 0) {
        snprintf(err, errlen, "%d layers do not divide into %d pipeline stages",
                 cfg->num_hidden_layers, p.pp);
        return NULL;
    }
    int ng = def->tensors(cfg, NULL), lb, le, L = cfg->num_hidden_layers;
    lb_tensor *t = lb_calloc(ng, sizeof *t);
    def->tensors(cfg, t);
    stage_layers(cfg, &p, &lb, &le);
    int k = 0;
    for (int i = 0; i < ng; i++) {
        int l = t[i].layer;
        int mine = (l >= lb && l < le) || (l < 0 && p.pp_rank == 0) ||
                   (l >= L && p.pp_rank == p.pp - 1);
        if (!mine) continue;
        lb_tensor x = t[i];
        x.global = i;
        if (cut(&x, &p, err, errlen) != 0) {
            free(t);
            return NULL;
        }
        t[k++] = x;
    }
    *n = k;
    return t;
}

size_t lb_tensor_global_index(const lb_tensor *t, size_t j)
{
    size_t idx[3] = {0, 0, 0}, g = 0;
    for (int d = t->ndim - 1; d >= 0; d--) {
        idx[d] = j % (size_t)t->shape[d];
        j /= (size_t)t->shape[d];
    }
    for (int d = 0; d < t->ndim; d++) {
        size_t S = (size_t)t->gshape[d] / t->groups[d];   // a cut sub-block of the whole
        size_t s = S / t->parts[d];                       // its piece
        size_t gi = idx[d] / s * S + (size_t)t->index[d] * s + idx[d] % s;
        g = g * (size_t)t->gshape[d] + gi;
    }
    return g;
}

void lb_tensor_take(const lb_tensor *t, const float *whole, float *piece)
{
    for (size_t j = 0; j < t->numel; j++) piece[j] = whole[lb_tensor_global_index(t, j)];
}

void lb_tensor_put(const lb_tensor *t, const float *piece, float *whole)
{
    for (size_t j = 0; j < t->numel; j++) whole[lb_tensor_global_index(t, j)] = piece[j];
}

// Offsets: region 0 (everything but experts), then region 1 (experts), each padded.
static void lay_out(lb_model *m, const size_t align[2])
{
    size_t off = 0;
    for (int r = 0; r < 2; r++) {
        m->region_begin[r] = off;
        for (int i = 0; i < m->ntensors; i++) {
            lb_tensor *t = &m->tensors[i];
            if (t->expert != r) continue;
            t->offset = off;
            off += t->numel;
        }
        size_t a = align[r] ? align[r] : 1, len = off - m->region_begin[r];
        m->region_len[r] = (len + a - 1) / a * a;
        off = m->region_begin[r] + m->region_len[r];
    }
    m->nparams = off;
}

lb_model *lb_model_create_parallel(const lb_model_config *cfg, lb_backend *be,
                                   const lb_model_parallel *par, char *err, size_t errlen)
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
    m->par = par ? *par : one_rank();
    if (m->par.tp == 1) m->par.sp = 0;
    if (complete(&m->par, err, errlen) != 0) {
        free(m);
        return NULL;
    }
    m->tensors = lb_model_pieces(cfg, &m->par, &m->ntensors, err, errlen);
    if (!m->tensors) {
        free(m);
        return NULL;
    }
    stage_layers(cfg, &m->par, &m->layer_begin, &m->layer_end);
    m->first_stage = m->par.pp_rank == 0;
    m->last_stage = m->par.pp_rank == m->par.pp - 1;
    m->gtensors = lb_model_pieces(cfg, NULL, &m->nglobal, err, errlen);   // the whole tensors
    m->gparams = 0;
    for (int i = 0; i < m->nglobal; i++) {   // laid out one after another, in table order
        m->gtensors[i].offset = m->gparams;
        m->gparams += m->gtensors[i].numel;
    }
    const size_t one[2] = {1, 1};
    lay_out(m, one);
    lb_alloc_what("the fp32 parameters and gradients (spread the model with parallel.tp, pp "
                  "or ep)");
    m->params = be->alloc(be, m->nparams * sizeof(float));   // zero-filled
    m->grads = be->alloc(be, m->nparams * sizeof(float));
    lb_alloc_what(NULL);
    m->wcache = lb_calloc(m->ntensors, sizeof *m->wcache);
    m->grad_fresh = lb_calloc(m->ntensors, 1);
    m->lin.be = be;
    m->lin.expert0 = m->par.ep_rank * (cfg->num_experts / m->par.ep);   // ep divides (checked)
    m->lin.etp = m->par.etp_comm;   // NULL when etp is 1
    lb_precision_spec fp32;
    memset(&fp32, 0, sizeof fp32);   // the fp32 recipe
    if (lb_model_set_precision(m, &fp32, 0, err, errlen) != 0) lb_die("%s", err);
    return m;
}

lb_model *lb_model_create(const lb_model_config *cfg, lb_backend *be, char *err, size_t errlen)
{
    return lb_model_create_parallel(cfg, be, NULL, err, errlen);
}

void lb_model_align(lb_model *m, const size_t align[2])
{
    lb_backend *be = m->be;
    size_t *old = lb_malloc((size_t)m->ntensors * sizeof *old);
    for (int i = 0; i < m->ntensors; i++) old[i] = m->tensors[i].offset;
    lay_out(m, align);
    float *p = be->alloc(be, m->nparams * sizeof(float));   // zero-filled: the padding
    for (int i = 0; i < m->ntensors; i++)
        be->copy(be, p + m->tensors[i].offset, m->params + old[i],
                 m->tensors[i].numel * sizeof(float));
    be->free(be, m->params);
    be->free(be, m->grads);
    m->params = p;
    m->grads = be->alloc(be, m->nparams * sizeof(float));   // zero-filled: nothing fresh
    memset(m->grad_fresh, 0, (size_t)m->ntensors);
    free(old);
    lb_model_params_changed(m, m->lin.step);
}

static void acts_release(lb_model *m)
{
    if (!m->acts) return;
    m->def->acts_free(m, m->acts);
    if (m->logits) m->be->free(m->be, m->logits);
    m->be->free(m->be, m->tokens);
    m->be->free(m->be, m->targets);
    m->acts = NULL;
    m->logits = NULL;
    m->logit_cap = 0;
    m->tokens = m->targets = NULL;
}

void lb_model_use_slot(lb_model *m, int s)
{
    int n = (int)(sizeof m->slot / sizeof m->slot[0]);
    if (s < 0 || s >= n) lb_die("activation slot %d: the model keeps 0..%d", s, n - 1);
    if (s == m->cur_slot) return;
    struct lb_model_slot *c = &m->slot[m->cur_slot], *x = &m->slot[s];
    *c = (struct lb_model_slot){m->b, m->t, m->acts, m->logits, m->logit_cap, m->tokens,
                                m->targets};
    m->b = x->b;
    m->t = x->t;
    m->acts = x->acts;
    m->logits = x->logits;
    m->logit_cap = x->logit_cap;
    m->tokens = x->tokens;
    m->targets = x->targets;
    m->cur_slot = s;
}

// A stage's rows of hidden states: this rank's (n / tp under sequence parallelism).
static size_t stage_rows(const lb_model *m)
{
    size_t n = (size_t)m->b * m->t;
    return m->par.sp ? n / m->par.tp : n;
}

size_t lb_model_stage_floats(const lb_model *m)
{
    const size_t c = (size_t)m->cfg.hidden_size;
    // a bf16 stream: rows of pad8(c) bf16 values, two to a 32-bit word
    return stage_rows(m) * (m->plan && m->plan[0].residual ? (c + 7) / 8 * 4 : c);
}

size_t lb_model_stage_grad_floats(const lb_model *m)
{
    return stage_rows(m) * (size_t)m->cfg.hidden_size;
}

float *lb_model_stage_input(lb_model *m) { return m->def->stage_input(m); }
float *lb_model_stage_output(lb_model *m) { return m->def->stage_output(m); }
float *lb_model_stage_grad(lb_model *m) { return m->def->stage_grad(m); }

void lb_model_free(lb_model *m)
{
    if (!m) return;
    for (int s = 0; s < (int)(sizeof m->slot / sizeof m->slot[0]); s++) {
        lb_model_use_slot(m, s);
        acts_release(m);
    }
    if (m->route_dev) m->be->free(m->be, m->route_dev);
    free(m->expert_load);
    free(m->moe_stats);
    if (m->lp_cap) {
        m->be->free(m->be, m->lp_loss);
        m->be->free(m->be, m->lp_w);
        m->be->free(m->be, m->lp_targets);
    }
    for (int i = 0; i < m->ntensors; i++) lb_wcache_free(&m->lin, &m->wcache[i]);
    free(m->wcache);
    free(m->grad_fresh);
    lb_linear_free(&m->lin);
    lb_contract_free(&m->contract);
    m->be->free(m->be, m->params);
    m->be->free(m->be, m->grads);
    free(m->tensors);
    free(m->gtensors);
    free(m->layer_tensors);
    free(m->plan);
    free(m);
}

void lb_model_init_params(lb_model *m, uint64_t seed)
{
    // Drawn on the host from (seed, whole tensor's index, element index in the whole tensor),
    // so every backend and every layout starts from the same numbers.
    float *host = lb_calloc(m->nparams, sizeof(float));
    for (int i = 0; i < m->ntensors; i++) {
        const lb_tensor *t = &m->tensors[i];
        float *p = host + t->offset;
        const float std = (float)m->cfg.initializer_range;
        // A whole tensor's element j is its global element j: lb_tensor_global_index's
        // divisions (up to 15 an element) took as long as drawing the number.
        int whole = 1;
        for (int d = 0; d < t->ndim; d++) whole &= t->parts[d] == 1;
        // Each value depends only on (seed, tensor, element), so threads change nothing.
        #pragma omp parallel for schedule(static) if (t->numel > 65536)
        for (size_t j = 0; j < t->numel; j++)
            p[j] = t->is_norm     ? 1.0f
                   : t->zero_init ? 0.0f
                                  : std * lb_rand_normal(seed, (uint64_t)t->global,
                                                     whole ? j : lb_tensor_global_index(t, j));
    }
    m->be->upload(m->be, m->params, host, m->nparams * sizeof(float));
    free(host);
    lb_model_params_changed(m, 0);
}

// The activation plan for the model's contract, layout and KV cache kind.
static void plan_make(lb_model *m)
{
    const size_t L = (size_t)m->cfg.num_hidden_layers;   // at least 1 (lb_decoder_check)
    if (!m->plan) m->plan = lb_calloc(L, sizeof *m->plan);
    memset(m->plan, 0, L * sizeof *m->plan);
    if (m->def->plan) m->def->plan(m, m->plan);
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
    plan_make(m);
    return 0;
}

void lb_model_params_changed(lb_model *m, uint64_t step)
{
    m->lin.step = step;
    m->wcache_stale = 1;
    for (int i = 0; i < m->ntensors; i++) m->wcache[i].b16_fresh = 0;
}

// Tensor i's cache holds a bf16 copy laid out as the tensor is (count x out rows of in, no
// padding), so the optimizer can write it element for element.
static int b16_flat(const lb_model *m, int i)
{
    const lb_wcache *c = &m->wcache[i];
    return c->b16 && c->in % 8 == 0 && (size_t)c->count * c->out * c->in == m->tensors[i].numel;
}

uint16_t *lb_model_b16_run(lb_model *m, size_t begin, size_t end, size_t *run_end)
{
    size_t e = end;
    for (int i = 0; i < m->ntensors; i++) {
        const lb_tensor *t = &m->tensors[i];
        if (!b16_flat(m, i)) continue;
        if (t->offset == begin && t->offset + t->numel <= end) {
            *run_end = t->offset + t->numel;
            return m->wcache[i].b16;
        }
        if (t->offset > begin && t->offset < e) e = t->offset;   // the next copy starts there
    }
    *run_end = e;
    return NULL;
}

void lb_model_b16_written(lb_model *m, size_t begin, size_t end)
{
    for (int i = 0; i < m->ntensors; i++)
        if (b16_flat(m, i) && m->tensors[i].offset == begin &&
            m->tensors[i].offset + m->tensors[i].numel == end)
            m->wcache[i].b16_fresh = 1;
}

void lb_model_refresh_weights(lb_model *m)
{
    if (!m->wcache_stale) return;
    lb_alloc_what("the precision recipe's weight caches (bf16 and quantized copies)");
    m->def->weights_refresh(m);
    lb_alloc_what(NULL);
    m->wcache_stale = 0;
}

// m->logits holds at least bytes (grow-only; the last stage's alone).
static void logits_ensure(lb_model *m, size_t bytes)
{
    if (!m->last_stage || bytes <= m->logit_cap) return;
    if (m->logits) m->be->free(m->be, m->logits);
    m->logits = m->be->alloc(m->be, bytes);
    m->logit_cap = bytes;
}

static void acts_ensure(lb_model *m, int b, int t)
{
    if (m->acts && m->b == b && m->t == t) return;
    acts_release(m);
    lb_backend *be = m->be;
    size_t n = (size_t)b * t;
    char what[200];
    snprintf(what, sizeof what, "the activations of a %d x %d micro-batch (lower "
             "train.micro_batch, or set train.recompute = selective or full)", b, t);
    lb_alloc_what(what);
    m->acts = m->def->acts_create(m, b, t);
    m->b = b;
    m->t = t;
    size_t rows = m->par.sp ? n / m->par.tp : n;   // sequence parallel: this rank's rows
    logits_ensure(m, (size_t)lb_model_ce_rows(m, (int)rows) * lb_model_logit_row_bytes(m));
    m->tokens = be->alloc(be, n * sizeof(int32_t));
    m->targets = be->alloc(be, n * sizeof(int32_t));
    lb_alloc_what(NULL);
}

void lb_model_prepare(lb_model *m, int b, int t) { acts_ensure(m, b, t); }

static size_t route_words(const lb_model *m, size_t n)
{
    const int k = m->def->route_k ? m->def->route_k(&m->cfg) : 0;
    return (size_t)(m->layer_end - m->layer_begin) * n * k;
}

int32_t *lb_model_route_stage(lb_model *m, size_t n)
{
    const size_t need = route_words(m, n);
    if (need > m->route_cap) {
        if (m->route_dev) m->be->free(m->be, m->route_dev);
        m->route_dev = m->be->alloc(m->be, need * sizeof(int32_t));
        m->route_cap = need;
    }
    return m->route_dev;
}

// route_log's rows of an n-row forward, staged by its layers, in one download: a download a
// layer made the device wait for the host four times a decode step of the 4-layer bench.
static void route_fetch(lb_model *m, size_t n)
{
    if (m->route_log && route_words(m, n))
        m->be->download(m->be, m->route_log, lb_model_route_stage(m, n),
                        route_words(m, n) * sizeof(int32_t));
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
    if (!targets)   // every row's logits, fp32
        logits_ensure(m, (m->par.sp ? n / m->par.tp : n) * (size_t)m->cfg.vocab_size * 4);
    m->be->upload(m->be, m->tokens, tokens, n * sizeof(int32_t));
    if (targets) m->be->upload(m->be, m->targets, targets, n * sizeof(int32_t));
    m->target_count = 0;
    for (size_t i = 0; targets && i < n; i++) m->target_count += targets[i] >= 0;
    lb_model_refresh_weights(m);
    m->def->forward(m, m->tokens, targets ? m->targets : NULL, b, t);
    route_fetch(m, n);
    return m->loss;
}

float lb_model_forward_train(lb_model *m, const int32_t *tokens, const int32_t *targets, int b,
                             int t, float loss_scale)
{
    if (!targets) lb_die("lb_model_forward_train: a training forward needs targets");
    m->head_bwd = 1;
    m->head_scale = loss_scale;
    float loss = lb_model_forward(m, tokens, targets, b, t);
    m->head_bwd = 0;
    return loss;
}

void lb_model_backward(lb_model *m, float loss_scale)
{
    if (!m->acts) lb_die("backward called before forward");
    m->def->backward(m, loss_scale);
    lb_model_grad_settle(m);
}

// Zeroes everything but the wgrad_gemm tensors, in runs of neighbours (lay_out's order: region
// by region, tensors in table order; the padding is in the runs and stays zero), and marks
// those fresh.
void lb_model_zero_grad(lb_model *m)
{
    size_t from = 0;   // start of the run of floats to zero
    for (int r = 0; r < 2; r++)
        for (int i = 0; i < m->ntensors; i++) {
            const lb_tensor *t = &m->tensors[i];
            if (t->expert != r || !t->wgrad_gemm) continue;
            if (t->offset > from)
                m->be->zero(m->be, m->grads + from, (t->offset - from) * sizeof(float));
            from = t->offset + t->numel;
            m->grad_fresh[i] = 1;
        }
    if (m->nparams > from) m->be->zero(m->be, m->grads + from, (m->nparams - from) * sizeof(float));
}

float lb_model_grad_beta(lb_model *m, const float *dw)
{
    for (int i = 0; i < m->ntensors; i++) {
        const lb_tensor *t = &m->tensors[i];
        if (dw < m->grads + t->offset || dw >= m->grads + t->offset + t->numel) continue;
        if (!t->wgrad_gemm)
            lb_die("lb_model_grad_beta: %s is not written by wgrads alone", t->name);
        if (!m->grad_fresh[i]) return 1.0f;
        m->grad_fresh[i] = 0;
        return 0.0f;
    }
    lb_die("lb_model_grad_beta: %p is not in a tensor's gradient", (const void *)dw);
}

void lb_model_grad_settle(lb_model *m)
{
    for (int i = 0; i < m->ntensors; i++)
        if (m->grad_fresh[i]) {
            const lb_tensor *t = &m->tensors[i];
            m->be->zero(m->be, m->grads + t->offset, t->numel * sizeof(float));
            m->grad_fresh[i] = 0;
        }
}

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

// --- sampling and RL ---------------------------------------------------------------------------

void lb_model_set_kv_fp8(lb_model *m, int on)
{
    // the training activations' q and k are bf16 only without the fp8 cache's fake
    // quantization (lb_blocks_qk16): made again for the new kind at the next step
    if (m->acts && !!on != m->kv_fp8) acts_release(m);
    m->kv_fp8 = !!on;
    plan_make(m);
}

int lb_model_set_kv_cache(lb_model *m, lb_kv_kind kind, char *err, size_t errlen)
{
    const int fp8 = kind == LB_KV_FP8, fp32 = kind == LB_KV_FP32;
    if (kind == LB_KV_BF16 && !m->contract.attention_bf16) {
        snprintf(err, errlen, "KV cache bf16 needs bf16 attention (precision.attention), "
                 "which this recipe runs in fp32");
        return -1;
    }
    lb_model_set_kv_fp8(m, fp8);
    m->kv_fp32 = fp32;
    return 0;
}

int lb_model_kv_bf16(const lb_model *m)
{
    return !m->kv_fp8 && !m->kv_fp32 && m->contract.attention_bf16;
}

void lb_model_set_ce_chunk(lb_model *m, int rows) { m->ce_chunk = rows > 0 ? rows : 0; }

void lb_model_act_plan(const lb_model *m, lb_act_plan *p)
{
    memset(p, 0, sizeof *p);
    p->layers = m->layer_end - m->layer_begin;
    for (int l = m->layer_begin; l < m->layer_end; l++) {
        const lb_layer_plan *q = &m->plan[l];
        p->residual += q->residual;
        p->qk += q->qk;
        p->qk_in += q->qk_in;
        p->ln1 += q->ln1;
        p->att += q->att;
        p->ln2 += q->ln2;
        if (!lb_model_layer_moe(m->def, &m->cfg, l) || m->cfg.n_shared_experts > 0)
            p->mlp_layers++;
        p->mlp_gate_up_out += q->mlp_gate_up_out;
        p->mlp_swiglu_out += q->mlp_swiglu_out;
        if (!lb_model_layer_moe(m->def, &m->cfg, l)) continue;
        p->moe_layers++;
        p->expert_in += q->expert_in;
        p->gate_up_out += q->gate_up_out;
        p->swiglu_out += q->swiglu_out;
        p->down_dgrad += q->down_dgrad;
    }
}

int lb_model_logits16(const lb_model *m)
{
    // every pass a plain bf16 GEMM: the logits meet bf16 products anyway
    return lb_linear_plain16(&m->lin, m->cfg.num_hidden_layers - 1, LB_ROLE_LM_HEAD);
}

size_t lb_model_logit_row_bytes(const lb_model *m)
{
    const size_t v = (size_t)m->cfg.vocab_size;
    return lb_model_logits16(m) ? (v + 7) / 8 * 8 * sizeof(uint16_t) : v * sizeof(float);
}

int lb_model_ce_rows(const lb_model *m, int rows)
{
    size_t fit = m->ce_chunk > 0 ? (size_t)m->ce_chunk
                                 : LB_CE_CHUNK_BYTES / lb_model_logit_row_bytes(m) / 64 * 64;
    if (fit < 64) fit = 64;
    return fit < (size_t)rows ? (int)fit : rows;
}

void lb_model_set_recompute(lb_model *m, int how)
{
    if (how < LB_RECOMPUTE_NONE || how > LB_RECOMPUTE_FULL)
        lb_die("lb_model_set_recompute: mode %d", how);
    m->recompute = how;
}

size_t lb_kvcache_bytes(const lb_model *m, int slots, int capacity, int logit_rows)
{
    const lb_model_config *c = &m->cfg;
    size_t hkv = (size_t)(c->num_key_value_heads / m->par.tp), d = (size_t)c->head_dim;
    size_t row = m->kv_fp8 ? d + (d + 127) / 128 * sizeof(float)
                 : lb_model_kv_bf16(m) ? (d + 15) / 16 * 16 * sizeof(uint16_t) : d * sizeof(float);
    return 2 * (size_t)c->num_hidden_layers * slots * capacity * hkv * row +
           (size_t)logit_rows * c->vocab_size * sizeof(float);
}

lb_kvcache *lb_kvcache_create(lb_model *m, int slots, int capacity, int max_rows,
                              int logit_rows)
{
    const lb_model_config *c = &m->cfg;
    lb_backend *be = m->be;
    if (slots < 1 || capacity < 1 || max_rows < 1)
        lb_die("KV cache: slots (%d), capacity (%d) and max_rows (%d) must be positive", slots,
               capacity, max_rows);
    if (logit_rows < 1 || logit_rows > max_rows)
        lb_die("KV cache: %d logits rows for %d rows a call", logit_rows, max_rows);
    if (capacity > c->max_position_embeddings)
        lb_die("KV cache: capacity %d exceeds max_position_embeddings %d", capacity,
               c->max_position_embeddings);
    if (!m->def->forward_cached)
        lb_die("model %s has no cached forward", c->arch);
    if (m->par.pp > 1 || m->par.sp)
        lb_die("KV cache: sampling runs without pipeline or sequence parallelism");
    lb_kvcache *kv = lb_calloc(1, sizeof *kv);
    kv->slots = slots;
    kv->capacity = capacity;
    kv->max_rows = max_rows;
    kv->logit_rows = logit_rows;
    kv->fp8 = m->kv_fp8;
    kv->bf16 = lb_model_kv_bf16(m);
    // this rank's kv heads under tensor parallelism
    int L = c->num_hidden_layers, hkv = c->num_key_value_heads / m->par.tp, d = c->head_dim;
    size_t rows = (size_t)slots * capacity * hkv;
    kv->layer = lb_calloc(L, sizeof *kv->layer);
    lb_alloc_what("the sampler's KV cache and rows (lower sample.slots, sample.max_rows or the "
                  "prompt and completion lengths)");
    for (int l = 0; l < L; l++) {
        lb_kv_layer *y = &kv->layer[l];
        *y = (lb_kv_layer){.fp8 = kv->fp8, .slots = slots, .cap = capacity, .hkv = hkv,
                           .d = d, .bf16 = kv->bf16};
        size_t elem = kv->fp8 ? 1 : kv->bf16 ? sizeof(uint16_t) : sizeof(float);
        y->k = be->alloc(be, rows * lb_kv_ld(y) * elem);   // zero-filled: bf16 pads are 0
        y->v = be->alloc(be, rows * lb_kv_ld(y) * elem);
        if (kv->fp8) {
            size_t nb = ((size_t)d + 127) / 128;
            y->ks = be->alloc(be, rows * nb * sizeof(float));
            y->vs = be->alloc(be, rows * nb * sizeof(float));
        }
    }
    kv->logits = be->alloc(be, (size_t)logit_rows * c->vocab_size * sizeof(float));
    kv->rows_dev = be->alloc(be, 3 * (size_t)max_rows * sizeof(int32_t));
    kv->rows_host = lb_malloc(3 * (size_t)max_rows * sizeof(int32_t));
    kv->acts = m->def->cached_create(m, max_rows);
    lb_alloc_what(NULL);
    return kv;
}

void lb_kvcache_free(lb_model *m, lb_kvcache *kv)
{
    if (!kv) return;
    lb_backend *be = m->be;
    for (int l = 0; l < m->cfg.num_hidden_layers; l++) {
        lb_kv_layer *y = &kv->layer[l];
        be->free(be, y->k);
        be->free(be, y->v);
        if (y->ks) be->free(be, y->ks);
        if (y->vs) be->free(be, y->vs);
    }
    free(kv->layer);
    m->def->cached_free(m, kv->acts);
    be->free(be, kv->logits);
    be->free(be, kv->rows_dev);
    free(kv->rows_host);
    free(kv);
}

void lb_model_forward_cached(lb_model *m, lb_kvcache *kv, const int32_t *tokens,
                             const int32_t *slot, const int32_t *pos, int n)
{
    if (n < 1 || n > kv->max_rows)
        lb_die("cached forward of %d tokens; the cache takes 1..%d per call", n, kv->max_rows);
    for (int i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= m->cfg.vocab_size)
            lb_die("token %d of row %d is outside the vocabulary (%d)", tokens[i], i,
                   m->cfg.vocab_size);
        if (slot[i] < 0 || slot[i] >= kv->slots || pos[i] < 0 || pos[i] >= kv->capacity)
            lb_die("row %d at (slot %d, position %d) is outside the KV cache (%d slots of %d "
                   "positions)", i, slot[i], pos[i], kv->slots, kv->capacity);
    }
    // one upload: (tokens, slot, pos) side by side, n each
    lb_backend *be = m->be;
    memcpy(kv->rows_host, tokens, (size_t)n * sizeof(int32_t));
    memcpy(kv->rows_host + n, slot, (size_t)n * sizeof(int32_t));
    memcpy(kv->rows_host + 2 * (size_t)n, pos, (size_t)n * sizeof(int32_t));
    be->upload(be, kv->rows_dev, kv->rows_host, 3 * (size_t)n * sizeof(int32_t));
    lb_model_forward_cached_dev(m, kv, kv->rows_dev, n, NULL, 0);
}

void lb_model_forward_cached_dev(lb_model *m, lb_kvcache *kv, const int32_t *rows, int n,
                                 const int32_t *lrows, int nl)
{
    lb_model_refresh_weights(m);   // the sampler reads the weights the last step wrote
    lb_model_forward_cached_queue(m, kv, rows, n, lrows, nl);
    route_fetch(m, (size_t)n);
}

void lb_model_route_fetch(lb_model *m, int n) { route_fetch(m, (size_t)n); }

int lb_model_cached_host_free(lb_model *m)
{
    return m->def->cached_host_free && m->def->cached_host_free(m);
}

void lb_model_forward_cached_queue(lb_model *m, lb_kvcache *kv, const int32_t *rows, int n,
                                   const int32_t *lrows, int nl)
{
    if (n < 1 || n > kv->max_rows)
        lb_die("cached forward of %d tokens; the cache takes 1..%d per call", n, kv->max_rows);
    if (lrows && (nl < 0 || nl > n))
        lb_die("cached forward of %d tokens with logits for %d of them", n, nl);
    if ((lrows ? nl : n) > kv->logit_rows)
        lb_die("cached forward with logits for %d rows; the cache holds %d", lrows ? nl : n,
               kv->logit_rows);
    kv->lrows = lrows;
    kv->nl = lrows ? nl : n;
    if (kv->fp8 != m->kv_fp8)
        lb_die("KV cache made with kv_fp8 %d, model now has %d", kv->fp8, m->kv_fp8);
    if (kv->bf16 && !m->contract.attention_bf16)
        lb_die("KV cache of bf16 rows, but the model's attention now runs in fp32");
    kv->tokens = rows;
    kv->slot = rows + n;
    kv->pos = rows + 2 * (size_t)n;
    m->def->forward_cached(m, kv, n);
}

// Grow-only scratch for n rows of log-prob work.
static void lp_ensure(lb_model *m, int n)
{
    if (n <= m->lp_cap) return;
    lb_backend *be = m->be;
    if (m->lp_cap) {
        be->free(be, m->lp_loss);
        be->free(be, m->lp_w);
        be->free(be, m->lp_targets);
    }
    m->lp_loss = be->alloc(be, (size_t)n * sizeof(float));
    m->lp_w = be->alloc(be, (size_t)n * sizeof(float));
    m->lp_targets = be->alloc(be, (size_t)n * sizeof(int32_t));
    m->lp_cap = n;
}

void lb_model_temper(lb_model *m, float *logits, int n, float inv_temp)
{
    if (inv_temp != 1.0f) m->be->scale(m->be, logits, inv_temp, (size_t)n * m->cfg.vocab_size);
}

// lp = -cross_entropy_fwd(logits, targets_dev); targets (host) zeroes the ignored rows.
static void logprobs_dev(lb_model *m, const float *logits, const int32_t *targets_dev,
                         const int32_t *targets, int n, float *lp)
{
    lb_backend *be = m->be;
    lp_ensure(m, n);
    be->cross_entropy_fwd(be, m->lp_loss, NULL, logits, targets_dev, n, m->cfg.vocab_size);
    be->download(be, lp, m->lp_loss, (size_t)n * sizeof(float));
    for (int i = 0; i < n; i++) lp[i] = targets[i] < 0 ? 0.0f : -lp[i];
}

void lb_model_nll_dev(lb_model *m, const float *logits, const int32_t *targets, int n,
                      float *nll)
{
    m->be->cross_entropy_fwd(m->be, nll, NULL, logits, targets, n, m->cfg.vocab_size);
}

void lb_model_forward_logprobs(lb_model *m, const int32_t *tokens, const int32_t *targets,
                               int b, int t, float inv_temp, float *lp)
{
    int n = b * t;
    lb_model_forward(m, tokens, NULL, b, t);
    m->be->upload(m->be, m->targets, targets, (size_t)n * sizeof(int32_t));
    lb_model_temper(m, m->logits, n, inv_temp);
    m->lp_inv_temp = inv_temp;
    logprobs_dev(m, m->logits, m->targets, targets, n, lp);
}

void lb_model_backward_logprobs(lb_model *m, const float *dlp, float aux_scale)
{
    if (!m->acts) lb_die("backward called before forward");
    lb_backend *be = m->be;
    int n = m->b * m->t;
    lp_ensure(m, n);
    // lp = -CE(logits * inv_temp): d/d logits = -dlp * inv_temp * (softmax - onehot)
    float *w = lb_malloc((size_t)n * sizeof(float));
    for (int i = 0; i < n; i++) w[i] = -dlp[i] * m->lp_inv_temp;
    be->upload(be, m->lp_w, w, (size_t)n * sizeof(float));
    free(w);
    be->cross_entropy_bwd_rows(be, m->logits, m->logits, NULL, m->targets, m->lp_w, n,
                               m->cfg.vocab_size);
    m->def->backward_logits(m, aux_scale);
    lb_model_grad_settle(m);
}

void lb_model_moe_stats_begin(lb_model *m)
{
    const lb_model_config *c = &m->cfg;
    if (!m->def->moe) return;
    free(m->moe_stats);
    m->moe_stats = lb_calloc((size_t)c->num_hidden_layers * (c->num_experts + 2), sizeof(double));
}

void lb_model_moe_stats_end(lb_model *m, lb_comm *all, double *load_max, double *load_min,
                            double *entropy)
{
    const lb_model_config *c = &m->cfg;
    const size_t L = (size_t)c->num_hidden_layers, E = (size_t)c->num_experts, w = E + 2;
    double *sum = m->def->moe ? lb_calloc(L * w, sizeof(double)) : NULL;
    if (sum && m->moe_stats) {
        if (all && all->size > 1) lb_comm_all_reduce(all, m->moe_stats, sum, L * w, LB_F64);
        else memcpy(sum, m->moe_stats, L * w * sizeof(double));
    }
    for (size_t l = 0; l < L; l++) {
        const double *row = sum ? sum + l * w : NULL;
        double total = 0.0, hi = 0.0, lo = INFINITY;
        for (size_t j = 0; row && j < E; j++) {
            total += row[j];
            hi = row[j] > hi ? row[j] : hi;
            lo = row[j] < lo ? row[j] : lo;
        }
        const int none = !row || !lb_model_layer_moe(m->def, c, (int)l) || row[E + 1] == 0.0;
        load_max[l] = none ? NAN : hi / (total / (double)E);
        load_min[l] = none ? NAN : lo / (total / (double)E);
        entropy[l] = none ? NAN : row[E] / row[E + 1];
    }
    free(sum);
    free(m->moe_stats);
    m->moe_stats = NULL;
}

void lb_model_after_step(lb_model *m, lb_comm *all)
{
    if (m->def->after_step) m->def->after_step(m, all);
}
