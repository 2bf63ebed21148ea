// tokenize_cmd.c: `lowbit data tokenize`: text and JSON-lines files -> token shards through a
// Hugging Face tokenizer (src/io/tokenizer.c), the files shared round-robin over the MPI ranks.
//
// Input file i (in the order of gen.input's globs, each sorted) is tokenized by rank
// i mod size and written as PREFIX_train_FFF_NNN.bin and PREFIX_val_FFF_NNN.bin (FFF = i), so
// the loader's name-sorted glob PREFIX_train_*.bin reads the corpus in input order whatever the
// number of ranks. A text file is one document; a .jsonl or .ndjson file holds one document a
// line (the string field gen.text_field). gen.eos_token, when set, follows every document.
// Of each file's tokens the first (1 - val_fraction) train and the rest validate, the cut moved
// to the next document end when the file holds several documents.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cJSON.h>
#include "src/cli/commands.h"
#include "src/io/files.h"
#include "src/io/data.h"
#include "src/io/json.h"
#include "src/io/tokenizer.h"

typedef struct {
    const lb_tokenizer *tok;
    int eos;                     // -1: none
    double t0, last_print;
    double bytes, tokens;        // this rank's progress
    int file, nfiles;            // this rank's files done, and its share
    int tty;
    int report;                  // rank 0 prints the progress line
} tk_state;

static void progress(tk_state *s, int final)
{
    double now = lb_now();
    if (!final && now - s->last_print < 0.5) return;
    s->last_print = now;
    double dt = now - s->t0 > 1e-9 ? now - s->t0 : 1e-9;
    fprintf(stderr, "%stokenize: rank 0 file %d/%d, %.1f MB, %.0f tokens, %.2f MB/s%s",
            s->tty ? "\r" : "", s->file, s->nfiles, s->bytes / 1e6, s->tokens,
            s->bytes / 1e6 / dt, s->tty && !final ? "" : "\n");
}

// One document: its tokens (then eos) appended, its end recorded.
static int add_doc(tk_state *s, const char *text, size_t len, lb_tokens *out, size_t **ends,
                   size_t *nends, size_t *capends, const char *where, char *err, size_t errlen)
{
    char msg[768];
    if (lb_tokenizer_encode(s->tok, text, len, out, msg, sizeof msg) != 0) {
        snprintf(err, errlen, "%s: %s", where, msg);
        return -1;
    }
    if (s->eos >= 0 && lb_tokens_push(out, (uint32_t)s->eos) != 0) goto oom;
    if (*nends == *capends) {
        size_t cap = *capends ? 2 * *capends : 64;
        size_t *e = realloc(*ends, cap * sizeof *e);
        if (!e) goto oom;
        *ends = e;
        *capends = cap;
    }
    (*ends)[(*nends)++] = out->n;
    s->bytes += (double)len;
    return 0;
oom:
    snprintf(err, errlen, "%s: out of memory", where);
    return -1;
}

static int is_jsonl(const char *path)
{
    size_t n = strlen(path);
    return (n > 6 && !strcmp(path + n - 6, ".jsonl")) || (n > 7 && !strcmp(path + n - 7, ".ndjson"));
}

static int tokenize_file(tk_state *s, const lb_config *c, const char *path, int index, int width,
                         double *ntrain, double *nval, char *err, size_t errlen)
{
    size_t len;
    char *text = lb_read_file(path, &len, err, errlen);
    if (!text) return -1;
    lb_tokens tok = {0};
    size_t *ends = NULL, nends = 0, capends = 0;
    int rc = -1;
    if (is_jsonl(path)) {
        size_t line = 0;
        for (char *p = text, *end = text + len; p < end;) {
            char *nl = memchr(p, '\n', (size_t)(end - p));
            size_t n = nl ? (size_t)(nl - p) : (size_t)(end - p);
            line++;
            size_t blank = 0;
            while (blank < n && strchr(" \t\r", p[blank])) blank++;
            if (blank < n) {
                char where[LB_PATH_MAX + 32];
                snprintf(where, sizeof where, "%s:%zu", path, line);
                cJSON *j = lb_json_parse(p, n, path, (int)line, err, errlen);
                if (!j) goto out;   // strict: a NUL, bytes after the value, a key twice
                const cJSON *f = cJSON_GetObjectItemCaseSensitive(j, c->gen.text_field);
                if (!cJSON_IsObject(j) || !cJSON_IsString(f)) {
                    snprintf(err, errlen, "%s: not a JSON object with a string \"%s\"", where,
                             c->gen.text_field);
                    cJSON_Delete(j);
                    goto out;
                }
                int r = add_doc(s, f->valuestring, strlen(f->valuestring), &tok, &ends, &nends,
                                &capends, where, err, errlen);
                cJSON_Delete(j);
                if (r != 0) goto out;
                if (s->report) progress(s, 0);

            }
            p += n + 1;
        }
    } else if (add_doc(s, text, len, &tok, &ends, &nends, &capends, path, err, errlen) != 0) {
        goto out;
    }
    // The split: the first (1 - val_fraction) of the tokens, to the next document end.
    size_t cut = (size_t)llround((1.0 - c->gen.val_fraction) * (double)tok.n);
    if (nends > 1)
        for (size_t k = 0; k < nends; k++)
            if (ends[k] >= cut) {
                cut = ends[k];
                break;
            }
    char name[2][48];
    snprintf(name[0], sizeof name[0], "train_%0*d", width, index);
    snprintf(name[1], sizeof name[1], "val_%0*d", width, index);
    if (lb_data_write_split(c->gen.output, name[0], tok.ids, cut, c->gen.shard_tokens, err,
                            errlen) != 0 ||
        lb_data_write_split(c->gen.output, name[1], tok.ids + cut, tok.n - cut,
                            c->gen.shard_tokens, err, errlen) != 0)
        goto out;
    *ntrain += (double)cut;
    *nval += (double)(tok.n - cut);
    s->tokens += (double)tok.n;
    rc = 0;
out:
    lb_tokens_free(&tok);
    free(ends);
    free(text);
    return rc;
}

