// rl.c: `lowbit rl`: GRPO with the sampler inside the trainer (doc/rl.md).
//
// One step: P prompts of the arithmetic task's train split, G completions each from the
// sampler (the model's own weights and weight cache; nothing is copied), rewards from the
// registry and the optional command, group-normalised advantages, then the trainer recomputes
// every response token's log-prob with the training forward (lp_old: the policy that sampled),
// and M mini-batches each take one optimizer step on GRPO's clipped, token-mean objective
// (src/grpo.h), the gradient entering at the logits through per-token weights. The optimizer
// step marks the weight cache stale; the next rollout's first forward re-quantizes it.
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

// pass@1 (mean share of correct samples), pass@k (share of problems with one correct) over the
// first eval_problems held-out problems, k = eval_samples draws each; greedy: top-1 decoding.
static rl_eval evaluate(const lb_config *c, lb_sampler *smp, lb_sampler *greedy, int max_new)
{
    rl_eval ev = {0, 0, 0, c->rl.eval_problems};
    int P = c->rl.eval_problems, K = c->rl.eval_samples;
    if (P == 0) return ev;
    char err[ERRLEN];
    rl_seq *qs = lb_calloc((size_t)P, sizeof *qs);
    lb_sample_req *reqs = lb_calloc((size_t)P * K, sizeof *reqs);
    int32_t *tok = lb_malloc((size_t)P * K * max_new * sizeof(int32_t));
    float *lp = lb_malloc((size_t)P * K * max_new * sizeof(float));
    for (int i = 0; i < P; i++) {
        uint64_t pi = lb_arith_nth(c, 1, (uint64_t)i);
        qs[i].plen = lb_arith_prompt(c, pi, qs[i].prompt);
        prompt_tokens(&qs[i]);
        for (int s = 0; s < K; s++) {
            lb_sample_req *r = &reqs[i * K + s];
            r->prompt = qs[i].ptok;
            r->prompt_len = qs[i].plen;
            // the same draws at every evaluation: steps differ only by the weights
            r->seed = lb_hash64(c->sample.seed ^ LB_RL_EVAL_SEED);
            r->stream = lb_sample_stream(pi, (uint64_t)s);
            r->tokens = tok + (size_t)(i * K + s) * max_new;
            r->logprobs = lp + (size_t)(i * K + s) * max_new;
        }
    }
    if (lb_sampler_run(smp, reqs, P * K, NULL, err, sizeof err) != 0) lb_die("%s", err);
    double p1 = 0.0;
    int pk = 0;
    for (int i = 0; i < P; i++) {
        int right = 0;
        for (int s = 0; s < K; s++)
            right += arith_correct(qs[i].prompt, reqs[i * K + s].tokens, reqs[i * K + s].len);
        p1 += (double)right / K;
        pk += right > 0;
    }
    // greedy: one request per problem (its draws are never used)
    for (int i = 0; i < P; i++) {
        reqs[i].prompt = qs[i].ptok;
        reqs[i].prompt_len = qs[i].plen;
        reqs[i].tokens = tok + (size_t)i * max_new;
        reqs[i].logprobs = lp + (size_t)i * max_new;
    }
    if (lb_sampler_run(greedy, reqs, P, NULL, err, sizeof err) != 0) lb_die("%s", err);
    int g = 0;
    for (int i = 0; i < P; i++) g += arith_correct(qs[i].prompt, reqs[i].tokens, reqs[i].len);
    ev.pass1 = p1 / P;
    ev.passk = (double)pk / P;
    ev.greedy = (double)g / P;
    free(qs);
    free(reqs);
    free(tok);
    free(lp);
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

// The trainer's view of sequences [first, first + count): tokens (count, T) = prompt +
// completion (the last completion token is only a target), targets the next token on response
// positions and -1 elsewhere. Returns the response tokens.
static int pack(const rl_seq *qs, int first, int count, int T, int32_t *tok, int32_t *tgt)
{
    int n = 0;
    for (int b = 0; b < count; b++) {
        const rl_seq *q = &qs[first + b];
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

// Response-token values of v (count, T) in sequence order into out.
static int gather(const rl_seq *qs, int first, int count, int T, const float *v, float *out)
{
    int n = 0;
    for (int b = 0; b < count; b++) {
        const rl_seq *q = &qs[first + b];
        for (int j = 0; j < q->len; j++) out[n++] = v[(size_t)b * T + q->plen - 1 + j];
    }
    return n;
}

int lb_cmd_rl(const lb_config *c0, lb_comm *comm)
{
    char err[ERRLEN], where[LB_PATH_MAX + 32], ckdir[LB_PATH_MAX + 32], path[2 * LB_PATH_MAX + 64];
    if (comm->size > 1) {
        if (comm->rank == 0)
            fprintf(stderr, "lowbit rl: %d ranks given, but RL runs on one rank in this release\n",
                    comm->size);
        return 1;
    }
    lb_config cfg = *c0;
    lb_config *c = &cfg;
    const int P = c->rl.prompts, G = c->rl.group, N = P * G, M = c->rl.mini_batches;
    if (!c->rl.init[0]) {
        fprintf(stderr, "%srl.init is empty: name the checkpoint RL starts from\n",
                lb_key_where(c, "rl", "init", where, sizeof where));
        return 1;
    }
    if (c->rl.eval_problems > 0 && !(c->gen.val_fraction > 0)) {
        fprintf(stderr, "%sgen.val_fraction is 0: no held-out problems for rl.eval_problems "
                "(set it to 0 to evaluate nothing)\n",
                lb_key_where(c, "gen", "val_fraction", where, sizeof where));
        return 1;
    }
    if (N % M) {
        fprintf(stderr, "%srl.mini_batches (%d) does not divide rl.prompts x rl.group = %d\n",
                lb_key_where(c, "rl", "mini_batches", where, sizeof where), M, N);
        return 1;
    }
    lb_rewards rw;
    lb_sampler_config sc;
    if (lb_rewards_init(&rw, c->rl.rewards, c->rl.format_reward, c->rl.reward_command, err,
                        sizeof err) != 0) {
        fprintf(stderr, "%s%s\n", lb_key_where(c, "rl", "rewards", where, sizeof where), err);
        return 1;
    }
    if (lb_model_config_from_checkpoint(c, c->rl.init, err, sizeof err) != 0 ||
        lb_rl_sampler_config(c, &sc, err, sizeof err) != 0) {
        fprintf(stderr, "lowbit rl: %s\n", err);
        return 1;
    }
    if (c->model.vocab_size < LB_BYTE_VOCAB) {
        fprintf(stderr, "lowbit rl: the arithmetic task needs byte tokens; the model has a "
                        "vocabulary of %d\n", c->model.vocab_size);
        return 1;
    }
    const int max_new = sc.max_new_tokens;
    const int T = lb_arith_prompt_max(c) + max_new;   // every sequence fits (b, T)
    const float inv_temp = 1.0f / sc.temperature;

    lb_backend *be = lb_rl_backend(c);
    if (!be) return 1;
    lb_model *m = lb_rl_model_open(c, be, c->rl.init, err, sizeof err);
    lb_model *ref = NULL;
    if (m && c->rl.kl_coef > 0) ref = lb_rl_model_open(c, be, c->rl.init, err, sizeof err);
    if (!m || (c->rl.kl_coef > 0 && !ref)) {
        fprintf(stderr, "lowbit rl: %s\n", err);
        return 1;
    }
    // the schedule runs over optimizer steps: rl.steps x rl.mini_batches
    lb_optim_config oc = {c->train.lr, c->train.min_lr, c->train.warmup_steps, c->rl.steps * M,
                          c->train.beta1, c->train.beta2, c->train.adam_eps,
                          c->train.weight_decay, c->train.grad_clip};
    lb_optimizer opt;
    lb_optimizer_init(&opt, m, &oc);
    snprintf(ckdir, sizeof ckdir, "%.*s/checkpoints", LB_PATH_MAX, c->run.out_dir);
    if (lb_mkdirs(ckdir, err, sizeof err) != 0) {
        fprintf(stderr, "lowbit rl: %s\n", err);
        return 1;
    }
    lb_train_state st = {0};
    char resume[LB_PATH_MAX + 64] = "";
    if (!strcmp(c->checkpoint.resume, "auto")) lb_checkpoint_latest(ckdir, resume, sizeof resume);
    else snprintf(resume, sizeof resume, "%.*s", LB_PATH_MAX, c->checkpoint.resume);
    if (resume[0]) {
        if (lb_checkpoint_load(resume, m, opt.adam_m, opt.adam_v, &st, err, sizeof err) != 0) {
            fprintf(stderr, "lowbit rl: %s\n", err);
            return 1;
        }
        printf("resumed from %s at step %" PRId64 "\n", resume, st.step);
    }
    lb_sampler *smp = lb_sampler_create(m, &sc, T, err, sizeof err);
    lb_sampler_config gc = sc;
    gc.top_k = 1;
    lb_sampler *greedy = smp ? lb_sampler_create(m, &gc, T, err, sizeof err) : NULL;
    if (!smp || !greedy) {
        fprintf(stderr, "lowbit rl: %s\n", err);
        return 1;
    }
    char *ini = lb_config_to_ini(c);
    printf("# resolved configuration\n%s\n", ini);
    if (be->deterministic && !strcmp(c->precision.nvfp4_scale, "per-tensor"))
        printf("warning: precision.nvfp4_scale = per-tensor scales NVFP4 activations by the amax "
               "of the whole call, so a row's result depends on its batch: sampler and trainer "
               "log-probs will differ where NVFP4 is used (per-token keeps them equal)\n");
    printf("model %s from %s: %.3fM parameters, %s backend%s, precision %s, KV cache %s; "
           "%d prompts x %d samples per step, %d mini-batch(es)\n",
           m->cfg.arch, c->rl.init, m->nparams / 1e6, be->name,
           be->deterministic ? " (deterministic)" : "", c->precision.recipe, c->sample.kv_cache,
           P, G, M);
    snprintf(path, sizeof path, "%.*s/%.*s", LB_PATH_MAX, c->run.out_dir, LB_PATH_MAX,
             c->train.metrics_file);
    FILE *metrics = fopen(path, resume[0] ? "a" : "w");
    if (!metrics) {
        fprintf(stderr, "lowbit rl: %s: cannot open for writing\n", path);
        return 1;
    }

    lb_grpo_config gcfg = {c->rl.eps_low, c->rl.eps_high, c->rl.kl_coef, c->rl.tis_cap,
                           c->rl.adv_eps};
    rl_seq *qs = lb_calloc((size_t)N, sizeof *qs);
    lb_sample_req *reqs = lb_calloc((size_t)N, sizeof *reqs);
    for (int i = 0; i < N; i++) {
        qs[i].tok = lb_malloc((size_t)max_new * sizeof(int32_t));
        qs[i].lp_roll = lb_malloc((size_t)max_new * sizeof(float));
        qs[i].lp_old = lb_malloc((size_t)max_new * sizeof(float));
    }
    const int MB = c->rl.micro_batch, NS = N / M;   // sequences per micro- and mini-batch
    size_t cap = (size_t)MB * T;
    int32_t *tok = lb_malloc(cap * sizeof(int32_t)), *tgt = lb_malloc(cap * sizeof(int32_t));
    float *lp = lb_malloc(cap * sizeof(float)), *lpr = lb_malloc(cap * sizeof(float));
    float *dfull = lb_malloc(cap * sizeof(float));
    size_t rcap = (size_t)N * max_new;   // response tokens at most
    float *r_lp = lb_malloc(rcap * sizeof(float)), *r_old = lb_malloc(rcap * sizeof(float));
    float *r_roll = lb_malloc(rcap * sizeof(float)), *r_ref = lb_malloc(rcap * sizeof(float));
    float *r_adv = lb_malloc(rcap * sizeof(float)), *r_d = lb_malloc(rcap * sizeof(float));
    float *rewards = lb_malloc((size_t)N * sizeof(float));
    float *adv = lb_malloc((size_t)N * sizeof(float));

    if (st.step == 0) {
        rl_eval ev = evaluate(c, smp, greedy, max_new);
        log_eval(c, metrics, 0, &ev);
    }
    double t_start = lb_now();
    for (int step = (int)st.step + 1; step <= c->rl.steps; step++) {
        // ---- rollout: P train problems, G samples each
        double t0 = lb_now();
        uint64_t draw_seed = lb_hash64(c->sample.seed + (uint64_t)step);
        for (int p = 0; p < P; p++) {
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
                lb_sample_req *r = &reqs[p * G + g];
                *r = (lb_sample_req){q->ptok, q->plen, draw_seed, lb_sample_stream(pi, (uint64_t)g),
                                     q->tok, q->lp_roll, 0, 0};
            }
        }
        lb_sample_stats ss;
        if (lb_sampler_run(smp, reqs, N, &ss, err, sizeof err) != 0) lb_die("%s", err);
        double rsum = 0.0, rsq = 0.0, lensum = 0.0;
        int correct = 0;
        for (int i = 0; i < N; i++) {
            rl_seq *q = &qs[i];
            q->len = reqs[i].len;
            char text[256];
            for (int j = 0; j < q->len; j++) text[j] = (char)q->tok[j];
            double r;
            // the task's text: the prompt without its separating newline
            if (lb_rewards_score(&rw, q->prompt + (q->prompt[0] == '\n'), text, (size_t)q->len,
                                 &r, err, sizeof err) != 0) {
                fprintf(stderr, "lowbit rl: step %d: %s\n", step, err);
                return 1;
            }
            rewards[i] = (float)r;
            rsum += r;
            rsq += r * r;
            lensum += q->len;
            q->correct = arith_correct(q->prompt, q->tok, q->len);
            correct += q->correct;
        }
        lb_grpo_advantages(rewards, P, G, c->rl.adv_eps, adv);
        double t_roll = lb_now() - t0;

        // ---- lp_old: the trainer's log-probs before any update. Mini-batch 0 gets them from
        // its own training forward (the weights have not moved yet); later mini-batches need
        // this extra pass.
        t0 = lb_now();
        for (int first = NS; first < N; first += MB) {
            int cnt = first + MB <= N ? MB : N - first;
            pack(qs, first, cnt, T, tok, tgt);
            lb_model_forward_logprobs(m, tok, tgt, cnt, T, inv_temp, lp);
            for (int b = 0; b < cnt; b++) {
                rl_seq *q = &qs[first + b];
                for (int j = 0; j < q->len; j++) q->lp_old[j] = lp[(size_t)b * T + q->plen - 1 + j];
            }
        }
        // ---- the update: M mini-batches, each one optimizer step
        double loss_sum = 0.0, clip = 0.0, tis = 0.0, klref = 0.0, norm = 0.0, lr = 0.0;
        long ntok_all = 0;
        for (int mb = 0; mb < M; mb++) {
            int f0 = mb * NS, ntok = 0;
            for (int i = f0; i < f0 + NS; i++) ntok += qs[i].len;
            lb_model_zero_grad(m);
            for (int first = f0; first < f0 + NS; first += MB) {
                int cnt = first + MB <= f0 + NS ? MB : f0 + NS - first;
                int n = pack(qs, first, cnt, T, tok, tgt);
                lb_model_forward_logprobs(m, tok, tgt, cnt, T, inv_temp, lp);
                gather(qs, first, cnt, T, lp, r_lp);
                int k = 0;
                for (int b = 0; b < cnt; b++) {
                    rl_seq *q = &qs[first + b];
                    for (int j = 0; j < q->len; j++, k++) {
                        if (mb == 0) q->lp_old[j] = r_lp[k];
                        r_old[k] = q->lp_old[j];
                        r_roll[k] = q->lp_roll[j];
                        r_adv[k] = adv[first + b];
                    }
                }
                if (ref) {
                    lb_model_forward_logprobs(ref, tok, tgt, cnt, T, inv_temp, lpr);
                    gather(qs, first, cnt, T, lpr, r_ref);
                }
                lb_grpo_stats gs;
                double l = lb_grpo_loss(&gcfg, r_lp, r_old, r_roll, ref ? r_ref : NULL, r_adv,
                                        (size_t)n, r_d, &gs);
                // grpo gives d(token mean over this micro-batch); the objective is the token
                // mean over the mini-batch
                double wgt = (double)n / ntok;
                for (size_t i = 0; i < cap; i++) dfull[i] = 0.0f;
                k = 0;
                for (int b = 0; b < cnt; b++) {
                    rl_seq *q = &qs[first + b];
                    for (int j = 0; j < q->len; j++, k++)
                        dfull[(size_t)b * T + q->plen - 1 + j] = (float)(r_d[k] * wgt);
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
        long nresp = 0, ptoks = 0;
        for (int i = 0; i < N; i++) {
            const rl_seq *q = &qs[i];
            for (int j = 0; j < q->len; j++) {
                double d = (double)q->lp_old[j] - q->lp_roll[j];
                dsum += fabs(d);
                if (fabs(d) > dmax) dmax = fabs(d);
                k3 += exp(d) - d - 1.0;   // KL(rollout || trainer), sampled from the rollout
            }
            nresp += q->len;
            ptoks += q->plen + q->len;
        }
        double rmean = rsum / N, rstd = sqrt(fmax(rsq / N - rmean * rmean, 0.0));
        double diff = dsum / nresp, lossm = loss_sum / ntok_all;
        double roll_tps = ss.generated / t_roll, train_tps = ptoks / t_train;
        if (c->train.log_every > 0 && (step % c->train.log_every == 0 || step == c->rl.steps))
            printf("step %5d/%d | reward %.3f +- %.3f | correct %.3f | len %.2f | lp diff %.3g "
                   "| k3 %.3g | tis clip %.3f | clip %.3f | loss %.4f | norm %.3f | rollout "
                   "%.2fs %.0f tok/s | train %.2fs %.0f tok/s\n",
                   step, c->rl.steps, rmean, rstd, (double)correct / N, lensum / N, diff,
                   k3 / nresp, tis / ntok_all, clip / ntok_all, lossm, norm, t_roll, roll_tps,
                   t_train, train_tps);
        fprintf(metrics,
                "{\"step\": %d, \"reward_mean\": %.9g, \"reward_std\": %.9g, \"correct\": %.9g, "
                "\"response_len\": %.9g, \"train_rollout_logprob_abs_diff\": %.9g, "
                "\"train_rollout_logprob_abs_diff_max\": %.9g, \"train_rollout_k3_kl\": %.9g, "
                "\"tis_clip_frac\": %.9g, \"clip_frac\": %.9g, \"kl_ref\": %.9g, \"loss\": %.9g, "
                "\"grad_norm\": %.9g, \"lr\": %.9g, \"rollout_s\": %.6f, \"train_s\": %.6f, "
                "\"rollout_tokens_per_s\": %.1f, \"train_tokens_per_s\": %.1f, "
                "\"elapsed_s\": %.3f}\n",
                step, rmean, rstd, (double)correct / N, lensum / N, diff, dmax, k3 / nresp,
                tis / ntok_all, clip / ntok_all, klref / ntok_all, lossm, norm, lr, t_roll,
                t_train, roll_tps, train_tps, lb_now() - t_start);
        fflush(stdout);
        fflush(metrics);
        if ((c->rl.eval_every > 0 && step % c->rl.eval_every == 0) || step == c->rl.steps) {
            rl_eval ev = evaluate(c, smp, greedy, max_new);
            log_eval(c, metrics, step, &ev);
        }
        if ((c->checkpoint.save_every > 0 && step % c->checkpoint.save_every == 0) ||
            step == c->rl.steps) {
            st.step = step;
            snprintf(path, sizeof path, "%s/step_%08d.safetensors", ckdir, step);
            if (lb_checkpoint_save(path, m, opt.adam_m, opt.adam_v, &st, ini, err, sizeof err) != 0)
                lb_die("%s", err);
            keep_last(ckdir, c->checkpoint.keep);
            printf("saved %s\n", path);
        }
    }
    fclose(metrics);
    for (int i = 0; i < N; i++) {
        free(qs[i].tok);
        free(qs[i].lp_roll);
        free(qs[i].lp_old);
    }
    free(qs), free(reqs), free(tok), free(tgt), free(lp), free(lpr), free(dfull);
    free(r_lp), free(r_old), free(r_roll), free(r_ref), free(r_adv), free(r_d);
    free(rewards), free(adv), free(ini);
    lb_sampler_free(smp);
    lb_sampler_free(greedy);
    lb_optimizer_free(&opt);
    lb_model_free(ref);
    lb_model_free(m);
    be->destroy(be);
    return 0;
}
