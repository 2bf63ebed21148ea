// mllog_check.c: `lowbit mlperf-check`: our own check of an MLPerf log (src/io/mllog.h). It
// follows the rules of mlcommons/logging's compliance checker (training_6.1.0: common.yaml,
// closed_common.yaml, closed_llama31_8b.yaml, closed_qwen35_397b_grpo.yaml) and adds the order
// of the run's intervals and the evaluation schedule (doc/mlperf.md).
#include "src/io/mllog.h"

#include <cJSON.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include "src/io/json.h"
#include "src/io/files.h"

#define TOKEN ":::MLLOG "

typedef struct {
    int line;                      // of the file
    double time;
    char type;                     // 'P', 'S', 'E'
    const char *key;
    cJSON *value, *meta, *json;
    int64_t samples;               // metadata samples_count, -1 without
} ll;

typedef enum { REQ_ONE, REQ_SOME, REQ_OPTIONAL } req;
// What a value must be: any, a non-empty string, one of the words in s, a number equal to num
// (V_EQ), an integer > 0 (V_POS), an integer >= 0 (V_INT), a number > 0 (V_NUMPOS).
typedef enum { V_ANY, V_STR, V_IN, V_EQ, V_POS, V_INT, V_NUMPOS } vcheck;

// A key of the rules. init: it belongs to the run's configuration, logged between init_start and
// init_stop. strict: value checked only under --strict (a benchmark's fixed size), otherwise
// only its type.
typedef struct {
    const char *key;
    req r;
    int init;
    vcheck v;
    const char *s;
    double num;
    int strict;
} rule;

#define PRECISIONS "fp64 fp32 tf32 fp16 fp8 nvfp4 mxfp4 bfloat16 int8 uint8 int4 uint4"

static const rule common_rules[] = {
    {"cache_clear", REQ_SOME, 0, V_ANY, NULL, 0, 0},
    {"submission_org", REQ_ONE, 1, V_STR, NULL, 0, 0},
    {"submission_platform", REQ_ONE, 1, V_STR, NULL, 0, 0},
    {"submission_division", REQ_ONE, 1, V_IN, "closed open", 0, 0},
    {"submission_benchmark", REQ_ONE, 1, V_IN, LB_MLPERF_LLAMA " " LB_MLPERF_GRPO, 0, 0},
    {"gradient_accumulation_steps", REQ_ONE, 1, V_POS, NULL, 0, 0},
    {"global_batch_size", REQ_ONE, 1, V_POS, NULL, 0, 0},
    {"max_steps", REQ_ONE, 1, V_POS, NULL, 0, 0},
    {"train_samples", REQ_ONE, 0, V_INT, NULL, 0, 0},
    {"opt_name", REQ_ONE, 1, V_IN, "adamw", 0, 0},
    {"opt_learning_rate_warmup_steps", REQ_ONE, 1, V_INT, NULL, 0, 0},
    {"lowest_numerical_precision_in_linear", REQ_OPTIONAL, 1, V_IN, PRECISIONS, 0, 0},
    {"lowest_numerical_precision_in_attn", REQ_OPTIONAL, 1, V_IN, PRECISIONS, 0, 0},
    {"lowest_numerical_precision_in_comm", REQ_OPTIONAL, 1, V_IN, PRECISIONS, 0, 0},
    {"tensor_parallelism", REQ_OPTIONAL, 1, V_POS, NULL, 0, 0},
    {"pipeline_parallelism", REQ_OPTIONAL, 1, V_POS, NULL, 0, 0},
    {"context_parallelism", REQ_OPTIONAL, 1, V_POS, NULL, 0, 0},
    {"expert_parallelism", REQ_OPTIONAL, 1, V_POS, NULL, 0, 0},
    {"micro_batch_size", REQ_OPTIONAL, 1, V_POS, NULL, 0, 0},
    {NULL, 0, 0, 0, NULL, 0, 0},
};

