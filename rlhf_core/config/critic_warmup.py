"""The ``critic_warmup`` kind: PPO's rollout loop with the actor frozen, training only the critic (OpenRLHF's
``freezing_steps`` as a stage of its own). Its section has the PPO kinds' roles and rewards, the critic's algorithm
(KL, GAE, reward shaping) and the rollout loop; none of the actor's optimizer or loss. ``PPOConfig`` (``ppo.py``)
extends it with those."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from rlhf_core.config.fields import ConfigError, check, opt, required
from rlhf_core.config.redact import redact_url
from rlhf_core.config.rl import (
    REWARD_SOURCES,
    ROLE_KEYS_MOVED,
    CriticRole,
    FrozenActorRole,
    FrozenWorkersConfig,
    PlacementConfig,
    ReferenceRole,
    RemoteRewardConfig,
    RewardRole,
    RLTrainConfig,
    ValueAlgoConfig,
)
from rlhf_core.config.sections import PromptData, SyncedRolloutConfig, TrainedModelConfig


@dataclass
class CriticWarmupConfig:
    RENAMED: ClassVar[dict[str, str]] = ROLE_KEYS_MOVED

    actor: FrozenActorRole = required("The policy whose rollouts the critic learns to value (it does not train).")
    data: PromptData = required("Prompts (input_key, e.g. 'prompt'); eval_path gives held-out prompts.")
    critic: CriticRole = opt(CriticRole(), "The critic to train: model (e.g. stage:critic_init), strategy, optim.")
    reward: RewardRole = opt(RewardRole(), "Frozen reward model (or reward_fn/remote_rm_url) and its workers.")
    reward_fn: str | None = opt(
        None, "module:function or path.py:function(prompts, responses) -> scores, or {scores, keep} (keep: bools)."
    )
    remote_rm_url: str | None = opt(
        None, "HTTP reward server: POST {prompts, responses} -> {scores} (remote_rm: timeouts, retries)."
    )
    remote_rm: RemoteRewardConfig = opt(RemoteRewardConfig(), "Remote reward server client settings.")
    reward_weights: dict[str, float] = opt(
        {}, "Weights of the summed rewards by source (reward, reward_fn, remote_rm_url); 1.0 each by default."
    )
    reference: ReferenceRole = opt(ReferenceRole(), "Frozen reference policy (null model = the actor's) and workers.")
    frozen: FrozenWorkersConfig = opt(FrozenWorkersConfig(), "Reward and reference workers: CPUs, ZeRO, offload.")
    placement: PlacementConfig = opt(PlacementConfig(), "Which roles share devices; offload during rollout.")
    rollout: SyncedRolloutConfig = opt(SyncedRolloutConfig(), "Generation settings.")
    algo: ValueAlgoConfig = opt(ValueAlgoConfig(), "KL and reward settings, GAE.")
    train: RLTrainConfig = opt(RLTrainConfig(), "Batching, steps, checkpoints.")

    def validate(self, name: str) -> None:
        if self.critic.model is None:
            raise ConfigError(
                f"'{name}.critic.model.name_or_path' is required: the critic warm-up trains one (e.g. "
                "stage:critic_init)"
            )
        check_rl(name, self, critic=True)


# ---------------------------------------------------------------------------------------------------------------------
# The checks both PPO kinds need (PPOConfig extends this section)


def reward_sources(p: CriticWarmupConfig) -> list[str]:
    """The reward sources a PPO-kind stage sums (in REWARD_SOURCES order)."""
    given = {"reward": p.reward.model, "reward_fn": p.reward_fn, "remote_rm_url": p.remote_rm_url}
    return [key for key in REWARD_SOURCES if given[key] is not None]


def check_rl(name: str, p: CriticWarmupConfig, critic: bool) -> None:
    """The checks of a PPO-kind stage that trains a critic (``critic``) or not: rewards, rollout, placement, and the
    batch arithmetic of OpenRLHF (rollout samples split evenly over every role's ranks, and into optimizer steps of
    train_batch_size made of micro-batches on every rank)."""
    t, r, a = p.train, p.rollout, p.algo
    _check_rewards(name, p)
    p.data.validate(f"{name}.data", min_len=1)
    r.validate(f"{name}.rollout")
    p.actor.strategy.validate(f"{name}.actor.strategy")
    if isinstance(p.actor.model, TrainedModelConfig):
        p.actor.model.validate(f"{name}.actor.model")
    if critic:
        if p.critic.model is not None:
            p.critic.model.validate(f"{name}.critic.model")
        p.critic.strategy.validate(f"{name}.critic.strategy")
        p.critic.optim.validate(f"{name}.critic.optim")
    for key in ("rollout_batch_size", "train_batch_size", "micro_train_batch_size", "micro_rollout_batch_size"):
        check(getattr(t, key) >= 1, f"{name}.train.{key}", getattr(t, key), "must be >= 1")
    check(t.keep_last >= 1, f"{name}.train.keep_last", t.keep_last, "must be >= 1")
    budget = t.max_tokens_per_micro_batch
    why = "must be > 0 with dynamic_batch on"
    check(not t.dynamic_batch or budget > 0, f"{name}.train.max_tokens_per_micro_batch", budget, why)
    frozen = p.frozen
    check(frozen.zero_stage in (0, 3), f"{name}.frozen.zero_stage", frozen.zero_stage, "must be 0 or 3")
    if frozen.offload and frozen.zero_stage != 3:
        raise ConfigError(f"'{name}.frozen.offload' needs '{name}.frozen.zero_stage=3' (offload of partitions)")
    if r.weight_sync_backend == "cuda_ipc" and not p.placement.colocate_all:
        raise ConfigError(
            f"'{name}.rollout.weight_sync_backend=cuda_ipc' needs '{name}.placement.colocate_all=true' (the engines "
            "must share the actor's GPUs)"
        )
    if r.weight_sync_backend == "nccl" and p.placement.colocate_all:
        # The actor's rank 0 and an engine worker would be two ranks of one NCCL communicator on one GPU, which NCCL
        # refuses at the first sync; colocated engines take the weights by CUDA IPC instead.
        raise ConfigError(
            f"'{name}.rollout.weight_sync_backend=nccl' cannot be used with '{name}.placement.colocate_all=true' "
            "(NCCL refuses two ranks on one GPU): use cuda_ipc or auto"
        )
    check(a.kl_coef >= 0, f"{name}.algo.kl_coef", a.kl_coef, "must be >= 0")
    check(0 <= a.gamma <= 1 and 0 <= a.lam <= 1, f"{name}.algo.gamma/lam", (a.gamma, a.lam), "must be in [0, 1]")
    check(a.ppo_epochs >= 1, f"{name}.algo.ppo_epochs", a.ppo_epochs, "must be >= 1")
    check(
        len(a.reward_clip) == 2 and a.reward_clip[0] < a.reward_clip[1],
        f"{name}.algo.reward_clip",
        a.reward_clip,
        "must be [low, high] with low < high",
    )
    if a.kl_in_loss and not a.needs_kl:
        raise ConfigError(
            f"'{name}.algo.kl_mode' = loss with kl_coef 0 adds no KL term: set '{name}.algo.kl_coef' "
            "> 0 (e.g. 0.01) or kl_mode=reward"
        )
    check(p.reward.workers >= 1, f"{name}.reward.workers", p.reward.workers, "must be >= 1")
    check(p.reference.workers >= 1, f"{name}.reference.workers", p.reference.workers, "must be >= 1")
    _check_batches(name, p, critic)
    _check_placement(name, p, critic)
    if p.data.eval_path is None and t.eval_prompts > 0:
        raise ConfigError(f"'{name}.data.eval_path' is required while '{name}.train.eval_prompts' > 0")
    _check_evaluation(name, p)


def _check_evaluation(name: str, p: CriticWarmupConfig) -> None:
    """The held-out accuracy (greedy) and pass@k need held-out prompts and a judge (eval_reward_fn or reward_fn)."""
    t = p.train
    tol = t.sync_check_tolerance
    check(tol is None or tol >= 0, f"{name}.train.sync_check_tolerance", tol, "must be >= 0 (null = off)")
    check(t.eval_pass_k >= 0, f"{name}.train.eval_pass_k", t.eval_pass_k, "must be >= 0 (0 = off)")
    check(math.isfinite(t.eval_correct_at), f"{name}.train.eval_correct_at", t.eval_correct_at, "must be finite")
    if not (t.eval_greedy or t.eval_pass_k):
        return
    asked = f"'{name}.train.eval_greedy' / '{name}.train.eval_pass_k'"
    if t.eval_prompts <= 0:
        raise ConfigError(f"{asked} need held-out prompts: set '{name}.train.eval_prompts' > 0")
    if t.eval_reward_fn is None and p.reward_fn is None:
        raise ConfigError(
            f"{asked} need a judge: set '{name}.train.eval_reward_fn' (module:function or path.py:function) or "
            f"'{name}.reward_fn'"
        )


def _check_rewards(name: str, p: CriticWarmupConfig) -> None:
    sources = reward_sources(p)
    if not sources:
        raise ConfigError(
            f"'{name}' has no reward: give '{name}.reward.model.name_or_path' (a reward model), "
            f"'{name}.reward_fn' (path.py:function) or '{name}.remote_rm_url' (a server)"
        )
    for key, weight in p.reward_weights.items():
        if key not in sources:
            raise ConfigError(
                f"'{name}.reward_weights.{key}' weighs no reward source of this stage (its sources: "
                f"{', '.join(sources)}; the keys are {', '.join(REWARD_SOURCES)})"
            )
        check(math.isfinite(weight), f"{name}.reward_weights.{key}", weight, "must be a finite number")
    if p.remote_rm_url is not None:
        url = p.remote_rm_url
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"'{name}.remote_rm_url' = {redact_url(url)!r} must be an http:// or https:// URL")
        rm = p.remote_rm
        check(rm.timeout_s > 0, f"{name}.remote_rm.timeout_s", rm.timeout_s, "must be > 0")
        check(rm.retries >= 0, f"{name}.remote_rm.retries", rm.retries, "must be >= 0")
        check(rm.backoff_s >= 0, f"{name}.remote_rm.backoff_s", rm.backoff_s, "must be >= 0")
        check(rm.batch_size >= 0, f"{name}.remote_rm.batch_size", rm.batch_size, "must be >= 0 (0 = one request)")


def _check_batches(name: str, p: CriticWarmupConfig, critic: bool) -> None:
    t = p.train
    samples = t.rollout_batch_size * p.rollout.n_samples_per_prompt
    if samples % t.train_batch_size:
        raise ConfigError(
            f"invalid value {t.train_batch_size} for '{name}.train.train_batch_size': rollout_batch_size x "
            f"n_samples_per_prompt = {samples} samples per step must split into whole optimizer steps"
        )
    trained = {"actor": p.actor.strategy.num_workers}
    trained.update({"critic": p.critic.strategy.num_workers} if critic else {})
    for role, workers in trained.items():
        per_step = t.micro_train_batch_size * workers
        if t.train_batch_size % per_step:
            raise ConfigError(
                f"invalid value {t.train_batch_size} for '{name}.train.train_batch_size': it must be a multiple of "
                f"micro_train_batch_size x {role}.strategy.num_workers = {t.micro_train_batch_size} x {workers}"
            )
    groups = {**trained, "reward": p.reward.workers if p.reward.model is not None else 0}
    groups["reference"] = p.reference.workers
    for role, workers in groups.items():
        if workers and samples % (workers * t.micro_rollout_batch_size):
            raise ConfigError(
                f"invalid value {t.micro_rollout_batch_size} for '{name}.train.micro_rollout_batch_size': the "
                f"{samples} samples of a step do not split into equal micro-batches over the {workers} {role} workers"
            )


def _check_placement(name: str, p: CriticWarmupConfig, critic: bool) -> None:
    place, actors, reward = p.placement, p.actor.strategy.num_workers, p.reward.model is not None
    if place.colocate_all and max(p.critic.strategy.num_workers, p.reward.workers, p.reference.workers) > actors:
        raise ConfigError(
            f"'{name}.placement.colocate_all' needs critic, reward and reference workers <= actor workers"
        )
    if place.colocate_actor_ref and p.reference.workers != actors:
        raise ConfigError(
            f"'{name}.placement.colocate_actor_ref' needs reference.workers == actor.strategy.num_workers"
        )
    if place.colocate_critic_reward and not (critic and reward):
        raise ConfigError(
            f"'{name}.placement.colocate_critic_reward' needs a critic and a reward model; this stage has "
            f"{'no critic' if not critic else 'no reward model'}: set it to false"
        )
    if place.colocate_critic_reward and p.reward.workers != p.critic.strategy.num_workers:
        raise ConfigError(
            f"'{name}.placement.colocate_critic_reward' needs reward.workers == critic.strategy.num_workers"
        )
