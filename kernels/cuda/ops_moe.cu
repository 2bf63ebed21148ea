// ops_moe.cu: the MoE router (softmax, top-k), the Switch load-balancing loss and token
// dispatch (plan, permute, combine) for the CUDA backend.
//
// Layouts (kernels.h): logits, probs, dlogits (n, e); idx, weight, dweight, row (n, k);
// x, out (n, c); permuted buffers xp, yp (n*k, c).
//
// Determinism: router rows are one warp each, a row's result depending on that row alone;
// selection is exact comparison. Slot sums run in slot order, in double, exactly as the CPU
// reference (so combine and permute_bwd match it bit for bit). The plan is a stable sort of
// expert ids (a counting sort in one block at decode sizes, else CUB's radix sort), so rows come
// sorted by (expert, token, slot) by construction. Expert counts for the aux loss use integer
// atomics in shared memory: integer addition is exact and order-free, so the counts are the same
// whatever the order. No floating-point atomics.
#include "kernels/cuda/cuda.cuh"
#include "kernels/router.h"

#include <cub/cub.cuh>
#include <limits.h>
#include <string.h>

#define ROW_WARPS 8
#define RED_THREADS 256
#define COL_CHUNK 128

// Does (pa, a) come before (pb, b) in the selection order: decreasing probability, then
// increasing index? (The CPU reference's rule.)
__device__ __forceinline__ bool ranks_before(float pa, int a, float pb, int b)
{
    return pa > pb || (pa == pb && a < b);
}

// --- router ----------------------------------------------------------------------------------

// One warp per row. probs holds exp(l - max) until the row's sum is known. The s-th choice is
// the best-ranked expert ranked after choice s-1: each lane proposes its best among its
// experts, and the xor butterfly keeps the better of each pair (a strict total order, so every
// lane ends with the same winner).
template <typename T>
__global__ void router_fwd_kernel(float *probs, int32_t *idx, float *weight, const T *logits,
                                  int n, int e, int k, int renorm, unsigned long long *err)
{
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * ROW_WARPS + (threadIdx.x >> 5);
    if (row >= n) return;
    const T *l = logits + (size_t)row * e;
    float *p = probs + (size_t)row * e;
    float m = -INFINITY;
    bool bad = false;
    for (int j = lane; j < e; j += 32) {
        float v = lb_ld(l + j);
        bad |= !isfinite(v);
        m = fmaxf(m, v);
    }
    if (__any_sync(0xffffffffu, bad) && lane == 0) lb_report(err, LB_CERR_ROUTER_LOGIT, row);
    m = lb_warp_max(m);
    double sum = 0.0;
    for (int j = lane; j < e; j += 32) {
        float ex = expf(lb_ld(l + j) - m);
        p[j] = ex;
        sum += ex;
    }
    sum = lb_warp_sum(sum);
    for (int j = lane; j < e; j += 32) p[j] = (float)(p[j] / sum);   // own elements only

    float prev_p = 0.0f;
    int prev = -1;
    double wsum = 0.0;
    for (int s = 0; s < k; s++) {
        float bp = -1.0f;   // probabilities are >= 0: -1 marks "no candidate"
        int bj = INT_MAX;
        for (int j = lane; j < e; j += 32) {
            float pj = p[j];
            if (prev >= 0 && !ranks_before(prev_p, prev, pj, j)) continue;
            if (bj == INT_MAX || ranks_before(pj, j, bp, bj)) bp = pj, bj = j;
        }
        for (int o = 16; o > 0; o >>= 1) {
            float op = __shfl_xor_sync(0xffffffffu, bp, o);
            int oj = __shfl_xor_sync(0xffffffffu, bj, o);
            if (ranks_before(op, oj, bp, bj)) bp = op, bj = oj;
        }
        prev_p = bp, prev = bj;
        wsum += bp;
        if (lane == 0) {
            idx[(size_t)row * k + s] = bj;
            weight[(size_t)row * k + s] = bp;
        }
    }
    if (renorm && lane == 0)
        for (int s = 0; s < k; s++) {
            float *w = weight + (size_t)row * k + s;
            *w = (float)(*w / wsum);
        }
}

static void cuda_router_topk_fwd(lb_backend *be, float *probs, int32_t *idx, float *weight,
                                 const float *logits, int n, int e, int k, int renorm)
{
    if (n < 0 || k < 0 || k > e || (n > 0 && e < 1))
        lb_die("router_topk_fwd: k %d outside [0, %d] or no experts", k, e);
    if (!n) return;
    lb_cuda_ctx *cx = lb_cuda(be);
    router_fwd_kernel<float><<<(n + ROW_WARPS - 1) / ROW_WARPS, ROW_WARPS * 32, 0, cx->stream>>>(
        probs, idx, weight, logits, n, e, k, renorm, cx->err_dev);
    LB_CUDA_LAUNCHED(cx);
}

