"""The PPO controller's experience and advantage phases on the roles of a LocalCluster (this process, one rank each,
no Ray): what each role is given, how truncated responses are scored and penalised, and the critic warm-up's frozen
actor as its own reference."""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from rlhf_core import run_layout, timing
from rlhf_core.algos.batching import ensure_eos, make_sequences
from rlhf_core.algos.experience import Experience
from rlhf_core.algos.logprob_gap import engine_logprob_tensor, rollout_logprob_gap
from rlhf_core.algos.ppo import KL_ESTIMATORS, approx_kl
from rlhf_core.config import as_ppo, load_config
from rlhf_core.distributed.cluster import LocalCluster, LocalWorkerGroup
from rlhf_core.distributed.placement import RoleSet, resource_demand, role_workers
from rlhf_core.jobs import ppo, stage_setup
from rlhf_core.jobs.ppo.controller import PPOController, PPOInputs
from rlhf_core.jobs.ppo.evaluation import HeldOut
from rlhf_core.jobs.ppo.experience import advantages
from rlhf_core.jobs.ppo.old_logprobs import old_logprobs_source
from rlhf_core.models.builders import load_tokenizer
from rlhf_core.rewards import RewardSources, Scored
from rlhf_core.storage import ObjectStore
from tests.conftest import TINY

MODEL = "builtin:tiny"  # every role's model: no upstream stage needed


class Seen(LocalWorkerGroup):
    """A one-rank group that keeps the shards its rank was given."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def call_each(self, method, shards, *args, **kwargs):
        self.seen.extend(shards)
        return super().call_each(method, shards, *args, **kwargs)


class Recording(LocalCluster):
    group_class = Seen


@pytest.fixture
def start(tmp_path):
    """``start(stage, *overrides)``: the stage's controller as ppo.run builds it, from inputs made here (16 short
    prompts, no held-out ones, the reward model's raw scores as the only source) and every model builtin:tiny, started
    on a Recording cluster; shut down after the test."""
    made = []

    def build(stage: str, *overrides: str) -> PPOController:
        cfg = load_config(TINY, [f"run_uri={tmp_path / 'run'}", *overrides])
        p, train_actor = as_ppo(cfg.stage(stage)), cfg.kind(stage) == "ppo"
        models = dict.fromkeys(("actor", "critic", "reward", "reference"), MODEL)
        store, work = ObjectStore(str(tmp_path / "run")), str(tmp_path / "work")
        setup = stage_setup.StageSetup(
            stage, p, store, work, models, {}, "test", None, sources=dict(models), kind=stage
        )
        prompts = [{"prompt": f"prompt {i}", "prompt_ids": [5 + i, 6, 7]} for i in range(16)]
        inputs = PPOInputs(load_tokenizer(MODEL), prompts, HeldOut([]), RewardSources(weights={"reward": 1.0}))
        controller = PPOController(stage, p, setup, train_actor, RoleSet.of(p, train_actor), inputs, Recording())
        made.append(controller)
        controller.start()
        return controller

    yield build
    for controller in made:
        controller.shutdown()


def test_truncated_responses_are_scored_with_eos_and_penalised_before_the_clip(start):
    # the clip and the penalty of the advantage phase (the earlier phases do not read them)
    controller = start("ppo", "ppo.algo.missing_eos_penalty=-1.0", "ppo.algo.reward_clip=[-1.2,1.2]")
    eos = controller.eos_id
    prompts = [[5, 6, 7], [8, 9]]
    responses = [[20, 21, 22, 23], [24, 25, 26, 27, 28, 29], [30, 31, eos], [32, eos]]  # 2 per prompt: 2 cut
    timer = timing.PhaseTimer()
    scored = controller.experience_maker().make(prompts, responses, ["first", "second"], timer)
    exp = scored.exp
    expanded = [p for p in prompts for _ in range(2)]
    # each role's forward is timed (in-process roles: their results are ready when their calls return)
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
    exp = dataclasses.replace(exp, scores=normalised)
    out, logs = advantages(Scored(exp, scored.parts), controller.p, controller.kl_ctl.value)
    assert isinstance(out, Experience) and exp.advantages is None and out.advantages is not None
    expected = (normalised - truncated.float()).clamp(-1.2, 1.2)
    assert logs["reward"] == pytest.approx(expected.mean().item(), abs=1e-6)
    assert logs["truncated_frac"] == 0.5 and logs["rm_score"] == pytest.approx(scored.parts["reward"].mean().item())
    # the reward of each row sits on its last action token: the returns there (GAE's advantage plus the critic's
    # value); actor and reference are the same model, so no KL penalty moves them
    last = sampled.action_mask.cumsum(1).argmax(1)
    assert (out.returns.gather(1, last[:, None]).squeeze(1) - expected).abs().max() < 1e-5


def test_the_critic_warmups_frozen_actor_is_its_own_reference(start, tmp_path):
    """The critic warm-up with ``reference`` null builds no reference group (nor asks Ray for one): its actor never
    trains, so the actor's old log-probs are the reference's, the KL (any estimator) and its penalty exactly 0, and
    the KL metrics stay, at 0.0. A reference of its own is built, and so is the PPO stage's, also with frozen
    warm-up steps (its actor trains after them)."""
    cfg = load_config(TINY, [f"run_uri={tmp_path}", "ppo.train.freeze_actor_steps=1"])
    warmup, stage = as_ppo(cfg.stage("critic_warmup")), cfg.stage("ppo")
    assert warmup.reference.model is None and warmup.algo.needs_kl
    frozen_roles, stage_roles = RoleSet.of(warmup, train_actor=False), RoleSet.of(stage, train_actor=True)
    assert not frozen_roles.reference and role_workers(warmup, frozen_roles)["reference"] == 0
    own = dataclasses.replace(warmup.reference, model=warmup.actor.model)
    assert RoleSet.of(dataclasses.replace(warmup, reference=own), train_actor=False).reference
    assert stage_roles.reference and role_workers(stage, stage_roles)["reference"] == stage.reference.workers
    frozen = resource_demand(warmup, frozen_roles, "cuda")
    trained = resource_demand(warmup, RoleSet.of(warmup), "cuda")
    assert trained["CPU"] - frozen["CPU"] == warmup.frozen.cpus_per_worker and trained["GPU"] - frozen["GPU"] == 1

    controller = start("critic_warmup", "critic_warmup.algo.kl_coef=0.5")
    assert controller.reference is None and controller.ref_from_actor and controller.kl_ctl.value == 0.5
    eos = controller.eos_id
    responses = [[20, 21, eos], [22, 23, 24, 25], [26, eos], [27, 28, 29]]
    scored = controller.experience_maker().make([[5, 6, 7], [8, 9]], responses, ["first", "second"])
    exp = scored.exp
    assert exp.ref_logprobs is exp.old_logprobs
    for estimator in KL_ESTIMATORS:
        kl = approx_kl(exp.old_logprobs, exp.ref_logprobs, exp.action_mask, estimator)
        assert torch.equal(kl, torch.zeros_like(exp.old_logprobs)), estimator
    out, logs = advantages(scored, controller.p, controller.kl_ctl.value)
    assert logs["kl"] == 0.0 and logs["kl_token_mean"] == 0.0
    controller.kl_ctl.load_state_dict(
        {"value": 0.0}
    )  # no penalty at all: the same advantages and returns, bit for bit
    unpenalised, _ = advantages(scored, controller.p, controller.kl_ctl.value)
    assert torch.equal(out.advantages, unpenalised.advantages) and torch.equal(out.returns, unpenalised.returns)


# -- the order of the start, and the engines' work outside a rollout ------------------------------------------------
class Stop(Exception):
    """Ends a controller's start at its first role group: the order up to there is what the test reads."""


