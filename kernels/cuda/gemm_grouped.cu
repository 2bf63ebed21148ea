// gemm_grouped.cu: the groups of a grouped GEMM (an MoE layer's local experts; a dense GEMM is
// a group of one) in one launch (bf16: one per 32 groups), on Hopper's warpgroup tensor-core
// instruction (wgmma, sm_90a): bf16 (gemm_grouped, after a packing launch) and, further down,
// fp8-block (gemm_q_grouped, on the quantized bytes as they are).
//
// cuBLASLt 13.0 has no grouped mode, and one call per expert leaves most of the chip idle: an
// expert's (1024, 1536) output is 48 tiles of 128 x 256 on 132 multiprocessors. Here the tiles
// of all the groups form one grid, so 128 experts fill the chip as one large GEMM does.
//
// Two steps, both queued on the backend's stream:
// 1. pack: every operand becomes a bf16 copy as it is laid out, each row padded with zeros to
//    a multiple of 8 elements (16 bytes), one copy per source that several groups read alike
//    (a dgrad's dy and the wgrad's, which linear.c passes side by side); the transposed
//    operands of the dgrad and wgrad passes are read MN-major by the GEMM (gt_grouped_mn).
//    The conversion rounds to nearest even, which is the rounding lb_gemm_args.bf16 asks for.
// 2. gemm (gt_kernel): 128 x BN tiles of the groups' C (BN 256, or 128 when some n is at most
//    128; a binary search over the groups' first tiles finds a tile's group), taken in turn by
//    one persistent block per multiprocessor, in bands of 16 tile rows (gg_tile).
//    Two math warpgroups, each 64 rows x BN columns of the tile, fp32 accumulators in
//    registers, and a producer: one thread of a third warpgroup loads 64-wide slices of k with
//    TMA (the tensor memory accelerator copies a whole box, zero-fills what lies beyond the
//    operand and writes the 128-byte swizzle the wgmma descriptors name) into a ring of 4
//    (BN 256) or 6 stages. Each stage has two barriers in shared memory: full (the copies'
//    bytes have landed) and empty (both math warpgroups are done with it), so a warpgroup only
//    ever waits for its data; one wgmma batch stays in flight while the next is issued, and
//    the producer fills the next tile's first stages while the math warps store this one.
//    TMA needs a tensor map per operand (cuTensorMapEncodeTiled, on the host); they travel in
//    the kernel parameters, which bounds a launch to GT_MAX groups.
//
// Exactness and determinism: bf16 x bf16 products are exact in fp32, and every element of C
// is the sum over k in one fixed order (slices of 64 in k order, each the tensor core's k16
// steps in order), whatever the group's size, its position in the launch or the other groups.
// So the result is bitwise reproducible and batch invariant (one row alone gives the same bits
// as the same row among many), as the deterministic mode asks; it is not the bits of
// cuBLASLt's GEMM, which sums in its own order (the tests compare each against the CPU). The
// one exception to the single order: a wgrad of few tiles is summed in slices of k, then the
// slices in order (gt_split), an order fixed by its shape, so still reproducible.
//
// A group with a bf16 output (lb_gemm_args.c16, beta 0) has its C stored as bf16: alpha d is
// rounded to fp32 once as for fp32 C, then to bf16 (nearest even) where it is stored (by TMA
// in 64 x 64 bf16 chunks, or gg_store16), so c16 is to_bf16 of the fp32 C bit for bit.
//
// What limits the bf16 kernel (0.6x of cuBLASLt's dense rate before the persistent blocks and
// the bands, doc/benchmarks.md): every block loads its own A and B slices through L2 (no TMA
// multicast across a cluster), the math warps stop multiplying while they store a tile unless
// the launch takes the TMA-store epilogue (beta 0: gt_store_tma), and the pack converts fp32
// operands on every call unless the caller gives their bf16 copies (lb_gemm_args.a16, .b16:
// the weight caches', the expert ops').
//
// The wgmma code exists only in the sm_90a build; lb_cuda_gemm_grouped_tc_ok says whether the
// device runs it (compute capability 9.0), and gemm.cu takes its per-group path otherwise.
#include "kernels/cuda/cuda.cuh"

#include <cuda.h>           // CUtensorMap
#include <cudaTypedefs.h>   // the driver's cuTensorMapEncodeTiled, reached through the runtime
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "kernels/quant/quant.h"
}

#define GG_BM 128          // tile rows: two warpgroups of 64
#define GG_BK 64           // 64 bf16 = 128 bytes, one row of the 128-byte swizzle atom
#define GG_TILE_A (GG_BM * GG_BK * 2)                  // A's slice of a stage: 16 KB
#define GG_PACK_MAX 64     // operands per pack launch: two per group

// --- the GEMM ----------------------------------------------------------------------------------

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// A warpgroup's 64 x 128 fp32 wgmma fragment: 64 registers per thread, written in the asm as
// %0 .. %63 and bound as read-write operands.
#define GG_D64_ASM                                                                             \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "     \
    "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "      \
    "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "      \
    "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define GG_D4(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define GG_D16(d, i) GG_D4(d, i), GG_D4(d, i + 4), GG_D4(d, i + 8), GG_D4(d, i + 12)
#define GG_D64(d) GG_D16(d, 0), GG_D16(d, 16), GG_D16(d, 32), GG_D16(d, 48)

// Shared-memory matrix descriptor of a k-contiguous bf16 tile in the 128-byte swizzle: start
// address, stride 1024 bytes between groups of 8 rows (the leading offset is unused there).
__device__ __forceinline__ uint64_t gg_desc(uint32_t addr)
{
    return (uint64_t)((addr & 0x3FFFF) >> 4) | (uint64_t)1 << 16 | (uint64_t)(1024 >> 4) << 32 |
           (uint64_t)1 << 62;
}

// The same for an MN-major tile (gt_kernel's GT_A_MN / GT_B_MN operands): 64-element rows of
// m or n (128 bytes), one row per k, swizzled alike; 8-row groups (of k) 1024 bytes apart, and
// the 64-wide blocks of m or n (one TMA box each: 64 rows of k) 8 KB apart.
__device__ __forceinline__ uint64_t gg_desc_mn(uint32_t addr)
{
    return (uint64_t)((addr & 0x3FFFF) >> 4) | (uint64_t)(8192 >> 4) << 16 |
           (uint64_t)(1024 >> 4) << 32 | (uint64_t)1 << 62;
}

// d (64 x 128, this warpgroup's fp32 fragment) += A (64 x 16) B (128 x 16)^T; MN's bits say
// which operand's tile is MN-major (the instruction's transpose flags).
template <int MN>
__device__ __forceinline__ void gg_wgmma(float *d, uint64_t da, uint64_t db)
{
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"   // scale-d true: d += (not d =)
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        GG_D64_ASM ", %64, %65, p, 1, 1, %66, %67;\n}\n"
        : GG_D64(d)
        : "l"(da), "l"(db), "n"(MN & 1), "n"(MN >> 1));
}
#endif

// Launch tile t's group (found among the groups' first tiles), and the origin (m0, n0) of its
// tile within the group (GG_BM x bn tiles). Tiles go in bands of GG_BAND
// tile rows, column by column within a band: the blocks resident at one time then share a
// few A row blocks and a few B column blocks, which stay in L2, where row-major order would
// stream a whole tile row's B (the LM head's 151936 x 2048 weight: 0.6 GB per tile row) from
// memory for every tile row. The order of the tiles changes no sum.
#define GG_BAND 16
template <typename Group>
__device__ __forceinline__ const Group &gg_tile(const Group *g, int count, int t, int bn, int *m0,
                                                int *n0, int bm = GG_BM)
{
    const Group &G = lb_group_of(g, count, t);
    const int u = t - G.tile0, tiles_n = G.tiles_n;
    const int tiles_m = (G.m + bm - 1) / bm, band = u / (GG_BAND * tiles_n);
    const int h = min(GG_BAND, tiles_m - band * GG_BAND), v = u - band * GG_BAND * tiles_n;
    *m0 = (band * GG_BAND + v % h) * bm;
    *n0 = v / h * bn;
    return G;
}

// C = alpha d + beta C for a warpgroup's 64 x 128 fragment d: this thread's d[4j + i] is row
// r + (i >> 1) * 8, column col0 + 8j + 2 (lane % 4) + (i & 1). A pair of columns is one 8-byte
// store where C's rows allow it (a warp then writes whole 32-byte sectors). beta 0 never reads
// C (NaN there is overwritten). Otherwise C is read CH column groups at a time, all loads
// before any store: a store may alias a later load as far as the compiler knows, so a load
// after it waits a full memory round trip (an accumulating wgrad's epilogue took 32 of them
// per tile). CH trades those round trips for registers (16: one).
// S2: NVFP4's second levels s2a of A (per row of C when s2a_row, else one) and s2b of B (per
// column when s2b_row), applied as gemm_q.cu's epilogue does: alpha (s2a s2b d) + beta c. A
// template parameter, so that the other kernels carry none of it (in registers either).
template <int CH, int S2 = 0>
__device__ __forceinline__ void gg_store(const float (&d)[64], float *c, int m, int n,
                                         float alpha, float beta, int r, int col0, int lane,
                                         const float *s2a = NULL, int s2a_row = 0,
                                         const float *s2b = NULL, int s2b_row = 0)
{
    const bool pair = (n & 1) == 0 && ((uintptr_t)c & 7) == 0;
#pragma unroll
    for (int j0 = 0; j0 < 16; j0 += CH) {
        float2 old[CH][2];
#pragma unroll
        for (int jj = 0; jj < CH; jj++)
#pragma unroll
            for (int half = 0; half < 2; half++) {
                const int col = col0 + (j0 + jj) * 8 + (lane & 3) * 2, row = r + half * 8;
                old[jj][half] = make_float2(0.0f, 0.0f);
                if (beta == 0.0f || col >= n || row >= m) continue;
                const float *p = c + (size_t)row * n + col;
                if (pair) old[jj][half] = *(const float2 *)p;
                else old[jj][half] = make_float2(p[0], col + 1 < n ? p[1] : 0.0f);
            }
#pragma unroll
        for (int jj = 0; jj < CH; jj++) {
            const int j = j0 + jj, col = col0 + j * 8 + (lane & 3) * 2;
            if (col >= n) continue;
#pragma unroll
            for (int half = 0; half < 2; half++) {
                const int row = r + half * 8;
                if (row >= m) continue;
                float *p = c + (size_t)row * n + col;
                float v0 = alpha * d[4 * j + 2 * half], v1 = alpha * d[4 * j + 2 * half + 1];
                if (S2) {
                    const float sa = s2a[s2a_row ? row : 0];
                    const float s0 = __fmul_rn(sa, s2b[s2b_row ? col : 0]);
                    const float s1 = __fmul_rn(sa, s2b[s2b_row && col + 1 < n ? col + 1 : 0]);
                    v0 = __fmul_rn(alpha, __fmul_rn(s0, d[4 * j + 2 * half]));
                    v1 = __fmul_rn(alpha, __fmul_rn(s1, d[4 * j + 2 * half + 1]));
                    if (beta != 0.0f) {
                        v0 = __fadd_rn(v0, __fmul_rn(beta, old[jj][half].x));
                        v1 = __fadd_rn(v1, __fmul_rn(beta, old[jj][half].y));
                    }
                } else if (beta != 0.0f) {
                    v0 = v0 + beta * old[jj][half].x;
                    v1 = v1 + beta * old[jj][half].y;
                }
                if (pair) {   // col is even, so col + 1 < n
                    *(float2 *)p = make_float2(v0, v1);
                } else {
                    p[0] = v0;
                    if (col + 1 < n) p[1] = v1;
                }
            }
        }
    }
}

// gg_store's beta-0 values (alpha d, rounded once) rounded to bf16, nearest even, into c16
// (m, pad8(n)) (lb_gemm_args.c16; 4-byte aligned): a column pair is one 4-byte store (col is
// even and the pitch a multiple of 8), an odd n's last column a 2-byte one; the pad columns
// are not written. Apart from gg_store, whose code the other kernels keep as it is.
__device__ __forceinline__ void gg_store16(const float (&d)[64], __nv_bfloat16 *c16, int m,
                                           int n, float alpha, int r, int col0, int lane)
{
    const size_t ld = (size_t)((n + 7) & ~7);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        const int col = col0 + j * 8 + (lane & 3) * 2;
        if (col >= n) continue;
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int row = r + half * 8;
            if (row >= m) continue;
            const float v0 = alpha * d[4 * j + 2 * half], v1 = alpha * d[4 * j + 2 * half + 1];
            __nv_bfloat16 *p = c16 + row * ld + col;
            if (col + 1 < n) *(__nv_bfloat162 *)p = __floats2bfloat162_rn(v0, v1);
            else *p = __float2bfloat16_rn(v0);
        }
    }
}

