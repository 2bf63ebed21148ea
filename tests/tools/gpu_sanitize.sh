#!/bin/bash
# gpu_sanitize.sh: compute-sanitizer over test_backend_ops on the GPU (doc/robustness.md).
# memcheck runs the whole case table in one process; racecheck (shared-memory hazards, far
# slower) runs one case runner at a time (LB_TEST_CASES), each under its own time limit, so a
# slow runner is named as not finished instead of hiding the others' results.
#   tests/tools/gpu_sanitize.sh [OUTDIR]    (from a built tree; test programs: make check TESTS=)
# Environment: MEMCHECK_S (600; 0 skips memcheck; a run past it without an error report is
# named as not finished, not failed), RACE_S (per runner, 60), RACE_BUDGET_S (total, 300),
# RUNNERS (default: every *_case of the table), EXCLUDE (runners left out of racecheck),
# LB_SRCDIR and LB_BUILDDIR (default: the current directory for both).
set -uo pipefail
out=${1:-sanitize}
mkdir -p "$out"
cs=${COMPUTE_SANITIZER:-compute-sanitizer}
command -v "$cs" > /dev/null || cs=/usr/local/cuda/bin/compute-sanitizer
export CK_FORK=no LB_TEST_SEED=${LB_TEST_SEED:-1}
t=${LB_BUILDDIR:-.}/tests/test_backend_ops
table=${LB_SRCDIR:-.}/tests/test_backend_ops.c
status=0

if [ "${MEMCHECK_S:-600}" -gt 0 ]; then
    timeout "${MEMCHECK_S:-600}" "$cs" --tool memcheck --error-exitcode 9 "$t" > "$out/memcheck.log" 2>&1
    rc=$?
    # compute-sanitizer prints each error as it finds it ("========= Invalid ...", "=========
    # Program hit ..."): a run cut by the time limit fails on those it printed, and is named
    # as not finished otherwise (the cases it reached: "N%: Checks" is written at the end only)
    errs=$(grep -cE '^========= (Invalid|Program hit|Uninitialized|Leaked|Malloc|Cuda API|Error)' \
           "$out/memcheck.log")
    if [ $rc -eq 124 ] && [ "$errs" -eq 0 ]; then
        echo "memcheck: not finished in ${MEMCHECK_S:-600} s, no error reported before the limit" \
             "($(grep -c '^Running\|^  ' "$out/memcheck.log") lines of output)"
    else
        echo "memcheck: rc $rc; $errs error reports; $(grep -E 'ERROR SUMMARY' "$out/memcheck.log" | tail -1);" \
             "$(grep -E '^[0-9]+%: Checks' "$out/memcheck.log" | tail -1)"
        [ $rc -eq 0 ] || status=1
    fi
fi

runners=${RUNNERS:-$(sed -n '/^static const test_case CASES/,/^#define NCASES/p' "$table" |
                     grep -o '\b[a-z0-9_]*_case\b' | grep -v '^test_case$' | sort -u)}
start=$SECONDS
for r in $runners; do
    case " ${EXCLUDE:-} " in *" $r "*) echo "racecheck $r: excluded"; continue ;; esac
    left=$(( ${RACE_BUDGET_S:-300} - (SECONDS - start) ))
    if [ $left -le 5 ]; then echo "racecheck $r: not run (budget spent)"; continue; fi
    lim=${RACE_S:-60}
    [ $lim -gt $left ] && lim=$left
    LB_TEST_CASES=$r timeout "$lim" "$cs" --tool racecheck --racecheck-report hazard \
        --error-exitcode 9 "$t" > "$out/racecheck-$r.log" 2>&1
    rc=$?
    case $rc in
        0) echo "racecheck $r: 0 hazards ($(grep -E 'RACECHECK SUMMARY' "$out/racecheck-$r.log" | tail -1))" ;;
        124) echo "racecheck $r: not finished in ${lim} s" ;;
        *) echo "racecheck $r: rc $rc: $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY|Failures' "$out/racecheck-$r.log" | tail -1)"
           status=1 ;;
    esac
done
exit $status
