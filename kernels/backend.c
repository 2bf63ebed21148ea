// backend.c: what every backend shares: a new table, the operations a backend lacks, the names.
//
// With CUDA (configure found nvcc) lb_backend_cuda_create lives in kernels/cuda/backend.cu;
// without it, the one below says why there is no CUDA backend.
#include <stdio.h>
#include <stdlib.h>
#include "lb_autoconf.h"
#include "kernels/common.h"
#include "kernels/kernels.h"
#include "kernels/quant/quant.h"

static const char *const op_names[LB_OP_COUNT] = {
#define X(ret, name, params, args) #name,
    LB_OPS(X)
#undef X
};

const char *lb_op_name(lb_op op)
{
    return (int)op >= 0 && op < LB_OP_COUNT ? op_names[op] : NULL;
}

// What stands in an entry the backend left empty: one function per operation, with the
// operation's own signature, that names the backend and the operation.
static void lacks(const lb_backend *be, const char *op)
    __attribute__((noreturn));
static void lacks(const lb_backend *be, const char *op)
{
    lb_die("backend %s lacks op %s", be->name, op);
}
#define X(ret, name, params, args) \
    static ret lacks_##name params { lacks(be, #name); }
LB_OPS(X)
#undef X

lb_backend *lb_backend_new(const char *name, void *ctx, void (*const *init)(lb_backend *),
                           int n)
{
    lb_backend *be = lb_calloc(1, sizeof *be);
    be->name = name;
    be->ctx = ctx;
    be->deterministic = 1;
    for (int i = 0; i < n; i++) init[i](be);
#define X(ret, name, params, args) \
    if (!be->name) be->name = lacks_##name;
    LB_OPS(X)
#undef X
    return be;
}

// Expert j's first row under counts_host, checking that the counts fit x->rows.
static size_t *experts_offsets(const lb_gemm_experts_args *x, const int *counts_host)
{
    if (x->e < 0 || x->rows < 0 || x->n < 0 || x->k < 0)
        lb_die("gemm_experts: negative size (e %d, rows %d, n %d, k %d)", x->e, x->rows, x->n,
               x->k);
    size_t *off = lb_calloc((size_t)x->e + 1, sizeof *off);
    for (int j = 0; j < x->e; j++) {
        const int m = counts_host[j];
        if (m < 0 || off[j] + (size_t)m > (size_t)x->rows)
            lb_die("gemm_experts: expert %d's %d rows pass the %d rows given", j, m, x->rows);
        off[j + 1] = off[j] + (size_t)m;
    }
    return off;
}

lb_gemm_args *lb_experts_groups(const lb_gemm_experts_args *x, const int *counts_host)
{
    size_t *off = experts_offsets(x, counts_host);
    const size_t lda = ((size_t)x->k + 7) / 8 * 8, ldc = ((size_t)x->n + 7) / 8 * 8;
    lb_gemm_args *g = lb_calloc(x->e ? (size_t)x->e : 1, sizeof *g);
    for (int j = 0; j < x->e; j++)
        g[j] = (lb_gemm_args){0, 1, counts_host[j], x->n, x->k, 1.0f, 0.0f, NULL, NULL,
                              x->c ? x->c + off[j] * x->n : NULL, 1,
                              x->b16 + (size_t)j * x->n * lda, x->a16 + off[j] * lda,
                              x->c16 ? x->c16 + off[j] * ldc : NULL};
    free(off);
    return g;
}

lb_gemm_q_args *lb_experts_qgroups(const lb_gemm_experts_args *x, const int *counts_host,
                                   lb_qmat *views)
{
    size_t *off = experts_offsets(x, counts_host);
    const size_t ldc = ((size_t)x->n + 7) / 8 * 8;
    lb_gemm_q_args *g = lb_calloc(x->e ? (size_t)x->e : 1, sizeof *g);
    for (int j = 0; j < x->e; j++) {
        const int m = counts_host[j];
        // an expert without rows is never read: its view borrows row 0's layout
        if (m) views[j] = lb_qmat_rows(x->qa, (int)off[j], m);
        else views[j] = *x->qa, views[j].rows = views[j].srows = 0;
        g[j] = (lb_gemm_q_args){m, x->n, x->k, 1.0f, 0.0f, &views[j], &x->qb[j],
                                x->c ? x->c + off[j] * x->n : NULL,
                                x->c16 ? x->c16 + off[j] * ldc : NULL};
    }
    free(off);
    return g;
}

int lb_backend_supports(const lb_backend *be, lb_op op)
{
    switch (op) {
#define X(ret, name, params, args) \
    case LB_OP_##name: return be->name && be->name != lacks_##name;
        LB_OPS(X)
#undef X
    default: return 0;
    }
}

#ifndef LB_HAVE_CUDA
lb_backend *lb_backend_cuda_create(int device, char *err, size_t errlen)
{
    (void)device;
    if (err && errlen)
        snprintf(err, errlen,
                 "backend cuda: lowbit was built without CUDA (configure found no nvcc)");
    return NULL;
}
#endif
