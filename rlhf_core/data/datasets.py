"""Datasets as stage outputs.

The ``generate`` and ``score`` stages commit their rows like the training stages commit models: one file,
``<run_uri>/<stage>/data.jsonl`` (or ``data.parquet``), listed with its size and sha256 in the stage's
``manifest.json``, which is written last and names the file (``extra["dataset"]``). A later stage reads it through
``data.train_path: stage:<name>``: ``dataset_uri`` verifies the manifest (every byte hashed) and hands the file's URI
to the ordinary loader, so that a bad row is reported with the file's location and row number.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from rlhf_core.storage import ArtifactError, Manifest, ObjectStore

FORMATS = ("jsonl", "parquet")


def write_dataset(
    store: ObjectStore,
    stage: str,
    rows: list[dict],
    fmt: str,
    *,
    config_hash: str,
    metrics: dict | None = None,
    extra: dict | None = None,
) -> Manifest:
    """Write ``rows`` as ``<stage>/data.<fmt>`` and commit it (manifest last, the old output removed first)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown dataset format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if not rows:
        raise ValueError(f"{stage}: refusing to commit an empty dataset")
    name = f"data.{fmt}"
    local = Path(tempfile.mkdtemp(prefix=f"{stage}-dataset-"))
    try:
        if fmt == "jsonl":
            with open(local / name, "w", encoding="utf-8", newline="\n") as f:
                for row in rows:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(rows), local / name)
        columns = list(rows[0])
        info = {"dataset": name, "rows": len(rows), "columns": columns, **(extra or {})}
        return store.put_artifact(
            str(local), stage, stage=stage, config_hash=config_hash, metrics=metrics or {}, extra=info
        )
    finally:
        shutil.rmtree(local, ignore_errors=True)


def dataset_uri(store: ObjectStore, name: str, key: str) -> str:
    """URI of stage ``name``'s committed dataset file, after checking every file against its manifest; an
    ``ArtifactError`` naming ``key`` when the stage has no complete output or its output is not a dataset."""
    try:
        manifest = store.read_manifest(name, verify=True)
    except ArtifactError as e:
        raise ArtifactError(f"'{key}' = stage:{name}: the {name} stage has no complete output ({e})") from None
    file = manifest.extra.get("dataset")
    if not file:
        raise ArtifactError(
            f"'{key}' = stage:{name}: the {name} stage's output is a model, not a dataset (a generate or score "
            "stage makes datasets)"
        )
    return store.uri(name, file)


def read_dataset(store: ObjectStore, name: str) -> list[dict[str, Any]]:
    """The rows of a committed dataset (verified), e.g. for tests and reports."""
    from rlhf_core.data.loading import load_rows

    return load_rows(dataset_uri(store, name, f"stage:{name}"), storage_options=store.fs.storage_options)
