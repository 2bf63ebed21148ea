// data.c: token shards (llm.c's format plus a uint32 version), the batch loader, and the
// arithmetic and text corpus generators behind `lowbit data`.
//
// Shard format. A shard is a header of LB_SHARD_HEADER_INTS (256) little-endian int32:
//   [0] = 20240520 (LB_SHARD_MAGIC), [1] = version, [2] = token count, [3..255] = 0,
// followed by exactly `count` tokens, little-endian:
//   version 1: uint16 per token. This is llm.c's format byte for byte, so llm.c's shards
//              (fineweb, tinyshakespeare, ...) load unchanged and ours load in llm.c.
//   version 2: uint32 per token. lowbit's extension for vocabularies over 65536 (Qwen3's
//              151936 does not fit uint16). llm.c does not read it.
// A file must be exactly 1024 + count * (2 or 4) bytes: anything shorter is truncated and
// anything longer has trailing bytes, and both are errors, so a half-copied shard never trains.
// The writer picks version 1 whenever every token is below 65536 to stay llm.c-compatible.
#include "src/io/data.h"

#include "kernels/common.h"
#include "src/io/files.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define LB_SHARD_HEADER_BYTES (LB_SHARD_HEADER_INTS * 4)

// ---- little-endian helpers (explicit, so shards are portable whatever the host order) -------

static uint32_t get_le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void put_le32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

// Token i of a raw token area with elem bytes per token (2: version 1, 4: version 2).
static inline uint32_t raw_token(const uint8_t *raw, int elem, size_t i)
{
    const uint8_t *p = raw + i * (size_t)elem;
    return elem == 2 ? (uint32_t)p[0] | (uint32_t)p[1] << 8 : get_le32(p);
}

// ---- reading ------------------------------------------------------------------------------

// Opens a shard and validates its header against the file size. On success *fp (when not
// NULL) is positioned at the first token; otherwise the file is closed.
static int shard_open(const char *path, FILE **fp, int *version, int64_t *count, char *err,
                      size_t errlen)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        return -1;
    }
    struct stat st;
    if (fstat(fileno(f), &st) != 0) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        fclose(f);
        return -1;
    }
    if (!S_ISREG(st.st_mode)) {
        snprintf(err, errlen, "%s: not a regular file", path);
        fclose(f);
        return -1;
    }
    long long size = (long long)st.st_size;
    if (size < LB_SHARD_HEADER_BYTES) {
        snprintf(err, errlen,
                 "%s: shorter than the shard header (expected at least %d bytes, found %lld)",
                 path, LB_SHARD_HEADER_BYTES, size);
        fclose(f);
        return -1;
    }
    uint8_t hdr[LB_SHARD_HEADER_BYTES];
    if (fread(hdr, 1, sizeof hdr, f) != sizeof hdr) {
        snprintf(err, errlen, "%s: read error in the shard header", path);
        fclose(f);
        return -1;
    }
    int32_t magic = (int32_t)get_le32(hdr), ver = (int32_t)get_le32(hdr + 4);
    int32_t cnt = (int32_t)get_le32(hdr + 8);
    const char *why = NULL;
    char buf[160];
    if (magic != LB_SHARD_MAGIC) {
        snprintf(buf, sizeof buf, "not a token shard: bad magic %ld (expected %d)", (long)magic,
                 LB_SHARD_MAGIC);
        why = buf;
    } else if (ver != 1 && ver != 2) {
        snprintf(buf, sizeof buf, "unknown shard version %ld (expected 1 or 2)", (long)ver);
        why = buf;
    } else if (cnt < 0) {
        snprintf(buf, sizeof buf, "negative token count %ld in the header", (long)cnt);
        why = buf;
    }
    if (why) {
        snprintf(err, errlen, "%s: %s", path, why);
        fclose(f);
        return -1;
    }
    long long expect = LB_SHARD_HEADER_BYTES + (long long)cnt * (ver == 1 ? 2 : 4);
    if (size != expect) {
        snprintf(err, errlen, "%s: %s %ld tokens (expected %lld bytes, found %lld)", path,
                 size < expect ? "truncated: the header declares"
                               : "trailing bytes after the header's",
                 (long)cnt, expect, size);
        fclose(f);
        return -1;
    }
    *version = ver;
    *count = cnt;
    if (fp)
        *fp = f;
    else
        fclose(f);
    return 0;
}

// Reads a validated shard's token area as stored (2 or 4 bytes per token). *raw is malloc'd
// (NULL for an empty shard).
static int shard_load_raw(const char *path, uint8_t **raw, int *version, int64_t *count,
                          char *err, size_t errlen)
{
    FILE *f;
    *raw = NULL;
    if (shard_open(path, &f, version, count, err, errlen) != 0) return -1;
    size_t bytes = (size_t)*count * (*version == 1 ? 2 : 4);
    uint8_t *buf = NULL;
    if (bytes) {
        buf = malloc(bytes);
        if (!buf) {
            snprintf(err, errlen, "%s: out of memory for %zu bytes of tokens", path, bytes);
            fclose(f);
            return -1;
        }
        if (fread(buf, 1, bytes, f) != bytes) {   // only when the file changes under us
            snprintf(err, errlen, "%s: read error (expected %zu token bytes)", path, bytes);
            free(buf);
            fclose(f);
            return -1;
        }
    }
    fclose(f);
    *raw = buf;
    return 0;
}

int lb_shard_read(const char *path, uint32_t **tokens, size_t *n, char *err, size_t errlen)
{
    uint8_t *raw;
    int version;
    int64_t count;
    *tokens = NULL;
    *n = 0;
    if (shard_load_raw(path, &raw, &version, &count, err, errlen) != 0) return -1;
    uint32_t *out = malloc(sizeof(uint32_t) * (count ? (size_t)count : 1));
    if (!out) {
        snprintf(err, errlen, "%s: out of memory for %lld tokens", path, (long long)count);
        free(raw);
        return -1;
    }
    int elem = version == 1 ? 2 : 4;
    for (int64_t i = 0; i < count; i++) out[i] = raw_token(raw, elem, (size_t)i);
    free(raw);
    *tokens = out;
    *n = (size_t)count;
    return 0;
}

