#!/bin/sh
# mpi_fake_ssh.sh: Open MPI's rsh agent for tests/test_multinode.sh: runs the daemon's command
# on this machine whatever host it names, so a hostfile of made-up nodes becomes separate
# Open MPI nodes here (each its own daemon and MPI_COMM_TYPE_SHARED group).
while [ $# -gt 0 ]; do
    case "$1" in
    -*) shift ;;
    *) break ;;
    esac
done
host=$1
shift
# A session directory of each node's own (Open MPI's comes from TMPDIR), under the test's
# LB_FAKE_NODE_TMP: with both daemons of a job in one directory, mpirun waited for ever after
# the job ended in about one run of six; with a directory a node, 10 runs of 10 ended.
TMPDIR=${LB_FAKE_NODE_TMP:-${TMPDIR:-/tmp}}/node-$host
mkdir -p "$TMPDIR" || exit 1
export TMPDIR
exec sh -c "$*"
