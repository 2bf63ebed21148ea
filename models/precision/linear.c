// linear.c: linear layers under the precision contract (see linear.h, doc/formats.md).
#include "models/precision/linear.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "kernels/common.h"

static int is_low(lb_format f) { return f != LB_FMT_FP32 && f != LB_FMT_BF16; }

// Grows one buffer of backend memory to at least n bytes (contents not kept).
static void *grow(lb_backend *be, void *p, size_t *cap, size_t n)
{
    if (*cap >= n) return p;
    if (p) be->free(be, p);
    *cap = n;
    return be->alloc(be, n);
}

static size_t align256(size_t x) { return (x + 255) & ~(size_t)255; }

// The wgrad's reduction (token) axis, padded with zero tokens, which add nothing to dy^T x: to
// a multiple of 16, so a quantized operand's rows are 16-byte multiples (what FP8 tensor cores
// load), and of the Hadamard size h when there is one (powers of two: the larger of the two).
static int wgrad_tokens(int n, int h)
{
    int p = h > 16 ? h : 16;
    return (n + p - 1) / p * p;
}

static float *scratch(lb_linear *L, int i, size_t n)
{
    return L->scratch[i] = grow(L->be, L->scratch[i], &L->scratch_n[i], n * sizeof(float));
}

// The bytes of q's transposed scales (lb_qmat.tscale) where its layout has them, else 0: every
// fp8-block 1x128 operand gets them, so the GEMMs that read them need no transpose of their own.
static size_t tscale_bytes(const lb_qmat *q)
{
    return lb_qmat_tscale_fits(q) ? lb_qmat_tscale_bytes(q) : 0;
}

void lb_linear_qscratch(lb_linear *L, int i, lb_qmat *q, int rows, int cols,
                        const lb_quant_args *a)
{
    if (rows < 1) lb_die("lb_linear_qscratch: %d rows", rows);
    lb_linear_qscratch_groups(L, i, q, 1, &rows, cols, a);
}

void lb_linear_qscratch_groups(lb_linear *L, int i, lb_qmat *q, int count, const int *rows,
                               int cols, const lb_quant_args *a)
{
    if (i < 0 || i >= LB_LINEAR_QSCRATCH) lb_die("lb_linear_qscratch_groups: no scratch %d", i);
    lb_qscratch *s = &L->qscratch[i];
    size_t nd = 0, ns = 0, n2 = 0;
    for (int j = 0; j < count; j++) {
        memset(&q[j], 0, sizeof q[j]);
        if (rows[j] == 0) continue;
        lb_qmat_layout(&q[j], rows[j], cols, a);
        nd += align256(lb_qmat_data_bytes(&q[j]));
        ns += align256(lb_qmat_scale_bytes(&q[j])) + align256(tscale_bytes(&q[j]));
        n2 += align256((size_t)q[j].nscale2 * sizeof(float));
    }
    s->data = grow(L->be, s->data, &s->data_n, nd);
    s->scale = grow(L->be, s->scale, &s->scale_n, ns);
    if (n2) s->scale2 = grow(L->be, s->scale2, &s->scale2_n, n2);
    nd = ns = n2 = 0;
    for (int j = 0; j < count; j++) {
        if (rows[j] == 0) continue;
        q[j].data = s->data + nd;
        q[j].scale = (uint8_t *)s->scale + ns;
        nd += align256(lb_qmat_data_bytes(&q[j]));
        ns += align256(lb_qmat_scale_bytes(&q[j]));
        if (tscale_bytes(&q[j])) q[j].tscale = (float *)((uint8_t *)s->scale + ns);
        ns += align256(tscale_bytes(&q[j]));
        if (q[j].nscale2) {
            q[j].scale2 = (float *)((uint8_t *)s->scale2 + n2);
            n2 += align256((size_t)q[j].nscale2 * sizeof(float));
        }
    }
}

void lb_linear_free(lb_linear *L)
{
    for (int i = 0; i < 4; i++)
        if (L->scratch[i]) L->be->free(L->be, L->scratch[i]);
    memset(L->scratch, 0, sizeof L->scratch);
    memset(L->scratch_n, 0, sizeof L->scratch_n);
    for (int i = 0; i < 2; i++)
        if (L->amax[i]) L->be->free(L->be, L->amax[i]);
    memset(L->amax, 0, sizeof L->amax);
    memset(L->amax_n, 0, sizeof L->amax_n);
    for (int i = 0; i < LB_LINEAR_QSCRATCH; i++) {
        lb_qscratch *s = &L->qscratch[i];
        if (s->data) L->be->free(L->be, s->data);
        if (s->scale) L->be->free(L->be, s->scale);
        if (s->scale2) L->be->free(L->be, s->scale2);
    }
    memset(L->qscratch, 0, sizeof L->qscratch);
}

// Stream id of one quantized operand, for stochastic rounding and random Hadamard signs.
// Expert e's id is expert 0's plus e: quantize_grouped gives group j the stream of tensor
// a->tensor + j, so one call quantizes every expert with its own stream. An expert's index is
// the global one (L->expert0 + e), so under expert parallelism it draws what it draws on one
// rank.
static uint64_t operand_id(const lb_linear *L, int layer, lb_role role, lb_pass pass, int e,
                           int which)
{
    const int expert = role == LB_ROLE_MOE_GATE_UP || role == LB_ROLE_MOE_DOWN;
    return lb_hash64((((uint64_t)layer * LB_NROLES + role) * LB_NPASSES + pass) * 4u +
                     (unsigned)which) + (unsigned)(e + (expert ? L->expert0 : 0));
}

// Activations and gradients: 1-D blocks along K. NVFP4's per-token second level applies when the
// quantized rows are tokens (row-wise); column-wise copies have feature rows, so they use one
// scale per tensor.
// What every operand of site s is quantized with: its format, direction and scale rules.
static lb_quant_args site_args(const lb_site *s, int colwise)
{
    lb_quant_args a;
    memset(&a, 0, sizeof a);
    a.fmt = s->fmt;
    a.colwise = colwise;
    a.elem = LB_E4M3;
    a.rule = s->scale_rule;
    a.pow2 = s->scale_pow2;
    return a;
}

static lb_quant_args act_args(const lb_linear *L, const lb_site *s, int colwise, int grad,
                              uint64_t id)
{
    lb_quant_args a = site_args(s, colwise);
    a.s2_mode = s->fmt == LB_FMT_NVFP4 && s->nvfp4_per_token && !colwise ? LB_S2_ROW : LB_S2_TENSOR;
    a.sr = grad && s->stochastic;
    a.seed = L->seed;
    a.step = L->step;
    a.tensor = id;
    return a;
}

// Whether operand x (grad 0) or dy (grad 1) of an expert GEMM at role holds features cut over
// L's etp group: gate/up's outputs and down's inputs are a rank's moe_intermediate_size / etp
// columns of them.
static int etp_cut(const lb_linear *L, lb_role role, int grad)
{
    return L->etp && L->etp->size > 1 &&
           ((role == LB_ROLE_MOE_GATE_UP && grad) || (role == LB_ROLE_MOE_DOWN && !grad));
}