// ---- writing ------------------------------------------------------------------------------

int lb_shard_write(const char *path, const uint32_t *tokens, size_t n, char *err, size_t errlen)
{
    if (n > (size_t)INT32_MAX) {   // the header's count is an int32
        snprintf(err, errlen, "%s: %zu tokens exceed the shard limit of %d", path, n,
                 INT32_MAX);
        return -1;
    }
    int version = 1;
    for (size_t i = 0; i < n; i++)
        if (tokens[i] > 0xFFFF) {
            version = 2;
            break;
        }
    int elem = version == 1 ? 2 : 4;

    lb_atomic_file a;
    if (lb_atomic_open(&a, path, err, errlen) != 0) return -1;
    uint8_t hdr[LB_SHARD_HEADER_BYTES] = {0};
    put_le32(hdr, LB_SHARD_MAGIC);
    put_le32(hdr + 4, (uint32_t)version);
    put_le32(hdr + 8, (uint32_t)n);
    int bad = fwrite(hdr, 1, sizeof hdr, a.f) != sizeof hdr;
    // Encode in chunks: bounded memory whatever the shard size.
    enum { CHUNK = 1 << 15 };
    uint8_t buf[CHUNK * 4];
    for (size_t i = 0; i < n && !bad; i += CHUNK) {
        size_t m = n - i < CHUNK ? n - i : CHUNK;
        for (size_t j = 0; j < m; j++) {
            uint32_t v = tokens[i + j];
            if (elem == 2) {
                buf[2 * j] = (uint8_t)v;
                buf[2 * j + 1] = (uint8_t)(v >> 8);
            } else {
                put_le32(buf + 4 * j, v);
            }
        }
        bad = fwrite(buf, (size_t)elem, m, a.f) != m;
    }
    if (bad) {
        snprintf(err, errlen, "%s: write failed: %s", path, strerror(errno));
        lb_atomic_abort(&a);   // removes the temporary: no partial shard is ever visible
        return -1;
    }
    return lb_atomic_commit(&a, err, errlen);
}

// ---- loader -------------------------------------------------------------------------------

struct lb_loader {
    char **paths;       // [nshards], sorted by name
    int nshards;
    int64_t *counts;    // [nshards] tokens per shard, from the headers read at open
    int b, t, vocab;
    size_t bt;          // tokens per batch (b*t); a batch reads bt+1
    int64_t shard, pos; // where the next batch starts (normalised lazily in next/tell)
    int loaded;         // shard whose tokens are in raw, -1 for none
    int elem;           // bytes per token of the loaded shard
    uint8_t *raw;       // [counts[loaded] * elem] tokens as stored
    // A sequence loader (lb_loader_open_blend); the fields above but shard, pos and raw serve
    // it too. Everything below but the file cache is a function of seq and the open arguments.
    int seqmode;
    int shuffle;
    uint64_t seed;
    int nsets;
    int *first;         // [nsets+1] the shards of set d are first[d] .. first[d+1]-1
    int64_t *wbefore;   // [nshards+1] windows in the shards before s (all sets)
    int64_t *q;         // [nsets] weights in millionths of their sum (at least 1)
    int64_t qsum;       // their sum
    int64_t period;     // the blend repeats every period sequences (per[d] of set d in each)
    int64_t *per;       // [nsets]
    int64_t seq;        // sequences drawn
    int64_t *drawn;     // [nsets] sequences drawn from each set
    int64_t inper;      // sequences drawn in the current period
    int64_t *pdrawn;    // [nsets] of them from each set
    FILE *fp;           // shard open for window reads, -1 in fp_shard for none
    int fp_shard, fp_elem;
};

// The position the next batch really starts at: a shard with fewer than bt+1 tokens left moves
// on to the start of the next (the last to the first). Needs only the header counts.
static void loader_normalise(const lb_loader *l, int64_t *shard, int64_t *pos)
{
    if (*pos + (int64_t)l->bt + 1 > l->counts[*shard]) {
        *shard = (*shard + 1) % l->nshards;
        *pos = 0;
    }
}

// Shard s of l read whole (*raw malloc'd, *elem bytes a token) and checked: it still matches
// the header read at open, and every token is inside the vocabulary.
static int loader_read(const lb_loader *l, int s, uint8_t **raw, int *elem, char *err,
                       size_t errlen)
{
    const char *path = l->paths[s];
    int version;
    int64_t count;
    if (shard_load_raw(path, raw, &version, &count, err, errlen) != 0) return -1;
    if (count != l->counts[s]) {   // replaced between open and now: positions would be wrong
        snprintf(err, errlen, "%s: changed since the loader opened it (%lld tokens, was %lld)",
                 path, (long long)count, (long long)l->counts[s]);
        free(*raw);
        return -1;
    }
    *elem = version == 1 ? 2 : 4;
    if (*elem == 2 && l->vocab > 0xFFFF) return 0;   // every uint16 fits
    for (int64_t i = 0; i < count; i++) {
        uint32_t tok = raw_token(*raw, *elem, (size_t)i);
        if (tok >= (uint32_t)l->vocab) {
            snprintf(err, errlen,
                     "%s: token %lu at offset %lld is outside the vocabulary (vocab_size %d)",
                     path, (unsigned long)tok, (long long)i, l->vocab);
            free(*raw);
            return -1;
        }
    }
    return 0;
}

// Brings shard s into memory. Checked again (lb_loader_check_shard did before the first step),
// so a shard replaced during the run fails here, never as a bad gather.
static int loader_load(lb_loader *l, int s, char *err, size_t errlen)
{
    if (l->loaded == s) return 0;
    free(l->raw);
    l->raw = NULL;
    l->loaded = -1;
    uint8_t *raw;
    if (loader_read(l, s, &raw, &l->elem, err, errlen) != 0) return -1;
    l->raw = raw;
    l->loaded = s;
    return 0;
}

