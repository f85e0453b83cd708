"""Config of the RL family: each estimator's and reward source's mistakes are refused naming the key and the fix, a
remote reward server's credentials never reach a dump of the config, and the presets without a critic load."""

import re
import typing

import pytest

from rlhf_core.algos.vocab import (
    ADVANTAGE_ESTIMATORS,
    GROUP_ESTIMATORS,
    IS_CORRECTIONS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
)
from rlhf_core.config import ConfigError, PPOAlgoConfig, load_config, stage_hash, to_yaml
from rlhf_core.config.hashing import _off
from tests.conftest import ROOT

PRESETS = ROOT / "deployments" / "configs"
TINY = PRESETS / "tiny.yaml"
GRPO = PRESETS / "tiny-grpo.yaml"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["ppo.algo.advantage_estimator=grpo"], r"'ppo.critic.model' is set but .* grpo builds no critic"),
        (
            ["ppo.critic.model=null"],
            r"'ppo.critic.model.name_or_path' is required: algo.advantage_estimator=gae needs one",
        ),
        (
            ["critic_warmup.critic.model=null"],
            r"'critic_warmup.critic.model.name_or_path' is required: the critic warm-up",
        ),
        (
            ["ppo.critic.model=null", "ppo.algo.advantage_estimator=rloo", "ppo.rollout.n_samples_per_prompt=1"],
            r"'ppo.algo.advantage_estimator' = rloo .* 'ppo.rollout.n_samples_per_prompt' >= 2 \(it is 1\)",
        ),
        (["ppo.algo.dynamic_filter=true", "ppo.rollout.n_samples_per_prompt=1"], r"'ppo.algo.dynamic_filter'"),
        (["ppo.reward.model=null"], r"'ppo' has no reward: give 'ppo.reward.model.name_or_path'"),
        (["ppo.reward_weights={reward_fn: 2.0}"], r"'ppo.reward_weights.reward_fn' weighs no reward source"),
        (["ppo.algo.dual_clip=1.0"], r"'ppo.algo.dual_clip': must be > 1"),
        (["ppo.algo.eps_clip_high=0"], r"'ppo.algo.eps_clip_high'"),
        (["ppo.algo.kl_loss_unbiased=true"], r"'ppo.algo.kl_loss_unbiased' applies to the KL loss term"),
        (["ppo.algo.kl_mode=loss", "ppo.algo.kl_coef=0"], r"'ppo.algo.kl_mode' = loss with kl_coef 0"),
        (["ppo.algo.is_correction_cap=0"], r"'ppo.algo.is_correction_cap'"),
        (["ppo.algo.policy_loss=gspo"], r"'ppo.algo.policy_loss' = gspo .* 'ppo.algo.loss_agg' = seq_mean \(it is"),
        (["ppo.algo.is_correction=tis", "ppo.algo.is_correction_threshold=[5.0,0.5]"], r"is_correction_threshold'"),
        (["ppo.algo.is_correction_threshold=[0.5]"], r"'ppo.algo.is_correction_threshold': must be \[low, high\]"),
        (["ppo.algo.is_correction=icepop", "ppo.algo.is_correction_cap=2"], r"'ppo.algo.is_correction_cap' and"),
        (["ppo.remote_rm_url=ftp://x/score"], r"'ppo.remote_rm_url' = 'ftp://x/score' must be an http"),
        (["ppo.remote_rm_url=http://h/score", "ppo.remote_rm.timeout_s=0"], r"'ppo.remote_rm.timeout_s'"),
        (["critic_warmup.algo.advantage_estimator=grpo"], r"critic_warmup.algo.advantage_estimator"),
        (["ppo.train.async_queue_size=0"], r"invalid value 0 for 'ppo.train.async_queue_size': must be >= 1"),
        (["ppo.train.partial_rollout_enable=true"], r"'ppo.train.async_enable': must be true with train.partial"),
        (
            ["ppo.train.async_enable=true", "ppo.train.partial_rollout_enable=true"],
            r"invalid value 'hf' for 'ppo.rollout.backend': must be vllm with train.partial_rollout_enable",
        ),
        (
            ["ppo.train.async_enable=true", "ppo.rollout.backend=vllm", "ppo.rollout.enable_sleep=true"],
            r"'ppo.train.async_enable' generates while .* set 'ppo.rollout.enable_sleep' = false or async_enable",
        ),
        (
            ["ppo.train.async_enable=true", "ppo.placement.offload_states_during_rollout=true"],
            r"'ppo.train.async_enable' .* set 'ppo.placement.offload_states_during_rollout' = false",
        ),
    ],
)
def test_rl_config_mistakes_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, overrides)