// An NVFP4 operand cut over the etp group whose second levels span the cut features (a
// token's row, row-wise per token, or a whole tensor) would take each rank's from its part. So
// a->amax becomes the group's largest amaxes (L->amax[slot]): quantize_amax, a download, a host
// all-gather, an upload (per such GEMM: one float per token or group, and a wait for the
// backend). A column-wise per-row level covers one feature: not cut. The groups are
// quantize_grouped's (count 1, prows NULL: quantize's one matrix). The ranks of the group hold
// the same tokens, so they all come here with the same shapes (doc/parallel.md).
static void etp_amax(lb_linear *L, int slot, lb_role role, int grad, lb_quant_args *a, int count,
                     lb_act x, const int *rows, const int *prows)
{
    const int cols = x.cols;
    if (!etp_cut(L, role, grad) || a->fmt != LB_FMT_NVFP4 || a->s2_mode == LB_S2_GIVEN ||
        (a->colwise && a->s2_mode == LB_S2_ROW))
        return;
    size_t n = 0;
    for (int j = 0; j < count; j++) {
        const int pr = prows ? prows[j] : rows[j];
        if (pr > 0) n += (size_t)lb_quant_nscale2(pr, cols, a);
    }
    if (n == 0) return;
    lb_backend *be = L->be;
    L->amax[slot] = grow(be, L->amax[slot], &L->amax_n[slot], n * sizeof(float));
    a->amax = NULL;
    be->quantize_amax(be, L->amax[slot], count, x, rows, prows, a);
    const int P = L->etp->size;
    float *mine = lb_malloc(n * (1 + P) * sizeof *mine), *all = mine + n;
    be->download(be, mine, L->amax[slot], n * sizeof(float));
    lb_comm_host_all_gather(L->etp, mine, all, n * sizeof *mine);
    for (size_t i = 0; i < n; i++) {   // the largest, NaN above all (the quantizers' order)
        float m = 0.0f;
        for (int r = 0; r < P; r++) {
            const float v = all[(size_t)r * n + i];
            m = isnan(v) || isnan(m) ? NAN : v > m ? v : m;
        }
        mine[i] = m;
    }
    be->upload(be, L->amax[slot], mine, n * sizeof(float));
    free(mine);
    a->amax = L->amax[slot];
}

// The wgrad's Hadamard transform, fused into the quantization of both operands (dy and x,
// column-wise): the same orthogonal H along the token axis cancels in dy^T x, and it spreads
// outliers before a 4-bit quantization. Its random signs are drawn per expert e.
static void wgrad_hadamard(const lb_linear *L, const lb_site *G, int layer, lb_role role, int e,
                           lb_quant_args *ad, lb_quant_args *ax)
{
    if (!G->hadamard) return;
    const int h = (int)G->hadamard;
    const uint32_t signs =
        G->hadamard_random
            ? lb_hadamard_signs(h, L->seed, L->step, operand_id(L, layer, role, LB_PASS_WGRAD, e, 2))
            : 0;
    ad->hadamard = ax->hadamard = h;
    ad->hsigns = ax->hsigns = signs;
}

// Weights: 128x128 blocks for fp8-block and 16x16 for NVFP4 (when asked), so the row-wise and
// column-wise copies share their scales.
static lb_quant_args weight_args(const lb_site *s, int colwise)
{
    lb_quant_args a = site_args(s, colwise);
    a.weight_blocks = s->fmt == LB_FMT_FP8_BLOCK || (s->fmt == LB_FMT_NVFP4 && s->nvfp4_weight_2d);
    a.s2_mode = LB_S2_TENSOR;
    return a;
}

static void round_into(lb_linear *L, float *dst, const float *src, size_t n)
{
    L->be->round_bf16(L->be, dst, src, n);
}

static int pad8(int x) { return (x + 7) / 8 * 8; }

// Expert e's matrix in the cache's bf16 copy of W, or NULL (none; c may be NULL).
static const uint16_t *cache_b16(const lb_wcache *c, int e)
{
    return c && c->b16 ? c->b16 + (size_t)e * c->out * pad8(c->in) : NULL;
}

// A row-wise copy's data and scale strides in row_alloc's allocations (q laid out).
static size_t row_data_stride(const lb_qmat *q)
{
    return (lb_qmat_data_bytes(q) + 255) / 256 * 256;
}

static size_t row_scale_stride(const lb_qmat *q)
{
    return (lb_qmat_scale_bytes(q) + 15) / 16 * 16;
}

// The row-wise copies of count (out, in) matrices in one allocation of data and one of scales,
// expert after expert (one map over all of them for gemm_experts' quantized form; data and
// scale strides of the matrix's own bytes, rounded to 256 and 16); second levels each alone.
// MX and NVFP4 copies also get their bf16 values (lb_qmat.d16) in one allocation, matrix after
// matrix: no tensor cores take those formats on Hopper, and its GEMMs then multiply these
// instead of dequantizing the weights on every call.
static void row_alloc(lb_backend *be, lb_qmat *q, int count, int out, int in,
                      const lb_quant_args *a)
{
    lb_qmat_layout(&q[0], out, in, a);
    const size_t db = row_data_stride(&q[0]), sb = row_scale_stride(&q[0]);
    const size_t d16 = lb_qmat_d16_fits(&q[0]) ? lb_qmat_d16_bytes(&q[0]) : 0;
    uint8_t *data = be->alloc(be, db * count);
    char *scale = be->alloc(be, sb * count);
    char *b16 = d16 ? be->alloc(be, d16 * count) : NULL;
    for (int e = 0; e < count; e++) {
        lb_qmat_layout(&q[e], out, in, a);
        q[e].data = data + e * db;
        q[e].scale = scale + e * sb;
        q[e].scale2 = q[e].nscale2 ? be->alloc(be, (size_t)q[e].nscale2 * sizeof(float)) : NULL;
        q[e].d16 = d16 ? (uint16_t *)(b16 + e * d16) : NULL;
    }
}

void lb_wcache_free(lb_linear *L, lb_wcache *c)
{
    lb_backend *be = L->be;
    if (c->row && c->count) {   // row_alloc's
        be->free(be, c->row[0].data);
        be->free(be, c->row[0].scale);
        if (c->row[0].d16) be->free(be, c->row[0].d16);
        for (int e = 0; e < c->count; e++) be->free(be, c->row[e].scale2);
    }
    for (int e = 0; c->col && e < c->count; e++) be->qmat_free(be, &c->col[e]);
    if (c->b16) be->free(be, c->b16);
    free(c->row);
    free(c->col);
    memset(c, 0, sizeof *c);
}

static int plain_bf16(const lb_site *S, const lb_site *F);

// The copies a weight's cache holds under the contract: a row-wise quantized one (the fprop's),
// a column-wise one (a quantized dgrad's), a bf16 one (bf16 GEMMs read it).
static void wcache_needs(const lb_linear *L, int layer, lb_role role, const lb_site **F,
                         const lb_site **D, int *need_row, int *need_col, int *need_b16)
{
    *F = lb_contract_site(L->contract, layer, role, LB_PASS_FPROP);
    *D = lb_contract_site(L->contract, layer, role, LB_PASS_DGRAD);
    *need_row = is_low((*F)->fmt);
    *need_col = is_low((*D)->fmt) && (*D)->mode == LB_BWD_QUANTIZED;
    *need_b16 = (*F)->fmt == LB_FMT_BF16 || plain_bf16(*D, *F);
}

size_t lb_wcache_bytes(const lb_linear *L, int layer, lb_role role, int count, int out, int in)
{
    const lb_site *F, *D;
    int need_row, need_col, need_b16;
    wcache_needs(L, layer, role, &F, &D, &need_row, &need_col, &need_b16);
    size_t n = need_b16 ? (size_t)count * out * pad8(in) * sizeof(uint16_t) : 0;
    lb_qmat q;
    memset(&q, 0, sizeof q);
    if (need_row) {   // row_alloc's
        const lb_quant_args ra = weight_args(F, 0);
        lb_qmat_layout(&q, out, in, &ra);
        n += (size_t)count *
             (row_data_stride(&q) + row_scale_stride(&q) + q.nscale2 * sizeof(float) +
              (lb_qmat_d16_fits(&q) ? lb_qmat_d16_bytes(&q) : 0));
    }
    if (need_col) {   // qmat_alloc's
        const lb_quant_args ca = weight_args(D, 1);
        lb_qmat_layout(&q, out, in, &ca);
        n += (size_t)count * (lb_qmat_data_bytes(&q) + lb_qmat_scale_bytes(&q) +
                              q.nscale2 * sizeof(float));
    }
    return n;
}

static int s2_tensor(const lb_quant_args *a)
{
    return a && a->fmt == LB_FMT_NVFP4 && a->s2_mode == LB_S2_TENSOR;
}

