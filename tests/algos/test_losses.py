"""Loss functions against values computed by hand (the arithmetic is in the comments)."""

import math

import pytest
import torch
from torch.testing import assert_close

from rlhf_core.algos.losses import last_token_index, masked_mean, pairwise_reward_loss, sft_loss, token_logprobs


def test_masked_mean_ignores_masked_entries_and_empty_mask():
    values = torch.tensor([[1.0, 2.0, 30.0], [4.0, 50.0, 60.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # (1 + 2 + 4) / 3
    assert_close(masked_mean(values, mask), torch.tensor(7.0 / 3.0))
    # rows: (1 + 2) / 2 = 1.5 and 4 / 1 = 4
    assert_close(masked_mean(values, mask, dim=1), torch.tensor([1.5, 4.0]))
    assert_close(masked_mean(values, torch.zeros_like(mask)), torch.tensor(0.0))


def test_token_logprobs_and_sft_loss_use_response_tokens_only():
    # Vocabulary of 2. Logits at each position: position 0 -> [0, 0], position 1 -> [ln 3, 0], position 2 unused.
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0], [5.0, 5.0]]])
    input_ids = torch.tensor([[1, 1, 0]])
    # Target of pos 0 is token 1: p = 1/2. Target of pos 1 is token 0: p = 3/(3+1) = 3/4.
    assert_close(token_logprobs(logits, input_ids), torch.tensor([[math.log(0.5), math.log(0.75)]]))
    # Only the last token (index 2) is a response token: loss = -ln(3/4) = 0.28768...
    loss = sft_loss(logits, input_ids, torch.tensor([[0, 0, 1]]))
    assert_close(loss, torch.tensor(-math.log(0.75)))
    # Both targets: -(ln 1/2 + ln 3/4) / 2 = (0.693147 + 0.287682) / 2 = 0.490415
    loss_all = sft_loss(logits, input_ids, torch.tensor([[1, 1, 1]]))
    assert loss_all.item() == pytest.approx(0.490415, abs=1e-6)


def test_pairwise_reward_loss_by_hand():
    chosen = torch.tensor([2.0, 0.0])
    rejected = torch.tensor([0.0, 0.0])
    # -log sigmoid(2) = log(1 + e^-2) = 0.126928; -log sigmoid(0) = log 2 = 0.693147; mean = 0.410038
    assert pairwise_reward_loss(chosen, rejected).item() == pytest.approx(0.410038, abs=1e-6)
    # margin 2 turns the first pair into diff 0: both log 2
    assert pairwise_reward_loss(chosen, rejected, margin=torch.tensor([2.0, 0.0])).item() == pytest.approx(
        math.log(2.0), abs=1e-6
    )


def test_pairwise_loss_gradient_pushes_chosen_up():
    chosen = torch.tensor([0.0], requires_grad=True)
    rejected = torch.tensor([0.0], requires_grad=True)
    pairwise_reward_loss(chosen, rejected).backward()
    # d/dc [-log sigmoid(c - r)] = -(1 - sigmoid(0)) = -0.5
    assert_close(chosen.grad, torch.tensor([-0.5]))
    assert_close(rejected.grad, torch.tensor([0.5]))


def test_last_token_index_right_left_and_no_padding():
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert last_token_index(mask).tolist() == [2, 4, 4]
