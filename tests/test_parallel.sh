#!/bin/bash
# Parallelism end to end on the CPU (mpirun --oversubscribe): every layout (data, tensor with
# and without sequence parallelism, pipeline 1F1B, expert all-to-all, and their products on up
# to 8 ranks) trains the same model as one rank (losses and final parameters within 1e-5
# relative), checkpoints move between layouts and continue the same curve, bad layouts stop
# before any work with one clear message, and a failing rank takes the whole job down quickly
# instead of hanging.
set -uo pipefail
. "${LB_SRCDIR:-.}/tests/lib.sh"
cmp=${LB_BUILDDIR:-.}/tests/ckpt_compare
cfg="$src/examples/tiny-moe.cfg"
mpi() { local np=$1; shift; timeout 120 mpirun --oversubscribe -np "$np" "$@"; }

"$bin" data "$cfg" --set gen.output="$tmp/arith" --set gen.problems=3000 > /dev/null ||
    { echo "FAIL: data"; exit 1; }
# grad_accum 4 is the global batch: 4 micro-batches on 1 rank, 2 on each of 2, 1 on each of 4.
small=(--set data.train_files="$tmp/arith_train_*.bin" --set data.val_files="$tmp/arith_val_*.bin"
       --set model.hidden_size=48 --set model.num_hidden_layers=2 --set model.head_dim=16
       --set model.moe_intermediate_size=64 --set train.seq_len=32 --set train.micro_batch=4
       --set train.grad_accum=4 --set train.steps=10 --set train.warmup_steps=2
       --set train.val_every=5 --set train.val_batches=3 --set train.log_every=0
       --set checkpoint.save_every=5 --set checkpoint.keep=5 --set run.threads=1)
ck() { echo "$tmp/$1/checkpoints/step_000000$2.safetensors"; }
strip() { grep '"loss"' "$1" | sed 's/, "tokens_per_s".*//'; }   # metrics without timings

