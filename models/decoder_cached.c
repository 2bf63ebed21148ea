// decoder_cached.c: the cached forward of the decoder, used for sampling: the training
// forward's operations in its order for the new rows of a step, attention through the KV
// cache, so that each row's logits are the training forward's bits; and its activations, one
// layer's worth for up to a step's rows, which every layer uses in turn.
#include <stdlib.h>
#include "kernels/common.h"
#include "models/blocks_internal.h"

// The cached forward's ln16 where the fprop of (layer l, role) is a bf16 GEMM, which reads the
// norm's bf16 copy (rmsnorm_fwd's out16, lb_linear_fwd16), or quantizes it
// (lb_blocks_qkv_quantized16); else NULL (no copy written).
static uint16_t *cached_ln16(const lb_model *m, lb_cached_acts *a, int l, lb_role role)
{
    if (role == LB_ROLE_ATTN_QKV && lb_blocks_qkv_quantized16(m, l)) return a->ln16;
    if (role == LB_ROLE_ROUTER && lb_blocks_ln2_16(m)) return a->ln16;   // lb_layer_plan.ln2
    return lb_contract_site(&m->contract, l, role, LB_PASS_FPROP)->fmt == LB_FMT_BF16 ? a->ln16
                                                                                      : NULL;
}

void *lb_decoder_cached_create(lb_model *m, int max_rows)
{
    lb_backend *be = m->be;
    lb_dims d = lb_dims_of(m);
    lb_cached_acts *a = lb_calloc(1, sizeof *a);
    size_t n = (size_t)max_rows, C = d.C, D = d.D, hq = d.hq, hkv = d.hkv;
    a->rows = max_rows;
    a->x = lb_blocks_falloc(be, n * C);
    a->xmid = lb_blocks_falloc(be, n * C);
    if (lb_blocks_res16(m)) {
        a->x16 = be->alloc(be, lb_blocks_n16(n, (int)C) * sizeof(uint16_t));
        a->xmid16 = be->alloc(be, lb_blocks_n16(n, (int)C) * sizeof(uint16_t));
    }
    a->ln = lb_blocks_falloc(be, n * C);
    a->rstd = lb_blocks_falloc(be, n);
    a->ln16 = be->alloc(be, lb_blocks_n16(n, (int)C) * sizeof(uint16_t));
    if (lb_blocks_qk_in16(m)) {   // q and k as the training forward stores them (qk_in)
        a->q16 = be->alloc(be, n * hq * D * sizeof(uint16_t));
        a->k16 = be->alloc(be, n * hkv * D * sizeof(uint16_t));
    } else {
        a->q = lb_blocks_falloc(be, n * hq * D);
        a->k = lb_blocks_falloc(be, n * hkv * D);
    }
    a->qrstd = lb_blocks_falloc(be, n * hq);
    a->qr = lb_blocks_falloc(be, n * hq * D);
    a->krstd = lb_blocks_falloc(be, n * hkv);
    a->kr = lb_blocks_falloc(be, n * hkv * D);
    a->v = lb_blocks_falloc(be, n * hkv * D);
    a->att = lb_blocks_falloc(be, n * hq * D);
    a->att16 = be->alloc(be, n * hq * D * sizeof(uint16_t));   // lb_blocks_att16: per call
    if (d.tp > 1) a->part = lb_blocks_falloc(be, n * C);
    if (m->kv_fp8) {   // made once: a step allocates nothing
        lb_quant_args qa = lb_blocks_kv_quant_args();
        be->qmat_alloc(be, &a->kq, max_rows * d.hkv, D, &qa);
        be->qmat_alloc(be, &a->vq, max_rows * d.hkv, D, &qa);
    }
    lb_blocks_ffn_create(m, &a->f, max_rows);
    a->rope_freq = lb_blocks_rope_freq_create(m);
    a->ones = lb_blocks_ones_create(m, n);
    return a;
}

void lb_decoder_cached_free(lb_model *m, void *p)
{
    lb_cached_acts *a = p;
    lb_backend *be = m->be;
    void *bufs[] = {a->x, a->xmid, a->x16, a->xmid16, a->ln, a->ln16, a->rstd, a->q, a->q16,
                    a->k16, a->qrstd, a->qr, a->k,
                    a->krstd, a->kr, a->v, a->att, a->att16, a->part, a->rope_freq, a->ones};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) be->free(be, bufs[i]);
    if (a->kq.data) be->qmat_free(be, &a->kq);
    if (a->vq.data) be->qmat_free(be, &a->vq);
    lb_blocks_ffn_free(m, &a->f);
    lb_blocks_scratch_free(be, &a->ms);
    free(a);
}

