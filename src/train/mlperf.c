// mlperf.c: a training or RL run's MLPerf log (see mlperf.h).
#include "src/train/mlperf.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// Bits of an element format, for "lowest".
static int format_bits(lb_format f)
{
    switch (f) {
    case LB_FMT_FP32: return 32;
    case LB_FMT_BF16: return 16;
    case LB_FMT_FP8_BLOCK: case LB_FMT_MXFP8: case LB_FMT_FP8_TENSOR: return 8;
    default: return 4;
    }
}

static const char *format_mlperf(lb_format f)
{
    switch (f) {
    case LB_FMT_FP32: return "fp32";
    case LB_FMT_BF16: return "bfloat16";
    case LB_FMT_FP8_BLOCK: case LB_FMT_MXFP8: case LB_FMT_FP8_TENSOR: return "fp8";
    case LB_FMT_MXFP4: return "mxfp4";
    default: return "nvfp4";
    }
}

const char *lb_mllog_precision_linear(const lb_contract *c, const lb_model_def *def,
                                      const lb_model_config *mc)
{
    lb_format low = LB_FMT_FP32;
    for (int l = 0; l < c->layers; l++) {
        int moe = lb_model_layer_moe(def, mc, l);
        for (int r = 0; r < LB_NROLES; r++) {
            int expert = r == LB_ROLE_MOE_GATE_UP || r == LB_ROLE_MOE_DOWN || r == LB_ROLE_ROUTER;
            int dense = r == LB_ROLE_MLP_GATE_UP || r == LB_ROLE_MLP_DOWN;
            // the roles this layer has: a dense layer no experts, a MoE layer no dense MLP
            // unless shared experts (which run as a dense MLP) stand beside the routed ones
            if ((expert && !moe) || (dense && moe && mc->n_shared_experts == 0)) continue;
            for (int p = 0; p < LB_NPASSES; p++) {
                const lb_site *s = lb_contract_site(c, l, (lb_role)r, (lb_pass)p);
                lb_format f = s->fmt;
                // a backward in BF16 on the (de)quantized operands
                if (p != LB_PASS_FPROP && s->mode != LB_BWD_QUANTIZED && format_bits(f) < 16)
                    f = LB_FMT_BF16;
                if (format_bits(f) < format_bits(low)) low = f;
            }
        }
    }
    return format_mlperf(low);
}

const char *lb_mllog_precision_attn(const lb_contract *c, const char *kv_cache)
{
    if (kv_cache && !strcmp(kv_cache, "fp8")) return "fp8";
    return c->attention_bf16 ? "bfloat16" : "fp32";
}

// ---- a run's MLPerf log -------------------------------------------------------------------

void lb_mllog_header(lb_mllog *l, const lb_config *c, const lb_mllog_run *r, double t_init_ms)
{
    if (!l) return;
    char b[64];
    lb_mllog_emit(l, __FILE__, __LINE__, t_init_ms, LB_MLLOG_POINT, "cache_clear",
                  c->mlperf.cache_cleared ? "true" : "false", NULL);
    lb_mllog_emit(l, __FILE__, __LINE__, t_init_ms, LB_MLLOG_START, "init_start", "null", NULL);
    LB_MLLOG_STR(l, "submission_benchmark", r->benchmark);
    LB_MLLOG_STR(l, "submission_org", c->mlperf.submission_org);
    LB_MLLOG_STR(l, "submission_division", c->mlperf.division);
    LB_MLLOG_STR(l, "submission_status", "onprem");
    char platform[160];
    if (c->mlperf.submission_platform[0])
        snprintf(platform, sizeof platform, "%s", c->mlperf.submission_platform);
    else snprintf(platform, sizeof platform, "%dx%s", r->world, r->backend);
    LB_MLLOG_STR(l, "submission_platform", platform);
    LB_MLLOG_INT(l, "seed", (int64_t)c->run.seed);
    LB_MLLOG_INT(l, "global_batch_size", r->global_batch);
    LB_MLLOG_INT(l, "micro_batch_size", r->micro_batch);
    LB_MLLOG_INT(l, "gradient_accumulation_steps", r->grad_accum);
    LB_MLLOG_INT(l, "max_sequence_length", r->max_seq);
    LB_MLLOG_INT(l, "max_steps", r->max_steps);
    LB_MLLOG_INT(l, "init_checkpoint_step", r->init_step);
    LB_MLLOG_INT(l, "eval_samples", r->eval_samples);
    LB_MLLOG_STR(l, "opt_name", "adamw");
    LB_MLLOG_NUM(l, "opt_base_learning_rate", c->train.lr);
    // lb_optimizer_lr: linear warm-up, then cosine to min_lr at the last optimizer step
    LB_MLLOG_NUM(l, "opt_end_learning_rate", c->train.min_lr);
    LB_MLLOG_NUM(l, "opt_adamw_beta_1", c->train.beta1);
    LB_MLLOG_NUM(l, "opt_adamw_beta_2", c->train.beta2);
    LB_MLLOG_NUM(l, "opt_adamw_epsilon", c->train.adam_eps);
    LB_MLLOG_NUM(l, "opt_adamw_weight_decay", c->train.weight_decay);
    LB_MLLOG_NUM(l, "opt_gradient_clip_norm", c->train.grad_clip);
    int warm = c->train.warmup_steps < r->opt_steps ? c->train.warmup_steps : (int)r->opt_steps;
    LB_MLLOG_INT(l, "opt_learning_rate_warmup_steps", warm);
    LB_MLLOG_INT(l, "opt_learning_rate_decay_steps", r->opt_steps - warm);
    LB_MLLOG_STR(l, "opt_learning_rate_decay_schedule",
                 warm == 0 && c->train.lr == c->train.min_lr ? "constant"
                                                             : "cosine with linear warmup");
    LB_MLLOG_INT(l, "tensor_parallelism", r->tp);
    LB_MLLOG_INT(l, "pipeline_parallelism", r->pp);
    LB_MLLOG_INT(l, "expert_parallelism", r->ep);
    LB_MLLOG_STR(l, "lowest_numerical_precision_in_linear", r->linear);
    LB_MLLOG_STR(l, "lowest_numerical_precision_in_attn", r->attn);
    // collectives move fp32 and fp64 (parallel/comm.h); one rank communicates nothing
    if (r->world > 1) LB_MLLOG_STR(l, "lowest_numerical_precision_in_comm", "fp32");
    LB_MLLOG_POINT_AT(l, "target_accuracy", lb_mllog_num(b, r->target));
}

