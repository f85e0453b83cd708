"""GPU acceptance checks of the PPO roles and of what rollout and training exchange, run by ``scripts/gpu_check.sh``
(which installs the wheels and sets the process-group environment): world size 1, the plain role classes and the
project's own transports, without Ray or vLLM.

The driver (this script without ``--worker``) runs each check in a worker process (``--worker NAME:SECONDS,...``,
started in a process group of its own) under the check's own time limit. On the GPU every check gets a fresh worker
(a CUDA context, memory statistics and a process group of its own); on the dry run one worker runs them in turn, to
import torch, DeepSpeed and transformers once. The driver prints each check's JSON lines as they come
(``{"check": ..., "ok": ..., ...}``; ``"ok": null`` with a ``"skipped"`` reason for a check that cannot run here).
A check past its limit gets ``{"check": NAME, "ok": false, "error": "timed out after N s"}`` and its worker's whole
process group is killed (spawned receivers, pytest); a worker that dies gets ``"error": "crashed (...): <its last
output line>"``; either way the remaining checks go on in a new worker. The summary line comes last
(``{"summary": ..., "ok": ..., "passed": [...], "failed": [...], "skipped": [...], "seconds": ...}``) and the exit
status is 1 when any check failed.

Time limits (seconds, GPU / dry run) are in ``CHECKS``; ``GPU_CHECK_LIMIT_<NAME>`` (e.g. ``GPU_CHECK_LIMIT_PACKING``)
overrides one, and ``GPU_CHECK_TIMEOUT`` (default 450) bounds them all together: a check starts with at most what is
left of it. The GPU limits sum to 440 s; a usual run takes a fraction of that.

The checks (``--only`` takes these names; ``train`` = both train checks, ``ipc`` = ``weight_sync``):

- ``train_actor`` / ``train_critic``: a ZeRO-3 training step of ``PolicyActor`` / ``CriticActor`` (gradient
  checkpointing on) on a Qwen2-0.5B-shaped model built from config in this file (no download): the rollout forward
  (old log-probs / values) then ``fit``. tokens/s counts every token of prompt + response through forward and
  backward. MFU = 6 * N * tokens / seconds / peak, with N the parameters that do matmuls (every ``nn.Linear``
  weight: the layers' projections, the actor's LM head, the critic's value head; not the embedding lookup), 6 * N
  the forward + backward FLOPs per token of a dense transformer (attention's O(T^2) term and the recomputation of
  gradient checkpointing left out, as is usual), and peak = 989 TFLOP/s, the H200 (= H100 SXM) bf16 dense peak. Then
  the offload/reload round trip of ``placement.offload_states_during_rollout``: the fp32 master partitions and Adam
  moments must come back bit for bit (and leave the GPU), and training must go on from them.
- ``zero_init``: the same model constructed under ``deepspeed.zero.Init``: torch.cuda.max_memory_allocated during
  construction against the full model's bytes and the per-rank shard (= the full model at world size 1, so this
  shows that construction allocates no fp32 or second full copy; the 1/N shrink needs several GPUs).
- ``weight_sync``: the project's weight-sync transport between this process and a spawned one: ``WeightSender``
  (``cuda_ipc`` on the GPU, ``gloo`` on the dry run) here; ``make_receiver_transport`` and ``receive_into_module``
  into a differently initialised model there; buckets smaller than the model. Two syncs, the second after an AdamW
  step changed the weights; after each, every received tensor must equal the sent one bit for bit (sha256 of its
  bytes, computed in each process). GB/s = the model's bytes / (start of ``send_weights`` to the receiver's end).
- ``attention_<impl>``: one sequence alone versus the same sequence right- and left-padded in a batch: max |logit
  difference| on the real tokens, for sdpa (on the GPU also in fp32, an exact reference) and (when installed)
  flash_attention_2; a control with the padding unmasked must differ, so that the check can see a masking error at
  all.
- ``packing_<impl>``: ``rlhf_core.models.forward.causal_lm_logprobs`` with ``pack=True`` (padding removed, samples
  packed into rows with restarting ``position_ids``) against ``pack=False`` (padded rows and the attention mask) on
  a ragged rollout-like batch (left-padded prompts, right-padded responses of different lengths): max |log-prob
  difference| over every real next token, within a tolerance per dtype (fp32 1e-4, bf16 5e-2, times the largest
  |log-prob| when over 1); a control packed without the restarts (a row's samples attend to each other) must differ
  by more. sdpa (on the GPU in bf16 and fp32), and flash_attention_2 when installed (CUDA).
- ``hf_generate``: the HF rollout engine (``HFGenerateEngine``) on the device: greedy generation of ragged prompts,
  ``load_state_dict`` with another model's weights, greedy generation again, which must equal a plain ``generate``
  of that other model on the same left-padded prompts, token for token, and differ from the first; tokens/s.
- ``ds_checkpoint``: a ZeRO-3 actor (a 4-layer model of the same width on the GPU) saves its shards with the roles'
  own checkpoint code (``save_shards`` into the run store, committed with ``commit_checkpoint``), takes a step, and
  loads them back (``load_shards``): the fp32 master partitions, the Adam moments and the module's partitions must
  equal the saved ones bit for bit; the step after loading must reproduce the step after saving (the same loss and
  master weights: bit for bit on CPU; on CUDA, whose backward kernels may be nondeterministic, the loss within 1e-6
  of it and the master weights' update within 1% of it, in L2 norm). Save/load seconds and bytes.
- ``pytest_gpu``: ``python -m pytest tests/gpu`` (these checks as tests, on smaller models) in a subprocess with a
  time limit, without the rest of the test suite's conftest (no Ray, no Prefect needed) and without third-party
  plugins: passed/failed/skipped counts. On the dry run those tests skip themselves (no CUDA): the check is then
  reported skipped, with the counts, and fails if any test failed or did not import.

``--dry-run`` runs the same code on CPU with tiny models, gloo and fp32: ``zero_init`` reports the partitions'
bytes (CPU has no allocator statistics), flash_attention_2 is skipped.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import hashlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
H200_BF16_DENSE_PEAK = 989e12  # FLOP/s: NVIDIA's H200 SXM bf16 dense (non-sparse) tensor-core peak

# Qwen2-0.5B's shape (494M parameters with tied embeddings), built from config; a 4-layer one of the same width (for
# the checkpoint and the tests under tests/gpu); the tiny one for --dry-run.
_QWEN2_05B: dict[str, Any] = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
MODEL_SPECS: dict[str, dict[str, Any]] = {
    "qwen2_0.5b": _QWEN2_05B,
    "qwen2_0.5b_4l": {**_QWEN2_05B, "num_hidden_layers": 4},
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        rope_theta=1e4,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
}

# rows per training step, tokens per row (prompt + response), micro-batch rows, timed steps; the checkpoint's model;
# the weight sync's bucket size; the HF engine's builtin model, prompts and new tokens per prompt
PLANS: dict[str, dict[str, Any]] = {
    "gpu": dict(
        model="qwen2_0.5b",
        precision="bf16",
        rows=16,
        seq=1024,
        prompt=256,
        micro=8,
        steps=3,
        checkpoint_model="qwen2_0.5b_4l",
        sync_bucket_bytes=128 << 20,
        hf_model="builtin:medium",
        hf_prompts=8,
        hf_new_tokens=64,
    ),
    "dry": dict(
        model="tiny",
        precision="fp32",
        rows=4,
        seq=48,
        prompt=16,
        micro=2,
        steps=1,
        checkpoint_model="tiny",
        sync_bucket_bytes=64 << 10,
        hf_model="builtin:tiny",
        hf_prompts=4,
        hf_new_tokens=16,
    ),
}

RESULTS: list[dict[str, Any]] = []
_RECORDS: Any = None  # in a worker: the pipe to the driver; else the records go to stdout


def causal_lm_on(device: str, config: Any, dtype: torch.dtype) -> torch.nn.Module:
    """A causal LM of ``config`` built (and randomly initialised) directly on ``device``: a 0.5B model in a second on
    a GPU, where a build on the CPU and a copy take many."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(device)


