"""Supervised losses: response-only next-token loss (SFT) and the pairwise Bradley-Terry loss (reward model).

Pure torch, tensor in and tensor out; shapes in the docstrings. B = batch, T = sequence length, V = vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is 1.

    Args:
        values: any shape.
        mask: same shape, 0/1 (bool or number).
        dim: reduce over this dim only; None = over everything.
    Returns:
        scalar, or ``values`` reduced over ``dim``. An all-zero mask gives 0, not NaN.
    """
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1.0)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Log-probability of each next token.

    Args:
        logits: (B, T, V) from a causal LM over ``input_ids``.
        input_ids: (B, T).
    Returns:
        (B, T-1): entry t is log p(input_ids[:, t+1] | input_ids[:, :t+1]).
    """
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def sft_loss(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of the response tokens.

    Args:
        logits: (B, T, V).
        input_ids: (B, T).
        loss_mask: (B, T), 1 on the tokens to learn (the response and its EOS), 0 on prompt and padding.
    Returns:
        scalar: -mean over masked targets of log p(token | prefix). Position 0 is never a target.
    """
    return -masked_mean(token_logprobs(logits, input_ids), loss_mask[:, 1:])


def pairwise_reward_loss(
    chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, margin: float | torch.Tensor = 0.0
) -> torch.Tensor:
    """Bradley-Terry loss: -mean log sigmoid(r_chosen - r_rejected - margin).

    Args:
        chosen_rewards: (B,) scalar rewards of the preferred responses.
        rejected_rewards: (B,).
        margin: a float or (B,) tensor.
    Returns:
        scalar loss.
    """
    return -F.logsigmoid(chosen_rewards - rejected_rewards - margin).mean()


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last non-pad token of each row (works for left, right or no padding).

    Args:
        attention_mask: (B, T), 1 on real tokens.
    Returns:
        (B,) long.
    """
    positions = torch.arange(attention_mask.size(1), device=attention_mask.device)
    return (positions * attention_mask.long()).argmax(dim=1)
