// reward.c: the reward registry and the external reward command (see reward.h).
#include "src/rl/reward.h"

#include <errno.h>
#include <math.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include "src/cli/util.h"
#include "src/io/data.h"

extern char **environ;

// --- the arithmetic task ------------------------------------------------------------------------

// 1 when the completion parses as an integer (up to a newline or its end) equal to the answer.
static double arith_exact(const lb_reward_ctx *ctx, const char *prompt, const char *completion,
                          size_t len)
{
    long want, got;
    if (lb_arith_answer(prompt, &want) != 0) return 0.0;
    if (lb_arith_parse_completion(completion, len, &got) != 0) return 0.0;
    return got == want ? 1.0 : 0.0;
}

// format_reward for a well-formed answer: an optional '-', digits, then the newline that ends
// the completion (so a completion cut by the length limit earns nothing).
static double arith_format(const lb_reward_ctx *ctx, const char *prompt, const char *completion,
                           size_t len)
{
    long v;
    if (len < 2 || completion[len - 1] != '\n') return 0.0;
    if (lb_arith_parse_completion(completion, len, &v) != 0) return 0.0;
    return ctx->format_reward;
}

// Partial credit: the share of the answer's characters (digits, and the sign) the completion
// has right at the same place value, over the longer of the two; 0 when the completion is not
// an integer. A model that rarely gets a whole answer right still gets a graded signal.
static double arith_digits(const lb_reward_ctx *ctx, const char *prompt, const char *completion,
                           size_t len)
{
    long want, got;
    if (lb_arith_answer(prompt, &want) != 0) return 0.0;
    if (lb_arith_parse_completion(completion, len, &got) != 0) return 0.0;
    char a[32], b[32];
    int la = snprintf(a, sizeof a, "%ld", want), lg = snprintf(b, sizeof b, "%ld", got);
    int n = la > lg ? la : lg, same = 0;
    for (int i = 1; i <= la && i <= lg; i++) same += a[la - i] == b[lg - i];   // from the units
    return (double)same / n;
}

static const lb_reward_def registry[] = {
    {"arith_exact", arith_exact, "1 if the answer to \"a+b=\" / \"a-b=\" is right, else 0"},
    {"arith_format", arith_format, "rl.format_reward for an integer followed by a newline"},
    {"arith_digits", arith_digits, "share of the answer's digits right at their place value"},
};

int lb_reward_count(void) { return (int)(sizeof registry / sizeof registry[0]); }

