"""PPO stage: a single controller driving actor, critic, reward and reference Ray groups and rollout engines.

After OpenRLHF's design: the actor (policy, DeepSpeed) starts from ``ppo.actor`` (usually ``stage:sft``), the critic
from ``ppo.critic`` (``stage:critic_warmup`` or ``stage:critic_init``), the reward model and the reference policy
are frozen. Each PPO step reads like its phases:

  1. rollout      the engines (vLLM, or HF generate) sample n responses per prompt, with the log-prob of each
                  sampled token (checked against the actor's: ``rollout_logprob_max_diff``)
  2. experience   a typed ``Experience``: actor and reference log-probs (logits / rollout temperature), critic values
                  (on the normalised reward scale), reward-model scores of prompt + response + EOS where it was cut
  3. advantages   normalised, missing-EOS-penalised and clipped scores, token-level KL penalty, GAE; returns a new
                  ``Experience`` with advantages and returns
  4. PPO epochs   actor (clipped policy loss, advantages whitened across all actor ranks) and critic together, each on
                  ``exp.shard(n)``, token-mean losses over each gradient-accumulation window
  5. weight sync  the actor's new weights go to the engines over a collective group (no disk)
  6. logging      (and a ``step`` event, ``rlhf_core.events``) and, every ``save_steps``, a checkpoint of actor,
                  critic and controller state

Every step logs its phases' wall seconds as ``timing/<phase>_s`` (``step_phases``; OpenRLHF's ``timing/*``):
generation, experience (and each role's forward, ``experience_<role>``), advantages, train (``critic_train``,
``actor_train``), weight_sync, checkpoint, and ``timing/step_s``, the whole step. They are in the step line, the
``step`` event and ``metrics.json``'s history; the final metrics add each phase's mean and total over the steps
(``timing/<phase>_s_mean``, ``timing/<phase>_s_total``, ``rlhf_core.timing.summarize``).

``algo.advantage_estimator`` (``rlhf_core.algos.advantages``): ``gae`` uses the critic; the critic-free estimators
(``reinforce++``, ``reinforce++_baseline``, ``grpo``, ``rloo``, ``dr_grpo``) start no critic group and write no critic:
the advantage is the return of the group-shaped reward. Rewards are the weighted sum (``reward_weights``) of a reward
model (``reward``), a Python reward function (``reward_fn``, on the driver, which may also drop samples) and a remote
reward server (``remote_rm_url``, ``rlhf_core.rewards``); at least one is given. No reward-model group is built
without ``reward``. No reference policy is built when ``algo.kl_coef`` = 0 and there is no ``algo.kl_target`` (no
KL, neither as a reward penalty nor as a loss term, ``algo.kl_mode``), nor in the critic warm-up with ``reference``
null: its frozen actor is the reference throughout (its old log-probs stand for the reference's, the KL is 0), and
it has no optimizer.
Roles are called through typed handles: ``group.call(PolicyActor.export, ...)``, never by method name.

Writes ``<run_uri>/ppo/`` (the policy, Hugging Face format), ``<run_uri>/ppo/critic/`` (with a critic) and
``<run_uri>/ppo/metrics.json``. The critic warm-up stage runs this same loop with the actor frozen throughout.

    python -m rlhf_core.jobs.ppo --config deployments/configs/tiny.yaml
    python -m rlhf_core.jobs.ppo --config deployments/configs/tiny.yaml ppo.rollout.backend=hf ppo.train.max_steps=4
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from rlhf_core import curves, events, timing
from rlhf_core.algos.advantages import cumulative_returns, shape_scores, varied_groups
from rlhf_core.algos.batching import ensure_eos, make_sequences
from rlhf_core.algos.experience import Experience
from rlhf_core.algos.losses import masked_mean
from rlhf_core.algos.ppo import (
    apply_missing_eos_penalty,
    approx_kl,
    clip_scores,
    gae,
    make_kl_controller,
    normalize_scores,
    token_rewards,
    truncated_is_weights,
)
from rlhf_core.config import (
    ConfigError,
    ModelConfig,
    PipelineConfig,
    PPOAlgoConfig,
    PPOConfig,
    RolloutConfig,
    StrategyConfig,
    TrainConfig,
    reward_sources,
)
from rlhf_core.data.examples import prompt_examples
from rlhf_core.data.sampler import global_batch
from rlhf_core.distributed import launcher
from rlhf_core.distributed.actor import PolicyActor
from rlhf_core.distributed.critic import CriticActor
from rlhf_core.distributed.device import resolve_device
from rlhf_core.distributed.reference import ReferencePolicy
from rlhf_core.distributed.reward import RewardScorer
from rlhf_core.distributed.role_base import RoleContext, TrainableRole
from rlhf_core.distributed.trainer import checkpoint_rel, newest_checkpoint, prune_checkpoints, write_entry
from rlhf_core.distributed.weight_sync import resolve_backend
from rlhf_core.jobs import common
from rlhf_core.models.builders import BUILTIN_PREFIX, load_tokenizer
from rlhf_core.rewards import RemoteRewardModel, call_reward_fn_with_mask, load_reward_fn
from rlhf_core.storage import ObjectStore
from rlhf_core.tracking import Tracker
from rlhf_core.types import CheckpointRef

KIND = "ppo"
# The phases of a step that run one after the other (their timing/<phase>_s add up to at most timing/step_s); the
# others in ``PPOController.step_phases`` run concurrently within experience and train.
SEQUENTIAL_PHASES = ("offload_states", "generation", "experience", "advantages", "train", "weight_sync", "checkpoint")


# ---------------------------------------------------------------------------------------------------------------------
# Checks made before any Ray actor starts


def plan_steps(p: PPOConfig, num_prompts: int) -> int:
    steps = num_prompts * p.train.num_episodes // p.train.rollout_batch_size
    return min(steps, p.train.max_steps) if p.train.max_steps is not None else steps


def optimizer_steps(p: PPOConfig, ppo_steps: int) -> int:
    samples = p.train.rollout_batch_size * p.rollout.n_samples_per_prompt
    return ppo_steps * samples // p.train.train_batch_size * p.algo.ppo_epochs


def needs_kl(a: PPOAlgoConfig) -> bool:
    """A KL to the reference policy, as a reward penalty or a loss term: none when kl_coef = 0 and no adaptive target
    (as OpenRLHF)."""
    return a.kl_coef > 0 or a.kl_target is not None


def actor_is_reference(p: PPOConfig, train_actor: bool) -> bool:
    """The policy is the reference at every step: the actor never trains (the critic warm-up) and the reference is its
    starting model (``reference`` null). The actor's old log-probs are then the reference's, and the KL is 0."""
    return not train_actor and p.reference is None


def needs_reference(p: PPOConfig, train_actor: bool) -> bool:
    """A reference group: for a KL (``needs_kl``) to a policy other than the frozen actor (``actor_is_reference``)."""
    return needs_kl(p.algo) and not actor_is_reference(p, train_actor)


def reference_workers(p: PPOConfig, train_actor: bool = True) -> int:
    return p.reference_workers if needs_reference(p, train_actor) else 0


def critic_workers(p: PPOConfig) -> int:
    """Critic ranks: none for the critic-free estimators (no ``critic`` model; validation pairs it with gae)."""
    return p.critic_strategy.num_workers if p.critic is not None else 0


def reward_workers(p: PPOConfig) -> int:
    """Reward-model workers: none when the rewards come only from a function or a remote server."""
    return p.reward_workers if p.reward is not None else 0


def resource_demand(p: PPOConfig, device: str, train_actor: bool = True) -> dict[str, float]:
    """Ray resources the roles and engines ask for (colocated roles share their partner's devices). ``train_actor``:
    False for the critic warm-up (``run``)."""
    a, c = p.actor_strategy, p.critic_strategy
    ref_workers = reference_workers(p, train_actor)
    cpus = a.num_workers * a.cpus_per_worker + critic_workers(p) * c.cpus_per_worker
    cpus += (reward_workers(p) + ref_workers) * p.frozen_cpus_per_worker
    cpus += p.rollout.num_engines * p.rollout.cpus_per_engine
    demand = {"CPU": cpus}
    if device == "cuda":
        gpus = a.num_workers + critic_workers(p) + p.rollout.num_engines * p.rollout.tensor_parallel_size
        gpus += 0 if (p.colocate_actor_ref or p.colocate_all) else ref_workers
        gpus += 0 if (p.colocate_critic_reward or p.colocate_all) else reward_workers(p)
        if p.colocate_all:  # every role and engine in the actor's bundles (check_fits: the engines' GPUs fit there)
            gpus = a.num_workers
        demand["GPU"] = gpus
    if p.colocate_all:  # one bundle of 1 CPU per actor rank, shared by all roles and the engines
        demand["CPU"] = a.num_workers
    for workers, _, resources in pinned_groups("", p, train_actor).values():  # custom resources: pins to nodes
        for name, amount in resources.items():
            demand[name] = demand.get(name, 0.0) + workers * amount
    return demand


def pinned_groups(
    stage: str, p: PPOConfig, train_actor: bool = True
) -> dict[str, tuple[int, float, dict[str, float]]]:
    """{config key: (workers, CPUs per worker, Ray custom resources per worker)} of each group that asks for any."""
    a, c, r = p.actor_strategy, p.critic_strategy, p.rollout
    frozen = p.frozen_cpus_per_worker
    groups = {
        f"{stage}.actor_strategy.resources": (a.num_workers, a.cpus_per_worker, a.resources),
        f"{stage}.critic_strategy.resources": (critic_workers(p), c.cpus_per_worker, c.resources),
        f"{stage}.reward_resources": (reward_workers(p), frozen, p.reward_resources),
        f"{stage}.reference_resources": (reference_workers(p, train_actor), frozen, p.reference_resources),
        f"{stage}.rollout.resources": (r.num_engines, r.cpus_per_engine, r.resources),
    }
    return {key: group for key, group in groups.items() if group[0] and group[2]}


def weight_sync_backend(stage: str, p: PPOConfig, device: str) -> str:
    """The actor -> engine transport on ``device`` (``rollout.weight_sync_backend`` resolved: auto = cuda_ipc with
    colocate_all on GPU, nccl on GPU, else gloo); a GPU transport on a CPU run is refused naming the key."""
    return resolve_backend(
        p.rollout.weight_sync_backend, device, p.colocate_all, key=f"{stage}.rollout.weight_sync_backend"
    )


def check_fits(
    stage: str, p: PPOConfig, device: str, available: dict[str, float], nodes: list[dict[str, float]] | None = None,
    train_actor: bool = True,
) -> None:  # fmt: skip
    """Refuse a layout that the cluster cannot place, naming what each role asks for. ``nodes``: each alive node's
    resources, for the custom resources that pin roles (default: ``available`` taken as one node). ``train_actor``:
    False for the critic warm-up (``run``)."""
    r = p.rollout
    weight_sync_backend(stage, p, device)
    if r.enable_sleep and device != "cuda":
        raise ConfigError(
            f"'{stage}.rollout.enable_sleep' needs a GPU: vLLM sleep mode is CUDA-only (device {device})"
        )
    if p.colocate_all and r.num_engines * r.tensor_parallel_size > p.actor_strategy.num_workers:
        raise ConfigError(
            f"'{stage}.rollout.num_engines' x tensor_parallel_size = {r.num_engines * r.tensor_parallel_size} "
            f"exceeds the {p.actor_strategy.num_workers} actor bundles that '{stage}.colocate_all' shares"
        )
    if p.offload_states_during_rollout:
        for role in ("actor", "critic") if p.critic is not None else ("actor",):
            s = getattr(p, f"{role}_strategy")
            if s.zero_stage == 0:  # DeepSpeed's offload_states is a method of its ZeRO-1/2/3 optimizers only
                raise ConfigError(
                    f"'{stage}.offload_states_during_rollout' needs ZeRO stage 1, 2 or 3: "
                    f"'{stage}.{role}_strategy.zero_stage' is 0"
                )
    pinned = pinned_groups(stage, p, train_actor)
    bundled = {  # roles placed in a colocation bundle: the bundle decides their node
        f"{stage}.actor_strategy.resources": p.colocate_all or p.colocate_actor_ref,
        f"{stage}.reference_resources": p.colocate_all or p.colocate_actor_ref,
        f"{stage}.critic_strategy.resources": p.colocate_all or p.colocate_critic_reward,
        f"{stage}.reward_resources": p.colocate_all or p.colocate_critic_reward,
    }
    for key in pinned:
        if bundled.get(key):
            raise ConfigError(f"'{key}' pins a colocated role, whose placement-group bundle decides its node: unset "
                              "it or the colocate_* key that places it")  # fmt: skip
    launcher.check_resources(pinned, nodes if nodes is not None else [available])
    demand = resource_demand(p, device, train_actor)
    for resource, needed in demand.items():
        have = available.get(resource, 0)
        if needed > have:
            raise ConfigError(
                f"{stage}: the roles need {needed:g} {resource} but the Ray cluster has {have:g} "
                f"(actor {p.actor_strategy.num_workers}, critic {critic_workers(p)}, reward "
                f"{reward_workers(p)}, reference {reference_workers(p, train_actor)}, {p.rollout.num_engines} "
                f"engine(s) x tensor_parallel_size {p.rollout.tensor_parallel_size}); lower "
                f"'{stage}.rollout.num_engines' or the worker counts"
            )


def reward_stats(stage: str, p: PPOConfig, reward_path: str | None) -> tuple[float, float] | None:
    """(mean, std) stored by the reward-model stage; refused when normalisation is on and they are missing. None
    without a reward model (a function's or a server's scores are used as they come)."""
    if not p.algo.normalize_reward or p.reward is None or reward_path is None:
        return None
    if not reward_path.startswith(BUILTIN_PREFIX):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(reward_path, trust_remote_code=p.reward.trust_remote_code)
        mean, std = getattr(config, "reward_mean", None), getattr(config, "reward_std", None)
        if mean is not None and std is not None:
            return float(mean), float(std)
    raise ConfigError(
        f"'{stage}.reward.name_or_path' = {p.reward.name_or_path} has no stored reward_mean/reward_std, but "
        f"'{stage}.algo.normalize_reward' is on: use a reward-model stage output or set it to false"
    )


def load_gold(spec: str | None, key: str = "train.gold_reward") -> Callable[[str, str], float] | None:
    """The gold-reward function ``module:function`` (None for None); a ConfigError naming ``key`` when it cannot be
    imported."""
    if spec is None:
        return None
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"'{key}' = {spec!r} cannot be imported ({e})") from None


def engine_kwargs(
    r: RolloutConfig, model: ModelConfig, precision: str, device: str, seed: int, max_len: int
) -> dict[str, Any]:
    """Constructor kwargs of the rollout engines (``create_engines``) for ``r.backend``, sampling the policy ``model``
    (its tokenizer, remote code, and for the HF backend its build seed) in ``precision`` on ``device``: the PPO
    engines and the generate stage's."""
    kwargs: dict[str, Any] = {"seed": seed, "tokenizer": model.tokenizer, "trust_remote_code": model.trust_remote_code}
    kwargs["dtype"] = "bfloat16" if precision == "bf16" else "float32"
    if r.backend == "vllm":
        eager = (device != "cuda") if r.enforce_eager is None else r.enforce_eager  # null: eager on CPU only
        kwargs.update(max_model_len=max_len + r.max_new_tokens, kv_cache_gib=r.kv_cache_gib,
                      gpu_memory_utilization=r.gpu_memory_utilization, enable_sleep=r.enable_sleep,
                      enforce_eager=eager)  # fmt: skip
    else:  # a builtin: policy is built, not loaded: the engine must build it with the policy's seed
        kwargs["init_seed"] = model.init_seed
    return kwargs


# What each reward source's mean score is logged as (steps, evaluation, metrics.json).
SOURCE_LOGS = {"reward": "rm_score", "reward_fn": "reward_fn_score", "remote_rm_url": "remote_rm_score"}


@dataclasses.dataclass
class Scored:
    """A step's experience with each reward source's raw (B,) scores and the reward function's keep mask (or
    None)."""

    exp: Experience
    parts: dict[str, torch.Tensor]
    keep: torch.Tensor | None = None


# ---------------------------------------------------------------------------------------------------------------------
# The controller


class PPOController:
    def __init__(self, stage: str, p: PPOConfig, st: common.StageSetup, train_actor: bool):
        self.stage, self.p, self.st, self.paths, self.train_actor = stage, p, st, st.paths, train_actor
        self.store: ObjectStore = st.store
        self.tokenizer = load_tokenizer(
            st.paths["actor"], p.actor.tokenizer, trust_remote_code=p.actor.trust_remote_code
        )
        self.pad_id, self.eos_id = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        options = self.store.fs.storage_options
        self.prompts = prompt_examples(p.data, self.tokenizer, "train", options)
        self.eval_prompts = (
            prompt_examples(p.data, self.tokenizer, "eval", options, max_rows=p.train.eval_prompts)
            if p.train.eval_prompts > 0 else []
        )  # fmt: skip
        self.steps = plan_steps(p, len(self.prompts))
        if self.steps == 0:
            raise ConfigError(
                f"'{stage}.train.rollout_batch_size' = {p.train.rollout_batch_size} is larger than the "
                f"{len(self.prompts)} prompts x {p.train.num_episodes} episodes: no PPO step would run"
            )
        self.stats = reward_stats(stage, p, st.paths.get("reward"))
        self.gold = load_gold(p.train.gold_reward)
        self.reward_fn = load_reward_fn(p.reward_fn, f"{stage}.reward_fn") if p.reward_fn is not None else None
        self.remote: RemoteRewardModel | None = None
        if p.remote_rm_url is not None:
            rm = p.remote_rm
            self.remote = RemoteRewardModel(
                p.remote_rm_url, f"{stage}.remote_rm_url", timeout_s=rm.timeout_s, retries=rm.retries,
                backoff_s=rm.backoff_s, batch_size=rm.batch_size,
            )  # fmt: skip
        self.weights = {key: p.reward_weights.get(key, 1.0) for key in reward_sources(p)}
        self.check_reward_sources()
        self.kl_ctl = make_kl_controller(p.algo.kl_coef, p.algo.kl_target, p.algo.kl_horizon)
        # The critic warm-up's frozen actor is its own reference: its old log-probs are the reference's (no group).
        self.ref_from_actor = needs_kl(p.algo) and actor_is_reference(p, train_actor)
        self.device = resolve_device(p.actor_strategy.device)
        # PPO steps in which the actor trains: its LR schedule spans only those (the frozen warm-up steps do not
        # count, so a decaying schedule completes on the last step).
        self.actor_ppo_steps = max(0, self.steps - p.train.freeze_actor_steps) if train_actor else 0
        self.actor: launcher.RayWorkerGroup[PolicyActor] | None = None
        self.critic: launcher.RayWorkerGroup[CriticActor] | None = None
        self.reward: launcher.RayWorkerGroup[RewardScorer] | None = None
        self.reference: launcher.RayWorkerGroup[ReferencePolicy] | None = None
        self.engines: Any = None
        self.placement: dict[str, Any] = {}
        self.placement_groups: list[Any] = []
        self.started_ray = False
        self.tracker = Tracker(None)  # run() opens the stage's trackers around fit()

    @property
    def roles(self) -> dict[str, int]:
        """Workers per role (0 = the role was not built), and rollout engines."""
        groups = {"actor": self.actor, "critic": self.critic, "reward": self.reward, "reference": self.reference}
        counts = {role: len(g) if g is not None else 0 for role, g in groups.items()}
        return {**counts, "engines": self.p.rollout.num_engines}

    def check_reward_sources(self) -> None:
        """Before any worker starts: the reward function answers a probe of two train prompts (empty responses) in
        the expected shape, and the remote reward server answers (``RemoteRewardModel.check``)."""
        if self.reward_fn is not None:
            prompts = [e["prompt"] for e in self.prompts[:2]]
            call_reward_fn_with_mask(self.reward_fn, self.p.reward_fn or "", f"{self.stage}.reward_fn", prompts,
                                     [""] * len(prompts))  # fmt: skip
        if self.remote is not None:
            self.remote.check()

    # -- set-up -------------------------------------------------------------------------------------------------------
    def start(self) -> None:
        from rlhf_core.distributed.rollout_engine import EngineGroup, create_engines

        p, t = self.p, self.p.train
        demand = resource_demand(p, self.device, self.train_actor)
        self.started_ray = launcher.init_ray(min_cpus=demand["CPU"])
        check_fits(self.stage, p, self.device, launcher.cluster_resources(), launcher.node_resources(),
                   train_actor=self.train_actor)  # fmt: skip

        base = dict(
            stage=self.stage, micro_rollout_batch_size=t.micro_rollout_batch_size, algo=p.algo, seed=t.seed,
            run_uri=self.store.root_uri, storage_options=self.store.fs.storage_options, work_dir=self.st.work,
            batch=TrainConfig(train_batch_size=t.train_batch_size, micro_train_batch_size=t.micro_train_batch_size),
            temperature=p.rollout.temperature,
        )  # fmt: skip
        actor_ctx = RoleContext(
            role="actor", model_path=self.st.sources["actor"], tokenizer_path=p.actor.tokenizer,
            init_seed=p.actor.init_seed, trust_remote_code=p.actor.trust_remote_code, strategy=p.actor_strategy,
            optim=p.actor_optim, total_optimizer_steps=optimizer_steps(p, self.actor_ppo_steps),
            max_new_tokens=p.rollout.max_new_tokens, trains=self.train_actor, **base,
        )  # fmt: skip
        critic_ctx = None
        if p.critic is not None:
            critic_ctx = RoleContext(
                role="critic", model_path=self.st.sources["critic"], tokenizer_path=p.critic.tokenizer,
                init_seed=p.critic.init_seed, trust_remote_code=p.critic.trust_remote_code,
                strategy=p.critic_strategy, optim=p.critic_optim, total_optimizer_steps=optimizer_steps(p, self.steps),
                reward_stats=self.stats, **base,
            )  # fmt: skip

        def frozen(n: int, resources: dict[str, float]) -> StrategyConfig:
            # the actor's strategy with the frozen role's own counts and pins (never the actor's nodes)
            return replace(p.actor_strategy, num_workers=n, cpus_per_worker=p.frozen_cpus_per_worker,
                           resources=resources)  # fmt: skip

        placement: dict[str, Any] = {}
        engine_placement: dict[str, Any] = {}
        if p.colocate_all:  # one bundle per actor rank; every role's worker i shares bundle i
            shared = launcher.colocation_group(p.actor_strategy.num_workers, 1.0, self.device)
            placement = {"actor": shared, "critic": shared}  # the critic's bundles also hold the reward workers
            # The hybrid engine: engine i's TP ranks in bundles i*tp.., a fifth of each bundle's device and CPU
            # like every role there (OpenRLHF's 0.2 GPU per party), so that all five parties schedule on GPU.
            engine_placement = {"placement": shared, "share": COLOCATED_SHARE, "num_cpus_per_engine": COLOCATED_SHARE}
            self.placement_groups.append(shared)
        else:
            if p.colocate_actor_ref:
                placement["actor"] = launcher.colocation_group(p.actor_strategy.num_workers, 1.0, self.device)
            if p.colocate_critic_reward:
                placement["critic"] = launcher.colocation_group(p.critic_strategy.num_workers, 1.0, self.device)
            self.placement_groups += list(placement.values())
        shared_share = COLOCATED_SHARE if p.colocate_all else 0.5
        share = {role: shared_share if role in placement else 1.0 for role in ("actor", "critic")}
        handles = create_engines(
            p.rollout.num_engines, self.st.sources["actor"], backend=p.rollout.backend, resources=p.rollout.resources,
            tensor_parallel_size=p.rollout.tensor_parallel_size,
            **{"num_cpus_per_engine": p.rollout.cpus_per_engine, **engine_placement}, **self._engine_kwargs(),
        )  # fmt: skip
        self.engines = EngineGroup(handles, self.eos_id, sleep=p.rollout.enable_sleep)
        self.actor = launcher.RayWorkerGroup(
            _slice_if_placed(p.actor_strategy, "actor" in placement), PolicyActor, actor_ctx,
            placement=placement.get("actor"), share=share["actor"],
        )  # fmt: skip
        if critic_ctx is not None:  # critic-free estimators (REINFORCE++, GRPO, RLOO, ...) start no critic
            self.critic = launcher.RayWorkerGroup(
                _slice_if_placed(p.critic_strategy, "critic" in placement), CriticActor, critic_ctx,
                placement=placement.get("critic"), share=share["critic"],
            )  # fmt: skip
        precision = p.actor_strategy.precision
        if p.reward is not None:  # rewards from a function or a server only: no reward-model workers
            self.reward = launcher.RayWorkerGroup(
                _slice_if_placed(frozen(p.reward_workers, p.reward_resources), "critic" in placement), RewardScorer,
                self.st.sources["reward"], t.micro_rollout_batch_size, precision, tokenizer_path=p.reward.tokenizer,
                init_seed=p.reward.init_seed, trust_remote_code=p.reward.trust_remote_code,
                zero_stage=p.frozen_zero_stage, offload=p.frozen_offload,  # 3: one ZeRO-3 copy over the workers
                packing=p.actor_strategy.packing, placement=placement.get("critic"), share=share["critic"],
            )  # fmt: skip
        if needs_reference(p, self.train_actor):
            ref = p.reference or p.actor  # default: the actor's starting model, with the actor's model keys
            self.reference = launcher.RayWorkerGroup(
                _slice_if_placed(frozen(p.reference_workers, p.reference_resources), "actor" in placement),
                ReferencePolicy, self.st.sources["reference"], t.micro_rollout_batch_size, precision, ref.init_seed,
                temperature=p.rollout.temperature, tokenizer_path=ref.tokenizer,
                trust_remote_code=ref.trust_remote_code, zero_stage=p.frozen_zero_stage, offload=p.frozen_offload,
                packing=p.actor_strategy.packing, placement=placement.get("actor"), share=share["actor"],
            )  # fmt: skip
        setups = self.actor.call_async(PolicyActor.setup)
        setups += self.critic.call_async(CriticActor.setup) if self.critic is not None else []
        launcher.wait(setups)
        self.engines.wait_ready()
        # Where the engines run, as their actors see it: colocate_all puts them in the roles' shared group.
        self.placement = {
            "shared_group": shared.id.hex() if p.colocate_all else None,
            "engine_groups": self.engines.placement_group_ids(),
        }
        # The weight transport: "auto" resolved from the device and colocate_all; a GPU transport on CPU is refused.
        sync_backend = weight_sync_backend(self.stage, p, self.device)
        self.actor.call(PolicyActor.connect_engines, handles, p.rollout.backend == "vllm", sync_backend,
                        p.rollout.weight_sync_bucket_mb)  # fmt: skip

    def _engine_kwargs(self) -> dict:
        p = self.p
        return engine_kwargs(p.rollout, p.actor, p.actor_strategy.precision, self.device, p.train.seed, p.data.max_len)

    def shutdown(self) -> None:
        for group in (self.actor, self.critic, self.reward, self.reference, self.engines):
            if group is not None:
                group.shutdown()
        for bundles in self.placement_groups:  # the colocation groups' reserved CPUs/GPUs back to the cluster
            launcher.release_group(bundles)
        self.placement_groups = []
        if self.started_ray:
            launcher.shutdown_ray()

    # -- phases -------------------------------------------------------------------------------------------------------
    def experience(
        self, prompt_ids: list[list[int]], responses: list[list[int]], prompts: list,
        timer: timing.PhaseTimer | None = None,
    ) -> Scored:  # fmt: skip
        """Sequences with old/reference log-probs, values (with a critic) and rewards, each role on its own shards.

        The actor, reference and critic see the sampled tokens only; the reward model scores prompt + response with
        EOS appended to the responses cut at max_new_tokens (``ensure_eos``), so that every response is scored the
        way the reward model was trained (at a final EOS) whether or not it stopped by itself. The reward function
        and the remote server get the raw ``prompts`` (one per prompt id) and the decoded responses, on the driver
        while the roles compute. ``exp.scores`` is the weighted sum of the sources (``reward_weights``; the reward
        model's part normalised with its stored statistics). The critic warm-up's frozen actor, when it is the
        reference (``actor_is_reference``), gives the reference log-probs too: its old ones. ``timer``: each role's
        forward as ``experience_<role>`` (and ``experience_reward_fn``, ``experience_remote_rm``), its seconds from the
        dispatch of the first role to its last result (they run concurrently)."""
        assert self.actor is not None
        n = len(responses) // len(prompt_ids)
        expanded = [ids for ids in prompt_ids for _ in range(n)]
        seq = make_sequences(expanded, responses, self.pad_id)
        closed, truncated = ensure_eos(responses, self.eos_id)
        started = time.perf_counter()
        refs = {"actor": self.actor.call_each_async(PolicyActor.logprobs, seq.shard(len(self.actor)))}
        if self.reference is not None:
            refs["reference"] = self.reference.call_each_async(
                ReferencePolicy.logprobs, seq.shard(len(self.reference))
            )
        if self.critic is not None:
            refs["critic"] = self.critic.call_each_async(CriticActor.values, seq.shard(len(self.critic)))
        if self.reward is not None:
            scored = make_sequences(expanded, closed, self.pad_id)
            refs["reward"] = self.reward.call_each_async(RewardScorer.scores, scored.shard(len(self.reward)))
        parts: dict[str, torch.Tensor] = {}
        keep = None
        if self.reward_fn is not None or self.remote is not None:
            texts = [self.tokenizer.decode(r, skip_special_tokens=True) for r in responses]
            raw = [pr for pr in prompts for _ in range(n)]
            if self.reward_fn is not None:
                t0 = time.perf_counter()
                fn_scores, fn_keep = call_reward_fn_with_mask(
                    self.reward_fn, self.p.reward_fn or "", f"{self.stage}.reward_fn", raw, texts
                )
                parts["reward_fn"] = torch.tensor(fn_scores, dtype=torch.float32)
                keep = torch.tensor(fn_keep, dtype=torch.bool) if fn_keep is not None else None
                if timer is not None:
                    timer.add("experience_reward_fn", time.perf_counter() - t0)
            if self.remote is not None:
                t0 = time.perf_counter()
                parts["remote_rm_url"] = torch.tensor(self.remote.score(raw, texts), dtype=torch.float32)
                if timer is not None:
                    timer.add("experience_remote_rm", time.perf_counter() - t0)
        out, seconds = launcher.wait_timed(refs, started)
        if timer is not None:
            for role, sec in seconds.items():
                timer.add(f"experience_{role}", sec)
        if "reward" in out:
            parts["reward"] = torch.cat(out["reward"])
        old_logprobs = torch.cat(out["actor"])
        ref_logprobs = torch.cat(out["reference"]) if "reference" in out else None
        if ref_logprobs is None and self.ref_from_actor:
            ref_logprobs = old_logprobs
        exp = Experience.from_sequences(
            seq, old_logprobs=old_logprobs, scores=self.combine(parts),
            values=torch.cat(out["critic"]) if "critic" in out else None, ref_logprobs=ref_logprobs,
            truncated=truncated,
        )  # fmt: skip
        return Scored(exp, parts, keep)

    def combine(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B,) reward: sum over the sources of weight x score, the reward model's score normalised (when on)."""
        total = torch.zeros_like(next(iter(parts.values())))
        for key, scores in parts.items():
            if key == "reward" and self.stats is not None:
                scores = normalize_scores(scores, *self.stats)
            total = total + self.weights[key] * scores
        return total

    def token_kl(self, exp: Experience, estimator: str) -> torch.Tensor:
        """(B, T-1) KL to the reference on the action tokens; 0 without reference log-probs (no KL)."""
        if exp.ref_logprobs is None:
            return torch.zeros_like(exp.old_logprobs)
        return approx_kl(exp.old_logprobs, exp.ref_logprobs, exp.action_mask, estimator)

    def advantages(
        self, scored: Scored, engine_logprobs: torch.Tensor | None = None
    ) -> tuple[Experience, dict[str, float]]:
        """Rewards -> penalties and clip -> group shaping (``algo.advantage_estimator``) -> token rewards (KL penalty
        with kl_mode=reward) -> GAE with the critic's values, or the discounted returns (critic-free: the advantage is
        the return). Samples dropped by the reward function's ``keep`` or by ``algo.dynamic_filter`` lose their action
        tokens (no part in the loss or the whitening). ``engine_logprobs``: (B, T-1) the engines' log-probs (NaN
        where none), for the truncated importance weights (``algo.is_correction_cap``)."""
        a, exp = self.p.algo, scored.exp
        # Missing-EOS penalty after normalisation and before clipping, as OpenRLHF adds its length penalties
        # (length_penalty.py: DAPO overlong, ProRL stop-properly) to the reward model's output, which is already
        # normalised there, before compute_reward clamps it: the penalty is in units of the normalised reward.
        scores = exp.scores
        if exp.truncated is not None:
            scores = apply_missing_eos_penalty(scores, exp.truncated, a.missing_eos_penalty)
        scores = clip_scores(scores, *a.reward_clip)
        n = self.p.rollout.n_samples_per_prompt
        keep = scored.keep if scored.keep is not None else torch.ones(exp.size, dtype=torch.bool)
        if a.dynamic_filter:
            keep = keep & varied_groups(scores, n)
        mask = exp.action_mask
        kl = self.token_kl(exp, a.kl_estimator)
        penalty = self.kl_ctl.value if a.kl_mode == "reward" else 0.0
        rewards = token_rewards(shape_scores(scores, n, a.advantage_estimator), kl, mask, penalty)
        if a.advantage_estimator == "gae":
            assert exp.values is not None, "gae needs the critic's values"
            exp = exp.with_advantages(*gae(rewards, exp.values, mask, a.gamma, a.lam))
        else:
            returns = cumulative_returns(rewards, mask, a.gamma)
            exp = exp.with_advantages(returns, returns)
        if a.is_correction_cap is not None and engine_logprobs is not None:
            weights = truncated_is_weights(exp.old_logprobs, engine_logprobs, mask, a.is_correction_cap)
            exp = dataclasses.replace(exp, is_weights=weights)
        if not bool(keep.all()):
            exp = dataclasses.replace(exp, action_mask=mask * keep.unsqueeze(1).to(mask.dtype))
        truncated = exp.truncated if exp.truncated is not None else torch.zeros(exp.size, dtype=torch.bool)
        logs = {
            "reward": scores.mean().item(),
            **{SOURCE_LOGS[key]: part.mean().item() for key, part in scored.parts.items()},
            "kl": (kl * mask).sum(1).mean().item(),  # per-sequence sum, mean over the batch
            # OpenRLHF's units (what the adaptive controller reads): each sequence's token mean, mean over the batch
            "kl_token_mean": masked_mean(kl, mask, dim=1).mean().item(),
            "response_len": mask.sum(1).float().mean().item(),
            "truncated_frac": truncated.float().mean().item(),
            "kl_coef": self.kl_ctl.value,
        }
        if a.dynamic_filter or scored.keep is not None:
            logs["filtered_frac"] = 1.0 - keep.float().mean().item()
        return exp, logs

    def train(
        self, exp: Experience, step: int, actor_frozen: bool, timer: timing.PhaseTimer | None = None
    ) -> dict[str, float]:
        """The PPO epochs of critic (when there is one) and actor (unless ``actor_frozen``), concurrently; rank 0's
        stats and the learning rates. ``timer``: ``critic_train`` and ``actor_train``, each group's seconds from the
        first dispatch to its last rank's result."""
        assert self.actor is not None
        if self.p.algo.kl_mode != "loss":
            exp = dataclasses.replace(exp, ref_logprobs=None)  # the trained roles do not read it
        started = time.perf_counter()
        refs = {}
        if self.critic is not None:
            critic_exp = dataclasses.replace(exp, ref_logprobs=None, is_weights=None)
            refs["critic_train"] = self.critic.call_each_async(
                CriticActor.fit, critic_exp.shard(len(self.critic)), step
            )
        if not actor_frozen:
            refs["actor_train"] = self.actor.call_each_async(
                PolicyActor.fit, exp.shard(len(self.actor)), step, self.kl_ctl.value
            )
        out, seconds = launcher.wait_timed(refs, started)
        if timer is not None:
            for name, sec in seconds.items():
                timer.add(name, sec)
        stats: dict[str, float] = {}
        if not actor_frozen:
            stats.update(out["actor_train"][0])
        if self.critic is not None:
            stats.update(out["critic_train"][0])
        # The learning rates after this step's optimizer steps (the scheduler has stepped); the critic warm-up's
        # actor has no optimizer.
        if self.train_actor:
            stats["actor_lr"] = self.actor.call(PolicyActor.lr)[0]
        if self.critic is not None:
            stats["critic_lr"] = self.critic.call(CriticActor.lr)[0]
        return stats

    def push_weights(self) -> dict[str, float]:
        """Sync the engines to the actor; rank 0's metrics (weight_sync_s, weight_sync_buckets,
        weight_sync_broadcasts)."""
        assert self.actor is not None
        self.engines.wake_up(["weights"])  # sleeping engines take the weights first; the KV cache waits for a rollout
        return self.actor.call(PolicyActor.push_weights)[0]

    def move_training_states(self, offload: bool, timer: timing.PhaseTimer | None = None) -> None:
        """``offload_states_during_rollout``: actor and critic optimizer states and gradients to host memory while
        the engines generate (``offload``), back before training (``TrainableRole.offload_states`` /
        ``reload_states``; nothing moves on CPU). Their weights stay for the experience forwards; the critic
        warm-up's actor has no such states. ``timer``: both moves as ``offload_states``."""
        if self.p.offload_states_during_rollout:
            assert self.actor is not None
            method = TrainableRole.offload_states if offload else TrainableRole.reload_states
            started = time.perf_counter()
            groups = [g for g in (self.actor if self.train_actor else None, self.critic) if g is not None]
            launcher.wait([ref for g in groups for ref in g.call_async(method)])
            if timer is not None:
                timer.add("offload_states", time.perf_counter() - started)

    # -- evaluation ---------------------------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """One sampled response per held-out prompt (rollout temperature, a fixed seed, so the runs before and after
        training sample alike): mean gold reward, mean RM score, and KL to the reference (k1 summed per response;
        left out without a KL, ``needs_kl``)."""
        from rlhf_core.distributed.rollout_engine import SamplingConfig

        if not self.eval_prompts:
            return {}
        ids = [e["prompt_ids"] for e in self.eval_prompts]
        r = self.p.rollout
        sampling = SamplingConfig(n=1, temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                                  seed=self.p.train.seed + 1)  # fmt: skip
        responses = self.engines.generate(ids, sampling)
        raw = [e["prompt"] for e in self.eval_prompts]
        # pad the eval batch to a multiple every role can split
        scored = self.experience(*_pad_to_multiple(ids, responses, raw, self._row_multiple()))
        exp, count = scored.exp, len(ids)
        out = {SOURCE_LOGS[key]: part[:count].mean().item() for key, part in scored.parts.items()}
        if len(scored.parts) > 1:
            out["reward"] = exp.scores[:count].mean().item()
        if exp.ref_logprobs is not None:
            mask = exp.action_mask[:count]
            kl = approx_kl(exp.old_logprobs[:count], exp.ref_logprobs[:count], mask, "k1")
            out["kl_to_ref"] = (kl * mask).sum(1).mean().item()
        if self.gold is not None:
            texts = [self.tokenizer.decode(r, skip_special_tokens=True) for r in responses]
            prompts = [
                e["prompt"] if isinstance(e["prompt"], str) else json.dumps(e["prompt"]) for e in self.eval_prompts
            ]
            out["gold_reward"] = sum(self.gold(pr, tx) for pr, tx in zip(prompts, texts)) / count
        return out

    def _row_multiple(self) -> int:
        p = self.p
        workers = [p.actor_strategy.num_workers, critic_workers(p), reward_workers(p)]
        workers += [p.reference_workers] if self.reference is not None else []
        workers = [w for w in workers if w]
        return math.lcm(*workers) * p.train.micro_rollout_batch_size

    def step_phases(self) -> list[str]:
        """The phases every step logs as ``timing/<phase>_s`` (0.0 when one did not run that step, e.g. the actor's
        training and the weight sync while the actor is frozen), besides ``timing/step_s``. The top-level phases run
        one after the other; ``experience_<role>`` run concurrently within ``experience`` and ``critic_train`` and
        ``actor_train`` within ``train``, each timed from the first dispatch to its group's last result."""
        p = self.p
        roles = ["actor", *(["reference"] if needs_reference(p, self.train_actor) else [])]
        roles += ["critic"] if p.critic else []
        roles += ["reward"] if p.reward is not None else []
        roles += ["reward_fn"] if p.reward_fn is not None else []
        roles += ["remote_rm"] if p.remote_rm_url is not None else []
        phases = ["generation", "experience", *(f"experience_{r}" for r in roles), "advantages", "train"]
        phases += ["critic_train"] if p.critic is not None else []
        phases += ["actor_train", "weight_sync", "checkpoint"]
        return (["offload_states"] if p.offload_states_during_rollout else []) + phases

    # -- weight-sync checks -------------------------------------------------------------------------------------------
    def probe_logprobs(self) -> tuple[list[float], list[float]]:
        """Log-probs of one fixed sequence from the first engine and from the actor (rank 0's copy), both of the raw
        logits (temperature 1: the engines' prompt log-probs do not see the sampling temperature)."""
        assert self.actor is not None
        text = "The garden is calm and lovely today."
        probe = self.prompts[0]["prompt_ids"] + self.tokenizer(text, add_special_tokens=False)["input_ids"]
        engine_lp = self.engines.sequence_logprobs(probe)
        rows = len(self.actor)
        # every token after the first is scored (the actor's log-probs cover the action tokens)
        batch = make_sequences([probe[:1]] * rows, [probe[1:]] * rows, self.pad_id)
        actor_lp = self.actor.call_each(PolicyActor.logprobs, batch.shard(rows), 1.0)[0][0].tolist()
        return engine_lp, actor_lp

    # -- checkpoints --------------------------------------------------------------------------------------------------
    def save_checkpoint(self, state: dict) -> None:
        """The trained roles' shards and the controller state; the critic warm-up's actor (its starting model, no
        optimizer) has none."""
        assert self.actor is not None
        rel = checkpoint_rel(self.stage, state["step"])
        files: dict[str, dict] = {}
        # The ranks that wrote the shards: a resume with other counts is refused (jobs.common.check_resumable).
        workers: dict[str, int] = {}
        if self.train_actor:
            files.update(self.actor.call(PolicyActor.save_shards, rel)[0])
            workers["actor_strategy.num_workers"] = len(self.actor)
        if self.critic is not None:
            files.update(self.critic.call(CriticActor.save_shards, rel)[0])
            workers["critic_strategy.num_workers"] = len(self.critic)
        state = dict(state, kl_ctl=self.kl_ctl.state_dict())
        files["controller_state.json"] = write_entry(self.store, f"{rel}/controller_state.json", json.dumps(state))
        self.store.commit(
            rel, stage=self.stage, config_hash=self.st.config_hash, files=files,
            extra={"step": state["step"], "workers": workers},
        )  # fmt: skip
        prune_checkpoints(self.store, self.stage, self.p.train.keep_last)
        print(f"[{self.stage}] checkpoint {self.store.uri(rel)}", flush=True)

    def load_checkpoint(self, rel: str) -> dict:
        assert self.actor is not None
        if self.train_actor:
            self.actor.call(PolicyActor.load_shards, rel)
        if self.critic is not None:
            self.critic.call(CriticActor.load_shards, rel)
        state = json.loads(self.store.read_text(f"{rel}/controller_state.json"))
        self.kl_ctl.load_state_dict(state.pop("kl_ctl"))
        return state

    # -- the loop -----------------------------------------------------------------------------------------------------
    def fit(self) -> dict:
        from rlhf_core.distributed.rollout_engine import SamplingConfig

        p, t, stage = self.p, self.p.train, self.stage
        state: dict[str, Any] = {"step": 0, "episode": 0, "consumed_prompts": 0, "history": [], "before": None}
        found = newest_checkpoint(self.store, stage, self.st.config_hash)
        if found is not None:
            state = self.load_checkpoint(found[1])
            print(f"[{stage}] resumed from {self.store.uri(found[1])} at step {state['step']}", flush=True)
            events.resumed(stage, state["step"])
            if self.train_actor:
                self.push_weights()  # the engines start from the initial policy: give them the checkpointed one
        resumed_from = state["step"]
        engine_lp_start, _ = self.probe_logprobs()
        eval_before_s = 0.0  # the evaluation before training, within the start-up (none on a resume: it is saved)
        if state["before"] is None:
            t0 = time.perf_counter()
            state["before"] = self.evaluate()
            eval_before_s = time.perf_counter() - t0
            print(f"[{stage}] before: {_fmt(state['before'])}", flush=True)

        fail_after = common.fail_after_step()
        startup_s = timing.since_job_start()
        evaluating = (
            f" ({eval_before_s:.1f}s of it evaluating {len(self.eval_prompts)} prompts)"
            if eval_before_s and self.eval_prompts
            else ""
        )
        print(f"[{stage}] first step {startup_s:.1f}s after the job started{evaluating}", flush=True)
        for step in range(state["step"], self.steps):
            timer = timing.PhaseTimer(self.step_phases())
            # 1. rollout: step k reads prompts [k*R, (k+1)*R) of the seeded prompt stream
            indices = global_batch(len(self.prompts), t.rollout_batch_size, step, t.seed)
            prompt_ids = [self.prompts[i]["prompt_ids"] for i in indices]
            prompts = [self.prompts[i]["prompt"] for i in indices]
            sampling = SamplingConfig(
                n=p.rollout.n_samples_per_prompt, temperature=p.rollout.temperature, top_p=p.rollout.top_p,
                max_new_tokens=p.rollout.max_new_tokens, seed=t.seed * 100_003 + step,
            )  # fmt: skip
            self.move_training_states(offload=True, timer=timer)
            with timer.phase("generation"):
                responses, engine_logprobs = self.engines.generate_with_logprobs(prompt_ids, sampling)
                self.engines.sleep()  # rollout.enable_sleep: the engines' GPU memory is the trainers' until the sync
            # 2. experience
            with timer.phase("experience"):
                scored = self.experience(prompt_ids, responses, prompts, timer)
            # 3. rewards (sources summed, penalties, group shaping, KL penalty) and advantages (GAE or returns)
            with timer.phase("advantages"):
                engine_lp = engine_logprob_tensor(scored.exp, engine_logprobs)
                exp, logs = self.advantages(scored, engine_lp)
                # The engines were synced after the last update: they sampled from the policy the actor now scores.
                logs["rollout_logprob_max_diff"] = rollout_logprob_gap(scored.exp, engine_lp)
            # 4. PPO epochs: the critic always trains, the actor after the frozen warm-up steps
            actor_frozen = not self.train_actor or step < t.freeze_actor_steps
            self.move_training_states(offload=False, timer=timer)
            with timer.phase("train"):
                logs.update(self.train(exp, step, actor_frozen, timer))
            # 5. weight sync to the engines
            if not actor_frozen:
                with timer.phase("weight_sync"):
                    sync = self.push_weights()
                logs.update(sync)
                logs["sync_s"] = sync["weight_sync_s"]
            self.kl_ctl.update(logs["kl_token_mean"], len(responses))
            # 6. logging and checkpoints
            state["step"], state["consumed_prompts"] = step + 1, (step + 1) * t.rollout_batch_size
            state["episode"] = state["consumed_prompts"] // len(self.prompts)
            entry = {"step": step + 1, "prompts": indices, "actor_frozen": actor_frozen, **logs}
            state["history"].append(entry)
            checkpoint = t.save_steps and (step + 1) % t.save_steps == 0 and step + 1 < self.steps
            if checkpoint:
                entry.update(timer.as_logs())  # the checkpoint's own copy: this step's timing so far
                with timer.phase("checkpoint"):
                    self.save_checkpoint(state)
            step_timing = timer.as_logs()
            logs.update(step_timing)
            entry.update(step_timing)
            if (step + 1) % t.log_steps == 0 or step + 1 == self.steps:
                seconds = step_timing[timing.STEP_KEY]
                print(f"[{stage}] step {step + 1}/{self.steps} {_fmt(logs)} ({seconds:.1f}s)", flush=True)
                events.step(stage, step + 1, self.steps, logs)
                self.tracker.log(step + 1, logs)
            if checkpoint and fail_after is not None and step + 1 >= fail_after:
                raise RuntimeError(f"injected failure after checkpoint at step {step + 1} (RLHF_FAIL_AFTER_STEP)")

        after = self.evaluate()
        print(f"[{stage}] after: {_fmt(after)}", flush=True)
        metrics: dict[str, Any] = {"steps": self.steps, "resumed_from_step": resumed_from, "startup_s": startup_s,
                                   "eval_before_s": eval_before_s}  # fmt: skip
        # Proof of the weight sync: the engines now compute what the trained actor computes.
        engine_lp, actor_lp = self.probe_logprobs()
        metrics["sync_engine_vs_actor_max_diff"] = max(abs(a - b) for a, b in zip(engine_lp, actor_lp))
        metrics["sync_engine_change_max"] = max(abs(a - b) for a, b in zip(engine_lp, engine_lp_start))
        gaps = [h["rollout_logprob_max_diff"] for h in state["history"] if "rollout_logprob_max_diff" in h]
        if gaps:
            metrics["rollout_logprob_max_diff"] = max(gaps)
        metrics.update({f"{k}_before": v for k, v in state["before"].items()})
        metrics.update({f"{k}_after": v for k, v in after.items()})
        last = state["history"][-1] if state["history"] else {}
        kept = ("kl", "kl_token_mean", "reward", *SOURCE_LOGS.values(), "policy_loss", "critic_loss")
        metrics.update({k: last[k] for k in kept if k in last})
        # Seconds per phase of a step, mean and total over the steps (timing/<phase>_s_mean, _total; timing/steps).
        metrics.update(timing.summarize(state["history"]))
        self.history = state["history"]
        return metrics


