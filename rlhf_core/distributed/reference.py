"""The reference role: the frozen starting policy, giving the log-probs the KL penalty is measured against."""

from __future__ import annotations

import os

import torch

from rlhf_core.algos.batching import split_batch
from rlhf_core.algos.losses import token_logprobs
from rlhf_core.models.builders import attn_implementation, build_causal_lm, load_tokenizer


class ReferencePolicy:
    def __init__(self, model_path: str, micro_batch_size: int, precision: str, init_seed: int = 0):
        device = os.environ.get("RLHF_DEVICE", "cpu")
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        tokenizer = load_tokenizer(model_path)
        attn = attn_implementation("auto", device)
        self.model = build_causal_lm(model_path, tokenizer, seed=init_seed, dtype=dtype, attn=attn).to(device).eval()
        self.micro, self.device = micro_batch_size, device

    @torch.no_grad()
    def logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(N, T-1) log-probs under the reference policy."""
        out = []
        for micro in split_batch(batch, self.micro):
            ids, mask = micro["input_ids"].to(self.device), micro["attention_mask"].to(self.device)
            out.append(token_logprobs(self.model(input_ids=ids, attention_mask=mask).logits, ids).cpu())
        return torch.cat(out)
