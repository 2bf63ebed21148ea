// tokenizer.c: byte-level BPE from a Hugging Face tokenizer.json (see tokenizer.h).
//
// The vocabulary is kept as raw bytes: a byte-level vocabulary spells byte b as the code point
// bytes_to_unicode(b) (GPT-2's table: printable Latin-1 stands for itself, the other 68 bytes
// become U+0100..U+0143), so mapping every entry back to bytes once at load lets encoding merge
// the text's own bytes and decoding copy bytes out, with no per-call mapping.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "src/io/tokenizer.h"
#include "src/io/json.h"

#include "src/io/files.h"

#include <cJSON.h>
#include <math.h>
#include <pcre2.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

// Ids above this are refused: no real vocabulary comes near, and a typo'd id (1e9) would
// otherwise allocate gigabytes of tables.
#define LB_TOKENIZER_MAX_ID (1 << 24)

// GPT-2's pre-tokenizer, the one ByteLevel applies when use_regex is true.
static const char gpt2_pattern[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

typedef enum { SPLIT_ISOLATED, SPLIT_REMOVED, SPLIT_MERGED_PREV, SPLIT_MERGED_NEXT,
               SPLIT_CONTIGUOUS } split_behavior;

typedef struct {
    int byte_level;              // 0: Split, 1: ByteLevel
    pcre2_code *re;              // Split's pattern, or GPT-2's for ByteLevel with use_regex
    split_behavior behavior;
    int invert;
    int add_prefix_space;
} pretok_step;

typedef struct {
    char *s;
    size_t len;
    uint32_t id;
    int special, lstrip, rstrip;
} added_token;

// Open-addressing map from byte strings to ids (the model vocabulary).
typedef struct {
    const char *s;               // NULL: empty slot
    uint32_t len, id;
} str_slot;

// Open-addressing map from an id pair to its merge (rank, merged id).
typedef struct {
    uint64_t key;                // (a << 32 | b) + 1; 0: empty slot
    uint32_t rank, id;
} pair_slot;

struct lb_tokenizer {
    int nids;                    // one more than the largest id
    char **bytes;                // (nids) what each id decodes to, NULL when no token has it
    uint32_t *nbytes;            // (nids)
    unsigned char *special;      // (nids) 1 for added tokens marked special
    unsigned char *is_added;     // (nids) 1: bytes[id] is an added token's (its own copy)
    str_slot *vocab;             // model vocabulary, raw bytes -> id
    size_t vocab_cap;
    pair_slot *merges;
    size_t merges_cap;
    uint32_t byte_id[256];       // the token of each single byte
    int ignore_merges;           // a piece that is a whole vocabulary entry is not merged
    int nfc;
    added_token *added;
    int nadded;
    int *added_by_byte[256];     // indices into added, longest first, by first byte
    int added_count[256];
    pretok_step *steps;
    int nsteps;
};

static void fail(char *err, size_t errlen, const char *name, const char *fmt, ...)
{
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    snprintf(err, errlen, "%s: %s", name, msg);
}

// ---- hashing ------------------------------------------------------------------------------

static uint64_t hash_bytes(const char *s, size_t n)
{
    uint64_t h = 1469598103934665603ull;           // FNV-1a
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
    return h;
}

static uint64_t hash_u64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return x;
}

static size_t table_cap(size_t n)
{
    size_t cap = 16;
    while (cap < 2 * n + 16) cap <<= 1;             // load factor at most one half
    return cap;
}

static str_slot *vocab_find(const lb_tokenizer *t, const char *s, size_t n)
{
    size_t mask = t->vocab_cap - 1, i = hash_bytes(s, n) & mask;
    while (t->vocab[i].s) {
        if (t->vocab[i].len == n && memcmp(t->vocab[i].s, s, n) == 0) return &t->vocab[i];
        i = (i + 1) & mask;
    }
    return &t->vocab[i];
}

static pair_slot *merge_find(const lb_tokenizer *t, uint32_t a, uint32_t b)
{
    uint64_t key = ((uint64_t)a << 32 | b) + 1;
    size_t mask = t->merges_cap - 1, i = hash_u64(key) & mask;
    while (t->merges[i].key && t->merges[i].key != key) i = (i + 1) & mask;
    return &t->merges[i];
}

// ---- byte-level alphabet ------------------------------------------------------------------

static int byte_is_printable(int b)
{
    return (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
}

// unicode_to_byte[cp] for cp < 324: the byte that code point stands for, or -1.
static void byte_level_tables(int16_t u2b[324])
{
    for (int i = 0; i < 324; i++) u2b[i] = -1;
    int n = 0;
    for (int b = 0; b < 256; b++) u2b[byte_is_printable(b) ? b : 256 + n++] = (int16_t)b;
}

// Maps a byte-level UTF-8 string to its raw bytes (out has at least strlen(s) bytes). Returns
// the length, or -1 when s holds a code point outside the byte-level alphabet.
static long byte_level_decode(const char *s, const int16_t u2b[324], char *out)
{
    const unsigned char *p = (const unsigned char *)s;
    long n = 0;
    while (*p) {
        utf8proc_int32_t cp;
        utf8proc_ssize_t k = utf8proc_iterate(p, -1, &cp);
        if (k <= 0 || cp >= 324 || u2b[cp] < 0) return -1;
        out[n++] = (char)u2b[cp];
        p += k;
    }
    return n;
}

// ---- loading ------------------------------------------------------------------------------

static int json_bool(const cJSON *obj, const char *key, int def)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (cJSON_IsBool(v)) return cJSON_IsTrue(v);
    return def;
}

