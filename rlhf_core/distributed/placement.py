"""Where a stage's Ray roles and rollout engines go: arithmetic on the config, with no Ray call.

A PPO-kind stage (ppo, critic_warmup) builds an actor and the roles of its ``RoleSet`` (critic, reference, reward
model). From the config this module answers what they ask Ray for (``resource_demand``, ``pinned_groups``), whether
the cluster can place them (``check_fits``, before any actor starts), and which colocation bundles they share
(``PlacementPlan``, which ``jobs.ppo.controller.PPOController.start`` turns into placement groups and worker
groups). The generate stage's groups (``generate_groups``) and the rollout engines' constructor kwargs
(``engine_kwargs``, PPO's and generate's) sit here too, so that ``jobs.stage_setup.ray_cpus`` reads one module below
the jobs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

from rlhf_core.config import (
    ConfigError,
    GenerateConfig,
    ModelConfig,
    PPOConfig,
    RolloutConfig,
    WorkerConfig,
    uses_critic,
)
from rlhf_core.distributed.launcher import check_resources
from rlhf_core.distributed.weight_sync.transports import resolve_backend

# A party's share of a colocation bundle's CPU (and of its GPU under colocate_all): actor, critic, reward and
# reference workers and a rollout engine share each bundle then.
COLOCATED_SHARE = 0.2

# {config key of the resources: (workers, CPUs per worker, Ray custom resources per worker)}
Groups = dict[str, tuple[int, float, dict[str, float]]]


# ---------------------------------------------------------------------------------------------------------------------
# The roles a PPO-kind stage builds


def actor_is_reference(p: PPOConfig, train_actor: bool) -> bool:
    """The policy is the reference at every step: the actor never trains (the critic warm-up) and the reference is its
    starting model (``reference`` null). The actor's old log-probs are then the reference's, and the KL is 0."""
    return not train_actor and p.reference.model is None


@dataclass(frozen=True)
class RoleSet:
    """The Ray roles a PPO-kind stage builds besides the actor. ``critic``: GAE and the critic warm-up train one
    (``config.uses_critic``); the critic-free estimators build none. ``reference``: for a KL (``algo.needs_kl``) to a
    policy other than the frozen actor (``actor_is_reference``). ``reward_model``: with ``reward`` (rewards from a
    function or a server only need no workers)."""

    critic: bool
    reference: bool
    reward_model: bool

    @classmethod
    def of(cls, p: PPOConfig, train_actor: bool = True) -> RoleSet:
        """``train_actor``: False for the critic warm-up (the stage kind whose actor never trains)."""
        kind = "ppo" if train_actor else "critic_warmup"
        return cls(
            critic=uses_critic(kind, p),
            reference=p.algo.needs_kl and not actor_is_reference(p, train_actor),
            reward_model=p.reward.model is not None,
        )


def role_workers(p: PPOConfig, roles: RoleSet) -> dict[str, int]:
    """Ray workers per role, 0 for a role the stage does not build."""
    return {
        "actor": p.actor.strategy.num_workers,
        "critic": p.critic.strategy.num_workers if roles.critic else 0,
        "reward": p.reward.workers if roles.reward_model else 0,
        "reference": p.reference.workers if roles.reference else 0,
    }


def role_models(p: PPOConfig, roles: RoleSet) -> dict[str, ModelConfig]:
    """The model each role loads (what ``jobs.stage_setup.setup_stage`` fetches and hashes); the reference defaults to
    the actor's starting model."""
    built: dict[str, ModelConfig | None] = {
        "actor": p.actor.model,
        "critic": p.critic.model if roles.critic else None,
        "reward": p.reward.model if roles.reward_model else None,
        "reference": (p.reference.model or p.actor.model) if roles.reference else None,
    }
    # a role built has its model (validation refuses a critic without one; reward_model means a reward model)
    return {role: model for role, model in built.items() if model is not None}


def row_multiple(p: PPOConfig, roles: RoleSet) -> int:
    """The rows of a batch that every built role can split into its workers' micro-batches."""
    workers = [w for w in role_workers(p, roles).values() if w]
    return math.lcm(*workers) * p.train.micro_rollout_batch_size