// A block computes whole 128 x BN tiles; a math warpgroup's 64 x BN share is BN / 128 wgmma
// accumulators of 64 x 128 (the same k16 steps in the same order for every element whatever
// BN is). Decode-shaped launches (gt_shape: fewer tiles than two rounds of the chip) take
// 64 x BN tiles and one math warpgroup (BM 64): the same instructions on the same k16 steps, so
// the same bits, with half the tensor-core work on rows that are mostly zero fill (about 16
// tokens an expert at 256 decode rows) and, for a dense GEMM of a few hundred rows, twice the
// tiles to spread over the multiprocessors.
#define GT_MAX 32
#define GT_THREADS 384
#define GT_THREADS_BM(BM) ((BM) == 64 ? 256 : 384)
#define GT_STAGES(BN) ((BN) == 256 ? 4 : 6)
#define GT_STAGE(BN) (GG_TILE_A + (BN) * GG_BK * 2)
#define GT_CHUNK 8192   // TS epilogue: 64 rows x 32 fp32 columns of C, two per math warpgroup
#define GT_SMEM(BN, TS) \
    (GT_STAGES(BN) * GT_STAGE(BN) + ((TS) ? 4 * GT_CHUNK : 0) + 1024 + 16 * GT_STAGES(BN))

// Operand layouts of a launch (gt_kernel's MN): by default A (m, k) and B (n, k), k contiguous;
// GT_A_MN: A stored (k, m), GT_B_MN: B stored (k, n), m or n contiguous (MN-major: the
// transposed operands of a dgrad or wgrad read as they are, no transposed copy).
#define GT_A_MN 1
#define GT_B_MN 2

typedef struct {
    CUtensorMap ta, tb;   // A, B bf16: k-major boxes 64 (k) x 128 and 64 x BN, or MN-major
                          // boxes 64 (m or n) x 64 (k)
    CUtensorMap tc;       // TS launches: C (m, n) fp32, boxes 32 x 64, or c16's (m, n) bf16
                          // of pitch pad8(n), boxes 64 x 64 (gt_store_tma)
    float *c;
    __nv_bfloat16 *c16;   // NULL, or (beta 0) where C goes instead, rounded to bf16
    const float *s2a, *s2b;   // NVFP4's second levels (gg_store), or NULL
    int s2a_row, s2b_row;
    int m, n, k;
    int tile0, tiles_n;
    float alpha, beta;
} gt_group;

typedef struct {
    int count, tiles;
    gt_group g[GT_MAX];
} gt_params;
// A kernel's parameters may take 32764 bytes (sm_70 and later, CUDA 12.1 and later); a group
// takes 512 (three 128-byte aligned tensor maps), so 64 groups do not fit.
static_assert(sizeof(gt_group) == 512, "gt_group is no longer 512 bytes");
static_assert(sizeof(gt_params) <= 32764, "gt_params exceeds the kernel parameter space");

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The box of map at (x0, y0) into dst (x the contiguous dimension: k of a k-major operand, m
// or n of an MN-major one); completes bytes on bar.
__device__ __forceinline__ void gt_load(uint32_t dst, const CUtensorMap *map, int x0, int y0,
                                        uint32_t bar)
{
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
        "l"((uint64_t)map), "r"(x0), "r"(y0), "r"(bar)
        : "memory");
}
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The TS epilogue (beta 0): a math warpgroup's 64 x (128 NH) share of the tile, times alpha,
// goes out through shared memory by TMA, 64 x 32 columns at a time, in turn through the
// warpgroup's NB chunk buffers at stg. The copies run on while the warpgroup starts its next
// tile: it waits only until the store that last used a buffer has read it (at most NB - 1 in
// flight besides). The rows and columns of a box beyond C are not written. The chunk is laid
// out in the 128-byte swizzle the map names (16-byte unit u of row r at u ^ (r % 8)), so the
// fragment's stores spread over the banks; the values are gg_store's (alpha d, rounded once).
// C16: a bf16 C (gt_group.c16), 64 x 64 columns a chunk (the same 8 KB); a column pair is
// 4 bytes, the pair of alpha d rounded to bf16 (nearest even; the lower column in the low
// half), so the values are to_bf16's of the fp32 chunk's.
template <int NH, int NB, int C16 = 0>
__device__ __forceinline__ void gt_store_tma(const float (&d)[NH][64], const CUtensorMap *map,
                                             float alpha, int m0, int n0, uint32_t stg, int cw,
                                             int warp, int lane, int lead)
{
    constexpr int W = C16 ? 64 : 32;          // columns of a chunk
    const int r0 = warp * 16 + (lane >> 2);   // this thread's first row of the 64
#pragma unroll
    for (int q = 0; q < NH * 128 / W; q++) {   // chunk q: columns W q .. W q + W - 1 of the share
        const uint32_t buf = stg + (q % NB) * GT_CHUNK;
        if (lead) asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(NB - 1) : "memory");
        asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
        if (C16) {
            // the fragment's 8-column block j = (q & 1) * 8 + jj of accumulator q >> 1: this
            // thread's pair is 4 bytes at 16-byte unit jj of its row, 4 (lane & 3) into it
#pragma unroll
            for (int jj = 0; jj < 8; jj++)
#pragma unroll
                for (int half = 0; half < 2; half++) {
                    const int row = r0 + 8 * half, i = 4 * ((q & 1) * 8 + jj) + 2 * half;
                    const uint32_t at = buf + row * 128 + (((jj ^ row) & 7) << 4) + 4 * (lane & 3);
                    const __nv_bfloat162 v =
                        __floats2bfloat162_rn(alpha * d[q >> 1][i], alpha * d[q >> 1][i + 1]);
                    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at),
                                 "r"(*reinterpret_cast<const uint32_t *>(&v))
                                 : "memory");
                }
        } else {
#pragma unroll
            for (int jj = 0; jj < 4; jj++)
#pragma unroll
                for (int half = 0; half < 2; half++) {
                    const int row = r0 + 8 * half, col = 8 * jj + 2 * (lane & 3);
                    const int i = 4 * ((q & 3) * 4 + jj) + 2 * half;
                    const uint32_t at =
                        buf + row * 128 + ((((col >> 2) ^ row) & 7) << 4) + (col & 3) * 4;
                    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(at),
                                 "f"(alpha * d[q >> 2][i]), "f"(alpha * d[q >> 2][i + 1])
                                 : "memory");
                }
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
        if (lead) {
            asm volatile(
                "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n"
                ::"l"((uint64_t)map), "r"(n0 + W * q), "r"(m0 + cw * 64), "r"(buf)
                : "memory");
            asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        }
    }
}
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The ring's barriers (one thread): full (the producer's arrival, plus the bytes) and empty
// (one arrival per math warpgroup, consumers of them) for each of the S stages.
__device__ __forceinline__ void gt_bars_init(uint32_t full, uint32_t empty, int S, int consumers)
{
    for (int s = 0; s < S; s++) {
        lb_mbar_init(full + 8 * s, 1);
        lb_mbar_init(empty + 8 * s, consumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Math warpgroup cw's 64 x (128 NH) share of one tile into d: nk slices of 64 k from the ring
// of S stages (STAGE bytes each, from base), slice counter it (over the block's tiles, as the
// producer counts), each stage released to the producer once its products are done.
template <int NH, int MN, int S, int STAGE>
__device__ __forceinline__ void gt_mma_tile(float (&d)[NH][64], uint32_t base, uint32_t full,
                                            uint32_t empty, int cw, int nk, int &it, int lead)
{
#pragma unroll
    for (int h = 0; h < NH; h++)
#pragma unroll
        for (int i = 0; i < 64; i++) d[h][i] = 0.0f;
    for (int kt = 0; kt < nk; kt++, it++) {
        const int s = it % S;
        lb_mbar_wait(full + 8 * s, (it / S) & 1);
        const uint32_t sa = base + s * STAGE + cw * 64 * 128, sb = base + s * STAGE + GG_TILE_A;
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int kk = 0; kk < GG_BK / 16; kk++)
#pragma unroll
            for (int h = 0; h < NH; h++)
                gg_wgmma<MN>(d[h],
                             MN & GT_A_MN ? gg_desc_mn(sa + kk * 2048) : gg_desc(sa + kk * 32),
                             MN & GT_B_MN ? gg_desc_mn(sb + h * 128 * 128 + kk * 2048)
                                          : gg_desc(sb + h * 128 * 128 + kk * 32));
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        // the previous slice's products are done: its stage may be refilled
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
        if (kt > 0 && lead) lb_mbar_arrive(empty + 8 * ((it - 1) % S));
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    if (lead) lb_mbar_arrive(empty + 8 * ((it - 1) % S));   // the tile's last slice
}
#endif

// S2: NVFP4 groups (gg_store), every group of the launch with its second levels. TS: every
// group has beta 0 and a C map (gt_store_tma) instead of gg_store. MN: the operand layouts
// (GT_A_MN, GT_B_MN): an MN-major operand's slice of 64 k arrives as 64-wide boxes of m or n,
// which fill its stage bytes in the same places as the k-major box (the warpgroup's 64 rows
// of A, B's 128-column halves), so only the descriptors and the transpose flags differ.
// C16 (not TS): some group has a bf16 C (gt_group.c16, gg_store16). A template parameter, as
// the branch to it takes 2 registers more in the other kernels' epilogue (165 -> 167 at BN
// 128); the TS kernels branch per group at no cost, so C16 is 0 there.
template <int BN, int S2, int TS, int MN, int C16 = 0, int BM = 128>
__global__ void __launch_bounds__(GT_THREADS_BM(BM), 1)
gt_kernel(const __grid_constant__ gt_params P)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int S = GT_STAGES(BN), NH = BN / 128, STAGE = GT_STAGE(BN);
    constexpr int TX = (BM + BN) * GG_BK * 2;   // a stage's bytes (BM 64: half its A space)
    static_assert(BM == 128 || (BM == 64 && MN == 0), "BM 64 is the k-major launch's");
    extern __shared__ uint8_t gt_smem[];
    const uint32_t base = ((uint32_t)__cvta_generic_to_shared(gt_smem) + 1023) & ~1023u;
    const uint32_t stg = base + S * STAGE;   // TS: the chunk buffers, 1024-aligned
    const uint32_t full = stg + (TS ? 4 * GT_CHUNK : 0), empty = full + 8 * S;   // 8-byte barriers
    const int tid = threadIdx.x, wg = tid >> 7;

    if (tid == 0) gt_bars_init(full, empty, S, BM / 64);
    __syncthreads();

    // Persistent: block b takes tiles b, b + grid, ...; the ring position it counts slices
    // over all of them, so the producer fills the next tile's first stages while the math
    // warpgroups write the current one out.
    if (wg == 0) {   // the producer: one thread
        if (tid == 0) {
            int it = 0;
            for (int t = blockIdx.x; t < P.tiles; t += gridDim.x) {
                int m0, n0;
                const gt_group &G = gg_tile(P.g, P.count, t, BN, &m0, &n0, BM);
                const int nk = (G.k + GG_BK - 1) / GG_BK;
                for (int kt = 0; kt < nk; kt++, it++) {
                    const int s = it % S;
                    // the stage's previous slice (it - S) has been read by both warpgroups
                    if (it >= S) lb_mbar_wait(empty + 8 * s, (it / S - 1) & 1);
                    lb_mbar_expect(full + 8 * s, TX);
                    const uint32_t st = base + s * STAGE, bar = full + 8 * s, k0 = kt * GG_BK;
                    if (MN & GT_A_MN)
                        for (int j = 0; j < GG_BM / 64; j++)
                            gt_load(st + j * 8192, &G.ta, m0 + 64 * j, k0, bar);
                    else
                        gt_load(st, &G.ta, k0, m0, bar);
                    if (MN & GT_B_MN)
                        for (int j = 0; j < BN / 64; j++)
                            gt_load(st + GG_TILE_A + j * 8192, &G.tb, n0 + 64 * j, k0, bar);
                    else
                        gt_load(st + GG_TILE_A, &G.tb, k0, n0, bar);
                }
            }
        }
        return;
    }

    const int cw = wg - 1;   // math warpgroup: rows cw * 64 .. + 63 of the tile
    const int warp = (tid >> 5) & 3, lane = tid & 31, lead = (tid & 127) == 0;
    int it = 0;
    for (int t = blockIdx.x; t < P.tiles; t += gridDim.x) {
        int m0, n0;
        const gt_group &G = gg_tile(P.g, P.count, t, BN, &m0, &n0, BM);
        float d[NH][64];
        gt_mma_tile<NH, MN, S, STAGE>(d, base, full, empty, cw, (G.k + GG_BK - 1) / GG_BK, it,
                                      lead);
        // a bf16 C (G.c16): a branch uniform over the block, taken per group (a launch may
        // mix them); never with NVFP4's second levels (gemm_q_grouped has no c16)
        static_assert(!(TS && C16) && !(S2 && C16), "C16 is the non-TS bf16 kernels'");
        if (TS) {
            if (!S2 && G.c16)
                gt_store_tma<NH, 2, 1>(d, &G.tc, G.alpha, m0, n0, stg + cw * 2 * GT_CHUNK, cw,
                                       warp, lane, lead);
            else
                gt_store_tma<NH, 2>(d, &G.tc, G.alpha, m0, n0, stg + cw * 2 * GT_CHUNK, cw,
                                    warp, lane, lead);
            continue;
        }
        const int r = m0 + cw * 64 + warp * 16 + (lane >> 2);
        if (C16 && G.c16) {
#pragma unroll
            for (int h = 0; h < NH; h++)
                gg_store16(d[h], G.c16, G.m, G.n, G.alpha, r, n0 + h * 128, lane);
            continue;
        }
#pragma unroll
        for (int h = 0; h < NH; h++)
            gg_store<BN == 256 ? 4 : 16, S2>(d[h], G.c, G.m, G.n, G.alpha, G.beta, r,
                                              n0 + h * 128, lane, G.s2a, G.s2a_row, G.s2b,
                                              G.s2b_row);
    }
    // the stores are complete before the block's shared memory goes
    if (TS && lead) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#endif
}

// --- gemm_experts: the groups' sizes on the device ---------------------------------------------
//
// An MoE layer's bf16 fprop (kernels.h gemm_experts) whose rows per expert stay in device
// memory (moe_plan's counts), so the host launches it without waiting for them: the sampler's
// decode step then queues a whole forward without a round trip. One map covers every expert's
// rows of A (the permuted buffer), one the stacked weights (e n rows), and each block derives
// the tiles from the counts itself (gx_plan). A tile's A box may run into the next expert's
// rows and its B box into the next expert's weight: those products land in rows and columns
// the store leaves out (gg_store's and gg_store16's bounds, so no TMA store). The slices, the
// wgmma steps and the store are gt_kernel's, so the bits are gemm_grouped's on those groups.

typedef struct {
    int tile0, tiles_n, m, row0;   // gg_tile's fields, and the expert's first row of A and C
} gx_group;

typedef struct {
    CUtensorMap ta, tb;        // A (rows, k): boxes 64 (k) x BM; B (e n, k): boxes 64 x BN
    float *c;                  // (rows, n), or NULL
    __nv_bfloat16 *c16;        // (rows, pad8(n)), or NULL
    const int *counts;         // (e) device memory
    unsigned long long *err;   // the backend's input-error word
    int e, rows, n, k;
} gx_params;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The launch's tiles from the counts (warp 0; the caller syncs the block): g[j] for each expert,
// *tiles in all. Each lane sums a run of experts, the runs' totals are scanned across the warp,
// then each lane writes its run. Counts passing the rows are clipped there and reported. PP:
// gx_params or gqx_params (the fields e, n, rows, counts, err).
template <int BN, int BM, typename PP>
__device__ __forceinline__ void gx_plan(const PP &P, gx_group *g, int *tiles, int lane)
{
    const int per = (P.e + 31) / 32, j0 = min(P.e, lane * per), j1 = min(P.e, j0 + per);
    const int tn = (P.n + BN - 1) / BN;
    int rows = 0;
    for (int j = j0; j < j1; j++) rows += P.counts[j];
    int r0 = rows;   // the exclusive prefix of the runs' rows
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, r0, o);
        if (lane >= o) r0 += v;
    }
    r0 -= rows;
    int t = 0;   // this run's tiles (with the clipped counts), then their prefix likewise
    for (int j = j0, r = r0; j < j1; j++) {
        const int m = max(0, min(P.counts[j], P.rows - r));
        if (m < P.counts[j]) lb_report(P.err, LB_CERR_EXPERTS_ROWS, j);
        r += P.counts[j];
        t += (m + BM - 1) / BM * tn;
    }
    int t0 = t;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, t0, o);
        if (lane >= o) t0 += v;
    }
    if (lane == 31) *tiles = t0;
    t0 -= t;
    for (int j = j0, r = r0; j < j1; j++) {
        const int m = max(0, min(P.counts[j], P.rows - r));
        g[j] = (gx_group){t0, tn, m, r};
        r += P.counts[j];
        t0 += (m + BM - 1) / BM * tn;
    }
}
#endif

