// rl.h: pieces `lowbit rl` (src/rl/rl.c) and `lowbit sample` (src/rl/sample_cmd.c) share: the model
// configuration of a checkpoint, the sampler's settings and layouts, and the arithmetic task's
// prompts.
#ifndef LB_RL_H
#define LB_RL_H

#include <stddef.h>
#include <stdint.h>
#include "src/cli/config.h"
#include "src/cli/run.h"
#include "src/rl/sampler.h"

// The layouts the sampler runs: no pipeline or sequence parallelism. -1 with a file:line
// message naming `who` (the command) otherwise.
int lb_sampler_check_layout(const lb_config *c, const lb_grid *g, const char *who, char *err,
                            size_t errlen);

// The [sample] keys as a sampler configuration (stop tokens parsed). -1 with a message.
int lb_rl_sampler_config(const lb_config *c, lb_sampler_config *out, char *err, size_t errlen);

// The arithmetic task (gen.seed, gen.max_operand, gen.val_fraction: the corpus `lowbit data`
// writes). The prompt of problem i is its text up to and including '=' ("17+25="), preceded
// by a newline as every problem but the first is in the corpus. Returns its length (buf >= 64).
int lb_arith_prompt(const lb_config *c, uint64_t i, char *buf);
// Longest prompt the task can produce.
int lb_arith_prompt_max(const lb_config *c);
// Index of the k-th (from 0) problem of a split in index order (val = 1: held out). The split
// must not be empty (val with gen.val_fraction 0 never returns).
uint64_t lb_arith_nth(const lb_config *c, int val, uint64_t k);

#endif
