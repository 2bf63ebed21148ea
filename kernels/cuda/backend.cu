// backend.cu: the CUDA backend's constructor, memory functions and shared helpers.
//
// One device, one stream, one cuBLASLt handle per backend. Buffers are device memory from
// cudaMalloc; copies and fills are queued on the stream, so they are ordered with the
// operations. upload and download return only when the host buffer may be reused or read
// (they wait for the stream); copy and zero do not wait.
#include "kernels/cuda/cuda.cuh"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" int lb_cuda_device_count(void);   // device.cu

// Names of the input errors kernels record (cuda.cuh, LB_CERR_*), for the message.
static const char *const cerr_what[LB_CERR_COUNT] = {
    "",
    "embedding_fwd: negative token id",
    "embedding_bwd: negative token id",
    "router_topk_fwd: non-finite logit in row",
    "router_topk_bwd: expert index out of range",
    "moe_aux_loss: expert index out of range",
    "moe_plan: expert index out of range",
    "moe_permute: plan row out of range",
    "moe_permute_bwd: plan row out of range",
    "moe_combine: plan row out of range",
    "moe_combine_bwd: plan row out of range",
    "cross_entropy_fwd: target >= vocabulary size",
    "cross_entropy_bwd: target >= vocabulary size",
    "kv_append / attention_cached: slot or position outside the KV cache",
    "gemm_experts: the experts' counts pass the rows given (expert)",
};

extern "C" void lb_cuda_wait(lb_cuda_ctx *cx, const char *file, int line)
{
    cx->waits++;
    LB_CUDA_CHECK(cudaMemcpyAsync(cx->err_host, cx->err_dev, sizeof *cx->err_dev,
                                  cudaMemcpyDeviceToHost, cx->stream));
    cudaError_t e = cudaStreamSynchronize(cx->stream);
    if (e != cudaSuccess)
        lb_die_at(file, line, "cuda: queued work failed: %s (%s)", cudaGetErrorString(e),
                  cudaGetErrorName(e));
    unsigned long long w = *cx->err_host;
    if (w) {
        unsigned code = (unsigned)(w >> 32);
        int value = (int)(unsigned)(w & 0xffffffffu);
        lb_die_at(file, line, "cuda: %s (value %d)",
                  code < LB_CERR_COUNT ? cerr_what[code] : "unknown input error", value);
    }
}

extern "C" void *lb_cuda_scratch(lb_cuda_ctx *cx, size_t bytes)
{
    if (bytes <= cx->scratch_bytes && cx->scratch) return cx->scratch;
    // Earlier queued work may still read the old scratch: wait before freeing it.
    LB_CUDA_CHECK(cudaStreamSynchronize(cx->stream));
    cx->waits++;
    LB_CUDA_CHECK(cudaFree(cx->scratch));
    cx->mem_gen++;
    size_t want = bytes < ((size_t)1 << 20) ? ((size_t)1 << 20) : bytes;
    want += want / 4;   // headroom, so slowly growing sizes do not reallocate every call
    cx->scratch = lb_cuda_malloc_what(cx, want, 0, "the scratch (the largest operation's "
                                      "workspace so far, with a quarter's headroom)");
    cx->scratch_bytes = want;
    return cx->scratch;
}

extern "C" void *lb_cuda_malloc_what(lb_cuda_ctx *cx, size_t bytes, int async, const char *what)
{
    void *p = NULL;
    cudaError_t e = async ? cudaMallocAsync(&p, bytes, cx->stream) : cudaMalloc(&p, bytes);
    if (e != cudaSuccess)
        lb_die("cuda: %zu bytes (%.2f GiB) for %s on device %d: %s (`lowbit info` prints what a "
               "configuration needs and which settings lower it: train.micro_batch, "
               "train.seq_len, train.ce_chunk, train.recompute)", bytes,
               (double)bytes / (1 << 30), what, cx->device, cudaGetErrorString(e));
    return p;
}