// Weights w_s = p_{idx_s} (/ S with S = sum_t p_{idx_t} when renorm), so
//   dp_{idx_s} = dw_s                                  (no renorm)
//   dp_{idx_s} = (dw_s - sum_t dw_t w_t) / S           (renorm)
// plus dprobs_expert[j] on every p_j, then the softmax backward dl = p (dp - sum_j p_j dp_j).
// One warp per row; dlogits holds dp while the row is worked on; lane 0 adds the k slot terms
// in slot order (the CPU's arithmetic), __syncwarp orders the lanes' global accesses.
__global__ void router_bwd_kernel(float *dlogits, const float *dweight,
                                  const float *dprobs_expert, const float *probs,
                                  const int32_t *idx, int n, int e, int k, int renorm,
                                  unsigned long long *err)
{
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * ROW_WARPS + (threadIdx.x >> 5);
    if (row >= n) return;
    const float *p = probs + (size_t)row * e, *dw = dweight + (size_t)row * k;
    const int32_t *ix = idx + (size_t)row * k;
    float *dl = dlogits + (size_t)row * e;
    for (int j = lane; j < e; j += 32) dl[j] = dprobs_expert ? dprobs_expert[j] : 0.0f;
    __syncwarp();
    if (lane == 0) {
        bool ok = true;
        for (int s = 0; s < k; s++)
            if (ix[s] < 0 || ix[s] >= e) {
                lb_report(err, LB_CERR_ROUTER_BWD_IDX, ix[s]);
                ok = false;
            }
        if (ok && renorm) {
            double S = 0.0, dot = 0.0;
            for (int s = 0; s < k; s++) S += p[ix[s]];
            for (int s = 0; s < k; s++) dot += (double)dw[s] * (p[ix[s]] / S);
            for (int s = 0; s < k; s++) dl[ix[s]] += (float)((dw[s] - dot) / S);
        } else if (ok) {
            for (int s = 0; s < k; s++) dl[ix[s]] += dw[s];
        }
    }
    __syncwarp();
    double pdp = 0.0;
    for (int j = lane; j < e; j += 32) pdp += (double)p[j] * dl[j];
    pdp = lb_warp_sum(pdp);
    for (int j = lane; j < e; j += 32) dl[j] = (float)(p[j] * (dl[j] - pdp));
}

static void cuda_router_topk_bwd(lb_backend *be, float *dlogits, const float *dweight,
                                 const float *dprobs_expert, const float *probs,
                                 const int32_t *idx, int n, int e, int k, int renorm)
{
    if (n < 0 || e < 0 || k < 0) lb_die("router_topk_bwd: negative size");
    if (!n || !e) return;
    lb_cuda_ctx *cx = lb_cuda(be);
    router_bwd_kernel<<<(n + ROW_WARPS - 1) / ROW_WARPS, ROW_WARPS * 32, 0, cx->stream>>>(
        dlogits, dweight, dprobs_expert, probs, idx, n, e, k, renorm, cx->err_dev);
    LB_CUDA_LAUNCHED(cx);
}

// --- load-balancing loss ---------------------------------------------------------------------

// counts (e): assignments per expert, one block, a shared-memory histogram (exact integers).
__global__ void expert_count_kernel(int *counts, const int32_t *idx, size_t total, int e,
                                    unsigned long long *err)
{
    extern __shared__ int hist[];
    for (int j = threadIdx.x; j < e; j += blockDim.x) hist[j] = 0;
    __syncthreads();
    for (size_t a = threadIdx.x; a < total; a += blockDim.x) {
        int j = idx[a];
        if (j < 0 || j >= e) lb_report(err, LB_CERR_AUX_IDX, j);
        else atomicAdd(&hist[j], 1);
    }
    __syncthreads();
    for (int j = threadIdx.x; j < e; j += blockDim.x) counts[j] = hist[j];
}

// Partials of column sums of x (n, c) over row chunks of COL_CHUNK (see ops_basic.cu's
// lb_cuda_colsum_partials): block (row chunk, column block) of (32, 8) threads.
__global__ void colsum_rows_kernel(double *part, const float *x, int n, int c)
{
    __shared__ double sh[8][33];
    int j = blockIdx.y * 32 + threadIdx.x, ch = blockIdx.x;
    int lo = ch * COL_CHUNK, hi = lo + COL_CHUNK < n ? lo + COL_CHUNK : n;
    double s = 0.0;
    if (j < c)
        for (int i = lo + threadIdx.y; i < hi; i += 8) s += x[(size_t)i * c + j];
    sh[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && j < c) {
        double t = 0.0;
        for (int y = 0; y < 8; y++) t += sh[y][threadIdx.x];
        part[(size_t)ch * c + j] = t;
    }
}

// loss = e sum_j f_j P_j, f_j = count_j / (n k), P_j = psum_j / n; one thread, experts in
// order, the CPU reference's expressions.
__global__ void aux_loss_final_kernel(float *loss, float *dprobs_expert, const int *counts,
                                      const double *psum, int n, int e, int k)
{
    if (threadIdx.x || blockIdx.x) return;
    double total = 0.0;
    for (int j = 0; j < e; j++) {
        double f = (double)counts[j] / ((double)n * k);
        total += f * (psum[j] / n);
        dprobs_expert[j] = (float)(e * f / n);
    }
    *loss = (float)(e * total);
}

