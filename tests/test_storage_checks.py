"""check_location and StorageError: each refusal on its own, local folders and a real SeaweedFS S3 server."""

from __future__ import annotations

import os
import socket
import time
import uuid
from pathlib import Path

import pytest
import s3fs

from rlhf_core.ports import free_port
from rlhf_core.storage import (
    S3_CONFIG_KWARGS,
    ArtifactError,
    ObjectStore,
    StorageError,
    check_location,
    storage_options_for,
)
from tests.conftest_s3 import s3_storage_options

UNREACHABLE_WITHIN_S = 30  # generous: a property (seconds, not minutes), not a benchmark


def refusal(uri: str, options: dict | None = None, **kwargs) -> str:
    with pytest.raises(StorageError) as ei:
        check_location(uri, options, **kwargs)
    text = str(ei.value)
    assert "\n" not in text and repr(uri) in text, text
    return text


def test_storage_error_takes_the_artifact_error_path() -> None:
    assert issubclass(StorageError, ArtifactError)


@pytest.mark.parametrize("uri", ["ftp://host/runs/x", "sftp://host/x", "nosuch://x/y", "simplecache::s3://b/x"])
def test_unsupported_scheme_refused(uri: str) -> None:
    text = refusal(uri)
    scheme = uri.split("::")[0].split("://")[0]
    assert f"scheme '{scheme}' is not supported; use a local path, file://" in text and "s3://" in text


def test_object_store_wraps_construction_errors() -> None:
    for uri in ("nosuch://x/y", "ftp://127.0.0.1:9/x"):  # refused before fsspec (whose ftp:// would connect)
        with pytest.raises(StorageError, match=rf"store '{uri}': scheme '\w+' is not supported"):
            ObjectStore(uri)
    with pytest.raises(StorageError, match=r"store 's3://b/x': cannot open it") as ei:
        ObjectStore("s3://b/x", {"key": "AK1", "username": "AK2", "secret": "s3cr3t-value"})  # s3fs: key or username
    assert "s3cr3t-value" not in str(ei.value)


def test_local_folder_ok_and_left_clean(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "keep.txt").write_text("x")
    for uri in (str(run), f"file://{run}", str(run) + "/"):
        check_location(uri)
    assert sorted(p.name for p in run.iterdir()) == ["keep.txt"]  # the probe and its folder are gone
    new = tmp_path / "a" / "b" / "run"
    check_location(str(new))  # a folder yet to be made is fine, and is not made by the check
    assert not (tmp_path / "a").exists()
    check_location(f"memory://check-{uuid.uuid4().hex[:8]}")
    ObjectStore(str(run)).check()


def test_existing_file_refused(tmp_path: Path) -> None:
    f = tmp_path / "run.txt"
    f.write_text("not a folder")
    assert "is an existing file, not a folder" in refusal(str(f))
    assert "is an existing file, not a folder" in refusal(f"file://{f}")
    with pytest.raises(StorageError, match=r"^run_uri '.*' is an existing file"):
        ObjectStore(str(f)).check()
    text = refusal(str(f / "sub" / "run"))  # under a file
    assert repr(str(f)) in text and "not a folder" in text
    assert f.read_text() == "not a folder"


def test_read_only_folder_refused(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        try:
            (ro / "probe").write_text("x")
            pytest.skip(f"this process (euid {os.geteuid()}) writes to read-only folders anyway")
        except PermissionError:
            pass
        assert "is not writable" in refusal(str(ro))
        assert "is not writable" in refusal(str(ro / "run"))  # the folder to be made is under a read-only one
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o755)


def test_storage_options_bound_s3_timeouts() -> None:
    opts = storage_options_for("s3://b/p", endpoint_url="http://e:3", key="K", secret="S")
    assert opts["config_kwargs"] == S3_CONFIG_KWARGS and opts["config_kwargs"] is not S3_CONFIG_KWARGS
    assert opts["config_kwargs"]["connect_timeout"] <= 10 and opts["config_kwargs"]["retries"]["max_attempts"] <= 3
    fs = s3fs.S3FileSystem(**opts, skip_instance_cache=True)  # s3fs hands config_kwargs to botocore's Config
    assert fs._prepare_config_kwargs()["connect_timeout"] == S3_CONFIG_KWARGS["connect_timeout"]
    assert storage_options_for("/local/x") == {}


