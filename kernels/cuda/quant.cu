// quant.cu: the low-precision codecs on the device: qmat_alloc/free, quantize (fp8-block,
// MXFP8, MXFP4, NVFP4; row-wise and column-wise; round to nearest even or stochastic),
// dequantize, the block-diagonal Walsh-Hadamard transform and bf16 rounding.
//
// The contract is doc/formats.md and the oracle is kernels/quant (codecs.c, quantize.c,
// hadamard.c): every byte of data, every scale and every second level equals the CPU's, bit for
// bit (tests/test_backend_ops.c checks them all). To get there:
// - Element rounding is the CPU's integer routine itself, kernels/quant/elem.h (it works on the
//   fp32 bits, so it is exact for every input, fp32 subnormals included).
// - Every floating-point operation the CPU performs is written as an explicit IEEE intrinsic
//   (__fdiv_rn, __fmul_rn, __fadd_rn, __fsub_rn), which nvcc never contracts into an FMA or
//   replaces by an approximation, whatever -fmad / --use_fast_math say. The CPU side is built
//   as ISO C11 without FMA contraction, so both sides perform the same roundings.
// - Block maxima are taken over the fp32 bit patterns of |x| (as unsigned integers, the order
//   of magnitudes; any NaN is above +Inf), which is exactly lb_amax's result: the largest |x|,
//   NaN when a NaN is present, +Inf when an infinity is. Integer maxima are exact and order
//   free, so the NVFP4 per-tensor and per-row maxima may use integer atomicMax.
// - NaN results the CPU writes as the C `NAN` constant (0x7fc00000) are written as those bits.
// - Stochastic rounding draws lb_rand_u64(seed, lb_quant_stream(step, tensor), index) with the
//   row-major index of the element in the quantized matrix, as the CPU does.
//
// fp8-block runs in one pass (fq_kernel, below, for quantize and quantize_grouped), MXFP8,
// MXFP4 and NVFP4 in one or two (mq_kernel: the NVFP4 tensor or row maxima first) unless a
// Hadamard transform of a size other than 16 is fused in. Those, and fp8-tensor, run in three
// passes over Q (the quantized matrix, x^T for column-wise; the column-wise input is first
// transposed into scratch, as quantize.c does):
//   1. amax: one warp per 128 consecutive columns of one row; the block maxima of that row
//      segment (one per 1-D block) go to scratch; NVFP4 also folds them into the tensor or row
//      maximum for the second level.
//   2. scales: one thread per scale block: the maximum over its rows, the scale (written to q)
//      and the divisor of its elements (to scratch); NVFP4's second level is computed before.
//   3. encode: one thread per pair of adjacent elements (one E2M1 byte, or two FP8 bytes).
#include "kernels/cuda/cuda.cuh"

#include <cuda_fp8.h>

#include <math.h>
#include <string.h>

extern "C" {
#include "kernels/quant/quant.h"
}
#include "kernels/quant/elem.h"
#include "kernels/sample.h"   // lb_sample_hash

#define QNAN_BITS 0x7fc00000u   // the C NAN constant the CPU writes

__device__ __forceinline__ float qnan() { return __uint_as_float(QNAN_BITS); }

// --- counter-based RNG (kernels/common.c), on the device ------------------------------------

// lb_rand_u64(seed, stream, counter) = hash(hash(hash(seed) ^ stream) ^ counter); the host
// passes base = hash(hash(seed) ^ stream) (the same hash, sample.h's).
__device__ __forceinline__ uint64_t d_rand(uint64_t base, uint64_t counter)
{
    return lb_sample_hash(base ^ counter);
}

// --- element codecs (codecs.c) -------------------------------------------------------------

// lb_encode(T, x, 1) (sr = 0) or lb_encode_sr(T, x, r) (sr = 1): both saturate. elem.h's,
// shared with the CPU; T a compile-time type, so its descriptor folds away.
template <int T> __device__ __forceinline__ unsigned encode(float x, int sr, uint64_t r)
{
    return lb_elem_encode(T, x, 1, sr, r);
}

// lb_decode, exact: values are built from their bits.
template <int T> __device__ __forceinline__ float decode(unsigned code)
{
    const lb_elem_fmt f = lb_elem_fmt_of(T);
    if (T == LB_E8M0) {
        if (code == 0xffu) return qnan();
        return code ? __uint_as_float(code << 23) : __uint_as_float(0x00400000u);   // 2^-127
    }
    if (T == LB_E2M1) code &= 0xfu;
    if (T == LB_UE4M3 && (code & 0x80u)) return qnan();
    unsigned mag = code & ~f.sign & 0xffu;
    if (T == LB_E5M2 && mag >= 0x7cu) {
        if (mag > 0x7cu) return qnan();
        return (code & f.sign) ? -INFINITY : INFINITY;
    }
    if ((T == LB_E4M3 || T == LB_UE4M3) && mag == 0x7fu) return qnan();
    unsigned ef = mag >> f.mbits, man = mag & ((1u << f.mbits) - 1);
    float v;
    if (ef == 0)   // subnormal: man * 2^(emin - mbits), exact
        v = __fmul_rn((float)man, __uint_as_float((unsigned)(127 + f.emin - f.mbits) << 23));
    else
        v = __uint_as_float(((ef - (unsigned)f.bias + 127u) << 23) | (man << (23 - f.mbits)));
    return (code & f.sign) ? -v : v;
}

// --- scale rules (quantize.c) ---------------------------------------------------------------

// E8M0 exponent k of an MX block with finite amax > 0 (mx_exponent), from the bits: amax =
// ma * 2^ea with ma in [0.5, 1) held as a 24-bit significand sig = ma * 2^24.
template <int ELEM> __device__ __forceinline__ int mx_exponent(float amax, int floor_rule)
{
    uint32_t u = __float_as_uint(amax);
    uint32_t sig;
    int ea;
    if (u >> 23) {
        sig = (u & 0x7fffffu) | 0x800000u;
        ea = (int)(u >> 23) - 126;
    } else {
        int sh = __clz(u) - 8;
        sig = u << sh;
        ea = -125 - sh;
    }
    int k;
    if (floor_rule) {
        int emax = ELEM == LB_E4M3 ? 8 : ELEM == LB_E5M2 ? 15 : 2;
        k = (ea - 1) - emax;
    } else {
        // elem_max = mm * 2^em: 448 = 0.875 * 2^9, 57344 = 0.875 * 2^16, 6 = 0.75 * 2^3
        int em = ELEM == LB_E4M3 ? 9 : ELEM == LB_E5M2 ? 16 : 3;
        uint32_t msig = ELEM == LB_E2M1 ? 0xc00000u : 0xe00000u;
        k = ea - em + (sig > msig);
    }
    return k < -127 ? -127 : k > 127 ? 127 : k;
}

// lb_nvfp4_scale2
__device__ __forceinline__ float nvfp4_scale2(float amax)
{
    if (!(fabsf(amax) < INFINITY)) return qnan();   // NaN or Inf
    float s = __fdiv_rn(amax, 2688.0f);
    return s == 0.0f ? 1.0f : s;
}

// The byte scale sc of an MX (NV 0) or NVFP4 (NV 1, second level t) block whose |x| maximum
// has bits mb, and the divisor of its elements (quantize.c's quantize_rows).
template <int ELEM, int NV>
__device__ __forceinline__ float byte_scale(uint32_t mb, float t, int floor_rule, unsigned &sc)
{
    const float amax = __uint_as_float(mb);
    const int finite = mb < 0x7f800000u;   // amax < INFINITY: false for NaN and Inf
    if (NV) {
        const float v = finite ? __fdiv_rn(__fdiv_rn(amax, 6.0f), t) : qnan();
        // encode<LB_UE4M3>(v, 0, 0): v >= 0 or NaN, so the hardware's E4M3 conversion (nearest
        // even, +Inf and beyond 448 saturated; see fq_pair) with the codec's NaN code
        sc = v != v ? 0x7fu : (unsigned)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
        return __fmul_rn(decode<LB_UE4M3>(sc), t);
    }
    sc = !finite ? 0xffu : mb == 0 ? 127u : (unsigned)(mx_exponent<ELEM>(amax, floor_rule) + 127);
    return decode<LB_E8M0>(sc);
}

// The fp8-block (and fp8-tensor) scale of a block whose |x| maximum has bits mb (quantize.c's
// quantize_rows): amax / 448, or with pow2 its power of two (elem.h's, shared with the CPU).
__device__ __forceinline__ float fp8_scale(uint32_t mb, int pow2)
{
    if (!(mb < 0x7f800000u)) return qnan();   // NaN or Inf in the block
    if (pow2) return lb_elem_fp8_scale_pow2(mb);
    const float s = __fdiv_rn(__uint_as_float(mb), 448.0f);
    return s == 0.0f ? 1.0f : s;              // all-zero block (or amax < 448 * 2^-150)
}

// --- pass 1: maxima of 1-D block segments ----------------------------------------------------

