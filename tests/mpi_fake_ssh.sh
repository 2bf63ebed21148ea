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
shift   # the host
exec sh -c "$*"