int lb_loader_check_shard(const lb_loader *l, int s, char *err, size_t errlen)
{
    uint8_t *raw;
    int elem;
    if (loader_read(l, s, &raw, &elem, err, errlen) != 0) return -1;
    free(raw);
    return 0;
}

int64_t lb_loader_tokens(const lb_loader *l)
{
    int64_t n = 0;
    for (int s = 0; s < l->nshards; s++) n += l->counts[s];
    return n;
}

// An empty loader of shape (b, t, vocab); what names the data in an error.
static lb_loader *loader_new(const char *what, int b, int t, int vocab_size, char *err,
                             size_t errlen)
{
    if (b <= 0 || t <= 0 || vocab_size <= 0 || (int64_t)b * t >= INT32_MAX) {
        snprintf(err, errlen, "%s: bad loader shape b=%d t=%d vocab_size=%d", what, b, t,
                 vocab_size);
        return NULL;
    }
    lb_loader *l = lb_calloc(1, sizeof *l);
    l->paths = lb_malloc(sizeof(char *));
    l->counts = lb_malloc(sizeof(int64_t));
    l->b = b;
    l->t = t;
    l->vocab = vocab_size;
    l->bt = (size_t)b * (size_t)t;
    l->loaded = -1;
    l->fp_shard = -1;
    return l;
}

// Appends the shards matching pattern (sorted by name) and reads every header now, so a
// corrupt or short shard stops the run before the first step.
static int loader_add(lb_loader *l, const char *pattern, char *err, size_t errlen)
{
    char **paths;
    int n = lb_glob(pattern, &paths);
    if (n == 0) {
        lb_glob_free(paths, 0);
        snprintf(err, errlen, "%s: no token shards match", pattern);
        return -1;
    }
    int at = l->nshards;
    l->paths = realloc(l->paths, sizeof(char *) * (size_t)(at + n));
    l->counts = realloc(l->counts, sizeof(int64_t) * (size_t)(at + n));
    if (!l->paths || !l->counts) lb_die("out of memory for %d shard names", at + n);
    memcpy(l->paths + at, paths, sizeof(char *) * (size_t)n);
    free(paths);   // the names now belong to l
    l->nshards = at + n;
    for (int s = at; s < l->nshards; s++) {
        int version;
        if (shard_open(l->paths[s], NULL, &version, &l->counts[s], err, errlen) != 0) return -1;
        if (l->counts[s] < (int64_t)l->bt + 1) {
            snprintf(err, errlen,
                     "%s: %lld tokens, too few for one batch (b*t+1 = %zu tokens with b=%d t=%d)",
                     l->paths[s], (long long)l->counts[s], l->bt + 1, l->b, l->t);
            return -1;
        }
    }
    return 0;
}

lb_loader *lb_loader_open(const char *pattern, int b, int t, int vocab_size, char *err,
                          size_t errlen)
{
    lb_loader *l = loader_new(pattern, b, t, vocab_size, err, errlen);
    if (l && loader_add(l, pattern, err, errlen) != 0) {
        lb_loader_close(l);
        return NULL;
    }
    return l;
}

// ---- sequence loader: shuffling and blending ------------------------------------------------

// Fixed stream id of the shuffle ("shuffle" + the set in the low bytes): changing it changes
// every shuffled run's order.
#define LB_SHUFFLE_STREAM 0x73687566666c6500ull
#define LB_BLEND_SCALE 1000000   // weights are resolved to millionths of their sum

uint64_t lb_data_permute(uint64_t n, uint64_t seed, uint64_t stream, uint64_t i)
{
    if (n <= 1) return 0;
    // A balanced Feistel network on 2h bits (4^h >= n) is a bijection of [0, 4^h); applying it
    // again until the value lands below n (cycle walking) restricts it to a bijection of
    // [0, n). 4^h < 4n, so under four rounds of walking on average.
    int h = 1;
    while (h < 32 && (1ull << (2 * h)) < n) h++;
    const uint64_t mask = (1ull << h) - 1;
    uint64_t x = i;
    do {
        uint64_t left = x >> h, right = x & mask;
        for (uint64_t r = 0; r < 4; r++) {   // four rounds: a pseudo-random permutation
            uint64_t f = lb_rand_u64(seed, stream, right << 2 | r) & mask;
            uint64_t next = left ^ f;
            left = right;
            right = next;
        }
        x = left << h | right;
    } while (x >= n);
    return x;
}

static int64_t gcd64(int64_t a, int64_t b)
{
    while (b) {
        int64_t r = a % b;
        a = b;
        b = r;
    }
    return a;
}

