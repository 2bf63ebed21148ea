// optim.c: clipping, AdamW and the schedule (see optim.h).
#include "src/optim.h"

#include <math.h>

void lb_optimizer_init(lb_optimizer *o, lb_model *m, const lb_optim_config *cfg)
{
    o->cfg = *cfg;
    o->m = m;
    o->adam_m = m->be->alloc(m->be, m->nparams * sizeof(float));
    o->adam_v = m->be->alloc(m->be, m->nparams * sizeof(float));
}

void lb_optimizer_free(lb_optimizer *o)
{
    o->m->be->free(o->m->be, o->adam_m);
    o->m->be->free(o->m->be, o->adam_v);
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
    double norm = sqrt(be->sumsq(be, m->grads, m->nparams));
    if (c->grad_clip > 0 && norm > c->grad_clip)
        be->scale(be, m->grads, (float)(c->grad_clip / norm), m->nparams);
    double lr = lb_optimizer_lr(c, step);
    for (int i = 0; i < m->ntensors; i++) {
        const lb_tensor *t = &m->tensors[i];
        float wd = t->is_norm ? 0.0f : (float)c->weight_decay;   // no decay on norms
        be->adamw(be, m->params + t->offset, m->grads + t->offset, o->adam_m + t->offset,
                  o->adam_v + t->offset, t->numel, (float)lr, (float)c->beta1, (float)c->beta2,
                  (float)c->eps, wd, step);
    }
    lb_model_params_changed(m, (uint64_t)step);   // the next forward re-quantizes once
    if (lr_out) *lr_out = lr;
    return norm;
}
