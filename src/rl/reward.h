// reward.h: RL rewards. A registry of reward functions in C (name -> function; add one by
// writing the function and one table line in src/rl/reward.c) and an external reward command
// for user tasks (src/rl/reward_cmd.c): a batch of completions per call as JSON lines on its
// stdin, {"prompt": "...", "completion": "...", "answer": "..."}, one number per line on its
// stdout, several calls at once, each under a time limit. A completion's reward is the sum of
// the named functions and the command's number (doc/rl.md).
#ifndef LB_REWARD_H
#define LB_REWARD_H

#include <stddef.h>

// One completion to score.
typedef struct {
    const char *prompt;            // NUL-terminated: the task's text (no chat template)
    const char *answer;            // NUL-terminated reference answer, "" when the task has none
    const char *completion;        // len bytes (the sampled tokens as text, stop token included)
    size_t len;
    int stopped;                   // it ended at a stop token, not at the length limit
} lb_reward_item;

typedef struct {
    double format_reward;          // what arith_format and answer_format pay
    const char *regex;             // answer_regex's pattern ("" none)
    void *code;                    // its compiled PCRE2 code when it holds no {answer}
} lb_reward_ctx;

typedef double (*lb_reward_fn)(const lb_reward_ctx *ctx, const lb_reward_item *it);

typedef struct {
    const char *name;
    lb_reward_fn fn;
    const char *help;
} lb_reward_def;

const lb_reward_def *lb_reward_lookup(const char *name);
int lb_reward_count(void);

#define LB_REWARD_MAX 16

// The external command: `command` under /bin/sh -c, `batch` completions a call, up to
// `workers` calls at once, each killed after `timeout` seconds (0: never), its completions
// then getting `timeout_value`.
typedef struct {
    const char *command;           // NULL: none
    int batch, workers;
    double timeout, timeout_value;
} lb_reward_cmd;

typedef struct {
    double format_reward;
    const char *regex;
    lb_reward_cmd cmd;
} lb_rewards_config;

typedef struct {
    int n;
    const lb_reward_def *fn[LB_REWARD_MAX];
    lb_reward_ctx ctx;
    lb_reward_cmd cmd;
} lb_rewards;

// list: comma-separated names (may be empty when a command is given). -1 with a message that
// lists the registered names on an unknown one, or names a bad regex, or a command sh cannot
// run. Free with lb_rewards_free.
int lb_rewards_init(lb_rewards *r, const char *list, const lb_rewards_config *cfg, char *err,
                    size_t errlen);
void lb_rewards_free(lb_rewards *r);
// 1 when a function of r compares completions with the reference answer.
int lb_rewards_need_answer(const lb_rewards *r);
// Runs the command once on the test item probe (before any work): 0, or -1 with a message
// when it fails, times out, or does not print one number.
int lb_rewards_check(const lb_rewards *r, const lb_reward_item *probe, char *err,
                     size_t errlen);
// The rewards of n completions into out. -1 with a message when the command fails; a call
// past the time limit is not a failure (a warning on stderr, timeout_value for its
// completions).
int lb_rewards_score(const lb_rewards *r, const lb_reward_item *it, int n, double *out,
                     char *err, size_t errlen);
// The command alone on n completions (src/rl/reward_cmd.c). *timed_out (may be NULL) counts
// the completions that got timeout_value.
int lb_reward_command_run(const lb_reward_cmd *c, const lb_reward_item *it, int n, double *out,
                          int *timed_out, char *err, size_t errlen);
// The JSON line of an item, as the command reads it (no newline; malloc'd).
char *lb_reward_item_json(const lb_reward_item *it);

// The final answer of a text (len bytes): the content of its last complete \boxed{...}
// (nested braces kept), else its last number. NUL-terminated into out (cap bytes). 0, or -1
// when it has none.
int lb_answer_final(const char *text, size_t len, char *out, size_t cap);
// 1 when the final answer of completion equals answer: as exact rationals when both are
// numbers (commas of thousands, trailing zeros, $, %, a unit word and \frac{a}{b} aside:
// "1,000" = "1000", "3.50" = "3.5", "1/2" = "0.5" = "\frac{1}{2}", "$5" = "5 cm" = "5"),
// else as text with blanks and $ removed.
int lb_answer_match(const char *completion, size_t len, const char *answer);

#endif