int lb_data_blend_parse(const char *spec, lb_data_blend *bl, char *err, size_t errlen)
{
    memset(bl, 0, sizeof *bl);
    size_t len = strlen(spec);
    if (len >= sizeof bl->text) {
        snprintf(err, errlen, "longer than %zu characters", sizeof bl->text - 1);
        return -1;
    }
    const char *p = spec + strspn(spec, " \t");
    char *end;
    (void)strtod(p, &end);
    if (!*p || end == p || (*end && *end != ' ' && *end != '\t')) {
        // not a number first: one glob, whole (a name may hold spaces)
        if (!*p) {
            snprintf(err, errlen, "empty: name the token shards");
            return -1;
        }
        memcpy(bl->text, spec, len + 1);
        bl->n = 1;
        bl->weight[0] = 1.0;
        bl->glob[0] = bl->text;
        return 0;
    }
    bl->weighted = 1;
    memcpy(bl->text, spec, len + 1);
    char *save = NULL;
    int words = 0;
    double sum = 0.0;
    for (char *w = strtok_r(bl->text, " \t", &save); w; w = strtok_r(NULL, " \t", &save)) {
        if (words % 2 == 0) {
            if (bl->n == LB_BLEND_MAX) {
                snprintf(err, errlen, "more than %d datasets", LB_BLEND_MAX);
                return -1;
            }
            double v = strtod(w, &end);
            if (end == w || *end || !isfinite(v)) {
                snprintf(err, errlen, "'%s' is not a weight: expected \"WEIGHT GLOB "
                         "[WEIGHT GLOB ...]\" (as Megatron's --data-path)", w);
                return -1;
            }
            if (!(v > 0.0)) {
                snprintf(err, errlen, "weight %s of dataset %d is not positive", w, bl->n + 1);
                return -1;
            }
            bl->weight[bl->n] = v;
            sum += v;
        } else {
            bl->glob[bl->n++] = w;
        }
        words++;
    }
    if (words % 2) {
        snprintf(err, errlen, "weight %g has no glob after it: expected \"WEIGHT GLOB "
                 "[WEIGHT GLOB ...]\"", bl->weight[bl->n]);
        return -1;
    }
    if (!(sum > 0.0) || !isfinite(sum)) {
        snprintf(err, errlen, "the weights sum to %g, not a positive number", sum);
        return -1;
    }
    for (int d = 0; d < bl->n; d++)
        if (llround(bl->weight[d] / sum * LB_BLEND_SCALE) < 1) {
            snprintf(err, errlen, "weight %g of %s is below a millionth of the weights' sum "
                     "(%g): the blend resolves weights to millionths", bl->weight[d],
                     bl->glob[d], sum);
            return -1;
        }
    return 0;
}

lb_loader *lb_loader_open_blend(const lb_data_blend *bl, int shuffle, uint64_t seed, int b,
                                int t, int vocab_size, char *err, size_t errlen)
{
    lb_loader *l = loader_new(bl->glob[0], b, t, vocab_size, err, errlen);
    if (!l) return NULL;
    l->seqmode = 1;
    l->shuffle = shuffle;
    l->seed = seed;
    l->nsets = bl->n;
    l->first = lb_calloc((size_t)bl->n + 1, sizeof(int));
    l->q = lb_calloc((size_t)bl->n, sizeof(int64_t));
    l->per = lb_calloc((size_t)bl->n, sizeof(int64_t));
    l->drawn = lb_calloc((size_t)bl->n, sizeof(int64_t));
    l->pdrawn = lb_calloc((size_t)bl->n, sizeof(int64_t));
    double sum = 0.0;
    for (int d = 0; d < bl->n; d++) sum += bl->weight[d];
    int64_t g = 0;
    for (int d = 0; d < bl->n; d++) {
        l->first[d] = l->nshards;
        if (loader_add(l, bl->glob[d], err, errlen) != 0) {
            lb_loader_close(l);
            return NULL;
        }
        // Integers, so the blend is the same on every machine whatever its floating point.
        l->q[d] = llround(bl->weight[d] / sum * LB_BLEND_SCALE);
        if (l->q[d] < 1) l->q[d] = 1;   // lb_data_blend_parse refuses these
        l->qsum += l->q[d];
        g = gcd64(g, l->q[d]);
    }
    l->first[bl->n] = l->nshards;
    // After qsum/g sequences every share q[d]/qsum times the count is a whole number, and each
    // count is within one of it, so the counts are exactly the shares: the assignment starts
    // over. Seeks jump whole periods.
    l->period = l->qsum / g;
    for (int d = 0; d < bl->n; d++) l->per[d] = l->q[d] / g;
    l->wbefore = lb_calloc((size_t)l->nshards + 1, sizeof(int64_t));
    for (int s = 0; s < l->nshards; s++)
        l->wbefore[s + 1] = l->wbefore[s] + (l->counts[s] - 1) / t;
    return l;
}

// The set of the next sequence: the one furthest behind its share of the sequences drawn so
// far in this period, plus this one (the lowest index on a tie). Moves the blend on.
static int seq_pick(lb_loader *l)
{
    int best = 0;
    int64_t best_lag = 0;
    for (int d = 0; d < l->nsets; d++) {
        // (share of inper+1 - drawn) * qsum: whole numbers (q <= 10^6, inper < 10^6)
        int64_t lag = l->q[d] * (l->inper + 1) - l->pdrawn[d] * l->qsum;
        if (d == 0 || lag > best_lag) {
            best = d;
            best_lag = lag;
        }
    }
    l->pdrawn[best]++;
    l->drawn[best]++;
    l->seq++;
    if (++l->inper == l->period) {
        for (int d = 0; d < l->nsets; d++)
            if (l->pdrawn[d] != l->per[d])
                lb_die("data blend: set %d drew %lld of a period's %lld sequences, not %lld", d,
                       (long long)l->pdrawn[d], (long long)l->period, (long long)l->per[d]);
        l->inper = 0;
        memset(l->pdrawn, 0, sizeof(int64_t) * (size_t)l->nsets);
    }
    return best;
}

static void seq_skip(lb_loader *l, int64_t n)
{
    for (int64_t i = 0; i < n; i++) seq_pick(l);
}

static void seq_seek(lb_loader *l, int64_t seq)
{
    int64_t whole = seq / l->period;
    for (int d = 0; d < l->nsets; d++) {
        l->drawn[d] = whole * l->per[d];
        l->pdrawn[d] = 0;
    }
    l->inper = 0;
    l->seq = whole * l->period;
    seq_skip(l, seq - l->seq);
}

// Global window of sequence k of set d: pass k / W over the set's W windows, in order or in
// that pass's permutation.
static int64_t seq_window(const lb_loader *l, int d, int64_t k)
{
    int64_t base = l->wbefore[l->first[d]], w = l->wbefore[l->first[d + 1]] - base;
    int64_t epoch = k / w, i = k % w;
    if (l->shuffle) {
        uint64_t stream = lb_rand_u64(l->seed, LB_SHUFFLE_STREAM | (uint64_t)d, (uint64_t)epoch);
        i = (int64_t)lb_data_permute((uint64_t)w, l->seed, stream, (uint64_t)i);
    }
    return base + i;
}

