// decoder.c: the training forward and backward of the decoder made of the blocks (see
// blocks.h): pre-norm layers of GQA attention (optional q/k RMSNorm, plain or llama3-scaled
// RoPE) and a feed-forward block (models/ffn.c), with the embedding, final norm and LM head,
// and the layers' recomputation. Forward and backward are written out explicitly (llm.c style)
// from kernel-set operations only; what differs between families is read from the
// definition's flags (lb_model_def.moe, .qk_norm) and the configuration (rope_type).
#include <string.h>
#include "kernels/common.h"
#include "models/blocks_internal.h"
#include "parallel/tensor_parallel.h"

// RoPE's rotated dimensions of a head: 0 (all of them) or the partial share (GLM).
static int rope_rot(const lb_model_config *c)
{
    double f = c->partial_rotary_factor;
    return f > 0 && f < 1 ? (int)(c->head_dim * f) : 0;
}

// --- tensor parallelism: Megatron's conjugate operators (parallel/tensor_parallel.h) ---------
// over this model piece's tp group and backend; (n, C) are whole rows, this rank's n / tp of
// them under sequence parallelism.

void lb_blocks_tp_reduce(lb_model *m, float *part, float *out, int n, int C)
{
    lb_tp_reduce(m->be, m->par.tp_comm, m->par.sp, part, out, n, C);
}

static void tp_gather(lb_model *m, const float *mine, float *full, int n, int C)
{
    lb_tp_gather(m->be, m->par.tp_comm, m->par.sp, mine, full, n, C);
}

void lb_blocks_tp_sum(lb_model *m, float *x, size_t count)
{
    lb_tp_all_reduce(m->be, m->par.tp_comm, x, count);
}

// --- the layers -----------------------------------------------------------------------------

// q, k, v (n, heads x D) = ln (n, C) times their weights: one call, so a low-precision ln is
// quantized once for the three (lb_linear_fwd_shared); q and k into q16 and k16 in bf16 instead
// where those are given (lb_layer_plan.qk_in).
void lb_qkv_fwd(lb_linear *lin, int l, const lb_layer_w *w, lb_act ln, float *q, float *k,
                float *v, uint16_t *q16, uint16_t *k16, lb_dims d)
{
    const float *ws[3] = {w->q, w->k, w->v};
    const lb_wcache *cs[3] = {w->cq, w->ck, w->cv};
    float *ys[3] = {q, k, v};
    uint16_t *y16[3] = {q16, k16, NULL};
    const int outs[3] = {d.hq * d.D, d.hkv * d.D, d.hkv * d.D};
    lb_linear_fwd_shared(lin, l, LB_ROLE_ATTN_QKV, ln, 3, ws, cs, ys, q16 ? y16 : NULL, outs);
}

// The fp8 KV cache's quantization of k or v rows x (rows, d): fp8-block activations, 1x128
// blocks along d (one scale per row when d <= 128), E4M3, scale amax / 448.
lb_quant_args lb_blocks_kv_quant_args(void)
{
    lb_quant_args a;
    memset(&a, 0, sizeof a);
    a.fmt = LB_FMT_FP8_BLOCK;
    a.elem = LB_E4M3;
    return a;
}

// x = dequantize(quantize(x)) in place: the values an fp8 cache gives back.
static void kv_fake_quant(lb_backend *be, float *x, int rows, int d)
{
    lb_quant_args a = lb_blocks_kv_quant_args();
    lb_qmat q;
    memset(&q, 0, sizeof q);
    be->qmat_alloc(be, &q, rows, d, &a);
    be->quantize(be, &q, lb_act_f32(x, rows, d), &a);
    be->dequantize(be, x, &q);
    be->qmat_free(be, &q);
}

// Under SP rank r holds rows [r ns, (r + 1) ns) of the residual stream.
static int row_offset(const lb_model *m, int ns) { return m->par.sp ? m->par.tp_rank * ns : 0; }

// The layer's activations: its own, or under recomputation the working set with the layer's
// saved input.
static lb_layer_acts *layer_at(lb_acts *a, int i)
{
    if (a->recompute != LB_RECOMPUTE_FULL) return &a->l[i];
    a->work.x = a->l[i].x;
    a->work.x16 = a->l[i].x16;
    return &a->work;
}

