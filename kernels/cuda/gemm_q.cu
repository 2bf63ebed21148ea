// gemm_q.cu: C (m, n) = alpha * A (m, k) * B (n, k)^T + beta * C on quantized operands
// (kernels.h gemm_q), on Hopper (sm_90). The CPU reference (kernels/cpu/ops_quant.c) computes
// it in fp32 on the exactly dequantized operands; doc/backends.md states each path's numerics.
//
// Paths by format:
// - fp8-block with 1x128 blocks in A and k a multiple of 16 (every training shape): on sm_90,
//   gemm_grouped.cu's wgmma kernel as a group of one (LB_CUDA_DENSE_TC=0: the next path);
//   gemm_q_grouped sends its fp8-block groups there in one launch.
// - other fp8-block: cuBLASLt's FP8 block scaling on tensor cores (E4M3 x E4M3, fp32 accum.
//   promoted per 128 of K, fp32 output). A 1x128 operand uses CUBLASLT_MATMUL_MATRIX_SCALE_
//   VEC128_32F, a 128x128 operand BLK128x128_32F; cuBLASLt accepts 1D x 1D, 1D x 2D and 2D x 1D
//   (TransformerEngine's rule, which the wgrad's two 1x128 operands need). 2D x 2D, and any
//   combination for which cuBLASLt offers no algorithm (no block scaling before sm_90, none of
//   these modes on sm_100 and later), fall back to dequantizing both operands to fp32 on the
//   device and the fp32 GEMM of gemm.cu, which is what the CPU computes.
// - fp8-tensor: cuBLASLt's FP8 GEMM with one fp32 scale per operand (the default scalar scale
//   mode, the qmat's scale as the scale pointer), fp32 accumulation (no fast accumulation)
//   and output; the same fp32 fallback when it offers no algorithm.
// - MXFP8, MXFP4, NVFP4: no tensor-core path on Hopper. Both operands are dequantized without
//   NVFP4's second level into bf16, which is exact (E4M3, E5M2 and E2M1 elements times a power
//   of two keep at most 4 significant bits, E2M1 x UE4M3 at most 6; bf16 holds 8 and fp32's
//   exponent range; see doc/backends.md for the subnormal corner), and multiplied by cuBLASLt's
//   bf16 tensor-core GEMM with fp32 accumulation and output (products of two bf16 values are
//   exact in fp32). An epilogue applies NVFP4's per-tensor / per-row second levels, alpha and
//   beta with the CPU's expression.
// Compute capability >= 10 (not built or tested here): MXFP8/MXFP4 map onto VEC32_UE8M0 and
// NVFP4 onto VEC16_UE4M3 natively, with the scales rearranged into cuBLASLt's 128x4 tiles and
// NVFP4's second level folded into alpha (per tensor) or the epilogue (per row).
//
// cuBLASLt is column-major: the row-major product is computed as C^T (n, m) = B A^T, so
// cuBLASLt's A is our B, its B our A, "TN" with K contiguous in both (the only FP8 layout
// Hopper's tensor cores take). Operands are padded where cuBLASLt needs it: K to 16 elements
// (16-byte leading dimensions), and for FP8 the rows to 16 (its outer-dimension rule) with
// zero elements; the scale tensors are always rearranged into cuBLASLt's layouts: VEC128_32F
// is (ceil(K/128), rows) with the rows contiguous, BLK128x128_32F (ceil(rows/128),
// roundup(ceil(K/128), 4)) with the K blocks contiguous.
//
// Plans (descriptors, layouts, algorithm) are cached per shape as in gemm.cu. Deterministic
// mode (the default) pins one algorithm per path, chosen once at a reference shape with no
// split-K and no workspace, checked against each shape with cublasLtMatmulAlgoCheck; if it
// refuses a shape the heuristic is asked about (LB_PIN_DIM rows of ours, n, k), so the choice
// never depends on m and a row's result does not depend on the other rows.
#include "kernels/cuda/cuda.cuh"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "kernels/quant/quant.h"
}

#define LB_PIN_DIM 4096

enum { QK_BF16 = 0, QK_FP8_VV, QK_FP8_BV, QK_FP8_VB, QK_FP8_TT, QK_COUNT };   // A' x B' scales
static const char *const qk_name[QK_COUNT] = {"bf16", "fp8 vec128 x vec128",
                                              "fp8 blk128x128 x vec128", "fp8 vec128 x blk128x128",
                                              "fp8 tensor x tensor"};

struct qplan {
    int kind, m, n, k, ldd, det;   // the key, in cuBLASLt's terms (m = our n, n = our m)
    int ok;                        // 0: no algorithm; the caller falls back
    int fallback;                  // deterministic, chosen at (m, LB_PIN_DIM, k)
    lb_lt_descs d;
    cublasLtMatmulAlgo_t algo;
    size_t ws;
};

