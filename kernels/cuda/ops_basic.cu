// ops_basic.cu: elementwise ops, sumsq, embedding, RMSNorm, RoPE and SwiGLU for the CUDA
// backend.
//
// Determinism: every output element is written by one thread, and every reduction runs in a
// fixed shape that depends on the problem size alone (never on the grid, the number of SMs or
// timing); no floating-point atomics. Row operations (RMSNorm, RoPE, SwiGLU) compute a row the
// same way whatever the other rows are, so they are batch invariant. Sums that the CPU
// reference takes in double are taken in double here too.
#include "kernels/cuda/cuda.cuh"

#include <cub/cub.cuh>

// --- elementwise -----------------------------------------------------------------------------

template <typename T> __global__ void add_kernel(T *y, const T *x, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        lb_st(y + i, lb_ld(y + i) + lb_ld(x + i));
}

template <typename T> __global__ void scale_kernel(T *x, float s, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        lb_st(x + i, lb_ld(x + i) * s);
}

__global__ void f64_to_f32_kernel(float *y, const double *x, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        y[i] = __double2float_rn(x[i]);
}

static void cuda_f64_to_f32(lb_backend *be, float *y, const double *x, size_t n)
{
    if (!n) return;
    lb_cuda_ctx *cx = lb_cuda(be);
    f64_to_f32_kernel<<<lb_grid(n, 256, cx), 256, 0, cx->stream>>>(y, x, n);
    LB_CUDA_LAUNCHED(cx);
}

static void cuda_add(lb_backend *be, float *y, const float *x, size_t n)
{
    if (!n) return;
    lb_cuda_ctx *cx = lb_cuda(be);
    add_kernel<float><<<lb_grid(n, 256, cx), 256, 0, cx->stream>>>(y, x, n);
    LB_CUDA_LAUNCHED(cx);
}

// y16 = bf16(x + r), a thread per element; in place where y16 is x's bf16 rows (each element
// read by the thread that writes it).
__global__ void add16_kernel(uint16_t *y16, const float *x, const uint16_t *x16, size_t xld,
                             const float *r, int n, int c)
{
    const int ld = (c + 7) & ~7;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < (size_t)n * ld;
         e += (size_t)gridDim.x * blockDim.x) {
        const size_t i = e / ld;
        const int j = (int)(e % ld);
        if (j >= c) {
            y16[e] = 0;
            continue;
        }
        const float xv = x16 ? __uint_as_float((uint32_t)x16[i * xld + j] << 16) : x[i * xld + j];
        y16[e] = (uint16_t)round_bf16_bits(__fadd_rn(xv, r[i * c + j]));
    }
}

static void cuda_add16(lb_backend *be, uint16_t *y16, lb_act x, const float *r)
{
    const size_t count = (size_t)x.rows * ((x.cols + 7) & ~7);
    if (!count) return;
    lb_cuda_ctx *cx = lb_cuda(be);
    const bool b = x.type == LB_ACT_BF16;
    add16_kernel<<<lb_grid(count, 256, cx), 256, 0, cx->stream>>>(
        y16, b ? NULL : (const float *)x.p, b ? (const uint16_t *)x.p : NULL, x.ld, r, x.rows,
        x.cols);
    LB_CUDA_LAUNCHED(cx);
}

static void cuda_scale(lb_backend *be, float *x, float s, size_t n)
{
    if (!n) return;
    lb_cuda_ctx *cx = lb_cuda(be);
    scale_kernel<float><<<lb_grid(n, 256, cx), 256, 0, cx->stream>>>(x, s, n);
    LB_CUDA_LAUNCHED(cx);
}

// --- sumsq: two passes of fixed shape --------------------------------------------------------
// Pass 1: chunk ch (SUMSQ_CHUNK consecutive elements) is summed by one block of RED_THREADS:
// thread t takes elements t, t + RED_THREADS, ... in order, in double, then the block's fixed
// tree. Pass 2: one block sums the chunk partials the same way. The grouping is a function of
// n alone, so the result is bitwise reproducible; x^2 of an fp32 value is exact in double.

#define RED_THREADS 256
#define SUMSQ_CHUNK 4096

template <typename T> __global__ void sumsq_partial_kernel(const T *x, size_t n, double *part)
{
    size_t lo = (size_t)blockIdx.x * SUMSQ_CHUNK;
    size_t hi = lo + SUMSQ_CHUNK < n ? lo + SUMSQ_CHUNK : n;
    double s = 0.0;
    for (size_t i = lo + threadIdx.x; i < hi; i += RED_THREADS) {
        double v = lb_ld(x + i);
        s += v * v;
    }
    s = lb_block_sum<RED_THREADS>(s);
    if (threadIdx.x == 0) part[blockIdx.x] = s;
}

__global__ void sum_partials_kernel(const double *part, size_t np, double *out)
{
    double s = 0.0;
    for (size_t i = threadIdx.x; i < np; i += RED_THREADS) s += part[i];
    s = lb_block_sum<RED_THREADS>(s);
    if (threadIdx.x == 0) *out = s;
}

