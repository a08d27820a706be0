#!/bin/sh
# Compares the ABI of a built libdparallel with the baseline in abi/.
#   tests/abi/check.sh LIBRARY            fails on any difference
#   tests/abi/check.sh --update LIBRARY   rewrites the baseline
# LIBRARY needs debug info (a RelWithDebInfo or Debug build): abidw reads the
# types from it. Only what the public headers declare and the library exports
# is recorded, so internal changes never show up here.
set -eu
root=$(cd "$(dirname "$0")/../.." && pwd)
baseline="$root/abi/libdparallel.abi"
headers="$root/include/dparallel"

update=0
if [ "${1:-}" = "--update" ]; then
  update=1
  shift
fi
if [ $# -ne 1 ] || [ ! -f "$1" ]; then
  echo "usage: tests/abi/check.sh [--update] path/to/libdparallel.so" >&2
  exit 2
fi
library=$1
for tool in abidw abidiff; do
  command -v "$tool" >/dev/null 2>&1 || { echo "error: $tool not found (abigail-tools; cmake/install-deps.sh installs it)" >&2; exit 1; }
done

current=$(mktemp)
trap 'rm -f "$current"' EXIT
# Source and build paths are recorded relative to the checkout, so the
# baseline names no machine's directories.
abidw --headers-dir "$headers" --drop-private-types --exported-interfaces-only \
  --no-show-locs --no-corpus-path "$library" | sed "s|'$root/|'|g" >"$current"
if ! grep -q "elf-symbol name='dp_get_api'" "$current"; then
  echo "error: abidw found no dp_get_api in $library (was it built with debug info?)" >&2
  exit 1
fi

if [ "$update" -eq 1 ]; then
  cp "$current" "$baseline"
  echo "wrote $baseline"
  exit 0
fi

status=0
abidiff --headers-dir1 "$headers" --headers-dir2 "$headers" "$baseline" "$current" || status=$?
# abidiff's status is a bit set: 1 error, 2 usage, 4 ABI change, 8 incompatible change.
if [ $((status & 3)) -ne 0 ]; then
  echo "error: abidiff failed (status $status)" >&2
  exit 1
fi
if [ $((status & 8)) -ne 0 ]; then
  echo "ABI BREAK: the change above breaks compiled hosts; it needs a new major version (and soname)." >&2
  exit 1
fi
if [ $((status & 4)) -ne 0 ]; then
  echo "ABI changed compatibly (above). Record it: tests/abi/check.sh --update $library" >&2
  exit 1
fi
echo "ABI matches abi/libdparallel.abi"