// RMSNorm of this rank's rows of x (fp32 or bf16) into norm's rows (all rows gathered under
// SP).
void lb_norm_rows(lb_model *m, lb_acts *a, lb_act xa, const float *w, float *norm,
                  uint16_t *norm16, float *rstd)
{
    const float *x = xa.type == LB_ACT_F32 ? xa.p : NULL;
    const uint16_t *x16 = xa.type == LB_ACT_BF16 ? xa.p : NULL;
    lb_dims d = lb_dims_of(m);
    int r0 = row_offset(m, a->ns);
    if (norm16) {   // the rank's rows in bf16, gathered as pairs of them in 32-bit words
        const size_t ld = lb_blocks_n16(1, d.C);
        m->be->rmsnorm_fwd(m->be, &(lb_rmsnorm_args){.out16 = norm16 + (size_t)r0 * ld,
                .rstd = rstd, .x = x, .x16 = x16, .w = w, .n = a->ns, .c = d.C,
                .eps = (float)m->cfg.rms_norm_eps});
        tp_gather(m, (const float *)(norm16 + (size_t)r0 * ld), (float *)norm16, a->n,
                  (int)(ld / 2));
        return;
    }
    m->be->rmsnorm_fwd(m->be, &(lb_rmsnorm_args){.out = norm + (size_t)r0 * d.C, .rstd = rstd,
            .x = x, .x16 = x16, .w = w, .n = a->ns, .c = d.C,
            .eps = (float)m->cfg.rms_norm_eps});
    tp_gather(m, norm + (size_t)r0 * d.C, norm, a->n, d.C);
}

// y (n, cols) += the bias b (cols) on every row: the fp32 GEMM ones (n, 1) b (1, cols), in
// every recipe (a bias is not a linear layer's weight, so the contract does not quantize it).
static void bias_rows(lb_backend *be, float *y, const float *b, const float *ones, int n,
                      int cols)
{
    be->gemm(be, &(lb_gemm_args){.transa = 0, .transb = 0, .m = n, .n = cols, .k = 1,
            .alpha = 1.0f, .beta = 1.0f, .a = ones, .b = b, .c = y});
}

// The attention biases (attention_bias) on the q, k, v projections of n rows.
void lb_blocks_qkv_bias_fwd(lb_model *m, const lb_layer_w *w, const float *ones, float *q,
                            float *k, float *v, int n)
{
    if (!w->qb) return;
    lb_dims d = lb_dims_of(m);
    bias_rows(m->be, q, w->qb, ones, n, d.hq * d.D);
    bias_rows(m->be, k, w->kb, ones, n, d.hkv * d.D);
    bias_rows(m->be, v, w->vb, ones, n, d.hkv * d.D);
}

// db (cols) += the column sums of dy (n, cols): ones (n, 1)^T dy.
static void qkv_bias_bwd(lb_backend *be, float *db, const float *ones, const float *dy, int n,
                         int cols)
{
    be->gemm(be, &(lb_gemm_args){.transa = 1, .transb = 0, .m = 1, .n = cols, .k = n,
            .alpha = 1.0f, .beta = 1.0f, .a = ones, .b = dy, .c = db});
}

// q and k of n rows as attention takes them: per-head RMSNorm (def->qk_norm; else a copy),
// then RoPE at positions pos (n), with the frequencies freq (NULL: plain RoPE). The training
// and the cached forward both go through here, so their rows are the same bits.
// qr16, kr16: NULL, or where q and k go instead, in bf16 (the rotation reads q and k then).
// q16, k16: NULL, or q and k in bf16, read instead (with the q/k norms: lb_layer_plan.qk_in).
void lb_blocks_qk_rope_fwd(lb_model *m, const lb_layer_w *w, const float *q, const float *k,
                           const uint16_t *q16, const uint16_t *k16, float *qr, float *kr,
                           uint16_t *qr16, uint16_t *kr16, float *qrstd, float *krstd,
                           const int32_t *pos, const double *freq, int n)
{
    lb_backend *be = m->be;
    lb_dims d = lb_dims_of(m);
    int D = d.D;
    float eps = (float)m->cfg.rms_norm_eps, theta = (float)m->cfg.rope_theta;
    const int norm = lb_blocks_qk_norm(m);
    if ((q16 || k16) && !norm) lb_die("q/k rope: bf16 q and k without their norms");
    if (!norm && !qr16) {
        be->copy(be, qr, q, (size_t)n * d.hq * D * sizeof(float));
        be->copy(be, kr, k, (size_t)n * d.hkv * D * sizeof(float));
    }
    // the q/k norms in the rotation's call (rope's src): one pass each
    be->rope(be, &(lb_rope_args){.x = qr16 && !norm ? (float *)q : qr, .out16 = qr16, .pos = pos,
            .n = n, .heads = d.hq, .d = D, .theta = theta, .rot = rope_rot(&m->cfg),
            .inv_freq = freq, .src = norm && !q16 ? q : NULL, .src16 = q16, .nw = w->qn,
            .rstd = qrstd, .eps = eps});
    be->rope(be, &(lb_rope_args){.x = kr16 && !norm ? (float *)k : kr, .out16 = kr16, .pos = pos,
            .n = n, .heads = d.hkv, .d = D, .theta = theta, .rot = rope_rot(&m->cfg),
            .inv_freq = freq, .src = norm && !k16 ? k : NULL, .src16 = k16, .nw = w->kn,
            .rstd = krstd, .eps = eps});
}

