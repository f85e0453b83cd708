"""The reward role: a frozen reward model scoring whole sequences at their last token (raw scores; the driver
normalises them with the mean/std the reward-model stage stored)."""

from __future__ import annotations

import os

import torch

from rlhf_core.algos.experience import SequenceBatch
from rlhf_core.models.builders import ScalarHeadModel, attn_implementation, build_scalar_model, load_tokenizer


class RewardScorer:
    def __init__(
        self, model_path: str, micro_batch_size: int, precision: str, *, tokenizer_path: str | None = None,
        init_seed: int = 0, trust_remote_code: bool = False,
    ):  # fmt: skip
        device = os.environ.get("RLHF_DEVICE", "cpu")
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        self.tokenizer = load_tokenizer(model_path, tokenizer_path, trust_remote_code=trust_remote_code)
        hf = build_scalar_model(
            model_path, self.tokenizer, seed=init_seed, dtype=dtype, attn=attn_implementation("auto", device),
            trust_remote_code=trust_remote_code,
        )  # fmt: skip
        self.model = ScalarHeadModel(hf).to(device).eval()
        self.micro, self.device = micro_batch_size, device

    @torch.no_grad()
    def scores(self, batch: SequenceBatch) -> torch.Tensor:
        """(N,) reward of each sequence."""
        out = []
        for micro in batch.split(self.micro):
            ids, mask = micro.input_ids.to(self.device), micro.attention_mask.to(self.device)
            out.append(ScalarHeadModel.last_values(self.model(ids, mask), mask).float().cpu())
        return torch.cat(out)