# max_rel_diff A B KEY [FIRST_STEP]: the largest relative difference of KEY ("loss",
# "val_loss", "grad_norm") between two metrics files over the steps both logged.
max_rel_diff() {
    awk -v key="\"$3\": " -v first="${4:-1}" '
        { s = $0; sub(/.*"step": /, "", s); step = s + 0
          i = index($0, key); if (!i || step < first) next
          v = substr($0, i + length(key)); sub(/[,}].*/, "", v)
          if (FNR == NR) a[step] = v + 0; else if (step in a) {
              d = v - a[step]; if (d < 0) d = -d; m = a[step] < 0 ? -a[step] : a[step]
              r = d / (m > 1e-12 ? m : 1e-12); if (r > worst) worst = r; n++ } }
        END { if (!n) { print "none"; exit 1 } printf "%.3g\n", worst }' "$1" "$2"
}
# agree NAME A B TOL: losses, validation losses and gradient norms of two runs within TOL.
agree() {
    local name=$1 a=$2 b=$3 tol=$4 key d
    for key in loss val_loss grad_norm; do
        d=$(max_rel_diff "$a" "$b" $key "${5:-1}") || { fail "$name: no $key to compare"; continue; }
        echo "$name: $key max relative difference $d"
        awk -v d="$d" -v t="$tol" 'BEGIN { exit !(d <= t) }' && ok || fail "$name: $key differs by $d"
    done
}
# moe_stats FILE: the MoE health of each logged step, a line "STEP KEY LAYER VALUE" a number
# (expert_load_max, expert_load_min, router_entropy: objects of the layers by number).
moe_stats() {
    awk '{ s = $0; sub(/.*"step": /, "", s); step = s + 0
           n = split("expert_load_max expert_load_min router_entropy", keys, " ")
           for (k = 1; k <= n; k++) {
               i = index($0, "\"" keys[k] "\": {"); if (!i) continue
               o = substr($0, i + length(keys[k]) + 5); sub(/}.*/, "", o)
               m = split(o, pairs, ", ")
               for (p = 1; p <= m; p++) { split(pairs[p], kv, ": "); gsub(/"/, "", kv[1])
                   print step, keys[k], kv[1], kv[2] } } }' "$1"
}
# moe_agree NAME A B TOL: the same MoE health numbers in two runs' metrics, each within TOL
# relative (the loads are counts: a token routed elsewhere moves them by far more).
moe_agree() {
    local d
    d=$(paste -d' ' <(moe_stats "$2") <(moe_stats "$3") | awk -v t="$4" '
        { if ($1 != $5 || $2 != $6 || $3 != $7) { bad = "rows differ: " $0; exit }
          d = $4 - $8; d = d < 0 ? -d : d; m = $4 < 0 ? -$4 : $4
          r = d / (m > 1e-12 ? m : 1e-12); if (r > w) w = r; n++ }
        END { if (bad != "") print bad; else if (NR != n || !n) print "none"; else printf "%.3g\n", w }')
    awk -v d="$d" -v t="$4" 'BEGIN { exit !(d + 0 == d && d <= t) }' && ok ||
        fail "$1: MoE health differs: $d"
}
same_params() {
    local name=$1 a=$2 b=$3 tol=$4 out
    if out=$("$cmp" "$a" "$b" "$tol" 2>&1); then ok; else fail "$name: $out"; fi
    echo "$name: parameters: $out"
}

# 1. One rank against dp2 (ZeRO-1), dp2 (all-reduce), dp2 (library-order sums) and dp4.
"$bin" train "$cfg" "${small[@]}" --set run.out_dir="$tmp/r1" > "$tmp/r1.log" 2>&1 ||
    { cat "$tmp/r1.log"; echo "FAIL: one-rank run"; exit 1; }
mpi 2 "$bin" train "$cfg" "${small[@]}" --set run.out_dir="$tmp/z2" > "$tmp/z2.log" 2>&1 ||
    fail "dp2 ZeRO-1 run: $(tail -n 3 "$tmp/z2.log")"
mpi 2 "$bin" train "$cfg" "${small[@]}" --set parallel.zero=false --set run.out_dir="$tmp/a2" \
    > "$tmp/a2.log" 2>&1 || fail "dp2 all-reduce run: $(tail -n 3 "$tmp/a2.log")"
mpi 2 "$bin" train "$cfg" "${small[@]}" --set parallel.deterministic=false \
    --set run.out_dir="$tmp/n2" > "$tmp/n2.log" 2>&1 || fail "dp2 library-order run"
mpi 4 "$bin" train "$cfg" "${small[@]}" --set run.out_dir="$tmp/z4" > "$tmp/z4.log" 2>&1 ||
    fail "dp4 ZeRO-1 run: $(tail -n 3 "$tmp/z4.log")"
grep -q "ZeRO-1 distributed optimizer" "$tmp/z2.log" && ok || fail "dp2 does not report ZeRO-1"
grep -q "all-reduced gradients" "$tmp/a2.log" && ok || fail "dp2 does not report all-reduce"
[ "$(grep -c '^model ' "$tmp/z4.log")" = 1 ] && ok || fail "dp4 printed the header more than once"
for run in z2 a2 n2 z4; do
    agree "1 rank vs $run" "$tmp/r1/metrics.jsonl" "$tmp/$run/metrics.jsonl" 1e-5
    same_params "1 rank vs $run" "$(ck r1 10)" "$(ck $run 10)" 1e-5
done
# Optimizer offload under ZeRO-1 (half of each shard's moments on the host): the same bits.
mpi 2 "$bin" train "$cfg" "${small[@]}" --set train.optimizer_offload=0.5 --set run.out_dir="$tmp/o2" \
    > "$tmp/o2.log" 2>&1 || fail "dp2 offload run: $(tail -n 3 "$tmp/o2.log")"
same_params "dp2 ZeRO-1 vs dp2 ZeRO-1 with optimizer offload" "$(ck z2 10)" "$(ck o2 10)" 0
# dp2 OUT ARGS...: a two-rank ZeRO-1 run of the small model into $tmp/OUT.
dp2() {
    local out=$1
    shift
    mpi 2 "$bin" train "$cfg" "${small[@]}" "$@" --set run.out_dir="$tmp/$out" > "$tmp/$out.log" 2>&1 ||
        fail "dp2 run $out ($*): $(tail -n 3 "$tmp/$out.log")"
}
# In bf16 AdamW writes the weight caches' bf16 copies in its own pass where it updates on the
# device, and the cache refresh rounds them where the moments are on the host: under ZeRO-1
# (the all-gather brings the other rank's shard) both ways give the same bits.
for f in 0 1; do dp2 b2o$f --set precision.recipe=bf16 --set train.optimizer_offload=$f; done
same_params "dp2 ZeRO-1 bf16, copies from AdamW vs from the refresh" "$(ck b2o0 10)" "$(ck b2o1 10)" 0
# AdamW's moments in bf16 under ZeRO-1, on the device or half offloaded: the same bits; and
# close to the fp32 moments' run.
for f in 0 0.5; do dp2 m2o$f --set train.adam_moments=bf16 --set train.optimizer_offload=$f; done
same_params "dp2 ZeRO-1 bf16 moments, offload 0 vs 0.5" "$(ck m2o0 10)" "$(ck m2o0.5 10)" 0
agree "dp2 ZeRO-1, fp32 vs bf16 moments" "$tmp/z2/metrics.jsonl" "$tmp/m2o0/metrics.jsonl" 1e-3
# ZeRO-1 and all-reduce sum the same gradients in the same rank order.
same_params "dp2 ZeRO-1 vs all-reduce" "$(ck z2 10)" "$(ck a2 10)" 1e-6
# The full optimizer state is in the checkpoint whatever the sharding.
if out=$("$cmp" --moments "$(ck r1 10)" "$(ck z4 10)" 1e-5 2>&1); then ok; else fail "moments: $out"; fi
echo "1 rank vs z4: parameters and moments: $out"

# 1b. Model parallelism: tp2, sp with tp2, pp2 (4 micro-batches per rank and step), ep2, ep4,
#     tp2 x ep2, pp2 x dp2, tp2 x pp2 x ep2 (8 ranks), and experts not cut over tp (etp 1: the
#     tp group's tokens go to the experts in two parts) with ep2 and with sp, and chunked
#     cross-entropy (37 rows of logits at a time, alone and with pp2 x sp2), against one rank,
#     for the MoE and, for
#     the dense column/row split of the fused gate_up, the dense Qwen3 under tp2 with sp, and
#     Llama 3.1 under tp2 and under sp2 x pp2, and GLM-4.5's MoE under tp2, ep2, pp2 x dp2 and
#     sp2 x etp1 x ep2. The
#     learning rate is 3e-4 here (the RL demo's; 3e-3 above): in Adam's first steps an element
#     whose gradient is near eps (a sum that cancels) moves by a fraction of lr that depends on
#     the gradient's rounding, so the parameters of two summation orders differ in proportion
#     to lr: up to 2.3e-5 at 3e-3, 2.4e-6 at 3e-4, while the losses agree to 1e-8 either way
#     (doc/parallel.md).
mp=("${small[@]}" --set train.lr=3e-4 --set train.min_lr=3e-5 --set train.log_every=5)
dense=(--set model.arch=qwen3 --set model.intermediate_size=96)
"$bin" train "$cfg" "${mp[@]}" --set run.out_dir="$tmp/m1" > "$tmp/m1.log" 2>&1 ||
    { cat "$tmp/m1.log"; echo "FAIL: one-rank run (lr 3e-4)"; exit 1; }
"$bin" train "$cfg" "${mp[@]}" "${dense[@]}" --set run.out_dir="$tmp/d1" > "$tmp/d1.log" 2>&1 ||
    { cat "$tmp/d1.log"; echo "FAIL: one-rank dense run"; exit 1; }
# Llama 3.1 (no q/k norm, llama3 RoPE scaling) under the same layouts as the dense Qwen3.
lla=(--set model.arch=llama --set model.intermediate_size=96 --set model.rope_type=llama3
     --set model.rope_original_max_position_embeddings=16)
"$bin" train "$cfg" "${mp[@]}" "${lla[@]}" --set run.out_dir="$tmp/l1" > "$tmp/l1.log" 2>&1 ||
    { cat "$tmp/l1.log"; echo "FAIL: one-rank llama run"; exit 1; }
# GLM-4.5's MoE (a dense first layer, the sigmoid router and its bias update over all ranks,
# a shared expert, attention biases, partial RoPE) under tp, ep, pp x dp and tp x ep.
glm=(--set model.arch=glm4_moe --set model.intermediate_size=96 --set model.first_k_dense_replace=1
     --set model.num_experts=8 --set model.n_group=4 --set model.topk_group=2
     --set model.n_shared_experts=1 --set model.routed_scaling_factor=2.5
     --set model.router_aux_loss_coef=0 --set model.attention_bias=true
     --set model.use_qk_norm=true --set model.partial_rotary_factor=0.5)
"$bin" train "$cfg" "${mp[@]}" "${glm[@]}" --set run.out_dir="$tmp/g1" > "$tmp/g1.log" 2>&1 ||
    { cat "$tmp/g1.log"; echo "FAIL: one-rank glm4_moe run"; exit 1; }
for layout in "tp2 2 m1 --set parallel.tp=2" \
              "sp2 2 m1 --set parallel.tp=2 --set parallel.sequence_parallel=true" \
              "pp2 2 m1 --set parallel.pp=2" \
              "ep2 2 m1 --set parallel.ep=2" \
              "ep4 4 m1 --set parallel.ep=4" \
              "tp2ep2 4 m1 --set parallel.tp=2 --set parallel.ep=2" \
              "pp2dp2 4 m1 --set parallel.pp=2" \
              "tp2pp2ep2 8 m1 --set parallel.tp=2 --set parallel.pp=2 --set parallel.ep=2" \
              "tp2etp1ep2 4 m1 --set parallel.tp=2 --set parallel.etp=1 --set parallel.ep=2" \
              "ce37 1 m1 --set train.ce_chunk=37" \
              "pp2sp2ce37 4 m1 --set parallel.pp=2 --set parallel.tp=2 --set parallel.sequence_parallel=true --set train.ce_chunk=37" \
              "sp2etp1 2 m1 --set parallel.tp=2 --set parallel.etp=1 --set parallel.sequence_parallel=true" \
              "dense-sp2 2 d1 --set parallel.tp=2 --set parallel.sequence_parallel=true ${dense[*]}" \
              "llama-tp2 2 l1 --set parallel.tp=2 ${lla[*]}" \
              "llama-sp2pp2 4 l1 --set parallel.tp=2 --set parallel.sequence_parallel=true --set parallel.pp=2 ${lla[*]}" \
              "glm-tp2 2 g1 --set parallel.tp=2 ${glm[*]}" \
              "glm-ep2 2 g1 --set parallel.ep=2 ${glm[*]}" \
              "glm-pp2dp2 4 g1 --set parallel.pp=2 ${glm[*]}" \
              "glm-sp2etp1ep2 4 g1 --set parallel.tp=2 --set parallel.sequence_parallel=true --set parallel.etp=1 --set parallel.ep=2 ${glm[*]}"; do
    set -- $layout
    name=$1 np=$2 ref=$3
    shift 3
    mpi "$np" "$bin" train "$cfg" "${mp[@]}" "$@" --set run.out_dir="$tmp/$name" \
        > "$tmp/$name.log" 2>&1 || { fail "$name run: $(tail -n 3 "$tmp/$name.log")"; continue; }
    agree "1 rank vs $name" "$tmp/$ref/metrics.jsonl" "$tmp/$name/metrics.jsonl" 1e-5
    same_params "1 rank vs $name" "$(ck $ref 10)" "$(ck $name 10)" 1e-5
    [ "$ref" = d1 ] || [ "$ref" = l1 ] ||
        moe_agree "1 rank vs $name" "$tmp/$ref/metrics.jsonl" "$tmp/$name/metrics.jsonl" 1e-5
done
# the MoE health of a logged step: every routed layer, loads about their mean, the entropy of a
# router over 4 experts at most log 4; GLM-4.5's dense first layer has none, a dense model none
moe_stats "$tmp/m1/metrics.jsonl" | awk '{ n++ } $2 == "expert_load_max" && $4 < 1 { bad = 1 }
    $2 == "expert_load_min" && ($4 > 1 || $4 < 0) { bad = 1 }
    $2 == "router_entropy" && ($4 <= 0 || $4 > log(4)) { bad = 1 }
    END { exit bad || n != 2 * 3 * 2 }' && ok || fail "MoE health of one rank: $(moe_stats "$tmp/m1/metrics.jsonl")"
[ "$(moe_stats "$tmp/g1/metrics.jsonl" | awk '$3 == 0' | wc -l)" = 0 ] &&
    [ "$(moe_stats "$tmp/g1/metrics.jsonl" | wc -l)" = 6 ] && ok || fail "MoE health of glm4_moe"
[ -z "$(moe_stats "$tmp/d1/metrics.jsonl")" ] && ok || fail "MoE health of a dense model"
grep -q "1F1B pipeline" "$tmp/pp2.log" && ok || fail "pp2 does not report the 1F1B schedule"
# Low precision under parallel layouts (doc/parallel.md): where a recipe's rounding scopes do
# not depend on the layout (bf16, fp8-block, nvfp4-moe, mxfp4 and mxfp4 with random Hadamard
# signs under ep2, mxfp8 under tp2 x ep2), the first two steps (loss and gradient norm) are the
# one rank's to 1e-7, and the parameters after 10 steps stay within 5e-3 (the fp32 summation
# orders of the layouts differ, and a last-bit difference can flip a bf16 rounding, whose
# effect grows chaotically over the steps: bf16 under ep2 over 12 seeds (1234, 1-3, 11-18),
# 2026-12-07, reached 1.6e-3 on main with the routed weights applied after down and 4.0e-3
# (seed 1234, this test's) with them applied to the SwiGLU output, where a router weight's
# last bit moves a bf16 rounding of the weighted rows; median 7e-5 and 1.2e-4). Before the
# mends: one rank rounded the experts' outputs to bf16 and ep and etp ranks did not (bf16 5e-6
# and 1.4e-4 at step 1, 1.6e-2 in the parameters); an expert's wgrad quantized the rows of all ep
# sources together along the tokens (fp8-block, nvfp4-moe, mxfp4: 3e-6 to 3e-5 at step 2, 1.2e-2
# to 2.2e-2 in the parameters); a rank's experts drew their local index's Hadamard signs.
for run in "bf16 1 b1" "bf16 2 bep2 --set parallel.ep=2" "bf16 2 bpp2 --set parallel.pp=2" \
           "bf16 2 bsp2 --set parallel.tp=2 --set parallel.sequence_parallel=true" "mxfp8 1 x1" \
           "mxfp8 4 xtp2ep2 --set parallel.tp=2 --set parallel.ep=2" "fp8-block 1 f1" \
           "fp8-block 2 fep2 --set parallel.ep=2" "nvfp4-moe 1 v1" "nvfp4-moe 2 vep2 --set parallel.ep=2" \
           "nvfp4-moe 2 vtp2 --set parallel.tp=2" \
           "nvfp4-moe 4 vtp2ep2 --set parallel.tp=2 --set parallel.ep=2" \
           "mxfp4 1 m41" "mxfp4 2 m4ep2 --set parallel.ep=2" \
           "mxfp4 1 h1 --set precision.wgrad_hadamard=random16" \
           "mxfp4 2 hep2 --set precision.wgrad_hadamard=random16 --set parallel.ep=2"; do
    set -- $run
    r=$1 np=$2 name=$3
    shift 3
    mpi "$np" "$bin" train "$cfg" "${mp[@]}" --set precision.recipe=$r "$@" \
        --set run.out_dir="$tmp/$name" > "$tmp/$name.log" 2>&1 ||
        fail "$name run: $(tail -n 3 "$tmp/$name.log")"
done
# nvfp4-moe under tp2 (etp 2): the experts' second levels are the whole expert's (weights) and
# the whole token's or tensor's (activations and gradients) (tests/test_linear_etp.sh checks
# them bit for bit). The steps are not one rank's even so: the attention's tp partial sums
# change the experts' inputs and gradients in the last bit, and an NVFP4 rounding can flip on
# that (step 1's gradient norm on main, 2026-12-07, seeds 1-6: equal for four, 2e-6 and 7.7e-6
# apart for seeds 1 and 3; with the routed weights on the SwiGLU output, this test's seed
# 1234 moves by 2.3e-6). The steps drift by the tp summation order through bf16 and NVFP4
# roundings (parameters after 10 steps: measured 2.45e-3, 6.8e-3 with the weights on the
# SwiGLU output, hence 1e-2).
for pair in "b1 bep2" "b1 bpp2" "b1 bsp2" "x1 xtp2ep2" "f1 fep2" "v1 vep2" "m41 m4ep2" \
            "h1 hep2" "v1 vtp2" \
            "v1 vtp2ep2"; do
    set -- $pair
    steps=$(case $2 in vtp2*) echo 0 ;; *) echo 2 ;; esac)
    for key in loss grad_norm; do
        [ "$steps" = 0 ] && continue
        d=$(max_rel_diff <(head -n $steps "$tmp/$1/metrics.jsonl") \
                         <(head -n $steps "$tmp/$2/metrics.jsonl") $key)
        echo "$1 vs $2: steps 1-$steps $key relative difference $d"
        awk -v d="$d" 'BEGIN { exit !(d <= 1e-7) }' && ok ||
            fail "$1 vs $2: steps 1-$steps $key differ by $d"
    done
    same_params "$1 vs $2" "$(ck $1 10)" "$(ck $2 10)" "$(case $2 in vtp2*) echo 1e-2 ;; *) echo 5e-3 ;; esac)"
