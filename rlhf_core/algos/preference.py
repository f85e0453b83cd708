"""Offline preference losses: DPO (with its cDPO and IPO variants) and KTO, as OpenRLHF's ``DPOLoss`` and
``KTOLoss``, and the per-sequence log-probs they take.

Pure torch, tensor in and tensor out; shapes in the docstrings. B = batch, T = sequence length. The log-prob inputs
are per-sequence sums (or means) of token log-probs, e.g. from :func:`sequence_logprobs`; "pi" is the policy being
trained, "ref" the frozen reference model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .losses import masked_mean, masked_sum

DPO_LOSS_TYPES = ("sigmoid", "ipo")


def sequence_logprobs(token_logprobs: torch.Tensor, mask: torch.Tensor, average: bool = False) -> torch.Tensor:
    """Log-prob of each whole response: sum_t(logp_t * mask_t), or that divided by sum_t(mask_t) when ``average``.

    Args:
        token_logprobs: (B, T) per-token log-probs.
        mask: (B, T), 0/1 (bool or number), 1 on the response tokens.
        average: mean over the masked tokens instead of the sum (an all-zero row gives 0, not NaN).
    Returns:
        (B,).
    """
    if token_logprobs.shape != mask.shape:
        raise ValueError(
            f"token_logprobs and mask must have the same shape, got {tuple(token_logprobs.shape)} "
            f"and {tuple(mask.shape)}"
        )
    if average:
        return masked_mean(token_logprobs, mask, dim=-1)
    return masked_sum(token_logprobs, mask, dim=-1)


@dataclass(frozen=True)
class PreferenceStats:
    """What :func:`dpo_loss` returns.

    Attributes:
        loss: scalar, differentiable.
        chosen_rewards: (B,) implicit rewards beta * (pi_c - ref_c), detached.
        rejected_rewards: (B,) beta * (pi_r - ref_r), detached.
    """

    loss: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor

    @property
    def accuracy(self) -> torch.Tensor:
        """Scalar: fraction of pairs whose chosen reward is strictly above the rejected one."""
        return (self.chosen_rewards > self.rejected_rewards).float().mean()

    @property
    def margin(self) -> torch.Tensor:
        """Scalar: mean of chosen_rewards - rejected_rewards."""
        return (self.chosen_rewards - self.rejected_rewards).mean()


def _check_beta(beta: float) -> None:
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> PreferenceStats:
    """DPO loss (Rafailov et al. 2023) with its conservative (cDPO) and IPO (Azar et al. 2023) variants.

    logits_i = (pi_c - pi_r) - (ref_c - ref_r), then per pair

        sigmoid: loss_i = -(1 - eps) * logsigmoid(beta * logits_i) - eps * logsigmoid(-beta * logits_i)
                 (plain DPO at eps = label_smoothing = 0, cDPO for 0 < eps < 0.5)
        ipo:     loss_i = (logits_i - 1 / (2 * beta))^2

    and loss = mean_i loss_i. With policy == reference, the sigmoid loss is log 2 and every reward is 0.

    Args:
        policy_chosen: (B,) sequence log-probs of the chosen responses under the policy.
        policy_rejected: (B,) of the rejected responses under the policy.
        ref_chosen: (B,) of the chosen responses under the reference (no gradient needed).
        ref_rejected: (B,) of the rejected responses under the reference.
        beta: > 0, the KL strength (sigmoid) or the target margin 1 / (2 beta) (ipo).
        loss_type: "sigmoid" or "ipo".
        label_smoothing: eps in [0, 0.5), the assumed rate of flipped preference labels; "sigmoid" only.
    Returns:
        :class:`PreferenceStats` (loss, chosen_rewards, rejected_rewards; accuracy and margin as properties).
    """
    _check_beta(beta)
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if loss_type != "sigmoid" and label_smoothing != 0.0:
        raise ValueError(
            f"label_smoothing applies to loss_type='sigmoid' only, got {label_smoothing} with {loss_type!r}"
        )
    logits = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    if loss_type == "ipo":
        losses = (logits - 1.0 / (2.0 * beta)) ** 2
    else:
        losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * logits)
        if label_smoothing:
            losses = losses - label_smoothing * F.logsigmoid(-beta * logits)
    return PreferenceStats(
        loss=losses.mean(),
        chosen_rewards=beta * (policy_chosen - ref_chosen).detach(),
        rejected_rewards=beta * (policy_rejected - ref_rejected).detach(),
    )


def kl_reference_point(policy_kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor, clamp: bool = True) -> torch.Tensor:
    """KTO's reference point z_ref = max(0, mean_j(pi_kl_j - ref_kl_j)), detached: an estimate of KL(pi || ref)
    from mismatched (prompt, response) pairs.

    Across data-parallel ranks OpenRLHF averages the means first and clamps after: call this with ``clamp=False``,
    all-reduce the result (sum / world_size), and pass it as ``kl`` to :func:`kto_loss`, which clamps it.

    Args:
        policy_kl_logps: (B_kl,) sequence log-probs of the mismatched responses under the policy.
        ref_kl_logps: (B_kl,) under the reference.
        clamp: clamp the mean at 0 (False: the raw mean, for an all-reduce before the clamp).
    Returns:
        scalar, detached.
    """
    kl = (policy_kl_logps - ref_kl_logps).mean().detach()
    return kl.clamp(min=0) if clamp else kl


class KTOStats(NamedTuple):
    """What :func:`kto_loss` returns; unpacks as ``loss, rewards, kl``.

    Attributes:
        loss: scalar, differentiable.
        rewards: (B,) implicit rewards beta * (pi - ref), detached (select desirable / undesirable with the mask).
        kl: scalar z_ref that was used, detached, >= 0.
    """

    loss: torch.Tensor
    rewards: torch.Tensor
    kl: torch.Tensor


def kto_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    policy_kl_logps: torch.Tensor | None,
    ref_kl_logps: torch.Tensor | None,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    kl: torch.Tensor | None = None,
) -> KTOStats:
    """KTO loss (Ethayarajh et al. 2024), as OpenRLHF's ``KTOLoss``.

    z_ref = max(0, mean_j(pi_kl_j - ref_kl_j)) detached (:func:`kl_reference_point`), or max(0, ``kl``) when given;
    r_i = pi_i - ref_i; then

        desirable:   loss_i = desirable_weight   * (1 - sigmoid(beta * (r_i - z_ref)))
        undesirable: loss_i = undesirable_weight * (1 - sigmoid(beta * (z_ref - r_i)))

    and loss = mean over all i, desirable and undesirable together.

    Args:
        policy_logps: (B,) sequence log-probs of the responses under the policy.
        ref_logps: (B,) under the reference.
        desirable: (B,) bool, True where the response is labelled desirable.
        policy_kl_logps: (B_kl,) policy log-probs of mismatched (prompt, response) pairs; may be None when ``kl``
            is given.
        ref_kl_logps: (B_kl,) reference log-probs of the same pairs; may be None when ``kl`` is given.
        beta: > 0.
        desirable_weight: >= 0, weight of the desirable examples' losses.
        undesirable_weight: >= 0, weight of the undesirable examples' losses.
        kl: scalar KL estimate to use instead of the one from the KL log-probs (e.g. already averaged over ranks);
            it is detached and clamped at 0.
    Returns:
        :class:`KTOStats` (loss, rewards, kl).
    """
    _check_beta(beta)
    if desirable_weight < 0:
        raise ValueError(f"desirable_weight must be >= 0, got {desirable_weight}")
    if undesirable_weight < 0:
        raise ValueError(f"undesirable_weight must be >= 0, got {undesirable_weight}")
    if desirable.shape != policy_logps.shape:
        raise ValueError(
            f"desirable must have the shape of policy_logps {tuple(policy_logps.shape)}, got {tuple(desirable.shape)}"
        )
    if kl is None:
        if policy_kl_logps is None or ref_kl_logps is None:
            raise ValueError("policy_kl_logps and ref_kl_logps are required when kl is not given")
        z_ref = kl_reference_point(policy_kl_logps, ref_kl_logps)
    else:
        z_ref = torch.as_tensor(kl, dtype=policy_logps.dtype, device=policy_logps.device).detach().clamp(min=0)
    logratios = policy_logps - ref_logps
    desirable = desirable.bool()
    losses = torch.where(
        desirable,
        desirable_weight * (1.0 - torch.sigmoid(beta * (logratios - z_ref))),
        undesirable_weight * (1.0 - torch.sigmoid(beta * (z_ref - logratios))),
    )
    return KTOStats(loss=losses.mean(), rewards=beta * logratios.detach(), kl=z_ref)
