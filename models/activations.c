// activations.c: the decoder's activations. The activation plan decides, per layer and role
// from the contract, which activations the GEMMs take, store and keep in bf16, and where the
// routed weights are applied; the buffers are made from it: a training step's (lb_acts: each
// layer's saved activations, those shared under selective recomputation, the backward's
// scratch, the quantized operands' scratch), laid out at once so that `lowbit info` counts
// what a step holds, and a feed-forward block's, which the cached forward makes too.
#include <stdlib.h>
#include <string.h>
#include "kernels/common.h"
#include "models/blocks_internal.h"

// Some layer of a MoE model has a dense MLP.
static int has_dense(const lb_model_config *c)
{
    return !lb_blocks_moe(c) || c->first_k_dense_replace > 0;
}

float *lb_blocks_falloc(lb_backend *be, size_t n) { return be->alloc(be, n * sizeof(float)); }

// A grow-only backend buffer of n elements of size bytes (capacity *cap elements): replaced
// by a larger one when too small, its contents then lost.
static void *grow_n(lb_backend *be, void *p, size_t *cap, size_t n, size_t size)
{
    if (n <= *cap) return p;
    if (p) be->free(be, p);
    *cap = n;
    return be->alloc(be, n * size);
}
float *lb_blocks_grow(lb_backend *be, float **p, size_t *cap, size_t n)
{
    return *p = grow_n(be, *p, cap, n, sizeof **p);
}
uint16_t *lb_blocks_grow16(lb_backend *be, uint16_t **p, size_t *cap, size_t n)
{
    return *p = grow_n(be, *p, cap, n, sizeof **p);
}
double *lb_blocks_grow64(lb_backend *be, double **p, size_t *cap, size_t n)
{
    return *p = grow_n(be, *p, cap, n, sizeof **p);
}

// Elements of a bf16 copy of (rows, cols) values (to_bf16's layout: rows padded to 8).
size_t lb_blocks_n16(size_t rows, int cols) { return rows * (size_t)((cols + 7) / 8 * 8); }

// What the fprop of (layer l, role) reads of a norm kept in fp32 (ln) and, beside it or alone,
// in bf16 (ln16): the bf16 rows for a bf16 fprop or where they are all there is, else the fp32
// ones.
lb_act lb_blocks_norm_in(const lb_model *m, int l, lb_role role, const float *ln,
                         const uint16_t *ln16, int n, int c)
{
    if (ln16 && (!ln || lb_contract_site(&m->contract, l, role, LB_PASS_FPROP)->fmt ==
                            LB_FMT_BF16))
        return lb_act_bf16(ln16, n, c);
    return lb_act_f32(ln, n, c);
}

// --- the activation plan (lb_layer_plan), decided once per contract, layout and KV cache ----

// Whether role's expert GEMMs of layer l take their activations in bf16 alone, written by the
// ops that make them (lb_linear_grouped_fwd's x as a bf16 lb_act): bf16 GEMMs, which read those
// values exactly, or quantized ones (lb_linear_quantized), which quantize them. In the
// low-precision recipes that rounds an activation to bf16 before its quantization, as
// Transformer Engine's and DeepSeek-V3's bf16 activations are.
static int plan_takes16(const lb_model *m, int l, lb_role role)
{
    return lb_linear_grouped_bf16(&m->lin, l, role) || lb_linear_quantized(&m->lin, l, role);
}

// Whether the training step stores the attention's input norm only in bf16 (lb_layer_acts
// ln1_16): where the q/k/v projections are plain bf16 GEMMs in every pass of every layer of the
// stage, the fprop and the wgrads read the norm rounded to bf16 anyway, so the step's bits do
// not change; where they are quantized in every pass (lb_linear_quantized), the quantizations
// read its bf16 values (the cached forward's too, qkv_quant16), whatever the layout: under
// sequence parallelism the ranks gather the norm's rows in bf16. One decision for the stage:
// selective recomputation shares the buffer between its layers.
static int plan_ln1(const lb_model *m)
{
    for (int l = m->layer_begin; l < m->layer_end; l++)
        if (!lb_linear_plain16(&m->lin, l, LB_ROLE_ATTN_QKV) &&
            !lb_linear_quantized(&m->lin, l, LB_ROLE_ATTN_QKV))
            return 0;
    return 1;
}

// Whether the training step stores the attention output only in bf16 (lb_layer_acts att16),
// written so by the bf16 attention (lb_attention_args.out16): where the o projection is a
// plain bf16 GEMM in every pass of every layer of the stage, which reads it rounded to bf16
// anyway, or quantized in every pass, whose quantizations then read its bf16 values (and the
// cached forward rounds its output so too). The backward's D_i = dout_i.out_i then reads the
// bf16 values, as FlashAttention's does. One decision for the stage, as plan_ln1's.
static int plan_att(const lb_model *m)
{
    lb_dims d = lb_dims_of(m);
    if (!m->contract.attention_bf16 || (d.hq * d.D) % 8) return 0;   // lb_act_bf16's pitch
    for (int l = m->layer_begin; l < m->layer_end; l++)
        if (!lb_linear_plain16(&m->lin, l, LB_ROLE_ATTN_OUT) &&
            !lb_linear_quantized(&m->lin, l, LB_ROLE_ATTN_OUT))
            return 0;
    return 1;
}

