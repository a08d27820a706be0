#!/bin/sh
# dp-perf across hosts on the testbed (tests/testbed/testbed.sh: hosts as
# network namespaces behind a bridge, each link shaped with tbf both ways;
# no latency is emulated): for each host count, link rate and backend,
# dp-perf all_reduce and dp-perf ddp with dp-run on every host; on the
# hierarchical backend dp-perf fsdp's fully_shard over every rank against
# HSDP on the mesh by host; and PyTorch's DDP over Gloo on the same hosts
# (bench/torch_ddp_hosts.py under dp-run) where a PyTorch 2 is found.
#   bench/testbed.sh BUILD_DIR [--hosts "2 4"] [--rates "2gbit 5gbit 10gbit"]
#                    [--ranks 2] [--sizes "-b 4K -e 4K,-b 1M -e 64M -f 4"]
#                    [--ddp "--layers 10 --width 1024 --batch 32 --steps 11 --warmup 2"]
#                    [--torch PYTHON]
#   bench/testbed.sh model [--nic-gbit 400] [--nics 1] [--gpus 8] [--params 1.3e9]
#                    [--tokens 16384 | --global-tokens 4194304] [--mfu 0.4]
#       The alpha-beta model of bench/RESULTS.md for DDP and HSDP steps from
#       2 to 1024 hosts of GPUS GPUs (see the assumptions it prints).
# Backends: "shm+gloo" (hierarchical: shared memory inside a host, Gloo
# across) and "gloo" (DP_SHM=0: one Gloo ring over all ranks). --sizes holds
# comma-separated dp-perf size options, one dp-perf run each. Only rank 0's
# lines are printed. Needs root; namespaces and links are removed however the
# run ends. PYTHON defaults to the first with torch of BUILD_DIR/../torch2,
# ../shared/anchors/build/torch2 and python3. Open MPI over TCP runs the
# anchors' mpi_coll (built here with mpicc, libopenmpi-dev) across the same
# hosts, launched through tests/testbed/mpi_agent.sh, where mpirun.openmpi
# and mpicc are found.
set -u
here=$(cd "$(dirname "$0")" && pwd)
tb=$here/../tests/testbed/testbed.sh

# ---- the model ----

model() {
  nic_gbit=400 nics=1 gpus=8 params=1.3e9 tokens=16384 global=0 mfu=0.4
  while [ $# -gt 0 ]; do
    case $1 in
      --nic-gbit) nic_gbit=$2 ;;
      --nics) nics=$2 ;;
      --gpus) gpus=$2 ;;
      --params) params=$2 ;;
      --tokens) tokens=$2 ;;
      --global-tokens) global=$2 ;;
      --mfu) mfu=$2 ;;
      *)
        echo "model: unknown option $1" >&2
        exit 2
        ;;
    esac
    shift 2
  done
  awk -v nic_gbit="$nic_gbit" -v nics="$nics" -v L="$gpus" -v P="$params" -v T="$tokens" -v G="$global" -v mfu="$mfu" '
    function max(a, b) { return a > b ? a : b }
    function log2(x) { return log(x) / log(2) }
    BEGIN {
      flops = 989e12            # H100 SXM dense bf16 peak (datasheet)
      nvl = 370e9               # NVLink ring bandwidth per GPU, after protocol overhead
      a_in = 3e-6               # alpha of one step inside a host
      a_x = 6e-6                # alpha of one step between hosts
      eff = 0.9                 # share of the NIC line rate reached
      bucket = 25e6             # DDP bucket cap (bytes)
      B = nic_gbit / 8 * 1e9 * nics * eff   # bytes/s out of (and into) one host
      n = 2 * P                 # bf16 gradients (bytes)
      nb = n / bucket
      if (G > 0) printf "# %g parameters (bf16 gradients %.2f GB), %g tokens per step over all GPUs, %d GPUs per host;\n", P, n / 1e9, G, L
      else printf "# %g parameters (bf16 gradients %.2f GB), %d tokens per GPU per step, %d GPUs per host;\n", P, n / 1e9, T, L
      printf "# compute: 6 x parameters x tokens FLOPs at %.0f%% MFU of 989 TFLOP/s, backward 2/3 of it;\n", mfu * 100
      printf "# per host %d x %g Gbit/s at %.0f%% = %.0f GB/s each way; NVLink %.0f GB/s per GPU;\n", nics, nic_gbit, eff * 100, B / 1e9, nvl / 1e9
      printf "# alpha %g us inside a host, %g us between hosts; DDP buckets of %g MB.\n", a_in * 1e6, a_x * 1e6, bucket / 1e6
      printf "# hosts | GPUs | compute ms | intra ms | inter bytes ms | inter alpha ms, ring / tree | DDP step ms, ring / tree | exposed, ring / tree | HSDP step ms, tree\n"
      split("2 8 32 64 128 256 512 1024", hs, " ")
      for (i = 1; i <= 8; ++i) {
        H = hs[i]
        tok = G > 0 ? G / (H * L) : T
        compute = 6 * P * tok / (flops * mfu)
        bwd = compute * 2 / 3
        last = bwd / nb           # the last bucket waits for the end of the backward
        # Inside the host: reduce-scatter + all-gather over NVLink.
        intra = 2 * (L - 1) / L * n / nvl + nb * 2 * (L - 1) * a_in
        # Across hosts, each GPU all-reduces its slice (n/L) with its peers,
        # on its share of the host link: 2(H-1)/H n leave and enter each host.
        beta_x = 2 * (H - 1) / H * n / B
        lat_r = nb * 2 * (H - 1) * a_x
        lat_t = nb * 2 * log2(H) * a_x
        comm_r = intra + beta_x + lat_r
        comm_t = intra + beta_x + lat_t
        # Exposed: what the backward cannot hide (all but the last bucket
        # overlaps), at least the last bucket own reduction.
        exp_r = max(comm_r - (bwd - last), comm_r / nb)
        exp_t = max(comm_t - (bwd - last), comm_t / nb)
        # HSDP: shards inside the host, replicas across. The forward
        # all-gathers the parameters (NVLink, prefetched behind the forward);
        # the backward all-gathers them again and reduce-scatters the
        # gradients (NVLink), then each GPU all-reduces its shard (n/L)
        # across hosts: the same bytes across as DDP, tree latency.
        fwd_h = (L - 1) / L * n / nvl + nb * (L - 1) * a_in
        bwd_h = 2 * (L - 1) / L * n / nvl + nb * 2 * (L - 1) * a_in + beta_x + lat_t
        exp_h = max(fwd_h - (compute - bwd), 0) + max(bwd_h - (bwd - last), bwd_h / nb)
        printf "%7d | %5d | %10.1f | %8.1f | %14.1f | %9.1f / %6.1f | %9.1f / %9.1f | %7.0f%% / %3.0f%% | %8.1f\n",
          H, H * L, compute * 1e3, intra * 1e3, beta_x * 1e3, lat_r * 1e3, lat_t * 1e3, (compute + exp_r) * 1e3,
          (compute + exp_t) * 1e3, 100 * exp_r / (compute + exp_r), 100 * exp_t / (compute + exp_t),
          (compute + exp_h) * 1e3
      }
    }'
}

