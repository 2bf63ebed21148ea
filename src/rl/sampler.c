// sampler.c: continuous-batching generation over a KV cache (see sampler.h, doc/rl.md).
#include "src/rl/sampler.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kernels/common.h"
#include "src/io/files.h"

#define SAMPLER_GRAPHS 4   // the shapes of the steady decode and a shrinking tail

struct lb_sampler {
    lb_model *m;
    lb_sampler_config cfg;
    int capacity;
    float inv_temp;
    lb_kvcache *kv;
    // one forward call's rows (max_rows): inputs, owning slot
    int32_t *tok, *slot, *pos;
    int *owner;                    // slot of the row when the row is sampled from, else -1
    // the rows sampled from (owner >= 0), in row order: at most one per slot
    int32_t *lrow;
    // a step's one upload, host and backend: tokens, slots, positions (rows each), the sampled
    // rows (nl), then from an even word on the sampled rows' random numbers (lb_sample_row, 6
    // words each)
    int32_t *up, *up_dev;
    // the step's results, backend and host: tokens, done flags (lb_sample_args), then the
    // tokens' negative log-probs as floats (3 x nl: one per sampled row)
    int32_t *out_dev, *out;
    // per slot: the request it holds (-1 free) and how many of its tokens are in the cache
    int *req, *fed;
    int32_t *tp_tgt;               // (tp x max_rows) the tensor-parallel ranks' draws
    int *row_req;                  // (max_rows) the request a row feeds, -1 for an idle row
    int32_t *route_log;            // (layers, max_rows, route_k) lb_model.route_log, or NULL
    // The decode step's queued work (step_queue) recorded once per shape and replayed: a
    // graph per (rows, sampled rows, routes kept), recorded when a shape runs a second step in
    // a row (the first, eager, grows the buffers), dropped when the backend's memory changed.
    int graphs;                    // the backend records and the cached forward is host-free
    struct {
        int rows, nl, routes;
        struct lb_graph *g;
    } graph[SAMPLER_GRAPHS];
    int ngraph, graph_next;        // graphs held; the one to replace when full
    int last_rows, last_nl, last_routes;   // the previous step's shape
    int q_rows, q_nl;              // step_queue's step
    size_t q_off;                  // its random numbers' word in up_dev
};

uint64_t lb_sample_stream(uint64_t prompt, uint64_t sample)
{
    return lb_hash64(lb_hash64(prompt) + sample);
}

