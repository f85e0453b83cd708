"""``train_actor`` / ``train_critic``: a ZeRO-3 training step of ``PolicyActor`` / ``CriticActor`` (gradient
checkpointing on) on a Qwen2-0.5B-shaped model built from config (``common.MODEL_SPECS``, no download): the rollout
forward (old log-probs / values) then ``fit``, one warm-up step and ``plan['steps']`` timed ones.

tokens/s counts every token of prompt + response through forward and backward. MFU = 6 * N * tokens / seconds /
peak, with N the parameters that do matmuls (every ``nn.Linear`` weight: the layers' projections, the actor's LM
head, the critic's value head; not the embedding lookup), 6 * N the forward + backward FLOPs per token of a dense
transformer (attention's O(T^2) term and the recomputation of gradient checkpointing left out, as is usual), and
peak = 989 TFLOP/s, the H200 (= H100 SXM) bf16 dense peak.

Then the offload/reload round trip of ``placement.offload_states_during_rollout``: the fp32 master partitions and
Adam moments must come back bit for bit (and leave the GPU), and training must go on from them."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from .common import MODEL_SPECS, Ctx, emit, free_memory, peak_since, reset_peak, run_check, sync
from .roles import experience, make_roles, role_context, step_loss, training_states

H200_BF16_DENSE_PEAK = 989e12  # FLOP/s: NVIDIA's H200 SXM bf16 dense (non-sparse) tensor-core peak


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
        losses.append(step_loss(stats))
    offload = offload_round_trip(role.engine, device)
    losses.append(step_loss(role.fit(exp, step=plan["steps"] + 1)))  # training goes on from the reloaded states
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


def offload_round_trip(engine: Any, device: str) -> dict[str, Any]:
    """What ``placement.offload_states_during_rollout`` does around every rollout: the training states of a ZeRO-3
    engine with torch's AdamW to host memory and back. They must come back bit for bit, and on a GPU leave it
    (allocated bytes fall by at least half of the master weights and moments)."""
    from rlhf_core.distributed.strategy import offload_training_states

    before = training_states(engine)
    state_bytes = sum(t.numel() * t.element_size() for t in before)
    sync(device)
    resident = torch.cuda.memory_allocated() if device == "cuda" else 0
    offload_training_states(engine, pin_memory=device == "cuda")
    sync(device)
    freed = resident - torch.cuda.memory_allocated() if device == "cuda" else None
    engine.reload_states()
    same = all(torch.equal(a, b) for a, b in zip(before, training_states(engine), strict=True))
    left = freed is None or freed >= state_bytes // 2
    return {
        "offload_state_bytes": state_bytes,
        "offload_freed_bytes": freed,
        "offload_round_trip_ok": bool(same and left and before),
    }


def _train(c: Ctx, role_name: str) -> dict:
    role_cls = make_roles(MODEL_SPECS[c.plan["model"]])[0 if role_name == "actor" else 1]
    return check_train(role_name, role_cls, c.plan, c.device, c.work, c.threads)


def run_actor(c: Ctx) -> None:
    run_check("train_actor", _train, c, "actor")


def run_critic(c: Ctx) -> None:
    run_check("train_critic", _train, c, "critic")