struct qcache {
    qplan **slot;
    size_t cap, count;
    cublasLtMatmulAlgo_t pinned[QK_COUNT];
    int pinned_state[QK_COUNT];    // 0 not asked yet, 1 found, -1 none
    int warned[QK_COUNT];          // the no-algorithm warning was printed
    long fp8_native, fp8_fallback, emulated;   // calls per path (lb_cuda_gemm_q_stats)
    long fp8_grouped;                          // groups run by gemm_grouped.cu's fp8 kernel
    int cc_major;
};

static qcache *cache_of(lb_cuda_ctx *cx)
{
    if (!cx->gemm_q) cx->gemm_q = lb_calloc(1, sizeof(qcache));
    return (qcache *)cx->gemm_q;
}

static size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

// scale_dummy: a device address for the FP8 scale pointers until a call sets the real ones
// (cuBLASLt answers CUBLAS_STATUS_INVALID_VALUE to block scaling without scale pointers).
static void make_descs(int kind, int m, int n, int k, int ldd, const void *scale_dummy,
                       lb_lt_descs *d)
{
    // A' = our B (n rows of K contiguous) stored (k, m) column-major, transposed; B' = our A,
    // (k, n).
    lb_lt_descs_init(d, 1, 0, kind == QK_BF16 ? CUDA_R_16BF : CUDA_R_8F_E4M3, k, m, k, k, n, k,
                     m, n, ldd);
    if (kind == QK_BF16) return;
    // Per tensor: the default scale mode, one fp32 scalar per operand on the device.
    cublasLtMatmulMatrixScale_t ma = kind == QK_FP8_BV ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                                   : kind == QK_FP8_TT ? CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F
                                                       : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    cublasLtMatmulMatrixScale_t mb = kind == QK_FP8_VB ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                                   : kind == QK_FP8_TT ? CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F
                                                       : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    LB_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d->op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &ma,
                                                   sizeof ma));
    LB_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d->op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mb,
                                                   sizeof mb));
    LB_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                   &scale_dummy, sizeof scale_dummy));
    LB_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                   &scale_dummy, sizeof scale_dummy));
    int8_t fast = 0;   // promote to fp32 (the default, stated: block scaling requires it)
    LB_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d->op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast,
                                                   sizeof fast));
}

// cuBLASLt answers an unsupported combination with NOT_SUPPORTED or INVALID_VALUE (block
// scaling on a device without it); that is not an error here: the caller falls back. Any
// other failure is.
static int unsupported(cublasStatus_t s)
{
    return s == CUBLAS_STATUS_NOT_SUPPORTED || s == CUBLAS_STATUS_INVALID_VALUE;
}

// The heuristic's first answer; 0 when it has none, and *status says why. Preferences: every
// buffer is 16-byte aligned with 16-byte leading dimensions (we pad); deterministic: no
// workspace and no split-K reduction of any scheme.
static int heuristic(lb_cuda_ctx *cx, int kind, int m, int n, int k, int ldd, int det,
                     cublasLtMatmulHeuristicResult_t *r, cublasStatus_t *status)
{
    lb_lt_descs d;
    make_descs(kind, m, n, k, ldd, cx->workspace, &d);
    cublasLtMatmulPreference_t pref = lb_lt_pref(cx, det, 16, 16, 16, LB_LT_IMPL_ALL);
    cublasStatus_t s;
    int found = lb_lt_heuristic(cx, &d, pref, r, &s);
    if (!unsupported(s)) LB_CUBLAS_CHECK(s);   // cublasLtMatmulAlgoGetHeuristic
    LB_CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
    lb_lt_descs_free(&d);
    if (status) *status = s == CUBLAS_STATUS_SUCCESS && !found ? CUBLAS_STATUS_NOT_SUPPORTED : s;
    return found;
}

static int algo_fits(lb_cuda_ctx *cx, const qplan *p, const cublasLtMatmulAlgo_t *algo)
{
    cublasStatus_t s;
    int fits = lb_lt_fits(cx, &p->d, algo, &s);
    if (!unsupported(s)) LB_CUBLAS_CHECK(s);   // cublasLtMatmulAlgoCheck
    return fits;
}

