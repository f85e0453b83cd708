"""The ``reward_model`` kind: a reward model trained on preference pairs (Bradley-Terry loss with a margin)."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_core.config.fields import ConfigError, opt, required
from rlhf_core.config.sections import (
    OptimConfig,
    PreferenceData,
    StrategyConfig,
    TrainConfig,
    TrainedModelConfig,
    check_training,
)


@dataclass
class RewardModelConfig:
    model: TrainedModelConfig = required("Model to start from, usually stage:sft.")
    data: PreferenceData = required("Preference data (prompt_key, chosen_key, rejected_key) with eval_path.")
    strategy: StrategyConfig = opt(StrategyConfig(), "DeepSpeed/Ray settings.")
    optim: OptimConfig = opt(OptimConfig(lr=9e-6), "Optimizer settings.")
    train: TrainConfig = opt(TrainConfig(), "Batching, steps, checkpoints.")
    margin: float = opt(0.0, "Margin m in -log sigmoid(r_chosen - r_rejected - m).")

    def validate(self, name: str) -> None:
        self.model.validate(f"{name}.model")
        check_training(name, self.strategy, self.optim, self.train, self.data)
        if not self.data.eval_path:
            raise ConfigError(f"'{name}.data.eval_path' is required: held-out pairs give accuracy and reward stats")
