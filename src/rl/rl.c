// rl.c: `lowbit rl`: GRPO with the sampler inside the trainer (doc/rl.md).
//
// One step: P prompts of the arithmetic task's train split or of rl.prompts_file's train
// prompts (src/rl/prompts.h), G completions each from the sampler (the model's own weights and
// weight cache; nothing is copied), rewards from the registry and the optional command (all of
// a rank's completions in one call, src/rl/reward.h), group-normalised advantages, then the
// trainer recomputes every response token's log-prob with the training forward (lp_old: the
// policy that sampled), and M mini-batches each take one optimizer step on GRPO's clipped,
// token-mean objective (src/rl/grpo.h), the gradient entering at the logits through per-token
// weights. The optimizer
// step marks the weight cache stale; the next rollout's first forward re-quantizes it. Under
// mpirun the prompts are split over the data-parallel ranks; under tensor and expert
// parallelism the model, the reference and the optimizer are pieces as in `lowbit train`, and
// the ranks keep their collective forwards in step (doc/rl.md).
#include "src/rl/rl.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kernels/common.h"
#include "src/io/checkpoint.h"
#include "src/cli/commands.h"
#include "src/io/data.h"
#include "src/rl/grpo.h"
#include "src/train/optim.h"
#include "src/rl/prompts.h"
#include "src/rl/reward.h"
#include "src/cli/run.h"
#include "src/io/metrics.h"
#include "src/train/mlperf.h"
#include "src/io/tokenizer.h"
#include "src/io/files.h"
#include "parallel/grid.h"

#define ERRLEN 2048
#define LB_RL_PROMPT_STREAM 0x524c50726f6d7074ull   // rollout prompt choice ("RLPrompt")
#define LB_RL_EVAL_SEED 0x6576616cull               // offline evaluation draws ("eval")

// ---- shared with `lowbit sample` ---------------------------------------------------------------

int lb_rl_sampler_config(const lb_config *c, lb_sampler_config *o, char *err, size_t errlen)
{
    memset(o, 0, sizeof *o);
    o->temperature = (float)c->sample.temperature;
    o->top_p = (float)c->sample.top_p;
    o->top_k = c->sample.top_k;
    o->max_new_tokens = c->sample.max_new_tokens;
    o->slots = c->sample.slots;
    o->max_rows = c->sample.max_rows;
    char where[LB_PATH_MAX + 32];
    for (const char *p = c->sample.stop_tokens; *p;) {
        while (*p == ' ' || *p == ',') p++;
        if (!*p) break;
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || (*end && *end != ',' && *end != ' ') || v < 0 ||
            v >= c->model.vocab_size) {
            snprintf(err, errlen, "%ssample.stop_tokens: '%s' is not a list of token ids below "
                     "the vocabulary size %d", lb_key_where(c, "sample", "stop_tokens", where,
                                                            sizeof where),
                     c->sample.stop_tokens, c->model.vocab_size);
            return -1;
        }
        if (o->nstop == LB_SAMPLER_MAX_STOP) {
            snprintf(err, errlen, "%ssample.stop_tokens: more than %d tokens",
                     lb_key_where(c, "sample", "stop_tokens", where, sizeof where),
                     LB_SAMPLER_MAX_STOP);
            return -1;
        }
        o->stop[o->nstop++] = (int32_t)v;
        p = end;
    }
    if (o->max_rows < o->slots) {
        snprintf(err, errlen, "%ssample.max_rows (%d) is smaller than sample.slots (%d): every "
                 "running sequence feeds one token per forward",
                 lb_key_where(c, "sample", "max_rows", where, sizeof where), o->max_rows,
                 o->slots);
        return -1;
    }
    return 0;
}

int lb_arith_prompt(const lb_config *c, uint64_t i, char *buf)
{
    char text[64];
    lb_arith_problem(c->gen.seed, i, c->gen.max_operand, text);
    size_t eq = strcspn(text, "=");
    return snprintf(buf, 64, "\n%.*s", (int)eq + 1, text);
}

int lb_arith_prompt_max(const lb_config *c)
{
    char probe[64];
    return snprintf(probe, sizeof probe, "\n%d+%d=", c->gen.max_operand, c->gen.max_operand);
}

uint64_t lb_arith_nth(const lb_config *c, int val, uint64_t k)
{
    for (uint64_t i = 0;; i++)
        if (lb_arith_is_val(c->gen.seed, i, c->gen.val_fraction) == val && k-- == 0) return i;
}

// ---- lowbit rl ---------------------------------------------------------------------------------

// One completion of a rollout and what the trainer needs of it.
typedef struct {
    const char *text;              // the task's text, as the rewards see it (no template)
    const char *answer;            // its reference answer
    const int32_t *ptok;           // the prompt's tokens (template applied)
    int plen;
    char abuf[64];                 // an arithmetic problem's own: "\n17+25=", its tokens,
    int32_t atok[64];              // its answer
    char aans[24];
    int32_t *tok;                  // (max_new_tokens)
    float *lp_roll;                // (max_new_tokens) sampler log-probs
    float *lp_old;                 // (max_new_tokens) trainer log-probs before the update
    int len;
    int correct;                   // the answer is right (the task's own check, for metrics)
    uint16_t *routes;              // (T, layers, route_k) the sampler's routes, or NULL
} rl_seq;

typedef struct {
    double pass1, passk, greedy;
    int problems;
} rl_eval;

// The prompts of rl.prompts_file: train and validation, each prompt's tokens (template
// applied), and the train prompts' draw order.
typedef struct {
    lb_prompt_set all, train, val;   // all owns the strings; val from rl.val_file owns its own
    int32_t **tok[2];              // [0] train, [1] val: each prompt's tokens
    int *ntok[2];
    lb_prompt_order order;
    int max_tokens;                // the longest prompt
} rl_prompts;

// Prompt i of the train (val 0) or validation (1) prompts as q's.
static void file_fill(const rl_prompts *f, int val, int i, rl_seq *q)
{
    const lb_prompt *p = &(val ? &f->val : &f->train)->p[i];
    q->text = p->prompt;
    q->answer = p->answer;
    q->ptok = f->tok[val][i];
    q->plen = f->ntok[val][i];
}

// text (n bytes) as tokens into a malloc'd array (*ntok of them): its bytes, or data.tokenizer's
// ids (tk).
static int32_t *encode_text(const lb_tokenizer *tk, const char *text, size_t n, int *ntok)
{
    int32_t *out;
    if (!tk) {
        out = lb_malloc((n ? n : 1) * sizeof *out);
        for (size_t i = 0; i < n; i++) out[i] = (unsigned char)text[i];
        *ntok = (int)n;
        return out;
    }
    char err[ERRLEN];
    lb_tokens t = {0};
    if (lb_tokenizer_encode(tk, text, n, &t, err, sizeof err) != 0)
        lb_die("rl: prompt \"%s\" through data.tokenizer: %s", text, err);
    out = lb_malloc((t.n ? t.n : 1) * sizeof *out);
    for (size_t i = 0; i < t.n; i++) out[i] = (int32_t)t.ids[i];
    *ntok = (int)t.n;
    lb_tokens_free(&t);
    return out;
}

// Arithmetic problem pi as q's prompt: "\n17+25=" (the newline that precedes every problem in
// the corpus), its tokens (a byte-level BPE token holds at least one byte, so they fit atok and
// the byte count bounds T) and its answer.
static void arith_fill(const lb_config *c, const lb_tokenizer *tk, uint64_t pi, rl_seq *q)
{
    int n = lb_arith_prompt(c, pi, q->abuf), nt;
    int32_t *t = encode_text(tk, q->abuf, (size_t)n, &nt);
    if (nt > n)   // not byte-level BPE: T's bound would not hold
        lb_die("rl: prompt \"%s\" is %d tokens of data.tokenizer, more than its %d bytes",
               q->abuf, nt, n);
    memcpy(q->atok, t, (size_t)nt * sizeof *t);
    free(t);
    long v = 0;
    q->text = q->abuf + 1;
    lb_arith_answer(q->text, &v);
    snprintf(q->aans, sizeof q->aans, "%ld", v);
    q->answer = q->aans;
    q->ptok = q->atok;
    q->plen = nt;
}


