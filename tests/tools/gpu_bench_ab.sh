#!/bin/bash
# gpu_bench_ab.sh: this tree's training step against a base build, alternated, in one GPU call
# (run from the source tree, after `. .gpu-host/setup.sh`). A change worth a percent of the
# step is within the step's run-to-run spread (about 1% on the H200), so the two builds run in
# turns, PAIRS times, on the same machine; the peer once at the end when PEER names its script.
#   git archive --format=tar.gz -o .bench/base.tar.gz REV     (here, before the call)
#   BASE_TAR=.bench/base.tar.gz tests/tools/gpu_bench_ab.sh   (there; carry .bench)
# The base is unpacked and built in /tmp/lowbit-base while this tree builds (both with
# bootstrap, configure and make lowbit). Prints each run's `train` line and, per build, the
# loss of every run (deterministic mode: one value each).
# Environment: BASE_TAR (required), CFG [examples/qwen3-30b-a3b-4l.cfg], PAIRS [3],
#   SET ["--set precision.recipe=bf16"] the runs' --set arguments, ITERS [2], PEER [""],
#   JOBS [8] make jobs for each of the two builds, CONFIGURE [""] more configure arguments.
set -uo pipefail
base_tar=${BASE_TAR:?BASE_TAR names the base tree as a tar.gz (git archive)}
[ -f "$base_tar" ] || { echo "gpu_bench_ab.sh: $base_tar: no such file" >&2; exit 2; }
cfg=${CFG:-examples/qwen3-30b-a3b-4l.cfg} pairs=${PAIRS:-3} iters=${ITERS:-2}
jobs=${JOBS:-8} base=/tmp/lowbit-base
read -ra set_args <<< "${SET:---set precision.recipe=bf16}"
build() {   # DIR LOG: bootstrap, configure and make lowbit in DIR
    # shellcheck disable=SC2086
    (cd "$1" && ./bootstrap > "$2" 2>&1 && ./configure -q ${CONFIGURE-} >> "$2" 2>&1 &&
        make -j"$jobs" lowbit >> "$2" 2>&1)
}
rm -rf "$base" && mkdir -p "$base" && tar xzf "$base_tar" -C "$base" || exit 2
build "$base" /tmp/lowbit-base.log &
pid=$!
build . /tmp/lowbit-new.log || { tail -20 /tmp/lowbit-new.log; exit 1; }
wait $pid || { tail -20 /tmp/lowbit-base.log; exit 1; }
echo "# gpu_bench_ab: $cfg ${set_args[*]}; built at $SECONDS s; $(date -u +%FT%TZ)"
declare -A losses
step() {   # NAME BINARY
    local line
    line=$(timeout -k 5 120 "$2" bench "$cfg" --set bench.kind=train --set bench.warmup=1 \
        --set bench.iters="$iters" "${set_args[@]}" 2>&1 | grep '^train ')
    echo "$1: ${line:-no train line}"
    losses[$1]="${losses[$1]-} ${line##*loss }"
}
for i in $(seq "$pairs"); do
    step new ./lowbit
    step base "$base/lowbit"
done
for b in new base; do echo "losses $b:${losses[$b]}"; done
if [ -n "${PEER-}" ]; then
    timeout -k 5 150 python3 "$PEER" --impl grouped --compile 2>&1 | tail -n 1
fi
