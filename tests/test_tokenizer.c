// test_tokenizer.c: the byte-level BPE tokenizer against ids from the `tokenizers` package
// (tests/data/tok_kjv, made by tests/tools/make_tokenizer.py), round trips of arbitrary bytes,
// and the errors for malformed tokenizer.json files.
#include <cJSON.h>
#include <unistd.h>
#include "src/io/files.h"
#include "src/io/tokenizer.h"
#include "tests/testutil.h"

static cJSON *read_json(const char *rel)
{
    char err[512];
    size_t n;
    char *text = lb_read_file(lb_test_src(rel), &n, err, sizeof err);
    ck_assert_msg(text, "%s", err);
    cJSON *j = cJSON_Parse(text);
    free(text);
    ck_assert_msg(j, "%s: not JSON", rel);
    return j;
}

// The edits of a golden variant, as make_tokenizer.py's apply_variant makes them.
static cJSON *apply_variant(const cJSON *doc, const cJSON *v)
{
    cJSON *d = cJSON_Duplicate(doc, 1);
    cJSON *model = cJSON_GetObjectItemCaseSensitive(d, "model");
    const cJSON *e;
    cJSON_ArrayForEach(e, v) {
        if (!strcmp(e->string, "model.ignore_merges")) {
            cJSON_ReplaceItemInObjectCaseSensitive(model, "ignore_merges", cJSON_Duplicate(e, 1));
        } else if (!strcmp(e->string, "merges_form")) {
            cJSON *merges = cJSON_GetObjectItemCaseSensitive(model, "merges"), *m;
            cJSON *str = cJSON_CreateArray();
            cJSON_ArrayForEach(m, merges) {
                char buf[1024];
                snprintf(buf, sizeof buf, "%s %s", cJSON_GetArrayItem(m, 0)->valuestring,
                         cJSON_GetArrayItem(m, 1)->valuestring);
                cJSON_AddItemToArray(str, cJSON_CreateString(buf));
            }
            cJSON_ReplaceItemInObjectCaseSensitive(model, "merges", str);
        } else if (!strcmp(e->string, "added_tokens_extra")) {
            int nid = 0;
            const cJSON *x;
            cJSON_ArrayForEach(x, cJSON_GetObjectItemCaseSensitive(model, "vocab"))
                if (x->valueint >= nid) nid = x->valueint + 1;
            cJSON *added = cJSON_GetObjectItemCaseSensitive(d, "added_tokens");
            cJSON_ArrayForEach(x, added) {
                int id = cJSON_GetObjectItemCaseSensitive(x, "id")->valueint;
                if (id >= nid) nid = id + 1;
            }
            cJSON_ArrayForEach(x, e) {
                cJSON *a = cJSON_Duplicate(x, 1);
                cJSON_AddNumberToObject(a, "id", nid++);
                cJSON_AddItemToArray(added, a);
            }
        } else {
            cJSON_ReplaceItemInObjectCaseSensitive(d, e->string, cJSON_Duplicate(e, 1));
        }
    }
    return d;
}

static lb_tokenizer *parse_doc(const cJSON *doc, const char *name, char *err, size_t errlen)
{
    char *text = cJSON_PrintUnformatted(doc);
    lb_tokenizer *t = lb_tokenizer_parse(text, name, err, errlen);
    free(text);
    return t;
}