// Whether a completion answers its prompt: the arithmetic task's own check (an integer up to
// the newline), or the final answer against the reference (lb_answer_match) for a prompts
// file.
static int seq_correct(const lb_tokenizer *tk, int file, const rl_seq *q, const int32_t *tok,
                       int len)
{
    size_t n;
    long want, got;
    char *text = lb_tokens_text(tk, tok, len, 0, &n);
    int ok = file ? lb_answer_match(text, n, q->answer)
                  : lb_arith_answer(q->text, &want) == 0 &&
                    lb_arith_parse_completion(text, n, &got) == 0 && got == want;
    free(text);
    return ok;
}

// Data parallelism (doc/rl.md): item j of a list (prompt j of a step, evaluation problem j)
// belongs to data-parallel rank j mod dp.
static int owns(const lb_comm *dp, int j) { return j % dp->size == dp->rank; }

// v holds n items of `per` doubles in global order, each rank having filled its own; afterwards
// every rank holds all of them. Values are moved, never summed, so what is computed from them
// in global order is bit for bit what one rank computes.
static void share_items(lb_comm *dp, double *v, int n, int per)
{
    if (dp->size == 1) return;
    size_t rows = (size_t)(n + dp->size - 1) / dp->size, w = (size_t)per;   // items per rank
    double *mine = lb_calloc(rows * w, sizeof *mine);
    double *all = lb_malloc(rows * w * dp->size * sizeof *all);
    for (int j = dp->rank, k = 0; j < n; j += dp->size, k++)
        memcpy(mine + k * w, v + j * w, w * sizeof *v);
    lb_comm_all_gather(dp, mine, all, rows * w, LB_F64);
    for (int j = 0; j < n; j++)
        memcpy(v + j * w, all + ((size_t)(j % dp->size) * rows + (size_t)(j / dp->size)) * w,
               w * sizeof *v);
    free(mine);
    free(all);
}

// The largest x over a group (comm.h sums only).
static double max_over(lb_comm *g, double x)
{
    if (g->size == 1) return x;
    double *all = lb_malloc((size_t)g->size * sizeof *all);
    lb_comm_host_all_gather(g, &x, all, sizeof x);
    for (int r = 0; r < g->size; r++) x = fmax(x, all[r]);
    free(all);
    return x;
}

// Expert parallelism: every forward and backward is collective over ep (the token all-to-all),
// so every rank of an ep group runs as many micro-batches as the busiest one (n: this rank's)
// and fills the rest with idle ones. The tp ranks of a data-parallel rank hold the same
// sequences, so they count alike without asking.
static int rounds_over(lb_comm *ep, int n) { return (int)max_over(ep, (double)n); }

// An idle micro-batch: one sequence of padding with no response token (targets -1) through the
// collective forwards a real one runs (the policy; when training, the reference too) and, when
// training, the backward with d loss / d lp = 0 and the load-balancing weight 0. Every gradient
// it adds, here and on the ep ranks whose experts its rows visit, is 0 times finite values:
// exactly zero. Its log-probs are discarded.
static void idle_micro_batch(lb_model *m, lb_model *ref, int T, float inv_temp, int train,
                             int32_t *tok, int32_t *tgt, float *lp, float *dlp)
{
    for (int t = 0; t < T; t++) tok[t] = 0, tgt[t] = -1, dlp[t] = 0.0f;
    lb_model_forward_logprobs(m, tok, tgt, 1, T, inv_temp, lp);
    if (!train) return;
    if (ref) lb_model_forward_logprobs(ref, tok, tgt, 1, T, inv_temp, lp);
    lb_model_backward_logprobs(m, dlp, 0.0f);
}

// pass@1 (mean share of correct samples), pass@k (share of problems with one correct) over the
// first eval_problems held-out problems, k = eval_samples draws each; greedy: top-1 decoding.
// Each data-parallel rank samples its own problems; the per-problem counts are shared and the
// scores summed in problem order, as on one rank.
static rl_eval evaluate(const lb_config *c, const lb_tokenizer *tk, const rl_prompts *fp,
                        lb_sampler *smp, lb_sampler *greedy, int max_new, lb_comm *dp)
{
    // a prompts file: its first eval_problems validation prompts (all, when fewer)
    int P = fp && fp->val.n < c->rl.eval_problems ? fp->val.n : c->rl.eval_problems;
    int K = c->rl.eval_samples;
    rl_eval ev = {0, 0, 0, P};
    if (P == 0) return ev;
    char err[ERRLEN];
    int np = 0;   // this rank's problems
    for (int i = 0; i < P; i++) np += owns(dp, i);
    rl_seq *qs = lb_calloc((size_t)np, sizeof *qs);
    lb_sample_req *reqs = lb_calloc((size_t)np * K, sizeof *reqs);
    int32_t *tok = lb_malloc((size_t)np * K * max_new * sizeof(int32_t));
    float *lp = lb_malloc((size_t)np * K * max_new * sizeof(float));
    double *res = lb_calloc((size_t)P * 2, sizeof *res);   // per problem: correct samples, greedy
    for (int i = dp->rank, k = 0; i < P; i += dp->size, k++) {
        uint64_t pi = fp ? (uint64_t)i : lb_arith_nth(c, 1, (uint64_t)i);
        if (fp) file_fill(fp, 1, i, &qs[k]);
        else arith_fill(c, tk, pi, &qs[k]);
        for (int s = 0; s < K; s++) {
            lb_sample_req *r = &reqs[k * K + s];
            r->prompt = qs[k].ptok;
            r->prompt_len = qs[k].plen;
            // the same draws at every evaluation: steps differ only by the weights
            r->seed = lb_hash64(c->sample.seed ^ LB_RL_EVAL_SEED);
            r->stream = lb_sample_stream(pi, (uint64_t)s);
            r->tokens = tok + (size_t)(k * K + s) * max_new;
            r->logprobs = lp + (size_t)(k * K + s) * max_new;
        }
    }
    // without problems too: under ep the sampler joins the group's collective forwards
    if (lb_sampler_run(smp, reqs, np * K, NULL, err, sizeof err) != 0) lb_die("%s", err);
    for (int i = dp->rank, k = 0; i < P; i += dp->size, k++)
        for (int s = 0; s < K; s++)
            res[2 * i] += seq_correct(tk, fp != NULL, &qs[k], reqs[k * K + s].tokens,
                                      reqs[k * K + s].len);
    // greedy: one request per problem (its draws are never used)
    for (int k = 0; k < np; k++) {
        reqs[k].prompt = qs[k].ptok;
        reqs[k].prompt_len = qs[k].plen;
        reqs[k].tokens = tok + (size_t)k * max_new;
        reqs[k].logprobs = lp + (size_t)k * max_new;
    }
    if (lb_sampler_run(greedy, reqs, np, NULL, err, sizeof err) != 0) lb_die("%s", err);
    for (int i = dp->rank, k = 0; i < P; i += dp->size, k++)
        res[2 * i + 1] = seq_correct(tk, fp != NULL, &qs[k], reqs[k].tokens, reqs[k].len);
    share_items(dp, res, P, 2);
    double p1 = 0.0;
    int pk = 0, g = 0;
    for (int i = 0; i < P; i++) {
        p1 += res[2 * i] / K;
        pk += res[2 * i] > 0;
        g += res[2 * i + 1] > 0;
    }
    ev.pass1 = p1 / P;
    ev.passk = (double)pk / P;
    ev.greedy = (double)g / P;
    free(qs);
    free(reqs);
    free(tok);
    free(lp);
    free(res);
    return ev;
}

static void log_eval(const lb_config *c, lb_metrics *metrics, int step, const rl_eval *ev)
{
    if (!ev->problems) return;
    printf("step %5d/%d | eval on %d held-out problems: pass@1 %.4f | pass@%d %.4f | greedy "
           "%.4f\n", step, c->rl.steps, ev->problems, ev->pass1, c->rl.eval_samples, ev->passk,
           ev->greedy);
    lb_metrics_printf(metrics, "{\"step\": %d, \"eval_pass_at_1\": %.9g, \"eval_pass_at_k\": "
                      "%.9g, \"eval_k\": %d, \"eval_greedy\": %.9g, \"eval_problems\": %d}",
                      step, ev->pass1, ev->passk, c->rl.eval_samples, ev->greedy, ev->problems);
    fflush(stdout);
}

