// run.h: the parallel pieces of a run that `lowbit train` (src/train.c) and `lowbit rl`
// (src/rl.c) build alike: the grid's groups as communicators over the backend's memory, the
// model piece and optimizer groups they give, the checkpoint to resume from, and the saves.
#ifndef LB_RUN_H
#define LB_RUN_H

#include <stddef.h>
#include "models/model.h"
#include "parallel/comm.h"
#include "parallel/grid.h"
#include "src/checkpoint.h"
#include "src/config.h"
#include "src/optim.h"

// The backend-memory communicators of the grid's groups: the grid's MPI ones for the CPU
// backend, NCCL over the same ranks for CUDA (a group of one rank keeps its MPI one).
typedef struct {
    lb_comm *tp, *ep, *pp, *dp, *edp;
    lb_comm nccl[5];
    int nnccl;                     // how many of nccl are open
} lb_run_comms;

// The backend of this rank: run.backend, one GPU per rank (rank i of a node takes device
// run.device + i). NULL after printing why.
lb_backend *lb_run_backend_open(const lb_config *c, lb_comm *world);

// Opens them in a fixed order (tp, ep, pp, dp, edp): creating an NCCL communicator is
// collective, so every rank creates its groups in that order, going on after a failure so that
// none waits in another's creation (a failed group keeps its MPI one). Returns 0, or -1 with the
// last message; the caller learns whether any rank failed (lb_any_failed).
int lb_run_comms_open(lb_run_comms *x, lb_grid *g, lb_backend *be, int cuda, char *err,
                      size_t errlen);
void lb_run_comms_free(lb_run_comms *x);

// This rank's place in the model-parallel grid, with x's tp and ep groups (NULL at size 1).
lb_model_parallel lb_run_model_parallel(const lb_grid *g, const lb_run_comms *x);
// The optimizer's groups: x's dp and edp, its tp when tp > 1, the norm over the world.
lb_optim_groups lb_run_optim_groups(const lb_grid *g, const lb_run_comms *x, lb_comm *world);

// The checkpoint a run resumes from into out: checkpoint.resume, or under "auto" the newest in
// ckdir (rank 0 looks, every rank learns it); "" to start fresh. Collective over world.
void lb_run_resume_path(const lb_config *c, const char *ckdir, lb_comm *world, char *out,
                        size_t outlen);
// Rank 0 of a run: the resolved configuration ini into OUT_DIR/config.ini (atomic) and one
// line that names it, or with run.verbose the whole text. 0, or -1 with a message.
int lb_run_config_write(const lb_config *c, const char *ini, char *err, size_t errlen);
// Whether step is due a checkpoint: every checkpoint.save_every steps and the last one
// (save_every -1: never).
int lb_run_save_due(const lb_config *c, int step, int last);
// Saves st's step into ckdir/step_NNNNNNNN.safetensors (collective over world; dies on
// failure), then rank 0 keeps the newest checkpoint.keep and names the file.
void lb_run_save(const lb_config *c, const char *ckdir, lb_optimizer *o, const lb_train_state *st,
                 const char *ini, lb_comm *world);

#endif
