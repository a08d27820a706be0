#!/bin/sh
# tests/gpu/check.sh --dry-run over a bundle packed from this build, with a
# stand-in nvidia-smi that lists one GPU: keeps the GPU check working
# between GPU runs (every carried library resolves, every step's filter
# selects a test, the bundle fits, $OUT gets its files).
#   dry_run_test.sh BUILD
set -eu
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/dp-gpu-dry.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
"$here/bundle.sh" --from "$1" --out "$tmp/pack"
mkdir "$tmp/path"
cat >"$tmp/path/nvidia-smi" <<'SMI'
#!/bin/sh
echo "GPU 0: Stand-in GPU (UUID: GPU-00000000-0000-0000-0000-000000000000)"
SMI
chmod +x "$tmp/path/nvidia-smi"
PATH="$tmp/path:$PATH" OUT="$tmp/out" "$here/check.sh" --dry-run --bundle "$tmp/pack"
