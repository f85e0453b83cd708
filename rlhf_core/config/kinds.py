"""The registry of stage kinds: each kind's config section (one module per kind in this package) and the job module
that runs an instance.

The built-in kinds are listed here. Another package adds a kind without changing this project: it exposes a
``StageKind`` under the entry-point group ``rlhf_pipeline.stage_kinds`` (the entry point's name is the kind's
name), and ``STAGE_KINDS`` reads the group the first time it is used (CONTRIBUTING.md, "Adding a stage kind").
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from rlhf_core.config.critic_init import CriticInitConfig
from rlhf_core.config.critic_warmup import CriticWarmupConfig
from rlhf_core.config.dpo import DPOConfig
from rlhf_core.config.fields import ConfigError
from rlhf_core.config.generate import GenerateConfig
from rlhf_core.config.kto import KTOConfig
from rlhf_core.config.ppo import PPOConfig
from rlhf_core.config.reward_model import RewardModelConfig
from rlhf_core.config.score import ScoreConfig
from rlhf_core.config.sft import SFTConfig


@dataclass(frozen=True)
class StageKind:
    """What a kind of stage is: its config section, the job module that runs one instance, and what it does. The
    section is a dataclass of the keys the kind reads, with a ``validate(stage_name)`` method, raising
    ``ConfigError``, for the checks that span its fields (run by ``load_config`` after every value has its type)."""

    name: str
    section: type
    job: str  # python -m <job> --config FILE --stage NAME
    description: str


BUILTIN_KINDS = (
    StageKind("sft", SFTConfig, "rlhf_core.jobs.sft", "Supervised fine-tuning of a causal LM."),
    StageKind("reward_model", RewardModelConfig, "rlhf_core.jobs.reward_model", "Reward model on preferences."),
    StageKind("critic_init", CriticInitConfig, "rlhf_core.jobs.critic_init", "Critic = copy of a reward model."),
    StageKind("critic_warmup", CriticWarmupConfig, "rlhf_core.jobs.critic_warmup", "PPO loop with the actor frozen."),
    StageKind("ppo", PPOConfig, "rlhf_core.jobs.ppo", "Ray-distributed PPO."),
    StageKind("dpo", DPOConfig, "rlhf_core.jobs.dpo", "DPO, IPO or cDPO on preference pairs."),
    StageKind("kto", KTOConfig, "rlhf_core.jobs.kto", "KTO on desirable/undesirable examples."),
    StageKind("generate", GenerateConfig, "rlhf_core.jobs.generate", "n responses per prompt -> a dataset."),
    StageKind("score", ScoreConfig, "rlhf_core.jobs.score", "Scores rows with a reward model or function."),
)
PLUGIN_GROUP = "rlhf_pipeline.stage_kinds"


class StageKinds(Mapping[str, StageKind]):
    """The built-in kinds, then those of the installed packages' ``rlhf_pipeline.stage_kinds`` entry points, read once
    on first use (not at import: a plugin module imports ``rlhf_core.config`` itself)."""

    def __init__(self, builtin: tuple[StageKind, ...]):
        self._kinds = {kind.name: kind for kind in builtin}
        self._builtin = frozenset(self._kinds)
        self._loaded = False

    def _all(self) -> dict[str, StageKind]:
        if not self._loaded:
            self._loaded = True
            for entry in importlib.metadata.entry_points(group=PLUGIN_GROUP):
                self._kinds[entry.name] = self._plugin(entry)
        return self._kinds

    def _plugin(self, entry: importlib.metadata.EntryPoint) -> StageKind:
        where = f"stage-kind entry point '{entry.name} = {entry.value}' ({PLUGIN_GROUP})"
        if entry.name in self._builtin:
            raise ConfigError(f"{where}: '{entry.name}' is a built-in kind and cannot be replaced")
        try:
            kind = entry.load()
        except Exception as e:  # the plugin's own import error, whatever it is, named with its entry point
            raise ConfigError(f"{where} cannot be loaded: {type(e).__name__}: {e}") from None
        if not isinstance(kind, StageKind) or kind.name != entry.name:
            raise ConfigError(f"{where} must name a StageKind whose name is '{entry.name}'")
        return kind

    def __getitem__(self, name: str) -> StageKind:
        return self._all()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


STAGE_KINDS: Mapping[str, StageKind] = StageKinds(BUILTIN_KINDS)
