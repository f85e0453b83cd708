"""Typed stage configs, loaded from a YAML preset plus ``key=value`` overrides.

A preset (``deployments/configs/*.yaml``) holds the run-level keys (``run_uri``, ``storage``) and one section per
stage (``sft``, ``reward_model``, ``critic_init``). ``load_config(path, overrides)`` merges YAML and overrides into
the dataclasses below and refuses unknown keys and invalid values with a ``ConfigError`` naming the key.

Hyperparameter defaults follow OpenRLHF (arXiv 2405.11143) and its CLI; model and data paths have no default.
A model path is a Hugging Face directory or hub name, ``builtin:<name>`` (a tiny model built from
``rlhf_core/assets/models/<name>.json`` with a fixed seed), or ``stage:<name>`` (the output of an earlier stage of
the same run, read from ``<run_uri>/<name>/`` after its manifest is verified).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

MISSING: Any = dataclasses.MISSING


class ConfigError(ValueError):
    """A config key is unknown, missing or has an invalid value; the message names the key."""


def required(help: str) -> Any:
    return field(default=MISSING, metadata={"help": help})


def opt(default: Any, help: str) -> Any:
    if isinstance(default, (list, dict, tuple)) or dataclasses.is_dataclass(default):
        return field(default_factory=lambda: _copy(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def _copy(value: Any) -> Any:
    return dataclasses.replace(value) if dataclasses.is_dataclass(value) else type(value)(value)


# ---------------------------------------------------------------------------------------------------------------------
# Shared sections


@dataclass
class StorageConfig:
    endpoint_url: str | None = opt(None, "S3 endpoint (e.g. http://127.0.0.1:8333); default: AWS_ENDPOINT_URL or AWS.")
    key: str | None = opt(None, "S3 access key id; default: AWS_ACCESS_KEY_ID. Never logged or stored.")
    secret: str | None = opt(None, "S3 secret key; default: AWS_SECRET_ACCESS_KEY. Never logged or stored.")
    region: str | None = opt(None, "S3 region; default: AWS_REGION.")


@dataclass
class ModelConfig:
    name_or_path: str = required("HF directory or hub name, builtin:<name>, or stage:<stage> of this run.")
    tokenizer: str | None = opt(None, "Tokenizer path or name; default: the model's own (bundled for builtin:).")
    init_seed: int = opt(0, "Seed for building builtin: models and freshly initialised value heads.")
    trust_remote_code: bool = opt(False, "Allow custom modelling code from the model directory.")


@dataclass
class DataConfig:
    train_path: str = required("Training data: JSONL/JSON/Parquet/CSV file, save_to_disk folder, hub name, s3:// URL.")
    eval_path: str | None = opt(None, "Held-out data in the same format; required by the reward-model stage.")
    train_split: str = opt("train", "Split name for hub datasets and DatasetDict folders.")
    eval_split: str = opt("test", "Split name of the held-out data.")
    max_len: int = opt(512, "Maximum tokens of prompt + response; longer responses are truncated, longer prompts refused.")
    max_samples: int | None = opt(None, "Use only the first N training rows.")
    input_key: str = opt("input", "SFT: key of the prompt (a string or a list of chat messages).")
    output_key: str | None = opt("output", "SFT: key of the response; null = input_key holds HH-RLHF transcripts.")
    prompt_key: str | None = opt("prompt", "Preferences: key of the prompt; null = chosen/rejected are full transcripts.")
    chosen_key: str = opt("chosen", "Preferences: key of the preferred response.")
    rejected_key: str = opt("rejected", "Preferences: key of the rejected response.")
    input_template: str | None = opt(None, "Prompt template with one {} (e.g. 'User: {}\\nAssistant: ').")
    apply_chat_template: bool = opt(True, "Use the tokenizer's chat template when it has one.")


@dataclass
class StrategyConfig:
    num_workers: int = opt(1, "Ray actors in the training group, one per device.")
    zero_stage: int = opt(2, "DeepSpeed ZeRO stage, 0-3.")
    offload_optimizer: bool = opt(False, "Keep optimizer state on the CPU (DeepSpeedCPUAdam).")
    precision: Literal["bf16", "fp32"] = opt("bf16", "Training precision.")
    gradient_checkpointing: bool = opt(False, "Recompute activations in backward to save memory.")
    attn_implementation: Literal["auto", "flash_attention_2", "sdpa", "eager"] = opt(
        "auto", "auto = flash_attention_2 when installed on a GPU, else sdpa."
    )
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "auto = cuda when a GPU is visible, else cpu.")
    cpus_per_worker: float = opt(1.0, "Ray CPUs reserved per worker.")
    threads_per_worker: int = opt(1, "torch/OMP threads per worker (avoid oversubscription on small machines).")


@dataclass
class OptimConfig:
    lr: float = opt(5e-6, "Peak learning rate.")
    weight_decay: float = opt(0.0, "AdamW weight decay.")
    adam_betas: list[float] = opt([0.9, 0.95], "AdamW betas.")
    lr_scheduler: Literal["cosine_with_min_lr", "constant_with_warmup"] = opt("cosine_with_min_lr", "LR schedule.")
    lr_warmup_ratio: float = opt(0.03, "Fraction of steps spent in linear warm-up.")
    min_lr_ratio: float = opt(0.1, "Final LR as a fraction of the peak (cosine).")
    max_norm: float = opt(1.0, "Gradient clipping norm (0 = off).")


@dataclass
class TrainConfig:
    train_batch_size: int = opt(128, "Global batch: samples per optimizer step over all ranks.")
    micro_train_batch_size: int = opt(8, "Samples per forward/backward on one rank.")
    max_epochs: int = opt(1, "Passes over the training set.")
    max_steps: int | None = opt(None, "Stop after this many optimizer steps (default: max_epochs worth).")
    seed: int = opt(42, "Seed of data order and all RNGs.")
    save_steps: int = opt(100, "Save an in-stage checkpoint every N steps (0 = never).")
    keep_last: int = opt(3, "Keep the newest K complete checkpoints.")
    log_steps: int = opt(10, "Print metrics every N steps.")
    eval_batch_size: int = opt(32, "Samples per forward pass at evaluation.")


# ---------------------------------------------------------------------------------------------------------------------
# Stage configs


@dataclass
class SFTConfig:
    model: ModelConfig = required("Base model to fine-tune.")
    data: DataConfig = required("Instruction data (input_key, output_key).")
    strategy: StrategyConfig = opt(StrategyConfig(), "DeepSpeed/Ray settings.")
    optim: OptimConfig = opt(OptimConfig(lr=5e-6), "Optimizer settings.")
    train: TrainConfig = opt(TrainConfig(), "Batching, steps, checkpoints.")


@dataclass
class RewardModelConfig:
    model: ModelConfig = required("Model to start from, usually stage:sft.")
    data: DataConfig = required("Preference data (prompt_key, chosen_key, rejected_key) with eval_path.")
    strategy: StrategyConfig = opt(StrategyConfig(), "DeepSpeed/Ray settings.")
    optim: OptimConfig = opt(OptimConfig(lr=9e-6), "Optimizer settings.")
    train: TrainConfig = opt(TrainConfig(), "Batching, steps, checkpoints.")
    margin: float = opt(0.0, "Margin m in -log sigmoid(r_chosen - r_rejected - m).")


@dataclass
class CriticInitConfig:
    model: ModelConfig = required("Reward model to copy, usually stage:reward_model.")


@dataclass
class PipelineConfig:
    run_uri: str = required("Where the run's artifacts go: a local path, file://... or s3://bucket/prefix.")
    storage: StorageConfig = opt(StorageConfig(), "Object-store credentials and endpoint.")
    sft: SFTConfig | None = opt(None, "SFT stage.")
    reward_model: RewardModelConfig | None = opt(None, "Reward-model stage.")
    critic_init: CriticInitConfig | None = opt(None, "Critic-initialisation stage.")

    def stage(self, name: str) -> Any:
        section = getattr(self, name, None)
        if section is None:
            raise ConfigError(f"the config has no '{name}' section; add it to the preset")
        return section


STAGES = ("sft", "reward_model", "critic_init")


# ---------------------------------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> PipelineConfig:
    """Merge a YAML preset and ``a.b.c=value`` overrides into a validated ``PipelineConfig``."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        raw = _unalias(raw)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        _set_dotted(raw, key.strip(), yaml.safe_load(value) if value.strip() else None)
    cfg = _build(PipelineConfig, raw, "")
    validate(cfg)
    return cfg


