// test_comm.c: the collective interface (parallel/comm.h) against serial computations, on any
// number of ranks: all-reduce, reduce-scatter, all-gather, all-to-all-v with uneven and zero
// counts, send/recv and send_recv, broadcast, barrier, the host helpers and the token
// dispatcher built on them (parallel/dispatcher.h), in deterministic
// mode (results bitwise equal to the serial rank-order sum) and in the library's mode (within
// rounding), over the world and over sub-communicators from lb_comm_split, and with a tiny
// piece size so every piecewise path runs.
//
//   test_comm          the MPI implementation (host memory), any number of ranks (make check
//                      runs it alone; tests/test_comm.sh runs it on 3 and 4 ranks)
//   test_comm nccl     the NCCL implementation on CUDA-backend memory, one GPU per rank
//                      (tests/test_comm_nccl.sh; exits 77 when lowbit has no CUDA)
//   test_comm gpus     prints the number of visible GPUs (for the shell test)
//
// Plain C rather than a Check suite: a failed assertion on one rank would leave the others
// waiting in the next collective, so a failure here prints rank, file:line and what differs
// and ends the whole job through MPI_Abort (lb_die).
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "lb_autoconf.h"
#include "kernels/common.h"
#include "kernels/kernels.h"
#include "parallel/comm.h"
#include "parallel/dispatcher.h"

#ifdef LB_HAVE_CUDA
int lb_cuda_device_count(void);
#endif

static long nchecks;
static const char *mode_name = "";
static int world_rank;

#define CHECK(cond, ...)                                                                      \
    do {                                                                                      \
        nchecks++;                                                                            \
        if (!(cond)) {                                                                        \
            char m_[512];                                                                     \
            snprintf(m_, sizeof m_, __VA_ARGS__);                                             \
            lb_die_at(__FILE__, __LINE__, "rank %d [%s]: check failed: %s", world_rank,      \
                      mode_name, m_);                                                         \
        }                                                                                     \
    } while (0)

// The value element i of group rank j contributes (different per rank, dtype and salt).
static double value(lb_dtype t, int j, size_t i, uint64_t salt)
{
    double x = lb_rand_normal(salt, (uint64_t)j, i);
    switch (t) {
    case LB_F32: return (float)x;
    case LB_F64: return x;
    case LB_I32: case LB_I64: return floor(x * 1000.0);
    case LB_BYTE: return (double)(lb_rand_u64(salt, (uint64_t)j, i) & 0xff);
    }
    return 0;
}

static void put(void *buf, lb_dtype t, size_t i, double v)
{
    switch (t) {
    case LB_F32: ((float *)buf)[i] = (float)v; break;
    case LB_F64: ((double *)buf)[i] = v; break;
    case LB_I32: ((int32_t *)buf)[i] = (int32_t)v; break;
    case LB_I64: ((int64_t *)buf)[i] = (int64_t)v; break;
    case LB_BYTE: ((uint8_t *)buf)[i] = (uint8_t)v; break;
    }
}

static double get(const void *buf, lb_dtype t, size_t i)
{
    switch (t) {
    case LB_F32: return ((const float *)buf)[i];
    case LB_F64: return ((const double *)buf)[i];
    case LB_I32: return ((const int32_t *)buf)[i];
    case LB_I64: return (double)((const int64_t *)buf)[i];
    case LB_BYTE: return ((const uint8_t *)buf)[i];
    }
    return 0;
}

// Fills host[0, n) with rank j's values of elements [first, first + n).
static void fill(void *host, lb_dtype t, int j, size_t first, size_t n, uint64_t salt)
{
    for (size_t i = 0; i < n; i++) put(host, t, i, value(t, j, first + i, salt));
}

// The serial rank-order sum ((x_0 + x_1) + x_2) + ... of element i, in the element type.
static void serial_sum(void *out, lb_dtype t, int p, size_t first, size_t n, uint64_t salt)
{
    for (size_t i = 0; i < n; i++) {
        float f = 0;
        double d = 0;
        int64_t k = 0;
        for (int j = 0; j < p; j++) {
            double v = value(t, j, first + i, salt);
            if (t == LB_F32) f = j ? f + (float)v : (float)v;
            else if (t == LB_F64) d = j ? d + v : v;
            else k += (int64_t)v;
        }
        put(out, t, i, t == LB_F32 ? f : t == LB_F64 ? d : (double)k);
    }
}

