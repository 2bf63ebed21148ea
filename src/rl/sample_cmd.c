// sample_cmd.c: `lowbit sample`: completions from a checkpoint, for prompts (--prompt TEXT, or
// the lines of sample.prompts, a file or "-" for stdin) or for problems of the arithmetic task,
// printed one per line. The text goes through the model's tokenizer (data.tokenizer, else the
// one stored in the checkpoint) both ways; a byte model's tokens are bytes.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kernels/common.h"
#include "src/cli/commands.h"
#include "src/io/data.h"
#include "src/io/tokenizer.h"
#include "src/rl/rl.h"
#include "src/cli/run.h"
#include "src/io/files.h"

#define ERRLEN 2048

// Bytes as a C-like literal on one line of ASCII (\n, \t, \\, \xNN for the rest).
static void print_escaped(const char *text, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        int ch = (unsigned char)text[i];
        if (ch == '\n') fputs("\\n", stdout);
        else if (ch == '\t') fputs("\\t", stdout);
        else if (ch == '\\') fputs("\\\\", stdout);
        else if (ch < 0x20 || ch > 0x7e) printf("\\x%02x", ch);   // ASCII output
        else putchar(ch);
    }
}

// Every rank reads the same configuration and prompts and so reaches the same verdicts: rank 0
// alone prints them.
#define SAY(...)                                           \
    do {                                                   \
        if (x->world->rank == 0) fprintf(stderr, __VA_ARGS__); \
    } while (0)

// One `lowbit sample` run: its configuration (the model section read from the checkpoint), the
// prompts and their samples' requests, and the parallel pieces (src/cli/run.h).
typedef struct {
    lb_config cfg;
    const lb_config *c;            // &cfg
    lb_comm *world;
    lb_sampler_config sc;
    int np, is_arith;              // prompts; arithmetic problems (their answers are checked)
    char **prompt;                 // (np) the prompts' text
    char *text;                    // the prompts file, cut into prompt's lines
    int32_t **ptok;                // (np) their tokens
    int *plen;                     // (np) tokens of each prompt
    lb_run_tokenizer tokenizer;    // data.tokenizer's or the checkpoint's; tokenizer.tk NULL: bytes
    int longest;                   // tokens of the longest prompt
    int S, n;                      // samples of each prompt; requests (np x S)
    lb_run run;
    lb_sampler *smp;
    lb_sample_req *reqs;           // (n)
    int32_t *tok;                  // (n, max_new_tokens)
    float *lp;                     // (n, max_new_tokens)
    lb_sample_stats st;
} sample_run;

// The checkpoint named, its model section and the sampler's settings. 0 or 1.
static int sample_config(sample_run *x)
{
    char err[ERRLEN], where[LB_PATH_MAX + 32];
    lb_config *c = &x->cfg;
    if (!c->sample.checkpoint[0]) {
        SAY("%ssample.checkpoint is empty: name the checkpoint to sample from\n",
            lb_key_where(c, "sample", "checkpoint", where, sizeof where));
        return 1;
    }
    if (lb_model_config_from_checkpoint(c, c->sample.checkpoint, err, sizeof err) != 0 ||
        lb_run_tokenizer_open(&x->tokenizer, c, c->sample.checkpoint, err, sizeof err) != 0 ||
        lb_run_stop_tokens(c, &x->tokenizer, err, sizeof err) != 0 ||
        lb_rl_sampler_config(c, &x->sc, err, sizeof err) != 0) {
        SAY("lowbit sample: %s\n", err);
        return 1;
    }
    if (!x->tokenizer.tk && c->model.vocab_size < LB_BYTE_VOCAB) {
        SAY("lowbit sample: prompts are bytes (no data.tokenizer); the model's vocabulary has "
            "only %d tokens\n",
            c->model.vocab_size);
        return 1;
    }
    return 0;
}

// The prompts: the command line's (--prompt TEXT, each one prompt), or the lines of
// sample.prompts (a file, or "-": stdin, which rank 0 reads for all; a final line without '\n'
// counts). An empty one is refused, naming where it stands. 0 or 1.
static int read_prompts(sample_run *x)
{
    char err[ERRLEN], where[LB_PATH_MAX + 32];
    const lb_config *c = x->c;
    if (c->nprompt) {
        if (c->sample.prompts[0]) {
            SAY("%ssample.prompts and --prompt both give prompts: use one\n",
                lb_key_where(c, "sample", "prompts", where, sizeof where));
            return 1;
        }
        x->prompt = lb_calloc((size_t)c->nprompt, sizeof *x->prompt);
        for (; x->np < c->nprompt; x->np++) {
            x->prompt[x->np] = (char *)c->prompt[x->np];
            if (!x->prompt[x->np][0]) {
                SAY("--prompt %d of %d is empty\n", x->np + 1, c->nprompt);
                return 1;
            }
        }
        return 0;
    }
    const char *name = strcmp(c->sample.prompts, "-") ? c->sample.prompts : "stdin";
    // the prompts after a NUL byte would be dropped unseen: refused
    x->text = lb_read_everywhere(x->world, c->sample.prompts, 1, err, sizeof err);
    if (!x->text) {
        SAY("lowbit sample: %s\n", err);
        return 1;
    }
    for (char *p = x->text; *p;) {
        char *e = strchr(p, '\n');
        size_t w = e ? (size_t)(e - p) : strlen(p);
        if (w && p[w - 1] == '\r') p[w - 1] = 0;
        p[w] = 0;
        x->prompt = realloc(x->prompt, (size_t)(x->np + 1) * sizeof *x->prompt);
        if (!x->prompt) lb_die("out of memory");
        x->prompt[x->np++] = p;
        if (!e) break;
        p = e + 1;
    }
    for (int i = 0; i < x->np; i++)
        if (!x->prompt[i][0]) {
            SAY("%s:%d: empty prompt (every line is one prompt)\n", name, i + 1);
            return 1;
        }
    if (!x->np) {
        SAY("%s: no prompts\n", name);
        return 1;
    }
    return 0;
}

