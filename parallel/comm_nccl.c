// comm_nccl.c: the NCCL implementation of the collective interface (device memory of the CUDA
// backend, queued on a stream), built only with CUDA. MPI bootstraps it: rank 0 of the MPI
// communicator asks NCCL for a unique id and broadcasts it, and every rank joins with
// ncclCommInitRank. Every CUDA and NCCL call is checked; a failure reports file:line and ends
// the job through MPI_Abort (a rank that stopped would leave the others waiting in NCCL).
//
// Deterministic sums (comm.h): NCCL's own reductions follow its ring or tree, chosen by size
// and topology, so with `deterministic` set a float sum is done as in comm.c: the chunks are
// exchanged with grouped ncclSend/ncclRecv and each rank adds its p copies in rank order with
// the backend's `add` (one thread per element, no atomics), then an all-gather spreads them.
#include "parallel/comm.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include "kernels/kernels.h"
#include "parallel/comm_impl.h"

#define CUDA_CHECK(call)                                                                   \
    do {                                                                                   \
        cudaError_t e_ = (call);                                                           \
        if (e_ != cudaSuccess)                                                             \
            lb_die_at(__FILE__, __LINE__, "%s failed: %s", #call, cudaGetErrorString(e_)); \
    } while (0)

#define NCCL_CHECK(call)                                                                   \
    do {                                                                                   \
        ncclResult_t r_ = (call);                                                          \
        if (r_ != ncclSuccess)                                                             \
            lb_die_at(__FILE__, __LINE__, "%s failed: %s", #call, ncclGetErrorString(r_)); \
    } while (0)

typedef struct {
    MPI_Comm mpi;                  // a duplicate of the bootstrap communicator (host messages)
    ncclComm_t comm;
    cudaStream_t stream;
    int own_stream;
    lb_backend *be;                // its add and copy run the rank-order sums
    char *stage;                   // device staging of the deterministic sums (grow-only)
    size_t stage_bytes;
} nccl_state;

static nccl_state *S(lb_comm *c) { return c->impl; }

// The state of an operation about to touch device memory. The backend's queued work finishes
// first: it may still be writing a send buffer or zero-filling a fresh receive buffer (NCCL
// runs on its own stream, unordered with the backend's).
static nccl_state *enter(lb_comm *c)
{
    nccl_state *s = S(c);
    s->be->sync(s->be);
    return s;
}

static ncclDataType_t nccl_type(lb_dtype t)
{
    switch (t) {
    case LB_F32: return ncclFloat32;
    case LB_F64: return ncclFloat64;
    case LB_I32: return ncclInt32;
    case LB_I64: return ncclInt64;
    case LB_BYTE: return ncclUint8;
    }
    lb_die("unknown lb_dtype %d", (int)t);
}

static size_t min_sz(size_t a, size_t b) { return a < b ? a : b; }

static char *stage(lb_comm *c, size_t bytes)
{
    nccl_state *s = S(c);
    if (bytes > s->stage_bytes) {
        if (s->stage) CUDA_CHECK(cudaFree(s->stage));
        CUDA_CHECK(cudaMalloc((void **)&s->stage, bytes));
        s->stage_bytes = bytes;
    }
    return s->stage;
}

// Whether a float sum must take the rank-order path. Integer sums are exact in any order.
static int det_float(lb_comm *c, lb_dtype t, const char *op)
{
    if (!c->deterministic || c->size == 1) return 0;
    if (t == LB_BYTE) lb_die("%s: bytes cannot be summed", op);
    if (t == LB_F64)
        lb_die("%s: deterministic sums of LB_F64 in device memory are not implemented (LB_F32 "
               "and integers are; or set deterministic off)", op);
    return t == LB_F32;
}

// dst (len floats) = stage[0] + ... + stage[p-1] in rank order, on the backend's stream; the
// staged chunks must be complete (the communicator's stream synchronized) before.
static void sum_in_rank_order(lb_comm *c, float *dst, const float *st, size_t len)
{
    lb_backend *be = S(c)->be;
    be->copy(be, dst, st, len * sizeof(float));
    for (int j = 1; j < c->size; j++) be->add(be, dst, st + (size_t)j * len, len);
    be->sync(be);
}

static void nccl_all_reduce(lb_comm *c, const void *send, void *recv, size_t count, lb_dtype t)
{
    nccl_state *s = enter(c);
    if (!det_float(c, t, "all_reduce")) {
        if (t == LB_BYTE) lb_die("all_reduce: bytes cannot be summed");
        NCCL_CHECK(ncclAllReduce(send, recv, count, nccl_type(t), ncclSum, s->comm, s->stream));
        return;
    }
    int p = c->size, r = c->rank;
    const float *in = send;
    float *out = recv;
    size_t span = lb_comm_piece * (size_t)p;
    size_t *off = lb_malloc(((size_t)p + 1) * sizeof *off);
    for (size_t o = 0; o < count; o += span) {
        size_t n = min_sz(span, count - o);
        for (int j = 0; j <= p; j++) off[j] = o + n * (size_t)j / (size_t)p;
        size_t mine = off[r + 1] - off[r];
        float *st = (float *)stage(c, (size_t)p * mine * sizeof(float) + 1);
        NCCL_CHECK(ncclGroupStart());
        for (int j = 0; j < p; j++) {
            size_t len = off[j + 1] - off[j];
            if (j == r || (!len && !mine)) continue;
            if (len) NCCL_CHECK(ncclSend(in + off[j], len, ncclFloat32, j, s->comm, s->stream));
            if (mine)
                NCCL_CHECK(ncclRecv(st + (size_t)j * mine, mine, ncclFloat32, j, s->comm,
                                    s->stream));
        }
        NCCL_CHECK(ncclGroupEnd());
        CUDA_CHECK(cudaMemcpyAsync(st + (size_t)r * mine, in + off[r], mine * sizeof(float),
                                   cudaMemcpyDeviceToDevice, s->stream));
        CUDA_CHECK(cudaStreamSynchronize(s->stream));
        sum_in_rank_order(c, out + off[r], st, mine);
        NCCL_CHECK(ncclGroupStart());
        for (int j = 0; j < p; j++) {
            size_t len = off[j + 1] - off[j];
            if (j == r) continue;
            if (mine) NCCL_CHECK(ncclSend(out + off[r], mine, ncclFloat32, j, s->comm, s->stream));
            if (len) NCCL_CHECK(ncclRecv(out + off[j], len, ncclFloat32, j, s->comm, s->stream));
        }
        NCCL_CHECK(ncclGroupEnd());
    }
    free(off);
}

static void nccl_reduce_scatter(lb_comm *c, const void *send, void *recv, size_t count,
                                lb_dtype t)
{
    nccl_state *s = enter(c);
    if (!det_float(c, t, "reduce_scatter")) {
        if (t == LB_BYTE) lb_die("reduce_scatter: bytes cannot be summed");
        NCCL_CHECK(ncclReduceScatter(send, recv, count, nccl_type(t), ncclSum, s->comm,
                                     s->stream));
        return;
    }
    int p = c->size, r = c->rank;
    const float *in = send;
    float *out = recv;
    for (size_t o = 0; o < count; o += lb_comm_piece) {
        size_t len = min_sz(lb_comm_piece, count - o);
        float *st = (float *)stage(c, (size_t)p * len * sizeof(float));
        NCCL_CHECK(ncclGroupStart());
        for (int j = 0; j < p; j++) {
            if (j == r) continue;
            NCCL_CHECK(ncclSend(in + (size_t)j * count + o, len, ncclFloat32, j, s->comm,
                                s->stream));
            NCCL_CHECK(ncclRecv(st + (size_t)j * len, len, ncclFloat32, j, s->comm, s->stream));
        }
        NCCL_CHECK(ncclGroupEnd());
        CUDA_CHECK(cudaMemcpyAsync(st + (size_t)r * len, in + (size_t)r * count + o,
                                   len * sizeof(float), cudaMemcpyDeviceToDevice, s->stream));
        CUDA_CHECK(cudaStreamSynchronize(s->stream));
        sum_in_rank_order(c, out + o, st, len);
    }
}

static void nccl_all_gather(lb_comm *c, const void *send, void *recv, size_t count, lb_dtype t)
{
    nccl_state *s = enter(c);
    NCCL_CHECK(ncclAllGather(send, recv, count, nccl_type(t), s->comm, s->stream));
}

static void nccl_all_to_all_v(lb_comm *c, const void *send, const size_t *send_counts,
                              const size_t *send_displs, void *recv, const size_t *recv_counts,
                              const size_t *recv_displs, lb_dtype t)
{
    nccl_state *s = enter(c);
    int p = c->size, r = c->rank;
    size_t es = lb_dtype_size(t);
    if (send_counts[r] != recv_counts[r])
        lb_die("all_to_all_v: rank %d sends itself %zu elements but expects %zu", r,
               send_counts[r], recv_counts[r]);
    NCCL_CHECK(ncclGroupStart());
    for (int j = 0; j < p; j++) {
        if (j == r) continue;
        if (send_counts[j])
            NCCL_CHECK(ncclSend((const char *)send + send_displs[j] * es, send_counts[j],
                                nccl_type(t), j, s->comm, s->stream));
        if (recv_counts[j])
            NCCL_CHECK(ncclRecv((char *)recv + recv_displs[j] * es, recv_counts[j],
                                nccl_type(t), j, s->comm, s->stream));
    }
    NCCL_CHECK(ncclGroupEnd());
    if (send_counts[r])
        CUDA_CHECK(cudaMemcpyAsync((char *)recv + recv_displs[r] * es,
                                   (const char *)send + send_displs[r] * es, send_counts[r] * es,
                                   cudaMemcpyDeviceToDevice, s->stream));
}

static void nccl_send(lb_comm *c, const void *buf, size_t count, lb_dtype t, int peer)
{
    if (!count) return;
    nccl_state *s = enter(c);
    NCCL_CHECK(ncclSend(buf, count, nccl_type(t), peer, s->comm, s->stream));
}

static void nccl_recv(lb_comm *c, void *buf, size_t count, lb_dtype t, int peer)
{
    if (!count) return;
    nccl_state *s = enter(c);
    NCCL_CHECK(ncclRecv(buf, count, nccl_type(t), peer, s->comm, s->stream));
}

static void nccl_send_recv(lb_comm *c, const void *send, size_t send_count, int dest, void *recv,
                           size_t recv_count, int source, lb_dtype t)
{
    NCCL_CHECK(ncclGroupStart());
    nccl_send(c, send, send_count, t, dest);
    nccl_recv(c, recv, recv_count, t, source);
    NCCL_CHECK(ncclGroupEnd());
}

static void nccl_broadcast(lb_comm *c, void *buf, size_t count, lb_dtype t, int root)
{
    nccl_state *s = enter(c);
    NCCL_CHECK(ncclBroadcast(buf, buf, count, nccl_type(t), root, s->comm, s->stream));
}

static void nccl_sync(lb_comm *c) { CUDA_CHECK(cudaStreamSynchronize(S(c)->stream)); }

static void nccl_barrier(lb_comm *c)
{
    nccl_sync(c);
    LB_MPI_CHECK(MPI_Barrier(S(c)->mpi));
}

static void nccl_destroy(lb_comm *c)
{
    nccl_state *s = S(c);
    if (!s) return;
    CUDA_CHECK(cudaStreamSynchronize(s->stream));
    NCCL_CHECK(ncclCommDestroy(s->comm));
    if (s->stage) CUDA_CHECK(cudaFree(s->stage));
    if (s->own_stream) CUDA_CHECK(cudaStreamDestroy(s->stream));
    LB_MPI_CHECK(MPI_Comm_free(&s->mpi));
    free(s);
    c->impl = c->mpi_comm = NULL;
}

static const lb_comm_ops nccl_ops = {
    .name = "nccl",
    .all_reduce = nccl_all_reduce,
    .reduce_scatter = nccl_reduce_scatter,
    .all_gather = nccl_all_gather,
    .all_to_all_v = nccl_all_to_all_v,
    .send = nccl_send,
    .recv = nccl_recv,
    .send_recv = nccl_send_recv,
    .broadcast = nccl_broadcast,
    .barrier = nccl_barrier,
    .sync = nccl_sync,
    .destroy = nccl_destroy,
};

int lb_comm_nccl_create(lb_comm *out, lb_comm *mpi, lb_backend *be, void *stream, char *err,
                        size_t errlen)
{
    if (!be || !be->add || !be->copy || !be->sync) {
        snprintf(err, errlen, "NCCL communicator: needs the CUDA backend whose memory it uses");
        return -1;
    }
    nccl_state *s = lb_calloc(1, sizeof *s);
    s->be = be;
    LB_MPI_CHECK(MPI_Comm_dup(lb_comm_mpi(mpi), &s->mpi));
    LB_MPI_CHECK(MPI_Comm_set_errhandler(s->mpi, MPI_ERRORS_RETURN));
    if (stream) {
        s->stream = (cudaStream_t)stream;
    } else {
        CUDA_CHECK(cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking));
        s->own_stream = 1;
    }
    ncclUniqueId id;
    if (mpi->rank == 0) NCCL_CHECK(ncclGetUniqueId(&id));
    LB_MPI_CHECK(MPI_Bcast(&id, (int)sizeof id, MPI_BYTE, 0, s->mpi));
    NCCL_CHECK(ncclCommInitRank(&s->comm, mpi->size, id, mpi->rank));
    out->rank = mpi->rank;
    out->size = mpi->size;
    out->mpi_comm = &s->mpi;
    out->ops = &nccl_ops;
    out->deterministic = mpi->deterministic;
    out->impl = s;
    return 0;
}
