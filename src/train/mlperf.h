// mlperf.h: a training or RL run's MLPerf log (doc/mlperf.md): the keys it logs at init from
// its configuration and model, the evaluation schedule, the target and the run's intervals,
// written through src/io/mllog.h.
#ifndef LB_MLPERF_H
#define LB_MLPERF_H

#include <stddef.h>
#include <stdint.h>

#include "models/model.h"
#include "models/precision/contract.h"
#include "src/cli/config.h"
#include "src/io/mllog.h"

// The lowest element format of the model's GEMMs (every layer, role and pass the model has;
// a backward in BF16 counts as bfloat16) and of attention, in the names of mlperf_logging's
// lowest_numerical_precision_* keys: fp32, bfloat16, fp8, mxfp4, nvfp4.
const char *lb_mllog_precision_linear(const lb_contract *c, const lb_model_def *def,
                                      const lb_model_config *mc);
const char *lb_mllog_precision_attn(const lb_contract *c, const char *kv_cache);

// ---- a run's MLPerf log (train and rl) -----------------------------------------------------

// What a command logs at init beside the [train] optimizer keys (lb_mllog_header).
typedef struct {
    const char *benchmark;         // LB_MLPERF_LLAMA, LB_MLPERF_GRPO
    int64_t global_batch;          // sequences per step
    int64_t micro_batch, grad_accum;   // sequences per forward; forwards per optimizer step and rank
    int64_t max_seq, max_steps, eval_samples, init_step;
    int64_t opt_steps;             // optimizer steps the learning-rate schedule spans
    int world, tp, pp, ep;
    const char *backend;           // run.backend
    const char *linear, *attn;     // lb_mllog_precision_*
    double target;
} lb_mllog_run;

// The evaluation schedule, the target and the run's intervals. Every rank keeps one (the
// decisions are the same everywhere); only rank 0's has a log.
typedef struct {
    lb_mllog *log;                 // NULL: keep the schedule, log nothing
    int root;                      // prints the time to train
    int first, every;              // evaluations after step first, first + every, ...
    int64_t batch;                 // sequences per step: samples_count = step x batch
    double target;
    int higher;                    // the target is an accuracy to exceed (rl), else a loss to reach
    int reached, block_open;
    double t_run;                  // run_start, ms since the epoch
} lb_mlperf;

// Rank 0 (root) opens c's log (mlperf.log_file in run.out_dir, appended when resumed); the
// others keep none. 0, or -1 with a message naming mlperf.log_file.
int lb_mlperf_open(lb_mlperf *p, const lb_config *c, int root, int resumed, char *err,
                   size_t errlen);
// cache_clear, init_start (at t_init_ms), the submission keys, the sizes and the optimizer and
// schedule keys of c's [train], the parallel sizes and the precisions (l NULL: nothing).
void lb_mllog_header(lb_mllog *l, const lb_config *c, const lb_mllog_run *r,
                     double t_init_ms);
// Steps between evaluations: every_seq sequences rounded up to a multiple of the batch.
int lb_mlperf_steps(int64_t seq, int64_t batch);
int lb_mlperf_due(const lb_mlperf *p, int step);
// init_stop, run_start and the first block_start (at samples_count step0 x batch).
void lb_mlperf_run_start(lb_mlperf *p, int step0);
// block_stop and eval_start at step's samples_count, before the evaluation.
void lb_mlperf_eval_start(lb_mlperf *p, int step);
// eval_accuracy and eval_stop, then the next block_start unless acc reaches the target or step
// is the last. Returns whether the target was reached (the run stops).
int lb_mlperf_eval_stop(lb_mlperf *p, int step, int last, double acc);
// The open block's block_stop, run_stop with status success or aborted, train_samples; rank 0
// prints the time to train (run_start to run_stop).
void lb_mlperf_run_stop(lb_mlperf *p, int step);

#endif
