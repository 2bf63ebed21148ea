// hadamard.c: the normalised block-diagonal Walsh-Hadamard transform (doc/formats.md).
//
// Forward on a block v (length n): w = c * H_n (s .* v), c = fp32(1/sqrt(n)). H_n is
// orthogonal up to c, so applying the same transform to both GEMM operands along K leaves
// A B^T unchanged up to rounding. The butterflies run in one fixed order (h = 1, 2, 4, ...),
// so the result never depends on threads or on the other rows.
#include "kernels/quant/quant.h"

#include <math.h>

#include "kernels/common.h"

// In-place unnormalised fast Walsh-Hadamard transform of v (n), Sylvester order:
// H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]].
static void fwht(float *v, int n)
{
    for (int h = 1; h < n; h *= 2)
        for (int i = 0; i < n; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                float a = v[j], b = v[j + h];
                v[j] = a + b;
                v[j + h] = a - b;
            }
}

// The normalisation constant: 1/sqrt(n) rounded once to fp32 (0.25 for n = 16).
static float norm_const(int n) { return (float)(1.0 / sqrt((double)n)); }

static void transform(float *y, const float *x, int rows, int cols, lb_axis axis, int n,
                      uint32_t signs, int inverse)
{
    if (n < 2 || n > 32 || (n & (n - 1)))
        lb_die("kernels/quant: Hadamard size %d is not a power of two in [2, 32]", n);
    if (axis != LB_AXIS_ROWS && axis != LB_AXIS_COLS)
        lb_die("kernels/quant: Hadamard axis %d is not rows (0) or cols (1)", (int)axis);
    int len = axis == LB_AXIS_COLS ? cols : rows;
    if (rows < 0 || cols < 0 || len % n)
        lb_die("kernels/quant: Hadamard of size %d along %s needs a multiple of %d, not %d", n,
               axis == LB_AXIS_COLS ? "cols" : "rows", n, len);
    float c = norm_const(n);
    // Block b of line l: element j sits at x[base + j * stride].
    int lines = axis == LB_AXIS_COLS ? rows : cols;
    size_t stride = axis == LB_AXIS_COLS ? 1 : (size_t)cols;
    int nblocks = len / n;
    #pragma omp parallel for schedule(static) if ((size_t)rows * cols >= 65536)
    for (int l = 0; l < lines; l++) {
        float v[32];
        for (int b = 0; b < nblocks; b++) {
            size_t base = axis == LB_AXIS_COLS ? (size_t)l * cols + (size_t)b * n
                                               : (size_t)b * n * cols + l;
            for (int j = 0; j < n; j++) {
                float t = x[base + j * stride];
                // Forward: signs before H; inverse: after (the transpose of H D is D H).
                v[j] = !inverse && (signs >> j & 1) ? -t : t;
            }
            fwht(v, n);
            for (int j = 0; j < n; j++) {
                float t = v[j] * c;
                y[base + j * stride] = inverse && (signs >> j & 1) ? -t : t;
            }
        }
    }
}

void lb_hadamard(float *y, const float *x, int rows, int cols, lb_axis axis, int n,
                 uint32_t signs)
{
    transform(y, x, rows, cols, axis, n, signs, 0);
}

void lb_hadamard_inv(float *y, const float *x, int rows, int cols, lb_axis axis, int n,
                     uint32_t signs)
{
    transform(y, x, rows, cols, axis, n, signs, 1);
}

uint32_t lb_hadamard_signs(int n, uint64_t seed, uint64_t step, uint64_t site)
{
    uint64_t r = lb_rand_u64(seed, lb_quant_stream(step, site), 0);
    return (uint32_t)(n >= 32 ? r & 0xffffffffu : r & ((1ull << n) - 1));
}
