// gemm.cu: fp32 GEMM through cuBLASLt, with a per-shape plan cache and, in deterministic mode,
// one pinned algorithm per transpose combination.
//
// C (m, n) = alpha op(A) (m, k) op(B) (k, n) + beta C, row-major (kernels.h). cuBLASLt is
// column-major, and a row-major (r, c) matrix is the column-major (c, r) matrix with the same
// bytes, so the product is computed as its transpose: C^T (n, m) = op(B)^T op(A)^T, i.e.
// cuBLASLt's "A" is our B and its "B" is our A, each with its own transpose flag.
//
// Compute type CUBLAS_COMPUTE_32F with fp32 operands: plain fp32 FFMA kernels, no TF32 (that
// would be CUBLAS_COMPUTE_32F_FAST_TF32), so results stay within fp32 rounding of the CPU.
//
// Plans: the matmul descriptor, the three layouts and the chosen algorithm are built once per
// (transa, transb, m, n, k, alignments, mode) and kept in an open-addressing hash map; a call
// with a known shape only looks its plan up and launches.
//
// Deterministic mode (be->deterministic, the default): cuBLASLt's heuristic picks tiles,
// split-K and reduction schemes by problem size, so one row's bits could change with m. Here
// the algorithm is chosen once per (transa, transb) by asking the heuristic about one fixed
// reference shape (LB_PIN_DIM cubed) under restrictions that make it valid for any shape:
// no workspace and reduction scheme NONE (so no split-K of any kind), 4-byte minimum
// alignment of every operand (so any fp32 pointer and leading dimension is accepted), and no
// tensor-core or reduced-precision-input implementation (plain FFMA). Split-K is then set to 1
// explicitly. Every shape runs that one algorithm once cublasLtMatmulAlgoCheck accepts it; if
// it refuses an (n, k), the heuristic is asked about (LB_PIN_DIM, n, k) under the same
// restrictions, which still does not depend on m. doc/backends.md records what this does and
// does not promise; tests/test_backend_ops.c checks one row alone against the same row in a
// batch. LB_CUDA_GEMM_LOG=1 prints every plan's algorithm configuration.
//
// BF16 tensor cores (on by default; LB_CUDA_BF16=0 turns them off): a GEMM of operands rounded
// to bf16 (lb_gemm_args.bf16) runs on sm_90 as a group of one of gemm_grouped.cu's wgmma kernel
// (faster than cuBLASLt's pinned algorithm; LB_CUDA_DENSE_TC=0 turns it off). Otherwise it
// converts both operands to bf16 (nearest even) in scratch, with leading dimensions padded to
// 8 elements (16 bytes), and runs cuBLASLt's bf16 x bf16 -> fp32 GEMM (CUBLAS_COMPUTE_32F:
// products exact, fp32 accumulation). Deterministic mode pins one algorithm per (transa,
// transb) as above, tensor cores allowed, still without split-K or workspace; a shape no such
// algorithm accepts takes the fp32 path on copies of the operands rounded to bf16.
//
// A bf16 output (lb_gemm_args.c16): the wgmma kernel stores it directly; every other path
// computes C in fp32 into a buffer of its own (cx->gemm_c32) and rounds it into c16 after.
#include "kernels/cuda/cuda.cuh"
#include "kernels/quant/quant.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define LB_PIN_DIM 4096   // reference shape for the pinned algorithm (m = n = k)

struct lb_gemm_plan {
    int transa, transb, m, n, k, align_a, align_b, align_c, det, bf16;   // the key
    int ok;                               // bf16: 0 when no algorithm fits (the fp32 path)
    lb_lt_descs d;                        // cuBLASLt's A (our B), B (our A), C = D
    cublasLtMatmulAlgo_t algo;
    size_t workspace;                     // bytes the algorithm needs (0 when pinned)
    int fallback;                         // deterministic, but chosen at (LB_PIN_DIM, n, k)
};

// Largest power of two <= 16 dividing both the address and the row pitch in bytes: the
// alignment cuBLASLt may assume for every row of the operand.
static int align_of(const void *p, long ld_elems)
{
    uintptr_t v = (uintptr_t)p | (uintptr_t)(ld_elems * 4) | 16;
    return (int)(v & (~v + 1));
}

static uint64_t plan_hash(const lb_gemm_plan *k)
{
    uint64_t h = 0x9e3779b97f4a7c15ull;
    const int f[] = {k->transa, k->transb, k->m, k->n, k->k, k->align_a, k->align_b, k->align_c,
                     k->det, k->bf16};
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
        h = lb_hash64(h ^ (uint64_t)(uint32_t)f[i]);
    return h;
}

static int plan_same(const lb_gemm_plan *a, const lb_gemm_plan *b)
{
    return a->transa == b->transa && a->transb == b->transb && a->m == b->m && a->n == b->n &&
           a->k == b->k && a->align_a == b->align_a && a->align_b == b->align_b &&
           a->align_c == b->align_c && a->det == b->det && a->bf16 == b->bf16;
}

// Descriptors of one row-major problem in cuBLASLt's column-major terms (see the top).
static int64_t pad8(int64_t x) { return (x + 7) / 8 * 8; }

// bf16: the operands are bf16 with their contiguous dimension padded to 8 elements.
static void make_descs(int transa, int transb, int m, int n, int k, lb_lt_descs *d, int bf16)
{
    int64_t ldb = transb ? k : n, lda = transa ? m : k;
    if (bf16) {
        ldb = pad8(ldb);
        lda = pad8(lda);
    }
    // cuBLASLt's A is our B: (k, n) row-major = (n, k) column-major, ld n; transposed: (n, k) =
    // (k, n), ld k. Its B is our A: (m, k) row-major = (k, m) column-major, ld k; transposed:
    // (k, m) = (m, k), ld m. C (m, n) row-major = (n, m) column-major, ld n.
    lb_lt_descs_init(d, transb, transa, bf16 ? CUDA_R_16BF : CUDA_R_32F, transb ? k : n,
                     transb ? n : k, ldb, transa ? m : k, transa ? k : m, lda, n, m, n);
}

