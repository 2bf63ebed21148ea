// optim.c: gradient reduction over data-parallel ranks, clipping, AdamW (on a ZeRO-1 shard or
// on everything) and the schedule (see optim.h and doc/parallel.md).
#include "src/optim.h"

#include <math.h>
#include <stdlib.h>
#include "kernels/common.h"

static int dp_size(const lb_optimizer *o) { return o->dp ? o->dp->size : 1; }

// Replaces *buf (n floats) by a zero-padded copy of `padded` floats.
static void pad_buffer(lb_backend *be, float **buf, size_t n, size_t padded)
{
    float *p = be->alloc(be, padded * sizeof(float));   // zero-filled
    be->copy(be, p, *buf, n * sizeof(float));
    be->free(be, *buf);
    *buf = p;
}

// The weight-decay runs of the shard: each tensor's part of [lo, hi), merged where neighbours
// decay alike, so the update is a few long AdamW calls that may cut through tensors.
static void build_segments(lb_optimizer *o, size_t lo, size_t hi)
{
    const lb_model *m = o->m;
    o->seg = lb_malloc(((size_t)m->ntensors + 1) * sizeof *o->seg);
    o->nseg = 0;
    for (int i = 0; i < m->ntensors; i++) {
        const lb_tensor *t = &m->tensors[i];
        size_t b = t->offset > lo ? t->offset : lo;
        size_t e = t->offset + t->numel < hi ? t->offset + t->numel : hi;
        if (b >= e) continue;
        float wd = t->is_norm ? 0.0f : (float)o->cfg.weight_decay;   // no decay on norms
        lb_optim_segment *prev = o->nseg ? &o->seg[o->nseg - 1] : NULL;
        if (prev && prev->end == b && prev->wd == wd) prev->end = e;
        else o->seg[o->nseg++] = (lb_optim_segment){b, e, wd};
    }
}

void lb_optimizer_init(lb_optimizer *o, lb_model *m, const lb_optim_config *cfg)
{
    lb_optimizer_init_dp(o, m, cfg, NULL, 0);
}

void lb_optimizer_init_dp(lb_optimizer *o, lb_model *m, const lb_optim_config *cfg, lb_comm *dp,
                          int distributed)
{
    lb_backend *be = m->be;
    o->cfg = *cfg;
    o->m = m;
    o->dp = dp;
    o->distributed = distributed;
    o->grad_shard = NULL;
    int p = dp_size(o);
    size_t n = m->nparams;
    if (distributed && p > 1) {
        // Equal shards (reduce-scatter and all-gather move equal blocks): pad the flat buffers.
        o->padded = (n + (size_t)p - 1) / (size_t)p * (size_t)p;
        o->shard_len = o->padded / (size_t)p;
        o->shard_begin = (size_t)dp->rank * o->shard_len;
        if (o->padded != n) {
            pad_buffer(be, &m->params, n, o->padded);
            pad_buffer(be, &m->grads, n, o->padded);
            lb_model_params_changed(m, m->lin.step);
        }
        o->grad_shard = be->alloc(be, o->shard_len * sizeof(float));
    } else {
        o->padded = n;
        o->shard_begin = 0;
        o->shard_len = n;
    }
    o->adam_m = be->alloc(be, o->shard_len * sizeof(float));
    o->adam_v = be->alloc(be, o->shard_len * sizeof(float));
    size_t hi = o->shard_begin + o->shard_len < n ? o->shard_begin + o->shard_len : n;
    build_segments(o, o->shard_begin, hi);
}

void lb_optimizer_free(lb_optimizer *o)
{
    lb_backend *be = o->m->be;
    be->free(be, o->adam_m);
    be->free(be, o->adam_v);
    if (o->grad_shard) be->free(be, o->grad_shard);
    free(o->seg);
    o->seg = NULL;
}

