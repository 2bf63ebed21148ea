// distributed_optimizer.h: data parallelism's part of the optimizer step: Megatron-Core's
// distributed optimizer (ZeRO-1, optimizer/distrib_optimizer.py) and gradient all-reduce over a
// flat fp32 parameter buffer and its gradient (doc/parallel.md). The buffer is cut into
// regions, each reduced over its own group (Megatron's buffers: the dense parameters over dp,
// the experts over edp):
//   - sharded (ZeRO-1): every region is padded to a multiple of its group's size (by the
//     caller, who owns the layout; the padding stays zero) and each rank owns an equal shard of
//     it. The gradient is reduce-scattered into the shard, the caller updates its shard of the
//     fp32 parameters and keeps the optimizer state of that shard only, and the parameters are
//     all-gathered whole again;
//   - otherwise: the gradient is all-reduced and every rank updates every parameter; each still
//     owns an equal share of each region, for what must be counted once (the gradient norm).
// The optimizer itself (clipping, AdamW, the schedule) is the caller's (src/train/optim.c).
#ifndef LB_DISTRIBUTED_OPTIMIZER_H
#define LB_DISTRIBUTED_OPTIMIZER_H

#include <stddef.h>
#include "kernels/kernels.h"
#include "parallel/comm.h"

#define LB_DIST_REGIONS 2

typedef struct {
    lb_backend *be;
    // Each region of the flat buffers (floats) and its group (backend memory; NULL: one rank).
    struct { lb_comm *comm; size_t begin, len; } region[LB_DIST_REGIONS];
    // The parameters this rank owns of each region, [begin, begin + len), placed at `at` in the
    // shard arrays (sharded), or at their own index (not).
    struct { size_t begin, len, at; } own[LB_DIST_REGIONS];
    size_t shard_len;              // floats of the shard: the owned ranges, or every parameter
    float *grad_shard;             // (shard_len) backend memory: the shard's reduced gradient;
                                   // NULL when not sharded
} lb_dist_optimizer;

// Whether the step shards: `distributed` asked for it and some group has more than one rank.
// Then align[r] is region r's group size, the multiple the caller pads the region to before
// lb_dist_optimizer_init (equal shards: reduce-scatter and all-gather move equal blocks).
int lb_dist_optimizer_sharded(lb_comm *const comm[LB_DIST_REGIONS], int distributed,
                              size_t align[LB_DIST_REGIONS]);
// Region r is [begin[r], begin[r] + len[r]) of the nparams floats, reduced over comm[r].
void lb_dist_optimizer_init(lb_dist_optimizer *d, lb_backend *be,
                            lb_comm *const comm[LB_DIST_REGIONS],
                            const size_t begin[LB_DIST_REGIONS],
                            const size_t len[LB_DIST_REGIONS], size_t nparams, int sharded);
void lb_dist_optimizer_free(lb_dist_optimizer *d);

// Where parameter i sits in the shard arrays (i owned when sharded).
size_t lb_dist_optimizer_shard_pos(const lb_dist_optimizer *d, size_t i);
// The reduced gradient of parameter i: in the shard, or in grads (i owned when sharded).
float *lb_dist_optimizer_grad(const lb_dist_optimizer *d, float *grads, size_t i);

// Sums the gradient (nparams, backend memory) over each region's group: into the shard, or in
// place. Collective over the groups; the backend's writes must be complete.
void lb_dist_optimizer_reduce_grads(lb_dist_optimizer *d, float *grads);
// Sharded: every rank gets every rank's updated shard, so params are whole again everywhere.
void lb_dist_optimizer_gather_params(lb_dist_optimizer *d, float *params);
// Sharded: n arrays laid out as the shard (shard[k], shard_len floats) gathered into arrays
// laid out as the parameters (full[k], nparams floats): checkpoints of optimizer state.
void lb_dist_optimizer_gather(lb_dist_optimizer *d, int n, float *const *shard,
                              float *const *full);

#endif
