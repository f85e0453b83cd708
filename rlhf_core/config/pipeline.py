"""The run-level config: storage, the loop, the trackers, and the stages as a graph of named instances
(``StageSpec``) linked by their ``stage:<name>`` paths."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from rlhf_core.config.fields import ConfigError, opt, required

STAGE_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
STAGE_PREFIX = "stage:"


@dataclass
class StorageConfig:
    endpoint_url: str | None = opt(None, "S3 endpoint (e.g. http://127.0.0.1:8333); default: AWS_ENDPOINT_URL or AWS.")
    key: str | None = opt(None, "S3 access key id; default: AWS_ACCESS_KEY_ID. Never logged or stored.")
    secret: str | None = opt(None, "S3 secret key; default: AWS_SECRET_ACCESS_KEY. Never logged or stored.")
    region: str | None = opt(None, "S3 region; default: AWS_REGION.")


@dataclass
class LoopConfig:
    iterations: int = opt(0, "Iterations K of the loop (0 = no loop); instance <name> of iteration i is <name>_<i>.")
    policy: str = opt(
        "", "The first iteration's policy, e.g. stage:sft; loop stages read the current one as loop:policy."
    )
    next_policy: str = opt("", "The loop stage whose output is the next iteration's policy, e.g. dpo.")
    stages: dict[str, Any] = opt({}, "The stages of one iteration (sections as under 'stages').")


# ---------------------------------------------------------------------------------------------------------------------
# Experiment trackers (rlhf_core.tracking): run-level, outside every stage's config hash


@dataclass
class MLflowConfig:
    tracking_uri: str | None = opt(
        None,
        "MLflow tracking server or store: http(s)://host:5000, file:///path, sqlite:///path.db; null = "
        "MLFLOW_TRACKING_URI, else ./mlruns. A user:password@ in it is redacted wherever it is logged or saved.",
    )
    experiment: str = opt("rlhf-pipeline", "MLflow experiment the stages' runs go to (created when missing).")


@dataclass
class WandbConfig:
    project: str = required("Weights & Biases project the stages' runs go to.")
    entity: str | None = opt(None, "W&B team or user; null = the API key's default entity.")
    mode: Literal["offline", "online"] = opt(
        "offline",
        "offline: the runs are written under <run_uri>/wandb/ (upload later with `wandb sync`); online: streamed to "
        "the server, the API key read from WANDB_API_KEY only.",
    )


@dataclass
class TrackingConfig:
    tensorboard: bool = opt(
        False, "TensorBoard event files under <run_uri>/tensorboard/<stage>/ (tensorboard --logdir <run_uri>)."
    )
    mlflow: MLflowConfig | None = opt(None, "One MLflow run per stage; null = off (needs mlflow-skinny).")
    wandb: WandbConfig | None = opt(None, "One W&B run per stage; null = off (needs wandb).")
    run_name: str | None = opt(
        None, "Trackers name each stage's run <run_name>/<stage>; null = the last folder of run_uri."
    )


# ---------------------------------------------------------------------------------------------------------------------
# The pipeline: a graph of named stage instances


@dataclass
class StageSpec:
    """One named stage instance: its kind and its typed config section. Its output is ``<run_uri>/<name>/``."""

    name: str
    kind: str
    section: Any

    def upstream(self) -> list[tuple[str, str]]:
        """(config key, stage name) of every ``stage:<name>`` model or dataset this instance reads, in field order."""
        return _stage_paths(self.section, self.name)

    def upstream_names(self) -> list[str]:
        return sorted({name for _, name in self.upstream()})


def _stage_paths(section: Any, prefix: str) -> list[tuple[str, str]]:
    """(key, stage name) of the ``stage:`` paths in a section and its sub-sections: models' ``name_or_path`` and data
    sections' ``train_path``/``eval_path``."""
    out = []
    for f in dataclasses.fields(section):
        value, key = getattr(section, f.name), f"{prefix}.{f.name}"
        if f.name in _PATH_KEYS and isinstance(value, str) and value.startswith(STAGE_PREFIX):
            out.append((key, value[len(STAGE_PREFIX) :]))
        elif dataclasses.is_dataclass(value):
            out += _stage_paths(value, key)
    return out


_PATH_KEYS = ("name_or_path", "train_path", "eval_path")


@dataclass
class PipelineConfig:
    run_uri: str = required("Where the run's artifacts go: a local path, file://... or s3://bucket/prefix.")
    storage: StorageConfig = opt(StorageConfig(), "Object-store credentials and endpoint.")
    stages: dict[str, StageSpec] = opt(
        {},
        "Named stage instances: stages.<name>.kind (sft, reward_model, critic_init, critic_warmup, ppo, dpo, kto, "
        "generate, score; default: the name) and that kind's section. stage:<name> model and data paths form the "
        "dependency graph.",
    )
    loop: LoopConfig = opt(LoopConfig(), "Stages repeated K times (rejection sampling, iterative DPO).")
    tracking: TrackingConfig = opt(
        TrackingConfig(), "Experiment trackers every stage logs its steps to; not part of any stage's config hash."
    )
    # stage instance -> its loop iteration (1..K), for the instances the loop made; not a config key
    iterations: dict[str, int] = field(default_factory=dict, metadata={"internal": True})

    def stage(self, name: str) -> Any:
        """The config section of stage instance ``name``."""
        return self.spec(name).section

    def spec(self, name: str) -> StageSpec:
        if name not in self.stages:
            known = ", ".join(self.stages) or "none"
            raise ConfigError(f"the config has no stage named '{name}' (stages: {known}); add it under 'stages:'")
        return self.stages[name]

    def kind(self, name: str) -> str:
        return self.spec(name).kind

    def order(self) -> list[str]:
        """Stage names in dependency order (each after the stages it reads), preset order among equals."""
        return topological_order(self)


def topological_order(cfg: PipelineConfig) -> list[str]:
    done: list[str] = []
    visiting: list[str] = []

    def visit(name: str) -> None:
        if name in done:
            return
        if name in visiting:
            cycle = " -> ".join([*visiting[visiting.index(name) :], name])
            raise ConfigError(f"the stages form a cycle ({cycle}): a stage cannot read its own output")
        visiting.append(name)
        for _, upstream in cfg.stages[name].upstream():
            if upstream in cfg.stages:
                visit(upstream)
        visiting.pop()
        done.append(name)

    for name in cfg.stages:
        visit(name)
    return done