const lb_reward_def *lb_reward_lookup(const char *name)
{
    for (int i = 0; i < lb_reward_count(); i++)
        if (!strcmp(registry[i].name, name)) return &registry[i];
    return NULL;
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

int lb_rewards_init(lb_rewards *r, const char *list, double format_reward, const char *command,
                    char *err, size_t errlen)
{
    memset(r, 0, sizeof *r);
    r->ctx.format_reward = format_reward;
    r->command = command && command[0] ? command : NULL;
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
    if (!r->n && !r->command) {
        snprintf(err, errlen, "rl.rewards is empty and rl.reward_command is not set: nothing "
                              "scores the completions");
        return -1;
    }
    return r->command ? command_runs(r->command, err, errlen) : 0;
}

// JSON string of len bytes: quotes, backslashes and control bytes escaped; other bytes as they
// are (UTF-8 text stays valid).
static void json_string(FILE *f, const char *s, size_t len)
{
    fputc('"', f);
    for (size_t i = 0; i < len; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (ch == '"' || ch == '\\') fprintf(f, "\\%c", ch);
        else if (ch == '\n') fputs("\\n", f);
        else if (ch == '\t') fputs("\\t", f);
        else if (ch < 0x20) fprintf(f, "\\u%04x", ch);
        else fputc(ch, f);
    }
    fputc('"', f);
}

// Up to 48 bytes of s for a message, control bytes shown as '?'.
static void excerpt(char *out, size_t outlen, const char *s, size_t len)
{
    size_t n = len < 48 ? len : 48, o = 0;
    for (size_t i = 0; i < n && o + 1 < outlen; i++)
        out[o++] = (unsigned char)s[i] < 0x20 ? '?' : s[i];
    if (len > n && o + 4 < outlen) out[o++] = '.', out[o++] = '.', out[o++] = '.';
    out[o] = 0;
    lb_escape_bytes(out, outlen);   // bytes that are not UTF-8 as \xNN, never raw
}

int lb_reward_command(const char *command, const char *prompt, const char *completion,
                      size_t len, double *out, char *err, size_t errlen)
{
    // stdin from an unlinked temporary file, so a command that never reads cannot block us
    FILE *in = tmpfile();
    if (!in) {
        snprintf(err, errlen, "rl.reward_command: cannot make a temporary file: %s",
                 strerror(errno));
        return -1;
    }
    fputs("{\"prompt\": ", in);
    json_string(in, prompt, strlen(prompt));
    fputs(", \"completion\": ", in);
    json_string(in, completion, len);
    fputs("}\n", in);
    fflush(in);
    rewind(in);
    int pipefd[2];
    if (pipe(pipefd) != 0) {
        snprintf(err, errlen, "rl.reward_command: pipe: %s", strerror(errno));
        fclose(in);
        return -1;
    }
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fileno(in), STDIN_FILENO);
    posix_spawn_file_actions_adddup2(&fa, pipefd[1], STDOUT_FILENO);
    posix_spawn_file_actions_addclose(&fa, pipefd[0]);
    posix_spawn_file_actions_addclose(&fa, pipefd[1]);
    char *argv[] = {"sh", "-c", (char *)command, NULL};
    pid_t pid;
    int rc = posix_spawn(&pid, "/bin/sh", &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    close(pipefd[1]);
    fclose(in);
    if (rc != 0) {
        snprintf(err, errlen, "rl.reward_command: cannot run '%s': %s", command, strerror(rc));
        close(pipefd[0]);
        return -1;
    }
    char buf[256];
    size_t got = 0;
    int truncated = 0;
    for (;;) {
        char tmp[512];
        ssize_t k = read(pipefd[0], tmp, sizeof tmp);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) break;
        size_t take = (size_t)k < sizeof buf - 1 - got ? (size_t)k : sizeof buf - 1 - got;
        memcpy(buf + got, tmp, take);
        got += take;
        truncated |= take < (size_t)k;
    }
    close(pipefd[0]);
    buf[got] = 0;
    int status;
    while (waitpid(pid, &status, 0) < 0)
        if (errno != EINTR) {
            snprintf(err, errlen, "rl.reward_command: waitpid: %s", strerror(errno));
            return -1;
        }
    char what[256];
    excerpt(what, sizeof what, completion, len);
    if (WIFSIGNALED(status)) {
        snprintf(err, errlen, "rl.reward_command: '%s' was killed by signal %d (completion "
                 "'%s')", command, WTERMSIG(status), what);
        return -1;
    }
    if (WEXITSTATUS(status) != 0) {
        snprintf(err, errlen, "rl.reward_command: '%s' exited with status %d (completion '%s')",
                 command, WEXITSTATUS(status), what);
        return -1;
    }
    char *end;
    errno = 0;
    double v = strtod(buf, &end);
    while (*end == ' ' || *end == '\t' || *end == '\n' || *end == '\r') end++;
    if (truncated || end == buf || *end || errno == ERANGE || !isfinite(v)) {
        char shown[256];
        excerpt(shown, sizeof shown, buf, got);
        snprintf(err, errlen, "rl.reward_command: '%s' printed '%s', not one number "
                 "(completion '%s')", command, shown, what);
        return -1;
    }
    *out = v;
    return 0;
}

int lb_rewards_score(const lb_rewards *r, const char *prompt, const char *completion, size_t len,
                     double *out, char *err, size_t errlen)
{
    double sum = 0.0;
    for (int i = 0; i < r->n; i++) sum += r->fn[i]->fn(&r->ctx, prompt, completion, len);
    if (r->command) {
        double v;
        if (lb_reward_command(r->command, prompt, completion, len, &v, err, errlen) != 0)
            return -1;
        sum += v;
    }
    *out = sum;
    return 0;
}
