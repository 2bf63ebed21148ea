#!/bin/bash
# `lowbit bench` on the CPU at tiny shapes: every kind prints its rows in the documented form
# (times and rates positive), the bf16 MoE layer's expert calls appear with bench.moe_passes,
# a training step's loss is finite and the same bits twice, and a bad format is refused.
set -uo pipefail
. "${LB_SRCDIR:-.}/tests/lib.sh"
cfg="$src/examples/tiny-moe.cfg"
quick=(--set bench.warmup=0 --set bench.iters=1)

# GEMMs: bf16 (dense, grouped, the layer's 12 expert calls) and fp8-block (dense, grouped, the
# other 5 expert GEMMs): 21 rows, each "gemm  FORMAT  SHAPE  T ms  R TFLOP/s" with T > 0.
"$bin" bench "$cfg" --set bench.kind=gemm --set bench.formats=bf16,fp8-block \
    --set bench.moe_passes=true --set bench.m=64 --set bench.n=72 --set bench.k=80 \
    --set bench.experts=4 --set bench.expert_rows=40 "${quick[@]}" > "$tmp/gemm" 2>&1 ||
    fail "bench gemm: exit $?"
rows=$(grep -c "^gemm " "$tmp/gemm")
[ "$rows" -eq 21 ] || fail "bench gemm: $rows rows, not 21"
awk '/^gemm / && !($(NF - 2) == "ms" && $(NF - 3) > 0 && $NF == "TFLOP/s") { bad = 1 }
     END { exit bad }' "$tmp/gemm" || fail "bench gemm: a row without a positive time"
for p in "gate/up fprop" "gate/up dgrad + wgrad" "gate/up dgrad" "gate/up wgrad" \
            "down fprop" "down dgrad + wgrad" "down dgrad" "down wgrad" \
            "gate/up fprop -> bf16" "gate/up dgrad -> bf16" "down fprop -> bf16" \
            "down dgrad -> bf16"; do
    grep -q "^gemm  bf16 *moe $p 4x40 rows " "$tmp/gemm" || fail "bench gemm: no bf16 '$p' row"
done

# Attention: fp32 and bf16, forward and forward + backward.
"$bin" bench "$cfg" --set bench.kind=attention --set bench.attn_batch=1 --set bench.attn_seq=40 \
    "${quick[@]}" > "$tmp/attn" 2>&1 || fail "bench attention: exit $?"
[ "$(grep -c "^attn  " "$tmp/attn")" -eq 4 ] || fail "bench attention: not 4 rows"

# Training steps: a finite loss, the same bits in a second run (the bench is deterministic).
for r in 1 2; do
    "$bin" bench "$cfg" --set bench.kind=train "${quick[@]}" > "$tmp/train$r" 2>&1 ||
        fail "bench train: exit $?"
done
l1=$(sed -n 's/^train .*, loss \([0-9.]*\)$/\1/p' "$tmp/train1")
l2=$(sed -n 's/^train .*, loss \([0-9.]*\)$/\1/p' "$tmp/train2")
[ -n "$l1" ] && awk -v l="$l1" 'BEGIN { exit !(l > 0 && l < 100) }' || fail "bench train: loss '$l1'"
[ "$l1" = "$l2" ] || fail "bench train: loss $l1 then $l2"
# with bf16 AdamW moments the row says so (the loss after one step is still the first one's)
"$bin" bench "$cfg" --set bench.kind=train --set train.adam_moments=bf16 "${quick[@]}" \
    > "$tmp/train16" 2>&1 || fail "bench train, bf16 moments: exit $?"
grep -q "^train [a-z0-9_]* fp32, bf16 moments: .*, loss $l1$" "$tmp/train16" ||
    fail "bench train, bf16 moments: $(grep '^train' "$tmp/train16")"
# Two steps (the second's loss follows the first's update): with half the AdamW moments on the
# host and with full recomputation the same bits, and the row names both settings.
two=(--set bench.warmup=1 --set bench.iters=1)
"$bin" bench "$cfg" --set bench.kind=train "${two[@]}" > "$tmp/t2" 2>&1 || fail "bench train x2: exit $?"
l2=$(sed -n 's/^train .*, loss \([0-9.]*\)$/\1/p' "$tmp/t2")
[ -n "$l2" ] && [ "$l2" != "$l1" ] || fail "bench train x2: loss '$l2' (one step: $l1)"
"$bin" bench "$cfg" --set bench.kind=train --set train.optimizer_offload=0.5 \
    --set train.recompute=full "${two[@]}" > "$tmp/t2o" 2>&1 || fail "bench train, offload: exit $?"
grep -q "^train [a-z0-9_]* fp32, recompute full, offload 0.5: .*, loss $l2$" "$tmp/t2o" ||
    fail "bench train, offload 0.5 and recompute full: $(grep '^train' "$tmp/t2o") (loss $l2 without)"

# Rollouts: bench.rollout_shapes times each shape in turn on one model, in the given order.
"$bin" bench "$cfg" --set bench.kind=rollout --set bench.rollout_prompt=5 \
    --set bench.rollout_shapes=2x4,3x6 "${quick[@]}" > "$tmp/roll" 2>&1 || fail "bench rollout: exit $?"
shapes=$(sed -n 's/^rollout [a-z0-9_]* fp32: batch \([0-9]*\), prompt 5, new \([0-9]*\), .*/\1 \2/p' "$tmp/roll" | tr '\n' ' ')
[ "$shapes" = "2 4 3 6 " ] || fail "bench rollout: shapes '$shapes', not '2 4 3 6 '"
awk '/^rollout / && !($0 ~ / [0-9.]+ s, [1-9][0-9]* generated tokens\/s/) { bad = 1 }
     END { exit bad }' "$tmp/roll" || fail "bench rollout: a row without a positive rate"
grep -q "^rollout .* batch 3, .* (18 generated, 15 prefill tokens" "$tmp/roll" ||
    fail "bench rollout: $(grep '^rollout' "$tmp/roll" | tail -1)"

# Bad input: one clear line, non-zero exit.
if "$bin" bench "$cfg" --set bench.kind=rollout --set bench.rollout_shapes=2x4,3 > "$tmp/bad" 2>&1; then
    fail "bench rollout with shapes 2x4,3: exit 0"
fi
grep -q "bench.rollout_shapes: '2x4,3' is not a list" "$tmp/bad" ||
    fail "bench rollout with shapes 2x4,3: $(cat "$tmp/bad")"
if "$bin" bench "$cfg" --set bench.kind=gemm --set bench.formats=bf17 > "$tmp/bad" 2>&1; then
    fail "bench gemm with format bf17: exit 0"
fi
grep -q "unknown format 'bf17'" "$tmp/bad" || fail "bench gemm with format bf17: no message"

summary
