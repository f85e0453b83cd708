"""A stage kind added as CONTRIBUTING.md's "Adding a stage kind" says, from outside the project: the toy ``noop``
kind of ``tests/fixtures/stage_kind_plugin`` (a config section, a ``StageKind`` under the ``rlhf_pipeline.stage_kinds``
entry point, a job module) runs through ``rlhf run``: the Prefect flow on the test's server launches its job, shows
its steps and commits its output. Its own config check refuses bad values before
anything runs."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from rlhf_core.run_layout import metrics
from rlhf_core.storage import ObjectStore
from tests.conftest import ROOT
from tests.flows.test_faults import RLHF, env, states  # noqa: F401 (env: a fixture)

pytestmark = pytest.mark.slow

PLUGIN = ROOT / "tests" / "fixtures" / "stage_kind_plugin"


def rlhf_run(preset, run_dir, environ):
    return subprocess.run(
        [RLHF, "run", str(preset), "--run-uri", str(run_dir), "--no-shared-ray"],
        cwd=ROOT,
        env=environ,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_stage_kind_from_an_entry_point_runs_through_the_flow(env, tmp_path):  # noqa: F811
    environ = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(PLUGIN), env.get("PYTHONPATH")]))}
    preset, run_dir = tmp_path / "noop.yaml", tmp_path / "run"
    preset.write_text("run_uri: unused\nstages:\n  fit:\n    kind: noop\n    steps: 3\n")

    done = rlhf_run(preset, run_dir, environ)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert states(run_dir) == {"fit": "Completed"}
    # w from 0 towards 1 with step 0.25: w = 0.5, 0.75, 0.875 after each step; loss (w - 1)^2 before it: 1, 1/4, 1/16
    history = json.loads(ObjectStore(str(run_dir)).read_text(metrics("fit")))["history"]
    assert [(row["loss"], row["w"]) for row in history] == [(1.0, 0.5), (0.25, 0.75), (0.0625, 0.875)]
    assert "fit: step 3/3" in done.stdout  # the job's step events reached the flow's display
    assert ObjectStore(str(run_dir)).read_manifest("fit").metrics["loss_end"] == 0.0625

    preset.write_text("run_uri: unused\nstages:\n  fit:\n    kind: noop\n    steps: 0\n")
    refused = rlhf_run(preset, tmp_path / "refused", environ)
    assert refused.returncode != 0
    assert "'fit.steps' = 0: give at least 1" in refused.stdout + refused.stderr
