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

A PPO-kind stage sums its sources into one reward (``RewardSources``): the reward model's scores (its Ray workers
compute them), the reward function's and the server's, each times its ``reward_weights`` weight.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import math
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch

from rlhf_core import timing
from rlhf_core.algos.experience import Experience
from rlhf_core.algos.ppo import normalize_scores
from rlhf_core.config import REWARD_SOURCES, ConfigError, PPOConfig, redact_url, reward_sources
from rlhf_core.errors import one_line
from rlhf_core.models.builders import BUILTIN_PREFIX

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
            raise ConfigError(
                f"'{key}' = {spec!r}: module {where!r} cannot be imported ({type(e).__name__}: {e})"
            ) from None
    fn = getattr(module, name, None)
    if fn is None:
        raise ConfigError(f"'{key}' = {spec!r}: {where} has no attribute {name!r}")
    if not callable(fn):
        raise ConfigError(f"'{key}' = {spec!r}: {where}.{name} is not callable (got {type(fn).__name__})")
    return fn


def load_gold(spec: str | None, key: str = "train.gold_reward") -> Callable[[str, str], float] | None:
    """The gold-reward function ``module:function`` (None for None); a ConfigError naming ``key`` when it cannot be
    imported."""
    if spec is None:
        return None
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"'{key}' = {spec!r} cannot be imported ({e})") from None


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
        raise ConfigError(f"{label} raised {type(e).__name__}: {one_line(str(e), 300)}") from e
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
        self,
        url: str,
        key: str,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        batch_size: int = 0,
    ) -> None:
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
                total=self.retries,
                connect=self.retries,
                read=self.retries,
                status=self.retries,
                other=self.retries,
                redirect=0,
                status_forcelist=RETRY_STATUSES,
                backoff_factor=self.backoff_s,
                allowed_methods=Retry.DEFAULT_ALLOWED_METHODS | {"POST"},
                raise_on_status=False,
                raise_on_redirect=False,
            )
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
        return one_line(text, EXCERPT_CHARS) or "(empty body)"

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
            raise self._fail(f"answered JSON without 'scores' (or 'rewards'): got {one_line(what, 100)}")
        values = answer["scores"] if "scores" in answer else answer["rewards"]
        if not isinstance(values, list):
            raise self._fail(f"answered 'scores' = {type(values).__name__}, not a list")
        if len(values) != len(prompts):
            raise self._fail(f"answered {len(values)} scores for {len(prompts)} rows")
        scores = []
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise self._fail(f"answered {one_line(repr(v), 60)} for row {i + 1}, not a number")
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


# ---------------------------------------------------------------------------------------------------------------------
# The reward sources of a PPO-kind stage, summed into one reward

# What each reward source (config.REWARD_SOURCES, in its order) is logged as: its mean score, in steps and metrics.
SOURCE_LOGS: dict[str, str] = dict(
    zip(REWARD_SOURCES, ("rm_score", "reward_fn_score", "remote_rm_score"), strict=True)
)


def reward_stats(stage: str, p: PPOConfig, reward_path: str | None) -> tuple[float, float] | None:
    """(mean, std) stored by the reward-model stage; refused when normalisation is on and they are missing. None
    without a reward model (a function's or a server's scores are used as they come)."""
    if not p.algo.normalize_reward or p.reward.model is None or reward_path is None:
        return None
    if not reward_path.startswith(BUILTIN_PREFIX):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(reward_path, trust_remote_code=p.reward.model.trust_remote_code)
        mean, std = getattr(config, "reward_mean", None), getattr(config, "reward_std", None)
        if mean is not None and std is not None:
            return float(mean), float(std)
    raise ConfigError(
        f"'{stage}.reward.model.name_or_path' = {p.reward.model.name_or_path} has no stored reward_mean/reward_std, "
        f"but '{stage}.algo.normalize_reward' is on: use a reward-model stage output or set it to false"
    )