// A GEMM role that reads its input rounded to bf16 or quantized in every pass.
static int reads16(const lb_model *m, int l, lb_role role)
{
    return lb_linear_plain16(&m->lin, l, role) || lb_linear_quantized(&m->lin, l, role);
}

// Whether the training step stores the feed-forward block's input norm only in bf16
// (lb_layer_acts ln2_16): where every GEMM that reads it reads bf16 in every pass of every
// layer of the stage, as plan_ln1's: the router, the experts (whose rows moe_permute makes
// from it: where they take bf16 rows, plan_takes16), the shared experts and a dense layer's
// gate/up. The router and the experts then read the bits they read before; a quantized
// dense or shared gate/up quantizes its bf16 values, as the other quantized inputs (the cached
// forward reads the same, lb_ffn_fwd's ln NULL). Under sequence parallelism the ranks gather
// it in bf16.
static int plan_ln2(const lb_model *m)
{
    lb_dims d = lb_dims_of(m);
    for (int l = m->layer_begin; l < m->layer_end; l++) {
        if (!lb_blocks_layer_moe(&m->cfg, l) || d.Fs) {
            if (!reads16(m, l, LB_ROLE_MLP_GATE_UP)) return 0;
            if (!lb_blocks_layer_moe(&m->cfg, l)) continue;
        }
        if (!reads16(m, l, LB_ROLE_ROUTER) || !plan_takes16(m, l, LB_ROLE_MOE_GATE_UP)) return 0;
    }
    return 1;
}

// Whether the residual stream is stored in bf16 (lb_layer_plan.residual): where no GEMM of
// the model is fp32 in any pass (every recipe but fp32, as a bf16 PyTorch model's or
// Megatron's without --fp32-residual-connection). Each residual add is then one fp32 add
// rounded once (add16), and the norms and their backward read the rounded rows. One decision
// for the whole model, not the stage: the pipeline's stages pass the stream on as it is.
static int plan_residual(const lb_model *m)
{
    for (int l = 0; l < m->cfg.num_hidden_layers; l++)
        for (int r = 0; r < LB_NROLES; r++)
            for (int p = 0; p < LB_NPASSES; p++)
                if (lb_contract_site(&m->contract, l, (lb_role)r, (lb_pass)p)->fmt ==
                    LB_FMT_FP32)
                    return 0;
    return 1;
}

// Whether the training step stores q and k before their norms in bf16 (lb_layer_plan.qk_in):
// the projection's outputs rounded to bf16 (lb_linear_fwd_shared's y16) where it is a plain
// bf16 GEMM in every pass of every layer of the stage, which the q/k norms and their backward
// then read (rope's src16), as a bf16 PyTorch model's norms do. Where q and k are stored in
// bf16 after RoPE too (lb_layer_plan.qk), the norms exist (a model without them keeps no q and
// k for the backward), with no attention biases (added to fp32 outputs) and heads of a
// multiple of 8 values. One decision for the stage: full recomputation shares the buffers.
static int plan_qk_in(const lb_model *m)
{
    if (!m->contract.attention_bf16 || m->kv_fp8 || !lb_blocks_qk_norm(m) ||
        m->cfg.attention_bias || m->cfg.head_dim % 8)
        return 0;
    for (int l = m->layer_begin; l < m->layer_end; l++)
        if (!lb_linear_plain16(&m->lin, l, LB_ROLE_ATTN_QKV)) return 0;
    return 1;
}

