#!/bin/sh
# The one command to verify dparallel's CUDA and NCCL paths on a GPU machine,
# from a bundle that tests/gpu/bundle.sh built and packed elsewhere: nothing
# is installed, configured or compiled here.
#   tests/gpu/check.sh [--bundle DIR] [--dry-run]
# DIR defaults to build/gpu-pack. Every step has a timestamp and its own
# `timeout`, the whole run stays within DP_GPU_BUDGET_S seconds (default
# 500), and $OUT (default build/gpu-out) always ends with at most three
# files: summary.txt, gpu-logs.tar.gz (every log) and, where the run got
# that far, figures.txt; they are rewritten after each step, so a run cut
# short still leaves what it did.
# Steps, on one GPU (more where there are more):
#   - fully_shard's full parameters at one address, their memory given
#     back at reshard through the driver's VMM, and kept without it;
#   - every test of the bundle's binaries named Cuda*/Nccl* (async/
#     duplicates do not exist here: the binaries run directly), copies of
#     2.5 GiB, and every NCCL collective, dtype and op on both channels of a
#     one-rank group (DP_TEST_NCCL_SINGLE_RANK=1);
#   - compute-sanitizer memcheck over the binaries that touch the GPU, the
#     library's own kernels first, without the tests that bound a time;
#   - the misaligned batched copy's throughput, dp-perf and dp-perf-dist.
# A GPU test that skips for a reason other than needing more GPUs fails.
# --dry-run (no GPU needed; a stand-in nvidia-smi on PATH): resolves every
# library of every carried binary, checks the bundle's size and the files
# in $OUT, lists what each step would run (each filter must select a test)
# and runs the host-only tests; a ctest runs it on every build.
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
bundle="$root/build/gpu-pack"
dry=0
while [ $# -gt 0 ]; do
  case "$1" in
    --bundle) bundle=$2; shift 2 ;;
    --dry-run) dry=1; shift ;;
    *) echo "usage: $0 [--bundle DIR] [--dry-run]" >&2; exit 2 ;;
  esac
done
bundle=$(cd "$bundle" 2>/dev/null && pwd || echo "$bundle")
out="${OUT:-$root/build/gpu-out}"
budget=${DP_GPU_BUDGET_S:-500}
max_mb=${DP_GPU_BUNDLE_MAX_MB:-48}
max_out_files=8
started=$(date +%s)
mkdir -p "$out"
logs=$(mktemp -d "${TMPDIR:-/tmp}/dp-gpu-logs.XXXXXX")
summary="$logs/summary.txt"
figures="$logs/figures.txt"
: >"$summary"
: >"$figures"
failed=0
bin="$bundle/bin"
cd "$logs" || exit 1  # whatever a test writes in its directory lands among the logs

elapsed() { echo $(($(date +%s) - started)); }
note() { printf '%s\n' "$1" >>"$summary"; echo "$1"; }
fail_note() { note "FAIL  $1"; failed=1; }
# Copies the summary and every log into $OUT; cheap, so done after each step.
publish() {
  cp "$summary" "$out/summary.txt" 2>/dev/null
  [ -s "$figures" ] && cp "$figures" "$out/figures.txt" 2>/dev/null
  tar -czf "$out/gpu-logs.tar.gz.part" -C "$logs" . 2>/dev/null && mv "$out/gpu-logs.tar.gz.part" "$out/gpu-logs.tar.gz"
}
finish() {
  note "== $(elapsed) s in all; $([ "$failed" -eq 0 ] && echo 'every check passed' || echo 'SOME CHECKS FAILED')"
  publish
  rm -rf "$logs"
}
trap 'failed=1; note "INTERRUPTED after $(elapsed) s"; finish; exit 1' INT TERM HUP