def _unalias(node: Any) -> Any:
    """Copy a YAML tree so that sections shared through anchors (&x / *x) stop sharing: an override of one
    stage's section must not change another's."""
    if isinstance(node, dict):
        return {k: _unalias(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_unalias(v) for v in node]
    return node


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for p in parents:
        child = node.get(p)
        if child is None:
            child = node[p] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override '{dotted}': '{p}' is not a section")
        node = child
    node[leaf] = value


def _build(cls: type, data: Any, prefix: str) -> Any:
    where = prefix or "the top level"
    if not isinstance(data, dict):
        raise ConfigError(f"'{prefix}' must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"; did you mean '{_join(prefix, close[0])}'?" if close else ""
            raise ConfigError(f"unknown config key '{_join(prefix, key)}' in {where}{hint}")
    kwargs = {}
    for name, f in fields.items():
        key = _join(prefix, name)
        if name in data:
            value = data[name]
            if isinstance(value, dict) and f.default_factory is not MISSING:  # type: ignore[misc]
                # A partial section overrides the stage's own defaults (e.g. the RM's higher learning rate).
                value = _deep_merge(dataclasses.asdict(f.default_factory()), value)  # type: ignore[misc]
            kwargs[name] = _coerce(hints[name], value, key)
        elif f.default is MISSING and f.default_factory is MISSING:  # type: ignore[misc]
            raise ConfigError(f"missing required config key '{key}': {f.metadata.get('help', '')}")
    return cls(**kwargs)


def _deep_merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(args[0], value, key)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"invalid value {value!r} for '{key}': choose one of {', '.join(map(str, choices))}")
        return value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"invalid value {value!r} for '{key}': expected a list")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"invalid value {value!r} for '{key}': expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"invalid value {value!r} for '{key}': expected an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"invalid value {value!r} for '{key}': expected a number")
        return float(value)
    if tp is str:
        if value is None or isinstance(value, (dict, list)):
            raise ConfigError(f"invalid value {value!r} for '{key}': expected a string")
        return str(value)
    return value


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else str(name)


