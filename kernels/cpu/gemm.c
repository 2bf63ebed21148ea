// gemm.c: the CPU backend's deterministic, batch-invariant SGEMM.
//
// C (m, n) = alpha * op(A) (m, k) * op(B) (k, n) + beta * C, every trans combination.
//
// OpenBLAS picks kernels, blockings and thread splits by problem size and CPU, so the bits of
// one output element change with m, with the row's position and (on some kernel sets) with
// the thread count. Here every element is computed by one fixed sequence of fp32 operations
// that depends on k, alpha and beta alone (the "canonical order"):
//
//   a = row i of op(A), b = column j of op(B), both length k, zero-padded to a multiple of 8
//   lane q in 0..7:  s_q = 0;  for t = 0, 1, ...:  s_q = s_q + a[8t + q] * b[8t + q]
//   s = ((s_0 + s_1) + (s_2 + s_3)) + ((s_4 + s_5) + (s_6 + s_7))
//   C[i][j] = alpha * s                      when beta == 0 (C is not read: NaN is overwritten)
//   C[i][j] = alpha * s + beta * C[i][j]     otherwise
//
// Each product and each sum is rounded to fp32 on its own (no FMA contraction, no
// reassociation), so the order is a function of k only: not of m or n, of the element's place
// in a tile or block, of the tile shape, of the thread count or of the instruction set.
// tests/test_kernels.c recomputes the canonical order in scalar C and compares bitwise.
//
// How: every case is reduced to dots of contiguous rows. op(A) row i is a row of A when
// transa == 0 and is packed (transposed) from A's column i when transa == 1; op(B) column j is
// a row of B when transb == 1 and is packed from B's column j when transb == 0. A micro-tile
// of 8 outputs (4x2, 2x4 or 1x8 rows x columns) keeps one 8-lane accumulator per output over
// the whole k; the k tail is one more step on zero-padded copies (0 * 0 = +0 is added to
// every lane of every element alike). Edge tiles re-read the block's last row or column in
// place of the missing ones and store only the valid outputs: a lane's arithmetic never
// depends on the other accumulators, so padding changes no computed element. Blocks of C are
// spread over OpenMP threads; block and tile sizes only decide who computes an element, never
// how.
//
// Builds: GCC vector extensions (8 fp32 lanes; clang compiles it too). On x86 the tile loop and
// the packing are compiled twice, for the baseline ISA (SSE2: each 8-lane op is two 4-lane
// ops) and for AVX2 (one 8-lane op, about 4x faster), chosen at run time. Neither may
// contract a * b + c into an FMA, so both give the same bits (tested): -ffp-contract=off is
// GCC's default for -std=c11 and the pragmas below keep it under -std=gnu11, -march=native
// and clang. The project's -O2 is enough (-O3 gains only on m = 1, about 20%).
#include "kernels/cpu/cpu.h"
#include "kernels/common.h"

#include <float.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#if defined(__FAST_MATH__)
#error "gemm.c must not be built with -ffast-math: the canonical order needs IEEE fp32 arithmetic"
#endif
#if FLT_EVAL_METHOD != 0
#error "gemm.c needs FLT_EVAL_METHOD 0 (fp32 operations rounded to fp32)"
#endif

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));   // unaligned loads
typedef int v8i __attribute__((vector_size(32)));

// SHUF(x, y, i0, ..., i7): lane e of the result is lane i_e of the 16 lanes of x then y.
#if defined(__clang__)
#define SHUF(x, y, ...) __builtin_shufflevector((x), (y), __VA_ARGS__)
#else
#define SHUF(x, y, ...) __builtin_shuffle((x), (y), (v8i){__VA_ARGS__})
#endif

#define AI static inline __attribute__((always_inline))

// PIN(1, v) keeps v in a vector register: GCC would otherwise fold the load of an A row into
// each of its NR multiplies (NR loads of one vector), and the 4x2 loop would run out of load
// ports. An empty asm changes no arithmetic. The constraint only exists with AVX, so only the
// AVX2 build passes 1; without optimisation the constant-false branch would survive to code
// generation and fail to compile in the baseline build, hence no pinning at -O0.
#if defined(__OPTIMIZE__) && (defined(__x86_64__) || defined(__i386__))
#define PIN(regs, v)                                  \
    do {                                              \
        if (regs) __asm__("" : "+x"(v));              \
    } while (0)
#else
#define PIN(regs, v) ((void)(regs))
#endif

// Lanes of the canonical order, and outputs per micro-tile (one reduction group).
#define LANES 8
#define TILE 8

