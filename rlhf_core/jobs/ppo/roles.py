"""What the PPO controller starts its Ray roles with: the trained roles' contexts (``role_context``: model,
strategy, optimizer and its step count, the stage's batch and algorithm) and the frozen roles' groups (reward model
and reference, forwards only, with the actor's packing and attention kernel). ``PPOController.start`` places them
by the ``PlacementPlan``; ``placed`` is each role's colocation bundle and share there.
"""

from __future__ import annotations

from typing import Any

from rlhf_core.config import PPOConfig, TrainConfig, WorkerConfig
from rlhf_core.distributed.cluster import Cluster, WorkerGroup
from rlhf_core.distributed.node_files import ModelSource
from rlhf_core.distributed.reference import ReferencePolicy
from rlhf_core.distributed.reward import RewardScorer
from rlhf_core.distributed.role_base import RoleContext
from rlhf_core.jobs import stage_setup


def optimizer_steps(p: PPOConfig, ppo_steps: int) -> int:
    samples = p.train.rollout_batch_size * p.rollout.n_samples_per_prompt
    return ppo_steps * samples // p.train.train_batch_size * p.algo.ppo_epochs


def role_context(
    stage: str,
    p: PPOConfig,
    setup: stage_setup.StageSetup,
    role: str,
    train_actor: bool,
    steps: int,
    actor_ppo_steps: int,
    reward_stats: tuple[float, float] | None,
) -> RoleContext:
    """What the trained role ``role`` ("actor" or "critic") gets on its ranks: its model (and LoRA adapters),
    strategy and optimizer, and the stage's batch, algorithm and run settings. The actor's LR schedule spans its
    ``actor_ppo_steps``, the critic's all ``steps``; the critic gets the reward model's stored ``reward_stats``."""
    train = p.train
    section = p.actor if role == "actor" else p.critic
    model = section.model
    assert model is not None, f"{stage}: no {role} model"
    own: dict[str, Any] = (
        dict(
            total_optimizer_steps=optimizer_steps(p, actor_ppo_steps),
            max_new_tokens=p.rollout.max_new_tokens,
            trains=train_actor,
        )
        if role == "actor"
        else dict(total_optimizer_steps=optimizer_steps(p, steps), reward_stats=reward_stats)
    )
    return RoleContext(
        role=role,
        model_path=setup.sources[role],
        tokenizer_path=model.tokenizer,
        init_seed=model.init_seed,
        trust_remote_code=model.trust_remote_code,
        lora=model.lora,
        aux_loss_coef=model.aux_loss_coef,
        strategy=section.strategy,
        optim=section.optim,
        stage=stage,
        micro_rollout_batch_size=train.micro_rollout_batch_size,
        algo=p.algo,
        seed=train.seed,
        run_uri=setup.store.root_uri,
        storage_options=setup.store.fs.storage_options,
        work_dir=setup.work,
        batch=TrainConfig(
            train_batch_size=train.train_batch_size, micro_train_batch_size=train.micro_train_batch_size
        ),
        temperature=p.rollout.temperature,
        max_tokens_per_micro_batch=train.max_tokens_per_micro_batch if train.dynamic_batch else None,
        **own,
    )


def _frozen(p: PPOConfig) -> dict[str, Any]:
    """The frozen roles' settings. Their one ZeRO stage is frozen.zero_stage (3: one ZeRO-3 copy over the workers),
    given here; their group's config (``placement.PlacementPlan``) is a ``WorkerConfig``, which has none. They take
    the actor's packing and attention kernel, so reference and actor log-probs come from the same kernel."""
    return dict(
        zero_stage=p.frozen.zero_stage,
        offload=p.frozen.offload,
        packing=p.actor.strategy.packing,
        attn=p.actor.strategy.attn_implementation,
    )


def reward_group(
    cluster: Cluster, p: PPOConfig, strategy: WorkerConfig, source: ModelSource, placed: dict[str, Any]
) -> WorkerGroup[RewardScorer]:
    """The reward model's workers (rewards from a function or a server only need none), from ``source``."""
    rm = p.reward.model
    assert rm is not None, "a reward group needs a reward model"
    return cluster.group(
        strategy,
        RewardScorer,
        source,
        p.train.micro_rollout_batch_size,
        p.actor.strategy.precision,
        tokenizer_path=rm.tokenizer,
        init_seed=rm.init_seed,
        trust_remote_code=rm.trust_remote_code,
        **_frozen(p),
        **placed,
    )


def reference_group(
    cluster: Cluster, p: PPOConfig, strategy: WorkerConfig, source: ModelSource, placed: dict[str, Any]
) -> WorkerGroup[ReferencePolicy]:
    """The reference policy's workers, from ``source``; its model keys default to the actor's (``reference.model``
    null: the actor's starting model)."""
    ref = p.reference.model or p.actor.model
    return cluster.group(
        strategy,
        ReferencePolicy,
        source,
        p.train.micro_rollout_batch_size,
        p.actor.strategy.precision,
        ref.init_seed,
        temperature=p.rollout.temperature,
        tokenizer_path=ref.tokenizer,
        trust_remote_code=ref.trust_remote_code,
        **_frozen(p),
        **placed,
    )