// Deterministic float sums must equal the serial sum bitwise; the library's within rounding
// (scaled by the sum of magnitudes); integer sums exactly.
static void expect_sum(lb_comm *c, const void *got, const void *want, lb_dtype t, int p,
                       size_t first, size_t n, uint64_t salt, const char *op)
{
    size_t es = lb_dtype_size(t);
    int exact = c->deterministic || t == LB_I32 || t == LB_I64;
    if (exact) {
        for (size_t i = 0; i < n; i++)
            CHECK(memcmp((const char *)got + i * es, (const char *)want + i * es, es) == 0,
                  "%s (%s, %d ranks, deterministic %d): element %zu is %.9g, the serial sum is "
                  "%.9g", op, c->ops->name, p, c->deterministic, first + i, get(got, t, i),
                  get(want, t, i));
        return;
    }
    for (size_t i = 0; i < n; i++) {
        double mag = 0;
        for (int j = 0; j < p; j++) mag += fabs(value(t, j, first + i, salt));
        double eps = t == LB_F32 ? 1e-6 : 1e-14;
        CHECK(fabs(get(got, t, i) - get(want, t, i)) <= eps * p * mag + 1e-30,
              "%s (%s, %d ranks): element %zu is %.9g, the serial sum is %.9g", op, c->ops->name,
              p, first + i, get(got, t, i), get(want, t, i));
    }
}

typedef struct {
    lb_comm *c;
    lb_backend *be;
} ctx;

static void *dev(ctx *x, size_t bytes) { return x->be->alloc(x->be, bytes ? bytes : 1); }
static void up(ctx *x, void *d, const void *h, size_t bytes)
{
    if (bytes) x->be->upload(x->be, d, h, bytes);
    x->be->sync(x->be);
}
static void down(ctx *x, void *h, const void *d, size_t bytes)
{
    lb_comm_sync(x->c);   // the communicator's stream may not be the backend's
    if (bytes) x->be->download(x->be, h, d, bytes);
}

static void test_all_reduce(ctx *x, lb_dtype t, size_t n, int in_place, uint64_t salt)
{
    lb_comm *c = x->c;
    size_t es = lb_dtype_size(t), bytes = n * es;
    void *h = lb_malloc(bytes + 1), *want = lb_malloc(bytes + 1);
    void *s = dev(x, bytes), *r = in_place ? s : dev(x, bytes);
    fill(h, t, c->rank, 0, n, salt);
    up(x, s, h, bytes);
    lb_comm_all_reduce(c, s, r, n, t);
    down(x, h, r, bytes);
    serial_sum(want, t, c->size, 0, n, salt);
    expect_sum(c, h, want, t, c->size, 0, n, salt, in_place ? "all_reduce in place" : "all_reduce");
    x->be->free(x->be, s);
    if (!in_place) x->be->free(x->be, r);
    free(h);
    free(want);
}

static void test_reduce_scatter(ctx *x, lb_dtype t, size_t n, uint64_t salt)
{
    lb_comm *c = x->c;
    int p = c->size;
    size_t es = lb_dtype_size(t);
    void *h = lb_malloc(n * p * es + 1), *want = lb_malloc(n * es + 1);
    void *s = dev(x, n * p * es), *r = dev(x, n * es);
    fill(h, t, c->rank, 0, n * p, salt);
    up(x, s, h, n * p * es);
    lb_comm_reduce_scatter(c, s, r, n, t);
    down(x, h, r, n * es);
    serial_sum(want, t, p, (size_t)c->rank * n, n, salt);
    expect_sum(c, h, want, t, p, (size_t)c->rank * n, n, salt, "reduce_scatter");
    x->be->free(x->be, s);
    x->be->free(x->be, r);
    free(h);
    free(want);
}

