#!/bin/sh
# Sets up, builds and runs every test: once in a normal build and once under
# AddressSanitizer + UndefinedBehaviorSanitizer.
#   tests/run.sh            both builds (what CI runs)
#   tests/run.sh normal     the normal build only
#   tests/run.sh sanitize   the sanitized build only
#   tests/run.sh stress [CTEST ARGS...]
#                           the normal build, then the whole suite (or what the
#                           ctest arguments select, e.g. -R Launcher) twice in a
#                           row with ctest -j2 beside a CPU hog: one busy loop
#                           per core, stopped when the script ends however it
#                           ends. No test may depend on an idle machine.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
mode=${1:-all}
[ $# -gt 0 ] && shift
jobs=$(nproc 2>/dev/null || echo 2)

case "$mode" in
  stress) ;;
  all | normal | sanitize) [ $# -eq 0 ] || { echo "usage: only tests/run.sh stress takes ctest arguments" >&2; exit 2; } ;;
  *) echo "usage: tests/run.sh [all|normal|sanitize|stress [CTEST ARGS...]]" >&2; exit 2 ;;
esac

"$root/cmake/install-deps.sh"

# PyTorch 2 from PyPI in a venv for the Python package's tests (label
# "python"; the normal build's DP_TORCH_PYTHON points here). Without it they
# are skipped, each saying why. PyPI's Linux wheel brings its CUDA libraries
# (GBs), and without them it does not import even on a CPU-only machine (so
# --no-deps does not help); DP_TORCH_PIP replaces pip's arguments, e.g.
# "--index-url https://download.pytorch.org/whl/cpu torch numpy".
torch_venv="$root/build/torch2"
if [ "$mode" != sanitize ] && ! "$torch_venv/bin/python" -c 'import torch' >/dev/null 2>&1; then
  echo "== PyTorch 2 for the Python tests ($torch_venv, from PyPI)"
  # shellcheck disable=SC2086
  if ! { python3 -m venv "$torch_venv" &&
    "$torch_venv/bin/pip" install -q --disable-pip-version-check ${DP_TORCH_PIP:-torch numpy}; }; then
    echo "warning: no PyTorch venv at $torch_venv: the python tests will be skipped" >&2
  fi
fi

build_suite() {  # name, extra cmake arguments...
  name=$1
  shift
  build="$root/build/$name"
  echo "== $name build ($build)"
  cmake -S "$root" -B "$build" "$@" >/dev/null
  cmake --build "$build" -j "$jobs"
}

run_suite() {  # name, extra cmake arguments...
  build_suite "$@"
  echo "== $1 tests"
  ctest --test-dir "$build" --output-on-failure --timeout 300 -j "$jobs"
}

hog_pids=""
start_hog() {
  i=0
  while [ "$i" -lt "$jobs" ]; do
    # Each loop also ends when this script is gone, even killed with SIGKILL.
    sh -c 'while kill -0 "$1" 2>/dev/null; do :; done' hog $$ &
    hog_pids="$hog_pids $!"
    i=$((i + 1))
  done
  echo "== CPU hog: $jobs busy loop(s):$hog_pids"
}
stop_hog() {
  for pid in $hog_pids; do
    kill "$pid" 2>/dev/null || true
  done
  hog_pids=""
}

case "$mode" in
  # The normal build is the optimised one the main job uses.
  all) run_suite normal -DCMAKE_BUILD_TYPE=Release && run_suite sanitize -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDP_SANITIZE=ON ;;
  normal) run_suite normal -DCMAKE_BUILD_TYPE=Release ;;
  sanitize) run_suite sanitize -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDP_SANITIZE=ON ;;
  stress)
    build_suite normal -DCMAKE_BUILD_TYPE=Release
    trap stop_hog EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    start_hog
    for round in 1 2; do
      echo "== normal tests beside the CPU hog, round $round of 2"
      ctest --test-dir "$build" --output-on-failure --timeout 300 -j 2 "$@"
    done
    echo "== the tests passed twice beside the CPU hog"
    ;;
esac
