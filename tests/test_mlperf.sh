#!/bin/bash
# The MLPerf log ([mlperf], doc/mlperf.md): a tiny `lowbit train` run logs llama31_8b's keys,
# evaluates on its schedule, stops at the target and prints the time to train; its log passes
# `lowbit mlperf-check`, and the same log edited (a key missing, a wrong value, lines out of
# order, a broken evaluation, a wrong status, ...) fails it with the line and key named. The log
# reshaped to the benchmark's fixed sizes passes --strict. Two ranks write one log (rank 0's).
# `lowbit rl` logs qwen35_397b_grpo's keys alike.
set -uo pipefail
. "${LB_SRCDIR:-.}/tests/lib.sh"
mpi() { local np=$1; shift; timeout 300 mpirun --oversubscribe -np "$np" "$@"; }
# check_ok LOG [--strict]: the checker passes it
check_ok() {
    local log=$1; shift
    if "$bin" mlperf-check "$@" "$log" > "$tmp/check.out" 2>&1; then ok; else
        fail "mlperf-check $* $log:"; sed 's/^/    /' "$tmp/check.out"; fi
}
# check_bad NAME PATTERN LOG [--strict]: the checker fails it (exit 1) and says PATTERN
check_bad() {
    local name=$1 pattern=$2 log=$3; shift 3
    "$bin" mlperf-check "$@" "$log" > "$tmp/check.out" 2>&1
    local rc=$?
    if [ $rc -ne 1 ]; then fail "$name: mlperf-check exit $rc, expected 1"; cat "$tmp/check.out"; return; fi
    if ! grep -Eq -- "$pattern" "$tmp/check.out"; then
        fail "$name: the checker does not say '$pattern':"; sed 's/^/    /' "$tmp/check.out"; return
    fi
    ok
}

"$bin" data "$src/examples/tiny-moe.cfg" --set gen.output="$tmp/mla" --set gen.problems=4000 \
    --set gen.val_fraction=0.3 > /dev/null || { echo "FAIL: data"; exit 1; }
small=(--set data.train_files="$tmp/mla_train_*.bin" --set data.val_files="$tmp/mla_val_*.bin"
       --set model.hidden_size=48 --set model.num_hidden_layers=2 --set model.head_dim=16
       --set model.moe_intermediate_size=64 --set train.seq_len=32 --set train.micro_batch=8
       --set train.log_every=0 --set train.steps=200 --set train.warmup_steps=5
       --set train.lr=0.003 --set train.min_lr=0.0003 --set train.adam_eps=1e-5
       --set checkpoint.save_every=-1 --set mlperf.enabled=true --set mlperf.eval_samples=64)

# 1. A run to a target: evaluations every 80 sequences (10 steps), stop at log-perplexity 2.0.
"$bin" train "$src/examples/tiny-moe.cfg" "${small[@]}" --set mlperf.eval_every=80 \
    --set mlperf.target=2.0 --set run.out_dir="$tmp/run" > "$tmp/run.log" 2>&1 ||
    { fail "the run:"; tail -5 "$tmp/run.log"; }
good=$tmp/run/mlperf.log
grep -q "^mlperf: target 2 reached at [0-9]* samples; time to train [0-9.]* s" "$tmp/run.log" &&
    ok || { fail "no time to train:"; tail -3 "$tmp/run.log"; }
