"""What the DPO and KTO stages share: response-only sequence log-probs and the frozen reference's numbers.

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
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from rlhf_core import run_layout
from rlhf_core.algos.experience import SequenceBatch
from rlhf_core.algos.preference import sequence_logprobs
from rlhf_core.config import ModelConfig, PreferenceConfig
from rlhf_core.data.examples import pad_right
from rlhf_core.distributed import device
from rlhf_core.distributed.checkpoints import StageContext, write_entry
from rlhf_core.distributed.cluster import Cluster, WorkerGroup
from rlhf_core.distributed.node_files import ModelSource, local_model_path
from rlhf_core.distributed.reference import ReferencePolicy
from rlhf_core.distributed.strategy import DeepSpeedStrategy
from rlhf_core.jobs import common
from rlhf_core.models.builders import build_causal_lm, load_tokenizer
from rlhf_core.models.forward import causal_lm_logprobs
from rlhf_core.storage import ArtifactError, ObjectStore

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


def stored_reference(st: common.StageSetup, splits: dict[str, list[Sequence]]) -> dict[str, list[float]] | None:
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
    st: common.StageSetup, p: PreferenceConfig, splits: dict[str, list[Sequence]], pad_id: int, cluster: Cluster
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
    st: common.StageSetup,
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
