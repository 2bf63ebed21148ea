// attention_tc.cu: causal grouped-query attention on bf16 tensor cores (kernels.h, the bf16 mode
// of attention_fwd, attention_bwd and attention_cached), FlashAttention-2 style.
//
// Numerics (kernels.h states them; the CPU reference computes the same): q, k, v, dout are
// rounded to bf16; products run on mma.sync m16n8k16, or on wgmma m64n64k16 for head dims 64
// and 128 on sm_90a (bf16 in, fp32 accumulate, k16 steps in the same order); the softmax
// is base 2 and online over key chunks of LB_ATTN_CHUNK = 64 positions aligned at 0;
// probabilities (and dS in the backward) are rounded to bf16 before they meet v (q, k).
// Every multiply and add outside the mma is an explicit round-to-nearest intrinsic, so the
// compiler fuses nothing and a query row's arithmetic is the same in every kernel that
// computes it.
//
// Fragments (PTX ISA, mma m16n8k16): lane = 4 g + tq. A (16 x 16): rows g and g + 8, columns
// 2 tq, 2 tq + 1 and those + 8. B (16 x 8): k rows 2 tq, 2 tq + 1 (and + 8), column g.
// C (16 x 8): rows g, g + 8, columns 2 tq, 2 tq + 1. A warp owns 16 rows; head dims are padded
// with zeros to a multiple of 16 (NK k-steps of 16), so d <= 128 is any size.
//
// Batch invariance and sampler = trainer: a query row's result depends only on its q, the keys
// and values at positions <= its own, and its position, because (1) an mma computes each
// output element from its own row of A and column of B, (2) the chunks are fixed, processed
// in order, and a chunk whose keys are all masked for a row leaves that row's state exactly
// unchanged (its max, scale 1, probabilities 0, products 0), (3) masked keys meet zero-valued
// or finite values only. attention_cached runs the same chunk function (tc_chunk) on the
// cache, with one warp holding 16 query heads of one kv head for one token (fragments from a
// bf16 cache's chunks staged in shared memory, or straight from an fp32 or fp8 cache's rows);
// the wgmma forward
// runs its softmax step (tc_online), and wgmma and mma.sync give the same bits for the same
// k16 steps (measured on the H200 over 24.6M products; test_backend_ops compares the forward
// with the cache kernel bitwise).
//
// Backward (no atomics): one kernel per query tile for dq (keys streamed), one per key tile
// for dk and dv (query chunks of every head of the group streamed, in order).
//
// Staging: k and v (and q, dout for the backward) are first converted once to bf16 copies
// (rows padded with zeros to 16 NK elements, so every row is whole 16-byte vectors); chunks then
// stream into shared memory, double-buffered (the next chunk loads while the tensor cores work
// on this one): by cp.async from every thread in the mma.sync kernels, by the tensor-memory
// accelerator (one thread, mbarriers) in the wgmma ones.
//
// Grids are (heads, batch, tiles), the longest tiles first (tc_tile_last_first).
#include "kernels/cuda/cuda.cuh"

#include <math.h>

#define TC_KC 64                       // keys per chunk (LB_ATTN_CHUNK)
#define TC_FWD_WARPS 4                 // forward: 4 warps x 32 query rows per block
#define TC_FWD_ROWS (TC_FWD_WARPS * 32)
#define TC_BWD_WARPS 4                 // backward: 4 warps x 16 rows per block
#define TC_LOG2E 1.4426950408889634
#define TC_LN2 0.69314718055994531f

static_assert(TC_KC == LB_ATTN_CHUNK, "the CUDA chunk is the kernel set's");
static_assert(TC_BWD_WARPS * 16 == TC_KC, "a backward key tile is one query chunk wide");

// --- mma helpers -------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t tc_pack(float lo, float hi)
{
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);   // .x (lo) in the low half
    return *reinterpret_cast<uint32_t *>(&v);
}

__device__ __forceinline__ void tc_mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 bf16 tiles, transposed: with lane L giving the address of row L & 7 of tile L >> 3,
// register i holds tile i's B fragment (k rows 2 tq, 2 tq + 1; column g).
__device__ __forceinline__ void tc_ldsm_t(uint32_t r[4], const __nv_bfloat16 *p)
{
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// Four 8x8 bf16 tiles as they are: register i holds row g, columns 2 tq, 2 tq + 1 of tile i.
__device__ __forceinline__ void tc_ldsm(uint32_t r[4], const __nv_bfloat16 *p)
{
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// A fragment of rows 0 .. 15 of a (rows, DP) bf16 tile in shared memory, k-step kk: tiles
// (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15). Rows are an
// odd number of 16-byte units apart (DP = 16 NK + 8), so a tile's eight rows hit distinct banks.
__device__ __forceinline__ void tc_afrag(uint32_t a[4], const __nv_bfloat16 *s, int DP, int lane,
                                         int kk)
{
    const int mi = lane >> 3;
    tc_ldsm(a, s + ((mi & 1) * 8 + (lane & 7)) * DP + kk * 16 + (mi >> 1) * 8);
}

// The A fragment of k-step kc (columns 16 kc .. 16 kc + 15) of a 16 x 64 tile held in C layout
// (s[nt][e]: n-tiles of 8 columns), rounded to bf16: C and A layouts match pairwise.
__device__ __forceinline__ void tc_ctoa(uint32_t a[4], const float (&s)[8][4], int kc)
{
    a[0] = tc_pack(s[2 * kc][0], s[2 * kc][1]);
    a[1] = tc_pack(s[2 * kc][2], s[2 * kc][3]);
    a[2] = tc_pack(s[2 * kc + 1][0], s[2 * kc + 1][1]);
    a[3] = tc_pack(s[2 * kc + 1][2], s[2 * kc + 1][3]);
}

// B fragments for "X^T" where X (n, DP) is row-major with n along the product's columns
// (keys of K for S = Q K^T), k-step kk, n-tiles nt and nt + 1 (columns nt * 8 + g and
// nt * 8 + 8 + g) in one ldmatrix: b[0], b[1] tile nt; b[2], b[3] tile nt + 1.
__device__ __forceinline__ void tc_bfrag2(uint32_t b[4], const __nv_bfloat16 *s, int DP, int lane,
                                          int nt, int kk)
{
    const int mi = lane >> 3;
    tc_ldsm(b, s + ((nt + (mi >> 1)) * 8 + (lane & 7)) * DP + kk * 16 + (mi & 1) * 8);
}

// B fragments for X (k, DP) row-major with k along the reduction (V in P V): k-step ks,
// columns dt * 8 .. dt * 8 + 15 (two n-tiles): b[0], b[1] tile dt; b[2], b[3] tile dt + 1.
__device__ __forceinline__ void tc_bfrag_t(uint32_t b[4], const __nv_bfloat16 *s, int DP,
                                           int lane, int ks, int dt)
{
    const int mi = lane >> 3;
    tc_ldsm_t(b, s + (ks * 16 + (lane & 7) + (mi & 1) * 8) * DP + (dt + (mi >> 1)) * 8);
}

// --- the chunk step shared by the forward and the cache kernel ----------------------------------

// 2^x as the MUFU instruction alone. exp2f adds a compare and two multiplies per value so that
// results below 2^-126 come out subnormal; here they flush to 0 (a probability under 2^-126
// adds nothing a float sum of terms near 1 can hold). Above 2^-126 the bits are exp2f's.
__device__ __forceinline__ float tc_exp2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

template <int NK> struct tc_state {
    float m[2], l[2];          // running max (base 2) and sum of rows g and g + 8
    float o[2 * NK][4];        // output accumulators, n-tiles of 8 head dims
};

template <int NK> __device__ __forceinline__ void tc_state_init(tc_state<NK> &st)
{
#pragma unroll
    for (int r = 0; r < 2; r++) st.m[r] = -INFINITY, st.l[r] = 0.0f;
#pragma unroll
    for (int dt = 0; dt < 2 * NK; dt++)
#pragma unroll
        for (int e = 0; e < 4; e++) st.o[dt][e] = 0.0f;
}

// The online-softmax step of one 16-row tile on a chunk's scores s (C layout, keys j0 + column;
// row g (+ 8) sees keys up to pos[0] ([1])): s becomes the probabilities, the state's max and
// sum advance, and its output accumulators are rescaled for the chunk's P V. Every kernel that
// computes a query row (tc_chunk, tw_fwd_kernel) runs this, so their bits agree. MASK false:
// the caller knows no key of the chunk lies after either row (the same values, fewer
// instructions). The output rescale is skipped when no row's maximum moved (alpha 1 multiplies
// exactly, so the bits are the same); BLOCK decides that for the whole block
// (__syncthreads_or, every thread of the block must call), otherwise per warp. A per-warp
// branch in tw_fwd_kernel<4> made ptxas (nvcc 13.0) reuse the loop-invariant Q fragment
// registers inside the loop, a miscompile read in its SASS (doc/backends.md).
template <int NK, bool MASK = true, bool BLOCK = false>
__device__ __forceinline__ void tc_online(tc_state<NK> &st, float (&s)[8][4], int j0,
                                          const int (&pos)[2], float c, int tq)
{
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int j = j0 + nt * 8 + 2 * tq + (e & 1);
            const float x = !MASK || j <= pos[e >> 1] ? __fmul_rn(s[nt][e], c) : -INFINITY;
            s[nt][e] = x;
            mx[e >> 1] = fmaxf(mx[e >> 1], x);
        }
    float alpha[2], mn[2], ls[2] = {0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < 2; r++) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        mn[r] = fmaxf(st.m[r], mx[r]);   // finite: key 0 of chunk 0 is never masked
        alpha[r] = tc_exp2(__fsub_rn(st.m[r], mn[r]));   // 0 on the first chunk
    }
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float p = tc_exp2(__fsub_rn(s[nt][e], mn[e >> 1]));   // 0 if masked
            s[nt][e] = p;
            ls[e >> 1] = __fadd_rn(ls[e >> 1], p);
        }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        ls[r] = __fadd_rn(ls[r], __shfl_xor_sync(0xffffffffu, ls[r], 1));
        ls[r] = __fadd_rn(ls[r], __shfl_xor_sync(0xffffffffu, ls[r], 2));
        st.l[r] = __fadd_rn(__fmul_rn(st.l[r], alpha[r]), ls[r]);
        st.m[r] = mn[r];
    }
    const int moved = alpha[0] != 1.0f || alpha[1] != 1.0f;
    if (BLOCK ? __syncthreads_or(moved) : __any_sync(0xffffffffu, moved))
#pragma unroll
        for (int dt = 0; dt < 2 * NK; dt++)
#pragma unroll
            for (int e = 0; e < 4; e++) st.o[dt][e] = __fmul_rn(st.o[dt][e], alpha[e >> 1]);
}

// Row r (0: g, 1: g + 8) of this thread's fragment a (the C layout: n-tiles of 8 columns), each
// value through f, into o (the row's first d columns).
__device__ __forceinline__ void tc_put(float *o, float v) { *o = v; }
__device__ __forceinline__ void tc_put(__nv_bfloat16 *o, float v) { *o = __float2bfloat16_rn(v); }

template <int NK, typename T, typename F>
__device__ __forceinline__ void tc_row_out(T *o, const float (&a)[2 * NK][4], int r, int tq,
                                           int d, F f)
{
#pragma unroll
    for (int dt = 0; dt < 2 * NK; dt++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int x = dt * 8 + 2 * tq + e;
            if (x < d) tc_put(o + x, f(a[dt][2 * r + e]));
        }
}

// Row r (0: g, 1: g + 8) of a finished state: its d outputs o / l into o (float, or bf16
// rounded to nearest even) and, when lse is not NULL, its log-sum-exp (natural log) by lane
// tq 0.
template <int NK, typename T>
__device__ __forceinline__ void tc_out_store(T *o, float *lse, const tc_state<NK> &st, int r,
                                             int tq, int d)
{
    const float l = st.l[r];
    tc_row_out<NK>(o, st.o, r, tq, d, [l](float v) { return __fdiv_rn(v, l); });
    if (lse && tq == 0) *lse = __fmul_rn(__fadd_rn(st.m[r], log2f(st.l[r])), TC_LN2);
}

// A training forward's row r of st at row offset `row`: into out16 (bf16) where it is given,
// else out. One branch a row, after the row's last chunk.
template <int NK>
__device__ __forceinline__ void tc_out_row(float *out, __nv_bfloat16 *out16, size_t row,
                                           float *lse, const tc_state<NK> &st, int r, int tq,
                                           int d)
{
    if (out16) tc_out_store<NK>(out16 + row, lse, st, r, tq, d);
    else tc_out_store<NK>(out + row, lse, st, r, tq, d);
}

// Query fragments of one 16-row tile held in registers (the cache kernel).
template <int NK> struct tc_qreg {
    const uint32_t (*qa)[4];
    __device__ void afrag(uint32_t a[4], int, int kk) const
    {
#pragma unroll
        for (int e = 0; e < 4; e++) a[e] = qa[kk][e];
    }
};