// gt_kernel's k-major launch (no second levels, no TMA store) on gx_params: C16 a bf16 C.
template <int BN, int C16, int BM>
__global__ void __launch_bounds__(GT_THREADS_BM(BM), 1)
gx_kernel(const __grid_constant__ gx_params P)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int S = GT_STAGES(BN), NH = BN / 128, STAGE = GT_STAGE(BN);
    constexpr int TX = (BM + BN) * GG_BK * 2;
    extern __shared__ uint8_t gt_smem[];
    __shared__ gx_group grp[GX_MAX_E];
    __shared__ int ntiles;
    const uint32_t base = ((uint32_t)__cvta_generic_to_shared(gt_smem) + 1023) & ~1023u;
    const uint32_t full = base + S * STAGE, empty = full + 8 * S;
    const int tid = threadIdx.x, wg = tid >> 7;
    if (tid == 0) gt_bars_init(full, empty, S, BM / 64);
    if (tid < 32) gx_plan<BN, BM>(P, grp, &ntiles, tid);
    __syncthreads();
    const int tiles = ntiles, nk = (P.k + GG_BK - 1) / GG_BK;
    if (wg == 0) {   // the producer: one thread
        if (tid == 0) {
            int it = 0;
            for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
                int m0, n0;
                const gx_group &G = gg_tile(grp, P.e, t, BN, &m0, &n0, BM);
                const int e = (int)(&G - grp);
                for (int kt = 0; kt < nk; kt++, it++) {
                    const int s = it % S;
                    if (it >= S) lb_mbar_wait(empty + 8 * s, (it / S - 1) & 1);
                    lb_mbar_expect(full + 8 * s, TX);
                    const uint32_t st = base + s * STAGE, bar = full + 8 * s;
                    gt_load(st, &P.ta, kt * GG_BK, G.row0 + m0, bar);
                    gt_load(st + GG_TILE_A, &P.tb, kt * GG_BK, e * P.n + n0, bar);
                }
            }
        }
        return;
    }
    const int cw = wg - 1;
    const int warp = (tid >> 5) & 3, lane = tid & 31, lead = (tid & 127) == 0;
    int it = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        int m0, n0;
        const gx_group &G = gg_tile(grp, P.e, t, BN, &m0, &n0, BM);
        float d[NH][64];
        gt_mma_tile<NH, 0, S, STAGE>(d, base, full, empty, cw, nk, it, lead);
        const int r = m0 + cw * 64 + warp * 16 + (lane >> 2);
#pragma unroll
        for (int h = 0; h < NH; h++) {
            if (C16)
                gg_store16(d[h], P.c16 + (size_t)G.row0 * ((P.n + 7) & ~7), G.m, P.n, 1.0f, r,
                           n0 + h * 128, lane);
            else
                gg_store<BN == 256 ? 4 : 16>(d[h], P.c + (size_t)G.row0 * P.n, G.m, P.n, 1.0f,
                                             0.0f, r, n0 + h * 128, lane);
        }
    }
#endif
}

// --- packing the operands -------------------------------------------------------------------------

typedef struct {
    const float *src;     // (rows, cols) fp32, rounded to bf16 here
    __nv_bfloat16 *dst;   // (rows, ld)
    int rows, cols, ld;
    // src holds logits and the copy gets cross-entropy's gradient instead (lb_ce_grad with the
    // forward's row statistics; linear_ce_bwd), or NULL
    const double *ce_stats;
    const int32_t *ce_targets;
    float ce_dloss;
} gg_pack_job;

typedef struct {
    int count;
    unsigned long long *err;   // the backend's input-error word (a target >= the vocabulary)
    gg_pack_job j[GG_PACK_MAX];
} gg_pack_params;
static_assert(sizeof(gg_pack_params) <= 32764, "gg_pack_params exceeds the parameter space");

// Four loaded logits of row r, columns c .. c + 3 (those < cols), become cross_entropy_bwd's
// values: 0 for an ignored row (a negative target), NaN and a reported error for a target
// beyond the vocabulary.
__device__ __forceinline__ void gg_ce_grad4(float4 &v, const gg_pack_job &J, int r, int c,
                                            unsigned long long *err)
{
    const int tgt = J.ce_targets[r];
    float x[4] = {v.x, v.y, v.z, v.w};
    if (tgt < 0 || tgt >= J.cols) {
        if (tgt >= J.cols && c == 0) lb_report(err, LB_CERR_CE_BWD_TARGET, tgt);
        const float fill = tgt < 0 ? 0.0f : NAN;
        x[0] = x[1] = x[2] = x[3] = fill;
    } else {
        const float m = (float)J.ce_stats[2 * r];
        const double inv = 1.0 / J.ce_stats[2 * r + 1];
#pragma unroll
        for (int e = 0; e < 4; e++) x[e] = lb_ce_grad(x[e], m, inv, J.ce_dloss, c + e == tgt);
    }
    // columns past the source stay the padding's zeros
    v = make_float4(x[0], c + 1 < J.cols ? x[1] : 0.0f, c + 2 < J.cols ? x[2] : 0.0f,
                    c + 3 < J.cols ? x[3] : 0.0f);
}

// Block (32, 8); blockIdx.y is the job, blockIdx.x strides over its rows. Elements beyond the
// source in a padded row are written as zeros (the GEMM reads whole 16-byte chunks).
__global__ void gg_pack_kernel(const __grid_constant__ gg_pack_params P)
{
    const gg_pack_job &J = P.j[blockIdx.y];
    const int tx = threadIdx.x, ty = threadIdx.y;
    if (J.cols % 4 == 0 && ((uintptr_t)J.src & 15) == 0) {
        // a row per step, four columns per thread and load (ld is a multiple of 8)
        for (int r = blockIdx.x; r < J.rows; r += gridDim.x) {
            const float *s = J.src + (size_t)r * J.cols;
            uint2 *d = (uint2 *)(J.dst + (size_t)r * J.ld);
#pragma unroll 4
            for (int c = 4 * (ty * 32 + tx); c < J.ld; c += 1024) {
                float4 v = c < J.cols ? __ldcs((const float4 *)(s + c))
                                      : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (J.ce_stats && c < J.cols) gg_ce_grad4(v, J, r, c, P.err);
                __nv_bfloat162 o[2] = {__floats2bfloat162_rn(v.x, v.y),
                                       __floats2bfloat162_rn(v.z, v.w)};
                d[c / 4] = *(const uint2 *)o;
            }
        }
        return;
    }
    // a row per step, a pair of columns per thread (ld is even)
    for (int r = blockIdx.x; r < J.rows; r += gridDim.x) {
        const float *s = J.src + (size_t)r * J.cols;
        __nv_bfloat162 *d = (__nv_bfloat162 *)(J.dst + (size_t)r * J.ld);
        for (int c = 2 * (ty * 32 + tx); c < J.ld; c += 512) {
            float4 v = make_float4(c < J.cols ? s[c] : 0.0f, c + 1 < J.cols ? s[c + 1] : 0.0f,
                                   0.0f, 0.0f);
            if (J.ce_stats && c < J.cols) gg_ce_grad4(v, J, r, c, P.err);
            d[c / 2] = __floats2bfloat162_rn(v.x, v.y);
        }
    }
}

// --- host side -----------------------------------------------------------------------------------

static int pad8(int x) { return (x + 7) / 8 * 8; }