// An expert cut over etp ranks quantized as NVFP4 with one second level per tensor: each rank
// computed s2 = amax / (6 x 448) over its shard, one rank over the whole expert. The group's s2
// is the largest shard's (the division is monotonic), except that an all-zero shard's s2 is 1
// (lb_nvfp4_scale2), so a shard whose s2 is 1 is asked whether it is zero. Experts whose s2
// changes are quantized again with it given: the bytes one rank writes for those rows
// (doc/parallel.md). Per weight and step: a 4-byte download per expert, one host all-gather.
static void wcache_etp_s2(lb_linear *L, lb_wcache *c, const float *w, const lb_quant_args *ra,
                          const lb_quant_args *ca, int rt)
{
    if (!s2_tensor(ra)) ra = NULL;
    if (!s2_tensor(ca)) ca = NULL;
    if (!ra && !ca) return;
    lb_backend *be = L->be;
    const lb_qmat *q0 = ra ? c->row : c->col;   // both copies hold the same s2 (the same tensor)
    const int count = c->count, n = L->etp->size, rows = c->out;
    const size_t mat = (size_t)c->out * c->in;
    float *have = lb_malloc((size_t)count * 2 * sizeof *have), *mine = have + count;
    float *all = lb_malloc((size_t)count * n * sizeof *all);
    for (int e = 0; e < count; e++) {
        be->download(be, &have[e], q0[e].scale2, sizeof(float));
        mine[e] = have[e] == 1.0f && be->sumsq(be, w + e * mat, mat) == 0.0 ? 0.0f : have[e];
    }
    lb_comm_host_all_gather(L->etp, mine, all, (size_t)count * sizeof *mine);
    for (int e = 0; e < count; e++) {
        float g = 0.0f;
        for (int r = 0; r < n; r++) {
            const float v = all[(size_t)r * count + e];
            g = isnan(v) || isnan(g) ? NAN : v > g ? v : g;
        }
        if (g == 0.0f) g = 1.0f;   // every shard zero: one rank's s2 of a zero tensor
        if (memcmp(&have[e], &g, sizeof g) == 0) continue;
        lb_quant_args gr = ra ? *ra : (lb_quant_args){0}, gc = ca ? *ca : (lb_quant_args){0};
        gr.s2_mode = gc.s2_mode = LB_S2_GIVEN;
        gr.s2 = gc.s2 = g;
        if (rt) {
            be->quantize_rt(be, 1, &c->row[e], &c->col[e], w + e * mat, &rows, c->in, &gr);
            continue;
        }
        const lb_act we = lb_act_f32(w + e * mat, rows, c->in);
        if (ra) be->quantize_grouped(be, 1, &c->row[e], we, &rows, NULL, &gr);
        if (ca) be->quantize_grouped(be, 1, &c->col[e], we, &rows, NULL, &gc);
    }
    free(have);
    free(all);
}

void lb_wcache_build(lb_linear *L, lb_wcache *c, int layer, lb_role role, const float *w,
                     int count, int out, int in)
{
    const lb_site *F, *D;
    int need_row, need_col, need_b16;
    wcache_needs(L, layer, role, &F, &D, &need_row, &need_col, &need_b16);
    int same = c->count == count && c->out == out && c->in == in && c->ffmt == F->fmt &&
               c->dfmt == D->fmt && !!c->row == need_row && !!c->col == need_col &&
               !!c->b16 == need_b16;
    if (!same) {
        lb_wcache_free(L, c);
        c->count = count;
        c->out = out;
        c->in = in;
        c->ffmt = F->fmt;
        c->dfmt = D->fmt;
    }
    lb_backend *be = L->be;
    if (need_b16) {   // the count matrices are (count out) rows of in
        if (!c->b16) c->b16 = be->alloc(be, (size_t)count * out * pad8(in) * sizeof(uint16_t));
        if (!c->b16_fresh) be->to_bf16(be, c->b16, w, (size_t)count * out, in, pad8(in));
    }
    c->b16_fresh = 0;
    int rows[count];   // every matrix of w quantized on its own, in one call
    for (int e = 0; e < count; e++) rows[e] = out;
    lb_quant_args ra = need_row ? weight_args(F, 0) : (lb_quant_args){0};
    lb_quant_args ca = need_col ? weight_args(D, 1) : (lb_quant_args){0};
    if (need_row) {
        if (!c->row) {
            c->row = lb_calloc(count, sizeof *c->row);
            row_alloc(be, c->row, count, out, in, &ra);
        }
    }
    if (need_col) {
        if (!c->col) c->col = lb_calloc(count, sizeof *c->col);
        for (int e = 0; e < count; e++)
            if (!c->col[e].data) be->qmat_alloc(be, &c->col[e], out, in, &ca);
    }
    // Square blocks in both copies: a block's scale is the same either way, so the
    // column-wise copy is the row-wise one transposed (the same bytes), written by quantize_rt
    // from the same pass over the fp32 weights.
    const int rt = need_row && need_col && ra.fmt == ca.fmt && ra.weight_blocks && ca.weight_blocks;
    if (rt) {
        be->quantize_rt(be, count, c->row, c->col, w, rows, in, &ra);
    } else {
        const lb_act wa = lb_act_f32(w, count * out, in);
        if (need_row) be->quantize_grouped(be, count, c->row, wa, rows, NULL, &ra);
        if (need_col) be->quantize_grouped(be, count, c->col, wa, rows, NULL, &ca);
    }
    if (L->etp && L->etp->size > 1 && (role == LB_ROLE_MOE_GATE_UP || role == LB_ROLE_MOE_DOWN))
        wcache_etp_s2(L, c, w, need_row ? &ra : NULL, need_col ? &ca : NULL, rt);
}

// C (m, n) = A (m, k) B (n, k)^T + beta C with A quantized here (from fp32 or bf16) and B from
// the cache.
static void gemm_act_q(lb_linear *L, lb_act a, const lb_quant_args *aa, const lb_qmat *b, int n,
                       float beta, float *c)
{
    lb_backend *be = L->be;
    lb_qmat q;
    lb_linear_qscratch(L, 0, &q, a.rows, a.cols, aa);
    be->quantize(be, &q, a, aa);
    be->gemm_q(be, a.rows, n, a.cols, 1.0f, &q, b, beta, c);
}

// An activation's fp32 rows for a GEMM operand (a), or NULL where it is bf16.
static const float *f32_of(lb_act x) { return x.type == LB_ACT_F32 ? x.p : NULL; }
// Its bf16 rows for a GEMM operand (a16), or NULL where it is fp32.
static const uint16_t *b16_of(lb_act x) { return x.type == LB_ACT_BF16 ? x.p : NULL; }

// x's fp32 rows for a pass that reads them alone (an fp32 GEMM, a dequantized or mixed
// backward): a bf16 x there is a plan that does not match the contract.
static const float *need_f32(lb_act x, int layer, lb_role role, const char *what)
{
    if (x.type != LB_ACT_F32 && x.rows > 0)
        lb_die("%s: layer %d %s: a bf16 activation for a pass that reads fp32 (the activation "
               "plan does not match the precision contract)", what, layer, lb_role_name(role));
    return x.p;
}

void lb_linear_fwd(lb_linear *L, int layer, lb_role role, lb_act x, const float *w,
                   const lb_wcache *c, int e, float *y, int out, float beta)
{
    lb_backend *be = L->be;
    const lb_site *F = lb_contract_site(L->contract, layer, role, LB_PASS_FPROP);
    const int n = x.rows, in = x.cols;
    size_t mat = (size_t)out * in;
    if (n == 0) return;
    if (F->fmt == LB_FMT_FP32) {
        lb_gemm(be, 0, 1, n, out, in, 1.0f, need_f32(x, layer, role, "lb_linear_fwd"),
                w + e * mat, beta, y);
    } else if (F->fmt == LB_FMT_BF16) {   // the GEMM rounds x (W: the cache's copy, kernels.h)
        lb_gemm_args g = {0, 1, n, out, in, 1.0f, beta, f32_of(x), w + e * mat, y, 1,
                          cache_b16(c, e), b16_of(x), NULL};
        be->gemm(be, &g);
    } else {
        lb_quant_args a = act_args(L, F, 0, 0, operand_id(L, layer, role, LB_PASS_FPROP, e, 0));
        etp_amax(L, 0, role, 0, &a, 1, x, &n, NULL);
        gemm_act_q(L, x, &a, &c->row[e], out, beta, y);
    }
}

