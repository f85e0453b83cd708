"""Batch plumbing for experience: build padded (B, T) tensors from prompt/response ids, split and join dicts.

Pure torch. Conventions: sequences are right-padded; position t of a (B, T-1) per-token tensor (log-probs, values,
KL, rewards, advantages) belongs to the token at t+1, so ``action_mask[:, t]`` is 1 when token t+1 is a response
token.
"""

from __future__ import annotations

import torch


def make_sequences(
    prompts: list[list[int]], responses: list[list[int]], pad_id: int
) -> dict[str, torch.Tensor]:
    """Join each prompt with its response.

    Returns:
        ``input_ids`` (B, T) right-padded with ``pad_id``, ``attention_mask`` (B, T), ``action_mask`` (B, T-1).
    """
    rows = [p + r for p, r in zip(prompts, responses)]
    width = max(len(x) for x in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    action_mask = torch.zeros((len(rows), width - 1), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
        attention_mask[i, : len(p) + len(r)] = 1
        action_mask[i, len(p) - 1 : len(p) - 1 + len(r)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "action_mask": action_mask}


def split_batch(batch: dict[str, torch.Tensor], size: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive chunks of ``size`` rows (the last may be smaller)."""
    n = next(iter(batch.values())).size(0)
    return [{k: v[lo : lo + size] for k, v in batch.items()} for lo in range(0, n, size)]


def shard_batch(batch: dict[str, torch.Tensor], world_size: int) -> list[dict[str, torch.Tensor]]:
    """``world_size`` equal contiguous shards (rows must divide evenly)."""
    n = next(iter(batch.values())).size(0)
    assert n % world_size == 0, f"{n} rows do not split over {world_size} ranks"
    return split_batch(batch, n // world_size)


def select_rows(batch: dict[str, torch.Tensor], index: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v[index] for k, v in batch.items()}
