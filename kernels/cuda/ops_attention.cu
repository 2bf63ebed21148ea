// ops_attention.cu: causal grouped-query attention, forward and backward, for the CUDA
// backend. Straightforward flash-style fp32 kernels: correct and deterministic first; the
// tensor-core version comes with the bf16 work (doc/backends.md).
//
// Layouts (kernels.h): q, out, dout, dq (b, t, hq, d); k, v, dk, dv (b, t, hkv, d); lse and the
// backward's D = rowsum(dout * out) (b, hq, t). Query head h reads kv head h / (hq / hkv).
// Softmax scale 1/sqrt(d); d <= 256.
//
// Work split. A block holds ATT_QB = ATT_WARPS x ATT_ROWS rows (query rows in the forward and
// dq kernels, key rows in the dk/dv kernel) of one (batch, head); each warp owns ATT_ROWS of
// them and each lane owns the head dimensions x = lane + 32 r. The other side (keys, or
// queries for dk/dv) streams through shared memory in chunks of ATT_KC = 32 positions
// aligned at position 0, one position per lane when scores are formed.
//
// Reduction order, fixed: a query row i takes key chunks 0, 1, ..., floor(i / 32) in order,
// with online softmax across chunks (running max, rescaled sum and accumulator) and keys in
// index order inside a chunk. Keys after i are masked to probability exactly 0. So a row's
// result depends on its own inputs and i alone: not on the batch, the sequence length t or the
// grid (batch invariance; "split over keys by a fixed chunk size"). The backward reduces
// dk/dv for key j over the group's query heads in order, then queries i >= j in order; dq over
// keys in order. No atomics anywhere.
#include "kernels/cuda/cuda.cuh"

#include <math.h>

extern "C" {
#include "kernels/quant/quant.h"   // lb_qmat: the fp8 KV cache's input
}

#define ATT_WARPS 4
#define ATT_ROWS 4
#define ATT_QB (ATT_WARPS * ATT_ROWS)
#define ATT_KC 32
#define ATT_THREADS (ATT_WARPS * 32)
#define ATT_DMAX 256

// (b, t, heads, d) element offset of row (bi, i, h).
__device__ __forceinline__ size_t att_row(int bi, int i, int h, int t, int heads, int d)
{
    return (((size_t)bi * t + i) * heads + h) * d;
}

// --- forward ---------------------------------------------------------------------------------
// Shared memory: qs [ATT_QB][d] the block's query rows; ks [ATT_KC][d + 1] (padded: lane j
// reads row j, so rows must fall in different banks); vs [ATT_KC][d] (read along d).
template <int NR, typename T>
__global__ void __launch_bounds__(ATT_THREADS)
attn_fwd_kernel(T *out, float *lse, const T *q, const T *k, const T *v, int t, int hq, int hkv,
                int d, float scale)
{
    extern __shared__ float sm[];
    const int dp = d + 1;
    float *qs = sm, *ks = qs + ATT_QB * d, *vs = ks + ATT_KC * dp;
    const int bi = blockIdx.z, h = blockIdx.y, i0 = blockIdx.x * ATT_QB;
    const int hk = h / (hq / hkv);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    for (int e = threadIdx.x; e < ATT_QB * d; e += ATT_THREADS) {
        int r = e / d, x = e % d, i = i0 + r;
        qs[e] = i < t ? lb_ld(q + att_row(bi, i, h, t, hq, d) + x) : 0.0f;
    }
    float m[ATT_ROWS], l[ATT_ROWS], acc[ATT_ROWS][NR];
#pragma unroll
    for (int r = 0; r < ATT_ROWS; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
#pragma unroll
        for (int rr = 0; rr < NR; rr++) acc[r][rr] = 0.0f;
    }
    const int ilast = min(i0 + ATT_QB, t) - 1;
    const int nchunks = ilast / ATT_KC + 1;
    for (int c = 0; c < nchunks; c++) {
        const int j0 = c * ATT_KC;
        __syncthreads();   // the previous chunk is consumed
        for (int e = threadIdx.x; e < ATT_KC * d; e += ATT_THREADS) {
            int jj = e / d, x = e % d, j = j0 + jj;
            bool in = j < t;
            ks[jj * dp + x] = in ? lb_ld(k + att_row(bi, j, hk, t, hkv, d) + x) : 0.0f;
            vs[jj * d + x] = in ? lb_ld(v + att_row(bi, j, hk, t, hkv, d) + x) : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < ATT_ROWS; r++) {
            const int qr = warp * ATT_ROWS + r, i = i0 + qr;
            if (i >= t || j0 > i) continue;   // uniform over the warp
            const int j = j0 + lane;
            float s = -INFINITY;
            if (j <= i) {
                const float *qrow = qs + qr * d, *krow = ks + lane * dp;
                float dot = 0.0f;
                for (int x = 0; x < d; x++) dot += qrow[x] * krow[x];
                s = dot * scale;
            }
            const float mn = fmaxf(m[r], lb_warp_max(s));   // finite: key j0 <= i is present
            const float alpha = expf(m[r] - mn);               // 0 on the first chunk
            const float p = j <= i ? expf(s - mn) : 0.0f;
            l[r] = l[r] * alpha + lb_warp_sum(p);
#pragma unroll
            for (int rr = 0; rr < NR; rr++) acc[r][rr] *= alpha;
            for (int jj = 0; jj < ATT_KC; jj++) {
                const float pj = __shfl_sync(0xffffffffu, p, jj);
#pragma unroll
                for (int rr = 0; rr < NR; rr++) {
                    const int x = lane + 32 * rr;
                    if (x < d) acc[r][rr] += pj * vs[jj * d + x];
                }
            }
            m[r] = mn;
        }
    }
#pragma unroll
    for (int r = 0; r < ATT_ROWS; r++) {
        const int i = i0 + warp * ATT_ROWS + r;
        if (i >= t) continue;
        T *o = out + att_row(bi, i, h, t, hq, d);
#pragma unroll
        for (int rr = 0; rr < NR; rr++) {
            const int x = lane + 32 * rr;
            if (x < d) lb_st(o + x, acc[r][rr] / l[r]);
        }
        if (lane == 0) lse[((size_t)bi * hq + h) * t + i] = m[r] + logf(l[r]);
    }
}