static void pack_launch(lb_cuda_ctx *cx, gg_pack_params *pp)
{
    if (!pp->count) return;
    size_t most = 0;   // rows of the largest job
    for (int i = 0; i < pp->count; i++)
        if ((size_t)pp->j[i].rows > most) most = (size_t)pp->j[i].rows;
    size_t cap = (size_t)cx->num_sms * 32 / pp->count + 1;
    dim3 grid((unsigned)(most < cap ? most : cap), (unsigned)pp->count);
    pp->err = cx->err_dev;
    gg_pack_kernel<<<grid, dim3(32, 8), 0, cx->stream>>>(*pp);
    LB_CUDA_LAUNCHED(cx);
    pp->count = 0;
}

extern "C" int lb_cuda_gemm_grouped_tc_ok(int major, int minor) { return major == 9 && minor == 0; }

// The driver's tensor-map encoder, looked up once through the runtime (no -lcuda).
static PFN_cuTensorMapEncodeTiled_v12000 tma_encoder(void)
{
    static PFN_cuTensorMapEncodeTiled_v12000 fn;
    if (!fn) {
        void *p = NULL;
        cudaDriverEntryPointQueryResult q;
        LB_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000,
                                                       cudaEnableDefault, &q));
        if (q != cudaDriverEntryPointSuccess || !p)
            lb_die("cuda: the driver has no cuTensorMapEncodeTiled");
        fn = (PFN_cuTensorMapEncodeTiled_v12000)p;
    }
    return fn;
}

static void tma_encode(CUtensorMap *map, CUtensorMapDataType dt, const void *x, int rank,
                       const uint64_t *dims, const uint64_t *pitch, const uint32_t *box,
                       CUtensorMapSwizzle swizzle)
{
    const cuuint32_t step[5] = {1, 1, 1, 1, 1};
    CUresult r = tma_encoder()(map, dt, (cuuint32_t)rank, (void *)x, (const cuuint64_t *)dims,
                               (const cuuint64_t *)pitch, (const cuuint32_t *)box, step,
                               CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                               CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
        lb_die("cuda: cuTensorMapEncodeTiled refused a rank %d tensor (%llu x %llu ...), error %d",
               rank, (unsigned long long)dims[0], (unsigned long long)dims[1], (int)r);
}

extern "C" void lb_cuda_tma_map(CUtensorMap *map, CUtensorMapDataType dt, const void *x, int rank,
                                const uint64_t *dims, const uint64_t *pitch, const uint32_t *box)
{
    tma_encode(map, dt, x, rank, dims, pitch, box, CU_TENSOR_MAP_SWIZZLE_128B);
}

// The map of an operand x (rows, k elements of type dt, k contiguous) with row pitch ld
// elements: boxes of box_k x box_rows.
static void tma_map(CUtensorMap *map, CUtensorMapDataType dt, const void *x, int rows, int k,
                    int ld, int box_k, int box_rows)
{
    const size_t esize = dt == CU_TENSOR_MAP_DATA_TYPE_UINT8 ? 1 : 2;
    const uint64_t dim[2] = {(uint64_t)k, (uint64_t)rows}, pitch[1] = {(uint64_t)ld * esize};
    const uint32_t box[2] = {(uint32_t)box_k, (uint32_t)box_rows};
    lb_cuda_tma_map(map, dt, x, 2, dim, pitch, box);
}

// A group's bf16 C (gt_group.c16, gq_group.c16), or NULL.
template <typename G> static const void *group_c16(const G &g) { return g.c16; }

// Whether a launch of these cnt groups (gt_group or gq_group) takes the TS epilogue
// (gt_store_tma): on, and every C written, not added to (beta 0), and addressable by TMA (rows
// 16-byte multiples apart from a 16-byte aligned start). If so, each group's C map: fp32, or
// a c16 group's bf16 (its pitch pad8(n) elements; the dims stop at n). A c16 group needs n a
// multiple of 8 as well: the store writes a row's last 16 bytes whole, so for other n it
// wrote pad columns (seen on the H200: column 101 of n 101), which kernels.h leaves alone.
template <typename G> static int ts_maps(G *g, int cnt, int on)
{
    int ts = on;
    for (int i = 0; i < cnt && ts; i++) {
        const void *c16 = group_c16(g[i]);
        ts = g[i].beta == 0.0f &&
             (c16 ? g[i].n % 8 == 0 && ((uintptr_t)c16 & 15) == 0
                  : g[i].n % 4 == 0 && ((uintptr_t)g[i].c & 15) == 0);
    }
    for (int i = 0; i < cnt && ts; i++) {
        const void *c16 = group_c16(g[i]);
        const uint64_t dim[2] = {(uint64_t)g[i].n, (uint64_t)g[i].m};
        const uint64_t pitch[1] = {c16 ? (uint64_t)pad8(g[i].n) * 2 : (uint64_t)g[i].n * 4};
        const uint32_t box[2] = {c16 ? 64u : 32u, 64};   // 128 bytes a row either way
        lb_cuda_tma_map(&g[i].tc,
                        c16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
                        c16 ? c16 : (const void *)g[i].c, 2, dim, pitch, box);
    }
    return ts;
}

template <int BN, int S2, int TS, int MN = 0, int C16 = 0, int BM = 128>
static void gemm_launch(lb_cuda_ctx *cx, int tiles, const gt_params *T)
{
    static int smem_set;   // the limit is the kernel's, set once per process (one device)
    if (!smem_set) {
        lb_cuda_smem_limit(gt_kernel<BN, S2, TS, MN, C16, BM>, GT_SMEM(BN, TS));
        smem_set = 1;
    }
    const int grid = tiles < cx->num_sms ? tiles : cx->num_sms;   // persistent blocks
    gt_kernel<BN, S2, TS, MN, C16, BM>
        <<<grid, GT_THREADS_BM(BM), GT_SMEM(BN, TS), cx->stream>>>(*T);
    LB_CUDA_LAUNCHED(cx);
}

// The launch of a layout MN without second levels: the TS kernel, or gg_store's (C16 where
// some group has a bf16 C).
template <int MN, int BM = 128>
static void gemm_launch_mn(lb_cuda_ctx *cx, int tiles, const gt_params *T, int bn, int ts,
                           int c16)
{
    if (bn == 256 && ts) gemm_launch<256, 0, 1, MN, 0, BM>(cx, tiles, T);
    else if (bn == 256 && c16) gemm_launch<256, 0, 0, MN, 1, BM>(cx, tiles, T);
    else if (bn == 256) gemm_launch<256, 0, 0, MN, 0, BM>(cx, tiles, T);
    else if (ts) gemm_launch<128, 0, 1, MN, 0, BM>(cx, tiles, T);
    else if (c16) gemm_launch<128, 0, 0, MN, 1, BM>(cx, tiles, T);
    else gemm_launch<128, 0, 0, MN, 0, BM>(cx, tiles, T);
}

// Group G of a launch on bf16 operands a and b, after the tiles before it (*tiles, advanced
// past its own). Layouts as mn says (GT_A_MN, GT_B_MN): a (m, pad8(k)) or (k, pad8(m)), b
// (n, pad8(k)) or (k, pad8(n)). c16: NULL, or (beta 0) C's bf16 home instead of c. Tiles of
// bm (128, or 64 for a k-major A) x bn.
static void gt_group_set(gt_group *G, const void *a, const void *b, int m, int n, int k, int bn,
                         float *c, uint16_t *c16, float alpha, float beta, int *tiles,
                         int mn = 0, int bm = GG_BM)
{
    memset(G, 0, sizeof *G);
    if (mn & GT_A_MN) tma_map(&G->ta, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, a, k, m, pad8(m), 64, 64);
    else tma_map(&G->ta, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, a, m, k, pad8(k), GG_BK, bm);
    if (mn & GT_B_MN) tma_map(&G->tb, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, b, k, n, pad8(n), 64, 64);
    else tma_map(&G->tb, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, b, n, k, pad8(k), GG_BK, bn);
    G->c = c, G->c16 = (__nv_bfloat16 *)c16, G->m = m, G->n = n, G->k = k;
    G->tile0 = *tiles, G->tiles_n = (n + bn - 1) / bn;
    G->alpha = alpha, G->beta = beta;
    *tiles += (m + bm - 1) / bm * G->tiles_n;
}

// The tile width for these groups: cx->grouped_bn, or 128 when some group's n is at most 128
// (n is the weights' size, so the choice never depends on the token count).
template <typename A> static int gt_bn(const lb_cuda_ctx *cx, const A *g, int count)
{
    int bn = cx->grouped_bn;
    for (int i = 0; i < count; i++)
        if (g[i].n <= 128) bn = 128;
    return bn;
}

// A quantized group's B in bf16 already (a weight's lb_qmat.d16), or NULL.
static const void *gt_b16(const lb_gemm_q_args &x) { return x.b->d16; }

// bf16 copies of the groups' operands in scratch (the previous launch's are done with: one
// stream): ab[i] = A_i (m, pad8(k)), ab[cnt + i] = B_i (n, pad8(k)), or B's d16 copy where it
// has one (no scratch, nothing to write).
template <typename A> static void gt_operands(lb_cuda_ctx *cx, const A *g, int cnt, void **ab)
{
    size_t bytes = 0;
    for (int i = 0; i < cnt; i++)
        bytes += lb_align256((size_t)g[i].m * pad8(g[i].k) * 2) +
                 (gt_b16(g[i]) ? 0 : lb_align256((size_t)g[i].n * pad8(g[i].k) * 2));
    char *sc = (char *)lb_cuda_scratch(cx, bytes);
    for (int i = 0; i < cnt; i++) {
        ab[i] = sc;
        sc += lb_align256((size_t)g[i].m * pad8(g[i].k) * 2);
        if (gt_b16(g[i])) {
            ab[cnt + i] = (void *)gt_b16(g[i]);
            continue;
        }
        ab[cnt + i] = sc;
        sc += lb_align256((size_t)g[i].n * pad8(g[i].k) * 2);
    }
}

// The GEMM launch of T's first cnt groups (tiles in all, columns bn, rows bm, layouts mn:
// GT_A_MN, GT_B_MN; NVFP4's second levels only with the default layouts, bm 64 only there
// and without them).
static void gt_launch(lb_cuda_ctx *cx, gt_params *T, int cnt, int tiles, int bn, int mn,
                      int bm = GG_BM)
{
    T->count = cnt, T->tiles = tiles;
    int s2 = 0;   // NVFP4: every group has its second levels
    for (int i = 0; i < cnt; i++) s2 |= T->g[i].s2a != NULL;
    if (s2 && mn) lb_die("cuda gemm: NVFP4 second levels with MN-major operands");
    int c16 = 0;   // some group's C is bf16 (gemm_q_grouped's never are: no c16 with s2)
    for (int i = 0; i < cnt; i++) c16 |= T->g[i].c16 != NULL;
    if (s2 && c16) lb_die("cuda gemm: NVFP4 second levels with a bf16 C");
    const int ts = ts_maps(T->g, cnt, cx->gg_tma_store && !s2);
    if (!tiles) return;
    if (bm == 64 && (mn || s2)) lb_die("cuda gemm: 64-row tiles with MN-major operands or NVFP4");
    if (bm == 64) gemm_launch_mn<0, 64>(cx, tiles, T, bn, ts, c16);
    else if (mn == GT_B_MN) gemm_launch_mn<GT_B_MN>(cx, tiles, T, bn, ts, c16);
    else if (mn == GT_A_MN) gemm_launch_mn<GT_A_MN>(cx, tiles, T, bn, ts, c16);
    else if (mn == (GT_A_MN | GT_B_MN))
        gemm_launch_mn<GT_A_MN | GT_B_MN>(cx, tiles, T, bn, ts, c16);
    else if (bn == 256 && s2) gemm_launch<256, 1, 0>(cx, tiles, T);
    else if (s2) gemm_launch<128, 1, 0>(cx, tiles, T);
    else gemm_launch_mn<0>(cx, tiles, T, bn, ts, c16);
}

// The groups g[0 .. count) in launches of GT_MAX: for each, the bf16 operand space
// (gt_operands) and the groups' tiles, then fill(groups, cnt, ab, T) queues what writes the
// copies (and sets what else its groups need), then the GEMM.
template <typename A, typename F>
static void gt_batches(lb_cuda_ctx *cx, const A *g, int count, F fill)
{
    const int bn = gt_bn(cx, g, count);
    gt_params *T = (gt_params *)lb_calloc(1, sizeof *T);
    for (int g0 = 0; g0 < count; g0 += GT_MAX) {
        const int cnt = count - g0 < GT_MAX ? count - g0 : GT_MAX;
        void *ab[2 * GT_MAX];
        gt_operands(cx, g + g0, cnt, ab);
        int tiles = 0;
        for (int i = 0; i < cnt; i++) {
            const A *x = &g[g0 + i];
            gt_group_set(&T->g[i], ab[i], ab[cnt + i], x->m, x->n, x->k, bn, x->c, NULL,
                         x->alpha, x->beta, &tiles);
        }
        fill(g + g0, cnt, (void *const *)ab, T);
        gt_launch(cx, T, cnt, tiles, bn, 0);
    }
    free(T);
}

// Split-k for a wgrad of few tiles (C (m, n) = A^T B, both read MN-major, k the tokens: a
// router's 128 x 2048 is 8 tiles, a k or v projection's 512 x 2048 32, on 132
// multiprocessors): the k range is cut into s slices at multiples of GG_BK, each a group of its
// own writing an fp32 partial, and gt_split_sum adds the partials in slice order. s depends on
// the shape alone (never on the device), so the sums stay reproducible; they are not the
// unsplit kernel's bits. 1: no split. Groups of more than GT_SPLIT_MAX_TILES are never split:
// such wgrads come many to a call (an expert down projection's 2048 x 768 is 48 tiles; 128 of
// them share a launch, which they fill), and a split one costs its partials' traffic and a
// summing launch of its own (an expert that drew 2048 tokens or more: 26 a layer in the
// 4-layer bench step, doc/benchmarks.md, 2026-11-30).
#define GT_SPLIT_TILES 128     // the tiles a split aims at
#define GT_SPLIT_MAX_TILES 32  // the most tiles of a group that is split
#define GT_SPLIT_MIN_K 1024    // the least k of a slice
static int gt_split(const lb_gemm_args *x, int bn)
{
    if (!x->transa || x->transb || x->c16) return 1;   // c16: its C is stored, never summed
    const int tiles = (x->m + GG_BM - 1) / GG_BM * ((x->n + bn - 1) / bn);
    if (tiles > GT_SPLIT_MAX_TILES) return 1;
    int s = GT_SPLIT_TILES / tiles;
    if (s > x->k / GT_SPLIT_MIN_K) s = x->k / GT_SPLIT_MIN_K;
    if (s > GT_MAX) s = GT_MAX;
    return s < 2 ? 1 : s;
}

// Slice j of s of k: [gt_slice(k, s, j), gt_slice(k, s, j + 1)).
static int gt_slice(int k, int s, int j)
{
    return j == s ? k : (int)((long long)k * j / s) / GG_BK * GG_BK;
}

// C (mn) = alpha (partial 0 + partial 1 + ... + partial s-1) + beta C, the partials ld apart.
__global__ void gt_split_sum_kernel(float *c, const float *part, size_t ld, size_t mn, int s,
                                    float alpha, float beta)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < mn;
         i += (size_t)gridDim.x * blockDim.x) {
        float t = part[i];
        for (int j = 1; j < s; j++) t = __fadd_rn(t, part[j * ld + i]);
        t = __fmul_rn(alpha, t);
        c[i] = beta == 0.0f ? t : __fadd_rn(t, __fmul_rn(beta, c[i]));
    }
}

