// train.c: `lowbit train`: micro-batches with gradient accumulation, global-norm clipping,
// AdamW with linear warm-up and cosine decay, validation, progress lines, JSON-lines metrics
// and atomic checkpoints that resume bit for bit; data parallelism over the ranks (each takes
// every dp-th micro-batch of the step; ZeRO-1 or all-reduce in the optimizer: doc/parallel.md).
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <unistd.h>
#include "kernels/common.h"
#include "src/io/checkpoint.h"
#include "src/cli/commands.h"
#include "src/io/data.h"
#include "src/train/optim.h"
#include "src/cli/run.h"
#include "src/io/metrics.h"
#include "src/train/mlperf.h"
#include "src/io/files.h"
#include "parallel/grid.h"
#include "parallel/pipeline_schedule.h"

#define ERRLEN 1024

static void fmt_duration(char *buf, size_t len, double s)
{
    if (s < 0 || !isfinite(s)) s = 0;
    long t = (long)(s + 0.5);
    if (t >= 3600) snprintf(buf, len, "%ldh%02ldm", t / 3600, t / 60 % 60);
    else snprintf(buf, len, "%ldm%02lds", t / 60, t % 60);
}

// The terminal's width when stdout is one (progress is then refreshed in place between the
// logged steps), else 0 (files and pipes get the logged lines only).
static int tty_columns(void)
{
    struct winsize ws;
    if (!isatty(STDOUT_FILENO)) return 0;
    return ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0 ? ws.ws_col : 80;
}

// Ends a line refreshed in place (*pending) before other output.
static void tty_clear(int *pending)
{
    if (*pending) printf("\r\033[K");
    *pending = 0;
}

static double max_rss_mib(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_maxrss / 1024.0;
}

// One `lowbit train` run: its parallel pieces (src/cli/run.h), the data, the state a checkpoint
// keeps, the model as a pipeline stage and the step's micro-batches. Set up once; every step
// reuses it.
typedef struct {
    lb_run run;                         // grid, communicators, backend, model, optimizer
    lb_config cfg;                      // the run's configuration ([model] from checkpoint.init)
    const lb_config *c;                 // &cfg
    lb_model *m;                        // run.m
    int B, T, G, M;                     // micro-batch, sequence, global and per-rank micro-batches
    lb_loader *train, *val;
    lb_run_tokenizer tok;               // data.tokenizer's or checkpoint.init's, saved with the model
    lb_train_state st;
    char resume[LB_PATH_MAX + 64];      // the checkpoint resumed from, or ""
    char *ini;                          // the resolved configuration
    lb_metrics *metrics;                // rank 0
    lb_pipeline_stage stage;
    int32_t **in, **tg;                 // (M) the step's micro-batches of this rank
    double *sums;                       // the step's loss sums (add_losses)
    double t0;                          // when the first step started
    double last_save;                   // when the last checkpoint was saved (or t0)
    int first;                          // the first step of this run
    int tty, pending;                   // progress on a terminal (tty_columns); a line is on it
    double t_init;                      // when the command started (MLPerf's init_start), ms
    lb_mlperf mlperf;                   // with mlperf.enabled: the schedule, the target, the log
} train_run;

// Mean cross-entropy over the first V batches of the validation shards. Data-parallel
// rank r evaluates batches r, r + dp, ...; under expert parallelism every rank runs the same
// number of forwards (the dispatcher is collective), repeating its first batch uncounted where it
// has none. One rank of each model replica counts (tp rank 0 of the last stage); the sums of
// losses and tokens are added over all ranks.
static double validate(train_run *x, int V)
{
    char err[ERRLEN];
    const lb_config *c = x->c;
    lb_loader *val = x->val;
    int32_t *in = x->in[0], *tg = x->tg[0];   // the step's buffers, free by now
    lb_model *m = x->m;
    const lb_grid *g = &x->run.grid;
    double acc[2] = {0.0, 0.0};   // sum of token losses, tokens
    int rounds = (V + g->dp - 1) / g->dp;
    int counts = m->last_stage && g->tp_rank == 0;
    lb_model_use_slot(m, 0);
    lb_loader_reset(val);
    int at = 0;   // the batch the loader returns next
    for (int k = 0; k < rounds; k++) {
        int mine = k * g->dp + g->dp_rank;
        if (mine >= V && g->ep == 1) break;
        int want = mine < V ? mine : (k == 0 ? 0 : -1);   // -1: run the last batch again
        if (want >= 0) {
            lb_loader_skip(val, want - at);
            if (lb_loader_next(val, in, tg, err, sizeof err) != 0) lb_die("%s", err);
            at = want + 1;
        }
        lb_pipeline_recv_forward(&x->stage);
        lb_model_forward(m, in, tg, c->train.micro_batch, c->train.seq_len);
        lb_pipeline_send_forward(&x->stage);
        if (counts && mine < V) {   // the last stage has the loss
            acc[0] += (double)m->ce_loss * m->ntokens;
            acc[1] += m->ntokens;
        }
    }
    if (x->run.world->size > 1) lb_comm_all_reduce(x->run.world, acc, acc, 2, LB_F64);
    return acc[1] > 0 ? acc[0] / acc[1] : 0.0;
}

