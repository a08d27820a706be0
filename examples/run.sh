#!/bin/sh
# Sets up, builds and runs dparallel's main job: dp-train, data-parallel
# training of an MLP on two logical CPU devices through the C ABI, checked
# against training on one device with the full batch, then the same training
# as two processes under dp-run with the DDP reducer (dp-train --ddp). dp-perf
# is built beside them, for the README's commands.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/cmake/install-deps.sh"
build="$root/build/release"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DDP_BUILD_TESTS=OFF >/dev/null
cmake --build "$build" -j "$(nproc 2>/dev/null || echo 2)" --target dp-train dp-run dp-perf
"$build/examples/dp-train" --devices cpu:0,cpu:1 "$@"
# The same training as 2 processes with the DDP reducer (each rank runs on
# cpu:0, so a run given --devices stops here).
for arg in "$@"; do
  [ "$arg" = --devices ] && exit 0
done
echo
"$build/tools/dp-run" -n 2 "$build/examples/dp-train" --ddp "$@"
