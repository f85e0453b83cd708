"""What every check shares: the model shapes and the two plans (GPU, dry run), a model built from config on the
device, the device's memory statistics, and the records. ``emit`` prints a check's JSON line (in a worker, into the
driver's pipe) and keeps it for the summary; ``run_check`` turns a check's exception into a failed record, so that
one broken check does not hide the others."""

from __future__ import annotations

import gc
import json
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]

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


# -- models and the device ------------------------------------------------------------------------------------------
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


def free_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def n_params(model: torch.nn.Module) -> int:
    """Parameters (shared ones once), also when ZeRO-3 has partitioned them (``ds_numel`` is the full size)."""
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())


def flash_attn_available(device: str) -> str | None:
    """None when flash_attention_2 can run here, else why not."""
    if device != "cuda":
        return "flash_attention_2 needs CUDA"
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return "flash_attn is not installed"
    return None


# -- the records, and how a worker runs a check -----------------------------------------------------------------------
def emit(record: dict[str, Any]) -> dict[str, Any]:
    print(json.dumps(record), file=_RECORDS or sys.stdout, flush=True)
    RESULTS.append(record)
    return record


def send_records_to(stream: Any) -> None:
    """In a worker: ``emit`` writes to ``stream`` (the pipe the driver passed) instead of stdout."""
    global _RECORDS
    _RECORDS = stream


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


def wait_s(c: Ctx) -> float:
    """How long a check may wait for another process: until 5 s before its limit, so that it reports the wait's
    failure itself."""
    return max(5.0, c.deadline - time.monotonic() - 5)


def run_per_attention(kind: str, check: Callable[..., dict], c: Ctx) -> None:
    """``check`` (``check(impl, plan, device, precision)``) as the records ``<kind>_sdpa`` in the plan's precision,
    on the GPU also ``<kind>_sdpa_fp32`` (the exact reference: flash attention has no fp32), and
    ``<kind>_flash_attention_2`` in bf16, reported skipped where it cannot run."""
    run_check(f"{kind}_sdpa", check, "sdpa", c.plan, c.device, c.plan["precision"])
    if c.device == "cuda":
        run_check(f"{kind}_sdpa_fp32", check, "sdpa", c.plan, c.device, "fp32")
    why = flash_attn_available(c.device)
    if why is None:
        run_check(f"{kind}_flash_attention_2", check, "flash_attention_2", c.plan, c.device, "bf16")
    else:
        emit({"check": f"{kind}_flash_attention_2", "ok": None, "skipped": why})
