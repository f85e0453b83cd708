"""Typed stage configs, loaded from a YAML preset plus ``key=value`` overrides.

A preset (``deployments/configs/*.yaml``) holds the run-level keys (``run_uri``, ``storage``) and ``stages``: named
stage instances, each with a ``kind`` (``sft``, ``reward_model``, ``critic_init``, ``critic_warmup``, ``ppo``,
``dpo``, ``kto``, ``generate``, ``score``; see ``STAGE_KINDS``) and that kind's section. ``stage:<name>`` model and
data paths make the dependency graph; several instances of one kind can live in one run (``sft_a`` -> ``sft_b``).
An optional ``loop`` repeats a group of stages K times as instances ``<name>_<i>`` (``loading.expand_loop``).
``load_config(path, overrides)`` merges YAML and overrides into the section dataclasses and refuses unknown keys and
invalid values with a ``ConfigError`` naming the key; ``<stage>.a.b=value`` overrides are shorthand for
``stages.<stage>.a.b=value``.

Hyperparameter defaults follow OpenRLHF (arXiv 2405.11143) and its CLI; model and data paths have no default.
A model path is a Hugging Face directory or hub name, ``builtin:<name>`` (a tiny model built from
``rlhf_core/assets/models/<name>.json`` with a fixed seed), or ``stage:<name>`` (the output of an earlier stage of
the same run, read from ``<run_uri>/<name>/`` after its manifest is verified).

The package, in reading order: ``fields`` (``opt``, ``required``, ``ConfigError``, ``check``), ``sections`` (the
sections several kinds share: model, data by row shape, workers and strategy, optimizer, training loop, rollout),
one module per kind (``sft``, ``reward_model``, ``critic_init``, ``dpo``, ``kto``, ``generate``, ``score``, and for
the PPO kinds ``rl`` (their role sections), ``critic_warmup`` (with the checks both share) and ``ppo``), each section
with its own ``validate``; ``kinds`` (``STAGE_KINDS``), ``pipeline`` (run-level keys and the stage graph),
``loading`` (YAML, overrides, the loop, types, renamed keys), ``validation`` (run-level checks), ``hashing`` (a
stage's config hash), ``redact`` (credentials out of URLs) and ``serialise`` (``to_yaml``, ``describe``).
``python -m rlhf_core.config`` lists every key.
"""

from rlhf_core.config.critic_init import CriticInitConfig
from rlhf_core.config.critic_warmup import CriticWarmupConfig, reward_sources
from rlhf_core.config.dpo import DPOConfig, PreferenceConfig
from rlhf_core.config.fields import ConfigError
from rlhf_core.config.generate import GenerateConfig
from rlhf_core.config.hashing import stage_hash
from rlhf_core.config.kinds import STAGE_KINDS, StageKind
from rlhf_core.config.kto import KTOConfig
from rlhf_core.config.loading import flatten, load_config
from rlhf_core.config.pipeline import (
    STAGE_PREFIX,
    LoopConfig,
    MLflowConfig,
    PipelineConfig,
    StageSpec,
    StorageConfig,
    TrackingConfig,
    WandbConfig,
)
from rlhf_core.config.ppo import PPOAlgoConfig, PPOConfig, PPOTrainConfig, as_ppo, uses_critic
from rlhf_core.config.redact import redact_tracking_uri, redact_url
from rlhf_core.config.reward_model import RewardModelConfig
from rlhf_core.config.rl import (
    REWARD_SOURCES,
    ActorRole,
    CriticRole,
    FrozenActorRole,
    FrozenWorkersConfig,
    PlacementConfig,
    ReferenceRole,
    RemoteRewardConfig,
    RewardRole,
    RLTrainConfig,
    ValueAlgoConfig,
)
from rlhf_core.config.score import ScoreConfig
from rlhf_core.config.sections import (
    DataSource,
    GeneratePrompts,
    HeldOutSource,
    InferenceStrategy,
    KTOData,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    PreferenceData,
    PromptData,
    ReadModelConfig,
    RolloutConfig,
    ScoreRows,
    SFTData,
    StrategyConfig,
    SyncedRolloutConfig,
    TrainConfig,
    TrainedModelConfig,
    WorkerConfig,
)
from rlhf_core.config.serialise import describe, to_dict, to_yaml
from rlhf_core.config.sft import SFTConfig
from rlhf_core.config.validation import validate

__all__ = [
    "ActorRole",
    "ConfigError",
    "CriticInitConfig",
    "CriticRole",
    "CriticWarmupConfig",
    "DPOConfig",
    "DataSource",
    "FrozenActorRole",
    "FrozenWorkersConfig",
    "GenerateConfig",
    "GeneratePrompts",
    "HeldOutSource",
    "InferenceStrategy",
    "KTOConfig",
    "KTOData",
    "LoopConfig",
    "LoraConfig",
    "MLflowConfig",
    "ModelConfig",
    "OptimConfig",
    "PPOAlgoConfig",
    "PPOConfig",
    "PPOTrainConfig",
    "PipelineConfig",
    "PlacementConfig",
    "PreferenceConfig",
    "PreferenceData",
    "PromptData",
    "REWARD_SOURCES",
    "RLTrainConfig",
    "ReadModelConfig",
    "ReferenceRole",
    "RemoteRewardConfig",
    "RewardModelConfig",
    "RewardRole",
    "RolloutConfig",
    "SFTConfig",
    "SFTData",
    "STAGE_KINDS",
    "STAGE_PREFIX",
    "ScoreConfig",
    "ScoreRows",
    "StageKind",
    "StageSpec",
    "StorageConfig",
    "StrategyConfig",
    "SyncedRolloutConfig",
    "TrackingConfig",
    "TrainConfig",
    "TrainedModelConfig",
    "ValueAlgoConfig",
    "WandbConfig",
    "WorkerConfig",
    "as_ppo",
    "describe",
    "flatten",
    "load_config",
    "redact_tracking_uri",
    "redact_url",
    "reward_sources",
    "stage_hash",
    "to_dict",
    "to_yaml",
    "uses_critic",
    "validate",
]
