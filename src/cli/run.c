// run.c: one run's setup, shared by the commands (src/cli/run.h).
#include "lb_autoconf.h"
#include "lb_commit.h"
#include "src/cli/run.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "kernels/common.h"
#include "src/bench/info.h"
#include "src/io/files.h"
#include "src/io/checkpoint.h"

#define ERRLEN 1024

int lb_run_failed(const lb_run *r, int failed, const char *err)
{
    lb_comm *w = r->world;
    failed = failed != 0;
    if (w->size == 1) {
        if (failed) fprintf(stderr, "%s: %s\n", r->who, err);
        return failed;
    }
    // Every rank learns which failed; the first of them sends its message to rank 0, which
    // prints it: one line however many ranks failed (each shard checked by another rank).
    int *all = lb_malloc(sizeof(int) * w->size);
    lb_comm_host_all_gather(w, &failed, all, sizeof(int));
    int first = -1;
    for (int i = 0; i < w->size && first < 0; i++)
        if (all[i]) first = i;
    free(all);
    if (first < 0) return 0;
    char msg[ERRLEN] = "";
    if (w->rank == first) snprintf(msg, sizeof msg, "%s", err);
    lb_comm_bcast(w, msg, sizeof msg, first);
    if (w->rank == 0 && first == 0) fprintf(stderr, "%s: %s\n", r->who, msg);
    else if (w->rank == 0) fprintf(stderr, "%s: rank %d: %s\n", r->who, first, msg);
    fflush(stderr);
    return 1;
}

int lb_run_check_shards(lb_run *r, const lb_loader *l, const char *key)
{
    char err[ERRLEN] = "";
    lb_comm *w = r->world;
    int n = lb_loader_nshards(l);
    int64_t tokens = lb_loader_tokens(l);
    // A progress line where the check takes a while: many shards, or over 2^28 tokens.
    int large = n >= 16 || tokens >= ((int64_t)1 << 28);
    double t0 = lb_now(), last = t0;
    if (r->root && large) {
        char count[32];
        if (tokens < 1000000) snprintf(count, sizeof count, "%lld", (long long)tokens);
        else snprintf(count, sizeof count, "%.1fM", tokens / 1e6);
        printf("checking %s: %d shards, %s tokens, over %d rank%s\n", key, n, count, w->size,
               w->size == 1 ? "" : "s");
        fflush(stdout);
    }
    int bad = 0, mine = (n - w->rank + w->size - 1) / w->size, done = 0;
    for (int s = w->rank; s < n && !bad; s += w->size) {
        bad = lb_loader_check_shard(l, s, err, sizeof err) != 0;
        done++;
        if (r->root && large && lb_now() - last >= 5.0 && done < mine) {
            last = lb_now();
            printf("checking %s: rank 0 has checked %d of its %d shards\n", key, done, mine);
            fflush(stdout);
        }
    }
    if (lb_run_failed(r, bad, err)) return 1;
    if (r->root && large) printf("checked %s in %.1f s\n", key, lb_now() - t0);
    return 0;
}

// Tensor-parallel groups (and expert-tensor-parallel ones) exchange activations in every layer,
// so across nodes their all-reduces cross the network: warn (rank 0, once) where the launch put
// one across nodes. Megatron's rule: tp inside a node; the grid keeps tp ranks consecutive, so
// a launch that fills each node with consecutive ranks (mpirun's default --map-by slot, the
// nodes' slots a multiple of tp) keeps them there (doc/parallel.md, Beyond one host).
static void warn_split_nodes(lb_run *r)
{
    const int node = lb_comm_node(r->world);
    const int spans = lb_comm_spans_nodes(&r->grid.tp_comm, node) |
                      lb_comm_spans_nodes(&r->grid.etp_comm, node);
    if (lb_comm_allreduce_sum(r->world, spans) != 0.0 && r->root)
        fprintf(stderr,
                "%s: warning: a tensor-parallel group (parallel.tp = %d, etp = %d) spans nodes: "
                "its all-reduces cross the network every layer; give each node a multiple of "
                "tp consecutive ranks (doc/parallel.md, Beyond one host)\n",
                r->who, r->grid.tp, r->grid.etp);
}