def model_config(spec: dict[str, Any], attn: str, **changes: Any) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(**{**spec, **changes}, attn_implementation=attn)


def dtype_of(precision: str) -> torch.dtype:
    return torch.bfloat16 if precision == "bf16" else torch.float32


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def reset_peak(device: str) -> int:
    if device != "cuda":
        return 0
    sync(device)
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def peak_since(device: str, base: int) -> int | None:
    if device != "cuda":
        return None
    sync(device)
    return torch.cuda.max_memory_allocated() - base


def n_params(model: torch.nn.Module) -> int:
    """Parameters (shared ones once), also when ZeRO-3 has partitioned them (``ds_numel`` is the full size)."""
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())


def matmul_params(model: torch.nn.Module) -> int:
    """The weights of the ``nn.Linear`` modules: what the 6 * N FLOPs per token count. An embedding is a lookup, not
    a matmul; a tied LM head multiplies by the embedding's weight, so it counts once, as a Linear. The critic has no
    LM head, only its one-output value head."""
    return sum(
        int(getattr(m.weight, "ds_numel", m.weight.numel())) for m in model.modules() if isinstance(m, torch.nn.Linear)
    )


# -- the roles, with their model built from this file's config ------------------------------------------------------
def make_roles(spec: dict[str, Any]) -> tuple[type, type]:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from rlhf_core.distributed.actor import PolicyActor
    from rlhf_core.distributed.critic import CriticActor
    from rlhf_core.models.builders import ScalarHeadModel

    class FromConfig:
        """``build_model`` from ``spec`` instead of a path; records the construction's size, time and peak memory."""

        def build_model(self, tokenizer: Any, dtype: torch.dtype, attn: str) -> torch.nn.Module:
            device = self.strategy.device
            base, start = reset_peak(device), time.perf_counter()
            model = self.from_config(model_config(spec, attn, pad_token_id=tokenizer.pad_token_id), dtype)
            self.construction = {
                "params": n_params(model),
                "params_matmul": matmul_params(model),
                "construct_s": round(time.perf_counter() - start, 2),
                "construct_peak_bytes": peak_since(device, base),
                "built_partitioned": any(hasattr(p, "ds_id") for p in model.parameters()),
            }
            return model

    class CheckActor(FromConfig, PolicyActor):
        def from_config(self, config: Any, dtype: torch.dtype) -> torch.nn.Module:
            return AutoModelForCausalLM.from_config(config, dtype=dtype)

    class CheckCritic(FromConfig, CriticActor):
        def from_config(self, config: Any, dtype: torch.dtype) -> torch.nn.Module:
            config.num_labels = 1
            return ScalarHeadModel(AutoModelForSequenceClassification.from_config(config, dtype=dtype))

    return CheckActor, CheckCritic


def role_context(role: str, plan: dict[str, Any], work: Path, threads: int) -> Any:
    from rlhf_core.config import OptimConfig, PPOAlgoConfig, StrategyConfig, TrainConfig
    from rlhf_core.distributed.role_base import RoleContext

    return RoleContext(
        stage="gpu_check",
        role=role,
        model_path="builtin:tiny",  # only for the tokenizer (pad/eos ids); the model comes from MODEL_SPECS
        tokenizer_path=None,
        init_seed=0,
        strategy=StrategyConfig(
            num_workers=1,
            zero_stage=3,
            precision=plan["precision"],
            gradient_checkpointing=True,
            attn_implementation="sdpa",
            threads_per_worker=threads,
        ),
        optim=OptimConfig(lr=1e-6, lr_warmup_ratio=0.0, lr_scheduler="constant_with_warmup"),
        batch=TrainConfig(train_batch_size=plan["rows"], micro_train_batch_size=plan["micro"]),
        micro_rollout_batch_size=plan["micro"],
        total_optimizer_steps=100,
        algo=PPOAlgoConfig(ppo_epochs=1),
        seed=0,
        run_uri=str(work / "run"),
        storage_options={},
        work_dir=str(work / role),
    )


def sequences(plan: dict[str, Any], vocab: int, seed: int) -> Any:
    from rlhf_core.algos.experience import SequenceBatch

    rows, seq = plan["rows"], plan["seq"]
    gen = torch.Generator().manual_seed(seed)
    action = torch.zeros(rows, seq - 1, dtype=torch.long)
    action[:, plan["prompt"] - 1 :] = 1
    return SequenceBatch(
        input_ids=torch.randint(3, vocab, (rows, seq), generator=gen),
        attention_mask=torch.ones(rows, seq, dtype=torch.long),
        action_mask=action,
    )


def _loss(stats: dict[str, float]) -> float:
    return next(v for k, v in stats.items() if k.endswith("loss"))


def experience(role: Any, role_name: str, plan: dict[str, Any]) -> tuple[Any, float]:
    """A rollout batch for ``role`` from its own forward (old log-probs or values) and random advantages; returns it
    with the forward's seconds."""
    from rlhf_core.algos.experience import Experience

    seq = sequences(plan, MODEL_SPECS[plan["model"]]["vocab_size"], seed=1)
    start = time.perf_counter()
    if role_name == "actor":
        old = role.logprobs(seq)
        values = torch.zeros_like(old)
    else:
        values = role.values(seq)
        old = torch.zeros_like(values)
    forward_s = time.perf_counter() - start
    gen = torch.Generator().manual_seed(2)
    exp = Experience.from_sequences(seq, old_logprobs=old, values=values, scores=torch.zeros(seq.size))
    return exp.with_advantages(torch.randn(old.shape, generator=gen), torch.randn(old.shape, generator=gen)), forward_s


