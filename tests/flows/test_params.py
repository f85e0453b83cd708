"""Flow parameters: presets resolve, credentials are refused as parameters (Prefect stores parameters)."""

import pytest
from pydantic import ValidationError

from flows.rlhf_pipeline import PipelineParams, resolve
from rlhf_core.config import ConfigError


def test_preset_and_run_uri_resolve(tmp_path):
    cfg, run_uri = resolve(PipelineParams(preset="tiny", run_name="x", run_uri=str(tmp_path)))
    assert run_uri == str(tmp_path) and cfg.run_uri == str(tmp_path) and cfg.kind("ppo") == "ppo"
    _, default_uri = resolve(PipelineParams(preset="tiny", run_name="nightly-1"))
    assert default_uri.endswith("runs/nightly-1")


def test_bad_parameters_are_refused():
    with pytest.raises(ConfigError, match="unknown preset 'nope'"):
        resolve(PipelineParams(preset="nope"))
    with pytest.raises(ConfigError, match="'storage.secret' cannot be a flow parameter"):
        resolve(PipelineParams(overrides=["storage.secret=hunter2"]))
    with pytest.raises(ConfigError, match="'run_uri=/tmp/x': the run's location is the run_uri parameter"):
        resolve(PipelineParams(overrides=["run_uri=/tmp/x"]))
    with pytest.raises(ValidationError):
        PipelineParams(run_name="../escape")
    # a reward server's URL may carry a token: not as a parameter (a plain one is fine)
    with pytest.raises(ConfigError, match="'grpo.remote_rm_url': a reward server URL with credentials") as e:
        resolve(PipelineParams(preset="tiny-grpo", overrides=["grpo.remote_rm_url=https://rm.example/score?key=s3cr"]))
    assert "s3cr" not in str(e.value)
    cfg, _ = resolve(PipelineParams(preset="tiny-grpo", overrides=["grpo.remote_rm_url=http://127.0.0.1:9/score"]))
    assert cfg.stage("grpo").remote_rm_url == "http://127.0.0.1:9/score"


def test_cli_resume_of_an_unknown_run_fails_clearly(tmp_path):
    import subprocess
    import sys

    from tests.conftest import ROOT

    result = subprocess.run(
        [sys.executable, "-m", "flows.cli", "resume", "nope", "--run-uri", str(tmp_path / "x")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "no run named 'nope'" in result.stderr, result.stderr
