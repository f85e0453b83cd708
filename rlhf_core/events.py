"""Structured events from a stage job to whoever launched it: JSON lines appended to one file.

The launcher (a Prefect task, a test) sets ``RLHF_EVENTS_FILE`` in the job's environment; the job's driver and its
rank-0 workers append one JSON object per line. Progress and results travel this way, never as text parsed out of
the logs, so log wording can change freely. Without the variable every ``emit`` is a no-op.

Events (``event`` field):

- ``step``:   ``stage``, ``step`` (1-based), ``total``, ``metrics`` (floats) -- one optimizer/PPO step done.
- ``resumed``: ``stage``, ``step`` -- the stage continues from its checkpoint of that step.
- ``result``: ``stage``, ``ref`` (a ``CheckpointRef`` as a dict) -- the stage committed its output.

Each line is written with one ``write`` on a file opened in append mode, so lines from several processes on one
machine do not interleave.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

EVENTS_ENV = "RLHF_EVENTS_FILE"


def events_path() -> str | None:
    return os.environ.get(EVENTS_ENV) or None


def emit(event: str, **fields: Any) -> None:
    """Append ``{"event": event, "time": ..., **fields}`` to the events file, when one is configured."""
    path = events_path()
    if path is None:
        return
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        # A rank-0 worker on another node of a cluster: the launcher's folder is not there. Its step events are
        # lost (the driver's result event still arrives); the job must not fail over progress reporting.
        return
    line = json.dumps({"event": event, "time": time.time(), **fields}, default=_plain) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)


def step(stage: str, step: int, total: int, metrics: dict[str, Any] | None = None) -> None:
    emit("step", stage=stage, step=int(step), total=int(total), metrics=_floats(metrics or {}))


def resumed(stage: str, step: int) -> None:
    emit("resumed", stage=stage, step=int(step))


def result(stage: str, ref: dict) -> None:
    emit("result", stage=stage, ref=ref)


def read_new(path: str | Path, offset: int) -> tuple[list[dict], int]:
    """Complete event lines after byte ``offset`` and the offset after the last complete one (a line still being
    written is left for the next call)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    events = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
    return events, offset + end


def _floats(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for k, v in metrics.items()}


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return str(value)
