#!/bin/bash
# libfuzzer.sh TARGET...: `make fuzz`. Builds the fuzz targets (tests/fuzz/fuzz_TARGET.c) with
# clang's libFuzzer, AddressSanitizer and UndefinedBehaviorSanitizer in a copy of the tracked
# tree (FUZZ_DIR, default /tmp/lowbit-fuzz; the in-tree build is left alone), then runs each for
# FUZZ_SECONDS (default 60) from the committed corpus tests/fuzz/corpus/TARGET/. The inputs it
# makes stay in FUZZ_DIR/work/TARGET. An input that crashes or trips a sanitizer is copied into
# tests/fuzz/corpus/TARGET/ (as crash-*, leak-*, timeout-* ...): mend the reader, and commit the
# file, so that `make check` replays it from then on. Exit 1 when anything was found.
set -euo pipefail
src=$(cd "$(dirname "$0")/../.." && pwd)
dir=${FUZZ_DIR:-/tmp/lowbit-fuzz}
seconds=${FUZZ_SECONDS:-60}
[ $# -gt 0 ] || set -- config safetensors checkpoint shard tokenizer
if ! echo 'int LLVMFuzzerTestOneInput(const char *d, long n) { return 0; }' |
     clang -fsanitize=fuzzer -x c - -o /dev/null 2>/dev/null; then
    echo "make fuzz: needs clang with libFuzzer (-fsanitize=fuzzer)" >&2
    exit 1
fi
mkdir -p "$dir/tree" "$dir/work"
if (cd "$src" && git rev-parse --is-inside-work-tree > /dev/null 2>&1); then
    (cd "$src" && git ls-files -z | xargs -0 cp --parents -t "$dir/tree")
else   # the distribution's files (an in-tree configure needed)
    make -s -C "$src" distdir distdir="$dir/tree" > /dev/null
fi
cd "$dir/tree"
san="-fsanitize=address,undefined -fno-sanitize-recover=undefined"
if [ ! -f Makefile ]; then
    ./bootstrap > /dev/null
    ./configure -q --without-cuda CC=clang CFLAGS="-g -O1 -fno-omit-frame-pointer $san \
        -fsanitize=fuzzer-no-link" LDFLAGS="$san"
fi
bins=()
for t in "$@"; do bins+=("tests/fuzz/fuzz_$t"); done
rm -f "${bins[@]}"   # linked with the replay driver's main before, if ever
make -j2 "${bins[@]}" CPPFLAGS=-DLB_LIBFUZZER LDFLAGS="$san -fsanitize=fuzzer" > /dev/null
export ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1
found=0
for t in "$@"; do
    mkdir -p "$dir/work/$t" "$dir/found/$t"
    echo "make fuzz: $t for $seconds s"
    "./tests/fuzz/fuzz_$t" -max_total_time="$seconds" -timeout=20 -rss_limit_mb=4096 \
        -artifact_prefix="$dir/found/$t/" "$dir/work/$t" "$src/tests/fuzz/corpus/$t" \
        > "$dir/work/$t.log" 2>&1 || true
    tail -n 1 "$dir/work/$t.log"
    for f in "$dir/found/$t"/*; do
        [ -e "$f" ] || continue
        cp "$f" "$src/tests/fuzz/corpus/$t/"
        echo "make fuzz: $t: $(basename "$f") -> tests/fuzz/corpus/$t/ (log: $dir/work/$t.log)"
        rm -f "$f"
        found=1
    done
done
exit $found