void lb_linear_fwd_shared(lb_linear *L, int layer, lb_role role, lb_act x, int count,
                          const float *const *w, const lb_wcache *const *c, float *const *y,
                          uint16_t *const *y16, const int *out)
{
    const lb_site *F = lb_contract_site(L->contract, layer, role, LB_PASS_FPROP);
    const int n = x.rows, in = x.cols;
    for (int i = 0; y16 && i < count; i++)
        if (y16[i] && !lb_linear_plain16(L, layer, role))
            lb_die("lb_linear_fwd_shared: a bf16 output of layer %d %s, which is not bf16 in "
                   "every pass", layer, lb_role_name(role));
    if (n == 0) return;
    if (F->fmt == LB_FMT_BF16) {   // one grouped call: a backend converts x once for all
        lb_gemm_args g[count];
        for (int i = 0; i < count; i++) {
            uint16_t *c16 = y16 ? y16[i] : NULL;   // the output rounded to bf16 instead
            g[i] = (lb_gemm_args){0, 1, n, out[i], in, 1.0f, 0.0f, f32_of(x), w[i],
                                  c16 ? NULL : y[i], 1, cache_b16(c[i], 0), b16_of(x), c16};
        }
        L->be->gemm_grouped(L->be, count, g);
        return;
    }
    if (!is_low(F->fmt)) {
        for (int i = 0; i < count; i++)
            lb_linear_fwd(L, layer, role, x, w[i], c[i], 0, y[i], out[i], 0.0f);
        return;
    }
    lb_quant_args a = act_args(L, F, 0, 0, operand_id(L, layer, role, LB_PASS_FPROP, 0, 0));
    lb_qmat q;
    lb_linear_qscratch(L, 0, &q, n, in, &a);
    L->be->quantize(L->be, &q, x, &a);
    // one grouped call (gemm_q's bits per group): at decode sizes q, k and v have few tiles
    // each, and run side by side instead of one after another
    lb_gemm_q_args g[count];
    for (int i = 0; i < count; i++)
        g[i] = (lb_gemm_q_args){n, out[i], in, 1.0f, 0.0f, &q, &c[i]->row[0], y[i], NULL};
    L->be->gemm_q_grouped(L->be, count, g);
}

// fp32 copy of the fprop's quantized activation x (n, in): what "dequantized" backward reads.
static float *fprop_dequant(lb_linear *L, int slot, int layer, lb_role role, int e,
                            const float *x, int n, int in)
{
    lb_backend *be = L->be;
    const lb_site *F = lb_contract_site(L->contract, layer, role, LB_PASS_FPROP);
    float *out = scratch(L, slot, (size_t)n * in);
    if (!is_low(F->fmt)) {
        round_into(L, out, x, (size_t)n * in);
        return out;
    }
    lb_quant_args a = act_args(L, F, 0, 0, operand_id(L, layer, role, LB_PASS_FPROP, e, 0));
    const lb_act xa = lb_act_f32(x, n, in);
    etp_amax(L, 0, role, 0, &a, 1, xa, &n, NULL);
    lb_qmat q;
    lb_linear_qscratch(L, 0, &q, n, in, &a);
    be->quantize(be, &q, xa, &a);
    be->dequantize(be, out, &q);
    return out;
}

// Whether a backward pass of site S runs as a bf16 GEMM on its original operands (rounded by
// the GEMM): bf16, and not the dequantized fprop operands of a low-precision forward F.
static int plain_bf16(const lb_site *S, const lb_site *F)
{
    return S->fmt == LB_FMT_BF16 && !(S->mode == LB_BWD_DEQUANTIZED && is_low(F->fmt));
}

// A quantized wgrad's column-wise x, made by the first of the weights that share x
// (lb_linear_bwd_shared) and read by the others.
typedef struct {
    lb_qmat q;
    int ready;
} shared_x;

static void linear_bwd(lb_linear *L, int layer, lb_role role, lb_act x, const float *w,
                       const lb_wcache *c, int e, const float *dy, float *dx, float dx_beta,
                       float *dw, float dw_beta, int out, shared_x *sx);

void lb_linear_bwd(lb_linear *L, int layer, lb_role role, lb_act x, const float *w,
                   const lb_wcache *c, int e, const float *dy, float *dx, float dx_beta,
                   float *dw, float dw_beta, int out)
{
    linear_bwd(L, layer, role, x, w, c, e, dy, dx, dx_beta, dw, dw_beta, out, NULL);
}

void lb_linear_bwd_shared(lb_linear *L, int layer, lb_role role, lb_act x, int count,
                          const float *const *w, const lb_wcache *const *c,
                          const float *const *dy, float *dx, float *const *dw,
                          const float *dw_beta, const int *out)
{
    const int n = x.rows, in = x.cols;
    const lb_site *F = lb_contract_site(L->contract, layer, role, LB_PASS_FPROP);
    const lb_site *D = lb_contract_site(L->contract, layer, role, LB_PASS_DGRAD);
    const lb_site *G = lb_contract_site(L->contract, layer, role, LB_PASS_WGRAD);
    int plain = n > 0 && dx && plain_bf16(D, F) && plain_bf16(G, F);
    for (int i = 0; i < count && plain; i++)
        plain = dw[i] && (dw_beta[i] == 0.0f || dw_beta[i] == 1.0f);
    if (plain) {
        // bf16: the first dgrad and every wgrad in one grouped call (x converted once for the
        // wgrads, each dy once for its dgrad and wgrad), then the other dgrads adding into dx
        // in order (groups of one call must not write the same C): the sums of separate calls
        lb_gemm_args g[count + 1];
        g[0] = (lb_gemm_args){0, 0, n, in, out[0], 1.0f, 0.0f, dy[0], w[0], dx, 1,
                              cache_b16(c[0], 0), NULL, NULL};
        for (int i = 0; i < count; i++)
            g[1 + i] = (lb_gemm_args){1, 0, out[i], in, n, 1.0f, dw_beta[i], dy[i], f32_of(x),
                                      dw[i], 1, b16_of(x), NULL, NULL};
        L->be->gemm_grouped(L->be, count + 1, g);
        for (int i = 1; i < count; i++)
            lb_gemm_bf16_b16(L->be, 0, 0, n, in, out[i], 1.0f, dy[i], w[i], cache_b16(c[i], 0),
                             1.0f, dx);
        return;
    }
    shared_x sx = {.ready = 0};
    for (int i = 0; i < count; i++)
        linear_bwd(L, layer, role, x, w[i], c[i], 0, dy[i], dx, i ? 1.0f : 0.0f, dw[i],
                   dw_beta[i], out[i], &sx);
}