# ---------------------------------------------------------------------------------------------------------------------
# What the roles ask Ray for, checked before any Ray actor starts


def resource_demand(p: PPOConfig, roles: RoleSet, device: str) -> dict[str, float]:
    """Ray resources the roles and engines ask for (colocated roles share their partner's devices)."""
    workers = role_workers(p, roles)
    actor, critic, rollout = p.actor.strategy, p.critic.strategy, p.rollout
    cpus = actor.num_workers * actor.cpus_per_worker + workers["critic"] * critic.cpus_per_worker
    cpus += (workers["reward"] + workers["reference"]) * p.frozen.cpus_per_worker
    cpus += rollout.num_engines * rollout.cpus_per_engine
    demand = {"CPU": cpus}
    if device == "cuda":
        gpus = actor.num_workers + workers["critic"] + rollout.num_engines * rollout.tensor_parallel_size
        gpus += 0 if (p.placement.colocate_actor_ref or p.placement.colocate_all) else workers["reference"]
        gpus += 0 if (p.placement.colocate_critic_reward or p.placement.colocate_all) else workers["reward"]
        if (
            p.placement.colocate_all
        ):  # every role and engine in the actor's bundles (check_fits: the engines' GPUs fit there)
            gpus = actor.num_workers
        demand["GPU"] = gpus
    if p.placement.colocate_all:  # one bundle of 1 CPU per actor rank, shared by all roles and the engines
        demand["CPU"] = actor.num_workers
    for count, _, resources in pinned_groups("", p, roles).values():  # custom resources: pins to nodes
        for name, amount in resources.items():
            demand[name] = demand.get(name, 0.0) + count * amount
    return demand


def pinned_groups(stage: str, p: PPOConfig, roles: RoleSet) -> Groups:
    """The groups that ask for Ray custom resources (pins to nodes), by the config key of their resources."""
    workers = role_workers(p, roles)
    actor, critic, rollout = p.actor.strategy, p.critic.strategy, p.rollout
    frozen = p.frozen.cpus_per_worker
    groups = {
        f"{stage}.actor.strategy.resources": (workers["actor"], actor.cpus_per_worker, actor.resources),
        f"{stage}.critic.strategy.resources": (workers["critic"], critic.cpus_per_worker, critic.resources),
        f"{stage}.reward.resources": (workers["reward"], frozen, p.reward.resources),
        f"{stage}.reference.resources": (workers["reference"], frozen, p.reference.resources),
        f"{stage}.rollout.resources": (rollout.num_engines, rollout.cpus_per_engine, rollout.resources),
    }
    return {key: group for key, group in groups.items() if group[0] and group[2]}


def weight_sync_backend(stage: str, p: PPOConfig, device: str) -> str:
    """The actor -> engine transport on ``device`` (``rollout.weight_sync_backend`` resolved: auto = cuda_ipc with
    colocate_all on GPU, nccl on GPU, else gloo); a GPU transport on a CPU run is refused naming the key."""
    return resolve_backend(
        p.rollout.weight_sync_backend, device, p.placement.colocate_all, key=f"{stage}.rollout.weight_sync_backend"
    )


