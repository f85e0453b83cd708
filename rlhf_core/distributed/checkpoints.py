"""What the training stages' rank trainers share: seeding, resuming, checkpoints and export, as plain functions.

Each supervised stage (``jobs/sft.py``, ``reward_model.py``, ``dpo.py``, ``kto.py``) owns its loop and calls these.
A checkpoint is DeepSpeed state plus the stage's own state (step, consumed samples, loss at the start) and per-rank
RNG states, written to ``<run_uri>/<stage>/checkpoints/step_<N>/`` and committed by a manifest that carries the
stage's config hash and the number of ranks that wrote it; a restart resumes from the newest complete one with the
same hash. The PPO roles save and load their shards with the same functions.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from rlhf_core import curves, events, run_layout
from rlhf_core.config import LoraConfig, OptimConfig, StrategyConfig, TrainConfig
from rlhf_core.distributed.node_files import ModelSource, StageModel, local_model_path
from rlhf_core.distributed.strategy import DeepSpeedStrategy
from rlhf_core.models.adapter_folder import STAGE_PREFIX, AdapterRecord, write_adapter
from rlhf_core.models.lora import lora_layers, merged_state_dict, merged_tensors
from rlhf_core.storage import ObjectStore
from rlhf_core.tracking import TrackingSpec


@dataclass
class StageContext:
    """Everything a rank needs, resolved by the job's driver; plain data, so it travels to Ray workers."""

    stage: str
    run_uri: str
    storage_options: dict
    config_hash: str
    model_path: ModelSource  # local directory, hub name, builtin:<name>, or a StageModel (fetched on the rank's node)
    tokenizer_path: str | None
    init_seed: int
    strategy: StrategyConfig
    optim: OptimConfig
    train: TrainConfig
    work_dir: str  # local scratch for staging checkpoints and exports
    fail_after_step: int | None = None  # fault injection for tests (RLHF_FAIL_AFTER_STEP)
    upstream: dict = field(default_factory=dict)
    trust_remote_code: bool = False  # <stage>.model.trust_remote_code: custom modelling code of the model directory
    job_started: float | None = None  # epoch seconds the job's process started (rlhf_core.timing): startup_s
    kind: str = ""  # the stage's kind (sft, reward_model, dpo, kto): the curves' title
    tracking: TrackingSpec | None = None  # the experiment trackers rank 0 logs to (rlhf_core.tracking)
    lora: LoraConfig | None = None  # <stage>.model.lora: LoRA adapters (rank 0: none)
    aux_loss_coef: float = 0.0  # <stage>.model.aux_loss_coef: the MoE load-balancing loss's weight
    model_source: ModelSource | None = None  # model_path before start_rank fetched it: an adapter export's base

    @property
    def model_dir(self) -> str:
        """The model on this node: ``model_path`` once ``start_rank`` has fetched a stage model to the node."""
        assert isinstance(self.model_path, str), f"[{self.stage}] the model is not fetched to this node yet"
        return self.model_path


def start_rank(ctx: StageContext) -> tuple[StageContext, DeepSpeedStrategy, ObjectStore, Path]:
    """Join the group's torch.distributed world and seed every generator with ``train.seed``. Returns the context
    with this node's copy of a stage model, the strategy, the run's store and this rank's scratch directory."""
    ctx = replace(ctx, model_source=ctx.model_path, model_path=local_model_path(ctx.model_path))
    strategy = DeepSpeedStrategy(ctx.strategy, ctx.optim, ctx.train)
    strategy.init_distributed()
    store = ObjectStore(ctx.run_uri, ctx.storage_options)
    work = Path(ctx.work_dir) / f"rank{strategy.rank}"
    seed_all(ctx.train.seed)
    return ctx, strategy, store, work


def log_rank0(strategy: DeepSpeedStrategy, stage: str, message: str) -> None:
    """One line of the stage's log, from rank 0 only."""
    if strategy.rank == 0:
        print(f"[{stage}] {message}", flush=True)


def resume(ctx: StageContext, strategy: DeepSpeedStrategy, store: ObjectStore, engine: Any, local: Path) -> dict:
    """Collective: the stage's state at the newest complete checkpoint of this config, its shards and RNG states
    loaded into ``engine`` and this process; a fresh state (step 0) when there is none."""
    found = strategy.broadcast_object(
        newest_checkpoint(store, ctx.stage, ctx.config_hash) if strategy.rank == 0 else None
    )
    if found is None:
        return {"step": 0, "consumed_samples": 0, "first_loss": None}
    state = dict(load_engine_shards(strategy, engine, store, found[1], local)["trainer_state"])
    log_rank0(strategy, ctx.stage, f"resumed from {store.uri(found[1])} at step {state['step']}")
    if strategy.rank == 0:
        events.resumed(ctx.stage, state["step"])
    return state


