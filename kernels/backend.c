// backend.c: backend selection shared by both builds.
#include <stdio.h>
#include "lb_autoconf.h"
#include "kernels/kernels.h"

#ifdef LB_HAVE_CUDA
// The CUDA kernel set is its own piece of work (doc/backends.md); this build can query devices
// (lowbit info) but has no CUDA operations to fill the table with yet.
int lb_cuda_device_count(void);
lb_backend *lb_backend_cuda_create(int device, char *err, size_t errlen)
{
    int n = lb_cuda_device_count();
    if (n <= 0)
        snprintf(err, errlen, "backend cuda: no CUDA device is visible");
    else if (device < 0 || device >= n)
        snprintf(err, errlen, "backend cuda: device %d does not exist (%d visible)", device, n);
    else
        snprintf(err, errlen,
                 "backend cuda: this release has no CUDA kernel set yet; use backend = cpu");
    return NULL;
}
#else
lb_backend *lb_backend_cuda_create(int device, char *err, size_t errlen)
{
    (void)device;
    snprintf(err, errlen,
             "backend cuda: lowbit was built without CUDA (configure found no nvcc)");
    return NULL;
}
#endif
