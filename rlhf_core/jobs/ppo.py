"""PPO stage: a single controller driving actor, critic, reward and reference Ray groups and rollout engines.

After OpenRLHF's design: the actor (policy, DeepSpeed) starts from ``ppo.actor`` (usually ``stage:sft``), the critic
from ``ppo.critic`` (``stage:critic_warmup`` or ``stage:critic_init``), the reward model and the reference policy
are frozen. Each PPO step reads like its phases:

  1. rollout      the engines (vLLM, or HF generate) sample n responses per prompt
  2. experience   actor and reference log-probs, critic values, reward-model scores
  3. advantages   normalised and clipped scores, token-level KL penalty, GAE
  4. PPO epochs   actor (clipped policy loss, advantages whitened across all actor ranks) and critic together
  5. weight sync  the actor's new weights go to the engines over a collective group (no disk)
  6. logging      and, every ``save_steps``, a checkpoint of actor, critic and controller state

Writes ``<run_uri>/ppo/`` (the policy, Hugging Face format), ``<run_uri>/ppo/critic/`` and
``<run_uri>/ppo/metrics.json``. The critic warm-up stage runs this same loop with the actor frozen throughout.

    python -m rlhf_core.jobs.ppo --config deployments/configs/tiny.yaml
    python -m rlhf_core.jobs.ppo --config deployments/configs/tiny.yaml ppo.rollout.backend=hf ppo.train.max_steps=4
"""

from __future__ import annotations

import importlib
import json
import math
import shutil
import time
from dataclasses import replace
from typing import Any, Callable

import torch

from rlhf_core.algos.batching import make_sequences, shard_batch
from rlhf_core.algos.ppo import approx_kl, clip_scores, gae, make_kl_controller, normalize_scores, token_rewards
from rlhf_core.config import ConfigError, PipelineConfig, PPOConfig, StrategyConfig, TrainConfig
from rlhf_core.data.examples import prompt_examples
from rlhf_core.data.sampler import global_batch
from rlhf_core.distributed import launcher
from rlhf_core.distributed.trainer import checkpoint_rel, newest_checkpoint, prune_checkpoints, write_entry
from rlhf_core.jobs import common
from rlhf_core.models.builders import BUILTIN_PREFIX, load_tokenizer
from rlhf_core.storage import ObjectStore
from rlhf_core.types import CheckpointRef

STAGE = "ppo"


# ---------------------------------------------------------------------------------------------------------------------
# Checks made before any Ray actor starts


def plan_steps(p: PPOConfig, num_prompts: int) -> int:
    steps = num_prompts * p.train.num_episodes // p.train.rollout_batch_size
    return min(steps, p.train.max_steps) if p.train.max_steps is not None else steps


def optimizer_steps(p: PPOConfig, ppo_steps: int) -> int:
    samples = p.train.rollout_batch_size * p.rollout.n_samples_per_prompt
    return ppo_steps * samples // p.train.train_batch_size * p.algo.ppo_epochs


def resource_demand(p: PPOConfig, device: str) -> dict[str, float]:
    """Ray resources the roles and engines ask for (colocated roles share their partner's devices)."""
    a, c = p.actor_strategy, p.critic_strategy
    cpus = a.num_workers * a.cpus_per_worker + c.num_workers * c.cpus_per_worker
    cpus += (p.reward_workers + p.reference_workers) * p.frozen_cpus_per_worker
    cpus += p.rollout.num_engines * p.rollout.cpus_per_engine
    demand = {"CPU": cpus}
    if device == "cuda":
        gpus = a.num_workers + c.num_workers + p.rollout.num_engines * p.rollout.tensor_parallel_size
        gpus += 0 if (p.colocate_actor_ref or p.colocate_all) else p.reference_workers
        gpus += 0 if (p.colocate_critic_reward or p.colocate_all) else p.reward_workers
        if p.colocate_all:
            gpus = max(a.num_workers, p.rollout.num_engines * p.rollout.tensor_parallel_size)
        demand["GPU"] = gpus
    return demand


