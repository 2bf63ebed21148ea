// ckpt_compare.c: compares the tensors of two lowbit checkpoints (tests/test_parallel.sh uses
// it to hold the parameters of every data-parallel layout to one rank's).
//
//   ckpt_compare [--moments] A B TOL   exit 0 when every parameter tensor (and, with --moments,
//                                      every AdamW moment) of A has the same shape in B and
//                                      max|a - b| <= TOL * max(max|a|, 1e-6) per tensor; prints
//                                      the worst tensor and its relative difference either way
//   ckpt_compare                       self-test: writes small files and checks the verdicts
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "src/io/safetensors.h"

// The largest per-tensor relative difference, or -1 with a message when the files do not
// match in names or shapes.
static double compare(const char *pa, const char *pb, int moments, char *worst, size_t wlen)
{
    char err[1024];
    lb_st_file a, b;
    if (lb_st_open(&a, pa, err, sizeof err) != 0) {
        fprintf(stderr, "%s\n", err);
        return -1;
    }
    if (lb_st_open(&b, pb, err, sizeof err) != 0) {
        fprintf(stderr, "%s\n", err);
        lb_st_close(&a);
        return -1;
    }
    double result = 0.0;
    int compared = 0;
    snprintf(worst, wlen, "-");
    for (int i = 0; i < a.ntensors && result >= 0; i++) {
        const lb_st_tensor *ta = &a.tensors[i];
        if (!moments && strncmp(ta->name, "optimizer.", 10) == 0) continue;
        const lb_st_tensor *tb = lb_st_find(&b, ta->name);
        int same = tb && tb->ndim == ta->ndim;
        for (int d = 0; same && d < ta->ndim; d++) same = ta->shape[d] == tb->shape[d];
        if (!same) {
            fprintf(stderr, "%s: tensor '%s' is missing or has another shape\n", pb, ta->name);
            result = -1;
            break;
        }
        int64_t n = lb_st_numel(ta);
        float *x = malloc((size_t)(n ? n : 1) * sizeof *x), *y = malloc((size_t)(n ? n : 1) * sizeof *y);
        if (lb_st_read_f32(&a, ta, x, err, sizeof err) || lb_st_read_f32(&b, tb, y, err, sizeof err)) {
            fprintf(stderr, "%s\n", err);
            result = -1;
        } else {
            double amax = 0.0, dmax = 0.0;
            for (int64_t k = 0; k < n; k++) {
                double d = fabs((double)x[k] - y[k]);
                if (!(d <= dmax)) dmax = d;   // NaN poisons the comparison
                if (fabs(x[k]) > amax) amax = fabs(x[k]);
            }
            double rel = dmax / (amax > 1e-6 ? amax : 1e-6);
            if (!(rel <= result)) {
                result = isnan(rel) ? INFINITY : rel;
                snprintf(worst, wlen, "%s", ta->name);
            }
            compared++;
        }
        free(x);
        free(y);
    }
    if (result >= 0 && compared == 0) {
        fprintf(stderr, "%s: no tensors to compare\n", pa);
        result = -1;
    }
    lb_st_close(&a);
    lb_st_close(&b);
    return result;
}

static int selftest(void)
{
    char dir[] = "/tmp/ckpt-compare-XXXXXX", p[3][64], err[1024], worst[160];
    if (!mkdtemp(dir)) return 1;
    float w[6] = {1, -2, 3, 0.5f, 0.25f, -4}, v[6], u[6] = {0};
    int64_t shape[2] = {2, 3}, flat[1] = {6};
    for (int k = 0; k < 6; k++) v[k] = w[k];
    v[4] += 4e-5f;   // 1e-5 of the tensor's max |w| = 4
    for (int f = 0; f < 3; f++) {
        snprintf(p[f], sizeof p[f], "%s/%d.safetensors", dir, f);
        lb_st_writer *wr = lb_st_writer_new();
        lb_st_writer_add(wr, "w", "F32", f == 2 ? 1 : 2, f == 2 ? flat : shape, f == 1 ? v : w);
        lb_st_writer_add(wr, "optimizer.exp_avg.w", "F32", 2, shape, f == 1 ? u : w);
        if (lb_st_writer_save(wr, p[f], err, sizeof err) != 0) return 1;
        lb_st_writer_free(wr);
    }
    int bad = 0;
    double r = compare(p[0], p[0], 1, worst, sizeof worst);
    if (r != 0.0) bad |= 1;
    r = compare(p[0], p[1], 0, worst, sizeof worst);   // 1e-5 relative, moments ignored
    if (!(fabs(r - 1e-5) < 1e-7) || strcmp(worst, "w")) bad |= 2;
    r = compare(p[0], p[1], 1, worst, sizeof worst);   // moments differ by 100%
    if (!(r == 1.0) || strcmp(worst, "optimizer.exp_avg.w")) bad |= 4;
    if (compare(p[0], p[2], 0, worst, sizeof worst) >= 0) bad |= 8;   // shape differs
    for (int f = 0; f < 3; f++) remove(p[f]);
    remove(dir);
    printf("ckpt_compare self-test: %s\n", bad ? "FAIL" : "PASS");
    return bad ? 1 : 0;
}

int main(int argc, char **argv)
{
    if (argc == 1) return selftest();
    int moments = argc > 1 && strcmp(argv[1], "--moments") == 0;
    if (argc != 4 + moments) {
        fprintf(stderr, "usage: ckpt_compare [--moments] A B TOL\n");
        return 2;
    }
    char worst[160];
    double tol = atof(argv[3 + moments]);
    double r = compare(argv[1 + moments], argv[2 + moments], moments, worst, sizeof worst);
    if (r < 0) return 1;
    printf("max relative difference %.3g (tensor %s), tolerance %.3g\n", r, worst, tol);
    return r <= tol ? 0 : 1;
}
