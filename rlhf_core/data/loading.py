"""Load rows (a list of dicts) from local files, fsspec URLs or the HF hub.

``load_rows(source, split=..., storage_options=..., max_rows=...)`` accepts:

* a local file: ``.jsonl`` (parsed line by line here, so a malformed line is
  reported with its 1-based line number; blank lines are skipped), ``.json``
  (a list of objects, an object holding a list under the split name or
  ``"data"``, or JSON lines), ``.parquet`` (pyarrow) or ``.csv``; any of these
  may be gzip-compressed (``.jsonl.gz`` ...);
* a folder written by ``datasets.Dataset.save_to_disk`` or
  ``DatasetDict.save_to_disk`` (``split`` picks the split of a DatasetDict);
* a folder of data files: the files whose relative path contains ``split`` as
  a word (``train.jsonl``, ``sft_train.jsonl``, ``train-00000-of-00001.parquet``,
  ``train/part0.csv``); if no file name mentions any split at all, every file;
* an ``s3://``, ``gs://``, ``memory://`` ... fsspec URL to a file or folder of
  the kinds above, opened with ``storage_options``;
* otherwise a Hugging Face hub dataset name (``datasets.load_dataset(name,
  split=split)``).

Every problem raises :class:`DataError` whose message names the source and,
when known, the row/line and key.  ``datasets``, ``fsspec`` and ``pyarrow`` are
imported lazily.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import os
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path, PurePosixPath
from typing import IO, Any

__all__ = ["DataError", "load_rows", "require_keys", "DATA_EXTENSIONS"]

#: File kinds load_rows reads (optionally followed by ".gz").
DATA_EXTENSIONS = (".jsonl", ".json", ".parquet", ".csv")

_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
# owner/name or name, as accepted by the hub.
_HUB_ID_RE = re.compile(r"^(?:[A-Za-z0-9][\w.\-]*/)?[A-Za-z0-9][\w.\-]*$")
_SPLIT_WORDS = ("train", "training", "test", "testing", "eval", "evaluation", "validation", "valid", "val", "dev")
_DATASET_MARKERS = ("dataset_dict.json", "state.json")


class DataError(ValueError):
    """A data source could not be read or does not have the expected shape.

    The message always names the source and, when known, the row (for JSONL
    files the 1-based line number) and the key.  The pieces are also available
    as attributes ``source``, ``row``, ``key``.
    """

    def __init__(
        self,
        message: str,
        *,
        source: str | None = None,
        row: int | None = None,
        key: str | None = None,
        row_label: str = "row",
    ) -> None:
        self.source, self.row, self.key, self.reason = source, row, key, message
        parts = []
        if source is not None:
            parts.append(str(source))
        if row is not None:
            parts.append(f"{row_label} {row}")
        if key is not None:
            parts.append(f"key {key!r}")
        super().__init__(": ".join(parts + [message]) if parts else message)


# --------------------------------------------------------------------------- helpers


def _strip_gz(name: str) -> tuple[str, bool]:
    lower = name.lower()
    if lower.endswith(".gz"):
        return name[:-3], True
    return name, False


def _data_ext(name: str) -> str | None:
    """The data extension of a file name (ignoring a trailing .gz), else None."""
    base, _ = _strip_gz(name)
    base = base.lower()
    for ext in DATA_EXTENSIONS:
        if base.endswith(ext):
            return ext
    return None


def _check_row(obj: Any, source: str, row: int, row_label: str = "row") -> dict:
    if not isinstance(obj, dict):
        raise DataError(
            f"expected a JSON object, got {type(obj).__name__}",
            source=source,
            row=row,
            row_label=row_label,
        )
    return obj


def _parse_jsonl(lines: Iterable[str], source: str, max_rows: int | None) -> list[dict]:
    rows: list[dict] = []
    for lineno, line in enumerate(lines, start=1):
        if max_rows is not None and len(rows) >= max_rows:
            break
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                f"invalid JSON ({e.msg} at column {e.colno})", source=source, row=lineno, row_label="line"
            ) from None
        rows.append(_check_row(obj, source, lineno, "line"))
    return rows


def _parse_json(text: str, source: str, split: str, max_rows: int | None) -> list[dict]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        # Not one JSON document: treat as JSON lines (errors name the line).
        return _parse_jsonl(io.StringIO(text), source, max_rows)
    if isinstance(obj, dict):
        for k in (split, "data", "rows"):
            if isinstance(obj.get(k), list):
                obj = obj[k]
                break
        else:
            obj = [obj]
    if not isinstance(obj, list):
        raise DataError(f"expected a JSON list of objects, got {type(obj).__name__}", source=source)
    if max_rows is not None:
        obj = obj[:max_rows]
    return [_check_row(o, source, i) for i, o in enumerate(obj, start=1)]


def _parse_csv(text_stream: IO[str], source: str, max_rows: int | None) -> list[dict]:
    reader = csv.DictReader(text_stream)
    rows: list[dict] = []
    try:
        for row in reader:
            if max_rows is not None and len(rows) >= max_rows:
                break
            if None in row:
                raise DataError(
                    "more fields than the header has columns", source=source, row=reader.line_num, row_label="line"
                )
            rows.append(dict(row))
    except csv.Error as e:
        raise DataError(f"invalid CSV ({e})", source=source, row=reader.line_num, row_label="line") from None
    return rows


def _parse_parquet(binary: IO[bytes], source: str, max_rows: int | None) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(binary)
    except Exception as e:  # pyarrow raises several types
        raise DataError(f"cannot read Parquet ({e})", source=source) from None
    if max_rows is not None:
        table = table.slice(0, max_rows)
    return table.to_pylist()


def _read_file(
    opener: Callable[[], IO[bytes]], name: str, source: str, split: str, max_rows: int | None
) -> list[dict]:
    """Read one data file given a function that opens it in binary mode."""
    ext = _data_ext(name)
    if ext is None:
        raise DataError(
            f"unsupported file type (expected one of {', '.join(DATA_EXTENSIONS)}, optionally .gz)", source=source
        )
    _, gz = _strip_gz(name)
    try:
        with opener() as raw:
            binary: IO[bytes] = gzip.GzipFile(fileobj=raw) if gz else raw
            if ext == ".parquet":
                data = binary.read() if gz else None
                return _parse_parquet(io.BytesIO(data) if gz else binary, source, max_rows)
            text = io.TextIOWrapper(binary, encoding="utf-8", newline="")
            try:
                if ext == ".jsonl":
                    return _parse_jsonl(text, source, max_rows)
                if ext == ".json":
                    return _parse_json(text.read(), source, split, max_rows)
                return _parse_csv(text, source, max_rows)
            finally:
                text.detach()
    except DataError:
        raise
    except FileNotFoundError:
        raise DataError("file not found", source=source) from None
    except UnicodeDecodeError as e:
        raise DataError(f"not valid UTF-8 text ({e.reason})", source=source) from None
    except (OSError, EOFError) as e:
        raise DataError(f"cannot read file ({e})", source=source) from None


def _path_words(rel: str) -> set[str]:
    return {w for w in re.split(r"[^A-Za-z0-9]+", rel.lower()) if w}


def _select_split_files(rel_paths: Sequence[str], split: str, source: str) -> list[str]:
    """Pick the data files of ``split`` among paths relative to the folder."""
    data = sorted(p for p in rel_paths if _data_ext(p) is not None)
    if not data:
        raise DataError(
            f"folder contains no data files ({', '.join(DATA_EXTENSIONS)}) and is not a datasets save_to_disk folder",
            source=source,
        )
    matching = [p for p in data if split.lower() in _path_words(p)]
    if matching:
        return matching
    if not any(_path_words(p) & set(_SPLIT_WORDS) for p in data):
        return data  # unsplit folder: every file belongs to the requested split
    raise DataError(f"no data file for split {split!r} (files: {', '.join(data)})", source=source)


def _from_hf_dataset(ds: Any, source: str, split: str, max_rows: int | None) -> list[dict]:
    """Rows of a datasets.Dataset, or of ``split`` of a DatasetDict."""
    if _is_dataset_dict(ds):
        if split not in ds:
            raise DataError(f"has no split {split!r} (available: {', '.join(ds.keys())})", source=source)
        ds = ds[split]
    if max_rows is not None:
        ds = ds.select(range(min(max_rows, len(ds))))
    return ds.to_list()


def _is_dataset_dict(obj: Any) -> bool:
    try:
        from datasets import DatasetDict
    except ImportError:  # pragma: no cover
        return False
    return isinstance(obj, DatasetDict)


def _load_from_disk(
    path: str, source: str, split: str, max_rows: int | None, storage_options: dict | None
) -> list[dict]:
    import datasets

    try:
        ds = datasets.load_from_disk(path, storage_options=storage_options)
    except Exception as e:
        raise DataError(f"cannot load datasets save_to_disk folder ({e})", source=source) from None
    return _from_hf_dataset(ds, source, split, max_rows)


# --------------------------------------------------------------------------- sources


def _load_local(path: Path, source: str, split: str, max_rows: int | None) -> list[dict]:
    if path.is_file():
        return _read_file(lambda: open(path, "rb"), path.name, source, split, max_rows)
    if any((path / m).is_file() for m in _DATASET_MARKERS):
        return _load_from_disk(str(path), source, split, max_rows, None)
    rel = [
        f.relative_to(path).as_posix()
        for f in path.rglob("*")
        if f.is_file() and not any(part.startswith(".") for part in f.relative_to(path).parts)
    ]
    rows: list[dict] = []
    for r in _select_split_files(rel, split, source):
        remaining = None if max_rows is None else max_rows - len(rows)
        if remaining is not None and remaining <= 0:
            break
        f = path / r
        rows.extend(_read_file(lambda f=f: open(f, "rb"), f.name, str(f), split, remaining))  # noqa: SIM115
    return rows


def _load_url(url: str, split: str, storage_options: dict | None, max_rows: int | None) -> list[dict]:
    try:
        import fsspec
    except ImportError:  # pragma: no cover
        raise DataError("fsspec is required to read URLs", source=url) from None
    try:
        fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except Exception as e:
        raise DataError(f"cannot open filesystem for URL ({e})", source=url) from None
    try:
        is_dir = fs.isdir(path)
        exists = is_dir or fs.exists(path)
    except Exception as e:
        raise DataError(f"cannot access URL ({e})", source=url) from None
    if not exists:
        raise DataError("does not exist", source=url)
    if not is_dir:
        name = PurePosixPath(path.split("?", 1)[0]).name
        return _read_file(lambda: fs.open(path, "rb"), name, url, split, max_rows)

    base = path.rstrip("/")
    if any(fs.isfile(f"{base}/{m}") for m in _DATASET_MARKERS):
        return _load_from_disk(url, url, split, max_rows, storage_options)
    files = [f for f in fs.find(base) if fs.isfile(f)]
    rel = [f[len(base) :].lstrip("/") for f in files]
    rel = [r for r in rel if not any(p.startswith(".") for p in r.split("/"))]
    protocol = url.split("://", 1)[0]
    rows: list[dict] = []
    for r in _select_split_files(rel, split, url):
        remaining = None if max_rows is None else max_rows - len(rows)
        if remaining is not None and remaining <= 0:
            break
        full = f"{base}/{r}"
        rows.extend(
            _read_file(
                lambda full=full: fs.open(full, "rb"),
                PurePosixPath(r).name,
                f"{protocol}://{full.lstrip('/')}" if protocol != "file" else full,
                split,
                remaining,
            )
        )
    return rows


def _load_hub(name: str, split: str, max_rows: int | None) -> list[dict]:
    prefix = "does not exist locally and the hub dataset could not be loaded"
    if not _HUB_ID_RE.match(name) or _data_ext(name) is not None:
        raise DataError("does not exist locally (and is not a Hugging Face hub dataset name)", source=name)
    try:
        import datasets

        ds = datasets.load_dataset(name, split=split)
    except Exception as e:
        reason = f"{type(e).__name__}: {e}".strip().splitlines()
        raise DataError(f"{prefix} ({reason[0] if reason else type(e).__name__})", source=name) from e
    return _from_hf_dataset(ds, name, split, max_rows)


# --------------------------------------------------------------------------- public API


def load_rows(
    source: str | os.PathLike,
    *,
    split: str = "train",
    storage_options: dict | None = None,
    max_rows: int | None = None,
) -> list[dict]:
    """Load ``source`` as a list of dict rows (at most ``max_rows``).

    See the module docstring for the accepted sources.  Raises
    :class:`DataError` (naming the source, and the line/row when known) when
    the source is missing, malformed or has no rows.
    """
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows must be >= 1 or None, got {max_rows}")
    src = os.fspath(source)
    if not isinstance(src, str) or not src:
        raise DataError("empty data source name", source=repr(source))

    if _URL_RE.match(src) and not src.lower().startswith("file://"):
        rows = _load_url(src, split, storage_options, max_rows)
    else:
        local = src[len("file://") :] if src.lower().startswith("file://") else src
        path = Path(local).expanduser()
        if path.exists():
            rows = _load_local(path, src, split, max_rows)
        elif src.lower().startswith("file://"):
            raise DataError("does not exist", source=src)
        else:
            rows = _load_hub(src, split, max_rows)

    if not rows:
        raise DataError("has no rows", source=src)
    return rows


def _value_problem(value: Any) -> str | None:
    """Why ``value`` is not a non-empty string or message list, else None."""
    if isinstance(value, str):
        return "is an empty string" if not value.strip() else None
    if isinstance(value, list):
        if not value:
            return "is an empty message list"
        for i, m in enumerate(value, start=1):
            if not isinstance(m, dict):
                return f"message {i} is not an object (got {type(m).__name__})"
            for k in ("role", "content"):
                if not isinstance(m.get(k), str):
                    return f"message {i} has no string {k!r}"
        return None
    return f"is not a string or a list of messages (got {type(value).__name__})"


def require_keys(rows: Sequence[dict], keys: Sequence[str], source: str) -> Sequence[dict]:
    """Check every row has each of ``keys`` with a usable value; return ``rows``.

    A usable value is a non-empty string or a non-empty list of
    ``{"role": str, "content": str}`` messages.  Raises :class:`DataError`
    naming ``source``, the first offending row (1-based) and the key.
    """
    if not rows:
        raise DataError("has no rows", source=source)
    for i, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise DataError(f"is not an object (got {type(row).__name__})", source=source, row=i)
        for key in keys:
            if key not in row:
                present = ", ".join(map(str, row.keys())) or "none"
                raise DataError(f"missing (row has keys: {present})", source=source, row=i, key=key)
            problem = _value_problem(row[key])
            if problem is not None:
                raise DataError(f"value {problem}", source=source, row=i, key=key)
    return rows