static double cuda_sumsq(lb_backend *be, const float *x, size_t n)
{
    if (!n) return 0.0;
    lb_cuda_ctx *cx = lb_cuda(be);
    size_t nch = (n + SUMSQ_CHUNK - 1) / SUMSQ_CHUNK;
    if (nch > 0x7fffffffu) lb_die("sumsq: %zu elements is too many for one call", n);
    double *part = (double *)lb_cuda_scratch(cx, (nch + 1) * sizeof(double));
    double *total = part + nch;
    sumsq_partial_kernel<float><<<(unsigned)nch, RED_THREADS, 0, cx->stream>>>(x, n, part);
    LB_CUDA_LAUNCHED(cx);
    sum_partials_kernel<<<1, RED_THREADS, 0, cx->stream>>>(part, nch, total);
    LB_CUDA_LAUNCHED(cx);
    double *h = (double *)lb_cuda_host_stage(cx, sizeof(double));
    LB_CUDA_CHECK(cudaMemcpyAsync(h, total, sizeof(double), cudaMemcpyDeviceToHost, cx->stream));
    LB_CUDA_WAIT(cx);
    return *h;
}

// --- deterministic column sums ---------------------------------------------------------------
// Column reductions over rows (RMSNorm's dw, the router's mean probabilities) run in two
// kernels of fixed shape: rows are cut into chunks of COL_CHUNK, each (chunk, 32 columns)
// block writes one double partial per column, then lb_cuda_colsum_partials sums the partials
// of each column over chunks. Block (32, 8): x picks the column, y strides over rows (or
// chunks) in order, and the 8 y partials are added in y order. Over more than
// COLSUM_FLAT chunks (a per-head norm's dw: 4096 chunks of the bench's q rows), one block per
// 32 columns would loop over them all with a handful of blocks on the GPU, so groups of
// COLSUM_GROUP chunks are summed first, each by its own blocks, the same way.

#define COL_CHUNK 128
#define COLSUM_FLAT 256
#define COLSUM_GROUP 64

// Block (g, column block): column j's sum of part rows [g group, min((g + 1) group, nchunks)).
__global__ void colsum_partials_kernel(const double *part, int nchunks, int group, int c,
                                       double *out, float *dst)
{
    __shared__ double sh[8][33];
    int j = blockIdx.y * 32 + threadIdx.x, lo = blockIdx.x * group;
    int hi = lo + group < nchunks ? lo + group : nchunks;
    double s = 0.0;
    if (j < c)
#pragma unroll 4
        for (int ch = lo + threadIdx.y; ch < hi; ch += 8) s += part[(size_t)ch * c + j];
    sh[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && j < c) {
        double t = 0.0;
        for (int y = 0; y < 8; y++) t += sh[y][threadIdx.x];
        if (dst) dst[j] += (float)t;
        else out[(size_t)blockIdx.x * c + j] = t;
    }
}

extern "C" size_t lb_cuda_colsum_work(int nchunks, int c)
{
    return nchunks > COLSUM_FLAT
               ? (size_t)((nchunks + COLSUM_GROUP - 1) / COLSUM_GROUP) * c * sizeof(double)
               : 0;
}

extern "C" void lb_cuda_colsum_partials(lb_cuda_ctx *cx, const double *part, int nchunks, int c,
                                        double *work, double *out, float *dst)
{
    dim3 block(32, 8);
    if (nchunks > COLSUM_FLAT) {   // the groups' sums into work, then those
        const int ng = (nchunks + COLSUM_GROUP - 1) / COLSUM_GROUP;
        colsum_partials_kernel<<<dim3(ng, (c + 31) / 32), block, 0, cx->stream>>>(
            part, nchunks, COLSUM_GROUP, c, work, NULL);
        LB_CUDA_LAUNCHED(cx);
        part = work, nchunks = ng;
    }
    colsum_partials_kernel<<<dim3(1, (c + 31) / 32), block, 0, cx->stream>>>(part, nchunks,
                                                                           nchunks, c, out, dst);
    LB_CUDA_LAUNCHED(cx);
}

// --- embedding -------------------------------------------------------------------------------

// out (n, c) = wte[tokens[i]]: block i copies row i.
template <typename T>
__global__ void embedding_fwd_kernel(T *out, const int32_t *tokens, const T *wte, int c,
                                     unsigned long long *err)
{
    int i = blockIdx.x;
    int tok = tokens[i];
    T *o = out + (size_t)i * c;
    if (tok < 0) {
        if (threadIdx.x == 0) lb_report(err, LB_CERR_EMB_FWD_TOKEN, tok);
        for (int j = threadIdx.x; j < c; j += blockDim.x) lb_st(o + j, __int_as_float(0x7fffffff));
        return;
    }
    const T *w = wte + (size_t)tok * c;
    for (int j = threadIdx.x; j < c; j += blockDim.x) o[j] = w[j];
}

static void cuda_embedding_fwd(lb_backend *be, float *out, const int32_t *tokens,
                               const float *wte, int n, int c)
{
    if (n < 0 || c < 0) lb_die("embedding_fwd: negative size (n %d, c %d)", n, c);
    if (!n || !c) return;
    lb_cuda_ctx *cx = lb_cuda(be);
    embedding_fwd_kernel<float><<<n, 256, 0, cx->stream>>>(out, tokens, wte, c, cx->err_dev);
    LB_CUDA_LAUNCHED(cx);
}

__global__ void iota_kernel(int32_t *x, int n)
{
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        x[i] = i;
}

