#!/bin/sh
# The one command to verify dparallel's CUDA and NCCL paths on a GPU machine:
#   tests/gpu/check.sh
# Builds (Release, CUDA and NCCL on, for the GPUs present: CUDA_ARCHS
# overrides) into build/gpu, runs every
# CUDA/NCCL test (fully_shard's queued NCCL collectives among them:
# CudaFsdp.*, CudaStreamOrder.Fsdp*, and with 2+ GPUs
# FsdpProcesses.CudaToyModelTrainsLikeOneProcessOverNccl, one process per
# GPU; with 2+ GPUs, every NCCL group also runs its control communicator,
# and CudaFsdp.BlockingUnshardsOnTwoGpus* pins that headers and rounds never
# wait for a held host stream), checks that each rank of a multi-process
# NCCL run has a context on its own GPU only, runs the GPU tests under compute-sanitizer
# (memcheck, racecheck, synccheck), times a misaligned batched copy, copies
# pitched rows between GPUs, then the GPU benchmarks and dp-train on the GPUs.
# Fails if a step fails, or if a GPU test skipped for a reason other than
# needing more GPUs than this machine has. Never run in CI (no GPU there).
#   DP_GPU_BUILD=DIR      check that existing build (CUDA and NCCL on, built for
#                         these GPUs) instead: nothing installed or built. A
#                         build made on another machine at the same path needs
#                         `ctest -N` run there after its last build: ctest
#                         lists the tests with that machine's CMake modules
#   DP_GPU_SANITIZERS=... the compute-sanitizer tools to run (default: memcheck
#                         racecheck synccheck)
set -eu
root=$(cd "$(dirname "$0")/../.." && pwd)
build="${DP_GPU_BUILD:-$root/build/gpu}"
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

[ -n "${DP_GPU_BUILD:-}" ] || "$root/cmake/install-deps.sh"
gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true); fi
echo "== $gpus GPU(s) visible to nvidia-smi"
[ "$gpus" -gt 0 ] || { echo "no GPU: nothing to verify here (CPU CI runs tests/run.sh)" >&2; exit 1; }

PATH="/usr/local/cuda/bin:$PATH"
export PATH
if [ -z "${DP_GPU_BUILD:-}" ]; then
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DDP_WITH_CUDA=ON -DDP_WITH_NCCL=ON \
    -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-native}" >/dev/null
  cmake --build "$build" -j "$jobs"
fi

# Every CUDA/NCCL test, one at a time (the multi-process ones take the GPUs),
# and the conformance suite's scenarios over NCCL, one GPU per rank.
# While the multi-process runs go (the conformance scenarios over NCCL, their
# async ones on the group's worker thread, and dp-perf-dist below), nvidia-smi
# lists each process's context on each GPU: a rank listed on two GPUs made a
# context it does not use (a thread that never chose a device put on GPU 0),
# about 0.5 GB each. In-process tests use several GPUs on purpose: they run
# outside the sampling.
apps="$build/compute-apps.csv"
: >"$apps"
sampler=""
start_sampler() {
  nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader -lms 200 >>"$apps" 2>/dev/null &
  sampler=$!
}
stop_sampler() {
  [ -n "$sampler" ] || return 0
  kill "$sampler" 2>/dev/null || true
  wait "$sampler" 2>/dev/null || true
  sampler=""
}
trap stop_sampler EXIT
check_contexts() {
  grep -E '^[0-9]+, ' "$apps" | cut -d, -f1,2 | tr -d ' ' | sort -u >"$apps.pairs" || true
  seen=$(cut -d, -f1 "$apps.pairs" | sort -u | grep -c . || true)
  multi=$(cut -d, -f1 "$apps.pairs" | sort | uniq -d | tr '\n' ' ' | sed 's/ $//')
  if [ "$seen" -eq 0 ]; then
    note "UNVERIFIED  one context per rank: nvidia-smi listed no compute process (another PID namespace?)"
  elif [ -n "$multi" ]; then
    for pid in $multi; do echo "pid $pid has contexts on: $(grep "^$pid, " "$apps" | cut -d, -f2,3 | sort -u | tr '\n' ';')"; done
    note "FAIL  one context per rank: pid(s) $multi on more than one GPU (see $apps)"
    failed=1
  elif [ "$gpus" -lt 2 ]; then
    note "PASS  one context per rank ($seen processes seen; with one GPU this cannot tell a stray context apart)"
  else
    note "PASS  one context per rank ($seen processes seen, each on one GPU)"
  fi
}

regex='Cuda|Nccl'
status=0
ctest --test-dir "$build" -R "$regex" -E 'Conformance' -V --timeout 600 --no-tests=error >"$log" 2>&1 || status=$?
start_sampler
ctest --test-dir "$build" -R 'Conformance/nccl\.' -V --timeout 600 --no-tests=error >>"$log" 2>&1 || status=$?
stop_sampler
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

# compute-sanitizer over every test binary with GPU tests, all of them but
# those that bound a time (the tools slow the GPU down a hundredfold): the
# throughput one, those that wait for a timeout or assert a call returned
# within one, and those that hold the host's stream while calls must return.
# Those run in the ctest pass above.
sanitizer=$(command -v compute-sanitizer || true)
for candidate in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
  [ -z "$sanitizer" ] && [ -x "$candidate" ] && sanitizer=$candidate
