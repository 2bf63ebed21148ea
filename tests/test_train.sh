#!/bin/bash
# End-to-end training on the CPU: data generation, a run that learns, and a resumed run that
# continues bit for bit (every logged loss and gradient norm identical).
set -euo pipefail
fail_fast=1   # each step builds on the ones before it
. "${LB_SRCDIR:-.}/tests/lib.sh"

"$bin" data "$src/examples/tiny-moe.cfg" --set gen.output="$tmp/arith" --set gen.problems=4000 \
    > "$tmp/data.log"
entropy=$(awk '/^train/ {print $(NF-1)}' "$tmp/data.log")
echo "unigram entropy of the corpus: $entropy nats/token"

small=(--set data.train_files="$tmp/arith_train_*.bin" --set data.val_files="$tmp/arith_val_*.bin"
       --set model.hidden_size=48 --set model.num_hidden_layers=2 --set model.head_dim=16
       --set model.moe_intermediate_size=64 --set train.seq_len=32 --set train.micro_batch=8
       --set train.log_every=0 --set checkpoint.keep=5)

# 1. It learns: after 120 steps the training loss is well below the unigram entropy.
"$bin" train "$src/examples/tiny-moe.cfg" "${small[@]}" --set train.steps=120 \
    --set train.warmup_steps=5 --set train.val_every=60 --set run.out_dir="$tmp/learn" > "$tmp/learn.log"
final=$(grep '"loss"' "$tmp/learn/metrics.jsonl" | tail -n 1 | sed 's/.*"loss": \([^,]*\),.*/\1/')
echo "loss after 120 steps: $final"
awk -v l="$final" -v h="$entropy" 'BEGIN { exit !(l < h - 0.5) }' ||
    fail "loss $final is not well below the unigram entropy $entropy"
# the resolved configuration goes to OUT_DIR/config.ini (a parameter file of the same run), not
# to stdout, unless -v
[ -f "$tmp/learn/config.ini" ] || fail "no config.ini in the run directory"
grep -q "^configuration: $tmp/learn/config.ini " "$tmp/learn.log" || fail "config.ini not named"
! grep -q "resolved configuration" "$tmp/learn.log" || fail "the configuration dump without -v"
"$bin" info "$tmp/learn/config.ini" | grep -q "^model  *qwen3_moe" || fail "config.ini does not load"
"$bin" train "$src/examples/tiny-moe.cfg" "${small[@]}" --set train.steps=1 --set train.warmup_steps=0 \
    --set run.out_dir="$tmp/verbose" -v > "$tmp/verbose.log"
grep -q "^# resolved configuration" "$tmp/verbose.log" || fail "-v prints no configuration"
# progress: in a file the logged steps only; on a terminal (script's pty) the steps between them
# too, each rewritten in place
printf '%q ' "$bin" train "$src/examples/tiny-moe.cfg" "${small[@]}" --set train.steps=6 \
    --set train.warmup_steps=1 --set train.log_every=3 --set run.out_dir="$tmp/tty" \
    --set run.overwrite=true > "$tmp/tty.sh"   # run twice: to a file, then on a terminal
bash "$tmp/tty.sh" > "$tmp/file.out"
[ "$(grep -c '^step     [36]/6 | loss ' "$tmp/file.out")" = 2 ] && ! grep -q $'\r' "$tmp/file.out" ||
    fail "a log file should hold the logged steps, each on a line of its own"
if command -v script > /dev/null; then
    script -qec "bash $tmp/tty.sh" "$tmp/tty.out" > /dev/null
    grep -q $'\r\033\[Kstep 2/6 | loss ' "$tmp/tty.out" || fail "no in-place progress on a terminal"
    grep -q $'\r\033\[Kstep     3/6 | loss ' "$tmp/tty.out" || fail "no logged step on a terminal"
fi

# 2. Resume: 8 steps straight, and the same run restarted from its step-4 checkpoint.
run=("${small[@]}" --set train.steps=8 --set train.warmup_steps=2 --set checkpoint.save_every=4
     --set train.grad_accum=2)
