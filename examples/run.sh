#!/bin/sh
# Sets up, builds and runs dparallel's main job: for now the dp-perf collective
# benchmark on two logical CPU devices.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/cmake/install-deps.sh"
build="$root/build/release"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DDP_BUILD_TESTS=OFF >/dev/null
cmake --build "$build" -j "$(nproc 2>/dev/null || echo 2)" --target dp-perf
for op in broadcast reduce_add; do
  "$build/bench/dp-perf" "$op" -b 64K -e 64M -f 4 -d cpu:0,cpu:1 -t float
done
