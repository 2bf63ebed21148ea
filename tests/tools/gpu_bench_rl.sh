#!/bin/bash
# gpu_bench_rl.sh: rollout throughput of lowbit's sampler against Hugging Face generate() on the
# same model shape and batch, in one call on the GPU machine; optionally the time split of one
# RL step. Prints every measurement line, then a summary table. Nothing is asserted.
#
#   tests/tools/gpu_bench_rl.sh [PEER_SCRIPT]     (run from the built source tree)
#
# PEER_SCRIPT: ../shared/bench/peer_hf_generate.py by default ("" or "none": lowbit only).
# Environment (defaults in brackets):
#   CFG [examples/qwen3-30b-a3b-4l.cfg]  model shape; the peer's defaults are the same shape
#   LAYERS [4]  BATCH [64]  PROMPT [128]  NEW [256]   both sides (peer_hf_generate.py's defaults)
#   RECIPES ["bf16 fp8-block nvfp4-moe"]   lowbit precision recipes
#   MAX_ROWS [8192]   lowbit tokens per forward call (prefill chunks; >= BATCH; 8,192 rows: the
#                     bf16 prefill 0.057 s against 0.082 with 2,048, +1.3 GiB, benchmarks.md)
#   KV [auto]         lowbit KV cache (auto | fp32 | bf16 | fp8)
#   CACHES [dynamic]  peer KV caches (dynamic static)
#   GRAPHS [1]        LB_CUDA_GRAPHS values each rollout runs under, in turns ("1 0": the
#                     decode step replayed as a graph, then eager; doc/rl.md)
#   SHAPES [""]       "BATCHxNEW ..." (e.g. "64x128 256x512"): each lowbit rollout process
#                     times all of them on one model (bench.rollout_shapes), in place of
#                     BATCH and NEW; PEER_SHAPES [SHAPES] the peer's, one process each
#   RL_RECIPES [bf16]  recipes of the RL-step split (bench.kind=rl; "" = none); RL_MICRO [16]
#   RL_WARMUP [1] RL_ITERS [1]   untimed and timed RL steps
#   TIMEOUT_S [180]   per command; BUDGET_S [560] for the whole script: a command gets at
#                     most what is left of it and none starts with under 30 s left, so the
#                     summary is printed inside one 600 s call
#   LOWBIT [./lowbit]; BACKEND [cuda]
# Order: the peer, the lowbit rollouts, the RL-step split.
set -uo pipefail
peer=${1-../shared/bench/peer_hf_generate.py}
cfg=${CFG:-examples/qwen3-30b-a3b-4l.cfg}
layers=${LAYERS:-4} batch=${BATCH:-64} prompt=${PROMPT:-128} new=${NEW:-256}
recipes=${RECIPES-bf16 fp8-block nvfp4-moe}
max_rows=${MAX_ROWS:-8192} kv=${KV:-auto} caches=${CACHES:-dynamic}
rl_recipes=${RL_RECIPES-bf16} rl_micro=${RL_MICRO:-16} graphs=${GRAPHS:-1}
rl_warmup=${RL_WARMUP:-1} rl_iters=${RL_ITERS:-1}
shapes=${SHAPES:-} peer_shapes=${PEER_SHAPES-${SHAPES:-}}
limit=${TIMEOUT_S:-180} bin=${LOWBIT:-./lowbit} backend=${BACKEND:-cuda}
deadline=$((SECONDS + ${BUDGET_S:-560}))
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

shape=(--set run.backend="$backend" --set model.num_hidden_layers="$layers"
       --set bench.rollout_batch="$batch" --set bench.rollout_prompt="$prompt"
       --set bench.rollout_new="$new" --set sample.max_rows="$max_rows"
       --set sample.kv_cache="$kv" --set sample.deterministic=true)
echo "# gpu_bench_rl: $cfg, $layers layers, batch $batch, prompt $prompt, new $new; $(date -u +%FT%TZ)"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

# run NAME CMD...: the command under the time limit, its output kept in $out/NAME and shown
run() {
    local name=$1 left=$((deadline - SECONDS - 10))
    shift
    if [ $left -lt 30 ]; then echo "## $name: skipped, the budget is spent"; return; fi
    [ $left -lt "$limit" ] || left=$limit
    echo "## $name ($left s at most): $*"
    timeout -k 5 "$left" "$@" > "$out/$name" 2>&1
    local rc=$?
    grep -Ev '^(#|$)' "$out/$name" | grep -Ev '^ +' | tail -n 20
    [ $rc = 0 ] || echo "## $name: exit $rc$([ $rc = 124 ] && echo " (over $left s)")"
}

if [ -n "$peer" ] && [ "$peer" != none ]; then
    if [ -f "$peer" ]; then
        for ca in $caches; do
            for sh in ${peer_shapes:-${batch}x$new}; do
                run "peer-$ca-$sh" python3 "$peer" --layers "$layers" --batch "${sh%x*}" \
                    --prompt "$prompt" --new "${sh#*x}" --cache "$ca"
            done
        done
    else
        echo "## peer: $peer not found (pass its path as the first argument)"
    fi
fi
for r in $recipes; do
    for g in $graphs; do
        LB_CUDA_GRAPHS=$g run "lowbit-$r-g$g" "$bin" bench "$cfg" "${shape[@]}" \
            --set precision.recipe="$r" --set bench.kind=rollout --set bench.warmup=1 \
            --set bench.iters=1 ${shapes:+--set bench.rollout_shapes="${shapes// /,}"}
    done
done
for r in $rl_recipes; do
    run "rl-$r" "$bin" bench "$cfg" "${shape[@]}" --set precision.recipe="$r" \
        --set bench.kind=rl --set rl.micro_batch="$rl_micro" --set bench.warmup="$rl_warmup" \
        --set bench.iters="$rl_iters"
done

echo
echo "# summary: generated tokens/s (prompt $prompt, $layers layers)"
printf '%-28s %10s %14s\n' implementation batchxnew tokens/s
for r in $recipes; do
    for g in $graphs; do
        name="lowbit $r$([ "$g" = 0 ] && echo ' (no graphs)')"
        for sh in ${shapes:-${batch}x$new}; do
            v=$(sed -n "s/^rollout .*: batch ${sh%x*}, prompt [0-9]*, new ${sh#*x}, .* \([0-9]*\) generated tokens\/s.*/\1/p" \
                "$out/lowbit-$r-g$g" 2>/dev/null | tail -n 1)
            printf '%-28s %10s %14s\n' "$name" "$sh" "${v:-failed}"
        done
    done
done
for ca in $caches; do
    for sh in ${peer_shapes:-${batch}x$new}; do
        [ -f "$out/peer-$ca-$sh" ] || continue
        v=$(sed -n 's/.*"generated_tokens_per_s": \([0-9]*\).*/\1/p' "$out/peer-$ca-$sh" 2>/dev/null | tail -n 1)
        printf '%-28s %10s %14s\n' "transformers ($ca cache)" "$sh" "${v:-failed}"
    done
done
for r in $rl_recipes; do
    grep -h '^rl [^s]' "$out/rl-$r" 2>/dev/null || echo "rl $r: failed"
done
