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

from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from rlhf_core.algos.moe import aux_list, with_aux_loss
from rlhf_core.algos.preference import PreferenceStats, dpo_loss
from rlhf_core.config import DPOConfig, PipelineConfig
from rlhf_core.data.examples import preference_examples
from rlhf_core.distributed.checkpoints import StageContext
from rlhf_core.distributed.cluster import Cluster
from rlhf_core.distributed.node_files import ModelSource
from rlhf_core.jobs import process
from rlhf_core.jobs.preference import PreferenceTrainer, Sequence, run_stage, tensors
from rlhf_core.types import CheckpointRef

KIND = "dpo"


class DPOTrainer:
    """One rank of the DPO stage, hosted by a Ray worker: DPO's sequences, batches, loss and held-out metrics, which
    its ``trainer`` (the preference stages' step loop) trains, checkpoints, resumes, evaluates and exports with."""

    # where an example's reference log-probs go, in ``reference_sequences`` order
    REF_KEYS: ClassVar[tuple[str, ...]] = ("ref_chosen", "ref_rejected")

    @staticmethod
    def reference_sequences(e: dict) -> list[Sequence]:
        """The chosen and the rejected sequence, each with its prompt length."""
        return [(e["chosen_ids"], e["chosen_prompt_len"]), (e["rejected_ids"], e["rejected_prompt_len"])]

    def __init__(
        self,
        ctx: StageContext,
        train_examples: list[dict],
        eval_examples: list[dict],
        p: DPOConfig,
        reference: ModelSource | None = None,
    ):
        self.p = p
        self.trainer = PreferenceTrainer(self, ctx, train_examples, eval_examples, p, reference)

    def fit(self) -> dict:
        return self.trainer.fit()

    def collate(self, examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
        """Chosen rows first, then rejected rows, in one (2B, T) batch."""
        return tensors(examples, pad_id, self.reference_sequences, self.REF_KEYS)

    def stats(
        self, model: Any, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, PreferenceStats, torch.Tensor | None]:
        """The loss (with the NLL term when ``nll_loss_coef`` is set), DPO's statistics and the NLL term."""
        p, coef = self.p, self.trainer.ctx.aux_loss_coef
        aux = aux_list(coef)
        logps, tokens = self.trainer.logps(model, batch, aux)
        ref = self.trainer.ref_logps(batch)
        half = logps.size(0) // 2
        stats = dpo_loss(logps[:half], logps[half:], ref[:half], ref[half:], p.beta, p.loss_type, p.label_smoothing)
        loss = stats.loss
        nll = None
        if p.nll_loss_coef:  # mean NLL per chosen response token
            mask = batch["loss_mask"][:half, 1:].to(tokens.dtype)
            nll = -(tokens[:half] * mask).sum() / mask.sum().clamp(min=1)
            loss = loss + p.nll_loss_coef * nll
        loss, self.aux_stats = with_aux_loss(loss, aux, coef)
        return loss, stats, nll

    def loss(self, model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        loss, stats, nll = self.stats(model, batch)
        out = {
            "acc": stats.accuracy.item(),
            "margin": stats.margin.item(),
            "chosen_reward": stats.chosen_rewards.mean().item(),
            "rejected_reward": stats.rejected_rewards.mean().item(),
        }
        if nll is not None:
            out["nll"] = nll.item()
        return loss, {**out, **self.aux_stats}

    @torch.no_grad()
    def evaluate(self, model: Any, batches: Iterable[dict[str, torch.Tensor]]) -> dict[str, float]:
        losses, chosen, rejected = [], [], []
        for batch in batches:
            loss, stats, _ = self.stats(model, batch)
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


def run(cfg: PipelineConfig, stage: str = KIND, cluster: Cluster | None = None) -> CheckpointRef:
    """The stage on ``cluster`` (default: Ray)."""
    return run_stage(cfg, stage, cluster, DPOTrainer, preference_examples)


if __name__ == "__main__":
    process.main(KIND, run)
