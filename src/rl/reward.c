// reward.c: the reward registry, the answer checks and the rewards' set-up (see reward.h; the
// command itself runs in src/rl/reward_cmd.c).
#define PCRE2_CODE_UNIT_WIDTH 8
#include "src/rl/reward.h"

#include <errno.h>
#include <pcre2.h>
#include <spawn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include "kernels/common.h"
#include "src/io/data.h"

extern char **environ;

// --- the arithmetic task ------------------------------------------------------------------------

// 1 when the completion parses as an integer (up to a newline or its end) equal to the answer.
static double arith_exact(const lb_reward_ctx *ctx, const lb_reward_item *it)
{
    long want, got;
    if (lb_arith_answer(it->prompt, &want) != 0) return 0.0;
    if (lb_arith_parse_completion(it->completion, it->len, &got) != 0) return 0.0;
    return got == want ? 1.0 : 0.0;
}

// format_reward for a well-formed answer: an optional '-', digits, then the newline that ends
// the completion (so a completion cut by the length limit earns nothing).
static double arith_format(const lb_reward_ctx *ctx, const lb_reward_item *it)
{
    long v;
    if (it->len < 2 || it->completion[it->len - 1] != '\n') return 0.0;
    if (lb_arith_parse_completion(it->completion, it->len, &v) != 0) return 0.0;
    return ctx->format_reward;
}

// Partial credit: the share of the answer's characters (digits, and the sign) the completion
// has right at the same place value, over the longer of the two; 0 when the completion is not
// an integer. A model that rarely gets a whole answer right still gets a graded signal.
static double arith_digits(const lb_reward_ctx *ctx, const lb_reward_item *it)
{
    long want, got;
    if (lb_arith_answer(it->prompt, &want) != 0) return 0.0;
    if (lb_arith_parse_completion(it->completion, it->len, &got) != 0) return 0.0;
    char a[32], b[32];
    int la = snprintf(a, sizeof a, "%ld", want), lg = snprintf(b, sizeof b, "%ld", got);
    int n = la > lg ? la : lg, same = 0;
    for (int i = 1; i <= la && i <= lg; i++) same += a[la - i] == b[lg - i];   // from the units
    return (double)same / n;
}

// --- answers: the final number or \boxed{} of a completion against a reference --------------

// A number as an exact reduced fraction (den > 0).
typedef struct {
    int64_t num, den;
} ratio;

