"""No credential appears in any output, log, artifact, manifest, config copy or error message.

Here: the refusals that exit before any worker starts, against the real S3 server (SeaweedFS on loopback) with a known
key and secret (an endpoint with nothing listening, a wrong secret, credentials written in a preset file), and the
config copy a flow saves with a run; every output, log and new Ray session folder they left is searched for the key
and the secret. A worker failure and the resume after it, on S3 with credentials, are searched the same way (with
every object they wrote to the bucket) in tests/jobs/test_store_outage.py; ``search_for_credentials`` below is the
one search of both."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf_core.config import load_config, to_yaml
from tests.conftest import ROOT, TINY

pytestmark = pytest.mark.slow


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_sessions() -> set[Path]:
    """The Ray session folders on this machine now (a job's own local Ray writes its logs in a new one)."""
    return set(Path("/tmp/ray").glob("session_2*"))


def files_under(*paths: Path) -> list[Path]:
    """The files among paths and in the folders among them (a missing path has none)."""
    return [f for p in paths if p.exists() for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file()]


def search_for_credentials(
    credentials: dict[str, str], outputs: dict[str, str | bytes], paths: list[Path], ray_before: set[Path]
) -> dict[str, bytes]:
    """Assert that no credential (name: value) appears in the outputs (where: text or bytes, e.g. a job's output or
    an object it wrote), in a file among or under paths, or in a file of a Ray session folder that appeared since
    ray_before. Returns what was searched (where: bytes), for the caller to check that it covers what it must."""
    time.sleep(1)  # Ray's log monitor flushes its files
    searched = {where: blob if isinstance(blob, bytes) else blob.encode() for where, blob in outputs.items()}
    for path in files_under(*paths, *(ray_sessions() - ray_before)):
        with contextlib.suppress(FileNotFoundError):  # a concurrent test's Ray may remove a file of its session
            searched[str(path)] = path.read_bytes()
    for name, value in credentials.items():
        found = [where for where, blob in searched.items() if value.encode() in blob]
        assert not found, f"the {name} appears in {len(found)} of {len(searched)} outputs/files: {found[:5]}"
    return searched


def test_no_credential_in_any_refusal_or_config_copy(s3_server, tmp_path):
    key, secret = s3_server.key, s3_server.secret
    run_uri = f"s3://{s3_server.bucket}/secrets/{tmp_path.name}"
    logs, work = tmp_path / "logs", tmp_path / "scratch"
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": key,
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_ENDPOINT_URL": s3_server.endpoint_url,
        "RLHF_LOG_DIR": str(logs),
        "RLHF_WORK_DIR": str(work),
    }
    env.pop("RAY_ADDRESS", None)
    ray_before = ray_sessions()
    outputs: dict[str, str] = {}

    def job(name: str, *overrides: str, config: Path = TINY, **extra: str) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "rlhf_core.jobs.sft",
                "--config",
                str(config),
                "--ref-out",
                str(tmp_path / "ref.json"),
                f"run_uri={run_uri}",
                *overrides,
            ],
            cwd=ROOT,
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=600,
        )
        outputs.update({f"{name} stdout": result.stdout, f"{name} stderr": result.stderr})
        return result

    dead = job("dead endpoint", f"storage.endpoint_url=http://127.0.0.1:{closed_port()}")
    assert dead.returncode == 2 and "Traceback" not in dead.stderr, dead.stderr
    assert "127.0.0.1" in dead.stderr  # the line names the location it could not reach
    wrong = job("wrong secret", AWS_SECRET_ACCESS_KEY=secret[::-1])
    assert wrong.returncode == 2 and "Traceback" not in wrong.stderr, wrong.stderr
    # credentials written in a preset file (not the environment), against a dead endpoint
    preset = tmp_path / "with-credentials.yaml"
    text = TINY.read_text().replace("stages:", f"storage: {{key: {key}, secret: {secret}}}\nstages:", 1)
    preset.write_text(text)
    from_file = job(
        "preset file",
        f"storage.endpoint_url=http://127.0.0.1:{closed_port()}",
        config=preset,
        AWS_ACCESS_KEY_ID="",
        AWS_SECRET_ACCESS_KEY="",
    )
    assert from_file.returncode == 2, from_file.stderr
    # the config copy a flow saves with the run, of a config holding both
    outputs["config copy"] = to_yaml(load_config(TINY, [f"storage.key={key}", f"storage.secret={secret}"]))

    credentials = {"key": key, "secret": secret, "wrong secret": secret[::-1]}
    searched = search_for_credentials(credentials, outputs, [logs, work, tmp_path / "ref.json"], ray_before)
    # The search read what could have held them: each refusal's one error line, the copy's storage section.
    for name in ("dead endpoint", "wrong secret", "preset file"):
        assert searched[f"{name} stderr"].decode().count("error: ") == 1, f"{name}: {outputs[f'{name} stderr']}"
    assert "key: '***'" in outputs["config copy"] and "secret: '***'" in outputs["config copy"]
