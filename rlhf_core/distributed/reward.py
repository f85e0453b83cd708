"""The reward role: a frozen reward model scoring whole sequences at their last token (raw scores; the driver
normalises them with the mean/std the reward-model stage stored)."""

from __future__ import annotations

import os

import torch

from rlhf_core.algos.batching import split_batch
from rlhf_core.models.builders import ScalarHeadModel, attn_implementation, build_scalar_model, load_tokenizer


class RewardScorer:
    def __init__(self, model_path: str, micro_batch_size: int, precision: str):
        device = os.environ.get("RLHF_DEVICE", "cpu")
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        tokenizer = load_tokenizer(model_path)
        hf = build_scalar_model(model_path, tokenizer, seed=0, dtype=dtype, attn=attn_implementation("auto", device))
        self.model = ScalarHeadModel(hf).to(device).eval()
        self.micro, self.device = micro_batch_size, device

    @torch.no_grad()
    def scores(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(N,) reward of each sequence."""
        out = []
        for micro in split_batch(batch, self.micro):
            ids, mask = micro["input_ids"].to(self.device), micro["attention_mask"].to(self.device)
            out.append(ScalarHeadModel.last_values(self.model(ids, mask), mask).float().cpu())
        return torch.cat(out)