// forward()'s operations in forward()'s order for n new rows; attention goes through the KV
// cache (kv_append, then attention_cached) instead of attention_fwd. Nothing a row computes
// depends on the other rows, so each row's logits equal the training forward's. Under tp and
// ep it is collective like forward (no sequence or pipeline parallelism here).
void lb_decoder_forward_cached(lb_model *m, lb_kvcache *kv, int n)
{
    const lb_model_config *c = &m->cfg;
    lb_backend *be = m->be;
    lb_cached_acts *a = kv->acts;
    lb_dims d = lb_dims_of(m);
    int C = d.C, D = d.D;
    float eps = (float)c->rms_norm_eps;
    lb_linear *lin = &m->lin;

    const int r16 = lb_blocks_res16(m);   // the stream in bf16: x16 and xmid16, as forward's
    be->embedding_fwd(be, a->x, kv->tokens,
                      m->params + lb_blocks_find_or_die(m, "model.embed_tokens.weight")->offset,
                      n, C);
    if (r16) be->to_bf16(be, a->x16, a->x, (size_t)n, C, (C + 7) & ~7);
    // Each residual add into an fp32 stream is the next norm's (rmsnorm_fwd's res: add()'s
    // bits); into a bf16 one, add16's as forward's. A norm whose readers are bf16 GEMMs also
    // writes their operand (out16): fewer launches a decode step.
    lb_layer_w w0 = lb_blocks_layer_weights(m, m->params, 0);
    be->rmsnorm_fwd(be, &(lb_rmsnorm_args){.out = a->ln, .rstd = a->rstd, .x = r16 ? NULL : a->x,
            .x16 = a->x16, .w = w0.ln1, .n = n, .c = C, .eps = eps,
            .out16 = cached_ln16(m, a, 0, LB_ROLE_ATTN_QKV)});
    for (int l = 0; l < c->num_hidden_layers; l++) {
        lb_layer_w w = lb_blocks_layer_weights(m, m->params, l);
        lb_qkv_fwd(lin, l, &w,
                   lb_blocks_norm_in(m, l, LB_ROLE_ATTN_QKV,
                                     lb_blocks_qkv_quantized16(m, l) ? NULL : a->ln,
                                     cached_ln16(m, a, l, LB_ROLE_ATTN_QKV), n, C),
                   a->q, a->k, a->v, a->q16, a->k16, d);
        lb_blocks_qkv_bias_fwd(m, &w, a->ones, a->q, a->k, a->v, n);
        lb_blocks_qk_rope_fwd(m, &w, a->q, a->k, a->q16, a->k16, a->qr, a->kr, NULL, NULL,
                              a->qrstd, a->krstd, kv->pos, a->rope_freq, n);
        if (kv->fp8) {   // the first n * hkv rows of the call's quantized k and v
            lb_quant_args qa = lb_blocks_kv_quant_args();
            lb_qmat kq = lb_qmat_rows(&a->kq, 0, n * d.hkv);
            lb_qmat vq = lb_qmat_rows(&a->vq, 0, n * d.hkv);
            be->quantize(be, &kq, lb_act_f32(a->kr, n * d.hkv, D), &qa);
            be->quantize(be, &vq, lb_act_f32(a->v, n * d.hkv, D), &qa);
            be->kv_append(be, &kv->layer[l], NULL, NULL, &kq, &vq, kv->slot, kv->pos, n);
        } else {
            be->kv_append(be, &kv->layer[l], a->kr, a->v, NULL, NULL, kv->slot, kv->pos, n);
        }
        be->attention_cached(be, a->att, a->qr, &kv->layer[l], kv->slot, kv->pos, n, d.hq,
                             m->contract.attention_bf16);
        // the o projection's input as the training forward stores it (bf16: att16)
        const uint16_t *att16 = NULL;
        if (lb_blocks_att16(m)) {
            be->to_bf16(be, a->att16, a->att, (size_t)n, d.hq * D, d.hq * D);
            att16 = a->att16;
        }
        float *part = d.tp > 1 ? a->part : a->xmid;
        lb_linear_fwd(lin, l, LB_ROLE_ATTN_OUT, lb_act_of(a->att, att16, n, d.hq * D), w.o, w.co,
                      0, part, C, 0.0f);
        lb_blocks_tp_reduce(m, part, a->xmid, n, C);
        // feed-forward block: xmid = xmid + x, its norm; the block's output overwrites x
        // the norm in fp32 only where something reads it (not under lb_layer_plan.ln2)
        uint16_t *ln16 = cached_ln16(m, a, l, LB_ROLE_ROUTER);
        float *ln = lb_blocks_ln2_16(m) ? NULL : a->ln;
        if (r16) be->add16(be, a->xmid16, lb_act_bf16(a->x16, n, C), a->xmid);
        be->rmsnorm_fwd(be, &(lb_rmsnorm_args){.out = ln, .rstd = a->rstd,
                .x = r16 ? NULL : a->xmid, .x16 = a->xmid16, .res = r16 ? NULL : a->x,
                .sum = r16 ? NULL : a->xmid, .w = w.ln2, .n = n, .c = C, .eps = eps,
                .out16 = ln16});
        part = d.tp > 1 ? a->part : a->x;
        lb_ffn_fwd(m, l, &w, &a->f, &a->ms, ln, ln16, n, part, 0, 1);
        lb_blocks_tp_reduce(m, part, a->x, n, C);
        if (r16) be->add16(be, a->x16, lb_act_bf16(a->xmid16, n, C), a->x);
        if (l + 1 == c->num_hidden_layers) {
            if (!r16) be->add(be, a->x, a->xmid, (size_t)n * C);
            break;
        }
        // x = x + xmid, the next norm
        lb_layer_w wn = lb_blocks_layer_weights(m, m->params, l + 1);
        be->rmsnorm_fwd(be, &(lb_rmsnorm_args){.out = a->ln, .rstd = a->rstd,
                .x = r16 ? NULL : a->x, .x16 = a->x16, .res = r16 ? NULL : a->xmid,
                .sum = r16 ? NULL : a->x, .w = wn.ln1, .n = n, .c = C, .eps = eps,
                .out16 = cached_ln16(m, a, l + 1, LB_ROLE_ATTN_QKV)});
    }
    // The final norm and the LM head act per row: only the rows whose logits are read (kv->lrows,
    // gathered into xmid, free now) pay for them; a prefill chunk's rows are not sampled. bf16
    // rows are gathered as pad8(C) / 2 words each.
    const float *xf = r16 ? NULL : a->x;
    const uint16_t *xf16 = a->x16;
    if (kv->lrows) {
        if (kv->nl == 0) return;
        if (r16) {
            const int words = (C + 7) / 8 * 4;
            be->embedding_fwd(be, (float *)a->xmid16, kv->lrows, (const float *)a->x16, kv->nl,
                              words);
            xf16 = a->xmid16;
        } else {
            be->embedding_fwd(be, a->xmid, kv->lrows, a->x, kv->nl, C);
            xf = a->xmid;
        }
    }
    const lb_tensor *tn = lb_blocks_find_or_die(m, "model.norm.weight");
    const lb_tensor *th = lb_blocks_find_or_die(m, "lm_head.weight");
    const int lmh = c->num_hidden_layers - 1;
    uint16_t *ln16 = cached_ln16(m, a, lmh, LB_ROLE_LM_HEAD);
    be->rmsnorm_fwd(be, &(lb_rmsnorm_args){.out = a->ln, .rstd = a->rstd, .x = xf, .x16 = xf16,
            .w = m->params + tn->offset, .n = kv->nl, .c = C, .eps = eps, .out16 = ln16});
    lb_linear_fwd(lin, lmh, LB_ROLE_LM_HEAD,
                  lb_blocks_norm_in(m, lmh, LB_ROLE_LM_HEAD, a->ln, ln16, kv->nl, C),
                  m->params + th->offset, &m->wcache[th - m->tensors], 0, kv->logits, d.V, 0.0f);
}

// No collective (tp, ep, pp 1) and every MoE layer's experts on the device counts.
int lb_decoder_cached_host_free(lb_model *m)
{
    if (m->par.tp > 1 || m->par.ep > 1 || m->par.pp > 1) return 0;
    for (int l = 0; l < m->cfg.num_hidden_layers; l++) {
        lb_layer_w w = lb_blocks_layer_weights(m, m->params, l);
        if (lb_blocks_layer_moe(&m->cfg, l) && !lb_blocks_experts_on_device(m, l, &w)) return 0;
    }
    return 1;
}
