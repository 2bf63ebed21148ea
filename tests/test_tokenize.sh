#!/bin/bash
# `lowbit data tokenize` end to end: text and JSON-lines files through the KJV tokenizer give
# the same shards on 1 and 2 ranks, every document ends in gen.eos_token, `lowbit train` reads
# the shards; and each mistake gets one clear line, a non-zero exit and no shards. Then the
# tokenizer's round trip through a checkpoint, sample, rl and an export.
# (The ids themselves are checked against the `tokenizers` package in tests/test_tokenizer.)
set -uo pipefail
. "${LB_SRCDIR:-.}/tests/lib.sh"
tok=$src/tests/data/tok_kjv/tokenizer.json
mpi() { local np=$1; shift; timeout 120 mpirun --oversubscribe -np "$np" "$@"; }
# Tokens of shards (version 1: uint16 after the 1024-byte header), one a line.
tokens() { for f in "$@"; do od -An -v -tu2 -j1024 -w2 "$f"; done | tr -d ' '; }

# its --help: purpose, example, the keys it reads
"$bin" data tokenize --help > "$tmp/help" 2>&1 && grep -q "^lowbit data tokenize: " "$tmp/help" &&
    grep -Eq "^  data.tokenizer +string " "$tmp/help" && grep -Eq "^  gen.eos_token +string " "$tmp/help" &&
    ok || { fail "lowbit data tokenize --help:"; cat "$tmp/help"; }

mkdir -p "$tmp/in"
for i in $(seq 1 40); do
    echo "And it came to pass, in the $i year of the king, that café 日本 🎉 were seen;"
done > "$tmp/in/a.txt"
for i in $(seq 1 20); do
    printf '{"id": %d, "text": "Verse %d: the LORD said unto Moses,\\n\\tGo thou.<|endoftext|>x"}\n' $i $i
done > "$tmp/in/b.jsonl"
args=(--set data.tokenizer="$tok" --set gen.input="$tmp/in/*.txt,$tmp/in/b.jsonl"
      --set gen.eos_token="<|endoftext|>" --set gen.val_fraction=0.1 --set gen.shard_tokens=400)
"$bin" data tokenize "${args[@]}" --set gen.output="$tmp/one/c" > "$tmp/log1" 2>&1 ||
    { fail "tokenize on 1 rank:"; cat "$tmp/log1"; }
mpi 2 "$bin" data tokenize "${args[@]}" --set gen.output="$tmp/two/c" > "$tmp/log2" 2>&1 ||
    { fail "tokenize on 2 ranks:"; cat "$tmp/log2"; }
grep -q "^tokenize: 2 file(s)" "$tmp/log1" && grep -q "tokenize: rank 0 file 1/1" "$tmp/log2" &&
    ok || fail "no summary or progress line"
(cd "$tmp/one" && ls) > "$tmp/l1"; (cd "$tmp/two" && ls) > "$tmp/l2"
if [ -s "$tmp/l1" ] && cmp -s "$tmp/l1" "$tmp/l2" &&
   (cd "$tmp/one" && for f in *; do cmp -s "$f" "../two/$f" || exit 1; done); then ok; else
    fail "shards differ between 1 and 2 ranks"; fi
# file 000 (the text) has train and val shards, cut to at most 400 tokens each
[ -e "$tmp/one/c_train_000_000.bin" ] && [ -e "$tmp/one/c_val_000_000.bin" ] &&
    [ -e "$tmp/one/c_train_001_000.bin" ] && ok || fail "missing shards:" $(cat "$tmp/l1")