// Heuristic preferences. Deterministic: no workspace, no split-K reduction of any scheme, any
// 4-byte alignment, FMA implementations only. Otherwise: the workspace and the given
// alignments, everything allowed.
static cublasLtMatmulPreference_t make_pref(lb_cuda_ctx *cx, int det, int al_a, int al_b,
                                            int al_c, int bf16)
{
    // An algorithm is kept when its flags lie inside the mask: allow everything but
    // tensor-core instructions and reduced-precision inputs (TF32, fp16, bf16: the
    // emulated-fp32 paths), leaving plain FFMA kernels. bf16 inputs: tensor cores are the point.
    const uint64_t ffma = ~(uint64_t)(CUBLASLT_NUMERICAL_IMPL_FLAGS_TENSOR_OP_MASK |
                                      CUBLASLT_NUMERICAL_IMPL_FLAGS_INPUT_TF32 |
                                      CUBLASLT_NUMERICAL_IMPL_FLAGS_INPUT_16F |
                                      CUBLASLT_NUMERICAL_IMPL_FLAGS_INPUT_16BF);
    return lb_lt_pref(cx, det, (uint32_t)al_a, (uint32_t)al_b, (uint32_t)al_c,
                      det && !bf16 ? ffma : LB_LT_IMPL_ALL);
}

// The best algorithm the heuristic offers for these descriptors; dies when there is none.
static cublasLtMatmulHeuristicResult_t heuristic(lb_cuda_ctx *cx, const lb_lt_descs *d,
                                                 cublasLtMatmulPreference_t pref,
                                                 const char *what)
{
    cublasLtMatmulHeuristicResult_t r;
    cublasStatus_t s;
    int found = lb_lt_heuristic(cx, d, pref, &r, &s);
    LB_CUBLAS_CHECK(s);   // cublasLtMatmulAlgoGetHeuristic
    if (!found) lb_die("cuda gemm: cuBLASLt offers no fp32 algorithm for %s", what);
    return r;
}

// The deterministic algorithm for (bf16, transa, transb), chosen at the reference shape; NULL
// when cuBLASLt offers none (bf16 only: fp32 always has one).
static const cublasLtMatmulAlgo_t *pinned_algo(lb_cuda_ctx *cx, int transa, int transb, int bf16)
{
    int slot = bf16 * 4 + transa * 2 + transb;
    if (!cx->pinned_ready[slot]) {
        lb_lt_descs d;
        make_descs(transa, transb, LB_PIN_DIM, LB_PIN_DIM, LB_PIN_DIM, &d, bf16);
        cublasLtMatmulPreference_t pref = make_pref(cx, 1, bf16 ? 16 : 4, bf16 ? 16 : 4, 4, bf16);
        char what[96];
        snprintf(what, sizeof what, "the pinned reference shape (transa %d, transb %d)", transa,
                 transb);
        cublasLtMatmulHeuristicResult_t r;
        int found = bf16 ? lb_lt_heuristic(cx, &d, pref, &r, NULL)
                         : (r = heuristic(cx, &d, pref, what), 1);
        LB_CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
        lb_lt_descs_free(&d);
        cx->pinned_ready[slot] = found ? 1 : -1;
        if (found) {
            cx->pinned[slot] = r.algo;
            lb_lt_no_splitk(&cx->pinned[slot]);
        }
    }
    return cx->pinned_ready[slot] == 1 ? &cx->pinned[slot] : NULL;
}

// One line naming an algorithm's configuration (LB_CUDA_GEMM_LOG and doc/backends.md).
static void log_plan(const lb_gemm_plan *p)
{
    int32_t id = -1, splitk = -1;
    uint32_t tile = 0, stages = 0, red = 0, swz = 0, custom = 0;
    uint16_t inner = 0, cluster = 0;
    uint64_t impl = 0;
    size_t w;
    LB_CUBLAS_CHECK(cublasLtMatmulAlgoCapGetAttribute(
        &p->algo, CUBLASLT_ALGO_CAP_NUMERICAL_IMPL_FLAGS, &impl, sizeof impl, &w));
#define CFG(attr, var) \
    LB_CUBLAS_CHECK(cublasLtMatmulAlgoConfigGetAttribute(&p->algo, attr, &var, sizeof var, &w))
    CFG(CUBLASLT_ALGO_CONFIG_ID, id);
    CFG(CUBLASLT_ALGO_CONFIG_TILE_ID, tile);
    CFG(CUBLASLT_ALGO_CONFIG_STAGES_ID, stages);
    CFG(CUBLASLT_ALGO_CONFIG_SPLITK_NUM, splitk);
    CFG(CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, red);
    CFG(CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, swz);
    CFG(CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, custom);
    CFG(CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, inner);
    CFG(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, cluster);
#undef CFG
    fprintf(stderr,
            "cuda gemm plan: %s transa %d transb %d m %d n %d k %d align %d/%d/%d: algo %d "
            "tile %u stages %u splitk %d reduction %u swizzle %u custom %u inner %u cluster %u "
            "impl 0x%llx workspace %zu\n",
            p->det ? (p->fallback ? "pinned-nk" : "pinned") : "heuristic", p->transa,
            p->transb, p->m, p->n, p->k, p->align_a, p->align_b, p->align_c, id, tile, stages,
            splitk, red, swz, custom, inner, cluster, (unsigned long long)impl, p->workspace);
}

