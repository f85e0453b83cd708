"""Preference losses (DPO, cDPO, IPO, KTO) against values computed by hand (the arithmetic is in the comments)."""

import math

import pytest
import torch
from torch.testing import assert_close

from rlhf_core.algos.preference import (
    PreferenceStats,
    dpo_loss,
    kl_reference_point,
    kto_loss,
    sequence_logprobs,
)

ATOL = 1e-6


def _pairs():
    # pair 0: (pi_c - pi_r) - (ref_c - ref_r) = (-1 + 3) - (-2 + 2) = 2
    # pair 1: (-5 + 4) - (-4.5 + 4.5) = -1
    return (
        torch.tensor([-1.0, -5.0]),  # policy_chosen
        torch.tensor([-3.0, -4.0]),  # policy_rejected
        torch.tensor([-2.0, -4.5]),  # ref_chosen
        torch.tensor([-2.0, -4.5]),  # ref_rejected
    )


def test_sequence_logprobs_sum_and_average_over_the_mask():
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0], [-7.0, -8.0, -9.0]])
    mask = torch.tensor([[0, 1, 1], [1, 0, 0], [0, 0, 0]])
    # sums: -2 - 3 = -5, -4, and 0 for the empty row
    assert_close(sequence_logprobs(logps, mask), torch.tensor([-5.0, -4.0, 0.0]))
    # means: -5 / 2 = -2.5, -4 / 1 = -4, and 0 (not NaN) for the empty row
    assert_close(sequence_logprobs(logps, mask.bool(), average=True), torch.tensor([-2.5, -4.0, 0.0]))
    with pytest.raises(ValueError, match="mask"):
        sequence_logprobs(logps, mask[:, :2])


def test_dpo_sigmoid_two_pairs_by_hand():
    stats = dpo_loss(*_pairs(), beta=0.1)
    assert isinstance(stats, PreferenceStats)
    # beta * logits = [0.2, -0.1]; -logsigmoid(x) = log(1 + e^-x)
    # log(1 + e^-0.2) = 0.598139, log(1 + e^0.1) = 0.744397; mean = 0.671268
    assert stats.loss.item() == pytest.approx(0.671268, abs=ATOL)
    # chosen: 0.1 * (-1 + 2) = 0.1, 0.1 * (-5 + 4.5) = -0.05; rejected: 0.1 * (-3 + 2) = -0.1, 0.1 * (-4 + 4.5) = 0.05
    assert_close(stats.chosen_rewards, torch.tensor([0.1, -0.05]))
    assert_close(stats.rejected_rewards, torch.tensor([-0.1, 0.05]))
    # accuracy: [0.1 > -0.1, -0.05 > 0.05] = [1, 0] -> 0.5; margin: (0.2 + -0.1) / 2 = 0.05
    assert stats.accuracy.item() == pytest.approx(0.5, abs=ATOL)
    assert stats.margin.item() == pytest.approx(0.05, abs=ATOL)


def test_dpo_policy_equal_to_reference_gives_log_2_and_zero_rewards():
    torch.manual_seed(0)
    chosen, rejected = torch.randn(5) * 10, torch.randn(5) * 10
    stats = dpo_loss(chosen, rejected, chosen.clone(), rejected.clone(), beta=0.3)
    # logits = 0 exactly: -logsigmoid(0) = log 2 = 0.693147
    assert stats.loss.item() == pytest.approx(math.log(2.0), abs=1e-7)
    assert torch.equal(stats.chosen_rewards, torch.zeros(5))
    assert torch.equal(stats.rejected_rewards, torch.zeros(5))
    assert stats.accuracy.item() == 0.0  # no pair strictly preferred
    # cDPO at logits 0: (1 - eps) * log 2 + eps * log 2 = log 2 too
    assert dpo_loss(chosen, rejected, chosen, rejected, beta=0.3, label_smoothing=0.2).loss.item() == pytest.approx(
        math.log(2.0), abs=1e-7
    )


def test_cdpo_label_smoothing_by_hand():
    pc, pr, rc, rr = (t[:1] for t in _pairs())  # pair 0: logits 2, beta * logits = 0.2
    stats = dpo_loss(pc, pr, rc, rr, beta=0.1, label_smoothing=0.1)
    # 0.9 * log(1 + e^-0.2) + 0.1 * log(1 + e^0.2) = 0.9 * 0.598139 + 0.1 * 0.798139 = 0.618139
    assert stats.loss.item() == pytest.approx(0.618139, abs=ATOL)
    # the rewards do not depend on the smoothing
    assert_close(stats.chosen_rewards, torch.tensor([0.1]))


