"""No credential appears in any output, log, artifact, manifest, config copy or error message: stage jobs run against
the real S3 server (SeaweedFS on loopback) with a known key and secret, through a worker failure, a resume, an
endpoint with nothing listening and a wrong secret; then every byte they left is searched for the key and secret."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import s3fs

from rlhf_core.config import load_config, to_yaml
from tests.conftest import ROOT, TINY

pytestmark = pytest.mark.slow

FAST = ["sft.data.max_samples=48", "sft.train.save_steps=1", "sft.train.max_steps=3"]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def files_under(*folders: Path) -> list[Path]:
    return [p for folder in folders if folder.exists() for p in folder.rglob("*") if p.is_file()]


def test_no_credential_in_any_output_log_or_artifact(s3_server, tmp_path):
    key, secret = s3_server.key, s3_server.secret
    run_uri = f"s3://{s3_server.bucket}/secrets/{tmp_path.name}"
    logs, work = tmp_path / "logs", tmp_path / "scratch"
    env = {**os.environ, "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret,
           "AWS_ENDPOINT_URL": s3_server.endpoint_url, "RLHF_LOG_DIR": str(logs),
           "RLHF_WORK_DIR": str(work)}  # fmt: skip
    env.pop("RAY_ADDRESS", None)
    ray_sessions = set(Path("/tmp/ray").glob("session_2*"))
    outputs: list[str] = []

    def job(*overrides: str, config: Path = TINY, **extra: str) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [sys.executable, "-m", "rlhf_core.jobs.sft", "--config", str(config),
             "--ref-out", str(tmp_path / "ref.json"), f"run_uri={run_uri}", *FAST, *overrides],
            cwd=ROOT, env={**env, **extra}, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        outputs.extend([result.stdout, result.stderr])
        return result

    failed = job(RLHF_FAIL_AFTER_STEP="2")  # a worker fails: one line, the traceback in the log folder
    assert failed.returncode == 1, failed.stderr
    assert "SupervisedTrainer rank 0 failed: RuntimeError: injected failure" in failed.stderr
    assert len(files_under(logs)) == 1
    resumed = job()
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((tmp_path / "ref.json").read_text())["metrics"]["resumed_from_step"] == 2

    dead = job(f"storage.endpoint_url=http://127.0.0.1:{closed_port()}", "sft.optim.lr=1e-3")
    assert dead.returncode == 2 and "Traceback" not in dead.stderr, dead.stderr
    assert "127.0.0.1" in dead.stderr  # the line names the location it could not reach
    wrong = job("sft.optim.lr=1e-3", AWS_SECRET_ACCESS_KEY=secret[::-1])
    assert wrong.returncode == 2 and "Traceback" not in wrong.stderr, wrong.stderr
    # credentials written in a preset file (not the environment), against a dead endpoint
    in_file = load_config(TINY, [f"storage.key={key}", f"storage.secret={secret}"])
    preset = tmp_path / "with-credentials.yaml"
    text = TINY.read_text().replace("stages:", f"storage: {{key: {key}, secret: {secret}}}\nstages:", 1)
    preset.write_text(text)
    from_file = job(f"storage.endpoint_url=http://127.0.0.1:{closed_port()}", config=preset,
                    AWS_ACCESS_KEY_ID="", AWS_SECRET_ACCESS_KEY="")  # fmt: skip
    assert from_file.returncode == 2, from_file.stderr
    outputs.append(to_yaml(in_file))  # the config copy a flow saves with the run

    fs = s3fs.S3FileSystem(key=key, secret=secret, client_kwargs={"endpoint_url": s3_server.endpoint_url},
                           skip_instance_cache=True)  # fmt: skip
    objects = fs.find(run_uri)
    assert any(o.endswith("sft/manifest.json") for o in objects)
    artifacts = [fs.cat_file(o) for o in objects]
    time.sleep(1)  # Ray's log monitor flushes its files
    left = files_under(logs, work, tmp_path / "ref.json", *(set(Path("/tmp/ray").glob("session_2*")) - ray_sessions))
    blobs = [t.encode() for t in outputs] + artifacts + [p.read_bytes() for p in left]
    assert len(blobs) > len(outputs) + 10  # searched the artifacts and the logs, not only the output
    for name, value in (("key", key), ("secret", secret), ("wrong secret", secret[::-1])):
        found = [i for i, blob in enumerate(blobs) if value.encode() in blob]
        assert not found, f"the {name} appears in {len(found)} outputs/files"