# step NAME LIMIT_S PROGRAM ARGS...: runs the program with its output in its own
# log, bounded by LIMIT_S and by what is left of the budget (30 s kept for
# the end). Returns the command's status; 124 where it timed out.
slug() { printf '%s' "$1" | tr -c 'A-Za-z0-9._-' '_' | cut -c1-80; }
step() {
  name=$1
  limit=$2
  shift 2
  left=$((budget - $(elapsed) - 30))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 10 ]; then
    fail_note "$name: not run, the time budget ($budget s) is spent"
    return 125
  fi
  log="$logs/$(printf '%02d' "$((${step_no:-0} + 1))")-$(slug "$name").log"
  step_no=$((${step_no:-0} + 1))
  t0=$(date +%s)
  echo "== [$(date -u +%H:%M:%S) +$(elapsed)s] $name (limit $limit s)"
  rc=0
  { echo "\$ $*"; echo "started $(date -u +%FT%TZ), limit $limit s"; } >"$log"
  timeout -k 5 "$limit" "$@" >>"$log" 2>&1 || rc=$?
  secs=$(($(date +%s) - t0))
  echo "ended with status $rc after $secs s" >>"$log"
  step_log=$log
  step_secs=$secs
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    fail_note "$name: timed out after $limit s (log $(basename "$log"))"
  fi
  publish
  return "$rc"
}
# A step whose status alone decides.
check() {
  name=$1
  rc=0
  step "$@" || rc=$?
  if [ "$rc" -eq 0 ]; then
    note "PASS  $name ($step_secs s)"
  elif [ "$rc" -ne 124 ] && [ "$rc" -ne 137 ] && [ "$rc" -ne 125 ]; then
    fail_note "$name: status $rc (log $(basename "$step_log"))"
    tail -n 20 "$step_log"
  fi
  return 0
}