// After a stable sort of (token, index) pairs, position p starts the run of its token when
// p == 0 or the previous key differs. The block at a run start adds the run's dout rows, in
// index order, to the token's dwte row: the same fp32 additions in the same order as the CPU
// reference (dwte[v] + dout[i1] + dout[i2] + ...). Runs are disjoint, so no two blocks write
// one row. Grid (n, column blocks).
template <typename T>
__global__ void embedding_bwd_kernel(float *dwte, const T *dout, const int32_t *keys,
                                     const int32_t *order, int n, int c,
                                     unsigned long long *err)
{
    int p = blockIdx.x;
    int tok = keys[p];
    if (p > 0 && keys[p - 1] == tok) return;
    if (tok < 0) {
        if (threadIdx.x == 0 && blockIdx.y == 0) lb_report(err, LB_CERR_EMB_BWD_TOKEN, tok);
        return;
    }
    int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= c) return;
    float *dst = dwte + (size_t)tok * c + j;
    float acc = *dst;
    for (int q = p; q < n && keys[q] == tok; q++) acc += lb_ld(dout + (size_t)order[q] * c + j);
    *dst = acc;
}

// Sorting the n token ids (CUB's radix sort, stable, so equal tokens keep index order) costs
// one O(n) pass per 8 key bits over n int32 pairs: negligible next to the (n, c) rows it
// saves from atomics. The vocabulary size is not an argument, so nothing here depends on it.
static void cuda_embedding_bwd(lb_backend *be, float *dwte, const float *dout,
                               const int32_t *tokens, int n, int c)
{
    if (n < 0 || c < 0) lb_die("embedding_bwd: negative size (n %d, c %d)", n, c);
    if (!n || !c) return;
    lb_cuda_ctx *cx = lb_cuda(be);
    size_t tmp_bytes = 0;
    LB_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(NULL, tmp_bytes, (const int32_t *)NULL,
                                                  (int32_t *)NULL, (const int32_t *)NULL,
                                                  (int32_t *)NULL, n, 0, 32, cx->stream));
    size_t arr = lb_align256((size_t)n * sizeof(int32_t));
    char *s = (char *)lb_cuda_scratch(cx, 3 * arr + lb_align256(tmp_bytes));
    int32_t *iota = (int32_t *)s, *keys = (int32_t *)(s + arr), *order = (int32_t *)(s + 2 * arr);
    void *tmp = s + 3 * arr;
    iota_kernel<<<lb_grid(n, 256, cx), 256, 0, cx->stream>>>(iota, n);
    LB_CUDA_LAUNCHED(cx);
    LB_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(tmp, tmp_bytes, tokens, keys, iota, order, n,
                                                  0, 32, cx->stream));
    dim3 grid(n, (c + 255) / 256);
    embedding_bwd_kernel<float><<<grid, 256, 0, cx->stream>>>(dwte, dout, keys, order, n, c,
                                                              cx->err_dev);
    LB_CUDA_LAUNCHED(cx);
}

// --- RMSNorm ---------------------------------------------------------------------------------
// A row is taken by a group of G threads (32 to 1024, by its width c: RMS_DISPATCH), thread t
// of it the K columns t, t + G, ..., held in registers, so the row is read once; a block of
// 256 (or G) threads holds 256 / G groups. The row's sums in double, as the CPU reference
// sums: the threads' partials, the warp's xor tree, then (G > 32) the group's warps in order.
// A row's result depends on that row alone.

// The group's sum of v (every thread of the block calls it: it may synchronise the block).
template <int G>
__device__ __forceinline__ double rms_group_sum(double v, double (*red)[G / 32], int gi, int li)
{
    v = lb_warp_sum(v);
    if constexpr (G > 32) {
        if ((li & 31) == 0) red[gi][li >> 5] = v;
        __syncthreads();
        v = 0.0;
#pragma unroll
        for (int q = 0; q < G / 32; q++) v += red[gi][q];
        __syncthreads();   // red is rewritten by the next call
    }
    return v;
}

#define RMS_NG(G) ((G) > 256 ? 1 : 256 / (G))   // groups (rows at a time) a block
#define ROW_WARPS 8   // the one-warp-a-row kernels (SwiGLU): rows a block

// res (not NULL): the row is x + res, stored in sum (which may be x) as add() stores it.
// out16 (not NULL): out's bf16 bits beside it, the row padded with zeros to pad8(c) (every G K
// is a multiple of 8 at or above c, so the group's threads cover the padding).
template <int G, int K>
__global__ void __launch_bounds__(G > 256 ? G : 256)
rmsnorm_fwd_kernel(float *out, uint16_t *out16, float *rstd, const float *x, const uint16_t *x16,
                   const float *res, float *sum, const float *w, int n, int c, float eps)
{
    __shared__ double red[RMS_NG(G)][G / 32];
    const int gi = threadIdx.x / G, li = threadIdx.x % G;
    const int row = blockIdx.x * RMS_NG(G) + gi;
    const bool on = row < n;
    float xv[K];
    double ss = 0.0;
#pragma unroll
    for (int k = 0; k < K; k++) {
        const int j = li + G * k;
        xv[k] = on && j < c ? lb_in_ld(x, x16, row, c, j) : 0.0f;
        if (res && on && j < c) {
            xv[k] = xv[k] + res[(size_t)row * c + j];
            sum[(size_t)row * c + j] = xv[k];
        }
        ss += (double)xv[k] * xv[k];
    }
    ss = rms_group_sum<G>(ss, red, gi, li);
    if (!on) return;
    const float r = (float)(1.0 / sqrt(ss / c + (double)eps));
    if (li == 0) rstd[row] = r;
    const int ld = (c + 7) & ~7;
#pragma unroll
    for (int k = 0; k < K; k++) {
        const int j = li + G * k;
        if (j < c) {
            const float o = (xv[k] * r) * w[j];   // as HF
            if (out) out[(size_t)row * c + j] = o;
            if (out16) out16[(size_t)row * ld + j] = (uint16_t)round_bf16_bits(o);
        } else if (out16 && j < ld) {
            out16[(size_t)row * ld + j] = 0;
        }
    }
}