# ---------------------------------------------------------------------------------------------------------------------
# Validation: every cross-field check in one place, each error names the key to change.


def validate(cfg: PipelineConfig) -> None:
    if not cfg.run_uri.strip():
        raise ConfigError("'run_uri' is empty: give a local path, file://... or s3://bucket/prefix")
    for name in ("sft", "reward_model"):
        stage = getattr(cfg, name)
        if stage is None:
            continue
        _validate_training(name, stage)
    rm = cfg.reward_model
    if rm is not None and not rm.data.eval_path:
        raise ConfigError("'reward_model.data.eval_path' is required: held-out pairs give accuracy and reward stats")


def _validate_training(name: str, stage: Any) -> None:
    s, t, o, d = stage.strategy, stage.train, stage.optim, stage.data
    _check(s.num_workers >= 1, f"{name}.strategy.num_workers", s.num_workers, "must be >= 1")
    _check(0 <= s.zero_stage <= 3, f"{name}.strategy.zero_stage", s.zero_stage, "must be 0, 1, 2 or 3")
    _check(s.threads_per_worker >= 1, f"{name}.strategy.threads_per_worker", s.threads_per_worker, "must be >= 1")
    _check(o.lr > 0, f"{name}.optim.lr", o.lr, "must be > 0")
    _check(len(o.adam_betas) == 2, f"{name}.optim.adam_betas", o.adam_betas, "must be two numbers")
    _check(0 <= o.lr_warmup_ratio < 1, f"{name}.optim.lr_warmup_ratio", o.lr_warmup_ratio, "must be in [0, 1)")
    _check(o.max_norm >= 0, f"{name}.optim.max_norm", o.max_norm, "must be >= 0")
    _check(d.max_len >= 8, f"{name}.data.max_len", d.max_len, "must be >= 8")
    _check(t.micro_train_batch_size >= 1, f"{name}.train.micro_train_batch_size", t.micro_train_batch_size, ">= 1")
    _check(t.max_epochs >= 1, f"{name}.train.max_epochs", t.max_epochs, "must be >= 1")
    _check(t.max_steps is None or t.max_steps >= 1, f"{name}.train.max_steps", t.max_steps, "must be >= 1")
    _check(t.save_steps >= 0, f"{name}.train.save_steps", t.save_steps, "must be >= 0")
    _check(t.keep_last >= 1, f"{name}.train.keep_last", t.keep_last, "must be >= 1")
    per_step = t.micro_train_batch_size * s.num_workers
    if t.train_batch_size < 1 or t.train_batch_size % per_step:
        raise ConfigError(
            f"invalid value {t.train_batch_size} for '{name}.train.train_batch_size': it must be a positive multiple "
            f"of micro_train_batch_size x num_workers = {t.micro_train_batch_size} x {s.num_workers} = {per_step}"
        )
    if d.input_template is not None and d.input_template.count("{}") != 1:
        raise ConfigError(f"invalid value {d.input_template!r} for '{name}.data.input_template': needs exactly one {{}}")


