"""Rewards computed outside a reward model: a Python reward function, or a remote HTTP reward server.

Reward function (``module:function`` or ``path/to/file.py:function``, relative to the working directory): called
as ``fn(prompts, responses, **columns)`` with the rows' raw prompts (strings or chat message lists) and response
strings, as TRL calls its reward functions. ``columns`` are what its signature asks for (``Columns``): ``labels``,
each row's ``data.label_key`` value, and any other column of the row by name, one value per response; a function
with ``**kwargs`` gets them all, and the two-argument form gets none. It returns one finite float per row, or
``{"scores": [...], "keep": [...]}`` where ``keep`` holds one bool per row (False: drop the sample from training,
dynamic sampling; ``call_reward_fn_with_mask``). Every problem is a ``ConfigError`` naming the config key and the
spec; a column that the signature requires and the data lacks is refused before any worker starts.

The remote reward server's client is ``rlhf_core.remote_reward.RemoteRewardModel``.

A PPO-kind stage sums its sources into one reward (``RewardSources``): the reward model's scores (its Ray workers
compute them), the reward function's and the server's, each times its ``reward_weights`` weight.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import json
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rlhf_core import timing
from rlhf_core.algos.experience import Experience
from rlhf_core.algos.ppo import normalize_scores
from rlhf_core.config import REWARD_SOURCES, ConfigError, PPOConfig, reward_sources
from rlhf_core.errors import one_line
from rlhf_core.models.builders import BUILTIN_PREFIX
from rlhf_core.remote_reward import RemoteRewardModel

RewardFn = Callable[..., Any]
GoldFn = Callable[..., float]

MASK_KEYS = ("scores", "keep")


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


def load_gold(spec: str | None, key: str = "train.gold_reward") -> GoldFn | None:
    """The gold-reward function ``module:function`` (None for None); a ConfigError naming ``key`` when it cannot be
    imported."""
    if spec is None:
        return None
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"'{key}' = {spec!r} cannot be imported ({e})") from None


#: The bundled synthetic task's rule: ``train.gold_reward: auto`` scores the bundled data with it.
SYNTHETIC_GOLD = "rlhf_core.data.synthetic:gold_reward"


def gold_spec(spec: str | None, train_path: str) -> str | None:
    """The gold reward a PPO-kind stage evaluates with: ``spec`` as given, and for ``auto`` the bundled task's rule
    when the training prompts are the bundled synthetic data (its folder), none on any other data."""
    if spec != "auto":
        return spec
    from rlhf_core.data.synthetic import BUNDLED_DIR

    if "://" in train_path or ":" in train_path.split("/")[0]:
        return None
    return SYNTHETIC_GOLD if Path(train_path).resolve().is_relative_to(BUNDLED_DIR) else None


def call_gold(gold: GoldFn, prompts: Sequence, responses: Sequence[str], labels: Sequence | None) -> list[float]:
    """``gold(prompt, response)`` per row (a chat prompt as its JSON text), with ``label=`` when there are labels
    and the function takes one."""
    texts = [pr if isinstance(pr, str) else json.dumps(pr, ensure_ascii=False) for pr in prompts]
    if labels is not None and _takes(gold, "label"):
        return [float(gold(pr, tx, label=lb)) for pr, tx, lb in zip(texts, responses, labels)]
    return [float(gold(pr, tx)) for pr, tx in zip(texts, responses)]


def _takes(fn: Callable, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


@dataclasses.dataclass(frozen=True)
class Columns:
    """What a reward function may take besides prompts and responses, one value per row: ``labels`` (the rows'
    ``data.label_key`` values; None without a label key) and the rows' other columns by name. ``label_key`` names
    the config key of the labels, for messages."""

    labels: list | None = None
    values: dict[str, list] = dataclasses.field(default_factory=dict)
    label_key: str = "data.label_key"

    @classmethod
    def of(cls, examples: Sequence[Mapping], label_key: str = "data.label_key") -> Columns:
        """Of ``prompt_examples`` rows (``label`` when the data has labels; ``columns``: the row's other values)."""
        has_labels = bool(examples) and "label" in examples[0]
        names = sorted({name for e in examples for name in e.get("columns", {})})
        values = {name: [e.get("columns", {}).get(name) for e in examples] for name in names}
        return cls([e["label"] for e in examples] if has_labels else None, values, label_key)

    def names(self) -> list[str]:
        return (["labels"] if self.labels is not None else []) + list(self.values)

    def _map(self, change: Callable[[list], list]) -> Columns:
        labels = change(self.labels) if self.labels is not None else None
        return Columns(labels, {k: change(v) for k, v in self.values.items()}, self.label_key)

    def expanded(self, n: int) -> Columns:
        """Each value repeated ``n`` times in place: one per sample of its prompt."""
        return self._map(lambda values: [v for v in values for _ in range(n)])

    def padded(self, extra: int) -> Columns:
        """``extra`` copies of the first row's values appended (a batch padded for the roles)."""
        return self._map(lambda values: values + values[:1] * extra)

    def head(self, rows: int) -> Columns:
        return self._map(lambda values: values[:rows])

    def as_kwargs(self) -> dict[str, list]:
        return {**self.values, **({"labels": self.labels} if self.labels is not None else {})}


def reward_fn_columns(fn: RewardFn, spec: str, key: str, columns: Columns) -> list[str]:
    """The column names ``fn`` takes as keyword arguments beyond (prompts, responses): those its signature names that
    the data has, or all of them with ``**kwargs``. A ConfigError naming ``key`` and the column when the signature
    requires one that the data does not have (``labels`` without ``data.label_key``)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a builtin): the two-argument form
        return []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    rest = [p for p in params if p.kind is not inspect.Parameter.VAR_POSITIONAL]
    rest = rest[2:] if sum(p.kind in positional for p in rest[:2]) == 2 else rest
    available = columns.names()
    wanted = []
    for p in rest:
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            continue
        if p.name in available:
            wanted.append(p.name)
        elif p.default is inspect.Parameter.empty:
            if p.name == "labels":
                raise ConfigError(
                    f"'{key}' = {spec!r} takes labels, but the data has none: set '{columns.label_key}' to the "
                    "column that holds them"
                )
            have = ", ".join(available) or "none"
            raise ConfigError(
                f"'{key}' = {spec!r} takes the column {p.name!r}, which the data does not have (its columns: {have})"
            )
    return available if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in rest) else wanted


def call_reward_fn(
    fn: RewardFn, spec: str, key: str, prompts: list, responses: list[str], columns: Columns | None = None
) -> list[float]:
    """``fn(prompts, responses, **columns)`` checked: one finite float per row, else a ConfigError naming the
    function (a ``{"scores", "keep"}`` answer gives its scores)."""
    return call_reward_fn_with_mask(fn, spec, key, prompts, responses, columns)[0]


def call_reward_fn_with_mask(
    fn: RewardFn, spec: str, key: str, prompts: list, responses: list[str], columns: Columns | None = None
) -> tuple[list[float], list[bool] | None]:
    """``fn(prompts, responses, **columns)`` checked (``columns``: one value per row; the function gets those its
    signature asks for, ``reward_fn_columns``): the scores (one finite float per row) and the keep mask (one bool
    per row; None when the function returned a plain list of scores). A ConfigError naming ``key`` and ``spec``
    when the function raises or returns anything else."""
    label = f"'{key}' = {spec!r}"
    kwargs = {}
    if columns is not None:
        given = columns.as_kwargs()
        kwargs = {name: list(given[name]) for name in reward_fn_columns(fn, spec, key, columns)}
    try:
        out = fn(list(prompts), list(responses), **kwargs)
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

    def check(self, prompts: list, columns: Columns | None = None) -> None:
        """Before any worker starts: the reward function takes the data's columns (``reward_fn_columns``) and
        answers a probe of ``prompts`` (their ``columns``, empty responses) in the expected shape, and the remote
        reward server answers (``RemoteRewardModel.check``)."""
        if self.reward_fn is not None:
            empty = [""] * len(prompts)
            call_reward_fn_with_mask(self.reward_fn, self.fn_spec, self.fn_key, prompts, empty, columns)
        if self.remote is not None:
            self.remote.check(columns.labels if columns is not None else None)

    def score_on_driver(
        self,
        tokenizer: Any,
        prompts: list,
        responses: list[list[int]],
        timer: timing.PhaseTimer | None = None,
        columns: Columns | None = None,
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """The reward function's and the server's (B,) scores by source key, of the raw ``prompts`` and ``columns``
        (one per response: labels and the rows' other values) and the decoded ``responses``, and the function's
        (B,) keep mask (None when it gives none). ``timer``: their seconds as ``experience_reward_fn`` and
        ``experience_remote_rm``."""
        parts: dict[str, torch.Tensor] = {}
        keep = None
        if self.reward_fn is None and self.remote is None:
            return parts, keep
        texts = [tokenizer.decode(r, skip_special_tokens=True) for r in responses]
        if self.reward_fn is not None:
            t0 = time.perf_counter()
            fn_scores, fn_keep = call_reward_fn_with_mask(
                self.reward_fn, self.fn_spec, self.fn_key, prompts, texts, columns
            )
            parts["reward_fn"] = torch.tensor(fn_scores, dtype=torch.float32)
            keep = torch.tensor(fn_keep, dtype=torch.bool) if fn_keep is not None else None
            if timer is not None:
                timer.add("experience_reward_fn", time.perf_counter() - t0)
        if self.remote is not None:
            t0 = time.perf_counter()
            labels = columns.labels if columns is not None else None
            parts["remote_rm_url"] = torch.tensor(self.remote.score(prompts, texts, labels), dtype=torch.float32)
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