"$bin" train "$src/examples/tiny-moe.cfg" "${run[@]}" --set run.out_dir="$tmp/a" > "$tmp/a.log"
ck="$tmp/a/checkpoints/step_00000004.safetensors"
[ -f "$ck" ] || fail "no checkpoint at step 4"
[ -f "$tmp/a/checkpoints/step_00000008.safetensors" ] || fail "no final checkpoint"
"$bin" train "$src/examples/tiny-moe.cfg" "${run[@]}" --set run.out_dir="$tmp/b" \
    --set checkpoint.resume="$ck" > "$tmp/b.log"
grep -q "resumed from $ck at step 4" "$tmp/b.log" || fail "resume not reported"
strip() { grep '"loss"' "$1" | sed 's/, "tokens_per_s".*//'; }   # drop timings
diff <(strip "$tmp/a/metrics.jsonl" | tail -n 4) <(strip "$tmp/b/metrics.jsonl") ||
    fail "resumed run differs from the uninterrupted one"
[ "$(strip "$tmp/b/metrics.jsonl" | wc -l)" = 4 ] || fail "resumed run should log steps 5-8 only"
# 2b. Resumed in its own directory from step 4 after it ran to 8 (a run that went past its last
#     checkpoint): metrics.jsonl keeps one row a step, the uninterrupted run's rows.
cp -r "$tmp/a" "$tmp/c"
"$bin" train "$src/examples/tiny-moe.cfg" "${run[@]}" --set run.out_dir="$tmp/c" \
    --set checkpoint.resume="$tmp/c/checkpoints/step_00000004.safetensors" > "$tmp/c.log"
diff <(strip "$tmp/a/metrics.jsonl") <(strip "$tmp/c/metrics.jsonl") ||
    fail "resumed in place: metrics.jsonl does not hold one row a step (steps 5-8 repeated?)"

# 2c. A resume names the keys changed since the checkpoint (the [model] keys are refused).
grep -q "at step 4; changed since: run.out_dir $tmp/a -> $tmp/b$" "$tmp/b.log" ||
    fail "resume: $(grep resumed "$tmp/b.log")"
"$bin" train "$src/examples/tiny-moe.cfg" "${run[@]}" --set run.out_dir="$tmp/b2" \
    --set train.lr=0.001 --set checkpoint.resume="$ck" > "$tmp/b2.log"
grep -q "changed since: run.out_dir $tmp/a -> $tmp/b2, train.lr 0.003 -> 0.001$" "$tmp/b2.log" ||
    fail "resume with another lr: $(grep resumed "$tmp/b2.log")"
# 3. resume = auto picks the newest checkpoint in out_dir: nothing left to do at step 8.
"$bin" train "$src/examples/tiny-moe.cfg" "${run[@]}" --set run.out_dir="$tmp/a" \
    --set checkpoint.resume=auto > "$tmp/auto.log"
grep -q "resumed from .*step_00000008.safetensors at step 8" "$tmp/auto.log" || fail "auto resume"
# 3b. Fine-tuning (checkpoint.init): the learnt weights, at step 1 of a new run, with new moments
#     and data position: its first loss is the trained model's, far below a fresh start's; a
#     [model] key that differs from the checkpoint's is refused by name.
ft=("${small[@]}" --set train.steps=2 --set train.warmup_steps=0)
"$bin" train "$src/examples/tiny-moe.cfg" "${ft[@]}" --set run.out_dir="$tmp/fresh" > "$tmp/fresh.log"
"$bin" train "$src/examples/tiny-moe.cfg" "${ft[@]}" --set run.out_dir="$tmp/ft" \
    --set checkpoint.init="$tmp/learn/checkpoints/step_00000120.safetensors" > "$tmp/ft.log"
grep -q "^initialized from .*step_00000120.safetensors (weights only" "$tmp/ft.log" ||
    fail "checkpoint.init not reported"