lb_sampler *lb_sampler_create(lb_model *m, const lb_sampler_config *c, int capacity, char *err,
                              size_t errlen)
{
    if (!(c->temperature > 0.0f) || !isfinite(c->temperature)) {
        snprintf(err, errlen, "sampler: temperature %g must be positive", (double)c->temperature);
        return NULL;
    }
    if (!(c->top_p > 0.0f && c->top_p <= 1.0f)) {
        snprintf(err, errlen, "sampler: top_p %g must be in (0, 1]", (double)c->top_p);
        return NULL;
    }
    if (c->top_k < 0 || c->max_new_tokens < 1 || c->slots < 1 || c->nstop < 0 ||
        c->nstop > LB_SAMPLER_MAX_STOP) {
        snprintf(err, errlen, "sampler: top_k >= 0, max_new_tokens >= 1, slots >= 1 and at most "
                              "%d stop tokens", LB_SAMPLER_MAX_STOP);
        return NULL;
    }
    // Every running sequence feeds one token per call, so a call must hold all of them.
    if (c->max_rows < c->slots) {
        snprintf(err, errlen, "sampler: max_rows (%d) is smaller than slots (%d)", c->max_rows,
                 c->slots);
        return NULL;
    }
    if (capacity < c->max_new_tokens || capacity > m->cfg.max_position_embeddings) {
        snprintf(err, errlen, "sampler: %d positions per sequence do not fit between "
                 "max_new_tokens (%d) and model.max_position_embeddings (%d)", capacity,
                 c->max_new_tokens, m->cfg.max_position_embeddings);
        return NULL;
    }
    for (int i = 0; i < c->nstop; i++)
        if (c->stop[i] < 0 || c->stop[i] >= m->cfg.vocab_size) {
            snprintf(err, errlen, "sampler: stop token %d is outside the vocabulary (%d)",
                     c->stop[i], m->cfg.vocab_size);
            return NULL;
        }
    // Say how many sequences fit rather than fail inside an allocation.
    // logits for the sampled rows only: one per slot at most (lb_sampler_run)
    const size_t need = lb_kvcache_bytes(m, c->slots, capacity, c->slots);
    const size_t have = m->be->mem_free(m->be);
    if (need > have) {
        const size_t per = lb_kvcache_bytes(m, 1, capacity, 1);   // a slot's cache and logits
        snprintf(err, errlen, "sampler: %d slots of %d positions need %.2f GiB for the KV cache "
                 "and %d logits rows; the %s backend has %.2f GiB free, which holds %zu slots "
                 "(sample.slots)", c->slots, capacity, (double)need / (1 << 30), c->slots,
                 m->be->name, (double)have / (1 << 30), have / per);
        return NULL;
    }
    lb_sampler *s = lb_calloc(1, sizeof *s);
    s->m = m;
    s->cfg = *c;
    s->capacity = capacity;
    s->inv_temp = 1.0f / c->temperature;
    s->kv = lb_kvcache_create(m, c->slots, capacity, c->max_rows, c->slots);
    int R = c->max_rows;
    s->tok = lb_malloc((size_t)R * sizeof(int32_t));
    s->slot = lb_malloc((size_t)R * sizeof(int32_t));
    s->pos = lb_malloc((size_t)R * sizeof(int32_t));
    s->owner = lb_malloc((size_t)R * sizeof(int));
    s->lrow = lb_malloc((size_t)c->slots * sizeof(int32_t));
    const size_t up_words = 3 * (size_t)R + c->slots + 1 +
                            (size_t)c->slots * sizeof(lb_sample_row) / 4;
    s->up = lb_malloc(up_words * sizeof(int32_t));
    s->up_dev = m->be->alloc(m->be, up_words * sizeof(int32_t));
    s->out = lb_malloc(3 * (size_t)R * sizeof(int32_t));
    s->out_dev = m->be->alloc(m->be, 3 * (size_t)R * sizeof(int32_t));
    s->req = lb_malloc((size_t)c->slots * sizeof(int));
    s->fed = lb_malloc((size_t)c->slots * sizeof(int));
    s->tp_tgt = lb_malloc((size_t)m->par.tp * R * sizeof(int32_t));
    s->row_req = lb_malloc((size_t)R * sizeof(int));
    const int rk = m->def->route_k ? m->def->route_k(&m->cfg) : 0;
    if (rk)
        s->route_log = lb_malloc((size_t)m->cfg.num_hidden_layers * R * rk * sizeof(int32_t));
    s->last_rows = -1;
    return s;
}

static void graphs_drop(lb_sampler *s)
{
    for (int i = 0; i < s->ngraph; i++) s->m->be->graph_free(s->m->be, s->graph[i].g);
    s->ngraph = s->graph_next = 0;
    s->last_rows = -1;
}

void lb_sampler_free(lb_sampler *s)
{
    if (!s) return;
    lb_backend *be = s->m->be;
    lb_kvcache_free(s->m, s->kv);
    free(s->tok);
    free(s->slot);
    free(s->pos);
    free(s->owner);
    free(s->lrow);
    free(s->up);
    be->free(be, s->up_dev);
    free(s->out);
    be->free(be, s->out_dev);
    free(s->req);
    free(s->fed);
    free(s->tp_tgt);
    free(s->row_req);
    free(s->route_log);
    graphs_drop(s);
    free(s);
}