// Launches CALL(G, K) with the row shape for c (c <= 16384).
#define RMS_DISPATCH(c, CALL)                                                                 \
    do {                                                                                      \
        if ((c) <= 128) CALL(32, 4);                                                          \
        else if ((c) <= 512) CALL(64, 8);                                                     \
        else if ((c) <= 2048) CALL(256, 8);                                                   \
        else if ((c) <= 4096) CALL(512, 8);                                                   \
        else if ((c) <= 8192) CALL(1024, 8);                                                  \
        else CALL(1024, 16);   /* registers spill: correct, not tuned */                      \
    } while (0)

static void cuda_rmsnorm_fwd(lb_backend *be, const lb_rmsnorm_args *a)
{
    const int n = a->n, c = a->c;
    if (n < 0 || c <= 0) lb_die("rmsnorm_fwd: bad size (n %d, c %d)", n, c);
    if (c > 16384) lb_die("rmsnorm_fwd: %d columns is more than 16384", c);
    if (!a->res != !a->sum) lb_die("rmsnorm_fwd: res and sum go together");
    if (!a->out && !a->out16) lb_die("rmsnorm_fwd: neither out nor out16");
    if (a->x16 && a->res) lb_die("rmsnorm_fwd: x16 with res");
    if (!n) return;
    lb_cuda_ctx *cx = lb_cuda(be);
#define RMS_FWD(G, K)                                                                     \
    rmsnorm_fwd_kernel<G, K><<<(n + RMS_NG(G) - 1) / RMS_NG(G), RMS_NG(G) * (G), 0,        \
                               cx->stream>>>(a->out, a->out16, a->rstd, a->x, a->x16,    \
                                             a->res, a->sum, a->w, n, c, a->eps)
    RMS_DISPATCH(c, RMS_FWD);
#undef RMS_FWD
    LB_CUDA_LAUNCHED(cx);
}

// dx_j = r (w_j dy_j) - x_j r^3 / c * sum_k (w_k dy_k x_k) (+ beta dx_j), in double like the
// CPU reference; and dw's partials in the same pass over dy and x (reading them is the cost),
// rows taken as the forward takes them. Block b takes rows [b rb, (b + 1) rb), group i of its
// ng the rows b rb + i, + ng, ...; each thread adds dy_ij x_ij r_i (rounded to fp32) for its
// columns over its rows, in order, in fp32 registers; the block then sums its groups' in
// double, in group order, into part (nblocks, c). G, K and rb depend on n and c alone, so the
// sums' order is a function of the shape.
template <int G, int K>
__global__ void __launch_bounds__(G > 256 ? G : 256, K > 8 || G > 256 ? 1 : 3)
rmsnorm_bwd_kernel(float *dx, float beta, double *part, const float *dout, const float *x,
                   const uint16_t *x16, const float *w, const float *rstd, int n, int c, int rb)
{
    constexpr int NG = RMS_NG(G);
    __shared__ double red[NG][G / 32];
    extern __shared__ float rms_sh[];   // NG > 1: (NG, c), the groups' partials
    const int gi = threadIdx.x / G, li = threadIdx.x % G;
    float wv[K], acc[K];
#pragma unroll
    for (int k = 0; k < K; k++) {
        const int j = li + G * k;
        wv[k] = j < c ? w[j] : 0.0f;
        acc[k] = 0.0f;
    }
    const int lo = blockIdx.x * rb, hi = lo + rb < n ? lo + rb : n;
    for (int row0 = lo; row0 < hi; row0 += NG) {   // every group's threads run every round
        const int row = row0 + gi;
        const bool on = row < hi;
        const float *gr = dout + (size_t)row * c;
        float xv[K], gv[K], old[K];
        double dot = 0.0;
#pragma unroll
        for (int k = 0; k < K; k++) {
            const int j = li + G * k;
            const bool in = on && j < c;
            xv[k] = in ? lb_in_ld(x, x16, row, c, j) : 0.0f;
            gv[k] = in ? gr[j] : 0.0f;
            old[k] = in && beta != 0.0f ? dx[(size_t)row * c + j] : 0.0f;
            dot += (double)gv[k] * wv[k] * xv[k];
        }
        dot = rms_group_sum<G>(dot, red, gi, li);
        if (!on) continue;
        const double r = rstd[row], coef = dot * r * r * r / c;
#pragma unroll
        for (int k = 0; k < K; k++) {
            const int j = li + G * k;
            if (j >= c) continue;
            float v = (float)(r * ((double)wv[k] * gv[k]) - coef * xv[k]);
            if (beta != 0.0f) v = __fadd_rn(__fmul_rn(beta, old[k]), v);
            dx[(size_t)row * c + j] = v;
            acc[k] = __fadd_rn(acc[k], (float)((double)gv[k] * xv[k] * r));
        }
    }
    if constexpr (NG == 1) {
#pragma unroll
        for (int k = 0; k < K; k++)
            if (li + G * k < c) part[(size_t)blockIdx.x * c + li + G * k] = acc[k];
    } else {
#pragma unroll
        for (int k = 0; k < K; k++)
            if (li + G * k < c) rms_sh[(size_t)gi * c + li + G * k] = acc[k];
        __syncthreads();
        for (int j = threadIdx.x; j < c; j += blockDim.x) {
            double t = 0.0;
            for (int q = 0; q < NG; q++) t += rms_sh[(size_t)q * c + j];
            part[(size_t)blockIdx.x * c + j] = t;
        }
    }
}