static lb_gemm_plan *build_plan(lb_cuda_ctx *cx, const lb_gemm_plan *key)
{
    lb_gemm_plan *p = (lb_gemm_plan *)lb_calloc(1, sizeof *p);
    *p = *key;
    p->ok = 1;
    make_descs(p->transa, p->transb, p->m, p->n, p->k, &p->d, p->bf16);
    char what[128];
    snprintf(what, sizeof what, "transa %d transb %d m %d n %d k %d", p->transa, p->transb, p->m,
             p->n, p->k);
    int al = p->bf16 ? 16 : 4;   // bf16 operands live in our padded, 256-byte aligned scratch
    if (p->det) {
        const cublasLtMatmulAlgo_t *pin = pinned_algo(cx, p->transa, p->transb, p->bf16);
        if (pin && lb_lt_fits(cx, &p->d, pin, NULL)) {
            p->algo = *pin;
        } else {
            // The pinned algorithm refuses this (n, k) (or there is none): ask the heuristic
            // under the same restrictions about (LB_PIN_DIM, n, k), which still does not
            // depend on m.
            lb_lt_descs d;
            make_descs(p->transa, p->transb, LB_PIN_DIM, p->n, p->k, &d, p->bf16);
            cublasLtMatmulPreference_t pref = make_pref(cx, 1, al, al, 4, p->bf16);
            cublasLtMatmulHeuristicResult_t r;
            int found = lb_lt_heuristic(cx, &d, pref, &r, NULL);
            LB_CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
            lb_lt_descs_free(&d);
            if (found) {
                p->algo = r.algo;
                lb_lt_no_splitk(&p->algo);
            }
            if (!found || !lb_lt_fits(cx, &p->d, &p->algo, NULL)) {
                if (!p->bf16)
                    lb_die("cuda gemm: no deterministic (no split-K, no workspace) cuBLASLt "
                           "algorithm accepts %s", what);
                p->ok = 0;   // the caller takes the fp32 path
            }
            p->fallback = 1;
        }
        p->workspace = 0;
    } else {
        cublasLtMatmulPreference_t pref =
            make_pref(cx, 0, p->bf16 ? al : p->align_a, p->bf16 ? al : p->align_b, p->align_c,
                      p->bf16);
        cublasLtMatmulHeuristicResult_t r;
        if (p->bf16) {
            p->ok = lb_lt_heuristic(cx, &p->d, pref, &r, NULL);
        } else {
            r = heuristic(cx, &p->d, pref, what);
        }
        LB_CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
        p->algo = r.algo;
        p->workspace = r.workspaceSize;
    }
    if (cx->gemm_log && p->ok) log_plan(p);
    return p;
}

static void plan_insert(lb_cuda_ctx *cx, lb_gemm_plan *p)
{
    if ((cx->plan_count + 1) * 2 > cx->plan_cap) {   // keep the load under one half
        size_t cap = cx->plan_cap ? cx->plan_cap * 2 : 256;
        lb_gemm_plan **t = (lb_gemm_plan **)lb_calloc(cap, sizeof *t);
        for (size_t i = 0; i < cx->plan_cap; i++) {
            lb_gemm_plan *q = cx->plans[i];
            if (!q) continue;
            size_t h = plan_hash(q) & (cap - 1);
            while (t[h]) h = (h + 1) & (cap - 1);
            t[h] = q;
        }
        free(cx->plans);
        cx->plans = t;
        cx->plan_cap = cap;
    }
    size_t h = plan_hash(p) & (cx->plan_cap - 1);
    while (cx->plans[h]) h = (h + 1) & (cx->plan_cap - 1);
    cx->plans[h] = p;
    cx->plan_count++;
}

static lb_gemm_plan *plan_get(lb_cuda_ctx *cx, const lb_gemm_plan *key)
{
    if (cx->plan_cap) {
        size_t h = plan_hash(key) & (cx->plan_cap - 1);
        for (lb_gemm_plan *q; (q = cx->plans[h]) != NULL; h = (h + 1) & (cx->plan_cap - 1))
            if (plan_same(q, key)) return q;
    }
    lb_gemm_plan *p = build_plan(cx, key);
    plan_insert(cx, p);
    return p;
}

extern "C" void lb_cuda_gemm_destroy(lb_cuda_ctx *cx)
{
    if (cx->side_ready) {
        for (int s = 0; s < 4; s++) {
            LB_CUDA_CHECK(cudaStreamDestroy(cx->side[s]));
            LB_CUDA_CHECK(cudaEventDestroy(cx->join[s]));
        }
        LB_CUDA_CHECK(cudaEventDestroy(cx->fork));
        cx->side_ready = 0;
    }
    for (size_t i = 0; i < cx->plan_cap; i++) {
        lb_gemm_plan *p = cx->plans[i];
        if (!p) continue;
        lb_lt_descs_free(&p->d);
        free(p);
    }
    free(cx->plans);
    cx->plans = NULL;
    cx->plan_cap = cx->plan_count = 0;
    LB_CUDA_CHECK(cudaFree(cx->gemm_c32));
    cx->gemm_c32 = NULL;
    cx->gemm_c32_bytes = 0;
}

// C *= beta over (m, n) contiguous elements (the no-product case with beta not 0 or 1).
__global__ void gemm_scale_kernel(float *c, float beta, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        c[i] *= beta;
}