static void log_plan(const qplan *p)
{
    int32_t id = -1;
    uint32_t tile = 0;
    size_t w;
    if (p->ok) {
        LB_CUBLAS_CHECK(cublasLtMatmulAlgoConfigGetAttribute(&p->algo, CUBLASLT_ALGO_CONFIG_ID, &id,
                                                             sizeof id, &w));
        LB_CUBLAS_CHECK(cublasLtMatmulAlgoConfigGetAttribute(
            &p->algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile, &w));
    }
    fprintf(stderr, "cuda gemm_q plan: %s %s m %d n %d k %d ldd %d: %s algo %d tile %u "
                    "workspace %zu\n",
            qk_name[p->kind], p->det ? (p->fallback ? "pinned-nk" : "pinned") : "heuristic",
            p->m, p->n, p->k, p->ldd, p->ok ? "cuBLASLt" : "NO ALGORITHM (fallback path)", id,
            tile, p->ws);
}

static qplan *build_plan(lb_cuda_ctx *cx, const qplan *key)
{
    qcache *qc = cache_of(cx);
    qplan *p = (qplan *)lb_calloc(1, sizeof *p);
    *p = *key;
    make_descs(p->kind, p->m, p->n, p->k, p->ldd, cx->workspace, &p->d);
    cublasLtMatmulHeuristicResult_t r;
    cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
    if (p->det) {
        int kd = p->kind;
        if (!qc->pinned_state[kd]) {
            if (heuristic(cx, kd, LB_PIN_DIM, LB_PIN_DIM, LB_PIN_DIM, LB_PIN_DIM, 1, &r, &st)) {
                qc->pinned[kd] = r.algo;
                lb_lt_no_splitk(&qc->pinned[kd]);
                qc->pinned_state[kd] = 1;
            } else {
                qc->pinned_state[kd] = -1;
            }
        }
        if (qc->pinned_state[kd] == 1 && algo_fits(cx, p, &qc->pinned[kd])) {
            p->algo = qc->pinned[kd];
            p->ok = 1;
        } else if (heuristic(cx, kd, p->m, LB_PIN_DIM, p->k, p->m, 1, &r, &st)) {
            // Chosen at (our n, LB_PIN_DIM rows of ours, k): still independent of our m.
            p->algo = r.algo;
            lb_lt_no_splitk(&p->algo);
            p->ok = algo_fits(cx, p, &p->algo);
            p->fallback = 1;
        }
        p->ws = 0;
    } else if (heuristic(cx, p->kind, p->m, p->n, p->k, p->ldd, 0, &r, &st)) {
        p->algo = r.algo;
        p->ws = r.workspaceSize;
        p->ok = 1;
    }
    if (cx->gemm_log) log_plan(p);
    // Falling back is correct but slow, and on Hopper it would mean the FP8 path is broken:
    // say so once per kind.
    if (!p->ok && !qc->warned[p->kind]) {
        qc->warned[p->kind] = 1;
        fprintf(stderr, "cuda gemm_q: cuBLASLt offers no %s algorithm here (%s, m %d n %d k %d); "
                        "these GEMMs run on the fp32 fallback\n",
                qk_name[p->kind], st == CUBLAS_STATUS_SUCCESS ? "algorithm check failed"
                                                              : cublasLtGetStatusString(st),
                p->m, p->n, p->k);
    }
    return p;
}

static uint64_t plan_hash(const qplan *k)
{
    const int f[] = {k->kind, k->m, k->n, k->k, k->ldd, k->det};
    uint64_t h = 0x51ed270b27a3c6f1ull;
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) h = lb_hash64(h ^ (uint64_t)(uint32_t)f[i]);
    return h;
}

static int plan_same(const qplan *a, const qplan *b)
{
    return a->kind == b->kind && a->m == b->m && a->n == b->n && a->k == b->k &&
           a->ldd == b->ldd && a->det == b->det;
}

static qplan *plan_get(lb_cuda_ctx *cx, const qplan *key)
{
    qcache *qc = cache_of(cx);
    if (qc->cap) {
        for (size_t h = plan_hash(key) & (qc->cap - 1); qc->slot[h]; h = (h + 1) & (qc->cap - 1))
            if (plan_same(qc->slot[h], key)) return qc->slot[h];
    }
    qplan *p = build_plan(cx, key);
    if ((qc->count + 1) * 2 > qc->cap) {   // keep the load under one half
        size_t cap = qc->cap ? qc->cap * 2 : 64;
        qplan **t = (qplan **)lb_calloc(cap, sizeof *t);
        for (size_t i = 0; i < qc->cap; i++) {
            if (!qc->slot[i]) continue;
            size_t h = plan_hash(qc->slot[i]) & (cap - 1);
            while (t[h]) h = (h + 1) & (cap - 1);
            t[h] = qc->slot[i];
        }
        free(qc->slot);
        qc->slot = t;
        qc->cap = cap;
    }
    size_t h = plan_hash(p) & (qc->cap - 1);
    while (qc->slot[h]) h = (h + 1) & (qc->cap - 1);
    qc->slot[h] = p;
    qc->count++;
    return p;
}

