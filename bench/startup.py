"""Stage start-up: per stage of a preset's pipeline, seconds from the job's process start to its first step.

    python -m bench.startup [--config deployments/configs/tiny.yaml] [--baseline-rev REV | --baseline-root DIR]
                            [--root DIR] [--repeats N] [--shared-ray before|after ...] [--keep DIR] [key=value ...]

Each stage runs as the flow runs it: its own job process (``python -m rlhf_core.jobs.<kind> --stage NAME``) in a
fresh run directory, stages in dependency order. Two clocks per stage, both from the job's process creation:

- ``startup_s`` from the stage's ``metrics.json`` (``final``), what the job measured itself (rank 0's clock);
- the arrival of the job's first-step line on its stdout, timestamped here: ``[<stage>] first step`` or, for code
  from before ``startup_s`` existed, ``[<stage>] before:`` (PPO kinds: printed right before the loop) or
  ``[<stage>] step 1/N ... (X.XXs)`` less its printed step time (supervised kinds). Ray forwards worker output a
  little late, so this clock reads a bit higher; it is the only one the old code has.

A stage without steps (``critic_init``: a copy, no Ray) reports its whole job time. The reported value per stage is
``startup_s`` where the job wrote one, else the stdout clock.

``--baseline-rev REV``: also run the same pipeline from a ``git worktree`` of REV (shared venv, ``PYTHONPATH`` and the
working directory pointing at it; ``--baseline-root``: from a checkout at DIR), stage by stage interleaved with the
current code (``--root``: another checkout) (before, after, before, ...), so that both see the same load; the final
metrics of both sides are compared (start-up levers must not change a number); ``speedup`` = the slowest stage
before / the slowest stage after. ``--repeats N``: the whole pipeline N times, medians reported (a shared machine's
load drifts). ``--shared-ray``: that side's jobs join one Ray head started before them, as a flow run with
``shared_ray`` gives its jobs (the head's own start is not counted, as the flow starts it once for all stages).
``--env-*``: extra environment for the jobs of one side. The last line is the summary (stage names as in the preset):

    startup: max_s=<slowest stage> sft_s=<..> reward_model_s=<..> ... [speedup=<before_max/after_max>]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# What import_deepspeed sets in the jobs of the current code, for a baseline's code from before it: both sides load
# the CPU Adam op make setup built, instead of a baseline job compiling one (about 90 s) inside its start-up.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))

ROOT = Path(__file__).resolve().parent.parent
_STEP_TIME = re.compile(r"\((\d+(?:\.\d+)?)s\)\s*$")


@dataclass
class StageTiming:
    stage: str
    kind: str
    wall_s: float  # job process start -> exit
    stdout_s: float | None  # job process start -> first-step line seen here
    metrics_s: float | None  # metrics.json final.startup_s
    lines: list[tuple[float, str]] = field(default_factory=list)
    final: dict = field(default_factory=dict)  # metrics.json "final"

    def results(self) -> dict:
        """The stage's final metrics without the clocks (what before and after must agree on)."""
        clocks = ("startup_s", "eval_before_s")
        return {k: v for k, v in self.final.items() if k not in clocks and not k.startswith("timing/")}

    @property
    def startup_s(self) -> float:
        """What is reported: the job's own clock, else the stdout clock, else (no steps) the whole job."""
        for value in (self.metrics_s, self.stdout_s):
            if value is not None:
                return value
        return self.wall_s


def first_step_offset(stage: str, line: str) -> float | None:
    """When ``line`` marks the first step of ``stage``: seconds to subtract from its arrival (the printed time of a
    step that had already run), else None."""
    tag = f"[{stage}] "
    at = line.find(tag)
    if at < 0:
        return None
    rest = line[at + len(tag) :]
    if rest.startswith("first step") or rest.startswith("before:"):
        return 0.0
    if rest.startswith("step 1/"):
        found = _STEP_TIME.search(rest)
        return float(found.group(1)) if found else 0.0
    return None