static void test_all_gather(ctx *x, lb_dtype t, size_t n, int in_place, uint64_t salt)
{
    lb_comm *c = x->c;
    int p = c->size;
    size_t es = lb_dtype_size(t);
    void *h = lb_malloc(n * p * es + 1), *want = lb_malloc(n * p * es + 1);
    void *r = dev(x, n * p * es);
    void *s = in_place ? (char *)r + (size_t)c->rank * n * es : dev(x, n * es);
    fill(h, t, c->rank, 0, n, salt);
    up(x, s, h, n * es);
    lb_comm_all_gather(c, s, r, n, t);
    down(x, h, r, n * p * es);
    for (int j = 0; j < p; j++) fill((char *)want + (size_t)j * n * es, t, j, 0, n, salt);
    CHECK(memcmp(h, want, n * p * es) == 0, "all_gather (%s, %d ranks, %zu per rank, in place %d)",
          c->ops->name, p, n, in_place);
    if (!in_place) x->be->free(x->be, s);
    x->be->free(x->be, r);
    free(h);
    free(want);
}

// Elements rank i sends rank j: uneven, some zero.
static size_t a2a_count(int i, int j, size_t scale) { return (size_t)((i * 7 + j * 3) % 5) * scale; }

static void test_all_to_all_v(ctx *x, lb_dtype t, size_t scale)
{
    lb_comm *c = x->c;
    int p = c->size, r = c->rank;
    size_t es = lb_dtype_size(t);
    size_t *sc = lb_malloc(p * sizeof *sc), *sd = lb_malloc(p * sizeof *sd);
    size_t *rc = lb_malloc(p * sizeof *rc), *rd = lb_malloc(p * sizeof *rd);
    size_t stot = 0, rtot = 0;
    // Send blocks in reverse rank order with a gap of 2 between them; receive blocks packed.
    for (int j = p - 1; j >= 0; j--) {
        sc[j] = a2a_count(r, j, scale);
        sd[j] = stot;
        stot += sc[j] + 2;
    }
    for (int i = 0; i < p; i++) {
        rc[i] = a2a_count(i, r, scale);
        rd[i] = rtot;
        rtot += rc[i];
    }
    // Element k of the block from i to j holds i * 1e6 + j * 1e3 + k (exact in every dtype but
    // bytes, which wrap the same way on both sides).
    void *h = lb_malloc(stot * es + 1), *want = lb_malloc(rtot * es + 1), *got = lb_malloc(rtot * es + 1);
    memset(h, 0, stot * es + 1);
    for (int j = 0; j < p; j++)
        for (size_t k = 0; k < sc[j]; k++) put(h, t, sd[j] + k, r * 1e6 + j * 1e3 + (double)k);
    for (int i = 0; i < p; i++)
        for (size_t k = 0; k < rc[i]; k++) put(want, t, rd[i] + k, i * 1e6 + r * 1e3 + (double)k);
    void *s = dev(x, stot * es), *d = dev(x, rtot * es);
    up(x, s, h, stot * es);
    lb_comm_all_to_all_v(c, s, sc, sd, d, rc, rd, t);
    down(x, got, d, rtot * es);
    CHECK(memcmp(got, want, rtot * es) == 0, "all_to_all_v (%s, %d ranks, scale %zu)",
          c->ops->name, p, scale);
    x->be->free(x->be, s);
    x->be->free(x->be, d);
    free(h);
    free(want);
    free(got);
    free(sc);
    free(sd);
    free(rc);
    free(rd);
}

