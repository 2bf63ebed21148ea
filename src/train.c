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
#include <sys/resource.h>
#include <unistd.h>
#include "kernels/common.h"
#include "src/checkpoint.h"
#include "src/commands.h"
#include "src/data.h"
#include "src/optim.h"
#include "src/util.h"
#include "parallel/grid.h"

#define ERRLEN 1024

static void fmt_duration(char *buf, size_t len, double s)
{
    if (s < 0 || !isfinite(s)) s = 0;
    long t = (long)(s + 0.5);
    if (t >= 3600) snprintf(buf, len, "%ldh%02ldm", t / 3600, t / 60 % 60);
    else snprintf(buf, len, "%ldm%02lds", t / 60, t % 60);
}

static double max_rss_mib(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_maxrss / 1024.0;
}

// Mean cross-entropy over the first val_batches batches of the validation shards. Data-parallel
// rank r evaluates batches r, r + dp, ...; the sums of losses and tokens are added over dp.
static double validate(const lb_config *c, lb_model *m, lb_loader *val, int32_t *in, int32_t *tg,
                       lb_comm *dp)
{
    char err[ERRLEN];
    double acc[2] = {0.0, 0.0};   // sum of token losses, tokens
    lb_loader_reset(val);
    for (int i = 0; i < c->train.val_batches; i++) {
        if (i % dp->size != dp->rank) {
            lb_loader_skip(val, 1);
            continue;
        }
        if (lb_loader_next(val, in, tg, err, sizeof err) != 0) lb_die("%s", err);
        lb_model_forward(m, in, tg, c->train.micro_batch, c->train.seq_len);
        acc[0] += (double)m->ce_loss * m->ntokens;
        acc[1] += m->ntokens;
    }
    if (dp->size > 1) lb_comm_all_reduce(dp, acc, acc, 2, LB_F64);
    return acc[1] > 0 ? acc[0] / acc[1] : 0.0;
}

