// ops_sample.cu: the sample operation on the GPU (kernels.h, lb_sample_args): one block of
// SAMPLE_THREADS per row. The arithmetic is kernels/sample.h's; weights are summed as 64-bit
// integers, so the tree and atomic orders below give the CPU's bits.
//
// Passes over a row: its maximum (strided, coalesced); without top-k/top-p the sum of weights
// over contiguous chunks, one per thread, in id order; with them four digit levels per cut
// (shared-memory histograms, sample.h's radix select) and a chunked pass for the ties' ranks;
// then the one thread whose chunk holds the target walks it.
//
// Without top-k/top-p (the RL default) and for greedy rows a row is split instead: one block
// of SAMPLE_PART_THREADS per SAMPLE_PART_LEN logits takes that part's maximum, then its weight
// (sample_part_max, sample_part_sum), and a block per row finds the part that holds the target
// and walks it (sample_part_pick). A block per row of 1024 threads reads 256 rows of the Qwen3
// vocabulary at 1.85 TB/s (ncu on an H200, 2026-12-02): 256 blocks, each walking its row
// alone. The maximum and the lowest id holding it are order-free, and the weights are integers,
// so every split gives the same sums and the same token.
#include "kernels/cuda/cuda.cuh"
#include "kernels/sample.h"

#include <cuda_profiler_api.h>
#include <stdlib.h>

#define SAMPLE_THREADS 1024
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)

struct sample_shared {
    uint64_t hist[256];
    uint64_t warp[SAMPLE_WARPS];
    uint64_t total;
    float best[SAMPLE_WARPS];
    int bi[SAMPLE_WARPS];
    uint32_t want, mask;
    uint64_t above;
    int32_t token;
};

// The block's sum (every thread gets it).
__device__ uint64_t block_sum(uint64_t x, sample_shared *sh)
{
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    for (int o = 16; o; o >>= 1) x += __shfl_down_sync(0xffffffffu, x, o);
    if (!lane) sh->warp[w] = x;
    __syncthreads();
    if (!w) {
        x = sh->warp[lane];
        for (int o = 16; o; o >>= 1) x += __shfl_down_sync(0xffffffffu, x, o);
        if (!lane) sh->total = x;
    }
    __syncthreads();
    x = sh->total;
    __syncthreads();
    return x;
}

// The sum of x over the threads before this one (thread order), and the block's total.
__device__ uint64_t block_exclusive(uint64_t x, sample_shared *sh, uint64_t *total)
{
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    uint64_t inc = x;
    for (int o = 1; o < 32; o <<= 1) {
        uint64_t y = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += y;
    }
    if (lane == 31) sh->warp[w] = inc;
    __syncthreads();
    if (!w) {
        uint64_t s = sh->warp[lane], t = s;
        for (int o = 1; o < 32; o <<= 1) {
            uint64_t y = __shfl_up_sync(0xffffffffu, t, o);
            if (lane >= o) t += y;
        }
        sh->warp[lane] = t - s;   // exclusive over the warps
        if (lane == 31) sh->total = t;
    }
    __syncthreads();
    const uint64_t before = sh->warp[w] + inc - x;
    *total = sh->total;
    __syncthreads();
    return before;
}

// find_cut of ops_sample.c: the four digit levels; returns the cut's key, its ties and mass.
__device__ void block_cut(const float *l, int v, float mx, bool by_weight, uint64_t need,
                          sample_shared *sh, uint32_t *key, uint64_t *ties, uint64_t *mass)
{
    if (!threadIdx.x) sh->want = 0, sh->mask = 0, sh->above = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int d = threadIdx.x; d < 256; d += SAMPLE_THREADS) sh->hist[d] = 0;
        __syncthreads();
        const uint32_t want = sh->want, mask = sh->mask;
        for (int j = threadIdx.x; j < v; j += SAMPLE_THREADS) {
            const float x = l[j];
            const uint32_t k = lb_sample_key(x);
            if ((k & mask) == want) {
                const uint64_t m = by_weight ? lb_sample_weight(x, mx) : 1;
                if (m) atomicAdd((unsigned long long *)&sh->hist[(k >> shift) & 255],
                                 (unsigned long long)m);
            }
        }
        __syncthreads();
        if (!threadIdx.x) {
            uint64_t above = sh->above;
            uint32_t w = sh->want, mk = sh->mask;
            lb_sample_cut_level(sh->hist, shift, need, &above, &w, &mk);
            sh->above = above, sh->want = w, sh->mask = mk;
        }
        __syncthreads();
    }
    const uint32_t want = sh->want;
    const uint64_t above = sh->above;
    __syncthreads();
    uint64_t w = lb_sample_weight(lb_sample_unkey(want), mx), unit = by_weight && w ? w : 1;
    uint64_t strict = 0;   // the weight of the larger keys (above, for the weight measure)
    if (by_weight) {
        strict = above;
    } else {
        for (int j = threadIdx.x; j < v; j += SAMPLE_THREADS)
            if (lb_sample_key(l[j]) > want) strict += lb_sample_weight(l[j], mx);
        strict = block_sum(strict, sh);
    }
    *key = want;
    *ties = (need - above + unit - 1) / unit;
    *mass = strict + *ties * w;
}

