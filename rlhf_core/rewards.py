"""Rewards computed outside a reward model: a Python reward function, or a remote HTTP reward server.

Reward function (``module:function`` or ``path/to/file.py:function``, relative to the working directory): called
as ``fn(prompts, responses)`` with the rows' raw prompts (strings or chat message lists) and response strings; it
returns one finite float per row, or ``{"scores": [...], "keep": [...]}`` where ``keep`` holds one bool per row
(False: drop the sample from training, dynamic sampling; ``call_reward_fn_with_mask``). Every problem is a
``ConfigError`` naming the config key and the spec.

Remote reward server (``RemoteRewardModel``), a batch JSON API: ``POST <url>`` with
``{"prompts": [...], "responses": [...]}`` answers ``{"scores": [...]}`` (or ``{"rewards": [...]}``), one finite
number per row, in order. Connection errors, read errors and HTTP 429/500/502/503/504 are retried with exponential
backoff; what still fails is a ``RemoteRewardError`` naming the key and the (redacted) URL: a failed request is
never a score of 0.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from rlhf_core.config import ConfigError, redact_url

RewardFn = Callable[[list, list[str]], Any]

MASK_KEYS = ("scores", "keep")
RETRY_STATUSES = (429, 500, 502, 503, 504)
EXCERPT_CHARS = 200


# ---------------------------------------------------------------------------------------------------------------------
# Reward functions


def load_reward_fn(spec: str, key: str) -> RewardFn:
    """``module:function`` or ``path/to/file.py:function`` (a path relative to the working directory) as a
    callable; a ConfigError naming ``key`` when the spec is malformed or cannot be imported."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ConfigError(f"'{key}' = {spec!r} is not of the form module:function or path/to/file.py:function")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ConfigError(f"'{key}' = {spec!r}: no file {path.resolve()} (paths are relative to {Path.cwd()})")
        module_name = f"rlhf_reward_fn_{abs(hash(str(path.resolve())))}"
        try:
            module_spec = importlib.util.spec_from_file_location(module_name, path)
            assert module_spec is not None and module_spec.loader is not None
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_name] = module
            module_spec.loader.exec_module(module)
        except Exception as e:  # the user's file: any error at import is a bad reward_fn
            sys.modules.pop(module_name, None)
            raise ConfigError(f"'{key}' = {spec!r}: {path} cannot be imported ({type(e).__name__}: {e})") from None
    else:
        try:
            module = importlib.import_module(where)
        except Exception as e:
            raise ConfigError(f"'{key}' = {spec!r}: module {where!r} cannot be imported ({type(e).__name__}: {e})") \
                from None  # fmt: skip
    fn = getattr(module, name, None)
    if fn is None:
        raise ConfigError(f"'{key}' = {spec!r}: {where} has no attribute {name!r}")
    if not callable(fn):
        raise ConfigError(f"'{key}' = {spec!r}: {where}.{name} is not callable (got {type(fn).__name__})")
    return fn


def call_reward_fn(fn: RewardFn, spec: str, key: str, prompts: list, responses: list[str]) -> list[float]:
    """``fn(prompts, responses)`` checked: one finite float per row, else a ConfigError naming the function (a
    ``{"scores", "keep"}`` answer gives its scores)."""
    return call_reward_fn_with_mask(fn, spec, key, prompts, responses)[0]


def call_reward_fn_with_mask(
    fn: RewardFn, spec: str, key: str, prompts: list, responses: list[str]
) -> tuple[list[float], list[bool] | None]:
    """``fn(prompts, responses)`` checked: the scores (one finite float per row) and the keep mask (one bool per
    row; None when the function returned a plain list of scores). A ConfigError naming ``key`` and ``spec`` when
    the function raises or returns anything else."""
    label = f"'{key}' = {spec!r}"
    try:
        out = fn(list(prompts), list(responses))
    except Exception as e:  # the user's function: whatever it raises is reported on one line
        raise ConfigError(f"{label} raised {type(e).__name__}: {_one_line(str(e), 300)}") from e
    keep = None
    if isinstance(out, Mapping):
        unknown = [str(k) for k in out if k not in MASK_KEYS]
        if unknown:
            raise ConfigError(
                f"{label} returned a dict with unknown keys {', '.join(map(repr, unknown))} (allowed: "
                f"{', '.join(map(repr, MASK_KEYS))})"
            )
        if "scores" not in out:
            raise ConfigError(f"{label} returned a dict without 'scores' (allowed keys: 'scores', 'keep')")
        if "keep" in out:
            keep = _check_keep(out["keep"], label, len(prompts))
        out = out["scores"]
    return _check_scores(out, label, len(prompts)), keep