static int64_t gcd64(int64_t a, int64_t b)
{
    if (a < 0) a = -a;
    while (b) {
        int64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

static int is_digit(char ch) { return ch >= '0' && ch <= '9'; }
static int is_alnum(char ch)
{
    return is_digit(ch) || (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z');
}

// Digits at s[i..n) into *v (at most 18 in all, counted in *nd); returns the index past them.
static size_t digits(const char *s, size_t n, size_t i, int64_t *v, int *nd)
{
    for (; i < n && is_digit(s[i]); i++) {
        if (++*nd > 18) return i;   // the caller sees nd > 18: too long to compare
        *v = *v * 10 + (s[i] - '0');
    }
    return i;
}

// A number starting at s[i] (len n): [sign] digits with comma groups of three ("1,000"),
// [.digits], or [sign] digits/digits, or [sign]\frac{digits}{digits} (\dfrac, \tfrac). A '-'
// (or the UTF-8 minus U+2212) is a sign only where no letter, digit or ')' precedes it: in
// "5-3" the numbers are 5 and 3. Returns the index past it, 0 when none starts at i.
static size_t number_at(const char *s, size_t n, size_t i, ratio *out)
{
    int neg = 0;
    size_t j = i;
    int after_word = i > 0 && (is_alnum(s[i - 1]) || s[i - 1] == ')');
    if (s[j] == '-' || s[j] == '+') neg = s[j] == '-', j++;
    else if (n - j >= 3 && !memcmp(s + j, "\xe2\x88\x92", 3)) neg = 1, j += 3;
    if (j > i && after_word) return 0;
    static const char *fracs[] = {"\\frac{", "\\dfrac{", "\\tfrac{"};
    for (int f = 0; f < 3; f++) {
        size_t fl = strlen(fracs[f]);
        if (n - j < fl || memcmp(s + j, fracs[f], fl)) continue;
        int64_t a = 0, b = 0;
        int na = 0, nb = 0;
        size_t k = digits(s, n, j + fl, &a, &na);
        if (!na || na > 18 || k + 1 >= n || s[k] != '}' || s[k + 1] != '{') return 0;
        k = digits(s, n, k + 2, &b, &nb);
        if (!nb || nb > 18 || k >= n || s[k] != '}' || b == 0) return 0;
        int64_t g = gcd64(a, b);
        *out = (ratio){neg ? -a / g : a / g, b / g};
        return k + 1;
    }
    int64_t v = 0, den = 1;
    int nd = 0;
    size_t k = digits(s, n, j, &v, &nd);
    const int lead = (int)(k - j);   // 0: ".5"
    if (!lead && !(k + 1 < n && s[k] == '.' && is_digit(s[k + 1]))) return 0;
    // thousands: a comma and exactly three digits, after a first group of at most three
    while (lead && lead <= 3 && nd <= 18 && k + 3 < n && s[k] == ',' && is_digit(s[k + 1]) &&
           is_digit(s[k + 2]) && is_digit(s[k + 3]) && (k + 4 >= n || !is_digit(s[k + 4])))
        k = digits(s, n, k + 1, &v, &nd);
    if (k + 1 < n && s[k] == '.' && is_digit(s[k + 1])) {
        size_t e = digits(s, n, k + 1, &v, &nd);
        for (size_t t = k + 1; t < e; t++) den *= 10;
        k = e;
    } else if (lead && k + 1 < n && s[k] == '/' && is_digit(s[k + 1])) {
        int64_t b = 0;
        int nb = 0;
        size_t e = digits(s, n, k + 1, &b, &nb);
        if (nb <= 18 && b != 0) den = b, k = e;
    }
    if (nd > 18) return 0;   // beyond int64: not compared
    int64_t g = gcd64(v, den);
    *out = (ratio){neg ? -v / g : v / g, den / g};
    return k;
}

// The last number of s[0..n) into *r and its span [*a, *b). 0, or -1 when it has none.
static int last_number(const char *s, size_t n, ratio *r, size_t *a, size_t *b)
{
    int found = 0;
    for (size_t i = 0; i < n;) {
        ratio v;
        size_t e = number_at(s, n, i, &v);
        if (!e) {
            i++;
            continue;
        }
        *r = v, *a = i, *b = e, found = 1;
        i = e;
    }
    return found ? 0 : -1;
}

// The content of the last complete \boxed{...} of s[0..n): [*a, *b). 0, or -1.
static int last_boxed(const char *s, size_t n, size_t *a, size_t *b)
{
    static const char key[] = "\\boxed{";
    int found = 0;
    for (size_t i = 0; i + sizeof key - 1 <= n; i++) {
        if (memcmp(s + i, key, sizeof key - 1)) continue;
        size_t j = i + sizeof key - 1;
        int depth = 1;
        for (size_t k = j; k < n; k++) {
            depth += (s[k] == '{') - (s[k] == '}');
            if (!depth) {
                *a = j, *b = k, found = 1;
                break;
            }
        }
    }
    return found ? 0 : -1;
}

// The text s[0..n) as one number: blanks, a leading $ or \$, a trailing %, \% or '.', and a
// unit (blank-separated letters: "5 cm") around exactly one number. 0, or -1.
static int whole_number(const char *s, size_t n, ratio *r)
{
    size_t a = 0, b = n;
    while (a < b && (s[a] == ' ' || s[a] == '\t' || s[a] == '\n')) a++;
    if (b - a >= 2 && s[a] == '\\' && s[a + 1] == '$') a += 2;
    else if (a < b && s[a] == '$') a++;
    size_t e = number_at(s, b, a, r);
    if (!e) return -1;
    if (e + 2 <= b && s[e] == '\\' && s[e + 1] == '%') e += 2;
    else if (e < b && (s[e] == '%' || s[e] == '.')) e++;
    while (e < b && (s[e] == ' ' || s[e] == '\t')) e++;
    size_t u = e;
    while (u < b && ((s[u] >= 'a' && s[u] <= 'z') || (s[u] >= 'A' && s[u] <= 'Z'))) u++;
    if (u > e && (u == b || s[u] == '.' || s[u] == ' ' || s[u] == '\n')) e = u + (u < b);
    while (e < b && (s[e] == ' ' || s[e] == '\t' || s[e] == '\n' || s[e] == '.')) e++;
    return e == b ? 0 : -1;
}

int lb_answer_final(const char *text, size_t len, char *out, size_t cap)
{
    size_t a, b;
    ratio r;
    if (last_boxed(text, len, &a, &b) != 0 && last_number(text, len, &r, &a, &b) != 0) return -1;
    snprintf(out, cap, "%.*s", (int)(b - a), text + a);
    return 0;
}

// s[0..n) without blanks and $, \left and \right, \dfrac and \tfrac as \frac: text answers
// ("x^2+1", "\frac{\pi}{2}") compared as written otherwise.
static size_t squeeze(const char *s, size_t n, char *out, size_t cap)
{
    size_t o = 0;
    for (size_t i = 0; i < n && o + 1 < cap; i++) {
        if (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '$') continue;
        if (n - i >= 5 && (!memcmp(s + i, "\\left", 5) || !memcmp(s + i, "\\dfra", 5) ||
                           !memcmp(s + i, "\\tfra", 5))) {
            if (s[i + 1] == 'l') {
                i += 4;
                continue;
            }
            i++;   // \dfrac -> \frac: drop the d or t
            out[o++] = '\\';
            continue;
        }
        if (n - i >= 6 && !memcmp(s + i, "\\right", 6)) {
            i += 5;
            continue;
        }
        out[o++] = s[i];
    }
    out[o] = 0;
    return o;
}

int lb_answer_match(const char *completion, size_t len, const char *answer)
{
    size_t ra = 0, rb = strlen(answer), a, b;
    if (last_boxed(answer, rb, &a, &b) == 0) ra = a, rb = b;   // a reference written boxed
    ratio want, got;
    const int numeric = whole_number(answer + ra, rb - ra, &want) == 0;
    if (last_boxed(completion, len, &a, &b) == 0) {
        if (numeric)
            return whole_number(completion + a, b - a, &got) == 0 && got.num == want.num &&
                   got.den == want.den;
        char x[512], y[512];
        size_t nx = squeeze(completion + a, b - a, x, sizeof x);
        size_t ny = squeeze(answer + ra, rb - ra, y, sizeof y);
        return nx > 0 && nx == ny && !memcmp(x, y, nx);
    }
    return numeric && last_number(completion, len, &got, &a, &b) == 0 && got.num == want.num &&
           got.den == want.den;
}

// 1 when the completion's final answer equals the reference (lb_answer_match).
static double answer_exact(const lb_reward_ctx *ctx, const lb_reward_item *it)
{
    return it->answer[0] && lb_answer_match(it->completion, it->len, it->answer) ? 1.0 : 0.0;
}

// format_reward for a completion that ended at a stop token and holds a final answer (a
// \boxed{} or a number).
static double answer_format(const lb_reward_ctx *ctx, const lb_reward_item *it)
{
    char buf[8];
    return it->stopped && lb_answer_final(it->completion, it->len, buf, sizeof buf) == 0
               ? ctx->format_reward : 0.0;
}

// PCRE2 code of pattern, its {answer} replaced by answer as a literal (\Q...\E). NULL with a
// message.
static pcre2_code *regex_compile(const char *pattern, const char *answer, char *err,
                                 size_t errlen)
{
    size_t n = strlen(pattern), na = answer ? strlen(answer) : 0, o = 0;
    char *src = lb_malloc(n + 8 * (na + 8) + 1);
    for (size_t i = 0; i < n;) {
        if (answer && !strncmp(pattern + i, "{answer}", 8)) {
            o += (size_t)sprintf(src + o, "\\Q");
            for (size_t k = 0; k < na; k++) {   // \E inside the answer ends the quote: split it
                if (answer[k] == '\\' && answer[k + 1] == 'E')
                    o += (size_t)sprintf(src + o, "\\E\\\\\\QE"), k++;
                else src[o++] = answer[k];
            }
            o += (size_t)sprintf(src + o, "\\E");
            i += 8;
        } else src[o++] = pattern[i++];
    }
    int code;
    PCRE2_SIZE at;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)src, o, PCRE2_UTF | PCRE2_MATCH_INVALID_UTF,
                                   &code, &at, NULL);
    free(src);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(code, msg, sizeof msg);
        snprintf(err, errlen, "rl.reward_regex: '%s' at offset %zu: %s", pattern, (size_t)at,
                 (const char *)msg);
    }
    return re;
}