static void test_p2p(ctx *x, size_t base, uint64_t salt)
{
    lb_comm *c = x->c;
    int p = c->size, r = c->rank;
    lb_dtype t = LB_F32;
    // A ring with send_recv: rank s sends base + 3 s elements to s + 1.
    int to = (r + 1) % p, from = (r + p - 1) % p;
    size_t ns = base + 3 * (size_t)r, nr = base + 3 * (size_t)from;
    float *h = lb_malloc((ns + nr + 1) * sizeof *h), *want = lb_malloc((nr + 1) * sizeof *want);
    fill(h, t, r, 0, ns, salt);
    fill(want, t, from, 0, nr, salt);
    float *s = dev(x, ns * 4), *d = dev(x, nr * 4);
    up(x, s, h, ns * 4);
    lb_comm_send_recv(c, s, ns, to, d, nr, from, t);
    down(x, h, d, nr * 4);
    CHECK(memcmp(h, want, nr * 4) == 0, "send_recv ring (%s, %d ranks): from rank %d",
          c->ops->name, p, from);
    // Blocking send and recv in pairs (0, 1), (2, 3), ...: the even rank sends first.
    int peer = r ^ 1;
    if (peer < p) {
        size_t mine = base + 5 * (size_t)r, theirs = base + 5 * (size_t)peer;
        float *hs = lb_malloc((mine + 1) * 4), *hr = lb_malloc((theirs + 1) * 4);
        float *w2 = lb_malloc((theirs + 1) * 4);
        fill(hs, t, r, 0, mine, salt + 1);
        fill(w2, t, peer, 0, theirs, salt + 1);
        float *ds = dev(x, mine * 4), *dr = dev(x, theirs * 4);
        up(x, ds, hs, mine * 4);
        if (r % 2 == 0) {
            lb_comm_send(c, ds, mine, t, peer);
            lb_comm_recv(c, dr, theirs, t, peer);
        } else {
            lb_comm_recv(c, dr, theirs, t, peer);
            lb_comm_send(c, ds, mine, t, peer);
        }
        down(x, hr, dr, theirs * 4);
        CHECK(memcmp(hr, w2, theirs * 4) == 0, "send/recv (%s): rank %d from %d", c->ops->name,
              r, peer);
        x->be->free(x->be, ds);
        x->be->free(x->be, dr);
        free(hs);
        free(hr);
        free(w2);
    }
    x->be->free(x->be, s);
    x->be->free(x->be, d);
    free(h);
    free(want);
}

static void test_broadcast(ctx *x, lb_dtype t, size_t n, uint64_t salt)
{
    lb_comm *c = x->c;
    size_t es = lb_dtype_size(t);
    for (int root = 0; root < c->size; root++) {
        void *h = lb_malloc(n * es + 1), *want = lb_malloc(n * es + 1);
        fill(h, t, c->rank, 0, n, salt);      // every rank starts with its own values
        fill(want, t, root, 0, n, salt);
        void *d = dev(x, n * es);
        up(x, d, h, n * es);
        lb_comm_broadcast(c, d, n, t, root);
        down(x, h, d, n * es);
        CHECK(memcmp(h, want, n * es) == 0, "broadcast (%s) from root %d", c->ops->name, root);
        x->be->free(x->be, d);
        free(h);
        free(want);
    }
}

static void test_host(lb_comm *c)
{
    // lb_comm_allreduce_sum in rank order; lb_comm_bcast of bytes.
    double want = 0;
    for (int j = 0; j < c->size; j++) want = j ? want + value(LB_F64, j, 0, 99) : value(LB_F64, j, 0, 99);
    double got = lb_comm_allreduce_sum(c, value(LB_F64, c->rank, 0, 99));
    if (c->deterministic) CHECK(got == want, "allreduce_sum %.17g, serial %.17g", got, want);
    else CHECK(fabs(got - want) <= 1e-12 * c->size, "allreduce_sum %.17g, serial %.17g", got, want);
    char text[64];
    snprintf(text, sizeof text, "from rank %d", c->rank);
    lb_comm_bcast(c, text, sizeof text, c->size - 1);
    char expect[64];
    snprintf(expect, sizeof expect, "from rank %d", c->size - 1);
    CHECK(strcmp(text, expect) == 0, "bcast gave '%s'", text);
    lb_comm_barrier(c);
}

// The token dispatcher (parallel/dispatcher.h): rank s holds count(s, e) rows for expert e in
// moe_plan order (expert-major), some ranks none at all; every row carries (source, expert,
// index, column) exactly in its values. After dispatch, rank r holds its experts' rows
// expert-major, source rank next, in each source's order; combine brings rows back to their
// senders, in their places.
static int d_count(int s, int e, uint64_t salt)
{
    if ((salt & 1) && s == 0) return 0;   // a rank that sends nothing
    return (int)((s * 5 + e * 3 + salt) % 4) * (int)(1 + salt % 3);
}
static float d_value(int s, int e, int i, int col)
{
    return (float)((((s * 64 + e) * 64 + i) * 8) + col);   // exact in fp32
}

