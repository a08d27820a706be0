#!/bin/sh
# Runs the sh blocks of bindings/rust/README.md, in order and in one shell,
# in an empty folder, and checks that every rust block is the file under
# examples/ that the line before it names. Environment: DPARALLEL (the
# source tree), DP_LIBRARY, and PATH holding cargo and dp-run.
#   readme_commands.sh WORKDIR
set -eu
readme="$DPARALLEL/bindings/rust/README.md"
work="$1"
rm -rf "$work"
mkdir -p "$work"

# Each rust block, into its own file, with the name the line before it gives.
awk -v dir="$work" '
  /^`examples\/[a-z_]+\.rs`/ { name = $0; gsub(/`|:.*/, "", name) }
  /^```rust$/ { inside = 1; n++; out = dir "/block" n ".rs"; print name > (dir "/block" n ".name"); next }
  /^```$/ && inside { inside = 0; close(out); next }
  inside { print > out }
' "$readme"
found=0
for block in "$work"/block*.rs; do
  [ -e "$block" ] || continue
  name=$(cat "${block%.rs}.name")
  if ! cmp -s "$block" "$DPARALLEL/bindings/rust/$name"; then
    echo "FAIL: README.md's rust block before which it names '$name' differs from that file:" >&2
    diff "$DPARALLEL/bindings/rust/$name" "$block" >&2 || true
    exit 1
  fi
  echo "ok: the README's rust block is $name"
  found=$((found + 1))
done
[ "$found" -ge 2 ] || { echo "FAIL: found $found rust blocks in README.md, want 2" >&2; exit 1; }

awk '/^```sh$/ { inside = 1; next } /^```$/ { inside = 0 } inside' "$readme" > "$work/commands.sh"
echo "running README.md's commands:"
cat "$work/commands.sh"
cd "$work"
sh -eux "$work/commands.sh" > "$work/output.txt" 2>&1 || { cat "$work/output.txt"; exit 1; }
cat "$work/output.txt"
# The program's own check passed on both ranks; they print the same step.
[ "$(grep -c 'w = \[0.75, 1.5\]' "$work/output.txt")" -eq 2 ] || { echo "FAIL: want 'w = [0.75, 1.5]' from both ranks" >&2; exit 1; }
echo "README.md's commands ran"