static int regex_matches(const pcre2_code *re, const char *s, size_t n)
{
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(re, NULL);
    int rc = pcre2_match(re, (PCRE2_SPTR)s, n, 0, 0, md, NULL);
    pcre2_match_data_free(md);
    return rc >= 0;
}

// 1 when rl.reward_regex matches somewhere in the completion ({answer} in it: the reference,
// literally).
static double answer_regex(const lb_reward_ctx *ctx, const lb_reward_item *it)
{
    if (ctx->code) return regex_matches(ctx->code, it->completion, it->len) ? 1.0 : 0.0;
    char err[256];
    pcre2_code *re = regex_compile(ctx->regex, it->answer, err, sizeof err);
    if (!re) return 0.0;   // the pattern compiled with a probe answer at init
    double v = regex_matches(re, it->completion, it->len) ? 1.0 : 0.0;
    pcre2_code_free(re);
    return v;
}

static const lb_reward_def registry[] = {
    {"arith_exact", arith_exact, "1 if the answer to \"a+b=\" / \"a-b=\" is right, else 0"},
    {"arith_format", arith_format, "rl.format_reward for an integer followed by a newline"},
    {"arith_digits", arith_digits, "share of the answer's digits right at their place value"},
    {"answer_exact", answer_exact, "1 if the final \\boxed{} or number equals the reference"},
    {"answer_regex", answer_regex, "1 if rl.reward_regex matches ({answer}: the reference)"},
    {"answer_format", answer_format, "rl.format_reward for a final answer and a stop token"},
};

