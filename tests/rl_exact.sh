# rl_exact.sh: sourced by tests/test_rl_prompts.sh and tests/test_rl_words.sh (after tests/lib.sh:
# fail). Defines:
#   field NAME FILE  the values of "NAME" in the step lines of a metrics file
#   exact NAME FILE  sampler and trainer agreed on every step of FILE: every train-rollout
#                    log-prob difference and its maximum exactly 0, routing_agreement 1
field() { grep '"reward_mean"' "$2" | sed "s/.*\"$1\": \([^,}]*\).*/\1/"; }
exact() {
    local f bad
    for f in train_rollout_logprob_abs_diff train_rollout_logprob_abs_diff_max; do
        bad=$(field $f "$2" | grep -vx 0 || true)
        [ -z "$bad" ] || fail "$1: $f is $bad, not 0"
    done
    bad=$(field routing_agreement "$2" | grep -vx 1 || true)
    [ -z "$bad" ] || fail "$1: routing_agreement is $bad, not 1"
    echo "$1: train_rollout_logprob_abs_diff = 0 and routing_agreement = 1 on every step"
}