// data.train_files: its syntax, its weights, a match for every glob (the shards' contents are
// checked when the loader opens them).
static int check_train_files(const lb_config *c, char *err, size_t errlen)
{
    lb_data_blend bl;
    char where[LB_PATH_MAX + 32], why[ERRLEN];
    lb_key_where(c, "data", "train_files", where, sizeof where);
    if (lb_data_blend_parse(c->data.train_files, &bl, why, sizeof why) != 0) {
        snprintf(err, errlen, "%sdata.train_files: %s", where, why);
        return -1;
    }
    for (int d = 0; d < bl.n; d++) {
        char **list;
        int n = lb_glob(bl.glob[d], &list);
        lb_glob_free(list, n);
        if (n == 0) {
            snprintf(err, errlen, "%sdata.train_files: %s: no token shards match", where,
                     bl.glob[d]);
            return -1;
        }
    }
    return 0;
}

// Layout checks that need the world size and the training keys, and the data named; the same
// verdict on every rank.
static int check_train(const lb_config *c, const lb_grid *g, char *err, size_t errlen)
{
    const lb_parallel_config *pc = &c->parallel;
    if (c->train.grad_accum % g->dp != 0) {
        const int ga = c->train.grad_accum, up = (ga + g->dp - 1) / g->dp * g->dp;
        const int keep = up % ga == 0 && c->train.micro_batch % (up / ga) == 0;
        char same[160] = "";
        if (keep)   // the same global batch of sequences
            snprintf(same, sizeof same, " --set train.micro_batch=%d",
                     c->train.micro_batch / (up / ga));
        snprintf(err, errlen, "train.grad_accum (%d) is not divisible by the data-parallel size "
                 "dp = %d (%d ranks / (tp %d x pp %d)): each data-parallel rank runs "
                 "grad_accum / dp micro-batches of every step (the global batch is grad_accum x "
                 "train.micro_batch sequences); add --set train.grad_accum=%d%s%s", ga, g->dp,
                 g->world, g->tp, g->pp, up, same, keep ? " to keep the global batch" : "");
        return -1;
    }
    if (pc->micro_batches > 0 && pc->micro_batches * g->dp != c->train.grad_accum) {
        snprintf(err, errlen, "parallel.micro_batches (%d) x dp (%d) is not train.grad_accum "
                 "(%d): leave parallel.micro_batches at 0 to derive it", pc->micro_batches, g->dp,
                 c->train.grad_accum);
        return -1;
    }
    if (pc->fail_rank >= g->world) {
        snprintf(err, errlen, "parallel.fail_rank (%d) is not a rank of this %d-rank job",
                 pc->fail_rank, g->world);
        return -1;
    }
    if (!c->data.train_files[0]) {
        snprintf(err, errlen, "data.train_files is empty: name the token shards");
        return -1;
    }
    if (check_train_files(c, err, errlen) != 0) return -1;
    if (c->mlperf.enabled && !c->data.val_files[0]) {
        snprintf(err, errlen, "mlperf.enabled: data.val_files is empty: the benchmark evaluates "
                 "on a fixed validation set");
        return -1;
    }
    if (c->mlperf.enabled && c->mlperf.eval_samples % c->train.micro_batch != 0) {
        snprintf(err, errlen, "mlperf.eval_samples (%d) is not a multiple of train.micro_batch "
                 "(%d): an evaluation is whole micro-batches", c->mlperf.eval_samples,
                 c->train.micro_batch);
        return -1;
    }
    return 0;
}

