// backend.c: what every backend shares: a new table, the operations a backend lacks, the names.
//
// With CUDA (configure found nvcc) lb_backend_cuda_create lives in kernels/cuda/backend.cu;
// without it, the one below says why there is no CUDA backend.
#include <stdio.h>
#include "lb_autoconf.h"
#include "kernels/common.h"
#include "kernels/kernels.h"

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