extern "C" void lb_cuda_gemm_q_destroy(lb_cuda_ctx *cx)
{
    qcache *qc = (qcache *)cx->gemm_q;
    if (!qc) return;
    for (size_t i = 0; i < qc->cap; i++) {
        qplan *p = qc->slot[i];
        if (!p) continue;
        lb_lt_descs_free(&p->d);
        free(p);
    }
    free(qc->slot);
    free(qc);
    cx->gemm_q = NULL;
}

// --- kernels ---------------------------------------------------------------------------------

// dst (Rp, kp) = src (R, K) with row pitch ld, zero elsewhere (FP8 bytes).
__global__ void pad_bytes_kernel(uint8_t *__restrict__ dst, int Rp, int kp,
                                 const uint8_t *__restrict__ src, int R, int K, size_t ld)
{
    size_t n = (size_t)Rp * kp;
    for (size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x; t < n;
         t += (size_t)gridDim.x * blockDim.x) {
        int r = (int)(t / kp), c = (int)(t % kp);
        dst[t] = r < R && c < K ? src[(size_t)r * ld + c] : 0;
    }
}

// VEC128_32F: dst (KB, Rp), rows contiguous, from our (R, KB) row-major; padded rows get 1.
__global__ void scale_vec_kernel(float *__restrict__ dst, int Rp, int KB,
                                 const float *__restrict__ src, int R)
{
    size_t n = (size_t)KB * Rp;
    for (size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x; t < n;
         t += (size_t)gridDim.x * blockDim.x) {
        int kb = (int)(t / Rp), r = (int)(t % Rp);
        dst[t] = r < R ? src[(size_t)r * KB + kb] : 1.0f;
    }
}

// BLK128x128_32F: dst (SR, KB4), K blocks contiguous, from our (SR, KB) row-major.
__global__ void scale_blk_kernel(float *__restrict__ dst, int SR, int KB4,
                                 const float *__restrict__ src, int KB)
{
    size_t n = (size_t)SR * KB4;
    for (size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x; t < n;
         t += (size_t)gridDim.x * blockDim.x) {
        int i = (int)(t / KB4), j = (int)(t % KB4);
        dst[t] = j < KB ? src[(size_t)i * KB + j] : 1.0f;
    }
}

// The CPU's epilogues (ops_quant.c, gemm.c) on t (m, n) with row pitch ldt:
//   mode 0 (t = A B^T):          c = t * alpha, then + c * beta when beta != 0
//   mode 1 (t = alpha A B^T):    c = t, then + c * beta when beta != 0
//   mode 2 (NVFP4, t = A_blocks B_blocks^T): c = alpha * ((s2a[i] * s2b[j]) * t) +
//                                              (beta != 0 ? beta * c : 0)
__global__ void epilogue_kernel(float *__restrict__ c, int m, int n, const float *__restrict__ t,
                                size_t ldt, int mode, float alpha, float beta,
                                const float *__restrict__ s2a, int s2a_row,
                                const float *__restrict__ s2b, int s2b_row)
{
    size_t total = (size_t)m * n;
    for (size_t q = blockIdx.x * (size_t)blockDim.x + threadIdx.x; q < total;
         q += (size_t)gridDim.x * blockDim.x) {
        int i = (int)(q / n), j = (int)(q % n);
        float tv = t[(size_t)i * ldt + j], o;
        if (mode == 2) {
            float s = __fmul_rn(s2a[s2a_row ? i : 0], s2b[s2b_row ? j : 0]);
            o = __fadd_rn(__fmul_rn(alpha, __fmul_rn(s, tv)),
                          beta != 0.0f ? __fmul_rn(beta, c[q]) : 0.0f);
        } else {
            o = mode == 0 ? __fmul_rn(tv, alpha) : tv;
            if (beta != 0.0f) o = __fadd_rn(o, __fmul_rn(c[q], beta));
        }
        c[q] = o;
    }
}

// --- paths -------------------------------------------------------------------------------------

// q's codes (rows, k) copied into dst (rows_pad, kp), zeros around them (cuBLASLt's FP8
// operands need rows and k in multiples of 16 and 16-byte aligned rows). Returns dst.
static const void *pad_operand(lb_cuda_ctx *cx, uint8_t *dst, int rows_pad, int kp,
                               const lb_qmat *q, int rows, int k)
{
    pad_bytes_kernel<<<lb_grid((size_t)rows_pad * kp, 256, cx), 256, 0, cx->stream>>>(
        dst, rows_pad, kp, q->data, rows, k, q->ld);
    LB_CUDA_LAUNCHED(cx);
    return dst;
}

