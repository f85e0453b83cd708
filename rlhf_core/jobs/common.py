"""Driver-side plumbing shared by the stage jobs: command line, object store, model resolution, Ray group.

Model resolution gives each model two forms: a path on the driver (for what the driver itself reads: tokenizer,
config, reward stats) and the source the roles and engines get. For a ``stage:`` model that source is a
``StageModel`` reference to the committed artifact, never the driver's path (which other nodes do not have): each
worker fetches it into its own node's cache (``rlhf_core.distributed.node_files``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rlhf_core import events, timing
from rlhf_core.config import (
    STAGE_PREFIX,
    ConfigError,
    GenerateConfig,
    PipelineConfig,
    PPOConfig,
    StrategyConfig,
    load_config,
    stage_hash,
)
from rlhf_core.data.datasets import dataset_uri
from rlhf_core.data.sampler import total_steps
from rlhf_core.distributed.node_files import ModelSource, local_model_path, stage_model
from rlhf_core.distributed.trainer import StageContext, newest_checkpoint
from rlhf_core.models.builders import check_model_source
from rlhf_core.storage import ArtifactError, ObjectStore, storage_options_for
from rlhf_core.types import CheckpointRef


def parse_args(kind: str, argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m rlhf_core.jobs.{kind}",
        description=f"Run one {kind} stage of a preset alone. Overrides are dotted keys, e.g. "
        f"{kind}.train.max_steps=10.",
    )
    parser.add_argument("--config", required=True, help="YAML preset, e.g. deployments/configs/tiny.yaml")
    parser.add_argument("--stage", help=f"the stage instance to run (default: the preset's only {kind} stage)")
    parser.add_argument("--ref-out", help="also write the resulting CheckpointRef as JSON to this file")
    parser.add_argument("overrides", nargs="*", help="key=value overrides (YAML values)")
    return parser.parse_args(argv)


def stage_of_kind(cfg: PipelineConfig, kind: str, name: str | None) -> str:
    """The instance to run: ``name`` (checked to be of ``kind``), else the config's only instance of ``kind``."""
    if name is not None:
        if cfg.kind(name) != kind:
            raise ConfigError(f"stage '{name}' is of kind {cfg.kind(name)}, not {kind}: run it with "
                              f"python -m rlhf_core.jobs.{cfg.kind(name)} --stage {name}")  # fmt: skip
        return name
    names = [n for n, spec in cfg.stages.items() if spec.kind == kind]
    if len(names) != 1:
        found = ", ".join(names) or "none"
        raise ConfigError(f"give --stage: the config has {len(names)} stages of kind {kind} ({found})")
    return names[0]


