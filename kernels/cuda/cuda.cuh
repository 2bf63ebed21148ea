// cuda.cuh: internal declarations shared by the files of the CUDA backend (kernels/cuda).
//
// Every CUDA runtime and cuBLASLt call goes through LB_CUDA_CHECK / LB_CUBLAS_CHECK, which
// print "file:line: call: error" through lb_die and end the process (the whole MPI job when
// one runs). Kernel launches are followed by LB_CUDA_LAUNCHED(cx), which checks the launch and,
// with LB_CUDA_SYNC=1 in the environment, waits for the kernel so a fault names its launch.
//
// Work is queued on the backend's one stream, so operations are ordered among themselves and
// with the memory functions; only the functions that return host values wait.
#ifndef LB_CUDA_CUH
#define LB_CUDA_CUH

#include <cublasLt.h>
#include <cuda.h>   // CUtensorMap
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

extern "C" {
#include "kernels/common.h"
#include "kernels/kernels.h"
}

#define LB_CUDA_CHECK(call)                                                                   \
    do {                                                                                      \
        cudaError_t e_ = (call);                                                              \
        if (e_ != cudaSuccess)                                                                \
            lb_die_at(__FILE__, __LINE__, "%s: %s (%s)", #call, cudaGetErrorString(e_),       \
                      cudaGetErrorName(e_));                                                  \
    } while (0)

#define LB_CUBLAS_CHECK(call)                                                                 \
    do {                                                                                      \
        cublasStatus_t s_ = (call);                                                           \
        if (s_ != CUBLAS_STATUS_SUCCESS)                                                      \
            lb_die_at(__FILE__, __LINE__, "%s: %s (%d)", #call, cublasLtGetStatusString(s_),  \
                      (int)s_);                                                               \
    } while (0)

// After every kernel launch: launch errors now, execution errors at once under LB_CUDA_SYNC.
#define LB_CUDA_LAUNCHED(cx)                                                                  \
    do {                                                                                      \
        LB_CUDA_CHECK(cudaGetLastError());                                                    \
        if ((cx)->sync_each) lb_cuda_wait((cx), __FILE__, __LINE__);                          \
    } while (0)

// Errors found by kernels in their inputs (a negative token, an expert index out of range...).
// A kernel cannot stop the process, so it records the first one in a device word, skips the
// bad element (writing NaN where it has an output), and the host reports it, with the
// operation's name and the offending value, at the next point where it waits for the stream.
enum {
    LB_CERR_NONE = 0,
    LB_CERR_EMB_FWD_TOKEN,      // embedding_fwd: negative token
    LB_CERR_EMB_BWD_TOKEN,      // embedding_bwd: negative token
    LB_CERR_ROUTER_LOGIT,       // router_topk_fwd: non-finite logit
    LB_CERR_ROUTER_BWD_IDX,     // router_topk_bwd: expert index out of range
    LB_CERR_AUX_IDX,            // moe_aux_loss: expert index out of range
    LB_CERR_PLAN_IDX,           // moe_plan: expert index out of range
    LB_CERR_PERMUTE_ROW,        // moe_permute: row out of range
    LB_CERR_PERMUTE_BWD_ROW,    // moe_permute_bwd: row out of range
    LB_CERR_COMBINE_ROW,        // moe_combine: row out of range
    LB_CERR_COMBINE_BWD_ROW,    // moe_combine_bwd: row out of range
    LB_CERR_CE_FWD_TARGET,      // cross_entropy_fwd: target >= v
    LB_CERR_CE_BWD_TARGET,      // cross_entropy_bwd: target >= v
    LB_CERR_KV_ROW,             // kv_append, attention_cached: slot or position outside the cache
    LB_CERR_EXPERTS_ROWS,       // gemm_experts: the counts pass the rows given
    LB_CERR_COUNT
};

// The device word holds (code << 32) | (uint32) value; the first error wins (atomicCAS on an
// error flag, not a reduction: no number depends on it).
__device__ __forceinline__ void lb_report(unsigned long long *err, int code, int value)
{
    unsigned long long w = ((unsigned long long)(unsigned)code << 32) | (unsigned)value;
    atomicCAS(err, 0ull, w);
}

