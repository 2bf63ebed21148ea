// data.h: token shards in llm.c's format, the batch loader, and the corpus generators.
//
// A shard is a header of 256 int32 (magic 20240520, version, token count, rest zero) followed by
// the tokens: uint16 in version 1 (llm.c), uint32 in version 2 (vocabularies over 65536).
#ifndef LB_DATA_H
#define LB_DATA_H

#include <stddef.h>
#include <stdint.h>

#define LB_SHARD_MAGIC 20240520
#define LB_SHARD_HEADER_INTS 256

// Writes a shard atomically (temporary name, fsync, rename), version 1 when every token fits
// in uint16, else version 2. Returns 0, or -1 with a message in err.
int lb_shard_write(const char *path, const uint32_t *tokens, size_t n, char *err, size_t errlen);

// Reads a whole shard (checks magic, version, size). *tokens is malloc'd.
int lb_shard_read(const char *path, uint32_t **tokens, size_t *n, char *err, size_t errlen);

// Sequential loader over the shards matching a glob (sorted by name), as llm.c: each batch is
// b*t+1 consecutive tokens; inputs are the first b*t, targets the last b*t; the position
// advances by b*t; a shard too short for the next batch moves to the next shard, and the last
// wraps to the first. Tokens >= vocab_size are an error naming the shard and offset.
typedef struct lb_loader lb_loader;

lb_loader *lb_loader_open(const char *pattern, int b, int t, int vocab_size, char *err,
                          size_t errlen);
// Fills inputs and targets (b*t each). Returns 0, or -1 with a message.
int lb_loader_next(lb_loader *l, int32_t *inputs, int32_t *targets, char *err, size_t errlen);
// Moves past n batches exactly as n calls of next would, without reading them (data-parallel
// ranks skip the batches of the other ranks).
void lb_loader_skip(lb_loader *l, int n);
void lb_loader_reset(lb_loader *l);
// Position, for checkpoints: shard index and token offset. A sequence loader (below) reports
// shard -1 and, as pos, the number of sequences it has drawn; seek takes the same pair and
// refuses a position of the other kind of loader.
void lb_loader_tell(const lb_loader *l, int64_t *shard, int64_t *pos);
int lb_loader_seek(lb_loader *l, int64_t shard, int64_t pos, char *err, size_t errlen);
int lb_loader_nshards(const lb_loader *l);
int64_t lb_loader_tokens(const lb_loader *l);   // in all shards, from the headers
// Reads shard s (0 .. nshards-1) whole and checks it against its header and every token
// against the vocabulary: open checks only the headers, this the contents, before the first
// step (lb_run_check_shards spreads it over the ranks). 0, or -1 naming the shard and offset.
int lb_loader_check_shard(const lb_loader *l, int s, char *err, size_t errlen);
void lb_loader_close(lb_loader *l);

// A weighted mixture of datasets, as Megatron's --data-path: "W1 GLOB1 W2 GLOB2 ..."
// (whitespace-separated; weights are positive numbers, relative to their sum). Text that does
// not start with a number is one glob, taken whole (spaces included), unweighted.
#define LB_BLEND_MAX 64
typedef struct {
    int n;                          // datasets
    int weighted;                   // the text gave weights (else n = 1 and weight 1)
    double weight[LB_BLEND_MAX];    // as written
    const char *glob[LB_BLEND_MAX]; // into text
    char text[1024];                // the globs, NUL-separated
} lb_data_blend;

// Parses spec. 0, or -1 with what is wrong (no location: the caller knows the key's).
int lb_data_blend_parse(const char *spec, lb_data_blend *bl, char *err, size_t errlen);

