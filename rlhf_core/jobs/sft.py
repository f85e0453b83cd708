"""SFT stage: next-token loss on the response tokens only, DeepSpeed ZeRO on a Ray group.

Reads the base model (``sft.model.name_or_path``) and instruction data; writes ``<run_uri>/sft/``, a Hugging Face
directory (safetensors, config, tokenizer) committed by ``manifest.json``, and ``<run_uri>/sft/metrics.json``.

    python -m rlhf_core.jobs.sft --config deployments/configs/tiny.yaml
    python -m rlhf_core.jobs.sft --config deployments/configs/tiny.yaml sft.strategy.zero_stage=3 sft.train.max_steps=4
"""

from __future__ import annotations

import shutil

import torch

from rlhf_core.algos.losses import sft_loss
from rlhf_core.config import PipelineConfig
from rlhf_core.data.examples import pad_right, sft_examples
from rlhf_core.distributed import launcher
from rlhf_core.distributed.trainer import StageContext, SupervisedTrainer
from rlhf_core.jobs import common
from rlhf_core.models.builders import build_causal_lm, load_tokenizer
from rlhf_core.models.forward import causal_lm_logprobs
from rlhf_core.types import CheckpointRef

KIND = "sft"


class SFTImpl:
    def __init__(self, packing: bool = True):
        self.packing = packing  # <stage>.strategy.packing: padding removed inside the forward

    def build_model(self, ctx: StageContext, tokenizer, dtype: torch.dtype, attn: str) -> torch.nn.Module:
        return build_causal_lm(
            ctx.model_path,
            tokenizer,
            seed=ctx.init_seed,
            dtype=dtype,
            attn=attn,
            trust_remote_code=ctx.trust_remote_code,
        )

    def before_training(self, model, ctx: StageContext, strategy, examples: dict[str, list], pad_id: int) -> None:
        pass

    def collate(self, examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
        ids = [e["input_ids"] for e in examples]
        return {
            "input_ids": pad_right(ids, pad_id),
            "attention_mask": pad_right([[1] * len(x) for x in ids], 0),
            "loss_mask": pad_right([e["loss_mask"] for e in examples], 0),
        }

    def loss(self, model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        ids, mask, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        logprobs = causal_lm_logprobs(model, ids, mask, loss_mask[:, 1:], pack=self.packing)
        return sft_loss(logprobs, loss_mask), {}

    @torch.no_grad()
    def evaluate(self, model, batches) -> dict[str, float]:
        total, count = 0.0, 0
        for batch in batches:
            loss, _ = self.loss(model, batch)
            rows = batch["input_ids"].shape[0]
            total, count = total + loss.item() * rows, count + rows
        return {"eval_loss": total / count}

    def finalize(self, hf_model, metrics: dict[str, float]) -> None:
        pass


def run(cfg: PipelineConfig, stage: str = KIND) -> CheckpointRef:
    # 1. inputs: model, config hash, finished output
    st = common.setup_stage(cfg, stage)
    if st.done is not None:
        return st.done

    # 2. data, tokenized and checked here so that bad rows fail before any worker starts
    section, options = st.section, st.store.fs.storage_options
    tokenizer = load_tokenizer(
        st.model_path, section.model.tokenizer, trust_remote_code=section.model.trust_remote_code
    )
    train = sft_examples(section.data, tokenizer, "train", options)
    held_out = sft_examples(section.data, tokenizer, "eval", options) if section.data.eval_path else []
    common.check_steps(stage, section, len(train))

    # 3. train on the Ray group; rank 0 exports and commits
    impl = SFTImpl(section.strategy.packing)
    try:
        metrics = launcher.run_group(
            section.strategy, SupervisedTrainer, impl, st.context(), train, held_out, key=f"{stage}.strategy"
        )[0]
    finally:
        shutil.rmtree(st.work, ignore_errors=True)  # downloaded inputs and staging
    return CheckpointRef(st.store.uri(stage), stage, metrics["steps"], st.config_hash, metrics)


if __name__ == "__main__":
    common.main(KIND, run)
