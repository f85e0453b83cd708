"""Run one stage job as a child process that Prefect can time out, cancel and retry without leaving anything behind.

The job (``python -m rlhf_core.jobs.<kind> --stage <name>``) starts in its own session; its output (Ray workers'
logs included: Ray forwards them to the driver) streams line by line into the Prefect run log. Progress and the
result come as structured events (``rlhf_core.events``: JSON lines in a file named by ``RLHF_EVENTS_FILE``), never
from the log text: ``step`` events move a progress callback, the ``result`` event carries the stage's reference.

On a timeout, a failure of this process, cancellation (Prefect raises in the flow's main thread) or a crash hook,
the whole process tree is stopped: SIGTERM, then SIGKILL after a grace period, found through the process tree
(psutil) and the job's process group, so Ray's GCS, raylet, workers and vLLM engines go too.
Every launch is recorded under ``<run_uri>/_launches/``, which is how tests count them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from rlhf_core.events import EVENTS_ENV, read_new
from rlhf_core.storage import ObjectStore

ROOT = Path(__file__).resolve().parent.parent
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
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(sig)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, sig)


def kill_all_jobs() -> None:
    """Stop every job this process launched (Prefect on_cancellation / on_crashed hooks call it)."""
    for pid in list(_LIVE):
        kill_tree(pid)
        _LIVE.pop(pid, None)


def launch_stage(
    stage: str,
    module: str,
    config_path: str,
    store: ObjectStore,
    log: Callable[[str], None],
    on_step: Callable[[int, int], None] | None = None,
    timeout_s: float | None = None,
    env: dict[str, str] | None = None,
) -> dict:
    """Run stage instance ``stage`` (``python -m <module> --stage <stage>`` on the resolved config file) and return
    the CheckpointRef dict of its ``result`` event."""
    events_file = Path(tempfile.mkstemp(prefix=f"{stage}-events-", suffix=".jsonl")[1])
    cmd = [sys.executable, "-m", module, "--config", config_path, "--stage", stage]
    child_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1", "RAY_DEDUP_LOGS": "0",
                 "HF_HUB_DISABLE_PROGRESS_BARS": "1", EVENTS_ENV: str(events_file)}  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
        start_new_session=True,
    )  # fmt: skip
    _LIVE[proc.pid] = proc
    store.write_json(
        f"_launches/{stage}-{time.time_ns()}.json", {"stage": stage, "pid": proc.pid, "time": time.time()}
    )
    tail: list[str] = []
    results: list[dict] = []
    finished = threading.Event()
    reader = threading.Thread(target=_pump, args=(proc, log, tail), daemon=True)
    watcher = threading.Thread(target=_watch, args=(events_file, stage, on_step, results, finished), daemon=True)
    reader.start()
    watcher.start()
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
        finished.set()
        watcher.join(timeout=10)
        events_file.unlink(missing_ok=True)
    if code != 0:
        # The job is gone, but a crash can leave its Ray processes behind: stop whatever remains of its group.
        kill_tree(proc.pid, grace_s=2)
        raise StageJobError(f"the {stage} job failed (exit code {code}):\n" + "\n".join(tail[-15:]), code)
    if not results:
        raise StageJobError(f"the {stage} job exited 0 without a result event", code)
    return results[-1]


def _pump(proc: subprocess.Popen, log: Callable[[str], None], tail: list[str]) -> None:
    """The job's output into the run log, and the last lines kept for the error message."""
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        if not line.strip():
            continue
        log(line)
        tail.append(line)
        del tail[:-50]


def _watch(path: Path, stage: str, on_step, results: list[dict], finished: threading.Event, poll_s: float = 0.5):
    """Follow the events file until the job has ended: progress from ``step`` events, the ``result`` event kept."""
    offset = 0
    while True:
        done = finished.is_set()  # read once more after the job ended, then stop
        new, offset = read_new(path, offset)
        for event in new:
            if event.get("stage") != stage:
                continue
            if event["event"] == "step" and on_step is not None:
                on_step(int(event["step"]), int(event["total"]))
            elif event["event"] == "result":
                results.append(event["ref"])
        if done:
            return
        finished.wait(poll_s)
