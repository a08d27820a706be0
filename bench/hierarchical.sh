#!/bin/sh
# dp-perf all_reduce across 4 ranks on this machine, interleaved in one run:
#   shm        one host, the shared-memory group;
#   shm+gloo   two pretend hosts x 2 ranks (DP_HOST_ID from RANK): shared
#              memory inside each, Gloo over loopback across;
#   gloo       one host with DP_SHM=0;
#   veth       (root only) the two hosts as two network namespaces joined by
#              a veth pair, Gloo on it (DP_SOCKET_IFNAME); removed at exit.
# Each runs dp-perf all_reduce at 4 KiB, then at 1, 4, 16 and 64 MiB.
#   bench/hierarchical.sh BUILD_DIR [rounds=2]
set -eu
build=$1
rounds=${2:-2}
run="$build/tools/dp-run"
perf="$build/bench/dp-perf"
if [ ! -x "$run" ] || [ ! -x "$perf" ]; then
  echo "build dp-run and dp-perf in $build first (-DDP_BUILD_BENCH=ON)" >&2
  exit 2
fi
# Ranks 0-1 on one host, 2-3 on the other (expanded by each rank's shell).
# shellcheck disable=SC2016
by_rank='export DP_HOST_ID=host$((RANK / 2)); exec "$@"'

veth=""
if [ "$(id -u)" = 0 ] && command -v ip >/dev/null 2>&1; then
  ns_a=dpbench-$$-a
  ns_b=dpbench-$$-b
  cleanup() {
    ip netns del "$ns_a" 2>/dev/null || true
    ip netns del "$ns_b" 2>/dev/null || true
  }
  trap cleanup EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  if ip netns add "$ns_a" 2>/dev/null && ip netns add "$ns_b"; then
    ip -n "$ns_a" link add gd-a type veth peer name gd-b netns "$ns_b"
    ip -n "$ns_a" addr add 10.231.0.5/30 dev gd-a
    ip -n "$ns_b" addr add 10.231.0.6/30 dev gd-b
    for dev in lo gd-a; do ip -n "$ns_a" link set "$dev" up; done
    for dev in lo gd-b; do ip -n "$ns_b" link set "$dev" up; done
    veth=yes
  fi
fi

# dp-perf's all_reduce at the sizes above, under the launcher given.
sweep() {
  "$@" all_reduce -b 4K -e 4K
  "$@" all_reduce -b 1M -e 64M -f 4 | grep -v '^\[rank 0\] # dp-perf'
}

i=1
while [ "$i" -le "$rounds" ]; do
  echo "== round $i: shm (dp-run -n 4 dp-perf), load: $(cut -d' ' -f1-3 /proc/loadavg)"
  sweep env -u DP_HOST_ID -u DP_SHM "$run" -n 4 "$perf"
  echo "== round $i: shm+gloo, 2 hosts x 2 ranks (DP_HOST_ID=host\$((RANK / 2)))"
  sweep env -u DP_SHM "$run" -n 4 sh -c "$by_rank" sh "$perf"
  echo "== round $i: gloo (DP_SHM=0)"
  sweep env -u DP_HOST_ID DP_SHM=0 "$run" -n 4 "$perf"
  if [ -n "$veth" ]; then
    echo "== round $i: shm+gloo, 2 network namespaces x 2 ranks, Gloo over a veth pair"
    for sizes in "-b 4K -e 4K" "-b 1M -e 64M -f 4"; do
      token=bench-$$-$i-${#sizes}
      # shellcheck disable=SC2086 # the sizes are words of their own
      ip netns exec "$ns_b" env -u DP_SHM DP_HOST_ID=b DP_SOCKET_IFNAME=gd-b DP_STORE_TOKEN="$token" \
        "$run" -n 2 --nnodes 2 --node-rank 1 --master-addr 10.231.0.5 --master-port 29500 \
        "$perf" all_reduce $sizes >/dev/null &
      other=$!
      # shellcheck disable=SC2086
      ip netns exec "$ns_a" env -u DP_SHM DP_HOST_ID=a DP_SOCKET_IFNAME=gd-a DP_STORE_TOKEN="$token" \
        "$run" -n 2 --nnodes 2 --node-rank 0 --master-addr 10.231.0.5 --master-port 29500 \
        "$perf" all_reduce $sizes
      wait "$other"
    done
  fi
  i=$((i + 1))
done
