"""Storage locations a stage job cannot use: refused with exit status 2 and one line naming the location and the fix
(``rlhf_core.storage.check_location`` in ``rlhf_core.run_layout.open_store``), never a library traceback, and
never a credential in the line. Each case overrides ``run_uri`` after the harness's own (the later one wins); the
harness's run folder stays untouched."""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

import pytest

from rlhf_core.ports import free_port

AWS_VARS = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_PROFILE",
)


@pytest.fixture
def aws_env(monkeypatch) -> dict[str, str]:
    """Known AWS credentials in the environment (and no other AWS settings)."""
    for var in AWS_VARS:
        monkeypatch.delenv(var, raising=False)
    env = {"AWS_ACCESS_KEY_ID": "AKENV" + uuid.uuid4().hex[:10].upper(), "AWS_SECRET_ACCESS_KEY": uuid.uuid4().hex}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


def read_only_folder(path: Path) -> Path:
    """A folder this process cannot write to; skips when it can anyway (root, or CAP_DAC_OVERRIDE)."""
    path.mkdir()
    path.chmod(0o555)
    try:
        (path / "probe").write_text("x")
    except PermissionError:
        return path
    (path / "probe").unlink()
    path.chmod(0o755)
    pytest.skip(f"this process (euid {os.geteuid()}) writes to read-only folders anyway")


def test_run_uri_is_an_existing_file(tmp_path, refused):
    f = tmp_path / "notes.txt"
    f.write_text("not a run folder\n")
    refused("sft", f"run_uri={f}", match=rf"run_uri '{re.escape(str(f))}' is an existing file, not a folder")
    assert f.read_text() == "not a run folder\n"


def test_run_uri_under_an_existing_file(tmp_path, refused):
    f = tmp_path / "notes.txt"
    f.write_text("x")
    refused("sft", f"run_uri={f}/run", match=rf"'{re.escape(str(f))}' is an existing file, not a folder")


def test_unsupported_scheme(refused):
    refused(
        "sft",
        "run_uri=ftp://files.example.com/runs/x",
        match=r"(run_uri|store) 'ftp://files.example.com/runs/x': scheme 'ftp' is not supported; use a local path, file://",
    )


def test_read_only_folder(tmp_path, refused):
    ro = read_only_folder(tmp_path / "ro")
    try:
        refused(
            "sft",
            f"run_uri={ro}",
            match=rf"run_uri '{re.escape(str(ro))}': folder '{re.escape(str(ro))}' is not writable",
        )
        refused("sft", f"run_uri={ro}/run", match=rf"folder '{re.escape(str(ro))}' is not writable")
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o755)


def test_s3_endpoint_on_a_closed_port(aws_env, refused):
    endpoint = f"http://127.0.0.1:{free_port()}"
    line = refused(
        "sft",
        f"storage.endpoint_url={endpoint}",
        "run_uri=s3://bucket/x",
        match=rf"run_uri 's3://bucket/x': cannot reach the S3 endpoint {re.escape(endpoint)}",
    )
    assert aws_env["AWS_ACCESS_KEY_ID"] not in line and aws_env["AWS_SECRET_ACCESS_KEY"] not in line


def test_s3_missing_bucket(s3_server, aws_env, refused):
    uri = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run"
    line = refused(
        "sft",
        f"storage.endpoint_url={s3_server.endpoint_url}",
        f"storage.key={s3_server.key}",
        f"storage.secret={s3_server.secret}",
        f"run_uri={uri}",
        match=rf"run_uri '{uri}': bucket 'no-such-bucket-\w+' does not exist at {re.escape(s3_server.endpoint_url)}",
    )
    assert s3_server.key not in line and s3_server.secret not in line


def test_s3_wrong_secret(s3_server, aws_env, refused):
    wrong, endpoint = "wrong-" + uuid.uuid4().hex, s3_server.endpoint_url
    uri = f"s3://{s3_server.bucket}/run-{uuid.uuid4().hex[:8]}"
    line = refused(
        "sft",
        f"storage.endpoint_url={s3_server.endpoint_url}",
        f"storage.key={s3_server.key}",
        f"storage.secret={wrong}",
        f"run_uri={uri}",
        match=rf"run_uri '{uri}': access to bucket '{s3_server.bucket}' at {re.escape(endpoint)} denied: check",
    )
    assert wrong not in line and s3_server.secret not in line and s3_server.key not in line


def test_s3_unknown_key_from_the_environment(s3_server, aws_env, refused):
    """Credentials from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY that the server does not know."""
    uri = f"s3://{s3_server.bucket}/run-{uuid.uuid4().hex[:8]}"
    line = refused(
        "sft",
        f"storage.endpoint_url={s3_server.endpoint_url}",
        f"run_uri={uri}",
        match=rf"run_uri '{uri}': access to bucket '{s3_server.bucket}' .* denied: check storage.key",
    )
    assert aws_env["AWS_ACCESS_KEY_ID"] not in line and aws_env["AWS_SECRET_ACCESS_KEY"] not in line
