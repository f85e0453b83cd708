"""Run one stage job as a child process that Prefect can time out, cancel and retry without leaving anything behind.

The job (``python -m rlhf_core.jobs.<kind> --stage <name>``) starts in its own session; its output (Ray workers'
logs included: Ray forwards them to the driver) streams line by line into the Prefect run log. Progress and the
result come as structured events (``rlhf_core.events``: JSON lines in a file named by ``RLHF_EVENTS_FILE``), never
from the log text: ``step`` events move a progress callback, the ``result`` event carries the stage's reference.

On a timeout, a failure of this process, cancellation (Prefect raises in the flow's main thread) or a crash hook,
the whole process tree is stopped: SIGTERM, then SIGKILL after a grace period, found through the process tree
(psutil) and the job's process group, so Ray's GCS, raylet, workers and vLLM engines go too.
Every launch is recorded under ``<run_uri>/_launches/``, which is how tests count them.

``shared_ray``: one Ray for a flow run's jobs (the flow's ``shared_ray`` parameter), a local head that each job joins
through ``RAY_ADDRESS`` instead of starting a Ray of its own; the head is stopped by pid when the run ends, by the
same hooks as the jobs, and by its guard process (``tasks._procs.guard_head``) when the flow's process dies.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from rlhf_core import run_layout
from rlhf_core.config import PipelineConfig
from rlhf_core.events import EVENTS_ENV, read_new
from rlhf_core.jobs.process import ORCHESTRATOR_ENV
from rlhf_core.ports import free_port
from rlhf_core.storage import ObjectStore
from tasks._procs import GUARD_HEAD, kill_tree, stop_head

ROOT = Path(__file__).resolve().parent.parent
_LIVE: dict[int, subprocess.Popen] = {}  # job pid -> process, for the cancellation and crash hooks
_HEADS: dict[int, tuple[subprocess.Popen, Path]] = {}  # ray_head pid -> (process, temp dir), for the same hooks


class StageJobError(RuntimeError):
    """The stage job exited with an error; the message carries its last output lines."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code

    @property
    def bad_input(self) -> bool:
        """Exit status 2: the job refused its config or data before starting work; a retry cannot help."""
        return self.exit_code == 2


def kill_all_jobs() -> None:
    """Stop every job this process launched, and the Ray heads it started for them (Prefect on_cancellation /
    on_crashed hooks call it)."""
    for pid in list(_LIVE):
        kill_tree(pid)
        _LIVE.pop(pid, None)
    for pid in list(_HEADS):
        _stop_head(pid)


# ---------------------------------------------------------------------------------------------------------------------
# One Ray for a flow run's stage jobs


# The environment of a shared head and of the jobs that join it: Ray's token authentication off (a job would need
# the head's token), loopback addresses.
HEAD_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


@contextlib.contextmanager
def ray_head(cpus: float | None = None, timeout_s: float = 180, attempts: int = 2) -> Iterator[str]:
    """A one-node Ray cluster on this machine for the stage jobs of one run, its address yielded once it is up: a
    ``ray start --head --block`` in a session of its own, on loopback, with its own temp dir and free ports (other
    Rays on the machine are left alone), CPUs as a job's own local Ray would get (the machine's, at least
    ``cpus``), GPUs detected. Stopped by pid when the context ends (never ``ray stop``, which stops every Ray of the
    machine), by ``kill_all_jobs``, and by its guard (``guard_head``) when this process is gone without either.

    A head that exits or is not up within ``timeout_s`` is stopped and started again, on new ports and a new temp dir
    (Ray picks some of its own ports, which another process may take first), up to ``attempts`` times; the error
    then carries the last start's log."""
    for attempt in range(1, attempts + 1):
        try:
            pid, address = _start_head(cpus, timeout_s)
        except RuntimeError as e:
            if attempt == attempts:
                raise
            print(f"{e}\nstarting the run's Ray head again ({attempt + 1}/{attempts})", file=sys.stderr, flush=True)
            continue
        try:
            yield address
        finally:
            _stop_head(pid)
        return


