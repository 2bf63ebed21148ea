// comm.c: the MPI implementation of the collective interface (host memory), the world and
// sub-communicators, and the host control messages. Every MPI call is checked; a failure names
// the call and ends the whole job through MPI_Abort.
//
// MPI counts are int, and the deterministic reductions stage data: every operation works in
// pieces of at most `piece` elements (lb_comm_mpi_set_piece), so any size works and staging
// memory stays at (ranks x piece) elements.
#include "parallel/comm.h"

#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "lb_autoconf.h"
#include "parallel/comm_impl.h"

// Tags keep internal point-to-point traffic of the collectives apart from lb_comm_send/recv.
enum { TAG_P2P = 1, TAG_COLL = 2 };

size_t lb_comm_piece = (size_t)1 << 22;

void lb_comm_mpi_set_piece(size_t elements)
{
    if (elements < 1 || elements > INT_MAX)
        lb_die("lb_comm_mpi_set_piece: %zu elements", elements);
    lb_comm_piece = elements;
}

size_t lb_dtype_size(lb_dtype t)
{
    switch (t) {
    case LB_F32: return 4;
    case LB_F64: return 8;
    case LB_I32: return 4;
    case LB_I64: return 8;
    case LB_BYTE: return 1;
    }
    lb_die("unknown lb_dtype %d", (int)t);
}

static MPI_Datatype mpi_type(lb_dtype t)
{
    switch (t) {
    case LB_F32: return MPI_FLOAT;
    case LB_F64: return MPI_DOUBLE;
    case LB_I32: return MPI_INT32_T;
    case LB_I64: return MPI_INT64_T;
    case LB_BYTE: return MPI_BYTE;
    }
    lb_die("unknown lb_dtype %d", (int)t);
}

static void need_summable(lb_dtype t, const char *op)
{
    if (t == LB_BYTE) lb_die("%s: bytes cannot be summed (use LB_I32, LB_I64, LB_F32 or LB_F64)", op);
}

static size_t min_sz(size_t a, size_t b) { return a < b ? a : b; }

// State of an MPI communicator: the MPI_Comm (c->mpi_comm points at it) and whether we free it.
typedef struct {
    MPI_Comm comm;
    int owned;
} mpi_state;

// ---------------------------------------------------------------------------------------------
// Point-to-point exchange: the building block of all-to-all-v, the deterministic reductions
// and send_recv. Every message is cut into pieces of at most `piece` elements; sender and
// receiver cut the same count the same way, and MPI keeps messages of one (source, tag) in
// order, so the pieces match.

typedef struct {
    char *buf;
    size_t count;
    int peer;
} xfer;

static size_t npieces(size_t count) { return (count + lb_comm_piece - 1) / lb_comm_piece; }

static void exchange(lb_comm *c, const xfer *sends, int nsend, const xfer *recvs, int nrecv,
                     lb_dtype t, int tag)
{
    MPI_Comm comm = lb_comm_mpi(c);
    MPI_Datatype type = mpi_type(t);
    size_t es = lb_dtype_size(t);
    size_t nreq = 0, nr = 0;
    for (int i = 0; i < nrecv; i++) nr += npieces(recvs[i].count);
    nreq = nr;
    for (int i = 0; i < nsend; i++) nreq += npieces(sends[i].count);
    if (nreq == 0) return;
    MPI_Request *req = lb_malloc(nreq * sizeof *req);
    MPI_Status *st = lb_malloc(nreq * sizeof *st);
    size_t *want = lb_malloc((nr ? nr : 1) * sizeof *want);
    size_t k = 0;
    // Receives first, so every send finds its match posted.
    for (int i = 0; i < nrecv; i++)
        for (size_t o = 0; o < recvs[i].count; o += lb_comm_piece, k++) {
            want[k] = min_sz(lb_comm_piece, recvs[i].count - o);
            LB_MPI_CHECK(MPI_Irecv(recvs[i].buf + o * es, (int)want[k], type, recvs[i].peer, tag,
                                   comm, &req[k]));
        }
    for (int i = 0; i < nsend; i++)
        for (size_t o = 0; o < sends[i].count; o += lb_comm_piece, k++)
            LB_MPI_CHECK(MPI_Isend(sends[i].buf + o * es,
                                   (int)min_sz(lb_comm_piece, sends[i].count - o), type,
                                   sends[i].peer, tag, comm, &req[k]));
    LB_MPI_CHECK(MPI_Waitall((int)nreq, req, st));
    // A sender that disagrees on a count is a bug in the caller: say so rather than compute on
    // a half-filled buffer.
    for (size_t i = 0; i < nr; i++) {
        int got = 0;
        LB_MPI_CHECK(MPI_Get_count(&st[i], type, &got));
        if ((size_t)got != want[i])
            lb_die("rank %d: expected %zu elements from rank %d, received %d (the ranks disagree "
                   "on a count)", c->rank, want[i], st[i].MPI_SOURCE, got);
    }
    free(want);
    free(st);
    free(req);
}

