#!/bin/bash
# `lowbit rl` and `lowbit sample` end to end on a small MoE pretrained here for a few steps:
# - every precision recipe (and the fp8 KV cache, mini-batches, KL to the reference): in
#   deterministic mode the trainer's recomputed log-probs equal the sampler's on every step,
#   after weight updates too (train_rollout_logprob_abs_diff exactly 0, and its maximum);
# - text prompts through a tokenizer.json (data.tokenizer), the same exactness;
# - a resumed RL run continues bit for bit;
# - `lowbit sample`: greedy output does not depend on slots or forward size, a seed reproduces;
# - configuration and reward-command mistakes stop with file:line or the command's name;
# - data parallelism (mpirun -np 2, ZeRO-1): the same rollouts as one rank, bit for bit, the
#   same losses and final weights within 1e-5, a one-rank checkpoint resumed under dp2;
# - tensor and expert parallelism (tp2, ep2, tp2 x ep2, tp2 x ep2 with etp 1): the same against
#   one rank, with ranks that idle in the expert-parallel lockstep, and a one-rank checkpoint
#   resumed under tp2 x ep2;
# - the layouts RL does not run (pp, sequence parallelism, heads that tp does not divide)
#   refused with one file:line message before any work.
set -euo pipefail
fail_fast=1   # each step builds on the ones before it
. "${LB_SRCDIR:-.}/tests/lib.sh"

. "$src/tests/rl_setup.sh"   # pretraining, rl, field, check_zero

for r in $LB_RECIPES; do
    "$bin" rl "$src/examples/rl-arith.cfg" "${rl[@]}" --set precision.recipe=$r \
        --set run.out_dir="$tmp/rl-$r" > "$tmp/rl-$r.log"
    check_zero "$r" "$tmp/rl-$r"
done
"$bin" rl "$src/examples/rl-arith.cfg" "${rl[@]}" --set precision.recipe=mxfp8 \
    --set sample.kv_cache=fp8 --set rl.mini_batches=2 --set rl.micro_batch=3 \
    --set rl.kl_coef=0.05 --set run.out_dir="$tmp/rl-more" > "$tmp/rl-more.log"
check_zero "fp8 KV cache, 2 mini-batches, KL" "$tmp/rl-more"
grep -aq 'rl/config' "$tmp"/rl-more/events.out.tfevents.* || fail "no rl/config text in the event file"
field kl_ref "$tmp/rl-more/metrics.jsonl" | tail -n 2 | awk '$1 <= 0 { exit 1 }' ||
    fail "KL to the reference stayed 0 after updates"

# Text prompts through a tokenizer.json (data.tokenizer): a model of its vocabulary, the problems
# as its ids, the completions decoded for the rewards; sampler and trainer still agree exactly.
# A vocabulary smaller than the tokenizer's is refused.
tok="$src/tests/data/tok_kjv/tokenizer.json"
"$bin" train "$src/examples/tiny-moe.cfg" --set data.train_files="$tmp/arith_train_*.bin" \
    --set data.val_files= --set model.hidden_size=32 --set model.num_hidden_layers=2 \
    --set model.head_dim=16 --set model.moe_intermediate_size=32 --set model.vocab_size=4100 \
    --set train.seq_len=32 --set train.micro_batch=8 --set train.steps=2 \
    --set train.warmup_steps=1 --set train.log_every=0 --set run.out_dir="$tmp/pre-bpe" \
    --set run.backend=cpu > /dev/null
"$bin" rl "$src/examples/rl-arith.cfg" "${rl[@]}" \
    --set rl.init="$tmp/pre-bpe/checkpoints/step_00000002.safetensors" \
    --set data.tokenizer="$tok" --set run.out_dir="$tmp/rl-bpe" > "$tmp/rl-bpe.log"
grep -q "prompts and completions through .*tokenizer.json (4100 tokens)" "$tmp/rl-bpe.log" ||
    fail "the RL run with data.tokenizer did not say it uses it"