// gen.input (comma list of globs) -> the files, as one '\n'-joined text (rank 0 expands it and
// every rank gets the same list).
static char *input_files(const char *spec, int *nfiles)
{
    size_t cap = 256, len = 0;
    char *out = malloc(cap);
    if (!out) return NULL;
    out[0] = 0;
    *nfiles = 0;
    char buf[LB_PATH_MAX];
    snprintf(buf, sizeof buf, "%s", spec);
    for (char *save = NULL, *g = strtok_r(buf, ",", &save); g; g = strtok_r(NULL, ",", &save)) {
        while (*g == ' ') g++;
        char **list;
        int n = lb_glob(g, &list);
        for (int i = 0; i < n; i++) {
            size_t k = strlen(list[i]);
            if (len + k + 2 > cap) {
                while (len + k + 2 > cap) cap *= 2;
                char *o = realloc(out, cap);
                if (!o) {
                    lb_glob_free(list, n);
                    free(out);
                    return NULL;
                }
                out = o;
            }
            memcpy(out + len, list[i], k);
            len += k;
            out[len++] = '\n';
            out[len] = 0;
            (*nfiles)++;
        }
        lb_glob_free(list, n);
    }
    return out;
}

// Rank 0, before anything is written: every PREFIX_{train,val}_*.bin present must be one this
// run may overwrite (PREFIX_SPLIT_FFF_NNN.bin with FFF < nfiles in this run's width); anything
// else (an earlier corpus with more files, or `lowbit data`'s PREFIX_train_NNN.bin) would be
// mixed in by the loader's glob.
static int check_stale(const char *prefix, int nfiles, int width, char *err, size_t errlen)
{
    static const char *split[2] = {"train", "val"};
    int rc = 0;
    for (int s = 0; s < 2 && rc == 0; s++) {
        char pattern[LB_PATH_MAX + 32];
        int head = snprintf(pattern, sizeof pattern, "%s_%s_", prefix, split[s]);
        snprintf(pattern + head, sizeof pattern - (size_t)head, "*.bin");
        char **list;
        int n = lb_glob(pattern, &list);
        for (int i = 0; i < n && rc == 0; i++) {
            const char *p = list[i] + head;
            size_t d1 = strspn(p, "0123456789");
            size_t d2 = p[d1] == '_' ? strspn(p + d1 + 1, "0123456789") : 0;
            int ok = (int)d1 == width && d2 > 0 && !strcmp(p + d1 + 1 + d2, ".bin") &&
                     atoi(p) < nfiles;
            if (!ok) {
                snprintf(err, errlen, "%s: shard of an earlier corpus that this one would not "
                         "replace; the loader would mix it in (remove it or choose another "
                         "gen.output)", list[i]);
                rc = -1;
            }
        }
        lb_glob_free(list, n);
    }
    return rc;
}

// Removes the shards of input file i (PREFIX_train_I_*.bin and PREFIX_val_I_*.bin).
static void remove_shards(const char *prefix, int width, int i)
{
    const char *split[2] = {"train", "val"};
    for (int k = 0; k < 2; k++) {
        char pattern[1200], **list;
        snprintf(pattern, sizeof pattern, "%s_%s_%0*d_*.bin", prefix, split[k], width, i);
        int n = lb_glob(pattern, &list);
        for (int j = 0; j < n; j++) unlink(list[j]);
        lb_glob_free(list, n);
    }
}

