#include "kernels/common.h"
#include "kernels/sample.h"   // the generator, one source for host and device

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void (*abort_hook)(int);
static char alloc_for[256];

void lb_alloc_what(const char *what)
{
    if (what) snprintf(alloc_for, sizeof alloc_for, " for %s", what);
    else alloc_for[0] = 0;
}

const char *lb_alloc_for(void) { return alloc_for; }

void lb_set_abort_hook(void (*hook)(int code)) { abort_hook = hook; }

void lb_abort(int code)
{
    fflush(stdout);
    fflush(stderr);
    if (abort_hook) abort_hook(code);
    exit(code);
}

const char *lb_source_path(const char *file)
{
    static const char *const top[] = {"/src/", "/models/", "/parallel/", "/kernels/", "/tests/"};
    const char *best = NULL;   // the last top directory in the name: the tree's own
    for (size_t i = 0; i < sizeof top / sizeof top[0]; i++)
        for (const char *p = strstr(file, top[i]); p; p = strstr(p + 1, top[i]))
            if (!best || p > best) best = p;
    return best ? best + 1 : file;
}

void lb_die_at(const char *file, int line, const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "%s:%d: ", lb_source_path(file), line);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    lb_abort(1);
}

void *lb_malloc(size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    if (!p) lb_die("out of host memory (%zu bytes)", bytes);
    return p;
}

void *lb_calloc(size_t n, size_t size)
{
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) lb_die("out of host memory (%zu x %zu bytes)", n, size);
    return p;
}

uint64_t lb_hash64(uint64_t x) { return lb_sample_hash(x); }

uint64_t lb_rand_u64(uint64_t seed, uint64_t stream, uint64_t counter)
{
    return lb_hash64(lb_hash64(lb_hash64(seed) ^ stream) ^ counter);
}

float lb_rand_uniform(uint64_t seed, uint64_t stream, uint64_t counter)
{
    return lb_sample_uniform(seed, stream, counter);
}

float lb_rand_normal(uint64_t seed, uint64_t stream, uint64_t counter)
{
    // Box-Muller on two independent draws; computed in double so it is the same everywhere.
    uint64_t a = lb_rand_u64(seed, stream, 2 * counter);
    uint64_t b = lb_rand_u64(seed, stream, 2 * counter + 1);
    double u1 = ((double)(a >> 11) + 1.0) * (1.0 / 9007199254740993.0);   // (0, 1]
    double u2 = (double)(b >> 11) * (1.0 / 9007199254740992.0);
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

float lb_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else {                                   // subnormal: renormalise
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 0x400));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float x;
    memcpy(&x, &u, 4);
    return x;
}

void lb_rope_inv_freq_llama3(double *inv_freq, int rot, double theta, double factor,
                             double low_freq_factor, double high_freq_factor,
                             double original_max)
{
    const double pi = 3.14159265358979323846;
    const double low_wavelen = original_max / low_freq_factor;
    const double high_wavelen = original_max / high_freq_factor;
    for (int i = 0; i < rot / 2; i++) {
        double f = pow(theta, -2.0 * i / rot), wavelen = 2 * pi / f;
        if (wavelen > low_wavelen) {
            f /= factor;
        } else if (!(wavelen < high_wavelen)) {   // the middle band, as transformers writes it
            double s = (original_max / wavelen - low_freq_factor) /
                       (high_freq_factor - low_freq_factor);
            f = (1 - s) * f / factor + s * f;
        }
        inv_freq[i] = f;
    }
}