if [ "${1:-}" = model ]; then
  shift
  model "$@"
  exit 0
fi

# ---- the measured runs ----

build=${1:?usage: bench/testbed.sh BUILD_DIR [options] | bench/testbed.sh model [options]}
shift
hosts_list="2 4" rates="2gbit 5gbit 10gbit" ranks=2
sizes="-b 4K -e 4K,-b 1M -e 64M -f 4"
ddp="--layers 10 --width 1024 --batch 32 --steps 11 --warmup 2"
torch_python=""
while [ $# -gt 0 ]; do
  case $1 in
    --hosts) hosts_list=$2 ;;
    --rates) rates=$2 ;;
    --ranks) ranks=$2 ;;
    --sizes) sizes=$2 ;;
    --ddp) ddp=$2 ;;
    --torch) torch_python=$2 ;;
    *)
      echo "unknown option $1" >&2
      exit 2
      ;;
  esac
  shift 2
done
run=$build/tools/dp-run
perf=$build/bench/dp-perf
if [ ! -x "$run" ] || [ ! -x "$perf" ]; then
  echo "build dp-run and dp-perf in $build first (-DDP_BUILD_BENCH=ON)" >&2
  exit 2
fi
[ "$(id -u)" = 0 ] || {
  echo "the testbed needs root" >&2
  exit 2
}

echo "# $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg), $(date -u '+%F %H:%M UTC')"
anchors=$(cd "$here/../.." && pwd)/shared/anchors
if [ -z "$torch_python" ]; then
  for candidate in "$build/../torch2/bin/python" "$anchors/build/torch2/bin/python" python3; do
    if "$candidate" -c 'import torch' 2>/dev/null; then
      torch_python=$candidate
      break
    fi
  done
fi
if [ -n "$torch_python" ] && "$torch_python" -c 'import torch' 2>/dev/null; then
  echo "# PyTorch DDP/gloo: $torch_python (torch $("$torch_python" -c 'import torch; print(torch.__version__)'))"
else
  echo "# PyTorch DDP/gloo skipped: no python with torch (--torch, $build/../torch2, $anchors/build/torch2, python3)"
  torch_python=""
fi
mpi_coll=""
mpicc=$(command -v mpicc.openmpi || command -v mpicc || true)
if ! command -v mpirun.openmpi >/dev/null 2>&1; then
  echo "# Open MPI over TCP skipped: no mpirun.openmpi (openmpi-bin)"
elif [ -z "$mpicc" ] || [ ! -f "$anchors/src/mpi_coll.c" ]; then
  echo "# Open MPI over TCP skipped: no mpicc (libopenmpi-dev) or no $anchors/src/mpi_coll.c"