static void cuda_moe_aux_loss(lb_backend *be, float *loss, float *dprobs_expert,
                              const float *probs, const int32_t *idx, int n, int e, int k)
{
    if (n < 0 || e < 0 || k < 0) lb_die("moe_aux_loss: negative size");
    lb_cuda_ctx *cx = lb_cuda(be);
    if (n == 0 || k == 0 || e == 0) {
        if (e) LB_CUDA_CHECK(cudaMemsetAsync(dprobs_expert, 0, (size_t)e * sizeof(float),
                                             cx->stream));
        *loss = 0.0f;
        return;
    }
    if ((size_t)e * sizeof(int) > 48 * 1024) lb_die("moe_aux_loss: %d experts is too many", e);
    if ((e + 31) / 32 > 65535) lb_die("moe_aux_loss: %d experts is too many", e);
    int nch = (n + COL_CHUNK - 1) / COL_CHUNK;
    size_t b_counts = lb_align256((size_t)e * sizeof(int));
    size_t b_psum = lb_align256((size_t)e * sizeof(double));
    size_t b_part = lb_align256((size_t)nch * e * sizeof(double));
    size_t b_work = lb_align256(lb_cuda_colsum_work(nch, e));
    char *s = (char *)lb_cuda_scratch(cx, b_counts + b_psum + b_part + 256 + b_work);
    int *counts = (int *)s;
    double *psum = (double *)(s + b_counts), *part = (double *)(s + b_counts + b_psum);
    float *dloss = (float *)(s + b_counts + b_psum + b_part);
    expert_count_kernel<<<1, 1024, (size_t)e * sizeof(int), cx->stream>>>(
        counts, idx, (size_t)n * k, e, cx->err_dev);
    LB_CUDA_LAUNCHED(cx);
    dim3 grid(nch, (e + 31) / 32), block(32, 8);
    colsum_rows_kernel<<<grid, block, 0, cx->stream>>>(part, probs, n, e);
    LB_CUDA_LAUNCHED(cx);
    lb_cuda_colsum_partials(cx, part, nch, e, (double *)(s + b_counts + b_psum + b_part + 256),
                            psum, NULL);
    aux_loss_final_kernel<<<1, 32, 0, cx->stream>>>(dloss, dprobs_expert, counts, psum, n, e, k);
    LB_CUDA_LAUNCHED(cx);
    float *h = (float *)lb_cuda_host_stage(cx, sizeof(float));
    LB_CUDA_CHECK(cudaMemcpyAsync(h, dloss, sizeof(float), cudaMemcpyDeviceToHost, cx->stream));
    LB_CUDA_WAIT(cx);
    *loss = *h;
}

// --- dispatch --------------------------------------------------------------------------------

__global__ void iota_kernel_moe(int32_t *x, int n)
{
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        x[i] = i;
}

// After the stable sort, sorted position p is the row of assignment order[p].
__global__ void plan_rows_kernel(int32_t *row, const int32_t *order, int total)
{
    for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < total; p += gridDim.x * blockDim.x)
        row[order[p]] = p;
}

// counts[j] = (first position with key > j) - (first position with key >= j), by binary
// search over the sorted keys; experts outside [0, e) are reported.
__global__ void plan_counts_kernel(int *counts, const int32_t *keys, int total, int e,
                                   unsigned long long *err)
{
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j == 0 && keys[0] < 0) lb_report(err, LB_CERR_PLAN_IDX, keys[0]);
    if (j == 0 && keys[total - 1] >= e) lb_report(err, LB_CERR_PLAN_IDX, keys[total - 1]);
    if (j >= e) return;
    int lo = 0, hi = total;   // first position with key >= j
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (keys[mid] < j) lo = mid + 1;
        else hi = mid;
    }
    int a = lo;
    hi = total;               // first position with key > j
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (keys[mid] <= j) lo = mid + 1;
        else hi = mid;
    }
    counts[j] = lo - a;
}

// The plan of up to PLAN_CHUNKS * PLAN_THREADS assignments and PLAN_SMALL_E experts in one
// launch (the sort path takes four, some 27 us at a decode step's 2048 x 128): a stable counting
// sort in one block of PLAN_THREADS. Bucket j + 1 holds expert j; indices < 0 go to bucket 0 and
// indices >= e to bucket e + 1, as the sort puts them first and last (it orders them by value
// among themselves, this by assignment: either way every assignment gets a distinct row in
// [0, total), so nothing downstream writes out of bounds).
//  1. Thread t holds assignments a = c * PLAN_THREADS + t in registers. __match_any_sync groups a
//     warp's lanes by bucket: rank = the group's lanes below; leaders add the group's size to
//     the histogram (integer atomics: order-free).
//  2. counts = the histogram's experts; base = its exclusive scan, each bucket's first row.
//  3. Chunk by chunk (c in order), leaders store their group's size in tab[bucket][warp]; one
//     warp per bucket scans these over warps from base[bucket] and advances base. Then
//     row[a] = tab[bucket][warp] + rank: rows ordered by (bucket, c, warp, lane), i.e. by
//     (bucket, a), the stable sort's rows.
// Shared memory: (e + 2) ints of base and (e + 2) * PLAN_STRIDE uint16 of tab (its entries are
// < total <= 16384), 72 bytes a bucket: 9 KB at e = 128, 72 KB at e = 1024 (above the default
// 48 KB: lb_cuda_smem_limit). 32 ints a bucket would be 132 KB at e = 1024.
#define PLAN_THREADS 1024
#define PLAN_CHUNKS 16     // registers a thread holds: total <= 16384
#define PLAN_SMALL_E 1024
#define PLAN_STRIDE 34     // tab's 32 warps a bucket, padded: one warp's buckets in distinct banks
#define PLAN_NONE 2047     // the bucket of a lane past the end (11 bits, beyond e + 1)

