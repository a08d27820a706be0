#!/bin/sh
# Runs a program and passes when it exits with CODE and its output (stdout
# and stderr) has a line matching the extended regular expression REGEX.
#   tools/tests/expect_exit.sh CODE REGEX PROGRAM [ARGS...]
# A program still running after 60 s is killed and fails the check.
set -u
[ $# -ge 3 ] || { echo "usage: expect_exit.sh CODE REGEX PROGRAM [ARGS...]" >&2; exit 2; }
want=$1
regex=$2
shift 2
out=$(timeout -s KILL 60 "$@" 2>&1)
got=$?
if [ "$got" -ne "$want" ] || ! printf '%s\n' "$out" | grep -q -E -e "$regex"; then
  printf '%s\n' "$out" | tail -n 40
  echo "FAIL: '$*' exited with $got (want $want); output matching '$regex': $(printf '%s\n' "$out" | grep -c -E -e "$regex")" >&2
  exit 1
fi
echo "ok: exit $got, output matches '$regex'"
