"""Supervised losses: response-only next-token loss (SFT) and the pairwise Bradley-Terry loss (reward model), with the
masked reductions and token log-probs that the PPO losses share.

Pure torch, tensor in and tensor out; shapes in the docstrings. B = batch, T = sequence length, V = vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


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
    """Log-probability of each next token, under the logits divided by the sampling temperature: the
    full-vocabulary formula at every position (the stages and roles use :func:`chunked_token_logprobs` on the
    scored positions only, through ``rlhf_core.models.forward``; this one is their reference).

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


# Logits per chunk of chosen-token log-probs: chunk positions x vocabulary stays at most this many elements
# (128 MiB of fp32), e.g. 1024 positions of a 32k vocabulary, 220 of Qwen's 152k.
LOGPROB_CHUNK_ELEMENTS = 2**25


def logprob_chunk_size(vocab_size: int, max_elements: int = LOGPROB_CHUNK_ELEMENTS) -> int:
    """Positions per chunk of :func:`chunked_token_logprobs`: ``max_elements // vocab_size``, at least 1."""
    return max(1, max_elements // max(1, vocab_size))


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy -sum_v p_v log p_v of softmax(logits) over the last dim, as logsumexp(l) - sum_v softmax(l)_v * l_v.

    Args:
        logits: (..., V).
    Returns:
        (...) float32.
    """
    logits = logits.float()
    return torch.logsumexp(logits, dim=-1) - (F.softmax(logits, dim=-1) * logits).sum(-1)


def _chunk_logprobs(hidden: torch.Tensor, targets: torch.Tensor, head: Callable, temperature: float) -> torch.Tensor:
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _chunk_logprobs_entropy(
    hidden: torch.Tensor, targets: torch.Tensor, head: Callable, temperature: float
) -> torch.Tensor:
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    chosen = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return torch.stack([chosen, entropy_from_logits(logits)], dim=-1)


def chunked_token_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log p(target) for the chosen positions only, ``chunk_size`` positions at a time: logits = ``head(hidden)``,
    log p = logit[target] - logsumexp(logits), the same as ``log_softmax(logits)[target]`` (as
    :func:`token_logprobs`) without ever holding more than one chunk's (chunk_size, V) fp32 logits. With autograd
    on, each chunk is checkpointed: backward recomputes its logits instead of keeping them, so training memory does
    not grow with positions x vocabulary either.

    Args:
        hidden: (M, H) final hidden states at the positions whose next token is scored.
        targets: (M,) long, the next token at each of them.
        head: (m, H) -> (m, V) logits (the LM head).
        temperature: > 0; the logits are divided by it.
        chunk_size: positions per chunk (>= 1), e.g. :func:`logprob_chunk_size` of the vocabulary.
        with_entropy: also the entropy of each position's distribution (:func:`entropy_from_logits` of the
            tempered logits), from the same chunks.
    Returns:
        (M,) float32; with ``with_entropy``, (log-probs, entropies), both (M,).
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    fn = _chunk_logprobs_entropy if with_entropy else _chunk_logprobs
    parts = []
    for lo in range(0, hidden.size(0), chunk_size):
        h, t = hidden[lo : lo + chunk_size], targets[lo : lo + chunk_size]
        if torch.is_grad_enabled() and h.requires_grad:
            parts.append(checkpoint(fn, h, t, head, temperature, use_reentrant=False))
        else:
            parts.append(fn(h, t, head, temperature))
    shape = (0, 2) if with_entropy else (0,)
    out = torch.cat(parts) if parts else hidden.new_zeros(shape, dtype=torch.float32)
    return (out[:, 0], out[:, 1]) if with_entropy else out


def sft_loss(logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of the response tokens.

    Args:
        logprobs: (B, T-1) next-token log-probs (:func:`token_logprobs`, or the chosen-token ones of
            ``rlhf_core.models.forward.causal_lm_logprobs``, which only fills the masked positions).
        loss_mask: (B, T), 1 on the tokens to learn (the response and its EOS), 0 on prompt and padding.
    Returns:
        scalar: -mean over masked targets of log p(token | prefix). Position 0 is never a target.
    """
    return -masked_mean(logprobs, loss_mask[:, 1:])


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