class StartOrder(LocalCluster):
    """A cluster that declares GPUs and records when the controller starts the engines, waits for them, puts them to
    sleep and loads the first role (where the record ends)."""

    def __init__(self):
        super().__init__(resources={"CPU": math.inf, "GPU": 8.0}, device="cuda")
        self.events = []

    def engines(self, count, model_path, **kwargs):
        self.events.append("engines start")
        return SimpleNamespace(
            wait_ready=lambda: self.events.append("engines ready"),
            sleep=lambda: self.events.append("engines asleep"),
            shutdown=lambda: None,
        )

    def group(self, strategy, cls, *args, **kwargs):
        self.events.append(f"{cls.__name__} loads")
        raise Stop


def start_order(tmp_path, *overrides: str) -> list[str]:
    cfg = load_config(TINY, [f"run_uri={tmp_path / 'run'}", *overrides])
    p = as_ppo(cfg.stage("ppo"))
    models = dict.fromkeys(("actor", "critic", "reward", "reference"), MODEL)
    setup = stage_setup.StageSetup(
        "ppo", p, ObjectStore(str(tmp_path / "run")), str(tmp_path), models, {}, "test", None, sources=dict(models)
    )
    prompts = [{"prompt": f"prompt {i}", "prompt_ids": [5 + i, 6, 7]} for i in range(16)]
    inputs = PPOInputs(load_tokenizer(MODEL), prompts, HeldOut([]), RewardSources(weights={"reward": 1.0}))
    cluster = StartOrder()
    controller = PPOController("ppo", p, setup, True, RoleSet.of(p, True), inputs, cluster)
    with pytest.raises(Stop):
        controller.start()
    controller.shutdown()
    return cluster.events