// Reads window win's t+1 tokens into out, checked against the vocabulary (the shards were
// checked whole before the first step; this catches one replaced since).
static int seq_read(lb_loader *l, int64_t win, uint32_t *out, char *err, size_t errlen)
{
    int lo = 0, hi = l->nshards - 1;   // the shard s with wbefore[s] <= win < wbefore[s+1]
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (l->wbefore[mid] <= win) lo = mid;
        else hi = mid - 1;
    }
    int s = lo;
    if (l->fp_shard != s) {
        if (l->fp) fclose(l->fp);
        l->fp = NULL;
        l->fp_shard = -1;
        int version;
        int64_t count;
        if (shard_open(l->paths[s], &l->fp, &version, &count, err, errlen) != 0) return -1;
        if (count != l->counts[s]) {
            snprintf(err, errlen, "%s: %lld tokens, %lld when the run started (replaced?)",
                     l->paths[s], (long long)count, (long long)l->counts[s]);
            fclose(l->fp);
            l->fp = NULL;
            return -1;
        }
        l->fp_shard = s;
        l->fp_elem = version == 1 ? 2 : 4;
    }
    int64_t off = (win - l->wbefore[s]) * l->t;
    size_t n = (size_t)l->t + 1, elem = (size_t)l->fp_elem;
    uint8_t *buf = lb_malloc(n * elem);
    int rc = 0;
    if (fseeko(l->fp, (off_t)(LB_SHARD_HEADER_BYTES + off * (int64_t)elem), SEEK_SET) != 0 ||
        fread(buf, elem, n, l->fp) != n) {
        snprintf(err, errlen, "%s: read error at token %lld", l->paths[s], (long long)off);
        rc = -1;
    }
    for (size_t i = 0; i < n && rc == 0; i++) {
        out[i] = raw_token(buf, (int)elem, i);
        if (out[i] >= (uint32_t)l->vocab) {
            snprintf(err, errlen,
                     "%s: token %lu at offset %lld is outside the vocabulary (vocab_size %d)",
                     l->paths[s], (unsigned long)out[i], (long long)(off + (int64_t)i), l->vocab);
            rc = -1;
        }
    }
    free(buf);
    return rc;
}

static int seq_next(lb_loader *l, int32_t *inputs, int32_t *targets, char *err, size_t errlen)
{
    int64_t at = l->seq;
    uint32_t *win = lb_malloc(sizeof(uint32_t) * ((size_t)l->t + 1));
    int rc = 0;
    for (int r = 0; r < l->b && rc == 0; r++) {
        int d = seq_pick(l);
        rc = seq_read(l, seq_window(l, d, l->drawn[d] - 1), win, err, errlen);
        for (int i = 0; i < l->t && rc == 0; i++) {
            inputs[(size_t)r * l->t + i] = (int32_t)win[i];
            targets[(size_t)r * l->t + i] = (int32_t)win[i + 1];
        }
    }
    free(win);
    if (rc != 0) seq_seek(l, at);   // a failed call changes nothing
    return rc;
}

int lb_loader_next(lb_loader *l, int32_t *inputs, int32_t *targets, char *err, size_t errlen)
{
    if (l->seqmode) return seq_next(l, inputs, targets, err, errlen);
    int64_t s = l->shard, p = l->pos;
    loader_normalise(l, &s, &p);
    // Commit the new position only after the shard loads, so a failed call changes nothing.
    if (loader_load(l, (int)s, err, errlen) != 0) return -1;
    for (size_t i = 0; i < l->bt; i++) {
        inputs[i] = (int32_t)raw_token(l->raw, l->elem, (size_t)p + i);
        targets[i] = (int32_t)raw_token(l->raw, l->elem, (size_t)p + i + 1);
    }
    l->shard = s;
    l->pos = p + (int64_t)l->bt;
    return 0;
}

void lb_loader_skip(lb_loader *l, int n)
{
    if (l->seqmode) {
        seq_skip(l, (int64_t)n * l->b);
        return;
    }
    for (int i = 0; i < n; i++) {
        loader_normalise(l, &l->shard, &l->pos);   // header counts only: nothing is loaded
        l->pos += (int64_t)l->bt;
    }
}

void lb_loader_reset(lb_loader *l)
{
    if (l->seqmode) seq_seek(l, 0);
    l->shard = 0;
    l->pos = 0;
}

// Reports the normalised position, so a checkpoint never records an exhausted shard.
void lb_loader_tell(const lb_loader *l, int64_t *shard, int64_t *pos)
{
    if (l->seqmode) {
        *shard = -1;
        *pos = l->seq;
        return;
    }
    int64_t s = l->shard, p = l->pos;
    loader_normalise(l, &s, &p);
    *shard = s;
    *pos = p;
}

// Accepts any position inside the shard (0..count): one too near the end for a batch moves on
// to the next shard exactly as next() would, so seek(tell()) and seek(raw state) agree.
int lb_loader_seek(lb_loader *l, int64_t shard, int64_t pos, char *err, size_t errlen)
{
    // The two kinds of position cannot stand for each other: say which one this is.
    if (l->seqmode != (shard == -1)) {
        snprintf(err, errlen, "data loader: the position is of a loader that %s, this one %s",
                 shard == -1 ? "draws sequences shuffled or blended"
                             : "reads the shards in order",
                 l->seqmode ? "draws sequences shuffled or blended (data.shuffle, weights in "
                              "data.train_files)"
                            : "reads them in order");
        return -1;
    }
    if (l->seqmode) {
        if (pos < 0) {
            snprintf(err, errlen, "data loader: sequence position %lld is negative",
                     (long long)pos);
            return -1;
        }
        seq_seek(l, pos);
        return 0;
    }
    if (shard < 0 || shard >= l->nshards) {
        snprintf(err, errlen, "data loader: shard index %lld out of range (%d shards)",
                 (long long)shard, l->nshards);
        return -1;
    }
    if (pos < 0 || pos > l->counts[shard]) {
        snprintf(err, errlen, "%s: position %lld is outside the shard (%lld tokens)",
                 l->paths[shard], (long long)pos, (long long)l->counts[shard]);
        return -1;
    }
    l->shard = shard;
    l->pos = pos;
    return 0;
}

