// test_grid.c: the process grid (parallel/grid.c) without MPI: every rank's coordinates and
// groups for many layouts, the layout and shape errors; the distributed optimizer's shards
// (src/train/optim.c): padding, shard bounds and weight-decay runs that cut through tensors; and the
// data split's loader skip (src/io/data.c). The communicators themselves run in test_comm and
// test_parallel.sh.
#include "tests/testutil.h"

#include <stdint.h>
#include <string.h>
#include "kernels/common.h"
#include "models/model.h"
#include "parallel/grid.h"
#include "src/io/data.h"
#include "src/train/optim.h"

// ---------------------------------------------------------------------------------------------
// Coordinates and groups

START_TEST(test_known_layout)
{
    // world 8, tp 2, ep 2 (etp = tp): dense dp 4, expert edp 2. Rank 5: tp_rank 1, dp_rank 2;
    // experts: etp_rank 1, ep_rank 0, edp_rank 1.
    lb_parallel_config pc = lb_test_parallel(2, 1, 2, 0);
    lb_grid g;
    char err[512];
    ck_assert_msg(lb_grid_layout(&g, &pc, 8, 5, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(g.dp, 4);
    ck_assert_int_eq(g.edp, 2);
    ck_assert_int_eq(g.etp, 2);
    ck_assert_int_eq(g.tp_rank, 1);
    ck_assert_int_eq(g.dp_rank, 2);
    ck_assert_int_eq(g.pp_rank, 0);
    ck_assert_int_eq(g.etp_rank, 1);
    ck_assert_int_eq(g.ep_rank, 0);
    ck_assert_int_eq(g.edp_rank, 1);
    int m[8];
    static const struct { lb_group g; int n, r[4]; } want[] = {
        {LB_GROUP_TP, 2, {4, 5}},       {LB_GROUP_DP, 4, {1, 3, 5, 7}}, {LB_GROUP_PP, 1, {5}},
        {LB_GROUP_MP, 2, {4, 5}},       {LB_GROUP_ETP, 2, {4, 5}},      {LB_GROUP_EP, 2, {5, 7}},
        {LB_GROUP_EDP, 2, {1, 5}},
    };
    for (size_t k = 0; k < sizeof want / sizeof want[0]; k++) {
        int n = lb_grid_members(&g, want[k].g, m);
        ck_assert_int_eq(n, want[k].n);
        for (int i = 0; i < n; i++)
            ck_assert_msg(m[i] == want[k].r[i], "%s group: member %d is %d, expected %d",
                          lb_grid_group_name(want[k].g), i, m[i], want[k].r[i]);
    }
    char d[200];
    lb_grid_describe(&g, d, sizeof d);
    ck_assert_str_eq(d, "world 8 = tp 2 x dp 4 x pp 1; experts: etp 2 x ep 2 x edp 2 x pp 1");
}
END_TEST

// For every valid layout of worlds 1..16: each rank's coordinates give back its rank under both
// formulas; the groups of one kind partition the world into groups of the right size whose
// members agree on every coordinate the group does not vary; etp = tp gives the rank order
// of doc/parallel.md, tp (fastest), ep, dp, pp (dp_rank = ep_rank + ep * edp_rank).
START_TEST(test_all_layouts)
{
    static const int sz[] = {1, 2, 3, 4, 8};
    char err[512];
    int layouts = 0;
    for (int world = 1; world <= 16; world++)
        for (int a = 0; a < 5; a++) for (int b = 0; b < 5; b++)
        for (int e = 0; e < 5; e++) for (int f = 0; f < 3; f++) {
            int tp = sz[a], pp = sz[b], ep = sz[e], etp = f == 0 ? 0 : sz[f];
            lb_parallel_config pc = lb_test_parallel(tp, pp, ep, etp);
            lb_grid g0;
            if (lb_grid_layout(&g0, &pc, world, 0, err, sizeof err) != 0) continue;
            layouts++;
            int sizes[LB_GROUP_COUNT] = {g0.tp, g0.dp, g0.pp, g0.tp * g0.pp, g0.etp, g0.ep, g0.edp};
            ck_assert_int_eq(g0.tp * g0.dp * g0.pp, world);
            ck_assert_int_eq(g0.etp * g0.ep * g0.edp * g0.pp, world);
            for (int k = 0; k < LB_GROUP_COUNT; k++) {
                int owner[16];
                for (int r = 0; r < world; r++) owner[r] = -1;
                for (int r = 0; r < world; r++) {
                    lb_grid g;
                    ck_assert_int_eq(lb_grid_layout(&g, &pc, world, r, err, sizeof err), 0);
                    ck_assert_int_eq(g.tp_rank + g.tp * (g.dp_rank + g.dp * g.pp_rank), r);
                    ck_assert_int_eq(g.etp_rank + g.etp * (g.ep_rank + g.ep * (g.edp_rank +
                                                                               g.edp * g.pp_rank)), r);
                    if (g.etp == g.tp) ck_assert_int_eq(g.dp_rank, g.ep_rank + g.ep * g.edp_rank);
                    int m[16], n = lb_grid_members(&g, (lb_group)k, m);
                    ck_assert_int_eq(n, sizes[k]);
                    int self = 0;
                    for (int i = 0; i < n; i++) {
                        ck_assert(m[i] >= 0 && m[i] < world);
                        if (i) ck_assert_int_lt(m[i - 1], m[i]);   // ascending: the split key
                        self += m[i] == r;
                        // one group per rank: whoever listed m[i] first named the same group
                        if (owner[m[i]] < 0) owner[m[i]] = m[0];
                        ck_assert_int_eq(owner[m[i]], m[0]);
                        lb_grid h;
                        ck_assert_int_eq(lb_grid_layout(&h, &pc, world, m[i], err, sizeof err), 0);
                        switch ((lb_group)k) {
                        case LB_GROUP_TP: ck_assert(h.dp_rank == g.dp_rank && h.pp_rank == g.pp_rank); break;
                        case LB_GROUP_DP: ck_assert(h.tp_rank == g.tp_rank && h.pp_rank == g.pp_rank); break;
                        case LB_GROUP_PP: ck_assert(h.tp_rank == g.tp_rank && h.dp_rank == g.dp_rank); break;
                        case LB_GROUP_MP: ck_assert(h.dp_rank == g.dp_rank); break;
                        case LB_GROUP_ETP: ck_assert(h.ep_rank == g.ep_rank && h.edp_rank == g.edp_rank &&
                                                     h.pp_rank == g.pp_rank); break;
                        case LB_GROUP_EP: ck_assert(h.etp_rank == g.etp_rank && h.edp_rank == g.edp_rank &&
                                                    h.pp_rank == g.pp_rank); break;
                        case LB_GROUP_EDP: ck_assert(h.etp_rank == g.etp_rank && h.ep_rank == g.ep_rank &&
                                                     h.pp_rank == g.pp_rank); break;
                        default: ck_abort();
                        }
                    }
                    ck_assert_int_eq(self, 1);
                }
            }
        }
    ck_assert_int_gt(layouts, 100);
}
END_TEST

// ---------------------------------------------------------------------------------------------
// Errors

static void expect_layout_error(lb_parallel_config pc, int world, const char *msg)
{
    lb_grid g;
    char err[512] = "";
    ck_assert_int_eq(lb_grid_layout(&g, &pc, world, 0, err, sizeof err), -1);
    ck_assert_str_eq(err, msg);
}

START_TEST(test_layout_errors)
{
    expect_layout_error(lb_test_parallel(4, 1, 1, 0), 6,
                        "the world of 6 ranks is not divisible by parallel.tp x parallel.pp = 4 x 1 "
                        "(dp = world / (tp x pp) must be a whole number)");
    expect_layout_error(lb_test_parallel(1, 2, 1, 0), 3,
                        "the world of 3 ranks is not divisible by parallel.tp x parallel.pp = 1 x 2 "
                        "(dp = world / (tp x pp) must be a whole number)");
    expect_layout_error(lb_test_parallel(1, 1, 3, 0), 4,
                        "the 4 ranks of a pipeline stage (world 4 / parallel.pp 1) are not divisible "
                        "by parallel.etp x parallel.ep = 1 x 3 (the expert grid folds the same ranks)");
    lb_parallel_config pc = lb_test_parallel(1, 1, 1, 0);
    pc.dp = 4;
    expect_layout_error(pc, 2, "parallel.dp = 4, but 2 ranks with parallel.tp = 1 and parallel.pp "
                               "= 1 give dp = 2 (leave parallel.dp at 0 to derive it)");
    lb_grid g;
    char err[512];
    ck_assert_int_eq(lb_grid_layout(&g, &pc, 4, 3, err, sizeof err), 0);   // dp agrees
}
END_TEST

START_TEST(test_not_built)
{
    char err[512] = "";
    lb_parallel_config dp = lb_test_parallel(1, 1, 1, 0);
    ck_assert_int_eq(lb_grid_check_built(&dp, err, sizeof err), 0);
    dp.etp = 1;
    ck_assert_int_eq(lb_grid_check_built(&dp, err, sizeof err), 0);
    lb_parallel_config mp = lb_test_parallel(2, 2, 2, 0);   // tp, pp, ep and any etp dividing tp are built
    ck_assert_int_eq(lb_grid_check_built(&mp, err, sizeof err), 0);
    mp.etp = 2;
    ck_assert_int_eq(lb_grid_check_built(&mp, err, sizeof err), 0);
    mp.etp = 1;
    ck_assert_int_eq(lb_grid_check_built(&mp, err, sizeof err), 0);
    mp.etp = 4;
    ck_assert_int_eq(lb_grid_check_built(&mp, err, sizeof err), -1);
    ck_assert_str_eq(err, "parallel.etp (4) does not divide parallel.tp (2): the tensor-parallel "
                          "group's tokens go to the experts in tp / etp parts, each cut over etp "
                          "ranks");
}
END_TEST

// ---------------------------------------------------------------------------------------------
// Distributed optimizer shards

static lb_model *tiny_model(lb_backend *be)
{
    // the tests' tiny Qwen3-MoE, with odd sizes: pieces that divide unevenly
    lb_model_config mc = lb_test_tiny_config("qwen3_moe", 37, 12, 3, 5);
    mc.num_attention_heads = 2;
    mc.num_key_value_heads = 1;
    mc.head_dim = 6;
    mc.intermediate_size = 16;
    mc.initializer_range = 0.02;
    char err[512];
    lb_model *m = lb_model_create(&mc, be, err, sizeof err);
    ck_assert_msg(m != NULL, "%s", err);
    return m;
}

// For 1..7 ranks: the model's two regions (dense, experts) are padded to a multiple of the
// group and keep every tensor's values with zero padding; each rank owns an equal share of
// each region, in rank order; the weight-decay runs of its shard tile the owned parameters,
// sit where shard_pos puts them, and give every element its tensor's decay (none for norm
// weights) even where a shard starts or ends inside a tensor. The communicator is never
// called by init, so a stand-in of the right size and rank serves.
START_TEST(test_zero_shards)
{
    char err[512];
    lb_backend *be = lb_backend_cpu_create(1, err, sizeof err);
    ck_assert_ptr_nonnull(be);
    lb_optim_config oc = {.lr = 1e-3, .min_lr = 1e-4, .total_steps = 10, .beta1 = 0.9,
                          .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .grad_clip = 1.0};
    lb_model *ref = tiny_model(be);
    lb_model_init_params(ref, 7);
    size_t data[2] = {0, 0};   // parameters per region, without padding
    for (int k = 0; k < ref->ntensors; k++) data[ref->tensors[k].expert] += ref->tensors[k].numel;
    ck_assert(data[0] > 0 && data[1] > 0);
    int cuts_inside = 0;
    for (int p = 1; p <= 7; p++) {
        size_t covered = 0;
        for (int r = 0; r < p; r++) {
            lb_model *m = tiny_model(be);
            lb_model_init_params(m, 7);
            lb_comm stand_in = {.rank = r, .size = p};
            lb_optimizer o;
            lb_optimizer_init_dp(&o, m, &oc, &stand_in, 1);
            for (int k = 0; k < m->ntensors; k++) {   // values kept, tensors in their region
                const lb_tensor *t = &m->tensors[k], *u = &ref->tensors[k];
                ck_assert_int_eq(memcmp(m->params + t->offset, ref->params + u->offset,
                                        t->numel * sizeof(float)), 0);
                ck_assert(t->offset >= m->region_begin[t->expert] &&
                          t->offset + t->numel <= m->region_begin[t->expert] + data[t->expert]);
            }
            size_t at = 0;
            for (int g = 0; g < 2; g++) {
                size_t len = m->region_len[g], b0 = m->region_begin[g];
                ck_assert_uint_eq(len, p > 1 ? (data[g] + p - 1) / p * p : data[g]);
                for (size_t i = b0 + data[g]; i < b0 + len; i++)
                    ck_assert(m->params[i] == 0.0f && m->grads[i] == 0.0f);
                if (p > 1) {
                    ck_assert_uint_eq(o.dist.own[g].len, len / p);
                    ck_assert_uint_eq(o.dist.own[g].begin, b0 + (size_t)r * (len / p));
                    ck_assert_uint_eq(o.dist.own[g].at, at);
                }
                at += o.dist.own[g].len;
            }
            ck_assert_uint_eq(o.dist.shard_len, p > 1 ? at : m->nparams);
            // the runs: in order, no gap or overlap within an owned range, merged where alike;
            // one rank owns the whole buffer as one range
            int nr = p > 1 ? 2 : 1;
            for (int g = 0; g < nr; g++) {
                size_t lo = p > 1 ? o.dist.own[g].begin : 0;
                size_t hi = p > 1 ? lo + o.dist.own[g].len : m->nparams;
                size_t end = p > 1 && m->region_begin[g] + data[g] < hi ? m->region_begin[g] + data[g] : hi;
                size_t pos = lo;
                for (int s = 0; s < o.nseg; s++) {
                    if (o.seg[s].begin < lo || o.seg[s].begin >= hi) continue;
                    ck_assert_uint_eq(o.seg[s].begin, pos);
                    ck_assert_uint_gt(o.seg[s].end, o.seg[s].begin);
                    ck_assert_uint_eq(o.seg[s].at, p > 1 ? o.dist.own[g].at + (pos - lo) : pos);
                    for (size_t i = o.seg[s].begin; i < o.seg[s].end; i++) {
                        const lb_tensor *t = NULL;
                        for (int k = 0; k < m->ntensors; k++)
                            if (i >= m->tensors[k].offset &&
                                i < m->tensors[k].offset + m->tensors[k].numel)
                                t = &m->tensors[k];
                        ck_assert_ptr_nonnull(t);
                        ck_assert(o.seg[s].wd == (t->is_norm ? 0.0f : 0.1f));
                    }
                    pos = o.seg[s].end;
                }
                ck_assert_uint_eq(pos, (lo < end ? end : lo));
                covered += pos - lo;
                for (int k = 0; k < m->ntensors; k++) {
                    size_t b = m->tensors[k].offset;
                    if (lo > b && lo < b + m->tensors[k].numel) cuts_inside++;
                }
            }
            lb_optimizer_free(&o);
            lb_model_free(m);
        }
        ck_assert_uint_eq(covered, data[0] + data[1]);   // the shards together: every parameter once
    }
    ck_assert_int_gt(cuts_inside, 5);   // the test did exercise shards starting inside tensors
    lb_model_free(ref);
    be->destroy(be);
}
END_TEST

// The single-rank optimizer is the one the trainer had before data parallelism: the whole
// buffer, one shard.
START_TEST(test_one_rank_shard)
{
    char err[512];
    lb_backend *be = lb_backend_cpu_create(1, err, sizeof err);
    lb_model *m = tiny_model(be);
    lb_optim_config oc = {.lr = 1e-3, .min_lr = 1e-4, .total_steps = 10, .beta1 = 0.9,
                          .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .grad_clip = 1.0};
    lb_optimizer o;
    lb_optimizer_init(&o, m, &oc);
    ck_assert_uint_eq(o.dist.own[0].begin, 0);
    ck_assert_uint_eq(o.dist.own[0].len + o.dist.own[1].len, m->nparams);
    ck_assert_uint_eq(o.dist.shard_len, m->nparams);
    ck_assert_ptr_null(o.dist.grad_shard);
    lb_optimizer_free(&o);
    lb_model_free(m);
    be->destroy(be);
}
END_TEST

// ---------------------------------------------------------------------------------------------
// Model pieces: for every layout of up to 8 ranks that divides a small MoE and a small dense
// model, the pieces of all ranks of one data-parallel index cover every element of every whole
// tensor, each exactly once from the ranks that write it (tp-replicated tensors from tp rank 0,
// experts from their owners), and lb_tensor_take inverts lb_tensor_put.
static void check_pieces(const char *arch, int tp, int etp, int ep, int pp)
{
    lb_model_config mc = lb_test_tiny_config(arch, 37, 12, 4, 4);
    mc.num_hidden_layers = 4, mc.head_dim = 6, mc.intermediate_size = 8;
    char err[256];
    int ng;
    lb_tensor *whole = lb_model_pieces(&mc, NULL, &ng, err, sizeof err);
    ck_assert_msg(whole != NULL, "%s", err);
    for (int gi = 0; gi < ng; gi++) {
        size_t n = whole[gi].numel;
        int *hits = lb_calloc(n, sizeof *hits);
        float *w = lb_malloc(n * sizeof(float)), *back = lb_malloc(n * sizeof(float));
        for (size_t j = 0; j < n; j++) w[j] = (float)j;
        // the ranks of dp index 0: (tp_rank, pp_rank), experts folded as etp x ep over tp x ...
        for (int pr = 0; pr < pp; pr++)
            for (int tr = 0; tr < tp; tr++)
                for (int er = 0; er < ep; er++) {
                    lb_model_parallel par = {tp, tr, 0, ep, er, pp, pr, NULL, NULL, etp, tr % etp, NULL};
                    int np;
                    lb_tensor *t = lb_model_pieces(&mc, &par, &np, err, sizeof err);
                    ck_assert_msg(t != NULL, "%s", err);
                    for (int i = 0; i < np; i++) {
                        if (t[i].global != gi) continue;
                        // One copy of each element: a dense piece from ep rank 0 (dense tensors
                        // are the same on every ep rank), a tp-replicated one from tp rank 0;
                        // an expert piece from the first etp tp ranks (etp_rank = tp_rank mod
                        // etp repeats beyond them).
                        int writes = t[i].expert ? tr < etp
                                                 : er == 0 && (!t[i].tp_replicated || tr == 0);
                        float *piece = lb_malloc(t[i].numel * sizeof(float));
                        lb_tensor_take(&t[i], w, piece);
                        for (size_t j = 0; j < t[i].numel; j++) {
                            size_t g = lb_tensor_global_index(&t[i], j);
                            ck_assert_uint_lt(g, n);
                            ck_assert(piece[j] == (float)g);
                            if (writes) hits[g]++;
                        }
                        if (writes) lb_tensor_put(&t[i], piece, back);
                        // fused gate_up: local row r is gate row (r of this rank's share) in the
                        // first half and the matching up row in the second
                        if (strstr(t[i].name, "gate_up")) {   // (2f, c) or (experts, 2f, c)
                            int d = t[i].ndim - 2, rows = (int)t[i].shape[d];
                            int64_t F = t[i].gshape[d] / 2, f = rows / 2;
                            int part = t[i].index[d];
                            size_t inner = (size_t)t[i].shape[d + 1];
                            size_t ginner = (size_t)t[i].gshape[d + 1];
                            // the rank's first expert (expert pieces) or the tensor itself
                            size_t base = d ? (size_t)t[i].index[0] * t[i].shape[0] * 2 * F * ginner
                                            : 0;
                            for (int r = 0; r < rows; r++) {
                                int64_t gr = r < f ? part * f + r : F + part * f + (r - f);
                                ck_assert_uint_eq(lb_tensor_global_index(&t[i], (size_t)r * inner),
                                                  base + (size_t)gr * ginner);
                            }
                        }
                        free(piece);
                    }
                    free(t);
                }
        for (size_t j = 0; j < n; j++)
            ck_assert_msg(hits[j] == 1, "%s tp %d etp %d ep %d pp %d: %s element %zu written %d "
                          "times", arch, tp, etp, ep, pp, whole[gi].name, j, hits[j]);
        ck_assert_int_eq(memcmp(w, back, n * sizeof(float)), 0);
        free(hits), free(w), free(back);
    }
    free(whole);
}

START_TEST(test_model_pieces)
{
    const int layouts[][4] = {{1, 1, 1, 1}, {2, 2, 1, 1}, {2, 1, 1, 1}, {2, 2, 2, 1},
                              {1, 1, 4, 1}, {2, 1, 2, 2}, {4, 2, 1, 1}, {4, 4, 4, 1},
                              {2, 2, 2, 4}, {1, 1, 2, 2}};
    for (size_t i = 0; i < sizeof layouts / sizeof layouts[0]; i++) {
        const int *l = layouts[i];
        check_pieces("qwen3_moe", l[0], l[1], l[2], l[3]);
        if (l[2] == 1) check_pieces("qwen3", l[0], l[1], 1, l[3]);
    }
}
END_TEST

// ---------------------------------------------------------------------------------------------
// The data split: skipping n batches lands where n calls of next land, across shard ends.

START_TEST(test_loader_skip)
{
    char err[512], dir[300], path[400];
    snprintf(dir, sizeof dir, "%s", lb_test_tmpdir());
    static const size_t lens[3] = {50, 23, 70};
    for (int s = 0; s < 3; s++) {
        uint32_t tok[70];
        for (size_t i = 0; i < lens[s]; i++) tok[i] = (uint32_t)(s * 100 + i) % 256;
        snprintf(path, sizeof path, "%s/d_%03d.bin", dir, s);
        ck_assert_msg(lb_shard_write(path, tok, lens[s], err, sizeof err) == 0, "%s", err);
    }
    snprintf(path, sizeof path, "%s/d_*.bin", dir);
    int32_t a_in[8], a_tg[8], b_in[8], b_tg[8];
    for (int n = 0; n <= 25; n++) {
        lb_loader *a = lb_loader_open(path, 2, 4, 256, err, sizeof err);
        lb_loader *b = lb_loader_open(path, 2, 4, 256, err, sizeof err);
        ck_assert_ptr_nonnull(a);
        ck_assert_ptr_nonnull(b);
        for (int i = 0; i < n; i++) ck_assert_int_eq(lb_loader_next(a, a_in, a_tg, err, sizeof err), 0);
        lb_loader_skip(b, n);
        int64_t sa, pa, sb, pb;
        lb_loader_tell(a, &sa, &pa);
        lb_loader_tell(b, &sb, &pb);
        ck_assert_msg(sa == sb && pa == pb, "after %d: next at %lld:%lld, skip at %lld:%lld", n,
                      (long long)sa, (long long)pa, (long long)sb, (long long)pb);
        ck_assert_int_eq(lb_loader_next(a, a_in, a_tg, err, sizeof err), 0);
        ck_assert_int_eq(lb_loader_next(b, b_in, b_tg, err, sizeof err), 0);
        ck_assert_int_eq(memcmp(a_in, b_in, sizeof a_in), 0);
        ck_assert_int_eq(memcmp(a_tg, b_tg, sizeof a_tg), 0);
        lb_loader_close(a);
        lb_loader_close(b);
    }
    for (int s = 0; s < 3; s++) {
        snprintf(path, sizeof path, "%s/d_%03d.bin", dir, s);
        remove(path);
    }
    remove(dir);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("grid");
    TCase *tc = tcase_create("grid");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_known_layout);
    tcase_add_test(tc, test_all_layouts);
    tcase_add_test(tc, test_layout_errors);
    tcase_add_test(tc, test_not_built);
    tcase_add_test(tc, test_zero_shards);
    tcase_add_test(tc, test_model_pieces);
    tcase_add_test(tc, test_one_rank_shard);
    tcase_add_test(tc, test_loader_skip);
    suite_add_tcase(s, tc);
    return lb_test_run(s);
}