done
# Activation recomputation under tp2 x pp2 x ep2 (full: its collectives run again in the
# backward) and under sequence parallelism (selective: the gathered norms again) gives the
# same bits as without it.
mpi 2 "$bin" train "$cfg" "${mp[@]}" --set parallel.tp=2 --set parallel.sequence_parallel=true \
    --set train.recompute=selective --set run.out_dir="$tmp/rcs" > "$tmp/rcs.log" 2>&1 ||
    fail "selective recompute run"
same_params "sp2 with selective recomputation" "$(ck sp2 10)" "$(ck rcs 10)" 0
mpi 8 "$bin" train "$cfg" "${mp[@]}" --set parallel.tp=2 --set parallel.pp=2 --set parallel.ep=2 \
    --set train.recompute=full --set run.out_dir="$tmp/rc8" > "$tmp/rc8.log" 2>&1 || fail "recompute run"
diff <(strip "$tmp/tp2pp2ep2/metrics.jsonl") <(strip "$tmp/rc8/metrics.jsonl") > /dev/null && ok ||
    fail "tp2 x pp2 x ep2 with recomputation: metrics differ"
same_params "tp2 x pp2 x ep2 with recomputation" "$(ck tp2pp2ep2 10)" "$(ck rc8 10)" 0
grep -q "sequence parallel" "$tmp/sp2.log" && ok || fail "sp2 does not report sequence parallelism"
# A checkpoint written under tp2 x pp2 resumes under ep2 x dp2 (dp 4 over 4 ranks, experts over
# 2) and continues the curve of the uninterrupted tp2 x pp2 run.
mpi 4 "$bin" train "$cfg" "${mp[@]}" --set parallel.tp=2 --set parallel.pp=2 \
    --set run.out_dir="$tmp/tp2pp2" > "$tmp/tp2pp2.log" 2>&1 || fail "tp2 x pp2 run"
