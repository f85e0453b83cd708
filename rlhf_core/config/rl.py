"""What the PPO kinds (``critic_warmup``, ``ppo``) share: a section per Ray role (actor, critic, reward model,
reference), the frozen workers, placement, the remote reward client, the KL/GAE settings of the critic's training,
and the rollout loop. The checks that hold for both kinds are ``critic_warmup.check_rl``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from rlhf_core.algos.vocab import KLEstimator
from rlhf_core.config.fields import opt, required
from rlhf_core.config.sections import InferenceStrategy, ModelConfig, OptimConfig, StrategyConfig, TrainedModelConfig

# The keys of a role's model that moved from the role's own section into ``<role>.model`` (refused with their new
# spelling by the loader).
MODEL_MOVED = {name: f"model.{name}" for name in ("name_or_path", "tokenizer", "init_seed", "trust_remote_code")}


# ---------------------------------------------------------------------------------------------------------------------
# One section per role


@dataclass
class ActorRole:
    RENAMED: ClassVar[dict[str, str]] = MODEL_MOVED

    model: TrainedModelConfig = required("Policy to train, usually stage:sft.")
    strategy: StrategyConfig = opt(StrategyConfig(), "The actor group's DeepSpeed/Ray settings.")
    optim: OptimConfig = opt(OptimConfig(lr=5e-7), "The actor's optimizer (low LR).")


@dataclass
class FrozenActorRole:
    """The critic warm-up's actor: it generates and scores its rollouts, and never trains."""

    RENAMED: ClassVar[dict[str, str]] = MODEL_MOVED

    model: ModelConfig = required("Policy whose rollouts the critic learns to value, usually stage:sft.")
    strategy: InferenceStrategy = opt(InferenceStrategy(), "The actor group's DeepSpeed/Ray settings.")


@dataclass
class CriticRole:
    RENAMED: ClassVar[dict[str, str]] = MODEL_MOVED

    model: TrainedModelConfig | None = opt(
        None, "Critic to start from (stage:critic_warmup or stage:critic_init); algo.advantage_estimator=gae only."
    )
    strategy: StrategyConfig = opt(StrategyConfig(), "The critic group's DeepSpeed/Ray settings.")
    optim: OptimConfig = opt(OptimConfig(lr=9e-6), "The critic's optimizer (higher LR).")


@dataclass
class RewardRole:
    RENAMED: ClassVar[dict[str, str]] = MODEL_MOVED

    model: ModelConfig | None = opt(
        None, "Frozen reward model, usually stage:reward_model (or reward_fn/remote_rm_url)."
    )
    workers: int = opt(1, "Reward-model Ray actors.")
    resources: dict[str, float] = opt({}, "Ray custom resources each reward worker asks for.")


@dataclass
class ReferenceRole:
    RENAMED: ClassVar[dict[str, str]] = MODEL_MOVED

    model: ModelConfig | None = opt(None, "Frozen reference policy; null = the actor's starting model.")
    workers: int = opt(1, "Reference-policy Ray actors.")
    resources: dict[str, float] = opt({}, "Ray custom resources each reference worker asks for.")


@dataclass
class FrozenWorkersConfig:
    """What the reward and reference workers (the frozen models) share."""

    cpus_per_worker: float = opt(0.5, "Ray CPUs reserved per reward/reference worker.")
    zero_stage: int = opt(
        0, "Reward and reference: 0 = a full replica per worker; 3 = partitioned over their workers (ZeRO-3)."
    )
    offload: bool = opt(False, "With zero_stage 3: reward/reference parameters live on the CPU.")


@dataclass
class PlacementConfig:
    colocate_actor_ref: bool = opt(False, "Place reference workers on the actor workers' devices (placement group).")
    colocate_critic_reward: bool = opt(False, "Place reward workers on the critic workers' devices.")
    colocate_all: bool = opt(False, "Actor, critic, reward and reference workers share the actor's devices.")
    offload_states_during_rollout: bool = opt(
        False, "Move actor/critic DeepSpeed states (optimizer, gradients) to the CPU while the engines generate."
    )


@dataclass
class RemoteRewardConfig:
    timeout_s: float = opt(30.0, "Seconds per request to the remote reward server.")
    retries: int = opt(3, "Retries of a failed request (connection errors, HTTP 429/5xx), with backoff.")
    backoff_s: float = opt(0.5, "Backoff factor between retries (0.5 s, 1 s, 2 s, ...).")
    batch_size: int = opt(0, "Rows per request (0 = the whole batch in one request).")


# The flat PPO-kind keys of earlier versions, by their place in the role sections (refused with the new spelling).
ROLE_KEYS_MOVED = {
    "actor_strategy": "actor.strategy",
    "critic_strategy": "critic.strategy",
    "critic_optim": "critic.optim",
    "reward_workers": "reward.workers",
    "reference_workers": "reference.workers",
    "reward_resources": "reward.resources",
    "reference_resources": "reference.resources",
    "frozen_cpus_per_worker": "frozen.cpus_per_worker",
    "frozen_zero_stage": "frozen.zero_stage",
    "frozen_offload": "frozen.offload",
    "colocate_actor_ref": "placement.colocate_actor_ref",
    "colocate_critic_reward": "placement.colocate_critic_reward",
    "colocate_all": "placement.colocate_all",
    "offload_states_during_rollout": "placement.offload_states_during_rollout",
}

