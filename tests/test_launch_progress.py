"""A progress callback that fails (the Prefect API unreachable from the launcher's thread) does not cost the result."""

from rlhf_core.storage import ObjectStore
from tasks.launch import launch_stage

JOB = "tests.fixtures.fake_stage_job"


def test_a_failing_progress_callback_is_dropped_and_the_result_still_read(tmp_path, capfd):
    calls = []

    def on_event(event: dict) -> None:
        calls.append(event["step"])
        raise ConnectionError("All connection attempts failed")

    ref = launch_stage("sft_b", JOB, "cfg.yaml", ObjectStore(str(tmp_path)), lambda line: None, on_event=on_event)
    assert ref["stage"] == "sft_b" and ref["step"] == 2
    assert calls == [1]  # dropped after its first failure
    assert "progress is no longer reported" in capfd.readouterr().err
