"""Wall-clock bookkeeping shared by the jobs: when the job's process started, and per-phase seconds of a step.

Plain Python (no torch): the job drivers, the Ray workers and the benchmarks read the same clock. ``job_started()``
is the creation time of the job's process (``python -m rlhf_core.jobs.<kind>``), so a stage's ``startup_s`` counts
the interpreter start and the imports, too, not only what happens after ``main()`` is reached.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psutil

# RLHF_JOB_STARTED: the job process's creation time, handed to the processes it starts (Ray workers), whose own
# creation time is not the job's.
JOB_STARTED_ENV = "RLHF_JOB_STARTED"


def job_started() -> float:
    """Epoch seconds at which this job started: ``RLHF_JOB_STARTED`` when set (inherited by a worker), else this
    process's creation time."""
    value = os.environ.get(JOB_STARTED_ENV)
    if value:
        return float(value)
    return psutil.Process().create_time()


def since_job_start() -> float:
    """Seconds since :func:`job_started`."""
    return time.time() - job_started()


class PhaseTimer:
    """Seconds per named phase, summed when a phase runs more than once; ``as_logs()`` gives ``timing/<phase>_s``
    entries (the names OpenRLHF logs as ``timing/*``) plus ``timing/step_s``, the wall time since the timer was made.

    >>> t = PhaseTimer()
    >>> with t.phase("generation"):
    ...     pass
    >>> sorted(t.as_logs())
    ['timing/generation_s', 'timing/step_s']
    """

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def as_logs(self) -> dict[str, float]:
        logs = {f"timing/{name}_s": s for name, s in self.seconds.items()}
        logs["timing/step_s"] = time.perf_counter() - self.started
        return logs
