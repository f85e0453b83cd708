"""DPO stage: Direct Preference Optimization (and IPO, cDPO) of a policy on preference pairs, against a frozen
reference.

Reads ``dpo.model.name_or_path`` (usually ``stage:sft``) and the same preference data as the reward model (pairs,
chat messages or HH-RLHF transcripts); writes ``<run_uri>/<stage>/``, a Hugging Face causal-LM directory committed by
``manifest.json``, its ``metrics.json``, and (``ref_logprobs: precompute``) ``reference_logprobs/``.

Per pair, with s = the summed log-prob of the response tokens: logits = (s_pi(c) - s_pi(r)) - (s_ref(c) - s_ref(r));
DPO loss -log sigmoid(beta * logits) (cDPO mixes in label_smoothing of the flipped pair); IPO (logits - 1/(2 beta))^2.
Implicit rewards beta * (s_pi - s_ref): accuracy (chosen above rejected), margin, chosen and rejected rewards, and
held-out versions of each (``eval_*``).

    python -m rlhf_core.jobs.dpo --config deployments/configs/tiny-dpo.yaml dpo.beta=0.2
"""

from __future__ import annotations

import torch

from rlhf_core.algos.preference import dpo_loss
from rlhf_core.config import DPOConfig, PipelineConfig
from rlhf_core.data.examples import preference_examples
from rlhf_core.distributed.node_files import ModelSource
from rlhf_core.jobs import common
from rlhf_core.jobs.preference import PreferenceImpl, PreferenceKind, Sequence, response_logprobs, run_preference
from rlhf_core.types import CheckpointRef

KIND = "dpo"


class DPOImpl(PreferenceImpl):
    REF_KEYS = ("ref_chosen", "ref_rejected")

    @staticmethod
    def reference_sequences(e: dict) -> list[Sequence]:
        return [(e["chosen_ids"], e["chosen_prompt_len"]), (e["rejected_ids"], e["rejected_prompt_len"])]

    def __init__(self, p: DPOConfig, reference: ModelSource | None = None):
        super().__init__(p, reference)
        self.beta, self.loss_type, self.smoothing, self.nll_coef = (
            p.beta,
            p.loss_type,
            p.label_smoothing,
            p.nll_loss_coef,
        )

    def collate(self, examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
        """Chosen rows first, then rejected rows, in one (2B, T) batch."""
        return self.tensors(examples, pad_id)

    def _stats(self, model, batch: dict[str, torch.Tensor]):
        logps, tokens = response_logprobs(model, batch, self.packing)
        ref = self.reference_logps(batch)
        half = logps.size(0) // 2
        stats = dpo_loss(logps[:half], logps[half:], ref[:half], ref[half:], self.beta, self.loss_type, self.smoothing)
        loss = stats.loss
        nll = None
        if self.nll_coef:  # mean NLL per chosen response token
            mask = batch["loss_mask"][:half, 1:].to(tokens.dtype)
            nll = -(tokens[:half] * mask).sum() / mask.sum().clamp(min=1)
            loss = loss + self.nll_coef * nll
        return loss, stats, nll

    def loss(self, model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        loss, stats, nll = self._stats(model, batch)
        out = {
            "acc": stats.accuracy.item(),
            "margin": stats.margin.item(),
            "chosen_reward": stats.chosen_rewards.mean().item(),
            "rejected_reward": stats.rejected_rewards.mean().item(),
        }
        if nll is not None:
            out["nll"] = nll.item()
        return loss, out

    @torch.no_grad()
    def evaluate(self, model, batches) -> dict[str, float]:
        losses, chosen, rejected = [], [], []
        for batch in batches:
            loss, stats, _ = self._stats(model, batch)
            losses.append(loss.item() * stats.chosen_rewards.numel())
            chosen.append(stats.chosen_rewards.float().cpu())
            rejected.append(stats.rejected_rewards.float().cpu())
        c, r = torch.cat(chosen), torch.cat(rejected)
        return {
            "eval_loss": sum(losses) / len(c),
            "eval_accuracy": (c > r).float().mean().item(),
            "eval_margin": (c - r).mean().item(),
            "eval_chosen_reward": c.mean().item(),
            "eval_rejected_reward": r.mean().item(),
            "eval_pairs": len(c),
        }


DPO = PreferenceKind(examples=preference_examples, impl=DPOImpl)


def run(cfg: PipelineConfig, stage: str = KIND) -> CheckpointRef:
    return run_preference(cfg, stage, DPO)


if __name__ == "__main__":
    common.main(KIND, run)
