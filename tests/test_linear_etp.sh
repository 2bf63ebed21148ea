#!/bin/bash
# NVFP4 experts cut over 2 expert-tensor-parallel ranks quantize with the whole expert's second
# levels, as one rank does: the weights' and the activations' and gradients' (tests/test_linear.c,
# etp_main; doc/parallel.md). On the CPU, and with a CUDA device visible also on the GPU (both
# ranks on the first device). A hang fails through timeout instead of stalling make check.
set -uo pipefail
src=${LB_SRCDIR:-.}
bin=${LB_BUILDDIR:-.}/tests/test_linear
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
ndev=$("${LB_BUILDDIR:-.}/lowbit" info "$src/examples/tiny-moe.cfg" 2>/dev/null |
       awk '/^CUDA/ {print $2}' || true)
case "$ndev" in ''|*[!0-9]*) ndev=0 ;; esac
backends=(cpu)
[ "$ndev" -ge 1 ] && backends+=(cuda)
for b in "${backends[@]}"; do
    if ! out=$(timeout 120 mpirun --oversubscribe -np 2 "$bin" etp "$b" 2>&1); then
        echo "FAIL: test_linear etp on 2 ranks, $b backend:"
        sed 's/^/    /' <<< "$out" | tail -n 30
        exit 1
    fi
    grep '^test_linear etp' <<< "$out"
done
