"""fsspec-based artifact/checkpoint store with manifest-last commits.

An artifact directory counts as complete only when its ``manifest.json`` exists and every file it
lists is present with the recorded size and sha256. The manifest is always written last (object
stores have no atomic rename), and deleted first when a directory is overwritten.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from rlhf_core.errors import one_line

MANIFEST_NAME = "manifest.json"
NEXT_SUFFIX = ".next"  # <rel>.next: a new version of rel, written beside it before it replaces rel
#: Fault injection for tests: seconds to sleep after each uploaded file, so that a test can stop the object store
#: in the middle of an upload.
UPLOAD_PAUSE_ENV = "RLHF_UPLOAD_PAUSE_S"
_CHUNK = 4 << 20


class ArtifactError(RuntimeError):
    """An artifact is missing, uncommitted or does not match its manifest."""


class StorageError(ArtifactError):
    """A storage location is unusable: unsupported scheme, unreachable, not writable, or an existing file."""


#: Bounded S3 timeouts (botocore ``Config``) so that an unreachable endpoint fails in seconds, not minutes. s3fs
#: retries each call up to ``S3FileSystem.retries`` (5) times on top of botocore's attempts.
S3_CONFIG_KWARGS: dict[str, Any] = {
    "connect_timeout": 5,
    "read_timeout": 30,
    "retries": {"max_attempts": 2, "mode": "standard"},
}
PROBE_DIR = "_probe"
_LOCAL_SCHEMES = ("", "file", "local")
_S3_SCHEMES = ("s3", "s3a")
_GS_SCHEMES = ("gs", "gcs")


@functools.cache
def _has_gcsfs() -> bool:
    return importlib.util.find_spec("gcsfs") is not None


def _scheme(uri: str) -> str:
    """The first protocol of uri, lower case ('' for a plain local path)."""
    if "::" in uri:  # fsspec chaining, e.g. simplecache::s3://...
        return uri.split("::", 1)[0].split("://", 1)[0].lower()
    return uri.split("://", 1)[0].lower() if "://" in uri else ""


def _secrets(options: dict | None) -> list[str]:
    """Every credential value in fsspec/s3fs storage options (top level and client_kwargs)."""
    opts = dict(options or {})
    names = ("key", "secret", "token", "username", "password")
    client_names = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")
    client = opts.get("client_kwargs") or {}
    vals = [opts.get(n) for n in names + client_names] + [client.get(n) for n in client_names]
    return [str(v) for v in vals if v]


def _endpoint(options: dict | None) -> str:
    opts = dict(options or {})
    url = (opts.get("client_kwargs") or {}).get("endpoint_url") or opts.get("endpoint_url")
    return str(url) if url else "the default AWS endpoint"


def unsupported_scheme(uri: str, what: str = "run_uri") -> str | None:
    """The refusal message when uri's scheme is not one the store supports, else None."""
    scheme = _scheme(uri)
    ok = _LOCAL_SCHEMES + ("memory",) + _S3_SCHEMES + (_GS_SCHEMES if _has_gcsfs() else ())
    if scheme in ok:
        return None
    gs = ", gs://" if _has_gcsfs() else ""
    return f"{what} {uri!r}: scheme {scheme!r} is not supported; use a local path, file://{gs} or s3://"


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
            text = redact(one_line(f"{type(e).__name__}: {e}"), _secrets(self._storage_options))
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


def storage_options_for(
    uri: str,
    *,
    endpoint_url: str | None = None,
    key: str | None = None,
    secret: str | None = None,
    region: str | None = None,
) -> dict:
    """s3fs options for s3:// URIs (explicit values, else AWS_* env vars, and bounded timeouts: ``S3_CONFIG_KWARGS``);
    {} for other schemes."""
    if not str(uri).startswith(("s3://", "s3a://")):
        return {}
    env = os.environ
    key = key or env.get("AWS_ACCESS_KEY_ID")
    secret = secret or env.get("AWS_SECRET_ACCESS_KEY")
    endpoint_url = endpoint_url or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    region = region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    opts: dict[str, Any] = {}
    if key:
        opts["key"] = key
    if secret:
        opts["secret"] = secret
    if env.get("AWS_SESSION_TOKEN") and key == env.get("AWS_ACCESS_KEY_ID"):
        opts["token"] = env["AWS_SESSION_TOKEN"]
    client_kwargs = {}
    if endpoint_url:
        client_kwargs["endpoint_url"] = endpoint_url
    if region:
        client_kwargs["region_name"] = region
    if client_kwargs:
        opts["client_kwargs"] = client_kwargs
    opts["config_kwargs"] = {**S3_CONFIG_KWARGS, "retries": dict(S3_CONFIG_KWARGS["retries"])}
    return opts