void lb_decoder_plan(const lb_model *m, lb_layer_plan *out)
{
    const int ln1 = plan_ln1(m), att = plan_att(m), ln2 = plan_ln2(m), res = plan_residual(m);
    const int qk_in = plan_qk_in(m);
    for (int l = 0; l < m->cfg.num_hidden_layers; l++) {
        lb_layer_plan *p = &out[l];
        p->residual = (uint8_t)res;
        // q and k after their norms and RoPE: where the contract's attention is bf16, which
        // rounds them to bf16 before any product, so the copy is all it reads and the step's
        // bits do not change. Not with the fp8 KV cache's straight-through quantization
        // (kv_fake_quant), which rewrites k in fp32 first.
        p->qk = m->contract.attention_bf16 && !m->kv_fp8;
        p->qk_in = (uint8_t)qk_in;
        p->ln1 = (uint8_t)ln1;
        p->qkv_quant16 = ln1 && lb_linear_quantized(&m->lin, l, LB_ROLE_ATTN_QKV);
        p->att = (uint8_t)att;
        p->ln2 = (uint8_t)ln2;
        if (!lb_blocks_layer_moe(&m->cfg, l) || lb_dims_of(m).Fs) {
            // A dense MLP (a dense layer's, or a MoE layer's shared experts): gate/up's output
            // in bf16 where gate/up is a plain bf16 GEMM (lb_linear_fwd_c16), as the experts'
            // (gate_up_out below): the SwiGLU then reads the rounded values; its output in
            // bf16 where down reads bf16 (a plain bf16 GEMM: the same bits; or quantized from
            // those values).
            p->mlp_gate_up_out = lb_linear_plain16(&m->lin, l, LB_ROLE_MLP_GATE_UP);
            p->mlp_swiglu_out = reads16(m, l, LB_ROLE_MLP_DOWN);
        }
        if (!lb_blocks_layer_moe(&m->cfg, l)) continue;
        p->expert_in = plan_takes16(m, l, LB_ROLE_MOE_GATE_UP);
        p->swiglu_out = plan_takes16(m, l, LB_ROLE_MOE_DOWN);
        // the outputs the expert GEMMs store in bf16 (lb_gemm_args.c16) for the ops that read
        // them, wherever their grouped call can (lb_linear_grouped_c16: bf16, or a quantized
        // fprop or dgrad): gate/up's gu (the SwiGLUs) and down's dh (swiglu_bwd), whose
        // elements are whole in every layout. Never the routed outputs, down's yp (the
        // combine) and gate/up's dxp (moe_permute_bwd): under etp an etp rank's yp and dxp are
        // partial sums over etp (summed by the caller in fp32), so rounding them where etp is
        // 1 alone made the recipe's numbers depend on the layout (doc/parallel.md, "Low
        // precision under parallel layouts").
        p->gate_up_out = lb_linear_grouped_c16(&m->lin, l, LB_ROLE_MOE_GATE_UP, LB_PASS_FPROP);
        p->down_dgrad = lb_linear_grouped_c16(&m->lin, l, LB_ROLE_MOE_DOWN, LB_PASS_DGRAD);
        // the gradients: bf16 GEMMs alone (a quantized backward reads fp32 gradients)
        p->gate_up_dy = lb_linear_grouped_bf16(&m->lin, l, LB_ROLE_MOE_GATE_UP);
        p->down_dy = lb_linear_grouped_bf16(&m->lin, l, LB_ROLE_MOE_DOWN);
        // The routed weights applied to the experts' SwiGLU outputs, before down
        // (lb_swiglu_args.rw), rather than to down's outputs: the same sum in real arithmetic,
        // but down's outputs (n*k, c) a layer then need not be kept for the backward, whose
        // weight gradient comes from down's dgrad instead (lb_swiglu_args.drw). Every recipe
        // but fp32, whose numbers stay those of the weights after down. (As Megatron's
        // moe_apply_probs_on_input, one GEMM later: the weighted rows are the rank's whole
        // elements in every layout.)
        p->weights_on_h = lb_contract_site(&m->contract, l, LB_ROLE_MOE_DOWN,
                                           LB_PASS_FPROP)->fmt != LB_FMT_FP32;
    }
}

int lb_blocks_qkv_quantized16(const lb_model *m, int l) { return m->plan[l].qkv_quant16; }

int lb_blocks_qk_in16(const lb_model *m) { return m->plan[0].qk_in; }

int lb_blocks_takes16(const lb_model *m, int l, lb_role role)
{
    return role == LB_ROLE_MOE_GATE_UP ? m->plan[l].expert_in : m->plan[l].swiglu_out;
}

int lb_blocks_grads16(const lb_model *m, int l, lb_role role)
{
    return role == LB_ROLE_MOE_GATE_UP ? m->plan[l].gate_up_dy : m->plan[l].down_dy;
}

int lb_blocks_out16(const lb_model *m, int l, lb_role role, lb_pass pass)
{
    if (role == LB_ROLE_MOE_GATE_UP && pass == LB_PASS_FPROP) return m->plan[l].gate_up_out;
    if (role == LB_ROLE_MOE_DOWN && pass == LB_PASS_DGRAD) return m->plan[l].down_dgrad;
    lb_die("lb_blocks_out16: the plan has no bf16 output of %s's pass %d", lb_role_name(role),
           (int)pass);
}

// The model-wide ones, the same in every layer's plan (layer 0's).
int lb_blocks_qk16(const lb_model *m) { return m->plan[0].qk; }

int lb_blocks_res16(const lb_model *m) { return m->plan[0].residual; }

static int ln1_16(const lb_model *m) { return m->plan[0].ln1; }

int lb_blocks_att16(const lb_model *m) { return m->plan[0].att; }

int lb_blocks_ln2_16(const lb_model *m) { return m->plan[0].ln2; }

int lb_blocks_mlp16(const lb_model *m, int l, int h)
{
    return h ? m->plan[l].mlp_swiglu_out : m->plan[l].mlp_gate_up_out;
}

// lb_blocks_mlp16 over this stage's dense layers (dense 1) or its MoE layers' shared experts
// (dense 0), as takes16_layers.
static int mlp16_layers(const lb_model *m, int h, int every, int dense)
{
    for (int l = m->layer_begin; l < m->layer_end; l++)
        if (lb_blocks_layer_moe(&m->cfg, l) != dense && lb_blocks_mlp16(m, l, h) != every)
            return !every;
    return every;
}

int lb_blocks_weights_on_h(const lb_model *m, int l) { return m->plan[l].weights_on_h; }

