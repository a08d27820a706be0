#!/bin/sh
# A network of N hosts on this machine, for tests and benchmarks: each host is
# a network namespace with one interface, eth0 (10.213.0.K+1/24 for host K),
# a veth pair into a bridge that lives in a namespace of its own, so no
# address and no link is added to this machine's own namespace. Each host's
# link is shaped with tbf at RATE both ways: on eth0 (what the host sends)
# and on the bridge's port (what it receives), like a switch port of RATE.
# Latency is not emulated (this kernel has no netem): a link adds only the
# veth's and the bridge's own cost, microseconds, and the queueing the
# shaping causes.
#
#   testbed.sh run --hosts N --rate RATE [--mtu M] [--timeout S] [--logs DIR]
#                  [--name NAME] [--port P] [--dp-run PATH --nproc R] -- CMD [ARGS...]
#       Runs CMD in every host at once and waits for all: with --dp-run,
#       "PATH -n R --nnodes N --node-rank K --master-addr 10.213.0.1
#       --master-port P CMD ARGS" in host K. Prints each host's output
#       (stdout and stderr) after "== host K: exit C", and exits 0 when every
#       host exited 0, else with the first failed host's code (124: still
#       running after S seconds, stopped). Without --name, the testbed is made
#       for the run and removed when it ends, however it ends; with --name, it
#       runs on that testbed (made by up; --hosts and --rate are then unused),
#       and stops every process in its hosts when it ends: one run at a time.
#   testbed.sh up --hosts N --rate RATE [--mtu M] [--name NAME]
#       Makes a testbed that stays until down (an earlier one of that name is
#       removed first).
#   testbed.sh exec [--name NAME] K CMD [ARGS...]   runs CMD in host K
#   testbed.sh shape [--name NAME] RATE             reshapes every link
#   testbed.sh stats [--name NAME]                  tc's counters of each link
#   testbed.sh down [--name NAME]                   removes the testbed
#   testbed.sh clean                                removes what killed runs left
# NAME defaults to "bed". RATE is tc's: 500mbit, 5gbit, ... or "none"
# (unshaped). Every command CMD runs with, besides the caller's environment:
#   TESTBED_HOST=K TESTBED_HOSTS=N TESTBED_ADDR=10.213.0.K+1
#   TESTBED_MASTER_ADDR=10.213.0.1 DP_SOCKET_IFNAME=eth0
#   DP_HOST_ID=<the host's namespace> (dparallel tells network namespaces
#   apart on its own; the id names the host in its messages)
#   DP_STORE_TOKEN=<one per run> (run only)
# Needs root and iproute2 (ip, tc); exits 77 without them. Namespaces are
# named dptb-NAME-br and dptb-NAME-hK; a run's NAME is run<its pid>, and
# those of runs killed outright (pid gone) are removed at the next start of
# any command, with their processes.
set -u

prefix=dptb-
subnet=10.213.0
me=$(basename "$0")

die() {
  echo "$me: $*" >&2
  exit 2
}
skip() {
  echo "$me: skipped: $*" >&2
  exit 77
}

case ${1:-} in
  '' | -h | --help)
    sed -n '2,/^set -u/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
    exit 0
    ;;
esac
[ "$(id -u)" = 0 ] || skip "needs root to make network namespaces"
command -v ip >/dev/null 2>&1 || skip "ip (iproute2) not found"
command -v tc >/dev/null 2>&1 || skip "tc (iproute2) not found"

# ---- the namespaces ----

host_ns() { echo "$prefix$1-h$2"; }
bridge_ns() { echo "$prefix$1-br"; }

# The namespaces of testbed $1, one a line.
namespaces_of() {
  ip netns list 2>/dev/null | sed -n "s/^\($prefix$1-\(br\|h[0-9]*\)\)\( .*\)\{0,1\}$/\1/p"
}

host_count() {
  namespaces_of "$1" | grep -c -- '-h[0-9]*$'
}

