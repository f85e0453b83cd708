"""The curves artifact of a stage task: the stage's per-step metrics as a figure in the Prefect UI, redrawn while the
job runs and drawn once more, from the job's complete ``metrics.json``, when it ends.

The job's ``step`` events reach the launcher's watcher thread; each one adds a point. The artifact (markdown with
the figure inline, ``<stage>-curves``) is created again, as a new version of the same key, once two steps are
logged and then at most every ``RLHF_CURVES_EVERY_S`` seconds (default 10; drawing takes a second or two here),
except at the last step, whose picture is the final version's.
Each new live version deletes the one before it, so a long stage keeps two versions of ~100 KB in Prefect's
database, not thousands: the newest live one and, once the stage has ended, the final one.
"""

from __future__ import annotations

import contextvars
import os
import sys
import time
from typing import Any

from prefect.artifacts import create_markdown_artifact
from prefect.client.orchestration import get_client

from rlhf_core import curves, run_layout
from rlhf_core.storage import ObjectStore

EVERY_ENV = "RLHF_CURVES_EVERY_S"
DEFAULT_EVERY_S = 10.0


class LiveCurves:
    """Collects one stage's step events and publishes its curves artifact (``add`` from the watcher thread,
    ``finish`` from the task's thread once the job has ended)."""

    def __init__(self, stage: str, kind: str, key: str, every_s: float | None = None):
        self.stage, self.kind, self.key = stage, kind, f"{key}-curves"
        self.every_s = float(os.environ.get(EVERY_ENV, DEFAULT_EVERY_S)) if every_s is None else every_s
        self.history: list[dict] = []
        self.total: int | None = None
        self.drawn_at: float | None = None
        self.live_id: Any = None  # the newest live version, deleted when the next one replaces it
        self.stopped = False  # a live drawing failed: no more until the final version
        # The watcher thread has no Prefect run context; artifacts made there must still belong to this task run.
        self._context = contextvars.copy_context()

    def add(self, event: dict) -> None:
        self.history.append({"step": int(event["step"]), **(event.get("metrics") or {})})
        self.total = int(event["total"])
        due = self.drawn_at is None or time.monotonic() - self.drawn_at >= self.every_s
        last = self.history[-1]["step"] >= self.total  # the final version follows when the job ends
        if len(self.history) >= 2 and due and not last and not self.stopped:
            try:
                self._context.run(self._publish, self.history, "running")
            except Exception as e:  # the progress bar and the terminal display go on without live curves
                print(f"warning: the {self.stage} curves are no longer drawn live ({e!r})", file=sys.stderr)
                self.stopped = True

    def finish(self, store: ObjectStore, failed: bool = False) -> None:
        """The last version: after a completed job from its own record of every step (it also holds the steps
        before a resume, which this task never saw), after a failed one the steps it logged. Best effort: a stage
        that trained must not fail, and be retried, over its figure."""
        try:
            rel = run_layout.metrics(self.stage)
            saved = store.read_json(rel).get("history") if not failed and store.exists(rel) else None
            if saved or self.history:
                self._publish(saved or self.history, "failed" if failed else "final")
        except Exception as e:
            print(f"warning: the {self.stage} curves were not drawn ({e!r})", file=sys.stderr)

    def _publish(self, history: list[dict], status: str) -> None:
        markdown = curves.stage_markdown(self.stage, self.kind, history, self.total, status)
        description = f"{self.stage} ({self.kind}): training curves"
        new = create_markdown_artifact(markdown, key=self.key, description=description)
        self.drawn_at = time.monotonic()
        if status != "running":
            return  # the last live version stays beside the final one
        replaced, self.live_id = self.live_id, new
        if replaced is not None:
            try:
                delete_artifact(replaced)
            except Exception as e:  # an extra version is harmless
                print(f"warning: an old version of the {self.stage} curves was not deleted ({e!r})", file=sys.stderr)


def delete_artifact(artifact_id: Any) -> None:
    with get_client(sync_client=True) as client:
        client.delete_artifact(artifact_id)
