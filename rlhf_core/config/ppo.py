"""The ``ppo`` kind: Ray-distributed PPO and the critic-free RL methods (REINFORCE++, GRPO, RLOO, Dr. GRPO). Its
section is the critic warm-up's (roles, rewards, rollout) plus what trains the actor: its optimizer, the actor loss
and the advantage estimator."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from rlhf_core.algos.vocab import GROUP_ESTIMATORS, AdvantageEstimator, ISCorrection, LossAggregation, PolicyLoss
from rlhf_core.config.critic_warmup import CriticWarmupConfig, check_rl
from rlhf_core.config.fields import ConfigError, check, opt, required
from rlhf_core.config.rl import ROLE_KEYS_MOVED, ActorRole, CriticRole, RLTrainConfig, ValueAlgoConfig
from rlhf_core.config.sections import StrategyConfig, TrainedModelConfig


@dataclass
class PPOAlgoConfig(ValueAlgoConfig):
    """The critic's settings (``ValueAlgoConfig``) plus the actor's loss and the advantage estimator."""

    eps_clip: float = opt(0.2, "PPO policy clip range.")
    whiten_advantages: bool = opt(
        True, "gae: normalise advantages over the whole rollout batch across all DP ranks (reinforce++ always does)."
    )
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
    kl_loss_unbiased: bool = opt(
        False, "kl_mode=loss: weigh the KL term by pi/pi_old (unbiased under rollout samples, DeepSeek-V3.2)."
    )
    entropy_coef: float = opt(0.0, "Entropy bonus: the actor loss minus this x the token entropy (0 = none).")
    policy_loss: PolicyLoss = opt(
        "ppo",
        "Policy ratio: ppo = per token; gspo = per sequence, exp of the mean token log-ratio (GSPO; needs "
        "loss_agg=seq_mean, and takes small clips such as eps_clip=3e-4, eps_clip_high=4e-4).",
    )
    is_correction_cap: float | None = opt(
        None,
        "Truncated importance sampling between engine and trainer log-probs: each token's loss x min(exp(old - "
        "rollout), cap); null = off. The same as is_correction=tis with is_correction_threshold [0, cap].",
    )
    is_correction: ISCorrection | None = opt(
        None,
        "Off-policy correction by r = exp(old - rollout) per token (engine vs trainer log-probs), with "
        "is_correction_threshold [low, high]: tis = loss x clamp(r, low, high); icepop = loss x r, 0 outside [low, "
        "high]; seq-mask-tis = loss x r, rows whose geometric-mean r is outside [low, high] dropped; null = off.",
    )
    is_correction_threshold: list[float] = opt([0.5, 5.0], "[low, high] of algo.is_correction (0 <= low < high).")
    use_rollout_logprobs: bool = opt(
        False,
        "A batch of several optimizer steps (ppo_epochs > 1 or train_batch_size < the rollout's samples): take the "
        "engines' log-probs as the old ones instead of the actor's experience forward; the actor scores only its "
        "first micro-batch to measure rollout_logprob_max_diff, and runs the whole forward when that exceeds "
        "rollout_logprobs_max_diff. (One optimizer step per batch never runs that forward: exact.)",
    )
    rollout_logprobs_max_diff: float = opt(
        0.1,
        "use_rollout_logprobs: the largest |engine - actor| log-prob gap on the probed micro-batch that still takes "
        "the engines' log-probs; above it the step falls back to the actor's forward.",
    )
    dynamic_filter: bool = opt(
        False, "Drop the prompts whose n samples all got the same reward (DAPO dynamic sampling; no signal)."
    )


@dataclass
class PPOTrainConfig(RLTrainConfig):
    freeze_actor_steps: int = opt(0, "First N PPO steps train only the critic (frozen-actor warm-up).")
    save_critic: bool = opt(True, "Also write the trained critic (to <run_uri>/<stage>/critic/).")
    async_enable: bool = opt(
        False,
        "Generate the next steps' rollouts on a thread while this step trains (OpenRLHF async training): a batch is "
        "sampled with one weight version, at most async_queue_size weight updates old when it trains. Not "
        "reproducible run to run: which version samples a batch depends on timing.",
    )
    async_queue_size: int = opt(1, "train.async_enable: rollout batches the generator may run ahead of training.")
    partial_rollout_enable: bool = opt(
        False,
        "train.async_enable with the vLLM backend: a weight sync no longer waits for the rollout being generated. The "
        "engines stop between decoding steps, take the new weights, compute the running responses' prompts and "
        "tokens so far again under them and go on, so a response's tokens may come from two or more weight "
        "versions (OpenRLHF partial rollout; pair it with algo.is_correction).",
    )


@dataclass
class PPOConfig(CriticWarmupConfig):
    RENAMED: ClassVar[dict[str, str]] = {**ROLE_KEYS_MOVED, "actor_optim": "actor.optim"}

    actor: ActorRole = required("The policy to train (model, usually stage:sft), its strategy and optimizer.")
    critic: CriticRole = opt(
        CriticRole(),
        "The critic (algo.advantage_estimator=gae only): model, e.g. stage:critic_warmup; strategy, optim.",
    )
    algo: PPOAlgoConfig = opt(PPOAlgoConfig(), "PPO, KL and reward settings.")
    train: PPOTrainConfig = opt(PPOTrainConfig(), "Batching, steps, checkpoints.")

    @classmethod
    def from_warmup(cls, w: CriticWarmupConfig) -> PPOConfig:
        """The PPO section that runs a critic warm-up: its own values, and PPO's defaults for the actor's optimizer,
        loss and estimator, which a frozen actor never uses."""
        fields = {f.name: getattr(w, f.name) for f in dataclasses.fields(CriticWarmupConfig)}
        actor_model = TrainedModelConfig(**dataclasses.asdict(w.actor.model))  # frozen: no adapters
        fields["actor"] = ActorRole(model=actor_model, strategy=_training_strategy(w))
        fields["algo"] = PPOAlgoConfig(**dataclasses.asdict(w.algo))
        fields["train"] = PPOTrainConfig(**dataclasses.asdict(w.train))
        return cls(**fields)

    def validate(self, name: str) -> None:
        critic, a, n = uses_critic("ppo", self), self.algo, self.rollout.n_samples_per_prompt
        if critic and self.critic.model is None:
            raise ConfigError(
                f"'{name}.critic.model.name_or_path' is required: algo.advantage_estimator=gae needs one (e.g. "
                f"stage:critic_init), or choose a critic-free '{name}.algo.advantage_estimator' (reinforce++, grpo, "
                "rloo, ...)"
            )
        if not critic and self.critic.model is not None:
            raise ConfigError(
                f"'{name}.critic.model' is set but '{name}.algo.advantage_estimator' = {a.advantage_estimator} "
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
        check(a.eps_clip > 0, f"{name}.algo.eps_clip", a.eps_clip, "must be > 0")
        check(a.eps_clip_high is None or a.eps_clip_high > 0, f"{name}.algo.eps_clip_high", a.eps_clip_high, "> 0")
        check(a.dual_clip is None or a.dual_clip > 1, f"{name}.algo.dual_clip", a.dual_clip, "must be > 1 (e.g. 3)")
        check(a.entropy_coef >= 0, f"{name}.algo.entropy_coef", a.entropy_coef, "must be >= 0")
        cap = a.is_correction_cap
        check(cap is None or cap > 0, f"{name}.algo.is_correction_cap", cap, "must be > 0 (e.g. 2.0)")
        _check_off_policy(name, a)
        if a.kl_loss_unbiased and not a.kl_in_loss:
            raise ConfigError(
                f"'{name}.algo.kl_loss_unbiased' applies to the KL loss term: set '{name}.algo.kl_mode' "
                "= loss or remove it"
            )
        freeze = self.train.freeze_actor_steps
        check(freeze >= 0, f"{name}.train.freeze_actor_steps", freeze, "must be >= 0")
        _check_async(name, self)
        self.actor.optim.validate(f"{name}.actor.optim")
        check_rl(name, self, critic)


def _check_off_policy(name: str, a: PPOAlgoConfig) -> None:
    """GSPO's objective is a mean over sequences; the IS correction's thresholds, one of its two spellings, and
    none with the engines' log-probs as the old ones (``use_rollout_logprobs``); the gap bound."""
    if a.policy_loss == "gspo" and a.loss_agg != "seq_mean":
        raise ConfigError(
            f"'{name}.algo.policy_loss' = gspo averages each sequence's clipped ratio: set '{name}.algo.loss_agg' "
            f"= seq_mean (it is {a.loss_agg})"
        )
    low_high = a.is_correction_threshold
    ok = len(low_high) == 2 and 0 <= low_high[0] < low_high[1]
    check(ok, f"{name}.algo.is_correction_threshold", low_high, "must be [low, high] with 0 <= low < high")
    bound = a.rollout_logprobs_max_diff
    check(bound >= 0, f"{name}.algo.rollout_logprobs_max_diff", bound, "must be >= 0 (e.g. 0.1)")
    if a.use_rollout_logprobs and (a.is_correction is not None or a.is_correction_cap is not None):
        raise ConfigError(
            f"'{name}.algo.use_rollout_logprobs' takes the engines' log-probs as the old ones, so the engine/trainer "
            f"correction of '{name}.algo.is_correction' (or is_correction_cap) would weigh every token by 1: keep one"
        )
    if a.is_correction is not None and a.is_correction_cap is not None:
        raise ConfigError(
            f"'{name}.algo.is_correction_cap' and '{name}.algo.is_correction' both correct the engine's log-probs: "
            f"keep one (is_correction_cap = c is is_correction=tis with is_correction_threshold [0, c])"
        )