// An id from JSON: an integer in [0, LB_TOKENIZER_MAX_ID). -1 otherwise.
static long json_id(const cJSON *v)
{
    if (!cJSON_IsNumber(v)) return -1;
    double d = v->valuedouble;
    if (d < 0 || d >= LB_TOKENIZER_MAX_ID || d != floor(d)) return -1;
    return (long)d;
}

static pcre2_code *compile_regex(const char *pattern, int literal, const char *name,
                                 const char *where, char *err, size_t errlen)
{
    int code;
    PCRE2_SIZE off;
    // PCRE2_LITERAL takes no UCP (it has no classes to widen).
    uint32_t opts = PCRE2_UTF | PCRE2_MATCH_INVALID_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED, opts, &code, &off,
                                   NULL);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(code, msg, sizeof msg);
        fail(err, errlen, name, "%s: bad regex at offset %zu: %s", where, (size_t)off,
             (const char *)msg);
        return NULL;
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);     // without JIT (unsupported host) it still works
    return re;
}

static int add_step(lb_tokenizer *t, pretok_step s)
{
    pretok_step *n = realloc(t->steps, (size_t)(t->nsteps + 1) * sizeof *n);
    if (!n) return -1;
    t->steps = n;
    t->steps[t->nsteps++] = s;
    return 0;
}

static int parse_pretok(lb_tokenizer *t, const cJSON *p, const char *where, const char *name,
                        char *err, size_t errlen)
{
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(p, "type");
    if (!cJSON_IsObject(p) || !cJSON_IsString(type)) {
        fail(err, errlen, name, "%s: not an object with a \"type\"", where);
        return -1;
    }
    const char *ty = type->valuestring;
    if (!strcmp(ty, "Sequence")) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(p, "pretokenizers");
        if (!cJSON_IsArray(list)) {
            fail(err, errlen, name, "%s: Sequence without a \"pretokenizers\" list", where);
            return -1;
        }
        int i = 0;
        const cJSON *e;
        cJSON_ArrayForEach(e, list) {
            char sub[256];
            snprintf(sub, sizeof sub, "%s.pretokenizers[%d]", where, i++);
            if (parse_pretok(t, e, sub, name, err, errlen) != 0) return -1;
        }
        return 0;
    }
    pretok_step s = {0};
    if (!strcmp(ty, "ByteLevel")) {
        s.byte_level = 1;
        s.add_prefix_space = json_bool(p, "add_prefix_space", 1);
        if (json_bool(p, "use_regex", 1)) {
            s.re = compile_regex(gpt2_pattern, 0, name, where, err, errlen);
            if (!s.re) return -1;
        }
    } else if (!strcmp(ty, "Split")) {
        const cJSON *pat = cJSON_GetObjectItemCaseSensitive(p, "pattern");
        const cJSON *rx = cJSON_GetObjectItemCaseSensitive(pat, "Regex");
        const cJSON *lit = cJSON_GetObjectItemCaseSensitive(pat, "String");
        if (!cJSON_IsString(rx) && !cJSON_IsString(lit)) {
            fail(err, errlen, name, "%s: Split needs \"pattern\": {\"Regex\": ...} or {\"String\": ...}",
                 where);
            return -1;
        }
        const cJSON *beh = cJSON_GetObjectItemCaseSensitive(p, "behavior");
        static const char *names[] = {"Isolated", "Removed", "MergedWithPrevious",
                                      "MergedWithNext", "Contiguous"};
        int b = -1;
        for (int i = 0; i < 5 && cJSON_IsString(beh); i++)
            if (!strcmp(beh->valuestring, names[i])) b = i;
        if (b < 0) {
            fail(err, errlen, name, "%s: Split \"behavior\" must be Isolated, Removed, "
                 "MergedWithPrevious, MergedWithNext or Contiguous", where);
            return -1;
        }
        s.behavior = (split_behavior)b;
        s.invert = json_bool(p, "invert", 0);
        s.re = cJSON_IsString(rx) ? compile_regex(rx->valuestring, 0, name, where, err, errlen)
                                  : compile_regex(lit->valuestring, 1, name, where, err, errlen);
        if (!s.re) return -1;
    } else {
        fail(err, errlen, name, "%s: pre-tokenizer type \"%s\" is not supported (Split, "
             "ByteLevel and Sequence are)", where, ty);
        return -1;
    }
    if (add_step(t, s) != 0) {
        pcre2_code_free(s.re);
        fail(err, errlen, name, "out of memory");
        return -1;
    }
    return 0;
}

