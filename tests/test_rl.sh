#!/bin/bash
# `lowbit rl` and `lowbit sample` end to end on a small MoE pretrained here for a few steps:
# - every precision recipe (and the fp8 KV cache, mini-batches, KL to the reference): in
#   deterministic mode the trainer's recomputed log-probs equal the sampler's on every step,
#   after weight updates too (train_rollout_logprob_abs_diff exactly 0, and its maximum);
# - a resumed RL run continues bit for bit;
# - `lowbit sample`: greedy output does not depend on slots or forward size, a seed reproduces;
# - configuration and reward-command mistakes stop with file:line or the command's name.
set -euo pipefail
src=${LB_SRCDIR:-.}
bin=${LB_BUILDDIR:-.}/lowbit
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

"$bin" data "$src/examples/tiny-moe.cfg" --set gen.output="$tmp/arith" --set gen.problems=3000 \
    > /dev/null
"$bin" train "$src/examples/tiny-moe.cfg" --set data.train_files="$tmp/arith_train_*.bin" \
    --set data.val_files= --set model.hidden_size=32 --set model.num_hidden_layers=2 \
    --set model.head_dim=16 --set model.moe_intermediate_size=32 --set train.seq_len=32 \
    --set train.micro_batch=8 --set train.steps=15 --set train.warmup_steps=2 \
    --set train.log_every=0 --set run.out_dir="$tmp/pre" > /dev/null
init="$tmp/pre/checkpoints/step_00000015.safetensors"
[ -f "$init" ] || fail "no pretrained checkpoint"

rl=(--set rl.init="$init" --set rl.steps=3 --set rl.prompts=4 --set rl.group=4
    --set rl.eval_problems=6 --set rl.eval_samples=2 --set rl.eval_every=2
    --set sample.max_new_tokens=5 --set train.lr=0.003 --set train.log_every=0
    --set checkpoint.save_every=2)

# field NAME FILE: the values of "NAME" in the step lines of a metrics file
field() { grep '"reward_mean"' "$2" | sed "s/.*\"$1\": \([^,}]*\).*/\1/"; }

check_zero() {   # NAME DIR: three steps, every abs_diff and its maximum exactly 0
    local m="$2/metrics.jsonl"
    [ "$(field step "$m" | wc -l)" = 3 ] || fail "$1: expected 3 RL steps in $m"
    for f in train_rollout_logprob_abs_diff train_rollout_logprob_abs_diff_max \
             train_rollout_k3_kl tis_clip_frac; do
        bad=$(field $f "$m" | grep -vx 0 || true)
        [ -z "$bad" ] || fail "$1: $f is $bad, not 0"
    done
    # the weights moved between rollouts (so steps 2 and 3 sampled from updated weights)
    field grad_norm "$m" | awk '$1 <= 0 { exit 1 }' || fail "$1: a zero gradient"
    grep -q '"eval_pass_at_1"' "$m" || fail "$1: no evaluation"
    echo "$1: train_rollout_logprob_abs_diff = 0 on every step"
}

for r in fp32 bf16 fp8-block mxfp8 nvfp4-moe mxfp4; do
    "$bin" rl "$src/examples/rl-arith.cfg" "${rl[@]}" --set precision.recipe=$r \
        --set run.out_dir="$tmp/rl-$r" > "$tmp/rl-$r.log"
    check_zero "$r" "$tmp/rl-$r"
done
"$bin" rl "$src/examples/rl-arith.cfg" "${rl[@]}" --set precision.recipe=mxfp8 \
    --set sample.kv_cache=fp8 --set rl.mini_batches=2 --set rl.micro_batch=3 \
    --set rl.kl_coef=0.05 --set run.out_dir="$tmp/rl-more" > "$tmp/rl-more.log"
check_zero "fp8 KV cache, 2 mini-batches, KL" "$tmp/rl-more"
field kl_ref "$tmp/rl-more/metrics.jsonl" | tail -n 2 | awk '$1 <= 0 { exit 1 }' ||
    fail "KL to the reference stayed 0 after updates"

# Resume: the 3 fp32 steps above against their step-2 checkpoint and a resumed third.
"$bin" rl "$src/examples/rl-arith.cfg" "${rl[@]}" --set checkpoint.resume="$tmp/rl-fp32/checkpoints/step_00000002.safetensors" \
    --set run.out_dir="$tmp/b" > "$tmp/b.log"
