"""Off-policy correction between the rollout engine and the trainer (OpenRLHF ``algo.advantage.is_correction_type``,
``models/loss.py::PolicyLoss``; F. Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training"). The engine sampled with its own numerics; the loss takes the trainer's log-probs at rollout time as the
behaviour policy, so each token's loss is weighed by r_t = exp(old_t - rollout_t).

Pure torch. B = batch of sequences, T = response (action) positions; ``action_mask`` (B, T) as in ``ppo.py``.
"""

from __future__ import annotations

import torch

from .losses import masked_mean
from .vocab import IS_CORRECTIONS, ISCorrection


@torch.no_grad()
def is_correction_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    kind: ISCorrection,
    low: float,
    high: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token weights of the policy loss, with r_t = exp(clamp(old_t - rollout_t, -20, 20)):

    tis: w_t = clamp(r_t, low, high) (truncated IS, both ends clamped as OpenRLHF does);
    icepop: w_t = r_t where low <= r_t <= high, else 0 (the token leaves the loss);
    seq-mask-tis: w_t = r_t on the rows whose geometric-mean ratio exp(mean_t(old_t - rollout_t)) lies in
    [low, high], 0 on every token of the other rows (OpenRLHF's code weighs the kept rows by r_t unclamped).

    Tokens without an engine log-prob (NaN) count as r_t = 1 and are left out of the row means.

    Args:
        old_logprobs: (B, T) the trainer's log-probs at rollout time.
        rollout_logprobs: (B, T) the engine's, NaN where it reported none.
        action_mask: (B, T).
        kind: one of :data:`IS_CORRECTIONS`.
        low: 0 <= low < high.
        high: the upper threshold.
    Returns:
        (weights, stats): (B, T), 1 where the mask is 0; ``is_clipped_frac`` = share of action tokens whose weight
        tis clamped, ``is_masked_frac`` = share of action tokens weighed 0 (icepop, seq-mask-tis).
    """
    if kind not in IS_CORRECTIONS:
        raise ValueError(f"unknown IS correction {kind!r}; choose one of {IS_CORRECTIONS}")
    if not 0 <= low < high:
        raise ValueError(f"IS correction thresholds need 0 <= low < high, got [{low}, {high}]")
    mask = action_mask.bool()
    valid = mask & ~rollout_logprobs.isnan()
    log_ratio = torch.where(valid, old_logprobs - rollout_logprobs, torch.zeros_like(old_logprobs)).clamp(-20, 20)
    ratio = log_ratio.exp()
    if kind == "tis":
        weights = ratio.clamp(low, high)
        clipped = mask & (weights != ratio)
        dropped = torch.zeros_like(mask)
    else:
        if kind == "icepop":
            inside = (ratio >= low) & (ratio <= high)
        else:
            seq_ratio = masked_mean(log_ratio, valid, dim=1).exp()  # (B,)
            inside = ((seq_ratio >= low) & (seq_ratio <= high)).unsqueeze(1).expand_as(mask)
        weights = torch.where(inside, ratio, torch.zeros_like(ratio))
        clipped = torch.zeros_like(mask)
        dropped = mask & ~inside
    weights = torch.where(mask, weights, torch.ones_like(weights))
    stats = {
        "is_clipped_frac": masked_mean(clipped.to(ratio.dtype), mask).item(),
        "is_masked_frac": masked_mean(dropped.to(ratio.dtype), mask).item(),
    }
    return weights, stats


def is_correction_setting(
    kind: ISCorrection | None, threshold: list[float], cap: float | None
) -> tuple[ISCorrection, float, float] | None:
    """(kind, low, high) of the correction a config asks for, or None: ``cap`` (``algo.is_correction_cap``) is the
    older spelling of tis on [0, cap]; otherwise ``kind`` (``algo.is_correction``) on ``threshold``."""
    if cap is not None:
        return "tis", 0.0, cap
    if kind is None:
        return None
    low, high = threshold
    return kind, low, high