// q's fp32 block scales in cuBLASLt's layout (n floats at dst): BLK128x128_32F (ceil(rows_pad /
// 128), KB4) for 128x128 blocks (blk), else VEC128_32F (KB, rows_pad).
static void scale_operand(lb_cuda_ctx *cx, float *dst, int blk, size_t n, int rows_pad, int KB,
                          int KB4, const lb_qmat *q, int rows)
{
    if (blk)
        scale_blk_kernel<<<lb_grid(n, 256, cx), 256, 0, cx->stream>>>(
            dst, (rows_pad + 127) / 128, KB4, (const float *)q->scale, KB);
    else
        scale_vec_kernel<<<lb_grid(n, 256, cx), 256, 0, cx->stream>>>(
            dst, rows_pad, KB, (const float *)q->scale, rows);
    LB_CUDA_LAUNCHED(cx);
}

// fp8-block through cuBLASLt block scaling, fp8-tensor through its per-tensor scaling (the
// scalars as they are); 0 when cuBLASLt has no algorithm (2D x 2D blocks, or the device has
// none of these modes): the caller falls back.
static int gemm_fp8_lt(lb_backend *be, int m, int n, int k, float alpha, const lb_qmat *a,
                       const lb_qmat *b, float beta, float *c)
{
    lb_cuda_ctx *cx = lb_cuda(be);
    const int pt = a->fmt == LB_FMT_FP8_TENSOR;
    int a2d = !pt && a->brows == 128, b2d = !pt && b->brows == 128;
    if (a2d && b2d) return 0;   // cuBLASLt has no 2D x 2D block scaling
    // cuBLASLt's A is our B.
    int kind = pt ? QK_FP8_TT : b2d ? QK_FP8_BV : a2d ? QK_FP8_VB : QK_FP8_VV;
    const int Mp = (int)round_up((size_t)n, 16), Np = (int)round_up((size_t)m, 16);
    const int kp = (int)round_up((size_t)k, 16), KB = (k + 127) / 128;
    const int direct = m % 16 == 0 && n % 16 == 0 && ((uintptr_t)c & 15) == 0;
    qplan key;
    memset(&key, 0, sizeof key);
    key.kind = kind, key.m = Mp, key.n = Np, key.k = kp, key.ldd = direct ? n : Mp;
    key.det = be->deterministic ? 1 : 0;
    qplan *p = plan_get(cx, &key);
    if (!p->ok) return 0;
    cache_of(cx)->fp8_native++;

    int pad_b = n % 16 || k % 16 || ((uintptr_t)b->data & 15);
    int pad_a = m % 16 || k % 16 || ((uintptr_t)a->data & 15);
    const int SRb = (Mp + 127) / 128, SRa = (Np + 127) / 128, KB4 = (int)round_up((size_t)KB, 4);
    size_t sz_sb = pt ? 0 : b2d ? (size_t)SRb * KB4 : (size_t)KB * Mp;   // floats
    size_t sz_sa = pt ? 0 : a2d ? (size_t)SRa * KB4 : (size_t)KB * Np;
    size_t off = 0, o_db = 0, o_da = 0, o_sb, o_sa, o_t = 0;
    if (pad_b) { o_db = off; off += lb_align256((size_t)Mp * kp); }
    if (pad_a) { o_da = off; off += lb_align256((size_t)Np * kp); }
    o_sb = off; off += lb_align256(sz_sb * sizeof(float));
    o_sa = off; off += lb_align256(sz_sa * sizeof(float));
    if (!direct) { o_t = off; off += lb_align256((size_t)Np * Mp * sizeof(float)); }
    char *sc = (char *)lb_cuda_scratch(cx, off);

    const void *db = pad_b ? pad_operand(cx, (uint8_t *)(sc + o_db), Mp, kp, b, n, k) : b->data;
    const void *da = pad_a ? pad_operand(cx, (uint8_t *)(sc + o_da), Np, kp, a, m, k) : a->data;
    float *sb = (float *)(sc + o_sb), *sa = (float *)(sc + o_sa);
    if (pt) {   // zero padding needs no scale of its own
        sb = (float *)b->scale;
        sa = (float *)a->scale;
    } else {
        scale_operand(cx, sb, b2d, sz_sb, Mp, KB, KB4, b, n);
        scale_operand(cx, sa, a2d, sz_sa, Np, KB, KB4, a, m);
    }

    LB_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->d.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                   &sb, sizeof sb));
    LB_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->d.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                   &sa, sizeof sa));
    float zero = 0.0f;
    float *d = direct ? c : (float *)(sc + o_t);
    LB_CUBLAS_CHECK(cublasLtMatmul(cx->lt, p->d.op, &alpha, db, p->d.a, da, p->d.b,
                                   direct ? &beta : &zero, d, p->d.c, d, p->d.c, &p->algo,
                                   p->ws ? cx->workspace : NULL, p->ws, cx->stream));
    if (cx->sync_each) LB_CUDA_WAIT(cx);
    if (!direct) {   // d = alpha A B^T (m_pad, n_pad): c = d + beta c
        epilogue_kernel<<<lb_grid((size_t)m * n, 256, cx), 256, 0, cx->stream>>>(
            c, m, n, d, (size_t)Mp, 1, alpha, beta, NULL, 0, NULL, 0);
        LB_CUDA_LAUNCHED(cx);
    }
    return 1;
}