mpi 4 "$bin" train "$cfg" "${mp[@]}" --set parallel.ep=2 --set checkpoint.resume="$(ck tp2pp2 05)" \
    --set run.out_dir="$tmp/ep2dp2" > "$tmp/ep2dp2.log" 2>&1 ||
    fail "tp2 x pp2 -> ep2 x dp2 resume: $(tail -n 3 "$tmp/ep2dp2.log")"
grep -q "resumed from $(ck tp2pp2 05) at step 5" "$tmp/ep2dp2.log" && ok || fail "ep2 x dp2: not resumed"
agree "tp2 x pp2 -> ep2 x dp2 from step 5" "$tmp/tp2pp2/metrics.jsonl" "$tmp/ep2dp2/metrics.jsonl" 1e-5 6
same_params "tp2 x pp2 -> ep2 x dp2" "$(ck tp2pp2 10)" "$(ck ep2dp2 10)" 1e-5
# The checkpoint is one file with whole tensors: it equals the one-rank run's step-5 file.
same_params "tp2 x pp2 checkpoint vs 1 rank at step 5" "$(ck m1 05)" "$(ck tp2pp2 05)" 1e-5

# 2. Resume across layouts: dp2's step-5 checkpoint continues under 1 rank, dp4 and dp2, on
#    the curve of the uninterrupted runs (dp2 on itself: bit for bit).
c5=$(ck z2 05)
for np in 1 4 2; do
    mpi $np "$bin" train "$cfg" "${small[@]}" --set checkpoint.resume="$c5" \
        --set run.out_dir="$tmp/res$np" > "$tmp/res$np.log" 2>&1 ||
        { fail "resume under $np rank(s): $(tail -n 3 "$tmp/res$np.log")"; continue; }
    grep -q "resumed from $c5 at step 5" "$tmp/res$np.log" && ok || fail "resume $np: not reported"
    [ "$(grep -c '"loss"' "$tmp/res$np/metrics.jsonl")" = 5 ] && ok || fail "resume $np: steps 6-10 only"
    agree "dp2 -> $np rank(s) from step 5" "$tmp/z2/metrics.jsonl" "$tmp/res$np/metrics.jsonl" 1e-5 6
    same_params "dp2 -> $np rank(s)" "$(ck z2 10)" "$(ck res$np 10)" 1e-5
