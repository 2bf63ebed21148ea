// config.c: parameter files, --set overrides, cross-key checks, the resolved configuration as
// INI text and doc/parameters.md, all driven by the table in src/cli/params.c.
//
// Files are read with inih, but never handed to it raw: inih silently splits a line longer
// than INI_MAX_LINE into two lines (truncating the value and shifting every later line number),
// reads indented lines as continuations of the previous value, and knows only ';' as an inline
// comment. So lb_config_parse first rewrites the text line for line (same line numbers):
// comments and surrounding blanks removed, over-long lines, bad section headers and lines
// without '=' reported by us. inih then splits the remaining key = value lines.
#include "src/cli/config.h"
#include "kernels/common.h"
#include "src/io/files.h"

#include <ctype.h>
#include <errno.h>
#include <ini.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>   // strcasecmp

#define LB_MSG 512
// Longest line inih reads whole: its buffer also holds '\r', '\n' and the NUL (see ini.h).
#define LB_INI_LINE (INI_MAX_LINE - 3)
#define LB_NSLOTS ((int)(sizeof(((lb_config *)0)->source_line) / sizeof(int)))

// ---------------------------------------------------------------------------------------------
// Small helpers

static void *field_of(lb_config *c, const lb_param *p) { return (char *)c + p->offset; }
static const void *cfield_of(const lb_config *c, const lb_param *p)
{
    return (const char *)c + p->offset;
}

// A blank inside a line (isspace without the newline).
static int is_blank(int ch)
{
    return ch == ' ' || ch == '\t' || ch == '\r' || ch == '\f' || ch == '\v';
}

static int find_param(const char *section, const char *key)
{
    for (int i = 0; i < lb_nparams; i++)
        if (!strcmp(lb_params[i].section, section) && !strcmp(lb_params[i].key, key)) return i;
    return -1;
}

static int section_known(const char *section)
{
    for (int i = 0; i < lb_nparams; i++)
        if (!strcmp(lb_params[i].section, section)) return 1;
    return 0;
}

// The user's text for a message: quoted, on one line, and short.
static void show(char *out, size_t n, const char *v)
{
    size_t o = 0, i = 0;
    if (n < 8) { if (n) *out = 0; return; }
    out[o++] = '\'';
    for (; v[i] && o + 5 < n && i < 64; i++)
        out[o++] = (unsigned char)v[i] < 0x20 || v[i] == 0x7f ? '?' : v[i];
    if (v[i]) { out[o++] = '.'; out[o++] = '.'; out[o++] = '.'; }
    out[o++] = '\'';
    out[o] = 0;
}

// Shortest %.Ng (N = 15..17) that reads back as exactly v, so files stay readable ("0.001",
// not "0.0010000000000000000208") and the round trip through text is still exact.
static void fmt_double(char *out, size_t n, double v)
{
    for (int prec = 15; prec <= 17; prec++) {
        snprintf(out, n, "%.*g", prec, v);
        if (strtod(out, NULL) == v) return;
    }
}

static int is_integer_type(lb_param_type t) { return t == LB_PARAM_INT || t == LB_PARAM_U64; }

static void fmt_bound(char *out, size_t n, const lb_param *p, double v)
{
    if (is_integer_type(p->type)) snprintf(out, n, "%.0f", v);
    else fmt_double(out, n, v);
}

static void range_text(char *out, size_t n, const lb_param *p)
{
    char lo[40], hi[40];
    fmt_bound(lo, sizeof lo, p, p->min);
    fmt_bound(hi, sizeof hi, p, p->max);
    snprintf(out, n, "[%s, %s]", lo, hi);
}

const char lb_choices_models[] = "(the registry's)";
const char lb_choices_recipes[] = "(the contract's recipes)";

const char *lb_param_choices(const lb_param *p)
{
    return p->choices == lb_choices_models    ? lb_model_arch_choices()
           : p->choices == lb_choices_recipes ? lb_recipe_choices()
                                              : p->choices;
}

// v's index among choices ("a|b|c"), or -1.
static int choice_of(const char *choices, const char *v)
{
    size_t len = strlen(v);
    int i = 0;
    for (const char *s = choices; *s; i++) {
        size_t w = strcspn(s, "|");
        if (w == len && !strncmp(s, v, len)) return i;
        s += w + (s[w] == '|');
    }
    return -1;
}

static int in_choices(const char *choices, const char *v) { return choice_of(choices, v) >= 0; }

// ---------------------------------------------------------------------------------------------
// Did-you-mean

// Edit distance counting a swap of neighbours as one edit ("trian" is one typo from "train"),
// case-insensitive ("LR" finds "lr"). Optimal string alignment, three rolling rows.
static int edit_distance(const char *a, const char *b)
{
    enum { MAXL = 64 };
    size_t la = strlen(a), lb = strlen(b);
    if (la >= MAXL || lb >= MAXL) return INT_MAX / 2;
    int r0[MAXL + 1], r1[MAXL + 1], r2[MAXL + 1];
    int *prev2 = r0, *prev = r1, *cur = r2;
    for (size_t j = 0; j <= lb; j++) prev[j] = (int)j;
    for (size_t i = 1; i <= la; i++) {
        int ai = tolower((unsigned char)a[i - 1]);
        cur[0] = (int)i;
        for (size_t j = 1; j <= lb; j++) {
            int bj = tolower((unsigned char)b[j - 1]);
            int best = prev[j - 1] + (ai != bj);
            if (prev[j] + 1 < best) best = prev[j] + 1;
            if (cur[j - 1] + 1 < best) best = cur[j - 1] + 1;
            if (i > 1 && j > 1 && ai == tolower((unsigned char)b[j - 2]) &&
                tolower((unsigned char)a[i - 2]) == bj && prev2[j - 2] + 1 < best)
                best = prev2[j - 2] + 1;
            cur[j] = best;
        }
        int *t = prev2;
        prev2 = prev;
        prev = cur;
        cur = t;
    }
    return prev[lb];
}

// A suggestion only when the typo is small next to the words compared.
static int close_enough(int d, const char *a, const char *b)
{
    size_t la = strlen(a), lb = strlen(b);
    int lim = (int)((la > lb ? la : lb) / 3);
    return d <= (lim > 1 ? lim : 1);
}

