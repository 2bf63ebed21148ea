// ops_optim.cu: cross-entropy over fp32 logits and the AdamW update for the CUDA backend.
//
// Cross-entropy: one block per row (vocabularies up to 151936 and beyond), CE_THREADS threads
// striding over the row in groups of four elements (group q = elements 4q .. 4q + 3 of the
// row, thread q % CE_THREADS; then the v % 4 last elements one per thread). The loads are
// 16-byte vectors where the row is 16-byte aligned, four scalars otherwise: the arithmetic,
// and so every bit, is the same either way, and a row's results depend on that row alone.
// The row max is exact in any order; the exponential sum takes each exp(l - running max) in
// fp32 (expf, a few ulp) and adds them in double, rescaled in double when the max grows,
// thread partials in order then the block's fixed tree: bitwise reproducible. The CPU
// reference takes exp in double; the difference is below fp32 rounding of the loss
// (tests/test_backend_ops.c states the bound).
#include "kernels/cuda/cuda.cuh"

#include <math.h>

#define CE_THREADS 512

// Group q of row l (4 values), by one 16-byte load when vec.
template <typename T>
__device__ __forceinline__ void ce_ld4(float x[4], const T *l, int q, bool vec)
{
#pragma unroll
    for (int e = 0; e < 4; e++) x[e] = lb_ld(l + 4 * q + e);
}
template <>
__device__ __forceinline__ void ce_ld4<float>(float x[4], const float *l, int q, bool vec)
{
    if (vec) {
        const float4 f = reinterpret_cast<const float4 *>(l)[q];
        x[0] = f.x, x[1] = f.y, x[2] = f.z, x[3] = f.w;
    } else {
#pragma unroll
        for (int e = 0; e < 4; e++) x[e] = l[4 * q + e];
    }
}

template <typename T> __device__ __forceinline__ bool ce_vec(const T *p)
{
    return sizeof(T) == 4 && (uintptr_t)p % 16 == 0;
}

// Adds n values x to a thread's running (max mt, sum st of expf(x - mt)).
__device__ __forceinline__ void ce_add(float &mt, double &st, const float *x, int n)
{
    float mx = x[0];
    for (int e = 1; e < n; e++) mx = fmaxf(mx, x[e]);
    if (mx > mt) {
        st *= exp((double)mt - (double)mx);   // 0 * 0 while mt is -inf
        mt = mx;
    }
    for (int e = 0; e < n; e++) st += (double)expf(x[e] - mt);
}

// Row statistics shared by the forward and the backward: max m and sum of exp(l - m), in one
// read of the row (a 151936-wide row of a 16384-row batch is not in L2 on a second read). Each
// thread keeps a running max and sum; the block rescales every thread's sum to the row max
// before the fixed tree. NaN logits make the sum NaN, as in a two-pass form. Two groups are
// loaded before either is used, so more loads are in flight.
template <typename T>
__device__ __forceinline__ void ce_row_stats(const T *l, int v, float *m_out, double *sum_out)
{
    const bool vec = ce_vec(l);
    const int v4 = v / 4;
    float mt = -INFINITY;
    double st = 0.0;
    int q = threadIdx.x;
    for (; q + CE_THREADS < v4; q += 2 * CE_THREADS) {
        float x[8];
        ce_ld4(x, l, q, vec);
        ce_ld4(x + 4, l, q + CE_THREADS, vec);
        ce_add(mt, st, x, 4);
        ce_add(mt, st, x + 4, 4);
    }
    if (q < v4) {
        float x[4];
        ce_ld4(x, l, q, vec);
        ce_add(mt, st, x, 4);
    }
    const int j = 4 * v4 + threadIdx.x;
    if (j < v) {
        const float x = lb_ld(l + j);
        ce_add(mt, st, &x, 1);
    }
    const float m = lb_block_max<CE_THREADS>(mt);
    const double s = lb_block_sum<CE_THREADS>(st == 0.0 ? 0.0 : st * exp((double)mt - (double)m));
    *m_out = m;
    *sum_out = s;
}