static void test_dispatch(ctx *x, int per_rank, uint64_t salt)
{
    lb_comm *c = x->c;
    const int P = c->size, me = c->rank, E = per_rank * P, C = 5;
    int *counts = lb_malloc((size_t)E * sizeof *counts), nsend = 0, nrecv = 0;
    for (int e = 0; e < E; e++) nsend += counts[e] = d_count(me, e, salt);
    for (int s = 0; s < P; s++)
        for (int e = me * per_rank; e < (me + 1) * per_rank; e++) nrecv += d_count(s, e, salt);
    float *h = lb_malloc(((size_t)(nsend > nrecv ? nsend : nrecv) + 1) * C * sizeof(float));
    for (int e = 0, r = 0; e < E; e++)
        for (int i = 0; i < counts[e]; i++, r++)
            for (int k = 0; k < C; k++) h[(size_t)r * C + k] = d_value(me, e, i, k);
    size_t big = (size_t)(nsend > nrecv ? nsend : nrecv) * C * sizeof(float);
    float *xs = dev(x, (size_t)nsend * C * sizeof(float)), *xe = dev(x, (size_t)nrecv * C * sizeof(float));
    float *back = dev(x, (size_t)nsend * C * sizeof(float)), *scratch = dev(x, big);
    up(x, xs, h, (size_t)nsend * C * sizeof(float));
    lb_ep_route r;
    memset(&r, 0, sizeof r);
    lb_ep_route_plan(&r, P > 1 ? c : NULL, x->be, counts, E);
    CHECK(r.nsend == nsend && r.nrecv == nrecv, "dispatch plan: %d/%d rows out, %d/%d in", r.nsend,
          nsend, r.nrecv, nrecv);
    lb_ep_dispatch(&r, P > 1 ? c : NULL, x->be, xs, xe, scratch, C);
    down(x, h, xe, (size_t)nrecv * C * sizeof(float));
    size_t row = 0;
    for (int le = 0; le < per_rank; le++) {
        int e = me * per_rank + le, want = 0;
        for (int s = 0; s < P; s++) {
            want += d_count(s, e, salt);
            for (int i = 0; i < d_count(s, e, salt); i++, row++)
                for (int k = 0; k < C; k++)
                    CHECK(h[row * C + k] == d_value(s, e, i, k),
                          "dispatch: row %zu column %d is %.1f, expected source %d expert %d row %d",
                          row, k, h[row * C + k], s, e, i);
        }
        CHECK(r.local_counts[le] == want, "dispatch: expert %d has %d rows, expected %d", e,
              r.local_counts[le], want);
    }
    lb_ep_combine(&r, P > 1 ? c : NULL, x->be, xe, back, scratch, C);
    down(x, h, back, (size_t)nsend * C * sizeof(float));
    for (int e = 0, q = 0; e < E; e++)
        for (int i = 0; i < counts[e]; i++, q++)
            for (int k = 0; k < C; k++)
                CHECK(h[(size_t)q * C + k] == d_value(me, e, i, k),
                      "combine: row %d of expert %d came back as %.1f", i, e, h[(size_t)q * C + k]);
    lb_ep_route_free(&r, x->be);
    x->be->free(x->be, xs);
    x->be->free(x->be, xe);
    x->be->free(x->be, back);
    x->be->free(x->be, scratch);
    free(h);
    free(counts);
}

static void suite(ctx *x, int nccl)
{
    lb_comm *c = x->c;
    static const size_t sizes[] = {0, 1, 7, 1000, 4099};
    static const lb_dtype sums[] = {LB_F32, LB_F64, LB_I32, LB_I64};
    for (int det = 1; det >= 0; det--) {
        c->deterministic = det;
        for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
            size_t n = sizes[k];
            for (size_t d = 0; d < sizeof sums / sizeof sums[0]; d++) {
                if (nccl && det && sums[d] == LB_F64) continue;   // not on the device (comm_nccl.c)
                test_all_reduce(x, sums[d], n, 0, 10 + k);
                test_all_reduce(x, sums[d], n, 1, 20 + k);
                test_reduce_scatter(x, sums[d], n, 30 + k);
            }
            test_all_gather(x, LB_F32, n, 0, 40 + k);
            test_all_gather(x, LB_I64, n, 1, 50 + k);
            test_broadcast(x, LB_F32, n, 60 + k);
            test_broadcast(x, LB_BYTE, n, 70 + k);
        }
        test_all_to_all_v(x, LB_F32, 1);
        test_all_to_all_v(x, LB_I32, 37);
        test_all_to_all_v(x, LB_F64, 1000);
        test_p2p(x, 0, 80);
        test_p2p(x, 11, 81);
        test_p2p(x, 3000, 82);
        test_host(c);
        for (uint64_t salt = 0; salt < 4; salt++) test_dispatch(x, 1 + (int)salt % 3, salt);
    }
    c->deterministic = 1;
}

