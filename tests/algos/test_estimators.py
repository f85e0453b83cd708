"""The critic-free advantage estimators (``rlhf_core.algos.advantages``), with the expected values worked by hand."""

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.testing import assert_close

from rlhf_core.algos.advantages import cumulative_returns, shape_scores, varied_groups, whitens
from rlhf_core.algos.ppo import distributed_masked_whiten, masked_whiten, token_rewards
from rlhf_core.algos.vocab import ADVANTAGE_ESTIMATORS
from rlhf_core.distributed import device
from rlhf_core.ports import free_port

# Two prompts, 4 samples each: prompt 0's rewards differ, prompt 1's are all equal.
SCORES = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])


def test_grpo_normalises_within_each_group_and_identical_rewards_give_zero():
    # group 0: mean 0.5, deviations +-0.5; unbiased variance (4 x 0.25) / 3 = 1/3, std 0.5773503
    #   -> +-0.5 / 0.5773503 = +-0.8660254.  group 1: all 2 -> 0 / (0 + 1e-9) = 0
    expected = torch.tensor([0.8660254, -0.8660254, -0.8660254, 0.8660254, 0.0, 0.0, 0.0, 0.0])
    assert_close(shape_scores(SCORES, 4, "grpo"), expected)


def test_rloo_baseline_excludes_the_sample_itself():
    # row 0: 1 - (0 + 0 + 1) / 3 = 2/3;  row 1: 0 - (1 + 0 + 1) / 3 = -2/3;  row 2 likewise -2/3;  row 3: 2/3
    # group 1: 2 - (2 + 2 + 2) / 3 = 0.  (A baseline that included the sample would be the mean 0.5: 0.5, -0.5.)
    expected = torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 0.0, 0.0, 0.0])
    assert_close(shape_scores(SCORES, 4, "rloo"), expected)


@pytest.mark.parametrize("estimator", ["reinforce++_baseline", "dr_grpo"])
def test_group_mean_baselines_subtract_the_mean_without_dividing(estimator):
    # group 0: r - 0.5;  group 1: 2 - 2 = 0
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0])
    assert_close(shape_scores(SCORES, 4, estimator), expected)


@pytest.mark.parametrize("estimator", ["gae", "reinforce++"])
def test_gae_and_reinforce_keep_the_reward(estimator):
    assert_close(shape_scores(SCORES, 4, estimator), SCORES)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "dr_grpo", "reinforce++_baseline"])
def test_a_group_of_identical_rewards_gives_zero_for_every_group_estimator(estimator):
    assert torch.equal(shape_scores(torch.full((6,), 0.7), 3, estimator), torch.zeros(6))


def test_estimator_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        shape_scores(SCORES, 4, "ppo")
    with pytest.raises(ValueError, match="'grpo'.*n_samples_per_prompt >= 2, got 1"):
        shape_scores(SCORES, 1, "grpo")
    with pytest.raises(ValueError, match="8 scores do not split into groups of 3"):
        shape_scores(SCORES, 3, "rloo")


def test_which_estimators_whiten():
    whitened = [e for e in ADVANTAGE_ESTIMATORS if whitens(e, whiten_advantages=False)]
    assert whitened == ["reinforce++", "reinforce++_baseline"]
    assert whitens("gae", whiten_advantages=True) and not whitens("grpo", whiten_advantages=True)


def test_cumulative_returns_by_hand_with_a_hole():
    # position 2 is a hole (masked; its reward inf must not leak); the returns run backwards over 3, 1, 0
    rewards = torch.tensor([[0.1, 0.2, math.inf, 5.0]])
    mask = torch.tensor([[1, 1, 0, 1]])
    # gamma 1: G3 = 5; G1 = 0.2 + 5 = 5.2; G0 = 0.1 + 5.2 = 5.3
    assert_close(cumulative_returns(rewards, mask, 1.0), torch.tensor([[5.3, 5.2, 0.0, 5.0]]))
    # gamma 0.5: G3 = 5; G1 = 0.2 + 0.5 x 5 = 2.7; G0 = 0.1 + 0.5 x 2.7 = 1.45
    assert_close(cumulative_returns(rewards, mask, 0.5), torch.tensor([[1.45, 2.7, 0.0, 5.0]]))


def test_critic_free_advantage_is_the_return_of_the_kl_penalised_rewards():
    # score 1 at the last token, KL 0.5 on each of 3 tokens with kl_coef 0.1: rewards -0.05, -0.05, -0.05 + 1
    rewards = token_rewards(torch.tensor([1.0]), torch.full((1, 3), 0.5), torch.ones(1, 3), 0.1)
    # returns (gamma 1): 0.9 - 0.05 - 0.05 = 0.85, then 0.9, 0.95
    assert_close(cumulative_returns(rewards, torch.ones(1, 3), 1.0), torch.tensor([[0.85, 0.9, 0.95]]))


def test_varied_groups_drop_prompts_whose_samples_all_scored_alike():
    assert varied_groups(SCORES, 4).tolist() == [True] * 4 + [False] * 4
    assert varied_groups(SCORES, 1).tolist() == [True] * 8


# REINFORCE++ across two ranks: rank 0 holds one response of 3 tokens, rank 1 one of 2 tokens.
RANK_REWARDS = [torch.tensor([[0.0, 0.0, 3.0]]), torch.tensor([[0.0, 1.0]])]


def _reinforce_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        mask = torch.ones_like(RANK_REWARDS[rank])
        returns = cumulative_returns(RANK_REWARDS[rank], mask, 1.0)
        advantages = distributed_masked_whiten(returns, mask, device.all_reduce_sum)
        torch.save(advantages, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_reinforce_pp_normalises_over_the_whole_batch_across_two_processes(tmp_path):
    mp.spawn(_reinforce_worker, args=(2, free_port("127.0.0.1"), str(tmp_path)), nprocs=2, join=True)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    # returns: rank 0 [3, 3, 3], rank 1 [1, 1]. Over all 5 tokens: mean 11/5 = 2.2;
    # E[x^2] = (9 + 9 + 9 + 1 + 1) / 5 = 5.8, variance 5.8 - 2.2^2 = 0.96, std 0.9797959
    # -> 3: 0.8 / 0.9797959 = 0.8164966;  1: -1.2 / 0.9797959 = -1.2247449
    assert_close(rank0, torch.full((1, 3), 0.8164966))
    assert_close(rank1, torch.full((1, 2), -1.2247449))
    # the same as whitening the concatenation in one process; rank 1 alone would give 0 (its returns are equal)
    flat = torch.tensor([[3.0, 3.0, 3.0, 1.0, 1.0]])
    assert_close(torch.cat([rank0, rank1], dim=1), masked_whiten(flat, torch.ones_like(flat)))
    alone = masked_whiten(torch.ones(1, 2), torch.ones(1, 2))
    assert torch.equal(alone, torch.zeros(1, 2)) and not torch.allclose(rank1, alone)
