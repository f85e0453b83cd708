"""GPU acceptance checks of the PPO roles, run by ``scripts/gpu_check.sh`` (which installs the wheels and sets the
process-group environment): one process, world size 1, the plain role classes without Ray.

Each check prints one JSON line (``{"check": ..., "ok": ..., ...}``); the last line is the summary
(``{"summary": ..., "ok": ...}``) and the exit status is 1 when any check failed.

- ``train_actor`` / ``train_critic``: a ZeRO-3 training step of ``PolicyActor`` / ``CriticActor`` (gradient
  checkpointing on) on a Qwen2-0.5B-shaped model built from config in this file (no download): the rollout forward
  (old log-probs / values) then ``fit``. tokens/s counts every token of prompt + response through forward and
  backward. MFU = 6 * N * tokens / seconds / peak, with N the parameters that do matmuls (every ``nn.Linear``
  weight: the layers' projections, the actor's LM head, the critic's value head; not the embedding lookup), 6 * N
  the forward + backward FLOPs per token of a dense transformer (attention's O(T^2) term and the recomputation of
  gradient checkpointing left out, as is usual), and peak = 989 TFLOP/s, the H200 (= H100 SXM) bf16 dense peak.
- ``zero_init``: the same model constructed under ``deepspeed.zero.Init``: torch.cuda.max_memory_allocated during
  construction against the full model's bytes and the per-rank shard (= the full model at world size 1, so this
  shows that construction allocates no fp32 or second full copy; the 1/N shrink needs several GPUs).
- ``weight_ipc``: the actor's weights handed to a model in another process (torch.multiprocessing spawn) by CUDA IPC
  handles of flat buckets (``torch.multiprocessing.reductions.reduce_tensor``, as OpenRLHF's colocated sync does):
  GB/s from packing the buckets to the receiver's acknowledgement, and a checksum of the received weights.
- ``attention_<impl>``: one sequence alone versus the same sequence right- and left-padded in a batch: max |logit
  difference| on the real tokens, for sdpa and (when installed) flash_attention_2; a control with the padding
  unmasked must differ, so that the check can see a masking error at all.

``--dry-run`` runs the same code on CPU with tiny models, gloo and fp32: the IPC check becomes a CPU shared-memory
handoff (same code path, tensors in shared memory instead of CUDA IPC), ``zero_init`` reports the partitions'
bytes (CPU has no allocator statistics), and only sdpa is checked.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

H200_BF16_DENSE_PEAK = 989e12  # FLOP/s: NVIDIA's H200 SXM bf16 dense (non-sparse) tensor-core peak

# Qwen2-0.5B's shape (494M parameters with tied embeddings), built from config; the tiny one for --dry-run.
MODEL_SPECS: dict[str, dict[str, Any]] = {
    "qwen2_0.5b": dict(
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
    ),
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

# rows per training step, tokens per row (prompt + response), micro-batch rows, timed steps
PLANS: dict[str, dict[str, Any]] = {
    "gpu": dict(model="qwen2_0.5b", precision="bf16", rows=16, seq=1024, prompt=256, micro=8, steps=3),
    "dry": dict(model="tiny", precision="fp32", rows=4, seq=48, prompt=16, micro=2, steps=1),
}

RESULTS: list[dict[str, Any]] = []


def emit(record: dict[str, Any]) -> dict[str, Any]:
    print(json.dumps(record, sort_keys=False), flush=True)
    RESULTS.append(record)
    return record


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


def check_train(role_name: str, role_cls: type, plan: dict[str, Any], device: str, work: Path, threads: int) -> dict:
    """Set up the role (DeepSpeed ZeRO-3), one warm-up step, then ``plan['steps']`` timed steps."""
    from rlhf_core.algos.experience import Experience

    role = role_cls(role_context(role_name, plan, work, threads))
    role.setup()
    spec = MODEL_SPECS[plan["model"]]
    seq = sequences(plan, spec["vocab_size"], seed=1)
    forward_s = []
    if role_name == "actor":
        start = time.perf_counter()
        old = role.logprobs(seq)
        forward_s.append(time.perf_counter() - start)
        values = torch.zeros_like(old)
    else:
        start = time.perf_counter()
        values = role.values(seq)
        forward_s.append(time.perf_counter() - start)
        old = torch.zeros_like(values)
    gen = torch.Generator().manual_seed(2)
    exp = Experience.from_sequences(seq, old_logprobs=old, values=values, scores=torch.zeros(seq.size))
    exp = exp.with_advantages(torch.randn(old.shape, generator=gen), torch.randn(old.shape, generator=gen))
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
        losses.append(next(v for k, v in stats.items() if k.endswith("loss")))
    offload = offload_round_trip(role.engine, device)
    stats = role.fit(exp, step=plan["steps"] + 1)  # training goes on from the reloaded states
    losses.append(next(v for k, v in stats.items() if k.endswith("loss")))
    tokens = seq.size * seq.input_ids.shape[1]
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
        "rows": seq.size,
        "tokens_per_step": tokens,
        "step_s": round(step_s, 4),
        "tokens_per_s": round(tokens_per_s, 1),
        "rollout_forward_tokens_per_s": round(tokens / forward_s[0], 1),
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
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return emit(record)


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


# -- weight handoff to another process --------------------------------------------------------------------------------
WS_API = (
    "bucket_plan",
    "pack_bucket",
    "unpack_bucket",
    "ipc_handle",
    "open_ipc_handle",
    "load_into_module",
    "spec_of",
)


def weight_sync_api() -> Any:
    """The bucket functions of ``rlhf_core.distributed.weight_sync.buckets`` and the CUDA-IPC ones of its
    ``transports`` when they are all there, else None (then this script packs its own buckets and calls
    ``reduce_tensor`` directly)."""
    from types import SimpleNamespace

    from rlhf_core.distributed.weight_sync import buckets, transports

    found = {name: vars(buckets).get(name) or vars(transports).get(name) for name in WS_API}
    return SimpleNamespace(**found) if all(found.values()) else None


def _weights_checksum(tensors: list[torch.Tensor]) -> float:
    return float(torch.stack([t.detach().double().sum() for t in tensors]).sum().item())


def _pack_plain(tensors: list[torch.Tensor], bucket_bytes: int) -> list[tuple[torch.Tensor, list[tuple]]]:
    """Fallback packing: flat buffers of at most ``bucket_bytes`` (a bigger tensor alone), one dtype each, with the
    (index, offset, numel, shape) of every tensor in it."""
    buckets: list[tuple[torch.Tensor, list[tuple]]] = []
    current: list[int] = []

    def close() -> None:
        if current:
            flat = torch.cat([tensors[i].reshape(-1) for i in current])
            offsets = [sum(tensors[j].numel() for j in current[:k]) for k in range(len(current))]
            buckets.append(
                (flat, [(i, o, tensors[i].numel(), tuple(tensors[i].shape)) for i, o in zip(current, offsets)])
            )

    size = 0
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        if current and (size + nbytes > bucket_bytes or t.dtype != tensors[current[0]].dtype):
            close()
            current, size = [], 0
        current.append(i)
        size += nbytes
    close()
    return buckets


def _ipc_receiver(spec: dict, precision: str, device: str, specs: list, bucket_bytes: int, inbox: Any, outbox: Any):
    """Spawned process with a model of its own: each message is one handle per bucket, opened, unpacked and copied
    into the model; it answers with a checksum of its weights."""
    try:
        from torch.multiprocessing.reductions import reduce_tensor  # noqa: F401 - registers torch's reductions
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        if device == "cuda":
            torch.cuda.set_device(0)
        torch.manual_seed(123)  # other weights than the sender's, so that the checksum shows the copy
        model = AutoModelForCausalLM.from_config(model_config(spec, "sdpa"), dtype=dtype_of(precision)).to(device)
        params = list(model.parameters())
        ws = weight_sync_api()
        outbox.put(("ready", _weights_checksum(params)))
        while (handles := inbox.get()) is not None:
            if ws is not None:
                for indices, handle in zip(ws.bucket_plan(specs, bucket_bytes), handles):
                    buffer = ws.open_ipc_handle(handle) if device == "cuda" else handle[0](*handle[1])
                    ws.load_into_module(model, ws.unpack_bucket(buffer, [specs[i] for i in indices]))
                    del buffer
            else:
                named = dict(model.named_parameters())
                with torch.no_grad():
                    for (rebuild, args), entries in handles:
                        flat = rebuild(*args)
                        for i, offset, numel, shape in entries:
                            named[specs[i][0]].copy_(flat[offset : offset + numel].view(shape))
                        del flat
            sync(device)
            outbox.put(("done", _weights_checksum(params)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the check
        outbox.put(("error", f"{type(e).__name__}: {e}"))


def check_ipc(plan: dict[str, Any], device: str, bucket_mb: int = 1024, reps: int = 3) -> dict:
    import torch.multiprocessing as mp
    from torch.multiprocessing.reductions import reduce_tensor
    from transformers import AutoModelForCausalLM

    from rlhf_core.distributed.weight_sync.buckets import spec_of

    spec, precision = MODEL_SPECS[plan["model"]], plan["precision"]
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(model_config(spec, "sdpa"), dtype=dtype_of(precision)).to(device)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    tensors = [t for _, t in named]
    specs = [spec_of(n, t) for n, t in named]
    expected = _weights_checksum(tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    bucket_bytes = bucket_mb << 20
    ws = weight_sync_api()
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(
        target=_ipc_receiver, args=(spec, precision, device, specs, bucket_bytes, inbox, outbox), daemon=True
    )
    child.start()
    record: dict[str, Any] = {
        "check": "weight_ipc",
        "device": device,
        "bytes": nbytes,
        "bucket_mb": bucket_mb,
        "transport": "cuda_ipc" if device == "cuda" else "cpu_shared_memory (dry run: no CUDA IPC on CPU)",
        "functions": "rlhf_core.distributed.weight_sync" if ws is not None else "script + reduce_tensor",
    }
    try:
        kind, initial = outbox.get(timeout=300)
        if kind != "ready":
            raise RuntimeError(f"receiver failed to start: {initial}")
        seconds, got, n_buckets = [], None, 0
        for _ in range(reps):
            sync(device)
            start = time.perf_counter()
            if ws is not None:
                buffers = [
                    ws.pack_bucket([tensors[i] for i in b], [specs[i] for i in b], device=device, index=k)
                    for k, b in enumerate(ws.bucket_plan(specs, bucket_bytes))
                ]
                handles = [ws.ipc_handle(b) if device == "cuda" else reduce_tensor(b) for b in buffers]
            else:
                buckets = _pack_plain(tensors, bucket_bytes)
                buffers = [flat for flat, _ in buckets]
                sync(device)
                handles = [(reduce_tensor(flat), entries) for flat, entries in buckets]
            inbox.put(handles)
            kind, got = outbox.get(timeout=300)
            if kind != "done":
                raise RuntimeError(f"receiver failed: {got}")
            seconds.append(time.perf_counter() - start)
            n_buckets = len(buffers)
            del buffers, handles  # the receiver has copied and dropped its mappings
        inbox.put(None)
        best = min(seconds)
        match = abs(got - expected) <= 1e-9 * max(1.0, abs(expected))
        record.update(
            buckets=n_buckets,
            seconds=[round(s, 4) for s in seconds],
            gb_per_s=round(nbytes / best / 1e9, 2),
            checksum_match=match,
            receiver_started_different=abs(initial - expected) > 1e-6 * max(1.0, abs(expected)),
            ok=match,
        )
        if not match:
            record["reason"] = f"received weights' checksum {got} != sent {expected}"
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.terminate()
    del model, named, tensors
    if device == "cuda":
        torch.cuda.empty_cache()
    return emit(record)


# -- attention: padded versus unpadded rows ---------------------------------------------------------------------------
def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


def check_attention(impl: str, plan: dict[str, Any], device: str, precision: str) -> dict:
    from transformers import AutoModelForCausalLM

    spec = MODEL_SPECS[plan["model"]]
    # fewer layers and a larger init than the training model: padding that leaks into attention must show clearly
    config = model_config(spec, impl, num_hidden_layers=min(4, spec["num_hidden_layers"]), initializer_range=0.1)
    torch.manual_seed(11)
    dtype = dtype_of(precision)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
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


# -- driver -----------------------------------------------------------------------------------------------------------
CHECKS = ("train", "zero_init", "ipc", "attention")


def run_check(name: str, fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - one failed check must not hide the others
        traceback.print_exc(file=sys.stderr)
        emit({"check": name, "ok": False, "reason": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny models, gloo, fp32")
    parser.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    args = parser.parse_args(argv)
    only = [c for c in args.only.split(",") if c]
    unknown = sorted(set(only) - set(CHECKS))
    if unknown:
        parser.error(f"--only: unknown check(s) {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"summary": "no CUDA device visible; use --dry-run on CPU", "ok": False}), flush=True)
        return 1
    os.environ["RLHF_DEVICE"] = device
    for key, value in (
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29511"),
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("LOCAL_RANK", "0"),
    ):
        os.environ.setdefault(key, value)
    plan = PLANS["dry" if args.dry_run else "gpu"]
    threads = max(1, min(4, os.cpu_count() or 1)) if args.dry_run else 8
    torch.set_num_threads(threads)
    start = time.perf_counter()
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": device}
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
    with contextlib.suppress(ImportError):
        import deepspeed
        import transformers

        env.update(deepspeed=deepspeed.__version__, transformers=transformers.__version__)
    emit({"check": "environment", "ok": True, **env})
    skipped: list[str] = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        if "train" in only:
            actor_cls, critic_cls = make_roles(MODEL_SPECS[plan["model"]])
            run_check("train_actor", check_train, "actor", actor_cls, plan, device, Path(tmp), threads)
            run_check("train_critic", check_train, "critic", critic_cls, plan, device, Path(tmp), threads)
        if "zero_init" in only:
            run_check("zero_init", check_zero_init, plan, device)
        if "ipc" in only:
            run_check("weight_ipc", check_ipc, plan, device)
        if "attention" in only:
            run_check("attention_sdpa", check_attention, "sdpa", plan, device, plan["precision"])
            if device == "cuda":  # exact reference: sdpa in fp32 (flash attention has no fp32)
                run_check("attention_sdpa_fp32", check_attention, "sdpa", plan, device, "fp32")
            why = flash_attn_available(device)
            if why is None:
                run_check("attention_flash_attention_2", check_attention, "flash_attention_2", plan, device, "bf16")
            else:
                skipped.append("attention_flash_attention_2")
                emit({"check": "attention_flash_attention_2", "ok": None, "skipped": why})
    failed = [r["check"] for r in RESULTS if r.get("ok") is False]
    passed = [r["check"] for r in RESULTS if r.get("ok") is True and r["check"] != "environment"]
    summary = {
        "summary": "gpu_check dry run (CPU)" if args.dry_run else "gpu_check",
        "ok": not failed,
        "passed": passed,
        "failed": failed,
        "skipped": skipped,
        "seconds": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(summary), flush=True)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
