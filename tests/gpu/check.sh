#!/bin/sh
# The one command to verify dparallel's CUDA and NCCL paths on a GPU machine:
#   tests/gpu/check.sh
# Builds (Release, CUDA and NCCL on, for the GPUs present: CUDA_ARCHS
# overrides) into build/gpu, runs every
# CUDA/NCCL test, then the GPU benchmarks and dp-train on the GPUs. Fails if a
# step fails, or if a GPU test skipped for a reason other than needing more
# GPUs than this machine has.
set -eu
root=$(cd "$(dirname "$0")/../.." && pwd)
build="$root/build/gpu"
jobs=$(nproc 2>/dev/null || echo 2)
log="$build/gpu-tests.log"
summary=""
failed=0
note() { summary="$summary
$1"; }
step() {  # name, command...
  name=$1
  shift
  echo "== $name"
  if "$@"; then note "PASS  $name"; else note "FAIL  $name"; failed=1; fi
}

"$root/cmake/install-deps.sh"
gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true); fi
echo "== $gpus GPU(s) visible to nvidia-smi"
[ "$gpus" -gt 0 ] || { echo "no GPU: nothing to verify here (CPU CI runs tests/run.sh)" >&2; exit 1; }

PATH="/usr/local/cuda/bin:$PATH"
export PATH
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DDP_WITH_CUDA=ON -DDP_WITH_NCCL=ON \
  -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-native}" >/dev/null
cmake --build "$build" -j "$jobs"

# Every CUDA/NCCL test, one at a time (the multi-process ones take the GPUs),
# and the conformance suite's scenarios over NCCL, one GPU per rank.
regex='Cuda|Nccl|Conformance/nccl\.'
status=0
ctest --test-dir "$build" -R "$regex" -V --timeout 600 --no-tests=error >"$log" 2>&1 || status=$?
grep -E 'Test +#[0-9]+: ' "$log" | sed 's/^ *[0-9]*\/[0-9]* //'
passed=$(grep -cE 'Test +#[0-9]+: .* Passed' "$log" || true)
skipped=$(grep -cE 'Test +#[0-9]+: .*Skipped' "$log" || true)
echo "== GPU tests: $passed passed, $skipped skipped, ctest status $status (full output: $log)"
[ "$status" -eq 0 ] && [ "$passed" -gt 0 ] && note "PASS  GPU tests ($passed passed, $skipped skipped)" ||
  { note "FAIL  GPU tests (see $log)"; failed=1; }
# A skip is fine only where the test needs more GPUs than there are, pins
# the behaviour without a GPU, or is a conformance scenario for cpu tensors.
for n in $(grep -E 'Test +#[0-9]+: .*Skipped' "$log" | sed -E 's/.*Test +#([0-9]+):.*/\1/'); do
  reason=$(grep -E "^$n: .*(needs [0-9]+ GPU|a GPU is present|not a nccl scenario)" "$log" | head -n 1 || true)
  need=$(printf '%s\n' "$reason" | sed -nE 's/.*needs ([0-9]+) GPU.*/\1/p')
  name=$(grep -E "Test +#$n: " "$log" | sed -E 's/.*Test +#[0-9]+: ([^ ]+).*/\1/' | head -n 1)
  if [ -n "$need" ] && [ "$need" -gt "$gpus" ]; then
    note "skip  $name (needs $need GPUs)"
  elif printf '%s' "$reason" | grep -q 'a GPU is present'; then
    note "skip  $name (the no-GPU case)"
  elif printf '%s' "$reason" | grep -q 'not a nccl scenario'; then
    note "skip  $name (cpu tensors only)"
  else
    note "FAIL  $name skipped with $gpus GPU(s) present: $(grep -E "^$n: .*SKIP" "$log" | head -n 1)"
    failed=1
  fi
done

# Benchmarks: the in-process collectives on the GPUs, checked element by element.
devs="cpu:0,cuda:0"
[ "$gpus" -ge 2 ] && devs="cuda:0,cuda:1"
for op in broadcast reduce_add scatter gather; do
  step "dp-perf $op -d $devs" "$build/bench/dp-perf" "$op" -d "$devs" -b 1K -e 64M -f 8 -s 5 -w 2
done
# The NCCL process group across ranks, one rank per GPU (a 1-rank group on one GPU).
for op in all_reduce broadcast all_gather reduce_scatter; do
  step "dp-run -n $gpus dp-perf $op --device cuda" "$build/tools/dp-run" -n "$gpus" "$build/bench/dp-perf-dist" \
    "$op" -b 4K -e 256M -f 4 -s 5 --device cuda
done
# dp-train: replicas on the GPUs against one device with the full batch.
step "dp-train --devices cuda:0" "$build/examples/dp-train" --devices cuda:0 --steps 10
step "dp-train --devices cuda:0,cpu:0" "$build/examples/dp-train" --devices cuda:0,cpu:0 --steps 10
[ "$gpus" -ge 2 ] && step "dp-train --devices cuda:0,cuda:1" "$build/examples/dp-train" --devices cuda:0,cuda:1 --steps 10

echo "== summary ($gpus GPU(s))$summary"
[ "$failed" -eq 0 ] && echo "== all GPU checks passed" || echo "== SOME GPU CHECKS FAILED"
exit "$failed"
