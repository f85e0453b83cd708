"""Flow parameters: presets resolve, credentials are refused as parameters (Prefect stores parameters)."""

import pytest
from pydantic import ValidationError

from flows.rlhf_pipeline import PipelineParams, resolve
from rlhf_core.config import ConfigError


def test_preset_and_run_uri_resolve(tmp_path):
    cfg, run_uri = resolve(PipelineParams(preset="tiny", run_name="x", run_uri=str(tmp_path)))
    assert run_uri == str(tmp_path) and cfg.run_uri == str(tmp_path) and cfg.ppo is not None
    _, default_uri = resolve(PipelineParams(preset="tiny", run_name="nightly-1"))
    assert default_uri.endswith("runs/nightly-1")


def test_bad_parameters_are_refused():
    with pytest.raises(ConfigError, match="unknown preset 'nope'"):
        resolve(PipelineParams(preset="nope"))
    with pytest.raises(ConfigError, match="'storage.secret' cannot be a flow parameter"):
        resolve(PipelineParams(overrides=["storage.secret=hunter2"]))
    with pytest.raises(ValidationError):
        PipelineParams(run_name="../escape")
