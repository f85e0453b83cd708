"""What the DPO and KTO stages share: their step loop and job, response-only sequence log-probs and the frozen
reference's numbers.

``PreferenceTrainer`` is the step loop of one rank of either stage, written once. It runs the stage's
``PreferenceMethod`` (``DPOTrainer`` in ``jobs/dpo.py``, ``KTOTrainer`` in ``jobs/kto.py``, the class the stage's
workers host): the sequences each example is scored on, its batches, its loss and its held-out metrics.
``run_stage`` is the job around it, each stage's ``run``.

Both score whole responses: the sum of the log-probs of the response tokens (EOS included) given the prompt, under
the policy being trained and under a frozen reference (``<stage>.reference``, default the policy's starting model).
The reference's numbers come one of two ways (``<stage>.ref_logprobs``):

- ``precompute`` (default): every training and held-out sequence is scored once before the first step, and the
  numbers are committed as ``<run_uri>/<stage>/reference_logprobs/`` (manifest with the stage's config hash), so that a
  resumed or retried stage reads them instead of recomputing, and the training ranks hold no reference model. When
  the reference is the policy's starting model (the default), the training ranks score their share with the policy
  they have just built, before it takes a step: no second model is loaded and no second group started. Another
  reference model is scored by a Ray group of ``ReferencePolicy`` workers before the training group starts;
- ``online``: every rank keeps a frozen full copy of the reference and scores each micro-batch as it trains.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Protocol

import torch

from rlhf_core import events, run_layout
from rlhf_core.algos.experience import SequenceBatch
from rlhf_core.algos.preference import sequence_logprobs
from rlhf_core.config import ModelConfig, PipelineConfig, PreferenceConfig
from rlhf_core.data.examples import pad_right
from rlhf_core.data.sampler import global_batch, rank_slice, total_steps
from rlhf_core.distributed import device
from rlhf_core.distributed.checkpoints import (
    StageContext,
    export_stage,
    fail_if_injected,
    log_rank0,
    resume,
    save_checkpoint,
    start_rank,
    write_entry,
)
from rlhf_core.distributed.cluster import Cluster, RayCluster, WorkerGroup
from rlhf_core.distributed.node_files import ModelSource, local_model_path
from rlhf_core.distributed.reference import ReferencePolicy
from rlhf_core.distributed.strategy import DeepSpeedStrategy
from rlhf_core.jobs import input_checks, stage_setup
from rlhf_core.models.builders import attn_implementation, build_causal_lm, load_tokenizer
from rlhf_core.models.forward import causal_lm_logprobs
from rlhf_core.storage import ArtifactError, ObjectStore
from rlhf_core.tracking import Tracker
from rlhf_core.types import CheckpointRef

Sequence = tuple[list[int], int]  # token ids (prompt + response + EOS) and the prompt's length
CHUNK = 4096  # sequences per round trip to the reference workers


def response_tensors(seqs: list[Sequence], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``loss_mask`` (1 on the response tokens)."""
    ids = [s for s, _ in seqs]
    return {
        "input_ids": pad_right(ids, pad_id),
        "attention_mask": pad_right([[1] * len(s) for s in ids], 0),
        "loss_mask": pad_right([[0] * n + [1] * (len(s) - n) for s, n in seqs], 0),
    }