// Names other programs use for our keys (Megatron, Hugging Face, nanoGPT). They are never
// accepted, only matched for suggestions: "learning_rate" finds train.lr.
static const struct { const char *alias, *section, *key; } lb_key_aliases[] = {
    {"num_threads", "run", "threads"}, {"nthreads", "run", "threads"},
    {"device_id", "run", "device"}, {"gpu", "run", "device"}, {"random_seed", "run", "seed"},
    {"output_dir", "run", "out_dir"}, {"save_dir", "run", "out_dir"},
    {"model_type", "model", "arch"}, {"architecture", "model", "arch"},
    {"vocab", "model", "vocab_size"}, {"padded_vocab_size", "model", "vocab_size"},
    {"d_model", "model", "hidden_size"}, {"n_embd", "model", "hidden_size"},
    {"num_layers", "model", "num_hidden_layers"}, {"n_layer", "model", "num_hidden_layers"},
    {"num_heads", "model", "num_attention_heads"}, {"n_head", "model", "num_attention_heads"},
    {"num_kv_heads", "model", "num_key_value_heads"},
    {"num_query_groups", "model", "num_key_value_heads"},
    {"kv_channels", "model", "head_dim"},
    {"ffn_hidden_size", "model", "intermediate_size"},
    {"num_moe_experts", "model", "num_experts"},
    {"moe_router_topk", "model", "num_experts_per_tok"}, {"top_k", "model", "num_experts_per_tok"},
    {"moe_ffn_hidden_size", "model", "moe_intermediate_size"},
    {"rotary_base", "model", "rope_theta"}, {"rope_base", "model", "rope_theta"},
    {"layernorm_epsilon", "model", "rms_norm_eps"}, {"norm_eps", "model", "rms_norm_eps"},
    {"moe_aux_loss_coeff", "model", "router_aux_loss_coef"},
    {"aux_loss_coef", "model", "router_aux_loss_coef"},
    {"init_method_std", "model", "initializer_range"}, {"init_std", "model", "initializer_range"},
    {"train_data", "data", "train_files"}, {"data_path", "data", "train_files"},
    {"val_data", "data", "val_files"}, {"valid_files", "data", "val_files"},
    {"learning_rate", "train", "lr"}, {"min_learning_rate", "train", "min_lr"},
    {"max_steps", "train", "steps"}, {"train_iters", "train", "steps"},
    {"num_steps", "train", "steps"},
    {"batch_size", "train", "micro_batch"}, {"micro_batch_size", "train", "micro_batch"},
    {"seq_length", "train", "seq_len"}, {"sequence_length", "train", "seq_len"},
    {"block_size", "train", "seq_len"},
    {"gradient_accumulation_steps", "train", "grad_accum"},
    {"warmup", "train", "warmup_steps"}, {"lr_warmup_steps", "train", "warmup_steps"},
    {"lr_warmup_iters", "train", "warmup_steps"},
    {"adam_beta1", "train", "beta1"}, {"adam_beta2", "train", "beta2"},
    {"adam_epsilon", "train", "adam_eps"}, {"eps", "train", "adam_eps"},
    {"max_grad_norm", "train", "grad_clip"}, {"clip_grad", "train", "grad_clip"},
    {"eval_interval", "train", "val_every"}, {"eval_iters", "train", "val_batches"},
    {"log_interval", "train", "log_every"},
    {"save_interval", "checkpoint", "save_every"}, {"keep_last", "checkpoint", "keep"},
    {"load", "checkpoint", "resume"}, {"resume_from", "checkpoint", "resume"},
    {"num_problems", "gen", "problems"}, {"val_split", "gen", "val_fraction"},
    {"shard_size", "gen", "shard_tokens"},
};

static const struct { const char *alias, *section; } lb_section_aliases[] = {
    {"training", "train"}, {"optimizer", "train"}, {"ckpt", "checkpoint"},
    {"checkpointing", "checkpoint"}, {"dataset", "data"}, {"generate", "gen"},
    {"datagen", "gen"}, {"conversion", "convert"}, {"runtime", "run"},
};

typedef struct { int d, param; } lb_match;

// A word of 4 or more letters that begins the other ("warmup", "warmup_steps") counts as one
// edit away, however long the rest.
static int prefix_of(const char *a, const char *b)
{
    size_t la = strlen(a), lb = strlen(b), n = la < lb ? la : lb;
    return n >= 4 && !strncasecmp(a, b, n);
}

static void consider(lb_match *m, int d, const char *typed, const char *known, int param)
{
    if (d > 1 && prefix_of(typed, known)) d = 1;
    if (close_enough(d, typed, known) && d < m->d) { m->d = d; m->param = param; }
}

// The closest key to `name`, in `section` (NULL: none) and elsewhere. Another section's key
// wins only when it is strictly closer.
static int suggest_key_index(const char *name, const char *section)
{
    lb_match same = {INT_MAX, -1}, other = {INT_MAX, -1};
    for (int i = 0; i < lb_nparams; i++) {
        lb_match *m = section && !strcmp(lb_params[i].section, section) ? &same : &other;
        consider(m, edit_distance(name, lb_params[i].key), name, lb_params[i].key, i);
    }
    for (size_t a = 0; a < sizeof lb_key_aliases / sizeof lb_key_aliases[0]; a++) {
        int i = find_param(lb_key_aliases[a].section, lb_key_aliases[a].key);
        if (i < 0) continue;
        lb_match *m = section && !strcmp(lb_params[i].section, section) ? &same : &other;
        consider(m, edit_distance(name, lb_key_aliases[a].alias), name, lb_key_aliases[a].alias, i);
    }
    return other.d < same.d ? other.param : same.param;
}

static const char *suggest_section(const char *name)
{
    const char *best = NULL;
    int bd = INT_MAX;
    for (int i = 0; i < lb_nparams; i++) {
        if (i > 0 && !strcmp(lb_params[i].section, lb_params[i - 1].section)) continue;
        int d = edit_distance(name, lb_params[i].section);
        if (close_enough(d, name, lb_params[i].section) && d < bd) {
            bd = d;
            best = lb_params[i].section;
        }
    }
    for (size_t a = 0; a < sizeof lb_section_aliases / sizeof lb_section_aliases[0]; a++) {
        int d = edit_distance(name, lb_section_aliases[a].alias);
        if (close_enough(d, name, lb_section_aliases[a].alias) && d < bd) {
            bd = d;
            best = lb_section_aliases[a].section;
        }
    }
    return best;
}

static void section_list(char *out, size_t n)
{
    size_t o = 0;
    out[0] = 0;
    for (int i = 0; i < lb_nparams && o < n; i++) {
        if (i > 0 && !strcmp(lb_params[i].section, lb_params[i - 1].section)) continue;
        o += (size_t)snprintf(out + o, n - o, "%s%s", o ? ", " : "", lb_params[i].section);
    }
}

// ---------------------------------------------------------------------------------------------
// Values

// Removes one pair of surrounding double quotes, in place: `resume = ""` is the empty string,
// and `"#x"` keeps a value that would otherwise read as a comment.
static char *unquote(char *v, char *msg, size_t n)
{
    size_t len = strlen(v);
    if (v[0] != '"') return v;
    if (len < 2 || v[len - 1] != '"') {
        snprintf(msg, n, "unterminated '\"' in value");
        return NULL;
    }
    v[len - 1] = 0;
    return v + 1;
}

static int parse_int_text(const char *v, long long *out)
{
    char *end;
    if (!*v || isspace((unsigned char)*v)) return -1;
    errno = 0;
    *out = strtoll(v, &end, 10);
    if (*end) return -1;
    return errno == ERANGE ? 1 : 0;
}

