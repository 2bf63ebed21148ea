// data_cmd.c: `lowbit data`: writes token shards (the arithmetic corpus or a text file) and
// reports their size and unigram entropy, the loss a model that ignores context would reach.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "src/cli/commands.h"
#include "src/io/data.h"
#include "src/io/files.h"

// Tokens and unigram entropy (nats) over the shards matching pattern.
static int shard_stats(const char *pattern, int *nfiles, size_t *ntok, double *entropy,
                       char *err, size_t errlen)
{
    char **list;
    int n = lb_glob(pattern, &list);
    size_t hist[LB_BYTE_VOCAB] = {0}, total = 0;
    for (int i = 0; i < n; i++) {
        uint32_t *tok;
        size_t len;
        if (lb_shard_read(list[i], &tok, &len, err, errlen) != 0) {
            lb_glob_free(list, n);
            return -1;
        }
        for (size_t j = 0; j < len; j++) hist[tok[j] < LB_BYTE_VOCAB ? tok[j] : 0]++;
        total += len;
        free(tok);
    }
    lb_glob_free(list, n);
    double h = 0.0;
    for (int v = 0; v < LB_BYTE_VOCAB; v++)
        if (hist[v]) {
            double p = (double)hist[v] / total;
            h -= p * log(p);
        }
    *nfiles = n;
    *ntok = total;
    *entropy = h;
    return 0;
}

// The corpus's shards (PREFIX_train_N.bin, PREFIX_val_N.bin): their count, their inodes into
// ino when it is not NULL (cap of them), and with clear, removed.
static int corpus_shards(const char *prefix, ino_t *ino, int cap, int clear)
{
    static const char *split[2] = {"train", "val"};
    int count = 0;
    for (int s = 0; s < 2; s++) {
        char pattern[LB_PATH_MAX + 32], **list;
        int head = snprintf(pattern, sizeof pattern, "%s_%s_", prefix, split[s]);
        snprintf(pattern + head, sizeof pattern - (size_t)head, "*.bin");
        int n = lb_glob(pattern, &list);
        for (int i = 0; i < n; i++) {
            const char *num = list[i] + head;
            size_t d = strspn(num, "0123456789");
            struct stat st;
            if (d == 0 || strcmp(num + d, ".bin") != 0 || stat(list[i], &st) != 0) continue;
            if (ino && count < cap) ino[count] = st.st_ino;
            count++;
            if (clear) unlink(list[i]);
        }
        lb_glob_free(list, n);
    }
    return count;
}

static ino_t *corpus_inodes(const char *prefix, int *n)
{
    *n = corpus_shards(prefix, NULL, 0, 0);
    ino_t *ino = malloc(sizeof *ino * (size_t)(*n + 1));
    if (ino) *n = corpus_shards(prefix, ino, *n, 0);
    return ino;
}

// After a failed write: when the run has written a shard (an atomic write gives it a new
// inode), the corpus is a mix of this run's shards and an earlier corpus's, which the loader
// would take without a word; all of them go. A run that wrote none leaves the files as they were.
static void corpus_undo(const char *prefix, const ino_t *before, int nbefore)
{
    int n;
    ino_t *now = corpus_inodes(prefix, &n);
    int written = !now;   // cannot tell: assume written
    for (int i = 0; now && i < n && !written; i++) {
        int old = 0;
        for (int j = 0; j < nbefore && !old; j++) old = now[i] == before[j];
        written = !old;
    }
    free(now);
    if (written) corpus_shards(prefix, NULL, 0, 1);
}

int lb_cmd_data(const lb_config *c, lb_comm *comm)
{
    if (comm->rank != 0) return 0;
    char err[1024];
    int rc;
    if (strcmp(c->gen.kind, "arithmetic") != 0 && !c->gen.input[0]) {
        fprintf(stderr, "lowbit data: gen.input is empty: name the text file to tokenize\n");
        return 1;
    }
    // The output's directory is made here, not by the writer, so that a failed run can remove
    // what it made: no empty directory, no partial corpus after an error (2026-12-07).
    char dir[LB_PATH_MAX];
    snprintf(dir, sizeof dir, "%s", c->gen.output);
    char *slash = strrchr(dir, '/');
    lb_dirs_made made = {"", ""};
    if (slash && slash != dir) {
        *slash = 0;
        if (lb_mkdirs_made(dir, &made, err, sizeof err) != 0) {
            fprintf(stderr, "lowbit data: %s\n", err);
            return 1;
        }
    }
    int nbefore;
    ino_t *before = corpus_inodes(c->gen.output, &nbefore);
    if (strcmp(c->gen.kind, "arithmetic") == 0) {
        rc = lb_data_gen_arith(c->gen.output, c->gen.problems, c->gen.max_operand,
                               c->gen.val_fraction, c->gen.shard_tokens, c->gen.seed, err,
                               sizeof err);
    } else {
        rc = lb_data_gen_text(c->gen.output, c->gen.input, c->gen.val_fraction,
                              c->gen.shard_tokens, err, sizeof err);
    }
    if (rc != 0) {
        fprintf(stderr, "lowbit data: %s\n", err);
        corpus_undo(c->gen.output, before, before ? nbefore : 0);
        free(before);
        lb_dirs_unmake(&made);
        return 1;
    }
    free(before);
    static const char *split[2] = {"train", "val"};
    for (int s = 0; s < 2; s++) {
        char pattern[LB_PATH_MAX + 32];
        int nfiles;
        size_t ntok;
        double h;
        snprintf(pattern, sizeof pattern, "%s_%s_*.bin", c->gen.output, split[s]);
        if (shard_stats(pattern, &nfiles, &ntok, &h, err, sizeof err) != 0) {
            fprintf(stderr, "lowbit data: %s\n", err);
            return 1;
        }
        printf("%-5s %zu tokens in %d shard(s) %s, unigram entropy %.4f nats/token\n", split[s],
               ntok, nfiles, pattern, h);
    }
    return 0;
}