// Core attention of layer L from its q, k, v projections: q/k norms, RoPE, what an fp8 KV
// cache would hold (straight-through backward), attention.
void lb_attention_core_fwd(lb_model *m, lb_acts *a, lb_layer_acts *L, const lb_layer_w *w)
{
    lb_backend *be = m->be;
    lb_dims d = lb_dims_of(m);
    int n = a->n, D = d.D;
    if ((L->qr16 != NULL) != lb_blocks_qk16(m))
        lb_die("attention: the activations were made for %s q and k, and the model now wants "
               "the other (the KV cache kind changed after they were made)",
               L->qr16 ? "bf16" : "fp32");
    lb_blocks_qk_rope_fwd(m, w, L->q, L->k, L->q16, L->k16, L->qr, L->kr, L->qr16, L->kr16,
                          L->qrstd, L->krstd, a->pos, a->rope_freq, n);
    if (m->kv_fp8) {
        kv_fake_quant(be, L->kr, n * d.hkv, D);
        kv_fake_quant(be, L->v, n * d.hkv, D);
    }
    // The contract's attention mode; the backward and the cached forward pass the same one, so
    // the sampler's rows are this forward's bits.
    be->attention_fwd(be, &(lb_attention_args){.out = L->att, .out16 = L->att16, .lse = L->lse,
            .q = L->qr, .k = L->kr, .v = L->v, .q16 = L->qr16, .k16 = L->kr16, .b = a->b,
            .t = a->t, .hq = d.hq, .hkv = d.hkv, .d = D,
            .bf16 = m->contract.attention_bf16});
}

// The residual add of a block's output: y = x + branch (ns, C), in place in fp32 (branch is y
// itself) or, where the stream is bf16, rounded once into y16 (branch is a->branch).
static void residual_add(lb_backend *be, float *y, uint16_t *y16, lb_act x, const float *branch,
                         size_t count)
{
    if (y16) be->add16(be, y16, x, branch);
    else be->add(be, y, x.p, count);
}