static void check_heads(const char *what, int b, int t, int hq, int hkv, int d)
{
    if (b < 0 || t < 0 || hq < 0 || hkv < 0 || d < 0)
        lb_die("%s: negative size (b %d, t %d, hq %d, hkv %d, d %d)", what, b, t, hq, hkv, d);
    if (hkv == 0 || hq % hkv)
        lb_die("%s: %d query heads are not a multiple of %d kv heads", what, hq, hkv);
    if (d > ATT_DMAX) lb_die("%s: head dim %d > %d is not supported", what, d, ATT_DMAX);
    if (hq > 65535 || b > 65535) lb_die("%s: %d heads or batch %d exceed the grid", what, hq, b);
}

template <int NR>
static void launch_fwd(lb_cuda_ctx *cx, float *out, float *lse, const float *q, const float *k,
                       const float *v, int b, int t, int hq, int hkv, int d)
{
    size_t smem = (size_t)(ATT_QB * d + ATT_KC * (d + 1) + ATT_KC * d) * sizeof(float);
    lb_cuda_smem_limit(attn_fwd_kernel<NR, float>, smem);
    dim3 grid((t + ATT_QB - 1) / ATT_QB, hq, b);
    attn_fwd_kernel<NR, float><<<grid, ATT_THREADS, smem, cx->stream>>>(
        out, lse, q, k, v, t, hq, hkv, d, (float)(1.0 / sqrt((double)d)));
    LB_CUDA_LAUNCHED(cx);
}

static void cuda_attention_fwd(lb_backend *be, float *out, uint16_t *out16, float *lse,
                               const float *q, const float *k, const float *v,
                               const uint16_t *q16, const uint16_t *k16, const uint16_t *v16,
                               int b, int t, int hq, int hkv, int d, int bf16)
{
    check_heads("attention_fwd", b, t, hq, hkv, d);
    if (!b || !t || !hq || !d) return;
    lb_cuda_ctx *cx = lb_cuda(be);
    if (bf16) {   // tensor cores (attention_tc.cu)
        if (d > 128) lb_die("attention_fwd: bf16 mode supports head dim <= 128, not %d", d);
        lb_cuda_attention_tc_fwd(cx, out, out16, lse, q, q16, k, k16, v, v16, b, t, hq, hkv, d);
        return;
    }
    if (d <= 32) launch_fwd<1>(cx, out, lse, q, k, v, b, t, hq, hkv, d);
    else if (d <= 64) launch_fwd<2>(cx, out, lse, q, k, v, b, t, hq, hkv, d);
    else if (d <= 128) launch_fwd<4>(cx, out, lse, q, k, v, b, t, hq, hkv, d);
    else launch_fwd<8>(cx, out, lse, q, k, v, b, t, hq, hkv, d);
}