int lb_run_layout(lb_run *r, const lb_config *c, lb_comm *world, const char *who,
                  lb_run_check check)
{
    char err[ERRLEN];
    memset(r, 0, sizeof *r);
    r->c = c;
    r->world = world;
    r->who = who;
    r->root = world->rank == 0;
    if (lb_grid_layout(&r->grid, &c->parallel, world->size, world->rank, err, sizeof err) != 0 ||
        lb_grid_check_built(&c->parallel, err, sizeof err) != 0 ||
        (check && check(c, &r->grid, err, sizeof err) != 0)) {
        if (r->root) fprintf(stderr, "%s: %s\n", who, err);
        return 1;
    }
    world->deterministic = c->parallel.deterministic;
    if (lb_grid_create(&r->grid, &c->parallel, world, err, sizeof err) != 0) lb_die("%s", err);
    warn_split_nodes(r);
    return 0;
}

// The grid's groups over the backend's memory, opened in a fixed order (tp, ep, pp, dp, edp):
// creating an NCCL communicator is collective, so every rank creates its groups in that order,
// going on after a failure so that none waits in another's creation (a failed group keeps its
// MPI one). Returns 0, or -1 with the last message.
static int comms_open(lb_run_comms *x, lb_grid *g, lb_backend *be, int cuda, char *err,
                      size_t errlen)
{
    lb_comm *mpi[5] = {&g->tp_comm, &g->ep_comm, &g->pp_comm, &g->dp_comm, &g->edp_comm};
    lb_comm **out[5] = {&x->tp, &x->ep, &x->pp, &x->dp, &x->edp};
    int bad = 0;
    x->nnccl = 0;
    for (int i = 0; i < 5; i++) {
        *out[i] = mpi[i];
        if (!cuda || mpi[i]->size == 1) continue;
        if (lb_comm_nccl_create(&x->nccl[x->nnccl], mpi[i], be, NULL, err, errlen) != 0) {
            bad = 1;
            continue;
        }
        *out[i] = &x->nccl[x->nnccl++];
    }
    return bad ? -1 : 0;
}

static void comms_free(lb_run_comms *x)
{
    for (int i = 0; i < x->nnccl; i++) lb_comm_free(&x->nccl[i]);
    x->nnccl = 0;
}

// Training: whether this rank's step fits the backend's memory, by `lowbit info`'s estimate,
// checked before the model is built, so that a configuration too large stops before any work
// with the sizes and the settings that lower them, not inside an allocation. CUDA: against
// the device's free memory; the CPU: against the host's physical memory (its free pages leave
// out the page cache, which would refuse runs that fit).
static int fits(lb_run *r, lb_backend *be, char *err, size_t errlen)
{
    lb_rank_memory mem;
    if (lb_info_rank_memory(r->c, &r->grid, &mem, err, errlen) != 0) return -1;
    size_t need = lb_info_rank_total(&mem), have;
    if (!strcmp(be->name, "cuda")) {
        have = be->mem_free(be);
    } else {
        long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGESIZE);
        have = pages > 0 && size > 0 ? (size_t)pages * (size_t)size : 0;
    }
    if (!have || need <= have) return 0;
    const double G = 1024.0 * 1024.0 * 1024.0;
    snprintf(err, errlen, "a training step needs about %.2f GiB on rank %d (parameters and "
             "gradients %.2f, optimizer %.2f, weight caches %.2f, activations %.2f, the "
             "backend's own %.2f: lowbit info) and the %s backend has %.2f GiB%s: lower "
             "train.micro_batch or train.seq_len, set train.recompute = selective or full, "
             "train.adam_moments = bf16 or train.optimizer_offload, or spread the model over "
             "more ranks (parallel.tp, parallel.pp, parallel.ep)", need / G, r->grid.rank,
             2 * mem.weights / G, mem.opt / G, mem.caches / G, mem.acts / G, mem.backend / G,
             be->name, have / G, strcmp(be->name, "cuda") ? " of physical memory" : " free");
    return -1;
}

