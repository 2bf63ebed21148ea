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
#include "src/checkpoint.h"
#include "src/commands.h"
#include "src/data.h"
#include "src/optim.h"
#include "src/run.h"
#include "src/metrics.h"
#include "src/util.h"
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

// The parallel pieces of one training run: the grid, the backend-memory communicators of its
// groups (src/run.h), the model piece, and the model as a pipeline stage.
typedef struct {
    lb_grid grid;
    lb_comm *world;
    lb_run_comms comms;
    lb_model *m;
    int B, T, G, M;                     // micro-batch, sequence, global and per-rank micro-batches
    lb_pipeline_stage stage;
    int32_t **in, **tg;                 // (M) the step's micro-batches of this rank
    double *sums;                       // the step's loss sums (add_losses)
} run_ctx;

// Mean cross-entropy over the first val_batches batches of the validation shards. Data-parallel
// rank r evaluates batches r, r + dp, ...; under expert parallelism every rank runs the same
// number of forwards (the dispatcher is collective), repeating its first batch uncounted where it
// has none. One rank of each model replica counts (tp rank 0 of the last stage); the sums of
// losses and tokens are added over all ranks.
static double validate(const lb_config *c, run_ctx *x, lb_loader *val, int32_t *in, int32_t *tg)
{
    char err[ERRLEN];
    lb_model *m = x->m;
    const lb_grid *g = &x->grid;
    double acc[2] = {0.0, 0.0};   // sum of token losses, tokens
    int V = c->train.val_batches, rounds = (V + g->dp - 1) / g->dp;
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
    if (x->world->size > 1) lb_comm_all_reduce(x->world, acc, acc, 2, LB_F64);
    return acc[1] > 0 ? acc[0] / acc[1] : 0.0;
}

lb_backend *lb_backend_open(const lb_config *c)
{
    char err[ERRLEN];
    lb_backend *be = strcmp(c->run.backend, "cuda") == 0
                         ? lb_backend_cuda_create(c->run.device, err, sizeof err)
                         : lb_backend_cpu_create(c->run.threads, err, sizeof err);
    if (!be) fprintf(stderr, "lowbit: %s\n", err);
    // LB_PROFILE=1: time every backend operation; the table goes to stderr at the end
    const char *prof = getenv("LB_PROFILE");
    if (be && prof && *prof && strcmp(prof, "0") != 0) be = lb_backend_profiled(be);
    return be;
}