def _check(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(f"invalid value {value!r} for '{key}': {why}")


# ---------------------------------------------------------------------------------------------------------------------
# Serialisation and hashing

# Fields that do not change what a stage computes: left out of its config hash so that, for example, keeping more
# checkpoints or moving the run does not invalidate a finished stage or its in-stage checkpoints.
_NOT_HASHED = {"save_steps", "keep_last", "log_steps", "num_workers", "cpus_per_worker", "threads_per_worker"}
_SECRETS = {"key", "secret"}


def to_dict(cfg: Any, redact: bool = True) -> dict:
    """Plain dict of a config; credentials are replaced by '***' unless redact=False."""
    out = dataclasses.asdict(cfg)
    if redact and isinstance(cfg, PipelineConfig):
        for k in _SECRETS:
            if out["storage"].get(k):
                out["storage"][k] = "***"
    return out


def to_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def stage_hash(section: Any, upstream: dict[str, str] | None = None) -> str:
    """Hash of a stage's resolved section (minus bookkeeping fields) and its upstream artifacts' hashes."""

    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k not in _NOT_HASHED}
        return node

    payload = {"stage": strip(dataclasses.asdict(section)), "upstream": upstream or {}}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, help) rows for documentation and ``--help``."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = _join(prefix, f.name)
        tp = hints[f.name]
        inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        target = tp if dataclasses.is_dataclass(tp) else (inner[0] if inner else None)
        if target is not None:
            rows += describe(target, key)
            continue
        if f.default is not MISSING:
            default = repr(f.default)
        elif f.default_factory is not MISSING:  # type: ignore[misc]
            default = repr(f.default_factory())  # type: ignore[misc]
        else:
            default = "(required)"
        rows.append((key, default, f.metadata.get("help", "")))
    return rows


if __name__ == "__main__":  # python -m rlhf_core.config: every key with its default and meaning
    for key, default, help_text in describe(PipelineConfig):
        print(f"{key:45s} {default:28s} {help_text}")
