#!/bin/bash
# The NCCL collectives on 2 GPUs, one rank each (tests/test_comm.c in nccl mode: the same checks
# as the MPI run, on CUDA-backend memory). Skipped (77) without CUDA or with fewer than 2 GPUs.
set -uo pipefail
bin=${LB_BUILDDIR:-.}/tests/test_comm
gpus=$("$bin" gpus 2>/dev/null || echo 0)
if [ "${gpus:-0}" -lt 2 ]; then
    echo "SKIP: $gpus GPU(s) visible, the NCCL test needs 2"
    exit 77
fi
log="${TMPDIR:-/tmp}/test_comm_nccl.$$.log"
if timeout 300 mpirun --oversubscribe -np 2 "$bin" nccl > "$log" 2>&1; then
    tail -n 1 "$log"
    rm -f "$log"
    exit 0
fi
echo "FAIL: test_comm nccl on 2 GPUs:"
sed 's/^/    /' "$log" | tail -n 30
rm -f "$log"
exit 1
