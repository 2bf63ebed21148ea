#!/bin/bash
# kjv_bench.sh: the small benchmark (examples/kjv-bench.cfg, doc/mlperf.md) under fp32, bf16 and
# each low-precision recipe, each run to the target with its MLPerf log; then a table of
# tokens and time to the target (OUT/results.md) and, with matplotlib, the validation curves
# (OUT/kjv-bench.png, examples/plot_runs.py).
#   examples/kjv_bench.sh [OUT] [--set section.key=value ...]   (default OUT runs/kjv-bench-recipes)
# Needs the `bible` program (apt-get install bible-kjv bible-kjv-text); run from the source tree.
set -euo pipefail
out=${1:-runs/kjv-bench-recipes}
[ $# -gt 0 ] && shift
bin=${LOWBIT:-./lowbit}
cfg=examples/kjv-bench.cfg
mkdir -p "$out"
if ! ls "$out"/data/kjv_train_*.bin > /dev/null 2>&1; then
    mkdir -p "$out/data"
    COLUMNS=80 bible gen1:1-rev22:21 > "$out/data/kjv.txt"
    "$bin" data tokenize "$cfg" --set gen.input="$out/data/kjv.txt" --set gen.output="$out/data/kjv"
fi
data=(--set data.train_files="$out/data/kjv_train_*.bin" --set data.val_files="$out/data/kjv_val_*.bin")
# name and the [precision] keys of each run
runs=("fp32|recipe=fp32" "bf16|recipe=bf16" "fp8-block|recipe=fp8-block" "mxfp8|recipe=mxfp8"
      "nvfp4-moe|recipe=nvfp4-moe" "mxfp4-h16|recipe=mxfp4"
      "mxfp4-none|recipe=mxfp4 wgrad_hadamard=none"
      "mxfp4-random16|recipe=mxfp4 wgrad_hadamard=random16"
      "mxfp4-h16-sr|recipe=mxfp4 stochastic_rounding=true")
seq_len=$(awk -F'[= ]+' '$1 == "seq_len" { print $2 }' "$cfg")
{
    echo "| run | precision | status | samples | tokens to target | time to train (s) | last eval log-ppl |"
    echo "|---|---|---|---|---|---|---|"
} > "$out/results.md"
for r in "${runs[@]}"; do
    name=${r%%|*}
    keys=()
    for kv in ${r#*|}; do keys+=(--set "precision.$kv"); done
    "$bin" train "$cfg" "${data[@]}" "${keys[@]}" --set run.out_dir="$out/$name" \
        --set run.overwrite=true "$@" \
        > "$out/$name.log" 2>&1
    log=$out/$name/mlperf.log
    "$bin" mlperf-check "$log" > /dev/null
    awk -v name="$name" -v prec="${r#*|}" -v T="$seq_len" '
        function val(k,  s) { s = $0; sub(".*\"" k "\": ", "", s); sub(/[,}].*/, "", s); return s }
        /"key": "run_start"/ { t0 = val("time_ms") }
        /"key": "eval_accuracy"/ { acc = val("value") }
        /"key": "run_stop"/ { t1 = val("time_ms"); st = val("status"); gsub(/"/, "", st) }
        /"key": "train_samples"/ { n = val("value") }
        END { printf "| %s | %s | %s | %d | %d | %.1f | %.4f |\n", name, prec, st, n, n * T,
                     (t1 - t0) / 1000, acc }' "$log" >> "$out/results.md"
    tail -1 "$out/results.md"
done
if python3 -c "import matplotlib" 2> /dev/null; then
    dirs=()
    for r in "${runs[@]}"; do dirs+=("$out/${r%%|*}"); done
    python3 examples/plot_runs.py "${dirs[@]}" -o "$out/kjv-bench.png" --title "kjv-bench: recipes"
fi
cat "$out/results.md"