// null, NFC, or a Sequence of NFC: anything else would change the ids unseen.
static int parse_normalizer(lb_tokenizer *t, const cJSON *n, const char *where, const char *name,
                            char *err, size_t errlen)
{
    if (!n || cJSON_IsNull(n)) return 0;
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(n, "type");
    if (cJSON_IsString(type) && !strcmp(type->valuestring, "NFC")) {
        t->nfc = 1;
        return 0;
    }
    if (cJSON_IsString(type) && !strcmp(type->valuestring, "Sequence")) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(n, "normalizers"), *e;
        int i = 0;
        cJSON_ArrayForEach(e, list) {
            char sub[256];
            snprintf(sub, sizeof sub, "%s.normalizers[%d]", where, i++);
            if (parse_normalizer(t, e, sub, name, err, errlen) != 0) return -1;
        }
        return 0;
    }
    fail(err, errlen, name, "%s: normalizer \"%s\" is not supported (only NFC is)", where,
         cJSON_IsString(type) ? type->valuestring : "?");
    return -1;
}

// Gives id an added token's bytes (a copy of s). An id the vocabulary has too (GPT-2's
// <|endoftext|>) decodes to the added content; its vocabulary string stays, owned by the map.
static int set_id_bytes(lb_tokenizer *t, uint32_t id, const char *s, size_t n)
{
    char *c = malloc(n + 1);
    if (!c) return -1;
    memcpy(c, s, n);
    c[n] = 0;
    t->bytes[id] = c;
    t->nbytes[id] = (uint32_t)n;
    t->is_added[id] = 1;
    return 0;
}

static int cmp_added_len(const void *a, const void *b, void *ctx)
{
    const added_token *x = (const added_token *)ctx + *(const int *)a;
    const added_token *y = (const added_token *)ctx + *(const int *)b;
    return x->len < y->len ? 1 : x->len > y->len ? -1 : 0;
}

