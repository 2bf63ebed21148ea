#!/bin/bash
# NVFP4 experts cut over 2 expert-tensor-parallel ranks quantize with the whole expert's second
# level, as one rank does (tests/test_linear.c, etp_main; doc/parallel.md). A hang fails through
# timeout instead of stalling make check.
set -uo pipefail
bin=${LB_BUILDDIR:-.}/tests/test_linear
if out=$(timeout 120 mpirun --oversubscribe -np 2 "$bin" etp 2>&1); then
    tail -n 1 <<< "$out"
    exit 0
fi
echo "FAIL: test_linear etp on 2 ranks:"
sed 's/^/    /' <<< "$out" | tail -n 30
exit 1
