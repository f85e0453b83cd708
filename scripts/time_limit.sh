#!/usr/bin/env bash
# Run a command under a wall-clock limit, and fail with a clear message when it runs past it.
#
#     scripts/time_limit.sh SECONDS WHAT COMMAND [ARG ...]
#
# Past SECONDS the command's process group gets SIGINT (pytest then stops and still prints its summary and the
# slowest tests), SIGKILL 60 s later; this script then exits 1 naming WHAT and the limit. Otherwise it exits with the
# command's own status. .ci/run puts `make test` under it, so that a change that makes the suite slow fails in CI
# with that message instead of running into CI's hard stop.
set -uo pipefail
if [ $# -lt 3 ] || ! [[ $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 SECONDS WHAT COMMAND [ARG ...]" >&2
  exit 2
fi
limit=$1 what=$2
shift 2
start=$SECONDS
timeout --signal=INT --kill-after=60 "$limit" "$@"
status=$?
elapsed=$((SECONDS - start))
if [ $status -eq 124 ] || { [ $status -eq 137 ] && [ $elapsed -ge "$limit" ]; }; then
  echo "time limit: '$what' ran past its limit of ${limit} s ($((limit / 60)) min) and was stopped after" \
    "${elapsed} s; the slowest tests are listed above" >&2
  exit 1
fi
exit $status