done
diff <(strip "$tmp/z2/metrics.jsonl" | tail -n 5) <(strip "$tmp/res2/metrics.jsonl") > /dev/null &&
    ok || fail "dp2 resumed from its own checkpoint is not bit for bit"
# A one-rank checkpoint resumes under ZeRO-1 too (re-sharding on load).
mpi 2 "$bin" train "$cfg" "${small[@]}" --set checkpoint.resume="$(ck r1 05)" \
    --set run.out_dir="$tmp/up2" > "$tmp/up2.log" 2>&1 || fail "1 rank -> dp2 resume"
same_params "1 rank -> dp2 from step 5" "$(ck r1 10)" "$(ck up2 10)" 1e-5

# 3. Bad layouts: a non-zero exit, one message (rank 0 only), no output directory.
# expect_bad NAME NP PATTERN ARGS...
expect_bad() {
    local name=$1 np=$2 pattern=$3
    shift 3
    rm -rf "$tmp/bad"
    mpi "$np" "$bin" train "$cfg" "${small[@]}" --set run.out_dir="$tmp/bad" "$@" \
        > "$tmp/bad.out" 2> "$tmp/bad.err"
    local rc=$?
    if [ $rc -eq 0 ] || [ $rc -eq 124 ]; then fail "$name: exit $rc"; return; fi
    if [ "$(grep -Ec -- "$pattern" "$tmp/bad.err")" != 1 ]; then
        fail "$name: stderr lacks '$pattern' once:"; sed 's/^/    /' "$tmp/bad.err" | head; return
    fi
    [ ! -e "$tmp/bad" ] && ok || fail "$name: work was done (run.out_dir exists)"
}
# a bad token in the second shard, which rank 1 checks: the job stops before any work with the
# message printed once (it was printed by both ranks, on one line)
cp "$tmp/arith_train_000.bin" "$tmp/tok_000.bin"
cp "$tmp/arith_train_000.bin" "$tmp/tok_001.bin"
printf '\xff\xff' | dd of="$tmp/tok_001.bin" bs=1 seek=$((1024 + 2 * 3)) conv=notrunc 2>/dev/null
expect_bad bad-token 2 "rank 1: .*tok_001.bin: token 65535 at offset 3 is outside the vocabulary" \
    --set data.train_files="$tmp/tok_*.bin"