// hadd(x, y) = [x0+x1, x2+x3, y0+y1, y2+y3, x4+x5, x6+x7, y4+y5, y6+y7] (vhaddps's layout).
#define HADD(x, y) \
    (SHUF((x), (y), 0, 2, 8, 10, 4, 6, 12, 14) + SHUF((x), (y), 1, 3, 9, 11, 5, 7, 13, 15))

// Lane e of the result is ((a0+a1)+(a2+a3)) + ((a4+a5)+(a6+a7)) of acc[e]: the canonical tree,
// done for 8 accumulators at once with 6 hadds, 2 cross-half shuffles and 1 add.
#define REDUCE8(acc, out)                                                                    \
    do {                                                                                     \
        v8 h0_ = HADD(acc[0], acc[1]), h1_ = HADD(acc[2], acc[3]);                           \
        v8 h2_ = HADD(acc[4], acc[5]), h3_ = HADD(acc[6], acc[7]);                           \
        v8 g0_ = HADD(h0_, h1_), g1_ = HADD(h2_, h3_);                                       \
        (out) = SHUF(g0_, g1_, 0, 1, 2, 3, 8, 9, 10, 11) +                                  \
                SHUF(g0_, g1_, 4, 5, 6, 7, 12, 13, 14, 15);                                 \
    } while (0)

// A whole tile's outputs, 8 / NR rows of NR floats at c (row stride ldc), to and from the
// lanes of one vector (lane r * NR + q is row r, column q) without a trip through the stack.
// Needs __builtin_shufflevector (clang, GCC 12); otherwise tiles go element by element.
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define HAVE_SHUFFLEVECTOR 1
typedef float v2u __attribute__((vector_size(8), aligned(4)));
typedef float v4u __attribute__((vector_size(16), aligned(4)));
#define SV __builtin_shufflevector

// (Vectors go by pointer: a 32-byte vector argument would change the baseline ABI.)
AI void load_rows(const int NR, v8 *o, const float *c, size_t ldc)
{
    if (NR == 8) {
        *o = *(const v8u *)c;
    } else if (NR == 4) {
        *o = SV(*(const v4u *)c, *(const v4u *)(c + ldc), 0, 1, 2, 3, 4, 5, 6, 7);
    } else {
        v4u lo = SV(*(const v2u *)c, *(const v2u *)(c + ldc), 0, 1, 2, 3);
        v4u hi = SV(*(const v2u *)(c + 2 * ldc), *(const v2u *)(c + 3 * ldc), 0, 1, 2, 3);
        *o = SV(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7);
    }
}

AI void store_rows(const int NR, float *c, size_t ldc, const v8 *o)
{
    if (NR == 8) {
        *(v8u *)c = *o;
    } else if (NR == 4) {
        *(v4u *)c = SV(*o, *o, 0, 1, 2, 3);
        *(v4u *)(c + ldc) = SV(*o, *o, 4, 5, 6, 7);
    } else {
        *(v2u *)c = SV(*o, *o, 0, 1);
        *(v2u *)(c + ldc) = SV(*o, *o, 2, 3);
        *(v2u *)(c + 2 * ldc) = SV(*o, *o, 4, 5);
        *(v2u *)(c + 3 * ldc) = SV(*o, *o, 6, 7);
    }
}
#endif

// One micro-tile: MR x NR outputs (MR * NR == TILE) at C[i][j], over the whole k.
// ar[r] (r < MR) and br[q] (q < NR) are the rows to dot, length k; only outputs r < mv,
// q < nv are stored (c points at the tile's top-left element, row stride ldc).
AI void tile(const int REGS, const int MR, const int NR, const float *const *ar,
             const float *const *br, int k, float alpha, float beta, float *c, size_t ldc, int mv,
             int nv)
{
    v8 acc[TILE];
    #pragma GCC unroll 8
    for (int e = 0; e < TILE; e++) acc[e] = (v8){0};
    int k8 = k & ~(LANES - 1);
    for (int l = 0; l < k8; l += LANES) {
        v8 bv[TILE];
        #pragma GCC unroll 8
        for (int q = 0; q < NR; q++) bv[q] = *(const v8u *)(br[q] + l);
        #pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            v8 av = *(const v8u *)(ar[r] + l);
            PIN(REGS && NR < 4, av);   // 1x8: GCC keeps the one A row in a register anyway
            #pragma GCC unroll 8
            for (int q = 0; q < NR; q++) acc[r * NR + q] += av * bv[q];
        }
    }
    if (k8 < k) {   // the k tail: one more step on zero-padded copies
        size_t tb = (size_t)(k - k8) * sizeof(float);
        v8 bv[TILE];
        #pragma GCC unroll 8
        for (int q = 0; q < NR; q++) {
            float t[LANES] = {0};
            memcpy(t, br[q] + k8, tb);
            memcpy(&bv[q], t, sizeof t);
        }
        #pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            float t[LANES] = {0};
            memcpy(t, ar[r] + k8, tb);
            v8 av;
            memcpy(&av, t, sizeof t);
            #pragma GCC unroll 8
            for (int q = 0; q < NR; q++) acc[r * NR + q] += av * bv[q];
        }
    }
    v8 s;
    REDUCE8(acc, s);
    v8 o = s * alpha;
    // Whole tiles move C a row at a time, edge tiles element by element; either way every
    // stored element gets the same two or three operations.
