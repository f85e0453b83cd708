"""Experiment trackers (rlhf_core.tracking) with the real packages: TensorBoard event files read back with
TensorBoard's reader, MLflow runs with MlflowClient, W&B offline run files with W&B's own protobuf records."""

import contextlib
import struct
import sys
import time
import warnings
from pathlib import Path

import pytest

from rlhf_core import tracking
from rlhf_core.config import ConfigError, load_config, stage_hash, to_yaml
from rlhf_core.jobs import stage_setup
from rlhf_core.run_layout import open_store
from rlhf_core.storage import ObjectStore
from tests.conftest import TINY

STEPS = [(1, {"loss": 2.0, "lr": 1e-3, "actor_frozen": False, "prompts": [1, 2]}), (2, {"loss": 1.5, "lr": 1e-3})]


def cfg_for(run_uri, *overrides):
    return load_config(TINY, [f"run_uri={run_uri}", *overrides])


def run_stage(cfg, stage="sft", steps=STEPS, fail=False):
    """Open the stage's trackers as a job does, log ``steps``, close them (as failed when ``fail``)."""
    spec = tracking.spec_for(cfg, stage, open_store(cfg))
    with pytest.raises(RuntimeError) if fail else contextlib.nullcontext(), tracking.Tracker(spec) as tracker:
        for step, metrics in steps:
            tracker.log(step, metrics)
        if fail:
            raise RuntimeError("the stage failed")
    return spec


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_records(run_file: Path, wait_s: float = 20.0) -> list:
    """The protobuf records of a W&B ``.wandb`` file, once it holds the run's exit record (wandb's service may still
    be writing it when ``finish`` returns)."""
    deadline = time.monotonic() + wait_s
    records = _read_wandb_file(run_file)
    while not any(r.HasField("exit") for r in records) and time.monotonic() < deadline:
        time.sleep(0.2)
        records = _read_wandb_file(run_file)
    return records


