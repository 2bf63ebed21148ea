// sample_cmd.c: `lowbit sample`: completions from a checkpoint, for prompts from a file (one
// per line, bytes as tokens) or for problems of the arithmetic task, printed one per line.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kernels/common.h"
#include "src/commands.h"
#include "src/data.h"
#include "src/rl.h"
#include "src/run.h"
#include "src/util.h"

#define ERRLEN 2048

// Bytes as a C-like literal on one line of ASCII (\n, \t, \\, \xNN for the rest).
static void print_escaped(const int32_t *tok, int n)
{
    for (int i = 0; i < n; i++) {
        int ch = tok[i];
        if (ch == '\n') fputs("\\n", stdout);
        else if (ch == '\t') fputs("\\t", stdout);
        else if (ch == '\\') fputs("\\\\", stdout);
        else if (ch < 0x20 || ch > 0x7e) printf("\\x%02x", ch);   // ASCII output
        else putchar(ch);
    }
}

// Every rank reads the same configuration and prompts and so reaches the same verdicts: rank 0
// alone prints them.
#define SAY(...)                                   \
    do {                                           \
        if (comm->rank == 0) fprintf(stderr, __VA_ARGS__); \
    } while (0)

int lb_cmd_sample(const lb_config *c0, lb_comm *comm)
{
    char err[ERRLEN], where[LB_PATH_MAX + 32];
    lb_config cfg = *c0;
    lb_config *c = &cfg;
    if (!c->sample.checkpoint[0]) {
        SAY("%ssample.checkpoint is empty: name the checkpoint to sample from\n",
                lb_key_where(c, "sample", "checkpoint", where, sizeof where));
        return 1;
    }
    lb_sampler_config sc;
    if (lb_model_config_from_checkpoint(c, c->sample.checkpoint, err, sizeof err) != 0 ||
        lb_rl_sampler_config(c, &sc, err, sizeof err) != 0) {
        SAY("lowbit sample: %s\n", err);
        return 1;
    }
    if (c->model.vocab_size < LB_BYTE_VOCAB) {
        SAY("lowbit sample: prompts are bytes; the model's vocabulary has only %d "
                        "tokens\n", c->model.vocab_size);
        return 1;
    }
    // Prompts: lines of a file, or arithmetic problems (is_arith: their answers are checked).
    int np = 0, is_arith = !c->sample.prompts[0];
    char **prompt = NULL;
    char *text = NULL;
    if (is_arith && !strcmp(c->sample.split, "val") && !(c->gen.val_fraction > 0)) {
        SAY("%sgen.val_fraction is 0: the val split is empty\n",
                lb_key_where(c, "gen", "val_fraction", where, sizeof where));
        return 1;
    }
    if (is_arith) {
        np = c->sample.problems;
        prompt = lb_calloc((size_t)np, sizeof *prompt);
        for (int i = 0; i < np; i++) {
            prompt[i] = lb_malloc(64);
            lb_arith_prompt(c, lb_arith_nth(c, !strcmp(c->sample.split, "val"), (uint64_t)i),
                            prompt[i]);
        }
    } else {
        size_t len;
        text = lb_read_file(c->sample.prompts, &len, err, sizeof err);
        if (!text) {
            SAY("lowbit sample: %s\n", err);
            return 1;
        }
        for (char *p = text; *p;) {   // one prompt per line; a final line without '\n' counts
            char *e = strchr(p, '\n');
            size_t w = e ? (size_t)(e - p) : strlen(p);
            if (w && p[w - 1] == '\r') p[w - 1] = 0;
            p[w] = 0;
            prompt = realloc(prompt, (size_t)(np + 1) * sizeof *prompt);
            if (!prompt) lb_die("out of memory");
            prompt[np++] = p;
            if (!e) break;
            p = e + 1;
        }
        for (int i = 0; i < np; i++)
            if (!prompt[i][0]) {
                SAY("%s:%d: empty prompt (every line is one prompt)\n",
                        c->sample.prompts, i + 1);
                return 1;
            }
        if (!np) {
            SAY("%s: no prompts\n", c->sample.prompts);
            return 1;
        }
    }
    int S = c->sample.samples, n = np * S, longest = 0;
    int32_t **ptok = lb_calloc((size_t)np, sizeof *ptok);
    for (int i = 0; i < np; i++) {
        int len = (int)strlen(prompt[i]);
        if (len > longest) longest = len;
        ptok[i] = lb_malloc((size_t)len * sizeof(int32_t));
        for (int j = 0; j < len; j++) ptok[i][j] = (unsigned char)prompt[i][j];
    }
    // The layout: tensor and expert parallelism split the model over the ranks (every rank
    // samples every prompt, in lockstep; data-parallel ranks repeat the work); no pipeline or
    // sequence parallelism in the sampler.
    lb_grid grid;
    if (lb_grid_layout(&grid, &c->parallel, comm->size, comm->rank, err, sizeof err) != 0 ||
        lb_sampler_check_layout(c, &grid, "lowbit sample", err, sizeof err) != 0 ||
        lb_grid_check_built(&c->parallel, err, sizeof err) != 0) {
        SAY("lowbit sample: %s\n", err);
        return 1;
    }
    comm->deterministic = c->parallel.deterministic;
    if (lb_grid_create(&grid, &c->parallel, comm, err, sizeof err) != 0) lb_die("%s", err);
    const int cuda = !strcmp(c->run.backend, "cuda");
    lb_backend *be = lb_rl_backend(c, comm);   // one GPU per rank
    snprintf(err, sizeof err, "the %.32s backend did not open", c->run.backend);
    if (lb_any_failed(comm, !be, "lowbit sample", err)) return 1;
    lb_run_comms x;
    int bad = lb_run_comms_open(&x, &grid, be, cuda, err, sizeof err) != 0;
    if (lb_any_failed(comm, bad, "lowbit sample", err)) return 1;
    lb_model_parallel par = lb_run_model_parallel(&grid, &x);
    lb_model *m = lb_rl_model_open(c, be, &par, c->sample.checkpoint, comm, err, sizeof err);
    if (!m) {
        SAY("lowbit sample: %s\n", err);
        return 1;
    }
    int capacity = longest + sc.max_new_tokens;
    if (capacity > m->cfg.max_position_embeddings) {
        SAY("lowbit sample: the longest prompt (%d tokens) plus sample.max_new_tokens "
                "(%d) exceeds model.max_position_embeddings (%d)\n", longest, sc.max_new_tokens,
                m->cfg.max_position_embeddings);
        return 1;
    }
    lb_sampler *smp = lb_sampler_create(m, &sc, capacity, err, sizeof err);
    if (!smp) {
        SAY("lowbit sample: %s\n", err);
        return 1;
    }
    lb_sample_req *reqs = lb_calloc((size_t)n, sizeof *reqs);
    int32_t *tok = lb_malloc((size_t)n * sc.max_new_tokens * sizeof(int32_t));
    float *lp = lb_malloc((size_t)n * sc.max_new_tokens * sizeof(float));
    for (int i = 0; i < np; i++)
        for (int s = 0; s < S; s++) {
            lb_sample_req *r = &reqs[i * S + s];
            r->prompt = ptok[i];
            r->prompt_len = (int)strlen(prompt[i]);
            r->seed = c->sample.seed;
            r->stream = lb_sample_stream((uint64_t)i, (uint64_t)s);
            r->tokens = tok + (size_t)(i * S + s) * sc.max_new_tokens;
            r->logprobs = lp + (size_t)(i * S + s) * sc.max_new_tokens;
        }
    lb_sample_stats st;
    if (lb_sampler_run(smp, reqs, n, &st, err, sizeof err) != 0) {
        SAY("lowbit sample: %s\n", err);
        return 1;
    }
    // prompt<TAB>completion<TAB>sum of log-probs[<TAB>correct|wrong], escaped on one line
    if (comm->rank == 0)
        printf("# prompt\tcompletion\tsum of log-probs%s\n", is_arith ? "\tanswer" : "");
    int right = 0, any = 0;
    for (int i = 0; i < np && comm->rank == 0; i++) {
        int ok_any = 0;
        for (int s = 0; s < S; s++) {
            const lb_sample_req *r = &reqs[i * S + s];
            double sum = 0.0;
            for (int j = 0; j < r->len; j++) sum += r->logprobs[j];
            print_escaped(r->prompt, r->prompt_len);
            putchar('\t');
            print_escaped(r->tokens, r->len);
            printf("\t%.4f", sum);
            if (is_arith) {
                char ctext[4096];
                long want, got;
                int len = r->len < (int)sizeof ctext ? r->len : (int)sizeof ctext;
                for (int j = 0; j < len; j++) ctext[j] = (char)r->tokens[j];
                int ok = lb_arith_answer(prompt[i] + (prompt[i][0] == '\n'), &want) == 0 &&
                         lb_arith_parse_completion(ctext, (size_t)len, &got) == 0 && got == want;
                printf("\t%s", ok ? "correct" : "wrong");
                right += ok;
                ok_any |= ok;
            }
            putchar('\n');
        }
        any += ok_any;
    }
    if (comm->rank == 0)
        printf("# %d completions of %d prompts: %ld tokens in %.2f s (%.0f tok/s), %ld forward "
               "calls\n", n, np, st.generated, st.seconds,
               st.generated / (st.seconds > 0 ? st.seconds : 1e-9), st.forwards);
    if (is_arith && comm->rank == 0) {   // pass@S only where it says more than pass@1
        printf("# arithmetic (%s split): pass@1 %.4f", c->sample.split, (double)right / n);
        if (S > 1) printf(", pass@%d %.4f", S, (double)any / np);
        printf("\n");
    }
    lb_sampler_free(smp);
    lb_model_free(m);
    lb_run_comms_free(&x);
    lb_grid_free(&grid);
    be->destroy(be);
    for (int i = 0; i < np; i++) {
        free(ptok[i]);
        if (is_arith) free(prompt[i]);
    }
    free(ptok), free(prompt), free(text), free(reqs), free(tok), free(lp);
    return 0;
}
