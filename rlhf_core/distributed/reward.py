"""The reward role: a frozen reward model scoring whole sequences at their last token (raw scores; the driver
normalises them with the mean/std the reward-model stage stored).

With ``ppo.frozen.zero_stage`` 3 the reward workers hold one ZeRO-3 partitioned copy between them
(``FrozenStrategy``), ``ppo.frozen.offload`` keeping the partitions on the CPU; 0 gives each worker a full replica."""

from __future__ import annotations

import torch

from rlhf_core.algos.experience import SequenceBatch
from rlhf_core.distributed.node_files import local_model_path
from rlhf_core.distributed.strategy import FrozenStrategy
from rlhf_core.models.builders import ScalarHeadModel, attn_implementation, build_scalar_model, load_tokenizer
from rlhf_core.models.forward import scalar_values


class RewardScorer:
    def __init__(
        self,
        model_path: str,
        micro_batch_size: int,
        precision: str,
        *,
        tokenizer_path: str | None = None,
        init_seed: int = 0,
        trust_remote_code: bool = False,
        zero_stage: int = 0,
        offload: bool = False,
        packing: bool = True,
        attn: str = "auto",
    ):
        model_path = local_model_path(model_path)  # a StageModel: this node's copy
        self.strategy = FrozenStrategy(zero_stage, offload, precision, micro_batch_size)
        self.packing = packing
        self.tokenizer = load_tokenizer(model_path, tokenizer_path, trust_remote_code=trust_remote_code)
        attn = attn_implementation(attn, self.strategy.device.type)  # the trained role's kernel: same numbers
        self.model = self.strategy.build(
            lambda: ScalarHeadModel(
                build_scalar_model(
                    model_path,
                    self.tokenizer,
                    seed=init_seed,
                    dtype=self.strategy.dtype,
                    attn=attn,
                    trust_remote_code=trust_remote_code,
                )
            )
        )

    @torch.no_grad()
    def scores(self, batch: SequenceBatch) -> torch.Tensor:
        """(N,) reward of each sequence. Collective under ZeRO-3: every worker of the group calls it at once."""

        def fn(micro: SequenceBatch) -> torch.Tensor:
            values = scalar_values(self.model, micro.input_ids, micro.attention_mask, pack=self.packing)
            return ScalarHeadModel.last_values(values, micro.attention_mask)

        return self.strategy.map_micro(batch, fn)
