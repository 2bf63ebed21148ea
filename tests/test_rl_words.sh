#!/bin/bash
# examples/rl-words.cfg end to end on the CPU (doc/rl.md, "Your own prompts"): sums in words
# through the KJV tokenizer. examples/word_sums.sh writes the pretraining text, `lowbit data
# tokenize` and `lowbit train` (examples/word-sums.cfg) give a small MoE that writes the sum in
# digits or in words; GRPO, paid for the right sum in digits, then
# - agrees exactly with its trainer (log-prob difference 0, routing agreement 1) on every step,
# - raises the reward: the last three steps' mean well above the first step's,
# - evaluates pass@1, pass@k and greedy accuracy on the 9 held-out prompts,
# - and its policy completes prompts with words of the tokenizer, not stray bytes.
set -euo pipefail
fail_fast=1   # each step builds on the ones before it
. "${LB_SRCDIR:-.}/tests/lib.sh"
. "$src/tests/rl_exact.sh"   # field, exact
tok=(--set data.tokenizer="$src/tests/data/tok_kjv/tokenizer.json" --set run.threads=1)

sh "$src/examples/word_sums.sh" corpus > "$tmp/sums.jsonl"
# the prompt set is the script's, as committed
sh "$src/examples/word_sums.sh" prompts | cmp -s - "$src/examples/rl-words.jsonl" ||
    fail "examples/rl-words.jsonl is not what examples/word_sums.sh prompts writes"
"$bin" data tokenize "$src/examples/word-sums.cfg" "${tok[@]}" --set gen.input="$tmp/sums.jsonl" \
    --set gen.output="$tmp/sums" > /dev/null
"$bin" train "$src/examples/word-sums.cfg" "${tok[@]}" --set data.train_files="$tmp/sums_train_*.bin" \
    --set run.out_dir="$tmp/pre" > /dev/null
init="$tmp/pre/checkpoints/step_00000200.safetensors"
[ -f "$init" ] || fail "no pretrained checkpoint"

"$bin" rl "$src/examples/rl-words.cfg" "${tok[@]}" --set rl.init="$init" \
    --set rl.prompts_file="$src/examples/rl-words.jsonl" --set train.log_every=0 \
    --set run.out_dir="$tmp/rl" > "$tmp/rl.log"
m="$tmp/rl/metrics.jsonl"
grep -q "prompts from .*rl-words.jsonl: 36 to train, 9 to validate" "$tmp/rl.log" ||
    { cat "$tmp/rl.log"; fail "the run does not say where its prompts come from"; }
[ "$(field step "$m" | wc -l)" = 16 ] || fail "expected 16 RL steps"
exact rl-words "$m"
# the reward rises: the last three steps' mean more than 0.3 above the first step's
r=$(field reward_mean "$m" | xargs)
echo "reward_mean per step: $r"
echo "$r" | awk '{ last = ($14 + $15 + $16) / 3; exit !(last > $1 + 0.3) }' ||
    fail "the reward did not rise: $r"
grep -o '"step": [0-9]*, "eval_pass_at_1": [^,]*, "eval_pass_at_k": .*"eval_greedy": [^,}]*' \
    "$m" > "$tmp/eval"
[ "$(wc -l < "$tmp/eval")" = 5 ] || fail "expected evaluations at steps 0, 4, 8, 12 and 16"
cat "$tmp/eval"

# The trained policy, greedy, on three of the problems: each completion a space, a number in digits
# or a number word, a full stop and the end of text.
"$bin" sample "$src/examples/rl-words.cfg" "${tok[@]}" \
    --set sample.checkpoint="$tmp/rl/checkpoints/step_00000016.safetensors" --set sample.top_k=1 \
    --prompt 'two and three are' --prompt 'four and four are' --prompt 'one and eight are' \
    2> /dev/null | grep -v '^#' > "$tmp/sample"
cut -f 1,2 "$tmp/sample"
words='one|two|three|four|five|six|seven|eight|nine|ten'
bad=$(cut -f 2 "$tmp/sample" | grep -Evx " ([0-9]+|$words)\.<\|endoftext\|>" || true)
[ -z "$bad" ] && [ "$(wc -l < "$tmp/sample")" = 3 ] || fail "completions not words: $bad"
summary
