// dispatcher.h: Megatron-Core's all-to-all token dispatcher for expert parallelism
// (doc/parallel.md). Experts are cut into ep equal ranges, range r on ep rank r. After the
// router, each rank holds its tokens' rows permuted by expert (moe_plan order: expert-major,
// token order within an expert). Dispatch exchanges the counts, then sends each rank the rows
// of its experts (all-to-all-v) and orders what arrives expert-major, source rank next, so one
// grouped GEMM runs every local expert. Combine is the inverse. Backward reuses the pair:
// dispatch carries d y to the experts, combine carries d x back. Every order is fixed, so the
// result does not depend on timing, and each row meets the same expert GEMM as on one rank.
#ifndef LB_DISPATCHER_H
#define LB_DISPATCHER_H

#include <stdint.h>
#include "kernels/kernels.h"
#include "parallel/comm.h"

// One MoE layer's routing plan for one micro-batch (kept for its backward).
typedef struct {
    int ep, experts, local;        // ep ranks, experts in all, experts per rank
    size_t *send, *sdispl;         // (ep) rows to each rank, their first row (sender order)
    size_t *recv, *rdispl;         // (ep) rows from each rank, where they land (source-major)
    int *local_counts;             // (local) rows per local expert after dispatch
    int *seg_counts;               // (local * ep) of those, the rows from source rank s at
                                   // [le * ep + s] (their order: expert-major, source-minor)
    int nrecv, nsend;
    int32_t *perm;                 // (cap) backend: source-major row i -> expert-major perm[i]
    int cap;
} lb_ep_route;

// Plans from counts (experts, host): this rank's rows per expert, in moe_plan order. Collective
// over ep (the counts travel as host messages over ep's MPI communicator). ep NULL or of size 1:
// every expert is local and dispatch/combine are copies.
void lb_ep_route_plan(lb_ep_route *r, lb_comm *ep, lb_backend *be, const int *counts,
                      int experts);
void lb_ep_route_free(lb_ep_route *r, lb_backend *be);
// x (nsend, c) in moe_plan order -> xe (nrecv, c) expert-major. scratch: (max(nsend, nrecv), c).
void lb_ep_dispatch(const lb_ep_route *r, lb_comm *ep, lb_backend *be, const float *x,
                    float *xe, float *scratch, int c);
// ye (nrecv, c) expert-major -> y (nsend, c) in moe_plan order.
void lb_ep_combine(const lb_ep_route *r, lb_comm *ep, lb_backend *be, const float *ye,
                   float *y, float *scratch, int c);

#endif