first() { grep '"loss"' "$1" | head -n 1 | sed 's/.*"loss": \([^,]*\),.*/\1/'; }
[ "$(grep -c '"loss"' "$tmp/ft/metrics.jsonl")" = 2 ] || fail "fine-tuning should log steps 1-2"
awk -v f="$(first "$tmp/ft/metrics.jsonl")" -v z="$(first "$tmp/fresh/metrics.jsonl")" \
    'BEGIN { exit !(f < z - 1) }' || fail "fine-tuning does not start from the learnt weights"
! "$bin" train "$src/examples/tiny-moe.cfg" "${ft[@]}" --set model.hidden_size=64 \
    --set run.out_dir="$tmp/ft2" --set checkpoint.init="$tmp/learn/checkpoints/step_00000120.safetensors" \
    > "$tmp/ft2.log" 2>&1 || fail "checkpoint.init with another model accepted"
grep -q "model.hidden_size differs from the model in" "$tmp/ft2.log" || fail "no message: $(cat "$tmp/ft2.log")"
# 3c. checkpoint.save_minutes: a save whenever that long has passed (here a few milliseconds:
#     every step) beside save_every's; the progress line says the step's time and the time run.
"$bin" train "$src/examples/tiny-moe.cfg" "${small[@]}" --set train.steps=3 --set train.warmup_steps=0 \
    --set train.log_every=1 --set checkpoint.save_minutes=0.00001 --set run.out_dir="$tmp/minutes" \
    > "$tmp/minutes.log"
[ "$(ls "$tmp/minutes/checkpoints" | grep -c '^step_0000000[123].safetensors$')" = 3 ] ||
    fail "save_minutes: $(ls "$tmp/minutes/checkpoints" | tr '\n' ' ')"
grep -Eq '^step     2/3 \| .* \| [0-9]+ ms/step \| mem [0-9]+ MiB \| 0m[0-9]{2}s in, ETA ' "$tmp/minutes.log" ||
    fail "progress line: $(grep '^step     2/3' "$tmp/minutes.log")"
# 4. Every precision recipe trains: finite losses that fall over 20 steps; so does fp8-block
#    with power-of-two scales (precision.scale = pow2), whose losses are not fp8-block's own.
for v in $LB_RECIPES fp8-block,pow2; do
    [ "$v" != fp32 ] || continue   # trained in 1.
    r=${v%,*} scale=fp32
    [ "$v" = "$r" ] || scale=${v#*,}
    "$bin" train "$src/examples/tiny-moe.cfg" "${small[@]}" --set train.steps=20 \
        --set train.warmup_steps=2 --set precision.recipe=$r --set precision.scale=$scale \
        --set run.out_dir="$tmp/p-$v" > "$tmp/p.log"
    m="$tmp/p-$v/metrics.jsonl"
    first=$(grep '"loss"' "$m" | head -n 3 | sed 's/.*"loss": \([^,]*\),.*/\1/' |
            awk '{s += $1} END {print s / NR}')
    last=$(grep '"loss"' "$m" | tail -n 3 | sed 's/.*"loss": \([^,]*\),.*/\1/' |
           awk '{s += $1} END {print s / NR}')
    echo "recipe $v: loss $first -> $last"
    awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a - 0.5) }' ||
        fail "recipe $v does not train"
done
losses() { grep '"loss"' "$1/metrics.jsonl" | sed 's/.*"loss": \([^,]*\),.*/\1/'; }
! diff -q <(losses "$tmp/p-fp8-block") <(losses "$tmp/p-fp8-block,pow2") > /dev/null ||
    fail "precision.scale=pow2 trains the same losses as fp32 scales: not applied"