# it stopped at the target, before train.steps, at an evaluation
steps=$(grep -c '"loss"' "$tmp/run/metrics.jsonl")
[ "$steps" -lt 200 ] && [ $((steps % 10)) = 0 ] && ok || fail "$steps steps: not stopped at an evaluation"
grep -q '"key": "run_stop".*"status": "success"' "$good" && ok || fail "run_stop is not a success"
# every line is an MLLOG event; the keys the issue names are there, once
[ "$(grep -vc '^:::MLLOG {"namespace": "", "time_ms": [0-9]*, "event_type": "' "$good")" = 0 ] &&
    ok || fail "a line of the log is not an MLLOG event"
for k in submission_org submission_platform submission_division submission_benchmark \
         global_batch_size gradient_accumulation_steps max_sequence_length opt_name \
         opt_adamw_beta_1 opt_adamw_beta_2 opt_adamw_epsilon opt_adamw_weight_decay \
         opt_gradient_clip_norm opt_base_learning_rate opt_end_learning_rate \
         opt_learning_rate_warmup_steps opt_learning_rate_decay_steps init_start init_stop \
         run_start run_stop train_samples eval_samples lowest_numerical_precision_in_linear; do
    [ "$(grep -c "\"key\": \"$k\"" "$good")" = 1 ] || fail "key $k not logged once"
done
grep -q '"key": "eval_accuracy", "value": [0-9.]*, "metadata": {[^}]*"samples_count": 80}' "$good" &&
    ok || fail "no eval_accuracy at 80 samples"
grep -q '"key": "max_sequence_length", "value": 32,' "$good" && ok || fail "max_sequence_length"
grep -q '"key": "opt_learning_rate_decay_steps", "value": 195,' "$good" && ok || fail "decay steps"
check_ok "$good"

# 2. The edited logs fail, naming the line and the key.
edit() { sed "$1" "$good" > "$tmp/bad.log"; }
grep -v '"key": "opt_adamw_epsilon"' "$good" > "$tmp/bad.log"
check_bad "missing key" 'opt_adamw_epsilon: missing' "$tmp/bad.log"
edit 's/"opt_adamw_beta_2", "value": 0.95/"opt_adamw_beta_2", "value": 0.999/'
check_bad "wrong value" ':[0-9]+: opt_adamw_beta_2: value 0.999, the rules want 0.95' "$tmp/bad.log"
# a NUL byte would end the text there: the lines after it (a second run_stop, invalid) would go
# unchecked and the log pass; it is refused as not a text file (exit 2, as an unreadable log)
{ head -n 3 "$good"; printf '\0'; tail -n +4 "$good"
  grep '"key": "run_stop"' "$good" | sed 's/"success"/"bogus"/'; } > "$tmp/nul.log"
"$bin" mlperf-check "$tmp/nul.log" > "$tmp/check.out" 2>&1
rc=$?
[ $rc -eq 2 ] && grep -q "nul.log:4: a NUL byte (offset [0-9]*): this is not a text file" \
    "$tmp/check.out" && ok || { fail "NUL byte: exit $rc"; cat "$tmp/check.out"; }
# a key twice: the official checker (Python's json) takes the last value, cJSON the first
edit 's/"opt_adamw_beta_2", "value": 0.95/"opt_adamw_beta_2", "value": 0.95, "value": 0.999/'
check_bad "duplicate key" ':[0-9]+: not JSON after .*key "value" twice in one object' "$tmp/bad.log"
edit 's/"opt_name", "value": "adamw"/"opt_name", "value": "sgd"/'
check_bad "wrong optimizer" 'opt_name: value "sgd" is not one of: adamw' "$tmp/bad.log"
edit 's/"opt_end_learning_rate", "value": 0.0003/"opt_end_learning_rate", "value": 0.0001/'
check_bad "end learning rate" 'opt_end_learning_rate: 0.0001.*not 0.1 x opt_base' "$tmp/bad.log"
edit 's/"opt_learning_rate_decay_steps", "value": 195/"opt_learning_rate_decay_steps", "value": 200/'
check_bad "decay steps" 'opt_learning_rate_decay_steps: 200, not max_steps - warm-up' "$tmp/bad.log"
# run_start before init_stop
awk '/"key": "init_stop"/ { held = $0; next } { print } /"key": "run_start"/ { print held }' \
    "$good" > "$tmp/bad.log"
check_bad "run_start first" 'run_start: before init_stop' "$tmp/bad.log"
# a configuration key logged after the run started
awk '/"key": "opt_name"/ { held = $0; next } { print } /"key": "run_start"/ { print held }' \
    "$good" > "$tmp/bad.log"
check_bad "config key late" 'opt_name: a configuration key outside init_start' "$tmp/bad.log"
# an evaluation without its accuracy
awk '/"key": "eval_accuracy"/ && !done { done = 1; next } { print }' "$good" > "$tmp/bad.log"
check_bad "no accuracy" 'eval_stop: 0 eval_accuracy lines' "$tmp/bad.log"
# an evaluation inside a block (its block_stop dropped)
awk '/"key": "block_stop"/ && !done { done = 1; next } { print }' "$good" > "$tmp/bad.log"
check_bad "eval in a block" 'eval_start: inside an open block' "$tmp/bad.log"
# the second evaluation moved by one step: off the schedule
edit 's/"samples_count": 160}/"samples_count": 168}/'
check_bad "off schedule" 'eval_accuracy: samples_count 240, the schedule.s is 256' "$tmp/bad.log"
edit 's/"status": "success"/"status": "aborted"/'
check_bad "status" 'run_stop: status is not success, but the target was reached' "$tmp/bad.log"
edit 's/"status": "success"/"status": "done"/'
check_bad "status word" 'run_stop: metadata status is not "success" or "aborted"' "$tmp/bad.log"
grep '"key": "run_stop"' "$good" >> "$tmp/bad.log"
check_bad "two run_stops" 'run_stop: a second run_stop' "$tmp/bad.log"
edit 's/"key": "train_samples", "value": \([0-9]*\)/"key": "train_samples", "value": 1\1/'
check_bad "train_samples" "train_samples: 1[0-9]*, but run_stop's samples_count" "$tmp/bad.log"
{ cat "$good"; echo ':::MLLOG {"namespace": "", "time_ms": 1, "key": '; } > "$tmp/bad.log"
check_bad "broken line" 'bad.log:[0-9]+: not JSON' "$tmp/bad.log"
# the run went on past the target (the first evaluation made to reach it)
awk '/"key": "eval_accuracy"/ && !done { sub(/"value": [0-9.e+-]*/, "\"value\": 1.5"); done = 1 }
     { print }' "$good" > "$tmp/bad.log"
check_bad "went on" 'eval_accuracy: the target 2 is reached here, but the run goes on' "$tmp/bad.log"
# the tiny run is not the benchmark's size
check_bad "strict sizes" 'max_sequence_length: value 32, the rules want 8192' "$good" --strict
"$bin" mlperf-check "$tmp/none.log" > "$tmp/check.out" 2>&1
[ $? = 2 ] && grep -q "none.log: " "$tmp/check.out" && ok || fail "an unreadable log: not exit 2"

# 3. --strict: a run whose evaluations fall every 192 sequences at 8 a step, to the default
# target 3.3, reshaped to the benchmark (x64: batch 512, evaluations every 12288 sequences;
# sequences of 8192, 1200000 steps, 1024 evaluation sequences) passes the strict rules.
"$bin" train "$src/examples/tiny-moe.cfg" "${small[@]}" --set mlperf.eval_every=192 \
    --set run.out_dir="$tmp/strict" > "$tmp/strict.log" 2>&1 ||
    { fail "the strict-shaped run:"; tail -5 "$tmp/strict.log"; }
grep -q '"samples_count": 192, "status": "success"' "$tmp/strict/mlperf.log" && ok ||
    fail "the strict-shaped run did not stop at its first evaluation"
sed -E -e 's/"samples_count": ([0-9]+)/"samples_count": \1@/g' \
    -e 's/"key": "train_samples", "value": ([0-9]+)/"key": "train_samples", "value": \1@/' \
    -e 's/"global_batch_size", "value": 8,/"global_batch_size", "value": 512,/' \
    -e 's/"max_sequence_length", "value": 32,/"max_sequence_length", "value": 8192,/' \
    -e 's/"max_steps", "value": 200,/"max_steps", "value": 1200000,/' \
    -e 's/"opt_learning_rate_decay_steps", "value": 195,/"opt_learning_rate_decay_steps", "value": 1199995,/' \
    -e 's/"eval_samples", "value": 64,/"eval_samples", "value": 1024,/' "$tmp/strict/mlperf.log" |
    awk '{ while (match($0, /[0-9]+@/)) {
               n = substr($0, RSTART, RLENGTH - 1) * 64
               $0 = substr($0, 1, RSTART - 1) n substr($0, RSTART + RLENGTH) }
           print }' > "$tmp/strict.mllog"
