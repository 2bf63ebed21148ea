// checkpoint.h: lowbit checkpoints. A checkpoint is one safetensors file: every parameter by
// its model name (F32), the AdamW moments as "optimizer.exp_avg.<name>" and
// "optimizer.exp_avg_sq.<name>", and metadata: format "lowbit-checkpoint-2", the resolved
// configuration (INI text), the step, the data loader position, the model's tokenizer.json
// text when it has one, a CRC-32 of the data and one of the header (the metadata and the
// tensor table). Loading checks all of them before it
// reads any data. Saves are atomic (temporary name, fsync, rename); see doc/checkpoints.md.
#ifndef LB_CHECKPOINT_H
#define LB_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>
#include "models/model.h"
#include "parallel/comm.h"
#include "parallel/grid.h"

typedef struct {
    int64_t step;                  // optimizer steps completed
    // lb_loader_tell's: shard and token offset, or shard -1 and the sequences drawn by a
    // shuffled or blended loader (stored as metadata "loader_sequence")
    int64_t loader_shard, loader_pos;
} lb_train_state;

// Writes params (and, when not NULL, the moments: backend buffers of m->nparams floats).
// tokenizer_json: the model's tokenizer.json text, stored verbatim; NULL for a byte model.
int lb_checkpoint_save(const char *path, const lb_model *m, const float *adam_m,
                       const float *adam_v, const lb_train_state *st, const char *config_ini,
                       const char *tokenizer_json, char *err, size_t errlen);
// The configuration stored in a checkpoint (malloc'd INI text).
char *lb_checkpoint_config(const char *path, char *err, size_t errlen);
// The tokenizer.json text stored in a checkpoint into *json (malloc'd; NULL when it has none),
// after the header's CRC is checked. 0, or -1 with a message.
int lb_checkpoint_tokenizer(const char *path, char **json, char *err, size_t errlen);
// Loads into a model built from that configuration. Every tensor must exist by name with the
// model's shape, the moments of every parameter too when the file has any; they are loaded
// when adam_m/adam_v are not NULL (zero when the file has none).
int lb_checkpoint_load(const char *path, lb_model *m, float *adam_m, float *adam_v,
                       lb_train_state *st, char *err, size_t errlen);
// Checkpoints of a parallel job: one file whatever the layout. Save: every rank gives its
// model piece m and the AdamW moments of all its parameters (adam_m, adam_v: host buffers of
// m->nparams floats laid out as m->params, the optimizer's shards gathered by the caller:
// lb_optimizer_save), sends the pieces it writes (one copy of each parameter) to rank 0, which
// puts every tensor together and writes the file. Load: rank 0 reads and checks the file, then
// sends every rank its pieces (the parameters into m, the moments into adam_m and adam_v,
// backend buffers, for the caller's optimizer), so a checkpoint of any layout resumes under any other. pc: the
// job's [parallel] section (the layout of every rank follows from it and the world size);
// NULL: data parallelism over the whole world. Collective over world; on -1 every rank
// returns -1 (rank 0 has the message).
int lb_checkpoint_save_parallel(const char *path, lb_model *m, const float *adam_m,
                                const float *adam_v, const lb_train_state *st,
                                const char *config_ini, const char *tokenizer_json,
                                lb_comm *world, const lb_parallel_config *pc, char *err,
                                size_t errlen);
int lb_checkpoint_load_parallel(const char *path, lb_model *m, float *adam_m, float *adam_v,
                                lb_train_state *st, lb_comm *world,
                                const lb_parallel_config *pc, char *err, size_t errlen);
// The parameters of any checkpoint (no moments, no optimizer) into this rank's piece m of the
// layout pc (NULL: every rank holds everything): rank 0 reads, every rank receives its pieces.
// The weight cache is marked stale at the file's step. Collective over world, as above.
int lb_checkpoint_load_weights(const char *path, lb_model *m, lb_comm *world,
                               const lb_parallel_config *pc, char *err, size_t errlen);
// Newest "step_NNNNNNNN.safetensors" in dir, or "" when none. Returns 0 or -1.
int lb_checkpoint_latest(const char *dir, char *out, size_t outlen);

#endif