// Checks `v` against the key and stores it; the field is written only when v is good.
// On error, msg gets the reason (without the key, which the caller puts in front).
static int set_value(lb_config *c, const lb_param *p, const char *v, char *msg, size_t n)
{
    char shown[80], range[96];
    int ranged = p->min < p->max;
    show(shown, sizeof shown, v);
    if (ranged) range_text(range, sizeof range, p);
    switch (p->type) {
    case LB_PARAM_INT: {
        long long x;
        int rc = parse_int_text(v, &x);
        if (rc < 0) {
            snprintf(msg, n, "%s is not an integer", shown);
            return -1;
        }
        if (rc > 0 || x < INT_MIN || x > INT_MAX || (ranged && (x < p->min || x > p->max))) {
            if (ranged) snprintf(msg, n, "%s is out of range %s", shown, range);
            else snprintf(msg, n, "%s does not fit in an int", shown);
            return -1;
        }
        *(int *)field_of(c, p) = (int)x;
        return 0;
    }
    case LB_PARAM_U64: {
        char *end;
        // strtoull would take "-1" as 2^64-1
        if (!*v || !isdigit((unsigned char)(*v == '+' ? v[1] : *v))) {
            snprintf(msg, n, "%s is not an unsigned integer", shown);
            return -1;
        }
        errno = 0;
        unsigned long long x = strtoull(v, &end, 10);
        if (*end) {
            snprintf(msg, n, "%s is not an unsigned integer", shown);
            return -1;
        }
        if (errno == ERANGE || (ranged && (x < p->min || x > p->max))) {
            if (ranged) snprintf(msg, n, "%s is out of range %s", shown, range);
            else snprintf(msg, n, "%s does not fit in 64 bits", shown);
            return -1;
        }
        *(uint64_t *)field_of(c, p) = (uint64_t)x;
        return 0;
    }
    case LB_PARAM_FLOAT: {
        char *end;
        if (!*v || isspace((unsigned char)*v)) {
            snprintf(msg, n, "%s is not a number", shown);
            return -1;
        }
        errno = 0;
        double x = strtod(v, &end);   // C locale: the program never calls setlocale
        if (*end) {
            snprintf(msg, n, "%s is not a number", shown);
            return -1;
        }
        if (!isfinite(x)) {   // "inf", "nan", or overflow to HUGE_VAL
            snprintf(msg, n, "%s is not a finite number", shown);
            return -1;
        }
        if (ranged && !(x >= p->min && x <= p->max)) {
            snprintf(msg, n, "%s is out of range %s", shown, range);
            return -1;
        }
        *(double *)field_of(c, p) = x;
        return 0;
    }
    case LB_PARAM_BOOL: {
        static const char *yes[] = {"true", "yes", "on", "1"}, *no[] = {"false", "no", "off", "0"};
        for (int i = 0; i < 4; i++) {
            if (!strcasecmp(v, yes[i])) { *(int *)field_of(c, p) = 1; return 0; }
            if (!strcasecmp(v, no[i])) { *(int *)field_of(c, p) = 0; return 0; }
        }
        snprintf(msg, n, "%s is not a boolean (true/false, yes/no, on/off, 1/0)", shown);
        return -1;
    }
    case LB_PARAM_ENUM:
    case LB_PARAM_STRING: {
        // no did-you-mean here: the choices are listed, and the nearest one misleads
        // ("gpu" is one letter from "cpu")
        if (p->type == LB_PARAM_ENUM && !in_choices(lb_param_choices(p), v)) {
            snprintf(msg, n, "%s is not one of %s", shown, lb_param_choices(p));
            return -1;
        }
        size_t len = strlen(v);
        if (len >= p->size) {
            snprintf(msg, n, "value is %zu characters long, at most %zu fit", len, p->size - 1);
            return -1;
        }
        for (size_t i = 0; i < len; i++) {
            if (((unsigned char)v[i] < 0x20 && v[i] != '\t') || v[i] == 0x7f) {
                snprintf(msg, n, "control character in value");
                return -1;
            }
            // only --set can get here: lb_config_to_ini could not write it back
            if (i > 0 && is_blank(v[i - 1]) && (v[i] == '#' || v[i] == ';')) {
                snprintf(msg, n, "'%c' after a blank would start a comment in a parameter file",
                         v[i]);
                return -1;
            }
        }
        // zero the whole buffer: equal configurations are equal bytes (memcmp, broadcasts,
        // checkpoints)
        char *dst = field_of(c, p);
        memset(dst, 0, p->size);
        memcpy(dst, v, len);
        return 0;
    }
    }
    snprintf(msg, n, "internal error: bad parameter type");
    return -1;
}

// The stored value as parameter-file text (before quoting).
void lb_param_format(const lb_config *c, const lb_param *p, char *out, size_t n)
{
    const void *f = cfield_of(c, p);
    switch (p->type) {
    case LB_PARAM_INT: snprintf(out, n, "%d", *(const int *)f); break;
    case LB_PARAM_U64: snprintf(out, n, "%" PRIu64, *(const uint64_t *)f); break;
    case LB_PARAM_FLOAT: fmt_double(out, n, *(const double *)f); break;
    case LB_PARAM_BOOL: snprintf(out, n, "%s", *(const int *)f ? "true" : "false"); break;
    case LB_PARAM_STRING:
    case LB_PARAM_ENUM: snprintf(out, n, "%.*s", (int)p->size, (const char *)f); break;
    }
}

void lb_config_defaults(lb_config *c)
{
    memset(c, 0, sizeof *c);
    for (int i = 0; i < lb_nparams; i++) {
        char msg[LB_MSG];
        // Every default goes through the setter, so defaults obey the same rules as files;
        // tests/test_config.c checks that each one is accepted.
        (void)set_value(c, &lb_params[i], lb_params[i].def, msg, sizeof msg);
    }
}

// ---------------------------------------------------------------------------------------------
// Parameter files

typedef struct {
    lb_config cfg;             // the copy being filled: c changes only when the whole file is good
    const int *keylines;       // line number of each key = value line, in file order
    int nkeys, next;
    int seen[LB_NSLOTS];       // line that set each key in this file, 0 = not yet
    char msg[LB_MSG];          // the first error (inih reports its line)
} lb_parse_ctx;

