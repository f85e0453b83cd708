"""Cross-field checks, run by ``load_config`` after every value has its type; each error names the key to change."""

from __future__ import annotations

import difflib
import math
from typing import Any

from rlhf_core.algos.vocab import GROUP_ESTIMATORS
from rlhf_core.config.fields import ConfigError
from rlhf_core.config.pipeline import PipelineConfig, TrackingConfig, topological_order
from rlhf_core.config.sections import RolloutConfig
from rlhf_core.config.serialise import redact_url
from rlhf_core.config.stages import (
    REWARD_SOURCES,
    DPOConfig,
    GenerateConfig,
    PPOConfig,
    PreferenceConfig,
    ScoreConfig,
    reward_sources,
    uses_critic,
)


def validate(cfg: PipelineConfig) -> None:
    if not cfg.run_uri.strip():
        raise ConfigError("'run_uri' is empty: give a local path, file://... or s3://bucket/prefix")
    _validate_tracking(cfg.tracking)
    for name, spec in cfg.stages.items():
        if spec.kind in ("sft", "reward_model", "dpo", "kto"):
            _validate_training(name, spec.section)
        if spec.kind in ("dpo", "kto"):
            _validate_preference(name, spec.kind, spec.section)
        if spec.kind == "generate":
            _validate_generate(name, spec.section)
        if spec.kind == "score":
            _validate_score(name, spec.section)
        if spec.kind == "reward_model" and not spec.section.data.eval_path:
            raise ConfigError(f"'{name}.data.eval_path' is required: held-out pairs give accuracy and reward stats")
        if spec.kind in ("critic_warmup", "ppo"):
            _validate_ppo(name, spec.section, spec.kind)
        for key, upstream in spec.upstream():
            if upstream not in cfg.stages:
                close = difflib.get_close_matches(upstream, [n for n in cfg.stages if n != name], n=1)
                hint = f"did you mean 'stage:{close[0]}'?" if close else f"stages: {', '.join(cfg.stages)}"
                raise ConfigError(f"'{key}' = stage:{upstream} names no stage of this config; {hint}")
    topological_order(cfg)  # refuses cycles


def _validate_tracking(t: TrackingConfig) -> None:
    """The trackers' values; whether their packages are installed is checked by the job (``tracking.check``)."""
    if t.mlflow is not None:
        uri = t.mlflow.tracking_uri
        _check(uri is None or bool(uri.strip()), "tracking.mlflow.tracking_uri", uri, "give a URI or null")
        _check(bool(t.mlflow.experiment.strip()), "tracking.mlflow.experiment", t.mlflow.experiment, "give a name")
    if t.wandb is not None:
        _check(bool(t.wandb.project.strip()), "tracking.wandb.project", t.wandb.project, "give a project name")
    if t.run_name is not None:
        _check(
            bool(t.run_name.strip()) and "/" not in t.run_name,
            "tracking.run_name",
            t.run_name,
            "give a non-empty name without '/' (or null for the run folder's name)",
        )


def _validate_training(name: str, stage: Any) -> None:
    s, t, o, d = stage.strategy, stage.train, stage.optim, stage.data
    _check(s.num_workers >= 1, f"{name}.strategy.num_workers", s.num_workers, "must be >= 1")
    _check(0 <= s.zero_stage <= 3, f"{name}.strategy.zero_stage", s.zero_stage, "must be 0, 1, 2 or 3")
    _check(s.threads_per_worker >= 1, f"{name}.strategy.threads_per_worker", s.threads_per_worker, "must be >= 1")
    _check(o.lr > 0, f"{name}.optim.lr", o.lr, "must be > 0")
    _check(len(o.adam_betas) == 2, f"{name}.optim.adam_betas", o.adam_betas, "must be two numbers")
    _check(0 <= o.lr_warmup_ratio < 1, f"{name}.optim.lr_warmup_ratio", o.lr_warmup_ratio, "must be in [0, 1)")
    _check(o.max_norm >= 0, f"{name}.optim.max_norm", o.max_norm, "must be >= 0")
    _check(d.max_len >= 8, f"{name}.data.max_len", d.max_len, "must be >= 8")
    _check(t.micro_train_batch_size >= 1, f"{name}.train.micro_train_batch_size", t.micro_train_batch_size, ">= 1")
    _check(t.max_epochs >= 1, f"{name}.train.max_epochs", t.max_epochs, "must be >= 1")
    _check(t.max_steps is None or t.max_steps >= 1, f"{name}.train.max_steps", t.max_steps, "must be >= 1")
    _check(t.save_steps >= 0, f"{name}.train.save_steps", t.save_steps, "must be >= 0")
    _check(t.keep_last >= 1, f"{name}.train.keep_last", t.keep_last, "must be >= 1")
    per_step = t.micro_train_batch_size * s.num_workers
    if t.train_batch_size < 1 or t.train_batch_size % per_step:
        raise ConfigError(
            f"invalid value {t.train_batch_size} for '{name}.train.train_batch_size': it must be a positive multiple "
            f"of micro_train_batch_size x num_workers = {t.micro_train_batch_size} x {s.num_workers} = {per_step}"
        )
    if d.input_template is not None and d.input_template.count("{}") != 1:
        raise ConfigError(
            f"invalid value {d.input_template!r} for '{name}.data.input_template': needs exactly one {{}}"
        )


