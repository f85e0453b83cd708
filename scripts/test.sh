#!/usr/bin/env bash
# The test suite as two pytest processes side by side (make test, make test-all):
#
#     scripts/test.sh [PYTEST ARG ...]
#
# Most of a real-engine test is start-up (a job process, its Ray, actors that import torch and DeepSpeed, a vLLM
# engine), one process after another: one core busy, the other idle. Two streams keep both cores at work:
#   1: the flows (a Prefect server, flow runs, their jobs) and the top-level tests;
#   2: everything else (the jobs, the distributed layer, the models, the config keys, bad input, the math); a new
#      test folder lands here.
# Each is about half of the suite's time. Their session fixtures are their own (each its Ray, its S3 server; the
# flows' Prefect server is the first one's), so no fixture is made twice. Lines are prefixed with their stream, and
# each stream ends with its own summary and slowest tests. The exit status is the first failing stream's, else 0.
# Given a test path (make test ARGS=tests/test_config.py), the arguments go to one pytest process unchanged.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTEST=(.venv/bin/python -m pytest)

for arg in "$@"; do
  if [[ $arg != -* && -e ${arg%%::*} ]]; then
    exec "${PYTEST[@]}" "$@"
  fi
done

FIRST=(tests/flows tests/test_*.py)
SECOND=(tests --ignore=tests/flows "--ignore-glob=$PWD/tests/test_*.py")

stream() {  # TAG PYTEST_ARG ...: one pytest process, its lines prefixed with [TAG]
  local tag=$1
  shift
  # The prefixer ignores SIGINT: on a time limit's SIGINT (scripts/time_limit.sh) pytest still prints its summary.
  "${PYTEST[@]}" "$@" 2>&1 | (trap '' INT && exec sed -u "s/^/[$tag] /")
  return "${PIPESTATUS[0]}"
}

finish() {  # PID: its exit status, waiting again when a signal cut the wait short
  while kill -0 "$1" 2>/dev/null; do
    wait "$1"
  done
  wait "$1"
}

trap ':' INT  # the streams get it too (one process group) and stop with their summaries; this script waits for them
stream 1 "${FIRST[@]}" "$@" &
first=$!
stream 2 "${SECOND[@]}" "$@" &
second=$!
finish "$first"
status=$?
finish "$second"
status2=$?
# 5: pytest selected no test (a -k or -m that only the other stream matches); a failure only when both say so
if [ "$status" -eq 5 ] && [ "$status2" -ne 5 ]; then status=0; fi
if [ "$status2" -eq 5 ] && [ "$status" -eq 0 ]; then status2=0; fi
[ "$status" -ne 0 ] || status=$status2
exit "$status"