// The fp32 fallback for fp8-block and fp8-tensor: both operands dequantized to fp32 (e * s,
// one rounding, as lb_dequantize_blocks) and gemm.cu's fp32 GEMM: the CPU's own computation.
static void gemm_fp32_dequant(lb_backend *be, int m, int n, int k, float alpha, const lb_qmat *a,
                              const lb_qmat *b, float beta, float *c)
{
    lb_cuda_ctx *cx = lb_cuda(be);
    size_t o_b = lb_align256((size_t)m * k * sizeof(float));
    char *sc = (char *)lb_cuda_scratch(cx, o_b + (size_t)n * k * sizeof(float));
    float *ad = (float *)sc, *bd = (float *)(sc + o_b);
    lb_cuda_dequant_f32(cx, ad, (size_t)k, k, a, 0);
    lb_cuda_dequant_f32(cx, bd, (size_t)k, k, b, 0);
    lb_gemm(be, 0, 1, m, n, k, alpha, ad, bd, beta, c);   // gemm.cu uses no scratch
}

// MXFP8, MXFP4, NVFP4: exact bf16 operands on tensor cores, then the CPU's epilogue.
static void gemm_emulated(lb_backend *be, int m, int n, int k, float alpha, const lb_qmat *a,
                          const lb_qmat *b, float beta, float *c)
{
    lb_cuda_ctx *cx = lb_cuda(be);
    const int kp = (int)round_up((size_t)k, 8), n4 = (int)round_up((size_t)n, 4);
    qplan key;
    memset(&key, 0, sizeof key);
    key.kind = QK_BF16, key.m = n, key.n = m, key.k = kp, key.ldd = n4;
    key.det = be->deterministic ? 1 : 0;
    qplan *p = plan_get(cx, &key);
    int nv = a->fmt == LB_FMT_NVFP4;
    const float *t;
    size_t ldt;
    if (p->ok) {
        size_t o_b = lb_align256((size_t)m * kp * 2), o_t = o_b + lb_align256((size_t)n * kp * 2);
        char *sc = (char *)lb_cuda_scratch(cx, o_t + (size_t)m * n4 * sizeof(float));
        void *abf = sc, *bbf = sc + o_b;
        float *tt = (float *)(sc + o_t);
        lb_cuda_dequant_bf16(cx, abf, (size_t)kp, kp, a, 0);
        lb_cuda_dequant_bf16(cx, bbf, (size_t)kp, kp, b, 0);
        float one = 1.0f, zero = 0.0f;
        LB_CUBLAS_CHECK(cublasLtMatmul(cx->lt, p->d.op, &one, bbf, p->d.a, abf, p->d.b, &zero, tt,
                                       p->d.c, tt, p->d.c, &p->algo,
                                       p->ws ? cx->workspace : NULL, p->ws, cx->stream));
        if (cx->sync_each) LB_CUDA_WAIT(cx);
        t = tt;
        ldt = (size_t)n4;
    } else {   // no bf16 algorithm: exact fp32 operands and the fp32 GEMM
        size_t o_b = lb_align256((size_t)m * k * 4), o_t = o_b + lb_align256((size_t)n * k * 4);
        char *sc = (char *)lb_cuda_scratch(cx, o_t + (size_t)m * n * sizeof(float));
        float *ad = (float *)sc, *bd = (float *)(sc + o_b), *tt = (float *)(sc + o_t);
        lb_cuda_dequant_f32(cx, ad, (size_t)k, k, a, 0);
        lb_cuda_dequant_f32(cx, bd, (size_t)k, k, b, 0);
        lb_gemm(be, 0, 1, m, n, k, 1.0f, ad, bd, 0.0f, tt);
        t = tt;
        ldt = (size_t)n;
    }
    epilogue_kernel<<<lb_grid((size_t)m * n, 256, cx), 256, 0, cx->stream>>>(
        c, m, n, t, ldt, nv ? 2 : 0, alpha, beta, nv ? a->scale2 : NULL, nv && a->nscale2 > 1,
        nv ? b->scale2 : NULL, nv && b->nscale2 > 1);
    LB_CUDA_LAUNCHED(cx);
}

