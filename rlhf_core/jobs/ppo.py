"""PPO stage: a single controller driving actor, critic, reward-model and reference Ray groups and rollout engines.

After OpenRLHF: the actor starts from ``ppo.actor`` (usually ``stage:sft``), the critic from ``ppo.critic``
(``stage:critic_warmup`` or ``stage:critic_init``); reward model and reference are frozen. Each step of ``fit``:

  1. rollout      the engines (vLLM, or HF generate) sample n responses per prompt, with each token's log-prob
  2. experience   actor and reference log-probs, critic values, the summed reward sources (``RewardSources``)
  3. advantages   penalised and clipped rewards, group shaping, token-level KL penalty, then GAE or returns
  4. PPO epochs   actor and critic together, each on its shards of the experience
  5. weight sync  the actor's new weights to the engines over a collective group (no disk)
  6. logging      the step's metrics with each phase's ``timing/<phase>_s``; every ``save_steps`` a checkpoint

Critic-free estimators start no critic, a stage without ``reward`` no reward model, one without a KL no reference;
the critic warm-up runs this loop, its actor frozen. Writes ``ppo/`` (policy), ``ppo/critic/``, ``ppo/metrics.json``.

    python -m rlhf_core.jobs.ppo --config deployments/configs/tiny.yaml
    python -m rlhf_core.jobs.ppo --config deployments/configs/tiny.yaml ppo.rollout.backend=hf ppo.train.max_steps=4
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from typing import Any

import torch

from rlhf_core import curves, events, run_layout, timing
from rlhf_core.algos.advantages import cumulative_returns, shape_scores, varied_groups
from rlhf_core.algos.batching import ensure_eos, make_sequences
from rlhf_core.algos.experience import Experience
from rlhf_core.algos.is_correction import is_correction_setting, is_correction_weights
from rlhf_core.algos.logprob_gap import engine_logprob_tensor, rollout_logprob_gap
from rlhf_core.algos.losses import masked_mean
from rlhf_core.algos.ppo import (
    apply_missing_eos_penalty,
    approx_kl,
    clip_scores,
    gae,
    make_kl_controller,
    token_rewards,
)
from rlhf_core.config import ConfigError, PipelineConfig, PPOConfig, TrainConfig, as_ppo
from rlhf_core.data.examples import prompt_examples
from rlhf_core.data.sampler import global_batch
from rlhf_core.distributed.actor import PolicyActor
from rlhf_core.distributed.checkpoints import commit_checkpoint, fail_if_injected, newest_checkpoint, write_entry
from rlhf_core.distributed.cluster import Cluster, RayCluster, WorkerGroup
from rlhf_core.distributed.critic import CriticActor
from rlhf_core.distributed.placement import (
    PlacementPlan,
    RoleSet,
    actor_is_reference,
    check_fits,
    engine_kwargs,
    needs_kl,
    resource_demand,
    role_models,
    role_workers,
    row_multiple,
    weight_sync_backend,
)
from rlhf_core.distributed.reference import ReferencePolicy
from rlhf_core.distributed.reward import RewardScorer
from rlhf_core.distributed.role_base import RoleContext, TrainableRole
from rlhf_core.distributed.rollout.engine import SamplingConfig
from rlhf_core.jobs import common
from rlhf_core.jobs.async_rollout import AsyncRollout, Rollout, rollout_logs
from rlhf_core.models.builders import load_tokenizer, stop_ids
from rlhf_core.old_logprobs import engine_old_logprobs, old_logprobs_source, probe_rows
from rlhf_core.ppo_eval import HeldOut, summary_metrics
from rlhf_core.rewards import SOURCE_LOGS, RewardSources, Scored
from rlhf_core.storage import ObjectStore
from rlhf_core.tracking import Tracker
from rlhf_core.types import CheckpointRef

KIND = "ppo"


# ---------------------------------------------------------------------------------------------------------------------
# Controller set-up: the plan of steps


def plan_steps(p: PPOConfig, num_prompts: int) -> int:
    steps = num_prompts * p.train.num_episodes // p.train.rollout_batch_size
    return min(steps, p.train.max_steps) if p.train.max_steps is not None else steps


def optimizer_steps(p: PPOConfig, ppo_steps: int) -> int:
    samples = p.train.rollout_batch_size * p.rollout.n_samples_per_prompt
    return ppo_steps * samples // p.train.train_batch_size * p.algo.ppo_epochs


# ---------------------------------------------------------------------------------------------------------------------
# The controller's inputs: read from the run's files by ``load_inputs``, or made by hand (tests, benches)


@dataclasses.dataclass
class PPOInputs:
    """What the controller reads before any worker starts: the actor's tokenizer, the training prompts
    (``prompt_examples`` rows), the held-out prompts and the reward sources."""

    tokenizer: Any
    prompts: list[dict]
    held_out: HeldOut
    rewards: RewardSources


def load_inputs(stage: str, p: PPOConfig, setup: common.StageSetup) -> PPOInputs:
    """The inputs of a stage from its fetched models and its data files."""
    tokenizer = load_tokenizer(
        setup.paths["actor"], p.actor.model.tokenizer, trust_remote_code=p.actor.model.trust_remote_code
    )
    options = setup.store.fs.storage_options
    return PPOInputs(
        tokenizer=tokenizer,
        prompts=prompt_examples(p.data, tokenizer, "train", options),
        held_out=HeldOut.load(p, tokenizer, options),
        rewards=RewardSources.of(stage, p, setup.paths.get("reward")),
    )


# ---------------------------------------------------------------------------------------------------------------------
# The controller


class PPOController:
    def __init__(
        self,
        stage: str,
        p: PPOConfig,
        setup: common.StageSetup,
        train_actor: bool,
        roles: RoleSet,
        inputs: PPOInputs,
        cluster: Cluster,
    ):
        self.stage, self.p, self.setup, self.paths, self.train_actor = stage, p, setup, setup.paths, train_actor
        self.roles, self.cluster = roles, cluster
        self.store: ObjectStore = setup.store
        self.tokenizer = inputs.tokenizer
        self.pad_id, self.eos_id = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        self.stop_ids = stop_ids(self.paths["actor"], self.tokenizer)  # what the engines stop on, EOS among them
        train = p.train
        self.prompts = inputs.prompts
        self.held_out = inputs.held_out
        self.steps = plan_steps(p, len(self.prompts))
        if self.steps == 0:
            raise ConfigError(
                f"'{stage}.train.rollout_batch_size' = {train.rollout_batch_size} is larger than the "
                f"{len(self.prompts)} prompts x {train.num_episodes} episodes: no PPO step would run"
            )
        self.rewards = inputs.rewards
        self.rewards.check([e["prompt"] for e in self.prompts[:2]])  # before any worker starts
        self.kl_ctl = make_kl_controller(p.algo.kl_coef, p.algo.kl_target, p.algo.kl_horizon)
        # The critic warm-up's frozen actor is its own reference: its old log-probs are the reference's (no group).
        self.ref_from_actor = needs_kl(p.algo) and actor_is_reference(p, train_actor)
        self.device = ""  # where the roles run: decided by the cluster in start()
        # PPO steps in which the actor trains: its LR schedule spans only those (the frozen warm-up steps do not
        # count, so a decaying schedule completes on the last step).
        self.actor_ppo_steps = max(0, self.steps - train.freeze_actor_steps) if train_actor else 0
        self.actor: WorkerGroup[PolicyActor] | None = None
        self.critic: WorkerGroup[CriticActor] | None = None
        self.reward: WorkerGroup[RewardScorer] | None = None
        self.reference: WorkerGroup[ReferencePolicy] | None = None
        self.engines: Any = None
        self.rollout: AsyncRollout | None = None  # train.async_enable: the generator thread
        self.placement: dict[str, Any] = {}
        self.placement_groups: list[Any] = []
        self.started = False
        self.tracker = Tracker(None)  # run() opens the stage's trackers around fit()

    # -- start: the roles and engines, placed by the plan -------------------------------------------------------------
    def role_context(self, role: str) -> RoleContext:
        """What the trained role ``role`` ("actor" or "critic") gets on its ranks: its model (and LoRA adapters),
        strategy and optimizer, and the stage's batch, algorithm and run settings."""
        p, train = self.p, self.p.train
        section = p.actor if role == "actor" else p.critic
        model = section.model
        assert model is not None, f"{self.stage}: no {role} model"
        own: dict[str, Any] = (
            dict(
                total_optimizer_steps=optimizer_steps(p, self.actor_ppo_steps),
                max_new_tokens=p.rollout.max_new_tokens,
                trains=self.train_actor,
            )
            if role == "actor"
            else dict(total_optimizer_steps=optimizer_steps(p, self.steps), reward_stats=self.rewards.stats)
        )
        return RoleContext(
            role=role,
            model_path=self.setup.sources[role],
            tokenizer_path=model.tokenizer,
            init_seed=model.init_seed,
            trust_remote_code=model.trust_remote_code,
            lora=model.lora,
            aux_loss_coef=model.aux_loss_coef,
            strategy=section.strategy,
            optim=section.optim,
            stage=self.stage,
            micro_rollout_batch_size=train.micro_rollout_batch_size,
            algo=p.algo,
            seed=train.seed,
            run_uri=self.store.root_uri,
            storage_options=self.store.fs.storage_options,
            work_dir=self.setup.work,
            batch=TrainConfig(
                train_batch_size=train.train_batch_size, micro_train_batch_size=train.micro_train_batch_size
            ),
            temperature=p.rollout.temperature,
            max_tokens_per_micro_batch=train.max_tokens_per_micro_batch if train.dynamic_batch else None,
            **own,
        )

    def start(self) -> None:
        p, train, roles, sources, cluster = self.p, self.p.train, self.roles, self.setup.sources, self.cluster
        cluster.start(min_cpus=resource_demand(p, roles, "cpu")["CPU"])  # the CPUs asked do not depend on the device
        self.started = True
        self.device = cluster.device(p.actor.strategy.device)
        common.check_engine_backend(
            f"{self.stage}.rollout.backend", p.rollout.backend, self.device, self.setup.paths["actor"]
        )
        check_fits(self.stage, p, roles, self.device, cluster.resources(), cluster.nodes())
        plan = PlacementPlan.of(p, roles)
        bundles = {name: cluster.colocation(count, 1.0, self.device) for name, count in plan.groups.items()}
        self.placement_groups += list(bundles.values())

        def placed(role: str) -> dict[str, Any]:
            return {"placement": bundles.get(plan.roles[role].group), "share": plan.roles[role].share}

        self.engines = cluster.engines(
            p.rollout.num_engines,
            common.engine_model(self.setup, "actor", p.rollout.backend, p.actor.model.init_seed, self.tokenizer),
            eos_token_id=self.eos_id,
            backend=p.rollout.backend,
            resources=p.rollout.resources,
            tensor_parallel_size=p.rollout.tensor_parallel_size,
            num_cpus_per_engine=plan.engine_cpus,
            placement=bundles.get(plan.engine_group),
            share=plan.engine_share,
            **engine_kwargs(
                p.rollout,
                p.actor.model,
                p.actor.strategy.precision,
                self.device,
                train.seed,
                p.data.max_len,
                enable_sleep=p.rollout.enable_sleep,
            ),
        )
        if p.rollout.enable_sleep:
            # vLLM sizes its KV cache from the GPU memory free while it starts, device-wide: the roles that share its
            # GPUs load their models only once it is up and asleep (OpenRLHF's order), so it is charged for its own.
            self.engines.wait_ready()
            self.engines.sleep()
        actor_ctx = self.role_context("actor")
        self.actor = cluster.group(plan.roles["actor"].strategy, PolicyActor, actor_ctx, **placed("actor"))
        if roles.critic:  # critic-free estimators (REINFORCE++, GRPO, RLOO, ...) start no critic
            critic_ctx = self.role_context("critic")
            self.critic = cluster.group(plan.roles["critic"].strategy, CriticActor, critic_ctx, **placed("critic"))
        # The frozen roles (forwards only); frozen.zero_stage 3: one ZeRO-3 copy over the workers. They take the
        # actor's packing and attention kernel, so reference and actor log-probs come from the same kernel.
        micro, precision = train.micro_rollout_batch_size, p.actor.strategy.precision
        frozen = dict(
            zero_stage=p.frozen.zero_stage,
            offload=p.frozen.offload,
            packing=p.actor.strategy.packing,
            attn=p.actor.strategy.attn_implementation,
        )
        if roles.reward_model:  # rewards from a function or a server only: no reward-model workers
            rm = p.reward.model
            self.reward = cluster.group(
                plan.roles["reward"].strategy,
                RewardScorer,
                sources["reward"],
                micro,
                precision,
                tokenizer_path=rm.tokenizer,
                init_seed=rm.init_seed,
                trust_remote_code=rm.trust_remote_code,
                **frozen,
                **placed("reward"),
            )
        if roles.reference:
            ref = (
                p.reference.model or p.actor.model
            )  # default: the actor's starting model, with the actor's model keys
            self.reference = cluster.group(
                plan.roles["reference"].strategy,
                ReferencePolicy,
                sources["reference"],
                micro,
                precision,
                ref.init_seed,
                temperature=p.rollout.temperature,
                tokenizer_path=ref.tokenizer,
                trust_remote_code=ref.trust_remote_code,
                **frozen,
                **placed("reference"),
            )
        setups = self.actor.call_async(PolicyActor.setup)
        setups += self.critic.call_async(CriticActor.setup) if self.critic is not None else []
        cluster.wait(setups)
        self.engines.wait_ready()
        # Where the engines run, as their actors see it: colocate_all puts them in the roles' shared group.
        shared = cluster.placement_id(bundles[plan.engine_group]) if plan.engine_group is not None else None
        self.placement = {"shared_group": shared, "engine_groups": self.engines.placement_group_ids()}
        # The weight transport: "auto" resolved from the device and colocate_all; a GPU transport on CPU is refused.
        sync_backend = weight_sync_backend(self.stage, p, self.device)
        is_vllm, bucket_mb = p.rollout.backend == "vllm", p.rollout.weight_sync_bucket_mb
        self.actor.call(PolicyActor.connect_engines, self.engines.handles, is_vllm, sync_backend, bucket_mb)

    def shutdown(self) -> None:
        if self.rollout is not None:  # its thread first: it calls the engines
            self.rollout.stop()
        for group in (self.actor, self.critic, self.reward, self.reference, self.engines):
            if group is not None:
                group.shutdown()
        for bundles in self.placement_groups:  # the colocation groups' reserved CPUs/GPUs back to the cluster
            self.cluster.release(bundles)
        self.placement_groups = []
        if self.started:
            self.started = False
            self.cluster.stop()

    # -- experience ---------------------------------------------------------------------------------------------------
    def experience(
        self,
        prompt_ids: list[list[int]],
        responses: list[list[int]],
        prompts: list,
        timer: timing.PhaseTimer | None = None,
        old: str = "forward",
        engine_logprobs: list[list[float]] | None = None,
    ) -> Scored:
        """Old and reference log-probs, values (with a critic) and the summed reward sources, the roles concurrently
        on their shards while the driver calls the reward function and server. The reward model scores prompt +
        response + EOS where a response was cut (``ensure_eos``), as it was trained. ``timer``: each role's seconds
        from the first dispatch to its last result, as ``experience_<role>``. ``old``: where the old log-probs come
        from (``rlhf_core.old_logprobs``); ``engine_logprobs``: the engines' per-response log-probs."""
        assert self.actor is not None
        n = len(responses) // len(prompt_ids)
        expanded = [ids for ids in prompt_ids for _ in range(n)]
        seq = make_sequences(expanded, responses, self.pad_id)
        closed, truncated = ensure_eos(responses, self.eos_id, self.stop_ids)
        engine_lp = engine_logprob_tensor(seq, engine_logprobs) if engine_logprobs is not None else None
        assert old == "forward" or engine_lp is not None, f"old log-probs from {old} need the engines' log-probs"
        started = time.perf_counter()
        shards, refs = seq.shard(len(self.actor)), {}
        if old == "engine":  # the actor scores the first micro-batch of each rank's shard: the gap's probe
            shards = [s.split(self.p.train.micro_rollout_batch_size)[0] for s in shards]
        if old != "training":
            refs["actor"] = self.actor.call_each_async(PolicyActor.logprobs, shards)
        if self.reference is not None:
            refs["reference"] = self.reference.call_each_async(
                ReferencePolicy.logprobs, seq.shard(len(self.reference))
            )
        if self.critic is not None:
            refs["critic"] = self.critic.call_each_async(CriticActor.values, seq.shard(len(self.critic)))
        if self.reward is not None:
            scored = make_sequences(expanded, closed, self.pad_id)
            refs["reward"] = self.reward.call_each_async(RewardScorer.scores, scored.shard(len(self.reward)))
        raw = [pr for pr in prompts for _ in range(n)]
        parts, keep = self.rewards.score_on_driver(self.tokenizer, raw, responses, timer)
        out, seconds = self.cluster.wait_timed(refs, started)
        if timer is not None:
            for role, sec in seconds.items():
                timer.add(f"experience_{role}", sec)
        if "reward" in out:
            parts["reward"] = torch.cat(out["reward"])
        old_logprobs, logs = self.old_logprobs(seq, old, engine_lp, out.get("actor"), timer)
        ref_logprobs = torch.cat(out["reference"]) if "reference" in out else None
        if ref_logprobs is None and self.ref_from_actor:
            ref_logprobs = old_logprobs
        exp = Experience.from_sequences(
            seq,
            old_logprobs=old_logprobs,
            scores=self.rewards.combine(parts),
            values=torch.cat(out["critic"]) if "critic" in out else None,
            ref_logprobs=ref_logprobs,
            truncated=truncated,
            rollout_logprobs=engine_lp if old_logprobs is None else None,
        )
        return Scored(exp, parts, keep, logs)

    def old_logprobs(
        self,
        seq: Any,
        old: str,
        engine_lp: torch.Tensor | None,
        actor_out: list[torch.Tensor] | None,
        timer: timing.PhaseTimer | None,
    ) -> tuple[torch.Tensor | None, dict[str, float]]:
        """The old log-probs (B, T-1) from ``old`` (``rlhf_core.old_logprobs``; None: "training") and their metrics:
        ``old_logprob_forward_rows`` (rows the actor's experience forward scored), ``old_logprobs_engine`` (1: the
        engines' are the old ones). A fallen-back "engine" step's whole forward counts in ``experience_actor``."""
        if old == "training":
            return None, {"old_logprob_forward_rows": 0.0, "old_logprobs_engine": 0.0}
        assert self.actor is not None and actor_out is not None
        if old == "engine":
            assert engine_lp is not None
            probed = probe_rows(seq.size, len(self.actor), self.p.train.micro_rollout_batch_size)
            bound = self.p.algo.rollout_logprobs_max_diff
            engine_old, logs, why = engine_old_logprobs(seq, engine_lp, probed, torch.cat(actor_out), bound)
            if engine_old is not None:
                return engine_old, {**logs, "old_logprob_forward_rows": float(len(probed)), "old_logprobs_engine": 1.0}
            print(f"[{self.stage}] {why}: the actor's forward gives this step's old log-probs", flush=True)
            started = time.perf_counter()
            actor_out = self.actor.call_each(PolicyActor.logprobs, seq.shard(len(self.actor)))
            if timer is not None:
                timer.add("experience_actor", time.perf_counter() - started)
        return torch.cat(actor_out), {"old_logprob_forward_rows": float(seq.size), "old_logprobs_engine": 0.0}

    # -- advantages ---------------------------------------------------------------------------------------------------
    def advantages(
        self, scored: Scored, engine_logprobs: torch.Tensor | None = None
    ) -> tuple[Experience, dict[str, float]]:
        """Rewards -> penalties and clip -> group shaping -> token rewards (KL penalty with kl_mode=reward) -> GAE,
        or the returns (critic-free: the advantage is the return). Samples dropped by the reward function's ``keep``
        or ``algo.dynamic_filter`` lose their action tokens. ``engine_logprobs``: (B, T-1) the engines' log-probs
        (NaN where none), for the off-policy correction's weights (``algo.is_correction``, ``is_correction_cap``)."""
        algo, exp = self.p.algo, scored.exp
        # Missing-EOS penalty after normalisation and before clipping, as OpenRLHF adds its length penalties (DAPO
        # overlong, ProRL stop-properly) to the normalised reward before compute_reward clamps it.
        scores = exp.scores
        if exp.truncated is not None:
            scores = apply_missing_eos_penalty(scores, exp.truncated, algo.missing_eos_penalty)
        scores = clip_scores(scores, *algo.reward_clip)
        n = self.p.rollout.n_samples_per_prompt
        keep = scored.keep if scored.keep is not None else torch.ones(exp.size, dtype=torch.bool)
        if algo.dynamic_filter:
            keep = keep & varied_groups(scores, n)
        mask = exp.action_mask
        # (B, T-1) KL to the reference on the action tokens; 0 without reference log-probs (no KL), or without old
        # log-probs (the actor measures it in its training forward; such a step has no KL in its rewards)
        if exp.ref_logprobs is None or exp.old_logprobs is None:
            kl = torch.zeros(mask.shape)
        else:
            kl = approx_kl(exp.old_logprobs, exp.ref_logprobs, mask, algo.kl_estimator)
        penalty = self.kl_ctl.value if algo.kl_mode == "reward" else 0.0
        rewards = token_rewards(shape_scores(scores, n, algo.advantage_estimator), kl, mask, penalty)
        if algo.advantage_estimator == "gae":
            assert exp.values is not None, "gae needs the critic's values"
            exp = exp.with_advantages(*gae(rewards, exp.values, mask, algo.gamma, algo.lam))
        else:
            returns = cumulative_returns(rewards, mask, algo.gamma)
            exp = exp.with_advantages(returns, returns)
        is_logs: dict[str, float] = {}
        correction = is_correction_setting(algo.is_correction, algo.is_correction_threshold, algo.is_correction_cap)
        # without old log-probs the actor weighs its loss from its training forward's log-probs
        if correction is not None and engine_logprobs is not None and exp.old_logprobs is not None:
            weights, is_logs = is_correction_weights(exp.old_logprobs, engine_logprobs, mask, *correction)
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
            **is_logs,
        }
        if algo.dynamic_filter or scored.keep is not None:
            logs["filtered_frac"] = 1.0 - keep.float().mean().item()
        return exp, logs

    # -- train --------------------------------------------------------------------------------------------------------
    def train(
        self, exp: Experience, step: int, actor_frozen: bool, timer: timing.PhaseTimer | None = None
    ) -> dict[str, float]:
        """The PPO epochs of critic (when there is one) and actor (unless ``actor_frozen``), concurrently; rank 0's
        stats and the learning rates. ``timer``: each group's seconds as ``critic_train`` and ``actor_train``."""
        assert self.actor is not None
        if self.p.algo.kl_mode != "loss":
            exp = dataclasses.replace(exp, ref_logprobs=None)  # the trained roles do not read it
        started = time.perf_counter()
        refs = {}
        if self.critic is not None:
            critic_exp = dataclasses.replace(exp, ref_logprobs=None, is_weights=None, rollout_logprobs=None)
            critic_shards = critic_exp.shard(len(self.critic))
            refs["critic_train"] = self.critic.call_each_async(CriticActor.fit, critic_shards, step)
        if not actor_frozen:
            refs["actor_train"] = self.actor.call_each_async(
                PolicyActor.fit, exp.shard(len(self.actor)), step, self.kl_ctl.value
            )
        out, seconds = self.cluster.wait_timed(refs, started)
        if timer is not None:
            for name, sec in seconds.items():
                timer.add(name, sec)
        stats: dict[str, float] = {}
        if not actor_frozen:
            stats.update(out["actor_train"][0])
        if self.critic is not None:
            stats.update(out["critic_train"][0])
        # The learning rates after this step (the scheduler has stepped); the warm-up's frozen actor has none.
        if self.train_actor:
            stats["actor_lr"] = self.actor.call(PolicyActor.lr)[0]
        if self.critic is not None:
            stats["critic_lr"] = self.critic.call(CriticActor.lr)[0]
        return stats

    def move_training_states(self, offload: bool, timer: timing.PhaseTimer | None = None) -> None:
        """``placement.offload_states_during_rollout``: the trained roles' optimizer states and gradients to host
        memory while the engines generate (``offload``), back before training (not on CPU). ``timer``:
        ``offload_states``."""
        if self.p.placement.offload_states_during_rollout:
            assert self.actor is not None
            method = TrainableRole.offload_states if offload else TrainableRole.reload_states
            started = time.perf_counter()
            groups = [g for g in (self.actor if self.train_actor else None, self.critic) if g is not None]
            self.cluster.wait([ref for g in groups for ref in g.call_async(method)])
            if timer is not None:
                timer.add("offload_states", time.perf_counter() - started)

    # -- push weights -------------------------------------------------------------------------------------------------
    def push_weights(self) -> dict[str, float]:
        """Sync the engines to the actor; rank 0's metrics (weight_sync_s, _buckets, _broadcasts)."""
        assert self.actor is not None
        self.engines.wake_up(["weights"])  # sleeping engines take the weights first; the KV cache waits for a rollout
        return self.actor.call(PolicyActor.push_weights)[0]

    @contextlib.contextmanager
    def engines_awake(self) -> Iterator[None]:
        """What the engines do outside a rollout (the sync probes, the evaluations) done as a rollout is: with the
        trained roles' optimizer states in host memory (``placement.offload_states_during_rollout``) and the engines
        asleep again afterwards (``rollout.enable_sleep``), so their KV cache never meets the training states on a
        shared GPU."""
        self.move_training_states(offload=True)
        try:
            yield
        finally:
            self.engines.sleep()
            self.move_training_states(offload=False)

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

    # -- evaluation ---------------------------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """One sampled response per held-out prompt (a fixed seed: before and after alike), scored as in training."""
        if not self.held_out.examples:
            return {}
        responses = self.engines.generate(self.held_out.prompt_ids, self.held_out.sampling(self.p))
        scored = self.experience(*self.held_out.batch(responses, row_multiple(self.p, self.roles)))
        return self.held_out.metrics(scored.exp, scored.parts, responses, self.tokenizer)

    # -- checkpoints --------------------------------------------------------------------------------------------------
    def save_checkpoint(self, state: dict) -> None:
        """The trained roles' shards and the controller state; the critic warm-up's actor (its starting model, no
        optimizer) has none."""
        assert self.actor is not None
        rel = run_layout.checkpoint(self.stage, state["step"])
        files: dict[str, dict] = {}
        workers: dict[str, int] = {}  # per group: the ranks that wrote the shards (commit_checkpoint)
        if self.train_actor:
            files.update(self.actor.call(PolicyActor.save_shards, rel)[0])
            workers["actor.strategy.num_workers"] = len(self.actor)
        if self.critic is not None:
            files.update(self.critic.call(CriticActor.save_shards, rel)[0])
            workers["critic.strategy.num_workers"] = len(self.critic)
        state = dict(state, kl_ctl=self.kl_ctl.state_dict())
        name = run_layout.CONTROLLER_STATE
        files[name] = write_entry(self.store, f"{rel}/{name}", json.dumps(state))
        commit_checkpoint(
            self.store, rel, self.stage, self.setup.config_hash, files, state["step"], workers, self.p.train.keep_last
        )

    def load_checkpoint(self, rel: str) -> dict:
        assert self.actor is not None
        if self.train_actor:
            self.actor.call(PolicyActor.load_shards, rel)
        if self.critic is not None:
            self.critic.call(CriticActor.load_shards, rel)
        state = json.loads(self.store.read_text(f"{rel}/{run_layout.CONTROLLER_STATE}"))
        self.kl_ctl.load_state_dict(state.pop("kl_ctl"))
        return state

    # -- fit: the loop ------------------------------------------------------------------------------------------------
    def rollout_sampling(self, step: int) -> SamplingConfig:
        """How step ``step`` samples its rollout: the rollout's settings, a seed of its own, and per-prompt seeds or
        the engines' own generators (``rollout.seed_per_prompt`` on the cluster's device)."""
        r = self.p.rollout
        return SamplingConfig(
            n=r.n_samples_per_prompt,
            temperature=r.temperature,
            top_p=r.top_p,
            max_new_tokens=r.max_new_tokens,
            seed=self.p.train.seed * 100_003 + step,
            seed_per_prompt=r.seeds_each_prompt(self.device),
        )

    def generate(self, step: int, turn: Callable[[], ContextManager] | None = None) -> Rollout:
        """Step ``step``'s rollout (``async_rollout``: on the generator thread, up to async_queue_size steps ahead;
        partial: in ``turn``s, between which weight syncs come)."""
        indices = global_batch(len(self.prompts), self.p.train.rollout_batch_size, step, self.p.train.seed)
        prompt_ids, sampling = [self.prompts[i]["prompt_ids"] for i in indices], self.rollout_sampling(step)
        if turn is not None:
            return self.engines.generate_partial(prompt_ids, sampling, turn)
        return (*self.engines.generate_with_logprobs(prompt_ids, sampling), None)

    def async_rollout(self) -> AsyncRollout | None:
        """train.async_enable: the generator thread's queue of rollouts (partial: train.partial_rollout_enable)."""
        t = self.p.train
        return AsyncRollout(self.generate, t.async_queue_size, t.partial_rollout_enable) if t.async_enable else None

    def step_phases(self) -> list[str]:
        """The phases every step logs as ``timing/<phase>_s`` (0.0 when one did not run that step), besides
        ``timing/step_s``; ``experience_<role>``, ``critic_train`` and ``actor_train`` overlap within their phase."""
        p, roles = self.p, self.roles
        forwards = ["actor", *(["reference"] if roles.reference else [])]
        forwards += ["critic"] if roles.critic else []
        forwards += ["reward"] if roles.reward_model else []
        forwards += ["reward_fn"] if p.reward_fn is not None else []
        forwards += ["remote_rm"] if p.remote_rm_url is not None else []
        phases = ["generation", "experience", *(f"experience_{f}" for f in forwards), "advantages", "train"]
        phases += ["critic_train"] if roles.critic else []
        phases += ["actor_train", "weight_sync", "checkpoint"]
        return (["offload_states"] if p.placement.offload_states_during_rollout else []) + phases

    def fit(self) -> dict:
        train, stage = self.p.train, self.stage
        state: dict[str, Any] = {"step": 0, "episode": 0, "consumed_prompts": 0, "history": [], "before": None}
        found = newest_checkpoint(self.store, stage, self.setup.config_hash)
        if found is not None:
            state = self.load_checkpoint(found[1])
            print(f"[{stage}] resumed from {self.store.uri(found[1])} at step {state['step']}", flush=True)
            events.resumed(stage, state["step"])
            if self.train_actor:
                self.push_weights()  # the engines start from the initial policy: give them the checkpointed one
        resumed_from = state["step"]
        eval_before_s = 0.0  # the evaluation before training, within the start-up (none on a resume: it is saved)
        with self.engines_awake():
            engine_lp_start, _ = self.probe_logprobs()
            if state["before"] is None:
                t0 = time.perf_counter()
                state["before"] = self.evaluate()
                eval_before_s = time.perf_counter() - t0
                print(f"[{stage}] before: {_fmt(state['before'])}", flush=True)

        fail_after = common.fail_after_step()
        startup_s = timing.since_job_start()
        n_eval = len(self.held_out.examples)
        evaluating = f" ({eval_before_s:.1f}s of it evaluating {n_eval} prompts)" if eval_before_s and n_eval else ""
        print(f"[{stage}] first step {startup_s:.1f}s after the job started{evaluating}", flush=True)
        self.rollout = self.async_rollout()  # a thread generates the next steps' rollouts while this loop trains
        batches = self.rollout.batches(state["step"], self.steps) if self.rollout else None
        update = self.rollout.weight_update if self.rollout else contextlib.nullcontext
        for step in range(state["step"], self.steps):
            timer = timing.PhaseTimer(self.step_phases())
            # 1. rollout: step k reads prompts [k*R, (k+1)*R) of the seeded prompt stream
            indices = global_batch(len(self.prompts), train.rollout_batch_size, step, train.seed)
            prompt_ids = [self.prompts[i]["prompt_ids"] for i in indices]
            prompts = [self.prompts[i]["prompt"] for i in indices]
            self.move_training_states(offload=True, timer=timer)
            with timer.phase("generation"):  # async: the wait for the thread's batch
                record, rollout = next(batches) if batches else (None, self.generate(step))
                responses, engine_logprobs, versions = rollout
                assert record is None or record.index == step, f"step {step} got batch {record.index}"
                self.engines.sleep()  # rollout.enable_sleep: the engines' GPU memory is the trainers' until the sync
            # 2. experience (the old log-probs: the actor's forward, its training forward's, or the engines')
            actor_frozen = not self.train_actor or step < train.freeze_actor_steps
            old = old_logprobs_source(self.p, actor_frozen, self.ref_from_actor)
            with timer.phase("experience"):
                scored = self.experience(prompt_ids, responses, prompts, timer, old, engine_logprobs)
            # 3. rewards (sources summed, penalties, group shaping, KL penalty) and advantages (GAE or returns)
            with timer.phase("advantages"):
                engine_lp = engine_logprob_tensor(scored.exp, engine_logprobs)
                exp, logs = self.advantages(scored, engine_lp)
                logs.update(scored.logs)
                # The engines were synced after the last update: they sampled from the policy the actor now scores.
                # (Old log-probs from the training forward: the actor measures it; the engines': the probe did.)
                if scored.exp.old_logprobs is not None and not scored.logs["old_logprobs_engine"]:
                    logs["rollout_logprob_max_diff"] = rollout_logprob_gap(scored.exp, engine_lp)
            # 4. PPO epochs: the critic always trains, the actor after the frozen warm-up steps
            self.move_training_states(offload=False, timer=timer)
            with timer.phase("train"):
                logs.update(self.train(exp, step, actor_frozen, timer))
            # 5. weight sync to the engines
            if not actor_frozen:
                with timer.phase("weight_sync"), update():
                    sync = self.push_weights()
                logs.update(sync)
                logs["sync_s"] = sync["weight_sync_s"]
            if record is not None:  # the weight updates the step's rollout lagged (<= train.async_queue_size)
                logs.update(rollout_logs(record, versions))
            self.kl_ctl.update(logs["kl_token_mean"], len(responses))
            # 6. logging and checkpoints
            state["step"], state["consumed_prompts"] = step + 1, (step + 1) * train.rollout_batch_size
            state["episode"] = state["consumed_prompts"] // len(self.prompts)
            entry = {"step": step + 1, "prompts": indices, "actor_frozen": actor_frozen, **logs}
            state["history"].append(entry)
            checkpoint = train.save_steps and (step + 1) % train.save_steps == 0 and step + 1 < self.steps
            if checkpoint:
                entry.update(timer.as_logs())  # the checkpoint's own copy: this step's timing so far
                with timer.phase("checkpoint"):
                    self.save_checkpoint(state)
            step_timing = timer.as_logs()
            logs.update(step_timing)
            entry.update(step_timing)
            if (step + 1) % train.log_steps == 0 or step + 1 == self.steps:
                seconds = step_timing[timing.STEP_KEY]
                print(f"[{stage}] step {step + 1}/{self.steps} {_fmt(logs)} ({seconds:.1f}s)", flush=True)
                events.step(stage, step + 1, self.steps, logs)
                self.tracker.log(step + 1, logs)
            if checkpoint:
                fail_if_injected(fail_after, step + 1)

        with self.engines_awake():
            after = self.evaluate()
            # Proof of the weight sync: the engines now compute what the trained actor computes.
            probes = (*self.probe_logprobs(), engine_lp_start)
        print(f"[{stage}] after: {_fmt(after)}", flush=True)
        metrics: dict[str, Any] = {
            "steps": self.steps,
            "resumed_from_step": resumed_from,
            "startup_s": startup_s,
            "eval_before_s": eval_before_s,
        }
        metrics.update(summary_metrics(state["history"], state["before"], after, probes))
        self.history = state["history"]
        return metrics


