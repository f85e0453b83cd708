"""The ``sft`` kind: supervised fine-tuning of a causal LM on instruction rows."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_core.config.fields import opt, required
from rlhf_core.config.sections import (
    OptimConfig,
    SFTData,
    StrategyConfig,
    TrainConfig,
    TrainedModelConfig,
    check_training,
)


@dataclass
class SFTConfig:
    model: TrainedModelConfig = required("Base model to fine-tune.")
    data: SFTData = required("Instruction data (input_key, output_key).")
    strategy: StrategyConfig = opt(StrategyConfig(), "DeepSpeed/Ray settings.")
    optim: OptimConfig = opt(OptimConfig(lr=5e-6), "Optimizer settings.")
    train: TrainConfig = opt(TrainConfig(), "Batching, steps, checkpoints.")

    def validate(self, name: str) -> None:
        self.model.validate(f"{name}.model")
        check_training(name, self.strategy, self.optim, self.train, self.data)