// Cross-entropy's d loss / d logit x in a row with max m and 1 / sum inv (ops_optim.cu's
// backward, and the LM head's fused one in gemm_grouped.cu: the same bits).
__device__ __forceinline__ float lb_ce_grad(float x, float m, double inv, float dloss, bool target)
{
    const double p = (double)expf(x - m) * inv;
    return (float)((double)dloss * (p - (target ? 1.0 : 0.0)));
}

// The bf16 bits of x, nearest even, quiet NaN kept (kernels/common.c lb_f32_to_bf16's bits).
__device__ __forceinline__ uint32_t round_bf16_bits(float x)
{
    const uint32_t u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return u >> 16 | 0x40u;   // quiet NaN
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// Four values' bf16 bits in 8 bytes, in order (a 16-byte fp32 load's copy).
__device__ __forceinline__ uint2 bf16x4_bits(float4 v)
{
    return make_uint2(round_bf16_bits(v.x) | round_bf16_bits(v.y) << 16,
                      round_bf16_bits(v.z) | round_bf16_bits(v.w) << 16);
}

// The zeros after a row's c values in to_bf16's layout (pitch pad8(c)), by the warp's lanes.
__device__ __forceinline__ void bf16_row_pad(uint16_t *row16, int c, int lane)
{
    for (int j = c + lane; j < ((c + 7) & ~7); j += 32) row16[j] = 0;
}

// An op's input row r (kernels.h: the ..16 inputs): fp32 of pitch cols, or, where x16 is
// not NULL, its bf16 copy of pitch pad8(cols), widened (exact). One value at column j, or four
// at columns 4 j .. 4 j + 3 (16-byte fp32 loads, 8-byte bf16 ones).
__device__ __forceinline__ float lb_in_ld(const float *x, const uint16_t *x16, size_t r,
                                          int cols, int j)
{
    if (x16) return __uint_as_float((uint32_t)x16[r * ((cols + 7) & ~7) + j] << 16);
    return x[r * cols + j];
}
__device__ __forceinline__ float4 lb_in_ld4(const float *x, const uint16_t *x16, size_t r,
                                            int cols, int j)
{
    if (x16) {
        const uint2 u = ((const uint2 *)(x16 + r * ((cols + 7) & ~7)))[j];
        return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u),
                           __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
    }
    return ((const float4 *)(x + r * cols))[j];
}

typedef struct lb_gemm_plan lb_gemm_plan;

// Backend-private state (lb_backend.ctx).
typedef struct {
    int device;
    int num_sms;
    int sync_each;                 // LB_CUDA_SYNC=1: wait and check after every launch
    cudaStream_t stream;           // every operation and copy is queued here

    cublasLtHandle_t lt;
    void *workspace;               // cuBLASLt workspace (non-deterministic mode only)
    size_t workspace_bytes;
    lb_gemm_plan **plans;          // open-addressing hash map of GEMM plans (gemm.cu)
    size_t plan_cap, plan_count;
    cublasLtMatmulAlgo_t pinned[8];   // deterministic mode: one algorithm per (bf16, transa, transb)
    int pinned_ready[8];              // 1 found, -1 none (bf16: the fp32 path then)
    int bf16_tc;                   // GEMMs marked bf16 on bf16 tensor cores (LB_CUDA_BF16=0: off)
    int grouped_tc;                // bf16 and fp8-block groups in one wgmma launch
                                   // (gemm_grouped.cu); sm_90 only, LB_CUDA_GROUPED=0: off
    int grouped_bn;                // the bf16 kernel's tile columns, 128 or 256 (LB_CUDA_GROUPED_BN)
    int gg_tma_store;              // its beta-0 epilogue by TMA (LB_CUDA_GG_TMA_STORE=0: off)
    int attn_wg;                   // bf16 attention forward and backward on wgmma (head dims 64, 128;
                                   // sm_90 only; LB_CUDA_ATTN_WG=0: mma.sync)
    int attn_ds;                   // their backward's dq from the dS the dk/dv kernel stores
                                   // (LB_CUDA_ATTN_DS=0: the dq kernel recomputes it)
    size_t attn_chunk;             // bytes of the bf16 backward's operands and dS tiles per
                                   // launch: it takes the batch in chunks that fit
                                   // (LB_CUDA_ATTN_CHUNK, default 1.5 GiB; 0: whole)
    int attn_split;                // attention_cached over a bf16 cache: W warps a (token, kv
                                   // head) (LB_CUDA_ATTN_SPLIT=0: one, tc_cached16_kernel)
    int dense_tc;                  // dense bf16 and fp8-block GEMMs on those kernels too
                                   // (LB_CUDA_DENSE_TC=0: off)
    int grouped_streams;           // LB_CUDA_GROUPED_STREAMS=1: bf16 groups on side streams
    cudaStream_t side[4];          // gemm_grouped's concurrent groups (created on first use)
    cudaEvent_t fork, join[4];
    int side_ready;
    int gemm_log;                  // LB_CUDA_GEMM_LOG=1: print every new plan to stderr
    void *gemm_q;                  // gemm_q.cu: its plan cache and pinned algorithms
    float *gemm_c32;               // gemm.cu: the fp32 C of a bf16-output (c16) GEMM off the
    size_t gemm_c32_bytes;         // wgmma kernel, before its rounding (grow-only; not scratch,
                                   // which the GEMM's operand copies take)

    unsigned long long mem_gen;    // counts device allocations and frees (graph_launch's test)
    unsigned long long waits;      // counts the host's waits for the stream (graph_record's)
    int graphs;                    // graph_record records (LB_CUDA_GRAPHS=0, LB_CUDA_SYNC,
                                   // LB_CUDA_PROFILE_SAMPLE: off, the caller runs eagerly)
    void *scratch;                 // device scratch, grown on demand (lb_cuda_scratch)
    size_t scratch_bytes;
    void *host_stage;              // pinned host memory for small results (sums, counts)
    size_t host_stage_bytes;
    unsigned long long *err_dev;   // the input-error word (see LB_CERR_*)
    unsigned long long *err_host;  // pinned copy read after each wait
} lb_cuda_ctx;

