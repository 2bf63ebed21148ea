// comm.h: the collective interface, named as Megatron-Core and NCCL name them: all-reduce (sum),
// reduce-scatter (sum), all-gather, all-to-all-v, send/recv, broadcast, barrier, over a
// communicator object. Two implementations fill one table of operations (as the kernel set):
//   - MPI (comm.c): host memory; the CPU backend's buffers and every control message.
//   - NCCL (comm_nccl.c, built with CUDA): device memory of the CUDA backend, queued on a
//     stream; bootstrapped through MPI (rank 0's unique id is broadcast).
// Sub-communicators (tensor, data, pipeline, expert groups: parallel/grid.h) come from
// MPI_Comm_split. Every MPI and NCCL call is checked; a failure reports file:line and ends the
// whole job through MPI_Abort, so one failing rank never leaves the others waiting.
//
// Determinism (doc/parallel.md): with `deterministic` set (the default) every floating-point
// sum is reduced in rank order, ((x_0 + x_1) + x_2) + ..., in the element type, whatever the
// message sizes, the algorithm the library would pick or the order in which data arrives:
// reduce-scatter exchanges the chunks (all-to-all) and each rank sums its chunk in rank order;
// all-reduce is that reduce-scatter followed by an all-gather. The result is bitwise the same
// on every rank and in every run, and equal to the serial left-to-right sum. Without it the
// library's own reductions run (MPI_Allreduce, ncclAllReduce): faster, not reproducible
// across algorithms. Integer sums are exact either way.
#ifndef LB_COMM_H
#define LB_COMM_H

#include <stddef.h>

struct lb_backend;

typedef enum { LB_F32, LB_F64, LB_I32, LB_I64, LB_BYTE } lb_dtype;
size_t lb_dtype_size(lb_dtype t);

typedef struct lb_comm lb_comm;

// One implementation. Counts are in elements. Buffers live in the implementation's memory
// (host for MPI, device for NCCL). In place: all_reduce may have send == recv; all_gather may
// have send == recv + rank * count; broadcast works in place; reduce_scatter's send and recv
// must not overlap. MPI operations are complete on return; NCCL ones are queued on the
// communicator's stream: call lb_comm_sync before the host or another stream reads the result.
typedef struct {
    const char *name;   // "mpi", "nccl"
    // recv (count) = sum over ranks of send (count)
    void (*all_reduce)(lb_comm *, const void *send, void *recv, size_t count, lb_dtype);
    // recv (count) = sum over ranks of send[rank * count, (rank + 1) * count); send (size * count)
    void (*reduce_scatter)(lb_comm *, const void *send, void *recv, size_t count, lb_dtype);
    // recv (size * count): rank j's send (count) at recv + j * count
    void (*all_gather)(lb_comm *, const void *send, void *recv, size_t count, lb_dtype);
    // send_counts[j] elements from send + send_displs[j] go to rank j, which receives them at
    // recv + recv_displs[rank]; counts may differ per pair and be zero. Each rank must expect
    // what the sender sends (recv_counts[i] on this rank = send_counts[rank] on rank i).
    void (*all_to_all_v)(lb_comm *, const void *send, const size_t *send_counts,
                         const size_t *send_displs, void *recv, const size_t *recv_counts,
                         const size_t *recv_displs, lb_dtype);
    // Point to point, matched in call order per pair of ranks (NCCL has no tags).
    void (*send)(lb_comm *, const void *buf, size_t count, lb_dtype, int peer);
    void (*recv)(lb_comm *, void *buf, size_t count, lb_dtype, int peer);
    // Both at once (pipeline stages send forward while receiving backward): never deadlocks.
    void (*send_recv)(lb_comm *, const void *send, size_t send_count, int dest, void *recv,
                      size_t recv_count, int source, lb_dtype);
    void (*broadcast)(lb_comm *, void *buf, size_t count, lb_dtype, int root);
    void (*barrier)(lb_comm *);
    void (*sync)(lb_comm *);          // wait for queued work (no-op for MPI)
    void (*destroy)(lb_comm *);
} lb_comm_ops;

struct lb_comm {
    int rank, size;
    void *mpi_comm;                // MPI_Comm *: the MPI communicator over the same ranks
                                   // (host control messages; NCCL bootstrap)
    const lb_comm_ops *ops;
    int deterministic;             // fixed-order (rank-order) floating-point sums
    void *impl;                    // implementation state
};

