// elem.h: the element encoder (lb_encode, lb_encode_sr: round to nearest even or stochastic) and
// the power-of-two fp8-block scale, one source for the CPU (codecs.c, quantize.c) and the device
// (cuda/quant.cu), whose bytes must agree bit for bit (doc/formats.md is the specification).
//
// It works on the fp32 bits with integer arithmetic alone, so it is exact for every input (fp32
// subnormals included) and independent of the FPU rounding mode. The type only enters through
// a small descriptor; the device calls it with a compile-time type, so the descriptor folds
// away.
#ifndef LB_QUANT_ELEM_H
#define LB_QUANT_ELEM_H

#include <stdint.h>

#include "kernels/quant/quant.h"   // lb_elem (quant.cu includes it first, with C linkage)

#ifdef __CUDACC__
#define LB_ELEM_HD __host__ __device__ __forceinline__
#else
#define LB_ELEM_HD static inline
#endif

typedef struct {
    int mbits;          // explicit mantissa bits
    int emin;           // exponent of the lowest binade; below it the spacing stays 2^(emin-mbits)
    int bias;           // exponent field = e + bias (E8M0: code 0 is 2^-127, a normal)
    unsigned maxmag;    // largest finite magnitude code
    unsigned sign;      // sign bit (0: unsigned type)
    unsigned nan;       // the NaN code without sign (E2M1: none, 0)
    int ties_away;      // E8M0 rounds ties up (ml_dtypes); every other type ties to even
} lb_elem_fmt;

// The descriptor of a valid type t (codecs.c checks t where it comes from outside). The device
// calls it with a compile-time t, so its loads fold into constants.
LB_ELEM_HD lb_elem_fmt lb_elem_fmt_of(int t)
{
    static const lb_elem_fmt fmt[] = {   // by lb_elem
        {3, -6, 7, 0x7eu, 0x80u, 0x7fu, 0},       // E4M3
        {2, -14, 15, 0x7bu, 0x80u, 0x7eu, 0},     // E5M2
        {1, 0, 1, 0x7u, 0x08u, 0u, 0},            // E2M1
        {0, -127, 127, 0xfeu, 0u, 0xffu, 1},      // E8M0
        {3, -6, 7, 0x7eu, 0u, 0x7fu, 0},          // UE4M3
    };
    return fmt[t];
}

// Rounds the magnitude with fp32 bits abits (finite, > 0) to the type's grid and returns its
// magnitude code, or maxmag + 1 on overflow. sr: round up iff r * 2^-64 < the fraction.
LB_ELEM_HD unsigned lb_elem_round_mag(lb_elem_fmt f, uint32_t abits, int sr, uint64_t r)
{
    // a = s * 2^(e - 23) with s in [2^23, 2^24): fp32 subnormals are normalised first so that
    // e = floor(log2 a) holds for every input.
    uint64_t s = abits & 0x7fffffu;
    int e = (int)(abits >> 23) - 127;
    if ((abits >> 23) == 0) {
#ifdef __CUDA_ARCH__
        const int sh = __clz((unsigned)s) - 8;            // s != 0: leading 1 moved to bit 23
#else
        const int sh = __builtin_clz((unsigned)s) - 8;
#endif
        s <<= sh;
        e = -126 - sh;
    } else {
        s |= 0x800000u;
    }
    int ee = e < f.emin ? f.emin : e;           // below emin the grid spacing stops shrinking
    int shift = 23 - f.mbits + (ee - e);        // bits of s below the grid's unit: >= 20
    uint64_t n, rem;
    if (shift >= 64) {
        n = 0;
        rem = s;
    } else {
        n = s >> shift;
        rem = s & ((1ull << shift) - 1);
    }
    int up;
    if (sr) {
        // p = rem / 2^shift exactly; up iff r < p * 2^64, i.e. r < ceil(p * 2^64).
        if (shift <= 64) {
            up = r < (rem << (64 - shift));
        } else {
            int k = shift - 64;
            uint64_t thr = k >= 25 ? (uint64_t)(rem != 0) : (rem + (1ull << k) - 1) >> k;
            up = r < thr;
        }
    } else if (shift >= 64) {
        up = 0;                                 // rem < 2^24 < half
    } else {
        uint64_t half = 1ull << (shift - 1);
        up = rem > half || (rem == half && (f.ties_away || (n & 1)));
    }
    n += (uint64_t)up;
    if (n >> (f.mbits + 1)) {                   // rounded up into the next binade
        n >>= 1;
        ee++;
    }
    if (n < (1u << f.mbits)) return (unsigned)n;   // subnormal or zero (ee == emin)
    long long code = ((long long)(ee + f.bias) << f.mbits) | (long long)(n - (1u << f.mbits));
    return code > (long long)f.maxmag ? f.maxmag + 1 : (unsigned)code;
}

