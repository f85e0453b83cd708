"""The reference role: the frozen starting policy, giving the log-probs the KL penalty is measured against (at the
rollout temperature, like the actor's, so that the KL compares the same distributions)."""

from __future__ import annotations

import os

import torch

from rlhf_core.algos.experience import SequenceBatch
from rlhf_core.algos.losses import token_logprobs
from rlhf_core.distributed.role_base import logprob_temperature
from rlhf_core.models.builders import attn_implementation, build_causal_lm, load_tokenizer


class ReferencePolicy:
    def __init__(
        self, model_path: str, micro_batch_size: int, precision: str, init_seed: int = 0, *,
        temperature: float = 1.0, tokenizer_path: str | None = None, trust_remote_code: bool = False,
    ):  # fmt: skip
        device = os.environ.get("RLHF_DEVICE", "cpu")
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        tokenizer = load_tokenizer(model_path, tokenizer_path, trust_remote_code=trust_remote_code)
        attn = attn_implementation("auto", device)
        self.model = (
            build_causal_lm(
                model_path, tokenizer, seed=init_seed, dtype=dtype, attn=attn, trust_remote_code=trust_remote_code
            )
            .to(device)
            .eval()
        )
        self.micro, self.device = micro_batch_size, device
        self.temperature = logprob_temperature(temperature)

    @torch.no_grad()
    def logprobs(self, batch: SequenceBatch) -> torch.Tensor:
        """(N, T-1) log-probs under the reference policy, logits divided by the rollout temperature."""
        out = []
        for micro in batch.split(self.micro):
            ids, mask = micro.input_ids.to(self.device), micro.attention_mask.to(self.device)
            logits = self.model(input_ids=ids, attention_mask=mask).logits
            out.append(token_logprobs(logits, ids, self.temperature).cpu())
        return torch.cat(out)