# ---- where things are ----
note "== dparallel GPU check $(date -u +%FT%TZ)$([ "$dry" -eq 1 ] && echo ' (dry run)'), bundle $bundle"
[ -f "$bundle/MANIFEST" ] || { fail_note "no bundle at $bundle: run tests/gpu/bundle.sh first"; finish; exit 1; }
sed 's/^/      bundle /' "$bundle/MANIFEST" >>"$summary"
note "      this machine: $(ldd --version 2>/dev/null | head -n 1), $(nproc) cores"
gpus=0
gpu_line=""
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(timeout 60 nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  timeout 60 nvidia-smi >"$logs/nvidia-smi.txt" 2>&1
  gpu_line=$(timeout 60 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null |
    head -n 1)
fi
note "      $gpus GPU(s) visible to nvidia-smi${gpu_line:+: $gpu_line}"
if [ "$gpus" -eq 0 ]; then
  fail_note "no GPU visible to nvidia-smi (for a dry run, put a stand-in nvidia-smi on PATH)"
  finish
  exit 1
fi

# NCCL as the image has it: the pip wheel's (nvidia-nccl-cu12), the
# toolkit's, or the system's; DP_NCCL_LIB_DIR overrides.
find_nccl() {
  [ -n "${DP_NCCL_LIB_DIR:-}" ] && { echo "$DP_NCCL_LIB_DIR"; return; }
  for python in python3 python; do
    dir=$("$python" -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null) &&
      [ -e "$dir/libnccl.so.2" ] && { echo "$dir"; return; }
  done
  for dir in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/lib/x86_64-linux-gnu /usr/local/lib \
    /usr/local/lib/python3*/dist-packages/nvidia/nccl/lib /usr/lib/python3*/site-packages/nvidia/nccl/lib \
    /usr/local/lib/python3*/site-packages/nvidia/nccl/lib /opt/conda/lib; do
    [ -e "$dir/libnccl.so.2" ] && { echo "$dir"; return; }
  done
  path=$(ldconfig -p 2>/dev/null | awk '/libnccl\.so\.2 / { print $NF; exit }')
  [ -n "$path" ] && dirname "$path"
}
nccl_dir=$(find_nccl || true)
if [ -n "$nccl_dir" ]; then
  note "      NCCL: $nccl_dir/libnccl.so.2"
else
  fail_note "libnccl.so.2 not found (set DP_NCCL_LIB_DIR)"
fi
# The carried C++ runtime (this build's GCC) only where the image's glibc
# is as new as it needs; else the image's own, which the ldd check below
# then shows to be new enough or not.
version_ge() {  # 2.N 2.M: whether N >= M
  [ "${1#*.}" -ge "${2#*.}" ] 2>/dev/null
}
image_glibc=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{ print $2 }')
cxx_needs=$(sed -n 's/^cxx_runtime_glibc_needed=//p' "$bundle/MANIFEST")
cxx_dir=""
if [ -d "$bundle/lib/cxx" ]; then
  if [ -z "$cxx_needs" ] || version_ge "${image_glibc:-0.0}" "$cxx_needs"; then
    cxx_dir="$bundle/lib/cxx"
    note "      C++ runtime: the bundle's (glibc ${image_glibc:-?} here, $cxx_needs needed)"
  else
    note "      C++ runtime: the image's (the bundle's needs glibc $cxx_needs, this image has $image_glibc)"
  fi
fi
LD_LIBRARY_PATH="$bundle/lib${cxx_dir:+:$cxx_dir}${nccl_dir:+:$nccl_dir}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH
# NCCL over loopback only (no network here), its warnings in the logs.
NCCL_SOCKET_IFNAME=lo
NCCL_DEBUG=WARN
NCCL_DEBUG_FILE="$logs/nccl.%h.%p.log"
DP_CONFORMANCE_WORKER="$bin/conformance_worker"
export NCCL_SOCKET_IFNAME NCCL_DEBUG NCCL_DEBUG_FILE DP_CONFORMANCE_WORKER

# ---- the bundle itself ----
size_kb=$(du -sk "$bundle" | cut -f1)
if [ "$size_kb" -le $((max_mb * 1024)) ]; then
  note "PASS  bundle size $((size_kb / 1024)) MiB (at most $max_mb)"
else
  fail_note "bundle size $((size_kb / 1024)) MiB, over $max_mb"
fi
# Every library of every carried binary resolves, libdparallel from the
# bundle, and none loads the shared CUDA runtime.
resolve() {
  bad=0
  for f in "$bin"/* "$bundle"/lib/*.so* ${cxx_dir:+"$cxx_dir"/*.so*}; do
    [ -f "$f" ] || continue
    listing=$(ldd "$f" 2>&1) || { echo "$f: ldd failed: $listing"; bad=1; continue; }
    echo "$f"
    printf '%s\n' "$listing"
    if printf '%s\n' "$listing" | grep -q 'not found'; then
      echo "!! $f: a library is not found"
      bad=1
    fi
    # The library links the static CUDA runtime: a shared one beside it is
    # a second runtime, of whatever version the image has, or none.
    if printf '%s\n' "$listing" | grep -q 'libcudart\.so'; then
      echo "!! $f loads a shared CUDA runtime (libcudart.so); link CUDA::cudart_static"
      bad=1
    fi
    dp=$(printf '%s\n' "$listing" | awk '$1 ~ /^libdparallel/ { print $3 }')
    case "$dp" in
      "" | "$bundle"/lib/*) ;;
      *) echo "!! $f loads $dp, not the bundle's"; bad=1 ;;
    esac
  done
  return $bad
}
if resolve >"$logs/ldd.txt" 2>&1; then
  note "PASS  every library of every carried binary resolves (ldd)"
else
  fail_note "a carried binary misses a library or loads a wrong one: $(grep '^!!' "$logs/ldd.txt" | head -n 3 | tr '\n' ' ')"
fi
publish

# ---- the tests ----
# Tests that bound a time, or hold a stream while calls must return: left
# out of compute-sanitizer, which slows the GPU down a hundredfold.
timed='*Throughput*:*Timeout*:*TimesOut*:*StreamIsHeld*:*IsHeld*:*LargeCopies*'
# Each binary and its GPU tests: the library's own kernels first.
# (dp_stream_tests has none: its one test named Cuda is for machines without a GPU.)
gpu_binaries="dp_comm_cuda_internal_tests dp_capi_tests dp_cuda_stream_tests dp_ddp_cuda_tests dp_nccl_tests
dp_fsdp_tests dp_fsdp_cuda_tests"
# The suites over the backend list name their instances after the backend
# (Backends/FsdpParity.*/nccl_world1_float32).
gpu_filter='*Cuda*:*Nccl*:*/nccl_*'
# Those with a step of their own are left out of the plain pass.
own_steps='NcclSingleRank.*:CudaLargeCopies.*'

# Lists what a filter selects; a filter that selects nothing is a failure
# (a renamed test would otherwise drop out of the check unseen).
selects() {  # binary filter
  n=$("$bin/$1" --gtest_list_tests --gtest_filter="$2" 2>/dev/null | grep -c '^  ' || true)
  [ "$n" -gt 0 ] && echo "$n"
}

# A gtest run: passes where gtest did and every skip is one this machine
# explains (more GPUs needed than present, or the no-GPU case).
gtest_step() {  # name limit binary filter [env...]
  name=$1
  limit=$2
  binary=$3
  filter=$4
  shift 4
  count=$(selects "$binary" "$filter") || { fail_note "$name: '$filter' selects no test of $binary"; return 0; }
  if [ "$dry" -eq 1 ]; then
    note "dry   $name: $binary, $count test(s) ($*)"
    return 0
  fi
  rc=0
  step "$name" "$limit" env "$@" "$bin/$binary" --gtest_filter="$filter" || rc=$?
  log=$step_log
  passed=$(grep -c '^\[       OK \]' "$log" || true)
  skipped=$(grep '^\[  SKIPPED \] [A-Za-z]' "$log" | awk '{ print $4 }' | sort -u | grep -c . || true)
  # gtest prints a skip's reason on the line before "[  SKIPPED ]".
  bad_skips=$(grep -B1 '^\[  SKIPPED \] [A-Za-z]' "$log" |
    grep -vE 'needs ([2-9]|[1-9][0-9]+) GPU|a GPU is present|^\[  SKIPPED|^--' | head -n 1)
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] || [ "$rc" -eq 125 ]; then
    :  # step said so
  elif [ "$rc" -ne 0 ]; then
    fail_note "$name: $(grep -c '^\[  FAILED  \] [A-Za-z]' "$log") failed, $passed passed (log $(basename "$log"))"
    grep -E '^\[  FAILED  \] [A-Za-z]' "$log" | head -n 10 | sed 's/^/      /' | tee -a "$summary"
  elif [ "$passed" -eq 0 ]; then
    fail_note "$name: no test passed ($skipped skipped)"
  elif [ "$skipped" -gt 0 ] && [ -n "$bad_skips" ]; then
    fail_note "$name: $passed passed, a skip with $gpus GPU(s) present: $bad_skips"
  else
    note "PASS  $name: $passed passed, $skipped skipped (more GPUs needed)"
  fi
  publish
}