// Query fragments of the warp's MT 16-row tiles from a (rows, DP) bf16 tile in shared memory.
struct tc_qsmem {
    const __nv_bfloat16 *q;
    int DP, lane;
    __device__ void afrag(uint32_t a[4], int mt, int kk) const
    {
        tc_afrag(a, q + mt * 16 * DP, DP, lane, kk);
    }
};

// Key chunk at j0 for the warp's MT tiles of 16 query rows (fragments from QA); row g (+ 8) of
// tile mt sees keys up to position pos[mt][0] ([mt][1]). LD gives the K and V fragments (shared
// memory or the cache); both give the same register values for the same keys, and a K or V
// fragment serves all MT tiles (which halves the shared-memory reads per product at MT 2), so
// every element's arithmetic is the same whatever MT and LD are.
template <int NK, int MT, class QA, class LD>
__device__ __forceinline__ void tc_chunk(tc_state<NK> (&st)[MT], const QA &qa, const LD &ld,
                                         int j0, const int (&pos)[MT][2], float c, int lane)
{
    const int tq = lane & 3;
    float s[MT][8][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) s[mt][nt][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < NK; kk++) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) qa.afrag(a[mt], mt, kk);
#pragma unroll
        for (int nt = 0; nt < 8; nt += 2) {
            uint32_t b[4];
            ld.kfrag2(b, nt, kk);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                tc_mma(s[mt][nt], a[mt], b[0], b[1]);
                tc_mma(s[mt][nt + 1], a[mt], b[2], b[3]);
            }
        }
    }
#pragma unroll
    for (int mt = 0; mt < MT; mt++) tc_online<NK>(st[mt], s[mt], j0, pos[mt], c, tq);
#pragma unroll
    for (int ks = 0; ks < 4; ks++) {
        uint32_t pa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) tc_ctoa(pa[mt], s[mt], ks);
#pragma unroll
        for (int dt = 0; dt < 2 * NK; dt += 2) {
            uint32_t b[4];
            ld.vfrag2(b, ks, dt);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                tc_mma(st[mt].o[dt], pa[mt], b[0], b[1]);
                tc_mma(st[mt].o[dt + 1], pa[mt], b[2], b[3]);
            }
        }
    }
}

// --- forward -----------------------------------------------------------------------------------

// Grids are (heads, batch, tiles): blocks start in linear order (x fastest), so the tile index,
// slowest, decides which tiles start first, across all heads and batches. The longest blocks
// go first (causal query tiles late in the sequence, key tiles early in it) and short ones fill
// the tail; with the tile fastest, every (head, batch) would hold long blocks, and the last
// ones would start when most of the work is done.
__device__ __forceinline__ int tc_tile_last_first() { return gridDim.z - 1 - blockIdx.z; }

// (b, t, heads, d) element offset of row (bi, i, h).
__device__ __forceinline__ size_t tc_row(int bi, int i, int h, int t, int heads, int d)
{
    return (((size_t)bi * t + i) * heads + h) * d;
}

// x (rows, d) fp32 or bf16 -> y (rows, d16) bf16, zero in columns d .. d16 - 1; a pair per
// thread.
template <typename T>
__global__ void tc_to_bf16_kernel(__nv_bfloat16 *y, const T *x, long rows, int d, int d16)
{
    const long e = (long)blockIdx.x * blockDim.x + threadIdx.x;
    const int half = d16 / 2;
    if (e >= rows * half) return;
    const long r = e / half;
    const int col = (int)(e % half) * 2;
    const T *p = x + r * d;
    const float v0 = col < d ? lb_ld(p + col) : 0.0f, v1 = col + 1 < d ? lb_ld(p + col + 1) : 0.0f;
    *reinterpret_cast<uint32_t *>(y + r * d16 + col) = tc_pack(v0, v1);
}

__device__ __forceinline__ void tc_cp16(void *dst, const void *src, int bytes)
{
    unsigned a = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(a), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void tc_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void tc_cp_wait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// The double-buffered chunk loop's step: queues chunk ch + 1 (if any) into the other of two
// stages of K and V (each 2 TILE elements at sm) with load(stage), which is free since chunk
// ch - 1 was consumed, waits until chunk ch has landed for every thread of the block, and
// returns its stage.
template <typename LOAD>
__device__ __forceinline__ const __nv_bfloat16 *tc_stage_next(__nv_bfloat16 *sm, int TILE, int ch,
                                                               int nchunks, LOAD load)
{
    if (ch + 1 < nchunks) {
        load(sm + ((ch + 1) & 1) * 2 * TILE);
        tc_cp_commit();
        tc_cp_wait<1>();
    } else {
        tc_cp_wait<0>();
    }
    __syncthreads();
    return sm + (ch & 1) * 2 * TILE;
}

// Queues rows [r0, r0 + TC_KC) of one (batch, head) of x (b, t, heads, 16 NK) bf16 into
// s (TC_KC, DP); rows past t are zero-filled (a 0-byte source).
template <int NK, int NT>
__device__ __forceinline__ void tc_load(__nv_bfloat16 *s, const __nv_bfloat16 *x, int bi, int r0,
                                        int h, int t, int heads)
{
    constexpr int D16 = 16 * NK, DP = D16 + 8, V = D16 / 8;
    for (int e = threadIdx.x; e < TC_KC * V; e += NT) {
        const int r = e / V, col = (e % V) * 8, i = r0 + r;
        const __nv_bfloat16 *src = x + (((size_t)bi * t + (i < t ? i : 0)) * heads + h) * D16 + col;
        tc_cp16(s + r * DP + col, src, i < t ? 16 : 0);
    }
}

// Query fragments of rows i and i + 8 (g's) straight from global memory.
template <int NK, typename T>
__device__ __forceinline__ void tc_qfrag(uint32_t (&qa)[NK][4], const T *q0, const T *q1, int d,
                                         int tq)
{
#pragma unroll
    for (int kk = 0; kk < NK; kk++) {
        const int x = kk * 16 + 2 * tq;
        float v[2][4];
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int xx = x + (e >> 1) * 8 + (e & 1);
            v[0][e] = q0 && xx < d ? lb_ld(q0 + xx) : 0.0f;
            v[1][e] = q1 && xx < d ? lb_ld(q1 + xx) : 0.0f;
        }
        qa[kk][0] = tc_pack(v[0][0], v[0][1]);
        qa[kk][1] = tc_pack(v[1][0], v[1][1]);
        qa[kk][2] = tc_pack(v[0][2], v[0][3]);
        qa[kk][3] = tc_pack(v[1][2], v[1][3]);
    }
}

// The cache kernels' query fragments: query heads hr[0] and hr[1] (rows g and g + 8; none at
// or past hmax, the group's end) of token i of q (n, hq, d).
template <int NK>
__device__ __forceinline__ void tc_qfrag_heads(uint32_t (&qa)[NK][4], const float *q, int i,
                                               int hq, const int (&hr)[2], int hmax, int d, int tq)
{
    tc_qfrag<NK>(qa, hr[0] < hmax ? q + ((size_t)i * hq + hr[0]) * d : NULL,
                 hr[1] < hmax ? q + ((size_t)i * hq + hr[1]) * d : NULL, d, tq);
}

// K and V chunk fragments from shared memory (K, V (TC_KC, DP) row-major).
struct tc_smem_ld {
    const __nv_bfloat16 *k, *v;
    int DP, g, tq, lane;
    __device__ void kfrag2(uint32_t b[4], int nt, int kk) const
    {
        tc_bfrag2(b, k, DP, lane, nt, kk);
    }
    __device__ void vfrag2(uint32_t b[4], int ks, int dt) const
    {
        tc_bfrag_t(b, v, DP, lane, ks, dt);
    }
};

// A block is TC_FWD_ROWS query rows of one (batch, head), 32 per warp (two 16-row tiles that
// share every K and V fragment), the last rows first (tc_tile_last_first).
// Shared memory: Q (TC_FWD_ROWS, DP), then two stages of K and V chunks (TC_KC, DP) each.
template <int NK, typename TQ>
__global__ void __launch_bounds__(TC_FWD_WARPS * 32)
tc_fwd_kernel(float *out, __nv_bfloat16 *out16, float *lse, const TQ *q,
              const __nv_bfloat16 *kb, const __nv_bfloat16 *vb, int t, int hq, int hkv, int d,
              float c)
{
    constexpr int DP = 16 * NK + 8, NT = TC_FWD_WARPS * 32, TILE = TC_KC * DP;
    extern __shared__ __align__(16) unsigned char tc_sm[];
    __nv_bfloat16 *qs = reinterpret_cast<__nv_bfloat16 *>(tc_sm);
    __nv_bfloat16 *sm = qs + TC_FWD_ROWS * DP;
    const int bi = blockIdx.y, h = blockIdx.x, hk = h / (hq / hkv);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const int i0 = tc_tile_last_first() * TC_FWD_ROWS, iw = i0 + warp * 32;
    const int nchunks = (min(i0 + TC_FWD_ROWS, t) - 1) / TC_KC + 1;
    tc_load<NK, NT>(sm, kb, bi, 0, hk, t, hkv);
    tc_load<NK, NT>(sm + TILE, vb, bi, 0, hk, t, hkv);
    tc_cp_commit();
    // Q rounded to bf16 (zeros past d and past t), a pair per thread; read after the first
    // chunk's barrier.
    for (int e = threadIdx.x; e < TC_FWD_ROWS * 8 * NK; e += NT) {
        const int r = e / (8 * NK), x = e % (8 * NK) * 2, i = i0 + r;
        const TQ *src = q + tc_row(bi, i < t ? i : 0, h, t, hq, d);
        const float v0 = i < t && x < d ? lb_ld(src + x) : 0.0f;
        const float v1 = i < t && x + 1 < d ? lb_ld(src + x + 1) : 0.0f;
        *reinterpret_cast<uint32_t *>(qs + r * DP + x) = tc_pack(v0, v1);
    }
    const tc_qsmem qa = {qs + warp * 32 * DP, DP, lane};
    const int pos[2][2] = {{iw + g, iw + g + 8}, {iw + 16 + g, iw + 24 + g}};
    tc_state<NK> st[2];
    tc_state_init(st[0]);
    tc_state_init(st[1]);
    for (int ch = 0; ch < nchunks; ch++) {
        const int j0 = ch * TC_KC;
        const __nv_bfloat16 *ks = tc_stage_next(sm, TILE, ch, nchunks, [&](__nv_bfloat16 *nx) {
            tc_load<NK, NT>(nx, kb, bi, j0 + TC_KC, hk, t, hkv);
            tc_load<NK, NT>(nx + TILE, vb, bi, j0 + TC_KC, hk, t, hkv);
        });
        const tc_smem_ld ld = {ks, ks + TILE, DP, g, tq, lane};
        // A chunk past all of tile 0's rows but not tile 1's leaves tile 0 exactly unchanged.
        if (iw < t && j0 <= iw + 31) tc_chunk<NK, 2>(st, qa, ld, j0, pos, c, lane);
        __syncthreads();   // chunk ch is consumed before its stage is refilled
    }
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int r = 0; r < 2; r++)
            if (pos[mt][r] < t)
                tc_out_row<NK>(out, out16, tc_row(bi, pos[mt][r], h, t, hq, d),
                               lse + ((size_t)bi * hq + h) * t + pos[mt][r], st[mt], r, tq, d);
}

// --- attention over the KV cache ------------------------------------------------------------

// K and V fragments read from the fp32 or fp8 cache rows of one (slot, kv head), keys after
// pos zero.
struct tc_cache_ld {
    const lb_kv_layer *c;
    size_t row0;               // cache row of position 0 of this (slot, kv head); rows follow
    int j0, pos, g, tq, nb;
    __device__ float at(const void *data, const float *sc, int j, int x) const
    {
        if (j > pos || x >= c->d) return 0.0f;
        const size_t r = row0 + j;
        if (!c->fp8) return ((const float *)data)[r * c->d + x];
        const float e = lb_e4m3_decode(((const uint8_t *)data)[r * c->d + x]);
        return __fmul_rn(e, sc[r * nb + x / 128]);
    }
    __device__ void kfrag(uint32_t &b0, uint32_t &b1, int nt, int kk) const
    {
        const int j = j0 + nt * 8 + g, x = kk * 16 + 2 * tq;
        b0 = tc_pack(at(c->k, c->ks, j, x), at(c->k, c->ks, j, x + 1));
        b1 = tc_pack(at(c->k, c->ks, j, x + 8), at(c->k, c->ks, j, x + 9));
    }
    __device__ void kfrag2(uint32_t b[4], int nt, int kk) const
    {
        kfrag(b[0], b[1], nt, kk);
        kfrag(b[2], b[3], nt + 1, kk);
    }
    __device__ void vfrag2(uint32_t b[4], int ks, int dt) const
    {
        const int j = j0 + ks * 16 + 2 * tq;
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int x = (dt + u) * 8 + g;
            b[2 * u] = tc_pack(at(c->v, c->vs, j, x), at(c->v, c->vs, j + 1, x));
            b[2 * u + 1] = tc_pack(at(c->v, c->vs, j + 8, x), at(c->v, c->vs, j + 9, x));
        }
    }
};

