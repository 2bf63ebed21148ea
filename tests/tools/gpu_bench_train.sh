#!/bin/bash
# gpu_bench_train.sh: the training-step table in one GPU call: the PyTorch peer
# (compiled and eager), then lowbit's step on examples/qwen3-30b-a3b-4l.cfg for each recipe,
# then where the time goes for the recipes in PROFILE (a second run with LB_PROFILE=1, whose
# sync around every operation slows it: its step time is not a measurement). EXTRA="NAME:VAR=
# VALUE" adds a bf16 row under an environment switch (e.g. "fp32-gemms:LB_CUDA_BF16=0").
# Prints every measurement line; nothing is asserted.
#   tests/tools/gpu_bench_train.sh [PEER_SCRIPT]      (run from the built source tree)
# Environment: CFG [examples/qwen3-30b-a3b-4l.cfg], LOWBIT [./lowbit],
#   RECIPES ["fp32 bf16 fp8-block nvfp4-moe"], ITERS [2], TIMEOUT_S [150],
#   BUDGET_S [560], PEER_MODES ["--compile" ""], PROFILE [bf16], TOP [12] lines of each of
#   the profile's two tables (operations, shapes), REPEAT [1] runs of each recipe: with more
#   than one, whether their losses (7 decimals) are the same, since deterministic mode
#   promises the same bits run after run (a kernel race showed first as such a difference),
#   MOMENTS [""]: "bf16" runs each recipe once more with train.adam_moments = bf16.
set -uo pipefail
peer=${1-../shared/bench/peer_torch_moe.py}
cfg=${CFG:-examples/qwen3-30b-a3b-4l.cfg} lowbit=${LOWBIT:-./lowbit}
recipes=${RECIPES-fp32 bf16 fp8-block nvfp4-moe} iters=${ITERS:-2} limit=${TIMEOUT_S:-150}
top=${TOP:-12}
deadline=$((SECONDS + ${BUDGET_S:-560}))
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
left() { local l=$((deadline - SECONDS - 10)); [ $l -lt $limit ] && echo $l || echo $limit; }
echo "# gpu_bench_train: $cfg; $(date -u +%FT%TZ)"
if [ -f "$peer" ]; then
    for mode in ${PEER_MODES---compile none}; do
        [ "$mode" = none ] && mode=
        l=$(left); [ $l -lt 30 ] && { echo "## peer $mode: skipped, the budget is spent"; continue; }
        echo "## peer --impl grouped $mode"
        timeout -k 5 $l python3 "$peer" --impl grouped $mode 2>&1 | tail -n 1
    done
fi
run() {   # NAME "VAR=VALUE ..." RUNS ARGS...
    local name=$1 envs=$2 runs=$3 losses="" i l
    shift 3
    for i in $(seq "$runs"); do
        l=$(left)
        [ $l -lt 30 ] && { echo "## $name: skipped, the budget is spent"; return; }
        echo "## $name ($l s at most)"
        env $envs timeout -k 5 $l "$lowbit" bench "$cfg" --set bench.kind=train \
            --set bench.warmup=1 --set bench.iters=$iters "$@" > "$out/$name.out" \
            2> "$out/$name.err"
        echo "## $name: exit $?"
        grep '^train ' "$out/$name.out"
        losses="$losses $(sed -n 's/^train .*, loss \([^ ]*\)$/\1/p' "$out/$name.out")"
        # the TOP longest operations, then the TOP longest shapes (the table's second part)
        sed -n '/^lowbit profile/,/^  by shape/p' "$out/$name.err" | grep -v '^  by shape' |
            head -n $((top + 2))
        sed -n '/^  by shape/,$p' "$out/$name.err" | head -n $((top + 1))
    done
    [ "$runs" -gt 1 ] || return 0
    set -- $losses
    local first=${1-none} x
    for x; do
        [ "$x" = "$first" ] || { echo "## $name: LOSSES DIFFER between runs:$losses"; return; }
    done
    [ $# -eq "$runs" ] && echo "## $name: the same loss in all $runs runs ($first)" ||
        echo "## $name: only $# of $runs runs reported a loss:$losses"
}
for r in $recipes; do
    run "$r" "" "${REPEAT:-1}" --set precision.recipe=$r
    [ -n "${MOMENTS-}" ] && run "$r-moments-$MOMENTS" "" 1 --set precision.recipe=$r \
        --set train.adam_moments="$MOMENTS"
done
for x in ${EXTRA-}; do
    run "bf16-${x%%:*}" "${x#*:}" 1 --set precision.recipe=bf16
done
for r in ${PROFILE-bf16}; do
    run "$r-profile" LB_PROFILE=1 1 --set precision.recipe=$r
done
