"""PPO math against values computed by hand (the arithmetic is in the comments)."""

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.testing import assert_close

from rlhf_core.algos.ppo import (
    AdaptiveKLController,
    FixedKLController,
    apply_missing_eos_penalty,
    approx_kl,
    clip_scores,
    distributed_masked_whiten,
    gae,
    make_kl_controller,
    masked_whiten,
    normalize_scores,
    policy_loss,
    token_rewards,
    value_loss,
)
from rlhf_core.distributed import device
from rlhf_core.ports import free_port


def test_approx_kl_three_estimators_with_masked_position():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]])
    ref_logprobs = torch.tensor([[-1.5, -1.0, -3.0]])
    mask = torch.tensor([[1, 1, 0]])
    # d = logprobs - ref = [0.5, -1.0, 2.5]; the last position is padding -> 0
    assert_close(approx_kl(logprobs, ref_logprobs, mask, "k1"), torch.tensor([[0.5, -1.0, 0.0]]))
    # d^2 / 2 = [0.25 / 2, 1 / 2] = [0.125, 0.5]
    assert_close(approx_kl(logprobs, ref_logprobs, mask, "k2"), torch.tensor([[0.125, 0.5, 0.0]]))
    # exp(-0.5) - 1 + 0.5 = 0.60653066 - 0.5 = 0.10653066; exp(1) - 1 - 1 = 2.71828183 - 2 = 0.71828183
    assert_close(approx_kl(logprobs, ref_logprobs, mask, "k3"), torch.tensor([[0.10653066, 0.71828183, 0.0]]))
    # no mask: every position counts, d = 2.5 -> k1 = 2.5
    assert approx_kl(logprobs, ref_logprobs)[0, 2].item() == 2.5


def test_approx_kl_clamps_to_ten_and_masks_infinite_padding():
    logprobs = torch.tensor([[15.0, -15.0, 5.0, -3.0, -math.inf]])
    ref_logprobs = torch.zeros(1, 5)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    # k1: 15 -> 10, -15 -> -10, 5, -3; padding -inf -> 0 (not nan)
    assert_close(approx_kl(logprobs, ref_logprobs, mask, "k1"), torch.tensor([[10.0, -10.0, 5.0, -3.0, 0.0]]))
    # k2: 112.5 -> 10, 112.5 -> 10, 25/2 = 12.5 -> 10, 9/2 = 4.5
    assert_close(approx_kl(logprobs, ref_logprobs, mask, "k2"), torch.tensor([[10.0, 10.0, 10.0, 4.5, 0.0]]))
    # k3 at d = -3: exp(3) - 1 - 3 = 20.0855 - 4 = 16.0855 -> 10; at d = 5: exp(-5) - 1 + 5 = 4.00673795
    k3 = approx_kl(logprobs, ref_logprobs, mask, "k3")
    assert_close(k3[0, 2:], torch.tensor([4.00673795, 10.0, 0.0]))


def test_approx_kl_k3_clamps_the_log_ratio_before_exp_so_gradients_stay_finite():
    ref_logprobs = torch.zeros(1, 3)
    # d = [-100, -1, 15]
    logprobs = torch.tensor([[-100.0, -1.0, 15.0]], requires_grad=True)
    k3 = approx_kl(logprobs, ref_logprobs, torch.ones(1, 3), "k3")
    # d = -100 -> clamped to -10: e^10 - 1 - 10 = 22026.4658 - 11 = 22015.4658 -> final clamp 10
    # d = -1 (inside): e^1 - 1 - 1 = 0.71828183
    # d = 15 -> clamped to 10: e^-10 - 1 + 10 = 0.0000454 + 9 = 9.0000454 (no longer 10, the price of the clamp)
    assert_close(k3.detach(), torch.tensor([[10.0, 0.71828183, 9.0000454]]))
    k3.sum().backward()
    # d(e^-d - 1 + d)/dd = 1 - e^-d: at d = -1: 1 - e = -1.71828183; at -100 and 15 a clamp saturates -> 0
    # (without the first clamp, exp(100) = inf in float32 and the gradient at d = -100 is 0 * -inf = NaN)
    assert torch.isfinite(logprobs.grad).all()
    assert_close(logprobs.grad, torch.tensor([[0.0, -1.71828183, 0.0]]))


