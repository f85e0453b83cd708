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

Text files are UTF-8 (a leading BOM is dropped, CRLF line ends are fine); an
invalid byte is refused with its line and column.  Every row is checked as it
is read: a key twice in one JSON object (``json`` would keep the last value)
and a non-finite number (NaN, Infinity, also in Parquet and hub rows) are
refused.  :func:`require_keys` checks text values and chat message lists.

Every problem raises :class:`DataError` whose message names the source and,
when known, the row/line and key.  ``datasets``, ``fsspec`` and ``pyarrow`` are
imported lazily.
"""

from __future__ import annotations

import codecs
import csv
import gzip
import io
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path, PurePosixPath
from typing import IO, Any, cast

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


class _Pairs(dict):
    """A parsed JSON object that had a key more than once (``duplicates`` names them); refused by _check_row."""

    duplicates: list[str]


class _NonFinite:
    """A NaN/Infinity/-Infinity (or overflowing) JSON number; refused by _check_row."""

    def __init__(self, text: str) -> None:
        self.text = text


def _object(pairs: list[tuple[str, Any]]) -> dict:
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    seen: set[str] = set()
    out = _Pairs(obj)
    out.duplicates = [k for k, _ in pairs if k in seen or seen.add(k)]
    return out


def _float(text: str) -> Any:
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(text)


def _loads(text: str) -> Any:
    """json.loads that marks duplicate keys and non-finite numbers instead of keeping the last value / NaN."""
    return json.loads(text, object_pairs_hook=_object, parse_constant=_NonFinite, parse_float=_float)


def _value_fault(value: Any) -> str | None:
    """Why a (nested) row value cannot be trained on: a duplicate key or a non-finite number, else None."""
    if isinstance(value, _Pairs):
        return f"an object in the value has the key {value.duplicates[0]!r} twice; keep one"
    if isinstance(value, _NonFinite):
        return f"value is {value.text}, not a finite number; replace it or drop the row"
    if isinstance(value, float) and not math.isfinite(value):
        return f"value is {value}, not a finite number; replace it or drop the row"
    if isinstance(value, dict):
        return next((p for p in map(_value_fault, value.values()) if p), None)
    if isinstance(value, (list, tuple)):
        return next((p for p in map(_value_fault, value) if p), None)
    return None


def _check_row(obj: Any, source: str, row: int, row_label: str = "row") -> dict:
    """``obj`` if it is an object without duplicate keys or non-finite numbers, else DataError naming row and key."""
    if not isinstance(obj, dict):
        raise DataError(
            f"expected a JSON object, got {type(obj).__name__}",
            source=source,
            row=row,
            row_label=row_label,
        )
    if isinstance(obj, _Pairs):
        raise DataError(
            "the key appears twice in the object (only one value would be kept); keep one",
            source=source,
            row=row,
            key=obj.duplicates[0],
            row_label=row_label,
        )
    for key, value in obj.items():
        problem = _value_fault(value)
        if problem is not None:
            raise DataError(problem, source=source, row=row, key=str(key), row_label=row_label)
    return obj


def _decode(data: bytes, source: str, first_line: int = 1) -> str:
    """UTF-8 text of ``data`` (a leading BOM dropped); invalid bytes refused with their line and column."""
    bom = data.startswith(codecs.BOM_UTF8) and first_line == 1
    try:
        return data.decode("utf-8-sig" if bom else "utf-8")
    except UnicodeDecodeError as e:
        start = e.start + (len(codecs.BOM_UTF8) if bom else 0)
        line_start = data.rfind(b"\n", 0, start) + 1
        raise DataError(
            f"not valid UTF-8 (byte 0x{data[start]:02x} at column {start - line_start + 1}); "
            "re-save the file as UTF-8",
            source=source,
            row=first_line + data.count(b"\n", 0, start),
            row_label="line",
        ) from None


def _parse_jsonl(lines: Iterable[bytes | str], source: str, max_rows: int | None) -> list[dict]:
    rows: list[dict] = []
    for lineno, line in enumerate(lines, start=1):
        if max_rows is not None and len(rows) >= max_rows:
            break
        if isinstance(line, bytes):
            line = _decode(line, source, lineno)
        if lineno == 1:
            line = line.removeprefix("\ufeff")
        if not line.strip():
            continue
        try:
            obj = _loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                f"invalid JSON ({e.msg} at column {e.colno})", source=source, row=lineno, row_label="line"
            ) from None
        rows.append(_check_row(obj, source, lineno, "line"))
    return rows


def _parse_json(text: str, source: str, split: str, max_rows: int | None) -> list[dict]:
    try:
        obj = _loads(text)
    except json.JSONDecodeError:
        # Not one JSON document: treat as JSON lines (errors name the line).
        return _parse_jsonl(io.StringIO(text), source, max_rows)
    if isinstance(obj, dict):
        for k in (split, "data", "rows"):
            if isinstance(obj.get(k), list):
                if isinstance(obj, _Pairs) and k in obj.duplicates:
                    raise DataError("the key appears twice in the file's object; keep one", source=source, key=k)
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
                    f"more fields than the header has columns ({len(reader.fieldnames or [])}); "
                    "quote values that hold commas",
                    source=source,
                    row=reader.line_num,
                    row_label="line",
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
    return [_check_row(r, source, i) for i, r in enumerate(table.to_pylist(), start=1)]


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
            # typeshed declares GzipFile a BufferedIOBase, not a typing.IO, though it is one at runtime
            binary: IO[bytes] = cast(IO[bytes], gzip.GzipFile(fileobj=raw)) if gz else raw
            if ext == ".parquet":
                return _parse_parquet(io.BytesIO(binary.read()) if gz else binary, source, max_rows)
            if ext == ".jsonl":
                return _parse_jsonl(binary, source, max_rows)
            text = _decode(binary.read(), source)
            if ext == ".json":
                return _parse_json(text, source, split, max_rows)
            return _parse_csv(io.StringIO(text, newline=""), source, max_rows)
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
    return [_check_row(r, source, i) for i, r in enumerate(ds.to_list(), start=1)]


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


#: Roles a chat message may have.
ROLES = ("system", "user", "assistant")
#: What a message list under a key must be (see _messages_problem).
LIST_KINDS = ("any", "prompt", "response", "conversation")


def _messages_problem(messages: list, kind: str = "any") -> str | None:
    """Why ``messages`` is not a usable chat message list of ``kind``, else None.

    Every list: objects with a role among :data:`ROLES` and a non-empty string content, a system message only
    first, user and assistant alternating.  ``prompt``: starts (after an optional system message) with user and
    ends with user.  ``conversation`` (a whole transcript): starts with user, ends with the assistant's answer.
    ``response`` (the answer to a prompt under its own key): ends with assistant; a lone assistant message or a
    conversation.
    """
    if not messages:
        return "is an empty message list"
    previous = None
    for i, m in enumerate(messages, start=1):
        if not isinstance(m, dict):
            return f"message {i} is not an object (got {type(m).__name__}); write {{'role': ..., 'content': ...}}"
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str):
            return f"message {i} has no string 'role'; add one of {', '.join(ROLES)}"
        if role not in ROLES:
            return f"message {i} has role {role!r}; use one of {', '.join(ROLES)}"
        if not isinstance(content, str):
            got = "missing" if content is None else f"a {type(content).__name__}"
            return f"message {i} has no string 'content' ({got}); write the text as one string"
        if not content.strip():
            return f"message {i} ({role}) has empty content; fill it in or drop the row"
        if role == "system" and i > 1:
            return f"message {i} is a system message after message 1; a system message may only come first"
        if role == previous:
            return f"message {i} is a second {role} message in a row; user and assistant must alternate"
        previous = role
    roles = [m["role"] for m in messages if m["role"] != "system"]
    if not roles:
        return "has only a system message; add the user message"
    first = 2 if messages[0]["role"] == "system" else 1
    lone_answer = kind == "response" and roles == ["assistant"]
    if kind != "any" and roles[0] != "user" and not lone_answer:
        return f"message {first} is {roles[0]!r}; after an optional system message the first one is from the user"
    if kind == "prompt" and roles[-1] != "user":
        return f"message {len(messages)} is {roles[-1]!r}; a prompt ends with a user message"
    if kind in ("response", "conversation") and roles[-1] != "assistant":
        return f"message {len(messages)} is {roles[-1]!r}; the list must end with the assistant's answer"
    return None


def _value_problem(value: Any, kind: str = "any") -> str | None:
    """Why ``value`` is not a non-empty string or message list (of ``kind``, see _messages_problem), else None."""
    if isinstance(value, str):
        return "is an empty string" if not value.strip() else None
    if isinstance(value, list):
        return _messages_problem(value, kind)
    return (
        f"is not a string or a list of messages (got {type(value).__name__} {_short(value)}); "
        "write the text as a string"
    )


def _short(value: Any, width: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def require_keys(
    rows: Sequence[dict], keys: Sequence[str], source: str, kinds: dict[str, str] | None = None
) -> Sequence[dict]:
    """Check every row has each of ``keys`` with a usable value; return ``rows``.

    A usable value is a non-empty string or a non-empty list of ``{"role": str, "content": str}`` messages, of
    the kind ``kinds[key]`` when given (one of :data:`LIST_KINDS`; see _messages_problem).  Raises
    :class:`DataError` naming ``source``, the first offending row (1-based) and the key.
    """
    kinds = kinds or {}
    if not rows:
        raise DataError("has no rows", source=source)
    for i, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise DataError(f"is not an object (got {type(row).__name__})", source=source, row=i)
        for key in keys:
            if key not in row:
                present = ", ".join(map(str, row.keys())) or "none"
                raise DataError(
                    f"missing (row has keys: {present}); add it or name the right key in the data config",
                    source=source,
                    row=i,
                    key=key,
                )
            problem = _value_problem(row[key], kinds.get(key, "any"))
            if problem is not None:
                raise DataError(f"value {problem}", source=source, row=i, key=key)
    return rows