static void linear_bwd(lb_linear *L, int layer, lb_role role, lb_act x, const float *w,
                       const lb_wcache *c, int e, const float *dy, float *dx, float dx_beta,
                       float *dw, float dw_beta, int out, shared_x *sx)
{
    const int n = x.rows, in = x.cols;
    lb_backend *be = L->be;
    const lb_site *F = lb_contract_site(L->contract, layer, role, LB_PASS_FPROP);
    const lb_site *D = lb_contract_site(L->contract, layer, role, LB_PASS_DGRAD);
    const lb_site *G = lb_contract_site(L->contract, layer, role, LB_PASS_WGRAD);
    size_t mat = (size_t)out * in;
    const float *we = w + e * mat;
    if (dw_beta != 0.0f && dw_beta != 1.0f) lb_die("lb_linear_bwd: dw_beta %g", dw_beta);
    if (n == 0) {   // no tokens: no product; a first write still owes dw its zeros
        if (dw && dw_beta == 0.0f) be->zero(be, dw, mat * sizeof(float));
        return;
    }

    // Both products plain bf16: one grouped call, in which a backend may convert dy once for
    // both (CUDA packs one bf16 copy of dy that both read); the same sums as two calls.
    if (dx && dw && plain_bf16(D, F) && plain_bf16(G, F)) {
        lb_gemm_args g[2] = {{0, 0, n, in, out, 1.0f, dx_beta, dy, we, dx, 1, cache_b16(c, e),
                              NULL, NULL},
                             {1, 0, out, in, n, 1.0f, dw_beta, dy, f32_of(x), dw, 1,
                              b16_of(x), NULL, NULL}};
        be->gemm_grouped(be, 2, g);
        return;
    }

    // Both products quantized: dy row-wise for the dgrad and column-wise for the wgrad from one
    // quantize_rc (in the wgrad below; the same bytes as two calls).
    const int rc = dx && dw && is_low(D->fmt) && D->mode == LB_BWD_QUANTIZED && is_low(G->fmt) &&
                   G->mode == LB_BWD_QUANTIZED;

    // dgrad: dx (n, in) = dy (n, out) W
    if (dx && !rc) {
        if (D->fmt == LB_FMT_FP32) {
            lb_gemm(be, 0, 0, n, in, out, 1.0f, dy, we, dx_beta, dx);
        } else if (!is_low(D->fmt) || D->mode != LB_BWD_QUANTIZED) {
            // BF16 GEMM: on the original weights (bf16, high) or on the fprop's quantized
            // weights dequantized (dequantized)
            if (D->mode == LB_BWD_DEQUANTIZED && is_low(F->fmt)) {
                float *dyb = scratch(L, 0, (size_t)n * out), *wd = scratch(L, 1, mat);
                round_into(L, dyb, dy, (size_t)n * out);
                be->dequantize(be, wd, &c->row[e]);
                // fp8-block values times fp32 scales: not bf16 values in general
                lb_gemm(be, 0, 0, n, in, out, 1.0f, dyb, wd, dx_beta, dx);
            } else {   // the GEMM rounds dy (W: the cache's copy, kernels.h)
                lb_gemm_bf16_b16(be, 0, 0, n, in, out, 1.0f, dy, we, cache_b16(c, e), dx_beta,
                                 dx);
            }
        } else {
            lb_quant_args a = act_args(L, D, 0, 1, operand_id(L, layer, role, LB_PASS_DGRAD, e, 0));
            const lb_act dya = lb_act_f32(dy, n, out);
            etp_amax(L, 0, role, 1, &a, 1, dya, &n, NULL);
            gemm_act_q(L, dya, &a, &c->col[e], in, dx_beta, dx);
        }
    }

    // wgrad: dw (out, in) = dy^T x + dw_beta dw, reducing over the n tokens
    if (!dw) return;
    if (G->fmt == LB_FMT_FP32) {
        lb_gemm(be, 1, 0, out, in, n, 1.0f, dy, need_f32(x, layer, role, "lb_linear_bwd"),
                dw_beta, dw);
    } else if (!is_low(G->fmt) || G->mode != LB_BWD_QUANTIZED) {
        if (G->mode != LB_BWD_DEQUANTIZED || !is_low(F->fmt)) {
            // dy and x rounded to bf16 (by the GEMM, kernels.h): what a dequantized fprop of
            // bf16 or fp32 activations gives too
            be->gemm(be, &(lb_gemm_args){1, 0, out, in, n, 1.0f, dw_beta, dy, f32_of(x), dw, 1,
                                         b16_of(x), NULL, NULL});
        } else {   // a quantized fprop's dequantized activations need not be bf16 values
            float *dyb = scratch(L, 0, (size_t)n * out);
            round_into(L, dyb, dy, (size_t)n * out);
            const float *xb = fprop_dequant(L, 2, layer, role, e,
                                            need_f32(x, layer, role, "lb_linear_bwd"), n, in);
            lb_gemm(be, 1, 0, out, in, n, 1.0f, dyb, xb, dw_beta, dw);
        }
    } else {
        int nk = wgrad_tokens(n, (int)G->hadamard), have = n;   // tokens in the operands
        lb_quant_args ad = act_args(L, G, 1, 1, operand_id(L, layer, role, LB_PASS_WGRAD, e, 0));
        lb_quant_args ax = act_args(L, G, 1, 0, operand_id(L, layer, role, LB_PASS_WGRAD, e, 1));
        wgrad_hadamard(L, G, layer, role, e, &ad, &ax);
        const lb_act dya = lb_act_f32(dy, n, out), xa = x;
        etp_amax(L, 1, role, 1, &ad, 1, dya, &have, &nk);
        lb_qmat qd, qx;
        lb_linear_qscratch(L, 0, &qd, nk, out, &ad);
        const int have_x = sx && sx->ready;   // x's bytes from an earlier weight sharing it
        if (have_x) qx = sx->q;
        else lb_linear_qscratch(L, 1, &qx, nk, in, &ax);
        // the padding tokens are the quantizer's (zero rows, transformed with the rest), not
        // copies
        if (rc) {   // and the dgrad's dy, then the dgrad
            lb_quant_args a = act_args(L, D, 0, 1, operand_id(L, layer, role, LB_PASS_DGRAD, e, 0));
            etp_amax(L, 0, role, 1, &a, 1, dya, &n, NULL);
            lb_qmat qr;
            lb_linear_qscratch(L, 2, &qr, n, out, &a);
            be->quantize_rc(be, &qr, &a, 1, &qd, dya, &have, &nk, &ad);
            be->gemm_q(be, n, in, out, 1.0f, &qr, &c->col[e], dx_beta, dx);
        } else {
            be->quantize_grouped(be, 1, &qd, dya, &have, &nk, &ad);
        }
        if (!have_x) {
            etp_amax(L, 1, role, 0, &ax, 1, xa, &have, &nk);
            be->quantize_grouped(be, 1, &qx, xa, &have, &nk, &ax);
        }
        if (sx) sx->q = qx, sx->ready = 1;
        be->gemm_q(be, out, in, nk, 1.0f, &qd, &qx, dw_beta, dw);
    }
}

int lb_linear_ce_fusable(const lb_linear *L, int layer, lb_role role)
{
    const lb_site *F = lb_contract_site(L->contract, layer, role, LB_PASS_FPROP);
    const lb_site *D = lb_contract_site(L->contract, layer, role, LB_PASS_DGRAD);
    const lb_site *G = lb_contract_site(L->contract, layer, role, LB_PASS_WGRAD);
    return plain_bf16(D, F) && plain_bf16(G, F);
}

int lb_linear_plain16(const lb_linear *L, int layer, lb_role role)
{
    return lb_contract_site(L->contract, layer, role, LB_PASS_FPROP)->fmt == LB_FMT_BF16 &&
           lb_linear_ce_fusable(L, layer, role);
}

void lb_linear_fwd_c16(lb_linear *L, int layer, lb_role role, lb_act x, const float *w,
                       const lb_wcache *c, uint16_t *y16, int out)
{
    if (!lb_linear_plain16(L, layer, role))
        lb_die("lb_linear_fwd_c16: layer %d %s is not bf16 in every pass", layer,
               lb_role_name(role));
    if (x.rows == 0) return;
    lb_gemm_args g = {0, 1, x.rows, out, x.cols, 1.0f, 0.0f, f32_of(x), w, NULL, 1,
                      cache_b16(c, 0), b16_of(x), y16};
    L->be->gemm(L->be, &g);
}