def _validate_preference(name: str, kind: str, p: PreferenceConfig) -> None:
    _check(p.beta > 0, f"{name}.beta", p.beta, "must be > 0")
    if isinstance(p, DPOConfig):
        _check(0 <= p.label_smoothing < 0.5, f"{name}.label_smoothing", p.label_smoothing, "must be in [0, 0.5)")
        _check(p.nll_loss_coef >= 0, f"{name}.nll_loss_coef", p.nll_loss_coef, "must be >= 0")
        if p.loss_type == "ipo" and p.label_smoothing:
            raise ConfigError(f"'{name}.label_smoothing' applies to loss_type=sigmoid (cDPO), not ipo: set it to 0")
    else:
        _check(p.desirable_weight > 0, f"{name}.desirable_weight", p.desirable_weight, "must be > 0")
        _check(p.undesirable_weight > 0, f"{name}.undesirable_weight", p.undesirable_weight, "must be > 0")


def _validate_sampling(name: str, r: RolloutConfig) -> None:
    _check(r.num_engines >= 1, f"{name}.rollout.num_engines", r.num_engines, "must be >= 1")
    _check(r.tensor_parallel_size >= 1, f"{name}.rollout.tensor_parallel_size", r.tensor_parallel_size, ">= 1")
    _check(
        0 < r.gpu_memory_utilization <= 1,
        f"{name}.rollout.gpu_memory_utilization",
        r.gpu_memory_utilization,
        "must be in (0, 1]",
    )
    _check(r.kv_cache_gib is None or r.kv_cache_gib > 0, f"{name}.rollout.kv_cache_gib", r.kv_cache_gib, "must be > 0")
    _check(r.n_samples_per_prompt >= 1, f"{name}.rollout.n_samples_per_prompt", r.n_samples_per_prompt, ">= 1")
    _check(r.max_new_tokens >= 1, f"{name}.rollout.max_new_tokens", r.max_new_tokens, "must be >= 1")
    _check(r.temperature >= 0, f"{name}.rollout.temperature", r.temperature, "must be >= 0")
    _check(0 < r.top_p <= 1, f"{name}.rollout.top_p", r.top_p, "must be in (0, 1]")


def _validate_generate(name: str, g: GenerateConfig) -> None:
    _validate_sampling(name, g.rollout)
    _check(g.strategy.num_workers >= 1, f"{name}.strategy.num_workers", g.strategy.num_workers, "must be >= 1")
    _check(g.data.max_len >= 2, f"{name}.data.max_len", g.data.max_len, "must be >= 2")


def _validate_score(name: str, sc: ScoreConfig) -> None:
    if (sc.reward is None) == (sc.reward_fn is None):
        raise ConfigError(
            f"give exactly one of '{name}.reward.name_or_path' (a reward model) and '{name}.reward_fn' "
            "(module:function or path.py:function)"
        )
    _check(sc.micro_batch_size >= 1, f"{name}.micro_batch_size", sc.micro_batch_size, "must be >= 1")
    _check(sc.strategy.num_workers >= 1, f"{name}.strategy.num_workers", sc.strategy.num_workers, "must be >= 1")
    if sc.threshold is not None and sc.select != "best":
        raise ConfigError(f"'{name}.threshold' applies to select=best: set {name}.select=best or remove it")


