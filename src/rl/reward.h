// reward.h: RL rewards. A registry of reward functions in C (name -> function; add one by
// writing the function and one table line in src/rl/reward.c) and an external reward command for
// user tasks: run once per completion with one JSON line on stdin,
// {"prompt": "...", "completion": "..."}, it prints one number. A completion's reward is the
// sum of the named functions and the command's number (doc/rl.md).
#ifndef LB_REWARD_H
#define LB_REWARD_H

#include <stddef.h>

typedef struct {
    double format_reward;          // what arith_format pays
} lb_reward_ctx;

// prompt: NUL-terminated text; completion: len bytes (the sampled tokens as bytes, stop token
// included).
typedef double (*lb_reward_fn)(const lb_reward_ctx *ctx, const char *prompt,
                               const char *completion, size_t len);

typedef struct {
    const char *name;
    lb_reward_fn fn;
    const char *help;
} lb_reward_def;

const lb_reward_def *lb_reward_lookup(const char *name);
int lb_reward_count(void);

#define LB_REWARD_MAX 16

typedef struct {
    int n;
    const lb_reward_def *fn[LB_REWARD_MAX];
    lb_reward_ctx ctx;
    const char *command;           // "" or NULL: none
} lb_rewards;

// list: comma-separated names (may be empty when a command is given). -1 with a message that
// lists the registered names on an unknown one.
int lb_rewards_init(lb_rewards *r, const char *list, double format_reward, const char *command,
                    char *err, size_t errlen);
// The reward of one completion. -1 with a message when the command fails.
int lb_rewards_score(const lb_rewards *r, const char *prompt, const char *completion, size_t len,
                     double *out, char *err, size_t errlen);
// Runs `command` with /bin/sh -c, the JSON line on its stdin, and parses its stdout as one
// finite number (surrounding blanks allowed). -1 with a message naming the command when it
// cannot start, exits non-zero, is killed, or prints anything else.
int lb_reward_command(const char *command, const char *prompt, const char *completion,
                      size_t len, double *out, char *err, size_t errlen);

#endif
