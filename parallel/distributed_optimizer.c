// distributed_optimizer.c: ZeRO-1 sharding and the data-parallel gradient reduction (see
// distributed_optimizer.h, doc/parallel.md).
#include "parallel/distributed_optimizer.h"

static int gsize(const lb_comm *c) { return c ? c->size : 1; }
static int grank(const lb_comm *c) { return c ? c->rank : 0; }

int lb_dist_optimizer_sharded(lb_comm *const comm[LB_DIST_REGIONS], int distributed,
                              size_t align[LB_DIST_REGIONS])
{
    int sharded = 0;
    for (int r = 0; r < LB_DIST_REGIONS; r++) {
        align[r] = (size_t)gsize(comm[r]);
        sharded |= distributed && gsize(comm[r]) > 1;
    }
    return sharded;
}

void lb_dist_optimizer_init(lb_dist_optimizer *d, lb_backend *be,
                            lb_comm *const comm[LB_DIST_REGIONS],
                            const size_t begin[LB_DIST_REGIONS],
                            const size_t len[LB_DIST_REGIONS], size_t nparams, int sharded)
{
    d->be = be;
    size_t at = 0;
    for (int r = 0; r < LB_DIST_REGIONS; r++) {
        d->region[r].comm = comm[r];
        d->region[r].begin = begin[r];
        d->region[r].len = len[r];
        // owned: the rank's equal share of the region (rounded up where it is not padded)
        size_t p = (size_t)gsize(comm[r]);
        size_t share = (len[r] + p - 1) / p, b = (size_t)grank(comm[r]) * share;
        if (b > len[r]) b = len[r];
        d->own[r].begin = begin[r] + b;
        d->own[r].len = b + share < len[r] ? share : len[r] - b;
        d->own[r].at = sharded ? at : d->own[r].begin;
        at += d->own[r].len;
    }
    d->shard_len = sharded ? at : nparams;
    d->grad_shard = sharded ? be->alloc(be, d->shard_len * sizeof(float)) : NULL;
}

void lb_dist_optimizer_free(lb_dist_optimizer *d)
{
    if (d->grad_shard) d->be->free(d->be, d->grad_shard);
    d->grad_shard = NULL;
}

size_t lb_dist_optimizer_shard_pos(const lb_dist_optimizer *d, size_t i)
{
    if (!d->grad_shard) return i;
    int r = i >= d->region[1].begin;
    return d->own[r].at + (i - d->own[r].begin);
}

float *lb_dist_optimizer_grad(const lb_dist_optimizer *d, float *grads, size_t i)
{
    return d->grad_shard ? d->grad_shard + lb_dist_optimizer_shard_pos(d, i) : grads + i;
}

void lb_dist_optimizer_reduce_grads(lb_dist_optimizer *d, float *grads)
{
    lb_backend *be = d->be;
    for (int r = 0; r < LB_DIST_REGIONS; r++) {
        lb_comm *g = d->region[r].comm;
        float *region = grads + d->region[r].begin;
        if (gsize(g) < 2 && d->grad_shard)   // a group of one: the shard is the region
            be->copy(be, d->grad_shard + d->own[r].at, region, d->own[r].len * sizeof(float));
        if (gsize(g) < 2 || d->region[r].len == 0) continue;
        if (d->grad_shard)
            lb_comm_reduce_scatter(g, region, d->grad_shard + d->own[r].at, d->own[r].len,
                                   LB_F32);
        else
            lb_comm_all_reduce(g, region, region, d->region[r].len, LB_F32);
        lb_comm_sync(g);
    }
}

void lb_dist_optimizer_gather_params(lb_dist_optimizer *d, float *params)
{
    if (!d->grad_shard) return;
    d->be->sync(d->be);   // the update is complete before the communicator reads
    for (int r = 0; r < LB_DIST_REGIONS; r++) {
        lb_comm *g = d->region[r].comm;
        if (gsize(g) < 2 || d->region[r].len == 0) continue;
        lb_comm_all_gather(g, params + d->own[r].begin, params + d->region[r].begin,
                           d->own[r].len, LB_F32);
        lb_comm_sync(g);
    }
}

void lb_dist_optimizer_gather(lb_dist_optimizer *d, int n, float *const *shard,
                              float *const *full)
{
    lb_backend *be = d->be;
    be->sync(be);
    for (int r = 0; r < LB_DIST_REGIONS; r++) {
        lb_comm *g = d->region[r].comm;
        size_t b = d->region[r].begin, at = d->own[r].at, len = d->own[r].len;
        if (gsize(g) < 2) {
            for (int k = 0; k < n; k++)
                be->copy(be, full[k] + b, shard[k] + at, len * sizeof(float));
            continue;
        }
        for (int k = 0; k < n; k++) lb_comm_all_gather(g, shard[k] + at, full[k] + b, len, LB_F32);
        lb_comm_sync(g);
    }
}
