// ops_optim.cu: cross-entropy over fp32 logits and the AdamW update for the CUDA backend.
//
// Cross-entropy: one block per row (vocabularies up to 151936 and beyond), CE_THREADS threads
// striding over the row. The row max is exact in any order; the exponential sum takes each
// exp(l - max) in fp32 (expf, a few ulp) and adds them in double, thread partials in stride
// order then the block's fixed tree, so a row's loss depends on that row alone and is bitwise
// reproducible. The CPU reference takes exp in double; the difference is below fp32 rounding
// of the loss (tests/test_backend_ops.c states the bound).
#include "kernels/cuda/cuda.cuh"

#include <math.h>

#define CE_THREADS 512

// Row statistics shared by the forward and the backward: max m and sum of exp(l - m).
template <typename T>
__device__ __forceinline__ void ce_row_stats(const T *l, int v, float *m_out, double *sum_out)
{
    float m = -INFINITY;
    for (int j = threadIdx.x; j < v; j += CE_THREADS) m = fmaxf(m, lb_ld(l + j));
    m = lb_block_max<CE_THREADS>(m);
    double s = 0.0;
    for (int j = threadIdx.x; j < v; j += CE_THREADS) s += (double)expf(lb_ld(l + j) - m);
    s = lb_block_sum<CE_THREADS>(s);
    *m_out = m;
    *sum_out = s;
}

// loss_i = m + log(sum) - l[target]; 0 where the target is negative; NaN (and a reported
// error) where it is >= v.
template <typename T>
__global__ void __launch_bounds__(CE_THREADS)
ce_fwd_kernel(float *loss, const T *logits, const int32_t *targets, int v,
              unsigned long long *err)
{
    const int i = blockIdx.x, tgt = targets[i];
    if (tgt < 0 || tgt >= v) {
        if (threadIdx.x == 0) {
            if (tgt >= v) lb_report(err, LB_CERR_CE_FWD_TARGET, tgt);
            loss[i] = tgt < 0 ? 0.0f : NAN;
        }
        return;
    }
    const T *l = logits + (size_t)i * v;
    float m;
    double s;
    ce_row_stats(l, v, &m, &s);
    if (threadIdx.x == 0) loss[i] = (float)((double)m + log(s) - (double)lb_ld(l + tgt));
}

// dlogits = dloss (softmax - onehot), p = exp(l - m) / sum. Every element is read, then
// written, by the same thread after the row statistics are complete (the reductions end with
// a barrier), so dlogits may alias logits.
// dloss_rows: one weight per row (cross_entropy_bwd_rows), or NULL for the scalar dloss.
template <typename T>
__global__ void __launch_bounds__(CE_THREADS)
ce_bwd_kernel(T *dlogits, const T *logits, const int32_t *targets, float dloss,
              const float *dloss_rows, int v, unsigned long long *err)
{
    const int i = blockIdx.x, tgt = targets[i];
    if (dloss_rows) dloss = dloss_rows[i];
    const T *l = logits + (size_t)i * v;
    T *dl = dlogits + (size_t)i * v;
    if (tgt < 0 || tgt >= v) {
        if (tgt >= v && threadIdx.x == 0) lb_report(err, LB_CERR_CE_BWD_TARGET, tgt);
        const float fill = tgt < 0 ? 0.0f : NAN;
        for (int j = threadIdx.x; j < v; j += CE_THREADS) lb_st(dl + j, fill);
        return;
    }
    float m;
    double s;
    ce_row_stats(l, v, &m, &s);
    const double inv = 1.0 / s;
    for (int j = threadIdx.x; j < v; j += CE_THREADS) {
        double p = (double)expf(lb_ld(l + j) - m) * inv;
        lb_st(dl + j, (float)((double)dloss * (p - (j == tgt ? 1.0 : 0.0))));
    }
}

static void ce_check(const char *what, int n, int v)
{
    if (n < 0 || v < 0) lb_die("%s: negative size (n %d, v %d)", what, n, v);
}

static void cuda_cross_entropy_fwd(lb_backend *be, float *loss, const float *logits,
                                   const int32_t *targets, int n, int v)
{
    ce_check("cross_entropy_fwd", n, v);
    if (!n) return;
    lb_cuda_ctx *cx = lb_cuda(be);
    ce_fwd_kernel<float><<<n, CE_THREADS, 0, cx->stream>>>(loss, logits, targets, v,
                                                           cx->err_dev);
    LB_CUDA_LAUNCHED(cx);
}

static void cuda_cross_entropy_bwd(lb_backend *be, float *dlogits, const float *logits,
                                   const int32_t *targets, float dloss, int n, int v)
{
    ce_check("cross_entropy_bwd", n, v);
    if (!n) return;
    lb_cuda_ctx *cx = lb_cuda(be);
    ce_bwd_kernel<float><<<n, CE_THREADS, 0, cx->stream>>>(dlogits, logits, targets, dloss,
                                                           NULL, v, cx->err_dev);
    LB_CUDA_LAUNCHED(cx);
}

static void cuda_cross_entropy_bwd_rows(lb_backend *be, float *dlogits, const float *logits,
                                        const int32_t *targets, const float *dloss, int n, int v)
{
    ce_check("cross_entropy_bwd_rows", n, v);
    if (!n) return;
    lb_cuda_ctx *cx = lb_cuda(be);
    ce_bwd_kernel<float><<<n, CE_THREADS, 0, cx->stream>>>(dlogits, logits, targets, 0.0f,
                                                           dloss, v, cx->err_dev);
    LB_CUDA_LAUNCHED(cx);
}

// --- AdamW -----------------------------------------------------------------------------------
// The CPU reference's expressions, one thread per element; bias corrections computed once on
// the host in double and rounded to fp32, as the CPU does. Parameters and moments are fp32
// master copies (never bf16), so this kernel is not templated.
__global__ void adamw_kernel(float *p, const float *g, float *m, float *v, size_t n, float lr,
                             float beta1, float beta2, float eps, float wd, float bc1, float bc2)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float gi = g[i];
        float mi = beta1 * m[i] + (1.0f - beta1) * gi;
        float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        float mhat = mi / bc1, vhat = vi / bc2;
        p[i] -= lr * (mhat / (sqrtf(vhat) + eps) + wd * p[i]);
    }
}

static void cuda_adamw(lb_backend *be, float *p, const float *g, float *m, float *v, size_t n,
                       float lr, float beta1, float beta2, float eps, float wd, int step)
{
    if (step < 1) lb_die("adamw: step %d, steps count from 1", step);
    if (!n) return;
    lb_cuda_ctx *cx = lb_cuda(be);
    float bc1 = (float)(1.0 - pow((double)beta1, step));
    float bc2 = (float)(1.0 - pow((double)beta2, step));
    adamw_kernel<<<lb_grid(n, 256, cx), 256, 0, cx->stream>>>(p, g, m, v, n, lr, beta1, beta2,
                                                              eps, wd, bc1, bc2);
    LB_CUDA_LAUNCHED(cx);
}

extern "C" void lb_cuda_init_optim(lb_backend *be)
{
    be->cross_entropy_fwd = cuda_cross_entropy_fwd;
    be->cross_entropy_bwd = cuda_cross_entropy_bwd;
    be->cross_entropy_bwd_rows = cuda_cross_entropy_bwd_rows;
    be->adamw = cuda_adamw;
}