// parallel.fail_rank: this rank stops here the way a real failure would.
static void fail_on_purpose(const char *mode, int rank, int step)
{
    if (strcmp(mode, "die") == 0)
        lb_die("rank %d fails at step %d on purpose (parallel.fail_rank)", rank, step);
    fprintf(stderr, "lowbit train: rank %d fails at step %d on purpose (parallel.fail_rank, "
            "fail_mode %s)\n", rank, step, mode);
    fflush(stderr);
    if (strcmp(mode, "exit") == 0) _exit(3);   // as a crash: no MPI_Finalize, no MPI_Abort
    raise(SIGKILL);                             // as the OOM killer would
    _exit(3);
}

// Per-rank sums of one micro-batch's loss terms: the cross-entropy exists on tp rank 0 of the
// last stage (one count per model replica), the aux loss of each stage's layers on its tp rank 0.
static void add_losses(const train_run *x, double sums[2])
{
    if (x->run.grid.tp_rank != 0) return;
    if (x->m->last_stage) sums[0] += x->m->ce_loss;
    sums[1] += x->m->aux_loss;
}

// The model piece as the pipeline schedule drives it (parallel/pipeline_schedule.h).
static void stage_use_slot(void *p, int slot)
{
    train_run *x = p;
    lb_model_use_slot(x->m, slot);
    lb_model_prepare(x->m, x->B, x->T);
}

static void stage_prepare(void *p)
{
    train_run *x = p;
    lb_model_prepare(x->m, x->B, x->T);
}

static void stage_forward(void *p, int j)
{
    train_run *x = p;
    lb_model_forward_train(x->m, x->in[j], x->tg[j], x->B, x->T, 1.0f / x->G);
    add_losses(x, x->sums);
}

static void stage_backward(void *p)
{
    train_run *x = p;
    lb_model_backward(x->m, 1.0f / x->G);   // the mean over the global batch
}

static float *stage_input(void *p) { return lb_model_stage_input(((train_run *)p)->m); }
static float *stage_output(void *p) { return lb_model_stage_output(((train_run *)p)->m); }
static float *stage_grad(void *p) { return lb_model_stage_grad(((train_run *)p)->m); }
static size_t stage_floats(void *p) { return lb_model_stage_floats(((train_run *)p)->m); }
static size_t stage_grad_floats(void *p)
{
    return lb_model_stage_grad_floats(((train_run *)p)->m);
}

static lb_pipeline_stage pipeline_stage(train_run *x)
{
    return (lb_pipeline_stage){x->run.comms.pp, x->m->be, x->run.grid.pp_rank, x->run.grid.pp,
                               x->m->first_stage, x->m->last_stage, x,
                               stage_use_slot, stage_prepare, stage_forward, stage_backward,
                               stage_input, stage_output, stage_grad, stage_floats,
                               stage_grad_floats};
}

// The layout and the data named, checked before any work; then the grid.
static int train_layout(train_run *x, const lb_config *c, lb_comm *comm)
{
    x->c = c;
    if (lb_run_layout(&x->run, c, comm, "lowbit train", check_train) != 0) return 1;
    x->B = c->train.micro_batch;
    x->T = c->train.seq_len;
    x->G = c->train.grad_accum;
    x->M = x->G / x->run.grid.dp;
    return 0;
}

// The shards' tokenizer, stored in every checkpoint: data.tokenizer, else that of the model
// checkpoint.init starts from (none: a byte model, whose checkpoints carry none).
static int train_tokenizer(train_run *x)
{
    char err[ERRLEN];
    int bad = lb_run_tokenizer_open(&x->tok, x->c, x->c->checkpoint.init, err, sizeof err) != 0;
    if (lb_run_failed(&x->run, bad, err)) return 1;
    x->run.tokenizer_json = x->tok.json;
    return 0;
}

