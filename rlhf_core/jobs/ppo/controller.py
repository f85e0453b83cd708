"""The PPO controller and its loop: a single controller driving actor, critic, reward-model and reference Ray groups
and rollout engines.

After OpenRLHF: the actor starts from ``ppo.actor`` (usually ``stage:sft``), the critic from ``ppo.critic``
(``stage:critic_warmup`` or ``stage:critic_init``); reward model and reference are frozen. Each step of ``fit``:

  1. rollout      the engines (vLLM, or HF generate) sample n responses per prompt, with each token's log-prob
                  (``async_rollout``: on a thread ahead of the loop)
  2. experience   actor and reference log-probs, critic values, the summed reward sources (``experience``; the old
                  log-probs' source from ``old_logprobs``)
  3. advantages   penalised and clipped rewards, group shaping, token-level KL penalty, then GAE or returns
  4. PPO epochs   actor and critic together, each on its shards of the experience
  5. weight sync  the actor's new weights to the engines over a collective group (no disk)
  6. logging      the step's metrics with each phase's ``timing/<phase>_s``; every ``save_steps`` a checkpoint

Before and after the loop the held-out evaluation (``evaluation``). Critic-free estimators start no critic, a stage
without ``reward`` no reward model, one without a KL no reference (``roles``); the critic warm-up runs this loop, its
actor frozen. Writes ``ppo/`` (policy), ``ppo/critic/``, ``ppo/metrics.json``.

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

from rlhf_core import curves, events, run_layout, timing
from rlhf_core.algos.experience import Experience
from rlhf_core.algos.logprob_gap import engine_logprob_tensor, rollout_logprob_gap
from rlhf_core.algos.ppo import make_kl_controller
from rlhf_core.config import ConfigError, PipelineConfig, PPOConfig, as_ppo
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
from rlhf_core.jobs import input_checks, process, stage_setup
from rlhf_core.jobs.ppo.async_rollout import AsyncRollout, Rollout, rollout_logs
from rlhf_core.jobs.ppo.evaluation import HeldOut, check_engine_sync, probe_logprobs, summary_metrics
from rlhf_core.jobs.ppo.experience import ExperienceMaker, advantages
from rlhf_core.jobs.ppo.old_logprobs import old_logprobs_source
from rlhf_core.jobs.ppo.roles import reference_group, reward_group, role_context
from rlhf_core.models.builders import load_tokenizer, stop_ids
from rlhf_core.rewards import Columns, RewardSources
from rlhf_core.storage import ObjectStore
from rlhf_core.tracking import Tracker
from rlhf_core.types import CheckpointRef

KIND = "ppo"


# ---------------------------------------------------------------------------------------------------------------------
# Controller set-up: the plan of steps


def plan_steps(p: PPOConfig, num_prompts: int) -> int:
    steps = num_prompts * p.train.num_episodes // p.train.rollout_batch_size
    return min(steps, p.train.max_steps) if p.train.max_steps is not None else steps


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


def load_inputs(stage: str, p: PPOConfig, setup: stage_setup.StageSetup) -> PPOInputs:
    """The inputs of a stage from its fetched models and its data files."""
    tokenizer = load_tokenizer(
        setup.paths["actor"], p.actor.model.tokenizer, trust_remote_code=p.actor.model.trust_remote_code
    )
    options = setup.store.fs.storage_options
    return PPOInputs(
        tokenizer=tokenizer,
        prompts=prompt_examples(p.data, tokenizer, "train", options),
        held_out=HeldOut.load(p, tokenizer, options, stage),
        rewards=RewardSources.of(stage, p, setup.paths.get("reward")),
    )


# ---------------------------------------------------------------------------------------------------------------------
# The controller


class PPOController:
    def __init__(
        self,
        stage: str,
        p: PPOConfig,
        setup: stage_setup.StageSetup,
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
        # before any worker starts: the reward function takes the data's columns and answers
        self.rewards.check([e["prompt"] for e in self.prompts[:2]], self.columns(self.prompts[:2]))
        self.kl_ctl = make_kl_controller(p.algo.kl_coef, p.algo.kl_target, p.algo.kl_horizon)
        # The critic warm-up's frozen actor is its own reference: its old log-probs are the reference's (no group).
        self.ref_from_actor = p.algo.needs_kl and actor_is_reference(p, train_actor)
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
        """The context of the trained role ``role`` ("actor" or "critic") for this stage's plan of steps."""
        steps, actor_steps, stats = self.steps, self.actor_ppo_steps, self.rewards.stats
        return role_context(self.stage, self.p, self.setup, role, self.train_actor, steps, actor_steps, stats)

    def start(self) -> None:
        p, train, roles, sources, cluster = self.p, self.p.train, self.roles, self.setup.sources, self.cluster
        cluster.start(min_cpus=resource_demand(p, roles, "cpu")["CPU"])  # the CPUs asked do not depend on the device
        self.started = True
        self.device = cluster.device(p.actor.strategy.device)
        input_checks.check_engine_backend(
            f"{self.stage}.rollout.backend", p.rollout.backend, self.device, self.setup.paths["actor"]
        )
        check_fits(self.stage, p, roles, self.device, cluster.resources(), cluster.nodes())
        plan = PlacementPlan.of(p, roles)
        # looked up by a role's or the engines' group, None when it has no colocation bundle
        bundles: dict[str | None, Any] = {
            name: cluster.colocation(count, 1.0, self.device) for name, count in plan.groups.items()
        }
        self.placement_groups += list(bundles.values())

        def placed(role: str) -> dict[str, Any]:
            return {"placement": bundles.get(plan.roles[role].group), "share": plan.roles[role].share}

        self.engines = cluster.engines(
            p.rollout.num_engines,
            stage_setup.engine_model(self.setup, "actor", p.rollout.backend, p.actor.model.init_seed, self.tokenizer),
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
        # The frozen roles (forwards only): the reward model (rewards from a function or a server only: no workers)
        # and the reference.
        if roles.reward_model:
            self.reward = reward_group(cluster, p, plan.roles["reward"].strategy, sources["reward"], placed("reward"))
        if roles.reference:
            strategy = plan.roles["reference"].strategy
            self.reference = reference_group(cluster, p, strategy, sources["reference"], placed("reference"))
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

    # -- experience: what phase 2 and the evaluations call ------------------------------------------------------------
    def experience_maker(self) -> ExperienceMaker:
        """The experience phase on the role groups as they are now (started, or set by hand)."""
        assert self.actor is not None
        return ExperienceMaker(
            self.stage,
            self.p,
            self.actor,
            self.critic,
            self.reward,
            self.reference,
            self.cluster,
            self.rewards,
            self.tokenizer,
            self.pad_id,
            self.eos_id,
            self.stop_ids,
            self.ref_from_actor,
        )

    # -- train --------------------------------------------------------------------------------------------------------
    def train(
        self, exp: Experience, step: int, actor_frozen: bool, timer: timing.PhaseTimer | None = None
    ) -> dict[str, float]:
        """The PPO epochs of critic (when there is one) and actor (unless ``actor_frozen``), concurrently; rank 0's
        stats and the learning rates. ``timer``: each group's seconds as ``critic_train`` and ``actor_train``."""
        assert self.actor is not None
        if not self.p.algo.kl_in_loss:
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
    def columns(self, examples: list[dict]) -> Columns:
        """What the reward function may take of these prompts' rows: their labels and other columns."""
        return Columns.of(examples, f"{self.stage}.data.label_key")

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
        maker, multiple = self.experience_maker(), row_multiple(self.p, self.roles)
        probe_ids = self.prompts[0]["prompt_ids"]
        eval_before_s = 0.0  # the evaluation before training, within the start-up (none on a resume: it is saved)
        with self.engines_awake():
            engine_lp_start, _ = probe_logprobs(self.engines, maker.actor, probe_ids, self.tokenizer, self.pad_id)
            if state["before"] is None:
                t0 = time.perf_counter()
                state["before"] = self.held_out.evaluate(self.engines, maker, multiple)
                eval_before_s = time.perf_counter() - t0
                print(f"[{stage}] before: {_fmt(state['before'])}", flush=True)

        fail_after = process.fail_after_step()
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
            columns = self.columns([self.prompts[i] for i in indices])  # labels travel with their prompts
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
                scored = maker.make(prompt_ids, responses, prompts, timer, old, engine_logprobs, columns)
            # 3. rewards (sources summed, penalties, group shaping, KL penalty) and advantages (GAE or returns)
            with timer.phase("advantages"):
                engine_lp = engine_logprob_tensor(scored.exp, engine_logprobs)
                exp, logs = advantages(scored, self.p, self.kl_ctl.value, engine_lp)
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
            after = self.held_out.evaluate(self.engines, maker, multiple)
            # Proof of the weight sync: the engines now compute what the trained actor computes.
            probes = (
                *probe_logprobs(self.engines, maker.actor, probe_ids, self.tokenizer, self.pad_id),
                engine_lp_start,
            )
        print(f"[{stage}] after: {_fmt(after)}", flush=True)
        metrics: dict[str, Any] = {
            "steps": self.steps,
            "resumed_from_step": resumed_from,
            "startup_s": startup_s,
            "eval_before_s": eval_before_s,
        }
        metrics.update(summary_metrics(state["history"], state["before"], after, probes))
        check_engine_sync(self.stage, metrics, self.p.train.sync_check_tolerance, self.p.actor.strategy.precision)
        # which rewards the evaluation used: named in the log (the final metrics hold numbers only)
        print(f"[{self.stage}] evaluated with {_fmt(self.held_out.described())}", flush=True)
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
    setup = stage_setup.setup_stage(cfg, stage, role_models(p, roles))
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


def main(argv: list[str] | None = None) -> None:
    """``python -m rlhf_core.jobs.ppo``: the stage under its lease (``jobs.process.main``)."""
    process.main(KIND, run, argv)
