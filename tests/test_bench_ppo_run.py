"""bench._ppo_run, without running a job: the overrides resolve to the benchmark's size on the tiny preset, the step
line both code versions print is parsed, and the steady-state numbers leave out the warm-up step."""

import argparse

import pytest

from bench import _ppo_run
from rlhf_core.config import load_config
from rlhf_core.data.synthetic import gold_reward
from rlhf_core.distributed.placement import RoleSet
from rlhf_core.jobs.ppo.old_logprobs import old_logprobs_source
from rlhf_core.rewards import call_reward_fn, load_reward_fn


def args_of(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    _ppo_run.add_size_args(parser)
    return parser.parse_args(list(argv))


def test_overrides_give_the_benchmark_size():
    args = args_of("--steps", "5", "--set", "ppo.rollout.top_p=0.9")
    p = load_config(str(_ppo_run.ROOT / _ppo_run.PRESET), _ppo_run.overrides(args)).stage("ppo")
    assert {p.actor.model.name_or_path, p.critic.model.name_or_path, p.reward.model.name_or_path} == {"builtin:medium"}
    assert (p.train.rollout_batch_size, p.rollout.max_new_tokens, p.algo.ppo_epochs) == (16, 64, 4)
    assert (p.actor.strategy.precision, p.critic.strategy.precision) == ("fp32", "fp32")
    assert not (
        p.placement.colocate_all or p.placement.colocate_actor_ref or p.placement.colocate_critic_reward
    )  # a separate critic
    assert (p.train.max_steps, p.train.save_steps, p.train.eval_prompts, p.rollout.top_p) == (5, 0, 0, 0.9)
    assert _ppo_run.samples_per_prompt(args) == p.rollout.n_samples_per_prompt
    assert _ppo_run.samples_per_prompt(args_of("--samples-per-prompt", "4")) == 4


def test_grpo_is_the_actor_alone_one_step_per_batch_without_kl_scored_by_the_gold_rule(monkeypatch):
    monkeypatch.chdir(_ppo_run.ROOT)  # the reward function's path is relative to the job's directory, the checkout
    args = args_of("--grpo")
    p = load_config(str(_ppo_run.ROOT / _ppo_run.PRESET), _ppo_run.overrides(args)).stage("ppo")
    assert (p.actor.model.name_or_path, p.critic.model, p.reward.model) == ("builtin:medium", None, None)
    assert (p.algo.advantage_estimator, p.reward_fn) == ("grpo", _ppo_run.GOLD_REWARD_FN)
    assert (p.train.rollout_batch_size, p.rollout.n_samples_per_prompt, p.rollout.max_new_tokens) == (16, 4, 64)
    assert (p.algo.ppo_epochs, p.train.train_batch_size) == (1, 64)  # the whole batch, one optimizer step
    assert (p.algo.kl_coef, p.algo.kl_target, p.rollout.backend) == (0.0, None, "vllm")
    assert RoleSet.of(p) == RoleSet(critic=False, reference=False, reward_model=False)  # the actor alone
    assert old_logprobs_source(p, actor_frozen=False, ref_from_actor=False) == "training"  # one step, no KL
    assert _ppo_run.samples_per_prompt(args) == 4
    prompt, response = "Write a sentence about the rain.", "The rain falls softly."
    scores = call_reward_fn(
        load_reward_fn(p.reward_fn, "ppo.reward_fn"), p.reward_fn, "ppo.reward_fn", [prompt], [response]
    )
    assert scores == [gold_reward(prompt, response)]  # a batch reward function: the gold rule row by row
    hf = args_of("--grpo", "--backend", "hf", "--epochs", "2")
    p = load_config(str(_ppo_run.ROOT / _ppo_run.PRESET), _ppo_run.overrides(hf)).stage("ppo")
    assert (p.rollout.backend, p.algo.ppo_epochs) == ("hf", 2)


def test_new_set_reaches_only_this_checkouts_run():
    args = args_of("--new-set", "ppo.train.async_enable=true", "--set", "ppo.rollout.top_p=0.9")
    assert "ppo.train.async_enable=true" not in _ppo_run.overrides(args)  # the baseline's overrides
    p = load_config(str(_ppo_run.ROOT / _ppo_run.PRESET), [*_ppo_run.overrides(args), *args.new_set]).stage("ppo")
    assert (p.train.async_enable, p.rollout.top_p) == (True, 0.9)


def test_step_line_and_steady_state():
    m = _ppo_run.STEP_LINE.match("[ppo] step 2/3 reward=0.1000 kl=0.0010 timing/step_s=14.2345 (14.2s)\n")
    assert m is not None and (m.group(1), m.group(2), m.group(3)) == ("2", "3", "14.2")
    timing = {"timing/train_s": 2.0, "timing/generation_s": 1.0, "timing/step_s": 4.0}
    steps = [
        _ppo_run.Step(1, 40.0, 32, 320.0, dict(timing), {"response_len": 10.0, **timing}),
        _ppo_run.Step(2, 4.0, 32, 640.0, dict(timing), {"response_len": 20.0, **timing}),
        _ppo_run.Step(3, 4.0, 32, 640.0, dict(timing), {"response_len": 20.0, **timing}),
    ]
    run = _ppo_run.Run("new", steps, 30.0, 100.0, {})
    assert [s.step for s in run.measured] == [2, 3]  # step 1, the warm-up, left out
    assert run.step_s == 4.0 and run.gen_tok_s == pytest.approx(160.0) and run.mean("response_len") == 20.0
    assert list(run.phases()) == ["generation", "train", "step"]  # the step's order, not the keys' order
    assert _ppo_run.Run("one", steps[:1], 30.0, 50.0, {}).measured == steps[:1]