def check_train(role_name: str, role_cls: type, plan: dict[str, Any], device: str, work: Path, threads: int) -> dict:
    """Set up the role (DeepSpeed ZeRO-3), one warm-up step, then ``plan['steps']`` timed steps."""
    role = role_cls(role_context(role_name, plan, work, threads))
    role.setup()
    exp, forward_s = experience(role, role_name, plan)
    before = torch.cuda.memory_allocated() if device == "cuda" else 0
    base = reset_peak(device)
    role.fit(exp, step=0)  # warm-up: allocator, kernels, optimizer states
    losses, seconds = [], []
    for step in range(1, plan["steps"] + 1):
        sync(device)
        start = time.perf_counter()
        stats = role.fit(exp, step=step)
        sync(device)
        seconds.append(time.perf_counter() - start)
        losses.append(_loss(stats))
    offload = offload_round_trip(role.engine, device)
    losses.append(_loss(role.fit(exp, step=plan["steps"] + 1)))  # training goes on from the reloaded states
    tokens = plan["rows"] * plan["seq"]  # sequences() builds full rows: no padding
    n = role.construction["params_matmul"]
    step_s = min(seconds)
    tokens_per_s = tokens / step_s
    finite = all(torch.isfinite(torch.tensor(losses)).tolist())
    record = {
        "check": f"train_{role_name}",
        "ok": finite,
        "model": plan["model"],
        "precision": plan["precision"],
        "zero_stage": 3,
        "device": device,
        "rows": plan["rows"],
        "tokens_per_step": tokens,
        "step_s": round(step_s, 4),
        "tokens_per_s": round(tokens_per_s, 1),
        "rollout_forward_tokens_per_s": round(tokens / forward_s, 1),
        "flops_formula": "6*N_matmul*tokens",
        "mfu": round(6 * n * tokens_per_s / H200_BF16_DENSE_PEAK, 4) if device == "cuda" else None,
        "peak_tflops_assumed": H200_BF16_DENSE_PEAK / 1e12,
        "loss": losses[-1],
        "train_peak_bytes": peak_since(device, base),
        "resident_bytes_before_step": before if device == "cuda" else None,
        **role.construction,
    }
    record.update(offload)
    record["ok"] = finite and offload["offload_round_trip_ok"]
    if not finite:
        record["reason"] = f"non-finite loss {losses}"
    elif not offload["offload_round_trip_ok"]:
        record["reason"] = "the training states changed over an offload/reload round trip, or did not leave the GPU"
    del role, exp
    free_memory(device)
    return emit(record)


def free_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _training_states(engine: Any) -> list[torch.Tensor]:
    """The ZeRO-3 engine's fp32 master partitions and Adam moments, as they are now (copies on the CPU)."""
    opt = engine.optimizer
    moments = [t for state in opt.optimizer.state.values() for k, t in state.items() if k in ("exp_avg", "exp_avg_sq")]
    return [t.detach().to("cpu", copy=True) for t in [*opt.fp32_partitioned_groups_flat, *moments]]


def offload_round_trip(engine: Any, device: str) -> dict[str, Any]:
    """What ``placement.offload_states_during_rollout`` does around every rollout: the training states of a ZeRO-3
    engine with torch's AdamW to host memory and back. They must come back bit for bit, and on a GPU leave it
    (allocated bytes fall by at least half of the master weights and moments)."""
    from rlhf_core.distributed.strategy import offload_training_states

    before = _training_states(engine)
    state_bytes = sum(t.numel() * t.element_size() for t in before)
    sync(device)
    resident = torch.cuda.memory_allocated() if device == "cuda" else 0
    offload_training_states(engine, pin_memory=device == "cuda")
    sync(device)
    freed = resident - torch.cuda.memory_allocated() if device == "cuda" else None
    engine.reload_states()
    same = all(torch.equal(a, b) for a, b in zip(before, _training_states(engine), strict=True))
    left = freed is None or freed >= state_bytes // 2
    return {
        "offload_state_bytes": state_bytes,
        "offload_freed_bytes": freed,
        "offload_round_trip_ok": bool(same and left and before),
    }


def check_zero_init(plan: dict[str, Any], device: str) -> dict:
    """Construct the model under ``deepspeed.zero.Init`` with the strategy's ZeRO-3 config."""
    import deepspeed
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from rlhf_core.config import OptimConfig, StrategyConfig, TrainConfig
    from rlhf_core.distributed.strategy import DeepSpeedStrategy

    dtype = dtype_of(plan["precision"])
    strategy = DeepSpeedStrategy(
        StrategyConfig(zero_stage=3, precision=plan["precision"]),
        OptimConfig(),
        TrainConfig(train_batch_size=plan["rows"], micro_train_batch_size=plan["micro"]),
    )
    strategy.init_distributed()
    world = dist.get_world_size()
    config = model_config(MODEL_SPECS[plan["model"]], "sdpa")
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, dtype=dtype)
    numel = n_params(meta)
    largest = max(p.numel() for p in meta.parameters())
    del meta
    item = torch.empty((), dtype=dtype).element_size()
    full_bytes, shard_bytes = numel * item, -(-numel // world) * item
    base, start = reset_peak(device), time.perf_counter()
    # The strategy's own context (DeepSpeedStrategy.model_init) when it has one, as the roles build under it; else
    # zero.Init directly. No dtype= there: DeepSpeed 0.19's Init ignores a given dtype on an accelerator without fp16
    # (the CPU one) and partitions in bf16; without it the dtype follows the config's bf16 switch.
    init = strategy.model_init() if hasattr(strategy, "model_init") else None
    with init if init is not None else deepspeed.zero.Init(config_dict_or_path=strategy.ds_config()):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    seconds = time.perf_counter() - start
    peak = peak_since(device, base)
    params = list(model.parameters())
    partitioned = all(hasattr(p, "ds_tensor") for p in params)
    partition_bytes = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in params) if partitioned else None
    partition_dtypes = sorted({str(p.ds_tensor.dtype).removeprefix("torch.") for p in params}) if partitioned else []
    record = {
        "check": "zero_init",
        "device": device,
        "world_size": world,
        "params": numel,
        "full_model_bytes": full_bytes,
        "shard_bytes": shard_bytes,
        "partition_bytes": partition_bytes,
        "partition_dtypes": partition_dtypes,
        "construct_peak_bytes": peak,
        "peak_over_full_model": round(peak / full_bytes, 3) if peak is not None else None,
        "construct_s": round(seconds, 2),
        "context": "DeepSpeedStrategy.model_init" if init is not None else "deepspeed.zero.Init",
    }
    # Allowed: the shard (padding included) plus two of the largest tensors in flight (one being initialised and
    # broadcast, one being partitioned). A construction in fp32, or a full copy next to the shards, exceeds it.
    limit = shard_bytes + 2 * largest * item + world * 4096 * len(params)
    problems = []
    if not partitioned:
        problems.append("parameters were not partitioned (no ds_tensor)")
    elif partition_dtypes != [str(dtype).removeprefix("torch.")]:
        problems.append(f"partitions are {partition_dtypes}, the model was asked for {dtype}")
    elif partition_bytes > limit:
        problems.append(f"partitions take {partition_bytes} bytes, more than the shard's {shard_bytes}")
    if peak is not None and peak > limit:
        problems.append(f"construction peaked at {peak} bytes, over the {limit} allowed (shard + 2 largest tensors)")
    if peak is None:
        record["peak_note"] = "CPU: no allocator statistics; partition bytes only"
    record["ok"] = not problems
    if problems:
        record["reason"] = "; ".join(problems)
    del model, params
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return emit(record)


# -- weight sync into another process, through the project's transport ------------------------------------------------
def tensor_digests(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """sha256 of each tensor's bytes: equal digests, bit-identical tensors."""
    return {
        name: hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()).hexdigest()
        for name, t in named
    }


