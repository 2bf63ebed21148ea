#!/bin/bash
# `lowbit rl` on a JSON-lines prompt set with reference answers (doc/rl.md, "Your own
# prompts"), on the CPU, from a small MoE pretrained here on the arithmetic corpus:
# - examples/rl-prompts.cfg, built-in rewards (answer_exact, answer_regex): sampler and trainer agree exactly on every
#   step, validation pass@k runs, and the reward rises on a task the model learns in a few
#   steps (one-digit answers, which it does not give at first);
# - the reward command in batches, several at once, gives the rewards the built-in regex gives;
# - a resumed run continues bit for bit (the prompt order is a function of seed and step);
# - data parallelism (mpirun -np 2): the rollouts and rewards of one rank, exactly;
# - a chat template with data.tokenizer's special tokens, sampler and trainer still exact;
# - mistakes (a bad line, a reward command that fails its test line, an unknown special
#   token) refused before any work with file:line or the prompt.
set -euo pipefail
fail_fast=1   # each step builds on the ones before it
. "${LB_SRCDIR:-.}/tests/lib.sh"
cmp=${LB_BUILDDIR:-.}/tests/ckpt_compare
. "$src/tests/rl_exact.sh"   # field, exact

"$bin" data "$src/examples/tiny-moe.cfg" --set gen.output="$tmp/arith" --set gen.problems=3000 \
    > /dev/null
pre=(--set data.train_files="$tmp/arith_train_*.bin" --set data.val_files=
     --set model.hidden_size=32 --set model.num_hidden_layers=2 --set model.head_dim=16
     --set model.moe_intermediate_size=32 --set train.seq_len=32 --set train.micro_batch=8
     --set train.warmup_steps=2 --set train.log_every=0 --set run.backend=cpu --set run.threads=1)
"$bin" train "$src/examples/tiny-moe.cfg" "${pre[@]}" --set train.steps=150 \
    --set run.out_dir="$tmp/pre" > /dev/null
init="$tmp/pre/checkpoints/step_00000150.safetensors"
[ -f "$init" ] || fail "no pretrained checkpoint"

# examples/rl-prompts.cfg on examples/rl-prompts.jsonl: one-digit problems with one-digit
# answers, which the model pretrained on 0..99 answers with two or three digits at first.
cfg="$src/examples/rl-prompts.cfg"
rl=(--set rl.init="$init" --set rl.prompts_file="$src/examples/rl-prompts.jsonl"
    --set rl.prompts=8 --set rl.group=8 --set rl.eval_problems=10 --set rl.eval_every=4
    --set train.log_every=0 --set run.threads=1)

"$bin" rl "$cfg" "${rl[@]}" --set rl.steps=8 \
    --set checkpoint.save_every=4 --set run.out_dir="$tmp/a" > "$tmp/a.log"
m="$tmp/a/metrics.jsonl"
grep -q "prompts from .*rl-prompts.jsonl: 270 to train, 30 to validate" "$tmp/a.log" ||
    { cat "$tmp/a.log"; fail "the run does not say where its prompts come from"; }
[ "$(field step "$m" | wc -l)" = 8 ] || fail "expected 8 RL steps"
exact builtin "$m"
[ "$(grep -c '"eval_pass_at_k": .*"eval_problems": 10' "$m")" = 3 ] ||
    fail "expected validation pass@k on 10 prompts at steps 0, 4 and 8"
# the reward rises: the last three steps' mean well above the first step's
r=$(field reward_mean "$m" | xargs)
echo "reward_mean per step: $r"
echo "$r" | awk '{ last = ($6 + $7 + $8) / 3; exit !(last > $1 + 0.3) }' ||
    fail "the reward did not rise: $r"

# Resume from step 4: steps 5..8 and the final weights and moments as the uninterrupted run's.
"$bin" rl "$cfg" "${rl[@]}" --set rl.steps=8 \
    --set checkpoint.save_every=4 \
    --set checkpoint.resume="$tmp/a/checkpoints/step_00000004.safetensors" \
    --set run.out_dir="$tmp/b" > "$tmp/b.log"
strip() { grep '"reward_mean"' "$1" | sed 's/, "rollout_s".*//'; }
diff <(strip "$m" | tail -n 4) <(strip "$tmp/b/metrics.jsonl") ||
    fail "the resumed run's steps differ from the uninterrupted one's"
"$cmp" --moments "$tmp/a/checkpoints/step_00000008.safetensors" \
    "$tmp/b/checkpoints/step_00000008.safetensors" 0 > /dev/null ||
    fail "the resumed run's checkpoint differs"

# The reward command, 4 completions a call, 3 calls at once: 1 for a one-digit answer ended by
# the newline (the JSON line holds it escaped), as answer_regex above pays; the same run.
cat > "$tmp/digit.sh" <<'SH'
#!/bin/sh
# one JSON line in per completion, one number out per line; LC_ALL=C: a completion's bytes
# need not be UTF-8
LC_ALL=C sed -e 's/.*"completion": "[0-9]\\n".*/1/' -e t -e 's/.*/0/'
SH
chmod +x "$tmp/digit.sh"
regex=(--set rl.rewards=answer_regex --set 'rl.reward_regex=^[0-9]\n$' --set rl.steps=3)
command=(--set rl.rewards= --set rl.reward_command="$tmp/digit.sh" --set rl.reward_batch=4
         --set rl.reward_workers=3 --set rl.steps=3)