@dataclasses.dataclass
class Scored:
    """A step's experience (its ``scores`` the sources' sum) with each reward source's raw (B,) scores and the reward
    function's keep mask (or None), and the experience phase's own metrics (where the old log-probs came from)."""

    exp: Experience
    parts: dict[str, torch.Tensor]
    keep: torch.Tensor | None = None
    logs: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class RewardSources:
    """A PPO-kind stage's reward sources: their weights by source key (``config.REWARD_SOURCES``), the reward
    model's stored (mean, std) when its scores are normalised, the reward function (``fn_spec`` as given at
    ``fn_key``) and the remote server's client. The reward model's workers score on their own; the function and the
    server are called here, on the driver."""

    weights: dict[str, float]
    stats: tuple[float, float] | None = None
    reward_fn: RewardFn | None = None
    fn_spec: str = ""
    fn_key: str = "reward_fn"
    remote: RemoteRewardModel | None = None

    @classmethod
    def of(cls, stage: str, p: PPOConfig, reward_path: str | None) -> RewardSources:
        """The stage's sources, loaded (``reward_path``: the reward model's local copy, for its statistics); none is
        called yet (``check``)."""
        stats = reward_stats(stage, p, reward_path)
        fn_key = f"{stage}.reward_fn"
        reward_fn = load_reward_fn(p.reward_fn, fn_key) if p.reward_fn is not None else None
        remote = None
        if p.remote_rm_url is not None:
            remote = RemoteRewardModel(
                p.remote_rm_url,
                f"{stage}.remote_rm_url",
                timeout_s=p.remote_rm.timeout_s,
                retries=p.remote_rm.retries,
                backoff_s=p.remote_rm.backoff_s,
                batch_size=p.remote_rm.batch_size,
            )
        weights = {key: p.reward_weights.get(key, 1.0) for key in reward_sources(p)}
        return cls(weights, stats, reward_fn, p.reward_fn or "", fn_key, remote)

    def check(self, prompts: list) -> None:
        """Before any worker starts: the reward function answers a probe of ``prompts`` (empty responses) in the
        expected shape, and the remote reward server answers (``RemoteRewardModel.check``)."""
        if self.reward_fn is not None:
            call_reward_fn_with_mask(self.reward_fn, self.fn_spec, self.fn_key, prompts, [""] * len(prompts))
        if self.remote is not None:
            self.remote.check()

    def score_on_driver(
        self, tokenizer: Any, prompts: list, responses: list[list[int]], timer: timing.PhaseTimer | None = None
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """The reward function's and the server's (B,) scores by source key, of the raw ``prompts`` (one per
        response) and the decoded ``responses``, and the function's (B,) keep mask (None when it gives none).
        ``timer``: their seconds as ``experience_reward_fn`` and ``experience_remote_rm``."""
        parts: dict[str, torch.Tensor] = {}
        keep = None
        if self.reward_fn is None and self.remote is None:
            return parts, keep
        texts = [tokenizer.decode(r, skip_special_tokens=True) for r in responses]
        if self.reward_fn is not None:
            t0 = time.perf_counter()
            fn_scores, fn_keep = call_reward_fn_with_mask(self.reward_fn, self.fn_spec, self.fn_key, prompts, texts)
            parts["reward_fn"] = torch.tensor(fn_scores, dtype=torch.float32)
            keep = torch.tensor(fn_keep, dtype=torch.bool) if fn_keep is not None else None
            if timer is not None:
                timer.add("experience_reward_fn", time.perf_counter() - t0)
        if self.remote is not None:
            t0 = time.perf_counter()
            parts["remote_rm_url"] = torch.tensor(self.remote.score(prompts, texts), dtype=torch.float32)
            if timer is not None:
                timer.add("experience_remote_rm", time.perf_counter() - t0)
        return parts, keep

    def combine(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B,) reward: sum over the sources of weight x score, the reward model's score normalised (when on)."""
        total = torch.zeros_like(next(iter(parts.values())))
        for key, scores in parts.items():
            if key == "reward" and self.stats is not None:
                scores = normalize_scores(scores, *self.stats)
            total = total + self.weights[key] * scores
        return total
