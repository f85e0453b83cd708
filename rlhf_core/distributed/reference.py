"""The reference role: the frozen starting policy, giving the log-probs the KL penalty is measured against (at the
rollout temperature, like the actor's, so that the KL compares the same distributions).

With ``ppo.frozen.zero_stage`` 3 the reference workers hold one ZeRO-3 partitioned copy between them
(``FrozenStrategy``), ``ppo.frozen.offload`` keeping the partitions on the CPU; 0 gives each worker a full replica."""

from __future__ import annotations

import torch

from rlhf_core.algos.experience import SequenceBatch
from rlhf_core.distributed.node_files import local_model_path
from rlhf_core.distributed.role_base import logprob_temperature
from rlhf_core.distributed.strategy import FrozenStrategy
from rlhf_core.models.builders import attn_implementation, build_causal_lm, load_tokenizer
from rlhf_core.models.forward import causal_lm_logprobs


class ReferencePolicy:
    def __init__(
        self,
        model_path: str,
        micro_batch_size: int,
        precision: str,
        init_seed: int = 0,
        *,
        temperature: float = 1.0,
        tokenizer_path: str | None = None,
        trust_remote_code: bool = False,
        zero_stage: int = 0,
        offload: bool = False,
        packing: bool = True,
        attn: str = "auto",
    ):
        model_path = local_model_path(model_path)  # a StageModel: this node's copy
        self.strategy = FrozenStrategy(zero_stage, offload, precision, micro_batch_size)
        tokenizer = load_tokenizer(model_path, tokenizer_path, trust_remote_code=trust_remote_code)
        attn = attn_implementation(attn, self.strategy.device.type)  # the trained role's kernel: same numbers
        self.model = self.strategy.build(
            lambda: build_causal_lm(
                model_path,
                tokenizer,
                seed=init_seed,
                dtype=self.strategy.dtype,
                attn=attn,
                trust_remote_code=trust_remote_code,
            )
        )
        self.temperature = logprob_temperature(temperature)
        self.packing = packing

    @torch.no_grad()
    def logprobs(self, batch: SequenceBatch) -> torch.Tensor:
        """(N, T-1) log-probs of the action tokens under the reference policy (0 elsewhere), logits divided by the
        rollout temperature. Collective under ZeRO-3: every worker of the group calls it (with its shard) at once."""

        def fn(micro: SequenceBatch) -> torch.Tensor:
            return causal_lm_logprobs(
                self.model,
                micro.input_ids,
                micro.attention_mask,
                micro.action_mask,
                temperature=self.temperature,
                pack=self.packing,
            )

        return self.strategy.map_micro(batch, fn)