def save_checkpoint(
    ctx: StageContext, strategy: DeepSpeedStrategy, store: ObjectStore, engine: Any, local: Path, state: dict
) -> None:
    """Collective: every rank uploads its shards, rank 0 adds the stage's state as ``trainer_state.json`` and commits
    the checkpoint."""
    rel = run_layout.checkpoint(ctx.stage, state["step"])
    files = save_engine_shards(strategy, engine, store, rel, local, {"trainer_state": dict(state)})
    if strategy.rank == 0:
        name = run_layout.TRAINER_STATE
        files[name] = write_entry(store, f"{rel}/{name}", json.dumps(state))
        workers = {"strategy.num_workers": strategy.world_size}
        commit_checkpoint(store, rel, ctx.stage, ctx.config_hash, files, state["step"], workers, ctx.train.keep_last)
    strategy.barrier()


def commit_checkpoint(
    store: ObjectStore,
    rel: str,
    stage: str,
    config_hash: str,
    files: dict[str, dict],
    step: int,
    workers: dict[str, int],
    keep_last: int,
) -> None:
    """Commit the uploaded checkpoint ``rel`` (manifest last) and prune the older ones beyond ``keep_last``.

    ``workers`` maps the config key of each group's worker count (under the stage section) to the ranks that wrote
    the shards: a resume with another count is refused (``jobs.input_checks.check_resumable``), as its shards would
    not load.
    """
    store.commit(rel, stage=stage, config_hash=config_hash, files=files, extra={"step": step, "workers": workers})
    prune_checkpoints(store, stage, keep_last)
    print(f"[{stage}] checkpoint {store.uri(rel)}", flush=True)


def fail_if_injected(fail_after_step: int | None, step: int) -> None:
    """Fault injection for tests (``RLHF_FAIL_AFTER_STEP``): called once the checkpoint of ``step`` is committed."""
    if fail_after_step is not None and step >= fail_after_step:
        raise RuntimeError(f"injected failure after checkpoint at step {step} (RLHF_FAIL_AFTER_STEP)")


def export_stage(
    ctx: StageContext,
    store: ObjectStore,
    module: nn.Module,
    weights: dict,
    tokenizer: Any,
    metrics: dict,
    history: list[dict],
    local: Path,
) -> None:
    """Rank 0: commit the stage's Hugging Face directory (manifest last, with the final metrics), then write
    ``metrics.json`` (history and final metrics) and the curves beside it."""
    exported = export_hf(module, weights, tokenizer, local, adapter=adapter_record(ctx))
    store.put_artifact(
        str(exported),
        ctx.stage,
        stage=ctx.stage,
        config_hash=ctx.config_hash,
        metrics=metrics,
        extra={"upstream": ctx.upstream},
        clear=False,
    )
    print(f"[{ctx.stage}] saved {store.uri(ctx.stage)}", flush=True)
    store.write_json(run_layout.metrics(ctx.stage), {"history": history, "final": metrics})
    curves.save_png(store, ctx.stage, ctx.kind, history)


def newest_checkpoint(store: ObjectStore, stage: str, config_hash: str) -> tuple[int, str] | None:
    """(step, rel) of the newest complete checkpoint made with ``config_hash``; incomplete or foreign ones are
    skipped."""
    base = run_layout.checkpoints(stage)
    for name in sorted(store.list_dirs(base), reverse=True):
        rel = f"{base}/{name}"
        if not name.startswith("step_") or not store.is_complete(rel):
            continue
        manifest = store.read_manifest(rel, verify=False)
        if manifest.config_hash == config_hash:
            return int(manifest.extra["step"]), rel
    return None


