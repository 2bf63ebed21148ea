#!/bin/bash
# The small benchmark (examples/kjv-bench.cfg, doc/mlperf.md): the King James Bible of Debian's
# bible-kjv-text through the KJV tokenizer, a 0.75M-parameter Qwen3-MoE on the CPU reaches the
# stated validation log-perplexity (5.3) before its 400-step budget, stops there, prints the
# time to train, and its MLPerf log passes `lowbit mlperf-check`. Skipped (77) without the
# `bible` program (packages bible-kjv and bible-kjv-text, .ci/packages).
set -uo pipefail
command -v bible > /dev/null || { echo "SKIP: no bible program (apt-get install bible-kjv bible-kjv-text)"; exit 77; }
fail_fast=1   # each step builds on the ones before it
. "${LB_SRCDIR:-.}/tests/lib.sh"
bin=$(cd "$(dirname "$bin")" && pwd)/lowbit   # absolute: the run below works in $src

COLUMNS=80 bible gen1:1-rev22:21 > "$tmp/kjv.txt" || fail "bible"
[ "$(wc -c < "$tmp/kjv.txt")" -gt 4000000 ] || fail "the text is not the whole Bible"
cd "$src"   # the configuration names the tokenizer relative to the source tree
at=(--set gen.input="$tmp/kjv.txt" --set gen.output="$tmp/kjv"
    --set data.train_files="$tmp/kjv_train_*.bin" --set data.val_files="$tmp/kjv_val_*.bin"
    --set run.out_dir="$tmp/run")
"$bin" data tokenize examples/kjv-bench.cfg "${at[@]}" > "$tmp/tok.log" 2>&1 ||
    { cat "$tmp/tok.log"; fail "tokenize"; }
start=$(date +%s)
"$bin" train examples/kjv-bench.cfg "${at[@]}" > "$tmp/train.log" 2>&1 ||
    { tail -5 "$tmp/train.log"; fail "train"; }
echo "training took $(( $(date +%s) - start )) s"
grep "val loss\|^mlperf" "$tmp/train.log"
grep -q "^mlperf: target 5.3 reached at [0-9]* samples; time to train" "$tmp/train.log" ||
    fail "the target 5.3 was not reached in 400 steps"
steps=$(grep -c '"loss"' "$tmp/run/metrics.jsonl")
[ "$steps" -lt 400 ] || fail "the run did not stop at the target"
"$bin" mlperf-check "$tmp/run/mlperf.log" || fail "the log does not pass mlperf-check"
summary
