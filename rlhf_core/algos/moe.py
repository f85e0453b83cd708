"""The Mixture-of-Experts auxiliary (load-balancing) loss over the real tokens of a batch.

Pure torch. transformers computes the loss of Switch Transformer (eqs. 4-6) from the router logits, weighted by the
attention mask; a packed batch (``algos.packing``) has no mask, and its rows end in filler tokens that the router
still routes, so the loss is computed here with an explicit mask of the real tokens, the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def load_balancing_loss(router_logits: Sequence[torch.Tensor], top_k: int, mask: torch.Tensor) -> torch.Tensor:
    """``E * sum_e f_e * P_e`` over the tokens where ``mask`` is 1: ``f_e`` the top-k assignments to expert ``e`` per
    token and ``P_e`` the mean router probability of ``e``, both summed over the layers before they are divided (as
    transformers' ``load_balancing_loss_func``). Uniform routing gives ``top_k``.

    Args:
        router_logits: one (N, E) tensor per MoE layer, a row per token of the forward (N = rows x length).
        top_k: experts routed per token.
        mask: N values, 1 on the real tokens, 0 on padding or packing filler.
    Returns:
        scalar, float32.
    """
    experts = router_logits[0].shape[-1]
    weights = mask.reshape(-1).float()
    counts = torch.zeros(experts, dtype=torch.float32, device=router_logits[0].device)
    probs = torch.zeros_like(counts)
    for logits in router_logits:
        p = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(p, top_k, dim=-1).indices
        counts = counts.scatter_add(0, chosen.reshape(-1), weights.repeat_interleave(top_k))
        probs = probs + (p * weights[:, None]).sum(0)
    rows = weights.sum() * len(router_logits)
    return experts * torch.sum((counts / rows) * (probs / rows))


def with_aux_loss(loss: torch.Tensor, aux_loss: list[torch.Tensor] | None, coef: float) -> tuple[torch.Tensor, dict]:
    """``loss + coef * mean(aux_loss)`` and the stat ``aux_loss`` (the mean), for a loss whose forwards collected
    their MoE load-balancing losses in ``aux_loss``; ``loss`` and no stat when nothing was collected (None)."""
    if aux_loss is None:
        return loss, {}
    aux = torch.stack([a.to(loss.device) for a in aux_loss]).mean()
    return loss + coef * aux, {"aux_loss": aux.item()}


def aux_list(coef: float) -> Any:
    """The list a forward collects its MoE load-balancing loss in (``models.forward``), or None when ``coef`` is 0."""
    return [] if coef else None