check_ok "$tmp/strict.mllog" --strict
sed 's/"opt_learning_rate_decay_steps", "value": 1199995,/"opt_learning_rate_decay_steps", "value": 195,/' \
    "$tmp/strict.mllog" > "$tmp/bad.log"
check_bad "strict decay" 'opt_learning_rate_decay_steps: 195, not max_steps - warm-up steps = 1199995' \
    "$tmp/bad.log" --strict
sed 's/"samples_count": 12288/"samples_count": 11776/g' "$tmp/strict.mllog" > "$tmp/bad.log"
check_bad "strict schedule" 'samples_count 11776, the schedule.s is 12288' "$tmp/bad.log" --strict

# 4. Two ranks: one log, rank 0's, with the communication's precision; it passes.
mpi 2 "$bin" train "$src/examples/tiny-moe.cfg" "${small[@]}" --set train.grad_accum=2 \
    --set mlperf.eval_every=80 --set mlperf.target=2.2 --set run.out_dir="$tmp/two" \
    > "$tmp/two.log" 2>&1 || { fail "two ranks:"; tail -5 "$tmp/two.log"; }
[ "$(grep -c '"key": "run_start"' "$tmp/two/mlperf.log")" = 1 ] && ok || fail "two ranks: not one log"
[ "$(grep -c '^mlperf: target' "$tmp/two.log")" = 1 ] && ok || fail "two ranks: not one time to train"
grep -q '"lowest_numerical_precision_in_comm", "value": "fp32"' "$tmp/two/mlperf.log" && ok ||
    fail "two ranks: no lowest_numerical_precision_in_comm"