static int apply_key(lb_parse_ctx *x, const char *section, const char *name, const char *value,
                     int line, char *msg, size_t n)
{
    char shown[80];
    show(shown, sizeof shown, name);
    if (!section[0]) {
        int s = suggest_key_index(name, NULL);
        if (s >= 0)
            snprintf(msg, n, "key %s is outside any [section] (did you mean '[%s] %s'?)", shown,
                     lb_params[s].section, lb_params[s].key);
        else snprintf(msg, n, "key %s is outside any [section]", shown);
        return -1;
    }
    int i = find_param(section, name);
    if (i < 0) {
        int s = suggest_key_index(name, section);
        if (s >= 0 && !strcmp(lb_params[s].section, section))
            snprintf(msg, n, "unknown key %s in [%s] (did you mean '%s'?)", shown, section,
                     lb_params[s].key);
        else if (s >= 0)
            snprintf(msg, n, "unknown key %s in [%s] (did you mean '[%s] %s'?)", shown, section,
                     lb_params[s].section, lb_params[s].key);
        else snprintf(msg, n, "unknown key %s in [%s]", shown, section);
        return -1;
    }
    const lb_param *p = &lb_params[i];
    if (x->seen[i]) {
        snprintf(msg, n, "key '%s' in [%s] already set on line %d", name, section, x->seen[i]);
        return -1;
    }
    char buf[INI_MAX_LINE + 1], why[LB_MSG - 128];   // room for the key in front
    snprintf(buf, sizeof buf, "%s", value);
    char *v = unquote(buf, why, sizeof why);
    if (!v || set_value(&x->cfg, p, v, why, sizeof why) != 0) {
        snprintf(msg, n, "%s.%s: %s", section, name, why);
        return -1;
    }
    x->seen[i] = line;
    x->cfg.source_line[i] = line;
    x->cfg.key_set[i] = 1;
    return 0;
}

static int on_key(void *user, const char *section, const char *name, const char *value)
{
    lb_parse_ctx *x = user;
    int line = x->next < x->nkeys ? x->keylines[x->next] : 0;
    x->next++;
    char msg[LB_MSG];
    if (apply_key(x, section, name, value, line, msg, sizeof msg) == 0) return 1;
    if (!x->msg[0]) snprintf(x->msg, sizeof x->msg, "%s", msg);
    return 0;
}

// Rewrites one line in place for inih: drops comments (a '#' or ';' that starts the line or
// follows a blank) and surrounding blanks. Returns the new length.
static size_t clean_line(char *line)
{
    char *s = line;
    while (is_blank(*s)) s++;
    size_t len = 0;
    if (*s != '#' && *s != ';') {
        for (len = 0; s[len]; len++)
            if (len > 0 && is_blank(s[len - 1]) && (s[len] == '#' || s[len] == ';')) break;
        while (len > 0 && is_blank(s[len - 1])) len--;
    }
    memmove(line, s, len);
    line[len] = 0;
    return len;
}

// Checks a cleaned line inih will see; 0, or -1 with msg. Key lines are counted in keylines.
static int check_line(const char *line, size_t len, char *msg, size_t n)
{
    char shown[80];
    if (len > LB_INI_LINE) {
        snprintf(msg, n, "line is %zu characters long without comments; the limit is %d "
                 "(inih's INI_MAX_LINE)", len, LB_INI_LINE);
        return -1;
    }
    if (line[0] == '[') {
        const char *close = strchr(line, ']');
        if (!close) {
            snprintf(msg, n, "missing ']' in section header");
            return -1;
        }
        if (close[1]) {
            show(shown, sizeof shown, close + 1);
            snprintf(msg, n, "unexpected %s after section header", shown);
            return -1;
        }
        char name[INI_MAX_LINE];
        snprintf(name, sizeof name, "%.*s", (int)(close - line - 1), line + 1);
        if (!section_known(name)) {
            const char *s = suggest_section(name);
            if (s) {
                snprintf(msg, n, "unknown section [%s] (did you mean [%s]?)", name, s);
            } else {
                char list[256];
                section_list(list, sizeof list);
                snprintf(msg, n, "unknown section [%s] (sections: %s)", name, list);
            }
            return -1;
        }
        return 0;
    }
    if (line[0]) {
        size_t sep = strcspn(line, "=:");
        if (!line[sep]) {
            show(shown, sizeof shown, line);
            snprintf(msg, n, "expected 'key = value', '[section]' or a comment, not %s", shown);
            return -1;
        }
        if (sep == 0) {
            snprintf(msg, n, "missing key name before '%c'", line[0]);
            return -1;
        }
    }
    return 0;
}

static int config_parse(lb_config *c, const char *text, const char *fname, char *err,
                        size_t errlen);

// The message quotes the input, which may be any bytes: it is escaped to print as it reads.
int lb_config_parse(lb_config *c, const char *text, const char *fname, char *err, size_t errlen)
{
    int rc = config_parse(c, text, fname, err, errlen);
    if (rc != 0) lb_escape_bytes(err, errlen);
    return rc;
}

static int config_parse(lb_config *c, const char *text, const char *fname, char *err,
                        size_t errlen)
{
    if (!fname) fname = "(string)";
    size_t tlen = strlen(text);
    int nlines = 1;
    for (const char *s = text; *s; s++) nlines += *s == '\n';
    char *clean = malloc(tlen + 2);   // cleaned text is never longer than the input
    int *keylines = malloc(sizeof(int) * (size_t)nlines);
    lb_parse_ctx *x = calloc(1, sizeof *x);
    if (!clean || !keylines || !x) {
        free(clean);
        free(keylines);
        free(x);
        snprintf(err, errlen, "%s: out of memory", fname);
        return -1;
    }

    // Pass 1: clean the text line for line; stop before the first line we reject, so that an
    // earlier error found by inih still comes first.
    const char *p = text;
    if (!strncmp(p, "\xEF\xBB\xBF", 3)) p += 3;   // UTF-8 byte order mark
    size_t olen = 0;
    int lineno = 0, badline = 0, nkeys = 0;
    char badmsg[LB_MSG] = "";
    while (*p) {
        const char *eol = strchr(p, '\n');
        size_t raw = eol ? (size_t)(eol - p) : strlen(p);
        lineno++;
        char *line = clean + olen;
        memcpy(line, p, raw);
        line[raw] = 0;
        size_t len = clean_line(line);
        if (check_line(line, len, badmsg, sizeof badmsg) != 0) {
            badline = lineno;
            break;
        }
        if (line[0] && line[0] != '[') keylines[nkeys++] = lineno;
        olen += len;
        clean[olen++] = '\n';
        if (!eol) break;
        p = eol + 1;
    }
    clean[olen] = 0;

    // Pass 2: inih splits key = value lines; on_key checks and applies them.
    x->cfg = *c;
    x->keylines = keylines;
    x->nkeys = nkeys;
    int rc = ini_parse_string(clean, on_key, x);
    int ok = 0;
    if (rc > 0)
        snprintf(err, errlen, "%s:%d: %s", fname, rc, x->msg[0] ? x->msg : "syntax error");
    else if (rc < 0)
        snprintf(err, errlen, "%s: inih failed (error %d)", fname, rc);
    else if (badline)
        snprintf(err, errlen, "%s:%d: %s", fname, badline, badmsg);
    else
        ok = 1;
    if (ok) {
        // Lines recorded for another file would point into the wrong text.
        if (strcmp(x->cfg.source_file, fname) != 0) {
            for (int i = 0; i < LB_NSLOTS; i++)
                if (!x->seen[i]) x->cfg.source_line[i] = 0;
            memset(x->cfg.source_file, 0, sizeof x->cfg.source_file);
            snprintf(x->cfg.source_file, sizeof x->cfg.source_file, "%s", fname);
        }
        *c = x->cfg;
    }
    free(clean);
    free(keylines);
    free(x);
    return ok ? 0 : -1;
}

