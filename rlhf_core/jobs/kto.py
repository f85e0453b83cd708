"""KTO stage: Kahneman-Tversky Optimization (Ethayarajh et al., 2024) of a policy on desirable and undesirable
examples, against a frozen reference.

The examples are unpaired rows (``data.label_key``: a boolean per prompt/response) or come from preference pairs
(chosen desirable, rejected undesirable). With r = s_pi - s_ref (summed response log-probs) and the KL reference
point z = max(0, mean(s_pi - s_ref)) over mismatched prompt/response pairs (each prompt with another example's
response, as in the paper; averaged over the ranks), the loss of a desirable example is
``desirable_weight * (1 - sigmoid(beta * (r - z)))``, of an undesirable one
``undesirable_weight * (1 - sigmoid(beta * (z - r)))``. Writes ``<run_uri>/<stage>/`` like the DPO stage.

    python -m rlhf_core.jobs.kto --config deployments/configs/tiny-kto.yaml
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from rlhf_core.algos.moe import aux_list, with_aux_loss
from rlhf_core.algos.preference import KTOStats, kl_reference_point, kto_loss
from rlhf_core.config import KTOConfig, PipelineConfig
from rlhf_core.data.examples import kto_examples
from rlhf_core.distributed import device
from rlhf_core.distributed.checkpoints import StageContext
from rlhf_core.distributed.cluster import Cluster
from rlhf_core.distributed.node_files import ModelSource
from rlhf_core.jobs import process
from rlhf_core.jobs.preference import PreferenceTrainer, Sequence, run_stage, tensors
from rlhf_core.types import CheckpointRef

KIND = "kto"


class KTOTrainer:
    """One rank of the KTO stage, hosted by a Ray worker: KTO's sequences, batches, loss and held-out metrics, which
    its ``trainer`` (the preference stages' step loop) trains, checkpoints, resumes, evaluates and exports with."""

    # where an example's reference log-probs go, in ``reference_sequences`` order
    REF_KEYS: ClassVar[tuple[str, ...]] = ("ref_logp", "ref_kl_logp")

    @staticmethod
    def reference_sequences(e: dict) -> list[Sequence]:
        """The example's sequence and its mismatched (KL) one, each with its prompt length."""
        return [(e["input_ids"], e["prompt_len"]), (e["kl_ids"], e["kl_prompt_len"])]

    def __init__(
        self,
        ctx: StageContext,
        train_examples: list[dict],
        eval_examples: list[dict],
        p: KTOConfig,
        reference: ModelSource | None = None,
    ):
        self.p = p
        self.trainer = PreferenceTrainer(self, ctx, train_examples, eval_examples, p, reference)

    def fit(self) -> dict:
        return self.trainer.fit()

    def collate(self, examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
        """The examples' rows first, then their mismatched (KL) rows, in one (2B, T) batch."""
        batch = tensors(examples, pad_id, self.reference_sequences, self.REF_KEYS)
        batch["desirable"] = torch.tensor([bool(e["desirable"]) for e in examples])
        return batch

    def stats(self, model: Any, batch: dict[str, torch.Tensor]) -> KTOStats:
        p, coef = self.p, self.trainer.ctx.aux_loss_coef
        half = batch["desirable"].numel()
        rows = {k: v[:half] for k, v in batch.items() if k != "desirable"}
        mismatched = {k: v[half:] for k, v in batch.items() if k != "desirable"}
        aux = aux_list(coef)
        logps, _ = self.trainer.logps(model, rows, aux)
        with torch.no_grad():  # the reference point is a constant of the loss: no graph for the mismatched rows
            kl_logps, _ = self.trainer.logps(model, mismatched)
        kl = kl_reference_point(kl_logps, self.trainer.ref_logps(mismatched), clamp=False)
        if device.initialized():  # one reference point for the whole step, averaged over the ranks
            kl = device.all_reduce_sum(kl.detach().clone()) / dist.get_world_size()
        ref = self.trainer.ref_logps(rows)
        weights = p.desirable_weight, p.undesirable_weight
        stats = kto_loss(logps, ref, batch["desirable"], None, None, p.beta, *weights, kl=kl)
        loss, self.aux_stats = with_aux_loss(stats.loss, aux, coef)
        return stats._replace(loss=loss)

    def loss(self, model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        stats = self.stats(model, batch)
        good = batch["desirable"].to(stats.rewards.device)
        # the same keys on every rank and micro-batch (the loop all-reduces each): 0 for a side the batch lacks
        means = {"chosen_reward": 0.0, "rejected_reward": 0.0, "margin": 0.0, **reward_means(stats.rewards, good)}
        return stats.loss, {"kl": stats.kl.item(), **means, **self.aux_stats}

    @torch.no_grad()
    def evaluate(self, model: Any, batches: Iterable[dict[str, torch.Tensor]]) -> dict[str, float]:
        total, count, rewards, good, kls = 0.0, 0, [], [], []
        for batch in batches:
            stats = self.stats(model, batch)
            n = batch["desirable"].numel()
            total, count = total + stats.loss.item() * n, count + n
            rewards.append(stats.rewards.float().cpu())
            good.append(batch["desirable"].cpu())
            kls.append(stats.kl.item())
        means = reward_means(torch.cat(rewards), torch.cat(good))
        return {
            "eval_loss": total / count,
            "eval_kl": sum(kls) / len(kls),
            "eval_examples": count,
            **{f"eval_{k}": v for k, v in means.items()},
        }


def reward_means(rewards: torch.Tensor, good: torch.Tensor) -> dict[str, float]:
    """Mean implicit reward of the desirable and of the undesirable examples (those present) and their margin."""
    out = {}
    if good.any():
        out["chosen_reward"] = rewards[good].mean().item()
    if (~good).any():
        out["rejected_reward"] = rewards[~good].mean().item()
    if len(out) == 2:
        out["margin"] = out["chosen_reward"] - out["rejected_reward"]
    return out


def run(cfg: PipelineConfig, stage: str = KIND, cluster: Cluster | None = None) -> CheckpointRef:
    """The stage on ``cluster`` (default: Ray)."""
    return run_stage(cfg, stage, cluster, KTOTrainer, kto_examples)


if __name__ == "__main__":
    process.main(KIND, run)