// dst (rows, ld) bf16 = src (rows, cols) fp32 rounded to nearest even (lb_gemm_args.bf16),
// columns cols..ld zero. Rows strided over blockIdx.y, pairs of columns over the x threads (ld
// is even; no 64-bit division per element).
__global__ void to_bf16_kernel(__nv_bfloat16 *__restrict__ dst, const float *__restrict__ src,
                               int rows, int cols, int ld)
{
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        const float *s = src + (size_t)r * cols;
        __nv_bfloat162 *d = (__nv_bfloat162 *)(dst + (size_t)r * ld);
        for (int c = 2 * (blockIdx.x * blockDim.x + threadIdx.x); c < ld;
             c += 2 * gridDim.x * blockDim.x) {
            const float v0 = c < cols ? s[c] : 0.0f, v1 = c + 1 < cols ? s[c + 1] : 0.0f;
            d[c / 2] = __floats2bfloat162_rn(v0, v1);
        }
    }
}

// dst (rows, ld) = bf16(src (rows, cols)), zeros beyond cols; queued.
static void to_bf16(lb_cuda_ctx *cx, __nv_bfloat16 *dst, const float *src, size_t rows, int cols,
                    int ld)
{
    unsigned gx = (unsigned)((ld / 2 + 255) / 256), cap = (unsigned)cx->num_sms * 16 / gx + 1;
    unsigned gy = (unsigned)(rows < cap ? rows : cap);
    if (gy > 65535) gy = 65535;
    to_bf16_kernel<<<dim3(gx, gy), 256, 0, cx->stream>>>(dst, src, (int)rows, cols, ld);
    LB_CUDA_LAUNCHED(cx);
}

// dst (rows, pad8(cols)) bf16 = src (rows, cols) fp32 rounded to nearest even, the pad columns
// not written (lb_gemm_args.c16: to_bf16_kernel's values without its zeros). Queued.
__global__ void gemm_c16_kernel(__nv_bfloat16 *__restrict__ dst, const float *__restrict__ src,
                                int rows, int cols)
{
    const int ld = (cols + 7) & ~7;
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        const float *s = src + (size_t)r * cols;
        __nv_bfloat16 *d = dst + (size_t)r * ld;
        for (int c = 2 * (blockIdx.x * blockDim.x + threadIdx.x); c < cols;
             c += 2 * gridDim.x * blockDim.x) {
            if (c + 1 < cols) *(__nv_bfloat162 *)(d + c) = __floats2bfloat162_rn(s[c], s[c + 1]);
            else d[c] = __float2bfloat16_rn(s[c]);   // an odd cols: the last column alone
        }
    }
}

static void gemm_c16(lb_cuda_ctx *cx, uint16_t *dst, const float *src, int rows, int cols)
{
    unsigned gx = (unsigned)(((cols + 1) / 2 + 255) / 256);   // pairs of columns over x
    unsigned cap = (unsigned)cx->num_sms * 16 / gx + 1;
    unsigned gy = (unsigned)rows < cap ? (unsigned)rows : cap;
    if (gy > 65535) gy = 65535;
    gemm_c16_kernel<<<dim3(gx, gy), 256, 0, cx->stream>>>((__nv_bfloat16 *)dst, src, rows, cols);
    LB_CUDA_LAUNCHED(cx);
}

// The fp32 C of a c16 call (at least n floats). Its own buffer, not lb_cuda_scratch: the
// GEMM that writes it takes its operand copies from the scratch, which may be reallocated.
static float *gemm_c32(lb_cuda_ctx *cx, size_t n)
{
    if (n * sizeof(float) <= cx->gemm_c32_bytes) return cx->gemm_c32;
    // queued work may still read the old buffer (an earlier call's rounding): wait first
    LB_CUDA_CHECK(cudaStreamSynchronize(cx->stream));
    cx->waits++;
    LB_CUDA_CHECK(cudaFree(cx->gemm_c32));
    size_t want = n * sizeof(float);
    want += want / 4;   // headroom, as lb_cuda_scratch
    cx->gemm_c32 = (float *)lb_cuda_malloc_what(cx, want, 0, "a bf16-output GEMM's fp32 result");
    cx->mem_gen++;
    cx->gemm_c32_bytes = want;
    return cx->gemm_c32;
}

extern "C" float *lb_cuda_c32(lb_cuda_ctx *cx, size_t n) { return gemm_c32(cx, n); }
extern "C" void lb_cuda_store_c16(lb_cuda_ctx *cx, uint16_t *c16, const float *c, int rows,
                                  int cols)
{
    gemm_c16(cx, c16, c, rows, cols);
}

// kernels.h's rule for c16: bf16 operands and beta 0; 4-byte aligned, as to_bf16's layout is
// (its kernels store column pairs).
static void c16_check(const lb_gemm_args *g, const char *op)
{
    if (g->c16 && (!g->bf16 || g->beta != 0.0f || ((uintptr_t)g->c16 & 3)))
        lb_die("%s: a bf16 output (c16) needs bf16 operands, beta 0 and a 4-byte aligned c16 "
               "(bf16 %d, beta %g, c16 %p)", op, g->bf16, (double)g->beta, (void *)g->c16);
}

// dst (rows, cols) fp32 = src (rows, ld) bf16 widened (a copy in to_bf16's layout back to fp32,
// exactly); queued.
__global__ void widen_bf16_kernel(float *__restrict__ dst, const __nv_bfloat16 *__restrict__ src,
                                  size_t rows, int cols, int ld)
{
    const size_t n = rows * cols;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        dst[i] = __bfloat162float(src[i / cols * ld + i % cols]);
}