// ---------------------------------------------------------------------------------------------
// --set section.key=value

static char *trim(char *s)
{
    while (isspace((unsigned char)*s)) s++;
    size_t len = strlen(s);
    while (len > 0 && isspace((unsigned char)s[len - 1])) s[--len] = 0;
    return s;
}

int lb_config_set(lb_config *c, const char *assignment, char *err, size_t errlen)
{
    char *copy = strdup(assignment);
    if (!copy) {
        snprintf(err, errlen, "--set: out of memory");
        return -1;
    }
    int rc = -1;
    char shown[80], msg[LB_MSG];
    char *eq = strchr(copy, '=');
    if (!eq) {
        show(shown, sizeof shown, assignment);
        snprintf(err, errlen, "--set %.*s: missing '=' (expected section.key=value)",
                 (int)strlen(shown) - 2, shown + 1);
        goto out;
    }
    *eq = 0;
    char *name = trim(copy), *value = trim(eq + 1);
    show(shown, sizeof shown, name);
    // the prefix names what the user typed, without our quotes
    char prefix[96];
    snprintf(prefix, sizeof prefix, "--set %.*s", (int)strlen(shown) - 2, shown + 1);
    char *dot = strchr(name, '.');
    if (!name[0]) {
        show(shown, sizeof shown, assignment);
        snprintf(err, errlen, "--set %.*s: missing section.key before '=' (expected "
                 "section.key=value)", (int)strlen(shown) - 2, shown + 1);
        goto out;
    }
    if (!dot || dot == name) {
        int s = suggest_key_index(dot ? dot + 1 : name, NULL);
        if (s >= 0)
            snprintf(err, errlen, "%s: missing section (expected section.key=value; did you "
                     "mean '%s.%s'?)", prefix, lb_params[s].section, lb_params[s].key);
        else snprintf(err, errlen, "%s: missing section (expected section.key=value)", prefix);
        goto out;
    }
    *dot = 0;
    const char *section = name, *key = dot + 1;
    if (!key[0]) {
        snprintf(err, errlen, "%s: missing key after '.' (expected section.key=value)", prefix);
        goto out;
    }
    if (!section_known(section)) {
        const char *s = suggest_section(section);
        char sec[80];
        show(sec, sizeof sec, section);
        if (s && find_param(s, key) >= 0)
            snprintf(err, errlen, "%s: unknown section %s (did you mean '%s.%s'?)", prefix, sec,
                     s, key);
        else if (s)
            snprintf(err, errlen, "%s: unknown section %s (did you mean '%s'?)", prefix, sec, s);
        else {
            char list[256];
            section_list(list, sizeof list);
            snprintf(err, errlen, "%s: unknown section %s (sections: %s)", prefix, sec, list);
        }
        goto out;
    }
    int i = find_param(section, key);
    if (i < 0) {
        int s = suggest_key_index(key, section);
        show(shown, sizeof shown, key);
        if (s >= 0)
            snprintf(err, errlen, "%s: unknown key %s in [%s] (did you mean '%s.%s'?)", prefix,
                     shown, section, lb_params[s].section, lb_params[s].key);
        else snprintf(err, errlen, "%s: unknown key %s in [%s]", prefix, shown, section);
        goto out;
    }
    // the same value rules as a file: surrounding blanks and one pair of quotes removed
    char *v = unquote(value, msg, sizeof msg);
    if (!v || set_value(c, &lb_params[i], v, msg, sizeof msg) != 0) {
        snprintf(err, errlen, "%s: %s", prefix, msg);
        goto out;
    }
    c->source_line[i] = 0;   // the file no longer decides this key
    c->key_set[i] = 1;
    rc = 0;
out:
    free(copy);
    return rc;
}

_Static_assert(sizeof(((lb_config *)0)->key_set) == LB_NSLOTS, "a key_set slot per source_line");

int lb_config_is_set(const lb_config *c, const char *section, const char *key)
{
    int i = find_param(section, key);
    return i >= 0 && i < LB_NSLOTS && c->key_set[i];
}

// ---------------------------------------------------------------------------------------------
// Cross-key checks

// "FILE:LINE: " for the first of the keys that a file line set, else "FILE: ", else "".
static void where(const lb_config *c, const char *k1, const char *k2, char *out, size_t n)
{
    const char *keys[2] = {k1, k2};
    out[0] = 0;
    if (!c->source_file[0]) return;
    for (int k = 0; k < 2; k++) {
        if (!keys[k]) continue;
        char sec[32];
        const char *dot = strchr(keys[k], '.');
        snprintf(sec, sizeof sec, "%.*s", (int)(dot - keys[k]), keys[k]);
        int i = find_param(sec, dot + 1);
        if (i >= 0 && i < LB_NSLOTS && c->source_line[i] > 0) {
            snprintf(out, n, "%.*s:%d: ", (int)sizeof c->source_file, c->source_file,
                     c->source_line[i]);
            return;
        }
    }
    snprintf(out, n, "%.*s: ", (int)sizeof c->source_file, c->source_file);
}

__attribute__((format(printf, 6, 7)))
static int fail(const lb_config *c, char *err, size_t errlen, const char *k1, const char *k2,
                const char *fmt, ...)
{
    char pre[LB_PATH_MAX + 32], msg[LB_MSG];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    where(c, k1, k2, pre, sizeof pre);
    snprintf(err, errlen, "%s%s", pre, msg);
    return -1;
}

// A configuration filled by code (or read from a checkpoint) gets the same per-key checks as a
// file: range, choices, well-formed strings.
static int check_field(const lb_config *c, const lb_param *p, char *msg, size_t n)
{
    char val[64], range[96];   // numbers only
    const void *f = cfield_of(c, p);
    if (p->type == LB_PARAM_STRING || p->type == LB_PARAM_ENUM) {
        if (!memchr(f, 0, p->size)) {
            snprintf(msg, n, "value is not terminated");
            return -1;
        }
        const char *s = f;
        lb_config tmp;   // through the setter for the same rules (choices, characters)
        return set_value(&tmp, p, s, msg, n);
    }
    if (p->type == LB_PARAM_BOOL) {
        int b = *(const int *)f;
        if (b != 0 && b != 1) {
            snprintf(msg, n, "%d is not a boolean (0 or 1)", b);
            return -1;
        }
        return 0;
    }
    double x = p->type == LB_PARAM_INT ? *(const int *)f
             : p->type == LB_PARAM_U64 ? (double)*(const uint64_t *)f : *(const double *)f;
    lb_param_format(c, p, val, sizeof val);
    if (!isfinite(x)) {
        snprintf(msg, n, "%s is not a finite number", val);
        return -1;
    }
    if (p->min < p->max && !(x >= p->min && x <= p->max)) {
        range_text(range, sizeof range, p);
        snprintf(msg, n, "%s is out of range %s", val, range);
        return -1;
    }
    return 0;
}