// loss_i = m + log(sum) - l[target]; 0 where the target is negative; NaN (and a reported
// error) where it is >= v. stats (n, 2), or NULL: m and sum.
template <typename T>
__global__ void __launch_bounds__(CE_THREADS)
ce_fwd_kernel(float *loss, double *stats, const T *logits, const int32_t *targets, int v,
              size_t ld, unsigned long long *err)
{
    const int i = blockIdx.x, tgt = targets[i];
    if (tgt < 0 || tgt >= v) {
        if (threadIdx.x == 0) {
            if (tgt >= v) lb_report(err, LB_CERR_CE_FWD_TARGET, tgt);
            loss[i] = tgt < 0 ? 0.0f : NAN;
        }
        return;
    }
    const T *l = logits + (size_t)i * ld;
    float m;
    double s;
    ce_row_stats(l, v, &m, &s);
    if (threadIdx.x == 0) {
        loss[i] = (float)((double)m + log(s) - (double)lb_ld(l + tgt));
        if (stats) stats[2 * i] = m, stats[2 * i + 1] = s;
    }
}

// dlogits = dloss (softmax - onehot), p = exp(l - m) / sum. Every element is read, then
// written, by the same thread after the row statistics are complete (the reductions end with
// a barrier), so dlogits may alias logits.
// dloss_rows: one weight per row (cross_entropy_bwd_rows), or NULL for the scalar dloss.
// stats: the forward's m and sum of each row (then the row is read once, not twice), or NULL.
template <typename T>
__global__ void __launch_bounds__(CE_THREADS)
ce_bwd_kernel(T *dlogits, const T *logits, const double *stats, const int32_t *targets,
              float dloss, const float *dloss_rows, int v, size_t ld, unsigned long long *err)
{
    const int i = blockIdx.x, tgt = targets[i];
    if (dloss_rows) dloss = dloss_rows[i];
    const T *l = logits + (size_t)i * ld;
    T *dl = dlogits + (size_t)i * ld;
    if (tgt < 0 || tgt >= v) {
        if (tgt >= v && threadIdx.x == 0) lb_report(err, LB_CERR_CE_BWD_TARGET, tgt);
        const float fill = tgt < 0 ? 0.0f : NAN;
        for (int j = threadIdx.x; j < v; j += CE_THREADS) lb_st(dl + j, fill);
        for (int j = v + threadIdx.x; j < (int)ld; j += CE_THREADS) lb_st(dl + j, 0.0f);
        return;
    }
    float m;
    double s;
    if (stats) m = (float)stats[2 * i], s = stats[2 * i + 1];
    else ce_row_stats(l, v, &m, &s);
    const double inv = 1.0 / s;
    const bool vec = ce_vec(l) && ce_vec(dl);
    const int v4 = v / 4;
    for (int q = threadIdx.x; q < v4; q += CE_THREADS) {
        float x[4];
        ce_ld4(x, l, q, vec);
#pragma unroll
        for (int e = 0; e < 4; e++) x[e] = lb_ce_grad(x[e], m, inv, dloss, 4 * q + e == tgt);
        if (vec)
            reinterpret_cast<float4 *>(dl)[q] = make_float4(x[0], x[1], x[2], x[3]);
        else
#pragma unroll
            for (int e = 0; e < 4; e++) lb_st(dl + 4 * q + e, x[e]);
    }
    const int j = 4 * v4 + threadIdx.x;
    if (j < v) lb_st(dl + j, lb_ce_grad(lb_ld(l + j), m, inv, dloss, j == tgt));
    for (int p = v + threadIdx.x; p < (int)ld; p += CE_THREADS) lb_st(dl + p, 0.0f);   // padding
}

static void ce_check(const char *what, int n, int v)
{
    if (n < 0 || v < 0) lb_die("%s: negative size (n %d, v %d)", what, n, v);
}

static void cuda_cross_entropy_fwd(lb_backend *be, float *loss, double *stats,
                                   const float *logits, const int32_t *targets, int n, int v)
{
    ce_check("cross_entropy_fwd", n, v);
    if (!n) return;
    lb_cuda_ctx *cx = lb_cuda(be);
    ce_fwd_kernel<float><<<n, CE_THREADS, 0, cx->stream>>>(loss, stats, logits, targets, v,
                                                           (size_t)v, cx->err_dev);
    LB_CUDA_LAUNCHED(cx);
}