static inline lb_cuda_ctx *lb_cuda(lb_backend *be) { return (lb_cuda_ctx *)be->ctx; }

// --- lt.cu: the cuBLASLt pieces of gemm.cu and gemm_q.cu. A problem's descriptors: the
// operation and cuBLASLt's A, B and C layouts (D is laid out as C).
typedef struct {
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, c;
} lb_lt_descs;
#define LB_LT_IMPL_ALL (~(uint64_t)0)   // lb_lt_pref: every numerical implementation
extern "C" {
// fp32 compute and scale, cuBLASLt's A and B transposed where trans_a, trans_b; A (a_rows,
// a_cols, lda) and B of element type ty, C fp32, all column-major as cuBLASLt stores them.
void lb_lt_descs_init(lb_lt_descs *d, int trans_a, int trans_b, cudaDataType_t ty,
                      uint64_t a_rows, uint64_t a_cols, int64_t lda, uint64_t b_rows,
                      uint64_t b_cols, int64_t ldb, uint64_t c_rows, uint64_t c_cols, int64_t ldc);
void lb_lt_descs_free(const lb_lt_descs *d);
// The heuristic's preferences: operands aligned to al_a, al_b bytes, C and D to al_c; the
// workspace, or with det none and no split-K reduction of any scheme; only the numerical
// implementations in impl (LB_LT_IMPL_ALL: no restriction).
cublasLtMatmulPreference_t lb_lt_pref(const lb_cuda_ctx *cx, int det, uint32_t al_a,
                                      uint32_t al_b, uint32_t al_c, uint64_t impl);
// The heuristic's first answer for d under pref in *r: 1 when it offers one. *status (where
// not NULL) is the call's own status, for the caller to judge.
int lb_lt_heuristic(const lb_cuda_ctx *cx, const lb_lt_descs *d, cublasLtMatmulPreference_t pref,
                    cublasLtMatmulHeuristicResult_t *r, cublasStatus_t *status);
// Whether algo runs d's problem without workspace (deterministic mode's rule); *status as above.
int lb_lt_fits(const lb_cuda_ctx *cx, const lb_lt_descs *d, const cublasLtMatmulAlgo_t *algo,
               cublasStatus_t *status);
// Pins split-K to 1 and the reduction scheme to NONE on an algorithm (the heuristic already
// chose so under deterministic preferences; this makes the rule explicit).
void lb_lt_no_splitk(cublasLtMatmulAlgo_t *algo);
}

