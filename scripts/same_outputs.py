"""Check that two runs of the same preset gave the same results, bit for bit: every stage's ``metrics.json`` values
(wall-clock values and Ray placement-group ids left out: they differ between any two runs), every tensor of every
weight file (``*.safetensors``), compared with ``torch.equal``, and every other file byte for byte (datasets, config,
tokenizer, reference log-probs), except the manifest (its commit time) and the curves (they plot the timings).
Used to show that a change of structure left the behaviour as it was: run the pipeline at both commits on CPU with the
same preset and seeds, then compare.

    python -m rlhf_core.jobs.pipeline --config deployments/configs/tiny.yaml run_uri=/tmp/before   # old commit
    python -m rlhf_core.jobs.pipeline --config deployments/configs/tiny.yaml run_uri=/tmp/after    # new commit
    python scripts/same_outputs.py /tmp/before /tmp/after

Prints one line per stage and exits 1 when anything differs (naming the metric, the tensor or the file).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

# Measured time and where Ray put the groups: not results.
WALL_CLOCK_SUFFIXES = ("_s", "_s_mean", "_s_total", "_s_max")
NOT_RESULTS = frozenset({"placement"})


def is_wall_clock(key: str) -> bool:
    return key.startswith("timing/") or key.endswith(WALL_CLOCK_SUFFIXES)


def results(metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics.json`` without its wall-clock values: ``final`` and each ``history`` row filtered."""

    def keep(row: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in row.items() if not is_wall_clock(k)}

    out = {k: v for k, v in metrics.items() if k not in NOT_RESULTS}
    if isinstance(out.get("final"), dict):
        out["final"] = keep(out["final"])
    if isinstance(out.get("history"), list):
        out["history"] = [keep(row) for row in out["history"]]
    return out


def differences(a: Any, b: Any, where: str) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        found = [f"{where}.{k}: only in one run" for k in sorted(set(a) ^ set(b))]
        for k in sorted(set(a) & set(b)):
            found += differences(a[k], b[k], f"{where}.{k}")
        return found
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def compare_stage(a: Path, b: Path) -> tuple[list[str], str]:
    found: list[str] = []
    checked = []
    metrics_a, metrics_b = a / "metrics.json", b / "metrics.json"
    if metrics_a.exists() or metrics_b.exists():
        if not (metrics_a.exists() and metrics_b.exists()):
            found.append("metrics.json: only in one run")
        else:
            ra, rb = (results(json.loads(p.read_text())) for p in (metrics_a, metrics_b))
            found += differences(ra, rb, "metrics")
            checked.append(f"{sum(len(r) for r in ra.get('history', []))} history values")
    files_a = sorted(p.relative_to(a) for p in a.glob("*.safetensors"))
    files_b = sorted(p.relative_to(b) for p in b.glob("*.safetensors"))
    if files_a != files_b:
        found.append(f"weight files differ: {[str(p) for p in files_a]} != {[str(p) for p in files_b]}")
    tensors = 0
    for rel in sorted(set(files_a) & set(files_b)):
        ta, tb = load_file(str(a / rel)), load_file(str(b / rel))
        if set(ta) != set(tb):
            found.append(f"{rel}: tensor names differ")
        for name in sorted(set(ta) & set(tb)):
            tensors += 1
            if ta[name].dtype != tb[name].dtype or not torch.equal(ta[name], tb[name]):
                found.append(f"{rel}:{name}: not equal")
    checked.append(f"{tensors} tensors in {len(files_a)} weight files")
    others_a, others_b = (
        sorted(p.name for p in d.glob("*") if p.is_file() and not _compared_apart(p)) for d in (a, b)
    )
    if others_a != others_b:
        found.append(f"other files differ: {others_a} != {others_b}")
    same = [
        name for name in sorted(set(others_a) & set(others_b)) if (a / name).read_bytes() == (b / name).read_bytes()
    ]
    found += [f"{name}: bytes differ" for name in sorted(set(others_a) & set(others_b)) if name not in same]
    checked.append(f"{len(same)} other files byte for byte")
    return found, ", ".join(checked)


def _compared_apart(path: Path) -> bool:
    """Weights and metrics are compared above; the manifest holds its commit time, the curves plot the timings."""
    return path.suffix == ".safetensors" or path.name in ("metrics.json", "manifest.json", "curves.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    args = parser.parse_args(argv)
    stages = sorted(
        {p.parent.relative_to(args.run_a) for p in args.run_a.rglob("manifest.json")}
        | {p.parent.relative_to(args.run_b) for p in args.run_b.rglob("manifest.json")}
    )
    if not stages:
        print(f"error: no committed stage (manifest.json) under {args.run_a} or {args.run_b}", file=sys.stderr)
        return 2
    failed = False
    for stage in stages:
        found, checked = compare_stage(args.run_a / stage, args.run_b / stage)
        print(f"{str(stage):20s} {'DIFFERENT' if found else 'same'}: {checked}")
        for line in found[:20]:
            print(f"    {line}")
        failed |= bool(found)
    print(f"same_outputs: identical={str(not failed).lower()} stages={len(stages)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