// Expert parallelism: whether any rank of the ep group still has rows to feed (busy on this
// rank). The cached forward is collective over ep (the token all-to-all), so the group runs as
// many forwards as its busiest rank needs.
static int any_busy(lb_comm *ep, int busy)
{
    int *all = lb_malloc((size_t)ep->size * sizeof *all), any = 0;
    lb_comm_host_all_gather(ep, &busy, all, sizeof busy);
    for (int r = 0; r < ep->size; r++) any |= all[r];
    free(all);
    return any;
}

// Tensor parallelism: the tp ranks hold the same requests and, after the rank-order all-reduces,
// the same logits bits, so they draw the same tokens and stay in lockstep. Checked here on every
// call: with deterministic sums a difference is a bug and stops the job; with library-order sums
// the logits may differ in the last bit, and tp rank 0's draws are taken so no rank runs ahead.
static int tp_agree(lb_sampler *s, lb_comm *tp, int32_t *tgt, int rows)
{
    lb_comm_host_all_gather(tp, tgt, s->tp_tgt, (size_t)rows * sizeof(int32_t));
    int differ = 0;
    for (int j = 1; j < tp->size; j++)
        for (int r = 0; r < rows; r++)
            if (s->tp_tgt[(size_t)j * rows + r] != s->tp_tgt[r]) {
                if (tp->deterministic)
                    lb_die("sampler: tensor-parallel rank %d drew token %d where rank 0 drew %d "
                           "(row %d): their logits differ under rank-order sums", j,
                           s->tp_tgt[(size_t)j * rows + r], s->tp_tgt[r], r);
                differ |= tgt[r] != s->tp_tgt[r];
            }
    memcpy(tgt, s->tp_tgt, (size_t)rows * sizeof(int32_t));
    return differ;
}

// Each fed row's router choices (lb_model.route_log: layer, row, k) into its request's
// routes at the row's position (position, layer, k).
static void keep_routes(lb_sampler *s, lb_sample_req *reqs, int rows)
{
    const lb_model *m = s->m;
    const int L = m->cfg.num_hidden_layers, K = m->def->route_k(&m->cfg);
    for (int r = 0; r < rows; r++) {
        if (s->row_req[r] < 0 || !reqs[s->row_req[r]].routes) continue;
        uint16_t *dst = reqs[s->row_req[r]].routes + (size_t)s->pos[r] * L * K;
        for (int l = 0; l < L; l++)
            for (int j = 0; j < K; j++)
                dst[l * K + j] = (uint16_t)s->route_log[((size_t)l * rows + r) * K + j];
    }
}

// A step's work after its upload, queued only (a graph may record it): the forward, then on
// the sampled rows the temperature, the draw, the done flags and the recorded log-probs (the
// trainer's operation on the same logits rows).
static void step_queue(void *p)
{
    lb_sampler *s = p;
    lb_model *m = s->m;
    const lb_sampler_config *c = &s->cfg;
    const int rows = s->q_rows, nl = s->q_nl;
    lb_model_forward_cached_queue(m, s->kv, s->up_dev, rows, s->up_dev + 3 * (size_t)rows, nl);
    if (nl == 0) return;
    lb_model_temper(m, s->kv->logits, nl, s->inv_temp);
    lb_sample_args sa = {s->kv->logits, (const lb_sample_row *)(s->up_dev + s->q_off),
                         s->out_dev, s->out_dev + nl, nl, m->cfg.vocab_size, c->top_k, c->top_p,
                         c->max_new_tokens, c->nstop, {0}};
    memcpy(sa.stop, c->stop, sizeof sa.stop);
    m->be->sample(m->be, &sa);
    lb_model_nll_dev(m, s->kv->logits, s->out_dev, nl, (float *)(s->out_dev + 2 * (size_t)nl));
}

