// backend.c: backend selection shared by both builds.
//
// With CUDA (configure found nvcc) lb_backend_cuda_create lives in kernels/cuda/backend.cu;
// without it, this stub says why there is no CUDA backend.
#include <stdio.h>
#include "lb_autoconf.h"
#include "kernels/kernels.h"

#ifndef LB_HAVE_CUDA
lb_backend *lb_backend_cuda_create(int device, char *err, size_t errlen)
{
    (void)device;
    if (err && errlen)
        snprintf(err, errlen,
                 "backend cuda: lowbit was built without CUDA (configure found no nvcc)");
    return NULL;
}
#else
// ISO C forbids an empty translation unit.
typedef int lb_backend_c_not_empty;
#endif
