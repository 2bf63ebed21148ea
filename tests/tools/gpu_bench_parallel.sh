#!/bin/bash
# gpu_bench_parallel.sh: training throughput of the 4-layer Qwen3-30B-A3B proxy on one GPU and
# on two (dp2, tp2, ep2 through NCCL), with lowbit train on generated token shards; prints each
# run's step lines and a summary. Nothing is asserted. Run from the built source tree on a
# machine with 2 GPUs:   tests/tools/gpu_bench_parallel.sh
# mpirun binds each rank to one core by default, which leaves the host-side work (parameter
# initialisation of 3 G values) on one core: --bind-to none.
# Environment: STEPS [4] (the first is not counted), RECIPE [fp32], LAYOUTS ["dp2 tp2 ep2"], ONE [1],
#   TIMEOUT_S [150] per run.
set -uo pipefail
bin=${LOWBIT:-./lowbit}
cfg=examples/qwen3-30b-a3b-4l.cfg
steps=${STEPS:-4} recipe=${RECIPE:-fp32} limit=${TIMEOUT_S:-150}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
"$bin" data examples/tiny-moe.cfg --set gen.output="$out/tok" --set gen.problems=60000 > /dev/null
# grad_accum 2: the global batch is 2 x 4 x 4096 tokens on every layout
common=(--set data.train_files="$out/tok_train_*.bin" --set data.val_files= --set train.steps=$steps
        --set train.grad_accum=2 --set train.log_every=1 --set checkpoint.save_every=-1
        --set precision.recipe=$recipe --set run.out_dir="$out/run")
# mean tokens/s over steps 2.. of a log
rate() { awk '/^step / && $2 !~ /^1\// { for (i = 1; i < NF; i++) if ($(i+1) == "tok/s") { s += $i; n++ } }
              END { if (n) printf "%.0f", s / n; else printf "-" }' "$1"; }
echo "# gpu_bench_parallel: $cfg, recipe $recipe, $steps steps, global batch 2 x 4 x 4096; $(date -u +%FT%TZ)"
if [ "${ONE:-1}" = 1 ]; then   # ONE=0: the layouts only
    timeout $limit "$bin" train "$cfg" "${common[@]}" > "$out/g1.log" 2>&1
    echo "1 GPU: exit $?"; grep -E "^(layout|step)" "$out/g1.log"
fi
declare -A flags=([dp2]="" [tp2]="--set parallel.tp=2" [ep2]="--set parallel.ep=2")
for l in ${LAYOUTS:-dp2 tp2 ep2}; do
    timeout $limit mpirun --oversubscribe --bind-to none -np 2 "$bin" train "$cfg" "${common[@]}" ${flags[$l]} \
        > "$out/$l.log" 2>&1
    echo "$l: exit $?"; grep -E "^(layout|step)" "$out/$l.log"; grep -iE "error|fail" "$out/$l.log" | head -3
done
echo "# summary (tokens/s of the global batch, mean over steps 2..$steps)"
[ -f "$out/g1.log" ] && echo "1 GPU $(rate "$out/g1.log")"
for l in ${LAYOUTS:-dp2 tp2 ep2}; do echo "$l $(rate "$out/$l.log")"; done