static void cuda_cross_entropy_fwd16(lb_backend *be, float *loss, double *stats,
                                     const uint16_t *logits16, const int32_t *targets, int n,
                                     int v)
{
    ce_check("cross_entropy_fwd16", n, v);
    if (!n) return;
    lb_cuda_ctx *cx = lb_cuda(be);
    ce_fwd_kernel<__nv_bfloat16><<<n, CE_THREADS, 0, cx->stream>>>(
        loss, stats, (const __nv_bfloat16 *)logits16, targets, v, (size_t)(v + 7) / 8 * 8,
        cx->err_dev);
    LB_CUDA_LAUNCHED(cx);
}

static void cuda_cross_entropy_bwd(lb_backend *be, float *dlogits, const float *logits,
                                   const double *stats, const int32_t *targets, float dloss,
                                   int n, int v)
{
    ce_check("cross_entropy_bwd", n, v);
    if (!n) return;
    lb_cuda_ctx *cx = lb_cuda(be);
    ce_bwd_kernel<float><<<n, CE_THREADS, 0, cx->stream>>>(dlogits, logits, stats, targets,
                                                           dloss, NULL, v, (size_t)v,
                                                           cx->err_dev);
    LB_CUDA_LAUNCHED(cx);
}

static void cuda_cross_entropy_bwd_rows(lb_backend *be, float *dlogits, const float *logits,
                                        const double *stats, const int32_t *targets,
                                        const float *dloss, int n, int v)
{
    ce_check("cross_entropy_bwd_rows", n, v);
    if (!n) return;
    lb_cuda_ctx *cx = lb_cuda(be);
    ce_bwd_kernel<float><<<n, CE_THREADS, 0, cx->stream>>>(dlogits, logits, stats, targets,
                                                           0.0f, dloss, v, (size_t)v,
                                                           cx->err_dev);
    LB_CUDA_LAUNCHED(cx);
}

// On gemm_grouped.cu's bf16 kernel where the device runs it (the gradient never stored in
// fp32); otherwise the definition: cross_entropy_bwd in place, then one gemm_grouped call.
static void cuda_linear_ce_bwd(lb_backend *be, float *dx, float dx_beta, float *dw,
                               float dw_beta, float *logits, const double *stats,
                               const int32_t *targets, float dloss, const float *x,
                               const float *w, const uint16_t *w16, int n, int v, int c)
{
    if (!stats) lb_die("linear_ce_bwd: needs the forward's row statistics");
    if (n < 0 || v < 0 || c < 0) lb_die("linear_ce_bwd: negative size (n %d, v %d, c %d)", n, v, c);
    lb_cuda_ctx *cx = lb_cuda(be);
    if (cx->grouped_tc && cx->bf16_tc && n > 0 && v > 0 && c > 0) {
        lb_cuda_linear_ce_bwd_tc(cx, dx, dx_beta, dw, dw_beta, logits, stats, targets, dloss, x,
                                 w, w16, n, v, c);
        if (cx->sync_each) LB_CUDA_WAIT(cx);
        return;
    }
    be->cross_entropy_bwd(be, logits, logits, stats, targets, dloss, n, v);
    lb_gemm_args g[2] = {{0, 0, n, c, v, 1.0f, dx_beta, logits, w, dx, 1, w16, NULL},
                         {1, 0, v, c, n, 1.0f, dw_beta, logits, x, dw, 1, NULL, NULL}};
    be->gemm_grouped(be, 2, g);
}

// --- AdamW -----------------------------------------------------------------------------------
// The CPU reference's expressions per element, each operation rounded alone in the CPU's order
// (intrinsics, so nvcc fuses nothing into an FMA): the update is the CPU's bit for bit, and
// the same in the vector and scalar paths. Bias corrections computed once on the host in
// double and rounded to fp32, as the CPU does. Parameters are fp32 master copies; the moments
// fp32 (adamw: 28 bytes an element, four float4 loads and three stores a thread when aligned)
// or bf16 (adamw16: each widened, updated by the same operations, stored rounded to nearest
// even as lb_f32_to_bf16 does, the parameter moved with the fp32 values; 8-byte vectors of
// four beside the float4s, 20 bytes). With p16 (a weight cache's bf16 copy) 2 bytes more, an
// 8-byte store of the four rounded parameters.
struct adamw_args {
    float gscale, lr, beta1, beta2, eps, wd, bc1, bc2;
};

