// info.c: `lowbit info`: what a configuration implies (parameters, FLOPs, memory), measured by
// building the model on a counting backend that allocates nothing.
#include "lb_autoconf.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kernels/common.h"
#include "models/blocks.h"
#include "parallel/grid.h"
#include "src/cli/commands.h"
#include "src/bench/info.h"
#include "src/cli/run.h"

typedef struct {
    size_t now, peak;
} count_ctx;

// Every allocation gets a distinct dummy pointer carrying its size, so free can subtract it.

// Bytes of one stored AdamW moment (train.adam_moments).
static size_t moment_size(const lb_config *c)
{
    return strcmp(c->train.adam_moments, "bf16") ? sizeof(float) : sizeof(uint16_t);
}

static void *count_alloc(lb_backend *be, size_t bytes)
{
    count_ctx *c = be->ctx;
    size_t *p = lb_malloc(sizeof(size_t));
    *p = bytes;
    c->now += bytes;
    if (c->now > c->peak) c->peak = c->now;
    return p;
}

static void count_free(lb_backend *be, void *p)
{
    count_ctx *c = be->ctx;
    if (!p) return;
    c->now -= *(size_t *)p;
    free(p);
}

static void count_upload(lb_backend *be, void *dst, const void *src, size_t bytes) {}

static double gib(size_t b) { return (double)b / (1024.0 * 1024.0 * 1024.0); }
static double mib(size_t b) { return (double)b / (1024.0 * 1024.0); }

// The process grid the configuration implies (parallel.dp, when set, plans a layout without
// launching it; else the MPI ranks of this run) and what each rank holds under it.
static int layout_world(const lb_config *c, int world_size)
{
    return c->parallel.dp ? c->parallel.dp * c->parallel.tp * c->parallel.pp : world_size;
}

// The same layout checks as `lowbit train`, before anything is printed.
static int check_layout(const lb_config *c, int world_size)
{
    char err[512];
    lb_grid g;
    if (lb_grid_layout(&g, &c->parallel, layout_world(c, world_size), 0, err, sizeof err) != 0 ||
        lb_grid_check_built(&c->parallel, err, sizeof err) != 0) {
        fprintf(stderr, "lowbit info: %s\n", err);
        return -1;
    }
    if (c->train.grad_accum % g.dp) {
        fprintf(stderr, "lowbit info: train.grad_accum (%d) is not divisible by the "
                "data-parallel size dp = %d\n", c->train.grad_accum, g.dp);
        return -1;
    }
    return 0;
}


// The bf16-mode attention backward's scratch on Hopper (kernels/cuda/attention_tc.cu,
// ops_attention.cu): D (rows of b t hq floats), and for a chunk of the batch at a time bf16
// copies of q, dout, k and v (head dims in 16s) and the dS tiles of the causal square in 64-row
// tiles, hq T (T + 1) / 2 of them a batch element, T = ceil(t / 64), while they take at most
// 4 GiB (else the kernel that recomputes them). The chunk: the most batch elements whose copies
// and tiles fit 1.5 GiB (LB_CUDA_ATTN_CHUNK), at least one. Head dims of 64 and 128 only (the
// wgmma kernels); 256-byte aligned pieces.
static size_t attn_bwd_scratch(size_t b, size_t t, size_t hq, size_t hkv, size_t d)
{
    size_t al = 256, d16 = (d + 15) / 16 * 16, T = (t + 63) / 64;
    const char *env = getenv("LB_CUDA_ATTN_CHUNK");
    size_t chunk = env && *env ? (size_t)strtoull(env, NULL, 10) : (size_t)1536 << 20;
#define AL(x) (((x) + al - 1) / al * al)
    size_t work = 0;
    for (size_t bc = b; bc >= 1; bc--) {
        size_t ds = bc * hq * (T * (T + 1) / 2) * 64 * 64 * 2;
        work = 2 * AL(bc * t * hq * d16 * 2) + 2 * AL(bc * t * hkv * d16 * 2);
        if ((d16 == 64 || d16 == 128) && ds <= ((size_t)4 << 30)) work += ds;
        if (!chunk || work <= chunk) break;
    }
    size_t bytes = AL(b * t * hq * 4) + work;
#undef AL
    return bytes;
}