grep -q "resumed from .*step_00000002.safetensors at step 2" "$tmp/b.log" || fail "resume not reported"
strip() { grep '"reward_mean"' "$1" | sed 's/, "rollout_s".*//'; }
diff <(strip "$tmp/rl-fp32/metrics.jsonl" | tail -n 1) <(strip "$tmp/b/metrics.jsonl") ||
    fail "the resumed RL step differs from the uninterrupted one"

# lowbit sample: greedy, one sequence at a time vs 8 at once; a seeded draw twice, in other batches.
ck="$tmp/rl-fp32/checkpoints/step_00000003.safetensors"
s=(--set sample.checkpoint="$ck" --set sample.problems=12 --set sample.max_new_tokens=5)
"$bin" sample "${s[@]}" --set sample.top_k=1 --set sample.slots=1 --set sample.max_rows=1 > "$tmp/g1"
"$bin" sample "${s[@]}" --set sample.top_k=1 --set sample.slots=8 > "$tmp/g8"
diff <(grep -av '^#' "$tmp/g1") <(grep -av '^#' "$tmp/g8") || fail "greedy output depends on the batch"
[ "$(grep -avc '^#' "$tmp/g1")" = 12 ] || fail "expected 12 completions"
"$bin" sample "${s[@]}" --set sample.samples=3 --set sample.slots=2 --set sample.max_rows=7 > "$tmp/s1"
"$bin" sample "${s[@]}" --set sample.samples=3 --set sample.slots=36 > "$tmp/s2"
diff <(grep -av '^#' "$tmp/s1") <(grep -av '^#' "$tmp/s2") || fail "seeded samples depend on the batch"
grep -q "^# arithmetic (val split): pass@1 " "$tmp/s1" || fail "no pass@1 summary"
printf '12+3=\n\n' > "$tmp/empty.txt"
printf '12+3=\n7-7=' > "$tmp/prompts.txt"
"$bin" sample "${s[@]}" --set sample.prompts="$tmp/prompts.txt" > "$tmp/p"
[ "$(grep -avc '^#' "$tmp/p")" = 2 ] || fail "prompts file: expected 2 completions"

# mistakes
expect_error() {   # NAME PATTERN CMD...
    local name=$1 pattern=$2
    shift 2
    if "$@" > "$tmp/out" 2> "$tmp/err"; then fail "$name: exit 0"; fi
    grep -Eq -- "$pattern" "$tmp/err" || { cat "$tmp/err"; fail "$name: stderr lacks '$pattern'"; }
}
printf '[rl]\ninit = %s\nrewards = arith_exact,bogus\n' "$init" > "$tmp/bad.cfg"
expect_error bad-reward "bad.cfg:3: rl.rewards: unknown reward 'bogus' \(registered: arith_exact, arith_format, arith_digits\)" \
    "$bin" rl "$tmp/bad.cfg"
printf '[rl]\ninit = %s\n[sample]\nstop_tokens = 10,x\n' "$init" > "$tmp/stop.cfg"
expect_error bad-stop "stop.cfg:4: sample.stop_tokens: '10,x' is not a list of token ids" "$bin" rl "$tmp/stop.cfg"
printf '[rl]\ninit = %s\n[model]\nhidden_size = 64\n' "$init" > "$tmp/model.cfg"
expect_error model-mismatch "model.cfg:4: model.hidden_size differs from the model in .*step_00000015" \
    "$bin" rl "$tmp/model.cfg"
expect_error no-init "rl.init is empty" "$bin" rl --set rl.steps=1
expect_error no-ckpt "sample.checkpoint is empty" "$bin" sample
expect_error empty-prompt "empty.txt:2: empty prompt" "$bin" sample "${s[@]}" --set sample.prompts="$tmp/empty.txt"
expect_error reward-cmd "rl.reward_command: 'exit 7' exited with status 7" \
    "$bin" rl "$src/examples/rl-arith.cfg" "${rl[@]}" --set rl.reward_command="exit 7" \
    --set run.out_dir="$tmp/cmd"
cat > "$tmp/len.sh" <<'EOF'
#!/bin/sh
# reward: 1 for a completion of exactly "7\n"-like length 2 (a JSON line in, a number out)
grep -q '"completion": "[0-9]\\n"' && echo 1 || echo 0
EOF
chmod +x "$tmp/len.sh"
"$bin" rl "$src/examples/rl-arith.cfg" "${rl[@]}" --set rl.steps=1 --set rl.rewards= \
    --set rl.reward_command="$tmp/len.sh" --set rl.eval_problems=0 --set run.out_dir="$tmp/cmd2" > /dev/null ||
    fail "an external reward command run"
echo "PASS"