// The earliest whole-word [model] key in a model check's message, to find its line.
static const char *model_key_in(const char *msg, char *out, size_t n)
{
    const char *best = NULL;
    int bi = -1;
    for (int i = 0; i < lb_nparams; i++) {
        if (strcmp(lb_params[i].section, "model")) continue;
        const char *key = lb_params[i].key;
        size_t kl = strlen(key);
        for (const char *s = strstr(msg, key); s; s = strstr(s + 1, key)) {
            int before = s > msg && (isalnum((unsigned char)s[-1]) || s[-1] == '_');
            int after = isalnum((unsigned char)s[kl]) || s[kl] == '_';
            if (!before && !after) {
                if (!best || s < best) { best = s; bi = i; }
                break;
            }
        }
    }
    if (bi < 0) return NULL;
    snprintf(out, n, "model.%s", lb_params[bi].key);
    return out;
}

static int divides(int what, const char *what_key, int by, const char *by_key, const char *why,
                   const char *keys[2], char *err, size_t errlen)
{
    if (what <= 0 || by <= 1 || what % by == 0) return 0;
    snprintf(err, errlen, "%s (%d) is not divisible by %s (%d)%s", what_key, what, by_key, by, why);
    keys[0] = what_key;
    keys[1] = by_key;
    return -1;
}

int lb_config_check_shapes(const lb_parallel_config *pc, const lb_config_shapes *s,
                           const char *keys[2], char *err, size_t errlen)
{
    keys[0] = keys[1] = NULL;
    int etp = pc->etp ? pc->etp : pc->tp;
    const char *etp_key = pc->etp ? "parallel.etp" : "parallel.etp (= parallel.tp)";
    if (divides(s->heads, "model.num_attention_heads", pc->tp, "parallel.tp",
                ": tensor parallelism splits the query heads", keys, err, errlen) ||
        divides(s->kv_heads, "model.num_key_value_heads", pc->tp, "parallel.tp",
                ": tensor parallelism splits the key/value heads", keys, err, errlen) ||
        divides(s->ffn, "model.intermediate_size", pc->tp, "parallel.tp",
                ": tensor parallelism splits the MLP", keys, err, errlen) ||
        divides(s->experts, "model.num_experts", pc->ep, "parallel.ep",
                ": every expert-parallel rank holds the same number of experts", keys, err,
                errlen) ||
        divides(s->layers, "model.num_hidden_layers", pc->pp, "parallel.pp",
                ": every pipeline stage holds the same number of layers", keys, err, errlen))
        return -1;
    if (divides(s->moe_ffn, "model.moe_intermediate_size", etp, etp_key,
                ": expert tensor parallelism splits each expert", keys, err, errlen)) {
        keys[1] = pc->etp ? "parallel.etp" : "parallel.tp";
        return -1;
    }
    if (pc->sequence_parallel) {
        if (pc->tp == 1) {
            snprintf(err, errlen, "parallel.sequence_parallel needs parallel.tp > 1 (it splits "
                     "the tensor-parallel group's activations over the sequence)");
            keys[0] = "parallel.sequence_parallel";
            keys[1] = "parallel.tp";
            return -1;
        }
        if (divides(s->seq_len, "train.seq_len", pc->tp, "parallel.tp",
                    ": sequence parallelism splits the sequence", keys, err, errlen))
            return -1;
    }
    if ((pc->fail_rank >= 0) != (pc->fail_step > 0)) {
        snprintf(err, errlen, "parallel.fail_rank and parallel.fail_step go together (rank %d, "
                 "step %d): set both to make a rank fail on purpose, or neither", pc->fail_rank,
                 pc->fail_step);
        keys[0] = "parallel.fail_rank";
        keys[1] = "parallel.fail_step";
        return -1;
    }
    return 0;
}

int lb_config_validate(const lb_config *c, char *err, size_t errlen)
{
    char msg[LB_MSG];
    for (int i = 0; i < lb_nparams; i++) {
        const lb_param *p = &lb_params[i];
        if (check_field(c, p, msg, sizeof msg) != 0) {
            char key[80];
            snprintf(key, sizeof key, "%s.%s", p->section, p->key);
            return fail(c, err, errlen, key, NULL, "%s: %s", key, msg);
        }
    }
    const lb_model_config *m = &c->model;
    if (m->num_attention_heads % m->num_key_value_heads != 0)
        return fail(c, err, errlen, "model.num_attention_heads", "model.num_key_value_heads",
                    "model.num_attention_heads (%d) is not a multiple of "
                    "model.num_key_value_heads (%d)", m->num_attention_heads,
                    m->num_key_value_heads);
    if (c->train.seq_len > m->max_position_embeddings)
        return fail(c, err, errlen, "train.seq_len", "model.max_position_embeddings",
                    "train.seq_len (%d) exceeds model.max_position_embeddings (%d)",
                    c->train.seq_len, m->max_position_embeddings);
    long long tokens = (long long)c->train.micro_batch * c->train.seq_len;
    if (tokens > INT_MAX)
        return fail(c, err, errlen, "train.micro_batch", "train.seq_len",
                    "train.micro_batch * train.seq_len = %lld tokens, more than an int holds "
                    "(%d)", tokens, INT_MAX);
    if (c->train.min_lr > c->train.lr) {
        char a[40], b[40];
        fmt_double(a, sizeof a, c->train.min_lr);
        fmt_double(b, sizeof b, c->train.lr);
        return fail(c, err, errlen, "train.min_lr", "train.lr",
                    "train.min_lr (%s) exceeds train.lr (%s)", a, b);
    }
    if (c->train.warmup_steps > c->train.steps)
        return fail(c, err, errlen, "train.warmup_steps", "train.steps",
                    "train.warmup_steps (%d) exceeds train.steps (%d): add --set "
                    "train.warmup_steps=%d or fewer", c->train.warmup_steps, c->train.steps,
                    c->train.steps);
    // AdamW's bias correction divides by 1 - beta^t
    if (c->train.beta1 >= 1)
        return fail(c, err, errlen, "train.beta1", NULL, "train.beta1 must be below 1");
    if (c->train.beta2 >= 1)
        return fail(c, err, errlen, "train.beta2", NULL, "train.beta2 must be below 1");
    const lb_model_def *def = lb_model_lookup(m->arch);
    if (def && def->check && def->check(m, msg, sizeof msg) != 0) {
        char key[80];
        return fail(c, err, errlen, model_key_in(msg, key, sizeof key), NULL, "%s", msg);
    }
    // The layout's splits of the model (heads by tp, experts by ep, layers by pp, ...): the
    // parts that need no world size, so they stop `lowbit` before MPI work.
    int moe = def && def->moe;
    lb_config_shapes shapes = {m->num_hidden_layers, m->num_attention_heads, m->num_key_value_heads,
                             moe ? m->num_experts : 0, moe ? 0 : m->intermediate_size,
                             moe ? m->moe_intermediate_size : 0, m->vocab_size,
                             c->train.seq_len};
    const char *keys[2];
    if (lb_config_check_shapes(&c->parallel, &shapes, keys, msg, sizeof msg) != 0)
        return fail(c, err, errlen, keys[0], keys[1], "%s", msg);
    if (c->parallel.micro_batches > 0 && c->train.grad_accum % c->parallel.micro_batches != 0)
        return fail(c, err, errlen, "train.grad_accum", "parallel.micro_batches",
                    "train.grad_accum (%d) is not a multiple of parallel.micro_batches (%d): "
                    "grad_accum = micro_batches x dp", c->train.grad_accum,
                    c->parallel.micro_batches);
    // The contract's lists (roles, layers, overrides) are parsed here so a bad word stops the
    // run before any work; its messages start with the key ("precision.overrides: ...").
    lb_contract k;
    const lb_precision_spec ps = lb_config_precision(c);
    if (lb_contract_resolve(&k, &ps, m->num_hidden_layers, msg, sizeof msg) != 0) {
        char key[80];
        size_t n = strcspn(msg, ":");
        snprintf(key, sizeof key, "%.*s", (int)(n < sizeof key ? n : sizeof key - 1), msg);
        return fail(c, err, errlen, key, NULL, "%s", msg);
    }
    lb_contract_free(&k);
    return 0;
}