// The token shards, then the backend, the communicators, the model piece, its optimizer and
// the checkpoint directory.
static int train_open(train_run *x)
{
    char err[ERRLEN];
    const lb_config *c = x->c;
    lb_run *r = &x->run;
    // Neither shuffled nor weighted: the sequential loader, so such runs read their data and
    // write their checkpoints exactly as before these options existed.
    lb_data_blend bl;
    if (lb_data_blend_parse(c->data.train_files, &bl, err, sizeof err) != 0)   // checked
        lb_die("data.train_files: %s", err);
    if (c->data.shuffle || bl.weighted)
        x->train = lb_loader_open_blend(&bl, c->data.shuffle, c->run.seed, x->B, x->T,
                                        c->model.vocab_size, err, sizeof err);
    else
        x->train = lb_loader_open(c->data.train_files, x->B, x->T, c->model.vocab_size, err,
                                  sizeof err);
    if (lb_run_failed(r, !x->train, err)) return 1;
    if (c->data.val_files[0]) {
        x->val = lb_loader_open(c->data.val_files, x->B, x->T, c->model.vocab_size, err,
                                sizeof err);
        if (lb_run_failed(r, !x->val, err)) return 1;
    }
    // every token of every shard, before any output (doc/data.md)
    if (lb_run_check_shards(r, x->train, "data.train_files") != 0 ||
        (x->val && lb_run_check_shards(r, x->val, "data.val_files") != 0))
        return 1;
    // an MLPerf evaluation reads each of its sequences once: the loader must not wrap around
    int64_t need = (int64_t)c->mlperf.eval_samples * x->T + 1;
    if (c->mlperf.enabled && lb_loader_tokens(x->val) < need) {
        snprintf(err, sizeof err, "data.val_files: %lld tokens, fewer than mlperf.eval_samples "
                 "(%d) x train.seq_len (%d) + 1: the evaluation would read sequences twice",
                 (long long)lb_loader_tokens(x->val), c->mlperf.eval_samples, x->T);
        if (lb_run_failed(r, 1, err)) return 1;
    }
    if (lb_run_setup(r, 0) != 0) return 1;
    x->m = r->m;
    lb_run_optimizer(r, c->train.steps);
    return lb_run_checkpoint_dir(r);
}

// A resumed run goes on with the tokenizer its checkpoint stores: taken from it where
// data.tokenizer is not set (so later checkpoints carry it on), and another one refused, since
// the same ids would then mean other text. 0, or -1 with a message.
static int resume_tokenizer(train_run *x, char *err, size_t errlen)
{
    char *stored = NULL;
    if (lb_checkpoint_tokenizer(x->resume, &stored, err, errlen) != 0) return -1;
    int rc = 0;
    if (!x->tok.json && stored) {
        rc = lb_run_tokenizer_open(&x->tok, x->c, x->resume, err, errlen);
        x->run.tokenizer_json = x->tok.json;
    } else if (x->tok.json && (!stored || strcmp(stored, x->tok.json))) {
        snprintf(err, errlen, "%.400s was trained %s; data.tokenizer names %.300s: resume with the "
                 "tokenizer it was trained with, or start a new run from its weights "
                 "(checkpoint.init)", x->resume, stored ? "with another tokenizer" : "on bytes "
                 "(it stores no tokenizer)", x->tok.name);
        rc = -1;
    }
    free(stored);
    return rc;
}

// Resume or start fresh. Rank 0 picks the checkpoint and reads it; every rank takes its part.
static int train_load(train_run *x)
{
    char err[ERRLEN];
    lb_run *r = &x->run;
    lb_run_resume_path(r, x->resume, sizeof x->resume);
    const char *init = x->c->checkpoint.init;
    if (!x->resume[0] && init[0]) {   // fine-tuning: the weights alone, at step 0
        int bad = lb_checkpoint_load_weights(init, x->m, r->world, &x->c->parallel, err,
                                             sizeof err) != 0;
        if (lb_run_failed(r, bad, err)) return 1;
        if (r->root) printf("initialized from %s (weights only: step 0, new optimizer state)\n",
                            init);
        return 0;
    }
    if (!x->resume[0]) {
        lb_model_init_params(x->m, x->c->run.seed);   // counter-based: the same on every layout
        return 0;
    }
    char why[ERRLEN];
    int bad = lb_optimizer_load(x->resume, &r->opt, &x->st, r->world,
                                          &x->c->parallel, err, sizeof err) != 0;
    // what the tensors' shapes do not tell (a changed rope_theta loads without a word)
    if (!bad) bad = lb_run_same_model(x->c, x->resume, err, sizeof err) != 0;
    if (!bad) bad = resume_tokenizer(x, err, sizeof err) != 0;
    if (!bad && lb_loader_seek(x->train, x->st.loader_shard, x->st.loader_pos, why,
                               sizeof why) != 0) {
        snprintf(err, sizeof err, "%.400s: its loader position does not fit data.train_files: "
                 "%.500s", x->resume, why);
        bad = 1;
    }
    if (lb_run_failed(r, bad, err)) return 1;
    if (r->root) {
        char changed[2048];
        lb_run_changed_keys(x->c, x->resume, changed, sizeof changed);
        printf("resumed from %s at step %" PRId64 "%s%s\n", x->resume, x->st.step,
               changed[0] ? "; changed since: " : "", changed);
    }
    return 0;
}

