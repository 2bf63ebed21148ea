// fuzz_tokenizer.c: the tokenizer.json reader (lb_tokenizer_load), as `lowbit data tokenize`
// reads it; an accepted tokenizer then encodes a few texts (ASCII, UTF-8, invalid UTF-8, an
// added token, the input's own first bytes), and decodes them and every id. Every id encode
// gives must lie below vocab_size and decode; an id past vocab_size must be refused (an id
// between that no token holds may be).
#include "src/io/tokenizer.h"
#include "tests/fuzz/fuzz.h"

static void encode_decode(const lb_tokenizer *t, const char *text, size_t len)
{
    char err[1024] = "";
    lb_tokens ids = {0};
    if (lb_tokenizer_encode(t, text, len, &ids, err, sizeof err) == 0) {
        int n = lb_tokenizer_vocab_size(t);
        for (size_t i = 0; i < ids.n; i++)
            if (ids.ids[i] >= (uint32_t)n) {
                fprintf(stderr, "fuzz: id %u of vocab_size %d\n", ids.ids[i], n);
                abort();
            }
        size_t got;
        char *back = lb_tokenizer_decode(t, ids.ids, ids.n, 0, &got, err, sizeof err);
        if (!back) {
            fprintf(stderr, "fuzz: an encoded text does not decode: %s\n", err);
            abort();
        }
        free(back);
    }
    lb_tokens_free(&ids);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[1024] = "";
    const char *path = lb_fuzz_file(data, size, ".json");
    lb_tokenizer *t = lb_tokenizer_load(path, err, sizeof err);
    if (!t) {
        lb_fuzz_names(err, path);
        lb_fuzz_accepted = 0;
        return 0;
    }
    static const char *texts[] = {
        "In the beginning God created the heaven and the earth.\n\n",
        "caf\xc3\xa9 \xe2\x82\xac 123456 \t  x  \r\n",
        "ok \xff\xfe bad \xc3",
        "<|endoftext|>a<|im_start|><think>\n",
        "",
    };
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++)
        encode_decode(t, texts[i], strlen(texts[i]));
    encode_decode(t, (const char *)data, size < 512 ? size : 512);   // any bytes, NULs too
    // Every id, alone and with special tokens skipped (a gap in the ids is refused).
    int n = lb_tokenizer_vocab_size(t);
    if (n < 1) {
        fprintf(stderr, "fuzz: an accepted tokenizer of vocab_size %d\n", n);
        abort();
    }
    for (int i = 0; i < n; i++) {
        uint32_t id = (uint32_t)i;
        size_t got;
        for (int skip = 0; skip < 2; skip++) free(lb_tokenizer_decode(t, &id, 1, skip, &got, err,
                                                                      sizeof err));
    }
    uint32_t past = (uint32_t)n;
    char *s = lb_tokenizer_decode(t, &past, 1, 0, NULL, err, sizeof err);
    if (s) {
        fprintf(stderr, "fuzz: id %d, past vocab_size, decodes\n", n);
        abort();
    }
    lb_tokenizer_free(t);
    lb_fuzz_accepted = 1;
    return 0;
}
