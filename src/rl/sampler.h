// sampler.h: batched generation on the trainer's model, kernels and weight cache (doc/rl.md).
//
// Prefill and decode go through lb_model_forward_cached (a KV cache built from kernel-set
// operations, bitwise equal per row to the training forward) with continuous batching: up to
// `slots` sequences decode together; a finished sequence leaves at once and the next waiting
// request takes its slot, its prompt prefilled in the same forward calls as the others' decode
// steps. The policy is softmax(logits / temperature); top-k and top-p truncate the draw. Each
// step's draw, stop test and recorded log-probability run on the device (the kernel set's
// `sample`, then cross_entropy_fwd through lb_model_nll_dev, the operation the RL trainer
// recomputes log-probs with: the log-probability under the policy, not the truncated draw);
// only the tokens, done flags and log-probs of the step's rows come back to the host.
//
// Randomness: the draw for completion position p of a request uses
// lb_rand_uniform(req.seed, req.stream, p), so a completion never depends on which other
// requests share its batch, on the slot it gets, or on the order requests finish in.
#ifndef LB_SAMPLER_H
#define LB_SAMPLER_H

#include <stddef.h>
#include <stdint.h>
#include "models/model.h"
#include "src/io/tokenizer.h"

#define LB_SAMPLER_MAX_STOP LB_SAMPLE_MAX_STOP

typedef struct {
    float temperature;             // > 0
    float top_p;                   // (0, 1]; 1 = off
    int top_k;                     // 0 = off; 1 = greedy
    int max_new_tokens;            // completion length limit (stop token included)
    int nstop;
    int32_t stop[LB_SAMPLER_MAX_STOP];   // tokens that end a completion (kept in it)
    int slots;                     // sequences decoded at once
    int max_rows;                  // tokens per forward call (decode rows + prefill chunks)
} lb_sampler_config;

typedef struct {
    // in
    const int32_t *prompt;         // (prompt_len) tokens
    int prompt_len;                // >= 1
    uint64_t seed, stream;         // the request's random numbers (see above)
    // out: (max_new_tokens) buffers the caller provides
    int32_t *tokens;               // completion tokens
    float *logprobs;               // log pi(token) under softmax(logits / temperature)
    int len;                       // completion length
    int stopped;                   // 1: ended by a stop token (the last token); 0: length limit
    // NULL, or (prompt_len + max_new_tokens - 1, routed layers, route_k) the caller provides:
    // the router's choices for every token the sampler fed (the prompt, then the completion
    // but its last token), by position (lb_model.route_log's rows)
    uint16_t *routes;
} lb_sample_req;

typedef struct {
    long forwards;                 // cached forward calls
    long prefill_tokens;           // prompt tokens fed
    long decode_tokens;            // sampled tokens fed back
    long generated;                // tokens sampled
    long idle_forwards;            // of forwards: idle rows for the ep group's lockstep
    long graph_forwards;           // of forwards: replays of a recorded step (graph_record)
    double seconds;
    // Of seconds: the stretches between two downloads of drawn tokens (the only waits) whose
    // forwards fed no prompt rows, and those forwards: the decode steps alone, without the
    // prefill chunks (host work included; a stretch with prompt rows counts as prefill).
    double decode_seconds;
    long decode_forwards;
    // Of decode_seconds: the host's part before each download, queuing the stretch's work (the
    // rest is the wait for the device). Near decode_seconds, the host is what a step waits on.
    double decode_queue_seconds;
} lb_sample_stats;

typedef struct lb_sampler lb_sampler;

// capacity: the longest prompt + max_new_tokens the sampler must hold (<= the model's
// max_position_embeddings). NULL with a message on a bad configuration.
lb_sampler *lb_sampler_create(lb_model *m, const lb_sampler_config *c, int capacity, char *err,
                              size_t errlen);
void lb_sampler_free(lb_sampler *s);
// Generates a completion for every request. On a model piece (lb_model.par) the call is
// collective: the tp ranks pass the same requests and draw the same tokens (checked); the ep
// ranks may pass different requests (or none) and run as many forwards as the busiest needs.
// Returns 0, or -1 with a message (a prompt too long for the capacity, a token outside the
// vocabulary; the same verdict on every tp rank, not on every ep rank). stats may be NULL.
int lb_sampler_run(lb_sampler *s, lb_sample_req *reqs, int n, lb_sample_stats *stats,
                   char *err, size_t errlen);

// The stream of sample `sample` of prompt `prompt` (a hash of both).
uint64_t lb_sample_stream(uint64_t prompt, uint64_t sample);

// The text of n generated tokens (malloc'd, NUL-terminated, *len bytes without it): t's
// decoding token by token, or without a tokenizer (t NULL) a token is a byte. An id with no
// text (past t's vocabulary in a padded model vocabulary, or past 255 without t) reads
// <unk:ID> where mark_unknown, else adds nothing.
char *lb_tokens_text(const lb_tokenizer *t, const int32_t *tok, int n, int mark_unknown,
                     size_t *len);

#endif