[ "$(grep -o "token 65535" "$tmp/bad.err" | wc -l)" = 1 ] && ok ||
    fail "bad token: the message is not printed once: $(cat "$tmp/bad.err")"
expect_bad world 3 "the world of 3 ranks is not divisible by parallel.tp x parallel.pp = 2 x 1" \
    --set parallel.tp=2 --set model.num_attention_heads=4 --set model.num_key_value_heads=2
expect_bad experts 2 "model.num_experts \(4\) is not divisible by parallel.ep \(3\)" --set parallel.ep=3
expect_bad heads 3 "model.num_attention_heads \(4\) is not divisible by parallel.tp \(3\)" --set parallel.tp=3
expect_bad kv-heads 4 "model.num_key_value_heads \(2\) is not divisible by parallel.tp \(4\)" --set parallel.tp=4
expect_bad layers 3 "model.num_hidden_layers \(2\) is not divisible by parallel.pp \(3\)" --set parallel.pp=3
expect_bad expert-grid 4 "the 4 ranks of a pipeline stage .* not divisible by parallel.etp x parallel.ep = 1 x 8" \
    --set parallel.ep=8 --set model.num_experts=8
expect_bad grad-accum 3 "train.grad_accum \(4\) is not divisible by the data-parallel size dp = 3.*add --set train.grad_accum=6\$" --set parallel.zero=true
# the example run as written on two ranks: the fix keeps the global batch of sequences
expect_bad grad-accum-fix 2 "add --set train.grad_accum=2 --set train.micro_batch=[0-9]+ to keep the global batch" \
    --set train.grad_accum=1