static void cuda_rmsnorm_bwd(lb_backend *be, float *dx, float dx_beta, float *dw,
                             const float *dout, const float *x, const uint16_t *x16,
                             const float *w,
                             const float *rstd, int n, int c)
{
    if (n < 0 || c <= 0) lb_die("rmsnorm_bwd: bad size (n %d, c %d)", n, c);
    if (c > 16384) lb_die("rmsnorm_bwd: %d columns is more than 16384", c);
    if (!n) return;
    lb_cuda_ctx *cx = lb_cuda(be);
    // Blocks of 16 rows or more, about 1024 of them on long inputs (the partials are then 4%
    // of the bytes read at c 2048).
    int rb = 16;
    while (rb < 1024 && (size_t)rb * 1024 < (size_t)n) rb *= 2;
    const int nb = (n + rb - 1) / rb;
    const size_t b_part = lb_align256((size_t)nb * c * sizeof(double));
    char *s = (char *)lb_cuda_scratch(cx, b_part + lb_cuda_colsum_work(nb, c));
    double *part = (double *)s;
    // the groups' partials in shared memory where a block has several: 8 KB at most
#define RMS_BWD(G, K)                                                                     \
    rmsnorm_bwd_kernel<G, K><<<nb, RMS_NG(G) * (G),                                       \
                               RMS_NG(G) > 1 ? (size_t)RMS_NG(G) * c * sizeof(float) : 0, \
                               cx->stream>>>(dx, dx_beta, part, dout, x, x16, w, rstd, n, c,  \
                                             rb)
    RMS_DISPATCH(c, RMS_BWD);
#undef RMS_BWD
    LB_CUDA_LAUNCHED(cx);
    lb_cuda_colsum_partials(cx, part, nb, c, (double *)(s + b_part), NULL, dw);
}

// --- RoPE ------------------------------------------------------------------------------------
// As the CPU reference: the angle pos * inv_freq in double, cos and sin rounded once to fp32;
// the rotation in fp32 with explicit round-to-nearest multiplies so no FMA contraction changes
// it (it then matches the CPU bit for bit whenever the double cos/sin round to the same fp32
// values). The first rot values of each head rotate (partial rotary); frequencies from the
// table (llama3 scaling: the host computed it) or theta^(-2f/rot). A block takes a row at a
// time: its rot / 2 cos and sin once, in shared memory, then every head's pairs. The double
// pow and sincos cost far more than a pair's rotation, and a row's heads share them: computed
// per head (a thread per pair, or a warp per head with the q/k norm) they made RoPE several
// times its memory time at 16 or 32 heads.

// The row's cos and sin (half each, sin times sign) into cs[0..half), cs[half..rot) by the
// block's threads. The caller synchronizes before reading them.
__device__ __forceinline__ void rope_angles(float *cs, int p, int half, int rot,
                                            const double *table, double theta, double sign)
{
    for (int f = threadIdx.x; f < half; f += blockDim.x) {
        double inv_freq = table ? table[f] : pow(theta, -2.0 * f / rot);
        double angle = (double)p * inv_freq, sd, cd;
        sincos(angle, &sd, &cd);
        cs[f] = (float)cd;
        cs[half + f] = (float)(sign * sd);
    }
}

// y = the rotation of x: the same buffer (in place), or a bf16 one (rope's out16). A block a
// row; shared memory: rot floats.
template <typename TI, typename TO>
__global__ void rope_kernel(TO *y, const TI *x, const int32_t *pos, int n, int heads, int d,
                            int rot, const double *table, double theta, double sign)
{
    extern __shared__ float rope_cs[];
    const int half = rot / 2;
    for (int i = blockIdx.x; i < n; i += gridDim.x) {
        rope_angles(rope_cs, pos[i], half, rot, table, theta, sign);
        __syncthreads();
        for (int e = threadIdx.x; e < heads * half; e += blockDim.x) {
            const int h = e / half, f = e % half;
            const size_t o = ((size_t)i * heads + h) * d;
            const float cs = rope_cs[f], sn = rope_cs[half + f];
            const float x1 = lb_ld(x + o + f), x2 = lb_ld(x + o + f + half);
            lb_st(y + o + f, __fsub_rn(__fmul_rn(x1, cs), __fmul_rn(x2, sn)));
            lb_st(y + o + f + half, __fadd_rn(__fmul_rn(x2, cs), __fmul_rn(x1, sn)));
        }
        __syncthreads();   // the angles are read before the next row's overwrite them
    }
}

// The values past rot of each head (partial rotary) pass through: copied into a bf16 output.
__global__ void rope_pass_kernel(__nv_bfloat16 *y, const float *x, size_t rows, int d, int rot)
{
    const int w = d - rot;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < rows * w;
         e += (size_t)gridDim.x * blockDim.x) {
        const size_t r = e / w, j = rot + e % w;
        y[r * d + j] = __float2bfloat16(x[r * d + j]);
    }
}

