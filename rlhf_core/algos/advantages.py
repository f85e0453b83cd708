"""Advantage estimators beyond GAE, after OpenRLHF's experience maker: REINFORCE++ (and its baseline variant),
GRPO, RLOO and Dr. GRPO, which need no critic.

Pure torch, tensor in and tensor out. B = batch of sequences, T = response (action) positions. The rows of a
rollout are grouped by prompt, consecutively: rows [k*n, (k+1)*n) are the n samples of prompt k
(``rollout.n_samples_per_prompt``).

A critic-free step: the sequence reward is shaped within its group (:func:`shape_scores`), spread over the tokens with
the KL penalty (``ppo.token_rewards``), and the advantage of a token is its return (:func:`cumulative_returns`);
REINFORCE++ then whitens the advantages over the whole rollout batch across the data-parallel ranks
(``ppo.distributed_masked_whiten``; :func:`whitens` says which estimators do).
"""

from __future__ import annotations

import torch

from .vocab import ADVANTAGE_ESTIMATORS, GROUP_ESTIMATORS, AdvantageEstimator


def _known(estimator: str) -> None:
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {ADVANTAGE_ESTIMATORS}")


def whitens(estimator: AdvantageEstimator, whiten_advantages: bool) -> bool:
    """Whether the advantages are whitened over the whole rollout batch (all ranks) before the policy loss: GAE when
    ``whiten_advantages``; REINFORCE++ and REINFORCE++-baseline always (their normalisation is global); GRPO, RLOO
    and Dr. GRPO never (theirs is within the group)."""
    _known(estimator)
    if estimator == "gae":
        return whiten_advantages
    return estimator in ("reinforce++", "reinforce++_baseline")


def _groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    if group_size < 1 or scores.dim() != 1 or scores.numel() % group_size:
        raise ValueError(f"{scores.numel()} scores do not split into groups of {group_size} samples per prompt")
    return scores.double().view(-1, group_size)


def shape_scores(
    scores: torch.Tensor, group_size: int, estimator: AdvantageEstimator, eps: float = 1e-9
) -> torch.Tensor:
    """Each sequence's reward as the estimator uses it.

    gae, reinforce++: r unchanged. reinforce++_baseline, dr_grpo: r - mean(group). grpo: (r - mean(group)) /
    (std(group) + eps), the std with Bessel's correction (as torch's default). rloo: r - (sum(group) - r) / (n - 1),
    the mean of the *other* samples of the prompt. A group of identical rewards gets 0 from every group estimator.

    Args:
        scores: (B,) rewards, B = prompts x ``group_size``, the samples of a prompt consecutive.
        group_size: samples per prompt n (>= 2 for the group estimators).
        estimator: one of :data:`ADVANTAGE_ESTIMATORS`.
    Returns:
        (B,) in the dtype of ``scores`` (computed in float64).
    """
    _known(estimator)
    if estimator in GROUP_ESTIMATORS and group_size < 2:
        raise ValueError(
            f"advantage estimator {estimator!r} compares the samples of a prompt: it needs "
            f"n_samples_per_prompt >= 2, got {group_size}"
        )
    if estimator in ("gae", "reinforce++"):
        return scores.clone()
    g = _groups(scores, group_size)
    mean = g.mean(dim=1, keepdim=True)
    if estimator in ("reinforce++_baseline", "dr_grpo"):
        out = g - mean
    elif estimator == "grpo":
        out = (g - mean) / (g.std(dim=1, keepdim=True) + eps)
    else:  # rloo
        out = g - (g.sum(dim=1, keepdim=True) - g) / (group_size - 1)
    return out.reshape(-1).to(scores.dtype)


@torch.no_grad()
def cumulative_returns(rewards: torch.Tensor, action_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Discounted returns over the action tokens, backwards: G_t = r_t + gamma * G_n, n = the next action token.

    Masked positions (padding, holes inside a response) are not time steps: G is carried across them unchanged, and
    they are 0 in the output. With gamma = 1 each token's return is the sum of the rewards from it to the end.

    Args:
        rewards: (B, T) token rewards (``ppo.token_rewards``).
        action_mask: (B, T).
        gamma: discount in [0, 1].
    Returns:
        (B, T), 0 where ``action_mask`` is 0; no grad.
    """
    keep = action_mask.bool()
    # where, not multiply: a non-finite reward on a masked position must not leak through 0 * inf.
    rewards = torch.where(keep, rewards, torch.zeros_like(rewards))
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.size(1))):
        running = torch.where(keep[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(keep[:, t], running, torch.zeros_like(running))
    return returns


def varied_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) bool: True for the rows of the prompts whose samples did not all get the same reward (DAPO's dynamic
    sampling keeps only those: a group of equal rewards has no signal). ``group_size`` 1: every row."""
    if group_size == 1:
        return torch.ones(scores.numel(), dtype=torch.bool, device=scores.device)
    g = _groups(scores, group_size)
    varied = (g.max(dim=1).values > g.min(dim=1).values).unsqueeze(1)
    return varied.expand_as(g).reshape(-1)