# 5. Activation recomputation runs a layer's norms, core attention and SwiGLU (selective) or
#    its whole forward (full) again before its backward: the same bits (metrics and every
#    parameter and moment of the final checkpoint), here for fp32 and for NVFP4 with its 4-bit
#    weight-gradient GEMMs, and less activation memory.
cmp=${LB_BUILDDIR:-.}/tests/ckpt_compare
for r in fp32 nvfp4-moe; do
    ref="$tmp/a"
    if [ $r != fp32 ]; then
        ref="$tmp/rn-$r"
        "$bin" train "$src/examples/tiny-moe.cfg" "${run[@]}" --set precision.recipe=$r \
            --set run.out_dir="$ref" > "$tmp/rc.log"
    fi
    for how in selective full; do
        "$bin" train "$src/examples/tiny-moe.cfg" "${run[@]}" --set precision.recipe=$r \
            --set train.recompute=$how --set run.out_dir="$tmp/rc-$r-$how" > "$tmp/rc.log"
        diff <(strip "$ref/metrics.jsonl") <(strip "$tmp/rc-$r-$how/metrics.jsonl") ||
            fail "recompute $how ($r): the metrics differ from the run without it"
        "$cmp" --moments "$ref/checkpoints/step_00000008.safetensors" \
            "$tmp/rc-$r-$how/checkpoints/step_00000008.safetensors" 0 ||
            fail "recompute $how ($r): checkpoints differ"
    done
done
act() { "$bin" info "$src/examples/tiny-moe.cfg" "$@" | awk '$1 == "per" {getline; print $(NF - 1)}'; }
a0=$(act) a1=$(act --set train.recompute=selective) a2=$(act --set train.recompute=full)
echo "activation MiB per rank: $a0 without recomputation, $a1 selective, $a2 full"
awk -v a="$a0" -v b="$a1" -v c="$a2" 'BEGIN { exit !(c < 0.5 * a && b < 0.9 * a && c < b) }' ||
    fail "recomputation does not save memory"
# 6. LB_PROFILE=1 wraps the backend in a timer that only forwards: the same bits, and a table
#    of the operations on stderr, then the GEMMs by shape (the expert layers' grouped call).
LB_PROFILE=1 "$bin" train "$src/examples/tiny-moe.cfg" "${run[@]}" --set run.out_dir="$tmp/prof" \
    > "$tmp/prof.log" 2> "$tmp/prof.err"
diff <(strip "$tmp/a/metrics.jsonl") <(strip "$tmp/prof/metrics.jsonl") || fail "LB_PROFILE changed the run"
grep -q "^lowbit profile" "$tmp/prof.err" && grep -Eq "^  gemm_grouped +[0-9]+ " "$tmp/prof.err" &&
    grep -Eq "^  attention_bwd +[0-9]+ " "$tmp/prof.err" &&
    grep -Eq "^    gemm_grouped [0-9]+ x \(n [0-9]+, k ~?[0-9]+\)( bf16)? +[0-9]+ +[0-9.]+ +[0-9.]+$" "$tmp/prof.err" ||
    fail "LB_PROFILE printed no table"
# 7. Optimizer offload: 37% of the moments live and are updated in host memory (by the CPU
#    backend): the same bits, also when a checkpoint is resumed with offload.
"$bin" train "$src/examples/tiny-moe.cfg" "${run[@]}" --set train.optimizer_offload=0.37 \
    --set run.out_dir="$tmp/off" > "$tmp/off.log"
diff <(strip "$tmp/a/metrics.jsonl") <(strip "$tmp/off/metrics.jsonl") || fail "offload changed the run"
"$cmp" --moments "$tmp/a/checkpoints/step_00000008.safetensors" \
    "$tmp/off/checkpoints/step_00000008.safetensors" 0 || fail "offload: checkpoints differ"
"$bin" train "$src/examples/tiny-moe.cfg" "${run[@]}" --set train.optimizer_offload=1 \
    --set checkpoint.resume="$ck" --set run.out_dir="$tmp/offr" > "$tmp/offr.log"
"$cmp" --moments "$tmp/a/checkpoints/step_00000008.safetensors" \
    "$tmp/offr/checkpoints/step_00000008.safetensors" 0 || fail "offload resume: checkpoints differ"