def check_fits(
    stage: str,
    p: PPOConfig,
    roles: RoleSet,
    device: str,
    available: dict[str, float],
    nodes: list[dict[str, float]] | None = None,
) -> None:
    """Refuse a layout that the cluster cannot place, naming what each role asks for. ``nodes``: each alive node's
    resources, for the custom resources that pin roles (default: ``available`` taken as one node)."""
    rollout = p.rollout
    weight_sync_backend(stage, p, device)
    if rollout.enable_sleep and device != "cuda":
        raise ConfigError(
            f"'{stage}.rollout.enable_sleep' needs a GPU: vLLM sleep mode is CUDA-only (device {device})"
        )
    engine_gpus = rollout.num_engines * rollout.tensor_parallel_size
    if p.placement.colocate_all and engine_gpus > p.actor.strategy.num_workers:
        raise ConfigError(
            f"'{stage}.rollout.num_engines' x tensor_parallel_size = {engine_gpus} "
            f"exceeds the {p.actor.strategy.num_workers} actor bundles that '{stage}.placement.colocate_all' shares"
        )
    if p.placement.offload_states_during_rollout:
        trained = {"actor": p.actor.strategy, **({"critic": p.critic.strategy} if roles.critic else {})}
        for role, strategy in trained.items():
            if strategy.zero_stage == 0:  # DeepSpeed's offload_states is a method of its ZeRO-1/2/3 optimizers only
                raise ConfigError(
                    f"'{stage}.placement.offload_states_during_rollout' needs ZeRO stage 1, 2 or 3: "
                    f"'{stage}.{role}.strategy.zero_stage' is 0"
                )
    pinned = pinned_groups(stage, p, roles)
    bundled = {  # roles placed in a colocation bundle: the bundle decides their node
        f"{stage}.actor.strategy.resources": p.placement.colocate_all or p.placement.colocate_actor_ref,
        f"{stage}.reference.resources": p.placement.colocate_all or p.placement.colocate_actor_ref,
        f"{stage}.critic.strategy.resources": p.placement.colocate_all or p.placement.colocate_critic_reward,
        f"{stage}.reward.resources": p.placement.colocate_all or p.placement.colocate_critic_reward,
    }
    for key in pinned:
        if bundled.get(key):
            raise ConfigError(
                f"'{key}' pins a colocated role, whose placement-group bundle decides its node: unset "
                "it or the placement.colocate_* key that places it"
            )
    check_resources(pinned, nodes if nodes is not None else [available])
    workers = role_workers(p, roles)
    for resource, needed in resource_demand(p, roles, device).items():
        have = available.get(resource, 0)
        if needed > have:
            raise ConfigError(
                f"{stage}: the roles need {needed:g} {resource} but the Ray cluster has {have:g} "
                f"(actor {workers['actor']}, critic {workers['critic']}, reward {workers['reward']}, reference "
                f"{workers['reference']}, {rollout.num_engines} engine(s) x tensor_parallel_size "
                f"{rollout.tensor_parallel_size}); lower '{stage}.rollout.num_engines' or the worker counts"
            )


# ---------------------------------------------------------------------------------------------------------------------
# Colocation: which bundles the roles and engines share


@dataclass(frozen=True)
class RolePlacement:
    """One role's group: its strategy (Ray counts; a fifth of a bundle's CPU per worker inside one; the frozen roles'
    a ``WorkerConfig``, without a ZeRO stage), the colocation group whose bundle i holds its worker i (None: Ray
    places it), and its share of that bundle's device."""

    strategy: WorkerConfig
    group: str | None = None
    share: float = 1.0


@dataclass(frozen=True)
class PlacementPlan:
    """The colocation groups to reserve (name -> bundles of 1 CPU and, on GPU, a device each, in reservation order),
    where each built role goes (``roles``: actor, critic, reward, reference), and the rollout engines' group, share
    and CPUs (colocate_all: the hybrid engine, engine i's TP ranks in bundles i*tp.. of the shared group)."""

    groups: dict[str, int]
    roles: dict[str, RolePlacement]
    engine_group: str | None = None
    engine_share: float = 1.0
    engine_cpus: float = 1.0

    @classmethod
    def of(cls, p: PPOConfig, roles: RoleSet) -> PlacementPlan:
        """colocate_all: one bundle per actor rank, every role's worker i and the engines share bundle i, a fifth of
        its device and CPU each (OpenRLHF's 0.2 GPU per party), so that all five parties schedule on GPU.
        colocate_actor_ref / colocate_critic_reward: the reference (reward) workers share the actor's (critic's)
        bundles, half a device each."""
        groups: dict[str, int] = {}
        if p.placement.colocate_all:
            groups["shared"] = p.actor.strategy.num_workers
        else:
            if p.placement.colocate_actor_ref:
                groups["actor"] = p.actor.strategy.num_workers
            if p.placement.colocate_critic_reward:
                groups["critic"] = p.critic.strategy.num_workers
        share = COLOCATED_SHARE if p.placement.colocate_all else 0.5
        actor_side = "shared" if p.placement.colocate_all else ("actor" if p.placement.colocate_actor_ref else None)
        critic_side = (
            "shared" if p.placement.colocate_all else ("critic" if p.placement.colocate_critic_reward else None)
        )
        wanted = {
            "actor": (p.actor.strategy, actor_side, True),
            "critic": (p.critic.strategy, critic_side, roles.critic),
            "reward": (_frozen(p, p.reward.workers, p.reward.resources), critic_side, roles.reward_model),
            "reference": (_frozen(p, p.reference.workers, p.reference.resources), actor_side, roles.reference),
        }
        placed = {
            role: RolePlacement(_slice_if_placed(strategy, group is not None), group, share if group else 1.0)
            for role, (strategy, group, built) in wanted.items()
            if built
        }
        if p.placement.colocate_all:
            return cls(groups, placed, "shared", COLOCATED_SHARE, COLOCATED_SHARE)
        return cls(groups, placed, engine_cpus=p.rollout.cpus_per_engine)


