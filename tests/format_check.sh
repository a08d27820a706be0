#!/bin/sh
# Fails, listing the files, when a C/C++/CUDA source differs from what
# clang-format makes of it with the repository's .clang-format.
#   tests/format_check.sh [clang-format binary]
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
clang_format=${1:-clang-format-14}
command -v "$clang_format" >/dev/null 2>&1 || { echo "error: $clang_format not found (cmake/install-deps.sh installs it)" >&2; exit 1; }
cd "$root"
if [ -d .git ] || [ -f .git ]; then
  files=$(git ls-files '*.c' '*.h' '*.cpp' '*.cu' '*.cuh')
else
  files=$(find bench capi examples include src tests tools -type f \
    \( -name '*.c' -o -name '*.h' -o -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' \))
fi
bad=""
for f in $files; do
  if ! "$clang_format" --dry-run -Werror "$f" >/dev/null 2>&1; then
    bad="$bad $f"
  fi
done
if [ -n "$bad" ]; then
  echo "not formatted (run: $clang_format -i <file>):"
  for f in $bad; do echo "  $f"; done
  exit 1
fi
echo "$(echo "$files" | wc -w) files formatted"
