#!/bin/bash
# gpu_bench_kernels.sh: the kernel benchmarks in one GPU call (run from the built source
# tree): test_backend_ops when TESTS=1 (its log in $OUT or a temporary directory, the summary
# printed), then `lowbit bench` of each kind in KINDS for every environment variant in
# VARIANTS, then the PyTorch kernel peers. A variant is a comma list of VAR=VALUE switches
# ("-" for none), so one call compares a kernel with its switch off (e.g.
# VARIANTS="- LB_CUDA_ATTN_WG=0"). Prints the measurement lines; nothing is asserted.
# Environment: CFG [examples/qwen3-30b-a3b-4l.cfg], LOWBIT [./lowbit], KINDS [gemm attention],
#   FORMATS [bf16,fp8-block], VARIANTS [-], ITERS [5], TIMEOUT_S [90] per bench,
#   SET [""] more --set arguments, PEERS [1], TESTS [0].
set -uo pipefail
cfg=${CFG:-examples/qwen3-30b-a3b-4l.cfg} lowbit=${LOWBIT:-./lowbit}
kinds=${KINDS:-gemm attention} formats=${FORMATS:-bf16,fp8-block} variants=${VARIANTS:--}
iters=${ITERS:-5} limit=${TIMEOUT_S:-90}
logs=${OUT:-$(mktemp -d)}
echo "# gpu_bench_kernels: $cfg; $(date -u +%FT%TZ); $(git rev-parse --short HEAD 2>/dev/null)"
if [ "${TESTS:-0}" = 1 ]; then
    t0=$SECONDS
    CK_FORK=no LB_TEST_VERBOSE=1 timeout -k 5 300 tests/test_backend_ops > "$logs/ops.log" 2>&1
    echo "## test_backend_ops: exit $? in $((SECONDS - t0)) s (log: $logs/ops.log)"
    grep -E '^[0-9]+%|:[FE]:|DIFFER|gemm_q paths' "$logs/ops.log"
fi
for v in $variants; do
    envs=()
    [ "$v" != - ] && IFS=, read -ra envs <<< "$v"
    for k in $kinds; do
        echo "## $k, variant $v"
        # shellcheck disable=SC2086
        env "${envs[@]}" timeout -k 5 "$limit" "$lowbit" bench "$cfg" --set bench.kind="$k" \
            --set bench.formats="$formats" --set bench.iters="$iters" --set bench.warmup=1 \
            ${SET:-} 2>&1 | grep -v '^lowbit bench'
        echo "## $k, variant $v: exit ${PIPESTATUS[0]}"
    done
done
if [ "${PEERS:-1}" = 1 ] && command -v python3 > /dev/null; then
    echo "## PyTorch kernel peers"
    timeout -k 5 120 python3 tests/tools/peer_kernels.py 2>&1 | tail -n 12
fi
