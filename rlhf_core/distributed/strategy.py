"""DeepSpeed ZeRO training inside one Ray worker: process group, engine, checkpoints, full weights for export.

The batch arithmetic follows OpenRLHF: ``train_batch_size`` samples per optimizer step over all ranks,
``micro_train_batch_size`` per forward on a rank, so gradient accumulation = train / (micro x world size).
gloo joins the ranks on CPU and NCCL on GPU; optimizer offload uses DeepSpeedCPUAdam, otherwise torch AdamW.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlhf_core.config import OptimConfig, StrategyConfig, TrainConfig
from rlhf_core.distributed import device


class DeepSpeedStrategy:
    def __init__(self, cfg: StrategyConfig, optim: OptimConfig, train: TrainConfig):
        self.cfg, self.optim_cfg, self.train_cfg = cfg, optim, train
        self.device = device.current().type  # "cpu" or "cuda", chosen once by the driver (RLHF_DEVICE)
        self.rank, self.world_size = 0, 1

    # -- process group ------------------------------------------------------------------------------------------------
    def init_distributed(self) -> None:
        import deepspeed

        if self.device == "cuda":
            torch.cuda.set_device(device.current())
        if not dist.is_initialized():
            deepspeed.init_distributed(dist_backend="nccl" if self.device == "cuda" else "gloo")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.cfg.precision == "bf16" else torch.float32

    @property
    def accumulation_steps(self) -> int:
        return self.train_cfg.train_batch_size // (self.train_cfg.micro_train_batch_size * self.world_size)

    def ds_config(self) -> dict:
        zero: dict[str, Any] = {"stage": self.cfg.zero_stage}
        if self.cfg.offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": self.device == "cuda"}
        if self.cfg.zero_stage == 3:
            zero["stage3_gather_16bit_weights_on_model_save"] = True
        return {
            "train_batch_size": self.train_cfg.train_batch_size,
            "train_micro_batch_size_per_gpu": self.train_cfg.micro_train_batch_size,
            "gradient_accumulation_steps": self.accumulation_steps,
            "gradient_clipping": self.optim_cfg.max_norm,
            "zero_optimization": zero,
            "bf16": {"enabled": self.cfg.precision == "bf16"},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }

    # -- engine -------------------------------------------------------------------------------------------------------
    def prepare(self, model: nn.Module, total_steps: int) -> Any:
        """Wrap ``model`` in a DeepSpeed engine with AdamW and the configured LR schedule."""
        import deepspeed

        if self.cfg.gradient_checkpointing:
            hf = getattr(model, "hf_model", model)
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        o = self.optim_cfg
        params = [p for p in model.parameters() if p.requires_grad]
        kwargs = dict(lr=o.lr, betas=tuple(o.adam_betas), weight_decay=o.weight_decay)
        if self.cfg.offload_optimizer:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = DeepSpeedCPUAdam(params, adamw_mode=True, **kwargs)
        else:
            optimizer = torch.optim.AdamW(params, **kwargs)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(o, total_steps))
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self.ds_config()
        )
        return engine

    # -- collectives (device-aware: rlhf_core.distributed.device) -----------------------------------------------------
    def all_reduce_mean(self, value: float) -> float:
        return device.all_reduce_mean(value)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """In place: the element-wise sum over all ranks, issued on the process group's device (any input device)."""
        return device.all_reduce_sum(tensor)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return device.all_gather_object(obj)

    def broadcast_object(self, obj: Any) -> Any:
        return device.broadcast_object(obj)

    def barrier(self) -> None:
        device.barrier()

    # -- checkpoints --------------------------------------------------------------------------------------------------
    def save_checkpoint(self, engine: Any, local_dir: str, client_state: dict) -> None:
        """Every rank writes its ZeRO shards under ``local_dir/ds`` (rank 0 also the module and client state)."""
        engine.save_checkpoint(local_dir, tag="ds", client_state=client_state, save_latest=False)

    def load_checkpoint(self, engine: Any, local_dir: str) -> dict:
        _, client_state = engine.load_checkpoint(
            local_dir, tag="ds", load_optimizer_states=True, load_lr_scheduler_states=True
        )
        assert client_state is not None, f"no DeepSpeed checkpoint under {local_dir}/ds"
        return client_state

    def full_state_dict(self, engine: Any) -> dict[str, torch.Tensor] | None:
        """All weights gathered on rank 0 (None elsewhere); every rank must call it (ZeRO-3 gathers shards)."""
        if self.cfg.zero_stage == 3:
            state = engine._zero3_consolidated_16bit_state_dict()
        else:
            state = engine.module.state_dict()
        if self.rank != 0:
            return None
        return {k: v.detach().to("cpu").clone() for k, v in state.items()}


def lr_lambda(o: OptimConfig, total_steps: int):
    """LR multiplier per step: linear warm-up, then constant or cosine decay to ``min_lr_ratio``."""
    warmup = math.ceil(o.lr_warmup_ratio * total_steps)

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if o.lr_scheduler == "constant_with_warmup":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn
