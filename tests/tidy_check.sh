#!/bin/sh
# Runs clang-tidy with the repository's .clang-tidy over the library's C++
# sources (src/, capi/) and fails on any finding.
#   tests/tidy_check.sh BUILD_DIR [clang-tidy binary] [parallel jobs]
# BUILD_DIR holds compile_commands.json.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:?usage: tests/tidy_check.sh BUILD_DIR [clang-tidy] [jobs]}
clang_tidy=${2:-clang-tidy-14}
jobs=${3:-$(nproc 2>/dev/null || echo 2)}
command -v "$clang_tidy" >/dev/null 2>&1 || { echo "error: $clang_tidy not found (cmake/install-deps.sh installs it)" >&2; exit 1; }
[ -f "$build/compile_commands.json" ] || { echo "error: no $build/compile_commands.json" >&2; exit 1; }
out=$(mktemp)
files=$(mktemp)
trap 'rm -f "$out" "$files"' EXIT
# The files are those the build compiles, so each has its real flags; GCC-only
# warning flags among them are unknown to clang.
python3 -c 'import json, os, sys
root = os.path.realpath(sys.argv[2])
for e in json.load(open(sys.argv[1])):
    f = os.path.realpath(os.path.join(e["directory"], e["file"]))
    if f.endswith(".cpp") and (f.startswith(root + "/src/") or f.startswith(root + "/capi/")):
        print(f)' "$build/compile_commands.json" "$root" | sort -u >"$files"
count=$(wc -l <"$files")
if [ "$count" -eq 0 ]; then
  echo "error: no library sources of $root in $build/compile_commands.json" >&2
  exit 1
fi
# xargs: 123 means some clang-tidy run reported errors (listed below); other
# failures (a crash, a missing binary) must not pass as "no findings".
status=0
xargs -P "$jobs" -n 4 "$clang_tidy" -p "$build" --quiet --extra-arg=-Wno-unknown-warning-option <"$files" \
  >"$out" 2>/dev/null || status=$?
if [ "$status" -ne 0 ] && [ "$status" -ne 123 ]; then
  echo "error: clang-tidy failed to run (xargs status $status)" >&2
  exit 1
fi
if grep -q -E '(warning|error): ' "$out"; then
  cat "$out"
  echo "clang-tidy: $(grep -c -E '(warning|error): ' "$out") finding(s) in $count files" >&2
  exit 1
fi
if [ "$status" -eq 123 ]; then
  echo "error: clang-tidy failed on a file without reporting why" >&2
  exit 1
fi
echo "clang-tidy: no findings in $count files"