def _validate_rl(name: str, kind: str, p: PPOConfig) -> None:
    """The estimator, the actor-loss options and the reward sources of a PPO-kind stage."""
    a, n = p.algo, p.rollout.n_samples_per_prompt
    if uses_critic(kind, p) and p.critic is None:
        why = "the critic warm-up trains one" if kind == "critic_warmup" else "algo.advantage_estimator=gae needs one"
        raise ConfigError(
            f"'{name}.critic.name_or_path' is required: {why} (e.g. stage:critic_init), or choose a "
            f"critic-free '{name}.algo.advantage_estimator' (reinforce++, grpo, rloo, ...)"
        )
    if not uses_critic(kind, p) and p.critic is not None:
        raise ConfigError(
            f"'{name}.critic' is set but '{name}.algo.advantage_estimator' = {a.advantage_estimator} "
            "builds no critic: remove it, or use advantage_estimator=gae"
        )
    if a.advantage_estimator in GROUP_ESTIMATORS and n < 2:
        raise ConfigError(
            f"'{name}.algo.advantage_estimator' = {a.advantage_estimator} compares the samples of a "
            f"prompt: set '{name}.rollout.n_samples_per_prompt' >= 2 (it is {n})"
        )
    if a.dynamic_filter and n < 2:
        raise ConfigError(
            f"'{name}.algo.dynamic_filter' drops prompts whose samples all score alike: set "
            f"'{name}.rollout.n_samples_per_prompt' >= 2 (it is {n})"
        )
    _check(a.eps_clip > 0, f"{name}.algo.eps_clip", a.eps_clip, "must be > 0")
    _check(a.eps_clip_high is None or a.eps_clip_high > 0, f"{name}.algo.eps_clip_high", a.eps_clip_high, "> 0")
    _check(a.dual_clip is None or a.dual_clip > 1, f"{name}.algo.dual_clip", a.dual_clip, "must be > 1 (e.g. 3)")
    _check(a.entropy_coef >= 0, f"{name}.algo.entropy_coef", a.entropy_coef, "must be >= 0")
    cap = a.is_correction_cap
    _check(cap is None or cap > 0, f"{name}.algo.is_correction_cap", cap, "must be > 0 (e.g. 2.0)")
    if a.kl_mode == "loss" and a.kl_coef == 0 and a.kl_target is None:
        raise ConfigError(
            f"'{name}.algo.kl_mode' = loss with kl_coef 0 adds no KL term: set '{name}.algo.kl_coef' "
            "> 0 (e.g. 0.01) or kl_mode=reward"
        )
    if a.kl_loss_unbiased and a.kl_mode != "loss":
        raise ConfigError(
            f"'{name}.algo.kl_loss_unbiased' applies to the KL loss term: set '{name}.algo.kl_mode' "
            "= loss or remove it"
        )
    sources = reward_sources(p)
    if not sources:
        raise ConfigError(
            f"'{name}' has no reward: give '{name}.reward.name_or_path' (a reward model), "
            f"'{name}.reward_fn' (path.py:function) or '{name}.remote_rm_url' (a server)"
        )
    for key, weight in p.reward_weights.items():
        if key not in sources:
            raise ConfigError(
                f"'{name}.reward_weights.{key}' weighs no reward source of this stage (its sources: "
                f"{', '.join(sources)}; the keys are {', '.join(REWARD_SOURCES)})"
            )
        _check(math.isfinite(weight), f"{name}.reward_weights.{key}", weight, "must be a finite number")
    if p.remote_rm_url is not None:
        url = p.remote_rm_url
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"'{name}.remote_rm_url' = {redact_url(url)!r} must be an http:// or https:// URL")
        rm = p.remote_rm
        _check(rm.timeout_s > 0, f"{name}.remote_rm.timeout_s", rm.timeout_s, "must be > 0")
        _check(rm.retries >= 0, f"{name}.remote_rm.retries", rm.retries, "must be >= 0")
        _check(rm.backoff_s >= 0, f"{name}.remote_rm.backoff_s", rm.backoff_s, "must be >= 0")
        _check(rm.batch_size >= 0, f"{name}.remote_rm.batch_size", rm.batch_size, "must be >= 0 (0 = one request)")