START_TEST(golden_ids)
{
    cJSON *doc = read_json("tests/data/tok_kjv/tokenizer.json");
    cJSON *golden = read_json("tests/data/tok_kjv/golden.json");
    const cJSON *variants = cJSON_GetObjectItemCaseSensitive(golden, "variants"), *v;
    int checked = 0, failed = 0;
    cJSON_ArrayForEach(v, variants) {
        char err[1024];
        cJSON *d = apply_variant(doc, v);
        lb_tokenizer *t = parse_doc(d, v->string, err, sizeof err);
        cJSON_Delete(d);
        ck_assert_msg(t, "%s", err);
        const cJSON *c;
        cJSON_ArrayForEach(c, cJSON_GetObjectItemCaseSensitive(golden, "cases")) {
            if (strcmp(cJSON_GetObjectItemCaseSensitive(c, "variant")->valuestring, v->string))
                continue;
            const char *text = cJSON_GetObjectItemCaseSensitive(c, "text")->valuestring;
            const cJSON *ids = cJSON_GetObjectItemCaseSensitive(c, "ids");
            lb_tokens got = {0};
            ck_assert_msg(lb_tokenizer_encode(t, text, strlen(text), &got, err, sizeof err) == 0,
                          "%s", err);
            int n = cJSON_GetArraySize(ids), same = (size_t)n == got.n;
            for (int i = 0; same && i < n; i++)
                same = got.ids[i] == (uint32_t)cJSON_GetArrayItem(ids, i)->valueint;
            if (!same) {
                fprintf(stderr, "%s: \"%s\": %zu ids, tokenizers gives %d:", v->string, text,
                        got.n, n);
                for (size_t i = 0; i < got.n; i++) fprintf(stderr, " %u", got.ids[i]);
                fprintf(stderr, "\n");
                failed++;
            }
            for (int skip = 0; skip < 2; skip++) {
                const char *want =
                    cJSON_GetObjectItemCaseSensitive(c, skip ? "decoded_skip" : "decoded")
                        ->valuestring;
                size_t len;
                char *dec = lb_tokenizer_decode(t, got.ids, got.n, skip, &len, err, sizeof err);
                ck_assert_msg(dec, "%s", err);
                if (len != strlen(want) || memcmp(dec, want, len)) {
                    fprintf(stderr, "%s: \"%s\": decoded (skip_special %d) \"%s\", tokenizers "
                            "gives \"%s\"\n", v->string, text, skip, dec, want);
                    failed++;
                }
                free(dec);
            }
            lb_tokens_free(&got);
            checked++;
        }
        lb_tokenizer_free(t);
    }
    cJSON_Delete(golden);
    cJSON_Delete(doc);
    ck_assert_int_ge(checked, 50);
    ck_assert_msg(failed == 0, "%d of %d golden cases differ", failed, checked);
}
END_TEST

// Any bytes (invalid UTF-8 too) encode and decode back exactly without a normalizer; with NFC,
// invalid UTF-8 is an error rather than a silent change.
START_TEST(round_trip_any_bytes)
{
    cJSON *doc = read_json("tests/data/tok_kjv/tokenizer.json");
    char err[1024];
    lb_tokenizer *nfc = parse_doc(doc, "main", err, sizeof err);
    ck_assert_msg(nfc, "%s", err);
    cJSON_ReplaceItemInObjectCaseSensitive(doc, "normalizer", cJSON_CreateNull());
    lb_tokenizer *t = parse_doc(doc, "raw", err, sizeof err);
    ck_assert_msg(t, "%s", err);
    char buf[4096];
    uint64_t x = 12345;
    for (int trial = 0; trial < 50; trial++) {
        size_t n = (size_t)(trial * 80);
        for (size_t i = 0; i < n; i++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            buf[i] = (char)(trial % 2 ? (char)(x >> 56) : " aeht\n\xc3\xa9\xff<|>"[(x >> 40) % 12]);
        }
        lb_tokens ids = {0};
        ck_assert_msg(lb_tokenizer_encode(t, buf, n, &ids, err, sizeof err) == 0, "%s", err);
        size_t len;
        char *dec = lb_tokenizer_decode(t, ids.ids, ids.n, 0, &len, err, sizeof err);
        ck_assert_msg(dec, "%s", err);
        ck_assert_uint_eq(len, n);
        ck_assert_msg(memcmp(dec, buf, n) == 0, "trial %d does not round-trip", trial);
        free(dec);
        lb_tokens_free(&ids);
    }
    lb_tokens ids = {0};
    ck_assert_int_ne(lb_tokenizer_encode(nfc, "ok \xff bad", 8, &ids, err, sizeof err), 0);
    ck_assert_msg(strstr(err, "NFC"), "%s", err);
    lb_tokens_free(&ids);
    // An id past the vocabulary does not decode.
    uint32_t bad = (uint32_t)lb_tokenizer_vocab_size(t);
    ck_assert_ptr_null(lb_tokenizer_decode(t, &bad, 1, 0, NULL, err, sizeof err));
    ck_assert_msg(strstr(err, "has no token"), "%s", err);
    ck_assert_int_eq(lb_tokenizer_token_id(t, "<|endoftext|>"), 4096);
    ck_assert_int_eq(lb_tokenizer_token_id(t, "a"), 64);
    ck_assert_int_eq(lb_tokenizer_token_id(t, "no such token anywhere"), -1);
    lb_tokenizer_free(t);
    lb_tokenizer_free(nfc);
    cJSON_Delete(doc);
}
END_TEST

// One malformed file: an edit of the KJV tokenizer, and the words its error must hold.
typedef struct {
    const char *what;            // path of the edit
    const char *json;            // the new value (NULL: delete the key)
    const char *expect;
} breakage;