static void widen_bf16(lb_cuda_ctx *cx, float *dst, const uint16_t *src, size_t rows, int cols)
{
    widen_bf16_kernel<<<lb_grid(rows * cols, 256, cx), 256, 0, cx->stream>>>(
        dst, (const __nv_bfloat16 *)src, rows, cols, pad8(cols));
    LB_CUDA_LAUNCHED(cx);
}

// The plan key of g's shape and mode; the caller sets the alignments.
static lb_gemm_plan plan_key(const lb_backend *be, const lb_gemm_args *g, int bf16)
{
    lb_gemm_plan key;
    memset(&key, 0, sizeof key);
    key.transa = g->transa ? 1 : 0;
    key.transb = g->transb ? 1 : 0;
    key.m = g->m, key.n = g->n, key.k = g->k;
    key.det = be->deterministic ? 1 : 0;
    key.bf16 = bf16;
    return key;
}

// The key of a bf16 plan: the bf16 copies are 16-byte aligned; C any fp32 pointer when pinned.
static lb_gemm_plan bf16_key(const lb_backend *be, const lb_gemm_args *g)
{
    lb_gemm_plan key = plan_key(be, g, 1);
    key.align_a = key.align_b = 16;
    key.align_c = key.det ? 4 : align_of(g->c, g->n);
    return key;
}

// cuBLASLt's bf16 tensor-core GEMM of g (operands rounded to bf16); 0 when no algorithm takes
// the shape.
static int gemm_bf16(lb_backend *be, const lb_gemm_args *g)
{
    lb_cuda_ctx *cx = lb_cuda(be);
    lb_gemm_plan key = bf16_key(be, g);
    lb_gemm_plan *p = plan_get(cx, &key);
    if (!p->ok) return 0;
    // row-major operands: A (rows_a, cols_a), B (rows_b, cols_b), contiguous cols padded to 8
    int rows_a = key.transa ? g->k : g->m, cols_a = key.transa ? g->m : g->k;
    int rows_b = key.transb ? g->n : g->k, cols_b = key.transb ? g->k : g->n;
    size_t lda = (size_t)pad8(cols_a), ldb = (size_t)pad8(cols_b);
    size_t o_b = lb_align256((size_t)rows_a * lda * 2);
    char *sc = (char *)lb_cuda_scratch(cx, o_b + (size_t)rows_b * ldb * 2);
    // a copy the caller gave is read as it is: the layout made here
    __nv_bfloat16 *ab = (__nv_bfloat16 *)sc, *bb = (__nv_bfloat16 *)(sc + o_b);
    if (g->a16) ab = (__nv_bfloat16 *)g->a16;
    else to_bf16(cx, ab, g->a, rows_a, cols_a, (int)lda);
    if (g->b16) bb = (__nv_bfloat16 *)g->b16;
    else to_bf16(cx, bb, g->b, rows_b, cols_b, (int)ldb);
    LB_CUBLAS_CHECK(cublasLtMatmul(cx->lt, p->d.op, &g->alpha, bb, p->d.a, ab, p->d.b, &g->beta,
                                   g->c, p->d.c, g->c, p->d.c, &p->algo,
                                   p->workspace ? cx->workspace : NULL, p->workspace, cx->stream));
    if (cx->sync_each) LB_CUDA_WAIT(cx);
    return 1;
}

static void cuda_gemm(lb_backend *be, const lb_gemm_args *g)
{
    lb_cuda_ctx *cx = lb_cuda(be);
    c16_check(g, "gemm");
    if (g->m < 0 || g->n < 0 || g->k < 0)
        lb_die("gemm: negative size (m %d, n %d, k %d)", g->m, g->n, g->k);
    if (g->m == 0 || g->n == 0) return;
    size_t mn = (size_t)g->m * g->n;
    if (g->k == 0 || g->alpha == 0.0f) {
        // No product: C = beta C; beta 0 overwrites (NaN in C must not survive), as the CPU.
        if (g->c16) {   // beta 0: bf16 zeros, the pad columns untouched
            LB_CUDA_CHECK(cudaMemset2DAsync(g->c16, (size_t)pad8(g->n) * 2, 0, (size_t)g->n * 2,
                                            (size_t)g->m, cx->stream));
        } else if (g->beta == 0.0f) {
            LB_CUDA_CHECK(cudaMemsetAsync(g->c, 0, mn * sizeof(float), cx->stream));
        } else if (g->beta != 1.0f) {
            gemm_scale_kernel<<<lb_grid(mn, 256, cx), 256, 0, cx->stream>>>(g->c, g->beta, mn);
            LB_CUDA_LAUNCHED(cx);
        }
        return;
    }
    if (g->bf16 && cx->bf16_tc && cx->dense_tc && cx->grouped_tc) {   // gemm_grouped.cu's kernel
        lb_cuda_gemm_grouped_tc(cx, 1, g);
        if (cx->sync_each) LB_CUDA_WAIT(cx);
        return;
    }
    if (g->c16) {   // cuBLASLt or the fp32 path below into gemm_c32, then rounded into c16
        lb_gemm_args r = *g;
        r.c = gemm_c32(cx, mn), r.c16 = NULL;
        cuda_gemm(be, &r);
        gemm_c16(cx, g->c16, r.c, g->m, g->n);
        return;
    }
    if (g->bf16 && cx->bf16_tc && gemm_bf16(be, g)) return;
    if (g->bf16) {   // the fp32 path on copies of the operands rounded to bf16 (kernels.h)
        size_t na = (size_t)g->m * g->k, nb = (size_t)g->k * g->n, o_b = lb_align256(na * 4);
        char *sc = (char *)lb_cuda_scratch(cx, o_b + nb * 4);
        lb_gemm_args r = *g;
        r.a = (float *)sc, r.b = (float *)(sc + o_b), r.bf16 = 0, r.a16 = r.b16 = NULL;
        // A stored (m, k) or (k, m), B (k, n) or (n, k); a copy widened gives the rounded values
        if (g->a16) widen_bf16(cx, (float *)r.a, g->a16, na / (g->transa ? g->m : g->k),
                               g->transa ? g->m : g->k);
        else be->round_bf16(be, (float *)r.a, g->a, na);
        if (g->b16) widen_bf16(cx, (float *)r.b, g->b16, nb / (g->transb ? g->k : g->n),
                               g->transb ? g->k : g->n);
        else be->round_bf16(be, (float *)r.b, g->b, nb);
        cuda_gemm(be, &r);
        return;
    }
    lb_gemm_plan key = plan_key(be, g, 0);
    if (key.det) {
        key.align_a = key.align_b = key.align_c = 4;   // the pinned algorithm accepts any
    } else {
        key.align_a = align_of(g->b, key.transb ? g->k : g->n);   // cuBLASLt's A is our B
        key.align_b = align_of(g->a, key.transa ? g->m : g->k);
        key.align_c = align_of(g->c, g->n);
    }
    lb_gemm_plan *p = plan_get(cx, &key);
    // beta 0: cuBLASLt does not read C (BLAS convention), so NaN in C is overwritten.
    LB_CUBLAS_CHECK(cublasLtMatmul(cx->lt, p->d.op, &g->alpha, g->b, p->d.a, g->a, p->d.b, &g->beta,
                                   g->c, p->d.c, g->c, p->d.c, &p->algo,
                                   p->workspace ? cx->workspace : NULL, p->workspace,
                                   cx->stream));
    if (cx->sync_each) LB_CUDA_WAIT(cx);
}