static int parse_model(lb_tokenizer *t, const cJSON *root, const cJSON *added, const char *name,
                       char *err, size_t errlen)
{
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (!cJSON_IsObject(model)) {
        fail(err, errlen, name, "no \"model\" object");
        return -1;
    }
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(model, "type");
    if (type && !(cJSON_IsString(type) && !strcmp(type->valuestring, "BPE"))) {
        fail(err, errlen, name, "model.type \"%s\" is not supported (only BPE is)",
             cJSON_IsString(type) ? type->valuestring : "?");
        return -1;
    }
    const cJSON *o;
    if ((o = cJSON_GetObjectItemCaseSensitive(model, "dropout")) && cJSON_IsNumber(o) &&
        o->valuedouble > 0) {
        fail(err, errlen, name, "model.dropout is set: BPE dropout is not supported");
        return -1;
    }
    static const char *affixes[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (int i = 0; i < 2; i++)
        if ((o = cJSON_GetObjectItemCaseSensitive(model, affixes[i])) && cJSON_IsString(o) &&
            o->valuestring[0]) {
            fail(err, errlen, name, "model.%s is set: not supported by byte-level BPE", affixes[i]);
            return -1;
        }
    if (json_bool(model, "byte_fallback", 0)) {
        fail(err, errlen, name, "model.byte_fallback is true: not supported (byte-level BPE "
             "needs no fallback)");
        return -1;
    }
    t->ignore_merges = json_bool(model, "ignore_merges", 0);
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    const cJSON *merges = cJSON_GetObjectItemCaseSensitive(model, "merges");
    if (!cJSON_IsObject(vocab)) {
        fail(err, errlen, name, "model.vocab is missing or not an object");
        return -1;
    }
    if (!cJSON_IsArray(merges)) {
        fail(err, errlen, name, "model.merges is missing or not a list");
        return -1;
    }
    // Ids: the vocabulary's and the added tokens', all in range.
    long maxid = -1;
    int nvocab = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, vocab) {
        long id = json_id(e);
        if (id < 0) {
            fail(err, errlen, name, "model.vocab[\"%s\"]: id is not an integer in [0, %d)",
                 e->string, LB_TOKENIZER_MAX_ID);
            return -1;
        }
        if (id > maxid) maxid = id;
        nvocab++;
    }
    int i = 0;
    cJSON_ArrayForEach(e, added) {
        long id = json_id(cJSON_GetObjectItemCaseSensitive(e, "id"));
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(e, "content");
        if (id < 0 || !cJSON_IsString(content) || !content->valuestring[0]) {
            fail(err, errlen, name, "added_tokens[%d]: needs an \"id\" in [0, %d) and a "
                 "non-empty \"content\"", i, LB_TOKENIZER_MAX_ID);
            return -1;
        }
        if (json_bool(e, "single_word", 0)) {
            fail(err, errlen, name, "added_tokens[%d] (\"%s\"): single_word is not supported", i,
                 content->valuestring);
            return -1;
        }
        if (id > maxid) maxid = id;
        i++;
    }
    t->nids = (int)maxid + 1;
    t->bytes = calloc((size_t)t->nids, sizeof *t->bytes);
    t->nbytes = calloc((size_t)t->nids, sizeof *t->nbytes);
    t->special = calloc((size_t)t->nids, 1);
    t->is_added = calloc((size_t)t->nids, 1);
    t->vocab_cap = table_cap((size_t)nvocab);
    t->vocab = calloc(t->vocab_cap, sizeof *t->vocab);
    if (!t->bytes || !t->nbytes || !t->special || !t->is_added || !t->vocab) goto oom;

    int16_t u2b[324];
    byte_level_tables(u2b);
    cJSON_ArrayForEach(e, vocab) {
        uint32_t id = (uint32_t)json_id(e);
        size_t slen = strlen(e->string);
        char *raw = malloc(slen + 1);
        if (!raw) goto oom;
        long n = byte_level_decode(e->string, u2b, raw);
        if (n < 0) {
            free(raw);
            fail(err, errlen, name, "model.vocab[\"%s\"] (id %u): not a byte-level token "
                 "(a code point outside GPT-2's byte alphabet)", e->string, id);
            return -1;
        }
        if (t->bytes[id]) {
            free(raw);
            fail(err, errlen, name, "model.vocab: id %u is given to two tokens (\"%s\" and "
                 "another)", id, e->string);
            return -1;
        }
        t->bytes[id] = raw;
        t->nbytes[id] = (uint32_t)n;
        str_slot *s = vocab_find(t, raw, (size_t)n);
        if (s->s) {
            t->bytes[id] = NULL;
            free(raw);
            fail(err, errlen, name, "model.vocab[\"%s\"]: the same token twice", e->string);
            return -1;
        }
        *s = (str_slot){raw, (uint32_t)n, id};
    }
    for (int b = 0; b < 256; b++) {
        char c = (char)b;
        str_slot *s = vocab_find(t, &c, 1);
        if (!s->s) {
            fail(err, errlen, name, "model.vocab has no token for byte 0x%02x: a byte-level "
                 "vocabulary needs all 256", b);
            return -1;
        }
        t->byte_id[b] = s->id;
    }

    // Merges, in rank order: "a b" or ["a", "b"], both parts and their join in the vocabulary.
    t->merges_cap = table_cap((size_t)cJSON_GetArraySize(merges));
    t->merges = calloc(t->merges_cap, sizeof *t->merges);
    if (!t->merges) goto oom;
    uint32_t rank = 0;
    cJSON_ArrayForEach(e, merges) {
        const char *part[2] = {NULL, NULL};
        char buf[1024];
        if (cJSON_IsString(e)) {
            const char *sp = strchr(e->valuestring, ' ');
            size_t n = strlen(e->valuestring);
            if (sp && !strchr(sp + 1, ' ') && sp != e->valuestring && sp[1] && n < sizeof buf) {
                memcpy(buf, e->valuestring, n + 1);
                buf[sp - e->valuestring] = 0;
                part[0] = buf;
                part[1] = buf + (sp - e->valuestring) + 1;
            }
        } else if (cJSON_IsArray(e) && cJSON_GetArraySize(e) == 2 &&
                   cJSON_IsString(cJSON_GetArrayItem(e, 0)) &&
                   cJSON_IsString(cJSON_GetArrayItem(e, 1))) {
            part[0] = cJSON_GetArrayItem(e, 0)->valuestring;
            part[1] = cJSON_GetArrayItem(e, 1)->valuestring;
        }
        if (!part[0]) {
            fail(err, errlen, name, "model.merges[%u]: bad merge (expected \"a b\" or [\"a\", "
                 "\"b\"])", rank);
            return -1;
        }
        uint32_t ids[2];
        char joined[2048];
        size_t jl = 0;
        for (int k = 0; k < 2; k++) {
            char raw[1024];
            long n = strlen(part[k]) < sizeof raw ? byte_level_decode(part[k], u2b, raw) : -1;
            str_slot *s = n < 0 ? NULL : vocab_find(t, raw, (size_t)n);
            if (!s || !s->s) {
                fail(err, errlen, name, "model.merges[%u]: bad merge: \"%s\" is not in the "
                     "vocabulary", rank, part[k]);
                return -1;
            }
            ids[k] = s->id;
            memcpy(joined + jl, raw, (size_t)n);
            jl += (size_t)n;
        }
        str_slot *s = vocab_find(t, joined, jl);
        if (!s->s) {
            fail(err, errlen, name, "model.merges[%u]: bad merge: \"%s%s\" (the merged token) is "
                 "not in the vocabulary", rank, part[0], part[1]);
            return -1;
        }
        pair_slot *m = merge_find(t, ids[0], ids[1]);
        if (!m->key)   // a repeated merge keeps its first (lowest) rank, as tokenizers does
            *m = (pair_slot){((uint64_t)ids[0] << 32 | ids[1]) + 1, rank, s->id};
        rank++;
    }

    // Added tokens: decode to their content; matched longest first at each position.
    t->nadded = cJSON_GetArraySize(added);
    t->added = calloc((size_t)t->nadded + 1, sizeof *t->added);
    if (!t->added) goto oom;
    i = 0;
    cJSON_ArrayForEach(e, added) {
        added_token *a = &t->added[i];
        const char *content = cJSON_GetObjectItemCaseSensitive(e, "content")->valuestring;
        a->len = strlen(content);
        a->s = strdup(content);
        a->id = (uint32_t)json_id(cJSON_GetObjectItemCaseSensitive(e, "id"));
        a->special = json_bool(e, "special", 0);
        a->lstrip = json_bool(e, "lstrip", 0);
        a->rstrip = json_bool(e, "rstrip", 0);
        if (t->is_added[a->id]) {
            fail(err, errlen, name, "added_tokens[%d] (\"%s\"): id %u is already an added token's",
                 i, content, a->id);
            return -1;
        }
        if (!a->s || set_id_bytes(t, a->id, content, a->len) != 0) goto oom;
        t->special[a->id] = (unsigned char)a->special;
        for (int j = 0; j < i; j++)
            if (t->added[j].len == a->len && !memcmp(t->added[j].s, a->s, a->len)) {
                fail(err, errlen, name, "added_tokens[%d]: \"%s\" is already added_tokens[%d]",
                     i, content, j);
                return -1;
            }
        t->added_count[(unsigned char)a->s[0]]++;
        i++;
    }
    for (int b = 0; b < 256; b++) {
        if (!t->added_count[b]) continue;
        t->added_by_byte[b] = malloc((size_t)t->added_count[b] * sizeof(int));
        if (!t->added_by_byte[b]) goto oom;
        int k = 0;
        for (int j = 0; j < t->nadded; j++)
            if ((unsigned char)t->added[j].s[0] == b) t->added_by_byte[b][k++] = j;
        qsort_r(t->added_by_byte[b], (size_t)k, sizeof(int), cmp_added_len, t->added);
    }
    return 0;
oom:
    fail(err, errlen, name, "out of memory");
    return -1;
}

