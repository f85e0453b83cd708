"""Tests for rlhf_core.storage on a local directory and on a real SeaweedFS S3 server."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from rlhf_core.storage import (
    S3_CONFIG_KWARGS,
    ArtifactError,
    Manifest,
    ObjectStore,
    redact,
    sha256_file,
    storage_options_for,
)
from tests.conftest_s3 import s3_storage_options


def make_dir(root: Path, variant: str = "a") -> Path:
    """A small artifact dir: nested text files and one ~1 MB binary file."""
    (root / "sub" / "deeper").mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(f'{{"variant": "{variant}"}}')
    (root / "sub" / "tokenizer.txt").write_text("hello world\n" * 10)
    (root / "sub" / "deeper" / "weights.bin").write_bytes(os.urandom(1_000_003))
    return root


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "local":
        return ObjectStore(str(tmp_path / "store"))
    server = request.getfixturevalue("s3_server")
    return ObjectStore(f"s3://{server.bucket}/t-{uuid.uuid4().hex[:8]}", s3_storage_options(server))


def test_roundtrip(store: ObjectStore, tmp_path: Path) -> None:
    src = make_dir(tmp_path / "src")
    m = store.put_artifact(src, "models/sft", stage="sft", config_hash="abc", metrics={"loss": 1.5}, extra={"step": 7})
    assert set(m.files) == {"config.json", "sub/tokenizer.txt", "sub/deeper/weights.bin"}
    assert m.files["sub/deeper/weights.bin"] == {
        "size": 1_000_003,
        "sha256": sha256_file(src / "sub/deeper/weights.bin"),
    }
    assert store.is_complete("models/sft")
    got = store.read_manifest("models/sft")
    assert got == m and got.extra == {"step": 7} and got.metrics == {"loss": 1.5}
    assert Manifest.from_json(m.to_json()) == m
    assert store.list_dirs("models") == ["sft"] and store.list_dirs("nope") == []
    assert store.list_dirs("models/sft") == ["sub"]

    out = tmp_path / "out"
    assert store.download_artifact("models/sft", out) == m
    for rel in m.files:
        assert (out / rel).read_bytes() == (src / rel).read_bytes()
    # a downloaded (manifest-bearing) dir can be re-uploaded: the local manifest is not an artifact file
    m2 = store.put_artifact(out, "models/copy", stage="sft", config_hash="abc")
    assert m2.files == m.files

    store.write_json("misc/state.json", {"a": 1})
    assert store.read_json("misc/state.json") == {"a": 1} and store.exists("misc/state.json")
    store.delete("models/copy")
    assert not store.exists("models/copy") and store.list_dirs("models") == ["sft"]
    store.delete("models/never-existed")


def test_missing_manifest_refused(store: ObjectStore, tmp_path: Path) -> None:
    src = make_dir(tmp_path / "src")
    store.upload_files(src, "ckpt/step-1")  # uploaded but never committed
    assert not store.is_complete("ckpt/step-1")
    with pytest.raises(ArtifactError, match="manifest missing") as ei:
        store.read_manifest("ckpt/step-1")
    assert store.uri("ckpt/step-1") in str(ei.value)
    with pytest.raises(ArtifactError, match="manifest missing"):
        store.download_artifact("ckpt/step-1", tmp_path / "out")


def test_same_size_tamper_detected(store: ObjectStore, tmp_path: Path) -> None:
    src = make_dir(tmp_path / "src")
    store.put_artifact(src, "m", stage="rm", config_hash="h")
    tampered = tmp_path / "tampered.txt"
    tampered.write_text("HELLO world\n" * 10)  # same size as sub/tokenizer.txt
    store.fs.put_file(str(tampered), store._path("m", "sub/tokenizer.txt"))
    assert store.read_manifest("m", verify=False).stage == "rm"
    with pytest.raises(ArtifactError, match=r"'sub/tokenizer.txt' sha256 mismatch") as ei:
        store.read_manifest("m")
    assert store.uri("m") in str(ei.value)
    assert not store.is_complete("m")
    with pytest.raises(ArtifactError, match=r"'sub/tokenizer.txt' sha256 mismatch"):
        store.download_artifact("m", tmp_path / "out")
    # a deleted file is reported as missing
    store.fs.rm_file(store._path("m", "config.json"))
    store.fs.invalidate_cache()
    with pytest.raises(ArtifactError, match="missing file 'config.json'"):
        store.read_manifest("m")


def test_overwrite_removes_old_files(store: ObjectStore, tmp_path: Path) -> None:
    store.put_artifact(make_dir(tmp_path / "a"), "art", stage="s", config_hash="1")
    b = tmp_path / "b"
    (b / "other").mkdir(parents=True)
    (b / "other" / "new.txt").write_text("new")
    m = store.put_artifact(b, "art", stage="s", config_hash="2")
    assert set(m.files) == {"other/new.txt"}
    assert not store.exists("art/config.json") and not store.exists("art/sub/deeper/weights.bin")
    assert store.list_dirs("art") == ["other"]
    assert store.read_manifest("art") == m and m.config_hash == "2"


def test_commit_refuses_absent_file(store: ObjectStore, tmp_path: Path) -> None:
    files = store.upload_files(make_dir(tmp_path / "src"), "sharded")  # e.g. rank 1's shard
    with pytest.raises(ArtifactError, match="missing file 'rank0/shard.pt'") as ei:
        store.commit(
            "sharded", stage="ppo", config_hash="x", files={**files, "rank0/shard.pt": {"size": 3, "sha256": "0" * 64}}
        )
    assert store.uri("sharded") in str(ei.value)
    assert not store.exists("sharded/manifest.json")
    bad = dict(files, **{"config.json": {**files["config.json"], "size": 999}})
    with pytest.raises(ArtifactError, match="'config.json' size mismatch"):
        store.commit("sharded", stage="ppo", config_hash="x", files=bad)
    m = store.commit("sharded", stage="ppo", config_hash="x", files=files, extra={"step": 3})
    assert store.read_manifest("sharded") == m


def test_s3_credentials(s3_server, tmp_path: Path) -> None:
    uri = f"s3://{s3_server.bucket}/cred-{uuid.uuid4().hex[:8]}"
    wrong = ObjectStore(
        uri,
        {"key": s3_server.key, "secret": "not-the-secret", "client_kwargs": {"endpoint_url": s3_server.endpoint_url}},
    )
    with pytest.raises(PermissionError):
        wrong.write_text("x.txt", "nope")
    with pytest.raises(PermissionError):
        wrong.put_artifact(make_dir(tmp_path / "src"), "m", stage="s", config_hash="h")

    good = ObjectStore(uri, s3_storage_options(s3_server))
    m = good.put_artifact(make_dir(tmp_path / "src"), "m", stage="s", config_hash="h", metrics={"acc": 1})
    assert good.is_complete("m")
    with pytest.raises(PermissionError):
        wrong.read_manifest("m")
    raw = good.read_text("m/manifest.json")
    for text in (raw, m.to_json(), repr(good), str(good)):
        assert s3_server.secret not in text and s3_server.key not in text
    assert repr(good) == f"ObjectStore({uri!r})"


def test_memory_and_file_uri(tmp_path: Path) -> None:
    for root in (f"file://{tmp_path}/fs-store", f"memory://mem-{uuid.uuid4().hex[:8]}"):
        s = ObjectStore(root)
        m = s.put_artifact(make_dir(tmp_path / "src"), "a/b", stage="s", config_hash="h")
        assert s.read_manifest("a/b") == m and s.list_dirs("a") == ["b"]
        assert s.uri("a/b", "manifest.json") == f"{root}/a/b/manifest.json"
    assert (tmp_path / "fs-store" / "a" / "b" / "manifest.json").is_file()


def test_storage_options_for(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "AWS_REGION",
        "AWS_DEFAULT_REGION",
        "AWS_SESSION_TOKEN",
    ):
        monkeypatch.delenv(var, raising=False)
    bounded = {"config_kwargs": S3_CONFIG_KWARGS}  # bounded botocore timeouts on every s3:// store
    assert storage_options_for("s3://b/p") == bounded
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKENV")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "SKENV")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://generic:1")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    assert storage_options_for("s3://b/p") == {
        "key": "AKENV",
        "secret": "SKENV",
        "client_kwargs": {"endpoint_url": "http://generic:1", "region_name": "eu-west-1"},
        **bounded,
    }
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://s3specific:2")
    assert storage_options_for("s3://b")["client_kwargs"]["endpoint_url"] == "http://s3specific:2"
    explicit = storage_options_for("s3://b", endpoint_url="http://e:3", key="K", secret="S", region="r")
    assert explicit == {
        "key": "K",
        "secret": "S",
        "client_kwargs": {"endpoint_url": "http://e:3", "region_name": "r"},
        **bounded,
    }
    assert storage_options_for("/local/path") == {} and storage_options_for("memory://x") == {}
    assert storage_options_for("file:///tmp/x") == {}


def test_redact_and_path_safety() -> None:
    assert redact("key=AK secret=S3CR3T", ["S3CR3T", "", None]) == "key=AK secret=***"
    assert redact("abcdef", ["abc", "abcdef"]) == "***"
    with pytest.raises(ValueError):
        ObjectStore("memory://x").uri("a/../b")


def test_prefix_siblings_untouched(store: ObjectStore, tmp_path: Path) -> None:
    src = make_dir(tmp_path / "src")
    store.put_artifact(src, "ckpt/step-1", stage="s", config_hash="h")
    store.put_artifact(src, "ckpt/step-10", stage="s", config_hash="h")
    store.put_artifact(src, "ckpt/step-1", stage="s", config_hash="h2")  # clears only step-1
    store.delete("ckpt/step-1")
    assert store.list_dirs("ckpt") == ["step-10"] and store.is_complete("ckpt/step-10")


def test_a_replacement_cut_short_never_loses_the_output(store: ObjectStore, tmp_path: Path) -> None:
    from rlhf_core.storage import next_rel

    old = store.put_artifact(make_dir(tmp_path / "a", "old"), "art", stage="s", config_hash="1")
    new_dir = make_dir(tmp_path / "b", "new")
    staging = next_rel("art")
    assert not store.exists(staging)  # put_artifact leaves nothing beside

    # died uploading the new version: the old one is untouched, and the half upload is dropped
    store.upload_files(new_dir, staging)
    assert store.read_manifest("art") == old
    assert store.recover("art") is False and not store.exists(staging)
    assert store.read_text("art/config.json") == '{"variant": "old"}'

    # died after committing the new version beside, or in the middle of the swap: recover finishes it
    for cut_at in ("committed", "swapping"):
        files = store.upload_files(new_dir, staging)
        store.commit(staging, stage="s", config_hash="2", files=files)
        if cut_at == "swapping":
            store.prepare("art", clear=False)  # the old manifest is gone, the copy had not finished
            store.fs.copy(store._path(staging, "config.json"), store._path("art", "config.json"))
        assert store.recover("art") is True
        assert store.read_manifest("art").config_hash == "2"  # verifies every file's sha256
        assert store.read_text("art/config.json") == '{"variant": "new"}' and not store.exists(staging)
        store.put_artifact(make_dir(tmp_path / "a", "old"), "art", stage="s", config_hash="1")
