"""The ``critic_init`` kind: the critic starts as a copy of a reward model (backbone and value head)."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_core.config.fields import required
from rlhf_core.config.sections import ReadModelConfig


@dataclass
class CriticInitConfig:
    model: ReadModelConfig = required("Reward model to copy, usually stage:reward_model.")

    def validate(self, name: str) -> None:
        """Nothing to check beyond the types: the job verifies that the model is a reward model."""