check_zero "tokenizer prompts" "$tmp/rl-bpe"
if "$bin" rl "$src/examples/rl-arith.cfg" "${rl[@]}" --set data.tokenizer="$tok" \
    --set run.out_dir="$tmp/rl-bpe-bad" > "$tmp/out" 2> "$tmp/err"; then
    fail "a 256-token model with a 4100-token tokenizer: exit 0"
fi
grep -q "has 4100 tokens, more than the model's vocabulary (256)" "$tmp/err" ||
    { cat "$tmp/err"; fail "a 256-token model with a 4100-token tokenizer: no clear error"; }

# Memory options in the RL loop: recomputation in the trainer's forward and backward and
# optimizer offload leave the fp32 run above unchanged, bit for bit.
"$bin" rl "$src/examples/rl-arith.cfg" "${rl[@]}" --set train.recompute=full \
    --set train.optimizer_offload=0.5 --set run.out_dir="$tmp/rl-mem" > "$tmp/rl-mem.log"
rlstrip() { grep '"reward_mean"' "$1" | sed 's/, "rollout_s".*//'; }
diff <(rlstrip "$tmp/rl-fp32/metrics.jsonl") <(rlstrip "$tmp/rl-mem/metrics.jsonl") > /dev/null ||
    fail "recompute + offload changed the RL run"
"${LB_BUILDDIR:-.}/tests/ckpt_compare" --moments "$tmp/rl-fp32/checkpoints/step_00000003.safetensors" \
    "$tmp/rl-mem/checkpoints/step_00000003.safetensors" 0 > /dev/null ||
    fail "recompute + offload: the RL checkpoints differ"

# Resume: the 3 fp32 steps above against their step-2 checkpoint and a resumed third.
"$bin" rl "$src/examples/rl-arith.cfg" "${rl[@]}" --set checkpoint.resume="$tmp/rl-fp32/checkpoints/step_00000002.safetensors" \
    --set run.out_dir="$tmp/b" > "$tmp/b.log"
grep -q "resumed from .*step_00000002.safetensors at step 2" "$tmp/b.log" || fail "resume not reported"
strip() { grep '"reward_mean"' "$1" | sed 's/, "rollout_s".*//'; }
diff <(strip "$tmp/rl-fp32/metrics.jsonl" | tail -n 1) <(strip "$tmp/b/metrics.jsonl") ||
    fail "the resumed RL step differs from the uninterrupted one"

# lowbit sample: greedy, one sequence at a time vs 8 at once; a seeded draw twice, in other batches.
ck="$tmp/rl-fp32/checkpoints/step_00000003.safetensors"
s=(--set sample.checkpoint="$ck" --set sample.problems=12 --set sample.max_new_tokens=5)
"$bin" sample "${s[@]}" --set sample.top_k=1 --set sample.slots=1 --set sample.max_rows=1 > "$tmp/g1"
"$bin" sample "${s[@]}" --set sample.top_k=1 --set sample.slots=8 > "$tmp/g8"
diff <(grep -av '^#' "$tmp/g1") <(grep -av '^#' "$tmp/g8") || fail "greedy output depends on the batch"
[ "$(grep -avc '^#' "$tmp/g1")" = 12 ] || fail "expected 12 completions"
"$bin" sample "${s[@]}" --set sample.samples=3 --set sample.slots=2 --set sample.max_rows=7 > "$tmp/s1"
"$bin" sample "${s[@]}" --set sample.samples=3 --set sample.slots=36 > "$tmp/s2"
diff <(grep -av '^#' "$tmp/s1") <(grep -av '^#' "$tmp/s2") || fail "seeded samples depend on the batch"
grep -q "^# arithmetic (val split): pass@1 [0-9.]*, pass@3 [0-9.]*$" "$tmp/s1" ||
    fail "no pass@1 and pass@3 summary"
grep -q "^# arithmetic (val split): pass@1 [0-9.]*$" "$tmp/g1" ||
    fail "one sample a prompt: the summary should be pass@1 alone"
