"""The PPO roles as the training checks (``train_step``, ``ds_checkpoint``) run them: ``PolicyActor`` and
``CriticActor`` with their model built from a spec in ``common.MODEL_SPECS`` (no download), their ``RoleContext``
(ZeRO-3, gradient checkpointing, world size 1), a rollout-like batch from the role's own forward, and the engine's
training states as copies to compare."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from .common import MODEL_SPECS, model_config, n_params, peak_since, reset_peak


def matmul_params(model: torch.nn.Module) -> int:
    """The weights of the ``nn.Linear`` modules: what the 6 * N FLOPs per token count. An embedding is a lookup, not
    a matmul; a tied LM head multiplies by the embedding's weight, so it counts once, as a Linear. The critic has no
    LM head, only its one-output value head."""
    return sum(
        int(getattr(m.weight, "ds_numel", m.weight.numel())) for m in model.modules() if isinstance(m, torch.nn.Linear)
    )


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


def step_loss(stats: dict[str, float]) -> float:
    """The loss among a ``fit`` step's statistics (the actor's and the critic's are named differently)."""
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


def training_states(engine: Any) -> list[torch.Tensor]:
    """The ZeRO-3 engine's fp32 master partitions and Adam moments, as they are now (copies on the CPU)."""
    opt = engine.optimizer
    moments = [t for state in opt.optimizer.state.values() for k, t in state.items() if k in ("exp_avg", "exp_avg_sq")]
    return [t.detach().to("cpu", copy=True) for t in [*opt.fp32_partitioned_groups_flat, *moments]]