int lb_run_setup(lb_run *r, int sampling)
{
    char err[ERRLEN];
    const lb_config *c = r->c;
    lb_backend *be = r->be = lb_run_backend_open(c, r->world);   // one GPU per rank
    if (be && sampling) be->deterministic = c->sample.deterministic;
    snprintf(err, sizeof err, "the %.32s backend did not open", c->run.backend);
    if (lb_run_failed(r, !be, err)) return 1;
    if (lb_run_failed(r, !sampling && fits(r, be, err, sizeof err) != 0, err)) return 1;
    // Activations, gradients and parameters travel in the backend's memory.
    int bad = comms_open(&r->comms, &r->grid, be, !strcmp(c->run.backend, "cuda"), err,
                         sizeof err) != 0;
    if (lb_run_failed(r, bad, err)) return 1;
    r->par = lb_model_parallel_of(&r->grid, r->comms.tp, r->comms.ep);
    r->m = lb_run_model(c, be, &r->par, sampling, err, sizeof err);
    if (lb_run_failed(r, !r->m, err)) return 1;
    // A training step's activations now, before run.out_dir and its files exist: a micro-batch
    // that does not fit stops in its allocation (which names it) with nothing written; at the
    // first step it left config.ini, metrics and an empty checkpoints directory (2026-12-07).
    if (!sampling) lb_model_prepare(r->m, c->train.micro_batch, c->train.seq_len);
    return 0;
}

void lb_run_optimizer(lb_run *r, int total_steps)
{
    lb_optim_config oc = lb_run_optim_config(r->c, total_steps);
    // the dense region over dp, the experts over edp, partial sums over tp, the norm over all
    lb_optim_groups og = {r->comms.dp, r->comms.edp, r->grid.tp > 1 ? r->comms.tp : NULL,
                          r->world};
    lb_optimizer_init_groups(&r->opt, r->m, &oc, &og, r->c->parallel.zero);
    r->has_opt = 1;
}

// The temporaries of killed saves in dir (lb_atomic_sweep).
static void sweep_temps(const char *dir)
{
    char pattern[1024];
    snprintf(pattern, sizeof pattern, "%s/step_*.safetensors.tmp.*", dir);
    lb_atomic_sweep(pattern);
}

// The files of a run c's run.out_dir holds (0: none): its config.ini, metrics, event files,
// MLPerf log and finished checkpoints; with clear, removed. Temporaries of killed writes do
// not count (they are swept).
static int run_files(const lb_config *c, int clear)
{
    const char *pats[] = {"config.ini", c->train.metrics_file, "events.out.tfevents.*",
                          c->mlperf.log_file, "checkpoints/step_*.safetensors"};
    int n = 0;
    for (size_t p = 0; p < sizeof pats / sizeof pats[0]; p++) {
        char pattern[2 * LB_PATH_MAX + 64], **list;
        if (!pats[p][0]) continue;
        snprintf(pattern, sizeof pattern, "%s/%s", c->run.out_dir, pats[p]);
        int k = lb_glob(pattern, &list);
        for (int i = 0; i < k; i++) {
            if (strstr(list[i], ".tmp.")) continue;
            n++;
            if (clear) unlink(list[i]);
        }
        lb_glob_free(list, k);
    }
    return n;
}

int lb_run_checkpoint_dir(lb_run *r)
{
    char err[ERRLEN];
    const lb_config *c = r->c;
    // A run directory is one run's: a new run into one that holds a run would replace its
    // metrics beside its old checkpoints, which resume = auto would then take up.
    int held = r->root && !c->checkpoint.resume[0] ? run_files(c, 0) : 0;
    if (held && c->run.overwrite) {
        run_files(c, 1);
        printf("run.overwrite: cleared %s (%d file%s of an earlier run)\n", c->run.out_dir, held,
               held == 1 ? "" : "s");
        held = 0;
    }
    snprintf(err, sizeof err, "run.out_dir %.900s holds a run already (%d of its files: "
             "config.ini, metrics, checkpoints): set checkpoint.resume = auto to continue it, "
             "run.overwrite = true to start over (which removes them), or another run.out_dir",
             c->run.out_dir, held);
    if (lb_run_failed(r, held > 0, err)) return 1;
    snprintf(r->ckdir, sizeof r->ckdir, "%.*s/checkpoints", LB_PATH_MAX, r->c->run.out_dir);
    struct stat st;
    r->outdir_made = r->root && stat(r->c->run.out_dir, &st) != 0;
    r->ckdir_made = r->root && stat(r->ckdir, &st) != 0;   // made here: early, so that a
    // directory that cannot be made stops the run before any work
    if (r->root && !r->ckdir_made) sweep_temps(r->ckdir);   // before a resume reads it
    return lb_run_failed(r, r->root && lb_mkdirs(r->ckdir, err, sizeof err) != 0, err);
}