// One warp per (row r, chunk of 128 columns); lane l holds columns 128 ch + l + 32 t, t < 4.
// amax1[r * scols + j]: max |x| bits over row r of block column j. With s2word (NVFP4 per
// tensor or per row), also the atomic maximum of the segment into s2word[s2row ? r : 0].
__global__ void amax_kernel(const float *__restrict__ x, int R, int C, int bc, int scols,
                            uint32_t *__restrict__ amax1, uint32_t *s2word, int s2row)
{
    const int lane = threadIdx.x & 31;
    const int nch = (C + 127) / 128;
    const size_t nwarps = (size_t)R * nch;
    for (size_t w = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32; w < nwarps;
         w += (size_t)gridDim.x * blockDim.x / 32) {
        int r = (int)(w / nch), ch = (int)(w % nch);
        const float *row = x + (size_t)r * C;
        uint32_t m[4];
#pragma unroll
        for (int t = 0; t < 4; t++) {
            int c = ch * 128 + lane + 32 * t;
            m[t] = c < C ? (__float_as_uint(row[c]) & 0x7fffffffu) : 0u;
        }
        uint32_t all = max(max(m[0], m[1]), max(m[2], m[3]));
        if (bc == 128) {
            uint32_t v = __reduce_max_sync(0xffffffffu, all);
            if (lane == 0) amax1[(size_t)r * scols + ch] = v;
        } else if (bc == 32) {
#pragma unroll
            for (int t = 0; t < 4; t++) {
                uint32_t v = __reduce_max_sync(0xffffffffu, m[t]);
                int j = ch * 4 + t;
                if (lane == 0 && j < scols) amax1[(size_t)r * scols + j] = v;
            }
        } else {   // bc == 16: half-warps
#pragma unroll
            for (int t = 0; t < 4; t++) {
                uint32_t v = m[t];
                for (int o = 8; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
                int j = ch * 8 + 2 * t + (lane >> 4);
                if ((lane & 15) == 0 && j < scols) amax1[(size_t)r * scols + j] = v;
            }
        }
        if (s2word) {
            uint32_t v = __reduce_max_sync(0xffffffffu, all);
            if (lane == 0 && v) atomicMax(s2word + (s2row ? r : 0), v);
        }
    }
}

// NVFP4 second level: s2[i] = lb_nvfp4_scale2(max) from the integer maxima, or the given value.
__global__ void scale2_kernel(float *__restrict__ s2, const uint32_t *__restrict__ s2word, int n,
                              int given, float s2_given)
{
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        s2[i] = given ? s2_given : nvfp4_scale2(__uint_as_float(s2word[i]));
}

// --- pass 2: block scales and divisors --------------------------------------------------------

// One thread per scale block (i, j): amax over its rows of amax1, the scale (q->scale) and the
// divisor of its elements (dv). fmt and the element type as in quantize.c's quantize_rows.
template <int ELEM>
__global__ void scale_kernel(int fmt, int R, int brows, int srows, int scols,
                             const uint32_t *__restrict__ amax1, void *__restrict__ scale,
                             const float *__restrict__ s2, int s2row, int floor_rule, int pow2,
                             float *__restrict__ dv)
{
    size_t nb = (size_t)srows * scols;
    for (size_t b = blockIdx.x * (size_t)blockDim.x + threadIdx.x; b < nb;
         b += (size_t)gridDim.x * blockDim.x) {
        int i = (int)(b / scols), j = (int)(b % scols);
        int r0 = i * brows, r1 = r0 + brows < R ? r0 + brows : R;
        uint32_t mb = 0;
        for (int r = r0; r < r1; r++) mb = max(mb, amax1[(size_t)r * scols + j]);
        float d;
        if (fmt == LB_FMT_FP8_BLOCK) {
            const float s = fp8_scale(mb, pow2);
            ((float *)scale)[b] = s;
            d = s;
        } else {
            unsigned sc;
            d = fmt == LB_FMT_NVFP4 ? byte_scale<ELEM, 1>(mb, s2[s2row ? r0 : 0], 0, sc)
                                    : byte_scale<ELEM, 0>(mb, 0.0f, floor_rule, sc);
            ((uint8_t *)scale)[b] = (uint8_t)sc;
        }
        dv[b] = d;
    }
}

// --- pass 3: elements ----------------------------------------------------------------------

// One thread per pair (r, 2p), (r, 2p + 1) of Q: E(x / d), or 0 where d is NaN or 0. E2M1 pairs
// are one byte (element 2p in the low nibble; a missing last element is 0); FP8 pairs two.
template <int ELEM>
__global__ void encode_kernel(const float *__restrict__ x, int R, int C, int brows, int bc,
                              int scols, const float *__restrict__ dv, uint8_t *__restrict__ data,
                              size_t ld, int sr, uint64_t rbase)
{
    const int np = (C + 1) / 2;
    const size_t n = (size_t)R * np;
    for (size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x; t < n;
         t += (size_t)gridDim.x * blockDim.x) {
        int r = (int)(t / np), p = (int)(t % np);
        int c0 = 2 * p, c1 = c0 + 1;             // bc is even: one block holds both
        float d = dv[(size_t)(r / brows) * scols + c0 / bc];
        int zero = d != d || d == 0.0f;
        size_t i0 = (size_t)r * C + c0;
        unsigned q0 = 0, q1 = 0;
        if (!zero) {
            q0 = encode<ELEM>(__fdiv_rn(x[i0], d), sr, sr ? d_rand(rbase, i0) : 0);
            if (c1 < C) q1 = encode<ELEM>(__fdiv_rn(x[i0 + 1], d), sr, sr ? d_rand(rbase, i0 + 1) : 0);
        }
        uint8_t *row = data + (size_t)r * ld;
        if (ELEM == LB_E2M1) {
            row[p] = (uint8_t)(q0 | (q1 << 4));
        } else {
            row[c0] = (uint8_t)q0;
            if (c1 < C) row[c1] = (uint8_t)q1;
        }
    }
}

// --- transpose (column-wise quantization reads x^T) ------------------------------------------

// xt (cols, rows) = x (rows, cols)^T in 32x32 tiles through shared memory; tiles indexed along
// blockIdx.x (no grid-dimension limit on rows). H > 0: the Hadamard transform of size H along
// x's rows (lb_quant_args.hadamard, hadamard_kernel's butterflies and roundings, hence the
// CPU's bits) is applied to the tile in shared memory: rows is a multiple of H, which divides
// 32, so every block of H rows lies in one tile.
template <int H>
__global__ void transpose_kernel(float *__restrict__ xt, const float *__restrict__ x, int rows,
                                 int cols, uint32_t signs, float hc)
{
    __shared__ float tile[32][33];
    const int tc = (cols + 31) / 32;
    const size_t ntiles = (size_t)tc * ((rows + 31) / 32);
    for (size_t b = blockIdx.x; b < ntiles; b += gridDim.x) {
        int c0 = (int)(b % tc) * 32, r0 = (int)(b / tc) * 32;
        for (int k = threadIdx.y; k < 32; k += 8) {
            int r = r0 + k, c = c0 + threadIdx.x;
            if (r < rows && c < cols) tile[k][threadIdx.x] = x[(size_t)r * cols + c];
        }
        __syncthreads();
        if (H) {   // (column, block of H rows) items over the 256 threads
            for (int i = threadIdx.y * 32 + threadIdx.x; i < 32 * (32 / (H ? H : 1)); i += 256) {
                const int col = i % 32, k0 = i / 32 * H;
                if (r0 + k0 >= rows || c0 + col >= cols) continue;
                float v[H ? H : 1];
#pragma unroll
                for (int j = 0; j < H; j++) {
                    const float u = tile[k0 + j][col];
                    v[j] = (signs >> j & 1) ? -u : u;
                }
                // stage h: pairs (j, j + h), j with bit h clear, in increasing j (the CPU's
                // order; written as one loop of H / 2 so that it unrolls into registers)
#pragma unroll
                for (int h = 1; h < H; h *= 2)
#pragma unroll
                    for (int p = 0; p < H / 2; p++) {
                        const int j = (p / h) * 2 * h + p % h;
                        const float a = v[j], bb = v[j + h];
                        v[j] = __fadd_rn(a, bb);
                        v[j + h] = __fsub_rn(a, bb);
                    }
#pragma unroll
                for (int j = 0; j < H; j++) tile[k0 + j][col] = __fmul_rn(v[j], hc);
            }
            __syncthreads();
        }
        for (int k = threadIdx.y; k < 32; k += 8) {
            int c = c0 + k, r = r0 + threadIdx.x;
            if (r < rows && c < cols) xt[(size_t)c * rows + r] = tile[threadIdx.x][k];
        }
        __syncthreads();
    }
}

// --- dequantization ----------------------------------------------------------------------------

template <typename O> __device__ __forceinline__ O to_out(float v);
template <> __device__ __forceinline__ float to_out<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 to_out<__nv_bfloat16>(float v)
{
    return __float2bfloat16_rn(v);
}

// Element (r, c) of Q dequantized: element * block scale (* s2 when with_s2, NVFP4), 0 for
// c >= C. quantize.c's dequantize.
template <int ELEM>
__device__ __forceinline__ float dq_value(int r, int c, int fmt, int C, const uint8_t *data,
                                          size_t ld, int brows, int bc, int scols,
                                          const void *scale, int scale_e8m0, const float *s2,
                                          int s2row, int with_s2)
{
    if (c >= C) return 0.0f;
    const uint8_t *row = data + (size_t)r * ld;
    unsigned code = ELEM == LB_E2M1 ? (row[c >> 1] >> ((c & 1) * 4)) & 0xfu : row[c];
    float e = decode<ELEM>(code), v;
    size_t si = (size_t)(r / brows) * scols + c / bc;
    if (fmt == LB_FMT_FP8_BLOCK || fmt == LB_FMT_FP8_TENSOR) {
        v = __fmul_rn(e, ((const float *)scale)[si]);
    } else {
        unsigned sc = ((const uint8_t *)scale)[si];
        v = __fmul_rn(e, scale_e8m0 ? decode<LB_E8M0>(sc) : decode<LB_UE4M3>(sc));
        if (fmt == LB_FMT_NVFP4 && with_s2) v = __fmul_rn(v, s2[s2row ? r : 0]);
    }
    return v;
}

// y (R, ocols) with row pitch ldy: columns < C get element * block scale (* s2 when with_s2,
// NVFP4), columns >= C get 0 (padding for the GEMM paths).
template <int ELEM, typename O>
__global__ void dequant_kernel(O *__restrict__ y, size_t ldy, int ocols, int fmt, int R, int C,
                               const uint8_t *__restrict__ data, size_t ld, int brows, int bc,
                               int scols, const void *__restrict__ scale, int scale_e8m0,
                               const float *__restrict__ s2, int s2row, int with_s2)
{
    const size_t n = (size_t)R * ocols;
    for (size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x; t < n;
         t += (size_t)gridDim.x * blockDim.x) {
        int r = (int)(t / ocols), c = (int)(t % ocols);
        y[(size_t)r * ldy + c] = to_out<O>(dq_value<ELEM>(r, c, fmt, C, data, ld, brows, bc, scols,
                                                          scale, scale_e8m0, s2, s2row, with_s2));
    }
}

template <typename O>
static void dequant_launch(lb_cuda_ctx *cx, O *y, size_t ldy, int ocols, const lb_qmat *q,
                           int with_s2)
{
    size_t n = (size_t)q->rows * ocols;
    if (!n) return;
    unsigned g = lb_grid(n, 256, cx);
    int e8 = q->scale_elem == LB_E8M0, s2row = q->nscale2 > 1;
#define DQ(E)                                                                                  \
    dequant_kernel<E, O><<<g, 256, 0, cx->stream>>>(y, ldy, ocols, (int)q->fmt, q->rows,      \
                                                    q->cols, q->data, q->ld, q->brows,         \
                                                    q->bcols, q->scols, q->scale, e8,          \
                                                    q->scale2, s2row, with_s2)
    switch (q->elem) {
    case LB_E4M3: DQ(LB_E4M3); break;
    case LB_E5M2: DQ(LB_E5M2); break;
    case LB_E2M1: DQ(LB_E2M1); break;
    default: lb_die("cuda dequantize: element type %d is not a quantizer element", (int)q->elem);
    }
#undef DQ
    LB_CUDA_LAUNCHED(cx);
}

// Used by gemm_q.cu: y (q rows, ocols >= q cols, row pitch ldy elements) = the dequantized
// values (with or without NVFP4's second level), zero beyond q cols; fp32 or bf16.
extern "C" void lb_cuda_dequant_f32(lb_cuda_ctx *cx, float *y, size_t ldy, int ocols,
                                    const lb_qmat *q, int with_s2)
{
    dequant_launch<float>(cx, y, ldy, ocols, q, with_s2);
}

extern "C" void lb_cuda_dequant_bf16(lb_cuda_ctx *cx, void *y, size_t ldy, int ocols,
                                     const lb_qmat *q, int with_s2)
{
    dequant_launch<__nv_bfloat16>(cx, (__nv_bfloat16 *)y, ldy, ocols, q, with_s2);
}

// Groups of matrices dequantized to bf16 in one launch (blockIdx.y: the matrix), without
// NVFP4's second level. A thread writes 8 columns (16 bytes; ocols and ldy are multiples of
// 8), which lie in one scale block (blocks are at least 16 wide and start at multiples of
// their width), from one load of their codes where the row allows.
#define DQ_MAX 64

typedef struct {
    const uint8_t *data;
    const void *scale;
    __nv_bfloat16 *y;
    size_t ld, ldy;
    int R, C, ocols, brows, bc, scols;
} dq_job;

typedef struct {
    int count, fmt, e8m0;
    dq_job j[DQ_MAX];
} dq_params;

template <int ELEM> __global__ void dequant_groups_kernel(const __grid_constant__ dq_params P)
{
    const dq_job &J = P.j[blockIdx.y];
    const int n8 = J.ocols / 8;
    const size_t n = (size_t)J.R * n8;
    for (size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x; t < n;
         t += (size_t)gridDim.x * blockDim.x) {
        const int r = (int)(t / n8), c = 8 * (int)(t % n8);
        float v[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        if (c < J.C) {
            const uint8_t *row = J.data + (size_t)r * J.ld;
            uint64_t codes = 0;   // code i in bits 4i (E2M1) or 8i (fp8)
            const int nb = ELEM == LB_E2M1 ? 4 : 8;
            const uint8_t *p = row + (ELEM == LB_E2M1 ? c / 2 : c);
            if (c + 7 < J.C && ((uintptr_t)p & (nb - 1)) == 0) {
                codes = nb == 4 ? *(const uint32_t *)p : *(const uint64_t *)p;
            } else {
                const int have = ELEM == LB_E2M1 ? (min(J.C - c, 8) + 1) / 2 : min(J.C - c, 8);
                for (int i = 0; i < have; i++) codes |= (uint64_t)p[i] << (8 * i);
            }
            const size_t si = (size_t)(r / J.brows) * J.scols + c / J.bc;
            float s;
            if (P.fmt == LB_FMT_FP8_BLOCK || P.fmt == LB_FMT_FP8_TENSOR) {
                s = ((const float *)J.scale)[si];
            } else {
                const unsigned sc = ((const uint8_t *)J.scale)[si];
                s = P.e8m0 ? decode<LB_E8M0>(sc) : decode<LB_UE4M3>(sc);
            }
#pragma unroll
            for (int i = 0; i < 8; i++) {   // dq_value's product
                const unsigned code = (unsigned)(codes >> (ELEM == LB_E2M1 ? 4 * i : 8 * i)) &
                                      (ELEM == LB_E2M1 ? 0xfu : 0xffu);
                if (c + i < J.C) v[i] = __fmul_rn(decode<ELEM>(code), s);
            }
        }
        __nv_bfloat162 o[4];
#pragma unroll
        for (int i = 0; i < 4; i++) o[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
        *(uint4 *)(J.y + (size_t)r * J.ldy + c) = *(const uint4 *)o;
    }
}

// Runs of jobs of one format and element type, DQ_MAX at most, one launch each.
extern "C" void lb_cuda_dequant_bf16_groups(lb_cuda_ctx *cx, int count,
                                            const lb_cuda_dq_job *jobs)
{
    dq_params *P = (dq_params *)lb_calloc(1, sizeof *P);
    for (int i0 = 0; i0 < count;) {
        const lb_qmat *q0 = jobs[i0].q;
        int cnt = 0;
        size_t most = 0;
        P->fmt = (int)q0->fmt, P->e8m0 = q0->scale_elem == LB_E8M0;
        for (; i0 + cnt < count && cnt < DQ_MAX; cnt++) {
            const lb_cuda_dq_job *x = &jobs[i0 + cnt];
            const lb_qmat *q = x->q;
            if (q->fmt != q0->fmt || q->elem != q0->elem) break;
            if (x->ocols % 8 || x->ldy % 8 || x->ocols < q->cols || ((uintptr_t)x->y & 15) ||
                (q->fmt != LB_FMT_FP8_TENSOR && q->bcols % 8))
                lb_die("cuda dequantize: an output row not a multiple of 8 or short, or "
                       "misaligned");
            P->j[cnt] = (dq_job){q->data, q->scale, (__nv_bfloat16 *)x->y, q->ld, x->ldy,
                                 q->rows, q->cols, x->ocols, q->brows, q->bcols, q->scols};
            const size_t n = (size_t)q->rows * (x->ocols / 8);
            if (n > most) most = n;
        }
        P->count = cnt;
        const size_t cap = (size_t)cx->num_sms * 16 / cnt + 1, blocks = (most + 255) / 256;
        const dim3 grid((unsigned)(blocks < cap ? blocks : cap), (unsigned)cnt);
        switch (q0->elem) {
        case LB_E4M3: dequant_groups_kernel<LB_E4M3><<<grid, 256, 0, cx->stream>>>(*P); break;
        case LB_E5M2: dequant_groups_kernel<LB_E5M2><<<grid, 256, 0, cx->stream>>>(*P); break;
        case LB_E2M1: dequant_groups_kernel<LB_E2M1><<<grid, 256, 0, cx->stream>>>(*P); break;
        default: lb_die("cuda dequantize: element type %d", (int)q0->elem);
        }
        LB_CUDA_LAUNCHED(cx);
        i0 += cnt;
    }
    free(P);
}

// --- fp8-block in one pass, for groups of rows (quantize_grouped, and quantize) --------------
//
// fp8-block has no second level and blocks of at most 128 x 128, so one block of 256 threads
// quantizes one 128 x 128 tile of some group's Q in one pass, from registers: warp w loads 16
// rows of x (x's rows are Q's rows, or Q's columns column-wise) as one 16-byte load per lane
// and row, all 16 in flight at once (the kernel is bound by memory; no shared-memory copy of
// the tile). The block maxima (per Q row for 1x128 blocks, over the tile for 128x128) are
// taken with warp reductions, across warps through shared memory where a block spans them,
// then the scales and the elements are written with the same roundings as the passes above.
// Zero stands for x beyond its rows (the padding). One launch for all the groups (an MoE
// layer's experts) instead of three or four per matrix.
#define FQ_MAX 240

typedef struct {
    const void *x;           // x_j (rows, cols), row pitch fq_params.ld, fp32 or bf16
    uint8_t *data;           // Q_j (R, C), row pitch ld (C for fp8)
    void *scale;             // (ceil(R / brows), scols): fp32 (fp8-block) or bytes
    float *scale2;           // NVFP4's second level (mq_kernel)
    uint32_t *s2w;           // NVFP4: |x| maxima of the tensor (1) or of Q's rows (R), scratch
    size_t ld;
    int rows, R, C, scols;
    int tile0, tiles_c;      // the group's first tile in the launch; tiles per tile row of Q_j
    uint64_t rbase;          // stochastic rounding stream
    uint32_t hsigns;         // Hadamard signs (mq_kernel)
    int roff;                // quantize_rc: x_j's first row in x (its row in the row-wise Q)
    // quantize_rt (128x128 blocks, row-wise): Q_j^T (C, R), row pitch tld, and its scales
    // (ceil(C / 128), tscols), written with Q_j; else tdata NULL
    uint8_t *tdata;
    float *tscale;
    size_t tld;
    int tscols;
    int tsld;                // 1x128 blocks: Q_j's scales transposed (lb_qmat.tscale, pitch
    float *ts;               // tsld), written beside its scales; else ts NULL
} fq_group;

typedef struct {
    int count, cols, blk2d, sr;
    int pow2;                // fp8-block scales rounded up to powers of two (lb_quant_args.pow2)
    int v4;                  // every row of x starts aligned for 4-element loads
    int x16;                 // x holds bf16 values (lb_act), else fp32
    size_t ld;               // x's row pitch in elements
    int floor_rule;          // MX scale rule (mq_kernel)
    int s2mode;              // NVFP4 second level: lb_scale2_mode (mq_kernel)
    float s2given;
    float hc;                // Hadamard normalisation (mq_kernel)
    uint8_t *rdata;          // quantize_rc: the row-wise Q of all of x (fp8-block 1x128)
    float *rscale;
    int rscols;
    int rtsld;               // quantize_rc: the row-wise Q's transposed scales, or rts NULL
    float *rts;
    fq_group g[FQ_MAX];
} fq_params;
static_assert(sizeof(fq_params) <= 32764, "fq_params exceeds a kernel's parameter space");

__device__ __forceinline__ float bf16_val(uint16_t b) { return __uint_as_float((uint32_t)b << 16); }

// x[row][c .. c + 3] in fp32 (a bf16 x's values exactly), zero beyond (rows, cols); c is a
// multiple of 4. X16: x is bf16 (P.x16), a template argument so each kernel has one load path
// (a branch on P.x16 in the loads cost the fp32 kernels registers, and time).
template <int X16>
__device__ __forceinline__ float4 fq_load(const fq_params &P, const void *x, int rows, int row,
                                          int c)
{
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const int cols = P.cols;
    if (row >= rows || c >= cols) return v;
    if constexpr (X16) {
        const uint16_t *p = (const uint16_t *)x + (size_t)row * P.ld + c;
        if (P.v4) {   // cols % 4 == 0: all four are in x, 8 bytes
            const uint2 u = __ldcs((const uint2 *)p);
            return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u),
                               __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
        }
        v.x = bf16_val(p[0]);
        if (c + 1 < cols) v.y = bf16_val(p[1]);
        if (c + 2 < cols) v.z = bf16_val(p[2]);
        if (c + 3 < cols) v.w = bf16_val(p[3]);
        return v;
    }
    const float *p = (const float *)x + (size_t)row * P.ld + c;
    if (P.v4) return __ldcs((const float4 *)p);   // cols % 4 == 0: all four are in x
    v.x = p[0];
    if (c + 1 < cols) v.y = p[1];
    if (c + 2 < cols) v.z = p[2];
    if (c + 3 < cols) v.w = p[3];
    return v;
}

__device__ __forceinline__ uint32_t fq_abs4(float4 v)
{
    return max(max(__float_as_uint(v.x) & 0x7fffffffu, __float_as_uint(v.y) & 0x7fffffffu),
               max(__float_as_uint(v.z) & 0x7fffffffu, __float_as_uint(v.w) & 0x7fffffffu));
}

__device__ __forceinline__ float fq_el(float4 v, int u)
{
    return u == 0 ? v.x : u == 1 ? v.y : u == 2 ? v.z : v.w;
}

// x / d for one block's divisor d: __fdiv_rn's result from one reciprocal per block instead of
// a division per element (which also costs a range check and a slow-path branch). r = RN(1/d);
// q = RN(x r) is within an ulp of x / d, and Markstein's correction RN(q + (x - d q) r), with
// the remainder exact in an FMA, rounds to RN(x / d) while no intermediate is subnormal. With
// d >= 2^-90 that holds wherever E4M3 tells quotients apart (|x / d| >= 2^-12 needs |x| >=
// 2^-102); below, both round to a zero of x's sign (the sign is kept for x = -0). A smaller d
// (a block of tiny values) has x and d scaled by 2^64 first, which is exact and leaves the
// quotient as it is. tests/tools/fp8_quotient_check.c checks this against IEEE division
// (random pairs, and around d times every E4M3 value and midpoint). Stochastic rounding keeps
// __fdiv_rn: there even a tiny quotient's last bit can move the draw's outcome.
struct fq_div {
    float d, r, k;   // d scaled by k; r = RN(1 / d)
};

__device__ __forceinline__ fq_div fq_div_of(float d)
{
    const float k = d < 0x1p-90f ? 0x1p64f : 1.0f;
    d = __fmul_rn(d, k);
    return fq_div{d, __frcp_rn(d), k};
}

template <int SR> __device__ __forceinline__ float fq_quot(float x, const fq_div &v)
{
    x = __fmul_rn(x, v.k);
    if (SR) return __fdiv_rn(x, v.d);
    const float q = __fmul_rn(x, v.r);
    return copysignf(__fmaf_rn(__fmaf_rn(-v.d, q, x), v.r, q), x);
}

// The E4M3 codes of x0 / d and x1 / d (Q's element indices at, at + 1) in the low two bytes.
// Round to nearest even is the hardware conversion (cvt.rn.satfinite: the CPU codec's rounding
// and saturation for the finite quotients here); stochastic rounding takes the codec. A NaN
// divisor (NaN or Inf in the block) gives codes 0, as the CPU.
template <int SR>
__device__ __forceinline__ uint32_t fq_pair(float x0, float x1, const fq_div &v, uint64_t rbase,
                                            size_t at)
{
    const float q0 = fq_quot<SR>(x0, v), q1 = fq_quot<SR>(x1, v);
    uint32_t w;
    if (!SR) w = __nv_cvt_float2_to_fp8x2(make_float2(q0, q1), __NV_SATFINITE, __NV_E4M3);
    else w = encode<LB_E4M3>(q0, 1, d_rand(rbase, at)) |
             encode<LB_E4M3>(q1, 1, d_rand(rbase, at + 1)) << 8;
    return v.d != v.d ? 0u : w;
}

// 128x128 blocks: the tile's scale from every thread's values (thread 0 writes it to Q's
// scales); every thread gets it. red: 8 words of shared memory.
__device__ __forceinline__ float fq_tile_scale(const float4 (&v)[16], uint32_t *red,
                                               const fq_group &G, int tr, int tc, int tid,
                                               int pow2)
{
    uint32_t m = 0;
#pragma unroll
    for (int s = 0; s < 16; s++) m = max(m, fq_abs4(v[s]));
    m = __reduce_max_sync(0xffffffffu, m);
    if ((tid & 31) == 0) red[tid >> 5] = m;
    __syncthreads();
    m = __reduce_max_sync(0xffffffffu, red[tid & 7]);
    const float sc = fp8_scale(m, pow2);
    if (tid == 0) ((float *)G.scale)[(size_t)tr * G.scols + tc] = sc;
    return sc;
}

// Column-wise tiles (v[s] holds Q rows 4 lane + u, columns 16 warp + s): for tid < 128, the
// |x| maximum of Q row tid of the tile (this thread's 16 values of each of its rows, then the
// 8 warps' through part). Every thread of the block calls it (a barrier).
__device__ __forceinline__ uint32_t colwise_row_max(const float4 (&v)[16], uint32_t (*part)[128],
                                                    int tid)
{
    const int lane = tid & 31, warp = tid >> 5;
#pragma unroll
    for (int u = 0; u < 4; u++) {
        uint32_t m = 0;
#pragma unroll
        for (int s = 0; s < 16; s++) m = max(m, __float_as_uint(fq_el(v[s], u)) & 0x7fffffffu);
        part[warp][4 * lane + u] = m;
    }
    __syncthreads();
    uint32_t m = 0;
    if (tid < 128)
#pragma unroll
        for (int w = 0; w < 8; w++) m = max(m, part[w][tid]);
    return m;
}

// The codes of x / d for Q row r, columns c .. c + 3 (Q has C columns), in a word's bytes.
template <int SR>
__device__ __forceinline__ uint32_t fq_word4(int C, int r, int c, float4 x, const fq_div &d,
                                             uint64_t rbase)
{
    const size_t at = (size_t)r * C + c;
    return fq_pair<SR>(x.x, x.y, d, rbase, at) | fq_pair<SR>(x.z, x.w, d, rbase, at + 2) << 16;
}

// Codes w (fq_word4) into Q row r, columns c .. c + 3 (Q has C columns, row pitch C): one
// 4-byte store where the word is whole and aligned; nothing for r >= R or c >= C.
__device__ __forceinline__ void fq_put4(uint8_t *data, int R, int C, int r, int c, uint32_t w)
{
    if (r >= R || c >= C) return;
    uint8_t *p = data + (size_t)r * C + c;
    if (c + 3 < C && ((uintptr_t)p & 3) == 0) {
        *(uint32_t *)p = w;
    } else {
        for (int u = 0; u < 4 && c + u < C; u++) p[u] = (uint8_t)(w >> (8 * u));
    }
}

// Q row r, columns c .. c + 3: the codes of x / d (nothing for r >= R or c >= C).
template <int SR>
__device__ __forceinline__ void fq_store4(uint8_t *data, int R, int C, int r, int c, float4 x,
                                          const fq_div &d, uint64_t rbase)
{
    if (r >= R || c >= C) return;
    fq_put4(data, R, C, r, c, fq_word4<SR>(C, r, c, x, d, rbase));
}

// 1x128 blocks of the N rows a warp holds whole (v[s]: Q row r0 + s, this lane's columns c ..
// c + 3, all in the 128-column block bc): lane s takes row r0 + s's maximum, computes its scale
// (written for rows below R, and into the transposed scales ts of pitch tsld if not NULL) and
// divisor once, and the divisor reaches every lane by shuffles (not computed by all 32 lanes N
// times); then a 4-byte word of codes per lane and row, so a warp writes 128 bytes of a Q row.
template <int SR, int N>
__device__ __forceinline__ void fq_rows(const float4 (&v)[N], uint8_t *data, float *scale,
                                        int scols, int R, int C, int r0, int c, int bc,
                                        uint64_t rbase, int lane, float *ts, int tsld, int pow2)
{
    uint32_t m = 0;
#pragma unroll
    for (int s = 0; s < N; s++) {
        const uint32_t ms = __reduce_max_sync(0xffffffffu, fq_abs4(v[s]));
        if (lane == s) m = ms;
    }
    const float sc = fp8_scale(m, pow2);
    if (lane < N && r0 + lane < R) {
        scale[(size_t)(r0 + lane) * scols + bc] = sc;
        if (ts) ts[(size_t)bc * tsld + r0 + lane] = sc;
    }
    const fq_div mine = fq_div_of(sc);
#pragma unroll
    for (int s = 0; s < N; s++) {
        const fq_div dr = {__shfl_sync(0xffffffffu, mine.d, s), __shfl_sync(0xffffffffu, mine.r, s),
                           __shfl_sync(0xffffffffu, mine.k, s)};
        fq_store4<SR>(data, R, C, r0 + s, c, v[s], dr, rbase);
    }
}

// A 128x128 tile's codes (v[s]: Q row xr + s, columns xc .. xc + 3) into Q and into Q^T
// (quantize_rt): the thread's 16 rows of one column are 16 consecutive bytes of a Q^T row, so
// each of its four columns is one 16-byte store there, with no pass through shared memory.
template <int SR>
__device__ __forceinline__ void fq_store_rt(const fq_group &G, const float4 (&v)[16],
                                            const fq_div &d, int xr, int xc)
{
    uint32_t w[16];
#pragma unroll
    for (int s = 0; s < 16; s++) {
        w[s] = fq_word4<SR>(G.C, xr + s, xc, v[s], d, G.rbase);
        fq_put4(G.data, G.R, G.C, xr + s, xc, w[s]);
    }
#pragma unroll
    for (int u = 0; u < 4; u++) {
        const int c = xc + u;   // Q^T row c, columns xr .. xr + 15
        if (c >= G.C || xr >= G.R) break;
        uint32_t t[4];
#pragma unroll
        for (int q = 0; q < 4; q++)
            t[q] = (w[4 * q] >> 8 * u & 255u) | (w[4 * q + 1] >> 8 * u & 255u) << 8 |
                   (w[4 * q + 2] >> 8 * u & 255u) << 16 | (w[4 * q + 3] >> 8 * u & 255u) << 24;
        uint8_t *p = G.tdata + (size_t)c * G.tld + xr;
        if (xr + 15 < G.R && ((uintptr_t)p & 15) == 0) {
            *(uint4 *)p = make_uint4(t[0], t[1], t[2], t[3]);
        } else {
            for (int k = 0; k < 16 && xr + k < G.R; k++) p[k] = (uint8_t)(t[k >> 2] >> 8 * (k & 3));
        }
    }
}

// Block blockIdx.x's tile: its group, its row and column (tr, tc) among the group's tiles, and
// v[s] = x[xr + s][xc .. xc + 3] (zero beyond x): Q(r0 + 16 warp + s, c0 + 4 lane + u)
// row-wise, Q(r0 + 4 lane + u, c0 + 16 warp + s) column-wise, with (r0, c0) = 128 (tr, tc).
struct fq_tile {
    const fq_group *G;
    int tr, tc, r0, c0, xr, xc;
};

template <int COLWISE, int X16>
__device__ __forceinline__ fq_tile fq_tile_load(const fq_params &P, float4 (&v)[16])
{
    const int t = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    fq_tile T;
    T.G = &lb_group_of(P.g, P.count, t);
    T.tr = (t - T.G->tile0) / T.G->tiles_c, T.tc = (t - T.G->tile0) % T.G->tiles_c;
    T.r0 = T.tr * 128, T.c0 = T.tc * 128;
    T.xr = (COLWISE ? T.c0 : T.r0) + 16 * warp, T.xc = (COLWISE ? T.r0 : T.c0) + 4 * lane;
#pragma unroll
    for (int s = 0; s < 16; s++) v[s] = fq_load<X16>(P, T.G->x, T.G->rows, T.xr + s, T.xc);
    return T;
}

// COLWISE 0: Q(r, c) = x[r][c] (128x128 blocks); 1: Q(r, c) = x[c][r]. SR: stochastic rounding
// (a kernel of its own, so the common one carries none of the random stream's code). ROWS
// (quantize_rc, with COLWISE 1, 1x128 blocks, no SR): the tile's values also go to the row-wise
// Q of all of x (P.rdata): x_j's row xr + s is its row roff + xr + s, the tile's columns its
// block tr.
template <int COLWISE, int SR, int ROWS, int X16>
__global__ void __launch_bounds__(256, 2) fq_kernel(const __grid_constant__ fq_params P)
{
    __shared__ uint32_t part[8][128];   // column-wise 1x128: each warp's maxima of the Q rows
    __shared__ float dv[128];           // column-wise 1x128: the divisor of each Q row
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float4 v[16];
    const fq_tile T = fq_tile_load<COLWISE, X16>(P, v);
    const fq_group &G = *T.G;
    const int tr = T.tr, tc = T.tc, r0 = T.r0, c0 = T.c0, xr = T.xr, xc = T.xc;

    if (!COLWISE) {   // 128x128 (row-wise 1x128 is fq_rows_kernel's)
        const float sc = fq_tile_scale(v, part[0], G, tr, tc, tid, P.pow2);   // 128x128
        const fq_div d = fq_div_of(sc);
        if (G.tdata) {
            if (tid == 0) G.tscale[(size_t)tc * G.tscols + tr] = sc;
            fq_store_rt<SR>(G, v, d, xr, xc);
            return;
        }
#pragma unroll
        for (int s = 0; s < 16; s++) fq_store4<SR>(G.data, G.R, G.C, xr + s, xc, v[s], d, G.rbase);
        return;
    }
    if (ROWS)   // padding rows (xr + s >= G.rows) are the next group's: not written
        fq_rows<0>(v, P.rdata, P.rscale, P.rscols, G.roff + G.rows, P.cols, G.roff + xr, xc, tr,
                   0, lane, P.rts, P.rtsld, P.pow2);

    fq_div d[4];
    if (P.blk2d) {
        d[0] = d[1] = d[2] = d[3] = fq_div_of(fq_tile_scale(v, part[0], G, tr, tc, tid, P.pow2));
    } else {
        const uint32_t m = colwise_row_max(v, part, tid);
        if (tid < 128) {
            const float sc = fp8_scale(m, P.pow2);
            dv[tid] = sc;
            if (r0 + tid < G.R) {
                ((float *)G.scale)[(size_t)(r0 + tid) * G.scols + tc] = sc;
                if (G.ts) G.ts[(size_t)tc * G.tsld + r0 + tid] = sc;
            }
        }
        __syncthreads();
#pragma unroll
        for (int u = 0; u < 4; u++) d[u] = fq_div_of(dv[4 * lane + u]);
    }
    // Q row 4 lane + u, columns c0 + 16 warp .. + 15: 16 bytes per lane and row
    const int c = c0 + 16 * warp;
    if (c >= G.C) return;
#pragma unroll
    for (int u = 0; u < 4; u++) {
        const int r = xc + u;
        if (r >= G.R) break;
        const size_t at = (size_t)r * G.C + c;
        uint32_t w[4];
#pragma unroll
        for (int s = 0; s < 16; s += 4)
            w[s / 4] = fq_pair<SR>(fq_el(v[s], u), fq_el(v[s + 1], u), d[u], G.rbase, at + s) |
                       fq_pair<SR>(fq_el(v[s + 2], u), fq_el(v[s + 3], u), d[u], G.rbase,
                                   at + s + 2) << 16;
        if (c + 15 < G.C && ((uintptr_t)(G.data + at) & 15) == 0) {
            *(uint4 *)(G.data + at) = make_uint4(w[0], w[1], w[2], w[3]);
        } else {
            for (int s = 0; s < 16 && c + s < G.C; s++)
                G.data[at + s] = (uint8_t)(w[s >> 2] >> (8 * (s & 3)));
        }
    }
}

// Row-wise 1x128 blocks (activations): tiles of FQ_ROWS_TILE x 128, 4 rows a warp, instead of
// fq_kernel's 128 x 128, so that a matrix of a few hundred rows (a decode step's 256) has 4x the
// blocks to spread over the multiprocessors (a 256 x 2048 one: 128, not 32). The same codes and
// scales: a 1x128 block is one row's, whatever the tile.
#define FQ_ROWS_TILE 32
template <int SR, int X16>
__global__ void __launch_bounds__(256) fq_rows_kernel(const __grid_constant__ fq_params P)
{
    const int t = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const fq_group &G = lb_group_of(P.g, P.count, t);
    const int tr = (t - G.tile0) / G.tiles_c, tc = (t - G.tile0) % G.tiles_c;
    const int xr = tr * FQ_ROWS_TILE + 4 * warp, xc = tc * 128 + 4 * lane;
    float4 v[4];
#pragma unroll
    for (int s = 0; s < 4; s++) v[s] = fq_load<X16>(P, G.x, G.rows, xr + s, xc);
    fq_rows<SR>(v, G.data, (float *)G.scale, G.scols, G.R, G.C, xr, xc, tc, G.rbase, lane, G.ts,
                G.tsld, P.pow2);
}

// --- MXFP8, MXFP4 and NVFP4 in one pass (two for an NVFP4 tensor or row maximum) ------------
//
// mq_kernel walks the tiles as fq_kernel does (one 128 x 128 tile of some group's Q per block
// of 256 threads, held in registers, one launch for all the groups) for the formats with byte
// scales. Their blocks fall inside the tile's layout: row-wise, a 1x32 (1x16) block of a Q
// row is 8 (4) adjacent lanes and a 16x16 block is 4 lanes over the warp's 16 rows;
// column-wise, a thread holds 16 consecutive columns of 4 Q rows, so a 1x16 block is its own,
// a 16x16 block 4 lanes and a 1x32 block two warps (through shared memory). NVFP4's second
// level from the tensor's or a Q row's maximum needs that maximum before any block scale: a
// first launch of the same kernel (AMAX) takes it over the same tiles (atomicMax of the |x|
// bits, as amax_kernel), the second quantizes. The wgrad's Hadamard transform of size 16 runs
// on the registers (column-wise, a warp's 16 rows of x are one thread's 16 values); other
// sizes take the passes above.

// 2^(127 - sc) = 1 / decode<LB_E8M0>(sc) exactly, sc < 255 (2^-127 is an fp32 subnormal).
__device__ __forceinline__ float e8m0_recip(unsigned sc)
{
    return sc == 254u ? __uint_as_float(0x00400000u) : __uint_as_float((254u - sc) << 23);
}

struct mq_div {
    fq_div v;
    int zero;   // the divisor is NaN or 0: every code is 0 (encode_kernel's rule)
};

// MX: d = 2^k, and x * 2^-k (one rounding of the exact x / d, subnormal or overflowing
// results included) is __fdiv_rn(x, d). NVFP4: fq_div's reciprocal and correction.
template <int NV> __device__ __forceinline__ mq_div mq_div_of(float d, unsigned sc)
{
    mq_div m;
    m.zero = d != d || d == 0.0f;
    m.v = NV ? fq_div_of(d) : fq_div{d, e8m0_recip(sc), 1.0f};
    return m;
}

// x / d rounded to nearest even (see fq_div). An overflowing quotient returns x r's infinity
// before the correction (which would make it NaN); the codecs saturate either.
template <int NV> __device__ __forceinline__ float mq_quot(float x, const fq_div &v, int sr)
{
    if (!NV) return __fmul_rn(x, v.r);
    if (sr) return fq_quot<1>(x, v);
    x = __fmul_rn(x, v.k);
    const float q = __fmul_rn(x, v.r);
    if (fabsf(q) == INFINITY) return q;
    return copysignf(__fmaf_rn(__fmaf_rn(-v.d, q, x), v.r, q), x);
}

// lb_encode(E2M1, q) rounding to nearest even, for q not NaN: the magnitudes are 0, 0.5, 1,
// 1.5, 2, 3, 4, 6 (codes 0 .. 7), so the code counts the midpoints below |q|; a tie (0.25,
// 0.75, ..., 5) goes to the even code, and everything above 5 (Inf too) saturates to 6. The
// sign bit is q's (-0 included), as the codec's.
__device__ __forceinline__ unsigned e2m1_rn(float q)
{
    const float a = fabsf(q);
    const unsigned m = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                       (a >= 3.5f) + (a > 5.0f);
    return (__float_as_uint(q) >> 28 & 8u) | m;
}

// The codes of x0 / d and x1 / d (Q's element indices at, at + 1), one per byte.
template <int ELEM>
__device__ __forceinline__ uint32_t mq_code2(float q0, float q1, int sr, uint64_t rb, size_t at)
{
    if (ELEM == LB_E4M3 && !sr)   // the hardware conversion: see fq_pair
        return __nv_cvt_float2_to_fp8x2(make_float2(q0, q1), __NV_SATFINITE, __NV_E4M3);
    if (ELEM == LB_E2M1 && !sr) return e2m1_rn(q0) | e2m1_rn(q1) << 8;
    return encode<ELEM>(q0, sr, sr ? d_rand(rb, at) : 0) |
           encode<ELEM>(q1, sr, sr ? d_rand(rb, at + 1) : 0) << 8;
}

// Four consecutive elements of a Q row (index at of the first), one code per byte.
template <int ELEM, int NV>
__device__ __forceinline__ uint32_t mq_codes4(float4 x, const mq_div &m, int sr, uint64_t rb,
                                              size_t at)
{
    if (m.zero) return 0u;
    const float q0 = mq_quot<NV>(x.x, m.v, sr), q1 = mq_quot<NV>(x.y, m.v, sr);
    const float q2 = mq_quot<NV>(x.z, m.v, sr), q3 = mq_quot<NV>(x.w, m.v, sr);
    return mq_code2<ELEM>(q0, q1, sr, rb, at) | mq_code2<ELEM>(q2, q3, sr, rb, at + 2) << 16;
}

// Four E2M1 codes, one per byte, as two bytes of nibbles (the first element low).
__device__ __forceinline__ uint32_t nibbles4(uint32_t w)
{
    return (w & 0xfu) | (w >> 4 & 0xf0u) | (w >> 8 & 0xf00u) | (w >> 12 & 0xf000u);
}

// Row r of Q, columns c .. c + 4n - 1 (c a multiple of 4n): the codes w[i] (four per word, one
// per byte), as one store where the run is whole and aligned, else byte by byte.
template <int ELEM, int N>
__device__ __forceinline__ void mq_store(const fq_group &G, int r, int c, const uint32_t (&w)[N])
{
    if (ELEM == LB_E2M1) {
        uint8_t *p = G.data + (size_t)r * G.ld + c / 2;
        uint32_t h[(N + 1) / 2];
#pragma unroll
        for (int i = 0; i < (N + 1) / 2; i++)
            h[i] = nibbles4(w[2 * i]) | (2 * i + 1 < N ? nibbles4(w[2 * i + 1]) << 16 : 0u);
        if (c + 4 * N - 1 < G.C && ((uintptr_t)p & (2 * N - 1)) == 0) {
            if (N == 1) *(uint16_t *)p = (uint16_t)h[0];
            else if (N == 2) *(uint32_t *)p = h[0];
            else *(uint2 *)p = make_uint2(h[0], h[1]);
            return;
        }
        // a missing last element of an odd row is the zero nibble of its byte
        for (int b = 0; b < 2 * N && c + 2 * b < G.C; b++) {
            uint32_t v = h[b / 4] >> (8 * (b % 4)) & 0xffu;
            if (c + 2 * b + 1 >= G.C) v &= 0xfu;
            p[b] = (uint8_t)v;
        }
        return;
    }
    uint8_t *p = G.data + (size_t)r * G.ld + c;
    if (c + 4 * N - 1 < G.C && ((uintptr_t)p & (4 * N - 1)) == 0) {
        if (N == 1) *(uint32_t *)p = w[0];
        else if (N == 2) *(uint2 *)p = make_uint2(w[0], w[1]);
        else *(uint4 *)p = make_uint4(w[0], w[1], w[2], w[3]);
        return;
    }
    for (int b = 0; b < 4 * N && c + b < G.C; b++) p[b] = (uint8_t)(w[b / 4] >> (8 * (b % 4)));
}

__device__ __forceinline__ float4 f4_neg(float4 a) { return make_float4(-a.x, -a.y, -a.z, -a.w); }

// hadamard.c's transform of size H along v[0 .. 15] (x's rows), component by component: the
// signs, the butterflies of transpose_kernel (same pairs, same roundings), the normalisation.
template <int H>
__device__ __forceinline__ void mq_hadamard(float4 (&v)[16], uint32_t signs, float hc)
{
#pragma unroll
    for (int s = 0; s < 16; s++)
        if (signs >> (s % H) & 1) v[s] = f4_neg(v[s]);
#pragma unroll
    for (int h = 1; h < H; h *= 2)
#pragma unroll
        for (int b = 0; b < 16; b += H)
#pragma unroll
            for (int p = 0; p < H / 2; p++) {
                const int j = b + (p / h) * 2 * h + p % h;
                const float4 a = v[j], c = v[j + h];
                v[j] = make_float4(__fadd_rn(a.x, c.x), __fadd_rn(a.y, c.y), __fadd_rn(a.z, c.z),
                                   __fadd_rn(a.w, c.w));
                v[j + h] = make_float4(__fsub_rn(a.x, c.x), __fsub_rn(a.y, c.y),
                                       __fsub_rn(a.z, c.z), __fsub_rn(a.w, c.w));
            }
#pragma unroll
    for (int s = 0; s < 16; s++)
        v[s] = make_float4(__fmul_rn(v[s].x, hc), __fmul_rn(v[s].y, hc), __fmul_rn(v[s].z, hc),
                           __fmul_rn(v[s].w, hc));
}

// The maximum of m over groups of N adjacent lanes (N a power of two), in every lane.
template <int N> __device__ __forceinline__ uint32_t lanes_max(uint32_t m)
{
#pragma unroll
    for (int o = 1; o < N; o *= 2) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    return m;
}

// The NVFP4 second level of Q row r (row mode) or of the tensor.
__device__ __forceinline__ float mq_s2(const fq_params &P, const fq_group &G, int r)
{
    if (P.s2mode == LB_S2_GIVEN) return P.s2given;
    return nvfp4_scale2(__uint_as_float(G.s2w[P.s2mode == LB_S2_ROW ? r : 0]));
}

// ELEM: element type; BR x BC: block (1x32 MX, 1x16 or 16x16 NVFP4); COLWISE as fq_kernel;
// H: Hadamard size (0 or 16, column-wise); AMAX: the NVFP4 maxima pass.
template <int ELEM, int BR, int BC, int COLWISE, int H, int AMAX, int X16>
__global__ void __launch_bounds__(256, 2) mq_kernel(const __grid_constant__ fq_params P)
{
    constexpr int NV = BC == 16;
    __shared__ uint32_t part[8][128];   // column-wise: each warp's maxima of the Q rows
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, t = blockIdx.x;
    float4 v[16];
    const fq_tile T = fq_tile_load<COLWISE, X16>(P, v);
    const fq_group &G = *T.G;
    const int tc = T.tc, r0 = T.r0, c0 = T.c0, xr = T.xr, xc = T.xc;
    if (H) mq_hadamard<H ? H : 1>(v, G.hsigns, P.hc);

    if (AMAX) {   // NVFP4: the maxima of Q's rows, or of the tensor, into G.s2w
        if (P.s2mode == LB_S2_ROW && !COLWISE) {
#pragma unroll
            for (int s = 0; s < 16; s++) {
                const uint32_t m = __reduce_max_sync(0xffffffffu, fq_abs4(v[s]));
                if (lane == 0 && m && xr + s < G.R) atomicMax(G.s2w + xr + s, m);
            }
        } else if (P.s2mode == LB_S2_ROW) {
            const uint32_t m = colwise_row_max(v, part, tid);
            if (tid < 128 && m && r0 + tid < G.R) atomicMax(G.s2w + r0 + tid, m);
        } else {
            uint32_t m = 0;
#pragma unroll
            for (int s = 0; s < 16; s++) m = max(m, fq_abs4(v[s]));
            m = __reduce_max_sync(0xffffffffu, m);
            if (lane == 0) part[0][warp] = m;
            __syncthreads();
            m = __reduce_max_sync(0xffffffffu, part[0][lane & 7]);
            if (tid == 0 && m) atomicMax(G.s2w, m);
        }
        return;
    }

    float t_all = 0.0f;   // NVFP4 second level of the tensor (or given)
    if (NV) {
        if (P.s2mode != LB_S2_ROW) {
            t_all = mq_s2(P, G, 0);
            if (t == G.tile0 && tid == 0) G.scale2[0] = t_all;
        } else if (tc == 0 && tid < 128 && r0 + tid < G.R) {
            G.scale2[r0 + tid] = mq_s2(P, G, r0 + tid);
        }
    }
    uint8_t *scale = (uint8_t *)G.scale;

    if (!COLWISE) {   // lanes beyond Q's columns take part in the shuffles, store nothing
        const int in = xc < G.C;
        if constexpr (BR == 16) {   // the warp's 16 rows, 4 lanes' 16 columns
            uint32_t m = 0;
#pragma unroll
            for (int s = 0; s < 16; s++) m = max(m, fq_abs4(v[s]));
            m = lanes_max<4>(m);
            unsigned sc;
            const mq_div d = mq_div_of<NV>(byte_scale<ELEM, NV>(m, t_all, 0, sc), sc);
            if ((lane & 3) == 0 && in && xr < G.R)
                scale[(size_t)(xr / 16) * G.scols + xc / 16] = sc;
#pragma unroll
            for (int s = 0; s < 16; s++) {
                const int r = xr + s;
                if (r >= G.R) break;
                const uint32_t w[1] = {mq_codes4<ELEM, NV>(v[s], d, P.sr, G.rbase,
                                                           (size_t)r * G.C + xc)};
                mq_store<ELEM, 1>(G, r, xc, w);
            }
        } else {
            // A block of row xr + s is BC / 4 = LG lanes. Its scale and divisor are computed by
            // one of them (lane k of the group takes rows s = LG i + k), and shuffled to the
            // others: the NVFP4 scale (two divisions and an encoding) is not done LG times.
            constexpr int LG = BC / 4, PER = 16 / LG;
            const int k = lane & (LG - 1);
            uint32_t m[16];
#pragma unroll
            for (int s = 0; s < 16; s++) m[s] = lanes_max<LG>(fq_abs4(v[s]));
            fq_div mine[PER];
#pragma unroll
            for (int i = 0; i < PER; i++) {
                uint32_t mm = m[LG * i];
#pragma unroll
                for (int j = 1; j < LG; j++)
                    if (k == j) mm = m[LG * i + j];
                const int r = xr + LG * i + k;
                const float t2 =
                    NV && P.s2mode == LB_S2_ROW ? (r < G.R ? mq_s2(P, G, r) : 1.0f) : t_all;
                unsigned sc;
                const float d = byte_scale<ELEM, NV>(mm, t2, P.floor_rule, sc);
                // the block's first lane is within Q's columns (this one need not be)
                if (xc - 4 * k < G.C && r < G.R) scale[(size_t)r * G.scols + xc / BC] = sc;
                mine[i] = mq_div_of<NV>(d, sc).v;
            }
#pragma unroll
            for (int s = 0; s < 16; s++) {
                const int r = xr + s, src = (lane & ~(LG - 1)) | (s % LG);
                if (r >= G.R) break;   // the same for the whole warp
                mq_div d;
                d.v.d = __shfl_sync(0xffffffffu, mine[s / LG].d, src);
                d.v.r = __shfl_sync(0xffffffffu, mine[s / LG].r, src);
                d.v.k = NV ? __shfl_sync(0xffffffffu, mine[s / LG].k, src) : 1.0f;
                d.zero = d.v.d != d.v.d || d.v.d == 0.0f;   // d scaled by k: still NaN or 0
                const uint32_t w[1] = {mq_codes4<ELEM, NV>(v[s], d, P.sr, G.rbase,
                                                           (size_t)r * G.C + xc)};
                mq_store<ELEM, 1>(G, r, xc, w);
            }
        }
        return;
    }

    // Column-wise: Q rows xc + u (u < 4), columns c = c0 + 16 warp .. + 15.
    const int c = c0 + 16 * warp;
    uint32_t m[4];
#pragma unroll
    for (int u = 0; u < 4; u++) {
        m[u] = 0;
#pragma unroll
        for (int s = 0; s < 16; s++)
            m[u] = max(m[u], __float_as_uint(fq_el(v[s], u)) & 0x7fffffffu);
    }
    if (BC == 32) {   // with the other warp of the pair
#pragma unroll
        for (int u = 0; u < 4; u++) part[warp][4 * lane + u] = m[u];
        __syncthreads();
#pragma unroll
        for (int u = 0; u < 4; u++) m[u] = max(m[u], part[warp ^ 1][4 * lane + u]);
    } else if (BR == 16) {   // 16 Q rows: 4 lanes' 4
        const uint32_t a = lanes_max<4>(max(max(m[0], m[1]), max(m[2], m[3])));
        m[0] = m[1] = m[2] = m[3] = a;
    }
    if (c >= G.C) return;
#pragma unroll
    for (int u = 0; u < 4; u++) {
        const int r = xc + u;
        if (r >= G.R) break;
        const float t2 = NV && P.s2mode == LB_S2_ROW ? mq_s2(P, G, r) : t_all;
        unsigned sc;
        const mq_div d = mq_div_of<NV>(byte_scale<ELEM, NV>(m[u], t2, P.floor_rule, sc), sc);
        const int writer = BR == 16 ? u == 0 && (lane & 3) == 0 : BC == 32 ? (warp & 1) == 0 : 1;
        if (writer) scale[(size_t)(r / BR) * G.scols + c / BC] = sc;
        const size_t at = (size_t)r * G.C + c;
        uint32_t w[4];
#pragma unroll
        for (int s = 0; s < 16; s += 4)
            w[s / 4] = mq_codes4<ELEM, NV>(make_float4(fq_el(v[s], u), fq_el(v[s + 1], u),
                                                       fq_el(v[s + 2], u), fq_el(v[s + 3], u)),
                                           d, P.sr, G.rbase, at + s);
        mq_store<ELEM, 4>(G, r, c, w);
    }
}

typedef void (*mq_fn)(fq_params);

// mq_kernel's quantizing and maxima kernels for a's format, direction and transform, on fp32
// or (X) bf16 rows.
template <int E, int BR, int BC, int X> static void mq_pick_x(int colwise, int h, mq_fn *q,
                                                             mq_fn *amax)
{
    *amax = NULL;
    if (!colwise) {
        *q = mq_kernel<E, BR, BC, 0, 0, 0, X>;
        if constexpr (BC == 16) *amax = mq_kernel<E, BR, BC, 0, 0, 1, X>;
    } else if (h) {
        *q = mq_kernel<E, BR, BC, 1, 16, 0, X>;
        if constexpr (BC == 16) *amax = mq_kernel<E, BR, BC, 1, 16, 1, X>;
    } else {
        *q = mq_kernel<E, BR, BC, 1, 0, 0, X>;
        if constexpr (BC == 16) *amax = mq_kernel<E, BR, BC, 1, 0, 1, X>;
    }
}

template <int E, int BR, int BC> static void mq_pick(int colwise, int h, int x16, mq_fn *q,
                                                     mq_fn *amax)
{
    if (x16) mq_pick_x<E, BR, BC, 1>(colwise, h, q, amax);
    else mq_pick_x<E, BR, BC, 0>(colwise, h, q, amax);
}

// Whether mq_kernel quantizes under a (else the passes; fp8-block is fq_kernel's).
static int mq_takes(const lb_quant_args *a)
{
    return (a->fmt == LB_FMT_MXFP8 || a->fmt == LB_FMT_MXFP4 || a->fmt == LB_FMT_NVFP4) &&
           (a->hadamard == 0 || a->hadamard == 16);
}

// A launch of fq_kernel or mq_kernel being collected, group by group.
typedef struct {
    lb_cuda_ctx *cx;
    lb_qmat *q;
    int cols, colwise, tiles;
    fq_params *P;
    mq_fn mq, mq_amax;       // mq_kernel's (NULL: fq_kernel); the NVFP4 maxima pass or NULL
    uint32_t *words;         // the maxima words of the groups not yet added (zeroed)
    lb_act x0;               // quantize_rc: x, of which each group's rows are a part
    int rows;                // quantize_rc: fq_kernel<1, 0, 1> (P->rdata: the row-wise Q)
    lb_qmat *qt;             // quantize_rt: the transposed copies, or NULL
    int trows;               // rows of a tile: FQ_ROWS_TILE for fq_rows_kernel, else 128
    int amax_only;           // quantize_amax: the NVFP4 maxima pass alone (words: its output)
} fq_collect;

// fp8-block row-wise 1x128 without quantize_rc's or quantize_rt's second output: fq_rows_kernel.
static int fq_rowwise(const fq_collect *c)
{
    return !c->mq && !c->rows && !c->qt && !c->colwise && !c->P->blk2d;
}

// fq_kernel or fq_rows_kernel for what c collects, on fp32 or (X) bf16 rows.
template <int X> static void fq_launch_x(const fq_collect *c, dim3 g, dim3 b, cudaStream_t st)
{
    if (fq_rowwise(c) && c->P->sr) fq_rows_kernel<1, X><<<g, b, 0, st>>>(*c->P);
    else if (fq_rowwise(c)) fq_rows_kernel<0, X><<<g, b, 0, st>>>(*c->P);
    else if (c->rows) fq_kernel<1, 0, 1, X><<<g, b, 0, st>>>(*c->P);
    else if (c->P->sr && c->colwise) fq_kernel<1, 1, 0, X><<<g, b, 0, st>>>(*c->P);
    else if (c->P->sr) fq_kernel<0, 1, 0, X><<<g, b, 0, st>>>(*c->P);
    else if (c->colwise) fq_kernel<1, 0, 0, X><<<g, b, 0, st>>>(*c->P);
    else fq_kernel<0, 0, 0, X><<<g, b, 0, st>>>(*c->P);
}

static void fq_flush(fq_collect *c)
{
    const dim3 g(c->tiles), b(256);
    cudaStream_t st = c->cx->stream;
    if (c->tiles) {
        if (c->mq_amax) {
            c->mq_amax<<<g, b, 0, st>>>(*c->P);
            LB_CUDA_LAUNCHED(c->cx);
        }
        if (c->amax_only) {
            c->P->count = 0, c->tiles = 0;
            return;
        }
        if (c->mq) c->mq<<<g, b, 0, st>>>(*c->P);
        else if (c->P->x16) fq_launch_x<1>(c, g, b, st);
        else fq_launch_x<0>(c, g, b, st);
        LB_CUDA_LAUNCHED(c->cx);
    }
    c->P->count = 0, c->tiles = 0;
}

// The NVFP4 maxima words a group of pr rows needs (tensor: 1, row: one per Q row).
static size_t mq_words(const lb_quant_args *a, int pr, int cols)
{
    if (a->fmt != LB_FMT_NVFP4 || a->s2_mode == LB_S2_GIVEN) return 0;
    return a->s2_mode == LB_S2_ROW ? (size_t)(a->colwise ? cols : pr) : 1;
}

// Adds group j to the launch being collected (launching it when full).
static void fq_group_add(void *ctx, int j, lb_act xj, int pr, const lb_quant_args *aj)
{
    const int r = xj.rows;
    fq_collect *c = (fq_collect *)ctx;
    if (c->P->count == FQ_MAX) fq_flush(c);
    lb_qmat want;
    memset(&want, 0, sizeof want);
    lb_qmat_layout(&want, pr, c->cols, aj);
    const lb_qmat *q = &c->q[j];
    if (want.fmt != q->fmt || want.rows != q->rows || want.cols != q->cols ||
        want.brows != q->brows || want.bcols != q->bcols || want.elem != q->elem ||
        want.nscale2 != q->nscale2)
        lb_die("cuda quantize: lb_qmat was laid out for another shape or format");
    const int tcn = (want.cols + 127) / 128;
    uint32_t *w = c->words;
    c->words += mq_words(aj, pr, c->cols);
    c->P->g[c->P->count++] = (fq_group){
        xj.p, q->data, q->scale, q->scale2, w, q->ld, r, want.rows, want.cols, want.scols,
        c->tiles, tcn,
        aj->sr ? lb_hash64(lb_hash64(aj->seed) ^ lb_quant_stream(aj->step, aj->tensor)) : 0,
        aj->hadamard && aj->hadamard < 32 ? aj->hsigns & ((1u << aj->hadamard) - 1) : aj->hsigns,
        c->rows ? (int)(((const char *)xj.p - (const char *)c->x0.p) / lb_act_esize(xj) / xj.ld)
                : 0,
        NULL, NULL, 0, 0, 0, NULL};
    if (q->tscale) {   // written with the scales (lb_qmat_tscale_ld dies for other layouts)
        fq_group &g = c->P->g[c->P->count - 1];
        g.tsld = (int)lb_qmat_tscale_ld(q), g.ts = q->tscale;
    }
    if (c->qt) {
        lb_qmat *t = &c->qt[j];
        lb_qmat_transpose_check(t, q);
        if (t->ld != (size_t)t->cols)
            lb_die("cuda quantize_rt: a transposed copy of row pitch %zu for %d columns", t->ld,
                   t->cols);
        fq_group &g = c->P->g[c->P->count - 1];
        g.tdata = t->data, g.tscale = (float *)t->scale, g.tld = t->ld, g.tscols = t->scols;
    }
    c->tiles += (want.rows + c->trows - 1) / c->trows * tcn;
}

// The launch's view of x: its columns, element type, row pitch, and whether every row starts
// aligned for 4-element loads.
static void fq_params_x(fq_params *P, lb_act x)
{
    P->cols = x.cols, P->x16 = x.type == LB_ACT_BF16, P->ld = x.ld;
    const size_t vb = 4 * lb_act_esize(x);   // a 4-element load's bytes
    P->v4 = x.cols % 4 == 0 && ((uintptr_t)x.p % vb) == 0 && (x.ld * lb_act_esize(x)) % vb == 0;
}

// Groups j with prows[j] > 0 (see kernels.h quantize_grouped), q[j] checked against the layout
// of (prows[j], cols) under a: fp8-block (fq_kernel) or a format mq_takes (mq_kernel), in as
// many launches as FQ_MAX groups need. amax_out: NULL, or (NVFP4) quantize_amax's output, which
// gets the maxima words of the groups' second levels instead of any quantization.

static void fq_launch(lb_cuda_ctx *cx, int count, lb_qmat *q, lb_act x, const int *rows,
                      const int *prows, const lb_quant_args *a, float *amax_out)
{
    const int cols = x.cols;
    fq_params *P = (fq_params *)lb_calloc(1, sizeof *P);
    fq_params_x(P, x);
    P->blk2d = a->weight_blocks ? 1 : 0, P->sr = a->sr ? 1 : 0, P->pow2 = a->pow2 ? 1 : 0;
    fq_collect c = {cx, q, cols, a->colwise ? 1 : 0, 0, P, NULL, NULL, NULL, {}, 0, NULL, 128};
    if (a->fmt != LB_FMT_FP8_BLOCK) {
        const int h = a->hadamard;
        P->floor_rule = a->rule == LB_SCALE_FLOOR, P->s2mode = (int)a->s2_mode, P->s2given = a->s2;
        P->hc = h ? (float)(1.0 / sqrt((double)h)) : 0.0f;   // hadamard.c's norm_const
        if (a->fmt == LB_FMT_MXFP4) mq_pick<LB_E2M1, 1, 32>(c.colwise, h, P->x16, &c.mq, &c.mq_amax);
        else if (a->fmt == LB_FMT_NVFP4 && a->weight_blocks)
            mq_pick<LB_E2M1, 16, 16>(c.colwise, h, P->x16, &c.mq, &c.mq_amax);
        else if (a->fmt == LB_FMT_NVFP4) mq_pick<LB_E2M1, 1, 16>(c.colwise, h, P->x16, &c.mq, &c.mq_amax);
        else if (a->elem == LB_E5M2) mq_pick<LB_E5M2, 1, 32>(c.colwise, h, P->x16, &c.mq, &c.mq_amax);
        else mq_pick<LB_E4M3, 1, 32>(c.colwise, h, P->x16, &c.mq, &c.mq_amax);
        size_t nw = 0;   // fq_group_add's, group after group (those skipped have none)
        for (int j = 0; j < count; j++) {
            const int pr = prows ? prows[j] : rows[j];
            if (pr > 0) nw += mq_words(a, pr, cols);
        }
        if (amax_out && !nw) {   // no group
            free(P);
            return;
        }
        if (nw) {   // the maxima words of every group, zeroed once or the given amaxes' bits
            c.words = amax_out ? (uint32_t *)amax_out
                               : (uint32_t *)lb_cuda_scratch(cx, nw * sizeof(uint32_t));
            c.amax_only = amax_out != NULL;
            if (a->amax && !amax_out)
                LB_CUDA_CHECK(cudaMemcpyAsync(c.words, a->amax, nw * sizeof(uint32_t),
                                              cudaMemcpyDeviceToDevice, cx->stream));
            else
                LB_CUDA_CHECK(cudaMemsetAsync(c.words, 0, nw * sizeof(uint32_t), cx->stream));
        } else {
            c.mq_amax = NULL;   // a given second level
        }
    }
    if (fq_rowwise(&c)) c.trows = FQ_ROWS_TILE;
    lb_quant_groups(count, x, rows, prows, a, fq_group_add, &c);
    fq_flush(&c);
    free(P);
}

// NVFP4's second-level mode and given value, checked as the CPU checks them.
static void nv_check(const lb_quant_args *a)
{
    if (a->fmt != LB_FMT_NVFP4) return;
    if (a->s2_mode == LB_S2_GIVEN) {
        if (a->amax) lb_die("cuda quantize: NVFP4 given scale2 with given amaxes");
        if (!(a->s2 > 0.0f && a->s2 < INFINITY) && a->s2 == a->s2)
            lb_die("cuda quantize: NVFP4 given scale2 %g is not positive and finite",
                   (double)a->s2);
    } else if (a->s2_mode != LB_S2_TENSOR && a->s2_mode != LB_S2_ROW) {
        lb_die("cuda quantize: unknown scale2 mode %d", (int)a->s2_mode);
    }
}

// lb_qmat.tscale from q's scales, for the quantizers that do not write it as they go.
__global__ void tscale_kernel(float *ts, int ld, const float *s, int rows, int kb)
{
    const size_t n = (size_t)rows * kb;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const int k = (int)(i / rows), r = (int)(i % rows);
        ts[(size_t)k * ld + r] = s[(size_t)r * kb + k];
    }
}

static void tscale_launch(lb_cuda_ctx *cx, const lb_qmat *q)
{
    const size_t n = (size_t)q->srows * q->scols;
    tscale_kernel<<<lb_grid(n, 256, cx), 256, 0, cx->stream>>>(
        q->tscale, (int)lb_qmat_tscale_ld(q), (const float *)q->scale, q->srows, q->scols);
    LB_CUDA_LAUNCHED(cx);
}

static void cuda_qmat_alloc(lb_backend *be, lb_qmat *q, int rows, int cols, const lb_quant_args *a)
{
    memset(q, 0, sizeof *q);
    lb_qmat_layout(q, rows, cols, a);
    q->data = (uint8_t *)be->alloc(be, lb_qmat_data_bytes(q));
    q->scale = be->alloc(be, lb_qmat_scale_bytes(q));
    q->scale2 = q->nscale2 ? (float *)be->alloc(be, (size_t)q->nscale2 * sizeof(float)) : NULL;
}

static void cuda_qmat_free(lb_backend *be, lb_qmat *q)
{
    be->free(be, q->data);
    be->free(be, q->scale);
    be->free(be, q->scale2);
    q->data = NULL;
    q->scale = NULL;
    q->scale2 = NULL;
}

// The d16 copies (lb_qmat.d16) of the count matrices q that have one, from their bytes: one
// launch of dequant_groups_kernel per DQ_MAX, after their quantizer's launches (one stream).
static void d16_launch(lb_cuda_ctx *cx, int count, const lb_qmat *q)
{
    lb_cuda_dq_job *jobs = NULL;
    int n = 0;
    for (int j = 0; j < count; j++) {
        if (!q[j].d16 || q[j].rows <= 0) continue;
        const size_t ld = (size_t)((q[j].cols + 7) & ~7);
        lb_qmat_d16_bytes(&q[j]);   // dies for a format without
        if (!jobs) jobs = (lb_cuda_dq_job *)lb_calloc((size_t)count, sizeof *jobs);
        jobs[n++] = (lb_cuda_dq_job){&q[j], q[j].d16, ld, (int)ld};
    }
    if (n) lb_cuda_dequant_bf16_groups(cx, n, jobs);
    free(jobs);
}

static void quantize_passes(lb_cuda_ctx *cx, lb_qmat *q, const float *x, int rows, int cols,
                            const lb_quant_args *a, float *amax_out);

__global__ void act_f32_kernel(float *y, const void *x, int x16, size_t ld, int rows, int cols)
{
    const size_t n = (size_t)rows * cols;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / cols, c = i % cols;
        y[i] = x16 ? bf16_val(((const uint16_t *)x)[r * ld + c]) : ((const float *)x)[r * ld + c];
    }
}