// E4M3 code to float, exact (kernels/quant's lb_decode): 0x7f/0xff NaN, no infinities. The fp8
// KV cache's reads (ops_attention.cu, attention_tc.cu).
__device__ __forceinline__ float lb_e4m3_decode(uint8_t c)
{
    const int e = (c >> 3) & 15, m = c & 7;
    float v;
    if (e == 15 && m == 7) v = __int_as_float(0x7fc00000);
    else if (e == 0) v = (float)m * 0.001953125f;            // subnormal: m * 2^-9
    else v = __int_as_float(((e + 120) << 23) | (m << 20));  // (1 + m/8) * 2^(e - 7)
    return (c & 0x80) ? -v : v;
}

// Raises a kernel's dynamic shared-memory limit when it needs more than the default 48 KB.
template <typename K> static inline void lb_cuda_smem_limit(K kernel, size_t bytes)
{
    if (bytes > 48 * 1024)
        LB_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)bytes));
}

// Functions shared between the files of this backend have C linkage like its entry point.
extern "C" {
// Waits for the stream and reports any input error the kernels recorded (backend.cu).
void lb_cuda_wait(lb_cuda_ctx *cx, const char *file, int line);
#define LB_CUDA_WAIT(cx) lb_cuda_wait((cx), __FILE__, __LINE__)
// Device scratch of at least `bytes`, valid until the next call (it may wait and reallocate).
void *lb_cuda_scratch(lb_cuda_ctx *cx, size_t bytes);
// cudaMalloc (async: on cx's stream) of bytes for `what`; a failure stops the job with what,
// how much and where `lowbit info` tells the settings that lower it.
void *lb_cuda_malloc_what(lb_cuda_ctx *cx, size_t bytes, int async, const char *what);
// Pinned host staging of at least `bytes`, for results an operation returns to the host.
void *lb_cuda_host_stage(lb_cuda_ctx *cx, size_t bytes);
}

// Carves consecutive 256-byte aligned pieces out of one scratch request.
static inline size_t lb_align256(size_t x) { return (x + 255) & ~(size_t)255; }

// Grid for a grid-stride loop over n items with `threads` per block: enough blocks to fill
// the chip several times over, never more than the items need. Elementwise results never
// depend on the grid (each element is computed by one thread, the same way).
static inline unsigned lb_grid(size_t n, int threads, const lb_cuda_ctx *cx)
{
    size_t want = (n + threads - 1) / threads, cap = (size_t)cx->num_sms * 16;
    if (want < 1) want = 1;
    return (unsigned)(want < cap ? want : cap);
}

// --- element access: activations are fp32 today; bf16 storage comes with the precision
// contract. Kernels that read or write activations are templated on the stored type T and
// compute in fp32 through these.
__device__ __forceinline__ float lb_ld(const float *p) { return *p; }
__device__ __forceinline__ float lb_ld(const __nv_bfloat16 *p) { return __bfloat162float(*p); }
__device__ __forceinline__ void lb_st(float *p, float v) { *p = v; }
__device__ __forceinline__ void lb_st(__nv_bfloat16 *p, float v) { *p = __float2bfloat16(v); }

// --- fixed-shape reductions. Each is a function of its inputs and of the block size alone
// (a compile-time constant at every use), never of the grid or of timing, so results are
// bitwise reproducible.