// bf16 copies of one operand of every group, src[i] (rows[i], cols) row-major fp32, at dst
// with row pitch ld; out[i] is group i's copy. Groups whose operands follow each other in
// memory (an expert layer's slices of one activation, its consecutive weight matrices) are
// converted by one launch. Returns the rows written.
static size_t grouped_to_bf16(lb_cuda_ctx *cx, const float *const *src, const int *rows,
                              int cols, int count, __nv_bfloat16 *dst, size_t ld,
                              __nv_bfloat16 **out)
{
    size_t r0 = 0;
    for (int i = 0; i < count;) {
        int j = i;
        size_t rr = (size_t)rows[i];
        while (j + 1 < count && src[j + 1] == src[j] + (size_t)rows[j] * cols) rr += rows[++j];
        if (rr) {
            to_bf16(cx, dst + r0 * ld, src[i], rr, cols, (int)ld);
        }
        for (size_t off = 0; i <= j; off += rows[i], i++) out[i] = dst + (r0 + off) * ld;
        r0 += rr;
    }
    return r0;
}

// The groups of a grouped call whose operands are all marked bf16, in deterministic mode (no
// workspace: the groups share nothing): both operands of every group are converted to bf16 up
// front (one launch per run of consecutive slices), then the groups' GEMMs run on four side
// streams at once, so experts with a few hundred rows each fill the GPU together. Every group
// runs its own plan on its own inputs and writes only its own C (kernels.h), so the result is
// the same bits as one call after the other. 0 when the groups do not fit this path.
// Off unless LB_CUDA_GROUPED_STREAMS=1, and only reached where the one-launch kernel is not
// (another GPU, or LB_CUDA_GROUPED=0); test_gemm_grouped_bf16 runs it (passed on the H200).
static int grouped_bf16(lb_backend *be, int count, const lb_gemm_args *g)
{
    lb_cuda_ctx *cx = lb_cuda(be);
    if (count < 2 || !cx->grouped_streams || !cx->bf16_tc || !be->deterministic) return 0;
    // converts fp32 operands only (cuda_gemm takes copies) and writes fp32 C only (c16: the
    // rounding's buffer is one)
    for (int i = 0; i < count; i++)
        if (g[i].a16 || g[i].b16 || g[i].c16) return 0;
    const int ta = g[0].transa ? 1 : 0, tb = g[0].transb ? 1 : 0;
    const int cols_a = ta ? g[0].m : g[0].k, cols_b = tb ? g[0].k : g[0].n;
    for (int i = 0; i < count; i++) {   // one transpose pair and one width per operand
        const lb_gemm_args *x = &g[i];
        if (!x->bf16 || (x->transa ? 1 : 0) != ta || (x->transb ? 1 : 0) != tb ||
            (ta ? x->m : x->k) != cols_a || (tb ? x->k : x->n) != cols_b || x->m < 0 ||
            x->n < 0 || x->k < 0)
            return 0;
    }
    // per group: operands and their rows (0: not run here), plan, bf16 copies
    const float **sa = (const float **)lb_malloc((size_t)count * 2 * sizeof *sa), **sb = sa + count;
    int *ra = (int *)lb_malloc((size_t)count * 2 * sizeof *ra), *rb = ra + count;
    lb_gemm_plan **plan = (lb_gemm_plan **)lb_calloc((size_t)count, sizeof *plan);
    __nv_bfloat16 **ab = (__nv_bfloat16 **)lb_malloc((size_t)count * 2 * sizeof *ab);
    __nv_bfloat16 **bb = ab + count;
    int nrun = 0;
    for (int i = 0; i < count; i++) {
        const lb_gemm_args *x = &g[i];
        sa[i] = x->a, sb[i] = x->b, ra[i] = rb[i] = 0;
        if (x->m == 0 || x->n == 0) continue;
        if (x->k == 0 || x->alpha == 0.0f) {   // no product: cuda_gemm's rule, in order
            cuda_gemm(be, x);
            continue;
        }
        lb_gemm_plan key = bf16_key(be, x);   // deterministic here: C aligned to 4
        lb_gemm_plan *p = plan_get(cx, &key);
        if (!p->ok) {   // no tensor-core algorithm takes this shape: the fp32 path
            cuda_gemm(be, x);
            continue;
        }
        plan[i] = p, nrun++;
        ra[i] = ta ? x->k : x->m, rb[i] = tb ? x->n : x->k;
    }
    if (nrun) {
        size_t lda = (size_t)pad8(cols_a), ldb = (size_t)pad8(cols_b), rows_a = 0, rows_b = 0;
        for (int i = 0; i < count; i++) rows_a += ra[i], rows_b += rb[i];
        size_t o_b = lb_align256(rows_a * lda * 2);
        char *sc = (char *)lb_cuda_scratch(cx, o_b + rows_b * ldb * 2);
        grouped_to_bf16(cx, sa, ra, cols_a, count, (__nv_bfloat16 *)sc, lda, ab);
        grouped_to_bf16(cx, sb, rb, cols_b, count, (__nv_bfloat16 *)(sc + o_b), ldb, bb);
        if (!cx->side_ready) {
            for (int s = 0; s < 4; s++) {
                LB_CUDA_CHECK(cudaStreamCreateWithFlags(&cx->side[s], cudaStreamNonBlocking));
                LB_CUDA_CHECK(cudaEventCreateWithFlags(&cx->join[s], cudaEventDisableTiming));
            }
            LB_CUDA_CHECK(cudaEventCreateWithFlags(&cx->fork, cudaEventDisableTiming));
            cx->side_ready = 1;
        }
        LB_CUDA_CHECK(cudaEventRecord(cx->fork, cx->stream));
        for (int s = 0; s < 4; s++) LB_CUDA_CHECK(cudaStreamWaitEvent(cx->side[s], cx->fork, 0));
        for (int i = 0, s = 0; i < count; i++) {
            const lb_gemm_plan *p = plan[i];
            if (!p) continue;
            LB_CUBLAS_CHECK(cublasLtMatmul(cx->lt, p->d.op, &g[i].alpha, bb[i], p->d.a, ab[i],
                                           p->d.b, &g[i].beta, g[i].c, p->d.c, g[i].c, p->d.c,
                                           &p->algo, NULL, 0, cx->side[s]));
            s = (s + 1) % 4;
        }
        for (int s = 0; s < 4; s++) {
            LB_CUDA_CHECK(cudaEventRecord(cx->join[s], cx->side[s]));
            LB_CUDA_CHECK(cudaStreamWaitEvent(cx->stream, cx->join[s], 0));
        }
        if (cx->sync_each) LB_CUDA_WAIT(cx);
    }
    free(sa), free(ra), free(plan), free(ab);
    return 1;
}