// dst (len) = stage[0] + stage[1] + ... + stage[p-1], left to right in the element type:
// the serial rank-order sum, whatever order the chunks arrived in.
static void sum_in_rank_order(void *dst, const char *stage, int p, size_t len, lb_dtype t)
{
    size_t es = lb_dtype_size(t);
    memcpy(dst, stage, len * es);
#define ADD(T)                                                                                \
    do {                                                                                      \
        T *y = dst;                                                                           \
        const T *s = x;                                                                       \
        for (size_t i = 0; i < len; i++) y[i] += s[i];                                        \
    } while (0)
    for (int j = 1; j < p; j++) {
        const void *x = stage + (size_t)j * len * es;
        switch (t) {
        case LB_F32: ADD(float); break;
        case LB_F64: ADD(double); break;
        case LB_I32: ADD(int32_t); break;
        case LB_I64: ADD(int64_t); break;
        case LB_BYTE: lb_die("bytes cannot be summed");
        }
    }
#undef ADD
}

// ---------------------------------------------------------------------------------------------
// The operations

// Deterministic all-reduce of [o, o + n): chunk j of the range goes to rank j, which sums the
// p copies in rank order; then every rank gathers every reduced chunk.
static void det_all_reduce_range(lb_comm *c, const char *send, char *recv, size_t n, lb_dtype t,
                                 char *stage)
{
    int p = c->size, r = c->rank;
    size_t es = lb_dtype_size(t);
    size_t *off = lb_malloc(((size_t)p + 1) * sizeof *off);
    for (int j = 0; j <= p; j++) off[j] = n * (size_t)j / (size_t)p;
    size_t mine = off[r + 1] - off[r];
    xfer *s = lb_malloc((size_t)p * sizeof *s), *q = lb_malloc((size_t)p * sizeof *q);
    int k = 0;
    for (int j = 0; j < p; j++)
        if (j != r) {
            s[k] = (xfer){(char *)send + off[j] * es, off[j + 1] - off[j], j};
            q[k] = (xfer){stage + (size_t)j * mine * es, mine, j};
            k++;
        }
    exchange(c, s, k, q, k, t, TAG_COLL);
    memcpy(stage + (size_t)r * mine * es, send + off[r] * es, mine * es);
    sum_in_rank_order(recv + off[r] * es, stage, p, mine, t);
    k = 0;
    for (int j = 0; j < p; j++)
        if (j != r) {
            s[k] = (xfer){recv + off[r] * es, mine, j};
            q[k] = (xfer){recv + off[j] * es, off[j + 1] - off[j], j};
            k++;
        }
    exchange(c, s, k, q, k, t, TAG_COLL);
    free(s);
    free(q);
    free(off);
}

static void mpi_all_reduce(lb_comm *c, const void *send, void *recv, size_t count, lb_dtype t)
{
    need_summable(t, "all_reduce");
    size_t es = lb_dtype_size(t);
    if (c->size == 1) {
        if (send != recv) memmove(recv, send, count * es);
        return;
    }
    if (c->deterministic && (t == LB_F32 || t == LB_F64)) {
        size_t span = lb_comm_piece * (size_t)c->size;   // each rank reduces at most a piece
        size_t chunk = min_sz(lb_comm_piece, (count + c->size - 1) / c->size);
        char *stage = lb_malloc(chunk * c->size * es + 1);
        for (size_t o = 0; o < count; o += span)
            det_all_reduce_range(c, (const char *)send + o * es, (char *)recv + o * es,
                                 min_sz(span, count - o), t, stage);
        free(stage);
        return;
    }
    for (size_t o = 0; o < count; o += lb_comm_piece) {
        int n = (int)min_sz(lb_comm_piece, count - o);
        const void *s = send == recv ? MPI_IN_PLACE : (const char *)send + o * es;
        LB_MPI_CHECK(MPI_Allreduce(s, (char *)recv + o * es, n, mpi_type(t), MPI_SUM,
                                   lb_comm_mpi(c)));
    }
}