lb_backend *lb_backend_open(const lb_config *c)
{
    char err[ERRLEN];
    lb_backend *be = strcmp(c->run.backend, "cuda") == 0
                         ? lb_backend_cuda_create(c->run.device, err, sizeof err)
                         : lb_backend_cpu_create(c->run.threads, err, sizeof err);
    if (!be) fprintf(stderr, "lowbit: %s\n", err);
    return be;
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
static int any_failed(lb_comm *w, int failed, const char *err)
{
    if (w->size == 1) {
        if (failed) fprintf(stderr, "lowbit train: %s\n", err);
        return failed;
    }
    int root_failed = failed;
    lb_comm_bcast(w, &root_failed, sizeof root_failed, 0);
    int n = (int)lb_comm_allreduce_sum(w, failed ? 1.0 : 0.0);
    if (failed && w->rank == 0) fprintf(stderr, "lowbit train: %s\n", err);
    else if (failed && !root_failed) fprintf(stderr, "lowbit train: rank %d: %s\n", w->rank, err);
    return n > 0;
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

int lb_cmd_train(const lb_config *c, lb_comm *comm)
{
    char err[ERRLEN], ckdir[LB_PATH_MAX + 32], path[2 * LB_PATH_MAX + 64];
    const int root = comm->rank == 0;
    // The layout first: a bad one stops every rank before any work, with one message.
    lb_grid grid;
    if (lb_grid_layout(&grid, &c->parallel, comm->size, comm->rank, err, sizeof err) != 0 ||
        lb_grid_check_built(&c->parallel, err, sizeof err) != 0 ||
        check_data_parallel(c, &grid, err, sizeof err) != 0) {
        if (root) fprintf(stderr, "lowbit train: %s\n", err);
        return 1;
    }
    if (!c->data.train_files[0]) {
        if (root) fprintf(stderr, "lowbit train: data.train_files is empty: name the token shards\n");
        return 1;
    }
    comm->deterministic = c->parallel.deterministic;
    if (lb_grid_create(&grid, &c->parallel, comm, err, sizeof err) != 0) lb_die("%s", err);
    lb_comm *dpc = &grid.dp_comm;   // host messages of the data-parallel group
    const int B = c->train.micro_batch, T = c->train.seq_len, G = c->train.grad_accum;

    lb_loader *train = lb_loader_open(c->data.train_files, B, T, c->model.vocab_size, err, sizeof err);
    if (any_failed(comm, !train, err)) return 1;
    lb_loader *val = NULL;
    if (c->data.val_files[0]) {
        val = lb_loader_open(c->data.val_files, B, T, c->model.vocab_size, err, sizeof err);
        if (any_failed(comm, !val, err)) return 1;
    }
    // One GPU per rank: rank i of a node takes device run.device + i.
    lb_config local = *c;
    if (strcmp(c->run.backend, "cuda") == 0 && comm->size > 1)
        local.run.device += lb_comm_local_rank(comm);
    lb_backend *be = lb_backend_open(&local);
    snprintf(err, sizeof err, "the %s backend did not open", c->run.backend);
    if (any_failed(comm, !be, err)) return 1;
    lb_model *m = lb_model_create(&c->model, be, err, sizeof err);
    if (any_failed(comm, !m, err)) return 1;
    if (any_failed(comm, lb_model_set_precision(m, &c->precision, c->run.seed, err, sizeof err) != 0,
                   err))
        return 1;
    // Gradients and parameters travel in the backend's memory: MPI for the CPU, NCCL for CUDA.
    lb_comm nccl = {0};
    lb_comm *dpg = dpc;
    if (strcmp(c->run.backend, "cuda") == 0 && grid.dp > 1) {
        int bad = lb_comm_nccl_create(&nccl, dpc, be, NULL, err, sizeof err) != 0;
        if (any_failed(comm, bad, err)) return 1;
        dpg = &nccl;
    }
    lb_optim_config oc = {c->train.lr, c->train.min_lr, c->train.warmup_steps, c->train.steps,
                          c->train.beta1, c->train.beta2, c->train.adam_eps,
                          c->train.weight_decay, c->train.grad_clip};
    lb_optimizer opt;
    lb_optimizer_init_dp(&opt, m, &oc, dpg, c->parallel.zero);
    snprintf(ckdir, sizeof ckdir, "%s/checkpoints", c->run.out_dir);
    int bad = root && lb_mkdirs(ckdir, err, sizeof err) != 0;
    if (any_failed(comm, bad, err)) return 1;

    // Resume or start fresh. Rank 0 picks the checkpoint and reads it; every rank takes its part.
    lb_train_state st = {0};
    char resume[LB_PATH_MAX + 64] = "";
    if (strcmp(c->checkpoint.resume, "auto") == 0) {
        if (root) lb_checkpoint_latest(ckdir, resume, sizeof resume);
        lb_comm_bcast(comm, resume, sizeof resume, 0);
    } else {
        snprintf(resume, sizeof resume, "%s", c->checkpoint.resume);
    }
    if (resume[0]) {
        bad = lb_checkpoint_load_dp(resume, &opt, &st, comm, err, sizeof err) != 0 ||
              lb_loader_seek(train, st.loader_shard, st.loader_pos, err, sizeof err) != 0;
        if (any_failed(comm, bad, err)) return 1;
        if (root) printf("resumed from %s at step %" PRId64 "\n", resume, st.step);
    } else {
        lb_model_init_params(m, c->run.seed);   // counter-based: the same on every rank
    }
    char *ini = lb_config_to_ini(c);
    char layout[256];
    lb_grid_describe(&grid, layout, sizeof layout);
    if (root) {
        printf("# resolved configuration\n%s\n", ini);
        printf("model %s: %.3fM parameters, %.3fM active matmul parameters per token, %s backend\n",
               m->cfg.arch, m->nparams / 1e6, lb_model_active_params(m) / 1e6, be->name);
        char how[128] = "one rank: no gradient communication";
        if (grid.dp > 1)
            snprintf(how, sizeof how, "%s over %s%s",
                     c->parallel.zero ? "ZeRO-1 distributed optimizer" : "all-reduced gradients",
                     dpg->ops->name, c->parallel.deterministic ? ", rank-order sums" : "");
        printf("layout %s; %d micro-batch%s of %d x %d per rank and step; %s\n", layout,
               G / grid.dp, G / grid.dp == 1 ? "" : "es", B, T, how);
    }

    FILE *metrics = NULL;
    snprintf(path, sizeof path, "%s/%s", c->run.out_dir, c->train.metrics_file);
    if (root) metrics = fopen(path, resume[0] ? "a" : "w");
    snprintf(err, sizeof err, "%.900s: cannot open for writing", path);
    if (any_failed(comm, root && !metrics, err)) return 1;

    int32_t *in = lb_malloc((size_t)B * T * sizeof(int32_t));
    int32_t *tg = lb_malloc((size_t)B * T * sizeof(int32_t));
    const double flops_tok = lb_model_flops_per_token(&m->cfg, T);
    const long tokens_step = (long)B * T * G;   // the global batch
    double t0 = lb_now();
    int first = (int)st.step + 1;
    for (int step = first; step <= c->train.steps; step++) {
        double ts = lb_now();
        lb_model_zero_grad(m);
        // Micro-batch j of the step's G consecutive batches belongs to data-parallel rank
        // j mod dp: the ranks together see exactly the batches one rank would, and every
        // loader ends the step at the same position.
        double sums[3] = {0.0, 0.0, 0.0};   // loss, ce, aux over this rank's micro-batches
        for (int j = 0; j < G; j++) {
            if (j % grid.dp != grid.dp_rank) {
                lb_loader_skip(train, 1);
                continue;
            }
            if (lb_loader_next(train, in, tg, err, sizeof err) != 0) lb_die("%s", err);
            lb_model_forward(m, in, tg, B, T);
            lb_model_backward(m, 1.0f / G);   // the mean over the global batch
            sums[0] += m->loss;
            sums[1] += m->ce_loss;
            sums[2] += m->aux_loss;
        }
        if (step == c->parallel.fail_step && comm->rank == c->parallel.fail_rank)
            fail_on_purpose(c->parallel.fail_mode, comm->rank, step);
        if (grid.dp > 1) lb_comm_all_reduce(dpc, sums, sums, 3, LB_F64);
        double loss = sums[0] / G, ce = sums[1] / G, aux = sums[2] / G;
        if (!isfinite(loss)) lb_die("step %d: loss is %f; stopping before the weights are harmed", step, loss);

        double lr;
        double norm = lb_optimizer_step(&opt, step, &lr);
        be->sync(be);
        double now = lb_now(), dt = now - ts;
        double tok_s = tokens_step / dt;
        int done = step - first + 1, left = c->train.steps - step;
        char eta[32];
        fmt_duration(eta, sizeof eta, (now - t0) / done * left);
        if (root && c->train.log_every > 0 &&
            (step % c->train.log_every == 0 || step == c->train.steps))
            printf("step %5d/%d | loss %.4f | lr %.2e | norm %.4f | %.0f tok/s | %.2f TFLOP/s | "
                   "mem %.0f MiB | ETA %s\n",
                   step, c->train.steps, loss, lr, norm, tok_s, tok_s * flops_tok / 1e12,
                   max_rss_mib(), eta);
        if (root)
            fprintf(metrics,
                    "{\"step\": %d, \"loss\": %.9g, \"ce_loss\": %.9g, \"aux_loss\": %.9g, "
                    "\"lr\": %.9g, \"grad_norm\": %.9g, \"tokens\": %ld, \"tokens_per_s\": %.1f, "
                    "\"step_s\": %.6f}\n",
                    step, loss, ce, aux, lr, norm, (long)step * tokens_step, tok_s, dt);
        if (val && c->train.val_every > 0 &&
            (step % c->train.val_every == 0 || step == c->train.steps)) {
            double vl = validate(c, m, val, in, tg, dpc);
            if (root) {
                printf("step %5d/%d | val loss %.4f\n", step, c->train.steps, vl);
                fprintf(metrics, "{\"step\": %d, \"val_loss\": %.9g}\n", step, vl);
            }
        }
        if (root) {
            fflush(stdout);
            fflush(metrics);
        }
        if ((c->checkpoint.save_every > 0 && step % c->checkpoint.save_every == 0) ||
            step == c->train.steps) {
            st.step = step;
            lb_loader_tell(train, &st.loader_shard, &st.loader_pos);   // the same on every rank
            snprintf(path, sizeof path, "%s/step_%08d.safetensors", ckdir, step);
            if (lb_checkpoint_save_dp(path, &opt, &st, ini, comm, err, sizeof err) != 0)
                lb_die("%s", err);
            if (root) {
                keep_last(ckdir, c->checkpoint.keep);
                printf("saved %s\n", path);
            }
        }
    }
    if (metrics) fclose(metrics);
    free(in);
    free(tg);
    free(ini);
    lb_optimizer_free(&opt);
    lb_model_free(m);
    if (dpg == &nccl) lb_comm_free(&nccl);
    lb_grid_free(&grid);
    lb_loader_close(train);
    if (val) lb_loader_close(val);
    be->destroy(be);
    return 0;
}
