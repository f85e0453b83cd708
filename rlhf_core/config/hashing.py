"""A stage's config hash: what decides whether a finished stage or an in-stage checkpoint still fits its config."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from rlhf_core.config.redact import redact_url

# Fields that do not change what a stage computes: left out of its config hash so that, for example, keeping more
# checkpoints or moving the run does not invalidate a finished stage or its in-stage checkpoints.
# Placement and transport (where a role runs, how weights travel, what sleeps between phases) change no result either.
_NOT_HASHED = {
    "save_steps",
    "keep_last",
    "log_steps",
    "num_workers",
    "cpus_per_worker",
    "threads_per_worker",
    "resources",
    "weight_sync_backend",
    "weight_sync_bucket_mb",
    "enable_sleep",
    "offload_states_during_rollout",
    "gpu_memory_utilization",
    "kv_cache_gib",
    "enforce_eager",
    "offload",  # frozen.offload: where the frozen models' partitions live
    "sync_check_tolerance",  # a check of the finished stage: raising it lets a failed stage resume
}

# The PPO algo's later options at their defaults: PPO's token ratio, no off-policy correction.
_OFF_BY_DEFAULT: dict[str, Any] = {"policy_loss": "ppo", "is_correction": None, "is_correction_threshold": [0.5, 5.0]}
# train.dynamic_batch off, with its budget at the default: the hash a stage had before these keys existed.
_OFF_BY_DEFAULT.update({"dynamic_batch": False, "max_tokens_per_micro_batch": 16384})
# train.async_enable off, with its queue at the default (synchronous steps, as before the keys existed).
_OFF_BY_DEFAULT.update({"async_enable": False, "async_queue_size": 1, "partial_rollout_enable": False})
# algo.use_rollout_logprobs off, with its bound at the default (the actor's forward, as before the keys existed).
_OFF_BY_DEFAULT.update({"use_rollout_logprobs": False, "rollout_logprobs_max_diff": 0.1})
# No labels (data.label_key) and no held-out accuracy or pass@k: the hash a stage had before these keys existed.
_OFF_BY_DEFAULT.update({"label_key": None, "eval_greedy": False, "eval_pass_k": 0, "eval_reward_fn": None})
_OFF_BY_DEFAULT.update({"eval_correct_at": 1.0})
# No data.prompt_template: prompts rendered as before the key existed.
_OFF_BY_DEFAULT.update({"prompt_template": None})


def _off(key: str, value: Any) -> bool:
    """A section or key that is off as it is by default (LoRA with rank 0, no LoRA target_parameters, no MoE
    auxiliary loss, ``_OFF_BY_DEFAULT``): left out, so that adding it to the config keeps the hashes of the stages that
    do not use it."""
    if key == "aux_loss_coef":
        return value == 0
    if key == "target_parameters":  # lora: no parameter adapted directly
        return value == []
    if key in _OFF_BY_DEFAULT:
        return value == _OFF_BY_DEFAULT[key]
    return key == "lora" and isinstance(value, dict) and value.get("rank") == 0


def stage_hash(section: Any, upstream: dict[str, str] | None = None) -> str:
    """Hash of a stage's resolved section (minus bookkeeping fields) and its upstream artifacts' hashes."""

    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k not in _NOT_HASHED and not _off(k, v)}
        return node

    payload = {"stage": strip(dataclasses.asdict(section)), "upstream": upstream or {}}
    if payload["stage"].get("remote_rm_url"):  # a new token for the same server computes the same rewards
        payload["stage"]["remote_rm_url"] = redact_url(payload["stage"]["remote_rm_url"])
    code = getattr(section, "reward_fn", None)
    if code:  # the reward function makes the stage's output: editing its file must rerun the stage
        payload["code"] = code_fingerprint(code)
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def code_fingerprint(spec: str) -> str:
    """sha256 of the source file behind ``path.py:function`` or ``module:function`` ("" when it cannot be found:
    the job then refuses the spec, naming its key)."""
    import importlib.util

    where = spec.rpartition(":")[0]
    try:
        found = None if where.endswith(".py") else importlib.util.find_spec(where)
        origin = where if where.endswith(".py") else None if found is None else found.origin
    except (ImportError, ValueError, AttributeError):
        return ""
    path = Path(origin) if isinstance(origin, str) else None
    return hashlib.sha256(path.read_bytes()).hexdigest() if path is not None and path.is_file() else ""
