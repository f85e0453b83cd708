"""fsspec-based artifact/checkpoint store with manifest-last commits.

An artifact directory counts as complete only when its ``manifest.json`` exists and every file it
lists is present with the recorded size and sha256. The manifest is always written last (object
stores have no atomic rename), and deleted first when a directory is overwritten.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from rlhf_core.errors import one_line
from rlhf_core.storage.errors import ArtifactError, StorageError
from rlhf_core.storage.location import check_location, option_secrets, redact, unsupported_scheme

MANIFEST_NAME = "manifest.json"
NEXT_SUFFIX = ".next"  # <rel>.next: a new version of rel, written beside it before it replaces rel
#: Fault injection for tests: seconds to sleep after each uploaded file, so that a test can stop the object store
#: in the middle of an upload.
UPLOAD_PAUSE_ENV = "RLHF_UPLOAD_PAUSE_S"
_CHUNK = 4 << 20


@dataclass
class Manifest:
    stage: str
    config_hash: str
    files: dict[str, dict]  # relpath -> {"size": int, "sha256": str}
    metrics: dict = field(default_factory=dict)
    created_at: str = ""
    extra: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    def content_hash(self) -> str:
        """sha256 of the file list (names, sizes, sha256s): equal hashes, equal files."""
        return hashlib.sha256(json.dumps(self.files, sort_keys=True).encode()).hexdigest()

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        d = json.loads(text)
        files = d["files"]
        if not isinstance(files, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str)
            for v in files.values()
        ):
            raise ValueError("'files' must map relpath -> {size: int, sha256: str}")
        return cls(
            stage=d["stage"],
            config_hash=d["config_hash"],
            files=files,
            metrics=d.get("metrics") or {},
            created_at=d.get("created_at", ""),
            extra=d.get("extra") or {},
        )


def next_rel(rel: str) -> str:
    """Where a new version of artifact rel is written before it replaces rel (``ObjectStore.put_artifact``)."""
    return rel.rstrip("/") + NEXT_SUFFIX


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a local file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _local_files(local_dir: str | os.PathLike) -> list[tuple[str, str]]:
    """(relpath with '/', absolute path) of every file under local_dir, minus a top-level manifest."""
    root = Path(local_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"not a directory: {root}")
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            if rel != MANIFEST_NAME:
                out.append((rel, str(full)))
    return out


class ObjectStore:
    """Store rooted at a URI: a local path, file://..., memory://..., or s3://bucket/prefix."""

    def __init__(self, root_uri: str, storage_options: dict | None = None) -> None:
        self.root_uri: str = str(root_uri).rstrip("/") or "/"
        self._storage_options = dict(storage_options or {})  # never logged or shown
        if msg := unsupported_scheme(self.root_uri, "store"):  # before fsspec: ftp:// would connect right here
            raise StorageError(msg)
        try:
            self.fs, root = fsspec.core.url_to_fs(self.root_uri, **self._storage_options)
        except Exception as e:  # unknown protocol, missing driver package, bad options: one clear line
            if isinstance(e, ValueError) and "protocol" in str(e).lower() and (msg := unsupported_scheme(root_uri)):
                raise StorageError(msg.replace("run_uri ", "store ", 1)) from None
            text = redact(one_line(f"{type(e).__name__}: {e}"), option_secrets(self._storage_options))
            raise StorageError(f"store {self.root_uri!r}: cannot open it ({text})") from None
        self._root: str = root.rstrip("/")
        self._is_s3 = "s3" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))
        self._is_local = isinstance(self.fs, LocalFileSystem)

    def __repr__(self) -> str:
        return f"ObjectStore({self.root_uri!r})"

    @property
    def local_root(self) -> Path | None:
        """The root as a folder of this machine; None for an object store (``s3://``, ``memory://``)."""
        return Path(self._root) if self._is_local else None

    def check(self, *, timeout_s: float = 10.0, what: str = "run_uri") -> None:
        """``check_location`` of this store's root: refuse (``StorageError``) a root the run cannot use."""
        check_location(self.root_uri, self._storage_options, timeout_s=timeout_s, what=what)

    # ---- paths ----------------------------------------------------------------------------
    @staticmethod
    def _join(base: str, parts: Iterable[str]) -> str:
        segs = [s for p in parts for s in str(p).split("/") if s]
        if ".." in segs:
            raise ValueError(f"'..' not allowed in store paths: {list(parts)}")
        return "/".join([base.rstrip("/")] + segs) if segs else base

    def uri(self, *parts: str) -> str:
        """Join the root URI and relative parts with '/'."""
        return self._join(self.root_uri, parts)

    def _path(self, *parts: str) -> str:
        return self._join(self._root, parts)

    def _mkparent(self, path: str) -> None:
        if self._is_local:
            self.fs.makedirs(self.fs._parent(path), exist_ok=True)

    # ---- plain objects --------------------------------------------------------------------
    def exists(self, rel: str) -> bool:
        self.fs.invalidate_cache()
        return self.fs.exists(self._path(rel))

    def write_text(self, rel: str, text: str) -> None:
        self.write_bytes(rel, text.encode("utf-8"))

    def write_bytes(self, rel: str, data: bytes) -> None:
        p = self._path(rel)
        self._mkparent(p)
        self.fs.pipe_file(p, data)
        self.fs.invalidate_cache()

    def read_text(self, rel: str) -> str:
        self.fs.invalidate_cache()
        return self.fs.cat_file(self._path(rel)).decode("utf-8")

    def write_json(self, rel: str, obj: Any) -> None:
        self.write_text(rel, json.dumps(obj, indent=2, sort_keys=True))

    def read_json(self, rel: str) -> Any:
        return json.loads(self.read_text(rel))

    def list_dirs(self, rel: str = "") -> list[str]:
        """Names of the immediate subdirectories of rel ([] if rel is missing)."""
        self.fs.invalidate_cache()
        try:
            entries = self.fs.ls(self._path(rel), detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory")

    def delete(self, rel: str) -> None:
        """Delete rel recursively; no error if it is missing."""
        p = self._path(rel)
        self.fs.invalidate_cache()
        if self._is_s3:
            files = self.fs.find(p)
            if files:
                self.fs.rm(files)
            self._prune_s3_dirs(p)  # some S3 servers (SeaweedFS) keep empty folder entries
        elif self.fs.exists(p):
            self.fs.rm(p, recursive=True)
        self.fs.invalidate_cache()

    def _prune_s3_dirs(self, path: str) -> None:
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            entries = []
        for e in entries:
            if e.get("type") == "directory" and e["name"].rstrip("/") != path:
                self._prune_s3_dirs(e["name"].rstrip("/"))
        bucket, key, _ = self.fs.split_path(path)
        if key:
            self.fs.call_s3("delete_object", Bucket=bucket, Key=key.rstrip("/") + "/")

    # ---- artifacts ------------------------------------------------------------------------
    def prepare(self, rel: str, *, clear: bool = True) -> None:
        """Un-commit rel (delete its manifest first) and, if clear, remove its old files."""
        mp = self._path(rel, MANIFEST_NAME)
        self.fs.invalidate_cache()
        if self.fs.exists(mp):
            self.fs.rm_file(mp)
        if clear:
            self.delete(rel)

    def upload_files(self, local_dir: str | os.PathLike, rel: str) -> dict[str, dict]:
        """Upload every file under local_dir to rel (no manifest); return their manifest entries."""
        entries: dict[str, dict] = {}
        for relpath, full in _local_files(local_dir):
            entries[relpath] = {"size": os.path.getsize(full), "sha256": sha256_file(full)}
            dest = self._path(rel, relpath)
            self._mkparent(dest)
            self.fs.put_file(full, dest)
            if pause := float(os.environ.get(UPLOAD_PAUSE_ENV) or 0):  # fault injection for tests
                time.sleep(pause)
        self.fs.invalidate_cache()
        return entries

    def commit(
        self,
        rel: str,
        *,
        stage: str,
        config_hash: str,
        files: dict[str, dict],
        metrics: dict | None = None,
        extra: dict | None = None,
    ) -> Manifest:
        """Write manifest.json after checking every listed file exists remotely with the right size."""
        m = Manifest(
            stage=stage,
            config_hash=config_hash,
            files=dict(files),
            metrics=dict(metrics or {}),
            created_at=datetime.now(UTC).isoformat(),
            extra=dict(extra or {}),
        )
        if MANIFEST_NAME in m.files:
            raise ArtifactError(f"{self.uri(rel)}: '{MANIFEST_NAME}' cannot be listed as a file")
        self._verify(rel, m, hash_remote=False)
        mp = self._path(rel, MANIFEST_NAME)
        self._mkparent(mp)
        self.fs.pipe_file(mp, m.to_json().encode("utf-8"))
        self.fs.invalidate_cache()
        return m

    def put_artifact(
        self,
        local_dir: str | os.PathLike,
        rel: str,
        *,
        stage: str,
        config_hash: str,
        metrics: dict | None = None,
        extra: dict | None = None,
        clear: bool = True,
    ) -> Manifest:
        """Upload local_dir beside rel (``<rel>.next``) and commit it there, then replace rel by it (``promote``).

        Until the new copy is complete, rel is left as it was; from then on one of the two is complete at every
        moment, and ``recover`` finishes a replacement that was cut short. ``clear``: files of the old rel that the
        new one does not have are removed (else kept, e.g. a stage's checkpoints under it)."""
        staging = next_rel(rel)
        self.delete(staging)  # a half upload of an earlier attempt
        files = self.upload_files(local_dir, staging)
        self.commit(staging, stage=stage, config_hash=config_hash, files=files, metrics=metrics, extra=extra)
        return self.promote(rel, clear=clear)

    def promote(self, rel: str, *, clear: bool = False) -> Manifest:
        """Replace rel by its committed ``<rel>.next``: rel's manifest removed first, the files copied (hard links on
        a local store), rel committed with the same manifest, then ``<rel>.next`` deleted."""
        staging = next_rel(rel)
        m = self.read_manifest(staging, verify=False)
        self.prepare(rel, clear=clear)
        for name in sorted(m.files):
            src, dest = self._path(staging, name), self._path(rel, name)
            self._mkparent(dest)
            if self._is_local:
                Path(dest).unlink(missing_ok=True)
                try:
                    os.link(src, dest)
                except OSError:  # another device, or no hard links there
                    self.fs.copy(src, dest)
            else:
                self.fs.copy(src, dest)
        self.fs.invalidate_cache()
        out = self.commit(
            rel, stage=m.stage, config_hash=m.config_hash, files=m.files, metrics=m.metrics, extra=m.extra
        )
        self.delete(staging)
        return out

    def recover(self, rel: str) -> bool:
        """Finish a replacement of rel that was cut short: a complete ``<rel>.next`` is promoted, a partial one (an
        upload that did not finish: rel is still the old output) deleted. True when rel was replaced."""
        staging = next_rel(rel)
        if not self.exists(staging):
            return False
        if self.is_complete(staging):
            self.promote(rel)
            return True
        self.delete(staging)
        return False

    def _remote_sizes(self, rel: str) -> dict[str, int]:
        base = self._path(rel).rstrip("/") + "/"
        self.fs.invalidate_cache()
        found = self.fs.find(base.rstrip("/"), detail=True)
        return {name[len(base) :]: int(info["size"]) for name, info in found.items() if name.startswith(base)}

    def _remote_sha256(self, path: str) -> str:
        h = hashlib.sha256()
        with self.fs.open(path, "rb", block_size=_CHUNK) as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        return h.hexdigest()

    def _verify(self, rel: str, m: Manifest, *, hash_remote: bool) -> None:
        sizes = self._remote_sizes(rel)
        for name, ent in sorted(m.files.items()):
            if name not in sizes:
                raise ArtifactError(f"{self.uri(rel)}: missing file {name!r}")
            if sizes[name] != ent["size"]:
                raise ArtifactError(
                    f"{self.uri(rel)}: file {name!r} size mismatch (manifest {ent['size']}, found {sizes[name]})"
                )
            if hash_remote and (got := self._remote_sha256(self._path(rel, name))) != ent["sha256"]:
                raise ArtifactError(
                    f"{self.uri(rel)}: file {name!r} sha256 mismatch "
                    f"(manifest {ent['sha256'][:12]}..., found {got[:12]}...)"
                )

    def read_manifest(self, rel: str, verify: bool = True) -> Manifest:
        """Read rel's manifest; with verify, check every file's presence, size and sha256."""
        self.fs.invalidate_cache()
        try:
            text = self.fs.cat_file(self._path(rel, MANIFEST_NAME))
        except FileNotFoundError:
            raise ArtifactError(f"{self.uri(rel)}: manifest missing (not a committed artifact)") from None
        try:
            m = Manifest.from_json(text)
        except (ValueError, KeyError, TypeError) as e:
            raise ArtifactError(f"{self.uri(rel)}: invalid manifest: {e}") from None
        if verify:
            self._verify(rel, m, hash_remote=True)
        return m

    def is_complete(self, rel: str) -> bool:
        try:
            self.read_manifest(rel, verify=True)
            return True
        except ArtifactError:
            return False

    def download_artifact(
        self,
        rel: str,
        local_dir: str | os.PathLike,
        only: str | None = None,
        keep: Callable[[str], bool] | None = None,
    ) -> Manifest:
        """Download every file in rel's manifest (or those under the subfolder ``only``, and of them those whose
        manifest path ``keep`` accepts) to local_dir, verify sha256, write the manifest last."""
        m = self.read_manifest(rel, verify=False)
        out = Path(local_dir)
        out.mkdir(parents=True, exist_ok=True)
        for name, ent in sorted(m.files.items()):
            if only is not None and not name.startswith(only.rstrip("/") + "/"):
                continue
            if keep is not None and not keep(name):
                continue
            dest = out / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                self.fs.get_file(self._path(rel, name), str(dest))
            except FileNotFoundError:
                raise ArtifactError(f"{self.uri(rel)}: missing file {name!r}") from None
            if (got := sha256_file(dest)) != ent["sha256"]:
                raise ArtifactError(
                    f"{self.uri(rel)}: file {name!r} sha256 mismatch after download "
                    f"(manifest {ent['sha256'][:12]}..., got {got[:12]}...)"
                )
        (out / MANIFEST_NAME).write_text(m.to_json())
        return m
