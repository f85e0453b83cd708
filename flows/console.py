"""The terminal display of ``rlhf run`` / ``resume`` / ``stage``: a listener of the stage progress events
(``tasks.progress``) that the command subscribes around the flow call.

- stdout a terminal: one live rich progress bar per stage (step k/N, steps/s, ETA, up to three step metrics and a
  note: ``attempt 2 (retry)``, ``resumed from step 4``, ``Cached (output committed for this config)``, ``Completed
  in 31.2 s``). While the bars are live, Prefect's console log handler prints through the bars' console, so log
  lines scroll above the bars instead of tearing them.
- otherwise (CI, a log file, ``| tee``): plain lines, e.g. ``sft: step 8/16 (50%) 1.9 steps/s ETA 4s loss=1.23``.
  A stage's step line is printed for its first and last step, and in between only when the stage has crossed
  another 10% of its steps or ``every_s`` seconds (default 60) have passed since its previous line; the markers
  above are printed as lines of their own. Logging is left as it is.

Rate and ETA are measured from the first step event of the current attempt (a job's startup is not a step).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TaskID, TextColumn
from rich.text import Text

if TYPE_CHECKING:
    from prefect.logging.handlers import PrefectConsoleHandler

STEP_METRICS = ("loss", "reward", "kl", "critic_loss", "policy_loss", "acc")  # shown: the first 3 a step carries
SHOWN_METRICS = 3
PLAIN_EVERY_S = 60.0
PLAIN_LINES = 10  # plain mode: a step line each time a stage crosses another 1/PLAIN_LINES of its steps
CACHED = "Cached (output committed for this config)"


@dataclass
class _Stage:
    """What the display knows of one stage instance."""

    attempt: int = 1
    step: int = 0
    total: int | None = None
    origin: tuple[int, float] | None = None  # (step, time) of this attempt's first step event
    rate: float | None = None  # steps/s
    eta_at: float | None = None  # when the last step is expected
    metrics: str = ""
    notes: list[str] = field(default_factory=list)
    printed: tuple[int, float] | None = None  # plain mode: (step, time) of the last step line
    done: bool = False  # finished Completed or Cached
    task: TaskID | None = None


class StageConsole:
    """Shows stage progress events on ``console`` (default: stdout); live bars when it is a terminal, plain lines
    otherwise. Call it with each event; use it as a context manager around the run (starts and stops the bars)."""

    def __init__(
        self,
        console: Console | None = None,
        live: bool | None = None,
        every_s: float = PLAIN_EVERY_S,
        clock: Callable[[], float] = time.time,
    ):
        # markup off: Prefect's log lines print through this console while the bars are live, and "[sft] step 1"
        # would otherwise lose its "[sft]" as an unknown style tag
        self.console = console or Console(markup=False)
        self.live = self.console.is_terminal and not self.console.is_dumb_terminal if live is None else live
        self.every_s = every_s
        self.clock = clock
        self.stages: dict[str, _Stage] = {}
        self._lock = threading.Lock()  # events come from the stage task's and the launcher's threads
        self._handlers: list[tuple[PrefectConsoleHandler, Console]] = []
        self.progress = (
            Progress(
                TextColumn("{task.description}", style="bold", markup=False),
                BarColumn(bar_width=24),
                _StepColumn(),
                _RateColumn(clock),
                TextColumn("{task.fields[metrics]}", markup=False),
                TextColumn("{task.fields[note]}", style="cyan", markup=False),
                console=self.console,
                refresh_per_second=4,
            )
            if self.live
            else None
        )

    def __enter__(self) -> StageConsole:
        if self.progress is not None:
            self.progress.start()
            for handler in _prefect_console_handlers():
                self._handlers.append((handler, handler.console))
                handler.console = self.progress.console
        return self

    def __exit__(self, *exc) -> None:
        for handler, console in self._handlers:
            handler.console = console
        self._handlers.clear()
        if self.progress is not None:
            self.progress.stop()

    def __call__(self, event: dict) -> None:
        kind, name = event.get("event"), event.get("stage")
        if not isinstance(name, str) or kind not in ("started", "step", "resumed", "finished"):
            return  # not a stage progress event this display knows
        with self._lock:
            stage = self.stages.setdefault(name, _Stage())
            if kind == "started":
                self._started(name, stage, int(event.get("attempt", 1)))
            elif kind == "step":
                self._step(name, stage, event)
            elif kind == "resumed":
                self._mark(name, stage, f"resumed from step {int(event['step'])}")
                stage.step = int(event["step"])
            else:
                self._finished(name, stage, event)
            self._draw(name, stage)

    # -----------------------------------------------------------------------------------------------------------------
    # events

    def _started(self, name: str, stage: _Stage, attempt: int) -> None:
        stage.attempt, stage.origin, stage.rate, stage.eta_at, stage.notes = attempt, None, None, None, []
        stage.done = False
        if attempt > 1:
            self._mark(name, stage, f"attempt {attempt} (retry)")
        elif not self.live:
            self._line(f"{name}: started")

    def _step(self, name: str, stage: _Stage, event: dict) -> None:
        step, total = int(event["step"]), int(event["total"])
        now = float(event.get("time") or self.clock())
        stage.step, stage.total = step, total
        if stage.origin is None or step < stage.origin[0]:
            stage.origin = (step, now)
        first_step, first_time = stage.origin
        if step > first_step and now > first_time:
            stage.rate = (step - first_step) / (now - first_time)
            stage.eta_at = now + (total - step) / stage.rate
        metrics = event.get("metrics") or {}
        shown = [k for k in STEP_METRICS if isinstance(metrics.get(k), (int, float))][:SHOWN_METRICS]
        stage.metrics = " ".join(f"{k}={metrics[k]:.4g}" for k in shown)
        if not self.live and self._worth_a_line(stage, step, total, now):
            stage.printed = (step, now)
            self._line(step_line(name, step, total, stage.rate, _eta_s(stage, now), stage.metrics))

    def _worth_a_line(self, stage: _Stage, step: int, total: int, now: float) -> bool:
        if stage.printed is None or step >= total:
            return True
        last_step, last_time = stage.printed
        return step * PLAIN_LINES // total > last_step * PLAIN_LINES // total or now - last_time >= self.every_s

    def _finished(self, name: str, stage: _Stage, event: dict) -> None:
        state = str(event["state"])
        if state == "Cached":
            text = CACHED
        elif state == "Completed":
            text = f"Completed in {float(event['duration_s']):.1f} s"
        else:
            text = f"{state} after {float(event['duration_s']):.1f} s"
        stage.eta_at, stage.done = None, state in ("Cached", "Completed")
        if stage.done and stage.total is not None:
            stage.step = stage.total
        stage.notes.append(text)
        if not self.live:
            self._line(f"{name}: {text}")

    def _mark(self, name: str, stage: _Stage, text: str) -> None:
        stage.notes.append(text)
        if not self.live:
            self._line(f"{name}: {text}")

    # -----------------------------------------------------------------------------------------------------------------
    # output

    def _line(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def _draw(self, name: str, stage: _Stage) -> None:
        if self.progress is None:
            return
        fields = {
            "metrics": stage.metrics,
            "note": ", ".join(stage.notes),
            "rate": stage.rate,
            "eta_at": stage.eta_at,
            "stepped": stage.total is not None,
        }
        total, completed = (1, 1) if stage.done and stage.total is None else (stage.total, stage.step)  # a full bar
        if stage.task is None:
            stage.task = self.progress.add_task(name, total=total, completed=completed, **fields)
        else:
            self.progress.update(stage.task, total=total, completed=completed, **fields)


def step_line(name: str, step: int, total: int, rate: float | None, eta_s: float | None, metrics: str) -> str:
    """``sft: step 8/16 (50%) 1.9 steps/s ETA 4s loss=1.23`` (rate and ETA once known, metrics when there are)."""
    parts = [f"{name}: step {step}/{total} ({100 * step // max(total, 1)}%)"]
    if rate is not None:
        parts.append(f"{rate:.3g} steps/s")
    if eta_s is not None and step < total:
        parts.append(f"ETA {duration(eta_s)}")
    if metrics:
        parts.append(metrics)
    return " ".join(parts)


def duration(seconds: float) -> str:
    """``4s``, ``2m05s``, ``1h02m``."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _eta_s(stage: _Stage, now: float) -> float | None:
    return None if stage.eta_at is None else max(0.0, stage.eta_at - now)


