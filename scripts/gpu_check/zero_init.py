"""``zero_init``: the check's model constructed under ``deepspeed.zero.Init`` with the strategy's ZeRO-3 config:
torch.cuda.max_memory_allocated during construction against the full model's bytes and the per-rank shard (= the
full model at world size 1, so this shows that construction allocates no fp32 or second full copy; the 1/N shrink
needs several GPUs). On the dry run (CPU has no allocator statistics) it reports the partitions' bytes only."""

from __future__ import annotations

import time
from typing import Any

import torch

from .common import (
    MODEL_SPECS,
    Ctx,
    dtype_of,
    emit,
    free_memory,
    model_config,
    n_params,
    peak_since,
    reset_peak,
    run_check,
)


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
    free_memory(device)
    return emit(record)


def run(c: Ctx) -> None:
    run_check("zero_init", check_zero_init, c.plan, c.device)