// lb_blocks_grads16 over this stage's layers, as takes16_layers.
static int grads16_layers(const lb_model *m, lb_role role, int every)
{
    for (int l = m->layer_begin; l < m->layer_end; l++)
        if (lb_blocks_grads16(m, l, role) != every) return !every;
    return every;
}

// Over this stage's layers: 1 if some layer's role takes them (every 0), or if all do (1).
static int takes16_layers(const lb_model *m, lb_role role, int every)
{
    for (int l = m->layer_begin; l < m->layer_end; l++)
        if (lb_blocks_takes16(m, l, role) != every) return !every;
    return every;
}

// lb_blocks_out16 over this stage's layers, as takes16_layers.
static int out16_layers(const lb_model *m, lb_role role, lb_pass pass, int every)
{
    for (int l = m->layer_begin; l < m->layer_end; l++)
        if (lb_blocks_out16(m, l, role, pass) != every) return !every;
    return every;
}

// lb_blocks_weights_on_h over this stage's MoE layers, as takes16_layers.
static int weights_on_h_layers(const lb_model *m, int every)
{
    for (int l = m->layer_begin; l < m->layer_end; l++)
        if (lb_blocks_layer_moe(&m->cfg, l) && lb_blocks_weights_on_h(m, l) != every)
            return !every;
    return every;
}

// --- activations ----------------------------------------------------------------------------------

void lb_blocks_ffn_create(lb_model *m, lb_ffn_acts *f, int n)
{
    lb_backend *be = m->be;
    lb_dims d = lb_dims_of(m);
    size_t rows = (size_t)n;
    if (lb_blocks_moe(&m->cfg)) {
        rows = (size_t)n * d.K;
        f->rlogits = lb_blocks_falloc(be, (size_t)n * d.E);
        f->probs = lb_blocks_falloc(be, (size_t)n * d.E);
        f->weight = lb_blocks_falloc(be, (size_t)n * d.K);
        f->idx = be->alloc(be, (size_t)n * d.K * sizeof(int32_t));
        f->row = be->alloc(be, (size_t)n * d.K * sizeof(int32_t));
        f->counts = lb_calloc(d.E, sizeof(int));
        f->counts_dev = be->alloc(be, (size_t)d.E * sizeof(int));
        f->aux_grad = lb_blocks_falloc(be, d.E);
        // down's routed outputs stay fp32 (lb_blocks_out16), kept where the weights follow down
        if (!weights_on_h_layers(m, 1)) lb_blocks_grow(be, &f->yp, &f->cap_yp, rows * d.C);
        if (weights_on_h_layers(m, 0)) lb_blocks_grow(be, &f->wp, &f->cap_wp, rows);
        if (out16_layers(m, LB_ROLE_MOE_GATE_UP, LB_PASS_FPROP, 0))
            lb_blocks_grow16(be, &f->gu16, &f->cap_gu16, lb_blocks_n16(rows, 2 * d.F));
        if (takes16_layers(m, LB_ROLE_MOE_DOWN, 0))   // a shared one is big enough
            lb_blocks_grow16(be, &f->h16, &f->cap_h16, lb_blocks_n16(rows, d.F));
    }
    const int moe = lb_blocks_moe(&m->cfg);
    if (moe ? !out16_layers(m, LB_ROLE_MOE_GATE_UP, LB_PASS_FPROP, 1)
            : !mlp16_layers(m, 0, 1, 1))
        lb_blocks_grow(be, &f->gu, &f->cap_gu, rows * 2 * d.F);
    if (moe ? !takes16_layers(m, LB_ROLE_MOE_DOWN, 1) : !mlp16_layers(m, 1, 1, 1))
        lb_blocks_grow(be, &f->h, &f->cap_h, rows * d.F);   // a shared h is big enough already
    if (!moe && mlp16_layers(m, 0, 0, 1))
        lb_blocks_grow16(be, &f->gu16, &f->cap_gu16, lb_blocks_n16(rows, 2 * d.F));
    if (!moe && mlp16_layers(m, 1, 0, 1))   // a shared one is big enough
        lb_blocks_grow16(be, &f->h16, &f->cap_h16, lb_blocks_n16(rows, d.F));
    if (moe && has_dense(&m->cfg)) {   // the dense leading layers' (grow-only)
        if (!mlp16_layers(m, 0, 1, 1))
            lb_blocks_grow(be, &f->gu, &f->cap_gu, (size_t)n * 2 * d.Fd);
        if (!mlp16_layers(m, 1, 1, 1)) lb_blocks_grow(be, &f->h, &f->cap_h, (size_t)n * d.Fd);
        if (mlp16_layers(m, 0, 0, 1))
            lb_blocks_grow16(be, &f->gu16, &f->cap_gu16, lb_blocks_n16((size_t)n, 2 * d.Fd));
        if (mlp16_layers(m, 1, 0, 1))
            lb_blocks_grow16(be, &f->h16, &f->cap_h16, lb_blocks_n16((size_t)n, d.Fd));
    }
    if (d.Fs) {   // the shared experts' MLP, kept by every layer (not recomputed)
        if (!mlp16_layers(m, 0, 1, 0)) f->sgu = lb_blocks_falloc(be, (size_t)n * 2 * d.Fs);
        if (!mlp16_layers(m, 1, 1, 0)) f->sh = lb_blocks_falloc(be, (size_t)n * d.Fs);
        if (mlp16_layers(m, 0, 0, 0))
            f->sgu16 = be->alloc(be, lb_blocks_n16((size_t)n, 2 * d.Fs) * sizeof(uint16_t));
        if (mlp16_layers(m, 1, 0, 0))
            f->sh16 = be->alloc(be, lb_blocks_n16((size_t)n, d.Fs) * sizeof(uint16_t));
    }
}

