#!/bin/sh
# dp-perf across 2 ranks next to the anchors, interleaved, in one run:
# torch.distributed + gloo and libgloo used directly (../shared/anchors).
#   bench/dist_vs_anchors.sh BUILD_DIR ANCHORS_DIR [rounds=2]
set -eu
build=$1
anchors=$2
rounds=${3:-2}
[ -x "$anchors/build/gloo_coll" ] || make -s -C "$anchors" build/gloo_coll
i=1
while [ "$i" -le "$rounds" ]; do
  echo "== round $i: dparallel (dp-run -n 2 dp-perf-dist all_reduce -b 4K -e 64M -f 4)"
  "$build/tools/dp-run" -n 2 "$build/bench/dp-perf-dist" all_reduce -b 4K -e 64M -f 4
  echo "== round $i: torch.distributed + gloo"
  /usr/bin/python3 "$anchors/src/torch_gloo_coll.py" --sizes 4K,64K,1M,16M,64M --bcast-sizes ''
  echo "== round $i: gloo directly"
  (cd "$anchors" && SKIP_BUILD=1 ./4_gloo.sh 21 4K,64K,1M,16M,64M '')
  i=$((i + 1))
done
