// common.h: small pieces every layer uses: fatal errors with file:line, the counter-based
// random number generator, and bf16 rounding.
#ifndef LB_COMMON_H
#define LB_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

// What the backend allocations that follow are for, named with the byte count in an
// out-of-memory message: a phrase with the settings that lower it, set by the code that
// allocates a model's parameters, its activations, optimizer state or KV cache, and cleared
// (NULL) after. Allocations happen on the main thread.
void lb_alloc_what(const char *what);
// " for WHAT" while one is set, else "".
const char *lb_alloc_for(void);

// Prints "file:line: message" to stderr and ends the process (the whole MPI job when one is
// running: see lb_set_abort_hook).
void lb_die_at(const char *file, int line, const char *fmt, ...)
    __attribute__((noreturn, format(printf, 3, 4)));
#define lb_die(...) lb_die_at(__FILE__, __LINE__, __VA_ARGS__)
// A source file's name as messages show it: from the tree's top directory on (src/, models/,
// parallel/, kernels/, tests/), whatever directory the build ran in ("../lowbit/src/x.c" ->
// "src/x.c"); other names as they are.
const char *lb_source_path(const char *file);
// parallel/ installs MPI_Abort here so one failing rank takes the whole job down.
void lb_set_abort_hook(void (*hook)(int code));
void lb_abort(int code) __attribute__((noreturn));

void *lb_malloc(size_t bytes);     // dies on failure
void *lb_calloc(size_t n, size_t size);

// Counter-based RNG: the value for (seed, stream, counter) never depends on call order, so
// initialisation and sampling are reproducible on every backend and rank layout.
uint64_t lb_hash64(uint64_t x);                                   // splitmix64 finaliser
uint64_t lb_rand_u64(uint64_t seed, uint64_t stream, uint64_t counter);
float lb_rand_uniform(uint64_t seed, uint64_t stream, uint64_t counter);   // [0, 1)
float lb_rand_normal(uint64_t seed, uint64_t stream, uint64_t counter);    // N(0, 1)

// bf16 round to nearest even (NaN stays NaN). Inline: the CPU's expert ops round every
// activation they write in the bf16 recipe (lb_bf16_row).
static inline uint16_t lb_f32_to_bf16(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);   // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline float lb_bf16_to_f32(uint16_t b)
{
    uint32_t u = (uint32_t)b << 16;
    float x;
    memcpy(&x, &u, 4);
    return x;
}
static inline float lb_round_bf16(float x) { return lb_bf16_to_f32(lb_f32_to_bf16(x)); }
// dst (ld) = src (cols) rounded to bf16, then zeros to ld: a row of to_bf16's layout.
static inline void lb_bf16_row(uint16_t *dst, const float *src, int cols, int ld)
{
    for (int c = 0; c < cols; c++) dst[c] = lb_f32_to_bf16(src[c]);
    for (int c = cols; c < ld; c++) dst[c] = 0;
}
// Element j of row r of an op's input: fp32 rows of cols, or (x16 not NULL) its bf16 copy in
// to_bf16's layout, read instead (kernels.h: the ops' ..16 inputs).
static inline float lb_in_at(const float *x, const uint16_t *x16, size_t r, int cols, int j)
{
    return x16 ? lb_bf16_to_f32(x16[r * (size_t)((cols + 7) / 8 * 8) + j]) : x[r * cols + j];
}
float lb_f16_to_f32(uint16_t h);

// RoPE frequencies with Llama 3.1's scaling (transformers' _compute_llama3_parameters), for the
// rope op's inv_freq: inv_freq (rot/2) from theta^(-2i/rot); wavelengths 2 pi / f longer than
// original_max / low_freq_factor are divided by factor, shorter than original_max /
// high_freq_factor kept, and those between blended linearly in original_max / wavelength. In
// double.
void lb_rope_inv_freq_llama3(double *inv_freq, int rot, double theta, double factor,
                             double low_freq_factor, double high_freq_factor,
                             double original_max);

#endif