def _read_wandb_file(run_file: Path) -> list:
    """LevelDB log format: 32 KiB blocks of 7-byte-headed chunks, after W&B's 7-byte file header; each record
    decoded with wandb's own ``Record`` message."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    records, pos, chunks = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # block trailer
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
        elif kind == 0:
            break
    return records


# ---------------------------------------------------------------------------------------------------------------------
# Config


def test_tracking_is_off_by_default_and_outside_the_stage_hash(tmp_path):
    off, on = cfg_for(tmp_path), cfg_for(tmp_path, "tracking.tensorboard=true", "tracking.mlflow.experiment=x")
    assert tracking.enabled(off.tracking) == [] and tracking.spec_for(off, "sft", open_store(off)) is None
    assert tracking.enabled(on.tracking) == ["tensorboard", "mlflow"]
    assert stage_hash(off.stage("sft")) == stage_hash(on.stage("sft"))


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("tracking.tensorbord=true", r"unknown config key 'tracking.tensorbord'.*did you mean 'tracking.tensorboard'"),
        (
            "tracking.wandb={project: p, mode: cloud}",
            r"invalid value 'cloud' for 'tracking.wandb.mode': choose one of offline, online",
        ),
        ("tracking.wandb.entity=me", r"missing required config key 'tracking.wandb.project'"),
        ("tracking.tensorboard=maybe", r"invalid value 'maybe' for 'tracking.tensorboard': expected true or false"),
        ("tracking.run_name=a/b", r"'tracking.run_name'.*without '/'"),
        ("tracking.mlflow.experiment=' '", r"'tracking.mlflow.experiment': give a name"),
    ],
)
def test_bad_tracking_keys_are_refused_by_name(tmp_path, override, match):
    with pytest.raises(ConfigError, match=match):
        cfg_for(tmp_path, override)


@pytest.mark.parametrize(
    ("key", "override", "package"),
    [
        ("tensorboard", "tracking.tensorboard=true", "tensorboard"),
        ("mlflow", "tracking.mlflow.experiment=x", "mlflow-skinny"),
        ("wandb", "tracking.wandb.project=p", "wandb"),
    ],
)
def test_a_tracker_without_its_package_is_refused_before_any_worker(tmp_path, monkeypatch, key, override, package):
    monkeypatch.setitem(sys.modules, tracking.PACKAGES[key][0], None)  # as if not installed
    cfg = cfg_for(tmp_path, override)
    with pytest.raises(
        ConfigError,
        match=rf"'tracking.{key}' is set but the {package} package is not installed: "
        rf"pip install {package}",
    ):
        stage_setup.setup_stage(cfg, "sft")


def test_wandb_online_needs_the_key_in_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = cfg_for(tmp_path, "tracking.wandb.project=p", "tracking.wandb.mode=online")
    with pytest.raises(ConfigError, match="'tracking.wandb.mode' = online needs WANDB_API_KEY in the environment"):
        tracking.check(cfg.tracking)


# ---------------------------------------------------------------------------------------------------------------------
# The trackers


def test_tensorboard_writes_one_run_per_stage_under_the_run(tmp_path):
    cfg = cfg_for(tmp_path / "run", "tracking.tensorboard=true")
    run_stage(cfg, "sft")
    run_stage(cfg, "reward_model", [(1, {"loss": 0.7, "acc": 0.5})])
    assert sorted(p.name for p in (tmp_path / "run" / "tensorboard").iterdir()) == ["reward_model", "sft"]
    got = scalars(tmp_path / "run" / "tensorboard" / "sft")
    assert set(got) == {"loss", "lr"}  # non-numeric metrics (bools, prompt lists) left out
    assert got["loss"] == [(1, 2.0), (2, 1.5)]
    assert scalars(tmp_path / "run" / "tensorboard" / "reward_model")["acc"] == [(1, 0.5)]


def test_tensorboard_files_reach_an_object_store(tmp_path):
    cfg = cfg_for("memory://tracking-test/run", "tracking.tensorboard=true")
    run_stage(cfg, "sft")
    store = ObjectStore("memory://tracking-test/run")
    files = store.fs.find(store.fs._strip_protocol("memory://tracking-test/run/tensorboard/sft"))
    assert len(files) == 1 and "tfevents" in files[0]
    local = tmp_path / "copy"
    local.mkdir()
    store.fs.get_file(files[0], str(local / Path(files[0]).name))
    assert scalars(local)["loss"] == [(1, 2.0), (2, 1.5)]


def test_mlflow_run_per_stage_with_params_metrics_and_status(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = cfg_for(tmp_path / "myrun", f"tracking.mlflow.tracking_uri={uri}", "tracking.mlflow.experiment=exp")
    run_stage(cfg, "sft")
    run_stage(cfg, "reward_model", [(1, {"loss": 0.7})], fail=True)
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("exp")
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    assert set(runs) == {"myrun/sft", "myrun/reward_model"}
    sft = runs["myrun/sft"]
    assert sft.info.status == "FINISHED" and runs["myrun/reward_model"].info.status == "FAILED"
    assert [(m.step, m.value) for m in client.get_metric_history(sft.info.run_id, "loss")] == [(1, 2.0), (2, 1.5)]
    assert sft.data.params["optim.lr"] == "0.003" and sft.data.params["model.name_or_path"] == "builtin:tiny"
    assert sft.data.tags["rlhf.kind"] == "sft"


def test_wandb_offline_run_folder_holds_config_and_metrics(tmp_path):
    cfg = cfg_for(tmp_path / "run", "tracking.wandb.project=proj", "tracking.run_name=exp1")
    run_stage(cfg, "sft")
    (run_dir,) = (tmp_path / "run" / "wandb").glob("offline-run-*")
    (run_file,) = run_dir.glob("run-*.wandb")
    records = wandb_records(run_file)
    run = next(r.run for r in records if r.HasField("run"))
    assert (run.project, run.display_name) == ("proj", "exp1/sft")
    config = {item.key or "/".join(item.nested_key): item.value_json for item in run.config.update}
    assert config["optim.lr"] == '"0.003"'
    history = [
        {i.key or "/".join(i.nested_key): i.value_json for i in r.history.item}
        for r in records
        if r.HasField("history")
    ]
    assert [(h["_step"], float(h["loss"])) for h in history] == [("1", 2.0), ("2", 1.5)]
    exit_records = [r.exit for r in records if r.HasField("exit")]
    assert exit_records and exit_records[-1].exit_code == 0


def test_a_failing_tracker_is_dropped_with_one_warning_and_no_credentials(tmp_path, monkeypatch):
    # An MLflow server that is down (a closed port) with credentials in its URI; TensorBoard goes on.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    uri = "http://alice:s3cr3t-pw@127.0.0.1:9/mlflow"
    cfg = cfg_for(tmp_path / "run", "tracking.tensorboard=true", f"tracking.mlflow.tracking_uri={uri}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_stage(cfg, "sft")
    ours = [w for w in caught if "tracking." in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    text = str(ours[0].message)
    assert "tracking.mlflow: opening failed" in text and "the stage goes on without it" in text
    assert "s3cr3t-pw" not in text and "alice" not in text
    assert scalars(tmp_path / "run" / "tensorboard" / "sft")["loss"] == [(1, 2.0), (2, 1.5)]
    assert "s3cr3t-pw" not in to_yaml(cfg) and "127.0.0.1:9/mlflow" in to_yaml(cfg)
    for path in (tmp_path / "run").rglob("*"):
        assert not path.is_file() or b"s3cr3t-pw" not in path.read_bytes(), path


def test_a_tracker_failing_mid_run_is_dropped_and_the_others_go_on(tmp_path):
    cfg = cfg_for(
        tmp_path / "run", "tracking.tensorboard=true", f"tracking.mlflow.tracking_uri=sqlite:///{tmp_path}/m.db"
    )
    spec = tracking.spec_for(cfg, "sft", open_store(cfg))
    tracker = tracking.Tracker(spec)
    assert [logger.key for logger in tracker.loggers] == ["tensorboard", "mlflow"]
    tracker.log(1, {"loss": 2.0})
    mlflow_logger = tracker.loggers[1]
    mlflow_logger.run_id = "no-such-run"  # the server lost the run: every later call raises
    with pytest.warns(RuntimeWarning, match=r"\[sft\] tracking.mlflow: logging failed") as caught:
        tracker.log(2, {"loss": 1.5})
        tracker.log(3, {"loss": 1.0})
        tracker.close()
    assert len([w for w in caught if "tracking." in str(w.message)]) == 1
    assert [logger.key for logger in tracker.loggers] == []
    assert scalars(tmp_path / "run" / "tensorboard" / "sft")["loss"] == [(1, 2.0), (2, 1.5), (3, 1.0)]


def test_params_redact_storage_and_reward_server_secrets(tmp_path):
    cfg = cfg_for(
        tmp_path / "run",
        "tracking.tensorboard=true",
        "storage.key=AKIA-probe",
        "storage.secret=sekrit",
        "ppo.remote_rm_url=http://u:tok3n@127.0.0.1:1/score",
    )
    spec = tracking.spec_for(cfg, "ppo", open_store(cfg))
    flat = " ".join(f"{k}={v}" for k, v in spec.params.items())
    assert "tok3n" not in flat and "sekrit" not in flat and "AKIA-probe" not in flat
    assert spec.params["remote_rm_url"] == "http://127.0.0.1:1/score"
    assert "sekrit" not in repr(spec)