def test_label_smoothing_shrinks_the_gap_between_a_pair_and_its_flip():
    pc, pr, rc, rr = (t[:1] for t in _pairs())
    # loss(x) - loss(-x) = (1 - 2 eps) * (log(1 + e^-bx) - log(1 + e^bx)) = -(1 - 2 eps) * b * x
    # eps = 0.25, b * x = 0.2: 0.75 * 0.598139 + 0.25 * 0.798139 = 0.648139 and 0.75 * 0.798139 + 0.25 * 0.598139
    # = 0.748139; gap -0.5 * 0.2 = -0.1
    kept = dpo_loss(pc, pr, rc, rr, beta=0.1, label_smoothing=0.25).loss
    flipped = dpo_loss(pr, pc, rr, rc, beta=0.1, label_smoothing=0.25).loss
    assert kept.item() == pytest.approx(0.648139, abs=ATOL)
    assert flipped.item() == pytest.approx(0.748139, abs=ATOL)
    # eps = 0.5 would make the loss symmetric in the label (it learns nothing): refused
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(pc, pr, rc, rr, beta=0.1, label_smoothing=0.5)


def test_ipo_by_hand():
    stats = dpo_loss(*_pairs(), beta=0.1, loss_type="ipo")
    # target 1 / (2 * 0.1) = 5: (2 - 5)^2 = 9, (-1 - 5)^2 = 36; mean = 22.5
    assert stats.loss.item() == pytest.approx(22.5, abs=1e-5)
    assert_close(stats.chosen_rewards, torch.tensor([0.1, -0.05]))


def test_dpo_gradient_raises_chosen_and_lowers_rejected():
    pc = torch.tensor([-2.0], requires_grad=True)
    pr = torch.tensor([-2.0], requires_grad=True)
    dpo_loss(pc, pr, torch.tensor([-2.0]), torch.tensor([-2.0]), beta=0.1).loss.backward()
    # logits 0: d/d pi_c [-logsigmoid(b * x)] = -b * (1 - sigmoid(0)) = -0.1 * 0.5 = -0.05; d/d pi_r = +0.05
    assert_close(pc.grad, torch.tensor([-0.05]))
    assert_close(pr.grad, torch.tensor([0.05]))
    # gradient descent raises pi_c: the loss goes down
    before = dpo_loss(pc, pr, torch.tensor([-2.0]), torch.tensor([-2.0]), beta=0.1).loss.item()
    after = dpo_loss(pc + 0.1, pr, torch.tensor([-2.0]), torch.tensor([-2.0]), beta=0.1).loss.item()
    assert after < before
    # IPO at logits 0: d/d pi_c (x - 5)^2 = 2 * (0 - 5) = -10
    pc.grad = None
    dpo_loss(pc, pr, torch.tensor([-2.0]), torch.tensor([-2.0]), beta=0.1, loss_type="ipo").loss.backward()
    assert_close(pc.grad, torch.tensor([-10.0]))


def test_dpo_rewards_are_detached():
    pc = torch.tensor([-1.0], requires_grad=True)
    stats = dpo_loss(pc, torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0]), beta=0.1)
    assert stats.loss.requires_grad
    assert not stats.chosen_rewards.requires_grad


def test_dpo_bad_arguments_name_the_argument():
    pairs = _pairs()
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(*pairs, beta=0.0)
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(*pairs, beta=-1.0)
    with pytest.raises(ValueError, match="loss_type"):
        dpo_loss(*pairs, beta=0.1, loss_type="hinge")
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(*pairs, beta=0.1, label_smoothing=-0.1)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(*pairs, beta=0.1, loss_type="ipo", label_smoothing=0.1)


def _kto_batch():
    # example 0 desirable: r = -1 + 2 = 1; example 1 undesirable: r = -3 + 2 = -1
    return torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -2.0]), torch.tensor([True, False])


def test_kto_desirable_and_undesirable_by_hand():
    policy, ref, desirable = _kto_batch()
    # z_ref = mean([-2 + 3, -3 + 3]) = mean([1, 0]) = 0.5
    stats = kto_loss(policy, ref, desirable, torch.tensor([-2.0, -3.0]), torch.tensor([-3.0, -3.0]), beta=0.5)
    loss, rewards, kl = stats  # unpacks as a tuple
    assert kl.item() == pytest.approx(0.5, abs=ATOL)
    # desirable: 1 - sigmoid(0.5 * (1 - 0.5)) = sigmoid(-0.25) = 0.437823
    # undesirable: 1 - sigmoid(0.5 * (0.5 + 1)) = sigmoid(-0.75) = 0.320821; mean = 0.379322
    assert loss.item() == pytest.approx(0.379322, abs=ATOL)
    # rewards: 0.5 * [1, -1]
    assert_close(rewards, torch.tensor([0.5, -0.5]))
    assert not rewards.requires_grad