def prune_checkpoints(store: ObjectStore, stage: str, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints of ``stage``."""
    base = run_layout.checkpoints(stage)
    complete = [d for d in sorted(store.list_dirs(base)) if store.is_complete(f"{base}/{d}")]
    for name in complete[:-keep_last]:
        store.delete(f"{base}/{name}")


# ---------------------------------------------------------------------------------------------------------------------
# Engine shards: every rank saves and uploads its own, rank 0 commits (also the PPO roles: actor, critic)


def save_engine_shards(
    strategy: DeepSpeedStrategy,
    engine: Any,
    store: ObjectStore,
    rel: str,
    local: Path,
    client_state: dict,
    sub: str = "",
) -> dict[str, dict]:
    """Collective: each rank writes its DeepSpeed shards and RNG state and uploads them to ``rel/sub``.

    Returns the manifest entries of every rank's files (relative to ``rel``) on every rank; nothing is committed.
    """
    shutil.rmtree(local, ignore_errors=True)
    strategy.save_checkpoint(engine, str(local), client_state=client_state)
    torch.save(rng_state(), local / f"rng_rank{strategy.rank}.pt")
    files = store.upload_files(str(local), f"{rel}/{sub}" if sub else rel)
    shutil.rmtree(local, ignore_errors=True)
    prefix = f"{sub}/" if sub else ""
    return {prefix + k: v for part in strategy.all_gather_object(files) for k, v in part.items()}


def load_engine_shards(
    strategy: DeepSpeedStrategy, engine: Any, store: ObjectStore, rel: str, local: Path, sub: str = ""
) -> dict:
    """Collective: each rank restores engine, optimizer, scheduler and its RNG state from a committed checkpoint,
    downloading only the files it reads (``rank_files``), not every rank's shards."""
    shutil.rmtree(local, ignore_errors=True)
    store.download_artifact(rel, str(local), only=sub or None, keep=rank_files(strategy.rank))
    root = local / sub if sub else local
    client_state = strategy.load_checkpoint(engine, str(root))
    set_rng_state(torch.load(root / f"rng_rank{strategy.rank}.pt", weights_only=False))
    shutil.rmtree(local, ignore_errors=True)
    return client_state


_RANK_FILE = re.compile(r"(?:^|/)(?:rng_rank|zero_pp_rank_)(\d+)[._]")


def rank_files(rank: int) -> Callable[[str], bool]:
    """Which checkpoint files rank ``rank`` downloads to resume: its own (``rng_rank<r>.pt``, DeepSpeed's
    ``zero_pp_rank_<r>_*``: its ZeRO optimizer partition, and under ZeRO-3 its parameter partition) and the files of
    no rank (ZeRO-0/1/2's ``mp_rank_00_model_states.pt`` with the module and client state, which every rank reads).
    DeepSpeed's non-elastic ZeRO load opens only the rank's own partition files; the other ranks' are never read."""

    def keep(name: str) -> bool:
        tagged = _RANK_FILE.search(name)
        return tagged is None or int(tagged.group(1)) == rank

    return keep


def export_hf(
    module: nn.Module, weights: dict, tokenizer: Any, local: Path, adapter: AdapterRecord | None = None
) -> Path:
    """Write the Hugging Face model inside ``module`` (itself, or ``module.hf_model``) with gathered ``weights``; a
    model with LoRA adapters is written as the plain model, its adapters merged (``models.lora``), or with
    ``adapter`` (``lora.export: adapter``, ``adapter_record``) as a PEFT adapter folder (``models.adapter_folder``)."""
    if adapter is not None:
        return write_adapter(module, weights, tokenizer, local, adapter)
    layers = lora_layers(module)
    if any(hasattr(p, "quant_state") for p in module.parameters()):  # QLoRA: dequant(W) + B @ A, from the module
        weights = {t.name: t.value() for t in merged_tensors(module)}
    elif layers:
        weights = merged_state_dict(weights, layers)
    hf_model: Any = getattr(module, "hf_model", module)  # a transformers model: save_pretrained
    prefix = "hf_model." if hf_model is not module else ""
    weights = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
    shutil.rmtree(local, ignore_errors=True)
    hf_model.save_pretrained(str(local), state_dict=weights, safe_serialization=True)
    tokenizer.save_pretrained(str(local))
    return local


def adapter_record(ctx: Any) -> AdapterRecord | None:
    """What an adapter export records of its base (``ctx``: a ``StageContext`` or a PPO ``RoleContext``): the
    source the stage trained from (``stage:<name>`` with its content hash, a local directory by absolute path), its
    build and lora settings; None unless the model's ``lora.export`` is adapter."""
    lora = ctx.lora
    if lora is None or lora.rank == 0 or lora.export != "adapter":
        return None
    source = ctx.model_source if ctx.model_source is not None else ctx.model_path
    if isinstance(source, StageModel):
        base, content = f"{STAGE_PREFIX}{source.rel}", source.content_hash
    else:
        base, content = (str(Path(source).resolve()) if Path(source).exists() else source), None
    return AdapterRecord(base, content, ctx.init_seed, ctx.trust_remote_code, asdict(lora))


def write_entry(store: ObjectStore, rel: str, text: str) -> dict:
    """Write a small text file into an uncommitted artifact and return its manifest entry."""
    store.write_text(rel, text)
    data = text.encode()
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


# ---------------------------------------------------------------------------------------------------------------------
# Random state: seeded once per rank, saved with each rank's shards, restored on resume


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():  # this rank's devices (a Ray worker sees its own GPU only)
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        for device, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)