def engine_logprob_tensor(exp: Experience, engine_logprobs: list[list[float]]) -> torch.Tensor:
    """(B, T-1) the engines' log-probs of the sampled tokens on the action positions, NaN elsewhere (and where an
    engine reported none)."""
    engine = torch.full_like(exp.old_logprobs, float("nan"))
    for i, lps in enumerate(engine_logprobs):
        positions = exp.action_mask[i].nonzero().flatten()
        if len(lps) != len(positions):
            raise ValueError(f"response {i}: {len(lps)} engine log-probs for {len(positions)} action tokens")
        engine[i, positions] = torch.tensor(lps, dtype=engine.dtype)
    return engine


def rollout_logprob_gap(exp: Experience, engine: torch.Tensor) -> float:
    """max |engine log-prob - actor old log-prob| over the action tokens: the engines sample at the rollout
    temperature and report processed log-probs; the actor divides its logits by the same temperature. ``engine``:
    :func:`engine_logprob_tensor`. NaN engine entries (a response the engine did not produce) are skipped; 0.0 when
    nothing is comparable."""
    valid = exp.action_mask.bool() & ~engine.isnan()
    if not valid.any():
        return 0.0
    return (engine - exp.old_logprobs)[valid].abs().max().item()


# A party's share of a colocation bundle's CPU (and of its GPU under colocate_all): actor, critic, reward and
# reference workers and a rollout engine share each bundle then.
COLOCATED_SHARE = 0.2


