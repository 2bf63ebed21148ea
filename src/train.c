// train.c: `lowbit train`: micro-batches with gradient accumulation, global-norm clipping,
// AdamW with linear warm-up and cosine decay, validation, progress lines, JSON-lines metrics
// and atomic checkpoints that resume bit for bit.
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
#include "src/optim.h"
#include "src/util.h"

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

// Mean cross-entropy over the first val_batches batches of the validation shards.
static double validate(const lb_config *c, lb_model *m, lb_loader *val, int32_t *in, int32_t *tg)
{
    char err[ERRLEN];
    double sum = 0.0;
    long count = 0;
    lb_loader_reset(val);
    for (int i = 0; i < c->train.val_batches; i++) {
        if (lb_loader_next(val, in, tg, err, sizeof err) != 0) lb_die("%s", err);
        lb_model_forward(m, in, tg, c->train.micro_batch, c->train.seq_len);
        sum += (double)m->ce_loss * m->ntokens;
        count += m->ntokens;
    }
    return count ? sum / count : 0.0;
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

int lb_cmd_train(const lb_config *c, lb_comm *comm)
{
    char err[ERRLEN], ckdir[LB_PATH_MAX + 32], path[2 * LB_PATH_MAX + 64];
    if (comm->size > 1) {
        if (comm->rank == 0)
            fprintf(stderr, "lowbit train: %d ranks given, but this release trains on one rank "
                            "(tensor, pipeline, expert and data parallelism are not built yet)\n",
                    comm->size);
        return 1;
    }
    if (!c->data.train_files[0]) {
        fprintf(stderr, "lowbit train: data.train_files is empty: name the token shards\n");
        return 1;
    }
    const int B = c->train.micro_batch, T = c->train.seq_len;
    lb_loader *train = lb_loader_open(c->data.train_files, B, T, c->model.vocab_size, err, sizeof err);
    if (!train) {
        fprintf(stderr, "lowbit train: %s\n", err);
        return 1;
    }
    lb_loader *val = NULL;
    if (c->data.val_files[0]) {
        val = lb_loader_open(c->data.val_files, B, T, c->model.vocab_size, err, sizeof err);
        if (!val) {
            fprintf(stderr, "lowbit train: %s\n", err);
            lb_loader_close(train);
            return 1;
        }
    }
    lb_backend *be = lb_backend_open(c);
    if (!be) return 1;
    lb_model *m = lb_model_create(&c->model, be, err, sizeof err);
    if (!m) {
        fprintf(stderr, "lowbit train: %s\n", err);
        return 1;
    }
    if (lb_model_set_precision(m, &c->precision, c->run.seed, err, sizeof err) != 0) {
        fprintf(stderr, "lowbit train: %s\n", err);
        return 1;
    }
    lb_optim_config oc = {c->train.lr, c->train.min_lr, c->train.warmup_steps, c->train.steps,
                          c->train.beta1, c->train.beta2, c->train.adam_eps,
                          c->train.weight_decay, c->train.grad_clip};
    lb_optimizer opt;
    lb_optimizer_init(&opt, m, &oc);
    snprintf(ckdir, sizeof ckdir, "%s/checkpoints", c->run.out_dir);
    if (lb_mkdirs(ckdir, err, sizeof err) != 0) {
        fprintf(stderr, "lowbit train: %s\n", err);
        return 1;
    }

    // Resume or start fresh.
    lb_train_state st = {0};
    char resume[LB_PATH_MAX + 64] = "";
    if (strcmp(c->checkpoint.resume, "auto") == 0) lb_checkpoint_latest(ckdir, resume, sizeof resume);
    else snprintf(resume, sizeof resume, "%s", c->checkpoint.resume);
    if (resume[0]) {
        if (lb_checkpoint_load(resume, m, opt.adam_m, opt.adam_v, &st, err, sizeof err) != 0 ||
            lb_loader_seek(train, st.loader_shard, st.loader_pos, err, sizeof err) != 0) {
            fprintf(stderr, "lowbit train: %s\n", err);
            return 1;
        }
        printf("resumed from %s at step %" PRId64 "\n", resume, st.step);
    } else {
        lb_model_init_params(m, c->run.seed);
    }
    char *ini = lb_config_to_ini(c);
    printf("# resolved configuration\n%s\n", ini);
    printf("model %s: %.3fM parameters, %.3fM active matmul parameters per token, %s backend\n",
           m->cfg.arch, m->nparams / 1e6, lb_model_active_params(m) / 1e6, be->name);

    snprintf(path, sizeof path, "%s/%s", c->run.out_dir, c->train.metrics_file);
    FILE *metrics = fopen(path, resume[0] ? "a" : "w");
    if (!metrics) {
        fprintf(stderr, "lowbit train: %s: cannot open for writing\n", path);
        return 1;
    }

    int32_t *in = lb_malloc((size_t)B * T * sizeof(int32_t));
    int32_t *tg = lb_malloc((size_t)B * T * sizeof(int32_t));
    const double flops_tok = lb_model_flops_per_token(&m->cfg, T);
    const long tokens_step = (long)B * T * c->train.grad_accum;
    double t0 = lb_now();
    int first = (int)st.step + 1;
    for (int step = first; step <= c->train.steps; step++) {
        double ts = lb_now();
        lb_model_zero_grad(m);
        double loss = 0.0, ce = 0.0, aux = 0.0;
        for (int a = 0; a < c->train.grad_accum; a++) {
            if (lb_loader_next(train, in, tg, err, sizeof err) != 0) lb_die("%s", err);
            lb_model_forward(m, in, tg, B, T);
            lb_model_backward(m, 1.0f / c->train.grad_accum);
            loss += m->loss;
            ce += m->ce_loss;
            aux += m->aux_loss;
        }
        loss /= c->train.grad_accum;
        ce /= c->train.grad_accum;
        aux /= c->train.grad_accum;
        if (!isfinite(loss)) lb_die("step %d: loss is %f; stopping before the weights are harmed", step, loss);

        double lr;
        double norm = lb_optimizer_step(&opt, step, &lr);
        be->sync(be);
        double now = lb_now(), dt = now - ts;
        double tok_s = tokens_step / dt;
        int done = step - first + 1, left = c->train.steps - step;
        char eta[32];
        fmt_duration(eta, sizeof eta, (now - t0) / done * left);
        if (c->train.log_every > 0 && (step % c->train.log_every == 0 || step == c->train.steps))
            printf("step %5d/%d | loss %.4f | lr %.2e | norm %.4f | %.0f tok/s | %.2f TFLOP/s | "
                   "mem %.0f MiB | ETA %s\n",
                   step, c->train.steps, loss, lr, norm, tok_s, tok_s * flops_tok / 1e12,
                   max_rss_mib(), eta);
        fprintf(metrics,
                "{\"step\": %d, \"loss\": %.9g, \"ce_loss\": %.9g, \"aux_loss\": %.9g, "
                "\"lr\": %.9g, \"grad_norm\": %.9g, \"tokens\": %ld, \"tokens_per_s\": %.1f, "
                "\"step_s\": %.6f}\n",
                step, loss, ce, aux, lr, norm, (long)step * tokens_step, tok_s, dt);
        if (val && c->train.val_every > 0 &&
            (step % c->train.val_every == 0 || step == c->train.steps)) {
            double vl = validate(c, m, val, in, tg);
            printf("step %5d/%d | val loss %.4f\n", step, c->train.steps, vl);
            fprintf(metrics, "{\"step\": %d, \"val_loss\": %.9g}\n", step, vl);
        }
        fflush(stdout);
        fflush(metrics);
        if ((c->checkpoint.save_every > 0 && step % c->checkpoint.save_every == 0) ||
            step == c->train.steps) {
            st.step = step;
            lb_loader_tell(train, &st.loader_shard, &st.loader_pos);
            snprintf(path, sizeof path, "%s/step_%08d.safetensors", ckdir, step);
            if (lb_checkpoint_save(path, m, opt.adam_m, opt.adam_v, &st, ini, err, sizeof err) != 0)
                lb_die("%s", err);
            keep_last(ckdir, c->checkpoint.keep);
            printf("saved %s\n", path);
        }
    }
    fclose(metrics);
    free(in);
    free(tg);
    free(ini);
    lb_optimizer_free(&opt);
    lb_model_free(m);
    lb_loader_close(train);
    if (val) lb_loader_close(val);
    be->destroy(be);
    return 0;
}