def test_kto_weights():
    policy, ref, desirable = _kto_batch()
    stats = kto_loss(
        policy,
        ref,
        desirable,
        torch.tensor([-2.0, -3.0]),
        torch.tensor([-3.0, -3.0]),
        beta=0.5,
        desirable_weight=2.0,
        undesirable_weight=0.5,
    )
    # (2 * 0.437823 + 0.5 * 0.320821) / 2 = (0.875647 + 0.160411) / 2 = 0.518029
    assert stats.loss.item() == pytest.approx(0.518029, abs=ATOL)


def test_kto_reference_point_clamped_at_zero():
    policy, ref, desirable = _kto_batch()
    # mean(-4 + 3) = -1 < 0 -> z_ref = 0
    assert kl_reference_point(torch.tensor([-4.0]), torch.tensor([-3.0])).item() == 0.0
    assert kl_reference_point(torch.tensor([-4.0]), torch.tensor([-3.0]), clamp=False).item() == -1.0
    stats = kto_loss(policy, ref, desirable, torch.tensor([-4.0]), torch.tensor([-3.0]), beta=0.5)
    assert stats.kl.item() == 0.0
    # desirable: 1 - sigmoid(0.5 * 1) = sigmoid(-0.5) = 0.377541; undesirable: 1 - sigmoid(0.5 * (0 + 1)) = 0.377541
    assert stats.loss.item() == pytest.approx(0.377541, abs=ATOL)
    # a given (e.g. all-reduced) kl is clamped the same way
    given = kto_loss(policy, ref, desirable, None, None, beta=0.5, kl=torch.tensor(-1.0))
    assert given.kl.item() == 0.0
    assert given.loss.item() == pytest.approx(0.377541, abs=ATOL)


def test_kto_given_kl_replaces_the_estimate_and_is_detached():
    policy, ref, desirable = _kto_batch()
    policy_kl = torch.tensor([-2.0, -3.0], requires_grad=True)
    # the KL log-probs would give z_ref = 0.5; the given kl 0.5 gives the same loss 0.379322 with no KL log-probs
    given = kto_loss(policy, ref, desirable, None, None, beta=0.5, kl=torch.tensor(0.5))
    assert given.loss.item() == pytest.approx(0.379322, abs=ATOL)
    # and it wins over the KL log-probs: with z_ref = 0 the loss is 0.377541, whatever they say
    override = kto_loss(policy, ref, desirable, policy_kl, torch.tensor([-3.0, -3.0]), beta=0.5, kl=torch.tensor(0.0))
    assert override.loss.item() == pytest.approx(0.377541, abs=ATOL)
    # z_ref is detached: no gradient reaches the KL log-probs
    pol = policy.clone().requires_grad_(True)
    kto_loss(pol, ref, desirable, policy_kl, torch.tensor([-3.0, -3.0]), beta=0.5).loss.backward()
    assert policy_kl.grad is None
    # desirable: d/d pi (1 - sigmoid(b (r - z))) / 2 = -b s (1 - s) / 2 with s = sigmoid(0.25) = 0.562177:
    # -0.5 * 0.562177 * 0.437823 / 2 = -0.061534; undesirable: d/d pi (1 - sigmoid(b (z - r))) / 2 = +b s (1 - s) / 2
    # with s = sigmoid(0.75) = 0.679179: 0.5 * 0.679179 * 0.320821 / 2 = 0.054474
    assert_close(pol.grad, torch.tensor([-0.061534, 0.054474]), atol=ATOL, rtol=0)


def test_kto_bad_arguments_name_the_argument():
    policy, ref, desirable = _kto_batch()
    kl_pair = (torch.tensor([-2.0]), torch.tensor([-3.0]))
    with pytest.raises(ValueError, match="beta"):
        kto_loss(policy, ref, desirable, *kl_pair, beta=0.0)
    with pytest.raises(ValueError, match="desirable_weight"):
        kto_loss(policy, ref, desirable, *kl_pair, beta=0.5, desirable_weight=-1.0)
    with pytest.raises(ValueError, match="undesirable_weight"):
        kto_loss(policy, ref, desirable, *kl_pair, beta=0.5, undesirable_weight=-1.0)
    with pytest.raises(ValueError, match="desirable must have the shape"):
        kto_loss(policy, ref, desirable[:1], *kl_pair, beta=0.5)
    with pytest.raises(ValueError, match="policy_kl_logps"):
        kto_loss(policy, ref, desirable, None, None, beta=0.5)
