"""GSPO's sequence-level importance ratio (Zheng et al. 2025, arXiv 2507.18071; OpenRLHF ``policy_loss_type=gspo``).

Pure torch. B = batch of sequences, T = response (action) positions; ``action_mask`` (B, T) as in ``ppo.py``.
"""

from __future__ import annotations

import torch

from .losses import masked_mean


def gspo_log_ratio(
    pi_logprobs: torch.Tensor, pi_old_logprobs: torch.Tensor, action_mask: torch.Tensor
) -> torch.Tensor:
    """Log of GSPO-token's ratio s_i,t = sg[s_i] * exp(logp_t - sg[logp_t]), with the sequence ratio
    s_i = exp(mean over row i's action tokens of (logp_t - old_t)), its log clamped to [-20, 20] like PPO's.

    Its value is log s_i on every token of row i; its gradient is that of logp_t alone, so d s_i,t / d logp_t = s_i
    and, with one advantage per sequence, the token mean of s_i,t * A_i has the gradient of s_i * A_i (the
    sequence-level GSPO objective) while a per-token advantage still reaches its own token.

    Args:
        pi_logprobs: (B, T) log-probs under the policy being trained (with grad).
        pi_old_logprobs: (B, T) log-probs under the rollout policy.
        action_mask: (B, T).
    Returns:
        (B, T); a row without action tokens has log s_i = 0; masked positions carry log s_i and no gradient.
    """
    # where, not multiply: a non-finite log-prob on a padding position must not leak through 0 * inf.
    keep = action_mask.bool()
    diff = torch.where(keep, pi_logprobs - pi_old_logprobs, torch.zeros_like(pi_logprobs))
    seq = masked_mean(diff.detach(), keep, dim=1).clamp(-20.0, 20.0)  # (B,) log s_i, no grad
    carrier = torch.where(keep, pi_logprobs - pi_logprobs.detach(), torch.zeros_like(pi_logprobs))  # value 0
    return seq.unsqueeze(1) + carrier
