#!/bin/sh
# dp-train --ddp --elastic under dp-run --survive-failures: 4 ranks train,
# rank 1 dies after step 6, the other 3 shrink their group, rebind the
# dp_ddp and finish. Their model must equal, byte for byte, a reference that
# trained the same data on 4 ranks up to step 6 (saved there) and on 3 from
# that save on. Over shared memory, then over Gloo (DP_SHM=0).
#   elastic_test.sh DP_RUN DP_TRAIN
set -eu
dp_run=$1
train=$2
tmp=$(mktemp -d "${TMPDIR:-/tmp}/dp-elastic.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
model="--ddp --batch 66 --width 32 --layers 3"

for shm in 1 0; do
  log=$tmp/elastic$shm.log
  status=0
  DP_SHM=$shm "$dp_run" -n 4 --survive-failures "$train" $model --steps 12 --elastic --die-at-step 6 \
    --save "$tmp/elastic$shm.safetensors" >"$log" 2>&1 || status=$?
  fail() { cat "$log"; echo "FAIL (DP_SHM=$shm): $1"; exit 1; }
  [ "$status" -eq 0 ] || fail "the elastic job exited with $status"
  grep -q "rank 1 exits after step 6" "$log" || fail "rank 1 did not die"
  grep -q "the other ranks go on (--survive-failures)" "$log" || fail "dp-run stopped the others"
  grep -q "rank(s) 1 lost; .*going on at step 7 over 3 ranks" "$log" || fail "the survivors did not go on at step 7"
  grep -q "parity with single-process training.*: OK" "$log" || fail "no parity with single-process training"

  ref=$tmp/ref$shm
  DP_SHM=$shm "$dp_run" -n 4 "$train" $model --steps 6 --checkpoint-dir "$ref" --checkpoint-every 6 \
    >"$tmp/four.log" 2>&1 || { cat "$tmp/four.log"; echo "FAIL: the reference's 4 ranks"; exit 1; }
  DP_SHM=$shm "$dp_run" -n 3 "$train" $model --steps 12 --checkpoint-dir "$ref" --checkpoint-every 6 \
    --save "$tmp/ref$shm.safetensors" >"$tmp/three.log" 2>&1 ||
    { cat "$tmp/three.log"; echo "FAIL: the reference's 3 ranks"; exit 1; }
  grep -q "resuming from $ref/step-6.safetensors: step 7 on" "$tmp/three.log" ||
    { cat "$tmp/three.log"; echo "FAIL: the reference did not resume at step 7"; exit 1; }
  cmp "$tmp/elastic$shm.safetensors" "$tmp/ref$shm.safetensors" ||
    fail "the survivors' model differs from the reference's (4 ranks to step 6, 3 after)"
done
echo "shrink and go on: OK"