// Prompts: lines of a file, or problems of the arithmetic task's sample.split; their tokens.
// 0 or 1.
static int sample_prompts(sample_run *x)
{
    char where[LB_PATH_MAX + 32];
    const lb_config *c = x->c;
    x->is_arith = !c->sample.prompts[0] && !c->nprompt;
    if (x->is_arith && !strcmp(c->sample.split, "val") && !(c->gen.val_fraction > 0)) {
        SAY("%sgen.val_fraction is 0: the val split is empty\n",
            lb_key_where(c, "gen", "val_fraction", where, sizeof where));
        return 1;
    }
    if (x->is_arith) {
        x->np = c->sample.problems;
        x->prompt = lb_calloc((size_t)x->np, sizeof *x->prompt);
        for (int i = 0; i < x->np; i++) {
            x->prompt[i] = lb_malloc(64);
            lb_arith_prompt(c, lb_arith_nth(c, !strcmp(c->sample.split, "val"), (uint64_t)i),
                            x->prompt[i]);
        }
    } else if (read_prompts(x) != 0) {
        return 1;
    }
    x->S = c->sample.samples;
    x->n = x->np * x->S;
    x->ptok = lb_calloc((size_t)x->np, sizeof *x->ptok);
    x->plen = lb_calloc((size_t)x->np, sizeof *x->plen);
    for (int i = 0; i < x->np; i++) {
        int len = (int)strlen(x->prompt[i]);
        if (x->tokenizer.tk) {
            char err[ERRLEN];
            lb_tokens t = {0};
            if (lb_tokenizer_encode(x->tokenizer.tk, x->prompt[i], (size_t)len, &t, err, sizeof err) != 0) {
                if (c->nprompt) SAY("--prompt %d: %s\n", i + 1, err);
                else SAY("%s:%d: %s\n", strcmp(c->sample.prompts, "-") ? c->sample.prompts
                                                                         : "stdin", i + 1, err);
                lb_tokens_free(&t);
                return 1;
            }
            len = (int)t.n;
            x->ptok[i] = lb_malloc(((size_t)len + 1) * sizeof(int32_t));
            for (int j = 0; j < len; j++) x->ptok[i][j] = (int32_t)t.ids[j];
            lb_tokens_free(&t);
        } else {
            x->ptok[i] = lb_malloc(((size_t)len + 1) * sizeof(int32_t));
            for (int j = 0; j < len; j++) x->ptok[i][j] = (unsigned char)x->prompt[i][j];
        }
        x->plen[i] = len;
        if (len > x->longest) x->longest = len;
    }
    return 0;
}

static int check_sample_layout(const lb_config *c, const lb_grid *g, char *err, size_t errlen)
{
    return lb_sampler_check_layout(c, g, "lowbit sample", err, errlen);
}

// The layout: tensor and expert parallelism split the model over the ranks (every rank samples
// every prompt, in lockstep; data-parallel ranks repeat the work); no pipeline or sequence
// parallelism in the sampler. Then the backend, the model piece with the checkpoint's weights
// (rank 0 reads, every rank gets its pieces) and the sampler. 0 or 1.
static int sample_open(sample_run *x)
{
    char err[ERRLEN];
    const lb_config *c = x->c;
    lb_run *r = &x->run;
    if (lb_run_layout(r, c, x->world, "lowbit sample", check_sample_layout) != 0 ||
        lb_run_setup(r, 1) != 0)
        return 1;
    int bad = lb_checkpoint_load_weights(c->sample.checkpoint, r->m, x->world,
                                         x->world->size > 1 ? &c->parallel : NULL, err,
                                         sizeof err) != 0;
    if (lb_run_failed(r, bad, err)) return 1;
    int capacity = x->longest + x->sc.max_new_tokens;
    if (capacity > r->m->cfg.max_position_embeddings) {
        SAY("lowbit sample: the longest prompt (%d tokens) plus sample.max_new_tokens (%d) "
            "exceeds model.max_position_embeddings (%d)\n", x->longest, x->sc.max_new_tokens,
            r->m->cfg.max_position_embeddings);
        return 1;
    }
    x->smp = lb_sampler_create(r->m, &x->sc, capacity, err, sizeof err);
    if (!x->smp) {
        SAY("lowbit sample: %s\n", err);
        return 1;
    }
    return 0;
}

