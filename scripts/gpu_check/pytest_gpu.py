"""``pytest_gpu``: ``python -m pytest tests/gpu`` (these checks as tests, on smaller models) in a subprocess with a
time limit, without the rest of the test suite's conftest (no Ray, no Prefect needed) and without third-party
plugins: passed/failed/skipped counts. On the dry run those tests skip themselves (no CUDA): the check is then
reported skipped, with the counts, and fails if any test failed or did not import."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from typing import Any

from .common import ROOT, Ctx, emit, run_check, wait_s

PYTEST_GPU = [
    "-m",
    "pytest",
    "tests/gpu",
    "-q",
    "-p",
    "no:cacheprovider",
    "--confcutdir=tests/gpu",  # tests/conftest.py (its S3 server plugin, Ray fixtures) is not loaded
    "-W",
    "ignore::pytest.PytestConfigWarning",  # the project's pytest-timeout setting, with plugins not autoloaded
]


def pytest_counts(output: str) -> dict[str, int]:
    """The counts of pytest's last summary line (``3 passed, 1 skipped in 2.0s``)."""
    lines = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|errors?)\b", line)]
    counts = dict.fromkeys(("passed", "failed", "skipped", "errors"), 0)
    for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)\b", lines[-1] if lines else ""):
        key = "errors" if what.startswith("error") else what
        counts[key] = counts.get(key, 0) + int(n)
    return counts


def _kill_tree(proc: subprocess.Popen) -> None:
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
    proc.kill()


def check_pytest_gpu(device: str, limit_s: float) -> dict:
    """``python -m pytest tests/gpu`` with this Python (plugins not autoloaded: an image's own pytest plugins stay
    out), killed with its children after ``limit_s``."""
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, *PYTEST_GPU], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        output, _ = proc.communicate(timeout=limit_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        output, _ = proc.communicate()
        timed_out = True
    seconds = time.perf_counter() - start
    print(output, file=sys.stderr, flush=True)
    counts = pytest_counts(output)
    last = next((line for line in reversed(output.splitlines()) if line.strip()), "")
    record: dict[str, Any] = {
        "check": "pytest_gpu",
        "command": "python " + " ".join(PYTEST_GPU),
        "returncode": proc.returncode,
        "tests_passed": counts["passed"],
        "tests_failed": counts["failed"],
        "tests_skipped": counts["skipped"],
        "tests_errors": counts["errors"],
        "seconds": round(seconds, 1),
        "last_line": last[-300:],
    }
    clean = not timed_out and proc.returncode == 0 and counts["failed"] == counts["errors"] == 0
    if device != "cuda" and clean and counts["skipped"] > 0 and counts["passed"] == 0:
        record.update(ok=None, skipped=f"tests/gpu needs CUDA: its {counts['skipped']} tests skipped themselves")
    else:
        record["ok"] = clean and counts["passed"] > 0
        if timed_out:
            record["reason"] = f"pytest timed out after {limit_s:.0f} s"
        elif not record["ok"]:
            record["reason"] = f"pytest: {last[-300:]}"
    return emit(record)


def run(c: Ctx) -> None:
    run_check("pytest_gpu", check_pytest_gpu, c.device, wait_s(c))