def _check_async(name: str, p: PPOConfig) -> None:
    """Async generation overlaps training, so nothing may hand the devices from one phase to the other."""
    queue = p.train.async_queue_size
    check(queue >= 1, f"{name}.train.async_queue_size", queue, "must be >= 1")
    if p.train.partial_rollout_enable:
        check(
            p.train.async_enable, f"{name}.train.async_enable", False, "must be true with train.partial_rollout_enable"
        )
        check(
            p.rollout.backend == "vllm",
            f"{name}.rollout.backend",
            p.rollout.backend,
            "must be vllm with train.partial_rollout_enable: Hugging Face generate runs each batch to its end",
        )
    for key, on in [
        ("rollout.enable_sleep", p.rollout.enable_sleep),
        ("placement.offload_states_during_rollout", p.placement.offload_states_during_rollout),
    ]:
        if p.train.async_enable and on:
            raise ConfigError(
                f"'{name}.train.async_enable' generates while the models train, so the devices cannot change hands "
                f"between the phases: set '{name}.{key}' = false or async_enable = false"
            )


def _training_strategy(w: CriticWarmupConfig) -> StrategyConfig:
    """The warm-up actor's strategy with PPO's defaults for what only a trained actor uses (offload, checkpointing)."""
    return StrategyConfig(**dataclasses.asdict(w.actor.strategy))


def as_ppo(section: CriticWarmupConfig) -> PPOConfig:
    """The PPO section that runs a stage of either PPO kind (a critic warm-up's with PPO's actor defaults)."""
    return section if isinstance(section, PPOConfig) else PPOConfig.from_warmup(section)


def uses_critic(kind: str, p: CriticWarmupConfig) -> bool:
    """The critic warm-up and GAE train a critic; the critic-free estimators build none."""
    return kind == "critic_warmup" or (isinstance(p.algo, PPOAlgoConfig) and p.algo.advantage_estimator == "gae")