def _row_values(out: Any, label: str, rows: int, what: str, noun: str, kind: str) -> list:
    """``out`` as a list of one value per row; a ConfigError (``label`` returned ...) when it is not a sequence or
    has another length. ``what``: how the returned value is named; ``noun``: its elements; ``kind``: their type."""
    try:
        values = list(out)
    except TypeError:
        raise ConfigError(f"{label} returned {what}{type(out).__name__}, not a list of {kind}") from None
    if len(values) != rows:
        raise ConfigError(f"{label} returned {len(values)} {noun} for {rows} rows")
    return values


def _check_scores(out: Any, label: str, rows: int) -> list[float]:
    values = _row_values(out, label, rows, "", "scores", "floats")
    scores = []
    for i, v in enumerate(values):
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise ConfigError(f"{label} returned {v!r} for row {i + 1}, not a float") from None
        if not math.isfinite(f):
            raise ConfigError(f"{label} returned {f} for row {i + 1}: scores must be finite")
        scores.append(f)
    return scores


def _check_keep(out: Any, label: str, rows: int) -> list[bool]:
    values = _row_values(out, label, rows, "'keep' = ", "'keep' flags", "bools")
    keep = []
    for i, v in enumerate(values):
        # a bool, or a numpy/torch boolean scalar; never 0/1 or a string
        if not (isinstance(v, bool) or getattr(getattr(v, "dtype", None), "kind", None) == "b"):
            raise ConfigError(f"{label} returned 'keep' = {v!r} for row {i + 1}, not a bool")
        keep.append(bool(v))
    return keep