expect_bad dp 2 "parallel.dp = 4, but 2 ranks with parallel.tp = 1 and parallel.pp = 1 give dp = 2" --set parallel.dp=4
expect_bad etp 4 "parallel.etp \(4\) does not divide parallel.tp \(2\)" \
    --set parallel.tp=2 --set parallel.etp=4
expect_bad sp 2 "parallel.sequence_parallel needs parallel.tp > 1" --set parallel.sequence_parallel=true
expect_bad fail-rank 2 "parallel.fail_rank \(5\) is not a rank of this 2-rank job" \
    --set parallel.fail_rank=5 --set parallel.fail_step=1

# 4. lowbit info plans a layout (parallel.dp) and prints each rank's memory: ZeRO-1 over 4
#    ranks keeps 3 shard-sized buffers (2 moments, the reduced gradient) of a quarter of the
#    parameters each, against 2 full moments without it.
"$bin" info "$cfg" "${small[@]}" > "$tmp/i1.log" 2>&1 || fail "info"
"$bin" info "$cfg" "${small[@]}" --set parallel.dp=4 > "$tmp/i4.log" 2>&1 || fail "info dp4"
[ "$(grep -Ec '^ +[0-3] +0 +[0-3] +0 ' "$tmp/i4.log")" = 4 ] && ok || fail "info dp4: 4 rank rows"
grep -q "ZeRO-1 distributed optimizer: AdamW state sharded over dp" "$tmp/i4.log" && ok ||
    fail "info dp4: ZeRO-1 not named"