// The q/k norm and RoPE of a row's heads, for d <= 128 and rot a multiple of 64: a block a
// row, its angles in shared memory (rope_angles), then a warp a head, holding it as
// rmsnorm_fwd_kernel<32, 4> holds a row (lane l: elements l + 32 k), so the norm is that
// kernel's arithmetic, and each rotated pair (f, f + rot / 2) is one lane's (k and
// k + rot / 64); the rotation is rope_kernel's. A decode step's four launches per layer (two
// norms, two rotations) become two. Shared memory: rot floats.
template <typename TO, typename TI>
__global__ void __launch_bounds__(256)
rope_norm_kernel(TO *x, float *rstd, const TI *src, const float *nw, const int32_t *pos,
                 int n, int heads, int d, int rot, const double *table, double theta, float eps)
{
    extern __shared__ float rope_cs[];
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5, half = rot / 2;
    for (int i = blockIdx.x; i < n; i += gridDim.x) {
        rope_angles(rope_cs, pos[i], half, rot, table, theta, 1.0);
        __syncthreads();
        for (int h = threadIdx.x >> 5; h < heads; h += warps) {
            const size_t hr = (size_t)i * heads + h;
            const TI *si = src + hr * d;
            float xv[4];
            double ss = 0.0;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const int j = lane + 32 * k;
                xv[k] = j < d ? lb_ld(si + j) : 0.0f;
                ss += (double)xv[k] * xv[k];
            }
            ss = lb_warp_sum(ss);
            const float r = (float)(1.0 / sqrt(ss / d + (double)eps));
            if (lane == 0) rstd[hr] = r;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const int j = lane + 32 * k;
                if (j < d) xv[k] = (xv[k] * r) * nw[j];
            }
#pragma unroll
            for (int k = 0; k < 2; k++) {
                const int f = lane + 32 * k, k2 = k + half / 32;
                if (f >= half) continue;
                const float cs = rope_cs[f], sn = rope_cs[half + f];
                const float x1 = xv[k], x2 = xv[k2];
                xv[k] = __fsub_rn(__fmul_rn(x1, cs), __fmul_rn(x2, sn));
                xv[k2] = __fadd_rn(__fmul_rn(x2, cs), __fmul_rn(x1, sn));
            }
            TO *xo = x + hr * d;
#pragma unroll
            for (int k = 0; k < 4; k++)
                if (lane + 32 * k < d) lb_st(xo + lane + 32 * k, xv[k]);
        }
        __syncthreads();   // the angles are read before the next row's overwrite them
    }
}

// Blocks for n rows, a row at a time each (grid-stride past the grid's limit).
static unsigned rope_blocks(int n) { return (unsigned)(n < 65535 ? n : 65535); }

static void cuda_rope(lb_backend *be, const lb_rope_args *a)
{
    const int n = a->n, heads = a->heads, d = a->d, rot = a->rot ? a->rot : a->d;
    if (n < 0 || heads < 0 || d < 0) lb_die("rope: negative size");
    if (d % 2) lb_die("rope: head dim %d is odd", d);
    if (rot % 2 || rot < 0 || rot > d) lb_die("rope: rot %d is not even in 0..%d", rot, d);
    if ((a->src || a->src16) && a->inverse)
        lb_die("rope: a norm (src) with the inverse rotation");
    if (a->src16 && (!a->nw || d % 8))
        lb_die("rope: src16 needs the norm's weight and a head dim that is a multiple of 8");
    if (a->out16 && a->inverse) lb_die("rope: a bf16 output (out16) with the inverse rotation");
    lb_cuda_ctx *cx = lb_cuda(be);
    __nv_bfloat16 *y16 = (__nv_bfloat16 *)a->out16;
    const float *x = a->x;   // the rotation's input
    if ((a->src || a->src16) && n && heads) {
        if (d <= 128 && rot % 64 == 0 && rot > 0) {
            const unsigned threads = 32 * (unsigned)(heads < 8 ? heads : 8);
            const size_t sm = (size_t)rot * sizeof(float);
            const __nv_bfloat16 *s16 = (const __nv_bfloat16 *)a->src16;
#define ROPE_NORM(Y, S)                                                                      \
    rope_norm_kernel<<<rope_blocks(n), threads, sm, cx->stream>>>(Y, a->rstd, S, a->nw, a->pos, \
                                                                   n, heads, d, rot,          \
                                                                   a->inv_freq,               \
                                                                   (double)a->theta, a->eps)
            if (y16 && s16) ROPE_NORM(y16, s16);
            else if (y16) ROPE_NORM(y16, a->src);
            else if (s16) ROPE_NORM(a->x, s16);
            else ROPE_NORM(a->x, a->src);
#undef ROPE_NORM
            LB_CUDA_LAUNCHED(cx);
            return;
        }
        // the norm in fp32, into x, or where a bf16 output leaves x unused, into scratch
        float *normed = y16 ? (float *)lb_cuda_scratch(cx, (size_t)n * heads * d * sizeof(float))
                            : a->x;
        lb_rmsnorm_args r = {};
        r.n = n * heads, r.c = d, r.x = a->src, r.x16 = a->src16, r.w = a->nw, r.rstd = a->rstd;
        r.out = normed;
        r.eps = a->eps;
        cuda_rmsnorm_fwd(be, &r);
        x = normed;
    }
    if (!n || !heads) return;
    if (y16) {
        if (rot < d) {
            const size_t rows = (size_t)n * heads;
            rope_pass_kernel<<<lb_grid(rows * (d - rot), 256, cx), 256, 0, cx->stream>>>(
                y16, x, rows, d, rot);
            LB_CUDA_LAUNCHED(cx);
        }
        if (!rot) return;
        rope_kernel<<<rope_blocks(n), 128, rot * sizeof(float), cx->stream>>>(
            y16, x, a->pos, n, heads, d, rot, a->inv_freq, (double)a->theta, 1.0);
        LB_CUDA_LAUNCHED(cx);
        return;
    }
    if (!rot) return;
    rope_kernel<<<rope_blocks(n), 128, rot * sizeof(float), cx->stream>>>(
        a->x, (const float *)a->x, a->pos, n, heads, d, rot, a->inv_freq, (double)a->theta,
        a->inverse ? -1.0 : 1.0);
    LB_CUDA_LAUNCHED(cx);
}

