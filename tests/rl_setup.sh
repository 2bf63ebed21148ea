# rl_setup.sh: sourced by tests/test_rl.sh, tests/test_rl_cuda.sh and tests/test_rl_nccl.sh (after
# tests/lib.sh: src, bin, tmp, fail). Pretrains the small MoE they start RL from (15 steps on the
# CPU) and defines:
#   rl              the keys of a short RL run from it: 3 steps of 4 prompts x 4 samples,
#                   evaluation at steps 0, 2 and 3, checkpoints every 2 steps and at the end
#   field NAME FILE the values of "NAME" in the step lines of a metrics file
#   check_zero NAME DIR
#                   three steps, every train-rollout log-prob difference and its maximum
#                   exactly 0, every router choice the same (routing_agreement 1), the weights
#                   moved, an evaluation ran
#   same_run REF RUN [KL_SCALE]
#                   RUN (a parallel layout) against REF (one rank): see below
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
    # the trainer's recompute routed every token the sampler fed to the same experts
    bad=$(field routing_agreement "$m" | grep -vx 1 || true)
    [ -z "$bad" ] || fail "$1: routing_agreement is $bad, not 1"
    # the weights moved between rollouts (so steps 2 and 3 sampled from updated weights)
    field grad_norm "$m" | awk '$1 <= 0 { exit 1 }' || fail "$1: a zero gradient"
    grep -q '"eval_pass_at_1"' "$m" || fail "$1: no evaluation"
    echo "$1: train_rollout_logprob_abs_diff = 0 on every step"
}

# near REF RUN KEY TOL SCALE: every step's KEY of runs REF and RUN within TOL x max(|REF's|,
# SCALE). The loss is a mean of terms -A ratio whose advantages sum to 0 per group (RMS 1), so
# it is held to the terms' scale (1), not to its own value near 0.
near() {
    paste <(field "$3" "$tmp/$1/metrics.jsonl") <(field "$3" "$tmp/$2/metrics.jsonl") |
        awk -v tol="$4" -v scale="$5" -v key="$3" -v run="$2" '
            { d = $1 - $2; a = $1 < 0 ? -$1 : $1; if (d < 0) d = -d; if (a < scale) a = scale
              r = d / a; if (r > w) w = r }
            END { printf "%s vs 1 rank: %s %.3g\n", run, key, w; exit !(NR == 3 && w <= tol) }' ||
        fail "$2: $3 differs from one rank"
}
# same_run REF RUN [KL_SCALE]: RUN sampled what REF sampled (rewards, lengths, evaluations
# exactly), its trainer agreed with its sampler bit for bit, and losses, KL (scale KL_SCALE,
# default 0), gradient norms and the final parameters agree with REF's to 1e-5.
same_run() {
    check_zero "$2" "$tmp/$2"
    for f in reward_mean reward_std correct response_len; do
        diff <(field $f "$tmp/$1/metrics.jsonl") <(field $f "$tmp/$2/metrics.jsonl") > /dev/null ||
            fail "$2: $f differs from one rank"
    done
    diff <(grep eval_pass "$tmp/$1/metrics.jsonl") <(grep eval_pass "$tmp/$2/metrics.jsonl") ||
        fail "$2: evaluations differ from one rank"
    near "$1" "$2" loss 1e-5 1
    near "$1" "$2" kl_ref 1e-5 "${3:-0}"
    near "$1" "$2" grad_norm 1e-5 0
    out=$("$cmp" "$(last "$1")" "$(last "$2")" 1e-5) || fail "$2: parameters: $out"
    echo "$2 vs 1 rank: parameters: $out"
}
last() { echo "$tmp/$1/checkpoints/step_00000003.safetensors"; }
cmp=${LB_BUILDDIR:-.}/tests/ckpt_compare
