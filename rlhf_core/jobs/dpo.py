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

import shutil
import time
from collections.abc import Iterable
from typing import Any

import torch

from rlhf_core import events
from rlhf_core.algos.moe import aux_list, with_aux_loss
from rlhf_core.algos.preference import PreferenceStats, dpo_loss
from rlhf_core.config import DPOConfig, PipelineConfig
from rlhf_core.data.examples import preference_examples
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

KIND = "dpo"


class DPOTrainer:
    """One rank of the DPO stage, hosted by a Ray worker: trains, checkpoints, resumes, evaluates and exports."""

    # where an example's reference log-probs go, in ``reference_sequences`` order
    REF_KEYS = ("ref_chosen", "ref_rejected")

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
        """Chosen rows first, then rejected rows, in one (2B, T) batch."""
        return tensors(examples, pad_id, self.reference_sequences, self.REF_KEYS)

    def stats(
        self, model: Any, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, PreferenceStats, torch.Tensor | None]:
        """The loss (with the NLL term when ``nll_loss_coef`` is set), DPO's statistics and the NLL term."""
        p, aux = self.p, aux_list(self.ctx.aux_loss_coef)
        logps, tokens = response_logprobs(model, batch, self.packing, aux)
        ref = reference_logps(batch, self.online, self.build)
        half = logps.size(0) // 2
        stats = dpo_loss(logps[:half], logps[half:], ref[:half], ref[half:], p.beta, p.loss_type, p.label_smoothing)
        loss = stats.loss
        nll = None
        if p.nll_loss_coef:  # mean NLL per chosen response token
            mask = batch["loss_mask"][:half, 1:].to(tokens.dtype)
            nll = -(tokens[:half] * mask).sum() / mask.sum().clamp(min=1)
            loss = loss + p.nll_loss_coef * nll
        loss, self.aux_stats = with_aux_loss(loss, aux, self.ctx.aux_loss_coef)
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
    train = preference_examples(p.data, tokenizer, "train", options)
    held_out = preference_examples(p.data, tokenizer, "eval", options) if p.data.eval_path else []
    common.check_steps(stage, p, len(train))

    # 3. reference log-probs (precomputed: once, stored with the stage; the starting model's are scored by the
    # training ranks before their first step), then training on the Ray group; rank 0 exports and commits
    try:
        if p.ref_logprobs == "precompute":
            splits = {"train": train, "eval": held_out}
            driver_reference(
                st, p, splits, DPOTrainer.reference_sequences, DPOTrainer.REF_KEYS, tokenizer.pad_token_id, cluster
            )
        reference = None if p.ref_logprobs == "precompute" else st.sources["reference"]
        metrics = cluster.run_group(
            p.strategy, DPOTrainer, st.context(), train, held_out, p, reference, key=f"{stage}.strategy"
        )[0]
    finally:
        shutil.rmtree(st.work, ignore_errors=True)  # downloaded inputs and staging
    return CheckpointRef(st.store.uri(stage), stage, metrics["steps"], st.config_hash, metrics)


if __name__ == "__main__":
    common.main(KIND, run)
