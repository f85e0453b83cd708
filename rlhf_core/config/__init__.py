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

The package, in reading order: ``fields`` (``opt``, ``required``, ``ConfigError``), ``sections`` (the sections several
kinds share), ``stages`` (one section per kind), ``kinds`` (``STAGE_KINDS``), ``pipeline`` (run-level keys and the
stage graph), ``loading`` (YAML, overrides, the loop, types), ``validation`` (cross-field checks), ``hashing`` (a
stage's config hash) and ``serialise`` (``to_yaml`` with redaction, ``describe``). ``python -m rlhf_core.config``
lists every key.
"""

from rlhf_core.config.fields import ConfigError
from rlhf_core.config.hashing import stage_hash
from rlhf_core.config.kinds import STAGE_KINDS, StageKind
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
from rlhf_core.config.sections import DataConfig, ModelConfig, OptimConfig, RolloutConfig, StrategyConfig, TrainConfig
from rlhf_core.config.serialise import describe, redact_tracking_uri, redact_url, to_dict, to_yaml
from rlhf_core.config.stages import (
    REWARD_SOURCES,
    CriticInitConfig,
    DPOConfig,
    GenerateConfig,
    KTOConfig,
    PPOAlgoConfig,
    PPOConfig,
    PPOTrainConfig,
    PreferenceConfig,
    RemoteRewardConfig,
    RewardModelConfig,
    ScoreConfig,
    SFTConfig,
    reward_sources,
    uses_critic,
)
from rlhf_core.config.validation import validate

__all__ = [
    "ConfigError",
    "CriticInitConfig",
    "DPOConfig",
    "DataConfig",
    "GenerateConfig",
    "KTOConfig",
    "LoopConfig",
    "MLflowConfig",
    "ModelConfig",
    "OptimConfig",
    "PPOAlgoConfig",
    "PPOConfig",
    "PPOTrainConfig",
    "PipelineConfig",
    "PreferenceConfig",
    "REWARD_SOURCES",
    "RemoteRewardConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "SFTConfig",
    "STAGE_KINDS",
    "STAGE_PREFIX",
    "ScoreConfig",
    "StageKind",
    "StageSpec",
    "StorageConfig",
    "StrategyConfig",
    "TrackingConfig",
    "TrainConfig",
    "WandbConfig",
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
