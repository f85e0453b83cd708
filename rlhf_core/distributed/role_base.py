"""What the trained PPO roles (actor, critic) share: DeepSpeed set-up, batched forwards, the PPO-epoch loop,
checkpoint shards and export. Each role file adds its model and its loss."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from rlhf_core.algos.batching import select_rows, split_batch
from rlhf_core.config import OptimConfig, PPOAlgoConfig, StrategyConfig, TrainConfig
from rlhf_core.distributed.strategy import DeepSpeedStrategy
from rlhf_core.distributed.trainer import export_hf, load_engine_shards, save_engine_shards
from rlhf_core.models.builders import attn_implementation, load_tokenizer
from rlhf_core.storage import ObjectStore


@dataclass
class RoleContext:
    """Plain data a role needs on its ranks, resolved by the PPO driver."""

    stage: str
    role: str
    model_path: str
    tokenizer_path: str | None
    init_seed: int
    strategy: StrategyConfig
    optim: OptimConfig
    batch: TrainConfig  # train_batch_size / micro_train_batch_size of the role's optimizer steps
    micro_rollout_batch_size: int
    total_optimizer_steps: int
    algo: PPOAlgoConfig
    seed: int
    run_uri: str
    storage_options: dict
    work_dir: str


class TrainableRole:
    """One rank of a DeepSpeed-trained role. Subclasses implement ``build_model``."""

    def __init__(self, ctx: RoleContext):
        self.ctx = ctx

    def build_model(self, tokenizer: Any, dtype: torch.dtype, attn: str) -> nn.Module:
        raise NotImplementedError

    def setup(self) -> int:
        ctx = self.ctx
        self.strategy = DeepSpeedStrategy(ctx.strategy, ctx.optim, ctx.batch)
        self.strategy.init_distributed()
        torch.manual_seed(ctx.seed)
        self.store = ObjectStore(ctx.run_uri, ctx.storage_options)
        self.work = Path(ctx.work_dir) / f"{ctx.role}{self.strategy.rank}"
        self.tokenizer = load_tokenizer(ctx.model_path, ctx.tokenizer_path)
        attn = attn_implementation(ctx.strategy.attn_implementation, self.strategy.device)
        model = self.build_model(self.tokenizer, self.strategy.dtype, attn)
        self.engine = self.strategy.prepare(model, max(1, ctx.total_optimizer_steps))
        return self.strategy.rank

    @torch.no_grad()
    def forward_batches(self, batch: dict[str, torch.Tensor], fn: Callable[[Any, dict], torch.Tensor]) -> torch.Tensor:
        """``fn(engine, micro_batch)`` over micro-batches of the rollout batch size, concatenated (eval mode)."""
        self.engine.eval()
        outputs = [fn(self.engine, micro).float().cpu() for micro in split_batch(batch, self.ctx.micro_rollout_batch_size)]
        self.engine.train()
        return torch.cat(outputs)

    def train_epochs(
        self, batch: dict[str, torch.Tensor], step: int, loss_fn: Callable[[Any, dict], tuple[torch.Tensor, dict]]
    ) -> dict[str, float]:
        """PPO epochs over this rank's share of the rollout: shuffled micro-batches; DeepSpeed steps the optimizer
        every ``train_batch_size / (micro x world)`` micro-batches. Returns stats averaged over micro-batches and
        ranks."""
        n = next(iter(batch.values())).size(0)
        sums: dict[str, float] = {}
        count = 0
        for epoch in range(self.ctx.algo.ppo_epochs):
            gen = torch.Generator().manual_seed(self.ctx.seed * 7919 + step * 101 + epoch * 13 + self.strategy.rank)
            shuffled = select_rows(batch, torch.randperm(n, generator=gen))
            for micro in split_batch(shuffled, self.ctx.batch.micro_train_batch_size):
                loss, stats = loss_fn(self.engine, micro)
                self.engine.backward(loss)
                self.engine.step()
                for k, v in {"loss": loss.item(), **stats}.items():
                    sums[k] = sums.get(k, 0.0) + v
                count += 1
        return {k: self.strategy.all_reduce_mean(v / count) for k, v in sums.items()}

    # -- checkpoints and export ---------------------------------------------------------------------------------------
    def save_shards(self, rel: str) -> dict[str, dict]:
        """Collective: this role's DeepSpeed shards under ``rel/<role>/``; returns all ranks' file entries."""
        return save_engine_shards(
            self.strategy, self.engine, self.store, rel, self.work / "ckpt", client_state={}, sub=self.ctx.role
        )

    def load_shards(self, rel: str) -> None:
        load_engine_shards(self.strategy, self.engine, self.store, rel, self.work / "resume", sub=self.ctx.role)

    def export(self, rel: str, config_hash: str, metrics: dict, extra: dict) -> None:
        """Collective: gather the weights and (rank 0) commit a Hugging Face directory at ``rel``."""
        weights = self.strategy.full_state_dict(self.engine)
        if self.strategy.rank == 0:
            local = export_hf(self.engine.module, weights, self.tokenizer, self.work / "export")
            self.store.put_artifact(
                str(local), rel, stage=self.ctx.stage, config_hash=config_hash, metrics=metrics, extra=extra,
                clear=False,
            )  # fmt: skip
        self.strategy.barrier()

    def trainable_state(self) -> dict[str, torch.Tensor] | None:
        """Full weights on rank 0 (collective), for tests that compare before and after."""
        return self.strategy.full_state_dict(self.engine)
