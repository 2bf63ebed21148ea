// lt.cu: the cuBLASLt pieces gemm.cu and gemm_q.cu share: a problem's descriptors, the
// heuristic's preferences and first answer, and deterministic mode's rules on an algorithm (no
// split-K, no workspace). The callers judge cuBLASLt's statuses themselves: gemm.cu's bf16 path
// falls back on any failure, gemm_q.cu on NOT_SUPPORTED and INVALID_VALUE, gemm.cu's fp32 path
// dies.
#include "kernels/cuda/cuda.cuh"

#include <string.h>

extern "C" void lb_lt_descs_init(lb_lt_descs *d, int trans_a, int trans_b, cudaDataType_t ty,
                                 uint64_t a_rows, uint64_t a_cols, int64_t lda, uint64_t b_rows,
                                 uint64_t b_cols, int64_t ldb, uint64_t c_rows, uint64_t c_cols,
                                 int64_t ldc)
{
    LB_CUBLAS_CHECK(cublasLtMatmulDescCreate(&d->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t opa = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasOperation_t opb = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    LB_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d->op, CUBLASLT_MATMUL_DESC_TRANSA, &opa,
                                                   sizeof opa));
    LB_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d->op, CUBLASLT_MATMUL_DESC_TRANSB, &opb,
                                                   sizeof opb));
    LB_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d->a, ty, a_rows, a_cols, lda));
    LB_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d->b, ty, b_rows, b_cols, ldb));
    LB_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d->c, CUDA_R_32F, c_rows, c_cols, ldc));
}

extern "C" void lb_lt_descs_free(const lb_lt_descs *d)
{
    LB_CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(d->a));
    LB_CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(d->b));
    LB_CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(d->c));
    LB_CUBLAS_CHECK(cublasLtMatmulDescDestroy(d->op));
}

extern "C" cublasLtMatmulPreference_t lb_lt_pref(const lb_cuda_ctx *cx, int det, uint32_t al_a,
                                                 uint32_t al_b, uint32_t al_c, uint64_t impl)
{
    cublasLtMatmulPreference_t pref;
    LB_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    uint64_t ws = det ? 0 : cx->workspace_bytes;
    LB_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    LB_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof al_a));
    LB_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof al_b));
    LB_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof al_c));
    LB_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof al_c));
    if (det) {
        uint32_t red = CUBLASLT_REDUCTION_SCHEME_NONE;
        LB_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
            pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &red, sizeof red));
    }
    if (impl != LB_LT_IMPL_ALL)
        LB_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_IMPL_MASK,
                                                             &impl, sizeof impl));
    return pref;
}

extern "C" int lb_lt_heuristic(const lb_cuda_ctx *cx, const lb_lt_descs *d,
                               cublasLtMatmulPreference_t pref, cublasLtMatmulHeuristicResult_t *r,
                               cublasStatus_t *status)
{
    memset(r, 0, sizeof *r);
    int got = 0;
    cublasStatus_t s =
        cublasLtMatmulAlgoGetHeuristic(cx->lt, d->op, d->a, d->b, d->c, d->c, pref, 1, r, &got);
    if (status) *status = s;
    return s == CUBLAS_STATUS_SUCCESS && got >= 1 && r->state == CUBLAS_STATUS_SUCCESS;
}

extern "C" int lb_lt_fits(const lb_cuda_ctx *cx, const lb_lt_descs *d,
                          const cublasLtMatmulAlgo_t *algo, cublasStatus_t *status)
{
    cublasLtMatmulHeuristicResult_t r;
    memset(&r, 0, sizeof r);
    cublasStatus_t s = cublasLtMatmulAlgoCheck(cx->lt, d->op, d->a, d->b, d->c, d->c, algo, &r);
    if (status) *status = s;
    return s == CUBLAS_STATUS_SUCCESS && r.workspaceSize == 0;
}

extern "C" void lb_lt_no_splitk(cublasLtMatmulAlgo_t *algo)
{
    int32_t one = 1;
    uint32_t none = CUBLASLT_REDUCTION_SCHEME_NONE;
    LB_CUBLAS_CHECK(cublasLtMatmulAlgoConfigSetAttribute(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                                                         &one, sizeof one));
    LB_CUBLAS_CHECK(cublasLtMatmulAlgoConfigSetAttribute(
        algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &none, sizeof none));
}
