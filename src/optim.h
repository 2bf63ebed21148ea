// optim.h: the optimizer step shared by `train` and `rl`: global-norm clipping, AdamW with
// decoupled weight decay (none on norm weights), the learning-rate schedule, and the weight
// cache refresh that follows every update.
#ifndef LB_OPTIM_H
#define LB_OPTIM_H

#include "models/model.h"

typedef struct {
    double lr, min_lr;
    int warmup_steps, total_steps;     // linear warm-up, then cosine to min_lr at total_steps
    double beta1, beta2, eps, weight_decay, grad_clip;
} lb_optim_config;

typedef struct {
    lb_optim_config cfg;
    lb_model *m;
    float *adam_m, *adam_v;            // (nparams) backend memory, same layout as the params
} lb_optimizer;

void lb_optimizer_init(lb_optimizer *o, lb_model *m, const lb_optim_config *cfg);
void lb_optimizer_free(lb_optimizer *o);
double lb_optimizer_lr(const lb_optim_config *c, int step);     // step counts from 1
// Clips m->grads to grad_clip (global L2 norm), applies AdamW for optimizer step `step`, and
// marks the weight cache stale. Returns the gradient norm before clipping.
double lb_optimizer_step(lb_optimizer *o, int step, double *lr_out);

#endif
