#!/bin/sh
# Fails, naming the file and the include, when a source includes a folder
# the layer rules of docs/ARCHITECTURE.md ("Layers") forbid.
#   tests/layers_check.sh [source root]
set -eu
root=${1:-$(cd "$(dirname "$0")/.." && pwd)}
cd "$root"

# The rules, as docs/ARCHITECTURE.md states them (the "Layers" table's
# "includes" column and the rules under it); change both together. A line
# names a folder (ending in /) or a file that includes, then what it may
# include: a folder (ending in /: anything under it), `folder/*` (the files
# directly in it, not its subfolders), a file, or `*` (a file beside it,
# no folder). The longest line that holds the including file decides.
# src/ddp/ and src/fsdp/ are siblings on src/lane/: neither lists the other.
rules='
src/core/                   core/
src/device/                 core/ device/
src/comm/                   core/ device/ comm/
src/module/                 core/ comm/ module/
src/parallel/               core/ comm/ module/ parallel/
src/distributed/            core/ comm/ distributed/* distributed/store/
src/distributed/backend_choice.cpp  core/ comm/ distributed/* distributed/store/ distributed/shm/ distributed/gloo/ distributed/nccl/
src/distributed/backend_registry.cpp  core/ comm/ distributed/* distributed/store/ distributed/shm/ distributed/gloo/ distributed/nccl/
src/distributed/store/      core/ distributed/store/
src/distributed/shm/        core/ comm/ distributed/shm/ distributed/backend.h distributed/call_header.h distributed/reduce_ops.h
src/distributed/shm/shm_process_group.h  core/ comm/ distributed/shm/ distributed/backend.h distributed/call_header.h distributed/reduce_ops.h distributed/process_group.h
src/distributed/gloo/       core/ comm/ distributed/gloo/ distributed/backend.h distributed/call_header.h distributed/reduce_ops.h distributed/rendezvous.h
src/distributed/nccl/       core/ comm/ device/cuda/ distributed/nccl/ distributed/backend.h distributed/call_header.h distributed/reduce_ops.h
src/distributed/mpi/        core/ comm/ distributed/mpi/ distributed/backend.h distributed/call_header.h distributed/reduce_ops.h distributed/rendezvous.h
src/lane/                   core/ comm/ module/ distributed/ device/cuda/cuda_runtime.h lane/
src/ddp/                    core/ comm/ module/ distributed/ lane/ ddp/
src/fsdp/                   core/ comm/ module/ distributed/ lane/ fsdp/
capi/                       core/ comm/ module/ parallel/ distributed/ lane/ ddp/ fsdp/ device/cpu/cpu_streams.h dparallel/ capi/
include/dparallel/          dparallel/
bench/                      dparallel/ *
tools/                      dparallel/ *
examples/                   dparallel/ *
bindings/                   dparallel/ *
'

# Edges the code has that the rules above do not allow, each with why it
# stands. A listed edge the code no longer has fails too, so that the list
# stays true.
exceptions='
src/distributed/shm/shm_collectives.cpp distributed/background_calls.h  the barrier asks whether a background thread may spin (a process-wide count, not a backend file)
src/distributed/shm/shm_setup.cpp       distributed/process_group.h     create_shm_process_group makes a whole group, as shm_process_group.h declares it
src/distributed/nccl/nccl_util.h         distributed/collective.h        ReduceOp and CallKind, which the front and the call headers share
'

if [ -d .git ] || [ -f .git ]; then
  files=$(git ls-files include src capi bench tools examples bindings)
else
  files=$(find include src capi bench tools examples bindings -type f)
fi
# shellcheck disable=SC2086 # one path a word
files=$(printf '%s\n' $files | grep -E '\.(c|h|cc|cpp|hpp|cu|cuh)$' || true)
[ -n "$files" ] || { echo "error: no sources under $root" >&2; exit 1; }

# file:line:#include "path" -> file path
# shellcheck disable=SC2086
grep -HE '^[[:space:]]*#[[:space:]]*include[[:space:]]*"' $files |
  sed -E 's/^([^:]*):[[:space:]]*#[[:space:]]*include[[:space:]]*"([^"]*)".*/\1 \2/' |
  awk -v rules="$rules" -v exceptions="$exceptions" '
    function allows(token, inc) {
      if (token == "*") return inc !~ /\//
      if (token ~ /\/\*$/) {
        dir = substr(token, 1, length(token) - 1)
        return index(inc, dir) == 1 && substr(inc, length(dir) + 1) !~ /\//
      }
      if (token ~ /\/$/) return index(inc, token) == 1
      return inc == token
    }
    BEGIN {
      n = split(rules, lines, "\n")
      for (i = 1; i <= n; i++) {
        if (split(lines[i], f, " ") < 2) continue
        key[++nkeys] = f[1]
        allowed[f[1]] = substr(lines[i], index(lines[i], f[1]) + length(f[1]))
        sub(/^[ \t]+/, "", allowed[f[1]])
      }
      n = split(exceptions, lines, "\n")
      for (i = 1; i <= n; i++) {
        if (split(lines[i], f, " ") < 3) continue
        excepted[f[1] " " f[2]] = 1
        unused[f[1] " " f[2]] = 1
      }
    }
    {
      file = $1; inc = $2; best = ""
      for (i = 1; i <= nkeys; i++) {
        k = key[i]
        if ((k ~ /\/$/ ? index(file, k) == 1 : file == k) && length(k) > length(best)) best = k
      }
      if (best == "") next  # outside the layered folders
      ok = 0
      m = split(allowed[best], tokens, " ")
      for (j = 1; j <= m; j++) if (allows(tokens[j], inc)) ok = 1
      if (ok) next
      if ((file " " inc) in excepted) { delete unused[file " " inc]; next }
      printf "%s includes \"%s\": the layer rules for %s allow only %s\n", file, inc, best, allowed[best]
      bad++
    }
    END {
      for (e in unused) {
        printf "listed exception no longer in the code (remove it): %s\n", e
        bad++
      }
      if (bad) {
        print "see docs/ARCHITECTURE.md, \"Layers\"; tests/layers_check.sh holds the rules as a table"
        exit 1
      }
      print NR " includes follow the layer rules"
    }'