// --- the world and sub-communicators (MPI, host memory) ---------------------------------------
// MPI_Init; installs MPI_Abort as the fatal-error hook so a failing rank ends the job.
void lb_comm_init(lb_comm *c, int *argc, char ***argv);
void lb_comm_finalize(lb_comm *c);
// MPI_Comm_split: ranks with the same color form one communicator, ordered by key. Collective
// over parent. The result inherits parent's deterministic flag; free it with lb_comm_free.
void lb_comm_split(lb_comm *parent, int color, int key, lb_comm *out);
void lb_comm_free(lb_comm *c);
// This rank's index among the ranks on its node (MPI_COMM_TYPE_SHARED): picks its GPU.
int lb_comm_local_rank(lb_comm *c);
// This rank's node (the ranks that share memory with it, as MPI_COMM_TYPE_SHARED groups them):
// the lowest rank of c on it. Collective over c.
int lb_comm_node(lb_comm *c);
// Whether c's ranks, each on node `node` (lb_comm_node over a common parent), lie on more than
// one node. Collective over c.
int lb_comm_spans_nodes(lb_comm *c, int node);
// For tests: the largest number of elements one MPI call or one staging buffer of the
// deterministic reductions handles (default 1 << 22; NCCL uses it for its staging too). Small
// values exercise the piecewise paths.
void lb_comm_mpi_set_piece(size_t elements);

// --- NCCL (device memory) ---------------------------------------------------------------------
// A communicator over the ranks of `mpi` (ncclCommInitRank; rank 0's unique id is broadcast
// through mpi, collectively). be is the CUDA backend whose device memory the buffers live in
// (its copy and add run the deterministic rank-order sums); stream is a cudaStream_t, or NULL
// for one of the communicator's own. The current device must be be's. Returns 0, or -1 with
// a message (also when lowbit was built without CUDA). Free with lb_comm_free.
int lb_comm_nccl_create(lb_comm *out, lb_comm *mpi, struct lb_backend *be, void *stream,
                        char *err, size_t errlen);

// --- collectives (dispatch to c->ops; see lb_comm_ops for the rules) --------------------------
static inline void lb_comm_all_reduce(lb_comm *c, const void *send, void *recv, size_t count,
                                      lb_dtype t) { c->ops->all_reduce(c, send, recv, count, t); }
static inline void lb_comm_reduce_scatter(lb_comm *c, const void *send, void *recv,
                                          size_t count, lb_dtype t)
{ c->ops->reduce_scatter(c, send, recv, count, t); }
static inline void lb_comm_all_gather(lb_comm *c, const void *send, void *recv, size_t count,
                                      lb_dtype t) { c->ops->all_gather(c, send, recv, count, t); }
static inline void lb_comm_all_to_all_v(lb_comm *c, const void *send, const size_t *send_counts,
                                        const size_t *send_displs, void *recv,
                                        const size_t *recv_counts, const size_t *recv_displs,
                                        lb_dtype t)
{ c->ops->all_to_all_v(c, send, send_counts, send_displs, recv, recv_counts, recv_displs, t); }
static inline void lb_comm_send(lb_comm *c, const void *buf, size_t count, lb_dtype t, int peer)
{ c->ops->send(c, buf, count, t, peer); }
static inline void lb_comm_recv(lb_comm *c, void *buf, size_t count, lb_dtype t, int peer)
{ c->ops->recv(c, buf, count, t, peer); }
static inline void lb_comm_send_recv(lb_comm *c, const void *send, size_t send_count, int dest,
                                     void *recv, size_t recv_count, int source, lb_dtype t)
{ c->ops->send_recv(c, send, send_count, dest, recv, recv_count, source, t); }
static inline void lb_comm_broadcast(lb_comm *c, void *buf, size_t count, lb_dtype t, int root)
{ c->ops->broadcast(c, buf, count, t, root); }
static inline void lb_comm_sync(lb_comm *c) { c->ops->sync(c); }
static inline void lb_comm_barrier(lb_comm *c) { c->ops->barrier(c); }

// --- host control messages (always MPI, over c->mpi_comm, whatever c's implementation) -------
void lb_comm_bcast(lb_comm *c, void *buf, size_t bytes, int root);
// recv (size * bytes): rank j's send (bytes) at recv + j * bytes (small messages: counts).
void lb_comm_host_all_gather(lb_comm *c, const void *send, void *recv, size_t bytes);
// Sum of one double over all ranks (rank order when c->deterministic).
double lb_comm_allreduce_sum(lb_comm *c, double x);

#endif