// Decoder layer i of this stage on L->x (L->x16), into a->l[i + 1].x (.x16); returns its
// load-balancing loss.
double lb_decoder_layer_fwd(lb_model *m, lb_acts *a, int i, lb_layer_acts *L)
{
    lb_backend *be = m->be;
    lb_dims d = lb_dims_of(m);
    int n = a->n, ns = a->ns, C = d.C, D = d.D;
    int l = m->layer_begin + i;
    lb_linear *lin = &m->lin;
    lb_layer_w w = lb_blocks_layer_weights(m, m->params, l);
    // attention block: heads split over tp, o_proj row-parallel
    const lb_act x = lb_act_of(L->x, L->x16, ns, C), xmid = lb_act_of(L->xmid, L->xmid16, ns, C);
    lb_norm_rows(m, a, x, w.ln1, L->ln1, L->ln1_16, L->rstd1);
    lb_qkv_fwd(lin, l, &w, lb_act_of(L->ln1, L->ln1_16, n, C), L->q, L->k, L->v, L->q16, L->k16,
               d);
    lb_blocks_qkv_bias_fwd(m, &w, a->ones, L->q, L->k, L->v, n);
    lb_attention_core_fwd(m, a, L, &w);
    // a block's output: into the fp32 stream, or a->branch before its add into the bf16 one
    float *sum = L->xmid16 ? a->branch : L->xmid, *part = d.tp > 1 ? a->part : sum;
    lb_linear_fwd(lin, l, LB_ROLE_ATTN_OUT, lb_act_of(L->att, L->att16, n, d.hq * D), w.o, w.co,
                  0, part, C, 0.0f);
    lb_blocks_tp_reduce(m, part, sum, n, C);
    residual_add(be, L->xmid, L->xmid16, x, sum, (size_t)ns * C);
    // feed-forward block: gate_up column-parallel, down row-parallel
    lb_layer_acts *next = &a->l[i + 1];
    lb_norm_rows(m, a, xmid, w.ln2, L->ln2, L->ln2_16, L->rstd2);
    sum = next->x16 ? a->branch : next->x, part = d.tp > 1 ? a->part : sum;
    double aux = lb_ffn_fwd(m, l, &w, &L->f, &a->ms, L->ln2, L->ln2_16, n, part, 1, 0);
    lb_blocks_tp_reduce(m, part, sum, n, C);
    residual_add(be, next->x, next->x16, xmid, sum, (size_t)ns * C);
    return aux;
}

// Selective recomputation before layer i's backward: the forward's norms, core attention and
// SwiGLU again from what the layer kept (x, xmid, the q/k/v projections, gate_up's output),
// with the same operations in the same order, so the same bits.
static void layer_recompute(lb_model *m, lb_acts *a, int i, lb_layer_acts *L)
{
    lb_dims d = lb_dims_of(m);
    lb_layer_w w = lb_blocks_layer_weights(m, m->params, m->layer_begin + i);
    lb_norm_rows(m, a, lb_act_of(L->x, L->x16, a->ns, d.C), w.ln1, L->ln1, L->ln1_16,
                 L->rstd1);
    lb_attention_core_fwd(m, a, L, &w);
    lb_norm_rows(m, a, lb_act_of(L->xmid, L->xmid16, a->ns, d.C), w.ln2, L->ln2, L->ln2_16,
                 L->rstd2);
    const int l = m->layer_begin + i, moe = lb_blocks_layer_moe(&m->cfg, l);
    int rows = moe ? L->f.route.nrecv : a->n;
    const int h16on =
        moe ? lb_blocks_takes16(m, l, LB_ROLE_MOE_DOWN) : lb_blocks_mlp16(m, l, 1);
    const int g16 = moe ? lb_blocks_out16(m, l, LB_ROLE_MOE_GATE_UP, LB_PASS_FPROP)
                        : lb_blocks_mlp16(m, l, 0);
    uint16_t *h16 = h16on ? L->f.h16 : NULL, *gu16 = g16 ? L->f.gu16 : NULL;
    const float *rw = !moe || !lb_blocks_weights_on_h(m, l) ? NULL : d.ep > 1 ? L->f.wpe : L->f.wp;
    if (rows)
        m->be->swiglu_fwd(m->be, &(lb_swiglu_args){.out = h16 ? NULL : L->f.h, .out16 = h16,
                .gu = gu16 ? NULL : L->f.gu, .gu16 = gu16, .rw = rw, .n = rows,
                .f = moe ? d.F : d.Fd});
}

// One chunk of the LM head's forward: the logits of nr rows x of lnf into m->logits (bf16
// where lb_model_logits16, else fp32) and their per-token losses into loss, with the row
// statistics where st is given.
static void head_chunk_fwd(lb_model *m, const float *x, const int32_t *tg, int nr, float *loss,
                           double *st)
{
    lb_dims d = lb_dims_of(m);
    const lb_tensor *th = lb_blocks_find_or_die(m, "lm_head.weight");
    const int l = m->cfg.num_hidden_layers - 1;
    const float *wh = m->params + th->offset;
    const lb_wcache *ch = &m->wcache[th - m->tensors];
    if (lb_model_logits16(m)) {
        uint16_t *l16 = (uint16_t *)m->logits;
        lb_linear_fwd_c16(&m->lin, l, LB_ROLE_LM_HEAD, lb_act_f32(x, nr, d.C), wh, ch, l16, d.V);
        m->be->cross_entropy_fwd16(m->be, loss, st, l16, tg, nr, d.V);
    } else {
        lb_linear_fwd(&m->lin, l, LB_ROLE_LM_HEAD, lb_act_f32(x, nr, d.C), wh, ch, 0, m->logits,
                      d.V, 0.0f);
        m->be->cross_entropy_fwd(m->be, loss, st, m->logits, tg, nr, d.V);
    }
}