// Groups all marked bf16: one launch of gemm_grouped.cu's kernel on sm_90, else (deterministic
// mode, LB_CUDA_GROUPED_STREAMS=1) grouped_bf16. Otherwise one cuBLASLt call per group, in
// order (cuBLASLt 13.0 has no grouped mode). Each group follows cuda_gemm's rules: m or n == 0
// touches nothing, k == 0 or alpha == 0 only scales C by beta (beta 0 zeroes it).
static void cuda_gemm_grouped(lb_backend *be, int count, const lb_gemm_args *args)
{
    lb_cuda_ctx *cx = lb_cuda(be);
    int all_bf16 = count > 0 && cx->grouped_tc && cx->bf16_tc;
    for (int i = 0; i < count && all_bf16; i++) all_bf16 = args[i].bf16;
    if (all_bf16) {
        lb_gemm_args *run = (lb_gemm_args *)lb_malloc((size_t)count * sizeof *run);
        int nrun = 0;
        for (int i = 0; i < count; i++) {
            const lb_gemm_args *x = &args[i];
            c16_check(x, "gemm_grouped");
            if (x->m < 0 || x->n < 0 || x->k < 0)
                lb_die("gemm_grouped: negative size (m %d, n %d, k %d)", x->m, x->n, x->k);
            if (x->m == 0 || x->n == 0) continue;
            if (x->k == 0 || x->alpha == 0.0f) cuda_gemm(be, x);   // no product
            else run[nrun++] = *x;
        }
        if (nrun) lb_cuda_gemm_grouped_tc(cx, nrun, run);
        if (cx->sync_each) LB_CUDA_WAIT(cx);
        free(run);
        return;
    }
    if (grouped_bf16(be, count, args)) return;
    for (int i = 0; i < count; i++) cuda_gemm(be, &args[i]);
}

// Whether gemm_experts' quantized x takes the bf16 kernel on its weights' d16 copies: MXFP8 or
// MXFP4 (NVFP4's second levels are not in gx_kernel's store), where gemm_q_grouped would take
// its bf16 path, every expert's copy the one before's plus (n, pad8(k)) (a weight cache's).
static int experts_mx16(const lb_cuda_ctx *cx, const lb_gemm_experts_args *x)
{
    const lb_format f = x->qa->fmt;
    if ((f != LB_FMT_MXFP8 && f != LB_FMT_MXFP4) || !cx->grouped_tc || !cx->dense_tc ||
        !cx->bf16_tc || x->e > GX_MAX_E)
        return 0;
    const size_t step = (size_t)x->n * ((x->k + 7) & ~7);
    for (int j = 0; j < x->e; j++)
        if (x->qb[j].fmt != f || !x->qb[j].d16 || x->qb[j].d16 != x->qb[0].d16 + j * step)
            return 0;
    return 1;
}