// lb_encode(t, x, sat) (sr = 0, r unused) and lb_encode_sr(t, x, r) (sat = 1, sr = 1) of a
// valid type t; the code is below 256.
LB_ELEM_HD unsigned lb_elem_encode(int t, float x, int sat, int sr, uint64_t r)
{
    const lb_elem_fmt f = lb_elem_fmt_of(t);
#ifdef __CUDA_ARCH__
    const uint32_t u = __float_as_uint(x);
#else
    union { float f; uint32_t u; } b;
    b.f = x;
    const uint32_t u = b.u;
#endif
    const uint32_t a = u & 0x7fffffffu;
    const unsigned sign = (u >> 31) ? f.sign : 0u;
    if (a > 0x7f800000u)                                  // NaN
        return t == LB_E2M1 ? 0x7u : sign | f.nan;        // E2M1 has none: +max, as CUDA
    if (!f.sign && (u >> 31) && a) return f.nan;          // unsigned type, negative value
    if (a == 0) return t == LB_E8M0 ? 0xffu : sign;       // E8M0 has no zero
    unsigned m = a == 0x7f800000u ? f.maxmag + 1 : lb_elem_round_mag(f, a, sr, r);
    if (m <= f.maxmag) return sign | m;
    // Overflow (or Inf).
    if (sat || sr || t == LB_E2M1) return sign | f.maxmag;
    if (t == LB_E5M2) return sign | 0x7cu;
    return sign | f.nan;
}

// The power-of-two fp8-block scale (lb_quant_args.pow2) of a block whose |x| maximum has fp32
// bits abits (finite: below 0x7f800000): 2^k for the smallest k with amax <= 448 * 2^k, from the
// bits alone (a floating-point log2 could misround at the binade boundaries), so amax = 448 *
// 2^k gives 2^k itself and the top element never clips. 1 for an all-zero block and where 2^k
// is below the smallest fp32 subnormal (k < -149: amax <= 448 * 2^-150, exactly where the FP32
// rule's amax / 448 rounds to 0 and falls back to 1). Subnormal scales 2^-149 .. 2^-127 are kept.
LB_ELEM_HD float lb_elem_fp8_scale_pow2(uint32_t abits)
{
    if (abits == 0) return 1.0f;
    // amax = s * 2^(e - 23), s in [2^23, 2^24) (subnormals normalised as lb_elem_round_mag)
    uint32_t s = abits & 0x7fffffu;
    int e = (int)(abits >> 23) - 127;
    if ((abits >> 23) == 0) {
#ifdef __CUDA_ARCH__
        const int sh = __clz(s) - 8;
#else
        const int sh = __builtin_clz(s) - 8;
#endif
        s <<= sh;
        e = -126 - sh;
    } else {
        s |= 0x800000u;
    }
    // 448 = 0xe00000 * 2^(8 - 23): amax <= 448 * 2^k iff k >= e - 8, plus one where s > 0xe00000
    const int k = e - 8 + (s > 0xe00000u);
    uint32_t bits;
    if (k < -149) return 1.0f;
    if (k < -126) bits = 1u << (k + 149);                // fp32 subnormal 2^k, exact
    else bits = (uint32_t)(k + 127) << 23;               // k <= 120: amax < 2^128
#ifdef __CUDA_ARCH__
    return __uint_as_float(bits);
#else
    union { uint32_t u; float f; } b;
    b.u = bits;
    return b.f;
#endif
}

#endif
