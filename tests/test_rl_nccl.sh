#!/bin/bash
# `lowbit rl` and `lowbit sample` on 2 GPUs through NCCL (one rank per GPU) against one GPU, as
# tests/test_rl.sh checks the layouts on the CPU: dp2 (ZeRO-1), tp2 and ep2 sample exactly the
# one-GPU rollouts (rewards, lengths, evaluations), their trainers agree with their samplers bit
# for bit (train_rollout_logprob_abs_diff exactly 0, deterministic mode), and losses, gradient
# norms and final parameters agree with one GPU's to 1e-5 (tests/rl_setup.sh: same_run). ep2
# with 3 prompts makes one rank run idle forwards. `lowbit sample` under tp2 prints the one-GPU
# completions. Skipped (77) without CUDA or with fewer than 2 GPUs.
set -euo pipefail
fail_fast=1   # each step builds on the ones before it
. "${LB_SRCDIR:-.}/tests/lib.sh"
need_gpus=2
. "$src/tests/need_cuda.sh"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
. "$src/tests/rl_setup.sh"   # pretraining, rl, field, check_zero, same_run
mpi() { local np=$1; shift; timeout 300 mpirun --oversubscribe --bind-to none -np "$np" "$@"; }

# The layouts of tests/test_rl.sh (AdamW eps 1e-6, explained there), on the GPU. NCCL sums
# gradients in its own order, not one GPU's, so from step 2 on every layout's weights differ
# from one GPU's by rounding (held to 1e-5 by same_run), hence its log-probs too, and kl_ref,
# a mean of k3 terms at the rounding floor (5e-6), is held to the scale 1e-4 in every layout,
# as tp is on the CPU (measured: ep2 1.6e-5 relative, 8e-11 absolute; dp2 1.3e-6; tp2 5e-6).
mp=("$src/examples/rl-arith.cfg" "${rl[@]}" --set train.lr=0.0003 --set rl.mini_batches=2
    --set rl.micro_batch=2 --set rl.kl_coef=0.05 --set rl.rewards= --set "rl.reward_command=wc -c"
    --set train.adam_eps=1e-6 --set rl.prompts=3 --set sample.slots=2 --set rl.eval_problems=5
    --set run.backend=cuda --set sample.deterministic=true)
"$bin" rl "${mp[@]}" --set run.out_dir="$tmp/m1" > "$tmp/m1.log" 2>&1 ||
    fail "one GPU: $(tail -n 3 "$tmp/m1.log")"
grep -q "cuda backend (deterministic)" "$tmp/m1.log" || fail "the run did not use the cuda backend"
for layout in "dp2 1e-4 parallel.zero=true" "tp2 1e-4 parallel.tp=2" "ep2 1e-4 parallel.ep=2"; do
    set -- $layout
    name=$1 klscale=$2
    shift 2
    sets=()
    for kv in "$@"; do sets+=(--set "$kv"); done
    mpi 2 "$bin" rl "${mp[@]}" "${sets[@]}" --set run.out_dir="$tmp/$name" \
        > "$tmp/$name.log" 2>&1 || fail "$name rl: $(tail -n 3 "$tmp/$name.log")"
    grep -q "collectives over nccl" "$tmp/$name.log" || fail "$name: not over NCCL"
    same_run m1 "$name" "$klscale"
done
field idle_forwards "$tmp/ep2/metrics.jsonl" | awk '$1 > 0 { n++ } END { exit !n }' ||
    fail "ep2: no idle forwards"

s=(--set sample.checkpoint="$(last m1)" --set sample.problems=12 --set sample.max_new_tokens=5
   --set sample.samples=3 --set run.backend=cuda)
"$bin" sample "${s[@]}" 2>&1 | grep -av '^#' > "$tmp/s1"
mpi 2 "$bin" sample "${s[@]}" --set parallel.tp=2 2> "$tmp/sp.err" | grep -av '^#' > "$tmp/sp" ||
    fail "sample under tp2: $(tail -n 3 "$tmp/sp.err")"
diff "$tmp/s1" "$tmp/sp" > /dev/null || fail "sample under tp2: the completions differ from one GPU's"
[ "$(wc -l < "$tmp/s1")" = 36 ] || fail "expected 36 completions"
summary