class _StepColumn(ProgressColumn):
    """``step 8/16`` once the stage has logged a step."""

    def render(self, task: Task) -> Text:
        if not task.fields.get("stepped") or task.total is None:
            return Text("")
        return Text(f"step {int(task.completed)}/{int(task.total)}")


class _RateColumn(ProgressColumn):
    """``1.9 steps/s ETA 4s``, the ETA counting down between step events."""

    def __init__(self, clock: Callable[[], float]):
        super().__init__()
        self.clock = clock

    def render(self, task: Task) -> Text:
        rate, eta_at = task.fields.get("rate"), task.fields.get("eta_at")
        parts = [] if rate is None else [f"{rate:.3g} steps/s"]
        if eta_at is not None and not task.finished:
            parts.append(f"ETA {duration(eta_at - self.clock())}")
        return Text(" ".join(parts), style="green")


def _prefect_console_handlers() -> list[PrefectConsoleHandler]:
    """Prefect's console log handlers (one object, attached to the root logger and a few others)."""
    from prefect.logging.handlers import PrefectConsoleHandler

    loggers = [
        logging.getLogger(),
        *(v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger)),
    ]
    found: dict[int, PrefectConsoleHandler] = {}
    for logger in loggers:
        for handler in logger.handlers:
            if isinstance(handler, PrefectConsoleHandler):
                found[id(handler)] = handler
    return list(found.values())
