"""Wall-clock bookkeeping shared by the jobs: when the job's process started, and per-phase seconds of a step.

Plain Python (no torch): the job drivers, the Ray workers and the benchmarks read the same clock. ``job_started()``
is the creation time of the job's process (``python -m rlhf_core.jobs.<kind>``), so a stage's ``startup_s`` counts
the interpreter start and the imports, too, not only what happens after ``main()`` is reached.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import psutil


def job_started() -> float:
    """Epoch seconds at which this process started (a Ray worker gets its job's through ``StageContext``)."""
    return psutil.Process().create_time()


def since_job_start() -> float:
    """Seconds since :func:`job_started`."""
    return time.time() - job_started()


class PhaseTimer:
    """Seconds per named phase, summed when a phase runs more than once; ``as_logs()`` gives ``timing/<phase>_s``
    entries (the names OpenRLHF logs as ``timing/*``) plus ``timing/step_s``, the wall time since the timer was made.
    ``phases``: names logged even when they did not run (0.0), so that every step logs the same keys, in this order.

    >>> t = PhaseTimer(["generation", "checkpoint"])
    >>> with t.phase("generation"):
    ...     pass
    >>> list(t.as_logs())
    ['timing/generation_s', 'timing/checkpoint_s', 'timing/step_s']
    """

    def __init__(self, phases: Iterable[str] = ()) -> None:
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = dict.fromkeys(phases, 0.0)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def elapsed(self) -> float:
        """Seconds since the timer was made (the step so far)."""
        return time.perf_counter() - self.started

    def as_logs(self) -> dict[str, float]:
        logs = {f"{PREFIX}{name}{SUFFIX}": s for name, s in self.seconds.items()}
        logs[STEP_KEY] = self.elapsed()
        return logs


PREFIX, SUFFIX = "timing/", "_s"
STEP_KEY = f"{PREFIX}step{SUFFIX}"


def phase_of(key: str) -> str | None:
    """``timing/<phase>_s`` -> ``<phase>``; None for any other key."""
    if key.startswith(PREFIX) and key.endswith(SUFFIX):
        return key[len(PREFIX) : -len(SUFFIX)]
    return None


def summarize(history: list[dict]) -> dict[str, float]:
    """Flat totals over the steps of a history (each a dict with ``timing/<phase>_s`` entries):
    ``timing/<phase>_s_mean`` and ``timing/<phase>_s_total`` per phase, in the order the phases were first logged,
    and ``timing/steps``, the steps that logged timing. {} when none did."""
    sums: dict[str, list[float]] = {}
    for entry in history:
        for key, value in entry.items():
            if phase_of(key) is not None:
                sums.setdefault(key, []).append(float(value))
    if not sums:
        return {}
    out: dict[str, float] = {}
    for key, values in sums.items():
        out[f"{key}_mean"] = sum(values) / len(values)
        out[f"{key}_total"] = sum(values)
    out[f"{PREFIX}steps"] = float(len(sums.get(STEP_KEY, next(iter(sums.values())))))
    return out


def phase_rows(metrics: dict) -> list[dict]:
    """One row per phase of a stage's summary (``summarize``'s keys among ``metrics``): phase, mean and total
    seconds per step and the share of the step's mean (phases that run concurrently overlap: their shares can add up
    to more than their enclosing phase's), the longest first; the step itself comes last. [] when ``metrics`` has no
    timing summary."""
    means = {
        name: float(v)
        for k, v in metrics.items()
        if k.endswith("_mean") and (name := phase_of(k[: -len("_mean")])) is not None
    }
    step = means.pop("step", None)
    if step is None:
        return []
    rows = []
    for name, mean in [*sorted(means.items(), key=lambda item: -item[1]), ("step", step)]:
        total = metrics.get(f"{PREFIX}{name}{SUFFIX}_total", mean)
        share = mean / step if step > 0 else 0.0
        rows.append(
            {
                "phase": name,
                "mean_s": round(mean, 3),
                "total_s": round(float(total), 3),
                "share_of_step": round(share, 3),
            }
        )
    return rows
