#!/bin/sh
# dp-train --ddp under dp-run --max-restarts: rank 1 dies after step 6 of
# the first run; the job starts again from the step-4 save and finishes with
# the model of an uninterrupted run, byte for byte. Then a save of 2 ranks
# resumes on 3 (another split of each batch): parity with single-process
# training still holds (dp-train's own check, its tolerance).
#   restart_test.sh DP_RUN DP_TRAIN
set -eu
dp_run=$1
train=$2
tmp=$(mktemp -d "${TMPDIR:-/tmp}/dp-restart.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
model="--ddp --steps 12 --batch 66 --width 32 --layers 3 --checkpoint-every 4"

"$dp_run" -n 2 "$train" $model --checkpoint-dir "$tmp/whole" --save "$tmp/whole.safetensors" >"$tmp/whole.log" 2>&1 ||
  { cat "$tmp/whole.log"; echo "FAIL: the uninterrupted run failed"; exit 1; }
status=0
"$dp_run" -n 2 --max-restarts 1 "$train" $model --checkpoint-dir "$tmp/cut" --die-at-step 6 \
  --save "$tmp/cut.safetensors" >"$tmp/cut.log" 2>&1 || status=$?
fail() { cat "$tmp/cut.log"; echo "FAIL: $1"; exit 1; }
[ "$status" -eq 0 ] || fail "the restarted job exited with $status"
grep -q "rank 1 exits after step 6" "$tmp/cut.log" || fail "rank 1 did not die"
grep -q "restarting the job (restart 1 of 1)" "$tmp/cut.log" || fail "dp-run did not restart the job"
grep -q "resuming from $tmp/cut/step-4.safetensors: step 5 on" "$tmp/cut.log" || fail "the second run did not resume at step 5"
cmp "$tmp/whole.safetensors" "$tmp/cut.safetensors" || fail "the restarted run's model differs from the uninterrupted one's"

# Another world size: 2 ranks save steps 4 and 8 of 8, 3 ranks go on to 12.
"$dp_run" -n 2 "$train" --ddp --steps 8 --batch 66 --width 32 --layers 3 --checkpoint-every 4 \
  --checkpoint-dir "$tmp/resized" >"$tmp/two.log" 2>&1 || { cat "$tmp/two.log"; echo "FAIL: 2 ranks"; exit 1; }
"$dp_run" -n 3 "$train" $model --checkpoint-dir "$tmp/resized" >"$tmp/three.log" 2>&1 ||
  { cat "$tmp/three.log"; echo "FAIL: 3 ranks from the save of 2"; exit 1; }
grep -q "resuming from $tmp/resized/step-8.safetensors: step 9 on" "$tmp/three.log" ||
  { cat "$tmp/three.log"; echo "FAIL: 3 ranks did not resume at step 9"; exit 1; }
grep -q "parity with single-process training.*: OK" "$tmp/three.log" ||
  { cat "$tmp/three.log"; echo "FAIL: no parity after resuming at another world size"; exit 1; }
echo "restart and resume: OK"
