#!/bin/bash
# NVFP4 experts cut over 2 expert-tensor-parallel ranks quantize with the whole expert's second
# level, as one rank does (tests/test_linear.c, etp_main; doc/parallel.md). A hang fails through
# timeout instead of stalling make check.
set -uo pipefail
bin=${LB_BUILDDIR:-.}/tests/test_linear
log=${TMPDIR:-/tmp}/test_linear_etp.$$.log
if timeout 120 mpirun --oversubscribe -np 2 "$bin" etp > "$log" 2>&1; then
    tail -n 1 "$log"
    rm -f "$log"
    exit 0
fi
echo "FAIL: test_linear etp on 2 ranks:"
sed 's/^/    /' "$log" | tail -n 30
rm -f "$log"
exit 1