// x's rows in fp32, cols apart, followed by pr - x.rows zero rows (pr >= x.rows): x itself
// where it is so, else a copy in stream-ordered memory, *tmp (cudaFreeAsync it on cx's stream;
// else NULL). For the passes that read fp32 rows alone.
static const float *act_f32(lb_cuda_ctx *cx, lb_act x, int pr, float **tmp)
{
    *tmp = NULL;
    if (x.type == LB_ACT_F32 && x.ld == (size_t)x.cols && pr == x.rows) return (const float *)x.p;
    const size_t row = (size_t)x.cols * sizeof(float), have = x.rows * row, all = pr * row;
    float *t = (float *)lb_cuda_malloc_what(cx, all ? all : 4, 1,
                                            "rows copied in fp32 for quantization");
    if (all > have)
        LB_CUDA_CHECK(cudaMemsetAsync((char *)t + have, 0, all - have, cx->stream));
    if (x.type == LB_ACT_F32 && x.ld == (size_t)x.cols && have) {
        LB_CUDA_CHECK(cudaMemcpyAsync(t, x.p, have, cudaMemcpyDeviceToDevice, cx->stream));
    } else if (have) {
        act_f32_kernel<<<lb_grid((size_t)x.rows * x.cols, 256, cx), 256, 0, cx->stream>>>(
            t, x.p, x.type == LB_ACT_BF16, x.ld, x.rows, x.cols);
        LB_CUDA_LAUNCHED(cx);
    }
    return *tmp = t;
}