o1=$(awk '$1 == "per" {getline; print $8}' "$tmp/i1.log")
o4=$(awk '$1 == "per" {getline; print $8}' "$tmp/i4.log")
awk -v a="$o1" -v b="$o4" 'BEGIN { r = b / a; exit !(r > 0.37 && r < 0.38) }' && ok ||
    fail "info: ZeRO-1 optimizer state over 4 ranks is $o4 MiB against $o1 MiB on one"
# Under tp2 x ep2 each rank holds its pieces: fewer weights than one rank, and the expert grid.
"$bin" info "$cfg" "${small[@]}" --set parallel.dp=2 --set parallel.tp=2 --set parallel.ep=2 \
    > "$tmp/i.log" 2>&1 || fail "info tp2 x ep2"
[ "$(grep -Ec '^ +[0-3] +[01] +[01] +0 +[01] ' "$tmp/i.log")" = 4 ] && ok || fail "info tp2 x ep2: 4 rank rows"
w1=$(awk '$1 == "per" {getline; print $6}' "$tmp/i1.log")
w4=$(awk '$1 == "per" {getline; print $6}' "$tmp/i.log")
awk -v a="$w1" -v b="$w4" 'BEGIN { exit !(b < 0.6 * a) }' && ok ||
    fail "info tp2 x ep2: rank 0 holds $w4 MiB of weights against $w1 MiB on one rank"
"$bin" info "$cfg" "${small[@]}" --set parallel.dp=3 > "$tmp/i.log" 2>&1 && fail "info dp3: exit 0" ||
    { grep -q "train.grad_accum (4) is not divisible by the data-parallel size dp = 3" "$tmp/i.log" &&
      ok || fail "info dp3: message"; }

# 5. A failing rank ends the job: non-zero within 30 seconds, whatever the way it fails. The
#    others are waiting in the gradient reduction when it goes; 1000 steps would take minutes.
for how in die:2 exit:1 kill:3 die:0; do
    mode=${how%:*} rank=${how#*:}
    start=$(date +%s)
    timeout 30 mpirun --oversubscribe -np 4 "$bin" train "$cfg" "${small[@]}" \
        --set train.steps=1000 --set checkpoint.save_every=0 --set run.out_dir="$tmp/f$mode$rank" \
        --set parallel.fail_rank=$rank --set parallel.fail_step=3 --set parallel.fail_mode=$mode \
        > "$tmp/f.out" 2> "$tmp/f.err"
    rc=$? took=$(( $(date +%s) - start ))
    echo "rank $rank fails ($mode): exit $rc after ${took}s"
    if [ $rc -eq 0 ] || [ $rc -eq 124 ] || [ $took -ge 30 ]; then   # 124: timeout fired
        fail "rank $rank failing ($mode): exit $rc after ${took}s"; sed 's/^/    /' "$tmp/f.err" | head
    else ok; fi
    grep -q "rank $rank fails at step 3 on purpose" "$tmp/f.err" && ok || fail "rank $rank ($mode): no message"
done

summary