// --- backward --------------------------------------------------------------------------------
// With P_ij = exp(S_ij - lse_i), S_ij = scale q_i.k_j (j <= i), D_i = dout_i.out_i:
//   dP_ij = dout_i.v_j;  dS_ij = P_ij (dP_ij - D_i)
//   dq_i = scale sum_j dS_ij k_j;  dk_j = scale sum_{h,i} dS_ij q_i;  dv_j = sum_{h,i} P_ij dout_i
// Both kernels recompute P from the saved lse by the same expression, so they see the same
// probabilities.

// D (b, hq, t): one warp per query row, double lane sums and the warp's xor tree.
template <typename T, typename TO>
__global__ void attn_rowdot_kernel(float *D, const T *dout, const TO *out, int b, int t, int hq,
                                   int d)
{
    const int lane = threadIdx.x & 31;
    const long r = (long)blockIdx.x * ATT_WARPS + (threadIdx.x >> 5);
    if (r >= (long)b * hq * t) return;
    const int bi = (int)(r / ((long)hq * t)), h = (int)(r / t % hq), i = (int)(r % t);
    const size_t o = att_row(bi, i, h, t, hq, d);
    double s = 0.0;
    for (int x = lane; x < d; x += 32) s += (double)lb_ld(dout + o + x) * lb_ld(out + o + x);
    s = lb_warp_sum(s);
    if (lane == 0) D[r] = (float)s;
}

