// run.c: the parallel pieces `lowbit train` and `lowbit rl` share (src/run.h).
#include "src/run.h"

#include "src/commands.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include "kernels/common.h"
#include "src/util.h"

lb_backend *lb_run_backend_open(const lb_config *c, lb_comm *world)
{
    lb_config local = *c;
    if (!strcmp(c->run.backend, "cuda") && world->size > 1)
        local.run.device += lb_comm_local_rank(world);
    return lb_backend_open(&local);
}

int lb_run_comms_open(lb_run_comms *x, lb_grid *g, lb_backend *be, int cuda, char *err,
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

void lb_run_comms_free(lb_run_comms *x)
{
    for (int i = 0; i < x->nnccl; i++) lb_comm_free(&x->nccl[i]);
    x->nnccl = 0;
}

lb_model_parallel lb_run_model_parallel(const lb_grid *g, const lb_run_comms *x)
{
    return lb_model_parallel_of(g, x->tp, x->ep);
}

lb_optim_groups lb_run_optim_groups(const lb_grid *g, const lb_run_comms *x, lb_comm *world)
{
    return (lb_optim_groups){x->dp, x->edp, g->tp > 1 ? x->tp : NULL, world};
}

void lb_run_resume_path(const lb_config *c, const char *ckdir, lb_comm *world, char *out,
                        size_t outlen)
{
    out[0] = '\0';
    if (strcmp(c->checkpoint.resume, "auto") == 0) {
        if (world->rank == 0) lb_checkpoint_latest(ckdir, out, outlen);
        lb_comm_bcast(world, out, outlen, 0);
    } else {
        snprintf(out, outlen, "%.*s", LB_PATH_MAX, c->checkpoint.resume);
    }
}

int lb_run_config_write(const lb_config *c, const char *ini, char *err, size_t errlen)
{
    char path[LB_PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/config.ini", c->run.out_dir);
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

// Removes all but the newest `keep` checkpoints of dir (their names sort by step).
static void keep_last(const char *dir, int keep)
{
    char pattern[1024];
    char **list;
    snprintf(pattern, sizeof pattern, "%s/step_*.safetensors", dir);
    int n = lb_glob(pattern, &list);
    for (int i = 0; i < n - keep; i++) unlink(list[i]);
    lb_glob_free(list, n);
}

void lb_run_save(const lb_config *c, const char *ckdir, lb_optimizer *o, const lb_train_state *st,
                 const char *ini, lb_comm *world)
{
    char path[2 * LB_PATH_MAX + 64], err[2048];
    snprintf(path, sizeof path, "%s/step_%08d.safetensors", ckdir, (int)st->step);
    if (lb_checkpoint_save_parallel(path, o, st, ini, world, &c->parallel, err, sizeof err) != 0)
        lb_die("%s", err);
    if (world->rank == 0) {
        keep_last(ckdir, c->checkpoint.keep);
        printf("saved %s\n", path);
    }
}