// One warp per (token i, kv head, 16 of the group's query heads): rows are query heads.
template <int NK>
__global__ void __launch_bounds__(128)
tc_cached_kernel(float *out, const float *q, lb_kv_layer c, const int32_t *slot,
                 const int32_t *pos, int n, int hq, float cl, unsigned long long *err)
{
    const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3, d = c.d;
    const int group = hq / c.hkv, parts = (group + 15) / 16;
    const long w = (long)blockIdx.x * 4 + (threadIdx.x >> 5);
    if (w >= (long)n * c.hkv * parts) return;   // whole warps; no block barrier follows
    const int i = (int)(w / ((long)c.hkv * parts)), hk = (int)(w / parts % c.hkv);
    const int h0 = hk * group + (int)(w % parts) * 16;   // query head of row 0
    const int hmax = (hk + 1) * group;
    const int sl = slot[i], ps = pos[i];
    const int hr[2] = {h0 + g, h0 + g + 8};
    if (sl < 0 || sl >= c.slots || ps < 0 || ps >= c.cap) {
        if (lane == 0) lb_report(err, LB_CERR_KV_ROW, sl >= 0 && sl < c.slots ? ps : sl);
        for (int r = 0; r < 2; r++)
            if (hr[r] < hmax)
                for (int x = tq; x < d; x += 4) out[((size_t)i * hq + hr[r]) * d + x] = NAN;
        return;
    }
    uint32_t qa[NK][4];
    tc_qfrag_heads<NK>(qa, q, i, hq, hr, hmax, d, tq);
    const tc_qreg<NK> qr = {qa};
    const int pos2[1][2] = {{ps, ps}};
    tc_state<NK> st[1];
    tc_state_init(st[0]);
    tc_cache_ld ld = {&c, ((size_t)sl * c.hkv + hk) * c.cap, 0, ps, g, tq, (d + 127) / 128};
    for (int j0 = 0; j0 <= ps; j0 += TC_KC) {
        ld.j0 = j0;
        tc_chunk<NK, 1>(st, qr, ld, j0, pos2, cl, lane);
    }
#pragma unroll
    for (int r = 0; r < 2; r++)
        if (hr[r] < hmax) tc_out_store<NK>(out + ((size_t)i * hq + hr[r]) * d, NULL, st[0], r, tq, d);
}

// Rows [j0, j0 + TC_KC) of one (slot, kv head)'s bf16 cache rows x (cap, 16 NK) into
// s (TC_KC, DP) by every thread of the block; rows past pos are zero-filled (a 0-byte source),
// so masked keys meet zeros, as tc_cache_ld gives them.
template <int NK>
__device__ __forceinline__ void tc_cache_load(__nv_bfloat16 *s, const __nv_bfloat16 *x, int j0,
                                              int pos)
{
    constexpr int D16 = 16 * NK, DP = D16 + 8, V = D16 / 8;
    for (int e = threadIdx.x; e < TC_KC * V; e += blockDim.x) {
        const int r = e / V, col = (e % V) * 8, j = j0 + r;
        tc_cp16(s + r * DP + col, x + (size_t)(j <= pos ? j : 0) * D16 + col, j <= pos ? 16 : 0);
    }
}

// The start of a decode block over a bf16 cache: a row outside the cache is reported and its
// heads' outputs set to NaN (by the threads where `write`), and false returned for the whole
// block; else the (slot, kv head)'s K and V rows in *kx, *vx and their first chunk on its way
// into stage 0.
template <int NK>
__device__ __forceinline__ bool tc_cached16_start(__nv_bfloat16 *sm, const __nv_bfloat16 **kx,
                                                  const __nv_bfloat16 **vx, float *out,
                                                  const lb_kv_layer &c, int i, int hk, int sl,
                                                  int ps, int hq, const int (&hr)[2], int hmax,
                                                  int tq, bool write, unsigned long long *err)
{
    constexpr int D16 = 16 * NK, TILE = TC_KC * (D16 + 8);
    if (sl < 0 || sl >= c.slots || ps < 0 || ps >= c.cap) {
        if (threadIdx.x == 0) lb_report(err, LB_CERR_KV_ROW, sl >= 0 && sl < c.slots ? ps : sl);
        if (write)
            for (int r = 0; r < 2; r++)
                if (hr[r] < hmax)
                    for (int x = tq; x < c.d; x += 4) out[((size_t)i * hq + hr[r]) * c.d + x] = NAN;
        return false;
    }
    const size_t row0 = ((size_t)sl * c.hkv + hk) * c.cap;
    *kx = (const __nv_bfloat16 *)c.k + row0 * D16;
    *vx = (const __nv_bfloat16 *)c.v + row0 * D16;
    tc_cache_load<NK>(sm, *kx, 0, ps);
    tc_cache_load<NK>(sm + TILE, *vx, 0, ps);
    tc_cp_commit();
    return true;
}

// The chunks of keys 0 .. ps of a decode block (its first chunk already loading, as
// tc_cached16_start leaves it): each through step(fragments, j0) while the next one loads.
template <int NK, class STEP>
__device__ __forceinline__ void tc_cached16_chunks(__nv_bfloat16 *sm, const __nv_bfloat16 *kx,
                                                   const __nv_bfloat16 *vx, int ps, int lane,
                                                   STEP step)
{
    constexpr int DP = 16 * NK + 8, TILE = TC_KC * DP;
    const int nchunks = ps / TC_KC + 1;
    for (int ch = 0; ch < nchunks; ch++) {
        const int j0 = ch * TC_KC;
        const __nv_bfloat16 *ks = tc_stage_next(sm, TILE, ch, nchunks, [&](__nv_bfloat16 *nx) {
            tc_cache_load<NK>(nx, kx, j0 + TC_KC, ps);
            tc_cache_load<NK>(nx + TILE, vx, j0 + TC_KC, ps);
        });
        step(tc_smem_ld{ks, ks + TILE, DP, lane >> 2, lane & 3, lane}, j0);
        __syncthreads();   // chunk ch is consumed before its stage is refilled
    }
}

// The decode kernel over a bf16 cache: a block per (token i, kv head), a warp per 16 of the
// group's query heads. The cache rows of one (slot, kv head) are contiguous, so each chunk
// streams into shared memory by cp.async, double-buffered (the next chunk loads while this one
// is in the tensor cores), and the warps read the forward's fragments from it (tc_smem_ld):
// the same values as tc_cache_ld's, the same tc_chunk, so the same bits.
// Shared memory: two stages of K and V chunks (TC_KC, DP) each.
template <int NK>
__global__ void __launch_bounds__(128)
tc_cached16_kernel(float *out, const float *q, lb_kv_layer c, const int32_t *slot,
                   const int32_t *pos, int hq, float cl, unsigned long long *err)
{
    extern __shared__ __align__(16) unsigned char tc_sm[];
    __nv_bfloat16 *sm = reinterpret_cast<__nv_bfloat16 *>(tc_sm);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const int d = c.d, group = hq / c.hkv;
    const int i = blockIdx.x / c.hkv, hk = blockIdx.x % c.hkv;
    const int h0 = hk * group + warp * 16, hmax = (hk + 1) * group;   // query head of row 0
    const int sl = slot[i], ps = pos[i];
    const int hr[2] = {h0 + g, h0 + g + 8};
    const __nv_bfloat16 *kx, *vx;
    if (!tc_cached16_start<NK>(sm, &kx, &vx, out, c, i, hk, sl, ps, hq, hr, hmax, tq, true, err))
        return;   // the whole block
    uint32_t qa[NK][4];   // while the first chunk loads
    tc_qfrag_heads<NK>(qa, q, i, hq, hr, hmax, d, tq);
    const tc_qreg<NK> qr = {qa};
    const int pos2[1][2] = {{ps, ps}};
    tc_state<NK> st[1];
    tc_state_init(st[0]);
    tc_cached16_chunks<NK>(sm, kx, vx, ps, lane, [&](const tc_smem_ld &ld, int j0) {
        tc_chunk<NK, 1>(st, qr, ld, j0, pos2, cl, lane);
    });
#pragma unroll
    for (int r = 0; r < 2; r++)
        if (hr[r] < hmax) tc_out_store<NK>(out + ((size_t)i * hq + hr[r]) * d, NULL, st[0], r, tq, d);
}

// tc_cached16_kernel with W warps on one (token, kv head): at decode a group of up to 16 query
// heads is one warp's rows, so a block of one warp (and its 70 KB of stages: three blocks an
// SM) left the tensor cores waiting on one warp's chain of products (0.19 ms for a decode step
// of 256 rows over four layers, 1.8 TB/s, ncu on an H200, 2026-12-02). Here warp w takes
// the chunk's key n-tiles [8w/W, 8(w+1)/W) for S = Q K^T and head-dim n-tiles
// [2NK w/W, 2NK(w+1)/W) for P V, each element computed as in tc_chunk (the same k order), and
// tc_online's steps are spread without changing an operation: the row maxima are order-free;
// each thread's running sum of probabilities passes from warp to warp in n-tile order (warp 0
// starts at zero, as tc_online's loop), then the same two shuffles; every warp then holds the
// same m, l and alpha. P's bf16 A fragments go through shared memory, one k-step per 16 keys.
template <int NK, int W> struct tcw_xch {
    float mx[W][32][2];      // each lane's row maxima over its warp's columns
    float ls[32][2];         // the running sum, handed on from warp to warp
    uint32_t pa[4][32][4];   // P's A fragments, k-step ks of 16 keys
};

// A warp's state: tc_state's m and l (the same in every warp), its DT head-dim n-tiles of o
// (indices known at compile time, so they stay in registers).
template <int DT> struct tcw_state {
    float m[2], l[2];
    float o[DT][4];
};

template <int NK, int W>
__device__ __forceinline__ void tcw_chunk(tcw_state<2 * NK / W> &st, const tc_qreg<NK> &qa,
                                          const tc_smem_ld &ld, int j0, int ps, float c,
                                          int lane, int warp, tcw_xch<NK, W> *x)
{
    constexpr int NT = 8 / W, DT = 2 * NK / W;
    const int tq = lane & 3, nt0 = warp * NT, dt0 = warp * DT;
    float s[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) s[nt][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < NK; kk++) {
        uint32_t a[4];
        qa.afrag(a, 0, kk);
#pragma unroll
        for (int nt = 0; nt < NT; nt += 2) {
            uint32_t b[4];
            ld.kfrag2(b, nt0 + nt, kk);
            tc_mma(s[nt], a, b[0], b[1]);
            tc_mma(s[nt + 1], a, b[2], b[3]);
        }
    }
    // tc_online, MASK true, both rows at position ps
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int j = j0 + (nt0 + nt) * 8 + 2 * tq + (e & 1);
            const float v = j <= ps ? __fmul_rn(s[nt][e], c) : -INFINITY;
            s[nt][e] = v;
            mx[e >> 1] = fmaxf(mx[e >> 1], v);
        }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        x->mx[warp][lane][r] = mx[r];
    }
    __syncthreads();
    float alpha[2], mn[2], ls[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
#pragma unroll
        for (int w = 0; w < W; w++) mx[r] = fmaxf(mx[r], x->mx[w][lane][r]);
        mn[r] = fmaxf(st.m[r], mx[r]);
        alpha[r] = tc_exp2(__fsub_rn(st.m[r], mn[r]));
    }
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) s[nt][e] = tc_exp2(__fsub_rn(s[nt][e], mn[e >> 1]));
    // the running sum: warp w adds its n-tiles to what warps 0 .. w - 1 left
#pragma unroll
    for (int w = 0; w < W; w++) {
        if (warp == w) {
            ls[0] = w ? x->ls[lane][0] : 0.0f, ls[1] = w ? x->ls[lane][1] : 0.0f;
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) ls[e >> 1] = __fadd_rn(ls[e >> 1], s[nt][e]);
            x->ls[lane][0] = ls[0], x->ls[lane][1] = ls[1];
        }
        __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        ls[r] = x->ls[lane][r];
        ls[r] = __fadd_rn(ls[r], __shfl_xor_sync(0xffffffffu, ls[r], 1));
        ls[r] = __fadd_rn(ls[r], __shfl_xor_sync(0xffffffffu, ls[r], 2));
        st.l[r] = __fadd_rn(__fmul_rn(st.l[r], alpha[r]), ls[r]);
        st.m[r] = mn[r];
    }
    // this warp's k-steps of P (tc_ctoa's packing)
#pragma unroll
    for (int kc = 0; kc < NT / 2; kc++) {
        uint32_t *pa = x->pa[nt0 / 2 + kc][lane];
        pa[0] = tc_pack(s[2 * kc][0], s[2 * kc][1]);
        pa[1] = tc_pack(s[2 * kc][2], s[2 * kc][3]);
        pa[2] = tc_pack(s[2 * kc + 1][0], s[2 * kc + 1][1]);
        pa[3] = tc_pack(s[2 * kc + 1][2], s[2 * kc + 1][3]);
    }
    const int moved = alpha[0] != 1.0f || alpha[1] != 1.0f;
    if (__any_sync(0xffffffffu, moved))   // the same in every warp: the same rows' alpha
