// data_cmd.c: `lowbit data`: writes token shards (the arithmetic corpus or a text file) and
// reports their size and unigram entropy, the loss a model that ignores context would reach.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "src/cli/commands.h"
#include "src/io/data.h"
#include "src/cli/util.h"

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

int lb_cmd_data(const lb_config *c, lb_comm *comm)
{
    if (comm->rank != 0) return 0;
    char err[1024];
    int rc;
    if (strcmp(c->gen.kind, "arithmetic") == 0) {
        rc = lb_data_gen_arith(c->gen.output, c->gen.problems, c->gen.max_operand,
                               c->gen.val_fraction, c->gen.shard_tokens, c->gen.seed, err,
                               sizeof err);
    } else {
        if (!c->gen.input[0]) {
            fprintf(stderr, "lowbit data: gen.input is empty: name the text file to tokenize\n");
            return 1;
        }
        rc = lb_data_gen_text(c->gen.output, c->gen.input, c->gen.val_fraction,
                              c->gen.shard_tokens, err, sizeof err);
    }
    if (rc != 0) {
        fprintf(stderr, "lowbit data: %s\n", err);
        return 1;
    }
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
