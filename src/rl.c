// rl.c: `lowbit rl`: GRPO with the sampler inside the trainer (doc/rl.md).
//
// One step: P prompts of the arithmetic task's train split, G completions each from the
// sampler (the model's own weights and weight cache; nothing is copied), rewards from the
// registry and the optional command, group-normalised advantages, then the trainer recomputes
// every response token's log-prob with the training forward (lp_old: the policy that sampled),
// and M mini-batches each take one optimizer step on GRPO's clipped, token-mean objective
// (src/grpo.h), the gradient entering at the logits through per-token weights. The optimizer
// step marks the weight cache stale; the next rollout's first forward re-quantizes it. Under
// mpirun the prompts are split over the data-parallel ranks; under tensor and expert
// parallelism the model, the reference and the optimizer are pieces as in `lowbit train`, and
// the ranks keep their collective forwards in step (doc/rl.md).
#include "src/rl.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>
#include "kernels/common.h"
#include "src/checkpoint.h"
#include "src/commands.h"
#include "src/data.h"
#include "src/grpo.h"
#include "src/optim.h"
#include "src/reward.h"
#include "src/util.h"
#include "parallel/grid.h"

#define ERRLEN 2048
#define LB_RL_PROMPT_STREAM 0x524c50726f6d7074ull   // rollout prompt choice ("RLPrompt")
#define LB_RL_EVAL_SEED 0x6576616cull               // offline evaluation draws ("eval")

// ---- shared with `lowbit sample` ---------------------------------------------------------------

static int param_index(const char *section, const char *key)
{
    for (int i = 0; i < lb_nparams; i++)
        if (!strcmp(lb_params[i].section, section) && !strcmp(lb_params[i].key, key)) return i;
    return -1;
}

const char *lb_key_where(const lb_config *c, const char *section, const char *key, char *buf,
                         size_t len)
{
    int i = param_index(section, key);
    if (!c->source_file[0]) snprintf(buf, len, "%s", "");
    else if (i >= 0 && c->source_line[i] > 0)
        snprintf(buf, len, "%s:%d: ", c->source_file, c->source_line[i]);
    else snprintf(buf, len, "%s: ", c->source_file);
    return buf;
}

int lb_model_config_from_checkpoint(lb_config *c, const char *path, char *err, size_t errlen)
{
    char *ini = lb_checkpoint_config(path, err, errlen);
    if (!ini) return -1;
    lb_config ck, def;
    lb_config_defaults(&ck);
    lb_config_defaults(&def);
    char perr[1024];
    int rc = lb_config_parse(&ck, ini, path, perr, sizeof perr);
    free(ini);
    if (rc != 0) {
        snprintf(err, errlen, "%s: its stored configuration does not parse: %s", path, perr);
        return -1;
    }
    for (int i = 0; i < lb_nparams; i++) {
        const lb_param *p = &lb_params[i];
        if (strcmp(p->section, "model")) continue;
        const char *mine = (const char *)c + p->offset, *theirs = (const char *)&ck + p->offset;
        const char *dflt = (const char *)&def + p->offset;
        if (memcmp(mine, dflt, p->size) && memcmp(mine, theirs, p->size)) {
            char where[LB_PATH_MAX + 32];
            snprintf(err, errlen, "%smodel.%s differs from the model in %s (leave [model] out: "
                     "it is read from the checkpoint)",
                     lb_key_where(c, "model", p->key, where, sizeof where), p->key, path);
            return -1;
        }
    }
    c->model = ck.model;
    return 0;
}

lb_backend *lb_rl_backend(const lb_config *c)
{
    lb_backend *be = lb_backend_open(c);
    if (be) be->deterministic = c->sample.deterministic;
    return be;
}

lb_model *lb_rl_model_open(const lb_config *c, lb_backend *be, const char *path, char *err,
                           size_t errlen)
{
    lb_model *m = lb_model_create(&c->model, be, err, errlen);
    if (!m) return NULL;
    if (lb_model_set_precision(m, &c->precision, c->run.seed, err, errlen) != 0 ||
        lb_checkpoint_load(path, m, NULL, NULL, NULL, err, errlen) != 0) {
        lb_model_free(m);
        return NULL;
    }
    lb_model_set_kv_fp8(m, !strcmp(c->sample.kv_cache, "fp8"));
    return m;
}

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
    char prompt[64];
    int32_t ptok[64];
    int plen;
    int32_t *tok;                  // (max_new_tokens)
    float *lp_roll;                // (max_new_tokens) sampler log-probs
    float *lp_old;                 // (max_new_tokens) trainer log-probs before the update
    int len;
    int correct;                   // the answer is right (the task's own check, for metrics)
} rl_seq;