#pragma unroll
        for (int dt = 0; dt < DT; dt++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                st.o[dt][e] = __fmul_rn(st.o[dt][e], alpha[e >> 1]);
    __syncthreads();
#pragma unroll
    for (int ks = 0; ks < 4; ks++) {
        uint32_t pa[4];
#pragma unroll
        for (int e = 0; e < 4; e++) pa[e] = x->pa[ks][lane][e];
#pragma unroll
        for (int dt = 0; dt < DT; dt += 2) {
            uint32_t b[4];
            ld.vfrag2(b, ks, dt0 + dt);
            tc_mma(st.o[dt], pa, b[0], b[1]);
            tc_mma(st.o[dt + 1], pa, b[2], b[3]);
        }
    }
}

template <int NK, int W>
__global__ void __launch_bounds__(32 * W)
tc_cached16w_kernel(float *out, const float *q, lb_kv_layer c, const int32_t *slot,
                    const int32_t *pos, int hq, float cl, unsigned long long *err)
{
    constexpr int D16 = 16 * NK, DP = D16 + 8, TILE = TC_KC * DP, DT = 2 * NK / W;
    extern __shared__ __align__(16) unsigned char tc_sm[];
    __nv_bfloat16 *sm = reinterpret_cast<__nv_bfloat16 *>(tc_sm);
    tcw_xch<NK, W> *xch = reinterpret_cast<tcw_xch<NK, W> *>(tc_sm + 4 * TILE * sizeof(*sm));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const int d = c.d, group = hq / c.hkv;
    const int i = blockIdx.x / c.hkv, hk = blockIdx.x % c.hkv;
    const int h0 = hk * group, hmax = (hk + 1) * group;   // query head of row 0
    const int sl = slot[i], ps = pos[i];
    const int hr[2] = {h0 + g, h0 + g + 8};
    const __nv_bfloat16 *kx, *vx;
    if (!tc_cached16_start<NK>(sm, &kx, &vx, out, c, i, hk, sl, ps, hq, hr, hmax, tq, warp == 0,
                               err))
        return;   // the whole block
    uint32_t qa[NK][4];   // while the first chunk loads
    tc_qfrag_heads<NK>(qa, q, i, hq, hr, hmax, d, tq);
    const tc_qreg<NK> qr = {qa};
    tcw_state<DT> st;
#pragma unroll
    for (int r = 0; r < 2; r++) st.m[r] = -INFINITY, st.l[r] = 0.0f;
#pragma unroll
    for (int dt = 0; dt < DT; dt++)
#pragma unroll
        for (int e = 0; e < 4; e++) st.o[dt][e] = 0.0f;
    tc_cached16_chunks<NK>(sm, kx, vx, ps, lane, [&](const tc_smem_ld &ld, int j0) {
        tcw_chunk<NK, W>(st, qr, ld, j0, ps, cl, lane, warp, xch);
    });
#pragma unroll
    for (int r = 0; r < 2; r++) {
        if (hr[r] >= hmax) continue;
        float *o = out + ((size_t)i * hq + hr[r]) * d;
        const float l = st.l[r];
#pragma unroll
        for (int dt = 0; dt < DT; dt++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int x = (warp * DT + dt) * 8 + 2 * tq + e;
                if (x < d) o[x] = __fdiv_rn(st.o[dt][2 * r + e], l);
            }
    }
}

// --- backward ----------------------------------------------------------------------------------
// p_ij = exp2(s_ij c - lse_i log2 e), dp_ij = dout_i . v_j, ds_ij = p_ij (dp_ij - D_i);
// dq_i = scale sum_j bf16(ds_ij) k_j; dk_j = scale sum bf16(ds_ij) q_i;
// dv_j = sum bf16(p_ij) dout_i.

// Probabilities and dS of a 16 x 64 tile (C layout: s[nt][e] at row g + 8 (e >> 1), column
// nt * 8 + 2 tq + (e & 1)), from scores s and dout . v products dp, in place:
// s <- p (0 where masked), dp <- ds. keep(e, nt) says whether the element is unmasked;
// l2[e >> 1], dd[e >> 1] are the row's lse * log2 e and D (for key-major tiles: per column).
__device__ __forceinline__ float tc_p(float s, float c, float l2)
{
    return tc_exp2(__fsub_rn(__fmul_rn(s, c), l2));
}

__device__ __forceinline__ float tc_ds(float p, float dp, float dd)
{
    return __fmul_rn(p, __fsub_rn(dp, dd));
}

// This thread's dq fragment acc, times scale, into its two query rows of dq (rows >= t are
// skipped): the end of every dq kernel.
template <int NK>
__device__ __forceinline__ void tc_dq_store(float *dq, const float (&acc)[2 * NK][4],
                                            const int (&rows)[2], int bi, int h, int t, int hq,
                                            int d, int tq, float scale)
{
#pragma unroll
    for (int r = 0; r < 2; r++)
        if (rows[r] < t)
            tc_row_out<NK>(dq + tc_row(bi, rows[r], h, t, hq, d), acc, r, tq, d,
                           [scale](float v) { return __fmul_rn(v, scale); });
}

// A dq kernel's inputs for this thread's two query rows (zeros for rows >= t): the q and dO
// fragments, lse * log2 e and D (lse and D: the (batch, head)'s rows); and its accumulator,
// zeroed.
template <int NK, typename TQ>
__device__ __forceinline__ void tc_dq_rows(uint32_t (&qa)[NK][4], uint32_t (&ga)[NK][4],
                                           float (&l2)[2], float (&dd)[2], float (&acc)[2 * NK][4],
                                           const TQ *q, const float *dout, const float *lse,
                                           const float *D, const int (&rows)[2], int bi, int h,
                                           int t, int hq, int d, int tq)
{
    tc_qfrag<NK>(qa, rows[0] < t ? q + tc_row(bi, rows[0], h, t, hq, d) : NULL,
                 rows[1] < t ? q + tc_row(bi, rows[1], h, t, hq, d) : NULL, d, tq);
    tc_qfrag<NK>(ga, rows[0] < t ? dout + tc_row(bi, rows[0], h, t, hq, d) : NULL,
                 rows[1] < t ? dout + tc_row(bi, rows[1], h, t, hq, d) : NULL, d, tq);
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l2[r] = rows[r] < t ? __fmul_rn(lse[rows[r]], (float)TC_LOG2E) : 0.0f;
        dd[r] = rows[r] < t ? D[rows[r]] : 0.0f;
    }
#pragma unroll
    for (int dt = 0; dt < 2 * NK; dt++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[dt][e] = 0.0f;
}

// A dk/dv kernel's results for this thread's two key rows (none beyond t): dk = ak times scale,
// dv = av.
template <int NK>
__device__ __forceinline__ void tc_dkdv_store(float *dk, float *dv, const float (&ak)[2 * NK][4],
                                              const float (&av)[2 * NK][4], const int (&keys)[2],
                                              int bi, int hk, int t, int hkv, int d, int tq,
                                              float scale)
{
#pragma unroll
    for (int r = 0; r < 2; r++) {
        if (keys[r] >= t) continue;
        float *ok = dk + tc_row(bi, keys[r], hk, t, hkv, d);
        float *ov = dv + tc_row(bi, keys[r], hk, t, hkv, d);
#pragma unroll
        for (int dt = 0; dt < 2 * NK; dt++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int x = dt * 8 + 2 * tq + e;
                if (x < d) {
                    ok[x] = __fmul_rn(ak[dt][2 * r + e], scale);
                    ov[x] = av[dt][2 * r + e];
                }
            }
    }
}

// The dk/dv kernels' staging of a query chunk's rows c0 .. c0 + TC_KC - 1 of head h: lse * log2 e
// into l2, D into dd (zero beyond t), by the block's NT threads.
template <int NT>
__device__ __forceinline__ void tc_stage_rows(float *l2, float *dd, const float *lse,
                                              const float *D, int bi, int h, int c0, int t,
                                              int hq)
{
    const size_t lrow = ((size_t)bi * hq + h) * t;
    for (int e = threadIdx.x; e < TC_KC; e += NT) {
        const int i = c0 + e;
        l2[e] = i < t ? __fmul_rn(lse[lrow + i], (float)TC_LOG2E) : 0.0f;
        dd[e] = i < t ? D[lrow + i] : 0.0f;
    }
}

// dq: a block is TC_BWD_WARPS x 16 query rows of one (batch, head); key chunks stream through
// shared memory (two stages of K, V (TC_KC, DP)).
template <int NK, typename TQ>
__global__ void __launch_bounds__(TC_BWD_WARPS * 32)
tc_bwd_dq_kernel(float *dq, const float *dout, const TQ *q, const __nv_bfloat16 *kb,
                 const __nv_bfloat16 *vb, const float *lse, const float *D, int t, int hq,
                 int hkv, int d, float c, float scale)
{
    constexpr int DP = 16 * NK + 8, NT = TC_BWD_WARPS * 32, TILE = TC_KC * DP;
    extern __shared__ __align__(16) unsigned char tc_sm[];
    __nv_bfloat16 *sm = reinterpret_cast<__nv_bfloat16 *>(tc_sm);
    const int bi = blockIdx.y, h = blockIdx.x, hk = h / (hq / hkv);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const int i0 = tc_tile_last_first() * (TC_BWD_WARPS * 16), iw = i0 + warp * 16;
    const int rows[2] = {iw + g, iw + g + 8};
    const size_t lrow = ((size_t)bi * hq + h) * t;
    const int nchunks = (min(i0 + TC_BWD_WARPS * 16, t) - 1) / TC_KC + 1;
    tc_load<NK, NT>(sm, kb, bi, 0, hk, t, hkv);
    tc_load<NK, NT>(sm + TILE, vb, bi, 0, hk, t, hkv);
    tc_cp_commit();
    uint32_t qa[NK][4], ga[NK][4];
    float l2[2], dd[2], acc[2 * NK][4];
    tc_dq_rows<NK, TQ>(qa, ga, l2, dd, acc, q, dout, lse + lrow, D + lrow, rows, bi, h, t, hq,
                       d, tq);
    for (int ch = 0; ch < nchunks; ch++) {
        const int j0 = ch * TC_KC;
        if (ch + 1 < nchunks) {
            __nv_bfloat16 *nx = sm + ((ch + 1) & 1) * 2 * TILE;
            tc_load<NK, NT>(nx, kb, bi, j0 + TC_KC, hk, t, hkv);
            tc_load<NK, NT>(nx + TILE, vb, bi, j0 + TC_KC, hk, t, hkv);
            tc_cp_commit();
            tc_cp_wait<1>();
        } else {
            tc_cp_wait<0>();
        }
        __syncthreads();
        const __nv_bfloat16 *ks = sm + (ch & 1) * 2 * TILE, *vs = ks + TILE;
        if (iw < t && j0 <= iw + 15) {
            float s[8][4], dp[8][4];
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) s[nt][e] = dp[nt][e] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < NK; kk++)
#pragma unroll
                for (int nt = 0; nt < 8; nt += 2) {
                    uint32_t b[4];
                    tc_bfrag2(b, ks, DP, lane, nt, kk);
                    tc_mma(s[nt], qa[kk], b[0], b[1]);
                    tc_mma(s[nt + 1], qa[kk], b[2], b[3]);
                    tc_bfrag2(b, vs, DP, lane, nt, kk);
                    tc_mma(dp[nt], ga[kk], b[0], b[1]);
                    tc_mma(dp[nt + 1], ga[kk], b[2], b[3]);
                }
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int j = j0 + nt * 8 + 2 * tq + (e & 1), r = e >> 1;
                    const float p = j <= rows[r] ? tc_p(s[nt][e], c, l2[r]) : 0.0f;
                    dp[nt][e] = tc_ds(p, dp[nt][e], dd[r]);
                }
#pragma unroll
            for (int kc = 0; kc < 4; kc++) {
                uint32_t da[4];
                tc_ctoa(da, dp, kc);
#pragma unroll
                for (int dt = 0; dt < 2 * NK; dt += 2) {
                    uint32_t b[4];
                    tc_bfrag_t(b, ks, DP, lane, kc, dt);
                    tc_mma(acc[dt], da, b[0], b[1]);
                    tc_mma(acc[dt + 1], da, b[2], b[3]);
                }
            }
        }
        __syncthreads();
    }
    tc_dq_store<NK>(dq, acc, rows, bi, h, t, hq, d, tq, scale);
}

