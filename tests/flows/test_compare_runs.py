"""``rlhf compare`` on two real tiny pipeline runs (the SFT stage only) that differ in the learning rate: the report
names that key, overlays both runs' loss curves and shows different final losses; the ``compare-runs`` flow stores
the same report as the ``run-comparison`` artifact on the Prefect server."""

import json

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
from prefect.client.schemas.sorting import ArtifactSort

from flows.cli import main
from flows.compare import ARTIFACT_KEY, compare_runs
from flows.rlhf_pipeline import PipelineParams, rlhf_pipeline
from rlhf_core import compare
from tests.test_compare import record_figures, section, table

pytestmark = pytest.mark.slow

# 64 rows / batch 16 = 4 steps, each logged.
SMALL = ["sft.data.max_samples=64", "sft.train.log_steps=1"]
LEARNING_RATES = {"lr-low": "1.0e-4", "lr-high": "3.0e-3"}


@pytest.fixture(scope="module")
def two_runs(prefect_server, tmp_path_factory):
    """Two pipeline runs of the tiny preset's SFT stage, one per learning rate: their folders."""
    root = tmp_path_factory.mktemp("compare")
    folders = []
    for name, lr in LEARNING_RATES.items():
        params = PipelineParams(
            preset="tiny",
            run_name=name,
            run_uri=str(root / name),
            stages=["sft"],
            overrides=[*SMALL, f"sft.optim.lr={lr}"],
            task_retries=0,
        )
        summary = rlhf_pipeline(params)
        assert [(row["stage"], row["state"]) for row in summary["stages"]] == [("sft", "Completed")], summary
        folders.append(root / name)
    return folders


def test_compare_overlays_two_real_runs(two_runs, tmp_path, monkeypatch, capsys):
    low, high = two_runs
    drawn = record_figures(monkeypatch)
    out = tmp_path / "report"
    main(["compare", str(low), str(high), "--out", str(out)])
    assert capsys.readouterr().out.strip().endswith(f"report: {out}/compare.md")
    text = (out / "compare.md").read_text()

    # The one config key that differs is the learning rate.
    assert table(section(text, "Config differences")) == {
        "key": ["lr-low", "lr-high"],
        "`sft.optim.lr`": ["0.0001", "0.003"],
    }
    # Both runs' logged loss curves are in the one SFT image.
    histories = {run.name: json.loads((run / "sft" / "metrics.json").read_text())["history"] for run in two_runs}
    assert drawn == {"sft: lr-low vs lr-high": histories}
    assert all(len(h) == 4 and all("loss" in e for e in h) for h in histories.values()), histories
    assert compare.curves.panels(histories.values())[0] == ("loss", ["loss"])
    assert (out / "sft.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    sft = section(text, "sft")
    assert "![sft](sft.png)" in sft
    finals = table(sft)
    assert finals["final metric"] == ["lr-low", "lr-high"]
    loss_low, loss_high = (float(v) for v in finals["`loss_end`"])
    assert loss_low != loss_high and loss_high < loss_low, finals


def test_the_flow_stores_the_report_as_an_artifact(two_runs, tmp_path):
    path = compare_runs([str(p) for p in two_runs], str(tmp_path / "flow-report"))
    assert path == f"{tmp_path}/flow-report/compare.md"
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[ARTIFACT_KEY])), sort=ArtifactSort.CREATED_DESC
        )
    artifact = found[0]  # the newest version of the key
    assert artifact.type == "markdown"
    assert artifact.data.startswith("# Run comparison: lr-low vs lr-high\n")
    assert "`sft.optim.lr`" in artifact.data and "![sft](data:image/png;base64," in artifact.data