void lb_blocks_ffn_free(lb_model *m, lb_ffn_acts *f)
{
    lb_backend *be = m->be;
    void *bufs[] = {f->rlogits, f->probs, f->weight, f->idx, f->row, f->aux_grad, f->yp,
                    f->xe, f->xe16, f->gu, f->h, f->h16, f->gu16, f->wp, f->wpe,
                    f->counts_dev, f->sgu, f->sh, f->sgu16, f->sh16};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) be->free(be, bufs[i]);
    free(f->counts);
    lb_ep_route_free(&f->route, be);
}

// The MoE scratch (rows, rows16; lb_ffn_bwd's dgu, dh or their bf16 forms, shared by the
// layers) for `rows` routed rows (this rank's tokens'), made with the activations so that
// `lowbit info` counts what a step holds. The experts' rows only where they are known (ep 1,
// the experts not split into parts); elsewhere lb_ffn_fwd and lb_ffn_bwd grow them on first
// use, as they do here past these sizes.
static void scratch_reserve(lb_model *m, lb_moe_scratch *s, size_t rows)
{
    lb_backend *be = m->be;
    lb_dims d = lb_dims_of(m);
    // rows: xp and dyp in fp32, or (lb_blocks_weights_on_h) down's outputs in the forward and
    // (x16) gate/up's dgrad in the backward: some of them in every MoE model
    lb_blocks_grow(be, &s->rows, &s->cap_rows, rows * d.C);
    if (weights_on_h_layers(m, 0)) {
        lb_blocks_grow64(be, &s->dwp, &s->cap_dwp, rows);
        lb_blocks_grow(be, &s->dw32, &s->cap_dw32, rows);
    }
    if (d.ep != 1 || d.parts != 1) return;
    if (takes16_layers(m, LB_ROLE_MOE_DOWN, 0) || takes16_layers(m, LB_ROLE_MOE_GATE_UP, 0))
        lb_blocks_grow16(be, &s->rows16, &s->cap_rows16, lb_blocks_n16(rows, d.C));
    if (grads16_layers(m, LB_ROLE_MOE_GATE_UP, 0))
        lb_blocks_grow16(be, &s->dgu16, &s->cap_dgu16, lb_blocks_n16(rows, 2 * d.F));
    if (!grads16_layers(m, LB_ROLE_MOE_GATE_UP, 1))
        lb_blocks_grow(be, &s->dgu, &s->cap_dgu, rows * 2 * d.F);
    if (out16_layers(m, LB_ROLE_MOE_DOWN, LB_PASS_DGRAD, 0))
        lb_blocks_grow16(be, &s->dh16, &s->cap_dh16, lb_blocks_n16(rows, d.F));
    if (!out16_layers(m, LB_ROLE_MOE_DOWN, LB_PASS_DGRAD, 1))
        lb_blocks_grow(be, &s->dh, &s->cap_dh, rows * d.F);
}

// The quantized operands' scratch (m->lin's) every quantized GEMM of this stage takes in a
// step of n rows (ns of them this rank's), laid out once with the activations: the largest
// request of each of its buffers, routing balanced (lb_linear_qscratch_reserve).
static void qscratch_reserve(lb_model *m, int n, int ns)
{
    lb_linear *lin = &m->lin;
    lb_dims d = lb_dims_of(m);
    for (int l = m->layer_begin; l < m->layer_end; l++) {
        lb_linear_qscratch_reserve(lin, l, LB_ROLE_ATTN_QKV, 1, n, d.hq * d.D, d.C);
        lb_linear_qscratch_reserve(lin, l, LB_ROLE_ATTN_OUT, 1, n, d.C, d.hq * d.D);
        if (!lb_blocks_layer_moe(&m->cfg, l)) {
            lb_linear_qscratch_reserve(lin, l, LB_ROLE_MLP_GATE_UP, 1, n, 2 * d.Fd, d.C);
            lb_linear_qscratch_reserve(lin, l, LB_ROLE_MLP_DOWN, 1, n, d.C, d.Fd);
            continue;
        }
        int o, rows = lb_blocks_part_rows(&d, n, &o) * d.K;
        lb_linear_qscratch_reserve(lin, l, LB_ROLE_ROUTER, 1, n, d.E, d.C);
        lb_linear_qscratch_reserve(lin, l, LB_ROLE_MOE_GATE_UP, d.El, rows, 2 * d.F, d.C);
        lb_linear_qscratch_reserve(lin, l, LB_ROLE_MOE_DOWN, d.El, rows, d.C, d.F);
        if (d.Fs) {
            lb_linear_qscratch_reserve(lin, l, LB_ROLE_MLP_GATE_UP, 1, n, 2 * d.Fs, d.C);
            lb_linear_qscratch_reserve(lin, l, LB_ROLE_MLP_DOWN, 1, n, d.C, d.Fs);
        }
    }
    if (m->last_stage)
        lb_linear_qscratch_reserve(lin, m->cfg.num_hidden_layers - 1, LB_ROLE_LM_HEAD, 1,
                                   lb_model_ce_rows(m, ns), d.V, d.C);
}