// Inclusive prefix sum over a warp's lanes.
__device__ __forceinline__ int plan_warp_scan(int v)
{
    for (int o = 1; o < 32; o <<= 1) {
        const int t = __shfl_up_sync(0xffffffffu, v, o);
        if ((threadIdx.x & 31) >= o) v += t;
    }
    return v;
}

// One block an SM: without the 1 ptxas holds it to 32 registers (two blocks) and spills key[].
__global__ void __launch_bounds__(PLAN_THREADS, 1)
plan_small_kernel(int32_t *row, int *counts, const int32_t *idx, int total, int e,
                  unsigned long long *err)
{
    extern __shared__ int base[];   // (e + 2): the histogram, then each bucket's next row
    __shared__ int wsum[32], kmin, kmax;
    const int nb = e + 2, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned below = (1u << lane) - 1;
    uint16_t *tab = (uint16_t *)(base + nb);
    for (int i = threadIdx.x; i < nb; i += PLAN_THREADS) base[i] = 0;
    for (int i = threadIdx.x; i < nb * PLAN_STRIDE / 2; i += PLAN_THREADS) ((int *)tab)[i] = 0;
    if (threadIdx.x == 0) kmin = INT_MAX, kmax = INT_MIN;
    __syncthreads();

    int key[PLAN_CHUNKS];   // the index, then bucket | rank << 11 | group size << 16
#pragma unroll
    for (int c = 0; c < PLAN_CHUNKS; c++) {   // all loads in flight at once
        const int a = c * PLAN_THREADS + threadIdx.x;
        key[c] = a < total ? idx[a] : 0;
    }
    int lo = INT_MAX, hi = INT_MIN;
#pragma unroll
    for (int c = 0; c < PLAN_CHUNKS; c++) {
        if (c * PLAN_THREADS >= total) break;   // the same for the whole block
        int b = PLAN_NONE;
        if (c * PLAN_THREADS + (int)threadIdx.x < total) {
            const int v = key[c];
            lo = min(lo, v), hi = max(hi, v);
            b = v < 0 ? 0 : v >= e ? e + 1 : v + 1;
        }
        const unsigned m = __match_any_sync(0xffffffffu, b);
        const int rank = __popc(m & below), size = __popc(m);
        if (b != PLAN_NONE && rank == 0) atomicAdd(&base[b], size);
        key[c] = b | rank << 11 | size << 16;
    }
    lo = __reduce_min_sync(0xffffffffu, lo);
    hi = __reduce_max_sync(0xffffffffu, hi);
    if (lane == 0) atomicMin(&kmin, lo), atomicMax(&kmax, hi);
    __syncthreads();
    if (threadIdx.x == 0) {   // plan_counts_kernel's reports: the smallest, then the largest
        if (kmin < 0) lb_report(err, LB_CERR_PLAN_IDX, kmin);
        if (kmax >= e) lb_report(err, LB_CERR_PLAN_IDX, kmax);
    }

    // Exclusive scan of the histogram, buckets 2t and 2t + 1 to thread t (nb <= 2 * 1024).
    const int i = 2 * threadIdx.x;
    const int h0 = i < nb ? base[i] : 0, h1 = i + 1 < nb ? base[i + 1] : 0;
    if (i >= 1 && i <= e) counts[i - 1] = h0;   // valid experts only
    if (i + 1 <= e) counts[i] = h1;
    const int s = plan_warp_scan(h0 + h1);
    if (lane == 31) wsum[warp] = s;
    __syncthreads();
    if (warp == 0) {
        const int w = wsum[lane];
        wsum[lane] = plan_warp_scan(w) - w;
    }
    __syncthreads();
    const int first = wsum[warp] + s - h0 - h1;
    if (i < nb) base[i] = first;
    if (i + 1 < nb) base[i + 1] = first + h0;
    __syncthreads();

#pragma unroll
    for (int c = 0; c < PLAN_CHUNKS; c++) {
        if (c * PLAN_THREADS >= total) break;
        const int b = key[c] & 2047, rank = key[c] >> 11 & 31, size = key[c] >> 16;
        const int slot = b * PLAN_STRIDE + warp;
        if (b != PLAN_NONE && rank == 0) tab[slot] = (uint16_t)size;
        __syncthreads();
        for (int j = warp; j < nb; j += 32) {   // bucket j: its chunk counts over warps
            const int v = tab[j * PLAN_STRIDE + lane];
            if (!__any_sync(0xffffffffu, v)) continue;
            const int incl = plan_warp_scan(v);
            const int b0 = __shfl_sync(0xffffffffu, lane == 31 ? base[j] : 0, 31);
            if (v) tab[j * PLAN_STRIDE + lane] = (uint16_t)(b0 + incl - v);
            if (lane == 31) base[j] = b0 + incl;   // lane 31 alone reads and writes base[j]
        }
        __syncthreads();
        if (b != PLAN_NONE) row[c * PLAN_THREADS + threadIdx.x] = tab[slot] + rank;
        __syncwarp();   // the group has read its entry before the leader clears it
        if (b != PLAN_NONE && rank == 0) tab[slot] = 0;   // zero again for the next chunk
        __syncwarp();   // cleared before the warp's next leaders store
    }
}