def _sync_receiver(
    spec: dict,
    precision: str,
    device: str,
    where: tuple[str, int, str, float, str],
    specs: list,
    bucket_bytes: int,
    inbox: Any,
    outbox: Any,
) -> None:
    """Spawned process: a model of its own (other weights than the sender's), joined to the sender as rank 1 of the
    weight-sync world; each message is a sync id to receive into the model, answered with the seconds it took and
    then the digests of the model's tensors."""
    try:
        from rlhf_core.distributed.weight_sync.receiver import make_receiver_transport, receive_into_module

        torch.set_num_threads(1)
        if device == "cuda":
            torch.cuda.set_device(0)
        torch.manual_seed(123)
        model = causal_lm_on(device, model_config(spec, "sdpa"), dtype_of(precision))
        addr, port, group, timeout_s, backend = where
        transport = make_receiver_transport(addr, port, 1, 2, group, timeout_s, backend)
        outbox.put(("joined", tensor_digests(model.named_parameters())))
        while (sync_id := inbox.get()) is not None:
            start = time.perf_counter()
            receive_into_module(transport, specs, model, bucket_bytes, sync_id)
            sync(device)
            outbox.put(("done", time.perf_counter() - start))
            outbox.put(("digests", tensor_digests(model.named_parameters())))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the check
        outbox.put(("error", f"{type(e).__name__}: {e}"))


def _detached(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach()) for n, p in model.named_parameters()]


def _expect(outbox: Any, kind: str, timeout_s: float) -> Any:
    got, value = outbox.get(timeout=timeout_s)
    if got == "error":
        raise RuntimeError(f"receiver process: {value}")
    if got != kind:
        raise RuntimeError(f"receiver process answered {got!r}, expected {kind!r}")
    return value


def _optimizer_step(model: torch.nn.Module, vocab: int, device: str) -> None:
    """One AdamW step on random tokens: new weights for the second sync, as training makes them."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(3, vocab, (2, 32), generator=torch.Generator().manual_seed(3)).to(device)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()


def check_weight_sync(
    plan: dict[str, Any], device: str, bucket_bytes: int | None = None, timeout_s: float = 60
) -> dict:
    """``WeightSender`` here, ``make_receiver_transport`` + ``receive_into_module`` in a spawned process; two syncs."""
    import torch.multiprocessing as mp

    from rlhf_core.distributed.weight_sync.buckets import bucket_plan, spec_of
    from rlhf_core.distributed.weight_sync.sender import WeightSender
    from rlhf_core.ports import free_port

    spec, precision = MODEL_SPECS[plan["model"]], plan["precision"]
    backend = "cuda_ipc" if device == "cuda" else "gloo"
    bucket_bytes = bucket_bytes or plan["sync_bucket_bytes"]
    torch.manual_seed(7)
    model = causal_lm_on(device, model_config(spec, "sdpa"), dtype_of(precision)).eval()
    specs = [spec_of(n, t) for n, t in _detached(model)]
    nbytes = sum(t.numel() * t.element_size() for _, t in _detached(model))
    where = ("127.0.0.1", free_port(), "gpu_check", float(timeout_s), backend)
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    # The receiver starts first: with gloo the sender's constructor blocks until the receiver has joined; with cuda_ipc
    # the sender hosts the store that the receiver's client waits for.
    child = ctx.Process(
        target=_sync_receiver,
        args=(spec, precision, device, where, specs, bucket_bytes, inbox, outbox),
        daemon=True,
    )
    child.start()
    record: dict[str, Any] = {
        "check": "weight_sync",
        "ok": False,
        "device": device,
        "transport": backend,
        "model": plan["model"],
        "bytes": nbytes,
        "tensors": len(specs),
        "bucket_bytes": bucket_bytes,
        "buckets": len(bucket_plan(specs, bucket_bytes)),
    }
    sender = None
    try:
        sender = WeightSender(where[0], where[1], 2, where[2], timeout_s, backend=backend, bucket_bytes=bucket_bytes)
        initial = _expect(outbox, "joined", timeout_s)
        sender.check_peer()  # cuda_ipc: the receiver is on this process's GPU (by UUID)
        syncs, sent = [], []
        for k in range(2):
            if k:
                _optimizer_step(model, spec["vocab_size"], device)
            expected = tensor_digests(_detached(model))
            sent.append(expected)
            inbox.put(sender.sync_id)
            sync(device)
            start = time.perf_counter()
            sync_id = sender.send_weights(iter(_detached(model)), specs)
            receiver_s = _expect(outbox, "done", timeout_s)
            seconds = time.perf_counter() - start
            got = _expect(outbox, "digests", timeout_s)
            mismatched = [n for n in expected if got.get(n) != expected[n]]
            syncs.append(
                {
                    "sync_id": sync_id,
                    "equal": not mismatched and set(got) == set(expected),
                    "mismatched": mismatched[:5],
                    "buckets": sender.last_sync_buckets,
                    "transfers": sender.last_sync_broadcasts,
                    "seconds": round(seconds, 4),
                    "sender_s": round(sender.last_sync_s, 4),
                    "receiver_s": round(receiver_s, 4),
                    "gb_per_s": round(nbytes / seconds / 1e9, 3),
                }
            )
        inbox.put(None)
        changed = sum(sent[0][n] != sent[1][n] for n in sent[0])
        started_different = sum(initial.get(n) != sent[0][n] for n in sent[0])
        problems = [f"sync {s['sync_id']}: {len(s['mismatched'])}+ tensors differ" for s in syncs if not s["equal"]]
        if changed == 0:
            problems.append("the optimizer step changed no tensor: the second sync shows nothing")
        if started_different == 0:
            problems.append("the receiver started with the sender's weights: the syncs show nothing")
        if min(s["buckets"] for s in syncs) < 2:
            problems.append("one bucket only: the bucketing is not exercised")
        record.update(
            ok=not problems,
            syncs=syncs,
            gb_per_s=max(s["gb_per_s"] for s in syncs),
            tensors_changed_by_step=changed,
            receiver_tensors_different_before=started_different,
        )
        if problems:
            record["reason"] = "; ".join(problems)
    except Exception as e:
        why = f"receiver process exited with status {child.exitcode}" if not child.is_alive() else ""
        with contextlib.suppress(Exception):  # the receiver's own error, if it failed first
            while True:
                kind, value = outbox.get(timeout=1)
                if kind == "error":
                    why = f"receiver process: {value}"
                    break
        if why:
            raise RuntimeError(f"{type(e).__name__}: {str(e).splitlines()[0]}; {why}") from e
        raise
    finally:
        if sender is not None:
            sender.close()
        child.join(timeout=30)
        if child.is_alive():
            child.terminate()
    del model
    free_memory(device)
    return emit(record)


# -- attention: padded versus unpadded rows ---------------------------------------------------------------------------
def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


def check_attention(impl: str, plan: dict[str, Any], device: str, precision: str) -> dict:
    spec = MODEL_SPECS[plan["model"]]
    # fewer layers and a larger init than the training model: padding that leaks into attention must show clearly
    config = model_config(spec, impl, num_hidden_layers=min(4, spec["num_hidden_layers"]), initializer_range=0.1)
    torch.manual_seed(11)
    dtype = dtype_of(precision)
    model = causal_lm_on(device, config, dtype).eval()
    length, pad = (plan["seq"] // 2, plan["seq"] // 4)
    gen = torch.Generator().manual_seed(5)
    seq = torch.randint(3, spec["vocab_size"], (length,), generator=gen)
    other = torch.randint(3, spec["vocab_size"], (length + pad,), generator=gen)
    pad_id = 0
    ids = torch.stack(
        [
            torch.cat([seq, torch.full((pad,), pad_id)]),  # right-padded
            torch.cat([torch.full((pad,), pad_id), seq]),  # left-padded
            other,  # a full row, so the batch is ragged
        ]
    ).to(device)
    mask = torch.ones_like(ids)
    mask[0, length:] = 0
    mask[1, :pad] = 0

    def logits(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=_positions(attention_mask))
        return out.logits.float()

    alone = logits(seq[None].to(device), torch.ones(1, length, dtype=torch.long, device=device))[0]
    batched = logits(ids, mask)
    unmasked = logits(ids, torch.ones_like(ids))  # control: the left padding visible to the real tokens
    right = (batched[0, :length] - alone).abs().max().item()
    left = (batched[1, pad:] - alone).abs().max().item()
    control = (unmasked[1, pad:] - alone).abs().max().item()
    scale = alone.abs().max().item()
    tol = 1e-4 * max(1.0, scale) if dtype == torch.float32 else 5e-2 * max(1.0, scale)
    problems = []
    if max(right, left) > tol:
        problems.append(f"padded rows differ by {max(right, left):.3g} > tol {tol:.3g}")
    if control <= tol:
        problems.append(f"the unmasked control differs only by {control:.3g} <= tol: the check cannot see leaks")
    record = {
        "check": f"attention_{impl}",
        "device": device,
        "precision": precision,
        "ok": not problems,
        "max_abs_diff_right_pad": right,
        "max_abs_diff_left_pad": left,
        "unmasked_control_diff": control,
        "logit_scale": scale,
        "tol": tol,
        "rows": f"{length} real tokens alone vs padded by {pad} in a batch of 3",
    }
    if problems:
        record["reason"] = "; ".join(problems)
    return emit(record)


def flash_attn_available(device: str) -> str | None:
    """None when flash_attention_2 can run here, else why not."""
    if device != "cuda":
        return "flash_attention_2 needs CUDA"
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return "flash_attn is not installed"
    return None


# -- packing: packed versus padded log-probs --------------------------------------------------------------------------
def ragged_batch(longest: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """4 rows laid out as a rollout: a left-padded prompt then a right-padded response, of 100%, 60%, 30% and 25% of
    ``longest`` real tokens (so packing puts the 60% and 30% samples into one row). Pad id 0."""
    prompt_width = max(1, longest // 3)
    width = longest + 1  # one column of padding even in the longest row
    lengths = [longest, longest * 6 // 10, longest * 3 // 10, longest // 4]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        p = max(1, min(prompt_width, n // 3))
        lo, hi = prompt_width - p, prompt_width - p + n
        ids[i, lo:hi] = torch.randint(3, vocab, (n,), generator=gen)
        mask[i, lo:hi] = 1
    return ids, mask


def _unrestarted_logprobs(model: Any, ids: torch.Tensor, mask: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """The control: the same packing, but the positions run on through each packed row (no restart per sample), so
    a row's later samples attend to the earlier ones."""
    from rlhf_core.models.forward import packing_for

    packing = packing_for(model, mask)
    packed = packing.pack(ids)
    positions = torch.arange(packed.shape[1], device=ids.device).expand_as(packed)
    logits = model(input_ids=packed, position_ids=positions, use_cache=False).logits.float()
    b, t = score.nonzero(as_tuple=True)
    rows, cols = packing.locate(b, t)
    out = torch.zeros(score.shape, dtype=torch.float32, device=ids.device)
    out[b, t] = torch.log_softmax(logits[rows, cols], -1).gather(1, ids[b, t + 1][:, None]).squeeze(1)
    return out