// dk, dv: a block is TC_KC key rows of one (batch, kv head) (16 per warp, kept in shared
// memory as K, V (TC_KC, DP)); for each query head of the group in order, query chunks of
// TC_KC stream through shared memory, double-buffered (Q, dO (TC_KC, DP); lse * log2 e and D
// per query). Tiles are key-major: S^T = K Q^T, dP^T = V dO^T, dv += P^T dO, dk += dS^T Q.
// Key tiles start in order (blockIdx.z): tile 0 sees every query and is the longest.
template <int NK>
__global__ void __launch_bounds__(TC_BWD_WARPS * 32)
tc_bwd_dkdv_kernel(float *dk, float *dv, const __nv_bfloat16 *qb, const __nv_bfloat16 *gb,
                   const __nv_bfloat16 *kb, const __nv_bfloat16 *vb, const float *lse,
                   const float *D, int t, int hq, int hkv, int d, float c, float scale)
{
    constexpr int DP = 16 * NK + 8, NT = TC_BWD_WARPS * 32, TILE = TC_KC * DP;
    extern __shared__ __align__(16) unsigned char tc_sm[];
    // kt, vt; then per stage s: Q at st + 2 s TILE, dO after it; then l2s, dds (2, TC_KC)
    __nv_bfloat16 *kt = reinterpret_cast<__nv_bfloat16 *>(tc_sm), *vt = kt + TILE;
    __nv_bfloat16 *st = vt + TILE;
    float *l2s = reinterpret_cast<float *>(st + 4 * TILE), *dds = l2s + 2 * TC_KC;
    const int bi = blockIdx.y, hk = blockIdx.x, j0 = blockIdx.z * TC_KC, group = hq / hkv;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const int jw = j0 + warp * 16;
    const int keys[2] = {jw + g, jw + g + 8};
    const int cf = j0 / TC_KC, nper = (t + TC_KC - 1) / TC_KC - cf, items = group * nper;
    // item it: query head hk * group + it / nper, query chunk cf + it % nper
    auto issue = [&](int it) {
        const int h = hk * group + it / nper, c0 = (cf + it % nper) * TC_KC, stg = it & 1;
        tc_load<NK, NT>(st + 2 * stg * TILE, qb, bi, c0, h, t, hq);
        tc_load<NK, NT>(st + (2 * stg + 1) * TILE, gb, bi, c0, h, t, hq);
        tc_stage_rows<NT>(l2s + stg * TC_KC, dds + stg * TC_KC, lse, D, bi, h, c0, t, hq);
    };
    tc_load<NK, NT>(kt, kb, bi, j0, hk, t, hkv);
    tc_load<NK, NT>(vt, vb, bi, j0, hk, t, hkv);
    issue(0);
    tc_cp_commit();
    const __nv_bfloat16 *kw = kt + warp * 16 * DP, *vw = vt + warp * 16 * DP;
    float ak[2 * NK][4], av[2 * NK][4];
#pragma unroll
    for (int dt = 0; dt < 2 * NK; dt++)
#pragma unroll
        for (int e = 0; e < 4; e++) ak[dt][e] = av[dt][e] = 0.0f;
    for (int it = 0; it < items; it++) {
        if (it + 1 < items) {   // the next item into the other stage (free since it - 1)
            issue(it + 1);
            tc_cp_commit();
            tc_cp_wait<1>();
        } else {
            tc_cp_wait<0>();
        }
        __syncthreads();
        const int c0 = (cf + it % nper) * TC_KC, stg = it & 1;
        const __nv_bfloat16 *qs = st + 2 * stg * TILE, *gs = qs + TILE;
        const float *l2c = l2s + stg * TC_KC, *ddc = dds + stg * TC_KC;
        if (jw < t) {
            float s[8][4], dp[8][4];
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) s[nt][e] = dp[nt][e] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < NK; kk++) {
                uint32_t ka[4], va[4];
                tc_afrag(ka, kw, DP, lane, kk);
                tc_afrag(va, vw, DP, lane, kk);
#pragma unroll
                for (int nt = 0; nt < 8; nt += 2) {
                    uint32_t b[4];
                    tc_bfrag2(b, qs, DP, lane, nt, kk);
                    tc_mma(s[nt], ka, b[0], b[1]);
                    tc_mma(s[nt + 1], ka, b[2], b[3]);
                    tc_bfrag2(b, gs, DP, lane, nt, kk);
                    tc_mma(dp[nt], va, b[0], b[1]);
                    tc_mma(dp[nt + 1], va, b[2], b[3]);
                }
            }
            // s <- p, dp <- ds; query i = c0 + column, key j = keys[row]
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int col = nt * 8 + 2 * tq + (e & 1), i = c0 + col;
                    const float p = i >= keys[e >> 1] && i < t ? tc_p(s[nt][e], c, l2c[col])
                                                                : 0.0f;
                    s[nt][e] = p;
                    dp[nt][e] = tc_ds(p, dp[nt][e], ddc[col]);
                }
#pragma unroll
            for (int kc = 0; kc < 4; kc++) {
                uint32_t pa[4];
                tc_ctoa(pa, s, kc);
                uint32_t da[4];
                tc_ctoa(da, dp, kc);
#pragma unroll
                for (int dt = 0; dt < 2 * NK; dt += 2) {
                    uint32_t b[4];
                    tc_bfrag_t(b, gs, DP, lane, kc, dt);
                    tc_mma(av[dt], pa, b[0], b[1]);
                    tc_mma(av[dt + 1], pa, b[2], b[3]);
                    tc_bfrag_t(b, qs, DP, lane, kc, dt);
                    tc_mma(ak[dt], da, b[0], b[1]);
                    tc_mma(ak[dt + 1], da, b[2], b[3]);
                }
            }
        }
        __syncthreads();
    }
    tc_dkdv_store<NK>(dk, dv, ak, av, keys, bi, hk, t, hkv, d, tq, scale);
}

// --- forward and backward on wgmma (sm_90a; head dims of 64 or 128) ------------------------------
//
// The same kernels, with the products that read a 64-row tile of keys (dq: S = Q K^T,
// dP = dO V^T) or of queries (dk/dv: S^T = K Q^T, dP^T = V dO^T) issued by the four warps as
// one warpgroup (wgmma m64n64k16, B read by the tensor cores straight from shared memory)
// instead of per-warp mma.sync with ldmatrix fragments. The tiles are stored in the 128-byte
// swizzle the wgmma descriptors name: rows of 64 elements (128 bytes), 8-row groups 1024 bytes
// apart, the 16-byte chunk c of row r at chunk c ^ (r % 8); a head dim of 128 is two such
// tiles side by side. The warpgroup's fp32 result has, per warp, the C layout of mma.sync
// (rows 16 w + g, g + 8), so p and dS are the code above, and they become the A fragments (in
// registers) of the products with a transposed operand (dq += dS K, dv += P^T dO, dk += dS^T
// Q), on wgmma too, the same tiles read N-major. Sums run in a fixed order (k16 steps in
// order), so the results are deterministic and batch invariant (the backward has no bitwise
// partner: only the forward is matched by the cache kernel). The tiles arrive by TMA
// (tw_tma), whose 128-byte swizzle is this one.
#define TW_ROWS 64                      // rows of a swizzled tile (keys or queries)
#define TW_ATOM (TW_ROWS * 128)         // bytes of one 64-element-wide part of a tile

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Rows [r0, r0 + TW_ROWS) of head h of batch bi of the tensor behind map (x (b, t, heads, 16 NK)
// bf16: tw_map) into the swizzled tile at shared address s, by the tensor-memory accelerator:
// the swizzle is the map's, rows past t arrive as zeros, and the bytes complete on mbarrier
// bar. One thread issues.
template <int NK>
__device__ __forceinline__ void tw_tma(uint32_t s, const CUtensorMap *map, int bi, int r0, int h,
                                       uint32_t bar)
{
#pragma unroll
    for (int part = 0; part < NK / 4; part++)
        asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
                     " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(s + part * TW_ATOM),
                     "l"((uint64_t)map), "r"(part * 64), "r"(h), "r"(r0), "r"(bi), "r"(bar)
                     : "memory");
}

// Two tiles (of maps a and b, the same rows) into s and s + one tile, announced on bar.
template <int NK>
__device__ __forceinline__ void tw_tma2(uint32_t s, const CUtensorMap *a, const CUtensorMap *b,
                                        int bi, int r0, int h, uint32_t bar)
{
    constexpr uint32_t TILE = TW_ROWS * 32 * NK;
    lb_mbar_expect(bar, 2 * TILE);
    tw_tma<NK>(s, a, bi, r0, h, bar);
    tw_tma<NK>(s + TILE, b, bi, r0, h, bar);
}

// Thread 0 sets up n mbarriers at bar, 8 bytes apart, each completed by one arrival and its
// bytes; a block barrier must follow before anyone else waits on them.
__device__ __forceinline__ void tw_bars_init(uint32_t bar, int n)
{
    if (threadIdx.x == 0) {
        for (int i = 0; i < n; i++) lb_mbar_init(bar + 8 * i, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
}

// Descriptor of the k16 step kk of a swizzled tile at shared address s (as gg_desc).
__device__ __forceinline__ uint64_t tw_desc(uint32_t s, int kk)
{
    const uint32_t a = s + (kk >> 2) * TW_ATOM + (kk & 3) * 32;
    return (uint64_t)((a & 0x3FFFF) >> 4) | (uint64_t)1 << 16 | (uint64_t)(1024 >> 4) << 32 |
           (uint64_t)1 << 62;
}

// Descriptor of k16 step kk of a product whose B is a swizzled tile read N-major (the tile's
// rows are k, its columns n; a transposed operand such as K in dS K): 16 rows, 64 columns from
// part `part` of the tile. For the 128-byte swizzle the 8-row groups are SBO = 1024 bytes
// apart along k and the 64-column parts LBO = TW_ATOM bytes apart along n (PTX ISA, canonical
// MN-major layout ((8,8,m),(8,k)) : ((1,8,LBO),(64,SBO)) in elements).
__device__ __forceinline__ uint64_t tw_desc_n(uint32_t s, int kk, int part)
{
    const uint32_t a = s + part * TW_ATOM + kk * 2048;
    return (uint64_t)((a & 0x3FFFF) >> 4) | (uint64_t)(TW_ATOM >> 4) << 16 |
           (uint64_t)(1024 >> 4) << 32 | (uint64_t)1 << 62;
}

#define TW_D32_ASM                                                                             \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "     \
    "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define TW_D4(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define TW_D32(d)                                                                              \
    TW_D4(d, 0), TW_D4(d, 4), TW_D4(d, 8), TW_D4(d, 12), TW_D4(d, 16), TW_D4(d, 20),           \
        TW_D4(d, 24), TW_D4(d, 28)

// d (64 x 64) = (acc ? d : 0) + A (64 x 16) B (64 x 16)^T; A and B from shared memory.
__device__ __forceinline__ void tw_wgmma_ss(float (&d)[32], uint64_t da, uint64_t db, int acc)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " TW_D32_ASM
                 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : TW_D32(d)
                 : "l"(da), "l"(db), "r"(acc));
}

// The same with A in registers: each warp's 16 rows as an mma.sync A fragment.
__device__ __forceinline__ void tw_wgmma_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t db,
                                            int acc)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " TW_D32_ASM
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                 : TW_D32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc));
}

// d (64 x 64) += A (64 x 16, registers) B (16 x 64), B N-major in shared memory (tw_desc_n).
__device__ __forceinline__ void tw_wgmma_rs_n(float (&d)[32], const uint32_t (&a)[4], uint64_t db)
{
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " TW_D32_ASM
                 ", {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"
                 : TW_D32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

// d (64 x 64) += A (64 x 16) B (16 x 64), both from shared memory and both MN-major (tw_desc_n):
// dq += dS K with the dS tile stored key-major (tw_ds_store).
__device__ __forceinline__ void tw_wgmma_ss_nn(float (&d)[32], uint64_t da, uint64_t db)
{
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " TW_D32_ASM
                 ", %32, %33, 1, 1, 1, 1, 1;\n"
                 : TW_D32(d)
                 : "l"(da), "l"(db));
}