# Stops every process in testbed $1's namespaces (they are the testbed's
# commands and their children): SIGTERM, up to 5 s to exit, then SIGKILL.
stop_processes() {
  sp_nss=$(namespaces_of "$1")
  [ -n "$sp_nss" ] || return 0
  sp_pids=$(for sp_ns in $sp_nss; do ip netns pids "$sp_ns" 2>/dev/null; done)
  [ -n "$sp_pids" ] || return 0
  # shellcheck disable=SC2086 # one pid a word
  kill -TERM $sp_pids 2>/dev/null
  sp_tries=0
  while [ "$sp_tries" -lt 50 ]; do
    sp_left=$(for sp_ns in $sp_nss; do ip netns pids "$sp_ns" 2>/dev/null; done)
    [ -n "$sp_left" ] || return 0
    sleep 0.1
    sp_tries=$((sp_tries + 1))
  done
  # shellcheck disable=SC2086
  kill -KILL $sp_left 2>/dev/null
}

# Removes testbed $1: its processes, then its namespaces (deleting a
# namespace deletes its ends of the veth pairs, and so the pairs).
teardown() {
  stop_processes "$1"
  for td_ns in $(namespaces_of "$1"); do
    ip netns del "$td_ns" 2>/dev/null
  done
}

# The testbeds of runs whose process is gone, and their log folders.
clean_stale() {
  for cs_name in $(ip netns list 2>/dev/null | sed -n "s/^${prefix}\(run[0-9]*\)-.*/\1/p" | sort -u); do
    kill -0 "${cs_name#run}" 2>/dev/null || teardown "$cs_name"
  done
  for cs_old in /tmp/dptb_run*_*; do
    [ -d "$cs_old" ] || continue
    cs_owner=${cs_old#/tmp/dptb_run}
    cs_owner=${cs_owner%%_*}
    kill -0 "$cs_owner" 2>/dev/null || rm -rf "$cs_old"
  done
}

# ---- shaping ----

# RATE in bit/s (an integer), or 0 for "none"; fails on anything else.
rate_bits() {
  echo "$1" | awk '
    $0 == "none" { print 0; exit }
    match($0, /^[0-9]+(\.[0-9]+)?(bit|kbit|mbit|gbit)$/) {
      n = $0 + 0
      unit = $0
      sub(/^[0-9.]+/, "", unit)
      if (unit == "kbit") n *= 1e3; else if (unit == "mbit") n *= 1e6; else if (unit == "gbit") n *= 1e9
      if (n >= 8000) { printf "%.0f\n", n; exit }
    }
    { exit 1 }'
}

# tbf on device $3 of namespace $2 at rate $1 (bit/s; 0 removes the shaping).
# The bucket holds 1 ms at the rate and at least two 64 KiB GSO packets, so
# the veth's large packets pass whole; packets queue up to 50 ms.
shape_dev() {
  if [ "$1" = 0 ]; then
    tc -n "$2" qdisc del dev "$3" root 2>/dev/null
    return 0
  fi
  sd_burst=$(($1 / 8 / 1000))
  [ "$sd_burst" -ge 131072 ] || sd_burst=131072
  tc -n "$2" qdisc replace dev "$3" root tbf rate "$1"bit burst "$sd_burst" latency 50ms ||
    die "tc qdisc on $3 in $2 failed (no tbf in this kernel?)"
}

shape_all() {
  sa_bits=$(rate_bits "$2") || die "RATE takes a tc rate like 500mbit or 5gbit, or none; not '$2'"
  sa_n=$(host_count "$1")
  [ "$sa_n" -gt 0 ] || die "no testbed named $1 (testbed.sh up makes one)"
  sa_k=0
  while [ "$sa_k" -lt "$sa_n" ]; do
    shape_dev "$sa_bits" "$(host_ns "$1" "$sa_k")" eth0
    shape_dev "$sa_bits" "$(bridge_ns "$1")" "h$sa_k"
    sa_k=$((sa_k + 1))
  done
}

# ---- making a testbed ----

# bring_up NAME HOSTS RATE MTU
bring_up() {
  bu_bits=$(rate_bits "$3") || die "--rate takes a tc rate like 500mbit or 5gbit, or none; not '$3'"
  bu_br=$(bridge_ns "$1")
  bu_err=$(ip netns add "$bu_br" 2>&1) || skip "ip netns add failed (no CAP_SYS_ADMIN?): $bu_err"
  ip -n "$bu_br" link add br0 type bridge || die "no bridge device in this kernel"
  ip -n "$bu_br" link set br0 mtu "$4" up || die "bringing br0 up"
  ip -n "$bu_br" link set lo up
  bu_k=0
  while [ "$bu_k" -lt "$2" ]; do
    bu_ns=$(host_ns "$1" "$bu_k")
    ip netns add "$bu_ns" || die "ip netns add $bu_ns"
    # Made inside the host with its peer in the bridge's namespace: no name
    # meets this machine's own.
    ip -n "$bu_ns" link add eth0 mtu "$4" type veth peer name "h$bu_k" mtu "$4" netns "$bu_br" || die "veth for host $bu_k"
    ip -n "$bu_br" link set "h$bu_k" master br0 up || die "bridge port h$bu_k"
    ip -n "$bu_ns" addr add "$subnet.$((bu_k + 1))/24" dev eth0 || die "address of host $bu_k"
    ip -n "$bu_ns" link set lo up
    ip -n "$bu_ns" link set eth0 up || die "eth0 of host $bu_k"
    shape_dev "$bu_bits" "$bu_ns" eth0
    shape_dev "$bu_bits" "$bu_br" "h$bu_k"
    bu_k=$((bu_k + 1))
  done
}

# ---- running in the hosts ----

# host_exec NAME K HOSTS CMD...: CMD in host K with the testbed's variables.
host_exec() {
  hx_name=$1 hx_k=$2 hx_n=$3
  shift 3
  exec ip netns exec "$(host_ns "$hx_name" "$hx_k")" env TESTBED_HOST="$hx_k" TESTBED_HOSTS="$hx_n" \
    TESTBED_ADDR="$subnet.$((hx_k + 1))" TESTBED_MASTER_ADDR="$subnet.1" DP_SOCKET_IFNAME=eth0 \
    DP_HOST_ID="$(host_ns "$hx_name" "$hx_k")" "$@"
}

# run's exit, however it comes: its commands stopped, its testbed (if its
# own) and its logs (if not the caller's) removed.
finish_run() {
  for pid in $pids; do kill -TERM "$pid" 2>/dev/null; done
  if [ -n "$own" ]; then teardown "$name"; else stop_processes "$name"; fi
  for pid in $pids; do wait "$pid" 2>/dev/null; done
  [ -n "$dir" ] && rm -rf "$dir"
}

# ---- the commands ----

positive() {
  case $2 in
    '' | *[!0-9]* | 0*) die "$1 takes a positive integer, not '$2'" ;;
  esac
}