void lb_blocks_scratch_free(lb_backend *be, lb_moe_scratch *s)
{
    void *bufs[] = {s->xs, s->ye, s->dye, s->dxe, s->dgu, s->dh, s->rows, s->rows16, s->dgu16,
                    s->dh16, s->dwp, s->dwpe, s->dw32};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) be->free(be, bufs[i]);
}

// What selective recomputation recomputes (doc/architecture.md, Model: norms, SwiGLU / expert
// activation, core attention): the norm outputs and their rstd, q and k after norm and RoPE, the attention
// output and its lse (and the SwiGLU output, lb_ffn_acts.h).
static void recomputable_create(lb_model *m, lb_layer_acts *L, int n, int ns)
{
    lb_backend *be = m->be;
    lb_dims d = lb_dims_of(m);
    size_t C = d.C, D = d.D, hq = d.hq, hkv = d.hkv;
    if (ln1_16(m)) L->ln1_16 = be->alloc(be, lb_blocks_n16(n, (int)C) * sizeof(uint16_t));
    else L->ln1 = lb_blocks_falloc(be, (size_t)n * C);
    L->rstd1 = lb_blocks_falloc(be, ns);
    L->qrstd = lb_blocks_falloc(be, n * hq);
    L->krstd = lb_blocks_falloc(be, n * hkv);
    if (lb_blocks_qk16(m)) {
        L->qr16 = be->alloc(be, n * hq * D * sizeof(uint16_t));
        L->kr16 = be->alloc(be, n * hkv * D * sizeof(uint16_t));
    } else {
        L->qr = lb_blocks_falloc(be, n * hq * D);
        L->kr = lb_blocks_falloc(be, n * hkv * D);
    }
    if (lb_blocks_att16(m)) L->att16 = be->alloc(be, n * hq * D * sizeof(uint16_t));
    else L->att = lb_blocks_falloc(be, n * hq * D);
    L->lse = lb_blocks_falloc(be, n * hq);
    if (lb_blocks_ln2_16(m)) L->ln2_16 = be->alloc(be, lb_blocks_n16(n, (int)C) * sizeof(uint16_t));
    else L->ln2 = lb_blocks_falloc(be, n * C);
    L->rstd2 = lb_blocks_falloc(be, ns);
}

static void recomputable_free(lb_model *m, lb_layer_acts *L)
{
    lb_backend *be = m->be;
    void *bufs[] = {L->ln1, L->rstd1, L->qrstd, L->qr, L->krstd, L->kr, L->att, L->lse, L->ln2,
                    L->rstd2, L->qr16, L->kr16, L->ln1_16, L->att16, L->ln2_16};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) be->free(be, bufs[i]);
}

// One set of those serves every layer under selective recomputation (a->sel); the expert
// activation's rows vary under ep, so its buffer holds the most a rank can receive.
static void shared_create(lb_model *m, lb_layer_acts *S, int n, int ns)
{
    lb_dims d = lb_dims_of(m);
    size_t rows = lb_blocks_moe(&m->cfg) ? (size_t)d.ep * n * d.K : (size_t)n;
    recomputable_create(m, S, n, ns);
    const int moe = lb_blocks_moe(&m->cfg);
    if (moe ? !takes16_layers(m, LB_ROLE_MOE_DOWN, 1) : !mlp16_layers(m, 1, 1, 1))
        lb_blocks_grow(m->be, &S->f.h, &S->f.cap_h, rows * d.F);
    if (moe && has_dense(&m->cfg) && !mlp16_layers(m, 1, 1, 1))   // the dense layers' h too
        lb_blocks_grow(m->be, &S->f.h, &S->f.cap_h, (size_t)n * d.Fd);
    // h's bf16 copy is recomputed in h's place where some layer's GEMMs take it
    if (moe ? takes16_layers(m, LB_ROLE_MOE_DOWN, 0) : mlp16_layers(m, 1, 0, 1))
        lb_blocks_grow16(m->be, &S->f.h16, &S->f.cap_h16, lb_blocks_n16(rows, d.F));
    if (moe && has_dense(&m->cfg) && mlp16_layers(m, 1, 0, 1))   // the dense layers' h16 too
        lb_blocks_grow16(m->be, &S->f.h16, &S->f.cap_h16, lb_blocks_n16((size_t)n, d.Fd));
}

static void shared_free(lb_model *m, lb_layer_acts *S)
{
    recomputable_free(m, S);
    if (S->f.h) m->be->free(m->be, S->f.h);
    if (S->f.h16) m->be->free(m->be, S->f.h16);
}