def run_stage(
    root: Path,
    config: str,
    stage: str,
    kind: str,
    run_uri: Path,
    overrides: list[str],
    env: dict[str, str],
    log_path: Path | None,
) -> StageTiming:
    """One stage job from checkout ``root``; its output is timestamped line by line as it arrives."""
    import psutil

    cmd = [
        sys.executable,
        "-m",
        f"rlhf_core.jobs.{kind}",
        "--config",
        config,
        "--stage",
        stage,
        f"run_uri={run_uri}",
        *overrides,
    ]
    child_env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "RAY_DEDUP_LOGS": "0",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "PYTHONPATH": os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])]),
        **env,
    }
    proc = subprocess.Popen(
        cmd,
        cwd=root,
        env=child_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,
    )
    try:
        started = psutil.Process(proc.pid).create_time()
    except psutil.NoSuchProcess:
        started = time.time()
    lines: list[tuple[float, str]] = []
    first: list[float] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            now = time.time()
            lines.append((now - started, line.rstrip("\n")))
            if not first:
                offset = first_step_offset(stage, line.rstrip())
                if offset is not None:
                    first.append(now - offset - started)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    code = proc.wait()
    ended = time.time()
    reader.join(timeout=30)
    if log_path is not None:
        log_path.write_text("".join(f"{t:8.2f} {text}\n" for t, text in lines))
    if code != 0:
        tail = "\n".join(text for _, text in lines[-25:])
        raise SystemExit(f"the {stage} job from {root} failed (exit code {code}):\n{tail}")
    final = {}
    metrics = run_uri / stage / "metrics.json"
    if metrics.is_file():
        final = json.loads(metrics.read_text()).get("final", {})
    return StageTiming(stage, kind, ended - started, first[0] if first else None, final.get("startup_s"), lines, final)


def worktree(rev: str) -> Path:
    """A detached worktree of ``rev`` under /tmp (the venv is shared; its code comes first on PYTHONPATH)."""
    sha = subprocess.run(
        ["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()
    path = Path(tempfile.gettempdir()) / f"bench-startup-{sha[:12]}"
    if not (path / "rlhf_core").is_dir():
        shutil.rmtree(path, ignore_errors=True)
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(path), sha], cwd=ROOT, check=True, capture_output=True
        )
    return path


def _env(items: list[str]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in items)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="deployments/configs/tiny.yaml", help="preset, relative to a checkout")
    parser.add_argument("--baseline-rev", help="also measure this git revision (a worktree), interleaved")
    parser.add_argument("--stages", nargs="*", help="only these stages (their inputs run too, unreported)")
    parser.add_argument("--baseline-root", help="a checkout to measure as the baseline instead of --baseline-rev")
    parser.add_argument("--root", help="measure the checkout at this path instead of this one (shared venv)")
    parser.add_argument("--keep", help="write the run dirs and the timestamped job logs here (default: a temp dir)")
    parser.add_argument("--env-after", action="append", default=[], help="KEY=VALUE for the current code's jobs")
    parser.add_argument("--env-before", action="append", default=[], help="KEY=VALUE for the baseline's jobs")
    parser.add_argument("--repeats", type=int, default=1, help="run the whole pipeline this many times (medians)")
    parser.add_argument(
        "--shared-ray",
        nargs="*",
        default=[],
        choices=["before", "after"],
        help="these sides' jobs join a Ray head started for them (the flow's shared_ray)",
    )
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every stage job")
    args = parser.parse_args(argv)

    from rlhf_core.config import load_config

    cfg = load_config(ROOT / args.config, args.overrides)
    order = cfg.order()
    sides: dict[str, tuple[Path, dict[str, str]]] = {}
    if args.baseline_rev or args.baseline_root:
        base = Path(args.baseline_root).resolve() if args.baseline_root else worktree(args.baseline_rev)
        sides["before"] = (base, _env(args.env_before))
    sides["after"] = (Path(args.root).resolve() if args.root else ROOT, _env(args.env_after))
    out = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-startup-"))
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[str, list[StageTiming]]] = {side: {stage: [] for stage in order} for side in sides}
    with contextlib.ExitStack() as heads:
        for side in args.shared_ray:  # one Ray for all of this side's jobs, started before them (the flow's way)
            from rlhf_core.jobs.stage_setup import ray_cpus
            from tasks.launch import HEAD_ENV, ray_head

            cpus = max((c for c in (ray_cpus(cfg.stage(n)) for n in order) if c is not None), default=1)
            address = heads.enter_context(ray_head(cpus))
            sides[side] = (sides[side][0], {**sides[side][1], "RAY_ADDRESS": address, **HEAD_ENV})
        _run_all(args, cfg, order, sides, runs, out)
    _report(args, order, sides, runs, out)