int lb_loader_nshards(const lb_loader *l) { return l->nshards; }

void lb_loader_close(lb_loader *l)
{
    if (!l) return;
    lb_glob_free(l->paths, l->nshards);
    free(l->counts);
    free(l->raw);
    free(l->first);
    free(l->wbefore);
    free(l->q);
    free(l->per);
    free(l->drawn);
    free(l->pdrawn);
    if (l->fp) fclose(l->fp);
    free(l);
}

// ---- arithmetic corpus --------------------------------------------------------------------

// Fixed stream ids ("arith" + a role byte): changing one changes every generated corpus.
#define LB_ARITH_STREAM_OP 0x6172697468000001ull
#define LB_ARITH_STREAM_A 0x6172697468000002ull
#define LB_ARITH_STREAM_B 0x6172697468000003ull
#define LB_ARITH_STREAM_VAL 0x6172697468000004ull

int lb_arith_problem(uint64_t seed, uint64_t i, int max_operand, char *buf)
{
    if (max_operand < 0) lb_die("lb_arith_problem: max_operand %d is negative", max_operand);
    // Modulo bias is below 2^-32 for any int range: irrelevant for a training corpus.
    uint64_t range = (uint64_t)max_operand + 1;
    long long a = (long long)(lb_rand_u64(seed, LB_ARITH_STREAM_A, i) % range);
    long long b = (long long)(lb_rand_u64(seed, LB_ARITH_STREAM_B, i) % range);
    int sub = (int)(lb_rand_u64(seed, LB_ARITH_STREAM_OP, i) >> 63);
    if (sub && b > a) {   // keep answers non-negative: b <= a
        long long x = a;
        a = b;
        b = x;
    }
    // Longest: "2147483647+2147483647=4294967294\n" = 33 bytes, within the 64 promised.
    return snprintf(buf, 64, "%lld%c%lld=%lld\n", a, sub ? '-' : '+', b, sub ? a - b : a + b);
}

int lb_arith_is_val(uint64_t seed, uint64_t i, double val_fraction)
{
    return (double)lb_rand_uniform(seed, LB_ARITH_STREAM_VAL, i) < val_fraction;
}

// Parses decimal digits at *p into a non-negative long; advances *p. -1 on none or overflow.
static int parse_ulong(const char **p, const char *end, long *out)
{
    const char *s = *p;
    long v = 0;
    if (s >= end || *s < '0' || *s > '9') return -1;
    for (; s < end && *s >= '0' && *s <= '9'; s++) {
        int d = *s - '0';
        if (v > (LONG_MAX - d) / 10) return -1;
        v = v * 10 + d;
    }
    *p = s;
    *out = v;
    return 0;
}

int lb_arith_answer(const char *prompt, long *expected)
{
    const char *p = prompt, *end = prompt + strlen(prompt);
    long a, b;
    if (parse_ulong(&p, end, &a) != 0) return -1;
    if (p >= end || (*p != '+' && *p != '-')) return -1;
    char op = *p++;
    if (parse_ulong(&p, end, &b) != 0) return -1;
    if (p >= end || *p != '=') return -1;
    if (op == '+') {
        if (a > LONG_MAX - b) return -1;
        *expected = a + b;
    } else {
        *expected = a - b;   // both non-negative: cannot overflow
    }
    return 0;
}

int lb_arith_parse_completion(const char *text, size_t len, long *value)
{
    const char *p = text, *end = text + len;
    int neg = p < end && *p == '-';
    if (neg) p++;
    long v;
    if (parse_ulong(&p, end, &v) != 0) return -1;
    if (p < end && *p != '\n') return -1;   // "42x", "42 " and "4 2" are wrong answers
    *value = neg ? -v : v;
    return 0;
}

// ---- generators ---------------------------------------------------------------------------

// One output split (train or val): accumulates tokens and writes PREFIX_NAME_NNN.bin shards.
// Shard numbers have at least 3 digits and as many as the largest needs, so the loader's
// name-sorted glob reads them in order.
//
// Shards are filled to shard_tokens (greedy, cut only between units), except that the last
// two are evened out: a greedy tail can be a handful of tokens, and the loader (as llm.c)
// refuses any shard shorter than one batch, so a corpus must not end in a stub. To do that,
// each full shard is held back until the next one fills (buf holds up to two shards).
typedef struct {
    const char *prefix, *name;
    int width;       // digits in the shard number
    int nshards;     // shards this split will hold (from the counting pass)
    int index;       // next shard number
    int newline_units;   // units end in '\n' (problems): cut only after one; else cut anywhere
    uint32_t *buf;   // [2*cap]: the held-back full shard [0, prev), then the open one [prev, prev+n)
    size_t prev, n, cap;
    int dry;         // counting pass: count shards, write nothing
} lb_split;

static int split_path(const lb_split *s, int index, char *out, size_t outlen, char *err,
                      size_t errlen)
{
    int k = snprintf(out, outlen, "%s_%s_%0*d.bin", s->prefix, s->name, s->width, index);
    if (k < 0 || (size_t)k >= outlen) {
        snprintf(err, errlen, "%s: output prefix too long", s->prefix);
        return -1;
    }
    return 0;
}

static int split_write(lb_split *s, const uint32_t *tok, size_t n, char *err, size_t errlen)
{
    char path[4096];
    if (split_path(s, s->index, path, sizeof path, err, errlen) != 0) return -1;
    if (lb_shard_write(path, tok, n, err, errlen) != 0) return -1;
    s->index++;
    return 0;
}