// gemm_experts: gx_kernel where gemm_grouped takes its wgmma kernel (the same bits), gqx_kernel
// where gemm_q_grouped takes its fp8 one; else the counts come to the host (a wait) and
// gemm_grouped or gemm_q_grouped runs the groups.
static void cuda_gemm_experts(lb_backend *be, const lb_gemm_experts_args *x)
{
    lb_cuda_ctx *cx = lb_cuda(be);
    const int q = x->qa != NULL;
    if (x->e < 0 || x->rows < 0 || x->n <= 0 || x->k <= 0 || !x->counts ||
        (q ? !x->qb || x->a16 || x->b16 : !x->a16 || !x->b16) || (!x->c && !x->c16))
        lb_die("gemm_experts: e %d, rows %d, n %d, k %d, or an operand missing", x->e, x->rows,
               x->n, x->k);
    if (((uintptr_t)x->a16 | (uintptr_t)x->b16) & 15 || ((uintptr_t)x->c16 & 3) ||
        ((uintptr_t)x->c & 7))
        lb_die("gemm_experts: misaligned operands (a16 %p, b16 %p, c16 %p, c %p)",
               (const void *)x->a16, (const void *)x->b16, (void *)x->c16, (void *)x->c);
    if (x->e == 0 || x->rows == 0) return;
    if (q && experts_mx16(cx, x)) {
        // MXFP8 and MXFP4 with the weights' bf16 copies: A dequantized as gemm_q_grouped's bf16
        // path does it, then the bf16 kernel on the device counts (no wait), the same products
        // in the same order, so gemm_q_grouped's bits
        const size_t ld = (size_t)((x->k + 7) & ~7);
        void *a16 = lb_cuda_scratch(cx, (size_t)x->rows * ld * sizeof(uint16_t));
        const lb_cuda_dq_job job = {x->qa, a16, ld, (int)ld};
        lb_cuda_dequant_bf16_groups(cx, 1, &job);
        lb_gemm_experts_args y = *x;
        y.a16 = (const uint16_t *)a16, y.b16 = x->qb[0].d16, y.qa = y.qb = NULL;
        lb_cuda_gemm_experts_tc(cx, &y);
        if (cx->sync_each) LB_CUDA_WAIT(cx);
        return;
    }
    if (q ? cx->grouped_tc && lb_cuda_gemm_experts_q_fits(x)
          : cx->grouped_tc && cx->bf16_tc) {
        if (q) lb_cuda_gemm_experts_q_tc(cx, x);
        else lb_cuda_gemm_experts_tc(cx, x);
        if (cx->sync_each) LB_CUDA_WAIT(cx);
        return;
    }
    int *h = (int *)lb_malloc((size_t)x->e * sizeof(int));
    be->download(be, h, x->counts, (size_t)x->e * sizeof(int));
    if (q) {
        lb_qmat *v = (lb_qmat *)lb_calloc((size_t)x->e, sizeof *v);
        lb_gemm_q_args *g = lb_experts_qgroups(x, h, v);
        be->gemm_q_grouped(be, x->e, g);
        free(g), free(v);
    } else {
        lb_gemm_args *g = lb_experts_groups(x, h);
        cuda_gemm_grouped(be, x->e, g);
        free(g);
    }
    free(h);
}

extern "C" void lb_cuda_init_gemm(lb_backend *be)
{
    lb_cuda_ctx *cx = lb_cuda(be);
    const char *s = getenv("LB_CUDA_GEMM_LOG");
    cx->gemm_log = s && *s && *s != '0';
    s = getenv("LB_CUDA_BF16");   // on unless "0": test_gemm_bf16 passed on the H200
    cx->bf16_tc = !(s && *s == '0');
    int major = 0, minor = 0;
    LB_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, cx->device));
    LB_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, cx->device));
    s = getenv("LB_CUDA_GROUPED");   // on unless "0" where the device runs the sm_90a kernel
    cx->grouped_tc = !(s && *s == '0') && lb_cuda_gemm_grouped_tc_ok(major, minor);
    s = getenv("LB_CUDA_DENSE_TC");   // dense bf16 GEMMs on that kernel too (0: cuBLASLt's)
    cx->dense_tc = !(s && *s == '0');
    s = getenv("LB_CUDA_GROUPED_BN");
    cx->grouped_bn = s && atoi(s) == 128 ? 128 : 256;
    s = getenv("LB_CUDA_GG_TMA_STORE");   // on unless "0"
    cx->gg_tma_store = !(s && *s == '0');
    s = getenv("LB_CUDA_ATTN_WG");   // attention_tc.cu: the same sm_90a condition
    cx->attn_wg = !(s && *s == '0') && lb_cuda_gemm_grouped_tc_ok(major, minor);
    s = getenv("LB_CUDA_ATTN_DS");   // on unless "0"
    cx->attn_ds = !(s && *s == '0');
    s = getenv("LB_CUDA_ATTN_CHUNK");   // bytes; the backward's scratch stays about this size
    cx->attn_chunk = s && *s ? (size_t)strtoull(s, NULL, 10) : (size_t)1536 << 20;
    s = getenv("LB_CUDA_ATTN_SPLIT");   // attention_tc.cu's decode kernel of W warps; on unless "0"
    cx->attn_split = !(s && *s == '0');
    s = getenv("LB_CUDA_GROUPED_STREAMS");
    cx->grouped_streams = s && *s && *s != '0';
    be->gemm = cuda_gemm;
    be->gemm_grouped = cuda_gemm_grouped;
    be->gemm_experts = cuda_gemm_experts;
}