def _fmt(logs: dict) -> str:
    return " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in logs.items())


# ---------------------------------------------------------------------------------------------------------------------
# Entry points


def run(
    cfg: PipelineConfig, stage: str = KIND, train_actor: bool = True, cluster: Cluster | None = None
) -> CheckpointRef:
    """The stage on ``cluster`` (default: Ray)."""
    # 1. inputs: config hash (with the upstream outputs' hashes), finished output, then the models
    p = as_ppo(cfg.stage(stage))  # a critic warm-up's section with PPO's actor defaults
    roles = RoleSet.of(p, train_actor)
    setup = common.setup_stage(cfg, stage, role_models(p, roles))
    if setup.done is not None:
        return setup.done
    store, work, upstream, config_hash = setup.store, setup.work, setup.upstream, setup.config_hash

    # 2. data and checks, before any Ray actor starts
    inputs = load_inputs(stage, p, setup)
    cluster = RayCluster() if cluster is None else cluster
    controller = PPOController(stage, p, setup, train_actor, roles, inputs, cluster)

    # 3. roles, the loop (its steps also to the experiment trackers, closed as failed when the stage raises), outputs
    try:
        with Tracker(setup.tracking) as controller.tracker:
            controller.start()
            metrics = controller.fit()
        extra = {"upstream": upstream}
        assert controller.actor is not None
        if train_actor and p.train.save_critic and controller.critic is not None:
            controller.critic.call(CriticActor.export, run_layout.critic(stage), config_hash, metrics, extra)
        store.write_json(
            run_layout.metrics(stage),
            {
                "history": controller.history,
                "final": metrics,
                "roles": {**role_workers(p, roles), "engines": p.rollout.num_engines},
                "placement": controller.placement,
            },
        )
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