// Every layout of the suite: the communicator itself, then sub-communicators of it (odd and
// even ranks, ordered by descending rank, so the key decides the group order).
static void run_all(lb_comm *world, lb_backend *be, int nccl)
{
    lb_comm dc;
    lb_comm *c = world;
    if (nccl) {
        char err[256];
        if (lb_comm_nccl_create(&dc, world, be, NULL, err, sizeof err) != 0) lb_die("%s", err);
        c = &dc;
    }
    ctx x = {c, be};
    suite(&x, nccl);
    if (nccl) lb_comm_free(&dc);

    lb_comm sub;
    lb_comm_split(world, world->rank % 2, -world->rank, &sub);
    int expect_size = world->size / 2 + (world->rank % 2 == 0 ? world->size % 2 : 0);
    CHECK(sub.size == expect_size, "split: %d ranks, expected %d", sub.size, expect_size);
    // Ranks of one color in descending world order: the group rank counts the ranks of the
    // same parity above this one.
    CHECK(sub.rank == (world->size - 1 - world->rank) / 2, "split: group rank %d of world rank %d",
          sub.rank, world->rank);
    c = &sub;
    if (nccl) {
        char err[256];
        if (lb_comm_nccl_create(&dc, &sub, be, NULL, err, sizeof err) != 0) lb_die("%s", err);
        c = &dc;
    }
    x.c = c;
    suite(&x, nccl);
    if (nccl) lb_comm_free(&dc);
    lb_comm_free(&sub);
}

int main(int argc, char **argv)
{
    const char *mode = argc > 1 ? argv[1] : "mpi";
    if (strcmp(mode, "gpus") == 0) {
#ifdef LB_HAVE_CUDA
        printf("%d\n", lb_cuda_device_count());
#else
        printf("0\n");
#endif
        return 0;
    }
    lb_comm world;
    lb_comm_init(&world, &argc, &argv);
    world_rank = world.rank;
    int nccl = strcmp(mode, "nccl") == 0;
    if (!nccl && strcmp(mode, "mpi") != 0) lb_die("usage: test_comm [mpi|nccl|gpus]");
    char err[256];
    CHECK(lb_comm_local_rank(&world) <= world.rank, "local rank above world rank");
    lb_backend *be;
    if (nccl) {
#ifndef LB_HAVE_CUDA
        if (world.rank == 0) printf("test_comm nccl: lowbit is built without CUDA: skipped\n");
        lb_comm_finalize(&world);
        return 77;
#else
        be = lb_backend_cuda_create(lb_comm_local_rank(&world), err, sizeof err);
        if (!be) lb_die("%s", err);
#endif
    } else {
        be = lb_backend_cpu_create(1, err, sizeof err);
        if (!be) lb_die("%s", err);
    }
    mode_name = nccl ? "nccl" : "mpi";
    run_all(&world, be, nccl);
    // Every piecewise path: pieces of 3 elements (staging, counts above a piece, many messages).
    lb_comm_mpi_set_piece(3);
    mode_name = nccl ? "nccl, pieces of 3" : "mpi, pieces of 3";
    run_all(&world, be, nccl);
    lb_comm_mpi_set_piece((size_t)1 << 22);
    be->destroy(be);
    long total = (long)lb_comm_allreduce_sum(&world, (double)nchecks);
    if (world.rank == 0)
        printf("test_comm %s: %d ranks, %ld checks passed\n", mode, world.size, total);
    lb_comm_finalize(&world);
    return 0;
}