static void mpi_reduce_scatter(lb_comm *c, const void *send, void *recv, size_t count, lb_dtype t)
{
    need_summable(t, "reduce_scatter");
    int p = c->size, r = c->rank;
    size_t es = lb_dtype_size(t);
    const char *in = send;
    if (p == 1) {
        memmove(recv, send, count * es);
        return;
    }
    size_t len0 = min_sz(lb_comm_piece, count);
    char *stage = lb_malloc(len0 * (size_t)p * es + 1);
    int det = c->deterministic && (t == LB_F32 || t == LB_F64);
    for (size_t o = 0; o < count; o += lb_comm_piece) {
        size_t len = min_sz(lb_comm_piece, count - o);
        if (det) {
            // Rank j's block [j count + o, + len) goes to rank j; this rank sums the p copies
            // of its own block in rank order.
            xfer *s = lb_malloc((size_t)p * sizeof *s), *q = lb_malloc((size_t)p * sizeof *q);
            int k = 0;
            for (int j = 0; j < p; j++)
                if (j != r) {
                    s[k] = (xfer){(char *)in + ((size_t)j * count + o) * es, len, j};
                    q[k] = (xfer){stage + (size_t)j * len * es, len, j};
                    k++;
                }
            exchange(c, s, k, q, k, t, TAG_COLL);
            memcpy(stage + (size_t)r * len * es, in + ((size_t)r * count + o) * es, len * es);
            sum_in_rank_order((char *)recv + o * es, stage, p, len, t);
            free(s);
            free(q);
        } else if (len == count) {
            LB_MPI_CHECK(MPI_Reduce_scatter_block(send, recv, (int)count, mpi_type(t), MPI_SUM,
                                                  lb_comm_mpi(c)));
        } else {
            for (int j = 0; j < p; j++)
                memcpy(stage + (size_t)j * len * es, in + ((size_t)j * count + o) * es, len * es);
            LB_MPI_CHECK(MPI_Reduce_scatter_block(stage, (char *)recv + o * es, (int)len,
                                                  mpi_type(t), MPI_SUM, lb_comm_mpi(c)));
        }
    }
    free(stage);
}

static void mpi_all_gather(lb_comm *c, const void *send, void *recv, size_t count, lb_dtype t)
{
    int p = c->size, r = c->rank;
    size_t es = lb_dtype_size(t);
    char *out = recv;
    int in_place = send == out + (size_t)r * count * es;
    if (count <= lb_comm_piece) {
        LB_MPI_CHECK(MPI_Allgather(in_place ? MPI_IN_PLACE : send, (int)count, mpi_type(t), recv,
                                   (int)count, mpi_type(t), lb_comm_mpi(c)));
        return;
    }
    // Large blocks: gather piece by piece into a staging buffer, then put each rank's piece in
    // its place (a rank's block is not contiguous in one piece's view).
    char *stage = lb_malloc(lb_comm_piece * (size_t)p * es);
    for (size_t o = 0; o < count; o += lb_comm_piece) {
        size_t len = min_sz(lb_comm_piece, count - o);
        LB_MPI_CHECK(MPI_Allgather((const char *)send + o * es, (int)len, mpi_type(t), stage,
                                   (int)len, mpi_type(t), lb_comm_mpi(c)));
        for (int j = 0; j < p; j++)
            memcpy(out + ((size_t)j * count + o) * es, stage + (size_t)j * len * es, len * es);
    }
    free(stage);
}