// ---------------------------------------------------------------------------------------------
// The resolved configuration

typedef struct {
    char *s;
    size_t len, cap;
    int oom;
} lb_text;

__attribute__((format(printf, 2, 3)))
static void text_add(lb_text *t, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (t->oom || n < 0) { t->oom = 1; return; }
    if (t->len + (size_t)n + 1 > t->cap) {
        size_t cap = t->cap ? t->cap : 4096;
        while (t->len + (size_t)n + 1 > cap) cap *= 2;
        char *s = realloc(t->s, cap);
        if (!s) { t->oom = 1; return; }
        t->s = s;
        t->cap = cap;
    }
    va_start(ap, fmt);
    vsnprintf(t->s + t->len, t->cap - t->len, fmt, ap);
    va_end(ap);
    t->len += (size_t)n;
}

// Quotes a string value that a file would otherwise read differently: surrounding blanks
// (stripped), a leading '"' (unquoted) or a leading '#' or ';' (a comment after "= ").
static int needs_quotes(const char *s)
{
    size_t len = strlen(s);
    return len > 0 && (s[0] == '"' || s[0] == '#' || s[0] == ';' || isspace((unsigned char)s[0])
                       || isspace((unsigned char)s[len - 1]));
}

char *lb_config_to_ini(const lb_config *c)
{
    lb_text t = {0};
    char val[LB_PATH_MAX + 8];
    for (int i = 0; i < lb_nparams; i++) {
        const lb_param *p = &lb_params[i];
        if (i == 0 || strcmp(p->section, lb_params[i - 1].section))
            text_add(&t, "%s[%s]\n", i ? "\n" : "", p->section);
        lb_param_format(c, p, val, sizeof val);
        const char *q = p->type == LB_PARAM_STRING && needs_quotes(val) ? "\"" : "";
        text_add(&t, "%s = %s%s%s\n", p->key, q, val, q);
    }
    if (t.oom || !t.s) {
        free(t.s);
        return NULL;
    }
    return t.s;
}

// ---------------------------------------------------------------------------------------------
// doc/parameters.md

// A table cell: '|' would end the cell.
static void md_cell(FILE *f, const char *s)
{
    for (; *s; s++) {
        if (*s == '|') fputc('\\', f);
        fputc(*s, f);
    }
}

static const char *type_name(lb_param_type t)
{
    switch (t) {
    case LB_PARAM_INT: return "int";
    case LB_PARAM_U64: return "u64";
    case LB_PARAM_FLOAT: return "float";
    case LB_PARAM_BOOL: return "bool";
    case LB_PARAM_STRING: return "string";
    case LB_PARAM_ENUM: return "enum";
    }
    return "?";
}

// A key's range or choices as plain text ("" when it has none).
static void range_or_choices(char *out, size_t n, const lb_param *p)
{
    out[0] = 0;
    if (p->type == LB_PARAM_ENUM) snprintf(out, n, "%s", lb_param_choices(p));
    else if (p->type == LB_PARAM_BOOL) snprintf(out, n, "true|false");
    else if (p->type != LB_PARAM_STRING && p->min < p->max) range_text(out, n, p);
}

static int in_sections(const char *sections, const char *sec)
{
    if (!sections[0]) return 1;
    size_t n = strlen(sec);
    for (const char *s = sections; (s = strstr(s, sec)); s += n)
        if ((s == sections || s[-1] == ' ') && (s[n] == ' ' || !s[n])) return 1;
    return 0;
}

void lb_params_text(FILE *f, const char *sections)
{
    for (int i = 0; i < lb_nparams; i++) {
        const lb_param *p = &lb_params[i];
        if (!in_sections(sections, p->section)) continue;
        if (i == 0 || strcmp(p->section, lb_params[i - 1].section)) fprintf(f, "[%s]\n", p->section);
        char key[96], range[200];
        snprintf(key, sizeof key, "%s.%s", p->section, p->key);
        range_or_choices(range, sizeof range, p);
        fprintf(f, "  %-34s %-6s %-14s %s%s%s\n", key, type_name(p->type),
                p->def[0] ? p->def : "\"\"", p->help, range[0] ? "; " : "", range);
    }
}

// Text for roff: a leading dot or quote escaped, backslashes doubled.
static void roff(FILE *f, const char *s)
{
    if (*s == '.' || *s == '\'') fputs("\\&", f);
    for (; *s; s++) {
        if (*s == '\\') fputs("\\e", f);
        else if (*s == '-') fputs("\\-", f);
        else fputc(*s, f);
    }
}

