"""GSPO's sequence ratio (``rlhf_core.algos.gspo``) and ``policy_loss_tokens(..., policy_loss="gspo")``: values and
gradients worked by hand."""

import math

import pytest
import torch
from torch.testing import assert_close

from rlhf_core.algos.gspo import gspo_log_ratio
from rlhf_core.algos.ppo import aggregate_loss, policy_loss_tokens

OLD = torch.zeros(2, 2)
MASK = torch.tensor([[1, 1], [1, 0]])
ADV = torch.tensor([[1.0, 1.0], [-1.0, 5.0]])


def _logp() -> torch.Tensor:
    # row 0: token ratios 2 and 0.5 -> s_0 = exp((ln 2 - ln 2) / 2) = 1; row 1: ratio 0.5 -> s_1 = 0.5, then a
    # padding position whose log-prob is -inf (it must give neither a value nor a NaN gradient)
    return torch.tensor([[math.log(2.0), math.log(0.5)], [math.log(0.5), -math.inf]], requires_grad=True)


def test_log_ratio_has_the_sequence_value_and_each_tokens_gradient():
    logp = _logp()
    log_s = gspo_log_ratio(logp, OLD, MASK)
    # value log s_i on every position of row i: [0, 0] and [ln 0.5, ln 0.5]
    assert_close(log_s.detach(), torch.tensor([[0.0, 0.0], [math.log(0.5)] * 2]))
    # d sum(s_i,t) / d logp_t = s_i on action tokens (1, 1 | 0.5), 0 on the padding
    log_s.exp().mul(MASK).sum().backward()
    assert_close(logp.grad, torch.tensor([[1.0, 1.0], [0.5, 0.0]]))


def test_gspo_policy_loss_by_hand():
    # bounds [1 - 0.6, 1 + 0.2] = [0.4, 1.2]. Row 0: s = 1, A = 1 -> loss_t = -1, -1, gradient -s x A = -1 each.
    # Row 1: s = 0.5, A = -1 -> -min(-0.5, -0.5) = 0.5, gradient -A x s = 0.5; padding 0.
    logp = _logp()
    loss_t, stats = policy_loss_tokens(logp, OLD, ADV, MASK, 0.6, 0.2, policy_loss="gspo")
    assert_close(loss_t.detach(), torch.tensor([[-1.0, -1.0], [0.5, 0.0]]))
    loss_t.sum().backward()
    assert_close(logp.grad, torch.tensor([[-1.0, -1.0], [0.5, 0.0]]))
    # nothing clipped; seq_ratio = (1 + 0.5) / 2 = 0.75; approx_kl = -(ln 2 - ln 2 + ln 0.5) / 3 = ln 2 / 3
    assert stats["clip_frac"] == 0.0 and stats["seq_ratio"] == pytest.approx(0.75)
    assert stats["approx_kl"] == pytest.approx(math.log(2.0) / 3)
    # aggregated over sequences: row means -1 and 0.5 -> (-1 + 0.5) / 2 = -0.25
    assert aggregate_loss(loss_t, MASK, "seq_mean").item() == pytest.approx(-0.25)


def test_gspo_differs_from_ppo_where_token_ratios_straddle_the_clip():
    # PPO on row 0: ratio 2 clipped at 1.2 -> -1.2 (no gradient); ratio 0.5 inside [0.4, 1.2] -> -0.5, gradient -0.5
    logp = _logp()
    loss_t, _ = policy_loss_tokens(logp, OLD, ADV, MASK, 0.6, 0.2)
    loss_t.sum().backward()
    assert_close(loss_t.detach()[0], torch.tensor([-1.2, -0.5]))
    assert_close(logp.grad[0], torch.tensor([0.0, -0.5]))


def test_gspo_clips_the_sequence_ratio():
    # symmetric 0.2: row 1's s = 0.5 < 0.8 with A = -1 -> -min(-0.5, -0.8) = 0.8, no gradient; 1 of 3 tokens clipped
    logp = _logp()
    loss_t, stats = policy_loss_tokens(logp, OLD, ADV, MASK, 0.2, policy_loss="gspo")
    loss_t.sum().backward()
    assert_close(loss_t.detach(), torch.tensor([[-1.0, -1.0], [0.8, 0.0]]))
    assert_close(logp.grad, torch.tensor([[-1.0, -1.0], [0.0, 0.0]]))
    assert stats["clip_frac"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="unknown policy loss 'grpo'"):
        policy_loss_tokens(logp, OLD, ADV, MASK, policy_loss="grpo")  # type: ignore[arg-type]
