// run.h: one run's setup, shared by the commands: the layout checks and the process grid, the
// backend, the grid's groups as communicators over the backend's memory, the model piece under
// the configuration's precision, the optimizer over its groups (train, rl, sample; bench and
// info take the backend, the model and the optimizer settings); then the checkpoint to resume
// from, the resolved configuration and the saves.
#ifndef LB_RUN_H
#define LB_RUN_H

#include <stddef.h>
#include "models/model.h"
#include "parallel/comm.h"
#include "parallel/grid.h"
#include "src/io/checkpoint.h"
#include "src/io/data.h"
#include "src/io/tokenizer.h"
#include "src/cli/config.h"
#include "src/train/optim.h"

// The backend-memory communicators of the grid's groups: the grid's MPI ones for the CPU
// backend, NCCL over the same ranks for CUDA (a group of one rank keeps its MPI one).
typedef struct {
    lb_comm *tp, *ep, *pp, *dp, *edp;
    lb_comm nccl[5];
    int nnccl;                     // how many of nccl are open
} lb_run_comms;

// One run of a command on this rank. Set up in steps (lb_run_layout, lb_run_setup,
// lb_run_optimizer, lb_run_checkpoint_dir), each returning 0, or 1 on every rank alike after one
// message; lb_run_teardown frees what they made.
typedef struct {
    const lb_config *c;
    lb_comm *world;
    const char *who;               // the command, "lowbit train": what messages start with
    int root;                      // world rank 0
    lb_grid grid;
    lb_run_comms comms;
    lb_model_parallel par;         // this rank's place in the model-parallel grid
    lb_backend *be;
    lb_model *m;                   // this rank's piece of the model
    lb_optimizer opt;              // with has_opt
    int has_opt;
    char ckdir[LB_PATH_MAX + 32];  // OUT_DIR/checkpoints
    int ckdir_made;                // rank 0 created ckdir in this run (lb_run_abandon)
    int outdir_made;               // ... and run.out_dir itself
    const char *tokenizer_json;    // the model's tokenizer.json text, stored in every checkpoint
                                   // lb_run_save writes (NULL: a byte model); set after layout
} lb_run;

// A command's own layout checks, after the grid's: 0, or -1 with a message.
typedef int (*lb_run_check)(const lb_config *c, const lb_grid *g, char *err, size_t errlen);

// A setup step that may fail on some ranks only (a file one node cannot read): every rank
// learns whether any failed, so they stop together instead of waiting in a collective. Rank 0
// prints one line, the message of the first rank that failed: "WHO: err" when that is rank 0,
// else "WHO: rank N: err". Collective over the world. Returns whether any rank failed.
int lb_run_failed(const lb_run *r, int failed, const char *err);
// Every shard of l read and checked (lb_loader_check_shard) before the first step, spread
// over the world: rank i checks shards i, i + size, ... A bad shard stops every rank with one
// message (lb_run_failed). key names the set in progress lines, printed by rank 0 for large
// sets (16 shards or more, or 2^28 tokens). Collective. 0, or 1 after the message.
int lb_run_check_shards(lb_run *r, const lb_loader *l, const char *key);

// The layout first: a bad one stops every rank before any work, with one message from rank 0
// (the grid's checks, then check's, which may be NULL). Then the grid's communicators (MPI,
// with parallel.deterministic sums).
int lb_run_layout(lb_run *r, const lb_config *c, lb_comm *world, const char *who,
                  lb_run_check check);
// The backend (one GPU per rank), the communicators of the grid's groups over its memory, and
// this rank's model piece (lb_run_model), its parameters not yet set. sampling: the sampler's
// numerics (lowbit rl, sample): batch-invariant operations per sample.deterministic.
int lb_run_setup(lb_run *r, int sampling);
// The optimizer of r's model over the grid's groups (ZeRO-1 per parallel.zero), its schedule
// ending at total_steps.
void lb_run_optimizer(lb_run *r, int total_steps);
// Makes OUT_DIR/checkpoints (rank 0), remembering whether it was there (lb_run_abandon).
int lb_run_checkpoint_dir(lb_run *r);
void lb_run_teardown(lb_run *r);
// After a command failed before its first save (a bad resume, a bad shard): removes the
// checkpoints directory lb_run_checkpoint_dir created, if it is still empty, so the failure
// leaves no litter. Rank 0's; a no-op elsewhere.
void lb_run_abandon(lb_run *r);

// The backend of run.backend; with a world of several ranks on CUDA, rank i of a node takes
// device run.device + i (collective over world; NULL: this process alone). LB_PROFILE=1 times
// every backend operation (the table goes to stderr at the end). NULL after printing why.
lb_backend *lb_run_backend_open(const lb_config *c, lb_comm *world);
// A model piece (par; NULL: the whole model) of c's model under c's precision and
// recomputation; for training (sampling 0) with train.ce_chunk, for sampling with
// sample.kv_cache. NULL with a message.
lb_model *lb_run_model(const lb_config *c, lb_backend *be, const lb_model_parallel *par,
                       int sampling, char *err, size_t errlen);