static void cuda_gemm_q(lb_backend *be, int m, int n, int k, float alpha, const lb_qmat *a,
                        const lb_qmat *b, float beta, float *c)
{
    if (a->cols != k || b->cols != k || a->rows != m || b->rows != n)
        lb_die("gemm_q: operands (%d, %d) and (%d, %d) do not fit (%d, %d, k %d)", a->rows,
               a->cols, b->rows, b->cols, m, n, k);
    if (a->fmt != b->fmt) lb_die("gemm_q: operands of different formats (%d, %d)", a->fmt, b->fmt);
    if (m <= 0 || n <= 0) return;
    if (alpha == 0.0f && a->fmt != LB_FMT_NVFP4) {
        // The CPU's GEMM never reads the operands then: C = beta C (beta 0 writes zeros).
        lb_gemm(be, 0, 1, m, n, k, 0.0f, NULL, NULL, beta, c);
        return;
    }
    lb_cuda_ctx *cx = lb_cuda(be);
    switch (a->fmt) {
    case LB_FMT_FP8_BLOCK:
        if (cx->grouped_tc && cx->dense_tc && lb_cuda_gemm_q_grouped_fits(a, b)) {
            // gemm_grouped.cu's fp8 kernel, a group of one: cuBLASLt's pinned algorithms
            // refuse some shapes (the fp32 fallback, 25x slower), and the choice would then
            // depend on m
            lb_gemm_q_args one = {m, n, k, alpha, beta, a, b, c, NULL};
            lb_cuda_gemm_q_grouped_tc(cx, 1, &one);
            cache_of(cx)->fp8_grouped++;
        } else if (!gemm_fp8_lt(be, m, n, k, alpha, a, b, beta, c)) {
            cache_of(lb_cuda(be))->fp8_fallback++;
            gemm_fp32_dequant(be, m, n, k, alpha, a, b, beta, c);
        }
        break;
    case LB_FMT_FP8_TENSOR:
        if (!gemm_fp8_lt(be, m, n, k, alpha, a, b, beta, c)) {
            cache_of(lb_cuda(be))->fp8_fallback++;
            gemm_fp32_dequant(be, m, n, k, alpha, a, b, beta, c);
        }
        break;
    case LB_FMT_MXFP8:
    case LB_FMT_MXFP4:
    case LB_FMT_NVFP4:
        cache_of(cx)->emulated++;
        if (cx->grouped_tc && cx->dense_tc) {
            // gemm_grouped.cu's bf16 kernel, a group of one, as gemm_q_grouped runs them: the
            // same bits alone or among groups, whatever m
            lb_gemm_q_args one = {m, n, k, alpha, beta, a, b, c, NULL};
            lb_cuda_gemm_q_grouped_bf16(cx, 1, &one);
        } else {
            gemm_emulated(be, m, n, k, alpha, a, b, beta, c);
        }
        break;
    default:
        lb_die("gemm_q: format %d has no quantized GEMM", (int)a->fmt);
    }
}