static void cuda_moe_plan(lb_backend *be, int32_t *row, int *counts_host, int *counts_out,
                          const int32_t *idx, int n, int e, int k)
{
    if (n < 0 || e < 0 || k < 0) lb_die("moe_plan: negative size");
    if ((size_t)n * k > INT32_MAX) lb_die("moe_plan: %d x %d assignments overflow int32", n, k);
    lb_cuda_ctx *cx = lb_cuda(be);
    int total = n * k;
    if (total == 0) {
        if (e && counts_host) memset(counts_host, 0, (size_t)e * sizeof(int));
        if (e && counts_out) LB_CUDA_CHECK(cudaMemsetAsync(counts_out, 0, (size_t)e * sizeof(int),
                                                           cx->stream));
        return;
    }
    size_t b_counts = lb_align256((size_t)(e ? e : 1) * sizeof(int));
    int *counts;
    if (total <= PLAN_CHUNKS * PLAN_THREADS && e <= PLAN_SMALL_E) {
        // One launch; scratch only for counts the caller has no buffer for.
        counts = counts_out ? counts_out : (int *)lb_cuda_scratch(cx, b_counts);
        size_t smem = (size_t)(e + 2) * (sizeof(int) + PLAN_STRIDE * sizeof(uint16_t));
        lb_cuda_smem_limit(plan_small_kernel, smem);
        plan_small_kernel<<<1, PLAN_THREADS, smem, cx->stream>>>(row, counts, idx, total, e,
                                                                 cx->err_dev);
        LB_CUDA_LAUNCHED(cx);
    } else {
        size_t tmp_bytes = 0;
        LB_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(NULL, tmp_bytes, (const int32_t *)NULL,
                                                      (int32_t *)NULL, (const int32_t *)NULL,
                                                      (int32_t *)NULL, total, 0, 32, cx->stream));
        size_t arr = lb_align256((size_t)total * sizeof(int32_t));
        char *s = (char *)lb_cuda_scratch(cx, 3 * arr + b_counts + lb_align256(tmp_bytes));
        int32_t *iota = (int32_t *)s, *keys = (int32_t *)(s + arr);
        int32_t *order = (int32_t *)(s + 2 * arr);
        counts = counts_out ? counts_out : (int *)(s + 3 * arr);
        void *tmp = s + 3 * arr + b_counts;
        iota_kernel_moe<<<lb_grid(total, 256, cx), 256, 0, cx->stream>>>(iota, total);
        LB_CUDA_LAUNCHED(cx);
        LB_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(tmp, tmp_bytes, idx, keys, iota, order,
                                                      total, 0, 32, cx->stream));
        plan_rows_kernel<<<lb_grid(total, 256, cx), 256, 0, cx->stream>>>(row, order, total);
        LB_CUDA_LAUNCHED(cx);
        plan_counts_kernel<<<(e + 255) / 256 > 0 ? (e + 255) / 256 : 1, 256, 0, cx->stream>>>(
            counts, keys, total, e, cx->err_dev);
        LB_CUDA_LAUNCHED(cx);
    }
    if (!counts_host) return;   // gemm_experts reads counts on the device: no wait
    if (e) {
        int *h = (int *)lb_cuda_host_stage(cx, (size_t)e * sizeof(int));
        LB_CUDA_CHECK(cudaMemcpyAsync(h, counts, (size_t)e * sizeof(int), cudaMemcpyDeviceToHost,
                                      cx->stream));
        LB_CUDA_WAIT(cx);
        memcpy(counts_host, h, (size_t)e * sizeof(int));
    } else {
        LB_CUDA_WAIT(cx);   // e == 0 with assignments: every index is out of range (reported)
    }
}

// The dispatcher's data movement: one warp per row (MOE_WARPS rows per block), 16 bytes per
// lane when vec (c % 4 == 0 and the buffers 16-byte aligned, so every row is), else 4. A
// block per row of a few kilobytes, or a thread per element with a 64-bit division each, had
// run these at 1.6 to 1.9 TB/s.
#define MOE_WARPS 8

// xp (n*k, c): warp a copies x[a / k] to xp[row[a]]. Rows of a plan are distinct.
// xp16: NULL, or its bf16 copy (kernels.h). x16 (rows of pitch ld16), where given, is the
// source instead of x: copied as it is into xp16, widened into xp.
__global__ void permute_kernel(float *xp, uint16_t *xp16, const float *x, const uint16_t *x16,
                               size_t ld16, const int32_t *row, int k, int c, int total, int vec,
                               unsigned long long *err)
{
    const int a = blockIdx.x * MOE_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (a >= total) return;
    const int r = row[a];
    if (r < 0 || r >= total) {
        if (lane == 0) lb_report(err, LB_CERR_PERMUTE_ROW, r);
        return;
    }
    float *dst = xp ? xp + (size_t)r * c : NULL;
    uint16_t *d16 = xp16 ? xp16 + (size_t)r * ((c + 7) & ~7) : NULL;
    if (x16) {
        const uint16_t *s16 = x16 + (size_t)(a / k) * ld16;
        if (vec && ld16 % 4 == 0) {   // 4 elements (8 bytes) a lane's step
            for (int j = lane; j < c / 4; j += 32) {
                const uint2 v = ((const uint2 *)s16)[j];
                if (d16) ((uint2 *)d16)[j] = v;
                if (dst)
                    ((float4 *)dst)[j] = make_float4(__uint_as_float(v.x << 16),
                                                     __uint_as_float(v.x & 0xffff0000u),
                                                     __uint_as_float(v.y << 16),
                                                     __uint_as_float(v.y & 0xffff0000u));
            }
        } else {
            for (int j = lane; j < c; j += 32) {
                if (d16) d16[j] = s16[j];
                if (dst) dst[j] = __uint_as_float((uint32_t)s16[j] << 16);
            }
        }
        if (d16) bf16_row_pad(d16, c, lane);
        return;
    }
    const float *src = x + (size_t)(a / k) * c;
    if (vec) {
        for (int j = lane; j < c / 4; j += 32) {
            const float4 v = ((const float4 *)src)[j];
            if (dst) ((float4 *)dst)[j] = v;
            if (d16) ((uint2 *)d16)[j] = bf16x4_bits(v);
        }
    } else {
        for (int j = lane; j < c; j += 32) {
            if (dst) dst[j] = src[j];
            if (d16) d16[j] = (uint16_t)round_bf16_bits(src[j]);
        }
    }
    if (d16) bf16_row_pad(d16, c, lane);
}

