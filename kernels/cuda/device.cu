// device.cu: CUDA device queries for `lowbit info` and `lowbit bench`. Every CUDA call is
// checked with file:line.
#include <cuda_runtime.h>
#include <stdio.h>
#include <string.h>

extern "C" {
#include "kernels/common.h"   // lb_source_path

// Number of visible devices; 0 when the driver is missing or no GPU is present.
int lb_cuda_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();   // clear the sticky "no device" error
        return 0;
    }
    return n;
}

// Peak device memory in use by this process since the first call, from cudaMemGetInfo
// (sampled: every call updates the peak with the current use).
size_t lb_cuda_mem_peak(void)
{
    static size_t peak;
    size_t free_b = 0, total = 0;
    if (cudaMemGetInfo(&free_b, &total) == cudaSuccess && total - free_b > peak) peak = total - free_b;
    return peak;
}

// One line describing device i into buf ("NVIDIA H200, sm_90, 139.8 GiB"); -1 on failure.
int lb_cuda_device_describe(int i, char *buf, size_t len)
{
    cudaDeviceProp p;
    cudaError_t rc = cudaGetDeviceProperties(&p, i);
    if (rc != cudaSuccess) {
        snprintf(buf, len, "%s:%d: cudaGetDeviceProperties: %s", lb_source_path(__FILE__),
                 __LINE__, cudaGetErrorString(rc));
        return -1;
    }
    snprintf(buf, len, "%s, sm_%d%d, %.1f GiB", p.name, p.major, p.minor,
             (double)p.totalGlobalMem / (1024.0 * 1024.0 * 1024.0));
    return 0;
}

}