int lb_reward_count(void) { return (int)(sizeof registry / sizeof registry[0]); }

const lb_reward_def *lb_reward_lookup(const char *name)
{
    for (int i = 0; i < lb_reward_count(); i++)
        if (!strcmp(registry[i].name, name)) return &registry[i];
    return NULL;
}

int lb_rewards_need_answer(const lb_rewards *r)
{
    for (int i = 0; i < r->n; i++)
        if (r->fn[i]->fn == answer_exact) return 1;
    return 0;
}

// The program a reward command runs, checked before any work: its first word (past VAR=value
// assignments) must be something sh can run (`command -v`: a builtin, a function or a file on
// PATH or at that path). Words with quotes, expansions or redirections are left to sh.
static int command_runs(const char *command, char *err, size_t errlen)
{
    const char *p = command;
    char word[512];
    for (;;) {
        while (*p == ' ' || *p == '\t') p++;
        size_t w = strcspn(p, " \t\n");
        if (!w) return 0;   // blank: sh says so at run time
        if (w >= sizeof word || strcspn(p, "\"'$`\\(){}<>|;&*?[~") < w) return 0;
        memcpy(word, p, w);
        word[w] = 0;
        p += w;
        const char *eq = strchr(word, '=');
        if (eq && eq > word) continue;   // an assignment before the program
        break;
    }
    pid_t pid;
    char *argv[] = {"sh", "-c", "command -v \"$0\" >/dev/null 2>&1", word, NULL};
    int rc = posix_spawn(&pid, "/bin/sh", NULL, NULL, argv, environ), status = 0;
    if (rc != 0) {
        snprintf(err, errlen, "rl.reward_command: cannot run /bin/sh: %s", strerror(rc));
        return -1;
    }
    while (waitpid(pid, &status, 0) < 0)
        if (errno != EINTR) return 0;
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return 0;
    snprintf(err, errlen, "rl.reward_command: '%s' is not a command sh can run (not a builtin, "
             "nor a file on PATH or at that path)", word);
    return -1;
}