# 8. AdamW's moments in bf16 (train.adam_moments): the first loss is the fp32 run's (no update
#    yet) and the others close to it but not all equal; it trains; a resumed run and offload
#    give the same bits (the checkpoint holds the bf16 moments exactly, in fp32).
m16=("${run[@]}" --set train.adam_moments=bf16)
"$bin" train "$src/examples/tiny-moe.cfg" "${m16[@]}" --set run.out_dir="$tmp/m16" > "$tmp/m16.log"
losses() { grep '"loss"' "$1" | sed 's/.*"loss": \([^,]*\),.*/\1/'; }
paste <(losses "$tmp/a/metrics.jsonl") <(losses "$tmp/m16/metrics.jsonl") |
    awk 'NR == 1 && $1 != $2 { bad = 1 } $1 != $2 { differ = 1 }
         { d = $1 - $2; if (d < 0) d = -d; if (d > 0.01 * $1) bad = 1 }
         END { exit bad || !differ }' ||
    fail "bf16 moments: losses not close to the fp32 moments' run (or all equal)"
"$bin" train "$src/examples/tiny-moe.cfg" "${m16[@]}" --set run.out_dir="$tmp/m16r" \
    --set checkpoint.resume="$tmp/m16/checkpoints/step_00000004.safetensors" > "$tmp/m16r.log"
diff <(strip "$tmp/m16/metrics.jsonl" | tail -n 4) <(strip "$tmp/m16r/metrics.jsonl") ||
    fail "bf16 moments: the resumed run differs"
"$bin" train "$src/examples/tiny-moe.cfg" "${m16[@]}" --set train.optimizer_offload=0.37 \
    --set run.out_dir="$tmp/m16o" > "$tmp/m16o.log"
for d in m16r m16o; do
    "$cmp" --moments "$tmp/m16/checkpoints/step_00000008.safetensors" \
        "$tmp/$d/checkpoints/step_00000008.safetensors" 0 || fail "bf16 moments ($d): checkpoints differ"
done
"$bin" train "$src/examples/tiny-moe.cfg" "${small[@]}" --set train.steps=20 \
    --set train.warmup_steps=2 --set train.adam_moments=bf16 --set run.out_dir="$tmp/m16t" > "$tmp/p.log"
first=$(losses "$tmp/m16t/metrics.jsonl" | head -n 3 | awk '{s += $1} END {print s / NR}')
last=$(losses "$tmp/m16t/metrics.jsonl" | tail -n 3 | awk '{s += $1} END {print s / NR}')
echo "bf16 moments: loss $first -> $last"
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a - 0.5) }' || fail "bf16 moments do not train"
# 9. Llama 3.1 (examples/tiny-llama.cfg: no q/k norm, llama3 RoPE scaling, dense MLP): every
#    recipe trains (losses fall over 20 steps), and a resumed run and selective and full
#    recomputation give the uninterrupted run's bits.
llama="$src/examples/tiny-llama.cfg"
lsmall=("${small[@]}" --set model.intermediate_size=96 --set model.rope_original_max_position_embeddings=16)
# family_trains NAME CFG "RECIPES" ARGS...: each recipe's 20 steps lower the loss by 0.5.
family_trains() {
    local name=$1 cfg=$2 recipes=$3 r first last
    shift 3
    for r in $recipes; do
        "$bin" train "$cfg" "$@" --set train.steps=20 --set train.warmup_steps=2 \
            --set precision.recipe=$r --set run.out_dir="$tmp/$name-$r" > "$tmp/p.log" ||
            fail "$name: recipe $r: $(tail -n 2 "$tmp/p.log")"
        first=$(losses "$tmp/$name-$r/metrics.jsonl" | head -n 3 | awk '{s += $1} END {print s / NR}')
        last=$(losses "$tmp/$name-$r/metrics.jsonl" | tail -n 3 | awk '{s += $1} END {print s / NR}')
        echo "$name, recipe $r: loss $first -> $last"
        awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a - 0.5) }' || fail "$name: recipe $r does not train"
    done
}
# family_same_bits NAME CFG ARGS...: 8 steps in $tmp/NAME-a; resumed from step 4, and with
# selective and full recomputation, the same bits.
family_same_bits() {
    local name=$1 cfg=$2 how
    shift 2
    local run=("$@" --set train.steps=8 --set train.warmup_steps=2 --set checkpoint.save_every=4
               --set train.grad_accum=2)
    "$bin" train "$cfg" "${run[@]}" --set run.out_dir="$tmp/$name-a" > "$tmp/$name-a.log"
    "$bin" train "$cfg" "${run[@]}" --set run.out_dir="$tmp/$name-b" \
        --set checkpoint.resume="$tmp/$name-a/checkpoints/step_00000004.safetensors" > "$tmp/$name-b.log"
    diff <(strip "$tmp/$name-a/metrics.jsonl" | tail -n 4) <(strip "$tmp/$name-b/metrics.jsonl") ||
        fail "$name: the resumed run differs from the uninterrupted one"
    for how in selective full; do
        "$bin" train "$cfg" "${run[@]}" --set train.recompute=$how --set run.out_dir="$tmp/$name-r$how" \
            > "$tmp/rc.log"
        "$cmp" --moments "$tmp/$name-a/checkpoints/step_00000008.safetensors" \
            "$tmp/$name-r$how/checkpoints/step_00000008.safetensors" 0 ||
            fail "$name: recompute $how changes the checkpoint"
    done
}
family_trains llama "$llama" "$LB_RECIPES" "${lsmall[@]}"
family_same_bits llama "$llama" "${lsmall[@]}"
"$bin" info "$llama" | grep -q "^rope .*llama3 scaling: factor 8" || fail "llama: info shows no llama3 RoPE"
# 10. GLM-4.5's MoE (examples/tiny-glm4-moe.cfg: a dense first layer, the sigmoid router with
#     groups and a selection bias, a shared expert, attention biases, partial RoPE): fp32, bf16
#     and fp8-block train; a resumed run and selective and full recomputation give the
#     uninterrupted run's bits; the bias update changes the trained weights
#     (router_bias_update_rate 0 gives other ones).
glm="$src/examples/tiny-glm4-moe.cfg"
gsmall=("${small[@]}" --set model.intermediate_size=96)
family_trains glm4_moe "$glm" "fp32 bf16 fp8-block" "${gsmall[@]}"
family_same_bits glm4_moe "$glm" "${gsmall[@]}"
grun=("${gsmall[@]}" --set train.steps=8 --set train.warmup_steps=2 --set checkpoint.save_every=4
      --set train.grad_accum=2)
