#!/bin/sh
# Runs clang-tidy with the repository's .clang-tidy over the library's C++
# sources (src/, capi/) and fails on any finding.
#   tests/tidy_check.sh BUILD_DIR [clang-tidy binary]
# BUILD_DIR holds compile_commands.json.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:?usage: tests/tidy_check.sh BUILD_DIR [clang-tidy]}
clang_tidy=${2:-clang-tidy-14}
jobs=$(nproc 2>/dev/null || echo 2)
[ -f "$build/compile_commands.json" ] || { echo "error: no $build/compile_commands.json" >&2; exit 1; }
out=$(mktemp)
trap 'rm -f "$out"' EXIT
# The files are those the build compiles, so each has its real flags; GCC-only
# warning flags among them are unknown to clang.
python3 -c 'import json, sys
for e in json.load(open(sys.argv[1])):
    f = e["file"]
    if f.endswith(".cpp") and (f.startswith(sys.argv[2] + "/src/") or f.startswith(sys.argv[2] + "/capi/")):
        print(f)' "$build/compile_commands.json" "$root" | sort -u |
  xargs -P "$jobs" -n 4 "$clang_tidy" -p "$build" --quiet --extra-arg=-Wno-unknown-warning-option >"$out" 2>/dev/null ||
  true
if grep -q -E '(warning|error): ' "$out"; then
  cat "$out"
  echo "clang-tidy: $(grep -c -E '(warning|error): ' "$out") finding(s)" >&2
  exit 1
fi
echo "clang-tidy: no findings"
