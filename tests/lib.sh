# lib.sh: sourced first by the shell tests, as . "${LB_SRCDIR:-.}/tests/lib.sh" (make check sets
# LB_SRCDIR and LB_BUILDDIR; by hand they default to the current directory). Defines:
#   src, bin        the source tree and the lowbit binary
#   tmp             a fresh directory, removed on exit (kept when KEEP is set, for reading)
#   pass, failed    counts of checks passed and failed
#   ok              counts a check passed
#   fail MSG        prints FAIL: MSG and counts it; a script that sets fail_fast=1 before
#                   sourcing stops there instead (exit 1), for the steps the next ones build on
#   expect_error NAME PATTERN CMD...
#                   CMD exits non-zero (a timeout's 124 counts as a failure) and prints PATTERN
#                   (grep -E) on stderr
#   summary [NAME]  the last line: the counts (or PASS where nothing was counted), and the
#                   exit status, 0 only when nothing failed
#   LB_RECIPES      the precision recipes, as `lowbit params` lists precision.recipe's choices,
#                   so a new recipe is tested where the tests loop over them all
# absolute, as make check gives them: tests run lowbit from other directories
src=$(cd "${LB_SRCDIR:-.}" && pwd)
bin=$(cd "${LB_BUILDDIR:-.}" && pwd)/lowbit
tmp=$(mktemp -d)
[ -n "${KEEP:-}" ] || trap 'rm -rf "$tmp"' EXIT
pass=0
failed=0
fail() {
    echo "FAIL: $*"
    failed=$((failed + 1))
    [ -z "${fail_fast:-}" ] || exit 1
}
ok() { pass=$((pass + 1)); }

expect_error() {
    local name=$1 pattern=$2 rc=0
    shift 2
    "$@" > "$tmp/out" 2> "$tmp/err" || rc=$?   # `|| rc=$?`: no stop under set -e
    if [ $rc -eq 0 ] || [ $rc -eq 124 ]; then fail "$name: exit $rc"; return; fi
    if ! grep -Eq -- "$pattern" "$tmp/err"; then
        # stderr first: under fail_fast, fail does not return
        sed 's/^/    /' "$tmp/err"; fail "$name: stderr lacks '$pattern' (stderr above)"; return
    fi
    ok
}

summary() {
    if [ "$pass" -gt 0 ] || [ "$failed" -gt 0 ]; then echo "${1:+$1: }$pass passed, $failed failed"
    else echo "PASS"; fi
    [ "$failed" -eq 0 ]
}

# The table's line is | `recipe` | enum | `fp32` | `fp32`, `bf16`, ... | description |.
LB_RECIPES=$("${LB_BUILDDIR:-.}/lowbit" params 2> /dev/null | awk -F'|' '
    /^## / { s = $0 }
    s == "## [precision]" && $2 ~ /`recipe`/ { gsub(/[`,]/, "", $5); print $5 }' | xargs)
# an empty list would turn every loop over the recipes into a silent pass
case " $LB_RECIPES " in
    *" fp32 "*) ;;
    *) echo "ERROR: no precision.recipe choices from ${LB_BUILDDIR:-.}/lowbit params"; exit 99 ;;
esac