// Appends one unit (a problem, or a run of text or tokens) that must not be split across
// shards: bytes (a byte token each) or, when bytes is NULL, tokens.
static int split_add(lb_split *s, const uint8_t *bytes, const uint32_t *tokens, size_t len,
                     char *err, size_t errlen)
{
    if (s->n + len > s->cap) {   // the open shard is full: it becomes the held-back one
        if (s->dry) {
            s->index++;
        } else {
            if (s->prev && split_write(s, s->buf, s->prev, err, errlen) != 0) return -1;
            memmove(s->buf, s->buf + s->prev, s->n * sizeof(uint32_t));
            s->prev = s->n;
        }
        s->n = 0;
    }
    if (!s->dry)
        for (size_t i = 0; i < len; i++) s->buf[s->prev + s->n + i] = bytes ? bytes[i] : tokens[i];
    s->n += len;
    return 0;
}

// Writes what is left. Two shards left are re-cut at the allowed point nearest their middle
// that keeps both within cap (the greedy cut always qualifies), so neither is a stub.
static int split_finish(lb_split *s, char *err, size_t errlen)
{
    if (s->dry) {
        s->index += s->n > 0;
        s->n = 0;
        return 0;
    }
    size_t total = s->prev + s->n, cut = s->prev;
    if (s->prev && s->n) {
        size_t lo = total > s->cap ? total - s->cap : 1;
        size_t hi = total - 1 < s->cap ? total - 1 : s->cap;
        size_t best = cut, bestdist = (size_t)-1;
        for (size_t c = lo; c <= hi; c++) {
            if (s->newline_units && s->buf[c - 1] != '\n') continue;
            size_t dist = 2 * c > total ? 2 * c - total : total - 2 * c;
            if (dist < bestdist) {
                best = c;
                bestdist = dist;
            }
        }
        cut = best;
    }
    if (cut && split_write(s, s->buf, cut, err, errlen) != 0) return -1;
    if (total > cut && split_write(s, s->buf + cut, total - cut, err, errlen) != 0) return -1;
    s->prev = s->n = 0;
    return 0;
}

static int ndigits(int v)
{
    int d = 1;
    while (v >= 10) {
        v /= 10;
        d++;
    }
    return d;
}

// After the counting pass: fixes the number width, then refuses to run over numbered shards of
// an earlier run that this run would not overwrite (a longer earlier corpus, or another
// width), since the loader's glob would silently mix them into the new corpus.
static int split_prepare(lb_split *s, char *err, size_t errlen)
{
    s->nshards = s->index;
    s->width = ndigits(s->nshards > 0 ? s->nshards - 1 : 0);
    if (s->width < 3) s->width = 3;
    s->index = 0;
    s->prev = s->n = 0;
    s->dry = 0;
    char pattern[4096];
    int k = snprintf(pattern, sizeof pattern, "%s_%s_*.bin", s->prefix, s->name);
    if (k < 0 || (size_t)k >= sizeof pattern) {
        snprintf(err, errlen, "%s: output prefix too long", s->prefix);
        return -1;
    }
    char **list;
    int n = lb_glob(pattern, &list);
    size_t head = (size_t)k - strlen("*.bin");   // length of "PREFIX_NAME_"
    int rc = 0;
    for (int i = 0; i < n && rc == 0; i++) {
        const char *num = list[i] + head;
        size_t digits = strspn(num, "0123456789");
        if (digits == 0 || strcmp(num + digits, ".bin") != 0) continue;   // not one of ours
        char ours[4096];
        long idx = strtol(num, NULL, 10);
        int mine = digits < 10 && idx < s->nshards &&
                   split_path(s, (int)idx, ours, sizeof ours, err, errlen) == 0 &&
                   strcmp(ours, list[i]) == 0;
        if (!mine) {
            snprintf(err, errlen,
                     "%s: shard of an earlier corpus that this one would not replace; the "
                     "loader would mix it in (remove it or choose another prefix)",
                     list[i]);
            rc = -1;
        }
    }
    lb_glob_free(list, n);
    return rc;
}

// Creates the directory part of PREFIX ("data/arith" -> "data"), if there is one.
static int make_prefix_dir(const char *prefix, char *err, size_t errlen)
{
    const char *slash = strrchr(prefix, '/');
    if (!slash || slash == prefix) return 0;
    char dir[4096];
    size_t n = (size_t)(slash - prefix);
    if (n >= sizeof dir) {
        snprintf(err, errlen, "%s: output prefix too long", prefix);
        return -1;
    }
    memcpy(dir, prefix, n);
    dir[n] = 0;
    return lb_mkdirs(dir, err, errlen);
}

// One pass over the problems, counting (dry) or writing. Problems are never cut.
static int arith_pass(lb_split *train, lb_split *val, int problems, int max_operand,
                      double val_fraction, uint64_t seed, char *err, size_t errlen)
{
    char buf[64];
    for (int i = 0; i < problems; i++) {
        int len = lb_arith_problem(seed, (uint64_t)i, max_operand, buf);
        lb_split *s = lb_arith_is_val(seed, (uint64_t)i, val_fraction) ? val : train;
        if (split_add(s, (const uint8_t *)buf, NULL, (size_t)len, err, errlen) != 0) return -1;
    }
    if (split_finish(train, err, errlen) != 0 || split_finish(val, err, errlen) != 0)
        return -1;
    return 0;
}

