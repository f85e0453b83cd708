"""Loss functions against values computed by hand (the arithmetic is in the comments)."""

import math

import pytest
import torch
from torch.testing import assert_close

from rlhf_core.algos.losses import (
    last_token_index,
    masked_mean,
    masked_sum,
    pairwise_reward_loss,
    sft_loss,
    token_logprobs,
    window_loss_scale,
)
from rlhf_core.algos.ppo import policy_loss


def test_masked_mean_ignores_masked_entries_and_empty_mask():
    values = torch.tensor([[1.0, 2.0, 30.0], [4.0, 50.0, 60.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # (1 + 2 + 4) / 3
    assert_close(masked_mean(values, mask), torch.tensor(7.0 / 3.0))
    # rows: (1 + 2) / 2 = 1.5 and 4 / 1 = 4
    assert_close(masked_mean(values, mask, dim=1), torch.tensor([1.5, 4.0]))
    assert_close(masked_mean(values, torch.zeros_like(mask)), torch.tensor(0.0))


def test_masked_sum():
    values = torch.tensor([[1.0, 2.0, 30.0], [4.0, 50.0, 60.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # 1 + 2 + 4 = 7; rows: 1 + 2 = 3 and 4
    assert_close(masked_sum(values, mask), torch.tensor(7.0))
    assert_close(masked_sum(values, mask, dim=1), torch.tensor([3.0, 4.0]))
    assert_close(masked_sum(values, torch.zeros_like(mask)), torch.tensor(0.0))


def test_window_loss_scale_gives_the_window_token_mean_under_deepspeed_averaging():
    assert window_loss_scale(4, 2) == 8.0
    with pytest.raises(ValueError, match="accumulation_steps >= 1"):
        window_loss_scale(0, 2)
    # One rank, 2 accumulation steps: micro-batches with 1 and 3 action tokens, N_window = 4. With
    # pi = pi_old, loss_t = -A_t. DeepSpeed backpropagates micro_loss / 2 for each micro-batch.
    advantages = [torch.tensor([[2.0, 0.0, 0.0]]), torch.tensor([[1.0, -1.0, 4.0]])]
    masks = [torch.tensor([[1, 0, 0]]), torch.tensor([[1, 1, 1]])]
    logprobs = torch.zeros(2, 3, requires_grad=True)
    num_tokens = 4 / window_loss_scale(2, 1)  # 4 / 2 = 2
    for i in range(2):
        loss, _ = policy_loss(logprobs[i : i + 1], torch.zeros(1, 3), advantages[i], masks[i], num_tokens=num_tokens)
        (loss / 2).backward()  # what DeepSpeed does with gradient_accumulation_steps = 2
    # micro 0: -2 / 2 / 2 = -2 / 4; micro 1: -(1 - 1 + 4) / 2 / 2 = -4 / 4: each token's gradient is -A_t / 4,
    # the token mean over the 4 tokens of the window
    assert_close(logprobs.grad, torch.tensor([[-0.5, 0.0, 0.0], [-0.25, 0.25, -1.0]]))


def test_token_logprobs_divides_logits_by_temperature():
    # Vocabulary of 2. Position 0 logits [ln 3, 0]; position 1 logits [0, 0]; position 2 unused.
    logits = torch.tensor([[[math.log(3.0), 0.0], [0.0, 0.0], [1.0, 2.0]]])
    input_ids = torch.tensor([[1, 0, 1]])
    # temperature 0.5: position 0 -> [2 ln 3, 0] = [ln 9, 0]: p(token 0) = 9 / (9 + 1) = 0.9, p(token 1) = 0.1
    # position 1 -> [0, 0] stays uniform: p(token 1) = 0.5
    assert_close(token_logprobs(logits, input_ids, temperature=0.5), torch.tensor([[math.log(0.9), math.log(0.5)]]))
    # temperature 1: p(token 0 | pos 0) = 3 / 4, p(token 1 | pos 1) = 1 / 2
    assert_close(token_logprobs(logits, input_ids), torch.tensor([[math.log(0.75), math.log(0.5)]]))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logprobs(logits, input_ids, temperature=0.0)


def test_token_logprobs_and_sft_loss_use_response_tokens_only():
    # Vocabulary of 2. Logits at each position: position 0 -> [0, 0], position 1 -> [ln 3, 0], position 2 unused.
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0], [5.0, 5.0]]])
    input_ids = torch.tensor([[1, 1, 0]])
    # Target of pos 0 is token 1: p = 1/2. Target of pos 1 is token 0: p = 3/(3+1) = 3/4.
    assert_close(token_logprobs(logits, input_ids), torch.tensor([[math.log(0.5), math.log(0.75)]]))
    # Only the last token (index 2) is a response token: loss = -ln(3/4) = 0.28768...
    loss = sft_loss(token_logprobs(logits, input_ids), torch.tensor([[0, 0, 1]]))
    assert_close(loss, torch.tensor(-math.log(0.75)))
    # Both targets: -(ln 1/2 + ln 3/4) / 2 = (0.693147 + 0.287682) / 2 = 0.490415
    loss_all = sft_loss(token_logprobs(logits, input_ids), torch.tensor([[1, 1, 1]]))
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
