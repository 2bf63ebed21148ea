#!/bin/bash
# The launch path across nodes, simulated on one machine: a hostfile of two made-up nodes and
# an rsh agent that starts each node's Open MPI daemon here (tests/mpi_fake_ssh.sh), with TCP
# between the ranks as between hosts. tp2 x dp2 on 4 ranks, 2 a node, trains exactly as on one
# node (the same metrics and checkpoint bits) without a warning; ranks dealt round-robin over
# the nodes (--map-by node) put each tp pair on two nodes, which still trains the same bits and
# draws the warning that tp crosses the network. Each made-up node's 2 slots look free to Open
# MPI, so its ranks would spin while they wait; beside make check's other MPI jobs on a 2-core
# machine that stalled a run past its time limit: mpi_yield_when_idle. The launcher is named
# (plm rsh): the GPU machine's image sets OMPI_MCA_plm=isolated, which starts no daemon on
# another node, so its mapper found both made-up nodes "already filled".
set -uo pipefail
. "${LB_SRCDIR:-.}/tests/lib.sh"
cmp=${LB_BUILDDIR:-.}/tests/ckpt_compare
cfg="$src/examples/tiny-moe.cfg"
printf 'nodea slots=2\nnodeb slots=2\n' > "$tmp/hosts"
export LB_FAKE_NODE_TMP="$tmp"   # the nodes' session directories (mpi_fake_ssh.sh)
nodes=(--hostfile "$tmp/hosts" --mca plm rsh --mca plm_rsh_agent "$src/tests/mpi_fake_ssh.sh"
       --mca plm_rsh_no_tree_spawn 1 --mca btl tcp,self --mca mpi_yield_when_idle 1)

"$bin" data "$cfg" --set gen.output="$tmp/arith" --set gen.problems=2000 > /dev/null ||
    { echo "FAIL: data"; exit 1; }
small=(--set data.train_files="$tmp/arith_train_*.bin" --set data.val_files="$tmp/arith_val_*.bin"
       --set model.hidden_size=48 --set model.num_hidden_layers=2 --set model.head_dim=16
       --set model.moe_intermediate_size=64 --set train.seq_len=32 --set train.micro_batch=4
       --set train.grad_accum=2 --set train.steps=4 --set train.warmup_steps=1
       --set train.val_every=0 --set train.log_every=0 --set checkpoint.save_every=4
       --set run.threads=1 --set parallel.tp=2)
strip() { grep '"loss"' "$1" | sed 's/, "tokens_per_s".*//'; }
run() {   # NAME MPIRUN-OPTIONS...: tp2 x dp2 on 4 ranks, its stderr in NAME.err
    local name=$1
    shift
    timeout 300 mpirun --oversubscribe -np 4 "$@" "$bin" train "$cfg" "${small[@]}" \
        --set run.out_dir="$tmp/$name" > "$tmp/$name.out" 2> "$tmp/$name.err" ||
        { fail "$name: exit $? ($(tail -n 3 "$tmp/$name.err" | tr '\n' ' '))"; return 1; }
}
run one --mca btl tcp,self --mca mpi_yield_when_idle 1
if run nodes "${nodes[@]}"; then
    [ "$(strip "$tmp/one/metrics.jsonl")" = "$(strip "$tmp/nodes/metrics.jsonl")" ] ||
        fail "two nodes: other metrics than one node"
    "$cmp" "$tmp/one/checkpoints/step_00000004.safetensors" \
        "$tmp/nodes/checkpoints/step_00000004.safetensors" 0 > /dev/null ||
        fail "two nodes: other checkpoint bits than one node"
    grep -q "spans nodes" "$tmp/nodes.err" && fail "two nodes, tp inside each: a warning"
fi
if run split "${nodes[@]}" --map-by node; then
    [ "$(strip "$tmp/one/metrics.jsonl")" = "$(strip "$tmp/split/metrics.jsonl")" ] ||
        fail "tp across nodes: other metrics than one node"
    [ "$(grep -c "spans nodes" "$tmp/split.err")" = 1 ] ||
        fail "tp across nodes: not one warning ($(cat "$tmp/split.err"))"
fi
summary
