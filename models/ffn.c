// ffn.c: the feed-forward blocks, shared by the training and the cached forward: a dense
// SwiGLU MLP, or a top-k routed SwiGLU mixture of experts (the router, the token dispatcher
// under expert parallelism, the experts' grouped GEMMs, the shared experts where there are
// some), forward and backward; the backward also counts the experts' loads and the MoE health
// statistics.
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "kernels/common.h"
#include "models/blocks_internal.h"

// Whether the cached forward's experts of MoE layer l run from the counts in backend memory
// (gemm_experts), so the host never waits for them.
int lb_blocks_experts_on_device(lb_model *m, int l, const lb_layer_w *w)
{
    return m->par.ep == 1 && lb_linear_experts_ok(&m->lin, l, LB_ROLE_MOE_GATE_UP, w->cgu) &&
           lb_linear_experts_ok(&m->lin, l, LB_ROLE_MOE_DOWN, w->cdown);
}

// A SwiGLU MLP (a dense layer's, or the shared experts') on x (n, c): gu (n, 2f) = x Wgu^T,
// h (n, f) = swiglu(gu), out = h Wdown^T + beta out. gu and h in bf16 (gu16, h16) where the
// plan says (lb_blocks_mlp16: both roles' readers read bf16), else fp32.
static void mlp_fwd(lb_model *m, int l, const float *wgu, const lb_wcache *cgu,
                    const float *wdown, const lb_wcache *cdown, lb_act x, float *gu,
                    uint16_t *gu16, float *h, uint16_t *h16, int f, float *out, float beta)
{
    lb_linear *lin = &m->lin;
    const int n = x.rows, c = lb_dims_of(m).C;
    if (gu16) lb_linear_fwd_c16(lin, l, LB_ROLE_MLP_GATE_UP, x, wgu, cgu, gu16, 2 * f);
    else lb_linear_fwd(lin, l, LB_ROLE_MLP_GATE_UP, x, wgu, cgu, 0, gu, 2 * f, 0.0f);
    m->be->swiglu_fwd(m->be, &(lb_swiglu_args){.out = h16 ? NULL : h, .out16 = h16,
            .gu = gu16 ? NULL : gu, .gu16 = gu16, .n = n, .f = f});
    lb_linear_fwd(lin, l, LB_ROLE_MLP_DOWN, lb_act_of(h, h16, n, f), wdown, cdown, 0, out, c,
                  beta);
}

// Its backward from dout (n, c): dx = dgu Wgu + dx_beta dx, the weights' gradients
// accumulated; dgu (n, 2f), dh (n, f) scratch. gu, h as the forward stored them.
static void mlp_bwd(lb_model *m, int l, const float *wgu, const lb_wcache *cgu,
                    const float *wdown, const lb_wcache *cdown, float *dwgu, float *dwdown,
                    lb_act x, const float *gu, const uint16_t *gu16, const float *h,
                    const uint16_t *h16, int f, const float *dout, float *dx, float dx_beta,
                    float *dgu, float *dh)
{
    lb_linear *lin = &m->lin;
    const int n = x.rows, c = lb_dims_of(m).C;
    lb_linear_bwd(lin, l, LB_ROLE_MLP_DOWN, lb_act_of(h, h16, n, f), wdown, cdown, 0, dout, dh,
                  0.0f, dwdown, lb_model_grad_beta(m, dwdown), c);
    m->be->swiglu_bwd(m->be, &(lb_swiglu_args){.dgu = dgu, .dout = dh, .gu = gu16 ? NULL : gu,
            .gu16 = gu16, .n = n, .f = f});
    lb_linear_bwd(lin, l, LB_ROLE_MLP_GATE_UP, x, wgu, cgu, 0, dgu, dx, dx_beta, dwgu,
                  lb_model_grad_beta(m, dwgu), 2 * f);
}