lb_tokenizer *lb_tokenizer_parse(const char *json, const char *name, char *err, size_t errlen)
{
    // strict: only white space after the value (two files run together, a cut edit), no key
    // twice (the tokenizers package takes the last, cJSON the first), no \u0000
    cJSON *root = lb_json_parse(json, strlen(json), name, 1, err, errlen);
    if (!root) return NULL;
    lb_tokenizer *t = calloc(1, sizeof *t);
    if (!t) {
        cJSON_Delete(root);
        fail(err, errlen, name, "out of memory");
        return NULL;
    }
    const cJSON *added = cJSON_GetObjectItemCaseSensitive(root, "added_tokens");
    const cJSON *pre = cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer");
    int rc = -1;
    if (!cJSON_IsObject(root)) {
        fail(err, errlen, name, "not a JSON object");
    } else if (added && !cJSON_IsNull(added) && !cJSON_IsArray(added)) {
        fail(err, errlen, name, "added_tokens is not a list");
    } else if (parse_normalizer(t, cJSON_GetObjectItemCaseSensitive(root, "normalizer"),
                                "normalizer", name, err, errlen) == 0 &&
               parse_model(t, root, cJSON_IsArray(added) ? added : NULL, name, err, errlen) == 0) {
        if (!pre || cJSON_IsNull(pre))
            fail(err, errlen, name, "no pre_tokenizer: only byte-level BPE (a ByteLevel "
                 "pre-tokenizer) is supported");
        else if (parse_pretok(t, pre, "pre_tokenizer", name, err, errlen) == 0) {
            int has_byte_level = 0;
            for (int i = 0; i < t->nsteps; i++) has_byte_level |= t->steps[i].byte_level;
            if (!has_byte_level)
                fail(err, errlen, name, "pre_tokenizer has no ByteLevel step: only byte-level "
                     "BPE is supported");
            else
                rc = 0;
        }
    }
    cJSON_Delete(root);
    if (rc != 0) {
        lb_tokenizer_free(t);
        return NULL;
    }
    return t;
}

char *lb_tokenizer_read(const char *path, char *err, size_t errlen)
{
    size_t n;
    char *text = lb_read_file(path, &n, err, errlen);
    if (!text) return NULL;
    // A NUL byte would end the text the parser sees, and the rest would be dropped unseen.
    if (lb_text_check(text, n, path, err, errlen) != 0) {
        free(text);
        return NULL;
    }
    return text;
}

lb_tokenizer *lb_tokenizer_load(const char *path, char *err, size_t errlen)
{
    char *text = lb_tokenizer_read(path, err, errlen);
    if (!text) return NULL;
    lb_tokenizer *t = lb_tokenizer_parse(text, path, err, errlen);
    free(text);
    return t;
}

void lb_tokenizer_free(lb_tokenizer *t)
{
    if (!t) return;
    // The vocabulary's strings are the map's; added tokens' copies are bytes[id]'s.
    for (size_t i = 0; t->vocab && i < t->vocab_cap; i++) free((char *)t->vocab[i].s);
    for (int i = 0; i < t->nids && t->bytes && t->is_added; i++)
        if (t->is_added[i]) free(t->bytes[i]);
    free(t->bytes);
    free(t->is_added);
    free(t->nbytes);
    free(t->special);
    free(t->vocab);
    free(t->merges);
    for (int i = 0; i < t->nadded; i++) free(t->added[i].s);
    free(t->added);
    for (int b = 0; b < 256; b++) free(t->added_by_byte[b]);
    for (int i = 0; i < t->nsteps; i++) pcre2_code_free(t->steps[i].re);
    free(t->steps);
    free(t);
}

int lb_tokenizer_vocab_size(const lb_tokenizer *t) { return t->nids; }

int lb_tokenizer_token_id(const lb_tokenizer *t, const char *text)
{
    size_t n = strlen(text);
    for (int i = 0; i < t->nadded; i++)
        if (t->added[i].len == n && !memcmp(t->added[i].s, text, n)) return (int)t->added[i].id;
    const str_slot *s = vocab_find(t, text, n);
    return s->s ? (int)s->id : -1;
}

// The first of names (NULL-terminated) that is an added token marked special, or -1.
static int special_named(const lb_tokenizer *t, const char *const *names)
{
    for (; *names; names++)
        for (int i = 0; i < t->nadded; i++)
            if (t->added[i].special && t->added[i].len == strlen(*names) &&
                !memcmp(t->added[i].s, *names, t->added[i].len))
                return (int)t->added[i].id;
    return -1;
}