"$bin" train "$glm" "${grun[@]}" --set model.router_bias_update_rate=0 --set run.out_dir="$tmp/g0" \
    > "$tmp/g0.log"
"$cmp" "$tmp/glm4_moe-a/checkpoints/step_00000008.safetensors" \
    "$tmp/g0/checkpoints/step_00000008.safetensors" 0 > /dev/null 2>&1 &&
    fail "glm4_moe: the selection-bias update changes nothing"
"$bin" info "$glm" | grep -q "^experts .*sigmoid router, top-2 of 4 groups.*1 shared.*layers 0-0 dense" ||
    fail "glm4_moe: info does not show the router, the shared expert and the dense layer"
# 11. Shuffled and blended data (doc/data.md): resumed from step 4, the uninterrupted run's
#     checkpoint exactly (0 tolerance, moments too) and its losses; the order differs from the
#     in-order run's and from another seed's; the checkpoint stores one sequence count.
blend=("${run[@]}" --set data.shuffle=true
       --set data.train_files="0.7 $tmp/arith_train_*.bin 0.3 $tmp/arith_val_*.bin")
"$bin" train "$src/examples/tiny-moe.cfg" "${blend[@]}" --set run.out_dir="$tmp/sa" > "$tmp/sa.log"
sck="$tmp/sa/checkpoints/step_00000004.safetensors"
"$bin" train "$src/examples/tiny-moe.cfg" "${blend[@]}" --set run.out_dir="$tmp/sb" \
    --set checkpoint.resume="$sck" > "$tmp/sb.log"
grep -q "resumed from $sck at step 4" "$tmp/sb.log" || fail "shuffled: resume not reported"
"$cmp" --moments "$tmp/sa/checkpoints/step_00000008.safetensors" \
    "$tmp/sb/checkpoints/step_00000008.safetensors" 0 > /dev/null ||
    fail "shuffled and blended: the resumed run's checkpoint differs from the uninterrupted one's"