void lb_run_abandon(lb_run *r)
{
    if (r->ckdir_made) rmdir(r->ckdir);   // fails, harmlessly, unless it is empty
    if (r->outdir_made) rmdir(r->c->run.out_dir);   // likewise: a refused run leaves no trace
    r->ckdir_made = r->outdir_made = 0;
}

void lb_run_teardown(lb_run *r)
{
    if (r->has_opt) lb_optimizer_free(&r->opt);
    r->has_opt = 0;
    lb_model_free(r->m);
    r->m = NULL;
    comms_free(&r->comms);
    lb_grid_free(&r->grid);
    if (r->be) r->be->destroy(r->be);
    r->be = NULL;
}

lb_backend *lb_run_backend_open(const lb_config *c, lb_comm *world)
{
    char err[ERRLEN];
    int device = c->run.device;
    if (!strcmp(c->run.backend, "cuda") && world && world->size > 1)
        device += lb_comm_local_rank(world);
    lb_backend *be = strcmp(c->run.backend, "cuda") == 0
                         ? lb_backend_cuda_create(device, err, sizeof err)
                         : lb_backend_cpu_create(c->run.threads, err, sizeof err);
    if (!be) fprintf(stderr, "lowbit: %s\n", err);
    const char *prof = getenv("LB_PROFILE");
    if (be && prof && *prof && strcmp(prof, "0") != 0) be = lb_backend_profiled(be);
    return be;
}

lb_model *lb_run_model(const lb_config *c, lb_backend *be, const lb_model_parallel *par,
                       int sampling, char *err, size_t errlen)
{
    lb_model *m = lb_model_create_parallel(&c->model, be, par, err, errlen);
    const lb_precision_spec ps = lb_config_precision(c);
    if (m && (lb_model_set_precision(m, &ps, c->run.seed, err, errlen) != 0 ||
              (sampling && lb_model_set_kv_cache(m, lb_config_kv_cache(c), err, errlen) != 0))) {
        lb_model_free(m);
        return NULL;
    }
    if (m) lb_model_set_recompute(m, lb_config_recompute(c));
    if (m && !sampling) lb_model_set_ce_chunk(m, c->train.ce_chunk);
    return m;
}

lb_optim_config lb_run_optim_config(const lb_config *c, int total_steps)
{
    return (lb_optim_config){c->train.lr, c->train.min_lr, c->train.warmup_steps, total_steps,
                             c->train.beta1, c->train.beta2, c->train.adam_eps,
                             c->train.weight_decay, c->train.grad_clip,
                             c->train.optimizer_offload, c->run.threads,
                             !strcmp(c->train.adam_moments, "bf16"), 0};
}

void lb_run_resume_path(const lb_run *r, char *out, size_t outlen)
{
    out[0] = '\0';
    if (strcmp(r->c->checkpoint.resume, "auto") == 0) {
        if (r->root) lb_checkpoint_latest(r->ckdir, out, outlen);
        lb_comm_bcast(r->world, out, outlen, 0);
    } else {
        snprintf(out, outlen, "%.*s", LB_PATH_MAX, r->c->checkpoint.resume);
    }
}

char *lb_run_ini(const lb_run *r)
{
    const lb_config *c = r->c;
    char *ini = lb_config_to_ini(c);
    const int world = r->world->size;
    size_t n = strlen(ini) + strlen(c->command) + 512;
    char *out = lb_malloc(n);
    // provenance as comments (the parser skips them): what made the run, and how
    snprintf(out, n, "# lowbit %s (commit %s)\n# command: %s\n# %d rank%s, run.backend %s (%s)\n%s",
             PACKAGE_VERSION, LB_GIT_COMMIT, c->command[0] ? c->command : "(none)", world,
             world == 1 ? "" : "s", c->run.backend, r->be && r->be->device[0] ? r->be->device : "-",
             ini);
    free(ini);
    return out;
}