grep -q '"submission_platform", "value": "2xcpu"' "$tmp/two/mlperf.log" && ok || fail "platform"
check_ok "$tmp/two/mlperf.log"

# 5. Precision keys follow the recipe: mxfp4 on the GEMMs, bf16 attention.
"$bin" train "$src/examples/tiny-moe.cfg" "${small[@]}" --set train.steps=10 \
    --set model.hidden_size=64 --set mlperf.eval_every=80 --set precision.recipe=mxfp4 \
    --set run.out_dir="$tmp/fp4" > "$tmp/fp4.log" 2>&1 || { fail "mxfp4 run:"; tail -5 "$tmp/fp4.log"; }
grep -q '"lowest_numerical_precision_in_linear", "value": "mxfp4"' "$tmp/fp4/mlperf.log" &&
    grep -q '"lowest_numerical_precision_in_attn", "value": "bfloat16"' "$tmp/fp4/mlperf.log" &&
    ok || fail "mxfp4: precision keys"
check_ok "$tmp/fp4/mlperf.log"

# 6. Mistakes of the configuration: one line each, non-zero exit.
"$bin" train "$src/examples/tiny-moe.cfg" "${small[@]}" --set data.val_files= \
    --set run.out_dir="$tmp/e1" > "$tmp/out" 2> "$tmp/err"
[ $? -ne 0 ] && grep -q "mlperf.enabled: data.val_files is empty" "$tmp/err" && ok ||
    { fail "no val files: accepted"; cat "$tmp/err"; }
"$bin" train "$src/examples/tiny-moe.cfg" "${small[@]}" --set mlperf.eval_samples=12 \
    --set run.out_dir="$tmp/e2" > "$tmp/out" 2> "$tmp/err"
[ $? -ne 0 ] && grep -q "mlperf.eval_samples (12) is not a multiple of train.micro_batch (8)" \
    "$tmp/err" && ok || { fail "eval_samples 12: accepted"; cat "$tmp/err"; }
"$bin" train "$src/examples/tiny-moe.cfg" "${small[@]}" --set mlperf.eval_samples=8000 \
    --set run.out_dir="$tmp/e3" > "$tmp/out" 2> "$tmp/err"
