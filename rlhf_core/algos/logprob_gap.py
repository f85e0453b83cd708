"""The rollout engines' log-probs against the actor's: how far the sampler's policy is from the trained one.

The engines report the log-prob of each token they sample (at the rollout temperature, processed log-probs); the
actor scores the same tokens with its logits divided by that temperature. Right after a weight sync the two should
agree up to numerics, so the largest gap is a check of the sync and a hint of sampler/trainer mismatch.
"""

from __future__ import annotations

import torch

from rlhf_core.algos.experience import Experience, SequenceBatch


def engine_logprob_tensor(exp: SequenceBatch, engine_logprobs: list[list[float]]) -> torch.Tensor:
    """The engines' per-response log-probs placed on the action positions.

    Args:
        exp: the step's sequences (or experience); its ``action_mask`` (B, T-1) gives each response's action positions.
        engine_logprobs: B lists, the engine's log-prob of each sampled token, one per action token.

    Returns:
        (B, T-1) the engines' log-probs on the action positions, NaN elsewhere (and where an engine reported none).
    """
    engine = torch.full(exp.action_mask.shape, float("nan"), dtype=torch.float32)
    for i, lps in enumerate(engine_logprobs):
        positions = exp.action_mask[i].nonzero().flatten()
        if len(lps) != len(positions):
            raise ValueError(f"response {i}: {len(lps)} engine log-probs for {len(positions)} action tokens")
        engine[i, positions] = torch.tensor(lps, dtype=engine.dtype)
    return engine


def rollout_logprob_gap(exp: Experience, engine: torch.Tensor) -> float:
    """max |engine log-prob - actor old log-prob| over the action tokens.

    Args:
        exp: the step's experience, with the actor's ``old_logprobs`` (B, T-1).
        engine: (B, T-1) from :func:`engine_logprob_tensor`; NaN entries (a response the engine did not produce)
            are skipped.

    Returns:
        The largest absolute gap; 0.0 when nothing is comparable.
    """
    assert exp.old_logprobs is not None, "the gap compares the engines' log-probs with the actor's"
    valid = exp.action_mask.bool() & ~engine.isnan()
    if not valid.any():
        return 0.0
    return (engine - exp.old_logprobs)[valid].abs().max().item()