// The trainer's view of sequences idx[0..count): tokens (count, T) = prompt + completion (the
// last completion token is only a target), targets the next token on response positions and
// -1 elsewhere. Returns the response tokens.
static int pack(const rl_seq *qs, const int *idx, int count, int T, int32_t *tok, int32_t *tgt)
{
    int n = 0;
    for (int b = 0; b < count; b++) {
        const rl_seq *q = &qs[idx[b]];
        int32_t *x = tok + (size_t)b * T, *y = tgt + (size_t)b * T;
        for (int t = 0; t < T; t++) x[t] = 0, y[t] = -1;
        for (int t = 0; t < q->plen; t++) x[t] = q->ptok[t];
        for (int j = 0; j < q->len; j++) {
            if (j + 1 < q->len) x[q->plen + j] = q->tok[j];
            y[q->plen - 1 + j] = q->tok[j];
        }
        n += q->len;
    }
    return n;
}

// Response-token values of v (count, T) of sequences idx[0..count) in order into out.
static int gather(const rl_seq *qs, const int *idx, int count, int T, const float *v, float *out)
{
    int n = 0;
    for (int b = 0; b < count; b++) {
        const rl_seq *q = &qs[idx[b]];
        for (int j = 0; j < q->len; j++) out[n++] = v[(size_t)b * T + q->plen - 1 + j];
    }
    return n;
}

// Layouts RL runs on, checked on every rank alike before any work.
int lb_sampler_check_layout(const lb_config *c, const lb_grid *g, const char *who, char *err,
                            size_t errlen)
{
    char where[LB_PATH_MAX + 32];
    if (g->pp > 1) {
        // the sampler decodes one token at a time through every layer: under pipeline
        // parallelism each decode step would cross all stages, which nothing schedules
        snprintf(err, errlen, "%sparallel.pp = %d: %s runs without pipeline parallelism "
                 "(the sampler decodes through every layer on each rank); set parallel.pp = 1",
                 lb_key_where(c, "parallel", "pp", where, sizeof where), g->pp, who);
        return -1;
    }
    if (c->parallel.sequence_parallel) {
        // the sampler's forwards feed single decode tokens of many sequences, not sequences
        // to split over the tensor-parallel ranks
        snprintf(err, errlen, "%sparallel.sequence_parallel: %s runs without sequence "
                 "parallelism (the sampler's forwards hold decode rows, not sequences to split); "
                 "set parallel.sequence_parallel = false",
                 lb_key_where(c, "parallel", "sequence_parallel", where, sizeof where), who);
        return -1;
    }
    return 0;
}

static int check_rl_layout(const lb_config *c, const lb_grid *g, char *err, size_t errlen)
{
    char where[LB_PATH_MAX + 32];
    if (lb_sampler_check_layout(c, g, "lowbit rl", err, errlen) != 0) return -1;
    if (c->rl.prompts < g->dp) {
        snprintf(err, errlen, "%srl.prompts (%d) is smaller than the data-parallel size %d: each "
                 "data-parallel rank samples and trains its own prompts",
                 lb_key_where(c, "rl", "prompts", where, sizeof where), c->rl.prompts, g->dp);
        return -1;
    }
    return 0;
}

// One `lowbit rl` run: its configuration (the model section read from rl.init), the parallel
// pieces, the policy, its reference and optimizer, the samplers, and the step's sequences with
// the trainer's buffers. Set up once; every step reuses it.
typedef struct {
    lb_config cfg;
    const lb_config *c;            // &cfg
    lb_run run;                    // grid, communicators, backend, policy, optimizer (src/cli/run.h)
    lb_comm *world;                // run.world
    int root;                      // run.root
    lb_comm *dpc, *epc;            // host messages of the data- and expert-parallel groups
    lb_backend *be;                // run.be
    lb_model *m, *ref;             // the policy (run.m); the KL reference, a frozen piece (or NULL)
    lb_sampler_config sc;
    lb_sampler *smp, *greedy;
    lb_sampler *val;               // [mlperf]: the evaluation's draws (mlperf.val_*)
    lb_rewards rw;
    lb_tokenizer *tk;              // tokenizer.tk, NULL: a token is a byte
    lb_run_tokenizer tokenizer;    // data.tokenizer's or rl.init's (src/cli/run.h)
    rl_prompts prompts;            // rl.prompts_file's
    const rl_prompts *fp;          // &prompts with a prompts file, NULL: the arithmetic task
    lb_grpo_config gcfg;
    lb_train_state st;
    char resume[LB_PATH_MAX + 64];
    char *ini;
    lb_metrics *metrics;
    int P, G, N, M;                // prompts, samples each, sequences, mini-batches of a step
    int MB, NS;                    // sequences per micro- and mini-batch
    int max_new, T;                // completion tokens at most; every sequence fits (b, T)
    float inv_temp;
    // qs holds the step's N sequences in global order; this rank samples and trains own[0..nl),
    // the sequences of its prompts, and learns everyone's reward, length and correctness.
    rl_seq *qs;
    lb_sample_req *reqs;
    int *own, nl;
    int *mbk;                      // own[mbk[mb] .. mbk[mb + 1]): this rank's of mini-batch mb
    double *seqv;                  // (N, 3) reward, length, correct
    size_t cap;                    // MB x T
    double t_init;                 // when the command started (MLPerf's init_start), ms
    lb_mlperf mlperf;              // with mlperf.enabled: the schedule, the target, the log
    int32_t *tok, *tgt;            // (MB, T) a micro-batch
    float *lp, *lpr, *dfull;       // (MB, T) its log-probs, the reference's, d loss / d lp
    float *r_lp, *r_old, *r_roll, *r_ref, *r_adv, *r_d;   // (MB x max_new) response tokens
    float *rewards, *adv;          // (N)
    int route_k;                   // the model's experts per token (0: no routed layers)
    int32_t *route_log;            // (layers, MB x T, route_k) the trainer's routes
} rl_run;

// What one step measured, for its log line.
typedef struct {
    lb_sample_stats ss;
    double rsum, rsq, lensum;      // rewards, their squares, completion lengths
    int correct;
    long idle;                     // idle micro-batches of this rank (expert parallelism)
    double loss_sum, clip, tis, klref, norm, lr;
    double route_same, route_all;  // (token, layer) pairs: the same experts as the sampler's
    long ntok_all;                 // response tokens of all mini-batches
    double t_roll, t_train;
} rl_step;

