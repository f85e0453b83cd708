"""Where a PPO step's old log-probs come from (``rlhf_core.jobs.ppo.old_logprobs``): the training forward for a batch
of one optimizer step without a KL in its rewards, the engines' with algo.use_rollout_logprobs when the probed rows
agree, else the actor's forward; the config refuses the engines' log-probs together with the engine/trainer
correction."""

import math

import pytest
import torch

from rlhf_core.algos.batching import make_sequences
from rlhf_core.config import ConfigError, as_ppo, load_config
from rlhf_core.jobs.ppo.old_logprobs import engine_old_logprobs, old_logprobs_source, probe_rows
from tests.conftest import TINY

ONE_STEP = ("ppo.train.train_batch_size=32",)  # tiny: 16 prompts x 2 samples = one optimizer step


def source(*overrides: str, frozen: bool = False, ref_from_actor: bool = False) -> str:
    p = as_ppo(load_config(TINY, list(overrides)).stage("ppo"))
    return old_logprobs_source(p, frozen, ref_from_actor)


def test_one_optimizer_step_without_a_kl_in_the_rewards_takes_the_training_forward():
    assert source(*ONE_STEP, "ppo.algo.kl_mode=loss") == "training"
    assert source(*ONE_STEP, "ppo.algo.kl_coef=0") == "training"  # no KL at all
    # the KL penalty of the rewards needs the old log-probs before training; so do frozen steps and several steps
    assert source(*ONE_STEP) == "forward"
    assert source(*ONE_STEP, "ppo.algo.kl_mode=loss", frozen=True) == "forward"
    assert source(*ONE_STEP, "ppo.algo.kl_mode=loss", ref_from_actor=True) == "forward"
    assert source("ppo.algo.kl_mode=loss") == "forward"  # 32 samples, train_batch_size 16: two steps
    assert source(*ONE_STEP, "ppo.algo.kl_mode=loss", "ppo.algo.ppo_epochs=2") == "forward"
    # several steps: the engines' with use_rollout_logprobs; one step stays exact
    assert source("ppo.algo.use_rollout_logprobs=true") == "engine"
    assert source(*ONE_STEP, "ppo.algo.use_rollout_logprobs=true") == "engine"  # KL in the rewards
    assert source(*ONE_STEP, "ppo.algo.kl_coef=0", "ppo.algo.use_rollout_logprobs=true") == "training"


def test_the_config_refuses_engine_logprobs_with_the_engine_trainer_correction_and_a_negative_bound():
    with pytest.raises(ConfigError, match=r"use_rollout_logprobs.*is_correction.*keep one"):
        load_config(TINY, ["ppo.algo.use_rollout_logprobs=true", "ppo.algo.is_correction=tis"])
    with pytest.raises(ConfigError, match=r"rollout_logprobs_max_diff"):
        load_config(TINY, ["ppo.algo.rollout_logprobs_max_diff=-1"])


def test_the_probe_is_the_first_micro_batch_of_each_ranks_shard():
    assert probe_rows(8, 2, 2).tolist() == [0, 1, 4, 5]
    assert probe_rows(4, 2, 8).tolist() == [0, 1, 2, 3]  # a micro-batch larger than a shard: the whole shard


def test_the_engines_logprobs_are_taken_when_the_probe_agrees_within_the_bound():
    # 4 rows; action positions row 0: 1, 2; the others 0, 1, 2 (prompts of 2, 1, 1, 1 tokens)
    seq = make_sequences([[1, 2], [3], [3], [3]], [[4, 5], [6, 7, 8], [6, 7, 8], [6, 7, 8]], pad_id=0)
    mask = seq.action_mask.bool()
    engine = torch.where(mask, -torch.arange(12.0).reshape(4, 3) / 10, torch.full((4, 3), math.nan))
    probed = torch.tensor([0, 2])
    actor = torch.where(mask[probed], engine[probed] + 0.05, torch.zeros(2, 3))  # gap 0.05 on the probed rows
    old, logs, why = engine_old_logprobs(seq, engine, probed, actor, bound=0.1)
    assert logs["rollout_logprob_max_diff"] == pytest.approx(0.05) and why == ""
    assert torch.equal(old, torch.where(mask, engine, torch.zeros_like(engine)))  # 0 off the action tokens
    old, logs, why = engine_old_logprobs(seq, engine, probed, actor, bound=0.01)
    assert old is None and why == "rollout_logprob_max_diff 0.0500 > algo.rollout_logprobs_max_diff 0.01"
    engine[3, 1] = math.nan  # an action token the engines did not report (outside the probe): the forward
    old, _, why = engine_old_logprobs(seq, engine, probed, actor, bound=0.1)
    assert old is None and why == "tokens without engine log-probs"
