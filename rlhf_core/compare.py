"""Run comparison: several runs' training curves overlaid stage by stage, their final metrics side by side, and the
config keys whose values differ between them (what explains the difference in the curves).

A run is a run name (``<runs_root>/<name>``), a folder or a URI (``file://``, ``s3://``) holding stage folders with
a ``metrics.json`` (``{"history": [...], "final": {...}}``) and, for pipeline runs, the resolved ``config.yaml``.
The report is ``<out>/compare.md`` with one overlay image ``<out>/<stage>.png`` per stage (``curves.figure_png``);
``Report.inline_markdown`` is the same text with the images as data URIs, for a Prefect artifact (``flows.compare``).

    rlhf compare lr-low lr-high                      # runs/lr-low and runs/lr-high -> runs/_compare/lr-low-vs-lr-high
    rlhf compare /tmp/a s3://bucket/runs/b --out /tmp/a-vs-b
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rlhf_core import curves, run_layout
from rlhf_core.config import ConfigError, flatten
from rlhf_core.errors import one_line
from rlhf_core.storage import ObjectStore, StorageError, storage_options_for

REPORT_NAME = "compare.md"
# Always different between two runs and shown as the run's location already: left out of the config table.
IGNORED_KEYS = frozenset({"run_uri"})
MISSING = "—"


@dataclass
class RunData:
    """One run as the report sees it: its label, location, per-stage ``metrics.json`` and flattened config."""

    arg: str
    label: str
    uri: str
    stages: dict[str, dict] = field(default_factory=dict)  # stage -> {"history": [...], "final": {...}}
    config: dict[str, Any] | None = None  # dotted key -> value; None without a config.yaml


@dataclass
class Report:
    """The written report: where ``compare.md`` is, its text, the text with inline images, the images by stage."""

    path: str
    markdown: str
    inline_markdown: str
    images: dict[str, bytes]
    runs: list[RunData]


def compare_report(runs: list[str], out: str, runs_root: str | Path = "runs") -> Report:
    """Load the runs (``load_run``), build the report and write it under ``out`` (a folder or a URI)."""
    loaded = load_runs(runs, runs_root)
    images = stage_images(loaded)
    markdown = report_markdown(loaded, lambda stage: f"{stage}.png", images)
    inline = report_markdown(loaded, lambda stage: curves.data_uri(images[stage]), images)
    return Report(write_report(out, markdown, images), markdown, inline, images, loaded)


# ---------------------------------------------------------------------------------------------------------------
# Loading the runs


def load_runs(args: list[str], runs_root: str | Path = "runs") -> list[RunData]:
    """Every run argument loaded, labels made unique (``a``, ``a-2``, ...) in argument order."""
    if not args:
        raise ConfigError("give at least one run to compare (a run name, a folder or a URI)")
    loaded = [load_run(arg, runs_root) for arg in args]
    seen: dict[str, int] = {}
    for run in loaded:
        base = run.label
        seen[base] = seen.get(base, 0) + 1
        if seen[base] > 1:
            run.label = f"{base}-{seen[base]}"
            while run.label in seen:  # e.g. a run really named "a-2" given as well
                seen[base] += 1
                run.label = f"{base}-{seen[base]}"
            seen[run.label] = 1
    return loaded


def resolve_location(arg: str, runs_root: str | Path = "runs") -> tuple[str, str]:
    """(URI, label) of a run argument: a URI as given, a run name as ``<runs_root>/<name>``, else a folder."""
    if "://" in arg:
        return arg.rstrip("/"), arg.rstrip("/").rsplit("/", 1)[-1] or arg
    named = Path(runs_root) / arg
    if "/" not in arg and named.is_dir():
        return str(named.resolve()), arg
    folder = Path(arg)
    if folder.is_dir():
        return str(folder.resolve()), folder.resolve().name
    raise ConfigError(f"{arg!r} is not a run: neither a run {named} nor a folder {folder.resolve()} exists")


def load_run(arg: str, runs_root: str | Path = "runs") -> RunData:
    """A run's stage metrics and config; a ``ConfigError`` naming ``arg`` when it has no stage with metrics."""
    uri, label = resolve_location(arg, runs_root)
    run = RunData(arg, label, uri)
    store = ObjectStore(uri, storage_options_for(uri))
    try:
        names = [d for d in store.list_dirs() if run_layout.is_stage_dir(d)]
        found = [d for d in names if store.exists(run_layout.metrics(d))]
        has_config = store.exists(run_layout.CONFIG)
    except Exception as e:  # an unreachable store, bad credentials: one line naming the run
        raise ConfigError(f"{arg!r}: cannot read {uri} ({one_line(f'{type(e).__name__}: {e}')})") from None
    if not found:
        raise ConfigError(f"{arg!r} is not a run: no stage folder with a {run_layout.METRICS} in {uri}")
    order: list[str] = []
    if has_config:
        try:
            tree = yaml.safe_load(store.read_text(run_layout.CONFIG)) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{arg!r}: {uri}/{run_layout.CONFIG} is not valid YAML ({one_line(str(e))})") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{arg!r}: {uri}/{run_layout.CONFIG} is not a mapping of config keys")
        run.config = config_keys(tree)
        order = [s for s in tree.get("stages") or {} if s in found]  # the pipeline order
    for stage in order + sorted(s for s in found if s not in order):
        try:
            metrics = json.loads(store.read_text(run_layout.metrics(stage)))
        except ValueError as e:
            raise ConfigError(f"{arg!r}: {uri}/{run_layout.metrics(stage)} is not valid JSON ({e})") from None
        run.stages[stage] = {"history": list(metrics.get("history") or []), "final": dict(metrics.get("final") or {})}
    return run