int lb_data_gen_arith(const char *prefix, int problems, int max_operand, double val_fraction,
                      int shard_tokens, uint64_t seed, char *err, size_t errlen)
{
    char probe[64];
    if (problems <= 0) {
        snprintf(err, errlen, "%s: problems must be positive (got %d)", prefix, problems);
        return -1;
    }
    if (max_operand < 0) {
        snprintf(err, errlen, "%s: max_operand must be >= 0 (got %d)", prefix, max_operand);
        return -1;
    }
    if (!(val_fraction >= 0.0 && val_fraction <= 1.0)) {
        snprintf(err, errlen, "%s: val_fraction must be in [0, 1] (got %g)", prefix,
                 val_fraction);
        return -1;
    }
    // The longest problem has both operands at the maximum ('+' makes the longest answer).
    int longest = snprintf(probe, sizeof probe, "%d+%d=%lld\n", max_operand, max_operand,
                           2LL * max_operand);
    if (shard_tokens < longest) {
        snprintf(err, errlen,
                 "%s: shard_tokens %d is smaller than the longest problem (%d tokens)", prefix,
                 shard_tokens, longest);
        return -1;
    }
    if (make_prefix_dir(prefix, err, errlen) != 0) return -1;

    lb_split train = {.prefix = prefix, .name = "train", .newline_units = 1,
                      .cap = (size_t)shard_tokens, .dry = 1};
    lb_split val = {.prefix = prefix, .name = "val", .newline_units = 1,
                    .cap = (size_t)shard_tokens, .dry = 1};
    // Count first (cheap: a hash and a snprintf per problem), so the number width is known
    // and stale shards are refused before anything is written.
    if (arith_pass(&train, &val, problems, max_operand, val_fraction, seed, err, errlen) != 0)
        return -1;
    if (split_prepare(&train, err, errlen) != 0 || split_prepare(&val, err, errlen) != 0)
        return -1;
    train.buf = malloc(sizeof(uint32_t) * 2 * (size_t)shard_tokens);
    val.buf = malloc(sizeof(uint32_t) * 2 * (size_t)shard_tokens);
    int rc = -1;
    if (!train.buf || !val.buf)
        snprintf(err, errlen, "%s: out of memory for shard_tokens %d", prefix, shard_tokens);
    else
        rc = arith_pass(&train, &val, problems, max_operand, val_fraction, seed, err, errlen);
    free(train.buf);
    free(val.buf);
    return rc;
}

// Writes n bytes (or, bytes NULL, tokens) to a split in shards of cap tokens (the last two
// evened out).
static int text_split(lb_split *s, const uint8_t *bytes, const uint32_t *tokens, size_t n,
                      char *err, size_t errlen)
{
    for (size_t off = 0; off < n; off += s->cap) {
        size_t m = n - off < s->cap ? n - off : s->cap;
        if (split_add(s, bytes ? bytes + off : NULL, bytes ? NULL : tokens + off, m, err,
                      errlen) != 0)
            return -1;
    }
    return split_finish(s, err, errlen);
}

int lb_data_write_split(const char *prefix, const char *name, const uint32_t *tokens, size_t n,
                        int shard_tokens, char *err, size_t errlen)
{
    if (shard_tokens <= 0) {
        snprintf(err, errlen, "%s: shard_tokens must be positive (got %d)", prefix, shard_tokens);
        return -1;
    }
    lb_split s = {.prefix = prefix, .name = name, .cap = (size_t)shard_tokens};
    s.index = (int)((n + (size_t)shard_tokens - 1) / (size_t)shard_tokens);
    if (make_prefix_dir(prefix, err, errlen) != 0 || split_prepare(&s, err, errlen) != 0)
        return -1;
    if (n == 0) return 0;
    s.buf = malloc(sizeof(uint32_t) * 2 * (size_t)shard_tokens);
    if (!s.buf) {
        snprintf(err, errlen, "%s: out of memory for shard_tokens %d", prefix, shard_tokens);
        return -1;
    }
    int rc = text_split(&s, NULL, tokens, n, err, errlen);
    free(s.buf);
    return rc;
}

int lb_data_gen_text(const char *prefix, const char *input, double val_fraction,
                     int shard_tokens, char *err, size_t errlen)
{
    if (!(val_fraction >= 0.0 && val_fraction <= 1.0)) {
        snprintf(err, errlen, "%s: val_fraction must be in [0, 1] (got %g)", input,
                 val_fraction);
        return -1;
    }
    if (shard_tokens <= 0) {
        snprintf(err, errlen, "%s: shard_tokens must be positive (got %d)", input,
                 shard_tokens);
        return -1;
    }
    size_t len;
    char *text = lb_read_file(input, &len, err, errlen);
    if (!text) return -1;
    if (len == 0) {
        snprintf(err, errlen, "%s: empty input file", input);
        free(text);
        return -1;
    }
    // The first (1 - val_fraction) of the bytes train, the rest validate (llm.c's
    // tinyshakespeare split is the same idea: a contiguous tail, not a random sample).
    size_t nval = (size_t)llround(val_fraction * (double)len);
    if (nval > len) nval = len;
    size_t ntrain = len - nval;
    const uint8_t *bytes = (const uint8_t *)text;

    int rc = -1;
    lb_split train = {.prefix = prefix, .name = "train", .cap = (size_t)shard_tokens};
    lb_split val = {.prefix = prefix, .name = "val", .cap = (size_t)shard_tokens};
    // Shard counts are known without a counting pass; split_prepare takes them from index.
    train.index = (int)((ntrain + (size_t)shard_tokens - 1) / (size_t)shard_tokens);
    val.index = (int)((nval + (size_t)shard_tokens - 1) / (size_t)shard_tokens);
    if (make_prefix_dir(prefix, err, errlen) != 0 || split_prepare(&train, err, errlen) != 0 ||
        split_prepare(&val, err, errlen) != 0)
        goto out;
    train.buf = malloc(sizeof(uint32_t) * 2 * (size_t)shard_tokens);
    val.buf = malloc(sizeof(uint32_t) * 2 * (size_t)shard_tokens);
    if (!train.buf || !val.buf) {
        snprintf(err, errlen, "%s: out of memory for shard_tokens %d", input, shard_tokens);
        goto out;
    }
    // Text is cut at exactly shard_tokens: feed each split one shard's worth at a time.
    if (text_split(&train, bytes, NULL, ntrain, err, errlen) != 0 ||
        text_split(&val, bytes + ntrain, NULL, nval, err, errlen) != 0)
        goto out;
    rc = 0;
out:
    free(train.buf);
    free(val.buf);
    free(text);
    return rc;
}
