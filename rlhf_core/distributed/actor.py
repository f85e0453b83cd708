"""The actor role: the policy, trained with DeepSpeed; old log-probs, the clipped PPO update, and the weight push
to the rollout engines (gathering ZeRO-3 partitions one parameter at a time)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from rlhf_core.algos.experience import Experience, SequenceBatch
from rlhf_core.algos.losses import token_logprobs
from rlhf_core.algos.ppo import distributed_masked_whiten, policy_loss
from rlhf_core.distributed.role_base import TrainableRole, logprob_temperature
from rlhf_core.models.builders import build_causal_lm


def _logprobs(model: Any, batch: SequenceBatch, temperature: float) -> torch.Tensor:
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return token_logprobs(logits, batch.input_ids, logprob_temperature(temperature))


class PolicyActor(TrainableRole):
    """One rank of the actor group. Its log-probs (old ones and in the loss) are those of the rollout distribution:
    logits divided by the rollout temperature."""

    def build_model(self, tokenizer: Any, dtype: torch.dtype, attn: str) -> nn.Module:
        c = self.ctx
        return build_causal_lm(
            c.model_path, tokenizer, seed=c.init_seed, dtype=dtype, attn=attn, trust_remote_code=c.trust_remote_code
        )

    def logprobs(self, batch: SequenceBatch, temperature: float | None = None) -> torch.Tensor:
        """(N, T-1) log-probs of this rank's shard under the current policy, at the rollout temperature (or at
        ``temperature``, e.g. 1.0 for the raw logits)."""
        t = self.ctx.temperature if temperature is None else temperature
        return self.forward_batches(batch, lambda model, micro: _logprobs(model, micro, t))

    def fit(self, exp: Experience, step: int) -> dict[str, float]:
        """PPO epochs on this rank's shard; advantages are whitened over the whole batch across all actor ranks."""
        assert exp.advantages is not None, "the actor trains on experience with advantages"
        if self.ctx.algo.whiten_advantages:
            exp = exp.with_advantages(
                distributed_masked_whiten(exp.advantages, exp.action_mask, self.strategy.all_reduce_sum), exp.returns
            )
        eps, temperature = self.ctx.algo.eps_clip, self.ctx.temperature

        def loss_fn(model: Any, micro: Experience, num_tokens: float) -> tuple[torch.Tensor, dict]:
            logp = _logprobs(model, micro, temperature)
            return policy_loss(
                logp, micro.old_logprobs, micro.advantages, micro.action_mask, eps, num_tokens=num_tokens
            )

        stats = self.train_epochs(exp, step, loss_fn)
        return {"policy_loss" if k == "loss" else k: v for k, v in stats.items()}

    # -- weight push to the rollout engines ---------------------------------------------------------------------------
    def connect_engines(self, engines: list[Any], use_collective: bool) -> None:
        """Rank 0 joins a weight-sync group with every engine worker (gloo on CPU); other ranks only help gather."""
        from rlhf_core.distributed.rollout_engine import connect_weight_sync

        self.engines = engines
        self.sender = None
        if self.strategy.rank == 0 and use_collective:
            self.sender = connect_weight_sync(engines)

    def _named_full_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        zero3 = self.ctx.strategy.zero_stage == 3
        for name, param in self.engine.module.named_parameters():
            if zero3:
                import deepspeed

                with deepspeed.zero.GatheredParameters([param]):
                    yield name, param.data.detach().clone()
            else:
                yield name, param.data.detach()

    def push_weights(self) -> float:
        """Collective over the actor ranks: send every parameter to the engines; returns the seconds (rank 0)."""
        from rlhf_core.distributed.rollout_engine import sync_weights
        from rlhf_core.distributed.weight_sync import spec_of

        named = self._named_full_params()
        if self.strategy.rank != 0:
            for _ in named:  # take part in each gather
                pass
            return 0.0
        specs = None
        if self.ctx.strategy.zero_stage == 3:
            specs = [
                spec_of(n, torch.empty(p.ds_shape, dtype=p.dtype)) for n, p in self.engine.module.named_parameters()
            ]
        return sync_weights(self.sender, self.engines, named, specs=specs)