// out (n, c): row i = sum over s in order of weight[i][s] * src[row[i][s]] (weight NULL: 1), in
// double (a product of two fp32 values is exact there, so 1 * y adds y itself): moe_combine, and
// moe_permute_bwd without weights; src16, where not NULL, is read instead of src (lb_in_ld).
// A row naming an assignment out of range is NaN (reported). blockIdx.y splits a row's columns
// over gridDim.y warps (slot_sum_cols): a decode step's few hundred rows then fill the chip.
__global__ void slot_sum_kernel(float *out, const float *src, const uint16_t *src16,
                                const float *weight, const int32_t *row, int n, int k, int c,
                                int total, int vec, int code, unsigned long long *err)
{
    const int i = blockIdx.x * MOE_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (i >= n) return;
    const int j0 = blockIdx.y * 32 + lane, step = 32 * gridDim.y;   // this warp's columns
    const int32_t *ri = row + (size_t)i * k;
    const float *wi = weight ? weight + (size_t)i * k : NULL;
    float *o = out + (size_t)i * c;
    for (int s = 0; s < k; s++)
        if (ri[s] < 0 || ri[s] >= total) {
            if (lane == 0 && blockIdx.y == 0) lb_report(err, code, ri[s]);
            for (int j = j0; j < c; j += step) o[j] = NAN;
            return;
        }
    if (vec) {
        for (int j = j0; j < c / 4; j += step) {
            double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0;
#pragma unroll 8
            for (int s = 0; s < k; s++) {
                const double w = wi ? (double)wi[s] : 1.0;
                const float4 y = lb_in_ld4(src, src16, ri[s], c, j);
                a0 += w * y.x, a1 += w * y.y, a2 += w * y.z, a3 += w * y.w;
            }
            ((float4 *)o)[j] = make_float4((float)a0, (float)a1, (float)a2, (float)a3);
        }
        return;
    }
    for (int j = j0; j < c; j += step) {
        double acc = 0.0;
#pragma unroll 8
        for (int s = 0; s < k; s++)
            acc += (wi ? (double)wi[s] : 1.0) * lb_in_ld(src, src16, ri[s], c, j);
        o[j] = (float)acc;
    }
}

// Warp a = (i, s): dyp[row] = weight * dout[i] and dweight[a] = dot(dout[i], yp[row]) (double:
// each lane's columns in order, then the warp's fixed butterfly); weight NULL: 1, dweight NULL:
// no dot.
__global__ void combine_bwd_kernel(float *dyp, uint16_t *dyp16, float *dweight,
                                   const float *dout, const float *yp, const uint16_t *yp16,
                                   const float *weight, const int32_t *row, int k, int c,
                                   int total, int vec, unsigned long long *err)
{
    const int a = blockIdx.x * MOE_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (a >= total) return;
    const int r = row[a];
    if (r < 0 || r >= total) {
        if (lane == 0) {
            lb_report(err, LB_CERR_COMBINE_BWD_ROW, r);
            if (dweight) dweight[a] = NAN;
        }
        return;
    }
    const float *g = dout + (size_t)(a / k) * c;
    float *dy = dyp ? dyp + (size_t)r * c : NULL;
    uint16_t *d16 = dyp16 ? dyp16 + (size_t)r * ((c + 7) & ~7) : NULL;
    const float w = weight ? weight[a] : 1.0f;
    double dot = 0.0;
    if (vec) {
        for (int j = lane; j < c / 4; j += 32) {
            const float4 gx = ((const float4 *)g)[j];
            const float4 v = make_float4(w * gx.x, w * gx.y, w * gx.z, w * gx.w);
            if (dy) ((float4 *)dy)[j] = v;
            if (d16) ((uint2 *)d16)[j] = bf16x4_bits(v);
            if (!dweight) continue;
            const float4 yx = lb_in_ld4(yp, yp16, r, c, j);
            dot += (double)gx.x * yx.x;
            dot += (double)gx.y * yx.y;
            dot += (double)gx.z * yx.z;
            dot += (double)gx.w * yx.w;
        }
    } else {
        for (int j = lane; j < c; j += 32) {
            const float gx = g[j], v = w * gx;
            if (dy) dy[j] = v;
            if (d16) d16[j] = (uint16_t)round_bf16_bits(v);
            if (dweight) dot += (double)gx * lb_in_ld(yp, yp16, r, c, j);
        }
    }
    if (d16) bf16_row_pad(d16, c, lane);
    if (!dweight) return;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    if (lane == 0) dweight[a] = (float)dot;
}