def redact(text: str, secrets: Iterable[str | None]) -> str:
    """Replace each non-empty secret in text by '***' (longest first)."""
    for s in sorted({s for s in secrets if s}, key=len, reverse=True):
        text = text.replace(s, "***")
    return text


def check_location(
    uri: str, storage_options: dict | None = None, *, timeout_s: float = 10.0, what: str = "run_uri"
) -> None:
    """Refuse, with one ``StorageError`` line naming the location (``what`` and ``uri``) and the fix, a location the
    run cannot use: an unsupported scheme, an existing file, an unreachable S3 endpoint or missing bucket (bounded by
    about ``timeout_s``), bad credentials, or a folder/prefix where a probe object ``_probe/<random>`` cannot be
    written and deleted. Credentials in ``storage_options`` never appear in the message. Leaves nothing behind."""
    uri = str(uri)
    if msg := unsupported_scheme(uri, what):
        raise StorageError(msg)
    options = dict(storage_options or {})
    where = f"{what} {uri!r}"
    secrets = _secrets(options)
    scheme = _scheme(uri)
    if scheme in _S3_SCHEMES:
        # a private instance with a short budget: one botocore attempt per call, one s3fs try
        config = {**(options.get("config_kwargs") or {})}
        config["connect_timeout"] = min(float(config.get("connect_timeout") or timeout_s), max(timeout_s / 2, 0.5))
        config["read_timeout"] = min(float(config.get("read_timeout") or timeout_s), timeout_s)
        config["retries"] = {"total_max_attempts": 1, "mode": "standard"}
        options = {**options, "config_kwargs": config, "skip_instance_cache": True}
    try:
        fs, root = fsspec.core.url_to_fs(uri.rstrip("/") or "/", **options)
    except Exception as e:
        text = redact(one_line(f"{type(e).__name__}: {e}"), secrets)
        raise StorageError(f"{where}: cannot open it ({text})") from None
    if scheme in _S3_SCHEMES:
        fs.retries = 1
        probe = partial(_check_s3, fs, root.rstrip("/"), where, _endpoint(options), timeout_s)
    elif isinstance(fs, LocalFileSystem):
        probe = partial(_check_local, root.rstrip("/") or "/", where)
    else:
        probe = partial(_check_generic, fs, root.rstrip("/"), where)
    outcome: list[BaseException | None] = []

    def target() -> None:
        try:
            probe()
            outcome.append(None)
        except BaseException as e:  # handed to the caller's thread
            outcome.append(e)

    worker = threading.Thread(target=target, name="check-location", daemon=True)
    worker.start()
    worker.join(timeout_s)  # the S3 calls are bounded by their own timeouts; this is the backstop (a hung mount)
    if not outcome:
        source = f" from {_endpoint(options)}" if scheme in _S3_SCHEMES else ""
        raise StorageError(f"{where}: no answer within {timeout_s:g}s{source}: check that the store is up")
    if (err := outcome[0]) is None:
        return
    if isinstance(err, StorageError):
        raise StorageError(redact(one_line(str(err)), secrets)) from None
    text = redact(one_line(f"{type(err).__name__}: {err}"), secrets)
    raise StorageError(f"{where}: cannot use it ({text})") from None


def _probe_name() -> str:
    return f"{PROBE_DIR}/{uuid.uuid4().hex[:12]}"