// out (n, c) = this rank's share of the block on ln (n, c): the caller sums it over tp. Returns
// the layer's load-balancing loss (0 for dense blocks or without want_aux). cached: the cached
// forward, which no backward follows, so that under ep 1 with bf16 expert GEMMs the rows per
// expert need not come to the host (moe_plan's device counts, gemm_experts): the host queues
// the whole layer without waiting, and the bits are the same.
double lb_ffn_fwd(lb_model *m, int l, const lb_layer_w *w, lb_ffn_acts *f, lb_moe_scratch *s,
                  const float *ln, const uint16_t *ln16, int n, float *out, int want_aux,
                  int cached)
{
    const lb_model_config *c = &m->cfg;
    lb_backend *be = m->be;
    lb_linear *lin = &m->lin;
    lb_dims d = lb_dims_of(m);
    if (!lb_blocks_layer_moe(c, l)) {
        // a dense layer of a MoE model routes nothing: zeros
        if (m->route_log && lb_blocks_moe(c))
            be->zero(be, lb_model_route_stage(m, n) + (size_t)(l - m->layer_begin) * n * d.K,
                     (size_t)n * d.K * sizeof(int32_t));
        // gate/up's and the SwiGLU's outputs in bf16 where the plan says (lb_blocks_mlp16)
        const int g16 = lb_blocks_mlp16(m, l, 0), h16 = lb_blocks_mlp16(m, l, 1);
        mlp_fwd(m, l, w->gu, w->cgu, w->down, w->cdown,
                lb_blocks_norm_in(m, l, LB_ROLE_MLP_GATE_UP, ln, ln16, n, d.C),
                g16 ? NULL : lb_blocks_grow(be, &f->gu, &f->cap_gu, (size_t)n * 2 * d.Fd),
                g16 ? lb_blocks_grow16(be, &f->gu16, &f->cap_gu16,
                                       lb_blocks_n16((size_t)n, 2 * d.Fd))
                    : NULL,
                h16 ? NULL : lb_blocks_grow(be, &f->h, &f->cap_h, (size_t)n * d.Fd),
                h16 ? lb_blocks_grow16(be, &f->h16, &f->cap_h16, lb_blocks_n16((size_t)n, d.Fd))
                    : NULL,
                d.Fd, out, 0.0f);
        return 0.0;
    }
    lb_linear_fwd(lin, l, LB_ROLE_ROUTER, lb_blocks_norm_in(m, l, LB_ROLE_ROUTER, ln, ln16, n, d.C),
                  w->router, w->crouter, 0, f->rlogits, d.E, 0.0f);
    if (lb_blocks_sigmoid_router(c))   // probs holds the sigmoid scores
        be->router_sigmoid_fwd(be, &(lb_router_sigmoid_args){.n = n, .e = d.E, .k = d.K,
                .n_group = c->n_group, .topk_group = c->topk_group, .renorm = c->norm_topk_prob,
                .scale = (float)c->routed_scaling_factor, .logits = f->rlogits, .bias = w->ebias,
                .scores = f->probs, .idx = f->idx, .weight = f->weight});
    else
        be->router_topk_fwd(be, &(lb_router_args){.probs = f->probs, .idx = f->idx,
                .weight = f->weight, .logits = f->rlogits, .n = n, .e = d.E, .k = d.K,
                .renorm = c->norm_topk_prob});
    if (m->route_log)
        be->copy(be, lb_model_route_stage(m, n) + (size_t)(l - m->layer_begin) * n * d.K, f->idx,
                 (size_t)n * d.K * sizeof(int32_t));
    float aux = 0.0f;   // the sigmoid router has no load-balancing loss
    if (want_aux && !lb_blocks_sigmoid_router(c))
        be->moe_aux_loss(be, &aux, f->aux_grad, f->probs, f->idx, n, d.E, d.K);
    // This rank's part of the rows goes to the experts (all of them when etp = tp). The others'
    // rows of `out` stay zero, so the caller's sum over tp assembles every part.
    int o, np = lb_blocks_part_rows(&d, n, &o);
    const int x16 = lb_blocks_takes16(m, l, LB_ROLE_MOE_GATE_UP);
    const int down16 = lb_blocks_takes16(m, l, LB_ROLE_MOE_DOWN);
    // the rows the experts take: from ln's bf16 form where they take bf16 rows (the same
    // bits as rounding ln's, half the bytes read), else ln itself
    const lb_act lna = ln16 && (x16 || !ln) ? lb_act_bf16(ln16, n, d.C) : lb_act_f32(ln, n, d.C);
    uint16_t *xp16 = x16 ? lb_blocks_grow16(be, &s->rows16, &s->cap_rows16,
                                            lb_blocks_n16((size_t)n * d.K, d.C))
                         : NULL;
    float *xp = x16 ? NULL : lb_blocks_grow(be, &s->rows, &s->cap_rows, (size_t)n * d.K * d.C);
    // bf16 experts read the bf16 copies of x and h (x16, down16), quantized ones fp32 x and h
    const int dev = cached && lb_blocks_experts_on_device(m, l, w);
    const int wh = lb_blocks_weights_on_h(m, l);
    // the rows' weights
    float *wr = wh ? lb_blocks_grow(be, &f->wp, &f->cap_wp, (size_t)n * d.K) : NULL;
    if (np) {
        be->moe_plan(be, f->row, dev ? NULL : f->counts, dev ? f->counts_dev : NULL,
                     f->idx + (size_t)o * d.K, np, d.E, d.K);
        be->moe_permute(be, xp, xp16, lb_act_rows(lna, (size_t)o, np), f->row, d.K);
        if (wh)   // slot r's weight to its row, row[r]: a permutation of np*k rows of one
            be->moe_permute(be, wr, NULL, lb_act_f32(f->weight + (size_t)o * d.K, np * d.K, 1),
                            f->row, 1);
    } else {
        memset(f->counts, 0, (size_t)d.E * sizeof *f->counts);
        if (dev) be->zero(be, f->counts_dev, (size_t)d.E * sizeof(int));
    }
    // the dispatcher: this rank's experts get their rows from every ep rank (x16: ep 1)
    lb_comm *ep = m->par.ep_comm;
    if (!dev) lb_ep_route_plan(&f->route, ep, be, f->counts, d.E);
    size_t nr = dev ? (size_t)np * d.K : (size_t)f->route.nrecv;
    size_t big = nr > (size_t)np * d.K ? nr : (size_t)np * d.K;
    // gate/up's outputs in bf16 where their readers take it (lb_blocks_out16); down's routed
    // ones in fp32, scratch in xp's place (read by gate/up already) where the weights are on h
    const int g16 = lb_blocks_out16(m, l, LB_ROLE_MOE_GATE_UP, LB_PASS_FPROP);
    float *yp = wh ? lb_blocks_grow(be, &s->rows, &s->cap_rows, (size_t)n * d.K * d.C)
                   : lb_blocks_grow(be, &f->yp, &f->cap_yp, (size_t)n * d.K * d.C);
    float *xe = xp, *ye = yp;
    uint16_t *xe16 = xp16;
    if (d.ep > 1) {
        ye = lb_blocks_grow(be, &s->ye, &s->cap_ye, nr * d.C);
        float *xs = lb_blocks_grow(be, &s->xs, &s->cap_xs, big * d.C);
        if (x16) {   // bf16 rows moved as pairs of them in 32-bit words (bits kept)
            xe16 = lb_blocks_grow16(be, &f->xe16, &f->cap_xe16, lb_blocks_n16(nr, d.C));
            lb_ep_dispatch(&f->route, ep, be, (const float *)xp16, (float *)xe16, xs,
                           (int)(lb_blocks_n16(1, d.C) / 2));
        } else {
            xe = lb_blocks_grow(be, &f->xe, &f->cap_xe, nr * d.C);
            lb_ep_dispatch(&f->route, ep, be, xp, xe, xs, d.C);
        }
        if (wh) {
            wr = lb_blocks_grow(be, &f->wpe, &f->cap_wpe, nr);
            lb_ep_dispatch(&f->route, ep, be, f->wp, wr, s->xs, 1);
        }
    }
    uint16_t *gu16 =
        g16 ? lb_blocks_grow16(be, &f->gu16, &f->cap_gu16, lb_blocks_n16(nr, 2 * d.F)) : NULL;
    float *gu = g16 ? NULL : lb_blocks_grow(be, &f->gu, &f->cap_gu, nr * 2 * d.F);
    uint16_t *h16 =
        down16 ? lb_blocks_grow16(be, &f->h16, &f->cap_h16, lb_blocks_n16(nr, d.F)) : NULL;
    if (!down16) lb_blocks_grow(be, &f->h, &f->cap_h, nr * d.F);
    if (dev)
        lb_linear_experts_fwd(lin, l, LB_ROLE_MOE_GATE_UP, lb_act_of(xp, xp16, (int)nr, d.C),
                              w->cgu, f->counts_dev, d.El, gu, gu16, 2 * d.F);
    else
        lb_linear_grouped_fwd(lin, l, LB_ROLE_MOE_GATE_UP, lb_act_of(xe, xe16, (int)nr, d.C),
                              w->gu, w->cgu, f->route.local_counts, d.El, gu, gu16, 2 * d.F);
    float *h = h16 ? NULL : f->h;
    if (nr) be->swiglu_fwd(be, &(lb_swiglu_args){.out = h, .out16 = h16, .gu = gu, .gu16 = gu16,
            .rw = wr, .n = (int)nr, .f = d.F});
    const lb_act ha = lb_act_of(h, h16, (int)nr, d.F);
    if (dev)
        lb_linear_experts_fwd(lin, l, LB_ROLE_MOE_DOWN, ha, w->cdown, f->counts_dev, d.El, ye,
                              NULL, d.C);
    else
        lb_linear_grouped_fwd(lin, l, LB_ROLE_MOE_DOWN, ha, w->down, w->cdown,
                              f->route.local_counts, d.El, ye, NULL, d.C);
    if (d.ep > 1) lb_ep_combine(&f->route, ep, be, ye, yp, s->xs, d.C);
    if (d.parts > 1) be->zero(be, out, (size_t)n * d.C * sizeof(float));
    if (np)
        be->moe_combine(be, &(lb_moe_combine_args){.out = out + (size_t)o * d.C, .yp = yp,
                .weight = wh ? NULL : f->weight + (size_t)o * d.K, .row = f->row,
                .n = np, .k = d.K, .c = d.C});
    if (w->sgu) {   // the shared experts on every row, added to the routed output (tp partial)
        const int g16 = lb_blocks_mlp16(m, l, 0), h16 = lb_blocks_mlp16(m, l, 1);
        mlp_fwd(m, l, w->sgu, w->csgu, w->sdown, w->csdown,
                lb_blocks_norm_in(m, l, LB_ROLE_MLP_GATE_UP, ln, ln16, n, d.C),
                g16 ? NULL : f->sgu, g16 ? f->sgu16 : NULL, h16 ? NULL : f->sh,
                h16 ? f->sh16 : NULL, d.Fs, out, 1.0f);
    }
    return aux;
}