// --- SwiGLU ----------------------------------------------------------------------------------
// gu (n, 2f) = [gate | up]; the CPU reference's expressions per element. One warp per row, four
// elements per lane step (16-byte loads and stores) when f % 4 == 0 and the buffers are
// 16-byte aligned, else one. (A thread per element with a 64-bit division each ran at 2.4
// TB/s.)

__device__ __forceinline__ float swiglu_one(float g, float u)
{
    float sig = 1.0f / (1.0f + expf(-g));
    return g * sig * u;
}

// d gate and d up of one element
__device__ __forceinline__ float2 swiglu_grad(float g, float u, float dy)
{
    float sig = 1.0f / (1.0f + expf(-g));
    float silu = g * sig;
    return make_float2(dy * u * (sig * (1.0f + g * (1.0f - sig))), dy * silu);
}

// A ..16 copy (NULL: none) gets the values' bf16 bits beside the fp32 stores, which are
// skipped where the fp32 output is NULL (kernels.h); a ..16 input is read instead of the fp32
// one (lb_in_ld: gate and up are columns [0, f) and [f, 2f) of a row of 2f either way).
// rw (NULL: none): row i's weight, multiplied in after the SwiGLU (kernels.h).
__global__ void swiglu_fwd_kernel(float *out, uint16_t *out16, const float *gu,
                                  const uint16_t *gu16, const float *rw, int n, int f, int vec)
{
    const int i = blockIdx.x * ROW_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (i >= n) return;
    float *o = out ? out + (size_t)i * f : NULL;
    uint16_t *o16 = out16 ? out16 + (size_t)i * ((f + 7) & ~7) : NULL;
    const float w = rw ? rw[i] : 1.0f;
    if (vec) {
        for (int j = lane; j < f / 4; j += 32) {
            const float4 a = lb_in_ld4(gu, gu16, i, 2 * f, j);
            const float4 b = lb_in_ld4(gu, gu16, i, 2 * f, f / 4 + j);
            float4 r = make_float4(swiglu_one(a.x, b.x), swiglu_one(a.y, b.y),
                                   swiglu_one(a.z, b.z), swiglu_one(a.w, b.w));
            if (rw) r = make_float4(r.x * w, r.y * w, r.z * w, r.w * w);
            if (o) ((float4 *)o)[j] = r;
            if (o16) ((uint2 *)o16)[j] = bf16x4_bits(r);
        }
    } else {
        for (int j = lane; j < f; j += 32) {
            float r =
                swiglu_one(lb_in_ld(gu, gu16, i, 2 * f, j), lb_in_ld(gu, gu16, i, 2 * f, f + j));
            if (rw) r *= w;
            if (o) o[j] = r;
            if (o16) o16[j] = (uint16_t)round_bf16_bits(r);
        }
    }
    if (o16) bf16_row_pad(o16, f, lane);
}

// rw, drw (NULL: none): row i's weight and its gradient (kernels.h), the gradient in double,
// each lane's columns in order, then the warp's fixed butterfly.
__global__ void swiglu_bwd_kernel(float *dgu, uint16_t *dgu16, const float *dout,
                                  const uint16_t *dout16, const float *gu, const uint16_t *gu16,
                                  const float *rw, double *drw, int n, int f, int vec)
{
    const int i = blockIdx.x * ROW_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (i >= n) return;
    float *dg = dgu ? dgu + (size_t)i * 2 * f : NULL, *du = dgu ? dg + f : NULL;
    uint16_t *dg16 = dgu16 ? dgu16 + (size_t)i * ((2 * f + 7) & ~7) : NULL;
    uint16_t *du16 = dg16 ? dg16 + f : NULL;
    const float w = rw ? rw[i] : 1.0f;
    double acc = 0.0;
    if (vec) {
        for (int j = lane; j < f / 4; j += 32) {
            const float4 a = lb_in_ld4(gu, gu16, i, 2 * f, j);
            const float4 b = lb_in_ld4(gu, gu16, i, 2 * f, f / 4 + j);
            float4 d = lb_in_ld4(dout, dout16, i, f, j);
            if (drw)
                acc += (double)d.x * swiglu_one(a.x, b.x) + (double)d.y * swiglu_one(a.y, b.y) +
                       (double)d.z * swiglu_one(a.z, b.z) + (double)d.w * swiglu_one(a.w, b.w);
            if (rw) d = make_float4(w * d.x, w * d.y, w * d.z, w * d.w);
            const float2 r0 = swiglu_grad(a.x, b.x, d.x), r1 = swiglu_grad(a.y, b.y, d.y);
            const float2 r2 = swiglu_grad(a.z, b.z, d.z), r3 = swiglu_grad(a.w, b.w, d.w);
            const float4 rg = make_float4(r0.x, r1.x, r2.x, r3.x);
            const float4 ru = make_float4(r0.y, r1.y, r2.y, r3.y);
            if (dg) {
                ((float4 *)dg)[j] = rg;
                ((float4 *)du)[j] = ru;
            }
            if (dg16) {
                ((uint2 *)dg16)[j] = bf16x4_bits(rg);
                ((uint2 *)du16)[j] = bf16x4_bits(ru);
            }
        }
    } else {
        for (int j = lane; j < f; j += 32) {
            const float g = lb_in_ld(gu, gu16, i, 2 * f, j), u = lb_in_ld(gu, gu16, i, 2 * f, f + j);
            float d = lb_in_ld(dout, dout16, i, f, j);
            if (drw) acc += (double)d * swiglu_one(g, u);
            if (rw) d = w * d;
            const float2 r = swiglu_grad(g, u, d);
            if (dg) dg[j] = r.x, du[j] = r.y;
            if (dg16) {
                dg16[j] = (uint16_t)round_bf16_bits(r.x);
                du16[j] = (uint16_t)round_bf16_bits(r.y);
            }
        }
    }
    if (dg16) bf16_row_pad(dg16, 2 * f, lane);
    if (!drw) return;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) drw[i] = acc;
}