def _start_head(cpus: float | None, timeout_s: float) -> tuple[int, str]:
    """Start one ``ray_head`` and wait until it is up: (the guard's pid, the head's address). One that exits or is
    not up within ``timeout_s`` is stopped, and a RuntimeError carries the tail of its log."""
    temp = Path(tempfile.mkdtemp(prefix="rlhf-ray-", dir="/tmp"))  # short: Ray's socket paths have a length limit
    port = free_port("127.0.0.1")
    ports = [
        f"--{name}={free_port('127.0.0.1')}"
        for name in (
            "dashboard-port",
            "ray-client-server-port",
            "dashboard-agent-listen-port",
            "dashboard-agent-grpc-port",
            "runtime-env-agent-port",
            "metrics-export-port",
        )
    ]
    n = int(-(-max(float(os.cpu_count() or 1), cpus or 1) // 1))
    cmd = [
        str(Path(sys.executable).with_name("ray")),
        "start",
        "--head",
        "--block",
        f"--port={port}",
        "--node-ip-address=127.0.0.1",
        f"--num-cpus={n}",
        "--include-dashboard=false",
        f"--temp-dir={temp}",
        "--disable-usage-stats",
        *ports,
    ]
    log = temp / "ray-start.log"
    guard = [sys.executable, "-m", "tasks._procs", GUARD_HEAD, str(os.getpid()), str(temp), "--", *cmd]
    with open(log, "w") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            guard,
            cwd=ROOT,
            env={**os.environ, **HEAD_ENV},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    _HEADS[proc.pid] = (proc, temp)
    deadline = time.time() + timeout_s
    try:
        while "Ray runtime started" not in log.read_text():  # printed once GCS, raylet and agents are up
            if proc.poll() is not None or time.time() > deadline:
                why = (
                    f"exited with status {proc.returncode}"
                    if proc.poll() is not None
                    else f"not up in {timeout_s:g} s"
                )
                # the log is read here, before the stop removes the temp dir
                raise RuntimeError(
                    f"the run's Ray head did not start ({why}; {' '.join(cmd)}):\n{log.read_text()[-3000:]}"
                )
            time.sleep(0.2)
    except BaseException:
        _stop_head(proc.pid)
        raise
    return proc.pid, f"127.0.0.1:{port}"


def _stop_head(pid: int) -> None:
    """Stop a head that ``ray_head`` started: its guard's session (``ray start``, GCS, raylet, workers) and what is
    left of its cluster (``tasks._procs.stop_head``)."""
    entry = _HEADS.pop(pid, None)
    if entry is None:
        return
    proc, temp = entry
    stop_head(pid, temp)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


@contextlib.contextmanager
def shared_ray(cfg: PipelineConfig, stages: list[str]) -> Iterator[str | None]:
    """One Ray for the stage jobs of a flow run: a ``ray_head`` sized for the largest of ``stages`` (the CPUs its
    job would give its own local Ray), whose address every job launched inside gets (``RAY_ADDRESS``, so
    ``launcher.init_ray`` connects instead of starting a Ray: seconds per stage). Yields the address; None, with
    nothing started, when ``RAY_ADDRESS`` is set already (the jobs join that cluster) or no stage uses Ray."""
    from rlhf_core.jobs.stage_setup import ray_cpus

    cpus = [c for c in (ray_cpus(cfg.stage(name)) for name in stages) if c is not None]
    if os.environ.get("RAY_ADDRESS") or not cpus:
        yield None
        return
    with ray_head(max(cpus)) as address, environ(RAY_ADDRESS=address, **HEAD_ENV):
        yield address  # launch_stage hands its environment to each job


@contextlib.contextmanager
def environ(**values: str) -> Iterator[None]:
    """This process's environment with ``values`` set, restored after (unset names unset again)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def launch_stage(
    stage: str,
    module: str,
    config_path: str,
    store: ObjectStore,
    log: Callable[[str], None],
    on_event: Callable[[dict], None] | None = None,
    timeout_s: float | None = None,
    env: dict[str, str] | None = None,
) -> dict:
    """Run stage instance ``stage`` (``python -m <module> --stage <stage>`` on the resolved config file) and return
    the CheckpointRef dict of its ``result`` event. ``on_event`` gets the stage's other events (``step``,
    ``resumed``) as the job writes them, in the launcher's watcher thread."""
    events_file = Path(tempfile.mkstemp(prefix=f"{stage}-events-", suffix=".jsonl")[1])
    cmd = [sys.executable, "-m", module, "--config", config_path, "--stage", stage]
    # RAY_COLOR_PREFIX=0: the workers' lines reach the run log and the terminal without ANSI colour codes
    child_env = {
        **os.environ,
        **(env or {}),
        "PYTHONUNBUFFERED": "1",
        "RAY_DEDUP_LOGS": "0",
        "RAY_COLOR_PREFIX": "0",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        EVENTS_ENV: str(events_file),
        ORCHESTRATOR_ENV: str(os.getpid()),
    }
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=child_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,
    )
    _LIVE[proc.pid] = proc
    store.write_json(run_layout.launch(stage, time.time_ns()), {"stage": stage, "pid": proc.pid, "time": time.time()})
    tail: list[str] = []
    results: list[dict] = []
    finished = threading.Event()
    reader = threading.Thread(target=_pump, args=(proc, log, tail), daemon=True)
    watcher = threading.Thread(target=_watch, args=(events_file, stage, on_event, results, finished), daemon=True)
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


def _watch(path: Path, stage: str, on_event, results: list[dict], finished: threading.Event, poll_s: float = 0.5):
    """Follow the events file until the job has ended: the ``result`` event kept, the others passed on. A
    callback that fails (e.g. the Prefect API it reports to is unreachable from this thread) is dropped
    with a warning: the result must still be read, or a finished job would count as failed and be retried."""
    offset = 0
    while True:
        done = finished.is_set()  # read once more after the job ended, then stop
        new, offset = read_new(path, offset)
        for event in new:
            if event.get("stage") != stage:
                continue
            if event["event"] == "result":
                results.append(event["ref"])
            elif on_event is not None:
                try:
                    on_event(event)
                except Exception as e:  # progress is best effort
                    print(f"warning: the {stage} job's progress is no longer reported ({e!r})", file=sys.stderr)
                    on_event = None
        if done:
            return
        finished.wait(poll_s)
