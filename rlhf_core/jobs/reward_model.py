"""Reward-model stage: a scalar head on the last non-pad token, trained with the pairwise Bradley-Terry loss.

After training it scores the held-out pairs: accuracy (chosen scored above rejected) and the mean and std of all
held-out rewards, stored in the model's config as ``reward_mean`` / ``reward_std`` for reward normalisation in PPO.
Reads ``reward_model.model.name_or_path`` (usually ``stage:sft``) and preference data; writes
``<run_uri>/reward_model/`` (Hugging Face sequence-classification directory, ``num_labels=1``).

    python -m rlhf_core.jobs.reward_model --config deployments/configs/tiny.yaml
"""

from __future__ import annotations

import shutil

import torch

from rlhf_core.algos.losses import pairwise_reward_loss
from rlhf_core.config import PipelineConfig
from rlhf_core.data.examples import pad_right, preference_examples
from rlhf_core.distributed import launcher
from rlhf_core.distributed.trainer import StageContext, SupervisedTrainer
from rlhf_core.jobs import common
from rlhf_core.models.builders import ScalarHeadModel, build_scalar_model, load_tokenizer
from rlhf_core.models.forward import scalar_values
from rlhf_core.types import CheckpointRef

KIND = "reward_model"


class RewardModelImpl:
    def __init__(self, margin: float, packing: bool = True):
        self.packing = packing  # <stage>.strategy.packing: padding removed inside the forward
        self.margin = margin

    def build_model(self, ctx: StageContext, tokenizer, dtype: torch.dtype, attn: str) -> torch.nn.Module:
        hf = build_scalar_model(
            ctx.model_path,
            tokenizer,
            seed=ctx.init_seed,
            dtype=dtype,
            attn=attn,
            trust_remote_code=ctx.trust_remote_code,
        )
        return ScalarHeadModel(hf)

    def before_training(self, model, ctx: StageContext, strategy, examples: dict[str, list], pad_id: int) -> None:
        pass

    def collate(self, examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
        """Chosen rows first, then rejected rows, in one (2B, T) batch."""
        ids = [e["chosen_ids"] for e in examples] + [e["rejected_ids"] for e in examples]
        return {"input_ids": pad_right(ids, pad_id), "attention_mask": pad_right([[1] * len(x) for x in ids], 0)}

    def rewards(self, model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        values = scalar_values(model, batch["input_ids"], batch["attention_mask"], pack=self.packing)
        rewards = ScalarHeadModel.last_values(values, batch["attention_mask"])
        half = rewards.size(0) // 2
        return rewards[:half], rewards[half:]

    def loss(self, model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        chosen, rejected = self.rewards(model, batch)
        acc = (chosen > rejected).float().mean().item()
        return pairwise_reward_loss(chosen, rejected, self.margin), {"acc": acc}

    @torch.no_grad()
    def evaluate(self, model, batches) -> dict[str, float]:
        chosen, rejected = [], []
        for batch in batches:
            c, r = self.rewards(model, batch)
            chosen.append(c.float().cpu())
            rejected.append(r.float().cpu())
        c, r = torch.cat(chosen), torch.cat(rejected)
        everything = torch.cat([c, r])
        return {
            "eval_accuracy": (c > r).float().mean().item(),
            "eval_pairs": len(c),
            "reward_mean": everything.mean().item(),
            "reward_std": everything.std().item(),
        }

    def finalize(self, hf_model, metrics: dict[str, float]) -> None:
        hf_model.config.reward_mean = metrics["reward_mean"]
        hf_model.config.reward_std = metrics["reward_std"]


def run(cfg: PipelineConfig, stage: str = KIND) -> CheckpointRef:
    # 1. inputs: model, config hash, finished output
    st = common.setup_stage(cfg, stage)
    if st.done is not None:
        return st.done

    # 2. data, tokenized and checked before any worker starts
    section, options = st.section, st.store.fs.storage_options
    tokenizer = load_tokenizer(
        st.model_path, section.model.tokenizer, trust_remote_code=section.model.trust_remote_code
    )
    train = preference_examples(section.data, tokenizer, "train", options)
    held_out = preference_examples(section.data, tokenizer, "eval", options)
    common.check_steps(stage, section, len(train))

    # 3. train on the Ray group; rank 0 evaluates, stores reward stats in the config, exports and commits
    impl = RewardModelImpl(section.margin, section.strategy.packing)
    try:
        metrics = launcher.run_group(
            section.strategy, SupervisedTrainer, impl, st.context(), train, held_out, key=f"{stage}.strategy"
        )[0]
    finally:
        shutil.rmtree(st.work, ignore_errors=True)  # downloaded inputs and staging
    return CheckpointRef(st.store.uri(stage), stage, metrics["steps"], st.config_hash, metrics)


if __name__ == "__main__":
    common.main(KIND, run)