// amax_out: NULL, or (NVFP4) quantize_amax's output: the maxima words of q's second levels
// are written there and nothing is quantized.
static void quantize_one(lb_backend *be, lb_qmat *q, lb_act x, const lb_quant_args *a,
                         float *amax_out)
{
    lb_cuda_ctx *cx = lb_cuda(be);
    int rows = x.rows;
    lb_qmat want;
    memset(&want, 0, sizeof want);
    lb_qmat_layout(&want, rows, x.cols, a);   // dies on a bad combination, as the CPU
    if (want.fmt != q->fmt || want.rows != q->rows || want.cols != q->cols ||
        want.brows != q->brows || want.bcols != q->bcols || want.elem != q->elem ||
        want.nscale2 != q->nscale2)
        lb_die("cuda quantize: lb_qmat was laid out for another shape or format");
    nv_check(a);
    if (q->tscale) lb_qmat_tscale_ld(q);   // dies for a layout without
    if ((q->fmt == LB_FMT_FP8_BLOCK && !a->hadamard) || mq_takes(a)) {   // fq_ or mq_kernel
        fq_launch(cx, 1, q, x, &rows, NULL, a, amax_out);
        return;
    }
    float *tmp;
    quantize_passes(cx, q, act_f32(cx, x, rows, &tmp), rows, x.cols, a, amax_out);
    if (tmp) LB_CUDA_CHECK(cudaFreeAsync(tmp, cx->stream));
}