// The training forward's LM head (lb_model_forward_train): R rows at a time, the chunk's
// logits, their per-token losses and row statistics, then at once the LM head's backward for
// those rows with the loss scale given up front: d lnf rows into a->dln, the weight gradient
// accumulated chunk by chunk. A chunk's logits are made once, and live only until its
// backward; unchunked (R = ns) the calls and their bits are those of forward then backward.
static void head_train(lb_model *m, lb_acts *a, const int32_t *tg, int R)
{
    lb_backend *be = m->be;
    lb_dims d = lb_dims_of(m);
    const lb_tensor *th = lb_blocks_find_or_die(m, "lm_head.weight");
    const int l = m->cfg.num_hidden_layers - 1, ns = a->ns, C = d.C;
    float *wh = m->params + th->offset, *dwh = m->grads + th->offset;
    const lb_wcache *ch = &m->wcache[th - m->tensors];
    float dce = m->ntokens ? m->head_scale / (float)m->ntokens : 0.0f;
    int fused = lb_linear_ce_fusable(&m->lin, l, LB_ROLE_LM_HEAD);
    // bf16 logits (lb_model_logits16 implies fused) get the gradient written over them
    uint16_t *l16 = lb_model_logits16(m) ? (uint16_t *)m->logits : NULL;
    for (int r = 0; r < ns; r += R) {
        int nr = ns - r < R ? ns - r : R;
        const float *x = a->lnf + (size_t)r * C;
        double *st = a->ce_stats + 2 * (size_t)r;
        head_chunk_fwd(m, x, tg + r, nr, a->loss + r, st);
        // the cross-entropy's gradient and the LM head's backward in one call where the
        // backward is a plain bf16 GEMM (the backend need not store the gradient)
        if (fused) {
            lb_linear_ce_bwd(&m->lin, l, LB_ROLE_LM_HEAD, lb_act_f32(x, nr, C), wh, ch,
                             l16 ? NULL : m->logits, l16, st, tg + r, dce,
                             a->dln + (size_t)r * C, dwh, lb_model_grad_beta(m, dwh), d.V);
        } else {
            be->cross_entropy_bwd(be, m->logits, m->logits, st, tg + r, dce, nr, d.V);
            lb_linear_bwd(&m->lin, l, LB_ROLE_LM_HEAD, lb_act_f32(x, nr, C), wh, ch, 0, m->logits,
                          a->dln + (size_t)r * C, 0.0f, dwh, lb_model_grad_beta(m, dwh), d.V);
        }
    }
    a->ce_stats_ok = a->logits_whole = 0;   // the buffer holds a gradient now
    a->head_done = 1;
    a->head_scale = m->head_scale;
}