void lb_params_man(FILE *f, const lb_command_doc *cmds, int ncmds)
{
    fprintf(f, ".TH LOWBIT 1 \"\" \"lowbit\" \"User Commands\"\n.SH NAME\n"
               "lowbit \\- low-precision training and RL for mixture-of-experts transformers\n"
               ".SH SYNOPSIS\n.B lowbit\n.I command\n[\\fIFILE.cfg\\fR] "
               "[\\fB\\-\\-set\\fR \\fIsection.key=value\\fR ...]\n.br\n"
               ".B mpirun \\-np\n.I N\n.B lowbit\n.I command FILE.cfg ...\n"
               ".SH DESCRIPTION\nOne MPI program: it pretrains Qwen3\\-MoE models with FP8, MXFP8, "
               "MXFP4 and NVFP4 GEMMs under a precision contract, splits work by tensor, "
               "pipeline, expert and data parallelism, and runs GRPO with the sampler inside "
               "the trainer. Parameter files are INI text; every key below may also be given "
               "as \\fB\\-\\-set\\fR section.key=value. \\fBlowbit\\fR \\fIcommand\\fR "
               "\\fB\\-\\-help\\fR lists a command's keys.\n.SH COMMANDS\n");
    for (int i = 0; i < ncmds; i++) {
        fprintf(f, ".TP\n.B %s\n", cmds[i].name);
        roff(f, cmds[i].purpose);
        fputs(".\n.br\nExample: ", f);
        roff(f, cmds[i].example);
        fputc('\n', f);
    }
    fputs(".SH PARAMETERS\n", f);
    for (int i = 0; i < lb_nparams; i++) {
        const lb_param *p = &lb_params[i];
        if (i == 0 || strcmp(p->section, lb_params[i - 1].section))
            fprintf(f, ".SS [%s]\n", p->section);
        char range[200];
        range_or_choices(range, sizeof range, p);
        fprintf(f, ".TP\n.B %s.%s\n", p->section, p->key);
        fprintf(f, "%s, default ", type_name(p->type));
        roff(f, p->def[0] ? p->def : "\"\"");
        if (range[0]) {
            fputs(", ", f);
            roff(f, range);
        }
        fputs(": ", f);
        roff(f, p->help);
        fputc('\n', f);
    }
    fputs(".SH FILES\nOUT_DIR/metrics.jsonl, OUT_DIR/checkpoints/step_*.safetensors\n"
          ".SH SEE ALSO\nThe README and doc/ of the source tree (installed under the "
          "package's doc directory): doc/parameters.md, doc/rl.md, doc/benchmarks.md.\n", f);
}

void lb_params_markdown(FILE *f)
{
    fprintf(f, "# Parameters\n\n"
            "This file is generated by `lowbit params` from the parameter table in "
            "src/cli/params.c, whose [model] keys are the models' (the shared blocks' in "
            "models/blocks.c, a family's own in its model file, listed by models/registry.c); "
            "do not edit it by hand (`make doc-params` rewrites it).\n\n"
            "A parameter file is INI text: `[section]` headers and `key = value` lines. A `#` "
            "or `;` starts a comment at the beginning of a line or after a blank. A value may "
            "be wrapped in double quotes, which are removed (`resume = \"\"` is empty). Lines "
            "hold at most %d characters, comments not counted. Every key may appear once per "
            "file, and `--set section.key=value` on the command line overrides it. An unknown "
            "key or a bad value stops the run before any work with `file:line: message`.\n\n"
            "Booleans are true/false, yes/no, on/off or 1/0. Ranges are inclusive.\n",
            LB_INI_LINE);
    for (int i = 0; i < lb_nparams; i++) {
        const lb_param *p = &lb_params[i];
        if (i == 0 || strcmp(p->section, lb_params[i - 1].section))
            fprintf(f, "\n## [%s]\n\n| key | type | default | range / choices | description |\n"
                    "|---|---|---|---|---|\n", p->section);
        fprintf(f, "| `%s` | %s | ", p->key, type_name(p->type));
        if (p->def[0]) {
            fputc('`', f);
            md_cell(f, p->def);
            fputc('`', f);
        } else {
            fputs("`\"\"`", f);
        }
        fputs(" | ", f);
        if (p->type == LB_PARAM_ENUM) {
            const char *choices = lb_param_choices(p);
            for (const char *s = choices; *s;) {
                size_t w = strcspn(s, "|");
                fprintf(f, "%s`%.*s`", s == choices ? "" : ", ", (int)w, s);
                s += w + (s[w] == '|');
            }
        } else if (p->type == LB_PARAM_STRING) {
            fprintf(f, "at most %zu characters", p->size - 1);
        } else if (p->type == LB_PARAM_BOOL) {
            fputs("true, false", f);
        } else if (p->min < p->max) {
            char range[96];
            range_text(range, sizeof range, p);
            fputs(range, f);
        }
        fputs(" | ", f);
        md_cell(f, p->help);
        fputs(" |\n", f);
    }
}

// The index of s among a choice list's names (the parser let only those through).
// An enum parameter's value as its index among the table's choices, which the enum it stands
// for lists in the same order (tests/test_config.c checks each pairing by name).
static int enum_index(const lb_config *c, const char *section, const char *key)
{
    for (int i = 0; i < lb_nparams; i++) {
        const lb_param *p = &lb_params[i];
        if (p->type != LB_PARAM_ENUM || strcmp(p->section, section) || strcmp(p->key, key))
            continue;
        const char *v = (const char *)c + p->offset;
        int k = choice_of(lb_param_choices(p), v);
        if (k < 0)
            lb_die("%s.%s: '%s' passed the parameter table's check but is not one of its "
                   "choices", section, key, v);
        return k;
    }
    lb_die("%s.%s: no such enum parameter", section, key);
}

int lb_config_recompute(const lb_config *c) { return enum_index(c, "train", "recompute"); }

lb_kv_kind lb_config_kv_cache(const lb_config *c)
{
    return (lb_kv_kind)enum_index(c, "sample", "kv_cache");
}

lb_precision_spec lb_config_precision(const lb_config *c)
{
    lb_precision_spec s;
    memset(&s, 0, sizeof s);
    s.recipe = (lb_recipe)enum_index(c, "precision", "recipe");
    s.backward = (lb_backward_choice)enum_index(c, "precision", "backward");
    s.wgrad_hadamard = (lb_wgrad_hadamard_choice)enum_index(c, "precision", "wgrad_hadamard");
    s.stochastic_rounding = c->precision.stochastic_rounding;
    s.scale_rule = (lb_scale_rule)enum_index(c, "precision", "scale_rule");
    s.scale_pow2 = enum_index(c, "precision", "scale");
    s.nvfp4_per_tensor = enum_index(c, "precision", "nvfp4_scale");
    s.nvfp4_weight_2d = enum_index(c, "precision", "nvfp4_weight_blocks");
    _Static_assert(sizeof s.keep_bf16_roles == sizeof c->precision.keep_bf16_roles &&
                       sizeof s.keep_bf16_layers == sizeof c->precision.keep_bf16_layers &&
                       sizeof s.overrides == sizeof c->precision.overrides,
                   "the lists fit");
    memcpy(s.keep_bf16_roles, c->precision.keep_bf16_roles, sizeof s.keep_bf16_roles);
    memcpy(s.keep_bf16_layers, c->precision.keep_bf16_layers, sizeof s.keep_bf16_layers);
    memcpy(s.overrides, c->precision.overrides, sizeof s.overrides);
    s.attention = (lb_attention_choice)enum_index(c, "precision", "attention");
    return s;
}