int lb_tokenizer_eot(const lb_tokenizer *t)
{
    static const char *const names[] = {"<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>",
                                        NULL};
    return special_named(t, names);
}

int lb_tokenizer_bos(const lb_tokenizer *t)
{
    static const char *const names[] = {"<|begin_of_text|>", "<s>", "<bos>", NULL};
    return special_named(t, names);
}

// ---- encoding -----------------------------------------------------------------------------

int lb_tokens_push(lb_tokens *v, uint32_t id)
{
    if (v->n == v->cap) {
        size_t cap = v->cap ? 2 * v->cap : 256;
        uint32_t *ids = realloc(v->ids, cap * sizeof *ids);
        if (!ids) return -1;
        v->ids = ids;
        v->cap = cap;
    }
    v->ids[v->n++] = id;
    return 0;
}

void lb_tokens_free(lb_tokens *v)
{
    free(v->ids);
    *v = (lb_tokens){0};
}

// Pre-tokenized pieces: piece i is buf[i ? end[i-1] : 0, end[i]).
typedef struct {
    char *buf;
    size_t len, cap;
    size_t *end;
    size_t n, ncap;
} pieces;

static int pieces_push(pieces *p, const char *prefix, size_t np, const char *s, size_t n)
{
    if (np + n == 0) return 0;                     // tokenizers drops empty pieces
    if (p->len + np + n > p->cap) {
        size_t cap = p->cap ? p->cap : 256;
        while (cap < p->len + np + n) cap *= 2;
        char *b = realloc(p->buf, cap);
        if (!b) return -1;
        p->buf = b;
        p->cap = cap;
    }
    if (p->n == p->ncap) {
        size_t cap = p->ncap ? 2 * p->ncap : 64;
        size_t *e = realloc(p->end, cap * sizeof *e);
        if (!e) return -1;
        p->end = e;
        p->ncap = cap;
    }
    memcpy(p->buf + p->len, prefix, np);
    memcpy(p->buf + p->len + np, s, n);
    p->len += np + n;
    p->end[p->n++] = p->len;
    return 0;
}

// One segment of a Split: [start, end) and whether the regex matched it (after invert).
typedef struct {
    size_t start, end;
    int match;
} segment;

// Splits s (n bytes) by re into segments covering it: gaps and matches, as tokenizers'
// find_matches. *segs grows as needed.
static int regex_segments(const pcre2_code *re, pcre2_match_data *md, const char *s, size_t n,
                          segment **segs, size_t *nseg, size_t *segcap, char *err, size_t errlen)
{
    size_t off = 0, prev = 0;
    *nseg = 0;
    for (;;) {
        if (*nseg + 2 >= *segcap) {
            size_t cap = *segcap ? 2 * *segcap : 64;
            segment *g = realloc(*segs, cap * sizeof *g);
            if (!g) return -1;
            *segs = g;
            *segcap = cap;
        }
        if (off > n) break;
        int rc = pcre2_match(re, (PCRE2_SPTR)s, n, off, 0, md, NULL);
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT)       // a long piece: the interpreter's stack
            rc = pcre2_match(re, (PCRE2_SPTR)s, n, off, PCRE2_NO_JIT, md, NULL);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof msg);
            snprintf(err, errlen, "pre-tokenizer regex: %s", (const char *)msg);
            return -1;
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        size_t ms = ov[0], me = ov[1];
        if (prev != ms) (*segs)[(*nseg)++] = (segment){prev, ms, 0};
        (*segs)[(*nseg)++] = (segment){ms, me, 1};
        prev = me;
        if (me == ms) {                            // empty match: step over one character
            off = me + 1;
            while (off < n && ((unsigned char)s[off] & 0xC0) == 0x80) off++;
        } else {
            off = me;
        }
    }
    if (prev < n) {
        (*segs)[(*nseg)++] = (segment){prev, n, 0};
    }
    return 0;
}

// A candidate merge of the symbol at pos with the one after it (nxt), as they were when pushed.
typedef struct {
    uint32_t rank, pos, nxt, a, b;
} merge_cand;

typedef struct {
    pieces a, b;                 // the pieces before and after a step
    segment *segs;
    size_t segcap;
    pcre2_match_data **md;       // per step
    uint32_t *sym;               // BPE symbols of one piece (3 x symcap)
    merge_cand *heap;            // BPE's merge candidates (3 x symcap)
    size_t symcap;
} encode_ctx;

