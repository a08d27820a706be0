#!/bin/sh
# Open MPI's remote launcher across the testbed's hosts (its plm_rsh_agent):
# called as "mpi_agent.sh [ssh options] HOST COMMAND...", it runs COMMAND in
# the network namespace of the host whose address is HOST (10.213.0.K+1 is
# host K) of the testbed TESTBED_NAME names (default "bed").
set -eu
while [ $# -gt 0 ]; do
  case $1 in
    -*) shift ;;  # ssh's options (-x and the like): nothing to pass on
    *) break ;;
  esac
done
host=$1
shift
case $host in
  10.213.0.*) k=$((${host##*.} - 1)) ;;
  *) echo "mpi_agent.sh: $host is no testbed host (10.213.0.K+1)" >&2; exit 2 ;;
esac
exec ip netns exec "dptb-${TESTBED_NAME:-bed}-h$k" sh -c "$*"