# Where a PPO-kind stage's reward can come from, as keys of ``reward_weights`` (several are summed).
REWARD_SOURCES = ("reward", "reward_fn", "remote_rm_url")


# ---------------------------------------------------------------------------------------------------------------------
# The critic's training: KL, GAE, reward shaping; the rollout loop


@dataclass
class ValueAlgoConfig:
    """The rewards, KL penalty and GAE that the critic learns from (the critic warm-up's whole algorithm)."""

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
    value_clip: float | None = opt(0.5, "Value clip range; null = unclipped value loss.")
    normalize_reward: bool = opt(
        True, "Normalise the reward model's scores with the mean/std its stage stored (reward_fn/remote: as given)."
    )
    reward_clip: list[float] = opt(
        [-10.0, 10.0], "Clamp of each sample's reward: the weighted sum of its sources, after the missing-EOS penalty."
    )
    missing_eos_penalty: float | None = opt(
        None,
        "Added to the reward (the weighted sum of the sources) of a response cut at max_new_tokens without EOS "
        "(e.g. -1.0); null = none.",
    )
    ppo_epochs: int = opt(1, "Passes over each rollout batch.")
    kl_mode: Literal["reward", "loss"] = opt(
        "reward", "reward = KL penalty in the token rewards (PPO); loss = kl_coef x KL term in the actor loss (GRPO)."
    )

    # Where the KL to the reference goes, decided here once for every reader (placement, old log-probs, advantages,
    # the actor's loss, validation). Validation refuses kl_mode=loss without a KL, so ``kl_in_loss`` reads the mode
    # alone and a validated config has a KL wherever it is true.
    @property
    def needs_kl(self) -> bool:
        """A KL to the reference policy, as a reward penalty or a loss term: none when kl_coef = 0 and no adaptive
        target (as OpenRLHF)."""
        return self.kl_coef > 0 or self.kl_target is not None

    @property
    def kl_in_reward(self) -> bool:
        """The KL as a token-level penalty in the rewards (``kl_mode`` reward, with a KL)."""
        return self.needs_kl and self.kl_mode == "reward"

    @property
    def kl_in_loss(self) -> bool:
        """The KL as a term of the actor loss (``kl_mode`` loss), on the reference log-probs."""
        return self.kl_mode == "loss"


@dataclass
class RLTrainConfig:
    """The rollout loop: prompts per step, batches, steps, checkpoints and the held-out evaluation."""

    rollout_batch_size: int = opt(1024, "Prompts per PPO step.")
    train_batch_size: int = opt(128, "Samples per optimizer step over all ranks (actor and critic).")
    micro_train_batch_size: int = opt(8, "Samples per forward/backward on one rank.")
    micro_rollout_batch_size: int = opt(16, "Samples per forward when making experience.")
    dynamic_batch: bool = opt(
        False,
        "Token-budget micro-batches for the actor and critic: each rank's share of an optimizer step (and of each "
        "experience forward) splits into the fewest balanced micro-batches of at most max_tokens_per_micro_batch "
        "tokens, as many on every rank, instead of micro_train_batch_size / micro_rollout_batch_size rows (OpenRLHF "
        "dynamic_batch_enable).",
    )
    max_tokens_per_micro_batch: int = opt(
        16384,
        "train.dynamic_batch's budget: prompt + response tokens (padding excluded) per micro-batch on one rank; a "
        "longer sample goes alone.",
    )
    num_episodes: int = opt(1, "Passes over the prompt set.")
    max_steps: int | None = opt(None, "Stop after this many PPO steps (default: num_episodes worth).")
    seed: int = opt(42, "Seed of prompt order, sampling and RNGs.")
    save_steps: int = opt(0, "Checkpoint every N PPO steps (0 = never).")
    keep_last: int = opt(3, "Keep the newest K complete checkpoints.")
    log_steps: int = opt(1, "Print metrics every N PPO steps.")
    eval_prompts: int = opt(64, "Held-out prompts sampled and scored before and after training.")
    gold_reward: str | None = opt(
        "auto",
        "module:function(prompt, response[, label]) -> float scoring each held-out response; auto = the bundled "
        "task's rule (rlhf_core.data.synthetic:gold_reward) on the bundled data, none on other data; null = none.",
    )
    eval_greedy: bool = opt(
        False, "Also answer each held-out prompt greedily and report accuracy_greedy (with its standard error)."
    )
    eval_pass_k: int = opt(
        0, "Also sample k answers per held-out prompt (rollout temperature) and report pass@k; 0 = off."
    )
    eval_reward_fn: str | None = opt(
        None,
        "Judge of the greedy accuracy and pass@k: a reward function (the reward_fn convention, labels included); "
        "null = the stage's reward_fn.",
    )
    eval_correct_at: float = opt(1.0, "A held-out answer counts as correct when the judge scores it at least this.")
    sync_check_tolerance: float | None = opt(
        1e-3,
        "Fail the stage when, at its end, the rollout engines' log-probs of a fixed sequence differ from the actor's "
        "by more than this (sync_engine_vs_actor_max_diff): the engines do not serve the weights the actor trains "
        "(a weight sync that left a layer behind). In fp32 a sound sync agrees well within 1e-3; in bf16 "
        "(actor.strategy.precision) engine and actor round differently, so there the check allows at least 0.5 "
        "and catches only gross faults. null = off.",
    )
