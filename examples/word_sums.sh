#!/bin/sh
# word_sums.sh: sums up to ten of two numbers from one to nine, in words of the King James Bible
# (one token each in tests/data/tok_kjv), for the rl-words example (examples/rl-words.cfg).
#   sh examples/word_sums.sh corpus [PASSES] > data/word_sums.jsonl   # pretraining text
#   sh examples/word_sums.sh prompts > examples/rl-words.jsonl         # RL prompts and answers
# corpus: PASSES (default 130) passes over the 45 sums, each pass in its own order, one JSON
# object a line, one document each for `lowbit data tokenize`; the sum is written in digits or,
# as often, in words: {"text": "two and three are 5."}, {"text": "four and one are five."}.
# prompts: the 45 problems in order, {"prompt": "two and three are", "answer": "5"}: the answer
# in digits, which answer_exact, `correct` and pass@k (numbers) judge. Deterministic: the
# orders and forms come from a Park-Miller generator in integer arithmetic, the same under
# every awk.
set -eu
mode=${1:-}
passes=${2:-130}
case $mode in corpus | prompts) ;; *)
    echo "usage: $0 corpus [PASSES] | prompts" >&2; exit 2 ;;
esac
case $passes in '' | *[!0-9]*)
    echo "$0: PASSES must be a whole number, not '$passes'" >&2; exit 2 ;;
esac
awk -v mode="$mode" -v passes="$passes" 'BEGIN {
    split("one two three four five six seven eight nine ten", w, " ")
    n = 0
    for (a = 1; a <= 9; a++)
        for (b = 1; a + b <= 10; b++) { n++; pa[n] = a; pb[n] = b }
    if (mode == "prompts") {
        for (i = 1; i <= n; i++)
            printf "{\"prompt\": \"%s and %s are\", \"answer\": \"%d\"}\n",
                   w[pa[i]], w[pb[i]], pa[i] + pb[i]
        exit
    }
    x = 20261207
    for (p = 0; p < passes; p++) {
        for (i = 1; i <= n; i++) o[i] = i
        for (i = n; i > 1; i--) {   # Fisher-Yates; x * 16807 < 2^46 stays exact in a double
            x = (x * 16807) % 2147483647
            j = 1 + x % i
            t = o[i]; o[i] = o[j]; o[j] = t
        }
        for (i = 1; i <= n; i++) {   # the sum in digits or, as often, in words
            x = (x * 16807) % 2147483647
            a = pa[o[i]]; b = pb[o[i]]
            printf "{\"text\": \"%s and %s are %s.\"}\n", w[a], w[b], x % 2 ? w[a + b] : a + b
        }
    }
}'