extern "C" void *lb_cuda_host_stage(lb_cuda_ctx *cx, size_t bytes)
{
    if (bytes <= cx->host_stage_bytes && cx->host_stage) return cx->host_stage;
    LB_CUDA_CHECK(cudaStreamSynchronize(cx->stream));
    cx->waits++;
    LB_CUDA_CHECK(cudaFreeHost(cx->host_stage));
    size_t want = bytes < 4096 ? 4096 : bytes;
    LB_CUDA_CHECK(cudaHostAlloc(&cx->host_stage, want, cudaHostAllocDefault));
    cx->host_stage_bytes = want;
    return cx->host_stage;
}

// --- memory functions ------------------------------------------------------------------------

// Zero-filled, as the table promises; a zero-byte request still gets a distinct, freeable
// pointer (the CPU backend's behaviour).
static void *cuda_alloc(lb_backend *be, size_t bytes)
{
    lb_cuda_ctx *cx = lb_cuda(be);
    size_t n = bytes ? bytes : 256;
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, n);
    if (e != cudaSuccess || !p)
        lb_die("cuda alloc: %zu bytes%s on device %d: %s (`lowbit info` prints what a "
               "configuration needs and which settings lower it)", bytes, lb_alloc_for(),
               cx->device, cudaGetErrorString(e));
    LB_CUDA_CHECK(cudaMemsetAsync(p, 0, n, cx->stream));
    cx->mem_gen++;
    return p;
}

static void cuda_free(lb_backend *be, void *p)
{
    if (!p) return;
    // Work queued on the stream may still use p.
    LB_CUDA_CHECK(cudaStreamSynchronize(lb_cuda(be)->stream));
    LB_CUDA_CHECK(cudaFree(p));
    lb_cuda(be)->mem_gen++;
    lb_cuda(be)->waits++;
}

// Waits: the caller may reuse or free src_host as soon as this returns (pageable or pinned).
static void cuda_upload(lb_backend *be, void *dst, const void *src_host, size_t bytes)
{
    if (!bytes) return;
    lb_cuda_ctx *cx = lb_cuda(be);
    LB_CUDA_CHECK(cudaMemcpyAsync(dst, src_host, bytes, cudaMemcpyHostToDevice, cx->stream));
    LB_CUDA_WAIT(cx);
}

static void cuda_download(lb_backend *be, void *dst_host, const void *src, size_t bytes)
{
    if (!bytes) return;
    lb_cuda_ctx *cx = lb_cuda(be);
    LB_CUDA_CHECK(cudaMemcpyAsync(dst_host, src, bytes, cudaMemcpyDeviceToHost, cx->stream));
    LB_CUDA_WAIT(cx);
}

// Callers may copy within one buffer (memmove semantics, as the CPU backend); cudaMemcpy
// leaves overlapping ranges undefined, so those go through scratch.
static void cuda_copy(lb_backend *be, void *dst, const void *src, size_t bytes)
{
    if (!bytes || dst == src) return;
    lb_cuda_ctx *cx = lb_cuda(be);
    const char *d = (const char *)dst, *s = (const char *)src;
    if (d < s + bytes && s < d + bytes) {
        void *tmp = lb_cuda_scratch(cx, bytes);
        LB_CUDA_CHECK(cudaMemcpyAsync(tmp, src, bytes, cudaMemcpyDeviceToDevice, cx->stream));
        LB_CUDA_CHECK(cudaMemcpyAsync(dst, tmp, bytes, cudaMemcpyDeviceToDevice, cx->stream));
    } else {
        LB_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cx->stream));
    }
}

static void cuda_zero(lb_backend *be, void *p, size_t bytes)
{
    if (!bytes) return;
    LB_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, lb_cuda(be)->stream));
}