def main(kind: str, run: Callable[[PipelineConfig, str], CheckpointRef], argv: list[str] | None = None) -> None:
    """``python -m rlhf_core.jobs.<kind> [--stage NAME]``: bad input exits with status 2 and one clear line. The
    result also goes out as a ``result`` event (``rlhf_core.events``) for the launcher."""
    from rlhf_core.data.loading import DataError
    from rlhf_core.models.builders import ModelPathError

    args = parse_args(kind, argv)
    try:
        cfg = load_config(args.config, args.overrides)
        stage = stage_of_kind(cfg, kind, args.stage)
        ref = run(cfg, stage)
    except (ConfigError, DataError, ModelPathError, ArtifactError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    events.result(stage, ref.to_dict())
    if args.ref_out:
        Path(args.ref_out).write_text(json.dumps(ref.to_dict()))
    print(f"[{stage}] done: {ref.uri} (step {ref.step}, config {ref.config_hash})")
    for key, value in ref.metrics.items():
        print(f"[{stage}]   {key}: {value}")


def ray_cpus(section: Any) -> float | None:
    """The CPUs a stage's Ray workers ask for (what its job passes to ``launcher.init_ray``); None for a kind that
    runs without Ray (critic_init)."""
    if isinstance(section, PPOConfig):
        from rlhf_core.distributed.device import resolve_device
        from rlhf_core.jobs.ppo import resource_demand

        return resource_demand(section, resolve_device(section.actor_strategy.device))["CPU"]
    if isinstance(section, GenerateConfig):  # the engines and, with a reference, two log-prob groups
        from rlhf_core.jobs.generate import resource_groups

        return sum(n * cpus for n, cpus, _ in resource_groups("generate", section).values())
    strategy = getattr(section, "strategy", None)
    if isinstance(strategy, StrategyConfig):  # sft, reward_model, dpo, kto, score: one group
        return strategy.num_workers * strategy.cpus_per_worker
    return None


def open_store(cfg: PipelineConfig) -> ObjectStore:
    """The run's object store; a plain local ``run_uri`` is made absolute so that every worker writes to one place."""
    s = cfg.storage
    uri = cfg.run_uri if "://" in cfg.run_uri else str(Path(cfg.run_uri).resolve())
    options = storage_options_for(uri, endpoint_url=s.endpoint_url, key=s.key, secret=s.secret, region=s.region)
    return ObjectStore(uri, options)


def work_dir(stage: str) -> str:
    """Local scratch directory for downloads and staging (RLHF_WORK_DIR, else the system temp dir)."""
    root = Path(os.environ.get("RLHF_WORK_DIR") or tempfile.gettempdir()) / "rlhf-pipeline"
    root.mkdir(parents=True, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"{stage}-", dir=root)


def upstream_hash(store: ObjectStore, path: str, key: str) -> dict[str, str]:
    """{upstream stage: config hash} when ``path`` names an earlier stage (read from its manifest), else {}."""
    if not path.startswith(STAGE_PREFIX):
        return {}
    name = path[len(STAGE_PREFIX) :]
    try:
        return {name: store.read_manifest(name, verify=False).config_hash}
    except ArtifactError as e:
        raise ArtifactError(f"'{key}' = {path}: the {name} stage has no complete output ({e})") from None


def resolve_model(
    store: ObjectStore, path: str, key: str, dest: str, trust_remote_code: bool = False
) -> tuple[str, ModelSource]:
    """(driver path, worker source) for ``path``. ``stage:<name>`` is copied to ``dest`` from its committed output,
    each file checked against the manifest, and the workers get a ``StageModel`` of that same manifest; other paths
    are checked to be a model before any worker starts and serve both."""
    if path.startswith(STAGE_PREFIX):
        name = path[len(STAGE_PREFIX) :]
        try:
            ref = stage_model(store, name)
            local = local_model_path(ref, cache=dest)  # the driver's own copy, deleted with its scratch dir
        except ArtifactError as e:
            raise ArtifactError(f"'{key}' = {path}: the {name} stage has no complete output ({e})") from None
        return local, ref
    check_model_source(path, key, trust_remote_code=trust_remote_code)
    return path, path


def committed_ref(store: ObjectStore, stage: str) -> CheckpointRef | None:
    """The stage's committed output (verified manifest) as a reference, whatever config made it; else None."""
    if not store.is_complete(stage):
        return None
    m = store.read_manifest(stage, verify=False)
    return CheckpointRef(store.uri(stage), stage, int(m.metrics.get("steps", 0)), m.config_hash, m.metrics)


def existing_output(store: ObjectStore, stage: str, config_hash: str) -> CheckpointRef | None:
    """The stage's committed output when it was made with the same config hash (then there is nothing to do)."""
    ref = committed_ref(store, stage)
    return ref if ref is not None and ref.config_hash == config_hash else None


@dataclass
class StageSetup:
    """A stage's resolved inputs: its config section, store, scratch dir, a loadable path per model (by role) on the
    driver, upstream hashes, config hash, its committed output when one already exists for this config hash (then
    there is nothing to do and nothing was fetched), and per role the model source the workers get (``sources``:
    a ``StageModel`` for a stage output, each worker fetching its node-local copy; else the same as ``paths``)."""

    stage: str
    section: Any
    store: ObjectStore
    work: str
    paths: dict[str, str]
    upstream: dict[str, str]
    config_hash: str
    done: CheckpointRef | None
    sources: dict[str, ModelSource] = field(default_factory=dict)

    @property
    def model_path(self) -> str:
        return self.paths["model"]

    def context(self) -> StageContext:
        s = self.section
        return StageContext(
            stage=self.stage, run_uri=self.store.root_uri, storage_options=self.store.fs.storage_options,
            config_hash=self.config_hash, model_path=self.sources["model"], tokenizer_path=s.model.tokenizer,
            init_seed=s.model.init_seed, trust_remote_code=s.model.trust_remote_code, strategy=s.strategy,
            optim=s.optim, train=s.train, work_dir=self.work,
            fail_after_step=fail_after_step(), upstream=self.upstream, job_started=timing.job_started(),
        )  # fmt: skip


def setup_stage(cfg: PipelineConfig, stage: str, models: dict[str, Any] | None = None) -> StageSetup:
    """Hash the stage's config (with the hashes of the upstream outputs it reads) and look for its output; only when
    there is work to do, fetch its models (verifying upstream files), each distinct path once.

    ``models`` maps a role to its ``ModelConfig``; default (None) ``{"model": section.model}``; ``{}`` for a stage
    that reads no model.
    """
    section = cfg.stage(stage)
    models = {"model": section.model} if models is None else models
    store = open_store(cfg)
    keys = {role: f"{stage}.{role}.name_or_path" for role in models}
    upstream: dict[str, str] = {}
    for role, model in models.items():
        upstream.update(upstream_hash(store, model.name_or_path, keys[role]))
    data_keys = {key: f"{STAGE_PREFIX}{name}" for key, name in cfg.spec(stage).upstream() if is_data_key(key)}
    for key, path in data_keys.items():
        upstream.update(upstream_hash(store, path, key))
    config_hash = stage_hash(section, upstream)
    done = existing_output(store, stage, config_hash)
    if done is not None:
        print(f"[{stage}] {done.uri} is already complete for config {config_hash}; nothing to do")
        return StageSetup(stage, section, store, "", {}, upstream, config_hash, done)
    check_resumable(store, stage, section, config_hash)
    section = resolve_data(store, section, data_keys)
    work = work_dir(stage)
    fetched: dict[str, tuple[str, ModelSource]] = {}
    for role, model in models.items():
        if model.name_or_path not in fetched:
            fetched[model.name_or_path] = resolve_model(
                store, model.name_or_path, keys[role], work, model.trust_remote_code
            )
    paths = {role: fetched[model.name_or_path][0] for role, model in models.items()}
    sources = {role: fetched[model.name_or_path][1] for role, model in models.items()}
    return StageSetup(stage, section, store, work, paths, upstream, config_hash, None, sources)


def is_data_key(key: str) -> bool:
    """Whether a ``StageSpec.upstream`` key names a data path (``<stage>.<section>.train_path``/``eval_path``)."""
    return key.rsplit(".", 1)[-1] in ("train_path", "eval_path")


def resolve_data(store: ObjectStore, section: Any, data_keys: dict[str, str]) -> Any:
    """The section with each ``stage:<name>`` data path replaced by the URI of that stage's committed dataset file
    (its manifest verified first); the config hash keeps the ``stage:`` form, so moving the run changes nothing."""
    changes: dict[str, dict[str, str]] = {}
    for key, path in data_keys.items():
        _, field_name, leaf = key.rsplit(".", 2)
        changes.setdefault(field_name, {})[leaf] = dataset_uri(store, path[len(STAGE_PREFIX) :], key)
    if not changes:
        return section
    return replace(section, **{name: replace(getattr(section, name), **paths) for name, paths in changes.items()})


def check_resumable(store: ObjectStore, stage: str, section: Any, config_hash: str) -> None:
    """Refuse to resume from a checkpoint written by another number of ranks (its ZeRO shards would not load).

    Checkpoint manifests record ``extra["workers"]``: {dotted key under the stage section: ranks that wrote it}.
    The worker counts are outside the config hash (moving a finished stage to more devices must not invalidate it),
    so this check is what stands between a resized rerun and a checkpoint it cannot load.
    """
    found = newest_checkpoint(store, stage, config_hash)
    if found is None:
        return
    recorded = store.read_manifest(found[1], verify=False).extra.get("workers", {})
    for key, then in recorded.items():
        now = section
        for part in key.split("."):
            now = getattr(now, part)
        if now != then:
            raise ConfigError(
                f"'{stage}.{key}' = {now}, but the checkpoint to resume from ({store.uri(found[1])}) was written by "
                f"{then} ranks: set {stage}.{key}={then} to resume, or delete {store.uri(f'{stage}/checkpoints')} to "
                "start the stage over"
            )


def check_steps(stage: str, section: Any, n_rows: int) -> None:
    t = section.train
    if total_steps(n_rows, t.train_batch_size, t.max_epochs, t.max_steps) == 0:
        raise ConfigError(
            f"'{stage}.train.train_batch_size' = {t.train_batch_size} is larger than the {n_rows} training rows "
            f"x {t.max_epochs} epochs of {section.data.train_path}: no optimizer step would run"
        )


def fail_after_step() -> int | None:
    value = os.environ.get("RLHF_FAIL_AFTER_STEP")
    return int(value) if value else None