__device__ __forceinline__ void adamw_one(float &p, float g, float &m, float &v,
                                          const adamw_args &a)
{
    const float gi = __fmul_rn(g, a.gscale);   // the clipping's scale
    const float mi = __fadd_rn(__fmul_rn(a.beta1, m), __fmul_rn(__fsub_rn(1.0f, a.beta1), gi));
    const float vi = __fadd_rn(__fmul_rn(a.beta2, v),
                               __fmul_rn(__fmul_rn(__fsub_rn(1.0f, a.beta2), gi), gi));
    m = mi;
    v = vi;
    const float mhat = __fdiv_rn(mi, a.bc1), vhat = __fdiv_rn(vi, a.bc2);
    const float u = __fadd_rn(__fdiv_rn(mhat, __fadd_rn(__fsqrt_rn(vhat), a.eps)),
                              __fmul_rn(a.wd, p));
    p = __fsub_rn(p, __fmul_rn(a.lr, u));
}

// A moment's storage: fp32 as is, bf16 widened on load and rounded on store; one element or
// four (vector i: elements 4i .. 4i + 3, 16 or 8 bytes).
__device__ __forceinline__ float mom_ld(const float *m, size_t i) { return m[i]; }
__device__ __forceinline__ float mom_ld(const uint16_t *m, size_t i)
{
    return __uint_as_float((uint32_t)m[i] << 16);
}
__device__ __forceinline__ void mom_st(float *m, size_t i, float x) { m[i] = x; }
__device__ __forceinline__ void mom_st(uint16_t *m, size_t i, float x)
{
    m[i] = (uint16_t)round_bf16_bits(x);
}
__device__ __forceinline__ float4 mom_ld4(const float *m, size_t i)
{
    return reinterpret_cast<const float4 *>(m)[i];
}
__device__ __forceinline__ float4 mom_ld4(const uint16_t *m, size_t i)
{
    const uint2 b = reinterpret_cast<const uint2 *>(m)[i];
    return make_float4(__uint_as_float(b.x << 16), __uint_as_float(b.x & 0xffff0000u),
                       __uint_as_float(b.y << 16), __uint_as_float(b.y & 0xffff0000u));
}
__device__ __forceinline__ void mom_st4(float *m, size_t i, float4 x)
{
    reinterpret_cast<float4 *>(m)[i] = x;
}
__device__ __forceinline__ void mom_st4(uint16_t *m, size_t i, float4 x)
{
    reinterpret_cast<uint2 *>(m)[i] = bf16x4_bits(x);
}

template <typename M>
__device__ __forceinline__ void adamw_at(float *p, const float *g, M *m, M *v, uint16_t *p16,
                                         size_t i, const adamw_args &a)
{
    float pi = p[i], mi = mom_ld(m, i), vi = mom_ld(v, i);
    adamw_one(pi, g[i], mi, vi, a);
    p[i] = pi;
    mom_st(m, i, mi);
    mom_st(v, i, vi);
    if (p16) p16[i] = (uint16_t)round_bf16_bits(pi);
}

// M: the moments' storage (float or uint16_t bf16 bits).
template <int VEC, typename M>
__global__ void adamw_kernel(float *p, const float *g, M *m, M *v, uint16_t *p16, size_t n,
                             adamw_args a)
{
    const size_t nv = n / VEC, stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < nv; i += stride) {
        if (VEC == 4) {
            float4 pp = reinterpret_cast<float4 *>(p)[i], mm = mom_ld4(m, i), vv = mom_ld4(v, i);
            const float4 gg = __ldcs(reinterpret_cast<const float4 *>(g) + i);
            adamw_one(pp.x, gg.x, mm.x, vv.x, a);
            adamw_one(pp.y, gg.y, mm.y, vv.y, a);
            adamw_one(pp.z, gg.z, mm.z, vv.z, a);
            adamw_one(pp.w, gg.w, mm.w, vv.w, a);
            reinterpret_cast<float4 *>(p)[i] = pp;
            mom_st4(m, i, mm);
            mom_st4(v, i, vv);
            if (p16) reinterpret_cast<uint2 *>(p16)[i] = bf16x4_bits(pp);
        } else {
            adamw_at(p, g, m, v, p16, i, a);
        }
    }
    // The tail past the last whole vector (VEC 4 only): thread i takes element nv * 4 + i.
    const size_t tail = nv * VEC + blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (VEC > 1 && tail < n) adamw_at(p, g, m, v, p16, tail, a);
}

