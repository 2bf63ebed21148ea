// prompts.h: `lowbit rl`'s own prompt sets (doc/rl.md, "Your own prompts"): a JSON-lines file
// of objects with a prompt and a reference answer (the keys are configurable), split into
// train and validation prompts by a second file or by a fraction, the train prompts drawn in
// an order that is a pure function of (seed, draw number), and an optional chat template.
#ifndef LB_PROMPTS_H
#define LB_PROMPTS_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    char *prompt;                  // the prompt key's text
    char *answer;                  // the answer key's text (a number as written by %.15g)
    int line;                      // its line in the file
} lb_prompt;

typedef struct {
    int n;
    lb_prompt *p;                  // owned by the set read from the file; splits share them
    int owner;
} lb_prompt_set;

// Reads a JSON-lines file (blank lines skipped) through the strict reader (src/io/json.h):
// every other line one object with a string prompt_key (not empty) and, when answer_key is
// not empty, answer_key as a string or a number. -1 with "path:line: what is wrong".
int lb_prompts_read(const char *path, const char *prompt_key, const char *answer_key,
                    lb_prompt_set *out, char *err, size_t errlen);
void lb_prompts_free(lb_prompt_set *s);
// Holds out round(fraction x n) prompts (at least one when fraction > 0) chosen by seed as
// val, the rest as train, both in file order; they share all's strings. -1 with a message
// when train would be empty.
int lb_prompts_split(const lb_prompt_set *all, double fraction, uint64_t seed,
                     lb_prompt_set *train, lb_prompt_set *val, char *err, size_t errlen);

// The order train prompts are drawn in: draw i is prompt perm_e[i mod n] where e = i / n and
// perm_e is a permutation drawn from (seed, e): every prompt once per pass, and a resumed run
// draws what the uninterrupted one drew.
typedef struct {
    uint64_t seed;
    int n;
    int64_t epoch;                 // the pass perm holds, -1 none yet
    int *perm;
} lb_prompt_order;

void lb_prompt_order_init(lb_prompt_order *o, uint64_t seed, int n);
int lb_prompt_order_at(lb_prompt_order *o, uint64_t i);
void lb_prompt_order_free(lb_prompt_order *o);

// The chat template tmpl with {prompt} replaced by prompt and \n, \t, \\ as the bytes
// (a parameter file's value is one line). malloc'd; NULL with a message when tmpl holds no
// {prompt}.
char *lb_chat_apply(const char *tmpl, const char *prompt, char *err, size_t errlen);

#endif
