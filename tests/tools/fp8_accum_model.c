// fp8_accum_model.c: Monte Carlo model of the error of Hopper's FP8 tensor-core GEMM with
// 128-wide block scaling, on the operands test_gemm_q (tests/test_backend_ops.c) draws; the
// basis of its bound B_FP8TC (doc/backends.md, "Tests and measured agreement").
//
// Model: within each 128-term block of K, every k32 tensor-core instruction aligns the
// accumulator and its 32 products (exact products of E4M3 codes) to the largest of them and
// truncates each to F fraction bits below it, then sums; the block partial is promoted to fp32
// and multiplied by sa * sb (fp32), as cuBLASLt's VEC128 / BLK128 scaling does. The reference
// is exact. Operands as scaled_randn: rows of magnitude exp(N(0,1)) times K groups of 32 of
// magnitude exp(N(0,1)) (or, for column-wise operands, the transpose of that pattern), block
// scale amax / 448, E4M3 round to nearest even. Prints each case's median and largest NMSE.
//   cc -O2 -o fp8_accum_model tests/tools/fp8_accum_model.c -lm && ./fp8_accum_model [F [DRAWS]]
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static uint64_t rs = 88172645463325252ull;   // xorshift64: the model needs no particular RNG
static double urand(void)
{
    rs ^= rs << 13, rs ^= rs >> 7, rs ^= rs << 17;
    return ((rs >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}
static double nrand(void) { return sqrt(-2 * log(urand())) * cos(6.283185307179586 * urand()); }

// Nearest-even E4M3 value of v, |v| <= 448 (subnormal step 2^-9).
static double e4m3(double v)
{
    double a = fabs(v);
    if (a == 0) return 0;
    int e;
    frexp(a, &e);
    e = e - 1 < -6 ? -6 : e - 1;
    double step = ldexp(1.0, e - 3), out = nearbyint(a / step) * step;
    if (out > 448) out = 448;
    return v < 0 ? -out : out;
}

// Operand (R, K): codes c and scales s (R, nb). colK 0: magnitude exp(N_r) exp(N_{k/32});
// colK 1: exp(N_k) exp(N_{r/32}). blk: rows per scale block (1 or 128), 128 along K.
static void make(int R, int K, int colK, int blk, double *c, double *s)
{
    int nb = (K + 127) / 128, big = R > K ? R : K;
    double *x = malloc(sizeof *x * R * K), *rm = malloc(sizeof *rm * big);
    double *cm = malloc(sizeof *cm * (big / 32 + 1));
    for (int i = 0; i < (colK ? K : R); i++) rm[i] = exp(nrand());
    for (int i = 0; i <= (colK ? R : K) / 32; i++) cm[i] = exp(nrand());
    for (int r = 0; r < R; r++)
        for (int k = 0; k < K; k++)
            x[r * K + k] = (colK ? rm[k] * cm[r / 32] : rm[r] * cm[k / 32]) * nrand();
    for (int rb = 0; rb < R; rb += blk)
        for (int b = 0; b < nb; b++) {
            int re = rb + blk < R ? rb + blk : R, ke = b * 128 + 128 < K ? b * 128 + 128 : K;
            double amax = 0;
            for (int r = rb; r < re; r++)
                for (int k = b * 128; k < ke; k++) amax = fmax(amax, fabs(x[r * K + k]));
            float sc = (float)(amax / 448.0);
            if (sc == 0) sc = 1;
            for (int r = rb; r < re; r++) {
                s[r * nb + b] = sc;
                for (int k = b * 128; k < ke; k++) c[r * K + k] = e4m3(x[r * K + k] / sc);
            }
        }
    free(x), free(rm), free(cm);
}

// NMSE of the modelled GEMM against the exact one for one draw of C = al A B^T + be C0.
static double draw(int m, int n, int k, const int *cs, float al, float be, int F)
{
    int nb = (k + 127) / 128;
    double *A = malloc(sizeof *A * m * k), *B = malloc(sizeof *B * n * k);
    double *sa = malloc(sizeof *sa * m * nb), *sb = malloc(sizeof *sb * n * nb);
    make(m, k, cs[0], cs[1], A, sa);
    make(n, k, cs[2], cs[3], B, sb);
    double num = 0, den = 0;
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            double c0 = be != 0 ? nrand() : 0, ref = 0;
            float tot = 0;
            for (int b = 0; b < nb; b++) {
                double acc = 0, exact = 0;
                for (int g = b * 128; g < k && g < b * 128 + 128; g += 32) {
                    double add[33], mx = fabs(acc);
                    int na = 0;
                    add[na++] = acc;
                    for (int kk = g; kk < k && kk < g + 32; kk++) {
                        double p = A[i * k + kk] * B[j * k + kk];
                        add[na++] = p, exact += p, mx = fmax(mx, fabs(p));
                    }
                    if (mx == 0) continue;
                    int e;
                    frexp(mx, &e);
                    double ulp = ldexp(1.0, e - 1 - F), sum = 0;
                    for (int t = 0; t < na; t++) sum += trunc(add[t] / ulp) * ulp;
                    acc = (float)sum;
                }
                tot = tot + (float)acc * (float)(sa[i * nb + b] * sb[j * nb + b]);
                ref += exact * sa[i * nb + b] * sb[j * nb + b];
            }
            double out = (double)(al * tot + be * (float)c0), r = al * ref + be * c0;
            num += (out - r) * (out - r), den += r * r;
        }
    free(A), free(B), free(sa), free(sb);
    return num / den;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    int F = argc > 1 ? atoi(argv[1]) : 13, N = argc > 2 ? atoi(argv[2]) : 100;
    if (N < 1) N = 1;
    // test_gemm_q's shapes and its four FP8 tensor-core cases: {A colK, A rows per block,
    // B colK, B rows per block}
    const int sz[][3] = {{37, 29, 53}, {129, 200, 300}, {256, 384, 512}, {1, 64, 128},
                         {300, 100, 1000}};
    const char *name[4] = {"1x128 x 128x128", "1x128 x 128x128 col", "1x128 col x 1x128 col",
                           "128x128 x 1x128"};
    const int cs[4][4] = {{0, 1, 0, 128}, {0, 1, 1, 128}, {1, 1, 1, 1}, {0, 128, 0, 1}};
    double *v = malloc(sizeof *v * N);
    for (int s = 0; s < 5; s++) {
        float al = s % 2 ? 0.75f : 1.0f, be = s % 3 == 1 ? 1.0f : s % 3 == 2 ? -0.5f : 0.0f;
        for (int c = 0; c < 4; c++) {
            for (int t = 0; t < N; t++) v[t] = draw(sz[s][0], sz[s][1], sz[s][2], cs[c], al, be, F);
            qsort(v, N, sizeof *v, cmp);
            printf("F %d  m %4d n %4d k %4d  %-22s median %.2e  max %.2e  (%d draws)\n", F,
                   sz[s][0], sz[s][1], sz[s][2], name[c], v[N / 2], v[N - 1], N);
        }
    }
    free(v);
    return 0;
}
