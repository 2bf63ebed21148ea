// ops_sample.c: the sample operation on the CPU (kernels.h, lb_sample_args), rows in parallel.
// The arithmetic is kernels/sample.h's, so the CUDA draws equal these bit for bit.
#include <math.h>
#include "kernels/common.h"
#include "kernels/cpu/cpu.h"
#include "kernels/sample.h"

// A cut of the sorted order: every token with a key above `key`, then the first `ties` tokens
// (in id order) whose key is `key`; `mass` their weight.
typedef struct {
    uint32_t key;
    uint64_t ties, mass;
} cut;

// The shortest prefix of the sorted order whose measure (by_weight: the weights, else one per
// token) reaches need (<= the row's total measure), by the four digit levels of sample.h.
static cut find_cut(const float *l, int v, float mx, int by_weight, uint64_t need)
{
    uint32_t want = 0, mask = 0;
    uint64_t above = 0, hist[256];
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int d = 0; d < 256; d++) hist[d] = 0;
        for (int j = 0; j < v; j++) {
            uint32_t k = lb_sample_key(l[j]);
            if ((k & mask) == want)
                hist[(k >> shift) & 255] += by_weight ? lb_sample_weight(l[j], mx) : 1;
        }
        lb_sample_cut_level(hist, shift, need, &above, &want, &mask);
    }
    // above: the measure of the larger keys; each tie adds its weight (or 1)
    uint64_t w = lb_sample_weight(lb_sample_unkey(want), mx), unit = by_weight && w ? w : 1;
    cut c = {want, (need - above + unit - 1) / unit, 0};
    for (int j = 0; j < v; j++)
        if (lb_sample_key(l[j]) > want) c.mass += lb_sample_weight(l[j], mx);
    c.mass += c.ties * w;
    return c;
}

int32_t lb_sample_draw(const float *l, int v, int top_k, float top_p, float u)
{
    float mx = -INFINITY;
    for (int j = 0; j < v; j++)
        if (l[j] > mx) mx = l[j];
    int32_t arg = 0;
    for (int j = 0; j < v; j++)
        if (l[j] == mx) {
            arg = j;
            break;
        }
    if (top_k == 1) return arg;
    // the kept set: all tokens, or those of a cut (all > key, then `ties` equal to it)
    cut c = {0, (uint64_t)v, 0};
    int whole = 1;
    if (top_k > 0 && top_k < v) {
        c = find_cut(l, v, mx, 0, (uint64_t)top_k);
        whole = 0;
    } else {
        for (int j = 0; j < v; j++) c.mass += lb_sample_weight(l[j], mx);
    }
    if (top_p < 1.0f) {
        c = find_cut(l, v, mx, 1, lb_sample_top_p_need(top_p, c.mass));
        whole = 0;
    }
    if (c.mass == 0) return arg;
    uint64_t target = lb_sample_target(u, c.mass), cum = 0, ties = 0;
    for (int j = 0; j < v; j++) {
        uint32_t k = lb_sample_key(l[j]);
        if (!whole && k < c.key) continue;
        if (!whole && k == c.key && ties++ >= c.ties) continue;
        cum += lb_sample_weight(l[j], mx);
        if (cum > target) return j;
    }
    return arg;   // not reached: the kept weights sum to c.mass > target
}

void lb_sample_check(const lb_sample_args *a)
{
    if (a->n < 0 || a->v < 1 || a->v > LB_SAMPLE_MAX_V || a->top_k < 0 ||
        !(a->top_p > 0.0f && a->top_p <= 1.0f) || a->nstop < 0 || a->nstop > LB_SAMPLE_MAX_STOP)
        lb_die("sample: n %d, v %d (1..%d), top_k %d, top_p %g, %d stop tokens: out of range",
               a->n, a->v, LB_SAMPLE_MAX_V, a->top_k, (double)a->top_p, a->nstop);
}

static void cpu_sample(lb_backend *be, const lb_sample_args *a)
{
    lb_sample_check(a);
    #pragma omp parallel for schedule(dynamic) num_threads(lb_cpu_threads(be)) \
        if ((size_t)a->n * a->v >= LB_CPU_PAR_MIN)
    for (int i = 0; i < a->n; i++) {
        const lb_sample_row *r = &a->rows[i];
        int32_t t = -1, done = 0;
        if (r->counter >= 0) {
            float u = a->top_k == 1 ? 0.0f
                                    : lb_sample_uniform(r->seed, r->stream, (uint64_t)r->counter);
            t = lb_sample_draw(a->logits + (size_t)i * a->v, a->v, a->top_k, a->top_p, u);
            done = a->max_len > 0 && r->counter + 1 >= a->max_len;
            for (int s = 0; s < a->nstop; s++)
                if (a->stop[s] == t) done = 2;
        }
        a->token[i] = t;
        if (a->done) a->done[i] = done;
    }
}

void lb_cpu_init_sample(lb_backend *be) { be->sample = cpu_sample; }
