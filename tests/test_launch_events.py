"""The task launcher takes progress and results from the job's events file, not from its log text."""

import pytest

from rlhf_core.storage import ObjectStore
from tasks.launch import StageJobError, launch_stage

JOB = "tests.fixtures.fake_stage_job"


def test_progress_and_result_come_from_events(tmp_path):
    lines, steps = [], []
    ref = launch_stage(
        "sft_b",
        JOB,
        "cfg.yaml",
        ObjectStore(str(tmp_path)),
        lines.append,
        on_event=lambda e: steps.append((e["step"], e["total"])),
    )
    assert steps == [(1, 2), (2, 2)]  # not the 9/9 of the log line, nor the other stage's event
    assert ref["stage"] == "sft_b" and ref["step"] == 2
    assert any("step 9/9" in line for line in lines)  # the log still reaches the run log, unparsed


def test_a_refusing_job_fails_with_its_exit_status(tmp_path):
    with pytest.raises(StageJobError, match="exit code 2[\\s\\S]*error: refused") as caught:
        launch_stage("sft_b", JOB, "fail", ObjectStore(str(tmp_path)), lambda line: None)
    assert caught.value.bad_input


def test_a_worker_whose_node_lacks_the_events_folder_skips_its_step_events(tmp_path, monkeypatch):
    """A rank-0 worker on another node gets the launcher's path, which does not exist there: it must not fail."""
    from rlhf_core import events

    monkeypatch.setenv(events.EVENTS_ENV, str(tmp_path / "not-on-this-node" / "events.jsonl"))
    events.step("sft", 1, 2, {"loss": 1.0})  # no error, nothing written
    assert not (tmp_path / "not-on-this-node").exists()
    monkeypatch.setenv(events.EVENTS_ENV, str(tmp_path / "events.jsonl"))
    events.step("sft", 1, 2, {"loss": 1.0})
    assert events.read_new(tmp_path / "events.jsonl", 0)[0][0]["step"] == 1