// The optimizer settings of [train], the schedule ending at total_steps.
lb_optim_config lb_run_optim_config(const lb_config *c, int total_steps);

// Reads a text file on rank 0 (with dash_stdin, "-" is standard input, which mpirun gives rank
// 0 alone) and gives its text to every rank; a NUL byte in it is refused. NULL on every rank
// when unreadable (rank 0 has the message). Collective over comm.
char *lb_read_everywhere(lb_comm *comm, const char *path, int dash_stdin, char *err,
                         size_t errlen);

// The tokenizer of a run (2026-12-07, doc/checkpoints.md): data.tokenizer's tokenizer.json
// when set, else the one stored in checkpoint (a path; "" or NULL: none), else none, and a
// token is a byte. Its text goes into every checkpoint the run saves, so the model's tokenizer
// travels with it to sample, rl and export.
typedef struct {
    lb_tokenizer *tk;              // NULL: tokens are bytes
    char *json;                    // its tokenizer.json text (malloc'd), NULL with tk
    char name[LB_PATH_MAX + 48];   // for messages: the file, or "the tokenizer stored in CKPT"
} lb_run_tokenizer;
// Reads and parses it, and checks that c's model has room for its tokens
// (model.vocab_size). Every rank reads the same files, so every rank reaches the same verdict.
// 0, or -1 with a message (t is then empty).
int lb_run_tokenizer_open(lb_run_tokenizer *t, const lb_config *c, const char *checkpoint,
                          char *err, size_t errlen);
void lb_run_tokenizer_close(lb_run_tokenizer *t);
// sample.stop_tokens when neither a file nor --set gave it: the end-of-text token of t's
// tokenizer (lb_tokenizer_eot), or the default 10 (newline) without one; written into c, so
// the resolved configuration shows the ids used. A given value stays as it is. 0, or -1 with a
// message for a tokenizer without an end-of-text token.
int lb_run_stop_tokens(lb_config *c, const lb_run_tokenizer *t, char *err, size_t errlen);

// The checkpoint a run resumes from into out: checkpoint.resume, or under "auto" the newest in
// r->ckdir (rank 0 looks, every rank learns it); "" to start fresh. Collective.
void lb_run_resume_path(const lb_run *r, char *out, size_t outlen);
// The configuration stored in the checkpoint at path, parsed over the defaults into out. 0, or
// -1 with a message.
int lb_run_checkpoint_config(const char *path, lb_config *out, char *err, size_t errlen);
// 0 when the checkpoint at path holds c's model: every [model] key the same (a resumed run
// continues that model; a changed rope_theta or num_experts_per_tok changes no tensor's shape,
// so the load alone would take it); else -1 with a message naming the first key that differs.
int lb_run_same_model(const lb_config *c, const char *path, char *err, size_t errlen);
// The keys outside [model] whose values in c differ from those stored in the checkpoint at
// path ("train.lr 0.0003 -> 0.0001, ..."), for the line that reports a resume; "" when none
// (or when the file's configuration does not read).
void lb_run_changed_keys(const lb_config *c, const char *path, char *out, size_t outlen);
// "FILE:LINE: " (or "FILE: ") where section.key was set, for messages; "" when not from a file.
const char *lb_key_where(const lb_config *c, const char *section, const char *key, char *buf,
                         size_t len);
// Reads the configuration stored in checkpoint `path` and takes its [model] section into
// c->model, so a run that loads its weights (sample, rl.init, checkpoint.init) is built like
// that model. A [model] key that c sets to another value than the checkpoint's is an error
// naming both.
int lb_model_config_from_checkpoint(lb_config *c, const char *path, char *err, size_t errlen);
// The run's resolved configuration (malloc'd INI text), after comments that say what made it:
// version and commit, the command line, the world's ranks, the backend and its device. Every
// checkpoint of the run stores this text, config.ini holds it.
char *lb_run_ini(const lb_run *r);
// Rank 0 of a run: ini (lb_run_ini's) into OUT_DIR/config.ini (atomic), and one line that
// names it, or with run.verbose the whole text. 0, or -1 with a message.
int lb_run_config_write(const lb_config *c, const char *ini, char *err, size_t errlen);
// Whether step is due a checkpoint: every checkpoint.save_every steps and the last one
// (save_every -1: never).
int lb_run_save_due(const lb_config *c, int step, int last);
// Saves st's step of r's optimizer into ckdir/step_NNNNNNNN.safetensors (collective; dies on
// failure), then rank 0 keeps the newest checkpoint.keep and names the file.
void lb_run_save(lb_run *r, const lb_train_state *st, const char *ini);

#endif
