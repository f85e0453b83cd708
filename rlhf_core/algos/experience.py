"""Typed batches for PPO: the sequences a rollout produced, and the experience computed on them.

Pure torch and dataclasses. Every field of a :class:`TensorBatch` is a tensor whose dim 0 is the batch (B rows), or
None (an optional field that was not computed); splitting, sharding and selecting rows act on every tensor field
alike and keep None fields None. Conventions as in :mod:`rlhf_core.algos.batching`: sequences are right-padded,
T = sequence length, and position t of a (B, T-1) per-token tensor belongs to the token at t+1.

The phases of a PPO step return new batches instead of mutating them, e.g.
``exp = exp.with_advantages(*gae(rewards, exp.values, exp.action_mask, gamma, lam))``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Self

import torch


@dataclass(kw_only=True)
class TensorBatch:
    """Base of the typed batches: every field is a tensor with the batch as dim 0, or None.

    Construction checks that all tensor fields have the same number of rows.
    """

    def __post_init__(self) -> None:
        rows = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                raise TypeError(f"{type(self).__name__}.{f.name} must be a tensor with a batch dim 0 or None")
            rows[f.name] = value.size(0)
        if not rows:
            raise ValueError(f"{type(self).__name__} has no tensor field")
        if len(set(rows.values())) > 1:
            raise ValueError(f"{type(self).__name__} fields disagree on the number of rows: {rows}")

    def tensors(self) -> dict[str, torch.Tensor]:
        """The non-None fields by name (the tensors themselves, not copies)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = value
        return out

    @property
    def size(self) -> int:
        """Number of rows B."""
        return next(iter(self.tensors().values())).size(0)

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Self:
        return dataclasses.replace(self, **{name: fn(value) for name, value in self.tensors().items()})

    def split(self, size: int) -> list[Self]:
        """Consecutive chunks of ``size`` rows (the last may be smaller); each field (n, ...) -> (size, ...)."""
        if size < 1:
            raise ValueError(f"split size must be >= 1, got {size}")
        return [self._map(lambda v, lo=lo: v[lo : lo + size]) for lo in range(0, self.size, size)]

    def shard(self, world_size: int) -> list[Self]:
        """``world_size`` equal contiguous shards of B / world_size rows; B must divide evenly. Each shard owns a
        compact copy of its rows: a shard goes to a Ray worker, and a view would carry the whole batch's storage."""
        n = self.size
        assert world_size >= 1 and n % world_size == 0, (
            f"{type(self).__name__} of {n} rows does not shard evenly over {world_size} ranks"
        )
        return [part._map(torch.Tensor.clone) for part in self.split(n // world_size)]

    def select_rows(self, index: torch.Tensor) -> Self:
        """The rows ``index`` (a (K,) long tensor, or a (B,) bool mask) of every field, in that order."""
        return self._map(lambda v: v[index.to(v.device)])


@dataclass(kw_only=True)
class SequenceBatch(TensorBatch):
    """Prompt + response sequences of a rollout (see ``batching.make_sequences``)."""

    input_ids: torch.Tensor  # (B, T) long, prompt + response, right-padded with the pad id
    attention_mask: torch.Tensor  # (B, T), 1 on real tokens, 0 on padding
    action_mask: torch.Tensor  # (B, T-1), 1 at position t when token t+1 is a response token (EOS included)

    def __post_init__(self) -> None:
        super().__post_init__()
        B, T = self.input_ids.shape
        if self.attention_mask.shape != (B, T) or self.action_mask.shape != (B, T - 1):
            raise ValueError(
                f"input_ids {tuple(self.input_ids.shape)} needs attention_mask {(B, T)} and action_mask "
                f"{(B, T - 1)}, got {tuple(self.attention_mask.shape)} and {tuple(self.action_mask.shape)}"
            )

    def sequences(self) -> SequenceBatch:
        """Only the three sequence fields, as a plain :class:`SequenceBatch` (what the models need as input)."""
        return SequenceBatch(
            input_ids=self.input_ids, attention_mask=self.attention_mask, action_mask=self.action_mask
        )


# per-token fields of an Experience: (B, T-1) like action_mask; per-row fields: (B,)
_PER_TOKEN = ("old_logprobs", "ref_logprobs", "values", "advantages", "returns", "is_weights", "rollout_logprobs")
_PER_ROW = ("scores", "truncated")


@dataclass(kw_only=True)
class Experience(SequenceBatch):
    """A rollout with what the models computed on it, and (after the advantage phase) advantages and returns.

    Shapes: B rows, T = width of ``input_ids``; per-token fields are (B, T-1) and aligned with ``action_mask``.
    """

    # (B, T-1) float, the behaviour policy's log-probs of the sampled tokens: the actor's at rollout time, or the
    # engines' (algo.use_rollout_logprobs); None = not computed, the actor's training forward gives them, detached (a
    # batch of one optimizer step: no update comes between the experience phase and that forward)
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None = None  # (B, T-1) float, reference-model log-probs; None = no reference model
    values: torch.Tensor | None = None  # (B, T-1) float, critic values at rollout time; None = no critic
    scores: torch.Tensor  # (B,) float, the reward of each sequence (before penalties, clipping and group shaping)
    truncated: torch.Tensor | None = None  # (B,) bool, True where the response had no EOS (batching.ensure_eos)
    advantages: torch.Tensor | None = None  # (B, T-1) float, from ppo.gae (then possibly whitened); None before
    returns: torch.Tensor | None = None  # (B, T-1) float, returns (GAE: advantages + values); None before
    # (B, T-1) float, off-policy weights engine -> trainer (algo.is_correction, is_correction_cap); None = off
    is_weights: torch.Tensor | None = None
    # (B, T-1) float, the engines' log-probs of the sampled tokens, NaN where none: sent to the actor only when
    # old_logprobs is None (its IS weights and rollout_logprob_max_diff are then measured in the training forward)
    rollout_logprobs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        B, T = self.input_ids.shape
        for name in _PER_TOKEN + _PER_ROW:
            value = getattr(self, name)
            want = (B, T - 1) if name in _PER_TOKEN else (B,)
            if value is not None and tuple(value.shape) != want:
                raise ValueError(f"Experience.{name} must be {want}, got {tuple(value.shape)}")

    @classmethod
    def from_sequences(
        cls,
        seq: SequenceBatch,
        *,
        old_logprobs: torch.Tensor | None,
        scores: torch.Tensor,
        values: torch.Tensor | None = None,
        ref_logprobs: torch.Tensor | None = None,
        truncated: torch.Tensor | None = None,
        rollout_logprobs: torch.Tensor | None = None,
    ) -> Experience:
        """An Experience on the sequences of ``seq`` (shapes as in the field comments), without advantages yet."""
        return cls(
            input_ids=seq.input_ids,
            attention_mask=seq.attention_mask,
            action_mask=seq.action_mask,
            old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs,
            values=values,
            scores=scores,
            truncated=truncated,
            rollout_logprobs=rollout_logprobs,
        )

    def with_advantages(self, advantages: torch.Tensor, returns: torch.Tensor | None) -> Experience:
        """A copy (same tensors, no data copied) with ``advantages`` and ``returns``, both (B, T-1) (``returns``
        None: a critic-free experience, which has none)."""
        return dataclasses.replace(self, advantages=advantages, returns=returns)