// [mlperf]: the evaluation schedule and the target on every rank; rank 0 opens the log and writes
// its init keys (llama31_8b's: doc/mlperf.md).
static int train_mlperf_open(train_run *x)
{
    char err[ERRLEN];
    const lb_config *c = x->c;
    lb_run *r = &x->run;
    lb_mlperf *p = &x->mlperf;
    p->batch = (int64_t)x->B * x->G;
    int64_t every = c->mlperf.eval_every > 0 ? c->mlperf.eval_every : 12288;
    p->every = lb_mlperf_steps(every, p->batch);
    p->first = c->mlperf.eval_start >= 0 ? lb_mlperf_steps(c->mlperf.eval_start, p->batch)
                                         : p->every;
    p->target = c->mlperf.target > 0 ? c->mlperf.target : 3.3;
    if (lb_run_failed(r, lb_mlperf_open(p, c, r->root, x->resume[0] != 0, err, sizeof err) != 0,
                      err))
        return 1;
    const lb_model *m = x->m;
    lb_mllog_run info = {LB_MLPERF_LLAMA, p->batch, x->B, x->M, x->T, c->train.steps,
                         c->mlperf.eval_samples, x->st.step, c->train.steps, r->world->size,
                         r->grid.tp, r->grid.pp, r->grid.ep, c->run.backend,
                         lb_mllog_precision_linear(&m->contract, m->def, &m->cfg),
                         lb_mllog_precision_attn(&m->contract, NULL), p->target};
    lb_mllog_header(p->log, c, &info, x->t_init);
    if (r->root)
        printf("mlperf: %s log in %s/%s; evaluation of %d sequences after step %d and every %d "
               "steps (%lld sequences); target eval log-perplexity %g%s\n", LB_MLPERF_LLAMA,
               c->run.out_dir, c->mlperf.log_file, c->mlperf.eval_samples, p->first, p->every,
               (long long)(p->every * p->batch), p->target,
               c->train.val_every > 0 ? " (train.val_every is not used)" : "");
    return 0;
}

// The resolved configuration into OUT_DIR, rank 0's header (the model, the layout, the
// step's shape) and the metrics file.
static int train_announce(train_run *x)
{
    char err[ERRLEN];
    const lb_config *c = x->c;
    lb_run *r = &x->run;
    const lb_model *m = x->m;
    x->ini = lb_run_ini(&x->run);
    char layout[256];
    lb_grid_describe(&r->grid, layout, sizeof layout);
    if (lb_run_failed(r, r->root && lb_run_config_write(c, x->ini, err,
                                                        sizeof err) != 0, err))
        return 1;
    if (r->root) {
        printf("model %s: %.3fM parameters (%.3fM on rank 0), %.3fM active matmul parameters per "
               "token, %s backend\n", m->cfg.arch, m->gparams / 1e6, m->nparams / 1e6,
               lb_model_active_params(m) / 1e6, r->be->name);
        char how[200] = "one rank: no communication";
        if (r->world->size > 1)
            snprintf(how, sizeof how, "%s; collectives over %s%s%s",
                     c->parallel.zero ? "ZeRO-1 distributed optimizer" : "all-reduced gradients",
                     r->comms.nnccl ? "nccl" : "mpi",
                     c->parallel.deterministic ? ", rank-order sums" : "",
                     r->grid.pp > 1 ? "; 1F1B pipeline" : "");
        printf("layout %s%s; %d micro-batch%s of %d x %d per rank and step; %s\n", layout,
               r->par.sp ? ", sequence parallel" : "", x->M, x->M == 1 ? "" : "es", x->B, x->T,
               how);
    }
    if (r->root)
        x->metrics = lb_metrics_open(c->run.out_dir, c->train.metrics_file, "train",
                                     x->resume[0] ? (long)x->st.step : -1, err, sizeof err);
    if (lb_run_failed(r, r->root && !x->metrics, err)) return 1;
    if (x->metrics) lb_metrics_text(x->metrics, x->resume[0] ? x->st.step : 0, "config", x->ini);
    return c->mlperf.enabled ? train_mlperf_open(x) : 0;
}

