#!/bin/sh
# Builds what tests/gpu/check.sh runs on a GPU machine and packs it into one
# folder: the CUDA/NCCL test binaries, the workers they start, dp-run,
# dp-perf, dp-perf-dist and libdparallel.so, stripped, with the runtime
# libraries they need that a bare GPU image may lack. NCCL and the driver
# stay out: check.sh finds them on the image.
#   tests/gpu/bundle.sh                 configure and build build/gpu-bundle
#                                       (sm_90 only, Release, bindings off),
#                                       pack into build/gpu-pack
#   tests/gpu/bundle.sh --from BUILD    pack from an existing CUDA+NCCL build
#   tests/gpu/bundle.sh --out DIR       pack into DIR instead
# Then, on the GPU machine, from the repository root with the pack beside it:
#   tests/gpu/check.sh                  (see its header)
# DP_GPU_BUNDLE_MAX_MB (default 48) bounds the folder's size.
set -eu
root=$(cd "$(dirname "$0")/../.." && pwd)
from=""
out="$root/build/gpu-pack"
while [ $# -gt 0 ]; do
  case "$1" in
    --from) from=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) echo "usage: $0 [--from BUILD] [--out DIR]" >&2; exit 2 ;;
  esac
done
max_mb=${DP_GPU_BUNDLE_MAX_MB:-48}

# Target name and where it lands in the build tree.
targets="
dparallel capi/libdparallel.so.0
dp_capi_tests tests/capi/dp_capi_tests
dp_comm_cuda_internal_tests tests/comm/dp_comm_cuda_internal_tests
dp_cuda_host_tests tests/comm/dp_cuda_host_tests
dp_ddp_cuda_tests tests/ddp/dp_ddp_cuda_tests
dp_nccl_tests tests/distributed/dp_nccl_tests
dp_fsdp_tests tests/fsdp/dp_fsdp_tests
dp_fsdp_cuda_tests tests/fsdp/dp_fsdp_cuda_tests
fsdp_worker tests/fsdp/fsdp_worker
dp_cuda_stream_tests tests/streams/dp_cuda_stream_tests
dp_conformance_tests tests/conformance/dp_conformance_tests
conformance_worker tests/conformance/conformance_worker
dp-run tools/dp-run
dp-perf bench/dp-perf
dp-perf-dist bench/dp-perf-dist
"

if [ -z "$from" ]; then
  from="$root/build/gpu-bundle"
  cmake -S "$root" -B "$from" -G "Unix Makefiles" -DCMAKE_BUILD_TYPE=Release -DDP_WITH_CUDA=ON -DDP_WITH_NCCL=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DDP_BUILD_BINDINGS=OFF -DDP_BUILD_EXAMPLES=OFF -DDP_OPENBLAS_LIBRARY=OFF >/dev/null
  names=$(printf '%s\n' "$targets" | awk 'NF == 2 { print $1 }' | tr '\n' ' ')
  # shellcheck disable=SC2086  # one word per target
  cmake --build "$from" -j "$(nproc 2>/dev/null || echo 2)" --target $names
fi
grep -qE '^DP_NCCL_LIBRARY:FILEPATH=/' "$from/CMakeCache.txt" 2>/dev/null ||
  { echo "error: $from is not a build with CUDA and NCCL" >&2; exit 1; }

rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
printf '%s\n' "$targets" | while read -r name path; do
  [ -n "$name" ] || continue
  [ -f "$from/$path" ] || { echo "error: $from/$path is missing: build target $name first" >&2; exit 1; }
  case "$path" in
    *.so*) cp -L "$from/$path" "$out/lib/" ;;
    *) cp -L "$from/$path" "$out/bin/" ;;
  esac
done

# dp-perf with its ddp mode links OpenBLAS (36 MiB with its Fortran
# runtime): this script's own build leaves that mode out; from another
# build, dp-perf stays behind and check.sh says so.
left_out=""
if readelf -d "$out/bin/dp-perf" 2>/dev/null | grep -q 'libopenblas'; then
  rm "$out/bin/dp-perf"
  left_out="dp-perf (links OpenBLAS; tests/gpu/bundle.sh's own build does not)"
fi

# Every library the binaries load, but the C library's own, the driver and
# NCCL (each image has its own, matched to its driver).
skip_lib() {
  case "$1" in
    libc.so* | libm.so* | libpthread.so* | libdl.so* | librt.so* | libutil.so* | ld-linux*) return 0 ;;
    libcuda.so* | libnvidia-*.so* | libnccl.so*) return 0 ;;
    libdparallel.so*) return 0 ;;
  esac
  return 1
}
for f in "$out"/bin/* "$out"/lib/libdparallel.so.0; do
  LD_LIBRARY_PATH="$out/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ldd "$f" | awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }'
done | sort -u | while read -r soname path; do
  skip_lib "$soname" || [ -e "$out/lib/$soname" ] || cp -L "$path" "$out/lib/$soname"
done
ln -sf libdparallel.so.0 "$out/lib/libdparallel.so"
# The C++ runtime goes apart: it needs this machine's glibc, which an older
# image lacks; check.sh uses it only where the image's glibc is recent enough.
mkdir -p "$out/lib/cxx"
for f in "$out"/lib/libstdc++.so* "$out"/lib/libgcc_s.so*; do
  [ -e "$f" ] && mv "$f" "$out/lib/cxx/"
done
glibc_of() {  # the newest GLIBC_2.N symbol version the files need, as 2.N
  for f in "$@"; do objdump -T "$f" 2>/dev/null; done | grep -o 'GLIBC_2\.[0-9]*' | sed 's/GLIBC_//' |
    sort -t. -k2 -n -u | tail -n 1
}
strip --strip-unneeded "$out"/bin/* "$out"/lib/*.so.* "$out"/lib/cxx/*.so* 2>/dev/null || true

{
  echo "built_from=$from"
  echo "commit=$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "cuda_architectures=$(sed -n 's/^CMAKE_CUDA_ARCHITECTURES:[A-Z]*=//p' "$from/CMakeCache.txt")"
  echo "glibc=$(ldd --version 2>/dev/null | head -n 1)"
  echo "nvcc=$(/usr/local/cuda/bin/nvcc --version 2>/dev/null | tail -n 1)"
  [ -z "$left_out" ] || echo "left_out=$left_out"
  echo "glibc_needed=$(glibc_of "$out"/bin/* "$out"/lib/*.so*)"
  echo "cxx_runtime_glibc_needed=$(glibc_of "$out"/lib/cxx/*.so*)"
} >"$out/MANIFEST"

size_kb=$(du -sk "$out" | cut -f1)
echo "== $out: $((size_kb / 1024)) MiB ($(ls "$out/bin" | wc -l) programs, $(ls "$out/lib" | wc -l) libraries)"
if [ "$size_kb" -gt $((max_mb * 1024)) ]; then
  echo "error: the bundle is over $max_mb MiB" >&2
  exit 1
fi
