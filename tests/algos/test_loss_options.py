"""Policy-loss options of ``rlhf_core.algos.ppo``: clip-higher, dual clip, importance weights, loss aggregation, the
KL loss term (plain and unbiased) with its gradient, and the entropy of ``losses``; the expected values worked by
hand. The IS weights themselves: ``test_is_correction.py``; GSPO's ratio: ``test_gspo.py``."""

import math

import pytest
import torch
from torch.testing import assert_close

from rlhf_core.algos.losses import chunked_token_logprobs, entropy_from_logits
from rlhf_core.algos.ppo import (
    aggregate_loss,
    kl_loss_tokens,
    policy_loss,
    policy_loss_tokens,
)

ONE = torch.ones(1, 1)


def _loss(ratio: float, advantage: float, **kwargs) -> torch.Tensor:
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss_t, _ = policy_loss_tokens(logp, torch.zeros(1, 1), torch.tensor([[advantage]]), ONE, **kwargs)
    return loss_t


def test_clip_higher_moves_only_the_upper_bound():
    # ratio 1.25, A = 1: symmetric 0.2 clips it at 1.2 -> -min(1.25, 1.2) = -1.2; eps_high 0.28 does not -> -1.25
    assert _loss(1.25, 1.0, clip_eps_low=0.2).item() == pytest.approx(-1.2)
    assert _loss(1.25, 1.0, clip_eps_low=0.2, clip_eps_high=0.28).item() == pytest.approx(-1.25)
    # ratio 0.5, A = -1: the lower bound 0.8 holds either way -> -min(-0.5, -0.8) = 0.8
    assert _loss(0.5, -1.0, clip_eps_low=0.2, clip_eps_high=0.28).item() == pytest.approx(0.8)


def test_dual_clip_bounds_a_negative_advantage_and_stops_its_gradient():
    # ratio 5, A = -1: surr = -5, clipped 1.2 x -1 = -1.2; -min(-5, -1.2) = 5, gradient d(-ratio A)/dlogp = 5
    logp = torch.tensor([[math.log(5.0)]], requires_grad=True)
    plain, _ = policy_loss_tokens(logp, torch.zeros(1, 1), -ONE, ONE)
    plain.sum().backward()
    assert plain.item() == pytest.approx(5.0) and logp.grad.item() == pytest.approx(5.0)
    # dual clip 3: min(5, -3 x -1) = 3, a constant: no gradient
    logp.grad = None
    bounded, stats = policy_loss_tokens(logp, torch.zeros(1, 1), -ONE, ONE, dual_clip=3.0)
    bounded.sum().backward()
    assert bounded.item() == pytest.approx(3.0) and logp.grad.item() == 0.0
    assert stats["dual_clip_frac"] == 1.0
    # a positive advantage is untouched by the dual clip: ratio 5, A = 1 -> -min(5, 1.2) = -1.2
    assert _loss(5.0, 1.0, dual_clip=3.0).item() == pytest.approx(-1.2)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        _loss(5.0, -1.0, dual_clip=1.0)


def test_importance_weights_scale_each_token_loss():
    # ratio 1.1, A = 2: -2.2; weight 0.5 -> -1.1. The padding token stays 0 whatever its inputs.
    logp = torch.tensor([[math.log(1.1), 30.0]])
    loss_t, _ = policy_loss_tokens(
        logp,
        torch.zeros(1, 2),
        torch.tensor([[2.0, 9.0]]),
        torch.tensor([[1, 0]]),
        is_weights=torch.tensor([[0.5, 7.0]]),
    )
    assert_close(loss_t, torch.tensor([[-1.1, 0.0]]))


LOSS_T = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # row 2 dropped (no action token)