// The step's micro-batches of this rank (read before the schedule runs), the model as a
// pipeline stage, and the clock.
static void train_alloc(train_run *x)
{
    x->in = lb_calloc(x->M, sizeof *x->in);
    x->tg = lb_calloc(x->M, sizeof *x->tg);
    for (int j = 0; j < x->M; j++) {
        x->in[j] = lb_malloc((size_t)x->B * x->T * sizeof(int32_t));
        x->tg[j] = lb_malloc((size_t)x->B * x->T * sizeof(int32_t));
    }
    x->stage = pipeline_stage(x);
    x->t0 = x->last_save = lb_now();
    x->tty = x->run.root && x->c->train.log_every > 0 ? tty_columns() : 0;
    x->first = (int)x->st.step + 1;
}

// Micro-batch j of the step's G consecutive batches belongs to data-parallel rank j mod dp:
// the ranks together see exactly the batches one rank would, and every loader ends the step at
// the same position.
static void read_micro_batches(train_run *x)
{
    char err[ERRLEN];
    const lb_grid *g = &x->run.grid;
    for (int j = 0, k = 0; j < x->G; j++) {
        if (j % g->dp != g->dp_rank) {
            lb_loader_skip(x->train, 1);
            continue;
        }
        if (lb_loader_next(x->train, x->in[k], x->tg[k], err, sizeof err) != 0) lb_die("%s", err);
        k++;
    }
}

// The MoE health of a logged step (lb_model_moe_stats_end; collective) as metrics members
// after a comma, each an object of the MoE layers by number: the most and the fewest tokens an
// expert got over the mean, and the router's mean entropy in nats. "" for a dense model.
static char *moe_metrics(train_run *x)
{
    const int L = x->c->model.num_hidden_layers;
    double *v = lb_malloc(3 * (size_t)L * sizeof(double));
    lb_model_moe_stats_end(x->m, x->run.world, v, v + L, v + 2 * L);
    static const char *const key[3] = {"expert_load_max", "expert_load_min", "router_entropy"};
    size_t cap = 64 + (size_t)L * 3 * 40, n = 0;
    char *s = lb_malloc(cap);
    s[0] = 0;
    for (int k = 0; k < 3; k++) {
        const char *sep = "";
        for (int l = 0; l < L; l++) {
            if (isnan(v[k * L + l])) continue;
            if (!*sep) n += (size_t)snprintf(s + n, cap - n, ", \"%s\": {", key[k]);
            n += (size_t)snprintf(s + n, cap - n, "%s\"%d\": %.6g", sep, l, v[k * L + l]);
            sep = ", ";
        }
        if (*sep) n += (size_t)snprintf(s + n, cap - n, "}");
    }
    free(v);
    return s;
}