def response_logprobs(
    model: Any, batch: dict[str, torch.Tensor], pack: bool, aux_loss: list | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """((B,) summed response log-probs, (B, T-1) token log-probs) of the batch's rows under ``model``
    (``aux_loss``: collects an MoE model's load-balancing loss)."""
    action = batch["loss_mask"][:, 1:]
    tokens = causal_lm_logprobs(
        model, batch["input_ids"], batch["attention_mask"], action, pack=pack, aux_loss=aux_loss
    )
    return sequence_logprobs(tokens, action.to(tokens.dtype)), tokens


class FrozenReference:
    """The online reference of one rank: built on first use (outside ZeRO-3's partitioned init, so it is a full
    copy), on the policy's device, never trained."""

    def __init__(self, source: ModelSource, ref: ModelConfig, packing: bool):
        self.source, self.ref, self.packing = source, ref, packing
        self.model: torch.nn.Module | None = None

    @torch.no_grad()
    def __call__(self, batch: dict[str, torch.Tensor], dtype: torch.dtype, attn: str) -> torch.Tensor:
        if self.model is None:  # with the reference's own tokenizer and keys, as the precomputing workers build it
            ref, path = self.ref, local_model_path(self.source)
            tokenizer = load_tokenizer(path, ref.tokenizer, trust_remote_code=ref.trust_remote_code)
            model = build_causal_lm(
                path, tokenizer, seed=ref.init_seed, dtype=dtype, attn=attn, trust_remote_code=ref.trust_remote_code
            )
            self.model = model.to(batch["input_ids"].device).eval().requires_grad_(False)
        return response_logprobs(self.model, batch, self.packing)[0]


def reference_logps(
    batch: dict[str, torch.Tensor], online: FrozenReference | None, build: tuple[torch.dtype, str] | None
) -> torch.Tensor:
    """(B,) reference log-probs of the batch's rows: the precomputed ones it carries, or the online copy's, built
    with the policy's precision and attention (``build``)."""
    if "ref_logps" in batch:
        return batch["ref_logps"]
    assert online is not None and build is not None, "no reference log-probs and no online reference"
    return online(batch, *build).to(batch["input_ids"].device)


def tensors(
    examples: list[dict], pad_id: int, sequences: Callable[[dict], list[Sequence]], keys: tuple[str, ...]
) -> dict[str, torch.Tensor]:
    """Each example's first sequence, then each one's second (``sequences``), with the reference log-probs the
    examples carry (``keys``, in the same order) when they were precomputed."""
    per_example = [sequences(e) for e in examples]
    batch = response_tensors([seqs[i] for i in range(len(keys)) for seqs in per_example], pad_id)
    if keys[0] in examples[0]:
        refs = [e[key] for key in keys for e in examples]
        batch["ref_logps"] = torch.tensor(refs, dtype=torch.float32)
    return batch


# ---------------------------------------------------------------------------------------------------------------------
# Precomputed reference log-probs


def starts_as_reference(p: PreferenceConfig) -> bool:
    """Whether the reference is the policy's starting model (``reference`` null or the same model settings)."""
    return p.reference is None or p.reference == p.model


def stored_reference(st: stage_setup.StageSetup, splits: dict[str, list[Sequence]]) -> dict[str, list[float]] | None:
    """The summed reference log-probs of every sequence of each split, when ``<stage>/reference_logprobs/`` was
    committed for this config hash and these splits."""
    store, rel = st.store, run_layout.reference_logprobs(st.stage)
    try:
        stored = store.read_manifest(rel, verify=True)
    except ArtifactError:
        return None
    if stored.config_hash != st.config_hash:
        return None
    saved = store.read_json(f"{rel}/logprobs.json")
    if {k: len(v) for k, v in saved.items()} != {k: len(v) for k, v in splits.items()}:
        return None
    print(f"[{st.stage}] reference log-probs from {store.uri(rel)}", flush=True)
    return saved


def commit_reference(store: ObjectStore, stage: str, config_hash: str, logps: dict[str, list[float]]) -> str:
    """Commits ``<stage>/reference_logprobs/`` (one JSON file, manifest last); returns its URI."""
    rel = run_layout.reference_logprobs(stage)
    store.prepare(rel)
    files = {"logprobs.json": write_entry(store, f"{rel}/logprobs.json", json.dumps(logps))}
    store.commit(
        rel,
        stage=stage,
        config_hash=config_hash,
        files=files,
        extra={"sequences": {k: len(v) for k, v in logps.items()}},
    )
    return store.uri(rel)


def precompute_reference(
    st: stage_setup.StageSetup, p: PreferenceConfig, splits: dict[str, list[Sequence]], pad_id: int, cluster: Cluster
) -> dict[str, list[float]]:
    """Summed log-probs of every sequence of each split under a reference other than the starting model, computed on
    a ``ReferencePolicy`` group of ``cluster`` and committed as ``<stage>/reference_logprobs/``."""
    ref = p.reference or p.model
    s = p.strategy
    cluster.start(min_cpus=s.num_workers * s.cpus_per_worker)
    group = None
    try:
        group = cluster.group(
            s,
            ReferencePolicy,
            st.sources["reference"],
            p.train.eval_batch_size,
            s.precision,
            ref.init_seed,
            tokenizer_path=ref.tokenizer,
            trust_remote_code=ref.trust_remote_code,
            packing=s.packing,
            attn=s.attn_implementation,
            name="reference",
        )
        out = {name: _score(group, seqs, pad_id) for name, seqs in splits.items()}
    finally:
        if group is not None:
            group.shutdown()
        cluster.stop()
    uri = commit_reference(st.store, st.stage, st.config_hash, out)
    print(f"[{st.stage}] reference log-probs of {sum(map(len, out.values()))} sequences: {uri}", flush=True)
    return out


def _score(group: WorkerGroup[ReferencePolicy], seqs: list[Sequence], pad_id: int) -> list[float]:
    workers, out = len(group), []
    for lo in range(0, len(seqs), CHUNK):
        chunk = seqs[lo : lo + CHUNK]
        padded = chunk + [chunk[-1]] * (-len(chunk) % workers)  # every worker gets an equal shard
        t = response_tensors(padded, pad_id)
        action = t["loss_mask"][:, 1:]
        batch = SequenceBatch(input_ids=t["input_ids"], attention_mask=t["attention_mask"], action_mask=action)
        tokens = torch.cat(group.call_each(ReferencePolicy.logprobs, batch.shard(workers)))
        out += sequence_logprobs(tokens, action.float())[: len(chunk)].tolist()
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Where the numbers come from: the driver (stored, or a reference group) or the training ranks (the starting model)


def driver_reference(
    st: stage_setup.StageSetup,
    p: PreferenceConfig,
    splits: dict[str, list[dict]],
    sequences: Callable[[dict], list[Sequence]],
    keys: tuple[str, ...],
    pad_id: int,
    cluster: Cluster,
) -> None:
    """``ref_logprobs: precompute`` on the driver: the numbers committed for this config hash are read back, those of
    a reference other than the starting model computed on a ``ReferencePolicy`` group; either way they are attached
    to the examples under ``keys``. The starting model's numbers not stored yet are left to the training ranks
    (``score_on_ranks``)."""
    seqs = {name: [s for e in rows for s in sequences(e)] for name, rows in splits.items() if rows}
    logps = stored_reference(st, seqs)
    if logps is None and not starts_as_reference(p):
        logps = precompute_reference(st, p, seqs, pad_id, cluster)
    for name, rows in splits.items():
        if logps is not None:
            attach(rows, keys, logps.get(name, []))


def score_on_ranks(
    model: Any,
    ctx: StageContext,
    strategy: DeepSpeedStrategy,
    p: PreferenceConfig,
    splits: dict[str, list[dict]],
    sequences: Callable[[dict], list[Sequence]],
    keys: tuple[str, ...],
    pad_id: int,
) -> None:
    """Collective: the precomputed numbers of the starting model that the driver did not find stored. Every rank
    scores its share of the sequences with the policy it has just built (before any step, and before a checkpoint is
    loaded), the shares are gathered, rank 0 commits them, and every rank attaches them to its examples."""
    if p.ref_logprobs != "precompute" or not starts_as_reference(p):
        return
    splits = {name: rows for name, rows in splits.items() if rows}
    if all(keys[0] in rows[0] for rows in splits.values()):
        return  # read back from reference_logprobs/ by the driver
    started = time.time()
    rank, world = strategy.rank, strategy.world_size
    seqs = {name: [s for e in rows for s in sequences(e)] for name, rows in splits.items()}
    mine = {}
    for name, all_seqs in seqs.items():  # rank r scores sequences r, r + world, ...
        share = all_seqs[rank::world]
        padded = share + (share[-1:] or all_seqs[:1]) * (-(-len(all_seqs) // world) - len(share))  # equal forwards
        mine[name] = _score_policy(model, padded, ctx.train.eval_batch_size, pad_id, p.strategy.packing)[: len(share)]
    shares = strategy.all_gather_object(mine)
    out = {name: [shares[i % world][name][i // world] for i in range(len(s))] for name, s in seqs.items()}
    if rank == 0:
        uri = commit_reference(ObjectStore(ctx.run_uri, ctx.storage_options), ctx.stage, ctx.config_hash, out)
        print(
            f"[{ctx.stage}] reference log-probs of {sum(map(len, out.values()))} sequences, scored by the "
            f"{world} training rank(s) in {time.time() - started:.1f}s: {uri}",
            flush=True,
        )
    for name, rows in splits.items():
        attach(rows, keys, out[name])


@torch.no_grad()
def _score_policy(model: Any, seqs: list[Sequence], micro: int, pad_id: int, packing: bool) -> list[float]:
    """Summed response log-probs of ``seqs`` under ``model`` in eval mode, ``micro`` sequences per forward; the
    model's mode is left as it was."""
    dev, was_training = next(model.parameters()).device, model.training
    model.eval()
    try:
        out: list[float] = []
        for lo in range(0, len(seqs), micro):
            batch = device.to_device(response_tensors(seqs[lo : lo + micro], pad_id), dev)
            out += response_logprobs(model, batch, packing)[0].float().cpu().tolist()
        return out
    finally:
        model.train(was_training)


def attach(rows: list[dict], keys: tuple[str, ...], values: Iterable[float]) -> None:
    """Each row's reference log-probs, in ``reference_sequences`` order, under ``keys``."""
    it = iter(values)
    for row in rows:
        for key in keys:
            row[key] = next(it)


# ---------------------------------------------------------------------------------------------------------------------
# The rank and the job of both stages: what differs between DPO and KTO is their PreferenceMethod


class PreferenceMethod(Protocol):
    """A preference stage's own part of its rank, the class its job hosts (``DPOTrainer``, ``KTOTrainer``): the
    sequences each example is scored on, its batches, its loss (with the per-micro-batch metrics the step loop
    averages) and its held-out metrics. It holds the ``PreferenceTrainer`` that runs them and hands ``fit`` to it."""

    REF_KEYS: ClassVar[tuple[str, ...]]  # where an example's reference log-probs go, in ``reference_sequences`` order

    @staticmethod
    def reference_sequences(e: dict) -> list[Sequence]: ...

    def collate(self, examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]: ...

    def loss(self, model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]: ...

    def evaluate(self, model: Any, batches: Iterable[dict[str, torch.Tensor]]) -> dict[str, float]: ...

    def fit(self) -> dict: ...


class PreferenceTrainer:
    """The step loop of one rank of a preference stage: trains, checkpoints, resumes, evaluates and exports, with
    ``method``'s sequences, batches, loss and held-out metrics. The stage's class (``method``) is what the Ray worker
    hosts, so that its actor, log lines and errors carry the stage's name (``DPOTrainer rank 0``)."""

    def __init__(
        self,
        method: PreferenceMethod,
        ctx: StageContext,
        train_examples: list[dict],
        eval_examples: list[dict],
        p: PreferenceConfig,
        reference: ModelSource | None = None,
    ):
        self.method = method
        self.ctx, self.train_examples, self.eval_examples = ctx, train_examples, eval_examples
        self.p, self.packing = p, p.strategy.packing  # packing: padding removed inside the forward
        # ref_logprobs: online: a frozen copy of the reference on every rank; precompute: numbers in the examples
        self.online = FrozenReference(reference, p.reference or p.model, self.packing) if reference else None
        self.build: tuple[torch.dtype, str] | None = None  # the policy's precision and attention, for the online copy

    def fit(self) -> dict:
        ctx, strategy, store, work = start_rank(self.ctx)
        self.ctx, t = ctx, ctx.train

        # 1. model and engine
        tokenizer = load_tokenizer(ctx.model_dir, ctx.tokenizer_path, trust_remote_code=ctx.trust_remote_code)
        attn = attn_implementation(ctx.strategy.attn_implementation, strategy.device)
        with strategy.model_init():  # ZeRO-3: each rank materialises only its partition
            model = self.build_model(tokenizer, strategy.dtype, attn)
        n = len(self.train_examples)
        steps = total_steps(n, t.train_batch_size, t.max_epochs, t.max_steps)
        engine = strategy.prepare(model, steps)
        self.device = next(engine.module.parameters()).device
        pad_id = tokenizer.pad_token_id
        # the starting model's reference log-probs (precompute, not stored yet): scored here, before any step
        examples = {"train": self.train_examples, "eval": self.eval_examples}
        method = self.method
        score_on_ranks(engine, ctx, strategy, self.p, examples, method.reference_sequences, method.REF_KEYS, pad_id)

        # 2. resume from the newest complete checkpoint of this config
        state = resume(ctx, strategy, store, engine, work / "resume")
        resumed_from = state["step"]

        # 3. steps: step k consumes stream items [k*B, (k+1)*B), this rank its slice of them
        startup_s = None if ctx.job_started is None else time.time() - ctx.job_started
        if startup_s is not None:
            log_rank0(strategy, ctx.stage, f"first step {startup_s:.1f}s after the job started")
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
                    loss, metrics = self.method.loss(engine, self.batch(micro, pad_id))
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
                    line = f"step {step + 1}/{steps} {shown} lr={lr:.2e} ({time.time() - started:.2f}s)"
                    log_rank0(strategy, ctx.stage, line)
                    if strategy.rank == 0:
                        events.step(ctx.stage, step + 1, steps, {**logs, "lr": lr})
                        tracker.log(step + 1, {**logs, "lr": lr})
                if t.save_steps and (step + 1) % t.save_steps == 0 and step + 1 < steps:
                    save_checkpoint(ctx, strategy, store, engine, work / "ckpt", state)
                    fail_if_injected(ctx.fail_after_step, step + 1)

            # 4. evaluate
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
                batches = (self.batch(self.eval_examples[lo : lo + t.eval_batch_size], pad_id) for lo in chunks)
                metrics.update(self.method.evaluate(engine, batches))

            # 5. export in Hugging Face format, manifest last
            weights = strategy.full_state_dict(engine)
            if weights is not None:  # rank 0's: the weights gathered
                export_stage(ctx, store, engine.module, weights, tokenizer, metrics, history, work / "export")
        strategy.barrier()
        shutil.rmtree(work, ignore_errors=True)
        return metrics

    def build_model(self, tokenizer: Any, dtype: torch.dtype, attn: str) -> torch.nn.Module:
        ctx = self.ctx
        self.build = (dtype, attn)
        return build_causal_lm(
            ctx.model_dir,
            tokenizer,
            seed=ctx.init_seed,
            dtype=dtype,
            attn=attn,
            trust_remote_code=ctx.trust_remote_code,
            lora=ctx.lora,
        )

    def batch(self, examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
        """The collated micro-batch on this rank's device (the one path every training and eval batch takes)."""
        return device.to_device(self.method.collate(examples, pad_id), self.device)

    def logps(
        self, model: Any, batch: dict[str, torch.Tensor], aux_loss: list | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``response_logprobs`` of the batch's rows under ``model``, packed as this stage packs."""
        return response_logprobs(model, batch, self.packing, aux_loss)

    def ref_logps(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B,) reference log-probs of the batch's rows: precomputed, or from this rank's online copy."""
        return reference_logps(batch, self.online, self.build)


def run_stage(
    cfg: PipelineConfig,
    stage: str,
    cluster: Cluster | None,
    method: type[PreferenceMethod],
    read_examples: Callable[..., list[dict]],
) -> CheckpointRef:
    """The preference stage ``stage`` on ``cluster`` (default: Ray): ``method`` (the stage's rank class) trained on
    the examples ``read_examples`` tokenizes (``preference_examples``, ``kto_examples``: data, tokenizer, split,
    storage options)."""
    cluster = RayCluster() if cluster is None else cluster
    # 1. inputs: policy and reference, config hash, finished output
    p = cfg.stage(stage)
    st = stage_setup.setup_stage(cfg, stage, {"model": p.model, "reference": p.reference or p.model})
    if st.done is not None:
        return st.done
    p = st.section  # its stage: data paths resolved to the committed datasets

    # 2. data, tokenized and checked before any worker starts
    options = st.store.fs.storage_options
    tokenizer = load_tokenizer(st.model_path, p.model.tokenizer, trust_remote_code=p.model.trust_remote_code)
    train = read_examples(p.data, tokenizer, "train", options)
    held_out = read_examples(p.data, tokenizer, "eval", options) if p.data.eval_path else []
    input_checks.check_steps(stage, p, len(train))

    # 3. reference log-probs (precomputed: once, stored with the stage; the starting model's are scored by the
    # training ranks before their first step), then training on the Ray group; rank 0 exports and commits
    try:
        if p.ref_logprobs == "precompute":
            splits = {"train": train, "eval": held_out}
            pad_id = tokenizer.pad_token_id
            driver_reference(st, p, splits, method.reference_sequences, method.REF_KEYS, pad_id, cluster)
        reference = None if p.ref_logprobs == "precompute" else st.sources["reference"]
        metrics = cluster.run_group(
            p.strategy, method, st.context(), train, held_out, p, reference, key=f"{stage}.strategy"
        )[0]
    finally:
        shutil.rmtree(st.work, ignore_errors=True)  # downloaded inputs and staging
    return CheckpointRef(st.store.uri(stage), stage, metrics["steps"], st.config_hash, metrics)