// Row i's token and done flag (lb_sample_args); -1 and 0 for a row that is not sampled.
__device__ void sample_store(const lb_sample_args &a, int i, const lb_sample_row &r, int32_t token)
{
    a.token[i] = token;
    if (!a.done) return;
    int done = 0;
    if (r.counter >= 0) {
        done = a.max_len > 0 && r.counter + 1 >= a.max_len;
        for (int s = 0; s < a.nstop; s++)
            if (a.stop[s] == token) done = 2;
    }
    a.done[i] = done;
}

__global__ void __launch_bounds__(SAMPLE_THREADS) sample_kernel(lb_sample_args a)
{
    __shared__ sample_shared sh;
    const int i = blockIdx.x, v = a.v, tid = threadIdx.x;
    const lb_sample_row r = a.rows[i];
    if (r.counter < 0) {   // not sampled
        if (!tid) sample_store(a, i, r, -1);
        return;
    }
    const float *l = a.logits + (size_t)i * v;
    // the maximum and the lowest token holding it (v: none)
    float best = -INFINITY;
    int bi = v;
    for (int j = tid; j < v; j += SAMPLE_THREADS) {
        const float x = l[j];
        if (x > best || (x == best && j < bi)) best = x, bi = j;
    }
    for (int o = 16; o; o >>= 1) {
        const float ob = __shfl_down_sync(0xffffffffu, best, o);
        const int oi = __shfl_down_sync(0xffffffffu, bi, o);
        if (ob > best || (ob == best && oi < bi)) best = ob, bi = oi;
    }
    if (!(tid & 31)) sh.best[tid >> 5] = best, sh.bi[tid >> 5] = bi;
    __syncthreads();
    if (tid < 32) {
        best = sh.best[tid], bi = sh.bi[tid];
        for (int o = 16; o; o >>= 1) {
            const float ob = __shfl_down_sync(0xffffffffu, best, o);
            const int oi = __shfl_down_sync(0xffffffffu, bi, o);
            if (ob > best || (ob == best && oi < bi)) best = ob, bi = oi;
        }
        if (!tid) sh.best[0] = best, sh.bi[0] = bi;
    }
    __syncthreads();
    const float mx = sh.best[0];
    const int32_t arg = sh.bi[0] < v ? sh.bi[0] : 0;
    int32_t token = arg;
    if (a.top_k != 1) {
        // the kept set: all tokens (whole), or every key above `key` and `ties` equal to it
        bool whole = true;
        uint32_t key = 0;
        uint64_t ties = 0, mass = 0;
        if (a.top_k > 0 && a.top_k < v) {
            block_cut(l, v, mx, false, (uint64_t)a.top_k, &sh, &key, &ties, &mass);
            whole = false;
        }
        if (a.top_p < 1.0f) {
            if (whole) {
                for (int j = tid; j < v; j += SAMPLE_THREADS) mass += lb_sample_weight(l[j], mx);
                mass = block_sum(mass, &sh);
            }
            block_cut(l, v, mx, true, lb_sample_top_p_need(a.top_p, mass), &sh, &key, &ties,
                      &mass);
            whole = false;
        }
        // each thread's chunk of ids: the weight it keeps, in id order
        const int cs = (v + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
        const int lo = min(v, tid * cs), hi = min(v, lo + cs);
        const uint64_t wkey = lb_sample_weight(lb_sample_unkey(key), mx);
        uint64_t kept = 0, tie_before = 0, total;
        if (whole) {
            for (int j = lo; j < hi; j++) kept += lb_sample_weight(l[j], mx);
        } else {
            uint64_t my_ties = 0;
            for (int j = lo; j < hi; j++) {
                const uint32_t k = lb_sample_key(l[j]);
                if (k > key) kept += lb_sample_weight(l[j], mx);
                my_ties += k == key;
            }
            tie_before = block_exclusive(my_ties, &sh, &total);
            const uint64_t mine = tie_before >= ties ? 0 : min(my_ties, ties - tie_before);
            kept += mine * wkey;
        }
        const uint64_t before = block_exclusive(kept, &sh, &total);
        if (!tid) sh.token = arg;
        __syncthreads();
        if (total) {
            const float u = lb_sample_uniform(r.seed, r.stream, (uint64_t)r.counter);
            const uint64_t target = lb_sample_target(u, total);
            if (target >= before && target < before + kept) {   // one thread: this chunk
                uint64_t cum = before, seen = tie_before;
                for (int j = lo; j < hi; j++) {
                    const uint32_t k = lb_sample_key(l[j]);
                    if (!whole && k < key) continue;
                    if (!whole && k == key && seen++ >= ties) continue;
                    cum += lb_sample_weight(l[j], mx);
                    if (cum > target) {
                        sh.token = j;
                        break;
                    }
                }
            }
        }
        __syncthreads();
        token = sh.token;
    }
    if (!tid) sample_store(a, i, r, token);
}

// --- the split row ------------------------------------------------------------------------

#define SAMPLE_PART_THREADS 256
#define SAMPLE_PART_WARPS (SAMPLE_PART_THREADS / 32)
#define SAMPLE_PART_LEN 8192   // logits a part: 19 parts a Qwen3 row, ~4,900 blocks at 256 rows

// The better of (x, j) and (best, bi): the larger value, the lower id on a tie; NaN never wins.
__device__ __forceinline__ void sample_better(float x, int j, float *best, int *bi)
{
    if (x > *best || (x == *best && j < *bi)) *best = x, *bi = j;
}

__device__ void part_argmax(float *best, int *bi, float *sb, int *si)
{
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    for (int o = 16; o; o >>= 1) {
        const float ob = __shfl_down_sync(0xffffffffu, *best, o);
        const int oi = __shfl_down_sync(0xffffffffu, *bi, o);
        sample_better(ob, oi, best, bi);
    }
    if (!lane) sb[w] = *best, si[w] = *bi;
    __syncthreads();
    if (!threadIdx.x) {
        for (int k = 1; k < SAMPLE_PART_WARPS; k++) sample_better(sb[k], si[k], best, bi);
        sb[0] = *best, si[0] = *bi;
    }
    __syncthreads();
    *best = sb[0], *bi = si[0];
}

__device__ uint64_t part_sum(uint64_t x, uint64_t *sw)
{
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    for (int o = 16; o; o >>= 1) x += __shfl_down_sync(0xffffffffu, x, o);
    if (!lane) sw[w] = x;
    __syncthreads();
    uint64_t t = 0;
    for (int k = 0; k < SAMPLE_PART_WARPS; k++) t += sw[k];
    __syncthreads();
    return t;
}

// Whether logits row i can be read as float4 (v % 4 == 0 and a 16-byte aligned base).
__device__ __forceinline__ bool part_vec(const lb_sample_args &a)
{
    return a.v % 4 == 0 && ((uintptr_t)a.logits & 15) == 0;
}

// Part c of row i: its maximum and lowest id holding it (v: none), into mx/mi[i * parts + c].
__global__ void __launch_bounds__(SAMPLE_PART_THREADS)
sample_part_max(lb_sample_args a, float *mxp, int *mip, int parts)
{
    __shared__ float sb[SAMPLE_PART_WARPS];
    __shared__ int si[SAMPLE_PART_WARPS];
    const int c = blockIdx.x, i = blockIdx.y, v = a.v;
    if (a.rows[i].counter < 0) return;   // not sampled: sample_part_pick writes -1
    const int lo = c * SAMPLE_PART_LEN, hi = min(v, lo + SAMPLE_PART_LEN);
    const float *l = a.logits + (size_t)i * v;
    float best = -INFINITY;
    int bi = v;
    if (part_vec(a)) {   // lo is a multiple of 4, and so is hi
        for (int j = lo + 4 * threadIdx.x; j < hi; j += 4 * SAMPLE_PART_THREADS) {
            const float4 x = *reinterpret_cast<const float4 *>(l + j);
            sample_better(x.x, j, &best, &bi);
            sample_better(x.y, j + 1, &best, &bi);
            sample_better(x.z, j + 2, &best, &bi);
            sample_better(x.w, j + 3, &best, &bi);
        }
    } else {
        for (int j = lo + threadIdx.x; j < hi; j += SAMPLE_PART_THREADS)
            sample_better(l[j], j, &best, &bi);
    }
    part_argmax(&best, &bi, sb, si);
    if (!threadIdx.x) mxp[(size_t)i * parts + c] = best, mip[(size_t)i * parts + c] = bi;
}

// Row i's maximum from its parts' (every thread reads them; parts in id order).
__device__ __forceinline__ void part_row_max(const float *mxp, const int *mip, int i, int parts,
                                             float *mx, int *arg)
{
    float best = -INFINITY;
    int bi = 0x7fffffff;
    for (int c = 0; c < parts; c++)
        sample_better(mxp[(size_t)i * parts + c], mip[(size_t)i * parts + c], &best, &bi);
    *mx = best, *arg = bi;
}

// Part c of row i: the sum of its weights, into wp[i * parts + c].
__global__ void __launch_bounds__(SAMPLE_PART_THREADS)
sample_part_sum(lb_sample_args a, const float *mxp, const int *mip, uint64_t *wp, int parts)
{
    __shared__ uint64_t sw[SAMPLE_PART_WARPS];
    const int c = blockIdx.x, i = blockIdx.y, v = a.v;
    if (a.rows[i].counter < 0) return;
    float mx;
    int arg;
    part_row_max(mxp, mip, i, parts, &mx, &arg);
    const int lo = c * SAMPLE_PART_LEN, hi = min(v, lo + SAMPLE_PART_LEN);
    const float *l = a.logits + (size_t)i * v;
    uint64_t s = 0;
    if (part_vec(a)) {
        for (int j = lo + 4 * threadIdx.x; j < hi; j += 4 * SAMPLE_PART_THREADS) {
            const float4 x = *reinterpret_cast<const float4 *>(l + j);
            s += lb_sample_weight(x.x, mx) + lb_sample_weight(x.y, mx) +
                 lb_sample_weight(x.z, mx) + lb_sample_weight(x.w, mx);
        }
    } else {
        for (int j = lo + threadIdx.x; j < hi; j += SAMPLE_PART_THREADS)
            s += lb_sample_weight(l[j], mx);
    }
    s = part_sum(s, sw);
    if (!threadIdx.x) wp[(size_t)i * parts + c] = s;
}

// Row i's token: greedy (wp NULL), or the part whose running weight passes the target, whose
// contiguous pieces (one a thread, in id order) are summed again so that the one thread whose
// piece holds the target walks it; then the done flag, as sample_kernel.
__global__ void __launch_bounds__(SAMPLE_PART_THREADS)
sample_part_pick(lb_sample_args a, const float *mxp, const int *mip, const uint64_t *wp,
                 int parts)
{
    __shared__ uint64_t sw[SAMPLE_PART_WARPS];
    __shared__ int32_t stoken;
    __shared__ int spart;
    __shared__ uint64_t sbase, starget;
    const int i = blockIdx.x, v = a.v, tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const lb_sample_row r = a.rows[i];
    if (r.counter < 0) {   // not sampled
        if (!tid) sample_store(a, i, r, -1);
        return;
    }
    float mx;
    int arg;
    part_row_max(mxp, mip, i, parts, &mx, &arg);
    if (arg >= v) arg = 0;   // no non-NaN logit
    int32_t token = arg;
    if (wp) {
        if (!tid) {
            uint64_t total = 0;
            for (int c = 0; c < parts; c++) total += wp[(size_t)i * parts + c];
            spart = -1, stoken = arg;
            if (total) {
                const float u = lb_sample_uniform(r.seed, r.stream, (uint64_t)r.counter);
                const uint64_t target = lb_sample_target(u, total);
                uint64_t before = 0;
                for (int c = 0; c < parts; c++) {
                    const uint64_t s = wp[(size_t)i * parts + c];
                    if (target < before + s) {
                        spart = c, sbase = before, starget = target;
                        break;
                    }
                    before += s;
                }
            }
        }
        __syncthreads();
        if (spart >= 0) {
            const int p0 = spart * SAMPLE_PART_LEN, p1 = min(v, p0 + SAMPLE_PART_LEN);
            const int cs = (p1 - p0 + SAMPLE_PART_THREADS - 1) / SAMPLE_PART_THREADS;
            const int lo = min(p1, p0 + tid * cs), hi = min(p1, lo + cs);
            const float *l = a.logits + (size_t)i * v;
            uint64_t kept = 0;
            for (int j = lo; j < hi; j++) kept += lb_sample_weight(l[j], mx);
            // exclusive sum over the threads before this one
            uint64_t inc = kept;
            for (int o = 1; o < 32; o <<= 1) {
                const uint64_t y = __shfl_up_sync(0xffffffffu, inc, o);
                if (lane >= o) inc += y;
            }
            if (lane == 31) sw[w] = inc;
            __syncthreads();
            uint64_t before = sbase + inc - kept;
            for (int k = 0; k < w; k++) before += sw[k];
            const uint64_t target = starget;
            if (target >= before && target < before + kept) {   // one thread: this piece
                uint64_t cum = before;
                for (int j = lo; j < hi; j++) {
                    cum += lb_sample_weight(l[j], mx);
                    if (cum > target) {
                        stoken = j;
                        break;
                    }
                }
            }
        }
        __syncthreads();
        token = stoken;
    }
    if (!tid) sample_store(a, i, r, token);
}

// Whether a's rows take the split form: greedy, or neither top-k nor top-p cuts the set.
static int sample_split(const lb_sample_args *a)
{
    static int off = -1;   // LB_CUDA_SAMPLE_SPLIT=0: one block a row for every setting
    if (off < 0) {
        const char *s = getenv("LB_CUDA_SAMPLE_SPLIT");
        off = s && *s == '0';
    }
    if (off) return 0;
    return a->top_k == 1 || (!(a->top_k > 0 && a->top_k < a->v) && !(a->top_p < 1.0f));
}

static void sample_split_launch(lb_cuda_ctx *cx, const lb_sample_args *a)
{
    const int parts = (a->v + SAMPLE_PART_LEN - 1) / SAMPLE_PART_LEN;
    const size_t np = (size_t)a->n * parts;
    char *s = (char *)lb_cuda_scratch(
        cx, lb_align256(np * sizeof(float)) + lb_align256(np * sizeof(int)) + np * 8);
    float *mxp = (float *)s;
    int *mip = (int *)(s + lb_align256(np * sizeof(float)));
    uint64_t *wp =
        (uint64_t *)(s + lb_align256(np * sizeof(float)) + lb_align256(np * sizeof(int)));
    const dim3 grid(parts, a->n);
    sample_part_max<<<grid, SAMPLE_PART_THREADS, 0, cx->stream>>>(*a, mxp, mip, parts);
    LB_CUDA_LAUNCHED(cx);
    if (a->top_k != 1) {
        sample_part_sum<<<grid, SAMPLE_PART_THREADS, 0, cx->stream>>>(*a, mxp, mip, wp, parts);
        LB_CUDA_LAUNCHED(cx);
    }
    sample_part_pick<<<a->n, SAMPLE_PART_THREADS, 0, cx->stream>>>(
        *a, mxp, mip, a->top_k != 1 ? wp : NULL, parts);
    LB_CUDA_LAUNCHED(cx);
}

// LB_CUDA_PROFILE_SAMPLE=N: the profiler's range (cudaProfilerStart/Stop, for `ncu
// --profile-from-start off`) is one decode step, from the Nth sample call of the process to the
// next: a per-kernel measurement of a step without instrumenting the prefill and the warm-up.
static void profile_range(void)
{
    static int at = -2, calls;
    if (at == -2) {
        const char *s = getenv("LB_CUDA_PROFILE_SAMPLE");
        at = s && *s ? atoi(s) : -1;
    }
    if (at < 0) return;
    if (calls == at) LB_CUDA_CHECK(cudaProfilerStart());
    if (calls == at + 1) LB_CUDA_CHECK(cudaProfilerStop());
    calls++;
}

static void cuda_sample(lb_backend *be, const lb_sample_args *a)
{
    lb_sample_check(a);
    if (!a->n) return;
    profile_range();
    lb_cuda_ctx *cx = lb_cuda(be);
    if (sample_split(a)) {
        sample_split_launch(cx, a);
        return;
    }
    sample_kernel<<<a->n, SAMPLE_THREADS, 0, cx->stream>>>(*a);
    LB_CUDA_LAUNCHED(cx);
}

extern "C" void lb_cuda_init_sample(lb_backend *be) { be->sample = cuda_sample; }
