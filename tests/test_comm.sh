#!/bin/bash
# The MPI collectives on 3 and 4 ranks (tests/test_comm.c: every operation against a serial
# computation, deterministic and not, world and sub-communicators, tiny pieces). A hang fails
# through timeout instead of stalling make check.
set -uo pipefail
bin=${LB_BUILDDIR:-.}/tests/test_comm
failed=0
for np in 3 4; do
    if timeout 300 mpirun --oversubscribe -np $np "$bin" mpi > "${TMPDIR:-/tmp}/test_comm.$$.log" 2>&1; then
        tail -n 1 "${TMPDIR:-/tmp}/test_comm.$$.log"
    else
        echo "FAIL: test_comm on $np ranks:"
        sed 's/^/    /' "${TMPDIR:-/tmp}/test_comm.$$.log" | tail -n 30
        failed=1
    fi
done
rm -f "${TMPDIR:-/tmp}/test_comm.$$.log"
exit $failed