static int apply_step(const pretok_step *st, pcre2_match_data *md, encode_ctx *c, char *err,
                      size_t errlen)
{
    pieces *in = &c->a, *out = &c->b;
    out->len = out->n = 0;
    for (size_t i = 0; i < in->n; i++) {
        const char *s = in->buf + (i ? in->end[i - 1] : 0);
        size_t n = in->end[i] - (i ? in->end[i - 1] : 0);
        const char *prefix = "";
        size_t np = 0;
        if (st->byte_level && st->add_prefix_space && s[0] != ' ') {
            prefix = " ";
            np = 1;
        }
        if (!st->re) {
            if (pieces_push(out, prefix, np, s, n) != 0) goto oom;
            continue;
        }
        // The prefix space is part of what the regex sees: split a copy.
        char *tmp = NULL;
        if (np) {
            tmp = malloc(n + 1);
            if (!tmp) goto oom;
            tmp[0] = ' ';
            memcpy(tmp + 1, s, n);
            s = tmp;
            n++;
        }
        size_t nseg;
        int rc = regex_segments(st->re, md, s, n, &c->segs, &nseg, &c->segcap, err, errlen);
        if (rc != 0) {
            free(tmp);
            if (!err[0]) goto oom;
            return -1;
        }
        segment *g = c->segs;
        if (st->invert)
            for (size_t k = 0; k < nseg; k++) g[k].match = !g[k].match;
        size_t cut = 0;                            // start of the piece being built
        for (size_t k = 0; k < nseg && rc == 0; k++) {
            switch (st->behavior) {
            case SPLIT_ISOLATED:
                rc = pieces_push(out, "", 0, s + g[k].start, g[k].end - g[k].start);
                break;
            case SPLIT_REMOVED:
                if (!g[k].match) rc = pieces_push(out, "", 0, s + g[k].start, g[k].end - g[k].start);
                break;
            case SPLIT_MERGED_PREV:                // a match ends the piece
                if (g[k].match) {
                    rc = pieces_push(out, "", 0, s + cut, g[k].end - cut);
                    cut = g[k].end;
                }
                break;
            case SPLIT_MERGED_NEXT:                // a match starts a piece
                if (g[k].match) {
                    rc = pieces_push(out, "", 0, s + cut, g[k].start - cut);
                    cut = g[k].start;
                }
                break;
            case SPLIT_CONTIGUOUS:                 // runs of matches join
                if (!g[k].match || k + 1 == nseg || !g[k + 1].match) {
                    rc = pieces_push(out, "", 0, s + cut, g[k].end - cut);
                    cut = g[k].end;
                }
                break;
            }
        }
        if (rc == 0 && (st->behavior == SPLIT_MERGED_PREV || st->behavior == SPLIT_MERGED_NEXT))
            rc = pieces_push(out, "", 0, s + cut, n - cut);
        free(tmp);
        if (rc != 0) goto oom;
    }
    pieces t = *in;                                // the output is the next step's input
    *in = *out;
    *out = t;
    return 0;
oom:
    snprintf(err, errlen, "out of memory");
    return -1;
}

static int cand_less(const merge_cand *x, const merge_cand *y)
{
    return x->rank < y->rank || (x->rank == y->rank && x->pos < y->pos);
}