double lb_optimizer_lr(const lb_optim_config *c, int step)
{
    int warm = c->warmup_steps, total = c->total_steps;
    if (warm > 0 && step <= warm) return c->lr * step / warm;
    if (total <= warm) return c->lr;
    double p = (double)(step - warm) / (double)(total - warm);
    if (p > 1.0) p = 1.0;
    return c->min_lr + 0.5 * (c->lr - c->min_lr) * (1.0 + cos(M_PI * p));
}

double lb_optimizer_step(lb_optimizer *o, int step, double *lr_out)
{
    lb_model *m = o->m;
    lb_backend *be = m->be;
    const lb_optim_config *c = &o->cfg;
    lb_comm *dp = o->dp;
    // g: the summed gradient of the shard, g[0] at parameter shard_begin.
    float *g = m->grads;
    if (dp_size(o) > 1) {
        be->sync(be);   // the backward's gradients are complete before the communicator reads
        if (o->grad_shard) {
            lb_comm_reduce_scatter(dp, m->grads, o->grad_shard, o->shard_len, LB_F32);
            g = o->grad_shard;
        } else {
            lb_comm_all_reduce(dp, m->grads, m->grads, m->nparams, LB_F32);
        }
        lb_comm_sync(dp);
    }
    // The global norm: each shard's sum of squares, summed over the ranks (padding is zero).
    double sumsq = be->sumsq(be, g, o->shard_len);
    if (o->grad_shard) sumsq = lb_comm_allreduce_sum(dp, sumsq);
    double norm = sqrt(sumsq);
    if (c->grad_clip > 0 && norm > c->grad_clip)
        be->scale(be, g, (float)(c->grad_clip / norm), o->shard_len);
    double lr = lb_optimizer_lr(c, step);
    for (int i = 0; i < o->nseg; i++) {
        const lb_optim_segment *s = &o->seg[i];
        size_t k = s->begin - o->shard_begin;
        be->adamw(be, m->params + s->begin, g + k, o->adam_m + k, o->adam_v + k, s->end - s->begin,
                  (float)lr, (float)c->beta1, (float)c->beta2, (float)c->eps, s->wd, step);
    }
    if (o->grad_shard) {
        // Every rank gets every updated shard: the parameters are whole again on every rank.
        be->sync(be);
        lb_comm_all_gather(dp, m->params + o->shard_begin, m->params, o->shard_len, LB_F32);
        lb_comm_sync(dp);
    }
    lb_model_params_changed(m, (uint64_t)step);   // the next forward re-quantizes once
    if (lr_out) *lr_out = lr;
    return norm;
}

void lb_optimizer_state_gather(lb_optimizer *o, float *adam_m, float *adam_v)
{
    lb_backend *be = o->m->be;
    if (!o->grad_shard) {
        be->copy(be, adam_m, o->adam_m, o->shard_len * sizeof(float));
        be->copy(be, adam_v, o->adam_v, o->shard_len * sizeof(float));
        return;
    }
    be->sync(be);
    lb_comm_all_gather(o->dp, o->adam_m, adam_m, o->shard_len, LB_F32);
    lb_comm_all_gather(o->dp, o->adam_v, adam_v, o->shard_len, LB_F32);
    lb_comm_sync(o->dp);
}

void lb_optimizer_state_load(lb_optimizer *o, const float *adam_m, const float *adam_v)
{
    lb_backend *be = o->m->be;
    size_t n = o->m->nparams;
    size_t len = o->shard_begin >= n ? 0
               : (n - o->shard_begin < o->shard_len ? n - o->shard_begin : o->shard_len);
    be->zero(be, o->adam_m, o->shard_len * sizeof(float));   // padding: zero, never updated
    be->zero(be, o->adam_v, o->shard_len * sizeof(float));
    be->copy(be, o->adam_m, adam_m + o->shard_begin, len * sizeof(float));
    be->copy(be, o->adam_v, adam_v + o->shard_begin, len * sizeof(float));
}
