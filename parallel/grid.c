// grid.c: the process grid (see grid.h and doc/parallel.md).
#include "parallel/grid.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kernels/common.h"

int lb_grid_layout(lb_grid *g, const lb_parallel_config *pc, int world, int rank, char *err,
                   size_t errlen)
{
    memset(g, 0, sizeof *g);
    int tp = pc->tp, pp = pc->pp, ep = pc->ep, etp = pc->etp ? pc->etp : pc->tp;
    if (tp < 1 || pp < 1 || ep < 1 || etp < 1 || world < 1 || rank < 0 || rank >= world) {
        snprintf(err, errlen, "parallel: sizes must be positive (tp %d, pp %d, ep %d, etp %d, "
                 "world %d)", tp, pp, ep, etp, world);
        return -1;
    }
    if (world % (tp * pp) != 0) {
        snprintf(err, errlen, "the world of %d ranks is not divisible by parallel.tp x parallel.pp "
                 "= %d x %d (dp = world / (tp x pp) must be a whole number)", world, tp, pp);
        return -1;
    }
    int dp = world / (tp * pp);
    if (pc->dp && pc->dp != dp) {
        snprintf(err, errlen, "parallel.dp = %d, but %d ranks with parallel.tp = %d and "
                 "parallel.pp = %d give dp = %d (leave parallel.dp at 0 to derive it)", pc->dp,
                 world, tp, pp, dp);
        return -1;
    }
    if ((world / pp) % (etp * ep) != 0) {
        snprintf(err, errlen, "the %d ranks of a pipeline stage (world %d / parallel.pp %d) are "
                 "not divisible by parallel.etp x parallel.ep = %d x %d (the expert grid folds "
                 "the same ranks)", world / pp, world, pp, etp, ep);
        return -1;
    }
    g->world = world;
    g->rank = rank;
    g->tp = tp;
    g->dp = dp;
    g->pp = pp;
    g->tp_rank = rank % tp;
    g->dp_rank = rank / tp % dp;
    g->pp_rank = rank / (tp * dp);
    g->etp = etp;
    g->ep = ep;
    g->edp = world / (etp * ep * pp);
    g->etp_rank = rank % etp;
    g->ep_rank = rank / etp % ep;
    g->edp_rank = rank / (etp * ep) % g->edp;
    g->sequence_parallel = pc->sequence_parallel;
    return 0;
}

// The world ranks of one group, ascending: the group rank is the position (lb_grid_create
// splits with key = world rank). *color identifies the group among its kind.
static int members(const lb_grid *g, lb_group which, int *out, int *color)
{
    int n = 0;
    switch (which) {
    case LB_GROUP_TP:
        for (int i = 0; i < g->tp; i++) out[n++] = i + g->tp * (g->dp_rank + g->dp * g->pp_rank);
        *color = g->dp_rank + g->dp * g->pp_rank;
        break;
    case LB_GROUP_DP:
        for (int i = 0; i < g->dp; i++) out[n++] = g->tp_rank + g->tp * (i + g->dp * g->pp_rank);
        *color = g->tp_rank + g->tp * g->pp_rank;
        break;
    case LB_GROUP_PP:
        for (int i = 0; i < g->pp; i++) out[n++] = g->tp_rank + g->tp * (g->dp_rank + g->dp * i);
        *color = g->tp_rank + g->tp * g->dp_rank;
        break;
    case LB_GROUP_MP:
        for (int ip = 0; ip < g->pp; ip++)
            for (int it = 0; it < g->tp; it++)
                out[n++] = it + g->tp * (g->dp_rank + g->dp * ip);
        *color = g->dp_rank;
        break;
    case LB_GROUP_ETP:
        for (int i = 0; i < g->etp; i++)
            out[n++] = i + g->etp * (g->ep_rank + g->ep * (g->edp_rank + g->edp * g->pp_rank));
        *color = g->ep_rank + g->ep * (g->edp_rank + g->edp * g->pp_rank);
        break;
    case LB_GROUP_EP:
        for (int i = 0; i < g->ep; i++)
            out[n++] = g->etp_rank + g->etp * (i + g->ep * (g->edp_rank + g->edp * g->pp_rank));
        *color = g->etp_rank + g->etp * (g->edp_rank + g->edp * g->pp_rank);
        break;
    case LB_GROUP_EDP:
        for (int i = 0; i < g->edp; i++)
            out[n++] = g->etp_rank + g->etp * (g->ep_rank + g->ep * (i + g->edp * g->pp_rank));
        *color = g->etp_rank + g->etp * (g->ep_rank + g->ep * g->pp_rank);
        break;
    default:
        lb_die("unknown group %d", (int)which);
    }
    return n;
}

int lb_grid_members(const lb_grid *g, lb_group which, int *out)
{
    int color;
    return members(g, which, out, &color);
}

const char *lb_grid_group_name(lb_group which)
{
    static const char *names[LB_GROUP_COUNT] = {"tp", "dp", "pp", "mp", "etp", "ep", "edp"};
    return which >= 0 && which < LB_GROUP_COUNT ? names[which] : "?";
}

static lb_comm *group_comm(lb_grid *g, lb_group which)
{
    lb_comm *c[LB_GROUP_COUNT] = {&g->tp_comm, &g->dp_comm, &g->pp_comm, &g->mp_comm,
                                  &g->etp_comm, &g->ep_comm, &g->edp_comm};
    return c[which];
}

int lb_grid_create(lb_grid *g, const lb_parallel_config *pc, lb_comm *world, char *err,
                   size_t errlen)
{
    if (lb_grid_layout(g, pc, world->size, world->rank, err, errlen) != 0) return -1;
    int *m = lb_malloc((size_t)world->size * sizeof *m);
    for (int k = 0; k < LB_GROUP_COUNT; k++) {
        int color, n = members(g, (lb_group)k, m, &color);
        lb_comm *c = group_comm(g, (lb_group)k);
        lb_comm_split(world, color, world->rank, c);
        // The split must give the group the formula names, in the same order.
        if (c->size != n || m[c->rank] != world->rank)
            lb_die("grid: %s group of rank %d has %d ranks (rank %d), expected %d",
                   lb_grid_group_name((lb_group)k), world->rank, c->size, c->rank, n);
    }
    free(m);
    g->has_comms = 1;
    return 0;
}

void lb_grid_free(lb_grid *g)
{
    if (!g->has_comms) return;
    for (int k = 0; k < LB_GROUP_COUNT; k++) lb_comm_free(group_comm(g, (lb_group)k));
    g->has_comms = 0;
}

void lb_grid_describe(const lb_grid *g, char *buf, size_t len)
{
    snprintf(buf, len, "world %d = tp %d x dp %d x pp %d; experts: etp %d x ep %d x edp %d x pp %d",
             g->world, g->tp, g->dp, g->pp, g->etp, g->ep, g->edp, g->pp);
}

int lb_grid_check_built(const lb_parallel_config *pc, char *err, size_t errlen)
{
    if (pc->etp && pc->tp % pc->etp != 0) {
        snprintf(err, errlen, "parallel.etp (%d) does not divide parallel.tp (%d): the tensor-"
                 "parallel group's tokens go to the experts in tp / etp parts, each cut over etp "
                 "ranks", pc->etp, pc->tp);
        return -1;
    }
    return 0;
}