// Pinned, so copies to and from it are DMA at the link's speed rather than staged by the
// driver through its own pinned buffer.
static void *cuda_host_alloc(lb_backend *be, size_t bytes)
{
    void *p = NULL;
    LB_CUDA_CHECK(cudaSetDevice(lb_cuda(be)->device));
    LB_CUDA_CHECK(cudaHostAlloc(&p, bytes ? bytes : 64, cudaHostAllocDefault));
    memset(p, 0, bytes);
    return p;
}

static void cuda_host_free(lb_backend *be, void *p)
{
    if (p) LB_CUDA_CHECK(cudaFreeHost(p));
}

static void cuda_sync(lb_backend *be) { LB_CUDA_WAIT(lb_cuda(be)); }

static size_t cuda_mem_free(lb_backend *be)
{
    size_t free_b = 0, total = 0;
    LB_CUDA_CHECK(cudaSetDevice(lb_cuda(be)->device));
    LB_CUDA_CHECK(cudaMemGetInfo(&free_b, &total));
    return free_b;
}

// --- graphs -----------------------------------------------------------------------------------
//
// A recording is a CUDA graph captured from the stream: its kernels, copies and cuBLASLt calls
// with their arguments as fn queued them, pointers included. So it is launched only while no
// device buffer has been allocated or freed since (mem_gen): a grown scratch or a reallocated
// buffer would leave it naming freed memory. fn first runs as a plain call: if it waited for
// the stream (a download: the fallback of an op that needs a count on the host) it cannot be
// captured, and nothing is recorded; if it allocated, the capture pass finds the buffers.
struct lb_graph {
    cudaGraphExec_t exec;
    unsigned long long gen;   // mem_gen at the recording
};

static struct lb_graph *cuda_graph_record(lb_backend *be, void (*fn)(void *), void *arg)
{
    lb_cuda_ctx *cx = lb_cuda(be);
    const unsigned long long waits = cx->waits;
    fn(arg);
    if (!cx->graphs || cx->waits != waits) return NULL;
    const unsigned long long gen = cx->mem_gen;
    cudaGraph_t graph;
    LB_CUDA_CHECK(cudaStreamBeginCapture(cx->stream, cudaStreamCaptureModeThreadLocal));
    fn(arg);
    LB_CUDA_CHECK(cudaStreamEndCapture(cx->stream, &graph));
    if (cx->mem_gen != gen) {   // fn allocated again: no fixed buffers to record
        LB_CUDA_CHECK(cudaGraphDestroy(graph));
        return NULL;
    }
    struct lb_graph *g = (struct lb_graph *)lb_malloc(sizeof *g);
    LB_CUDA_CHECK(cudaGraphInstantiate(&g->exec, graph, 0));
    LB_CUDA_CHECK(cudaGraphDestroy(graph));
    g->gen = gen;
    return g;
}

static int cuda_graph_launch(lb_backend *be, struct lb_graph *g)
{
    lb_cuda_ctx *cx = lb_cuda(be);
    if (g->gen != cx->mem_gen) return 0;
    LB_CUDA_CHECK(cudaGraphLaunch(g->exec, cx->stream));
    return 1;
}

static void cuda_graph_free(lb_backend *be, struct lb_graph *g)
{
    if (!g) return;
    LB_CUDA_CHECK(cudaGraphExecDestroy(g->exec));
    free(g);
}

static void cuda_destroy(lb_backend *be)
{
    if (!be) return;
    lb_cuda_ctx *cx = lb_cuda(be);
    LB_CUDA_CHECK(cudaSetDevice(cx->device));
    LB_CUDA_WAIT(cx);
    lb_cuda_gemm_destroy(cx);
    lb_cuda_gemm_q_destroy(cx);
    LB_CUBLAS_CHECK(cublasLtDestroy(cx->lt));
    LB_CUDA_CHECK(cudaFree(cx->workspace));
    LB_CUDA_CHECK(cudaFree(cx->scratch));
    LB_CUDA_CHECK(cudaFree(cx->err_dev));
    LB_CUDA_CHECK(cudaFreeHost(cx->err_host));
    LB_CUDA_CHECK(cudaFreeHost(cx->host_stage));
    LB_CUDA_CHECK(cudaStreamDestroy(cx->stream));
    free(cx);
    free(be);
}

