#!/bin/sh
# Sets up, builds and runs every test: once in a normal build and once under
# AddressSanitizer + UndefinedBehaviorSanitizer.
#   tests/run.sh            both builds
#   tests/run.sh normal     the normal build only
#   tests/run.sh sanitize   the sanitized build only
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
mode=${1:-all}
jobs=$(nproc 2>/dev/null || echo 2)

"$root/cmake/install-deps.sh"

run_suite() {  # name, extra cmake arguments...
  name=$1
  shift
  build="$root/build/$name"
  echo "== $name build ($build)"
  cmake -S "$root" -B "$build" "$@" >/dev/null
  cmake --build "$build" -j "$jobs"
  echo "== $name tests"
  ctest --test-dir "$build" --output-on-failure --timeout 300 -j "$jobs"
}

case "$mode" in
  # The normal build is the optimised one the main job uses.
  all) run_suite normal -DCMAKE_BUILD_TYPE=Release && run_suite sanitize -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDP_SANITIZE=ON ;;
  normal) run_suite normal -DCMAKE_BUILD_TYPE=Release ;;
  sanitize) run_suite sanitize -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDP_SANITIZE=ON ;;
  *) echo "usage: tests/run.sh [all|normal|sanitize]" >&2; exit 2 ;;
esac
