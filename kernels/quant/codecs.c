// codecs.c: element encoders and decoders for E4M3, E5M2, E2M1, E8M0 and UE4M3.
//
// The encoders are elem.h's (shared with the device): one generic rounding routine on the fp32
// bits for every type, which only enters through a small descriptor. doc/formats.md is the
// specification.
#include "kernels/quant/quant.h"
#include "kernels/quant/elem.h"

#include <math.h>

#include "kernels/common.h"

// The descriptor of t, which comes from outside: checked here.
static lb_elem_fmt desc(lb_elem t)
{
    if ((unsigned)t > LB_UE4M3) lb_die("kernels/quant: unknown element type %d", (int)t);
    return lb_elem_fmt_of(t);
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

uint8_t lb_encode(lb_elem t, float x, int sat)
{
    desc(t);
    return (uint8_t)lb_elem_encode(t, x, sat, 0, 0);
}

uint8_t lb_encode_sr(lb_elem t, float x, uint64_t r)
{
    desc(t);
    return (uint8_t)lb_elem_encode(t, x, 1, 1, r);
}

float lb_decode(lb_elem t, uint8_t code)
{
    const lb_elem_fmt f = desc(t);
    if (t == LB_E2M1) code &= 0xf;
    if (t == LB_E8M0) return code == 0xff ? NAN : ldexpf(1.0f, (int)code - 127);
    if (t == LB_UE4M3 && (code & 0x80)) return NAN;          // never produced by the encoder
    unsigned mag = code & (unsigned)~f.sign & 0xffu;
    if (t == LB_E5M2 && mag >= 0x7c) {
        if (mag > 0x7c) return NAN;
        return (code & f.sign) ? -INFINITY : INFINITY;
    }
    if ((t == LB_E4M3 || t == LB_UE4M3) && mag == 0x7f) return NAN;
    unsigned ef = mag >> f.mbits, man = mag & ((1u << f.mbits) - 1);
    float v = ef == 0 ? ldexpf((float)man, f.emin - f.mbits)
                      : ldexpf((float)((1u << f.mbits) | man), (int)ef - f.bias - f.mbits);
    return (code & f.sign) ? -v : v;
}