// rl.prompts_file (and rl.val_file, or rl.val_fraction of it) read and checked before any
// work, the chat template applied and the prompts' tokens made: the same on every rank, the
// mistakes printed by rank 0. Returns 0 or 1.
static int rl_prompts_load(rl_run *x)
{
    char err[ERRLEN], where[LB_PATH_MAX + 32];
    const lb_config *c = x->c;
    rl_prompts *f = &x->prompts;
    const char *tmpl = c->rl.chat_template;
    int bad = lb_prompts_read(c->rl.prompts_file, c->rl.prompt_field, c->rl.answer_field,
                              &f->all, err, sizeof err) != 0;
    if (!bad && c->rl.val_file[0]) {
        f->train = f->all;
        f->train.owner = 0;
        bad = lb_prompts_read(c->rl.val_file, c->rl.prompt_field, c->rl.answer_field, &f->val,
                              err, sizeof err) != 0;
    } else if (!bad) {
        bad = lb_prompts_split(&f->all, c->rl.val_fraction, c->sample.seed, &f->train, &f->val,
                               err, sizeof err) != 0;
    }
    if (bad) {
        if (x->root) fprintf(stderr, "%s%s\n", lb_key_where(c, "rl", "prompts_file", where,
                                                             sizeof where), err);
        return 1;
    }
    x->fp = f;
    if (c->rl.eval_problems > 0 && f->val.n == 0) {
        if (x->root) fprintf(stderr, "%srl.val_fraction is 0 and rl.val_file is empty: no "
                             "validation prompts for rl.eval_problems (set it to 0 to evaluate "
                             "nothing)\n", lb_key_where(c, "rl", "val_fraction", where,
                                                          sizeof where));
        return 1;
    }
    if (!c->rl.answer_field[0] && lb_rewards_need_answer(&x->rw)) {
        if (x->root) fprintf(stderr, "%srl.answer_field is empty: answer_exact compares with "
                             "reference answers\n", lb_key_where(c, "rl", "answer_field", where,
                                                                  sizeof where));
        return 1;
    }
    // a special token of the template (<|...|>) must be one of the tokenizer's: as bytes it
    // would be a string the model never saw as a token
    for (const char *t = strstr(tmpl, "<|"); t; t = strstr(t + 2, "<|")) {
        const char *e = strstr(t + 2, "|>");
        if (!e) break;
        char name[128];
        snprintf(name, sizeof name, "%.*s", (int)(e + 2 - t), t);
        if (!x->tk || lb_tokenizer_token_id(x->tk, name) < 0) {
            if (x->root) fprintf(stderr, "%srl.chat_template: '%s' is not a token of %s\n",
                                 lb_key_where(c, "rl", "chat_template", where, sizeof where),
                                 name, x->tk ? x->tokenizer.name
                                             : "the byte tokens (no data.tokenizer, none in "
                                               "rl.init)");
            return 1;
        }
    }
    for (int v = 0; v < 2; v++) {
        const lb_prompt_set *set = v ? &f->val : &f->train;
        f->tok[v] = lb_calloc((size_t)set->n + 1, sizeof *f->tok[v]);
        f->ntok[v] = lb_calloc((size_t)set->n + 1, sizeof *f->ntok[v]);
        for (int i = 0; i < set->n; i++) {
            char *text = tmpl[0] ? lb_chat_apply(tmpl, set->p[i].prompt, err, sizeof err)
                                 : NULL;
            if (tmpl[0] && !text) {
                if (x->root) fprintf(stderr, "%s%s\n", lb_key_where(c, "rl", "chat_template",
                                                                     where, sizeof where), err);
                return 1;
            }
            const char *in = text ? text : set->p[i].prompt;
            f->tok[v][i] = encode_text(x->tk, in, strlen(in), &f->ntok[v][i]);
            free(text);
            if (f->ntok[v][i] > f->max_tokens) f->max_tokens = f->ntok[v][i];
        }
    }
    lb_prompt_order_init(&f->order, c->sample.seed, f->train.n);
    return 0;
}

// The layout and the configuration, checked before any work: the same verdict on every rank,
// printed once. Reads rl.init's model section into x->cfg. Returns 0 or 1.
static int rl_check(rl_run *x)
{
    char err[ERRLEN], where[LB_PATH_MAX + 32];
    lb_config *c = &x->cfg;
    const int root = x->root;
    // The layout first: a bad one stops every rank before any work, with one message.
    if (lb_run_layout(&x->run, c, x->world, "lowbit rl", check_rl_layout) != 0) return 1;
    // Checks of the configuration alone: the same verdict on every rank, printed by rank 0.
    if (!c->rl.init[0]) {
        if (root) fprintf(stderr, "%srl.init is empty: name the checkpoint RL starts from\n",
                          lb_key_where(c, "rl", "init", where, sizeof where));
        return 1;
    }
    if (!c->rl.prompts_file[0] && c->rl.eval_problems > 0 && !(c->gen.val_fraction > 0)) {
        if (root) fprintf(stderr, "%sgen.val_fraction is 0: no held-out problems for "
                          "rl.eval_problems (set it to 0 to evaluate nothing)\n",
                          lb_key_where(c, "gen", "val_fraction", where, sizeof where));
        return 1;
    }
    if (c->mlperf.enabled && c->rl.eval_problems == 0) {
        if (root) fprintf(stderr, "%srl.eval_problems is 0: mlperf.enabled evaluates on "
                          "held-out problems\n",
                          lb_key_where(c, "rl", "eval_problems", where, sizeof where));
        return 1;
    }
    if (x->N % x->M) {
        if (root) fprintf(stderr, "%srl.mini_batches (%d) does not divide rl.prompts x rl.group "
                          "= %d\n", lb_key_where(c, "rl", "mini_batches", where, sizeof where),
                          x->M, x->N);
        return 1;
    }
    lb_rewards_config rc = {c->rl.format_reward, c->rl.reward_regex,
                            {c->rl.reward_command, c->rl.reward_batch, c->rl.reward_workers,
                             c->rl.reward_timeout, c->rl.reward_timeout_value}};
    if (lb_rewards_init(&x->rw, c->rl.rewards, &rc, err, sizeof err) != 0) {
        const char *key = strncmp(err, "rl.reward_regex", 15) ? strncmp(err, "rl.reward_command",
                                                                          17) ? "rewards"
                                                                              : "reward_command"
                                                              : "reward_regex";
        if (root) fprintf(stderr, "%s%s\n", lb_key_where(c, "rl", key, where, sizeof where), err);
        return 1;
    }
    // Every rank reads rl.init's model section; the layout's splits of that model (heads by tp,
    // experts by ep) are checked as a file's [model] would be.
    // The model's tokenizer (data.tokenizer, else rl.init's), before the stop tokens that
    // default to its end-of-text token; the checkpoints of this run carry it on.
    int bad = lb_model_config_from_checkpoint(c, c->rl.init, err, sizeof err) != 0 ||
              lb_run_tokenizer_open(&x->tokenizer, c, c->rl.init, err, sizeof err) != 0 ||
              lb_run_stop_tokens(c, &x->tokenizer, err, sizeof err) != 0 ||
              lb_rl_sampler_config(c, &x->sc, err, sizeof err) != 0;
    if (lb_run_failed(&x->run, bad, err)) return 1;
    x->tk = x->tokenizer.tk;
    x->run.tokenizer_json = x->tokenizer.json;
    if (lb_config_validate(c, err, sizeof err) != 0) {
        if (root) fprintf(stderr, "%s (the model of %s)\n", err, c->rl.init);
        return 1;
    }
    if (x->tk) {   // the prompts' text through it, the completions back
        for (int i = 0; i < x->sc.nstop; i++)
            if (x->sc.stop[i] >= lb_tokenizer_vocab_size(x->tk)) {
                if (root) fprintf(stderr, "%ssample.stop_tokens: %d is not a token of %s\n",
                                  lb_key_where(c, "sample", "stop_tokens", where, sizeof where),
                                  x->sc.stop[i], x->tokenizer.name);
                return 1;
            }
    } else if (c->model.vocab_size < LB_BYTE_VOCAB) {
        if (root)
            fprintf(stderr, "lowbit rl: %s needs byte tokens (or data.tokenizer); the model has "
                    "a vocabulary of %d\n", c->rl.prompts_file[0] ? "a prompts file"
                                                                  : "the arithmetic task",
                    c->model.vocab_size);
        return 1;
    }
    if (c->rl.prompts_file[0] && rl_prompts_load(x) != 0) return 1;
    // the reward command answers a test line (the first train prompt, an empty completion)
    // before any work, on every rank that may score
    rl_seq probe = {0};
    if (x->fp) file_fill(x->fp, 0, 0, &probe);
    else arith_fill(c, x->tk, lb_arith_nth(c, 0, 0), &probe);
    lb_reward_item it = {probe.text, probe.answer, "", 0, 0};
    char msg[1000];   // with where and the line, within err
    bad = lb_rewards_check(&x->rw, &it, msg, sizeof msg) != 0;
    if (bad) {   // where the command was set, what failed, the line it was given
        char *json = lb_reward_item_json(&it);
        snprintf(err, sizeof err, "%s%s (test line %.400s)",
                 lb_key_where(c, "rl", "reward_command", where, sizeof where), msg, json);
        free(json);
    }
    return lb_run_failed(&x->run, bad, err) ? 1 : 0;
}