void lb_decoder_forward(lb_model *m, const int32_t *tokens, const int32_t *targets, int b, int t)
{
    const lb_model_config *c = &m->cfg;
    lb_backend *be = m->be;
    lb_acts *a = m->acts;
    lb_dims d = lb_dims_of(m);
    int ns = a->ns, r0 = row_offset(m, ns), C = d.C;
    float eps = (float)c->rms_norm_eps;
    double aux = 0.0;
    lb_linear *lin = &m->lin;
    (void)b, (void)t;   // the activations were made for (b, t)

    if (m->first_stage) {   // the embedding rows (rounded to bf16 where the stream is bf16)
        lb_layer_acts *L0 = &a->l[0];
        be->embedding_fwd(be, L0->x16 ? a->branch : L0->x, tokens + r0,
                          m->params +
                              lb_blocks_find_or_die(m, "model.embed_tokens.weight")->offset,
                          ns, C);
        if (L0->x16) be->to_bf16(be, L0->x16, a->branch, (size_t)ns, C, (C + 7) & ~7);
    }
    for (int i = 0; i < a->nl; i++) aux += lb_decoder_layer_fwd(m, a, i, layer_at(a, i));
    m->aux_loss = (float)aux;
    m->ntokens = 0;
    m->ce_loss = 0.0f;
    m->loss = (float)(c->router_aux_loss_coef * aux);
    a->ce_stats_ok = a->logits_whole = a->head_done = 0;
    if (!m->last_stage) return;   // the next stage continues from stage_output
    const lb_tensor *tn = lb_blocks_find_or_die(m, "model.norm.weight");
    const lb_tensor *th = lb_blocks_find_or_die(m, "lm_head.weight");
    be->rmsnorm_fwd(be, &(lb_rmsnorm_args){.out = a->lnf, .rstd = a->rstdf, .x = a->l[a->nl].x,
            .x16 = a->l[a->nl].x16, .w = m->params + tn->offset, .n = ns, .c = C, .eps = eps});
    int R = targets ? lb_model_ce_rows(m, ns) : ns;
    if (!targets) {   // the logits of every row (log-probabilities, sampling's checks)
        lb_linear_fwd(lin, c->num_hidden_layers - 1, LB_ROLE_LM_HEAD, lb_act_f32(a->lnf, ns, C),
                      m->params + th->offset, &m->wcache[th - m->tensors], 0, m->logits, d.V,
                      0.0f);
        a->logits_whole = 1;
        return;
    }
    m->ntokens = m->target_count;   // all rows', counted by the host before the forward
    if (m->head_bwd) {
        head_train(m, a, targets + r0, R);
    } else {
        // Loss only, or kept for a backward: the LM head and the per-token losses R rows at a
        // time (chunked, the logits are not kept); unchunked, the statistics save the
        // backward a second read of every row. bf16 logits where the head is bf16 throughout.
        for (int r = 0; r < ns; r += R) {
            int nr = ns - r < R ? ns - r : R;
            head_chunk_fwd(m, a->lnf + (size_t)r * C, targets + r0 + r, nr, a->loss + r,
                           R == ns ? a->ce_stats : NULL);
        }
        a->ce_stats_ok = a->logits_whole = R == ns;
    }
    // Loss: mean cross-entropy over counted targets, summed in token order in double (each
    // rank's rows, then the ranks in order under SP).
    be->download(be, a->host_loss, a->loss, (size_t)ns * sizeof(float));
    be->download(be, a->host_targets, targets + r0, (size_t)ns * sizeof(int32_t));
    double sum = 0.0;
    for (int i = 0; i < ns; i++)
        if (a->host_targets[i] >= 0) sum += a->host_loss[i];
    if (m->par.sp) sum = lb_comm_allreduce_sum(m->par.tp_comm, sum);
    m->ce_loss = m->ntokens > 0 ? (float)(sum / m->ntokens) : 0.0f;
    m->loss = (float)(m->ce_loss + c->router_aux_loss_coef * aux);
}