static const rule llama_rules[] = {
    {"max_sequence_length", REQ_ONE, 1, V_EQ, NULL, 8192, 1},
    {"max_steps", REQ_ONE, 1, V_EQ, NULL, 1200000, 1},
    {"eval_samples", REQ_ONE, 1, V_EQ, NULL, 1024, 1},
    {"opt_base_learning_rate", REQ_ONE, 1, V_NUMPOS, NULL, 0, 0},
    {"opt_end_learning_rate", REQ_ONE, 1, V_NUMPOS, NULL, 0, 0},
    {"opt_learning_rate_decay_steps", REQ_ONE, 1, V_INT, NULL, 0, 0},
    {"opt_learning_rate_decay_schedule", REQ_ONE, 1, V_IN, "cosine with linear warmup", 0, 0},
    {"opt_adamw_beta_1", REQ_ONE, 1, V_EQ, NULL, 0.9, 0},
    {"opt_adamw_beta_2", REQ_ONE, 1, V_EQ, NULL, 0.95, 0},
    {"opt_adamw_epsilon", REQ_ONE, 1, V_EQ, NULL, 1e-05, 0},
    {"opt_adamw_weight_decay", REQ_ONE, 1, V_EQ, NULL, 0.1, 0},
    {"opt_gradient_clip_norm", REQ_ONE, 1, V_EQ, NULL, 1.0, 0},
    {NULL, 0, 0, 0, NULL, 0, 0},
};

static const rule grpo_rules[] = {
    {"max_sequence_length", REQ_ONE, 1, V_EQ, NULL, 65536, 1},
    {"eval_samples", REQ_ONE, 1, V_EQ, NULL, 256, 1},
    {"init_checkpoint_step", REQ_ONE, 1, V_EQ, NULL, 0, 0},
    {"opt_base_learning_rate", REQ_ONE, 1, V_NUMPOS, NULL, 0, 0},
    {"opt_adamw_beta_1", REQ_ONE, 1, V_EQ, NULL, 0.9, 0},
    {"opt_adamw_beta_2", REQ_ONE, 1, V_EQ, NULL, 0.999, 0},
    {"opt_adamw_epsilon", REQ_ONE, 1, V_EQ, NULL, 1e-8, 0},
    {"opt_adamw_weight_decay", REQ_ONE, 1, V_EQ, NULL, 0.0, 0},
    {"opt_gradient_clip_norm", REQ_ONE, 1, V_NUMPOS, NULL, 0, 0},
    {"opt_learning_rate_warmup_steps", REQ_ONE, 1, V_EQ, NULL, 0, 0},
    {"opt_learning_rate_decay_schedule", REQ_ONE, 1, V_IN, "constant", 0, 0},
    {"generation_training_rollout_temperature", REQ_ONE, 1, V_EQ, NULL, 1.0, 0},
    {"generation_training_rollout_top_p", REQ_ONE, 1, V_EQ, NULL, 1.0, 0},
    {"generation_validation_rollout_temperature", REQ_ONE, 1, V_EQ, NULL, 0.1, 1},
    {"generation_validation_rollout_top_p", REQ_ONE, 1, V_EQ, NULL, 0.95, 1},
    {"num_prompts_per_step", REQ_ONE, 1, V_POS, NULL, 0, 0},
    {"num_generations_per_prompt", REQ_ONE, 1, V_EQ, NULL, 16, 1},
    {NULL, 0, 0, 0, NULL, 0, 0},
};

typedef struct {
    const char *path;
    FILE *out;
    int problems;
} checker;

