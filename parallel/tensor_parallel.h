// tensor_parallel.h: Megatron's conjugate operators of tensor parallelism (Megatron-Core's
// tensor_parallel/mappings.py; doc/parallel.md), which join the pieces of column- and
// row-parallel linear layers. A column-parallel layer (weight cut by output features) reads the
// whole input and writes its share of the features; the row-parallel layer after it (weight cut
// by input features) writes partial sums, which lb_tp_reduce adds over the group. Under sequence
// parallelism the activations between those pairs are cut by rows (tokens): lb_tp_reduce
// reduce-scatters instead of all-reducing, and lb_tp_gather all-gathers the rows before the next
// column-parallel layer. The layers themselves are models/precision/linear.h on this rank's piece of
// the weight; which tensor is cut how is the model definition's (lb_split, models/model.h).
//
// Every operator waits for the backend's queued writes first (the communicator reads them) and
// for the communicator after (the backend reads the result). tp is the tensor-parallel group in
// the backend's memory (MPI for the CPU backend, NCCL for CUDA); NULL or one rank: nothing to do.
#ifndef LB_TENSOR_PARALLEL_H
#define LB_TENSOR_PARALLEL_H

#include <stddef.h>
#include "kernels/kernels.h"
#include "parallel/comm.h"

// out = the sum over tp of part (n, c): an all-reduce (Megatron's
// reduce_from_tensor_model_parallel_region), in place (out = part); or, with sp, a
// reduce-scatter that leaves this rank's n / tp rows in out (n / tp, c)
// (reduce_scatter_to_sequence_parallel_region). One rank: out must be part.
void lb_tp_reduce(lb_backend *be, lb_comm *tp, int sp, float *part, float *out, int n, int c);
// With sp: full (n, c) from each rank's rows mine (n / tp, c) (Megatron's
// gather_from_sequence_parallel_region); mine may be full + rank * (n / tp) * c (in place).
// Without sp the rows are already whole (full = mine) and nothing happens.
void lb_tp_gather(lb_backend *be, lb_comm *tp, int sp, const float *mine, float *full, int n,
                  int c);
// Sums x (count) over tp in place: a small result every tp rank needs whole.
void lb_tp_all_reduce(lb_backend *be, lb_comm *tp, float *x, size_t count);

#endif