printf '12+3=\n\n' > "$tmp/empty.txt"
printf '12+3=\n7-7=' > "$tmp/prompts.txt"
"$bin" sample "${s[@]}" --set sample.prompts="$tmp/prompts.txt" > "$tmp/p"
[ "$(grep -avc '^#' "$tmp/p")" = 2 ] || fail "prompts file: expected 2 completions"

# mistakes
printf '[rl]\ninit = %s\nrewards = arith_exact,bogus\n' "$init" > "$tmp/bad.cfg"
expect_error bad-reward "bad.cfg:3: rl.rewards: unknown reward 'bogus' \(registered: arith_exact, arith_format, arith_digits, answer_exact, answer_regex, answer_format\)" \
    "$bin" rl "$tmp/bad.cfg"
printf '[rl]\ninit = %s\n[sample]\nstop_tokens = 10,x\n' "$init" > "$tmp/stop.cfg"
expect_error bad-stop "stop.cfg:4: sample.stop_tokens: '10,x' is not a list of token ids" "$bin" rl "$tmp/stop.cfg"
printf '[rl]\ninit = %s\n[model]\nhidden_size = 64\n' "$init" > "$tmp/model.cfg"
expect_error model-mismatch "model.cfg:4: model.hidden_size differs from the model in .*step_00000015" \
    "$bin" rl "$tmp/model.cfg"
expect_error no-init "rl.init is empty" "$bin" rl --set rl.steps=1
expect_error no-ckpt "sample.checkpoint is empty" "$bin" sample
expect_error empty-prompt "empty.txt:2: empty prompt" "$bin" sample "${s[@]}" --set sample.prompts="$tmp/empty.txt"
# a NUL byte would end the text there and drop the later prompts unseen
printf '1+2=\n3+4=\0\n5+6=\n' > "$tmp/nul.txt"
expect_error nul-prompt "nul.txt:2: a NUL byte \(offset 9\): this is not a text file" \
    "$bin" sample "${s[@]}" --set sample.prompts="$tmp/nul.txt"
# a reward command that is not there is refused before any work, and leaves no run directory
expect_error reward-cmd-missing "rl.reward_command: '/nonexistent/score.sh' is not a command sh can run" \
    "$bin" rl "$src/examples/rl-arith.cfg" "${rl[@]}" --set rl.reward_command="/nonexistent/score.sh" \
    --set run.out_dir="$tmp/nocmd"
[ ! -e "$tmp/nocmd" ] || fail "a refused reward command left $tmp/nocmd"
expect_error reward-cmd "rl.reward_command: 'exit 7' exited with status 7" \
    "$bin" rl "$src/examples/rl-arith.cfg" "${rl[@]}" --set rl.reward_command="exit 7" \
    --set run.out_dir="$tmp/cmd"
cat > "$tmp/len.sh" <<'EOF'
#!/bin/sh
# reward: 1 for a completion of exactly "7\n"-like length 2 (a JSON line in, a number out)
grep -q '"completion": "[0-9]\\n"' && echo 1 || echo 0
EOF
chmod +x "$tmp/len.sh"
"$bin" rl "$src/examples/rl-arith.cfg" "${rl[@]}" --set rl.steps=1 --set rl.rewards= \
    --set rl.reward_command="$tmp/len.sh" --set rl.eval_problems=0 --set run.out_dir="$tmp/cmd2" > /dev/null ||
    fail "an external reward command run"

