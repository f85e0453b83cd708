"""The ``dpo`` kind: DPO, IPO or cDPO on preference pairs, against a frozen reference. ``PreferenceConfig`` is what
it shares with KTO (``kto.py``): the policy, its reference and where the reference's numbers come from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlhf_core.config.fields import ConfigError, check, opt, required
from rlhf_core.config.sections import (
    ModelConfig,
    OptimConfig,
    PreferenceData,
    StrategyConfig,
    TrainConfig,
    TrainedModelConfig,
    check_training,
)


@dataclass
class PreferenceConfig:
    model: TrainedModelConfig = required("Policy to train, usually stage:sft.")
    data: PreferenceData = required("Preference pairs (prompt_key, chosen_key, rejected_key); eval_path: held-out.")
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

    def validate(self, name: str) -> None:
        self.model.validate(f"{name}.model")
        check_training(name, self.strategy, self.optim, self.train, self.data)
        check(self.beta > 0, f"{name}.beta", self.beta, "must be > 0")


@dataclass
class DPOConfig(PreferenceConfig):
    loss_type: Literal["sigmoid", "ipo"] = opt("sigmoid", "sigmoid = DPO (cDPO with label_smoothing > 0); ipo = IPO.")
    label_smoothing: float = opt(0.0, "cDPO: assumed probability in [0, 0.5) that a preference label is flipped.")
    nll_loss_coef: float = opt(0.0, "Weight of an added NLL (SFT) loss on the chosen responses (0 = none).")

    def validate(self, name: str) -> None:
        super().validate(name)
        smoothing = self.label_smoothing
        check(0 <= smoothing < 0.5, f"{name}.label_smoothing", smoothing, "must be in [0, 0.5)")
        check(self.nll_loss_coef >= 0, f"{name}.nll_loss_coef", self.nll_loss_coef, "must be >= 0")
        if self.loss_type == "ipo" and smoothing:
            raise ConfigError(f"'{name}.label_smoothing' applies to loss_type=sigmoid (cDPO), not ipo: set it to 0")
