"""Stopping process trees: a stage job with everything it started, a flow run's Ray head. Standard library and psutil
only, so that the head's guard (``python -m tasks._procs guard-head``) starts at once."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

GUARD_HEAD = "guard-head"  # the guard's command word: ``python -m tasks._procs guard-head PARENT TEMP -- CMD...``

# A Ray head's own stop (GCS and raylet draining on SIGTERM) takes over 10 s; what it holds is the finished run's, so
# after this grace its processes are killed.
HEAD_GRACE_S = 2.0


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


def stop_head(pid: int, temp: Path) -> None:
    """Stop a Ray head (the guard or ``ray start`` at ``pid``, with its session) after ``HEAD_GRACE_S``, then kill
    what is left of its cluster, the processes whose command line names its temp dir, and remove that dir."""
    kill_tree(pid, grace_s=HEAD_GRACE_S)
    for p in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(str(temp) in part for part in p.info["cmdline"] or []):
                p.kill()
    shutil.rmtree(temp, ignore_errors=True)


def head_guards(parent: int) -> list[psutil.Process]:
    """The Ray-head guards that process ``parent`` started (a flow run's ``shared_ray``)."""
    return [p for p in psutil.Process(parent).children() if GUARD_HEAD in p.cmdline()]


def guard_head(parent: int, temp: Path, cmd: list[str], poll_s: float = 1.0) -> int:
    """Run a flow run's Ray head (``cmd``, ``ray start --head --block``) as a child of this process and stop it, with
    everything it started, once ``parent`` (the process that runs the flow) is gone. A flow process that dies by
    SIGKILL or with its container runs no hook, and a head left behind would hold its CPUs and its stage jobs'
    workers for good. Stopping this guard's session stops the head with it (``tasks.launch.ray_head``)."""
    head = subprocess.Popen(cmd)
    while head.poll() is None:
        if os.getppid() != parent:  # reparented: the flow's process is gone
            print(f"the process that started this Ray head (pid {parent}) is gone: stopping the head", flush=True)
            stop_head(head.pid, temp)
            return 1
        time.sleep(poll_s)
    return head.returncode


if __name__ == "__main__":  # python -m tasks._procs guard-head PARENT_PID TEMP_DIR -- COMMAND...
    word, parent_pid, temp_dir, _, *command = sys.argv[1:]
    assert word == GUARD_HEAD, sys.argv
    raise SystemExit(guard_head(int(parent_pid), Path(temp_dir), command))