// The tile shape of the k-major groups of g (A (m, k), B (n, k): no transpose of A, B
// transposed), *bm x *bn, 128 x bn on entry. A launch of them that would not fill two rounds
// of the multiprocessors (decode: ~16 rows an expert, a dense GEMM of a few hundred rows)
// takes 64-row tiles; if that still leaves multiprocessors idle, 128 columns. The shape
// changes no sum (gt_kernel), only how the work spreads. LB_CUDA_GROUPED_BM=128 keeps 128.
static void gt_shape(const lb_cuda_ctx *cx, const lb_gemm_args *g, int count, int *bm, int *bn)
{
    static int forced = -1;
    if (forced < 0) {
        const char *e = getenv("LB_CUDA_GROUPED_BM");
        forced = e && atoi(e) == 128;
    }
    long t128 = 0, t64 = 0;
    int cnt = 0;
    for (int i = 0; i < count; i++) {
        if (g[i].transa || !g[i].transb) continue;
        t128 += (long)(g[i].m + 127) / 128 * ((g[i].n + *bn - 1) / *bn);
        t64 += (long)(g[i].m + 63) / 64 * ((g[i].n + *bn - 1) / *bn);
        cnt++;
    }
    if (!cnt || forced) return;
    const long launches = (cnt + GT_MAX - 1) / GT_MAX;   // tiles a launch, about
    if (t128 / launches >= 2L * cx->num_sms) return;
    *bm = 64;
    if (*bn == 256 && t64 / launches < cx->num_sms) *bn = 128;
}

// The groups as they are laid out: every operand becomes one plain bf16 copy (no
// transposing; a source that several groups read with the same shape, such as a layer's dy in
// its dgrad and its wgrad, once), all of them first, in pack launches of GG_PACK_MAX; then
// the groups of each layout (A (m, k) or (k, m), B (n, k) or (k, n): GT_A_MN, GT_B_MN) in
// GEMM launches of GT_MAX, the transposed operands read MN-major. The scratch holds every
// copy of the call at once. An operand given in bf16 already (lb_gemm_args.a16, .b16: a weight
// cache's copy, or one its producer wrote, in the layout these copies have) is read as it is.
// ce, or NULL: the copy of the source ce->src gets cross-entropy's gradient of those logits
// instead (ce's ce_ fields; linear_ce_bwd).
static void gt_grouped_mn(lb_cuda_ctx *cx, int count, const lb_gemm_args *g,
                          const gg_pack_job *ce = NULL)
{
    typedef struct {
        const float *src;
        int rows, cols;
        size_t off;   // in the scratch
    } gt_copy;
    gt_copy *cp = (gt_copy *)lb_calloc(2 * (size_t)count, sizeof *cp);
    int *ic = (int *)lb_calloc(2 * (size_t)count, sizeof *ic);   // group i: A ic[2i], B ic[2i+1]
    int nc = 0;
    size_t bytes = 0;
    for (int i = 0; i < 2 * count; i++) {
        const lb_gemm_args *x = &g[i / 2];
        if (i % 2 ? x->b16 != NULL : x->a16 != NULL) {   // read as it is
            ic[i] = -1;
            continue;
        }
        gt_copy c = i % 2 ? (gt_copy){x->b, x->transb ? x->n : x->k, x->transb ? x->k : x->n, 0}
                          : (gt_copy){x->a, x->transa ? x->k : x->m, x->transa ? x->m : x->k, 0};
        int j = 0;
        while (j < nc && !(cp[j].src == c.src && cp[j].rows == c.rows && cp[j].cols == c.cols)) j++;
        if (j == nc) {
            c.off = bytes;
            bytes += lb_align256((size_t)c.rows * pad8(c.cols) * 2);
            cp[nc++] = c;
        }
        ic[i] = j;
    }
    const int bn = gt_bn(cx, g, count);
    int *split = (int *)lb_calloc((size_t)count, sizeof *split);
    size_t *part_off = (size_t *)lb_calloc((size_t)count, sizeof *part_off);
    for (int i = 0; i < count; i++) {   // the partials of split groups, after the copies
        split[i] = gt_split(&g[i], bn);
        part_off[i] = bytes;
        if (split[i] > 1) bytes += split[i] * lb_align256((size_t)g[i].m * g[i].n * 4);
    }
    char *sc = (char *)lb_cuda_scratch(cx, bytes);
    gg_pack_params *pp = (gg_pack_params *)lb_calloc(1, sizeof *pp);
    for (int j = 0; j < nc; j++) {
        gg_pack_job J = {cp[j].src, (__nv_bfloat16 *)(sc + cp[j].off), cp[j].rows, cp[j].cols,
                         pad8(cp[j].cols), NULL, NULL, 0.0f};
        if (ce && cp[j].src == ce->src)
            J.ce_stats = ce->ce_stats, J.ce_targets = ce->ce_targets, J.ce_dloss = ce->ce_dloss;
        pp->j[pp->count++] = J;
        if (pp->count == GG_PACK_MAX) pack_launch(cx, pp);
    }
    pack_launch(cx, pp);
    free(pp);
    gt_params *T = (gt_params *)lb_calloc(1, sizeof *T);
    for (int mn = 0; mn < 4; mn++) {
        int cnt = 0, tiles = 0, bm = GG_BM, bnm = bn;
        if (mn == 0) gt_shape(cx, g, count, &bm, &bnm);
        for (int i = 0; i < count; i++) {
            if (((g[i].transa ? GT_A_MN : 0) | (g[i].transb ? 0 : GT_B_MN)) != mn) continue;
            const lb_gemm_args *x = &g[i];
            const char *a = ic[2 * i] < 0 ? (const char *)x->a16 : sc + cp[ic[2 * i]].off;
            const char *b = ic[2 * i + 1] < 0 ? (const char *)x->b16
                                              : sc + cp[ic[2 * i + 1]].off;
            const int s = split[i];
            for (int j = 0; j < s; j++) {   // s 1: the group as it is
                // split: A (k, m) and B (k, n) from row k0 on, C a partial, beta 0
                const int k0 = gt_slice(x->k, s, j), k1 = gt_slice(x->k, s, j + 1);
                float *c = s > 1 ? (float *)(sc + part_off[i] +
                                             j * lb_align256((size_t)x->m * x->n * 4))
                                 : x->c;
                gt_group_set(&T->g[cnt++], a + (size_t)k0 * pad8(x->m) * 2,
                             b + (size_t)k0 * pad8(x->n) * 2, x->m, x->n, k1 - k0, bnm, c,
                             s > 1 ? NULL : x->c16, s > 1 ? 1.0f : x->alpha,
                             s > 1 ? 0.0f : x->beta, &tiles, mn, bm);
                if (cnt == GT_MAX) {
                    gt_launch(cx, T, cnt, tiles, bnm, mn, bm);
                    cnt = 0, tiles = 0;
                }
            }
        }
        if (cnt) gt_launch(cx, T, cnt, tiles, bnm, mn, bm);
    }
    for (int i = 0; i < count; i++) {   // after every launch: one stream
        if (split[i] < 2) continue;
        const size_t mnn = (size_t)g[i].m * g[i].n;
        gt_split_sum_kernel<<<lb_grid(mnn, 256, cx), 256, 0, cx->stream>>>(
            g[i].c, (const float *)(sc + part_off[i]), lb_align256(mnn * 4) / 4, mnn, split[i],
            g[i].alpha, g[i].beta);
        LB_CUDA_LAUNCHED(cx);
    }
    free(T), free(cp), free(ic), free(split), free(part_off);
}

// Runs the groups g[0 .. count) (each bf16, m, n, k > 0, alpha != 0; gemm.cu filters) as
// described at the top (gt_grouped_mn). Queued on cx->stream. Tiles are 128 x gt_bn.
extern "C" void lb_cuda_gemm_grouped_tc(lb_cuda_ctx *cx, int count, const lb_gemm_args *g)
{
    gt_grouped_mn(cx, count, g);
}

template <int BN, int C16, int BM>
static void gx_launch(lb_cuda_ctx *cx, int grid, const gx_params *P)
{
    static int smem_set;
    if (!smem_set) {
        lb_cuda_smem_limit(gx_kernel<BN, C16, BM>, GT_SMEM(BN, 0));
        smem_set = 1;
    }
    gx_kernel<BN, C16, BM><<<grid, GT_THREADS_BM(BM), GT_SMEM(BN, 0), cx->stream>>>(*P);
    LB_CUDA_LAUNCHED(cx);
}

// The launch for P's C: bf16 (c16) or fp32.
template <int BN, int BM>
static void gx_launch_c16(lb_cuda_ctx *cx, int grid, const gx_params *P)
{
    if (P->c16) gx_launch<BN, 1, BM>(cx, grid, P);
    else gx_launch<BN, 0, BM>(cx, grid, P);
}

