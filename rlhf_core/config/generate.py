"""The ``generate`` kind: n responses per prompt from a policy, committed as a dataset (with their KL to a
reference and a gold reward when asked)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlhf_core.config.fields import opt, required
from rlhf_core.config.sections import GeneratePrompts, ModelConfig, RolloutConfig, WorkerConfig


@dataclass
class GenerateConfig:
    model: ModelConfig = required("Policy to sample from, e.g. stage:sft.")
    data: GeneratePrompts = required("Prompts (input_key).")
    reference: ModelConfig | None = opt(None, "Also measure KL(policy || reference) of the responses (kl_to_ref).")
    strategy: WorkerConfig = opt(WorkerConfig(), "Engines' precision and device; the KL forward's Ray workers.")
    rollout: RolloutConfig = opt(
        RolloutConfig(n_samples_per_prompt=4), "Engines and sampling: n_samples_per_prompt responses per prompt."
    )
    seed: int = opt(42, "Sampling seed.")
    gold_reward: str | None = opt(
        None, "module:function(prompt, response) -> float giving each row a gold_reward (and its mean); null = none."
    )
    output_format: Literal["jsonl", "parquet"] = opt("jsonl", "File format of the committed dataset.")

    def validate(self, name: str) -> None:
        self.rollout.validate(f"{name}.rollout")
        self.strategy.validate(f"{name}.strategy")
        self.data.validate(f"{name}.data", min_len=2)