// The other formats and transforms in several passes over fp32 rows.
static void quantize_passes(lb_cuda_ctx *cx, lb_qmat *q, const float *x, int rows, int cols,
                            const lb_quant_args *a, float *amax_out)
{
    const int nv = q->fmt == LB_FMT_NVFP4;
    // fp8-tensor: the passes below with one block. The tensor's maximum is the atomic maximum
    // of amax_kernel's second-level word (an order-free maximum of |x| bits: NaN above Inf
    // above every finite value), its scale fp8-block's rule on that one amax.
    const int pt = q->fmt == LB_FMT_FP8_TENSOR;
    const int R = q->rows, C = q->cols;
    const size_t n = (size_t)R * C, nseg = (size_t)R * (pt ? (C + 127) / 128 : q->scols),
                 nblk = (size_t)q->srows * q->scols;
    const int need_s2word = (nv && a->s2_mode != LB_S2_GIVEN) || pt;

    // Scratch: [x^T] [amax1] [dv] [s2 words]
    size_t o_amax = a->colwise ? lb_align256(n * sizeof(float)) : 0;
    size_t o_dv = o_amax + lb_align256(nseg * sizeof(uint32_t));
    size_t o_s2 = o_dv + lb_align256(nblk * sizeof(float));
    const int nword = pt ? 1 : q->nscale2;
    size_t total = o_s2 + (need_s2word && !amax_out ? lb_align256((size_t)nword * sizeof(uint32_t)) : 0);
    char *sc = (char *)lb_cuda_scratch(cx, total);
    uint32_t *amax1 = (uint32_t *)(sc + o_amax),
             *s2word = amax_out ? (uint32_t *)amax_out
                                : need_s2word ? (uint32_t *)(sc + o_s2) : NULL;
    float *dv = (float *)(sc + o_dv);

    const float *src = x;
    if (a->colwise) {   // Q = x^T: x (rows, cols) -> (cols, rows) = (R, C)
        float *xt = (float *)sc;
        size_t ntiles = (size_t)((cols + 31) / 32) * ((rows + 31) / 32);
        unsigned g = ntiles < (size_t)cx->num_sms * 32 ? (unsigned)ntiles : (unsigned)cx->num_sms * 32;
        // with the wgrad's Hadamard transform fused in (lb_qmat_layout checked its size)
        const int h = a->hadamard;
        const uint32_t hs = h && h < 32 ? a->hsigns & ((1u << h) - 1) : a->hsigns;
        const float hc = h ? (float)(1.0 / sqrt((double)h)) : 0.0f;   // hadamard.c's norm_const
        const dim3 tb(32, 8);
        switch (h) {
        case 0: transpose_kernel<0><<<g, tb, 0, cx->stream>>>(xt, x, rows, cols, 0, 0.0f); break;
        case 2: transpose_kernel<2><<<g, tb, 0, cx->stream>>>(xt, x, rows, cols, hs, hc); break;
        case 4: transpose_kernel<4><<<g, tb, 0, cx->stream>>>(xt, x, rows, cols, hs, hc); break;
        case 8: transpose_kernel<8><<<g, tb, 0, cx->stream>>>(xt, x, rows, cols, hs, hc); break;
        case 16: transpose_kernel<16><<<g, tb, 0, cx->stream>>>(xt, x, rows, cols, hs, hc); break;
        default: transpose_kernel<32><<<g, tb, 0, cx->stream>>>(xt, x, rows, cols, hs, hc); break;
        }
        LB_CUDA_LAUNCHED(cx);
        src = xt;
    }
    if (need_s2word && nv && a->amax && !amax_out)   // the given amaxes' bits
        LB_CUDA_CHECK(cudaMemcpyAsync(s2word, a->amax, (size_t)nword * sizeof(uint32_t),
                                      cudaMemcpyDeviceToDevice, cx->stream));
    else if (need_s2word)
        LB_CUDA_CHECK(cudaMemsetAsync(s2word, 0, (size_t)nword * sizeof(uint32_t), cx->stream));

    // Segment maxima of 128 columns (fp8-tensor: written, then unused beside the word).
    const int bc1 = pt ? 128 : q->bcols, scols1 = pt ? (C + 127) / 128 : q->scols;
    size_t warps = (size_t)R * ((C + 127) / 128);
    amax_kernel<<<lb_grid(warps * 32, 256, cx), 256, 0, cx->stream>>>(
        src, R, C, bc1, scols1, amax1, s2word, !pt && a->s2_mode == LB_S2_ROW);
    LB_CUDA_LAUNCHED(cx);
    if (amax_out) return;
    uint64_t rbase = a->sr ? lb_hash64(lb_hash64(a->seed) ^ lb_quant_stream(a->step, a->tensor)) : 0;
    if (pt) {
        // The scale from the one word (fp8-block's branch of scale_kernel, one block of one
        // row), then the elements against dv[0].
        scale_kernel<LB_E4M3><<<1, 32, 0, cx->stream>>>(LB_FMT_FP8_BLOCK, 1, 1, 1, 1, s2word,
                                                          q->scale, NULL, 0, 0, a->pow2 ? 1 : 0,
                                                          dv);
        LB_CUDA_LAUNCHED(cx);
        size_t pairs = (size_t)R * ((C + 1) / 2);
        encode_kernel<LB_E4M3><<<lb_grid(pairs, 256, cx), 256, 0, cx->stream>>>(
            src, R, C, R, C, 1, dv, q->data, q->ld, a->sr ? 1 : 0, rbase);
        LB_CUDA_LAUNCHED(cx);
        return;
    }
    if (nv) {
        scale2_kernel<<<lb_grid((size_t)q->nscale2, 256, cx), 256, 0, cx->stream>>>(
            q->scale2, s2word, q->nscale2, a->s2_mode == LB_S2_GIVEN, a->s2);
        LB_CUDA_LAUNCHED(cx);
    }
    int s2row = nv && a->s2_mode == LB_S2_ROW, floor_rule = a->rule == LB_SCALE_FLOOR;
    const int pow2 = a->pow2 ? 1 : 0;
    unsigned gs = lb_grid(nblk, 256, cx);
#define SK(E)                                                                                  \
    scale_kernel<E><<<gs, 256, 0, cx->stream>>>((int)q->fmt, R, q->brows, q->srows, q->scols,  \
                                                amax1, q->scale, q->scale2, s2row, floor_rule, \
                                                pow2, dv)
    switch (q->elem) {
    case LB_E4M3: SK(LB_E4M3); break;
    case LB_E5M2: SK(LB_E5M2); break;
    case LB_E2M1: SK(LB_E2M1); break;
    default: lb_die("cuda quantize: element type %d", (int)q->elem);
    }
#undef SK
    LB_CUDA_LAUNCHED(cx);

    size_t pairs = (size_t)R * ((C + 1) / 2);
    unsigned ge = lb_grid(pairs, 256, cx);
#define EK(E)                                                                                  \
    encode_kernel<E><<<ge, 256, 0, cx->stream>>>(src, R, C, q->brows, q->bcols, q->scols, dv,  \
                                                 q->data, q->ld, a->sr ? 1 : 0, rbase)
    switch (q->elem) {
    case LB_E4M3: EK(LB_E4M3); break;
    case LB_E5M2: EK(LB_E5M2); break;
    case LB_E2M1: EK(LB_E2M1); break;
    default: break;
    }
#undef EK
    LB_CUDA_LAUNCHED(cx);
    if (q->tscale) tscale_launch(cx, q);
}

