"""A supervised stage's rank-0 worker reports its steps as structured events (the Ray workers see RLHF_EVENTS_FILE),
and its checkpoints record the ranks that wrote them."""

import json

import pytest

from rlhf_core.jobs import sft
from rlhf_core.storage import ObjectStore
from tests.jobs.conftest import cfg_for

pytestmark = pytest.mark.slow


def test_supervised_steps_reach_the_events_file_from_the_worker(ray_cluster, tmp_path, monkeypatch):
    events_file = tmp_path / "events.jsonl"
    monkeypatch.setenv("RLHF_EVENTS_FILE", str(events_file))
    run_dir = tmp_path / "run"
    overrides = ["sft.data.max_samples=32", "sft.data.eval_path=null", "sft.train.max_steps=2",
                 "sft.train.save_steps=1", "sft.train.log_steps=1"]  # fmt: skip
    sft.run(cfg_for(run_dir, *overrides))

    events = [json.loads(line) for line in events_file.read_text().splitlines()]
    steps = [e for e in events if e["event"] == "step"]
    assert [(e["stage"], e["step"], e["total"]) for e in steps] == [("sft", 1, 2), ("sft", 2, 2)]
    assert set(steps[0]["metrics"]) >= {"loss", "lr"} and isinstance(steps[0]["metrics"]["loss"], float)
    history = json.loads((run_dir / "sft" / "metrics.json").read_text())["history"]
    assert [e["metrics"]["loss"] for e in steps] == [h["loss"] for h in history]
    manifest = ObjectStore(str(run_dir)).read_manifest("sft/checkpoints/step_00000001")
    assert manifest.extra == {"step": 1, "workers": {"strategy.num_workers": 1}}
