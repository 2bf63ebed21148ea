#!/bin/bash
# gpu_bench_parallel.sh: training throughput of the Qwen3-30B-A3B proxy on one GPU and on GPUS
# GPUs in each of LAYOUTS (through NCCL), with lowbit train on generated token shards, and
# optionally a GRPO step (bench.kind=rl) on the same layouts; prints each run's step lines, the
# layout and memory lines, and a summary with tokens/s per GPU and the scaling efficiency
# against one GPU. Nothing is asserted. Run from the built source tree, one call per machine:
#   GPUS=2 LAYOUTS="dp2 ep2 tp2xsp pp2" tests/tools/gpu_bench_parallel.sh
#   GPUS=4 LAYERS=8 LAYOUTS="tp2xep2 pp2xdp2 ep4 pp4" tests/tools/gpu_bench_parallel.sh
#   GPUS=8 LAYERS=16 LAYOUTS="pp2xep4 pp4xep2" VARIANTS="base offload recompute" RL=1 \
#     tests/tools/gpu_bench_parallel.sh
# A layout is its parts joined by x: tpN, ppN, epN, etpN, dpN (asserted), sp (sequence
# parallelism); dp follows from GPUS. mpirun binds each rank to one core by default, which
# leaves the host-side work (parameter initialisation of billions of values) on one core:
# --bind-to none.
# Environment: GPUS [2]; LAYOUTS ["dp2 tp2 ep2"]; LAYERS [4]; STEPS [4] (the first is not
#   counted); RECIPE [fp32]; ONE [1] (0: no one-GPU run; a layout that needs more memory than
#   one GPU has fails there, which the summary shows); VARIANTS ["base"]: base, offload
#   (train.optimizer_offload = 1), recompute (train.recompute = full); RL [0] (1: one GRPO step
#   of batch 64, prompt 128, 128 new per layout without pp, after one warm-up); TIMEOUT_S [150]
#   per run; CFG [examples/qwen3-30b-a3b-4l.cfg], BACKEND [cuda] (CFG=examples/tiny-moe.cfg
#   BACKEND=cpu runs the script's path on the CPU).
set -uo pipefail
bin=${LOWBIT:-./lowbit}
cfg=${CFG:-examples/qwen3-30b-a3b-4l.cfg} backend=${BACKEND:-cuda}
gpus=${GPUS:-2} layers=${LAYERS:-4} steps=${STEPS:-4} recipe=${RECIPE:-fp32}
limit=${TIMEOUT_S:-150} layouts=${LAYOUTS:-dp2 tp2 ep2} variants=${VARIANTS:-base}
out=$(mktemp -d)
[ -n "${KEEP:-}" ] || trap 'rm -rf "$out"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
"$bin" data examples/tiny-moe.cfg --set gen.output="$out/tok" --set gen.problems=60000 > /dev/null
# grad_accum 2 x GPUS: the same global batch (2 GPUS x 4 x 4096 tokens) on every layout
common=(--set run.backend="$backend" --set model.num_hidden_layers="$layers" --set data.train_files="$out/tok_train_*.bin"
        --set data.val_files= --set train.steps="$steps" --set train.warmup_steps=1
        --set train.grad_accum=$((2 * gpus))
        --set train.log_every=1 --set checkpoint.save_every=-1 --set precision.recipe="$recipe"
        --set run.out_dir="$out/run")
# the --set flags of a layout name (tp2xep2 -> parallel.tp=2 parallel.ep=2)
flags() {
    local part
    for part in ${1//x/ }; do
        case $part in
        sp) echo "--set parallel.sequence_parallel=true" ;;
        tp* | pp* | ep* | etp* | dp*) echo "--set parallel.${part%%[0-9]*}=${part##*[a-z]}" ;;
        *) echo "unknown layout part $part" >&2; return 1 ;;
        esac
    done
}
vflags() {
    case $1 in
    base) ;;
    offload) echo "--set train.optimizer_offload=1" ;;
    recompute) echo "--set train.recompute=full" ;;
    *) echo "unknown variant $1" >&2; return 1 ;;
    esac
}
# mean tokens/s over steps 2.. of a log
rate() { awk '/^step / && $2 !~ /^1\// { for (i = 1; i < NF; i++) if ($(i+1) == "tok/s") { s += $i; n++ } }
              END { if (n) printf "%.0f", s / n; else printf "-" }' "$1"; }
echo "# gpu_bench_parallel: $cfg, $layers layers, recipe $recipe, $steps steps, $gpus GPUs, global batch $((2 * gpus)) x 4 x 4096; $(date -u +%FT%TZ)"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n 1
if [ "${ONE:-1}" = 1 ]; then
    timeout $limit "$bin" train "$cfg" "${common[@]}" > "$out/g1.log" 2>&1
    echo "1 GPU: exit $?"; grep -E "^(layout|step|memory)" "$out/g1.log"
fi
for v in $variants; do
    for l in $layouts; do
        f=$(flags "$l") && vf=$(vflags "$v") || continue
        timeout $limit mpirun --oversubscribe --bind-to none -np "$gpus" "$bin" train "$cfg" \
            "${common[@]}" $f $vf > "$out/$l-$v.log" 2>&1
        echo "$l $v: exit $?"; grep -E "^(layout|step|memory)" "$out/$l-$v.log"
        grep -iE "error|fail|warning" "$out/$l-$v.log" | head -3
    done
done
if [ "${RL:-0}" = 1 ]; then
    for l in $layouts; do
        case $l in *pp*) echo "rl $l: skipped (lowbit rl runs without pipeline parallelism)"; continue ;; esac
        f=$(flags "$l") || continue
        timeout $limit mpirun --oversubscribe --bind-to none -np "$gpus" "$bin" bench "$cfg" \
            --set run.backend="$backend" --set model.num_hidden_layers="$layers" \
            --set precision.recipe="$recipe" --set bench.kind=rl --set bench.rollout_batch=64 \
            --set bench.rollout_prompt=128 --set bench.rollout_new=128 --set bench.warmup=1 \
            --set bench.iters=1 $f > "$out/rl-$l.log" 2>&1
        echo "rl $l: exit $?"; grep -E "^rl |train_rollout|abs_diff" "$out/rl-$l.log" | head -4
    done
fi
echo "# summary: tokens/s of the global batch (mean over steps 2..$steps), per GPU, and against one GPU"
one=$([ -f "$out/g1.log" ] && rate "$out/g1.log" || echo -)
echo "1 GPU $one"
for v in $variants; do
    for l in $layouts; do
        [ -f "$out/$l-$v.log" ] || continue
        r=$(rate "$out/$l-$v.log")
        awk -v l="$l" -v v="$v" -v r="$r" -v g="$gpus" -v o="$one" 'BEGIN {
            if (r == "-") { printf "%s %s: failed\n", l, v; exit }
            printf "%s %s: %d tokens/s, %d per GPU", l, v, r, r / g
            if (o != "-" && o > 0) printf ", scaling efficiency %.2f", r / (g * o)
            printf "\n" }'
    done
done
