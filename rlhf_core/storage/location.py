"""Where a store may live: the supported schemes, s3fs options and credentials, and the checks of a location.

``unsupported_scheme`` names a scheme the store cannot use; ``storage_options_for`` builds the s3fs options of an
``s3://`` URI (explicit values, else the ``AWS_*`` variables, with bounded timeouts); ``redact`` keeps credentials
out of messages; ``check_location`` refuses, with one ``StorageError`` line, a location a run cannot use (a probe
object written and deleted: ``_check_local``, ``_check_s3``, ``_check_generic``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import threading
import uuid
from collections.abc import Iterable
from functools import partial
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from rlhf_core.errors import one_line
from rlhf_core.storage.errors import StorageError

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


def option_secrets(options: dict | None) -> list[str]:
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
    secrets = option_secrets(options)
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
