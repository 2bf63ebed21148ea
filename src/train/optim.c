// optim.c: gradient reduction over the parallel groups, clipping, AdamW (on a ZeRO-1 shard or
// on everything) and the schedule (see optim.h and doc/parallel.md).
#include "src/train/optim.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include "kernels/common.h"

typedef struct lb_offload_worker lb_offload_worker;
static lb_offload_worker *worker_start(lb_optimizer *o);
static void worker_stop(lb_offload_worker *w);

static int gsize(const lb_comm *c) { return c ? c->size : 1; }

static int by_offset(const void *a, const void *b)
{
    const lb_tensor *x = *(const lb_tensor *const *)a, *y = *(const lb_tensor *const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

// The model's tensors in buffer order (regions are not in table order).
static const lb_tensor **sorted_tensors(const lb_model *m)
{
    const lb_tensor **t = lb_malloc((size_t)m->ntensors * sizeof *t);
    for (int i = 0; i < m->ntensors; i++) t[i] = &m->tensors[i];
    qsort(t, m->ntensors, sizeof *t, by_offset);
    return t;
}

// The weight-decay runs of [lo, hi): each tensor's part, merged where neighbours decay alike
// and sit next to each other in the moment arrays, so the update is a few long AdamW calls
// that may cut through tensors.
static void add_segments(lb_optimizer *o, const lb_tensor **t, size_t lo, size_t hi)
{
    for (int i = 0; i < o->m->ntensors; i++) {
        size_t b = t[i]->offset > lo ? t[i]->offset : lo;
        size_t e = t[i]->offset + t[i]->numel < hi ? t[i]->offset + t[i]->numel : hi;
        if (b >= e || t[i]->frozen) continue;   // frozen: moved outside the optimizer
        // no decay on norms and biases
        float wd = t[i]->is_norm || t[i]->zero_init ? 0.0f : (float)o->cfg.weight_decay;
        size_t at = lb_dist_optimizer_shard_pos(&o->dist, b);
        lb_optim_segment *prev = o->nseg ? &o->seg[o->nseg - 1] : NULL;
        if (prev && prev->end == b && prev->wd == wd && prev->at + (b - prev->begin) == at)
            prev->end = e;
        else o->seg[o->nseg++] = (lb_optim_segment){b, e, at, 0, wd, 0};
    }
}

// Offload: the first `offload` of the segments' parameters (in segment order) keep their moments
// on the host; a segment across the boundary is cut in two. Moments are packed per side.
static void place_moments(lb_optimizer *o)
{
    size_t total = 0, dev = 0, host = 0;
    for (int i = 0; i < o->nseg; i++) total += o->seg[i].end - o->seg[i].begin;
    double f = o->cfg.offload < 0 ? 0 : o->cfg.offload > 1 ? 1 : o->cfg.offload;
    size_t want = (size_t)(f * (double)total + 0.5);
    for (int i = 0; i < o->nseg; i++) {
        lb_optim_segment *s = &o->seg[i];
        size_t len = s->end - s->begin;
        if (host < want && host + len > want) {   // cut: [begin, begin + k) host, rest device
            size_t k = want - host;
            memmove(s + 2, s + 1, (size_t)(o->nseg - i - 1) * sizeof *s);
            s[1] = *s;
            s[1].begin += k;
            s[1].at += k;
            s->end = s->begin + k;
            o->nseg++;
            len = k;
        }
        s->host = host < want;
        if (s->host) {
            s->mat = host;
            host += len;
        } else {
            s->mat = dev;
            dev += len;
        }
    }
    o->dev_len = dev;
    o->host_len = host;
    o->host = NULL;
    if (!host) return;
    char err[256];
    o->host = lb_backend_cpu_create(o->cfg.offload_threads, err, sizeof err);
    if (!o->host) lb_die("optimizer offload: %s", err);
    o->host_m = lb_calloc(host, lb_optimizer_moment_size(o));
    o->host_v = lb_calloc(host, lb_optimizer_moment_size(o));
    size_t piece = o->cfg.offload_piece ? o->cfg.offload_piece : LB_OFFLOAD_PIECE;
    o->npiece = 0;
    for (int i = 0; i < o->nseg; i++)
        if (o->seg[i].host) o->npiece += (int)((o->seg[i].end - o->seg[i].begin + piece - 1) / piece);
    o->piece = lb_malloc((size_t)o->npiece * sizeof *o->piece);
    int n = 0;
    for (int i = 0; i < o->nseg; i++) {
        const lb_optim_segment *s = &o->seg[i];
        for (size_t b = s->begin; s->host && b < s->end; b += piece) {
            lb_optim_segment *c = &o->piece[n++];
            *c = *s;
            c->begin = b;
            c->end = s->end - b < piece ? s->end : b + piece;
            c->at += b - s->begin;
            c->mat += b - s->begin;
        }
    }
    size_t slot = piece < host ? piece : host;
    lb_backend *be = o->m->be;
    for (int k = 0; k < 2; k++) {
        o->stage_p[k] = be->host_alloc(be, slot * sizeof(float));
        o->stage_g[k] = be->host_alloc(be, slot * sizeof(float));
    }
    o->worker = worker_start(o);
}

size_t lb_optimizer_moment_size(const lb_optimizer *o)
{
    return o->cfg.moments16 ? sizeof(uint16_t) : sizeof(float);
}

void lb_optimizer_init(lb_optimizer *o, lb_model *m, const lb_optim_config *cfg)
{
    lb_optimizer_init_dp(o, m, cfg, NULL, 0);
}

void lb_optimizer_init_dp(lb_optimizer *o, lb_model *m, const lb_optim_config *cfg, lb_comm *dp,
                          int distributed)
{
    lb_optim_groups g = {dp, dp, NULL, dp};
    lb_optimizer_init_groups(o, m, cfg, &g, distributed);
}

void lb_optimizer_init_groups(lb_optimizer *o, lb_model *m, const lb_optim_config *cfg,
                              const lb_optim_groups *g, int distributed)
{
    lb_backend *be = m->be;
    o->cfg = *cfg;
    o->m = m;
    o->g = *g;
    // dense over dp, experts over edp; ZeRO-1 re-lays the regions padded for equal shards
    lb_comm *comm[LB_DIST_REGIONS] = {g->dp, g->edp ? g->edp : g->dp};
    size_t align[LB_DIST_REGIONS];
    int zero = lb_dist_optimizer_sharded(comm, distributed, align);
    if (zero) lb_model_align(m, align);
    lb_dist_optimizer_init(&o->dist, be, comm, m->region_begin, m->region_len, m->nparams, zero);
    const lb_tensor **t = sorted_tensors(m);
    o->seg = lb_malloc(((size_t)m->ntensors + 3) * sizeof *o->seg);
    o->nseg = 0;
    if (zero)
        for (int r = 0; r < LB_DIST_REGIONS; r++)
            add_segments(o, t, o->dist.own[r].begin, o->dist.own[r].begin + o->dist.own[r].len);
    else
        add_segments(o, t, 0, m->nparams);
    free(t);
    place_moments(o);
    lb_alloc_what("the AdamW moments (set train.adam_moments = bf16, parallel.zero with data "
                  "parallelism, or train.optimizer_offload)");
    o->adam_m = be->alloc(be, (o->dev_len ? o->dev_len : 1) * lb_optimizer_moment_size(o));
    o->adam_v = be->alloc(be, (o->dev_len ? o->dev_len : 1) * lb_optimizer_moment_size(o));
    lb_alloc_what(NULL);
}

void lb_optimizer_free(lb_optimizer *o)
{
    lb_backend *be = o->m->be;
    be->free(be, o->adam_m);
    be->free(be, o->adam_v);
    lb_dist_optimizer_free(&o->dist);
    if (o->host) {
        worker_stop(o->worker);
        o->host->destroy(o->host);
        free(o->host_m);
        free(o->host_v);
        free(o->piece);
        for (int k = 0; k < 2; k++) {
            be->host_free(be, o->stage_p[k]);
            be->host_free(be, o->stage_g[k]);
        }
        o->host = NULL;
    }
    free(o->seg);
    o->seg = NULL;
}

double lb_optimizer_lr(const lb_optim_config *c, int step)
{
    int warm = c->warmup_steps, total = c->total_steps;
    if (warm > 0 && step <= warm) return c->lr * step / warm;
    if (total <= warm) return c->lr;
    double p = (double)(step - warm) / (double)(total - warm);
    if (p > 1.0) p = 1.0;
    return c->min_lr + 0.5 * (c->lr - c->min_lr) * (1.0 + cos(M_PI * p));
}

// The reduced gradient of parameter i (i owned under ZeRO).
static float *grad_at(lb_optimizer *o, size_t i)
{
    return lb_dist_optimizer_grad(&o->dist, o->m->grads, i);
}

// AdamW on be for n parameters p whose moments start at element k of m and v (fp32, or bf16
// with cfg.moments16).
static void adamw_run(const lb_optimizer *o, lb_backend *be, float *p, const float *g,
                      float gscale, void *m, void *v, size_t k, uint16_t *p16, size_t n, float lr,
                      float wd, int step)
{
    const lb_optim_config *c = &o->cfg;
    if (c->moments16)
        be->adamw16(be, &(lb_adamw_args){.p = p, .g = g, .gscale = gscale,
                .m16 = (uint16_t *)m + k, .v16 = (uint16_t *)v + k, .p16 = p16, .n = n, .lr = lr,
                .beta1 = (float)c->beta1, .beta2 = (float)c->beta2, .eps = (float)c->eps, .wd = wd,
                .step = step});
    else
        be->adamw(be, &(lb_adamw_args){.p = p, .g = g, .gscale = gscale, .m = (float *)m + k,
                .v = (float *)v + k, .p16 = p16, .n = n, .lr = lr, .beta1 = (float)c->beta1,
                .beta2 = (float)c->beta2, .eps = (float)c->eps, .wd = wd, .step = step});
}

// The host's updates run on a thread of its own (the CPU backend's OpenMP team stays with it
// from step to step), one piece at a time: the step posts piece i and waits for it before it
// copies that piece back up.
struct lb_offload_worker {
    lb_optimizer *o;
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int state;                // IDLE, POSTED (the piece below waits), QUIT
    int piece, step;
    float lr, gscale;
};
enum { W_IDLE, W_POSTED, W_QUIT };

// AdamW on the host for the posted piece's staged parameters and gradients (slot piece % 2).
static void *worker_main(void *arg)
{
    lb_offload_worker *w = arg;
    lb_optimizer *o = w->o;
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (w->state != W_POSTED && w->state != W_QUIT) pthread_cond_wait(&w->cv, &w->mu);
        if (w->state == W_QUIT) break;
        pthread_mutex_unlock(&w->mu);
        const lb_optim_segment *s = &o->piece[w->piece];
        int k = w->piece % 2;
        adamw_run(o, o->host, o->stage_p[k], o->stage_g[k], w->gscale, o->host_m, o->host_v,
                  s->mat, NULL, s->end - s->begin, w->lr, s->wd, w->step);
        pthread_mutex_lock(&w->mu);
        w->state = W_IDLE;
        pthread_cond_broadcast(&w->cv);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

static lb_offload_worker *worker_start(lb_optimizer *o)
{
    lb_offload_worker *w = lb_calloc(1, sizeof *w);
    w->o = o;
    w->state = W_IDLE;
    if (pthread_mutex_init(&w->mu, NULL) || pthread_cond_init(&w->cv, NULL) ||
        pthread_create(&w->th, NULL, worker_main, w))
        lb_die("optimizer offload: cannot start the host update thread");
    return w;
}

static void worker_post(lb_offload_worker *w, int piece, float lr, float gscale, int step)
{
    pthread_mutex_lock(&w->mu);
    w->piece = piece, w->lr = lr, w->gscale = gscale, w->step = step;
    w->state = W_POSTED;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

static void worker_wait(lb_offload_worker *w)
{
    pthread_mutex_lock(&w->mu);
    while (w->state == W_POSTED) pthread_cond_wait(&w->cv, &w->mu);
    pthread_mutex_unlock(&w->mu);
}

static void worker_stop(lb_offload_worker *w)
{
    pthread_mutex_lock(&w->mu);
    w->state = W_QUIT;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    if (pthread_join(w->th, NULL) != 0) lb_die("optimizer offload: the host update thread failed");
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    free(w);
}

// The offloaded pieces through the two slots: piece i comes down while the host updates piece
// i - 1, and piece i - 1 goes back up while the host updates piece i, so the link and the
// host's AdamW run at once (the copies are synchronous on this thread; the update is not).
static void offload_step(lb_optimizer *o, float lr, float gscale, int step)
{
    lb_backend *be = o->m->be;
    for (int i = 0; i <= o->npiece; i++) {
        if (i < o->npiece) {
            const lb_optim_segment *s = &o->piece[i];
            size_t bytes = (s->end - s->begin) * sizeof(float);
            be->download(be, o->stage_p[i % 2], o->m->params + s->begin, bytes);
            be->download(be, o->stage_g[i % 2], grad_at(o, s->begin), bytes);
        }
        if (i > 0) worker_wait(o->worker);
        if (i < o->npiece) worker_post(o->worker, i, lr, gscale, step);
        if (i > 0) {   // its slot is free for piece i + 1 once this returns
            const lb_optim_segment *s = &o->piece[i - 1];
            be->upload(be, o->m->params + s->begin, o->stage_p[(i - 1) % 2],
                       (s->end - s->begin) * sizeof(float));
        }
    }
}

// The squared global norm: every rank adds its owned parameters once (a tp-replicated tensor
// only on tp rank 0), and the world sums that. Owned ranges split every region over its group,
// pieces of different tp, ep and pipeline ranks are different parameters.
static double global_sumsq(lb_optimizer *o)
{
    lb_model *m = o->m;
    lb_backend *be = m->be;
    int skip_replicated = m->par.tp > 1 && m->par.tp_rank != 0;
    double sum = 0.0;
    for (int r = 0; r < 2; r++) {
        size_t lo = o->dist.own[r].begin, hi = lo + o->dist.own[r].len;
        if (!skip_replicated) {   // the owned range in one pass (padding is zero)
            if (hi > lo) sum += be->sumsq(be, grad_at(o, lo), hi - lo);
            continue;
        }
        for (int i = 0; i < m->ntensors; i++) {
            const lb_tensor *t = &m->tensors[i];
            size_t b = t->offset > lo ? t->offset : lo;
            size_t e = t->offset + t->numel < hi ? t->offset + t->numel : hi;
            if (b < e && !t->tp_replicated) sum += be->sumsq(be, grad_at(o, b), e - b);
        }
    }
    return gsize(o->g.world) > 1 ? lb_comm_allreduce_sum(o->g.world, sum) : sum;
}

double lb_optimizer_step(lb_optimizer *o, int step, double *lr_out)
{
    lb_model *m = o->m;
    lb_backend *be = m->be;
    const lb_optim_config *c = &o->cfg;
    lb_model_grad_settle(m);   // a step with no backward since zero_grad still sees zeros
    be->sync(be);   // the backward's gradients are complete before a communicator reads
    if (gsize(o->g.tp) > 1) {   // partial gradients of tp-replicated tensors
        for (int i = 0; i < m->ntensors; i++) {
            const lb_tensor *t = &m->tensors[i];
            if (t->tp_sum)
                lb_comm_all_reduce(o->g.tp, m->grads + t->offset, m->grads + t->offset, t->numel,
                                   LB_F32);
        }
        lb_comm_sync(o->g.tp);
    }
    lb_dist_optimizer_reduce_grads(&o->dist, m->grads);   // dense over dp, experts over edp
    double norm = sqrt(global_sumsq(o));
    // Clipping scales the gradients inside adamw (one pass over them fewer than scaling first).
    float gscale = c->grad_clip > 0 && norm > c->grad_clip ? (float)(c->grad_clip / norm) : 1.0f;
    double lr = lb_optimizer_lr(c, step);
    // A segment in runs: a tensor whose weight cache keeps a bf16 copy in its own layout gets
    // the rounded update written there in the same pass (the cache then skips reading it).
    for (int i = 0; i < o->nseg; i++) {
        const lb_optim_segment *s = &o->seg[i];
        if (s->host) continue;
        for (size_t b = s->begin, e; b < s->end; b = e) {
            uint16_t *p16 = lb_model_b16_run(m, b, s->end, &e);
            size_t k = s->mat + (b - s->begin);
            adamw_run(o, be, m->params + b, grad_at(o, b), gscale, o->adam_m, o->adam_v, k,
                      p16, e - b, (float)lr, s->wd, step);
        }
    }
    // the offloaded segments, once the backend's updates are queued (they are other parameters)
    if (o->host) offload_step(o, (float)lr, gscale, step);
    // ZeRO-1: every rank gets every updated shard; the parameters are whole again everywhere
    lb_dist_optimizer_gather_params(&o->dist, m->params);
    lb_model_params_changed(m, (uint64_t)step);   // the next forward re-quantizes once
    // the copies written above hold the new values (an all-gather leaves this rank's own
    // shard as it was)
    for (int i = 0; i < o->nseg; i++) {
        const lb_optim_segment *s = &o->seg[i];
        for (size_t b = s->begin, e; b < s->end && !s->host; b = e)
            if (lb_model_b16_run(m, b, s->end, &e)) lb_model_b16_written(m, b, e);
    }
    if (lr_out) *lr_out = lr;
    return norm;
}

// bf16 moments to and from fp32 backend buffers, through the host in pieces (checkpoints
// only): n moments at src (backend memory, or host memory where src_host) widened into dst.
#define MOMENT_PIECE ((size_t)1 << 20)
static void moments_widen(lb_backend *be, float *dst, const uint16_t *src, int src_host, size_t n)
{
    float *f = lb_malloc(MOMENT_PIECE * sizeof *f);
    uint16_t *h = src_host ? NULL : lb_malloc(MOMENT_PIECE * sizeof *h);
    for (size_t o = 0; o < n; o += MOMENT_PIECE) {
        size_t len = n - o < MOMENT_PIECE ? n - o : MOMENT_PIECE;
        const uint16_t *b = src + o;
        if (!src_host) be->download(be, h, b, len * sizeof *h), b = h;
        for (size_t i = 0; i < len; i++) f[i] = lb_bf16_to_f32(b[i]);
        be->upload(be, dst + o, f, len * sizeof *f);
    }
    free(f);
    free(h);
}

// n fp32 moments at src (backend memory) rounded to bf16 into dst (backend memory, or host
// memory where dst_host).
static void moments_round(lb_backend *be, uint16_t *dst, int dst_host, const float *src, size_t n)
{
    float *f = lb_malloc(MOMENT_PIECE * sizeof *f);
    uint16_t *h = lb_malloc(MOMENT_PIECE * sizeof *h);
    for (size_t o = 0; o < n; o += MOMENT_PIECE) {
        size_t len = n - o < MOMENT_PIECE ? n - o : MOMENT_PIECE;
        be->download(be, f, src + o, len * sizeof *f);
        uint16_t *b = dst_host ? dst + o : h;
        for (size_t i = 0; i < len; i++) b[i] = lb_f32_to_bf16(f[i]);
        if (!dst_host) be->upload(be, dst + o, h, len * sizeof *h);
    }
    free(f);
    free(h);
}

// The moments in the shard's layout (position seg.at), device and host parts together, into
// backend buffers dm, dv of shard_len floats (zero elsewhere).
static void moments_to_shard(lb_optimizer *o, float *dm, float *dv)
{
    lb_backend *be = o->m->be;
    be->zero(be, dm, o->dist.shard_len * sizeof(float));
    be->zero(be, dv, o->dist.shard_len * sizeof(float));
    for (int i = 0; i < o->nseg; i++) {
        const lb_optim_segment *s = &o->seg[i];
        size_t n = s->end - s->begin, bytes = n * sizeof(float);
        if (o->cfg.moments16) {
            const uint16_t *m16 = s->host ? o->host_m : o->adam_m;
            const uint16_t *v16 = s->host ? o->host_v : o->adam_v;
            moments_widen(be, dm + s->at, m16 + s->mat, s->host, n);
            moments_widen(be, dv + s->at, v16 + s->mat, s->host, n);
        } else if (s->host) {
            be->upload(be, dm + s->at, (float *)o->host_m + s->mat, bytes);
            be->upload(be, dv + s->at, (float *)o->host_v + s->mat, bytes);
        } else {
            be->copy(be, dm + s->at, (float *)o->adam_m + s->mat, bytes);
            be->copy(be, dv + s->at, (float *)o->adam_v + s->mat, bytes);
        }
    }
}

void lb_optimizer_state_gather(lb_optimizer *o, float *adam_m, float *adam_v)
{
    lb_model *m = o->m;
    lb_backend *be = m->be;
    if (!o->dist.grad_shard) {   // the shard is every parameter, at its own index
        moments_to_shard(o, adam_m, adam_v);
        return;
    }
    float *sm = be->alloc(be, o->dist.shard_len * sizeof(float));
    float *sv = be->alloc(be, o->dist.shard_len * sizeof(float));
    moments_to_shard(o, sm, sv);
    float *shard[2] = {sm, sv}, *full[2] = {adam_m, adam_v};
    lb_dist_optimizer_gather(&o->dist, 2, shard, full);
    be->free(be, sm);
    be->free(be, sv);
}

void lb_optimizer_state_load(lb_optimizer *o, const float *adam_m, const float *adam_v)
{
    lb_backend *be = o->m->be;
    for (int i = 0; i < o->nseg; i++) {   // full moments are laid out as the parameters
        const lb_optim_segment *s = &o->seg[i];
        size_t n = s->end - s->begin, bytes = n * sizeof(float);
        if (o->cfg.moments16) {
            uint16_t *m16 = s->host ? o->host_m : o->adam_m;
            uint16_t *v16 = s->host ? o->host_v : o->adam_v;
            moments_round(be, m16 + s->mat, s->host, adam_m + s->begin, n);
            moments_round(be, v16 + s->mat, s->host, adam_v + s->begin, n);
        } else if (s->host) {
            be->download(be, (float *)o->host_m + s->mat, adam_m + s->begin, bytes);
            be->download(be, (float *)o->host_v + s->mat, adam_v + s->begin, bytes);
        } else {
            be->copy(be, (float *)o->adam_m + s->mat, adam_m + s->begin, bytes);
            be->copy(be, (float *)o->adam_v + s->mat, adam_v + s->begin, bytes);
        }
    }
}

int lb_optimizer_save(const char *path, lb_optimizer *o, const lb_train_state *st,
                      const char *config_ini, const char *tokenizer_json, lb_comm *world,
                      const lb_parallel_config *pc, char *err, size_t errlen)
{
    lb_backend *be = o->m->be;
    const size_t n = o->m->nparams, bytes = n * sizeof(float);
    float *am = be->alloc(be, bytes), *av = be->alloc(be, bytes);
    lb_optimizer_state_gather(o, am, av);   // the moments of all this rank's parameters
    // on the host before the save's messages and file: the backend holds them no longer
    float *host = lb_malloc(2 * bytes);
    be->download(be, host, am, bytes);
    be->download(be, host + n, av, bytes);
    be->free(be, am);
    be->free(be, av);
    int rc = lb_checkpoint_save_parallel(path, o->m, host, host + n, st, config_ini,
                                         tokenizer_json, world, pc, err, errlen);
    free(host);
    return rc;
}

int lb_optimizer_load(const char *path, lb_optimizer *o, lb_train_state *st, lb_comm *world,
                      const lb_parallel_config *pc, char *err, size_t errlen)
{
    lb_backend *be = o->m->be;
    const size_t bytes = o->m->nparams * sizeof(float);
    float *am = be->alloc(be, bytes), *av = be->alloc(be, bytes);
    int rc = lb_checkpoint_load_parallel(path, o->m, am, av, st, world, pc, err, errlen);
    if (rc == 0) lb_optimizer_state_load(o, am, av);
    be->free(be, am);
    be->free(be, av);
    return rc;
}
