// mllog.h: the MLPerf log ([mlperf], doc/mlperf.md). `:::MLLOG {...}` lines in the format of
// mlcommons/logging's mllog (namespace, time_ms, event_type, key, value, metadata with file and
// lineno), written by rank 0 only; and our own check of such a log against the keys, values and
// order of the llama31_8b and qwen35_397b_grpo rules (`lowbit mlperf-check`).
#ifndef LB_MLLOG_H
#define LB_MLLOG_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include "models/precision/contract.h"
#include "models/model.h"
#include "src/cli/config.h"

// The benchmarks whose keys lowbit logs: `lowbit train` as llama31_8b, `lowbit rl` as
// qwen35_397b_grpo.
#define LB_MLPERF_LLAMA "llama31_8b"
#define LB_MLPERF_GRPO "qwen35_397b_grpo"

typedef enum { LB_MLLOG_POINT, LB_MLLOG_START, LB_MLLOG_END } lb_mllog_type;

typedef struct lb_mllog lb_mllog;

// Opens OUT_DIR/FILE ("-": stdout) for a new run (emptied) or a resumed one (appended). NULL
// with "path: reason" in err.
lb_mllog *lb_mllog_open(const char *out_dir, const char *file, int resumed, char *err,
                        size_t errlen);
void lb_mllog_close(lb_mllog *l);   // NULL: nothing
// Milliseconds since the Unix epoch (mllog's time_ms).
double lb_mllog_now_ms(void);

// One line. time_ms < 0: now. value: JSON text ("null", "8192", "\"adamw\""); meta: further
// metadata members without braces ("\"samples_count\": 24") or NULL. file and line are the
// call site (the macros below pass them). l NULL: nothing.
void lb_mllog_emit(lb_mllog *l, const char *file, int line, double time_ms, lb_mllog_type type,
                   const char *key, const char *value, const char *meta);
// Values as JSON text into buf (at least 64 bytes; strings: 2 x strlen + 8): numbers in their
// shortest form that reads back the same double (1e-05, 0.95, 1.0), strings escaped.
const char *lb_mllog_num(char *buf, double v);
const char *lb_mllog_int(char *buf, int64_t v);
const char *lb_mllog_str(char *buf, size_t len, const char *s);

#define LB_MLLOG_POINT_AT(l, key, value) \
    lb_mllog_emit(l, __FILE__, __LINE__, -1, LB_MLLOG_POINT, key, value, NULL)

// Shorthands for a key with a number, an integer or a string value.
#define LB_MLLOG_NUM(l, key, v) \
    do { char b_[64]; LB_MLLOG_POINT_AT(l, key, lb_mllog_num(b_, v)); } while (0)
#define LB_MLLOG_INT(l, key, v) \
    do { char b_[64]; LB_MLLOG_POINT_AT(l, key, lb_mllog_int(b_, v)); } while (0)
#define LB_MLLOG_STR(l, key, s) \
    do { char b_[1100]; LB_MLLOG_POINT_AT(l, key, lb_mllog_str(b_, sizeof b_, s)); } while (0)
// An interval's start or end with samples_count (samples < 0: no metadata).
#define LB_MLLOG_SAMPLES(l, type, key, samples)                                           \
    do {                                                                                  \
        char m_[64];                                                                      \
        snprintf(m_, sizeof m_, "\"samples_count\": %lld", (long long)(samples));        \
        lb_mllog_emit(l, __FILE__, __LINE__, -1, type, key, "null", (samples) < 0 ? NULL : m_); \
    } while (0)

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

// The log at path checked (doc/mlperf.md): the benchmark's keys present as often as its rules
// say, in the order init_start < config keys < init_stop < run_start < blocks and evaluations
// < run_stop, their values as the rules constrain them, and a target reached when the status is
// success. strict: also the benchmark's fixed sizes (max_sequence_length, max_steps,
// eval_samples, the target, the evaluation points, the batch-scaled learning rate and clip);
// otherwise they are only checked to agree with each other. Prints each problem as
// "path:line: key: what is wrong" to out; returns the number of problems, or -1 when the file
// cannot be read (message in out).
int lb_mllog_check(const char *path, int strict, FILE *out);

#endif
