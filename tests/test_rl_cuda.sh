#!/bin/bash
# `lowbit rl` and `lowbit sample` on the GPU (run.backend=cuda), deterministic mode:
# - every precision recipe, and the fp8 KV cache with mini-batches and KL: the trainer's
#   recomputed log-probs equal the sampler's on every one of 3 RL steps, after weight updates
#   too (train_rollout_logprob_abs_diff and its maximum exactly 0), as tests/test_rl.sh demands
#   on the CPU. The CUDA sampler runs kv_append / attention_cached, the trainer attention_fwd;
#   both share the weight cache and every other kernel, so any difference is a bug;
# - `lowbit sample`: greedy output one sequence at a time equals 8 at once, and seeded samples
#   do not depend on slots or forward size (batch invariance of the CUDA kernels end to end).
# The model is pretrained on the CPU (a few seconds); RL and sampling run on the GPU.
# It skips (exit 77) when lowbit has no CUDA backend or no device is visible.
set -euo pipefail
fail_fast=1   # each step builds on the ones before it
. "${LB_SRCDIR:-.}/tests/lib.sh"
. "$src/tests/need_cuda.sh"
. "$src/tests/rl_setup.sh"   # pretraining, rl, field, check_zero
rl+=(--set run.backend=cuda --set sample.deterministic=true)

on_cuda() {   # NAME LOG DIR: the run used the cuda backend; its log-probs agree exactly
    grep -q "cuda backend (deterministic)" "$2" || fail "$1: the run did not use the cuda backend"
    check_zero "$1 on cuda" "$3"
}
for r in $LB_RECIPES; do
    "$bin" rl "$src/examples/rl-arith.cfg" "${rl[@]}" --set precision.recipe=$r \
        --set run.out_dir="$tmp/rl-$r" > "$tmp/rl-$r.log" 2>&1 ||
        { cat "$tmp/rl-$r.log"; fail "recipe $r"; }
    on_cuda "$r" "$tmp/rl-$r.log" "$tmp/rl-$r"
done
"$bin" rl "$src/examples/rl-arith.cfg" "${rl[@]}" --set precision.recipe=mxfp8 \
    --set sample.kv_cache=fp8 --set rl.mini_batches=2 --set rl.micro_batch=3 \
    --set rl.kl_coef=0.05 --set run.out_dir="$tmp/rl-more" > "$tmp/rl-more.log" 2>&1 ||
    { cat "$tmp/rl-more.log"; fail "fp8 KV cache run"; }
on_cuda "fp8 KV cache, 2 mini-batches, KL" "$tmp/rl-more.log" "$tmp/rl-more"

# lowbit sample on the GPU: greedy one at a time vs 8 at once; a seeded draw in other batches.
ck="$tmp/rl-more/checkpoints/step_00000003.safetensors"
[ -f "$ck" ] || fail "no RL checkpoint"
gen() {   # OUT KEY=VALUE...: 12 problems on the GPU, completions only
    local out=$1
    shift
    local set=()
    for kv in "$@"; do set+=(--set "$kv"); done
    "$bin" sample --set sample.checkpoint="$ck" --set sample.problems=12 \
        --set sample.max_new_tokens=5 --set run.backend=cuda "${set[@]}" | grep -av '^#' > "$out"
}
gen "$tmp/g1" sample.top_k=1 sample.slots=1 sample.max_rows=1
gen "$tmp/g8" sample.top_k=1 sample.slots=8
diff "$tmp/g1" "$tmp/g8" || fail "greedy output depends on the batch"
[ "$(wc -l < "$tmp/g1")" = 12 ] || fail "expected 12 completions"
gen "$tmp/s1" sample.samples=3 sample.slots=2 sample.max_rows=7
gen "$tmp/s2" sample.samples=3 sample.slots=36
diff "$tmp/s1" "$tmp/s2" || fail "seeded samples depend on the batch"
summary