def test_approx_kl_k1_k2_unchanged_at_large_log_ratios():
    logprobs = torch.tensor([[-100.0, -1.0, 15.0]], requires_grad=True)
    k1 = approx_kl(logprobs, torch.zeros(1, 3), estimator="k1")
    k2 = approx_kl(logprobs, torch.zeros(1, 3), estimator="k2")
    # k1 = d clamped: [-10, -1, 10];  k2 = d^2 / 2 clamped: [5000 -> 10, 0.5, 112.5 -> 10]
    assert_close(k1.detach(), torch.tensor([[-10.0, -1.0, 10.0]]))
    assert_close(k2.detach(), torch.tensor([[10.0, 0.5, 10.0]]))
    (k1 + k2).sum().backward()
    # inside the clamp: d k1/dd = 1, d k2/dd = d = -1 -> 0 at d = -1; saturated elsewhere -> 0
    assert_close(logprobs.grad, torch.tensor([[0.0, 0.0, 0.0]]))


def test_approx_kl_unknown_estimator():
    with pytest.raises(ValueError, match="'k4'"):
        approx_kl(torch.zeros(1, 2), torch.zeros(1, 2), estimator="k4")


def test_token_rewards_score_on_each_rows_last_action_token():
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    scores = torch.tensor([1.0, -2.0, 7.0])
    rewards = token_rewards(scores, kl, mask, kl_coef=0.5)
    # row 0: -0.5 * [0.1, 0.2, 0.3] = [-0.05, -0.1, -0.15], score 1 on index 2: -0.15 + 1 = 0.85
    # row 1: one action token: -0.5 * 0.4 + (-2) = -2.2, padding 0
    # row 2: no action token at all -> all 0 (the score has nowhere to go)
    expected = torch.tensor([[-0.05, -0.1, 0.85], [-2.2, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert_close(rewards, expected)


def test_apply_missing_eos_penalty():
    scores = torch.tensor([1.0, 0.5, -2.0])
    truncated = torch.tensor([False, True, True])
    # rows 1 and 2 had no EOS: 0.5 - 1 = -0.5, -2 - 1 = -3; row 0 unchanged
    assert_close(apply_missing_eos_penalty(scores, truncated, -1.0), torch.tensor([1.0, -0.5, -3.0]))
    # None: no penalty at all
    assert_close(apply_missing_eos_penalty(scores, truncated, None), scores)


def test_normalize_and_clip_scores():
    scores = torch.tensor([3.0, -1.0, 25.0])
    # (3 - 1) / 2 = 1, (-1 - 1) / 2 = -1, (25 - 1) / 2 = 12
    assert_close(normalize_scores(scores, mean=1.0, std=2.0), torch.tensor([1.0, -1.0, 12.0]))
    assert_close(clip_scores(torch.tensor([1.0, -11.0, 12.0]), -10.0, 10.0), torch.tensor([1.0, -10.0, 10.0]))


def test_gae_gamma_one_lambda_one():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3)
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    # delta_2 = 1 + 0 - 0.7 = 0.3;     A_2 = 0.3
    # delta_1 = 0 + 0.7 - 0.6 = 0.1;   A_1 = 0.1 + 0.3 = 0.4
    # delta_0 = 0 + 0.6 - 0.5 = 0.1;   A_0 = 0.1 + 0.4 = 0.5
    assert_close(advantages, torch.tensor([[0.5, 0.4, 0.3]]))
    # returns = A + V = [1.0, 1.0, 1.0] (the undiscounted reward-to-go)
    assert_close(returns, torch.tensor([[1.0, 1.0, 1.0]]))


def test_gae_gamma_lambda_discounted():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    advantages, returns = gae(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.5)
    # gamma * lam = 0.45
    # delta_2 = 1 + 0.9 * 0 - 0.7 = 0.3;          A_2 = 0.3
    # delta_1 = 0 + 0.9 * 0.7 - 0.6 = 0.03;       A_1 = 0.03 + 0.45 * 0.3 = 0.165
    # delta_0 = 0 + 0.9 * 0.6 - 0.5 = 0.04;       A_0 = 0.04 + 0.45 * 0.165 = 0.04 + 0.07425 = 0.11425
    assert_close(advantages, torch.tensor([[0.11425, 0.165, 0.3]]))
    # returns = A + V = [0.61425, 0.765, 1.0]
    assert_close(returns, torch.tensor([[0.61425, 0.765, 1.0]]))


def test_gae_ignores_padding_after_two_tokens():
    # row 1 has padding at index 2 holding garbage reward 5 and value 9, which must not leak in
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 5.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [1.0, 0.5, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    # row 1: delta_1 = 2 + 0 (V after the last token) - 0.5 = 1.5;  A_1 = 1.5
    #        delta_0 = 0 + 0.5 - 1.0 = -0.5;                         A_0 = -0.5 + 1.5 = 1.0
    #        returns = [1.0 + 1.0, 1.5 + 0.5, 0] = [2.0, 2.0, 0]
    assert_close(advantages, torch.tensor([[0.5, 0.4, 0.3], [1.0, 1.5, 0.0]]))
    assert_close(returns, torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]))


def _rows_with_holes():
    # row 0: mask [1, 1, 0, 1], a hole at index 2 holding garbage reward 5 and value 9
    # row 1: mask [1, 0, 0, 1], a hole of two positions holding garbage
    rewards = torch.tensor([[0.0, 0.0, 5.0, 1.0], [0.0, 7.0, 7.0, 2.0]])
    values = torch.tensor([[0.5, 0.6, 9.0, 0.7], [1.0, 8.0, 8.0, 0.5]])
    mask = torch.tensor([[1, 1, 0, 1], [1, 0, 0, 1]])
    return rewards, values, mask


def test_gae_skips_holes_in_the_action_mask_gamma_one_lambda_one():
    advantages, returns = gae(*_rows_with_holes(), gamma=1.0, lam=1.0)
    # row 0 (the hole is skipped; index 3 is the next action token after index 1):
    #   delta_3 = 1 + 0 - 0.7 = 0.3;                 A_3 = 0.3
    #   delta_1 = 0 + V_3 - 0.6 = 0.7 - 0.6 = 0.1;   A_1 = 0.1 + A_3 = 0.4
    #   delta_0 = 0 + 0.6 - 0.5 = 0.1;               A_0 = 0.1 + 0.4 = 0.5
    #   returns = A + V = [1.0, 1.0, 0 (hole), 1.0]
    # row 1: delta_3 = 2 + 0 - 0.5 = 1.5;  A_3 = 1.5
    #        delta_0 = 0 + V_3 - 1.0 = 0.5 - 1 = -0.5;  A_0 = -0.5 + 1.5 = 1.0;  returns [2.0, 0, 0, 2.0]
    # (cutting the recursion at the hole would give row 0 delta_1 = 0 + 0 - 0.6, A_1 = -0.6)
    assert_close(advantages, torch.tensor([[0.5, 0.4, 0.0, 0.3], [1.0, 0.0, 0.0, 1.5]]))
    assert_close(returns, torch.tensor([[1.0, 1.0, 0.0, 1.0], [2.0, 0.0, 0.0, 2.0]]))


def test_gae_skips_holes_in_the_action_mask_discounted():
    advantages, returns = gae(*_rows_with_holes(), gamma=0.9, lam=0.5)
    # gamma * lam = 0.45; a hole is not a time step, so it costs no extra discount
    # row 0: delta_3 = 1 + 0.9 * 0 - 0.7 = 0.3;          A_3 = 0.3
    #        delta_1 = 0 + 0.9 * 0.7 - 0.6 = 0.03;       A_1 = 0.03 + 0.45 * 0.3 = 0.03 + 0.135 = 0.165
    #        delta_0 = 0 + 0.9 * 0.6 - 0.5 = 0.04;       A_0 = 0.04 + 0.45 * 0.165 = 0.04 + 0.07425 = 0.11425
    #        returns = [0.11425 + 0.5, 0.165 + 0.6, 0, 0.3 + 0.7] = [0.61425, 0.765, 0, 1.0]
    # row 1: delta_3 = 2 + 0 - 0.5 = 1.5;                A_3 = 1.5
    #        delta_0 = 0 + 0.9 * 0.5 - 1.0 = -0.55;      A_0 = -0.55 + 0.45 * 1.5 = -0.55 + 0.675 = 0.125
    #        returns = [0.125 + 1.0, 0, 0, 1.5 + 0.5] = [1.125, 0, 0, 2.0]
    assert_close(advantages, torch.tensor([[0.11425, 0.165, 0.0, 0.3], [0.125, 0.0, 0.0, 1.5]]))
    assert_close(returns, torch.tensor([[0.61425, 0.765, 0.0, 1.0], [1.125, 0.0, 0.0, 2.0]]))


def test_gae_ignores_non_finite_garbage_on_masked_positions():
    rewards = torch.tensor([[0.0, math.nan, 1.0, 0.0]])
    values = torch.tensor([[0.5, math.inf, 0.7, -math.inf]])
    advantages, returns = gae(rewards, values, torch.tensor([[1, 0, 1, 0]]), gamma=1.0, lam=1.0)
    # delta_2 = 1 + 0 - 0.7 = 0.3, A_2 = 0.3;  delta_0 = 0 + 0.7 - 0.5 = 0.2, A_0 = 0.2 + 0.3 = 0.5
    assert_close(advantages, torch.tensor([[0.5, 0.0, 0.3, 0.0]]))
    assert_close(returns, torch.tensor([[1.0, 0.0, 1.0, 0.0]]))


def test_gae_has_no_grad():
    values = torch.tensor([[0.5, 0.6]], requires_grad=True)
    advantages, returns = gae(torch.zeros(1, 2), values, torch.ones(1, 2), 1.0, 1.0)
    assert not advantages.requires_grad and not returns.requires_grad


def test_masked_whiten_by_hand():
    x = torch.tensor([[2.0, 4.0, 4.0, 4.0, 5.0], [5.0, 7.0, 9.0, 99.0, -99.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    # masked entries 2, 4, 4, 4, 5, 5, 7, 9: mean = 40 / 8 = 5
    # deviations -3, -1, -1, -1, 0, 0, 2, 4; squares 9 + 1 + 1 + 1 + 0 + 0 + 4 + 16 = 32; var = 32 / 8 = 4, std 2
    expected = torch.tensor([[-1.5, -0.5, -0.5, -0.5, 0.0], [0.0, 1.0, 2.0, 0.0, 0.0]])
    assert_close(masked_whiten(x, mask), expected)
    # shift_mean=False: x / 2, masked entries 0
    expected_no_shift = torch.tensor([[1.0, 2.0, 2.0, 2.0, 2.5], [2.5, 3.5, 4.5, 0.0, 0.0]])
    assert_close(masked_whiten(x, mask, shift_mean=False), expected_no_shift)
    # divide_std=False (OpenRLHF no_std_norm): x - 5
    expected_mean_only = torch.tensor([[-3.0, -1.0, -1.0, -1.0, 0.0], [0.0, 2.0, 4.0, 0.0, 0.0]])
    assert_close(masked_whiten(x, mask, divide_std=False), expected_mean_only)


# Rank 0 holds 2 rows, rank 1 holds 1 row; both T = 4 so the concatenation is a (3, 4) batch.
RANK_X = [
    torch.tensor([[1.0, 2.0, 3.0, 50.0], [0.5, -1.0, 40.0, 40.0]]),
    torch.tensor([[10.0, 12.0, 14.0, 16.0]]),
]
RANK_MASK = [
    torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]),
    torch.tensor([[1, 1, 1, 1]]),
]


def _whiten_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        # the sums travel through the device-aware collective the actor passes (gloo here: on the CPU)
        shifted = distributed_masked_whiten(RANK_X[rank], RANK_MASK[rank], device.all_reduce_sum)
        unshifted = distributed_masked_whiten(RANK_X[rank], RANK_MASK[rank], device.all_reduce_sum, shift_mean=False)
        torch.save({"shifted": shifted, "unshifted": unshifted}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_distributed_masked_whiten_matches_whitening_the_concatenation(tmp_path):
    mp.spawn(_whiten_worker, args=(2, free_port("127.0.0.1"), str(tmp_path)), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]

    x_all, mask_all = torch.cat(RANK_X), torch.cat(RANK_MASK)
    for key, shift_mean in (("shifted", True), ("unshifted", False)):
        expected = masked_whiten(x_all, mask_all, shift_mean=shift_mean)
        assert_close(torch.cat([r[key] for r in results]), expected)
        # whitening each rank alone gives something else (rank means 1.1 and 13 vs global ~6.4)
        alone = masked_whiten(RANK_X[1], RANK_MASK[1], shift_mean=shift_mean)
        assert not torch.allclose(results[1][key], alone)


def test_distributed_masked_whiten_without_process_group_is_local():
    assert not dist.is_initialized()
    x, mask = RANK_X[0], RANK_MASK[0]
    assert_close(distributed_masked_whiten(x, mask), masked_whiten(x, mask))


def _policy_inputs():
    # tokens: 0 ratio 1.1 (inside), 1 ratio 1.5 with A > 0, 2 ratio 0.5 with A < 0,
    #         3 ratio 1.5 with A < 0 (outside the range but the unclipped term is the min), 4 padding
    pi_logprobs = torch.tensor([[math.log(1.1), math.log(1.5), math.log(0.5), math.log(1.5), 3.0]])
    pi_old_logprobs = torch.zeros(1, 5)
    advantages = torch.tensor([[2.0, 1.0, -1.0, -1.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    return pi_logprobs, pi_old_logprobs, advantages, mask


def test_policy_loss_by_hand():
    pi_logprobs, pi_old_logprobs, advantages, mask = _policy_inputs()
    loss, stats = policy_loss(pi_logprobs, pi_old_logprobs, advantages, mask, clip_eps=0.2)
    # token 0: min(1.1 * 2, 1.1 * 2) = 2.2                         -> -2.2
    # token 1: min(1.5 * 1, 1.2 * 1) = 1.2 (clipped)               -> -1.2
    # token 2: min(0.5 * -1, 0.8 * -1) = min(-0.5, -0.8) = -0.8 (clipped) -> 0.8
    # token 3: min(1.5 * -1, 1.2 * -1) = min(-1.5, -1.2) = -1.5    -> 1.5
    # token mean = (-2.2 - 1.2 + 0.8 + 1.5) / 4 = -1.1 / 4 = -0.275
    assert_close(loss, torch.tensor(-0.275))
    # clipped term active on tokens 1 and 2 of 4
    assert stats["clip_frac"] == pytest.approx(0.5)
    # mean(old - logp) = -(ln 1.1 + ln 1.5 + ln 0.5 + ln 1.5) / 4
    #                  = -(0.0953102 + 0.4054651 - 0.6931472 + 0.4054651) / 4 = -0.2130932 / 4 = -0.0532733
    assert stats["approx_kl"] == pytest.approx(-0.0532733, abs=1e-6)


def test_policy_loss_gradient_is_zero_on_clipped_tokens():
    pi_logprobs, pi_old_logprobs, advantages, mask = _policy_inputs()
    pi_logprobs.requires_grad_(True)
    loss, _ = policy_loss(pi_logprobs, pi_old_logprobs, advantages, mask)
    loss.backward()
    # unclipped: d(-ratio * A / 4)/d logp = -ratio * A / 4: token 0: -1.1 * 2 / 4 = -0.55; token 3: 1.5 / 4 = 0.375
    # tokens 1 and 2 clipped -> 0; padding -> 0
    assert_close(pi_logprobs.grad, torch.tensor([[-0.55, 0.0, 0.0, 0.375, 0.0]]))


def test_policy_loss_with_num_tokens_divides_the_token_sum():
    pi_logprobs, pi_old_logprobs, advantages, mask = _policy_inputs()
    loss, stats = policy_loss(pi_logprobs, pi_old_logprobs, advantages, mask, num_tokens=10)
    # token sum (see test_policy_loss_by_hand) = -2.2 - 1.2 + 0.8 + 1.5 = -1.1; / 10 = -0.11
    assert_close(loss, torch.tensor(-0.11))
    # the stats stay token means over this batch's 4 action tokens
    assert stats["clip_frac"] == pytest.approx(0.5)
    assert stats["approx_kl"] == pytest.approx(-0.0532733, abs=1e-6)


# Two micro-batches of one row each, 1 and 3 action tokens, joined as a (2, 3) full batch.
# With pi = pi_old the ratio is 1 (inside the clip range): loss_t = -A_t and d loss_t / d logp_t = -A_t.
MICRO_ADVANTAGES = torch.tensor([[2.0, 50.0, 50.0], [1.0, -1.0, 4.0]])
MICRO_MASK = torch.tensor([[1, 0, 0], [1, 1, 1]])


def test_policy_loss_equal_per_token_weight_across_micro_batches_of_unequal_length():
    full_logprobs = torch.zeros(2, 3, requires_grad=True)
    full, _ = policy_loss(full_logprobs, torch.zeros(2, 3), MICRO_ADVANTAGES, MICRO_MASK)
    full.backward()
    # full-batch token mean: -(2 + 1 - 1 + 4) / 4 = -6 / 4 = -1.5; each token's gradient -A_t / 4
    assert_close(full, torch.tensor(-1.5))
    assert_close(full_logprobs.grad, torch.tensor([[-0.5, 0.0, 0.0], [-0.25, 0.25, -1.0]]))

    logprobs = torch.zeros(2, 3, requires_grad=True)
    micro = [
        policy_loss(
            logprobs[i : i + 1], torch.zeros(1, 3), MICRO_ADVANTAGES[i : i + 1], MICRO_MASK[i : i + 1], num_tokens=4
        )[0]
        for i in range(2)
    ]
    # micro 0: -2 / 4 = -0.5; micro 1: -(1 - 1 + 4) / 4 = -1.0; sum = -1.5, the full-batch token mean
    assert_close(micro[0], torch.tensor(-0.5))
    assert_close(micro[1], torch.tensor(-1.0))
    (micro[0] + micro[1]).backward()
    # every token weighs 1/4: gradients -A_t / 4 as for the full batch
    assert_close(logprobs.grad, full_logprobs.grad)

    mean_logprobs = torch.zeros(2, 3, requires_grad=True)
    means = [
        policy_loss(mean_logprobs[i : i + 1], torch.zeros(1, 3), MICRO_ADVANTAGES[i : i + 1], MICRO_MASK[i : i + 1])[0]
        for i in range(2)
    ]
    ((means[0] + means[1]) / 2).backward()
    # averaging the per-micro token means: (-2 / 1 + -4 / 3) / 2 = (-2 - 1.3333333) / 2 = -1.6666667 != -1.5
    assert_close((means[0] + means[1]) / 2, torch.tensor(-5.0 / 3.0))
    # weights 1/2 for the lone token of micro 0 and 1/6 = (1/3) * (1/2) for each token of micro 1:
    # [-2 / 2, 0, 0] and [-1 / 6, 1 / 6, -4 / 6]
    assert_close(mean_logprobs.grad, torch.tensor([[-1.0, 0.0, 0.0], [-1.0 / 6.0, 1.0 / 6.0, -4.0 / 6.0]]))


def test_value_loss_equal_per_token_weight_across_micro_batches_of_unequal_length():
    returns = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    start = torch.tensor([[1.0, 9.0, 9.0], [2.0, 0.0, 3.0]])
    for clip_eps in (None, 0.5):
        # clip_eps 0.5 with old_values = values: v_clip = v, the clipped and unclipped terms agree
        full_values = start.clone().requires_grad_(True)
        full, _ = value_loss(full_values, start, returns, MICRO_MASK, clip_eps=clip_eps)
        full.backward()
        # squared errors on action tokens: (1 - 0)^2 = 1; (2 - 1)^2 = 1, (0 - 1)^2 = 1, (3 - 1)^2 = 4
        # token mean: 0.5 * (1 + 1 + 1 + 4) / 4 = 0.5 * 7 / 4 = 0.875; gradient (v - R) / 4
        assert_close(full, torch.tensor(0.875))
        assert_close(full_values.grad, torch.tensor([[0.25, 0.0, 0.0], [0.25, -0.25, 0.5]]))

        values = start.clone().requires_grad_(True)
        micro = [
            value_loss(
                values[i : i + 1],
                start[i : i + 1],
                returns[i : i + 1],
                MICRO_MASK[i : i + 1],
                clip_eps=clip_eps,
                num_tokens=torch.tensor(4.0),
            )[0]
            for i in range(2)
        ]
        # micro 0: 0.5 * 1 / 4 = 0.125; micro 1: 0.5 * (1 + 1 + 4) / 4 = 0.75; sum 0.875
        assert_close(micro[0], torch.tensor(0.125))
        assert_close(micro[1], torch.tensor(0.75))
        (micro[0] + micro[1]).backward()
        assert_close(values.grad, full_values.grad)


def test_policy_loss_clamps_log_ratio():
    # log ratio 100 would overflow exp; clamped to 20 then clipped to 1.2 for A = 1 -> loss -1.2
    loss, _ = policy_loss(torch.tensor([[100.0]]), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1))
    assert_close(loss, torch.tensor(-1.2))


def test_value_loss_with_and_without_clipping():
    values = torch.tensor([[1.0, 2.0, 2.0, 5.0]])
    old_values = torch.tensor([[0.8, 1.0, 0.5, 0.0]])
    returns = torch.tensor([[1.5, 1.0, 3.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, stats = value_loss(values, old_values, returns, mask, clip_eps=0.5)
    # token 0: v - old = 0.2 (inside) -> v_clip = 1.0; (1 - 1.5)^2 = 0.25 both        -> 0.5 * 0.25 = 0.125
    # token 1: v - old = 1.0 -> 0.5, v_clip = 1.5; max((2 - 1)^2, (1.5 - 1)^2) = max(1, 0.25) = 1 -> 0.5
    # token 2: v - old = 1.5 -> 0.5, v_clip = 1.0; max((2 - 3)^2, (1 - 3)^2) = max(1, 4) = 4 (clipped) -> 2.0
    # token mean = (0.125 + 0.5 + 2.0) / 3 = 2.625 / 3 = 0.875
    assert_close(loss, torch.tensor(0.875))
    assert stats["value_clip_frac"] == pytest.approx(1 / 3)
    # no clipping: 0.5 * (0.25 + 1 + 1) / 3 = 0.5 * 2.25 / 3 = 0.375
    loss_unclipped, stats_unclipped = value_loss(values, old_values, returns, mask, clip_eps=None)
    assert_close(loss_unclipped, torch.tensor(0.375))
    assert stats_unclipped["value_clip_frac"] == 0.0


def test_adaptive_kl_controller_update_and_state_dict():
    kl_ctl = AdaptiveKLController(init_value=0.1, target=6.0, horizon=10000)
    kl_ctl.update(current_kl=9.0, n_steps=100)
    # error = clip(9 / 6 - 1, -0.2, 0.2) = clip(0.5) = 0.2; 0.1 * (1 + 0.2 * 100 / 10000) = 0.1 * 1.002 = 0.1002
    assert kl_ctl.value == pytest.approx(0.1002)
    kl_ctl.update(current_kl=6.6, n_steps=100)
    # error = 6.6 / 6 - 1 = 0.1 (inside); 0.1002 * (1 + 0.1 * 0.01) = 0.1002 * 1.001 = 0.1003002
    assert kl_ctl.value == pytest.approx(0.1003002)

    restored = AdaptiveKLController(init_value=0.5, target=6.0, horizon=10000)
    restored.load_state_dict(kl_ctl.state_dict())
    assert restored.value == kl_ctl.value
    assert all(isinstance(v, float) for v in kl_ctl.state_dict().values())


def test_fixed_kl_controller_and_factory():
    kl_ctl = make_kl_controller(0.05)
    assert isinstance(kl_ctl, FixedKLController)
    kl_ctl.update(current_kl=100.0, n_steps=1000)
    assert kl_ctl.value == 0.05
    restored = FixedKLController(1.0)
    restored.load_state_dict(kl_ctl.state_dict())
    assert restored.value == 0.05

    adaptive = make_kl_controller(0.1, target=6.0)
    assert isinstance(adaptive, AdaptiveKLController) and adaptive.horizon == 10000
    with pytest.raises(ValueError, match="target > 0"):
        make_kl_controller(0.1, target=0.0)