void lb_linear_ce_bwd(lb_linear *L, int layer, lb_role role, lb_act x, const float *w,
                      const lb_wcache *c, float *logits, uint16_t *logits16, const double *stats,
                      const int32_t *targets, float dloss, float *dx, float *dw, float dw_beta,
                      int out)
{
    const int n = x.rows, in = x.cols;
    if (!lb_linear_ce_fusable(L, layer, role))
        lb_die("lb_linear_ce_bwd: layer %d %s has a backward pass that is not a plain bf16 GEMM",
               layer, lb_role_name(role));
    if (!stats) lb_die("lb_linear_ce_bwd: needs the forward's row statistics");
    if (dw_beta != 0.0f && dw_beta != 1.0f) lb_die("lb_linear_ce_bwd: dw_beta %g", dw_beta);
    if (n == 0) {   // as lb_linear_bwd: a first write still owes dw its zeros
        if (dw_beta == 0.0f) L->be->zero(L->be, dw, (size_t)out * in * sizeof(float));
        return;
    }
    // lb_linear_bwd's grouped call for both products, dy made inside it
    L->be->linear_ce_bwd(L->be, &(lb_linear_ce_args){.dx = dx, .dx_beta = 0.0f, .dw = dw,
            .dw_beta = dw_beta, .logits = logits, .logits16 = logits16, .stats = stats,
            .targets = targets,
            .dloss = dloss, .x = need_f32(x, layer, role, "lb_linear_ce_bwd"), .w = w,
            .w16 = cache_b16(c, 0), .n = n, .v = out, .c = in});
}

// --- experts: one weight matrix per group of consecutive rows ----------------------------------

// Whether every pass of the site has format f (the backward mode does not matter then: fp32
// and bf16 backward GEMMs read the original operands, rounded for bf16).
static int all_fmt(const lb_linear *L, int layer, lb_role role, lb_format f)
{
    for (int p = 0; p < LB_NPASSES; p++)
        if (lb_contract_site(L->contract, layer, role, (lb_pass)p)->fmt != f) return 0;
    return 1;
}

// Row-wise quantization of all the groups' rows in one call gives every group the bytes of its
// own quantization (1-D blocks lie within a row), unless elements round stochastically (the
// random stream is the expert's) or NVFP4 takes one second level for the whole tensor.
static int splits_by_rows(const lb_quant_args *a)
{
    return !a->sr && !(a->fmt == LB_FMT_NVFP4 && a->s2_mode == LB_S2_TENSOR);
}

// C_j (counts[j], n) = Q(A_j) (counts[j], k) B_j^T for all groups in one gemm_q_grouped call,
// B_j = b[j], A_j and C_j rows of a (rows, k) and c (rows, n); aa is expert 0's arguments. The
// quantization is each expert's own, as lb_linear_fwd/_bwd make it: one call of quantize for
// all rows when that gives the same bytes (splits_by_rows), else quantize_grouped. pre, if not
// NULL, is that one call's result, made by the caller. c16, if not NULL, gets C in bf16
// instead of c (lb_gemm_q_args.c16). role, grad: the site's role and whether A is a gradient
// (etp_amax).
static void grouped_act_q(lb_linear *L, lb_role role, int grad, lb_act a,
                          const int *counts, int groups, const lb_quant_args *aa0,
                          const lb_qmat *pre, const lb_qmat *b, int n, float *c, uint16_t *c16)
{
    lb_backend *be = L->be;
    const int k = a.cols;
    int rows = 0;
    for (int j = 0; j < groups; j++) rows += counts[j];
    if (rows == 0) return;
    lb_qmat q, v[groups];
    lb_gemm_q_args g[groups];
    lb_quant_args ab = *aa0, *aa = &ab;
    const int split = pre || splits_by_rows(aa);
    if (pre) {
        q = *pre;
    } else if (split) {
        etp_amax(L, 0, role, grad, aa, 1, a, &rows, NULL);
        lb_linear_qscratch(L, 0, &q, rows, k, aa);
        be->quantize(be, &q, lb_act_rows(a, 0, rows), aa);
    } else {
        etp_amax(L, 0, role, grad, aa, groups, a, counts, NULL);
        lb_linear_qscratch_groups(L, 0, v, groups, counts, k, aa);
        be->quantize_grouped(be, groups, v, a, counts, NULL, aa);
    }
    int off = 0;
    for (int j = 0; j < groups; j++) {
        if (split) {
            if (counts[j]) v[j] = lb_qmat_rows(&q, off, counts[j]);
            else v[j] = q, v[j].rows = v[j].srows = 0;   // skipped: never read
        }
        g[j] = (lb_gemm_q_args){counts[j], n, k, 1.0f, 0.0f, &v[j], &b[j],
                                c16 ? NULL : c + (size_t)off * n,
                                c16 ? c16 + (size_t)off * ((n + 7) / 8 * 8) : NULL};
        off += counts[j];
    }
    be->gemm_q_grouped(be, groups, g);
}

int lb_linear_grouped_bf16(const lb_linear *L, int layer, lb_role role)
{
    return all_fmt(L, layer, role, LB_FMT_BF16);
}

int lb_linear_quantized(const lb_linear *L, int layer, lb_role role)
{
    for (int p = 0; p < LB_NPASSES; p++) {
        const lb_site *s = lb_contract_site(L->contract, layer, role, (lb_pass)p);
        if (!is_low(s->fmt) || (p != LB_PASS_FPROP && s->mode != LB_BWD_QUANTIZED)) return 0;
    }
    return 1;
}

int lb_linear_grouped_c16(const lb_linear *L, int layer, lb_role role, lb_pass pass)
{
    if (all_fmt(L, layer, role, LB_FMT_BF16)) return pass != LB_PASS_WGRAD;
    const lb_site *s = lb_contract_site(L->contract, layer, role, pass);
    if (pass == LB_PASS_FPROP) return is_low(s->fmt);   // grouped_act_q
    if (pass == LB_PASS_DGRAD) return is_low(s->fmt) && s->mode == LB_BWD_QUANTIZED;
    return 0;
}

// Row off of a bf16 copy of (rows, cols) values in to_bf16's layout, or NULL.
static const uint16_t *copy_row(const uint16_t *x16, size_t off, int cols)
{
    return x16 ? x16 + off * (size_t)((cols + 7) / 8 * 8) : NULL;
}

// The rows of the groups: with none, the operands may all be NULL.
static size_t rows_of(const int *counts, int groups)
{
    size_t r = 0;
    for (int j = 0; j < groups; j++) r += (size_t)counts[j];
    return r;
}

// Row off of x (rows, cols), or NULL where x is (its bf16 copy stands in for it).
static const float *row_of(const float *x, size_t off, int cols)
{
    return x ? x + off * (size_t)cols : NULL;
}

// An experts' x: bf16 only where their GEMMs read bf16 values (bf16, or quantized from them).
static void experts_x_check(const lb_linear *L, int layer, lb_role role, lb_act x,
                            const int *counts, int groups, const char *what)
{
    if (x.type == LB_ACT_BF16 && !all_fmt(L, layer, role, LB_FMT_BF16) &&
        !lb_linear_quantized(L, layer, role))
        lb_die("%s: layer %d %s: a bf16 x for GEMMs neither bf16 nor quantized from it", what,
               layer, lb_role_name(role));
    if ((size_t)x.rows < rows_of(counts, groups))
        lb_die("%s: layer %d %s: x has %d rows, the groups %zu", what, layer, lb_role_name(role),
               x.rows, rows_of(counts, groups));
}