// bytes (a multiple of 16) from global src into shared dst, completing on mbarrier bar.
__device__ __forceinline__ void tw_bulk(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar)
{
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

// dS^T of one dk/dv item (64 keys x 64 queries) from this thread's bf16 A fragments da (rows 16
// warp + g and + 8, tc_ctoa's layout) into its 8 KB tile: key rows of 128 bytes, the 16-byte
// chunk c of row r at chunk c ^ (r % 8). That is the 128-byte swizzle of the shared-memory
// tiles, so the dq kernel copies a tile as it is and reads it as an MN-major wgmma operand.
__device__ __forceinline__ void tw_ds_store(__nv_bfloat16 *tile, const uint32_t (&da)[4][4],
                                            int warp, int g, int tq)
{
    char *row = reinterpret_cast<char *>(tile) + (16 * warp + g) * 128 + 4 * tq;
#pragma unroll
    for (int kc = 0; kc < 4; kc++)
#pragma unroll
        for (int hi = 0; hi < 2; hi++) {
            const int off = ((2 * kc + hi) ^ g) * 16;   // (g + 8) % 8 == g
            *reinterpret_cast<uint32_t *>(row + off) = da[kc][2 * hi];
            *reinterpret_cast<uint32_t *>(row + 8 * 128 + off) = da[kc][2 * hi + 1];
        }
}

// The (8, 4) C-layout fragment as the 32 registers of a 64-column wgmma result (the same order).
__device__ __forceinline__ float (&tw_flat(float (&s)[8][4]))[32]
{
    return *reinterpret_cast<float(*)[32]>(&s[0][0]);
}

// Columns [64 part, 64 part + 64) of a (2 NK, 4) C-layout accumulator, as tw_flat.
template <int NK>
__device__ __forceinline__ float (&tw_part(float (&s)[2 * NK][4], int part))[32]
{
    return *reinterpret_cast<float(*)[32]>(&s[8 * part][0]);
}

__device__ __forceinline__ void tw_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void tw_commit()
{
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void tw_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void tw_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }
__device__ __forceinline__ void tw_commit_wait()
{
    tw_commit();
    tw_wait();
}

// acc (64 x 16 NK, C layout) += bf16(p) (64 x 64 in C layout, which becomes the register A
// fragments) times the swizzled tile at shared address `tile` read N-major (64 k rows, 16 NK
// columns): issued after a wgmma fence; the caller commits and waits.
template <int NK>
__device__ __forceinline__ void tw_mma_pn(float (&acc)[2 * NK][4], const float (&p)[8][4],
                                          uint32_t tile)
{
    uint32_t pa[4][4];
#pragma unroll
    for (int kc = 0; kc < 4; kc++) tc_ctoa(pa[kc], p, kc);
    tw_fence();
#pragma unroll
    for (int kc = 0; kc < 4; kc++)
#pragma unroll
        for (int part = 0; part < NK / 4; part++)
            tw_wgmma_rs_n(tw_part<NK>(acc, part), pa[kc], tw_desc_n(tile, kc, part));
}
#endif

// The forward as tc_fwd_kernel, 64 query rows per block (one warpgroup: warp w holds rows
// 16 w + g and + 8, the C layout of mma.sync), Q as A fragments in registers, K and V chunks
// swizzled in two stages. S = Q K^T and O += P V run on wgmma with their k16 steps in
// tc_chunk's order, and the softmax step is tc_online: wgmma and mma.sync give the same bits
// for the same k16 steps (measured on the H200: doc/backends.md), so every row equals the cache
// kernel's bit for bit, as test_backend_ops checks. With 64-row tiles on 64-key chunks every
// row of a block needs every chunk up to the diagonal one. NK is 4 or 8.
template <int NK, typename TQ>
__global__ void __launch_bounds__(128)
tw_fwd_kernel(float *out, __nv_bfloat16 *out16, float *lse, const TQ *q,
              const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv,
              int t, int hq, int hkv, int d, float c)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int TILE = TW_ROWS * 32 * NK;   // bytes of a (64, 16 NK) bf16 tile
    static_assert(TW_ROWS == TC_KC, "a query tile is one key chunk");
    extern __shared__ __align__(16) unsigned char tc_sm[];
    const uint32_t base = ((uint32_t)__cvta_generic_to_shared(tc_sm) + 1023) & ~1023u;
    const int bi = blockIdx.y, h = blockIdx.x, hk = h / (hq / hkv);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const int i0 = tc_tile_last_first() * TW_ROWS, iw = i0 + warp * 16;
    const int pos[2] = {iw + g, iw + g + 8};
    const int nchunks = (min(i0 + TW_ROWS, t) - 1) / TC_KC + 1;
    const uint32_t full = base + 4 * TILE;   // the stages' mbarriers
    tw_bars_init(full, 2);
    if (threadIdx.x == 0) tw_tma2<NK>(base, &tk, &tv, bi, 0, hk, full);
    uint32_t qa[NK][4];
    tc_qfrag<NK>(qa, pos[0] < t ? q + tc_row(bi, pos[0], h, t, hq, d) : NULL,
                 pos[1] < t ? q + tc_row(bi, pos[1], h, t, hq, d) : NULL, d, tq);
    tc_state<NK> st;
    tc_state_init(st);
    __syncthreads();   // the mbarriers are set up
    for (int ch = 0; ch < nchunks; ch++) {
        const int j0 = ch * TC_KC;
        if (threadIdx.x == 0 && ch + 1 < nchunks) {   // the next chunk into the other stage
            const int sn = (ch + 1) & 1;               // (free since ch - 1's last barrier)
            tw_tma2<NK>(base + sn * 2 * TILE, &tk, &tv, bi, j0 + TC_KC, hk, full + 8 * sn);
        }
        lb_mbar_wait(full + 8 * (ch & 1), (ch >> 1) & 1);   // chunk ch has landed
        const uint32_t ks = base + (ch & 1) * 2 * TILE, vs = ks + TILE;
        float s[8][4];   // from 0, accumulated k16 step by step as tc_chunk does
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) s[nt][e] = 0.0f;
        tw_fence();
#pragma unroll
        for (int kk = 0; kk < NK; kk++) tw_wgmma_rs(tw_flat(s), qa[kk], tw_desc(ks, kk), 1);
        tw_commit_wait();
        // only the last chunk (the diagonal one) has keys after some of the block's rows
        if (ch + 1 < nchunks) tc_online<NK, false, true>(st, s, j0, pos, c, tq);
        else tc_online<NK, true, true>(st, s, j0, pos, c, tq);
        tw_mma_pn<NK>(st.o, s, vs);   // O += P V
        tw_commit_wait();
        __syncthreads();   // chunk ch is consumed before its stage is refilled
    }
#pragma unroll
    for (int r = 0; r < 2; r++)
        if (pos[r] < t)
            tc_out_row<NK>(out, out16, tc_row(bi, pos[r], h, t, hq, d),
                           lse + ((size_t)bi * hq + h) * t + pos[r], st, r, tq, d);
#endif
}

// Element offset of the dS tile of (batch bi, query head h, query chunk ci, key chunk kj <= ci):
// per (batch, head) the T (T + 1) / 2 tiles of the causal triangle, row by row, 64 x 64 each.
__device__ __forceinline__ size_t tw_ds_tile(int bi, int h, int ci, int kj, int t, int hq)
{
    const size_t T = (t + TW_ROWS - 1) / TW_ROWS;
    return (((size_t)bi * hq + h) * (T * (T + 1) / 2) + (size_t)ci * (ci + 1) / 2 + kj) *
           (TW_ROWS * TW_ROWS);
}

// dq = scale sum_j bf16(dS_ij) k_j from the dS tiles the dk/dv kernel stored: 64 query rows per
// block (one warpgroup), each key chunk's dS tile and K tile copied into one of three stages
// (dS by a bulk copy, K by TMA), dq += dS K on wgmma with both operands read MN-major. Only
// the dq kernel's third product is left, not its recomputation of S and dP; the sums are the
// dq kernel's (the same bf16 dS values met in the same k16 steps, chunks in order), so a row's
// dq still depends only on the keys up to it. NK is 4 or 8.
template <int NK>
__global__ void __launch_bounds__(128)
tw_bwd_dq_ds_kernel(float *dq, const __nv_bfloat16 *ds, const __grid_constant__ CUtensorMap tk,
                    int t, int hq, int hkv, int d, float scale)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int TILE = TW_ROWS * 32 * NK, DS = TW_ROWS * TW_ROWS * 2, STAGE = TILE + DS;
    extern __shared__ __align__(16) unsigned char tc_sm[];
    const uint32_t base = ((uint32_t)__cvta_generic_to_shared(tc_sm) + 1023) & ~1023u;
    const int bi = blockIdx.y, h = blockIdx.x, hk = h / (hq / hkv);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const int ci = tc_tile_last_first(), iw = ci * TW_ROWS + warp * 16;
    const int rows[2] = {iw + g, iw + g + 8};
    const __nv_bfloat16 *dst = ds + tw_ds_tile(bi, h, ci, 0, t, hq);   // key chunk kj at kj tiles
    const int nchunks = ci + 1;
    const uint32_t full = base + 3 * STAGE;
    tw_bars_init(full, 3);
    auto load = [&](int ch) {   // thread 0: key chunk ch (K, then its dS tile) into stage ch % 3
        const uint32_t s = base + (ch % 3) * STAGE, bar = full + 8 * (ch % 3);
        lb_mbar_expect(bar, STAGE);
        tw_tma<NK>(s, &tk, bi, ch * TC_KC, hk, bar);
        tw_bulk(s + TILE, dst + (size_t)ch * (TW_ROWS * TW_ROWS), DS, bar);
    };
    if (threadIdx.x == 0) {
        load(0);
        if (nchunks > 1) load(1);
    }
    float acc[2 * NK][4];
#pragma unroll
    for (int dt = 0; dt < 2 * NK; dt++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[dt][e] = 0.0f;
    __syncthreads();   // the mbarriers are set up
    // Chunk ch's products run on while the block waits for chunk ch - 1's to finish, then its
    // stage is refilled with chunk ch + 2.
    for (int ch = 0; ch < nchunks; ch++) {
        const uint32_t s = base + (ch % 3) * STAGE;
        lb_mbar_wait(full + 8 * (ch % 3), (ch / 3) & 1);
        tw_fence();
#pragma unroll
        for (int kc = 0; kc < 4; kc++)
#pragma unroll
            for (int part = 0; part < NK / 4; part++)
                tw_wgmma_ss_nn(tw_part<NK>(acc, part), tw_desc_n(s + TILE, kc, 0),
                               tw_desc_n(s, kc, part));
        tw_commit();
        tw_wait1();        // chunk ch - 1's products are done
        __syncthreads();   // in every warp: its stage may be refilled
        if (threadIdx.x == 0 && ch + 2 < nchunks) load(ch + 2);
    }
    tw_wait();
    tc_dq_store<NK>(dq, acc, rows, bi, h, t, hq, d, tq, scale);
#endif
}

// dq as tc_bwd_dq_kernel, 64 query rows per block (one warpgroup); K and V chunks swizzled in
// two stages. NK is 4 or 8.
template <int NK, typename TQ>
__global__ void __launch_bounds__(128)
tw_bwd_dq_kernel(float *dq, const float *dout, const TQ *q,
                 const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv,
                 const float *lse, const float *D, int t, int hq, int hkv, int d, float c,
                 float scale)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int TILE = TW_ROWS * 32 * NK;   // bytes of a (64, 16 NK) bf16 tile
    extern __shared__ __align__(16) unsigned char tc_sm[];
    const uint32_t base = ((uint32_t)__cvta_generic_to_shared(tc_sm) + 1023) & ~1023u;
    const int bi = blockIdx.y, h = blockIdx.x, hk = h / (hq / hkv);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const int i0 = tc_tile_last_first() * TW_ROWS, iw = i0 + warp * 16;
    const int rows[2] = {iw + g, iw + g + 8};
    const size_t lrow = ((size_t)bi * hq + h) * t;
    const int nchunks = (min(i0 + TW_ROWS, t) - 1) / TC_KC + 1;
    const uint32_t full = base + 6 * TILE;   // the three stages' mbarriers
    tw_bars_init(full, 3);
    if (threadIdx.x == 0) {
        tw_tma2<NK>(base, &tk, &tv, bi, 0, hk, full);
        if (nchunks > 1) tw_tma2<NK>(base + 2 * TILE, &tk, &tv, bi, TC_KC, hk, full + 8);
    }
    uint32_t qa[NK][4], ga[NK][4];
    float l2[2], dd[2], acc[2 * NK][4];
    tc_dq_rows<NK, TQ>(qa, ga, l2, dd, acc, q, dout, lse + lrow, D + lrow, rows, bi, h, t, hq,
                       d, tq);
    __syncthreads();   // the mbarriers are set up
    // Chunk ch's dq += dS K runs on while chunk ch + 1's S and dP are issued; one wait covers
    // both. Three stages, so that chunk ch + 2 loads while ch and ch + 1 are in use.
    for (int ch = 0; ch < nchunks; ch++) {
        const int j0 = ch * TC_KC, sc = ch % 3;
        lb_mbar_wait(full + 8 * sc, (ch / 3) & 1);
        const uint32_t ks = base + sc * 2 * TILE, vs = ks + TILE;
        // S and dP in C layout (column = key j0 + nt * 8 + 2 tq + (e & 1)), then dS in place
        float s[8][4], dp[8][4];
        tw_fence();
#pragma unroll
        for (int kk = 0; kk < NK; kk++) {
            tw_wgmma_rs(tw_flat(s), qa[kk], tw_desc(ks, kk), kk);
            tw_wgmma_rs(tw_flat(dp), ga[kk], tw_desc(vs, kk), kk);
        }
        tw_commit_wait();
        __syncthreads();   // every warp is past chunk ch - 1's dq product: its stage is free
        if (threadIdx.x == 0 && ch + 2 < nchunks) {
            const int sn = (ch + 2) % 3;
            tw_tma2<NK>(base + sn * 2 * TILE, &tk, &tv, bi, j0 + 2 * TC_KC, hk, full + 8 * sn);
        }
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int j = j0 + nt * 8 + 2 * tq + (e & 1), r = e >> 1;
                const float p = j <= rows[r] ? tc_p(s[nt][e], c, l2[r]) : 0.0f;
                dp[nt][e] = tc_ds(p, dp[nt][e], dd[r]);
            }
        tw_mma_pn<NK>(acc, dp, ks);   // dq += dS K
        tw_commit();
    }
    tw_wait();
    tc_dq_store<NK>(dq, acc, rows, bi, h, t, hq, d, tq, scale);
#endif
}