// gemm_experts (kernels.h) on gx_kernel: queued on cx->stream, no wait. The tile shape comes
// from the sizes the host knows (rows, e, n), never from the counts: 64 rows where the mean
// expert has fewer than 64 (decode), 128 columns where n is at most 128 (gt_bn).
extern "C" void lb_cuda_gemm_experts_tc(lb_cuda_ctx *cx, const lb_gemm_experts_args *x)
{
    if (x->e > GX_MAX_E) lb_die("gemm_experts: %d experts (at most %d)", x->e, GX_MAX_E);
    gx_params P;
    memset(&P, 0, sizeof P);
    const int bn = x->n <= 128 ? 128 : cx->grouped_bn, bm = x->rows < 64 * x->e ? 64 : 128;
    tma_map(&P.ta, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, x->a16, x->rows, x->k, pad8(x->k), GG_BK,
            bm);
    tma_map(&P.tb, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, x->b16, x->e * x->n, x->k, pad8(x->k), GG_BK,
            bn);
    P.c = x->c, P.c16 = (__nv_bfloat16 *)x->c16, P.counts = x->counts, P.err = cx->err_dev;
    P.e = x->e, P.rows = x->rows, P.n = x->n, P.k = x->k;
    // at most rows / bm + e tile rows, each (n / bn) tiles
    const long most = ((long)x->rows / bm + x->e) * ((x->n + bn - 1) / bn);
    const int grid = most < cx->num_sms ? (int)most : cx->num_sms;
    if (bm == 64 && bn == 256) gx_launch_c16<256, 64>(cx, grid, &P);
    else if (bm == 64) gx_launch_c16<128, 64>(cx, grid, &P);
    else if (bn == 256) gx_launch_c16<256, 128>(cx, grid, &P);
    else gx_launch_c16<128, 128>(cx, grid, &P);
}

// linear_ce_bwd (kernels.h) on this kernel: the dgrad dx (n, c) = dy w and the wgrad dw (v, c)
// = dy^T x as gemm_grouped's groups on operands as they are laid out (gt_grouped_mn), whose
// copy of dy (n, v) is cross-entropy's gradient computed from the logits as they are read
// (gg_ce_grad4); the dgrad reads dy k-major and w MN-major, the wgrad dy and x MN-major. The
// gradient is never stored in fp32 (two passes of n v 4 bytes: 10 GB each for the 4-layer
// bench's LM head), and no transposed copy is written (dy^T: n v 2 bytes). The same bf16
// values meet in the same k order as in cross_entropy_bwd and gemm_grouped, so the same bits
// (test_linear_ce_bwd). Queued on cx->stream.
extern "C" void lb_cuda_linear_ce_bwd_tc(lb_cuda_ctx *cx, float *dx, float dx_beta, float *dw,
                                         float dw_beta, const float *logits,
                                         const double *stats, const int32_t *targets,
                                         float dloss, const float *x, const float *w,
                                         const uint16_t *w16, int n, int v, int c)
{
    const lb_gemm_args g[2] = {{0, 0, n, c, v, 1.0f, dx_beta, logits, w, dx, 1, w16, NULL, NULL},
                               {1, 0, v, c, n, 1.0f, dw_beta, logits, x, dw, 1, NULL, NULL, NULL}};
    const gg_pack_job ce = {logits, NULL, n, v, 0, stats, targets, dloss};
    gt_grouped_mn(cx, 2, g, &ce);
}

// MXFP8, MXFP4, NVFP4 (gemm_q.cu): every operand dequantized to bf16 in scratch (an element
// times its block scale has at most 6 significant bits: exact in bf16 within its exponent
// range; NVFP4's second level stays out) with the pack's layout, one dequantization and one
// GEMM launch per GT_MAX groups; gg_store applies the second levels. The sums are the bf16
// kernel's, in its fixed order: reproducible and batch invariant.
extern "C" void lb_cuda_gemm_q_grouped_bf16(lb_cuda_ctx *cx, int count, const lb_gemm_q_args *g)
{
    lb_cuda_dq_job *jobs = (lb_cuda_dq_job *)lb_calloc(2 * GT_MAX, sizeof *jobs);
    auto dequant = [&](const lb_gemm_q_args *gb, int cnt, void *const *ab, gt_params *T) {
        int n = cnt;
        for (int i = 0; i < cnt; i++) {
            const lb_gemm_q_args *x = &gb[i];
            const size_t ld = (size_t)pad8(x->k);
            jobs[i] = (lb_cuda_dq_job){x->a, ab[i], ld, (int)ld};   // the A's, then the B's
            if (!x->b->d16)   // without a bf16 copy of their own: runs of a type
                jobs[n++] = (lb_cuda_dq_job){x->b, ab[cnt + i], ld, (int)ld};
            if (x->a->fmt == LB_FMT_NVFP4) {
                gt_group *G = &T->g[i];
                G->s2a = x->a->scale2, G->s2a_row = x->a->nscale2 > 1;
                G->s2b = x->b->scale2, G->s2b_row = x->b->nscale2 > 1;
            }
        }
        lb_cuda_dequant_bf16_groups(cx, n, jobs);
    };
    gt_batches(cx, g, count, dequant);
    free(jobs);
}

// --- fp8-block: E4M3 x E4M3 with block scales, promoted to fp32 per 128 of k -------------------
//
// gemm_q's fp8-block product of groups (kernels.h gemm_q_grouped): A (m, k) activations with
// 1x128 scales (m, KB), B (n, k) with 128x128 scales (ceil(n / 128), KB) or 1x128 scales
// (n, KB), KB = ceil(k / 128). No packing: the quantized operands are already k contiguous
// bytes, which is what the tensor cores read for FP8.
//
// gq_kernel has gt_kernel's structure (persistent blocks, bands of tile rows, a TMA producer,
// full/empty barriers per stage) with 128 x 128 tiles. Each 128-element k block (128 bytes a
// row: one row of the 128-byte swizzle) is one stage of a 5- or 6-stage ring, together with
// the scales of the tile's 128 rows of A (and, for a 1x128 B, of its 128 columns), copied by
// TMA from transposed copies that a small kernel writes first (gq_scales_t_kernel: a k block's
// scales of consecutive rows are then one 512-byte box). A 128x128 B's one scale per tile and
// k block the math threads read from global memory (one address for the whole tile, so L1
// serves it). A math warpgroup puts a block's four k32 products (wgmma m64n128k32 e4m3) into a fresh fp32 fragment and adds
// it to the accumulator d scaled by sa[row] * sb[col] (DeepSeek-V3's promotion: the tensor
// cores' FP8 sums keep about 14 bits, so they never run longer than one block). It has two
// such fragments and promotes block kt - 1 while block kt's products run, so its tensor work
// never waits for a promotion; the registers for three 64 x 128 fragments come from the
// producer warpgroup (setmaxnreg: 40 there, 232 in the math warpgroups). The
// order of every sum is fixed (blocks in k order, k32 steps in order within one), so the result
// is bitwise reproducible and batch invariant, as the bf16 kernel above.
//
// Needs k a multiple of 16 (TMA's 16-byte row pitch) and row pitches of k bytes; gemm_q.cu
// sends other groups through gemm_q.
#define GQ_BN 128
#define GQ_BK 128                       // bytes = elements of E4M3; one scale block
#define GQ_STAGE (GG_BM * GQ_BK + GQ_BN * GQ_BK)   // 32 KB
#define GQ_SCALES (2 * GQ_BN * 4)   // a stage's scales: A's 128 rows, then a 1x128 B's 128
// Shared memory: the ring's stages, their scales, the chunk buffers of the TS epilogue (two
// per math warpgroup, so one goes out while the next is written; 1024-aligned), the barriers.
// Six stages; five beside the chunk buffers.
#define GQ_STAGES(TS) ((TS) ? 5 : 6)
#define GQ_RING(TS) ((GQ_STAGES(TS) * (GQ_STAGE + GQ_SCALES) + 1023) & ~1023)
#define GQ_SMEM(TS) (1024 + GQ_RING(TS) + ((TS) ? 4 * GT_CHUNK : 0) + 16 * GQ_STAGES(TS))
// Registers per thread after setmaxnreg: 128 x 40 + 256 x 232 fit the 64K of a multiprocessor
#define GQ_LOAD_REGS 40
#define GQ_MATH_REGS 232

typedef struct {
    CUtensorMap ta, tb;         // A (m, k), B (n, k) E4M3 codes; boxes 128 x 128 bytes
    CUtensorMap tc;             // TS launches: C (m, n) fp32, boxes 32 x 64 (gt_store_tma)
    // The scales, transposed (gq_scales_t): A's (kb, m), boxes 128 x 1; a 1x128 B's (kb, n),
    // boxes 128 x 1. A 128x128 B's (ceil(n / 128), kb) are read as they are (sb).
    CUtensorMap tsa, tsb;
    const float *sb;
    float *c;                   // (m, n)
    __nv_bfloat16 *c16;         // NULL, or (TS launches) C stored in bf16 instead
    int m, n, kb;
    int tile0, tiles_n;
    float alpha, beta;
} gq_group;

typedef struct {
    int count, tiles;
    gq_group g[GT_MAX];
} gq_params;
static_assert(sizeof(gq_params) <= 32764, "gq_params exceeds the kernel parameter space");

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// d (64 x 128 fp32) = (acc ? d : 0) + A (64 x 32) B (128 x 32)^T, E4M3 operands.
__device__ __forceinline__ void gq_wgmma(float *d, uint64_t da, uint64_t db, int acc)
{
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
        GG_D64_ASM ", %64, %65, p, 1, 1;\n}\n"
        : GG_D64(d)
        : "l"(da), "l"(db), "r"(acc));
}

// d += t * sa[row] * sb (the promotion of one k block's products): a0, a1 the scales of this
// thread's two rows; sb the tile's one scale b2 (VEC 0) or, VEC 1, one per column (the block's
// 128 scales in shared memory at sbs).
template <int VEC>
__device__ __forceinline__ void gq_promote(float (&d)[64], const float (&t)[64], float a0, float a1,
                                           float b2, const float *sbs, int lane)
{
#pragma unroll
    for (int j = 0; j < 16; j++) {
        float b0 = b2, b1 = b2;
        if (VEC) {
            const float2 b = *(const float2 *)(sbs + j * 8 + (lane & 3) * 2);
            b0 = b.x, b1 = b.y;
        }
        d[4 * j + 0] = fmaf(t[4 * j + 0], a0 * b0, d[4 * j + 0]);
        d[4 * j + 1] = fmaf(t[4 * j + 1], a0 * b1, d[4 * j + 1]);
        d[4 * j + 2] = fmaf(t[4 * j + 2], a1 * b0, d[4 * j + 2]);
        d[4 * j + 3] = fmaf(t[4 * j + 3], a1 * b1, d[4 * j + 3]);
    }
}

