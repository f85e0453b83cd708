"""Run one stage job as a child process that Prefect can time out, cancel and retry without leaving anything behind.

The job (``python -m rlhf_core.jobs.<stage>``) starts in its own session; its output (Ray workers' logs included:
Ray forwards them to the driver) streams line by line into the Prefect run log, and ``[stage] step k/N`` lines
move a progress callback. On a timeout, a failure of this process, cancellation (Prefect raises in the flow's main
thread) or a crash hook, the whole process tree is stopped: SIGTERM, then SIGKILL after a grace period, found
through the process tree (psutil) and the job's process group, so Ray's GCS, raylet, workers and vLLM engines go
too. Every launch is recorded under ``<run_uri>/_launches/``, which is how tests count them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import psutil

from rlhf_core.storage import ObjectStore

ROOT = Path(__file__).resolve().parent.parent
STEP_LINE = re.compile(r"\[(\w+)\] step (\d+)/(\d+)")
_LIVE: dict[int, subprocess.Popen] = {}  # job pid -> process, for the cancellation and crash hooks


class StageJobError(RuntimeError):
    """The stage job exited with an error; the message carries its last output lines."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code

    @property
    def bad_input(self) -> bool:
        """Exit status 2: the job refused its config or data before starting work; a retry cannot help."""
        return self.exit_code == 2


def kill_tree(pid: int, grace_s: float = 10.0) -> list[int]:
    """Stop ``pid`` and all its descendants (and its process group); returns the pids that were alive."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    _signal(procs, pid, signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    _signal(alive, pid, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=5)
    return [p.pid for p in procs]


def _signal(procs: list[psutil.Process], group: int, sig: int) -> None:
    """Send ``sig`` to each process and to the process group ``group`` (the job's session)."""
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(group, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_all_jobs() -> None:
    """Stop every job this process launched (Prefect on_cancellation / on_crashed hooks call it)."""
    for pid in list(_LIVE):
        kill_tree(pid)
        _LIVE.pop(pid, None)


def launch_stage(
    stage: str,
    config_path: str,
    store: ObjectStore,
    log: Callable[[str], None],
    on_step: Callable[[int, int], None] | None = None,
    timeout_s: float | None = None,
    env: dict[str, str] | None = None,
) -> dict:
    """Run the ``stage`` job on the resolved config file and return its CheckpointRef as a dict."""
    ref_file = Path(tempfile.mkstemp(prefix=f"{stage}-ref-", suffix=".json")[1])
    cmd = [sys.executable, "-m", f"rlhf_core.jobs.{stage}", "--config", config_path, "--ref-out", str(ref_file)]
    child_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1", "RAY_DEDUP_LOGS": "0",
                 "HF_HUB_DISABLE_PROGRESS_BARS": "1"}  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
        start_new_session=True,
    )  # fmt: skip
    _LIVE[proc.pid] = proc
    store.write_json(f"_launches/{stage}-{time.time_ns()}.json", {"stage": stage, "pid": proc.pid, "time": time.time()})
    tail: list[str] = []
    reader = threading.Thread(target=_pump, args=(proc, stage, log, on_step, tail), daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        raise TimeoutError(f"the {stage} job ran past {timeout_s:.0f} s and was stopped") from None
    except BaseException:  # cancellation, KeyboardInterrupt, Prefect's termination signal
        kill_tree(proc.pid)
        raise
    finally:
        _LIVE.pop(proc.pid, None)
        reader.join(timeout=10)
    if code != 0:
        # The job is gone, but a crash can leave its Ray processes behind: stop whatever remains of its group.
        kill_tree(proc.pid, grace_s=2)
        raise StageJobError(f"the {stage} job failed (exit code {code}):\n" + "\n".join(tail[-15:]), code)
    ref = json.loads(ref_file.read_text())
    ref_file.unlink(missing_ok=True)
    return ref


def _pump(proc: subprocess.Popen, stage: str, log, on_step, tail: list[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        if not line.strip():
            continue
        log(line)
        tail.append(line)
        del tail[:-50]
        match = STEP_LINE.search(line)
        if match and match.group(1) == stage and on_step is not None:
            on_step(int(match.group(2)), int(match.group(3)))