[ $? -ne 0 ] && grep -q "fewer than mlperf.eval_samples (8000)" "$tmp/err" && ok ||
    { fail "a validation set too small: accepted"; cat "$tmp/err"; }

# the commands' --help list the [mlperf] keys; the checker's usage mistakes exit 2
"$bin" train --help > "$tmp/h1"; "$bin" rl --help > "$tmp/h2"
grep -Eq "^  mlperf.enabled +bool " "$tmp/h1" && grep -Eq "^  mlperf.val_temperature +float " \
    "$tmp/h2" && ok || fail "--help lacks the [mlperf] keys"
"$bin" mlperf-check --strct "$good" > /dev/null 2> "$tmp/err"
[ $? = 2 ] && grep -q "unknown option '--strct'" "$tmp/err" && ok || fail "mlperf-check --strct"
"$bin" mlperf-check > /dev/null 2>&1
[ $? = 2 ] && ok || fail "mlperf-check without a log: not exit 2"

"$bin" train "$src/examples/tiny-moe.cfg" "${small[@]}" --set mlperf.log_file=/nonexistent/m.log \
    --set run.out_dir="$tmp/e5" > "$tmp/out" 2> "$tmp/err"
[ $? -ne 0 ] && grep -q "/nonexistent/m.log: cannot open for writing: .* (mlperf.log_file)" \
    "$tmp/err" && ok || { fail "an unwritable mlperf.log_file: accepted"; cat "$tmp/err"; }

# 7. The benchmark's configuration parses and plans (it does not run here).
"$bin" info "$src/examples/mlperf-llama31-8b.cfg" > "$tmp/info.out" 2>&1 &&
    grep -q "^model  *llama" "$tmp/info.out" && ok ||
    { fail "examples/mlperf-llama31-8b.cfg:"; cat "$tmp/info.out"; }

# 8. `lowbit rl` in qwen35_397b_grpo's keys, from a small MoE pretrained here for 15 steps: the
# benchmark's hyperparameters at a global batch of 1 prompt x 16 generations (learning rate
# 1e-6 x sqrt(16 / 256), clip 0.125 x sqrt(256 / 16), AdamW 0.9 / 0.999 / 1e-8, no weight decay,
# a constant schedule), the first evaluation at 16 x ceil(2.5 + 3840 / 16) = 3888 samples, then
# one a step. The model is far from the target: the run ends aborted, and its log passes.
. "$src/tests/rl_setup.sh"   # the pretraining: $init
grpo=(--set rl.init="$init" --set rl.steps=245
      --set rl.prompts=1 --set rl.group=16 --set rl.eval_problems=4 --set sample.max_new_tokens=5
      --set train.lr=2.5e-7 --set train.min_lr=2.5e-7 --set train.warmup_steps=0
      --set train.beta2=0.999 --set train.adam_eps=1e-8 --set train.weight_decay=0
      --set train.grad_clip=0.5 --set train.log_every=0 --set checkpoint.save_every=-1
      --set mlperf.enabled=true)
"$bin" rl "$src/examples/rl-arith.cfg" "${grpo[@]}" --set run.out_dir="$tmp/rl" > "$tmp/rl.log" 2>&1 ||
    { fail "the rl run:"; tail -5 "$tmp/rl.log"; }
rllog=$tmp/rl/mlperf.log
grep -q "^mlperf: target 0.69 not reached in 3920 samples (status aborted)" "$tmp/rl.log" && ok ||
    { fail "rl: no time to train"; tail -3 "$tmp/rl.log"; }
for k in num_prompts_per_step num_generations_per_prompt generation_training_rollout_temperature \
         generation_training_rollout_top_p generation_validation_rollout_temperature \
         generation_validation_rollout_top_p init_checkpoint_step; do
    [ "$(grep -c "\"key\": \"$k\"" "$rllog")" = 1 ] || fail "rl: key $k not logged once"
done
[ "$(grep -o '"key": "eval_accuracy", "value": [0-9.]*, "metadata": {[^}]*"samples_count": [0-9]*' "$rllog" |
     sed 's/.*: //' | tr '\n' ' ')" = "3888 3904 3920 " ] && ok || fail "rl: evaluation points"