// What the CUDA backend holds beyond the model's buffers at a training step's peak, by the
// measured peaks of 2026-12-03 (H200, two shapes, every recompute mode and offload fraction:
// doc/benchmarks.md) and 2026-12-07 (H100 and H200, the proxy with the LM head in chunks): its
// scratch, one buffer grown to the largest request of the step with a quarter's headroom, and
// about 0.6 GiB for the context, the kernels' code, cuBLASLt's workspace and the GEMMs' fp32
// staging (the residue at every setting). The largest requests: the LM head's fused backward
// (linear_ce_bwd), bf16 copies of the logits' gradient (unless the logits are bf16 already:
// logits16, the gradient written over them) and of x, (rows, vocab) and (rows, hidden), for a
// chunk's rows; and the bf16 attention backward (attn, attn_bwd_scratch). The CPU backend
// holds nothing of its own that counts.
#define LB_INFO_CUDA_BASE ((size_t)614 << 20)
static size_t backend_bytes(const lb_config *c, size_t lm_rows, int logits16, size_t attn)
{
    if (strcmp(c->run.backend, "cuda")) return 0;
    size_t pad = 8, v = ((size_t)c->model.vocab_size + pad - 1) / pad * pad;
    size_t h = ((size_t)c->model.hidden_size + pad - 1) / pad * pad;
    size_t scratch = lm_rows * ((logits16 ? 0 : v) + h) * 2;
    if (attn > scratch) scratch = attn;
    return LB_INFO_CUDA_BASE + scratch + scratch / 4;
}

size_t lb_info_rank_total(const lb_rank_memory *m)
{
    return 2 * m->weights + m->opt + m->backend + m->caches + m->acts;
}

int lb_info_rank_memory(const lb_config *c, const lb_grid *g, lb_rank_memory *out, char *err,
                        size_t errlen)
{
    count_ctx ctx = {0, 0};
    lb_backend counter = {.name = "count", .ctx = &ctx, .alloc = count_alloc,
                          .free = count_free, .upload = count_upload};
    lb_model_parallel par = lb_model_parallel_of(g, NULL, NULL);
    // the contract too: where expert GEMMs are bf16 the activations include their bf16 copies
    lb_model *m = lb_run_model(c, &counter, &par, 0, err, errlen);
    if (!m) return -1;
    int zero = c->parallel.zero && (g->dp > 1 || g->edp > 1);
    size_t p[2] = {zero ? (size_t)g->dp : 1, zero ? (size_t)g->edp : 1}, n = 0, shard = 0;
    for (int r = 0; r < 2; r++) {   // the regions as the distributed optimizer pads them
        size_t len = (m->region_len[r] + p[r] - 1) / p[r] * p[r];
        n += len;
        shard += len / p[r];
    }
    out->weights = n * sizeof(float);
    out->caches = m->def->wcache_bytes ? m->def->wcache_bytes(m) : 0;
    // AdamW moments of the shard (the offloaded share in host memory), and under ZeRO-1 the
    // reduce-scatter's gradient shard
    size_t moments = 2 * (zero ? shard : n), msize = moment_size(c);
    out->host = (size_t)(c->train.optimizer_offload * (double)moments + 0.5) * msize;
    out->opt = (zero ? shard : 0) * sizeof(float) + moments * msize - out->host;
    size_t before = ctx.now;
    size_t rows = (size_t)c->train.micro_batch * c->train.seq_len;
    m->acts = m->def->acts_create(m, c->train.micro_batch, c->train.seq_len);
    lb_model_act_plan(m, &out->plan);
    // the quantized operands' scratch, laid out with the activations, is one for the stage:
    // counted with the weight caches
    size_t qs = lb_linear_qscratch_held(&m->lin);
    out->caches += qs;
    // + logits on the last stage (this rank's rows under SP), tokens and targets; pipeline
    // stages keep up to pp - stage micro-batches in flight
    size_t lrows = rows / (par.sp ? g->tp : 1);   // rows of logits at a time
    lrows = (size_t)lb_model_ce_rows(m, (int)lrows);
    out->acts = ctx.now - before - qs + rows * 2 * sizeof(int32_t) +
                (m->last_stage ? lrows * lb_model_logit_row_bytes(m) : 0);
    int flight = g->pp - g->pp_rank < c->train.grad_accum / g->dp ? g->pp - g->pp_rank
                                                                 : c->train.grad_accum / g->dp;
    out->acts *= (size_t)(flight > 0 ? flight : 1);
    lb_dims d = lb_dims_of(m);
    size_t attn = m->contract.attention_bf16 && m->layer_end > m->layer_begin
                      ? attn_bwd_scratch((size_t)c->train.micro_batch, (size_t)c->train.seq_len,
                                         (size_t)d.hq, (size_t)d.hkv, (size_t)d.D)
                      : 0;
    out->backend = backend_bytes(c, m->last_stage ? lrows : 0, lb_model_logits16(m), attn);
    m->def->acts_free(m, m->acts);
    m->acts = NULL;
    lb_model_free(m);
    return 0;
}

