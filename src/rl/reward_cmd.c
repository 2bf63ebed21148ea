// reward_cmd.c: the external reward command (reward.h). The completions are cut into batches
// of rl.reward_batch; each batch is one run of the command under /bin/sh -c, its JSON lines
// written to a pipe on its stdin and its numbers read from a pipe on its stdout, up to
// rl.reward_workers runs at once (one poll loop, no threads). A run past rl.reward_timeout is
// killed with its process group (sh's children too) and its completions get
// rl.reward_timeout_value.
#include "src/rl/reward.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include "kernels/common.h"
#include "src/io/files.h"

extern char **environ;

// A growable byte buffer.
typedef struct {
    char *p;
    size_t n, cap;
} buf;

static void put(buf *b, const char *s, size_t n)
{
    if (b->n + n + 1 > b->cap) {
        b->cap = (b->n + n + 1) * 2;
        b->p = realloc(b->p, b->cap);
        if (!b->p) lb_die("out of memory");
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

// JSON string of len bytes: quotes, backslashes and control bytes escaped; other bytes as they
// are (UTF-8 text stays valid).
static void json_string(buf *b, const char *s, size_t len)
{
    put(b, "\"", 1);
    for (size_t i = 0; i < len; i++) {
        unsigned char ch = (unsigned char)s[i];
        char e[8];
        if (ch == '"' || ch == '\\') snprintf(e, sizeof e, "\\%c", ch);
        else if (ch == '\n') snprintf(e, sizeof e, "\\n");
        else if (ch == '\t') snprintf(e, sizeof e, "\\t");
        else if (ch < 0x20) snprintf(e, sizeof e, "\\u%04x", ch);
        else e[0] = (char)ch, e[1] = 0;
        put(b, e, strlen(e));
    }
    put(b, "\"", 1);
}

static void item_json(buf *b, const lb_reward_item *it)
{
    put(b, "{\"prompt\": ", 11);
    json_string(b, it->prompt, strlen(it->prompt));
    put(b, ", \"completion\": ", 16);
    json_string(b, it->completion, it->len);
    put(b, ", \"answer\": ", 12);
    json_string(b, it->answer, strlen(it->answer));
    put(b, "}", 1);
}

char *lb_reward_item_json(const lb_reward_item *it)
{
    buf b = {0};
    item_json(&b, it);
    return b.p;
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

// "(prompt 'P', completion 'C')" of an item, for messages.
static void which(char *out, size_t outlen, const lb_reward_item *it)
{
    char p[256], c[256];
    excerpt(p, sizeof p, it->prompt, strlen(it->prompt));
    excerpt(c, sizeof c, it->completion, it->len);
    snprintf(out, outlen, "(prompt '%s', completion '%s')", p, c);
}

// One run of the command: items [first, first + count).
typedef struct {
    pid_t pid;
    int in, out;                   // our ends: its stdin, its stdout (-1 once closed)
    buf input, output;
    size_t sent;
    int first, count;
    double deadline;               // lb_now() seconds; 0: none
    int exited, status;
} job;

static int job_start(const lb_reward_cmd *c, const lb_reward_item *it, int first, int count,
                     job *j, char *err, size_t errlen)
{
    memset(j, 0, sizeof *j);
    j->first = first, j->count = count, j->in = j->out = -1;
    for (int k = first; k < first + count; k++) {
        item_json(&j->input, &it[k]);
        put(&j->input, "\n", 1);
    }
    int to[2], from[2];
    if (pipe2(to, O_CLOEXEC) != 0 || pipe2(from, O_CLOEXEC) != 0) {
        snprintf(err, errlen, "rl.reward_command: pipe: %s", strerror(errno));
        return -1;
    }
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, to[0], STDIN_FILENO);
    posix_spawn_file_actions_adddup2(&fa, from[1], STDOUT_FILENO);
    // its own process group (killed whole on a timeout), SIGPIPE back to the default that we
    // ignore while writing
    posix_spawnattr_t at;
    posix_spawnattr_init(&at);
    sigset_t def;
    sigemptyset(&def);
    sigaddset(&def, SIGPIPE);
    posix_spawnattr_setsigdefault(&at, &def);
    posix_spawnattr_setpgroup(&at, 0);
    posix_spawnattr_setflags(&at, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGDEF);
    char *argv[] = {"sh", "-c", (char *)c->command, NULL};
    int rc = posix_spawn(&j->pid, "/bin/sh", &fa, &at, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&at);
    close(to[0]);
    close(from[1]);
    if (rc != 0) {
        snprintf(err, errlen, "rl.reward_command: cannot run '%s': %s", c->command,
                 strerror(rc));
        close(to[1]);
        close(from[0]);
        return -1;
    }
    j->in = to[1], j->out = from[0];
    fcntl(j->in, F_SETFL, fcntl(j->in, F_GETFL) | O_NONBLOCK);
    j->deadline = c->timeout > 0 ? lb_now() + c->timeout : 0;
    return 0;
}

static void job_close(job *j)
{
    if (j->in >= 0) close(j->in);
    if (j->out >= 0) close(j->out);
    j->in = j->out = -1;
}

// Kills a running job's process group and reaps it.
static void job_kill(job *j)
{
    job_close(j);
    if (!j->exited) {
        kill(-j->pid, SIGKILL);
        while (waitpid(j->pid, &j->status, 0) < 0 && errno == EINTR) {
        }
        j->exited = 1;
    }
}

static void job_free(job *j)
{
    free(j->input.p);
    free(j->output.p);
}

// The job's output: exactly count lines, each one finite number (blanks around it allowed).
static int job_parse(const lb_reward_cmd *c, const lb_reward_item *it, job *j, double *out,
                     char *err, size_t errlen)
{
    char w[600], shown[256];
    const char *p = j->output.p ? j->output.p : "";
    const char *end = p + j->output.n;
    int k = 0;
    for (; p < end && k < j->count; k++) {
        const char *e = memchr(p, '\n', (size_t)(end - p));
        size_t n = e ? (size_t)(e - p) : (size_t)(end - p);
        char line[256];
        int bad = n >= sizeof line;
        snprintf(line, sizeof line, "%.*s", (int)(n < sizeof line ? n : sizeof line - 1), p);
        char *stop;
        errno = 0;
        double v = strtod(line, &stop);
        while (*stop == ' ' || *stop == '\t' || *stop == '\r') stop++;
        if (bad || stop == line || *stop || errno == ERANGE || !isfinite(v)) {
            excerpt(shown, sizeof shown, p, n);
            which(w, sizeof w, &it[j->first + k]);
            snprintf(err, errlen, "rl.reward_command: '%s' printed '%s' on line %d of a batch "
                     "of %d, not one number %s", c->command, shown, k + 1, j->count, w);
            return -1;
        }
        out[j->first + k] = v;
        p = e ? e + 1 : end;
    }
    if (k < j->count || p < end) {
        excerpt(shown, sizeof shown, p, (size_t)(end - p));
        which(w, sizeof w, &it[j->first + (k < j->count ? k : 0)]);
        snprintf(err, errlen, k < j->count
                 ? "rl.reward_command: '%s' printed %d line(s) for a batch of %d: one number a "
                   "line per completion %s%s"
                 : "rl.reward_command: '%s' printed more than %d line(s) for a batch of %d "
                   "('%s' after them) %s", c->command, k, j->count,
                 k < j->count ? w : shown, k < j->count ? "" : w);
        return -1;
    }
    return 0;
}

// The finished job's verdict: 0 with its rewards in out, or -1 with a message naming its
// (first) prompt.
static int job_finish(const lb_reward_cmd *c, const lb_reward_item *it, job *j, double *out,
                      char *err, size_t errlen)
{
    char w[600];
    which(w, sizeof w, &it[j->first]);
    if (WIFSIGNALED(j->status)) {
        snprintf(err, errlen, "rl.reward_command: '%s' was killed by signal %d on a batch of %d "
                 "%s", c->command, WTERMSIG(j->status), j->count, w);
        return -1;
    }
    if (WEXITSTATUS(j->status) != 0) {
        snprintf(err, errlen, "rl.reward_command: '%s' exited with status %d on a batch of %d "
                 "%s", c->command, WEXITSTATUS(j->status), j->count, w);
        return -1;
    }
    return job_parse(c, it, j, out, err, errlen);
}

// Moves what can move without blocking: input to the job, its output to us; reaps it once its
// stdout is closed. Returns -1 on an I/O error (message in err).
static int job_pump(const lb_reward_cmd *c, job *j, short in_ev, short out_ev, char *err,
                    size_t errlen)
{
    if (j->in >= 0 && (in_ev & (POLLOUT | POLLERR | POLLHUP))) {
        ssize_t k = write(j->in, j->input.p + j->sent, j->input.n - j->sent);
        if (k > 0) j->sent += (size_t)k;
        if ((k < 0 && errno != EAGAIN && errno != EINTR) || j->sent == j->input.n) {
            close(j->in);   // all sent, or it stopped reading (EPIPE): its exit status tells
            j->in = -1;
        }
    }
    if (j->out >= 0 && (out_ev & (POLLIN | POLLERR | POLLHUP))) {
        char tmp[4096];
        ssize_t k = read(j->out, tmp, sizeof tmp);
        if (k > 0) {
            if (j->output.n + (size_t)k > ((size_t)j->count + 1) * 1024) {
                snprintf(err, errlen, "rl.reward_command: '%s' printed more than 1 KiB a "
                         "completion on a batch of %d", c->command, j->count);
                return -1;
            }
            put(&j->output, tmp, (size_t)k);
        } else if (k == 0 || errno != EINTR) {
            close(j->out);
            j->out = -1;
        }
    }
    if (j->out < 0 && !j->exited) {
        pid_t r = waitpid(j->pid, &j->status, WNOHANG);
        if (r == j->pid) j->exited = 1;
    }
    return 0;
}

int lb_reward_command_run(const lb_reward_cmd *c, const lb_reward_item *it, int n, double *out,
                          int *timed_out, char *err, size_t errlen)
{
    const int B = c->batch > 0 ? c->batch : 1, W = c->workers > 0 ? c->workers : 1;
    job *jobs = lb_calloc((size_t)W, sizeof *jobs);
    int *live = lb_calloc((size_t)W, sizeof *live);
    struct pollfd *pf = lb_calloc((size_t)W * 2, sizeof *pf);
    struct sigaction ign = {.sa_handler = SIG_IGN}, old;
    sigemptyset(&ign.sa_mask);
    sigaction(SIGPIPE, &ign, &old);   // a command that exits unread: EPIPE, not our death
    int next = 0, running = 0, rc = 0, late = 0;
    while (rc == 0 && (next < n || running)) {
        for (int w = 0; w < W && next < n && rc == 0; w++) {
            if (live[w]) continue;
            int cnt = n - next < B ? n - next : B;
            rc = job_start(c, it, next, cnt, &jobs[w], err, errlen);
            if (rc == 0) live[w] = 1, running++, next += cnt;
        }
        if (rc != 0) break;
        // wait for I/O, or a deadline, or (a job whose stdout closed) its exit
        double now = lb_now(), wait = 1.0;
        int np = 0;
        for (int w = 0; w < W; w++) {
            if (!live[w]) continue;
            job *j = &jobs[w];
            pf[2 * w] = (struct pollfd){j->in, POLLOUT, 0};
            pf[2 * w + 1] = (struct pollfd){j->out, POLLIN, 0};
            np += (j->in >= 0) + (j->out >= 0);
            if (j->out < 0) wait = fmin(wait, 0.005);
            if (j->deadline > 0) wait = fmin(wait, fmax(j->deadline - now, 0.0));
        }
        for (int f = 0; f < 2 * W; f++)   // poll ignores fd -1: a closed pipe, a free worker
            if (!live[f / 2]) pf[f] = (struct pollfd){-1, 0, 0};
        if (np) {
            if (poll(pf, (nfds_t)(2 * W), (int)ceil(wait * 1000)) <= 0)
                for (int f = 0; f < 2 * W; f++) pf[f].revents = 0;
        } else {
            usleep((useconds_t)(wait * 1e6));
            for (int f = 0; f < 2 * W; f++) pf[f].revents = 0;
        }
        for (int w = 0; w < W && rc == 0; w++) {
            if (!live[w]) continue;
            job *j = &jobs[w];
            rc = job_pump(c, j, pf[2 * w].revents, pf[2 * w + 1].revents, err, errlen);
            if (rc != 0) break;
            if (!j->exited && j->deadline > 0 && lb_now() >= j->deadline) {
                job_kill(j);
                char wh[600];
                which(wh, sizeof wh, &it[j->first]);
                fprintf(stderr, "warning: rl.reward_command: '%s' ran past rl.reward_timeout "
                        "(%g s) on a batch of %d %s: killed; reward %g for each of them\n",
                        c->command, c->timeout, j->count, wh, c->timeout_value);
                for (int k = j->first; k < j->first + j->count; k++) out[k] = c->timeout_value;
                late += j->count;
            } else if (j->exited && j->out < 0) {
                job_close(j);
                rc = job_finish(c, it, j, out, err, errlen);
            } else {
                continue;
            }
            job_free(j);
            live[w] = 0, running--;
        }
    }
    for (int w = 0; w < W; w++)   // after a failure: the others stop
        if (live[w]) job_kill(&jobs[w]), job_free(&jobs[w]);
    sigaction(SIGPIPE, &old, NULL);
    free(jobs);
    free(live);
    free(pf);
    if (timed_out) *timed_out = late;
    return rc;
}