grep -q '"key": "submission_benchmark", "value": "qwen35_397b_grpo"' "$rllog" &&
    grep -q '"key": "opt_learning_rate_decay_schedule", "value": "constant"' "$rllog" && ok ||
    fail "rl: benchmark or schedule"
check_ok "$rllog"
# --strict: only the sizes of a tiny run and the target are wrong (mlcommons/logging's checker
# finds the same three)
"$bin" mlperf-check --strict "$rllog" > "$tmp/check.out" 2>&1
[ "$(grep -c ': max_sequence_length: value 10, the rules want 65536$\|: eval_samples: value 4, the rules want 256$\|eval_accuracy: none reaches the target 0.69$' "$tmp/check.out")" = 3 ] &&
    grep -q "3 problem(s)" "$tmp/check.out" && ok || { fail "rl --strict:"; cat "$tmp/check.out"; }
# the log edited to the benchmark's sizes and to a last evaluation above the target (a check of
# the checker, not a result) passes --strict; then broken one way each, it fails
last=$(grep -n '"key": "eval_accuracy"' "$rllog" | tail -1 | cut -d: -f1)
sed -e 's/"max_sequence_length", "value": 10,/"max_sequence_length", "value": 65536,/' \
    -e 's/"eval_samples", "value": 4,/"eval_samples", "value": 256,/' \
    -e "${last}s/\"value\": [0-9.]*/\"value\": 0.75/" -e 's/"status": "aborted"/"status": "success"/' \
    "$rllog" > "$tmp/rl-strict.log"
check_ok "$tmp/rl-strict.log" --strict
sed 's/"num_generations_per_prompt", "value": 16,/"num_generations_per_prompt", "value": 8,/' \
    "$tmp/rl-strict.log" > "$tmp/bad.log"
check_bad "rl generations" 'num_prompts_per_step x num_generations_per_prompt is 8, not global_batch_size 16' \
    "$tmp/bad.log"
check_bad "rl generations strict" 'num_generations_per_prompt: value 8, the rules want 16' \
    "$tmp/bad.log" --strict
sed 's/"opt_base_learning_rate", "value": 2.5e-07,/"opt_base_learning_rate", "value": 1e-06,/' \
    "$tmp/rl-strict.log" > "$tmp/bad.log"
check_bad "rl learning rate" 'opt_base_learning_rate: 1e-06, the rules want 1e-6 x sqrt\(16 / 256\) = 2.5e-07' \
    "$tmp/bad.log" --strict
sed 's/"opt_gradient_clip_norm", "value": 0.5,/"opt_gradient_clip_norm", "value": 1.0,/' \
    "$tmp/rl-strict.log" > "$tmp/bad.log"
check_bad "rl clip" 'opt_gradient_clip_norm: 1, the rules want 0.125 x sqrt\(256 / 16\) = 0.5' \
    "$tmp/bad.log" --strict
sed 's/"generation_training_rollout_temperature", "value": 1.0,/"generation_training_rollout_temperature", "value": 0.7,/' \
    "$tmp/rl-strict.log" > "$tmp/bad.log"
check_bad "rl temperature" 'generation_training_rollout_temperature: value 0.7, the rules want 1' \
    "$tmp/bad.log"
# the first evaluation dropped: the next is not at the benchmark's first point
grep -v '"samples_count": 3888}' "$tmp/rl-strict.log" > "$tmp/bad.log"
check_bad "rl first evaluation" 'samples_count 3904, the schedule.s is 3888' "$tmp/bad.log" --strict
"$bin" rl "$src/examples/rl-arith.cfg" "${grpo[@]}" --set rl.eval_problems=0 \
    --set run.out_dir="$tmp/e4" > "$tmp/out" 2> "$tmp/err"
[ $? -ne 0 ] && grep -q "rl.eval_problems is 0: mlperf.enabled evaluates on held-out problems" \
    "$tmp/err" && ok || { fail "rl without evaluation: accepted"; cat "$tmp/err"; }

summary