done
filter='Cuda*:Nccl*-*Throughput*:*Timeout*:*StreamIsHeld*'
# A binary whose selected tests make no CUDA call is no failure. NCCL probes
# its kernels with cudaFuncGetAttributes and handles a missing image itself:
# those reports alone, with every test passed, are no failure either.
sanitize() {  # tool, test binary
  out="$build/sanitizer-$1-$(basename "$2").log"
  rc=0
  (cd "$(dirname "$2")" && "$sanitizer" --tool "$1" --require-cuda-init no --error-exitcode 99 \
    --target-processes all "$2" --gtest_filter="$filter") >"$out" 2>&1 || rc=$?
  cat "$out"
  [ "$rc" -eq 0 ] && return 0
  # One summary per process (--target-processes all): every one counts.
  errors=$(sed -nE 's/^========= ERROR SUMMARY: ([0-9]+) error.*/\1/p' "$out" | awk '{ n += $1 } END { if (NR) print n }')
  probes=$(grep -c 'cudaErrorNoKernelImageForDevice.*cudaFuncGetAttributes' "$out" || true)
  if [ -n "$errors" ] && [ "$errors" -eq "$probes" ] && grep -q '^\[  PASSED  \]' "$out" &&
    ! grep -q '^\[  FAILED  \]' "$out"; then
    echo "== the $probes report(s) are NCCL probing its kernels; every test passed"
    return 0
  fi
  return 1
}
if [ -n "$sanitizer" ]; then
  bins=""
  for b in $(find "$build/tests" -type f -name 'dp_*tests' | sort); do
    [ -x "$b" ] || continue
    "$b" --gtest_list_tests --gtest_filter="$filter" 2>/dev/null | grep -q '^  ' && bins="$bins $b"
  done
  for tool in ${DP_GPU_SANITIZERS:-memcheck racecheck synccheck}; do
    for b in $bins; do
      step "compute-sanitizer --tool $tool $(basename "$b")" sanitize "$tool" "$b"
    done
  done
else
  note "FAIL  compute-sanitizer not found (it comes with the CUDA toolkit)"
  failed=1
fi

# A misaligned batched copy's throughput beside a device-to-device memcpy
# (the test fails below loose floors; its GB/s line goes in the summary).
comm_tests="$build/tests/comm/dp_comm_cuda_internal_tests"
rate=""
throughput() {
  out=$(cd "$build/tests/comm" && "$comm_tests" --gtest_filter='CudaBatchedCopy.Throughput*' 2>&1) || {
    printf '%s\n' "$out"
    return 1
  }
  printf '%s\n' "$out"
  rate=$(printf '%s\n' "$out" | grep 'GB/s' | head -n 1)
  [ -n "$rate" ]
}
step "batched copy throughput, misaligned segments" throughput
[ -n "$rate" ] && note "      $rate"

# Pitched rows and peer access between two GPUs; with one GPU, say what is left out.
ran_not_skipped() {  # gtest filter
  out=$(cd "$build/tests/comm" && "$comm_tests" --gtest_filter="$1" 2>&1) || {
    printf '%s\n' "$out"
    return 1
  }
  printf '%s\n' "$out"
  ! printf '%s\n' "$out" | grep -q '^\[  SKIPPED \]'
}
if [ "$gpus" -ge 2 ]; then
  step "pitched copy between cuda:0 and cuda:1 (peer access)" ran_not_skipped 'CudaPitchedCopy.*'
else
  note "NOT COVERED with one GPU: pitched copies and peer access between GPUs, in-process NCCL, and NCCL process
      groups of more than one rank (NCCL needs one GPU per rank); run this script on a machine with 2+ GPUs"
fi

# Benchmarks: the in-process collectives on the GPUs, checked element by element.
devs="cpu:0,cuda:0"
[ "$gpus" -ge 2 ] && devs="cuda:0,cuda:1"
for op in broadcast reduce_add scatter gather; do
  step "dp-perf $op -d $devs" "$build/bench/dp-perf" "$op" -d "$devs" -b 1K -e 64M -f 8 -s 5 -w 2
done
# The NCCL process group across ranks, one rank per GPU (a 1-rank group on
# one GPU), sampled for stray contexts with the conformance scenarios above.
start_sampler
for op in all_reduce broadcast all_gather reduce_scatter; do
  step "dp-run -n $gpus dp-perf $op --device cuda" "$build/tools/dp-run" -n "$gpus" "$build/bench/dp-perf-dist" \
    "$op" -b 4K -e 256M -f 4 -s 5 --device cuda
done
stop_sampler
check_contexts
# dp-train: replicas on the GPUs against one device with the full batch.
step "dp-train --devices cuda:0" "$build/examples/dp-train" --devices cuda:0 --steps 10
step "dp-train --devices cuda:0,cpu:0" "$build/examples/dp-train" --devices cuda:0,cpu:0 --steps 10
[ "$gpus" -ge 2 ] && step "dp-train --devices cuda:0,cuda:1" "$build/examples/dp-train" --devices cuda:0,cuda:1 --steps 10

echo "== summary ($gpus GPU(s))$summary"
[ "$failed" -eq 0 ] && echo "== all GPU checks passed" || echo "== SOME GPU CHECKS FAILED"
exit "$failed"