// The backend, the communicators, the policy (and its reference) and the optimizer as lowbit
// train builds them, and the checkpoint directory. Returns 0 or 1 (on every rank alike).
static int rl_open(rl_run *x)
{
    char err[ERRLEN];
    const lb_config *c = x->c;
    x->dpc = &x->run.grid.dp_comm;
    x->epc = &x->run.grid.ep_comm;
    x->max_new = x->sc.max_new_tokens;
    x->T = (x->fp ? x->fp->max_tokens : lb_arith_prompt_max(c)) + x->max_new;
    x->inv_temp = 1.0f / x->sc.temperature;
    if (lb_run_setup(&x->run, 1) != 0) return 1;
    x->be = x->run.be;
    x->m = x->run.m;
    if (c->rl.kl_coef > 0) x->ref = lb_run_model(c, x->be, &x->run.par, 1, err, sizeof err);
    if (lb_run_failed(&x->run, c->rl.kl_coef > 0 && !x->ref, err)) return 1;
    x->route_k = x->m->def->route_k ? x->m->def->route_k(&x->m->cfg) : 0;
    // the schedule runs over optimizer steps: rl.steps x rl.mini_batches
    lb_run_optimizer(&x->run, c->rl.steps * x->M);
    return lb_run_checkpoint_dir(&x->run);
}

// The policy starts from rl.init, or resumes (weights, moments, step) from a checkpoint; rank 0
// reads either and sends every rank its pieces. The reference is rl.init's. Then the samplers
// over the policy's weights. Returns 0 or 1.
static int rl_load(rl_run *x)
{
    char err[ERRLEN];
    const lb_config *c = x->c;
    lb_comm *comm = x->world;
    lb_run_resume_path(&x->run, x->resume, sizeof x->resume);
    int bad = (x->resume[0] ? lb_optimizer_load(x->resume, &x->run.opt, &x->st, comm,
                                                          &c->parallel, err, sizeof err)
                            : lb_checkpoint_load_weights(c->rl.init, x->m, comm, &c->parallel,
                                                         err, sizeof err)) != 0 ||
              (x->ref && lb_checkpoint_load_weights(c->rl.init, x->ref, comm, &c->parallel, err,
                                                    sizeof err) != 0);
    if (lb_run_failed(&x->run, bad, err)) return 1;
    if (x->resume[0] && x->root) {
        char changed[2048];
        lb_run_changed_keys(c, x->resume, changed, sizeof changed);
        printf("resumed from %s at step %" PRId64 "%s%s\n", x->resume, x->st.step,
               changed[0] ? "; changed since: " : "", changed);
    }
    x->smp = lb_sampler_create(x->m, &x->sc, x->T, err, sizeof err);
    lb_sampler_config gc = x->sc;
    gc.top_k = 1;
    x->greedy = x->smp ? lb_sampler_create(x->m, &gc, x->T, err, sizeof err) : NULL;
    if (x->greedy && c->mlperf.enabled) {
        lb_sampler_config vc = x->sc;
        vc.temperature = (float)c->mlperf.val_temperature;
        vc.top_p = (float)c->mlperf.val_top_p;
        x->val = lb_sampler_create(x->m, &vc, x->T, err, sizeof err);
    }
    return lb_run_failed(&x->run, !x->smp || !x->greedy || (c->mlperf.enabled && !x->val), err);
}

// Rank 0's header: warnings about the layout, the run's shape.
static void rl_announce(const rl_run *x)
{
    const lb_config *c = x->c;
    const lb_grid *g = &x->run.grid;
    const lb_model *m = x->m;
    const int G = x->G, N = x->N, M = x->M;
    char layout[256], how[320] = "one rank";
    lb_grid_describe(g, layout, sizeof layout);
    if (x->world->size > 1)
        snprintf(how, sizeof how,
                 "prompt j on data-parallel rank j mod %d%s%s; %s; collectives over %s%s",
                 g->dp, g->tp > 1 ? "; tensor-parallel ranks sample in lockstep" : "",
                 g->ep > 1 ? "; expert-parallel ranks run their busiest rank's number of "
                             "forwards (idle rows fill the rest)" : "",
                 c->parallel.zero ? "ZeRO-1 distributed optimizer" : "all-reduced gradients",
                 x->run.comms.nnccl ? "nccl" : "mpi",
                 c->parallel.deterministic ? ", rank-order sums" : "");
    if (x->be->deterministic && lb_config_precision(c).nvfp4_per_tensor)
        printf("warning: precision.nvfp4_scale = per-tensor scales NVFP4 activations by the "
               "amax of the whole call, so a row's result depends on its batch: sampler and "
               "trainer log-probs will differ where NVFP4 is used (per-token keeps them "
               "equal)\n");
    if (g->dp > 1 && m->cfg.router_aux_loss_coef > 0 &&
        (G % c->rl.micro_batch || N / M % c->rl.micro_batch))
        printf("note: rl.micro_batch (%d) does not divide rl.group (%d) and the mini-batch "
               "(%d sequences), so the data-parallel ranks group other sequences into a "
               "forward than one rank does; the load-balancing loss is a statistic of each "
               "forward's tokens, so its gradient can differ from a one-rank run's (with "
               "model.router_aux_loss_coef = 0 the runs are the same)\n",
               c->rl.micro_batch, G, N / M);
    printf("model %s from %s: %.3fM parameters (%.3fM on rank 0), %s backend%s, precision "
           "%s, KV cache %s; %d prompts x %d samples per step, %d mini-batch(es)\nlayout "
           "%s; %s\n",
           m->cfg.arch, c->rl.init, m->gparams / 1e6, m->nparams / 1e6, x->be->name,
           x->be->deterministic ? " (deterministic)" : "", c->precision.recipe,
           c->sample.kv_cache, x->P, G, M, layout, how);
    if (x->tk)
        printf("prompts and completions through %s (%d tokens); sample.stop_tokens are its ids\n",
               x->tokenizer.name, lb_tokenizer_vocab_size(x->tk));
    if (x->fp)
        printf("prompts from %s: %d to train, %d to validate (%s)%s%s\n", c->rl.prompts_file,
               x->fp->train.n, x->fp->val.n, c->rl.val_file[0] ? c->rl.val_file : "rl.val_fraction",
               c->rl.chat_template[0] ? "; chat template " : "", c->rl.chat_template);
    if (x->rw.cmd.command)
        printf("reward command '%s': %d completion(s) a call, %d call(s) at once, %g s limit\n",
               x->rw.cmd.command, x->rw.cmd.batch, x->rw.cmd.workers, x->rw.cmd.timeout);
}

// The step's sequences (this rank's with their token and log-prob buffers), its mini-batches'
// shares of them, and the trainer's micro-batch buffers.
static void rl_alloc(rl_run *x)
{
    const int N = x->N, G = x->G, M = x->M, max_new = x->max_new;
    x->qs = lb_calloc((size_t)N, sizeof *x->qs);
    x->reqs = lb_calloc((size_t)N, sizeof *x->reqs);
    x->own = lb_malloc((size_t)N * sizeof *x->own);
    x->nl = 0;
    for (int i = 0; i < N; i++) {
        if (owns(x->dpc, i / G)) {
            x->own[x->nl++] = i;
            x->qs[i].tok = lb_malloc((size_t)max_new * sizeof(int32_t));
            x->qs[i].lp_roll = lb_malloc((size_t)max_new * sizeof(float));
            x->qs[i].lp_old = lb_malloc((size_t)max_new * sizeof(float));
            if (x->route_k)
                x->qs[i].routes = lb_malloc((size_t)x->T * x->m->cfg.num_hidden_layers *
                                            x->route_k * sizeof(uint16_t));
        }
    }
    x->MB = x->c->rl.micro_batch;
    x->NS = N / M;
    x->mbk = lb_malloc((size_t)(M + 1) * sizeof *x->mbk);
    for (int mb = 0, k = 0; mb <= M; mb++) {
        while (k < x->nl && x->own[k] < mb * x->NS) k++;
        x->mbk[mb] = k;
    }
    x->seqv = lb_malloc((size_t)N * 3 * sizeof *x->seqv);
    size_t cap = x->cap = (size_t)x->MB * x->T;
    if (x->route_k)
        x->route_log = lb_malloc(cap * x->m->cfg.num_hidden_layers * x->route_k *
                                 sizeof(int32_t));
    x->tok = lb_malloc(cap * sizeof(int32_t));
    x->tgt = lb_malloc(cap * sizeof(int32_t));
    x->lp = lb_malloc(cap * sizeof(float));
    x->lpr = lb_malloc(cap * sizeof(float));
    x->dfull = lb_malloc(cap * sizeof(float));
    size_t rcap = (size_t)x->MB * max_new;   // response tokens of a micro-batch at most
    float **r[6] = {&x->r_lp, &x->r_old, &x->r_roll, &x->r_ref, &x->r_adv, &x->r_d};
    for (int i = 0; i < 6; i++) *r[i] = lb_malloc(rcap * sizeof(float));
    x->rewards = lb_malloc((size_t)N * sizeof(float));
    x->adv = lb_malloc((size_t)N * sizeof(float));
}