else
  mpi_coll=$(mktemp "/tmp/dptb_mpi_coll$$_XXXXXX") || exit 1
  if "$mpicc" -O2 -o "$mpi_coll" "$anchors/src/mpi_coll.c"; then
    echo "# Open MPI over TCP: $(mpirun.openmpi --version | head -n 1), the anchors' mpi_coll"
  else
    echo "# Open MPI over TCP skipped: mpi_coll did not build"
    rm -f "$mpi_coll"
    mpi_coll=""
  fi
fi
agent=$(cd "$here/../tests/testbed" && pwd)/mpi_agent.sh

# The testbed is named after this process, so a run killed outright is
# removed by the next start of testbed.sh.
name=run$$
trap '"$tb" down --name "$name"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

# The run under way, if any (its testbed.sh stops its hosts' commands).
stop_child() {
  [ -z "$child" ] && return 0
  kill -TERM "$child" 2>/dev/null
  wait "$child" 2>/dev/null
}

# on_hosts BACKEND ARGS...: dp-perf ARGS under dp-run on every host; rank 0's lines.
on_hosts() {
  backend=$1
  shift
  if [ "$backend" = gloo ]; then set -- env DP_SHM=0 "$@"; else set -- env -u DP_SHM "$@"; fi
  # In the background, so that a signal reaches this shell's traps at once.
  "$@" >"$out" 2>&1 &
  child=$!
  wait "$child"
  code=$?
  child=""
  if [ "$code" != 0 ]; then
    cat "$out"
    echo "failed with $code" >&2
    exit 1
  fi
  grep '^\[rank 0\]' "$out"
}

# mpi_on_hosts HOSTS: the anchors' mpi_coll over Open MPI's TCP transport,
# RANKS per host, mpirun in host 0 and the others' daemons started through
# the agent; its whole output.
mpi_on_hosts() {
  list=""
  k=1
  while [ "$k" -le "$1" ]; do
    list="$list${list:+,}$subnet_prefix$k:$ranks"
    k=$((k + 1))
  done
  "$tb" exec --name "$name" 0 env TESTBED_NAME="$name" OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    timeout -s KILL 600 mpirun.openmpi --mca plm_rsh_agent "$agent" -H "$list" -np $(($1 * ranks)) \
    --mca btl tcp,self --mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0 \
    "$mpi_coll" 11 4K,1M,16M,64M 16M >"$out" 2>&1 &
  child=$!
  wait "$child"
  code=$?
  child=""
  cat "$out"
  [ "$code" = 0 ] || echo "# Open MPI failed with $code"
}
subnet_prefix=10.213.0.

out=$(mktemp "/tmp/dptb_run$$_XXXXXX") || exit 1
child=""
trap 'stop_child; "$tb" down --name "$name"; rm -f "$out" ${mpi_coll:+"$mpi_coll"}' EXIT
for hosts in $hosts_list; do
  "$tb" up --name "$name" --hosts "$hosts" --rate none || exit 1
  for rate in $rates; do
    "$tb" shape --name "$name" "$rate" || exit 1
    for backend in shm+gloo gloo; do
      old_ifs=$IFS
      IFS=,
      for size in $sizes; do
        IFS=$old_ifs
        echo "== $hosts hosts x $ranks ranks, $rate, $backend: dp-perf all_reduce $size"
        # shellcheck disable=SC2086 # the options' words
        on_hosts "$backend" "$tb" run --name "$name" --timeout 600 --dp-run "$run" --nproc "$ranks" -- \
          "$perf" all_reduce $size
      done
      IFS=$old_ifs
      echo "== $hosts hosts x $ranks ranks, $rate, $backend: dp-perf ddp $ddp"
      # shellcheck disable=SC2086
      on_hosts "$backend" "$tb" run --name "$name" --timeout 600 --dp-run "$run" --nproc "$ranks" -- "$perf" ddp $ddp
      if [ "$backend" = shm+gloo ]; then
        # HSDP shards inside each host (shared memory) and replicates across.
        echo "== $hosts hosts x $ranks ranks, $rate, $backend: dp-perf fsdp $ddp --modes local,fsdp,hsdp,ddp"
        # shellcheck disable=SC2086
        on_hosts "$backend" "$tb" run --name "$name" --timeout 600 --dp-run "$run" --nproc "$ranks" -- \
          "$perf" fsdp $ddp --modes local,fsdp,hsdp,ddp
      fi
    done
    if [ -n "$torch_python" ]; then
      echo "== $hosts hosts x $ranks ranks, $rate, PyTorch DDP/gloo: torch_ddp_hosts.py $ddp"
      # shellcheck disable=SC2086 # dp-perf's model options are the script's
      on_hosts gloo "$tb" run --name "$name" --timeout 600 --dp-run "$run" --nproc "$ranks" -- \
        env OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 "$torch_python" "$here/torch_ddp_hosts.py" $ddp
    fi
    if [ -n "$mpi_coll" ]; then
      echo "== $hosts hosts x $ranks ranks, $rate, Open MPI over TCP: mpi_coll 11 4K,1M,16M,64M 16M"
      mpi_on_hosts "$hosts"
    fi
  done
  "$tb" down --name "$name"
done