static void cuda_quantize(lb_backend *be, lb_qmat *q, lb_act x, const lb_quant_args *a)
{
    quantize_one(be, q, x, a, NULL);
    d16_launch(lb_cuda(be), 1, q);
}

// One group quantized on its own; a padded one from a zero-filled fp32 copy (act_f32).
static void cuda_group(void *ctx, int j, lb_act xj, int pr, const lb_quant_args *aj)
{
    lb_backend *be = (lb_backend *)((void **)ctx)[0];
    lb_qmat *q = (lb_qmat *)((void **)ctx)[1];
    if (pr == xj.rows) {
        cuda_quantize(be, &q[j], xj, aj);
        return;
    }
    float *t;
    cuda_quantize(be, &q[j], lb_act_f32(act_f32(lb_cuda(be), xj, pr, &t), pr, xj.cols), aj);
    LB_CUDA_CHECK(cudaFreeAsync(t, lb_cuda(be)->stream));
}

// fp8-block without a Hadamard transform: all groups in one fq_kernel launch; MX and NVFP4
// without one or with size 16: one mq_kernel launch (two for NVFP4's maxima). Otherwise:
// quantize per group (a transform fused into its transpose), a padded group from a zero-filled
// copy in stream-ordered memory.
static void cuda_quantize_grouped(lb_backend *be, int count, lb_qmat *q, lb_act x,
                                  const int *rows, const int *prows, const lb_quant_args *a)
{
    lb_cuda_ctx *cx = lb_cuda(be);
    nv_check(a);
    if ((a->fmt == LB_FMT_FP8_BLOCK && !a->hadamard) || mq_takes(a)) {
        fq_launch(cx, count, q, x, rows, prows, a, NULL);
        d16_launch(cx, count, q);
        return;
    }
    void *g[2] = {be, q};   // cuda_quantize writes each group's d16
    lb_quant_groups(count, x, rows, prows, a, cuda_group, g);
}

