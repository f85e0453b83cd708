"""A stage's set-up on the driver: its config hash, its finished output if any, its models and data resolved, the
context its ranks get (``StageSetup``), what the rollout engines load, and the CPUs its Ray workers ask for.

Model resolution gives each model two forms: a path on the driver (for what the driver itself reads: tokenizer,
config, reward stats) and the source the roles and engines get. For a ``stage:`` model that source is a
``StageModel`` reference to the committed artifact, never the driver's path (which other nodes do not have): each
worker fetches it into its own node's cache (``rlhf_core.distributed.node_files``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from rlhf_core import timing, tracking
from rlhf_core.config import (
    STAGE_PREFIX,
    ConfigError,
    CriticWarmupConfig,
    GenerateConfig,
    PipelineConfig,
    WorkerConfig,
    as_ppo,
    stage_hash,
)
from rlhf_core.data.datasets import dataset_uri
from rlhf_core.distributed.checkpoints import StageContext
from rlhf_core.distributed.node_files import ModelSource, local_model_path, stage_model
from rlhf_core.jobs.input_checks import (
    check_adapters,
    check_packing,
    check_resumable,
    check_router,
    check_whole_parameter_adapters,
)
from rlhf_core.jobs.process import fail_after_step, work_dir
from rlhf_core.models.checks import check_model_source
from rlhf_core.run_layout import existing_output, open_store, upstream_hash
from rlhf_core.storage import ArtifactError, ObjectStore
from rlhf_core.types import CheckpointRef

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def ray_cpus(section: Any) -> float | None:
    """The CPUs a stage's Ray workers ask for (what its job passes to ``launcher.init_ray``); None for a kind that
    runs without Ray (critic_init)."""
    if isinstance(section, CriticWarmupConfig):  # ppo and critic_warmup
        from rlhf_core.distributed.placement import RoleSet, resource_demand

        # The section does not say its kind: counted with a trained actor (a critic warm-up's reference too). The
        # CPUs asked are the same on any device.
        p = as_ppo(section)
        return resource_demand(p, RoleSet.of(p), "cpu")["CPU"]
    if isinstance(section, GenerateConfig):  # the engines and, with a reference, two log-prob groups
        from rlhf_core.distributed.placement import generate_groups

        return sum(n * cpus for n, cpus, _ in generate_groups("generate", section).values())
    strategy = getattr(section, "strategy", None)
    if isinstance(strategy, WorkerConfig):  # sft, reward_model, dpo, kto, score: one group
        return strategy.num_workers * strategy.cpus_per_worker
    return None


def resolve_model(
    store: ObjectStore, path: str, key: str, dest: str, trust_remote_code: bool = False, tokenizer: str | None = None
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
    local = local_model_path(path, cache=dest)  # a local adapter folder: merged over its base (node_files)
    check_model_source(local, key, trust_remote_code=trust_remote_code, tokenizer=tokenizer)
    return local, path


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
    kind: str = ""
    tracking: tracking.TrackingSpec | None = None  # the run's experiment trackers for this stage (None: none on)

    @property
    def model_path(self) -> str:
        return self.paths["model"]

    def context(self) -> StageContext:
        s = self.section
        return StageContext(
            stage=self.stage,
            run_uri=self.store.root_uri,
            storage_options=self.store.fs.storage_options,
            config_hash=self.config_hash,
            model_path=self.sources["model"],
            tokenizer_path=s.model.tokenizer,
            init_seed=s.model.init_seed,
            trust_remote_code=s.model.trust_remote_code,
            lora=getattr(s.model, "lora", None),
            aux_loss_coef=getattr(s.model, "aux_loss_coef", 0.0),
            strategy=s.strategy,
            optim=s.optim,
            train=s.train,
            work_dir=self.work,
            fail_after_step=fail_after_step(),
            upstream=self.upstream,
            job_started=timing.job_started(),
            kind=self.kind,
            tracking=self.tracking,
        )


def setup_stage(cfg: PipelineConfig, stage: str, models: dict[str, Any] | None = None) -> StageSetup:
    """Hash the stage's config (with the hashes of the upstream outputs it reads) and look for its output; only when
    there is work to do, fetch its models (verifying upstream files), each distinct path once.

    ``models`` maps a role to its ``ModelConfig``; default (None) ``{"model": section.model}``; ``{}`` for a stage
    that reads no model.
    """
    section = cfg.stage(stage)
    models = {"model": section.model} if models is None else models
    store = open_store(cfg)
    tracked = tracking.spec_for(cfg, stage, store)  # refuses a tracker whose package is missing, before any worker
    # a PPO-kind role's model is <role>.model (its section also holds the role's workers); other kinds name it <role>
    where = ".model" if isinstance(section, CriticWarmupConfig) else ""
    keys = {role: f"{stage}.{role}{where}.name_or_path" for role in models}
    upstream: dict[str, str] = {}
    for role, model in models.items():
        upstream.update(upstream_hash(store, model.name_or_path, keys[role]))
    data_keys = {key: f"{STAGE_PREFIX}{name}" for key, name in cfg.spec(stage).upstream() if is_data_key(key)}
    for key, path in data_keys.items():
        upstream.update(upstream_hash(store, path, key))
    config_hash = stage_hash(section, upstream)
    if store.recover(stage):  # the job that wrote the stage's new output died while replacing the old one
        print(f"[{stage}] finished replacing {store.uri(stage)} by its new output")
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
                store, model.name_or_path, keys[role], work, model.trust_remote_code, model.tokenizer
            )
    paths = {role: fetched[model.name_or_path][0] for role, model in models.items()}
    sources = {role: fetched[model.name_or_path][1] for role, model in models.items()}
    for role, model in models.items():
        check_packing(stage, section, role, where, paths[role])
        lora = getattr(model, "lora", None)
        # the trained models only: a PPO reference may be the actor's model section, and is built without adapters
        if getattr(model, "aux_loss_coef", 0.0) and role in ("model", "actor", "critic"):
            check_router(f"{stage}.{role}{where}", model, paths[role])
        if lora is not None and lora.rank > 0 and role in ("model", "actor", "critic"):
            scalar = role == "critic" or cfg.kind(stage) == "reward_model"
            strategy = getattr(section, role).strategy if where else section.strategy
            if lora.load_in_4bit and strategy.zero_stage == 3:
                raise ConfigError(
                    f"'{stage}.{role}{where}.lora.load_in_4bit' keeps 4-bit base weights, which ZeRO-3 cannot "
                    f"partition: set '{stage}.{role + '.' if where else ''}strategy.zero_stage' to 2 or lower"
                )
            if strategy.zero_stage == 3:
                zero = f"{stage}.{role + '.' if where else ''}strategy.zero_stage"
                check_whole_parameter_adapters(f"{stage}.{role}{where}", zero, model, paths[role], scalar=scalar)
            check_adapters(f"{stage}.{role}{where}", model, paths[role], scalar=scalar)
    return StageSetup(
        stage, section, store, work, paths, upstream, config_hash, None, sources, cfg.kind(stage), tracked
    )


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


def engine_model(st: StageSetup, role: str, backend: str, init_seed: int, tokenizer: Any) -> Any:
    """What the rollout engines load for ``role``'s model: its worker source; a ``builtin:`` model for vLLM (which
    loads directories only) built with its init_seed and saved to the stage's scratch directory first."""
    import torch

    from rlhf_core.models.builders import BUILTIN_PREFIX, build_causal_lm

    source = st.sources[role]
    if backend != "vllm" or not str(source).startswith(BUILTIN_PREFIX):
        return source
    path = Path(st.work) / f"builtin_{role}"
    built = build_causal_lm(str(source), tokenizer, seed=init_seed, dtype=torch.float32, attn="sdpa")
    model = cast("PreTrainedModel", built)  # typed nn.Module: a builtin is a transformers model
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return str(path)