def check_packing(impl: str, plan: dict[str, Any], device: str, precision: str) -> dict:
    from rlhf_core.models.forward import causal_lm_logprobs, packing_for

    spec = MODEL_SPECS[plan["model"]]
    # as the attention check: few layers and a large init, so that a leak between samples shows clearly
    config = model_config(spec, impl, num_hidden_layers=min(4, spec["num_hidden_layers"]), initializer_range=0.1)
    torch.manual_seed(13)
    dtype = dtype_of(precision)
    model = causal_lm_on(device, config, dtype).eval()
    ids, mask = (t.to(device) for t in ragged_batch(plan["seq"] // 2, spec["vocab_size"], seed=17))
    score = mask[:, :-1].bool() & mask[:, 1:].bool()  # every real token's next real token
    with torch.no_grad():
        packed = causal_lm_logprobs(model, ids, mask, score, pack=True)
        padded = causal_lm_logprobs(model, ids, mask, score, pack=False)
        control = _unrestarted_logprobs(model, ids, mask, score)
    diff = (packed - padded)[score].abs().max().item()
    control_diff = (control - padded)[score].abs().max().item()
    scale = padded[score].abs().max().item()
    tol = (1e-4 if dtype == torch.float32 else 5e-2) * max(1.0, scale)
    packing = packing_for(model, mask)
    problems = []
    if diff > tol:
        problems.append(f"packed log-probs differ from padded ones by {diff:.3g} > tol {tol:.3g}")
    if control_diff <= tol:
        problems.append(f"the unrestarted control differs only by {control_diff:.3g} <= tol: no leak to see")
    record = {
        "check": f"packing_{impl}",
        "device": device,
        "precision": precision,
        "ok": not problems,
        "max_abs_diff": diff,
        "cross_sample_control_diff": control_diff,
        "logprob_scale": scale,
        "tol": tol,
        "real_tokens_per_row": mask.sum(1).tolist(),
        "scored_tokens": int(score.sum()),
        "packed_shape": list(packing.packed_shape),
        "padded_shape": list(ids.shape),
    }
    if problems:
        record["reason"] = "; ".join(problems)
    del model
    free_memory(device)
    return emit(record)


# -- the HF rollout engine --------------------------------------------------------------------------------------------
def _plain_generate(
    model: Any, prompts: list[list[int]], pad_id: int, stop_ids: tuple[int, ...], max_new_tokens: int
) -> list[list[int]]:
    """Greedy ``model.generate`` on the left-padded prompts; each response cut after its first stop id."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.no_grad():
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=list(stop_ids),
            pad_token_id=pad_id,
        )
    responses = []
    for row in out[:, width:].tolist():
        end = next((i for i, token in enumerate(row) if token in stop_ids), None)
        responses.append(row if end is None else row[: end + 1])
    return responses


def check_hf_generate(plan: dict[str, Any], device: str) -> dict:
    from rlhf_core.distributed.rollout.engine import SamplingConfig
    from rlhf_core.distributed.rollout.hf_engine import HFGenerateEngine
    from rlhf_core.models.builders import build_causal_lm

    path, dtype = plan["hf_model"], dtype_of(plan["precision"])
    start = time.perf_counter()
    engine = HFGenerateEngine(path, dtype=str(dtype).removeprefix("torch."), init_seed=0)
    start_s = time.perf_counter() - start
    tok = engine.tokenizer
    special = set(tok.all_special_ids)
    allowed = torch.tensor([i for i in range(len(tok)) if i not in special])
    gen = torch.Generator().manual_seed(21)
    n = plan["hf_prompts"]
    prompts = [allowed[torch.randint(len(allowed), (4 + 3 * i,), generator=gen)].tolist() for i in range(n)]
    sampling = SamplingConfig(n=1, temperature=0.0, max_new_tokens=plan["hf_new_tokens"], seed=0)

    def timed_generate(engine: Any) -> tuple[list[list[int]], float]:
        sync(device)
        t0 = time.perf_counter()
        out = engine.generate(prompts, sampling)
        sync(device)
        return out, time.perf_counter() - t0

    first, first_s = timed_generate(engine)
    other = build_causal_lm(path, tok, seed=1, dtype=dtype, attn="sdpa").to(engine.device).eval()
    engine.load_state_dict(dict(other.state_dict()))
    loaded = all(torch.equal(p, dict(other.named_parameters())[n]) for n, p in engine.model.named_parameters())
    second, second_s = timed_generate(engine)
    reference = _plain_generate(other, prompts, engine.pad_id, engine.stop_ids, plan["hf_new_tokens"])
    tokens = sum(len(r) for r in second)
    problems = []
    if engine.device.type != device:
        problems.append(f"the engine's model is on {engine.device}, not {device}")
    if not loaded:
        problems.append("load_state_dict left parameters that differ from the loaded model's")
    if second != reference:
        rows = [i for i, (a, b) in enumerate(zip(second, reference)) if a != b]
        problems.append(f"after load_state_dict, rows {rows} differ from the loaded model's own generate")
    if second == first:
        problems.append("the generations before and after load_state_dict are equal: the load shows nothing")
    if tokens == 0:
        problems.append("nothing was generated")
    record = {
        "check": "hf_generate",
        "ok": not problems,
        "device": str(engine.device),
        "model": path,
        "dtype": str(dtype).removeprefix("torch."),
        "prompts": n,
        "max_new_tokens": plan["hf_new_tokens"],
        "generated_tokens": tokens,
        "matches_reference": second == reference,
        "differs_from_before_load": second != first,
        "tokens_per_s": round(tokens / second_s, 1),
        "first_call_tokens_per_s": round(sum(len(r) for r in first) / first_s, 1),
        "engine_start_s": round(start_s, 2),
    }
    if problems:
        record["reason"] = "; ".join(problems)
    del engine, other
    free_memory(device)
    return emit(record)


# -- DeepSpeed checkpoint: save, step, load, step -------------------------------------------------------------------
def _checkpoint_states(engine: Any) -> list[torch.Tensor]:
    """The training states (fp32 master partitions, Adam moments) and the module's own partitions (copies on the
    CPU)."""
    module = [p.ds_tensor.detach().to("cpu", copy=True) for p in engine.module.parameters()]
    return _training_states(engine) + module


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((x.double() - y.double()).abs().max().item() for x, y in zip(a, b) if x.numel()), default=0.0)


def _l2(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The L2 norm of ``b - a`` over all the tensors."""
    return sum(float((y.double() - x.double()).square().sum()) for x, y in zip(a, b)) ** 0.5


def check_ds_checkpoint(plan: dict[str, Any], device: str, work: Path, threads: int) -> dict:
    """The actor's ``save_shards`` / ``load_shards`` (DeepSpeed's save_checkpoint / load_checkpoint under the
    strategy, uploaded to and downloaded from the run store) around one training step."""
    from rlhf_core import run_layout
    from rlhf_core.distributed.checkpoints import commit_checkpoint

    plan = {**plan, "model": plan["checkpoint_model"]}
    actor_cls, _ = make_roles(MODEL_SPECS[plan["model"]])
    role = actor_cls(role_context("actor", plan, work, threads))
    role.setup()
    exp, _ = experience(role, "actor", plan)
    role.fit(exp, step=0)  # the optimizer states exist from here
    master = len(role.engine.optimizer.fp32_partitioned_groups_flat)
    saved = _checkpoint_states(role.engine)
    steps_saved = role.engine.global_steps
    rel = run_layout.checkpoint("gpu_check", 1)
    sync(device)
    start = time.perf_counter()
    files = role.save_shards(rel)
    commit_checkpoint(role.store, rel, "gpu_check", "gpu_check", files, 1, {"actor.strategy.num_workers": 1}, 1)
    save_s = time.perf_counter() - start
    loss_a = _loss(role.fit(exp, step=1))
    after_a = _checkpoint_states(role.engine)
    start = time.perf_counter()
    role.load_shards(rel)
    sync(device)
    load_s = time.perf_counter() - start
    loaded = _checkpoint_states(role.engine)
    steps_loaded = role.engine.global_steps
    loss_b = _loss(role.fit(exp, step=1))
    after_b = _checkpoint_states(role.engine)
    restored = all(torch.equal(x, y) for x, y in zip(saved, loaded, strict=True))
    step_changed = any(not torch.equal(x, y) for x, y in zip(saved[:master], after_a[:master]))
    update = _max_diff(saved[:master], after_a[:master])
    replay_diff = _max_diff(after_a[:master], after_b[:master])
    replay_rel = _l2(after_a[:master], after_b[:master]) / max(_l2(saved[:master], after_a[:master]), 1e-30)
    # CPU kernels are deterministic: the replayed step is bit for bit. CUDA backward kernels may not be (atomics in
    # attention's and the embedding's backward): the replayed update within 1% of the update (L2); a state that the
    # load did not restore (the step count in Adam's bias correction, the learning rate) moves it by far more
    replay_tol = 0.0 if device != "cuda" else 1e-2
    loss_tol = 0.0 if device != "cuda" else 1e-6 * max(1.0, abs(loss_a))
    problems = []
    if not restored:
        problems.append(f"the loaded states differ from the saved ones (max |diff| {_max_diff(saved, loaded):.3g})")
    if not step_changed:
        problems.append("the step after saving changed no master weight: the load shows nothing")
    if abs(loss_b - loss_a) > loss_tol:
        problems.append(f"the step after loading has loss {loss_b}, the step after saving had {loss_a}")
    if replay_rel > replay_tol:
        problems.append(f"the step after loading differs from the step after saving by {replay_rel:.3g} of it (L2)")
    if steps_loaded != steps_saved:
        problems.append(f"global_steps {steps_loaded} after loading, {steps_saved} when saved")
    record = {
        "check": "ds_checkpoint",
        "ok": not problems,
        "device": device,
        "model": plan["model"],
        "precision": plan["precision"],
        "zero_stage": 3,
        "files": len(files),
        "bytes": sum(int(entry["size"]) for entry in files.values()),
        "save_s": round(save_s, 3),
        "load_s": round(load_s, 3),
        "states_restored_exactly": restored,
        "state_tensors": len(saved),
        "step_update_max": update,
        "replay_max_diff": replay_diff,
        "replay_rel_l2": replay_rel,
        "replay_tol": replay_tol,
        "loss_after_save": loss_a,
        "loss_after_load": loss_b,
        "global_steps": steps_saved,
    }
    if problems:
        record["reason"] = "; ".join(problems)
    del role, exp
    free_memory(device)
    return emit(record)


# -- pytest tests/gpu -------------------------------------------------------------------------------------------------
PYTEST_GPU = [
    "-m",
    "pytest",
    "tests/gpu",
    "-q",
    "-p",
    "no:cacheprovider",
    "--confcutdir=tests/gpu",  # tests/conftest.py (its S3 server plugin, Ray fixtures) is not loaded
    "-W",
    "ignore::pytest.PytestConfigWarning",  # the project's pytest-timeout setting, with plugins not autoloaded
]


def pytest_counts(output: str) -> dict[str, int]:
    """The counts of pytest's last summary line (``3 passed, 1 skipped in 2.0s``)."""
    lines = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|errors?)\b", line)]
    counts = dict.fromkeys(("passed", "failed", "skipped", "errors"), 0)
    for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)\b", lines[-1] if lines else ""):
        key = "errors" if what.startswith("error") else what
        counts[key] = counts.get(key, 0) + int(n)
    return counts