#ifdef HAVE_SHUFFLEVECTOR
    if (mv == MR && nv == NR) {
        if (beta != 0.0f) {
            v8 ov;
            load_rows(NR, &ov, c, ldc);
            o = o + ov * beta;
        }
        store_rows(NR, c, ldc, &o);
        return;
    }
#endif
    if (beta != 0.0f) {
        v8 ov = {0};
        for (int r = 0; r < mv; r++)
            for (int q = 0; q < nv; q++) ov[r * NR + q] = c[(size_t)r * ldc + q];
        o = o + ov * beta;
    }
    for (int r = 0; r < mv; r++)
        for (int q = 0; q < nv; q++) c[(size_t)r * ldc + q] = o[r * NR + q];
}

// One block of C: rows [0, mb) x columns [0, nb) at c. Row r of op(A) is a + r * sa and
// column q of op(B) is b + q * sb (both contiguous over k). Rows go in 4s (4x2 tiles), a
// remainder of 2 or 3 in a 2x4 tile, a single row in 1x8 tiles (m = 1 decode wastes nothing).
typedef struct {
    const float *a, *b;
    size_t sa, sb;
    int mb, nb, k;
    float alpha, beta;
    float *c;
    size_t ldc;
} gemm_block;

AI void row_group(const int REGS, const int MR, const int NR, const gemm_block *p, int i)
{
    const float *ar[TILE], *br[TILE];
    int mv = p->mb - i < MR ? p->mb - i : MR;
    for (int r = 0; r < MR; r++) ar[r] = p->a + (size_t)(i + (r < mv ? r : mv - 1)) * p->sa;
    for (int j = 0; j < p->nb; j += NR) {
        int nv = p->nb - j < NR ? p->nb - j : NR;
        for (int q = 0; q < NR; q++) br[q] = p->b + (size_t)(j + (q < nv ? q : nv - 1)) * p->sb;
        tile(REGS, MR, NR, ar, br, p->k, p->alpha, p->beta, p->c + (size_t)i * p->ldc + j, p->ldc,
             mv, nv);
    }
}

AI void block_body(const int REGS, const gemm_block *p)
{
    int i = 0;
    for (; i + 4 <= p->mb; i += 4) row_group(REGS, 4, 2, p, i);
    if (p->mb - i >= 2) row_group(REGS, 2, 4, p, i), i += 2;
    if (p->mb - i == 1) row_group(REGS, 1, 8, p, i);
}