cmd=${1:-}
[ $# -gt 0 ] && shift
name=bed hosts="" rate="" mtu=1500 timeout=600 logs="" dprun="" nproc="" port=29500 own=yes
while [ $# -gt 0 ]; do
  case $1 in
    --name) name=${2:?--name needs a value} own="" ;;
    --hosts) hosts=${2:?--hosts needs a value} ;;
    --rate) rate=${2:?--rate needs a value} ;;
    --mtu) mtu=${2:?--mtu needs a value} ;;
    --timeout) timeout=${2:?--timeout needs a value} ;;
    --logs) logs=${2:?--logs needs a value} ;;
    --dp-run) dprun=${2:?--dp-run needs a value} ;;
    --nproc) nproc=${2:?--nproc needs a value} ;;
    --port) port=${2:?--port needs a value} ;;
    --) shift && break ;;
    -*) die "unknown option $1" ;;
    *) break ;;
  esac
  shift 2
done
case $name in
  *[!a-zA-Z0-9]* | '') die "--name takes letters and digits, not '$name'" ;;
esac

clean_stale

case $cmd in
  up)
    positive --hosts "$hosts"
    [ "$hosts" -le 200 ] || die "--hosts takes at most 200"
    positive --mtu "$mtu"
    [ -n "$rate" ] || die "--rate is required (a tc rate like 5gbit, or none)"
    teardown "$name"
    trap 'teardown "$name"' EXIT
    bring_up "$name" "$hosts" "$rate" "$mtu"
    trap - EXIT
    echo "testbed $name: $hosts hosts at $subnet.1..$subnet.$hosts, links shaped at $rate each way"
    ;;
  down)
    teardown "$name"
    ;;
  clean) ;;
  shape)
    [ $# -eq 1 ] || die "usage: $me shape [--name NAME] RATE"
    shape_all "$name" "$1"
    ;;
  stats)
    n=$(host_count "$name")
    [ "$n" -gt 0 ] || die "no testbed named $name"
    k=0
    while [ "$k" -lt "$n" ]; do
      echo "host $k, eth0 (sent by the host):"
      tc -n "$(host_ns "$name" "$k")" -s qdisc show dev eth0 | sed 's/^/  /'
      echo "host $k, bridge port h$k (received by the host):"
      tc -n "$(bridge_ns "$name")" -s qdisc show dev "h$k" | sed 's/^/  /'
      k=$((k + 1))
    done
    ;;
  exec)
    [ $# -ge 2 ] || die "usage: $me exec [--name NAME] K CMD [ARGS...]"
    n=$(host_count "$name")
    case $1 in '' | *[!0-9]*) die "K takes a host number, not '$1'" ;; esac
    [ "$1" -lt "$n" ] || die "no host $1 in testbed $name ($n hosts)"
    k=$1
    shift
    host_exec "$name" "$k" "$n" "$@"
    ;;
  run)
    [ $# -gt 0 ] || die "run: no command given"
    positive --timeout "$timeout"
    positive --port "$port"
    if [ -n "$dprun" ]; then
      positive --nproc "$nproc"
      [ -x "$dprun" ] || die "--dp-run: no program at $dprun"
    fi
    pids="" dir=""
    trap finish_run EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    trap 'exit 129' HUP
    if [ -n "$own" ]; then
      name=run$$
      positive --hosts "$hosts"
      [ "$hosts" -le 200 ] || die "--hosts takes at most 200"
      positive --mtu "$mtu"
      [ -n "$rate" ] || die "--rate is required (a tc rate like 5gbit, or none)"
      bring_up "$name" "$hosts" "$rate" "$mtu"
    fi
    n=$(host_count "$name")
    [ "$n" -gt 0 ] || die "no testbed named $name (testbed.sh up makes one)"
    if [ -z "$logs" ]; then
      dir=$(mktemp -d "/tmp/dptb_run$$_XXXXXX") || die "mktemp"
      logs=$dir
    fi
    mkdir -p "$logs" || die "cannot make $logs"
    token=testbed-$$-$(date +%s%N)
    k=0
    while [ "$k" -lt "$n" ]; do
      (
        if [ -n "$dprun" ]; then
          set -- "$dprun" -n "$nproc" --nnodes "$n" --node-rank "$k" --master-addr "$subnet.1" --master-port "$port" "$@"
        fi
        host_exec "$name" "$k" "$n" env DP_STORE_TOKEN="$token" timeout -k 10 "$timeout" "$@"
      ) >"$logs/host$k.out" 2>&1 </dev/null &
      pids="$pids $!"
      k=$((k + 1))
    done
    status=0
    k=0
    for pid in $pids; do
      wait "$pid"
      code=$?
      echo "$code" >"$logs/host$k.rc"
      [ "$code" = 0 ] || [ "$status" != 0 ] || status=$code
      k=$((k + 1))
    done
    pids=""
    k=0
    while [ "$k" -lt "$n" ]; do
      code=$(cat "$logs/host$k.rc")
      note=""
      [ "$code" = 124 ] && note=" (still running after ${timeout}s, stopped)"
      echo "== host $k: exit $code$note"
      cat "$logs/host$k.out"
      k=$((k + 1))
    done
    exit "$status"
    ;;
  *) die "unknown command '$cmd' (run, up, exec, shape, stats, down, clean)" ;;
esac
