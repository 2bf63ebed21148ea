# rl_setup.sh: sourced by tests/test_rl.sh and tests/test_rl_cuda.sh (after they set src, bin,
# tmp and fail). Pretrains the small MoE both start RL from (15 steps on the CPU) and defines:
#   rl              the keys of a short RL run from it: 3 steps of 4 prompts x 4 samples,
#                   evaluation at steps 0, 2 and 3, checkpoints every 2 steps and at the end
#   field NAME FILE the values of "NAME" in the step lines of a metrics file
#   check_zero NAME DIR
#                   three steps, every train-rollout log-prob difference and its maximum
#                   exactly 0, the weights moved, an evaluation ran
"$bin" data "$src/examples/tiny-moe.cfg" --set gen.output="$tmp/arith" --set gen.problems=3000 \
    > /dev/null
"$bin" train "$src/examples/tiny-moe.cfg" --set data.train_files="$tmp/arith_train_*.bin" \
    --set data.val_files= --set model.hidden_size=32 --set model.num_hidden_layers=2 \
    --set model.head_dim=16 --set model.moe_intermediate_size=32 --set train.seq_len=32 \
    --set train.micro_batch=8 --set train.steps=15 --set train.warmup_steps=2 \
    --set train.log_every=0 --set run.out_dir="$tmp/pre" --set run.backend=cpu > /dev/null
init="$tmp/pre/checkpoints/step_00000015.safetensors"
[ -f "$init" ] || fail "no pretrained checkpoint"

rl=(--set rl.init="$init" --set rl.steps=3 --set rl.prompts=4 --set rl.group=4
    --set rl.eval_problems=6 --set rl.eval_samples=2 --set rl.eval_every=2
    --set sample.max_new_tokens=5 --set train.lr=0.003 --set train.log_every=0
    --set checkpoint.save_every=2)

field() { grep '"reward_mean"' "$2" | sed "s/.*\"$1\": \([^,}]*\).*/\1/"; }

check_zero() {
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