# Host-only: the CUDA backend's plans and decisions, no GPU needed (the dry run's real test run).
if [ "$dry" -eq 1 ]; then
  check "host-only tests (dp_cuda_host_tests)" 120 "$bin/dp_cuda_host_tests"
fi

# First what this run is for: the checks of the latest fixes.
# Copies of 2.5 GiB, host to GPU and GPU to GPU (one 1-D copy each).
gtest_step "copies of 2.5 GiB" 60 dp_comm_cuda_internal_tests 'CudaLargeCopies.*'
# Every NCCL collective, dtype and op on both channels of a one-rank group.
gtest_step "NCCL on one rank: every collective, dtype, op and channel" 150 dp_nccl_tests 'NcclSingleRank.*' \
  NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT NCCL_DEBUG_FILE="$logs/nccl-single-rank.%p.log"
# Each group made two communicators (data and control): NCCL ran, not the one-rank shortcut.
if [ "$dry" -eq 0 ]; then
  inits=$(cat "$logs"/nccl-single-rank.*.log 2>/dev/null | grep -c 'Init COMPLETE' || true)
  if [ "$inits" -ge 4 ]; then
    note "PASS  NCCL on one rank: $inits communicators initialized (two per group)"
  else
    fail_note "NCCL on one rank: $inits communicator(s) initialized, expected 4 (two groups, data and control)"
  fi
fi
# fully_shard's full parameters: one address across unshards, their memory
# given back at reshard through the driver's VMM (cudaMemGetInfo), and kept
# in the fallback without it (DP_CUDA_VMM=0).
gtest_step "fully_shard on VMM: one address per full parameter, memory back at reshard" 90 dp_fsdp_cuda_tests \
  'CudaFsdpFullAddress.*'
gtest_step "fully_shard without VMM (DP_CUDA_VMM=0): one address, memory kept" 90 dp_fsdp_cuda_tests \
  'CudaFsdpFullAddress.*' DP_CUDA_VMM=0