def _kill_tree(proc: subprocess.Popen) -> None:
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
    proc.kill()


def check_pytest_gpu(device: str, limit_s: float) -> dict:
    """``python -m pytest tests/gpu`` with this Python (plugins not autoloaded: an image's own pytest plugins stay
    out), killed with its children after ``limit_s``."""
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, *PYTEST_GPU], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        output, _ = proc.communicate(timeout=limit_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        output, _ = proc.communicate()
        timed_out = True
    seconds = time.perf_counter() - start
    print(output, file=sys.stderr, flush=True)
    counts = pytest_counts(output)
    last = next((line for line in reversed(output.splitlines()) if line.strip()), "")
    record: dict[str, Any] = {
        "check": "pytest_gpu",
        "command": "python " + " ".join(PYTEST_GPU),
        "returncode": proc.returncode,
        "tests_passed": counts["passed"],
        "tests_failed": counts["failed"],
        "tests_skipped": counts["skipped"],
        "tests_errors": counts["errors"],
        "seconds": round(seconds, 1),
        "last_line": last[-300:],
    }
    clean = not timed_out and proc.returncode == 0 and counts["failed"] == counts["errors"] == 0
    if device != "cuda" and clean and counts["skipped"] > 0 and counts["passed"] == 0:
        record.update(ok=None, skipped=f"tests/gpu needs CUDA: its {counts['skipped']} tests skipped themselves")
    else:
        record["ok"] = clean and counts["passed"] > 0
        if timed_out:
            record["reason"] = f"pytest timed out after {limit_s:.0f} s"
        elif not record["ok"]:
            record["reason"] = f"pytest: {last[-300:]}"
    return emit(record)


# -- the checks, as the workers run them ------------------------------------------------------------------------------
@dataclass
class Ctx:
    """What a check runs with in its worker."""

    plan: dict[str, Any]
    device: str
    work: Path
    threads: int
    deadline: float  # time.monotonic() when the driver kills the worker


def run_check(name: str, fn: Callable[..., Any], *args: Any) -> None:
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - one failed check must not hide the others
        traceback.print_exc(file=sys.stderr)
        emit({"check": name, "ok": False, "reason": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"})


def _train(role_name: str) -> Callable[[Ctx], None]:
    def train(c: Ctx) -> dict:
        role_cls = make_roles(MODEL_SPECS[c.plan["model"]])[0 if role_name == "actor" else 1]
        return check_train(role_name, role_cls, c.plan, c.device, c.work, c.threads)

    return lambda c: run_check(f"train_{role_name}", train, c)


def _wait_s(c: Ctx) -> float:
    """How long a check may wait for another process: until 5 s before its limit, so that it reports the wait's
    failure itself."""
    return max(5.0, c.deadline - time.monotonic() - 5)


def _attention(c: Ctx) -> None:
    run_check("attention_sdpa", check_attention, "sdpa", c.plan, c.device, c.plan["precision"])
    if c.device == "cuda":  # exact reference: sdpa in fp32 (flash attention has no fp32)
        run_check("attention_sdpa_fp32", check_attention, "sdpa", c.plan, c.device, "fp32")
    why = flash_attn_available(c.device)
    if why is None:
        run_check("attention_flash_attention_2", check_attention, "flash_attention_2", c.plan, c.device, "bf16")
    else:
        emit({"check": "attention_flash_attention_2", "ok": None, "skipped": why})


def _packing(c: Ctx) -> None:
    run_check("packing_sdpa", check_packing, "sdpa", c.plan, c.device, c.plan["precision"])
    if c.device == "cuda":
        run_check("packing_sdpa_fp32", check_packing, "sdpa", c.plan, c.device, "fp32")
    why = flash_attn_available(c.device)
    if why is None:
        run_check("packing_flash_attention_2", check_packing, "flash_attention_2", c.plan, c.device, "bf16")
    else:
        emit({"check": "packing_flash_attention_2", "ok": None, "skipped": why})


def _test_hang(c: Ctx) -> None:
    """Test-only (GPU_CHECK_TEST_CHECKS=1): starts a child process, says its pid, then waits forever."""
    child = subprocess.Popen(["sleep", "600"])
    print(f"test_hang: child pid {child.pid}", file=sys.stderr, flush=True)
    time.sleep(600)


def _test_crash(c: Ctx) -> None:
    """Test-only (GPU_CHECK_TEST_CHECKS=1): the worker dies mid-check."""
    print("test_crash: the worker kills itself", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


# name -> (what the worker runs, time limit in seconds on the GPU, on the dry run). The GPU limits sum to 440 s.
CHECKS: dict[str, tuple[Callable[[Ctx], None], float, float]] = {
    "train_actor": (_train("actor"), 70, 120),
    "train_critic": (_train("critic"), 70, 120),
    "zero_init": (lambda c: run_check("zero_init", check_zero_init, c.plan, c.device), 30, 60),
    "weight_sync": (
        lambda c: run_check("weight_sync", check_weight_sync, c.plan, c.device, None, _wait_s(c)),
        45,
        90,
    ),
    "attention": (_attention, 30, 60),
    "packing": (_packing, 30, 60),
    "hf_generate": (lambda c: run_check("hf_generate", check_hf_generate, c.plan, c.device), 25, 60),
    "ds_checkpoint": (
        lambda c: run_check("ds_checkpoint", check_ds_checkpoint, c.plan, c.device, c.work, c.threads),
        55,
        120,
    ),
    "pytest_gpu": (lambda c: run_check("pytest_gpu", check_pytest_gpu, c.device, _wait_s(c)), 85, 90),
}
TEST_CHECKS: dict[str, tuple[Callable[[Ctx], None], float, float]] = {
    "test_hang": (_test_hang, 10, 10),
    "test_crash": (_test_crash, 10, 10),
}
ALIASES = {"train": ["train_actor", "train_critic"], "ipc": ["weight_sync"]}
RECORD_FD_ENV = "GPU_CHECK_RECORD_FD"
LAUNCHED_ENV = "GPU_CHECK_LAUNCHED"  # the worker's launch, on time.monotonic()'s clock (one for all processes)


def known_checks() -> dict[str, tuple[Callable[[Ctx], None], float, float]]:
    return {**CHECKS, **(TEST_CHECKS if os.environ.get("GPU_CHECK_TEST_CHECKS") == "1" else {})}


def limit_of(name: str, dry: bool) -> float:
    """The check's time limit: ``GPU_CHECK_LIMIT_<NAME>`` if set, else its default for the GPU or the dry run."""
    key = f"GPU_CHECK_LIMIT_{name.upper()}"
    if not os.environ.get(key):
        return known_checks()[name][2 if dry else 1]
    try:
        return float(os.environ[key])
    except ValueError:
        raise SystemExit(f"gpu_check: {key}={os.environ[key]!r} is not a number of seconds") from None


def emit(record: dict[str, Any]) -> dict[str, Any]:
    print(json.dumps(record), file=_RECORDS or sys.stdout, flush=True)
    RESULTS.append(record)
    return record


def worker(spec: str, dry: bool) -> int:
    """Run the checks of ``spec`` (``NAME:SECONDS,...``) in turn; a start and a done event around each, and the
    checks' records, go to the driver through the pipe it passed."""
    global _RECORDS
    _RECORDS = os.fdopen(int(os.environ[RECORD_FD_ENV]), "w", buffering=1)
    device = "cpu" if dry else "cuda"
    threads = max(1, min(4, os.cpu_count() or 1)) if dry else 8
    torch.set_num_threads(threads)
    plan = PLANS["dry" if dry else "gpu"]
    checks = known_checks()
    start = float(os.environ.get(LAUNCHED_ENV) or time.monotonic())  # the first check's limit runs from the launch
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        for item in spec.split(","):
            name, _, limit = item.partition(":")
            print(json.dumps({"event": "start", "check": name}), file=_RECORDS, flush=True)
            checks[name][0](Ctx(plan, device, Path(tmp) / name, threads, start + float(limit)))
            start = time.monotonic()
            print(json.dumps({"event": "done", "check": name}), file=_RECORDS, flush=True)
    return 0


# -- the driver -------------------------------------------------------------------------------------------------------
EXIT_GRACE_S = 30  # a worker that has finished its checks but does not exit is killed after this


def _pump_records(fd: int, events: queue.Queue) -> None:
    with os.fdopen(fd, "r") as stream:
        for line in stream:
            with contextlib.suppress(json.JSONDecodeError):
                events.put(json.loads(line))
    events.put(None)


def _pump_log(stream: Any, tail: collections.deque) -> None:
    """The worker's stdout and stderr, passed on to this process's stderr; the last lines kept for a crash report."""
    for raw in iter(stream.readline, b""):
        sys.stderr.buffer.write(raw)
        sys.stderr.flush()
        if line := raw.decode("utf-8", "replace").strip():
            tail.append(line)


def _kill_group(proc: subprocess.Popen) -> None:
    """The worker and everything it started (its process group: spawned receivers, pytest and its children)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _exit_text(rc: int) -> str:
    if rc < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-rc).name}"
    return f"exit status {rc}"


def run_worker(
    group: list[str], limits: dict[str, float], dry: bool, end: float, report: Callable[[dict], None]
) -> list[str]:
    """Run the checks of ``group`` in one worker; returns those that ran to their end or failed (the others are
    left for the next worker). A check's limit counts from its start event (the first one's from the worker's
    launch, its imports included) and is cut to what is left until ``end``."""
    from rlhf_core.ports import free_port

    def limit(name: str) -> float:
        return max(1.0, min(limits[name], end - time.monotonic()))

    spec = ",".join(f"{name}:{limit(name):g}" for name in group)
    read_fd, write_fd = os.pipe()
    env = dict(os.environ, PYTHONFAULTHANDLER="1", MASTER_PORT=str(free_port()))
    env.update({RECORD_FD_ENV: str(write_fd), LAUNCHED_ENV: repr(time.monotonic())})
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--worker", spec, *(["--dry-run"] if dry else [])],
        env=env,
        pass_fds=(write_fd,),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, killed as a whole
    )
    os.close(write_fd)
    events: queue.Queue = queue.Queue()
    tail: collections.deque = collections.deque(maxlen=20)
    log = threading.Thread(target=_pump_log, args=(proc.stdout, tail), daemon=True)
    log.start()
    threading.Thread(target=_pump_records, args=(read_fd, events), daemon=True).start()
    ended: list[str] = []
    current: str | None = group[0]
    current_limit = limit(group[0])
    deadline = time.monotonic() + current_limit
    started = False
    while True:
        try:
            item = events.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            _kill_group(proc)
            if current is None:
                print(f"gpu_check: a worker did not exit {EXIT_GRACE_S} s after its checks; killed", file=sys.stderr)
                return ended
            report({"check": current, "ok": False, "error": f"timed out after {current_limit:g} s"})
            return [*ended, current]
        if item is None:  # the worker has exited (or closed the pipe): a check still running has crashed
            try:
                rc = proc.wait(timeout=EXIT_GRACE_S)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                rc = proc.returncode
            log.join(timeout=5)
            if current is None:
                return ended
            last = tail[-1] if tail else "no output"
            report({"check": current, "ok": False, "error": f"crashed ({_exit_text(rc)}): {last[-300:]}"})
            return [*ended, current]
        if item.get("event") == "start":
            current = item["check"]
            if started:  # the first check's limit runs from the launch
                current_limit = limit(current)
                deadline = time.monotonic() + current_limit
            started = True
        elif item.get("event") == "done":
            ended.append(item["check"])
            current = None
            deadline = time.monotonic() + EXIT_GRACE_S
        else:
            report(item)


def environment(device: str) -> dict[str, Any]:
    import importlib.metadata as md

    env: dict[str, Any] = {"check": "environment", "ok": True, "python": sys.version.split()[0]}
    env.update(torch=torch.__version__, cuda=torch.version.cuda, device=device)
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
    for dist in ("deepspeed", "transformers", "rlhf-pipeline"):
        with contextlib.suppress(md.PackageNotFoundError):
            env[dist] = md.version(dist)
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny models, gloo, fp32")
    parser.add_argument(
        "--only", default=",".join(CHECKS), help=f"comma-separated subset of {','.join([*CHECKS, *ALIASES])}"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.dry_run)
    checks = known_checks()
    wanted = [c for c in args.only.split(",") if c]
    unknown = sorted(set(wanted) - set(checks) - set(ALIASES))
    if unknown:
        parser.error(f"--only: unknown check(s) {', '.join(unknown)}; choose from {', '.join([*CHECKS, *ALIASES])}")
    only = list(dict.fromkeys(n for c in wanted for n in ALIASES.get(c, [c])))
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"summary": "no CUDA device visible; use --dry-run on CPU", "ok": False}), flush=True)
        return 1
    os.environ["RLHF_DEVICE"] = device
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    start = time.monotonic()
    end = start + float(os.environ.get("GPU_CHECK_TIMEOUT") or 450)
    limits = {name: limit_of(name, args.dry_run) for name in only}
    emit(environment(device))
    pending = list(only)
    while pending:
        if end - time.monotonic() < 1:
            for name in pending:
                emit({"check": name, "ok": False, "error": "not started: GPU_CHECK_TIMEOUT was spent"})
            break
        # the dry run: one worker for all (imports once); the GPU: one per check (its own CUDA context)
        group = pending if args.dry_run else pending[:1]
        ended = run_worker(group, limits, args.dry_run, end, emit)
        pending = [name for name in pending if name not in ended]
    failed = [r["check"] for r in RESULTS if r.get("ok") is False]
    summary = {
        "summary": "gpu_check dry run (CPU)" if args.dry_run else "gpu_check",
        "ok": not failed,
        "passed": [r["check"] for r in RESULTS if r.get("ok") is True and r["check"] != "environment"],
        "failed": failed,
        "skipped": [r["check"] for r in RESULTS if r.get("ok") is None],
        "seconds": round(time.monotonic() - start, 1),
    }
    print(json.dumps(summary), flush=True)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
