#!/bin/bash
# The parallel layouts on 2 GPUs through NCCL (one rank per GPU) against one GPU: dp2 (ZeRO-1),
# tp2, tp2 with sequence parallelism, ep2 and pp2 train the tiny MoE for 10 steps to the same
# losses (within 1e-5 relative at every step) and the same parameters (within 1e-5 relative per
# tensor, tests/ckpt_compare), as on the CPU (tests/test_parallel.sh; learning rate 3e-4 there
# and here, doc/parallel.md says why). Skipped (77) without CUDA or with fewer than 2 GPUs.
set -uo pipefail
. "${LB_SRCDIR:-.}/tests/lib.sh"
cmp=${LB_BUILDDIR:-.}/tests/ckpt_compare
need_gpus=2
. "$src/tests/need_cuda.sh"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cfg="$src/examples/tiny-moe.cfg"
"$bin" data "$cfg" --set gen.output="$tmp/arith" --set gen.problems=3000 > /dev/null ||
    { echo "FAIL: data"; exit 1; }
small=(--set data.train_files="$tmp/arith_train_*.bin" --set data.val_files=
       --set model.hidden_size=48 --set model.num_hidden_layers=2 --set model.head_dim=16
       --set model.moe_intermediate_size=64 --set train.seq_len=32 --set train.micro_batch=4
       --set train.grad_accum=4 --set train.steps=10 --set train.warmup_steps=2
       --set train.lr=3e-4 --set train.min_lr=3e-5 --set train.log_every=0 --set checkpoint.save_every=0
       --set run.backend=cuda)
losses() { grep '"loss"' "$1/metrics.jsonl" | sed 's/.*"loss": \([^,]*\),.*/\1/'; }
"$bin" train "$cfg" "${small[@]}" --set run.out_dir="$tmp/g1" > "$tmp/g1.log" 2>&1 ||
    { tail -n 5 "$tmp/g1.log"; echo "FAIL: one-GPU run"; exit 1; }
for layout in "dp2 --set parallel.zero=true" "tp2 --set parallel.tp=2" \
              "sp2 --set parallel.tp=2 --set parallel.sequence_parallel=true" \
              "ep2 --set parallel.ep=2" "pp2 --set parallel.pp=2"; do
    set -- $layout
    name=$1
    shift
    if ! timeout 300 mpirun --oversubscribe -np 2 "$bin" train "$cfg" "${small[@]}" "$@" \
            --set run.out_dir="$tmp/$name" > "$tmp/$name.log" 2>&1; then
        fail "$name: $(tail -n 5 "$tmp/$name.log")"
        continue
    fi
    grep -q "collectives over nccl" "$tmp/$name.log" || fail "$name: not over NCCL"
    d=$(paste <(losses "$tmp/g1") <(losses "$tmp/$name") | awk '
        { d = $1 - $2; if (d < 0) d = -d; r = d / ($1 < 0 ? -$1 : $1); if (r > m) m = r; n++ }
        END { if (n != 10) print "missing"; else printf "%.3g\n", m }')
    echo "$name: loss max relative difference $d"
    awk -v d="$d" 'BEGIN { exit !(d != "missing" && d <= 1e-5) }' && pass=$((pass + 1)) ||
        fail "$name: losses differ by $d"
    f=checkpoints/step_00000010.safetensors
    if out=$("$cmp" "$tmp/g1/$f" "$tmp/$name/$f" 1e-5 2>&1); then pass=$((pass + 1));
    else fail "$name: $out"; fi
    echo "$name: parameters: $out"
done
summary