// dst (rows, ld_dst) = columns [c0, c0 + rows) of src (k, ld_src), transposed: the rows of
// op(A) for transa == 1 and the columns of op(B) for transb == 0. Whole 8x8 squares go through
// registers (8 loads, 24 shuffles, 8 stores); the ragged edges element by element. Only copies.
AI void pack_body(float *dst, size_t ld_dst, const float *src, size_t ld_src, int c0, int rows,
                  int k)
{
    int r8 = rows & ~7, k8 = k & ~7;
    for (int l = 0; l < k8; l += 8)
        for (int r = 0; r < r8; r += 8) {
            const float *s0 = src + (size_t)l * ld_src + c0 + r;
            v8 x[8], t[8], u[8];
            #pragma GCC unroll 8
            for (int i = 0; i < 8; i++) x[i] = *(const v8u *)(s0 + (size_t)i * ld_src);
            #pragma GCC unroll 4
            for (int i = 0; i < 8; i += 2) {   // interleave row pairs
                t[i] = SHUF(x[i], x[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
                t[i + 1] = SHUF(x[i], x[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
            }
            #pragma GCC unroll 2
            for (int i = 0; i < 8; i += 4) {   // then pairs of pairs
                u[i] = SHUF(t[i], t[i + 2], 0, 1, 8, 9, 4, 5, 12, 13);
                u[i + 1] = SHUF(t[i], t[i + 2], 2, 3, 10, 11, 6, 7, 14, 15);
                u[i + 2] = SHUF(t[i + 1], t[i + 3], 0, 1, 8, 9, 4, 5, 12, 13);
                u[i + 3] = SHUF(t[i + 1], t[i + 3], 2, 3, 10, 11, 6, 7, 14, 15);
            }
            // u[j] (j < 4) holds columns j and j + 4 of rows 0-3 and u[j + 4] those of rows 4-7.
            #pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                *(v8u *)(dst + (size_t)(r + j) * ld_dst + l) =
                    SHUF(u[j], u[j + 4], 0, 1, 2, 3, 8, 9, 10, 11);
                *(v8u *)(dst + (size_t)(r + j + 4) * ld_dst + l) =
                    SHUF(u[j], u[j + 4], 4, 5, 6, 7, 12, 13, 14, 15);
            }
        }
    for (int l = 0; l < k; l++) {   // edges: columns past r8 for every l, rows past k8
        const float *sl = src + (size_t)l * ld_src + c0;
        for (int r = l < k8 ? r8 : 0; r < rows; r++) dst[(size_t)r * ld_dst + l] = sl[r];
    }
}

// Each build (baseline, AVX2) of the tile loop and the packing.
typedef struct {
    void (*block)(const gemm_block *);
    void (*pack)(float *, size_t, const float *, size_t, int, int, int);
} gemm_isa;

static void block_base(const gemm_block *p) { block_body(0, p); }
static void pack_base(float *d, size_t ldd, const float *s, size_t lds, int c0, int rows, int k)
{
    pack_body(d, ldd, s, lds, c0, rows, k);
}

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define HAVE_AVX2_BUILD 1
__attribute__((target("avx2"))) static void block_avx2(const gemm_block *p) { block_body(1, p); }
__attribute__((target("avx2"))) static void pack_avx2(float *d, size_t ldd, const float *s,
                                                      size_t lds, int c0, int rows, int k)
{
    pack_body(d, ldd, s, lds, c0, rows, k);
}
#endif

static void *alloc64(size_t bytes)
{
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0 || !p)
        lb_die("gemm: out of host memory (%zu bytes)", bytes);
    return p;
}

static int round_up(int x, int to) { return (x + to - 1) / to * to; }

int lb_cpu_gemm_trivial(const lb_gemm_args *g)
{
    if (g->m < 0 || g->n < 0 || g->k < 0)
        lb_die("gemm: negative size (m %d, n %d, k %d)", g->m, g->n, g->k);
    if (g->m == 0 || g->n == 0) return 1;
    if (g->k != 0 && g->alpha != 0.0f) return 0;
    // No product: C = beta * C, and beta 0 overwrites (NaN in C must not survive).
    size_t mn = (size_t)g->m * g->n;
    if (g->beta == 0.0f) memset(g->c, 0, mn * sizeof(float));
    else if (g->beta != 1.0f)
        for (size_t i = 0; i < mn; i++) g->c[i] *= g->beta;
    return 1;
}

// Floats of op(B) per block: NB columns x k, sized for L2 while the block's rows stream past.
#define GEMM_BBLOCK_FLOATS 131072

// How one call is cut into tasks (blocks of C) and the packing buffers of one thread.
typedef struct {
    const lb_gemm_args *g;
    gemm_isa run;
    int mb, nb, nib, njb, ib_major;
    int pack_a, pack_b;   // op(A) rows / op(B) columns are strided in memory: transpose them
    size_t ks;   // row stride of packed operands (floats)
} gemm_plan;

typedef struct {
    float *apack, *bpack;
    int packed_ib, packed_jb;
} gemm_scratch;

static void scratch_init(gemm_scratch *sc, const gemm_plan *pl)
{
    sc->apack = pl->pack_a ? alloc64((size_t)pl->mb * pl->ks * sizeof(float)) : NULL;
    sc->bpack = pl->pack_b ? alloc64((size_t)pl->nb * pl->ks * sizeof(float)) : NULL;
    sc->packed_ib = sc->packed_jb = -1;
}

static void scratch_free(gemm_scratch *sc)
{
    free(sc->apack);
    free(sc->bpack);
}

// Task t: block (ib, jb) of C, packing op(A) rows / op(B) columns unless this thread's
// previous task already packed the same ones.
static void run_task(const gemm_plan *pl, gemm_scratch *sc, int t)
{
    const lb_gemm_args *g = pl->g;
    const int m = g->m, n = g->n, k = g->k;
    int ib = pl->ib_major ? t / pl->njb : t % pl->nib;
    int jb = pl->ib_major ? t % pl->njb : t / pl->nib;
    int i0 = ib * pl->mb, j0 = jb * pl->nb;
    gemm_block p;
    p.mb = m - i0 < pl->mb ? m - i0 : pl->mb;
    p.nb = n - j0 < pl->nb ? n - j0 : pl->nb;
    p.k = k, p.alpha = g->alpha, p.beta = g->beta;
    p.c = g->c + (size_t)i0 * n + j0, p.ldc = (size_t)n;
    if (pl->pack_a) {   // A (k, m): op(A) rows are A's columns
        if (sc->packed_ib != ib) pl->run.pack(sc->apack, pl->ks, g->a, (size_t)m, i0, p.mb, k);
        sc->packed_ib = ib;
        p.a = sc->apack, p.sa = pl->ks;
    } else {            // A (m, k), or (k, 1) which is its one row already
        p.a = g->a + (size_t)i0 * k, p.sa = (size_t)k;
    }
    if (pl->pack_b) {   // B (k, n): op(B) columns are B's columns
        if (sc->packed_jb != jb) pl->run.pack(sc->bpack, pl->ks, g->b, (size_t)n, j0, p.nb, k);
        sc->packed_jb = jb;
        p.b = sc->bpack, p.sb = pl->ks;
    } else {            // B (n, k), or (k, 1) which is its one column already
        p.b = g->b + (size_t)j0 * k, p.sb = (size_t)k;
    }
    pl->run.block(&p);
}

void lb_cpu_gemm_det(const lb_gemm_args *g, int threads, int isa)
{
    if (lb_cpu_gemm_trivial(g)) return;
    const int m = g->m, n = g->n, k = g->k;
    gemm_plan pl = {.g = g, .run = {block_base, pack_base}};
#ifdef HAVE_AVX2_BUILD
    if (isa != LB_CPU_GEMM_BASE && __builtin_cpu_supports("avx2"))
        pl.run = (gemm_isa){block_avx2, pack_avx2};
#endif

    // Blocks of MB x NB outputs, halved until there are a few per thread. None of this changes
    // a result: it only decides which thread computes an element.
    int mb = m == 1 ? 1 : 64;
    int nb = GEMM_BBLOCK_FLOATS / k;
    nb = nb < 8 ? 8 : nb / 8 * 8;
    if (nb > round_up(n, 8)) nb = round_up(n, 8);
    if (mb > m) mb = m;
    int nt = threads > 0 ? threads : 1;
    while ((long)((m + mb - 1) / mb) * ((n + nb - 1) / nb) < 4L * nt) {
        if (nb > 8) nb = round_up(nb / 2, 8);
        else if (mb > 4) mb = round_up(mb / 2, 4);
        else break;
    }
    pl.mb = mb, pl.nb = nb;
    pl.nib = (m + mb - 1) / mb, pl.njb = (n + nb - 1) / nb;
    // Packed row stride: k rounded up to 64 bytes, plus 64 when that is a multiple of 1 KiB, so
    // the 8 rows one transposed square writes do not all map to the same L1 sets.
    pl.ks = (size_t)round_up(k, 16) + (round_up(k, 16) % 256 == 0 ? 16 : 0);
    pl.pack_a = g->transa && m > 1;
    pl.pack_b = !g->transb && n > 1;
    // Neighbouring tasks share a block row (ib-major) or column (jb-major), and a thread keeps
    // its last packing, so a packed block is mostly reused. When both operands are packed,
    // take the order that packs fewer elements (ib-major: n k per block row; jb-major: m k per
    // block column).
    pl.ib_major = pl.pack_a && (!pl.pack_b || (long)pl.nib * n < (long)pl.njb * m);
    const int ntask = pl.nib * pl.njb;

    // Below ~1 M multiply-adds the thread start-up costs more than it saves.
    if (nt == 1 || ntask == 1 || (double)m * n * k < 1e6) {
        gemm_scratch sc;
        scratch_init(&sc, &pl);
        for (int t = 0; t < ntask; t++) run_task(&pl, &sc, t);
        scratch_free(&sc);
        return;
    }
    #pragma omp parallel num_threads(nt)
    {
        gemm_scratch sc;
        scratch_init(&sc, &pl);
        // Dynamic: a thread slowed down (a busy machine, a partial last block) holds no one
        // up. Which thread takes a task never changes a result.
        #pragma omp for schedule(dynamic)
        for (int t = 0; t < ntask; t++) run_task(&pl, &sc, t);
        scratch_free(&sc);
    }
}