def test_sleeping_engines_are_up_and_asleep_before_any_role_loads_its_model(tmp_path):
    # The hybrid engine on GPUs (the 1-GPU preset's layout): vLLM measures the free GPU memory while it starts, so the
    # roles sharing its GPUs load only once it is up and asleep.
    hybrid = ("ppo.rollout.backend=vllm", "ppo.rollout.enable_sleep=true", "ppo.placement.colocate_all=true")
    events = start_order(tmp_path, *hybrid)
    assert events == ["engines start", "engines ready", "engines asleep", "PolicyActor loads"]
    # Engines that never sleep start beside the roles, as before: their start-up overlaps the roles' set-up.
    assert start_order(tmp_path) == ["engines start", "PolicyActor loads"]


class Offloads(LocalWorkerGroup):
    """A one-rank group that records when the trained roles' states go to host memory and come back."""

    events: list[str] = []

    def call_async(self, method, *args, **kwargs):
        if method.__name__ in ("offload_states", "reload_states"):
            self.events.append(method.__name__)
        return super().call_async(method, *args, **kwargs)


class EngineCalls(LocalCluster):
    """The in-process cluster, with every engine call the controller makes recorded beside the roles' offloads."""

    group_class = Offloads

    def engines(self, *args, **kwargs):
        group = super().engines(*args, **kwargs)
        events = Offloads.events

        class Recorded:
            def __getattr__(self, name):
                attr = getattr(group, name)
                if name in ("generate", "generate_with_logprobs", "sequence_logprobs", "sleep") and callable(attr):
                    return lambda *a, **k: (events.append(name), attr(*a, **k))[1]
                return attr

        return Recorded()


def test_the_probes_and_evaluations_run_with_the_training_states_offloaded(tmp_path, monkeypatch):
    """With placement.offload_states_during_rollout, the engines' work outside a rollout (the sync probes at the
    start and the end, the evaluations before and after training) happens as a rollout does: the trained roles'
    states in host memory first, the engines put back to sleep after, the states reloaded."""
    monkeypatch.setattr(Offloads, "events", [])
    cfg = load_config(
        TINY,
        [
            f"run_uri={tmp_path / 'run'}",
            *(f"ppo.{role}.model.name_or_path={MODEL}" for role in ("actor", "critic", "reward")),
            "ppo.algo.normalize_reward=false",  # a builtin reward model has no stored statistics
            "ppo.placement.offload_states_during_rollout=true",
            "ppo.train.max_steps=1",
            "ppo.train.eval_prompts=4",
        ],
    )
    ppo.run(cfg, "ppo", cluster=EngineCalls())
    events = Offloads.events
    work = [i for i, e in enumerate(events) if e in ("generate", "generate_with_logprobs", "sequence_logprobs")]
    assert [events[i] for i in work] == ["sequence_logprobs", "generate", "generate_with_logprobs", "generate"] + [
        "sequence_logprobs"
    ]
    for i in work:  # each engine call comes while the states of both trained roles (actor, critic) are offloaded
        before = events[:i]
        assert before.count("offload_states") - before.count("reload_states") == 2, (i, events)


# -- the old log-probs of a batch of one optimizer step: the training forward's -------------------------------------
ONE_STEP = (  # 2 prompts x 2 samples = train_batch_size: one optimizer step; the KL in the loss, not the rewards
    "ppo.train.rollout_batch_size=2",
    "ppo.train.train_batch_size=4",
    "ppo.train.micro_train_batch_size=2",
    "ppo.train.micro_rollout_batch_size=2",
    "ppo.algo.kl_mode=loss",
    "ppo.algo.kl_loss_unbiased=true",
    "ppo.algo.is_correction=tis",
    "ppo.reference.model.name_or_path=builtin:tiny",  # weights of another seed: a KL to the reference above 0
    "ppo.reference.model.init_seed=11",
)


