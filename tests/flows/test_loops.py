"""An iterative-DPO loop as a Prefect flow run against the real server: one task per stage instance, named with its
iteration, the gold reward per iteration as an artifact, and a run stopped in iteration 2 that resumes there without
relaunching iteration 1."""

import json

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterId

from flows.rlhf_pipeline import PipelineParams, rlhf_pipeline
from tests.flows.test_pipeline import launches, states

# make test: the loop's stages in the stage graph (tests/test_loop_config.py), generate, score and DPO as jobs
# (tests/jobs/), a failed run resumed at its failed stage (tests/flows/test_pipeline.py); this flow run is test-all's
pytestmark = [pytest.mark.slow, pytest.mark.extended]

PRESET = "tests/data/loop/iterative_dpo.yaml"
ITERATION = ["generate", "score", "dpo"]
STAGES = ["sft"] + [f"{s}_{i}" for i in (1, 2) for s in ITERATION]


def test_an_iterative_dpo_run_stopped_in_iteration_2_resumes_there(prefect_server, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    # dpo_2 (the only stage that checkpoints) fails on purpose after its checkpoint at step 2
    params = PipelineParams(
        preset=PRESET,
        run_name="iter-dpo",
        run_uri=str(run_dir),
        task_retries=0,
        overrides=["dpo_2.train.save_steps=2"],
    )
    monkeypatch.setenv("RLHF_FAIL_AFTER_STEP", "2")
    with pytest.raises(Exception, match="injected failure after checkpoint at step 2"):
        rlhf_pipeline(params)
    monkeypatch.delenv("RLHF_FAIL_AFTER_STEP")
    failed = json.loads((run_dir / "run_summary.json").read_text())
    assert states(failed) == {**dict.fromkeys(STAGES[:-1], "Completed"), "dpo_2": "Failed"}
    assert launches(run_dir) == STAGES

    state = rlhf_pipeline(params, return_state=True)
    resumed = state.result()
    # iteration 1 (and iteration 2's finished stages) end Cached and are not launched again; dpo_2 resumes
    assert states(resumed) == {**dict.fromkeys(STAGES[:-1], "Cached"), "dpo_2": "Completed"}
    assert launches(run_dir) == STAGES + ["dpo_2"]
    dpo_2 = [r for r in resumed["stages"] if r["stage"] == "dpo_2"][0]
    assert dpo_2["metrics"]["resumed_from_step"] == 2 and dpo_2["metrics"]["steps"] == 4

    # the UI: one task run per instance, named with its iteration, and the gold reward of each iteration's samples
    with get_client(sync_client=True) as client:
        flow_run = FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
        runs = client.read_task_runs(flow_run_filter=flow_run)
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["gold-per-iteration"])),
            flow_run_filter=flow_run,
        )
    assert sorted(r.name for r in runs) == sorted(STAGES)
    assert len(artifacts) == 1
    table = artifacts[0].data if isinstance(artifacts[0].data, list) else json.loads(artifacts[0].data)
    assert [row["iteration"] for row in table] == [1, 2]
    for i, row in zip((1, 2), table):
        generated = json.loads((run_dir / f"generate_{i}" / "manifest.json").read_text())["metrics"]["gold_reward"]
        assert row["generate/gold_reward"] == pytest.approx(generated, abs=1e-4)
    assert resumed["iterations"] == table