def check_fits(stage: str, p: PPOConfig, device: str, available: dict[str, float]) -> None:
    """Refuse a layout that the cluster cannot place, naming what each role asks for."""
    if device == "cpu" and p.rollout.backend == "vllm" and p.rollout.tensor_parallel_size != 1:
        raise ConfigError(f"'{stage}.rollout.tensor_parallel_size' must be 1 for vLLM on CPU")
    demand = resource_demand(p, device)
    for resource, needed in demand.items():
        have = available.get(resource, 0)
        if needed > have:
            raise ConfigError(
                f"{stage}: the roles need {needed:g} {resource} but the Ray cluster has {have:g} "
                f"(actor {p.actor_strategy.num_workers}, critic {p.critic_strategy.num_workers}, reward "
                f"{p.reward_workers}, reference {p.reference_workers}, {p.rollout.num_engines} engine(s) x "
                f"tensor_parallel_size {p.rollout.tensor_parallel_size}); lower "
                f"'{stage}.rollout.num_engines' or the worker counts"
            )


def reward_stats(stage: str, p: PPOConfig, reward_path: str) -> tuple[float, float] | None:
    """(mean, std) stored by the reward-model stage; refused when normalisation is on and they are missing."""
    if not p.algo.normalize_reward:
        return None
    if not reward_path.startswith(BUILTIN_PREFIX):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(reward_path)
        mean, std = getattr(config, "reward_mean", None), getattr(config, "reward_std", None)
        if mean is not None and std is not None:
            return float(mean), float(std)
    raise ConfigError(
        f"'{stage}.reward.name_or_path' = {p.reward.name_or_path} has no stored reward_mean/reward_std, but "
        f"'{stage}.algo.normalize_reward' is on: use a reward-model stage output or set it to false"
    )


def load_gold(spec: str | None) -> Callable[[str, str], float] | None:
    if spec is None:
        return None
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"'train.gold_reward' = {spec!r} cannot be imported ({e})") from None


# ---------------------------------------------------------------------------------------------------------------------
# The controller