// Rank 0's progress: the logged step's line, or between logged steps on a terminal one short
// line rewritten in place; and the step's metrics.
static void log_step(train_run *x, int step, int logged, double loss, const double sums[2],
                     double lr, double norm, double now, double dt, const char *moe)
{
    const lb_config *c = x->c;
    const long tokens_step = (long)x->B * x->T * x->G;   // the global batch
    double tok_s = tokens_step / dt;
    int done = step - x->first + 1, left = c->train.steps - step;
    char eta[32], ran[32];
    fmt_duration(eta, sizeof eta, (now - x->t0) / done * left);
    fmt_duration(ran, sizeof ran, now - x->t0);
    if (logged) {
        tty_clear(&x->pending);
        printf("step %5d/%d | loss %.4f | lr %.2e | norm %.4f | %.0f tok/s | %.2f TFLOP/s | "
               "%.0f ms/step | mem %.0f MiB | %s in, ETA %s\n",
               step, c->train.steps, loss, lr, norm, tok_s,
               tok_s * lb_model_flops_per_token(&x->m->cfg, x->T) / 1e12, dt * 1e3,
               max_rss_mib(), ran, eta);
    } else if (x->tty) {
        char line[160];
        int w = snprintf(line, sizeof line, "step %d/%d | loss %.4f | %.0f tok/s | ETA %s",
                         step, c->train.steps, loss, tok_s, eta);
        if (w > x->tty - 1) line[x->tty > 1 ? x->tty - 1 : 0] = 0;
        printf("\r\033[K%s", line);
        fflush(stdout);
        x->pending = 1;
    }
    lb_metrics_printf(x->metrics,
                      "{\"step\": %d, \"loss\": %.9g, \"ce_loss\": %.9g, \"aux_loss\": "
                      "%.9g, \"lr\": %.9g, \"grad_norm\": %.9g, \"tokens\": %ld, "
                      "\"tokens_per_s\": %.1f, \"step_s\": %.6f, \"mem_mib\": %.0f%s}",
                      step, loss, sums[0], sums[1], lr, norm, (long)step * tokens_step, tok_s,
                      dt, max_rss_mib(), moe);
}

// Validation when due: the loss on every rank, logged by rank 0. Under [mlperf] on its
// schedule, over mlperf.eval_samples sequences, as an evaluation of the MLPerf log; returns
// whether it reached the target (the run stops).
static int train_validate(train_run *x, int step)
{
    const lb_config *c = x->c;
    lb_mlperf *p = &x->mlperf;
    int ml = c->mlperf.enabled;
    if (ml ? !lb_mlperf_due(p, step)
           : !x->val || c->train.val_every <= 0 ||
                 (step % c->train.val_every != 0 && step != c->train.steps))
        return 0;
    if (ml) lb_mlperf_eval_start(p, step);
    double vl = validate(x, ml ? c->mlperf.eval_samples / x->B : c->train.val_batches);
    if (x->run.root) {
        tty_clear(&x->pending);
        printf("step %5d/%d | val loss %.4f\n", step, c->train.steps, vl);
        lb_metrics_printf(x->metrics, "{\"step\": %d, \"val_loss\": %.9g}", step, vl);
    }
    return ml && lb_mlperf_eval_stop(p, step, c->train.steps, vl);
}

// SIGTERM and SIGINT (a scheduler's preemption, Ctrl-C) ask the run to stop at the next step
// boundary with a checkpoint; the handler resets itself, so a second signal ends the process
// as the default would (every save is atomic: the last finished checkpoint stays whole).
static volatile sig_atomic_t stop_signal;
static void on_stop_signal(int sig) { stop_signal = sig; }

static void stop_signals_catch(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop_signal;
    sa.sa_flags = SA_RESETHAND;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
}

// Whether any rank received one: every rank stops at the same step.
static int stop_requested(lb_comm *comm)
{
    double any = stop_signal != 0;
    if (comm->size > 1) any = lb_comm_allreduce_sum(comm, any);
    return any > 0.0;
}

// checkpoint.save_minutes: whether that long has passed since the last save (or the start) by
// rank 0's clock, the same answer on every rank (a save is collective).
static int save_time_due(train_run *x, double now)
{
    const double minutes = x->c->checkpoint.save_minutes;
    if (minutes <= 0.0) return 0;
    lb_comm *comm = x->run.world;
    double due = x->run.root && now - x->last_save >= minutes * 60.0;
    if (comm->size > 1) due = lb_comm_allreduce_sum(comm, due);
    return due > 0.0;
}