// The vector path when p and g are 16-byte aligned, the moments 16 (fp32) or 8 (bf16), p16 8.
template <typename M>
static void adamw_launch(lb_backend *be, const char *op, float *p, const float *g, float gscale,
                         M *m, M *v, uint16_t *p16, size_t n, float lr, float beta1,
                         float beta2, float eps, float wd, int step)
{
    if (step < 1) lb_die("%s: step %d, steps count from 1", op, step);
    if (!n) return;
    lb_cuda_ctx *cx = lb_cuda(be);
    const adamw_args a = {gscale, lr, beta1, beta2, eps, wd,
                          (float)(1.0 - pow((double)beta1, step)),
                          (float)(1.0 - pow((double)beta2, step))};
    const uintptr_t mal = 4 * sizeof(M);
    const int vec = ((uintptr_t)p | (uintptr_t)g) % 16 == 0 &&
                    ((uintptr_t)m | (uintptr_t)v) % mal == 0 && (uintptr_t)p16 % 8 == 0 &&
                    n >= 4;
    if (vec)
        adamw_kernel<4, M><<<lb_grid(n / 4, 256, cx), 256, 0, cx->stream>>>(p, g, m, v, p16, n, a);
    else
        adamw_kernel<1, M><<<lb_grid(n, 256, cx), 256, 0, cx->stream>>>(p, g, m, v, p16, n, a);
    LB_CUDA_LAUNCHED(cx);
}

// The table's entries take argument structs (kernels.h); the kernels' hosts above take
// the fields.

static void cuda_linear_ce_bwd_op(lb_backend *be, const lb_linear_ce_args *a)
{
    if (a->logits16) {   // the gradient written over the bf16 logits, which the GEMMs read
        const int n = a->n, v = a->v, c = a->c;
        if (!a->stats) lb_die("linear_ce_bwd: needs the forward's row statistics");
        if (n < 0 || v < 0 || c < 0)
            lb_die("linear_ce_bwd: negative size (n %d, v %d, c %d)", n, v, c);
        lb_cuda_ctx *cx = lb_cuda(be);
        __nv_bfloat16 *l16 = (__nv_bfloat16 *)a->logits16;
        if (n > 0) {
            ce_bwd_kernel<__nv_bfloat16><<<n, CE_THREADS, 0, cx->stream>>>(
                l16, l16, a->stats, a->targets, a->dloss, NULL, v, (size_t)(v + 7) / 8 * 8,
                cx->err_dev);
            LB_CUDA_LAUNCHED(cx);
        }
        lb_gemm_args g[2] = {
            {0, 0, n, c, v, 1.0f, a->dx_beta, NULL, a->w, a->dx, 1, a->w16, a->logits16, NULL},
            {1, 0, v, c, n, 1.0f, a->dw_beta, NULL, a->x, a->dw, 1, NULL, a->logits16, NULL}};
        be->gemm_grouped(be, 2, g);
        return;
    }
    cuda_linear_ce_bwd(be, a->dx, a->dx_beta, a->dw, a->dw_beta, a->logits, a->stats, a->targets,
                       a->dloss, a->x, a->w, a->w16, a->n, a->v, a->c);
}

static void cuda_adamw(lb_backend *be, const lb_adamw_args *a)
{
    adamw_launch(be, "adamw", a->p, a->g, a->gscale, a->m, a->v, a->p16, a->n, a->lr, a->beta1,
                 a->beta2, a->eps, a->wd, a->step);
}

static void cuda_adamw16(lb_backend *be, const lb_adamw_args *a)
{
    adamw_launch(be, "adamw16", a->p, a->g, a->gscale, a->m16, a->v16, a->p16, a->n, a->lr,
                 a->beta1, a->beta2, a->eps, a->wd, a->step);
}

extern "C" void lb_cuda_init_optim(lb_backend *be)
{
    be->cross_entropy_fwd = cuda_cross_entropy_fwd;
    be->cross_entropy_fwd16 = cuda_cross_entropy_fwd16;
    be->cross_entropy_bwd = cuda_cross_entropy_bwd;
    be->cross_entropy_bwd_rows = cuda_cross_entropy_bwd_rows;
    be->linear_ce_bwd = cuda_linear_ce_bwd_op;
    be->adamw = cuda_adamw;
    be->adamw16 = cuda_adamw16;
}