// fp8-block groups that gemm_grouped.cu's kernel takes run in one launch per block shape of B
// (128x128 weights, 1x128 for the wgrad's operands); MXFP8, MXFP4 and NVFP4 groups on its bf16
// kernel in one launch (the path cuda_gemm_q takes for them); the others through cuda_gemm_q
// one by one. Whether a group fits depends on k, its layouts and the device (never on m), so a
// row's path, and its bits, never depend on how many rows share its group.
// A bf16 C (c16): the fp8 kernel stores it where its launches store by TMA; every other group
// with one writes an fp32 C into lb_cuda_c32, rounded into c16 after the launches (the same
// bits: c16 is the fp32 C rounded once either way).
static void cuda_gemm_q_grouped(lb_backend *be, int count, const lb_gemm_q_args *g)
{
    lb_cuda_ctx *cx = lb_cuda(be);
    const size_t bytes = (size_t)(count > 0 ? count : 1) * sizeof(lb_gemm_q_args);
    lb_gemm_q_args *run[3], *all = (lb_gemm_q_args *)lb_malloc(bytes);
    for (int v = 0; v < 3; v++) run[v] = (lb_gemm_q_args *)lb_malloc(bytes);
    int nrun[3] = {0, 0, 0};   // [0]: B with 128x128 blocks, [1]: with 1x128 blocks, [2]: MX/NV
    // each group's path: -1 none (m or n 0), 0 and 1 as run's, 2 MX/NV, 3 cuda_gemm_q alone
    int *path = (int *)lb_malloc((size_t)(count > 0 ? count : 1) * sizeof(int));
    for (int i = 0; i < count; i++) {
        const lb_gemm_q_args *x = &g[i];
        all[i] = *x, path[i] = -1;
        if (x->m < 0 || x->n < 0 || x->k < 0)
            lb_die("gemm_q_grouped: negative size (m %d, n %d, k %d)", x->m, x->n, x->k);
        if (x->c16 && (x->beta != 0.0f || ((uintptr_t)x->c16 & 3)))
            lb_die("gemm_q_grouped: group %d: a bf16 output (c16) needs beta 0 and 4-byte "
                   "alignment (beta %g, c16 %p)", i, (double)x->beta, (void *)x->c16);
        if (x->m == 0 || x->n == 0) continue;
        if (x->a->cols != x->k || x->b->cols != x->k || x->a->rows != x->m || x->b->rows != x->n)
            lb_die("gemm_q_grouped: group %d: operands (%d, %d) and (%d, %d) do not fit "
                   "(%d, %d, k %d)", i, x->a->rows, x->a->cols, x->b->rows, x->b->cols, x->m,
                   x->n, x->k);
        const lb_format f = x->a->fmt;
        const int mxnv = f == LB_FMT_MXFP8 || f == LB_FMT_MXFP4 || f == LB_FMT_NVFP4;
        if (mxnv && x->b->fmt == f && cx->grouped_tc && cx->dense_tc &&
            (x->alpha != 0.0f || f == LB_FMT_NVFP4))   // as cuda_gemm_q
            path[i] = 2;
        else if (cx->grouped_tc && x->alpha != 0.0f && lb_cuda_gemm_q_grouped_fits(x->a, x->b))
            path[i] = x->b->brows == 1;
        else
            path[i] = 3;
    }
    // which c16 groups go through lb_cuda_c32: all but those of an fp8 launch set that stores by
    // TMA (a launch set is the groups of one block shape; ts is decided over all of it)
    int ts[2];
    for (int v = 0; v < 2; v++) {
        int n = 0;
        for (int i = 0; i < count; i++)
            if (path[i] == v) run[v][n++] = all[i];
        ts[v] = lb_cuda_gemm_q_grouped_ts(cx, n, run[v]);
    }
    size_t c32n = 0;
    for (int i = 0; i < count; i++)
        if (path[i] >= 0 && all[i].c16 && !(path[i] < 2 && ts[path[i]]))
            c32n += (size_t)all[i].m * all[i].n;
    float *c32 = c32n ? lb_cuda_c32(cx, c32n) : NULL;   // before any launch: it may wait
    size_t off = 0;
    for (int i = 0; i < count; i++) {
        lb_gemm_q_args *x = &all[i];
        if (path[i] < 0) continue;
        if (x->c16 && !(path[i] < 2 && ts[path[i]])) {
            x->c = c32 + off, off += (size_t)x->m * x->n;
            x->c16 = NULL;   // rounded into g[i].c16 below
        }
        if (path[i] == 3) {
            cuda_gemm_q(be, x->m, x->n, x->k, x->alpha, x->a, x->b, x->beta, x->c);
        } else {
            run[path[i]][nrun[path[i]]++] = *x;
            if (path[i] == 2) cache_of(cx)->emulated++;
        }
    }
    for (int v = 0; v < 2; v++) {
        if (nrun[v]) lb_cuda_gemm_q_grouped_tc(cx, nrun[v], run[v]);
        cache_of(cx)->fp8_grouped += nrun[v];
    }
    if (nrun[2]) lb_cuda_gemm_q_grouped_bf16(cx, nrun[2], run[2]);
    for (int i = 0; i < count; i++)   // after every launch: one stream
        if (path[i] >= 0 && g[i].c16 && !all[i].c16)
            lb_cuda_store_c16(cx, g[i].c16, all[i].c, g[i].m, g[i].n);
    for (int v = 0; v < 3; v++) free(run[v]);
    free(all), free(path);
    if (cx->sync_each) LB_CUDA_WAIT(cx);
}

// For tests/test_backend_ops.c: how many gemm_q calls took each path, and the device's compute
// capability (the FP8 block-scaled path must be taken on 9.x).
extern "C" void lb_cuda_gemm_q_stats(lb_backend *be, long *fp8_native, long *fp8_fallback,
                                     long *emulated, long *fp8_grouped, int *cc_major)
{
    qcache *qc = cache_of(lb_cuda(be));
    if (!qc->cc_major) {
        cudaDeviceProp prop;
        LB_CUDA_CHECK(cudaGetDeviceProperties(&prop, lb_cuda(be)->device));
        qc->cc_major = prop.major;
    }
    *fp8_native = qc->fp8_native;
    *fp8_fallback = qc->fp8_fallback;
    *emulated = qc->emulated;
    *fp8_grouped = qc->fp8_grouped;
    *cc_major = qc->cc_major;
}

extern "C" void lb_cuda_init_gemm_q(lb_backend *be)
{
    be->gemm_q = cuda_gemm_q;
    be->gemm_q_grouped = cuda_gemm_q_grouped;
}