static void rl_free(rl_run *x)
{
    lb_metrics_close(x->metrics);
    for (int k = 0; k < x->nl; k++) {
        free(x->qs[x->own[k]].tok);
        free(x->qs[x->own[k]].lp_roll);
        free(x->qs[x->own[k]].lp_old);
        free(x->qs[x->own[k]].routes);
    }
    free(x->qs), free(x->reqs), free(x->own), free(x->mbk), free(x->seqv), free(x->tok);
    free(x->tgt), free(x->lp), free(x->lpr), free(x->dfull), free(x->r_lp), free(x->r_old);
    free(x->r_roll), free(x->r_ref), free(x->r_adv), free(x->r_d), free(x->rewards);
    free(x->adv), free(x->ini), free(x->route_log);
    lb_sampler_free(x->smp);
    lb_sampler_free(x->greedy);
    lb_sampler_free(x->val);
    lb_mllog_close(x->mlperf.log);
    lb_model_free(x->ref);
    lb_run_tokenizer_close(&x->tokenizer);
    lb_rewards_free(&x->rw);
    rl_prompts *f = &x->prompts;
    for (int v = 0; v < 2; v++) {
        for (int i = 0; f->tok[v] && i < (v ? f->val.n : f->train.n); i++) free(f->tok[v][i]);
        free(f->tok[v]);
        free(f->ntok[v]);
    }
    lb_prompt_order_free(&f->order);
    if (f->val.owner) lb_prompts_free(&f->val);
    else free(f->val.p);
    if (!f->train.owner && f->train.p != f->all.p) free(f->train.p);
    lb_prompts_free(&f->all);
    lb_run_teardown(&x->run);
}

// The rollout: P train problems, G samples each; every rank draws all P problems (the same on
// every rank) and samples those it owns with the one-rank seeds and streams. tp rank 0 scores
// its completions; every rank learns all rewards, lengths and correctness, and the step's
// statistics and advantages follow from all N in one-rank order. Returns 0, or 1 when a reward
// failed on a one-rank run (with more ranks it dies: the others would wait).
static int rl_rollout(rl_run *x, int step, rl_step *s)
{
    char err[ERRLEN];
    const lb_config *c = x->c;
    const int P = x->P, G = x->G, N = x->N;
    rl_seq *qs = x->qs;
    uint64_t draw_seed = lb_hash64(c->sample.seed + (uint64_t)step);
    for (int p = 0, k = 0; p < P; p++) {
        uint64_t pi = 0, draw = (uint64_t)(step - 1) * P + p;
        if (x->fp) {   // the prompts file's order: a pure function of (seed, draw)
            pi = (uint64_t)lb_prompt_order_at(&x->prompts.order, draw);
        } else {
            for (uint64_t a = 0;; a++) {   // a random problem of the train split
                pi = lb_rand_u64(c->sample.seed, LB_RL_PROMPT_STREAM + a, draw) >> 33;
                if (!lb_arith_is_val(c->gen.seed, pi, c->gen.val_fraction)) break;
            }
        }
        for (int g = 0; g < G; g++) {
            rl_seq *q = &qs[p * G + g];
            if (x->fp) file_fill(x->fp, 0, (int)pi, q);
            else arith_fill(c, x->tk, pi, q);
            if (!owns(x->dpc, p)) continue;
            x->reqs[k++] = (lb_sample_req){q->ptok, q->plen, draw_seed,
                                           lb_sample_stream(pi, (uint64_t)g), q->tok, q->lp_roll,
                                           0, 0, q->routes};
        }
    }
    if (lb_sampler_run(x->smp, x->reqs, x->nl, &s->ss, err, sizeof err) != 0) lb_die("%s", err);
    // The tp ranks of a data-parallel rank hold the same completions; tp rank 0 scores them
    // all at once (the reward command's batches run side by side) and the column of tp rank 0
    // shares them below.
    if (x->run.grid.tp_rank == 0 && x->nl) {
        lb_reward_item *it = lb_calloc((size_t)x->nl, sizeof *it);
        double *r = lb_malloc((size_t)x->nl * sizeof *r);
        for (int k = 0; k < x->nl; k++) {
            rl_seq *q = &qs[x->own[k]];
            q->len = x->reqs[k].len;
            size_t tn;
            char *text = lb_tokens_text(x->tk, q->tok, q->len, 0, &tn);
            it[k] = (lb_reward_item){q->text, q->answer, text, tn, x->reqs[k].stopped};
        }
        int bad = lb_rewards_score(&x->rw, it, x->nl, r, err, sizeof err) != 0;
        for (int k = 0; k < x->nl && !bad; k++) {
            const rl_seq *q = &qs[x->own[k]];
            double *v = x->seqv + (size_t)x->own[k] * 3;
            v[0] = r[k];
            v[1] = q->len;
            v[2] = seq_correct(x->tk, x->fp != NULL, q, q->tok, q->len);
        }
        for (int k = 0; k < x->nl; k++) free((char *)it[k].completion);
        free(it);
        free(r);
        if (bad) {
            if (x->world->size > 1) lb_die("step %d: %s", step, err);   // the others wait
            fprintf(stderr, "lowbit rl: step %d: %s\n", step, err);
            return 1;
        }
    }
    share_items(x->dpc, x->seqv, P, 3 * G);
    if (x->run.grid.tp > 1)
        lb_comm_bcast(&x->run.grid.tp_comm, x->seqv, (size_t)N * 3 * sizeof *x->seqv, 0);
    // the step's statistics and advantages from all N sequences, in one-rank order
    for (int i = 0; i < N; i++) {
        const double *v = x->seqv + (size_t)i * 3;
        x->rewards[i] = (float)v[0];
        s->rsum += v[0];
        s->rsq += v[0] * v[0];
        qs[i].len = (int)v[1];
        s->lensum += qs[i].len;
        s->correct += (int)v[2];
    }
    lb_grpo_advantages(x->rewards, P, G, c->rl.adv_eps, x->adv);
    return 0;
}

// The trainer's forward of the cnt sequences idx (packed, T positions each) with the
// log-probs lp, and its routes compared with the sampler's: s counts the (token, layer) pairs,
// over every token the sampler fed, where both picked the same set of experts.
static void forward_routed(rl_run *x, const int *idx, int cnt, rl_step *s)
{
    lb_model *m = x->m;
    const int T = x->T, L = m->cfg.num_hidden_layers, K = x->route_k;
    m->route_log = x->route_log;
    lb_model_forward_logprobs(m, x->tok, x->tgt, cnt, T, x->inv_temp, x->lp);
    m->route_log = NULL;
    for (int b = 0; b < cnt && K; b++) {
        const rl_seq *q = &x->qs[idx[b]];
        for (int i = 0; i < q->plen + q->len - 1; i++)
            for (int l = 0; l < L; l++) {
                const uint16_t *a = q->routes + ((size_t)i * L + l) * K;
                const int32_t *t = x->route_log + ((size_t)l * cnt * T + (size_t)b * T + i) * K;
                int same = 1;
                for (int j = 0; j < K && same; j++) {
                    same = 0;
                    for (int u = 0; u < K; u++) same |= a[u] == t[j];
                }
                s->route_same += same;
                s->route_all += 1;
            }
    }
}

// lp_old: the trainer's log-probs before any update. Mini-batch 0 gets them from its own
// training forward (the weights have not moved yet); later mini-batches need this extra pass.
static void rl_old_logprobs(rl_run *x, rl_step *s)
{
    const int MB = x->MB, T = x->T, nl = x->nl, k0 = x->mbk[1];
    const int nf = rounds_over(x->epc, (nl - k0 + MB - 1) / MB);
    for (int k = k0; k < k0 + nf * MB; k += MB) {
        if (k >= nl) {
            idle_micro_batch(x->m, x->ref, T, x->inv_temp, 0, x->tok, x->tgt, x->lp, x->dfull);
            s->idle++;
            continue;
        }
        int cnt = k + MB <= nl ? MB : nl - k;
        pack(x->qs, x->own + k, cnt, T, x->tok, x->tgt);
        forward_routed(x, x->own + k, cnt, s);
        for (int b = 0; b < cnt; b++) {
            rl_seq *q = &x->qs[x->own[k + b]];
            for (int j = 0; j < q->len; j++)
                q->lp_old[j] = x->lp[(size_t)b * T + q->plen - 1 + j];
        }
    }
}

