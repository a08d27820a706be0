#!/bin/sh
# dp-train --ddp over the MPI backend under an implementation's mpirun, two
# ranks: several buckets reduced through MPI while the backward marks them,
# each rank checking parity with single-process training.
#   mpi_ddp_test.sh MPIRUN MPI_LIBRARY DP_TRAIN [mpirun options...]
# Exits 77 (skipped) when MPIRUN is not on PATH.
set -eu
mpirun=$1
library=$2
train=$3
shift 3
command -v "$mpirun" >/dev/null 2>&1 || { echo "skip: no $mpirun on PATH"; exit 77; }
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
out=$(mktemp "${TMPDIR:-/tmp}/dp-mpi-ddp.XXXXXX")
trap 'rm -f "$out"' EXIT
status=0
# LeakSanitizer off: MPI leaves allocations from modules it has unloaded by exit.
env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 LSAN_OPTIONS=detect_leaks=0 \
  DP_MPI_LIBRARY="$library" DP_STORE_ADDR=127.0.0.1 DP_STORE_PORT="$port" \
  timeout -s KILL 200 "$mpirun" "$@" -np 2 "$train" --ddp --backend mpi --steps 8 --batch 91 --width 40 --layers 4 \
  --bucket-cap-mb 0.005 --first-bucket-cap-mb 0.002 >"$out" 2>&1 || status=$?
fail() { cat "$out"; echo "FAIL: $1"; exit 1; }
[ "$status" -eq 0 ] || fail "exit status $status"
grep -q "over 2 ranks (mpi;" "$out" || fail "the group is not the MPI backend"
[ "$(grep -c 'parity with single-process training.*: OK' "$out")" -eq 2 ] || fail "not both ranks kept parity"
echo "dp-train --ddp over MPI ($mpirun): OK"