static void heap_push(merge_cand *h, size_t *n, merge_cand c)
{
    size_t i = (*n)++;
    while (i && cand_less(&c, &h[(i - 1) / 2])) {
        h[i] = h[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    h[i] = c;
}

static merge_cand heap_pop(merge_cand *h, size_t *n)
{
    merge_cand top = h[0], last = h[--*n];
    size_t i = 0;
    for (;;) {
        size_t k = 2 * i + 1;
        if (k >= *n) break;
        if (k + 1 < *n && cand_less(&h[k + 1], &h[k])) k++;
        if (!cand_less(&h[k], &last)) break;
        h[i] = h[k];
        i = k;
    }
    if (*n) h[i] = last;
    return top;
}

// BPE of one piece: start from its bytes, merge the adjacent pair of lowest rank (leftmost on
// ties) until no pair has a merge. A heap of candidates (stale ones skipped when popped) keeps a
// long piece (a run of spaces) at n log n, as tokenizers' merge queue does.
static int bpe_piece(const lb_tokenizer *t, encode_ctx *c, const char *s, size_t n,
                     lb_tokens *out)
{
    if (t->ignore_merges) {
        const str_slot *w = vocab_find(t, s, n);
        if (w->s) return lb_tokens_push(out, w->id);
    }
    if (n > c->symcap) {
        free(c->sym);
        free(c->heap);
        c->sym = malloc(3 * n * sizeof *c->sym);       // id, prev + 1, next (n = none)
        c->heap = malloc(3 * n * sizeof *c->heap);     // at most n - 1 + 2 per merge
        if (!c->sym || !c->heap) {
            c->symcap = 0;
            return -1;
        }
        c->symcap = n;
    }
    uint32_t *id = c->sym, *prev = c->sym + n, *next = c->sym + 2 * n;
    merge_cand *h = c->heap;
    size_t nh = 0;
    for (size_t i = 0; i < n; i++) {
        id[i] = t->byte_id[(unsigned char)s[i]];
        prev[i] = (uint32_t)i;                         // prev + 1: 0 = none
        next[i] = (uint32_t)(i + 1);
    }
    for (size_t i = 0; i + 1 < n; i++) {
        const pair_slot *p = merge_find(t, id[i], id[i + 1]);
        if (p->key) heap_push(h, &nh, (merge_cand){p->rank, (uint32_t)i, (uint32_t)i + 1, id[i], id[i + 1]});
    }
    while (nh) {
        merge_cand m = heap_pop(h, &nh);
        if (id[m.pos] != m.a || next[m.pos] != m.nxt || id[m.nxt] != m.b) continue;   // stale
        id[m.pos] = merge_find(t, m.a, m.b)->id;
        id[m.nxt] = UINT32_MAX;                        // dead
        next[m.pos] = next[m.nxt];
        if (next[m.pos] < n) prev[next[m.pos]] = m.pos + 1;
        if (prev[m.pos]) {
            uint32_t l = prev[m.pos] - 1;
            const pair_slot *p = merge_find(t, id[l], id[m.pos]);
            if (p->key) heap_push(h, &nh, (merge_cand){p->rank, l, m.pos, id[l], id[m.pos]});
        }
        if (next[m.pos] < n) {
            uint32_t r = next[m.pos];
            const pair_slot *p = merge_find(t, id[m.pos], id[r]);
            if (p->key) heap_push(h, &nh, (merge_cand){p->rank, m.pos, r, id[m.pos], id[r]});
        }
    }
    for (size_t i = 0; i < n; i = next[i])
        if (lb_tokens_push(out, id[i]) != 0) return -1;
    return 0;
}

// A stretch of text between added tokens: normalize, pre-tokenize, BPE.
static int encode_segment(const lb_tokenizer *t, encode_ctx *c, const char *s, size_t n,
                          lb_tokens *out, char *err, size_t errlen)
{
    if (n == 0) return 0;
    utf8proc_uint8_t *norm = NULL;
    if (t->nfc) {
        utf8proc_ssize_t k = utf8proc_map((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, &norm,
                                          UTF8PROC_STABLE | UTF8PROC_COMPOSE);
        if (k < 0) {
            snprintf(err, errlen, "NFC normalizer: %s", utf8proc_errmsg(k));
            return -1;
        }
        s = (const char *)norm;
        n = (size_t)k;
    }
    c->a.len = c->a.n = 0;
    int rc = pieces_push(&c->a, "", 0, s, n);
    free(norm);
    if (rc != 0) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    for (int i = 0; i < t->nsteps; i++)
        if (apply_step(&t->steps[i], c->md[i], c, err, errlen) != 0) return -1;
    for (size_t i = 0; i < c->a.n; i++) {
        size_t b = i ? c->a.end[i - 1] : 0;
        if (bpe_piece(t, c, c->a.buf + b, c->a.end[i] - b, out) != 0) {
            snprintf(err, errlen, "out of memory");
            return -1;
        }
    }
    return 0;
}

static int is_space(char ch)
{
    return ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r' || ch == '\v' || ch == '\f';
}

// The added token at text[pos] (longest first), or -1.
static int added_at(const lb_tokenizer *t, const char *text, size_t len, size_t pos)
{
    unsigned char b = (unsigned char)text[pos];
    for (int k = 0; k < t->added_count[b]; k++) {
        const added_token *a = &t->added[t->added_by_byte[b][k]];
        if (a->len <= len - pos && !memcmp(text + pos, a->s, a->len)) return t->added_by_byte[b][k];
    }
    return -1;
}

int lb_tokenizer_encode(const lb_tokenizer *t, const char *text, size_t len, lb_tokens *out,
                        char *err, size_t errlen)
{
    encode_ctx c = {0};
    int rc = -1;
    err[0] = 0;
    c.md = calloc((size_t)t->nsteps + 1, sizeof *c.md);
    if (!c.md) goto done;
    for (int i = 0; i < t->nsteps; i++)
        if (t->steps[i].re && !(c.md[i] = pcre2_match_data_create_from_pattern(t->steps[i].re, NULL)))
            goto done;
    size_t seg = 0, pos = 0;
    while (pos < len) {
        int k = t->added_count[(unsigned char)text[pos]] ? added_at(t, text, len, pos) : -1;
        if (k < 0) {
            pos++;
            continue;
        }
        const added_token *a = &t->added[k];
        size_t ms = pos, me = pos + a->len;
        if (a->lstrip)
            while (ms > seg && is_space(text[ms - 1])) ms--;
        if (a->rstrip)
            while (me < len && is_space(text[me])) me++;
        if (encode_segment(t, &c, text + seg, ms - seg, out, err, errlen) != 0) goto done;
        if (lb_tokens_push(out, a->id) != 0) goto done;
        seg = pos = me;
    }
    if (encode_segment(t, &c, text + seg, len - seg, out, err, errlen) != 0) goto done;
    rc = 0;
done:
    if (rc != 0 && !err[0]) snprintf(err, errlen, "out of memory");
    for (int i = 0; c.md && i < t->nsteps; i++) pcre2_match_data_free(c.md[i]);
    free(c.md);
    free(c.a.buf);
    free(c.a.end);
    free(c.b.buf);
    free(c.b.end);
    free(c.segs);
    free(c.sym);
    free(c.heap);
    return rc;
}

// ---- decoding -----------------------------------------------------------------------------

char *lb_tokenizer_decode(const lb_tokenizer *t, const uint32_t *ids, size_t n, int skip_special,
                          size_t *len, char *err, size_t errlen)
{
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] >= (uint32_t)t->nids || !t->bytes[ids[i]]) {
            snprintf(err, errlen, "token %zu: id %u has no token (vocabulary of %d)", i, ids[i],
                     t->nids);
            return NULL;
        }
        if (!(skip_special && t->special[ids[i]])) total += t->nbytes[ids[i]];
    }
    char *s = malloc(total + 1);
    if (!s) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (skip_special && t->special[ids[i]]) continue;
        memcpy(s + k, t->bytes[ids[i]], t->nbytes[ids[i]]);
        k += t->nbytes[ids[i]];
    }
    s[k] = 0;
    if (len) *len = k;
    return s;
}