static void mpi_all_to_all_v(lb_comm *c, const void *send, const size_t *send_counts,
                             const size_t *send_displs, void *recv, const size_t *recv_counts,
                             const size_t *recv_displs, lb_dtype t)
{
    int p = c->size, r = c->rank;
    size_t es = lb_dtype_size(t);
    if (send_counts[r] != recv_counts[r])
        lb_die("all_to_all_v: rank %d sends itself %zu elements but expects %zu", r,
               send_counts[r], recv_counts[r]);
    xfer *s = lb_malloc((size_t)p * sizeof *s), *q = lb_malloc((size_t)p * sizeof *q);
    int k = 0;
    for (int j = 0; j < p; j++)
        if (j != r) {
            s[k] = (xfer){(char *)send + send_displs[j] * es, send_counts[j], j};
            q[k] = (xfer){(char *)recv + recv_displs[j] * es, recv_counts[j], j};
            k++;
        }
    exchange(c, s, k, q, k, t, TAG_COLL);
    memmove((char *)recv + recv_displs[r] * es, (const char *)send + send_displs[r] * es,
            send_counts[r] * es);
    free(s);
    free(q);
}

static void mpi_send(lb_comm *c, const void *buf, size_t count, lb_dtype t, int peer)
{
    size_t es = lb_dtype_size(t);
    for (size_t o = 0; o < count; o += lb_comm_piece)
        LB_MPI_CHECK(MPI_Send((const char *)buf + o * es, (int)min_sz(lb_comm_piece, count - o),
                              mpi_type(t), peer, TAG_P2P, lb_comm_mpi(c)));
}

static void mpi_recv(lb_comm *c, void *buf, size_t count, lb_dtype t, int peer)
{
    xfer q = {buf, count, peer};
    exchange(c, NULL, 0, &q, 1, t, TAG_P2P);
}

static void mpi_send_recv(lb_comm *c, const void *send, size_t send_count, int dest, void *recv,
                          size_t recv_count, int source, lb_dtype t)
{
    xfer s = {(char *)send, send_count, dest}, q = {recv, recv_count, source};
    exchange(c, &s, 1, &q, 1, t, TAG_P2P);
}

static void mpi_broadcast(lb_comm *c, void *buf, size_t count, lb_dtype t, int root)
{
    size_t es = lb_dtype_size(t);
    for (size_t o = 0; o < count; o += lb_comm_piece)
        LB_MPI_CHECK(MPI_Bcast((char *)buf + o * es, (int)min_sz(lb_comm_piece, count - o),
                               mpi_type(t), root, lb_comm_mpi(c)));
}

static void mpi_barrier(lb_comm *c) { LB_MPI_CHECK(MPI_Barrier(lb_comm_mpi(c))); }
static void mpi_sync(lb_comm *c) {}

static void mpi_destroy(lb_comm *c)
{
    mpi_state *s = c->impl;
    if (s && s->owned) LB_MPI_CHECK(MPI_Comm_free(&s->comm));
    free(s);
    c->impl = c->mpi_comm = NULL;
}

static const lb_comm_ops mpi_ops = {
    .name = "mpi",
    .all_reduce = mpi_all_reduce,
    .reduce_scatter = mpi_reduce_scatter,
    .all_gather = mpi_all_gather,
    .all_to_all_v = mpi_all_to_all_v,
    .send = mpi_send,
    .recv = mpi_recv,
    .send_recv = mpi_send_recv,
    .broadcast = mpi_broadcast,
    .barrier = mpi_barrier,
    .sync = mpi_sync,
    .destroy = mpi_destroy,
};

// ---------------------------------------------------------------------------------------------
// World and sub-communicators