def _check_local(root: str, where: str) -> None:
    path = Path(root)
    if path.exists() and not path.is_dir():
        raise StorageError(f"{where} is an existing file, not a folder: give a folder path")
    missing: list[Path] = []  # the folders this check creates (and removes again), deepest first
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    if not p.is_dir():
        raise StorageError(f"{where}: {str(p)!r} is an existing file, not a folder: give a folder path")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / _probe_name()
        probe.parent.mkdir(exist_ok=True)
        try:
            probe.write_bytes(b"")
            probe.unlink()
        finally:
            _rmdir_quiet(probe.parent)
    except PermissionError:
        raise StorageError(
            f"{where}: folder {str(p)!r} is not writable: fix its permissions or use another run_uri"
        ) from None
    except OSError as e:
        raise StorageError(f"{where}: cannot write there ({e.strerror or e})") from None
    finally:
        for d in missing:
            _rmdir_quiet(d)


def _rmdir_quiet(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.rmdir()


def _check_generic(fs: Any, root: str, where: str) -> None:
    if fs.isfile(root):
        raise StorageError(f"{where} is an existing file, not a folder: give a folder path")
    probe = f"{root}/{_probe_name()}"
    fs.pipe_file(probe, b"")
    fs.rm_file(probe)
    fs.invalidate_cache()


def _check_s3(fs: Any, root: str, where: str, endpoint: str, timeout_s: float) -> None:
    from botocore.exceptions import BotoCoreError, NoCredentialsError

    bucket, key, _ = fs.split_path(root)
    if not bucket:
        raise StorageError(f"{where}: no bucket named: use s3://<bucket>/<prefix>")
    creds = "check storage.key and storage.secret (or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)"
    unreachable = (
        f"{where}: cannot reach the S3 endpoint {endpoint} within {timeout_s:g}s: "
        "check storage.endpoint_url (or AWS_ENDPOINT_URL) and that the server is up"
    )
    base = f"{key}/" if key else ""
    step = "bucket"
    try:
        listed = fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=base, MaxKeys=1)
        existed = not key or bool(listed.get("KeyCount"))
        step = "object"
        if key:
            try:
                fs.call_s3("head_object", Bucket=bucket, Key=key)
                raise StorageError(f"{where} is an existing object, not a prefix: give a folder-like prefix")
            except FileNotFoundError:
                pass
        step = "write"
        probe = base + _probe_name()
        fs.call_s3("put_object", Bucket=bucket, Key=probe, Body=b"")
        step = "delete"
        fs.call_s3("delete_object", Bucket=bucket, Key=probe)
        # some servers (SeaweedFS) keep empty folder entries: remove those the probe made
        for marker in [base + PROBE_DIR + "/"] + ([] if existed else [base]):
            with contextlib.suppress(Exception):
                fs.call_s3("delete_object", Bucket=bucket, Key=marker)
    except StorageError:
        raise
    except FileNotFoundError as e:
        if step != "bucket":
            raise
        code = (getattr(e.__cause__, "response", None) or {}).get("Error", {}).get("Code")
        if code == "NoSuchBucket":
            raise StorageError(
                f"{where}: bucket {bucket!r} does not exist at {endpoint}: create it or fix run_uri"
            ) from None
        raise StorageError(
            f"{where}: {endpoint} answered 'not found' ({code}) without naming a missing bucket: is it an S3 "
            "endpoint? check storage.endpoint_url (or AWS_ENDPOINT_URL)"
        ) from None
    except PermissionError:
        if step == "bucket":
            raise StorageError(f"{where}: access to bucket {bucket!r} at {endpoint} denied: {creds}") from None
        action = "delete" if step == "delete" else "write"
        raise StorageError(f"{where}: not allowed to {action} objects at {endpoint}: {creds}") from None
    except NoCredentialsError:
        raise StorageError(f"{where}: no S3 credentials: {creds}") from None
    except (BotoCoreError, OSError, TimeoutError) as e:
        if isinstance(e, (BotoCoreError, TimeoutError, ConnectionError)) or "timeout" in type(e).__name__.lower():
            raise StorageError(unreachable) from None
        raise