// From d loss / d logits in m->logits on the last stage, or d loss / d stage output in
// stage_grad on an earlier one; aux_scale weighs the load-balancing loss. On a later stage
// stage_grad ends holding d loss / d stage input.
static void backward_from(lb_model *m, float aux_scale, int head_done)
{
    const lb_model_config *c = &m->cfg;
    lb_backend *be = m->be;
    lb_acts *a = m->acts;
    lb_dims d = lb_dims_of(m);
    int b = a->b, t = a->t, n = a->n, ns = a->ns, r0 = row_offset(m, ns), C = d.C, D = d.D;
    float theta = (float)c->rope_theta;
    float *G = m->grads;
    lb_linear *lin = &m->lin;

    if (m->last_stage) {   // lm head (unless done chunk by chunk) and final norm
        const lb_tensor *tn = lb_blocks_find_or_die(m, "model.norm.weight");
        const lb_tensor *th = lb_blocks_find_or_die(m, "lm_head.weight");
        if (!head_done)
            lb_linear_bwd(lin, c->num_hidden_layers - 1, LB_ROLE_LM_HEAD,
                          lb_act_f32(a->lnf, ns, C), m->params + th->offset,
                          &m->wcache[th - m->tensors], 0, m->logits, a->dln, 0.0f,
                          G + th->offset, lb_model_grad_beta(m, G + th->offset), d.V);
        be->rmsnorm_bwd(be, &(lb_rmsnorm_args){.dx = a->dres, .dx_beta = 0.0f,
                .dw = G + tn->offset, .dout = a->dln, .x = a->l[a->nl].x,
                .x16 = a->l[a->nl].x16, .w = m->params + tn->offset, .rstd = a->rstdf,
                .n = ns, .c = C});
    }
    for (int i = a->nl - 1; i >= 0; i--) {
        int l = m->layer_begin + i;
        lb_layer_acts *L = layer_at(a, i);
        // Recomputation: the layer's forward again, on its saved input, the same operations in
        // the same order, so every activation is the same bits as the first time. Its output
        // (x of layer i + 1, no longer needed) is rewritten with the same values.
        if (a->recompute == LB_RECOMPUTE_FULL) lb_decoder_layer_fwd(m, a, i, L);
        else if (a->recompute == LB_RECOMPUTE_SELECTIVE) layer_recompute(m, a, i, L);
        lb_layer_w w = lb_blocks_layer_weights(m, m->params, l);
        lb_layer_w dw = lb_blocks_layer_weights(m, G, l);
        // feed-forward block: dres is d loss / d xnext, and passes straight to xmid
        tp_gather(m, a->dres, a->dfull, n, C);
        lb_ffn_bwd(m, l, &w, &dw, &L->f, a, lb_act_of(L->ln2, L->ln2_16, n, C), n, a->dfull,
                   a->dln, aux_scale);
        lb_blocks_tp_reduce(m, a->dln, a->dlns, n, C);
        be->rmsnorm_bwd(be, &(lb_rmsnorm_args){.dx = a->dres, .dx_beta = 1.0f, .dw = dw.ln2,
                .dout = a->dlns, .x = L->xmid, .x16 = L->xmid16, .w = w.ln2, .rstd = L->rstd2,
                .n = ns, .c = C});
        // attention block: dres is now d loss / d xmid
        tp_gather(m, a->dres, a->dfull, n, C);
        lb_linear_bwd(lin, l, LB_ROLE_ATTN_OUT, lb_act_of(L->att, L->att16, n, d.hq * D), w.o,
                      w.co, 0, a->dfull, a->datt, 0.0f, dw.o, lb_model_grad_beta(m, dw.o), C);
        be->attention_bwd(be, &(lb_attention_args){.dq = a->dq, .dk = a->dk, .dv = a->dv,
                .dout = a->datt, .q = L->qr, .k = L->kr, .v = L->v, .q16 = L->qr16,
                .k16 = L->kr16, .out = L->att, .out16 = L->att16, .lse = L->lse,
                .b = b, .t = t, .hq = d.hq, .hkv = d.hkv, .d = D,
                .bf16 = m->contract.attention_bf16});
        be->rope(be, &(lb_rope_args){.x = a->dq, .pos = a->pos, .n = n, .heads = d.hq, .d = D,
                .theta = theta, .inverse = 1, .rot = rope_rot(c), .inv_freq = a->rope_freq});
        be->rope(be, &(lb_rope_args){.x = a->dk, .pos = a->pos, .n = n, .heads = d.hkv, .d = D,
                .theta = theta, .inverse = 1, .rot = rope_rot(c), .inv_freq = a->rope_freq});
        // d loss / d the projections' q and k: through the q/k norms, or RoPE's input itself
        const float *dqp = a->dq, *dkp = a->dk;
        if (lb_blocks_qk_norm(m)) {
            be->rmsnorm_bwd(be, &(lb_rmsnorm_args){.dx = a->dqr, .dx_beta = 0.0f, .dw = dw.qn,
                    .dout = a->dq, .x = L->q, .x16 = L->q16, .w = w.qn, .rstd = L->qrstd,
                    .n = n * d.hq,
                    .c = D});
            be->rmsnorm_bwd(be, &(lb_rmsnorm_args){.dx = a->dkr, .dx_beta = 0.0f, .dw = dw.kn,
                    .dout = a->dk, .x = L->k, .x16 = L->k16, .w = w.kn, .rstd = L->krstd,
                    .n = n * d.hkv,
                    .c = D});
            dqp = a->dqr, dkp = a->dkr;
        }
        if (w.qb) {   // the biases' gradients: the column sums of dq, dk, dv
            qkv_bias_bwd(be, dw.qb, a->ones, dqp, n, d.hq * D);
            qkv_bias_bwd(be, dw.kb, a->ones, dkp, n, d.hkv * D);
            qkv_bias_bwd(be, dw.vb, a->ones, a->dv, n, d.hkv * D);
        }
        {   // dln = dq W_q + dk W_k + dv W_v, the wgrads' column-wise ln1 made once
            const float *ws[3] = {w.q, w.k, w.v}, *dys[3] = {dqp, dkp, a->dv};
            const lb_wcache *cs[3] = {w.cq, w.ck, w.cv};
            float *dws[3] = {dw.q, dw.k, dw.v};
            const float betas[3] = {lb_model_grad_beta(m, dw.q), lb_model_grad_beta(m, dw.k),
                                    lb_model_grad_beta(m, dw.v)};
            const int outs[3] = {d.hq * D, d.hkv * D, d.hkv * D};
            lb_linear_bwd_shared(lin, l, LB_ROLE_ATTN_QKV, lb_act_of(L->ln1, L->ln1_16, n, C), 3,
                                 ws, cs, dys, a->dln, dws, betas, outs);
        }
        lb_blocks_tp_reduce(m, a->dln, a->dlns, n, C);
        be->rmsnorm_bwd(be, &(lb_rmsnorm_args){.dx = a->dres, .dx_beta = 1.0f, .dw = dw.ln1,
                .dout = a->dlns, .x = L->x, .x16 = L->x16, .w = w.ln1, .rstd = L->rstd1,
                .n = ns, .c = C});
    }
    if (m->first_stage)
        be->embedding_bwd(be, G + lb_blocks_find_or_die(m, "model.embed_tokens.weight")->offset,
                          a->dres, m->tokens + r0, ns, C);
}

