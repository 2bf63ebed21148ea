#!/bin/bash
# gpu_rl_fast.sh: train_rollout_logprob_abs_diff and routing_agreement of lowbit rl on the GPU
# in the fast (non-deterministic) sampling mode, next to the deterministic mode, on the small MoE the RL
# tests use (tests/rl_setup.sh). Prints the per-step values; nothing is asserted.
# Run from the built source tree:   tests/tools/gpu_rl_fast.sh [RECIPES]
set -uo pipefail
src=. bin=./lowbit
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
. tests/rl_setup.sh
for r in ${1:-bf16 fp8-block nvfp4-moe}; do
    for det in true false; do
        out="$tmp/$r-$det"
        "$bin" rl "$src/examples/rl-arith.cfg" "${rl[@]}" --set run.backend=cuda \
            --set precision.recipe="$r" --set sample.deterministic=$det \
            --set run.out_dir="$out" > "$out.log" 2>&1 || { tail -n 3 "$out.log"; continue; }
        echo "$r, sample.deterministic=$det: abs_diff per step $(field train_rollout_logprob_abs_diff "$out/metrics.jsonl" | tr '\n' ' ')"
        echo "$r, sample.deterministic=$det: routing_agreement per step $(field routing_agreement "$out/metrics.jsonl" | tr '\n' ' ')"
    done
done