static void wrap(lb_comm *c, MPI_Comm comm, int owned, int deterministic)
{
    mpi_state *s = lb_malloc(sizeof *s);
    s->comm = comm;
    s->owned = owned;
    // Errors come back as codes so LB_MPI_CHECK can report file:line before aborting.
    LB_MPI_CHECK(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
    LB_MPI_CHECK(MPI_Comm_rank(comm, &c->rank));
    LB_MPI_CHECK(MPI_Comm_size(comm, &c->size));
    c->mpi_comm = &s->comm;
    c->impl = s;
    c->ops = &mpi_ops;
    c->deterministic = deterministic;
}

// The failure path itself: its MPI calls are not checked (a failing check would come back here).
static void abort_job(int code)
{
    int up = 0, down = 0;
    MPI_Initialized(&up);
    MPI_Finalized(&down);
    if (up && !down) {
        int size = 1;
        MPI_Comm_size(MPI_COMM_WORLD, &size);
        if (size > 1) MPI_Abort(MPI_COMM_WORLD, code ? code : 1);
        MPI_Finalize();   // alone: a clean exit with the code, no abort banner
    }
}

void lb_comm_init(lb_comm *c, int *argc, char ***argv)
{
    LB_MPI_CHECK(MPI_Init(argc, argv));
    wrap(c, MPI_COMM_WORLD, 0, 1);
    lb_set_abort_hook(abort_job);
}

void lb_comm_finalize(lb_comm *c)
{
    lb_comm_free(c);
    lb_set_abort_hook(NULL);
    LB_MPI_CHECK(MPI_Finalize());
}

void lb_comm_split(lb_comm *parent, int color, int key, lb_comm *out)
{
    MPI_Comm comm;
    LB_MPI_CHECK(MPI_Comm_split(lb_comm_mpi(parent), color, key, &comm));
    wrap(out, comm, 1, parent->deterministic);
}

void lb_comm_free(lb_comm *c)
{
    if (c && c->ops) c->ops->destroy(c);
}

int lb_comm_local_rank(lb_comm *c)
{
    MPI_Comm node;
    int r = 0;
    LB_MPI_CHECK(MPI_Comm_split_type(lb_comm_mpi(c), MPI_COMM_TYPE_SHARED, c->rank,
                                     MPI_INFO_NULL, &node));
    LB_MPI_CHECK(MPI_Comm_rank(node, &r));
    LB_MPI_CHECK(MPI_Comm_free(&node));
    return r;
}

int lb_comm_node(lb_comm *c)
{
    MPI_Comm node;
    int first = c->rank;
    LB_MPI_CHECK(MPI_Comm_split_type(lb_comm_mpi(c), MPI_COMM_TYPE_SHARED, c->rank,
                                     MPI_INFO_NULL, &node));
    LB_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &first, 1, MPI_INT, MPI_MIN, node));
    LB_MPI_CHECK(MPI_Comm_free(&node));
    return first;
}

int lb_comm_spans_nodes(lb_comm *c, int node)
{
    int lo = node, hi = node;
    LB_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &lo, 1, MPI_INT, MPI_MIN, lb_comm_mpi(c)));
    LB_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &hi, 1, MPI_INT, MPI_MAX, lb_comm_mpi(c)));
    return lo != hi;
}

// ---------------------------------------------------------------------------------------------
// Host control messages

void lb_comm_bcast(lb_comm *c, void *buf, size_t bytes, int root)
{
    const size_t chunk = (size_t)1 << 30;   // MPI counts are int
    for (size_t off = 0; off < bytes; off += chunk)
        LB_MPI_CHECK(MPI_Bcast((char *)buf + off, (int)min_sz(chunk, bytes - off), MPI_BYTE, root,
                               lb_comm_mpi(c)));
}

void lb_comm_host_all_gather(lb_comm *c, const void *send, void *recv, size_t bytes)
{
    if (bytes > (size_t)1 << 30) lb_die("host all-gather of %zu bytes: control messages only", bytes);
    LB_MPI_CHECK(MPI_Allgather(send, (int)bytes, MPI_BYTE, recv, (int)bytes, MPI_BYTE,
                               lb_comm_mpi(c)));
}

double lb_comm_allreduce_sum(lb_comm *c, double x)
{
    if (!c->deterministic) {
        double out = 0.0;
        LB_MPI_CHECK(MPI_Allreduce(&x, &out, 1, MPI_DOUBLE, MPI_SUM, lb_comm_mpi(c)));
        return out;
    }
    double *all = lb_malloc((size_t)c->size * sizeof *all);
    LB_MPI_CHECK(MPI_Allgather(&x, 1, MPI_DOUBLE, all, 1, MPI_DOUBLE, lb_comm_mpi(c)));
    double sum = all[0];
    for (int j = 1; j < c->size; j++) sum += all[j];
    free(all);
    return sum;
}

#ifndef LB_HAVE_CUDA
int lb_comm_nccl_create(lb_comm *out, lb_comm *mpi, struct lb_backend *be, void *stream,
                        char *err, size_t errlen)
{
    snprintf(err, errlen, "NCCL is not built: configure found no CUDA toolkit (nvcc)");
    return -1;
}
#endif