# Data parallelism: the same run on 1 rank and on 2 (ZeRO-1). Each prompt keeps its seeds and
# the sampler is batch-invariant, so the rollouts, hence every reward statistic and the
# evaluations, are equal exactly; losses, KL and gradient norms and the final weights agree to
# 1e-5 (sums in another order). rl.micro_batch = 2 divides the group and the mini-batch, so
# both layouts put the same sequences in each forward (the load-balancing loss is a statistic
# of a forward's tokens). The reward command (the JSON line's length) gives unequal rewards
# within groups, so the policy gradient is not zero.
mpi() { local np=$1; shift; timeout 120 mpirun --oversubscribe -np "$np" "$@"; }
# lowbit sample on model pieces: tp2, ep2 and tp2 x ep2 draw the one-rank completions (the
# same seeds; logits equal to rounding, which moves no draw here), printed once, by rank 0.
for layout in "2 parallel.tp=2" "2 parallel.ep=2" "4 parallel.tp=2 parallel.ep=2"; do
    set -- $layout
    np=$1
    shift
    sets=()
    for kv in "$@"; do sets+=(--set "$kv"); done
    mpi "$np" "$bin" sample "${s[@]}" --set sample.samples=3 "${sets[@]}" > "$tmp/sp" 2> "$tmp/sp.err" ||
        fail "sample under $*: $(tail -n 3 "$tmp/sp.err")"
    diff <(grep -av '^#' "$tmp/s1") <(grep -av '^#' "$tmp/sp") > /dev/null ||
        fail "sample under $*: the completions differ from one rank's"
done
dp=("$src/examples/rl-arith.cfg" "${rl[@]}" --set train.lr=0.0003 --set rl.mini_batches=2
    --set rl.micro_batch=2 --set rl.kl_coef=0.05 --set rl.rewards= --set "rl.reward_command=wc -c"
    --set run.threads=1)
"$bin" rl "${dp[@]}" --set run.out_dir="$tmp/dp1" > "$tmp/dp1.log"
mpi 2 "$bin" rl "${dp[@]}" --set run.out_dir="$tmp/dp2" > "$tmp/dp2.log" 2>&1 ||
    fail "dp2 rl: $(tail -n 3 "$tmp/dp2.log")"
grep -q "ZeRO-1 distributed optimizer" "$tmp/dp2.log" || fail "dp2 does not report ZeRO-1"
field reward_std "$tmp/dp2/metrics.jsonl" | awk '$1 <= 0 { exit 1 }' || fail "dp2: equal rewards"
same_run dp1 dp2
# The one-rank checkpoint of step 2 resumes under dp2 (ZeRO-1 re-shards the moments).
mpi 2 "$bin" rl "${dp[@]}" --set checkpoint.resume="$tmp/dp1/checkpoints/step_00000002.safetensors" \
    --set run.out_dir="$tmp/dp2r" > "$tmp/dp2r.log" 2>&1 || fail "dp2 resume: $(tail -n 3 "$tmp/dp2r.log")"
[ "$(field reward_mean "$tmp/dp2r/metrics.jsonl")" = "$(field reward_mean "$tmp/dp1/metrics.jsonl" | tail -n 1)" ] ||
    fail "dp2 resumed: step 3's rollouts differ"
out=$("$cmp" "$(last dp1)" "$(last dp2r)" 1e-5) || fail "dp2 resumed: parameters: $out"
# Tensor and expert parallelism against one rank. AdamW's eps is 1e-6 for these (as in
# tests/test_parallel.sh): tp sums each row-parallel output in another order, and with 1e-8 an
# element whose gradient is a cancelling sum near 1e-8 (an LM-head row of a byte never drawn)
# gets a first update that is a ratio of two rounding-level numbers (2.6e-5 relative measured).
# With etp 1 the ep groups are tp pairs, which hold the same prompts (no idle forwards).
# Three prompts over dp2 (ep2) give the ranks 2 and 1 prompts, and two sampler slots make the
# busier rank decode longer, so ranks run idle forwards and idle micro-batches to keep the ep
# group's collectives in step; idle_forwards counts them. Under tp the log-probs themselves
# differ from one rank's by rounding (|lp| near log 256 = 5.5, float32 ulp 4.8e-7), and each k3
# term of kl_ref takes that difference times |lp_ref - lp| (1e-3 here), so kl_ref (5e-6 at step
# 1) is held to the scale 1e-4 under tp (1e-9 absolute; measured 5e-10), relatively
# otherwise: ep moves rows, never changes a sum.
mp=("${dp[@]}" --set train.adam_eps=1e-6 --set rl.prompts=3 --set sample.slots=2
    --set rl.eval_problems=5)