// A dk/dv item's S^T and dP^T (C layout: row = key, column = query c0 + col) into P^T and dS^T,
// in place; lse * log2 e and D of the item's queries from shared memory, a pair of adjacent
// columns per load. MASK: keys after a query, and queries from t on, give p = 0.
template <bool MASK>
__device__ __forceinline__ void tw_p_ds(float (&s)[8][4], float (&dp)[8][4], const float *l2c,
                                        const float *ddc, int c0, const int (&keys)[2], int t,
                                        float c, int tq)
{
#pragma unroll
    for (int nt = 0; nt < 8; nt++) {
        const float2 l2 = *reinterpret_cast<const float2 *>(l2c + nt * 8 + 2 * tq);
        const float2 dd = *reinterpret_cast<const float2 *>(ddc + nt * 8 + 2 * tq);
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int i = c0 + nt * 8 + 2 * tq + (e & 1);
            const bool keep = !MASK || (i >= keys[e >> 1] && i < t);
            const float p = keep ? tc_p(s[nt][e], c, e & 1 ? l2.y : l2.x) : 0.0f;
            s[nt][e] = p;
            dp[nt][e] = tc_ds(p, dp[nt][e], e & 1 ? dd.y : dd.x);
        }
    }
}

// dk, dv as tc_bwd_dkdv_kernel: 64 keys per block (K, V swizzled, kept), query chunks of every
// head of the group streamed (Q, dO swizzled, two stages). NK is 4 or 8. With ds not NULL, every
// item's dS^T also goes to its tile there (tw_ds_tile), for tw_bwd_dq_ds_kernel.
template <int NK>
__global__ void __launch_bounds__(128)
tw_bwd_dkdv_kernel(float *dk, float *dv, __nv_bfloat16 *ds, const __grid_constant__ CUtensorMap tq_,
                   const __grid_constant__ CUtensorMap tg, const __grid_constant__ CUtensorMap tk,
                   const __grid_constant__ CUtensorMap tv, const float *lse, const float *D, int t,
                   int hq, int hkv, int d, float c, float scale)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int TILE = TW_ROWS * 32 * NK;
    extern __shared__ __align__(16) unsigned char tc_sm[];
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(tc_sm), base = (raw + 1023) & ~1023u;
    // kt, vt, then per stage Q and dO; then l2s, dds (2, TC_KC) floats; then the mbarriers of
    // the two stages and of K, V
    const uint32_t kt = base, vt = base + TILE, st = base + 2 * TILE;
    float *l2s = reinterpret_cast<float *>(tc_sm + (base - raw) + 6 * TILE), *dds = l2s + 2 * TC_KC;
    const uint32_t full = base + 6 * TILE + 4 * TC_KC * sizeof(float);
    const int bi = blockIdx.y, hk = blockIdx.x, j0 = blockIdx.z * TC_KC, group = hq / hkv;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const int jw = j0 + warp * 16;
    const int keys[2] = {jw + g, jw + g + 8};
    const int cf = j0 / TC_KC, nper = (t + TC_KC - 1) / TC_KC - cf, items = group * nper;
    auto issue = [&](int it) {
        const int h = hk * group + it / nper, c0 = (cf + it % nper) * TC_KC, stg = it & 1;
        if (threadIdx.x == 0) tw_tma2<NK>(st + 2 * stg * TILE, &tq_, &tg, bi, c0, h, full + 8 * stg);
        tc_stage_rows<128>(l2s + stg * TC_KC, dds + stg * TC_KC, lse, D, bi, h, c0, t, hq);
    };
    tw_bars_init(full, 3);
    if (threadIdx.x == 0) tw_tma2<NK>(kt, &tk, &tv, bi, j0, hk, full + 16);
    issue(0);
    float ak[2 * NK][4], av[2 * NK][4];
#pragma unroll
    for (int dt = 0; dt < 2 * NK; dt++)
#pragma unroll
        for (int e = 0; e < 4; e++) ak[dt][e] = av[dt][e] = 0.0f;
    __syncthreads();   // the mbarriers are set up, item 0's lse and D staged
    lb_mbar_wait(full + 16, 0);   // K and V
    // As in the dq kernel, item it's dv and dk products run on while item it + 1's S^T and dP^T
    // are issued.
    for (int it = 0; it < items; it++) {
        lb_mbar_wait(full + 8 * (it & 1), (it >> 1) & 1);
        const int c0 = (cf + it % nper) * TC_KC, stg = it & 1;
        const uint32_t qs = st + 2 * stg * TILE, gs = qs + TILE;
        const float *l2c = l2s + stg * TC_KC, *ddc = dds + stg * TC_KC;
        // S^T and dP^T in C layout (row = key, column = query), then in place P^T and dS^T
        float s[8][4], dp[8][4];
        tw_fence();
#pragma unroll
        for (int kk = 0; kk < NK; kk++) {
            tw_wgmma_ss(tw_flat(s), tw_desc(kt, kk), tw_desc(qs, kk), kk);
            tw_wgmma_ss(tw_flat(dp), tw_desc(vt, kk), tw_desc(gs, kk), kk);
        }
        tw_commit_wait();
        // Every warp is past item it - 1's products and its lse and D: the next item into
        // that stage (its lse and D are read after the next item's first barrier).
        __syncthreads();
        if (it + 1 < items) issue(it + 1);
        // P^T and dS^T in place; an item whose queries all come after the block's keys and
        // before t (most of them) skips the mask: the same values, fewer instructions.
        if (c0 >= j0 + TC_KC && c0 + TC_KC <= t)
            tw_p_ds<false>(s, dp, l2c, ddc, c0, keys, t, c, tq);
        else
            tw_p_ds<true>(s, dp, l2c, ddc, c0, keys, t, c, tq);
        // dv += P^T dO, dk += dS^T Q, dO and Q read N-major
        uint32_t pa[4][4], da[4][4];
#pragma unroll
        for (int kc = 0; kc < 4; kc++) {
            tc_ctoa(pa[kc], s, kc);
            tc_ctoa(da[kc], dp, kc);
        }
        if (ds) tw_ds_store(ds + tw_ds_tile(bi, hk * group + it / nper, c0 / TC_KC, cf, t, hq),
                            da, warp, g, tq);
        tw_fence();
#pragma unroll
        for (int kc = 0; kc < 4; kc++)
#pragma unroll
            for (int part = 0; part < NK / 4; part++) {
                tw_wgmma_rs_n(tw_part<NK>(av, part), pa[kc], tw_desc_n(gs, kc, part));
                tw_wgmma_rs_n(tw_part<NK>(ak, part), da[kc], tw_desc_n(qs, kc, part));
            }
        tw_commit();
    }
    tw_wait();
    tc_dkdv_store<NK>(dk, dv, ak, av, keys, bi, hk, t, hkv, d, tq, scale);
#endif
}

// --- launchers ---------------------------------------------------------------------------------

static float tc_c(int d) { return (float)(1.0 / sqrt((double)d) * TC_LOG2E); }

static size_t tc_align(size_t bytes) { return (bytes + 255) / 256 * 256; }

// bf16 copy of x (rows, d) as (rows, 16 ceil(d / 16)) at y; queued.
template <typename T>
static void tc_to_bf16(lb_cuda_ctx *cx, __nv_bfloat16 *y, const T *x, long rows, int d)
{
    const int d16 = (d + 15) / 16 * 16;
    const long pairs = rows * (d16 / 2);
    if (!pairs) return;
    tc_to_bf16_kernel<<<(unsigned)((pairs + 255) / 256), 256, 0, cx->stream>>>(y, x, rows, d, d16);
    LB_CUDA_LAUNCHED(cx);
}

// x (rows, d) as the kernels read it, bf16 rows of 16 ceil(d / 16): x16 itself where it is
// given and d is a multiple of 16 (the same values a copy would hold), else a copy into y.
static const __nv_bfloat16 *tc_rows16(lb_cuda_ctx *cx, __nv_bfloat16 *y, const float *x,
                                      const uint16_t *x16, long rows, int d)
{
    if (x16 && d % 16 == 0) return reinterpret_cast<const __nv_bfloat16 *>(x16);
    if (x16) tc_to_bf16(cx, y, reinterpret_cast<const __nv_bfloat16 *>(x16), rows, d);
    else tc_to_bf16(cx, y, x, rows, d);
    return y;
}

#define TW_SMEM_EXTRA (1024 + 64)   // the tiles' 1024-byte alignment, then the mbarriers

// The map of x (b, t, heads, d16) bf16 for tw_tma: boxes of 64 head dims x one head x TW_ROWS
// rows, rows past t (dimension 2) read as zeros.
static void tw_map(CUtensorMap *map, const __nv_bfloat16 *x, int b, int t, int heads, int d16)
{
    const uint64_t row = (uint64_t)d16 * sizeof(__nv_bfloat16);
    const uint64_t dims[4] = {(uint64_t)d16, (uint64_t)heads, (uint64_t)t, (uint64_t)b};
    const uint64_t pitch[3] = {row, row * heads, row * heads * t};
    const uint32_t box[4] = {64, 1, TW_ROWS, 1};
    lb_cuda_tma_map(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, x, 4, dims, pitch, box);
}

// The forward with q as the kernels read it (TQ float, or bf16 where q16 is given).
template <int NK, typename TQ>
static void fwd_nkq(lb_cuda_ctx *cx, float *out, __nv_bfloat16 *out16, float *lse, const TQ *q,
                    const __nv_bfloat16 *kb, const __nv_bfloat16 *vb, int b, int t, int hq,
                    int hkv, int d)
{
    if constexpr (NK == 4 || NK == 8) if (cx->attn_wg) {   // wgmma (sm_90a)
        const size_t smem = 4 * (size_t)TW_ROWS * 32 * NK + TW_SMEM_EXTRA;
        lb_cuda_smem_limit(tw_fwd_kernel<NK, TQ>, smem);
        CUtensorMap tk, tv;
        tw_map(&tk, kb, b, t, hkv, 16 * NK);
        tw_map(&tv, vb, b, t, hkv, 16 * NK);
        dim3 grid(hq, b, (t + TW_ROWS - 1) / TW_ROWS);
        tw_fwd_kernel<NK, TQ><<<grid, 128, smem, cx->stream>>>(out, out16, lse, q, tk, tv, t,
                                                                hq, hkv, d, tc_c(d));
        LB_CUDA_LAUNCHED(cx);
        return;
    }
    const size_t smem = (size_t)(TC_FWD_ROWS + 4 * TC_KC) * (16 * NK + 8) * sizeof(__nv_bfloat16);
    lb_cuda_smem_limit(tc_fwd_kernel<NK, TQ>, smem);
    dim3 grid(hq, b, (t + TC_FWD_ROWS - 1) / TC_FWD_ROWS);
    tc_fwd_kernel<NK, TQ><<<grid, TC_FWD_WARPS * 32, smem, cx->stream>>>(
        out, out16, lse, q, kb, vb, t, hq, hkv, d, tc_c(d));
    LB_CUDA_LAUNCHED(cx);
}

template <int NK>
static void fwd_nk(lb_cuda_ctx *cx, float *out, uint16_t *out16, float *lse, const float *q,
                   const uint16_t *q16, const float *k, const uint16_t *k16, const float *v,
                   const uint16_t *v16, int b, int t, int hq, int hkv, int d)
{
    const long krows = (long)b * t * hkv;
    const size_t kbytes = tc_align((size_t)krows * 16 * NK * sizeof(__nv_bfloat16));
    char *w = (char *)lb_cuda_scratch(cx, 2 * kbytes);
    const __nv_bfloat16 *kb = tc_rows16(cx, (__nv_bfloat16 *)w, k, k16, krows, d);
    const __nv_bfloat16 *vb = tc_rows16(cx, (__nv_bfloat16 *)(w + kbytes), v, v16, krows, d);
    __nv_bfloat16 *o16 = reinterpret_cast<__nv_bfloat16 *>(out16);
    if (q16)
        fwd_nkq<NK>(cx, out, o16, lse, reinterpret_cast<const __nv_bfloat16 *>(q16), kb, vb, b, t,
                    hq, hkv, d);
    else
        fwd_nkq<NK>(cx, out, o16, lse, q, kb, vb, b, t, hq, hkv, d);
}

// The dS tiles of the causal triangle, bf16 (tw_ds_tile).
static size_t tw_ds_bytes(int b, int t, int hq)
{
    const size_t T = (t + TW_ROWS - 1) / TW_ROWS;
    return (size_t)b * hq * (T * (T + 1) / 2) * TW_ROWS * TW_ROWS * sizeof(__nv_bfloat16);
}

// The most scratch the dS tiles may take: they grow with t^2 (2.2 GB at b 4, t 4096, 32 heads;
// 34 GB for one sequence of 32768), so longer sequences take the dq kernel that recomputes S
// and dP instead, whose results are the same bits.
#define TW_DS_MAX ((size_t)4 << 30)

// Whether the backward takes dq from stored dS tiles (the wgmma kernels, head dims 64 and 128).
static bool tw_ds_on(const lb_cuda_ctx *cx, int b, int t, int hq, int d)
{
    const int nk = (d + 15) / 16;
    return cx->attn_wg && cx->attn_ds && (nk == 4 || nk == 8) &&
           tw_ds_bytes(b, t, hq) <= TW_DS_MAX;
}

