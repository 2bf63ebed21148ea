// tokenizer.h: byte-level BPE read from a Hugging Face tokenizer.json (GPT-2, Llama 3, Qwen2/3).
//
// Encoding follows `tokenizers`: added and special tokens are split out first (exact match,
// leftmost-longest), the rest is normalized (none or NFC), pre-tokenized (Split with a regex,
// ByteLevel, or a Sequence of them) and each piece is merged by the BPE ranks. The
// post-processor (BOS/EOS templates) is not applied: ids are those of
// `encode(text, add_special_tokens=False)`. doc/data.md lists what is refused.
#ifndef LB_TOKENIZER_H
#define LB_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

typedef struct lb_tokenizer lb_tokenizer;

// A growable array of token ids (encode appends to it).
typedef struct {
    uint32_t *ids;
    size_t n, cap;
} lb_tokens;

// Reads tokenizer.json. NULL with "PATH: what is wrong" in err.
lb_tokenizer *lb_tokenizer_load(const char *path, char *err, size_t errlen);
// The text of a tokenizer.json file (malloc'd), refused with a NUL byte in it, which would end
// the text the parser (and a checkpoint's metadata string) sees. NULL with a message.
char *lb_tokenizer_read(const char *path, char *err, size_t errlen);
// The same from JSON text already in memory; name is used in messages.
lb_tokenizer *lb_tokenizer_parse(const char *json, const char *name, char *err, size_t errlen);
void lb_tokenizer_free(lb_tokenizer *t);

// One more than the largest id (model vocabulary and added tokens).
int lb_tokenizer_vocab_size(const lb_tokenizer *t);
// The id of a token given by its text (an added token's content, or a vocabulary entry as raw
// bytes), or -1.
int lb_tokenizer_token_id(const lb_tokenizer *t, const char *text);
// The end-of-text token, where a completion stops and a document ends, or -1. tokenizer.json
// does not say which token that is (tokenizer_config.json's eos_token does), so (2026-12-07)
// it is the first added token marked special among the names the families read here give it:
// <|endoftext|> (GPT-2, Qwen2/3 base), <|end_of_text|> (Llama 3), </s> (Llama 2, Mistral),
// <eos> (Gemma). The chat models' end of turn (<|im_end|>, <|eot_id|>) is not the end of text.
int lb_tokenizer_eot(const lb_tokenizer *t);
// The beginning-of-text token the same way: <|begin_of_text|>, <s>, <bos>; -1 when none (GPT-2
// and Qwen have none of their own).
int lb_tokenizer_bos(const lb_tokenizer *t);

// Appends the ids of text (len bytes, any bytes: invalid UTF-8 falls between regex matches and
// is still encoded byte by byte). Returns 0, or -1 with a message.
int lb_tokenizer_encode(const lb_tokenizer *t, const char *text, size_t len, lb_tokens *out,
                        char *err, size_t errlen);
// The bytes of ids (malloc'd, NUL-terminated, *len without the NUL). skip_special drops added
// tokens marked special. Unlike `tokenizers`, which replaces invalid UTF-8 by U+FFFD, the bytes
// come back exactly, so a completion cut mid-character still concatenates right. NULL with a
// message for an id without a token.
char *lb_tokenizer_decode(const lb_tokenizer *t, const uint32_t *ids, size_t n, int skip_special,
                          size_t *len, char *err, size_t errlen);

// Appends one id. 0, or -1 out of memory.
int lb_tokens_push(lb_tokens *v, uint32_t id);
void lb_tokens_free(lb_tokens *v);

#endif