// Sequence loader: the training sequences are the windows of t+1 tokens starting at multiples
// of t in each shard (a batch is b of them: inputs the first t tokens of each, targets the
// last t). Global sequence i goes to the dataset whose share of the first i+1 is furthest
// behind its weight (Megatron's blendable index: every dataset's count over any prefix is
// within one of its weighted share) and is that dataset's next sequence. A dataset's sequence k
// is window k mod W of its W windows, in order or, with shuffle, through a seeded permutation
// of the W windows drawn anew for every pass (epoch = k / W). All of it is a function of
// (seed, weights, shard sizes, i): the position is one count (lb_loader_tell) and a seek
// rebuilds the rest. Every shard must hold b*t+1 tokens, as for lb_loader_open.
lb_loader *lb_loader_open_blend(const lb_data_blend *bl, int shuffle, uint64_t seed, int b,
                                int t, int vocab_size, char *err, size_t errlen);
// Position i (0 <= i < n) of the seeded permutation of [0, n) of (seed, stream): a bijection
// (a Feistel network over the next power of 4, walking cycles back into range).
uint64_t lb_data_permute(uint64_t n, uint64_t seed, uint64_t stream, uint64_t i);

// Byte-level tokenizer: a token is a byte (vocabulary 256).
#define LB_BYTE_VOCAB 256

// Arithmetic problems "a+b=c\n" (0 <= a, b <= max_operand) and "a-b=c\n" (0 <= b <= a <=
// max_operand), drawn from seed. Writes problem i (0-based) into buf (at least 64 bytes) and
// returns its length. The same (seed, i) always gives the same problem; the RL task reuses it.
int lb_arith_problem(uint64_t seed, uint64_t i, int max_operand, char *buf);

// Held-out split: problem i is a validation problem iff a uniform draw of its own (a stream
// separate from the problem's operands) is below val_fraction. Returns 1 for val, 0 for train.
int lb_arith_is_val(uint64_t seed, uint64_t i, double val_fraction);

// The RL reward's two halves. A prompt is a problem up to and including '=' ("17+25=").
// lb_arith_answer parses "a+b=" or "a-b=" (decimal a, b >= 0; anything after '=' is ignored,
// so a whole problem line also works) and stores the correct result. Returns 0, or -1 when the
// text is not of that form or the numbers overflow a long.
int lb_arith_answer(const char *prompt, long *expected);
// lb_arith_parse_completion reads the model's answer: an optional '-', one or more decimal
// digits, then '\n' or the end of the text (len bytes; no NUL needed); nothing else is
// accepted (no spaces, no '+'). Returns 0 with *value, or -1 when malformed or out of range.
int lb_arith_parse_completion(const char *text, size_t len, long *value);

// Generators behind `lowbit data`: write PREFIX_train_NNN.bin and PREFIX_val_NNN.bin.
// Byte tokens (LB_BYTE_VOCAB). Shards hold at most shard_tokens tokens (arith: cut only
// between problems); the last two of a split are evened out so the corpus never ends in a
// stub shorter than a batch. NNN has 3 digits, more when a split needs over 1000 shards. The
// directory of PREFIX is created. Numbered shards of an earlier run under the same PREFIX that
// this run would not overwrite are refused (the loader's glob would mix them in). An empty
// split writes no file. Print nothing; return 0, or -1 with "PATH: message" in err.
// arith: problem i goes to val iff lb_arith_is_val(seed, i, val_fraction).
// text: any bytes; the first (1 - val_fraction) of the file trains, the rest validates.
int lb_data_gen_arith(const char *prefix, int problems, int max_operand, double val_fraction,
                      int shard_tokens, uint64_t seed, char *err, size_t errlen);
int lb_data_gen_text(const char *prefix, const char *input, double val_fraction,
                     int shard_tokens, char *err, size_t errlen);
// Tokens (any vocabulary) as PREFIX_NAME_NNN.bin, in shards of at most shard_tokens with the
// last two evened out; stale numbered shards of PREFIX_NAME are refused as above. n = 0
// writes nothing. `lowbit data tokenize` writes each input file's splits with it.
int lb_data_write_split(const char *prefix, const char *name, const uint32_t *tokens, size_t n,
                        int shard_tokens, char *err, size_t errlen);

#endif