int lb_rewards_init(lb_rewards *r, const char *list, const lb_rewards_config *cfg, char *err,
                    size_t errlen)
{
    memset(r, 0, sizeof *r);
    r->ctx.format_reward = cfg->format_reward;
    r->ctx.regex = cfg->regex ? cfg->regex : "";
    r->cmd = cfg->cmd;
    if (r->cmd.command && !r->cmd.command[0]) r->cmd.command = NULL;
    if (r->cmd.batch < 1) r->cmd.batch = 1;
    if (r->cmd.workers < 1) r->cmd.workers = 1;
    for (const char *p = list; *p;) {
        size_t w = strcspn(p, ",");
        char name[64];
        size_t a = 0, b = w;   // trim blanks
        while (a < b && (p[a] == ' ' || p[a] == '\t')) a++;
        while (b > a && (p[b - 1] == ' ' || p[b - 1] == '\t')) b--;
        if (b > a) {
            snprintf(name, sizeof name, "%.*s", (int)(b - a), p + a);
            const lb_reward_def *d = lb_reward_lookup(name);
            if (!d) {
                int o = snprintf(err, errlen, "rl.rewards: unknown reward '%s' (registered:", name);
                for (int i = 0; i < lb_reward_count() && o > 0 && (size_t)o < errlen; i++)
                    o += snprintf(err + o, errlen - o, "%s %s", i ? "," : "", registry[i].name);
                if (o > 0 && (size_t)o < errlen) snprintf(err + o, errlen - o, ")");
                return -1;
            }
            if (r->n == LB_REWARD_MAX) {
                snprintf(err, errlen, "rl.rewards: more than %d rewards", LB_REWARD_MAX);
                return -1;
            }
            r->fn[r->n++] = d;
        }
        p += w + (p[w] == ',');
    }
    if (!r->n && !r->cmd.command) {
        snprintf(err, errlen, "rl.rewards is empty and rl.reward_command is not set: nothing "
                              "scores the completions");
        return -1;
    }
    int uses_regex = 0;
    for (int i = 0; i < r->n; i++) uses_regex |= r->fn[i]->fn == answer_regex;
    if (uses_regex && !r->ctx.regex[0]) {
        snprintf(err, errlen, "rl.rewards names answer_regex and rl.reward_regex is empty");
        return -1;
    }
    if (uses_regex) {   // a pattern with {answer} is compiled per completion, checked here once
        pcre2_code *re = regex_compile(r->ctx.regex, "42", err, errlen);
        if (!re) return -1;
        if (strstr(r->ctx.regex, "{answer}")) pcre2_code_free(re);
        else r->ctx.code = re;
    }
    return r->cmd.command ? command_runs(r->cmd.command, err, errlen) : 0;
}

void lb_rewards_free(lb_rewards *r)
{
    pcre2_code_free(r->ctx.code);
    r->ctx.code = NULL;
}

int lb_rewards_check(const lb_rewards *r, const lb_reward_item *probe, char *err, size_t errlen)
{
    double v;
    int late = 0;
    if (!r->cmd.command) return 0;
    if (lb_reward_command_run(&r->cmd, probe, 1, &v, &late, err, errlen) != 0) return -1;
    if (late) {
        snprintf(err, errlen, "rl.reward_command: '%s' gave no answer to a test line within "
                 "rl.reward_timeout (%g s)", r->cmd.command, r->cmd.timeout);
        return -1;
    }
    return 0;
}

int lb_rewards_score(const lb_rewards *r, const lb_reward_item *it, int n, double *out,
                     char *err, size_t errlen)
{
    for (int k = 0; k < n; k++) {
        out[k] = 0.0;
        for (int i = 0; i < r->n; i++) out[k] += r->fn[i]->fn(&r->ctx, &it[k]);
    }
    if (!r->cmd.command || n == 0) return 0;
    double *v = lb_malloc((size_t)n * sizeof *v);
    int rc = lb_reward_command_run(&r->cmd, it, n, v, NULL, err, errlen);
    for (int k = 0; k < n && rc == 0; k++) out[k] += v[k];
    free(v);
    return rc;
}