def _one_line(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------------------------------
# Remote reward server


class RemoteRewardError(RuntimeError):
    """A remote reward server could not be reached, failed or gave an unusable answer; the message names the config
    key and the redacted URL."""


class RemoteRewardModel:
    """A client of an HTTP reward server with a batch JSON API (see the module docstring).

    ``key`` is the config key the URL came from, named in every error. ``retries``: retries after the first try
    (connection errors, read errors, HTTP 429/500/502/503/504), sleeping ``backoff_s * 2**(n - 1)`` before the n-th
    retry after the first; ``timeout_s`` bounds connecting and each read of every request; ``batch_size`` > 0
    splits a batch into requests of at most that many rows.
    """

    def __init__(
        self, url: str, key: str, timeout_s: float = 30.0, retries: int = 3, backoff_s: float = 0.5,
        batch_size: int = 0,
    ) -> None:  # fmt: skip
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigError(f"'{key}' = {redact_url(str(url))!r} is not an http:// or https:// URL")
        if timeout_s <= 0:
            raise ConfigError(f"'{key}': the reward server timeout must be > 0 (got {timeout_s})")
        if retries < 0 or backoff_s < 0 or batch_size < 0:
            raise ConfigError(
                f"'{key}': retries, backoff and batch size must be >= 0 (got {retries}, {backoff_s}, {batch_size})"
            )
        self.url = url
        self.key = key
        self.timeout_s = float(timeout_s)
        self.retries = int(retries)
        self.backoff_s = float(backoff_s)
        self.batch_size = int(batch_size)
        self.safe_url = redact_url(url)
        self._session = None

    # a picklable client (it can be sent to a worker): the session is made again on first use
    def __getstate__(self) -> dict:
        return {**self.__dict__, "_session": None}

    def __repr__(self) -> str:
        return f"RemoteRewardModel({self.safe_url!r}, key={self.key!r})"

    def __enter__(self) -> RemoteRewardModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    def session(self):
        if self._session is None:
            import requests
            from requests.adapters import HTTPAdapter
            from urllib3.util import Retry

            retry = Retry(
                total=self.retries, connect=self.retries, read=self.retries, status=self.retries,
                other=self.retries, redirect=0, status_forcelist=RETRY_STATUSES, backoff_factor=self.backoff_s,
                allowed_methods=Retry.DEFAULT_ALLOWED_METHODS | {"POST"}, raise_on_status=False,
                raise_on_redirect=False,
            )  # fmt: skip
            session = requests.Session()
            adapter = HTTPAdapter(max_retries=retry)
            session.mount("http://", adapter)
            session.mount("https://", adapter)
            self._session = session
        return self._session

    def check(self) -> None:
        """Probe the server with one row (prompt "", response ""), to fail before training starts."""
        self.score([""], [""])

    def score(self, prompts: list, responses: list[str]) -> list[float]:
        """One finite float per (prompt, response) row, in order; a RemoteRewardError otherwise."""
        prompts, responses = list(prompts), list(responses)
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts for {len(responses)} responses")
        step = self.batch_size or max(1, len(prompts))
        scores: list[float] = []
        for start in range(0, len(prompts), step):
            scores += self._post(prompts[start : start + step], responses[start : start + step])
        return scores

    def _fail(self, problem: str) -> RemoteRewardError:
        return RemoteRewardError(f"'{self.key}': the reward server {self.safe_url} {problem}")

    def _excerpt(self, text: str) -> str:
        # the server may echo the request line: never let the URL's secrets through
        parts = urlsplit(self.url)
        for secret in (parts.password, parts.username, parts.query, parts.fragment):
            if secret:
                text = text.replace(secret, "***")
        return _one_line(text, EXCERPT_CHARS) or "(empty body)"

    def _post(self, prompts: list, responses: list[str]) -> list[float]:
        import requests

        try:
            body = json.dumps({"prompts": prompts, "responses": responses})
        except (TypeError, ValueError) as e:
            raise self._fail(f"cannot be sent these prompts: they are not JSON ({type(e).__name__})") from None
        tries_max = self.retries + 1
        try:
            resp = self.session().post(
                self.url, data=body, headers={"Content-Type": "application/json"}, timeout=self.timeout_s
            )
        except requests.RequestException as e:
            raise self._fail(f"failed after {tries_max} {_tries(tries_max)}: {self._describe(e)}") from None
        history = getattr(getattr(resp.raw, "retries", None), "history", None)
        tries = len(history) + 1 if history is not None else 1
        if not 200 <= resp.status_code < 300:
            raise self._fail(
                f"answered HTTP {resp.status_code} after {tries} {_tries(tries)}: {self._excerpt(resp.text)}"
            )
        try:
            answer = json.loads(resp.content)
        except ValueError:
            raise self._fail(f"answered HTTP {resp.status_code} with non-JSON: {self._excerpt(resp.text)}") from None
        if not isinstance(answer, dict) or not ("scores" in answer or "rewards" in answer):
            what = f"keys {sorted(map(str, answer))}" if isinstance(answer, dict) else type(answer).__name__
            raise self._fail(f"answered JSON without 'scores' (or 'rewards'): got {_one_line(what, 100)}")
        values = answer["scores"] if "scores" in answer else answer["rewards"]
        if not isinstance(values, list):
            raise self._fail(f"answered 'scores' = {type(values).__name__}, not a list")
        if len(values) != len(prompts):
            raise self._fail(f"answered {len(values)} scores for {len(prompts)} rows")
        scores = []
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise self._fail(f"answered {_one_line(repr(v), 60)} for row {i + 1}, not a number")
            if not math.isfinite(v):
                raise self._fail(f"answered {v} for row {i + 1}: scores must be finite")
            scores.append(float(v))
        return scores

    def _describe(self, e: BaseException) -> str:
        """The kind of a transport error, without the URL (urllib3's messages repeat the path and query)."""
        import requests
        import urllib3.exceptions

        chain = _chain(e)
        root = _root_oserror(chain)
        detail = f" ({type(root).__name__}: {root.strerror})" if root is not None and root.strerror else ""
        # NewConnectionError is a urllib3 ConnectTimeoutError: a refused connection is not a timeout
        if any(isinstance(c, urllib3.exceptions.NewConnectionError) for c in chain):
            return f"cannot connect{detail or f' ({type(root or e).__name__})'}"
        if isinstance(e, requests.Timeout) or any(
            isinstance(c, TimeoutError | urllib3.exceptions.TimeoutError) for c in chain
        ):
            return f"timed out (timeout {self.timeout_s:g}s)"
        if root is not None:
            return f"connection error{detail or f' ({type(root).__name__})'}"
        return type(e).__name__


def _tries(n: int) -> str:
    return "try" if n == 1 else "tries"


def _chain(e: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    stack: list[BaseException | None] = [e]
    while stack:
        cur = stack.pop()
        if cur is None or any(cur is s for s in seen):
            continue
        seen.append(cur)
        stack += [cur.__cause__, cur.__context__, getattr(cur, "reason", None)]
        stack += [a for a in getattr(cur, "args", ()) if isinstance(a, BaseException)]
    return seen


def _root_oserror(chain: list[BaseException]) -> OSError | None:
    """The innermost plain OSError (ConnectionRefusedError, socket.gaierror...) below a requests/urllib3 error."""
    import requests
    import urllib3.exceptions

    found = None
    for c in chain:
        if isinstance(c, OSError) and not isinstance(c, requests.RequestException | urllib3.exceptions.HTTPError):
            found = c
    return found