// Layout checks that need the world size and the training keys; the same verdict on every rank.
static int check_data_parallel(const lb_config *c, const lb_grid *g, char *err, size_t errlen)
{
    const lb_parallel_config *pc = &c->parallel;
    if (c->train.grad_accum % g->dp != 0) {
        snprintf(err, errlen, "train.grad_accum (%d) is not divisible by the data-parallel size "
                 "dp = %d (%d ranks / (tp %d x pp %d)): each data-parallel rank runs "
                 "grad_accum / dp micro-batches of every step", c->train.grad_accum, g->dp,
                 g->world, g->tp, g->pp);
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
    return 0;
}

// A setup step that may fail on some ranks only (a file one node cannot read): every rank
// learns whether any failed, so they stop together instead of waiting in a collective. Rank 0
// prints its message; another rank prints its own when rank 0 did not fail.
int lb_any_failed(lb_comm *w, int failed, const char *who, const char *err)
{
    if (w->size == 1) {
        if (failed) fprintf(stderr, "%s: %s\n", who, err);
        return failed;
    }
    int root_failed = failed;
    lb_comm_bcast(w, &root_failed, sizeof root_failed, 0);
    int n = (int)lb_comm_allreduce_sum(w, failed ? 1.0 : 0.0);
    if (failed && w->rank == 0) fprintf(stderr, "%s: %s\n", who, err);
    else if (failed && !root_failed) fprintf(stderr, "%s: rank %d: %s\n", who, w->rank, err);
    return n > 0;
}

static int any_failed(lb_comm *w, int failed, const char *err)
{
    return lb_any_failed(w, failed, "lowbit train", err);
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
static void add_losses(const run_ctx *x, double sums[2])
{
    if (x->grid.tp_rank != 0) return;
    if (x->m->last_stage) sums[0] += x->m->ce_loss;
    sums[1] += x->m->aux_loss;
}

// The model piece as the pipeline schedule drives it (parallel/pipeline_schedule.h).
static void stage_use_slot(void *p, int slot)
{
    run_ctx *x = p;
    lb_model_use_slot(x->m, slot);
    lb_model_prepare(x->m, x->B, x->T);
}

static void stage_prepare(void *p)
{
    run_ctx *x = p;
    lb_model_prepare(x->m, x->B, x->T);
}

static void stage_forward(void *p, int j)
{
    run_ctx *x = p;
    lb_model_forward(x->m, x->in[j], x->tg[j], x->B, x->T);
    add_losses(x, x->sums);
}

static void stage_backward(void *p)
{
    run_ctx *x = p;
    lb_model_backward(x->m, 1.0f / x->G);   // the mean over the global batch
}

static float *stage_input(void *p) { return lb_model_stage_input(((run_ctx *)p)->m); }
static float *stage_output(void *p) { return lb_model_stage_output(((run_ctx *)p)->m); }
static float *stage_grad(void *p) { return lb_model_stage_grad(((run_ctx *)p)->m); }
static size_t stage_floats(void *p) { return lb_model_stage_floats(((run_ctx *)p)->m); }

static lb_pipeline_stage pipeline_stage(run_ctx *x)
{
    return (lb_pipeline_stage){x->comms.pp, x->m->be, x->grid.pp_rank, x->grid.pp,
                               x->m->first_stage, x->m->last_stage, x,
                               stage_use_slot, stage_prepare, stage_forward, stage_backward,
                               stage_input, stage_output, stage_grad, stage_floats};
}

int lb_cmd_train(const lb_config *c, lb_comm *comm)
{
    char err[ERRLEN], ckdir[LB_PATH_MAX + 32];
    const int root = comm->rank == 0;
    run_ctx x;
    memset(&x, 0, sizeof x);
    x.world = comm;
    lb_grid *grid = &x.grid;
    // The layout first: a bad one stops every rank before any work, with one message.
    if (lb_grid_layout(grid, &c->parallel, comm->size, comm->rank, err, sizeof err) != 0 ||
        lb_grid_check_built(&c->parallel, err, sizeof err) != 0 ||
        check_data_parallel(c, grid, err, sizeof err) != 0) {
        if (root) fprintf(stderr, "lowbit train: %s\n", err);
        return 1;
    }
    if (!c->data.train_files[0]) {
        if (root) fprintf(stderr, "lowbit train: data.train_files is empty: name the token shards\n");
        return 1;
    }
    comm->deterministic = c->parallel.deterministic;
    if (lb_grid_create(grid, &c->parallel, comm, err, sizeof err) != 0) lb_die("%s", err);
    const int B = c->train.micro_batch, T = c->train.seq_len, G = c->train.grad_accum;
    x.B = B;
    x.T = T;
    x.G = G;
    x.M = G / grid->dp;

    lb_loader *train = lb_loader_open(c->data.train_files, B, T, c->model.vocab_size, err, sizeof err);
    if (any_failed(comm, !train, err)) return 1;
    lb_loader *val = NULL;
    if (c->data.val_files[0]) {
        val = lb_loader_open(c->data.val_files, B, T, c->model.vocab_size, err, sizeof err);
        if (any_failed(comm, !val, err)) return 1;
    }
    const int cuda = strcmp(c->run.backend, "cuda") == 0;
    lb_backend *be = lb_run_backend_open(c, comm);   // one GPU per rank
    snprintf(err, sizeof err, "the %s backend did not open", c->run.backend);
    if (any_failed(comm, !be, err)) return 1;
    // Activations, gradients and parameters travel in the backend's memory.
    int bad = lb_run_comms_open(&x.comms, grid, be, cuda, err, sizeof err) != 0;
    if (any_failed(comm, bad, err)) return 1;
    lb_model_parallel par = lb_run_model_parallel(grid, &x.comms);
    lb_model *m = x.m = lb_model_create_parallel(&c->model, be, &par, err, sizeof err);
    if (any_failed(comm, !m, err)) return 1;
    if (any_failed(comm, lb_model_set_precision(m, &c->precision, c->run.seed, err, sizeof err) != 0 ||
                             lb_model_set_recompute(m, c->train.recompute, err, sizeof err) != 0,
                   err))
        return 1;
    lb_model_set_ce_chunk(m, c->train.ce_chunk);
    lb_optim_config oc = {c->train.lr, c->train.min_lr, c->train.warmup_steps, c->train.steps,
                          c->train.beta1, c->train.beta2, c->train.adam_eps,
                          c->train.weight_decay, c->train.grad_clip,
                          c->train.optimizer_offload, c->run.threads,
                          !strcmp(c->train.adam_moments, "bf16")};
    lb_optim_groups og = lb_run_optim_groups(grid, &x.comms, comm);
    lb_optimizer opt;
    lb_optimizer_init_groups(&opt, m, &oc, &og, c->parallel.zero);
    snprintf(ckdir, sizeof ckdir, "%s/checkpoints", c->run.out_dir);
    bad = root && lb_mkdirs(ckdir, err, sizeof err) != 0;
    if (any_failed(comm, bad, err)) return 1;

    // Resume or start fresh. Rank 0 picks the checkpoint and reads it; every rank takes its part.
    lb_train_state st = {0};
    char resume[LB_PATH_MAX + 64] = "";
    lb_run_resume_path(c, ckdir, comm, resume, sizeof resume);
    if (resume[0]) {
        bad = lb_checkpoint_load_parallel(resume, &opt, &st, comm, &c->parallel, err,
                                          sizeof err) != 0 ||
              lb_loader_seek(train, st.loader_shard, st.loader_pos, err, sizeof err) != 0;
        if (any_failed(comm, bad, err)) return 1;
        if (root) printf("resumed from %s at step %" PRId64 "\n", resume, st.step);
    } else {
        lb_model_init_params(m, c->run.seed);   // counter-based: the same on every layout
    }
    char *ini = lb_config_to_ini(c);
    char layout[256];
    lb_grid_describe(grid, layout, sizeof layout);
    bad = root && lb_run_config_write(c, ini, err, sizeof err) != 0;
    if (any_failed(comm, bad, err)) return 1;
    if (root) {
        printf("model %s: %.3fM parameters (%.3fM on rank 0), %.3fM active matmul parameters per "
               "token, %s backend\n", m->cfg.arch, m->gparams / 1e6, m->nparams / 1e6,
               lb_model_active_params(m) / 1e6, be->name);
        char how[200] = "one rank: no communication";
        if (comm->size > 1)
            snprintf(how, sizeof how, "%s; collectives over %s%s%s",
                     c->parallel.zero ? "ZeRO-1 distributed optimizer" : "all-reduced gradients",
                     x.comms.nnccl ? "nccl" : "mpi",
                     c->parallel.deterministic ? ", rank-order sums" : "",
                     grid->pp > 1 ? "; 1F1B pipeline" : "");
        printf("layout %s%s; %d micro-batch%s of %d x %d per rank and step; %s\n", layout,
               par.sp ? ", sequence parallel" : "", x.M, x.M == 1 ? "" : "es", B, T, how);
    }

    lb_metrics *metrics = NULL;
    if (root)
        metrics = lb_metrics_open(c->run.out_dir, c->train.metrics_file, "train",
                                  resume[0] ? (long)st.step : -1, err, sizeof err);
    if (any_failed(comm, root && !metrics, err)) return 1;

    // The step's micro-batches of this rank, read before the schedule runs.
    int32_t **in = lb_calloc(x.M, sizeof *in), **tg = lb_calloc(x.M, sizeof *tg);
    for (int j = 0; j < x.M; j++) {
        in[j] = lb_malloc((size_t)B * T * sizeof(int32_t));
        tg[j] = lb_malloc((size_t)B * T * sizeof(int32_t));
    }
    x.in = in;
    x.tg = tg;
    x.stage = pipeline_stage(&x);
    const double flops_tok = lb_model_flops_per_token(&m->cfg, T);
    const long tokens_step = (long)B * T * G;   // the global batch
    double t0 = lb_now();
    const int tty = root && c->train.log_every > 0 ? tty_columns() : 0;
    int pending = 0;   // an in-place line is on the terminal
    int first = (int)st.step + 1;
    for (int step = first; step <= c->train.steps; step++) {
        double ts = lb_now();
        lb_model_zero_grad(m);
        // Micro-batch j of the step's G consecutive batches belongs to data-parallel rank
        // j mod dp: the ranks together see exactly the batches one rank would, and every
        // loader ends the step at the same position.
        for (int j = 0, k = 0; j < G; j++) {
            if (j % grid->dp != grid->dp_rank) {
                lb_loader_skip(train, 1);
                continue;
            }
            if (lb_loader_next(train, in[k], tg[k], err, sizeof err) != 0) lb_die("%s", err);
            k++;
        }
        double sums[2] = {0.0, 0.0};   // cross-entropy, aux over this rank's micro-batches
        x.sums = sums;
        lb_pipeline_forward_backward(&x.stage, x.M);
        if (step == c->parallel.fail_step && comm->rank == c->parallel.fail_rank)
            fail_on_purpose(c->parallel.fail_mode, comm->rank, step);
        if (comm->size > 1) lb_comm_all_reduce(comm, sums, sums, 2, LB_F64);
        double ce = sums[0] / G, aux = sums[1] / G;
        double loss = ce + c->model.router_aux_loss_coef * aux;
        if (!isfinite(loss)) lb_die("step %d: loss is %f; stopping before the weights are harmed", step, loss);

        double lr;
        double norm = lb_optimizer_step(&opt, step, &lr);
        be->sync(be);
        double now = lb_now(), dt = now - ts;
        double tok_s = tokens_step / dt;
        int done = step - first + 1, left = c->train.steps - step;
        char eta[32];
        fmt_duration(eta, sizeof eta, (now - t0) / done * left);
        const int logged = c->train.log_every > 0 &&
                           (step % c->train.log_every == 0 || step == c->train.steps);
        if (root && logged) {
            tty_clear(&pending);
            printf("step %5d/%d | loss %.4f | lr %.2e | norm %.4f | %.0f tok/s | %.2f TFLOP/s | "
                   "mem %.0f MiB | ETA %s\n",
                   step, c->train.steps, loss, lr, norm, tok_s, tok_s * flops_tok / 1e12,
                   max_rss_mib(), eta);
        } else if (root && tty) {
            // between logged steps, on a terminal: one short line rewritten in place
            char line[160];
            int w = snprintf(line, sizeof line, "step %d/%d | loss %.4f | %.0f tok/s | ETA %s",
                             step, c->train.steps, loss, tok_s, eta);
            if (w > tty - 1) line[tty > 1 ? tty - 1 : 0] = 0;
            printf("\r\033[K%s", line);
            fflush(stdout);
            pending = 1;
        }
        if (root)
            lb_metrics_printf(metrics,
                              "{\"step\": %d, \"loss\": %.9g, \"ce_loss\": %.9g, \"aux_loss\": "
                              "%.9g, \"lr\": %.9g, \"grad_norm\": %.9g, \"tokens\": %ld, "
                              "\"tokens_per_s\": %.1f, \"step_s\": %.6f, \"mem_mib\": %.0f}",
                              step, loss, ce, aux, lr, norm, (long)step * tokens_step, tok_s, dt,
                              max_rss_mib());
        if (val && c->train.val_every > 0 &&
            (step % c->train.val_every == 0 || step == c->train.steps)) {
            double vl = validate(c, &x, val, in[0], tg[0]);
            if (root) {
                tty_clear(&pending);
                printf("step %5d/%d | val loss %.4f\n", step, c->train.steps, vl);
                lb_metrics_printf(metrics, "{\"step\": %d, \"val_loss\": %.9g}", step, vl);
            }
        }
        if (root) fflush(stdout);
        if (lb_run_save_due(c, step, c->train.steps)) {
            if (root) tty_clear(&pending);
            st.step = step;
            lb_loader_tell(train, &st.loader_shard, &st.loader_pos);   // the same on every rank
            lb_run_save(c, ckdir, &opt, &st, ini, comm);
        }
    }
    lb_metrics_close(metrics);
    for (int j = 0; j < x.M; j++) {
        free(in[j]);
        free(tg[j]);
    }
    free(in);
    free(tg);
    free(ini);
    lb_optimizer_free(&opt);
    lb_model_free(m);
    lb_run_comms_free(&x.comms);
    lb_grid_free(grid);
    lb_loader_close(train);
    if (val) lb_loader_close(val);
    be->destroy(be);
    return 0;
}