typedef struct {
    lb_backend *be;
    float *out;   // the next group's amaxes
} amax_groups;

// quantize_amax of one group: quantize_one's maxima pass, a padded group from a zero-filled
// copy (a Hadamard transform mixes the padding rows in, as the quantization does).
static void amax_group(void *ctx, int j, lb_act xj, int pr, const lb_quant_args *aj)
{
    amax_groups *g = (amax_groups *)ctx;
    lb_qmat q;   // the layout alone: quantize_one checks against it
    memset(&q, 0, sizeof q);
    lb_qmat_layout(&q, pr, xj.cols, aj);
    float *out = g->out;
    g->out += lb_quant_nscale2(pr, xj.cols, aj);
    if (pr == xj.rows) {
        quantize_one(g->be, &q, xj, aj, out);
        return;
    }
    float *t;
    quantize_one(g->be, &q, lb_act_f32(act_f32(lb_cuda(g->be), xj, pr, &t), pr, xj.cols), aj,
                 out);
    LB_CUDA_CHECK(cudaFreeAsync(t, lb_cuda(g->be)->stream));
}

// NVFP4's maxima words are |x| bits, so the amaxes are those words as floats: mq_kernel's maxima
// pass for all groups in one launch where it quantizes, else amax_kernel per group.
static void cuda_quantize_amax(lb_backend *be, float *amax, int count, lb_act x,
                               const int *rows, const int *prows, const lb_quant_args *a)
{
    lb_quant_nscale2(1, x.cols, a);   // dies for a format or mode without
    lb_quant_args b = *a;
    b.amax = NULL;
    if (mq_takes(&b)) {
        lb_qmat *q = (lb_qmat *)lb_calloc((size_t)count + 1, sizeof *q);
        for (int j = 0; j < count; j++) {
            const int pr = prows ? prows[j] : rows[j];
            if (pr > 0) lb_qmat_layout(&q[j], pr, x.cols, &b);
        }
        fq_launch(lb_cuda(be), count, q, x, rows, prows, &b, amax);
        free(q);
        return;
    }
    amax_groups g = {be, amax};
    lb_quant_groups(count, x, rows, prows, &b, amax_group, &g);
}

// fp8-block 1x128 both ways, rounding to nearest, no transform, one scale rule (a layer's dy
// under the fp8-block recipe): the column-wise tiles of fq_kernel, each also written row-wise,
// one launch per FQ_MAX groups, so x is read once. Otherwise the two calls.
static void cuda_quantize_rc(lb_backend *be, lb_qmat *qr, const lb_quant_args *ar, int count,
                             lb_qmat *qc, lb_act x, const int *rows, const int *prows,
                             const lb_quant_args *ac)
{
    lb_cuda_ctx *cx = lb_cuda(be);
    int total = 0;
    for (int j = 0; j < count; j++) total += rows[j];
    const int one = ar->fmt == LB_FMT_FP8_BLOCK && ac->fmt == LB_FMT_FP8_BLOCK && !ar->colwise &&
                    ac->colwise && !ar->weight_blocks && !ac->weight_blocks && !ar->sr &&
                    !ac->sr && !ar->hadamard && !ac->hadamard && !ar->pow2 == !ac->pow2 &&
                    total > 0;
    if (!one) {
        cuda_quantize(be, qr, lb_act_rows(x, 0, total), ar);
        cuda_quantize_grouped(be, count, qc, x, rows, prows, ac);
        return;
    }
    lb_qmat want;
    memset(&want, 0, sizeof want);
    lb_qmat_layout(&want, total, x.cols, ar);
    if (want.fmt != qr->fmt || want.rows != qr->rows || want.cols != qr->cols ||
        want.brows != qr->brows || want.bcols != qr->bcols || want.elem != qr->elem)
        lb_die("cuda quantize_rc: the row-wise lb_qmat was laid out for another shape or format");
    fq_params *P = (fq_params *)lb_calloc(1, sizeof *P);
    fq_params_x(P, x);
    P->pow2 = ac->pow2 ? 1 : 0;   // the row-wise copy's too (the same, checked above)
    P->rdata = qr->data, P->rscale = (float *)qr->scale, P->rscols = qr->scols;
    if (qr->tscale) P->rts = qr->tscale, P->rtsld = (int)lb_qmat_tscale_ld(qr);
    fq_collect c = {cx, qc, x.cols, 1, 0, P, NULL, NULL, NULL, x, 1, NULL, 128};
    lb_quant_groups(count, x, rows, prows, ac, fq_group_add, &c);
    fq_flush(&c);
    free(P);
}

static void cuda_dequantize(lb_backend *be, float *y, const lb_qmat *q)
{
    dequant_launch<float>(lb_cuda(be), y, (size_t)q->cols, q->cols, q, 1);
}

// --- transposed copies (qmat_transpose, kernels/quant lb_qmat_transpose) ------------------------

// One launch for up to QT_MAX matrices of one format: qt8_kernel moves byte codes (E4M3) in 64 x
// 64 tiles through shared memory, 16 bytes per thread in and out; qt4_kernel moves E2M1 codes in
// 32 x 32 tiles (one code per byte there; pairs split and rejoined); then qs_kernel transposes
// the small scale grids and copies the second level.
#define QT_MAX 128

typedef struct {
    const uint8_t *sd;
    uint8_t *dd;           // codes: src (rows, cols), dst (cols, rows)
    const void *ss;
    void *ds;              // block scales: src (srows, scols), dst (scols, srows)
    const float *s2s;
    float *s2d;            // NVFP4's one second level, else NULL
    int rows, cols, srows, scols;
    size_t sld, dld;       // bytes per row
    int tile0, tiles_c;    // the group's first tile; tiles per tile row of src
} qt_group;

typedef struct {
    int count, e2m1, es;   // es: bytes per scale (4 fp8-block, 1 NVFP4)
    qt_group g[QT_MAX];
} qt_params;

__global__ void qt8_kernel(const __grid_constant__ qt_params P)
{
    // Loads: thread (row tid / 4, bytes 16 (tid % 4) ..); stores: dst row c0 + tid % 64 (a
    // column of the tile), src rows 16 (tid / 64) ..: each warp reads 32 consecutive bytes of a
    // tile row at a time, so neither phase has bank conflicts without padding.
    __shared__ __align__(16) uint8_t tile[64][64];
    const int t = blockIdx.x, tid = threadIdx.x;
    const qt_group &G = lb_group_of(P.g, P.count, t);
    const int u = t - G.tile0, r0 = u / G.tiles_c * 64, c0 = u % G.tiles_c * 64;
    {
        const int i = tid >> 2, j = 16 * (tid & 3), r = r0 + i, c = c0 + j;
        uint4 w = make_uint4(0, 0, 0, 0);   // beyond src: zero (never stored)
        if (r < G.rows && c < G.cols) {
            const uint8_t *p = G.sd + (size_t)r * G.sld + c;
            if (c + 15 < G.cols && ((uintptr_t)p & 15) == 0) {
                w = *(const uint4 *)p;
            } else {
                uint32_t b[4] = {0, 0, 0, 0};
                for (int k = 0; k < 16 && c + k < G.cols; k++)
                    b[k >> 2] |= (uint32_t)p[k] << 8 * (k & 3);
                w = make_uint4(b[0], b[1], b[2], b[3]);
            }
        }
        *(uint4 *)&tile[i][j] = w;
    }
    __syncthreads();
    const int i = tid & 63, j = 16 * (tid >> 6), c = c0 + i, r = r0 + j;
    if (c >= G.cols || r >= G.rows) return;
    uint32_t b[4];
#pragma unroll
    for (int q = 0; q < 4; q++)
        b[q] = tile[j + 4 * q][i] | tile[j + 4 * q + 1][i] << 8 | tile[j + 4 * q + 2][i] << 16 |
               (uint32_t)tile[j + 4 * q + 3][i] << 24;
    uint8_t *p = G.dd + (size_t)c * G.dld + r;
    if (r + 15 < G.rows && ((uintptr_t)p & 15) == 0) {
        *(uint4 *)p = make_uint4(b[0], b[1], b[2], b[3]);
    } else {
        for (int k = 0; k < 16 && r + k < G.rows; k++) p[k] = (uint8_t)(b[k >> 2] >> 8 * (k & 3));
    }
}