// 16-byte fp32 rows, and 8-byte bf16 ones (copies and inputs: a pitch of a multiple of 8
// elements, so every row starts where the first does, and the up half of a gate/up row f
// elements in, 8-byte aligned when f % 4 == 0).
static int swiglu_vec(int f, const void *p0, const void *p1, const void *p2, const void *q0,
                      const void *q1 = NULL, const void *q2 = NULL)
{
    return f % 4 == 0 && (((uintptr_t)p0 | (uintptr_t)p1 | (uintptr_t)p2) & 15) == 0 &&
           (((uintptr_t)q0 | (uintptr_t)q1 | (uintptr_t)q2) & 7) == 0;
}

static void cuda_swiglu_fwd(lb_backend *be, float *out, uint16_t *out16, const float *gu,
                            const uint16_t *gu16, const float *rw, int n, int f)
{
    if (n < 0 || f < 0) lb_die("swiglu_fwd: negative size (n %d, f %d)", n, f);
    if (!n || !f) return;
    if (!out && !out16) lb_die("swiglu_fwd: neither out nor out16");
    if (!gu && !gu16) lb_die("swiglu_fwd: neither gu nor gu16");
    lb_cuda_ctx *cx = lb_cuda(be);
    swiglu_fwd_kernel<<<(n + ROW_WARPS - 1) / ROW_WARPS, ROW_WARPS * 32, 0, cx->stream>>>(
        out, out16, gu, gu16, rw, n, f, swiglu_vec(f, out, gu, gu, out16, gu16));
    LB_CUDA_LAUNCHED(cx);
}

static void cuda_swiglu_bwd(lb_backend *be, float *dgu, uint16_t *dgu16, const float *dout,
                            const uint16_t *dout16, const float *gu, const uint16_t *gu16,
                            const float *rw, double *drw, int n, int f)
{
    if (n < 0 || f < 0) lb_die("swiglu_bwd: negative size (n %d, f %d)", n, f);
    if (!n || !f) return;
    if (!dgu && !dgu16) lb_die("swiglu_bwd: neither dgu nor dgu16");
    if ((!gu && !gu16) || (!dout && !dout16)) lb_die("swiglu_bwd: an input missing");
    lb_cuda_ctx *cx = lb_cuda(be);
    swiglu_bwd_kernel<<<(n + ROW_WARPS - 1) / ROW_WARPS, ROW_WARPS * 32, 0, cx->stream>>>(
        dgu, dgu16, dout, dout16, gu, gu16, rw, drw, n, f,
        swiglu_vec(f, dgu, dout, gu, dgu16, dout16, gu16));
    LB_CUDA_LAUNCHED(cx);
}

// The table's entries take argument structs (kernels.h); the kernels' hosts above take
// the fields.

static void cuda_rmsnorm_bwd_op(lb_backend *be, const lb_rmsnorm_args *a)
{
    cuda_rmsnorm_bwd(be, a->dx, a->dx_beta, a->dw, a->dout, a->x, a->x16, a->w, a->rstd, a->n,
                     a->c);
}

static void cuda_swiglu_fwd_op(lb_backend *be, const lb_swiglu_args *a)
{
    cuda_swiglu_fwd(be, a->out, a->out16, a->gu, a->gu16, a->rw, a->n, a->f);
}

static void cuda_swiglu_bwd_op(lb_backend *be, const lb_swiglu_args *a)
{
    cuda_swiglu_bwd(be, a->dgu, a->dgu16, a->dout, a->dout16, a->gu, a->gu16, a->rw, a->drw,
                    a->n, a->f);
}

extern "C" void lb_cuda_init_basic(lb_backend *be)
{
    be->add = cuda_add;
    be->add16 = cuda_add16;
    be->scale = cuda_scale;
    be->f64_to_f32 = cuda_f64_to_f32;
    be->sumsq = cuda_sumsq;
    be->embedding_fwd = cuda_embedding_fwd;
    be->embedding_bwd = cuda_embedding_bwd;
    be->rmsnorm_fwd = cuda_rmsnorm_fwd;
    be->rmsnorm_bwd = cuda_rmsnorm_bwd_op;
    be->rope = cuda_rope;
    be->swiglu_fwd = cuda_swiglu_fwd_op;
    be->swiglu_bwd = cuda_swiglu_bwd_op;
}