static cJSON *at_path(cJSON *doc, const char *path, char *last, size_t lastlen)
{
    // "model.merges.0": objects by key, arrays by index; returns the parent of the last part.
    char buf[256];
    snprintf(buf, sizeof buf, "%s", path);
    cJSON *cur = doc;
    char *part = strtok(buf, "."), *next;
    while ((next = strtok(NULL, "."))) {
        cur = cJSON_IsArray(cur) ? cJSON_GetArrayItem(cur, atoi(part))
                                 : cJSON_GetObjectItemCaseSensitive(cur, part);
        ck_assert_msg(cur, "no %s in the test tokenizer", path);
        part = next;
    }
    snprintf(last, lastlen, "%s", part);
    return cur;
}

START_TEST(malformed_files)
{
    static const breakage cases[] = {
        {"model", NULL, "no \"model\" object"},
        {"model.type", "\"WordPiece\"", "model.type \"WordPiece\" is not supported"},
        {"model.vocab", NULL, "model.vocab is missing"},
        {"model.merges", "{}", "model.merges is missing or not a list"},
        {"model.merges.0", "\"th\"", "model.merges[0]: bad merge (expected"},
        {"model.merges.1", "[\"zzzz\", \"e\"]", "model.merges[1]: bad merge: \"zzzz\" is not"},
        {"model.merges.2", "[\"q\", \"q\"]", "model.merges[2]: bad merge: \"qq\" (the merged"},
        {"model.merges.3", "[\"a\"]", "model.merges[3]: bad merge"},
        {"model.vocab.a", "-1", "model.vocab[\"a\"]: id is not an integer"},
        {"model.vocab.a", "1e9", "model.vocab[\"a\"]: id is not an integer"},
        {"model.vocab.a", "65", "model.vocab: id 65 is given to two tokens"},
        {"model.vocab.Ā", NULL, "no token for byte 0x00"},
        {"model.dropout", "0.1", "dropout is not supported"},
        {"added_tokens.0.id", "100000000", "added_tokens[0]: needs an \"id\" in [0,"},
        {"added_tokens.1.content", "\"<|endoftext|>\"", "\"<|endoftext|>\" is already added_tokens[0]"},
        {"added_tokens.0.single_word", "true", "single_word is not supported"},
        {"added_tokens.1.id", "4096", "id 4096 is already an added token's"},
        {"pre_tokenizer.pretokenizers.0.pattern.Regex", "\"(unclosed\"", "bad regex at offset"},
        {"pre_tokenizer.pretokenizers.0.behavior", "\"Sideways\"", "\"behavior\" must be"},
        {"pre_tokenizer.pretokenizers.1.type", "\"Whitespace\"", "\"Whitespace\" is not supported"},
        {"pre_tokenizer.pretokenizers.1", "{\"type\": \"Split\", \"pattern\": {\"String\": \" \"}, "
         "\"behavior\": \"Removed\", \"invert\": false}", "no ByteLevel step"},
        {"pre_tokenizer", NULL, "no pre_tokenizer"},
        {"normalizer", "{\"type\": \"NFKC\"}", "normalizer \"NFKC\" is not supported"},
    };
    cJSON *doc = read_json("tests/data/tok_kjv/tokenizer.json");
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        cJSON *d = cJSON_Duplicate(doc, 1);
        char last[64], err[1024] = "";
        cJSON *parent = at_path(d, cases[i].what, last, sizeof last);
        cJSON *val = cases[i].json ? cJSON_Parse(cases[i].json) : NULL;
        if (cases[i].json) ck_assert_ptr_nonnull(val);
        if (cJSON_IsArray(parent)) {
            cJSON_ReplaceItemInArray(parent, atoi(last), val);
        } else if (val) {
            if (cJSON_GetObjectItemCaseSensitive(parent, last))
                cJSON_ReplaceItemInObjectCaseSensitive(parent, last, val);
            else
                cJSON_AddItemToObject(parent, last, val);
        } else {
            cJSON_DeleteItemFromObjectCaseSensitive(parent, last);
        }
        lb_tokenizer *t = parse_doc(d, "bad.json", err, sizeof err);
        cJSON_Delete(d);
        ck_assert_msg(!t, "%s = %s loaded", cases[i].what, cases[i].json);
        ck_assert_msg(!strncmp(err, "bad.json: ", 10) && strstr(err, cases[i].expect),
                      "%s: got \"%s\", want \"%s\"", cases[i].what, err, cases[i].expect);
    }
    cJSON_Delete(doc);
    char err[1024];
    ck_assert_ptr_null(lb_tokenizer_parse("{\"model\": ", "cut.json", err, sizeof err));
    ck_assert_msg(strstr(err, "cut.json:1: not valid JSON"), "%s", err);
    // Bytes after the JSON value were dropped unseen before: refused, naming the file.
    ck_assert_ptr_null(lb_tokenizer_parse("{\"model\": {}}\n x", "more.json", err, sizeof err));
    ck_assert_msg(strstr(err, "more.json:2: bytes after the JSON value (byte 15)"), "%s", err);
    // A key twice: the tokenizers package takes the last, cJSON the first: refused, with the
    // line of the second; a NUL escape would cut a token's text
    ck_assert_ptr_null(lb_tokenizer_parse("{\"model\": {},\n \"model\": {\"type\": \"BPE\"}}",
                                          "dup.json", err, sizeof err));
    ck_assert_msg(strstr(err, "dup.json:2: key \"model\" twice in one object"), "%s", err);
    ck_assert_ptr_null(lb_tokenizer_parse("{\"model\": {\"vocab\": {\"a\\u0000b\": 0}}}",
                                          "nul.json", err, sizeof err));
    ck_assert_msg(strstr(err, "nul.json:1: a NUL character (\\u0000) in a string"), "%s", err);
    // So was all after a NUL byte: the KJV tokenizer, a NUL and a second JSON object.
    char tmp[] = "/tmp/lowbit-tok-XXXXXX";
    int fd = mkstemp(tmp);
    ck_assert_int_ge(fd, 0);
    FILE *f = fdopen(fd, "wb"), *kjv = fopen(lb_test_src("tests/data/tok_kjv/tokenizer.json"), "rb");
    ck_assert(f && kjv);
    for (int ch; (ch = fgetc(kjv)) != EOF;) fputc(ch, f);
    fclose(kjv);
    fwrite("\0{}", 1, 3, f);
    fclose(f);
    ck_assert_ptr_null(lb_tokenizer_load(tmp, err, sizeof err));
    ck_assert_msg(strstr(err, ": a NUL byte (offset ") && !strncmp(err, tmp, strlen(tmp)), "%s",
                  err);
    unlink(tmp);
    ck_assert_ptr_null(lb_tokenizer_load("/nonexistent/tokenizer.json", err, sizeof err));
    ck_assert_msg(strstr(err, "/nonexistent/tokenizer.json: "), "%s", err);
}
END_TEST

