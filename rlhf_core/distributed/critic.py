"""The critic role: a value head on every token (initialised from the reward model), trained with the clipped
value loss at the critic's own, higher learning rate."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rlhf_core.algos.experience import Experience, SequenceBatch
from rlhf_core.algos.moe import aux_list, with_aux_loss
from rlhf_core.algos.ppo import normalize_scores, value_loss
from rlhf_core.distributed.role_base import TrainableRole, WindowNorm
from rlhf_core.models.builders import ScalarHeadModel, build_scalar_model
from rlhf_core.models.forward import scalar_values


def _values(
    model: Any,
    batch: SequenceBatch,
    reward_stats: tuple[float, float] | None,
    pack: bool,
    aux_loss: list | None = None,
) -> torch.Tensor:
    """(N, T-1): the value of the state after token t, aligned with the log-prob of token t+1. With reward
    normalisation on, (raw head - reward_mean) / reward_std, the scale of the normalised rewards (as OpenRLHF's
    critic does), in training and at rollout alike. ``aux_loss``: collects an MoE backbone's load-balancing loss."""
    values = scalar_values(model, batch.input_ids, batch.attention_mask, pack=pack, aux_loss=aux_loss)[:, :-1]
    return values if reward_stats is None else normalize_scores(values, *reward_stats)


class CriticActor(TrainableRole):
    """One rank of the critic group."""

    def build_model(self, tokenizer: Any, dtype: torch.dtype, attn: str) -> nn.Module:
        c = self.ctx
        hf = build_scalar_model(
            self.model_dir,
            tokenizer,
            seed=c.init_seed,
            dtype=dtype,
            attn=attn,
            trust_remote_code=c.trust_remote_code,
            lora=c.lora,
        )
        return ScalarHeadModel(hf)

    def values(self, batch: SequenceBatch) -> torch.Tensor:
        stats, pack = self.ctx.reward_stats, self.ctx.strategy.packing
        return self.forward_batches(batch, lambda model, micro: _values(model, micro, stats, pack))

    def fit(self, exp: Experience, step: int) -> dict[str, float]:
        assert exp.returns is not None and exp.values is not None, "the critic trains on values and returns"
        clip, stats, pack = self.ctx.algo.value_clip, self.ctx.reward_stats, self.ctx.strategy.packing

        def loss_fn(model: Any, micro: Experience, norm: WindowNorm) -> tuple[torch.Tensor, dict]:
            assert micro.values is not None and micro.returns is not None  # exp's rows (asserted above)
            aux = aux_list(self.ctx.aux_loss_coef)
            values = _values(model, micro, stats, pack, aux)
            loss, out = value_loss(
                values, micro.values, micro.returns, micro.action_mask, clip, num_tokens=norm.tokens
            )
            loss, extra = with_aux_loss(loss, aux, self.ctx.aux_loss_coef * norm.aux_scale)
            return loss, {**out, **extra}

        stats_out = self.train_epochs(exp, step, loss_fn)
        return {f"critic_{k}" if not k.startswith("value") else k: v for k, v in stats_out.items()}
