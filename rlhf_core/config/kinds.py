"""The registry of stage kinds: each kind's config section, the job module that runs an instance, and the keys of
its shared sections that it has no use for.

The built-in kinds are listed here. Another package adds a kind without changing this project: it exposes a
``StageKind`` under the entry-point group ``rlhf_pipeline.stage_kinds`` (the entry point's name is the kind's
name), and ``STAGE_KINDS`` reads the group the first time it is used (CONTRIBUTING.md, "Adding a stage kind").
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from rlhf_core.config.fields import ConfigError
from rlhf_core.config.sections import OptimConfig
from rlhf_core.config.stages import (
    CriticInitConfig,
    DPOConfig,
    GenerateConfig,
    KTOConfig,
    PPOConfig,
    RewardModelConfig,
    ScoreConfig,
    SFTConfig,
)


@dataclass(frozen=True)
class StageKind:
    """What a kind of stage is: its config section, the job module that runs one instance, and what it does."""

    name: str
    section: type
    job: str  # python -m <job> --config FILE --stage NAME
    description: str
    # Keys of the (shared) section classes that this kind has no use for, relative to the section: left out of the
    # documentation and refused when a preset or an override sets them, so that no key is silently ignored.
    unused: frozenset[str] = frozenset()
    # The kind's own cross-field checks, ``check(stage_name, section)``, raising ConfigError; run after the built-in
    # checks of ``validation.validate``.
    check: Callable[[str, Any], None] | None = None


_PREFERENCE_KEYS = ("data.prompt_key", "data.chosen_key", "data.rejected_key")
_GENERATED_KEYS = ("data.response_key", "data.label_key")
_PROMPT_ONLY = frozenset(("data.output_key", *_PREFERENCE_KEYS, *_GENERATED_KEYS))
# frozen workers (generate's log-prob groups, score's reward model) pick their attention themselves (FrozenStrategy)
_NOT_TRAINED = (
    "strategy.zero_stage",
    "strategy.offload_optimizer",
    "strategy.gradient_checkpointing",
    "strategy.attn_implementation",
)
_NOT_SYNCED = ("rollout.enable_sleep", "rollout.weight_sync_backend", "rollout.weight_sync_bucket_mb")
# the actor's loss and the critic-free estimators: the critic warm-up (GAE, the actor frozen) has no use for them
_ACTOR_LOSS = (
    "algo.advantage_estimator",
    "algo.eps_clip_high",
    "algo.dual_clip",
    "algo.loss_agg",
    "algo.kl_loss_unbiased",
    "algo.entropy_coef",
    "algo.is_correction_cap",
    "algo.dynamic_filter",
)
_ACTOR_OPTIM = tuple(f"actor_optim.{f.name}" for f in dataclasses.fields(OptimConfig))

_KINDS = (
    StageKind(
        name="sft",
        section=SFTConfig,
        job="rlhf_core.jobs.sft",
        description="Supervised fine-tuning of a causal LM.",
        unused=frozenset({*_PREFERENCE_KEYS, *_GENERATED_KEYS}),
    ),
    StageKind(
        name="reward_model",
        section=RewardModelConfig,
        job="rlhf_core.jobs.reward_model",
        description="Reward model on preferences.",
        unused=frozenset({"data.input_key", "data.output_key", *_GENERATED_KEYS}),
    ),
    StageKind(
        name="critic_init",
        section=CriticInitConfig,
        job="rlhf_core.jobs.critic_init",
        description="Critic = copy of a reward model.",
        unused=frozenset({"model.init_seed"}),
    ),
    StageKind(
        name="critic_warmup",
        section=PPOConfig,
        job="rlhf_core.jobs.critic_warmup",
        description="PPO loop with the actor frozen.",
        unused=_PROMPT_ONLY
        | {
            "train.freeze_actor_steps",
            "train.save_critic",
            "algo.eps_clip",
            "algo.whiten_advantages",
            "actor_strategy.gradient_checkpointing",
            "actor_strategy.offload_optimizer",
            *_ACTOR_OPTIM,
            *_ACTOR_LOSS,
        },
    ),
    StageKind(
        name="ppo",
        section=PPOConfig,
        job="rlhf_core.jobs.ppo",
        description="Ray-distributed PPO.",
        unused=_PROMPT_ONLY,
    ),
    StageKind(
        name="dpo",
        section=DPOConfig,
        job="rlhf_core.jobs.dpo",
        description="DPO, IPO or cDPO on preference pairs.",
        unused=frozenset({"data.input_key", "data.output_key", *_GENERATED_KEYS}),
    ),
    StageKind(
        name="kto",
        section=KTOConfig,
        job="rlhf_core.jobs.kto",
        description="KTO on desirable/undesirable examples.",
        unused=frozenset({"data.input_key", "data.output_key"}),
    ),
    StageKind(
        name="generate",
        section=GenerateConfig,
        job="rlhf_core.jobs.generate",
        description="n responses per prompt -> a dataset.",
        unused=_PROMPT_ONLY | {"data.eval_path", "data.eval_split", *_NOT_TRAINED, *_NOT_SYNCED},
    ),
    StageKind(
        name="score",
        section=ScoreConfig,
        job="rlhf_core.jobs.score",
        description="Scores rows with a reward model or function.",
        unused=frozenset(
            {
                "data.eval_path",
                "data.eval_split",
                "data.input_key",
                "data.output_key",
                "data.chosen_key",
                "data.rejected_key",
                "data.label_key",
                *_NOT_TRAINED,
            }
        ),
    ),
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


STAGE_KINDS: Mapping[str, StageKind] = StageKinds(_KINDS)