// An added token on an id the vocabulary has too (GPT-2's <|endoftext|>): the id decodes to the
// added content, and the vocabulary's entry still encodes to it.
START_TEST(added_token_on_vocab_id)
{
    cJSON *doc = read_json("tests/data/tok_kjv/tokenizer.json");
    char err[1024];
    lb_tokenizer *plain = parse_doc(doc, "plain", err, sizeof err);
    ck_assert_msg(plain, "%s", err);
    uint32_t id = 300;
    size_t vlen;
    char *vocab_bytes = lb_tokenizer_decode(plain, &id, 1, 0, &vlen, err, sizeof err);
    ck_assert_ptr_nonnull(vocab_bytes);
    cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(doc, "added_tokens"),
                         cJSON_Parse("{\"id\": 300, \"content\": \"<sep>\", \"special\": true}"));
    lb_tokenizer *t = parse_doc(doc, "shared", err, sizeof err);
    ck_assert_msg(t, "%s", err);
    size_t len;
    char *dec = lb_tokenizer_decode(t, &id, 1, 0, &len, err, sizeof err);
    ck_assert_str_eq(dec, "<sep>");
    free(dec);
    ck_assert_int_eq(lb_tokenizer_token_id(t, "<sep>"), 300);
    ck_assert_int_eq(lb_tokenizer_token_id(t, vocab_bytes), 300);
    lb_tokens a = {0}, b = {0};
    ck_assert_int_eq(lb_tokenizer_encode(t, vocab_bytes, vlen, &a, err, sizeof err), 0);
    ck_assert_int_eq(lb_tokenizer_encode(plain, vocab_bytes, vlen, &b, err, sizeof err), 0);
    ck_assert_uint_eq(a.n, b.n);
    ck_assert_int_eq(memcmp(a.ids, b.ids, a.n * sizeof *a.ids), 0);
    ck_assert_int_eq(lb_tokenizer_encode(t, "x<sep>y", 7, &a, err, sizeof err), 0);
    int found = 0;
    for (size_t i = b.n; i < a.n; i++) found += a.ids[i] == 300;
    ck_assert_int_eq(found, 1);
    lb_tokens_free(&a);
    lb_tokens_free(&b);
    free(vocab_bytes);
    lb_tokenizer_free(t);
    lb_tokenizer_free(plain);
    cJSON_Delete(doc);
}
END_TEST

static Suite *tokenizer_suite(void)
{
    Suite *s = suite_create("tokenizer");
    TCase *tc = tcase_create("tokenizer");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, golden_ids);
    tcase_add_test(tc, round_trip_any_bytes);
    tcase_add_test(tc, malformed_files);
    tcase_add_test(tc, added_token_on_vocab_id);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) { return lb_test_run(tokenizer_suite()); }