__global__ void qt4_kernel(const __grid_constant__ qt_params P)
{
    __shared__ uint8_t tile[32][33];
    const int t = blockIdx.x, tx = threadIdx.x, ty = threadIdx.y;
    const qt_group &G = lb_group_of(P.g, P.count, t);
    const int u = t - G.tile0, r0 = u / G.tiles_c * 32, c0 = u % G.tiles_c * 32;
    for (int k = ty; k < 32; k += 8) {
        const int r = r0 + k, c = c0 + tx;
        uint8_t v = 0;   // beyond src: zero (an odd row count's last high nibble)
        if (r < G.rows && c < G.cols) {
            const uint8_t b = G.sd[(size_t)r * G.sld + (c >> 1)];
            v = (uint8_t)(b >> ((c & 1) * 4) & 15u);
        }
        tile[k][tx] = v;
    }
    __syncthreads();
    for (int k = ty; k < 32; k += 8) {   // dst row c0 + k: src rows r0 .. r0 + 31
        const int c = c0 + k;
        if (c >= G.cols) continue;
        // r0 is even: byte (r0 + 2 tx) / 2 holds rows r0 + 2 tx and + 1
        const int r = r0 + 2 * tx;
        if (tx < 16 && r < G.rows)
            G.dd[(size_t)c * G.dld + (r >> 1)] =
                (uint8_t)(tile[2 * tx][k] | tile[2 * tx + 1][k] << 4);
    }
}

__global__ void qs_kernel(const __grid_constant__ qt_params P)
{
    const qt_group &G = P.g[blockIdx.y];
    const int n = G.srows * G.scols;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const int a = i / G.scols, b = i - a * G.scols;
        const size_t from = (size_t)i * P.es, to = ((size_t)b * G.srows + a) * P.es;
        for (int e = 0; e < P.es; e++)
            ((uint8_t *)G.ds)[to + e] = ((const uint8_t *)G.ss)[from + e];
        if (i == 0 && G.s2d) *G.s2d = *G.s2s;
    }
}

static void qt_launch(lb_cuda_ctx *cx, qt_params *P, int tiles)
{
    if (!P->count) return;
    if (P->e2m1) qt4_kernel<<<tiles, dim3(32, 8), 0, cx->stream>>>(*P);
    else qt8_kernel<<<tiles, 256, 0, cx->stream>>>(*P);
    LB_CUDA_LAUNCHED(cx);
    int most = 1;
    for (int j = 0; j < P->count; j++)
        if (P->g[j].srows * P->g[j].scols > most) most = P->g[j].srows * P->g[j].scols;
    qs_kernel<<<dim3((unsigned)((most + 255) / 256), (unsigned)P->count), 256, 0, cx->stream>>>(*P);
    LB_CUDA_LAUNCHED(cx);
    P->count = 0;
}

static void cuda_qmat_transpose(lb_backend *be, int count, lb_qmat *dst, const lb_qmat *src)
{
    lb_cuda_ctx *cx = lb_cuda(be);
    qt_params *P = (qt_params *)lb_calloc(1, sizeof *P);
    int tiles = 0;
    for (int j = 0; j < count; j++) {
        lb_qmat_transpose_check(&dst[j], &src[j]);
        const int e2m1 = src[j].elem == LB_E2M1, es = src[j].fmt == LB_FMT_FP8_BLOCK ? 4 : 1;
        if (P->count == QT_MAX || (P->count && (P->e2m1 != e2m1 || P->es != es))) {
            qt_launch(cx, P, tiles);
            tiles = 0;
        }
        P->e2m1 = e2m1, P->es = es;
        const lb_qmat *a = &src[j];
        const int T = e2m1 ? 32 : 64, tc = (a->cols + T - 1) / T;   // the kernel's tile
        P->g[P->count++] = (qt_group){a->data, dst[j].data, a->scale, dst[j].scale,
                                      a->nscale2 ? a->scale2 : NULL,
                                      a->nscale2 ? dst[j].scale2 : NULL,
                                      a->rows, a->cols, a->srows, a->scols, a->ld, dst[j].ld,
                                      tiles, tc};
        tiles += (a->rows + T - 1) / T * tc;
    }
    qt_launch(cx, P, tiles);
    free(P);
    d16_launch(cx, count, dst);
}

// fp8-block 128x128 row-wise (a weight cache): each tile written to Q and, transposed, to Q^T
// by fq_kernel, one launch per FQ_MAX groups; the pass of qmat_transpose over Q's bytes and
// its launches saved. Otherwise the two calls.
static void cuda_quantize_rt(lb_backend *be, int count, lb_qmat *qr, lb_qmat *qc,
                             const float *x, const int *rows, int cols, const lb_quant_args *a)
{
    int total = 0;
    for (int j = 0; j < count; j++) total += rows[j];
    const lb_act xa = lb_act_f32(x, total, cols);
    if (a->fmt != LB_FMT_FP8_BLOCK || !a->weight_blocks || a->colwise || a->hadamard) {
        cuda_quantize_grouped(be, count, qr, xa, rows, NULL, a);
        lb_qmat *s = (lb_qmat *)lb_calloc(2 * (size_t)count + 1, sizeof *s), *d = s + count;
        int n = 0;
        for (int j = 0; j < count; j++)
            if (rows[j]) s[n] = qr[j], d[n++] = qc[j];   // the same buffers
        cuda_qmat_transpose(be, n, d, s);
        free(s);
        return;
    }
    fq_params *P = (fq_params *)lb_calloc(1, sizeof *P);
    fq_params_x(P, xa);
    P->blk2d = 1, P->sr = a->sr ? 1 : 0, P->pow2 = a->pow2 ? 1 : 0;
    fq_collect c = {lb_cuda(be), qr, cols, 0, 0, P, NULL, NULL, NULL, {}, 0, qc, 128};
    lb_quant_groups(count, xa, rows, NULL, a, fq_group_add, &c);
    fq_flush(&c);
    free(P);
}

// --- Hadamard (hadamard.c) ------------------------------------------------------------------

// One thread per block of n elements (a line l, block b): the same butterflies in the same order
// as the CPU (h = 1, 2, 4, ...; (a, b) -> (a + b, a - b)), then one multiply by c. The block is
// held in registers, so y may equal x.
template <int N>
__global__ void hadamard_kernel(float *y, const float *x, int rows, int cols, int axis_cols,
                                uint32_t signs, float c)
{
    const int len = axis_cols ? cols : rows, lines = axis_cols ? rows : cols;
    const int nblocks = len / N;
    const size_t stride = axis_cols ? 1 : (size_t)cols;
    const size_t total = (size_t)lines * nblocks;
    for (size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x; t < total;
         t += (size_t)gridDim.x * blockDim.x) {
        // Along rows, consecutive threads take consecutive columns (coalesced).
        size_t l, b;
        if (axis_cols) {
            l = t / nblocks;
            b = t % nblocks;
        } else {
            l = t % lines;
            b = t / lines;
        }
        size_t base = axis_cols ? l * cols + b * N : b * N * (size_t)cols + l;
        float v[N];
#pragma unroll
        for (int j = 0; j < N; j++) {
            float u = x[base + j * stride];
            v[j] = (signs >> j & 1) ? -u : u;
        }
#pragma unroll
        for (int h = 1; h < N; h *= 2)
#pragma unroll
            for (int i = 0; i < N; i += 2 * h)
#pragma unroll
                for (int j = i; j < i + h; j++) {
                    float a = v[j], bb = v[j + h];
                    v[j] = __fadd_rn(a, bb);
                    v[j + h] = __fsub_rn(a, bb);
                }
#pragma unroll
        for (int j = 0; j < N; j++) y[base + j * stride] = __fmul_rn(v[j], c);
    }
}

static void cuda_hadamard(lb_backend *be, float *y, const float *x, int rows, int cols, int axis,
                          int hn, uint32_t signs)
{
    lb_cuda_ctx *cx = lb_cuda(be);
    if (hn < 2 || hn > 32 || (hn & (hn - 1)))
        lb_die("cuda hadamard: size %d is not a power of two in [2, 32]", hn);
    if (axis != LB_AXIS_ROWS && axis != LB_AXIS_COLS)
        lb_die("cuda hadamard: axis %d is not rows (0) or cols (1)", axis);
    int len = axis == LB_AXIS_COLS ? cols : rows;
    if (rows < 0 || cols < 0 || len % hn)
        lb_die("cuda hadamard: size %d along %s needs a multiple of %d, not %d", hn,
               axis == LB_AXIS_COLS ? "cols" : "rows", hn, len);
    size_t total = (size_t)(axis == LB_AXIS_COLS ? rows : cols) * (len / hn);
    if (!total) return;
    float c = (float)(1.0 / sqrt((double)hn));   // hadamard.c's norm_const
    if (hn < 32) signs &= (1u << hn) - 1;
    unsigned g = lb_grid(total, 128, cx);
    int ac = axis == LB_AXIS_COLS;
    switch (hn) {
    case 2: hadamard_kernel<2><<<g, 128, 0, cx->stream>>>(y, x, rows, cols, ac, signs, c); break;
    case 4: hadamard_kernel<4><<<g, 128, 0, cx->stream>>>(y, x, rows, cols, ac, signs, c); break;
    case 8: hadamard_kernel<8><<<g, 128, 0, cx->stream>>>(y, x, rows, cols, ac, signs, c); break;
    case 16: hadamard_kernel<16><<<g, 128, 0, cx->stream>>>(y, x, rows, cols, ac, signs, c); break;
    default: hadamard_kernel<32><<<g, 128, 0, cx->stream>>>(y, x, rows, cols, ac, signs, c); break;
    }
    LB_CUDA_LAUNCHED(cx);
}

// --- bf16 rounding (kernels/common.c lb_f32_to_bf16, on the bits) -----------------------------

__global__ void round_bf16_kernel(float *y, const float *x, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        y[i] = __uint_as_float(round_bf16_bits(x[i]) << 16);
}

static void cuda_round_bf16(lb_backend *be, float *y, const float *x, size_t n)
{
    if (!n) return;
    lb_cuda_ctx *cx = lb_cuda(be);
    round_bf16_kernel<<<lb_grid(n, 256, cx), 256, 0, cx->stream>>>(y, x, n);
    LB_CUDA_LAUNCHED(cx);
}

// y (rows, ld) bf16 bits of x (rows, cols), zeros past cols: a pair of columns per thread
// (ld is even).
__global__ void to_bf16_kernel(uint16_t *y, const float *x, size_t rows, int cols, int ld)
{
    const size_t pairs = rows * (size_t)(ld / 2);
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < pairs;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / (ld / 2);
        const int c = (int)(i % (ld / 2)) * 2;
        const float *xr = x + r * cols;
        const uint32_t lo = c < cols ? round_bf16_bits(xr[c]) : 0;
        const uint32_t hi = c + 1 < cols ? round_bf16_bits(xr[c + 1]) : 0;
        reinterpret_cast<uint32_t *>(y + r * ld)[c / 2] = lo | hi << 16;
    }
}

// The same when ld == cols: the matrix is one run of n8 groups of 8 values (two 16-byte
// loads, one 16-byte store a thread), the layout of every weight whose in is a multiple of 8.
__global__ void to_bf16_flat_kernel(uint4 *y, const float4 *x, size_t n8)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n8;
         i += (size_t)gridDim.x * blockDim.x) {
        const float4 a = x[2 * i], b = x[2 * i + 1];
        y[i] = make_uint4(round_bf16_bits(a.x) | round_bf16_bits(a.y) << 16,
                          round_bf16_bits(a.z) | round_bf16_bits(a.w) << 16,
                          round_bf16_bits(b.x) | round_bf16_bits(b.y) << 16,
                          round_bf16_bits(b.z) | round_bf16_bits(b.w) << 16);
    }
}

static void cuda_to_bf16(lb_backend *be, uint16_t *y, const float *x, size_t rows, int cols,
                         int ld)
{
    if (cols < 0 || ld < cols || ld % 8)
        lb_die("to_bf16: row pitch %d for %d columns (a multiple of 8, at least the columns)", ld,
               cols);
    if (!rows || !ld) return;
    lb_cuda_ctx *cx = lb_cuda(be);
    if (ld == cols && !((uintptr_t)x % 16) && !((uintptr_t)y % 16)) {
        const size_t n8 = rows * (size_t)cols / 8;
        to_bf16_flat_kernel<<<lb_grid(n8, 256, cx), 256, 0, cx->stream>>>(
            reinterpret_cast<uint4 *>(y), reinterpret_cast<const float4 *>(x), n8);
        LB_CUDA_LAUNCHED(cx);
        return;
    }
    const size_t pairs = rows * (size_t)(ld / 2);
    to_bf16_kernel<<<lb_grid(pairs, 256, cx), 256, 0, cx->stream>>>(y, x, rows, cols, ld);
    LB_CUDA_LAUNCHED(cx);
}

extern "C" void lb_cuda_init_quant(lb_backend *be)
{
    be->qmat_alloc = cuda_qmat_alloc;
    be->qmat_free = cuda_qmat_free;
    be->quantize = cuda_quantize;
    be->quantize_grouped = cuda_quantize_grouped;
    be->quantize_amax = cuda_quantize_amax;
    be->quantize_rc = cuda_quantize_rc;
    be->qmat_transpose = cuda_qmat_transpose;
    be->quantize_rt = cuda_quantize_rt;
    be->dequantize = cuda_dequantize;
    be->hadamard = cuda_hadamard;
    be->round_bf16 = cuda_round_bf16;
    be->to_bf16 = cuda_to_bf16;
}
