// codecs.c: element encoders and decoders for E4M3, E5M2, E2M1, E8M0 and UE4M3.
//
// One generic rounding routine serves every type: it works on the fp32 bits, so it is exact
// for every input (fp32 subnormals included) and independent of the FPU rounding mode. The
// type only enters through a small descriptor. doc/formats.md is the specification.
#include "kernels/quant/quant.h"

#include <math.h>
#include <string.h>

#include "kernels/common.h"

typedef struct {
    int mbits;          // explicit mantissa bits
    int emin;           // exponent of the lowest binade; below it the spacing stays 2^(emin-mbits)
    int bias;           // exponent field = e + bias (E8M0: code 0 is 2^-127, a normal)
    unsigned maxmag;    // largest finite magnitude code
    uint8_t sign;       // sign bit (0: unsigned type)
    uint8_t nan;        // the NaN code without sign (E2M1: none, 0)
    int ties_away;      // E8M0 rounds ties up (ml_dtypes); every other type ties to even
} fmt_desc;

static const fmt_desc FMT[] = {
    [LB_E4M3]  = {3, -6, 7, 0x7e, 0x80, 0x7f, 0},
    [LB_E5M2]  = {2, -14, 15, 0x7b, 0x80, 0x7e, 0},
    [LB_E2M1]  = {1, 0, 1, 0x7, 0x08, 0, 0},
    [LB_E8M0]  = {0, -127, 127, 0xfe, 0, 0xff, 1},
    [LB_UE4M3] = {3, -6, 7, 0x7e, 0, 0x7f, 0},
};

static const fmt_desc *desc(lb_elem t)
{
    if ((unsigned)t > LB_UE4M3) lb_die("kernels/quant: unknown element type %d", (int)t);
    return &FMT[t];
}

float lb_elem_max(lb_elem t)
{
    static const float mx[] = {448.0f, 57344.0f, 6.0f, 0x1p127f, 448.0f};
    desc(t);
    return mx[t];
}

const char *lb_elem_name(lb_elem t)
{
    static const char *names[] = {"e4m3", "e5m2", "e2m1", "e8m0", "ue4m3"};
    desc(t);
    return names[t];
}

uint64_t lb_quant_stream(uint64_t step, uint64_t tensor) { return lb_hash64(step) ^ tensor; }

// Rounds the magnitude with fp32 bits abits (finite, > 0) to the type's grid and returns its
// magnitude code, or maxmag + 1 on overflow. sr: round up iff r * 2^-64 < the fraction.
static unsigned round_mag(const fmt_desc *f, uint32_t abits, int sr, uint64_t r)
{
    // a = s * 2^(e - 23) with s in [2^23, 2^24): fp32 subnormals are normalised first so that
    // e = floor(log2 a) holds for every input.
    uint64_t s = abits & 0x7fffffu;
    int e = (int)(abits >> 23) - 127;
    if ((abits >> 23) == 0) {
        e = -126;
        while (!(s & 0x800000u)) { s <<= 1; e--; }
    } else {
        s |= 0x800000u;
    }
    int ee = e < f->emin ? f->emin : e;          // below emin the grid spacing stops shrinking
    int shift = 23 - f->mbits + (ee - e);        // bits of s below the grid's unit: >= 20
    uint64_t n, rem;
    if (shift >= 64) { n = 0; rem = s; }
    else { n = s >> shift; rem = s & ((1ull << shift) - 1); }
    int up;
    if (sr) {
        // p = rem / 2^shift exactly; up iff r < p * 2^64, i.e. r < ceil(p * 2^64).
        if (shift <= 64) {
            up = r < (rem << (64 - shift));
        } else {
            int k = shift - 64;
            uint64_t thr = k >= 25 ? (rem != 0) : (rem + (1ull << k) - 1) >> k;
            up = r < thr;
        }
    } else if (shift >= 64) {
        up = 0;                                  // rem < 2^24 < half
    } else {
        uint64_t half = 1ull << (shift - 1);
        up = rem > half || (rem == half && (f->ties_away || (n & 1)));
    }
    n += (uint64_t)up;
    if (n >> (f->mbits + 1)) { n >>= 1; ee++; }  // rounded up into the next binade
    if (n < (1u << f->mbits)) return (unsigned)n; // subnormal or zero (ee == emin)
    long code = ((long)(ee + f->bias) << f->mbits) | (long)(n - (1u << f->mbits));
    return code > (long)f->maxmag ? f->maxmag + 1 : (unsigned)code;
}

static uint8_t encode(lb_elem t, float x, int sat, int sr, uint64_t r)
{
    const fmt_desc *f = desc(t);
    uint32_t u;
    memcpy(&u, &x, 4);
    uint32_t a = u & 0x7fffffffu;
    uint8_t sign = (u >> 31) ? f->sign : 0;
    if (a > 0x7f800000u)                                     // NaN
        return t == LB_E2M1 ? 0x7 : (uint8_t)(sign | f->nan); // E2M1 has none: +max, as CUDA
    if (!f->sign && (u >> 31) && a) return f->nan;           // unsigned type, negative value
    if (a == 0) return t == LB_E8M0 ? 0xff : sign;           // E8M0 has no zero
    unsigned m = a == 0x7f800000u ? f->maxmag + 1 : round_mag(f, a, sr, r);
    if (m <= f->maxmag) return (uint8_t)(sign | m);
    // Overflow (or Inf).
    if (sat || sr || t == LB_E2M1) return (uint8_t)(sign | f->maxmag);
    if (t == LB_E5M2) return (uint8_t)(sign | 0x7c);
    return (uint8_t)(sign | f->nan);
}

uint8_t lb_encode(lb_elem t, float x, int sat) { return encode(t, x, sat, 0, 0); }

uint8_t lb_encode_sr(lb_elem t, float x, uint64_t r) { return encode(t, x, 1, 1, r); }

float lb_decode(lb_elem t, uint8_t code)
{
    const fmt_desc *f = desc(t);
    if (t == LB_E2M1) code &= 0xf;
    if (t == LB_E8M0) return code == 0xff ? NAN : ldexpf(1.0f, (int)code - 127);
    if (t == LB_UE4M3 && (code & 0x80)) return NAN;          // never produced by the encoder
    unsigned mag = code & (unsigned)~f->sign & 0xffu;
    if (t == LB_E5M2 && mag >= 0x7c) {
        if (mag > 0x7c) return NAN;
        return (code & f->sign) ? -INFINITY : INFINITY;
    }
    if ((t == LB_E4M3 || t == LB_UE4M3) && mag == 0x7f) return NAN;
    unsigned ef = mag >> f->mbits, man = mag & ((1u << f->mbits) - 1);
    float v = ef == 0 ? ldexpf((float)man, f->emin - f->mbits)
                      : ldexpf((float)((1u << f->mbits) | man), (int)ef - f->bias - f->mbits);
    return (code & f->sign) ? -v : v;
}
