// test_data.c: token shards, the batch loader, and the arithmetic and text generators.
#include "src/io/data.h"

#include "kernels/common.h"
#include "src/io/metrics.h"
#include "src/train/mlperf.h"
#include "src/io/files.h"
#include "tests/testutil.h"

#include <dirent.h>
#include <ftw.h>
#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>

static char err[2048];

// ---- helpers ------------------------------------------------------------------------------

// Scratch directories, removed after the run (with their contents) so /tmp does not fill up.
static char scratch_dirs[64][256];
static int nscratch;

static const char *scratch(void)
{
    const char *d = lb_test_tmpdir();
    ck_assert_int_lt(nscratch, 64);
    snprintf(scratch_dirs[nscratch], sizeof scratch_dirs[0], "%s", d);
    return scratch_dirs[nscratch++];
}

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    return remove(path);
}

static void scratch_cleanup(void)
{
    for (int i = 0; i < nscratch; i++) nftw(scratch_dirs[i], rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

static const char *path_in(const char *dir, const char *name)
{
    static char buf[8][1024];
    static int next;
    char *out = buf[next++ % 8];
    snprintf(out, sizeof buf[0], "%s/%s", dir, name);
    return out;
}

static void write_bytes(const char *path, const void *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    ck_assert_uint_eq(fwrite(data, 1, n, f), n);
    ck_assert_int_eq(fclose(f), 0);
}

static uint8_t *slurp(const char *path, size_t *n)
{
    char e[512];
    uint8_t *p = (uint8_t *)lb_read_file(path, n, e, sizeof e);
    ck_assert_msg(p != NULL, "%s", e);
    return p;
}

static long file_size(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 ? (long)st.st_size : -1;
}

static int dir_entries(const char *dir)
{
    DIR *d = opendir(dir);
    ck_assert_ptr_nonnull(d);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
    closedir(d);
    return n;
}

static void assert_err_has(const char *needle)
{
    ck_assert_msg(strstr(err, needle) != NULL, "error \"%s\" lacks \"%s\"", err, needle);
}

// Writes a shard whose token k is base + k.
static void write_ramp(const char *path, uint32_t base, size_t n)
{
    uint32_t *tok = malloc(sizeof(uint32_t) * n);
    for (size_t k = 0; k < n; k++) tok[k] = base + (uint32_t)k;
    ck_assert_msg(lb_shard_write(path, tok, n, err, sizeof err) == 0, "%s", err);
    free(tok);
}

// ---- shards -------------------------------------------------------------------------------

START_TEST(shard_v1_round_trip)
{
    const char *dir = scratch(), *p = path_in(dir, "a.bin");
    uint32_t tok[] = {0, 1, 255, 256, 40000, 65535, 7};
    size_t n = sizeof tok / sizeof tok[0];
    ck_assert_msg(lb_shard_write(p, tok, n, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(file_size(p), 1024 + 2 * (long)n);   // uint16: llm.c's version 1
    size_t len;
    uint8_t *raw = slurp(p, &len);
    int32_t hdr[3];
    memcpy(hdr, raw, sizeof hdr);   // the test host is little-endian (x86, arm64)
    ck_assert_int_eq(hdr[0], 20240520);
    ck_assert_int_eq(hdr[1], 1);
    ck_assert_int_eq(hdr[2], (int32_t)n);
    for (int i = 3; i < 256; i++) ck_assert_int_eq(raw[4 * i] | raw[4 * i + 3], 0);
    ck_assert_int_eq(raw[1024 + 2 * 4], 0x40);   // 40000 = 0x9C40, little-endian
    ck_assert_int_eq(raw[1024 + 2 * 4 + 1], 0x9C);
    free(raw);

    uint32_t *back;
    size_t m;
    ck_assert_msg(lb_shard_read(p, &back, &m, err, sizeof err) == 0, "%s", err);
    ck_assert_uint_eq(m, n);
    for (size_t i = 0; i < n; i++) ck_assert_uint_eq(back[i], tok[i]);
    free(back);
    ck_assert_int_eq(dir_entries(dir), 1);   // no temporary left next to it
}
END_TEST

START_TEST(shard_v2_round_trip)
{
    const char *dir = scratch(), *p = path_in(dir, "b.bin");
    uint32_t tok[] = {5, 65535, 65536, 151935, 0xFFFFFFFFu, 0};
    size_t n = sizeof tok / sizeof tok[0];
    ck_assert_msg(lb_shard_write(p, tok, n, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(file_size(p), 1024 + 4 * (long)n);   // one token >= 65536: uint32
    size_t len;
    uint8_t *raw = slurp(p, &len);
    int32_t hdr[3];
    memcpy(hdr, raw, sizeof hdr);
    ck_assert_int_eq(hdr[1], 2);
    ck_assert_int_eq(hdr[2], (int32_t)n);
    free(raw);
    uint32_t *back;
    size_t m;
    ck_assert_msg(lb_shard_read(p, &back, &m, err, sizeof err) == 0, "%s", err);
    ck_assert_uint_eq(m, n);
    for (size_t i = 0; i < n; i++) ck_assert_uint_eq(back[i], tok[i]);
    free(back);

    // An empty shard is a valid file (header only).
    const char *e = path_in(dir, "empty.bin");
    ck_assert_msg(lb_shard_write(e, tok, 0, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(file_size(e), 1024);
    ck_assert_msg(lb_shard_read(e, &back, &m, err, sizeof err) == 0, "%s", err);
    ck_assert_uint_eq(m, 0);
    free(back);
}
END_TEST

// Builds a corrupt copy of a good 10-token v1 shard and checks the read error.
static void check_corrupt(const char *dir, const char *name, int what, const char *needle)
{
    const char *good = path_in(dir, "good.bin");
    write_ramp(good, 0, 10);
    size_t n;
    uint8_t *raw = slurp(good, &n);   // 1044 bytes
    uint8_t *buf = calloc(n + 8, 1);
    memcpy(buf, raw, n);
    size_t m = n;
    int32_t v;
    switch (what) {
    case 0: m = n - 1; break;                                        // truncated
    case 1: m = n + 2; break;                                        // trailing bytes
    case 2: v = 20240521; memcpy(buf, &v, 4); break;                 // bad magic
    case 3: v = 3; memcpy(buf + 4, &v, 4); break;                    // unknown version
    case 4: m = 100; break;                                          // shorter than header
    case 5: v = 2; memcpy(buf + 4, &v, 4); break;                    // v2 header, v1 body
    }
    const char *bad = path_in(dir, name);
    write_bytes(bad, buf, m);
    uint32_t *tok = (uint32_t *)1;
    size_t cnt = 99;
    ck_assert_int_eq(lb_shard_read(bad, &tok, &cnt, err, sizeof err), -1);
    ck_assert_ptr_null(tok);
    // "PATH: what is wrong (...)": the message starts with the file's name.
    ck_assert_msg(strncmp(err, bad, strlen(bad)) == 0 && err[strlen(bad)] == ':',
                  "error \"%s\" does not start with %s:", err, bad);
    assert_err_has(needle);
    free(raw);
    free(buf);
}

START_TEST(shard_corrupt_errors)
{
    const char *dir = scratch();
    check_corrupt(dir, "trunc.bin", 0, "truncated: the header declares 10 tokens "
                                       "(expected 1044 bytes, found 1043)");
    check_corrupt(dir, "trail.bin", 1, "trailing bytes after the header's 10 tokens "
                                       "(expected 1044 bytes, found 1046)");
    check_corrupt(dir, "magic.bin", 2, "bad magic 20240521 (expected 20240520)");
    check_corrupt(dir, "version.bin", 3, "unknown shard version 3 (expected 1 or 2)");
    check_corrupt(dir, "short.bin", 4,
                  "shorter than the shard header (expected at least 1024 bytes, found 100)");
    check_corrupt(dir, "v2body.bin", 5, "(expected 1064 bytes, found 1044)");

    // The loader validates every header at open, naming the bad shard among good ones.
    write_ramp(path_in(dir, "z_000.bin"), 0, 100);
    write_bytes(path_in(dir, "z_001.bin"), "not a shard", 11);
    write_ramp(path_in(dir, "z_002.bin"), 0, 100);
    ck_assert_ptr_null(lb_loader_open(path_in(dir, "z_*.bin"), 2, 4, 256, err, sizeof err));
    assert_err_has(path_in(dir, "z_001.bin"));
    assert_err_has("found 11");

    uint32_t *tok;
    size_t cnt;
    ck_assert_int_eq(lb_shard_read(path_in(dir, "missing.bin"), &tok, &cnt, err, sizeof err),
                     -1);
    assert_err_has("missing.bin: No such file or directory");
}
END_TEST

START_TEST(shard_failed_write_leaves_nothing)
{
    const char *dir = scratch(), *p = path_in(dir, "s.bin");
    write_ramp(p, 7, 10);   // the old version, which a failed write must keep
    size_t oldn;
    uint8_t *old = slurp(p, &oldn);

    // A write that fails mid-file: cap the file size (SIGXFSZ ignored, so write gets EFBIG).
    struct rlimit saved, lim;
    ck_assert_int_eq(getrlimit(RLIMIT_FSIZE, &saved), 0);
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
    lim = saved;
    lim.rlim_cur = 4096;
    ck_assert_int_eq(setrlimit(RLIMIT_FSIZE, &lim), 0);
    size_t n = 100000;
    uint32_t *tok = calloc(n, sizeof(uint32_t));
    int rc = lb_shard_write(p, tok, n, err, sizeof err);
    ck_assert_int_eq(setrlimit(RLIMIT_FSIZE, &saved), 0);
    signal(SIGXFSZ, prev);
    ck_assert_int_eq(rc, -1);
    assert_err_has(p);
    ck_assert_int_eq(dir_entries(dir), 1);   // no temporary, no partial file
    size_t nown;
    uint8_t *now = slurp(p, &nown);
    ck_assert_uint_eq(nown, oldn);
    ck_assert_int_eq(memcmp(now, old, oldn), 0);
    free(now);
    free(old);

    // A write into a missing directory fails cleanly too.
    ck_assert_int_eq(lb_shard_write(path_in(dir, "no/such/x.bin"), tok, 5, err, sizeof err),
                     -1);
    assert_err_has("No such file or directory");
    ck_assert_int_eq(dir_entries(dir), 1);
    free(tok);
}
END_TEST

// ---- loader -------------------------------------------------------------------------------

// Two shards: s_000 holds tokens 0..14, s_001 holds 100..109. With b=2, t=3 (6 tokens a batch,
// 7 read) the batches start at (s_000, 0), (s_000, 6), then 12+7 > 15 moves to (s_001, 0),
// then 6+7 > 10 wraps to (s_000, 0), and so on.
static const char *two_shards(void)
{
    const char *dir = scratch();
    write_ramp(path_in(dir, "s_001.bin"), 100, 10);   // written first: order must come from
    write_ramp(path_in(dir, "s_000.bin"), 0, 15);     // the sorted names
    write_ramp(path_in(dir, "other.bin"), 5000, 50);  // not matched by the glob
    return path_in(dir, "s_*.bin");
}

static void check_window(const int32_t *in, const int32_t *tg, int first)
{
    for (int i = 0; i < 6; i++) {
        ck_assert_int_eq(in[i], first + i);
        ck_assert_int_eq(tg[i], first + i + 1);   // targets are the inputs shifted by one
    }
}

START_TEST(loader_windows_boundary_and_wrap)
{
    lb_loader *l = lb_loader_open(two_shards(), 2, 3, 256, err, sizeof err);
    ck_assert_msg(l != NULL, "%s", err);
    ck_assert_int_eq(lb_loader_nshards(l), 2);
    const int first[] = {0, 6, 100, 0, 6, 100, 0};
    int32_t in[6], tg[6];
    for (int k = 0; k < 7; k++) {
        ck_assert_msg(lb_loader_next(l, in, tg, err, sizeof err) == 0, "%s", err);
        check_window(in, tg, first[k]);
    }
    lb_loader_reset(l);
    ck_assert_int_eq(lb_loader_next(l, in, tg, err, sizeof err), 0);
    check_window(in, tg, 0);
    lb_loader_close(l);

    // One shard: it wraps onto itself.
    const char *dir = scratch();
    write_ramp(path_in(dir, "one.bin"), 0, 13);
    l = lb_loader_open(path_in(dir, "one.bin"), 1, 6, 256, err, sizeof err);
    ck_assert_msg(l != NULL, "%s", err);
    const int first1[] = {0, 6, 0, 6};
    for (int k = 0; k < 4; k++) {
        ck_assert_int_eq(lb_loader_next(l, in, tg, err, sizeof err), 0);
        check_window(in, tg, first1[k]);
    }
    lb_loader_close(l);
}
END_TEST

START_TEST(loader_tell_seek)
{
    const char *pat = two_shards();
    lb_loader *a = lb_loader_open(pat, 2, 3, 256, err, sizeof err);
    lb_loader *b = lb_loader_open(pat, 2, 3, 256, err, sizeof err);
    ck_assert_ptr_nonnull(a);
    ck_assert_ptr_nonnull(b);
    int32_t ia[6], ta[6], ib[6], tb[6];
    // tell() is normalised: after (s_000, 6) comes (s_001, 0), not (s_000, 12).
    const int64_t want_shard[] = {0, 0, 1, 0, 0, 1, 0, 0};
    const int64_t want_pos[] = {0, 6, 0, 0, 6, 0, 0, 6};
    for (int k = 0; k < 8; k++) {
        int64_t s, p;
        lb_loader_tell(a, &s, &p);
        ck_assert_int_eq(s, want_shard[k]);
        ck_assert_int_eq(p, want_pos[k]);
        // A fresh loader seeking to the reported position gives the same next batch.
        ck_assert_msg(lb_loader_seek(b, s, p, err, sizeof err) == 0, "%s", err);
        ck_assert_int_eq(lb_loader_next(a, ia, ta, err, sizeof err), 0);
        ck_assert_int_eq(lb_loader_next(b, ib, tb, err, sizeof err), 0);
        ck_assert_int_eq(memcmp(ia, ib, sizeof ia), 0);
        ck_assert_int_eq(memcmp(ta, tb, sizeof ta), 0);
    }
    // seek(tell()) on a loader mid-stream leaves its sequence unchanged.
    lb_loader_reset(a);
    lb_loader_reset(b);
    for (int k = 0; k < 12; k++) {
        int64_t s, p;
        lb_loader_tell(a, &s, &p);
        ck_assert_int_eq(lb_loader_seek(a, s, p, err, sizeof err), 0);
        ck_assert_int_eq(lb_loader_next(a, ia, ta, err, sizeof err), 0);
        ck_assert_int_eq(lb_loader_next(b, ib, tb, err, sizeof err), 0);
        ck_assert_int_eq(memcmp(ia, ib, sizeof ia), 0);
        ck_assert_int_eq(memcmp(ta, tb, sizeof ta), 0);
    }
    // A position too near the end of a shard moves on as next() would.
    ck_assert_int_eq(lb_loader_seek(a, 0, 12, err, sizeof err), 0);
    ck_assert_int_eq(lb_loader_next(a, ia, ta, err, sizeof err), 0);
    check_window(ia, ta, 100);
    ck_assert_int_eq(lb_loader_seek(a, 1, 3, err, sizeof err), 0);
    ck_assert_int_eq(lb_loader_next(a, ia, ta, err, sizeof err), 0);
    check_window(ia, ta, 103);

    // Invalid positions are refused and change nothing.
    ck_assert_int_eq(lb_loader_seek(a, 2, 0, err, sizeof err), -1);
    assert_err_has("shard index 2 out of range (2 shards)");
    ck_assert_int_eq(lb_loader_seek(a, -1, 0, err, sizeof err), -1);
    ck_assert_int_eq(lb_loader_seek(a, 1, 11, err, sizeof err), -1);
    assert_err_has("s_001.bin: position 11 is outside the shard (10 tokens)");
    ck_assert_int_eq(lb_loader_seek(a, 0, -1, err, sizeof err), -1);
    int64_t s, p;
    lb_loader_tell(a, &s, &p);
    ck_assert_int_eq(s, 0);   // after (1, 3) + 6 = (1, 9): normalised to the wrap
    ck_assert_int_eq(p, 0);
    lb_loader_close(a);
    lb_loader_close(b);
}
END_TEST

START_TEST(loader_errors)
{
    const char *dir = scratch();
    char pat[1100];
    snprintf(pat, sizeof pat, "%s/nothing_*.bin", dir);
    ck_assert_ptr_null(lb_loader_open(pat, 1, 4, 256, err, sizeof err));
    char want[1200];
    snprintf(want, sizeof want, "%s: no token shards match", pat);
    ck_assert_str_eq(err, want);

    // Out-of-vocabulary token in the second shard: found when that shard loads.
    uint32_t good[20], bad[20];
    for (int i = 0; i < 20; i++) good[i] = bad[i] = (uint32_t)i;
    bad[7] = 300;
    const char *g = path_in(dir, "v_000.bin"), *b = path_in(dir, "v_001.bin");
    ck_assert_int_eq(lb_shard_write(g, good, 20, err, sizeof err), 0);
    ck_assert_int_eq(lb_shard_write(b, bad, 20, err, sizeof err), 0);
    lb_loader *l = lb_loader_open(path_in(dir, "v_*.bin"), 1, 10, 256, err, sizeof err);
    ck_assert_msg(l != NULL, "%s", err);
    int32_t in[10], tg[10];
    ck_assert_int_eq(lb_loader_next(l, in, tg, err, sizeof err), 0);
    ck_assert_int_eq(lb_loader_next(l, in, tg, err, sizeof err), -1);
    snprintf(want, sizeof want,
             "%s: token 300 at offset 7 is outside the vocabulary (vocab_size 256)", b);
    ck_assert_str_eq(err, want);
    int64_t s, p;   // the failed call did not move the loader
    lb_loader_tell(l, &s, &p);
    ck_assert_int_eq(s, 1);
    ck_assert_int_eq(p, 0);
    // the same found before any batch, shard by shard (lb_run_check_shards)
    ck_assert_int_eq(lb_loader_check_shard(l, 0, err, sizeof err), 0);
    err[0] = 0;
    ck_assert_int_eq(lb_loader_check_shard(l, 1, err, sizeof err), -1);
    ck_assert_str_eq(err, want);
    ck_assert_int_eq(lb_loader_tokens(l), 40);
    lb_loader_close(l);
    // vocab_size 300 still excludes token 300 (the bound is strict)...
    l = lb_loader_open(path_in(dir, "v_*.bin"), 1, 10, 300, err, sizeof err);
    ck_assert_int_eq(lb_loader_seek(l, 1, 0, err, sizeof err), 0);
    ck_assert_int_eq(lb_loader_next(l, in, tg, err, sizeof err), -1);
    assert_err_has("token 300 at offset 7 is outside the vocabulary (vocab_size 300)");
    lb_loader_close(l);
    // ...and with a vocabulary that holds 300 the same shards load.
    l = lb_loader_open(path_in(dir, "v_*.bin"), 1, 10, 301, err, sizeof err);
    ck_assert_int_eq(lb_loader_next(l, in, tg, err, sizeof err), 0);
    ck_assert_msg(lb_loader_next(l, in, tg, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(tg[6], 300);   // offset 7 is target 6 of the window at 0
    lb_loader_close(l);

    // A shard shorter than b*t+1 tokens is refused at open, by name.
    ck_assert_ptr_null(lb_loader_open(path_in(dir, "v_*.bin"), 4, 5, 301, err, sizeof err));
    assert_err_has(g);
    assert_err_has("20 tokens, too few for one batch (b*t+1 = 21 tokens");
    l = lb_loader_open(path_in(dir, "v_*.bin"), 1, 19, 301, err, sizeof err);   // exactly fits
    ck_assert_msg(l != NULL, "%s", err);
    lb_loader_close(l);
}
END_TEST

// ---- arithmetic corpus --------------------------------------------------------------------

// Parses "a?b=c\n" strictly; returns 0 when well-formed.
static int parse_problem(const char *s, long *a, char *op, long *b, long *c)
{
    int used = 0;
    if (sscanf(s, "%ld%c%ld=%ld\n%n", a, op, b, c, &used) != 4) return -1;
    return s[strlen(s) - 1] == '\n' && (*op == '+' || *op == '-') ? 0 : -1;
}

START_TEST(arith_problems)
{
    char buf[64], again[64];
    int plus = 0, minus = 0, hit_max = 0, hit_zero = 0;
    const int max = 50, n = 4000;
    for (int i = 0; i < n; i++) {
        int len = lb_arith_problem(1234, (uint64_t)i, max, buf);
        ck_assert_int_eq(len, (int)strlen(buf));
        ck_assert_int_eq(lb_arith_problem(1234, (uint64_t)i, max, again), len);
        ck_assert_str_eq(buf, again);   // deterministic in (seed, i)
        long a, b, c;
        char op;
        ck_assert_msg(parse_problem(buf, &a, &op, &b, &c) == 0, "bad problem %s", buf);
        ck_assert(a >= 0 && a <= max && b >= 0 && b <= max);
        if (op == '+') {
            plus++;
            ck_assert_int_eq(c, a + b);
        } else {
            minus++;
            ck_assert_int_le(b, a);
            ck_assert_int_eq(c, a - b);
        }
        hit_max += a == max || b == max;
        hit_zero += a == 0 || b == 0;
        // The RL reward's view of the same problem.
        long want;
        ck_assert_int_eq(lb_arith_answer(buf, &want), 0);   // the whole line works
        ck_assert_int_eq(want, c);
        *strchr(buf, '=') = 0;
        ck_assert_int_eq(lb_arith_answer(buf, &want), -1);  // no '=': not a prompt
    }
    ck_assert_int_gt(plus, n * 4 / 10);
    ck_assert_int_gt(minus, n * 4 / 10);
    ck_assert_int_gt(hit_max, 0);   // both ends of [0, max] occur
    ck_assert_int_gt(hit_zero, 0);
    int differ = 0;
    for (int i = 0; i < 20; i++) {
        lb_arith_problem(1234, (uint64_t)i, max, buf);
        lb_arith_problem(1235, (uint64_t)i, max, again);
        differ += strcmp(buf, again) != 0;
    }
    ck_assert_int_gt(differ, 10);   // the seed matters

    lb_arith_problem(7, 3, 0, buf);
    ck_assert(strcmp(buf, "0+0=0\n") == 0 || strcmp(buf, "0-0=0\n") == 0);
    int len = lb_arith_problem(7, 3, 2147483647, buf);
    ck_assert_int_lt(len, 64);
    long a, b, c;
    char op;
    ck_assert_int_eq(parse_problem(buf, &a, &op, &b, &c), 0);
    ck_assert_int_eq(c, op == '+' ? a + b : a - b);
}
END_TEST

START_TEST(arith_answer_and_completion)
{
    long v = 0;
    ck_assert_int_eq(lb_arith_answer("17+25=", &v), 0);
    ck_assert_int_eq(v, 42);
    ck_assert_int_eq(lb_arith_answer("17-25=", &v), 0);
    ck_assert_int_eq(v, -8);
    ck_assert_int_eq(lb_arith_answer("0-0=", &v), 0);
    ck_assert_int_eq(v, 0);
    const char *bad[] = {"", "17+25", "+25=", "17+=", "17*25=", " 17+25=", "17 + 25=",
                         "-3+4=", "99999999999999999999+1="};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        ck_assert_msg(lb_arith_answer(bad[i], &v) == -1, "accepted \"%s\"", bad[i]);

    ck_assert_int_eq(lb_arith_parse_completion("42\n", 3, &v), 0);
    ck_assert_int_eq(v, 42);
    ck_assert_int_eq(lb_arith_parse_completion("42\n17+3=20\n", 11, &v), 0);   // stops at \n
    ck_assert_int_eq(v, 42);
    ck_assert_int_eq(lb_arith_parse_completion("-8", 2, &v), 0);   // end of text ends it too
    ck_assert_int_eq(v, -8);
    ck_assert_int_eq(lb_arith_parse_completion("123456", 3, &v), 0);   // only len bytes
    ck_assert_int_eq(v, 123);
    const char *badc[] = {"", "\n", "-", "42x", "4 2", " 42", "+42", "x42", "42 \n",
                          "99999999999999999999"};
    for (size_t i = 0; i < sizeof badc / sizeof badc[0]; i++)
        ck_assert_msg(lb_arith_parse_completion(badc[i], strlen(badc[i]), &v) == -1,
                      "accepted \"%s\"", badc[i]);
}
END_TEST

// Concatenates the shards matching pattern (in name order); each must be <= max_tokens and,
// when ends_at is not 0, end with that byte. *smallest: the shortest shard's length.
static char *read_split(const char *pattern, size_t max_tokens, int ends_at, size_t *total,
                        int *nshards, size_t *smallest)
{
    *smallest = (size_t)-1;
    char **list;
    int n = lb_glob(pattern, &list);
    char *all = malloc(1);
    size_t len = 0;
    for (int i = 0; i < n; i++) {
        uint32_t *tok;
        size_t m;
        ck_assert_msg(lb_shard_read(list[i], &tok, &m, err, sizeof err) == 0, "%s", err);
        ck_assert_uint_gt(m, 0);
        ck_assert_uint_le(m, max_tokens);
        if (m < *smallest) *smallest = m;
        if (ends_at) ck_assert_uint_eq(tok[m - 1], (uint32_t)ends_at);
        all = realloc(all, len + m + 1);
        for (size_t k = 0; k < m; k++) {
            ck_assert_uint_lt(tok[k], 256);
            all[len + k] = (char)tok[k];
        }
        len += m;
        free(tok);
    }
    all[len] = 0;
    lb_glob_free(list, n);
    *total = len;
    *nshards = n;
    return all;
}

START_TEST(arith_corpus_split)
{
    const char *dir = scratch();
    char prefix[1100], pat[1200];
    snprintf(prefix, sizeof prefix, "%s/new/sub/arith", dir);   // directories created
    const int n = 3000, max = 999, shard = 256;
    const double frac = 0.1;
    ck_assert_msg(lb_data_gen_arith(prefix, n, max, frac, shard, 42, err, sizeof err) == 0,
                  "%s", err);
    snprintf(pat, sizeof pat, "%s_train_000.bin", prefix);
    ck_assert_int_gt(file_size(pat), 1024);

    // Expected splits, problem by problem in index order.
    char *want_train = calloc((size_t)n, 64), *want_val = calloc((size_t)n, 64);
    size_t lt = 0, lv = 0;
    int nval = 0;
    char buf[64];
    for (int i = 0; i < n; i++) {
        int len = lb_arith_problem(42, (uint64_t)i, max, buf);
        int v = lb_arith_is_val(42, (uint64_t)i, frac);
        ck_assert_int_eq(v, lb_arith_is_val(42, (uint64_t)i, frac));
        memcpy(v ? want_val + lv : want_train + lt, buf, (size_t)len);
        if (v) {
            lv += (size_t)len;
            nval++;
        } else {
            lt += (size_t)len;
        }
    }
    ck_assert_int_gt(nval, n * 7 / 100);   // roughly the requested fraction
    ck_assert_int_lt(nval, n * 13 / 100);

    // Every problem in exactly one split, in order; shards cut only after a '\n'.
    size_t gt, gv, mt, mv;
    int st, sv;
    snprintf(pat, sizeof pat, "%s_train_*.bin", prefix);
    char *got_train = read_split(pat, (size_t)shard, '\n', &gt, &st, &mt);
    snprintf(pat, sizeof pat, "%s_val_*.bin", prefix);
    char *got_val = read_split(pat, (size_t)shard, '\n', &gv, &sv, &mv);
    // No stub at the end: the last two shards are evened out (a problem is <= 13 bytes).
    ck_assert_uint_ge(mt, (size_t)shard / 2 - 13);
    ck_assert_uint_ge(mv, (size_t)shard / 2 - 13);
    ck_assert_uint_eq(gt, lt);
    ck_assert_uint_eq(gv, lv);
    ck_assert_int_eq(memcmp(got_train, want_train, lt), 0);
    ck_assert_int_eq(memcmp(got_val, want_val, lv), 0);
    ck_assert_int_gt(st, 1);
    ck_assert_int_gt(sv, 1);
    ck_assert_uint_gt(gt, (size_t)st * (shard - 16));   // shards are filled, not one per problem

    // The output trains: the loader reads it with the byte vocabulary.
    snprintf(pat, sizeof pat, "%s_train_*.bin", prefix);
    lb_loader *l = lb_loader_open(pat, 4, 32, LB_BYTE_VOCAB, err, sizeof err);
    ck_assert_msg(l != NULL, "%s", err);
    int32_t in[128], tg[128];
    for (int k = 0; k < 50; k++) ck_assert_int_eq(lb_loader_next(l, in, tg, err, sizeof err), 0);
    lb_loader_close(l);

    // Regenerating over its own output is fine and reproduces it byte for byte.
    ck_assert_msg(lb_data_gen_arith(prefix, n, max, frac, shard, 42, err, sizeof err) == 0,
                  "%s", err);
    char *again = read_split(pat, (size_t)shard, '\n', &gt, &st, &mt);
    ck_assert_uint_eq(gt, lt);
    ck_assert_int_eq(memcmp(again, want_train, lt), 0);
    free(again);

    free(want_train);
    free(want_val);
    free(got_train);
    free(got_val);
}
END_TEST

START_TEST(arith_corpus_errors)
{
    const char *dir = scratch();
    char prefix[1100];
    snprintf(prefix, sizeof prefix, "%s/a", dir);
    ck_assert_int_eq(lb_data_gen_arith(prefix, 100, 99, 0.1, 8, 1, err, sizeof err), -1);
    assert_err_has("shard_tokens 8 is smaller than the longest problem (10 tokens)");
    ck_assert_int_eq(lb_data_gen_arith(prefix, 0, 99, 0.1, 64, 1, err, sizeof err), -1);
    ck_assert_int_eq(lb_data_gen_arith(prefix, 10, -1, 0.1, 64, 1, err, sizeof err), -1);
    ck_assert_int_eq(lb_data_gen_arith(prefix, 10, 9, 1.5, 64, 1, err, sizeof err), -1);
    assert_err_has("val_fraction");
    ck_assert_int_eq(dir_entries(dir), 0);   // refused before writing anything

    // A numbered shard from an earlier, longer run would be mixed in: refused, nothing written.
    write_ramp(path_in(dir, "a_train_007.bin"), 0, 10);
    ck_assert_int_eq(lb_data_gen_arith(prefix, 10, 9, 0.0, 64, 1, err, sizeof err), -1);
    assert_err_has("a_train_007.bin: shard of an earlier corpus");
    ck_assert_int_eq(dir_entries(dir), 1);
    write_ramp(path_in(dir, "a_train_notes.bin"), 0, 10);   // not a numbered shard: ignored
    remove(path_in(dir, "a_train_007.bin"));
    ck_assert_msg(lb_data_gen_arith(prefix, 10, 9, 0.0, 64, 1, err, sizeof err) == 0, "%s",
                  err);
    ck_assert_int_gt(file_size(path_in(dir, "a_train_000.bin")), 1024);
    ck_assert_int_eq(file_size(path_in(dir, "a_val_000.bin")), -1);   // empty split: no file
}
END_TEST

// ---- text corpus --------------------------------------------------------------------------

START_TEST(text_corpus)
{
    const char *dir = scratch();
    const size_t n = 1000;
    uint8_t *data = malloc(n + 1);
    for (size_t i = 0; i <= n; i++) data[i] = (uint8_t)lb_rand_u64(9, 1, i);   // any byte
    data[0] = 0;
    data[1] = 0xFF;
    data[2] = 0xC3;   // a lone UTF-8 lead byte: bytes, not characters
    const char *in = path_in(dir, "input.txt");
    write_bytes(in, data, n);
    char prefix[1100], pat[1200];
    snprintf(prefix, sizeof prefix, "%s/out/text", dir);
    ck_assert_msg(lb_data_gen_text(prefix, in, 0.1, 64, err, sizeof err) == 0, "%s", err);

    size_t gt, gv, mt, mv;
    int st, sv;
    snprintf(pat, sizeof pat, "%s_train_*.bin", prefix);
    char *train = read_split(pat, 64, 0, &gt, &st, &mt);
    snprintf(pat, sizeof pat, "%s_val_*.bin", prefix);
    char *val = read_split(pat, 64, 0, &gv, &sv, &mv);
    ck_assert_uint_eq(gt, 900);   // the first 90% trains, the last 10% validates
    ck_assert_uint_eq(gv, 100);
    ck_assert_int_eq(st, 15);     // ceil(900 / 64)
    ck_assert_int_eq(sv, 2);
    ck_assert_int_eq(memcmp(train, data, 900), 0);
    ck_assert_int_eq(memcmp(val, data + 900, 100), 0);
    // Cut at 64 bytes, except the last two, evened out: 900 = 13 * 64 + 34 + 34, 100 = 50 + 50.
    ck_assert_int_eq(file_size(path_in(dir, "out/text_train_000.bin")), 1024 + 2 * 64);
    ck_assert_int_eq(file_size(path_in(dir, "out/text_train_012.bin")), 1024 + 2 * 64);
    ck_assert_int_eq(file_size(path_in(dir, "out/text_train_013.bin")), 1024 + 2 * 34);
    ck_assert_int_eq(file_size(path_in(dir, "out/text_train_014.bin")), 1024 + 2 * 34);
    ck_assert_int_eq(file_size(path_in(dir, "out/text_val_001.bin")), 1024 + 2 * 50);
    ck_assert_uint_eq(mt, 34);
    ck_assert_uint_eq(mv, 50);
    free(train);
    free(val);

    // 1001 shards: the number widens to 4 digits for all of them, so name order stays right
    // (with 3 digits "1000" would sort before "101").
    const char *wide = path_in(dir, "wide.txt");
    write_bytes(wide, data, n + 1);
    snprintf(prefix, sizeof prefix, "%s/wide/t", dir);
    ck_assert_msg(lb_data_gen_text(prefix, wide, 0.0, 1, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(file_size(path_in(dir, "wide/t_train_1000.bin")), 1026);
    ck_assert_int_eq(file_size(path_in(dir, "wide/t_train_0000.bin")), 1026);
    snprintf(pat, sizeof pat, "%s_train_*.bin", prefix);
    train = read_split(pat, 1, 0, &gt, &st, &mt);
    ck_assert_int_eq(st, 1001);
    ck_assert_uint_eq(gt, n + 1);
    ck_assert_int_eq(memcmp(train, data, n + 1), 0);
    free(train);

    // Errors: empty input, missing input.
    const char *empty = path_in(dir, "empty.txt");
    write_bytes(empty, "", 0);
    ck_assert_int_eq(lb_data_gen_text(prefix, empty, 0.1, 64, err, sizeof err), -1);
    char want[1200];
    snprintf(want, sizeof want, "%s: empty input file", empty);
    ck_assert_str_eq(err, want);
    const char *missing = path_in(dir, "missing.txt");
    ck_assert_int_eq(lb_data_gen_text(prefix, missing, 0.1, 64, err, sizeof err), -1);
    snprintf(want, sizeof want, "%s: No such file or directory", missing);
    ck_assert_str_eq(err, want);
    free(data);
}
END_TEST

// ---- metrics: JSON lines and TensorBoard event files ----------------------------------------

static uint32_t le32(const unsigned char *p) { return p[0] | p[1] << 8 | p[2] << 16 | (uint32_t)p[3] << 24; }

// CRC-32C against its check value; an event file's records framed as TFRecords (lengths and
// masked CRCs checked), the version record first, then one record a metrics line with its tags
// and values (an object's numbers by their keys), a text record last; a reopened run's rows
// after the resumed step dropped. tests/tools/read_tfevents.py
// reads the same files with the tensorboard package.
START_TEST(metrics_tfevents)
{
    ck_assert_uint_eq(lb_crc32c("123456789", 9), 0xE3069283u);   // the CRC-32C check value
    const char *dir = scratch();
    lb_metrics *m = lb_metrics_open(dir, "metrics.jsonl", "train", -1, err, sizeof err);
    ck_assert_msg(m != NULL, "%s", err);
    for (int s = 1; s <= 4; s++)
        lb_metrics_printf(m, "{\"step\": %d, \"loss\": %.9g, \"lr\": 0.001, \"note\": null, "
                          "\"load\": {\"3\": 1.5}}", s, 5.0 - s);
    lb_metrics_text(m, 4, "config", "[train]\nlr = 1\n");
    lb_metrics_close(m);
    DIR *d = opendir(dir);
    char ev[1100] = "";
    for (struct dirent *e; (e = readdir(d));)
        if (!strncmp(e->d_name, "events.out.tfevents.", 20))
            snprintf(ev, sizeof ev, "%s/%s", dir, e->d_name);
    closedir(d);
    ck_assert_msg(ev[0], "no event file in %s", dir);
    size_t n;
    unsigned char *b = (unsigned char *)lb_read_file(ev, &n, err, sizeof err);
    ck_assert_msg(b != NULL, "%s", err);
    int records = 0;
    for (size_t o = 0; o < n; records++) {
        ck_assert(o + 12 <= n);
        uint64_t len = le32(b + o) | (uint64_t)le32(b + o + 4) << 32;
        ck_assert_uint_eq(le32(b + o + 8), lb_crc32c_masked(b + o, 8));
        ck_assert(o + 12 + len + 4 <= n);
        const unsigned char *data = b + o + 12;
        ck_assert_uint_eq(le32(data + len), lb_crc32c_masked(data, len));
        if (records == 0) {
            ck_assert(memmem(data, len, "brain.Event:2", 13) != NULL);
        } else if (records == 5) {   // the text: its tag, the text plugin, the lines indented
            ck_assert(memmem(data, len, "train/config", 12) && memmem(data, len, "\n\x04text", 6));
            ck_assert(memmem(data, len, "    [train]\n    lr = 1\n", 23) != NULL);
            ck_assert(!memmem(data, len, "train/loss", 10));
        } else {
            // step (field 2) records - 0 .. 3 + 1, the tags, loss's float bits (5 - step)
            ck_assert(memmem(data, len, "train/loss", 10) && memmem(data, len, "train/lr", 8));
            ck_assert(memmem(data, len, "train/load/3", 12) != NULL);   // an object's number
            ck_assert(!memmem(data, len, "train/note", 10) && !memmem(data, len, "train/step", 10));
            const unsigned char step_field[2] = {0x10, (unsigned char)records};
            ck_assert(memmem(data, len, step_field, 2) != NULL);
            float v = (float)(5 - records);
            unsigned char bits[5] = {0x15};
            memcpy(bits + 1, &v, 4);
            ck_assert(memmem(data, len, bits, 5) != NULL);
        }
        o += 12 + len + 4;
    }
    ck_assert_int_eq(records, 6);
    free(b);
    // resumed at step 2 in the same directory: steps 3 and 4 will run again
    char path[1100];
    snprintf(path, sizeof path, "%s/metrics.jsonl", dir);
    m = lb_metrics_open(dir, "metrics.jsonl", "train", 2, err, sizeof err);
    ck_assert_msg(m != NULL, "%s", err);
    lb_metrics_printf(m, "{\"step\": 3, \"loss\": 2}");
    lb_metrics_close(m);
    char *text = lb_read_file(path, NULL, err, sizeof err);
    ck_assert_str_eq(text, "{\"step\": 1, \"loss\": 4, \"lr\": 0.001, \"note\": null, "
                           "\"load\": {\"3\": 1.5}}\n"
                           "{\"step\": 2, \"loss\": 3, \"lr\": 0.001, \"note\": null, "
                           "\"load\": {\"3\": 1.5}}\n"
                           "{\"step\": 3, \"loss\": 2}\n");
    free(text);
}
END_TEST

// The MLPerf schedule and target (src/train/mlperf.h): evaluations after step first and every
// `every` steps; a loss target is reached at or below it, an accuracy target only above it;
// the number formats of the log's values.
START_TEST(mlperf_schedule_and_target)
{
    ck_assert_int_eq(lb_mlperf_steps(12288, 32), 384);
    ck_assert_int_eq(lb_mlperf_steps(12288, 1000), 13);   // rounded up to whole steps
    ck_assert_int_eq(lb_mlperf_steps(5, 8), 1);
    lb_mlperf p = {0};
    p.first = 3, p.every = 2, p.batch = 8, p.target = 3.3;
    int due[10];
    for (int s = 1; s <= 9; s++) due[s] = lb_mlperf_due(&p, s);
    ck_assert(!due[1] && !due[2] && due[3] && !due[4] && due[5] && !due[6] && due[7]);
    ck_assert_int_eq(lb_mlperf_eval_stop(&p, 3, 9, 3.4), 0);
    ck_assert(p.block_open);                                // the next block began
    ck_assert_int_eq(lb_mlperf_eval_stop(&p, 5, 9, 3.3), 1);   // at the target: reached
    p = (lb_mlperf){.first = 1, .every = 1, .batch = 16, .target = 0.69, .higher = 1};
    ck_assert_int_eq(lb_mlperf_eval_stop(&p, 1, 9, 0.69), 0);  // an accuracy must exceed it
    ck_assert_int_eq(lb_mlperf_eval_stop(&p, 2, 9, 0.70), 1);
    p.reached = 0, p.block_open = 0;
    ck_assert_int_eq(lb_mlperf_eval_stop(&p, 9, 9, 0.1), 0);
    ck_assert(!p.block_open);                               // the last step opens no block
    char b[64], sb[64];
    ck_assert_str_eq(lb_mllog_num(b, 1e-5), "1e-05");
    ck_assert_str_eq(lb_mllog_num(b, 0.95), "0.95");
    ck_assert_str_eq(lb_mllog_num(b, 1.0), "1.0");
    ck_assert_str_eq(lb_mllog_num(b, 1.0e-6 * 0.25), "2.5e-07");
    ck_assert_str_eq(lb_mllog_int(b, 1200000), "1200000");
    ck_assert_str_eq(lb_mllog_str(sb, sizeof sb, "a \"q\"\n"), "\"a \\\"q\\\"\\n\"");
}
END_TEST

// ---- shuffling and blending -----------------------------------------------------------------

START_TEST(permute_bijection)
{
    static const uint64_t sizes[] = {1, 2, 3, 5, 16, 17, 1000, 4099};
    static uint8_t seen[4099];
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        uint64_t n = sizes[k];
        memset(seen, 0, sizeof seen);
        uint64_t fixed = 0;
        for (uint64_t i = 0; i < n; i++) {
            uint64_t v = lb_data_permute(n, 7, 11, i);
            ck_assert_uint_lt(v, n);
            ck_assert_msg(!seen[v], "n=%llu: %llu drawn twice", (unsigned long long)n,
                          (unsigned long long)v);
            seen[v] = 1;
            fixed += v == i;
            ck_assert_uint_eq(lb_data_permute(n, 7, 11, i), v);   // reproducible
        }
        if (n >= 1000) ck_assert_uint_lt(fixed, n / 50);   // no identity in disguise
    }
    // Another stream (epoch) or seed: another order.
    int same_stream = 0, same_seed = 0;
    for (uint64_t i = 0; i < 1000; i++) {
        same_stream += lb_data_permute(1000, 7, 12, i) == lb_data_permute(1000, 7, 11, i);
        same_seed += lb_data_permute(1000, 8, 11, i) == lb_data_permute(1000, 7, 11, i);
    }
    ck_assert_int_lt(same_stream, 20);
    ck_assert_int_lt(same_seed, 20);
}
END_TEST

START_TEST(blend_parse)
{
    lb_data_blend bl;
    ck_assert_msg(lb_data_blend_parse(" 0.7 a_*.bin\t0.3  b_*.bin ", &bl, err, sizeof err) == 0,
                  "%s", err);
    ck_assert_int_eq(bl.n, 2);
    ck_assert_int_eq(bl.weighted, 1);
    ck_assert_str_eq(bl.glob[0], "a_*.bin");
    ck_assert_str_eq(bl.glob[1], "b_*.bin");
    ck_assert(bl.weight[0] == 0.7 && bl.weight[1] == 0.3);
    // Weights need not sum to one (Megatron normalises them too).
    ck_assert_int_eq(lb_data_blend_parse("2 a 6 b 2 c", &bl, err, sizeof err), 0);
    ck_assert_int_eq(bl.n, 3);
    // No number first: one glob, whole, spaces and all.
    ck_assert_int_eq(lb_data_blend_parse("my data/x_*.bin", &bl, err, sizeof err), 0);
    ck_assert_int_eq(bl.n, 1);
    ck_assert_int_eq(bl.weighted, 0);
    ck_assert_str_eq(bl.glob[0], "my data/x_*.bin");
    ck_assert_int_eq(lb_data_blend_parse("0.5x.bin", &bl, err, sizeof err), 0);
    ck_assert_int_eq(bl.weighted, 0);

    static const char *bad[][2] = {
        {"0.7 a 0.3", "weight 0.3 has no glob after it"},
        {"0.7 a -1 b", "weight -1 of dataset 2 is not positive"},
        {"0 a", "weight 0 of dataset 1 is not positive"},
        {"0.7 a x b", "'x' is not a weight"},
        {"1 a nan b", "'nan' is not a weight"},
        {"1e-9 a 1 b", "below a millionth"},
        {"  ", "empty"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        ck_assert_int_eq(lb_data_blend_parse(bad[k][0], &bl, err, sizeof err), -1);
        assert_err_has(bad[k][1]);
    }
}
END_TEST

// Three datasets whose token k of a shard is base + k: a (two shards: 10 and 7 windows of
// t=4), b (8 windows) and c (5). A window's first token names it; / 100000 names its set.
static const char *three_sets(char *spec, size_t len, const char *weights[3])
{
    const char *dir = scratch();
    write_ramp(path_in(dir, "a_000.bin"), 0, 41);
    write_ramp(path_in(dir, "a_001.bin"), 1000, 29);
    write_ramp(path_in(dir, "b_000.bin"), 100000, 33);
    write_ramp(path_in(dir, "c_000.bin"), 200000, 21);
    snprintf(spec, len, "%s %s/a_*.bin %s %s/b_*.bin %s %s/c_*.bin", weights[0], dir,
             weights[1], dir, weights[2], dir);
    return dir;
}

static lb_loader *open_spec(const char *spec, int shuffle, uint64_t seed, int b)
{
    lb_data_blend bl;
    ck_assert_msg(lb_data_blend_parse(spec, &bl, err, sizeof err) == 0, "%s", err);
    lb_loader *l = lb_loader_open_blend(&bl, shuffle, seed, b, 4, 1 << 20, err, sizeof err);
    ck_assert_msg(l != NULL, "%s", err);
    return l;
}

// The first tokens of the next batch's b sequences; checks each is one window of 5 tokens.
static void next_firsts(lb_loader *l, int b, int32_t *first)
{
    int32_t in[64], tg[64];
    ck_assert_msg(lb_loader_next(l, in, tg, err, sizeof err) == 0, "%s", err);
    for (int r = 0; r < b; r++) {
        first[r] = in[r * 4];
        ck_assert_int_eq(first[r] % 100000 % 1000 % 4, 0);   // windows start at multiples of t
        for (int i = 0; i < 4; i++) {
            ck_assert_int_eq(in[r * 4 + i], first[r] + i);
            ck_assert_int_eq(tg[r * 4 + i], first[r] + i + 1);
        }
    }
}

START_TEST(blend_proportions_and_passes)
{
    char spec[4096];
    const char *w[3] = {"0.5", "0.3", "0.2"};
    three_sets(spec, sizeof spec, w);
    const double share[3] = {0.5, 0.3, 0.2};
    const int windows[3] = {17, 8, 5};
    lb_loader *l = open_spec(spec, 1, 42, 1);
    int count[3] = {0, 0, 0};
    int32_t order[3][40];   // each set's first 40 sequences: over two passes
    for (int n = 1; n <= 200; n++) {
        int32_t f;
        next_firsts(l, 1, &f);
        int d = f / 100000;
        if (count[d] < 40) order[d][count[d]] = f;
        count[d]++;
        // Over every prefix each set is within one sequence of its share...
        for (int k = 0; k < 3; k++)
            ck_assert_msg(fabs(count[k] - n * share[k]) < 1.0, "n=%d set %d: %d sequences", n,
                          k, count[k]);
        // ...and exactly at it where the share is whole.
        if (n % 10 == 0)
            for (int k = 0; k < 3; k++) ck_assert_int_eq(count[k] * 10, n * (int)(share[k] * 10));
    }
    // Each pass over a set draws every window once, in an order other than the file's and
    // other than the pass before.
    for (int d = 0; d < 3; d++) {
        int32_t seen[2][17];
        for (int e = 0; e < 2; e++) {
            for (int i = 0; i < windows[d]; i++) seen[e][i] = order[d][e * windows[d] + i];
            for (int i = 0; i < windows[d]; i++)
                for (int j = i + 1; j < windows[d]; j++) ck_assert_int_ne(seen[e][i], seen[e][j]);
        }
        ck_assert(memcmp(seen[0], seen[1], sizeof(int32_t) * (size_t)windows[d]) != 0);
    }
    int in_order = 1;   // set a's first pass, unshuffled, would be 0, 4, ..., 36, 1000, ...
    for (int i = 1; i < 17; i++) in_order &= order[0][i] > order[0][i - 1];
    ck_assert(!in_order);
    lb_loader_close(l);

    // Unshuffled, a weighted set reads its windows in file order, pass after pass.
    l = open_spec(spec, 0, 42, 1);
    int k = 0;
    for (int n = 0; n < 100; n++) {
        int32_t f;
        next_firsts(l, 1, &f);
        if (f / 100000 != 0) continue;
        int i = k++ % 17;
        ck_assert_int_eq(f, i < 10 ? 4 * i : 1000 + 4 * (i - 10));
    }
    lb_loader_close(l);

    // The same seed gives the same order; another seed another.
    lb_loader *a = open_spec(spec, 1, 42, 1), *b = open_spec(spec, 1, 42, 1),
              *c = open_spec(spec, 1, 43, 1);
    int differ = 0;
    for (int n = 0; n < 60; n++) {
        int32_t fa, fb, fc;
        next_firsts(a, 1, &fa);
        next_firsts(b, 1, &fb);
        next_firsts(c, 1, &fc);
        ck_assert_int_eq(fa, fb);
        ck_assert_int_eq(fa / 100000, fc / 100000);   // the blend does not depend on the seed
        differ += fa != fc;
    }
    ck_assert_int_gt(differ, 30);
    lb_loader_close(a);
    lb_loader_close(b);
    lb_loader_close(c);
}
END_TEST

// Data-parallel ranks take micro-batch j of every step's G when j mod dp is theirs and skip the
// others (train.c, read_micro_batches): together they draw each sequence of the one-rank order
// exactly once.
START_TEST(blend_dp_split)
{
    char spec[4096];
    const char *w[3] = {"0.7", "0.2", "0.1"};
    three_sets(spec, sizeof spec, w);
    enum { DP = 3, G = 6, B = 2, STEPS = 5 };
    lb_loader *one = open_spec(spec, 1, 9, B), *rank[DP];
    for (int r = 0; r < DP; r++) rank[r] = open_spec(spec, 1, 9, B);
    for (int step = 0; step < STEPS; step++) {
        int32_t want[G][B], got[G][B];
        int taken[G] = {0};
        for (int j = 0; j < G; j++) next_firsts(one, B, want[j]);
        for (int r = 0; r < DP; r++)
            for (int j = 0; j < G; j++) {
                if (j % DP != r) {
                    lb_loader_skip(rank[r], 1);
                    continue;
                }
                next_firsts(rank[r], B, got[j]);
                taken[j]++;
            }
        for (int j = 0; j < G; j++) {
            ck_assert_int_eq(taken[j], 1);   // every micro-batch by exactly one rank
            for (int i = 0; i < B; i++) ck_assert_int_eq(got[j][i], want[j][i]);
        }
        int64_t s1, p1;   // and every rank ends the step where the one rank does
        lb_loader_tell(one, &s1, &p1);
        for (int r = 0; r < DP; r++) {
            int64_t s, p;
            lb_loader_tell(rank[r], &s, &p);
            ck_assert_int_eq(s, s1);
            ck_assert_int_eq(p, p1);
        }
    }
    lb_loader_close(one);
    for (int r = 0; r < DP; r++) lb_loader_close(rank[r]);
}
END_TEST

START_TEST(blend_tell_seek)
{
    char spec[4096];
    const char *w[3] = {"0.45", "0.35", "0.2"};   // a period of 20 sequences
    three_sets(spec, sizeof spec, w);
    lb_loader *a = open_spec(spec, 1, 5, 3);
    int32_t fa[3], fb[3];
    for (int k = 0; k < 40; k++) {   // 120 sequences: several periods and passes
        int64_t s, p;
        lb_loader_tell(a, &s, &p);
        ck_assert_int_eq(s, -1);
        ck_assert_int_eq(p, 3 * k);   // sequences drawn
        // A fresh loader seeking to the reported position draws the same next batch.
        lb_loader *b = open_spec(spec, 1, 5, 3);
        ck_assert_msg(lb_loader_seek(b, s, p, err, sizeof err) == 0, "%s", err);
        next_firsts(a, 3, fa);
        next_firsts(b, 3, fb);
        for (int i = 0; i < 3; i++) ck_assert_int_eq(fa[i], fb[i]);
        lb_loader_close(b);
    }
    // reset: back to the first batch
    lb_loader *b = open_spec(spec, 1, 5, 3);
    next_firsts(b, 3, fb);
    lb_loader_reset(a);
    next_firsts(a, 3, fa);
    for (int i = 0; i < 3; i++) ck_assert_int_eq(fa[i], fb[i]);
    lb_loader_close(b);
    // A position of the other kind of loader is refused, saying so.
    ck_assert_int_eq(lb_loader_seek(a, 0, 0, err, sizeof err), -1);
    assert_err_has("the position is of a loader that reads the shards in order");
    ck_assert_int_eq(lb_loader_seek(a, -1, -2, err, sizeof err), -1);
    lb_loader *plain = lb_loader_open(two_shards(), 2, 3, 256, err, sizeof err);
    ck_assert_ptr_nonnull(plain);
    ck_assert_int_eq(lb_loader_seek(plain, -1, 12, err, sizeof err), -1);
    assert_err_has("the position is of a loader that draws sequences shuffled or blended");
    lb_loader_close(plain);
    lb_loader_close(a);

    // A glob that matches nothing, named.
    char bad[4200];
    snprintf(bad, sizeof bad, "%s 1 /nonexistent/z_*.bin", spec);
    lb_data_blend bl;
    ck_assert_int_eq(lb_data_blend_parse(bad, &bl, err, sizeof err), 0);
    ck_assert_ptr_null(lb_loader_open_blend(&bl, 1, 5, 3, 4, 1 << 20, err, sizeof err));
    ck_assert_str_eq(err, "/nonexistent/z_*.bin: no token shards match");
}
END_TEST

static Suite *data_suite(void)
{
    Suite *s = suite_create("data");
    TCase *tc = tcase_create("data");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, shard_v1_round_trip);
    tcase_add_test(tc, shard_v2_round_trip);
    tcase_add_test(tc, shard_corrupt_errors);
    tcase_add_test(tc, shard_failed_write_leaves_nothing);
    tcase_add_test(tc, loader_windows_boundary_and_wrap);
    tcase_add_test(tc, loader_tell_seek);
    tcase_add_test(tc, loader_errors);
    tcase_add_test(tc, permute_bijection);
    tcase_add_test(tc, blend_parse);
    tcase_add_test(tc, blend_proportions_and_passes);
    tcase_add_test(tc, blend_dp_split);
    tcase_add_test(tc, blend_tell_seek);
    tcase_add_test(tc, arith_problems);
    tcase_add_test(tc, arith_answer_and_completion);
    tcase_add_test(tc, arith_corpus_split);
    tcase_add_test(tc, arith_corpus_errors);
    tcase_add_test(tc, text_corpus);
    tcase_add_test(tc, metrics_tfevents);
    tcase_add_test(tc, mlperf_schedule_and_target);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    int rc = lb_test_run(data_suite());
    scratch_cleanup();
    return rc;
}
