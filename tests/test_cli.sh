#!/bin/bash
# The command line on bad input: every mistake gets one clear line naming the file (and line),
# a non-zero exit, and no partial output. Also: doc/parameters.md is not stale.
set -uo pipefail
. "${LB_SRCDIR:-.}/tests/lib.sh"

# every command's --help: its purpose, an example, and the keys of its sections with defaults
for c in train:train.steps info:model.hidden_size data:gen.problems convert:convert.input \
         sample:sample.checkpoint rl:rl.group bench:bench.kind; do
    name=${c%%:*} key=${c#*:}
    if "$bin" "$name" --help > "$tmp/help" 2>&1 && grep -q "^lowbit $name: " "$tmp/help" &&
       grep -q "^example:" "$tmp/help" && grep -Eq "^  $key +[a-z0-9]+ " "$tmp/help"; then ok; else
        fail "lowbit $name --help lacks its purpose, example or $key:"; sed 's/^/    /' "$tmp/help"; fi
done
# the manual page, from the same table: every key and every command
"$bin" params --man > "$tmp/man"
if grep -q '^\.TH LOWBIT 1' "$tmp/man" && grep -q '^\.B train\.steps$' "$tmp/man" &&
   grep -q '^\.B rl$' "$tmp/man" &&
   [ "$(grep -c '^\.B [a-z_]*\.[a-z0-9_]*$' "$tmp/man")" = "$(grep -c '^| `' "$src/doc/parameters.md")" ]
then ok; else fail "lowbit params --man: no manual page, or not every key in it"; fi

# doc/parameters.md is generated from the parameter table
if "$bin" params | diff -q - "$src/doc/parameters.md" >/dev/null; then ok; else
    fail "doc/parameters.md is stale: run 'make doc-params'"; fi

cfg="$src/examples/tiny-moe.cfg"
"$bin" info "$cfg" > "$tmp/info" 2>&1 && grep -q "parameters" "$tmp/info" && ok || fail "info"
# info counts activations under the precision contract: the bf16 recipe's expert layers keep bf16
# copies of their activations in place of fp32 ones (the tiny model: 50.215 MiB against 57.215)
act() { "$bin" info "$cfg" "$@" 2>&1 | awk '/rank  tp/ { getline; print $(NF - 1) }'; }
a32=$(act) a16=$(act --set precision.recipe=bf16)
[ -n "$a32" ] && [ -n "$a16" ] && [ "$a32" != "$a16" ] && ok ||
    fail "info: activations $a16 MiB in bf16, $a32 MiB in fp32"
# and the weight caches: none in fp32, the bf16 copies in bf16, fp8 copies both ways in fp8-block
cache() { "$bin" info "$cfg" "$@" 2>&1 | awk '/rank  tp/ { getline; print $(NF - 2) }'; }
c32=$(cache) c16=$(cache --set precision.recipe=bf16) c8=$(cache --set precision.recipe=fp8-block)
awk -v a="$c32" -v b="$c16" -v c="$c8" 'BEGIN { exit !(a == 0 && b > 0 && c > 0) }' && ok ||
    fail "info: weight caches $c32 MiB in fp32, $c16 in bf16, $c8 in fp8-block"
# activations per token and layer: under full recomputation a layer keeps its input alone (128
# fp32 values, 512 bytes); selective keeps less than none, and bf16 storage less than fp32
lay() { "$bin" info "$cfg" "$@" 2>&1 | sed -n 's/.*activations per token and layer: \([0-9]*\) bytes.*/\1/p'; }
l32=$(lay) lfull=$(lay --set train.recompute=full) lsel=$(lay --set train.recompute=selective)
l16=$(lay --set precision.recipe=bf16)
[ "$lfull" = 512 ] && [ "$lsel" -lt "$l32" ] && [ "$l16" -lt "$l32" ] && ok ||
    fail "info: bytes per token and layer: $l32 (fp32), $lfull (full), $lsel (selective), $l16 (bf16)"
# the activation plan: which activations the recipe stores in bf16 (none in fp32; the residual
# stream where no GEMM is fp32 in any pass; q and k before their norms where the q/k/v
# projections are plain bf16 GEMMs; the input norm where the q/k/v GEMMs are plain bf16
# or quantized in every pass, under tp too, the attention output where the o projection is so,
# the feed-forward block's input norm where the router and the experts read bf16; the experts'
# inputs where their GEMMs are so too: not with a dequantized backward)
plan() { "$bin" info "$cfg" "$@" 2>&1 | sed -n 's/.*activations in bf16 (rank 0): \([^;]*\);.*/\1/p'; }
p32=$(plan) p16=$(plan --set precision.recipe=bf16) p8=$(plan --set precision.recipe=fp8-block)
pmx=$(plan --set precision.recipe=mxfp8)
pdq=$(plan --set precision.recipe=fp8-block --set precision.backward=dequantized)
ptp=$(plan --set precision.recipe=bf16 --set parallel.tp=2 --set parallel.dp=1)
p32w=$(plan --set precision.recipe=bf16 --set 'precision.overrides=lm_head.wgrad=fp32')
all16="the residual stream, q and k after RoPE, the attention's input norm, the attention output, the feed-forward block's input norm, the experts' input rows, gate/up's outputs, the SwiGLU outputs, down's input gradients"
# and q and k before their norms where the q/k/v projections are plain bf16 GEMMs
b16="the residual stream, q and k before their norms, ${all16#the residual stream, }"
[ "$p32" = none ] && [ "$p16" = "$b16" ] && [ "$p8" = "$all16" ] && [ "$pmx" = "$all16" ] &&
    [ "$pdq" = "the residual stream, q and k after RoPE, gate/up's outputs" ] &&
    [ "$ptp" = "$b16" ] && [ "$p32w" = "${b16#the residual stream, }" ] && ok ||
    fail "info: activation plans: fp32 '$p32', bf16 '$p16', fp8-block '$p8', mxfp8 '$pmx', fp8-block dequantized '$pdq', bf16 tp2 '$ptp', bf16 with an fp32 wgrad '$p32w'"
# a dense model's MLP: gate/up's outputs where gate/up is a plain bf16 GEMM, the SwiGLU's where
# down reads bf16 (quantized too)
lcfg="$src/examples/tiny-llama.cfg"
l16=$("$bin" info "$lcfg" --set precision.recipe=bf16 2>&1 | grep "activations in bf16")
l8=$("$bin" info "$lcfg" --set precision.recipe=fp8-block 2>&1 | grep "activations in bf16")
[[ "$l16" == *"the MLP's gate/up outputs, the MLP's SwiGLU outputs;"* ]] &&
    [[ "$l8" != *"the MLP's gate/up outputs"* ]] && [[ "$l8" == *"the MLP's SwiGLU outputs;"* ]] &&
    ok || fail "info: a dense model's MLP plan: bf16 '$l16', fp8-block '$l8'"
# and what the backend holds of its own: nothing on the CPU; on CUDA 614 MiB (context and code)
# and the LM head backward's bf16 scratch with a quarter's headroom, rows x (vocab 256 + hidden
# 128) x 2 bytes x 1.25: 0.9375 MiB for 16 x 64 rows, 0.234 for chunks of 256 (train.ce_chunk)
bk() { "$bin" info "$cfg" "$@" 2>&1 | awk '/rank  tp/ { getline; print $(NF - 3) }'; }
b0=$(bk) b1=$(bk --set run.backend=cuda) b2=$(bk --set run.backend=cuda --set train.ce_chunk=256)
[ "$b0 $b1 $b2" = "0.000 614.938 614.234" ] && ok ||
    fail "info: backend memory $b0 MiB on the CPU, $b1 on CUDA, $b2 on CUDA in chunks of 256"
# in bf16 with heads of 64 the attention backward's scratch is the larger request: D (16 x 64
# x 4 heads floats), bf16 q, dout (2 x 16 x 64 x 4 x 64 x 2 bytes), k, v (2 x 16 x 64 x 2 x 64 x
# 2) and one 64 x 64 dS tile per sequence and head (16 x 4 x 8 KiB): 2.015625 MiB x 1.25 (the
# LM head's bf16 logits leave it x alone: 0.25 MiB)
b3=$(bk --set run.backend=cuda --set precision.recipe=bf16 --set model.head_dim=64)
[ "$b3" = "616.520" ] && ok || fail "info: backend memory $b3 MiB in bf16 with heads of 64"
# the 4-layer Qwen3-30B-A3B proxy's training step in bf16 on CUDA, fp32 master weights and
# moments, fits an 80 GB card with room: at most 66 GiB in all, its activations at most 13 GiB
# (measured on an H100 at 65.8 GiB, doc/benchmarks.md)
read -r pa pt < <("$bin" info "$src/examples/qwen3-30b-a3b-4l.cfg" --set run.backend=cuda \
    --set precision.recipe=bf16 2>&1 | awk '/rank  tp/ { getline; print $(NF - 1), $NF }')
awk -v a="$pa" -v t="$pt" 'BEGIN { exit !(a > 0 && a <= 13 * 1024 && t > 0 && t <= 66 * 1024) }' &&
    ok || fail "info: the proxy in bf16 needs $pt MiB, activations $pa MiB (at most 66, 13 GiB)"

# configuration mistakes
printf '[train]\nsteps = 10\nlerning_rate = 0.1\n' > "$tmp/typo.cfg"
expect_error typo "typo.cfg:3: unknown key 'lerning_rate' in \[train\] \(did you mean 'lr'\?\)" \
    "$bin" train "$tmp/typo.cfg"
# values that would make NaN: AdamW's epsilon 0 (0 / 0 for a parameter without gradient),
# GRPO's adv_eps 0 (a group of equal rewards); betas at 1 are refused by lb_config_validate
expect_error adam_eps "train.adam_eps: '0' is out of range \\[1e-30, 1\\]" \
    "$bin" train "$cfg" --set train.adam_eps=0
expect_error adv_eps "rl.adv_eps: '0' is out of range" "$bin" train "$cfg" --set rl.adv_eps=0
# a NUL byte ends a C string: the rest of the file must not be dropped unseen
printf '[train]\nsteps = 3\n\0[run]\nseed = 2\n' > "$tmp/nul.cfg"
expect_error nul "nul.cfg:3: a NUL byte \(offset 18\): this is not a text file" \
    "$bin" train "$tmp/nul.cfg"
# bytes that are not text are quoted escaped, never raw
printf '[train]\n\xff\xfe = 1\n' > "$tmp/garbage.cfg"
expect_error garbage "garbage.cfg:2: unknown key '\\\\xff\\\\xfe'" "$bin" train "$tmp/garbage.cfg"
if LC_ALL=C grep -q $'[\x80-\xff]' "$tmp/err"; then fail "garbage: raw high bytes on stderr"; else ok; fi
printf '[train]\nsteps = ten\n' > "$tmp/type.cfg"
expect_error type "type.cfg:2: train.steps: 'ten' is not an integer" "$bin" train "$tmp/type.cfg"
expect_error missing-cfg "nothere.cfg: No such file or directory" "$bin" train "$tmp/nothere.cfg"
expect_error bad-set "^--set train.stpes: .*did you mean 'train.steps'" "$bin" info --set train.stpes=3
expect_error bad-arch "model.arch: 'llama9' is not one of" "$bin" info --set model.arch=llama9
expect_error heads "model.num_attention_heads \(6\) is not a multiple of model.num_key_value_heads \(4\)" \
    "$bin" info "$cfg" --set model.num_attention_heads=6 --set model.num_key_value_heads=4
expect_error command "unknown command 'trian'" "$bin" trian "$cfg"

# data mistakes: generate a small corpus, then damage copies of it
"$bin" data "$cfg" --set gen.output="$tmp/d/arith" --set gen.problems=2000 >/dev/null 2>&1 || fail "data"
run=(--set data.val_files= --set train.steps=2 --set train.warmup_steps=0 --set train.micro_batch=2 --set train.seq_len=16
     --set model.hidden_size=32 --set model.head_dim=8 --set model.num_hidden_layers=1)
expect_error no-shards "no token shards match" "$bin" train "$cfg" "${run[@]}" \
    --set data.train_files="$tmp/none_*.bin" --set run.out_dir="$tmp/r0"
mkdir -p "$tmp/bad"
head -c 3000 "$tmp/d/arith_train_000.bin" > "$tmp/bad/trunc_000.bin"
expect_error truncated-shard "trunc_000.bin: truncated" "$bin" train "$cfg" "${run[@]}" \
    --set data.train_files="$tmp/bad/trunc_*.bin" --set run.out_dir="$tmp/r1"
[ ! -e "$tmp/r1/checkpoints/step_00000002.safetensors" ] && ok || fail "checkpoint after a bad shard"
cat "$tmp/d/arith_train_000.bin" > "$tmp/bad/magic_000.bin"
printf 'XXXX' | dd of="$tmp/bad/magic_000.bin" bs=1 conv=notrunc 2>/dev/null
expect_error bad-magic "magic_000.bin: not a token shard: bad magic" "$bin" train "$cfg" "${run[@]}" \
    --set data.train_files="$tmp/bad/magic_*.bin" --set run.out_dir="$tmp/r2"
# every shard's tokens are checked before the first step: a bad token in the second shard
# stops the run before any output (no metrics.jsonl, no checkpoints)
cp "$tmp/d/arith_train_000.bin" "$tmp/bad/tok_000.bin"
cp "$tmp/d/arith_train_000.bin" "$tmp/bad/tok_001.bin"
printf '\xff\xff' | dd of="$tmp/bad/tok_001.bin" bs=1 seek=$((1024 + 2 * 7)) conv=notrunc 2>/dev/null
expect_error bad-token "tok_001.bin: token 65535 at offset 7 is outside the vocabulary \(vocab_size 256\)" \
    "$bin" train "$cfg" "${run[@]}" --set train.steps=50 --set checkpoint.save_every=1 \
    --set data.train_files="$tmp/bad/tok_*.bin" --set run.out_dir="$tmp/r8"
[ ! -e "$tmp/r8" ] && ok || fail "a bad token left output: $(ls -R "$tmp/r8")"
expect_error bad-val-token "tok_001.bin: token 65535 at offset 7" "$bin" train "$cfg" "${run[@]}" \
    --set data.train_files="$tmp/d/arith_train_*.bin" --set data.val_files="$tmp/bad/tok_*.bin" \
    --set run.out_dir="$tmp/r8"
# a large set gets progress lines
"$bin" data "$cfg" --set gen.output="$tmp/many/arith" --set gen.problems=2000 \
    --set gen.shard_tokens=600 >/dev/null 2>&1 || fail "data (many shards)"
nmany=$(ls "$tmp/many"/arith_train_*.bin | wc -l)
"$bin" train "$cfg" "${run[@]}" --set train.steps=1 --set data.train_files="$tmp/many/arith_train_*.bin" \
    --set run.out_dir="$tmp/r9" > "$tmp/many.log" 2>&1
grep -Eq "^checking data.train_files: $nmany shards, [0-9]+ tokens, over 1 rank$" "$tmp/many.log" &&
    grep -q "^checked data.train_files in " "$tmp/many.log" && [ "$nmany" -ge 16 ] && ok ||
    fail "no progress lines for $nmany shards: $(head -n 3 "$tmp/many.log")"
expect_error text-missing "nofile.txt: No such file or directory" "$bin" data \
    --set gen.kind=text --set gen.input="$tmp/nofile.txt" --set gen.output="$tmp/t/x"
[ -z "$(ls "$tmp/t" 2>/dev/null)" ] && ok || fail "data left output after an error"

# checkpoint mistakes: train 2 steps, then resume from damaged or foreign checkpoints
good=(--set data.train_files="$tmp/d/arith_train_*.bin" "${run[@]}")
"$bin" train "$cfg" "${good[@]}" --set run.out_dir="$tmp/ok" >/dev/null 2>&1 || fail "train"
ck="$tmp/ok/checkpoints/step_00000002.safetensors"
# a run directory is one run's: a new run into it is refused with the ways out named (its files
# untouched); run.overwrite = true clears it and starts over; checkpoint.resume = auto continues
before=$(cat "$tmp/ok/metrics.jsonl")
expect_error dir-held "run.out_dir .*/ok holds a run already \\([0-9]+ of its files.*set checkpoint.resume = auto to continue it, run.overwrite = true to start over" \
    "$bin" train "$cfg" "${good[@]}" --set run.out_dir="$tmp/ok"
[ "$(cat "$tmp/ok/metrics.jsonl")" = "$before" ] && [ -f "$ck" ] && ok ||
    fail "a refused run into a held directory changed it"
cp -r "$tmp/ok" "$tmp/ow"
"$bin" train "$cfg" "${good[@]}" --set run.out_dir="$tmp/ow" --set run.overwrite=true \
    --set train.steps=1 --set train.warmup_steps=1 > "$tmp/ow.log" 2>&1 || fail "run.overwrite run"
grep -q "^run.overwrite: cleared .*/ow" "$tmp/ow.log" && [ "$(ls "$tmp/ow/checkpoints")" = step_00000001.safetensors ] &&
    [ "$(grep -c '"loss"' "$tmp/ow/metrics.jsonl")" = 1 ] && [ "$(ls "$tmp/ow" | grep -c tfevents)" = 1 ] && ok ||
    fail "run.overwrite left the earlier run: $(ls "$tmp/ow" "$tmp/ow/checkpoints")"
# TensorBoard holds the resolved configuration as text (train/config), config.ini's lines
grep -aq 'train/config' "$tmp"/ow/events.out.tfevents.* && grep -aq '    \[train\]' "$tmp"/ow/events.out.tfevents.* &&
    ok || fail "no train/config text in the event file"
# config.ini says what made the run: version and commit, the command line, ranks, backend and
# device; so does every checkpoint of the run (its stored configuration is config.ini's text)
head -n 3 "$tmp/ok/config.ini" | tr '\n' '|' | grep -Eq "^# lowbit [0-9.]+ \(commit ([0-9a-f]+(-dirty)?|unknown)\)\|# command: lowbit train .*tiny-moe.cfg --set data.train_files=.*\|# 1 rank, run.backend cpu \(host, [0-9]+ threads?\)\|$" &&
    ok || fail "config.ini's provenance: $(head -n 3 "$tmp/ok/config.ini")"
for f in "$tmp"/ok/checkpoints/step_*.safetensors; do
    grep -aq '# command: lowbit train .*tiny-moe.cfg' "$f" && grep -aq '# 1 rank, run.backend cpu (host' "$f" &&
        ok || fail "$f: no provenance in its stored configuration"
    # a checkpoint as FILE: its stored configuration, so `lowbit info` describes its model
    diff <("$bin" info "$f" 2>&1 | grep -v '^CUDA') <("$bin" info "$tmp/ok/config.ini" 2>&1 | grep -v '^CUDA') > /dev/null &&
        "$bin" info "$f" | grep -q "^shape  *[0-9]* layers, hidden" && ok ||
        fail "info on a checkpoint: $("$bin" info "$f" 2>&1 | head -n 3)"
done
"$bin" --version | grep -Eq "^lowbit [0-9.]+ \(commit ([0-9a-f]+(-dirty)?|unknown)\)$" && ok ||
    fail "--version: $("$bin" --version)"
[ -f "$ck" ] && ok || fail "no checkpoint written"
# a model far too large for the machine stops before any work, with lowbit info's sizes and
# the settings that lower them, not inside an allocation
expect_error too-big "a training step needs about [0-9.]+ GiB on rank 0 \\(parameters and gradients [0-9.]+, .*\\) and the cpu backend has [0-9.]+ GiB of physical memory: lower train.micro_batch" \
    "$bin" train "$cfg" "${good[@]}" --set run.out_dir="$tmp/big" --set model.hidden_size=8192 \
    --set model.num_hidden_layers=64 --set model.moe_intermediate_size=8192 \
    --set model.num_experts=64 --set model.head_dim=128 --set model.num_attention_heads=64 \
    --set model.num_key_value_heads=8
[ ! -e "$tmp/big" ] && ok || fail "a refused model left $tmp/big"
# a metrics write that fails (a full disk: /dev/full answers every write with ENOSPC) stops the
# run with the reason, never a silent exit 0 with rows missing
mkdir -p "$tmp/full" && ln -s /dev/full "$tmp/full/metrics.jsonl"
expect_error full-disk "full/metrics.jsonl: cannot write: No space left on device" \
    "$bin" train "$cfg" "${good[@]}" --set run.out_dir="$tmp/full" --set checkpoint.resume=auto
# without a tokenizer a completion's tokens are bytes; an id past 255 (a vocabulary of 300)
# prints as <unk:ID>, not as its low byte
"$bin" train "$cfg" "${good[@]}" --set model.vocab_size=300 --set run.out_dir="$tmp/v300" \
    >/dev/null 2>&1 || fail "train (vocabulary 300)"
"$bin" sample --set sample.checkpoint="$tmp/v300/checkpoints/step_00000002.safetensors" \
    --set sample.problems=8 --set sample.samples=4 --set sample.max_new_tokens=32 \
    --set sample.temperature=100 > "$tmp/v300.out" 2>&1 || fail "sample (vocabulary 300)"
grep -q '<unk:2[5-9][0-9]>' "$tmp/v300.out" && ok ||
    fail "sample: no id past 255 printed as <unk:ID>: $(head -n 3 "$tmp/v300.out")"
# the temporaries a killed save leaves go with the next run in the directory, unless their
# process still lives (another save in progress)
mkdir -p "$tmp/sw/checkpoints"
dead=$(sh -c 'echo $$')   # a process that has ended
touch "$tmp/sw/checkpoints/step_00000001.safetensors.tmp.$dead" \
      "$tmp/sw/checkpoints/step_00000001.safetensors.tmp.$$" \
      "$tmp/sw/metrics.jsonl.tmp.$dead" "$tmp/sw/config.ini.tmp.$dead"
"$bin" train "$cfg" "${good[@]}" --set run.out_dir="$tmp/sw" >/dev/null 2>&1 || fail "train (sweep)"
[ ! -e "$tmp/sw/checkpoints/step_00000001.safetensors.tmp.$dead" ] &&
    [ -e "$tmp/sw/checkpoints/step_00000001.safetensors.tmp.$$" ] && ok ||
    fail "temporaries of killed saves: $(ls "$tmp/sw/checkpoints")"
# and those of a metrics rewrite (a resume) or a configuration write killed midway
[ ! -e "$tmp/sw/metrics.jsonl.tmp.$dead" ] && [ ! -e "$tmp/sw/config.ini.tmp.$dead" ] && ok ||
    fail "temporaries of killed writes: $(ls "$tmp/sw")"
# poke FILE OLD NEW: overwrites the first OLD in FILE with NEW (the same length), in place
poke() {
    local at
    at=$(LC_ALL=C grep -obUaF -- "$2" "$1" | head -n 1 | cut -d: -f1)
    [ -n "$at" ] || { fail "poke: '$2' not in $1"; return 1; }
    printf '%s' "$3" | dd of="$1" bs=1 seek="$at" conv=notrunc 2>/dev/null
}
# the header CRC covers the metadata and the tensor table: an edited step, loader position or
# stored model is refused by resume and by sample, naming the file
edit() { cp "$ck" "$tmp/$1.safetensors"; poke "$tmp/$1.safetensors" "$2" "$3"; }
edit step '"step":"2"' '"step":"3"'
expect_error edited-step "step.safetensors: header checksum mismatch" "$bin" train "$cfg" \
    "${good[@]}" --set run.out_dir="$tmp/r6" --set checkpoint.resume="$tmp/step.safetensors"
expect_error edited-step-sample "step.safetensors: header checksum mismatch" "$bin" sample \
    --set sample.checkpoint="$tmp/step.safetensors" --set sample.problems=2
edit pos '"loader_pos":"' '"loader_pos":"1'
expect_error edited-pos "pos.safetensors: header checksum mismatch" "$bin" train "$cfg" \
    "${good[@]}" --set run.out_dir="$tmp/r6" --set checkpoint.resume="$tmp/pos.safetensors"
edit rope 'rope_theta = 10000' 'rope_theta = 10001'
expect_error edited-rope "rope.safetensors: header checksum mismatch" "$bin" sample \
    --set sample.checkpoint="$tmp/rope.safetensors" --set sample.problems=2
edit topk 'num_experts_per_tok = 2' 'num_experts_per_tok = 1'
expect_error edited-topk "topk.safetensors: header checksum mismatch" "$bin" sample \
    --set sample.checkpoint="$tmp/topk.safetensors" --set sample.problems=2
# a resumed run continues the checkpoint's model: a changed key that changes no tensor's shape
# (rope_theta, num_experts_per_tok) is refused, as sample refuses it
expect_error resume-rope "step_00000002.safetensors: model.rope_theta is 10000 in the checkpoint, 10001 in this run" \
    "$bin" train "$cfg" "${good[@]}" --set run.out_dir="$tmp/r7" --set checkpoint.resume="$ck" \
    --set model.rope_theta=10001
expect_error resume-topk "model.num_experts_per_tok is 2 in the checkpoint, 1 in this run" \
    "$bin" train "$cfg" "${good[@]}" --set run.out_dir="$tmp/r7" --set checkpoint.resume="$ck" \
    --set model.num_experts_per_tok=1
# a corrupt name among the optimizer's moments is an error, never zero moments
edit moment 'optimizer.exp_avg.' 'optimizer.exp_avX.'
expect_error moment-name "moment.safetensors: tensor 'optimizer\.exp_avg\..*' is missing; the file holds 'optimizer\.exp_avX\..*' instead" \
    "$bin" train "$cfg" "${good[@]}" --set run.out_dir="$tmp/r6" \
    --set checkpoint.resume="$tmp/moment.safetensors"
# every metadata field is checked: a negative step (a checkpoint at step 10 makes room for it)
"$bin" train "$cfg" "${good[@]}" --set train.steps=10 --set run.out_dir="$tmp/ok10" \
    >/dev/null 2>&1 || fail "train 10"
cp "$tmp/ok10/checkpoints/step_00000010.safetensors" "$tmp/neg.safetensors"
poke "$tmp/neg.safetensors" '"step":"10"' '"step":"-9"'
expect_error negative-step "neg.safetensors: metadata 'step' is '-9': not a whole number" \
    "$bin" train "$cfg" "${good[@]}" --set run.out_dir="$tmp/r6" \
    --set checkpoint.resume="$tmp/neg.safetensors"
expect_error negative-step-sample "neg.safetensors: metadata 'step' is '-9': not a whole number" \
    "$bin" sample --set sample.checkpoint="$tmp/neg.safetensors" --set sample.problems=2
cp "$tmp/ok10/checkpoints/step_00000010.safetensors" "$tmp/crc.safetensors"
poke "$tmp/crc.safetensors" '"crc32":"' '"crc32":"X'
expect_error bad-crc-field "crc.safetensors: metadata 'crc32' is 'X.*': not 8 hex digits" \
    "$bin" sample --set sample.checkpoint="$tmp/crc.safetensors" --set sample.problems=2
# a checkpoint of format 1 (no header CRC, before 2026-12-02) still resumes
edit old 'lowbit-checkpoint-2' 'lowbit-checkpoint-1'
"$bin" train "$cfg" "${good[@]}" --set train.steps=3 --set run.out_dir="$tmp/r7" \
    --set checkpoint.resume="$tmp/old.safetensors" > "$tmp/r7.log" 2>&1 &&
    grep -q "resumed from .*old.safetensors at step 2" "$tmp/r7.log" && ok ||
    fail "format-1 checkpoint: $(cat "$tmp/r7.log")"
[ ! -e "$tmp/r6" ] && ok || fail "a refused checkpoint left output: $(ls -A "$tmp/r6")"
head -c 5000 "$ck" > "$tmp/trunc.safetensors"
expect_error trunc-ckpt "trunc.safetensors: " "$bin" train "$cfg" "${good[@]}" \
    --set run.out_dir="$tmp/r3" --set checkpoint.resume="$tmp/trunc.safetensors"
expect_error shape-ckpt "step_00000002.safetensors: tensor '.*' has shape \[.*\], the model expects" \
    "$bin" train "$cfg" "${good[@]}" --set model.hidden_size=48 \
    --set run.out_dir="$tmp/r4" --set checkpoint.resume="$ck"
expect_error missing-ckpt "gone.safetensors: No such file or directory" "$bin" train "$cfg" \
    "${good[@]}" --set run.out_dir="$tmp/r5" --set checkpoint.resume="$tmp/gone.safetensors"
[ ! -e "$tmp/r5/checkpoints/step_00000002.safetensors" ] && ok || fail "output after a bad resume"
[ ! -e "$tmp/r5/checkpoints" ] && ok || fail "an empty checkpoints directory after a bad resume"

# Hugging Face conversion mistakes
expect_error hf-missing "nodir/config.json: No such file or directory" "$bin" convert \
    --set convert.input="$tmp/nodir" --set convert.output="$tmp/x.safetensors"
[ ! -e "$tmp/x.safetensors" ] && ok || fail "convert left output after an error"
mkdir -p "$tmp/hf"
cp "$src/tests/data/hf_qwen3_moe/config.json" "$tmp/hf/"
head -c 4000 "$src/tests/data/hf_qwen3_moe/model.safetensors" > "$tmp/hf/model.safetensors"
expect_error hf-trunc "hf/model.safetensors: " "$bin" convert --set convert.input="$tmp/hf" \
    --set convert.output="$tmp/y.safetensors"
[ ! -e "$tmp/y.safetensors" ] && ok || fail "convert left output after a truncated import"
# config.json with a key twice: transformers takes the last, so importing the first would be
# another model; and bytes after the object
mkdir -p "$tmp/hfd" && cp "$src/tests/data/hf_qwen3_moe/model.safetensors" "$tmp/hfd/"
sed 's/"rope_theta": \([0-9.e+]*\)/"rope_theta": \1, "rope_theta": 500000.0/' \
    "$src/tests/data/hf_qwen3_moe/config.json" > "$tmp/hfd/config.json"
expect_error hf-dup "hfd/config.json:[0-9]+: key \"rope_theta\" twice in one object" "$bin" convert \
    --set convert.input="$tmp/hfd" --set convert.output="$tmp/z.safetensors"
{ cat "$src/tests/data/hf_qwen3_moe/config.json"; echo '{}'; } > "$tmp/hfd/config.json"
expect_error hf-tail "hfd/config.json:[0-9]+: bytes after the JSON value" "$bin" convert \
    --set convert.input="$tmp/hfd" --set convert.output="$tmp/z.safetensors"
[ ! -e "$tmp/z.safetensors" ] && ok || fail "convert left output after a bad config.json"

# A full disk under convert and data: the message names the file and the reason, and nothing of
# the failed command is left. A write's temporary (PATH.tmp.PID, the PID the one exec keeps) is
# made a link to /dev/full, which answers every write with ENOSPC.
on_full() {   # on_full PATH CMD...: CMD runs with PATH's temporary on /dev/full
    sh -c 'ln -s /dev/full "$0.tmp.$$" && exec "$@"' "$@"
}
"$bin" convert --set convert.input="$src/tests/data/hf_qwen3_moe" \
    --set convert.output="$tmp/ck.safetensors" >/dev/null 2>&1 || fail "convert (import)"
mkdir -p "$tmp/fi" "$tmp/fe"
expect_error full-import "fi/ck.safetensors: write failed: No space left on device" \
    on_full "$tmp/fi/ck.safetensors" "$bin" convert \
    --set convert.input="$src/tests/data/hf_qwen3_moe" --set convert.output="$tmp/fi/ck.safetensors"
[ -z "$(ls -A "$tmp/fi")" ] && ok || fail "full-import left $(ls -A "$tmp/fi")"
# config.json, written last: the export's model.safetensors goes too (no partial export)
expect_error full-export "fe/config.json: write failed: No space left on device" \
    on_full "$tmp/fe/config.json" "$bin" convert --set convert.direction=export \
    --set convert.input="$tmp/ck.safetensors" --set convert.output="$tmp/fe"
[ -z "$(ls -A "$tmp/fe")" ] && ok || fail "full-export left $(ls -A "$tmp/fe")"
# data: a run that fails before its first shard leaves an earlier corpus as it was; one that
# fails after (the val shard, written after the train one) removes the mix of both corpora
gen=(data --set gen.output="$tmp/fd/arith" --set gen.problems=200)
"$bin" "${gen[@]}" >/dev/null 2>&1 || fail "data (earlier corpus)"
old=$(ls -i "$tmp/fd")
expect_error full-data "fd/arith_train_000.bin: write failed: No space left on device" \
    on_full "$tmp/fd/arith_train_000.bin" "$bin" "${gen[@]}"
[ "$(ls -i "$tmp/fd")" = "$old" ] && ok || fail "full-data changed the earlier corpus: $(ls -A "$tmp/fd")"
expect_error full-data-val "fd/arith_val_000.bin: write failed: No space left on device" \
    on_full "$tmp/fd/arith_val_000.bin" "$bin" "${gen[@]}"
[ -z "$(ls -A "$tmp/fd")" ] && ok || fail "full-data-val left $(ls -A "$tmp/fd")"
# the directories a failed command made go too: a 64 KiB tmpfs in a user namespace (where the
# system allows one) fills up under each command's first write
mkdir -p "$tmp/mnt"
if unshare -rm sh -c "mount -t tmpfs -o size=64k tmpfs '$tmp/mnt'" 2>/dev/null; then
    unshare -rm sh -c 'mount -t tmpfs -o size=64k tmpfs "$1" && cd "$1" || exit 1
        "$2" data --set gen.output=new/d/arith --set gen.problems=20000 2>>err.log
        "$2" convert --set convert.input="$3" --set convert.output=new/i/ck.safetensors 2>>err.log
        "$2" convert --set convert.direction=export --set convert.input="$4" \
            --set convert.output=new/e 2>>err.log
        cat err.log; rm err.log; ls -A' sh "$tmp/mnt" "$bin" "$src/tests/data/hf_qwen3_moe" \
        "$tmp/ck.safetensors" > "$tmp/tmpfs.out" 2>&1
    [ "$(grep -c 'No space left on device' "$tmp/tmpfs.out")" = 3 ] && ok ||
        fail "tmpfs: not three write failures: $(cat "$tmp/tmpfs.out")"
    grep -q '^new$' "$tmp/tmpfs.out" && fail "tmpfs: a failed command left new/" || ok
else
    echo "SKIP: no tmpfs in a user namespace here (the directories of failed commands)"
fi

# An allocation that fails names how much and what for, with the settings that lower it (an
# address-space limit stands in for a small machine; one thread keeps the process's own small;
# not under AddressSanitizer, whose shadow memory takes more address space than the limit).
[ -n "${ASAN_OPTIONS-}" ] || ( ulimit -v 3000000 && before=$failed
  OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 expect_error oom \
      "cpu alloc: out of host memory: [0-9]+ bytes for the activations of a 1024 x 64 micro-batch \\(lower train.micro_batch" \
      "$bin" bench "$cfg" --set bench.kind=train --set run.threads=1 --set train.micro_batch=1024 \
      --set bench.warmup=0 --set bench.iters=1
  [ "$failed" = "$before" ] ) && ok || fail "oom: see above"
# the same in a training run: it stops before it writes anything, so no run.out_dir is left
"$bin" data --set gen.output="$tmp/big/arith" --set gen.problems=20000 >/dev/null 2>&1 ||
    fail "data (20000 problems)"
[ -n "${ASAN_OPTIONS-}" ] || ( ulimit -v 3000000 && before=$failed
  OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 expect_error oom-train \
      "cpu alloc: out of host memory: [0-9]+ bytes for the activations of a 1024 x 64 micro-batch \\(lower train.micro_batch" \
      "$bin" train "$cfg" --set data.train_files="$tmp/big/arith_train_*.bin" \
      --set data.val_files= --set train.steps=2 --set train.warmup_steps=0 \
      --set run.out_dir="$tmp/oom/run" --set run.threads=1 --set train.micro_batch=1024
  [ "$failed" = "$before" ] ) && ok || fail "oom-train: see above"
[ -n "${ASAN_OPTIONS-}" ] || { [ ! -e "$tmp/oom" ] && ok || fail "oom-train left $(find "$tmp/oom")"; }

summary
