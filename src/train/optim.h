// optim.h: the optimizer step shared by `train` and `rl`: the gradient reduction over the
// data-parallel ranks, global-norm clipping, AdamW with decoupled weight decay (none on norm
// weights), the learning-rate schedule, and the weight cache refresh that follows every update.
//
// Data parallelism (doc/parallel.md). Every rank adds its micro-batches' gradients (each scaled
// by 1 / the global number of micro-batches) into m->grads; the step then sums them over the
// data-parallel group (the experts' over the expert-data-parallel group, after the partial
// sums of tp-replicated tensors over tp), so the update is the one a single rank computes over
// the whole global batch (the sharding and its communication: parallel/distributed_optimizer.h):
//   - distributed (ZeRO-1, Megatron's distributed optimizer): reduce-scatter each region of the
//     flat gradient (padded to a multiple of its group), take the global norm from the shards'
//     sums of squares, AdamW on this rank's shard of the fp32 parameters (the master weights:
//     parameters are fp32 here) with the moments of that shard only, all-gather the parameters;
//   - otherwise: all-reduce the gradient, and every rank updates every parameter.
// Weight decay follows the tensor table element by element, so a shard that cuts through a
// tensor still decays its matrix elements and not its norm weights.
#ifndef LB_OPTIM_H
#define LB_OPTIM_H

#include "models/model.h"
#include "parallel/comm.h"
#include "parallel/distributed_optimizer.h"
#include "src/io/checkpoint.h"

typedef struct {
    double lr, min_lr;
    int warmup_steps, total_steps;     // linear warm-up, then cosine to min_lr at total_steps
    double beta1, beta2, eps, weight_decay, grad_clip;
    // Optimizer offload (doc/architecture.md, Memory): this fraction of the rank's parameters keeps its
    // AdamW moments in host memory and is updated there by the CPU backend (threads: 0 = all
    // cores) on a thread of its own, after the backend's update of the rest is queued: each
    // step streams those parameters and gradients down in pieces and the parameters back up,
    // the copies of one piece overlapping the host update of the one before.
    double offload;
    int offload_threads;
    // 1: the moments are stored in bf16 (adamw16, train.adam_moments = bf16), on the device
    // and offloaded alike; the parameters, gradients and checkpoints stay fp32.
    int moments16;
    // Parameters an offload piece holds at most (0: LB_OFFLOAD_PIECE); tests make it small.
    size_t offload_piece;
} lb_optim_config;

// 8 Mi parameters: 32 MiB copies, long enough for the link's full rate, and four staging
// arrays of 128 MiB in all.
#define LB_OFFLOAD_PIECE ((size_t)1 << 23)

// A run of parameters with one weight decay (norm weights get none); at: where its first
// parameter sits in the shard (the ZeRO gradient shard; the moments' checkpoint layout); mat:
// where its moments start, in adam_m/adam_v or, offloaded (host), in host_m/host_v.
typedef struct {
    size_t begin, end;                 // parameter indices, begin inclusive
    size_t at, mat;
    float wd;
    int host;
} lb_optim_segment;

// The groups a step communicates over (NULL: size 1). Megatron's buckets: the dense region of
// the parameter buffer is reduced over dp, the experts over edp; gradients of tp-replicated
// tensors that are partial sums (lb_tensor.tp_sum) first over tp; the global norm over all
// ranks (`world`: every rank of every model-parallel piece).
typedef struct {
    lb_comm *dp, *edp, *tp;            // backend memory (MPI for the CPU, NCCL for CUDA)
    lb_comm *world;                    // host messages (MPI)
} lb_optim_groups;