void lb_linear_grouped_fwd(lb_linear *L, int layer, lb_role role, lb_act x, const float *w,
                           const lb_wcache *c, const int *counts, int groups, float *y,
                           uint16_t *y16, int out)
{
    const int in = x.cols;
    size_t off = 0, mat = (size_t)out * in;
    int bf16 = all_fmt(L, layer, role, LB_FMT_BF16);
    experts_x_check(L, layer, role, x, counts, groups, "lb_linear_grouped_fwd");
    if (y16 && !lb_linear_grouped_c16(L, layer, role, LB_PASS_FPROP))
        lb_die("lb_linear_grouped_fwd: a bf16 y where the GEMMs store fp32");
    if (bf16 || all_fmt(L, layer, role, LB_FMT_FP32)) {   // one grouped call for all experts
        if (!bf16) need_f32(x, layer, role, "lb_linear_grouped_fwd");
        lb_gemm_args g[groups];
        for (int j = 0; j < groups; j++) {
            const lb_act xj = lb_act_rows(x, off, counts[j]);
            g[j] = (lb_gemm_args){0, 1, counts[j], out, in, 1.0f, 0.0f, f32_of(xj),
                                  w + j * mat, y16 ? NULL : y + off * out, bf16,
                                  bf16 ? cache_b16(c, j) : NULL, b16_of(xj),
                                  (uint16_t *)copy_row(y16, off, out)};
            off += (size_t)counts[j];
        }
        L->be->gemm_grouped(L->be, groups, g);
        return;
    }
    const lb_site *F = lb_contract_site(L->contract, layer, role, LB_PASS_FPROP);
    if (is_low(F->fmt)) {   // the bytes and products of lb_linear_fwd per expert
        lb_quant_args a = act_args(L, F, 0, 0, operand_id(L, layer, role, LB_PASS_FPROP, 0, 0));
        grouped_act_q(L, role, 0, lb_act_rows(x, 0, (int)rows_of(counts, groups)), counts,
                      groups, &a, NULL, c->row, out, y, y16);
        return;
    }
    for (int j = 0; j < groups; j++) {   // mixed fp32 and bf16 passes
        lb_linear_fwd(L, layer, role, lb_act_rows(x, off, counts[j]), w, c, j, y + off * out,
                      out, 0.0f);
        off += (size_t)counts[j];
    }
}

int lb_linear_experts_ok(const lb_linear *L, int layer, lb_role role, const lb_wcache *c)
{
    if (!c || !lb_backend_supports(L->be, LB_OP_gemm_experts)) return 0;
    if (all_fmt(L, layer, role, LB_FMT_BF16)) return c->b16 != NULL;
    const lb_site *F = lb_contract_site(L->contract, layer, role, LB_PASS_FPROP);
    if (!is_low(F->fmt) || !c->row) return 0;
    // one quantization of all rows must be every expert's own (grouped_act_q's split)
    lb_quant_args a = act_args(L, F, 0, 0, operand_id(L, layer, role, LB_PASS_FPROP, 0, 0));
    return splits_by_rows(&a);
}

void lb_linear_experts_fwd(lb_linear *L, int layer, lb_role role, lb_act x, const lb_wcache *c,
                           const int *counts, int groups, float *y, uint16_t *y16, int out)
{
    const int rows = x.rows, in = x.cols;
    if (!lb_linear_experts_ok(L, layer, role, c))
        lb_die("lb_linear_experts_fwd: neither bf16 GEMMs on a bf16 weight cache nor quantized "
               "ones on a row-wise cache");
    lb_gemm_experts_args g = {.c = y16 ? NULL : y, .c16 = y16, .counts = counts, .e = groups,
                              .rows = rows, .n = out, .k = in};
    if (all_fmt(L, layer, role, LB_FMT_BF16)) {
        if (x.type != LB_ACT_BF16) lb_die("lb_linear_experts_fwd: bf16 GEMMs on an fp32 x");
        g.a16 = x.p, g.b16 = cache_b16(c, 0);
        L->be->gemm_experts(L->be, &g);
        return;
    }
    if (x.type == LB_ACT_BF16 && !lb_linear_quantized(L, layer, role))
        lb_die("lb_linear_experts_fwd: a bf16 x where not every pass is quantized from it");
    if (y16 && !lb_linear_grouped_c16(L, layer, role, LB_PASS_FPROP))
        lb_die("lb_linear_experts_fwd: a bf16 y where the GEMMs store fp32");
    // grouped_act_q's quantization: all rows in one call, each expert's bytes
    const lb_site *F = lb_contract_site(L->contract, layer, role, LB_PASS_FPROP);
    lb_quant_args a = act_args(L, F, 0, 0, operand_id(L, layer, role, LB_PASS_FPROP, 0, 0));
    if (rows == 0) return;
    etp_amax(L, 0, role, 0, &a, 1, x, &rows, NULL);
    lb_qmat q;
    lb_linear_qscratch(L, 0, &q, rows, in, &a);
    L->be->quantize(L->be, &q, x, &a);
    g.qa = &q, g.qb = c->row;
    L->be->gemm_experts(L->be, &g);
}

