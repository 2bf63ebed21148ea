// dispatcher.c: the all-to-all token dispatcher (see dispatcher.h).
#include "parallel/dispatcher.h"

#include <stdlib.h>
#include <string.h>
#include "kernels/common.h"

static int ep_size(const lb_comm *ep) { return ep ? ep->size : 1; }

void lb_ep_route_plan(lb_ep_route *r, lb_comm *ep, lb_backend *be, const int *counts,
                      int experts)
{
    int P = ep_size(ep), me = ep ? ep->rank : 0;
    if (experts % P != 0) lb_die("%d experts do not divide over %d expert-parallel ranks", experts, P);
    if (r->ep != P || r->experts != experts) {
        lb_ep_route_free(r, be);
        r->ep = P;
        r->experts = experts;
        r->local = experts / P;
        r->send = lb_calloc(P, sizeof *r->send);
        r->sdispl = lb_calloc(P, sizeof *r->sdispl);
        r->recv = lb_calloc(P, sizeof *r->recv);
        r->rdispl = lb_calloc(P, sizeof *r->rdispl);
        r->local_counts = lb_calloc(r->local, sizeof *r->local_counts);
        r->seg_counts = lb_calloc((size_t)r->local * P, sizeof *r->seg_counts);
    }
    const int E = experts, Le = r->local;
    // all[s][e]: rows source rank s sends to expert e
    int *all = lb_malloc((size_t)P * E * sizeof *all);
    if (P > 1) lb_comm_host_all_gather(ep, counts, all, (size_t)E * sizeof *counts);
    else memcpy(all, counts, (size_t)E * sizeof *counts);
    size_t off = 0;
    for (int j = 0; j < P; j++) {   // our rows are expert-major, so rank j's are contiguous
        size_t n = 0;
        for (int e = j * Le; e < (j + 1) * Le; e++) n += (size_t)all[(size_t)me * E + e];
        r->send[j] = n;
        r->sdispl[j] = off;
        off += n;
    }
    r->nsend = (int)off;
    off = 0;
    for (int s = 0; s < P; s++) {
        size_t n = 0;
        for (int e = me * Le; e < (me + 1) * Le; e++) n += (size_t)all[(size_t)s * E + e];
        r->recv[s] = n;
        r->rdispl[s] = off;
        off += n;
    }
    r->nrecv = (int)off;
    // Arrivals are source-major, expert-minor; the experts want expert-major, source-minor.
    int32_t *perm = lb_malloc(((size_t)r->nrecv + 1) * sizeof *perm);
    size_t dst = 0;
    for (int le = 0; le < Le; le++) {
        int e = me * Le + le;
        r->local_counts[le] = 0;
        for (int s = 0; s < P; s++) {
            size_t src = r->rdispl[s];
            for (int f = me * Le; f < e; f++) src += (size_t)all[(size_t)s * E + f];
            for (int i = 0; i < all[(size_t)s * E + e]; i++) perm[src + i] = (int32_t)dst++;
            r->local_counts[le] += all[(size_t)s * E + e];
            r->seg_counts[(size_t)le * P + s] = all[(size_t)s * E + e];
        }
    }
    if (r->nrecv > r->cap) {
        if (r->perm) be->free(be, r->perm);
        r->cap = r->nrecv;
        r->perm = be->alloc(be, (size_t)r->cap * sizeof(int32_t));
    }
    if (r->nrecv) be->upload(be, r->perm, perm, (size_t)r->nrecv * sizeof(int32_t));
    free(perm);
    free(all);
}

void lb_ep_route_free(lb_ep_route *r, lb_backend *be)
{
    free(r->send);
    free(r->sdispl);
    free(r->recv);
    free(r->rdispl);
    free(r->local_counts);
    free(r->seg_counts);
    if (r->perm) be->free(be, r->perm);
    memset(r, 0, sizeof *r);
}

// The all-to-all-v of rows of c floats, from the `from` layout to the `to` layout.
static void exchange(const lb_ep_route *r, lb_comm *ep, lb_backend *be, const float *x,
                     const size_t *fc, const size_t *fd, float *y, const size_t *tc,
                     const size_t *td, int c)
{
    int P = r->ep;
    size_t *b = lb_malloc(4 * (size_t)P * sizeof *b);
    for (int j = 0; j < P; j++) {   // rows -> floats
        b[j] = fc[j] * c;
        b[P + j] = fd[j] * c;
        b[2 * P + j] = tc[j] * c;
        b[3 * P + j] = td[j] * c;
    }
    be->sync(be);   // the backend's writes are complete before the communicator reads
    lb_comm_all_to_all_v(ep, x, b, b + P, y, b + 2 * P, b + 3 * P, LB_F32);
    lb_comm_sync(ep);
    free(b);
}

void lb_ep_dispatch(const lb_ep_route *r, lb_comm *ep, lb_backend *be, const float *x,
                    float *xe, float *scratch, int c)
{
    if (r->ep == 1) {
        be->copy(be, xe, x, (size_t)r->nsend * c * sizeof(float));
        return;
    }
    exchange(r, ep, be, x, r->send, r->sdispl, scratch, r->recv, r->rdispl, c);
    // xe[perm[i]] = s[i]
    if (r->nrecv) be->moe_permute(be, xe, NULL, lb_act_f32(scratch, r->nrecv, c), r->perm, 1);
}

void lb_ep_combine(const lb_ep_route *r, lb_comm *ep, lb_backend *be, const float *ye,
                   float *y, float *scratch, int c)
{
    if (r->ep == 1) {
        be->copy(be, y, ye, (size_t)r->nsend * c * sizeof(float));
        return;
    }
    // s[i] = ye[perm[i]]
    if (r->nrecv) be->moe_permute_bwd(be, scratch, ye, NULL, r->perm, r->nrecv, 1, c);
    exchange(r, ep, be, scratch, r->recv, r->rdispl, y, r->send, r->sdispl, c);
}