def test_a_remote_reward_url_with_credentials_is_redacted_and_not_hashed():
    secret = "http://user:hunter2@127.0.0.1:8123/score?token=s3cr3t"
    cfg = load_config(TINY, [f"ppo.remote_rm_url={secret}"])
    assert cfg.stage("ppo").remote_rm_url == secret  # the job itself gets the real URL
    text = to_yaml(cfg)
    assert "hunter2" not in text and "s3cr3t" not in text and "127.0.0.1:8123/score" in text
    # a new token for the same server computes the same rewards: the stage's hash does not change
    other = load_config(TINY, ["ppo.remote_rm_url=http://user:other@127.0.0.1:8123/score?token=new"])
    assert stage_hash(cfg.stage("ppo")) == stage_hash(other.stage("ppo"))
    moved = load_config(TINY, ["ppo.remote_rm_url=http://127.0.0.1:9999/score"])
    assert stage_hash(moved.stage("ppo")) != stage_hash(cfg.stage("ppo"))


@pytest.mark.parametrize("preset", ["tiny-grpo", "tiny-reinforce", "tiny-rloo", "tiny-rlvr"])
def test_the_critic_free_presets_have_no_critic_stage(preset):
    cfg = load_config(PRESETS / f"{preset}.yaml")
    kinds = {cfg.kind(name) for name in cfg.stages}
    assert "critic_init" not in kinds and "critic_warmup" not in kinds
    (rl,) = [name for name in cfg.stages if cfg.kind(name) == "ppo"]
    section = cfg.stage(rl)
    assert section.critic.model is None and section.algo.advantage_estimator != "gae"
    if preset == "tiny-rlvr":
        assert section.reward.model is None and section.reward_fn.endswith("gold.py:gold_rewards")
        assert "reward_model" not in cfg.stages


def test_the_estimator_names_are_the_algorithms_own():
    """rlhf_core.algos names the estimators and loss aggregations (one Literal each); the config's fields take those
    types, so the config accepts exactly what the algorithms implement."""
    hints = typing.get_type_hints(PPOAlgoConfig)
    assert typing.get_args(hints["advantage_estimator"]) == ADVANTAGE_ESTIMATORS
    assert typing.get_args(hints["kl_estimator"]) == KL_ESTIMATORS
    assert typing.get_args(hints["loss_agg"]) == LOSS_AGGREGATIONS
    assert typing.get_args(hints["policy_loss"]) == POLICY_LOSSES
    assert typing.get_args(hints["is_correction"]) == (typing.Literal[IS_CORRECTIONS], type(None))
    assert set(GROUP_ESTIMATORS) < set(ADVANTAGE_ESTIMATORS)
    choices = ", ".join(map(re.escape, ADVANTAGE_ESTIMATORS))
    with pytest.raises(ConfigError, match=f"'ppo.algo.advantage_estimator': choose one of {choices}$"):
        load_config(TINY, ["ppo.algo.advantage_estimator=ppo"])


def test_gspo_and_the_is_correction_load_and_leave_the_default_hash_alone():
    """The new actor-loss keys are off by default and out of the hash then (``hashing._OFF_BY_DEFAULT``)."""
    base = load_config(TINY)
    default = load_config(TINY, ["ppo.algo.policy_loss=ppo", "ppo.algo.is_correction_threshold=[0.5,5.0]"])
    assert stage_hash(base.stage("ppo")) == stage_hash(default.stage("ppo"))
    gspo = load_config(TINY, ["ppo.algo.policy_loss=gspo", "ppo.algo.loss_agg=seq_mean"]).stage("ppo")
    assert gspo.algo.policy_loss == "gspo"
    seq_mask = load_config(TINY, ["ppo.algo.is_correction=seq-mask-tis"]).stage("ppo")
    assert seq_mask.algo.is_correction == "seq-mask-tis" and seq_mask.algo.is_correction_threshold == [0.5, 5.0]
    assert stage_hash(seq_mask) != stage_hash(base.stage("ppo"))


def test_async_training_stays_out_of_the_hash_until_turned_on():
    """Off by default and then out of the hash (``hashing._OFF_BY_DEFAULT``): the stages keep their hashes."""
    assert _off("async_enable", False) and _off("async_queue_size", 1) and _off("partial_rollout_enable", False)
    base = load_config(TINY).stage("ppo")
    on = load_config(TINY, ["ppo.train.async_enable=true"]).stage("ppo")
    assert on.train.async_enable and on.train.async_queue_size == 1
    assert stage_hash(on) != stage_hash(base)


@pytest.mark.parametrize(
    "kl_coef, kl_target, kl_mode, expected",
    [
        # (needs_kl, kl_in_reward, kl_in_loss): a KL when the coefficient is positive or a target adapts it
        (0.01, None, "reward", (True, True, False)),
        (0.0, None, "reward", (False, False, False)),  # no KL: no penalty, no reference to build
        (0.0, 6.0, "reward", (True, True, False)),  # the adaptive controller may raise a zero coefficient
        (0.05, None, "loss", (True, False, True)),  # GRPO's loss term, not in the rewards
    ],
)
def test_where_the_kl_goes_is_decided_once_on_the_algorithm(kl_coef, kl_target, kl_mode, expected):
    """Placement, old log-probs, advantages and the actor's loss read these three properties, nothing else."""
    a = PPOAlgoConfig(kl_coef=kl_coef, kl_target=kl_target, kl_mode=kl_mode)
    assert (a.needs_kl, a.kl_in_reward, a.kl_in_loss) == expected
