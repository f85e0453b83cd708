"""A flow run with ``shared_ray``: its stage jobs join one Ray that the flow starts and stops, instead of each
starting its own (the package's shared_ray fixture is set aside here: RAY_ADDRESS unset)."""

import json

import psutil
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

from flows.rlhf_pipeline import PipelineParams, rlhf_pipeline
from tasks.launch import _HEADS

# make test proves one Ray for a run's jobs on the deployed run (test_pipeline.py::deployed_run, shared_ray)
pytestmark = [pytest.mark.slow, pytest.mark.extended]


def _ray_heads_of_runs() -> list[int]:
    """Processes of any cluster started by tasks.launch.ray_head (their command lines name its /tmp/rlhf-ray-*)."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any("/tmp/rlhf-ray-" in part for part in p.info["cmdline"] or []):
                found.append(p.pid)
        except psutil.Error:
            pass
    return found


def test_the_stage_jobs_of_a_shared_ray_run_join_one_cluster_stopped_after(prefect_server, tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    before = set(_ray_heads_of_runs())
    run_dir = tmp_path / "run"
    params = PipelineParams(preset="sft_chain", run_name="shared", run_uri=str(run_dir), shared_ray=True)
    state = rlhf_pipeline(params, return_state=True)
    summary = state.result()
    assert [row["state"] for row in summary["stages"]] == ["Completed", "Completed"]
    assert not _HEADS and not set(_ray_heads_of_runs()) - before  # the run's Ray is gone
    logs: list = []
    with get_client(sync_client=True) as client:
        run_logs = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id]))
        while page := client.read_logs(log_filter=run_logs, limit=200, offset=len(logs)):
            logs += page
    messages = "\n".join(log.message for log in logs)
    assert "the stage jobs join the run's Ray at 127.0.0.1:" in messages
    address = messages.split("the stage jobs join the run's Ray at ", 1)[1].split()[0]
    # each job connected to that cluster; none started a Ray of its own
    port = address.rsplit(":", 1)[1]  # Ray logs the head by the machine's address
    assert messages.count("Connecting to existing Ray cluster at address: ") == 2, messages[-3000:]
    assert messages.count(f":{port}...") == 2
    assert "Started a local Ray instance" not in messages
    assert json.loads((run_dir / "run_summary.json").read_text())["state"] == "Completed"