# ---- the real S3 server -----------------------------------------------------------------------------------------


def test_s3_reachable_and_writable(s3_server) -> None:
    prefix = f"check-{uuid.uuid4().hex[:8]}"
    uri = f"s3://{s3_server.bucket}/{prefix}"
    check_location(uri, s3_storage_options(s3_server))
    check_location(f"s3://{s3_server.bucket}", s3_storage_options(s3_server))  # the bucket's root
    fs = s3fs.S3FileSystem(**s3_storage_options(s3_server), skip_instance_cache=True)
    assert fs.find(f"{s3_server.bucket}/{prefix}", withdirs=True) == []  # nothing left, not even a folder entry
    assert not fs.exists(f"{s3_server.bucket}/_probe")
    fs.pipe_file(f"{s3_server.bucket}/{prefix}/keep.txt", b"x")  # a prefix in use keeps what it had
    check_location(uri, s3_storage_options(s3_server))
    assert fs.find(f"{s3_server.bucket}/{prefix}") == [f"{s3_server.bucket}/{prefix}/keep.txt"]
    fs.rm_file(f"{s3_server.bucket}/{prefix}/keep.txt")
    # and a store opened with the pipeline's own options (bounded timeouts) still works
    opts = storage_options_for(uri, endpoint_url=s3_server.endpoint_url, key=s3_server.key, secret=s3_server.secret)
    store = ObjectStore(uri, opts)
    store.write_text("x.txt", "ok")
    assert store.read_text("x.txt") == "ok"
    store.delete("x.txt")


def test_s3_missing_bucket_refused(s3_server) -> None:
    text = refusal("s3://no-such-bucket-xyz/run", s3_storage_options(s3_server))
    assert "bucket 'no-such-bucket-xyz' does not exist" in text and s3_server.endpoint_url in text


def test_s3_wrong_credentials_refused(s3_server) -> None:
    wrong = "wrong-" + uuid.uuid4().hex
    opts = {**s3_storage_options(s3_server), "secret": wrong}
    text = refusal(f"s3://{s3_server.bucket}/run", opts)
    assert "denied" in text and "storage.secret" in text and s3_server.endpoint_url in text
    assert wrong not in text and s3_server.secret not in text
    unknown_key = "AKUNKNOWN" + uuid.uuid4().hex[:8].upper()
    text = refusal(f"s3://{s3_server.bucket}/run", {**opts, "key": unknown_key})
    assert unknown_key not in text and wrong not in text


def test_s3_existing_object_refused(s3_server) -> None:
    fs = s3fs.S3FileSystem(**s3_storage_options(s3_server), skip_instance_cache=True)
    path = f"{s3_server.bucket}/obj-{uuid.uuid4().hex[:8]}"
    fs.pipe_file(path, b"data")
    try:
        assert "is an existing object" in refusal(f"s3://{path}", s3_storage_options(s3_server))
    finally:
        fs.rm_file(path)


def test_s3_closed_port_fails_within_bound() -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"
    opts = storage_options_for("s3://bucket/x", endpoint_url=endpoint, key="AKCLOSEDPORT", secret="closed-port-secret")
    started = time.monotonic()
    text = refusal("s3://bucket/x", opts)
    elapsed = time.monotonic() - started
    assert elapsed < UNREACHABLE_WITHIN_S, f"took {elapsed:.1f}s"
    assert f"cannot reach the S3 endpoint {endpoint}" in text and "storage.endpoint_url" in text
    assert "AKCLOSEDPORT" not in text and "closed-port-secret" not in text


def test_s3_silent_endpoint_fails_within_bound() -> None:
    """An endpoint that accepts connections and never answers (a hung server): refused after about timeout_s."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
        opts = storage_options_for("s3://bucket/x", endpoint_url=endpoint, key="AKSILENT", secret="silent-secret")
        started = time.monotonic()
        text = refusal("s3://bucket/x", opts, timeout_s=2.0)
        elapsed = time.monotonic() - started
    assert elapsed < UNREACHABLE_WITHIN_S, f"took {elapsed:.1f}s"
    assert endpoint in text and "silent-secret" not in text and "AKSILENT" not in text