// 16-byte rows: c a multiple of 4 and every buffer 16-byte aligned (a bf16 copy or input,
// whose pitch is a multiple of 8 elements, 8-byte aligned).
static int moe_vec(int c, const void *p0, const void *p1, const void *p2, const void *p16 = NULL,
                   const void *q16 = NULL)
{
    return c % 4 == 0 && (((uintptr_t)p0 | (uintptr_t)p1 | (uintptr_t)p2) & 15) == 0 &&
           (((uintptr_t)p16 | (uintptr_t)q16) & 7) == 0;
}

static unsigned moe_blocks(int rows) { return (unsigned)((rows + MOE_WARPS - 1) / MOE_WARPS); }

// slot_sum_kernel's grid: rows in blocks of MOE_WARPS, and each row's columns split so that
// every warp has at least 64 of them (lanes' 16-byte steps when vec) and there are about eight
// blocks a multiprocessor. Each element's sum is the same whatever the split.
static dim3 slot_sum_grid(const lb_cuda_ctx *cx, int n, int c, int vec)
{
    const unsigned bx = moe_blocks(n), units = (unsigned)(vec ? c / 4 : c);
    unsigned by = (unsigned)(8 * cx->num_sms) / bx, most = (units + 63) / 64;
    if (by > most) by = most;
    return dim3(bx, by < 1 ? 1 : by);
}

static int dispatch_total(const char *what, int n, int k, int c)
{
    if (n < 0 || k < 0 || c < 0) lb_die("%s: negative size (n %d, k %d, c %d)", what, n, k, c);
    if ((size_t)n * k > INT32_MAX) lb_die("%s: %d x %d assignments overflow int32", what, n, k);
    return n * k;
}

static void cuda_moe_permute(lb_backend *be, float *xp, uint16_t *xp16, lb_act x,
                             const int32_t *row, int k)
{
    const int n = x.rows, c = x.cols;
    int total = dispatch_total("moe_permute", n, k, c);
    if (!total || !c) return;
    if (!xp && !xp16) lb_die("moe_permute: neither xp nor xp16");
    if (x.type == LB_ACT_F32 && x.ld != (size_t)c)
        lb_die("moe_permute: fp32 rows of pitch %zu, not %d", x.ld, c);
    lb_cuda_ctx *cx = lb_cuda(be);
    const float *x32 = x.type == LB_ACT_F32 ? (const float *)x.p : NULL;
    const uint16_t *x16 = x.type == LB_ACT_BF16 ? (const uint16_t *)x.p : NULL;
    permute_kernel<<<moe_blocks(total), 32 * MOE_WARPS, 0, cx->stream>>>(
        xp, xp16, x32, x16, x.ld, row, k, c, total,
        moe_vec(c, xp, x32, x32, xp16, x16), cx->err_dev);
    LB_CUDA_LAUNCHED(cx);
}

static void cuda_moe_permute_bwd(lb_backend *be, float *dx, const float *dxp,
                                 const uint16_t *dxp16, const int32_t *row, int n, int k, int c)
{
    int total = dispatch_total("moe_permute_bwd", n, k, c);
    size_t all = (size_t)n * c;
    if (!all) return;
    lb_cuda_ctx *cx = lb_cuda(be);
    const int vec = moe_vec(c, dx, dxp, dxp, dxp16);
    slot_sum_kernel<<<slot_sum_grid(cx, n, c, vec), 32 * MOE_WARPS, 0, cx->stream>>>(
        dx, dxp, dxp16, NULL, row, n, k, c, total, vec, LB_CERR_PERMUTE_BWD_ROW, cx->err_dev);
    LB_CUDA_LAUNCHED(cx);
}

static void cuda_moe_combine(lb_backend *be, float *out, const float *yp, const uint16_t *yp16,
                             const float *weight, const int32_t *row, int n, int k, int c)
{
    int total = dispatch_total("moe_combine", n, k, c);
    size_t all = (size_t)n * c;
    if (!all) return;
    lb_cuda_ctx *cx = lb_cuda(be);
    const int vec = moe_vec(c, out, yp, yp, yp16);
    slot_sum_kernel<<<slot_sum_grid(cx, n, c, vec), 32 * MOE_WARPS, 0, cx->stream>>>(
        out, yp, yp16, weight, row, n, k, c, total, vec, LB_CERR_COMBINE_ROW, cx->err_dev);
    LB_CUDA_LAUNCHED(cx);
}