// A layer's saved activations (all but its input x) for n rows, ns of them this rank's; with
// S, the recomputed ones are S's.
static void layer_create(lb_model *m, lb_layer_acts *L, int n, int ns, const lb_layer_acts *S)
{
    lb_backend *be = m->be;
    lb_dims d = lb_dims_of(m);
    size_t C = d.C, D = d.D, hq = d.hq, hkv = d.hkv;
    if (lb_blocks_qk_in16(m)) {   // (n, hq*d) and (n, hkv*d) in bf16: d a multiple of 8
        L->q16 = be->alloc(be, n * hq * D * sizeof(uint16_t));
        L->k16 = be->alloc(be, n * hkv * D * sizeof(uint16_t));
    } else {
        L->q = lb_blocks_falloc(be, n * hq * D);
        L->k = lb_blocks_falloc(be, n * hkv * D);
    }
    L->v = lb_blocks_falloc(be, n * hkv * D);
    if (lb_blocks_res16(m)) L->xmid16 = be->alloc(be, lb_blocks_n16(ns, (int)C) * sizeof(uint16_t));
    else L->xmid = lb_blocks_falloc(be, ns * C);
    if (S) {
        L->shared = 1;
        L->ln1 = S->ln1, L->rstd1 = S->rstd1, L->qrstd = S->qrstd, L->qr = S->qr;
        L->krstd = S->krstd, L->kr = S->kr, L->att = S->att, L->lse = S->lse;
        L->qr16 = S->qr16, L->kr16 = S->kr16, L->ln1_16 = S->ln1_16, L->att16 = S->att16;
        L->ln2 = S->ln2, L->rstd2 = S->rstd2, L->ln2_16 = S->ln2_16;
        L->f.h = S->f.h, L->f.cap_h = S->f.cap_h;   // big enough: grow never replaces it
        L->f.h16 = S->f.h16, L->f.cap_h16 = S->f.cap_h16;
    } else {
        recomputable_create(m, L, n, ns);
    }
    lb_blocks_ffn_create(m, &L->f, n);
}

static void layer_free(lb_model *m, lb_layer_acts *L)
{
    lb_backend *be = m->be;
    void *own[] = {L->q, L->k, L->q16, L->k16, L->v, L->xmid, L->xmid16};
    for (size_t i = 0; i < sizeof own / sizeof own[0]; i++)
        if (own[i]) be->free(be, own[i]);
    if (L->shared) L->f.h = NULL, L->f.h16 = NULL;   // sel's
    else recomputable_free(m, L);
    lb_blocks_ffn_free(m, &L->f);
}

// The RoPE frequencies of the configuration's rope_type in backend memory (D/2 doubles), or
// NULL for plain RoPE (the op's own theta^(-2i/D)).
double *lb_blocks_rope_freq_create(lb_model *m)
{
    const lb_model_config *c = &m->cfg;
    if (strcmp(c->rope_type, "llama3") != 0) return NULL;
    int half = c->head_dim / 2;
    double *host = lb_malloc((size_t)half * sizeof(double));
    lb_rope_inv_freq_llama3(host, c->head_dim, c->rope_theta, c->rope_factor,
                            c->rope_low_freq_factor, c->rope_high_freq_factor,
                            c->rope_original_max_position_embeddings);
    double *dev = m->be->alloc(m->be, (size_t)half * sizeof(double));
    m->be->upload(m->be, dev, host, (size_t)half * sizeof(double));
    free(host);
    return dev;
}

// n ones in backend memory where the attention has biases (their GEMMs), else NULL.
float *lb_blocks_ones_create(lb_model *m, size_t n)
{
    if (!m->cfg.attention_bias) return NULL;
    float *host = lb_malloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) host[i] = 1.0f;
    float *dev = lb_blocks_falloc(m->be, n ? n : 1);
    m->be->upload(m->be, dev, host, n * sizeof(float));
    free(host);
    return dev;
}

