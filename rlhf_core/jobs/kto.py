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

import shutil
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from rlhf_core import events
from rlhf_core.algos.moe import aux_list, with_aux_loss
from rlhf_core.algos.preference import KTOStats, kl_reference_point, kto_loss
from rlhf_core.config import KTOConfig, PipelineConfig
from rlhf_core.data.examples import kto_examples
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
from rlhf_core.distributed.node_files import ModelSource
from rlhf_core.jobs import common
from rlhf_core.jobs.preference import (
    FrozenReference,
    Sequence,
    driver_reference,
    reference_logps,
    response_logprobs,
    score_on_ranks,
    tensors,
)
from rlhf_core.models.builders import attn_implementation, build_causal_lm, load_tokenizer
from rlhf_core.tracking import Tracker
from rlhf_core.types import CheckpointRef

KIND = "kto"


class KTOTrainer:
    """One rank of the KTO stage, hosted by a Ray worker: trains, checkpoints, resumes, evaluates and exports."""

    # where an example's reference log-probs go, in ``reference_sequences`` order
    REF_KEYS = ("ref_logp", "ref_kl_logp")

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
        self.ctx, self.train_examples, self.eval_examples = ctx, train_examples, eval_examples
        self.p, self.packing = p, p.strategy.packing  # packing: padding removed inside the forward
        # ref_logprobs: online: a frozen copy of the reference on every rank; precompute: numbers in the examples
        self.online = FrozenReference(reference, p.reference or p.model, self.packing) if reference else None
        self.build: tuple[torch.dtype, str] | None = None  # the policy's precision and attention, for the online copy

    def fit(self) -> dict:
        ctx, strategy, store, work = start_rank(self.ctx)
        self.ctx, t = ctx, ctx.train

        # 1. model and engine
        tokenizer = load_tokenizer(ctx.model_path, ctx.tokenizer_path, trust_remote_code=ctx.trust_remote_code)
        attn = attn_implementation(ctx.strategy.attn_implementation, strategy.device)
        with strategy.model_init():  # ZeRO-3: each rank materialises only its partition
            model = self.build_model(tokenizer, strategy.dtype, attn)
        n = len(self.train_examples)
        steps = total_steps(n, t.train_batch_size, t.max_epochs, t.max_steps)
        engine = strategy.prepare(model, steps)
        self.device = next(engine.module.parameters()).device
        pad_id = tokenizer.pad_token_id
        # the starting model's reference log-probs (precompute, not stored yet): scored here, before any step
        examples = {"train": self.train_examples, "eval": self.eval_examples}
        score_on_ranks(engine, ctx, strategy, self.p, examples, self.reference_sequences, self.REF_KEYS, pad_id)

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
            if strategy.rank == 0:
                export_stage(ctx, store, engine.module, weights, tokenizer, metrics, history, work / "export")
        strategy.barrier()
        shutil.rmtree(work, ignore_errors=True)
        return metrics

    def build_model(self, tokenizer: Any, dtype: torch.dtype, attn: str) -> torch.nn.Module:
        ctx = self.ctx
        self.build = (dtype, attn)
        return build_causal_lm(
            ctx.model_path,
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
        """The examples' rows first, then their mismatched (KL) rows, in one (2B, T) batch."""
        batch = tensors(examples, pad_id, self.reference_sequences, self.REF_KEYS)
        batch["desirable"] = torch.tensor([bool(e["desirable"]) for e in examples])
        return batch

    def stats(self, model: Any, batch: dict[str, torch.Tensor]) -> KTOStats:
        p = self.p
        half = batch["desirable"].numel()
        rows = {k: v[:half] for k, v in batch.items() if k != "desirable"}
        mismatched = {k: v[half:] for k, v in batch.items() if k != "desirable"}
        aux = aux_list(self.ctx.aux_loss_coef)
        logps, _ = response_logprobs(model, rows, self.packing, aux)
        with torch.no_grad():  # the reference point is a constant of the loss: no graph for the mismatched rows
            kl_logps, _ = response_logprobs(model, mismatched, self.packing)
        kl = kl_reference_point(kl_logps, reference_logps(mismatched, self.online, self.build), clamp=False)
        if device.initialized():  # one reference point for the whole step, averaged over the ranks
            kl = device.all_reduce_sum(kl.detach().clone()) / dist.get_world_size()
        ref = reference_logps(rows, self.online, self.build)
        weights = p.desirable_weight, p.undesirable_weight
        stats = kto_loss(logps, ref, batch["desirable"], None, None, p.beta, *weights, kl=kl)
        loss, self.aux_stats = with_aux_loss(stats.loss, aux, self.ctx.aux_loss_coef)
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
    cluster = RayCluster() if cluster is None else cluster
    # 1. inputs: policy and reference, config hash, finished output
    p = cfg.stage(stage)
    st = common.setup_stage(cfg, stage, {"model": p.model, "reference": p.reference or p.model})
    if st.done is not None:
        return st.done
    p = st.section  # its stage: data paths resolved to the committed datasets

    # 2. data, tokenized and checked before any worker starts
    options = st.store.fs.storage_options
    tokenizer = load_tokenizer(st.model_path, p.model.tokenizer, trust_remote_code=p.model.trust_remote_code)
    train = kto_examples(p.data, tokenizer, "train", options)
    held_out = kto_examples(p.data, tokenizer, "eval", options) if p.data.eval_path else []
    common.check_steps(stage, p, len(train))

    # 3. reference log-probs (precomputed: once, stored with the stage; the starting model's are scored by the
    # training ranks before their first step), then training on the Ray group; rank 0 exports and commits
    try:
        if p.ref_logprobs == "precompute":
            splits = {"train": train, "eval": held_out}
            driver_reference(
                st, p, splits, KTOTrainer.reference_sequences, KTOTrainer.REF_KEYS, tokenizer.pad_token_id, cluster
            )
        reference = None if p.ref_logprobs == "precompute" else st.sources["reference"]
        metrics = cluster.run_group(
            p.strategy, KTOTrainer, st.context(), train, held_out, p, reference, key=f"{stage}.strategy"
        )[0]
    finally:
        shutil.rmtree(st.work, ignore_errors=True)  # downloaded inputs and staging
    return CheckpointRef(st.store.uri(stage), stage, metrics["steps"], st.config_hash, metrics)


if __name__ == "__main__":
    common.main(KIND, run)
