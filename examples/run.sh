#!/bin/sh
# Sets up, builds and runs dparallel's main job: dp-train, data-parallel
# training of an MLP on two logical CPU devices through the C ABI, checked
# against training on one device with the full batch. The launcher
# (tools/dp-run) and dp-perf are built beside it, for the README's commands.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/cmake/install-deps.sh"
build="$root/build/release"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DDP_BUILD_TESTS=OFF >/dev/null
cmake --build "$build" -j "$(nproc 2>/dev/null || echo 2)" --target dp-train dp-run dp-perf
"$build/examples/dp-train" --devices cpu:0,cpu:1 "$@"
