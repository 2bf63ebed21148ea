// prompts.c: JSON-lines prompt sets, their split and draw order, the chat template
// (prompts.h).
#include "src/rl/prompts.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kernels/common.h"
#include "src/io/files.h"
#include "src/io/json.h"

#define LB_PROMPT_SPLIT_STREAM 0x73706c6974ull   // which prompts are held out ("split")
#define LB_PROMPT_ORDER_STREAM 0x6f72646572ull   // the passes' permutations ("order")

static char *dup_str(const char *s)
{
    size_t n = strlen(s) + 1;
    return memcpy(lb_malloc(n), s, n);
}

// One line's object into *p. -1 with "path:line: what".
static int read_line(const char *text, size_t len, const char *path, int line,
                     const char *prompt_key, const char *answer_key, lb_prompt *p, char *err,
                     size_t errlen)
{
    cJSON *o = lb_json_parse(text, len, path, line, err, errlen);
    if (!o) return -1;
    int rc = -1;
    const cJSON *q = cJSON_IsObject(o) ? cJSON_GetObjectItemCaseSensitive(o, prompt_key) : NULL;
    const cJSON *a = answer_key[0] && cJSON_IsObject(o)
                         ? cJSON_GetObjectItemCaseSensitive(o, answer_key) : NULL;
    if (!cJSON_IsObject(o))
        snprintf(err, errlen, "%s:%d: not a JSON object (a line is one prompt: {\"%s\": ...})",
                 path, line, prompt_key);
    else if (!cJSON_IsString(q))
        snprintf(err, errlen, "%s:%d: no string \"%s\" (rl.prompt_field names the prompt's key)",
                 path, line, prompt_key);
    else if (!q->valuestring[0])
        snprintf(err, errlen, "%s:%d: \"%s\" is empty", path, line, prompt_key);
    else if (answer_key[0] && !cJSON_IsString(a) && !cJSON_IsNumber(a))
        snprintf(err, errlen, "%s:%d: no \"%s\" as a string or a number (rl.answer_field names "
                 "the reference answer's key)", path, line, answer_key);
    else {
        char num[32];
        if (cJSON_IsNumber(a)) snprintf(num, sizeof num, "%.15g", a->valuedouble);
        p->prompt = dup_str(q->valuestring);
        p->answer = dup_str(!a ? "" : cJSON_IsString(a) ? a->valuestring : num);
        p->line = line;
        rc = 0;
    }
    cJSON_Delete(o);
    return rc;
}

int lb_prompts_read(const char *path, const char *prompt_key, const char *answer_key,
                    lb_prompt_set *out, char *err, size_t errlen)
{
    memset(out, 0, sizeof *out);
    out->owner = 1;
    size_t len;
    char *text = lb_read_file(path, &len, err, errlen);
    if (!text) return -1;
    int rc = 0, cap = 0;
    const char *p = text, *end = text + len;
    for (int line = 1; p < end && rc == 0; line++) {
        const char *e = memchr(p, '\n', (size_t)(end - p));
        size_t n = e ? (size_t)(e - p) : (size_t)(end - p);
        size_t blank = strspn(p, " \t\r");
        if (blank < n) {
            if (out->n == cap) {
                cap = cap ? 2 * cap : 64;
                out->p = realloc(out->p, (size_t)cap * sizeof *out->p);
                if (!out->p) lb_die("out of memory");
            }
            rc = read_line(p, n, path, line, prompt_key, answer_key, &out->p[out->n], err,
                           errlen);
            out->n += rc == 0;
        }
        p = e ? e + 1 : end;
    }
    free(text);
    if (rc == 0 && !out->n) {
        snprintf(err, errlen, "%s: no prompts (one JSON object a line)", path);
        rc = -1;
    }
    if (rc != 0) lb_prompts_free(out);
    return rc;
}

void lb_prompts_free(lb_prompt_set *s)
{
    for (int i = 0; s->owner && i < s->n; i++) free(s->p[i].prompt), free(s->p[i].answer);
    free(s->p);
    memset(s, 0, sizeof *s);
}

// A permutation of 0..n-1 from (seed, stream, counter): Fisher-Yates.
static void permute(int *perm, int n, uint64_t seed, uint64_t stream, uint64_t counter)
{
    for (int i = 0; i < n; i++) perm[i] = i;
    for (int i = n - 1; i > 0; i--) {
        uint64_t r = lb_rand_u64(seed, stream + (uint64_t)i, counter);
        int k = (int)(r % (uint64_t)(i + 1)), t = perm[i];
        perm[i] = perm[k];
        perm[k] = t;
    }
}

int lb_prompts_split(const lb_prompt_set *all, double fraction, uint64_t seed,
                     lb_prompt_set *train, lb_prompt_set *val, char *err, size_t errlen)
{
    const int n = all->n;
    int nv = (int)floor(fraction * n + 0.5);
    if (fraction > 0 && nv == 0) nv = 1;
    if (nv >= n) {
        snprintf(err, errlen, "rl.val_fraction %g of %d prompts leaves none to train on", fraction,
                 n);
        return -1;
    }
    int *perm = lb_malloc((size_t)n * sizeof *perm);
    char *held = lb_calloc((size_t)n, 1);
    permute(perm, n, seed, LB_PROMPT_SPLIT_STREAM, 0);
    for (int i = 0; i < nv; i++) held[perm[i]] = 1;
    *train = (lb_prompt_set){0, lb_malloc((size_t)(n - nv) * sizeof(lb_prompt)), 0};
    *val = (lb_prompt_set){0, lb_malloc((size_t)(nv ? nv : 1) * sizeof(lb_prompt)), 0};
    for (int i = 0; i < n; i++) {
        lb_prompt_set *s = held[i] ? val : train;
        s->p[s->n++] = all->p[i];
    }
    free(perm);
    free(held);
    return 0;
}

void lb_prompt_order_init(lb_prompt_order *o, uint64_t seed, int n)
{
    *o = (lb_prompt_order){seed, n, -1, lb_malloc((size_t)n * sizeof(int))};
}

int lb_prompt_order_at(lb_prompt_order *o, uint64_t i)
{
    int64_t e = (int64_t)(i / (uint64_t)o->n);
    if (e != o->epoch) {
        permute(o->perm, o->n, o->seed, LB_PROMPT_ORDER_STREAM, (uint64_t)e);
        o->epoch = e;
    }
    return o->perm[i % (uint64_t)o->n];
}

void lb_prompt_order_free(lb_prompt_order *o)
{
    free(o->perm);
    o->perm = NULL;
}

char *lb_chat_apply(const char *tmpl, const char *prompt, char *err, size_t errlen)
{
    if (!strstr(tmpl, "{prompt}")) {
        snprintf(err, errlen, "rl.chat_template: '%s' holds no {prompt} (where the prompt goes)",
                 tmpl);
        return NULL;
    }
    size_t np = strlen(prompt), cap = strlen(tmpl) + 1, o = 0;
    for (const char *t = strstr(tmpl, "{prompt}"); t; t = strstr(t + 8, "{prompt}")) cap += np;
    char *out = lb_malloc(cap);
    for (const char *t = tmpl; *t;) {
        if (!strncmp(t, "{prompt}", 8)) {
            memcpy(out + o, prompt, np);
            o += np;
            t += 8;
        } else if (t[0] == '\\' && (t[1] == 'n' || t[1] == 't' || t[1] == '\\')) {
            out[o++] = t[1] == 'n' ? '\n' : t[1] == 't' ? '\t' : '\\';
            t += 2;
        } else {
            out[o++] = *t++;
        }
    }
    out[o] = 0;
    return out;
}