// The backward's work memory for b batch elements at once: bf16 copies of q, dout, k and v,
// and the dS tiles where it stores them.
static size_t tc_bwd_work(const lb_cuda_ctx *cx, int b, int t, int hq, int hkv, int d)
{
    const size_t d16 = (size_t)(d + 15) / 16 * 16, e = sizeof(__nv_bfloat16);
    return 2 * tc_align((size_t)b * t * hq * d16 * e) + 2 * tc_align((size_t)b * t * hkv * d16 * e) +
           (tw_ds_on(cx, b, t, hq, d) ? tw_ds_bytes(b, t, hq) : 0);
}

// The batch elements one launch of the backward takes: the most whose work fits
// cx->attn_chunk (at least one; all where it is 0). The dS tiles grow with t^2, so a whole
// batch's would be the step's largest scratch (2.2 GB at b 4, t 4096, 32 heads); the (batch,
// head) blocks are independent, so chunks give the same bits.
static int tc_bwd_chunk(const lb_cuda_ctx *cx, int b, int t, int hq, int hkv, int d)
{
    int bc = b;
    while (cx->attn_chunk && bc > 1 && tc_bwd_work(cx, bc, t, hq, hkv, d) > cx->attn_chunk) bc--;
    return bc;
}

extern "C" size_t lb_cuda_attention_tc_work(const lb_cuda_ctx *cx, int b, int t, int hq, int hkv,
                                            int d)
{
    return tc_bwd_work(cx, tc_bwd_chunk(cx, b, t, hq, hkv, d), t, hq, hkv, d);
}

// The backward with q as the dq kernels read it (TQ float, or bf16 where q16 is given), and
// q, dout, k, v as bf16 rows of 16 NK (qb, gb, kb, vb); the dS tiles after the copies in work.
template <int NK, typename TQ>
static void bwd_nkq(lb_cuda_ctx *cx, float *dq, float *dk, float *dv, const float *dout,
                    const TQ *q, const __nv_bfloat16 *qb, const __nv_bfloat16 *gb,
                    const __nv_bfloat16 *kb, const __nv_bfloat16 *vb, const float *lse,
                    const float *D, void *work, int b, int t, int hq, int hkv, int d)
{
    const float c = tc_c(d), scale = (float)(1.0 / sqrt((double)d));
    const long qrows = (long)b * t * hq, krows = (long)b * t * hkv;
    const size_t e = 16 * NK * sizeof(__nv_bfloat16);
    const size_t qbytes = tc_align((size_t)qrows * e), kbytes = tc_align((size_t)krows * e);
    char *w = (char *)work;
    if constexpr (NK == 4 || NK == 8) if (cx->attn_wg) {   // wgmma (sm_90a)
        const size_t tile = (size_t)TW_ROWS * 32 * NK;
        CUtensorMap tq, tg, tk, tv;
        tw_map(&tq, qb, b, t, hq, 16 * NK);
        tw_map(&tg, gb, b, t, hq, 16 * NK);
        tw_map(&tk, kb, b, t, hkv, 16 * NK);
        tw_map(&tv, vb, b, t, hkv, 16 * NK);
        const size_t smem_kv = 6 * tile + 4 * TC_KC * sizeof(float) + TW_SMEM_EXTRA;
        lb_cuda_smem_limit(tw_bwd_dkdv_kernel<NK>, smem_kv);
        dim3 gk(hkv, b, (t + TC_KC - 1) / TC_KC), gq(hq, b, (t + TW_ROWS - 1) / TW_ROWS);
        if (tw_ds_on(cx, b, t, hq, d)) {   // dk, dv and the dS tiles, then dq from them
            __nv_bfloat16 *ds = (__nv_bfloat16 *)(w + 2 * qbytes + 2 * kbytes);
            tw_bwd_dkdv_kernel<NK><<<gk, 128, smem_kv, cx->stream>>>(
                dk, dv, ds, tq, tg, tk, tv, lse, D, t, hq, hkv, d, c, scale);
            LB_CUDA_LAUNCHED(cx);
            const size_t smem_ds = 3 * (tile + TW_ROWS * TW_ROWS * 2) + TW_SMEM_EXTRA;
            lb_cuda_smem_limit(tw_bwd_dq_ds_kernel<NK>, smem_ds);
            tw_bwd_dq_ds_kernel<NK><<<gq, 128, smem_ds, cx->stream>>>(dq, ds, tk, t, hq, hkv, d,
                                                                      scale);
            LB_CUDA_LAUNCHED(cx);
            return;
        }
        const size_t smem_dq = 6 * tile + TW_SMEM_EXTRA;
        lb_cuda_smem_limit(tw_bwd_dq_kernel<NK, TQ>, smem_dq);
        tw_bwd_dq_kernel<NK, TQ><<<gq, 128, smem_dq, cx->stream>>>(dq, dout, q, tk, tv, lse, D, t,
                                                                    hq, hkv, d, c, scale);
        LB_CUDA_LAUNCHED(cx);
        tw_bwd_dkdv_kernel<NK><<<gk, 128, smem_kv, cx->stream>>>(
            dk, dv, nullptr, tq, tg, tk, tv, lse, D, t, hq, hkv, d, c, scale);
        LB_CUDA_LAUNCHED(cx);
        return;
    }
    constexpr int DP = 16 * NK + 8;
    const size_t smem_dq = (size_t)4 * TC_KC * DP * sizeof(__nv_bfloat16);
    lb_cuda_smem_limit(tc_bwd_dq_kernel<NK, TQ>, smem_dq);
    dim3 gq(hq, b, (t + TC_BWD_WARPS * 16 - 1) / (TC_BWD_WARPS * 16));
    tc_bwd_dq_kernel<NK, TQ><<<gq, TC_BWD_WARPS * 32, smem_dq, cx->stream>>>(
        dq, dout, q, kb, vb, lse, D, t, hq, hkv, d, c, scale);
    LB_CUDA_LAUNCHED(cx);
    const size_t smem_kv =
        (size_t)6 * TC_KC * DP * sizeof(__nv_bfloat16) + 4 * TC_KC * sizeof(float);
    lb_cuda_smem_limit(tc_bwd_dkdv_kernel<NK>, smem_kv);
    dim3 gk(hkv, b, (t + TC_KC - 1) / TC_KC);
    tc_bwd_dkdv_kernel<NK><<<gk, TC_BWD_WARPS * 32, smem_kv, cx->stream>>>(
        dk, dv, qb, gb, kb, vb, lse, D, t, hq, hkv, d, c, scale);
    LB_CUDA_LAUNCHED(cx);
}

template <int NK>
static void bwd_nk(lb_cuda_ctx *cx, float *dq, float *dk, float *dv, const float *dout,
                   const float *q, const uint16_t *q16, const float *k, const uint16_t *k16,
                   const float *v, const uint16_t *v16, const float *lse, const float *D,
                   void *work, int b, int t, int hq, int hkv, int d)
{
    const long qrows = (long)b * t * hq, krows = (long)b * t * hkv;
    const size_t e = 16 * NK * sizeof(__nv_bfloat16);
    const size_t qbytes = tc_align((size_t)qrows * e), kbytes = tc_align((size_t)krows * e);
    char *w = (char *)work;
    __nv_bfloat16 *gb = (__nv_bfloat16 *)(w + qbytes);
    const __nv_bfloat16 *qb = tc_rows16(cx, (__nv_bfloat16 *)w, q, q16, qrows, d);
    tc_to_bf16(cx, gb, dout, qrows, d);
    const __nv_bfloat16 *kb = tc_rows16(cx, (__nv_bfloat16 *)(w + 2 * qbytes), k, k16, krows, d);
    const __nv_bfloat16 *vb =
        tc_rows16(cx, (__nv_bfloat16 *)(w + 2 * qbytes + kbytes), v, v16, krows, d);
    if (q16)
        bwd_nkq<NK>(cx, dq, dk, dv, dout, reinterpret_cast<const __nv_bfloat16 *>(q16), qb, gb,
                    kb, vb, lse, D, work, b, t, hq, hkv, d);
    else
        bwd_nkq<NK>(cx, dq, dk, dv, dout, q, qb, gb, kb, vb, lse, D, work, b, t, hq, hkv, d);
}

template <int NK>
static void cached_nk(lb_cuda_ctx *cx, float *out, const float *q, const lb_kv_layer *c,
                      const int32_t *slot, const int32_t *pos, int n, int hq)
{
    const int parts = (hq / c->hkv + 15) / 16;
    if (c->bf16) {
        if (parts > 4) lb_die("attention_cached: %d query heads per kv head; at most 64", hq / c->hkv);
        constexpr int DP = 16 * NK + 8;
        const size_t smem = (size_t)4 * TC_KC * DP * sizeof(__nv_bfloat16);
        constexpr int W = NK % 4 == 0 ? 4 : NK % 2 == 0 ? 2 : 1;   // tcw_chunk's splits
        if (W > 1 && parts == 1 && cx->attn_split) {
            const size_t sw = smem + sizeof(tcw_xch<NK, W>);
            lb_cuda_smem_limit(tc_cached16w_kernel<NK, W>, sw);
            tc_cached16w_kernel<NK, W><<<(unsigned)n * c->hkv, 32 * W, sw, cx->stream>>>(
                out, q, *c, slot, pos, hq, tc_c(c->d), cx->err_dev);
            LB_CUDA_LAUNCHED(cx);
            return;
        }
        lb_cuda_smem_limit(tc_cached16_kernel<NK>, smem);
        tc_cached16_kernel<NK><<<(unsigned)n * c->hkv, 32 * parts, smem, cx->stream>>>(
            out, q, *c, slot, pos, hq, tc_c(c->d), cx->err_dev);
        LB_CUDA_LAUNCHED(cx);
        return;
    }
    const long warps = (long)n * c->hkv * parts;
    tc_cached_kernel<NK><<<(unsigned)((warps + 3) / 4), 128, 0, cx->stream>>>(
        out, q, *c, slot, pos, n, hq, tc_c(c->d), cx->err_dev);
    LB_CUDA_LAUNCHED(cx);
}

// d <= 128 (ops_attention.cu checks): NK = ceil(d / 16) k-steps.
#define TC_DISPATCH(d, CALL)                                                                   \
    switch ((d + 15) / 16) {                                                                   \
    case 1: CALL(1); break;                                                                    \
    case 2: CALL(2); break;                                                                    \
    case 3: CALL(3); break;                                                                    \
    case 4: CALL(4); break;                                                                    \
    case 5: CALL(5); break;                                                                    \
    case 6: CALL(6); break;                                                                    \
    case 7: CALL(7); break;                                                                    \
    default: CALL(8); break;                                                                   \
    }

extern "C" void lb_cuda_attention_tc_fwd(lb_cuda_ctx *cx, float *out, uint16_t *out16,
                                         float *lse, const float *q, const uint16_t *q16,
                                         const float *k, const uint16_t *k16, const float *v,
                                         const uint16_t *v16, int b, int t, int hq, int hkv, int d)
{
#define CALL(NK) fwd_nk<NK>(cx, out, out16, lse, q, q16, k, k16, v, v16, b, t, hq, hkv, d)
    TC_DISPATCH(d, CALL)
#undef CALL
}

extern "C" void lb_cuda_attention_tc_bwd(lb_cuda_ctx *cx, float *dq, float *dk, float *dv,
                                         const float *dout, const float *q,
                                         const uint16_t *q16, const float *k,
                                         const uint16_t *k16, const float *v,
                                         const uint16_t *v16, const float *lse, const float *D,
                                         void *work, int b, int t, int hq, int hkv, int d)
{
    const int bc = tc_bwd_chunk(cx, b, t, hq, hkv, d);
    for (int b0 = 0; b0 < b; b0 += bc) {   // q-shaped (b, t, hq, d), k-shaped, lse (b, hq, t)
        const int nb = b - b0 < bc ? b - b0 : bc;
        const size_t qo = (size_t)b0 * t * hq * d, ko = (size_t)b0 * t * hkv * d,
                     lo = (size_t)b0 * hq * t;
#define CALL(NK)                                                                               \
    bwd_nk<NK>(cx, dq + qo, dk + ko, dv + ko, dout + qo, q ? q + qo : q, q16 ? q16 + qo : q16, \
               k ? k + ko : k, k16 ? k16 + ko : k16, v ? v + ko : v, v16 ? v16 + ko : v16,      \
               lse + lo, D + lo, work, nb, t, hq, hkv, d)
        TC_DISPATCH(d, CALL)
#undef CALL
    }
}

extern "C" void lb_cuda_attention_tc_cached(lb_cuda_ctx *cx, float *out, const float *q,
                                            const lb_kv_layer *c, const int32_t *slot,
                                            const int32_t *pos, int n, int hq)
{
#define CALL(NK) cached_nk<NK>(cx, out, q, c, slot, pos, n, hq)
    TC_DISPATCH(c->d, CALL)
#undef CALL
}