// One optimizer step: the micro-batches through the pipeline schedule, the loss over all
// ranks, the update, the log, validation and the checkpoint when due (and when an MLPerf
// evaluation reached the target, which ends the run: returns 1).
static int train_step(train_run *x, int step)
{
    const lb_config *c = x->c;
    lb_run *r = &x->run;
    lb_comm *comm = r->world;
    double ts = lb_now();
    // the step's line is logged: its MoE health too (every rank gathers it)
    const int logged = c->train.log_every > 0 &&
                       (step % c->train.log_every == 0 || step == c->train.steps);
    if (logged) lb_model_moe_stats_begin(x->m);
    lb_model_zero_grad(x->m);
    read_micro_batches(x);
    double sums[2] = {0.0, 0.0};   // cross-entropy, aux over this rank's micro-batches
    x->sums = sums;
    lb_pipeline_forward_backward(&x->stage, x->M);
    if (step == c->parallel.fail_step && comm->rank == c->parallel.fail_rank)
        fail_on_purpose(c->parallel.fail_mode, comm->rank, step);
    if (comm->size > 1) lb_comm_all_reduce(comm, sums, sums, 2, LB_F64);
    sums[0] /= x->G;   // the means over the global batch
    sums[1] /= x->G;
    double loss = sums[0] + c->model.router_aux_loss_coef * sums[1];
    if (!isfinite(loss))
        lb_die("step %d: loss is %f; stopping before the weights are harmed", step, loss);
    double lr;
    double norm = lb_optimizer_step(&r->opt, step, &lr);
    lb_model_after_step(x->m, comm);   // e.g. the sigmoid router's balancing (glm4_moe)
    r->be->sync(r->be);
    double now = lb_now();
    char *moe = logged ? moe_metrics(x) : NULL;
    if (r->root) log_step(x, step, logged, loss, sums, lr, norm, now, now - ts, moe ? moe : "");
    free(moe);
    int stop = train_validate(x, step);
    if (r->root) fflush(stdout);
    int sig = stop_requested(comm);
    if (lb_run_save_due(c, step, stop || sig ? step : c->train.steps) ||
        (c->checkpoint.save_every >= 0 && save_time_due(x, lb_now()))) {
        if (r->root) tty_clear(&x->pending);
        x->st.step = step;
        lb_loader_tell(x->train, &x->st.loader_shard, &x->st.loader_pos);   // the same everywhere
        lb_run_save(r, &x->st, x->ini);
        x->last_save = lb_now();
    }
    if (sig && r->root)
        printf("stopped by %s after step %d%s\n", stop_signal == SIGINT ? "SIGINT" : "SIGTERM",
               step, c->checkpoint.save_every < 0
                   ? " without a checkpoint (checkpoint.save_every = -1)"
                   : "; its checkpoint is saved: checkpoint.resume = auto continues the run");
    return stop || sig;
}

// Frees what was made, also of a run that stopped during its setup.
static void train_free(train_run *x)
{
    lb_metrics_close(x->metrics);
    lb_mllog_close(x->mlperf.log);
    for (int j = 0; x->in && j < x->M; j++) {
        free(x->in[j]);
        free(x->tg[j]);
    }
    free(x->in);
    free(x->tg);
    free(x->ini);
    lb_run_teardown(&x->run);
    lb_run_tokenizer_close(&x->tok);
    lb_loader_close(x->train);
    lb_loader_close(x->val);
}

int lb_cmd_train(const lb_config *c, lb_comm *comm)
{
    train_run *x = lb_calloc(1, sizeof *x);
    x->t_init = lb_mllog_now_ms();
    x->cfg = *c;
    if (c->checkpoint.init[0]) {   // the model to fine-tune is the checkpoint's
        char err[ERRLEN];
        if (lb_model_config_from_checkpoint(&x->cfg, c->checkpoint.init, err, sizeof err) != 0) {
            if (comm->rank == 0) fprintf(stderr, "lowbit train: %s\n", err);
            free(x);
            return 1;
        }
    }
    c = &x->cfg;
    if (train_layout(x, c, comm) != 0 || train_tokenizer(x) != 0 || train_open(x) != 0 ||
        train_load(x) != 0 || train_announce(x) != 0) {
        lb_run_abandon(&x->run);
        train_free(x);
        free(x);
        return 1;
    }
    train_alloc(x);
    stop_signals_catch();
    if (c->mlperf.enabled) lb_mlperf_run_start(&x->mlperf, x->first - 1);
    int step = x->first;
    for (; step <= c->train.steps; step++)
        if (train_step(x, step)) break;
    if (c->mlperf.enabled) lb_mlperf_run_stop(&x->mlperf, step <= c->train.steps ? step : step - 1);
    train_free(x);
    free(x);
    return 0;
}
