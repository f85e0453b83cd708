"""SFT stage: next-token loss on the response tokens only, DeepSpeed ZeRO on a Ray group.

Reads the base model (``sft.model.name_or_path``) and instruction data; writes ``<run_uri>/sft/``, a Hugging Face
directory (safetensors, config, tokenizer) committed by ``manifest.json``, and ``<run_uri>/sft/metrics.json``.

    python -m rlhf_core.jobs.sft --config deployments/configs/tiny.yaml
    python -m rlhf_core.jobs.sft --config deployments/configs/tiny.yaml sft.strategy.zero_stage=3 sft.train.max_steps=4
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterable
from typing import Any

import torch

from rlhf_core import events
from rlhf_core.algos.losses import sft_loss
from rlhf_core.algos.moe import aux_list, with_aux_loss
from rlhf_core.config import PipelineConfig
from rlhf_core.data.examples import pad_right, sft_examples
from rlhf_core.data.sampler import global_batch, rank_slice, total_steps
from rlhf_core.distributed import device
from rlhf_core.distributed.checkpoints import (
    StageContext,
    export_stage,
    fail_if_injected,
    log_rank0,
    resume,
    save_checkpoint,
    start_rank,
)
from rlhf_core.distributed.cluster import Cluster, RayCluster
from rlhf_core.jobs import input_checks, process, stage_setup
from rlhf_core.models.builders import attn_implementation, build_causal_lm, load_tokenizer
from rlhf_core.models.forward import causal_lm_logprobs
from rlhf_core.tracking import Tracker
from rlhf_core.types import CheckpointRef

KIND = "sft"


class SFTTrainer:
    """One rank of the SFT stage, hosted by a Ray worker: trains, checkpoints, resumes, evaluates and exports."""

    def __init__(self, ctx: StageContext, train_examples: list[dict], eval_examples: list[dict]):
        self.ctx, self.train_examples, self.eval_examples = ctx, train_examples, eval_examples
        self.packing = ctx.strategy.packing  # padding removed inside the forward

    def fit(self) -> dict:
        ctx, strategy, store, work = start_rank(self.ctx)
        self.ctx, t = ctx, ctx.train

        # 1. model and engine
        tokenizer = load_tokenizer(ctx.model_dir, ctx.tokenizer_path, trust_remote_code=ctx.trust_remote_code)
        attn = attn_implementation(ctx.strategy.attn_implementation, strategy.device)
        with strategy.model_init():  # ZeRO-3: each rank materialises only its partition
            model = self.build_model(tokenizer, strategy.dtype, attn)
        n = len(self.train_examples)
        steps = total_steps(n, t.train_batch_size, t.max_epochs, t.max_steps)
        engine = strategy.prepare(model, steps)
        self.device = next(engine.module.parameters()).device
        pad_id = tokenizer.pad_token_id

        # 2. resume from the newest complete checkpoint of this config
        state = resume(ctx, strategy, store, engine, work / "resume")
        resumed_from = state["step"]

        # 3. steps: step k consumes stream items [k*B, (k+1)*B), this rank its slice of them
        startup_s = None if ctx.job_started is None else time.time() - ctx.job_started
        if startup_s is not None:
            log_rank0(strategy, ctx.stage, f"first step {startup_s:.1f}s after the job started")
        history = []
        # rank 0's trackers (TensorBoard, MLflow, W&B), closed as failed when the stage raises
        with Tracker(ctx.tracking if strategy.rank == 0 else None) as tracker:
            for step in range(state["step"], steps):
                started = time.time()
                indices = rank_slice(
                    global_batch(n, t.train_batch_size, step, t.seed), strategy.rank, strategy.world_size
                )
                sums: dict[str, float] = {}
                for lo in range(0, len(indices), t.micro_train_batch_size):
                    micro = [self.train_examples[i] for i in indices[lo : lo + t.micro_train_batch_size]]
                    loss, metrics = self.loss(engine, self.batch(micro, pad_id))
                    engine.backward(loss)
                    engine.step()
                    for k, v in {"loss": loss.item(), **metrics}.items():
                        sums[k] = sums.get(k, 0.0) + v / strategy.accumulation_steps
                logs = {k: strategy.all_reduce_mean(v) for k, v in sums.items()}
                state["step"], state["consumed_samples"] = step + 1, (step + 1) * t.train_batch_size
                if state["first_loss"] is None:
                    state["first_loss"] = logs["loss"]
                history.append({"step": step + 1, **logs})
                if (step + 1) % t.log_steps == 0 or step + 1 == steps or step == 0:
                    lr = engine.get_lr()[0]
                    shown = " ".join(f"{k}={v:.4f}" for k, v in logs.items())
                    line = f"step {step + 1}/{steps} {shown} lr={lr:.2e} ({time.time() - started:.2f}s)"
                    log_rank0(strategy, ctx.stage, line)
                    if strategy.rank == 0:
                        events.step(ctx.stage, step + 1, steps, {**logs, "lr": lr})
                        tracker.log(step + 1, {**logs, "lr": lr})
                if t.save_steps and (step + 1) % t.save_steps == 0 and step + 1 < steps:
                    save_checkpoint(ctx, strategy, store, engine, work / "ckpt", state)
                    fail_if_injected(ctx.fail_after_step, step + 1)

            # 4. evaluate
            metrics = {
                "steps": steps,
                "train_samples": n,
                "resumed_from_step": resumed_from,
                "loss_start": state["first_loss"],
                "loss_end": history[-1]["loss"] if history else None,
            }
            if startup_s is not None:
                metrics["startup_s"] = startup_s  # job start -> first step (rank 0's clock)
            if self.eval_examples:
                chunks = range(0, len(self.eval_examples), t.eval_batch_size)
                batches = (self.batch(self.eval_examples[lo : lo + t.eval_batch_size], pad_id) for lo in chunks)
                metrics.update(self.evaluate(engine, batches))

            # 5. export in Hugging Face format, manifest last
            weights = strategy.full_state_dict(engine)
            if weights is not None:  # rank 0's: the weights gathered
                export_stage(ctx, store, engine.module, weights, tokenizer, metrics, history, work / "export")
        strategy.barrier()
        shutil.rmtree(work, ignore_errors=True)
        return metrics

    def build_model(self, tokenizer: Any, dtype: torch.dtype, attn: str) -> torch.nn.Module:
        ctx = self.ctx
        return build_causal_lm(
            ctx.model_dir,
            tokenizer,
            seed=ctx.init_seed,
            dtype=dtype,
            attn=attn,
            trust_remote_code=ctx.trust_remote_code,
            lora=ctx.lora,
        )

    def batch(self, examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
        """The collated micro-batch on this rank's device (the one path every training and eval batch takes)."""
        return device.to_device(self.collate(examples, pad_id), self.device)

    def collate(self, examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
        ids = [e["input_ids"] for e in examples]
        return {
            "input_ids": pad_right(ids, pad_id),
            "attention_mask": pad_right([[1] * len(x) for x in ids], 0),
            "loss_mask": pad_right([e["loss_mask"] for e in examples], 0),
        }

    def loss(self, model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        ids, mask, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        aux = aux_list(self.ctx.aux_loss_coef)
        logprobs = causal_lm_logprobs(model, ids, mask, loss_mask[:, 1:], pack=self.packing, aux_loss=aux)
        return with_aux_loss(sft_loss(logprobs, loss_mask), aux, self.ctx.aux_loss_coef)

    @torch.no_grad()
    def evaluate(self, model: Any, batches: Iterable[dict[str, torch.Tensor]]) -> dict[str, float]:
        total, count = 0.0, 0
        for batch in batches:
            loss, _ = self.loss(model, batch)
            rows = batch["input_ids"].shape[0]
            total, count = total + loss.item() * rows, count + rows
        return {"eval_loss": total / count}


def run(cfg: PipelineConfig, stage: str = KIND, cluster: Cluster | None = None) -> CheckpointRef:
    """The stage on ``cluster`` (default: Ray)."""
    cluster = RayCluster() if cluster is None else cluster
    # 1. inputs: model, config hash, finished output
    st = stage_setup.setup_stage(cfg, stage)
    if st.done is not None:
        return st.done

    # 2. data, tokenized and checked here so that bad rows fail before any worker starts
    section, options = st.section, st.store.fs.storage_options
    tokenizer = load_tokenizer(
        st.model_path, section.model.tokenizer, trust_remote_code=section.model.trust_remote_code
    )
    train = sft_examples(section.data, tokenizer, "train", options)
    held_out = sft_examples(section.data, tokenizer, "eval", options) if section.data.eval_path else []
    input_checks.check_steps(stage, section, len(train))

    # 3. train on the Ray group; rank 0 exports and commits
    try:
        metrics = cluster.run_group(
            section.strategy, SFTTrainer, st.context(), train, held_out, key=f"{stage}.strategy"
        )[0]
    finally:
        shutil.rmtree(st.work, ignore_errors=True)  # downloaded inputs and staging
    return CheckpointRef(st.store.uri(stage), stage, metrics["steps"], st.config_hash, metrics)


if __name__ == "__main__":
    process.main(KIND, run)
