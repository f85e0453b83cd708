"""The MoE load-balancing loss by hand, with and without filler tokens, and against transformers' own."""

import math

import torch

from rlhf_core.algos.moe import load_balancing_loss


def test_two_tokens_two_experts_by_hand():
    # token 1: logits (ln 3, 0) -> probabilities (0.75, 0.25), routed (top 1) to expert 0
    # token 2: logits (0, ln 3) -> (0.25, 0.75), routed to expert 1
    # f = (1/2, 1/2), P = (0.5, 0.5): loss = 2 * (1/2 * 0.5 + 1/2 * 0.5) = 1.0 (balanced)
    two = torch.tensor([[math.log(3), 0.0], [0.0, math.log(3)]])
    assert torch.allclose(load_balancing_loss([two], 1, torch.ones(2)), torch.tensor(1.0))
    # a filler token routed to expert 0 (logits (ln 3, 0)) counted as real:
    # f = (2/3, 1/3), P = ((0.75 + 0.25 + 0.75) / 3, (0.25 + 0.75 + 0.25) / 3) = (7/12, 5/12)
    # loss = 2 * (2/3 * 7/12 + 1/3 * 5/12) = 2 * 19/36 = 19/18
    three = torch.cat([two, torch.tensor([[math.log(3), 0.0]])])
    assert torch.allclose(load_balancing_loss([three], 1, torch.ones(3)), torch.tensor(19 / 18))
    # masked out, it does not count: 1.0 again
    assert torch.allclose(load_balancing_loss([three], 1, torch.tensor([1.0, 1.0, 0.0])), torch.tensor(1.0))
    # two layers: counts and probabilities summed over the layers, then divided by 2 x 2 rows (the same as one)
    assert torch.allclose(load_balancing_loss([two, two], 1, torch.ones(2)), torch.tensor(1.0))


def test_equals_transformers_loss_with_an_attention_mask():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    gen = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(2 * 5, 4, generator=gen) for _ in range(3))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    ours = load_balancing_loss(logits, 2, mask.reshape(-1))
    assert torch.allclose(ours, load_balancing_loss_func(logits, 4, 2, mask), atol=1e-6)