class PPOController:
    def __init__(self, stage: str, p: PPOConfig, st: common.StageSetup, train_actor: bool):
        self.stage, self.p, self.st, self.paths, self.train_actor = stage, p, st, st.paths, train_actor
        self.store: ObjectStore = st.store
        self.tokenizer = load_tokenizer(st.paths["actor"], p.actor.tokenizer)
        self.pad_id = self.tokenizer.pad_token_id
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
        self.stats = reward_stats(stage, p, st.paths["reward"])
        self.gold = load_gold(p.train.gold_reward)
        self.kl_ctl = make_kl_controller(p.algo.kl_coef, p.algo.kl_target, p.algo.kl_horizon)
        self.device = launcher.resolve_device(p.actor_strategy.device)

    # -- set-up -------------------------------------------------------------------------------------------------------
    def start(self) -> None:
        from rlhf_core.distributed.actor import PolicyActor
        from rlhf_core.distributed.critic import CriticActor
        from rlhf_core.distributed.reference import ReferencePolicy
        from rlhf_core.distributed.reward import RewardScorer
        from rlhf_core.distributed.role_base import RoleContext
        from rlhf_core.distributed.rollout_engine import EngineGroup, create_engines

        p, t = self.p, self.p.train
        demand = resource_demand(p, self.device)
        self.started_ray = launcher.init_ray(min_cpus=demand["CPU"])
        check_fits(self.stage, p, self.device, launcher.cluster_resources())

        actor_steps = optimizer_steps(p, self.steps if self.train_actor else 0)
        base = dict(
            stage=self.stage, init_seed=0, micro_rollout_batch_size=t.micro_rollout_batch_size, algo=p.algo,
            seed=t.seed, run_uri=self.store.root_uri, storage_options=self.store.fs.storage_options,
            work_dir=self.st.work,
            batch=TrainConfig(train_batch_size=t.train_batch_size, micro_train_batch_size=t.micro_train_batch_size),
        )  # fmt: skip
        actor_ctx = RoleContext(
            role="actor", model_path=self.paths["actor"], tokenizer_path=p.actor.tokenizer,
            strategy=p.actor_strategy, optim=p.actor_optim, total_optimizer_steps=actor_steps, **base,
        )  # fmt: skip
        critic_ctx = RoleContext(
            role="critic", model_path=self.paths["critic"], tokenizer_path=p.critic.tokenizer,
            strategy=p.critic_strategy, optim=p.critic_optim, total_optimizer_steps=optimizer_steps(p, self.steps),
            **base,
        )  # fmt: skip
        frozen = lambda n: replace(p.actor_strategy, num_workers=n, cpus_per_worker=p.frozen_cpus_per_worker)  # noqa: E731
        placement: dict[str, Any] = {}
        if p.colocate_all:  # one bundle per actor rank; every role's worker i shares bundle i
            shared = launcher.colocation_group(p.actor_strategy.num_workers, 1.0, self.device)
            placement = {"actor": shared, "critic": shared}
        else:
            if p.colocate_actor_ref:
                placement["actor"] = launcher.colocation_group(p.actor_strategy.num_workers, 1.0, self.device)
            if p.colocate_critic_reward:
                placement["critic"] = launcher.colocation_group(p.critic_strategy.num_workers, 1.0, self.device)
        shared_share = 0.25 if p.colocate_all else 0.5
        share = {role: shared_share if role in placement else 1.0 for role in ("actor", "critic")}
        handles = create_engines(
            p.rollout.num_engines, self.paths["actor"], backend=p.rollout.backend,
            tensor_parallel_size=p.rollout.tensor_parallel_size, num_cpus_per_engine=p.rollout.cpus_per_engine,
            **self._engine_kwargs(),
        )  # fmt: skip
        self.engines = EngineGroup(handles, self.tokenizer.eos_token_id)
        self.actor = launcher.RayWorkerGroup(
            _slice_if_placed(p.actor_strategy, "actor" in placement), PolicyActor, actor_ctx,
            placement=placement.get("actor"), share=share["actor"],
        )  # fmt: skip
        self.critic = launcher.RayWorkerGroup(
            _slice_if_placed(p.critic_strategy, "critic" in placement), CriticActor, critic_ctx,
            placement=placement.get("critic"), share=share["critic"],
        )  # fmt: skip
        precision = p.actor_strategy.precision
        self.reward = launcher.RayWorkerGroup(
            _slice_if_placed(frozen(p.reward_workers), "critic" in placement), RewardScorer, self.paths["reward"],
            t.micro_rollout_batch_size, precision, placement=placement.get("critic"), share=share["critic"],
        )  # fmt: skip
        self.reference = launcher.RayWorkerGroup(
            _slice_if_placed(frozen(p.reference_workers), "actor" in placement), ReferencePolicy,
            self.paths["reference"], t.micro_rollout_batch_size, precision, placement=placement.get("actor"),
            share=share["actor"],
        )  # fmt: skip
        launcher.wait(self.actor.call_async("setup") + self.critic.call_async("setup"))
        self.engines.wait_ready()
        self.actor.call("connect_engines", handles, p.rollout.backend == "vllm")

    def _engine_kwargs(self) -> dict:
        p = self.p
        kwargs: dict[str, Any] = {"seed": p.train.seed}
        dtype = "bfloat16" if p.actor_strategy.precision == "bf16" else "float32"
        kwargs["dtype"] = dtype
        if p.rollout.backend == "vllm":
            kwargs.update(max_model_len=p.data.max_len + p.rollout.max_new_tokens, kv_cache_gib=p.rollout.kv_cache_gib)
        return kwargs

    def shutdown(self) -> None:
        for group in ("actor", "critic", "reward", "reference", "engines"):
            if hasattr(self, group):
                getattr(self, group).shutdown()
        if getattr(self, "started_ray", False):
            launcher.shutdown_ray()

    # -- phases -------------------------------------------------------------------------------------------------------
    def experience(self, prompt_ids: list[list[int]], responses: list[list[int]]) -> dict[str, torch.Tensor]:
        """Sequences with old/reference log-probs, values and reward scores, each role on its own shards."""
        n = len(responses) // len(prompt_ids)
        expanded = [ids for ids in prompt_ids for _ in range(n)]
        batch = make_sequences(expanded, responses, self.pad_id)
        refs = {
            "old_logprobs": self.actor.call_each_async("logprobs", shard_batch(batch, len(self.actor.actors))),
            "ref_logprobs": self.reference.call_each_async("logprobs", shard_batch(batch, len(self.reference.actors))),
            "values": self.critic.call_each_async("values", shard_batch(batch, len(self.critic.actors))),
            "scores": self.reward.call_each_async("scores", shard_batch(batch, len(self.reward.actors))),
        }
        return {**batch, **{k: torch.cat(launcher.wait(v)) for k, v in refs.items()}}

    def advantages(self, exp: dict[str, torch.Tensor]) -> dict[str, float]:
        a = self.p.algo
        scores = exp["scores"]
        if self.stats is not None:
            scores = normalize_scores(scores, *self.stats)
        scores = clip_scores(scores, *a.reward_clip)
        mask = exp["action_mask"]
        kl = approx_kl(exp["old_logprobs"], exp["ref_logprobs"], mask, a.kl_estimator)
        rewards = token_rewards(scores, kl, mask, self.kl_ctl.value)
        exp["advantages"], exp["returns"] = gae(rewards, exp["values"], mask, a.gamma, a.lam)
        seq_kl = (kl * mask).sum(1).mean().item()
        return {"reward": scores.mean().item(), "rm_score": exp["scores"].mean().item(), "kl": seq_kl,
                "response_len": mask.sum(1).float().mean().item(), "kl_coef": self.kl_ctl.value}  # fmt: skip

    def train(self, exp: dict[str, torch.Tensor], step: int, actor_frozen: bool) -> dict[str, float]:
        keys = ("input_ids", "attention_mask", "action_mask")
        critic_batch = {k: exp[k] for k in keys} | {"old_values": exp["values"], "returns": exp["returns"]}
        critic_refs = self.critic.call_each_async("fit", shard_batch(critic_batch, len(self.critic.actors)), step)
        stats: dict[str, float] = {}
        if not actor_frozen:
            actor_batch = {k: exp[k] for k in keys} | {"old_logprobs": exp["old_logprobs"], "advantages": exp["advantages"]}
            stats.update(self.actor.call_each("fit", shard_batch(actor_batch, len(self.actor.actors)), step)[0])
        stats.update(launcher.wait(critic_refs)[0])
        return stats

    def push_weights(self) -> float:
        return self.actor.call("push_weights")[0]

    # -- evaluation ---------------------------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """One sampled response per held-out prompt (rollout temperature, a fixed seed, so the runs before and after
        training sample alike): mean gold reward, mean RM score, and KL to the reference (k1 summed per response)."""
        from rlhf_core.distributed.rollout_engine import SamplingConfig

        if not self.eval_prompts:
            return {}
        ids = [e["prompt_ids"] for e in self.eval_prompts]
        r = self.p.rollout
        sampling = SamplingConfig(n=1, temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                                  seed=self.p.train.seed + 1)  # fmt: skip
        responses = self.engines.generate(ids, sampling)
        # pad the eval batch to a multiple every role can split
        exp = self.experience(*_pad_to_multiple(ids, responses, self._row_multiple()))
        count = len(ids)
        mask = exp["action_mask"][:count]
        kl = approx_kl(exp["old_logprobs"][:count], exp["ref_logprobs"][:count], mask, "k1")
        out = {"rm_score": exp["scores"][:count].mean().item(), "kl_to_ref": (kl * mask).sum(1).mean().item()}
        if self.gold is not None:
            texts = [self.tokenizer.decode(r, skip_special_tokens=True) for r in responses]
            prompts = [e["prompt"] if isinstance(e["prompt"], str) else json.dumps(e["prompt"]) for e in self.eval_prompts]
            out["gold_reward"] = sum(self.gold(pr, tx) for pr, tx in zip(prompts, texts)) / count
        return out

    def _row_multiple(self) -> int:
        p = self.p
        workers = [p.actor_strategy.num_workers, p.critic_strategy.num_workers, p.reward_workers, p.reference_workers]
        return math.lcm(*workers) * p.train.micro_rollout_batch_size

    # -- weight-sync check -------------------------------------------------------------------------------------------
    def probe_logprobs(self) -> tuple[list[float], list[float]]:
        """Log-probs of one fixed sequence from the first engine and from the actor (rank 0's copy)."""
        text = "The garden is calm and lovely today."
        probe = self.prompts[0]["prompt_ids"] + self.tokenizer(text, add_special_tokens=False)["input_ids"]
        engine_lp = self.engines.sequence_logprobs(probe)
        rows = len(self.actor.actors)
        batch = make_sequences([probe] * rows, [[]] * rows, self.pad_id)
        actor_lp = self.actor.call_each("logprobs", shard_batch(batch, rows))[0][0].tolist()
        return engine_lp, actor_lp

    # -- checkpoints --------------------------------------------------------------------------------------------------
    def save_checkpoint(self, state: dict) -> None:
        rel = checkpoint_rel(self.stage, state["step"])
        files = {**self.actor.call("save_shards", rel)[0], **self.critic.call("save_shards", rel)[0]}
        state = dict(state, kl_ctl=self.kl_ctl.state_dict())
        files["controller_state.json"] = write_entry(self.store, f"{rel}/controller_state.json", json.dumps(state))
        self.store.commit(
            rel, stage=self.stage, config_hash=self.st.config_hash, files=files, extra={"step": state["step"]}
        )
        prune_checkpoints(self.store, self.stage, self.p.train.keep_last)
        print(f"[{self.stage}] checkpoint {self.store.uri(rel)}", flush=True)

    def load_checkpoint(self, rel: str) -> dict:
        self.actor.call("load_shards", rel)
        self.critic.call("load_shards", rel)
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
            if self.train_actor:
                self.push_weights()  # the engines start from the initial policy: give them the checkpointed one
        resumed_from = state["step"]
        engine_lp_start, _ = self.probe_logprobs()
        if state["before"] is None:
            state["before"] = self.evaluate()
            print(f"[{stage}] before: {_fmt(state['before'])}", flush=True)

        fail_after = common.fail_after_step()
        for step in range(state["step"], self.steps):
            started = time.time()
            # 1. rollout: step k reads prompts [k*R, (k+1)*R) of the seeded prompt stream
            indices = global_batch(len(self.prompts), t.rollout_batch_size, step, t.seed)
            prompt_ids = [self.prompts[i]["prompt_ids"] for i in indices]
            sampling = SamplingConfig(
                n=p.rollout.n_samples_per_prompt, temperature=p.rollout.temperature, top_p=p.rollout.top_p,
                max_new_tokens=p.rollout.max_new_tokens, seed=t.seed * 100_003 + step,
            )  # fmt: skip
            responses = self.engines.generate(prompt_ids, sampling)
            # 2. experience
            exp = self.experience(prompt_ids, responses)
            # 3. rewards (normalised RM score + KL penalty) and GAE
            logs = self.advantages(exp)
            # 4. PPO epochs: the critic always trains, the actor after the frozen warm-up steps
            actor_frozen = not self.train_actor or step < t.freeze_actor_steps
            logs.update(self.train(exp, step, actor_frozen))
            # 5. weight sync to the engines
            if not actor_frozen:
                logs["sync_s"] = self.push_weights()
            self.kl_ctl.update(logs["kl"], len(responses))
            # 6. logging and checkpoints
            state["step"], state["consumed_prompts"] = step + 1, (step + 1) * t.rollout_batch_size
            state["episode"] = state["consumed_prompts"] // len(self.prompts)
            state["history"].append({"step": step + 1, "prompts": indices, "actor_frozen": actor_frozen, **logs})
            if (step + 1) % t.log_steps == 0 or step + 1 == self.steps:
                print(f"[{stage}] step {step + 1}/{self.steps} {_fmt(logs)} ({time.time() - started:.1f}s)", flush=True)
            if t.save_steps and (step + 1) % t.save_steps == 0 and step + 1 < self.steps:
                self.save_checkpoint(state)
                if fail_after is not None and step + 1 >= fail_after:
                    raise RuntimeError(f"injected failure after checkpoint at step {step + 1} (RLHF_FAIL_AFTER_STEP)")

        after = self.evaluate()
        print(f"[{stage}] after: {_fmt(after)}", flush=True)
        metrics: dict[str, Any] = {"steps": self.steps, "resumed_from_step": resumed_from}
        # Proof of the weight sync: the engines now compute what the trained actor computes.
        engine_lp, actor_lp = self.probe_logprobs()
        metrics["sync_engine_vs_actor_max_diff"] = max(abs(a - b) for a, b in zip(engine_lp, actor_lp))
        metrics["sync_engine_change_max"] = max(abs(a - b) for a, b in zip(engine_lp, engine_lp_start))
        metrics.update({f"{k}_before": v for k, v in state["before"].items()})
        metrics.update({f"{k}_after": v for k, v in after.items()})
        last = state["history"][-1] if state["history"] else {}
        metrics.update({k: last[k] for k in ("kl", "rm_score", "policy_loss", "critic_loss") if k in last})
        self.history = state["history"]
        return metrics


def _slice_if_placed(s: StrategyConfig, placed: bool) -> StrategyConfig:
    # Inside a placement-group bundle (1 CPU) the roles share the bundle; each asks for a quarter of it.
    return replace(s, cpus_per_worker=0.25) if placed else s


def _pad_to_multiple(ids: list, responses: list, multiple: int) -> tuple[list, list]:
    extra = (-len(ids)) % multiple
    return ids + ids[:1] * extra, responses + responses[:1] * extra


def _fmt(logs: dict) -> str:
    return " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in logs.items())


# ---------------------------------------------------------------------------------------------------------------------
# Entry points


def run(cfg: PipelineConfig, stage: str = STAGE, train_actor: bool = True) -> CheckpointRef:
    # 1. inputs: config hash (with the upstream outputs' hashes), finished output, then the four models
    p: PPOConfig = cfg.stage(stage)
    models = {"actor": p.actor, "critic": p.critic, "reward": p.reward, "reference": p.reference or p.actor}
    st = common.setup_stage(cfg, stage, models)
    if st.done is not None:
        return st.done
    store, work, upstream, config_hash = st.store, st.work, st.upstream, st.config_hash

    # 2. data and checks, before any Ray actor starts
    controller = PPOController(stage, p, st, train_actor)

    # 3. roles, the loop, outputs
    try:
        controller.start()
        metrics = controller.fit()
        extra = {"upstream": upstream}
        if train_actor and p.train.save_critic:
            controller.critic.call("export", f"{stage}/critic", config_hash, metrics, extra)
        store.write_json(f"{stage}/metrics.json", {"history": controller.history, "final": metrics})
        group = controller.actor if train_actor else controller.critic
        group.call("export", stage, config_hash, metrics, extra)
    finally:
        controller.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    return CheckpointRef(store.uri(stage), stage, metrics["steps"], config_hash, metrics)


if __name__ == "__main__":
    common.main(STAGE, run)
