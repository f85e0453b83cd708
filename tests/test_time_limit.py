"""The CI time guard (scripts/time_limit.sh): a run past its limit is stopped and fails with one clear message, and
pytest still prints where the time went; a run within it keeps its own exit status."""

import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT

GUARD = ROOT / "scripts" / "time_limit.sh"

SLOW_SUITE = """
import time

def test_quick():
    pass

def test_deliberately_slow():
    time.sleep(60)
"""


def guard(limit_s: int, *command: str, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(GUARD), str(limit_s), "the suite", *command], cwd=cwd, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow  # a pytest run held past its limit
def test_a_deliberately_slowed_run_is_stopped_and_fails_with_the_limit_named(tmp_path):
    (tmp_path / "test_slow.py").write_text(SLOW_SUITE)
    start = time.monotonic()
    out = guard(
        8, sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--durations=5", str(tmp_path), cwd=tmp_path
    )
    assert time.monotonic() - start < 40  # stopped at the limit, not after the 60 s sleep
    assert out.returncode == 1
    message = [line for line in out.stderr.splitlines() if line.startswith("time limit:")]
    assert message == [message[0]] and "'the suite' ran past its limit of 8 s" in message[0]
    assert "slowest 5 durations" in out.stdout and "KeyboardInterrupt" in out.stdout  # pytest's summary still printed


def test_a_run_within_the_limit_keeps_its_exit_status():
    assert guard(30, "true").returncode == 0
    failed = guard(30, "bash", "-c", "exit 3")
    assert failed.returncode == 3 and "time limit" not in failed.stderr


def test_a_limit_that_is_not_a_positive_number_of_seconds_is_refused():
    for limit in ("0", "soon", "-5"):  # timeout(1) would read 0 as "no limit"
        out = subprocess.run([str(GUARD), limit, "the suite", "true"], capture_output=True, text=True)
        assert out.returncode == 2 and out.stderr.startswith("usage:")
