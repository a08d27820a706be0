#!/bin/sh
# Installs the build into a fresh prefix and runs the installed programs with
# LD_LIBRARY_PATH unset: each must find libdparallel through its RUNPATH.
#   tools/tests/installed_programs_run.sh CMAKE BUILD_DIR BINDIR PROGRAM...
set -eu
cmake=$1
build=$2
bindir=$3
shift 3
prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT
"$cmake" --install "$build" --prefix "$prefix" >/dev/null
bin="$prefix/$bindir"
run() {
  echo "== $*"
  env -u LD_LIBRARY_PATH timeout -s KILL 60 "$@"
}
for program in "$@"; do
  case "$program" in
    dp-run) run "$bin/dp-run" -n 2 sh -c 'echo rank $RANK of $WORLD_SIZE' ;;
    dp-perf)
      # One size, checked element by element; across two ranks under the installed launcher too.
      run "$bin/dp-perf" broadcast -b 4K -e 4K -s 1 -w 0
      if [ -x "$bin/dp-run" ]; then
        run "$bin/dp-run" -n 2 "$bin/dp-perf" all_reduce -b 4K -e 4K -s 1 -n 1
      fi
      ;;
    *) echo "error: no check for $program" >&2; exit 2 ;;
  esac
done
echo "installed programs run without LD_LIBRARY_PATH"
