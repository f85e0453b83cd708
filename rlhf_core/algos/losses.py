"""Supervised losses: response-only next-token loss (SFT) and the pairwise Bradley-Terry loss (reward model), with the
masked reductions and token log-probs that the PPO losses share.

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


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is 1.

    Args:
        values: any shape.
        mask: same shape, 0/1 (bool or number).
        dim: reduce over this dim only; None = over everything.
    Returns:
        scalar, or ``values`` summed over ``dim``. An all-zero mask gives 0.
    """
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum()
    return (values * mask).sum(dim)


def window_loss_scale(accumulation_steps: int, world_size: int) -> float:
    """Factor that turns per-micro-batch token sums into the token mean over a whole gradient-accumulation window.

    One optimizer step sees ``accumulation_steps`` micro-batches on each of ``world_size`` data-parallel ranks: the
    window. DeepSpeed divides each micro-batch loss by ``accumulation_steps`` before backward and averages the
    gradients over the ranks, so the step's gradient is the mean, over ranks and micro-batches, of the micro-batch
    gradients. A per-micro-batch token mean therefore weighs a token by 1 / (its micro-batch's token count): tokens of
    short responses count more. With N_window = the number of action tokens of the whole window (summed over every
    micro-batch and every rank, e.g. by an all-reduce), the micro-batch loss

        sum_t(loss_t * mask_t) / N_window * accumulation_steps * world_size

    makes the step's gradient exactly that of the token mean over the N_window tokens (OpenRLHF 0.11
    ``aggregate_loss``): every token of the window has weight 1 / N_window, on every rank. With the losses of
    :mod:`rlhf_core.algos.ppo` that is ``num_tokens=N_window / window_loss_scale(accumulation_steps, world_size)``.

    Args:
        accumulation_steps: micro-batches per optimizer step on one rank (>= 1).
        world_size: data-parallel ranks that average their gradients (>= 1).
    Returns:
        ``accumulation_steps * world_size`` as a float.
    """
    if accumulation_steps < 1 or world_size < 1:
        raise ValueError(f"need accumulation_steps >= 1 and world_size >= 1, got {accumulation_steps}, {world_size}")
    return float(accumulation_steps * world_size)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each next token, under the logits divided by the sampling temperature.

    Use the rollout's temperature so that the log-probs are those of the distribution the tokens were sampled from
    (as OpenRLHF does); 1.0 leaves the logits as they are (no division at all).

    Args:
        logits: (B, T, V) from a causal LM over ``input_ids``.
        input_ids: (B, T).
        temperature: > 0; ``log_softmax(logits / temperature)``.
    Returns:
        (B, T-1) float32: entry t is log p(input_ids[:, t+1] | input_ids[:, :t+1]).
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logits = logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = F.log_softmax(logits, dim=-1)
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
