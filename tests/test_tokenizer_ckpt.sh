#!/bin/bash
# The tokenizer travels with the model (doc/checkpoints.md): `lowbit train` with data.tokenizer
# stores its tokenizer.json in the checkpoint; `lowbit sample` from that checkpoint without
# data.tokenizer reads and writes text through it (--prompt, prompts from stdin), stopping at
# its end-of-text token; `lowbit rl` starts from it and its checkpoints carry it on; `lowbit
# convert` exports it as tokenizer.json, byte for byte, with generation_config.json; a changed
# byte of it in the checkpoint is refused by the header's CRC.
set -uo pipefail
src=${LB_SRCDIR:-.}
bin=${LB_BUILDDIR:-.}/lowbit
tok=$src/tests/data/tok_kjv/tokenizer.json
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass=0
failed=0
fail() { echo "FAIL: $*"; failed=$((failed + 1)); }
ok() { pass=$((pass + 1)); }
expect_error() {
    local name=$1 pattern=$2
    shift 2
    "$@" >"$tmp/out" 2>"$tmp/err"
    local rc=$?
    if [ $rc -eq 0 ] || [ $rc -eq 124 ]; then fail "$name: exit $rc"; return; fi
    if ! grep -Eq -- "$pattern" "$tmp/err"; then
        fail "$name: stderr lacks '$pattern':"; sed 's/^/    /' "$tmp/err"; return
    fi
    ok
}
# The completions of a `lowbit sample` output: decoded words, not escaped bytes or ids.
words() {
    local n
    n=$(grep -v '^#' "$1" | cut -f2 | grep -c '[A-Za-z]')
    [ "$n" -gt 0 ] && ! grep -v '^#' "$1" | cut -f2 | grep -q '\\x\|<unk:'
}

for i in $(seq 1 40); do
    echo "In the beginning God created the heaven and the earth. And God said, Let there be light."
done > "$tmp/a.txt"
"$bin" data tokenize --set data.tokenizer="$tok" --set gen.input="$tmp/a.txt" \
    --set gen.eos_token="<|endoftext|>" --set gen.output="$tmp/c" > "$tmp/log" 2>&1 ||
    { cat "$tmp/log"; fail "tokenize"; }
"$bin" train "$src/examples/tiny-moe.cfg" --set model.vocab_size=4100 --set train.steps=2 \
    --set train.warmup_steps=1 --set train.seq_len=32 --set train.micro_batch=2 \
    --set train.grad_accum=1 --set data.train_files="$tmp/c_train_*.bin" --set data.val_files= \
    --set data.tokenizer="$tok" --set run.out_dir="$tmp/run" > "$tmp/train.log" 2>&1 ||
    { tail -5 "$tmp/train.log"; fail "train with data.tokenizer"; }
ck=$tmp/run/checkpoints/step_00000002.safetensors

# sample without data.tokenizer: the checkpoint's tokenizer, its end-of-text token (4096)
smp=(--set sample.checkpoint="$ck" --set sample.max_new_tokens=6)
"$bin" sample "${smp[@]}" --prompt "In the beginning" --prompt "And God said" > "$tmp/s1" 2>&1 ||
    { cat "$tmp/s1"; fail "sample --prompt"; }
grep -q "^# text through the tokenizer stored in .*step_00000002.safetensors (4100 tokens); stop tokens 4096$" \
    "$tmp/s1" && ok || { fail "sample did not use the checkpoint's tokenizer:"; cat "$tmp/s1"; }
[ "$(grep -c "^In the beginning	\|^And God said	" "$tmp/s1")" = 2 ] && words "$tmp/s1" && ok ||
    { fail "sample --prompt: not two prompts with words:"; cat "$tmp/s1"; }
# prompts from stdin
printf 'the earth\nLet there be\n' | "$bin" sample "${smp[@]}" --set sample.prompts=- > "$tmp/s2" 2>&1 ||
    { cat "$tmp/s2"; fail "sample from stdin"; }
[ "$(grep -c "^the earth	\|^Let there be	" "$tmp/s2")" = 2 ] && words "$tmp/s2" && ok ||
    { fail "sample from stdin:"; cat "$tmp/s2"; }
