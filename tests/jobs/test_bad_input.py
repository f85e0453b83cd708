"""Bad input fails before any worker starts, with a message naming the file, row or key; nothing is lost."""

import json
import subprocess
import sys

import pytest

from rlhf_core.config import ConfigError, load_config
from rlhf_core.data.loading import DataError
from rlhf_core.jobs import reward_model, sft
from rlhf_core.models.builders import ModelPathError
from rlhf_core.storage import ArtifactError, ObjectStore
from tests.clusters import NoWorkers
from tests.conftest import ROOT, TINY


@pytest.fixture
def no_workers():
    """A cluster that fails the test if a job gets as far as starting its Ray group."""
    return NoWorkers("the job started its workers despite bad input")


def jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def run_sft(tmp_path, *overrides, cluster=None):
    return sft.run(load_config(TINY, [f"run_uri={tmp_path / 'run'}", *overrides]), cluster=cluster)


def test_missing_dataset_key(tmp_path, no_workers):
    data = jsonl(tmp_path / "d.jsonl", [json.dumps({"input": "a", "output": "b"}), json.dumps({"input": "a"})])
    with pytest.raises(DataError, match=r"d.jsonl.*row 2.*'output'"):
        run_sft(tmp_path, f"sft.data.train_path={data}", cluster=no_workers)
    assert not (tmp_path / "run" / "sft").exists()


def test_empty_dataset(tmp_path, no_workers):
    data = jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(DataError, match=r"empty.jsonl.*has no rows"):
        run_sft(tmp_path, f"sft.data.train_path={data}", cluster=no_workers)


def test_malformed_jsonl_line(tmp_path, no_workers):
    data = jsonl(tmp_path / "bad.jsonl", [json.dumps({"input": "a", "output": "b"}), '{"input": "a", "output": '])
    with pytest.raises(DataError, match=r"bad.jsonl.*line 2"):
        run_sft(tmp_path, f"sft.data.train_path={data}", cluster=no_workers)


def test_prompt_longer_than_max_len(tmp_path, no_workers):
    long_prompt = "Write a sentence about " + "the river and " * 40
    data = jsonl(
        tmp_path / "long.jsonl",
        [json.dumps({"input": "a", "output": "b"}), json.dumps({"input": long_prompt, "output": "b"})],
    )
    with pytest.raises(DataError, match=r"long.jsonl row 2: the prompt has \d+ tokens but data.max_len is 64"):
        run_sft(tmp_path, f"sft.data.train_path={data}", cluster=no_workers)


@pytest.mark.parametrize("path", ["/nonexistent/model/dir", "builtin:huge", "no-such-org/no-such-model-xyz"])
def test_unknown_model_path(tmp_path, no_workers, path):
    with pytest.raises(ModelPathError, match=r"'sft.model.name_or_path'"):
        run_sft(tmp_path, f"sft.model.name_or_path={path}", cluster=no_workers)


def test_invalid_config_value(tmp_path):
    with pytest.raises(ConfigError, match=r"invalid value -1.0 for 'sft.optim.lr': must be > 0"):
        run_sft(tmp_path, "sft.optim.lr=-1")


def test_upstream_stage_without_output(tmp_path, no_workers):
    cfg = load_config(TINY, [f"run_uri={tmp_path / 'run'}"])
    with pytest.raises(ArtifactError, match=r"'reward_model.model.name_or_path' = stage:sft: the sft stage has no"):
        reward_model.run(cfg, cluster=no_workers)


def test_bad_data_leaves_a_finished_stage_intact(tmp_path, no_workers):
    # A committed SFT output (made by hand here: any complete artifact will do).
    out = tmp_path / "export"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"weights")
    store = ObjectStore(str(tmp_path / "run"))
    store.put_artifact(str(out), "sft", stage="sft", config_hash="earlier", metrics={"steps": 3})
    data = jsonl(tmp_path / "bad.jsonl", ["not json"])
    with pytest.raises(DataError):
        run_sft(tmp_path, f"sft.data.train_path={data}", cluster=no_workers)
    assert store.read_manifest("sft").config_hash == "earlier"
    assert (tmp_path / "run" / "sft" / "model.safetensors").read_bytes() == b"weights"


def test_command_line_reports_bad_input_with_status_2(tmp_path):
    data = jsonl(tmp_path / "bad.jsonl", [json.dumps({"input": "a", "output": "b"}), "{oops"])
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlhf_core.jobs.sft",
            "--config",
            str(TINY),
            f"run_uri={tmp_path / 'run'}",
            f"sft.data.train_path={data}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "bad.jsonl" in result.stderr and "line 2" in result.stderr
    assert "Traceback" not in result.stderr