"$bin" rl "$cfg" "${rl[@]}" "${regex[@]}" --set run.out_dir="$tmp/re" > /dev/null
"$bin" rl "$cfg" "${rl[@]}" "${command[@]}" --set run.out_dir="$tmp/cmd" > /dev/null
diff <(strip "$tmp/re/metrics.jsonl") <(strip "$tmp/cmd/metrics.jsonl") > /dev/null ||
    fail "the reward command's run differs from the built-in regex's"
field reward_std "$tmp/cmd/metrics.jsonl" | awk '$1 > 0 { ok = 1 } END { exit !ok }' ||
    fail "the reward command gave equal rewards"

# Data parallelism: two ranks sample and score their own prompts (the command runs there);
# the rollouts, rewards and evaluations are one rank's exactly.
timeout 120 mpirun --oversubscribe -np 2 "$bin" rl "$cfg" "${rl[@]}" \
    "${command[@]}" --set run.out_dir="$tmp/dp2" > "$tmp/dp2.log" 2>&1 ||
    fail "dp2: $(tail -n 3 "$tmp/dp2.log")"
exact dp2 "$tmp/dp2/metrics.jsonl"
# per step: reward mean and std, correct, response length; and the evaluation lines
rollouts() { grep -o '"reward_mean": .*"response_len": [^,]*\|.*eval_pass.*' "$1"; }
diff <(rollouts "$tmp/cmd/metrics.jsonl") <(rollouts "$tmp/dp2/metrics.jsonl") ||
    fail "dp2: the rollouts, rewards or evaluations differ from one rank's"

# A chat template with the tokenizer's special tokens, from a model of its vocabulary.
tok="$src/tests/data/tok_kjv/tokenizer.json"
"$bin" train "$src/examples/tiny-moe.cfg" "${pre[@]}" --set model.vocab_size=4100 \
    --set train.steps=2 --set run.out_dir="$tmp/pre-bpe" > /dev/null
bpe=(--set rl.init="$tmp/pre-bpe/checkpoints/step_00000002.safetensors" --set data.tokenizer="$tok"
     --set sample.stop_tokens=0 --set rl.steps=2 --set rl.eval_every=0)
"$bin" rl "$cfg" "${rl[@]}" "${bpe[@]}" \
    --set 'rl.chat_template=<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n' \
    --set run.out_dir="$tmp/chat" > /dev/null
exact "chat template" "$tmp/chat/metrics.jsonl"

# mistakes, before any work (no run directory)
# expect_refused NAME PATTERN CMD...: expect_error, and no work done in the run directory
expect_refused() {
    local name=$1 pattern=$2
    shift 2
    rm -rf "$tmp/bad"
    expect_error "$name" "$pattern" "$@" --set run.out_dir="$tmp/bad"
    [ ! -e "$tmp/bad" ] || fail "$name: work was done"
}
{ head -n 2 "$src/examples/rl-prompts.jsonl"; echo '{"prompt": "1+1="}'; } > "$tmp/noanswer.jsonl"
expect_refused no-answer 'noanswer.jsonl:3: no "answer" as a string or a number' \
    "$bin" rl "$cfg" "${rl[@]}" --set rl.prompts_file="$tmp/noanswer.jsonl"
expect_refused bad-command "rl.reward_command: 'echo yes' printed 'yes' on line 1 of a batch of 1, not one number \(prompt '\?[0-9][-+][0-9]=', completion ''\)" \
    "$bin" rl "$cfg" "${rl[@]}" --set rl.reward_command="echo yes"
expect_refused bad-token "rl.chat_template: '<\|user\|>' is not a token of .*tokenizer.json" \
    "$bin" rl "$cfg" "${rl[@]}" "${bpe[@]}" \
    --set 'rl.chat_template=<|user|>{prompt}'
expect_refused no-val "rl.val_fraction is 0 and rl.val_file is empty" \
    "$bin" rl "$cfg" "${rl[@]}" --set rl.val_fraction=0
printf '[rl]\nprompts_file = %s\nrewards = answer_regex\nreward_regex = (\n' \
    "$src/examples/rl-prompts.jsonl" > "$tmp/regex.cfg"
expect_refused bad-regex "regex.cfg:4: rl.reward_regex: '\(' at offset 1: missing closing parenthesis" \
    "$bin" rl "$tmp/regex.cfg" --set rl.init="$init"
printf '[rl]\nprompts_file = %s\n' "$tmp/noanswer.jsonl" > "$tmp/noanswer.cfg"
expect_refused no-answer-cfg "noanswer.cfg:2: .*noanswer.jsonl:3: no \"answer\"" \
    "$bin" rl "$tmp/noanswer.cfg" --set rl.init="$init"
summary