// S samples of every prompt: sample s of prompt i draws from stream (i, s) of sample.seed.
// 0 or 1.
static int sample_generate(sample_run *x)
{
    char err[ERRLEN];
    const int S = x->S, max_new = x->sc.max_new_tokens;
    x->reqs = lb_calloc((size_t)x->n, sizeof *x->reqs);
    x->tok = lb_malloc((size_t)x->n * max_new * sizeof(int32_t));
    x->lp = lb_malloc((size_t)x->n * max_new * sizeof(float));
    for (int i = 0; i < x->np; i++)
        for (int s = 0; s < S; s++) {
            lb_sample_req *q = &x->reqs[i * S + s];
            q->prompt = x->ptok[i];
            q->prompt_len = x->plen[i];
            q->seed = x->c->sample.seed;
            q->stream = lb_sample_stream((uint64_t)i, (uint64_t)s);
            q->tokens = x->tok + (size_t)(i * S + s) * max_new;
            q->logprobs = x->lp + (size_t)(i * S + s) * max_new;
        }
    if (lb_sampler_run(x->smp, x->reqs, x->n, &x->st, err, sizeof err) != 0) {
        SAY("lowbit sample: %s\n", err);
        return 1;
    }
    return 0;
}


// Rank 0: prompt<TAB>completion<TAB>sum of log-probs[<TAB>correct|wrong], escaped on one line
// each, then the totals (and pass@1, pass@S for the arithmetic task).
static void sample_print(const sample_run *x)
{
    const lb_config *c = x->c;
    const int np = x->np, S = x->S, n = x->n, is_arith = x->is_arith;
    if (x->tokenizer.tk)
        printf("# text through %s (%d tokens); stop tokens %s\n", x->tokenizer.name,
               lb_tokenizer_vocab_size(x->tokenizer.tk), c->sample.stop_tokens);
    printf("# prompt\tcompletion\tsum of log-probs%s\n", is_arith ? "\tanswer" : "");
    int right = 0, any = 0;
    for (int i = 0; i < np; i++) {
        int ok_any = 0;
        for (int s = 0; s < S; s++) {
            const lb_sample_req *r = &x->reqs[i * S + s];
            double sum = 0.0;
            for (int j = 0; j < r->len; j++) sum += r->logprobs[j];
            size_t clen;
            char *ctext = lb_tokens_text(x->tokenizer.tk, r->tokens, r->len, 1, &clen);
            print_escaped(x->prompt[i], strlen(x->prompt[i]));
            putchar('\t');
            print_escaped(ctext, clen);
            printf("\t%.4f", sum);
            if (is_arith) {
                long want, got;
                const char *p = x->prompt[i];
                int ok = lb_arith_answer(p + (p[0] == '\n'), &want) == 0 &&
                         lb_arith_parse_completion(ctext, clen, &got) == 0 && got == want;
                printf("\t%s", ok ? "correct" : "wrong");
                right += ok;
                ok_any |= ok;
            }
            putchar('\n');
            free(ctext);
        }
        any += ok_any;
    }
    const lb_sample_stats *st = &x->st;
    printf("# %d completions of %d prompts: %ld tokens in %.2f s (%.0f tok/s), %ld forward "
           "calls\n", n, np, st->generated, st->seconds,
           st->generated / (st->seconds > 0 ? st->seconds : 1e-9), st->forwards);
    if (is_arith) {   // pass@S only where it says more than pass@1
        printf("# arithmetic (%s split): pass@1 %.4f", c->sample.split, (double)right / n);
        if (S > 1) printf(", pass@%d %.4f", S, (double)any / np);
        printf("\n");
    }
}

// Frees what was made, also of a run that stopped during its setup.
static void sample_free(sample_run *x)
{
    lb_sampler_free(x->smp);
    lb_run_teardown(&x->run);
    for (int i = 0; i < x->np; i++) {
        if (x->ptok) free(x->ptok[i]);
        if (x->is_arith && x->prompt) free(x->prompt[i]);
    }
    lb_run_tokenizer_close(&x->tokenizer);
    free(x->ptok), free(x->plen), free(x->prompt), free(x->text), free(x->reqs), free(x->tok), free(x->lp);
}

int lb_cmd_sample(const lb_config *c0, lb_comm *comm)
{
    sample_run run, *x = &run;
    memset(x, 0, sizeof *x);
    x->cfg = *c0;
    x->c = &x->cfg;
    x->world = comm;
    if (sample_config(x) != 0 || sample_prompts(x) != 0 || sample_open(x) != 0 ||
        sample_generate(x) != 0) {
        sample_free(x);
        return 1;
    }
    if (comm->rank == 0) sample_print(x);
    sample_free(x);
    return 0;
}