def _validate_ppo(name: str, p: PPOConfig, kind: str = "ppo") -> None:
    """Batch arithmetic as in OpenRLHF: rollout samples split evenly over actor and critic ranks, and into
    optimizer steps of train_batch_size made of micro-batches on every rank."""
    t, r, a = p.train, p.rollout, p.algo
    _validate_rl(name, kind, p)
    critic, reward = uses_critic(kind, p), p.reward is not None
    for key in ("rollout_batch_size", "train_batch_size", "micro_train_batch_size", "micro_rollout_batch_size"):
        _check(getattr(t, key) >= 1, f"{name}.train.{key}", getattr(t, key), "must be >= 1")
    _validate_sampling(name, r)
    _check(r.weight_sync_bucket_mb >= 1, f"{name}.rollout.weight_sync_bucket_mb", r.weight_sync_bucket_mb, ">= 1")
    _check(p.frozen_zero_stage in (0, 3), f"{name}.frozen_zero_stage", p.frozen_zero_stage, "must be 0 or 3")
    if p.frozen_offload and p.frozen_zero_stage != 3:
        raise ConfigError(f"'{name}.frozen_offload' needs '{name}.frozen_zero_stage=3' (offload of partitions)")
    if r.enable_sleep and r.backend != "vllm":
        raise ConfigError(f"'{name}.rollout.enable_sleep' needs '{name}.rollout.backend=vllm' (vLLM sleep mode)")
    if r.weight_sync_backend == "cuda_ipc" and not p.colocate_all:
        raise ConfigError(
            f"'{name}.rollout.weight_sync_backend=cuda_ipc' needs '{name}.colocate_all=true' (the engines must share "
            "the actor's GPUs)"
        )
    _check(a.kl_coef >= 0, f"{name}.algo.kl_coef", a.kl_coef, "must be >= 0")
    _check(0 <= a.gamma <= 1 and 0 <= a.lam <= 1, f"{name}.algo.gamma/lam", (a.gamma, a.lam), "must be in [0, 1]")
    _check(a.ppo_epochs >= 1, f"{name}.algo.ppo_epochs", a.ppo_epochs, "must be >= 1")
    _check(
        len(a.reward_clip) == 2 and a.reward_clip[0] < a.reward_clip[1],
        f"{name}.algo.reward_clip",
        a.reward_clip,
        "must be [low, high] with low < high",
    )
    _check(t.freeze_actor_steps >= 0, f"{name}.train.freeze_actor_steps", t.freeze_actor_steps, "must be >= 0")
    _check(t.keep_last >= 1, f"{name}.train.keep_last", t.keep_last, "must be >= 1")
    _check(p.reward_workers >= 1, f"{name}.reward_workers", p.reward_workers, "must be >= 1")
    _check(p.reference_workers >= 1, f"{name}.reference_workers", p.reference_workers, "must be >= 1")
    samples = t.rollout_batch_size * r.n_samples_per_prompt
    if samples % t.train_batch_size:
        raise ConfigError(
            f"invalid value {t.train_batch_size} for '{name}.train.train_batch_size': rollout_batch_size x "
            f"n_samples_per_prompt = {samples} samples per step must split into whole optimizer steps"
        )
    for role in ("actor", "critic") if critic else ("actor",):
        workers = getattr(p, f"{role}_strategy").num_workers
        _check(workers >= 1, f"{name}.{role}_strategy.num_workers", workers, "must be >= 1")
        per_step = t.micro_train_batch_size * workers
        if t.train_batch_size % per_step:
            raise ConfigError(
                f"invalid value {t.train_batch_size} for '{name}.train.train_batch_size': it must be a multiple of "
                f"micro_train_batch_size x {role}_strategy.num_workers = {t.micro_train_batch_size} x {workers}"
            )
    groups = (
        ("actor", p.actor_strategy.num_workers, True),
        ("critic", p.critic_strategy.num_workers, critic),
        ("reward", p.reward_workers, reward),
        ("reference", p.reference_workers, True),
    )
    for role, workers, used in groups:
        if used and samples % (workers * t.micro_rollout_batch_size):
            raise ConfigError(
                f"invalid value {t.micro_rollout_batch_size} for '{name}.train.micro_rollout_batch_size': the "
                f"{samples} samples of a step do not split into equal micro-batches over the {workers} {role} workers"
            )
    if p.colocate_all and max(p.critic_strategy.num_workers, p.reward_workers, p.reference_workers) > (
        p.actor_strategy.num_workers
    ):
        raise ConfigError(f"'{name}.colocate_all' needs critic, reward and reference workers <= actor workers")
    if p.colocate_actor_ref and p.reference_workers != p.actor_strategy.num_workers:
        raise ConfigError(f"'{name}.colocate_actor_ref' needs reference_workers == actor_strategy.num_workers")
    if p.colocate_critic_reward and not (critic and reward):
        raise ConfigError(
            f"'{name}.colocate_critic_reward' needs a critic and a reward model; this stage has "
            f"{'no critic' if not critic else 'no reward model'}: set it to false"
        )
    if p.colocate_critic_reward and p.reward_workers != p.critic_strategy.num_workers:
        raise ConfigError(f"'{name}.colocate_critic_reward' needs reward_workers == critic_strategy.num_workers")
    if p.data.eval_path is None and t.eval_prompts > 0:
        raise ConfigError(f"'{name}.data.eval_path' is required while '{name}.train.eval_prompts' > 0")


def _check(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(f"invalid value {value!r} for '{key}': {why}")
