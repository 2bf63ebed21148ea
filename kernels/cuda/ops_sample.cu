// ops_sample.cu: the sample operation on the GPU (kernels.h, lb_sample_args): one block of
// SAMPLE_THREADS per row. The arithmetic is kernels/sample.h's; weights are summed as 64-bit
// integers, so the tree and atomic orders below give the CPU's bits.
//
// Passes over a row: its maximum (strided, coalesced); without top-k/top-p the sum of weights
// over contiguous chunks, one per thread, in id order; with them four digit levels per cut
// (shared-memory histograms, sample.h's radix select) and a chunked pass for the ties' ranks;
// then the one thread whose chunk holds the target walks it.
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

__global__ void __launch_bounds__(SAMPLE_THREADS) sample_kernel(lb_sample_args a)
{
    __shared__ sample_shared sh;
    const int i = blockIdx.x, v = a.v, tid = threadIdx.x;
    const lb_sample_row r = a.rows[i];
    if (r.counter < 0) {
        if (!tid) {
            a.token[i] = -1;
            if (a.done) a.done[i] = 0;
        }
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
    if (!tid) {
        a.token[i] = token;
        if (a.done) {
            int done = a.max_len > 0 && r.counter + 1 >= a.max_len;
            for (int s = 0; s < a.nstop; s++)
                if (a.stop[s] == token) done = 2;
            a.done[i] = done;
        }
    }
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
    sample_kernel<<<a->n, SAMPLE_THREADS, 0, cx->stream>>>(*a);
    LB_CUDA_LAUNCHED(cx);
}

extern "C" void lb_cuda_init_sample(lb_backend *be) { be->sample = cuda_sample; }