typedef struct {
    double pass1, passk, greedy;
    int problems;
} rl_eval;

static void prompt_tokens(rl_seq *q)
{
    for (int i = 0; i < q->plen; i++) q->ptok[i] = (unsigned char)q->prompt[i];
}

static int arith_correct(const char *prompt, const int32_t *tok, int len)
{
    char text[256];
    long want, got;
    if (len > (int)sizeof text) return 0;
    for (int i = 0; i < len; i++) text[i] = (char)tok[i];
    return lb_arith_answer(prompt + (prompt[0] == '\n'), &want) == 0 &&
           lb_arith_parse_completion(text, (size_t)len, &got) == 0 && got == want;
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
static rl_eval evaluate(const lb_config *c, lb_sampler *smp, lb_sampler *greedy, int max_new,
                        lb_comm *dp)
{
    rl_eval ev = {0, 0, 0, c->rl.eval_problems};
    int P = c->rl.eval_problems, K = c->rl.eval_samples;
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
        uint64_t pi = lb_arith_nth(c, 1, (uint64_t)i);
        qs[k].plen = lb_arith_prompt(c, pi, qs[k].prompt);
        prompt_tokens(&qs[k]);
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
            res[2 * i] += arith_correct(qs[k].prompt, reqs[k * K + s].tokens, reqs[k * K + s].len);
    // greedy: one request per problem (its draws are never used)
    for (int k = 0; k < np; k++) {
        reqs[k].prompt = qs[k].ptok;
        reqs[k].prompt_len = qs[k].plen;
        reqs[k].tokens = tok + (size_t)k * max_new;
        reqs[k].logprobs = lp + (size_t)k * max_new;
    }
    if (lb_sampler_run(greedy, reqs, np, NULL, err, sizeof err) != 0) lb_die("%s", err);
    for (int i = dp->rank, k = 0; i < P; i += dp->size, k++)
        res[2 * i + 1] = arith_correct(qs[k].prompt, reqs[k].tokens, reqs[k].len);
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

static void log_eval(const lb_config *c, FILE *metrics, int step, const rl_eval *ev)
{
    if (!ev->problems) return;
    printf("step %5d/%d | eval on %d held-out problems: pass@1 %.4f | pass@%d %.4f | greedy "
           "%.4f\n", step, c->rl.steps, ev->problems, ev->pass1, c->rl.eval_samples, ev->passk,
           ev->greedy);
    fprintf(metrics, "{\"step\": %d, \"eval_pass_at_1\": %.9g, \"eval_pass_at_k\": %.9g, "
                     "\"eval_k\": %d, \"eval_greedy\": %.9g, \"eval_problems\": %d}\n",
            step, ev->pass1, ev->passk, c->rl.eval_samples, ev->greedy, ev->problems);
    fflush(stdout);
    fflush(metrics);
}

static void keep_last(const char *dir, int keep)
{
    char pattern[1024];
    char **list;
    snprintf(pattern, sizeof pattern, "%s/step_*.safetensors", dir);
    int n = lb_glob(pattern, &list);
    for (int i = 0; i < n - keep; i++) unlink(list[i]);
    lb_glob_free(list, n);
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
static int check_rl_layout(const lb_config *c, const lb_grid *g, char *err, size_t errlen)
{
    char where[LB_PATH_MAX + 32];
    if (g->pp > 1) {
        // the sampler decodes one token at a time through every layer: under pipeline
        // parallelism each decode step would cross all stages, which RL does not schedule
        snprintf(err, errlen, "%sparallel.pp = %d: lowbit rl runs without pipeline parallelism "
                 "(the sampler decodes through every layer on each rank); set parallel.pp = 1",
                 lb_key_where(c, "parallel", "pp", where, sizeof where), g->pp);
        return -1;
    }
    if (c->parallel.sequence_parallel) {
        // the sampler's forwards feed single decode tokens of many sequences, not sequences
        // to split over the tensor-parallel ranks
        snprintf(err, errlen, "%sparallel.sequence_parallel: lowbit rl runs without sequence "
                 "parallelism (the sampler's forwards hold decode rows, not sequences to split); "
                 "set parallel.sequence_parallel = false",
                 lb_key_where(c, "parallel", "sequence_parallel", where, sizeof where));
        return -1;
    }
    if (c->rl.prompts < g->dp) {
        snprintf(err, errlen, "%srl.prompts (%d) is smaller than the data-parallel size %d: each "
                 "data-parallel rank samples and trains its own prompts",
                 lb_key_where(c, "rl", "prompts", where, sizeof where), c->rl.prompts, g->dp);
        return -1;
    }
    return 0;
}

// The backend-memory communicators of the groups the model pieces and the optimizer use: the
// grid's MPI ones for the CPU, NCCL over the same ranks for CUDA (every rank creates its groups
// in the same order, going on after a failure so that none waits in another's creation).
typedef struct {
    lb_comm *tp, *ep, *dp, *edp;
    lb_comm nccl[4];
    int nnccl;
} rl_comms;

static int rl_comms_open(rl_comms *x, lb_grid *g, lb_backend *be, int cuda, char *err,
                         size_t errlen)
{
    lb_comm *mpi[4] = {&g->tp_comm, &g->ep_comm, &g->dp_comm, &g->edp_comm};
    lb_comm **out[4] = {&x->tp, &x->ep, &x->dp, &x->edp};
    int bad = 0;
    x->nnccl = 0;
    for (int i = 0; i < 4; i++) {
        *out[i] = mpi[i];
        if (!cuda || mpi[i]->size == 1) continue;
        if (lb_comm_nccl_create(&x->nccl[x->nnccl], mpi[i], be, NULL, err, errlen) != 0) {
            bad = 1;
            continue;
        }
        *out[i] = &x->nccl[x->nnccl++];
    }
    return bad;
}

// This rank's piece of the model, its weights still to load.
static lb_model *rl_model_piece(const lb_config *c, lb_backend *be, const lb_model_parallel *par,
                                char *err, size_t errlen)
{
    lb_model *m = lb_model_create_parallel(&c->model, be, par, err, errlen);
    if (m && lb_model_set_precision(m, &c->precision, c->run.seed, err, errlen) != 0) {
        lb_model_free(m);
        return NULL;
    }
    if (m) lb_model_set_kv_fp8(m, !strcmp(c->sample.kv_cache, "fp8"));
    return m;
}

int lb_cmd_rl(const lb_config *c0, lb_comm *comm)
{
    char err[ERRLEN], where[LB_PATH_MAX + 32], ckdir[LB_PATH_MAX + 32], path[2 * LB_PATH_MAX + 64];
    const int root = comm->rank == 0;
    lb_config cfg = *c0;
    lb_config *c = &cfg;
    const int P = c->rl.prompts, G = c->rl.group, N = P * G, M = c->rl.mini_batches;
    // The layout first: a bad one stops every rank before any work, with one message.
    lb_grid grid;
    if (lb_grid_layout(&grid, &c->parallel, comm->size, comm->rank, err, sizeof err) != 0 ||
        check_rl_layout(c, &grid, err, sizeof err) != 0 ||
        lb_grid_check_built(&c->parallel, err, sizeof err) != 0) {
        if (root) fprintf(stderr, "lowbit rl: %s\n", err);
        return 1;
    }
    // Checks of the configuration alone: the same verdict on every rank, printed by rank 0.
    if (!c->rl.init[0]) {
        if (root) fprintf(stderr, "%srl.init is empty: name the checkpoint RL starts from\n",
                          lb_key_where(c, "rl", "init", where, sizeof where));
        return 1;
    }
    if (c->rl.eval_problems > 0 && !(c->gen.val_fraction > 0)) {
        if (root) fprintf(stderr, "%sgen.val_fraction is 0: no held-out problems for "
                          "rl.eval_problems (set it to 0 to evaluate nothing)\n",
                          lb_key_where(c, "gen", "val_fraction", where, sizeof where));
        return 1;
    }
    if (N % M) {
        if (root) fprintf(stderr, "%srl.mini_batches (%d) does not divide rl.prompts x rl.group "
                          "= %d\n", lb_key_where(c, "rl", "mini_batches", where, sizeof where),
                          M, N);
        return 1;
    }
    lb_rewards rw;
    if (lb_rewards_init(&rw, c->rl.rewards, c->rl.format_reward, c->rl.reward_command, err,
                        sizeof err) != 0) {
        if (root) fprintf(stderr, "%s%s\n", lb_key_where(c, "rl", "rewards", where, sizeof where),
                          err);
        return 1;
    }
    // Every rank reads rl.init's model section; the layout's splits of that model (heads by tp,
    // experts by ep) are checked as a file's [model] would be.
    lb_sampler_config sc;
    int bad = lb_model_config_from_checkpoint(c, c->rl.init, err, sizeof err) != 0 ||
              lb_rl_sampler_config(c, &sc, err, sizeof err) != 0;
    if (lb_any_failed(comm, bad, "lowbit rl", err)) return 1;
    if (lb_config_validate(c, err, sizeof err) != 0) {
        if (root) fprintf(stderr, "%s (the model of %s)\n", err, c->rl.init);
        return 1;
    }
    if (c->model.vocab_size < LB_BYTE_VOCAB) {
        if (root)
            fprintf(stderr, "lowbit rl: the arithmetic task needs byte tokens; the model has a "
                    "vocabulary of %d\n", c->model.vocab_size);
        return 1;
    }
    comm->deterministic = c->parallel.deterministic;
    if (lb_grid_create(&grid, &c->parallel, comm, err, sizeof err) != 0) lb_die("%s", err);
    lb_comm *dpc = &grid.dp_comm;   // host messages of the data-parallel group
    lb_comm *epc = &grid.ep_comm;   // and of the expert-parallel group
    const int max_new = sc.max_new_tokens;
    const int T = lb_arith_prompt_max(c) + max_new;   // every sequence fits (b, T)
    const float inv_temp = 1.0f / sc.temperature;

    // One GPU per rank: rank i of a node takes device run.device + i.
    lb_config local = *c;
    if (!strcmp(c->run.backend, "cuda") && comm->size > 1)
        local.run.device += lb_comm_local_rank(comm);
    lb_backend *be = lb_rl_backend(&local);
    snprintf(err, sizeof err, "the %.32s backend did not open", c->run.backend);
    if (lb_any_failed(comm, !be, "lowbit rl", err)) return 1;
    // The model pieces, their communicators and the optimizer as lowbit train builds them.
    rl_comms x;
    bad = rl_comms_open(&x, &grid, be, !strcmp(c->run.backend, "cuda"), err, sizeof err);
    if (lb_any_failed(comm, bad, "lowbit rl", err)) return 1;
    lb_model_parallel par = {grid.tp, grid.tp_rank, 0, grid.ep, grid.ep_rank, 1, 0,
                             grid.tp > 1 ? x.tp : NULL, grid.ep > 1 ? x.ep : NULL};
    lb_model *m = rl_model_piece(c, be, &par, err, sizeof err);
    lb_model *ref = NULL;   // the KL reference: a frozen piece on every rank
    if (m && c->rl.kl_coef > 0) ref = rl_model_piece(c, be, &par, err, sizeof err);
    if (lb_any_failed(comm, !m || (c->rl.kl_coef > 0 && !ref), "lowbit rl", err)) return 1;
    // the schedule runs over optimizer steps: rl.steps x rl.mini_batches
    lb_optim_config oc = {c->train.lr, c->train.min_lr, c->train.warmup_steps, c->rl.steps * M,
                          c->train.beta1, c->train.beta2, c->train.adam_eps,
                          c->train.weight_decay, c->train.grad_clip};
    lb_optimizer opt;
    lb_optimizer_init_groups(&opt, m, &oc, &(lb_optim_groups){x.dp, x.edp,
                                                               grid.tp > 1 ? x.tp : NULL, comm},
                             c->parallel.zero);
    snprintf(ckdir, sizeof ckdir, "%.*s/checkpoints", LB_PATH_MAX, c->run.out_dir);
    bad = root && lb_mkdirs(ckdir, err, sizeof err) != 0;
    if (lb_any_failed(comm, bad, "lowbit rl", err)) return 1;
    // The policy starts from rl.init, or resumes (weights, moments, step) from a checkpoint;
    // rank 0 reads either and sends every rank its pieces.
    lb_train_state st = {0};
    char resume[LB_PATH_MAX + 64] = "";
    if (!strcmp(c->checkpoint.resume, "auto")) {
        if (root) lb_checkpoint_latest(ckdir, resume, sizeof resume);
        lb_comm_bcast(comm, resume, sizeof resume, 0);
    } else {
        snprintf(resume, sizeof resume, "%.*s", LB_PATH_MAX, c->checkpoint.resume);
    }
    bad = (resume[0] ? lb_checkpoint_load_parallel(resume, &opt, &st, comm, &c->parallel, err,
                                                   sizeof err)
                     : lb_checkpoint_load_weights(c->rl.init, m, comm, &c->parallel, err,
                                                  sizeof err)) != 0 ||
          (ref && lb_checkpoint_load_weights(c->rl.init, ref, comm, &c->parallel, err,
                                             sizeof err) != 0);
    if (lb_any_failed(comm, bad, "lowbit rl", err)) return 1;
    if (resume[0] && root) printf("resumed from %s at step %" PRId64 "\n", resume, st.step);
    lb_sampler *smp = lb_sampler_create(m, &sc, T, err, sizeof err);
    lb_sampler_config gc = sc;
    gc.top_k = 1;
    lb_sampler *greedy = smp ? lb_sampler_create(m, &gc, T, err, sizeof err) : NULL;
    if (lb_any_failed(comm, !smp || !greedy, "lowbit rl", err)) return 1;
    char *ini = lb_config_to_ini(c);
    if (root) {
        char layout[256], how[320] = "one rank";
        lb_grid_describe(&grid, layout, sizeof layout);
        if (comm->size > 1)
            snprintf(how, sizeof how, "prompt j on data-parallel rank j mod %d%s%s; %s over %s%s",
                     grid.dp, grid.tp > 1 ? "; tensor-parallel ranks sample in lockstep" : "",
                     grid.ep > 1 ? "; expert-parallel ranks run their busiest rank's number of "
                                   "forwards (idle rows fill the rest)" : "",
                     c->parallel.zero ? "ZeRO-1 distributed optimizer" : "all-reduced gradients",
                     x.dp->ops->name, c->parallel.deterministic ? ", rank-order sums" : "");
        printf("# resolved configuration\n%s\n", ini);
        if (be->deterministic && !strcmp(c->precision.nvfp4_scale, "per-tensor"))
            printf("warning: precision.nvfp4_scale = per-tensor scales NVFP4 activations by the "
                   "amax of the whole call, so a row's result depends on its batch: sampler and "
                   "trainer log-probs will differ where NVFP4 is used (per-token keeps them "
                   "equal)\n");
        if (grid.dp > 1 && m->cfg.router_aux_loss_coef > 0 &&
            (G % c->rl.micro_batch || N / M % c->rl.micro_batch))
            printf("note: rl.micro_batch (%d) does not divide rl.group (%d) and the mini-batch "
                   "(%d sequences), so the data-parallel ranks group other sequences into a "
                   "forward than one rank does; the load-balancing loss is a statistic of each "
                   "forward's tokens, so the run differs from a one-rank run by that term\n",
                   c->rl.micro_batch, G, N / M);
        printf("model %s from %s: %.3fM parameters (%.3fM on rank 0), %s backend%s, precision "
               "%s, KV cache %s; %d prompts x %d samples per step, %d mini-batch(es)\nlayout "
               "%s; %s\n",
               m->cfg.arch, c->rl.init, m->gparams / 1e6, m->nparams / 1e6, be->name,
               be->deterministic ? " (deterministic)" : "", c->precision.recipe,
               c->sample.kv_cache, P, G, M, layout, how);
    }
    snprintf(path, sizeof path, "%.*s/%.*s", LB_PATH_MAX, c->run.out_dir, LB_PATH_MAX,
             c->train.metrics_file);
    FILE *metrics = root ? fopen(path, resume[0] ? "a" : "w") : NULL;
    snprintf(err, sizeof err, "%.*s: cannot open for writing", LB_PATH_MAX, path);
    if (lb_any_failed(comm, root && !metrics, "lowbit rl", err)) return 1;

    lb_grpo_config gcfg = {c->rl.eps_low, c->rl.eps_high, c->rl.kl_coef, c->rl.tis_cap,
                           c->rl.adv_eps};
    // qs holds the step's N sequences in global order; this rank samples and trains own[0..nl),
    // the sequences of its prompts, and learns everyone's reward, length and correctness.
    rl_seq *qs = lb_calloc((size_t)N, sizeof *qs);
    lb_sample_req *reqs = lb_calloc((size_t)N, sizeof *reqs);
    int *own = lb_malloc((size_t)N * sizeof *own), nl = 0;
    for (int i = 0; i < N; i++) {
        if (owns(dpc, i / G)) {
            own[nl++] = i;
            qs[i].tok = lb_malloc((size_t)max_new * sizeof(int32_t));
            qs[i].lp_roll = lb_malloc((size_t)max_new * sizeof(float));
            qs[i].lp_old = lb_malloc((size_t)max_new * sizeof(float));
        }
    }
    const int MB = c->rl.micro_batch, NS = N / M;   // sequences per micro- and mini-batch
    // own[mbk[mb] .. mbk[mb + 1]) are this rank's sequences of mini-batch mb
    int *mbk = lb_malloc((size_t)(M + 1) * sizeof *mbk);
    for (int mb = 0, k = 0; mb <= M; mb++) {
        while (k < nl && own[k] < mb * NS) k++;
        mbk[mb] = k;
    }
    double *seqv = lb_malloc((size_t)N * 3 * sizeof *seqv);   // reward, length, correct
    size_t cap = (size_t)MB * T;
    int32_t *tok = lb_malloc(cap * sizeof(int32_t)), *tgt = lb_malloc(cap * sizeof(int32_t));
    float *lp = lb_malloc(cap * sizeof(float)), *lpr = lb_malloc(cap * sizeof(float));
    float *dfull = lb_malloc(cap * sizeof(float));
    size_t rcap = (size_t)MB * max_new;   // response tokens of a micro-batch at most
    float *r_lp = lb_malloc(rcap * sizeof(float)), *r_old = lb_malloc(rcap * sizeof(float));
    float *r_roll = lb_malloc(rcap * sizeof(float)), *r_ref = lb_malloc(rcap * sizeof(float));
    float *r_adv = lb_malloc(rcap * sizeof(float)), *r_d = lb_malloc(rcap * sizeof(float));
    float *rewards = lb_malloc((size_t)N * sizeof(float));
    float *adv = lb_malloc((size_t)N * sizeof(float));

    if (st.step == 0) {
        rl_eval ev = evaluate(c, smp, greedy, max_new, dpc);
        if (root) log_eval(c, metrics, 0, &ev);
    }
    double t_start = lb_now();
    for (int step = (int)st.step + 1; step <= c->rl.steps; step++) {
        // ---- rollout: P train problems, G samples each; every rank draws all P problems (the
        // same on every rank) and samples those it owns with the one-rank seeds and streams
        double t0 = lb_now();
        uint64_t draw_seed = lb_hash64(c->sample.seed + (uint64_t)step);
        for (int p = 0, k = 0; p < P; p++) {
            uint64_t pi = 0;
            for (uint64_t a = 0;; a++) {   // a random problem of the train split
                pi = lb_rand_u64(c->sample.seed, LB_RL_PROMPT_STREAM + a,
                                 (uint64_t)(step - 1) * P + p) >> 33;
                if (!lb_arith_is_val(c->gen.seed, pi, c->gen.val_fraction)) break;
            }
            for (int g = 0; g < G; g++) {
                rl_seq *q = &qs[p * G + g];
                q->plen = lb_arith_prompt(c, pi, q->prompt);
                prompt_tokens(q);
                if (!owns(dpc, p)) continue;
                reqs[k++] = (lb_sample_req){q->ptok, q->plen, draw_seed,
                                            lb_sample_stream(pi, (uint64_t)g), q->tok, q->lp_roll,
                                            0, 0};
            }
        }
        lb_sample_stats ss = {0};
        if (lb_sampler_run(smp, reqs, nl, &ss, err, sizeof err) != 0) lb_die("%s", err);
        // The tp ranks of a data-parallel rank hold the same completions; tp rank 0 scores them
        // (a reward command runs once) and the column of tp rank 0 shares them below.
        for (int k = 0; k < nl && grid.tp_rank == 0; k++) {
            rl_seq *q = &qs[own[k]];
            q->len = reqs[k].len;
            char text[256];
            for (int j = 0; j < q->len; j++) text[j] = (char)q->tok[j];
            double r;
            // the task's text: the prompt without its separating newline
            if (lb_rewards_score(&rw, q->prompt + (q->prompt[0] == '\n'), text, (size_t)q->len,
                                 &r, err, sizeof err) != 0) {
                if (comm->size > 1) lb_die("step %d: %s", step, err);   // the others wait
                fprintf(stderr, "lowbit rl: step %d: %s\n", step, err);
                return 1;
            }
            double *v = seqv + (size_t)own[k] * 3;
            v[0] = r;
            v[1] = q->len;
            v[2] = arith_correct(q->prompt, q->tok, q->len);
        }
        share_items(dpc, seqv, P, 3 * G);
        if (grid.tp > 1) lb_comm_bcast(&grid.tp_comm, seqv, (size_t)N * 3 * sizeof *seqv, 0);
        // the step's statistics and advantages from all N sequences, in one-rank order
        double rsum = 0.0, rsq = 0.0, lensum = 0.0;
        int correct = 0;
        for (int i = 0; i < N; i++) {
            const double *v = seqv + (size_t)i * 3;
            rewards[i] = (float)v[0];
            rsum += v[0];
            rsq += v[0] * v[0];
            qs[i].len = (int)v[1];
            lensum += qs[i].len;
            correct += (int)v[2];
        }
        lb_grpo_advantages(rewards, P, G, c->rl.adv_eps, adv);
        double t_roll = lb_now() - t0;   // until the slowest rank's rollout (share_items waits)

        // ---- lp_old: the trainer's log-probs before any update. Mini-batch 0 gets them from
        // its own training forward (the weights have not moved yet); later mini-batches need
        // this extra pass.
        t0 = lb_now();
        long idle = 0;   // idle micro-batches of this rank (expert parallelism)
        const int nf = rounds_over(epc, (nl - mbk[1] + MB - 1) / MB);
        for (int k = mbk[1]; k < mbk[1] + nf * MB; k += MB) {
            if (k >= nl) {
                idle_micro_batch(m, ref, T, inv_temp, 0, tok, tgt, lp, dfull);
                idle++;
                continue;
            }
            int cnt = k + MB <= nl ? MB : nl - k;
            pack(qs, own + k, cnt, T, tok, tgt);
            lb_model_forward_logprobs(m, tok, tgt, cnt, T, inv_temp, lp);
            for (int b = 0; b < cnt; b++) {
                rl_seq *q = &qs[own[k + b]];
                for (int j = 0; j < q->len; j++) q->lp_old[j] = lp[(size_t)b * T + q->plen - 1 + j];
            }
        }
        // ---- the update: M mini-batches, each one optimizer step
        double loss_sum = 0.0, clip = 0.0, tis = 0.0, klref = 0.0, norm = 0.0, lr = 0.0;
        long ntok_all = 0;
        for (int mb = 0; mb < M; mb++) {
            // the mini-batch's global token count (all lengths are known on every rank), so the
            // token mean's denominator, and the summed gradients, are one rank's
            int f0 = mb * NS, ntok = 0;
            for (int i = f0; i < f0 + NS; i++) ntok += qs[i].len;
            lb_model_zero_grad(m);
            const int nb = rounds_over(epc, (mbk[mb + 1] - mbk[mb] + MB - 1) / MB);
            for (int k = mbk[mb]; k < mbk[mb] + nb * MB; k += MB) {
                if (k >= mbk[mb + 1]) {
                    idle_micro_batch(m, ref, T, inv_temp, 1, tok, tgt, lp, dfull);
                    idle++;
                    continue;
                }
                int cnt = k + MB <= mbk[mb + 1] ? MB : mbk[mb + 1] - k;
                int n = pack(qs, own + k, cnt, T, tok, tgt);
                lb_model_forward_logprobs(m, tok, tgt, cnt, T, inv_temp, lp);
                gather(qs, own + k, cnt, T, lp, r_lp);
                int t = 0;
                for (int b = 0; b < cnt; b++) {
                    rl_seq *q = &qs[own[k + b]];
                    for (int j = 0; j < q->len; j++, t++) {
                        if (mb == 0) q->lp_old[j] = r_lp[t];
                        r_old[t] = q->lp_old[j];
                        r_roll[t] = q->lp_roll[j];
                        r_adv[t] = adv[own[k + b]];
                    }
                }
                if (ref) {
                    lb_model_forward_logprobs(ref, tok, tgt, cnt, T, inv_temp, lpr);
                    gather(qs, own + k, cnt, T, lpr, r_ref);
                }
                lb_grpo_stats gs;
                double l = lb_grpo_loss(&gcfg, r_lp, r_old, r_roll, ref ? r_ref : NULL, r_adv,
                                        (size_t)n, r_d, &gs);
                // grpo gives d(token mean over this micro-batch); the objective is the token
                // mean over the mini-batch
                double wgt = (double)n / ntok;
                for (size_t i = 0; i < cap; i++) dfull[i] = 0.0f;
                t = 0;
                for (int b = 0; b < cnt; b++) {
                    rl_seq *q = &qs[own[k + b]];
                    for (int j = 0; j < q->len; j++, t++)
                        dfull[(size_t)b * T + q->plen - 1 + j] = (float)(r_d[t] * wgt);
                }
                lb_model_backward_logprobs(m, dfull,
                                           (float)(m->cfg.router_aux_loss_coef * cnt / NS));
                loss_sum += l * n;
                clip += gs.clip_frac * n;
                tis += gs.tis_clip_frac * n;
                klref += gs.kl * n;
            }
            ntok_all += ntok;
            norm = lb_optimizer_step(&opt, (step - 1) * M + mb + 1, &lr);
        }
        be->sync(be);
        double t_train = lb_now() - t0;

        // ---- agreement of sampler and trainer on the tokens the sampler drew
        double dsum = 0.0, dmax = 0.0, k3 = 0.0;
        long ptoks = 0;
        for (int k = 0; k < nl; k++) {
            const rl_seq *q = &qs[own[k]];
            for (int j = 0; j < q->len; j++) {
                double d = (double)q->lp_old[j] - q->lp_roll[j];
                dsum += fabs(d);
                if (fabs(d) > dmax) dmax = fabs(d);
                k3 += exp(d) - d - 1.0;   // KL(rollout || trainer), sampled from the rollout
            }
        }
        for (int i = 0; i < N; i++) ptoks += qs[i].plen + qs[i].len;
        // this rank's token sums to the global ones (rank order), the maximum over ranks
        double sums[8] = {loss_sum, clip, tis, klref, dsum, k3, (double)ss.generated,
                          (double)(ss.idle_forwards + idle)};
        if (grid.dp > 1) lb_comm_all_reduce(dpc, sums, sums, 8, LB_F64);
        dmax = max_over(dpc, dmax);
        loss_sum = sums[0], clip = sums[1], tis = sums[2], klref = sums[3];
        double rmean = rsum / N, rstd = sqrt(fmax(rsq / N - rmean * rmean, 0.0));
        double diff = sums[4] / ntok_all, lossm = loss_sum / ntok_all;
        double roll_tps = sums[6] / t_roll, train_tps = ptoks / t_train;
        if (root && c->train.log_every > 0 &&
            (step % c->train.log_every == 0 || step == c->rl.steps))
            printf("step %5d/%d | reward %.3f +- %.3f | correct %.3f | len %.2f | lp diff %.3g "
                   "| k3 %.3g | tis clip %.3f | clip %.3f | loss %.4f | norm %.3f | rollout "
                   "%.2fs %.0f tok/s | train %.2fs %.0f tok/s\n",
                   step, c->rl.steps, rmean, rstd, (double)correct / N, lensum / N, diff,
                   sums[5] / ntok_all, tis / ntok_all, clip / ntok_all, lossm, norm, t_roll,
                   roll_tps, t_train, train_tps);
        if (root) {
            fprintf(metrics,
                    "{\"step\": %d, \"reward_mean\": %.9g, \"reward_std\": %.9g, \"correct\": "
                    "%.9g, \"response_len\": %.9g, \"train_rollout_logprob_abs_diff\": %.9g, "
                    "\"train_rollout_logprob_abs_diff_max\": %.9g, \"train_rollout_k3_kl\": "
                    "%.9g, \"tis_clip_frac\": %.9g, \"clip_frac\": %.9g, \"kl_ref\": %.9g, "
                    "\"loss\": %.9g, \"grad_norm\": %.9g, \"lr\": %.9g, \"rollout_s\": %.6f, "
                    "\"train_s\": %.6f, \"rollout_tokens_per_s\": %.1f, "
                    "\"train_tokens_per_s\": %.1f, \"idle_forwards\": %.0f, \"elapsed_s\": "
                    "%.3f}\n",
                    step, rmean, rstd, (double)correct / N, lensum / N, diff, dmax,
                    sums[5] / ntok_all, tis / ntok_all, clip / ntok_all, klref / ntok_all, lossm,
                    norm, lr, t_roll, t_train, roll_tps, train_tps, sums[7], lb_now() - t_start);
            fflush(stdout);
            fflush(metrics);
        }
        if ((c->rl.eval_every > 0 && step % c->rl.eval_every == 0) || step == c->rl.steps) {
            rl_eval ev = evaluate(c, smp, greedy, max_new, dpc);
            if (root) log_eval(c, metrics, step, &ev);
        }
        if ((c->checkpoint.save_every > 0 && step % c->checkpoint.save_every == 0) ||
            (step == c->rl.steps && c->checkpoint.save_every >= 0)) {
            st.step = step;
            snprintf(path, sizeof path, "%s/step_%08d.safetensors", ckdir, step);
            if (lb_checkpoint_save_parallel(path, &opt, &st, ini, comm, &c->parallel, err,
                                            sizeof err) != 0)
                lb_die("%s", err);
            if (root) {
                keep_last(ckdir, c->checkpoint.keep);
                printf("saved %s\n", path);
            }
        }
    }
    if (metrics) fclose(metrics);
    for (int k = 0; k < nl; k++) {
        free(qs[own[k]].tok);
        free(qs[own[k]].lp_roll);
        free(qs[own[k]].lp_old);
    }
    free(qs), free(reqs), free(own), free(mbk), free(seqv), free(tok), free(tgt), free(lp);
    free(lpr), free(dfull), free(r_lp), free(r_old), free(r_roll), free(r_ref), free(r_adv);
    free(r_d), free(rewards), free(adv), free(ini);
    lb_sampler_free(smp);
    lb_sampler_free(greedy);
    lb_optimizer_free(&opt);
    lb_model_free(ref);
    lb_model_free(m);
    for (int i = 0; i < x.nnccl; i++) lb_comm_free(&x.nccl[i]);
    lb_grid_free(&grid);
    be->destroy(be);
    return 0;
}