"$bin" rl "${mp[@]}" --set run.out_dir="$tmp/m1" > "$tmp/m1.log"
for layout in "tp2 2 0 1e-4 parallel.tp=2" "ep2 2 1 0 parallel.ep=2" \
              "tp2ep2 4 1 1e-4 parallel.tp=2 parallel.ep=2" \
              "tp2etp1ep2 4 0 1e-4 parallel.tp=2 parallel.etp=1 parallel.ep=2"; do
    set -- $layout
    name=$1 np=$2 idles=$3 klscale=$4
    shift 4
    sets=()
    for kv in "$@"; do sets+=(--set "$kv"); done
    mpi "$np" "$bin" rl "${mp[@]}" "${sets[@]}" --set run.out_dir="$tmp/$name" > "$tmp/$name.log" 2>&1 ||
        fail "$name rl: $(tail -n 3 "$tmp/$name.log")"
    same_run m1 "$name" "$klscale"
    field idle_forwards "$tmp/$name/metrics.jsonl" |
        awk -v want="$idles" '($1 > 0) != want { exit 1 }' ||
        fail "$name: idle_forwards $(field idle_forwards "$tmp/$name/metrics.jsonl" | xargs) (want > 0: $idles)"
done
# The one-rank checkpoint of step 2 resumes under tp2 x ep2 (rank 0 cuts every tensor).
mpi 4 "$bin" rl "${mp[@]}" --set parallel.tp=2 --set parallel.ep=2 \
    --set checkpoint.resume="$tmp/m1/checkpoints/step_00000002.safetensors" \
    --set run.out_dir="$tmp/mpr" > "$tmp/mpr.log" 2>&1 || fail "tp2 x ep2 resume: $(tail -n 3 "$tmp/mpr.log")"
[ "$(field reward_mean "$tmp/mpr/metrics.jsonl")" = "$(field reward_mean "$tmp/m1/metrics.jsonl" | tail -n 1)" ] ||
    fail "tp2 x ep2 resumed: step 3's rollouts differ"
out=$("$cmp" "$(last m1)" "$(last mpr)" 1e-5) || fail "tp2 x ep2 resumed: parameters: $out"
# Layouts RL does not run: one file:line message, before any work. The model's heads are
# checked against tp once its section is read from rl.init (here a model with one KV head).
"$bin" train "$src/examples/tiny-moe.cfg" --set data.train_files="$tmp/arith_train_*.bin" \
    --set data.val_files= --set model.hidden_size=32 --set model.num_hidden_layers=1 \
    --set model.head_dim=16 --set model.moe_intermediate_size=32 --set model.num_key_value_heads=1 \
    --set train.seq_len=32 --set train.micro_batch=2 --set train.steps=1 --set train.warmup_steps=0 \
    --set train.log_every=0 --set run.out_dir="$tmp/kv1" > /dev/null
for bad in "pp:parallel.pp = 2:bad.cfg:2: parallel.pp = 2: lowbit rl runs without pipeline parallelism" \
           "sp:parallel.tp = 2\nsequence_parallel = true:bad.cfg:3: parallel.sequence_parallel: lowbit rl runs without sequence parallelism" \
           "kv:parallel.tp = 2:bad.cfg:2: model.num_key_value_heads \(1\) is not divisible by parallel.tp \(2\).*kv1/"; do
    IFS=: read -r name keys want <<< "$bad"
    printf "[parallel]\n${keys#parallel.}\n" > "$tmp/bad.cfg"
    init_of=$init
    [ "$name" = kv ] && init_of="$tmp/kv1/checkpoints/step_00000001.safetensors"
    rm -rf "$tmp/bad"
    mpi 2 "$bin" rl "$tmp/bad.cfg" "${rl[@]}" --set rl.init="$init_of" --set run.out_dir="$tmp/bad" \
        > /dev/null 2> "$tmp/err" && fail "$name: exit 0"
    [ "$(grep -Ec -- "$want" "$tmp/err")" = 1 ] || { cat "$tmp/err"; fail "$name: message"; }
    [ ! -e "$tmp/bad" ] || fail "$name: work was done"
done
summary