// Rank 0's activation plan: what it stores in bf16 (of its stage's layers where not all).
static void print_plan(const lb_act_plan *p)
{
    const int L = p->layers, E = p->moe_layers, M = p->mlp_layers;
    const struct { int n, of; const char *what; } a[] = {
        {p->residual, L, "the residual stream"}, {p->qk_in, L, "q and k before their norms"},
        {p->qk, L, "q and k after RoPE"},
        {p->ln1, L, "the attention's input norm"},
        {p->att, L, "the attention output"}, {p->ln2, L, "the feed-forward block's input norm"},
        {p->expert_in, E, "the experts' input rows"}, {p->gate_up_out, E, "gate/up's outputs"},
        {p->swiglu_out, E, "the SwiGLU outputs"}, {p->down_dgrad, E, "down's input gradients"},
        {p->mlp_gate_up_out, M, "the MLP's gate/up outputs"},
        {p->mlp_swiglu_out, M, "the MLP's SwiGLU outputs"}};
    printf("            activations in bf16 (rank 0): ");
    int any = 0;
    for (size_t i = 0; i < sizeof a / sizeof a[0]; i++) {
        if (!a[i].n) continue;
        printf("%s%s", any++ ? ", " : "", a[i].what);
        if (a[i].n < a[i].of) printf(" (%d of %d layers)", a[i].n, a[i].of);
    }
    printf("%s; %s%s%s, %sthe experts' routed outputs and the "
           "gradients between ops in fp32\n", any ? "" : "none",
           p->residual < p->layers ? "the residual stream, " : "",
           p->ln2 < p->layers ? "the other norms, " : "the final norm, ",
           p->qk_in < p->layers ? "q/k/v before RoPE" : "v",
           p->att < p->layers ? "the attention output, " : "");
}

static void print_layout(const lb_config *c, int world_size)
{
    const lb_parallel_config *pc = &c->parallel;
    char err[512], desc[256];
    int world = layout_world(c, world_size);
    lb_grid g;
    lb_grid_layout(&g, pc, world, 0, err, sizeof err);   // checked by check_layout
    lb_grid_describe(&g, desc, sizeof desc);
    printf("layout      %s%s (%s)\n", desc,
           pc->sequence_parallel && g.tp > 1 ? ", sequence parallel" : "",
           pc->dp ? "planned: parallel.dp" : "the ranks of this run");
    int G = c->train.grad_accum;
    int zero = pc->zero && (g.dp > 1 || g.edp > 1);
    printf("data        %d micro-batch%s of %d x %d per rank and step (train.grad_accum %d over dp "
           "%d); %s\n", G / g.dp, G / g.dp == 1 ? "" : "es", c->train.micro_batch,
           c->train.seq_len, G, g.dp,
           world == 1 ? "one rank: no gradient communication"
           : zero ? "ZeRO-1 distributed optimizer: AdamW state sharded over dp (experts over edp)"
                  : "gradients all-reduced, AdamW state replicated");
    printf("per rank    rank  tp dp pp ep   weights MiB   grads MiB   optimizer MiB   "
           "backend MiB   caches MiB   activations MiB   total MiB\n");
    for (int r = 0; r < world && r < 16; r++) {
        lb_grid h;
        lb_rank_memory mem;
        lb_grid_layout(&h, pc, world, r, err, sizeof err);
        if (lb_info_rank_memory(c, &h, &mem, err, sizeof err) != 0) {
            printf("            %-5d %s\n", r, err);
            continue;
        }
        printf("            %-5d %-2d %-2d %-2d %-2d   %-13.3f %-11.3f %-15.3f %-13.3f %-12.3f "
               "%-17.3f %.3f\n", r, h.tp_rank, h.dp_rank, h.pp_rank, h.ep_rank, mib(mem.weights),
               mib(mem.weights), mib(mem.opt), mib(mem.backend), mib(mem.caches), mib(mem.acts),
               mib(lb_info_rank_total(&mem)));
    }
    if (world > 16) printf("            ... (%d ranks)\n", world);
    lb_rank_memory r0;
    if (lb_info_rank_memory(c, &g, &r0, err, sizeof err) == 0) print_plan(&r0.plan);
    if (c->train.optimizer_offload > 0) {
        lb_rank_memory mem;
        if (lb_info_rank_memory(c, &g, &mem, err, sizeof err) == 0)
            printf("            optimizer offload: rank 0 keeps %.3f MiB of AdamW moments in "
                   "host memory (train.optimizer_offload = %g)\n", mib(mem.host),
                   c->train.optimizer_offload);
    }
    printf("            weights and grads: this rank's pieces (padded for ZeRO-1); backend: "
           "what run.backend holds of its own (CUDA: the LM head backward's scratch and the "
           "context); caches: the precision contract's bf16 and quantized weight copies and its "
           "quantized operands' scratch; "
           "activations: balanced routing, micro-batches in flight on its pipeline stage\n");
}