// Queues step_queue for this shape: its graph's replay, or the eager calls (recorded when the
// previous step had the same shape). Returns 1 for a replay.
static int step_run(lb_sampler *s, int rows, int nl, int routes, size_t off)
{
    lb_backend *be = s->m->be;
    s->q_rows = rows, s->q_nl = nl, s->q_off = off;
    if (!s->graphs) {
        step_queue(s);
        return 0;
    }
    const int again = rows == s->last_rows && nl == s->last_nl && routes == s->last_routes;
    s->last_rows = rows, s->last_nl = nl, s->last_routes = routes;
    for (int i = 0; i < s->ngraph; i++)
        if (s->graph[i].rows == rows && s->graph[i].nl == nl && s->graph[i].routes == routes) {
            if (be->graph_launch(be, s->graph[i].g)) return 1;
            // stale (buffers changed since): recorded again below, or run eagerly
            be->graph_free(be, s->graph[i].g);
            s->graph[i] = s->graph[--s->ngraph];
            s->graph_next = 0;
            break;
        }
    if (!again) {
        step_queue(s);
        return 0;
    }
    struct lb_graph *g = be->graph_record(be, step_queue, s);   // runs the step too
    if (!g) {   // the step waits for the backend (or graphs are off): eager for this run
        s->graphs = 0;
        return 0;
    }
    int i = s->ngraph;
    if (i < SAMPLER_GRAPHS) {
        s->ngraph++;
    } else {   // full: replace the oldest recording
        i = s->graph_next;
        be->graph_free(be, s->graph[i].g);
        s->graph_next = (i + 1) % SAMPLER_GRAPHS;
    }
    s->graph[i].rows = rows, s->graph[i].nl = nl, s->graph[i].routes = routes, s->graph[i].g = g;
    return 0;
}