// One micro-batch of mini-batch mb: this rank's sequences own[k .. k + cnt) of the mini-batch's
// ntok response tokens. Forward (and the reference's), GRPO's loss on the response tokens, and
// the backward with its gradient scaled to the mini-batch's token mean; adds to s's sums.
static void rl_train_micro_batch(rl_run *x, int mb, int k, int cnt, int ntok, rl_step *s)
{
    const int T = x->T;
    const int *idx = x->own + k;
    lb_model *m = x->m;
    rl_seq *qs = x->qs;
    int n = pack(qs, idx, cnt, T, x->tok, x->tgt);
    if (mb == 0) forward_routed(x, idx, cnt, s);   // the weights the sampler drew with
    else lb_model_forward_logprobs(m, x->tok, x->tgt, cnt, T, x->inv_temp, x->lp);
    gather(qs, idx, cnt, T, x->lp, x->r_lp);
    int t = 0;
    for (int b = 0; b < cnt; b++) {
        rl_seq *q = &qs[idx[b]];
        for (int j = 0; j < q->len; j++, t++) {
            if (mb == 0) q->lp_old[j] = x->r_lp[t];
            x->r_old[t] = q->lp_old[j];
            x->r_roll[t] = q->lp_roll[j];
            x->r_adv[t] = x->adv[idx[b]];
        }
    }
    if (x->ref) {
        lb_model_forward_logprobs(x->ref, x->tok, x->tgt, cnt, T, x->inv_temp, x->lpr);
        gather(qs, idx, cnt, T, x->lpr, x->r_ref);
    }
    lb_grpo_stats gs;
    double l = lb_grpo_loss(&x->gcfg, x->r_lp, x->r_old, x->r_roll, x->ref ? x->r_ref : NULL,
                            x->r_adv, (size_t)n, x->r_d, &gs);
    // grpo gives d(token mean over this micro-batch); the objective is the token mean over the
    // mini-batch
    double wgt = (double)n / ntok;
    for (size_t i = 0; i < x->cap; i++) x->dfull[i] = 0.0f;
    t = 0;
    for (int b = 0; b < cnt; b++) {
        rl_seq *q = &qs[idx[b]];
        for (int j = 0; j < q->len; j++, t++)
            x->dfull[(size_t)b * T + q->plen - 1 + j] = (float)(x->r_d[t] * wgt);
    }
    lb_model_backward_logprobs(m, x->dfull, (float)(m->cfg.router_aux_loss_coef * cnt / x->NS));
    s->loss_sum += l * n;
    s->clip += gs.clip_frac * n;
    s->tis += gs.tis_clip_frac * n;
    s->klref += gs.kl * n;
}

// The update: M mini-batches, each one optimizer step over its micro-batches (idle ones fill
// the expert-parallel lockstep).
static void rl_update(rl_run *x, int step, rl_step *s)
{
    const int M = x->M, MB = x->MB, NS = x->NS;
    const int *mbk = x->mbk;
    for (int mb = 0; mb < M; mb++) {
        // the mini-batch's global token count (all lengths are known on every rank), so the
        // token mean's denominator, and the summed gradients, are one rank's
        int f0 = mb * NS, ntok = 0;
        for (int i = f0; i < f0 + NS; i++) ntok += x->qs[i].len;
        lb_model_zero_grad(x->m);
        const int nb = rounds_over(x->epc, (mbk[mb + 1] - mbk[mb] + MB - 1) / MB);
        for (int k = mbk[mb]; k < mbk[mb] + nb * MB; k += MB) {
            if (k >= mbk[mb + 1]) {
                idle_micro_batch(x->m, x->ref, x->T, x->inv_temp, 1, x->tok, x->tgt, x->lp,
                                 x->dfull);
                s->idle++;
                continue;
            }
            int cnt = k + MB <= mbk[mb + 1] ? MB : mbk[mb + 1] - k;
            rl_train_micro_batch(x, mb, k, cnt, ntok, s);
        }
        s->ntok_all += ntok;
        s->norm = lb_optimizer_step(&x->run.opt, (step - 1) * M + mb + 1, &s->lr);
        lb_model_after_step(x->run.m, x->run.world);   // as train_step does
    }
}

// Agreement of sampler and trainer on the tokens the sampler drew, this rank's sums made global
// (rank order), then the step's progress line and metrics (rank 0).
static void rl_log_step(rl_run *x, int step, rl_step *s, double t_start)
{
    const lb_config *c = x->c;
    const int N = x->N;
    const rl_seq *qs = x->qs;
    double dsum = 0.0, dmax = 0.0, k3 = 0.0;
    long ptoks = 0;
    for (int k = 0; k < x->nl; k++) {
        const rl_seq *q = &qs[x->own[k]];
        for (int j = 0; j < q->len; j++) {
            double d = (double)q->lp_old[j] - q->lp_roll[j];
            dsum += fabs(d);
            if (fabs(d) > dmax) dmax = fabs(d);
            k3 += exp(d) - d - 1.0;   // KL(rollout || trainer), sampled from the rollout
        }
    }
    for (int i = 0; i < N; i++) ptoks += qs[i].plen + qs[i].len;
    // this rank's token sums to the global ones (rank order), the maximum over ranks
    double sums[10] = {s->loss_sum, s->clip, s->tis, s->klref, dsum, k3,
                       (double)s->ss.generated, (double)(s->ss.idle_forwards + s->idle),
                       s->route_same, s->route_all};
    if (x->run.grid.dp > 1) lb_comm_all_reduce(x->dpc, sums, sums, 10, LB_F64);
    dmax = max_over(x->dpc, dmax);
    double loss_sum = sums[0], clip = sums[1], tis = sums[2], klref = sums[3];
    const long ntok_all = s->ntok_all;
    double rmean = s->rsum / N, rstd = sqrt(fmax(s->rsq / N - rmean * rmean, 0.0));
    double diff = sums[4] / ntok_all, lossm = loss_sum / ntok_all;
    double roll_tps = sums[6] / s->t_roll, train_tps = ptoks / s->t_train;
    if (!x->root) return;
    // the share of (token, layer) router choices the trainer's recompute made as the sampler
    // did (routed models only)
    char routes[64] = "";
    if (x->route_k)
        snprintf(routes, sizeof routes, sums[9] > 0 ? ", \"routing_agreement\": %.9g"
                                                   : ", \"routing_agreement\": null",
                 sums[8] / sums[9]);
    if (c->train.log_every > 0 && (step % c->train.log_every == 0 || step == c->rl.steps))
        printf("step %5d/%d | reward %.3f +- %.3f | correct %.3f | len %.2f | lp diff %.3g "
               "| k3 %.3g | tis clip %.3f | clip %.3f | loss %.4f | norm %.3f | rollout "
               "%.2fs %.0f tok/s | train %.2fs %.0f tok/s\n",
               step, c->rl.steps, rmean, rstd, (double)s->correct / N, s->lensum / N, diff,
               sums[5] / ntok_all, tis / ntok_all, clip / ntok_all, lossm, s->norm, s->t_roll,
               roll_tps, s->t_train, train_tps);
    lb_metrics_printf(x->metrics,
            "{\"step\": %d, \"reward_mean\": %.9g, \"reward_std\": %.9g, \"correct\": "
            "%.9g, \"response_len\": %.9g, \"train_rollout_logprob_abs_diff\": %.9g, "
            "\"train_rollout_logprob_abs_diff_max\": %.9g, \"train_rollout_k3_kl\": "
            "%.9g, \"tis_clip_frac\": %.9g, \"clip_frac\": %.9g, \"kl_ref\": %.9g, "
            "\"loss\": %.9g, \"grad_norm\": %.9g, \"lr\": %.9g, \"rollout_s\": %.6f, "
            "\"train_s\": %.6f, \"rollout_tokens_per_s\": %.1f, "
            "\"train_tokens_per_s\": %.1f, \"idle_forwards\": %.0f, \"elapsed_s\": "
            "%.3f%s}",
            step, rmean, rstd, (double)s->correct / N, s->lensum / N, diff, dmax,
            sums[5] / ntok_all, tis / ntok_all, clip / ntok_all, klref / ntok_all, lossm,
            s->norm, s->lr, s->t_roll, s->t_train, roll_tps, train_tps, sums[7],
            lb_now() - t_start, routes);
    fflush(stdout);
}

