"""Node-local copies of stage models: each node fetches a committed artifact from the object store once.

A ``stage:<name>`` model lives in the object store. The driver's own download of it sits on the driver's disk, which
other nodes do not see, so roles and engines never get that path: they get a ``StageModel`` (store URI, artifact,
storage options and the content hash of the manifest the driver read) and call ``local_model_path`` in the process
that loads the model. That resolves it to a directory on the caller's node:

- the cache root is ``RLHF_NODE_CACHE`` when set in the worker's environment (set it per node, e.g. in the
  environment of each ``ray start``; it is not forwarded from the driver), else ``<node temp dir>/<session>/
  rlhf-models`` under the Ray node the process runs on (``ray start --temp-dir`` is per node; the cache lives as long
  as the cluster's session), else ``<system temp dir>/rlhf-models`` without Ray;
- a copy is keyed by the artifact's content hash, so a changed artifact is fetched again and an unchanged one is
  shared by every job on the node;
- an exclusive file lock per copy makes concurrent workers on one node download once: the first downloads (every
  file checked against the manifest's sha256), the others wait and reuse it;
- a copy is renamed into place only when complete, and the manifest it was made from must have the content hash the
  driver saw: an artifact rewritten during the job is refused rather than mixed with the old one.

An adapter folder (a LoRA stage's ``lora.export: adapter`` output, or such a folder on disk) resolves to the plain
model it trained: its base is resolved the same way and the adapters merged into it once per copy
(``models.adapter_folder``), so every loader gets a plain Hugging Face folder.

Every download and every use appends a line to ``<cache root>/log.jsonl`` (event, artifact, hash, pid, path): what a
test or an operator reads to see which node used which copy. Other model sources (``builtin:``, local directories,
hub names) pass through unchanged. Storage options (credentials) are never shown: not in ``repr``, logs or errors.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from rlhf_core.storage import MANIFEST_NAME, ArtifactError, Manifest, ObjectStore

CACHE_ENV = "RLHF_NODE_CACHE"
LOG_NAME = "log.jsonl"


@dataclass(frozen=True)
class StageModel:
    """A committed model artifact in the object store, as it travels to roles and engines (plain, picklable data)."""

    root_uri: str  # the store's root
    rel: str  # the artifact, relative to the root (a stage name)
    content_hash: str  # of the manifest's file list when the driver read it
    storage_options: dict = field(default_factory=dict, repr=False, compare=False)  # credentials: never shown

    def __str__(self) -> str:
        return f"{self.root_uri.rstrip('/')}/{self.rel} (content {self.content_hash[:12]})"


ModelSource = str | StageModel


def content_hash(manifest: Manifest) -> str:
    """sha256 of the manifest's file list (names, sizes, sha256s): equal hashes, equal files."""
    return manifest.content_hash()


def stage_model(store: ObjectStore, rel: str) -> StageModel:
    """The reference roles get for the committed artifact ``rel`` of ``store`` (its manifest read now)."""
    manifest = store.read_manifest(rel, verify=False)
    return StageModel(store.root_uri, rel, content_hash(manifest), dict(store.fs.storage_options))


