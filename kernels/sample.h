// sample.h: the arithmetic of the `sample` operation (kernels.h), one source for both backends.
//
// The CPU (kernels/cpu/ops_sample.c) and CUDA (kernels/cuda/ops_sample.cu) draws must agree bit
// for bit on the same logits, so everything that decides a token is here, written with
// operations whose result IEEE 754 fixes: float multiplies and adds one at a time (LB_FMUL,
// LB_FADD: __fmul_rn/__fadd_rn on the device, which nvcc never fuses; plain C11 on the host,
// where -std=c11 keeps GCC from contracting), conversions, and integer arithmetic. Sums of
// weights are 64-bit integers, so their order (threads, atomics) never changes a bit.
//
// A row's weights: w_j = W(l_j - max) in units of 2^-39, W(0) = 2^39, an approximation of
// 2^39 exp(l_j - max) to about 1e-7 relative, 0 below exp(-27.7) (2^-40) of the maximum.
// v <= LB_SAMPLE_MAX_V keeps every sum of weights below 2^63.
#ifndef LB_SAMPLE_H
#define LB_SAMPLE_H

#include <math.h>
#include <stdint.h>

#ifdef __CUDACC__
#define LB_HD __device__ __forceinline__
#define LB_FMUL(a, b) __fmul_rn((a), (b))
#define LB_FADD(a, b) __fadd_rn((a), (b))
#else
#define LB_HD static inline
#define LB_FMUL(a, b) ((a) * (b))
#define LB_FADD(a, b) ((a) + (b))
#endif

#define LB_SAMPLE_MAX_V (1 << 23)
#define LB_SAMPLE_ONE ((uint64_t)1 << 39)   // the weight of the maximum

// The counter-based generator (kernels/common.c's lb_hash64 and lb_rand_uniform call these),
// for the device too.
LB_HD uint64_t lb_sample_hash(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}
LB_HD float lb_sample_uniform(uint64_t seed, uint64_t stream, uint64_t counter)
{
    uint64_t r = lb_sample_hash(lb_sample_hash(lb_sample_hash(seed) ^ stream) ^ counter);
    return (float)(r >> 40) * (1.0f / 16777216.0f);   // both exact: 24 bits
}

// The order of the sorted vocabulary as an unsigned key: larger logit, larger key; -0 and +0
// one key (equal logits); NaN below everything. Equal keys are ordered by token id (lower
// first) wherever an order is needed.
LB_HD uint32_t lb_sample_key(float x)
{
    if (x != x) return 0;
    if (x == 0.0f) x = 0.0f;
    union { float f; uint32_t u; } b;
    b.f = x;
    return b.u & 0x80000000u ? ~b.u : b.u | 0x80000000u;
}

// The logit of a key (lb_sample_key's inverse; NaN for key 0).
LB_HD float lb_sample_unkey(uint32_t k)
{
    union { float f; uint32_t u; } b;
    b.u = k & 0x80000000u ? k & 0x7fffffffu : ~k;
    return b.f;   // key 0: all ones, a NaN
}

// w(l) for a row whose maximum is mx (see the top): 2^(y) with y = (l - mx) log2(e) split into
// floor(y) and a fraction f in [0, 1), 2^f by its Taylor series in f ln 2 (degree 8, Horner),
// scaled to 2^39 and shifted right by -floor(y).
LB_HD uint64_t lb_sample_weight(float l, float mx)
{
    if (l == mx) return LB_SAMPLE_ONE;
    const float y = LB_FMUL(LB_FADD(l, -mx), 1.44269504f);
    if (!(y > -40.0f)) return 0;   // also NaN
    const float n = floorf(y), f = LB_FADD(y, -n);
    // ln2^i / i!, i = 8 .. 1
    float p = 1.32154868e-06f;
    p = LB_FADD(LB_FMUL(p, f), 1.52527338e-05f);
    p = LB_FADD(LB_FMUL(p, f), 1.54035304e-04f);
    p = LB_FADD(LB_FMUL(p, f), 1.33335581e-03f);
    p = LB_FADD(LB_FMUL(p, f), 9.61812911e-03f);
    p = LB_FADD(LB_FMUL(p, f), 5.55041087e-02f);
    p = LB_FADD(LB_FMUL(p, f), 2.40226507e-01f);
    p = LB_FADD(LB_FMUL(p, f), 6.93147181e-01f);
    p = LB_FADD(LB_FMUL(p, f), 1.0f);
    // p in [1, 2]: p 2^39 is exact and below 2^41; the shift is 0 .. 40
    return (uint64_t)LB_FMUL(p, 549755813888.0f) >> (int)-n;
}

// The smallest prefix of a sorted order holding a measure, found by key digits (radix select,
// 8 bits at a time from the top). For each level the caller fills hist[256] with the measure of
// the elements whose key matches `want` under `mask`, by their digit (key >> shift) & 255;
// lb_sample_cut_level then picks the digit at which the measure of the keys above, plus the
// digit's own, first reaches need, and narrows want and mask. After the four levels (shift
// 24, 16, 8, 0) want is the key of the prefix's last element and *above the measure of the
// larger keys.
LB_HD void lb_sample_cut_level(const uint64_t *hist, int shift, uint64_t need, uint64_t *above,
                               uint32_t *want, uint32_t *mask)
{
    int d = 255;
    for (; d > 0; d--) {
        if (*above + hist[d] >= need) break;
        *above += hist[d];
    }
    *want |= (uint32_t)d << shift;
    *mask |= 255u << shift;
}

// The draw's target in [0, total): u total, rounded down (total > 0).
LB_HD uint64_t lb_sample_target(float u, uint64_t total)
{
    uint64_t t = (uint64_t)((double)u * (double)total);
    return t < total ? t : total - 1;
}

// top-p's measure: the mass a prefix of the top-k set (total) must reach, at least 1.
LB_HD uint64_t lb_sample_top_p_need(float top_p, uint64_t total)
{
    uint64_t t = (uint64_t)((double)top_p * (double)total);
    return t > total ? total : t < 1 ? 1 : t;
}

#endif
