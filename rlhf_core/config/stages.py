"""One config section per stage kind (``STAGE_KINDS`` in ``kinds.py`` says which kind uses which), with the
sub-sections only one kind has (PPO's algorithm, training loop and remote reward client)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlhf_core.algos.vocab import AdvantageEstimator, KLEstimator, LossAggregation
from rlhf_core.config.fields import opt, required
from rlhf_core.config.sections import DataConfig, ModelConfig, OptimConfig, RolloutConfig, StrategyConfig, TrainConfig

# ---------------------------------------------------------------------------------------------------------------------
# Supervised kinds: sft, reward_model, and critic_init (a copy)


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


# ---------------------------------------------------------------------------------------------------------------------
# PPO and the critic warm-up


@dataclass
class PPOAlgoConfig:
    kl_coef: float = opt(0.01, "Initial coefficient beta of the token-level KL penalty.")
    kl_estimator: KLEstimator = opt("k1", "KL estimator: k1 = d, k2 = d^2/2, k3 = e^-d - 1 + d.")
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
    advantage_estimator: AdvantageEstimator = opt(
        "gae",
        "gae = PPO with a critic; critic-free: reinforce++ (returns whitened over the global batch), "
        "reinforce++_baseline (minus the prompt's group mean, then whitened), grpo (normalised within each prompt's "
        "group), rloo (leave-one-out baseline), dr_grpo (minus the group mean, no std); group estimators need "
        "rollout.n_samples_per_prompt >= 2.",
    )
    eps_clip_high: float | None = opt(None, "Upper clip bound 1 + eps_clip_high (clip-higher, DAPO); null = eps_clip.")
    dual_clip: float | None = opt(None, "Dual clip c > 1: a token with A < 0 loses at most -c * A; null = off.")
    loss_agg: LossAggregation = opt(
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


# The PPOConfig keys a reward can come from; several are summed (reward_weights).
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


def uses_critic(kind: str, p: PPOConfig) -> bool:
    """The critic warm-up and GAE train a critic; the critic-free estimators build none."""
    return kind == "critic_warmup" or p.algo.advantage_estimator == "gae"


def reward_sources(p: PPOConfig) -> list[str]:
    """The reward sources a PPO-kind stage sums (in REWARD_SOURCES order)."""
    return [key for key in REWARD_SOURCES if getattr(p, key) is not None]


# ---------------------------------------------------------------------------------------------------------------------
# DPO and KTO


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
        "precompute = reference log-probs computed once before training and committed in the stage's folder (a "
        "retry or resume reads them back); online = a frozen reference copy on every rank, every step.",
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


# ---------------------------------------------------------------------------------------------------------------------
# Datasets made by a policy or a reward: generate and score


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
