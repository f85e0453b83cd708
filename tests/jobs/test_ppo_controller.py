"""The PPO controller's experience and advantage phases on plain in-process roles (no Ray): what each role is given,
how truncated responses are scored and penalised, and the critic warm-up's frozen actor as its own reference."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from rlhf_core import timing
from rlhf_core.algos.batching import ensure_eos, make_sequences
from rlhf_core.algos.experience import Experience, SequenceBatch
from rlhf_core.algos.ppo import KL_ESTIMATORS, approx_kl, make_kl_controller
from rlhf_core.config import PPOAlgoConfig, load_config
from rlhf_core.distributed import launcher
from rlhf_core.distributed.placement import RoleSet, needs_kl, resource_demand, role_workers
from rlhf_core.distributed.reward import RewardScorer
from rlhf_core.jobs import ppo
from rlhf_core.models.builders import load_tokenizer
from rlhf_core.rewards import RewardSources, Scored
from tests.conftest import TINY


class InProcess:
    """A one-rank stand-in for a RayWorkerGroup: runs the named method on a local object and records its input."""

    def __init__(self, obj):
        self.obj, self.seen = obj, []

    def __len__(self):
        return 1

    def call_each_async(self, method, shards, *args):
        self.seen.extend(shards)
        return [getattr(self.obj, method.__name__)(shard, *args) for shard in shards]


class Zeros:
    """Log-probs / values of the right shape (the phases under test only pass them through)."""

    def logprobs(self, batch: SequenceBatch):
        return torch.full(batch.action_mask.shape, -1.0)

    def values(self, batch: SequenceBatch):
        return torch.zeros(batch.action_mask.shape)


@pytest.fixture
def controller(monkeypatch):
    monkeypatch.setattr(launcher, "wait", lambda results: results)  # results, not ObjectRefs
    tok = load_tokenizer("builtin:tiny")
    ctl = object.__new__(ppo.PPOController)
    ctl.tokenizer, ctl.pad_id, ctl.eos_id = tok, tok.pad_token_id, tok.eos_token_id
    ctl.actor, ctl.critic, ctl.reference = InProcess(Zeros()), InProcess(Zeros()), InProcess(Zeros())
    ctl.reward = InProcess(RewardScorer("builtin:tiny", 2, "fp32", init_seed=1))
    ctl.rewards = RewardSources(weights={"reward": 1.0})
    return ctl


def test_truncated_responses_are_scored_with_eos_and_penalised_before_the_clip(controller):
    eos = controller.eos_id
    prompts = [[5, 6, 7], [8, 9]]
    responses = [[20, 21, 22, 23], [24, 25, 26, 27, 28, 29], [30, 31, eos], [32, eos]]  # 2 per prompt: 2 cut
    timer = timing.PhaseTimer()
    scored = controller.experience(prompts, responses, ["first", "second"], timer)
    exp = scored.exp
    expanded = [p for p in prompts for _ in range(2)]
    # each role's forward is timed (in-process stand-ins: their results are ready at dispatch)
    assert set(timer.seconds) == {f"experience_{r}" for r in ("actor", "reference", "critic", "reward")}

    # actor, critic and reference see the sampled tokens only
    sampled = make_sequences(expanded, responses, controller.pad_id)
    for group in (controller.actor, controller.critic, controller.reference):
        assert torch.equal(group.seen[0].input_ids, sampled.input_ids)
    assert torch.equal(exp.input_ids, sampled.input_ids) and torch.equal(exp.action_mask, sampled.action_mask)
    # the reward model scores prompt + response + EOS where the response was cut
    closed, truncated = ensure_eos(responses, eos)
    assert truncated.tolist() == [True, True, False, False] and torch.equal(exp.truncated, truncated)
    closed_seq = make_sequences(expanded, closed, controller.pad_id)
    assert torch.equal(controller.reward.seen[0].input_ids, closed_seq.input_ids)
    scorer = controller.reward.obj
    torch.testing.assert_close(exp.scores, scorer.scores(closed_seq))  # no stored statistics: the raw scores
    unclosed = scorer.scores(sampled)
    assert (exp.scores[:2] - unclosed[:2]).abs().min() > 1e-4  # the cut ones: scored at the appended EOS
    torch.testing.assert_close(exp.scores[2:], unclosed[2:])

    # normalise (with the reward model's stored statistics, when the sources are combined), then the missing-EOS
    # penalty, then the clip (OpenRLHF's order); the advantages come as a new Experience
    mean, std = exp.scores.mean().item(), 0.1
    controller.rewards.stats = (mean, std)
    normalised = controller.rewards.combine(scored.parts)
    torch.testing.assert_close(normalised, (exp.scores - mean) / (std + 1e-8))
    algo = PPOAlgoConfig(missing_eos_penalty=-1.0, reward_clip=[-1.2, 1.2])
    controller.p = SimpleNamespace(algo=algo, rollout=SimpleNamespace(n_samples_per_prompt=2))
    controller.kl_ctl = make_kl_controller(0.01)
    exp = dataclasses.replace(exp, scores=normalised)
    out, logs = controller.advantages(Scored(exp, scored.parts))
    assert isinstance(out, Experience) and exp.advantages is None and out.advantages is not None
    expected = (normalised - truncated.float()).clamp(-1.2, 1.2)
    assert logs["reward"] == pytest.approx(expected.mean().item(), abs=1e-6)
    assert logs["truncated_frac"] == 0.5 and logs["rm_score"] == pytest.approx(scored.parts["reward"].mean().item())
    # the reward of each row sits on its last action token: the returns there (gamma = 1, critic values 0)
    last = sampled.action_mask.cumsum(1).argmax(1)
    assert (out.returns.gather(1, last[:, None]).squeeze(1) - expected).abs().max() < 1e-5


def test_the_critic_warmups_frozen_actor_is_its_own_reference(controller, tmp_path):
    """The critic warm-up with ``reference`` null builds no reference group (nor asks Ray for one): its actor never
    trains, so the actor's old log-probs are the reference's, the KL (any estimator) and its penalty exactly 0, and
    the KL metrics stay, at 0.0. A reference of its own is built, and so is the PPO stage's, also with frozen
    warm-up steps (its actor trains after them)."""
    cfg = load_config(TINY, [f"run_uri={tmp_path}", "ppo.train.freeze_actor_steps=1"])
    warmup, stage = cfg.stage("critic_warmup"), cfg.stage("ppo")
    assert warmup.reference is None and needs_kl(warmup.algo)
    frozen_roles, stage_roles = RoleSet.of(warmup, train_actor=False), RoleSet.of(stage, train_actor=True)
    assert not frozen_roles.reference and role_workers(warmup, frozen_roles)["reference"] == 0
    assert RoleSet.of(dataclasses.replace(warmup, reference=warmup.actor), train_actor=False).reference
    assert stage_roles.reference and role_workers(stage, stage_roles)["reference"] == stage.reference_workers
    frozen = resource_demand(warmup, frozen_roles, "cuda")
    trained = resource_demand(warmup, RoleSet.of(warmup), "cuda")
    assert trained["CPU"] - frozen["CPU"] == warmup.frozen_cpus_per_worker and trained["GPU"] - frozen["GPU"] == 1

    controller.reference, controller.ref_from_actor = None, True
    eos = controller.eos_id
    responses = [[20, 21, eos], [22, 23, 24, 25], [26, eos], [27, 28, 29]]
    scored = controller.experience([[5, 6, 7], [8, 9]], responses, ["first", "second"])
    exp = scored.exp
    assert exp.ref_logprobs is exp.old_logprobs
    for estimator in KL_ESTIMATORS:
        kl = approx_kl(exp.old_logprobs, exp.ref_logprobs, exp.action_mask, estimator)
        assert torch.equal(kl, torch.zeros_like(exp.old_logprobs)), estimator
    controller.p = SimpleNamespace(algo=PPOAlgoConfig(kl_coef=0.5), rollout=SimpleNamespace(n_samples_per_prompt=2))
    controller.kl_ctl = make_kl_controller(0.5)
    out, logs = controller.advantages(scored)
    assert logs["kl"] == 0.0 and logs["kl_token_mean"] == 0.0
    controller.kl_ctl = make_kl_controller(0.0)  # no penalty at all: the same advantages and returns, bit for bit
    unpenalised, _ = controller.advantages(scored)
    assert torch.equal(out.advantages, unpenalised.advantages) and torch.equal(out.returns, unpenalised.returns)