def config_keys(tree: dict) -> dict[str, Any]:
    """A resolved ``config.yaml`` as dotted keys spelled as overrides are: ``stages.sft.optim.lr`` -> ``sft.optim.lr``
    (the stages first, in pipeline order), then the top-level sections (``storage.endpoint_url``, ...)."""
    stages = tree.get("stages") if isinstance(tree.get("stages"), dict) else {}
    return {**flatten(stages), **flatten({k: v for k, v in tree.items() if k != "stages"})}


# ---------------------------------------------------------------------------------------------------------------
# Building the report


def stages_of(runs: list[RunData]) -> list[str]:
    """Every stage of any run, in the order the runs list them."""
    return list(dict.fromkeys(stage for run in runs for stage in run.stages))


def config_differences(runs: list[RunData]) -> dict[str, list[Any]]:
    """Dotted config key -> its value in each run that has a config (``MISSING`` where that config lacks the key),
    for the keys whose values are not all equal."""
    configs = [run.config for run in runs if run.config is not None]
    keys = dict.fromkeys(k for config in configs for k in config if k not in IGNORED_KEYS)
    out = {}
    for key in keys:
        values = [config.get(key, MISSING) for config in configs]
        if any(v != values[0] for v in values[1:]):
            out[key] = values
    return out


def final_rows(runs: list[RunData], stage: str) -> list[tuple[str, list[Any]]]:
    """(metric, value per run that has the stage) for every final metric of the stage, nested ones dotted."""
    finals = [flatten(run.stages[stage]["final"]) for run in runs if stage in run.stages]
    names = dict.fromkeys(k for final in finals for k in final)
    return [(name, [final.get(name, MISSING) for final in finals]) for name in names]


def stage_images(runs: list[RunData]) -> dict[str, bytes]:
    """One overlay PNG per stage that some run logged steps for ({run label: history} in ``curves.figure_png``)."""
    images = {}
    for stage in stages_of(runs):
        series = {run.label: run.stages[stage]["history"] for run in runs if stage in run.stages}
        if curves.panels(series.values()):
            images[stage] = curves.figure_png(series, f"{stage}: {' vs '.join(series)}")
    return images


def report_markdown(runs: list[RunData], image_ref: Callable[[str], str], images: dict[str, bytes]) -> str:
    """The report: title, the runs, the differing config keys, then per stage its overlay image and final metrics.
    ``image_ref(stage)`` is where the markdown points for the stage's image (a file name or a data URI)."""
    labels = [run.label for run in runs]
    lines = [f"# Run comparison: {' vs '.join(labels)}", "", "| run | location | stages |", "|---|---|---|"]
    lines += [f"| {_cell(r.label)} | `{_cell(r.uri)}` | {_cell(', '.join(r.stages))} |" for r in runs]

    lines += ["", "## Config differences", ""]
    with_config = [run for run in runs if run.config is not None]
    without = [run.label for run in runs if run.config is None]
    if without:
        lines += [
            f"No {run_layout.CONFIG} in {', '.join(without)} (a pipeline run writes one; a stage job alone does not)."
        ]
        lines += [""]
    diffs = config_differences(runs)
    if len(with_config) < 2:
        lines += [f"Fewer than two runs have a {run_layout.CONFIG}: nothing to compare."]
    elif not diffs:
        lines += ["No config key differs between " + ", ".join(r.label for r in with_config) + "."]
    else:
        lines += _table("key", [r.label for r in with_config], [(f"`{k}`", v) for k, v in diffs.items()])

    for stage in stages_of(runs):
        have = [run.label for run in runs if stage in run.stages]
        lines += ["", f"## {stage}", ""]
        if len(have) < len(runs):
            missing = [run.label for run in runs if stage not in run.stages]
            lines += [f"Only in {', '.join(have)} (not in {', '.join(missing)}).", ""]
        if stage in images:
            lines += [f"![{stage}]({image_ref(stage)})", ""]
        else:
            lines += ["No logged steps to draw.", ""]
        rows = final_rows(runs, stage)
        lines += _table("final metric", have, [(f"`{k}`", v) for k, v in rows]) if rows else ["No final metrics."]
    return "\n".join(lines) + "\n"


def _table(first: str, columns: list[str], rows: list[tuple[str, list[Any]]]) -> list[str]:
    head = f"| {first} | " + " | ".join(_cell(c) for c in columns) + " |"
    lines = [head, "|---" * (len(columns) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(_cell(format_value(v)) for v in values) + " |" for name, values in rows]
    return lines


def format_value(value: Any) -> str:
    """A config or metric value in a table cell: floats to 6 significant digits, YAML spelling otherwise."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def write_report(out: str, markdown: str, images: dict[str, bytes]) -> str:
    """``<out>/compare.md`` and ``<out>/<stage>.png`` (a local folder, created, or a URI); the report's path."""
    out = out.rstrip("/")
    try:
        store = ObjectStore(out, storage_options_for(out))
        for stage, png in images.items():
            store.write_bytes(f"{stage}.png", png)
        store.write_text(REPORT_NAME, markdown)
    except (OSError, StorageError) as e:  # an existing file, no permission, an unreachable store: --out to fix
        raise ConfigError(f"cannot write the report to {out!r} ({one_line(f'{type(e).__name__}: {e}')})") from None
    return f"{out}/{REPORT_NAME}"


def default_name(runs: list[str]) -> str:
    """``<a>-vs-<b>`` from the run arguments' last path parts, safe as a folder name."""
    parts = [re.sub(r"[^A-Za-z0-9_.-]+", "_", arg.rstrip("/").rsplit("/", 1)[-1]) or "run" for arg in runs]
    return "-vs-".join(parts)