def _run_all(args: argparse.Namespace, cfg, order: list[str], sides: dict, runs: dict, out: Path) -> None:
    for r in range(args.repeats):
        for stage in order:
            for side, (root, env) in sides.items():  # interleaved: both sides see the same drift of the load
                run_uri = out / side / f"run{r}"
                run_uri.mkdir(parents=True, exist_ok=True)
                t = run_stage(
                    root,
                    args.config,
                    stage,
                    cfg.kind(stage),
                    run_uri,
                    args.overrides,
                    env,
                    out / side / f"{stage}-{r}.log",
                )
                runs[side][stage].append(t)
                evaluating = t.final.get("eval_before_s")  # PPO kinds: the evaluation before the first step
                print(
                    f"{side:6s} {stage:14s} startup {_fmt(t.startup_s):>6s} s (metrics {_fmt(t.metrics_s)}, "
                    f"stdout {_fmt(t.stdout_s)}"
                    + (f", of it evaluating {_fmt(evaluating)}" if evaluating else "")
                    + f"), job {t.wall_s:.1f} s",
                    flush=True,
                )


def _report(args: argparse.Namespace, order: list[str], sides: dict, runs: dict, out: Path) -> None:
    shown = [s for s in order if not args.stages or s in args.stages]
    median = {side: {s: statistics.median(t.startup_s for t in runs[side][s]) for s in shown} for side in sides}
    each = " (median of the runs, each run's in brackets)" if args.repeats > 1 else ""
    print(
        f"\n{'stage':14s}"
        + "".join(f" {side + '_s':>9s}" for side in sides)
        + (" ratio" if len(sides) > 1 else "")
        + each
    )
    for stage in shown:
        values = [median[side][stage] for side in sides]
        ratio = f" {values[0] / values[-1]:5.2f}" if len(values) > 1 else ""
        spread = (
            " [" + "; ".join(" ".join(f"{t.startup_s:.1f}" for t in runs[side][stage]) for side in sides) + "]"
            if args.repeats > 1
            else ""
        )
        print(f"{stage:14s}" + "".join(f" {v:9.1f}" for v in values) + ratio + spread)
    if len(sides) > 1:
        for stage in shown:
            finals = [t.results() for side in sides for t in runs[side][stage]]
            keys = set.intersection(*(set(f) for f in finals))
            differ = sorted(k for k in keys if len({json.dumps(f[k]) for f in finals}) > 1)
            values = "; ".join(
                f"{k} " + " / ".join(f"{f[k]:.6g}" if isinstance(f[k], float) else str(f[k]) for f in finals)
                for k in differ
            )
            print(
                f"{stage}: "
                + (
                    f"final metrics differ (each run's, before then after): {values}"
                    if differ
                    else f"the same {len(keys)} final metrics in every run, before and after"
                )
            )
    print(f"(job logs and run dirs: {out})")
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    after = median["after"]
    line = f"startup: max_s={max(after.values()):.1f} " + " ".join(f"{s}_s={v:.1f}" for s, v in after.items())
    if "before" in median:
        line += f" speedup={max(median['before'].values()) / max(after.values()):.2f}"
    print(line)


if __name__ == "__main__":
    main()