int lb_sampler_run(lb_sampler *s, lb_sample_req *reqs, int n, lb_sample_stats *stats,
                   char *err, size_t errlen)
{
    lb_model *m = s->m;
    lb_backend *be = m->be;
    const lb_sampler_config *c = &s->cfg;
    int V = m->cfg.vocab_size, S = c->slots, R = c->max_rows;
    double t0 = lb_now();
    lb_sample_stats st = {0};
    // A sequence feeds its prompt and all its sampled tokens but the last.
    for (int r = 0; r < n; r++) {
        const lb_sample_req *q = &reqs[r];
        if (q->prompt_len < 1 || q->prompt_len + c->max_new_tokens - 1 > s->capacity) {
            snprintf(err, errlen, "sampler: prompt %d has %d tokens; 1 to %d fit with "
                     "max_new_tokens %d", r, q->prompt_len, s->capacity - c->max_new_tokens + 1,
                     c->max_new_tokens);
            return -1;
        }
        for (int i = 0; i < q->prompt_len; i++)
            if (q->prompt[i] < 0 || q->prompt[i] >= V) {
                snprintf(err, errlen, "sampler: prompt %d token %d is %d, outside the "
                         "vocabulary (%d)", r, i, q->prompt[i], V);
                return -1;
            }
    }
    for (int k = 0; k < S; k++) s->req[k] = -1;
    // the weights the last optimizer step wrote, once a run (nothing changes them during it);
    // the caches also exist from then on, which lb_model_cached_host_free asks about
    lb_model_refresh_weights(m);
    s->graphs = lb_backend_supports(be, LB_OP_graph_record) && lb_model_cached_host_free(m);
    lb_comm *ep = m->par.ep > 1 ? m->par.ep_comm : NULL;
    lb_comm *tp = m->par.tp > 1 ? m->par.tp_comm : NULL;
    int next = 0;
    // the current stretch since the last download: its start, forwards, whether it fed prompts
    double mark = t0;
    long stretch_forwards = 0;
    int stretch_prefill = 0;
    for (;;) {
        // Free slots take the next waiting requests.
        for (int k = 0; k < S && next < n; k++)
            if (s->req[k] < 0) {
                s->req[k] = next;
                s->fed[k] = 0;
                reqs[next].len = 0;
                reqs[next].stopped = 0;
                next++;
            }
        // Decode rows first (one per running sequence, all fit: max_rows >= slots), then
        // prompt chunks in slot order while rows remain.
        int rows = 0;
        for (int k = 0; k < S; k++) {
            if (s->req[k] < 0) continue;
            lb_sample_req *q = &reqs[s->req[k]];
            if (s->fed[k] < q->prompt_len) continue;
            s->tok[rows] = q->tokens[q->len - 1];
            s->slot[rows] = k;
            s->pos[rows] = s->fed[k];
            s->owner[rows] = k;
            s->row_req[rows] = s->req[k];
            rows++;
            s->fed[k]++;
            st.decode_tokens++;
        }
        for (int k = 0; k < S && rows < R; k++) {
            if (s->req[k] < 0) continue;
            lb_sample_req *q = &reqs[s->req[k]];
            if (s->fed[k] >= q->prompt_len) continue;
            int chunk = q->prompt_len - s->fed[k];
            if (chunk > R - rows) chunk = R - rows;
            for (int i = 0; i < chunk; i++) {
                s->tok[rows] = q->prompt[s->fed[k] + i];
                s->slot[rows] = k;
                s->pos[rows] = s->fed[k] + i;
                s->owner[rows] = -1;
                s->row_req[rows] = s->req[k];
                rows++;
            }
            s->fed[k] += chunk;
            st.prefill_tokens += chunk;
            stretch_prefill = 1;
            if (s->fed[k] == q->prompt_len) s->owner[rows - 1] = k;   // its first token
        }
        // rows >= 1 while requests remain: every unfinished request holds a slot and feeds a
        // decode row or a chunk. rows = 0: this rank is done.
        if (ep ? !any_busy(ep, rows > 0) : rows == 0) break;
        if (rows == 0) {
            // An idle row keeps this rank in the ep group's collective forward; its logits are
            // not sampled. It writes k and v at (slot 0, position 0), which no sequence holds:
            // rows = 0 means every slot is free (a held slot feeds a row) and nothing waits
            // (free slots take waiting requests first). A sequence reads only positions it wrote
            // itself, kv_append before attention_cached, so the next owner of slot 0 rewrites
            // position 0 before reading it.
            s->tok[0] = 0;
            s->slot[0] = 0;
            s->pos[0] = 0;
            s->owner[0] = -1;
            s->row_req[0] = -1;
            rows = 1;
            st.idle_forwards++;
        }
        int want_routes = 0;
        for (int r = 0; r < rows && s->route_log; r++)
            want_routes |= s->row_req[r] >= 0 && reqs[s->row_req[r]].routes;
        // The rows sampled from: only they get the final norm, the LM head and the draw.
        int nl = 0;
        for (int r = 0; r < rows; r++)
            if (s->owner[r] >= 0) {
                if (nl == S) lb_die("sampler: more sampled rows than slots (%d)", S);
                s->lrow[nl++] = r;
            }
        // One upload: the rows (valid by construction: prompts checked above, drawn tokens in
        // the vocabulary, positions below the capacity), the sampled rows and their random
        // numbers.
        const size_t off = (3 * (size_t)rows + nl + 1) & ~(size_t)1;   // 8-byte aligned rows
        memcpy(s->up, s->tok, (size_t)rows * sizeof(int32_t));
        memcpy(s->up + rows, s->slot, (size_t)rows * sizeof(int32_t));
        memcpy(s->up + 2 * (size_t)rows, s->pos, (size_t)rows * sizeof(int32_t));
        memcpy(s->up + 3 * (size_t)rows, s->lrow, (size_t)nl * sizeof(int32_t));
        lb_sample_row *rng = (lb_sample_row *)(s->up + off);
        for (int j = 0; j < nl; j++) {
            const lb_sample_req *q = &reqs[s->req[s->owner[s->lrow[j]]]];
            rng[j] = (lb_sample_row){q->seed, q->stream, q->len};
        }
        be->upload(be, s->up_dev, s->up, off * sizeof(int32_t) + (size_t)nl * sizeof *rng);
        m->route_log = want_routes ? s->route_log : NULL;
        st.graph_forwards += step_run(s, rows, nl, want_routes, off);
        lb_model_route_fetch(m, rows);
        m->route_log = NULL;
        if (want_routes) keep_routes(s, reqs, rows);
        st.forwards++;
        stretch_forwards++;
        if (nl == 0) continue;   // prefill chunks only: nothing drawn
        // the draws, their done flags and log-probs: 3 x nl words
        float *nll_dev = (float *)(s->out_dev + 2 * (size_t)nl);
        const double queued = lb_now();
        be->download(be, s->out, s->out_dev, 3 * (size_t)nl * sizeof(int32_t));
        const double now = lb_now();
        if (!stretch_prefill) {
            st.decode_seconds += now - mark;
            st.decode_queue_seconds += queued - mark;
            st.decode_forwards += stretch_forwards;
        }
        mark = now, stretch_forwards = 0, stretch_prefill = 0;
        int32_t *tgt = s->out, *stop = s->out + nl;
        const float *nll = (const float *)(s->out + 2 * (size_t)nl);
        if (tp && tp_agree(s, tp, tgt, nl)) {
            // library-order sums only: rank 0's draws, and their log-probs on this rank
            be->upload(be, s->out_dev, tgt, (size_t)nl * sizeof(int32_t));
            lb_model_nll_dev(m, s->kv->logits, s->out_dev, nl, nll_dev);
            be->download(be, s->out + 2 * (size_t)nl, nll_dev, (size_t)nl * sizeof(float));
            for (int j = 0; j < nl; j++) {   // and their done flags
                stop[j] = reqs[s->req[s->owner[s->lrow[j]]]].len + 1 >= c->max_new_tokens;
                for (int i = 0; i < c->nstop; i++)
                    if (c->stop[i] == tgt[j]) stop[j] = 2;
            }
        }
        for (int j = 0; j < nl; j++) {
            const int k = s->owner[s->lrow[j]];
            lb_sample_req *q = &reqs[s->req[k]];
            q->tokens[q->len] = tgt[j];
            q->logprobs[q->len] = -nll[j];
            q->len++;
            st.generated++;
            if (stop[j]) {   // 2: a stop token, 1: the length limit
                q->stopped = stop[j] == 2;
                s->req[k] = -1;   // the slot is free for the next request
            }
        }
    }
    be->sync(be);
    graphs_drop(s);   // the next run may follow a training step's reallocations
    st.seconds = lb_now() - t0;
    if (stats) *stats = st;
    return 0;
}

char *lb_tokens_text(const lb_tokenizer *t, const int32_t *tok, int n, int mark_unknown,
                     size_t *len)
{
    size_t cap = 16 * (size_t)n + 1, k = 0;
    char *s = lb_malloc(cap);
    for (int j = 0; j < n; j++) {
        char err[256], unk[32], byte = (char)tok[j], *piece = NULL;
        const uint32_t id = (uint32_t)tok[j];
        const char *src = &byte;
        size_t m = 1;
        if (t) piece = lb_tokenizer_decode(t, &id, 1, 0, &m, err, sizeof err);
        if (piece) src = piece;
        else if (t || id > 255)
            m = mark_unknown ? (size_t)snprintf(unk, sizeof unk, "<unk:%u>", id) : 0, src = unk;
        if (k + m + 1 > cap) {
            while (k + m + 1 > cap) cap *= 2;
            char *g = realloc(s, cap);
            if (!g) lb_die("out of memory");
            s = g;
        }
        memcpy(s + k, src, m);
        k += m;
        free(piece);
    }
    s[k] = 0;
    *len = k;
    return s;
}