big=$(for f in "$tmp"/one/*.bin; do od -An -t d4 -j8 -N4 "$f"; done | awk '$1 > 400' | wc -l)
[ "$big" = 0 ] && ok || fail "a shard over gen.shard_tokens"
# one eos per document (1 text file + 20 lines) plus the 20 <|endoftext|> inside the lines
neos=$(tokens "$tmp"/one/*.bin | grep -cx 4096)
[ "$neos" = 41 ] && ok || fail "$neos end-of-text tokens, expected 41"
# the text's own bytes come back: the shards hold 4100-vocabulary ids, not bytes
maxid=$(tokens "$tmp"/one/*.bin | sort -n | tail -1)
[ "$maxid" = 4096 ] && ok || fail "largest id $maxid, expected 4096"
# `lowbit train` reads them with the tokenizer's vocabulary
"$bin" train "$src/examples/tiny-moe.cfg" --set model.vocab_size=4100 --set train.steps=2 --set train.warmup_steps=1 \
    --set train.seq_len=32 --set train.micro_batch=2 --set train.grad_accum=1 \
    --set data.train_files="$tmp/one/c_train_*.bin" --set data.val_files="$tmp/one/c_val_000_*.bin" \
    --set run.out_dir="$tmp/run" --set train.val_every=2 > "$tmp/train.log" 2>&1 &&
    ok || { fail "train on the tokenized shards:"; tail -5 "$tmp/train.log"; }

# `lowbit sample` with the tokenizer: text prompts in, completions decoded to text
ck=$(ls "$tmp"/run/checkpoints/step_*.safetensors 2>/dev/null | tail -1)
printf 'And God said\nthe café of 日本\n' > "$tmp/prompts.txt"
smp=(--set sample.checkpoint="$ck" --set sample.prompts="$tmp/prompts.txt"
     --set sample.max_new_tokens=6 --set sample.samples=2)
if "$bin" sample "${smp[@]}" --set data.tokenizer="$tok" > "$tmp/s.out" 2> "$tmp/s.err"; then
    # the prompt column is the text (escaped), every completion decodes (no id without a token)
    [ "$(grep -c $'^And God said\t' "$tmp/s.out")" = 2 ] &&
    [ "$(grep -cF 'the caf\xc3\xa9 of \xe6\x97\xa5\xe6\x9c\xac	' "$tmp/s.out")" = 2 ] &&
    ! grep -q "<unk:" "$tmp/s.out" && ok || { fail "sample with a tokenizer:"; cat "$tmp/s.out"; }
else
    fail "sample with a tokenizer:"; cat "$tmp/s.err"
fi
sed 's/"added_tokens":\[/"added_tokens":[{"id":5000,"content":"<x>","special":true},/' "$tok" > "$tmp/big.json"
expect_error sample-vocab "big.json has 5001 tokens, more than the model's vocabulary \(4100\)" \
    "$bin" sample "${smp[@]}" --set data.tokenizer="$tmp/big.json"

# mistakes
expect_error no-tokenizer "data.tokenizer is empty" "$bin" data tokenize \
    --set gen.input="$tmp/in/a.txt" --set gen.output="$tmp/e/x"
expect_error missing-tokenizer "nothere.json: No such file" "$bin" data tokenize \
    --set data.tokenizer="$tmp/nothere.json" --set gen.input="$tmp/in/a.txt" --set gen.output="$tmp/e/x"
sed 's/"type":"BPE"/"type":"Unigram"/' "$tok" > "$tmp/bad.json"
expect_error bad-tokenizer "bad.json: model.type \"Unigram\" is not supported" mpi 2 "$bin" data \
    tokenize --set data.tokenizer="$tmp/bad.json" --set gen.input="$tmp/in/a.txt" --set gen.output="$tmp/e/x"
[ "$(grep -c "is not supported" "$tmp/err")" = 1 ] && ok || fail "2 ranks, one error: not one line"
expect_error no-input "gen.input: no file matches" "$bin" data tokenize --set data.tokenizer="$tok" \
    --set gen.input="$tmp/in/*.none" --set gen.output="$tmp/e/x"
expect_error bad-eos "gen.eos_token: \"<eos>\" is not a token" "$bin" data tokenize \
    --set data.tokenizer="$tok" --set gen.input="$tmp/in/a.txt" --set gen.eos_token="<eos>" \
    --set gen.output="$tmp/e/x"
{ echo '{"text": "fine"}'; echo; echo '{"txt": "no text field"}'; } > "$tmp/in/bad.jsonl"
expect_error bad-line "bad.jsonl:3: not a JSON object with a string \"text\"" mpi 2 "$bin" data \
    tokenize --set data.tokenizer="$tok" --set gen.input="$tmp/in/a.txt,$tmp/in/bad.jsonl" \
    --set gen.output="$tmp/e/x"
[ ! -e "$tmp/e/x_train_001_000.bin" ] && ok || fail "shards of the bad file were written"
# nor those of the good file before it: a failed run leaves no output (doc/data.md)
[ -z "$(ls "$tmp/e" 2>/dev/null)" ] && ok || fail "a failed tokenize left shards: $(ls "$tmp/e")"
# JSON lines are read strictly, as Python's json reads them or refuses them: a \u0000 would cut
# the text, bytes after the object would be dropped, and of a key twice Python takes the last
printf '{"text": "fine"}\n{"text": "cut\\u0000here"}\n' > "$tmp/in/nul.jsonl"
expect_error nul-escape "nul.jsonl:2: a NUL character \(\\\\u0000\) in a string" "$bin" data tokenize \
    --set data.tokenizer="$tok" --set gen.input="$tmp/in/nul.jsonl" --set gen.output="$tmp/e/x"
printf '{"text": "fine"}\n\n{"text": "a"} garbage\n' > "$tmp/in/tail.jsonl"
expect_error json-tail "tail.jsonl:3: bytes after the JSON value" "$bin" data tokenize \
    --set data.tokenizer="$tok" --set gen.input="$tmp/in/tail.jsonl" --set gen.output="$tmp/e/x"
printf '{"text": "first", "text": "last"}\n' > "$tmp/in/dup.jsonl"
expect_error json-dup "dup.jsonl:1: key \"text\" twice in one object" "$bin" data tokenize \
    --set data.tokenizer="$tok" --set gen.input="$tmp/in/dup.jsonl" --set gen.output="$tmp/e/x"
mkdir -p "$tmp/s" && cp "$tmp/one/c_train_000_000.bin" "$tmp/s/c_train_000.bin"
expect_error stale "c_train_000.bin: shard of an earlier corpus" "$bin" data tokenize \
    --set data.tokenizer="$tok" --set gen.input="$tmp/in/a.txt" --set gen.output="$tmp/s/c"
[ "$(ls "$tmp/s")" = c_train_000.bin ] && ok || fail "tokenize wrote next to a stale shard"

# The tokenizer travels with the model (doc/checkpoints.md): `lowbit train` with data.tokenizer
# stores its tokenizer.json in the checkpoint; `lowbit sample` from that checkpoint without
# data.tokenizer reads and writes text through it (--prompt, prompts from stdin), stopping at
# its end-of-text token; `lowbit rl` starts from it and its checkpoints carry it on; `lowbit
# convert` exports it as tokenizer.json, byte for byte, with generation_config.json; a changed
# byte of it in the checkpoint is refused by the header's CRC.
mkdir -p "$tmp/tc"
# The completions of a `lowbit sample` output: decoded words, not escaped bytes or ids.
words() {
    local n
    n=$(grep -v '^#' "$1" | cut -f2 | grep -c '[A-Za-z]')
    [ "$n" -gt 0 ] && ! grep -v '^#' "$1" | cut -f2 | grep -q '\\x\|<unk:'
}

for i in $(seq 1 40); do
    echo "In the beginning God created the heaven and the earth. And God said, Let there be light."
done > "$tmp/tc/a.txt"
"$bin" data tokenize --set data.tokenizer="$tok" --set gen.input="$tmp/tc/a.txt" \
    --set gen.eos_token="<|endoftext|>" --set gen.output="$tmp/tc/c" > "$tmp/tc/log" 2>&1 ||
    { cat "$tmp/tc/log"; fail "tokenize"; }
"$bin" train "$src/examples/tiny-moe.cfg" --set model.vocab_size=4100 --set train.steps=2 \
    --set train.warmup_steps=1 --set train.seq_len=32 --set train.micro_batch=2 \
    --set train.grad_accum=1 --set data.train_files="$tmp/tc/c_train_*.bin" --set data.val_files= \
    --set data.tokenizer="$tok" --set run.out_dir="$tmp/tc/run" > "$tmp/tc/train.log" 2>&1 ||
    { tail -5 "$tmp/tc/train.log"; fail "train with data.tokenizer"; }
ck=$tmp/tc/run/checkpoints/step_00000002.safetensors

# sample without data.tokenizer: the checkpoint's tokenizer, its end-of-text token (4096)
smp=(--set sample.checkpoint="$ck" --set sample.max_new_tokens=6)
"$bin" sample "${smp[@]}" --prompt "In the beginning" --prompt "And God said" > "$tmp/tc/s1" 2>&1 ||
    { cat "$tmp/tc/s1"; fail "sample --prompt"; }
grep -q "^# text through the tokenizer stored in .*step_00000002.safetensors (4100 tokens); stop tokens 4096$" \
    "$tmp/tc/s1" && ok || { fail "sample did not use the checkpoint's tokenizer:"; cat "$tmp/tc/s1"; }
[ "$(grep -c "^In the beginning	\|^And God said	" "$tmp/tc/s1")" = 2 ] && words "$tmp/tc/s1" && ok ||
    { fail "sample --prompt: not two prompts with words:"; cat "$tmp/tc/s1"; }
# prompts from stdin
printf 'the earth\nLet there be\n' | "$bin" sample "${smp[@]}" --set sample.prompts=- > "$tmp/tc/s2" 2>&1 ||
    { cat "$tmp/tc/s2"; fail "sample from stdin"; }
[ "$(grep -c "^the earth	\|^Let there be	" "$tmp/tc/s2")" = 2 ] && words "$tmp/tc/s2" && ok ||
    { fail "sample from stdin:"; cat "$tmp/tc/s2"; }
# a stop token given stays as given
"$bin" sample "${smp[@]}" --prompt "light" --set sample.stop_tokens=10 > "$tmp/tc/s3" 2>&1 &&
    grep -q "; stop tokens 10$" "$tmp/tc/s3" && ok || { fail "sample.stop_tokens=10 not kept:"; cat "$tmp/tc/s3"; }
expect_error stdin-empty "^stdin:2: empty prompt" \
    sh -c 'printf "a\n\nb\n" | "$0" sample "$@" --set sample.prompts=-' "$bin" "${smp[@]}"
expect_error both "sample.prompts and --prompt both give prompts" \
    "$bin" sample "${smp[@]}" --set sample.prompts="$tmp/tc/a.txt" --prompt x
expect_error prompt-empty "^--prompt 2 of 2 is empty" "$bin" sample "${smp[@]}" --prompt x --prompt ""
expect_error prompt-elsewhere "unexpected argument '--prompt'" "$bin" train --prompt x

# rl from it, without data.tokenizer: the checkpoint's tokenizer, and its checkpoints keep it
"$bin" data "$src/examples/tiny-moe.cfg" --set gen.output="$tmp/tc/arith" --set gen.problems=200 \
    > /dev/null 2>&1 || fail "data"
"$bin" rl "$src/examples/rl-arith.cfg" --set rl.init="$ck" --set rl.steps=1 --set rl.prompts=2 \
    --set rl.group=2 --set rl.eval_problems=0 --set sample.max_new_tokens=4 \
    --set run.out_dir="$tmp/tc/rl" > "$tmp/tc/rl.log" 2>&1 || { tail -5 "$tmp/tc/rl.log"; fail "rl"; }
grep -q "prompts and completions through the tokenizer stored in .*step_00000002.safetensors (4100 tokens)" \
    "$tmp/tc/rl.log" && ok || { fail "rl did not use the checkpoint's tokenizer"; tail -5 "$tmp/tc/rl.log"; }
"$bin" sample --set sample.checkpoint="$tmp/tc/rl/checkpoints/step_00000001.safetensors" \
    --prompt "In the" --set sample.max_new_tokens=2 > "$tmp/tc/s4" 2>&1 &&
    grep -q "^# text through the tokenizer stored in .*; stop tokens 4096$" "$tmp/tc/s4" && ok ||
    { fail "the rl checkpoint lost the tokenizer:"; cat "$tmp/tc/s4"; }

# export: tokenizer.json byte for byte, generation_config.json with the end-of-text id
"$bin" convert --set convert.direction=export --set convert.input="$ck" \
    --set convert.output="$tmp/tc/hf" > "$tmp/tc/conv.log" 2>&1 || { cat "$tmp/tc/conv.log"; fail "export"; }
cmp -s "$tok" "$tmp/tc/hf/tokenizer.json" && ok || fail "exported tokenizer.json differs from the source"
grep -q '"eos_token_id":[[:space:]]*4096' "$tmp/tc/hf/generation_config.json" && ok ||
    { fail "generation_config.json lacks eos_token_id 4096:"; cat "$tmp/tc/hf/generation_config.json"; }
# and back: the import stores it again
"$bin" convert --set convert.direction=import --set convert.input="$tmp/tc/hf" \
    --set convert.output="$tmp/tc/back.safetensors" > "$tmp/tc/conv2.log" 2>&1 &&
    "$bin" convert --set convert.direction=export --set convert.input="$tmp/tc/back.safetensors" \
    --set convert.output="$tmp/tc/hf2" > "$tmp/tc/conv3.log" 2>&1 && cmp -s "$tok" "$tmp/tc/hf2/tokenizer.json" &&
    ok || { cat "$tmp/tc/conv2.log" "$tmp/tc/conv3.log"; fail "import, export: tokenizer.json lost or changed"; }

# one changed byte of the stored tokenizer: the header's CRC refuses the file
LC_ALL=C sed 's/<think>/<thonk>/' "$ck" > "$tmp/tc/bad.safetensors"
cmp -s "$ck" "$tmp/tc/bad.safetensors" && fail "the corruption changed nothing"
expect_error crc-sample "bad.safetensors: header checksum mismatch" \
    "$bin" sample --set sample.checkpoint="$tmp/tc/bad.safetensors" --prompt x
expect_error crc-export "bad.safetensors: header checksum mismatch" "$bin" convert \
    --set convert.direction=export --set convert.input="$tmp/tc/bad.safetensors" --set convert.output="$tmp/tc/hf3"

# a resumed run without data.tokenizer goes on with its checkpoint's, and its checkpoints keep
# it; another tokenizer is refused (the same ids would mean other text)
cp -r "$tmp/tc/run" "$tmp/tc/res"
res=(--set model.vocab_size=4100 --set train.warmup_steps=1 --set train.seq_len=32
     --set train.micro_batch=2 --set train.grad_accum=1 --set data.train_files="$tmp/tc/c_train_*.bin"
     --set data.val_files= --set checkpoint.resume=auto --set run.out_dir="$tmp/tc/res")
"$bin" train "$src/examples/tiny-moe.cfg" "${res[@]}" --set train.steps=3 > "$tmp/tc/res.log" 2>&1 &&
    "$bin" sample --set sample.checkpoint="$tmp/tc/res/checkpoints/step_00000003.safetensors" \
        --prompt "In the" --set sample.max_new_tokens=2 > "$tmp/tc/s5" 2>&1 &&
    grep -q "^# text through the tokenizer stored in .*; stop tokens 4096$" "$tmp/tc/s5" && ok ||
    { fail "a resumed run lost the tokenizer:"; cat "$tmp/tc/res.log" "$tmp/tc/s5"; }
LC_ALL=C sed 's/<think>/<thonk>/' "$tok" > "$tmp/tc/other.json"
expect_error resume-other "step_00000003.safetensors was trained with another tokenizer; data.tokenizer names .*other.json" \
    "$bin" train "$src/examples/tiny-moe.cfg" "${res[@]}" --set train.steps=4 --set data.tokenizer="$tmp/tc/other.json"

summary