def _slice_if_placed(s: StrategyConfig, placed: bool) -> StrategyConfig:
    # Inside a placement-group bundle (1 CPU) the roles share the bundle; each asks for a fifth of it.
    return replace(s, cpus_per_worker=COLOCATED_SHARE) if placed else s


def _pad_to_multiple(ids: list, responses: list, prompts: list, multiple: int) -> tuple[list, list, list]:
    extra = (-len(ids)) % multiple
    return ids + ids[:1] * extra, responses + responses[:1] * extra, prompts + prompts[:1] * extra


def _fmt(logs: dict) -> str:
    return " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in logs.items())


# ---------------------------------------------------------------------------------------------------------------------
# Entry points


def run(cfg: PipelineConfig, stage: str = KIND, train_actor: bool = True) -> CheckpointRef:
    # 1. inputs: config hash (with the upstream outputs' hashes), finished output, then the models
    p: PPOConfig = cfg.stage(stage)
    models = {"actor": p.actor}
    models.update({role: m for role, m in (("critic", p.critic), ("reward", p.reward)) if m is not None})
    if needs_reference(p, train_actor):
        models["reference"] = p.reference or p.actor
    st = common.setup_stage(cfg, stage, models)
    if st.done is not None:
        return st.done
    store, work, upstream, config_hash = st.store, st.work, st.upstream, st.config_hash

    # 2. data and checks, before any Ray actor starts
    controller = PPOController(stage, p, st, train_actor)

    # 3. roles, the loop (its steps also to the experiment trackers, closed as failed when the stage raises), outputs
    try:
        with Tracker(st.tracking) as controller.tracker:
            controller.start()
            metrics = controller.fit()
        extra = {"upstream": upstream}
        assert controller.actor is not None
        if train_actor and p.train.save_critic and controller.critic is not None:
            controller.critic.call(CriticActor.export, f"{stage}/critic", config_hash, metrics, extra)
        store.write_json(
            f"{stage}/metrics.json",
            {"history": controller.history, "final": metrics, "roles": controller.roles,
             "placement": controller.placement},
        )  # fmt: skip
        curves.save_png(store, stage, cfg.kind(stage), controller.history)
        if train_actor:
            controller.actor.call(PolicyActor.export, stage, config_hash, metrics, extra)
        else:
            assert controller.critic is not None, "the critic warm-up trains a critic"
            controller.critic.call(CriticActor.export, stage, config_hash, metrics, extra)
    finally:
        controller.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    return CheckpointRef(store.uri(stage), stage, metrics["steps"], config_hash, metrics)


if __name__ == "__main__":
    common.main(KIND, run)
