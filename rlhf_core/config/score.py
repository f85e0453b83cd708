"""The ``score`` kind: rows scored by a reward model or a reward function, kept whole or selected (best-of-n,
best/worst pairs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlhf_core.config.fields import ConfigError, check, opt, required
from rlhf_core.config.sections import ModelConfig, ScoreRows, WorkerConfig


@dataclass
class ScoreConfig:
    data: ScoreRows = required("Rows to score (prompt_key, response_key), usually stage:<generate stage>.")
    reward: ModelConfig | None = opt(None, "Reward model (e.g. stage:reward_model); or give reward_fn.")
    reward_fn: str | None = opt(
        None, "module:function or path.py:function(prompts, responses) -> list of floats; or give reward."
    )
    strategy: WorkerConfig = opt(WorkerConfig(), "Ray workers of the reward model.")
    micro_batch_size: int = opt(16, "Rows per reward-model forward.")
    select: Literal["all", "best", "pairs"] = opt(
        "all",
        "all = every row with its score; best = the best response per prompt (best-of-n); pairs = "
        "(best, worst) per prompt as prompt/chosen/rejected (iterative DPO).",
    )
    threshold: float | None = opt(None, "select=best: keep a prompt's best response only at this score or above.")
    output_format: Literal["jsonl", "parquet"] = opt("jsonl", "File format of the committed dataset.")

    def validate(self, name: str) -> None:
        if (self.reward is None) == (self.reward_fn is None):
            raise ConfigError(
                f"give exactly one of '{name}.reward.name_or_path' (a reward model) and '{name}.reward_fn' "
                "(module:function or path.py:function)"
            )
        check(self.micro_batch_size >= 1, f"{name}.micro_batch_size", self.micro_batch_size, "must be >= 1")
        self.strategy.validate(f"{name}.strategy")
        if self.threshold is not None and self.select != "best":
            raise ConfigError(f"'{name}.threshold' applies to select=best: set {name}.select=best or remove it")