# dparallel.torch on the GPU, where the image has a PyTorch that sees it
# (DP_TORCH_PYTHON, python3, or the venv GPU images ship): replicate and
# fully_shard train as torch alone does, on torch's default and a side
# stream. Without the carried C++ runtime: torch needs the image's.
torch_python=""
if [ "$dry" -eq 0 ]; then
  for candidate in "${DP_TORCH_PYTHON:-}" python3 /opt/torch/.venv/bin/python; do
    [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 || continue
    if timeout 120 "$candidate" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
      >/dev/null 2>&1; then
      torch_python=$candidate
      break
    fi
  done
fi
torch_step="dparallel.torch on cuda:0 trains as torch alone (replicate, fully_shard; default and side stream)"
if [ "$dry" -eq 1 ]; then
  note "dry   $torch_step: python/tests/cuda_single_rank.py under a PyTorch that sees the GPU"
elif [ -z "$torch_python" ]; then
  note "NOT RUN  $torch_step: no PyTorch with CUDA on this image (DP_TORCH_PYTHON names one)"
else
  check "$torch_step" 180 env LD_LIBRARY_PATH="$bundle/lib${nccl_dir:+:$nccl_dir}" PYTHONPATH="$root/python" \
    DP_LIBRARY="$bundle/lib/libdparallel.so.0" DP_TEST_NCCL_SINGLE_RANK=1 PYTHONUNBUFFERED=1 \
    "$torch_python" "$root/python/tests/cuda_single_rank.py"
fi
# The stream-order tests with the library's wait for the host's stream
# switched off (DP_TEST_SKIP_STREAM_WAIT=1): each must fail, or it passes
# whether the library waits or not.
unwaited='CudaStreamOrder.BroadcastOnOneGpu*:CudaStreamOrder.ReduceAddScatterGather*:CudaStreamOrder.DdpMarks*'
unwaited="$unwaited:CudaStreamOrder.CoalescedCalls*:CudaStreamOrder.NcclAllGatherOfWorldOne*"
must_fail() {  # name limit binary filter env...
  name=$1
  limit=$2
  binary=$3
  filter=$4
  shift 4
  count=$(selects "$binary" "$filter") || { fail_note "$name: '$filter' selects no test of $binary"; return 0; }
  if [ "$dry" -eq 1 ]; then
    note "dry   $name: $binary, $count test(s) that must fail ($*)"
    return 0
  fi
  rc=0
  step "$name" "$limit" env "$@" "$bin/$binary" --gtest_filter="$filter" || rc=$?
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] || [ "$rc" -eq 125 ] && return 0
  failing=$(grep -E '^\[  FAILED  \] [A-Za-z]' "$step_log" | awk '{ print $4 }' | sort -u | grep -c . || true)
  if [ "$failing" -eq "$count" ]; then
    note "PASS  $name: all $count fail without the wait"
  else
    fail_note "$name: $failing of $count fail without the wait (log $(basename "$step_log"))"
  fi
  publish
}
must_fail "stream-order tests fail without the library's wait" 120 dp_cuda_stream_tests "$unwaited" \
  DP_TEST_SKIP_STREAM_WAIT=1

# Then every GPU test, binary by binary, the library's kernels first.
for b in $gpu_binaries; do
  gtest_step "GPU tests of $b" 150 "$b" "$gpu_filter-$own_steps"
done
# The NCCL conformance scenarios (one GPU per rank: on one GPU, those of one rank).
if [ "$dry" -eq 1 ] || [ "$gpus" -ge 2 ]; then
  gtest_step "conformance scenarios over NCCL" 200 dp_conformance_tests 'Conformance/nccl.*'
fi

