#!/bin/bash
# The precision ablation: the tiny MoE on the arithmetic corpus under every recipe, same data,
# same seed, same steps. Writes OUT/<variant>/metrics.jsonl, OUT/table.md and OUT/loss.png.
#   bash examples/ablation/run.sh [OUT] [STEPS]      (from the repository root, after make)
set -euo pipefail
out=${1:-runs/ablation}
steps=${2:-150}
bin=${LOWBIT:-./lowbit}
cfg=examples/tiny-moe.cfg
[ -f data/arith_train_000.bin ] || "$bin" data "$cfg"
variants=(
    "bf16               precision.recipe=bf16"
    "fp8-block          precision.recipe=fp8-block"
    "mxfp8              precision.recipe=mxfp8"
    "nvfp4-moe          precision.recipe=nvfp4-moe"
    "mxfp4-h16          precision.recipe=mxfp4"
    "mxfp4-noh          precision.recipe=mxfp4 precision.wgrad_hadamard=none"
    "mxfp4-random-h16   precision.recipe=mxfp4 precision.wgrad_hadamard=random16"
    "mxfp4-h16-sr       precision.recipe=mxfp4 precision.stochastic_rounding=true"
)
for v in "${variants[@]}"; do
    read -r name sets <<<"$v"
    args=(--set run.out_dir="$out/$name" --set run.overwrite=true --set train.steps="$steps" --set train.log_every=25
          --set checkpoint.save_every=0 --set checkpoint.keep=1 --set train.val_every="$steps")
    for s in $sets; do args+=(--set "$s"); done
    echo "== $name"
    "$bin" train "$cfg" "${args[@]}" | grep -E '^step .*(/| val)'
done
python3 examples/ablation/report.py "$out" "${variants[@]%% *}"