void lb_decoder_backward_logits(lb_model *m, float aux_scale)
{
    lb_acts *a = m->acts;
    if (m->last_stage && !a->logits_whole)
        lb_die("backward from the logits: the last forward kept no logits of every row (it had "
               "targets and chunked cross-entropy, or ran the LM head's backward)");
    backward_from(m, aux_scale, 0);
}

void lb_decoder_backward(lb_model *m, float loss_scale)
{
    lb_acts *a = m->acts;
    int ns = a->ns, head_done = 0;
    if (m->last_stage && a->head_done) {   // lb_model_forward_train ran the LM head's backward
        if (loss_scale != a->head_scale)
            lb_die("backward with loss scale %g after a training forward for %g", loss_scale,
                   a->head_scale);
        head_done = 1;
    } else if (m->last_stage) {
        const lb_model_config *c = &m->cfg;
        lb_dims d = lb_dims_of(m);
        const lb_tensor *th = lb_blocks_find_or_die(m, "lm_head.weight");
        const int32_t *tg = m->targets + row_offset(m, ns);
        float dce = m->ntokens ? loss_scale / (float)m->ntokens : 0.0f;
        float *wh = m->params + th->offset, *dwh = m->grads + th->offset;
        if (!a->logits_whole)
            lb_die("backward: the forward kept no logits (chunked cross-entropy); a training "
                   "step's forward is lb_model_forward_train");
        const double *st = a->ce_stats_ok ? a->ce_stats : NULL;   // the forward's, if any
        const int l = c->num_hidden_layers - 1;
        // The cross-entropy's gradient and the LM head's backward in one call (the backend
        // need not store the gradient); else the logits buffer becomes d loss / d logits, and
        // backward_from runs the LM head's backward
        head_done = st && lb_linear_ce_fusable(&m->lin, l, LB_ROLE_LM_HEAD);
        uint16_t *l16 = lb_model_logits16(m) ? (uint16_t *)m->logits : NULL;
        if (l16 && !head_done) lb_die("backward: the forward's bf16 logits lack their statistics");
        if (head_done)
            lb_linear_ce_bwd(&m->lin, l, LB_ROLE_LM_HEAD, lb_act_f32(a->lnf, ns, d.C), wh,
                             &m->wcache[th - m->tensors], l16 ? NULL : m->logits, l16, st, tg,
                             dce, a->dln, dwh, lb_model_grad_beta(m, dwh), d.V);
        else
            m->be->cross_entropy_bwd(m->be, m->logits, m->logits, st, tg, dce, ns, d.V);
        a->ce_stats_ok = a->logits_whole = 0;   // the buffer no longer holds the logits
    }
    a->head_done = 0;
    backward_from(m, loss_scale * (float)m->cfg.router_aux_loss_coef, head_done);
}