# ---- figures ----
figure() {  # name limit command...: the command's last lines go in figures.txt
  name=$1
  for a in "$@"; do
    case "$a" in
      "$bin"/*)
        [ -x "$a" ] && continue
        if grep -q "^left_out=$(basename "$a") " "$bundle/MANIFEST"; then
          note "NOT RUN  $name: $(sed -n 's/^left_out=//p' "$bundle/MANIFEST")"
        else
          fail_note "$name: $a is not in the bundle"
        fi
        return
        ;;
    esac
  done
  if [ "$dry" -eq 1 ]; then
    shift 2
    note "dry   $name: $*"
    return
  fi
  rc=0
  step "$@" || rc=$?
  { echo "== $name"; tail -n 25 "$step_log"; } >>"$figures"
  if [ "$rc" -eq 0 ] && grep -q '^\[  SKIPPED \] [A-Za-z]' "$step_log"; then
    fail_note "$name: skipped with $gpus GPU(s) present"
    return
  fi
  [ "$rc" -eq 0 ] && note "PASS  $name ($step_secs s)"
  [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && [ "$rc" -ne 137 ] && [ "$rc" -ne 125 ] && fail_note "$name: status $rc"
  publish
}
figure "batched copy throughput, misaligned segments" 60 "$bin/dp_comm_cuda_internal_tests" \
  --gtest_filter='CudaBatchedCopy.Throughput*'
devs="cpu:0,cuda:0"
[ "$gpus" -ge 2 ] && devs="cuda:0,cuda:1"
for op in broadcast reduce_add; do
  figure "dp-perf $op -d $devs" 60 "$bin/dp-perf" "$op" -d "$devs" -b 1K -e 256M -f 16 -s 5 -w 2
done
# The NCCL process group, one rank per GPU; on one GPU, NCCL itself runs
# through the one-rank switch.
for op in all_reduce all_gather reduce_scatter; do
  figure "dp-run -n $gpus dp-perf-dist $op --device cuda" 60 env DP_TEST_NCCL_SINGLE_RANK=1 "$bin/dp-run" -n "$gpus" \
    "$bin/dp-perf-dist" "$op" -b 4K -e 256M -f 16 -s 5 --device cuda
done
if [ "$gpus" -lt 2 ]; then
  note "NOT COVERED with one GPU: copies and peer access between GPUs, in-process NCCL, NCCL groups of more than one rank"
fi

# ---- compute-sanitizer memcheck, last: it takes what time is left ----
sanitizer=$(command -v compute-sanitizer || true)
for candidate in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
  [ -z "$sanitizer" ] && [ -x "$candidate" ] && sanitizer=$candidate
done
# Reports that are no failure, with every test passed: NCCL probing for
# kernels its build lacks (cudaFuncGetAttributes, then cudaGetLastError,
# from inside NCCL), and the library asking whether the legacy stream
# captures while a blocking stream does (the capture tests provoke it; the
# answer is an error by CUDA's rules, and the capture stays valid). Each
# report is counted once, from its "Program hit" line to the next.
expected_reports() {  # log
  awk '/^========= Program hit/ { if (r) n += ok; r = 1; ok = 0
         if ($0 ~ /cudaErrorStreamCaptureImplicit.*(cudaStreamIsCapturing|cudaGetLastError)/) ok = 1
         probe = ($0 ~ /cudaErrorNoKernelImageForDevice.*(cudaFuncGetAttributes|cudaGetLastError)/); next }
       r && probe && /Host Frame:.*libnccl/ { ok = 1 }
       END { if (r) n += ok; print n + 0 }' "$1"
}
memcheck_verdict() {  # name log rc
  [ "$3" -eq 0 ] && { note "PASS  $1"; return; }
  [ "$3" -eq 124 ] || [ "$3" -eq 137 ] || [ "$3" -eq 125 ] && return
  errors=$(sed -nE 's/^========= ERROR SUMMARY: ([0-9]+) error.*/\1/p' "$2" | awk '{ n += $1 } END { if (NR) print n }')
  probes=$(expected_reports "$2")
  if [ -n "$errors" ] && [ "$errors" -eq "$probes" ] && grep -q '^\[  PASSED  \]' "$2" && ! grep -q '^\[  FAILED  \]' "$2"; then
    note "PASS  $1 (its $probes report(s): NCCL probing its kernels, or the capture tests' probe)"
  else
    fail_note "$1: ${errors:-?} error(s) (log $(basename "$2"))"
  fi
}
if [ "$dry" -eq 1 ]; then
  note "dry   compute-sanitizer memcheck over: $gpu_binaries (filter $gpu_filter-$timed)"
elif [ -z "$sanitizer" ]; then
  note "NOT RUN  compute-sanitizer: not on this image"
else
  for b in $gpu_binaries; do
    selects "$b" "$gpu_filter-$timed" >/dev/null || continue
    rc=0
    step "memcheck $b" 120 "$sanitizer" --tool memcheck --require-cuda-init no --error-exitcode 99 --print-limit 100000 \
      --target-processes all "$bin/$b" --gtest_filter="$gpu_filter-$timed" || rc=$?
    memcheck_verdict "memcheck $b" "$step_log" "$rc"
  done
fi

# ---- what came back ----
finish_checks() {
  if [ "$dry" -eq 1 ]; then
    publish
    n=$(find "$out" -maxdepth 1 -type f | wc -l)
    if [ "$n" -le "$max_out_files" ] && [ -s "$out/summary.txt" ] && [ -s "$out/gpu-logs.tar.gz" ] &&
      tar -tzf "$out/gpu-logs.tar.gz" >/dev/null; then
      note "PASS  \$OUT holds $n file(s) (at most $max_out_files), the summary and a readable log tarball"
    else
      fail_note "\$OUT holds $n file(s) (at most $max_out_files) or misses the summary or the tarball"
    fi
  fi
}
finish_checks
finish
exit "$failed"
