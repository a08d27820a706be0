#!/bin/sh
# Tests on the testbed (testbed.sh beside this script): hosts as network
# namespaces behind a bridge, each link shaped.
#   testbed_test.sh hierarchical CI DP_RUN SHM_WORKER DP_TRAIN
#   testbed_test.sh flat CI DP_RUN SHM_WORKER DP_TRAIN
#       2 hosts x 2 ranks, dp-run on each host, links at 5 Gbit/s: an
#       all_reduce checked bit for bit (hierarchical: shm_worker's
#       rank_order_sums on "shm+gloo", inexact float sums in host order;
#       flat: DP_SHM=0, shm_worker's exact sums on "gloo"), which must have
#       crossed host 0's link; then dp-train --ddp, whose every rank matches
#       single-process training and whose model is bit for bit the one the
#       same 2 x 2 ranks make on one host's loopback.
#   testbed_test.sh hsdp CI DP_RUN HSDP_WORKER
#       2 hosts x 2 ranks, links at 5 Gbit/s: hsdp_worker's scenarios with
#       each host's ranks a shard group (shared memory) and the replicas
#       across the hosts: the mesh by host (dp_device_mesh_create_by_host's
#       splits) and the 2x2 groups train like one process, and a sharded
#       save loads at other mesh shapes; the replicas' all-reduces must
#       have crossed host 0's link.
#   testbed_test.sh elastic CI DP_RUN DP_TRAIN
#       2 hosts x 2 ranks, links at 5 Gbit/s, dp-run --survive-failures on
#       each: dp-train --ddp --elastic, host 1's two ranks die after step 4
#       (a whole host lost); host 0's ranks shrink the group to themselves,
#       rebind and finish, matching single-process training.
#   testbed_test.sh rate CI TCP_TRANSFER
#       Links at 100 Mbit/s: 16 MB from host 1 to host 0 take at least 0.8 x
#       (16 MB - one bucket) / rate, and tc's counters show the bytes through
#       host 1's shaper and host 0's bridge port.
#   testbed_test.sh cleanup CI
#       While up, this machine's own namespace has no new link or address;
#       another testbed's up, clean and down leave a live run alone; a
#       run stopped by SIGTERM or SIGINT leaves no namespace and no process;
#       one killed outright (SIGKILL) is removed with its processes by the
#       next start.
# Needs root: exits 77 (skipped) without, unless CI is non-empty, where not
# being root fails. Everything is removed on every exit; what a killed run
# of this script left goes at the next start (its testbed is named after its
# pid, as testbed.sh's own runs are).
set -u
mode=${1:?mode}
ci=${2:-}
[ $# -ge 2 ] && shift 2
here=$(cd "$(dirname "$0")" && pwd)
tb=$here/testbed.sh

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

name=run$$
dir=""
started=""
cleanup() {
  for pid in $started; do kill -KILL "$pid" 2>/dev/null; done
  for pid in $started; do wait "$pid" 2>/dev/null; done
  "$tb" down --name "$name" 2>/dev/null
  "$tb" clean 2>/dev/null
  [ -n "$dir" ] && rm -rf "$dir"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP
# testbed.sh clears a stale /tmp/dptb_run<pid>_* with the testbed.
dir=$(mktemp -d "/tmp/dptb_run$$_XXXXXX") || fail "mktemp"

# up NAME ARGS...: makes the testbed, or skips where namespaces cannot be made.
up() {
  "$tb" up --name "$name" "$@" >"$dir/up.txt" 2>&1
  code=$?
  [ "$code" = 77 ] && skip "$(cat "$dir/up.txt")"
  [ "$code" = 0 ] || fail "testbed.sh up: $(cat "$dir/up.txt")"
}

# The bytes tc's qdisc counted on one link, as testbed.sh stats titles it.
sent() {
  "$tb" stats --name "$name" | awk -v title="$1" '$0 == title { f = 1; next } f && $1 == "Sent" { print $2; exit }'
}

# run ARGS...: testbed.sh run on this script's testbed; its output to the
# file $out, echoed; fails the test when a host fails.
run_on_hosts() {
  "$tb" run --name "$name" --timeout 90 "$@" >"$out" 2>&1
  code=$?
  cat "$out"
  [ "$code" = 0 ] || fail "a host exited with $code"
}

case $mode in
  hierarchical | flat)
    run=${1:?DP_RUN} worker=${2:?SHM_WORKER} train=${3:?DP_TRAIN}
    for program in "$run" "$worker" "$train"; do [ -x "$program" ] || fail "no program at $program"; done
    up --hosts 2 --rate 5gbit
    if [ "$mode" = hierarchical ]; then
      backend=shm+gloo
      set -- env -u DP_SHM
      # shm_worker's three repeated sums of 700001 floats
      payload=$((3 * 700001 * 4))
      check="rank_order_sums shm+gloo 2"
    else
      backend=gloo
      set -- env DP_SHM=0
      payload=$((300000 * 4))
      check="backend gloo"
    fi
    link="host 0, eth0 (sent by the host):"
    before=$(sent "$link")
    out=$dir/all_reduce.txt
    # shellcheck disable=SC2086 # the scenario's words
    "$@" "$tb" run --name "$name" --timeout 90 --dp-run "$run" --nproc 2 -- env DP_TEST_TIMEOUT_MS=60000 \
      "$worker" $check >"$out" 2>&1 || {
      cat "$out"
      fail "the all_reduce failed"
    }
    cat "$out"
    [ "$(grep -c "passed" "$out")" = 4 ] || fail "not every rank passed"
    after=$(sent "$link")
    # Each host's result depends on every element of the other's sums, so
    # at least the payload crosses each way.
    crossed=$((after - before))
    echo "host 0 sent $crossed bytes over its link during the all_reduce"
    [ "$crossed" -ge "$payload" ] || fail "host 0 sent $crossed bytes, fewer than the $payload all-reduced"

    # A small MLP, several buckets.
    train_args="--ddp --steps 8 --batch 91 --width 40 --layers 4 --bucket-cap-mb 0.005 --first-bucket-cap-mb 0.002"
    out=$dir/ddp.txt
    # shellcheck disable=SC2086 # the options' words
    "$@" "$tb" run --name "$name" --timeout 90 --dp-run "$run" --nproc 2 -- "$train" $train_args \
      --save "$dir/hosts.safetensors" >"$out" 2>&1 || {
      cat "$out"
      fail "DDP across the hosts failed"
    }
    cat "$out"
    grep -q "over 4 ranks ($backend;" "$out" || fail "the ranks' group is not $backend"
    [ "$(grep -c "parity with single-process training.*: OK" "$out")" = 4 ] || fail "not every rank matched"
    # The same ranks as 2 nodes on host 0's loopback: same ranks per node,
    # the same group, so the same sums in the same order.
    for k in 1 0; do
      # shellcheck disable=SC2086
      "$@" "$tb" exec --name "$name" 0 env DP_HOST_ID="node$k" DP_SOCKET_IFNAME=lo DP_STORE_TOKEN="ref-$$" \
        "$run" -n 2 --nnodes 2 --node-rank "$k" --master-addr 127.0.0.1 --master-port 29600 "$train" $train_args \
        --save "$dir/loopback$k.safetensors" >"$dir/loopback$k.txt" 2>&1 &
      started="$started $!"
    done
    for pid in $started; do wait "$pid" || {
      cat "$dir"/loopback*.txt
      fail "the loopback run failed"
    }; done
    started=""
    cmp "$dir/hosts.safetensors" "$dir/loopback0.safetensors" ||
      fail "the model trained across the hosts differs from the one trained on loopback"
    echo "passed: $backend across 2 hosts x 2 ranks; the DDP model is bit for bit the loopback run's"
    ;;

  hsdp)
    run=${1:?DP_RUN} worker=${2:?HSDP_WORKER}
    for program in "$run" "$worker"; do [ -x "$program" ] || fail "no program at $program"; done
    up --hosts 2 --rate 5gbit
    link="host 0, eth0 (sent by the host):"
    for scenario in mesh_parity parity save_load; do
      before=$(sent "$link")
      # The worker's groups rendezvous through files, which every host sees;
      # their traffic goes through the hosts' links.
      mkdir "$dir/$scenario" || fail "mkdir"
      out=$dir/$scenario.txt
      "$tb" run --name "$name" --timeout 90 --dp-run "$run" --nproc 2 -- env DP_TEST_DIR="$dir/$scenario" \
        "$worker" "$scenario" >"$out" 2>&1 || {
        cat "$out"
        fail "$scenario across the hosts failed"
      }
      cat "$out"
      [ "$(grep -c ": $scenario passed" "$out")" = 4 ] || fail "not every rank passed $scenario"
      crossed=$(($(sent "$link") - before))
      echo "host 0 sent $crossed bytes over its link during $scenario"
      # The replicate groups connect and all-reduce across the hosts.
      [ "$crossed" -ge 1024 ] || fail "host 0 sent only $crossed bytes during $scenario"
    done
    echo "passed: HSDP across 2 hosts x 2 ranks trains like one process and saves and loads across mesh shapes"
    ;;

  elastic)
    run=${1:?DP_RUN} train=${2:?DP_TRAIN}
    for program in "$run" "$train"; do [ -x "$program" ] || fail "no program at $program"; done
    up --hosts 2 --rate 5gbit
    # testbed.sh starts PATH with dp-run's own arguments.
    survive=$dir/dp-run-survive
    printf '#!/bin/sh\nexec "%s" --survive-failures "$@"\n' "$run" >"$survive" && chmod +x "$survive" || fail "wrapper"
    out=$dir/elastic.txt
    code=0
    env -u DP_SHM "$tb" run --name "$name" --timeout 90 --dp-run "$survive" --nproc 2 -- "$train" --ddp --elastic \
      --steps 10 --batch 91 --width 40 --layers 4 --die-at-step 4 --dying-ranks 2,3 >"$out" 2>&1 || code=$?
    cat "$out"
    grep -q "== host 0: exit 0" "$out" || fail "host 0's ranks did not finish"
    grep -q "== host 1: exit 9" "$out" || fail "host 1's ranks did not die as asked"
    [ "$code" = 9 ] || fail "testbed.sh run exited with $code, not host 1's 9"
    grep -q "over 4 ranks (shm+gloo;" "$out" || fail "the job did not start on the hierarchical group"
    grep -q "rank(s) 2, 3 lost; .*going on at step 5 over 2 ranks" "$out" || fail "host 0's ranks did not go on at step 5"
    [ "$(grep -c "parity with single-process training.*: OK" "$out")" = 2 ] || fail "the survivors do not both match"
    echo "passed: a host lost whole, the other's ranks shrink, rebind and finish like one process"
    ;;

  rate)
    transfer=${1:?TCP_TRANSFER}
    [ -x "$transfer" ] || fail "no program at $transfer"
    bits=100000000
    bytes=16000000
    up --hosts 2 --rate 100mbit
    out=$dir/transfer.txt
    # shellcheck disable=SC2016 # expanded by each host's shell
    run_on_hosts -- sh -c 'if [ "$TESTBED_HOST" = 0 ]; then exec "$0" recv 5201 "$1"; else
                             exec "$0" send "$TESTBED_MASTER_ADDR" 5201 "$1"; fi' "$transfer" "$bytes"
    seconds=$(sed -n "s/^received $bytes bytes in \([0-9.]*\) s$/\1/p" "$out")
    [ -n "$seconds" ] || fail "host 0 did not receive $bytes bytes"
    # tbf lets at most one bucket (at most 1 MiB here) plus rate x time
    # through; headers only add to the bytes on the wire.
    awk -v s="$seconds" -v b="$bytes" -v r="$bits" 'BEGIN {
      low = (b - 1048576) * 8 / r
      printf "%d bytes in %.3f s (%.1f Mbit/s); shaped, they take at least %.3f s\n", b, s, b * 8 / s / 1e6, low
      exit !(s >= 0.8 * low) }' || fail "the transfer was faster than the links' rate allows"
    through=$(sent "host 1, eth0 (sent by the host):")
    into=$(sent "host 0, bridge port h0 (received by the host):")
    echo "tc: host 1's eth0 sent $through bytes, the bridge port to host 0 $into bytes"
    [ "$through" -ge "$bytes" ] || fail "host 1's shaper counted $through bytes, fewer than the $bytes sent"
    [ "$into" -ge "$bytes" ] || fail "host 0's bridge port counted $into bytes, fewer than the $bytes received"
    echo "passed: the links' shaping bounds a transfer between hosts"
    ;;

  cleanup)
    # Links of this namespace, with their peers' namespaces; others may add
    # theirs meanwhile, so only the testbed's names and addresses count.
    ip -o link show | sed 's/^[0-9]*: //' | sort >"$dir/links.before"
    up --hosts 3 --rate 1gbit
    ip -o link show | sed 's/^[0-9]*: //' | sort >"$dir/links.up"
    added=$(comm -13 "$dir/links.before" "$dir/links.up" | grep -E "^(br0|eth0|h[0-9]+)[@:]|dptb-$name-")
    [ -z "$added" ] || fail "the testbed added links to this namespace: $added"
    ours=$(ip -o addr show | grep ' 10\.213\.')
    [ -z "$ours" ] || fail "the testbed's addresses are in this namespace: $ours"
    "$tb" down --name "$name"
    ! ip netns list | grep -q "^dptb-$name-" || fail "down left namespaces: $(ip netns list)"

    # Starts a 2-host run of `sleep` and waits (60 s at most) until both
    # hosts' commands run; sets $pid and $inside (the processes in the hosts).
    start_run() {
      # env resets SIGINT, which a shell's background job otherwise ignores.
      env --default-signal=INT "$tb" run --hosts 2 --rate 1gbit -- sleep 300 >"$dir/run.txt" 2>&1 &
      pid=$!
      started=$pid
      tries=0
      while :; do
        inside=$(for k in 0 1; do ip netns pids "dptb-run$pid-h$k" 2>/dev/null; done)
        [ "$(echo "$inside" | grep -c .)" -ge 2 ] && break
        kill -0 "$pid" 2>/dev/null || fail "the run ended early: $(cat "$dir/run.txt")"
        [ "$tries" -lt 600 ] || fail "the run's hosts did not start in 60 s"
        sleep 0.1
        tries=$((tries + 1))
      done
    }
    # The run of $pid left no namespace and none of $inside.
    expect_gone() {
      left=$(ip netns list | grep "^dptb-run$pid-")
      [ -z "$left" ] || fail "$1 left namespaces: $left"
      for p in $inside; do
        # A zombie waits only for its new parent to reap it.
        state=$(sed 's/.*) //' "/proc/$p/stat" 2>/dev/null | cut -d' ' -f1)
        [ -z "$state" ] || [ "$state" = Z ] || fail "$1 left process $p running (state $state)"
      done
    }
    # Another testbed made, cleaned and removed beside a live run leaves
    # the run alone.
    start_run
    up --hosts 2 --rate 1gbit
    "$tb" clean
    "$tb" down --name "$name"
    [ "$(ip netns list | grep -c "^dptb-run$pid-")" = 3 ] || fail "another testbed's up, clean or down removed a live run's"
    for p in $inside; do
      kill -0 "$p" 2>/dev/null || fail "another testbed's up, clean or down stopped a live run's process $p"
    done
    kill -TERM "$pid"
    wait "$pid"
    started=""

    for signal in TERM INT; do
      start_run
      kill "-$signal" "$pid"
      wait "$pid"
      code=$?
      started=""
      echo "SIG$signal: the run exited with $code"
      [ "$code" != 0 ] || fail "the run stopped by SIG$signal exited 0"
      expect_gone "a run stopped by SIG$signal"
    done

    start_run
    kill -KILL "$pid"
    wait "$pid"
    started=""
    ip netns list | grep -q "^dptb-run$pid-" || fail "nothing left to clean after SIGKILL"
    "$tb" clean
    expect_gone "a run killed outright, after the next start,"
    echo "passed: nothing left behind after down, SIGTERM, SIGINT and SIGKILL"
    ;;
  *) fail "unknown mode $mode" ;;
esac