def test_a_batch_of_one_optimizer_step_runs_no_old_logprob_forward_and_trains_alike(start):
    """The same step twice from the same weights: with the actor's old-log-prob forward, and as fit() runs it (no
    forward: the training forward's log-probs, detached). The loss, every gradient, the KL to the reference, the IS
    correction's statistics and the engine gap agree within 1e-6; the actor's model runs no experience forward."""
    prompts, texts = [[5, 6, 7], [8, 9]], ["first", "second"]
    runs = {}
    for old in ("forward", "training"):
        c = start("ppo", *ONE_STEP)
        assert old_logprobs_source(c.p, actor_frozen=False, ref_from_actor=c.ref_from_actor) == "training"
        eos, actor = c.eos_id, c.actor.obj
        responses = [[20, 21, eos], [22, 23, 24, 25], [26, eos], [27, 28, 29]]
        if not runs:  # the engines' log-probs: the starting actor's, 0.3 off in turn (IS weights e^+-0.3)
            seq = make_sequences([p for p in prompts for _ in range(2)], responses, c.pad_id)
            lp = actor.logprobs(seq)
            engine = [
                [lp[i, t].item() + 0.3 * (-1) ** t for t in seq.action_mask[i].nonzero().flatten()] for i in range(4)
            ]
        module = actor.engine.module
        forwards: list[int] = []
        hook = module.register_forward_pre_hook(lambda *_, seen=forwards: seen.append(1))
        scored = c.experience_maker().make(prompts, responses, texts, timing.PhaseTimer(), old, engine)
        hook.remove()
        calls = len(c.actor.seen)  # the shards the actor group was given, for the old-log-prob forward
        exp, logs = advantages(scored, c.p, c.kl_ctl.value, engine_logprob_tensor(scored.exp, engine))
        logs.update(scored.logs)
        grads: dict[str, torch.Tensor] = {}
        hooks = [
            p.register_hook(lambda g, n=n, out=grads: out.__setitem__(n, g.detach().clone()))
            for n, p in module.named_parameters()
            if p.requires_grad
        ]
        stats = c.train(exp, 0, actor_frozen=False)
        for h in hooks:
            h.remove()
        if old == "forward":
            logs["rollout_logprob_max_diff"] = rollout_logprob_gap(
                scored.exp, engine_logprob_tensor(scored.exp, engine)
            )
        runs[old] = {"forwards": len(forwards), "seen": calls, "logs": {**logs, **stats}, "grads": grads}
    forward, training = runs["forward"], runs["training"]
    assert forward["forwards"] == 2 and forward["seen"] == 1  # two micro-batches of 2 rows
    assert training["forwards"] == 0 and training["seen"] == 0
    assert forward["logs"]["old_logprob_forward_rows"] == 4 and training["logs"]["old_logprob_forward_rows"] == 0
    keys = ("policy_loss", "kl_loss", "kl", "kl_token_mean", "is_clipped_frac", "rollout_logprob_max_diff")
    for key in keys:
        assert training["logs"][key] == pytest.approx(forward["logs"][key], abs=1e-6), key
    assert forward["logs"]["kl"] > 0 and forward["logs"]["rollout_logprob_max_diff"] == pytest.approx(0.3, abs=1e-5)
    assert forward["grads"].keys() == training["grads"].keys() and forward["grads"]
    for name, grad in forward["grads"].items():
        torch.testing.assert_close(training["grads"][name], grad, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize(
    ("overrides", "forward_rows", "engine"),
    [
        (("ppo.train.train_batch_size=32", "ppo.algo.kl_mode=loss"), 0.0, 0.0),  # one step: no forward
        (("ppo.algo.use_rollout_logprobs=true",), 8.0, 1.0),  # two steps: the engines', one micro-batch probed
    ],
)
def test_each_step_logs_where_its_old_logprobs_came_from(tmp_path, overrides, forward_rows, engine):
    """The stage in this process (tiny: 16 prompts x 2 samples, train_batch_size 16, micro-batches of 8): a batch
    of one optimizer step runs no old-log-prob forward and the actor measures the engine gap and the KL; with
    use_rollout_logprobs the HF engine's log-probs (the actor's numerics on CPU) pass the probe."""
    cfg = load_config(
        TINY,
        [
            f"run_uri={tmp_path / 'run'}",
            *(f"ppo.{role}.model.name_or_path={MODEL}" for role in ("actor", "critic", "reward")),
            "ppo.reference.model.name_or_path=builtin:tiny",
            "ppo.reference.model.init_seed=11",
            "ppo.algo.normalize_reward=false",
            "ppo.train.max_steps=2",
            "ppo.train.eval_prompts=0",
            *overrides,
        ],
    )
    ppo.run(cfg, "ppo", cluster=LocalCluster())
    history = ObjectStore(str(tmp_path / "run")).read_json(run_layout.metrics("ppo"))["history"]
    assert len(history) == 2
    for entry in history:
        assert entry["old_logprob_forward_rows"] == forward_rows and entry["old_logprobs_engine"] == engine
        if forward_rows == 0:
            assert entry["timing/experience_actor_s"] == 0.0
        assert 0 <= entry["rollout_logprob_max_diff"] < 1e-3 and entry["kl_token_mean"] > 0, entry