// The sigmoid router's loads: layer l's rows per expert of this backward's micro-batch (this
// rank's part of its rows), added to m->expert_load for the next bias update. In the backward,
// so that recomputation and forwards without a step (evaluation, sampling) count nothing.
static void expert_load_add(lb_model *m, int l, const int *counts)
{
    const lb_model_config *c = &m->cfg;
    if (!m->expert_load)
        m->expert_load = lb_calloc((size_t)c->num_hidden_layers * c->num_experts, sizeof(double));
    double *row = m->expert_load + (size_t)l * c->num_experts;
    for (int j = 0; j < c->num_experts; j++) row[j] += counts[j];
}

// MoE health (lb_model_moe_stats_begin): layer l's tokens per expert (counts, this rank's part
// of the rows) and the entropy of its rows' router distributions, probs (n, E) downloaded
// (only while collecting: the metrics' logged steps). The entropy of every s-th row, at most
// LB_MOE_STATS_ROWS of them: a mean that needs no more, at a host cost that does not grow
// with the micro-batch.
static void moe_stats_add(lb_model *m, int l, const lb_ffn_acts *f, int n)
{
    if (!m->moe_stats) return;
    const int E = m->cfg.num_experts;
    double *row = m->moe_stats + (size_t)l * (E + 2);
    for (int j = 0; j < E; j++) row[j] += f->counts[j];
    const size_t count = (size_t)n * E;
    float *p = lb_malloc((count ? count : 1) * sizeof(float));
    m->be->download(m->be, p, f->probs, count * sizeof(float));
    const int s = (n + LB_MOE_STATS_ROWS - 1) / LB_MOE_STATS_ROWS;
    for (int i = 0; i < n; i += s) {
        const float *pi = p + (size_t)i * E;
        double z = 0.0, h = 0.0;
        for (int j = 0; j < E; j++) z += pi[j];
        for (int j = 0; j < E && z > 0.0; j++)
            if (pi[j] > 0.0f) h -= pi[j] / z * log(pi[j] / z);
        row[E] += h;
        row[E + 1] += 1;
    }
    free(p);
}