// dq: the forward's structure. Shared memory: qs, dos [ATT_QB][d] (query rows, dout rows);
// ks, vs [ATT_KC][d + 1] (lane j forms q.k_j and dout.v_j, so both are padded).
template <int NR, typename T>
__global__ void __launch_bounds__(ATT_THREADS)
attn_bwd_dq_kernel(T *dq, const T *dout, const T *q, const T *k, const T *v, const float *lse,
                   const float *D, int t, int hq, int hkv, int d, float scale)
{
    extern __shared__ float sm[];
    const int dp = d + 1;
    float *qs = sm, *dos = qs + ATT_QB * d, *ks = dos + ATT_QB * d, *vs = ks + ATT_KC * dp;
    const int bi = blockIdx.z, h = blockIdx.y, i0 = blockIdx.x * ATT_QB;
    const int hk = h / (hq / hkv);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const size_t lrow = ((size_t)bi * hq + h) * t;

    for (int e = threadIdx.x; e < ATT_QB * d; e += ATT_THREADS) {
        int r = e / d, x = e % d, i = i0 + r;
        bool in = i < t;
        qs[e] = in ? lb_ld(q + att_row(bi, i, h, t, hq, d) + x) : 0.0f;
        dos[e] = in ? lb_ld(dout + att_row(bi, i, h, t, hq, d) + x) : 0.0f;
    }
    float li[ATT_ROWS], Di[ATT_ROWS], acc[ATT_ROWS][NR];
#pragma unroll
    for (int r = 0; r < ATT_ROWS; r++) {
        const int i = i0 + warp * ATT_ROWS + r;
        li[r] = i < t ? lse[lrow + i] : 0.0f;
        Di[r] = i < t ? D[lrow + i] : 0.0f;
#pragma unroll
        for (int rr = 0; rr < NR; rr++) acc[r][rr] = 0.0f;
    }
    const int ilast = min(i0 + ATT_QB, t) - 1;
    const int nchunks = ilast / ATT_KC + 1;
    for (int c = 0; c < nchunks; c++) {
        const int j0 = c * ATT_KC;
        __syncthreads();
        for (int e = threadIdx.x; e < ATT_KC * d; e += ATT_THREADS) {
            int jj = e / d, x = e % d, j = j0 + jj;
            bool in = j < t;
            ks[jj * dp + x] = in ? lb_ld(k + att_row(bi, j, hk, t, hkv, d) + x) : 0.0f;
            vs[jj * dp + x] = in ? lb_ld(v + att_row(bi, j, hk, t, hkv, d) + x) : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < ATT_ROWS; r++) {
            const int qr = warp * ATT_ROWS + r, i = i0 + qr;
            if (i >= t || j0 > i) continue;
            const int j = j0 + lane;
            float ds = 0.0f;
            if (j <= i) {
                const float *qrow = qs + qr * d, *grow = dos + qr * d;
                const float *krow = ks + lane * dp, *vrow = vs + lane * dp;
                float sdot = 0.0f, pdot = 0.0f;
                for (int x = 0; x < d; x++) {
                    sdot += qrow[x] * krow[x];
                    pdot += grow[x] * vrow[x];
                }
                const float p = expf(sdot * scale - li[r]);
                ds = p * (pdot - Di[r]);
            }
            for (int jj = 0; jj < ATT_KC; jj++) {
                const float dsj = __shfl_sync(0xffffffffu, ds, jj);
#pragma unroll
                for (int rr = 0; rr < NR; rr++) {
                    const int x = lane + 32 * rr;
                    if (x < d) acc[r][rr] += dsj * ks[jj * dp + x];
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ATT_ROWS; r++) {
        const int i = i0 + warp * ATT_ROWS + r;
        if (i >= t) continue;
        T *o = dq + att_row(bi, i, h, t, hq, d);
#pragma unroll
        for (int rr = 0; rr < NR; rr++) {
            const int x = lane + 32 * rr;
            if (x < d) lb_st(o + x, acc[r][rr] * scale);
        }
    }
}

// dk, dv: a block holds ATT_QB key rows of one (batch, kv head); query chunks of the group's
// heads stream through shared memory. Shared memory: kr, vr [ATT_QB][d] (the block's key and
// value rows, read by all lanes at once); qs, dos [ATT_KC][d + 1] (lane i forms q_i.k_j and
// dout_i.v_j); ls, Ds [ATT_KC] (lse and D of the chunk's queries).
template <int NR, typename T>
__global__ void __launch_bounds__(ATT_THREADS)
attn_bwd_dkdv_kernel(T *dk, T *dv, const T *dout, const T *q, const T *k, const T *v,
                     const float *lse, const float *D, int t, int hq, int hkv, int d, float scale)
{
    extern __shared__ float sm[];
    const int dp = d + 1;
    float *kr = sm, *vr = kr + ATT_QB * d, *qs = vr + ATT_QB * d, *dos = qs + ATT_KC * dp;
    float *ls = dos + ATT_KC * dp, *Ds = ls + ATT_KC;
    const int bi = blockIdx.z, hk = blockIdx.y, j0 = blockIdx.x * ATT_QB;
    const int group = hq / hkv;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    for (int e = threadIdx.x; e < ATT_QB * d; e += ATT_THREADS) {
        int r = e / d, x = e % d, j = j0 + r;
        bool in = j < t;
        kr[e] = in ? lb_ld(k + att_row(bi, j, hk, t, hkv, d) + x) : 0.0f;
        vr[e] = in ? lb_ld(v + att_row(bi, j, hk, t, hkv, d) + x) : 0.0f;
    }
    float ak[ATT_ROWS][NR], av[ATT_ROWS][NR];
#pragma unroll
    for (int r = 0; r < ATT_ROWS; r++)
#pragma unroll
        for (int rr = 0; rr < NR; rr++) ak[r][rr] = av[r][rr] = 0.0f;

    const int cfirst = j0 / ATT_KC, nchunks = (t + ATT_KC - 1) / ATT_KC;
    for (int h = hk * group; h < (hk + 1) * group; h++) {
        const size_t lrow = ((size_t)bi * hq + h) * t;
        for (int c = cfirst; c < nchunks; c++) {
            const int c0 = c * ATT_KC;
            __syncthreads();
            for (int e = threadIdx.x; e < ATT_KC * d; e += ATT_THREADS) {
                int ii = e / d, x = e % d, i = c0 + ii;
                bool in = i < t;
                qs[ii * dp + x] = in ? lb_ld(q + att_row(bi, i, h, t, hq, d) + x) : 0.0f;
                dos[ii * dp + x] = in ? lb_ld(dout + att_row(bi, i, h, t, hq, d) + x) : 0.0f;
            }
            if (threadIdx.x < ATT_KC) {
                int i = c0 + threadIdx.x;
                ls[threadIdx.x] = i < t ? lse[lrow + i] : 0.0f;
                Ds[threadIdx.x] = i < t ? D[lrow + i] : 0.0f;
            }
            __syncthreads();
#pragma unroll
            for (int r = 0; r < ATT_ROWS; r++) {
                const int kr_i = warp * ATT_ROWS + r, j = j0 + kr_i;
                if (j >= t || c0 + ATT_KC - 1 < j) continue;   // no query i >= j in the chunk
                const int i = c0 + lane;
                float p = 0.0f, ds = 0.0f;
                if (i >= j && i < t) {
                    const float *qrow = qs + lane * dp, *grow = dos + lane * dp;
                    const float *krow = kr + kr_i * d, *vrow = vr + kr_i * d;
                    float sdot = 0.0f, pdot = 0.0f;
                    for (int x = 0; x < d; x++) {
                        sdot += qrow[x] * krow[x];
                        pdot += grow[x] * vrow[x];
                    }
                    p = expf(sdot * scale - ls[lane]);
                    ds = p * (pdot - Ds[lane]);
                }
                for (int ii = 0; ii < ATT_KC; ii++) {
                    const float dsi = __shfl_sync(0xffffffffu, ds, ii);
                    const float pi = __shfl_sync(0xffffffffu, p, ii);
#pragma unroll
                    for (int rr = 0; rr < NR; rr++) {
                        const int x = lane + 32 * rr;
                        if (x < d) {
                            ak[r][rr] += dsi * qs[ii * dp + x];
                            av[r][rr] += pi * dos[ii * dp + x];
                        }
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ATT_ROWS; r++) {
        const int j = j0 + warp * ATT_ROWS + r;
        if (j >= t) continue;
        T *ok = dk + att_row(bi, j, hk, t, hkv, d), *ov = dv + att_row(bi, j, hk, t, hkv, d);
#pragma unroll
        for (int rr = 0; rr < NR; rr++) {
            const int x = lane + 32 * rr;
            if (x < d) {
                lb_st(ok + x, ak[r][rr] * scale);
                lb_st(ov + x, av[r][rr]);
            }
        }
    }
}

template <int NR>
static void launch_bwd(lb_cuda_ctx *cx, float *dq, float *dk, float *dv, const float *dout,
                       const float *q, const float *k, const float *v, const float *lse,
                       const float *D, int b, int t, int hq, int hkv, int d)
{
    float scale = (float)(1.0 / sqrt((double)d));
    size_t smem_dq = (size_t)(2 * ATT_QB * d + 2 * ATT_KC * (d + 1)) * sizeof(float);
    lb_cuda_smem_limit(attn_bwd_dq_kernel<NR, float>, smem_dq);
    dim3 gq((t + ATT_QB - 1) / ATT_QB, hq, b);
    attn_bwd_dq_kernel<NR, float><<<gq, ATT_THREADS, smem_dq, cx->stream>>>(
        dq, dout, q, k, v, lse, D, t, hq, hkv, d, scale);
    LB_CUDA_LAUNCHED(cx);
    size_t smem_kv = (size_t)(2 * ATT_QB * d + 2 * ATT_KC * (d + 1) + 2 * ATT_KC) * sizeof(float);
    lb_cuda_smem_limit(attn_bwd_dkdv_kernel<NR, float>, smem_kv);
    dim3 gk((t + ATT_QB - 1) / ATT_QB, hkv, b);
    attn_bwd_dkdv_kernel<NR, float><<<gk, ATT_THREADS, smem_kv, cx->stream>>>(
        dk, dv, dout, q, k, v, lse, D, t, hq, hkv, d, scale);
    LB_CUDA_LAUNCHED(cx);
}

static void cuda_attention_bwd(lb_backend *be, float *dq, float *dk, float *dv,
                               const float *dout, const float *q, const float *k, const float *v,
                               const uint16_t *q16, const uint16_t *k16, const uint16_t *v16,
                               const float *out, const uint16_t *out16, const float *lse, int b,
                               int t, int hq, int hkv, int d, int bf16)
{
    check_heads("attention_bwd", b, t, hq, hkv, d);
    if (!b || !t || !d) return;
    if (bf16 && d > 128) lb_die("attention_bwd: bf16 mode supports head dim <= 128, not %d", d);
    lb_cuda_ctx *cx = lb_cuda(be);
    if (!hq) {   // no query heads read k or v: their gradients are zero, as on the CPU
        size_t bytes = (size_t)b * t * hkv * d * sizeof(float);
        LB_CUDA_CHECK(cudaMemsetAsync(dk, 0, bytes, cx->stream));
        LB_CUDA_CHECK(cudaMemsetAsync(dv, 0, bytes, cx->stream));
        return;
    }
    long rows = (long)b * hq * t;
    // D, then (bf16 mode) the tensor-core kernels' bf16 operands
    size_t dbytes = ((size_t)rows * sizeof(float) + 255) / 256 * 256;
    size_t work = bf16 ? lb_cuda_attention_tc_work(cx, b, t, hq, hkv, d) : 0;
    float *D = (float *)lb_cuda_scratch(cx, dbytes + work);
    const unsigned rblocks = (unsigned)((rows + ATT_WARPS - 1) / ATT_WARPS);
    if (out16)
        attn_rowdot_kernel<float, __nv_bfloat16><<<rblocks, ATT_THREADS, 0, cx->stream>>>(
            D, dout, reinterpret_cast<const __nv_bfloat16 *>(out16), b, t, hq, d);
    else
        attn_rowdot_kernel<float, float><<<rblocks, ATT_THREADS, 0, cx->stream>>>(D, dout, out, b,
                                                                                 t, hq, d);
    LB_CUDA_LAUNCHED(cx);
    if (bf16) {   // tensor cores (attention_tc.cu), with the same D
        lb_cuda_attention_tc_bwd(cx, dq, dk, dv, dout, q, q16, k, k16, v, v16, lse, D,
                                 (char *)D + dbytes, b, t, hq, hkv, d);
        return;
    }
    if (d <= 32) launch_bwd<1>(cx, dq, dk, dv, dout, q, k, v, lse, D, b, t, hq, hkv, d);
    else if (d <= 64) launch_bwd<2>(cx, dq, dk, dv, dout, q, k, v, lse, D, b, t, hq, hkv, d);
    else if (d <= 128) launch_bwd<4>(cx, dq, dk, dv, dout, q, k, v, lse, D, b, t, hq, hkv, d);
    else launch_bwd<8>(cx, dq, dk, dv, dout, q, k, v, lse, D, b, t, hq, hkv, d);
}

// --- KV cache: append and attention over it (sampling) ----------------------------------------
// attention_cached reproduces attn_fwd_kernel's arithmetic for one query row exactly: key
// chunks of ATT_KC positions aligned at 0, lane j forming q.k_j over x in order, the same
// online-softmax updates and warp reductions, values accumulated in key order. Only the
// staging differs (one warp per row, keys read from the cache instead of shared memory), and
// that moves no rounding. Keys past pos[i] are skipped where the training kernel adds
// 0 * v (the same sum unless an accumulator is exactly -0).

// Element x of cache row `row` (slot, head, pos flattened), fp32 or E4M3 * block scale (the
// dequantize expression of the training forward's fake quantization).
__device__ __forceinline__ float kv_load(const lb_kv_layer &c, const void *data,
                                         const float *scales, size_t row, int x, int nb)
{
    if (!c.fp8) return ((const float *)data)[row * c.d + x];
    const float e = lb_e4m3_decode(((const uint8_t *)data)[row * c.d + x]);
    return __fmul_rn(e, scales[row * nb + x / 128]);   // as quant.cu's dequantize rounds it
}

__device__ __forceinline__ bool kv_row_ok(const lb_kv_layer &c, int sl, int ps)
{
    return sl >= 0 && sl < c.slots && ps >= 0 && ps < c.cap;
}

// One block per (token i, kv head h): copies the row's d elements (fp32), rounds them to bf16
// (zeros to the row's end, lb_kv_ld), or copies d codes and nb scales (fp8) to (slot[i], h,
// pos[i]).
__global__ void kv_append_kernel(lb_kv_layer c, const float *k, const float *v,
                                 const uint8_t *kcodes, const uint8_t *vcodes, size_t kld,
                                 size_t vld, const float *kscale, const float *vscale,
                                 const int32_t *slot, const int32_t *pos,
                                 unsigned long long *err)
{
    const int i = blockIdx.x / c.hkv, h = blockIdx.x % c.hkv, d = c.d, nb = (d + 127) / 128;
    const int sl = slot[i], ps = pos[i];
    if (!kv_row_ok(c, sl, ps)) {
        if (threadIdx.x == 0) lb_report(err, LB_CERR_KV_ROW, sl >= 0 && sl < c.slots ? ps : sl);
        return;
    }
    const size_t dst = ((size_t)sl * c.hkv + h) * c.cap + ps, src = (size_t)i * c.hkv + h;
    if (c.bf16) {
        const int ld = (d + 15) / 16 * 16;
        for (int x = threadIdx.x; x < ld; x += blockDim.x) {
            ((__nv_bfloat16 *)c.k)[dst * ld + x] = __float2bfloat16_rn(x < d ? k[src * d + x] : 0.0f);
            ((__nv_bfloat16 *)c.v)[dst * ld + x] = __float2bfloat16_rn(x < d ? v[src * d + x] : 0.0f);
        }
        return;
    }
    if (!c.fp8) {
        for (int x = threadIdx.x; x < d; x += blockDim.x) {
            ((float *)c.k)[dst * d + x] = k[src * d + x];
            ((float *)c.v)[dst * d + x] = v[src * d + x];
        }
        return;
    }
    for (int x = threadIdx.x; x < d; x += blockDim.x) {
        ((uint8_t *)c.k)[dst * d + x] = kcodes[src * kld + x];
        ((uint8_t *)c.v)[dst * d + x] = vcodes[src * vld + x];
    }
    for (int x = threadIdx.x; x < nb; x += blockDim.x) {
        c.ks[dst * nb + x] = kscale[src * nb + x];
        c.vs[dst * nb + x] = vscale[src * nb + x];
    }
}

static void cuda_kv_append(lb_backend *be, const lb_kv_layer *c, const float *k, const float *v,
                           const struct lb_qmat *kq, const struct lb_qmat *vq,
                           const int32_t *slot, const int32_t *pos, int n)
{
    if (n < 0) lb_die("kv_append: negative row count %d", n);
    if (!n || !c->hkv || !c->d) return;
    lb_cuda_ctx *cx = lb_cuda(be);
    const uint8_t *kc = NULL, *vc = NULL;
    const float *ksc = NULL, *vsc = NULL;
    size_t kld = 0, vld = 0;
    if (c->fp8) {
        const struct lb_qmat *qs[2] = {kq, vq};
        for (int w = 0; w < 2; w++) {
            const struct lb_qmat *q = qs[w];
            if (!q || q->fmt != LB_FMT_FP8_BLOCK || q->elem != LB_E4M3 || q->brows != 1 ||
                q->bcols != 128 ||
                q->rows != n * c->hkv || q->cols != c->d)
                lb_die("kv_append: an fp8 cache takes row-wise fp8-block (1x128) "
                       "quantizations of (%d, %d)", n * c->hkv, c->d);
        }
        kc = kq->data, vc = vq->data, kld = kq->ld, vld = vq->ld;
        ksc = (const float *)kq->scale, vsc = (const float *)vq->scale;
    }
    kv_append_kernel<<<(unsigned)n * c->hkv, 128, 0, cx->stream>>>(
        *c, k, v, kc, vc, kld, vld, ksc, vsc, slot, pos, cx->err_dev);
    LB_CUDA_LAUNCHED(cx);
}

// One warp per (token i, query head h); sm holds each warp's query row (ATT_WARPS, d).
template <int NR>
__global__ void __launch_bounds__(ATT_THREADS)
attn_cached_kernel(float *out, const float *q, lb_kv_layer c, const int32_t *slot,
                   const int32_t *pos, int n, int hq, float scale, unsigned long long *err)
{
    extern __shared__ float sm[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, d = c.d;
    const long r = (long)blockIdx.x * ATT_WARPS + warp;
    if (r >= (long)n * hq) return;   // whole warps only; no block barrier follows
    const int i = (int)(r / hq), h = (int)(r % hq), hk = h / (hq / c.hkv);
    const int sl = slot[i], ps = pos[i], nb = (d + 127) / 128;
    float *o = out + ((size_t)i * hq + h) * d;
    if (!kv_row_ok(c, sl, ps)) {
        if (lane == 0) lb_report(err, LB_CERR_KV_ROW, sl >= 0 && sl < c.slots ? ps : sl);
        for (int x = lane; x < d; x += 32) o[x] = NAN;
        return;
    }
    float *qs = sm + warp * d;
    for (int x = lane; x < d; x += 32) qs[x] = q[((size_t)i * hq + h) * d + x];
    __syncwarp();
    const size_t row0 = ((size_t)sl * c.hkv + hk) * c.cap;   // cache row of position 0
    float m = -INFINITY, l = 0.0f, acc[NR];
#pragma unroll
    for (int rr = 0; rr < NR; rr++) acc[rr] = 0.0f;
    for (int j0 = 0; j0 <= ps; j0 += ATT_KC) {
        const int j = j0 + lane;
        float s = -INFINITY;
        if (j <= ps) {
            const size_t kr = row0 + j;
            float dot = 0.0f;
            for (int x = 0; x < d; x++) {
                const float kx = kv_load(c, c.k, c.ks, kr, x, nb);
                dot += qs[x] * kx;
            }
            s = dot * scale;
        }
        const float mn = fmaxf(m, lb_warp_max(s));
        const float alpha = expf(m - mn);
        const float p = j <= ps ? expf(s - mn) : 0.0f;
        l = l * alpha + lb_warp_sum(p);
#pragma unroll
        for (int rr = 0; rr < NR; rr++) acc[rr] *= alpha;
        const int last = min(ATT_KC, ps - j0 + 1);
        for (int jj = 0; jj < last; jj++) {
            const float pj = __shfl_sync(0xffffffffu, p, jj);
            const size_t vr = row0 + j0 + jj;
#pragma unroll
            for (int rr = 0; rr < NR; rr++) {
                const int x = lane + 32 * rr;
                if (x < d) acc[rr] += pj * kv_load(c, c.v, c.vs, vr, x, nb);
            }
        }
        m = mn;
    }
#pragma unroll
    for (int rr = 0; rr < NR; rr++) {
        const int x = lane + 32 * rr;
        if (x < d) o[x] = acc[rr] / l;
    }
}

template <int NR>
static void launch_cached(lb_cuda_ctx *cx, float *out, const float *q, const lb_kv_layer *c,
                          const int32_t *slot, const int32_t *pos, int n, int hq)
{
    long rows = (long)n * hq;
    size_t smem = (size_t)ATT_WARPS * c->d * sizeof(float);
    attn_cached_kernel<NR><<<(unsigned)((rows + ATT_WARPS - 1) / ATT_WARPS), ATT_THREADS, smem,
                             cx->stream>>>(out, q, *c, slot, pos, n, hq,
                                           (float)(1.0 / sqrt((double)c->d)), cx->err_dev);
    LB_CUDA_LAUNCHED(cx);
}

static void cuda_attention_cached(lb_backend *be, float *out, const float *q,
                                  const lb_kv_layer *c, const int32_t *slot, const int32_t *pos,
                                  int n, int hq, int bf16)
{
    check_heads("attention_cached", 1, 1, hq, c->hkv, c->d);
    if (n < 0) lb_die("attention_cached: negative row count %d", n);
    if (!n || !hq || !c->d) return;
    lb_cuda_ctx *cx = lb_cuda(be);
    int d = c->d;
    if (c->bf16 && !bf16) lb_die("attention_cached: a bf16 cache is read in bf16 mode only");
    if (bf16) {   // tensor cores (attention_tc.cu)
        if (d > 128) lb_die("attention_cached: bf16 mode supports head dim <= 128, not %d", d);
        lb_cuda_attention_tc_cached(cx, out, q, c, slot, pos, n, hq);
        return;
    }
    if (d <= 32) launch_cached<1>(cx, out, q, c, slot, pos, n, hq);
    else if (d <= 64) launch_cached<2>(cx, out, q, c, slot, pos, n, hq);
    else if (d <= 128) launch_cached<4>(cx, out, q, c, slot, pos, n, hq);
    else launch_cached<8>(cx, out, q, c, slot, pos, n, hq);
}

// The table's entries take argument structs (kernels.h); the kernels' hosts above take
// the fields.

// kernels.h: bf16 operands (q16, k16, v16, out16) in bf16 mode only.
static void check_inputs16(const char *what, const lb_attention_args *a)
{
    if (!a->bf16 && (a->q16 || a->k16 || a->v16 || a->out16))
        lb_die("%s: bf16 operands (q16, k16, v16, out16) are taken in bf16 mode only", what);
}

static void cuda_attention_fwd_op(lb_backend *be, const lb_attention_args *a)
{
    check_inputs16("attention_fwd", a);
    cuda_attention_fwd(be, a->out, a->out16, a->lse, a->q, a->k, a->v, a->q16, a->k16, a->v16,
                       a->b, a->t, a->hq, a->hkv, a->d, a->bf16);
}

static void cuda_attention_bwd_op(lb_backend *be, const lb_attention_args *a)
{
    check_inputs16("attention_bwd", a);
    cuda_attention_bwd(be, a->dq, a->dk, a->dv, a->dout, a->q, a->k, a->v, a->q16, a->k16,
                       a->v16, a->out, a->out16, a->lse, a->b, a->t, a->hq, a->hkv, a->d,
                       a->bf16);
}

extern "C" void lb_cuda_init_attention(lb_backend *be)
{
    be->attention_fwd = cuda_attention_fwd_op;
    be->attention_bwd = cuda_attention_bwd_op;
    be->kv_append = cuda_kv_append;
    be->attention_cached = cuda_attention_cached;
}