# a stop token given stays as given
"$bin" sample "${smp[@]}" --prompt "light" --set sample.stop_tokens=10 > "$tmp/s3" 2>&1 &&
    grep -q "; stop tokens 10$" "$tmp/s3" && ok || { fail "sample.stop_tokens=10 not kept:"; cat "$tmp/s3"; }
expect_error stdin-empty "^stdin:2: empty prompt" \
    sh -c 'printf "a\n\nb\n" | "$0" sample "$@" --set sample.prompts=-' "$bin" "${smp[@]}"
expect_error both "sample.prompts and --prompt both give prompts" \
    "$bin" sample "${smp[@]}" --set sample.prompts="$tmp/a.txt" --prompt x
expect_error prompt-empty "^--prompt 2 of 2 is empty" "$bin" sample "${smp[@]}" --prompt x --prompt ""
expect_error prompt-elsewhere "unexpected argument '--prompt'" "$bin" train --prompt x

# rl from it, without data.tokenizer: the checkpoint's tokenizer, and its checkpoints keep it
"$bin" data "$src/examples/tiny-moe.cfg" --set gen.output="$tmp/arith" --set gen.problems=200 \
    > /dev/null 2>&1 || fail "data"
"$bin" rl "$src/examples/rl-arith.cfg" --set rl.init="$ck" --set rl.steps=1 --set rl.prompts=2 \
    --set rl.group=2 --set rl.eval_problems=0 --set sample.max_new_tokens=4 \
    --set run.out_dir="$tmp/rl" > "$tmp/rl.log" 2>&1 || { tail -5 "$tmp/rl.log"; fail "rl"; }
grep -q "prompts and completions through the tokenizer stored in .*step_00000002.safetensors (4100 tokens)" \
    "$tmp/rl.log" && ok || { fail "rl did not use the checkpoint's tokenizer"; tail -5 "$tmp/rl.log"; }
"$bin" sample --set sample.checkpoint="$tmp/rl/checkpoints/step_00000001.safetensors" \
    --prompt "In the" --set sample.max_new_tokens=2 > "$tmp/s4" 2>&1 &&
    grep -q "^# text through the tokenizer stored in .*; stop tokens 4096$" "$tmp/s4" && ok ||
    { fail "the rl checkpoint lost the tokenizer:"; cat "$tmp/s4"; }

# export: tokenizer.json byte for byte, generation_config.json with the end-of-text id
"$bin" convert --set convert.direction=export --set convert.input="$ck" \
    --set convert.output="$tmp/hf" > "$tmp/conv.log" 2>&1 || { cat "$tmp/conv.log"; fail "export"; }
cmp -s "$tok" "$tmp/hf/tokenizer.json" && ok || fail "exported tokenizer.json differs from the source"
grep -q '"eos_token_id":[[:space:]]*4096' "$tmp/hf/generation_config.json" && ok ||
    { fail "generation_config.json lacks eos_token_id 4096:"; cat "$tmp/hf/generation_config.json"; }
# and back: the import stores it again
"$bin" convert --set convert.direction=import --set convert.input="$tmp/hf" \
    --set convert.output="$tmp/back.safetensors" > "$tmp/conv2.log" 2>&1 &&
    "$bin" convert --set convert.direction=export --set convert.input="$tmp/back.safetensors" \
    --set convert.output="$tmp/hf2" > "$tmp/conv3.log" 2>&1 && cmp -s "$tok" "$tmp/hf2/tokenizer.json" &&
    ok || { cat "$tmp/conv2.log" "$tmp/conv3.log"; fail "import, export: tokenizer.json lost or changed"; }

# one changed byte of the stored tokenizer: the header's CRC refuses the file
LC_ALL=C sed 's/<think>/<thonk>/' "$ck" > "$tmp/bad.safetensors"
cmp -s "$ck" "$tmp/bad.safetensors" && fail "the corruption changed nothing"
expect_error crc-sample "bad.safetensors: header checksum mismatch" \
    "$bin" sample --set sample.checkpoint="$tmp/bad.safetensors" --prompt x
expect_error crc-export "bad.safetensors: header checksum mismatch" "$bin" convert \
    --set convert.direction=export --set convert.input="$tmp/bad.safetensors" --set convert.output="$tmp/hf3"

echo "$pass passed, $failed failed"
[ "$failed" -eq 0 ]
