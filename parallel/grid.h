// grid.h: the process grid (doc/parallel.md). The world is cut, fastest first, into tensor
// (tp), data (dp) and pipeline (pp) parallel groups for the dense layers, and the same ranks are
// folded into expert-tensor (etp), expert (ep), expert-data (edp) and pipeline groups for the
// expert layers, as Megatron-Core does:
//
//   dense:   rank = tp_rank  + tp  * (dp_rank + dp * pp_rank),             dp  = world / (tp pp)
//   experts: rank = etp_rank + etp * (ep_rank + ep * (edp_rank + edp * pp_rank)),
//            edp = world / (etp ep pp)
//
// With etp = tp (the default) a dense data-parallel index splits into ep_rank + ep * edp_rank,
// which orders the ranks tp (fastest), ep, dp, pp (doc/parallel.md). Every dense data-parallel rank reads different
// data; attention is replicated over the ep ranks and experts are split over them.
#ifndef LB_GRID_H
#define LB_GRID_H

#include <stddef.h>
#include "parallel/comm.h"

// The [parallel] section of a parameter file (src/cli/params.c documents each key).
typedef struct {
    int tp;                        // tensor-parallel size
    int pp;                        // pipeline-parallel size
    int ep;                        // expert-parallel size
    int etp;                       // expert-tensor-parallel size, 0 = tp
    int dp;                        // data-parallel size, 0 = world / (tp pp); else it must match
    int sequence_parallel;         // with tp: activations split over the sequence between blocks
    int micro_batches;             // per data-parallel rank and step, 0 = train.grad_accum / dp
    int zero;                      // ZeRO-1 distributed optimizer; 0 = all-reduce gradients
    int deterministic;             // rank-order floating-point sums in every collective
    int fail_rank;                 // debug: this rank fails at fail_step (-1 = none)
    int fail_step;
    char fail_mode[8];             // die (MPI_Abort) | exit (no MPI_Finalize) | kill (SIGKILL)
} lb_parallel_config;

typedef struct {
    int world, rank;
    int tp, dp, pp;                // dense grid
    int tp_rank, dp_rank, pp_rank;
    int etp, ep, edp;              // expert grid (same pp)
    int etp_rank, ep_rank, edp_rank;
    int sequence_parallel;
    // Communicators (lb_grid_create), MPI over host memory. Megatron-Core's groups:
    lb_comm tp_comm;               // tensor-model-parallel: same dp_rank, pp_rank
    lb_comm dp_comm;               // data-parallel (dense gradients): same tp_rank, pp_rank
    lb_comm pp_comm;               // pipeline-model-parallel: same tp_rank, dp_rank
    lb_comm mp_comm;               // model-parallel (tp x pp): same dp_rank
    lb_comm etp_comm;              // expert-tensor-parallel: same ep_rank, edp_rank, pp_rank
    lb_comm ep_comm;               // expert-model-parallel (token all-to-all): same etp, edp, pp
    lb_comm edp_comm;              // expert-data-parallel (expert gradients): same etp, ep, pp
    int has_comms;
} lb_grid;

// The groups, for lb_grid_members and tests.
typedef enum { LB_GROUP_TP, LB_GROUP_DP, LB_GROUP_PP, LB_GROUP_MP, LB_GROUP_ETP, LB_GROUP_EP,
               LB_GROUP_EDP, LB_GROUP_COUNT } lb_group;

// Sizes and this rank's coordinates for a world of `world` ranks; no communication, so any
// layout can be planned (lowbit info) and tested without MPI. Checks that the world divides
// (and parallel.dp, when given, agrees). Returns 0, or -1 with a message naming the keys.
int lb_grid_layout(lb_grid *g, const lb_parallel_config *pc, int world, int rank, char *err,
                   size_t errlen);
// lb_grid_layout over `world`'s ranks, then one MPI_Comm_split per group. Collective. Every
// rank reaches the same verdict, so on -1 all return without communicating.
int lb_grid_create(lb_grid *g, const lb_parallel_config *pc, lb_comm *world, char *err,
                   size_t errlen);
void lb_grid_free(lb_grid *g);

// World ranks of this rank's group, in group-rank order (out holds the group's size).
int lb_grid_members(const lb_grid *g, lb_group which, int *out);
const char *lb_grid_group_name(lb_group which);
// "world 8 = tp 2 x dp 4 x pp 1; experts: etp 2 x ep 2 x edp 2 x pp 1"
void lb_grid_describe(const lb_grid *g, char *buf, size_t len);

// Whether this release can train the layout: every layout whose expert tensor parallelism
// divides the tensor parallelism (etp 0 means tp). -1 with a message otherwise.
int lb_grid_check_built(const lb_parallel_config *pc, char *err, size_t errlen);

#endif
