#!/bin/bash
# make_corpus.sh BUILD_DIR: (re)writes the committed seed corpus tests/fuzz/corpus/ from the
# examples, the test data and hand-made damage: ok-* files every reader must accept, bad-* ones
# it must refuse with a message naming the file (the bad inputs of tests/test_cli.sh among
# them). BUILD_DIR holds the built tests/fuzz/fuzz_checkpoint. Files `make fuzz` found are
# kept (they have other names).
set -euo pipefail
src=$(cd "$(dirname "$0")/../.." && pwd)
build=$(cd "${1:?usage: make_corpus.sh BUILD_DIR}" && pwd)
out=$src/tests/fuzz/corpus
mkdir -p "$out"/{config,safetensors,checkpoint,shard,tokenizer}
rm -f "$out"/*/ok-* "$out"/*/bad-*
# poke FILE OLD NEW: the first OLD in FILE becomes NEW (the same length)
poke() {
    local at
    at=$(LC_ALL=C grep -obUaF -- "$2" "$1" | head -n 1 | cut -d: -f1)
    [ -n "$at" ] || { echo "make_corpus: '$2' not in $1" >&2; exit 1; }
    printf '%s' "$3" | dd of="$1" bs=1 seek="$at" conv=notrunc 2>/dev/null
}
le32() { printf "\\x$(printf %02x $(($1 & 255)))\\x$(printf %02x $(($1 >> 8 & 255)))\\x$(printf %02x $(($1 >> 16 & 255)))\\x$(printf %02x $(($1 >> 24 & 255)))"; }
# shard MAGIC VERSION COUNT: a shard header (256 int32)
shard() { le32 "$1"; le32 "$2"; le32 "$3"; head -c $((1024 - 12)) /dev/zero; }
# st HEADER: a safetensors file of that JSON header and DATA bytes (second argument) of zeros
st() {
    local n=${#1}
    le32 "$n"; le32 0; printf '%s' "$1"; head -c "${2:-0}" /dev/zero
}

# --- parameter files
c=$out/config
cp "$src/examples/tiny-moe.cfg" "$c/ok-tiny-moe.cfg"
cp "$src/examples/rl-arith.cfg" "$c/ok-rl-arith.cfg"
printf '' > "$c/ok-empty.cfg"
printf '[train]\nsteps = 3\n\0[run]\nseed = 2\n' > "$c/bad-nul.cfg"
printf '[train]\n\xff\xfe = 1\n' > "$c/bad-garbage.cfg"
printf '[train]\nsteps = 10\nlerning_rate = 0.1\n' > "$c/bad-typo.cfg"
printf '[train]\nsteps = ten\n' > "$c/bad-type.cfg"
printf '[train\nsteps = 1\n' > "$c/bad-section.cfg"
printf '[train]\nsteps = 99999999999999999999\n' > "$c/bad-range.cfg"
printf '[model]\nnum_attention_heads = 6\nnum_key_value_heads = 4\n' > "$c/bad-heads.cfg"

# --- safetensors
s=$out/safetensors
cp "$src/tests/data/st_python.safetensors" "$s/ok-python"
st '{}' > "$s/ok-empty"
st '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"__metadata__":{"k":"v"}}' 8 > "$s/ok-one"
head -c 5 "$s/ok-python" > "$s/bad-short"
head -c 200 "$s/ok-python" > "$s/bad-trunc"
st '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}' 8 > "$s/bad-json"
st '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}' 12 > "$s/bad-overlap"
st '{"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}' 12 > "$s/bad-gap"
st '{"a":{"dtype":"F31","shape":[2],"data_offsets":[0,8]}}' 8 > "$s/bad-dtype"
st '{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}' 8 > "$s/bad-shape"
st '{"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}}' 8 > "$s/bad-overflow"
st '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}' 16 > "$s/bad-twice"
st '{"__metadata__":{"k":1}}' > "$s/bad-meta"
{ le32 100000; le32 0; printf '{}'; } > "$s/bad-hlen"

# --- checkpoints (the damage of tests/test_cli.sh)
k=$out/checkpoint
"$build/tests/fuzz/fuzz_checkpoint" --seed "$k"
edit() { cp "$k/ok-step15" "$k/$1"; poke "$k/$1" "$2" "$3"; }
edit bad-step '"step":"15"' '"step":"16"'
edit bad-step-negative '"step":"15"' '"step":"-9"'
edit bad-loader-pos '"loader_pos":"40"' '"loader_pos":"41"'
edit bad-rope 'rope_theta = 10000' 'rope_theta = 10001'
edit bad-moment-name 'optimizer.exp_avg.' 'optimizer.exp_avX.'
edit bad-param-name 'model.norm.weight' 'model.norm.weighT'
edit bad-crc-field '"crc32":"' '"crc32":"X'
edit bad-format 'lowbit-checkpoint-2' 'lowbit-checkpoint-7'
edit ok-format1 'lowbit-checkpoint-2' 'lowbit-checkpoint-1'
edit bad-format1-step '"step":"15"' '"step":"-9"'
poke "$k/bad-format1-step" 'lowbit-checkpoint-2' 'lowbit-checkpoint-1'
cp "$k/ok-step15" "$k/bad-data"
size=$(stat -c %s "$k/bad-data")
printf '\x55' | dd of="$k/bad-data" bs=1 seek=$((size - 7)) conv=notrunc 2>/dev/null
head -c $((size - 4)) "$k/ok-step15" > "$k/bad-trunc"
cp "$s/ok-python" "$k/bad-not-lowbit"

# --- token shards (tokens below 256: the replay's vocabulary)
d=$out/shard
tok() { for i in $(seq 1 "$1"); do printf "\\x$(printf %02x $((i % 250)))\\x00"; done; }
{ shard 20240520 1 12; tok 12; } > "$d/ok-v1"
{ shard 20240520 2 6; for i in 1 2 3 4 5 6; do le32 $((i * 40)); done; } > "$d/ok-v2"
{ shard 20240521 1 12; tok 12; } > "$d/bad-magic"
{ shard 20240520 3 12; tok 12; } > "$d/bad-version"
{ shard 20240520 1 12; tok 11; } > "$d/bad-trunc"
{ shard 20240520 1 12; tok 13; } > "$d/bad-trailing"
{ shard 20240520 1 -1; } > "$d/bad-negative"
{ shard 20240520 1 4; tok 4; } > "$d/bad-too-few"
{ shard 20240520 1 12; tok 7; printf '\xff\xff'; tok 4; } > "$d/bad-token"
{ shard 20240520 2 6; for i in 1 2 3 4 5; do le32 $i; done; le32 256; } > "$d/bad-token-v2"
head -c 100 "$d/ok-v1" > "$d/bad-short"
# --- tokenizer.json (the KJV tokenizer, a small hand-made one, and damage to each)
t=$out/tokenizer
kjv=$src/tests/data/tok_kjv/tokenizer.json
cp "$kjv" "$t/ok-kjv"
# vocab: the 256 bytes of GPT-2's byte-level alphabet as JSON \u escapes (ids 0-255)
vocab() {
    local b n=0 sep=
    for b in $(seq 0 255); do
        if { [ "$b" -ge 33 ] && [ "$b" -le 126 ]; } || { [ "$b" -ge 161 ] && [ "$b" -le 172 ]; } ||
           { [ "$b" -ge 174 ] && [ "$b" -le 255 ]; }; then
            printf '%s"\\u%04x":%d' "$sep" "$b" "$b"
        else
            printf '%s"\\u%04x":%d' "$sep" $((256 + n)) "$b"
            n=$((n + 1))
        fi
        sep=,
    done
}
# tokjson PRE MERGES EXTRA_VOCAB ADDED: a byte-level BPE tokenizer.json
tokjson() {
    printf '{"added_tokens":[%s],"normalizer":null,"pre_tokenizer":%s,' "$4" "$1"
    printf '"model":{"type":"BPE","vocab":{'; vocab; printf '%s},"merges":[%s]}}\n' "$3" "$2"
}
bl='{"type":"ByteLevel","add_prefix_space":false,"use_regex":true}'
end='{"id":259,"content":"<|endoftext|>","special":true}'
tokjson "$bl" '["t","h"],["th","e"]' ',"th":256,"the":257' "$end" > "$t/ok-small"
tokjson "$bl" '"t h","th e"' ',"th":256,"the":257' "" > "$t/ok-small-string-merges"
tokjson '{"type":"Sequence","pretokenizers":[{"type":"Split","pattern":{"String":" "},"behavior":"Removed","invert":false},'"$bl"']}' \
    '' '' '{"id":300,"content":"<s>","special":false}' > "$t/ok-split-gap"
printf '' > "$t/bad-empty"
printf '{"model": ' > "$t/bad-cut"
printf '[]' > "$t/bad-list"
{ cat "$t/ok-small"; printf 'x'; } > "$t/bad-trailing"
{ cat "$t/ok-small"; printf '\0{}'; } > "$t/bad-nul"
tokjson "$bl" '["t","h"]' '' '' > "$t/bad-merge-unknown"
tokjson "$bl" '["t","h"]' ',"th":256' '{"id":256,"content":"<x>"}' > "$t/ok-added-on-vocab-id"
tokjson "$bl" '["q","q"]' ',"th":256' '' > "$t/bad-merge-result"
tokjson "$bl" '["t"]' ',"th":256' '' > "$t/bad-merge-one"
tokjson "$bl" '' ',"th":65' '' > "$t/bad-id-twice"
tokjson "$bl" '' ',"\u4e00":256' '' > "$t/bad-not-byte-level"
tokjson "$bl" '' ',"th":16777216' '' > "$t/bad-id-range"
tokjson "$bl" '' ',"th":1.5' '' > "$t/bad-id-fraction"
tokjson "$bl" '' '' '{"id":256,"content":""}' > "$t/bad-added-empty"
tokjson "$bl" '' '' '{"id":256,"content":"<a>","single_word":true}' > "$t/bad-single-word"
tokjson '{"type":"Split","pattern":{"Regex":"(unclosed"},"behavior":"Isolated","invert":false}' '' '' '' > "$t/bad-regex"
tokjson '{"type":"Whitespace"}' '' '' '' > "$t/bad-pretok"
tokjson 'null' '' '' '' > "$t/bad-no-pretok"
tokjson '{"type":"Split","pattern":{"String":" "},"behavior":"Sideways","invert":false}' '' '' '' > "$t/bad-behavior"
cp "$t/ok-small" "$t/bad-model-type"
poke "$t/bad-model-type" '"type":"BPE"' '"type":"WPE"'
sed 's/"\\u0100":0,//' "$t/ok-small" > "$t/bad-no-byte"
sed 's/"normalizer":null/"normalizer":{"type":"NFKC"}/' "$t/ok-small" > "$t/bad-normalizer"
sed 's/"type":"BPE",/"type":"BPE","dropout":0.1,/' "$t/ok-small" > "$t/bad-dropout"
echo "make_corpus: $(ls "$out"/* | grep -c -- '-') files in $out"