// The held-out evaluation (every rl.eval_every steps and at the last; under [mlperf] on its
// schedule, pass@1 at mlperf.val_temperature as the log's eval_accuracy) and the checkpoint (as
// checkpoint.save_every says) after step. Returns 1 when the MLPerf target was reached (the
// run stops).
static int rl_eval_and_save(rl_run *x, int step)
{
    const lb_config *c = x->c;
    int ml = c->mlperf.enabled, stop = 0;
    if (ml ? lb_mlperf_due(&x->mlperf, step)
           : (c->rl.eval_every > 0 && step % c->rl.eval_every == 0) || step == c->rl.steps) {
        if (ml) lb_mlperf_eval_start(&x->mlperf, step);
        rl_eval ev = evaluate(c, x->tk, x->fp, ml ? x->val : x->smp, x->greedy, x->max_new, x->dpc);
        if (x->root) log_eval(c, x->metrics, step, &ev);
        stop = ml && lb_mlperf_eval_stop(&x->mlperf, step, c->rl.steps, ev.pass1);
    }
    if (lb_run_save_due(c, step, stop ? step : c->rl.steps)) {
        x->st.step = step;
        lb_run_save(&x->run, &x->st, x->ini);
    }
    return stop;
}

// One step: the rollout, lp_old, the update, the log line, evaluation and checkpoint. Returns
// 1 when the rollout failed, 2 when the MLPerf target was reached.
static int rl_step_run(rl_run *x, int step, double t_start)
{
    rl_step s = {0};
    double t0 = lb_now();
    if (rl_rollout(x, step, &s) != 0) return 1;
    s.t_roll = lb_now() - t0;   // until the slowest rank's rollout (share_items waits)
    t0 = lb_now();
    rl_old_logprobs(x, &s);
    rl_update(x, step, &s);
    x->be->sync(x->be);
    s.t_train = lb_now() - t0;
    rl_log_step(x, step, &s, t_start);
    return rl_eval_and_save(x, step) ? 2 : 0;
}

// [mlperf]: the evaluation schedule and the target on every rank; rank 0 opens the log and
// writes its init keys (qwen35_397b_grpo's where they apply: doc/mlperf.md). 0 or 1.
static int rl_mlperf_open(rl_run *x)
{
    char err[ERRLEN] = "";
    const lb_config *c = x->c;
    lb_mlperf *p = &x->mlperf;
    const lb_grid *g = &x->run.grid;
    p->higher = 1;
    p->batch = x->N;
    p->every = c->mlperf.eval_every > 0 ? lb_mlperf_steps(c->mlperf.eval_every, p->batch) : 1;
    // the benchmark's first validation: batch x ceil(2.5 + 3840 / batch) samples
    p->first = c->mlperf.eval_start >= 0 ? lb_mlperf_steps(c->mlperf.eval_start, p->batch)
                                         : (int)ceil(2.5 + 3840.0 / (double)p->batch);
    p->target = c->mlperf.target > 0 ? c->mlperf.target : 0.69;
    if (lb_run_failed(&x->run, lb_mlperf_open(p, c, x->root, x->resume[0] != 0, err,
                                              sizeof err) != 0, err))
        return 1;
    const lb_model *m = x->m;
    // forwards of one optimizer step on a data-parallel rank: its share of a mini-batch
    int64_t share = (x->NS + g->dp - 1) / g->dp, gas = (share + x->MB - 1) / x->MB;
    lb_mllog_run info = {LB_MLPERF_GRPO, x->N, x->MB, gas, x->T, c->rl.steps,
                         c->rl.eval_problems, x->st.step, (int64_t)c->rl.steps * x->M,
                         x->world->size, g->tp, g->pp, g->ep, c->run.backend,
                         lb_mllog_precision_linear(&m->contract, m->def, &m->cfg),
                         lb_mllog_precision_attn(&m->contract, c->sample.kv_cache), p->target};
    lb_mllog_header(p->log, c, &info, x->t_init);
    LB_MLLOG_NUM(p->log, "generation_training_rollout_temperature", c->sample.temperature);
    LB_MLLOG_NUM(p->log, "generation_training_rollout_top_p", c->sample.top_p);
    LB_MLLOG_NUM(p->log, "generation_validation_rollout_temperature", c->mlperf.val_temperature);
    LB_MLLOG_NUM(p->log, "generation_validation_rollout_top_p", c->mlperf.val_top_p);
    LB_MLLOG_INT(p->log, "num_prompts_per_step", x->P);
    LB_MLLOG_INT(p->log, "num_generations_per_prompt", x->G);
    if (x->root) {
        printf("mlperf: %s log in %s/%s; evaluation on %d held-out problems after step %d and "
               "every %d steps; target accuracy above %g%s\n", LB_MLPERF_GRPO, c->run.out_dir,
               c->mlperf.log_file, c->rl.eval_problems, p->first, p->every, p->target,
               c->rl.eval_every > 0 ? " (rl.eval_every is not used)" : "");
        fflush(stdout);
    }
    return 0;
}

int lb_cmd_rl(const lb_config *c0, lb_comm *comm)
{
    char err[ERRLEN];
    rl_run run;
    rl_run *x = &run;
    memset(x, 0, sizeof *x);
    x->cfg = *c0;
    x->c = &x->cfg;
    x->world = comm;
    x->root = comm->rank == 0;
    x->t_init = lb_mllog_now_ms();
    const lb_config *c = x->c;
    x->P = c->rl.prompts, x->G = c->rl.group, x->N = x->P * x->G, x->M = c->rl.mini_batches;
    if (rl_check(x) != 0 || rl_open(x) != 0 || rl_load(x) != 0) {
        lb_run_abandon(&x->run);   // a bad resume leaves no empty checkpoints directory
        rl_free(x);
        return 1;
    }
    x->ini = lb_run_ini(&x->run);
    int bad = x->root && lb_run_config_write(c, x->ini, err, sizeof err) != 0;
    if (lb_run_failed(&x->run, bad, err)) {
        rl_free(x);
        return 1;
    }
    if (x->root) rl_announce(x);
    x->metrics = x->root ? lb_metrics_open(c->run.out_dir, c->train.metrics_file, "rl",
                                           x->resume[0] ? (long)x->st.step : -1, err, sizeof err)
                         : NULL;
    if (lb_run_failed(&x->run, x->root && !x->metrics, err)) {
        rl_free(x);
        return 1;
    }
    if (x->metrics) lb_metrics_text(x->metrics, x->resume[0] ? x->st.step : 0, "config", x->ini);

    x->gcfg = (lb_grpo_config){c->rl.eps_low, c->rl.eps_high, c->rl.kl_coef, c->rl.tis_cap,
                               c->rl.adv_eps};
    rl_alloc(x);
    if (c->mlperf.enabled && rl_mlperf_open(x) != 0) {
        rl_free(x);
        return 1;
    }
    // the evaluation before training (not under [mlperf]: outside its timed run)
    if (x->st.step == 0 && !c->mlperf.enabled) {
        rl_eval ev = evaluate(c, x->tk, x->fp, x->smp, x->greedy, x->max_new, x->dpc);
        if (x->root) log_eval(c, x->metrics, 0, &ev);
    }
    double t_start = lb_now();
    if (c->mlperf.enabled) lb_mlperf_run_start(&x->mlperf, (int)x->st.step);
    int step = (int)x->st.step + 1, rc = 0;
    for (; step <= c->rl.steps; step++)
        if ((rc = rl_step_run(x, step, t_start)) != 0) break;
    if (rc == 1) {
        rl_free(x);
        return 1;
    }
    if (c->mlperf.enabled) lb_mlperf_run_stop(&x->mlperf, step <= c->rl.steps ? step : step - 1);
    rl_free(x);
    return 0;
}