// Waits for ring position it's stage (S stages) and queues its four k32 products into t (as
// one group).
template <int S>
__device__ __forceinline__ void gq_issue(float (&t)[64], uint32_t base, uint32_t full, int it,
                                         int cw)
{
    const int s = it % S;
    lb_mbar_wait(full + 8 * s, (it / S) & 1);
    const uint32_t sa = base + s * GQ_STAGE + cw * 64 * 128;
    const uint32_t sb = base + s * GQ_STAGE + GG_BM * GQ_BK;
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < GQ_BK / 32; kk++)   // k32 steps: 32 bytes further in each row
        gq_wgmma(t, gg_desc(sa + kk * 32), gg_desc(sb + kk * 32), kk);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Promotes ring position it's finished products t into d with the stage's scales (row ra of
// the tile's A and ra + 8), then gives the stage back to the producer.
template <int VEC, int S>
__device__ __forceinline__ void gq_retire(float (&d)[64], const float (&t)[64], uint32_t empty,
                                          const float *scales, int it, int ra, float b2, int lane)
{
    const int s = it % S;
    const float *sc = scales + s * (GQ_SCALES / 4);
    gq_promote<VEC>(d, t, sc[ra], sc[ra + 8], b2, sc + GQ_BN, lane);
    // The scales are read by the generic proxy and rewritten by TMA (the async proxy) once the
    // stage is released. Without this fence the loads could still be in flight at the
    // arrival (ptxas issued it right after them), and a load could return the next block's
    // scale: run-to-run differences in training, never in small tests.
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncwarp();   // the warp's reads of the stage (products, scales) are done
    if (lane == 0) lb_mbar_arrive(empty + 8 * s);
}

// Box (c0, c1) of a scale map (no swizzle) into dst; completes its bytes on bar.
__device__ __forceinline__ void gq_load_scales(uint32_t dst, const CUtensorMap *map, int c0,
                                               int c1, uint32_t bar)
{
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
        "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}
#endif

// VEC 0: B has 128x128 blocks (one scale per tile and k block); 1: 1x128 (one per column).
// TS: every group has beta 0 and a C map: gt_store_tma instead of gg_store.
template <int VEC, int TS>
__global__ void __launch_bounds__(GT_THREADS, 1) gq_kernel(const __grid_constant__ gq_params P)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int S = GQ_STAGES(TS);
    extern __shared__ uint8_t gq_smem[];
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(gq_smem), base = (raw + 1023) & ~1023u;
    const float *scales = (const float *)(gq_smem + (base - raw) + S * GQ_STAGE);   // S x 256
    const uint32_t sbase = base + S * GQ_STAGE;
    const uint32_t stg = base + GQ_RING(TS);   // TS: the chunk buffers
    const uint32_t full = stg + (TS ? 4 * GT_CHUNK : 0), empty = full + 8 * S;
    const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31;

    if (tid == 0) {
        for (int s = 0; s < S; s++) {
            // the producer's arrival plus the bytes; one arrival per math warp once it is
            // done with the stage
            lb_mbar_init(full + 8 * s, 1);
            lb_mbar_init(empty + 8 * s, 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {   // the producer: one thread issues the copies
        // its registers go to the math warpgroups (three fragments of 64 each)
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(GQ_LOAD_REGS));
        if (tid == 0) {
            // each stage: the k block of A and B and their scales, all by TMA (loaded by
            // the math threads as they promoted, the scales' latency held the promotion up)
            constexpr int SB = VEC ? GQ_BN * 4 : 0;   // B's scale bytes
            int it = 0;
            for (int t = blockIdx.x; t < P.tiles; t += gridDim.x) {
                int m0, n0;
                const gq_group &G = gg_tile(P.g, P.count, t, GQ_BN, &m0, &n0);
                for (int kt = 0; kt < G.kb; kt++, it++) {
                    const int s = it % S;
                    if (it >= S) lb_mbar_wait(empty + 8 * s, (it / S - 1) & 1);
                    const uint32_t f = full + 8 * s, sc = sbase + s * GQ_SCALES;
                    lb_mbar_expect(f, GQ_STAGE + GQ_BN * 4 + SB);
                    gt_load(base + s * GQ_STAGE, &G.ta, kt * GQ_BK, m0, f);
                    gt_load(base + s * GQ_STAGE + GG_BM * GQ_BK, &G.tb, kt * GQ_BK, n0, f);
                    gq_load_scales(sc, &G.tsa, m0, kt, f);
                    if (VEC) gq_load_scales(sc + GQ_BN * 4, &G.tsb, n0, kt, f);
                }
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(GQ_MATH_REGS));
    const int cw = wg - 1, warp = (tid >> 5) & 3;
    int it = 0;
    for (int t = blockIdx.x; t < P.tiles; t += gridDim.x) {
        int m0, n0;
        const gq_group &G = gg_tile(P.g, P.count, t, GQ_BN, &m0, &n0);
        // this thread's rows of C (gg_store's layout): ra and ra + 8 of the tile
        const int ra = cw * 64 + warp * 16 + (lane >> 2), r = m0 + ra;
        // Block kt's products go to one fragment while block kt - 1's, in the other, are
        // promoted: the tensor cores do not wait for a promotion. The same sums in the same
        // order as promoting each block before issuing the next.
        float d[64], t0[64], t1[64];
#pragma unroll
        for (int i = 0; i < 64; i++) d[i] = 0.0f;
        // a 128x128 B's scale of block kt (one address for the whole tile: L1 serves it)
        const float *sb2 = G.sb + (size_t)(n0 / GQ_BN) * G.kb;
        float b0 = 0.0f, b1 = 0.0f;
        gq_issue<S>(t0, base, full, it, cw);
        if (!VEC) b0 = sb2[0];
        int kt = 1;
        for (; kt + 1 < G.kb; kt += 2) {   // t0 holds block kt - 1's products, in flight
            gq_issue<S>(t1, base, full, it + kt, cw);
            if (!VEC) b1 = sb2[kt];
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
            gq_retire<VEC, S>(d, t0, empty, scales, it + kt - 1, ra, b0, lane);
            gq_issue<S>(t0, base, full, it + kt + 1, cw);
            if (!VEC) b0 = sb2[kt + 1];
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
            gq_retire<VEC, S>(d, t1, empty, scales, it + kt, ra, b1, lane);
        }
        if (kt < G.kb) {   // an even number of blocks: the last goes to t1
            gq_issue<S>(t1, base, full, it + kt, cw);
            if (!VEC) b1 = sb2[kt];
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
            gq_retire<VEC, S>(d, t0, empty, scales, it + kt - 1, ra, b0, lane);
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
            gq_retire<VEC, S>(d, t1, empty, scales, it + kt, ra, b1, lane);
        } else {
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
            gq_retire<VEC, S>(d, t0, empty, scales, it + kt - 1, ra, b0, lane);
        }
        it += G.kb;
        if (TS) {   // a bf16 C (G.c16) only here: a branch uniform over the block
            if (G.c16)
                gt_store_tma<1, 2, 1>(reinterpret_cast<const float(&)[1][64]>(d), &G.tc, G.alpha,
                                      m0, n0, stg + cw * 2 * GT_CHUNK, cw, warp, lane,
                                      (tid & 127) == 0);
            else
                gt_store_tma<1, 2>(reinterpret_cast<const float(&)[1][64]>(d), &G.tc, G.alpha,
                                   m0, n0, stg + cw * 2 * GT_CHUNK, cw, warp, lane,
                                   (tid & 127) == 0);
            continue;
        }
        gg_store<16>(d, G.c, G.m, G.n, G.alpha, G.beta, r, n0, lane);
    }
    // the stores are complete before the block's shared memory goes
    if (TS && (tid & 127) == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#endif
}

// --- gemm_experts, quantized: the fp8-block groups' sizes on the device -------------------------
//
// gemm_experts' fp8-block form (kernels.h: qa the rows of all experts quantized 1x128 in one
// call, qb the experts' 128x128-block weights, stacked in one allocation as the weight cache
// lays them out) as gx_kernel is gemm_grouped's: gq_kernel's ring, products and promotions on
// tiles that each block plans from the device counts (gx_plan), so the decode step queues its
// fp8 expert GEMMs without waiting for the counts. One map over all rows of A, one over the e n
// rows of B, one over A's transposed scales; B's tile scale is read at expert e's place in the
// stacked scales. A box of scales starts at a 16-byte aligned row (TMA faults on others, seen on
// the H200 as an illegal instruction: an expert's rows start anywhere), so it holds BM + 4 rows
// and a tile reads its own from the offset. BM 64 (decode: about 16 rows an expert) takes one
// math warpgroup and 64-row boxes; a row's sums are the same blocks in the same order as in
// gq_kernel's 128-row tiles, so the bits are gemm_q_grouped's on those groups. A tile's boxes
// may run into the next expert's rows: the store leaves them out (gg_store, gg_store16).
typedef struct {
    CUtensorMap ta, tb;   // A (rows, k) E4M3: boxes 128 bytes x BM; B (e n, k): boxes 128 x 128
    CUtensorMap tsa;      // A's scales transposed (kb, pad128(rows)): boxes BM + 4 x 1
    const float *sb;      // (ceil(n / 128), kb) B's scales of expert 0; expert j's j sstep on
    size_t sstep;
    float *c;             // (rows, n), or NULL
    __nv_bfloat16 *c16;   // (rows, pad8(n)), or NULL
    const int *counts;    // (e) device memory
    unsigned long long *err;
    int e, rows, n, kb;
} gqx_params;

template <int BM, int C16>
__global__ void __launch_bounds__(GT_THREADS_BM(BM), 1) gqx_kernel(const __grid_constant__ gqx_params P)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int S = GQ_STAGES(0), W = BM / 16;   // math warps
    extern __shared__ uint8_t gq_smem[];
    __shared__ gx_group grp[GX_MAX_E];
    __shared__ int ntiles;
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(gq_smem), base = (raw + 1023) & ~1023u;
    const float *scales = (const float *)(gq_smem + (base - raw) + S * GQ_STAGE);
    const uint32_t sbase = base + S * GQ_STAGE;
    const uint32_t full = base + GQ_RING(0), empty = full + 8 * S;
    const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31;
    if (tid == 0) {
        for (int s = 0; s < S; s++) {
            lb_mbar_init(full + 8 * s, 1);
            lb_mbar_init(empty + 8 * s, W);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    if (tid < 32) gx_plan<GQ_BN, BM>(P, grp, &ntiles, tid);
    __syncthreads();
    const int tiles = ntiles;
    if (wg == 0) {   // the producer: one thread
        if (BM == 128) asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(GQ_LOAD_REGS));
        if (tid == 0) {
            int it = 0;
            for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
                int m0, n0;
                const gx_group &G = gg_tile(grp, P.e, t, GQ_BN, &m0, &n0, BM);
                const int e = (int)(&G - grp);
                for (int kt = 0; kt < P.kb; kt++, it++) {
                    const int s = it % S;
                    if (it >= S) lb_mbar_wait(empty + 8 * s, (it / S - 1) & 1);
                    const uint32_t f = full + 8 * s;
                    lb_mbar_expect(f, BM * GQ_BK + GQ_BN * GQ_BK + (BM + 4) * 4);
                    gt_load(base + s * GQ_STAGE, &P.ta, kt * GQ_BK, G.row0 + m0, f);
                    gt_load(base + s * GQ_STAGE + GG_BM * GQ_BK, &P.tb, kt * GQ_BK,
                            e * P.n + n0, f);
                    gq_load_scales(sbase + s * GQ_SCALES, &P.tsa, (G.row0 + m0) & ~3, kt, f);
                }
            }
        }
        return;
    }
    if (BM == 128) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(GQ_MATH_REGS));
    const int cw = wg - 1, warp = (tid >> 5) & 3;
    const int ra = cw * 64 + warp * 16 + (lane >> 2);   // gq_kernel's rows of the tile
    int it = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        int m0, n0;
        const gx_group &G = gg_tile(grp, P.e, t, GQ_BN, &m0, &n0, BM);
        const int e = (int)(&G - grp), kb = P.kb, rs = ra + ((G.row0 + m0) & 3);
        const float *sb2 = P.sb + e * P.sstep + (size_t)(n0 / GQ_BN) * kb;
        float d[64], t0[64], t1[64];
#pragma unroll
        for (int i = 0; i < 64; i++) d[i] = 0.0f;
        // gq_kernel's schedule (its VEC 0 branch): block kt's products in one fragment while
        // block kt - 1's are promoted from the other
        float b0 = sb2[0], b1 = 0.0f;
        gq_issue<S>(t0, base, full, it, cw);
        int kt = 1;
        for (; kt + 1 < kb; kt += 2) {
            gq_issue<S>(t1, base, full, it + kt, cw);
            b1 = sb2[kt];
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
            gq_retire<0, S>(d, t0, empty, scales, it + kt - 1, rs, b0, lane);
            gq_issue<S>(t0, base, full, it + kt + 1, cw);
            b0 = sb2[kt + 1];
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
            gq_retire<0, S>(d, t1, empty, scales, it + kt, rs, b1, lane);
        }
        if (kt < kb) {
            gq_issue<S>(t1, base, full, it + kt, cw);
            b1 = sb2[kt];
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
            gq_retire<0, S>(d, t0, empty, scales, it + kt - 1, rs, b0, lane);
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
            gq_retire<0, S>(d, t1, empty, scales, it + kt, rs, b1, lane);
        } else {
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
            gq_retire<0, S>(d, t0, empty, scales, it + kt - 1, rs, b0, lane);
        }
        it += kb;
        if (C16)
            gg_store16(d, P.c16 + (size_t)G.row0 * ((P.n + 7) & ~7), G.m, P.n, 1.0f, m0 + ra,
                       n0, lane);
        else
            gg_store<16>(d, P.c + (size_t)G.row0 * P.n, G.m, P.n, 1.0f, 0.0f, m0 + ra, n0, lane);
    }
#endif
}

// Block scales transposed for the producer's TMA: src (rows, kb) -> dst (kb, ld), ld = rows
// rounded up to a multiple of 128 (the map's box: no box reaches beyond the tensor), zeros in
// the padding. A k block's scales of 128 consecutive rows are then one box.
typedef struct {
    const float *src;
    float *dst;
    int rows, kb, ld;
} gq_st_job;

#define GQ_ST_MAX 64
typedef struct {
    int count;
    gq_st_job j[GQ_ST_MAX];
} gq_st_params;

// Block (32, 8); blockIdx.y the job; 32 x 32 tiles through shared memory, so that reads and
// writes are both row by row.
__global__ void gq_scales_t_kernel(const __grid_constant__ gq_st_params P)
{
    __shared__ float tile[32][33];
    const gq_st_job &J = P.j[blockIdx.y];
    const int tr = (J.ld + 31) / 32, tk = (J.kb + 31) / 32;
    for (int b = blockIdx.x; b < tr * tk; b += gridDim.x) {
        const int r0 = b % tr * 32, k0 = b / tr * 32;
        for (int i = threadIdx.y; i < 32; i += 8) {
            const int r = r0 + i, k = k0 + threadIdx.x;
            tile[i][threadIdx.x] = r < J.rows && k < J.kb ? J.src[(size_t)r * J.kb + k] : 0.0f;
        }
        __syncthreads();
        for (int i = threadIdx.y; i < 32; i += 8) {
            const int k = k0 + i, r = r0 + threadIdx.x;
            if (k < J.kb && r < J.ld) J.dst[(size_t)k * J.ld + r] = tile[threadIdx.x][i];
        }
        __syncthreads();
    }
}

// The map of transposed scales (kb, rows) of row pitch ld (no swizzle: boxes of box x 1
// floats; the tensor map fills a box's rows beyond rows with zeros).
static void scale_map(CUtensorMap *map, const float *x, int ld, int rows, int kb, int box)
{
    const uint64_t dim[2] = {(uint64_t)rows, (uint64_t)kb}, pitch[1] = {(uint64_t)ld * 4};
    const uint32_t bx[2] = {(uint32_t)box, 1};
    tma_encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, x, 2, dim, pitch, bx,
               CU_TENSOR_MAP_SWIZZLE_NONE);
}

static void gq_scales_t_launch(lb_cuda_ctx *cx, const gq_st_params *T, int tiles)
{
    const dim3 grid(tiles < cx->num_sms ? tiles : cx->num_sms, T->count);
    gq_scales_t_kernel<<<grid, dim3(32, 8), 0, cx->stream>>>(*T);
    LB_CUDA_LAUNCHED(cx);
}

// Every group's A scales, and a 1x128 B's, transposed: job[2i] A's of group i, job[2i + 1] its
// B's (left empty for a 128x128 B, whose scales are read as they are). An operand with its
// scales transposed already (lb_qmat.tscale, written by the quantizer) is read there; the
// others go into scratch, one launch per GQ_ST_MAX jobs.
static void gq_scales_t(lb_cuda_ctx *cx, int count, const lb_gemm_q_args *g, int vec,
                        gq_st_job *job)
{
    size_t bytes = 0;
    for (int i = 0; i < 2 * count; i++) {
        if (i & 1 && !vec) continue;
        const lb_qmat *q = i & 1 ? g[i / 2].b : g[i / 2].a;
        job[i].src = (const float *)q->scale, job[i].rows = q->srows, job[i].kb = q->scols;
        job[i].ld = (q->srows + 127) / 128 * 128;
        if (q->tscale) job[i].dst = q->tscale;
        else bytes += lb_align256((size_t)job[i].ld * job[i].kb * sizeof(float));
    }
    char *sc = bytes ? (char *)lb_cuda_scratch(cx, bytes) : NULL;
    gq_st_params T;
    T.count = 0;
    int most = 0;   // the largest job's 32 x 32 tiles
    for (int i = 0; i < 2 * count; i++) {
        if (!job[i].src || job[i].dst) continue;
        job[i].dst = (float *)sc;
        sc += lb_align256((size_t)job[i].ld * job[i].kb * sizeof(float));
        T.j[T.count++] = job[i];
        const int tiles = job[i].ld / 32 * ((job[i].kb + 31) / 32);
        most = tiles > most ? tiles : most;
        if (T.count == GQ_ST_MAX) {
            gq_scales_t_launch(cx, &T, most);
            T.count = 0, most = 0;
        }
    }
    if (T.count) gq_scales_t_launch(cx, &T, most);
}

// Whether gq_kernel takes the fp8-block GEMM of a (m, k) and b (n, k): 1x128 activations,
// 128x128 or 1x128 b, k a multiple of 16 with rows k bytes apart, 16-byte aligned data.
extern "C" int lb_cuda_gemm_q_grouped_fits(const lb_qmat *a, const lb_qmat *b)
{
    return a->fmt == LB_FMT_FP8_BLOCK && b->fmt == LB_FMT_FP8_BLOCK && a->brows == 1 &&
           (b->brows == 1 || b->brows == 128) && a->cols % 16 == 0 && a->cols == b->cols &&
           a->ld == (size_t)a->cols && b->ld == (size_t)b->cols &&
           ((uintptr_t)a->data & 15) == 0 && ((uintptr_t)b->data & 15) == 0;
}

// ts_maps' rule for the fp8 groups g[0 .. count), whatever launches they are cut into.
extern "C" int lb_cuda_gemm_q_grouped_ts(const lb_cuda_ctx *cx, int count,
                                         const lb_gemm_q_args *g)
{
    int ts = cx->gg_tma_store;
    for (int i = 0; i < count && ts; i++) {
        const lb_gemm_q_args *x = &g[i];
        ts = x->beta == 0.0f && (x->c16 ? x->n % 8 == 0 && ((uintptr_t)x->c16 & 15) == 0
                                        : x->n % 4 == 0 && ((uintptr_t)x->c & 15) == 0);
    }
    return ts;
}

// The groups g[0 .. count): every one fits (above), with m, n, k > 0 and alpha != 0, and all
// with the same b block shape. One launch per GT_MAX groups (their tensor maps travel in the
// kernel parameters). Queued on cx->stream.
extern "C" void lb_cuda_gemm_q_grouped_tc(lb_cuda_ctx *cx, int count, const lb_gemm_q_args *g)
{
    static int smem_set[4];
    const int vec = count > 0 && g[0].b->brows == 1;
    gq_st_job *job = (gq_st_job *)lb_calloc(2 * (size_t)count, sizeof *job);
    gq_scales_t(cx, count, g, vec, job);
    gq_params *P = (gq_params *)lb_calloc(1, sizeof *P);
    for (int g0 = 0; g0 < count; g0 += GT_MAX) {
        const int cnt = count - g0 < GT_MAX ? count - g0 : GT_MAX;
        int tiles = 0;
        for (int i = 0; i < cnt; i++) {
            const lb_gemm_q_args *x = &g[g0 + i];
            const gq_st_job *ja = &job[2 * (g0 + i)], *jb = ja + 1;
            gq_group *G = &P->g[i];
            tma_map(&G->ta, CU_TENSOR_MAP_DATA_TYPE_UINT8, x->a->data, x->m, x->k, x->k, GQ_BK,
                    GG_BM);
            tma_map(&G->tb, CU_TENSOR_MAP_DATA_TYPE_UINT8, x->b->data, x->n, x->k, x->k, GQ_BK,
                    GQ_BN);
            scale_map(&G->tsa, ja->dst, ja->ld, ja->rows, ja->kb, GG_BM);
            if (vec) scale_map(&G->tsb, jb->dst, jb->ld, jb->rows, jb->kb, GQ_BN);
            G->sb = (const float *)x->b->scale;
            G->c = x->c, G->c16 = (__nv_bfloat16 *)x->c16, G->m = x->m, G->n = x->n;
            G->kb = x->a->scols;
            G->tile0 = tiles, G->tiles_n = (x->n + GQ_BN - 1) / GQ_BN;
            G->alpha = x->alpha, G->beta = x->beta;
            tiles += (x->m + GG_BM - 1) / GG_BM * G->tiles_n;
        }
        P->count = cnt, P->tiles = tiles;
        const int ts = ts_maps(P->g, cnt, cx->gg_tma_store);
        for (int i = 0; i < cnt && !ts; i++)   // gemm_q.cu asked lb_cuda_gemm_q_grouped_ts
            if (P->g[i].c16) lb_die("gemm_q_grouped: a bf16 C in a launch without TMA stores");
        const int grid = tiles < cx->num_sms ? tiles : cx->num_sms;   // persistent blocks
        const int v = 2 * ts + vec;
        void (*kern)(const gq_params) = v == 3 ? gq_kernel<1, 1>
                                        : v == 2 ? gq_kernel<0, 1>
                                        : v == 1 ? gq_kernel<1, 0>
                                                 : gq_kernel<0, 0>;
        if (!smem_set[v]) {   // the limit is the kernel's, set once per process (one device)
            lb_cuda_smem_limit(kern, GQ_SMEM(ts));
            smem_set[v] = 1;
        }
        kern<<<grid, GT_THREADS, GQ_SMEM(ts), cx->stream>>>(*P);
        LB_CUDA_LAUNCHED(cx);
    }
    free(P);
    free(job);
}

// Whether lb_cuda_gemm_experts_q_tc takes x: A fits gq_kernel (1x128 fp8-block rows of k
// bytes), every expert's B is 128x128 fp8-block (n, k) and the experts lie one after another,
// data n k bytes apart (one map over their e n rows) and scales at one stride (linear.c's
// weight cache lays them out so).
extern "C" int lb_cuda_gemm_experts_q_fits(const lb_gemm_experts_args *x)
{
    const lb_qmat *a = x->qa, *b = x->qb;
    if (x->e < 1 || x->e > GX_MAX_E || !lb_cuda_gemm_q_grouped_fits(a, &b[0]) ||
        b[0].brows != 128 || a->rows != x->rows || a->cols != x->k)
        return 0;
    const size_t dstep = (size_t)x->n * x->k;
    const float *s0 = (const float *)b[0].scale;
    const ptrdiff_t sstep = x->e > 1 ? (const float *)b[1].scale - s0 : 0;
    if (sstep < 0 || (x->e > 1 && (size_t)sstep < (size_t)(x->n + 127) / 128 * a->scols))
        return 0;
    for (int j = 0; j < x->e; j++)
        if (b[j].fmt != b[0].fmt || b[j].brows != 128 || b[j].rows != x->n ||
            b[j].cols != x->k || b[j].ld != (size_t)x->k || b[j].scols != a->scols ||
            b[j].data != b[0].data + j * dstep ||
            (const float *)b[j].scale != s0 + j * sstep)
            return 0;
    return 1;
}

template <int BM, int C16>
static void gqx_launch(lb_cuda_ctx *cx, int grid, const gqx_params *P)
{
    static int smem_set;
    if (!smem_set) {
        lb_cuda_smem_limit(gqx_kernel<BM, C16>, GQ_SMEM(0));
        smem_set = 1;
    }
    gqx_kernel<BM, C16><<<grid, GT_THREADS_BM(BM), GQ_SMEM(0), cx->stream>>>(*P);
    LB_CUDA_LAUNCHED(cx);
}

// gemm_experts' fp8-block form on gqx_kernel (x fits, above): queued on cx->stream, no wait.
// 64-row tiles where the mean expert has fewer than 64 rows, as gemm_experts' bf16 form.
extern "C" void lb_cuda_gemm_experts_q_tc(lb_cuda_ctx *cx, const lb_gemm_experts_args *x)
{
    gqx_params P;
    memset(&P, 0, sizeof P);
    const int bm = x->rows < 64 * x->e ? 64 : 128;
    const lb_gemm_q_args g = {x->rows, x->n, x->k, 1.0f, 0.0f, x->qa, &x->qb[0], NULL, NULL};
    gq_st_job job[2];
    memset(job, 0, sizeof job);
    gq_scales_t(cx, 1, &g, 0, job);
    tma_map(&P.ta, CU_TENSOR_MAP_DATA_TYPE_UINT8, x->qa->data, x->rows, x->k, x->k, GQ_BK, bm);
    tma_map(&P.tb, CU_TENSOR_MAP_DATA_TYPE_UINT8, x->qb[0].data, x->e * x->n, x->k, x->k, GQ_BK,
            GQ_BN);
    scale_map(&P.tsa, job[0].dst, job[0].ld, job[0].rows, job[0].kb, bm + 4);
    P.sb = (const float *)x->qb[0].scale;
    P.sstep = x->e > 1 ? (size_t)((const float *)x->qb[1].scale - P.sb) : 0;
    P.c = x->c, P.c16 = (__nv_bfloat16 *)x->c16, P.counts = x->counts, P.err = cx->err_dev;
    P.e = x->e, P.rows = x->rows, P.n = x->n, P.kb = x->qa->scols;
    const long most = ((long)x->rows / bm + x->e) * ((x->n + GQ_BN - 1) / GQ_BN);
    const int grid = most < cx->num_sms ? (int)most : cx->num_sms;
    if (bm == 64) {
        if (P.c16) gqx_launch<64, 1>(cx, grid, &P);
        else gqx_launch<64, 0>(cx, grid, &P);
    } else {
        if (P.c16) gqx_launch<128, 1>(cx, grid, &P);
        else gqx_launch<128, 0>(cx, grid, &P);
    }
}