static void cuda_moe_combine_bwd(lb_backend *be, float *dyp, uint16_t *dyp16, float *dweight,
                                 const float *dout, const float *yp, const uint16_t *yp16,
                                 const float *weight, const int32_t *row, int n, int k, int c)
{
    int total = dispatch_total("moe_combine_bwd", n, k, c);
    if (!total) return;
    if (c && !dyp && !dyp16) lb_die("moe_combine_bwd: neither dyp nor dyp16");
    lb_cuda_ctx *cx = lb_cuda(be);
    combine_bwd_kernel<<<moe_blocks(total), 32 * MOE_WARPS, 0, cx->stream>>>(
        dyp, dyp16, dweight, dout, yp, yp16, weight, row, k, c, total,
        moe_vec(c, dyp, dout, yp, dyp16, yp16), cx->err_dev);
    LB_CUDA_LAUNCHED(cx);
}

// --- the sigmoid router (kernels/router.h: the CPU's row arithmetic) ---------------------------
// One thread per row: e is the expert count of one layer (tens to hundreds) and the router a
// sliver of a step; the choice scores live in scratch.

__global__ void router_sigmoid_fwd_kernel(lb_router_sigmoid_args a, float *choice)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= a.n) return;
    lb_router_sigmoid_row(a.logits + (size_t)i * a.e, a.bias, a.scores + (size_t)i * a.e,
                          choice + (size_t)i * a.e, a.idx + (size_t)i * a.k,
                          a.weight + (size_t)i * a.k, a.e, a.k, a.n_group, a.topk_group,
                          a.renorm, a.scale);
}

__global__ void router_sigmoid_bwd_kernel(lb_router_sigmoid_args a)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= a.n) return;
    lb_router_sigmoid_row_bwd(a.scores + (size_t)i * a.e, a.idx + (size_t)i * a.k,
                              a.dweight + (size_t)i * a.k, a.dlogits + (size_t)i * a.e, a.e,
                              a.k, a.renorm, a.scale);
}

static void cuda_router_sigmoid_fwd(lb_backend *be, const lb_router_sigmoid_args *a)
{
    lb_router_sigmoid_check("router_sigmoid_fwd", a);
    if (!a->n) return;
    lb_cuda_ctx *cx = lb_cuda(be);
    float *choice = (float *)lb_cuda_scratch(cx, (size_t)a->n * a->e * sizeof(float));
    router_sigmoid_fwd_kernel<<<(a->n + 127) / 128, 128, 0, cx->stream>>>(*a, choice);
    LB_CUDA_LAUNCHED(cx);
}

static void cuda_router_sigmoid_bwd(lb_backend *be, const lb_router_sigmoid_args *a)
{
    lb_router_sigmoid_check("router_sigmoid_bwd", a);
    if (!a->n) return;
    lb_cuda_ctx *cx = lb_cuda(be);
    router_sigmoid_bwd_kernel<<<(a->n + 127) / 128, 128, 0, cx->stream>>>(*a);
    LB_CUDA_LAUNCHED(cx);
}

// The CPU's loop, on one thread: e values once a step.
__global__ void router_bias_update_kernel(float *bias, const float *load, int e, float rate)
{
    double mean = 0.0;
    for (int j = 0; j < e; j++) mean += load[j];
    mean /= e > 0 ? e : 1;
    for (int j = 0; j < e; j++)
        bias[j] += load[j] < mean ? rate : load[j] > mean ? -rate : 0.0f;
}

static void cuda_router_bias_update(lb_backend *be, float *bias, const float *load, int e,
                                    float rate)
{
    if (e <= 0) return;
    lb_cuda_ctx *cx = lb_cuda(be);
    router_bias_update_kernel<<<1, 1, 0, cx->stream>>>(bias, load, e, rate);
    LB_CUDA_LAUNCHED(cx);
}

// The table's entries take argument structs (kernels.h); the kernels' hosts above take
// the fields.

static void cuda_router_topk_fwd_op(lb_backend *be, const lb_router_args *a)
{
    cuda_router_topk_fwd(be, a->probs, a->idx, a->weight, a->logits, a->n, a->e, a->k, a->renorm);
}

static void cuda_router_topk_bwd_op(lb_backend *be, const lb_router_args *a)
{
    cuda_router_topk_bwd(be, a->dlogits, a->dweight, a->dprobs_expert, a->probs, a->idx, a->n,
                         a->e, a->k, a->renorm);
}

static void cuda_moe_combine_op(lb_backend *be, const lb_moe_combine_args *a)
{
    cuda_moe_combine(be, a->out, a->yp, a->yp16, a->weight, a->row, a->n, a->k, a->c);
}

static void cuda_moe_combine_bwd_op(lb_backend *be, const lb_moe_combine_args *a)
{
    cuda_moe_combine_bwd(be, a->dyp, a->dyp16, a->dweight, a->dout, a->yp, a->yp16, a->weight,
                         a->row, a->n, a->k, a->c);
}

extern "C" void lb_cuda_init_moe(lb_backend *be)
{
    be->router_topk_fwd = cuda_router_topk_fwd_op;
    be->router_topk_bwd = cuda_router_topk_bwd_op;
    be->router_sigmoid_fwd = cuda_router_sigmoid_fwd;
    be->router_sigmoid_bwd = cuda_router_sigmoid_bwd;
    be->router_bias_update = cuda_router_bias_update;
    be->moe_aux_loss = cuda_moe_aux_loss;
    be->moe_plan = cuda_moe_plan;
    be->moe_permute = cuda_moe_permute;
    be->moe_permute_bwd = cuda_moe_permute_bwd;
    be->moe_combine = cuda_moe_combine_op;
    be->moe_combine_bwd = cuda_moe_combine_bwd_op;
}