int lb_run_config_write(const lb_config *c, const char *ini, char *err, size_t errlen)
{
    char path[LB_PATH_MAX + 16], pattern[LB_PATH_MAX + 32];
    snprintf(path, sizeof path, "%s/config.ini", c->run.out_dir);
    snprintf(pattern, sizeof pattern, "%s.tmp.*", path);
    lb_atomic_sweep(pattern);   // a killed run's
    lb_atomic_file a;
    if (lb_atomic_open(&a, path, err, errlen) != 0) return -1;
    fputs(ini, a.f);
    if (lb_atomic_commit(&a, err, errlen) != 0) return -1;
    if (c->run.verbose) printf("# resolved configuration\n%s\n", ini);
    else printf("configuration: %s (every key, resolved; -v prints it here)\n", path);
    return 0;
}

int lb_run_save_due(const lb_config *c, int step, int last)
{
    int every = c->checkpoint.save_every;
    return (every > 0 && step % every == 0) || (step == last && every >= 0);
}

// Removes all but the newest `keep` checkpoints of dir (their names sort by step), and the
// temporaries of killed saves.
static void keep_last(const char *dir, int keep)
{
    sweep_temps(dir);
    char pattern[1024];
    char **list;
    snprintf(pattern, sizeof pattern, "%s/step_*.safetensors", dir);
    int n = lb_glob(pattern, &list);
    for (int i = 0; i < n - keep; i++) unlink(list[i]);
    lb_glob_free(list, n);
}

void lb_run_save(lb_run *r, const lb_train_state *st, const char *ini)
{
    char path[2 * LB_PATH_MAX + 64], err[2048];
    snprintf(path, sizeof path, "%s/step_%08d.safetensors", r->ckdir, (int)st->step);
    if (lb_optimizer_save(path, &r->opt, st, ini, r->tokenizer_json, r->world,
                                    &r->c->parallel, err, sizeof err) != 0)
        lb_die("%s", err);
    if (r->root) {
        keep_last(r->ckdir, r->c->checkpoint.keep);
        printf("saved %s\n", path);
    }
}

char *lb_read_everywhere(lb_comm *comm, const char *path, int dash_stdin, char *err,
                         size_t errlen)
{
    char *text = NULL;
    long long len = -1;
    if (comm->rank == 0) {
        size_t n;
        int in = dash_stdin && !strcmp(path, "-");
        text = in ? lb_read_stdin(&n, err, errlen) : lb_read_file(path, &n, err, errlen);
        if (text && lb_text_check(text, n, in ? "stdin" : path, err, errlen) != 0) {
            free(text);
            text = NULL;
        }
        len = text ? (long long)n : -1;
    }
    lb_comm_bcast(comm, &len, sizeof len, 0);
    if (len < 0) return NULL;
    if (comm->rank != 0) text = lb_malloc((size_t)len + 1);
    lb_comm_bcast(comm, text, (size_t)len + 1, 0);
    return text;
}

int lb_run_tokenizer_open(lb_run_tokenizer *t, const lb_config *c, const char *checkpoint,
                          char *err, size_t errlen)
{
    memset(t, 0, sizeof *t);
    const char *path = c->data.tokenizer;
    if (path[0]) {
        snprintf(t->name, sizeof t->name, "%s", path);
        t->json = lb_tokenizer_read(path, err, errlen);
    } else if (checkpoint && checkpoint[0]) {
        snprintf(t->name, sizeof t->name, "the tokenizer stored in %s", checkpoint);
        if (lb_checkpoint_tokenizer(checkpoint, &t->json, err, errlen) != 0) goto fail;
    }
    if (!t->json) return path[0] ? -1 : 0;   // no file, or a checkpoint of a byte model
    if (!(t->tk = lb_tokenizer_parse(t->json, t->name, err, errlen))) goto fail;
    if (lb_tokenizer_vocab_size(t->tk) > c->model.vocab_size) {
        snprintf(err, errlen, "%s has %d tokens, more than the model's vocabulary (%d)", t->name,
                 lb_tokenizer_vocab_size(t->tk), c->model.vocab_size);
        goto fail;
    }
    return 0;
fail:
    lb_run_tokenizer_close(t);
    return -1;
}

