"""Training curves: a stage's per-step metrics drawn with matplotlib, one panel per metric group.

The same figure serves three places: the stage's curves artifact in the Prefect UI (``tasks.stages``, redrawn every
few logged steps while the stage runs), ``<run_uri>/<stage>/curves.png`` beside ``metrics.json`` (written by the
job), and ``rlhf compare``, which overlays several runs' histories in each panel (``compare_report``).

A history is what ``metrics.json`` keeps and the ``step`` events carry: a list of ``{"step": k, name: value, ...}``.
"""

from __future__ import annotations

import base64
import io
import math
import sys
from collections.abc import Iterable, Mapping
from typing import Any, TypeGuard

from rlhf_core import run_layout, timing
from rlhf_core.storage import ObjectStore

# Panels in this order, each the metrics drawn together; a panel whose metrics a history lacks is left out.
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("loss", ("loss",)),
    ("accuracy", ("acc", "accuracy")),
    ("reward", ("reward",)),
    ("reward-source score", ("rm_score", "reward_fn_score", "remote_rm_score")),
    ("KL", ("kl", "kl_token_mean")),
    ("response length (tokens)", ("response_len",)),
    ("policy loss", ("policy_loss",)),
    ("critic loss", ("critic_loss",)),
    ("clip fraction", ("clip_frac", "value_clip_frac")),
    ("learning rate", ("lr", "actor_lr", "critic_lr")),
)
# Per-step bookkeeping rather than training signals: never given a panel of their own.
SKIP = frozenset(
    {
        "step",
        "prompts",
        "actor_frozen",
        "weight_sync_broadcasts",
        "weight_sync_buckets",
        "weight_sync_mib",
        "weight_sync_s",
        "sync_s",
        "rollout_logprob_max_diff",
    }
)
MAX_PANELS = 12
TIMING_PANEL = "step phases (s)"


def is_number(value: Any) -> TypeGuard[float]:
    """A finite int or float (a bool, a list or NaN is not a metric to draw or log)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def panels(histories: Iterable[list[dict]]) -> list[tuple[str, list[str]]]:
    """The panels for these histories: the known groups they have, the phase timings in one panel, then every other
    numeric metric alone, at most ``MAX_PANELS``."""
    keys: dict[str, None] = {}
    for history in histories:
        for entry in history:
            keys.update({k: None for k, v in entry.items() if is_number(v)})
    out: list[tuple[str, list[str]]] = []
    used: set[str] = set(SKIP)
    for title, names in GROUPS:
        present = [n for n in names if n in keys]
        if present:
            out.append((title, present))
            used.update(present)
    phases = [k for k in keys if timing.phase_of(k) is not None]
    if phases:
        out.append((TIMING_PANEL, phases))
        used.update(phases)
    out += [(k, [k]) for k in keys if k not in used]
    return out[:MAX_PANELS]


def points(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    """The (steps, values) of ``key`` in a history, entries without a finite value left out."""
    pairs = [(int(e["step"]), float(e[key])) for e in history if "step" in e and is_number(e.get(key))]
    return [s for s, _ in pairs], [v for _, v in pairs]


def figure_png(series: Mapping[str, list[dict]], title: str) -> bytes:
    """``figure`` as PNG bytes."""
    buf = io.BytesIO()
    figure(series, title).savefig(buf, format="png")
    return buf.getvalue()


def figure(series: Mapping[str, list[dict]], title: str) -> Any:
    """A matplotlib ``Figure`` of the histories in ``series`` ({label: history}): one panel per metric group, one
    line per metric and label (several labels overlay, as in ``rlhf compare``). Drawn without pyplot or a display
    (``Figure`` alone is thread-safe enough for the launcher's watcher thread)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    layout = panels(series.values())
    cols = min(3, max(1, len(layout)))
    rows = max(1, math.ceil(len(layout) / cols))
    fig = Figure(figsize=(4.2 * cols, 2.9 * rows), dpi=90, layout="constrained")
    fig.suptitle(title)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, (heading, keys) in zip(axes, layout):
        for label, history in series.items():
            for key in keys:
                steps, values = points(history, key)
                if not steps:
                    continue
                shown = timing.phase_of(key) or key  # "generation" for timing/generation_s
                parts = [p for p in (label if len(series) > 1 else "", shown if len(keys) > 1 else "") if p]
                ax.plot(
                    steps,
                    values,
                    marker="o" if len(steps) <= 40 else None,
                    markersize=3,
                    label=": ".join(parts) or None,
                )
        ax.set_title(heading, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, ncols=2 if len(ax.get_lines()) > 6 else 1)
    if not layout:
        axes[0].text(0.5, 0.5, "no steps logged yet", ha="center", va="center")
    for ax in axes[len(layout) or 1 :]:
        ax.set_visible(False)
    return fig


def save_png(store: ObjectStore, stage: str, kind: str, history: list[dict]) -> None:
    """``<stage>/curves.png`` beside ``metrics.json``. Best effort: a stage that trained must not fail over its
    figure (one warning line instead)."""
    try:
        store.write_bytes(
            run_layout.curves(stage), figure_png({stage: history}, f"{stage} ({kind})" if kind else stage)
        )
    except Exception as e:
        print(
            f"warning: [{stage}] {run_layout.CURVES} was not written ({type(e).__name__}: {e})",
            file=sys.stderr,
            flush=True,
        )


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def logged_steps(history: list[dict]) -> list[int]:
    return [int(e["step"]) for e in history if "step" in e]


STATUS = {"running": "running, redrawn as steps are logged", "final": "final", "failed": "the job failed here"}


def stage_markdown(
    stage: str, kind: str, history: list[dict], total: int | None, status: str, table_rows: int = 12
) -> str:
    """The curves artifact of one stage: the figure inline (a data URI, which the Prefect UI renders without a file
    server), a line saying how far the stage is (``status``: a key of ``STATUS``), and the last logged values as a
    table."""
    steps = logged_steps(history)
    where = f"{len(steps)} logged step{'s' * (len(steps) != 1)}"
    if steps:
        where += f", last step {steps[-1]}" + (f" of {total}" if total else "")
    lines = [
        f"# {stage} ({kind}): training curves",
        "",
        f"**{STATUS[status]}**: {where}",
        "",
        f"![{stage} curves]({data_uri(figure_png({stage: history}, f'{stage} ({kind})'))})",
        "",
    ]
    layout = panels([history])
    keys = [k for _, names in layout for k in names]
    if steps and keys:
        shown = history[-table_rows:]
        lines += [
            f"Last {len(shown)} logged steps:",
            "",
            "| step | " + " | ".join(keys) + " |",
            "|---" * (len(keys) + 1) + "|",
        ]
        for e in shown:
            cells = [f"{e[k]:.4g}" if is_number(e.get(k)) else "" for k in keys]
            lines.append(f"| {e.get('step', '')} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