void lb_linear_grouped_bwd(lb_linear *L, int layer, lb_role role, lb_act x, const float *w,
                           const lb_wcache *c, const int *counts, int groups, const int *segs,
                           int nsrc, const float *dy, const uint16_t *dy16, float *dx,
                           uint16_t *dx16, float *dw, float dw_beta, int out)
{
    const int in = x.cols;
    size_t off = 0, mat = (size_t)out * in;
    if (dw_beta != 0.0f && dw_beta != 1.0f) lb_die("lb_linear_grouped_bwd: dw_beta %g", dw_beta);
    int bf16 = all_fmt(L, layer, role, LB_FMT_BF16);
    if (dy16 && !bf16) lb_die("lb_linear_grouped_bwd: a bf16 dy for GEMMs not in bf16");
    experts_x_check(L, layer, role, x, counts, groups, "lb_linear_grouped_bwd");
    if (dx16 && !lb_linear_grouped_c16(L, layer, role, LB_PASS_DGRAD))
        lb_die("lb_linear_grouped_bwd: a bf16 dx where the dgrad stores fp32");
    if (!dy && !dy16 && rows_of(counts, groups))
        lb_die("lb_linear_grouped_bwd: neither dy nor its bf16 copy");
    if (bf16 || all_fmt(L, layer, role, LB_FMT_FP32)) {
        if (!bf16) need_f32(x, layer, role, "lb_linear_grouped_bwd");
        // Each expert's dgrad and wgrad side by side in one call: a backend may convert its dy
        // once for both (see lb_linear_bwd).
        lb_gemm_args g[2 * groups];
        for (int j = 0; j < groups; j++) {
            int mj = counts[j];
            const lb_act xj = lb_act_rows(x, off, mj);
            g[2 * j] = (lb_gemm_args){0, 0, mj, in, out, 1.0f, 0.0f, row_of(dy, off, out),
                                      w + j * mat, dx16 ? NULL : dx + off * in, bf16,
                                      bf16 ? cache_b16(c, j) : NULL, copy_row(dy16, off, out),
                                      (uint16_t *)copy_row(dx16, off, in)};
            // mj 0: no product, and beta 0 zeroes the matrix (kernels.h)
            g[2 * j + 1] = (lb_gemm_args){1, 0, out, in, mj, 1.0f, dw_beta, row_of(dy, off, out),
                                          f32_of(xj), dw + j * mat, bf16, b16_of(xj),
                                          copy_row(dy16, off, out), NULL};
            off += (size_t)mj;
        }
        L->be->gemm_grouped(L->be, 2 * groups, g);
        return;
    }
    // A quantized dgrad of all experts in one call, as in lb_linear_bwd: dx = Q(dy) Q(W^T)^T.
    // With a quantized wgrad too and dy quantized row-wise in one call (splits_by_rows), that
    // call and the wgrad's are one quantize_rc (below).
    const lb_site *D = lb_contract_site(L->contract, layer, role, LB_PASS_DGRAD);
    const lb_site *G = lb_contract_site(L->contract, layer, role, LB_PASS_WGRAD);
    const int dq = is_low(D->fmt) && D->mode == LB_BWD_QUANTIZED;
    const int wq = is_low(G->fmt) && G->mode == LB_BWD_QUANTIZED;
    lb_quant_args a = dq ? act_args(L, D, 0, 1, operand_id(L, layer, role, LB_PASS_DGRAD, 0, 0))
                         : (lb_quant_args){0};
    const int rc = dq && wq && splits_by_rows(&a);
    const int nrows = (int)rows_of(counts, groups);
    const lb_act dya = lb_act_f32(dy, nrows, out), xa = lb_act_rows(x, 0, nrows);
    int dgrad_done = 0;
    if (dq && !rc) {
        grouped_act_q(L, role, 1, dya, counts, groups, &a, NULL, c->col, in, dx, dx16);
        dgrad_done = 1;
    }
    // A quantized wgrad of all experts in one call: each expert's dy_j and x_j quantized
    // column-wise on its own (its own random stream: expert 0's id + j; its own random
    // Hadamard signs), its tokens padded as lb_linear_bwd pads them (wgrad_tokens), so the
    // result is lb_linear_bwd's; a Hadamard transform is fused into those quantizations.
    // With segments (an expert's rows from several ep source ranks) each segment is such a
    // group, so an expert's wgrad is the sum of its segments' products, each quantized as one
    // rank quantizes that source's micro-batch (random Hadamard signs too: each segment gets
    // its expert's). Not with stochastic rounding: quantize_grouped keys a group's stream by
    // its index, so a segment would not draw its expert's stream; that keeps one group per
    // expert.
    int wgrad_done = 0;
    if (wq) {
        lb_quant_args ad = act_args(L, G, 1, 1, operand_id(L, layer, role, LB_PASS_WGRAD, 0, 0));
        lb_quant_args ax = act_args(L, G, 1, 0, operand_id(L, layer, role, LB_PASS_WGRAD, 0, 1));
        const int P = segs && nsrc > 1 && !ad.sr ? nsrc : 1;
        const int ng_all = groups * P;
        const int *gc = P > 1 ? segs : counts;   // rows per quantization group
        uint32_t signs[ng_all];
        for (int j = 0; j < groups; j++) {   // expert j's, as lb_linear_bwd draws them
            wgrad_hadamard(L, G, layer, role, j, &ad, &ax);
            for (int s = 0; s < P; s++) signs[j * P + s] = ad.hsigns;
        }
        ad.hsigns_groups = ax.hsigns_groups = signs;
        lb_backend *be = L->be;
        int kp[ng_all];
        lb_qmat qd[ng_all], qx[ng_all];
        lb_gemm_q_args g[groups];
        for (int q = 0; q < ng_all; q++)
            kp[q] = gc[q] ? wgrad_tokens(gc[q], (int)G->hadamard) : 0;
        lb_linear_qscratch_groups(L, 0, qd, ng_all, kp, out, &ad);
        lb_linear_qscratch_groups(L, 1, qx, ng_all, kp, in, &ax);
        etp_amax(L, 1, role, 1, &ad, ng_all, dya, gc, kp);
        if (rc) {   // dy both ways, then the dgrad
            int rows = nrows;
            if (rows) {
                lb_qmat qr;
                etp_amax(L, 0, role, 1, &a, 1, dya, &rows, NULL);
                lb_linear_qscratch(L, 2, &qr, rows, out, &a);
                be->quantize_rc(be, &qr, &a, ng_all, qd, dya, gc, kp, &ad);
                grouped_act_q(L, role, 1, dya, counts, groups, &a, &qr, c->col, in, dx, dx16);
            }
            dgrad_done = 1;
        } else {
            be->quantize_grouped(be, ng_all, qd, dya, gc, kp, &ad);
        }
        etp_amax(L, 1, role, 0, &ax, ng_all, xa, gc, kp);
        be->quantize_grouped(be, ng_all, qx, xa, gc, kp, &ax);
        for (int j = 0, z = 0; j <= groups; j++) {
            // a first write owes the experts without rows their zeros: one call per run of them
            // (in the 4-layer bench about 24 of each layer's 128 experts get no rows)
            if (j < groups && !counts[j]) continue;
            if (dw_beta == 0.0f && z < j) be->zero(be, dw + z * mat, (j - z) * mat * sizeof(float));
            z = j + 1;
        }
        // round r: every expert's r-th segment with rows, its first with dw_beta and the later
        // ones adding (so no call writes one matrix twice)
        int next[groups];
        memset(next, 0, sizeof next);
        for (int ng = 1; ng;) {
            ng = 0;
            for (int j = 0; j < groups; j++) {
                int s = next[j];
                while (s < P && !gc[j * P + s]) s++;
                if (s == P) {
                    next[j] = P;
                    continue;
                }
                const int q = j * P + s;
                g[ng++] = (lb_gemm_q_args){out, in, kp[q], 1.0f, next[j] > 0 ? 1.0f : dw_beta,
                                           &qd[q], &qx[q], dw + j * mat, NULL};
                next[j] = s + 1;
            }
            if (ng) be->gemm_q_grouped(be, ng, g);
        }
        wgrad_done = 1;
    }
    if (dgrad_done && wgrad_done) return;
    for (int j = 0; j < groups; j++) {
        lb_linear_bwd(L, layer, role, lb_act_rows(x, off, counts[j]), w, c, j, dy + off * out,
                      dgrad_done ? NULL : dx + off * in, 0.0f, wgrad_done ? NULL : dw + j * mat,
                      dw_beta, out);
        off += (size_t)counts[j];
    }
}

size_t lb_linear_qscratch_held(const lb_linear *L)
{
    size_t n = 0;
    for (int i = 0; i < LB_LINEAR_QSCRATCH; i++)
        n += L->qscratch[i].data_n + L->qscratch[i].scale_n + L->qscratch[i].scale2_n;
    return n;
}

// One operand's scratch i as a pass lays it out: groups of counts rows (one group: the call of
// lb_linear_fwd/_bwd; several: the experts', in one quantization where splits_by_rows).
static void reserve_operand(lb_linear *L, int i, const lb_quant_args *a, int groups,
                            const int *counts, int cols)
{
    lb_qmat q[groups > 0 ? groups : 1];
    int rows = (int)rows_of(counts, groups);
    if (rows == 0) return;
    if (groups == 1 || splits_by_rows(a)) lb_linear_qscratch(L, i, q, rows, cols, a);
    else lb_linear_qscratch_groups(L, i, q, groups, counts, cols, a);
}

void lb_linear_qscratch_reserve(lb_linear *L, int layer, lb_role role, int groups, int rows,
                                int out, int in)
{
    if (groups < 1 || rows < 1) return;
    const lb_site *F = lb_contract_site(L->contract, layer, role, LB_PASS_FPROP);
    const lb_site *D = lb_contract_site(L->contract, layer, role, LB_PASS_DGRAD);
    const lb_site *G = lb_contract_site(L->contract, layer, role, LB_PASS_WGRAD);
    int counts[groups], kp[groups];
    for (int j = 0; j < groups; j++) counts[j] = rows / groups + (j < rows % groups);
    if (is_low(F->fmt)) {
        lb_quant_args a = act_args(L, F, 0, 0, 0);
        reserve_operand(L, 0, &a, groups, counts, in);
    }
    const int dq = is_low(D->fmt) && D->mode == LB_BWD_QUANTIZED;
    const int wq = is_low(G->fmt) && G->mode == LB_BWD_QUANTIZED;
    lb_quant_args a = dq ? act_args(L, D, 0, 1, 0) : (lb_quant_args){0};
    if (dq && !(wq && (groups == 1 || splits_by_rows(&a))))
        reserve_operand(L, 0, &a, groups, counts, out);
    if (!wq) return;
    lb_quant_args ad = act_args(L, G, 1, 1, 0), ax = act_args(L, G, 1, 0, 0);
    ad.hadamard = ax.hadamard = (int)G->hadamard;
    for (int j = 0; j < groups; j++) kp[j] = counts[j] ? wgrad_tokens(counts[j], ad.hadamard) : 0;
    lb_qmat q[groups];
    lb_linear_qscratch_groups(L, 0, q, groups, kp, out, &ad);
    lb_linear_qscratch_groups(L, 1, q, groups, kp, in, &ax);
    if (dq) {   // quantize_rc's row-wise dy of all rows
        lb_qmat r;
        lb_linear_qscratch(L, 2, &r, rows, out, &a);
    }
}
