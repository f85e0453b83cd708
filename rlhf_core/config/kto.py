"""The ``kto`` kind: KTO on desirable and undesirable examples (pairs, or unpaired rows with a label)."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_core.config.dpo import PreferenceConfig
from rlhf_core.config.fields import check, opt, required
from rlhf_core.config.sections import KTOData


@dataclass
class KTOConfig(PreferenceConfig):
    data: KTOData = required(
        "Preference pairs (prompt_key, chosen_key, rejected_key), or unpaired rows (prompt_key, response_key, "
        "label_key); eval_path: held-out rows."
    )
    desirable_weight: float = opt(1.0, "Weight of the desirable examples' losses.")
    undesirable_weight: float = opt(1.0, "Weight of the undesirable examples' losses.")

    def validate(self, name: str) -> None:
        super().validate(name)
        check(self.desirable_weight > 0, f"{name}.desirable_weight", self.desirable_weight, "must be > 0")
        check(self.undesirable_weight > 0, f"{name}.undesirable_weight", self.undesirable_weight, "must be > 0")
