// fp8_quotient_check.c: the check behind fq_kernel's division (kernels/cuda/quant.cu, fq_div):
// x / d computed as r = RN(1/d), q = RN(x r), q' = RN(q + RN(x - d q) r) (FMAs, Markstein's
// correction), with x and d first scaled by 2^64 when d < 2^-90, gives the E4M3 code that
// IEEE division gives. Quotients at or above 2^-12 must match bit for bit; below, both must
// stay under 2^-11 with the same sign (E4M3's smallest step is 2^-9, so both round to a zero
// of that sign). Divisors over every positive float up to 2^120 (the block scales amax / 448);
// x random below 449 d, and around d times every E4M3 value and every midpoint between two
// (where one ulp could change a rounding), and tiny. Exits 1 at the first mismatch it reports.
//   cc -O2 -ffp-contract=off -o fp8_quotient_check tests/tools/fp8_quotient_check.c -lm
//   ./fp8_quotient_check [PAIRS]     (default 1e9; about 15 s)
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t state = 88172645463325252ull;

static uint64_t next(void)
{
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
}

static float from_bits(uint32_t b)
{
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static uint32_t bits(float f)
{
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
}

// The kernel's quotient (fq_div_of and fq_quot), in C with explicit fmaf.
static float quotient(float x, float d)
{
    const float k = d < 0x1p-90f ? 0x1p64f : 1.0f;
    d *= k, x *= k;
    const float r = 1.0f / d, q = x * r;
    return copysignf(fmaf(fmaf(-d, q, x), r, q), x);
}

int main(int argc, char **argv)
{
    long pairs = argc > 1 ? atol(argv[1]) : 1000000000L, checked = 0;
    for (long i = 0; i < pairs; i++) {
        const float d = from_bits((uint32_t)(next() % 0x7bffffffu) + 1u);
        float x;
        if (i % 4 == 0) {   // uniform below 449 d
            x = (float)((double)(next() >> 11) / 9007199254740992.0 * 449.0 * d);
        } else if (i % 4 == 3) {   // any magnitude below 449 d, subnormals included
            x = from_bits((uint32_t)(next() % 0x7f000000u));
            if (!(fabsf(x) <= 449.0f * d)) continue;
        } else {   // within 4 ulps of d times an E4M3 value (i % 4 == 1) or midpoint (2)
            const int e = (int)(next() % 19) - 10, m = (int)(next() % 16);
            const double v = ldexp(1.0 + m / 16.0 + (i % 4 == 2 ? 1.0 / 32.0 : 0.0), e);
            const float base = (float)(v * d);
            if (!isfinite(base) || base == 0.0f) continue;
            x = from_bits(bits(base) + (uint32_t)((int)(next() % 9) - 4));
        }
        if (!isfinite(x)) continue;
        if (next() & 1) x = -x;
        const float want = x / d, got = quotient(x, d);
        checked++;
        if (fabsf(want) < 0x1p-12f && fabsf(got) < 0x1p-11f && signbit(got) == signbit(want))
            continue;
        if (bits(got) != bits(want)) {
            printf("x %a d %a: %a, IEEE division %a\n", x, d, got, want);
            return 1;
        }
    }
    if (bits(quotient(-0.0f, 1.0f)) != bits(-0.0f)) {
        printf("-0 / 1 lost its sign\n");
        return 1;
    }
    printf("%ld pairs, every quotient gives IEEE division's E4M3 code\n", checked);
    return 0;
}