// The memory and control entries, this file's.
static void cuda_init_memory(lb_backend *be)
{
#define X(ret, name, params, args) be->name = cuda_##name;
    LB_OPS_MEMORY(X) LB_OPS_CONTROL(X)
#undef X
}

// cuBLASLt's recommended workspace on Hopper (cuBLAS documentation: 32 MiB for sm_90).
#define LB_CUDA_WORKSPACE ((size_t)32 << 20)

extern "C" lb_backend *lb_backend_cuda_create(int device, char *err, size_t errlen)
{
    if (err && errlen) err[0] = '\0';
    int n = lb_cuda_device_count();
    if (n <= 0) {
        if (err && errlen) snprintf(err, errlen, "backend cuda: no CUDA device is visible");
        return NULL;
    }
    if (device < 0 || device >= n) {
        if (err && errlen)
            snprintf(err, errlen, "backend cuda: device %d does not exist (%d visible)", device,
                     n);
        return NULL;
    }
    cudaDeviceProp prop;
    LB_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    // The build embeds sm_90a code and compute_90 PTX (configure's NVCCFLAGS): older chips
    // cannot run it.
    if (prop.major < 9) {
        if (err && errlen)
            snprintf(err, errlen,
                     "backend cuda: device %d (%s) is sm_%d%d; this build needs sm_90 or newer",
                     device, prop.name, prop.major, prop.minor);
        return NULL;
    }
    LB_CUDA_CHECK(cudaSetDevice(device));

    lb_cuda_ctx *cx = (lb_cuda_ctx *)lb_calloc(1, sizeof *cx);
    cx->device = device;
    cx->num_sms = prop.multiProcessorCount;
    const char *s = getenv("LB_CUDA_SYNC");
    cx->sync_each = s && *s && *s != '0';
    s = getenv("LB_CUDA_GRAPHS");
    const char *prof = getenv("LB_CUDA_PROFILE_SAMPLE");   // its range counts sample calls
    cx->graphs = !cx->sync_each && !(s && *s == '0') && !(prof && *prof);
    LB_CUDA_CHECK(cudaStreamCreateWithFlags(&cx->stream, cudaStreamNonBlocking));
    LB_CUBLAS_CHECK(cublasLtCreate(&cx->lt));
    cx->workspace_bytes = LB_CUDA_WORKSPACE;
    LB_CUDA_CHECK(cudaMalloc(&cx->workspace, cx->workspace_bytes));
    LB_CUDA_CHECK(cudaMalloc(&cx->err_dev, sizeof *cx->err_dev));
    LB_CUDA_CHECK(cudaMemsetAsync(cx->err_dev, 0, sizeof *cx->err_dev, cx->stream));
    LB_CUDA_CHECK(cudaHostAlloc(&cx->err_host, sizeof *cx->err_host, cudaHostAllocDefault));
    *cx->err_host = 0;

    // deterministic 1, the table's default; 0 lets the GEMM take cuBLASLt's heuristic
    static void (*const init[])(lb_backend *) = {
        cuda_init_memory, lb_cuda_init_gemm, lb_cuda_init_basic, lb_cuda_init_attention,
        lb_cuda_init_moe, lb_cuda_init_optim, lb_cuda_init_quant, lb_cuda_init_gemm_q,
        lb_cuda_init_sample,
    };
    lb_backend *be = lb_backend_new("cuda", cx, init, (int)(sizeof init / sizeof *init));
    snprintf(be->device, sizeof be->device, "%s, device %d", prop.name, device);
    LB_CUDA_WAIT(cx);
    return be;
}