typedef struct {
    lb_optim_config cfg;
    lb_model *m;
    lb_optim_groups g;
    // The regions (0 dense, 1 experts; lb_model) over their groups, and the parameters this
    // rank owns (its ZeRO shard; without ZeRO it updates all but counts only these in the norm)
    lb_dist_optimizer dist;
    // The moments: float, or uint16_t bf16 bits where cfg.moments16 (lb_optimizer_moment_size)
    void *adam_m, *adam_v;             // (dev_len) backend memory: the moments on the device
    size_t dev_len, host_len;          // moments on the device and offloaded to the host
    void *host_m, *host_v;             // (host_len) host memory: the offloaded moments
    // The offloaded segments cut into pieces of at most cfg.offload_piece parameters, and two
    // staging slots (be->host_alloc: pinned for CUDA) of a piece's parameters and gradients:
    // piece i's copies use slot i % 2 while the host updates piece i - 1 in the other.
    int npiece;
    lb_optim_segment *piece;
    float *stage_p[2], *stage_g[2];
    lb_backend *host;                  // the CPU backend that updates them (NULL: no offload)
    struct lb_offload_worker *worker;  // the thread that runs the host's updates
    int nseg;
    lb_optim_segment *seg;             // the AdamW runs
} lb_optimizer;

// One rank (no communication).
void lb_optimizer_init(lb_optimizer *o, lb_model *m, const lb_optim_config *cfg);
// Data parallelism over dp, a communicator over the backend's memory (MPI for the CPU backend,
// NCCL for CUDA); NULL or one rank is lb_optimizer_init. distributed: ZeRO-1, else all-reduce.
void lb_optimizer_init_dp(lb_optimizer *o, lb_model *m, const lb_optim_config *cfg, lb_comm *dp,
                          int distributed);
// Any layout. With ZeRO-1 the model's regions are re-laid padded to a multiple of their group
// size (lb_model_align: Megatron's contiguous buffers; the padding stays zero and is never
// updated): take pointers into m->params and m->grads only after this call.
void lb_optimizer_init_groups(lb_optimizer *o, lb_model *m, const lb_optim_config *cfg,
                              const lb_optim_groups *g, int distributed);
void lb_optimizer_free(lb_optimizer *o);
double lb_optimizer_lr(const lb_optim_config *c, int step);     // step counts from 1
// Sums the gradients over tp (partial ones), dp and edp, clips them to grad_clip (global L2
// norm), applies AdamW for optimizer step `step`, and marks the weight cache stale. Collective
// over all ranks. Returns the
// gradient norm before clipping (the same on every rank).
double lb_optimizer_step(lb_optimizer *o, int step, double *lr_out);

// Bytes of one stored moment: 4 (fp32) or 2 (bf16).
size_t lb_optimizer_moment_size(const lb_optimizer *o);

// Checkpoints hold the full moments in fp32 whatever the layout (bf16 moments widen exactly;
// loading rounds fp32 ones to nearest even, the identity on moments that were bf16). Gather:
// every rank gets the moments of all its parameters into adam_m and adam_v (backend buffers of
// m->nparams floats, laid out as m->params). Collective over dp and edp.
void lb_optimizer_state_gather(lb_optimizer *o, float *adam_m, float *adam_v);
// Load: keeps this rank's shard of the moments of all its parameters (backend buffers of
// m->nparams floats): any checkpoint loads under any data-parallel size.
void lb_optimizer_state_load(lb_optimizer *o, const float *adam_m, const float *adam_v);

// The parallel checkpoint of o's model and moments (lb_checkpoint_save_parallel and
// lb_checkpoint_load_parallel, src/io/checkpoint.h, with the moments gathered from and loaded
// into o's shards). Collective over world; on -1 every rank returns -1 (rank 0 has the message).
int lb_optimizer_save(const char *path, lb_optimizer *o, const lb_train_state *st,
                      const char *config_ini, const char *tokenizer_json, lb_comm *world,
                      const lb_parallel_config *pc, char *err, size_t errlen);
int lb_optimizer_load(const char *path, lb_optimizer *o, lb_train_state *st, lb_comm *world,
                      const lb_parallel_config *pc, char *err, size_t errlen);

#endif
