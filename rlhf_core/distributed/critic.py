"""The critic role: a value head on every token (initialised from the reward model), trained with the clipped
value loss at the critic's own, higher learning rate."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rlhf_core.algos.ppo import value_loss
from rlhf_core.distributed.role_base import TrainableRole
from rlhf_core.models.builders import ScalarHeadModel, build_scalar_model


def _values(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(N, T-1): the value of the state after token t, aligned with the log-prob of token t+1."""
    return model(batch["input_ids"], batch["attention_mask"])[:, :-1]


class CriticActor(TrainableRole):
    """One rank of the critic group."""

    def build_model(self, tokenizer: Any, dtype: torch.dtype, attn: str) -> nn.Module:
        hf = build_scalar_model(self.ctx.model_path, tokenizer, seed=self.ctx.init_seed, dtype=dtype, attn=attn)
        return ScalarHeadModel(hf)

    def values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.forward_batches(batch, _values)

    def fit(self, batch: dict[str, torch.Tensor], step: int) -> dict[str, float]:
        clip = self.ctx.algo.value_clip

        def loss_fn(model: Any, micro: dict) -> tuple[torch.Tensor, dict]:
            return value_loss(_values(model, micro), micro["old_values"], micro["returns"], micro["action_mask"], clip)

        stats = self.train_epochs(batch, step, loss_fn)
        return {f"critic_{k}" if not k.startswith("value") else k: v for k, v in stats.items()}