void *lb_decoder_acts_create(lb_model *m, int b, int t)
{
    lb_backend *be = m->be;
    lb_dims d = lb_dims_of(m);
    lb_acts *a = lb_calloc(1, sizeof *a);
    size_t n = (size_t)b * t, ns = d.sp ? n / d.tp : n, C = d.C, D = d.D, hq = d.hq,
           hkv = d.hkv, F = d.F, E = d.E, K = d.K;
    int moe = lb_blocks_moe(&m->cfg);
    a->b = b;
    a->t = t;
    a->n = (int)n;
    a->ns = (int)ns;
    a->nl = m->layer_end - m->layer_begin;
    a->l = lb_calloc(a->nl + 1, sizeof *a->l);
    a->recompute = m->recompute;
    if (a->recompute == LB_RECOMPUTE_SELECTIVE) shared_create(m, &a->sel, (int)n, (int)ns);
    for (int l = 0; l <= a->nl; l++) {
        if (lb_blocks_res16(m))
            a->l[l].x16 = be->alloc(be, lb_blocks_n16(ns, (int)C) * sizeof(uint16_t));
        else a->l[l].x = lb_blocks_falloc(be, ns * C);
        if (l < a->nl && a->recompute != LB_RECOMPUTE_FULL)
            layer_create(m, &a->l[l], (int)n, (int)ns,
                         a->recompute == LB_RECOMPUTE_SELECTIVE ? &a->sel : NULL);
    }
    if (a->recompute == LB_RECOMPUTE_FULL) layer_create(m, &a->work, (int)n, (int)ns, NULL);
    a->lnf = lb_blocks_falloc(be, ns * C);
    a->rstdf = lb_blocks_falloc(be, ns);
    a->loss = lb_blocks_falloc(be, ns);
    a->ce_stats = be->alloc(be, (size_t)ns * 2 * sizeof(double));
    a->pos = be->alloc(be, n * sizeof(int32_t));
    int32_t *pos = lb_malloc(n * sizeof(int32_t));
    for (size_t i = 0; i < n; i++) pos[i] = (int32_t)(i % (size_t)t);   // each row starts at 0
    be->upload(be, a->pos, pos, n * sizeof(int32_t));
    free(pos);
    a->rope_freq = lb_blocks_rope_freq_create(m);
    a->ones = lb_blocks_ones_create(m, n);
    if (d.tp > 1) a->part = lb_blocks_falloc(be, n * C);
    if (lb_blocks_res16(m)) a->branch = lb_blocks_falloc(be, ns * C);
    a->dres = lb_blocks_falloc(be, ns * C);
    a->dfull = d.sp ? lb_blocks_falloc(be, n * C) : a->dres;
    a->dln = lb_blocks_falloc(be, n * C);
    a->dlns = d.sp ? lb_blocks_falloc(be, ns * C) : a->dln;
    a->dq = lb_blocks_falloc(be, n * hq * D);
    a->dk = lb_blocks_falloc(be, n * hkv * D);
    a->dv = lb_blocks_falloc(be, n * hkv * D);
    a->datt = lb_blocks_falloc(be, n * hq * D);
    a->dqr = lb_blocks_falloc(be, n * hq * D);
    a->dkr = lb_blocks_falloc(be, n * hkv * D);
    if (moe) {
        // gate/up's dgrad: the scratch's rows where the layer reads xp16 (lb_ffn_bwd)
        if (d.ep > 1 || !takes16_layers(m, LB_ROLE_MOE_GATE_UP, 1))
            a->dxp = lb_blocks_falloc(be, n * K * C);
        a->drlogits = lb_blocks_falloc(be, n * E);
        a->dweight = lb_blocks_falloc(be, n * K);
        a->daux = lb_blocks_falloc(be, E);
        scratch_reserve(m, &a->ms, n * K);
    }
    qscratch_reserve(m, (int)n, (int)ns);
    // dense MLPs' backward scratch: every layer of a dense model, a MoE model's dense layers and
    // its shared experts
    size_t fw = moe ? (size_t)(has_dense(&m->cfg) ? d.Fd : 0) : F;
    if ((size_t)d.Fs > fw) fw = d.Fs;
    if (fw) {
        a->dgu = lb_blocks_falloc(be, n * 2 * fw);
        a->dh = lb_blocks_falloc(be, n * fw);
    }
    a->host_loss = lb_malloc(ns * sizeof(float));
    a->host_targets = lb_malloc(ns * sizeof(int32_t));
    return a;
}

void lb_decoder_acts_free(lb_model *m, void *p)
{
    lb_acts *a = p;
    lb_backend *be = m->be;
    for (int l = 0; l <= a->nl; l++) {
        be->free(be, a->l[l].x ? (void *)a->l[l].x : (void *)a->l[l].x16);
        if (l < a->nl && a->recompute != LB_RECOMPUTE_FULL) layer_free(m, &a->l[l]);
    }
    if (a->recompute == LB_RECOMPUTE_FULL) layer_free(m, &a->work);
    if (a->recompute == LB_RECOMPUTE_SELECTIVE) shared_free(m, &a->sel);
    free(a->l);
    void *bufs[] = {a->lnf, a->rstdf, a->loss, a->ce_stats, a->pos, a->rope_freq, a->ones, a->part,
                    a->branch, a->dres, a->dln,
                    a->dq, a->dk, a->dv, a->datt, a->dqr, a->dkr, a->dgu, a->dh, a->dxp,
                    a->drlogits, a->dweight, a->daux};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) be->free(be, bufs[i]);
    if (a->dfull != a->dres) be->free(be, a->dfull);
    if (a->dlns != a->dln) be->free(be, a->dlns);
    lb_blocks_scratch_free(be, &a->ms);
    free(a->host_loss);
    free(a->host_targets);
    free(a);
}

// The stage's input and output hidden states as the pipeline's messages: fp32 rows, or bf16
// rows (lb_layer_plan.residual) as pairs of them in 32-bit words (lb_model_stage_floats).
static float *stage_rows(const lb_layer_acts *L) { return L->x ? L->x : (float *)L->x16; }
float *lb_decoder_stage_input(lb_model *m) { return stage_rows(&((lb_acts *)m->acts)->l[0]); }
float *lb_decoder_stage_output(lb_model *m)
{
    lb_acts *a = m->acts;
    return stage_rows(&a->l[a->nl]);
}
float *lb_decoder_stage_grad(lb_model *m) { return ((lb_acts *)m->acts)->dres; }
