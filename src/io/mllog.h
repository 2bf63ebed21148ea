// mllog.h: the MLPerf log ([mlperf], doc/mlperf.md). `:::MLLOG {...}` lines in the format of
// mlcommons/logging's mllog (namespace, time_ms, event_type, key, value, metadata with file and
// lineno), written by rank 0 only; and our own check of such a log against the keys, values and
// order of the llama31_8b and qwen35_397b_grpo rules (`lowbit mlperf-check`). What a training
// or RL run logs, from its configuration, is src/train/mlperf.h.
#ifndef LB_MLLOG_H
#define LB_MLLOG_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

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