int lb_cmd_data_tokenize(const lb_config *c, lb_comm *comm)
{
    char err[2048] = "";
    int failed = 0;
    lb_tokenizer *tok = NULL;
    char *files = NULL;
    long long flen = -1;
    int nfiles = 0;
    if (!c->data.tokenizer[0]) {
        snprintf(err, sizeof err, "data.tokenizer is empty: name the tokenizer.json to use");
        failed = 1;
    } else if (!c->gen.input[0]) {
        snprintf(err, sizeof err, "gen.input is empty: name the text or .jsonl files (globs)");
        failed = 1;
    } else if (!(tok = lb_tokenizer_load(c->data.tokenizer, err, sizeof err))) {
        failed = 1;
    }
    int eos = -1;
    if (!failed && c->gen.eos_token[0] && (eos = lb_tokenizer_token_id(tok, c->gen.eos_token)) < 0) {
        snprintf(err, sizeof err, "gen.eos_token: \"%s\" is not a token of %s", c->gen.eos_token,
                 c->data.tokenizer);
        failed = 1;
    }
    if (comm->rank == 0 && !failed) {
        files = input_files(c->gen.input, &nfiles);
        if (!files) {
            snprintf(err, sizeof err, "out of memory");
            failed = 1;
        } else if (nfiles == 0) {
            snprintf(err, sizeof err, "gen.input: no file matches \"%s\"", c->gen.input);
            failed = 1;
        }
    }
    int width = 3;
    while (nfiles > 1 && width < 10 && nfiles - 1 >= (int)pow(10, width)) width++;
    if (comm->rank == 0 && !failed && check_stale(c->gen.output, nfiles, width, err, sizeof err))
        failed = 1;
    // Every rank stops together on any error so far, and gets the file list.
    // One line for an error every rank meets (a bad tokenizer.json): rank 0 says it; another
    // rank speaks only for an error of its own.
    int failed0 = failed;
    lb_comm_bcast(comm, &failed0, sizeof failed0, 0);
    if (lb_comm_allreduce_sum(comm, failed) > 0) {
        if (failed && (comm->rank == 0 || !failed0))
            fprintf(stderr, "lowbit data tokenize: %s\n", err);
        lb_tokenizer_free(tok);
        free(files);
        return 1;
    }
    flen = comm->rank == 0 ? (long long)strlen(files) : 0;
    lb_comm_bcast(comm, &flen, sizeof flen, 0);
    lb_comm_bcast(comm, &nfiles, sizeof nfiles, 0);
    lb_comm_bcast(comm, &width, sizeof width, 0);
    if (comm->rank != 0) files = malloc((size_t)flen + 1);
    lb_comm_bcast(comm, files, (size_t)flen + 1, 0);

    tk_state s = {.tok = tok, .eos = eos, .t0 = lb_now(), .tty = isatty(2),
                  .report = comm->rank == 0};
    for (int i = comm->rank; i < nfiles; i += comm->size) s.nfiles++;
    double ntrain = 0, nval = 0;
    char *p = files;
    for (int i = 0; i < nfiles && !failed; i++) {
        char *nl = strchr(p, '\n');
        *nl = 0;
        if (i % comm->size == comm->rank) {
            if (tokenize_file(&s, c, p, i, width, &ntrain, &nval, err, sizeof err) != 0) {
                fprintf(stderr, "lowbit data tokenize: %s\n", err);
                failed = 1;
            }
            s.file++;
            if (s.report && !failed) progress(&s, s.file == s.nfiles);
        }
        p = nl + 1;
    }
    // A failed rank has said why; all of them exit non-zero, and each removes the shards of
    // the files it took (doc/data.md: no output after an error).
    int anyfail = lb_comm_allreduce_sum(comm, failed) > 0;
    for (int i = comm->rank; anyfail && i < nfiles; i += comm->size)
        remove_shards(c->gen.output, width, i);
    double tt = lb_comm_allreduce_sum(comm, ntrain), tv = lb_comm_allreduce_sum(comm, nval);
    double tb = lb_comm_allreduce_sum(comm, s.bytes);
    if (comm->rank == 0 && !anyfail)
        printf("tokenize: %d file(s), %.0f bytes -> train %.0f tokens %s_train_*.bin, val %.0f "
               "tokens %s_val_*.bin (%.3f bytes/token, %.1f s)\n", nfiles, tb, tt,
               c->gen.output, tv, c->gen.output, tt + tv > 0 ? tb / (tt + tv) : 0.0,
               lb_now() - s.t0);
    lb_tokenizer_free(tok);
    free(files);
    return anyfail ? 1 : 0;
}