int lb_mlperf_open(lb_mlperf *p, const lb_config *c, int root, int resumed, char *err,
                   size_t errlen)
{
    p->root = root;
    if (!root) return 0;
    p->log = lb_mllog_open(c->run.out_dir, c->mlperf.log_file, resumed, err, errlen);
    if (!p->log) snprintf(err + strlen(err), errlen - strlen(err), " (mlperf.log_file)");
    return p->log ? 0 : -1;
}

int lb_mlperf_steps(int64_t seq, int64_t batch)
{
    int64_t s = (seq + batch - 1) / batch;
    return s < 1 ? 1 : (int)s;
}

int lb_mlperf_due(const lb_mlperf *p, int step)
{
    return step >= p->first && (step - p->first) % p->every == 0;
}

void lb_mlperf_run_start(lb_mlperf *p, int step0)
{
    p->t_run = lb_mllog_now_ms();
    p->block_open = 1;
    lb_mllog_emit(p->log, __FILE__, __LINE__, p->t_run, LB_MLLOG_END, "init_stop", "null", NULL);
    lb_mllog_emit(p->log, __FILE__, __LINE__, p->t_run, LB_MLLOG_START, "run_start", "null",
                  NULL);
    LB_MLLOG_SAMPLES(p->log, LB_MLLOG_START, "block_start", step0 * p->batch);
}

void lb_mlperf_eval_start(lb_mlperf *p, int step)
{
    LB_MLLOG_SAMPLES(p->log, LB_MLLOG_END, "block_stop", step * p->batch);
    p->block_open = 0;
    LB_MLLOG_SAMPLES(p->log, LB_MLLOG_START, "eval_start", step * p->batch);
}

int lb_mlperf_eval_stop(lb_mlperf *p, int step, int last, double acc)
{
    char v[64], m[64];
    snprintf(m, sizeof m, "\"samples_count\": %lld", (long long)(step * p->batch));
    lb_mllog_emit(p->log, __FILE__, __LINE__, -1, LB_MLLOG_POINT, "eval_accuracy",
                  lb_mllog_num(v, acc), m);
    LB_MLLOG_SAMPLES(p->log, LB_MLLOG_END, "eval_stop", step * p->batch);
    p->reached = p->higher ? acc > p->target : acc <= p->target;
    if (!p->reached && step < last) {
        LB_MLLOG_SAMPLES(p->log, LB_MLLOG_START, "block_start", step * p->batch);
        p->block_open = 1;
    }
    return p->reached;
}

void lb_mlperf_run_stop(lb_mlperf *p, int step)
{
    if (p->block_open) LB_MLLOG_SAMPLES(p->log, LB_MLLOG_END, "block_stop", step * p->batch);
    p->block_open = 0;
    double t = lb_mllog_now_ms();
    const char *status = p->reached ? "success" : "aborted";
    char m[96], b[64];
    snprintf(m, sizeof m, "\"samples_count\": %lld, \"status\": \"%s\"",
             (long long)(step * p->batch), status);
    lb_mllog_emit(p->log, __FILE__, __LINE__, t, LB_MLLOG_END, "run_stop", "null", m);
    LB_MLLOG_POINT_AT(p->log, "train_samples", lb_mllog_int(b, step * p->batch));
    if (p->root) {
        if (p->reached)
            printf("mlperf: target %g reached at %lld samples; time to train %.3f s (run_start "
                   "to run_stop)\n", p->target, (long long)(step * p->batch), (t - p->t_run) / 1e3);
        else
            printf("mlperf: target %g not reached in %lld samples (status aborted); %.3f s from "
                   "run_start to run_stop\n", p->target, (long long)(step * p->batch),
                   (t - p->t_run) / 1e3);
        fflush(stdout);
    }
}
