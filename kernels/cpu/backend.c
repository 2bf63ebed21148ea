// backend.c: the CPU reference backend's memory functions and its constructor.
//
// Buffers are plain host memory, so upload, download and copy are memcpy and sync has nothing
// to wait for. The operations live in ops_*.c and are installed by lb_cpu_init_*.
#include "kernels/cpu/cpu.h"
#include "kernels/common.h"

#include <cblas.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

// 64-byte alignment: a cache line and an AVX-512 vector, so OpenBLAS and the compiler's
// vectorised loops never straddle lines at the start of a buffer.
#define LB_CPU_ALIGN 64

static void *cpu_alloc(lb_backend *be, size_t bytes)
{
    size_t rounded = (bytes + LB_CPU_ALIGN - 1) / LB_CPU_ALIGN * LB_CPU_ALIGN;
    if (rounded < bytes) lb_die("cpu alloc: size overflow (%zu bytes)", bytes);
    void *p = NULL;
    if (posix_memalign(&p, LB_CPU_ALIGN, rounded ? rounded : LB_CPU_ALIGN) != 0 || !p)
        lb_die("cpu alloc: out of host memory: %zu bytes%s (`lowbit info` prints what a "
               "configuration needs and which settings lower it)", bytes, lb_alloc_for());
    memset(p, 0, rounded);
    return p;
}

static void cpu_free(lb_backend *be, void *p) { free(p); }

static void cpu_upload(lb_backend *be, void *dst, const void *src_host, size_t bytes)
{
    if (bytes) memcpy(dst, src_host, bytes);
}

static void cpu_download(lb_backend *be, void *dst_host, const void *src, size_t bytes)
{
    if (bytes) memcpy(dst_host, src, bytes);
}

// memmove: callers may copy within one buffer.
static void cpu_copy(lb_backend *be, void *dst, const void *src, size_t bytes)
{
    if (bytes && dst != src) memmove(dst, src, bytes);
}

static void cpu_zero(lb_backend *be, void *p, size_t bytes)
{
    if (bytes) memset(p, 0, bytes);
}

static void *cpu_host_alloc(lb_backend *be, size_t bytes) { return cpu_alloc(be, bytes); }

static void cpu_host_free(lb_backend *be, void *p) { free(p); }

static void cpu_sync(lb_backend *be) {}   // every operation completes before it returns

// The host's available physical memory.
static size_t cpu_mem_free(lb_backend *be)
{
    long pages = sysconf(_SC_AVPHYS_PAGES), size = sysconf(_SC_PAGESIZE);
    return pages > 0 && size > 0 ? (size_t)pages * (size_t)size : 0;
}

static void cpu_destroy(lb_backend *be)
{
    if (!be) return;
    free(((lb_cpu_ctx *)be->ctx)->round);
    free(((lb_cpu_ctx *)be->ctx)->c32);
    free(be->ctx);
    free(be);
}

// A recording is the function itself: its operations run when they are queued, so running
// fn again is the replay (the same operations on the same memory, host code included).
struct lb_graph {
    void (*fn)(void *);
    void *arg;
};

static struct lb_graph *cpu_graph_record(lb_backend *be, void (*fn)(void *), void *arg)
{
    fn(arg);
    struct lb_graph *g = lb_malloc(sizeof *g);
    g->fn = fn, g->arg = arg;
    return g;
}

static int cpu_graph_launch(lb_backend *be, struct lb_graph *g)
{
    g->fn(g->arg);
    return 1;
}

static void cpu_graph_free(lb_backend *be, struct lb_graph *g) { free(g); }

// The memory and control entries, this file's.
static void cpu_init_memory(lb_backend *be)
{
#define X(ret, name, params, args) be->name = cpu_##name;
    LB_OPS_MEMORY(X) LB_OPS_CONTROL(X)
#undef X
}

lb_backend *lb_backend_cpu_create(int threads, char *err, size_t errlen)
{
    if (err && errlen) err[0] = '\0';
    if (threads < 0) {
        if (err && errlen) snprintf(err, errlen, "cpu backend: threads must be >= 0, not %d",
                                    threads);
        return NULL;
    }
    if (threads == 0) threads = omp_get_num_procs();
    if (threads < 1) threads = 1;

    lb_cpu_ctx *ctx = lb_calloc(1, sizeof *ctx);
    ctx->threads = threads;
    static void (*const init[])(lb_backend *) = {
        cpu_init_memory, lb_cpu_init_basic, lb_cpu_init_attention, lb_cpu_init_moe,
        lb_cpu_init_optim, lb_cpu_init_quant, lb_cpu_init_sample,
    };
    lb_backend *be = lb_backend_new("cpu", ctx, init, (int)(sizeof init / sizeof *init));
    snprintf(be->device, sizeof be->device, "host, %d thread%s", threads, threads == 1 ? "" : "s");

    // Process-wide defaults for code outside the table; the operations themselves name the
    // backend's count on every parallel loop and BLAS call (see lb_cpu_threads).
    omp_set_num_threads(threads);
    openblas_set_num_threads(threads);
    return be;
}
