"""Comparing runs: ``rlhf compare RUN_A RUN_B ...`` and the ``compare-runs`` flow write the same report
(``rlhf_core.compare``: each stage's curves overlaid, the final metrics side by side, the config keys that differ);
the flow, and the command when called inside a flow run, also publish it as the ``run-comparison`` markdown
artifact with the images inline (data URIs, which the Prefect UI renders).

    rlhf compare lr-low lr-high                     # runs/lr-low, runs/lr-high -> runs/_compare/lr-low-vs-lr-high
    rlhf compare runs/a s3://bucket/runs/b --out /tmp/a-vs-b
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.context import FlowRunContext

from rlhf_core.compare import Report, compare_report, default_name

ROOT = Path(__file__).resolve().parent.parent  # as tasks.launch.ROOT, without importing the job helpers
RUNS = ROOT / "runs"
ARTIFACT_KEY = "run-comparison"


def report_location(runs: list[str], out: str | None) -> str:
    """``out`` (a folder, made absolute, or a URI), default ``runs/_compare/<a>-vs-<b>``."""
    if out is None:
        return str(RUNS / "_compare" / default_name(runs))
    return out if "://" in out else str(Path(out).resolve())


def publish(report: Report) -> None:
    labels = " vs ".join(run.label for run in report.runs)
    create_markdown_artifact(report.inline_markdown, key=ARTIFACT_KEY, description=f"{labels}: {report.path}")


def compare_command(runs: list[str], out: str | None = None) -> str:
    """The report of ``rlhf compare``; also the artifact when called inside a flow run. Returns compare.md's path."""
    report = compare_report(runs, report_location(runs, out), RUNS)
    if FlowRunContext.get() is not None:
        publish(report)
    return report.path


@flow(name="compare-runs", log_prints=True)
def compare_runs(runs: list[str], out: str | None = None) -> str:
    """Overlay the runs' curves and put their final metrics side by side: the report and a markdown artifact."""
    report = compare_report(runs, report_location(runs, out), RUNS)
    publish(report)
    print(f"report: {report.path}")
    return report.path
