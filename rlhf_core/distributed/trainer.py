"""The per-rank loop shared by the supervised stages (SFT, reward model): train, checkpoint, resume, export.

A stage supplies a small ``StageImpl`` (build the model, collate, loss, evaluate, finalize); this class runs it on
one rank of a Ray group. Checkpoints are DeepSpeed state plus our own state (step, consumed samples, loss at the
start, per-rank RNG states), written to ``<run_uri>/<stage>/checkpoints/step_<N>/`` and committed by a manifest that
carries the stage's config hash; a restart resumes from the newest complete one with the same hash.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from rlhf_core import curves, events
from rlhf_core.config import OptimConfig, StrategyConfig, TrainConfig
from rlhf_core.data.sampler import global_batch, rank_slice, total_steps
from rlhf_core.distributed import device
from rlhf_core.distributed.node_files import ModelSource, local_model_path
from rlhf_core.distributed.strategy import DeepSpeedStrategy
from rlhf_core.models.builders import attn_implementation, load_tokenizer
from rlhf_core.storage import ObjectStore
from rlhf_core.tracking import Tracker, TrackingSpec


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


class StageImpl(Protocol):
    def build_model(self, ctx: StageContext, tokenizer: Any, dtype: torch.dtype, attn: str) -> nn.Module: ...
    def before_training(
        self, model: nn.Module, ctx: StageContext, strategy: DeepSpeedStrategy, examples: dict[str, list], pad_id: int
    ) -> None: ...  # with the starting model, on every rank, before a checkpoint is loaded (DPO/KTO: the reference)
    def collate(self, examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]: ...
    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]: ...
    def evaluate(self, model: nn.Module, batches: Iterable[dict[str, torch.Tensor]]) -> dict[str, float]: ...
    def finalize(self, hf_model: nn.Module, metrics: dict[str, float]) -> None: ...


def checkpoint_rel(stage: str, step: int) -> str:
    return f"{stage}/checkpoints/step_{step:08d}"


def newest_checkpoint(store: ObjectStore, stage: str, config_hash: str) -> tuple[int, str] | None:
    """(step, rel) of the newest complete checkpoint made with ``config_hash``; incomplete or foreign ones are
    skipped."""
    for name in sorted(store.list_dirs(f"{stage}/checkpoints"), reverse=True):
        rel = f"{stage}/checkpoints/{name}"
        if not name.startswith("step_") or not store.is_complete(rel):
            continue
        manifest = store.read_manifest(rel, verify=False)
        if manifest.config_hash == config_hash:
            return int(manifest.extra["step"]), rel
    return None


class SupervisedTrainer:
    """One rank of a supervised stage."""

    def __init__(self, impl: StageImpl, ctx: StageContext, train_examples: list, eval_examples: list):
        self.impl, self.ctx = impl, ctx
        self.train_examples, self.eval_examples = train_examples, eval_examples

    def fit(self) -> dict:
        ctx, t = self.ctx, self.ctx.train
        ctx = self.ctx = replace(ctx, model_path=local_model_path(ctx.model_path))  # this node's copy of a stage model
        strategy = self.strategy = DeepSpeedStrategy(ctx.strategy, ctx.optim, t)
        strategy.init_distributed()
        self.store = ObjectStore(ctx.run_uri, ctx.storage_options)
        self.work = Path(ctx.work_dir) / f"rank{strategy.rank}"
        _seed_all(t.seed)

        # 1. model and engine
        tokenizer = load_tokenizer(ctx.model_path, ctx.tokenizer_path, trust_remote_code=ctx.trust_remote_code)
        attn = attn_implementation(ctx.strategy.attn_implementation, strategy.device)
        with strategy.model_init():  # ZeRO-3: each rank materialises only its partition
            model = self.impl.build_model(ctx, tokenizer, strategy.dtype, attn)
        n = len(self.train_examples)
        steps = total_steps(n, t.train_batch_size, t.max_epochs, t.max_steps)
        engine = strategy.prepare(model, steps)
        self.device = next(engine.module.parameters()).device
        pad_id = tokenizer.pad_token_id
        self.impl.before_training(engine, ctx, strategy, {"train": self.train_examples, "eval": self.eval_examples},
                                  pad_id)  # fmt: skip

        # 2. resume from the newest complete checkpoint of this config
        state = {"step": 0, "consumed_samples": 0, "first_loss": None}
        resumed_from = 0
        found = strategy.broadcast_object(
            newest_checkpoint(self.store, ctx.stage, ctx.config_hash) if strategy.rank == 0 else None
        )
        if found is not None:
            state = self._load_checkpoint(engine, found[1])
            resumed_from = state["step"]
            self._log(f"resumed from {self.store.uri(found[1])} at step {state['step']}")
            if strategy.rank == 0:
                events.resumed(ctx.stage, state["step"])

        # 3. train: step k consumes stream items [k*B, (k+1)*B), this rank its slice of them
        startup_s = None if ctx.job_started is None else time.time() - ctx.job_started
        if startup_s is not None:
            self._log(f"first step {startup_s:.1f}s after the job started")
        history = []
        # rank 0's trackers (TensorBoard, MLflow, W&B), closed as failed when the stage raises
        with Tracker(ctx.tracking if strategy.rank == 0 else None) as tracker:
            for step in range(state["step"], steps):
                started = time.time()
                indices = rank_slice(
                    global_batch(n, t.train_batch_size, step, t.seed), strategy.rank, strategy.world_size
                )
                sums: dict[str, float] = {}
                for lo in range(0, len(indices), t.micro_train_batch_size):
                    micro = [self.train_examples[i] for i in indices[lo : lo + t.micro_train_batch_size]]
                    loss, metrics = self.impl.loss(engine, self._batch(micro, pad_id))
                    engine.backward(loss)
                    engine.step()
                    for k, v in {"loss": loss.item(), **metrics}.items():
                        sums[k] = sums.get(k, 0.0) + v / strategy.accumulation_steps
                logs = {k: strategy.all_reduce_mean(v) for k, v in sums.items()}
                state["step"], state["consumed_samples"] = step + 1, (step + 1) * t.train_batch_size
                if state["first_loss"] is None:
                    state["first_loss"] = logs["loss"]
                history.append({"step": step + 1, **logs})
                if (step + 1) % t.log_steps == 0 or step + 1 == steps or step == 0:
                    lr = engine.get_lr()[0]
                    shown = " ".join(f"{k}={v:.4f}" for k, v in logs.items())
                    self._log(f"step {step + 1}/{steps} {shown} lr={lr:.2e} ({time.time() - started:.2f}s)")
                    if strategy.rank == 0:
                        events.step(ctx.stage, step + 1, steps, {**logs, "lr": lr})
                        tracker.log(step + 1, {**logs, "lr": lr})
                if t.save_steps and (step + 1) % t.save_steps == 0 and step + 1 < steps:
                    self._save_checkpoint(engine, state)
                    if ctx.fail_after_step is not None and step + 1 >= ctx.fail_after_step:
                        raise RuntimeError(
                            f"injected failure after checkpoint at step {step + 1} (RLHF_FAIL_AFTER_STEP)"
                        )

            # 4. evaluate and export in Hugging Face format, manifest last
            metrics = {
                "steps": steps,
                "train_samples": n,
                "resumed_from_step": resumed_from,
                "loss_start": state["first_loss"],
                "loss_end": history[-1]["loss"] if history else None,
            }
            if startup_s is not None:
                metrics["startup_s"] = startup_s  # job start -> first step (rank 0's clock)
            if self.eval_examples:
                chunks = range(0, len(self.eval_examples), t.eval_batch_size)
                batches = (self._batch(self.eval_examples[lo : lo + t.eval_batch_size], pad_id) for lo in chunks)
                metrics.update(self.impl.evaluate(engine, batches))
            weights = strategy.full_state_dict(engine)
            if strategy.rank == 0:
                self._export(engine.module, weights, tokenizer, metrics)
                self.store.write_json(f"{ctx.stage}/metrics.json", {"history": history, "final": metrics})
                curves.save_png(self.store, ctx.stage, ctx.kind, history)
        strategy.barrier()
        shutil.rmtree(self.work, ignore_errors=True)
        return metrics

    def _batch(self, examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
        """The collated micro-batch on this rank's device (the one path every training and eval batch takes)."""
        return device.to_device(self.impl.collate(examples, pad_id), self.device)

    # -- checkpoints --------------------------------------------------------------------------------------------------
    def _save_checkpoint(self, engine: Any, state: dict) -> None:
        ctx, strategy = self.ctx, self.strategy
        rel = checkpoint_rel(ctx.stage, state["step"])
        files = save_engine_shards(
            strategy, engine, self.store, rel, self.work / "ckpt", {"trainer_state": dict(state)}
        )
        if strategy.rank == 0:
            files["trainer_state.json"] = write_entry(self.store, f"{rel}/trainer_state.json", json.dumps(state))
            # The ranks that wrote the shards: a resume with another count is refused (jobs.common.check_resumable).
            workers = {"strategy.num_workers": strategy.world_size}
            self.store.commit(
                rel, stage=ctx.stage, config_hash=ctx.config_hash, files=files,
                extra={"step": state["step"], "workers": workers},
            )  # fmt: skip
            prune_checkpoints(self.store, ctx.stage, ctx.train.keep_last)
            self._log(f"checkpoint {self.store.uri(rel)}")
        strategy.barrier()

    def _load_checkpoint(self, engine: Any, rel: str) -> dict:
        client_state = load_engine_shards(self.strategy, engine, self.store, rel, self.work / "resume")
        return dict(client_state["trainer_state"])

    # -- export -------------------------------------------------------------------------------------------------------
    def _export(self, module: nn.Module, weights: dict, tokenizer: Any, metrics: dict) -> None:
        hf_model = getattr(module, "hf_model", module)
        self.impl.finalize(hf_model, metrics)
        local = export_hf(module, weights, tokenizer, self.work / "export")
        self.store.put_artifact(
            str(local), self.ctx.stage, stage=self.ctx.stage, config_hash=self.ctx.config_hash,
            metrics=metrics, extra={"upstream": self.ctx.upstream}, clear=False,
        )  # fmt: skip
        self._log(f"saved {self.store.uri(self.ctx.stage)}")

    def _log(self, message: str) -> None:
        if self.strategy.rank == 0:
            print(f"[{self.ctx.stage}] {message}", flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# Pieces shared with the PPO roles (actor, critic): every rank saves and uploads its own shards, rank 0 commits.


def save_engine_shards(
    strategy: DeepSpeedStrategy, engine: Any, store: ObjectStore, rel: str, local: Path, client_state: dict,
    sub: str = "",
) -> dict[str, dict]:  # fmt: skip
    """Collective: each rank writes its DeepSpeed shards and RNG state and uploads them to ``rel/sub``.

    Returns the manifest entries of every rank's files (relative to ``rel``) on every rank; nothing is committed.
    """
    shutil.rmtree(local, ignore_errors=True)
    strategy.save_checkpoint(engine, str(local), client_state=client_state)
    torch.save(_rng_state(), local / f"rng_rank{strategy.rank}.pt")
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
    _set_rng_state(torch.load(root / f"rng_rank{strategy.rank}.pt", weights_only=False))
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


def prune_checkpoints(store: ObjectStore, stage: str, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints of ``stage``."""
    base = f"{stage}/checkpoints"
    complete = [d for d in sorted(store.list_dirs(base)) if store.is_complete(f"{base}/{d}")]
    for name in complete[:-keep_last]:
        store.delete(f"{base}/{name}")


def export_hf(module: nn.Module, weights: dict, tokenizer: Any, local: Path) -> Path:
    """Write the Hugging Face model inside ``module`` (itself, or ``module.hf_model``) with gathered ``weights``."""
    hf_model = getattr(module, "hf_model", module)
    prefix = "hf_model." if hf_model is not module else ""
    weights = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
    shutil.rmtree(local, ignore_errors=True)
    hf_model.save_pretrained(str(local), state_dict=weights, safe_serialization=True)
    tokenizer.save_pretrained(str(local))
    return local


def write_entry(store: ObjectStore, rel: str, text: str) -> dict:
    """Write a small text file into an uncommitted artifact and return its manifest entry."""
    store.write_text(rel, text)
    data = text.encode()
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():  # this rank's devices (a Ray worker sees its own GPU only)
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        for device, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)
