#!/bin/sh
# Two hosts as two network namespaces: the hierarchical group (shared memory
# inside each host, Gloo across) with its cross-host traffic on a real
# interface instead of loopback.
#   veth_hosts_test.sh SHM_WORKER [IP_COMMAND [CI]]
# Namespace A holds ranks 0 and 1 and the store, B ranks 2 and 3. They are
# joined by two veth pairs: "st" carries the store (MASTER_ADDR), "gd" the
# Gloo data (DP_SOCKET_IFNAME). The ranks run shm_worker's rank_order_sums
# scenario (float sums checked bit for bit, on the "shm+gloo" backend); then
# gd must have carried at least that scenario's
# all-reduced bytes each way and st less, so Gloo used the interface it was
# named and not the store's. The namespaces share the boot id and host name,
# so DP_HOST_ID tells the hosts apart.
# Needs root and iproute2: exits 77 (skipped) without them, unless CI is
# non-empty, where not being root fails. The namespaces and links are removed
# on every exit; those of an earlier run killed outright (and its output
# folder) go at the next start.
set -u
worker=$1
ip_command=${2:-ip}
ci=${3:-}
limit=90  # seconds for the ranks; ctest gives the test 120

skip() {
  echo "skipped: $*"
  exit 77
}
fail() {
  echo "FAIL: $*" >&2
  exit 1
}

if [ "$(id -u)" != 0 ]; then
  [ -n "$ci" ] && fail "not root: CI runs this test as root"
  skip "needs root to create network namespaces"
fi
command -v "$ip_command" >/dev/null 2>&1 || fail "$ip_command (iproute2) not found"
ip() { command "$ip_command" "$@"; }
[ -x "$worker" ] || fail "no worker at $worker"

prefix=dpveth-
ns_a=$prefix$$-a
ns_b=$prefix$$-b
dir=$(mktemp -d "/tmp/dp_veth_$$_XXXXXX") || fail "mktemp"
pids=""

cleanup() {
  # timeout passes SIGTERM on to its rank.
  for pid in $pids; do kill "$pid" 2>/dev/null; done
  for pid in $pids; do wait "$pid" 2>/dev/null; done
  # Deleting a namespace deletes its ends of the pairs, and so the pairs.
  ip netns del "$ns_a" 2>/dev/null
  ip netns del "$ns_b" 2>/dev/null
  rm -rf "$dir"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

# Namespaces of runs that were killed before their trap ran (pid gone).
for ns in $(ip netns list 2>/dev/null | sed -n "s/^\(${prefix}[0-9]*-[ab]\).*/\1/p"); do
  owner=${ns#"$prefix"}
  owner=${owner%-*}
  kill -0 "$owner" 2>/dev/null || ip netns del "$ns" 2>/dev/null
done
for old in /tmp/dp_veth_*_*; do
  owner=${old#/tmp/dp_veth_}
  owner=${owner%%_*}
  [ -d "$old" ] && ! kill -0 "$owner" 2>/dev/null && rm -rf "$old"
done

ip netns add "$ns_a" 2>"$dir/err" || skip "ip netns add failed (no CAP_SYS_ADMIN?): $(cat "$dir/err")"
ip netns add "$ns_b" || fail "ip netns add $ns_b"

# Each pair is made inside A with its peer in B, so no name meets the root
# namespace's; the addresses are private to the two namespaces.
a() { ip -n "$ns_a" "$@" || fail "ip -n $ns_a $*"; }
b() { ip -n "$ns_b" "$@" || fail "ip -n $ns_b $*"; }
a link add st-a type veth peer name st-b netns "$ns_b"
a link add gd-a type veth peer name gd-b netns "$ns_b"
a addr add 10.231.0.1/30 dev st-a
b addr add 10.231.0.2/30 dev st-b
a addr add 10.231.0.5/30 dev gd-a
b addr add 10.231.0.6/30 dev gd-b
for dev in lo st-a gd-a; do a link set "$dev" up; done
for dev in lo st-b gd-b; do b link set "$dev" up; done

# The link's byte counters, "rx tx", as seen from A.
counters() {
  ip netns exec "$ns_a" cat "/sys/class/net/$1/statistics/rx_bytes" "/sys/class/net/$1/statistics/tx_bytes" |
    tr '\n' ' '
}
gd_before=$(counters gd-a) || fail "reading gd-a's counters"
st_before=$(counters st-a) || fail "reading st-a's counters"

# The namespaces are new: any port is free in A.
port=29500
token=veth-$$-$(date +%s%N)
for rank in 0 1 2 3; do
  if [ "$rank" -lt 2 ]; then ns=$ns_a host=a ifname=gd-a; else ns=$ns_b host=b ifname=gd-b; fi
  timeout -s KILL "$limit" "$ip_command" netns exec "$ns" env -u DP_SHM \
    RANK=$rank WORLD_SIZE=4 LOCAL_RANK=$((rank % 2)) LOCAL_WORLD_SIZE=2 \
    MASTER_ADDR=10.231.0.1 MASTER_PORT=$port DP_STORE_TOKEN="$token" \
    DP_HOST_ID="veth-host-$host" DP_SOCKET_IFNAME=$ifname DP_TEST_TIMEOUT_MS=60000 \
    "$worker" rank_order_sums shm+gloo 2 >"$dir/rank$rank.txt" 2>&1 &
  pids="$pids $!"
done

failed=0
rank=0
for pid in $pids; do
  wait "$pid"
  code=$?
  if [ "$code" != 0 ]; then
    [ "$code" = 137 ] && echo "rank $rank: still running after ${limit}s, killed" >&2
    echo "rank $rank exited with $code; its output:" >&2
    sed 's/^/  /' "$dir/rank$rank.txt" >&2
    failed=1
  fi
  rank=$((rank + 1))
done
pids=""
[ "$failed" = 0 ] || fail "a rank failed"
cat "$dir"/rank*.txt

gd_after=$(counters gd-a) || fail "reading gd-a's counters"
st_after=$(counters st-a) || fail "reading st-a's counters"
# shellcheck disable=SC2086 # split into the eight counters
set -- $gd_before $gd_after $st_before $st_after
gd_rx=$(($3 - $1)) gd_tx=$(($4 - $2)) st_rx=$(($7 - $5)) st_tx=$(($8 - $6))
echo "gd-a (Gloo): rx $gd_rx B, tx $gd_tx B; st-a (store): rx $st_rx B, tx $st_tx B"

# A host's result depends on every element of the other host's sum, so an
# all_reduce of N bytes moves at least N bytes each way between the hosts;
# the scenario's three repeatable sums are 3 x 700001 float32.
payload=$((3 * 700001 * 4))
[ "$gd_rx" -ge "$payload" ] || fail "gd-a received $gd_rx bytes, fewer than the $payload all-reduced"
[ "$gd_tx" -ge "$payload" ] || fail "gd-a sent $gd_tx bytes, fewer than the $payload all-reduced"
[ "$st_rx" -lt "$payload" ] || fail "the store's link received $st_rx bytes: collective data went through it"
[ "$st_tx" -lt "$payload" ] || fail "the store's link sent $st_tx bytes: collective data went through it"
echo "passed: shm+gloo across two namespaces, Gloo on gd-a/gd-b"
