"""The pipeline flow's report: a row per stage task (state, duration, attempts, key metrics, notes), the loop
iterations' gold-reward table, and the markdown of both. The flow writes the summary to ``<run_uri>/run_summary.json``
(``rlhf_core.run_layout.SUMMARY``) and publishes its markdown as the ``run-summary`` artifact; ``rlhf run`` prints it.
"""

from __future__ import annotations

from typing import Any

from rlhf_core.config import PipelineConfig
from rlhf_core.run_layout import summary_metrics

ITERATION_METRICS = ("gold_reward", "kl_to_ref", "gold_reward_after", "kl_to_ref_after")


def stage_row(stage: str, kind: str, state: Any, duration_s: float, ref: dict | None) -> dict:
    """The summary row of one stage task's final ``state``; ``ref`` is its result when it completed."""
    row = {
        "stage": stage,
        "kind": kind,
        "state": state.name,
        "duration_s": round(duration_s, 1),
        "attempts": attempts(state),
    }
    if ref is not None:
        row.update(uri=ref["uri"], metrics=summary_metrics(ref["metrics"]))
    row["notes"] = stage_notes(row)
    return row


def attempts(state: Any) -> int:
    """How many times the task ran (1, or more after retries; 0 for a result found by its cache key)."""
    from prefect.client.orchestration import get_client

    task_run_id = state.state_details.task_run_id
    if task_run_id is None:
        return 1
    try:
        with get_client(sync_client=True) as client:
            return client.read_task_run(task_run_id).run_count
    except Exception:  # the summary's note only: never fail the run over it
        return 1


def stage_notes(row: dict) -> str:
    """What the state name alone does not say at a glance: a retry, a resume, a stage that did not run."""
    notes = []
    if row["state"] == "Cached":
        notes.append("not run: output committed for this config")
    if row.get("attempts", 1) > 1:
        notes.append(f"attempt {row['attempts']} (retried)")
    resumed = row.get("metrics", {}).get("resumed_from_step")
    if resumed and row["state"] != "Cached":
        notes.append(f"resumed from step {int(resumed)}")
    return ", ".join(notes)


def iteration_rows(cfg: PipelineConfig, refs: dict[str, dict]) -> list[dict]:
    """One row per loop iteration (0: the stages outside the loop that ran before it) with the gold reward and KL
    of each stage that measured them (``<stage>/<metric>``, loop stages under their name without ``_<i>``)."""
    rows: dict[int, dict] = {}
    for stage in cfg.order():
        metrics = refs.get(stage, {}).get("metrics", {})
        found = {k: metrics[k] for k in ITERATION_METRICS if metrics.get(k) is not None}
        i = cfg.iterations.get(stage, 0)
        if not found:
            continue
        base = stage.removesuffix(f"_{i}") if i else stage
        row = rows.setdefault(i, {"iteration": i})
        row.update({f"{base}/{k}": round(v, 4) for k, v in found.items()})
    return [rows[i] for i in sorted(rows)]


def summary_markdown(summary: dict) -> str:
    lines = [
        f"# RLHF run `{summary['run_name']}`: {summary['state']}",
        "",
        f"Artifacts: `{summary['run_uri']}`",
        "",
        "| stage | state | notes | duration (s) | key metrics | model |",
        "|---" * 6 + "|",
    ]
    for row in summary["stages"]:
        metrics = ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.get("metrics", {}).items()
        )
        lines.append(
            f"| {row['stage']} | {row['state']} | {row.get('notes', '')} | {row['duration_s']} | {metrics} | "
            f"`{row.get('uri', '')}` |"
        )
    if summary.get("iterations"):
        columns = sorted({k for row in summary["iterations"] for k in row if k != "iteration"})
        lines += [
            "",
            "Gold reward per iteration:",
            "",
            "| iteration | " + " | ".join(columns) + " |",
            "|---" * (len(columns) + 1) + "|",
        ]
        for row in summary["iterations"]:
            cells = [str(row.get(c, "")) for c in columns]
            lines.append(f"| {row['iteration']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