// dln (n, c) = this rank's share of d loss / d ln given dout (n, c) = d loss / d out (the same on
// every tp rank); the caller sums it over tp. Accumulates the block's weight gradients.
void lb_ffn_bwd(lb_model *m, int l, const lb_layer_w *w, const lb_layer_w *dw, lb_ffn_acts *f,
                lb_acts *a, lb_act ln, int n, const float *dout, float *dln, float aux_scale)
{
    const lb_model_config *c = &m->cfg;
    lb_backend *be = m->be;
    lb_linear *lin = &m->lin;
    lb_dims d = lb_dims_of(m);
    lb_moe_scratch *s = &a->ms;
    if (!lb_blocks_layer_moe(c, l)) {
        const int g16 = lb_blocks_mlp16(m, l, 0), h16 = lb_blocks_mlp16(m, l, 1);
        mlp_bwd(m, l, w->gu, w->cgu, w->down, w->cdown, dw->gu, dw->down, ln,
                g16 ? NULL : f->gu, g16 ? f->gu16 : NULL, h16 ? NULL : f->h,
                h16 ? f->h16 : NULL, d.Fd, dout, dln, 0.0f, a->dgu, a->dh);
        return;
    }
    int o, np = lb_blocks_part_rows(&d, n, &o);   // the rows this rank sent to the experts
    // the copies the forward wrote (lb_ffn_acts), and those of dyp and dgu to write here (dgu's
    // under expert parallelism too: the experts' rows are local by then)
    const int gu16 = lb_blocks_takes16(m, l, LB_ROLE_MOE_GATE_UP);
    const int down16 = lb_blocks_takes16(m, l, LB_ROLE_MOE_DOWN);
    size_t nr = (size_t)f->route.nrecv, big = nr > (size_t)np * d.K ? nr : (size_t)np * d.K;
    uint16_t *dyp16 = d.ep == 1 && lb_blocks_grads16(m, l, LB_ROLE_MOE_DOWN)
                          ? lb_blocks_grow16(be, &s->rows16, &s->cap_rows16,
                                             lb_blocks_n16((size_t)np * d.K, d.C))
                          : NULL;
    uint16_t *dgu16 = lb_blocks_grads16(m, l, LB_ROLE_MOE_GATE_UP)
                          ? lb_blocks_grow16(be, &s->dgu16, &s->cap_dgu16,
                                             lb_blocks_n16(nr, 2 * d.F))
                          : NULL;
    if (d.parts > 1) be->zero(be, a->dweight, (size_t)n * d.K * sizeof(float));
    // where there is a copy, only GEMMs would read dyp
    float *dyp = dyp16 ? NULL : lb_blocks_grow(be, &s->rows, &s->cap_rows, (size_t)np * d.K * d.C);
    // the forward's outputs as it stored them, and the backward's to store alike
    // (lb_blocks_out16)
    const int g16 = lb_blocks_out16(m, l, LB_ROLE_MOE_GATE_UP, LB_PASS_FPROP);
    const int dh16 = lb_blocks_out16(m, l, LB_ROLE_MOE_DOWN, LB_PASS_DGRAD);
    // weights on h: dyp is dout's rows as they are, the weights' gradients come from down's
    // dgrad (below)
    const int wh = lb_blocks_weights_on_h(m, l);
    if (np)
        be->moe_combine_bwd(be, &(lb_moe_combine_args){.dyp = dyp, .dyp16 = dyp16,
                .dweight = wh ? NULL : a->dweight + (size_t)o * d.K,
                .dout = dout + (size_t)o * d.C, .yp = wh ? NULL : f->yp, .weight = wh ? NULL : f->weight + (size_t)o * d.K, .row = f->row, .n = np,
                .k = d.K, .c = d.C});
    // yp held this rank's etp share of its part's expert outputs: the sum over tp gives every
    // row's combine-weight gradient whole
    if (!wh) lb_blocks_tp_sum(m, a->dweight, (size_t)n * d.K);
    lb_comm *ep = m->par.ep_comm;
    // gate/up's dgrad: where the layer reads xp16, in the scratch's fp32 rows (dyp's, or
    // the forward's down outputs: dead by then); else its own buffer
    const int x16 = d.ep == 1 && gu16;   // the forward wrote xp16 (rows16) and not xp
    float *dxp = x16 ? lb_blocks_grow(be, &s->rows, &s->cap_rows, (size_t)n * d.K * d.C) : a->dxp;
    float *dye = dyp, *dxe = dxp;
    if (d.ep > 1) {
        dye = lb_blocks_grow(be, &s->dye, &s->cap_dye, nr * d.C);
        dxe = lb_blocks_grow(be, &s->dxe, &s->cap_dxe, nr * d.C);
        lb_ep_dispatch(&f->route, ep, be, dyp, dye,
                       lb_blocks_grow(be, &s->xs, &s->cap_xs, big * d.C), d.C);
    }
    float *dgu = dgu16 ? NULL : lb_blocks_grow(be, &s->dgu, &s->cap_dgu, nr * 2 * d.F);
    uint16_t *dh16p =
        dh16 ? lb_blocks_grow16(be, &s->dh16, &s->cap_dh16, lb_blocks_n16(nr, d.F)) : NULL;
    float *dh = dh16 ? NULL : lb_blocks_grow(be, &s->dh, &s->cap_dh, nr * d.F);
    lb_linear_grouped_bwd(lin, l, LB_ROLE_MOE_DOWN,
                          down16 ? lb_act_bf16(f->h16, (int)nr, d.F) : lb_act_f32(f->h, (int)nr, d.F),
                          w->down, w->cdown, f->route.local_counts, d.El, f->route.seg_counts,
                          f->route.ep, dye, dyp16, dh, dh16p, dw->down,
                          lb_model_grad_beta(m, dw->down), d.C);
    double *dwr = !wh ? NULL
                  : d.ep > 1 ? lb_blocks_grow64(be, &s->dwpe, &s->cap_dwpe, nr)
                             : lb_blocks_grow64(be, &s->dwp, &s->cap_dwp, (size_t)n * d.K);
    if (nr)
        be->swiglu_bwd(be, &(lb_swiglu_args){.dgu = dgu, .dgu16 = dgu16, .dout = dh,
                .dout16 = dh16p, .gu = g16 ? NULL : f->gu, .gu16 = g16 ? f->gu16 : NULL,
                .rw = !wh ? NULL : d.ep > 1 ? f->wpe : f->wp, .drw = dwr, .n = (int)nr,
                .f = d.F});
    if (wh) {   // the weights' gradients: whole, rounded once, back to their slots
        double *dwp = lb_blocks_grow64(be, &s->dwp, &s->cap_dwp, (size_t)n * d.K);
        float *dw32 = lb_blocks_grow(be, &s->dw32, &s->cap_dw32, (size_t)n * d.K);
        // under ep from the experts' ranks, the doubles moved as pairs of 32-bit words
        if (d.ep > 1) lb_ep_combine(&f->route, ep, be, (float *)dwr, (float *)dwp, s->xs, 2);
        // etp ranks hold parts of each row's columns: their double sums are added before the
        // one rounding, so a row's weight gradient is one rank's whatever etp is (parts 1:
        // every tp rank holds the same rows in the same order)
        if (d.parts == 1 && d.tp > 1 && np)
            lb_comm_all_reduce(m->par.tp_comm, dwp, dwp, (size_t)np * d.K, LB_F64);
        be->f64_to_f32(be, dw32, dwp, (size_t)np * d.K);
        if (np)
            be->moe_permute_bwd(be, a->dweight + (size_t)o * d.K, dw32, NULL, f->row, np * d.K,
                                1, 1);
        // with the rows in parts (etp < tp), the sum over tp assembles them: whole where etp is
        // 1; where it is more, the etp ranks' parts are rounded before they are added, as the
        // weights applied after down always are
        if (d.parts > 1) lb_blocks_tp_sum(m, a->dweight, (size_t)n * d.K);
    }
    // the forward's xp again, in dyp's place (dead by now); under ep the experts' rows kept
    float *xp = NULL;
    uint16_t *xp16 = NULL;
    if (d.ep == 1) {
        if (x16)
            xp16 = lb_blocks_grow16(be, &s->rows16, &s->cap_rows16,
                                    lb_blocks_n16((size_t)n * d.K, d.C));
        else
            xp = lb_blocks_grow(be, &s->rows, &s->cap_rows, (size_t)n * d.K * d.C);
        if (np) be->moe_permute(be, xp, xp16, lb_act_rows(ln, (size_t)o, np), f->row, d.K);
    }
    const lb_act xa = d.ep > 1 ? lb_act_of(f->xe, gu16 ? f->xe16 : NULL, (int)nr, d.C)
                               : lb_act_of(xp, xp16, (int)nr, d.C);
    lb_linear_grouped_bwd(lin, l, LB_ROLE_MOE_GATE_UP, xa, w->gu, w->cgu, f->route.local_counts,
                          d.El, f->route.seg_counts, f->route.ep, dgu, dgu16, dxe, NULL, dw->gu,
                          lb_model_grad_beta(m, dw->gu), 2 * d.F);
    if (d.ep > 1) lb_ep_combine(&f->route, ep, be, dxe, dxp, s->xs, d.C);
    if (d.parts > 1) be->zero(be, dln, (size_t)n * d.C * sizeof(float));
    if (np)
        be->moe_permute_bwd(be, dln + (size_t)o * d.C, dxp, NULL, f->row, np, d.K, d.C);
    moe_stats_add(m, l, f, n);
    if (lb_blocks_sigmoid_router(c)) {   // through the routed weights alone (the bias selects only)
        be->router_sigmoid_bwd(be, &(lb_router_sigmoid_args){.n = n, .e = d.E, .k = d.K,
                .n_group = c->n_group, .topk_group = c->topk_group, .renorm = c->norm_topk_prob,
                .scale = (float)c->routed_scaling_factor, .scores = f->probs, .idx = f->idx,
                .dweight = a->dweight, .dlogits = a->drlogits});
        expert_load_add(m, l, f->counts);
    } else {   // router: through the top-k weights and the load-balancing loss
        be->copy(be, a->daux, f->aux_grad, (size_t)d.E * sizeof(float));
        be->scale(be, a->daux, aux_scale, (size_t)d.E);
        be->router_topk_bwd(be, &(lb_router_args){.dlogits = a->drlogits, .dweight = a->dweight,
                .dprobs_expert = a->daux, .probs = f->probs, .idx = f->idx, .n = n, .e = d.E,
                .k = d.K, .renorm = c->norm_topk_prob});
    }
    // The router is replicated over tp and its gradient the same on every tp rank: one rank
    // adds its share to dln so the tp sum counts it once.
    lb_linear_bwd(lin, l, LB_ROLE_ROUTER, ln, w->router, w->crouter, 0, a->drlogits,
                  m->par.tp_rank == 0 ? dln : NULL, 1.0f, dw->router,
                  lb_model_grad_beta(m, dw->router), d.E);
    if (w->sgu) {   // the shared experts: a dense MLP's backward, its dln added (tp partial)
        const int g16 = lb_blocks_mlp16(m, l, 0), h16 = lb_blocks_mlp16(m, l, 1);
        mlp_bwd(m, l, w->sgu, w->csgu, w->sdown, w->csdown, dw->sgu, dw->sdown, ln,
                g16 ? NULL : f->sgu, g16 ? f->sgu16 : NULL, h16 ? NULL : f->sh,
                h16 ? f->sh16 : NULL, d.Fs, dout, dln, 1.0f, a->dgu, a->dh);
    }
}