def node_cache_dir() -> Path:
    """This node's cache root (see the module docstring for the order)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    try:
        import ray

        if ray.is_initialized():
            ctx = ray.get_runtime_context()
            return Path(ctx.get_temp_dir()) / ctx.get_session_name() / "rlhf-models"
    except ImportError:
        pass
    return Path(tempfile.gettempdir()) / "rlhf-models"


def local_model_path(source: ModelSource, cache: str | os.PathLike | None = None) -> str:
    """A path this process can load ``source`` from: a ``StageModel`` is fetched into the node cache (once per node
    and content), any other source is returned as it is."""
    root = Path(cache) if cache is not None else node_cache_dir()
    if isinstance(source, StageModel):
        return fetch(source, root)
    from rlhf_core.models.adapter_folder import is_adapter_folder

    return merged_local(source, root) if is_adapter_folder(source) else source


def fetch(ref: StageModel, root: Path) -> str:
    """The node-local copy of ``ref`` under ``root``, downloaded and verified unless it is there already."""
    root.mkdir(parents=True, exist_ok=True)
    name = f"{ref.rel.strip('/').replace('/', '--')}-{ref.content_hash[:16]}"
    final = root / name
    with _locked(root / f"{name}.lock"):
        if not _is_copy_of(final, ref):
            started = time.perf_counter()
            partial = root / f"{name}.partial-{os.getpid()}"
            shutil.rmtree(partial, ignore_errors=True)
            store = ObjectStore(ref.root_uri, ref.storage_options)
            try:
                manifest = store.download_artifact(ref.rel, partial)  # each file's sha256 checked against it
                if content_hash(manifest) != ref.content_hash:
                    raise ArtifactError(
                        f"{store.uri(ref.rel)} changed since the job read its manifest (content "
                        f"{content_hash(manifest)[:12]}, expected {ref.content_hash[:12]}): rerun the stage"
                    )
                partial = _merged_in_place(store, ref, partial, root)
                shutil.rmtree(final, ignore_errors=True)
                partial.rename(final)
            finally:
                shutil.rmtree(partial, ignore_errors=True)
            seconds = time.perf_counter() - started
            _log(root, "download", ref, final, files=len(manifest.files), seconds=round(seconds, 3))
            print(
                f"[node-cache] {store.uri(ref.rel)} -> {final} ({len(manifest.files)} files, {seconds:.1f}s)",
                flush=True,
            )
        _log(root, "use", ref, final)
    return str(final)


def _merged_in_place(store: ObjectStore, ref: StageModel, partial: Path, root: Path) -> Path:
    """A downloaded adapter folder (``lora.export: adapter``) replaced by the plain model it trained: its base
    fetched too (a ``stage:`` base: that output of the same store, refused unless it is the one the adapters were
    trained over) and merged (``models.adapter_folder``); the manifest kept, so the copy is recognised. Any other
    folder as it is."""
    from rlhf_core.models.adapter_folder import STAGE_PREFIX, is_adapter_folder, merge_adapter, read_record

    if not is_adapter_folder(partial):
        return partial
    record = read_record(partial)
    base: str = record.base
    if base.startswith(STAGE_PREFIX):
        current = stage_model(store, base[len(STAGE_PREFIX) :])
        if record.base_content and current.content_hash != record.base_content:
            raise ArtifactError(
                f"{store.uri(ref.rel)} holds adapters trained over another {base} output than "
                f"{store.uri(current.rel)} (content {current.content_hash[:12]}, expected "
                f"{record.base_content[:12]}): rerun {ref.rel}"
            )
        base = fetch(current, root)
    else:
        base = local_model_path(base, root)
    merged = partial.with_name(f"{partial.name}-merged")
    shutil.rmtree(merged, ignore_errors=True)
    try:
        merge_adapter(partial, base, merged)
    except BaseException:
        shutil.rmtree(merged, ignore_errors=True)
        raise
    shutil.copy(partial / MANIFEST_NAME, merged / MANIFEST_NAME)
    shutil.rmtree(partial, ignore_errors=True)
    return merged


def merged_local(path: str, root: Path) -> str:
    """A local adapter folder (a stage's output in a run folder on disk) as the plain model it trained, merged once
    per node into ``root`` (keyed by the adapter files' content), its base resolved beside it
    (``adapter_folder.local_base``)."""
    from rlhf_core.models.adapter_folder import RECORD, local_base, merge_adapter

    digest = hashlib.sha256()
    for name in sorted(p.name for p in Path(path).iterdir() if p.name.startswith("adapter_") or p.name == RECORD):
        digest.update(name.encode() + (Path(path) / name).read_bytes())
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"adapter-{digest.hexdigest()[:16]}"
    with _locked(root / f"{final.name}.lock"):
        if not (final / "config.json").is_file():
            base = local_model_path(local_base(path), root)
            partial = root / f"{final.name}.partial-{os.getpid()}"
            shutil.rmtree(partial, ignore_errors=True)
            try:
                merge_adapter(path, base, partial)
                shutil.rmtree(final, ignore_errors=True)
                partial.rename(final)
            finally:
                shutil.rmtree(partial, ignore_errors=True)
            print(f"[node-cache] {path} merged over {base} -> {final}", flush=True)
    return str(final)


def read_log(root: str | os.PathLike) -> list[dict]:
    """The events of a cache root (``[]`` when nothing was fetched there)."""
    path = Path(root) / LOG_NAME
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _is_copy_of(path: Path, ref: StageModel) -> bool:
    manifest = path / MANIFEST_NAME
    if not manifest.is_file():
        return False
    try:
        return content_hash(Manifest.from_json(manifest.read_text())) == ref.content_hash
    except (ValueError, KeyError, TypeError):
        return False


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _log(root: Path, event: str, ref: StageModel, path: Path, **extra: object) -> None:
    line = {
        "event": event,
        "rel": ref.rel,
        "content_hash": ref.content_hash,
        "pid": os.getpid(),
        "path": str(path),
        "time": time.time(),
        **extra,
    }
    with open(root / LOG_NAME, "a") as f:  # small appends under O_APPEND stay whole lines
        f.write(json.dumps(line) + "\n")