#ifdef LB_HAVE_CUDA
int lb_cuda_device_count(void);
int lb_cuda_device_describe(int i, char *buf, size_t len);
#endif

// The activations one decoder layer adds per token, in the recipe's storage and under
// train.recompute: one rank without parallelism, the model with one layer more against the
// model as it is (the last layer: a routed one in a MoE family). 0, or -1 with a message.
static int layer_bytes(const lb_config *c, double *per_token, char *err, size_t errlen)
{
    lb_config one = *c;
    one.parallel.tp = one.parallel.pp = one.parallel.ep = one.parallel.dp = 1;
    one.parallel.etp = 0;
    one.parallel.sequence_parallel = 0;
    one.train.grad_accum = 1;
    lb_grid g;
    if (lb_grid_layout(&g, &one.parallel, 1, 0, err, errlen) != 0) return -1;
    lb_rank_memory a, b;
    if (lb_info_rank_memory(&one, &g, &a, err, errlen) != 0) return -1;
    one.model.num_hidden_layers++;
    if (lb_info_rank_memory(&one, &g, &b, err, errlen) != 0) return -1;
    *per_token = ((double)b.acts - (double)a.acts) / ((double)c->train.micro_batch *
                                                        c->train.seq_len);
    return 0;
}

int lb_cmd_info(const lb_config *c, lb_comm *comm)
{
    if (comm->rank != 0) return 0;
    if (check_layout(c, comm->size) != 0) return 1;
    char err[1024];
    count_ctx ctx = {0, 0};
    lb_backend counter = {.name = "count", .ctx = &ctx, .alloc = count_alloc,
                          .free = count_free, .upload = count_upload};
    lb_model *m = lb_model_create(&c->model, &counter, err, sizeof err);
    if (!m) {
        fprintf(stderr, "lowbit info: %s\n", err);
        return 1;
    }
    size_t weights = ctx.now;   // params + grads
    m->acts = m->def->acts_create(m, c->train.micro_batch, c->train.seq_len);
    size_t acts = ctx.now - weights +
                  (size_t)c->train.micro_batch * c->train.seq_len *
                      ((size_t)c->model.vocab_size * sizeof(float) + 2 * sizeof(int32_t));
    m->def->acts_free(m, m->acts);
    m->acts = NULL;

    const lb_model_config *mc = &m->cfg;
    int64_t active = lb_model_active_params(m);
    double fpt = lb_model_flops_per_token(mc, c->train.seq_len);
    printf("model       %s: %s\n", mc->arch, m->def->summary);
    printf("shape       %d layers, hidden %d, %d q heads / %d kv heads x %d, vocab %d\n",
           mc->num_hidden_layers, mc->hidden_size, mc->num_attention_heads,
           mc->num_key_value_heads, mc->head_dim, mc->vocab_size);
    if (strcmp(mc->rope_type, "llama3") == 0)
        printf("rope        theta %g, llama3 scaling: factor %g, low/high freq factors %g/%g, "
               "original context %d\n", mc->rope_theta, mc->rope_factor,
               mc->rope_low_freq_factor, mc->rope_high_freq_factor,
               mc->rope_original_max_position_embeddings);
    else
        printf("rope        theta %g\n", mc->rope_theta);
    if (m->def->moe) {
        printf("experts     %d, top-%d, expert FFN %d", mc->num_experts, mc->num_experts_per_tok,
               mc->moe_intermediate_size);
        if (m->def->sigmoid_router)
            printf("; sigmoid router, top-%d of %d groups, scale %g, bias step %g",
                   mc->topk_group, mc->n_group, mc->routed_scaling_factor,
                   mc->router_bias_update_rate);
        if (mc->n_shared_experts) printf("; %d shared", mc->n_shared_experts);
        if (mc->first_k_dense_replace)
            printf("; layers 0-%d dense (FFN %d)", mc->first_k_dense_replace - 1,
                   mc->intermediate_size);
        printf("\n");
    }
    else
        printf("mlp         SwiGLU, FFN %d\n", mc->intermediate_size);
    printf("parameters  %zu (%.3fM) in %d tensors\n", m->nparams, m->nparams / 1e6, m->ntensors);
    printf("active      %lld matmul parameters per token (%.3fM)\n", (long long)active,
           active / 1e6);
    printf("FLOPs       %.4g per token for training at seq_len %d (6 x active + attention)\n",
           fpt, c->train.seq_len);
    size_t p = m->nparams * sizeof(float), pm = m->nparams * moment_size(c);
    printf("memory      weights %.3f GiB, gradients %.3f GiB, AdamW moments %.3f GiB (%s)\n",
           gib(p), gib(p), gib(2 * pm), c->train.adam_moments);
    printf("            activations %.3f GiB for micro-batch %d x %d tokens; total %.3f GiB "
           "(fp32, one rank; the per-rank table below has the recipe's)\n",
           gib(acts), c->train.micro_batch, c->train.seq_len, gib(2 * p + 2 * pm + acts));
    print_layout(c, comm->size);
    double per_layer;
    if (layer_bytes(c, &per_layer, err, sizeof err) == 0)
        printf("            activations per token and layer: %.0f bytes (%s recipe, "
               "train.recompute %s; one rank without parallelism, the last layer's)\n",
               per_layer, c->precision.recipe, c->train.recompute);
    lb_contract contract;
    const lb_precision_spec ps = lb_config_precision(c);
    if (lb_contract_resolve(&contract, &ps, mc->num_hidden_layers, err, sizeof err) == 0) {
        // the roles of this architecture's GEMMs: experts and a router, or a dense MLP
        const int moe = m->def->moe;
        unsigned roles = 1u << LB_ROLE_ATTN_QKV | 1u << LB_ROLE_ATTN_OUT | 1u << LB_ROLE_LM_HEAD;
        roles |= moe ? 1u << LB_ROLE_MOE_GATE_UP | 1u << LB_ROLE_MOE_DOWN | 1u << LB_ROLE_ROUTER
                     : 1u << LB_ROLE_MLP_GATE_UP | 1u << LB_ROLE_MLP_DOWN;
        if (moe && (mc->first_k_dense_replace || mc->n_shared_experts))   // dense MLPs too
            roles |= 1u << LB_ROLE_MLP_GATE_UP | 1u << LB_ROLE_MLP_DOWN;
        lb_contract_print(&contract, roles, stdout);
        lb_contract_free(&contract);
    }
#ifdef LB_HAVE_CUDA
    int n = lb_cuda_device_count();
    printf("CUDA        %d device(s) visible\n", n);
    for (int i = 0; i < n; i++) {
        char d[256];
        lb_cuda_device_describe(i, d, sizeof d);
        printf("            %d: %s\n", i, d);
    }
#else
    printf("CUDA        not built\n");
#endif
    lb_model_free(m);
    return 0;
}