diff <(strip "$tmp/sa/metrics.jsonl" | tail -n 4) <(strip "$tmp/sb/metrics.jsonl") ||
    fail "shuffled and blended: the resumed run's losses differ"
grep -aq '"loader_sequence":"64"' "$sck" ||   # 4 steps x grad_accum 2 x micro_batch 8
    fail "shuffled: the checkpoint does not store the sequences drawn"
! grep -aq '"loader_sequence"' "$ck" || fail "an in-order run's checkpoint has a sequence count"
"$bin" train "$src/examples/tiny-moe.cfg" "${blend[@]}" --set run.out_dir="$tmp/sc" \
    --set run.seed=99 --set train.steps=1 --set train.warmup_steps=0 > /dev/null
"$bin" train "$src/examples/tiny-moe.cfg" "${blend[@]}" --set run.out_dir="$tmp/sd" \
    --set data.shuffle=false --set train.steps=1 --set train.warmup_steps=0 > /dev/null
first_loss() { grep '"loss"' "$1" | head -n 1 | sed 's/.*"loss": \([^,]*\),.*/\1/'; }
[ "$(first_loss "$tmp/sa/metrics.jsonl")" != "$(first_loss "$tmp/a/metrics.jsonl")" ] ||
    fail "shuffled and blended: the same first batch as the in-order run"
[ "$(first_loss "$tmp/sa/metrics.jsonl")" != "$(first_loss "$tmp/sd/metrics.jsonl")" ] ||
    fail "shuffled: the same first batch as the unshuffled blend"
# another seed initialises another model too: the losses must differ, the data is the point of
# the unit tests (tests/test_data.c)
[ "$(first_loss "$tmp/sa/metrics.jsonl")" != "$(first_loss "$tmp/sc/metrics.jsonl")" ] ||
    fail "shuffled: another seed gives the same first batch"
# a checkpoint of the other kind of loader is refused, saying why
if "$bin" train "$src/examples/tiny-moe.cfg" "${blend[@]}" --set run.out_dir="$tmp/se" \
    --set checkpoint.resume="$ck" > /dev/null 2> "$tmp/se.err"; then
    fail "an in-order checkpoint resumed a shuffled run"
fi
grep -q "its loader position does not fit data.train_files: .*reads the shards in order" \
    "$tmp/se.err" || fail "in-order checkpoint, shuffled run: $(cat "$tmp/se.err")"
# 11b. A bad data.train_files stops the run before any work, at its file and line.
bad_files() {   # bad_files NAME VALUE PATTERN
    sed "s|^train_files = .*|train_files = $2|" "$src/examples/tiny-moe.cfg" > "$tmp/$1.cfg"
    if "$bin" train "$tmp/$1.cfg" --set run.out_dir="$tmp/$1" > "$tmp/$1.out" 2> "$tmp/$1.err"; then
        fail "$1: exit 0"
    fi
    grep -qF -- "lowbit train: $tmp/$1.cfg:27: data.train_files: $3" "$tmp/$1.err" ||
        fail "$1: stderr lacks '$tmp/$1.cfg:27: data.train_files: $3': $(cat "$tmp/$1.err")"
    [ ! -e "$tmp/$1/metrics.jsonl" ] || fail "$1: the run started"
}
bad_files odd "0.7 $tmp/arith_train_*.bin 0.3" "weight 0.3 has no glob after it"
bad_files negative "0.7 $tmp/arith_train_*.bin -0.3 $tmp/arith_val_*.bin" \
    "weight -0.3 of dataset 2 is not positive"
bad_files zero "0 $tmp/arith_train_*.bin" "weight 0 of dataset 1 is not positive"
bad_files word "0.7 $tmp/arith_train_*.bin x $tmp/arith_val_*.bin" "'x' is not a weight"
bad_files nomatch "0.7 $tmp/arith_train_*.bin 0.3 $tmp/nothing_*.bin" \
    "$tmp/nothing_*.bin: no token shards match"
bad_files nomatch1 "$tmp/nothing_*.bin" "$tmp/nothing_*.bin: no token shards match"
summary