static void problem(checker *k, int line, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void problem(checker *k, int line, const char *key, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    if (line > 0) fprintf(k->out, "%s:%d: ", k->path, line);
    else fprintf(k->out, "%s: ", k->path);
    if (key) fprintf(k->out, "%s: ", key);
    vfprintf(k->out, fmt, ap);
    fputc('\n', k->out);
    va_end(ap);
    k->problems++;
}

static int is_int(const cJSON *v)
{
    return cJSON_IsNumber(v) && v->valuedouble == floor(v->valuedouble) &&
           fabs(v->valuedouble) < 9e15;
}

static int word_in(const char *w, const char *list)
{
    size_t n = strlen(w);
    // the list's words are separated by single spaces, except "cosine with linear warmup",
    // a list of one that is compared whole
    if (!strchr(list, ' ') || !strcmp(list, "cosine with linear warmup")) return !strcmp(w, list);
    for (const char *p = list; *p;) {
        const char *e = strchr(p, ' ');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        if (len == n && !strncmp(p, w, n)) return 1;
        p += len + (e != NULL);
    }
    return 0;
}

static void check_value(checker *k, const ll *l, const rule *r, int strict)
{
    const cJSON *v = l->value;
    char shown[128];
    char *t = cJSON_PrintUnformatted(v);
    snprintf(shown, sizeof shown, "%s", t ? t : "?");
    free(t);
    int fixed = !r->strict || strict;   // the value itself is checked, not only its type
    switch (r->v) {
    case V_ANY: break;
    case V_STR:
        if (!cJSON_IsString(v) || !v->valuestring[0])
            problem(k, l->line, r->key, "value %s is not a non-empty string", shown);
        break;
    case V_IN:
        if (!cJSON_IsString(v) || !word_in(v->valuestring, r->s))
            problem(k, l->line, r->key, "value %s is not one of: %s", shown, r->s);
        break;
    case V_EQ:
        if (!cJSON_IsNumber(v)) problem(k, l->line, r->key, "value %s is not a number", shown);
        else if (fixed && v->valuedouble != r->num)
            problem(k, l->line, r->key, "value %s, the rules want %.15g", shown, r->num);
        break;
    case V_POS:
        if (!is_int(v) || v->valuedouble <= 0)
            problem(k, l->line, r->key, "value %s is not an integer > 0", shown);
        break;
    case V_INT:
        if (!is_int(v) || v->valuedouble < 0)
            problem(k, l->line, r->key, "value %s is not an integer >= 0", shown);
        break;
    case V_NUMPOS:
        if (!cJSON_IsNumber(v) || !(v->valuedouble > 0))
            problem(k, l->line, r->key, "value %s is not a number > 0", shown);
        break;
    }
}

// Reads the log's :::MLLOG lines (anything before the token on a line is dropped, as the
// official parser does). -1 with a message when the file cannot be read.
static int read_log(checker *k, ll **out, int *n)
{
    char err[1200];
    size_t len;
    char *text = lb_read_file(k->path, &len, err, sizeof err);
    *out = NULL;
    *n = 0;
    if (text && lb_text_check(text, len, k->path, err, sizeof err) != 0) {
        free(text);   // the lines after the NUL byte would go unchecked
        text = NULL;
    }
    if (!text) {
        fprintf(k->out, "%s\n", err);
        return -1;
    }
    ll *v = NULL;
    int cap = 0, line = 0;
    for (char *p = text, *e; *p; p = e + (*e != 0)) {
        e = strchr(p, '\n');
        if (!e) e = p + strlen(p);
        line++;
        char save = *e;
        *e = 0;
        char *at = strstr(p, TOKEN);
        if (at) {
            // strict: bytes after the event, a key twice (the official checker, Python, takes
            // the last value) are problems, with the parser's reason
            char jerr[512] = "";
            const char *js = at + strlen(TOKEN);
            cJSON *j = lb_json_parse(js, strlen(js), k->path, line, jerr, sizeof jerr);
            const cJSON *ts = j ? cJSON_GetObjectItem(j, "time_ms") : NULL;
            const cJSON *ty = j ? cJSON_GetObjectItem(j, "event_type") : NULL;
            const cJSON *key = j ? cJSON_GetObjectItem(j, "key") : NULL;
            const cJSON *ns = j ? cJSON_GetObjectItem(j, "namespace") : NULL;
            cJSON *val = j ? cJSON_GetObjectItem(j, "value") : NULL;
            cJSON *meta = j ? cJSON_GetObjectItem(j, "metadata") : NULL;
            const char *tn = cJSON_IsString(ty) ? ty->valuestring : "";
            char type = !strcmp(tn, "POINT_IN_TIME") ? 'P' : !strcmp(tn, "INTERVAL_START") ? 'S'
                        : !strcmp(tn, "INTERVAL_END") ? 'E' : 0;
            const char *why = strstr(jerr, ": ") ? strstr(jerr, ": ") + 2 : jerr;
            if (!j) problem(k, line, NULL, "not JSON after '" TOKEN "': %s", why);
            else if (!cJSON_IsString(ns) || !cJSON_IsNumber(ts) || !type || !cJSON_IsString(key) ||
                     !val || !cJSON_IsObject(meta) ||
                     !cJSON_IsString(cJSON_GetObjectItem(meta, "file")) ||
                     !cJSON_IsNumber(cJSON_GetObjectItem(meta, "lineno")))
                problem(k, line, NULL, "not an MLLOG event (namespace, time_ms, event_type "
                        "POINT_IN_TIME|INTERVAL_START|INTERVAL_END, key, value, metadata with "
                        "file and lineno)");
            else {
                if (*n == cap) v = realloc(v, (size_t)(cap = cap ? 2 * cap : 64) * sizeof *v);
                const cJSON *sc = cJSON_GetObjectItem(meta, "samples_count");
                v[(*n)++] = (ll){line, ts->valuedouble, type, key->valuestring, val, meta, j,
                                 is_int(sc) ? (int64_t)sc->valuedouble : -1};
                j = NULL;
            }
            cJSON_Delete(j);
        }
        *e = save;
    }
    free(text);
    *out = v;
    return 0;
}

static const rule *find_rule(const rule *rs, const char *key)
{
    for (; rs && rs->key; rs++)
        if (!strcmp(rs->key, key)) return rs;
    return NULL;
}

// The value of the first line of key (NULL: none).
static const ll *first_of(const ll *v, int n, const char *key)
{
    for (int i = 0; i < n; i++)
        if (!strcmp(v[i].key, key)) return &v[i];
    return NULL;
}

static double num_of(const ll *v, int n, const char *key, double dflt)
{
    const ll *l = first_of(v, n, key);
    return l && cJSON_IsNumber(l->value) ? l->value->valuedouble : dflt;
}

// The keys: how often, where (a configuration key between init_start and init_stop), their
// values. The benchmark's rules override the common ones of the same key.
static void check_keys(checker *k, const ll *v, int n, const rule *bench, int strict,
                       int i_init, int i_stop)
{
    const rule *sets[2] = {bench, common_rules};
    for (int s = 0; s < 2; s++)
        for (const rule *r = sets[s]; r->key; r++) {
            if (s == 1 && find_rule(bench, r->key)) continue;
            int count = 0;
            for (int i = 0; i < n; i++) {
                if (strcmp(v[i].key, r->key)) continue;
                count++;
                check_value(k, &v[i], r, strict);
                if (r->init && (i < i_init || (i_stop >= 0 && i > i_stop)))
                    problem(k, v[i].line, r->key, "a configuration key outside init_start .. "
                            "init_stop");
            }
            if (r->r == REQ_ONE && count != 1)
                problem(k, 0, r->key, "%s (the rules want exactly one)",
                        count ? "logged more than once" : "missing");
            if (r->r == REQ_SOME && count == 0)
                problem(k, 0, r->key, "missing (the rules want at least one)");
        }
}

// init_start .. init_stop .. run_start, then blocks and evaluations, then run_stop; samples
// counts that never decrease. Returns the index of run_stop (-1: none).
static int check_order(checker *k, const ll *v, int n, int *i_init, int *i_stop)
{
    int init = -1, stop = -1, run = -1, end = -1;
    enum { OUT, BLOCK, EVAL } st = OUT;
    int64_t last = -1, at = -1;    // the last samples_count; the open interval's
    int acc = 0;                   // eval_accuracy lines in the open evaluation
    for (int i = 0; i < n; i++) {
        const ll *l = &v[i];
        const char *key = l->key;
        if (l->samples >= 0) {
            if (l->samples < last)
                problem(k, l->line, key, "samples_count %lld after %lld: it never decreases",
                        (long long)l->samples, (long long)last);
            last = l->samples;
        }
        int interval = !strcmp(key, "block_start") || !strcmp(key, "block_stop") ||
                       !strcmp(key, "eval_start") || !strcmp(key, "eval_stop") ||
                       !strcmp(key, "eval_accuracy");
        if (!strcmp(key, "init_start")) {
            if (init < 0) init = i;
            if (stop >= 0 || run >= 0) problem(k, l->line, key, "after init_stop or run_start");
        } else if (!strcmp(key, "init_stop")) {
            if (init < 0) problem(k, l->line, key, "before init_start");
            if (stop < 0) stop = i;
        } else if (!strcmp(key, "run_start")) {
            if (stop < 0) problem(k, l->line, key, "before init_stop");
            if (run < 0) run = i;
            else problem(k, l->line, key, "a second run_start");
        } else if (!strcmp(key, "run_stop")) {
            if (run < 0) problem(k, l->line, key, "before run_start");
            if (st != OUT)
                problem(k, l->line, key, "inside an open %s", st == BLOCK ? "block" : "evaluation");
            const cJSON *s = cJSON_GetObjectItem(l->meta, "status");
            if (!cJSON_IsString(s) ||
                (strcmp(s->valuestring, "success") && strcmp(s->valuestring, "aborted")))
                problem(k, l->line, key, "metadata status is not \"success\" or \"aborted\"");
            if (end < 0) end = i;
            else problem(k, l->line, key, "a second run_stop");
        } else if (interval) {
            if (run < 0 || end >= 0) {
                problem(k, l->line, key, "outside run_start .. run_stop");
                continue;
            }
            if (l->samples < 0) {
                problem(k, l->line, key, "no integer samples_count in its metadata");
                continue;
            }
            if (!strcmp(key, "block_start")) {
                if (st != OUT) problem(k, l->line, key, "inside an open block or evaluation");
                st = BLOCK, at = l->samples;
            } else if (!strcmp(key, "block_stop")) {
                if (st != BLOCK) problem(k, l->line, key, "without a block_start");
                st = OUT;
            } else if (!strcmp(key, "eval_start")) {
                if (st != OUT) problem(k, l->line, key, "inside an open block or evaluation");
                st = EVAL, at = l->samples, acc = 0;
            } else {
                if (st != EVAL) problem(k, l->line, key, "outside eval_start .. eval_stop");
                else if (l->samples != at)
                    problem(k, l->line, key, "samples_count %lld, its eval_start's is %lld",
                            (long long)l->samples, (long long)at);
                if (!strcmp(key, "eval_accuracy")) {
                    acc++;
                    if (!cJSON_IsNumber(l->value))
                        problem(k, l->line, key, "value is not a number");
                } else {
                    if (st == EVAL && acc != 1)
                        problem(k, l->line, key, "%d eval_accuracy lines in the evaluation, not 1",
                                acc);
                    st = OUT;
                }
            }
        }
    }
    if (init < 0) problem(k, 0, "init_start", "missing");
    if (stop < 0) problem(k, 0, "init_stop", "missing");
    if (run < 0) problem(k, 0, "run_start", "missing");
    if (end < 0) problem(k, 0, "run_stop", "missing");
    *i_init = init < 0 ? 0 : init;
    *i_stop = stop;
    return end;
}

// The evaluations: their points (strict: the benchmark's schedule; otherwise equally spaced
// whole steps), their values, and the status against the target.
static void check_evals(checker *k, const ll *v, int n, int grpo, int strict, int end)
{
    double gbs = num_of(v, n, "global_batch_size", 0);
    double target = strict ? (grpo ? 0.69 : 3.3) : num_of(v, n, "target_accuracy", grpo ? 0.69 : 3.3);
    if (gbs <= 0) return;   // reported with the keys
    int64_t b = (int64_t)gbs, first = -1, step = -1, prev = -1;
    if (strict) {
        first = grpo ? b * (int64_t)ceil(2.5 + 3840.0 / gbs) : lb_mlperf_steps(12288, b) * b;
        step = grpo ? b : first;
    }
    int evals = 0, reached_at = -1;
    const ll *last = NULL;
    for (int i = 0; i < n; i++) {
        const ll *l = &v[i];
        if (strcmp(l->key, "eval_accuracy") || l->samples < 0 || !cJSON_IsNumber(l->value)) continue;
        double a = l->value->valuedouble;
        if (l->samples % b != 0)
            problem(k, l->line, l->key, "samples_count %lld is not a whole number of steps of "
                    "global_batch_size %lld", (long long)l->samples, (long long)b);
        if (!strict && evals == 1) step = l->samples - prev;
        int64_t want = evals == 0 ? first : prev + step;
        if (want >= 0 && (strict || evals >= 1) && l->samples != want)
            problem(k, l->line, l->key, "samples_count %lld, the schedule's is %lld",
                    (long long)l->samples, (long long)want);
        if (grpo ? !(a >= 0 && a <= 1) : !(a > 0))
            problem(k, l->line, l->key, "value %g is not %s", a, grpo ? "in [0, 1]" : "> 0");
        int hit = grpo ? a > target : a <= target;
        if (hit && reached_at < 0) reached_at = i;
        prev = l->samples;
        last = l;
        evals++;
    }
    if (evals == 0) problem(k, 0, "eval_accuracy", "missing (the rules want at least one)");
    const cJSON *st = end >= 0 ? cJSON_GetObjectItem(v[end].meta, "status") : NULL;
    int success = cJSON_IsString(st) && !strcmp(st->valuestring, "success");
    if (strict && reached_at < 0)
        problem(k, 0, "eval_accuracy", "none reaches the target %g", target);
    if (success && reached_at < 0)
        problem(k, v[end].line, "run_stop", "status success, but no evaluation reached the "
                "target %g", target);
    if (reached_at >= 0 && last != &v[reached_at])
        problem(k, v[reached_at].line, "eval_accuracy", "the target %g is reached here, but "
                "the run goes on", target);
    if (end >= 0 && !success && reached_at >= 0)
        problem(k, v[end].line, "run_stop", "status is not success, but the target was reached");
    // train_samples: what the run trained on, at least the last evaluation's point
    const ll *ts = first_of(v, n, "train_samples");
    if (ts && is_int(ts->value)) {
        int64_t t = (int64_t)ts->value->valuedouble;
        if (last && t < last->samples)
            problem(k, ts->line, ts->key, "%lld, fewer than the last evaluation's samples_count "
                    "%lld", (long long)t, (long long)last->samples);
        if (end >= 0 && v[end].samples >= 0 && t != v[end].samples)
            problem(k, ts->line, ts->key, "%lld, but run_stop's samples_count is %lld",
                    (long long)t, (long long)v[end].samples);
    }
}

// Values that depend on each other: the schedule's steps, the end learning rate, GRPO's batch
// and its learning rate and clip scaled with it; the time from init_start to init_stop.
static void check_relations(checker *k, const ll *v, int n, int grpo, int strict)
{
    double gbs = num_of(v, n, "global_batch_size", 0);
    const ll *decay = first_of(v, n, "opt_learning_rate_decay_steps");
    double warm = num_of(v, n, "opt_learning_rate_warmup_steps", NAN);
    double maxs = num_of(v, n, "max_steps", NAN);
    if (!grpo && decay && cJSON_IsNumber(decay->value) &&
        decay->value->valuedouble != (strict ? 1200000 : maxs) - warm)
        problem(k, decay->line, decay->key, "%.15g, not max_steps - warm-up steps = %.15g",
                decay->value->valuedouble, (strict ? 1200000 : maxs) - warm);
    const ll *end = first_of(v, n, "opt_end_learning_rate");
    double base = num_of(v, n, "opt_base_learning_rate", NAN);
    if (!grpo && end && cJSON_IsNumber(end->value) &&
        fabs(end->value->valuedouble - 0.1 * base) > 1e-9 * base)
        problem(k, end->line, end->key, "%.15g, not 0.1 x opt_base_learning_rate = %.15g",
                end->value->valuedouble, 0.1 * base);
    if (grpo && gbs > 0) {
        double np = num_of(v, n, "num_prompts_per_step", NAN);
        const ll *g = first_of(v, n, "num_generations_per_prompt");
        if (g && cJSON_IsNumber(g->value) && np * g->value->valuedouble != gbs)
            problem(k, g->line, g->key, "num_prompts_per_step x num_generations_per_prompt is "
                    "%.15g, not global_batch_size %.15g", np * g->value->valuedouble, gbs);
        const ll *lr = first_of(v, n, "opt_base_learning_rate");
        double want = 1.0e-6 * sqrt(gbs / 256);
        if (strict && lr && cJSON_IsNumber(lr->value) && fabs(lr->value->valuedouble - want) >= 1e-9)
            problem(k, lr->line, lr->key, "%.15g, the rules want 1e-6 x sqrt(%g / 256) = %.15g",
                    lr->value->valuedouble, gbs, want);
        const ll *clip = first_of(v, n, "opt_gradient_clip_norm");
        want = 0.125 * sqrt(256 / gbs);
        if (strict && clip && cJSON_IsNumber(clip->value) &&
            fabs(clip->value->valuedouble - want) >= 1e-9)
            problem(k, clip->line, clip->key, "%.15g, the rules want 0.125 x sqrt(256 / %g) = "
                    "%.15g", clip->value->valuedouble, gbs, want);
    }
    const ll *i0 = first_of(v, n, "init_start"), *i1 = first_of(v, n, "init_stop");
    const ll *div = first_of(v, n, "submission_division");
    int open = div && cJSON_IsString(div->value) && !strcmp(div->value->valuestring, "open");
    double mins = open ? 240 : 30;
    if (i0 && i1 && i1->time - i0->time >= mins * 60e3)
        problem(k, i1->line, i1->key, "%.1f minutes after init_start, the rules allow %g",
                (i1->time - i0->time) / 60e3, mins);
}

int lb_mllog_check(const char *path, int strict, FILE *out)
{
    checker k = {path, out, 0};
    int n = 0;
    ll *v;
    if (read_log(&k, &v, &n) != 0) return -1;
    const ll *bl = first_of(v, n, "submission_benchmark");
    const char *bench = bl && cJSON_IsString(bl->value) ? bl->value->valuestring : "";
    int grpo = !strcmp(bench, LB_MLPERF_GRPO);
    const rule *rules = grpo ? grpo_rules : llama_rules;
    if (!bl) problem(&k, 0, "submission_benchmark", "missing: checked as " LB_MLPERF_LLAMA);
    int i_init, i_stop;
    int end = check_order(&k, v, n, &i_init, &i_stop);
    check_keys(&k, v, n, rules, strict, i_init, i_stop);
    check_evals(&k, v, n, grpo, strict, end);
    check_relations(&k, v, n, grpo, strict);
    if (k.problems == 0)
        fprintf(out, "%s: ok: %d MLLOG lines, %s rules%s\n", path, n,
                grpo ? LB_MLPERF_GRPO : LB_MLPERF_LLAMA, strict ? " (strict)" : "");
    else fprintf(out, "%s: %d problem(s)\n", path, k.problems);
    for (int i = 0; i < n; i++) cJSON_Delete(v[i].json);
    free(v);
    return k.problems;
}