// Every lane ends with the same value: the xor butterfly combines the same two partial sums
// on both lanes of each pair, and a + b == b + a in IEEE arithmetic.
template <typename T> __device__ __forceinline__ T lb_warp_sum(T v)
{
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float lb_warp_max(float v)
{
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a block of THREADS threads (a multiple of 32, at most 1024); every thread gets the
// total. Uses 32 doubles of shared memory; ends with a barrier so it can be called again.
template <int THREADS> __device__ __forceinline__ double lb_block_sum(double v)
{
    __shared__ double part[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = lb_warp_sum(v);
    if (lane == 0) part[warp] = v;
    __syncthreads();
    double t = lane < THREADS / 32 ? part[lane] : 0.0;
    t = lb_warp_sum(t);
    __syncthreads();
    return t;
}
template <int THREADS> __device__ __forceinline__ float lb_block_max(float v)
{
    __shared__ float part[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = lb_warp_max(v);
    if (lane == 0) part[warp] = v;
    __syncthreads();
    float t = lane < THREADS / 32 ? part[lane] : -INFINITY;
    t = lb_warp_max(t);
    __syncthreads();
    return t;
}

// The group of a one-launch grouped kernel that block t works for: the last of g[0 .. count)
// whose first tile (member tile0, ascending) is <= t. A binary search: up to 240 groups.
template <typename G> __device__ __forceinline__ const G &lb_group_of(const G *g, int count, int t)
{
    int lo = 0, hi = count - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (g[mid].tile0 <= t) lo = mid;
        else hi = mid - 1;
    }
    return g[lo];
}

// --- Hopper's asynchronous copies: mbarriers and the tensor-memory accelerator (TMA). A TMA copy
// completes its bytes on an mbarrier; waiters spin on the barrier's phase parity.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void lb_mbar_init(uint32_t bar, int count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}

__device__ __forceinline__ void lb_mbar_wait(uint32_t bar, int parity)
{
    asm volatile(
        "{\n.reg .pred p;\nWAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}

__device__ __forceinline__ void lb_mbar_arrive(uint32_t bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// One arrival that also announces `bytes` of copies to complete on bar.
__device__ __forceinline__ void lb_mbar_expect(uint32_t bar, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}
#endif

// Installers, one per file (as the CPU backend's lb_cpu_init_*).
extern "C" {
void lb_cuda_init_gemm(lb_backend *be);        // gemm.cu
void lb_cuda_init_basic(lb_backend *be);       // ops_basic.cu
void lb_cuda_init_attention(lb_backend *be);   // ops_attention.cu
void lb_cuda_init_moe(lb_backend *be);         // ops_moe.cu
void lb_cuda_init_optim(lb_backend *be);       // ops_optim.cu
void lb_cuda_gemm_destroy(lb_cuda_ctx *cx);    // gemm.cu: frees the plan cache
void lb_cuda_init_quant(lb_backend *be);       // quant.cu: qmat, quantize, dequantize, Hadamard, bf16
void lb_cuda_init_gemm_q(lb_backend *be);      // gemm_q.cu
void lb_cuda_init_sample(lb_backend *be);      // ops_sample.cu
void lb_cuda_gemm_q_destroy(lb_cuda_ctx *cx);  // gemm_q.cu: frees its plan cache
// quant.cu: y (q rows, ocols >= q cols; row pitch ldy elements) = q dequantized (NVFP4 with
// its second level when with_s2), zero in the columns beyond q cols; fp32 or bf16. Queued.
void lb_cuda_dequant_f32(lb_cuda_ctx *cx, float *y, size_t ldy, int ocols,
                         const struct lb_qmat *q, int with_s2);
void lb_cuda_dequant_bf16(lb_cuda_ctx *cx, void *y, size_t ldy, int ocols,
                          const struct lb_qmat *q, int with_s2);
// quant.cu: matrices dequantized to bf16 (y as above, 16-byte aligned, ocols and ldy multiples
// of 8), without NVFP4's second level: one launch per run of up to 64 consecutive jobs of one
// format and element type. Queued.
typedef struct {
    const struct lb_qmat *q;
    void *y;
    size_t ldy;
    int ocols;
} lb_cuda_dq_job;
void lb_cuda_dequant_bf16_groups(lb_cuda_ctx *cx, int count, const lb_cuda_dq_job *jobs);
// Column sums of per-chunk partials, used by the deterministic column reductions
// (ops_basic.cu): out[j] = sum over ch in a fixed tree of part[ch * c + j], ch < nchunks.
// If dst is not NULL, dst[j] += (float)out[j] instead of writing out. work: device memory of
// lb_cuda_colsum_work(nchunks, c) bytes (none for a few hundred chunks or fewer).
size_t lb_cuda_colsum_work(int nchunks, int c);
void lb_cuda_colsum_partials(lb_cuda_ctx *cx, const double *part, int nchunks, int c,
                             double *work, double *out, float *dst);
// attention_tc.cu: the bf16 tensor-core attention (kernels.h, attention_* with bf16 = 1),
// called by ops_attention.cu after its argument checks; d <= 128. Queued on cx->stream.
// The forward takes its work memory from lb_cuda_scratch; the backward from `work`, of
// lb_cuda_attention_tc_work bytes (the caller's scratch also holds D): a chunk of the batch's
// (cx->attn_chunk), the chunks one after another, each the bits of the whole.
// q16, k16, v16: NULL, or that input in bf16 (kernels.h), read instead of the fp32 one;
// out16: NULL, or where the output goes in bf16 instead of out.
void lb_cuda_attention_tc_fwd(lb_cuda_ctx *cx, float *out, uint16_t *out16, float *lse,
                              const float *q, const uint16_t *q16, const float *k,
                              const uint16_t *k16, const float *v, const uint16_t *v16, int b,
                              int t, int hq, int hkv, int d);
size_t lb_cuda_attention_tc_work(const lb_cuda_ctx *cx, int b, int t, int hq, int hkv, int d);
void lb_cuda_attention_tc_bwd(lb_cuda_ctx *cx, float *dq, float *dk, float *dv,
                              const float *dout, const float *q, const uint16_t *q16,
                              const float *k, const uint16_t *k16, const float *v,
                              const uint16_t *v16, const float *lse, const float *D, void *work,
                              int b, int t, int hq, int hkv, int d);
// gemm_grouped.cu: the tensor map of a rank-dimensional tensor of dt elements at x (16-byte
// aligned): dims[0] elements contiguous, pitch[i] bytes between steps of dimension i + 1, boxes
// of box[] (box[0] elements are 128 bytes) in the 128-byte swizzle; reads outside dims give
// zeros. Dies if the driver refuses it.
void lb_cuda_tma_map(CUtensorMap *map, CUtensorMapDataType dt, const void *x, int rank,
                     const uint64_t *dims, const uint64_t *pitch, const uint32_t *box);
// gemm_grouped.cu: whether the device runs its kernel; the groups g[0 .. count), every one
// bf16 with m, n, k > 0 and alpha != 0, in one launch (after one packing launch). Queued.
int lb_cuda_gemm_grouped_tc_ok(int major, int minor);
void lb_cuda_gemm_grouped_tc(lb_cuda_ctx *cx, int count, const lb_gemm_args *g);
// gemm_experts on the same kernel's steps, the counts read on the device (sm_90a), for at
// most GX_MAX_E experts a layer
#define GX_MAX_E 512
void lb_cuda_gemm_experts_tc(lb_cuda_ctx *cx, const lb_gemm_experts_args *x);
// its fp8-block form (gq_kernel's steps): whether x's operands fit, and the launch
int lb_cuda_gemm_experts_q_fits(const lb_gemm_experts_args *x);
void lb_cuda_gemm_experts_q_tc(lb_cuda_ctx *cx, const lb_gemm_experts_args *x);
// gemm_grouped.cu: linear_ce_bwd (kernels.h) on that kernel, n, v, c > 0, the gradient
// computed by the pack from the logits and the forward's stats. Queued.
void lb_cuda_linear_ce_bwd_tc(lb_cuda_ctx *cx, float *dx, float dx_beta, float *dw,
                              float dw_beta, const float *logits, const double *stats,
                              const int32_t *targets, float dloss, const float *x,
                              const float *w, const uint16_t *w16, int n, int v, int c);
// gemm_grouped.cu, fp8-block: whether its kernel takes a x b (layouts, not m); the groups
// g[0 .. count), all fitting, m, n, k > 0, alpha != 0, one block shape of b, in one launch.
int lb_cuda_gemm_q_grouped_fits(const struct lb_qmat *a, const struct lb_qmat *b);
void lb_cuda_gemm_q_grouped_tc(lb_cuda_ctx *cx, int count, const lb_gemm_q_args *g);
// Whether a launch of those groups stores C by TMA (its c16 groups then bf16 natively).
int lb_cuda_gemm_q_grouped_ts(const lb_cuda_ctx *cx, int count, const lb_gemm_q_args *g);
// gemm.cu: the grow-only fp32 C of calls with a bf16 output that their path cannot store in
// bf16 (at least n floats; waits for queued work before it grows), and the rounding of such
// a C (rows, cols) into c16 (pitch pad8(cols), pads not written). Queued.
float *lb_cuda_c32(lb_cuda_ctx *cx, size_t n);
void lb_cuda_store_c16(lb_cuda_ctx *cx, uint16_t *c16, const float *c, int rows, int cols);
// gemm_grouped.cu, MXFP8, MXFP4, NVFP4: the groups g[0 .. count) (m, n, k > 0, each a's and
// b's formats equal) dequantized to bf16 and run on the bf16 kernel, NVFP4's second levels in
// its epilogue. Queued.
void lb_cuda_gemm_q_grouped_bf16(lb_cuda_ctx *cx, int count, const lb_gemm_q_args *g);
void lb_cuda_attention_tc_cached(lb_cuda_ctx *cx, float *out, const float *q,
                                 const lb_kv_layer *c, const int32_t *slot,
                                 const int32_t *pos, int n, int hq);
}

#endif