def test_loss_aggregations_by_hand():
    # token_mean: (1 + 2 + 3 + 4) / 4 tokens = 2.5; with a window's 8 tokens: 10 / 8 = 1.25
    assert aggregate_loss(LOSS_T, MASK, "token_mean").item() == pytest.approx(2.5)
    assert aggregate_loss(LOSS_T, MASK, "token_mean", num_tokens=8.0).item() == pytest.approx(1.25)
    # seq_mean: row means 6/3 = 2 and 4/1 = 4 over the 2 rows with tokens -> 3; over a window's 4 sequences -> 1.5
    assert aggregate_loss(LOSS_T, MASK, "seq_mean").item() == pytest.approx(3.0)
    assert aggregate_loss(LOSS_T, MASK, "seq_mean", num_sequences=4.0).item() == pytest.approx(1.5)
    # seq_sum_norm (Dr. GRPO), length 4: row sums 6 and 4 -> 6/4 + 4/4 = 2.5, over 2 sequences -> 1.25
    assert aggregate_loss(LOSS_T, MASK, "seq_sum_norm", norm_len=4).item() == pytest.approx(1.25)
    with pytest.raises(ValueError, match="seq_sum_norm needs norm_len > 0"):
        aggregate_loss(LOSS_T, MASK, "seq_sum_norm")
    with pytest.raises(ValueError, match="unknown loss aggregation 'sum'"):
        aggregate_loss(LOSS_T, MASK, "sum")


def test_policy_loss_is_the_token_mean_of_the_per_token_loss():
    logp = torch.tensor([[math.log(1.1), math.log(1.5), math.log(0.5), 3.0]])
    adv, mask = torch.tensor([[2.0, 1.0, -1.0, 100.0]]), torch.tensor([[1, 1, 1, 0]])
    loss, stats = policy_loss(logp, torch.zeros(1, 4), adv, mask, clip_eps=0.2, num_tokens=5.0)
    loss_t, token_stats = policy_loss_tokens(logp, torch.zeros(1, 4), adv, mask, 0.2)
    assert_close(loss, aggregate_loss(loss_t, mask, "token_mean", num_tokens=5.0))
    assert stats.items() <= token_stats.items()


def test_kl_loss_k3_value_and_gradient_plain_and_unbiased():
    # d = logp - ref = ln 2 (logp 0, ref -ln 2): k3 = e^-d - 1 + d = 0.5 - 1 + 0.6931472 = 0.1931472
    ref = torch.tensor([[-math.log(2.0)]])
    logp = torch.zeros(1, 1, requires_grad=True)
    kl = kl_loss_tokens(logp, ref, ONE, "k3")
    kl.sum().backward()
    assert kl.item() == pytest.approx(0.1931472, abs=1e-6)
    assert logp.grad.item() == pytest.approx(0.5)  # d k3 / d logp = 1 - e^-d = 1 - 0.5
    # unbiased, on policy (old = logp, ratio 1): same value; gradient k3 + (1 - e^-d) = 0.1931472 + 0.5 = ln 2 = d
    logp.grad = None
    kl = kl_loss_tokens(logp, ref, ONE, "k3", old_logprobs=torch.zeros(1, 1))
    kl.sum().backward()
    assert kl.item() == pytest.approx(0.1931472, abs=1e-6)
    assert logp.grad.item() == pytest.approx(math.log(2.0), abs=1e-6)
    # old = -ln 2 (the sample was half as likely under the rollout policy): ratio 2 -> 2 x 0.1931472 = 0.3862944
    kl = kl_loss_tokens(torch.zeros(1, 1), ref, ONE, "k3", old_logprobs=ref)
    assert kl.item() == pytest.approx(0.3862944, abs=1e-6)
    # masked tokens are 0
    assert kl_loss_tokens(torch.zeros(1, 1), ref, torch.zeros(1, 1)).item() == 0.0


def test_entropy_by_hand_and_from_the_chunked_forward():
    # uniform over 4: ln 4 = 1.3862944;  logits [0, ln 3]: p = [0.25, 0.75],
    # H = 0.25 x ln 4 + 0.75 x ln(4/3) = 0.3465736 + 0.2157616 = 0.5623351
    assert entropy_from_logits(torch.zeros(4)).item() == pytest.approx(1.3862944, abs=1e-6)
    assert entropy_from_logits(torch.tensor([0.0, math.log(3.0)])).item() == pytest.approx(0.5623351, abs=1e-6)
    # the chunked forward's entropies are those of the tempered logits, chunk by chunk
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11)
    hidden, targets = torch.randn(5, 8), torch.randint(0, 11, (5,))
    logp, entropy = chunked_token_logprobs(hidden, targets, head, temperature=0.7, chunk_size=2, with_entropy=True)
    logits = head(hidden) / 0.7
    assert_close(entropy, entropy_from_logits(logits))
    assert_close(logp, chunked_token_logprobs(hidden, targets, head, temperature=0.7, chunk_size=2))