void lb_run_tokenizer_close(lb_run_tokenizer *t)
{
    lb_tokenizer_free(t->tk);
    free(t->json);
    memset(t, 0, sizeof *t);
}

int lb_run_stop_tokens(lb_config *c, const lb_run_tokenizer *t, char *err, size_t errlen)
{
    if (lb_config_is_set(c, "sample", "stop_tokens") || !t->tk) return 0;
    int eot = lb_tokenizer_eot(t->tk);
    if (eot < 0) {
        snprintf(err, errlen, "%s has no end-of-text token (<|endoftext|>, <|end_of_text|>, "
                 "</s> or <eos>, marked special): set sample.stop_tokens", t->name);
        return -1;
    }
    memset(c->sample.stop_tokens, 0, sizeof c->sample.stop_tokens);
    snprintf(c->sample.stop_tokens, sizeof c->sample.stop_tokens, "%d", eot);
    return 0;
}

int lb_run_checkpoint_config(const char *path, lb_config *out, char *err, size_t errlen)
{
    char *ini = lb_checkpoint_config(path, err, errlen);
    if (!ini) return -1;
    lb_config_defaults(out);
    char perr[1024];
    int rc = lb_config_parse(out, ini, path, perr, sizeof perr);
    free(ini);
    if (rc != 0) {
        snprintf(err, errlen, "%s: its stored configuration does not parse: %s", path, perr);
        return -1;
    }
    return 0;
}

int lb_run_same_model(const lb_config *c, const char *path, char *err, size_t errlen)
{
    lb_config ck;
    if (lb_run_checkpoint_config(path, &ck, err, errlen) != 0) return -1;
    for (int i = 0; i < lb_nparams; i++) {
        const lb_param *p = &lb_params[i];
        if (strcmp(p->section, "model")) continue;
        if (!memcmp((const char *)c + p->offset, (const char *)&ck + p->offset, p->size))
            continue;
        char mine[256], theirs[256];
        lb_param_format(c, p, mine, sizeof mine);
        lb_param_format(&ck, p, theirs, sizeof theirs);
        snprintf(err, errlen, "%s: model.%s is %s in the checkpoint, %s in this run: a resumed "
                 "run continues the checkpoint's model (start a new run, or set it back)", path,
                 p->key, theirs, mine);
        return -1;
    }
    return 0;
}

void lb_run_changed_keys(const lb_config *c, const char *path, char *out, size_t outlen)
{
    lb_config ck;
    char err[1024];
    size_t used = 0;
    out[0] = 0;
    if (lb_run_checkpoint_config(path, &ck, err, sizeof err) != 0) return;
    for (int i = 0; i < lb_nparams; i++) {
        const lb_param *p = &lb_params[i];
        if (!strcmp(p->section, "model") ||
            (!strcmp(p->section, "checkpoint") &&
             (!strcmp(p->key, "resume") || !strcmp(p->key, "init"))))
            continue;   // the model is refused when changed; resume names the checkpoint itself
        if (!memcmp((const char *)c + p->offset, (const char *)&ck + p->offset, p->size))
            continue;
        char mine[160], theirs[160];
        lb_param_format(c, p, mine, sizeof mine);
        lb_param_format(&ck, p, theirs, sizeof theirs);
        int w = snprintf(out + used, outlen - used, "%s%s.%s %s -> %s", used ? ", " : "",
                         p->section, p->key, theirs, mine);
        if (w < 0 || (size_t)w >= outlen - used) {   // cut: say so and stop
            if (outlen > 4) snprintf(out + outlen - 5, 5, "...");
            return;
        }
        used += (size_t)w;
    }
}

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
    lb_config ck, def;
    if (lb_run_checkpoint_config(path, &ck, err, errlen) != 0) return -1;
    lb_config_defaults(&def);
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