def _frozen(p: PPOConfig, workers: int, resources: dict[str, float]) -> WorkerConfig:
    # The actor's worker settings (device, precision, threads) with the frozen role's own counts and pins (never the
    # actor's nodes). A worker group's config, without a ZeRO stage: a frozen role's one is frozen.zero_stage, which
    # jobs.ppo.roles gives the role itself.
    actor = p.actor.strategy
    settings = WorkerConfig(**{f.name: getattr(actor, f.name) for f in fields(WorkerConfig)})
    return replace(settings, num_workers=workers, cpus_per_worker=p.frozen.cpus_per_worker, resources=resources)


def _slice_if_placed(strategy: WorkerConfig, placed: bool) -> WorkerConfig:
    # Inside a placement-group bundle (1 CPU) the roles share the bundle; each asks for a fifth of it.
    return replace(strategy, cpus_per_worker=COLOCATED_SHARE) if placed else strategy


# ---------------------------------------------------------------------------------------------------------------------
# Rollout engines, and the generate stage's groups


def engine_kwargs(
    rollout: RolloutConfig,
    model: ModelConfig,
    precision: str,
    device: str,
    seed: int,
    max_len: int,
    enable_sleep: bool = False,
) -> dict[str, Any]:
    """Constructor kwargs of the rollout engines (``EngineGroup.create``) for ``rollout.backend``, sampling the policy
    ``model`` (its tokenizer, remote code, and for the HF backend its build seed) in ``precision`` on ``device``: the
    PPO engines and the generate stage's. ``enable_sleep``: vLLM sleep mode (PPO's ``rollout.enable_sleep``)."""
    kwargs: dict[str, Any] = {"seed": seed, "tokenizer": model.tokenizer, "trust_remote_code": model.trust_remote_code}
    kwargs["dtype"] = "bfloat16" if precision == "bf16" else "float32"
    if rollout.backend == "vllm":
        eager = (device != "cuda") if rollout.enforce_eager is None else rollout.enforce_eager  # null: eager on CPU
        kwargs.update(
            max_model_len=max_len + rollout.max_new_tokens,
            kv_cache_gib=rollout.kv_cache_gib,
            gpu_memory_utilization=rollout.gpu_memory_utilization,
            enable_sleep=enable_sleep,
            enforce_eager=eager,
        )
    else:  # a builtin: policy is built, not loaded: the engine must build it with the policy's seed
        kwargs["init_seed"] = model.init_seed
    return kwargs


def generate_groups(stage: str, g: GenerateConfig) -> Groups:
    """The generate stage's groups by the config key of their resources: the engines and, with a reference, the two
    log-prob groups (policy and reference)."""
    rollout, strategy = g.rollout, g.strategy
    groups = {f"{stage}.rollout.resources": (rollout.num_engines, rollout.cpus_per_engine, rollout.resources)}
    if g.reference is not None:
        groups[f"{stage}.strategy.resources"] = (
            2 * strategy.num_workers,
            strategy.cpus_per_worker,
            strategy.resources,
        )
    return groups
